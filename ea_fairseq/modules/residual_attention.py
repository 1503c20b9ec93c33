"""Residual attention (RealFormer), He et al. 2021, *RealFormer: Transformer Likes Residual
Attention*, Eq. (2)–(3).

Each layer adds the previous layer's pre-softmax attention scores to its own::

    Prev^i    = Prev^(i-1) + Q K^T / sqrt(d)        (Prev^0 = 0)
    A^i       = softmax(Prev^i)

per attention kind of a stack (encoder self-attention; decoder self- and encoder-decoder
attention each with their own chain). ``Prev^(i-1)`` -- the previous layer's scores, which
already hold its own residual -- is what the previous layer handed on
(:mod:`~ea_fairseq.modules.attention_map_carrier`), and ``Prev^i`` is handed on to the next
layer. The module has no parameters of its own: a RealFormer's parameters
are exactly its Transformer's.

Masked entries (padding keys, future positions) and padded query rows are zeros in both
terms and in the map handed on, never ``-inf``; ``-inf`` is written only into the softmax's
input. In a decoding step the previous layer hands on this step's row, the only row this
layer reads, so decoding needs no cache of its own.
"""
from ea_ops.masks import fill_masked, fill_masked_, neutral_entries

from .attention_maps import LogitMapAttention


class ResidualAttention(LogitMapAttention):
    """Multi-head attention whose logits add the previous layer's (RealFormer)."""

    def setup_mechanism(self, slot: str) -> None:
        self.slot = slot

    def carried_names(self):
        return (self.slot,), (self.slot,)

    def transform_logits(self, logits, masked, query_padding_mask, incremental_state):
        scores = fill_masked_(logits, neutral_entries(masked, query_padding_mask), 0.0)
        previous = self.previous_map(self.slot)
        if previous is not None:  # zero where ``scores`` is: the sum is too
            scores = scores + previous
        self.hand_on(self.slot, scores)
        self.report_maps(lambda: {"dot_product": logits, "logits": scores}, masked)
        return fill_masked(scores, masked, float("-inf"))
