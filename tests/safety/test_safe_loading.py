"""A checkpoint cannot run code: crafted checkpoints are refused by every loading path
(fairseq-generate, fairseq-interactive, the hub, --restore-file, averaging, the analysis
tool, warm start) before fairseq converts or evaluates anything, nothing is executed, and
the message names the field; damaged files are reported as such; normal checkpoints of
every family the plugin vouches for still load.

This file: every entry point refuses every attack (checkpoint_attacks.py), the messages, the
allow-list's scope, the plugin's option errors; what does load is in
test_safe_loading_what_loads.py, the property over any configuration in
test_safe_loading_properties.py, numpy values in test_safe_loading_numpy.py."""
import argparse
import time

import pytest
import torch
from fairseq import checkpoint_utils, tasks
from fairseq.models.transformer import TransformerModel

from support.checkpoint_attacks import ATTACKS, checkpoints, crafted, trusted_state, unguarded_load  # noqa: F401  (fixture)
from conftest import cli
from ea_fairseq.safety import no_code as safety
from ea_fairseq_cli import average_checkpoints as avg
from support.trained_checkpoints import USER_DIR, run, train_command


@pytest.mark.parametrize("attack", ["bytes-in-fconv", "code-in-evaluated-field", "oc.create-section",
                                    "yaml-configuration"])
def test_the_payloads_are_live_without_the_guard(tmp_path, checkpoints, attack):
    """Negative control: unguarded, fairseq's loading runs the payload (so the tests below,
    which check that the file is never created, can fail)."""
    marker = tmp_path / "pwned"
    path = crafted(checkpoints["vanilla"], tmp_path / "c.pt", attack, marker)
    state = unguarded_load(path)
    with pytest.raises(Exception):  # eval ran; what it returned does not build a model
        checkpoint_utils.load_model_ensemble_and_task([str(path)], state=state)
    assert marker.exists()


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_every_attack_is_refused_by_the_hub_and_the_plugins_loader(tmp_path, checkpoints, tiny_data_bin, attack):
    """The hub (``from_pretrained``: fairseq's loader, as generate, interactive, --restore-file
    and the analysis tool use it) and the plugin's loader (averaging, warm start)."""
    marker = tmp_path / "pwned"
    path = crafted(checkpoints["vanilla"], tmp_path / "c.pt", attack, marker)
    shown = ATTACKS[attack][1]
    start = time.perf_counter()
    with pytest.raises(safety.UnsafeCheckpointError) as refusal:
        TransformerModel.from_pretrained(str(tmp_path), checkpoint_file="c.pt",
                                         data_name_or_path=tiny_data_bin, user_dir=USER_DIR)
    assert shown in str(refusal.value) and "Nothing in" in str(refusal.value)
    with pytest.raises(safety.UnsafeCheckpointError) as refusal:
        safety.load_checkpoint(str(path))
    assert shown in str(refusal.value)
    assert time.perf_counter() - start < 10  # (the 2^40 walk would take days)
    assert not marker.exists()


def test_fairseq_generate_refuses(tmp_path, tiny_data_bin, checkpoints):
    marker = tmp_path / "pwned"
    path = crafted(checkpoints["vanilla"], tmp_path / "c.pt", "bytes-in-fconv", marker)
    code, out = run([cli("fairseq-generate"), tiny_data_bin, "--user-dir", USER_DIR, "--path", path,
                     "--beam", "2", "--cpu", "--max-len-b", "5"], expect_ok=False, cwd=tmp_path)
    assert code != 0 and ATTACKS["bytes-in-fconv"][1] in out, out[-3000:]
    assert not marker.exists()


def test_fairseq_interactive_refuses(tmp_path, tiny_data_bin, checkpoints):
    marker = tmp_path / "pwned"
    path = crafted(checkpoints["vanilla"], tmp_path / "c.pt", "oc.create-section", marker)
    code, out = run([cli("fairseq-interactive"), tiny_data_bin, "--user-dir", USER_DIR, "--path", path,
                     "--task", "translation_lines", "--cpu", "--source-lang", "src", "--target-lang", "tgt"],
                    expect_ok=False, cwd=tmp_path, input="s1 s2\n")
    assert code != 0 and ATTACKS["oc.create-section"][1] in out, out[-3000:]
    assert not marker.exists()


