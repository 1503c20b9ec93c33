"""No host-device syncs and no data-dependent Python branches in a training forward.

Each mechanism's layers (the second layer of each stack, which reads the map the first
handed on) are traced by ``torch.compile(fullgraph=True)`` with the eager backend: a
``tensor.any()`` in an ``if``, an ``.item()`` or any other value-dependent Python
decision breaks the graph and fails the trace. On a GPU each of those would wait for the
device. The reference implementations are traced (accelerators are opaque C++ calls);
the traced layer must compute what the eager one does.
"""
import pytest
import torch

from conftest import build_model, random_batch
from ea_ops import accelerators

LAYERS = ("--encoder-layers", "2", "--decoder-layers", "2", "--dropout", "0.0")
CASES = {
    "ea": ("ea_transformer_lite", "--ea-decoder-alpha", "0.3"),
    "pa": ("pa_transformer_lite",),
    "ran_all": ("ran_all_lite", "--ran-max-positions", "32", "--attention-dropout", "0.0"),
    "ea+drop_attention": ("ea_transformer_lite", "--drop-attention", "element"),
    "hcsa": ("hcsa_lite", "--attention-dropout", "0.0"),
    "syn_r": ("syn_r_lite", "--synthesizer-max-positions", "32", "--attention-dropout", "0.0"),
}


def traced_and_eager(fn, *args):
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="eager", fullgraph=True)
    torch.manual_seed(0)
    got = compiled(*args)
    torch.manual_seed(0)
    return got, fn(*args)


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_training_layers_trace_without_graph_breaks(dictionary, case):
    model, _ = build_model(CASES[case][0], *LAYERS, *CASES[case][1:])
    model.train()
    src, lengths, prev = random_batch(dictionary, [5, 8, 3], 6)  # left-padded sources
    pad = dictionary.pad()
    src_mask = src.eq(pad)
    tgt_mask = torch.zeros_like(prev, dtype=torch.bool)
    tgt_mask[2, 4:] = True  # a right-padded target
    future = torch.triu(torch.full((6, 6), float("-inf")), 1)
    x = torch.randn(src.size(1), 3, model.encoder.embed_positions.embedding_dim, requires_grad=True)
    y = torch.randn(6, 3, x.size(-1), requires_grad=True)
    enc, dec = model.encoder, model.decoder

    def encoder_layers(x, mask):
        with enc.attention_scope(x.size(0)):
            for layer in enc.layers:
                x = layer(x, encoder_padding_mask=mask)
        return x

    def decoder_layers(y, memory, mask, tmask, future):
        with dec.attention_scope(y.size(0)):
            for layer in dec.layers:
                y = layer(y, memory, mask, self_attn_mask=future, self_attn_padding_mask=tmask)[0]
        return y

    with accelerators.reference_only():
        got, want = traced_and_eager(encoder_layers, x, src_mask)
        assert torch.equal(got, want)
        got_dec, want_dec = traced_and_eager(decoder_layers, y, got.detach(), src_mask, tgt_mask, future)
        assert torch.equal(got_dec, want_dec)
        (got.sum() + got_dec.sum()).backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
