"""ea-fairseq-average-checkpoints on real fairseq-train checkpoints: inputs of another model
(arch, any option: heads, activation, normalisation, dropout) or other data (recorded data
directory, languages; dictionaries' checksums with --data-dirs) are refused with one line
naming the difference, even where every weight has the same shape; the output never goes
through a planted link."""
import hashlib
import os
import shutil
import subprocess

import pytest
import torch

from ea_fairseq_cli import average_checkpoints as avg
from test_average_checkpoints import BIN
from support.trained_checkpoints import ENV, family_checkpoints


@pytest.fixture(scope="module")
def vanilla(tmp_path_factory, tiny_data_bin):
    return family_checkpoints(tmp_path_factory, tiny_data_bin)["vanilla"]


def variant(vanilla, path, model=None, task=None, seed=0, legacy=False):
    """A copy of ``vanilla`` with other weights and the given configuration changes (with
    ``legacy``, in the layout of fairseq before hydra: ``args`` and no ``cfg``)."""
    state = torch.load(vanilla, weights_only=False)  # a file the tests wrote
    g = torch.Generator().manual_seed(seed)
    for key, value in state["model"].items():
        if value.is_floating_point():
            state["model"][key] = value + 0.01 * torch.randn(value.shape, generator=g, dtype=value.dtype)
    for name, value in (model or {}).items():
        setattr(state["cfg"]["model"], name, value)
    state["cfg"]["task"].update(task or {})
    if legacy:  # the full Namespace of fairseq-train's options, task ones included
        state["args"], state["cfg"] = state["cfg"]["model"], None
        for name, value in (task or {}).items():
            setattr(state["args"], name, value)
    torch.save(state, path)
    return path


