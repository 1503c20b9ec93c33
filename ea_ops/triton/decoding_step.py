"""One decoding step of EA Eq. (4) as one Triton kernel, launched by the operator of
:mod:`.operators` (the backend :func:`~.operators.step` of the operation
:func:`ea_ops.evolving_attention`), held to the reference's step
(:func:`ea_ops.reference.convolve_rows`) and to the full pass by ``tests/ops/test_triton_step.py``.

A step has one new query row per hypothesis (B, H, 1, S) in a shifted layout (decoder
self-attention, ``causal``: the masked kernel, Fig. 3b; encoder-decoder attention,
``rows``, Fig. 3c): its convolution reads the new row of ``A_input`` and the ``k - 1``
earlier ones, which the previous step left in the :class:`~ea_ops.contract.StepState`.
One program per hypothesis holds every head and every key of its row, so the whole of
Eq. (4) is one launch per attention and step:

* the earlier rows are read through the state's ``order`` (beam search's pending reorder:
  hypothesis n reads cached hypothesis ``order[n]``, an int32 or int64 tensor of any stride;
  nothing is gathered or copied first),
  zero beyond their ``S' <= S`` keys (decoder self-attention's rows are one key narrower
  per step) and before the first target position (no state yet);
* the new row of ``A_input`` (the α mix with the previous layer's finite ``A_logit``, zero
  where masked) is derived where the convolution's taps read it; the causal layout's
  upper-right taps are skipped (the weights are read as they are: no ``tril``, no kernel
  derived per run);
* bias, ReLU and the β mix give the new row of ``A_logit``, written with ``-inf`` where
  masked, or its softmax (float32; zero weights in a row whose every key is masked) where
  the values are given; with ``hand_on`` the finite ``A_logit`` beside it;
* the next state, ``(B, H, k - 1, S)``, a new tensor: the earlier rows 1.. in the new
  order, widened with zeros to ``S``, and the new row of ``A_input``.

What is left to PyTorch: the value product, one ``bmm`` (:func:`ea_ops.values.value_product`,
as after the full pass's kernel). In this kernel it would save that launch, but each
program would read its sentence's values itself: beam search's hypotheses share the
encoder's values, which the ``bmm`` reads once per sentence for all its beams (one matrix
product of ``beams`` rows) and a program per hypothesis would read once per beam, and the
``keys x head_dim`` tile of every head does not fit a program's registers beside the row
(it would loop over key blocks). Per attention and step that leaves two launches (the
kernel, the ``bmm``) and the outputs' allocations.

Everything is computed in float32, whatever the maps' dtype (float16, bfloat16, float32),
and rounded once to the dtype of the tensor written (the state and ``A_logit``: the
logits'; the weights: float32).
"""
import triton
import triton.language as tl

from . import MAX_ROW_ELEMENTS
from .evolving_attention import warps

# a step's row holds at least this many keys (padded): the keys of a decoding run's
# self-attention grow every step, and each power of two below would be another compile
MIN_KEYS = 32

# the integer arguments (lengths, strides, the state's sizes): not specialised by Triton, so
# that one compiled variant takes every step of a decoding run and every batch
STEP_INTEGERS = ("H", "S", "B_E", "S_E", "sxb", "sxh", "sxs", "spb", "sph", "sps", "seb", "seh", "ser", "ses",
                 "so", "smb", "sms")

@triton.jit
def _new_row(x_ptr, p_ptr, heads, cols, keep, sxh, sxs, sph, sps, alpha, HAS_PREV: tl.constexpr):
    """The new row of ``A_input`` at ``heads`` and key columns ``cols``, zero where not
    ``keep`` (outside the map, masked)."""
    x = tl.load(x_ptr + heads * sxh + cols * sxs, mask=keep, other=0.0).to(tl.float32)
    if HAS_PREV:
        p = tl.load(p_ptr + heads * sph + cols * sps, mask=keep, other=0.0).to(tl.float32)
        x = x + alpha * (p - x)
    return x


