"""EA Eq. (4) of a whole map (a full pass) as Triton kernels, forward and backward: the
backend :func:`full_pass` of the operation :func:`ea_ops.evolving_attention`, held to its
reference (:func:`ea_ops.evolving_attention_reference`) by ``tests/ops/test_triton_full_pass.py``.

One program handles ``BLOCK_T`` query rows of one sentence, every head and every key, so the
heads-to-heads convolution and the softmax need nothing from another program:

* forward, one kernel: ``A_input`` (the α mix with the previous layer's finite ``A_logit``,
  neutral zeros) is derived where the convolution reads it (``k x k`` taps of every input
  head, the layout's shift folded into the tap offsets: nothing padded, nothing cropped), then
  bias, ReLU, the β mix and either ``A_logit`` with ``-inf`` where masked or the softmax (rows
  whose every key is masked get zero weights); with ``hand_on`` also the finite ``A_logit``.
  Nothing else is written: no ``A_input``, no convolution output.
* backward, two kernels: the first recomputes the convolution (for ReLU's sign), takes the
  gradient of ``A_logit`` (through the softmax where it ran) and writes the convolution's
  output gradient and the β mix's direct gradient, and each program's share of the weight
  and bias gradients (summed over programs by one reduction: deterministic, no atomics); the
  second is the transposed convolution of that gradient over the heads, the neutral zeros,
  and the α mix's split into the gradients of the logits and of the previous map.

Everything is computed in float32, whatever the dtype of the maps (float16, bfloat16,
float32); every result is rounded once, to the dtype of the tensor it is written into (the
softmax's weights: float32, as the operation returns them).
"""
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..contract import BackendResult, EvolvingAttentionParams, StepState
from ..values import value_product
from . import MAX_ROW_ELEMENTS

# query rows per program: at most this many float32 values of a (heads x rows x keys) tile,
# and threads for 16 of them each: compiled for sm_90 (H = 8, S = 32), the backward's
# convolution kernel then holds 128 registers a thread, no spills (32 each: 252 registers)
TILE_ELEMENTS = 2048
ELEMENTS_PER_THREAD = 16


@triton.jit
def _a_input(x_ptr, p_ptr, off, keep, alpha, HAS_PREV: tl.constexpr):
    """``A_input`` at the offsets ``off`` of the maps, zero where not ``keep`` (outside the
    map, neutral)."""
    x = tl.load(x_ptr + off, mask=keep, other=0.0).to(tl.float32)
    if HAS_PREV:
        p = tl.load(p_ptr + off, mask=keep, other=0.0).to(tl.float32)
        x = x + alpha * (p - x)
    return x


@triton.jit
def _kept(n_ptr, heads, rows, cols, inside, snh, snt, sns, HAS_NEUTRAL: tl.constexpr):
    """Inside the map and not neutral, at (heads, rows, cols) of the program's sentence."""
    if HAS_NEUTRAL:
        n = tl.load(n_ptr + heads * snh + rows * snt + cols * sns, mask=inside, other=1)
        return inside & (n == 0)
    return inside


@triton.jit
def _convolution(x_ptr, p_ptr, w_ptr, n_ptr, hh, tt, jj, H, T, S, snh, snt, sns, alpha,
                 BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr,
                 K: tl.constexpr, R0: tl.constexpr, C0: tl.constexpr, CAUSAL: tl.constexpr,
                 HAS_PREV: tl.constexpr, HAS_NEUTRAL: tl.constexpr, NEUTRAL_PER_HEAD: tl.constexpr):
    """``Conv(A_input)`` (no bias) at (every head, tt, jj): output (t, j) reads input
    (t + a - R0, j + c - C0) through tap (a, c); the causal layout keeps taps c <= a.
    A tap's offsets and (one for all heads) neutral entries are derived once for every
    input head."""
    acc = tl.zeros([BLOCK_H, BLOCK_T, BLOCK_S], dtype=tl.float32)
    w_rows = w_ptr + hh * (H * K * K)
    heads = hh < H
    for a in tl.static_range(K):
        for c in tl.static_range(K):
            if (not CAUSAL) or (c <= a):
                rows = tt + (a - R0)
                cols = jj + (c - C0)
                inside = (rows >= 0) & (rows < T) & (cols >= 0) & (cols < S)
                off = rows * S + cols
                keep = inside
                if not NEUTRAL_PER_HEAD:
                    keep = _kept(n_ptr, 0, rows, cols, inside, snh, snt, sns, HAS_NEUTRAL)
                for g in range(H):
                    if NEUTRAL_PER_HEAD:
                        keep = _kept(n_ptr, g, rows, cols, inside, snh, snt, sns, HAS_NEUTRAL)
                    x = _a_input(x_ptr, p_ptr, off + g * T * S, keep, alpha, HAS_PREV)
                    w = tl.load(w_rows + (g * K + a) * K + c, mask=heads, other=0.0)
                    acc += w.to(tl.float32) * x
    return acc


