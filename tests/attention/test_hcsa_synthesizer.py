"""RAN's baselines HC-SA (You et al. 2020) and Syn-R (Tay et al. 2020): their equations
recomputed in float64, the decoding cache's padding, options. (Causality, incremental
decoding, batch invariance: test_decoding_properties.py; parameter counts, at the Lite and
the papers' sizes: test_families.py.)"""
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from support.attention_calls import project_out, real_slots, recorded_attention_calls, values_of
from conftest import build_model, decoder_out, random_batch
from ea_fairseq.modules import HardCodedGaussianAttention, RandomSynthesizerAttention

SMALL = ("--encoder-layers", "2", "--decoder-layers", "2", "--dropout", "0.0", "--attention-dropout", "0.0",
         "--synthesizer-max-positions", "32")
# the papers' settings, written here from the papers (not read from the code)
ENCODER_CENTRES, DECODER_CENTRES, STD = (-1, +1), (-1, 0), 1.0  # You et al. 2020, RAN §Settings


def hcsa_weights(heads, positions, centres, causal, normalised=False):
    """You et al.: head h's weights at query position i are the density N(j; i + o_h, σ²)
    at the keys j it may see (their code, fallcat/stupidNMT: unnormalised); ``normalised``:
    divided by their sum over those keys (the first half of the heads takes the first
    centre)."""
    n = len(positions)
    w = torch.zeros(heads, n, n, dtype=torch.float64)
    for h in range(heads):
        o = centres[h * len(centres) // heads]
        for i in range(n):
            for j in range(n):
                if not causal or j <= i:
                    w[h, i, j] = math.exp(-((positions[j] - positions[i] - o) ** 2) / (2 * STD ** 2))
            w[h, i] /= w[h, i].sum() if normalised else math.sqrt(2 * math.pi) * STD
    return w


def synthesizer_weights(module, positions, causal):
    """Tay et al. §3.2: softmax(R_h) over the keys the query may see, R read at positions."""
    n = len(positions)
    r = module.logits.detach()[:, positions][:, :, positions]
    if causal:
        r = r.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return r.softmax(-1)


def largest_gap(model, calls, bsz, weights_of):
    gaps = []
    for name, stack, causal in (("encoder.self", model.encoder, False), ("decoder.self", model.decoder, True)):
        for layer, (query, _, padding, output) in zip(stack.layers, calls[name]):
            module = layer.self_attn
            for b in range(bsz):
                slots = real_slots(padding, b, query.size(0))
                w = weights_of(module, slots, causal)
                out = project_out(module, w @ values_of(module, query[slots, b]))
                gaps.append((out - output[slots, b]).abs().max().item())
    return max(gaps)


def weights_for(arch, mutated=False, normalize="none"):
    """The reference weights of ``arch`` for a sentence at ``slots`` of the batch; positions
    count from the sentence's first token. ``mutated``: HC-SA's densities normalised the
    other way (``normalize``: "none", the density itself, or "visible", over the visible
    keys), Syn-R's positions counted from the batch's first slot."""
    if arch == "hcsa_lite":
        return lambda module, slots, causal: hcsa_weights(
            module.num_heads, list(range(len(slots))), DECODER_CENTRES if causal else ENCODER_CENTRES,
            causal, normalised=(normalize == "visible") != mutated)
    return lambda module, slots, causal: synthesizer_weights(
        module, slots.tolist() if mutated else list(range(len(slots))), causal)


@pytest.mark.parametrize("arch,normalize", [("hcsa_lite", "none"), ("hcsa_lite", "visible"),
                                            ("syn_r_lite", None)])
def test_equation_in_float64_on_a_left_padded_batch(dictionary, arch, normalize):
    model, _ = build_model(arch, *SMALL, *(("--hcsa-normalize", normalize) if normalize else ()))
    model.double()
    src, lengths, prev = random_batch(dictionary, [5, 9, 3], 7)
    with recorded_attention_calls(model) as calls:
        decoder_out(model, src, lengths, prev)
    assert len(calls["encoder.self"]) == len(calls["decoder.self"]) == 2
    assert largest_gap(model, calls, 3, weights_for(arch, normalize=normalize)) <= 1e-12
    assert largest_gap(model, calls, 3, weights_for(arch, mutated=True, normalize=normalize)) > 1e-3


@pytest.mark.parametrize("normalize", ["none", "visible"])
def test_hcsa_weights_are_the_papers_gaussians(dictionary, normalize):
    """The weights themselves (need_head_weights): centred on i-1 / i+1 (encoder) and i-1 / i
    (decoder), σ = 1. "none": the density, 1/sqrt(2π) = 0.3989 at the centre, a decoder row
    summing to Σ_k≥0 N(k) = 0.6993 (centre i) and N(1) + Σ_k≥0 N(k) = 0.9413 (centre i-1) at
    every position past the first few; "visible": every row sums to 1."""
    model, _ = build_model("hcsa_lite", *SMALL, "--hcsa-normalize", normalize)
    model.double()
    x = torch.randn(7, 1, 160, dtype=torch.float64)
    for module, centres, causal in ((model.encoder.layers[0].self_attn, ENCODER_CENTRES, False),
                                    (model.decoder.layers[0].self_attn, DECODER_CENTRES, True)):
        mask = torch.full((7, 7), float("-inf"), dtype=torch.float64).triu(1) if causal else None
        _, weights = module(x, x, x, attn_mask=mask, need_head_weights=True)
        expected = hcsa_weights(4, list(range(7)), centres, causal, normalised=normalize == "visible")
        assert (weights[:, 0] - expected).abs().max() <= 1e-15
        assert weights[0, 0, 3].argmax() == 2 and weights[-1, 0, 3].argmax() == (4 if not causal else 3)
        sums = weights[:, 0, 4:].sum(-1)  # positions 4..6, every head
        if normalize == "visible":
            torch.testing.assert_close(sums, torch.ones_like(sums), rtol=0, atol=1e-12)
        elif causal:
            assert sums[0].sub(0.9413).abs().max() < 1e-3 and sums[-1].sub(0.6993).abs().max() < 1e-3
        if normalize == "none":  # the first heads' centre i-1: the density's peak
            assert weights[0, 0, 6, 5].item() == pytest.approx(1 / math.sqrt(2 * math.pi), rel=1e-12)
    biased = [m.v_proj.bias is not None and m.out_proj.bias is not None
              for m in (model.encoder.layers[0].self_attn, model.decoder.layers[0].self_attn)]
    assert biased == [normalize == "visible"] * 2  # the authors' projections have no biases


def test_a_decoding_runs_key_padding_is_kept_with_its_values():
    """fairseq hands a decoding step the padding of its own tokens only; the padding of the
    earlier steps is kept with their values, and reordered with them."""
    module = HardCodedGaussianAttention(8, 2, offsets=[-1, 0], causal=True)
    state = {}
    x = torch.randn(1, 2, 8)
    module(x, x, x, key_padding_mask=torch.tensor([[False], [True]]), incremental_state=state)
    _, weights = module(x, x, x, incremental_state=state, need_weights=True)
    assert weights[1, 0, 0] == 0.0 and weights[0, 0, 0] > 0.0  # the padded key is masked
    cached = module._get_input_buffer(state)
    assert cached["prev_key_padding_mask"].tolist() == [[False, False], [True, False]]
    module.reorder_incremental_state(state, torch.tensor([1, 0]))
    assert module._get_input_buffer(state)["prev_key_padding_mask"].tolist() == [[True, False], [False, False]]


def test_too_long_input_is_a_clear_error(dictionary):
    model, args = build_model("syn_r_lite", *SMALL[:-1], "8")
    assert args.max_source_positions == args.max_target_positions == 8  # fairseq filters/refuses
    src, lengths, prev = random_batch(dictionary, [10, 4], 3)
    with pytest.raises(ValueError, match="raise --synthesizer-max-positions"):
        decoder_out(model, src, lengths, prev)


@pytest.mark.parametrize("extra,message", [
    (("--hcsa-decoder-offsets", "1"), "cannot centre on a later token"),
    (("--hcsa-encoder-offsets", "-1", "0", "1"), "cannot be split evenly"),
    (("--hcsa-std", "0"), "must be positive"),
])
def test_bad_hcsa_options_are_clear_errors(extra, message):
    with pytest.raises(ValueError, match=message):
        build_model("hcsa_lite", *extra)


def test_options_and_composition(dictionary):
    model, _ = build_model("hcsa_lite", *SMALL, "--hcsa-std", "2", "--hcsa-encoder-offsets", "-2", "-1", "1", "2")
    assert model.encoder.layers[0].self_attn.offsets == (-2, -1, 1, 2)
    assert model.encoder.layers[0].self_attn.std == 2.0
    fixed, _ = build_model("syn_r_lite", *SMALL, "--synthesizer-fixed")
    assert all(not layer.self_attn.logits.requires_grad for layer in fixed.encoder.layers)
    # one role each, with other mechanisms and DropAttention, through the registry (decoding:
    # family syn-r-encoder+hcsa-decoder+dropattention)
    mixed, _ = build_model("ea_transformer_lite", *SMALL, "--encoder-attention", "synthesizer",
                           "--decoder-attention", "hcsa", "--drop-attention", "element",
                           "--drop-attention-p", "0.3")
    assert isinstance(mixed.encoder.layers[0].self_attn, RandomSynthesizerAttention)
    assert isinstance(mixed.decoder.layers[0].self_attn, HardCodedGaussianAttention)
    assert mixed.decoder.layers[0].self_attn.weight_dropout is not None
    mixed.train()
    src, lengths, prev = random_batch(dictionary, [5, 9], 6)
    out = mixed(src, lengths, prev)[0]
    F.cross_entropy(out.reshape(-1, out.size(-1)), prev.reshape(-1)).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in mixed.parameters() if p.requires_grad)
    with pytest.raises(SystemExit):
        build_model("ea_transformer_lite", "--cross-attention", "hcsa")


