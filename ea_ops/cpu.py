"""EA Eq. (4) on CPU, fused (float32/float64): backends of :func:`ea_ops.evolving_attention`.
Which calls they take is the dispatcher's decision (:mod:`ea_ops.dispatch`); they take the
backends' one signature and return a :class:`~ea_ops.contract.BackendResult`, which the
operation finishes.

* :func:`full_pass` (training and full passes): one C++ pass before the convolution (skip
  connection, neutral zeros, the channels-last layout the convolution reads) and one after
  it (ReLU, β mix, reading the convolution's output through the strides of its ``T x S``
  part), each with a fused backward. In PyTorch operations those passes, their backward
  passes and the layout changes cost more on CPU than the convolutions themselves.
* :func:`step` (incremental decoding): the whole of Eq. (4) for one new query row per
  hypothesis in one call -- and, given the values, the softmax and the value product too.
  A step's half dozen tensor operations on a few hundred numbers each cost more in fixed
  overhead than in work on CPU.

The C++ sources are ``csrc/evolving_attention.cpp`` (the passes, the step's driver) and
``csrc/evolving_attention_loops.h`` (the step's inner loops, built for AVX2 + FMA and for
any CPU, chosen by the CPU's features; ``EA_FAIRSEQ_PORTABLE_KERNELS=1`` forces the
portable build), compiled ahead by ``python -m ea_ops.build`` (:mod:`ea_ops.build`).
``tests/ops/test_accelerator_cpu.py`` holds both backends to the reference.
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .library import extension
from .contract import BackendResult, EvolvingAttentionParams, StepState

NAME = "cpu"  # the backend's name on the step kernels it keeps in a decoding run's state


class EvolvingAttentionInput(torch.autograd.Function):
    """``A_input`` (Eq. 4, line 1), channels-last; see :func:`full_pass`."""

    @staticmethod
    def forward(ctx, logits: Tensor, previous: Optional[Tensor], neutral: Optional[Tensor], alpha: float):
        ctx.alpha, ctx.has_previous = alpha, previous is not None
        ctx.save_for_backward(neutral)
        return extension().evolving_attention_input_forward(logits, previous, neutral, alpha)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (neutral,) = ctx.saved_tensors
        grad_logits, grad_previous = extension().evolving_attention_input_backward(
            grad, neutral, ctx.alpha, ctx.has_previous)
        return grad_logits, grad_previous if ctx.has_previous else None, None, None


class ConvolutionResidual(torch.autograd.Function):
    """``A_logit`` (Eq. 4, line 2) from the uncropped convolution; see
    :func:`full_pass`."""

    @staticmethod
    def forward(ctx, a_input: Tensor, conv: Tensor, masked: Optional[Tensor], beta: float):
        ctx.beta = beta
        ctx.channels_last = not a_input.is_contiguous()
        ctx.save_for_backward(conv, masked)
        return extension().convolution_residual_forward(a_input, conv, masked, beta)

    @staticmethod
    def backward(ctx, grad: Tensor):
        conv, masked = ctx.saved_tensors
        grad_a, grad_conv = extension().convolution_residual_backward(
            grad, conv, masked, ctx.beta, ctx.channels_last)
        return grad_a, grad_conv, None, None


def full_pass(logits: Tensor, previous: Optional[Tensor], masked: Optional[Tensor],
              neutral: Optional[Tensor], params: EvolvingAttentionParams, *, state: Optional[StepState] = None,
              values: Optional[Tensor] = None, hand_on: bool = False, return_maps: bool = False) -> BackendResult:
    """Whole maps (B, H, T, S): one fused pass before the convolution, one after it; the
    masked entries of ``A_logit`` hold ``-inf`` already unless it is handed on. ``neutral``:
    every entry that enters Eq. (4) as zero (``masked`` included), or None for none. (No
    state, values or maps: the dispatcher gives it no call with them.)"""
    if neutral is not None:
        neutral = neutral.expand(logits.shape)
    a_input = EvolvingAttentionInput.apply(logits, previous, neutral, float(params.alpha))
    k = params.weight.size(-1)
    weight = params.weight.tril() if params.layout == "causal" else params.weight
    # the one-sided padding of the layout as symmetric padding: the convolution's
    # [:, :, :T, :S] is Conv(A_input), which the fused residual reads in place
    rows = k - 1 if params.layout in ("causal", "rows") else k // 2
    cols = k - 1 if params.layout == "causal" else k // 2
    conv_out = F.conv2d(a_input, weight, params.bias, padding=(rows, cols))
    written = None if (hand_on or masked is None) else masked.expand(logits.shape)
    a_logit = ConvolutionResidual.apply(a_input, conv_out, written, float(params.beta))
    return BackendResult(a_logit, masked_filled=written is not None)


def step(logits: Tensor, previous: Optional[Tensor], masked: Optional[Tensor],
         neutral: Optional[Tensor], params: EvolvingAttentionParams, *, state: StepState,
         values: Optional[Tensor] = None, hand_on: bool = False, return_maps: bool = False) -> BackendResult:
    """One query row per hypothesis (B, H, 1, S), with one mask (B, 1, 1, S) for all heads
    (``neutral`` is ``masked``: no padded query rows): the whole of Eq. (4) in one call,
    reading the earlier rows in beam search's order -- and given ``values``, the softmax and
    the value product too (a row whose every key is masked gets zero weights, as in
    :func:`ea_ops.softmax.masked_softmax`). Shifted layouts, ``k > 1``, autograd off: the
    kernel derived from the weights is kept in the state for the run."""
    bsz, _, _, src_len = logits.shape
    k = params.weight.size(-1)
    keys = None if masked is None else masked.expand(bsz, 1, 1, src_len).reshape(bsz, src_len)
    causal = params.layout == "causal"
    weight = state.kernel_for(NAME)
    if weight is None:
        weight = (params.weight.tril() if causal else params.weight).contiguous()
    out, rows_out, context = extension().evolving_attention_step(
        logits, previous, state.rows, keys, weight, params.bias, float(params.alpha),
        float(params.beta), k - 1 if causal else k // 2, values, state.order)
    following = StepState(rows_out, None, weight, NAME)
    if values is not None:
        return BackendResult(probs=out, context=context, state=following)
    return BackendResult(out, state=following)
