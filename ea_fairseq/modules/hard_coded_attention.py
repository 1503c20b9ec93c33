"""Hard-coded Gaussian self-attention (HC-SA), You et al. (2020), "Hard-Coded Gaussian
Attention for Neural Machine Translation", §3.

Each head ``h`` attends from the token at position ``i`` with fixed weights, a Gaussian
``N(i + o_h, σ²)`` over the key positions ``j``, normalised over the keys the query may
see (its sentence's real tokens; in a decoder, the positions up to its own)::

    w_h(i, j) = exp(-(j - (i + o_h))² / 2σ²) / Σ_j' exp(-(j' - (i + o_h))² / 2σ²)

i.e. ``softmax_j(-(j - i - o_h)² / 2σ²)`` over the visible keys. The offsets ``o_h``
are split evenly over the heads (the first heads take the first offset): You et al.'s
encoder heads look at ``i - 1`` and ``i + 1``, their decoder heads at ``i - 1`` and
``i``, with ``σ = 1`` (the setting RAN's HC-SA baseline follows). No query or key
projection; no parameters besides fairseq's value and output projections. (The
authors' code takes the density itself, unnormalised; normalising it over the visible
keys changes the weights only near a sentence's ends, where part of the Gaussian falls
outside it, and keeps every row a distribution, as attention weights are elsewhere.)
"""
from typing import Optional, Sequence

import torch
from torch import Tensor

from .position_attention import PositionAttention


class HardCodedGaussianAttention(PositionAttention):
    """Self-attention with fixed Gaussian weights around ``i + offset`` (see module)."""

    map_name = "gaussian"

    def __init__(self, embed_dim: int, num_heads: int, offsets: Sequence[int], std: float = 1.0,
                 **options):
        super().__init__(embed_dim, num_heads, **options)
        offsets = [int(o) for o in offsets]
        if not offsets or num_heads % len(offsets):
            raise ValueError(f"HC-SA: {num_heads} heads cannot be split evenly over the offsets "
                             f"{offsets}; give a number of offsets that divides the heads")
        if not std > 0:
            raise ValueError(f"HC-SA: the standard deviation must be positive, got {std}")
        self.std = float(std)
        self.offsets = tuple(o for o in offsets for _ in range(num_heads // len(offsets)))

    def extra_repr(self) -> str:
        return f"offsets={self.offsets}, std={self.std}"

    def position_logits(self, query_positions: Tensor, key_positions: Tensor,
                        padding_mask: Optional[Tensor], start: int, dtype: torch.dtype) -> Tensor:
        """``-(pos_j - pos_i - o_h)² / 2σ²``: the log-density, up to a constant per row."""
        offsets = torch.tensor(self.offsets, dtype=dtype, device=query_positions.device)
        distance = (key_positions[:, None, None, :] - query_positions[:, None, :, None]).to(dtype)
        return -((distance - offsets[None, :, None, None]) ** 2) / (2.0 * self.std ** 2)
