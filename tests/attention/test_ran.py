"""RAN-E / RAN-D / RAN-ALL: the matrices, the decoding shortcut, caching, a RAN decoder's
encoder-decoder attention (the plugin's: computes what fairseq's does). (Causality,
incremental == full pass, positions per sentence (batch invariance) of every RAN family:
test_decoding_properties.py; parameter counts, at the Lite and the papers' sizes:
test_families.py.)"""
import os

import pytest
import torch
import torch.nn.functional as F
from fairseq import checkpoint_utils
from fairseq.modules.multihead_attention import MultiheadAttention
from fairseq.sequence_generator import SequenceGeneratorWithAlignment

import test_checkpoint_fixtures as fixtures
from conftest import build_model, decoder_out, incremental_logprobs, random_batch
from ea_fairseq.modules.attention_map_carrier import layer_maps
from ea_fairseq.modules.attention_maps import LogitMapAttention
from ea_fairseq.modules.evolving_attention import EvolvingAttention
from ea_fairseq.modules.recurrent_attention import (RecurrentAttention, RecurrentAttentionMatrices,
                                                    sentence_logits, sentence_positions)

SMALL = ("--encoder-layers", "3", "--decoder-layers", "3", "--dropout", "0.0",
         "--attention-dropout", "0.0", "--ran-max-positions", "32")


def test_decoding_step_weights_equal_the_general_path(dictionary, monkeypatch):
    """Decoding without autograd reads each step's weights from the precomputed causal
    softmax of A_l; with autograd on, the same steps go through logits, masks and softmax.
    Both must agree, across a beam reorder, and the shortcut must really be taken."""
    model, _ = build_model("ran_all_lite", *SMALL)
    src, lengths, prev = random_batch(dictionary, [5, 9, 3, 7], 8)
    calls = []
    original = RecurrentAttention.causal_weights
    monkeypatch.setattr(RecurrentAttention, "causal_weights",
                        lambda self, *args: calls.append(1) or original(self, *args))
    order = torch.tensor([1, 1, 3, 2])
    fast, _ = incremental_logprobs(model, src, lengths, prev, reorder_at=4, new_order=order)
    assert len(calls) == 3 * prev.size(1)  # every decoder RAN layer, every step
    calls.clear()
    general, _ = incremental_logprobs(model, src, lengths, prev, reorder_at=4, new_order=order, grad=True)
    assert not calls
    assert (fast - general.detach()).abs().max() <= 1e-5
    # new weights (as after an optimizer step or loading a checkpoint): new step weights
    plain, _ = incremental_logprobs(model, src, lengths, prev)
    with torch.no_grad():
        model.decoder.recurrent_matrices.initial.mul_(3.0)
    fast_after, _ = incremental_logprobs(model, src, lengths, prev)
    general_after, _ = incremental_logprobs(model, src, lengths, prev, grad=True)
    assert (fast_after - general_after.detach()).abs().max() <= 1e-5
    assert (fast_after - plain).abs().max() > 1e-3


def test_sentence_logits_gather_each_sentence_exactly():
    """P A P^T with one-hot P equals indexing A at each sentence's positions, bit for bit
    (real slots; padded slots get zeros), and its gradient equals the gather's."""
    torch.manual_seed(0)
    square = torch.randn(3, 6, 6, requires_grad=True)
    mask = torch.tensor([[True, True, False, False, False, False],   # left-padded
                         [False, False, False, False, False, False],
                         [False, False, False, False, True, True]])  # right-padded
    got = sentence_logits(square, mask)
    pos = sentence_positions(mask, 6, "cpu")
    gathered = square[:, pos[:, :, None], pos[:, None, :]].transpose(0, 1)
    real = ~mask[:, None, :, None] & ~mask[:, None, None, :]
    assert torch.equal(got[real.expand_as(got)], gathered[real.expand_as(got)])
    assert torch.equal(got[~real.expand_as(got)], torch.zeros_like(got[~real.expand_as(got)]))
    grad = torch.randn(got.shape) * real
    (g1,) = torch.autograd.grad(got, square, grad)
    (g2,) = torch.autograd.grad(gathered, square, grad)
    assert torch.allclose(g1, g2, atol=1e-6)


