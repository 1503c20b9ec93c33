"""The checkpoint's configuration must describe its weights, and its training state must be
what fairseq's trainer can read back.

:func:`check_model_matches` builds the model the generated configuration describes, with the
checkpoint's task, on torch's ``meta`` device (no memory;
:func:`~ea_fairseq.models.building.build_on_meta`, placeholder dictionaries as large as the
weights' embeddings) under the budget of its weights (:mod:`ea_fairseq.safety.budget`), and
loads the weights into it as fairseq does (``load_state_dict`` with ``strict=True``, which
upgrades and prunes them first): any exception, a missing or unexpected key or a shape that
differs is refused in one line naming the first difference, before fairseq builds anything.

:func:`check_training_state` reads what fairseq's trainer reads back on ``--restore-file``:
the metrics' meter classes (fairseq calls ``globals()[name]()`` in ``fairseq.logging.meters``:
only its ``Meter`` subclasses, each loading its stored state; their names plain names and their
states numbers, which fairseq adds to and logs in its progress lines), the update count, the best score
and the scheduler's numbers (numbers: fairseq compares every validation score with them) and the
criterion's and optimizer's class names (which fairseq prints when they do not match). The
optimizer's state, which generation never reads, is bounded only (:func:`check_optimizer_state`):
its layout is the trainer's (one flat float32 master tensor under ``--fp16``, Adafactor's factored
moments, a loss scale, ...), and fairseq's optimizer compares it with the parameters itself when
training resumes.
"""
import argparse
import re
import warnings
from typing import Any, Dict, Iterator, Mapping, Tuple

import numpy as np
import torch

from ..budget import Budget, BudgetError
from .reading import UnsafeCheckpointError, _shown

