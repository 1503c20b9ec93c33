"""Warm start: any arch of the plugin from a trained vanilla transformer checkpoint."""
import sys

import pytest
import torch
from fairseq import checkpoint_utils

from conftest import REPO, decoder_out, random_batch
from ea_fairseq.modules import AttentionMapConv
from ea_fairseq_cli.warm_start import WarmStartError, main, warm_start
from support.trained_checkpoints import TINY, family_checkpoints, run, train_command, train_many

EA_OFF = ["--ea-alpha", "0", "--ea-beta", "0", "--ea-decoder-alpha", "0"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_data_bin):
    return family_checkpoints(tmp_path_factory, tiny_data_bin)


def load(path, data):
    (model,), _, task = checkpoint_utils.load_model_ensemble_and_task([str(path)], arg_overrides={"data": data})
    return model.double(), task


@pytest.mark.parametrize("options,equal", [(EA_OFF, True), ([], False)], ids=["ea-off", "ea-on"])
def test_switched_off_the_warm_started_model_is_the_vanilla_one(tmp_path, checkpoints, tiny_data_bin,
                                                               options, equal):
    state, report, _ = warm_start(str(checkpoints["vanilla"]), "ea_transformer_lite", options)
    torch.save(state, tmp_path / "ea.pt")
    vanilla, task = load(checkpoints["vanilla"], tiny_data_bin)
    ea, _ = load(tmp_path / "ea.pt", tiny_data_bin)
    assert type(ea).__name__ == "EATransformerModel"
    src, lengths, prev = random_batch(task.source_dictionary, [7, 4, 9], 6)
    gap = (decoder_out(ea, src, lengths, prev) - decoder_out(vanilla, src, lengths, prev)).abs().max()
    assert gap <= 1e-6 if equal else gap > 1e-3  # (the second: EA with its paper weights moves it)


def test_every_shared_parameter_copied_the_mechanisms_initialised_as_in_training(checkpoints):
    vanilla = torch.load(checkpoints["vanilla"], weights_only=False)["model"]
    state, report, _ = warm_start(str(checkpoints["vanilla"]), "ea_transformer_lite", seed=5)
    assert sorted(report["copied"]) == sorted(vanilla) and not report["unused"]
    assert sorted(report["new"]) == sorted(k for k in state["model"] if ".conv." in k) and report["new"]
    for key in report["copied"]:
        assert torch.equal(state["model"][key], vanilla[key]), key
    # the new convolutions are what building the model with that seed gives
    from conftest import build_model

    fresh, _ = build_model("ea_transformer_lite", *TINY, "--share-all-embeddings", seed=5,
                           dictionary=_dictionary(vanilla["encoder.embed_tokens.weight"].shape[0]))
    for key in report["new"]:
        assert torch.equal(state["model"][key], fresh.state_dict()[key]), key
    assert any(isinstance(m, AttentionMapConv) for m in fresh.modules())


def _dictionary(size):
    from ea_fairseq_cli.warm_start import _dictionary as make

    return make(size)


def test_ran_and_pa_report_what_is_new_and_unused(checkpoints, tiny_data_bin, tmp_path):
    state, report, _ = warm_start(str(checkpoints["vanilla"]), "ran_all_lite", ["--ran-max-positions", "16"])
    assert {k.split(".")[-2] for k in report["unused"]} == {"q_proj", "k_proj"}  # RAN has none
    assert all("recurrent_matrices" in k for k in report["new"]) and report["new"]
    torch.save(state, tmp_path / "ran.pt")
    model, _ = load(tmp_path / "ran.pt", tiny_data_bin)  # a loadable fairseq checkpoint
    assert model.encoder.recurrent_matrices is not None
    _, report, _ = warm_start(str(checkpoints["vanilla"]), "pa_transformer_lite")
    assert report["new"] and all(".predictor." in k for k in report["new"]) and not report["unused"]


