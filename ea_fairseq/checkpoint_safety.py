"""Load fairseq checkpoints without letting them run code.

A checkpoint is input, and two things in it could run code:

1. **Pickled objects.** Checkpoints are read with torch's weights-only unpickler, which is
   never switched off. fairseq checkpoints also hold their configuration (an
   ``argparse.Namespace``; omegaconf containers in older ones), which that unpickler refuses
   unless allow-listed: those classes are allow-listed only *while a checkpoint is being
   loaded* (:func:`checkpoint_globals_allowed`), not for the whole process.
2. **Configuration strings that fairseq evaluates.** The allow-listed configuration is
   plain data, but fairseq later hands some of its strings to ``eval()`` (for instance
   ``adaptive_softmax_cutoff`` through ``utils.eval_str_list`` when it builds a decoder)
   or uses them as names to look up. :func:`validate_checkpoint` checks every such field
   (:data:`GUARDED_FIELDS`): it must be a literal value of the form fairseq expects, or
   loading stops with an error that names the field.

:func:`install` (run when the plugin is imported) puts both in front of
``fairseq.checkpoint_utils.load_checkpoint_to_cpu``, the one function through which
fairseq's command-line tools, ``--restore-file``/``--finetune-from-model`` and the hub
(``from_pretrained``) read a checkpoint: the file's configuration is validated before
fairseq converts or evaluates any of it, and again after fairseq has applied its
overrides. :func:`load_checkpoint` does the same for the plugin's own tools (checkpoint
averaging, warm start).
"""
import argparse
import ast
import collections
import contextlib
import functools
import os
import re
import typing
import zipfile
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple

import torch


class CheckpointError(RuntimeError):
    """A checkpoint that is refused: it does not load, and nothing in it was run."""


class UnsafeCheckpointError(CheckpointError):
    """A configuration field holds something other than a literal of the expected form."""


# -- 1. pickled objects ------------------------------------------------------------------
def fairseq_checkpoint_globals() -> List[Any]:
    """The classes a fairseq checkpoint's configuration is made of.

    ``fairseq-train`` writes its options as an ``argparse.Namespace`` (the only class a
    checkpoint of the current fairseq needs); checkpoints written through hydra or by
    older fairseq keep omegaconf containers, whose node classes are listed too. None of
    them runs code when unpickled: they are containers of plain values.
    """
    from omegaconf import DictConfig, ListConfig, nodes
    from omegaconf.base import ContainerMetadata, Metadata

    return [
        argparse.Namespace,
        DictConfig,
        ListConfig,
        ContainerMetadata,
        Metadata,
        nodes.AnyNode,
        typing.Any,
        collections.defaultdict,
    ]


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


def _refused_pickle(path: str, err: Exception) -> CheckpointError:
    text = str(err)
    found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text) or re.search(r"GLOBAL ([\w.]+)", text)
    what = f"an object of {found.group(1)}" if found else "an object"
    return CheckpointError(
        f"{path}: refused: the file holds {what}, which torch's weights-only loader does not "
        "unpickle (only tensors and a fairseq configuration are read from a checkpoint, "
        "so that loading one cannot run code). Nothing in it was run. If it is a fairseq "
        "checkpoint of a kind ea_fairseq does not know, report the class named here."
    )


def _weights_only_load(path: str, map_location) -> Any:
    with checkpoint_globals_allowed():
        try:
            return torch.load(path, map_location=map_location, weights_only=True)
        except (FileNotFoundError, IsADirectoryError, PermissionError):
            raise
        except Exception as err:  # the unpickler names the refused global
            if isinstance(err, zipfile.BadZipFile) or "invalid load key" in str(err) \
                    or "failed finding central directory" in str(err):
                raise CheckpointError(f"{path}: not a torch checkpoint ({err})") from err
            raise _refused_pickle(path, err) from err


def load_checkpoint(path: str) -> Dict[str, Any]:
    """``torch.load`` a fairseq checkpoint onto the CPU, weights-only, and validate its
    configuration (:func:`validate_checkpoint`)."""
    state = _weights_only_load(path, "cpu")
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: holds a {type(state).__name__}, not a fairseq checkpoint (a dict)")
    validate_checkpoint(state, path)
    return state


