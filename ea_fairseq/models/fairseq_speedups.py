"""Faster versions of fairseq's bookkeeping, for the plugin's decoder; nothing else changes.

**Beam reorder.** At every beam-search step fairseq's
``FairseqIncrementalDecoder.reorder_incremental_state_scripting`` walks all modules of the
decoder (about 130) and tests each for ``reorder_incremental_state``: 0.3-0.5 ms a step on
CPU, a tenth of a small model's step. :class:`ListedStateHolders` lists the same modules,
in the same order, once per decoding run (afresh when a run starts with an empty state, so
a module swapped in between runs is reordered) and reorders those.
:func:`use_fairseq_reorder` switches back to fairseq's walk, for timings that should hold
the mechanisms' own cost only (``scripts/benchmark.py --fairseq-reorder``).
"""
from fairseq.models import FairseqIncrementalDecoder


class ListedStateHolders:
    """Mixin for a ``FairseqIncrementalDecoder``: the beam reorder over a list of the
    modules holding incremental state, made once per decoding run (see module docstring)."""

    #: reorder as fairseq does, walking every module at every step (use_fairseq_reorder)
    walk_every_module = False
    _state_holders = None

    def note_decoding_step(self, incremental_state) -> None:
        """Call at the start of each pass, before anything writes to ``incremental_state``."""
        if incremental_state is not None and not incremental_state:
            self._state_holders = None  # a new decoding run: list the modules afresh

    def reorder_incremental_state_scripting(self, incremental_state, new_order):
        """Reorder every module's incremental state for the new beam order."""
        if self.walk_every_module:
            return FairseqIncrementalDecoder.reorder_incremental_state_scripting(
                self, incremental_state, new_order)
        holders = self._state_holders
        if holders is None:
            holders = tuple(m for m in self.modules() if hasattr(m, "reorder_incremental_state"))
            self._state_holders = holders
        for module in holders:
            result = module.reorder_incremental_state(incremental_state, new_order)
            if result is not None:
                incremental_state = result


def use_fairseq_reorder() -> None:
    """Reorder the plugin's decoders' caches as fairseq does, by a walk over every module
    at every beam-search step (for benchmarks; see module docstring)."""
    ListedStateHolders.walk_every_module = True
