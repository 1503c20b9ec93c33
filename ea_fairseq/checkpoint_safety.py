"""Load fairseq checkpoints without letting them run code.

A checkpoint is input. It is read once, by :func:`read_checkpoint`, and handed to fairseq
only after :func:`sanitize` has rebuilt it from what it may contain:

1. **Pickled objects.** torch's weights-only unpickler reads the file and is never switched
   off; the classes of a fairseq configuration (``argparse.Namespace``; omegaconf containers
   in older checkpoints) are allow-listed only while a checkpoint is read
   (:func:`checkpoint_globals_allowed`); records must be stored uncompressed, as torch
   writes them, so none outgrows the file. A file that is empty, truncated or not a torch
   checkpoint is reported as such (:class:`CorruptCheckpointError`), not as a refusal.
2. **Plain data only.** The configuration (``args`` and ``cfg``) is rebuilt from ``None``,
   ``bool``, ``int``, ``float``, ``str`` and lists, tuples, dicts and Namespaces of them,
   walked once: each container is visited once however often it is referred to, its size
   counted as often as it is referred to (so a configuration whose expansion is huge is
   refused after a linear walk), depth and size bounded. Anything else (``bytes``, an
   omegaconf node of another kind, ...) and any string holding an omegaconf interpolation
   (``${``) is refused with the field's path; ``cfg`` must be a dict of sections (omegaconf
   would parse a string as YAML). Omegaconf containers are read from their stored content,
   nothing resolved, and no omegaconf value is read while the file is unpickled
   (:func:`_no_interpolation_resolved`). The rest of the state (weights, optimizer state) is
   walked with the same bounds, and every tensor must fit in its storage (an expanded or
   stride-0 view declaring more elements than the file holds is refused).
3. **Families vouched for.** The model configuration must name an architecture of this
   plugin or of fairseq's ``TransformerModel``: what fairseq evaluates when it builds
   those is known. Every configuration string fairseq passes to ``eval()`` or
   ``ast.literal_eval()`` (:data:`EVALUATED_FIELDS`, in any section) must be a literal of the
   form fairseq expects, and is replaced by ``repr()`` of the parsed value: fairseq
   only ever evaluates text written here from a validated literal (its size counted through
   its nesting). The model configuration may not describe a model larger than its weights
   (:func:`_check_model_sizes`). Any other model family
   (fconv, LSTM, wav2vec, ...) is refused; ``EA_FAIRSEQ_TRUST_CHECKPOINTS=1`` loads a
   checkpoint one trusts with its configuration unchecked (:data:`TRUST_SWITCH`, logged).

:func:`install` (run when the plugin is imported) puts this in front of
``fairseq.checkpoint_utils.load_checkpoint_to_cpu``, the one function through which
fairseq's command-line tools, ``--restore-file``/``--finetune-from-model`` and the hub
(``from_pretrained``) read a checkpoint. :func:`load_checkpoint` does the same for the
plugin's own tools (checkpoint averaging, warm start).
"""
import argparse
import ast
import collections
import contextlib
import functools
import logging
import math
import os
import re
import typing
import zipfile
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

import torch

logger = logging.getLogger(__name__)

TRUST_SWITCH = "EA_FAIRSEQ_TRUST_CHECKPOINTS"


class CheckpointError(RuntimeError):
    """A checkpoint that does not load; nothing in it was run."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint refused for safety: it holds something other than plain data of the
    expected form, or a model family whose loading this plugin has not checked."""


class CorruptCheckpointError(CheckpointError):
    """A file that is empty, truncated, damaged or not a torch checkpoint at all."""


# -- 1. reading the file -----------------------------------------------------------------
def fairseq_checkpoint_globals() -> List[Any]:
    """The classes a fairseq checkpoint's configuration is made of.

    ``fairseq-train`` writes its options as an ``argparse.Namespace``; checkpoints written
    through hydra or by older fairseq keep omegaconf containers, whose node classes are
    listed too. None of them runs code when unpickled, and :func:`sanitize` reads their
    stored content without calling any of their methods.
    """
    from omegaconf import DictConfig, ListConfig, nodes
    from omegaconf.base import ContainerMetadata, Metadata

    return [argparse.Namespace, DictConfig, ListConfig, ContainerMetadata, Metadata, nodes.AnyNode,
            typing.Any, collections.defaultdict, dict, list, int, str, float, bool]  # builtins: omegaconf metadata


