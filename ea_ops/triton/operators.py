"""The kernels (:mod:`.evolving_attention`, :mod:`.decoding_step`) as ``torch.library``
operations, and the operation's backends :func:`full_pass` and :func:`step` that call them.

``torch.ops.ea_ops.triton_full_pass`` (one kernel), its gradient
``torch.ops.ea_ops.triton_full_pass_backward`` (two kernels and one reduction) and
``torch.ops.ea_ops.triton_step`` (one kernel; no autograd: decoding) are operators of torch's
dispatcher, each with a fake implementation (the shapes and dtypes of its results, no launch):
``torch.compile`` traces a model through them without a graph break, and a CUDA graph captures
their launches (no host synchronisation: the arguments are checked by their shapes).
The gradient is registered with ``torch.library.register_autograd``, once differentiable (a
second derivative is refused). An output a call does not ask for (``carried`` without
``hand_on``, the gradient of an absent previous map) is left out of the operator's list of
results (no allocation), and None at :func:`evolving_attention_triton` and in the backends'
results.
"""
from typing import List, Optional, Sequence, Tuple

import torch
import triton
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..contract import BackendResult, EvolvingAttentionParams, StepState
from ..values import value_product
from . import checked, decoding_step, evolving_attention as kernels, on_device


@torch.library.custom_op("ea_ops::triton_full_pass", mutates_args=())
def triton_full_pass(logits: Tensor, previous: Optional[Tensor], weight: Tensor, bias: Optional[Tensor],
                     masked: Optional[Tensor], neutral: Optional[Tensor], alpha: float, beta: float, layout: str,
                     softmax: bool, hand_on: bool, tile: Optional[Sequence[int]]) -> List[Tensor]:
    """Eq. (4) of a full pass: ``[out]``, or ``[out, carried]`` with ``hand_on``: ``out`` the
    weights (float32, with ``softmax``) or ``A_logit`` with ``-inf`` where masked, ``carried``
    the finite ``A_logit``. A ``previous`` map that broadcasts is expanded (autograd sums its
    gradient back)."""
    outputs = _fake(logits, previous, weight, bias, masked, neutral, alpha, beta, layout, softmax, hand_on, tile)
    if not logits.numel():
        return outputs
    logits, previous, weight, bias = _as_read(logits, previous, weight, bias)
    grid, (m, m_strides), (n, n_strides), constants = kernels._setup(
        logits, masked, neutral, layout, weight.size(-1), tile, previous is not None)
    with on_device(logits):
        kernels._forward_kernel[grid](
            logits, previous, weight, bias, m, n, outputs[0], outputs[1] if hand_on else None,
            *logits.shape[1:], *m_strides, *n_strides, float(alpha), float(beta), HAS_BIAS=bias is not None,
            NEUTRAL_PER_HEAD=n_strides[1] != 0, SOFTMAX=softmax, HAND_ON=hand_on, **constants)
    return outputs


@triton_full_pass.register_fake
def _fake(logits, previous, weight, bias, masked, neutral, alpha, beta, layout, softmax, hand_on, tile):
    checked(logits, previous, weight, bias, (masked, neutral))
    out = logits.new_empty(logits.shape, dtype=torch.float32 if softmax else logits.dtype)
    return [out, logits.new_empty(logits.shape)] if hand_on else [out]


