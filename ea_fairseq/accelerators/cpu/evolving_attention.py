"""EA Eq. (4) on CPU, fused (float32/float64): the accelerator of
:mod:`ea_fairseq.modules.evolving_attention`, which holds the equation and its reference.

* :meth:`EvolvingAttentionCPU.full_pass` (training and full passes): one C++ pass before
  the convolution (skip connection, neutral zeros, the channels-last layout the
  convolution reads) and one after it (ReLU, β mix, and the crop of the convolution's
  border), each with a fused backward. In PyTorch operations those passes, their backward
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
from torch import Tensor

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
    """The operations :class:`~ea_fairseq.modules.evolving_attention.EvolvingAttention`
    calls on an accelerator (same values and gradients as its reference)."""

    device_type = "cpu"
    dtypes = frozenset((torch.float32, torch.float64))

    def available(self) -> bool:
        return extension() is not None

    def full_pass(self, logits: Tensor, previous: Optional[Tensor], neutral: Optional[Tensor],
                  masked: Optional[Tensor], conv, alpha: float, beta: float) -> Tensor:
        """``A_logit`` of whole maps (B, H, T, S), Eq. (4) with ``conv`` (an
        :class:`~ea_fairseq.modules.attention_map_conv.AttentionMapConv`).

        ``neutral`` marks the entries that enter the skip connection and the convolution
        as zeros; ``masked``, when given, the entries written ``-inf`` (else they keep
        their finite values). Both broadcastable to the map, or None. Contiguous result.
        """
        if neutral is not None:
            neutral = neutral.expand(logits.shape)
        a_input = EvolvingAttentionInput.apply(logits, previous, neutral, float(alpha))
        conv_out = conv.convolve_uncropped(a_input)  # its [:, :, :T, :S] is Conv(A_input)
        if masked is not None:
            masked = masked.expand(logits.shape)
        return ConvolutionResidual.apply(a_input, conv_out, masked, float(beta))

    def step(self, logits: Tensor, previous: Optional[Tensor], masked: Optional[Tensor],
             earlier: Optional[Tensor], order: Optional[Tensor], conv, alpha: float, beta: float,
             values: Optional[Tensor] = None, cross_attention: bool = False):
        """Eq. (4) for one query row per hypothesis, in place of ``logits`` (B, H, 1, S).

        ``previous``: the previous layer's ``A_logit`` row or None; ``masked``: the masked
        entries (broadcastable, the same for every head) or None; ``earlier``: the cached
        ``k - 1`` rows of ``A_input`` (B', H, k-1, S' <= S) or None before the first step;
        ``order``: beam search's reorder since they were cached (hypothesis n reads
        ``earlier[order[n]]``) or None. Returns ``(A_logit, rows to cache, None)`` --
        ``A_logit`` finite, masked entries included -- or, with ``values``
        (B_kv * H, S, head_dim), ``(weights, rows to cache, context)``: the softmax over
        the unmasked keys and the value product (1, B, H * head_dim). None where the
        accelerator does not take the step (autograd on, several rows, per-head masks,
        no earlier rows to read, or -- ``cross_attention`` -- encoder values it computes
        slower than torch, see :data:`STEP_VALUES_MAX_BATCH`).
        """
        bsz, heads, rows, src_len = logits.shape
        if torch.is_grad_enabled() or rows != 1 or conv.rows_needed == 0:
            return None
        if (values is not None and cross_attention and bsz > STEP_VALUES_MAX_BATCH
                and values.size(0) == bsz * heads):
            return None  # encoder values per hypothesis (beam 1): torch's batched matmul
        keys = None
        if masked is not None:
            if masked.size(1) != 1:
                return None  # a mask per head: the reference
            keys = masked.expand(bsz, 1, 1, src_len).reshape(bsz, src_len)
        return extension().evolving_attention_step(
            logits, previous, earlier, keys, conv.masked_weight(), conv.bias, float(alpha),
            float(beta), conv.col_padding[0], values, order)
