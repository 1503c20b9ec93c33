"""EA Eq. (4)'s Triton kernels (:mod:`ea_ops.triton.evolving_attention`) against the float64
reference (:func:`ea_ops.evolving_attention_reference`): values and gradients (logits, the
previous map, the convolution's weight and bias) in the three layouts of EA Fig. 3, odd lengths,
padded keys, left-padded targets, float32/float16/bfloat16, k = 3 and k = 1, α = 0 and β = 0.

On CUDA the kernels are compiled; on a CPU they run in Triton's interpreter
(``bash scripts/test_triton.sh`` sets ``TRITON_INTERPRET=1``). Without triton, or on a CPU
without the interpreter, the file is skipped (the default suite). Shapes are tiny: the
interpreter runs every program in Python.
"""
import os

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA: the kernels run in Triton's interpreter, bash scripts/test_triton.sh",
                allow_module_level=True)

from ea_ops import EvolvingAttentionParams, evolving_attention_reference  # noqa: E402
from ea_ops.masks import fill_masked  # noqa: E402
from ea_ops.softmax import fully_masked_rows, masked_softmax  # noqa: E402
from ea_ops.triton.evolving_attention import EvolvingAttentionTriton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
BSZ = 2


def masks(layout, tgt_len, src_len, heads, per_head=False):
    """``(masked, neutral)`` of a batch of two: sentence 1 has two padded keys (fairseq's
    left-padded sources), and in the decoder its target is left-padded by two positions
    (padded query rows neutral; in the causal layout its first two rows see only padded
    keys: rows with every key masked)."""
    pad = torch.zeros(BSZ, src_len, dtype=torch.bool)
    pad[1, :2] = True
    masked = pad[:, None, None, :]
    if layout == "causal":
        masked = masked | torch.ones(tgt_len, src_len, dtype=torch.bool).triu(1)[None, None]
    if per_head:  # a different mask for each head: head h also masks key h
        masked = masked.expand(BSZ, heads, tgt_len, src_len).clone()
        for h in range(heads):
            masked[:, h, :, h] = True
    rows = torch.zeros(BSZ, tgt_len, dtype=torch.bool)
    rows[1, :2] = True
    neutral = masked | rows[:, None, :, None]
    return masked.to(DEVICE), neutral.to(DEVICE)


def inputs(heads, tgt_len, src_len, k, dtype, previous=True, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)

    def draw(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(DEVICE, dtype).requires_grad_()

    return (draw(BSZ, heads, tgt_len, src_len), draw(BSZ, heads, tgt_len, src_len) if previous else None,
            draw(heads, heads, k, k, scale=0.5), draw(heads, scale=0.5) if bias else None)


def reference(logits, previous, weight, bias, masked, neutral, alpha, beta, layout, softmax):
    """The operation's output and the finite A_logit in float64: the reference, then the
    ``-inf`` fill and the softmax the operation finishes it with."""
    wide = [None if t is None else t.detach().double().requires_grad_() for t in (logits, previous, weight, bias)]
    params = EvolvingAttentionParams(alpha, beta, wide[2], wide[3], layout)
    a_logit = evolving_attention_reference(wide[0].clone(), wide[1], masked, neutral, params).a_logit
    out = fill_masked(a_logit, masked, float("-inf"))
    if softmax:
        out = masked_softmax(out, fully_masked_rows(masked))
    return wide, out, a_logit


def bound(dtype, terms):
    """How far a result of the kernels may lie from the float64 reference, relative to the
    largest reference value of that tensor. Every result is a float32 sum of at most ``terms``
    products (the weight gradient's sum over the batch, rows and keys is the longest), within
    terms * u32 of the exact sum relative to the sum of the terms' magnitudes (Higham's
    gamma_n), then rounded once to its dtype (u_dtype relative); 4x for the products' and
    the α/β mixes' own roundings and for the terms' magnitudes exceeding the largest result.
    The inputs are the same numbers in both (the float64 reference reads the rounded ones)."""
    unit = torch.finfo(dtype).eps / 2
    return 4 * (unit + terms * torch.finfo(torch.float32).eps / 2)


def check(layout, dtype, *, heads=3, tgt_len=7, src_len=7, k=3, alpha=0.3, beta=0.6, previous=True, bias=True,
          softmax=False, hand_on=True, block_t=None, per_head=False, seed=0):
    """Run the kernels forward and backward and hold values and gradients to the reference."""
    logits, prev, weight, b = inputs(heads, tgt_len, src_len, k, dtype, previous, bias, seed)
    masked, neutral = masks(layout, tgt_len, src_len, heads, per_head)
    out, carried = EvolvingAttentionTriton.apply(logits, prev, weight, b, masked, neutral, alpha, beta, layout,
                                                 softmax, hand_on, block_t)
    wide, ref_out, ref_a_logit = reference(logits, prev, weight, b, masked, neutral, alpha, beta, layout, softmax)
    terms = BSZ * tgt_len * src_len + 2 * heads * k * k + src_len
    g = torch.Generator().manual_seed(seed + 1)
    grad_out = torch.randn(out.shape, generator=g).to(DEVICE, out.dtype)  # masked entries too
    outputs, ref_outputs, grads = [out], [ref_out], [grad_out]
    if hand_on:
        outputs.append(carried)
        ref_outputs.append(ref_a_logit)
        grads.append(torch.randn(carried.shape, generator=g).to(DEVICE, carried.dtype))
    else:
        assert carried is None
    assert out.dtype == (torch.float32 if softmax else dtype)
    assert torch.equal(out.isneginf(), ref_out.isneginf()), "-inf where masked, nowhere else"
    for got, want in zip(outputs, ref_outputs):
        close(got, want, bound(got.dtype, terms), "values")
    leaves = [t for t in (logits, prev, weight, b) if t is not None]
    wide_leaves = [t for t in wide if t is not None]
    got_grads = torch.autograd.grad(outputs, leaves, grads)
    want_grads = torch.autograd.grad(ref_outputs, wide_leaves, [t.double() for t in grads])
    for name, got, want in zip(("logits", "previous", "weight", "bias"), got_grads, want_grads):
        assert got.dtype == dtype
        close(got, want, bound(dtype, terms), f"gradient of {name}")
    return got_grads, want_grads


def close(got, want, relative, what):
    got, want = got.double().cpu(), want.cpu()
    finite = want.isfinite()
    scale = want[finite].abs().max().item() if finite.any() else 0.0
    error = (got[finite] - want[finite]).abs().max().item() if finite.any() else 0.0
    assert error <= relative * max(scale, 1e-30), f"{what}: error {error:.3g} > {relative:.3g} x {scale:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout,tgt_len,src_len", [("full", 7, 7), ("causal", 7, 7), ("rows", 5, 9)])
