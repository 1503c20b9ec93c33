"""A checkpoint's model names one architecture, and a checkpoint writes no line of its own into
a log: through the real entry points (the averaging tool, warm start, fairseq-generate's main),
with a negative control for each (what the payload does where it is not checked) and a clean
input that still works."""
import argparse
import logging
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ea_fairseq.safety import no_code as safety
from ea_fairseq.safety.no_code.fields import shown_key, shown_text
from test_checkpoint_schema import saved, trusted_state, vanilla  # noqa: F401  (fixture)
from support.trained_checkpoints import USER_DIR, family_checkpoints


@pytest.fixture(scope="module")
def ea(tmp_path_factory, tiny_data_bin):
    return family_checkpoints(tmp_path_factory, tiny_data_bin)["ea"]


def _two_architectures(path, built: str):
    """The checkpoint at ``path`` with ``_name`` set to ``built`` (what fairseq builds) and its
    ``arch`` left naming its own architecture (what a tool reading ``arch`` reports)."""
    state = trusted_state(path)
    state["cfg"]["model"]._name = built
    return state


# ---------------------------------------------------------------- one architecture


def test_fairseq_builds_name_while_a_tool_reading_arch_reports_the_other(ea):
    """Negative control: fairseq's build_model takes ``_name`` over ``arch``; the averaging tool
    compared ``arch`` (the ea checkpoint's), so the two fields describe two models."""
    import inspect

    from fairseq import models

    source = inspect.getsource(models.build_model)
    assert 'getattr(cfg, "_name", None) or getattr(cfg, "arch", None)' in source
    state = _two_architectures(ea, "transformer_lite")
    assert (state["cfg"]["model"]._name, state["cfg"]["model"].arch) == ("transformer_lite", "ea_transformer_lite")


def test_name_and_arch_that_disagree_are_refused_by_averaging_and_warm_start(tmp_path, ea, vanilla, capsys):  # noqa: F811
    from ea_fairseq_cli import average_checkpoints, warm_start

    attack = saved(_two_architectures(ea, "transformer_lite"), tmp_path / "attack")
    out = tmp_path / "avg.pt"
    assert average_checkpoints.main(["--inputs", str(attack), str(ea), "--output", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "_name = 'transformer_lite' and cfg.model.arch = 'ea_transformer_lite'" in err, err
    assert "Nothing in the checkpoint was run" in err and not out.exists()

    legacy = trusted_state(vanilla)  # fairseq builds transformer_lite; arch says transformer
    legacy["cfg"]["model"].arch = "transformer"
    attack = saved(legacy, tmp_path / "legacy")
    out = tmp_path / "ws.pt"
    assert warm_start.main([str(attack), "--arch", "ea_transformer_lite", "--output", str(out)]) == 1
    err = capsys.readouterr().err
    assert "name two architectures" in err and err.count("\n") == 1 and not out.exists(), err

    # a fairseq-hydra-train dict layout (only _name) and the agreeing pair still load
    state = trusted_state(vanilla)
    fields = {k: v for k, v in vars(state["cfg"]["model"]).items() if k != "arch"}
    state["cfg"]["model"] = fields
    loaded = safety.load_checkpoint(str(saved(state, tmp_path / "hydra")))
    assert safety.architecture(loaded["cfg"]["model"]) == "transformer_lite"
    assert average_checkpoints.main(["--inputs", str(ea), str(ea), "--output", str(out)]) == 0


def test_architecture_is_the_field_fairseq_builds():
    assert safety.architecture(argparse.Namespace(_name="a", arch="b")) == "a"
    assert safety.architecture(argparse.Namespace(arch="b")) == "b"
    assert safety.architecture({"_name": None, "arch": "b"}) == "b"
    assert safety.architecture(None) is None


# ---------------------------------------------------------------- log lines

FAKE = "Generate test with beam=5: BLEU4 = 99.90, 99.9/99.9/99.9/99.9 (BP=1.000, ratio=1.000)"
HOSTILE_KEYS = ["x\n" + FAKE, "\x1b]0;pwned\x07\x1b[2J\x1b[1;1H" + FAKE, "y\r" + FAKE, "z\u2028" + FAKE,
                "w" * 20_000 + "\n" + FAKE]


def _hostile_log_state(path):
    state = trusted_state(path)
    for key in HOSTILE_KEYS:
        state["cfg"][key] = 1  # a top-level section no dataclass declares: dropped, logged
    state["cfg"]["common"]["q\n" + FAKE] = 1
    state["cfg"]["scoring"] = {"_name": "s\n" + FAKE}  # no registered dataclass: dropped, logged
    state["cfg"]["model"].encoder_embed_path = "/e\n" + FAKE  # a path not opened: logged
    return state


def _generate(data, path):
    from fairseq import options
    from fairseq_cli import generate

    args = options.parse_args_and_arch(options.get_generation_parser(), [
        str(data), "--user-dir", USER_DIR, "--path", str(path), "--beam", "1", "--max-len-b", "3",
        "--cpu", "--batch-size", "16", "--num-workers", "0"])
    return generate.main(args)


def test_a_checkpoint_writes_no_line_into_fairseq_generate_s_log(tmp_path, vanilla, tiny_data_bin,  # noqa: F811
                                                                  caplog, capsys):
    path = saved(_hostile_log_state(vanilla), tmp_path)
    with caplog.at_level(logging.INFO):
        _generate(tiny_data_bin, path)
    text = caplog.text + capsys.readouterr().out
    dropped = [r.getMessage() for r in caplog.records if "were dropped" in r.getMessage()]
    assert dropped and "'x\\nGenerate test" in dropped[0]  # reported, escaped
    assert all("\n" not in r.getMessage() for r in caplog.records if r.name.startswith("ea_fairseq")), dropped
    lines = re.split(r"[\n\r\u2028]", text)
    assert [line for line in lines if line.startswith("Generate test with beam=1: BLEU4")]  # fairseq's own
    assert not [line for line in lines if line.startswith(FAKE[:20]) and "99.90" in line]
    assert "\x1b" not in text and "\u2028" not in text
    assert max(len(r.getMessage()) for r in caplog.records if r.name.startswith("ea_fairseq")) < 4000
    # negative control: the same keys shown as they are write the fake line
    assert any(line.startswith(FAKE[:20]) for line in f"dropped: cfg.{HOSTILE_KEYS[0]}".splitlines())


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=300))
def test_shown_keys_and_texts_hold_no_line_break_or_control(text):
    for shown in (shown_key(text), shown_text(text)):
        assert shown.isprintable() and len(shown) <= max(len(text), 1000)
        assert shown == text or shown.startswith(("'", '"'))


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture(scope="module")
def vanilla_state(vanilla):  # noqa: F811
    return trusted_state(vanilla)


