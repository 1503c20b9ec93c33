"""The quality benchmark's report of stored results that no runner trained here (runs written
as the runner writes them): every learning-rate run listed once, under what its family chose; a
run recorded as finished without its scores stopping the report with one line; the training
loss read from one kind of fairseq-train log line."""
import contextlib
import json
import os
import shutil
from pathlib import Path

import pytest

from support.quality_support import benchmarks_module


def _stored_run(path: Path, system: str, lr, **extra) -> dict:
    """A failed run's record as quality.py writes it (no scores to read), under ``path``."""
    record = {"system": system, "seed": 1, "lr": lr, "status": "failed", "failure": "scripts/demo.sh exited 1",
              "machine": {"cpu": "test"}, "commands": ["bash scripts/demo.sh"], "started": f"{system} {path.name}",
              "git": {"commit": "0" * 40, "dirty": []}, **extra}
    if record["lr"] is None:
        del record["lr"]
    path.mkdir(parents=True)
    (path / "run.json").write_text(json.dumps(record))
    return record


def test_every_learning_rate_run_is_listed_once_under_what_its_family_chose(tmp_path):
    """Results the runner's layout allows, or a copy of them holds: a seed 1 that is a copy of
    its learning-rate run (the links dereferenced) is listed once, as seed 1; two runs at one rate
    (``lr0.002``, ``lr0.0020``) and a run.json without ``lr`` (named by its directory) are each
    listed; a family whose choice is written but not yet linked names its chosen run as chosen."""
    quality_results = benchmarks_module("quality_results")
    quality_report = benchmarks_module("quality_report")

    res = tmp_path / "res"
    systems = {s: {"arch": s, "train_args": "", "seeds": 1, "own_dropout": ""} for s in ("a_lite", "b_lite", "c_lite")}
    res.mkdir()
    (res / "config.json").write_text(json.dumps({"budget": {"lrs": [0.001, 0.002]}, "baseline": "a_lite",
                                                 "planned": [[s, 1] for s in systems], "systems": systems}))
    lrs = res / "lr_selection"
    chosen = _stored_run(lrs / "a_lite" / "lr0.001", "a_lite", 0.001)
    shutil.copytree(lrs / "a_lite" / "lr0.001", res / "runs" / "a_lite" / "seed1")  # a dereferenced copy
    _stored_run(lrs / "a_lite" / "lr0.002", "a_lite", None)
    _stored_run(lrs / "a_lite" / "lr0.0020", "a_lite", "0.0020")
    _stored_run(lrs / "b_lite" / "lr0.001", "b_lite", 0.001)
    _stored_run(lrs / "b_lite" / "lr0.002", "b_lite", 0.002)
    _stored_run(lrs / "c_lite" / "lr0.002", "c_lite", 0.002)  # failed: the family's choice waits for this rate
    _stored_run(lrs / "gone_lite" / "lr0.001", "gone_lite", 0.001)  # a family config.json no longer lists
    _stored_run(res / "runs" / "gone_lite" / "seed2", "gone_lite", 0.001, seed=2)
    for s, lr in (("a_lite", 0.001), ("b_lite", 0.002)):
        (lrs / s / "choice.json").write_text(json.dumps({"system": s, "lr": lr, "seed": 1, "rule": "best",
                                                         "valid": {}}))

    out = quality_results.build(str(res))
    a, b = out["systems"]["a_lite"], out["systems"]["b_lite"]
    assert list(a["runs"]) == ["1"] and a["runs"]["1"]["started"] == chosen["started"]
    assert sorted(r["started"] for r in a["lr_candidates"].values()) == ["a_lite lr0.002", "a_lite lr0.0020"]
    assert sorted(r["started"] for r in b["lr_candidates"].values()) == ["b_lite lr0.001", "b_lite lr0.002"]
    assert out["provenance"]["runs"] == 6 and len(set(out["provenance"]["commits"]["0" * 40])) == 6
    names = [n for n, _ in quality_results.named_runs(out)]
    assert len(names) == len(set(names)) == 6
    assert out["findings"][-1] == ("Stored runs of families that config.json does not list, left out of this "
                                   "report: runs/gone_lite/seed2, lr_selection/gone_lite/lr0.001")
    assert [n for n in names if n.startswith("c_lite")] == [
        "c_lite seed 1 at lr 0.002 (learning-rate run, its family's rate not chosen yet)"]
    assert [n for n in names if n.startswith("b_lite")] == [
        "b_lite seed 1 at lr 0.001 (learning-rate run, not chosen)",
        "b_lite seed 1 at lr 0.002 (learning-rate run, chosen, not linked as the family's seed 1 yet)"]
    md = quality_report.markdown(out, {"command": "", "output": ""})
    assert md.count("| a_lite | 1 (not chosen) | failed | ") == 2 and md.count("| a_lite | 1 | failed | ") == 1
    assert md.count("| b_lite | 1 (not chosen) | failed | 0.001 |") == 1
    assert md.count("| b_lite | 1 (chosen, not linked as the family's seed 1 yet) | failed | 0.002 |") == 1
    assert "**Missing** (not run yet): b_lite seed 1 (its learning-rate runs are under Runs), c_lite seed 1 " \
           "(its learning-rate runs are under Runs)." in md
    assert "| c_lite | c_lite | – (not chosen yet) |" in md and "the demo's, not selected" not in md
    assert "Not chosen yet: c_lite (its learning-rate runs are under Runs)." in md
    # before any family's choice (the runner's report after each of the first runs)
    shutil.rmtree(res / "runs")
    for s in systems:
        with contextlib.suppress(FileNotFoundError):
            (lrs / s / "choice.json").unlink()
    md = quality_report.markdown(quality_results.build(str(res)), {"command": "", "output": ""})
    assert "No family's learning rate is chosen yet: `quality.py run` chooses each family's from 0.001 and 0.002 " \
           "on the validation set (seed 1) once all its rates' runs have finished; those stored so far are " \
           "listed under Runs." in md and "the demo's, not selected" not in md and "No learning-rate selection" not in md


