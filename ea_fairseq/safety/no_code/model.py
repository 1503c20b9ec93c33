"""The model section fairseq receives, generated from the model's option table.

A model is configured by argparse options (``add_args``) and the fields its architecture
function fills in; those, typed by fairseq's ``TransformerConfig`` for a model that takes the
transformer's options, and otherwise by the option itself (a flag is a bool, ``choices`` an
enum, ``nargs`` a list) or the architecture's default, are the fields the section may hold.
fairseq's ``TransformerConfig.from_namespace`` also reads nested ``encoder``/``decoder``/
``quant_noise`` sections (where no flat field is given, with the dataclass defaults for the
rest) and un-prefixed aliases (``layers`` for both ``encoder_layers`` and ``decoder_layers``):
they are read here into the flat fields, as fairseq would read them, and then checked like them
(what they make fairseq build is bounded by :mod:`ea_fairseq.safety.budget`).
``*_layers_to_keep`` stays the comma-separated string the legacy model splits.

The architecture is the one fairseq's ``build_model`` builds: ``_name``, else ``arch``
(:func:`architecture`); a section whose two fields name different architectures is refused,
so every tool that reads either field reads the model fairseq builds.
"""
import argparse
import dataclasses
import functools
import typing
from typing import Any, Dict, List, Mapping, Optional

from .literals import EVALUATED_FIELDS, _Refused
from .fields import PATH_FIELDS, _fields, _names_a_path, defaults, shown_key, typed
from .reading import UnsafeCheckpointError, _shown

_NESTED = ("encoder", "decoder", "quant_noise")


@functools.lru_cache(maxsize=None)
def _transformer_types() -> Dict[str, Any]:
    """``{flat option name: declared type}`` of fairseq's ``TransformerConfig``."""
    from fairseq.models.transformer.transformer_config import TransformerConfig

    types = {}
    for field in dataclasses.fields(TransformerConfig):
        if field.name in _NESTED:
            for sub in dataclasses.fields(field.type):
                types[f"{field.name}_{sub.name}"] = sub.type
        elif not field.name.startswith("_"):
            types[field.name] = field.type
    for side in ("encoder", "decoder"):  # the legacy model splits a string "0,2"
        types[f"{side}_layers_to_keep"] = Optional[typing.Union[str, List[int]]]
    return types


@functools.lru_cache(maxsize=None)
def _nested_fields() -> Dict[str, Dict[str, Any]]:
    """``{section: {field: default}}`` of ``TransformerConfig``'s nested sections."""
    from fairseq.models.transformer.transformer_config import TransformerConfig

    out = {}
    for field in dataclasses.fields(TransformerConfig):
        if field.name in _NESTED:
            out[field.name] = {k: v for k, v in defaults(field.type).items() if not k.startswith("_")}
    return out


def _option_type(action: argparse.Action) -> Any:
    """The declared type of an option of the plugin (not declared by ``TransformerConfig``)."""
    if action.nargs == 0:
        return bool
    many = action.nargs in ("+", "*") or isinstance(action.nargs, int)
    if action.choices is not None:
        return ("choices", tuple(action.choices), many)
    names = getattr(getattr(action.type, "__code__", None), "co_names", ())
    if getattr(action.type, "__name__", None) == "eval_bool":  # fairseq evaluates the text once, when parsing
        return bool
    if "eval_str_list" in names:  # (lightconv's kernel sizes: a lambda around it)
        return typing.Union[List[int], List[float]]
    kind = action.type if action.type in (int, float, str) else (
        int if getattr(action.type, "__module__", "").startswith("ea_fairseq") else None)
    if action.type is not None and kind is None:
        return None  # an option whose type this table cannot state: refused if a checkpoint sets it
    kind = kind or str
    return List[kind] if many else kind


@functools.lru_cache(maxsize=None)
def _declared_types(model_class) -> Dict[str, Any]:
    """``TransformerConfig``'s types for a model that takes the transformer's options (the
    plugin's models, fairseq's multilingual transformer, ...); none for another family, whose
    fields of the same names may differ (fconv's ``encoder_layers`` is text)."""
    from fairseq.models.transformer import TransformerModel

    from ...models.hydra_config import option_actions

    takes = isinstance(model_class, type) and set(option_actions(TransformerModel)) <= set(option_actions(model_class))
    return _transformer_types() if takes else {}


@functools.lru_cache(maxsize=None)
def option_table(model_class) -> Dict[str, Any]:
    """``{field: declared type}`` of the options of ``model_class``."""
    from ...models.hydra_config import option_actions

    transformer = _declared_types(model_class)
    return {dest: transformer.get(dest) or _option_type(action)
            for dest, action in option_actions(model_class).items() if dest != "help"}


