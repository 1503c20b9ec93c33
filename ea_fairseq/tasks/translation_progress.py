"""``--task translation_progress``: fairseq's ``translation`` task that says how far validation has got.

With ``--eval-bleu``, fairseq's validation translates the whole validation set with beam search
and prints nothing until its ``valid on`` line: minutes on a CPU. This task logs, on the process
that logs (rank 0), what it is doing when a validation with BLEU starts, a progress line every
``--valid-progress-seconds`` (sentences translated of this process's share, time spent, time
left at the rate so far) and the time the pass took; a validation without BLEU logs progress only
when it runs longer than that interval. Everything else (data, models, BLEU) is fairseq's
``translation``; its checkpoints name this task (and its interval), so they load where the plugin
is loaded, as the plugin's models do.

Only the task's own hooks are used: :meth:`begin_valid_epoch` marks a validation, the
validation iterator fairseq asks for gives the pass's subset and size (:meth:`get_batch_iterator`),
and :meth:`valid_step` counts sentences after fairseq's own step; :meth:`begin_epoch` and
:meth:`train_step` end the validation. The first line says how many of the subset's sentences
are translated when fairseq leaves some out: those :meth:`filter_indices_by_size` skips as too
long, and a last batch smaller than ``--required-batch-size-multiple`` (8 by default), which
fairseq drops without a word: ``translating 37 of 40 sentences (3 dropped by
--required-batch-size-multiple 8: use --required-batch-size-multiple 1)``.
"""
import inspect
import json
import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import Optional

from fairseq.tasks import register_task
from fairseq.tasks.translation import TranslationConfig, TranslationTask

logger = logging.getLogger(__name__)


@dataclass
class TranslationProgressConfig(TranslationConfig):
    valid_progress_seconds: float = field(
        default=30.0, metadata={"help": "seconds between validation progress lines (0: after every batch)"})


def _seconds(value: float) -> str:
    value = int(round(value))
    return f"{value} s" if value < 120 else f"{value // 60} min {value % 60:02d} s"


def progress_line(label: str, subset: str, done: int, total: Optional[int], elapsed: float,
                  shards: int = 1) -> str:
    """One progress line: ``[valid BLEU] 'valid': 120/400 sentences, 35 s, ~80 s left``; without a
    known total, the count alone; with several processes, the count is this process's share."""
    share = f" (this process's share; {shards} processes)" if shards > 1 else ""
    if total is None:
        return f"[{label}] '{subset}': {done} sentences{share}, {_seconds(elapsed)}"
    if done >= total:
        return f"[{label}] '{subset}': {total}/{total} sentences{share} in {_seconds(elapsed)}"
    left = f", ~{_seconds(elapsed / done * (total - done))} left" if done else ""
    return f"[{label}] '{subset}': {done}/{total} sentences{share}, {_seconds(elapsed)}{left}"


def translating(total: Optional[int], size: int, batched: int, skipped: int, multiple: int, shards: int = 1) -> str:
    """What a validation with BLEU translates: ``translating 56 of 60 sentences (4 dropped by
    --required-batch-size-multiple 8: use --required-batch-size-multiple 1)``. ``total``: this
    process's sentences (None: not known); ``size``: the subset's; ``batched``: those in the
    batches of all processes; ``skipped``: those too long for the model, left out before
    batching (--skip-invalid-size-inputs-valid-test); fairseq drops the rest, a last batch not
    a multiple of ``multiple``."""
    if total is None:
        return "translating its sentences"
    dropped = size - skipped - batched
    why = []
    if skipped > 0:
        why.append(f"{skipped} longer than the model takes, skipped by --skip-invalid-size-inputs-valid-test")
    if dropped > 0:
        why.append(f"{dropped} dropped by --required-batch-size-multiple {multiple}: use "
                   "--required-batch-size-multiple 1")
    if shards > 1:
        return f"translating {total} sentences (this process's share of {batched} of {size}{'; ' if why else ''}" \
               f"{'; '.join(why)})"
    if total == size:
        return f"translating {total} sentences"
    return f"translating {total} of {size} sentences ({'; '.join(why)})"


