"""The configuration fairseq receives from a checkpoint, generated here field by field.

fairseq's own dataclasses (``fairseq.dataclass.configs``: the sections of ``FairseqConfig``;
the task, criterion, optimizer, learning-rate scheduler, scorer, BPE and tokenizer dataclasses
of fairseq's registries) and the model's option table (the argparse options of the model class,
typed by fairseq's ``TransformerConfig`` where it declares the field) say which fields exist
and of which type. Each value the checkpoint holds is converted to its field's declared type
(:func:`typed`: ints are ints, floats finite, enums among their choices, lists of their item
type, strings strings); fields that no dataclass or option declares are dropped (logged).
The legacy ``args`` layout is converted here into the same form, so fairseq never runs its own
conversion (which ``ast.literal_eval``\\ s strings held in non-string fields and pastes strings
into hydra overrides). The model's nested ``encoder``/``decoder`` sections and un-prefixed
aliases (``layers``, ``embed_dim``, ...), which fairseq's ``TransformerConfig.from_namespace``
reads in place of the flat fields, are read into the flat fields, so they are bounded like them.

Load-time effects are not taken from a checkpoint: the ``generation`` section is fairseq's
defaults (the caller's overrides apply on top; the values dropped are logged in one line), and
the fields naming files fairseq would open while loading (:data:`PATH_FIELDS`) take their
defaults (None), logged; languages, which fairseq puts in file names, are codes
(:data:`LANGUAGE_FIELDS`).
"""
import argparse
import copy
import dataclasses
import enum
import functools
import logging
import math
import re
import typing
from typing import Any, Dict, List, Optional, Tuple

from .literals import EVALUATED_FIELDS, _evaluated_value, _literal
from .plain import _Refused
from .reading import TRUST_SWITCH, UnsafeCheckpointError, _shown

logger = logging.getLogger(__name__)

# fields naming a file fairseq opens while it loads a model (embeddings, the hub's unknown-word
# dictionary, BPE and tokenizer models): a checkpoint's value is not honoured
PATH_FIELDS = frozenset({
    "encoder_embed_path", "decoder_embed_path", "replace_unk", "lm_path", "bpe_codes", "bpe_merges",
    "bpe_vocab", "bpe_vocab_file", "sentencepiece_model", "sentencepiece_model_path", "gpt2_encoder_json",
    "gpt2_vocab_bpe", "quantization_config_path"})
# values fairseq puts in file names: languages (dict.{lang}.txt) and the splits a task loads
# ({split}.{src}-{tgt}.{lang}); every section, every layout
NAME_FIELDS = {"source_lang": "a language code", "target_lang": "a language code",
               "train_subset": "a split name", "valid_subset": "comma-separated split names",
               "gen_subset": "a split name"}
LANGUAGE_FIELDS = frozenset(k for k, v in NAME_FIELDS.items() if v == "a language code")
_LANGUAGE = re.compile(r"[A-Za-z0-9_-]{1,64}")
_NAMES = re.compile(r"[A-Za-z0-9_-]{1,64}(,[A-Za-z0-9_-]{1,64}){0,63}")
# the task families whose configuration this plugin has checked (its recipes and hub use these);
# another task's dataclass may name files and directories fairseq opens when it sets the task up
VOUCHED_TASKS = frozenset({"translation", "translation_lines"})
# text processors the hub may build from a checkpoint: those that need no network (gpt2, bert,
# hf_byte_bpe, ... download their vocabularies or reach for other packages' files)
OFFLINE_TEXT = {"bpe": frozenset({"sentencepiece", "subword_nmt", "fastbpe", "characters", "bytes", "byte_bpe"}),
                "tokenizer": frozenset({"moses", "nltk", "space"})}
REGISTRY_SECTIONS = ("task", "criterion", "optimizer", "lr_scheduler", "scoring", "bpe", "tokenizer")
_INTEGER, _NUMBER = re.compile(r"[-+]?\d{1,19}"), re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d{1,3})?")


class Refusal(Exception):
    """A value refused: ``(path, value, why)``."""


def _unwrap_optional(tp) -> Tuple[Any, bool]:
    if typing.get_origin(tp) is typing.Union:
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(inner) == 1:
            return inner[0], type(None) in typing.get_args(tp)
    return tp, False


