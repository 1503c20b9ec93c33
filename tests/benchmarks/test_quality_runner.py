"""benchmarks/quality.py's runner without training: its refusals (bad arguments, a second
runner on one work directory, a working tree with uncommitted changes), each one line and
before anything is written; the choice among several learning rates on stored candidate runs
(each candidate a whole run of its own); the plan's systems that take their family's rate, and
the primary pair's kept checkpoints."""
import json
import os
import subprocess
from pathlib import Path

import pytest

from support.quality_support import REPO, benchmarks_module, quality


def test_bad_arguments_get_one_line(tmp_path):
    unknown = quality("run", "--systems", "transformer_lite", "bogus_lite", "--results-dir", tmp_path / "r",
                      "--work-dir", tmp_path / "w", check=False)
    assert unknown.returncode != 0 and "Traceback" not in unknown.stderr
    (line,) = unknown.stderr.strip().splitlines()
    assert line.startswith("quality.py: unknown system(s) bogus_lite; known: transformer_lite, ea_transformer_lite")
    outside = quality("run", "--commit", "--results-dir", tmp_path / "r", "--work-dir", tmp_path / "w", check=False)
    assert outside.returncode != 0 and "outside the repository" in outside.stderr.strip().splitlines()[-1]
    demo = subprocess.run(["bash", str(REPO / "scripts" / "demo.sh")], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "DEMO_DIR": str(tmp_path / "d"), "DEMO_STOP_AFTER": "bogus"})
    assert demo.returncode != 0
    assert "DEMO_STOP_AFTER must be data or translation (got 'bogus')" in demo.stderr
    assert not (tmp_path / "d").exists()  # refused before any stage