LIMIT_UPDATES = 10 ** 12  # far beyond any training run; fairseq schedules learning rates from it
#: the optimizer state's numbers per number of the weights (fairseq's optimizers keep at most three:
#: Adam's two moments and AMSGrad's maximum), plus :data:`LIMIT_OPTIMIZER_SLACK` (step counts,
#: scalars, a criterion's own parameters)
LIMIT_OPTIMIZER_FACTOR = 4
LIMIT_OPTIMIZER_SLACK = 1 << 20
_INTEGERS = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def _refuse(source: str, what: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(f"{source}: refused: {what}. Nothing in the checkpoint was run; if you "
                                 "wrote this checkpoint yourself, correct its configuration.")


def _vocabulary(weights: Mapping, side: str) -> int:
    """The rows of ``side``'s embedding (or output projection) holding data (a (10**9, 0)
    tensor, stored in no bytes, sizes nothing; the placeholder dictionaries store no symbol per
    row either, :class:`~ea_fairseq.models.building.SizedDictionary`)."""
    for key in (f"{side}.embed_tokens.weight", f"{side}.output_projection.weight"):
        if torch.is_tensor(weights.get(key)) and weights[key].dim() == 2 and weights[key].numel() > 0:
            return int(weights[key].shape[0])
    return 0


def meta_model(cfg: Dict[str, Any], weights: Mapping):
    """The model ``cfg`` (the generated configuration) describes, on the ``meta`` device."""
    from fairseq.tasks import TASK_REGISTRY
    from omegaconf import OmegaConf

    from ...models.building import build_on_meta

    received = OmegaConf.create(cfg, flags={"allow_objects": True})  # as fairseq's loader receives it
    task = received.get("task")
    task_class = TASK_REGISTRY.get(task.get("_name")) if task is not None else None
    source, target = _vocabulary(weights, "encoder"), _vocabulary(weights, "decoder")
    return build_on_meta(received.model, source or target, target or source, task_class, task), received


def check_model_matches(cfg: Dict[str, Any], weights: Any, source: str):
    """Refuse a configuration fairseq cannot build, or whose model is not the weights'."""
    if not isinstance(weights, Mapping) or cfg.get("model") is None:
        return None
    if not (_vocabulary(weights, "encoder") or _vocabulary(weights, "decoder")):
        return None  # no embedding to size placeholder dictionaries by (a multilingual model's are
        # under models.PAIR.): fairseq's build, budgeted the same way, compares the weights
    try:
        with Budget.for_weights(weights, source):
            model, received = meta_model(cfg, weights)
    except BudgetError:
        raise
    except Exception as error:  # noqa: BLE001  (whatever fairseq would raise, said in one line)
        first = (str(error).strip().splitlines() or [""])[0][:300]
        raise _refuse(source, f"fairseq cannot build the model its configuration describes "
                              f"({type(error).__name__}: {first})") from None
    try:
        # names and shapes only: meta copies of the weights, no data read; one-element tensors
        # (fairseq's ``version`` buffers, which its state-dict upgrade reads with ``.item()``) as
        # stored, without torch's warning that copying them into meta parameters does nothing
        on_meta = {name: value.to("meta") if torch.is_tensor(value) and value.numel() > 1 else value
                   for name, value in weights.items()}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*to a meta parameter in the current model")
            model.load_state_dict(on_meta, strict=True, model_cfg=received.model)
    except Exception as error:  # noqa: BLE001
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        first = (lines[1] if len(lines) > 1 else lines[0] if lines else type(error).__name__)[:300]
        raise _refuse(source, f"its weights are not those of the model its configuration describes: {first}") \
            from None
    return model


def check_training_state(state: Mapping, source: str) -> None:
    """The trainer state fairseq reads back on ``--restore-file``."""
    _check_meters(state.get("extra_state"), source)
    _check_train_iterator(state.get("extra_state"), source)
    extra = state.get("extra_state")
    _check_ema(state, extra, source)
    if isinstance(extra, Mapping) and not _real(extra.get("best")):
        raise _refuse(source, f"extra_state['best'] = {_shown(extra.get('best'))}: not a number (fairseq compares "
                              "every validation score with it)")
    elapsed = extra.get("previous_training_time") if isinstance(extra, Mapping) else None
    if elapsed is not None and not (type(elapsed) in (int, float) and 0 <= elapsed < float("inf")):
        raise _refuse(source, f"extra_state.previous_training_time = {_shown(elapsed)}: not a number of seconds")
    history = state.get("optimizer_history")
    if type(history) is list and history:
        last = history[-1]
        updates = last.get("num_updates") if type(last) is dict else None
        if updates is not None and not (type(updates) is int and 0 <= updates <= LIMIT_UPDATES):
            raise _refuse(source, f"optimizer_history[-1].num_updates = {_shown(updates)}: not an update "
                                  f"count (an int from 0 to {LIMIT_UPDATES})")
        for key in ("criterion_name", "optimizer_name"):  # fairseq prints them when they do not match
            name = last.get(key) if type(last) is dict else None
            if name is not None and not (type(name) is str and _CLASS_NAME.fullmatch(name)):
                raise _refuse(source, f"optimizer_history[-1].{key} = {_shown(name)}: not a class name "
                                      "([A-Za-z_][A-Za-z0-9_]*, what fairseq's trainer writes)")
        scheduler = last.get("lr_scheduler_state") if type(last) is dict else None
        if scheduler is not None and not (isinstance(scheduler, Mapping) and all(
                _real(value) for key, value in scheduler.items() if key in _SCHEDULER_NUMBERS)):
            raise _refuse(source, f"optimizer_history[-1].lr_scheduler_state = {_shown(scheduler)}: not a "
                                  "learning-rate scheduler's state (a dict of numbers: best, last_epoch, lr), which "
                                  "fairseq's scheduler compares validation losses with")
    check_optimizer_state(state, source)


def _check_ema(state: Mapping, extra: Any, source: str) -> None:
    """``--store-ema``'s copies (``ema``, ``ema_fp32_params``), which fairseq's trainer loads into
    a copy of the model on ``--restore-file``: the model's own names and shapes."""
    weights = state.get("model")
    if not isinstance(extra, Mapping) or not isinstance(weights, Mapping):
        return
    for key in ("ema", "ema_fp32_params"):
        copies = extra.get(key)
        if copies is None:
            continue
        if not isinstance(copies, Mapping):
            raise _refuse(source, f"extra_state[{key!r}] = {_shown(copies)}: not the model's weights (a dict of "
                                  "tensors), which fairseq loads into its EMA model")
        for name, value in copies.items():
            if not (torch.is_tensor(value) and name in weights and torch.is_tensor(weights[name])
                    and value.shape == weights[name].shape):
                raise _refuse(source, f"extra_state[{key!r}][{_shown(name)}]: not a weight of the model with its "
                                      f"shape (fairseq loads the EMA copy into the model)")


_CLASS_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,99}")
#: the numbers fairseq's learning-rate schedulers write and read back (``best``: compared with
#: every validation loss; ``last_epoch``: torch's ReduceLROnPlateau count; ``lr``)
_SCHEDULER_NUMBERS = ("best", "last_epoch", "lr")