def test_restore_file_refuses(tmp_path, tiny_data_bin, checkpoints):
    marker = tmp_path / "pwned"
    path = crafted(checkpoints["vanilla"], tmp_path / "c.pt", "code-in-optimizer-field", marker)
    code, out = run(train_command(tiny_data_bin, "transformer_lite", tmp_path / "save", "--restore-file", path),
                    expect_ok=False, cwd=tmp_path)
    assert code != 0 and ATTACKS["code-in-optimizer-field"][1] in out, out[-3000:]
    assert not marker.exists()


@pytest.mark.parametrize("attack", ["oc.create-section", "stride-0-tensor"])
def test_averaging_refuses_and_writes_nothing(tmp_path, checkpoints, attack, capsys):
    marker = tmp_path / "pwned"
    path = crafted(checkpoints["vanilla"], tmp_path / "c.pt", attack, marker)
    out = tmp_path / "avg.pt"
    for inputs in ([checkpoints["vanilla"], path], [path, checkpoints["vanilla"]]):
        assert avg.main(["--inputs", *map(str, inputs), "--output", str(out)]) == 1
        assert ATTACKS[attack][1] in capsys.readouterr().err
    assert not out.exists() and not marker.exists()


def test_analysis_refuses(tmp_path, tiny_data_bin, checkpoints):
    from ea_fairseq_cli.analysis import main

    marker = tmp_path / "pwned"
    path = crafted(checkpoints["vanilla"], tmp_path / "c.pt", "bytes-in-fconv", marker)
    with pytest.raises(SystemExit) as exit_:
        main(["dump", str(path), "--data", tiny_data_bin, "--out", str(tmp_path / "d.npz")])
    assert ATTACKS["bytes-in-fconv"][1] in str(exit_.value.code)
    assert not marker.exists()


def test_warm_start_refuses(tmp_path, checkpoints, capsys):
    from ea_fairseq_cli.warm_start import main

    marker = tmp_path / "pwned"
    path = crafted(checkpoints["vanilla"], tmp_path / "c.pt", "code-in-evaluated-field", marker)
    assert main([str(path), "--arch", "ea_transformer_lite", "--output", str(tmp_path / "w.pt")]) == 1
    assert ATTACKS["code-in-evaluated-field"][1] in capsys.readouterr().err
    assert not (tmp_path / "w.pt").exists() and not marker.exists()


@pytest.mark.parametrize("field,value,why", [
    ("adaptive_softmax_cutoff", "[1000, 'x']", "the text 'x' where fairseq declares int"),
    ("adaptive_softmax_cutoff", "[0] * 1000000000", "more than 100000 items"),
    ("adaptive_softmax_cutoff", "(lambda: 1)()", "function call"),
    ("adaptive_softmax_cutoff", "{1, 2}", "a set"),
    ("adam_betas", "().__class__", "attribute access"),
    ("adam_betas", "(0.9, 1e999)", "not a number or a list of numbers"),  # repr(inf) is not a literal
    ("encoder_xformers_att_config", "{**{}}", "unpacks a dict"),
    ("left_pad_source", "__debug__", "the text '__debug__' where fairseq declares bool"),
    ("encoder_layers", "'\\x24{common.user_dir}'", "where fairseq declares int"),
])
def test_errors_say_what_is_wrong(field, value, why):
    """Each value is refused in the section where fairseq reads it."""
    section = {"adam_betas": "optimizer", "left_pad_source": "task"}.get(field, "model")
    named = {"model": {"arch": "transformer"}, "optimizer": {"_name": "adam"}, "task": {"_name": "translation"}}
    state = {"cfg": {section: dict(named[section], **{field: value})}}
    state["cfg"]["model"] = argparse.Namespace(**state["cfg"].get("model", named["model"]))
    with pytest.raises(safety.UnsafeCheckpointError, match=why.replace("(", r"\(")):
        safety.sanitize(state, "x.pt")


def test_an_xformers_configuration_is_fairseqs_to_accept():
    """A dict literal in an xFormers field is handed over: fairseq's own MultiheadAttention uses
    it where xFormers is installed (and says it is missing where not); the plugin's own
    attentions refuse it when they are built."""
    model = argparse.Namespace(arch="transformer", encoder_xformers_att_config="{'name': 'scaled_dot_product'}")
    out = safety.sanitize({"cfg": {"model": model}}, "x.pt")
    assert out["cfg"]["model"].encoder_xformers_att_config == "{'name': 'scaled_dot_product'}"


