"""EA Eq. (4) in PyTorch operations: the reference backend of :func:`ea_ops.evolving_attention`,
for every device and dtype, autocast and autograd included, and the backend every other is
held to (the operation's module documents the equation)."""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .contract import BackendResult, EvolvingAttentionParams, StepState
from .map_conv import convolve, layout_kernel, layout_padding
from .masks import fill_masked, fill_masked_, pad_rows_to

NAME = "reference"  # the backend's name on the step kernels it keeps in a run's state


def evolving_attention_reference(logits: Tensor, previous: Optional[Tensor], masked: Optional[Tensor],
                                 neutral: Optional[Tensor], params: EvolvingAttentionParams, *,
                                 state: Optional[StepState] = None, values: Optional[Tensor] = None,
                                 hand_on: bool = False, return_maps: bool = False) -> BackendResult:
    """The finite ``A_logit`` of Eq. (4) (:func:`ea_ops.evolving_attention` documents the
    arguments; ``values`` and ``hand_on`` are the operation's to finish). New tensors: its
    inputs are only read (``logits`` itself is ``A_logit`` where Eq. 4 changes nothing: no
    previous map, no convolution, no neutral entry)."""
    neutral = masked if neutral is None else neutral
    a_input = fill_masked(logits, neutral, 0.0)
    dot_product = a_input.clone() if return_maps and previous is not None else a_input
    if previous is not None:  # line 1, the α skip connection (previous's masked entries re-zeroed)
        # (a previous map of another dtype, and under autocast the convolution's output, are
        # taken in the maps' dtype, as the sum of the two lines written out would promote them)
        a_input = fill_masked_(torch.lerp(a_input, previous.to(a_input.dtype), params.alpha), neutral, 0.0)
    conv = None  # ReLU(Conv(A_input))
    following = state
    if params.weight is None:
        a_logit = a_input
    else:
        conv, following = convolve_rows(a_input, params, state)
        conv = F.relu(conv).to(a_input.dtype)
        a_logit = torch.lerp(a_input, conv, params.beta)  # line 2, β·ReLU(Conv) + (1-β)·A_input
    maps = None
    if return_maps:
        maps = {"dot_product": dot_product,
                "convolution": params.beta * conv if conv is not None else torch.zeros_like(a_logit),
                "logits": a_logit.clone()}
    return BackendResult(a_logit, state=following, maps=maps)


def convolve_rows(a_input: Tensor, params: EvolvingAttentionParams, state: Optional[StepState]):
    """``(Conv(A_input), the next step's state)``; in a decoding step on the earlier rows
    and the new ones (zeros before the first target position, exactly the zero border of
    the full pass)."""
    k = params.weight.size(-1)
    if state is None or k == 1:
        kernel, padding = layout_kernel(params.weight, params.layout)
        return convolve(a_input, kernel, params.bias, padding), state
    kernel = state.kernel_for(NAME)
    if kernel is None:
        kernel, padding = layout_kernel(params.weight, params.layout, True)
    else:
        padding = layout_padding(params.layout, k, True)
    earlier = state.rows
    if earlier is not None and state.order is not None:
        earlier = earlier.index_select(0, state.order)
    bsz, heads, _, src_len = a_input.shape
    if earlier is None:
        earlier = a_input.new_zeros(bsz, heads, k - 1, src_len)
    else:
        # decoder self-attention: earlier rows had fewer keys; the new ones are masked
        earlier = pad_rows_to(earlier, src_len)
    rows = torch.cat([earlier, a_input], dim=2)
    keep = not torch.is_grad_enabled()  # a kernel made with autograd on must not outlive the pass
    following = StepState(rows[:, :, -(k - 1):], None, kernel if keep else None, NAME if keep else None)
    return convolve(rows, kernel, params.bias, padding), following
