"""Principle 3, budget the effect, not the declaration: what fairseq builds from a received
checkpoint is counted as it is built, and stopped before it allocates more than the checkpoint's
weights justify.

No field of a configuration is bounded by what it declares: a model is built under
:class:`Budget`, which runs every torch operation of the build first on the ``meta`` device (a
shape, no memory) and adds the elements of each new tensor it would make (parameters, buffers,
tables the checkpoint does not store, such as sinusoidal position tables, and the temporaries
that compute them) before the real operation runs. Past the budget the build stops with
:class:`BudgetError`, so a layer count, a dimension, a position limit or a dictionary that is
too large costs no memory and no more time than the budget's worth of building.

Where: every model fairseq builds from a checkpoint (``fairseq.models.build_model`` with
``from_checkpoint``, or with the very model configuration fairseq loaded from the checkpoint
this thread read last, which is how a task whose ``build_model`` takes no ``from_checkpoint``
builds it: the command-line tools, the hub, ``ea-fairseq-analysis``), with the task's real
dictionaries, against the weights of that checkpoint (:func:`weights_read`,
:func:`configuration_read`); and the meta build that compares a checkpoint's configuration with
its weights when it is read (:mod:`ea_fairseq.safety.no_code.consistency`).

A dictionary costs its reading before any model is built (fairseq keeps a few hundred bytes of
Python objects a type). Every type is a row of an embedding or output layer, at least one
element of at least one byte, which the checkpoint stores (uncompressed), so a dictionary read
for a checkpoint may hold at most one line per element of its weights or byte of its file,
counted before fairseq reads it (:func:`dictionary_bound`, :mod:`ea_fairseq.safety.data_files`):
fairseq-generate, -interactive and -eval-lm read their dictionaries before the checkpoint, so
while such a command runs (:func:`checkpoints_named`, around fairseq-generate's ``main`` and
``call_main``) the largest checkpoint it names bounds them by its bytes; the hub reads the
checkpoint first, so between reading a checkpoint and building its model a thread's
dictionaries are bounded by the elements of its weights. Training names no checkpoint: its
dictionaries are not bounded.
"""
import argparse
import collections
import contextlib
import functools
import os
import threading
from typing import Any, Iterator, List, Mapping, Optional, Tuple

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from ..errors import UnsafeCheckpointError

#: elements a build may create per element of the weights (a model built in float32 from fp16
#: weights, the temporaries of its initialisation), plus :data:`SLACK` for what no weight
#: stores (position tables, buffers, a tiny model's fixed costs)
FACTOR = 4
SLACK = 1 << 24
#: torch operations a build may run per tensor of the weights (fairseq's and the plugin's
#: models run about 11 to build and initialise one), plus :data:`OPERATIONS_SLACK`: a thousand
#: layers of a few elements cost little memory, but time
OPERATIONS_FACTOR = 64
OPERATIONS_SLACK = 1 << 12


class BudgetError(UnsafeCheckpointError):
    """A model whose build would create far more than its checkpoint's weights."""


_TO_HOST = (torch.Tensor.cpu, torch.Tensor.cuda)
_CONTAINERS = (tuple, list, dict, collections.deque)  # and their subclasses: what torch's tree_map walks


