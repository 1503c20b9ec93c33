"""Evolving Attention (EA-Transformer), EA paper Eq. (4), §3.3 and §3.5, as one operation.

For layer i of a stack, :func:`evolving_attention` computes::

    A_input^i = α · A_logit^(i-1) + (1 − α) · Attention(X)_logit^i     (α: skip connection)
    A_logit^i = β · ReLU(Conv(A_input^i)) + (1 − β) · A_input^i        (β: convolution)
    A^i       = softmax(A_logit^i)

``Attention(X)_logit = QK^T / sqrt(d)`` is the attention's own logit map (with its masks);
``A_logit^i`` is handed to the next layer by the caller. The first layer has no previous
map and uses ``A_input = Attention(X)_logit``. ``Conv`` is a heads-to-heads convolution in
the layout of the attention kind (Fig. 3, :mod:`~ea_fairseq.modules.attention_map_conv`):
``full`` for encoder self-attention, ``causal`` (masked kernel + shift) for decoder
self-attention, ``rows`` (shift along the target axis) for encoder-decoder attention.
Without a convolution, ``A_logit = A_input``.

Masked entries (padding keys, future positions, padded query rows) enter the skip
connection and the convolution as neutral zeros -- never ``-inf`` or a dtype's minimum;
the map handed on to the next layer is finite (its masked entries hold whatever the
convolution put there, which the next layer's zero fill replaces), and ``-inf`` is written
only into the softmax's input.

The operation is a function, as ``scaled_dot_product_attention`` is: its state comes in
and goes out. A decoding step takes the :class:`~ea_fairseq.ops.evolving_attention_types.StepState`
the previous step returned (the last ``k - 1`` rows of ``A_input``, exactly what the
convolution reads of earlier steps, and beam search's pending reorder) and returns the
next one, which the caller stores; nothing is written anywhere else. (``logits``, a fresh
score tensor, is consumed: its storage may hold the result.) The backends -- the PyTorch
reference here (:func:`evolving_attention_reference`, for every device and dtype, autocast
and autograd included) and the CPU accelerator's fused passes
(:mod:`ea_fairseq.accelerators.cpu.evolving_attention`) -- compute the same values and
gradients; which one runs a call is decided in one table
(:mod:`ea_fairseq.ops.evolving_attention_dispatch`).
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..accelerators.cpu import evolving_attention as cpu
from ..ops import evolving_attention_dispatch as dispatch
from ..ops.evolving_attention_types import (BackendResult, EvolvingAttentionOutput, EvolvingAttentionParams,
                                            StepState)
from .attention_map_conv import convolve, layout_kernel, layout_padding
from .attention_masks import fill_masked, fill_masked_, pad_rows_to
from .masked_softmax import attention_weights
from .weighted_values import value_product

NAME = dispatch.REFERENCE  # the backend's name on the step kernels it keeps in a run's state


def evolving_attention(logits: Tensor, previous: Optional[Tensor], masked: Optional[Tensor],
                       neutral: Optional[Tensor], params: EvolvingAttentionParams, *,
                       state: Optional[StepState] = None, values: Optional[Tensor] = None,
                       empty: Optional[Tensor] = None, hand_on: bool = False,
                       return_maps: bool = False) -> EvolvingAttentionOutput:
    """EA Eq. (4) on this layer's logit map, by the backend the dispatcher chooses.

    ``logits``: ``Attention(X)_logit`` (B, H, T, S), a fresh score tensor, which autograd
    does not keep (consumed: it may be changed in place); ``previous``: the previous layer's
    finite ``A_logit`` or None; ``masked``: the entries the softmax must not see (``-inf``
    in the result), a broadcastable bool mask or None; ``neutral``: the entries entering
    Eq. (4) as zeros where they are more than ``masked`` (``masked`` and padded query
    rows), else None; ``params``: α, β and the convolution; ``state``: a decoding step's
    :class:`~ea_fairseq.ops.evolving_attention_types.StepState` (``logits`` are the new
    rows; ``StepState()`` for the first step), or None for a full pass; ``values``
    (B_kv * H, S, head_dim), when given: the weights' softmax and value product are
    computed too (no dropout on the weights), with zero weights in the rows ``empty`` marks
    (every key masked, :func:`~ea_fairseq.modules.masked_softmax.fully_masked_rows` of
    ``masked``; None where no row can be); ``hand_on``: also return the finite
    ``A_logit``; ``return_maps``: also return the intermediate maps (for analysis).
    A decoding step's output carries the state for the next step.
    """
    call = dispatch.describe(logits, masked, neutral, params, state, values, hand_on, return_maps)
    backend = dispatch.choose(call)
    neutral = masked if neutral is None else neutral
    if backend == dispatch.CPU_FULL_PASS:
        result = cpu.full_pass(logits, previous, masked, neutral, params, hand_on)
    elif backend in (dispatch.CPU_STEP, dispatch.CPU_STEP_ATTEND):
        result = cpu.step(logits, previous, masked, params, state,
                          values if backend == dispatch.CPU_STEP_ATTEND else None)
    else:
        result = evolving_attention_reference(logits, previous, masked, neutral, params,
                                              state=state, return_maps=return_maps)
    return finish(result, masked, hand_on, values, empty)


def evolving_attention_reference(logits: Tensor, previous: Optional[Tensor], masked: Optional[Tensor],
                                 neutral: Optional[Tensor], params: EvolvingAttentionParams, *,
                                 state: Optional[StepState] = None,
                                 return_maps: bool = False) -> BackendResult:
    """EA Eq. (4) in PyTorch operations: the reference every backend is held to
    (:func:`evolving_attention` documents the arguments). Returns the finite ``A_logit``."""
    neutral = masked if neutral is None else neutral
    a_input = fill_masked_(logits, neutral, 0.0)
    dot_product = a_input.clone() if return_maps and previous is not None else a_input
    if previous is not None:  # line 1, the α skip connection (previous's masked entries re-zeroed)
        a_input = fill_masked_(torch.lerp(a_input, previous, params.alpha), neutral, 0.0)
    conv = None  # ReLU(Conv(A_input))
    following = state
    if params.weight is None:
        a_logit = a_input
    else:
        conv, following = convolve_rows(a_input, params, state)
        conv = F.relu(conv)
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


def finish(result: BackendResult, masked: Optional[Tensor], hand_on: bool, values: Optional[Tensor],
           empty: Optional[Tensor]) -> EvolvingAttentionOutput:
    """The operation's output from a backend's: ``-inf`` where ``masked`` (in the finite
    ``A_logit``, in place unless it is handed on), then with ``values`` the softmax (zero
    weights in ``empty`` rows) and the value product, where the backend did not."""
    if result.probs is not None:
        return EvolvingAttentionOutput(probs=result.probs, context=result.context, state=result.state)
    a_logit = result.a_logit
    carried = a_logit if hand_on else None
    if not result.masked_filled:
        a_logit = (fill_masked if hand_on else fill_masked_)(a_logit, masked, float("-inf"))
    if values is None:
        return EvolvingAttentionOutput(a_logit, carried, maps=result.maps, state=result.state)
    probs_float, probs = attention_weights(a_logit, values.dtype, empty)
    context = value_product(probs, values, a_logit.size(0), a_logit.size(2))
    return EvolvingAttentionOutput(None, carried, probs_float, context, result.maps, result.state)