@triton.jit(do_not_specialize=STEP_INTEGERS)
def _step_kernel(x_ptr, p_ptr, e_ptr, order_ptr, m_ptr, w_ptr, bias_ptr, out_ptr, carry_ptr, rows_ptr,
                 H, S, B_E, S_E, sxb, sxh, sxs, spb, sph, sps, seb, seh, ser, ses, so, smb, sms, alpha, beta,
                 K: tl.constexpr, C0: tl.constexpr, CAUSAL: tl.constexpr, HAS_PREV: tl.constexpr,
                 HAS_EARLIER: tl.constexpr, HAS_ORDER: tl.constexpr,
                 HAS_BIAS: tl.constexpr, SOFTMAX: tl.constexpr, HAND_ON: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr):
    # the program's hypothesis: its pointers moved once (64-bit), offsets within it 32-bit
    n = tl.program_id(0).to(tl.int64)
    x_ptr += n * sxb
    if HAS_PREV:
        p_ptr += n * spb
    m_ptr += n * smb
    out_ptr += n * H * S
    if HAND_ON:
        carry_ptr += n * H * S
    rows_ptr += n * H * (K - 1) * S
    # the cached hypothesis this one continues: an order that indexes none reads nothing
    # and poisons the hypothesis's results with NaN (checking it on the host would wait
    # for the device)
    poison = 0.0
    if HAS_EARLIER:
        source = n
        if HAS_ORDER:
            source = tl.load(order_ptr + n * so).to(tl.int64)
            poison = tl.where((source >= 0) & (source < B_E), 0.0, float("nan"))
            source = tl.where((source >= 0) & (source < B_E), source, 0)
        e_ptr += source * seb
    h = tl.arange(0, BLOCK_H)[:, None]
    j = tl.arange(0, BLOCK_S)[None, :]
    heads = h < H
    # output column j reads columns j + c - C0 through tap column c: the new row (tap row
    # K - 1) and the earlier rows 0 .. K - 2; the causal layout keeps taps c <= a
    acc = tl.zeros([BLOCK_H, BLOCK_S], dtype=tl.float32)
    w_rows = w_ptr + h * (H * K * K)
    for c in tl.static_range(K):
        cols = j + (c - C0)
        keep = (cols >= 0) & (cols < S)
        keep = keep & (tl.load(m_ptr + cols * sms, mask=keep, other=1) == 0)
        cached = (cols >= 0) & (cols < S_E)
        for g in range(H):
            x = _new_row(x_ptr, p_ptr, g, cols, keep, sxh, sxs, sph, sps, alpha, HAS_PREV)
            w = tl.load(w_rows + (g * K + K - 1) * K + c, mask=heads, other=0.0)
            acc += w.to(tl.float32) * x
            if HAS_EARLIER:
                for a in tl.static_range(K - 1):
                    if (not CAUSAL) or (c <= a):
                        e = tl.load(e_ptr + g * seh + a * ser + cols * ses, mask=cached, other=0.0)
                        w = tl.load(w_rows + (g * K + a) * K + c, mask=heads, other=0.0)
                        acc += w.to(tl.float32) * e.to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + h, mask=heads, other=0.0).to(tl.float32)
    inside = j < S
    masked = tl.load(m_ptr + j * sms, mask=inside, other=1) != 0
    valid = heads & inside
    center = _new_row(x_ptr, p_ptr, h, j, valid & (masked == 0), sxh, sxs, sph, sps, alpha, HAS_PREV)
    a_logit = center + beta * (tl.maximum(acc, 0.0) - center) + poison
    off = h * S + j
    if HAND_ON:
        tl.store(carry_ptr + off, a_logit.to(carry_ptr.dtype.element_ty), mask=valid)
    scores = tl.where(masked, float("-inf"), a_logit)
    if SOFTMAX:
        top = tl.max(scores, axis=1)
        top = tl.where(top == float("-inf"), 0.0, top)  # every key masked: zero weights
        e = tl.exp(scores - top[:, None])
        total = tl.sum(e, axis=1)
        total = tl.where(total == 0.0, 1.0, total)
        tl.store(out_ptr + off, e / total[:, None], mask=valid)
    else:
        tl.store(out_ptr + off, scores.to(out_ptr.dtype.element_ty), mask=valid)
    # the next step's state: earlier rows 1 .. K - 2 (widened with zeros to S), the new row
    rows_out = rows_ptr + h * ((K - 1) * S) + j
    for a in tl.static_range(K - 2):
        kept = tl.zeros([BLOCK_H, BLOCK_S], dtype=tl.float32)
        if HAS_EARLIER:
            kept = tl.load(e_ptr + h * seh + (a + 1) * ser + j * ses, mask=heads & (j < S_E), other=0.0)
            kept = kept.to(tl.float32) + poison
        tl.store(rows_out + a * S, kept.to(rows_ptr.dtype.element_ty), mask=valid)
    tl.store(rows_out + (K - 2) * S, (center + poison).to(rows_ptr.dtype.element_ty), mask=valid)


def step_blocks(heads: int, keys: int):
    """(BLOCK_H, BLOCK_S, warps) of a step's row of ``heads`` x ``keys``: every key in one
    block, a power of two of at least :data:`MIN_KEYS`."""
    block_h, block_s = triton.next_power_of_2(heads), max(MIN_KEYS, triton.next_power_of_2(keys))
    if block_h * block_s > MAX_ROW_ELEMENTS:
        raise ValueError(f"EA's Triton step takes at most {MAX_ROW_ELEMENTS} (heads x keys, rounded up to "
                         f"powers of two) per row, got {heads} x {keys}: the dispatcher gives such calls "
                         "to the reference")
    return block_h, block_s, warps(block_h * block_s)
