"""EA Eq. (4) on CPU, fused (float32/float64): the accelerator of
:mod:`ea_fairseq.modules.evolving_attention`, which holds the equation and its reference.

* :meth:`EvolvingAttentionCPU.full_pass` (training and full passes): one C++ pass before
  the convolution (skip connection, neutral zeros, the channels-last layout the
  convolution reads) and one after it (ReLU, β mix, reading the convolution's output
  through the strides of its ``T x S`` part), each with a fused backward. In PyTorch operations those passes, their backward
  passes and the layout changes cost more on CPU than the convolutions themselves.
* :meth:`EvolvingAttentionCPU.step` (incremental decoding): the whole of Eq. (4) for one
  new query row per hypothesis in one call -- and, where no later layer reads the map,
  the softmax and the value product too. A step's half dozen tensor operations on a few
  hundred numbers each cost more in fixed overhead than in work on CPU.

The C++ sources are ``csrc/evolving_attention.cpp`` (the passes, the step's driver) and
``csrc/evolving_attention_loops.h`` (the step's inner loops, built for AVX2 + FMA and for
any CPU, chosen by the CPU's features; ``EA_FAIRSEQ_PORTABLE_KERNELS=1`` forces the
portable build). ``tests/test_accelerator_cpu.py`` holds both operations to the reference.
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ...modules.evolving_attention import EvolvingAttentionOutput, finish
from .. import Accelerator
from .build import extension

# A decoding step's softmax and value product run inside the step kernel (one call instead
# of half a dozen small tensor operations), except for encoder-decoder attention whose values
# are not shared by beams (beam 1) above this many hypotheses, where torch's softmax and
# batched matmul run them (the measurements behind the threshold: benchmarks/README.md).
STEP_VALUES_MAX_BATCH = 64


class EvolvingAttentionInput(torch.autograd.Function):
    """``A_input`` (Eq. 4, line 1), channels-last; see :meth:`EvolvingAttentionCPU.full_pass`."""

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
    :meth:`EvolvingAttentionCPU.full_pass`."""

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


class EvolvingAttentionCPU(Accelerator):
    """:func:`~ea_fairseq.modules.evolving_attention.evolving_attention` on CPU: the same
    signature, values and gradients as its reference; ``NotImplemented`` where it does not
    take the call (the reference runs)."""

    device_type = "cpu"
    dtypes = frozenset((torch.float32, torch.float64))

    def available(self) -> bool:
        return extension() is not None

    def __call__(self, logits, previous, masked, neutral, params, *, cache=None, values=None,
                 empty=None, hand_on=False):
        if params.weight is None:
            return NotImplemented
        if cache is None:
            return self.full_pass(logits, previous, masked, neutral, params, values, empty, hand_on)
        return self.step(logits, previous, masked, neutral, params, cache, values, empty, hand_on)

    def full_pass(self, logits, previous, masked, neutral, params, values, empty, hand_on):
        """Whole maps (B, H, T, S): one fused pass before the convolution, one after it."""
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
        return finish(a_logit, masked if hand_on else None, hand_on, values, empty=empty)

    def step(self, logits, previous, masked, neutral, params, cache, values, empty, hand_on):
        """One query row per hypothesis, in place of ``logits`` (B, H, 1, S): the whole of
        Eq. (4) in one call, reading the cached rows in beam search's order -- and where
        no later layer reads ``A_logit``, the softmax and the value product too (a row whose
        every key is masked gets zero weights, as in
        :func:`~ea_fairseq.modules.masked_softmax.masked_softmax`). Not taken
        with autograd on, several rows, a mask per head, ``k = 1``, or the ``full`` layout;
        encoder values it computes slower than torch (:data:`STEP_VALUES_MAX_BATCH`) go to
        torch's softmax and batched matmul."""
        bsz, heads, rows, src_len = logits.shape
        k = params.weight.size(-1)
        if (torch.is_grad_enabled() or rows != 1 or k == 1 or params.layout == "full"
                or neutral is not masked):
            return NotImplemented
        keys = None
        if masked is not None:
            if masked.size(1) != 1:
                return NotImplemented  # a mask per head: the reference
            keys = masked.expand(bsz, 1, 1, src_len).reshape(bsz, src_len)
        fused_values = values is not None and not hand_on and not (
            params.layout == "rows" and bsz > STEP_VALUES_MAX_BATCH and values.size(0) == bsz * heads)
        causal = params.layout == "causal"
        weight = cache.memo("cpu", lambda: (params.weight.tril() if causal else params.weight).contiguous())
        out, rows_out, context = extension().evolving_attention_step(
            logits, previous, cache.rows, keys, weight, params.bias, float(params.alpha),
            float(params.beta), k - 1 if causal else k // 2, values if fused_values else None,
            cache.order)
        cache.store(rows_out)
        if fused_values:
            return EvolvingAttentionOutput(probs=out, context=context)
        return finish(out, masked, hand_on, values, empty=empty)
