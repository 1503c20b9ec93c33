"""``fairseq-hydra-train``'s run checked before it starts, its refusals printed as one line.

fairseq-hydra-train imports the plugin only inside the training job: after hydra has created
the run directory (the recipe configs put it at ``checkpoint.save_dir``) and after fairseq's
distributed set-up has asserted on the device count. A refusal there is a traceback under
hydra's report (``world size is 8 but have 0 available devices``, ``Torch not compiled with
CUDA enabled``, the plugin's own option errors) and leaves a directory without checkpoints
behind. :class:`RunChecks` is a hydra callback, named by every recipe config under
``hydra.callbacks``; once hydra has composed the configuration, before the job starts and
before any directory exists (hydra's ``on_run_start``), it

* refuses a key of any other section that fairseq's configuration does not define
  (``+optimization.lrr=0.1``: fairseq would train without reading it), naming the closest
  key (:func:`check_keys`);
* builds the model fairseq would build from ``cfg.model`` on the ``meta`` device, with the
  plugin's own code, so that an option of the model's arch it refuses
  (:class:`~ea_fairseq.errors.OptionError`) stops the run;
* refuses what the machine cannot run (:mod:`ea_fairseq.device_checks`, as fairseq-train's
  command line does): fp16 or bf16 where torch sees no CUDA GPU (or ``common.cpu=true``; amp,
  ``memory_efficient_fp16`` and ``fp16_no_flatten_grads`` train on a CPU), ``common.tpu=true``
  without torch_xla, and a ``distributed_world_size`` above the GPUs visible when fairseq
  would start the processes itself (not under torchrun or Slurm), naming the overrides that
  run the config here.

A refusal is one line, ``fairseq-hydra-train: error: ...``, and exit status 1. When the job
itself fails (``on_job_end``), the run directory is removed if this run created it and it
holds nothing but hydra's log and config, with the parents hydra made for it (left empty),
and an ``OptionError`` (or another of the plugin's one-line errors: a checkpoint refused, a data
directory that is not there) is printed as one line too; other errors are reported by fairseq
and hydra as they are.
"""
import copy
import dataclasses
import os
import shutil
import sys
from typing import Any, Dict, Optional

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from .device_checks import HYDRA, refusal
from .errors import OptionError, did_you_mean


def refuse(message: str) -> None:
    """End the process with ``message`` as one line (hydra's report catches ``Exception``
    only, so ``SystemExit`` reaches the interpreter, which prints it)."""
    program = os.path.basename(sys.argv[0] or "") or "fairseq-hydra-train"
    raise SystemExit(f"{program}: error: {message}")


def job_config(config: DictConfig) -> DictConfig:
    """The configuration fairseq's training receives: hydra's section removed (as hydra's
    ``run_job`` does), fairseq's defaults added and every value resolved (as
    ``fairseq_cli.hydra_train`` does)."""
    from fairseq.dataclass.initialize import add_defaults
    from fairseq.dataclass.utils import omegaconf_no_object_check

    cfg = copy.deepcopy(config)
    with read_write(cfg), open_dict(cfg):
        del cfg["hydra"]
    add_defaults(cfg)
    with omegaconf_no_object_check():
        cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True))
    OmegaConf.set_struct(cfg, True)
    return cfg


def _section_fields(section: str, value) -> Optional[Dict[str, Any]]:
    """The fields of the dataclass fairseq reads ``section`` of its configuration into (a
    registry's choice, by its ``_name``, for task, criterion, optimizer, ...); None where
    fairseq has none (a choice without a dataclass, the model: :func:`check_model`)."""
    from fairseq.dataclass.configs import FairseqConfig
    from fairseq.registry import REGISTRIES
    from fairseq.tasks import TASK_DATACLASS_REGISTRY

    field = FairseqConfig.__dataclass_fields__[section]
    if field.type is not Any:
        return field.type.__dataclass_fields__ if dataclasses.is_dataclass(field.type) else None
    name = value if isinstance(value, str) else value.get("_name") if isinstance(value, DictConfig) else None
    if section == "task":
        dc = TASK_DATACLASS_REGISTRY.get(name)
    elif section in REGISTRIES:
        dc = REGISTRIES[section]["dataclass_registry"].get(name)
    else:
        return None
    return None if dc is None else dc.__dataclass_fields__


