"""EA-Transformer: exact reduction to fairseq's transformer, the causality check's negative
control, masked entries, the decoding step's convolution and kinds. (Causality, incremental ==
full pass and batch invariance of every EA family, with the accelerator and with the
reference alone: test_decoding_properties.py.)"""
import contextlib

import pytest
import torch
import torch.nn.functional as F
from fairseq.models.transformer import TransformerModel
from fairseq.modules import MultiheadAttention

from conftest import beam_reorder_gap, build_model, decoder_out, incremental_logprobs, random_batch
from ea_fairseq.models.stack import StackLayer
from ea_fairseq.modules import AttentionMapConv, EvolvingAttention
from ea_fairseq.modules.attention_maps import LogitMapAttention
from ea_ops.reference import evolving_attention_reference
from ea_ops import dispatch
from ea_ops.contract import EvolvingAttentionParams, StepState
from ea_ops import accelerators
from support.families import FAMILIES

SMALL = ("--encoder-layers", "3", "--decoder-layers", "3", "--dropout", "0.0")
ALL_OFF = ("--ea-alpha", "0", "--ea-beta", "0", "--ea-decoder-alpha", "0",
           "--ea-no-encoder-conv", "--ea-no-decoder-conv", "--ea-no-cross-conv")
# EA everywhere, with weights large enough that every part visibly moves the output
STRONG = ("--ea-alpha", "0.5", "--ea-beta", "0.5", "--ea-decoder-alpha", "0.3")


def perturbed(model, family: str) -> None:
    """``model`` (built with SMALL) moved off its initial values as its family's tests move it
    (:meth:`families.Family.perturb`): the map convolutions large enough that a leak through
    any tap shows."""
    FAMILIES[family].perturbed(model, *SMALL)


@pytest.fixture
def accelerated_step(monkeypatch):
    """Decode with the CPU backend's step, checked to run; yields the list of its steps
    (whether each returned the weights)."""
    if not dispatch.accelerated_dtype("cpu", torch.float32):
        pytest.skip("no CPU accelerator here (switched off, or not built): the reference runs")
    calls = []

    def counted(run):
        def step(*args, **kwargs):
            out = run(*args, **kwargs)
            calls.append(out.probs is not None)  # no A_logit handed on: it computed the weights
            return out
        return step

    for name in (dispatch.CPU_STEP, dispatch.CPU_STEP_ATTEND):
        row = dispatch.TABLE[name]
        monkeypatch.setitem(dispatch.TABLE, name, row._replace(run=counted(row.run)))
    yield calls
    assert calls, "decoding never reached the accelerator's step"


def ea_modules(model):
    return [m for m in model.modules() if isinstance(m, EvolvingAttention)]


@pytest.mark.parametrize("extra", [ALL_OFF, ("--ea-alpha", "0", "--ea-beta", "0")],
                         ids=["convs-off", "convs-on-beta0"])
def test_switched_off_equals_fairseq_transformer(dictionary, extra):
    """Same weights, same output as fairseq's own TransformerModel (its fused attention).

    Compared in float64: in float32 fairseq's fused path and its own unfused path already
    differ by ~2e-6 on these logits (see the bitwise test below for float32).
    """
    ea, _ = build_model("ea_transformer_lite", *SMALL, *extra, "--share-all-embeddings")
    assert len(ea_modules(ea)) == 9, "EA attention must be in the path for this test"
    vanilla, _ = build_model("transformer_lite", *SMALL, "--share-all-embeddings")
    assert type(vanilla) is TransformerModel
    missing, unexpected = ea.load_state_dict(vanilla.state_dict(), strict=False)
    assert not unexpected
    assert all(".conv." in k for k in missing) and bool(missing) == ("--ea-no-encoder-conv" not in extra)
    ea.double(), vanilla.double()
    src, lengths, prev = random_batch(dictionary, [7, 4, 9], 6)
    diff = (decoder_out(ea, src, lengths, prev) - decoder_out(vanilla, src, lengths, prev)).abs().max()
    assert diff <= 1e-6, diff


