"""A checkpoint cannot run code: crafted configurations are refused by every loading path
(fairseq-generate, the hub, --restore-file, averaging, the analysis tool) before fairseq
evaluates them, and nothing is executed; normal checkpoints of every family still load."""
import argparse
import os

import pytest
import torch
from fairseq import checkpoint_utils, options

from conftest import cli
from ea_fairseq import checkpoint_safety as safety
from trained_checkpoints import USER_DIR, family_checkpoints, run, train_command

from ea_fairseq.tools import average_checkpoints as avg


def payload(marker) -> str:
    """What the issue found: a string fairseq's eval() runs, leaving a file behind."""
    return f"__import__('os').system('touch {marker}') or None"


def crafted(src, dst, field, value, where="model"):
    """A copy of checkpoint ``src`` with one configuration field replaced."""
    state = torch.load(src, weights_only=False)  # our own, trusted file
    if where == "args":  # the legacy layout: a flat Namespace, no cfg
        flat = argparse.Namespace(**vars(state["cfg"]["model"]))
        flat.task, flat.data = "translation", state["cfg"]["task"]["data"]
        setattr(flat, field, value)
        state["args"], state["cfg"] = flat, None
    elif isinstance(state["cfg"][where], argparse.Namespace):
        setattr(state["cfg"][where], field, value)
    else:
        state["cfg"][where][field] = value
    torch.save(state, dst)
    return dst


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_data_bin):
    return family_checkpoints(tmp_path_factory, tiny_data_bin)


@pytest.fixture
def evil(tmp_path, checkpoints):
    """(crafted checkpoint, the file its payload would create)."""
    marker = tmp_path / "pwned"
    return crafted(checkpoints["vanilla"], tmp_path / "crafted.pt", "adaptive_softmax_cutoff",
                   payload(marker)), marker


def test_the_payload_is_live_without_the_guard(tmp_path, checkpoints):
    """Negative control: unguarded, fairseq's loading runs the payload (so the tests below
    that check the file is absent can fail)."""
    marker = tmp_path / "pwned"
    path = crafted(checkpoints["vanilla"], tmp_path / "c.pt", "adaptive_softmax_cutoff", payload(marker))
    state = unguarded_load(path)
    with pytest.raises(TypeError):  # eval ran, then eval_str_list choked on its None
        checkpoint_utils.load_model_ensemble_and_task([str(path)], state=state)
    assert marker.exists()


def unguarded_load(path):
    """fairseq's own loader, without the validation (the allow-list still scoped)."""
    with safety.checkpoint_globals_allowed():
        return checkpoint_utils.load_checkpoint_to_cpu.__wrapped__(str(path))


def refused(text, field="cfg.model.adaptive_softmax_cutoff"):
    return "refused" in text and field in text and "Nothing in the checkpoint was run" in text


def test_fairseq_generate_refuses(tiny_data_bin, evil):
    path, marker = evil
    code, out = run([cli("fairseq-generate"), tiny_data_bin, "--user-dir", USER_DIR, "--path", path,
                     "--beam", "5", "--cpu", "--max-len-b", "5"], expect_ok=False, cwd=path.parent)
    assert code != 0 and refused(out), out[-3000:]
    assert not marker.exists()


def test_restore_file_refuses(tmp_path, tiny_data_bin, evil):
    path, marker = evil
    code, out = run(train_command(tiny_data_bin, "transformer_lite", tmp_path / "save", "--restore-file", path),
                    expect_ok=False, cwd=tmp_path)
    assert code != 0 and refused(out), out[-3000:]
    assert not marker.exists()


def test_hub_refuses(tiny_data_bin, evil):
    from fairseq.models.transformer import TransformerModel

    path, marker = evil
    with pytest.raises(safety.UnsafeCheckpointError, match="cfg.model.adaptive_softmax_cutoff"):
        TransformerModel.from_pretrained(str(path.parent), checkpoint_file=path.name,
                                         data_name_or_path=tiny_data_bin, user_dir=USER_DIR)
    assert not marker.exists()


def test_averaging_refuses_and_writes_nothing(tmp_path, checkpoints, evil, capsys):
    path, marker = evil
    out = tmp_path / "avg.pt"
    for inputs in ([checkpoints["vanilla"], path], [path, checkpoints["vanilla"]]):
        assert avg.main(["--inputs", *map(str, inputs), "--output", str(out)]) == 1
        assert refused(capsys.readouterr().err)
    assert not out.exists() and not marker.exists()


def test_analysis_refuses(tmp_path, tiny_data_bin, evil):
    from ea_fairseq.analysis.cli import main

    path, marker = evil
    with pytest.raises(SystemExit) as exit_:
        main(["dump", str(path), "--data", tiny_data_bin, "--out", str(tmp_path / "d.npz")])
    assert refused(str(exit_.value.code))
    assert not marker.exists()


@pytest.mark.parametrize("field", sorted(safety.GUARDED_FIELDS))
def test_every_guarded_field_is_refused(tmp_path, checkpoints, field):
    """Every field fairseq evaluates, imports or looks up by name (a path string is a valid
    user_dir: that field is refused for not being a string)."""
    marker = tmp_path / "pwned"
    path = crafted(checkpoints["vanilla"], tmp_path / "c.pt", field, 7 if field == "user_dir" else payload(marker))
    with pytest.raises(safety.UnsafeCheckpointError, match=f"cfg.model.{field} "):
        checkpoint_utils.load_checkpoint_to_cpu(str(path))  # generate, hub, restore, analysis
    with pytest.raises(safety.UnsafeCheckpointError, match=f"cfg.model.{field} "):
        safety.load_checkpoint(str(path))  # averaging, warm start
    assert not marker.exists()


