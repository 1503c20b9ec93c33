"""Hard-coded Gaussian self-attention (HC-SA), You et al. (2020), "Hard-Coded Gaussian
Attention for Neural Machine Translation", §3, as their code (fallcat/stupidNMT,
``models/new_attention.py``) computes it.

Each head ``h`` attends from the token at position ``i`` with fixed weights around
``i + o_h`` over the key positions ``j`` it may see (its sentence's real tokens; in a
decoder, the positions up to its own), with the normal density
``N(j; i + o_h, σ²) = exp(-(j - i - o_h)² / 2σ²) / (σ √(2π))``. ``normalize`` picks the
weights:

``"none"`` (the default)
    ``w_h(i, j) = N(j; i + o_h, σ²)`` itself, unnormalised, zero at keys the query cannot
    see, and value and output projections without biases: the authors' code, whose setting
    RAN's HC-SA baseline (RAN Table 1) follows. A row's weights sum to whatever part of the
    density falls on its visible keys: with σ = 1 about 1.0 in the middle of a sentence, and
    in a decoder (no key after ``i``) about 0.70 for ``o_h = 0`` and 0.94 for ``o_h = -1``
    at every position, less still at a sentence's first tokens.
``"visible"``
    ``w_h(i, j) = N(j; i + o_h, σ²) / Σ_j' N(j'; i + o_h, σ²)`` over the visible keys ``j'``,
    i.e. ``softmax_j(-(j - i - o_h)² / 2σ²)``: every row a distribution; with fairseq's
    projection biases. In a decoder this rescales every row (by 1/0.70 and 1/0.94 above),
    in an encoder the rows near a sentence's ends. (The behaviour of models built before
    the option existed, which load with it.)

The offsets ``o_h`` are split evenly over the heads (the first heads take the first offset):
You et al.'s encoder heads look at ``i - 1`` and ``i + 1``, their decoder heads at ``i - 1``
and ``i``, with ``σ = 1``. Positions are counted per sentence (padding skipped). No query or
key projection; no parameters besides the value and output projections.
"""
import math
from typing import Optional, Sequence

import torch
from torch import Tensor

from ea_ops.values import fairseq_weights, value_product
from .position_attention import PositionAttention

NORMALIZE = ("none", "visible")


class HardCodedGaussianAttention(PositionAttention):
    """Self-attention with fixed Gaussian weights around ``i + offset`` (see module)."""

    map_name = "gaussian"

    def __init__(self, embed_dim: int, num_heads: int, offsets: Sequence[int], std: float = 1.0,
                 normalize: str = "none", **options):
        if normalize not in NORMALIZE:
            raise ValueError(f"--hcsa-normalize must be one of {NORMALIZE}, got {normalize!r}")
        if normalize == "none":
            options["bias"] = False  # the authors' projections have none
        super().__init__(embed_dim, num_heads, **options)
        offsets = [int(o) for o in offsets]
        if not offsets or num_heads % len(offsets):
            raise ValueError(f"HC-SA: {num_heads} heads cannot be split evenly over the offsets "
                             f"{offsets}; give a number of offsets that divides the heads")
        if not std > 0:
            raise ValueError(f"HC-SA: the standard deviation must be positive, got {std}")
        self.std = float(std)
        self.normalize = normalize
        self.offsets = tuple(o for o in offsets for _ in range(num_heads // len(offsets)))
        # the offsets as a tensor on the module's device (it moves with the module): a
        # forward pass builds nothing from Python values, so no host-to-device copy per call;
        # not persistent, so checkpoints hold only the projections
        self.register_buffer("head_offsets", torch.tensor(self.offsets, dtype=torch.long), persistent=False)

    def extra_repr(self) -> str:
        return f"offsets={self.offsets}, std={self.std}, normalize={self.normalize}"

    def position_logits(self, query_positions: Tensor, key_positions: Tensor,
                        padding_mask: Optional[Tensor], start: int, dtype: torch.dtype) -> Tensor:
        """``log N(pos_j; pos_i + o_h, σ²)``: the log-density."""
        offsets = self.head_offsets.to(dtype)
        distance = (key_positions[:, None, None, :] - query_positions[:, None, :, None]).to(dtype)
        log_norm = math.log(self.std * math.sqrt(2.0 * math.pi))
        return -((distance - offsets[None, :, None, None]) ** 2) / (2.0 * self.std ** 2) - log_norm

    def attend_with(self, logits: Tensor, v: Tensor, bsz: int, tgt_len: int,
                    need_weights: bool, need_head_weights: bool, empty: Optional[Tensor] = None):
        """``"visible"``: the shared softmax. ``"none"``: the density itself, ``exp`` of the
        log-density (0 at masked keys, whose logits are ``-inf``; a row without visible keys
        is all zeros)."""
        if self.normalize == "visible":
            return super().attend_with(logits, v, bsz, tgt_len, need_weights, need_head_weights, empty)
        probs_float = logits.exp()
        probs = probs_float if probs_float.dtype == v.dtype else probs_float.to(v.dtype)
        context = value_product(self.drop_weights(probs), v, bsz, tgt_len)
        return self.out_proj(context), fairseq_weights(probs_float, need_weights, need_head_weights)