def test_switched_off_equals_fairseq_attention_in_float32(dictionary):
    """float32: as close to fairseq's unfused attention as fairseq's fused path is (the
    plugin joins the projections that read the same input into one matmul, a different
    summation order than three), and bitwise equal where the projections stay separate."""
    ea, _ = build_model("ea_transformer_lite", *SMALL, *ALL_OFF)
    vanilla, _ = build_model("transformer_lite", *SMALL)
    ea.load_state_dict(vanilla.state_dict())
    src, lengths, prev = random_batch(dictionary, [7, 4, 9], 6)
    fused = decoder_out(vanilla, src, lengths, prev)
    for m in vanilla.modules():
        if isinstance(m, MultiheadAttention):
            m.skip_embed_dim_check = True  # fairseq's unfused path: explicit QK^T and softmax
    unfused = decoder_out(vanilla, src, lengths, prev)
    fairseqs_own_gap = (fused - unfused).abs().max()
    assert 0 < fairseqs_own_gap < 1e-5
    assert (decoder_out(ea, src, lengths, prev) - unfused).abs().max() <= 2 * fairseqs_own_gap
    # a hook on a projection keeps it separate: fairseq's numbers exactly
    hooks = [getattr(m, n).register_forward_hook(lambda *a: None)
             for m in ea_modules(ea) for n in ("q_proj", "k_proj", "v_proj")]
    try:
        assert torch.equal(decoder_out(ea, src, lengths, prev), unfused)
    finally:
        for h in hooks:
            h.remove()


def test_ea_changes_the_output(dictionary):
    """Guard for the test above: with EA on, the same weights give a different output."""
    ea, _ = build_model("ea_transformer_lite", *SMALL, *STRONG)
    vanilla, _ = build_model("transformer_lite", *SMALL)
    ea.load_state_dict(vanilla.state_dict(), strict=False)
    src, lengths, prev = random_batch(dictionary, [7, 4, 9], 6)
    assert (decoder_out(ea, src, lengths, prev) - decoder_out(vanilla, src, lengths, prev)).abs().max() > 1e-3


@pytest.mark.parametrize("which", ["decoder", "cross"])
def test_causality_check_catches_a_leaking_conv(dictionary, which):
    """Negative control: a row-centred (encoder-style) conv in the decoder reads the next
    target row, and the causality check (test_decoding_properties.py) sees it."""
    off = "--ea-no-cross-conv" if which == "decoder" else "--ea-no-decoder-conv"
    model, _ = build_model("ea_transformer_lite", *SMALL, *STRONG, off)
    perturbed(model, "ea-lite")
    for m in model.decoder.modules():
        if isinstance(m, AttentionMapConv):
            m.layout = "full"
    src, lengths, prev = random_batch(dictionary, [6, 8], 10)
    base = decoder_out(model, src, lengths, prev)
    changed = prev.clone()
    changed[:, 5:] = (changed[:, 5:] + 1 - 4) % (len(dictionary) - 4) + 4
    out = decoder_out(model, src, lengths, changed)
    assert (out[:, :5] - base[:, :5]).abs().max() > 1e-4


@pytest.mark.parametrize("decoder_alpha", ["0.3", "0"], ids=["hand-on", "weights"])
def test_decoding_takes_the_accelerated_step_of_its_kind(dictionary, accelerated_step, decoder_alpha):
    """Decoder α > 0: each layer but the last hands its A_logit on, and the accelerated step
    returns it; the last layer (nobody reads its map) and α = 0 (the papers' decoder: no
    layer reads it): the step returns the attention weights, softmax included. Either way,
    across beam reorders, the full pass's values."""
    model, _ = build_model("ea_transformer_lite", *SMALL, *STRONG, "--ea-decoder-alpha", decoder_alpha)
    perturbed(model, "ea-lite" if decoder_alpha != "0" else "ea-lite-paper-decoder")
    assert beam_reorder_gap(model, dictionary, [[1, 1, 3, 2], [1, 0, 2, 2]]) <= 1e-5
    if decoder_alpha == "0":
        assert set(accelerated_step) == {True}
    else:  # 3 layers: the weights in the last layer's self- and cross-attention, A_logit in the others'
        assert 3 * accelerated_step.count(True) == len(accelerated_step)


def test_maps_are_handed_on_only_to_later_layers_and_die_with_the_pass(dictionary):
    """The first layer reads no previous map, the last hands none on, and nothing of a
    pass outlives it (nor enters the state dict)."""
    model, _ = build_model("ea_transformer_lite", *SMALL, *STRONG)
    src, lengths, prev = random_batch(dictionary, [5, 7], 4)
    decoder_out(model, src, lengths, prev)
    for stack in (model.encoder, model.decoder):
        layers = list(stack.layers)
        assert "self" not in layers[0].reads and not layers[-1].hands and layers[0].hands
        assert stack.stack_pass is None and all(layer.stack_pass is None for layer in layers)
    assert "cross" in model.decoder.layers[1].reads and "cross" not in model.decoder.layers[0].reads
    assert not any("stack_pass" in k for k in model.state_dict())