# -- 2. configuration strings fairseq evaluates ------------------------------------------
LIMIT_CHARS = 10_000  # a guarded string longer than this is refused unread
LIMIT_ITEMS = 100_000  # ... or one whose value would hold more items than this
LIMIT_DEPTH = 64  # nesting of the configuration itself


class _Refused(Exception):
    pass


def _literal(text: str, allow_name: bool = False) -> Any:
    """The value of ``text`` if it is a literal expression, else :class:`_Refused`.

    Literals as ``ast.literal_eval`` reads them, plus ``+`` and ``*`` between them, as in
    fairseq's own defaults (``"[(512, 3)] * 20"``), sizes bounded. With ``allow_name``,
    the whole string may also be one identifier: ``eval`` of a bare name only looks it up
    and runs nothing (options such as ``decoder_attention`` are a name in one model and
    an evaluated expression in another).
    """
    if len(text) > LIMIT_CHARS:
        raise _Refused(f"it is longer than {LIMIT_CHARS} characters")
    if allow_name and text.isidentifier():
        return _NAME
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


_NAME = object()


def _size(x) -> int:
    return len(x) if isinstance(x, (str, bytes, list, tuple, dict, set)) else 1


_SYNTAX = {ast.Call: "a function call", ast.Attribute: "an attribute access", ast.Name: "a name",
           ast.Lambda: "a lambda", ast.Subscript: "a subscript", ast.BoolOp: "'and'/'or'",
           ast.Compare: "a comparison", ast.JoinedStr: "an f-string"}


def _value(node) -> Any:
    if isinstance(node, ast.Constant) and node.value is not Ellipsis:
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        items = [_value(e) for e in node.elts]
        return items if isinstance(node, ast.List) else tuple(items)
    if isinstance(node, ast.Set):
        return {_hashable(_value(e)) for e in node.elts}
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise _Refused("it unpacks a dict with '**' (code, not a literal)")
        return {_hashable(_value(k)): _value(v) for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        operand = _value(node.operand)
        if _is_number(operand) or isinstance(operand, complex):
            return -operand if isinstance(node.op, ast.USub) else operand
        raise _Refused("it puts a sign before something that is not a number")
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Mult):
            counts = [x for x in (left, right) if _is_int(x)]
            seqs = [x for x in (left, right) if isinstance(x, (str, bytes, list, tuple))]
            if seqs and counts and counts[0] * _size(seqs[0]) > LIMIT_ITEMS:
                raise _Refused(f"its value would hold more than {LIMIT_ITEMS} items")
        elif _size(left) + _size(right) > LIMIT_ITEMS:
            raise _Refused(f"its value would hold more than {LIMIT_ITEMS} items")
        try:
            return left + right if isinstance(node.op, ast.Add) else left * right
        except TypeError:
            raise _Refused("it applies '+' or '*' to values that do not combine")
    what = _SYNTAX.get(type(node), f"'{type(node).__name__}' syntax")
    raise _Refused(f"it contains {what}: code, not a literal")


def _hashable(x):
    try:
        hash(x)
    except TypeError:
        raise _Refused("it has an unhashable key")
    return x


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _ints(x) -> bool:
    return _is_int(x) or (isinstance(x, (list, tuple)) and all(_is_int(i) for i in x))


def _numbers(x) -> bool:
    return _is_number(x) or (isinstance(x, (list, tuple)) and all(_is_number(i) for i in x))


_PLAIN = (str, bytes, int, float, complex, bool, type(None))


def _plain(x, depth: int = 0) -> bool:
    if depth > LIMIT_DEPTH:
        return False
    if isinstance(x, _PLAIN):
        return True
    if isinstance(x, (list, tuple, set)):
        return all(_plain(i, depth + 1) for i in x)
    if isinstance(x, dict):
        return all(_plain(k, depth + 1) and _plain(v, depth + 1) for k, v in x.items())
    return False


class Form(typing.NamedTuple):
    """What fairseq does with a field, and which values are safe and well-formed there."""

    use: str  # what fairseq does with it (for the error message)
    expected: str  # the form, in words
    check: Callable[[Any], bool]  # on the literal's value
    example: str
    evaluated: bool = True  # a string is evaluated (else: taken as it is)
    allow_name: bool = False


