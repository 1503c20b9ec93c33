"""A newcomer's first hour, through the real entry points: what went on without a word now says
so, and what was refused for no reason is accepted.

* ``fairseq-generate`` decoding a checkpoint in another direction than it was trained for
  (a joint dictionary loads it either way) warns in one line, once, and still translates;
* validation BLEU (``--task translation_progress``) says how many sentences fairseq dropped
  for ``--required-batch-size-multiple``;
* ``fairseq-interactive --task translation_lines`` passes an empty line through as an empty
  translation (fairseq's ``translation`` makes words of it);
* ``train.sh`` does not train anew over another run's checkpoints where there is no
  ``checkpoint_last.pt`` to resume;
* ``ea-fairseq-average-checkpoints`` averages a checkpoint trained with
  ``--checkpoint-activations --amp`` with one trained without: the same model.
"""
import re
import subprocess

import pytest

from conftest import cli
from test_hub_interactive import interactive_session
from test_recipe_short_runs import env, train  # noqa: F401  (fixtures)
from test_valid_progress import BLEU, fairseq_train
from support.trained_checkpoints import ENV, USER_DIR, train_command, train_many

DECODE = ["--beam", "2", "--max-len-a", "0", "--max-len-b", "5", "--cpu", "--required-batch-size-multiple", "1"]
DIRECTION = "was trained to translate"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_data_bin):
    """Two tiny src->tgt checkpoints of one model, one trained with --checkpoint-activations
    and --amp (one fairseq-train process: two 3-update runs)."""
    root = tmp_path_factory.mktemp("traps")
    runs = {"plain": (), "activations": ("--checkpoint-activations", "--amp")}
    train_many(*(train_command(tiny_data_bin, "transformer_lite", root / name, "-s", "src", "-t", "tgt", *extra)
                 for name, extra in runs.items()))
    return {name: root / name / "checkpoint_last.pt" for name in runs}


def command(argv, stdin=None, cwd=None):
    proc = subprocess.run([cli(argv[0]), *map(str, argv[1:])], input=stdin, capture_output=True, text=True,
                          env=ENV, cwd=cwd, timeout=300)
    return proc.returncode, proc.stdout, proc.stderr


def test_decoding_another_direction_than_trained_warns_once(checkpoints, tiny_data_bin):
    ensemble = f"{checkpoints['plain']}:{checkpoints['activations']}"  # two src->tgt checkpoints, one load
    code, out, err = command(["fairseq-generate", tiny_data_bin, "--user-dir", USER_DIR, "--path", ensemble,
                              "-s", "tgt", "-t", "src", "--gen-subset", "test", *DECODE])
    assert code == 0 and "BLEU4 = " in out, err[-3000:]  # warned, not refused
    warned = [line for line in (out + err).splitlines() if DIRECTION in line]
    assert len(warned) == 1 and "WARNING" in warned[0], warned
    assert warned[0].endswith(f"{checkpoints['activations']} {DIRECTION} src->tgt (--source-lang src --target-lang "
                              "tgt) but this run translates tgt->src: its output is no tgt->src translation; give "
                              "-s src -t tgt, or a checkpoint trained for tgt->src"), warned
    # (the same direction is not warned of: test_interactive_passes_an_empty_line_through)


def test_validation_bleu_says_how_many_sentences_fairseq_dropped(tiny_data_bin, tmp_path, caplog, monkeypatch):
    # 40 tokens a validation batch: batches of fewer than 8 sentences, the last of them dropped
    lines = fairseq_train(tiny_data_bin, tmp_path, caplog, monkeypatch, *BLEU, "--max-update", "1",
                          "--max-tokens-valid", "40", "--required-batch-size-multiple", "8")
    said = re.fullmatch(r"\[valid BLEU\] 'valid': translating (\d+) of 40 sentences \((\d+) dropped by "
                        r"--required-batch-size-multiple 8: use --required-batch-size-multiple 1\) with beam 2 "
                        r"for BLEU; progress every 30 s \(--valid-progress-seconds\)", lines[0])
    assert said, lines
    kept, dropped = int(said[1]), int(said[2])
    assert kept + dropped == 40 and 0 < dropped < 8
    assert re.fullmatch(rf"\[valid BLEU\] 'valid': {kept}/{kept} sentences in \d+ s", lines[-1]), lines


