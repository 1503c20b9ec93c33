"""DropAttention: drop rate, windows, rescaling, determinism, and use in every variant."""
import pytest
import torch

from conftest import build_model, decoder_out, random_batch
from ea_fairseq.modules import AttentionMechanism, DropAttention
from support.families import FAMILIES


def softmax_weights(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(shape, generator=g), dim=-1)


@pytest.mark.parametrize("mode", ["column", "element"])
@pytest.mark.parametrize("p,w", [(0.1, 1), (0.2, 2), (0.3, 3)])
def test_measured_drop_rate(mode, p, w):
    torch.manual_seed(0)
    drop = DropAttention(mode, p, w)
    mask = drop.drop_mask((16, 4, 32, 200), "cpu").expand(16, 4, 32, 200)
    expected = 1 - (1 - p / w) ** w  # every position is covered by w possible window starts
    interior = mask[..., w:].float().mean().item()  # the first w-1 keys have fewer starts
    n = mask[..., w:].numel() / (32 if mode == "column" else 1)
    assert abs(interior - expected) < 5 * (expected * (1 - expected) / n) ** 0.5 + 1e-3
    assert abs(expected - p) < p * p  # "about p"


@pytest.mark.parametrize("mode", ["column", "element"])
def test_windows_are_contiguous(mode):
    torch.manual_seed(1)
    w = 3
    mask = DropAttention(mode, 0.15, w).drop_mask((4, 2, 5, 300), "cpu")
    for row in mask.reshape(-1, 300).tolist():
        run = 0
        for j, dropped in enumerate(row + [False]):
            if dropped:
                run += 1
            else:
                if run:  # a maximal run of dropped keys is one or more whole windows,
                    assert run >= w or j == len(row), (run, j)  # or clipped at the end
                run = 0


def test_column_mode_drops_the_same_keys_in_every_row():
    torch.manual_seed(2)
    mask = DropAttention("column", 0.3, 2).drop_mask((3, 2, 7, 20), "cpu")
    assert mask.shape == (3, 2, 1, 20)  # one draw per sentence and head, shared by all rows


@pytest.mark.parametrize("mode", ["column", "element"])
def test_normalized_rescaling_rows_sum_to_one(mode):
    torch.manual_seed(3)
    probs = softmax_weights((8, 4, 10, 12))
    out = DropAttention(mode, 0.4, 2).train()(probs)
    assert torch.allclose(out.sum(-1), torch.ones(8, 4, 10), atol=1e-6)
    assert (out == 0).any()


def test_dropout_rescaling_divides_by_keep_probability():
    torch.manual_seed(4)
    probs = softmax_weights((2, 2, 5, 9))
    out = DropAttention("element", 0.25, 1, rescale="dropout").train()(probs)
    kept = out != 0
    assert torch.allclose(out[kept], probs[kept] / 0.75)


def test_rows_with_everything_dropped_keep_their_weights():
    torch.manual_seed(5)
    probs = softmax_weights((64, 2, 3, 1))  # one key per row: dropping it empties the row
    out = DropAttention("element", 0.9, 1).train()(probs)
    assert torch.isfinite(out).all()
    assert torch.equal(out, probs)


def test_identity_in_eval_mode_and_same_mask_for_same_seed():
    probs = softmax_weights((2, 2, 6, 6))
    drop = DropAttention("element", 0.5, 2)
    assert drop.eval()(probs) is probs
    drop.train()
    torch.manual_seed(7)
    a = drop(probs)
    torch.manual_seed(7)
    assert torch.equal(a, drop(probs))
    assert not torch.equal(a, drop(probs))


DROP = ("--drop-attention", "element", "--drop-attention-p", "0.2", "--drop-attention-window", "2")


@pytest.mark.parametrize("family,extra", [
    ("ea-lite", ()),
    ("ea-lite", ("--encoder-attention", "vanilla", "--decoder-attention", "vanilla", "--cross-attention", "vanilla")),
    ("pa-lite", ()),
    ("ran-all-lite", ()),
], ids=["ea", "vanilla", "pa", "ran"])
def test_every_variant_takes_drop_attention_only_in_training(dictionary, family, extra):
    arch, *options = FAMILIES[family].args()
    extra = (*options, *extra)
    model, _ = build_model(arch, "--encoder-layers", "2", "--decoder-layers", "2", "--dropout", "0",
                           *extra, *DROP)
    attns = [m for m in model.modules() if isinstance(m, AttentionMechanism)]
    assert len(attns) == 6 and all(isinstance(m.weight_dropout, DropAttention) for m in attns)
    plain, _ = build_model(arch, "--encoder-layers", "2", "--decoder-layers", "2", "--dropout", "0",
                           "--attention-dropout", "0", *extra)
    plain.load_state_dict(model.state_dict())
    src, lengths, prev = random_batch(dictionary, [6, 4], 5)
    # eval: untouched (vanilla attentions of ``plain`` run fairseq's fused kernel: float32 rounding)
    assert (decoder_out(model, src, lengths, prev) - decoder_out(plain, src, lengths, prev)).abs().max() <= 1e-5
    model.train()
    torch.manual_seed(0)
    trained = model(src, lengths, prev)[0]
    assert torch.isfinite(trained).all()
    assert (trained - decoder_out(plain, src, lengths, prev)).abs().max() > 1e-4


def test_drop_attention_on_selected_roles():
    model, _ = build_model("ea_transformer_lite", *DROP, "--drop-attention-on", "cross")
    assert all(isinstance(layer.encoder_attn.weight_dropout, DropAttention) for layer in model.decoder.layers)
    assert all(layer.self_attn.weight_dropout is None for layer in model.decoder.layers)
    assert all(layer.self_attn.weight_dropout is None for layer in model.encoder.layers)


def test_bad_drop_attention_options():
    with pytest.raises(ValueError, match="drop-attention-p"):
        build_model("ea_transformer_lite", "--drop-attention", "column", "--drop-attention-p", "1.0")
