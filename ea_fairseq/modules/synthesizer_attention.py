"""Random Synthesizer self-attention (Syn-R), Tay et al. (2020), "Synthesizer: Rethinking
Self-Attention in Transformer Models", §3.2 ("Random Synthesized Attention").

Each head ``h`` of each layer has its own attention logits ``R_h``, an ``L x L`` matrix
of parameters (``L = --synthesizer-max-positions``), randomly initialised and trained
with the model (or kept fixed: "Fixed Random")::

    Y_h = softmax(R_h) G_h(X)

where ``G_h`` is the head's value projection: no query or key projection, the weights do
not depend on the input. ``R_h[pos_i, pos_j]`` is read at the positions of query and key
within their sentence; in a decoder, keys after the query are masked before the
softmax. Sentences longer than ``L`` are refused.
"""
from typing import Optional

import torch
import torch.nn as nn
from torch import Tensor

from .position_attention import PositionAttention, matrix_logits


class RandomSynthesizerAttention(PositionAttention):
    """Self-attention with learned, input-independent logits ``R`` per head (see module)."""

    map_name = "synthesized"

    def __init__(self, embed_dim: int, num_heads: int, max_positions: int, fixed: bool = False,
                 **options):
        super().__init__(embed_dim, num_heads, **options)
        if max_positions < 1:
            raise ValueError(f"--synthesizer-max-positions must be at least 1, got {max_positions}")
        self.max_positions = max_positions
        self.logits = nn.Parameter(torch.empty(num_heads, max_positions, max_positions),
                                   requires_grad=not fixed)
        nn.init.xavier_uniform_(self.logits)

    def extra_repr(self) -> str:
        return f"max_positions={self.max_positions}, fixed={not self.logits.requires_grad}"

    def position_logits(self, query_positions: Tensor, key_positions: Tensor,
                        padding_mask: Optional[Tensor], start: int, dtype: torch.dtype) -> Tensor:
        """``R[h, pos_i, pos_j]``, computed in ``dtype`` (the parameters may be in a lower one)."""
        tgt_len, src_len = query_positions.size(-1), key_positions.size(-1)
        if max(start + tgt_len, src_len) > self.max_positions:
            raise ValueError(
                f"Random Synthesizer attention got a sequence of {max(start + tgt_len, src_len)} "
                f"positions but its attention matrices cover {self.max_positions}; raise "
                "--synthesizer-max-positions or filter longer sentences with "
                "--max-source-positions / --max-target-positions."
            )
        rows = self.logits[:, start : start + tgt_len, :src_len]  # only the rows this call needs
        one_hot = None if padding_mask is None else self.pass_one_hot(padding_mask, query_positions, dtype)
        return matrix_logits(rows.to(dtype), tgt_len, src_len, padding_mask, positions=query_positions,
                             one_hot=one_hot)