@pytest.mark.parametrize("arch", ["ran_e_lite", "ran_d_lite"])
def test_training_pass_decides_from_shapes_only(arch):
    """A RAN layer's training forward and backward run on meta tensors, which have shapes
    but no values: no ``.any()``/``.item()`` in a Python branch (a host-device sync on a
    GPU) can hide in them."""
    model, _ = build_model(arch, *SMALL)
    model.train().to("meta")
    stack = model.encoder if arch == "ran_e_lite" else model.decoder
    attn = stack.layers[0].self_attn
    x = torch.empty(7, 2, attn.embed_dim, device="meta", requires_grad=True)
    padding = torch.empty(2, 7, dtype=torch.bool, device="meta")
    future = torch.empty(7, 7, device="meta") if arch == "ran_d_lite" else None
    for mask in (None, padding):
        with stack.attention_scope(7) as stack_pass, layer_maps(attn, previous=stack_pass.values):
            out, _ = attn(x, x, x, key_padding_mask=mask, attn_mask=future, need_weights=False)
        out.sum().backward()
        assert out.shape == x.shape and stack.recurrent_matrices.initial.grad is not None


def test_ran_layers_have_no_query_key_projections():
    model, _ = build_model("ran_all_lite", *SMALL)
    for layer in list(model.encoder.layers) + list(model.decoder.layers):
        assert isinstance(layer.self_attn, RecurrentAttention)
        assert not hasattr(layer.self_attn, "q_proj") and not hasattr(layer.self_attn, "k_proj")
    assert not isinstance(model.decoder.layers[0].encoder_attn, RecurrentAttention)  # cross stays
    assert [layer.self_attn.ran_index for layer in model.encoder.layers] == [0, 1, 2]


def test_layers_share_their_stacks_matrices_saved_once():
    """Each RAN layer reads the matrices its stack owns: one module, in the state dict and
    in ``parameters()`` once, whose per-pass result is released when the pass ends."""
    model, _ = build_model("ran_all_lite", *SMALL)
    for stack in (model.encoder, model.decoder):
        assert all(layer.self_attn.matrices is stack.recurrent_matrices for layer in stack.layers)
        assert stack.stack_pass is None
    keys = [k for k in model.state_dict() if "initial" in k or "transition" in k]
    assert sorted(keys) == sorted(f"{s}.recurrent_matrices.{n}" for s in ("encoder", "decoder")
                                  for n in ("initial", "transition.weight", "transition.bias"))
    assert len(list(model.parameters())) == len({id(p) for p in model.parameters()})
    with pytest.raises(RuntimeError, match="stack"):
        model.encoder.layers[0].self_attn(torch.randn(3, 1, model.encoder.embed_positions.embedding_dim),
                                          None, None)


def test_first_layer_standard_option():
    model, _ = build_model("ran_e_lite", *SMALL, "--ran-first-layer-standard")
    kinds = [isinstance(layer.self_attn, RecurrentAttention) for layer in model.encoder.layers]
    assert kinds == [False, True, True]
    assert model.encoder.recurrent_matrices.num_layers == 2


def test_matrices_follow_eqs_3_and_4():
    torch.manual_seed(0)
    m = RecurrentAttentionMatrices(heads=2, max_positions=5, num_layers=3)
    a = m.initial
    for got in m.compute():
        a = F.layer_norm(torch.tanh(a @ m.transition.weight.T + m.transition.bias), (5,),
                         m.layer_norm.weight, m.layer_norm.bias) + a
        assert torch.allclose(got, a, atol=1e-6)
    rows = m.compute(rows=3)
    assert all(torch.allclose(r, f[:, :3], atol=1e-6) for r, f in zip(rows, m.compute()))


