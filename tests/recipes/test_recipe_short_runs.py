"""The recipes on short runs and on a quiet terminal, with stand-ins for fairseq's programs (each
test is a few bash runs): evaluate.sh averages what a short run has and refuses a mistyped
folder without making it; train.sh resumes a run whose budget alone grows, keeps fairseq's
configuration and model dump in train.log, and trains EVAL_BLEU=1 runs with the task that reports
validation's progress."""
import os
import stat

import pytest

from test_recipes import RECIPES, env, run  # noqa: F401  (fixture)

# fairseq-train as the terminal sees it: its configuration, the model's structure, a
# validation with BLEU; what it is given is written beside it
FAKE_TRAIN = """#!/usr/bin/env bash
echo "$*" > "$(dirname "$0")/given"
echo "2026-01-01 00:00:00 | INFO | fairseq_cli.train | {'_name': None, 'common': {'_name': None}}"
echo "2026-01-01 00:00:00 | INFO | fairseq_cli.train | EATransformerModel("
echo "  (encoder): EATransformerEncoder("
echo "  )"
echo ")"
echo "2026-01-01 00:00:01 | INFO | fairseq_cli.train | num. shared model params: 2,501,864"
echo "2026-01-01 00:00:02 | INFO | fairseq.tasks.fairseq_task | can_reuse_epoch_itr = True"
echo "2026-01-01 00:00:02 | INFO | fairseq.tasks.fairseq_task | creating new batches for epoch 1"
echo "2026-01-01 00:00:02 | INFO | fairseq_cli.train | begin validation on \\"valid\\" subset"
echo "2026-01-01 00:00:09 | INFO | ea_fairseq.tasks.translation_progress | [valid BLEU] 'valid': 40/40 sentences in 7 s"
echo "2026-01-01 00:00:09 | INFO | valid | epoch 001 | valid on 'valid' subset | loss 7.4 | bleu 0.07"
"""


def fake_data(root):
    """A data directory train.sh accepts: dictionaries, the training split's index, and a
    validation index of 40 sentences (fairseq's mmap header: the count at byte 18)."""
    data = root / "data"
    data.mkdir()
    for name in ("train.xx-yy.xx.idx", "train.xx-yy.yy.idx", "dict.xx.txt", "dict.yy.txt"):
        (data / name).write_text("a 1\n")
    (data / "valid.xx-yy.xx.idx").write_bytes(b"MMIDIDX\x00\x00" + bytes(9) + (40).to_bytes(8, "little"))
    return data


@pytest.fixture
def train(env, tmp_path):  # noqa: F811
    """train.sh ea_lite own on the CPU with the fake fairseq-train: (env vars) -> process."""
    data, save = fake_data(tmp_path), tmp_path / "save"
    stub = tmp_path / "bin" / "fairseq-train"
    stub.parent.mkdir()
    stub.write_text(FAKE_TRAIN)
    stub.chmod(stub.stat().st_mode | stat.S_IXUSR)
    base = dict(env, CPU="1", FAIRSEQ_TRAIN=str(stub), DATA=str(data), SAVE_DIR=str(save))

    def go(check=True, **variables):
        return run(["bash", RECIPES / "train.sh", "ea_lite", "own"], dict(base, **variables), tmp_path, check=check)
    go.save, go.base = save, base
    return go


def test_train_keeps_the_config_in_its_log_and_validation_bleu_reports_progress(train):
    proc = train(EVAL_BLEU="1", MAX_EPOCH="1")
    out = proc.stdout
    assert "{'_name'" not in out and "EATransformerModel(" not in out and "(encoder)" not in out
    assert "can_reuse_epoch_itr" not in out and "creating new batches" not in out
    assert out.splitlines()[0] == (f"[train] fairseq's configuration and the model's structure: in {train.save}/"
                                   "train.log (SHOW_CONFIG=1 shows them here)")
    assert "num. shared model params" in out and "[valid BLEU] 'valid': 40/40 sentences in 7 s" in out
    given = (train.save.parent / "bin" / "given").read_text().split()
    assert given[given.index("--task") + 1] == "translation_progress"  # (the plugin's task logs the progress)
    shown = train(EVAL_BLEU="1", MAX_EPOCH="1", SHOW_CONFIG="1", ALLOW_CHANGED_SETTINGS="1").stdout
    assert "{'_name'" in shown and "  (encoder): EATransformerEncoder(" in shown and "can_reuse_epoch_itr" in shown
    train(MAX_EPOCH="1", ALLOW_CHANGED_SETTINGS="1")
    given = (train.save.parent / "bin" / "given").read_text().split()
    assert given[given.index("--task") + 1] == "translation"  # without EVAL_BLEU: fairseq's own task


