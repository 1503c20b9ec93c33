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
defaults (None), logged. Languages and split names, which fairseq puts in file names, are taken
as fairseq takes them: the file it then opens is confined to its directory (:mod:`ea_fairseq.safety.data_files`).
"""
import argparse
import dataclasses
import logging
import re
from typing import Any, Dict, List, Optional

from .fields import (PATH_FIELDS, REGISTRY_SECTIONS, _fields, _names_a_path,  # noqa: F401
                     _unwrap_optional, declared, defaults, shown_key, shown_text, typed)
from .literals import EVALUATED_FIELDS, _Refused
from .model import model_section
from .reading import UnsafeCheckpointError, _shown

logger = logging.getLogger(__name__)


class Generator:
    """Generates the configuration of one checkpoint: ``generate(cfg, args)``."""

    def __init__(self, source: str):
        self.source = shown_text(source)  # every message and log line names it so
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

    def section(self, dataclass_type, given: Optional[Dict[str, Any]], path: str, name=None,
                task: bool = False) -> Dict[str, Any]:
        """The section of ``dataclass_type`` from the fields ``given`` (None: its defaults);
        ``task``: a task's, whose fields naming a file elsewhere, which the task opens when it is
        set up from the checkpoint (``lang_dict``, ``labels``), keep their defaults (``data``:
        what every tool that sets the task up gives)."""
        types = declared(dataclass_type)
        out = defaults(dataclass_type)
        out["_name"] = name
        for key, value in (given or {}).items():
            if key not in types:
                if key != "_name" and not path.startswith("args"):
                    self.dropped.append(f"{path}.{shown_key(key)}")
                continue
            if key in PATH_FIELDS:
                if value is not None and value != out[key]:
                    self.paths.append(f"{path}.{key}={_shown(value)}")
                continue
            tp, _ = _unwrap_optional(types[key])
            default = out[key]
            try:
                if dataclasses.is_dataclass(tp):
                    out[key] = self.section(tp, _fields(value), f"{path}.{key}", task=task)
                    out[key].pop("_name", None)
                else:
                    out[key] = typed(value, types[key], key)
            except _Refused as why:
                raise self.refuse(f"{path}.{key}", value, why) from None
            if task and key != "data" and _names_a_path(out[key]) and out[key] != default:
                self.paths.append(f"{path}.{key}={_shown(value)}")
                out[key] = default
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
        if kind == "task" and (type(name) is not str or name not in dataclasses_):
            raise UnsafeCheckpointError(  # (fairseq hands such a task the stored Namespace whole)
                f"{self.source}: refused: {'args.task' if legacy is not None else 'cfg.task._name'} = "
                f"{_shown(name)}: a task fairseq registers without a configuration dataclass, so there is no "
                "schema to generate its configuration from. Nothing in the checkpoint was run.")
        if type(name) is not str or name not in dataclasses_:
            self.dropped.append(f"cfg.{kind} ({_shown(name)}: no configuration dataclass registered)")
            return None
        return self.section(dataclasses_[name], fields, "args" if legacy is not None else f"cfg.{kind}", name=name,
                            task=kind == "task")

    def generate(self, cfg: Optional[Dict[str, Any]], args: Optional[argparse.Namespace]) -> Dict[str, Any]:
        """The configuration (a dict of sections) fairseq receives; ``args``: the legacy layout,
        which fairseq would convert in place of ``cfg``."""
        from fairseq.dataclass.configs import FairseqConfig


        if cfg is not None and type(cfg) is not dict:  # (a string would be parsed as YAML by OmegaConf.create)
            raise self.refuse("cfg", cfg, "not a configuration (a dict of sections)")
        legacy = None if args is None else _upgraded(args)
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
                    if name in ("bpe", "tokenizer") and out[name] is not None:
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
                    self.dropped.append(f"cfg.{shown_key(name)}")
        _resolve_references(out)
        model = out.get("model")
        if type(model) is argparse.Namespace:  # a legacy model reads the whole command line from its section
            given = vars(legacy) if legacy is not None else _fields(cfg["model"])
            _complete_namespace(model, out, given)
        return out

    def _note_generation(self, given: Optional[Dict[str, Any]], applied: Dict[str, Any]) -> None:
        for key, value in (given or {}).items():
            if key in applied and key != "_name" and value != applied[key] and _differs(value, applied[key]):
                self.generation.append(f"{key}={_shown(value)}")

    def log(self) -> None:
        """One line for each kind of value not taken from the checkpoint; every key, name and
        value in it from the checkpoint escaped and cut (:func:`~.fields.shown_key`,
        :func:`~.reading._shown`): a checkpoint writes no line of its own into the log."""
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


def _complete_namespace(model: argparse.Namespace, out: Dict[str, Any], given: Dict[str, Any]) -> None:
    """The fields of ``given`` (the checkpoint's model Namespace, which fairseq hands a legacy model
    whole: LSTM reads ``args.criterion``, BART ``args.task``) that belong to another section, with
    that section's generated value: a registry's name (``task``, ``criterion``, ...) or a field."""
    generated: Dict[str, Any] = {}
    for name, section in out.items():
        if isinstance(section, dict) and name != "model":
            generated.setdefault(name, section.get("_name"))
            for key, value in section.items():
                generated.setdefault(key, value)
    for key in given:
        if not hasattr(model, key) and key in generated and key != "_name":
            setattr(model, key, generated[key])


def _upgraded(args: argparse.Namespace) -> argparse.Namespace:
    """A copy of the legacy ``args`` with the renames fairseq's ``_upgrade_state_dict`` makes
    before it converts them (which it does not get to do here: it receives the generated
    ``cfg``): a missing task is ``translation``, ``max_positions`` both position limits,
    ``--raw-text``/``--lazy-load`` a dataset format, ``min_lr`` ``stop_min_lr``, ``remove_bpe``
    ``post_process``, a list of data directories its first. The values are typed after this."""
    fields = dict(vars(args))
    fields.setdefault("task", "translation")
    if "max_positions" in fields and "max_source_positions" not in fields:
        fields["max_source_positions"] = fields["max_target_positions"] = fields["max_positions"]
    if fields.get("raw_text") is True:
        fields["dataset_impl"] = "raw"
    elif fields.get("lazy_load") is True:
        fields["dataset_impl"] = "lazy"
    if "min_lr" in fields:
        fields["stop_min_lr"] = fields.pop("min_lr")
    if "remove_bpe" in fields:
        fields["post_process"] = fields["remove_bpe"]
    if type(fields.get("data")) in (list, tuple) and fields["data"]:
        fields["data"] = fields["data"][0]
    return argparse.Namespace(**fields)


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