@torch.library.custom_op("ea_ops::triton_full_pass_backward", mutates_args=())
def triton_full_pass_backward(grad_out: Optional[Tensor], grad_carried: Optional[Tensor], logits: Tensor,
                              previous: Optional[Tensor], weight: Tensor, bias: Optional[Tensor],
                              masked: Optional[Tensor], neutral: Optional[Tensor], probs: Optional[Tensor],
                              alpha: float, beta: float, layout: str, softmax: bool,
                              tile: Optional[Sequence[int]]) -> List[Tensor]:
    """The gradients of :func:`triton_full_pass`'s inputs: ``[logits, weight and bias]``, with a
    previous map ``[logits, previous, weight and bias]`` (``previous`` in the logits' shape;
    weight and bias in one tensor, the weight's ``H·H·k·k`` entries then the bias's ``H``, split
    by :func:`_gradients`), from those of its outputs (None: not used); ``probs``: its weights,
    with ``softmax``. Weight and bias gradients: one
    reduction of every program's share, one rounding (deterministic, no atomics)."""
    grads = _input_gradients(grad_out, grad_carried, logits, previous, weight, bias, masked, neutral, probs, softmax)
    if not logits.numel() or (grad_out is None and grad_carried is None):
        return [g.zero_() for g in grads] + [weight.new_zeros((weight.numel() + logits.size(1),))]
    logits, previous, weight, bias = _as_read(logits, previous, weight, bias)
    grid, (m, m_strides), (n, n_strides), constants = kernels._setup(
        logits, masked, neutral, layout, weight.size(-1), tile, previous is not None)
    heads, taps = logits.size(1), weight.numel()
    dconv, grad_in = (torch.empty(logits.shape, device=logits.device, dtype=torch.float32) for _ in range(2))
    shares = logits.new_empty((grid[0] * triton.cdiv(logits.size(-1), constants["BLOCK_S"]), taps + heads),
                              dtype=torch.float32)
    grad_out, grad_carried = (None if g is None else g.contiguous() for g in (grad_out, grad_carried))
    with on_device(logits):
        kernels._backward_conv_kernel[grid](
            logits, previous, weight, bias, m, n, probs, grad_out, grad_carried, dconv, grad_in, shares,
            *logits.shape[1:], *m_strides, *n_strides, float(alpha), float(beta), HAS_BIAS=bias is not None,
            NEUTRAL_PER_HEAD=n_strides[1] != 0, SOFTMAX=softmax, HAS_GOUT=grad_out is not None,
            HAS_GCARRY=grad_carried is not None, **kernels.BACKWARD_CONV_LIMIT, **constants)
        kernels._backward_input_kernel[grid](
            weight, n, dconv, grad_in, grads[0], grads[1] if previous is not None else None, *logits.shape[1:],
            *n_strides, float(alpha), **constants)
    return grads + [shares.sum(0).to(weight.dtype)]


@triton_full_pass_backward.register_fake
def _fake_backward(grad_out, grad_carried, logits, previous, weight, bias, masked, neutral, probs, alpha, beta,
                   layout, softmax, tile):
    return (_input_gradients(grad_out, grad_carried, logits, previous, weight, bias, masked, neutral, probs, softmax)
            + [weight.new_empty((weight.numel() + logits.size(1),))])


def _as_read(logits, previous, weight, bias):
    """The full pass's tensors as its kernels read them: contiguous, a previous map that
    broadcasts expanded to the logits' shape (a copy, in the forward and again in the backward:
    nothing of the batch's size is kept between them), the bias read as ``bias_ptr + head``."""
    logits = logits.contiguous()
    return (logits, None if previous is None else previous.expand_as(logits).contiguous(), weight.contiguous(),
            None if bias is None else bias.contiguous())


def _input_gradients(grad_out, grad_carried, logits, previous, weight, bias, masked, neutral, probs, softmax):
    """The arguments of the backward checked, and its gradients of the logits and of the previous
    map (where there is one) allocated, contiguous, as the kernels write them."""
    checked(logits, previous, weight, bias, (masked, neutral))
    wrong = [f"{name} {tuple(t.shape)}" for name, t in (("grad_out", grad_out), ("grad_carried", grad_carried),
                                                        ("probs", probs if softmax else None))
             if t is not None and t.shape != logits.shape]
    if wrong or (softmax and probs is None):
        raise ValueError(f"EA's Triton kernels: {', '.join(wrong) or 'no probs with softmax'}: not the logits' "
                         f"shape {tuple(logits.shape)}")
    return [logits.new_empty(logits.shape)] + ([] if previous is None else [logits.new_empty(logits.shape,
                                                                                             dtype=previous.dtype)])


def _keep(ctx, inputs, output) -> None:
    logits, previous, weight, bias, masked, neutral, alpha, beta, layout, softmax, hand_on, tile = inputs
    ctx.setup = (alpha, beta, layout, softmax, hand_on, tile)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(logits, previous, weight, bias, masked, neutral, output[0] if softmax else None)


def _gradients(ctx, grads):
    return _once_differentiable_gradients(ctx, *grads)  # (the outputs' gradients as arguments: a list hides
    # from once_differentiable that they require grad, so a second derivative would not say why it is refused)


