"""Which model families a checkpoint may name, and how large a model its configuration may ask
for: no larger than its weights, for every field fairseq reads when it builds the model."""
import argparse
import re
from typing import Any, Dict, List, Mapping, Tuple

import torch

from .reading import TRUST_SWITCH, UnsafeCheckpointError, _shown

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




LIMIT_POSITIONS = 1 << 16  # fairseq's max_source/target_positions (a sinusoidal table of that many rows)
LIMIT_UNSTORED_POSITIONS = 1024  # a plugin position limit above the weights' largest dimension (RAN's
# and Syn-R's defaults, 256, are stored whether or not those attentions are used)
_LAYERS = re.compile(r"(encoder|decoder)\.layers\.(\d+)\.")
_KEEP = re.compile(r"\d{1,6}(,\d{1,6})*")
_SIZED = ("_dim", "_heads", "_positions", "_sizes", "_size", "_window", "_layers")  # fields sizing what fairseq
# allocates (encoder_layers/decoder_layers, base_layers and base_sublayers: bounded by the layers held)


def weight_sizes(weights: Any) -> Tuple[Dict[str, int], int]:
    """``({side: layers}, largest dimension)`` of the weights: the layers each side holds and
    the largest dimension of a tensor holding any element (a (2**36, 0) tensor holds none)."""
    layers: Dict[str, set] = {"encoder": set(), "decoder": set()}
    largest = 0
    if isinstance(weights, Mapping):  # (an OrderedDict, as torch saves a state dict)
        for key, value in weights.items():
            found = _LAYERS.match(key) if type(key) is str else None
            if found:
                layers[found.group(1)].add(int(found.group(2)))
            if torch.is_tensor(value) and value.numel():
                largest = max(largest, *value.shape)
    return {side: len(held) for side, held in layers.items()}, largest


def check_model_sizes(fields: Mapping[str, Any], weights: Any, where: str, source: str) -> None:
    """The typed, flat model configuration ``fields`` (nested sections and un-prefixed aliases
    already read into it) may not ask fairseq to build more than ``weights`` describe:
    ``encoder_layers``/``decoder_layers`` (and ``base_layers``/``base_sublayers``) at most the
    layers the weights hold, ``*_layers_to_keep`` indices of those layers, and every ``*_dim``
    and ``*_heads`` (at least 1), ``*_positions``, ``*_size(s)``, ``*_window`` and other
    ``*_layers`` at most the largest dimension of a tensor of the weights
    (``max_source_positions``/``max_target_positions``: at most :data:`LIMIT_POSITIONS`; the
    plugin's ``*_positions``: at most :data:`LIMIT_UNSTORED_POSITIONS` if larger), so that
    a small file cannot make fairseq allocate a huge model before it compares the weights."""
    if not isinstance(weights, Mapping):
        return
    layers, largest = weight_sizes(weights)

    def refuse(name, value, what):
        raise UnsafeCheckpointError(
            f"{source}: refused: {where}.{name} = {_shown(value)}: {what}; fairseq would build (and allocate) "
            "that model before comparing it with the weights. Nothing in the checkpoint was run.")

    for name, value in fields.items():
        side = name.split("_")[0] if name in ("encoder_layers", "decoder_layers") else None
        if side and type(value) is int and value > layers[side]:
            refuse(name, value, f"more than the {layers[side]} {side} layers its weights hold")
        if name in ("encoder_layers_to_keep", "decoder_layers_to_keep") and value is not None:
            held = layers[name.split("_")[0]]
            kept = value.split(",") if type(value) is str and _KEEP.fullmatch(value) else (
                value if type(value) is list and all(type(i) is int and i >= 0 for i in value) else None)
            if kept is None or len(kept) > held or any(int(i) >= held for i in kept):
                refuse(name, value, f"not a comma-separated list of the {held} {name.split('_')[0]} layers its "
                                    "weights hold")
        if name in ("base_layers", "base_sublayers") and type(value) is int and value > max(layers.values()):
            refuse(name, value, f"more than the {max(layers.values())} layers its weights hold")
        if not name.endswith(_SIZED) or side or name.startswith("base_"):
            continue
        limit = LIMIT_POSITIONS if name in ("max_source_positions", "max_target_positions") else (
            max(largest, LIMIT_UNSTORED_POSITIONS) if name.endswith("_positions") else largest)
        values = value if type(value) in (list, tuple) else [value]
        if any(type(v) is int and (v > limit or (v < 1 and name.endswith(("_dim", "_heads")))) for v in values):
            refuse(name, value, "less than 1" if min(values) < 1 else
                   f"more than the largest dimension of its weights ({largest})" if limit == largest else
                   f"more than {limit} positions (its weights' largest dimension: {largest})")
