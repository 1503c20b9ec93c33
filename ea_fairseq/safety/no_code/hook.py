"""The plugin's checkpoint loader (:func:`sanitize`, :func:`load_checkpoint`) and what puts it
in front of ``fairseq.checkpoint_utils.load_checkpoint_to_cpu`` (:func:`checkpoint_loader`,
installed by :mod:`ea_fairseq.side_effects`)."""
import argparse
import logging
import threading
from typing import Any, Dict, List, Mapping

import torch

from ..budget import configuration_read, reading, weights_read
from .consistency import check_model_matches, check_training_state, check_upgradable
from .fields import shown_key, shown_text
from .plain import LIMIT_AMPLIFICATION, _Walk
from .reading import CheckpointError, UnsafeCheckpointError, _shown, read_checkpoint
from .schema import Generator

logger = logging.getLogger(__name__)


def sanitize(state: Dict[str, Any], source: str, *, build_check: bool = True) -> Dict[str, Any]:
    """``state`` with the configuration fairseq receives generated from the checkpoint's
    (:class:`~.schema.Generator`; ``args`` None, ``cfg`` a dict of typed sections), the rest of
    the state bounded; or :class:`CheckpointError`.
    ``build_check``: also build the configured model on ``meta`` and require it to take the
    weights and training state (:mod:`.consistency`), for a caller that builds the model or
    resumes training from it; a tool that only reads the weights (averaging) leaves it to the
    load that builds the model."""
    source = shown_text(source)
    walk = _Walk(source)
    out = dict(state)
    config_roots = [root for root in ("args", "cfg") if state.get(root) is not None]
    for key, value in state.items():
        if key not in config_roots:
            out[key] = walk.bounded(value, f"[{key!r}]")
    stored = sum(walk.storages.values())
    if walk.tensor_bytes > LIMIT_AMPLIFICATION * stored + (1 << 20):
        raise UnsafeCheckpointError(
            f"{source}: refused: its tensors declare {walk.tensor_bytes} bytes over {stored} bytes of "
            "stored data (many views of the same storage). Nothing in the checkpoint was run.")
    for root in config_roots:
        out[root] = walk.plain(state[root], root)[0]
    if not config_roots:
        return out
    generator = Generator(source)
    out["cfg"] = generator.generate(out.get("cfg"), out.get("args"))
    out["args"] = None
    _check_received(out["cfg"], source)
    if build_check:
        check_model_matches(out["cfg"], out.get("model"), source)
        check_training_state(out, source)
    generator.log()
    return out


