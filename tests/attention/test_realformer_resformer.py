"""RealFormer (residual attention) and ResFormer (value residual learning): each held to its
paper's equation, re-implemented here from the module's parameters, on models built by
fairseq's path; refused options. (Causality, incremental decoding, batch invariance, alone
and combined with other mechanisms: test_decoding_properties.py; the reductions to the
Transformer, a one-layer RealFormer and ResFormer at λ = (0, 1), and their state dicts, the
Transformer's at the Lite and Base sizes: test_families.py.)"""
import pytest
from fairseq.modules import MultiheadAttention

from conftest import build_model, decoder_out, random_batch
from support.attention_calls import recorded_attention_calls
from support.paper_equations import attend, dot_product_logits, heads, masked_softmax

THREE = ("--encoder-layers", "3", "--decoder-layers", "3", "--dropout", "0.0", "--attention-dropout", "0.0")
LENGTHS = [4, 9, 6]  # left-padded source batch


def run_recorded(model, dictionary):
    """One teacher-forced pass over a left-padded batch: every attention's calls, per kind."""
    src, lengths, prev = random_batch(dictionary, LENGTHS, 7)
    with recorded_attention_calls(model) as calls:
        decoder_out(model, src, lengths, prev)
    return calls, lengths


def chains(model):
    """(kind, attention modules of its chain, causal, is cross-attention)."""
    return [
        ("encoder.self", [l.self_attn for l in model.encoder.layers], False, False),
        ("decoder.self", [l.self_attn for l in model.decoder.layers], True, False),
        ("decoder.cross", [l.encoder_attn for l in model.decoder.layers], False, True),
    ]


def sentence(call, i, n, is_cross, is_encoder):
    """Sentence i (n source tokens, left-padded) of a recorded call (query, key, key padding,
    output), alone and unpadded: (query, key = value, output)."""
    query, key, _, output = call
    crop = slice(-n, None) if is_encoder else slice(None)
    key = key[slice(-n, None) if (is_encoder or is_cross) else slice(None), i:i + 1]
    return query[crop, i:i + 1], key, output[crop, i:i + 1]


def test_realformer_follows_its_equation_in_every_attention(dictionary):
    """RealFormer Eq. (2)-(3): Prev^i = Prev^(i-1) + QK^T/sqrt(d), A^i = softmax(Prev^i),
    per attention kind, each sentence computed alone (no padding at all)."""
    model, _ = build_model("realformer_lite", *THREE)
    model.double()
    calls, lengths = run_recorded(model, dictionary)
    worst = 0.0
    for kind, chain, causal, is_cross in chains(model):
        for i, n in enumerate(lengths.tolist()):
            prev = 0.0
            for layer, attn in enumerate(chain):
                query, value, out = sentence(calls[kind][layer], i, n, is_cross, kind == "encoder.self")
                key = value
                scores = prev + dot_product_logits(attn, query, key)
                prev = scores
                expected = attend(attn, masked_softmax(scores, causal=causal),
                                  heads(value, attn.v_proj, attn.num_heads))
                worst = max(worst, (expected - out).abs().max().item())
    assert worst <= 1e-12


@pytest.mark.parametrize("lambdas", [("0.5", "0.5"), ("0.3", "0.9")])
def test_resformer_follows_its_equation(dictionary, lambdas):
    """Value residual Eq. (5): V'_n = λ1·V_1 + λ2·V_n for n ≥ 2 in encoder and decoder
    self-attention, each sentence alone (encoder-decoder attention is fairseq's, unchanged)."""
    l1, l2 = map(float, lambdas)
    model, _ = build_model("resformer_lite", *THREE, "--value-residual-lambdas", *lambdas)
    model.double()
    assert all(type(l.encoder_attn) is MultiheadAttention for l in model.decoder.layers)
    calls, lengths = run_recorded(model, dictionary)
    worst = 0.0
    for kind, chain, causal, is_cross in chains(model)[:2]:
        for i, n in enumerate(lengths.tolist()):
            first = None
            for layer, attn in enumerate(chain):
                query, value, out = sentence(calls[kind][layer], i, n, is_cross, kind == "encoder.self")
                key = value
                v = heads(value, attn.v_proj, attn.num_heads)
                if first is None:
                    first = v
                else:
                    v = l1 * first + l2 * v
                weights = masked_softmax(dot_product_logits(attn, query, key), causal=causal)
                worst = max(worst, (attend(attn, weights, v) - out).abs().max().item())
    assert worst <= 1e-12


def test_value_residual_is_for_self_attention(capsys):
    with pytest.raises(SystemExit):
        build_model("resformer_lite", "--value-residual-on", "cross")
    assert "invalid choice" in capsys.readouterr().err
