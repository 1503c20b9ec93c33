"""What checkpoints must share before their weights are averaged: the model and the data.

Weights of the same shapes can belong to different models: other head counts, another
activation function, pre- instead of post-norm, or embeddings of another dictionary of the
same size. Their average is a model of neither and translates badly without a word. So:

* **the model**: each input's model configuration (``cfg.model``, fairseq-hydra-train's
  dict layout or the legacy ``args``) is completed with its architecture's defaults and the
  plugin's (``fill_defaults``), as fairseq and the plugin do before they build the model, and
  every option the architecture's model class defines (``add_args``: dimensions, layers,
  heads, activation, normalisation, dropout, the plugin's mechanisms, ...) and the arch
  itself must be equal (an attention on fairseq's module or on the plugin's path, ``vanilla``
  or ``dot_product``, is one attention: the same parameters and math), except the options of
  :data:`NOT_THE_MODEL`, which say how the model was trained or run (memory, speed,
  precision), not what its weights mean;
* **the data**: a checkpoint records no checksum of its dictionaries, only its task, the
  data directory it was trained on and its languages (``cfg.task``); those must be equal, the
  directory compared as recorded and never opened. Inputs trained on data recorded under
  different names (a moved data-bin) are averaged when ``--data-dirs`` names each input's data
  directory and their ``dict.*.txt`` files have equal SHA-256 checksums. Dictionaries that
  changed under one directory name are not seen.

A difference stops the run with one line naming the first differences.
"""
import argparse
import copy
import hashlib
import os
import stat
from typing import Any, Dict, List, Mapping, Optional, Sequence


#: Options that change how a model is trained or run, never what its weights mean, so
#: checkpoints that differ only in them hold one model and are averaged: recomputing each
#: layer's activations in the backward pass and keeping them on the CPU meanwhile (memory),
#: FSDP's wrapping threshold (how parameters are sharded), torch's LayerNorm instead of the
#: fused one (``export``: the same parameters and math), and precision (fp16, bf16, amp and
#: their memory-efficient forms: fairseq saves the weights in float32 whatever the precision,
#: ``utils.move_to_cpu``). fairseq keeps the precision flags in ``cfg.common``, which is not
#: compared; they are named here for a model that declares them as its own options.
NOT_THE_MODEL = frozenset({
    "checkpoint_activations", "offload_activations",  # memory
    "min_params_to_wrap",  # FSDP sharding
    "export",  # LayerNorm's implementation
    "fp16", "bf16", "amp", "memory_efficient_fp16", "memory_efficient_bf16",  # precision
})


class InputMismatch(ValueError):
    """Inputs that do not hold the same model or were trained on different data."""


def _section(state: Mapping, name: str):
    cfg = state.get("cfg")
    if isinstance(cfg, Mapping) and cfg.get(name) is not None:
        return cfg[name]
    return state.get("args")


def model_options(state: Mapping, path: str) -> Optional[Dict[str, Any]]:
    """The options that define the model in ``state``, with the arch's defaults (not those of
    :data:`NOT_THE_MODEL`); None if the checkpoint holds no model configuration."""
    from fairseq.models import ARCH_CONFIG_REGISTRY, ARCH_MODEL_REGISTRY

    from ..safety.no_code import architecture
    from ..models import attention_variants as variants
    from ..models.ea_transformer import EATransformerModel
    from ..models.hydra_config import namespace_from_config, option_actions

    section = _section(state, "model")
    if section is None:
        return None
    if isinstance(section, Mapping):  # fairseq-hydra-train's layout
        name = architecture(section)
        if name not in ARCH_MODEL_REGISTRY:
            raise InputMismatch(f"{path}: model configuration of unknown architecture {name!r}")
        try:
            section = namespace_from_config(section, ARCH_MODEL_REGISTRY[name])
        except ValueError as err:
            raise InputMismatch(f"{path}: {err}") from None
    if not isinstance(section, argparse.Namespace):
        raise InputMismatch(f"{path}: the model configuration is a {type(section).__name__}, not fairseq's")
    args = copy.deepcopy(section)
    arch = args.arch = architecture(args)  # the one fairseq builds
    if arch not in ARCH_CONFIG_REGISTRY:
        raise InputMismatch(f"{path}: model configuration of unknown architecture {arch!r}")
    ARCH_CONFIG_REGISTRY[arch](args)  # the configuration fairseq builds the model from
    model = ARCH_MODEL_REGISTRY[arch]
    if issubclass(model, EATransformerModel):
        variants.fill_defaults(args)  # what the plugin's build_model fills in
        for role in variants.ROLES:  # the same attention on fairseq's module or the plugin's path
            setattr(args, f"{role}_attention", variants.computed_attention(args, role))
    fields = sorted(set(option_actions(model)) - NOT_THE_MODEL)
    return {"arch": arch, **{name: getattr(args, name, None) for name in fields}}