def sha(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


MODEL_CHANGES = {  # every one keeps every weight's shape
    "activation": ({"activation_fn": "gelu"}, "--activation-fn is 'gelu' there, 'relu' in"),
    "heads": ({"encoder_attention_heads": 2}, "--encoder-attention-heads is 2 there, 4 in"),
    "pre-norm": ({"decoder_normalize_before": True}, "--decoder-normalize-before is True there, False in"),
    "dropout": ({"attention_dropout": 0.3}, "--attention-dropout is 0.3 there, 0.0 in"),
    "arch": ({"arch": "transformer_iwslt_de_en", "_name": "transformer_iwslt_de_en"}, "--arch is 'transformer_iwslt_de_en' there, 'transformer_lite' in"),
}


@pytest.mark.parametrize("legacy", [False, True], ids=["cfg", "legacy-args"])
@pytest.mark.parametrize("change", sorted(MODEL_CHANGES))
def test_another_model_of_the_same_shapes_is_refused(tmp_path, vanilla, change, legacy, capsys):
    fields, shown = MODEL_CHANGES[change]
    a = variant(vanilla, tmp_path / "a.pt", seed=1, legacy=legacy)
    b = variant(vanilla, tmp_path / "b.pt", model=fields, seed=2, legacy=legacy)
    assert avg.main(["--inputs", str(a), str(b), "--output", str(tmp_path / "avg.pt")]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (f"average_checkpoints: error: {b} holds another model than {a}: {shown} {a}; "
                   "average checkpoints of one model")
    assert sorted(os.listdir(tmp_path)) == ["a.pt", "b.pt"]


def test_an_option_left_to_the_arch_default_is_the_same_model(tmp_path, vanilla):
    """The comparison is of the configuration fairseq builds (the arch fills its defaults)."""
    a = variant(vanilla, tmp_path / "a.pt", seed=1)
    state = torch.load(variant(vanilla, tmp_path / "b.pt", seed=2), weights_only=False)
    assert state["cfg"]["model"].activation_fn == "relu"
    del state["cfg"]["model"].activation_fn  # transformer_lite's default
    torch.save(state, tmp_path / "b.pt")
    assert avg.main(["--inputs", str(a), str(tmp_path / "b.pt"), "--output", str(tmp_path / "avg.pt")]) == 0


def dictionaries(directory, source, swap=False):
    os.makedirs(directory)
    for name in ("dict.src.txt", "dict.tgt.txt"):
        lines = open(os.path.join(source, name)).read().splitlines(True)
        if swap and name == "dict.src.txt":
            lines[0], lines[1] = lines[1], lines[0]  # same size, other ids
        open(os.path.join(directory, name), "w").writelines(lines)
    return str(directory)


def test_the_legacy_layout_records_the_same_task_and_data(tmp_path, vanilla):
    from ea_fairseq.tools.average_inputs import data_record

    state = torch.load(vanilla, weights_only=False)
    legacy = torch.load(variant(vanilla, tmp_path / "l.pt", legacy=True), weights_only=False)
    assert data_record(legacy) == data_record(state) and data_record(state)["task"] == "translation"


@pytest.mark.parametrize("legacy", [False, True], ids=["cfg", "legacy-args"])
def test_other_data_is_refused_unless_the_dictionaries_are_shown_equal(tmp_path, vanilla, tiny_data_bin, capsys,
                                                                      legacy):
    a = variant(vanilla, tmp_path / "a.pt", seed=1, legacy=legacy)
    b = variant(vanilla, tmp_path / "b.pt", task={"data": "/elsewhere/bin"}, seed=2, legacy=legacy)
    out = tmp_path / "avg.pt"
    assert avg.main(["--inputs", str(a), str(b), "--output", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"{b} holds a model trained on other data than {a}: --data is '/elsewhere/bin' there" in err
    assert "name each input's with --data-dirs" in err and not out.exists()

    same, other = dictionaries(tmp_path / "same", tiny_data_bin), dictionaries(tmp_path / "other", tiny_data_bin, True)
    assert avg.main(["--inputs", str(a), str(b), "--output", str(out), "--data-dirs", tiny_data_bin, same]) == 0
    out.unlink()
    assert avg.main(["--inputs", str(a), str(b), "--output", str(out), "--data-dirs", tiny_data_bin, other]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (f"average_checkpoints: error: {b} was trained with other dictionaries than {a}: dict.src.txt "
                   f"differ between {other} and {tiny_data_bin}; average checkpoints of one model")
    assert not out.exists()
    fifo_dir = dictionaries(tmp_path / "fifo", tiny_data_bin)
    os.unlink(os.path.join(fifo_dir, "dict.src.txt"))
    os.mkfifo(os.path.join(fifo_dir, "dict.src.txt"))  # would hang a plain read
    assert avg.main(["--inputs", str(a), str(b), "--output", str(out), "--data-dirs", tiny_data_bin, fifo_dir]) == 1
    assert "not a regular dictionary file" in capsys.readouterr().err

    c = variant(vanilla, tmp_path / "c.pt", task={"source_lang": "de"}, seed=3, legacy=legacy)
    assert avg.main(["--inputs", str(a), str(c), "--output", str(out), "--data-dirs", tiny_data_bin, same]) == 1
    assert "--source-lang is 'de' there, None in" in capsys.readouterr().err


def test_console_tool_writes_through_no_planted_link(tmp_path, vanilla):
    a = variant(vanilla, tmp_path / "a.pt", seed=1)
    b = variant(vanilla, tmp_path / "b.pt", seed=2)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    out = tmp_path / "avg.pt"
    os.symlink(a, str(out) + ".tmp")  # the name the old writer used, pointing at an input
    os.symlink(victim, str(out))  # and the output name itself, pointing outside
    digests = {p: sha(p) for p in (a, b)}
    proc = subprocess.run([str(BIN / "ea-fairseq-average-checkpoints"), "--inputs", str(a), str(b),
                           "--output", str(out)], capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert {p: sha(p) for p in (a, b)} == digests and victim.read_text() == "keep"
    assert os.readlink(str(out) + ".tmp") == str(a)
    assert not out.is_symlink() and torch.load(out, weights_only=False)["model"]
    umask = os.umask(0o022)
    os.umask(umask)
    assert os.stat(out).st_mode & 0o777 == 0o666 & ~umask  # as a plain open() makes it
    assert sorted(os.listdir(tmp_path)) == ["a.pt", "avg.pt", "avg.pt.tmp", "b.pt", "victim.txt"]

    # the same tool refuses another model in one line
    c = variant(vanilla, tmp_path / "c.pt", model={"activation_fn": "gelu"}, seed=3)
    proc = subprocess.run([str(BIN / "ea-fairseq-average-checkpoints"), "--inputs", str(a), str(c),
                           "--output", str(tmp_path / "no.pt")], capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1].startswith(
        f"average_checkpoints: error: {c} holds another model than {a}: --activation-fn is 'gelu'")
    assert not (tmp_path / "no.pt").exists()


def test_an_output_that_cannot_be_written_is_one_line(tmp_path, vanilla, capsys):
    a = variant(vanilla, tmp_path / "a.pt", seed=1)
    (tmp_path / "dir.pt").mkdir()
    assert avg.main(["--inputs", str(a), str(a), "--output", str(tmp_path / "dir.pt")]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"average_checkpoints: error: --output {tmp_path / 'dir.pt'}: Is a directory")
    assert sorted(os.listdir(tmp_path)) == ["a.pt", "dir.pt"]  # no temporary file left


def test_negative_control_a_plain_save_follows_the_planted_link(tmp_path, vanilla):
    """What writing to OUTPUT.tmp by name does: the input it points at is overwritten."""
    a = tmp_path / "a.pt"
    shutil.copy(vanilla, a)
    before = sha(a)
    os.symlink(a, tmp_path / "avg.pt.tmp")
    torch.save({"model": {}}, str(tmp_path / "avg.pt") + ".tmp")
    assert sha(a) != before


@pytest.mark.parametrize("first, second", [(None, "dot_product"), ("vanilla", "dot_product"), (None, "vanilla")])
def test_a_ran_decoders_encoder_decoder_attention_on_either_path_is_the_same_model(tmp_path, first, second, capsys):
    """A RAN-D checkpoint that names no --cross-attention (written before the option's
    default was the plugin's path) builds the plugin's dot-product attention; one that names
    fairseq's module (vanilla) has the same parameters and computes the same attention: a
    run resumed across versions averages its epochs. Another attention is refused."""
    from test_checkpoint_fixtures import FIXTURES

    paths = []
    for name, value in (("a", first), ("b", second), ("c", "ea")):
        state = torch.load(os.path.join(FIXTURES, "ran_d", "checkpoint.pt"), weights_only=False)
        if value is None:
            del state["cfg"]["model"].cross_attention
        else:
            state["cfg"]["model"].cross_attention = value
        paths.append(str(tmp_path / f"{name}.pt"))
        torch.save(state, paths[-1])
    assert avg.main(["--inputs", *paths[:2], "--output", str(tmp_path / "avg.pt")]) == 0, capsys.readouterr().err
    assert avg.main(["--inputs", paths[0], paths[2], "--output", str(tmp_path / "other.pt")]) == 1
    assert "--cross-attention is 'ea' there" in capsys.readouterr().err