def test_a_second_runner_on_the_same_work_dir_is_refused(tmp_path):
    import fcntl

    (tmp_path / "w").mkdir()
    with open(tmp_path / "w" / "run.lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write("4242")
        held.flush()
        second = quality("run", "--results-dir", tmp_path / "r", "--work-dir", tmp_path / "w", check=False)
    assert second.returncode != 0 and "Traceback" not in second.stderr
    (line,) = second.stderr.strip().splitlines()
    assert line.startswith(f"quality.py: another quality.py run (pid 4242) is using {tmp_path / 'w'}")
    assert not (tmp_path / "r").exists()  # refused before anything was written


def test_a_dirty_tree_is_refused_unless_allowed(tmp_path, monkeypatch):
    """The runner records the commit each run ran on: uncommitted changes outside the results
    are refused (one line) unless --allow-dirty; git_state lists them, leaving out the results."""
    q = benchmarks_module("quality")
    quality_runner = benchmarks_module("quality_runner")

    repo = tmp_path / "repo"
    (repo / "res").mkdir(parents=True)
    git = lambda *a: subprocess.run(["git", *a], cwd=repo, capture_output=True, text=True, check=True)  # noqa: E731
    git("init", "-q")
    (repo / "code.py").write_text("x = 1\n")
    git("add", "code.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "c")
    assert quality_runner.git_state(str(repo), [str(repo / "res")]) == {
        "commit": git("rev-parse", "HEAD").stdout.strip(), "dirty": []}
    (repo / "code.py").write_text("x = 2\n")
    (repo / "new.py").write_text("")
    (repo / "res" / "run.json").write_text("{}")
    assert sorted(quality_runner.git_state(str(repo), [str(repo / "res")])["dirty"]) == ["code.py", "new.py"]

    monkeypatch.setattr(quality_runner, "git_state",
                        lambda repo, exclude: {"commit": "abc", "dirty": ["ea_fairseq/x.py"]})
    monkeypatch.setattr(quality_runner, "pip_freeze", lambda: "torch==0\n")
    with pytest.raises(SystemExit, match=r"^quality.py: the working tree has uncommitted changes \(ea_fairseq/x.py\): "
                                         r"commit them .* or give --allow-dirty"):
        q.main(["run", "--results-dir", str(tmp_path / "r"), "--work-dir", str(tmp_path / "w")])
    assert not (tmp_path / "r").exists()  # refused before anything was written
    monkeypatch.setattr(quality_runner, "git_state", lambda repo, exclude: {"commit": None, "dirty": []})
    with pytest.raises(SystemExit, match="is not a git checkout"):
        q.main(["run", "--results-dir", str(tmp_path / "r"), "--work-dir", str(tmp_path / "w")])


@pytest.mark.parametrize("scores, chosen", [
    ({0.002: (3.0, 20.0), 0.001: (4.0, 10.0)}, 0.001),  # sacreBLEU decides
    ({0.002: (4.0, 21.0), 0.001: (4.0, 20.0)}, 0.002),  # then chrF
    ({0.002: (4.0, 20.0), 0.001: (4.0, 20.0)}, 0.001),  # then the lower rate
])
def test_the_learning_rate_is_the_best_validation_candidate(tmp_path, scores, chosen):
    """choose_lr on stored candidate runs: validation sacreBLEU, then chrF, then the lower
    rate; seed 1 becomes a link to the chosen run; no choice while a candidate is unfinished."""
    q = benchmarks_module("quality_runner")

    runner = q.Runner.__new__(q.Runner)  # no git or pip records: nothing here trains
    runner.results, runner.args = str(tmp_path), type("Args", (), {"lrs": sorted(scores)})()
    for lr, (bleu, chrf) in scores.items():
        run = Path(runner.candidate_dir("ea_transformer_lite", lr))
        (run / "valid").mkdir(parents=True)
        (run / "run.json").write_text(json.dumps({"status": "finished"}))
        metrics = {"sacrebleu": {"score": bleu}, "chrf": {"score": chrf}, "chrf++": {"score": chrf}}
        (run / "valid" / "valid.es-en.scores.json").write_text(json.dumps({"metrics": metrics}))
    assert runner.choose_lr("ea_transformer_lite") == chosen
    choice = json.loads((tmp_path / "lr_selection" / "ea_transformer_lite" / "choice.json").read_text())
    assert choice["lr"] == chosen and choice["valid"][f"{chosen:g}"]["sacrebleu"] == scores[chosen][0]
    assert Path(runner.run_dir("ea_transformer_lite", 1)).resolve() == Path(runner.candidate_dir(
        "ea_transformer_lite", chosen)).resolve()
    (Path(runner.candidate_dir("ea_transformer_lite", 0.002)) / "run.json").write_text(json.dumps({"status": "failed"}))
    assert runner.choose_lr("ea_transformer_lite") is None

def test_systems_of_the_plan_take_their_familys_rate_and_the_primary_pair_keeps_its_checkpoints(tmp_path):
    """The compute-matched baseline, EA's ablations and RAN without its attention dropout train
    at the rate their family chose on the validation set (none of their own is selected); the
    primary pair's new seeds keep every checkpoint for the learning curves."""
    import argparse

    q = benchmarks_module("quality_runner")
    plan = benchmarks_module("quality_plan")
    res = tmp_path / "res"
    runner = q.Runner(argparse.Namespace(results_dir=str(res), work_dir=str(tmp_path / "work"), seeds=None,
                                         update_readme=False, readme=str(tmp_path / "README.md")))
    assert runner.lr_of("ea_transformer_lite_alpha0") is None  # EA's rate not chosen yet: not run
    (res / "lr_selection" / "ea_transformer_lite").mkdir(parents=True)
    (res / "lr_selection" / "ea_transformer_lite" / "choice.json").write_text('{"lr": 0.002}')
    for system in ("ea_transformer_lite_alpha0", "ea_transformer_lite_beta0"):
        assert runner.lr_of(system) == 0.002
    taking = {s: family for s, (_, _, _, family) in plan.SYSTEMS.items() if family}
    assert taking == {"transformer_lite_1400_updates": "transformer_lite",
                      "ea_transformer_lite_alpha0": "ea_transformer_lite",
                      "ea_transformer_lite_beta0": "ea_transformer_lite",
                      "ran_d_lite_attention_dropout0": "ran_d_lite",
                      "ran_all_lite_attention_dropout0": "ran_all_lite"}
    assert all(plan.SYSTEMS[f][3] is None for f in taking.values())  # families choose their own
    assert [runner.seeds(s)[-1] for s in ("transformer_lite", "ea_transformer_lite")] == [10, 10]
    assert plan.KEEP_CHECKPOINTS == {"transformer_lite": 6, "ea_transformer_lite": 6}


def test_rates_beside_the_grid_are_recorded_never_chosen_and_a_better_one_is_a_finding(tmp_path):
    """The primary pair's rates beside the plan's grid (quality_plan.LRS_BESIDE) are tried only
    where a run tries the plan's grid; choice.json records their validation scores beside the
    choice, which they never change, and the report names one that beats the chosen rate."""
    q, plan = benchmarks_module("quality_runner"), benchmarks_module("quality_plan")
    report = benchmarks_module("quality_report")
    runner = q.Runner.__new__(q.Runner)
    runner.results, runner.args = str(tmp_path), type("Args", (), {"lrs": list(plan.LRS)})()
    beside = plan.LRS_BESIDE["ea_transformer_lite"]
    assert runner.lrs_beside("ea_transformer_lite") == list(beside) and runner.lrs_beside("pa_transformer_lite") == []
    runner.args.lrs = [0.002]  # another grid than the plan's: nothing beside it
    assert runner.lrs_beside("ea_transformer_lite") == []
    runner.args.lrs = list(plan.LRS)
    scores = {0.001: 4.0, 0.002: 3.0, beside[0]: 2.0, beside[1]: 9.0}
    for lr, bleu in scores.items():
        run = Path(runner.candidate_dir("ea_transformer_lite", lr))
        (run / "valid").mkdir(parents=True)
        (run / "run.json").write_text(json.dumps({"status": "finished"}))
        metrics = {"sacrebleu": {"score": bleu}, "chrf": {"score": 20.0}, "chrf++": {"score": 20.0}}
        (run / "valid" / "valid.es-en.scores.json").write_text(json.dumps({"metrics": metrics}))
    assert runner.choose_lr("ea_transformer_lite") == 0.001  # 0.003's 9.0 does not change the choice
    choice = json.loads((tmp_path / "lr_selection" / "ea_transformer_lite" / "choice.json").read_text())
    assert sorted(choice["valid"]) == ["0.001", "0.002"] and sorted(choice["beside"]) == ["0.0005", "0.003"]
    lines = report.lr_lines({"systems": {"ea_transformer_lite": {"lr_selection": choice, "lr_candidates": {}, "lr": []}},
                             "budget": {"lrs": list(plan.LRS)}})
    assert "| system | lr 0.001 | lr 0.002 | lr 0.0005 (beside) | lr 0.003 (beside) | chosen |" in lines
    assert any("**Finding**" in x and "ea_transformer_lite at 0.003 (9.00 against 4.00 at 0.001)" in x for x in lines)
    (Path(runner.candidate_dir("ea_transformer_lite", beside[1])) / "run.json").write_text('{"status": "failed"}')
    runner.choose_lr("ea_transformer_lite")
    choice = json.loads((tmp_path / "lr_selection" / "ea_transformer_lite" / "choice.json").read_text())
    assert sorted(choice["beside"]) == ["0.0005"]  # only finished runs are recorded
