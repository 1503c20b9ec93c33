"""What a fairseq run asks of the machine's devices, checked before the run starts.

fairseq fails deep inside a run that asks for devices the machine lacks, after it has written
its save dir or run directory: ``--fp16`` in ``torch.cuda.current_device()`` (the flattened
fp32 copy of ``FP16Optimizer``, fairseq's default for fp16), ``--bf16`` (which fairseq's
command line turns into ``--tpu``) and ``--tpu`` where torch_xla is not installed, a
``--distributed-world-size`` above the GPUs in an assertion of its process start.
:func:`refusal` names what the run asks, why it cannot run here and the settings that run
it, spelled for its caller: hydra's keys (:data:`HYDRA`, fairseq-hydra-train's run callback in
:mod:`ea_fairseq.hydra_checks`) or fairseq's options (:data:`COMMAND_LINE`, for
:func:`checked_call_main`, a row of :mod:`ea_fairseq.side_effects`).

Refused are the runs that fail: precision where torch sees no CUDA GPU or the run is told to
use the CPU (``--cpu``, ``common.cpu=true``), except the forms fairseq trains on a CPU
(``--amp``, whose autocast turns itself off there, ``--memory-efficient-fp16`` and
``--fp16-no-flatten-grads``, in float16).
"""
import functools
import importlib.util
import inspect
import os
from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple

from .errors import OptionError

Setting = Tuple[str, str, object]  # (section, key, value) of fairseq's configuration


class Spelling(NamedTuple):
    """How a caller's user writes settings: one (``setting``), and the settings that run it
    here (``fixes``: "run with ..."); ``bf16_sets_tpu``: fairseq's command line turns
    ``--bf16`` into ``--tpu``; ``whose``: whose batch ``--update-freq`` keeps."""

    setting: Callable[[Setting], str]
    fixes: Callable[[Sequence[Setting]], str]
    bf16_sets_tpu: bool
    whose: str


