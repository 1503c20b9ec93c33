"""Plain data only: a checkpoint's configuration rebuilt from ``None``, ``bool``, ``int``,
``float``, ``str`` and lists, tuples, dicts and Namespaces of them, walked once (each container
visited once however often it is referred to, its size counted as often as it is referred to),
depth and size bounded, no string of it code when read as Python (:func:`_not_code`); the rest of
the state walked with the same bounds, every tensor
within its storage, numpy values only arrays and scalars of booleans and numbers (counted by
their elements; an unpickled array put in its place). Omegaconf containers are read from
their stored content, nothing resolved."""
import argparse
import ast
import collections
import re
from typing import Any, Dict, List, Tuple

import numpy as np
import torch

from .literals import EVALUATED_FIELDS, _SCALARS, _literal, _Refused
from .numpy_values import PendingArray
from .reading import UnsafeCheckpointError, _shown

LIMIT_DEPTH = 64  # nesting of containers
LIMIT_CONFIG_NODES = 200_000  # values in the configuration, counted as often as referred to
LIMIT_STATE_NODES = 20_000_000  # ... and in the rest of the state
LIMIT_AMPLIFICATION = 16  # bytes all tensors declare / bytes of their distinct storages

_NUMPY_KINDS = "biufc"  # booleans, signed and unsigned integers, floating-point and complex numbers


LIMIT_READ_AS_CODE = 1 << 20  # a string longer than this that may be an expression is refused unread
_EXPRESSION = re.compile(r"[(\[{*]")  # what an expression that calls or multiplies holds


def _not_code(text: str, path: str, walk: "_Walk") -> None:
    """A configuration string that, read as Python (as fairseq's ``eval()`` reads some fields of
    some families, and the fields a family evaluates are not all known here), calls anything, or
    builds a value beyond the literal bounds (``[0] * 10**9``), is refused whatever its field: a
    checkpoint's configuration is data. The fields known to be evaluated are read as literals where
    they are generated (:mod:`.literals`), with their own message."""
    if not _EXPRESSION.search(text) or path.rsplit(".", 1)[-1] in EVALUATED_FIELDS:
        return
    if len(text) > LIMIT_READ_AS_CODE:
        raise walk.refuse(path, f"a string of {len(text)} characters that may be a Python expression (a field "
                                "fairseq evaluates would run it)")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return  # not an expression: text
    nodes = list(ast.walk(tree))
    if any(isinstance(n, ast.Call) for n in nodes):
        raise walk.refuse(path, f"{_shown(text)}, read as Python (as fairseq evaluates some fields), calls a "
                                "function: code, not data")
    if any(isinstance(n, ast.BinOp) for n in nodes) and not any(isinstance(n, ast.Name) for n in nodes):
        try:
            _literal(text)  # a literal expression: within the bounds of an evaluated field's
        except _Refused as why:
            raise walk.refuse(path, f"{_shown(text)}, read as Python (as fairseq evaluates some fields): {why}")


def _omegaconf_classes():
    from omegaconf import DictConfig, ListConfig, nodes

    return DictConfig, ListConfig, nodes.AnyNode