@triton.jit
def _forward_kernel(x_ptr, p_ptr, w_ptr, bias_ptr, m_ptr, n_ptr, out_ptr, carry_ptr,
                    H, T, S, smb, smh, smt, sms, snb, snh, snt, sns, alpha, beta,
                    K: tl.constexpr, R0: tl.constexpr, C0: tl.constexpr, CAUSAL: tl.constexpr,
                    HAS_PREV: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr,
                    HAS_NEUTRAL: tl.constexpr, NEUTRAL_PER_HEAD: tl.constexpr, SOFTMAX: tl.constexpr,
                    HAND_ON: tl.constexpr,
                    BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr):
    # the program's sentence: its pointers moved once (64-bit), offsets within it 32-bit
    b = tl.program_id(1).to(tl.int64)
    base = b * H * T * S
    x_ptr += base
    if HAS_PREV:
        p_ptr += base
    out_ptr += base
    if HAND_ON:
        carry_ptr += base
    if HAS_MASK:
        m_ptr += b * smb
    if HAS_NEUTRAL:
        n_ptr += b * snb
    hh = tl.arange(0, BLOCK_H)[:, None, None]
    tt = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T))[None, :, None]
    jj = tl.arange(0, BLOCK_S)[None, None, :]
    valid = (hh < H) & (tt < T) & (jj < S)
    conv = _convolution(x_ptr, p_ptr, w_ptr, n_ptr, hh, tt, jj, H, T, S, snh, snt, sns, alpha, BLOCK_H, BLOCK_T,
                        BLOCK_S, K, R0, C0, CAUSAL, HAS_PREV, HAS_NEUTRAL, NEUTRAL_PER_HEAD)
    if HAS_BIAS:
        conv += tl.load(bias_ptr + hh, mask=hh < H, other=0.0).to(tl.float32)
    off = (hh * T + tt) * S + jj
    keep = _kept(n_ptr, hh, tt, jj, valid, snh, snt, sns, HAS_NEUTRAL)
    center = _a_input(x_ptr, p_ptr, off, keep, alpha, HAS_PREV)
    a_logit = center + beta * (tl.maximum(conv, 0.0) - center)
    if HAND_ON:
        tl.store(carry_ptr + off, a_logit.to(carry_ptr.dtype.element_ty), mask=valid)
    if HAS_MASK:
        masked = tl.load(m_ptr + hh * smh + tt * smt + jj * sms, mask=valid, other=1) != 0
    else:
        masked = jj >= S
    scores = tl.where(masked, float("-inf"), a_logit)
    if SOFTMAX:
        top = tl.max(scores, axis=2)
        top = tl.where(top == float("-inf"), 0.0, top)  # every key masked: zero weights
        e = tl.exp(scores - top[:, :, None])
        total = tl.sum(e, axis=2)
        total = tl.where(total == 0.0, 1.0, total)
        tl.store(out_ptr + off, e / total[:, :, None], mask=valid)
    else:
        tl.store(out_ptr + off, scores.to(out_ptr.dtype.element_ty), mask=valid)