@pytest.mark.parametrize("flag", ["--ran-fixed-init", "--ran-no-layernorm", "--ran-no-residual"])
def test_ablation_options(flag):
    model, _ = build_model("ran_e_lite", *SMALL, flag)
    m = model.encoder.recurrent_matrices
    assert m.initial.requires_grad == (flag != "--ran-fixed-init")
    assert (m.layer_norm is None) == (flag == "--ran-no-layernorm")
    assert m.residual == (flag != "--ran-no-residual")


def test_a0_and_transition_are_trained_saved_and_follow_the_weights(dictionary):
    model, _ = build_model("ran_all_lite", *SMALL)
    mats = model.encoder.recurrent_matrices
    # training: gradients reach A0 and the transition of both stacks
    model.train()
    src, lengths, prev = random_batch(dictionary, [5, 9], 6)
    out = model(src, lengths, prev)[0]
    F.cross_entropy(out.reshape(-1, out.size(-1)), prev.reshape(-1)).backward()
    for stack in (model.encoder, model.decoder):
        for name, p in stack.recurrent_matrices.named_parameters():
            assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert "encoder.recurrent_matrices.initial" in model.state_dict()
    # inference: a full pass computes the rows it needs, from the current weights
    model.eval()
    with torch.no_grad():
        first = mats(8)
        assert [a.shape for a in first] == [(4, 8, 32)] * 3
        assert all(torch.equal(a, b[:, :8]) for a, b in zip(first, mats.compute()))
        torch.optim.SGD(model.parameters(), lr=0.1).step()
        second = mats(8)
        assert not torch.equal(second[0], first[0])
        assert all(torch.equal(a, b[:, :8]) for a, b in zip(second, mats.compute()))
        other, _ = build_model("ran_all_lite", *SMALL, seed=5)
        model.load_state_dict(other.state_dict())
        assert torch.equal(mats(8)[0], other.encoder.recurrent_matrices(8)[0])


def test_a_decoding_run_computes_the_matrices_once_per_doubling(dictionary, monkeypatch):
    """A decoding run keeps RAN's matrices in its incremental state: 16 rows at its first
    step, doubled when a step goes past them; a new run starts afresh."""
    model, _ = build_model("ran_d_lite", *SMALL)
    src, lengths, prev = random_batch(dictionary, [5, 9, 3, 7], 20)
    rows = []
    original = RecurrentAttentionMatrices.compute

    def compute(self, stop=None, first=0):
        rows.append((first, stop))
        return original(self, stop, first)

    monkeypatch.setattr(RecurrentAttentionMatrices, "compute", compute)
    steps, _ = incremental_logprobs(model, src, lengths, prev)
    assert rows == [(0, 16), (16, 32)]
    rows.clear()
    incremental_logprobs(model, src, lengths, prev[:, :3])
    assert rows == [(0, 16)]
    assert (steps - decoder_out(model, src, lengths, prev)).abs().max().item() <= 1e-5


def test_too_long_input_is_a_clear_error(dictionary):
    model, args = build_model("ran_e_lite", *SMALL)
    assert args.max_source_positions == 32  # fairseq's own size filter applies
    assert model.max_positions()[0] == 32
    src, lengths, prev = random_batch(dictionary, [40], 3)
    with pytest.raises(ValueError, match="--ran-max-positions"):
        decoder_out(model, src, lengths, prev)


def test_ran_d_with_an_ea_encoder(dictionary):
    """The point of one plugin for both families: RAN-D with an evolving-attention encoder."""
    model, _ = build_model("ran_d_lite", *SMALL, "--encoder-attention", "ea", "--ea-alpha", "0.5",
                           "--ea-beta", "0.5")
    assert all(isinstance(layer.self_attn, EvolvingAttention) for layer in model.encoder.layers)
    assert all(isinstance(layer.self_attn, RecurrentAttention) for layer in model.decoder.layers)
    assert getattr(model.encoder, "recurrent_matrices", None) is None  # (it decodes: family ran-d-lite+ea-encoder)