def test_a_finished_run_without_its_scores_gets_one_line(tmp_path):
    """A run recorded as finished whose eval/ holds no scores.json (a table run or a learning-rate
    run not chosen) stops the report with one line naming the run, not a traceback."""
    quality_results = benchmarks_module("quality_results")

    res = tmp_path / "res"
    systems = {"a_lite": {"arch": "a_lite", "train_args": "", "seeds": 1, "own_dropout": ""}}
    res.mkdir()
    (res / "config.json").write_text(json.dumps({"budget": {}, "baseline": "a_lite", "planned": [["a_lite", 1]],
                                                 "systems": systems}))
    run = res / "lr_selection" / "a_lite" / "lr0.002"
    _stored_run(run, "a_lite", 0.002, status="finished")
    (run / "eval").mkdir()
    with pytest.raises(SystemExit, match=r"^[^\n]*lr0\.002[^\n]* finished[^\n]*scores\.json[^\n]*$"):
        quality_results.build(str(res))
    (res / "runs" / "a_lite").mkdir(parents=True)
    (res / "runs" / "a_lite" / "seed1").symlink_to(os.path.relpath(run, res / "runs" / "a_lite"))
    with pytest.raises(SystemExit, match=r"^[^\n]*seed1[^\n]* finished[^\n]*scores\.json[^\n]*$"):
        quality_results.build(str(res))


def test_the_training_loss_is_read_from_one_kind_of_log_line(tmp_path):
    """fairseq-train logs a train_inner line per log interval (the mean over that interval) and a
    train line per epoch (the mean over the epoch, at the same update where an epoch ends with an
    interval): the loss curve and the last loss are the train_inner lines', never an epoch's mean;
    a log shorter than one interval has only epoch lines, and those are its curve."""
    quality_results = benchmarks_module("quality_results")

    head = "2026-11-27 04:48:15 | INFO | "
    log = tmp_path / "train.log"
    log.write_text("".join([
        f"{head}fairseq_cli.train | num. shared model params: 3,482,496 (num. trained: 3,482,496)\n",
        f"{head}train_inner | epoch 001:     25 / 40 loss=12.214, nll_loss=12.1, ppl=4000, num_updates=25, lr=1e-4\n",
        f"{head}train | epoch 001 | loss 11.5 | nll_loss 11.3 | ppl 2900 | num_updates 40 | lr 1.6e-4\n",
        f"{head}train_inner | epoch 002:     10 / 40 loss=8.978, nll_loss=8.3, ppl=320, num_updates=50, lr=2e-4\n",
        f"{head}train | epoch 002 | loss 8.983 | nll_loss 8.349 | ppl 326.07 | num_updates 52 | lr 2.1e-4\n",
        f"{head}valid | epoch 002 | valid on 'valid' subset | loss 7.5 | nll_loss 7.1 | num_updates 52\n"]))
    t = quality_results.training_summary(str(log))
    assert t["loss_curve"] == [[25, 12.214], [50, 8.978]] and t["last_loss"] == 8.978
    assert (t["updates"], t["last_loss_update"], t["first_loss"], t["params"]) == (52, 50, 12.214, "3,482,496")
    log.write_text(f"{head}train | epoch 001 | loss 13.1 | nll_loss 13 | ppl 9000 | num_updates 2 | lr 1e-7\n")
    t = quality_results.training_summary(str(log))
    assert t["loss_curve"] == [[2, 13.1]] and (t["updates"], t["last_loss_update"]) == (2, 2)


@pytest.mark.parametrize("delta, holm, done, says", [
    (0.6, 0.90, 5, "a gain in training speed at equal updates"),
    (0.6, 0.01, 5, "a gain at equal compute"),
    (-0.6, 0.01, 5, "a gain in training speed at equal updates"),  # the baseline better: not EA's gain
    (0.6, 0.01, 3, "not read yet (ea_transformer_lite 10 of 10 seeds, transformer_lite_1400_updates 3 of 5 seeds)"),
])
def test_the_plans_reading_of_the_compute_matched_comparison(delta, holm, done, says):
    """The plan's pre-stated reading: EA-Lite's gain is one at equal compute only where it beats
    the compute-matched baseline at Holm p < 0.05 (sacreBLEU), and nothing is read before both
    sides have every planned seed."""
    report = benchmarks_module("quality_report")
    systems = {"ea_transformer_lite": {"seeds_finished": list(range(1, 11)), "seeds_planned": list(range(1, 11))},
               "transformer_lite_1400_updates": {"seeds_finished": list(range(1, done + 1)),
                                                 "seeds_planned": list(range(1, 6))}}
    x = {"delta": delta, "welch_ci": [delta - 0.7, delta + 0.7], "p_holm": holm}
    out = {"systems": systems, "comparisons": {"ea_transformer_lite vs transformer_lite_1400_updates": {"sacrebleu": x}}}
    (line,) = [line for line in report.reading_lines(out) if "1400" in line]
    assert says in line, line
