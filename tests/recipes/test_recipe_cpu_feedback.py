"""What a researcher sees from a short run on the CPU: the known warnings filtered out and
nothing else, fairseq's loss every few updates, evaluate.sh naming the checkpoints a run has,
and --eval-bleu's validation BLEU choosing checkpoint_best.pt."""
import os
import re
import subprocess

import pytest

from support.recipe_support import RECIPES, TINY, TRAIN_SH_RUN, env, run  # noqa: F401  (fixture)

KNOWN_WARNINGS = """\
/v/hydra/experimental/initialize.py:45: Hydra14MigrationWarning: 
The version_base parameter is not specified.
Hydra will assume defaults for version 1.1.
See https://hydra.cc/docs/upgrades/1.3_to_1.4/prepare_for_1_4/ for preparation instructions.
  self.delegate = real_initialize(
DEBUG:hydra.core.utils:Setting JobRuntime:name=UNKNOWN_NAME
sys:1: UserWarning: 
'config' is validated against ConfigStore schema with the same name.
This behavior is deprecated in Hydra 1.1 and will be removed in Hydra 1.2.
See https://hydra.cc/docs/1.2/upgrades/1.0_to_1.1/automatic_schema_matching for migration instructions.
/v/hydra/compose.py:56: UserWarning: 
The strict flag in the compose API is deprecated.
See https://hydra.cc/docs/1.2/upgrades/0.11_to_1.0/strict_mode_flag_deprecated for more info.

  deprecation_warning(
/v/torch/utils/data/dataloader.py:1102: UserWarning: 'pin_memory' argument is set as true but no accelerator is found, then device pinned memory won't be used.
  super().__init__(loader)
/v/fairseq/tasks/fairseq_task.py:531: FutureWarning: `torch.cuda.amp.autocast(args...)` is deprecated. Please use `torch.amp.autocast('cuda', args...)` instead.
  with torch.cuda.amp.autocast(enabled=(isinstance(optimizer, AMPOptimizer))):
"""
OTHER_OUTPUT = """\
2026-01-01 00:00:00 | INFO | train | epoch 001 | loss 7.397
/v/ea_fairseq/x.py:3: UserWarning: something a user must see
  warnings.warn("something a user must see")
Traceback (most recent call last):
  File "/v/fairseq_cli/train.py", line 96, in main
    model = task.build_model(cfg.model)
ValueError: a real error
"""


def test_ea_quiet_leaves_out_the_known_warnings_and_nothing_else():
    """The recipes' filter (common.sh): the known warnings go, each with its message lines and
    source line; another warning, log lines and a traceback pass unchanged, in order;
    EA_FAIRSEQ_SHOW_WARNINGS=1 passes everything."""
    text = KNOWN_WARNINGS + OTHER_OUTPUT + KNOWN_WARNINGS
    quiet = ["bash", "-c", f"source {RECIPES / 'common.sh'} && ea_quiet"]
    env = {k: v for k, v in os.environ.items() if k != "EA_FAIRSEQ_SHOW_WARNINGS"}
    out = subprocess.run(quiet, input=text, capture_output=True, text=True, env=env, check=True).stdout
    assert out == OTHER_OUTPUT
    shown = subprocess.run(quiet, input=text, capture_output=True, text=True, check=True,
                           env=dict(env, EA_FAIRSEQ_SHOW_WARNINGS="1")).stdout
    assert shown == text


def _short_cpu_run(env, root, data, **extra):
    """train.sh transformer_lite own (tiny dims) on CPU for 6 updates, shorter than the
    data's first epoch (11 batches of 300 tokens)."""
    save = root / "ck"
    proc = run(["bash", RECIPES / "train.sh", "transformer_lite", "own", *TINY[2:], *TRAIN_SH_RUN],
               {**env, "DATA": str(data), "SAVE_DIR": str(save), "CPU": "1", "MAX_UPDATE": "6", "MAX_TOKENS": "300",
                **extra}, root)
    return save, proc


@pytest.fixture(scope="module")
def eval_bleu_run(env, tiny_data_bin, tmp_path_factory):
    """The same short run with EVAL_BLEU=1, and with the known warnings shown
    (EA_FAIRSEQ_SHOW_WARNINGS=1: the filter's negative control, in the test below)."""
    return _short_cpu_run(env, tmp_path_factory.mktemp("eval_bleu"), tiny_data_bin, EVAL_BLEU="1",
                          EA_FAIRSEQ_SHOW_WARNINGS="1")