@pytest.mark.parametrize("arch", ["ran_e_lite", "ran_d_lite", "ran_all_lite"])
def test_weights_changed_through_data_are_used(dictionary, arch):
    """``p.data.add_`` does not bump the version counter of ``p``: a result derived from
    the weights and kept between passes would go stale. After a forward pass and a
    decoding run in eval mode, RAN's weights are changed that way; both must then equal
    a freshly built model with the same state dict."""
    model, _ = build_model(arch, *SMALL)
    src, lengths, prev = random_batch(dictionary, [5, 9, 3, 7], 8)
    decoder_out(model, src, lengths, prev)
    incremental_logprobs(model, src, lengths, prev)
    with torch.no_grad():
        for stack in (model.encoder, model.decoder):
            if getattr(stack, "recurrent_matrices", None) is not None:
                for p in stack.recurrent_matrices.parameters():
                    p.data.add_(0.5)
    fresh, _ = build_model(arch, *SMALL, seed=7)
    fresh.load_state_dict(model.state_dict())
    expected = decoder_out(fresh, src, lengths, prev)
    assert (decoder_out(model, src, lengths, prev) - expected).abs().max().item() <= 1e-6
    steps, _ = incremental_logprobs(model, src, lengths, prev)
    assert (steps - incremental_logprobs(fresh, src, lengths, prev)[0]).abs().max().item() <= 1e-6
    assert (steps - expected).abs().max().item() <= 1e-5


def cross_attention_kinds(model):
    return {type(layer.encoder_attn) for layer in model.decoder.layers}


@pytest.mark.parametrize("arch, options, kind", [
    ("ran_d_lite", (), LogitMapAttention), ("ran_all_lite", (), LogitMapAttention),
    ("ran_e_lite", ("--decoder-attention", "ran"), LogitMapAttention),  # a RAN decoder, however chosen
    ("hcsa_lite", ("--decoder-attention", "ran"), LogitMapAttention),
    ("ran_e_lite", (), MultiheadAttention),  # the transformer's decoder
    ("ran_all_lite", ("--cross-attention", "vanilla"), MultiheadAttention),
])
def test_a_ran_decoders_encoder_decoder_attention_is_the_plugins(arch, options, kind):
    """RAN leaves the encoder-decoder attention dot-product: a RAN decoder's is the plugin's
    (``--cross-attention dot_product``), fairseq's parameters under fairseq's names."""
    model, args = build_model(arch, *SMALL, *options)
    assert cross_attention_kinds(model) == {kind}
    vanilla, _ = build_model(arch, *SMALL, *options, "--cross-attention", "vanilla")
    assert model.state_dict().keys() == vanilla.state_dict().keys()


def load_fixture(family, **overrides):
    """A stored checkpoint fixture (test_checkpoint_fixtures.py), loaded as fairseq-generate
    loads it, with ``overrides`` of its configuration (fairseq's --model-overrides)."""
    (model,), _, task = checkpoint_utils.load_model_ensemble_and_task(
        [os.path.join(fixtures.FIXTURES, family, "checkpoint.pt")],
        arg_overrides=dict(data=fixtures.FIXTURES, source_lang="src", target_lang="tgt", **overrides))
    return model.eval(), task