class _Pass:
    """The validation pass of one subset: its size, the sentences done, its clock."""

    def __init__(self, subset: str, total: Optional[int], shards: int):
        self.subset, self.total, self.shards = subset, total, shards
        self.done, self.reported = 0, False
        self.start = self.last = time.monotonic()


_BATCH_ITERATOR = inspect.signature(TranslationTask.get_batch_iterator)


@register_task("translation_progress", dataclass=TranslationProgressConfig)
class TranslationProgressTask(TranslationTask):
    def __init__(self, cfg, src_dict, tgt_dict):
        super().__init__(cfg, src_dict, tgt_dict)
        self._validating = False
        self._pass: Optional[_Pass] = None
        self._kept = weakref.WeakKeyDictionary()  # dataset: its sentences left after the size filter

    def _label(self) -> str:
        return "valid BLEU" if self.cfg.eval_bleu else "valid"

    def begin_epoch(self, epoch, model):
        self._validating, self._pass = False, None
        return super().begin_epoch(epoch, model)

    def begin_valid_epoch(self, epoch, model):
        self._validating, self._pass = True, None
        return super().begin_valid_epoch(epoch, model)

    def train_step(self, *args, **kwargs):
        self._validating, self._pass = False, None
        return super().train_step(*args, **kwargs)

    def filter_indices_by_size(self, indices, dataset, max_positions=None, ignore_invalid_inputs=False):
        indices = super().filter_indices_by_size(indices, dataset, max_positions, ignore_invalid_inputs)
        self._kept[dataset] = len(indices)
        return indices

    def get_batch_iterator(self, dataset, *args, **kwargs):
        iterator = super().get_batch_iterator(dataset, *args, **kwargs)
        subset = next((name for name, d in self.datasets.items() if d is dataset), None)
        # (fairseq asks for the next epoch's training batches between validation and begin_epoch)
        if self._validating and subset is not None and subset != self.cfg.train_subset:
            shards, shard = getattr(iterator, "num_shards", 1), getattr(iterator, "shard_id", 0)
            batches = getattr(iterator, "frozen_batches", None)
            total = None if batches is None else sum(len(b) for b in batches[shard::shards])
            self._pass = _Pass(subset, total, shards)
            if self.cfg.eval_bleu:
                given = _BATCH_ITERATOR.bind(self, dataset, *args, **kwargs)
                given.apply_defaults()
                size = len(dataset)
                what = translating(total, size, sum(len(b) for b in batches or ()), size - self._kept.get(dataset, size),
                                   given.arguments["required_batch_size_multiple"], shards)
                beam = json.loads(self.cfg.eval_bleu_args or "{}").get("beam", 5)
                every = ("after every batch" if self.cfg.valid_progress_seconds <= 0
                         else f"every {_seconds(self.cfg.valid_progress_seconds)}")
                logger.info(f"[{self._label()}] '{subset}': {what} with beam {beam} "
                            f"for BLEU; progress {every} (--valid-progress-seconds)")
        return iterator

    def valid_step(self, sample, model, criterion):
        result = super().valid_step(sample, model, criterion)
        p = self._pass
        if p is not None and sample:
            p.done += int(sample.get("nsentences", 0) or 0)
            if p.total is not None:
                p.done = min(p.done, p.total)
            now = time.monotonic()
            finished = p.total is not None and p.done >= p.total
            if finished:
                if self.cfg.eval_bleu or p.reported:
                    logger.info(progress_line(self._label(), p.subset, p.done, p.total, now - p.start, p.shards))
                self._pass = None
            elif now - p.last >= self.cfg.valid_progress_seconds:
                logger.info(progress_line(self._label(), p.subset, p.done, p.total, now - p.start, p.shards))
                p.last, p.reported = now, True
        return result