def test_checkpoint_from_before_hcsa_normalize_loads_as_trained(tmp_path, dictionary):
    """A checkpoint whose configuration predates --hcsa-normalize (the plugin's other
    defaults filled in, that one absent) was trained normalised over the visible keys, with
    projection biases: through fairseq's checkpoint loader it builds that way again and gives
    the same output; a new build without the option is the authors' unnormalised HC-SA."""
    from fairseq import checkpoint_utils

    old, args = build_model("hcsa_lite", *SMALL, "--hcsa-normalize", "visible", dictionary=dictionary)
    del args.hcsa_normalize
    path = str(tmp_path / "old.pt")
    torch.save({"args": args, "model": old.state_dict(), "optimizer_history": [{"criterion_name": "CrossEntropyCriterion",
                                                       "lr_scheduler_state": {"best": None}, "num_updates": 0}],
                "extra_state": {},
                "last_optimizer_state": None}, path)
    state = checkpoint_utils.load_checkpoint_to_cpu(path)
    loaded = type(old).build_model(state["cfg"].model, SimpleNamespace(source_dictionary=dictionary,
                                                                        target_dictionary=dictionary))
    loaded.load_state_dict(state["model"], strict=True)
    assert loaded.encoder.layers[0].self_attn.normalize == "visible"
    src, lengths, prev = random_batch(dictionary, [5, 9, 3], 7)
    torch.testing.assert_close(decoder_out(loaded.eval(), src, lengths, prev),
                               decoder_out(old.eval(), src, lengths, prev), rtol=0, atol=0)
    new, _ = build_model("hcsa_lite", *SMALL, dictionary=dictionary)
    assert new.encoder.layers[0].self_attn.normalize == "none"
