"""EA Eq. (4)'s Triton kernels for a full pass (:mod:`ea_ops.triton.evolving_attention`) against
the float64 reference (:func:`ea_ops.evolving_attention_reference`): values and gradients (logits,
the previous map, the convolution's weight and bias) in the three layouts of EA Fig. 3, odd
lengths, padded keys, left-padded targets, float32/float16/bfloat16, k = 3 and k = 1, α = 0 and
β = 0; arguments of any strides, a previous map that broadcasts, masks that are not bool refused;
the operation running them where the dispatcher says, and an EA-Lite model training through them.
Its bounds (:func:`bound`, :func:`close`) are also tests/ops/test_triton_step.py's.

On CUDA the kernels are compiled; on a CPU they run in Triton's interpreter
(``bash scripts/test_triton.sh`` sets ``TRITON_INTERPRET=1``). Without triton, or on a CPU
without the interpreter, the file is skipped (the default suite). Shapes are tiny: the
interpreter runs every program in Python. What the interpreter cannot show (that the kernels
compile for a GPU, and their registers) and what a training update launches on them:
tests/ops/test_triton_registers_and_launches.py.
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
from ea_ops.triton.operators import evolving_attention_triton  # noqa: E402

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
          softmax=False, hand_on=True, tile=None, per_head=False, masked_keys=True, seed=0):
    """Run the kernels forward and backward and hold values and gradients to the reference."""
    logits, prev, weight, b = inputs(heads, tgt_len, src_len, k, dtype, previous, bias, seed)
    masked, neutral = masks(layout, tgt_len, src_len, heads, per_head) if masked_keys else (None, None)
    out, carried = evolving_attention_triton(logits, prev, weight, b, masked, neutral, alpha, beta, layout,
                                             softmax, hand_on, tile)
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
    # two query rows and two keys a block: 7 rows in four programs, the last with one row, and
    # each program's 7 keys in four blocks, the last with one key (the softmax's running sums)
    check("causal", torch.float32, tgt_len=7, src_len=7, tile=(2, 2), per_head=True, softmax=True)


@pytest.mark.parametrize("softmax", [False, True])
def test_a_call_without_masks(softmax):
    """No mask and no neutral entries (a batch without padding): the kernels read a zero byte
    in their place, one compiled variant with the padded batches'."""
    check("rows", torch.float32, tgt_len=5, src_len=6, softmax=softmax, masked_keys=False)


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
        _, got = evolving_attention_triton(logits, prev, weight, b, masked, neutral, 0.3, beta, layout,
                                           False, True, None)
        with pytest.raises(AssertionError):
            close(got.detach(), want.detach(), relative, "values")