@functools.lru_cache(maxsize=None)
def _arch_fields(name: str) -> Dict[str, Any]:
    """``{field: type}`` of what the architecture function of ``name`` fills in, typed by its
    default (a flag's False is a bool); None where the default says nothing (None)."""
    from fairseq.models import ARCH_CONFIG_REGISTRY

    if name not in ARCH_CONFIG_REGISTRY:
        return {}
    args = argparse.Namespace()
    ARCH_CONFIG_REGISTRY[name](args)
    return {key: (type(value) if type(value) in (bool, int, float, str) else None) for key, value in vars(args).items()}


def _flat_fields(fields: Dict[str, Any], path: str, table: Dict[str, Any]) -> Dict[str, Any]:
    """``fields`` with nested sections and un-prefixed aliases read into the flat fields, as
    fairseq's ``TransformerConfig.from_namespace`` reads them."""
    flat = dict(fields)
    for section, known in _nested_fields().items():
        nested = flat.pop(section, None)
        if nested is not None:
            sub = _fields(nested)
            for key in sub:
                if key not in known and key != "_name":
                    raise _Refused(f"{path}.{section}.{shown_key(key)}: not a field of fairseq's {section} section")
            for key, default in known.items():  # fairseq builds the section from these, and
                flat.setdefault(f"{section}_{key}", sub.get(key, default))  # flat fields override them
        else:
            for key in known:  # an un-prefixed alias overrides the prefixed field
                if key in fields and key not in table:
                    flat[f"{section}_{key}"] = fields[key]
    for section in _NESTED:
        for key in _nested_fields()[section]:
            if key not in table:
                flat.pop(key, None)
    return flat


def architecture(section: Any) -> Optional[str]:
    """The architecture fairseq builds from the model ``section`` (a Namespace, a dict or
    omegaconf's DictConfig): ``_name``, else ``arch``, as fairseq's ``build_model`` reads
    them. The plugin's tools read the architecture here and nowhere else."""
    if section is None:
        return None
    get = section.get if isinstance(section, Mapping) else (lambda key: getattr(section, key, None))
    return get("_name") or get("arch")


def model_section(gen, given: Any, path: str, legacy: bool):
    """The model section of the generated configuration (a Namespace where fairseq would
    hand the model one, else a dict), from the checkpoint's ``given`` section."""
    from fairseq.models import ARCH_MODEL_REGISTRY, MODEL_REGISTRY

    fields = _fields(given)
    name = architecture(fields)
    if fields.get("_name") is not None and fields.get("arch") is not None and fields["_name"] != fields["arch"]:
        raise UnsafeCheckpointError(
            f"{gen.source}: refused: {path}._name = {_shown(fields['_name'])} and {path}.arch = "
            f"{_shown(fields['arch'])} name two architectures: fairseq builds {path}._name, while a tool "
            "reading arch would report (and average, warm-start, analyse) the other. Nothing in the "
            "checkpoint was run; if you wrote this checkpoint yourself, give both fields the same architecture.")
    model_class = ARCH_MODEL_REGISTRY.get(name) or MODEL_REGISTRY.get(name)
    table = dict(option_table(model_class)) if model_class is not None else {}  # (unknown: fairseq says so)
    for key, kind in _arch_fields(name).items():  # fields the architecture fills in that no option gives
        table.setdefault(key, _declared_types(model_class).get(key) or kind)
    try:
        flat = _flat_fields(fields, path, table)
    except _Refused as why:
        raise gen.refuse(path, given, why) from None
    out: Dict[str, Any] = {}
    for key, value in flat.items():
        here = f"{path}.{shown_key(key)}"
        if key in ("_name", "arch"):
            out[key] = value
            continue
        if key not in table:
            if not legacy and type(given) is dict:
                gen.dropped.append(here)
            continue
        if key in PATH_FIELDS:
            if value is not None:
                gen.paths.append(f"{here}={_shown(value)}")
            out[key] = None
            continue
        declared = table[key]
        try:
            if declared is None and key not in EVALUATED_FIELDS:
                raise _Refused("an option whose type the plugin's option table does not state")
            if type(declared) is tuple:  # ("choices", choices, a list of them)
                values = value if declared[2] and type(value) in (list, tuple) else [value]
                if value is not None and any(type(v) not in (str, int, float) or v not in declared[1]
                                             for v in values):
                    raise _Refused(f"not {'a list of ' if declared[2] else ''}one of {list(declared[1])}")
                out[key] = list(values) if declared[2] and value is not None else value
            else:
                declared = Any if declared is None else declared
                out[key] = typed(value, declared if value is not None else Optional[declared], key)
        except _Refused as why:
            raise gen.refuse(here, value, why) from None
        if _names_a_path(out[key]):  # a checkpoint or file elsewhere, which the model would read as it is built
            gen.paths.append(f"{here}={_shown(value)}")
            out[key] = None
    if legacy or type(given) is argparse.Namespace:
        return argparse.Namespace(**out)
    return out