def typed(value: Any, tp: Any, name: str) -> Any:
    """``value`` converted to the declared type ``tp`` of field ``name``, or :class:`_Refused`.
    A string in a field of another type (the legacy layout stored ``'True'``, ``'[0.001]'``)
    is read with the plugin's literal parser, never evaluated."""
    tp, optional = _unwrap_optional(tp)
    if name in EVALUATED_FIELDS and tp in (str, Any, object):  # fairseq evaluates the text
        return _evaluated_value(name, value)
    if typing.get_origin(tp) is typing.Union:  # one of several types: the first that takes it
        if value is None and type(None) in typing.get_args(tp):
            return None
        for option in typing.get_args(tp):
            try:
                return typed(value, option, name)
            except _Refused:
                continue
        raise _Refused(f"a {type(value).__name__} where fairseq declares {_type_name(tp)}")
    if value is None:
        if optional or tp is Any:
            return None
        raise _Refused(f"None where fairseq declares {_type_name(tp)}")
    if tp is Any or tp is object:
        return _any_value(value)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        choices = [str(c.value) for c in tp]
        if type(value) is str and value in choices:
            return value
        raise _Refused(f"not one of {choices}")
    origin = typing.get_origin(tp)
    if origin in (list, List, tuple):
        item = (typing.get_args(tp) or (Any,))[0]
        if type(value) is str:
            value = _literal(value)
        if type(value) not in (list, tuple):
            value = [value]  # fairseq's own conversion does the same with one number
        return [typed(v, item, name) for v in value]
    if type(value) is str and tp in (bool, int, float):
        value = _legacy_scalar(value, tp)
    if tp is bool and type(value) is bool:
        return value
    if tp is int and type(value) is int:
        return value
    if tp is float and type(value) in (int, float) and math.isfinite(value):
        return float(value)
    if tp is str and type(value) is str:
        if name in NAME_FIELDS and not (_NAMES if "," in NAME_FIELDS[name] else _LANGUAGE).fullmatch(value):
            raise _Refused(f"not {NAME_FIELDS[name]} ([A-Za-z0-9_-]+); fairseq puts it in file names")
        return value
    raise _Refused(f"a {type(value).__name__} where fairseq declares {_type_name(tp)}")


def _legacy_scalar(text: str, tp) -> Any:
    stripped = text.strip()
    if tp is bool and stripped in ("True", "False"):
        return stripped == "True"
    if tp is int and _INTEGER.fullmatch(stripped):
        return int(stripped)
    if tp is float and _NUMBER.fullmatch(stripped):
        return float(stripped)
    raise _Refused(f"the text {_shown(text)} where fairseq declares {_type_name(tp)}")


def _any_value(value: Any) -> Any:
    if type(value) in (list, tuple):
        return [_any_value(v) for v in value]
    if type(value) is float and not math.isfinite(value):
        raise _Refused("a number that is not finite")
    if type(value) in (type(None), bool, int, float, str):
        return value
    raise _Refused(f"a {type(value).__name__} where fairseq declares a plain value")


def _type_name(tp) -> str:
    if typing.get_origin(tp) is typing.Union:
        return " or ".join(_type_name(a) for a in typing.get_args(tp) if a is not type(None))
    return str(tp).replace("typing.", "") if typing.get_origin(tp) else getattr(tp, "__name__", str(tp))


def _fields(section: Any) -> Optional[Dict[str, Any]]:
    if section is None:
        return None
    if type(section) is argparse.Namespace:
        return dict(vars(section))
    if type(section) is dict:
        return dict(section)
    raise _Refused(f"a {type(section).__name__} where fairseq reads a section (a dict of fields)")


def declared(dataclass_type) -> Dict[str, Any]:
    """``{field: type}`` of a fairseq dataclass (``_name`` aside)."""
    return {f.name: f.type for f in dataclasses.fields(dataclass_type) if not f.name.startswith("_")}


def defaults(dataclass_type) -> Dict[str, Any]:
    """fairseq's defaults for ``dataclass_type`` (``${...}``: fairseq's own references, resolved
    in :func:`_resolve_references`; ``'???'``: no default)."""
    return copy.deepcopy(_defaults(dataclass_type))


