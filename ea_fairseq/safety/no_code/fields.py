"""The fields a checkpoint's configuration may hold and the conversion of a value to its
field's declared type (:func:`typed`), read from fairseq's dataclasses: what
:mod:`~ea_fairseq.safety.no_code.schema` and :mod:`~ea_fairseq.safety.no_code.model`
generate every section from."""
import argparse
import copy
import dataclasses
import enum
import functools
import math
import os
import re
import typing
from typing import Any, Dict, List, Optional, Tuple

from .literals import EVALUATED_FIELDS, _evaluated_value, _literal, _Refused
from ..data_files import CHECKED_FORMATS
from .reading import _shown


# fields naming a file fairseq opens while it loads a model (embeddings, the hub's unknown-word
# dictionary, BPE and tokenizer models): a checkpoint's value is not honoured
PATH_FIELDS = frozenset({
    "encoder_embed_path", "decoder_embed_path", "replace_unk", "lm_path", "bpe_codes", "bpe_merges",
    "bpe_vocab", "bpe_vocab_file", "sentencepiece_model", "sentencepiece_model_path", "gpt2_encoder_json",
    "gpt2_vocab_bpe", "quantization_config_path"})
LIMIT_POSITIONS = 1 << 16  # fairseq's max_source/target_positions
# integers by which fairseq sizes what it allocates when it loads data or translates with a
# checkpoint's configuration (the analysis tool and the hub set their task up from it): padding
# multiples, length buckets, position tables, ratios: (least, most); every other integer a
# 64-bit one (fairseq's own defaults reach 2**63 - 1)
INTEGER_BOUNDS = {
    "max_source_positions": (1, LIMIT_POSITIONS), "max_target_positions": (1, LIMIT_POSITIONS),
    "required_seq_len_multiple": (1, LIMIT_POSITIONS), "required_batch_size_multiple": (1, LIMIT_POSITIONS),
    "num_batch_buckets": (0, LIMIT_POSITIONS), "upsample_primary": (-1, 1024), "num_workers": (0, 1024),
    "data_buffer_size": (0, LIMIT_POSITIONS)}
LIMIT_INTEGER = (1 << 63) - 1
# enumerations fairseq would act on beyond what the plugin checks: the dataset formats (fasta
# indexes its file through a shell command holding the path; huffman opens a third file)
CHOICES_CHECKED = {"dataset_impl": CHECKED_FORMATS}
REGISTRY_SECTIONS = ("task", "criterion", "optimizer", "lr_scheduler", "scoring", "bpe", "tokenizer")
_INTEGER, _NUMBER = re.compile(r"[-+]?\d{1,19}"), re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d{1,3})?")


_PLAIN_KEY = re.compile(r"[A-Za-z0-9_.-]{1,100}")
LIMIT_SHOWN_TEXT = 1000  # characters of a path shown as it is; longer, it is shown cut (repr, 100)


def shown_key(key: Any) -> str:
    """A key or name read from input, as a log line or message shows it: itself where it is a
    plain name, else its ``repr`` cut to 100 characters (:func:`~.reading._shown`), so no
    newline, control character or terminal escape in it reaches a log."""
    return key if type(key) is str and _PLAIN_KEY.fullmatch(key) else _shown(key)


def shown_text(text: Any) -> str:
    """A path or other text from input, as a log line or message shows it: itself where every
    character is printable (``str.isprintable``: no newline, control, escape or bidi-override
    character) and it is at most :data:`LIMIT_SHOWN_TEXT` long, else its ``repr`` cut."""
    return text if type(text) is str and text.isprintable() and len(text) <= LIMIT_SHOWN_TEXT else _shown(text)


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
        choices = [str(c.value) for c in tp if name not in CHOICES_CHECKED or str(c.value) in CHOICES_CHECKED[name]]
        if type(value) is str and value in choices:
            return value
        raise _Refused(f"not one of {choices}" + (" (the dataset formats whose files the plugin checks before fairseq "
                                                  "reads them)" if name in CHOICES_CHECKED else ""))
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
        return _bounded(value, name)
    if tp is float and type(value) in (int, float) and math.isfinite(value):
        return float(value)
    if tp is str and type(value) is str:
        return value
    raise _Refused(f"a {type(value).__name__} where fairseq declares {_type_name(tp)}")


def _bounded(value: int, name: str) -> int:
    least, most = INTEGER_BOUNDS.get(name, (-LIMIT_INTEGER - 1, LIMIT_INTEGER))
    if not least <= value <= most:
        raise _Refused(f"not an integer from {least} to {most}" + (
            " (fairseq sizes what it allocates by it)" if name in INTEGER_BOUNDS else " (a 64-bit integer)"))
    return value


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
    if type(value) is int:
        return _bounded(value, "")
    if type(value) in (type(None), bool, float, str):
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


def _names_a_path(value: Any) -> bool:
    """Whether a string value names a file or directory elsewhere (absolute, or through a
    separator): fairseq's tasks open such fields (``lang_dict``, ``labels``, ...) when set up,
    and its models the checkpoints such fields name (``load_pretrained_encoder_from``,
    ``w2v_path``, ``pretrained_mlm_checkpoint``, ...) when built."""
    return type(value) is str and (os.path.isabs(value) or os.sep in value or ".." in value)