def check_keys(config: DictConfig) -> None:
    """Every key of the run's configuration outside ``model`` and ``hydra`` is a field of the
    section fairseq reads it into: a typo (``+optimization.lrr=0.1``) stops the run, where
    fairseq would ignore it (its fixed sections) or fail in a traceback (task, criterion, ...)."""
    from fairseq.dataclass.configs import FairseqConfig

    sections = [k for k in FairseqConfig.__dataclass_fields__ if k != "_name"]
    for section in config:
        if section in ("hydra", "model", "_name"):
            continue
        if section not in sections:
            hint = did_you_mean(str(section), sections)
            refuse(f"{section}: not a section of fairseq's configuration{hint}; the sections are "
                   f"{', '.join(sections)}")
        value = config[section]
        fields = _section_fields(section, value)
        if fields is None or not isinstance(value, DictConfig):
            continue
        for key in value:
            if key == "_name" or key in fields:
                continue
            hint = did_you_mean(str(key), fields, f"{section}.")
            chosen = f" {value.get('_name')}" if value.get("_name") else ""
            arch = OmegaConf.select(config, "model._name", default=None) or "ARCH"
            where = (f"`ea-fairseq-options {arch} --all --{section.replace('_', '-')}{chosen}`"
                     if chosen else "`fairseq-train --help`")
            refuse(f"{section}.{key}: not an option of fairseq's {section}{chosen}{hint}; {where} lists "
                   "them (option --a-b is key a_b)")


def check_model(cfg: DictConfig) -> None:
    """Build ``cfg.model`` as fairseq's training does, on the ``meta`` device (no memory, no
    data: a placeholder dictionary), when its arch is one of the plugin's models; an
    ``OptionError`` ends the run, any other failure is left to the real build."""
    from fairseq.models import ARCH_MODEL_REGISTRY

    from .models.building import build_on_meta
    from .models.ea_transformer import EATransformerModel

    arch = cfg.model.get("_name") if cfg.get("model") is not None else None
    model_class = ARCH_MODEL_REGISTRY.get(arch)
    if model_class is None or not issubclass(model_class, EATransformerModel):
        return
    try:
        build_on_meta(cfg.model, 64, 64)
    except OptionError as error:
        refuse(str(error))
    except Exception:  # noqa: BLE001  (not an option the plugin refuses: fairseq reports it)
        return


def check_devices(cfg: DictConfig) -> None:
    """Precision and process count against the devices torch sees here
    (:func:`ea_fairseq.device_checks.refusal`, fairseq-train's check too), in one line naming
    the overrides that run the config on this machine."""
    message = refusal(cfg, HYDRA)
    if message:
        refuse(message)


def _only_hydra_files(directory: str) -> bool:
    """The run directory holds hydra's config (``.hydra``) and log files, nothing else."""
    try:
        names = os.listdir(directory)
    except OSError:
        return False
    return all(name == ".hydra" or name.endswith(".log") for name in names)


def _outermost_missing(path: str) -> Optional[str]:
    """The outermost of ``path`` and its parents that does not exist yet; None if it exists."""
    path, missing = os.path.abspath(path), None
    while not os.path.exists(path) and os.path.dirname(path) != path:
        missing, path = path, os.path.dirname(path)
    return missing


def _remove_run_directory(run_dir: str, created: str) -> None:
    """``run_dir`` and its parents up to ``created``, the directories hydra made for the run."""
    shutil.rmtree(run_dir, ignore_errors=True)
    parent = os.path.dirname(os.path.abspath(run_dir))
    while parent == created or parent.startswith(created + os.sep):
        try:
            os.rmdir(parent)  # only while empty
        except OSError:
            return
        parent = os.path.dirname(parent)


class RunChecks(Callback):
    """The hydra callback of the recipe configs (``hydra.callbacks``); see the module."""

    def __init__(self) -> None:
        self.created: Optional[str] = None  # the outermost directory the run will make

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        try:
            run_dir = OmegaConf.select(config, "hydra.run.dir")
            self.created = None if run_dir is None else _outermost_missing(str(run_dir))
        except Exception:  # noqa: BLE001  (e.g. a ${hydra:...} value not resolvable yet: no checks)
            return
        check_keys(config)  # before fairseq's defaults are merged in (a typo there is a traceback)
        try:
            cfg = job_config(config)
        except Exception:  # noqa: BLE001
            return
        check_model(cfg)
        check_devices(cfg)

    def on_job_end(self, config: DictConfig, job_return, **kwargs) -> None:
        from hydra.core.utils import JobStatus

        if job_return.status != JobStatus.FAILED:
            return
        run_dir = OmegaConf.select(config, "hydra.runtime.output_dir")
        if run_dir and self.created and _only_hydra_files(str(run_dir)):
            _remove_run_directory(str(run_dir), self.created)  # a failed run leaves no directory
        # the job's exception, without JobReturn.return_value, which prints hydra's report;
        # in a sweep (-m) hydra reports it, and the other jobs go on
        error = getattr(job_return, "_return_value", None)
        one_line = isinstance(error, OptionError) or getattr(type(error), "one_line", False)
        if one_line and str(OmegaConf.select(config, "hydra.mode")) != "RunMode.MULTIRUN":
            refuse(str(error))
