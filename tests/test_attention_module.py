"""The plugin's attention modules: built directly with fairseq's parameters, following the
written protocol, with one cache whose one reorder knows which rows are per hypothesis."""
import ast
import inspect
import os

import pytest
import torch
from fairseq.modules import MultiheadAttention

from ea_fairseq.modules.attention_cache import AttentionCache
from ea_fairseq.modules.attention_maps import LogitMapAttention
from ea_fairseq.modules.attention_protocol import AttentionModule

from conftest import REPO, build_model

ARCHS = [("ea_transformer_lite",), ("pa_transformer_lite",), ("ran_all_lite",), ("hcsa_lite",), ("syn_r_lite",),
         ("realformer_lite",), ("resformer_lite",), ("conv_transformer_lite",),
         ("ran_d_lite", "--drop-attention", "element", "--value-residual-on", "encoder", "decoder")]


@pytest.mark.parametrize("args", ARCHS, ids=lambda a: "-".join(a))
def test_every_role_follows_the_protocol(args, dictionary):
    model, _ = build_model(*args, dictionary=dictionary)
    expected = list(inspect.signature(AttentionModule.forward).parameters)
    modules = [layer.self_attn for layer in model.encoder.layers] + [
        m for layer in model.decoder.layers for m in (layer.self_attn, layer.encoder_attn)]
    for module in modules:
        assert isinstance(module, AttentionModule), type(module)
        if not isinstance(module, MultiheadAttention):  # the plugin's: the protocol's call
            assert list(inspect.signature(type(module).forward).parameters) == expected, type(module)


def test_no_module_is_promoted_or_routed_through_fairseqs_forward():
    """The package builds its modules (no ``__class__`` swap), has no fairseq attention
    forward to fall back into, and sets ``skip_embed_dim_check`` on no model's module."""
    assert not issubclass(LogitMapAttention, MultiheadAttention)
    package = os.path.join(REPO, "ea_fairseq")
    for root, _, files in os.walk(package):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(root, name)
            with open(path, encoding="utf-8") as f:
                source = f.read()
            for node in ast.walk(ast.parse(source)):
                if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                    assert node.attr != "__class__", (path, node.lineno)
                    # (the analysis tool reads per-head weights of fairseq's own modules, a
                    # vanilla model's, through fairseq's unfused path: its one use)
                    if not path.endswith(os.path.join("analysis", "maps.py")):
                        assert node.attr != "skip_embed_dim_check", (path, node.lineno)


@pytest.mark.parametrize("kind", ["self", "cross"])
def test_fairseqs_parameters_initialisation_and_numbers(kind):
    """Same parameter names, the same initial values from the same seed, and with its
    projections kept apart (a hook) fairseq's unfused attention's numbers exactly."""
    options = dict(self_attention=True) if kind == "self" else dict(encoder_decoder_attention=True, kdim=12, vdim=12)
    torch.manual_seed(0)
    fairseq = MultiheadAttention(16, 4, dropout=0.0, **options)
    torch.manual_seed(0)
    own = LogitMapAttention(16, 4, dropout=0.0, **options)
    assert list(own.state_dict()) == list(fairseq.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(own.state_dict().values(), fairseq.state_dict().values()))
    fairseq.skip_embed_dim_check = True  # fairseq's unfused path
    x = torch.randn(5, 3, 16)
    memory = x if kind == "self" else torch.randn(7, 3, 12)
    padding = torch.zeros(3, memory.size(0), dtype=torch.bool)
    padding[1, -2:] = True
    hooks = [getattr(own, n).register_forward_hook(lambda *a: None) for n in ("q_proj", "k_proj", "v_proj")]
    out, weights = own(x, memory, memory, key_padding_mask=padding)
    expected, expected_weights = fairseq(x, memory, memory, key_padding_mask=padding)
    assert torch.equal(out, expected) and torch.equal(weights, expected_weights)
    for h in hooks:
        h.remove()
    joined, _ = own(x, memory, memory, key_padding_mask=padding)
    assert (joined - expected).abs().max() < 1e-5


def test_one_reorder_knows_hypothesis_and_sentence_rows():
    beams = 2
    hypotheses = AttentionCache()  # self-attention: one row per hypothesis
    hypotheses.keys = hypotheses.values = torch.arange(4.0).view(4, 1, 1, 1)
    hypotheses.key_padding = torch.tensor([[True], [False], [False], [False]])
    hypotheses.mechanism["rows"] = torch.arange(4.0)
    sentences = AttentionCache()  # the encoder's keys, one row per sentence, shared by its beams
    sentences.keys = sentences.values = torch.arange(2.0).view(2, 1, 1, 1)
    sentences.static, sentences.beam_size = True, beams

    def by_index(state, order):
        if "rows" in state:
            state["rows"] = state["rows"].index_select(0, order)

    within = torch.tensor([1, 1, 2, 3])  # beams change within their sentences
    hypotheses.reorder(within, by_index)
    sentences.reorder(within, by_index)
    assert hypotheses.keys.flatten().tolist() == [1, 1, 2, 3]
    assert hypotheses.key_padding.flatten().tolist() == [False, False, False, False]
    assert hypotheses.mechanism["rows"].tolist() == [1, 1, 2, 3]
    assert sentences.keys.flatten().tolist() == [0, 1]  # shared: nothing to move
    sentences.reorder(torch.tensor([2, 3]), by_index)  # sentence 0 finished: its beams leave
    assert sentences.keys.flatten().tolist() == [1]
    assert hypotheses.as_buffer().keys() == {"prev_key", "prev_value", "prev_key_padding_mask"}
