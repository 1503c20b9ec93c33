"""The quality benchmark's learning curves (benchmarks/quality_curves.py): which checkpoints are
points, each point scored once (resumable) and moved into place only once scored, a failing
point leaving nothing behind, a run whose checkpoints are gone trained again and scored from its
re-run, and the table and figure computed from the stored scores."""
import json
import shutil
import statistics
from pathlib import Path

import pytest

from support.quality_support import benchmarks_module


def _scores(path, bleu: float, chrf: float) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "valid.es-en.scores.json").write_text(json.dumps(
        {"metrics": {"sacrebleu": {"score": bleu}, "chrf": {"score": chrf}}}))


def checkpoints(train) -> None:
    """What fairseq-train leaves in ``train`` with every checkpoint kept (60 updates apart)."""
    train.mkdir(parents=True)
    for update in range(60, 1201, 60):
        (train / f"checkpoint_{1 + update // 600}_{update}.pt").write_bytes(b"")
    (train / "checkpoint_last.pt").write_bytes(b"")


class FakeRunner:
    """The parts of quality_runner.Runner that score_points uses, over a results and a work
    directory laid out as the runner lays them out; ``validate`` scores a checkpoint by its update."""

    def __init__(self, tmp_path, curves, fail_at=None):
        self.results, self.work = str(tmp_path / "results"), str(tmp_path / "work")
        self.git, self.machine, self.fail_at, self.validated = {"commit": "0" * 40}, {"cpu": "test"}, fail_at, []
        for system, first in curves.KEEP_CHECKPOINTS.items():
            arch = benchmarks_module("quality_plan").SYSTEMS[system][0]
            for seed in (first - 1, first, first + 1):  # the one before keeps no checkpoints
                run = tmp_path / "results" / "runs" / system / f"seed{seed}"
                run.mkdir(parents=True)
                status = "failed" if seed == first + 1 and system == "transformer_lite" else "finished"
                (run / "run.json").write_text(json.dumps({"status": status}))
                checkpoints(tmp_path / "work" / "runs" / system / f"seed{seed}" / "train" / arch)

    def seeds(self, system):
        return list(range(1, 11))

    def run_dir(self, system, seed):
        return f"{self.results}/runs/{system}/seed{seed}"

    def rerun_dir(self, system, seed):
        return f"{self.results}/reruns/{system}/seed{seed}"

    def finished_at(self, final):
        try:
            with open(f"{final}/run.json") as f:
                return json.load(f)
        except FileNotFoundError:
            return None

    def validate(self, record, checkpoint, work, out_dir):
        update = record["update"]
        if update == self.fail_at:
            record["failure"] = "fairseq-generate on the validation set exited 1"
            return 1
        self.validated.append((record["system"], record["seed"], update))
        _scores(Path(out_dir), bleu=update / 100 + record["seed"], chrf=update / 50)
        return 0

    def link_refs(self, eval_dir):
        pass


def test_every_kept_checkpoint_240_updates_apart_is_scored_once(tmp_path):
    curves = benchmarks_module("quality_curves")
    runner = FakeRunner(tmp_path, curves)
    written = curves.score_points(runner)
    updates = [240, 480, 720, 960, 1200]
    first = curves.KEEP_CHECKPOINTS
    expected = sorted((s, k, u) for s in first for k in (first[s], first[s] + 1) for u in updates
                      if not (s == "transformer_lite" and k == first[s] + 1))  # (that run failed)
    assert sorted(runner.validated) == expected and len(written) == len(expected)
    point = json.loads(open(f"{written[0]}/point.json").read())
    assert point["checkpoint"].startswith("runs/") and point["git"] == runner.git
    assert not list((tmp_path / "results" / "curves").rglob("*.partial"))
    runner.validated.clear()
    assert curves.score_points(runner) == [] and runner.validated == []  # resumed: nothing again