@once_differentiable
def _once_differentiable_gradients(ctx, *grads):
    alpha, beta, layout, softmax, hand_on, tile = ctx.setup
    logits, previous, weight, bias, masked, neutral, probs = ctx.saved_tensors
    grad_out, grad_carried = grads[0], grads[1] if hand_on else None
    grads = torch.ops.ea_ops.triton_full_pass_backward(grad_out, grad_carried, logits, previous, weight, bias, masked,
                                                       neutral, probs, alpha, beta, layout, softmax, tile)
    grad_previous, taps, parameters = grads[1] if previous is not None else None, weight.numel(), grads[-1]
    return (grads[0], grad_previous, parameters[:taps].view(weight.shape),
            parameters[taps:] if bias is not None else None, None, None, None, None, None, None, None, None)


triton_full_pass.register_autograd(_gradients, setup_context=_keep)


def evolving_attention_triton(logits, previous, weight, bias, masked, neutral, alpha, beta, layout, softmax, hand_on,
                              tile=None) -> Tuple[Tensor, Optional[Tensor]]:
    """:func:`triton_full_pass`: ``(out, carried)``, ``carried`` None without ``hand_on``."""
    outputs = torch.ops.ea_ops.triton_full_pass(logits, previous, weight, bias, masked, neutral, float(alpha),
                                                float(beta), layout, softmax, hand_on, tile)
    return outputs[0], outputs[1] if hand_on else None


def full_pass(logits: Tensor, previous: Optional[Tensor], masked: Optional[Tensor], neutral: Optional[Tensor],
              params: EvolvingAttentionParams, *, state: Optional[StepState] = None, values: Optional[Tensor] = None,
              hand_on: bool = False, return_maps: bool = False) -> BackendResult:
    """Eq. (4) of whole maps (B, H, T, S) with a map convolution, the backend's signature of
    :class:`~ea_ops.contract.BackendResult` (no ``state``, no ``return_maps``: the
    dispatcher gives this backend neither). Without ``values``: ``A_logit`` with ``-inf`` in
    the masked entries; with them (B_kv * H, S, head_dim): the weights, float32, softmax in the
    kernel (zero weights in rows whose every key is masked), and their product with the
    values. With ``hand_on`` the finite ``A_logit`` too, written by the same kernel."""
    softmax = values is not None
    out, carried = evolving_attention_triton(logits, previous, params.weight, params.bias, masked, neutral,
                                             params.alpha, params.beta, params.layout, softmax, hand_on)
    return _result(out, carried, values, None)


def _result(out: Tensor, carried: Optional[Tensor], values: Optional[Tensor],
            state: Optional[StepState]) -> BackendResult:
    """A backend's result from a kernel's ``out``: ``A_logit`` with ``-inf`` where masked, or,
    with ``values``, the weights (float32) and their product with the values."""
    if values is None:
        return BackendResult(out, masked_filled=True, state=state, carried=carried)
    probs = out if values.dtype == out.dtype else out.to(values.dtype)
    context = value_product(probs, values, out.size(0), out.size(2))
    return BackendResult(probs=out, context=context, state=state, carried=carried)


@torch.library.custom_op("ea_ops::triton_step", mutates_args=())
def triton_step(logits: Tensor, previous: Optional[Tensor], earlier: Optional[Tensor], order: Optional[Tensor],
                masked: Optional[Tensor], weight: Tensor, bias: Optional[Tensor], alpha: float, beta: float,
                layout: str, softmax: bool, hand_on: bool) -> List[Tensor]:
    """One decoding step of Eq. (4) (:func:`step`): ``[out, rows]``, or ``[out, rows, carried]``
    with ``hand_on``; ``earlier`` and ``order``: the state's rows and pending order."""
    outputs = _fake_step(logits, previous, earlier, order, masked, weight, bias, alpha, beta, layout, softmax, hand_on)
    if not logits.numel():  # nothing to launch for no hypotheses or no keys
        return outputs
    bsz, heads, _, src_len = logits.shape
    k = weight.size(-1)
    bias = None if bias is None else bias.contiguous()  # read as bias_ptr + head
    m, m_strides = kernels._mask_args(masked, (bsz, 1, 1, src_len), logits.device)
    if previous is not None:
        previous = previous.expand_as(logits)  # a map that broadcasts, read as the reference's α mix reads it
    x_strides = (logits.stride(0), logits.stride(1), logits.stride(3))
    p_strides = (0, 0, 0) if previous is None else (previous.stride(0), previous.stride(1), previous.stride(3))
    e_strides = (0, 0, 0, 0) if earlier is None else tuple(earlier.stride())
    block_h, block_s, warps = decoding_step.step_blocks(heads, src_len)
    with on_device(logits):
        decoding_step._step_kernel[(bsz,)](
            logits, previous, earlier, order, m, weight.contiguous(), bias, outputs[0], outputs[2] if hand_on else None,
            outputs[1],
            heads, src_len, 0 if earlier is None else earlier.size(0), 0 if earlier is None else earlier.size(3),
            *x_strides, *p_strides, *e_strides, 0 if order is None else order.stride(0), m_strides[0], m_strides[3],
            float(alpha), float(beta), K=k, C0=kernels._offsets(layout, k)[1], CAUSAL=layout == "causal",
            HAS_PREV=previous is not None, HAS_EARLIER=earlier is not None, HAS_ORDER=order is not None,
            HAS_BIAS=bias is not None, SOFTMAX=softmax, HAND_ON=hand_on, BLOCK_H=block_h, BLOCK_S=block_s,
            num_warps=warps)
    return outputs