def data_record(state: Mapping) -> Dict[str, Any]:
    """The task, data directory and languages the checkpoint records."""
    task = _section(state, "task")
    if isinstance(task, Mapping):  # cfg.task
        name, get = task.get("_name"), task.get
    else:  # the legacy args: every option of fairseq-train, the task's name in ``task``
        name, get = getattr(task, "task", None), (lambda key: getattr(task, key, None))
    return {"task": name, "data": get("data"), "source_lang": get("source_lang"),
            "target_lang": get("target_lang")}


def _differences(mine: Mapping, theirs: Mapping) -> List[str]:
    return [f"{'--' + k.replace('_', '-') if k != 'arch' else '--arch'} is {mine.get(k)!r} there, "
            f"{theirs.get(k)!r} in" for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k)]


def _refuse(path: str, first: str, differences: List[str], what: str, hint: str = "") -> InputMismatch:
    shown = "; ".join(f"{d} {first}" for d in differences[:3])
    more = f" (and {len(differences) - 3} more)" if len(differences) > 3 else ""
    return InputMismatch(f"{path} holds {what} than {first}: {shown}{more}; average checkpoints of "
                         f"one model{hint}")


def check_same(path: str, state: Mapping, first: str, reference: Mapping, data_checked: bool) -> None:
    """Refuse ``state`` (read from ``path``) unless it holds the model ``reference`` (read from
    ``first``) holds, trained on the same data (recorded names; see ``data_checked``)."""
    mine, theirs = model_options(state, path), model_options(reference, first)
    if (mine is None) != (theirs is None):
        which, other = (path, first) if mine is None else (first, path)
        raise InputMismatch(f"{which} holds no model configuration, {other} does; average "
                            "checkpoints of one model")
    if mine is not None and mine != theirs:
        raise _refuse(path, first, _differences(mine, theirs), "another model")
    differences = _differences(data_record(state), data_record(reference))
    if data_checked:
        differences = [d for d in differences if not d.startswith("--data ")]
    if differences:
        raise _refuse(path, first, differences, "a model trained on other data",
                      hint=" (if the data directories hold the same dictionaries, name each "
                           "input's with --data-dirs)" if any(d.startswith("--data ") for d in differences) else "")


LIMIT_DICT_BYTES = 1 << 30


def dictionary_checksums(directory: str) -> Dict[str, str]:
    """SHA-256 of every ``dict.*.txt`` in ``directory`` (regular files only: never a FIFO)."""
    if not os.path.isdir(directory):
        raise InputMismatch(f"--data-dirs {directory}: not a directory")
    sums = {}
    for name in sorted(os.listdir(directory)):
        if not (name.startswith("dict.") and name.endswith(".txt")):
            continue
        path = os.path.join(directory, name)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode) or info.st_size > LIMIT_DICT_BYTES:
                raise InputMismatch(f"{path}: not a regular dictionary file of at most {LIMIT_DICT_BYTES} bytes")
            digest = hashlib.sha256()
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        sums[name] = digest.hexdigest()
    if not sums:
        raise InputMismatch(f"--data-dirs {directory}: no dict.*.txt in it")
    return sums


def check_dictionaries(paths: Sequence[str], directories: Sequence[str]) -> None:
    """Refuse unless the data directories given for the inputs hold the same dictionaries."""
    if len(directories) != len(paths):
        raise InputMismatch(f"--data-dirs names {len(directories)} directories for {len(paths)} "
                            "inputs: give one per input, in the inputs' order")
    reference = dictionary_checksums(directories[0])
    for path, directory in zip(paths[1:], directories[1:]):
        sums = dictionary_checksums(directory)
        differ = sorted(n for n in set(sums) | set(reference) if sums.get(n) != reference.get(n))
        if differ:
            raise InputMismatch(f"{path} was trained with other dictionaries than {paths[0]}: "
                                f"{', '.join(differ)} differ between {directory} and {directories[0]}; "
                                "average checkpoints of one model")
