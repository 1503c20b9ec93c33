"""EA Eq. (4) of a whole map (a full pass) as Triton kernels, forward and backward, launched by
the operators of :mod:`.operators` (the backend of the operation :func:`ea_ops.evolving_attention`),
held to its reference (:func:`ea_ops.evolving_attention_reference`) by
``tests/ops/test_triton_full_pass.py``.

One program handles ``BLOCK_T`` query rows of one sentence and every head, looping over the
keys in blocks of ``BLOCK_S`` (the convolution reads its neighbours' entries from the maps,
so a block needs nothing from another program or block). The tile is the same for every
length, and the integer arguments are not specialised: one compiled variant takes every
length, stride and batch (``benchmarks/triton_counts.py`` counts them):

* forward, one kernel: ``A_input`` (the α mix with the previous layer's finite ``A_logit``,
  neutral zeros) is derived where the convolution reads it (``k x k`` taps of every input
  head, the layout's shift folded into the tap offsets: nothing padded, nothing cropped), then
  bias, ReLU, the β mix and ``A_logit`` with ``-inf`` where masked, written; where the weights
  are asked for, each row's running maximum and sum of exponentials over the blocks, then a
  second pass turns the written scores into the softmax (rows whose every key is masked get
  zero weights); with ``hand_on`` also the finite ``A_logit``. Nothing else is written: no
  ``A_input``, no convolution output.
* backward, two kernels: the first takes each row's sum of the weights times their gradient
  (where the softmax ran), then block by block recomputes the convolution (for ReLU's sign),
  takes the gradient of ``A_logit`` and writes the convolution's output gradient and the β
  mix's direct gradient, and each block's share of the weight and bias gradients (summed over
  programs and blocks by one reduction: deterministic, no atomics); the second is the
  transposed convolution of that gradient over the heads, the neutral zeros, and the α mix's
  split into the gradients of the logits and of the previous map.

Everything is computed in float32, whatever the dtype of the maps (float16, bfloat16,
float32); every result is rounded once, to the dtype of the tensor it is written into (the
softmax's weights: float32, as the operation returns them).
"""
import functools
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

# the integer arguments (lengths, strides): not specialised by Triton, so that one compiled
# variant takes every length, stride and batch (not one for each divisible by 16 or not)
MAP_INTEGERS = ("H", "T", "S", "smb", "smh", "smt", "sms", "snb", "snh", "snt", "sns")

# a program's tile: keys in blocks of KEYS_BLOCK, query rows for about TILE_ELEMENTS float32
# values, at least four warps: for sm_90 at H = 8 (4 rows, 8 values a thread) the kernels hold
# at most 136 registers a thread, no spills (2048 values: the forward spills 16 bytes)
KEYS_BLOCK = 32
TILE_ELEMENTS = 1024
ELEMENTS_PER_THREAD = 16
# the backward convolution kernel's register limit on NVIDIA, not ROCm (no maxnreg there): on sm_90
# 142 to 191 at H = 4 and 8; without one ptxas holds it to 128 and spills 8 to 16 bytes a thread
BACKWARD_CONV_LIMIT = {} if torch.version.hip else {"maxnreg": 192}