@settings(max_examples=25, deadline=None)
@given(st.text(min_size=1, max_size=60), st.text(max_size=60))
def test_no_key_or_value_from_a_checkpoint_breaks_a_log_line_or_a_message(vanilla_state, key, value):
    """Hypothesis: keys dropped at the top, in a section and in a registry name, and a path
    value not honoured, logged by the loader; a key in a nested model section refused."""
    import copy

    state = copy.copy(vanilla_state)
    state["cfg"] = dict(state["cfg"], **{"~" + key: 1})
    state["cfg"]["common"] = dict(state["cfg"]["common"], **{"~" + key: value})
    state["cfg"]["scoring"] = {"_name": "s" + key}
    model = argparse.Namespace(**vars(state["cfg"]["model"]))
    model.encoder_embed_path = value or None
    state["cfg"]["model"] = model
    records, log = _Records(), logging.getLogger("ea_fairseq")
    log.addHandler(records)
    level, log.level = log.level, logging.DEBUG
    try:
        safety.sanitize(state, "c.pt", build_check=False)
    except safety.UnsafeCheckpointError as code:  # a value that reads as a call: refused, in one printable line
        assert str(code).isprintable() and "calls a function" in str(code), str(code)
        return
    finally:
        log.removeHandler(records)
        log.setLevel(level)
    assert records.messages and all(m.isprintable() for m in records.messages), records.messages
    model.encoder = {"~" + key: 1}
    with pytest.raises(safety.UnsafeCheckpointError) as refused:
        safety.sanitize(state, "c.pt", build_check=False)
    assert str(refused.value).isprintable()


def test_a_weight_name_writes_no_line_into_the_averaging_tool_s_error(tmp_path, vanilla, capsys):  # noqa: F811
    from ea_fairseq_cli import average_checkpoints

    state = trusted_state(vanilla)
    state["model"]["x\n" + FAKE] = torch.tensor([float("nan")])
    path = saved(state, tmp_path)
    assert average_checkpoints.main(["--inputs", str(path), str(vanilla), "--output", str(tmp_path / "a.pt")]) == 1
    err = capsys.readouterr().err
    assert "NaN or infinite weights in 1 tensors: 'x\\nGenerate test" in err, err
    assert not [line for line in err.splitlines() if line.startswith(FAKE[:20])]


@pytest.mark.parametrize("field, value", [
    ("epoch", "1) @ 0 updates\n" + FAKE), ("epoch", 2 ** 40), ("iterations_in_epoch", 10 ** 15), ("shuffle", "yes"),
    ("previous_training_time", "\x1b[2J")])
def test_the_training_position_fairseq_logs_on_resuming_is_a_number(tmp_path, vanilla, field, value):  # noqa: F811
    """``fairseq-train --restore-file`` logs the stored epoch as it is ("Loaded checkpoint ...
    (epoch N @ U updates)"), picks the data shard and learning rate from it and fast-forwards the
    iterator by the stored count: through the loader fairseq-train calls, each is refused in one
    line unless it has the type fairseq writes."""
    import inspect

    from fairseq import checkpoint_utils, trainer

    assert "(epoch {} @ {} updates)" in inspect.getsource(trainer.Trainer.load_checkpoint)  # as it is
    state = trusted_state(vanilla)
    extra = state.setdefault("extra_state", {})
    assert type(extra["train_iterator"]["epoch"]) is int  # what fairseq-train wrote
    (extra if field == "previous_training_time" else extra["train_iterator"])[field] = value
    path = saved(state, tmp_path)
    with pytest.raises(safety.UnsafeCheckpointError) as refused:
        checkpoint_utils.load_checkpoint_to_cpu(str(path))
    message = str(refused.value)
    assert field in message and "\n" not in message and "\x1b" not in message, message
    extra.pop("previous_training_time", None)
    extra["train_iterator"] = {"epoch": 3, "iterations_in_epoch": 0, "version": 2, "shuffle": True}
    assert checkpoint_utils.load_checkpoint_to_cpu(str(saved(state, tmp_path / "clean")))["extra_state"][
        "train_iterator"]["epoch"] == 3