@pytest.mark.usefixtures("one_thread")  # (tiny models: conftest)
@pytest.mark.parametrize("family", ["ran_all", "ran_d"])
def test_stored_ran_checkpoints_compute_the_same_on_the_plugins_encoder_decoder_attention(family):
    """A RAN checkpoint written with fairseq's encoder-decoder attention loads as written,
    and loads into the plugin's (``cross_attention`` overridden): both compute the stored
    logits, encoder outputs and beam search within the fixtures' rounding bound, and give
    fairseq-generate --print-alignment the same alignments from the same weights (the last
    decoder layer's encoder-decoder attention, head-averaged, at every decoding step); the
    query scaling 1 % off, and the logits leave the bound."""
    written, task = load_fixture(family)
    plugin, _ = load_fixture(family, cross_attention="dot_product")
    assert cross_attention_kinds(written) == {MultiheadAttention}
    assert cross_attention_kinds(plugin) == {LogitMapAttention}
    dictionary = task.target_dictionary
    ratios = fixtures.excess(fixtures.expected(family), fixtures.outputs(plugin, task), dictionary)
    assert {name: r for name, r in ratios.items() if r > 1} == {}, ratios
    src, lengths, _ = fixtures.batch(dictionary, left_pad=True)
    sample = {"net_input": {"src_tokens": src, "src_lengths": lengths}}
    aligned = {}
    for name, model in (("written", written), ("plugin", plugin)):
        generator = SequenceGeneratorWithAlignment([model], dictionary, beam_size=fixtures.BEAM, max_len_a=0,
                                                   max_len_b=fixtures.MAX_LEN_B, print_alignment="hard")
        aligned[name] = [h for sentence in generator.generate([model], sample) for h in sentence]
    for want, got in zip(aligned["written"], aligned["plugin"]):
        assert torch.equal(got["tokens"], want["tokens"]) and got["alignment"] == want["alignment"]
        assert got["attention"].shape == want["attention"].shape
        assert (got["attention"] - want["attention"]).abs().max() <= fixtures.bound(want["attention"])
    assert any(h["alignment"] for h in aligned["plugin"])
    # negative control: the query scaling 1 % larger in every layer, and the logits leave the bound
    for layer in plugin.decoder.layers:
        layer.encoder_attn.scaling *= 1.01
    ratios = fixtures.excess(fixtures.expected(family), fixtures.outputs(plugin, task), dictionary)
    assert min(ratios["logits_left"], ratios["logits_right"]) > 1, ratios



@pytest.mark.usefixtures("one_thread")  # (tiny models: conftest)
@pytest.mark.parametrize("layout", ["cfg", "legacy-args", "cfg-dict"])
def test_a_ran_checkpoint_that_names_no_cross_attention_computes_its_stored_outputs(tmp_path, layout):
    """A RAN-D checkpoint whose configuration has no cross_attention key (written before the
    option; fairseq-train's cfg Namespace, the legacy ``args``, fairseq-hydra-train's dict)
    loads into the plugin's encoder-decoder attention and computes its stored outputs."""
    import copy

    state = torch.load(os.path.join(fixtures.FIXTURES, "ran_d", "checkpoint.pt"), weights_only=False)
    model_cfg = copy.deepcopy(state["cfg"]["model"])
    del model_cfg.cross_attention
    if layout == "legacy-args":
        state["args"], state["cfg"] = model_cfg, None
        for name, section in (("task", "translation"), ("criterion", "cross_entropy"), ("optimizer", "adam"),
                              ("lr_scheduler", "fixed"), ("lr", [0.1])):
            setattr(state["args"], name, section)
    else:
        state["cfg"]["model"] = model_cfg if layout == "cfg" else dict(vars(model_cfg), _name=model_cfg.arch)
    path = str(tmp_path / "checkpoint.pt")
    torch.save(state, path)
    (model,), _, task = checkpoint_utils.load_model_ensemble_and_task(
        [path], arg_overrides=dict(data=fixtures.FIXTURES, source_lang="src", target_lang="tgt"))
    assert cross_attention_kinds(model) == {LogitMapAttention}
    ratios = fixtures.excess(fixtures.expected("ran_d"), fixtures.outputs(model.eval(), task), task.target_dictionary)
    assert {name: r for name, r in ratios.items() if r > 1} == {}, ratios
