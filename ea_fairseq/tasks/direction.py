"""A checkpoint decoded in another direction than it was trained for: one warning line.

With a joint dictionary fairseq loads an es->en checkpoint for ``fairseq-generate -s en -t es``
(or ``fairseq-interactive``), translates and prints BLEU without a word: the dictionaries fit,
and neither the task nor the model knows the direction the weights were trained for. Only
``checkpoint_utils.load_model_ensemble_and_task`` holds both the command line's task and the
checkpoint's configuration (``cfg.task.source_lang`` / ``target_lang``, as ``fairseq-train``
stored them), for every model and task, fairseq's or the plugin's. :func:`direction_checked`
wraps it (a row of :data:`ea_fairseq.side_effects.SIDE_EFFECTS`, in the command lines the
plugin serves): after fairseq's own function has loaded the ensemble, languages that differ
are one logging warning, once per process and pair of directions. Nothing is refused and
nothing loaded is changed.

Not seen: a checkpoint trained without ``--source-lang``/``--target-lang`` (fairseq infers the
pair from the data directory and stores None), languages overridden by ``--model-overrides``
or the hub's ``source_lang=`` (fairseq writes those into the checkpoint's configuration before
this sees it), and, in an ensemble, any checkpoint but the last (fairseq returns the last's
configuration).
"""
import functools
import logging
from typing import Optional, Tuple

logger = logging.getLogger(__name__)
_warned = set()  # (trained, decoded) pairs already warned of in this process


def _pair(section) -> Optional[Tuple[str, str]]:
    """(source, target) languages of a task configuration, or None where either is unknown."""
    if section is None:
        return None
    source, target = getattr(section, "source_lang", None), getattr(section, "target_lang", None)
    if isinstance(source, str) and isinstance(target, str) and source and target:
        return source, target
    return None


def directions(checkpoint_cfg, task) -> Optional[Tuple[Tuple[str, str], Tuple[str, str]]]:
    """(trained, decoded) language pairs where the checkpoint's configuration ``checkpoint_cfg``
    names another direction than ``task`` decodes; None where they agree or either is unknown."""
    trained = _pair(getattr(checkpoint_cfg, "task", None))
    decoded = _pair(getattr(task, "cfg", None))
    if trained is None or decoded is None or trained == decoded:
        return None
    return trained, decoded


def warning(path: str, trained: Tuple[str, str], decoded: Tuple[str, str]) -> str:
    (cs, ct), (ts, tt) = trained, decoded
    return (f"{path} was trained to translate {cs}->{ct} (--source-lang {cs} --target-lang {ct}) but this run "
            f"translates {ts}->{tt}: its output is no {ts}->{tt} translation; give -s {cs} -t {ct}, or a "
            f"checkpoint trained for {ts}->{tt}")


def direction_checked(original):
    """``checkpoint_utils.load_model_ensemble_and_task`` (``original``), which warns when the
    task it is given decodes another direction than the checkpoint was trained for."""

    @functools.wraps(original)
    def load(filenames, arg_overrides=None, task=None, *args, **kwargs):
        result = original(filenames, arg_overrides, task, *args, **kwargs)
        if task is not None and filenames:  # (without a task fairseq builds the checkpoint's own)
            found = directions(result[1], task)
            if found is not None and found not in _warned:
                _warned.add(found)
                logger.warning(warning(str(filenames[-1]), *found))
        return result

    return load
