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
* ``mechanism`` -- the mechanism's own state (a dict of tensors, or an object of the
  mechanism's: EA's :class:`~ea_ops.contract.StepState`), one row per hypothesis; reordered
  by the mechanism's ``reorder_mechanism_state``, which returns it in the new order (by
  default every tensor of the dict, batch first);
* ``memo`` -- what a run derives once, the same for every hypothesis (a step's scaled
  projection, RAN's causal weights, the positions of a position attention): never reordered.

fairseq's decoder layer looks into its self-attention's cache under fairseq's names
(``prev_key``, ``prev_value``, ``prev_key_padding_mask``: :meth:`AttentionCache.as_buffer`)
only for ``--cross-self-attention`` and when it is handed a previous state.
"""
from typing import Any, Callable, Dict, Optional, Tuple

import torch
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
        self.mechanism: Any = {}
        self.memo: Dict[str, Any] = {}

    def extend(self, keys: Optional[Tensor], values: Tensor,
               padding: Optional[Tensor]) -> Tuple[Optional[Tensor], Tensor, Optional[Tensor]]:
        """A self-attention's decoding step: append its keys (None for an attention without
        keys) and values (B, H, S_new, head_dim), and the padding of its keys (the last
        ``S_new`` columns of ``padding``, as fairseq's decoder hands a step's padding, or
        None); returns the keys, values and padding (B, S) of every key the step sees (the
        padding None where nothing is padded)."""
        new = values.size(2)
        if self.values is not None:
            values = torch.cat([self.values, values], dim=2)
            keys = None if keys is None else torch.cat([self.keys, keys], dim=2)
        before = self.key_padding
        if before is not None or padding is not None:
            bsz, seen = values.size(0), values.size(2)
            now = (padding[:, -new:].to(torch.bool) if padding is not None
                   else torch.zeros(bsz, new, dtype=torch.bool, device=before.device))
            if before is None:
                before = torch.zeros(bsz, seen - new, dtype=torch.bool, device=now.device)
            padding = torch.cat([before, now], dim=1)
        self.keys, self.values, self.key_padding = keys, values, padding
        return keys, values, padding

    def reorder(self, new_order: Tensor, reorder_mechanism: Callable[[Any, Tensor], Any]) -> None:
        """Put every hypothesis-dependent entry in beam search's new order of hypotheses."""
        if self.keys is not None or self.values is not None:
            order = self.kept_rows(new_order)
            if order is not None:
                self.keys, self.values, self.key_padding = (
                    None if t is None else t.index_select(0, order)
                    for t in (self.keys, self.values, self.key_padding))
        self.mechanism = reorder_mechanism(self.mechanism, new_order)

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