@contextlib.contextmanager
def checkpoint_globals_allowed() -> Iterator[None]:
    """Allow-list :func:`fairseq_checkpoint_globals` for weights-only loads in this block."""
    scoped = getattr(torch.serialization, "safe_globals", None)
    if scoped is not None:  # adds them to torch's (per-process) list, removes them on exit
        with scoped(fairseq_checkpoint_globals()):
            yield
        return
    add = getattr(torch.serialization, "add_safe_globals", None)
    if add is not None:
        # torch 2.4 has the allow-list but no context manager to scope it: there the
        # classes stay allow-listed for the process (torch < 2.4 has no allow-list).
        add(fairseq_checkpoint_globals())
    yield


def _corrupt(path: str, cause: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{path}: corrupt or not a checkpoint: {cause}")


class _InterpolationDuringLoad(Exception):
    pass


@contextlib.contextmanager
def _no_interpolation_resolved() -> Iterator[List[str]]:
    """While a file is unpickled, omegaconf resolves no interpolation: an allow-listed class
    called on an omegaconf container (``dict(DictConfig)``) would otherwise resolve its
    ``${...}`` (environment variables, exponential string chains) inside ``torch.load``,
    before the configuration is read. Yields the interpolations that were attempted."""
    from omegaconf.base import Container

    attempted: List[str] = []
    original = Container._maybe_resolve_interpolation

    def refuse(self, parent, key, value, *args, **kwargs):
        attempted.append(str(getattr(value, "_value", lambda: value)()))
        raise _InterpolationDuringLoad(attempted[-1])

    Container._maybe_resolve_interpolation = refuse
    try:
        yield attempted
    finally:
        Container._maybe_resolve_interpolation = original


def read_checkpoint(path: str, source: Optional[str] = None) -> Dict[str, Any]:
    """The state stored in the checkpoint file ``path``, read weights-only onto the CPU
    (``source``: the name used in messages). Not yet sanitized."""
    source = source or str(path)
    size = os.path.getsize(path)  # FileNotFoundError / IsADirectoryError as they are
    if size == 0:
        raise _corrupt(source, "the file is empty (0 bytes; a run that stopped while saving leaves one)")
    if zipfile.is_zipfile(path):
        try:
            with zipfile.ZipFile(path) as archive:
                packed = [i.filename for i in archive.infolist() if i.compress_type != zipfile.ZIP_STORED]
        except (zipfile.BadZipFile, OSError, ValueError) as err:
            raise _corrupt(source, f"a damaged zip archive ({err})") from err
        if packed:  # torch stores records uncompressed: a record can never outgrow the file
            raise UnsafeCheckpointError(
                f"{source}: refused: it holds compressed records ({packed[0]}, ...), which torch.save "
                "never writes; a compressed record could expand far beyond the file's size.")
    else:
        with open(path, "rb") as f:
            head = f.read(16)
        if head.startswith(b"PK"):
            raise _corrupt(source, "a zip archive without its central directory (truncated: the file "
                                   "was cut short or is still being written)")
        if not head.startswith(b"\x80"):  # torch's legacy format is a pickle (protocol 2)
            raise _corrupt(source, f"not a torch checkpoint (neither a zip archive nor a pickle; it begins "
                                   f"with {head!r})")
    with checkpoint_globals_allowed(), _no_interpolation_resolved() as resolved:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except (FileNotFoundError, IsADirectoryError, PermissionError):
            raise
        except Exception as err:
            if resolved:
                raise UnsafeCheckpointError(
                    f"{source}: refused: unpickling it reads the values of an omegaconf container "
                    f"({_shown(resolved[0])}, ...), which resolves their interpolations; a checkpoint "
                    "never does that (it calls an allow-listed class on a configuration while it is "
                    "unpickled). Nothing in the checkpoint was run.") from None
            raise _classify_load_error(source, err) from err
    if not isinstance(state, dict):
        raise _corrupt(source, f"it holds a {type(state).__name__}, not a fairseq checkpoint (a dict)")
    return state


def _classify_load_error(source: str, err: Exception) -> CheckpointError:
    text = str(err)
    found = re.search(r"GLOBAL ([\w.]+)", text)
    if found:  # the unpickler met a class it does not allow: a refusal, not damage
        return UnsafeCheckpointError(
            f"{source}: refused: the file holds an object of {found.group(1)}, which torch's "
            "weights-only loader does not unpickle (a checkpoint is read as tensors and a fairseq "
            "configuration only, so that loading it cannot run code). Nothing in it was run.")
    detail = re.search(r"WeightsUnpickler error:\s*(.*?)(?:\n\n|$)", text, re.S)
    cause = detail.group(1).strip() if detail else text.split(". This is an internal")[0].strip()
    cause = f"{type(err).__name__}: {cause}" if cause else type(err).__name__
    if isinstance(err, EOFError):
        cause = "the file ends early (EOFError)"
    return _corrupt(source, cause[:300])


# -- 2. plain data -----------------------------------------------------------------------
LIMIT_DEPTH = 64  # nesting of containers
LIMIT_CONFIG_NODES = 200_000  # values in the configuration, counted as often as referred to
LIMIT_STATE_NODES = 20_000_000  # ... and in the rest of the state
LIMIT_AMPLIFICATION = 16  # bytes all tensors declare / bytes of their distinct storages
LIMIT_CHARS = 10_000  # an evaluated string longer than this is refused unread
LIMIT_ITEMS = 100_000  # ... or one whose value would hold more items than this

_SCALARS = (type(None), bool, int, float, str)


class _Refused(Exception):
    pass


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
        self.dict_config, self.list_config, self.any_node = _omegaconf_classes()

    def refuse(self, path: str, why: str, config: bool = True) -> UnsafeCheckpointError:
        what = ("A checkpoint's configuration may only hold None, booleans, numbers, strings and "
                "lists/dicts of them" if config else "Outside its configuration a checkpoint holds tensors "
                "and plain data, nested at most {LIMIT_DEPTH} deep".format(LIMIT_DEPTH=LIMIT_DEPTH))
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
        size = 1
        for name, child in children[1]:
            size += self.check(child, f"{path}[{name!r}]", depth + 1)
            if size > LIMIT_STATE_NODES:
                raise self.refuse(path, f"it holds more than {LIMIT_STATE_NODES} values (counting every "
                                        "reference to a shared container)", config=False)
        self.active.discard(key)
        self.sizes[key] = size
        self.keep.append(node)
        return size

    def tensor(self, t: torch.Tensor, path: str) -> None:
        if t.layout is not torch.strided or t.is_quantized:
            raise self.refuse(path, f"a {t.layout} tensor{' (quantized)' if t.is_quantized else ''}; "
                                    "fairseq checkpoints hold dense tensors", config=False)
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


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 100 else text[:97] + "..."


# -- 3. families and the fields fairseq evaluates ----------------------------------------
def _is_int(x) -> bool:
    return type(x) is int


def _is_number(x) -> bool:
    return type(x) in (int, float) and math.isfinite(x)


class Form(typing.NamedTuple):
    """What fairseq does with a field, and which literal values are well-formed there."""

    use: str  # what fairseq does with it (for the error message)
    expected: str  # the form, in words
    check: typing.Callable[[Any], bool]
    example: str


def _ints(x) -> bool:
    return _is_int(x) or (type(x) in (list, tuple) and all(_is_int(i) for i in x))


def _numbers(x) -> bool:
    return _is_number(x) or (type(x) in (list, tuple) and all(_is_number(i) for i in x))


def _literal_data(x) -> bool:
    if type(x) in (list, tuple):
        return all(_literal_data(i) for i in x)
    if type(x) is dict:
        return all(_literal_data(k) and _literal_data(v) for k, v in x.items())
    return type(x) in _SCALARS and (type(x) is not float or math.isfinite(x))


_INTS = dict(expected="an integer or a list of integers", check=_ints, example="'[10000, 50000]'")
_NUMBERS = dict(expected="a number or a list of numbers", check=_numbers, example="'(0.9, 0.98)'")
_DICT = dict(expected="a dict literal", check=lambda x: type(x) is dict and _literal_data(x), example="'{}'")
_BOOL = dict(expected="True or False", check=lambda x: type(x) is bool, example="'True'")
_DATA = dict(expected="a Python literal", check=_literal_data, example="'[1, 2]'")

# field name -> Form: every configuration field that fairseq 0.12 passes to eval() (or
# ast.literal_eval()) when it builds a model of the families below, their optimizers, tasks
# and criterions, wherever the name occurs in ``args`` or ``cfg``
EVALUATED_FIELDS: Dict[str, Form] = {}
for _names, _use, _kind in (
    (("adaptive_softmax_cutoff", "adaptive_input_cutoff"), "utils.eval_str_list() when the decoder is built", _INTS),
    (("pipeline_balance", "pipeline_devices", "pipeline_encoder_balance", "pipeline_encoder_devices",
      "pipeline_decoder_balance", "pipeline_decoder_devices"),
     "utils.eval_str_list() when pipeline parallelism is set up", _INTS),
    (("xformers_att_config", "encoder_xformers_att_config", "decoder_xformers_att_config"),
     "utils.eval_str_dict() in MultiheadAttention", _DICT),
    (("optimizer_overrides",), "ast.literal_eval() when training resumes", _DICT),
    (("adam_betas", "adamax_betas", "lamb_betas", "adafactor_eps"), "eval() when the optimizer is built", _NUMBERS),
    (("left_pad_source", "left_pad_target"), "utils.eval_bool() in the multilingual tasks", _BOOL),
    (("wer_args",), "eval() in the CTC criterion", _DATA),
    (("feature_encoder_spec", "character_filters"), "eval() when the model's data or embedder is built", _DATA),
):
    for _name in _names:
        EVALUATED_FIELDS[_name] = Form(use=_use, **_kind)
del _names, _use, _kind, _name


def _literal(text: str) -> Any:
    """The value of ``text`` if it is a literal expression, else :class:`_Refused`.

    Literals as ``ast.literal_eval`` reads them, plus ``+`` and ``*`` between them, as in
    fairseq's own defaults (``"[(512, 3)] * 20"``), sizes bounded.
    """
    if len(text) > LIMIT_CHARS:
        raise _Refused(f"it is longer than {LIMIT_CHARS} characters")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        raise _Refused("it is not a Python literal")
    for node in ast.walk(tree):  # name the most telling construct first
        if isinstance(node, (ast.Call, ast.Attribute, ast.Lambda)):
            raise _Refused(f"it contains {_SYNTAX[type(node)]}: code, not a literal")
    try:
        return _value(tree.body)
    except RecursionError:
        raise _Refused("it is nested too deeply")


_SYNTAX = {ast.Call: "a function call", ast.Attribute: "an attribute access", ast.Name: "a name",
           ast.Lambda: "a lambda", ast.Subscript: "a subscript", ast.BoolOp: "'and'/'or'",
           ast.Compare: "a comparison", ast.JoinedStr: "an f-string", ast.Set: "a set"}


LIMIT_INT = 10 ** 18  # an integer an evaluated field may hold


def _value(node) -> Any:
    return _weighed(node)[0]


def _weighed(node) -> Tuple[Any, int]:
    """``(value, size)`` of a literal node; ``size`` counts every item the value holds,
    nested ones included and a string's characters, so ``[[0] * 10**5] * 10**5`` is refused
    before it is built."""
    if isinstance(node, ast.Constant) and type(node.value) in _SCALARS:
        value = node.value
        return value, _bounded(len(value) if type(value) is str else 1, value)
    if isinstance(node, (ast.List, ast.Tuple)):
        items = [_weighed(e) for e in node.elts]
        values = [v for v, _ in items]
        return (values if isinstance(node, ast.List) else tuple(values)), _bounded(1 + sum(w for _, w in items))
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise _Refused("it unpacks a dict with '**' (code, not a literal)")
        keys = [_weighed(k) for k in node.keys]
        if any(type(k) not in _SCALARS for k, _ in keys):
            raise _Refused("it has a key that is not a plain value")
        values = [_weighed(v) for v in node.values]
        return (dict(zip((k for k, _ in keys), (v for v, _ in values))),
                _bounded(1 + sum(w for _, w in keys) + sum(w for _, w in values)))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        operand, weight = _weighed(node.operand)
        if type(operand) in (int, float):
            return (-operand if isinstance(node.op, ast.USub) else operand), weight
        raise _Refused("it puts a sign before something that is not a number")
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        (left, wl), (right, wr) = _weighed(node.left), _weighed(node.right)
        if isinstance(node.op, ast.Mult) and (_is_int(left) != _is_int(right)):
            count, weight = (left, wr) if _is_int(left) else (right, wl)
            size = _bounded(max(count, 0) * weight)  # the sequence's size, repeated
        else:
            size = _bounded(wl + wr)
        try:
            value = left + right if isinstance(node.op, ast.Add) else left * right
        except TypeError:
            raise _Refused("it applies '+' or '*' to values that do not combine")
        return value, _bounded(size, value)
    what = _SYNTAX.get(type(node), f"'{type(node).__name__}' syntax")
    raise _Refused(f"it contains {what}: code, not a literal")


def _bounded(size: int, value: Any = None) -> int:
    if size > LIMIT_ITEMS:
        raise _Refused(f"its value would hold more than {LIMIT_ITEMS} items")
    if _is_int(value) and abs(value) > LIMIT_INT:
        raise _Refused(f"it holds an integer beyond {LIMIT_INT}")
    return size


def _evaluated_value(name: str, value: Any) -> Any:
    """What fairseq gets in evaluated field ``name``: a string becomes ``repr()`` of the
    literal it holds (checked against the field's form); other values must have the form."""
    form = EVALUATED_FIELDS[name]
    if value is None:
        return None
    if type(value) is str:
        parsed = _literal(value)
        if not form.check(parsed):
            raise _Refused(f"it is not {form.expected}")
        return repr(parsed)
    if not form.check(value):
        raise _Refused(f"it is not {form.expected}")
    return value


def _rewrite_evaluated(node, path: str, source: str) -> None:
    """Replace, in place, every evaluated field of the plain configuration ``node``."""
    if type(node) is argparse.Namespace:
        items, set_ = list(vars(node).items()), functools.partial(setattr, node)
    elif type(node) is dict:
        items, set_ = list(node.items()), node.__setitem__
    elif type(node) in (list, tuple):
        for i, item in enumerate(node):
            _rewrite_evaluated(item, f"{path}[{i}]", source)
        return
    else:
        return
    for name, value in items:
        here = f"{path}.{name}"
        if name in EVALUATED_FIELDS:
            try:
                set_(name, _evaluated_value(name, value))
            except _Refused as why:
                form = EVALUATED_FIELDS[name]
                raise UnsafeCheckpointError(
                    f"{source}: refused: {here} = {_shown(value)}: {why}. fairseq passes this field to "
                    f"{form.use}, so a checkpoint may only hold {form.expected} there (e.g. {form.example}). "
                    "Nothing in the checkpoint was run; if you wrote this checkpoint yourself, correct "
                    "that field (or re-save from a trusted run).") from None
        else:
            _rewrite_evaluated(value, here, source)


def vouched_model_class(name: str):
    """The model class of architecture (or model) ``name`` if this plugin vouches for its
    loading: the plugin's own models and fairseq's ``TransformerModel``; else None."""
    from fairseq.models import ARCH_MODEL_REGISTRY, MODEL_REGISTRY
    from fairseq.models.transformer import TransformerModel

    cls = ARCH_MODEL_REGISTRY.get(name) or MODEL_REGISTRY.get(name)
    if cls is None:
        return None
    if cls is TransformerModel or cls.__module__.split(".")[0] == __name__.split(".")[0]:
        return cls
    return None


def _model_sections(state: Mapping, source: str = "") -> List[Tuple[str, Any]]:
    """``(path, section)`` of the model configurations fairseq may build from."""
    sections = []
    if state.get("args") is not None:
        sections.append(("args", state["args"]))
    cfg = state.get("cfg")
    if cfg is not None:
        if type(cfg) is not dict:  # (a string would be parsed as YAML by OmegaConf.create)
            raise UnsafeCheckpointError(f"{source}: refused: cfg = {_shown(cfg)}: not a configuration "
                                        "(a dict of sections). Nothing in the checkpoint was run.")
        if cfg.get("model") is not None:
            sections.append(("cfg.model", cfg["model"]))
    for where, section in sections:
        if type(section) not in (dict, argparse.Namespace):
            raise UnsafeCheckpointError(f"{source}: refused: {where} = {_shown(section)}: not a model "
                                        "configuration (a Namespace or dict). Nothing in the checkpoint was run.")
    return sections


def _model_names(state: Mapping, source: str) -> List[Tuple[str, Any]]:
    """``(path, name)`` of every model name fairseq may build from (none: no model config)."""
    names = []
    for where, section in _model_sections(state, source):
        fields = vars(section) if type(section) is argparse.Namespace else section
        for field in ("_name", "arch"):
            if fields.get(field) is not None:
                names.append((f"{where}.{field}", fields[field]))
        if not any(fields.get(f) is not None for f in ("_name", "arch")):
            names.append((f"{where}.arch", None))
    return names


def _check_family(state: Mapping, source: str) -> None:
    for where, name in _model_names(state, source):
        if type(name) is str and vouched_model_class(name) is not None:
            continue
        raise UnsafeCheckpointError(
            f"{source}: refused: {where} = {_shown(name)}: ea_fairseq loads checkpoints of its own "
            "architectures and of fairseq's transformer (--arch transformer, transformer_iwslt_de_en, "
            "...) only; for other model families it has not checked which configuration fields fairseq "
            f"evaluates. Nothing in the checkpoint was run. To load a checkpoint you trust without "
            f"these checks, set {TRUST_SWITCH}=1.")


LIMIT_MODEL_SIZE = 1 << 16  # a dimension, head count or position limit beyond the weights'
_LAYERS = re.compile(r"(encoder|decoder)\.layers\.(\d+)\.")


def _check_model_sizes(state: Mapping, source: str) -> None:
    """The model configuration may not ask fairseq to build more than the weights describe:
    ``encoder_layers``/``decoder_layers`` at most the layers the weights hold, and every
    ``*_dim``, ``*_heads`` and ``*_positions`` at most the largest tensor dimension of the
    weights (or :data:`LIMIT_MODEL_SIZE`), so that a small file cannot make fairseq allocate
    a huge model before it compares the weights."""
    weights = state.get("model")
    if not isinstance(weights, Mapping):  # (an OrderedDict, as torch saves a state dict)
        return
    layers: Dict[str, set] = {"encoder": set(), "decoder": set()}
    largest = LIMIT_MODEL_SIZE
    for key, value in weights.items():
        found = _LAYERS.match(key) if type(key) is str else None
        if found:
            layers[found.group(1)].add(int(found.group(2)))
        if torch.is_tensor(value) and value.dim():
            largest = max(largest, *value.shape)
    for where, section in _model_sections(state, source):
        fields = vars(section) if type(section) is argparse.Namespace else section
        for name, value in fields.items():
            if not _is_int(value):
                continue
            side = name[: -len("_layers")] if name in ("encoder_layers", "decoder_layers") else None
            limit = len(layers[side]) if side else (
                largest if type(name) is str and name.endswith(("_dim", "_heads", "_positions")) else None)
            if limit is not None and value > limit:
                what = f"the {len(layers[side])} {side} layers its weights hold" if side else (
                    f"the largest dimension of its weights ({largest})")
                raise UnsafeCheckpointError(
                    f"{source}: refused: {where}.{name} = {value}: more than {what}; fairseq would "
                    "build (and allocate) that model before comparing it with the weights. Nothing "
                    "in the checkpoint was run.")


def trusted() -> bool:
    """Whether the user switched the configuration checks off (:data:`TRUST_SWITCH`)."""
    return os.environ.get(TRUST_SWITCH, "") == "1"  # only the documented value: "false" is not "1"


def sanitize(state: Dict[str, Any], source: str) -> Dict[str, Any]:
    """``state`` with its configuration rebuilt as plain data (evaluated fields as text
    written here from their literal), the rest bounded; or :class:`CheckpointError`."""
    walk = _Walk(source)
    out = dict(state)
    config_roots = [root for root in ("args", "cfg") if state.get(root) is not None]
    for key, value in state.items():
        if key not in config_roots:
            walk.check(value, f"[{key!r}]")
    stored = sum(walk.storages.values())
    if walk.tensor_bytes > LIMIT_AMPLIFICATION * stored + (1 << 20):
        raise UnsafeCheckpointError(
            f"{source}: refused: its tensors declare {walk.tensor_bytes} bytes over {stored} bytes of "
            "stored data (many views of the same storage). Nothing in the checkpoint was run.")
    if trusted():
        logger.warning("%s=1: loading %s with its configuration unchecked; a checkpoint's "
                       "configuration can run code, load only checkpoints you trust this way",
                       TRUST_SWITCH, source)
        return out
    for root in config_roots:
        out[root] = walk.plain(state[root], root)[0]
    _check_family(out, source)
    _check_model_sizes(out, source)
    for root in config_roots:
        _rewrite_evaluated(out[root], root, source)
    return out


def load_checkpoint(path: str) -> Dict[str, Any]:
    """A fairseq checkpoint read onto the CPU, weights-only, and sanitized (:func:`sanitize`)."""
    return sanitize(read_checkpoint(path), str(path))


def nonfinite_weights(model_state: Mapping[str, Any]) -> List[str]:
    """Names of the floating-point tensors of ``model_state`` holding NaN or infinity."""
    return [name for name, value in model_state.items()
            if torch.is_tensor(value) and value.is_floating_point() and not bool(torch.isfinite(value).all())]


# -- fairseq's loader -------------------------------------------------------------------
class _ReadOnce:
    """fairseq's ``checkpoint_utils.torch`` during one load: ``torch.load`` returns the state
    read and sanitized here (once); everything else is torch's."""

    def __init__(self, state):
        self._state = [state]

    def load(self, *args, **kwargs):
        if not self._state:
            raise CheckpointError("fairseq read a second file in one load_checkpoint_to_cpu call")
        return self._state.pop()

    def __getattr__(self, name):
        return getattr(torch, name)


def install() -> None:
    """Read every checkpoint ``fairseq.checkpoint_utils.load_checkpoint_to_cpu`` loads here.

    fairseq's tools, its trainer and ``load_model_ensemble_and_task`` (hence the hub) call
    that function through its module, so wrapping it there reaches them all. The wrapper
    reads the file (:func:`read_checkpoint`), sanitizes it (:func:`sanitize`) and runs
    fairseq's own function on that state: its ``torch.load`` returns the sanitized state
    instead of reading the file again (:class:`_ReadOnce`), so fairseq's conversions and
    overrides apply to what was checked, and nothing else.

    Not through here: in multi-process training, fairseq's trainer reads a checkpoint on rank
    0 and sends it to the other ranks with ``distributed_utils.broadcast_object``, which
    unpickles with ``torch.load``; torch's weights-only default refuses fairseq's own
    ``_TensorPlaceholder`` there (with or without this plugin), so such a resume stops on
    the other ranks. ``--load-checkpoint-on-all-dp-ranks`` makes every rank read the file
    through this loader instead.
    """
    from fairseq import checkpoint_utils
    from fairseq.file_io import PathManager

    original = checkpoint_utils.load_checkpoint_to_cpu
    if getattr(original, "ea_fairseq_validates", False):
        return

    @functools.wraps(original)
    def load_checkpoint_to_cpu(path, arg_overrides=None, load_on_all_ranks=False):
        state = sanitize(read_checkpoint(PathManager.get_local_path(path), str(path)), str(path))
        reading, checkpoint_utils.torch = checkpoint_utils.torch, _ReadOnce(state)
        try:
            return original(path, arg_overrides, load_on_all_ranks)
        finally:
            checkpoint_utils.torch = reading

    load_checkpoint_to_cpu.ea_fairseq_validates = True
    checkpoint_utils.load_checkpoint_to_cpu = load_checkpoint_to_cpu