@pytest.mark.parametrize("field,where,shown", [
    ("adam_betas", "optimizer", "cfg.optimizer.adam_betas"),
    ("left_pad_source", "task", "cfg.task.left_pad_source"),
    ("adaptive_softmax_cutoff", "args", "args.adaptive_softmax_cutoff"),  # legacy checkpoints
    ("encoder_xformers_att_config", "args", "args.encoder_xformers_att_config"),
])
def test_refused_in_every_section_and_layout(tmp_path, checkpoints, field, where, shown):
    marker = tmp_path / "pwned"
    path = crafted(checkpoints["vanilla"], tmp_path / "c.pt", field, payload(marker), where=where)
    with pytest.raises(safety.UnsafeCheckpointError, match=shown.replace(".", r"\.")):
        checkpoint_utils.load_model_ensemble_and_task([str(path)])
    assert not marker.exists()


@pytest.mark.parametrize("field", ["encoder_xformers_att_config", "decoder_xformers_att_config"])
def test_fields_evaluated_while_loading_are_caught_before(tmp_path, checkpoints, field):
    """These are evaluated when the model is built from the checkpoint (control: unguarded,
    the payload runs); guarded, loading stops first."""
    marker = tmp_path / "pwned"
    path = crafted(checkpoints["vanilla"], tmp_path / "c.pt", field, payload(marker))
    state = unguarded_load(path)
    checkpoint_utils.load_model_ensemble_and_task([str(path)], state=state)
    assert marker.exists()
    marker.unlink()
    with pytest.raises(safety.UnsafeCheckpointError, match=field):
        checkpoint_utils.load_model_ensemble_and_task([str(path)])
    assert not marker.exists()


@pytest.mark.parametrize("field,value,why", [
    ("adaptive_softmax_cutoff", "[1000, 'x']", "not an integer or a list of integers"),
    ("adaptive_softmax_cutoff", "${oc.env:HOME}", "not a Python literal"),
    ("adaptive_softmax_cutoff", "[0] * 1000000000", "more than 100000 items"),
    ("adaptive_softmax_cutoff", "(lambda: 1)()", "function call"),
    ("adam_betas", "().__class__", "attribute access"),
    ("decoder_attention", "[x for x in ()]", "code, not a literal"),
    ("user_dir", 7, "not a directory path"),
    ("arch", "transformer; rm -rf ~", "registered name"),
    ("task", "../../etc", "registered name"),
])
def test_errors_say_what_is_wrong(field, value, why):
    state = {"cfg": {"model": argparse.Namespace(**{field: value})}}
    with pytest.raises(safety.UnsafeCheckpointError, match=why.replace("(", r"\(")):
        safety.validate_checkpoint(state, "x.pt")


@pytest.mark.parametrize("arch,task", [
    ("fconv_wmt_en_de", "translation"), ("fconv_self_att_wp", "translation"), ("lstm_luong_wmt_en_de", "translation"),
    ("lightconv_iwslt_de_en", "translation"), ("transformer_wmt_en_de_big", "translation"),
    ("transformer_lm_gpt", "language_modeling"), ("ran_d", "translation"), ("ea_transformer_base", "translation"),
])
@pytest.mark.parametrize("optimizer", ["adam", "adafactor"])
def test_fairseq_defaults_are_accepted(arch, task, optimizer):
    """Expressions fairseq itself stores (``"[(512, 3)] * 9 + [(1024, 3)] * 4"``, betas,
    character filters, names) are literals: no false refusal."""
    args = options.parse_args_and_arch(options.get_training_parser(), [
        "/nonexistent", "--arch", arch, "--task", task, "--optimizer", optimizer,
        "--lr-scheduler", "inverse_sqrt", "--user-dir", USER_DIR])
    safety.validate_checkpoint({"args": args}, "x.pt")
    safety.validate_checkpoint({"cfg": {"model": args, "optimizer": {"adam_betas": "(0.9, 0.98)"}}}, "x.pt")


def test_a_pickled_callable_is_refused_by_fairseqs_loader(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"model": {}, "cfg": None, "hook": os.system}, path)
    with pytest.raises(safety.CheckpointError, match="posix.system"):
        checkpoint_utils.load_checkpoint_to_cpu(str(path))


def test_allow_list_is_scoped_to_checkpoint_loads(checkpoints):
    checkpoint_utils.load_checkpoint_to_cpu(str(checkpoints["vanilla"]))
    assert argparse.Namespace not in torch.serialization.get_safe_globals()
    with pytest.raises(Exception, match="(?i)weights.only"):  # plain torch.load is untouched
        torch.load(checkpoints["vanilla"], weights_only=True)


@pytest.mark.parametrize("family", ["vanilla", "ea", "pa", "ran"])
def test_normal_checkpoints_of_every_family_load(checkpoints, family, tiny_data_bin):
    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(checkpoints[family])], arg_overrides={"data": tiny_data_bin})
    state = safety.load_checkpoint(str(checkpoints[family]))
    assert all(torch.equal(v, models[0].state_dict()[k]) for k, v in state["model"].items())