def _check_received(cfg: Dict[str, Any], source: str) -> None:
    """The configuration as fairseq receives it (``OmegaConf.create``, as fairseq's loader
    calls it) holds no interpolation: nothing in it is resolved when fairseq reads it."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    def walk(node, path):
        if isinstance(node, (DictConfig, ListConfig)):
            keys = node.keys() if isinstance(node, DictConfig) else range(len(node))
            for key in keys:
                child = node._get_node(key)
                if child._is_interpolation():
                    raise UnsafeCheckpointError(f"{source}: refused: {path}.{key} = {_shown(child._value())}: "
                                                "an omegaconf interpolation. Nothing in the checkpoint was run.")
                walk(child if isinstance(child, (DictConfig, ListConfig)) else child._value(), f"{path}.{key}")
        elif type(node) is argparse.Namespace:
            walk(OmegaConf.create(vars(node), flags={"allow_objects": True}), path)
        elif type(node) is str and "${" in node:
            raise UnsafeCheckpointError(f"{source}: refused: {path} = {_shown(node)}: an omegaconf "
                                        "interpolation. Nothing in the checkpoint was run.")

    walk(OmegaConf.create(cfg, flags={"allow_objects": True}), "cfg")


def load_checkpoint(path: str, *, build_check: bool = True) -> Dict[str, Any]:
    """A fairseq checkpoint read onto the CPU, weights-only, and sanitized (:func:`sanitize`)."""
    source = shown_text(str(path))  # the name every message gives it (a file name is input too)
    return sanitize(read_checkpoint(path, source), source, build_check=build_check)


def nonfinite_weights(model_state: Mapping[str, Any]) -> List[str]:
    """Names of the floating-point tensors of ``model_state`` holding NaN or infinity, as a
    message shows them (:func:`~.fields.shown_key`: a name from the file writes no line of its own)."""
    return [shown_key(name) for name, value in model_state.items()
            if torch.is_tensor(value) and value.is_floating_point() and not bool(torch.isfinite(value).all())]


# -- fairseq's loader -------------------------------------------------------------------
_pending = threading.local()  # per thread: the states its open load_checkpoint_to_cpu calls read here
_TAKEN = object()


class _TorchForCheckpointUtils:
    """What ``fairseq.checkpoint_utils`` sees as ``torch`` (:func:`torch_for_checkpoint_utils`):
    torch itself, except that ``load`` called in a thread inside the plugin's
    ``load_checkpoint_to_cpu`` returns the state that call read and sanitized (once). In every
    other thread, and outside that call, ``load`` is ``torch.load``: no state is shared between
    threads, nothing is swapped for the duration of a call."""

    def load(self, *args, **kwargs):
        states = getattr(_pending, "states", None)
        if not states:
            return torch.load(*args, **kwargs)
        if states[-1] is _TAKEN:
            raise CheckpointError("fairseq read a second file in one load_checkpoint_to_cpu call")
        state, states[-1] = states[-1], _TAKEN
        return state

    def __getattr__(self, name):
        return getattr(torch, name)

    def __repr__(self):
        return f"<torch for fairseq.checkpoint_utils, through ea_fairseq: {torch!r}>"


def torch_for_checkpoint_utils(original) -> _TorchForCheckpointUtils:
    """The ``torch`` of ``fairseq.checkpoint_utils`` (``original``: torch itself) that hands
    fairseq's own function the state :func:`checkpoint_loader` read."""
    return _TorchForCheckpointUtils()


def checkpoint_loader(original):
    """``fairseq.checkpoint_utils.load_checkpoint_to_cpu`` (``original``) reading every
    checkpoint through the plugin (installed by :mod:`ea_fairseq.side_effects`).

    fairseq's tools, its trainer and ``load_model_ensemble_and_task`` (hence the hub) call
    that function through its module, so replacing it there reaches them all. The replacement
    reads the file (:func:`read_checkpoint`), sanitizes it (:func:`sanitize`) and runs
    fairseq's own function on that state: its ``torch.load`` returns the sanitized state
    instead of reading the file again (:class:`_TorchForCheckpointUtils`, keyed by thread), so
    fairseq's conversions and overrides apply to what was checked, and nothing else. fairseq
    has no hook on this path (docs/fairseq-internals.md); both replacements act only inside
    this function's call, in its thread.

    Not through here: in multi-process training, fairseq's trainer reads a checkpoint on rank
    0 and sends it to the other ranks with ``distributed_utils.broadcast_object``, which
    unpickles with ``torch.load``; torch's weights-only default refuses fairseq's own
    ``_TensorPlaceholder`` there (with or without this plugin), so such a resume stops on
    the other ranks. ``--load-checkpoint-on-all-dp-ranks`` makes every rank read the file
    through this loader instead.
    """
    from fairseq.file_io import PathManager

    def load_checkpoint_to_cpu(path, arg_overrides=None, load_on_all_ranks=False):
        source = shown_text(str(path))  # the name every message gives it (a file name is input too)
        reading()  # the budget of the checkpoint read before this one in the same loading ends
        state = sanitize(read_checkpoint(PathManager.get_local_path(path), source), source)
        check_upgradable(state, source)  # what fairseq's own upgrade indexes before anything else
        weights_read(source, state.get("model"))  # the model fairseq builds next is budgeted by them
        states = _pending.__dict__.setdefault("states", [])
        states.append(state)
        try:
            loaded = original(path, arg_overrides, load_on_all_ranks)
        finally:
            states.pop()
        configuration_read(loaded)  # a build given its model configuration is budgeted too
        return loaded

    return load_checkpoint_to_cpu