@triton.jit
def _program(T, BLOCK_T: tl.constexpr):
    """(sentence, row tile) of this program: the grid is one axis of sentences x row tiles
    (axis 0 takes 2^31 - 1 programs; a second axis would stop at 65,535 sentences)."""
    pid = tl.program_id(0)
    tiles = tl.cdiv(T, BLOCK_T)
    return (pid // tiles).to(tl.int64), pid % tiles


@triton.jit
def _key_block(hh, tt, s0, H, T, S, BLOCK_S: tl.constexpr):
    """Keys ``s0`` .. ``s0 + BLOCK_S`` of rows ``tt`` of heads ``hh``: (keys, inside, offsets)."""
    jj = (s0 + tl.arange(0, BLOCK_S))[None, None, :]
    return jj, (hh < H) & (tt < T) & (jj < S), (hh * T + tt) * S + jj


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
def _kept(n_ptr, heads, rows, cols, inside, snh, snt, sns):
    """Inside the map and not neutral, at (heads, rows, cols) of the program's sentence."""
    n = tl.load(n_ptr + heads * snh + rows * snt + cols * sns, mask=inside, other=1)
    return inside & (n == 0)


@triton.jit
def _tap(n_ptr, tt, jj, T, S, snh, snt, sns, a: tl.constexpr, c: tl.constexpr, R0: tl.constexpr, C0: tl.constexpr,
         NEUTRAL_PER_HEAD: tl.constexpr):
    """What tap (a, c) reads for outputs (tt, jj), input (tt + a - R0, jj + c - C0): (rows,
    cols, inside the map, offsets, kept: inside, and not neutral where one mask serves all heads)."""
    rows = tt + (a - R0)
    cols = jj + (c - C0)
    inside = (rows >= 0) & (rows < T) & (cols >= 0) & (cols < S)
    keep = inside
    if not NEUTRAL_PER_HEAD:
        keep = _kept(n_ptr, 0, rows, cols, inside, snh, snt, sns)
    return rows, cols, inside, rows * S + cols, keep


@triton.jit
def _tap_input(x_ptr, p_ptr, n_ptr, g, rows, cols, inside, off, keep, T, S, snh, snt, sns, alpha,
               HAS_PREV: tl.constexpr, NEUTRAL_PER_HEAD: tl.constexpr):
    """``A_input`` of input head ``g`` where a tap (:func:`_tap`) reads it."""
    if NEUTRAL_PER_HEAD:
        keep = _kept(n_ptr, g, rows, cols, inside, snh, snt, sns)
    return _a_input(x_ptr, p_ptr, off + g * T * S, keep, alpha, HAS_PREV)


@triton.jit
def _convolution(x_ptr, p_ptr, w_ptr, n_ptr, hh, tt, jj, H, T, S, snh, snt, sns, alpha,
                 BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr,
                 K: tl.constexpr, R0: tl.constexpr, C0: tl.constexpr, CAUSAL: tl.constexpr,
                 HAS_PREV: tl.constexpr, NEUTRAL_PER_HEAD: tl.constexpr):
    """``Conv(A_input)`` (no bias) at (every head, tt, jj), tap by tap (:func:`_tap`); the
    causal layout keeps taps c <= a."""
    acc = tl.zeros([BLOCK_H, BLOCK_T, BLOCK_S], dtype=tl.float32)
    w_rows = w_ptr + hh * (H * K * K)
    heads = hh < H
    for a in tl.static_range(K):
        for c in tl.static_range(K):
            if (not CAUSAL) or (c <= a):
                rows, cols, inside, off, keep = _tap(n_ptr, tt, jj, T, S, snh, snt, sns, a, c, R0, C0,
                                                     NEUTRAL_PER_HEAD)
                for g in range(H):
                    x = _tap_input(x_ptr, p_ptr, n_ptr, g, rows, cols, inside, off, keep, T, S, snh, snt, sns, alpha,
                                   HAS_PREV, NEUTRAL_PER_HEAD)
                    w = tl.load(w_rows + (g * K + a) * K + c, mask=heads, other=0.0)
                    acc += w.to(tl.float32) * x
    return acc


@triton.jit(do_not_specialize=MAP_INTEGERS)
def _forward_kernel(x_ptr, p_ptr, w_ptr, bias_ptr, m_ptr, n_ptr, out_ptr, carry_ptr,
                    H, T, S, smb, smh, smt, sms, snb, snh, snt, sns, alpha, beta,
                    K: tl.constexpr, R0: tl.constexpr, C0: tl.constexpr, CAUSAL: tl.constexpr,
                    HAS_PREV: tl.constexpr, HAS_BIAS: tl.constexpr, NEUTRAL_PER_HEAD: tl.constexpr,
                    SOFTMAX: tl.constexpr,
                    HAND_ON: tl.constexpr,
                    BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr):
    # the program's sentence: its pointers moved once (64-bit), offsets within it 32-bit
    b, tile = _program(T, BLOCK_T)
    base = b * H * T * S
    x_ptr += base
    if HAS_PREV:
        p_ptr += base
    out_ptr += base
    if HAND_ON:
        carry_ptr += base
    m_ptr += b * smb
    n_ptr += b * snb
    hh = tl.arange(0, BLOCK_H)[:, None, None]
    tt = (tile * BLOCK_T + tl.arange(0, BLOCK_T))[None, :, None]
    # the keys block by block: A_logit written (with -inf where masked), and with the softmax
    # each row's running maximum and sum of exponentials (rescaled as the maximum grows)
    top = tl.full([BLOCK_H, BLOCK_T], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_H, BLOCK_T], dtype=tl.float32)
    for s0 in range(0, S, BLOCK_S):
        jj, valid, off = _key_block(hh, tt, s0, H, T, S, BLOCK_S)
        conv = _convolution(x_ptr, p_ptr, w_ptr, n_ptr, hh, tt, jj, H, T, S, snh, snt, sns, alpha, BLOCK_H,
                            BLOCK_T, BLOCK_S, K, R0, C0, CAUSAL, HAS_PREV, NEUTRAL_PER_HEAD)
        if HAS_BIAS:
            conv += tl.load(bias_ptr + hh, mask=hh < H, other=0.0).to(tl.float32)
        keep = _kept(n_ptr, hh, tt, jj, valid, snh, snt, sns)
        center = _a_input(x_ptr, p_ptr, off, keep, alpha, HAS_PREV)
        a_logit = center + beta * (tl.maximum(conv, 0.0) - center)
        if HAND_ON:
            tl.store(carry_ptr + off, a_logit.to(carry_ptr.dtype.element_ty), mask=valid)
        masked = tl.load(m_ptr + hh * smh + tt * smt + jj * sms, mask=valid, other=1) != 0
        scores = tl.where(masked, float("-inf"), a_logit)
        tl.store(out_ptr + off, scores.to(out_ptr.dtype.element_ty), mask=valid)
        if SOFTMAX:
            grown = tl.maximum(top, tl.max(scores, axis=2))
            shift = tl.where(grown == float("-inf"), 0.0, grown)  # every key so far masked
            total = total * tl.exp(top - shift) + tl.sum(tl.exp(scores - shift[:, :, None]), axis=2)
            top = grown
    if SOFTMAX:
        # the weights from the scores this program wrote (float32): zero in rows whose every key is masked
        tl.debug_barrier()
        shift = tl.where(top == float("-inf"), 0.0, top)
        total = tl.where(total == 0.0, 1.0, total)
        for s0 in range(0, S, BLOCK_S):
            jj, valid, off = _key_block(hh, tt, s0, H, T, S, BLOCK_S)
            scores = tl.load(out_ptr + off, mask=valid, other=float("-inf"))
            tl.store(out_ptr + off, tl.exp(scores - shift[:, :, None]) / total[:, :, None], mask=valid)