_INTS = dict(expected="an integer or a list of integers", check=_ints, example="'[10000, 50000]' or None")
_NUMBERS = dict(expected="a number or a list of numbers", check=_numbers, example="'(0.9, 0.98)'")
_DICT = dict(expected="a dict literal", check=lambda x: isinstance(x, dict), example="'{}' or None")
_ANY = dict(expected="a Python literal", check=_plain, example="'[(512, 3)] * 20'")
_NAME_OR_ANY = dict(expected="a Python literal or a plain name", check=lambda x: x is _NAME or _plain(x),
                    example="'True', '[(512, 3)] * 20' or 'vanilla'", allow_name=True)
_REGISTRY_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}")

# field name -> Form; checked wherever the name occurs in ``args`` or ``cfg`` (any section,
# any depth: nested configurations such as wav2vec's ``w2v_args`` are read the same way)
GUARDED_FIELDS: Dict[str, Form] = {}
for _names, _use, _kind in (
    (("adaptive_softmax_cutoff",), "utils.eval_str_list() when the decoder is built", _INTS),
    (("adaptive_input_cutoff",), "utils.eval_str_list() when the decoder is built", _INTS),
    (("pipeline_balance", "pipeline_devices", "pipeline_encoder_balance", "pipeline_encoder_devices",
      "pipeline_decoder_balance", "pipeline_decoder_devices"),
     "utils.eval_str_list() when pipeline parallelism is set up", _INTS),
    (("xformers_att_config", "encoder_xformers_att_config", "decoder_xformers_att_config"),
     "utils.eval_str_dict() in MultiheadAttention", _DICT),
    (("optimizer_overrides",), "ast.literal_eval() when training resumes", _DICT),
    (("adam_betas", "adamax_betas", "lamb_betas", "adafactor_eps"),
     "eval() when the optimizer is built", _NUMBERS),
    (("character_filters",), "eval() when a character-CNN language model is built", _ANY),
    (("wer_args",), "eval() in the CTC criterion", _ANY),
    (("conv_feature_layers", "conv_aggregator_layers", "override_encoder_layers", "feature_encoder_spec"),
     "eval() when a wav2vec/HuBERT feature extractor is built", _ANY),
    (("left_pad_source", "left_pad_target"), "utils.eval_bool() in the multilingual tasks", _ANY),
    (("encoder_layers", "decoder_layers", "encoder_attention", "decoder_attention", "self_attention",
      "project_input", "gated_attention", "downsample", "pretrained"),
     "eval() when an fconv or LSTM model is built", _NAME_OR_ANY),
):
    for _name in _names:
        GUARDED_FIELDS[_name] = Form(use=_use, **_kind)
GUARDED_FIELDS["user_dir"] = Form(
    use="utils.import_user_module(), which imports it", expected="a directory path (a string) or None",
    check=lambda x: isinstance(x, str) and "\0" not in x, example="'/path/to/ea_fairseq'", evaluated=False)
for _name in ("task", "arch", "_name", "criterion", "optimizer", "lr_scheduler", "tokenizer", "bpe",
              "scoring"):
    GUARDED_FIELDS[_name] = Form(
        use="a lookup in fairseq's registries", expected="a registered name (letters, digits, '_', '.', '-')",
        check=lambda x: isinstance(x, str) and _REGISTRY_NAME.fullmatch(x) is not None,
        example="'transformer_lite'", evaluated=False)
del _names, _use, _kind, _name


def check_field(name: str, value: Any) -> Optional[str]:
    """Why ``value`` is refused in field ``name`` (None: accepted)."""
    form = GUARDED_FIELDS.get(name)
    if form is None or value is None:
        return None
    if isinstance(value, (argparse.Namespace, Mapping)) and name in ("task", "optimizer", "criterion",
                                                                  "lr_scheduler", "tokenizer", "bpe",
                                                                  "scoring"):
        return None  # a configuration section of that name (its fields are checked one by one)
    if isinstance(value, str) and form.evaluated:
        try:
            parsed = _literal(value, allow_name=form.allow_name)
        except _Refused as why:
            return f"{why}"
        return None if form.check(parsed) else f"it is not {form.expected}"
    if not form.evaluated and not isinstance(value, str):
        return f"it is a {type(value).__name__}, not {form.expected}"
    return None if form.check(value) else f"it is not {form.expected}"


def _children(node) -> Optional[List[Tuple[str, Any]]]:
    if isinstance(node, argparse.Namespace):
        return list(vars(node).items())
    if isinstance(node, Mapping):
        return list(node.items())
    return None


