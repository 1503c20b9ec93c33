"""Load many checkpoints in one process, as fairseq receives them (``load_checkpoint_to_cpu``)
and through the hub (``from_pretrained``); print one JSON line per checkpoint: the outcome
(loaded / refused / error), the refusal's message, and every received value whose type is not
the one fairseq declares for its field (an interpolation counts as mistyped).

usage: hub_load_many.py DATA USER_DIR CHECKPOINT...
"""
import argparse
import ast
import dataclasses
import enum
import json
import math
import os
import sys
import typing


def _declared(section_name, section):
    from fairseq.dataclass.configs import FairseqConfig
    from fairseq.registry import REGISTRIES
    from fairseq.tasks import TASK_DATACLASS_REGISTRY

    fields = {f.name: f.type for f in dataclasses.fields(FairseqConfig)}
    tp = fields.get(section_name)
    if dataclasses.is_dataclass(tp):
        return {f.name: f.type for f in dataclasses.fields(tp)}
    registry = TASK_DATACLASS_REGISTRY if section_name == "task" else REGISTRIES.get(section_name, {}).get(
        "dataclass_registry", {})
    name = section.get("_name") if hasattr(section, "get") else None
    if name in registry:
        return {f.name: f.type for f in dataclasses.fields(registry[name])}
    return None


def _has_type(value, tp) -> bool:
    from omegaconf import ListConfig

    if typing.get_origin(tp) is typing.Union:
        args = typing.get_args(tp)
        return (value is None and type(None) in args) or any(_has_type(value, a) for a in args if a is not type(None))
    if tp is typing.Any:
        return _plain(value)
    if typing.get_origin(tp) in (list, typing.List):
        (item,) = typing.get_args(tp) or (typing.Any,)
        return isinstance(value, (list, ListConfig)) and all(_has_type(v, item) for v in value)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return value in [c.value for c in tp]
    if tp is bool:
        return type(value) is bool
    if tp is int:
        return type(value) is int
    if tp is float:
        return type(value) in (int, float) and math.isfinite(value)
    if tp is str:
        return type(value) is str and "${" not in value
    return True  # a nested dataclass: its own fields are walked


def _plain(value) -> bool:
    from omegaconf import ListConfig

    if isinstance(value, (list, tuple, ListConfig)):
        return all(_plain(v) for v in value)
    if type(value) is str:
        return "${" not in value
    return type(value) in (type(None), bool, int, float) and (type(value) is not float or math.isfinite(value))


def mistyped(cfg):
    """``section.field`` of every received value whose type is not fairseq's declared one."""
    from omegaconf import DictConfig

    from ea_fairseq.safety.no_code import EVALUATED_FIELDS

    wrong = []
    for name in cfg:
        section = cfg._get_node(name)
        if isinstance(section, DictConfig):
            declared = _declared(name, section)
            for key in section:
                node = section._get_node(key)
                if node._is_interpolation():
                    wrong.append(f"{name}.{key} (interpolation)")
                    continue
                value = section[key]
                tp = (declared or {}).get(key, typing.Any)
                if not _has_type(value, tp) and not isinstance(value, DictConfig):
                    wrong.append(f"{name}.{key}={value!r}")
        else:
            value = section._value() if hasattr(section, "_value") else section
            if isinstance(value, argparse.Namespace):
                for key, v in vars(value).items():
                    if not _plain(v):
                        wrong.append(f"{name}.{key}={v!r}")
                    elif key in EVALUATED_FIELDS and type(v) is str:
                        try:
                            ast.literal_eval(v)
                        except (ValueError, SyntaxError):
                            wrong.append(f"{name}.{key}={v!r} (not a literal)")
    return wrong


def main(data, user_dir, *paths):
    from fairseq import checkpoint_utils, utils

    utils.import_user_module(argparse.Namespace(user_dir=user_dir))
    from fairseq.models.transformer import TransformerModel

    from ea_fairseq.safety.no_code import CheckpointError

    for path in paths:
        result = {"path": path, "outcome": "loaded", "message": "", "mistyped": []}
        try:
            state = checkpoint_utils.load_checkpoint_to_cpu(path, arg_overrides={"data": data})
            result["mistyped"] = mistyped(state["cfg"])
            TransformerModel.from_pretrained(os.path.dirname(path), checkpoint_file=os.path.basename(path),
                                             data_name_or_path=data, user_dir=user_dir)
        except CheckpointError as err:
            result.update(outcome="refused", message=str(err))
        except Exception as err:  # fairseq refusing a value of the right type (a missing language...)
            result.update(outcome="error", message=f"{type(err).__name__}: {err}"[:300])
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