def test_a_short_cpu_run_gives_feedback_and_evaluate_names_its_checkpoints(env, tmp_path, tiny_data_bin,
                                                                           eval_bleu_run):
    """train.sh on CPU, shorter than an epoch: fairseq's loss every 5 updates, none of the
    known warnings on stderr (they are there without the filter: the --eval-bleu run);
    evaluate.sh then finds no epoch checkpoint and names what the run has in one line, and
    --best, one of them, scores it."""
    save, proc = _short_cpu_run(env, tmp_path, tiny_data_bin)
    log = (save / "train.log").read_text()
    assert re.search(r"^epoch 001:\s+5 / \d+ loss=.*num_updates=5,", log, re.M), log[-2000:]
    assert "--log-interval 5" in (save / "train.command").read_text()
    assert not re.search(r"Warning|DEBUG:hydra", proc.stderr), proc.stderr
    _, shown = eval_bleu_run
    assert re.search(r"pin_memory|torch\.cuda\.amp", shown.stderr), shown.stderr

    evaluate = ["bash", RECIPES / "evaluate.sh", save, tiny_data_bin, "iwslt", "--cpu"]
    proc = run(evaluate, env, tmp_path, check=False)
    assert proc.returncode == 1 and proc.stderr.splitlines() == [
        f"evaluate.sh: error: no epoch checkpoints to average in {save} (the run stopped before saving one): "
        f"evaluate with --best (checkpoint_best.pt); or --checkpoint {save}/checkpoint_last.pt"], proc.stderr
    out = run(evaluate + ["--best", "--", "--max-len-a", "0", "--max-len-b", "6"], env, tmp_path).stdout
    assert f"model: {save}/checkpoint_best.pt" in out and re.search(r"^fairseq tokenized BLEU .*BLEU4 = ", out, re.M)


def test_evaluate_sh_names_the_checkpoints_a_run_has(env, tmp_path):
    """No epoch checkpoints but update ones (a RAN run stopped early): the pointer names
    averaging by update with as many as there are; none at all: one line saying so."""
    data, run_dir = tmp_path / "data", tmp_path / "run"
    data.mkdir()
    run_dir.mkdir()
    for name in ("test.de-en.de.idx", "test.de-en.en.idx"):
        (data / name).write_text("")
    evaluate = ["bash", RECIPES / "evaluate.sh", run_dir, data, "iwslt", "--cpu"]
    proc = run(evaluate, env, tmp_path, check=False)
    assert proc.returncode == 1 and proc.stderr.splitlines() == [
        f"evaluate.sh: error: no checkpoints in {run_dir} (checkpointE.pt, checkpoint_E_U.pt, checkpoint_best.pt, "
        "checkpoint_last.pt)"], proc.stderr
    for name in ("checkpoint_1_5000.pt", "checkpoint_2_10000.pt", "checkpoint_last.pt"):
        (run_dir / name).write_bytes(b"")
    proc = run(evaluate, env, tmp_path, check=False)
    assert proc.returncode == 1 and proc.stderr.splitlines() == [
        f"evaluate.sh: error: no epoch checkpoints to average in {run_dir} (the run stopped before saving one): "
        "evaluate with --avg-by update --num-avg 2 (averages its last 2 update checkpoints checkpoint_E_U.pt); "
        f"or --checkpoint {run_dir}/checkpoint_last.pt"], proc.stderr


def test_eval_bleu_validates_with_bleu_and_keeps_the_best_by_it(eval_bleu_run):
    """EVAL_BLEU=1: a BLEU in every validation line, and checkpoint_best.pt saved with that
    BLEU as its score (not the loss)."""
    save, proc = eval_bleu_run
    log = (save / "train.log").read_text()
    bleu = re.search(r"^epoch 001 \| valid on 'valid' subset .*\| bleu ([0-9.]+) .*num_updates 6", log, re.M)
    best = re.search(r"Saved checkpoint .*checkpoint_best\.pt \(epoch 1 @ 6 updates, score ([0-9.]+)\)", proc.stdout)
    assert bleu and best and float(best.group(1)) == float(bleu.group(1)), proc.stdout[-2000:]
    assert "--best-checkpoint-metric bleu" in (save / "train.settings").read_text()
    # the validation's translation says what it does and when it is done (--task translation_progress)
    said = proc.stdout + log
    total = re.search(r"\[valid BLEU\] 'valid': translating (\d+) sentences with beam 5", said)
    assert total and f"[valid BLEU] 'valid': {total.group(1)}/{total.group(1)} sentences in " in said, said[-2000:]


def test_an_eval_bleu_checkpoint_is_scored_by_evaluate_sh(eval_bleu_run, env, tiny_data_bin):
    """fairseq keeps the BLEU counts of --eval-bleu as numpy values in extra_state['metrics']:
    the checkpoint loads (weights-only) and scores."""
    save, _ = eval_bleu_run
    out = run(["bash", RECIPES / "evaluate.sh", save, tiny_data_bin, "iwslt", "--cpu", "--best", "--",
               "--max-len-a", "0", "--max-len-b", "6"], env, save.parent).stdout
    assert re.search(r"^fairseq tokenized BLEU .*BLEU4 = ", out, re.M)
