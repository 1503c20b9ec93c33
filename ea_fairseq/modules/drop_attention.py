"""DropAttention, DropAttention paper §4 (Algorithm "DropAttention(e)").

Structured dropout on the attention weights Λ (batch x heads x tgt x src), training only:

* ``column`` -- DropAttention(c): drop whole key positions (the value vectors v_j) of a
  head's attention matrix, the same keys for every query row;
* ``element`` -- DropAttention(e): drop entries Λ_ij independently per row.

Each dropped position is widened to a window of ``w`` consecutive keys: window starts are
sampled with ``γ = p / w`` and every start at ``j`` drops ``j .. j+w−1`` (clipped at the
end of the sentence), so the expected drop rate is ``1 − (1 − γ)^w ≈ p``.

Rescaling: ``normalized`` (the paper's default) re-divides each row by its remaining sum
so it sums to 1 again; ``dropout`` divides by ``1 − p`` like standard dropout.

A row whose every non-zero weight was dropped (likely for rows with few keys, e.g. the
first target position) keeps its original weights: nothing is dropped from that row.
This is defined, finite behaviour: no division by zero, no NaN.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

MODES = ("column", "element")
RESCALES = ("normalized", "dropout")


class DropAttention(nn.Module):
    def __init__(self, mode: str, p: float, window: int = 1, rescale: str = "normalized"):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"--drop-attention must be one of {MODES}, got {mode!r}")
        if rescale not in RESCALES:
            raise ValueError(f"--drop-attention-rescale must be one of {RESCALES}, got {rescale!r}")
        if not 0.0 <= p < 1.0:
            raise ValueError(f"--drop-attention-p must lie in [0, 1), got {p}")
        if window < 1:
            raise ValueError(f"--drop-attention-window must be >= 1, got {window}")
        self.mode, self.p, self.window, self.rescale = mode, float(p), int(window), rescale

    def extra_repr(self) -> str:
        return f"mode={self.mode}, p={self.p}, window={self.window}, rescale={self.rescale}"

    def drop_mask(self, shape, device) -> Tensor:
        """Boolean mask of dropped entries, broadcastable to ``shape`` (B, H, T, S)."""
        bsz, heads, tgt_len, src_len = shape
        rows = 1 if self.mode == "column" else tgt_len
        gamma = self.p / self.window
        starts = torch.rand(bsz * heads * rows, 1, src_len, device=device) < gamma
        if self.window > 1:  # start j drops j .. j+w-1: a max over the w starts before j
            widened = F.max_pool1d(F.pad(starts.float(), (self.window - 1, 0)), self.window, stride=1)
            starts = widened > 0
        return starts.view(bsz, heads, rows, src_len)

    def forward(self, probs: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return probs
        kept = probs.masked_fill(self.drop_mask(probs.shape, probs.device), 0.0)
        if self.rescale == "dropout":
            return kept / (1.0 - self.p)
        total = kept.sum(dim=-1, keepdim=True)
        empty = total <= 0
        return torch.where(empty, probs, kept / total.masked_fill(empty, 1.0))
