"""The state one attention keeps in a decoding run, and its one beam reorder.

fairseq's incremental decoding hands every step the run's ``incremental_state`` (a dict it
starts empty and drops after the run); each module of this plugin keeps one
:class:`AttentionCache` there, under its own key. What the cache holds, and how beam
search's reorder treats it:

* ``keys``, ``values`` (B_kv, H, S, head_dim) and ``key_padding`` (B_kv, S) bool or None --
  the keys and values of the steps so far. *Growing* (self-attention: every step adds its
  own), one row per hypothesis: the reorder selects ``new_order``. *Static*
  (encoder-decoder attention: the encoder's, computed at the first step), one row per
  hypothesis or, with beam search's beam size set (:meth:`AttentionCache.share_by_beams`),
  one row per *sentence*, which its beams share: such rows follow a reorder only when
  sentences leave the batch (each kept sentence's row, picked by its first beam);
* ``mechanism`` -- the mechanism's own state (EA's convolution rows), one row per
  hypothesis; reordered by the mechanism's ``reorder_mechanism_state`` (by default every
  tensor in it, batch first);
* ``memo`` -- what a run derives once from the weights (a step's scaled projection, RAN's
  causal weights), the same for every hypothesis: never reordered.

fairseq's decoder layer looks into its self-attention's cache under fairseq's names
(``prev_key``, ``prev_value``, ``prev_key_padding_mask``: :meth:`AttentionCache.as_buffer`)
only for ``--cross-self-attention`` and when it is handed a previous state.
"""
from typing import Any, Callable, Dict, Optional

from torch import Tensor


class AttentionCache:
    """One attention's decoding state (see the module docstring)."""

    __slots__ = ("keys", "values", "key_padding", "static", "beam_size", "mechanism", "memo")

    def __init__(self):
        self.keys: Optional[Tensor] = None
        self.values: Optional[Tensor] = None
        self.key_padding: Optional[Tensor] = None
        self.static = False  # keys computed once (the encoder's), not grown per step
        self.beam_size = 1  # > 1: static rows may be one per sentence, shared by its beams
        self.mechanism: Dict[str, Any] = {}
        self.memo: Dict[str, Any] = {}

    def reorder(self, new_order: Tensor, reorder_mechanism: Callable[[Dict[str, Any], Tensor], None]) -> None:
        """Put every hypothesis-dependent entry in beam search's new order of hypotheses."""
        if self.keys is not None or self.values is not None:
            order = self.kept_rows(new_order)
            if order is not None:
                self.keys, self.values, self.key_padding = (
                    None if t is None else t.index_select(0, order)
                    for t in (self.keys, self.values, self.key_padding))
        reorder_mechanism(self.mechanism, new_order)

    def kept_rows(self, new_order: Tensor) -> Optional[Tensor]:
        """The rows of keys and values the hypotheses in ``new_order`` read, or None where
        they stay as they are (sentence rows, no sentence left the batch). Decided from
        shapes only (no look at the order's values, which would wait for the device)."""
        if not self.static:
            return new_order
        rows = (self.keys if self.keys is not None else self.values).size(0)
        if rows * self.beam_size == new_order.size(0):
            return None
        if self.beam_size > 1:
            return new_order.reshape(-1, self.beam_size)[:, 0] // self.beam_size
        return new_order

    def as_buffer(self) -> Dict[str, Optional[Tensor]]:
        """The keys and values under fairseq's names (what its decoder layer reads)."""
        buffer = {}
        for name, tensor in (("prev_key", self.keys), ("prev_value", self.values),
                             ("prev_key_padding_mask", self.key_padding)):
            if tensor is not None:
                buffer[name] = tensor
        return buffer

    def load_buffer(self, buffer: Dict[str, Optional[Tensor]]) -> None:
        """Keys and values handed in under fairseq's names (a decoder layer's previous state)."""
        self.keys, self.values = buffer.get("prev_key"), buffer.get("prev_value")
        padding = buffer.get("prev_key_padding_mask")
        self.key_padding = None if padding is None else padding.bool()