@functools.lru_cache(maxsize=None)
def _defaults(dataclass_type) -> Dict[str, Any]:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.structured(dataclass_type), resolve=False, enum_to_str=True)


class Generator:
    """Generates the configuration of one checkpoint: ``generate(cfg, args)``."""

    def __init__(self, source: str):
        self.source = source
        self.dropped: List[str] = []  # fields no dataclass or option declares
        self.paths: List[str] = []  # path fields not honoured
        self.generation: List[str] = []  # generation values not applied
        self.text: List[str] = []  # the tokenizer and BPE the hub applies from the checkpoint

    def refuse(self, path: str, value: Any, why: Any) -> UnsafeCheckpointError:
        form = EVALUATED_FIELDS.get(path.rsplit(".", 1)[-1])
        rule = (f"fairseq passes this field to {form.use}, so a checkpoint may only hold {form.expected} there "
                f"(e.g. {form.example})" if form else
                "A checkpoint may only hold values of the types fairseq declares")
        return UnsafeCheckpointError(
            f"{self.source}: refused: {path} = {_shown(value)}: {why}. {rule}. Nothing in "
            "the checkpoint was run; if you wrote this checkpoint yourself, correct that field.")

    def section(self, dataclass_type, given: Optional[Dict[str, Any]], path: str, name=None) -> Dict[str, Any]:
        """The section of ``dataclass_type`` from the fields ``given`` (None: its defaults)."""
        types = declared(dataclass_type)
        out = defaults(dataclass_type)
        out["_name"] = name
        for key, value in (given or {}).items():
            if key not in types:
                if key != "_name" and not path.startswith("args"):
                    self.dropped.append(f"{path}.{key}")
                continue
            if key in PATH_FIELDS:
                if value is not None and value != out[key]:
                    self.paths.append(f"{path}.{key}={_shown(value)}")
                continue
            tp, _ = _unwrap_optional(types[key])
            try:
                if dataclasses.is_dataclass(tp):
                    out[key] = self.section(tp, _fields(value), f"{path}.{key}")
                    out[key].pop("_name", None)
                else:
                    out[key] = typed(value, types[key], key)
            except _Refused as why:
                raise self.refuse(f"{path}.{key}", value, why) from None
        return out

    def registry_section(self, kind: str, given: Any, legacy: Optional[argparse.Namespace]):
        """The section of registry ``kind`` (task, optimizer, ...) named by the checkpoint."""
        from fairseq.registry import REGISTRIES
        from fairseq.tasks import TASK_DATACLASS_REGISTRY

        fields = vars(legacy) if legacy is not None else _fields(given)
        name = (fields or {}).get(kind if legacy is not None else "_name")
        if name is None:
            return None
        dataclasses_ = TASK_DATACLASS_REGISTRY if kind == "task" else REGISTRIES[kind]["dataclass_registry"]
        if kind == "task" and (type(name) is not str or name not in VOUCHED_TASKS):
            raise UnsafeCheckpointError(
                f"{self.source}: refused: {'args.task' if legacy is not None else 'cfg.task._name'} = "
                f"{_shown(name)}: ea_fairseq loads checkpoints of the tasks {', '.join(sorted(VOUCHED_TASKS))} "
                "only; for other tasks it has not checked which configuration fields fairseq opens or "
                f"evaluates. Nothing in the checkpoint was run. To load a checkpoint you trust without these "
                f"checks, set {TRUST_SWITCH}=1.")
        if kind in OFFLINE_TEXT and (type(name) is not str or name not in OFFLINE_TEXT[kind]):
            raise self.refuse("args." + kind if legacy is not None else f"cfg.{kind}._name", name,
                              f"fairseq's hub builds this {kind} from the checkpoint, and only "
                              f"{', '.join(sorted(OFFLINE_TEXT[kind]))} need no download")
        if type(name) is not str or name not in dataclasses_:
            self.dropped.append(f"cfg.{kind} ({name!r}: no configuration dataclass registered)")
            return None
        return self.section(dataclasses_[name], fields, "args" if legacy is not None else f"cfg.{kind}", name=name)

    def generate(self, cfg: Optional[Dict[str, Any]], args: Optional[argparse.Namespace]) -> Dict[str, Any]:
        """The configuration (a dict of sections) fairseq receives; ``args``: the legacy layout,
        which fairseq would convert in place of ``cfg``."""
        from fairseq.dataclass.configs import FairseqConfig

        from .model import model_section

        legacy = args
        out: Dict[str, Any] = {"_name": None}
        for field in dataclasses.fields(FairseqConfig):
            name = field.name
            if name.startswith("_"):
                continue
            given = None if legacy is not None else (cfg or {}).get(name)
            path = "args" if legacy is not None else f"cfg.{name}"
            try:
                if name == "model":
                    source = legacy if legacy is not None else given
                    out[name] = None if source is None else model_section(self, source, path, legacy is not None)
                elif name in REGISTRY_SECTIONS:
                    out[name] = self.registry_section(name, given, legacy)
                    if name in OFFLINE_TEXT and out[name] is not None:
                        self.text.append(f"{name}={out[name]['_name']}")
                elif name == "generation":
                    out[name] = self.section(field.type, None, path)
                    self._note_generation(vars(legacy) if legacy is not None else _fields(given), out[name])
                else:
                    out[name] = self.section(field.type, vars(legacy) if legacy is not None else _fields(given), path)
            except _Refused as why:
                raise self.refuse(path, given, why) from None
        if legacy is None:
            for name in (cfg or {}):
                if name not in out:
                    self.dropped.append(f"cfg.{name}")
        _resolve_references(out)
        return out

    def _note_generation(self, given: Optional[Dict[str, Any]], applied: Dict[str, Any]) -> None:
        for key, value in (given or {}).items():
            if key in applied and key != "_name" and value != applied[key] and _differs(value, applied[key]):
                self.generation.append(f"{key}={_shown(value)}")

    def log(self) -> None:
        """One line for each kind of value not taken from the checkpoint."""
        if self.generation:
            logger.warning("%s: the checkpoint's generation settings are not applied (%s); fairseq's defaults "
                           "and the caller's options are used (pass them to from_pretrained or on the "
                           "command line to use them)", self.source, ", ".join(self.generation))
        if self.text:
            logger.warning("%s: the checkpoint names a text processing (%s): fairseq's hub (from_pretrained) "
                           "applies it to the sentences it is given unless tokenizer=/bpe= are passed; "
                           "fairseq-generate and fairseq-interactive apply only their own --tokenizer/--bpe",
                           self.source, ", ".join(self.text))
        if self.paths:
            logger.warning("%s: paths in the checkpoint's configuration are not opened (%s); give them as "
                           "options if they are needed", self.source, ", ".join(self.paths))
        if self.dropped:
            logger.info("%s: configuration fields fairseq does not declare were dropped: %s", self.source,
                        ", ".join(self.dropped[:20]) + (", ..." if len(self.dropped) > 20 else ""))


