"""Faster versions of fairseq's bookkeeping, for the plugin's decoder; nothing else changes.

**Beam reorder.** At every beam-search step fairseq's
``FairseqIncrementalDecoder.reorder_incremental_state_scripting`` walks all modules of the
decoder (about 130) and tests each for ``reorder_incremental_state`` (its cost:
benchmarks/README.md). :class:`ListedStateHolders` lists the same modules,
in the same order, once per decoding run and reorders those. A run is recognised by a
marker it leaves in the run's own incremental state (fairseq starts every run with an
empty one), so a module swapped in between runs is listed by the next run.

:func:`list_state_holders` gives a decoder of another class (a benchmark's fairseq twin)
the same reorder, so that speed ratios compare the attention, not the bookkeeping;
:func:`use_fairseq_reorder` switches both back to fairseq's walk
(``benchmarks/benchmark.py --fairseq-reorder``).
"""
import types

from fairseq.models import FairseqIncrementalDecoder

#: key of the marker a listed reorder leaves in a decoding run's incremental state
LISTED_RUN = "ea_fairseq.listed_reorder"


class ListedStateHolders:
    """Mixin for a ``FairseqIncrementalDecoder``: the beam reorder over a list of the
    modules holding incremental state, made once per decoding run (see module docstring)."""

    #: reorder as fairseq does, walking every module at every step (use_fairseq_reorder)
    walk_every_module = False
    _state_holders = None

    def reorder_incremental_state_scripting(self, incremental_state, new_order):
        """Reorder every module's incremental state for the new beam order."""
        if ListedStateHolders.walk_every_module:
            return FairseqIncrementalDecoder.reorder_incremental_state_scripting(
                self, incremental_state, new_order)
        holders = self._state_holders
        if holders is None or LISTED_RUN not in incremental_state:  # a new decoding run
            holders = tuple(m for m in self.modules() if hasattr(m, "reorder_incremental_state"))
            self._state_holders = holders
            incremental_state[LISTED_RUN] = {}
        for module in holders:
            result = module.reorder_incremental_state(incremental_state, new_order)
            if result is not None:
                incremental_state = result


def list_state_holders(decoder: FairseqIncrementalDecoder) -> FairseqIncrementalDecoder:
    """``decoder`` (any fairseq incremental decoder) reordering as the plugin's decoder does."""
    decoder._state_holders = None
    decoder.reorder_incremental_state_scripting = types.MethodType(
        ListedStateHolders.reorder_incremental_state_scripting, decoder)
    return decoder


def use_fairseq_reorder() -> None:
    """Reorder with fairseq's walk over every module at every beam-search step, in the
    plugin's decoders and in those given :func:`list_state_holders` (for benchmarks)."""
    ListedStateHolders.walk_every_module = True