@triton.jit
def _backward_conv_kernel(x_ptr, p_ptr, w_ptr, bias_ptr, m_ptr, n_ptr, probs_ptr, gout_ptr, gcarry_ptr,
                          dconv_ptr, gin_ptr, shares_ptr,
                          H, T, S, smb, smh, smt, sms, snb, snh, snt, sns, alpha, beta,
                          K: tl.constexpr, R0: tl.constexpr, C0: tl.constexpr, CAUSAL: tl.constexpr,
                          HAS_PREV: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr,
                          HAS_NEUTRAL: tl.constexpr, NEUTRAL_PER_HEAD: tl.constexpr, SOFTMAX: tl.constexpr,
                          HAS_GOUT: tl.constexpr, HAS_GCARRY: tl.constexpr,
                          BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr):
    b = tl.program_id(1).to(tl.int64)
    program = b * tl.num_programs(0) + tl.program_id(0)
    base = b * H * T * S
    x_ptr += base
    if HAS_PREV:
        p_ptr += base
    if HAS_MASK:
        m_ptr += b * smb
    if HAS_NEUTRAL:
        n_ptr += b * snb
    if SOFTMAX:
        probs_ptr += base
    if HAS_GOUT:
        gout_ptr += base
    if HAS_GCARRY:
        gcarry_ptr += base
    dconv_ptr += base
    gin_ptr += base
    h1 = tl.arange(0, BLOCK_H)
    hh = h1[:, None, None]
    tt = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T))[None, :, None]
    jj = tl.arange(0, BLOCK_S)[None, None, :]
    valid = (hh < H) & (tt < T) & (jj < S)
    off = (hh * T + tt) * S + jj
    conv = _convolution(x_ptr, p_ptr, w_ptr, n_ptr, hh, tt, jj, H, T, S, snh, snt, sns, alpha, BLOCK_H, BLOCK_T,
                        BLOCK_S, K, R0, C0, CAUSAL, HAS_PREV, HAS_NEUTRAL, NEUTRAL_PER_HEAD)
    if HAS_BIAS:
        conv += tl.load(bias_ptr + hh, mask=hh < H, other=0.0).to(tl.float32)
    # the gradient of A_logit: through the softmax, or through the -inf fill
    grad = tl.zeros([BLOCK_H, BLOCK_T, BLOCK_S], dtype=tl.float32)
    if HAS_GOUT:
        g_out = tl.load(gout_ptr + off, mask=valid, other=0.0).to(tl.float32)
        if SOFTMAX:
            probs = tl.load(probs_ptr + off, mask=valid, other=0.0)
            grad = probs * (g_out - tl.sum(probs * g_out, axis=2)[:, :, None])
        else:
            if HAS_MASK:
                masked = tl.load(m_ptr + hh * smh + tt * smt + jj * sms, mask=valid, other=1)
                g_out = tl.where(masked != 0, 0.0, g_out)
            grad = g_out
    if HAS_GCARRY:
        grad += tl.load(gcarry_ptr + off, mask=valid, other=0.0).to(tl.float32)
    dconv = tl.where(conv > 0.0, beta * grad, 0.0)
    tl.store(dconv_ptr + off, dconv, mask=valid)
    tl.store(gin_ptr + off, (1.0 - beta) * grad, mask=valid)
    # this program's share of the weight and bias gradients, one row of H * H * K * K + H:
    # for each tap, dconv against the tap's view of A_input (zero for the causal layout's
    # masked taps), then the bias's
    row = shares_ptr + program * (H * H * K * K + H)
    if HAS_BIAS:
        tl.store(row + H * H * K * K + h1, tl.sum(tl.sum(dconv, axis=2), axis=1), mask=h1 < H)
    shares = row + h1 * (H * K * K)
    for a in tl.static_range(K):
        for c in tl.static_range(K):
            if CAUSAL and (c > a):
                for g in range(H):
                    tl.store(shares + (g * K + a) * K + c, tl.zeros([BLOCK_H], dtype=tl.float32), mask=h1 < H)
            else:
                rows = tt + (a - R0)
                cols = jj + (c - C0)
                inside = (rows >= 0) & (rows < T) & (cols >= 0) & (cols < S)
                tap_off = rows * S + cols
                keep = inside
                if not NEUTRAL_PER_HEAD:
                    keep = _kept(n_ptr, 0, rows, cols, inside, snh, snt, sns, HAS_NEUTRAL)
                for g in range(H):
                    if NEUTRAL_PER_HEAD:
                        keep = _kept(n_ptr, g, rows, cols, inside, snh, snt, sns, HAS_NEUTRAL)
                    x = _a_input(x_ptr, p_ptr, tap_off + g * T * S, keep, alpha, HAS_PREV)
                    share = tl.sum(tl.sum(dconv * x, axis=2), axis=1)
                    tl.store(shares + (g * K + a) * K + c, share, mask=h1 < H)


