"""The convolution over an attention map whose heads are the channels (EA §3.3, §3.5, Fig. 3).

One K->K 2-D convolution (K = number of heads) over the ``tgt x src`` logit map, in the
three layouts of the EA paper's Figure 3:

``"full"``   encoder self-attention (Fig. 3a): a plain ``k x k`` convolution with a zero
             border.
``"causal"`` decoder self-attention (Fig. 3b): the kernel's upper-right triangle is masked
             (taps whose column offset exceeds their row offset; a 3x3 kernel keeps 6 of its
             9 taps) and the output is shifted by ``k // 2`` rows down and ``k // 2`` columns
             right. Output entry (t, j) then reads rows t-k+1..t and columns j-k+1..j only:
             query t never sees a target position after t.
``"rows"``   encoder-decoder attention (Fig. 3c): a ``k x k`` convolution shifted by
             ``k // 2`` along the target (row) axis; output row t reads target rows
             t-k+1..t and source columns centred on j.

Inputs are expected to hold neutral zeros wherever the attention is masked (padding,
future positions): with fairseq's left-padded sources a padded column then looks exactly
like the convolution's own zero border, so a sentence's map does not depend on what it
was batched with. Incremental decoding passes the cached previous rows itself
(``pad_rows=False``). One ``F.conv2d`` call per map (cuDNN on CUDA, oneDNN on CPU).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

LAYOUTS = ("full", "causal", "rows")


class AttentionMapConv(nn.Conv2d):
    """``k x k`` heads-to-heads convolution of an attention map, in one of :data:`LAYOUTS`.

    A subclass of ``nn.Conv2d`` for its parameters, initialisation and state-dict names;
    the padding (and the shift it implements) is applied in :meth:`forward`.
    """

    def __init__(self, heads: int, kernel_size: int, layout: str):
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if kernel_size < 1 or kernel_size % 2 == 0:
            raise ValueError(f"the attention-map kernel size must be odd and >= 1, got {kernel_size}")
        super().__init__(heads, heads, kernel_size, padding=0)
        self.layout = layout
        k = kernel_size
        if layout == "causal":
            # keep taps (a, b) with b <= a: the kernel's lower triangle, diagonal included
            self.register_buffer("kernel_mask", torch.ones(k, k).tril(), persistent=False)
        else:
            self.kernel_mask = None
        half, full = k // 2, k - 1
        # (top, bottom) and (left, right) zero padding: the shift of Fig. 3 is asymmetric padding
        self.row_padding = (full, 0) if layout in ("causal", "rows") else (half, half)
        self.col_padding = (full, 0) if layout == "causal" else (half, half)

    @property
    def rows_needed(self) -> int:
        """How many earlier target rows one output row reads (the incremental cache size)."""
        return self.kernel_size[0] - 1

    def forward(self, maps: Tensor, pad_rows: bool = True) -> Tensor:
        """``maps`` is (batch, heads, tgt, src); returns the convolved map of the same size.

        With ``pad_rows=False`` the caller supplies the ``rows_needed`` earlier rows on top
        of the rows to compute (incremental decoding) and gets ``tgt - rows_needed`` rows.
        """
        rows = maps.size(2) - (0 if pad_rows else self.rows_needed)
        return self.convolve_uncropped(maps, pad_rows)[:, :, :rows, : maps.size(3)]

    def convolve_uncropped(self, maps: Tensor, pad_rows: bool = True) -> Tensor:
        """The convolution with symmetric zero padding, whose ``[:, :, :rows, :src]`` is
        :meth:`forward`'s result: a one-sided (shifted) padding is symmetric padding with
        the surplus rows and columns cropped, which saves a padded copy of the map."""
        top, bottom = self.row_padding if pad_rows else (0, 0)
        left, right = self.col_padding
        return F.conv2d(maps, self.masked_weight(), self.bias,
                        padding=(max(top, bottom), max(left, right)))

    def masked_weight(self) -> Tensor:
        """The kernel with the causal layout's masked taps zeroed (the kernel itself otherwise)."""
        return self.weight if self.kernel_mask is None else self.weight * self.kernel_mask

    def extra_repr(self) -> str:
        return super().extra_repr() + f", layout={self.layout}"