def _differs(a, b) -> bool:
    if type(a) in (list, tuple) and type(b) in (list, tuple):
        return list(a) != list(b)
    return not (type(a) in (int, float) and type(b) in (int, float) and a == b)


_REFERENCE = re.compile(r"\$\{([A-Za-z_][\w.]*)\}")


def _resolve_references(cfg: Dict[str, Any]) -> None:
    """Replace fairseq's own default references (``${common.fp16}``, the dataclasses' ``II()``)
    with the values they name in the generated configuration: what fairseq receives holds no
    interpolation at all."""
    def lookup(dotted: str, depth: int = 0):
        node: Any = cfg
        for part in dotted.split("."):
            node = (vars(node) if type(node) is argparse.Namespace else node or {}).get(part) \
                if type(node) in (dict, argparse.Namespace) else None
        if type(node) is str and _REFERENCE.fullmatch(node) and depth < 8:
            return lookup(_REFERENCE.fullmatch(node).group(1), depth + 1)
        return None if type(node) is str and "${" in node else node

    def walk(node):
        items = vars(node) if type(node) is argparse.Namespace else node if type(node) is dict else None
        for key, value in list((items or {}).items()):
            if type(value) is str and "${" in value:
                found = _REFERENCE.fullmatch(value)
                items[key] = lookup(found.group(1)) if found else None
            elif type(value) in (dict, argparse.Namespace):
                walk(value)

    walk(cfg)