@pytest.mark.parametrize("path", ["accelerated", "reference"])
def test_masked_entries_never_reach_the_conv_as_inf(dictionary, monkeypatch, path):
    """Padding and future positions enter the convolutions as zeros (no -inf / NaN), and
    the maps handed on to the next layer are finite."""
    model, _ = build_model("ea_transformer_lite", *SMALL, *STRONG)
    seen, handed_on = [], []
    conv2d = F.conv2d  # every map convolution, the reference's and the accelerator's
    monkeypatch.setattr(F, "conv2d", lambda maps, *a, **k: seen.append(maps) or conv2d(maps, *a, **k))
    body = StackLayer.body

    def spied(layer, *args, **kwargs):  # what each layer's call hands on
        out = body(layer, *args, **kwargs)
        handed_on.extend(v for v in out[len(out) - len(layer.hands):] if v is not None)
        return out

    monkeypatch.setattr(StackLayer, "body", spied)
    src, lengths, prev = random_batch(dictionary, [3, 9], 6)
    with accelerators.reference_only() if path == "reference" else contextlib.nullcontext():
        out = decoder_out(model, src, lengths, prev)
    assert len(seen) == 9 and len(handed_on) == 6  # the last layer of each of the 3 chains hands on nothing
    assert all(torch.isfinite(x).all() for x in seen + handed_on)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("layout", ["causal", "rows"])  # the decoder's layouts
def test_one_step_convolution_equals_the_full_map_row(layout):
    """A decoding step convolves only its cached rows; it gives the full pass's row, also
    when a new decoding run starts after the weights changed in place, through
    autograd-invisible ``.data`` writes too (a step's kernel is made once per run)."""
    torch.manual_seed(0)
    conv = AttentionMapConv(4, 3, layout)
    maps = torch.randn(3, 4, 6, 7)

    def decoded():
        params = EvolvingAttentionParams(0.0, 1.0, conv.weight, conv.bias, layout)
        state, rows = StepState(), []
        for t in range(6):
            step = maps[:, :, t : t + 1].clone()
            out = evolving_attention_reference(step, None, None, None, params, state=state)
            state = out.state
            rows.append(out.a_logit)
        return torch.cat(rows, dim=2)

    with torch.no_grad():
        full = conv(maps)
        assert (decoded() - F.relu(full)).abs().max() <= 1e-5
        for change in (lambda w: w.mul_(-2.0), lambda w: w.data.add_(0.5)):
            change(conv.weight)
            assert (conv(maps) - full).abs().max() > 1e-3
            full = conv(maps)
            assert (decoded() - F.relu(full)).abs().max() <= 1e-5


@pytest.mark.parametrize("beam_shared_keys", [False, True], ids=["keys-per-hypothesis", "beam-shared-keys"])
def test_decoding_steps_equal_fairseqs_own_step_path(dictionary, beam_shared_keys, monkeypatch):
    """A decoding step's logits come from the attention's joined, scale-folded projections
    (made once per run) into the run's cache; with a hook on the projections each projection
    runs its own module (fairseq's numbers). Both decode alike, beam reorders included."""
    model, _ = build_model("ea_transformer_lite", *SMALL, *STRONG)
    perturbed(model, "ea-lite")
    src, lengths, _ = random_batch(dictionary, [5, 9, 5, 9], 8)
    _, _, prev = random_batch(dictionary, [5, 9, 5, 9], 6, seed=7)
    order = torch.tensor([1, 0, 3, 2])
    if beam_shared_keys:
        src, lengths = src[[0, 0, 2, 2]], lengths[[0, 0, 2, 2]]
        model.decoder.set_beam_size(2)
    taken = []
    step_projection = LogitMapAttention.step_projection
    monkeypatch.setattr(LogitMapAttention, "step_projection",
                        lambda self, *a: taken.append(step_projection(self, *a)) or taken[-1])
    joined, _ = incremental_logprobs(model, src, lengths, prev, 3, order)
    assert taken and all(t is not None for t in taken)
    taken.clear()
    hooks = [m.q_proj.register_forward_hook(lambda *a: None) for m in ea_modules(model)]
    try:
        own, _ = incremental_logprobs(model, src, lengths, prev, 3, order)
    finally:
        for h in hooks:
            h.remove()
        model.decoder.set_beam_size(1)
    assert taken and all(t is None for t in taken)  # a hooked q_proj joins nothing
    assert (joined - own).abs().max() <= 1e-5
    assert not torch.equal(joined[:, 0], joined[:, 1])  # the steps differ: a real comparison