_METRIC_NAME = re.compile(r"[A-Za-z0-9_.:/-]{1,100}")


def _numeric(value: Any) -> bool:
    """None, a real number or an array or tensor of real numbers (--eval-bleu's counts)."""
    if isinstance(value, np.ndarray):
        return value.dtype.kind in "biuf"
    if torch.is_tensor(value):
        return value.is_floating_point() or value.dtype in _INTEGERS
    return _real(value)


def _real(value: Any) -> bool:
    """None or one real number, as fairseq writes a best score: a Python, numpy or 0-dim tensor one."""
    if value is None or type(value) in (int, float):
        return True
    if isinstance(value, (np.integer, np.floating)):
        return True
    return torch.is_tensor(value) and value.dim() == 0 and (value.is_floating_point() or value.dtype in _INTEGERS[1:])


def check_upgradable(state: Mapping, source: str) -> None:
    """The layout fairseq's ``_upgrade_state_dict`` indexes in every checkpoint its loader reads
    (the hub, fairseq-generate, ``--restore-file``): ``optimizer_history`` a non-empty list of
    dicts (or the oldest layout's ``optimizer`` and ``best_loss``), ``extra_state`` a dict (or
    the oldest layout's ``epoch``, ``batch_offset`` and ``val_loss``); without them fairseq
    stops in a KeyError deep in its loader."""
    history = state.get("optimizer_history")
    if "optimizer_history" not in state and not {"optimizer", "best_loss"} <= set(state):
        raise _refuse(source, "no optimizer_history (nor the oldest layout's optimizer and best_loss): fairseq's "
                              "loader reads it in every checkpoint (a list of dicts, as fairseq's trainer writes "
                              "it; a converted model needs [{'criterion_name': ..., 'lr_scheduler_state': {}, "
                              "'num_updates': 0}] and extra_state {})")
    if "optimizer_history" in state and not (type(history) is list and history
                                             and all(isinstance(h, Mapping) for h in history)):
        raise _refuse(source, f"optimizer_history = {_shown(history)}: not fairseq's optimizer history (a "
                              "non-empty list of dicts), which fairseq's loader reads in every checkpoint")
    extra = state.get("extra_state")
    if "extra_state" not in state and not {"epoch", "batch_offset", "val_loss"} <= set(state):
        raise _refuse(source, "no extra_state (nor the oldest layout's epoch, batch_offset and val_loss): fairseq's "
                              "loader reads it in every checkpoint (a dict; {} where there is no training state)")
    if "extra_state" in state and not isinstance(extra, Mapping):
        raise _refuse(source, f"extra_state = {_shown(extra)}: not a dict, which fairseq's loader reads in every "
                              "checkpoint")


#: the data iterator's position fairseq's ``EpochBatchIterator.state_dict`` writes, and the type
#: each field must have: fairseq logs the epoch ("Loaded checkpoint ... (epoch N ...)"), picks
#: the data shard and the learning rate from it, and fast-forwards the iterator by the count
_ITERATOR_FIELDS = {"epoch": int, "iterations_in_epoch": int, "version": int, "shuffle": bool}
#: epochs are seeds too (fairseq adds the epoch to the run's seed, which numpy takes below 2**32)
LIMIT_EPOCHS = 10 ** 6


def _check_train_iterator(extra: Any, source: str) -> None:
    iterator = extra.get("train_iterator") if isinstance(extra, Mapping) else None
    if iterator is None:
        return
    if not isinstance(iterator, Mapping):
        raise _refuse(source, f"extra_state.train_iterator = {_shown(iterator)}: not the data iterator's "
                              "position fairseq writes (a dict)")
    for key, kind in _ITERATOR_FIELDS.items():
        value = iterator.get(key)
        limit = LIMIT_EPOCHS if key == "epoch" else LIMIT_UPDATES
        if value is not None and not (type(value) is kind and (kind is bool or 0 <= value <= limit)):
            bound = "True or False" if kind is bool else f"an int from 0 to {limit}"
            raise _refuse(source, f"extra_state.train_iterator[{key!r}] = {_shown(value)}: not {bound}")