def _map(fn, tree):
    """``tree`` with ``fn`` applied to each of its tensors, as torch's ``tree_map`` does it: the
    plain tuples, lists and dicts torch's operations take and return walked here (a build runs
    thousands of operations: torch's general walk cost more than the build), their subclasses
    (a named tuple, ``torch.Size``, an ``OrderedDict``) by ``tree_map`` itself."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    kind = type(tree)
    if kind is tuple or kind is list:
        return kind([_map(fn, x) for x in tree])
    if kind is dict:
        return {k: _map(fn, v) for k, v in tree.items()}
    if isinstance(tree, _CONTAINERS):
        return tree_map(lambda t: fn(t) if isinstance(t, torch.Tensor) else t, tree)
    return tree


def _tensors(tree) -> list:
    found = []
    _map(lambda t: found.append(t) or t, tree)
    return found


def _storages(tree) -> set:
    return {t.untyped_storage()._cdata for t in _tensors(tree)}


class _Allocations(TorchDispatchMode):
    """The allocations of its :class:`Budget`'s block that reach torch's dispatcher without a
    torch function the budget sees: legacy constructors (``torch.Tensor(n, m)``,
    ``FloatTensor``), which fairseq's convolutions and attention biases build their parameters
    with, and which take no ``meta`` device. Each is sized on ``meta`` and charged before it runs."""

    def __init__(self, budget: "Budget"):
        super().__init__()
        self.budget = budget

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        budget = self.budget
        budget.seen += 1  # (calling an operation runs the budget's torch function again: not counted there)
        try:
            if budget.seen == 1 and any(a.name == "device" for a in func._schema.arguments) \
                    and not _tensors((args, kwargs)):  # a factory no torch function of the budget counted
                budget.operations -= 1
                budget.charge(sum(t.numel() for t in _tensors(func(*args, **dict(kwargs, device="meta")))))
            return func(*args, **kwargs)
        finally:
            budget.seen -= 1


class Budget(TorchFunctionMode):
    """Counts the torch operations in its block and the elements of the tensors they create,
    each before it is created, and raises :class:`BudgetError` past either limit, which
    :meth:`for_weights` sets from the weights of the checkpoint the model is built for. What
    reaches the dispatcher without a torch function (legacy constructors) is counted by
    :class:`_Allocations`, entered with it."""

    def __init__(self, limit: int, operations: int, what: str, weights: int = 0):
        super().__init__()
        self.limit, self.operations, self.what, self.used = limit, operations, what, 0
        self.weights = weights  # the elements of the weights it was set from
        self.configuration: Any = None  # the model configuration fairseq loaded with them
        self.seen = 0  # > 0 while a torch function runs that this mode has counted
        self._allocations: Optional[_Allocations] = None

    def __enter__(self):
        self._allocations = _Allocations(self).__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._allocations.__exit__(*exc)

    def charge(self, elements: int) -> None:
        """``elements`` more, and one operation; :class:`BudgetError` past either limit."""
        self.used += elements
        if self.used > self.limit or self.operations < 0:
            raise BudgetError(f"{self.what}: refused: the model its configuration describes would create more "
                              f"than {self.limit:,} elements (parameters, buffers and tables) or take more "
                              "operations to build than its weights justify, with these dictionaries; nothing was "
                              "allocated. Nothing in the checkpoint was run; use the dictionaries and "
                              "configuration it was trained with.")

    @classmethod
    def for_weights(cls, weights: Any, what: str) -> "Budget":
        tensors = [v for v in weights.values() if torch.is_tensor(v)] if isinstance(weights, Mapping) else []
        # the elements stored: each storage once, however many tensors view it
        storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() // t.element_size() for t in tensors}
        elements = sum(storages.values())
        return cls(FACTOR * elements + SLACK, OPERATIONS_FACTOR * len(tensors) + OPERATIONS_SLACK, what, elements)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.seen and isinstance(func, torch._ops.OpOverload):  # an operation :class:`_Allocations` runs
            return func(*args, **kwargs)
        self.operations -= 1
        if func in _TO_HOST and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            return args[0]  # a build on meta that initialises on the host (BART's normal_ draws on the CPU)
        self.seen += 1
        try:
            elements = 0
            try:
                # detached: a meta copy of a parameter is otherwise a non-leaf tensor, whose ``.grad``
                # (read by ``Module.to`` for every parameter it moves) makes torch warn
                on_meta = _map(lambda t: t.detach().to("meta"), (args, kwargs))
                with torch.device("meta"):
                    out = func(*on_meta[0], **on_meta[1])
                given = _storages(on_meta)
                elements = sum(t.numel() for t in _tensors(out) if t.untyped_storage()._cdata not in given)
            except Exception:  # noqa: BLE001  (no meta kernel: an operation that reads values, not one that sizes)
                pass
            self.charge(elements)
            return func(*args, **kwargs)
        finally:
            self.seen -= 1


_read = threading.local()  # per thread: the budget of the checkpoint it read last


def weights_read(source: str, weights: Any) -> None:
    """Record, for this thread, the checkpoint just read: the next model fairseq builds from a
    checkpoint in this thread is budgeted by its weights; inside :func:`loading_budgeted`, from
    here on everything is."""
    _read.last = Budget.for_weights(weights, source)
    session = getattr(_read, "session", None)
    if session is not None:
        session.append(_read.last.__enter__())


def reading() -> None:
    """A checkpoint is about to be read in this thread: the budget of the one read before it in
    the same loading (:func:`loading_budgeted`) ends here, before the new file is read and
    compared with its configuration."""
    session = getattr(_read, "session", None)
    while session:
        session.pop().__exit__(None, None, None)


def loading_budgeted(original):
    """``fairseq.checkpoint_utils.load_model_ensemble_and_task`` (``original``): from each
    checkpoint's reading (:func:`weights_read` enters its budget) to the next one's or to the
    end of the call, everything the loading does is under that checkpoint's budget: the task's
    ``build_model`` (which registers a classification head sized by its configuration after the
    model is built), the model's ``load_state_dict`` and the upgrades that run there (RoBERTa's
    heads, sized by the shapes of stored tensors)."""

    @functools.wraps(original)
    def load(*args, **kwargs):
        outer, _read.session = getattr(_read, "session", None), []
        try:
            return original(*args, **kwargs)
        finally:
            reading()
            _read.session = outer

    return load


def configuration_read(state: Mapping) -> None:
    """Record, for this thread, the model configuration (``cfg.model``, or the legacy ``args``)
    of the checkpoint state fairseq just loaded (after :func:`weights_read`): a build given that
    very object is a build from the checkpoint, whatever ``from_checkpoint`` says."""
    pending: Optional[Budget] = getattr(_read, "last", None)
    cfg = state.get("cfg") if isinstance(state, Mapping) else None
    if pending is not None:
        pending.configuration = cfg.model if cfg is not None and "model" in cfg else state.get("args")


def build_model(original):
    """``fairseq.models.build_model`` (``original``) building a model from a checkpoint under
    the budget of the checkpoint this thread read last; any other build as fairseq does."""

    @functools.wraps(original)
    def build(cfg, task, from_checkpoint=False):
        budget: Optional[Budget] = getattr(_read, "last", None)
        if budget is None or not (from_checkpoint or cfg is budget.configuration is not None):
            return original(cfg, task, from_checkpoint)
        _read.last = None
        if budget in (getattr(_read, "session", None) or ()):  # entered when it was read, for the whole loading
            return original(cfg, task, from_checkpoint)
        with budget:
            return original(cfg, task, from_checkpoint)

    return build


@contextlib.contextmanager
def checkpoints_named(cfg) -> Iterator[None]:
    """While a command line runs with ``cfg`` (its configuration or, fairseq-generate's, its
    parsed arguments), the largest of the checkpoints it names (``--path``, an ensemble's,
    ``--lm-path``; each as the files fairseq will load for it: ``--checkpoint-suffix``, its
    shards) bounds the dictionaries this thread reads (:func:`dictionary_bound`)."""
    from fairseq.checkpoint_utils import get_maybe_sharded_checkpoint_filename
    from fairseq.utils import split_paths

    def field(section: str, name: str):
        return getattr(cfg if isinstance(cfg, argparse.Namespace) else getattr(cfg, section, None), name, None)

    suffix, shards = field("checkpoint", "checkpoint_suffix") or "", field("checkpoint", "checkpoint_shard_count")
    shards = shards if type(shards) is int and shards > 0 else 1

    def loaded(path: str) -> List[str]:
        return [get_maybe_sharded_checkpoint_filename(path, suffix, k, shards) for k in range(shards)]

    path = field("common_eval", "path")
    named = [loaded(p) for p in (split_paths(path) if isinstance(path, str) else ())]
    named += [[field("generation", "lm_path")]]
    sizes = [(sum(map(_stored_bytes, files)), files[0]) for files in named
             if all(isinstance(f, str) and os.path.isfile(f) for f in files)]
    previous, _read.named = getattr(_read, "named", None), max(sizes, default=None)
    try:
        yield
    finally:
        _read.named = previous


def _stored_bytes(path: str) -> int:
    """The bytes file ``path`` stores: none for a link out of its directory or what is not a
    regular file (the checkpoint is read from inside its directory only), up to its first hole
    for a sparse file (:func:`ea_fairseq.safety.confined.stored_bytes`, as a data split)."""
    from .confined import ConfinedPathError, inside, stored_bytes

    try:
        real = inside(path)
        return stored_bytes(real, os.path.getsize(real))
    except (ConfinedPathError, OSError):
        return 0


def with_checkpoints_named(main, cfg, **kwargs):
    """``main(cfg, **kwargs)`` under :func:`checkpoints_named`: what fairseq's ``call_main``
    runs, in its own process or in each it starts (a module-level function, so that
    ``functools.partial(with_checkpoints_named, main)`` pickles to them). A checkpoint an earlier
    run of this thread read (a hydra multirun's previous job) bounds nothing in this one."""
    _read.last = None
    with checkpoints_named(cfg):
        return main(cfg, **kwargs)


def dictionary_bound() -> Optional[Tuple[int, str, str]]:
    """(lines, checkpoint, what they count) a dictionary this thread reads may hold: the bytes of
    the largest checkpoint the command line this thread runs names, else the elements of the
    weights of the checkpoint this thread read and has not built a model from yet; None if
    neither (see the module's docstring)."""
    named = getattr(_read, "named", None)
    if named is not None:
        return named[0], named[1], "bytes"
    pending = getattr(_read, "last", None)
    return None if pending is None else (pending.weights, pending.what, "weight elements")