class _Walk:
    """One walk over a state: every container visited once (memo by ``id``), cycles and
    excess refused. ``plain`` rebuilds the configuration; ``check`` bounds the rest."""

    def __init__(self, source: str):
        self.source = source
        self.memo: Dict[int, Tuple[Any, int]] = {}  # id -> (rebuilt value, expanded size)
        self.sizes: Dict[int, int] = {}  # id -> expanded size, outside the configuration
        self.keep: List[Any] = []  # the originals stay alive, so their ids stay theirs
        self.active: set = set()
        self.storages: Dict[Tuple[int, int], int] = {}
        self.tensor_bytes = 0
        self.swapped: Dict[int, Any] = {}  # id -> what replaces it outside the configuration
        self.dict_config, self.list_config, self.any_node = _omegaconf_classes()

    def refuse(self, path: str, why: str, config: bool = True) -> UnsafeCheckpointError:
        what = ("A checkpoint's configuration may only hold None, booleans, numbers, strings and "
                "lists/dicts of them" if config else "Outside its configuration a checkpoint holds tensors, "
                f"numeric numpy values and plain data, nested at most {LIMIT_DEPTH} deep")
        path = path if len(path) <= 160 else f"{path[:80]}...{path[-60:]}"
        return UnsafeCheckpointError(f"{self.source}: refused: {path}: {why}. {what}. Nothing in the checkpoint was run.")

    def _children(self, node, path: str):
        """``(kind, [(key, child)])`` of a container, or None for a leaf."""
        kind = type(node)
        if kind in (list, tuple):
            return kind, list(enumerate(node))
        if kind in (dict, collections.OrderedDict, collections.defaultdict):
            return dict, list(node.items())
        if kind is argparse.Namespace:
            return argparse.Namespace, list(vars(node).items())
        if kind is self.dict_config or kind is self.list_config:
            content = vars(node).get("_content")  # stored content, no interpolation resolved
            if content is None or isinstance(content, str):
                return "value", [(None, content)]
            if kind is self.dict_config and type(content) is dict:
                return dict, list(content.items())
            if kind is self.list_config and type(content) is list:
                return list, list(enumerate(content))
            raise self.refuse(path, f"an omegaconf container holding a {type(content).__name__}")
        if kind is self.any_node:
            return "value", [(None, vars(node).get("_val"))]
        return None

    def plain(self, node, path: str, depth: int = 0) -> Tuple[Any, int]:
        """(the plain value of ``node``, its size counted as often as referred to)."""
        kind = type(node)
        if kind in _SCALARS:
            if kind is str and "${" in node:
                raise self.refuse(path, f"{_shown(node)} holds an omegaconf interpolation ('${{'), "
                                        "which fairseq would resolve when the field is read")
            if kind is str:
                _not_code(node, path, self)
            return node, 1
        if depth > LIMIT_DEPTH:
            raise self.refuse(path, f"nested more than {LIMIT_DEPTH} deep")
        key = id(node)
        if key in self.memo:
            return self.memo[key]
        if key in self.active:
            raise self.refuse(path, "it contains itself (a cycle)")
        children = self._children(node, path)
        if children is None:
            kind = np.ndarray if kind is PendingArray else kind
            raise self.refuse(path, f"a {kind.__module__}.{kind.__qualname__} value"
                                    if kind.__module__ != "builtins" else f"a {kind.__name__} value")
        self.active.add(key)
        shape, items = children
        size, values = 1, []
        for name, child in items:
            if shape in (dict, argparse.Namespace):
                if type(name) not in (_SCALARS if shape is dict else (str,)) or (type(name) is str and "${" in name):
                    raise self.refuse(f"{path}[{_shown(name)}]", "a key that is not a plain name")
                child_path = f"{path}.{name}" if type(name) is str else f"{path}[{name!r}]"
            elif shape == "value":
                child_path = path
            else:
                child_path = f"{path}[{name}]"
            value, n = self.plain(child, child_path, depth + 1)
            size += n
            if size > LIMIT_CONFIG_NODES:
                raise self.refuse(path, f"it holds more than {LIMIT_CONFIG_NODES} values (counting "
                                        "every reference to a shared list or dict)")
            values.append((name, value))
        self.active.discard(key)
        if shape == "value":
            value = values[0][1]
        elif shape is dict:
            value = dict(values)
        elif shape is argparse.Namespace:
            value = argparse.Namespace(**{k: v for k, v in values})
        else:
            value = shape(v for _, v in values)
        self.memo[key] = (value, size)
        self.keep.append(node)
        return value, size

    def check(self, node, path: str, depth: int = 0) -> int:
        """Bound the part of the state that is not configuration; its size."""
        if torch.is_tensor(node):
            self.tensor(node, path)
            return 1
        if type(node) is PendingArray:
            if not hasattr(node, "value"):
                raise self.refuse(path, "a numpy array without its data", config=False)
            self.swapped[id(node)] = node.value
            self.keep.append(node)
            return self.numpy(node.value, path)
        if isinstance(node, (np.ndarray, np.generic)):
            return self.numpy(node, path)
        if type(node) in _SCALARS:
            return 1
        if depth > LIMIT_DEPTH:
            raise self.refuse(path, f"nested more than {LIMIT_DEPTH} deep", config=False)
        key = id(node)
        if key in self.sizes:
            return self.sizes[key]
        if key in self.active:
            raise self.refuse(path, "it contains itself (a cycle)", config=False)
        if type(node) in (self.dict_config, self.list_config, self.any_node):
            raise self.refuse(path, "an omegaconf container outside the configuration", config=False)
        children = self._children(node, path)
        if children is None:
            if isinstance(node, (torch.Size, torch.dtype, torch.device, torch.memory_format, bytes)):
                return 1
            raise self.refuse(path, f"a {type(node).__qualname__} value", config=False)
        self.active.add(key)
        size, replaced = 1, {}
        for name, child in children[1]:
            size += self.check(child, f"{path}[{name!r}]", depth + 1)
            if size > LIMIT_STATE_NODES:
                raise self.refuse(path, f"it holds more than {LIMIT_STATE_NODES} values (counting every "
                                        "reference to a shared container)", config=False)
            if id(child) in self.swapped:
                replaced[name] = self.swapped[id(child)]
        self.active.discard(key)
        if replaced:  # an unpickled array in its place (a tuple: a new tuple in the tuple's place)
            if type(node) is tuple:
                self.swapped[key] = tuple(replaced.get(i, v) for i, v in enumerate(node))
            elif type(node) is argparse.Namespace:
                vars(node).update(replaced)
            else:  # a dict or a list
                for name, value in replaced.items():
                    node[name] = value
        self.sizes[key] = size
        self.keep.append(node)
        return size

    def bounded(self, node, path: str) -> Any:
        """``node`` checked (:meth:`check`), with the arrays unpickled in it in their places."""
        self.check(node, path)
        return self.swapped.get(id(node), node)

    def numpy(self, value, path: str) -> int:
        """A numpy array or scalar of booleans or numbers (fairseq's ``--eval-bleu`` counts),
        its data stored in the file (a contiguous array); its size: its element count."""
        dtype = getattr(value, "dtype", None)
        if type(value) is not np.ndarray and not isinstance(value, np.generic) or not isinstance(dtype, np.dtype) \
                or dtype.kind not in _NUMPY_KINDS or dtype.fields is not None or dtype.subdtype is not None \
                or dtype.hasobject:
            raise self.refuse(path, f"a numpy {type(value).__name__} of dtype {dtype}: numpy values may only be "
                                    "arrays and scalars of booleans and numbers", config=False)
        if type(value) is not np.ndarray:
            return 1
        if value.size > LIMIT_STATE_NODES:
            raise self.refuse(path, f"a numpy array declaring {value.size} elements (shape {value.shape}), more "
                                    f"than {LIMIT_STATE_NODES}", config=False)
        if not (value.flags.c_contiguous or value.flags.f_contiguous):
            raise self.refuse(path, f"a numpy array declaring {value.nbytes} bytes (shape {value.shape}) as a "
                                    f"strided view (strides {value.strides}); numpy unpickles arrays with their "
                                    "data stored contiguously", config=False)
        root = value
        while isinstance(root.base, np.ndarray):
            root = root.base
        stored = len(root.base) if isinstance(root.base, bytes) else root.nbytes
        self.storages[(id(root.base if root.base is not None else root), stored)] = stored
        self.keep.append(root)
        self.tensor_bytes += value.nbytes
        return 1 + value.size

    def tensor(self, t: torch.Tensor, path: str) -> None:
        if t.layout is not torch.strided or t.is_quantized:
            raise self.refuse(path, f"a {t.layout} tensor{' (quantized)' if t.is_quantized else ''}; "
                                    "fairseq checkpoints hold dense tensors", config=False)
        if t.device.type != "cpu":  # (a meta tensor: a shape with no data, as large as it likes)
            raise self.refuse(path, f"a tensor on the {t.device.type} device, {tuple(t.shape)} {t.dtype} with no "
                                    "data in the file; a checkpoint's tensors hold their data, read onto the CPU",
                              config=False)
        storage = t.untyped_storage()
        available = storage.nbytes() - t.storage_offset() * t.element_size()
        declared = t.numel() * t.element_size()
        if declared > available:
            raise UnsafeCheckpointError(
                f"{self.source}: refused: tensor {path} declares {tuple(t.shape)} {t.dtype} "
                f"({declared} bytes) over {max(available, 0)} bytes of stored data (an expanded or "
                "overlapping view): copying or averaging it would allocate far more than the file "
                "holds. Nothing in the checkpoint was run.")
        self.storages[(storage.data_ptr(), storage.nbytes())] = storage.nbytes()
        self.tensor_bytes += declared