def _check_meters(extra: Any, source: str) -> None:
    from fairseq.logging import meters

    metrics = extra.get("metrics") if isinstance(extra, Mapping) else None
    if metrics is None:
        return
    if not isinstance(metrics, Mapping):
        raise _refuse(source, f"extra_state.metrics = {_shown(metrics)}: not fairseq's metrics (a dict)")
    for name, entries in metrics.items():
        if not (type(name) is str and _METRIC_NAME.fullmatch(name)):
            raise _refuse(source, f"extra_state.metrics[{_shown(name)}]: not a metrics name ([A-Za-z0-9_.:/-], "
                                  "what fairseq writes; fairseq logs it)")
        for i, entry in enumerate(entries if type(entries) in (list, tuple) else [entries]):
            where = f"extra_state.metrics[{name!r}][{i}]"
            if type(entry) not in (list, tuple) or len(entry) != 4:
                raise _refuse(source, f"{where} = {_shown(entry)}: not a (priority, key, meter class, state) entry")
            if not (type(entry[1]) is str and _METRIC_NAME.fullmatch(entry[1])):
                raise _refuse(source, f"{where}: meter name {_shown(entry[1])}: not a metric name ([A-Za-z0-9_.:/-], "
                                      "what fairseq writes; fairseq logs it with its value)")
            if not (isinstance(entry[3], Mapping) and all(_numeric(v) for v in entry[3].values())):
                raise _refuse(source, f"{where}: meter state {_shown(entry[3])}: not a meter's numbers (None, "
                                      "numbers, numeric arrays; fairseq adds to them and logs them)")
            cls = getattr(meters, entry[2], None) if type(entry[2]) is str else None
            if not (isinstance(cls, type) and issubclass(cls, meters.Meter) and cls is not meters.Meter):
                raise _refuse(source, f"{where}: meter class {_shown(entry[2])}: not one of fairseq's meters "
                                      "(fairseq would call that name from its module)")
            try:
                cls().load_state_dict(entry[3])
            except Exception as error:  # noqa: BLE001
                raise _refuse(source, f"{where}: a {entry[2]} state fairseq cannot read "
                                      f"({type(error).__name__}: {_shown(error)})") from None


def _numbers(node: Any) -> Iterator[Tuple[str, Any]]:
    """``(path, tensor or numpy array)`` of everything ``node`` holds (already walked once and
    bounded in depth and size by :mod:`.plain`)."""
    if torch.is_tensor(node) or isinstance(node, np.ndarray):
        yield "", node
    elif isinstance(node, (Mapping, argparse.Namespace)) or type(node) in (list, tuple):
        items = vars(node).items() if type(node) is argparse.Namespace else (
            node.items() if isinstance(node, Mapping) else enumerate(node))
        for key, child in items:
            for path, value in _numbers(child):
                yield f"[{key!r}]{path}", value


def check_optimizer_state(state: Mapping, source: str) -> None:
    """``last_optimizer_state`` in whatever layout fairseq's trainer wrote it: tensors of real
    numbers or booleans, together at most :data:`LIMIT_OPTIMIZER_FACTOR` times the numbers of
    the weights plus :data:`LIMIT_OPTIMIZER_SLACK`, and ``--fp16``'s loss scale a finite number
    above 0 (fairseq's trainer sets it as stored). Generation never reads it; how it maps onto
    the parameters is checked by fairseq's optimizer when training resumes from it."""
    weights = state.get("model")
    held = sum(value.numel() for value in weights.values() if torch.is_tensor(value)) \
        if isinstance(weights, Mapping) else 0
    limit = LIMIT_OPTIMIZER_FACTOR * held + LIMIT_OPTIMIZER_SLACK
    optim = state.get("last_optimizer_state")
    scale = optim.get("loss_scale") if isinstance(optim, Mapping) else None
    if scale is not None and not (type(scale) in (int, float) and 0 < scale < float("inf")):
        raise _refuse(source, f"last_optimizer_state['loss_scale'] = {_shown(scale)}: not a loss scale (a finite "
                              "number above 0); fairseq's fp16 optimizer multiplies the loss by it when training "
                              "resumes (NaN skips every update)")
    total = 0
    for path, value in _numbers(state.get("last_optimizer_state")):
        if torch.is_tensor(value) and not (value.is_floating_point() or value.dtype in _INTEGERS):
            raise _refuse(source, f"last_optimizer_state{path} is a {value.dtype} tensor; an optimizer's "
                                  "state holds real numbers")
        total += value.numel() if torch.is_tensor(value) else value.size
        if total > limit:
            raise _refuse(source, f"last_optimizer_state holds more than {limit} numbers "
                                  f"({LIMIT_OPTIMIZER_FACTOR} x the {held} of its weights + {LIMIT_OPTIMIZER_SLACK}); "
                                  "fairseq's optimizers keep at most 3 per weight")
