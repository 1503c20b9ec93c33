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
(``pad_rows=False``).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .attention_maps import values_key

LAYOUTS = ("full", "causal", "rows")

# One decoding step convolves a few rows per hypothesis. Up to this many hypotheses,
# ATen's direct (im2col + GEMM) convolution beats oneDNN's; measured on a 2-core Xeon for
# 4 heads, 3x3 kernels, 26-100 keys: 13 vs 75 us at 5 hypotheses, 100 vs 101 us at 160,
# 354 vs 218 us at 640.
DIRECT_CONV_MAX_BATCH = 160
_direct_conv2d = getattr(torch._C._nn, "thnn_conv2d", None)
if _direct_conv2d is None:  # not in this torch build: oneDNN's for every size
    DIRECT_CONV_MAX_BATCH = -1


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
        # (left, right, top, bottom) zero padding: the shift of Fig. 3 is asymmetric padding
        cols = (full, 0) if layout == "causal" else (half, half)
        self._masked = None  # (weight version, masked kernel), see masked_weight()
        self.row_padding = (full, 0) if layout in ("causal", "rows") else (half, half)
        self.col_padding = cols

    @property
    def rows_needed(self) -> int:
        """How many earlier target rows one output row reads (the incremental cache size)."""
        return self.kernel_size[0] - 1

    def forward(self, maps: Tensor, pad_rows: bool = True, keep_layout: bool = False,
                crop: bool = True) -> Tensor:
        """``maps`` is (batch, heads, tgt, src); returns the convolved map of the same width.

        With ``pad_rows=False`` the caller supplies the ``rows_needed`` earlier rows on top
        of the rows to compute (incremental decoding) and gets ``tgt - rows_needed`` rows.
        With ``keep_layout=True`` the result may be a strided (channels-last, cropped) view:
        cheaper when the next operation reads it once anyway. With ``crop=False`` (whole
        maps) it is the uncropped channels-last output, whose ``[:, :, :tgt, :src]`` is the
        result: for a consumer that crops as it reads (and writes the gradient in place).
        """
        weight = self.masked_weight()
        top, bottom = self.row_padding if pad_rows else (0, 0)
        left, right = self.col_padding
        rows = maps.size(2) - (0 if pad_rows else self.rows_needed)
        padding = (max(top, bottom), max(left, right))
        # A one-sided (shifted) padding is done as symmetric padding with the surplus
        # rows/columns cropped, which saves a padded copy.
        if pad_rows:
            # Whole maps (training, encoder): heads are few (4-8 channels), and the
            # channels-last layout is several times faster for such convolutions on CPU.
            out = F.conv2d(maps.contiguous(memory_format=torch.channels_last), weight, self.bias,
                           padding=padding)
        elif maps.size(0) <= DIRECT_CONV_MAX_BATCH:
            # One decoding step: a few rows per sentence. oneDNN's fixed cost per call
            # (about 70 us) is several times the work here; the direct im2col kernel is not.
            out = _direct_conv2d(maps.contiguous(), weight, self.kernel_size, self.bias,
                                 (1, 1), padding)
        else:
            out = F.conv2d(maps.contiguous(), weight, self.bias, padding=padding)
        if pad_rows and not crop:
            return out
        out = out[:, :, :rows, : maps.size(3)] if (top, left) != (bottom, right) else out
        # one decoding step's row is small and read once: the cropped view will do
        return out.contiguous() if pad_rows and not keep_layout else out

    def masked_weight(self) -> Tensor:
        """The kernel with the causal layout's masked taps zeroed (the kernel itself otherwise).

        Without autograd (decoding) the product is kept until the weight changes.
        """
        if self.kernel_mask is None:
            return self.weight
        if torch.is_grad_enabled():
            self._masked = None
            return self.weight * self.kernel_mask
        # the mask is a constant buffer: a device/dtype move changes the weight's key too
        key = values_key((self.weight,))
        if self._masked is None or self._masked[0] != key:
            self._masked = (key, self.weight * self.kernel_mask)
        return self._masked[1]

    def extra_repr(self) -> str:
        return super().extra_repr() + f", layout={self.layout}"