def test_interactive_passes_an_empty_line_through(checkpoints, tiny_data_bin, monkeypatch, capsys):
    lines = ["s1 s2 s3", "", "   ", "s4 s5"]
    batched = ["--buffer-size", "4", "--batch-size", "4"]
    code, out, err = command(["fairseq-interactive", tiny_data_bin, "--user-dir", USER_DIR, "--task",
                              "translation_lines", "--path", checkpoints["plain"], "-s", "src", "-t", "tgt", *DECODE,
                              *batched], stdin="".join(line + "\n" for line in lines))
    assert code == 0, err[-3000:]
    assert DIRECTION not in out + err  # the direction it was trained for: no warning
    passed = dict(line.split("\t", 1) for line in re.findall(r"^[HD]-\d+\t.*$", out, flags=re.M))
    assert "input line 2: empty, passed through as an empty translation (score 0), as is every empty line of " \
           "this session" in err
    # negative control: fairseq's translation task makes words of them (in this process: the same decoding)
    theirs, _ = interactive_session(tiny_data_bin, checkpoints["plain"], lines, "--task", "translation", *DECODE,
                                    *batched, monkeypatch=monkeypatch, capsys=capsys)
    for i in (1, 2):  # the empty line and the line of spaces
        assert passed[f"H-{i}"] == passed[f"D-{i}"] == "0.0\t", passed
        assert theirs[i][0] != "", theirs
    for i in (0, 3):  # the other lines: fairseq's hypotheses
        assert passed[f"H-{i}"].split("\t")[1] == theirs[i][0], (passed, theirs)


def test_train_sh_does_not_train_over_another_runs_checkpoints(train):  # noqa: F811
    train(MAX_EPOCH="2")
    given = train.save.parent / "bin" / "given"  # what the stand-in fairseq-train was given last
    for name in ("checkpoint_best.pt", "checkpoint2.pt"):  # a run's checkpoints, no checkpoint_last.pt
        (train.save / name).write_bytes(b"")
    given.unlink()
    refused = train(check=False, MAX_EPOCH="2", LR="0.002")
    assert refused.returncode == 1 and not given.exists(), refused.stderr
    assert refused.stderr.splitlines()[-1] == (
        f"train.sh: error: not training in {train.save}: its checkpoints (checkpoint2.pt, checkpoint_best.pt) were "
        "trained with other settings (was: --lr 1e-3, now: --lr 0.002), and with no checkpoint_last.pt to resume "
        "fairseq-train would start anew and overwrite them; train into another directory (SAVE_DIR=...), or over "
        "them: ALLOW_CHANGED_SETTINGS=1")
    assert "--lr 1e-3" in (train.save / "train.settings").read_text()  # the record kept
    train(MAX_EPOCH="2")  # the same settings: trained as before
    assert given.exists()
    (train.save / "train.settings").unlink()  # checkpoints of no recorded settings
    refused = train(check=False, MAX_EPOCH="2")
    assert refused.returncode == 1 and "have no record of their settings" in refused.stderr.splitlines()[-1]
    asked = train(MAX_EPOCH="2", LR="0.002", ALLOW_CHANGED_SETTINGS="1")
    assert f"[train] ALLOW_CHANGED_SETTINGS=1: training anew in {train.save} over checkpoints" in asked.stderr
    for name in ("checkpoint_best.pt", "checkpoint2.pt"):
        (train.save / name).unlink()
    train(MAX_EPOCH="2", LR="0.003")  # a record alone (a run that saved nothing): nothing to overwrite


def test_averaging_accepts_checkpoints_that_differ_only_in_memory_or_precision_flags(checkpoints, tmp_path):
    code, out, err = command(["ea-fairseq-average-checkpoints", "--inputs", checkpoints["plain"],
                              checkpoints["activations"], "--output", tmp_path / "averaged.pt"], cwd=tmp_path)
    assert code == 0 and err.splitlines()[-1] == f"wrote {tmp_path / 'averaged.pt'}", err