@triton_step.register_fake
def _fake_step(logits, previous, earlier, order, masked, weight, bias, alpha, beta, layout, softmax, hand_on):
    checked(logits, previous, weight, bias, (masked,), (earlier, order))
    bsz, heads, tgt_len, src_len = logits.shape
    k = weight.size(-1)
    if (tgt_len != 1 or k < 2 or layout not in ("causal", "rows")
            or (masked is not None and masked.dim() >= 3 and masked.size(-3) != 1)):
        raise ValueError(f"EA's Triton step takes one query row, (B, H, 1, S), a shifted layout, a k x k kernel, "
                         f"k > 1, and one mask for all heads: got logits {tuple(logits.shape)}, weight "
                         f"{tuple(weight.shape)}, layout {layout!r}, mask "
                         f"{None if masked is None else tuple(masked.shape)}; the dispatcher gives other calls "
                         "to the reference")
    if earlier is not None and (earlier.dim() != 4 or earlier.shape[1:3] != (heads, k - 1)
                                or earlier.size(3) > src_len or (order is None and earlier.size(0) != bsz)
                                or (order is not None and (tuple(order.shape) != (bsz,)
                                                           or order.dtype not in (torch.int32, torch.int64)))):
        raise ValueError(f"a decoding step's state must hold rows (B', {heads}, {k - 1}, S' <= {src_len}) and an "
                         f"int32/int64 order of {bsz} hypotheses (B' = {bsz} without one), got rows "
                         f"{tuple(earlier.shape)} and order "
                         f"{None if order is None else (tuple(order.shape), order.dtype)}: pass the state the "
                         "previous step returned, reordered by StepState.reordered")
    if logits.numel():
        decoding_step.step_blocks(heads, src_len)  # a row the kernel cannot hold: refused
    out = logits.new_empty(logits.shape, dtype=torch.float32 if softmax else logits.dtype)
    return [out, logits.new_empty((bsz, heads, k - 1, src_len))] + ([logits.new_empty(logits.shape)] if hand_on else [])


def step(logits: Tensor, previous: Optional[Tensor], masked: Optional[Tensor], neutral: Optional[Tensor],
         params: EvolvingAttentionParams, *, state: StepState, values: Optional[Tensor] = None,
         hand_on: bool = False, return_maps: bool = False) -> BackendResult:
    """One decoding step of Eq. (4), the backend's signature of
    :class:`~ea_ops.contract.BackendResult`: one query row per hypothesis (B, H, 1, S), one
    mask (B, 1, 1, S) for all heads (``neutral`` is ``masked``: no padded query rows), a
    shifted layout, ``k > 1``, autograd off (the dispatcher gives it no other call). Without
    ``values``: ``A_logit`` with ``-inf`` where masked; with them (B_kv * H, S, head_dim):
    the weights (float32) and their product with the values. With ``hand_on`` the finite
    ``A_logit`` too. The next :class:`~ea_ops.contract.StepState` is a new tensor; no
    argument is written."""
    softmax = values is not None
    out, rows, *handed = torch.ops.ea_ops.triton_step(
        logits, previous, state.rows, state.order, masked, params.weight, params.bias, float(params.alpha),
        float(params.beta), params.layout, softmax, hand_on)
    return _result(out, handed[0] if hand_on else None, values, StepState(rows))
