"""What the loading guard lets through: every option fairseq itself stores for the families the
plugin vouches for, other families only with the trust switch (and its documented value only),
normal checkpoints of every family and fairseq's own transformer in each layout; compressed
records are refused and damaged files reported as damaged, not as refusals."""
import argparse
import os
import re

import pytest
import torch
from fairseq import checkpoint_utils, options
from fairseq.models.transformer import TransformerModel
from omegaconf import OmegaConf

from support.checkpoint_attacks import (ATTACKS, _legacy_args_layout, _model_fields, checkpoints,  # noqa: F401  (fixture)
                                crafted, trusted_state)
from ea_fairseq.safety import no_code as safety
from ea_fairseq_cli import average_checkpoints as avg
from support.trained_checkpoints import USER_DIR


@pytest.mark.parametrize("arch,task", [
    ("transformer_wmt_en_de_big", "translation"), ("transformer_iwslt_de_en", "translation"),
    ("transformer_lite", "translation_lines"), ("ran_d", "translation"), ("ea_transformer_base", "translation"),
])
@pytest.mark.parametrize("optimizer", ["adam", "adafactor"])
def test_fairseq_defaults_are_accepted(arch, task, optimizer):
    """Every option fairseq itself stores for the vouched families (betas, expressions,
    names) passes: no false refusal."""
    args = options.parse_args_and_arch(options.get_training_parser(), [
        "/nonexistent", "--arch", arch, "--task", task, "--optimizer", optimizer,
        "--lr-scheduler", "inverse_sqrt", "--user-dir", USER_DIR])
    safety.sanitize({"args": args}, "x.pt")
    safety.sanitize({"cfg": {"model": args, "optimizer": {"adam_betas": "(0.9, 0.98)"}}}, "x.pt")


@pytest.mark.parametrize("arch", ["fconv_iwslt_de_en", "fconv_self_att_wp", "lstm", "lightconv_iwslt_de_en",
                                  "bart_base", "transformer_align", "no_such_arch"])
@pytest.mark.parametrize("layout", ["arch", "_name", "legacy-args"])
def test_other_families_are_generated_from_their_own_options(arch, layout):
    """By use, not by family: fairseq's other models are sanitized as their options declare them
    (an unknown architecture passes through to fairseq, which says it does not know it); a field
    fairseq evaluates for them (fconv's layer lists) holds a literal or is refused."""
    known = arch != "no_such_arch"
    fields = vars(options.parse_args_and_arch(options.get_training_parser(), [
        "/nonexistent", "--arch", arch, "--task", "translation"])) if known else {}
    model = argparse.Namespace(**{**fields, "_name" if layout == "_name" else "arch": arch})
    state = {"args": model} if layout == "legacy-args" else {"cfg": {"model": model}}
    generated = safety.sanitize(state, "x.pt")["cfg"]["model"]
    assert (vars(generated) if type(generated) is argparse.Namespace else generated).get(
        "_name" if layout == "_name" else "arch") == arch
    if arch.startswith("fconv"):
        model.encoder_layers = "[__import__('os').system('true')]"
        with pytest.raises(safety.UnsafeCheckpointError, match="encoder_layers.*function call"):
            safety.sanitize(state, "x.pt")


def test_other_tasks_load_as_their_dataclasses_declare_them(tmp_path, checkpoints):
    """By use: a task fairseq declares with a dataclass is generated from it (no list of tasks,
    no switch); one registered without a dataclass has no schema, and is refused in one line."""
    state = torch.load(checkpoints["vanilla"], weights_only=False)
    state["cfg"]["task"]["_name"] = "language_modeling"  # (its model is a translation model: no build)
    assert safety.sanitize(state, "c.pt", build_check=False)["cfg"]["task"]["_name"] == "language_modeling"
    state["cfg"]["task"]["_name"] = "multilingual_translation"
    with pytest.raises(safety.UnsafeCheckpointError, match="without a configuration dataclass"):
        safety.sanitize(state, "c.pt", build_check=False)