def test_a_run_whose_checkpoints_are_gone_is_trained_again_and_scored_from_its_rerun(tmp_path):
    curves = benchmarks_module("quality_curves")
    runner = FakeRunner(tmp_path, curves)
    system, seed = "ea_transformer_lite", curves.KEEP_CHECKPOINTS["ea_transformer_lite"]
    arch = benchmarks_module("quality_plan").SYSTEMS[system][0]
    shutil.rmtree(tmp_path / "work" / "runs" / system / f"seed{seed}")
    assert curves.lost(runner) == [(system, seed)]
    checkpoints(tmp_path / "work" / "reruns" / system / f"seed{seed}" / "train" / arch)  # quality.py run --rerun
    unfinished = [w for w in curves.score_points(runner) if f"/{system}/seed{seed}/" in w]
    assert unfinished == [] and curves.lost(runner) == [(system, seed)]  # the re-run has not finished yet
    rerun = tmp_path / "results" / "reruns" / system / f"seed{seed}"
    rerun.mkdir(parents=True)
    (rerun / "run.json").write_text(json.dumps({"status": "finished"}))
    assert curves.lost(runner) == []
    written = curves.score_points(runner)
    from_rerun = [w for w in written if f"/{system}/seed{seed}/" in w]
    assert len(from_rerun) == 5
    assert json.loads(open(f"{from_rerun[0]}/point.json").read())["checkpoint"].startswith("reruns/")
    shutil.rmtree(tmp_path / "work")  # scored, then every checkpoint gone: nothing to train again
    assert curves.lost(runner) == [] and curves.score_points(runner) == []


def test_a_failing_point_stops_and_leaves_nothing_in_its_place(tmp_path):
    curves = benchmarks_module("quality_curves")
    runner = FakeRunner(tmp_path, curves, fail_at=480)
    with pytest.raises(SystemExit, match="at 480 updates: fairseq-generate on the validation set exited 1"):
        curves.score_points(runner)
    system = sorted(curves.KEEP_CHECKPOINTS)[0]
    seed = curves.KEEP_CHECKPOINTS[system]
    assert (tmp_path / "results" / "curves" / system / f"seed{seed}" / "update240" / "point.json").exists()
    assert not (tmp_path / "results" / "curves" / system / f"seed{seed}" / "update480").exists()


def test_the_table_and_figure_come_from_the_stored_scores(tmp_path):
    curves = benchmarks_module("quality_curves")
    results = tmp_path / "results"
    assert curves.points(str(results)) == {}
    assert curves.section({}) == ["No point scored yet (`benchmarks/quality.py curves`)."]
    assert not curves.plot({}, str(tmp_path / "none.svg"))
    given = {("ea_transformer_lite", 6, 240): (5.0, 20.0), ("ea_transformer_lite", 7, 240): (7.0, 24.0),
             ("transformer_lite", 6, 240): (4.0, 18.0), ("transformer_lite", 6, 480): (8.0, 30.0)}
    for (system, seed, update), (bleu, chrf) in given.items():
        _scores(results / "curves" / system / f"seed{seed}" / f"update{update}", bleu, chrf)
    scored = curves.points(str(results))
    lines = curves.section(scored, "quality/curves.svg")
    assert "| updates | ea_transformer_lite, sacreBLEU | ea_transformer_lite, chrF | transformer_lite, sacreBLEU |" \
           in lines[2]
    row240 = next(line for line in lines if line.startswith("| 240 |"))
    assert f"6.00 ± {statistics.stdev([5.0, 7.0]):.2f} (2)" in row240 and "22.00 ± 2.83 (2)" in row240
    assert "| 4.00 (1) | 18.00 (1) |" in row240
    assert next(line for line in lines if line.startswith("| 480 |")) == "| 480 |  |  | 8.00 (1) | 30.00 (1) |"
    assert lines[-1] == "![learning curves](quality/curves.svg)"
    one, two = tmp_path / "one.svg", tmp_path / "two.svg"
    assert curves.plot(scored, str(one)) and curves.plot(scored, str(two))
    assert one.read_bytes() == two.read_bytes() and b"<svg" in one.read_bytes()