def test_values_and_gradients_equal_the_float64_reference(layout, tgt_len, src_len, dtype):
    # float32: A_logit (-inf where masked) and the finite map handed on, as in training;
    # float16/bfloat16: the weights (the softmax fused), with and without the map handed on
    softmax = dtype != torch.float32
    hand_on = dtype != torch.bfloat16
    check(layout, dtype, tgt_len=tgt_len, src_len=src_len, softmax=softmax, hand_on=hand_on)


def test_several_programs_per_map_with_a_mask_per_head():
    # two query rows per program: 7 rows in four programs, the last with one row
    check("causal", torch.float32, block_t=2, per_head=True, softmax=True)


@pytest.mark.parametrize("layout", ["full", "causal", "rows"])
def test_kernel_size_one(layout):
    check(layout, torch.float32, k=1, tgt_len=5, src_len=6, hand_on=False)


def test_alpha_zero_gives_the_previous_map_no_gradient():
    got, _ = check("full", torch.float32, alpha=0.0, softmax=True, tgt_len=5, src_len=5)
    assert got[1].abs().max() == 0


def test_beta_zero_gives_the_convolution_no_gradient():
    got, _ = check("rows", torch.float32, beta=0.0, tgt_len=3, src_len=5)
    assert got[2].abs().max() == 0 and got[3].abs().max() == 0


def test_first_layer_without_bias():
    check("causal", torch.float16, previous=False, bias=False, tgt_len=5, src_len=5, softmax=True)


def test_the_comparison_bites():
    # negative controls: the kernels in another layout, and with another β, are not within
    # the bound of the reference
    heads, tgt_len, src_len, k = 3, 5, 5, 3
    logits, prev, weight, b = inputs(heads, tgt_len, src_len, k, torch.float32)
    masked, neutral = masks("full", tgt_len, src_len, heads)
    _, _, want = reference(logits, prev, weight, b, masked, neutral, 0.3, 0.6, "full", False)
    relative = bound(torch.float32, BSZ * tgt_len * src_len + 2 * heads * k * k + src_len)
    for layout, beta in (("rows", 0.6), ("full", 0.61)):
        _, got = EvolvingAttentionTriton.apply(logits, prev, weight, b, masked, neutral, 0.3, beta, layout,
                                               False, True, None)
        with pytest.raises(AssertionError):
            close(got.detach(), want.detach(), relative, "values")