@pytest.mark.parametrize("attend", [False, True], ids=["A_logit", "weights"])
def test_the_operation_runs_the_kernels_where_the_dispatcher_says(attend):
    """``evolving_attention`` on CPU inside ``interpret_on_cpu()`` (the interpreter standing in
    for a GPU): the dispatcher names the Triton backend, and the operation's outputs (the
    weights and the value product, or A_logit; the map handed on) and gradients are the
    reference's within the bound, the map handed on written by the kernel itself."""
    from ea_ops import accelerators, dispatch, evolving_attention
    from ea_ops.triton import interpret_on_cpu

    heads, tgt_len, src_len, k = 3, 5, 6, 3
    masked, neutral = masks("rows", tgt_len, src_len, heads)
    values = torch.randn(BSZ * heads, src_len, 4, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    results = []
    for triton_on in (True, False):
        logits, prev, weight, b = inputs(heads, tgt_len, src_len, k, torch.float32, seed=3)
        params = EvolvingAttentionParams(0.3, 0.6, weight, b, "rows")
        with interpret_on_cpu() if triton_on else accelerators.reference_only():
            call = dispatch.describe(logits, masked, neutral, params, None, values if attend else None, True, False)
            assert (dispatch.choose(call) == dispatch.TRITON_FULL_PASS) == triton_on
            out = evolving_attention(logits, prev, masked, neutral, params, values=values if attend else None,
                                     empty=fully_masked_rows(masked) if attend else None, hand_on=True)
        shown = [out.context, out.probs, out.carried] if attend else [out.logits, out.carried]
        loss = sum((t.masked_fill(t.isneginf(), 0) * torch.linspace(-1, 1, t.numel(), device=t.device).view_as(t))
                   .sum() for t in shown)
        results.append((shown, torch.autograd.grad(loss, (logits, prev, weight, b))))
    (got, got_grads), (want, want_grads) = results
    relative = bound(torch.float32, BSZ * tgt_len * src_len + 2 * heads * k * k + src_len)
    for x, y in zip(got + list(got_grads), want + list(want_grads)):
        assert torch.equal(x.isneginf(), y.isneginf())
        close(x.detach(), y.detach().double(), relative, "the operation's outputs and gradients")


def test_an_ea_model_trains_through_the_kernels(monkeypatch):
    """One training pass of an EA-Lite model (two encoder and two decoder layers: maps handed
    on in every role; the encoder, causal and cross layouts; left-padded sources) with every
    EA attention on the kernels: its loss and every parameter's gradient are as close to the
    float64 model's as the float32 reference's are (4x, PyTorch's fudge factor for a backend
    against the math path in the same dtype; plus a few float32 ulps where both are exact)."""
    import copy

    from conftest import build_model, make_dictionary, random_batch
    from support.families import FAMILIES
    from ea_ops import accelerators, dispatch
    from ea_ops.triton import interpret_on_cpu

    dictionary = make_dictionary()
    model = build_model("ea_transformer_lite", "--ea-alpha", "0.5", "--ea-beta", "0.5", "--ea-decoder-alpha", "0.3",
                        "--encoder-layers", "2", "--decoder-layers", "2", "--dropout", "0",
                        "--attention-dropout", "0", dictionary=dictionary)[0]
    FAMILIES["ea-lite"].perturbed(model, "--encoder-layers", "2", "--decoder-layers", "2")
    model.train()
    src, lengths, prev = random_batch(dictionary, [5, 3], 4, seed=1)
    chosen = []
    choose = dispatch.choose
    monkeypatch.setattr(dispatch, "choose", lambda call: chosen.append(choose(call)) or chosen[-1])

    def train_pass(net, context):
        net.zero_grad()
        with context:
            out, _ = net(src.to(DEVICE), lengths.to(DEVICE), prev.to(DEVICE))
            loss = out.logsumexp(-1).sum()
            loss.backward()
        return [loss.detach()] + [p.grad for p in net.parameters()]

    model.to(DEVICE)
    wide = train_pass(copy.deepcopy(model).double(), accelerators.reference_only())
    reference = train_pass(model, accelerators.reference_only())
    chosen.clear()
    kernels = train_pass(model, interpret_on_cpu())
    assert chosen == [dispatch.TRITON_FULL_PASS] * 6, chosen  # 2 encoder, 2 decoder self, 2 cross
    ulps = 16 * torch.finfo(torch.float32).eps
    for got, ref, want in zip(kernels, reference, wide):
        scale = want.abs().max().item()
        assert (got - want).abs().max().item() <= 4 * (ref - want).abs().max().item() + ulps * scale


def test_arguments_of_any_strides():
    """Views as the operation's arguments (logits and previous map transposed or broadcast,
    a weight transposed, a bias that is every other entry of a tensor): the kernels' results
    and gradients are those of contiguous copies. Negative control: the strided bias read as
    if contiguous takes other entries (the comparison with copies fails)."""
    g = torch.Generator().manual_seed(5)
    heads, tgt_len, src_len = 3, 4, 5

    def drawn(*shape):
        return torch.randn(*shape, generator=g).to(DEVICE)

    views = [lambda: drawn(BSZ, src_len, heads, tgt_len).permute(0, 2, 3, 1),
             lambda: drawn(1, heads, tgt_len, src_len).expand(BSZ, -1, -1, -1),
             lambda: drawn(heads, heads, 3, 3).transpose(0, 1), lambda: drawn(2 * heads)[::2]]
    masked, neutral = masks("causal", tgt_len, src_len, heads)
    results = []
    for contiguous in (False, True):
        g.manual_seed(5)
        leaves = [view().contiguous() if contiguous else view() for view in views]
        assert contiguous or not any(v.is_contiguous() for v in leaves)
        leaves = [v.requires_grad_() for v in leaves]
        out, carried = evolving_attention_triton(*leaves, masked, neutral, 0.4, 0.7, "causal", True, True, None)
        grads = torch.autograd.grad((out * torch.arange(out.numel(), device=DEVICE).view_as(out)).sum()
                                    + carried.sum(), leaves)
        results.append([out, carried, *grads])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_previous_map_that_broadcasts_is_read_and_differentiated_as_the_reference_does():
    """A previous map (1, H, T, S) broadcast over the batch, as the reference's α mix
    broadcasts it: the values and its gradient (summed over the batch) are the float64
    reference's; no sentence reads or writes beyond it."""
    from ea_ops import accelerators, evolving_attention
    from ea_ops.triton import interpret_on_cpu

    heads, tgt_len, src_len, k = 3, 4, 5, 3
    logits, previous, weight, bias = inputs(heads, tgt_len, src_len, k, torch.float32, seed=3)
    masked, neutral = masks("causal", tgt_len, src_len, heads)
    results = []
    for dtype, context in ((torch.float32, interpret_on_cpu), (torch.float64, accelerators.reference_only)):
        first = previous[:1].detach().to(dtype).requires_grad_()
        params = EvolvingAttentionParams(0.3, 0.6, weight.detach().to(dtype), bias.detach().to(dtype), "causal")
        with context():
            carried = evolving_attention(logits.detach().to(dtype), first, masked, neutral, params,
                                         hand_on=True).carried
        results.append((carried.detach(), torch.autograd.grad(carried, first, torch.ones_like(carried))[0]))
    (got, got_grad), (want, want_grad) = results
    relative = bound(torch.float32, BSZ * tgt_len * src_len + 2 * heads * k * k)
    close(got, want, relative, "A_logit of a broadcast previous map")
    close(got_grad, want_grad, relative, "the broadcast previous map's gradient")


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32])
def test_a_mask_that_is_not_bool_is_refused_with_a_message(dtype):
    """As the reference and the CPU backends: a mask is a bool tensor (a float mask's bytes
    are no mask)."""
    from ea_ops import evolving_attention
    from ea_ops.triton import interpret_on_cpu

    logits, previous, weight, bias = inputs(3, 4, 5, 3, torch.float32, seed=3)
    masked, _ = masks("causal", 4, 5, 3)
    params = EvolvingAttentionParams(0.3, 0.6, weight, bias, "causal")
    with interpret_on_cpu(), pytest.raises(ValueError, match="bool"):
        evolving_attention(logits, previous, masked.to(dtype), None, params)