def _key_value(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return f"[{','.join(map(str, value))}]"
    return str(value)


def _key(setting: Setting) -> str:
    section, key, value = setting
    return f"{section}.{key}={_key_value(value)}"


def _option(setting: Setting) -> str:
    _, key, value = setting
    option = "--" + key.replace("_", "-")
    if value is True:
        return option
    return f"{option} {' '.join(map(str, value)) if isinstance(value, (list, tuple)) else value}"


HYDRA = Spelling(_key, lambda fixes: "run with " + " ".join(map(_key, fixes)), False, "the config's")
COMMAND_LINE = Spelling(
    _option,
    lambda fixes: "run " + " and ".join(f"without --{key.replace('_', '-')}" if value is False
                                        else f"with {_option((section, key, value))}"
                                        for section, key, value in fixes),
    True, "the command line's")


def _single_node_spawn(dist) -> bool:
    """Whether fairseq would start the processes itself on this machine (its
    ``_infer_single_node_init``), which asserts the world size against the GPUs here."""
    if dist.get("distributed_init_method") is not None or dist.get("pipeline_model_parallel"):
        return False
    if all(key in os.environ for key in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")):
        return False  # torchrun / torch.distributed.launch
    slurm = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST")
    return not (dist.get("distributed_port", -1) > 0 and slurm)


def _cuda_precision(common, dist) -> List[str]:
    """The precision flags set that fairseq's trainer runs on a CUDA GPU only: fp16 through
    ``FP16Optimizer``'s flattened copy (not with ``memory_efficient_fp16``, ``amp``,
    ``fp16_no_flatten_grads``, bf16 or a fully sharded model) and bf16 off a TPU."""
    if common.get("tpu"):
        return []
    flattened = not any(common.get(flag) for flag in ("memory_efficient_fp16", "memory_efficient_bf16", "amp",
                                                      "fp16_no_flatten_grads", "bf16"))
    flags = ["fp16"] if common.get("fp16") and flattened and dist.get("ddp_backend") != "fully_sharded" else []
    return flags + [flag for flag in ("bf16", "memory_efficient_bf16") if common.get(flag)]


def refusal(cfg, spelling: Spelling, training: bool = True) -> Optional[str]:
    """Why the run configured by ``cfg`` (fairseq's configuration: ``common``,
    ``distributed_training``, ``optimization``) cannot run on this machine, in one line naming
    the settings that run it here; None where it can. ``training``: the checks of precision
    (fairseq's trainer); the process count is checked for every run."""
    import torch

    common, dist = cfg.common, cfg.distributed_training
    if training and common.get("tpu") and importlib.util.find_spec("torch_xla") is None:
        flag = "bf16" if spelling.bf16_sets_tpu and common.get("bf16") else "tpu"
        sets = f" (fairseq's command line sets {spelling.setting(('common', 'tpu', True))} with it)" \
            if flag == "bf16" else ""
        return (f"{spelling.setting(('common', flag, True))} runs on a TPU{sets}, and torch_xla is not "
                f"installed: {spelling.fixes([('common', flag, False)])}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    asks: List[Setting] = []
    fixes: List[Setting] = []
    flags = _cuda_precision(common, dist) if training else []
    if flags and (gpus == 0 or common.get("cpu")):
        asks += [("common", flag, True) for flag in flags]
        fixes += [("common", flag, False) for flag in flags]
    world = dist.get("distributed_world_size", 1) or 1
    note = ""
    if world > max(gpus, 1) and _single_node_spawn(dist):
        asks.append(("distributed_training", "distributed_world_size", world))
        fixed = max(gpus, 1)
        fixes.append(("distributed_training", "distributed_world_size", fixed))
        update_freq = list(cfg.optimization.get("update_freq") or [1])
        if len(update_freq) == 1 and (world * update_freq[0]) % fixed == 0:
            keep = [world * update_freq[0] // fixed]
            note = f" ({spelling.setting(('optimization', 'update_freq', keep))} keeps {spelling.whose} batch)"
    if not asks:
        return None
    need = f"{world} CUDA GPUs" if world > max(gpus, 1) else "a CUDA GPU"
    if common.get("cpu"):
        where = f"{spelling.setting(('common', 'cpu', True))} trains on the CPU"
    else:
        where = f"torch sees {gpus} here (torch {torch.__version__}, built for CUDA: {torch.version.cuda or 'none'})"
    return (f"{' and '.join(map(spelling.setting, asks))} need{'s' if len(asks) == 1 else ''} {need}, and "
            f"{where}: {spelling.fixes(fixes)}{note}, or on {need}")


#: the modules of the ``main`` functions fairseq's command lines hand ``call_main``: training
#: (precision checked), hydra's (checked by the run callback, in hydra's spelling: passed on)
TRAINING = ("fairseq_cli.train",)
HYDRA_MAINS = ("fairseq_cli.hydra_train", "fairseq_cli.hydra_validate")


def checked_call_main(call_main):
    """``fairseq.distributed.utils.call_main`` (a row of
    :data:`ea_fairseq.side_effects.SIDE_EFFECTS`), which every fairseq command line that runs a
    model hands its configuration and its ``main``: a run this machine cannot run
    (:func:`refusal`) is an :class:`~ea_fairseq.errors.OptionError`, before fairseq writes its
    save dir or starts a process. While it runs, the checkpoints it names bound the dictionaries
    it reads before them (:func:`ea_fairseq.safety.budget.checkpoints_named`)."""

    def run(cfg, main, **kwargs):
        from .safety.budget import with_checkpoints_named

        module = getattr(inspect.unwrap(main), "__module__", None)
        if module not in HYDRA_MAINS:
            message = refusal(cfg, COMMAND_LINE, training=module in TRAINING)
            if message:
                raise OptionError(message)
        # in this process or in each process fairseq starts for a device (they read the dictionaries too)
        return call_main(cfg, functools.partial(with_checkpoints_named, main), **kwargs)

    return run
