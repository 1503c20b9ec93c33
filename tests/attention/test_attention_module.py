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
from support.families import FAMILIES

#: every family but those that build the same modules at other values or sizes
MODULE_SETS = [name for name, f in FAMILIES.items() if not f.variant_of]


@pytest.mark.parametrize("name", MODULE_SETS)
def test_every_role_follows_the_protocol(name, dictionary):
    model, _ = build_model(*FAMILIES[name].args(), "--encoder-layers", "2", "--decoder-layers", "1",
                           dictionary=dictionary)
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
        return state

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


def _twins(**options):
    """fairseq's MHA and the plugin's module with the same weights (fairseq's unfused path)."""
    torch.manual_seed(0)
    fairseq = MultiheadAttention(16, 4, dropout=0.0, **options)
    torch.manual_seed(0)
    own = LogitMapAttention(16, 4, dropout=0.0, **options)
    fairseq.skip_embed_dim_check = True
    return own, fairseq


def _attention(module, x, keys, values):
    """Scaled dot-product attention of the module's projections, written out (no mask)."""
    heads, bsz = module.num_heads, x.size(1)
    split = lambda t: t.contiguous().view(t.size(0), bsz * heads, -1).transpose(0, 1)  # noqa: E731
    q, k, v = split(module.q_proj(x) * module.scaling), split(module.k_proj(keys)), split(module.v_proj(values))
    out = torch.softmax(q @ k.transpose(1, 2), -1) @ v
    return module.out_proj(out.transpose(0, 1).contiguous().view(x.size(0), bsz, -1))


def test_separate_keys_and_values_and_the_logits_before_softmax():
    """Keys and values from different tensors: values projected from ``value``, in a full pass
    and in decoding steps (fairseq's encoder-decoder attention projects both from ``key``; its
    layers pass one tensor). ``before_softmax=True`` gives fairseq's logits and values."""
    own, fairseq = _twins(encoder_decoder_attention=True)
    x, keys, values = torch.randn(5, 3, 16), torch.randn(7, 3, 16), torch.randn(7, 3, 16)
    expected = _attention(own, x, keys, values)
    assert (own(x, keys, values)[0] - expected).abs().max() < 1e-6
    assert (own(x, keys, keys)[0] - expected).abs().max() > 1e-3  # negative control: values matter
    state = {}
    for t in range(2):  # the keys and values projected at the first step, reused at the next
        out, _ = own(x[t:t + 1], keys, values, incremental_state=state, static_kv=True)
        assert (out - expected[t:t + 1]).abs().max() < 1e-6, t
    logits, v = own(x, keys, keys, before_softmax=True)
    expected_logits, expected_v = fairseq(x, keys, keys, before_softmax=True)
    assert logits.shape == expected_logits.shape == (3 * 4, 5, 7)
    assert (logits - expected_logits).abs().max() < 1e-5 and (v - expected_v).abs().max() < 1e-6


def test_steps_that_bring_new_keys_and_values_apart():
    """Decoding steps of an attention whose keys are not fixed (``static_kv=False``), each
    step's key and value from different tensors: the attention over all keys and values so
    far, written out."""
    own, _ = _twins(encoder_decoder_attention=True)
    x, keys, values = torch.randn(4, 2, 16), torch.randn(4, 2, 16), torch.randn(4, 2, 16)
    state = {}
    for t in range(4):
        out, _ = own(x[t:t + 1], keys[t:t + 1], values[t:t + 1], incremental_state=state)
        expected = _attention(own, x[t:t + 1], keys[:t + 1], values[:t + 1])
        assert (out - expected).abs().max() < 1e-6, t


def test_a_key_or_value_left_out_is_the_query_or_the_key():
    own, _ = _twins(self_attention=True)
    x = torch.randn(4, 2, 16)
    assert torch.equal(own(x, None, None)[0], own(x, x, x)[0])
    cross, _ = _twins(encoder_decoder_attention=True)
    memory = torch.randn(6, 2, 16)
    assert torch.equal(cross(x, memory, None)[0], cross(x, memory, memory)[0])


def test_a_previous_state_handed_in_under_fairseqs_names_is_read_back():
    """fairseq's decoder layer hands a previous self-attention state in (prev_self_attn_state)
    and reads it back (--cross-self-attention) under fairseq's names; the next step attends
    to it as fairseq's module does."""
    own, fairseq = _twins(self_attention=True)
    bsz, prefix = 2, 3
    buffer = {"prev_key": torch.randn(bsz, 4, prefix, 4), "prev_value": torch.randn(bsz, 4, prefix, 4),
              "prev_key_padding_mask": torch.zeros(bsz, prefix, dtype=torch.bool)}
    own_state, fairseq_state = {}, {}
    own._set_input_buffer(own_state, dict(buffer))
    fairseq._set_input_buffer(fairseq_state, dict(buffer))
    read = own._get_input_buffer(own_state)
    assert torch.equal(read["prev_key"], buffer["prev_key"]) and torch.equal(read["prev_value"], buffer["prev_value"])
    step = torch.randn(1, bsz, 16)
    padding = torch.zeros(bsz, 1, dtype=torch.bool)
    out, _ = own(step, step, step, key_padding_mask=padding, incremental_state=own_state)
    expected, _ = fairseq(step, step, step, key_padding_mask=padding, incremental_state=fairseq_state)
    assert (out - expected).abs().max() < 1e-6
    assert own._get_input_buffer(own_state)["prev_key"].size(2) == prefix + 1


@pytest.mark.parametrize("options, message", [
    (dict(num_heads=3), "embed_dim 16 is not divisible by num_heads 3"),
    (dict(self_attention=True, kdim=12), "self-attention needs keys and values of the queries' width"),
    (dict(add_bias_kv=True), "cannot take the extra key column of --add-bias-kv / --add-zero-attn"),
    (dict(add_zero_attn=True), "cannot take the extra key column of --add-bias-kv / --add-zero-attn"),
    (dict(xformers_att_config='{"name": "scaled_dot_product"}'), "drop --encoder/--decoder-xformers-att-config"),
    (dict(unknown_option=1), "unexpected options ['unknown_option']"),
])
def test_what_the_module_cannot_be_is_refused_in_one_line(options, message):
    options = {"embed_dim": 16, "num_heads": 4, **options}
    with pytest.raises((ValueError, TypeError)) as caught:
        LogitMapAttention(**options)
    assert str(caught.value).count("\n") == 0 and message in str(caught.value)


def test_masks_of_another_shape_are_refused_in_one_line():
    own, _ = _twins(self_attention=True)
    x = torch.randn(4, 2, 16)
    with pytest.raises(ValueError, match=r"key_padding_mask of shape \(2, 3\) does not cover the \(batch, keys\) = \(2, 4\)"):
        own(x, x, x, key_padding_mask=torch.zeros(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"attn_mask of shape \(4, 3\) is not the \(queries, keys\) = \(4, 4\)"):
        own(x, x, x, attn_mask=torch.zeros(4, 3))