def test_train_resumes_when_only_the_budget_grows(train):
    train(MAX_EPOCH="2")
    (train.save / "checkpoint_last.pt").write_bytes(b"")
    grown = train(MAX_EPOCH="5")
    assert (f"[train] resuming {train.save}/checkpoint_last.pt with a larger budget: --max-epoch 2 -> 5 "
            "(other settings the same)") in grown.stderr
    assert "--max-epoch 5" in (train.save.parent / "bin" / "given").read_text()
    # negative controls: a smaller budget, or another setting with it, is a changed run
    for variables in (dict(MAX_EPOCH="3"), dict(MAX_EPOCH="9", LR="0.002")):
        refused = train(check=False, **variables)
        assert refused.returncode == 1 and "not resuming" in refused.stderr, refused.stderr
    assert "no limit" in train(MAX_EPOCH="").stderr  # no MAX_EPOCH: the budget grows too


def test_the_progress_interval_is_not_a_setting_of_the_run(train):
    train(EVAL_BLEU="1")
    (train.save / "checkpoint_last.pt").write_bytes(b"")
    for interval in (["--valid-progress-seconds", "5"], ["--valid-progress-seconds=0"]):
        proc = go_with(train, *interval)
        assert "resuming" in proc.stderr and "(same settings)" in proc.stderr, proc.stderr
        assert interval[0].split("=")[0] in (train.save.parent / "bin" / "given").read_text()


def go_with(train, *options):
    """train.sh EVAL_BLEU=1 with fairseq-train options after the pair."""
    return run(["bash", RECIPES / "train.sh", "ea_lite", "own", *options], dict(train.base, EVAL_BLEU="1"),
               train.save.parent)


def _checkpoints(folder, names):
    folder.mkdir()
    for name in names:
        (folder / name).write_bytes(b"")
    return folder


def test_evaluate_averages_what_a_short_run_has(env, tmp_path):  # noqa: F811
    """A run of 3 epochs: the default averages those 3 (and says so); a --num-avg above them
    says which number works. (python and fairseq-generate are stand-ins: echo and false.)"""
    data = fake_data(tmp_path)
    run_dir = _checkpoints(tmp_path / "run", ["checkpoint1.pt", "checkpoint2.pt", "checkpoint3.pt",
                                              "checkpoint_last.pt"])
    stand_ins = dict(env, PYTHON="echo", FAIRSEQ_GENERATE="false")
    proc = run(["bash", RECIPES / "evaluate.sh", run_dir, data, "wmt", "-s", "xx", "-t", "yy"], stand_ins,
               tmp_path, check=False)
    assert (f"[evaluate] {run_dir} has 3 epoch checkpoint(s), fewer than the default 10: averaging those 3 "
            "(--num-avg N chooses)") in proc.stderr
    assert "--num-epoch-checkpoints 3 " in proc.stdout  # what the averaging was asked for
    asked = run(["bash", RECIPES / "evaluate.sh", run_dir, data, "wmt", "-s", "xx", "-t", "yy", "--num-avg", "5"],
                stand_ins, tmp_path, check=False)
    assert asked.returncode == 1 and asked.stderr.splitlines() == [
        f"evaluate.sh: error: --num-avg 5, but {run_dir} has 3 epoch checkpoint(s): evaluate with --num-avg 3"]


def test_evaluate_refuses_a_mistyped_folder_and_makes_nothing(env, tmp_path):  # noqa: F811
    data = fake_data(tmp_path)
    typo = tmp_path / "checkpoints" / "ea_lte"
    proc = run(["bash", RECIPES / "evaluate.sh", typo, data, "wmt"], env, tmp_path, check=False)
    assert proc.returncode == 1 and proc.stderr.splitlines() == [
        f"evaluate.sh: error: checkpoint directory {typo} not found (train.sh's SAVE_DIR, e.g. "
        "checkpoints/ea_lite.iwslt14_de_en)"]
    assert not os.path.exists(typo.parent)


def test_evaluate_says_comet_failed_in_its_own_venv(env, tmp_path):  # noqa: F811
    """A COMET request that fails inside the COMET venv: exit status 3, and the line names that
    venv instead of telling the user to set it up. (Stand-ins: the venv's python prints what
    ea-fairseq-bleu prints and exits 3; fairseq-generate translates nothing.)"""
    data = fake_data(tmp_path)
    run_dir = _checkpoints(tmp_path / "run", ["checkpoint1.pt"])
    venv = tmp_path / "venv-comet"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text("#!/usr/bin/env bash\necho 'COMET: not scored: the model could not be loaded'\nexit 3\n")
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    stand_ins = dict(env, FAIRSEQ_GENERATE="true", EA_FAIRSEQ_COMET_VENV=str(venv))  # (PYTHON: ea_write's)
    proc = run(["bash", RECIPES / "evaluate.sh", run_dir, data, "iwslt", "-s", "xx", "-t", "yy",
                "--checkpoint", run_dir / "checkpoint1.pt", "--comet-model", "model.ckpt"], stand_ins, tmp_path,
               check=False)
    assert proc.returncode == 3, proc.stderr
    assert "COMET: not scored: the model could not be loaded" in proc.stdout
    assert proc.stderr.splitlines()[-1] == (
        f"[evaluate] error: COMET not scored (the line above says why; it ran in the COMET venv {venv}); "
        f"BLEU and chrF are in {run_dir}/eval/bleu-test.xx-yy.txt")
    assert "setup_comet_env" not in proc.stderr