@triton.jit(do_not_specialize=MAP_INTEGERS)
def _backward_conv_kernel(x_ptr, p_ptr, w_ptr, bias_ptr, m_ptr, n_ptr, probs_ptr, gout_ptr, gcarry_ptr,
                          dconv_ptr, gin_ptr, shares_ptr,
                          H, T, S, smb, smh, smt, sms, snb, snh, snt, sns, alpha, beta,
                          K: tl.constexpr, R0: tl.constexpr, C0: tl.constexpr, CAUSAL: tl.constexpr,
                          HAS_PREV: tl.constexpr, HAS_BIAS: tl.constexpr, NEUTRAL_PER_HEAD: tl.constexpr,
                          SOFTMAX: tl.constexpr,
                          HAS_GOUT: tl.constexpr, HAS_GCARRY: tl.constexpr,
                          BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr):
    b, tile = _program(T, BLOCK_T)
    program = tl.program_id(0).to(tl.int64)
    base = b * H * T * S
    x_ptr += base
    if HAS_PREV:
        p_ptr += base
    m_ptr += b * smb
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
    tt = (tile * BLOCK_T + tl.arange(0, BLOCK_T))[None, :, None]
    if SOFTMAX and HAS_GOUT:  # each row's sum of weights x their gradient, over every key
        dot = tl.zeros([BLOCK_H, BLOCK_T], dtype=tl.float32)
        for s0 in range(0, S, BLOCK_S):
            jj, valid, off = _key_block(hh, tt, s0, H, T, S, BLOCK_S)
            probs = tl.load(probs_ptr + off, mask=valid, other=0.0)
            dot += tl.sum(probs * tl.load(gout_ptr + off, mask=valid, other=0.0).to(tl.float32), axis=2)
    key_blocks = tl.cdiv(S, BLOCK_S)
    for s0 in range(0, S, BLOCK_S):
        jj, valid, off = _key_block(hh, tt, s0, H, T, S, BLOCK_S)
        conv = _convolution(x_ptr, p_ptr, w_ptr, n_ptr, hh, tt, jj, H, T, S, snh, snt, sns, alpha, BLOCK_H, BLOCK_T,
                            BLOCK_S, K, R0, C0, CAUSAL, HAS_PREV, NEUTRAL_PER_HEAD)
        if HAS_BIAS:
            conv += tl.load(bias_ptr + hh, mask=hh < H, other=0.0).to(tl.float32)
        # the gradient of A_logit: through the softmax, or through the -inf fill
        grad = tl.zeros([BLOCK_H, BLOCK_T, BLOCK_S], dtype=tl.float32)
        if HAS_GOUT:
            g_out = tl.load(gout_ptr + off, mask=valid, other=0.0).to(tl.float32)
            if SOFTMAX:
                probs = tl.load(probs_ptr + off, mask=valid, other=0.0)
                grad = probs * (g_out - dot[:, :, None])
            else:
                masked = tl.load(m_ptr + hh * smh + tt * smt + jj * sms, mask=valid, other=1)
                grad = tl.where(masked != 0, 0.0, g_out)
        if HAS_GCARRY:
            grad += tl.load(gcarry_ptr + off, mask=valid, other=0.0).to(tl.float32)
        dconv = tl.where(conv > 0.0, beta * grad, 0.0)
        tl.store(dconv_ptr + off, dconv, mask=valid)
        tl.store(gin_ptr + off, (1.0 - beta) * grad, mask=valid)
        # this program's share of the weight and bias gradients, one row of H * H * K * K + H
        # for each block of keys: for each tap, dconv against the tap's view of A_input (zero for
        # the causal layout's masked taps), then the bias's
        row = shares_ptr + (program * key_blocks + s0 // BLOCK_S) * (H * H * K * K + H)
        if HAS_BIAS:
            tl.store(row + H * H * K * K + h1, tl.sum(tl.sum(dconv, axis=2), axis=1), mask=h1 < H)
        shares = row + h1 * (H * K * K)
        for a in tl.static_range(K):
            for c in tl.static_range(K):
                if CAUSAL and (c > a):
                    for g in range(H):
                        tl.store(shares + (g * K + a) * K + c, tl.zeros([BLOCK_H], dtype=tl.float32), mask=h1 < H)
                else:
                    rows, cols, inside, off, keep = _tap(n_ptr, tt, jj, T, S, snh, snt, sns, a, c, R0, C0,
                                                         NEUTRAL_PER_HEAD)
                    for g in range(H):
                        x = _tap_input(x_ptr, p_ptr, n_ptr, g, rows, cols, inside, off, keep, T, S, snh, snt, sns,
                                       alpha, HAS_PREV, NEUTRAL_PER_HEAD)
                        share = tl.sum(tl.sum(dconv * x, axis=2), axis=1)
                        tl.store(shares + (g * K + a) * K + c, share, mask=h1 < H)


@triton.jit(do_not_specialize=MAP_INTEGERS)
def _backward_input_kernel(w_ptr, n_ptr, dconv_ptr, gin_ptr, gx_ptr, gp_ptr,
                           H, T, S, snb, snh, snt, sns, alpha,
                           K: tl.constexpr, R0: tl.constexpr, C0: tl.constexpr, CAUSAL: tl.constexpr,
                           HAS_PREV: tl.constexpr,
                           BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr):
    b, tile = _program(T, BLOCK_T)
    base = b * H * T * S
    dconv_ptr += base
    gin_ptr += base
    gx_ptr += base
    if HAS_PREV:
        gp_ptr += base
    n_ptr += b * snb
    gg = tl.arange(0, BLOCK_H)[:, None, None]
    uu = (tile * BLOCK_T + tl.arange(0, BLOCK_T))[None, :, None]
    w_cols = w_ptr + gg * (K * K)
    heads = gg < H
    for s0 in range(0, S, BLOCK_S):  # the keys block by block
        vv, valid, off = _key_block(gg, uu, s0, H, T, S, BLOCK_S)
        acc = tl.load(gin_ptr + off, mask=valid, other=0.0)
        # input (u, v) of head g fed output (u - a + R0, v - c + C0) of head h through tap (a, c)
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


def blocks(heads: int, tile: Optional[Tuple[int, int]] = None):
    """(BLOCK_H, BLOCK_T, BLOCK_S, warps) of the kernels for maps of ``heads`` heads, whatever
    their lengths (one compiled variant for every length): keys in blocks of
    :data:`KEYS_BLOCK`, as many query rows as make a tile of about :data:`TILE_ELEMENTS`
    float32 values, ``ELEMENTS_PER_THREAD`` per thread; ``tile`` (rows, keys), powers of two,
    in place of those (tests: several programs and key blocks per map)."""
    block_h = triton.next_power_of_2(heads)
    block_t, block_s = tile or (max(1, TILE_ELEMENTS // (block_h * KEYS_BLOCK)), KEYS_BLOCK)
    return block_h, block_t, block_s, warps(block_h * block_t * block_s)


def _setup(logits: Tensor, masked: Optional[Tensor], neutral: Optional[Tensor], layout: str, k: int,
           tile: Optional[Tuple[int, int]], has_previous: bool):
    """What each kernel of a full pass is launched with: the grid (sentences x row tiles, one
    axis), both masks as ``(bytes, strides)``, the constexprs and warps of heads, tile, layout."""
    bsz, heads, tgt_len, _ = shape = logits.shape
    block_h, block_t, block_s, warps = blocks(heads, tile)
    rows, cols = _offsets(layout, k)
    constants = dict(K=k, R0=rows, C0=cols, CAUSAL=layout == "causal", HAS_PREV=has_previous,
                     BLOCK_H=block_h, BLOCK_T=block_t, BLOCK_S=block_s, num_warps=warps)
    return ((triton.cdiv(tgt_len, block_t) * bsz,), _mask_args(masked, shape, logits.device),
            _mask_args(neutral, shape, logits.device), constants)


def warps(elements: int) -> int:
    """Warps (4 to 16) of a program holding ``elements`` float32 values, ELEMENTS_PER_THREAD each."""
    return max(4, min(16, elements // (32 * ELEMENTS_PER_THREAD)))


def _mask_args(mask: Optional[Tensor], shape, device):
    """A bool mask broadcast to ``shape`` as (bytes, strides); without one, a zero byte read
    at every entry (strides 0): the kernels read a mask whether or not a call has one, so
    that a batch with padding and one without compile one variant."""
    if mask is None:
        return _zero_byte(device), (0, 0, 0, 0)
    mask = mask.expand(shape)
    return mask.view(torch.uint8), tuple(mask.stride())


@functools.lru_cache(maxsize=None)
def _zero_byte(device) -> Tensor:
    """One zero byte on ``device``, made once (no allocation per call)."""
    return torch.zeros((), dtype=torch.uint8, device=device)