def test_evaluated_fields_are_handed_over_as_typed_values_or_text_written_from_their_literal(
        tmp_path, checkpoints, tiny_data_bin, monkeypatch):
    """fairseq receives the parsed literal converted to the field's declared type (a list of
    ints), or ``repr()`` of it where fairseq declares text (``adam_betas``), never the
    checkpoint's string."""
    # the vanilla weights have no adaptive softmax, which the model check refuses
    # (test_checkpoint_inputs); here only the handed-over values are looked at
    from ea_fairseq.safety.no_code import hook
    monkeypatch.setattr(hook, "check_model_matches", lambda cfg, weights, source: None)
    state = trusted_state(checkpoints["vanilla"])
    state["cfg"]["model"].adaptive_softmax_cutoff = " [10] + [5 * 4]"
    state["cfg"]["optimizer"]["adam_betas"] = "(0.9, 0.98)"
    torch.save(state, tmp_path / "c.pt")
    loaded = checkpoint_utils.load_checkpoint_to_cpu(str(tmp_path / "c.pt"), arg_overrides={"data": tiny_data_bin})
    assert list(loaded["cfg"].model.adaptive_softmax_cutoff) == [10, 20]  # fairseq's declared List[int]
    assert loaded["cfg"].optimizer.adam_betas == "(0.9, 0.98)"
    model = tasks.setup_task(loaded["cfg"].task).build_model(loaded["cfg"].model)
    assert model.decoder.adaptive_softmax.cutoff[:2] == [10, 20]

def test_allow_list_is_scoped_to_checkpoint_loads(checkpoints):
    checkpoint_utils.load_checkpoint_to_cpu(str(checkpoints["vanilla"]))
    assert argparse.Namespace not in torch.serialization.get_safe_globals()
    with pytest.raises(Exception, match="(?i)weights.only"):  # plain torch.load is untouched
        torch.load(checkpoints["vanilla"], weights_only=True)


def test_fairseq_reads_the_file_once(tmp_path, checkpoints, monkeypatch):
    """fairseq's conversions run on the sanitized state: the file is not read a second time."""
    reads = []
    real = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: reads.append(a) or real(*a, **k))
    checkpoint_utils.load_checkpoint_to_cpu(str(checkpoints["vanilla"]))
    assert len(reads) == 1

# -- the plugin's option errors on fairseq's command line ---------------------------------
@pytest.mark.parametrize("extra,message", [
    (["--arch", "ea_transformer_lite", "--ea-alpha", "-1"], "--ea-alpha must lie in [0, 1], got -1.0"),
    (["--arch", "ea_transformer_lite", "--drop-attention", "element", "--drop-attention-p", "1.5"],
     "--drop-attention-p must lie in [0, 1), got 1.5"),
    (["--arch", "transformer_lite", "--drop-attention-p", "0.2"], "--drop-attention-p given without --drop-attention"),
])
def test_option_errors_are_raised_as_option_errors(extra, message):
    """Refused when the model is built, whatever brought the value (command line, hydra,
    a checkpoint): the class the command line prints as one line."""
    from conftest import build_model
    from ea_fairseq.errors import OptionError

    with pytest.raises(OptionError) as err:
        build_model(extra[1], *extra[2:])
    assert message in str(err.value)


def test_option_error_on_the_command_line_is_one_line(tmp_path, tiny_data_bin):
    code, out = run(train_command(tiny_data_bin, "ea_transformer_lite", tmp_path, "--ea-alpha", "-1"),
                    expect_ok=False, cwd=tmp_path)
    assert code == 1 and "Traceback" not in out, out[-3000:]
    assert out.strip().splitlines()[-1] == "fairseq-train: error: --ea-alpha must lie in [0, 1], got -1.0"


def test_ran_overlong_line_with_fairseqs_translation_task_names_the_options(tiny_data_bin, checkpoints):
    """fairseq's own refusal of the line, with a note naming the limit and the way on."""
    code, out = run([cli("fairseq-interactive"), tiny_data_bin, "--user-dir", USER_DIR, "--path", checkpoints["ran"],
                     "--cpu", "--source-lang", "src", "--target-lang", "tgt", "--beam", "2"],
                    expect_ok=False, input=" ".join(["s4"] * 30) + "\n")
    assert code != 0 and "Size of sample #0 is invalid" in out, out[-3000:]
    assert "at most --ran-max-positions 16 tokens" in out and "--task translation_lines" in out