@pytest.mark.parametrize("options,message", [
    (["--encoder-layers", "3"], "--encoder-layers is 2 in .*, 3 for the new model"),
    (["--decoder-attention-heads", "2"], "--decoder-attention-heads is 4"),
    (["--encoder-ffn-embed-dim", "64"], "--encoder-ffn-embed-dim is 32"),
    (["--ea-bogus", "1"], "not options of --arch ea_transformer_lite: --ea-bogus 1"),
])
def test_different_dimensions_are_refused(checkpoints, options, message):
    with pytest.raises(WarmStartError, match=message):
        warm_start(str(checkpoints["vanilla"]), "ea_transformer_lite", options)


def test_only_a_vanilla_transformer_is_a_starting_point(checkpoints):
    with pytest.raises(WarmStartError, match="--arch ea_transformer_lite with --encoder-attention ea"):
        warm_start(str(checkpoints["ea"]), "ran_all_lite")


def test_command_line_then_fairseq_train_continues_as_ea(tmp_path, checkpoints, tiny_data_bin, capsys):
    out = tmp_path / "ea_init.pt"
    code, log = run([sys.executable, "-m", "ea_fairseq_cli.warm_start", checkpoints["vanilla"], "--arch",
                     "ea_transformer_lite", "--output", out], cwd=REPO)
    assert "copied from the vanilla model: 89 tensors" in log
    assert "encoder.layers.*.self_attn.conv.weight (x2)" in log
    assert f"--share-all-embeddings --finetune-from-model {out}" in log
    assert main([str(checkpoints["vanilla"]), "--arch", "ea_transformer_lite", "--encoder-layers", "3",
                 "--output", str(tmp_path / "no.pt")]) == 1
    assert "warm_start: error: the dimensions differ" in capsys.readouterr().err
    assert not (tmp_path / "no.pt").exists()

    finetune = train_command(tiny_data_bin, "ea_transformer_lite", tmp_path / "ft", "--finetune-from-model", out,
                             updates=2)
    restore = train_command(tiny_data_bin, "ea_transformer_lite", tmp_path / "rs", "--restore-file", out, updates=2)
    log = train_many(finetune, restore)
    assert f"loading pretrained model from {out}" in log
    assert log.count(f"Loaded checkpoint {out} (epoch 1 @ 0 updates)") == 2
    vanilla = torch.load(checkpoints["vanilla"], weights_only=False)["model"]
    start = torch.load(out, weights_only=False)["model"]
    ft = torch.load(tmp_path / "ft" / "checkpoint_last.pt", weights_only=False)
    rs = torch.load(tmp_path / "rs" / "checkpoint_last.pt", weights_only=False)
    assert ft["optimizer_history"][-1]["num_updates"] == 2 and ft["cfg"]["model"].arch == "ea_transformer_lite"
    for key, value in ft["model"].items():
        assert torch.equal(value, rs["model"][key]), key  # both ways fine-tune the same way
        moved = (value - start[key]).abs().max().item() if value.is_floating_point() else 0.0
        assert moved <= 2.5e-3, key  # two Adam steps of lr 1e-3 from the warm start
        if key in vanilla and value.is_floating_point() and value.numel() > 1:
            assert (value - vanilla[key]).abs().max() <= 2.5e-3, key
    assert any((ft["model"][k] != start[k]).any() for k in start if ".conv." in k)  # EA trains


def test_non_finite_weights_are_reported_by_name(tmp_path, checkpoints):
    state = torch.load(checkpoints["vanilla"], weights_only=False)
    state["model"]["decoder.layers.1.fc2.weight"][0, 0] = float("nan")
    torch.save(state, tmp_path / "nan.pt")
    with pytest.raises(WarmStartError, match="NaN or infinite weights in 1 tensors: decoder.layers.1.fc2.weight"):
        warm_start(str(tmp_path / "nan.pt"), "ea_transformer_lite")