@triton.jit
def _backward_input_kernel(w_ptr, n_ptr, dconv_ptr, gin_ptr, gx_ptr, gp_ptr,
                           H, T, S, snb, snh, snt, sns, alpha,
                           K: tl.constexpr, R0: tl.constexpr, C0: tl.constexpr, CAUSAL: tl.constexpr,
                           HAS_PREV: tl.constexpr, HAS_NEUTRAL: tl.constexpr,
                           BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr):
    b = tl.program_id(1).to(tl.int64)
    base = b * H * T * S
    dconv_ptr += base
    gin_ptr += base
    gx_ptr += base
    if HAS_PREV:
        gp_ptr += base
    if HAS_NEUTRAL:
        n_ptr += b * snb
    gg = tl.arange(0, BLOCK_H)[:, None, None]
    uu = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T))[None, :, None]
    vv = tl.arange(0, BLOCK_S)[None, None, :]
    valid = (gg < H) & (uu < T) & (vv < S)
    off = (gg * T + uu) * S + vv
    acc = tl.load(gin_ptr + off, mask=valid, other=0.0)
    # input (u, v) of head g fed output (u - a + R0, v - c + C0) of head h through tap (a, c)
    w_cols = w_ptr + gg * (K * K)
    heads = gg < H
    for a in tl.static_range(K):
        for c in tl.static_range(K):
            if (not CAUSAL) or (c <= a):
                rows = uu - (a - R0)
                cols = vv - (c - C0)
                inside = (rows >= 0) & (rows < T) & (cols >= 0) & (cols < S)
                tap_off = rows * S + cols
                for h in range(H):
                    d = tl.load(dconv_ptr + tap_off + h * T * S, mask=inside, other=0.0)
                    w = tl.load(w_cols + (h * H * K + a) * K + c, mask=heads, other=0.0)
                    acc += w.to(tl.float32) * d
    if HAS_NEUTRAL:
        neutral = tl.load(n_ptr + gg * snh + uu * snt + vv * sns, mask=valid, other=0)
        acc = tl.where(neutral != 0, 0.0, acc)
    if HAS_PREV:
        tl.store(gx_ptr + off, ((1.0 - alpha) * acc).to(gx_ptr.dtype.element_ty), mask=valid)
        tl.store(gp_ptr + off, (alpha * acc).to(gp_ptr.dtype.element_ty), mask=valid)
    else:
        tl.store(gx_ptr + off, acc.to(gx_ptr.dtype.element_ty), mask=valid)


def _offsets(layout: str, k: int):
    """(R0, C0): output (t, j) reads input rows t - R0 .. t - R0 + k - 1, columns j - C0 ..
    (:mod:`~ea_fairseq.modules.attention_map_conv`'s layouts, Fig. 3 of the EA paper)."""
    rows = k - 1 if layout in ("causal", "rows") else k // 2
    cols = k - 1 if layout == "causal" else k // 2
    return rows, cols


