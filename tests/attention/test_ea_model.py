"""EA-Transformer as a fairseq model: beam reorders of swapped modules, gradients,
checkpoints, errors. (Beam search == teacher forcing: test_decoding_properties.py; the
parameters EA adds: test_families.py; Table 5's sizes: test_analysis.py.)"""
import copy
import os

import pytest
import torch
import torch.nn.functional as F

from conftest import build_model, parse, random_batch
from ea_fairseq.safety.no_code import load_checkpoint


def test_beam_reorder_reaches_modules_swapped_in_between_decoding_runs(dictionary):
    """The decoder lists the modules that hold incremental state once per decoding run,
    not at every beam-search step (fairseq walks all modules each step); a run that starts
    from an empty state lists them afresh, so a module swapped in is reordered, and the one
    it replaced is not."""
    model, _ = build_model("ea_transformer_lite", "--encoder-layers", "2", "--decoder-layers", "2")
    model.eval()
    src, lengths, prev = random_batch(dictionary, [5, 7], 4)
    dec = model.decoder
    calls = []

    def spied(module, name):
        reorder = module.reorder_incremental_state
        module.reorder_incremental_state = lambda state, order: (calls.append(name), reorder(state, order))[1]
        return module

    def decoding_run():
        state = {}
        with torch.no_grad():
            enc = model.encoder(src, src_lengths=lengths)
            for t in range(1, 3):
                dec(prev[:, :t], encoder_out=enc, incremental_state=state)
                dec.reorder_incremental_state_scripting(state, torch.tensor([1, 0]))

    replacement = copy.deepcopy(dec.layers[1].self_attn)
    spied(dec.layers[1].self_attn, "old")
    decoding_run()
    assert calls == ["old", "old"]
    dec.layers[1].self_attn = spied(replacement, "new")
    decoding_run()
    assert calls[2:] == ["new", "new"]


def test_one_backward_reaches_every_parameter(dictionary):
    """legacy_ddp does not report unused parameters: prove there are none."""
    model, _ = build_model("ea_transformer_lite", "--share-all-embeddings")
    model.train()
    src, lengths, prev = random_batch(dictionary, [6, 9, 4], 7)
    out = model(src, lengths, prev)[0]
    F.cross_entropy(out.view(-1, out.size(-1)), prev.view(-1)).backward()
    missing = [n for n, p in model.named_parameters() if p.requires_grad and (p.grad is None or not p.grad.abs().sum())]
    assert not missing


def test_checkpoint_round_trip_is_weights_only(tmp_path, dictionary):
    model, args = build_model("ea_transformer_lite", "--ea-kernel-size", "5")
    path = os.path.join(tmp_path, "ckpt.pt")
    torch.save({"args": args, "model": model.state_dict()}, path)
    state = load_checkpoint(path)  # torch's weights-only unpickler, never switched off
    assert state["args"] is None and state["cfg"]["model"].ea_kernel_size == 5  # legacy layout, converted
    again, _ = build_model("ea_transformer_lite", "--ea-kernel-size", "5", seed=99)
    again.load_state_dict(state["model"], strict=True)
    src, lengths, prev = random_batch(dictionary, [5, 3], 4)
    model.eval(), again.eval()
    with torch.no_grad():
        assert torch.equal(model(src, lengths, prev)[0], again(src, lengths, prev)[0])


def test_weights_only_still_refuses_other_objects(tmp_path):
    path = os.path.join(tmp_path, "evil.pt")
    torch.save({"model": {}, "payload": os.system}, path)
    with pytest.raises(RuntimeError, match="weights-only"):
        load_checkpoint(path)


@pytest.mark.parametrize("extra,message", [
    (("--ea-alpha", "1.5"), "alpha must lie in"),
    (("--ea-beta", "-0.1"), "beta must lie in"),
])
def test_bad_options_fail_with_a_clear_message(extra, message):
    with pytest.raises(ValueError, match=message):
        build_model("ea_transformer_lite", *extra)


def test_kernel_size_choices_are_enforced(capsys):
    with pytest.raises(SystemExit):
        parse("ea_transformer_lite", "--ea-kernel-size", "4")
    assert "invalid choice" in capsys.readouterr().err


def test_table6_rows_are_expressible():
    """Every ablation row of EA Table 6 maps to options on ea_transformer_lite."""
    rows = {
        "w/o encoder conv": ("--ea-no-encoder-conv",),
        "w/o decoder conv": ("--ea-no-decoder-conv",),
        "w/o enc-dec conv": ("--ea-no-cross-conv",),
        "w/o skip connection": ("--ea-alpha", "0"),
        "1x1 conv": ("--ea-kernel-size", "1"),
        "5x5 conv": ("--ea-kernel-size", "5"),
    }
    for extra in rows.values():
        model, args = build_model("ea_transformer_lite", *extra)
        convs = {n.split(".")[0] + "/" + n.split(".")[3]: m.kernel_size for n, m in model.named_modules()
                 if n.endswith(".conv")}
        assert ("encoder/self_attn" in convs) != ("--ea-no-encoder-conv" in extra)
        assert ("decoder/self_attn" in convs) != ("--ea-no-decoder-conv" in extra)
        assert ("decoder/encoder_attn" in convs) != ("--ea-no-cross-conv" in extra)
        k = int(extra[1]) if "--ea-kernel-size" in extra else 3
        assert all(ks == (k, k) for ks in convs.values())
        assert model.encoder.layers[0].self_attn.alpha == (0.0 if "--ea-alpha" in extra else 0.1)
        assert model.decoder.layers[0].self_attn.alpha == 0.0  # paper §4.3: no decoder skip


def test_mechanism_classes_built_directly_work_or_name_the_way():
    """``EvolvingAttention(16, 4, self_attention=True)`` names the options it needs and how
    the models build it; given them, the module attends on its own (no stack: no previous
    map); PA likewise; RAN, which reads its stack's matrices, names its stack."""
    from ea_fairseq.modules import EvolvingAttention, PredictiveAttention, RecurrentAttention

    x = torch.randn(5, 2, 16)
    with pytest.raises(TypeError, match=r"needs its mechanism's options \['slot', 'alpha'.*EvolvingAttention\(16, 4, self_attention=True, slot=\.\.\."):
        EvolvingAttention(16, 4, self_attention=True)
    attn = EvolvingAttention(16, 4, self_attention=True, slot="self", alpha=0.3, beta=0.5,
                             kernel_size=3, conv_layout="full", hand_on=True)
    out, weights = attn(x, x, x)
    assert out.shape == (5, 2, 16) and torch.allclose(weights.sum(-1), torch.ones(2, 5))
    pa = PredictiveAttention(16, 4, self_attention=True, alpha=0.1, conv_layers=1, predict=True)
    assert pa(x, x, x)[0].shape == (5, 2, 16)
    with pytest.raises(RuntimeError, match="build it in an encoder or decoder"):
        RecurrentAttention(16, 4)(x, x, x)