def test_compressed_records_are_refused(tmp_path, checkpoints):
    """torch.save stores records uncompressed, so none can expand beyond the file's size."""
    import zipfile

    with zipfile.ZipFile(checkpoints["vanilla"]) as src, \
            zipfile.ZipFile(tmp_path / "c.pt", "w", compression=zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info))
    for load in (checkpoint_utils.load_checkpoint_to_cpu, safety.load_checkpoint):
        with pytest.raises(safety.UnsafeCheckpointError, match="compressed records"):
            load(str(tmp_path / "c.pt"))


@pytest.mark.parametrize("content,cause", [
    (b"", "the file is empty"),
    (b"step 1000 loss 3.2\n", "not a torch checkpoint"),
    ("truncated", "a zip archive without its central directory"),
    (b"\x80\x02" + os.urandom(64), "corrupt or not a checkpoint"),
], ids=["empty", "text", "truncated", "damaged-pickle"])
def test_damaged_files_are_reported_as_such_not_as_refusals(tmp_path, checkpoints, content, cause, capsys):
    if content == "truncated":
        data = checkpoints["vanilla"].read_bytes()
        content = data[: len(data) // 2]
    path = tmp_path / "checkpoint_last.pt"
    path.write_bytes(content)
    for load in (checkpoint_utils.load_checkpoint_to_cpu, safety.load_checkpoint):
        with pytest.raises(safety.CorruptCheckpointError, match="corrupt or not a checkpoint") as err:
            load(str(path))
        assert cause in str(err.value) and "refused" not in str(err.value)
    assert avg.main(["--inputs", str(path), str(checkpoints["vanilla"]), "--output", str(tmp_path / "a.pt")]) == 1
    assert "corrupt or not a checkpoint" in capsys.readouterr().err

@pytest.mark.parametrize("family", ["vanilla", "ea", "pa", "ran"])
def test_normal_checkpoints_of_every_family_load(checkpoints, family, tiny_data_bin):
    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(checkpoints[family])], arg_overrides={"data": tiny_data_bin})
    state = safety.load_checkpoint(str(checkpoints[family]))
    assert all(torch.equal(v, models[0].state_dict()[k]) for k, v in state["model"].items())


@pytest.mark.parametrize("layout", ["transformer-arch", "hydra-dict", "legacy-args", "omegaconf-container"])
def test_fairseq_transformer_checkpoints_load(tmp_path, checkpoints, tiny_data_bin, layout):
    """fairseq's own ``TransformerModel`` (``--arch transformer``; ``_name`` as hydra writes it;
    the legacy ``args`` layout; an omegaconf container) loads and computes the same."""
    state = trusted_state(checkpoints["vanilla"])
    model_cfg = state["cfg"]["model"]
    model_cfg.arch = model_cfg._name = "transformer"
    if layout == "hydra-dict":
        state["cfg"]["model"] = _model_fields(model_cfg)
    elif layout == "legacy-args":
        _legacy_args_layout(state, None)
        state["args"].adaptive_softmax_cutoff = None
    elif layout == "omegaconf-container":
        state["cfg"] = OmegaConf.create(dict(state["cfg"], model=_model_fields(model_cfg)),
                                        flags={"allow_objects": True})
    torch.save(state, tmp_path / "c.pt")
    (model,), _, _ = checkpoint_utils.load_model_ensemble_and_task(
        [str(tmp_path / "c.pt")], arg_overrides={"data": tiny_data_bin})
    (reference,), _, _ = checkpoint_utils.load_model_ensemble_and_task(
        [str(checkpoints["vanilla"])], arg_overrides={"data": tiny_data_bin})
    assert type(model) is TransformerModel
    assert all(torch.equal(v, reference.state_dict()[k]) for k, v in model.state_dict().items())