def _plain_config(cfg):
    """An omegaconf container as plain dicts/lists, interpolations left unresolved."""
    try:
        from omegaconf import OmegaConf
    except ImportError:  # pragma: no cover - fairseq depends on omegaconf
        return cfg
    if OmegaConf.is_config(cfg):
        return OmegaConf.to_container(cfg, resolve=False)
    return cfg


def iter_fields(node, path: str, depth: int = 0) -> Iterator[Tuple[str, str, Any]]:
    """``(path, name, value)`` of every named field under ``node``."""
    if depth > LIMIT_DEPTH:
        raise UnsafeCheckpointError(f"{path}: the configuration is nested more than {LIMIT_DEPTH} deep")
    node = _plain_config(node)
    children = _children(node)
    if children is None:
        if isinstance(node, (list, tuple)):
            for i, item in enumerate(node):
                yield from iter_fields(item, f"{path}[{i}]", depth + 1)
        return
    for key, value in children:
        if not isinstance(key, str):
            continue
        value = _plain_config(value)  # e.g. an omegaconf list held by a Namespace
        yield f"{path}.{key}", key, value
        yield from iter_fields(value, f"{path}.{key}", depth + 1)


def validate_checkpoint(state: Mapping, source: str) -> None:
    """Refuse a checkpoint whose configuration holds anything fairseq would evaluate or
    import that is not a literal of the expected form (:data:`GUARDED_FIELDS`)."""
    for root in ("args", "cfg"):
        if root not in state or state[root] is None:
            continue
        for path, name, value in iter_fields(state[root], root):
            why = check_field(name, value)
            if why is None:
                continue
            form = GUARDED_FIELDS[name]
            shown = repr(value)
            shown = shown if len(shown) <= 120 else shown[:117] + "..."
            raise UnsafeCheckpointError(
                f"{source}: refused: {path} = {shown}: {why}. fairseq passes this field to "
                f"{form.use}, so a checkpoint may only hold {form.expected} there (e.g. "
                f"{form.example}). Nothing in the checkpoint was run; if you wrote this "
                "checkpoint yourself, correct that field (or re-save from a trusted run)."
            )


# -- fairseq's loader -------------------------------------------------------------------
def install() -> None:
    """Validate every checkpoint ``fairseq.checkpoint_utils.load_checkpoint_to_cpu`` reads.

    fairseq's tools, its trainer and ``load_model_ensemble_and_task`` (hence the hub) call
    that function through its module, so wrapping it there reaches them all. The wrapper
    reads the file's configuration first (tensors on the ``meta`` device: no tensor data
    is read) and validates it before fairseq converts or evaluates anything; then fairseq
    loads the file with the configuration classes allow-listed for that call only, and
    the result, fairseq's overrides applied, is validated again.

    Not through here: in multi-process training, fairseq's trainer reads a checkpoint on rank
    0 and sends it to the other ranks with ``distributed_utils.broadcast_object``, which
    unpickles with ``torch.load``; torch's weights-only default refuses fairseq's own
    ``_TensorPlaceholder`` there (with or without this plugin), so such a resume stops on
    the other ranks. ``--load-checkpoint-on-all-dp-ranks`` makes every rank read the file
    through this loader instead.
    """
    from fairseq import checkpoint_utils

    original = checkpoint_utils.load_checkpoint_to_cpu
    if getattr(original, "ea_fairseq_validates", False):
        return

    @functools.wraps(original)
    def load_checkpoint_to_cpu(path, arg_overrides=None, load_on_all_ranks=False):
        if isinstance(path, (str, os.PathLike)) and os.path.isfile(path):  # else fairseq fetches it
            raw = _weights_only_load(path, "meta")
            if not isinstance(raw, dict):
                raise CheckpointError(f"{path}: holds a {type(raw).__name__}, not a fairseq checkpoint")
            validate_checkpoint(raw, path)
            del raw
        with checkpoint_globals_allowed():
            try:
                state = original(path, arg_overrides, load_on_all_ranks)
            except CheckpointError:
                raise
            except Exception as err:
                if "weights_only" in str(err) or "Unsupported global" in str(err):
                    raise _refused_pickle(str(path), err) from err
                raise
        validate_checkpoint(state, str(path))
        return state

    load_checkpoint_to_cpu.ea_fairseq_validates = True
    checkpoint_utils.load_checkpoint_to_cpu = load_checkpoint_to_cpu
