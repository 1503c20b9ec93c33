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
was batched with.

:func:`convolve` computes exactly the ``tgt x src`` outputs, in one ``F.conv2d`` call
(cuDNN on CUDA, oneDNN on CPU): the shifts' one-sided zero border is folded into the kernel
(:func:`layout_kernel`: ``k - 1`` zero rows below it for the shift along the target axis,
``k - 1`` zero columns right of it for the causal column shift), so the convolution's own
symmetric padding gives the shifted output with nothing computed and cropped. In
incremental decoding the caller supplies the ``k - 1`` earlier rows on top of the new ones,
which are the top border.
"""
from typing import Optional, Tuple

import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

LAYOUTS = ("full", "causal", "rows")


def check_layout(layout: str, kernel_size: int) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if kernel_size < 1 or kernel_size % 2 == 0:
        raise ValueError(f"the attention-map kernel size must be odd and >= 1, got {kernel_size}: the "
                         "layouts' padding centres the kernel on a map entry (the papers use 3)")


def layout_padding(layout: str, k: int, rows_given: bool = False) -> Tuple[int, int]:
    """The ``F.conv2d`` padding that goes with :func:`layout_kernel`'s kernel."""
    half, full = k // 2, k - 1
    if layout == "full":
        return half, half
    if layout == "causal":
        return (0, full) if rows_given else (full, full)
    return (0, half) if rows_given else (full, half)  # rows


def layout_kernel(weight: Tensor, layout: str, rows_given: bool = False) -> Tuple[Tensor, Tuple[int, int]]:
    """``(kernel, padding)`` for ``F.conv2d`` that convolve a map in ``layout`` with
    ``weight`` (H, H, k, k) and return exactly its ``tgt x src`` outputs; with
    ``rows_given`` the map carries the ``k - 1`` rows before its first output row on top
    (incremental decoding) and the result has ``k - 1`` rows fewer than the map.

    Taps in the zero rows (columns) appended to the kernel meet the symmetric padding's
    bottom rows (right columns) only: what remains is the one-sided shift of Fig. 3.
    """
    k = weight.size(-1)
    full = k - 1
    padding = layout_padding(layout, k, rows_given)
    if layout == "full":
        return weight, padding
    if layout == "causal":
        weight = weight.tril()  # keep taps (a, b) with b <= a: the lower triangle
        return (F.pad(weight, (0, full)) if rows_given else F.pad(weight, (0, full, 0, full))), padding
    return (weight if rows_given else F.pad(weight, (0, 0, 0, full))), padding  # rows


def convolve(maps: Tensor, kernel: Tensor, bias: Optional[Tensor], padding: Tuple[int, int]) -> Tensor:
    """The map convolution, with a kernel and padding from :func:`layout_kernel`."""
    return F.conv2d(maps, kernel, bias, padding=padding)


class AttentionMapConv(nn.Conv2d):
    """``k x k`` heads-to-heads convolution of an attention map, in one of :data:`LAYOUTS`.

    A subclass of ``nn.Conv2d`` for its parameters, initialisation and state-dict names;
    the layout's padding (and the shift it implements) is applied in :meth:`forward`.
    """

    def __init__(self, heads: int, kernel_size: int, layout: str):
        check_layout(layout, kernel_size)
        super().__init__(heads, heads, kernel_size, padding=0)
        self.layout = layout

    def forward(self, maps: Tensor) -> Tensor:
        """``maps`` is (batch, heads, tgt, src); returns the convolved map of the same size."""
        kernel, padding = layout_kernel(self.weight, self.layout)
        return convolve(maps, kernel, self.bias, padding)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", layout={self.layout}"