def blocks(heads: int, tgt_len: int, src_len: int, block_t: Optional[int] = None):
    """(BLOCK_H, BLOCK_T, BLOCK_S, warps) for a (heads, T, S) map: a program's tile holds
    about :data:`TILE_ELEMENTS` float32 values, ``ELEMENTS_PER_THREAD`` per thread."""
    block_h, block_s = triton.next_power_of_2(heads), triton.next_power_of_2(src_len)
    if block_h * block_s > MAX_ROW_ELEMENTS:
        raise ValueError(f"EA's Triton kernels take at most {MAX_ROW_ELEMENTS} (heads x keys, rounded up to "
                         f"powers of two) per row, got {heads} x {src_len}: the dispatcher gives such calls "
                         "to the reference")
    if block_t is None:
        block_t = max(1, min(triton.next_power_of_2(tgt_len), TILE_ELEMENTS // (block_h * block_s)))
    warps = max(4, min(16, block_h * block_t * block_s // (32 * ELEMENTS_PER_THREAD)))
    return block_h, block_t, block_s, warps


def _mask_args(mask: Optional[Tensor], shape):
    """A bool mask broadcast to ``shape`` as (bytes, strides); a placeholder without one."""
    if mask is None:
        return None, (0, 0, 0, 0)
    if mask.dtype != torch.bool:
        raise ValueError(f"EA's masks are bool tensors (True: masked), got {mask.dtype}: pass mask.bool()")
    mask = mask.expand(shape)
    return mask.view(torch.uint8), tuple(mask.stride())


class EvolvingAttentionTriton(torch.autograd.Function):
    """Eq. (4) of a full pass: ``(out, carried)`` with ``out`` the weights (float32, with
    ``softmax``) or ``A_logit`` with ``-inf`` where masked, ``carried`` the finite ``A_logit``
    (with ``hand_on``, else None)."""

    @staticmethod
    def forward(ctx, logits, previous, weight, bias, masked, neutral, alpha, beta, layout, softmax, hand_on,
                block_t):
        logits = logits.contiguous()
        previous = None if previous is None else previous.contiguous()
        weight = weight.contiguous()
        bias = None if bias is None else bias.contiguous()  # read as bias_ptr + head
        bsz, heads, tgt_len, src_len = shape = logits.shape
        k = weight.size(-1)
        block_h, block_t, block_s, warps = blocks(heads, tgt_len, src_len, block_t)
        m, m_strides = _mask_args(masked, shape)
        n, n_strides = _mask_args(neutral, shape)
        out = torch.empty(shape, device=logits.device, dtype=torch.float32 if softmax else logits.dtype)
        carried = torch.empty_like(logits) if hand_on else None
        rows, cols = _offsets(layout, k)
        grid = (triton.cdiv(tgt_len, block_t), bsz)
        _forward_kernel[grid](
            logits, previous, weight, bias, m, n, out, carried, heads, tgt_len, src_len, *m_strides, *n_strides,
            float(alpha), float(beta), K=k, R0=rows, C0=cols, CAUSAL=layout == "causal",
            HAS_PREV=previous is not None, HAS_BIAS=bias is not None, HAS_MASK=m is not None,
            HAS_NEUTRAL=n is not None, NEUTRAL_PER_HEAD=n_strides[1] != 0, SOFTMAX=softmax, HAND_ON=hand_on,
            BLOCK_H=block_h, BLOCK_T=block_t, BLOCK_S=block_s, num_warps=warps)
        ctx.setup = (alpha, beta, layout, softmax, block_t, previous is not None)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(logits, previous, weight, bias, masked, neutral, out if softmax else None)
        return out, carried

    @staticmethod
    def backward(ctx, grad_out, grad_carried):
        alpha, beta, layout, softmax, block_t, has_previous = ctx.setup
        logits, previous, weight, bias, masked, neutral, probs = ctx.saved_tensors
        bsz, heads, tgt_len, src_len = shape = logits.shape
        k = weight.size(-1)
        block_h, block_t, block_s, warps = blocks(heads, tgt_len, src_len, block_t)
        m, m_strides = _mask_args(masked, shape)
        n, n_strides = _mask_args(neutral, shape)
        rows, cols = _offsets(layout, k)
        grid = (triton.cdiv(tgt_len, block_t), bsz)
        programs = grid[0] * grid[1]
        dconv = torch.empty(shape, device=logits.device, dtype=torch.float32)
        grad_in = torch.empty(shape, device=logits.device, dtype=torch.float32)
        taps = weight.numel()
        shares = logits.new_empty((programs, taps + heads), dtype=torch.float32)
        grad_out = None if grad_out is None else grad_out.contiguous()
        grad_carried = None if grad_carried is None else grad_carried.contiguous()
        constants = dict(K=k, R0=rows, C0=cols, CAUSAL=layout == "causal", HAS_PREV=has_previous,
                         HAS_NEUTRAL=n is not None, BLOCK_H=block_h, BLOCK_T=block_t, BLOCK_S=block_s,
                         num_warps=warps)
        _backward_conv_kernel[grid](
            logits, previous, weight, bias, m, n, probs, grad_out, grad_carried, dconv, grad_in,
            shares, heads, tgt_len, src_len, *m_strides, *n_strides, float(alpha), float(beta),
            HAS_BIAS=bias is not None, HAS_MASK=m is not None, NEUTRAL_PER_HEAD=n_strides[1] != 0,
            SOFTMAX=softmax, HAS_GOUT=grad_out is not None,
            HAS_GCARRY=grad_carried is not None, **constants)
        grad_logits = torch.empty_like(logits)
        grad_previous = torch.empty_like(previous) if has_previous else None
        _backward_input_kernel[grid](
            weight, n, dconv, grad_in, grad_logits, grad_previous, heads, tgt_len, src_len, *n_strides,
            float(alpha), **constants)
        total = shares.sum(0).to(weight.dtype)  # one reduction, one rounding, for weight and bias
        grad_weight = total[:taps].view(weight.shape)
        grad_bias = total[taps:] if bias is not None else None
        return grad_logits, grad_previous, grad_weight, grad_bias, None, None, None, None, None, None, None, None




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
    if previous is not None:
        previous = previous.expand_as(logits)  # a map that broadcasts: its gradient is summed back by autograd
    out, carried = EvolvingAttentionTriton.apply(
        logits, previous, params.weight, params.bias, masked, neutral, float(params.alpha), float(params.beta),
        params.layout, softmax, hand_on, None)
    if not softmax:
        return BackendResult(out, masked_filled=True, carried=carried)
    probs = out if values.dtype == out.dtype else out.to(values.dtype)
    context = value_product(probs, values, logits.size(0), logits.size(2))
    return BackendResult(probs=out, context=context, carried=carried)
