"""benchmarks/quality.py end to end on a tiny budget: two systems, each trained once (seed 1,
the learning-rate run, translated and scored on the validation set too) through the demo on a
hundred-odd short verses of the shipped corpus, scored, probed and reported; the records are
checked against git and pip, resuming and refusals against the same runner.

The report's seed-level arithmetic (means, spreads, Welch's t and CI, Holm, sign, agreement)
needs more than one seed per system: it is checked on a copy of those results holding, for
each system, a second seed derived from its first (not trained: seed 1's stored translation
with a few sentences replaced by their references, scored by ea-fairseq-bleu with the runner's
arguments and stored in the runner's layout), reported by ``quality.py report``. Every number
of both reports is recomputed with sacreBLEU and scipy from the stored hypotheses.

Without training: the runner's refusals and its choice of learning rate are
test_quality_runner.py's, the report of stored results that no runner trained here
test_quality_report.py's."""
import json
import lzma
import os
import shutil
import statistics
import subprocess
from pathlib import Path

import pytest
import sacrebleu
from sacrebleu.metrics import BLEU, CHRF

from support.quality_support import REPO, benchmarks_module, derive_seed, quality, tiny_corpus

SYSTEMS, SEEDS, LRS = ("transformer_lite", "realformer_lite"), (1,), ("0.002",)
#: seed 2 of each system, derived from its seed 1: these test sentences' hypotheses replaced by their
#: references (different counts: the systems and the seeds score differently in both metrics)
DERIVED = {"transformer_lite": (0, 1), "realformer_lite": (0, 1, 2, 3, 4)}
DERIVED_SEEDS = (1, 2)
UPDATES, TRAIN, VALID, TEST = 2, 120, 6, 8  # the demo's budget and corpus, cut to what the assertions read
BUDGET = ["--updates", str(UPDATES), "--bpe-merges", "100", "--avg", "2", "--max-tokens", "256", "--warmup", "2",
          "--lrs", *LRS]
KOCMI = {"sacrebleu": (0.52, 1.39), "chrf": (0.33, 1.00)}  # Kocmi et al. (2024), Table 1


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("quality")
    tiny_corpus(tmp / "corpus", {"train": TRAIN, "valid": VALID, "test": TEST})
    readme = tmp / "README.md"
    original = (REPO / "README.md").read_text(encoding="utf-8")
    readme.write_text(original, encoding="utf-8")
    (tmp / "README.original.md").write_text(original, encoding="utf-8")
    res = tmp / "res"
    # what a run killed half-way leaves: its staging directory and its work files
    partial = res / "lr_selection" / "realformer_lite" / f".lr{float(LRS[0]):g}.partial" / "eval"
    partial.mkdir(parents=True)
    (partial / "test.es-en.scores.json").write_text("{")
    stale = tmp / "work" / "lr_selection" / "realformer_lite" / f"lr{float(LRS[0]):g}" / "train" / "realformer_lite"
    stale.mkdir(parents=True)
    (stale / "checkpoint_9_99.pt").write_text("")
    common = ["--results-dir", res, "--work-dir", tmp / "work", "--corpus", tmp / "corpus", *BUDGET,
              "--systems", *SYSTEMS, "--seeds", *SEEDS, "--allow-dirty", "--probe-batch", "0"]
    done = quality("run", *common, "--update-readme", "--readme", readme, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp, res, common, json.loads((tmp / "res.json").read_text())


@pytest.fixture(scope="module")
def derived(finished):
    """A copy of the finished results with seed 2 of each system derived from seed 1 (see
    derive_seed), reported by ``quality.py report --update-readme`` as any stored results are."""
    tmp, res, _, _ = finished
    results = tmp / "derived"
    shutil.copytree(res, results, symlinks=True)
    for system, sentences in DERIVED.items():
        derive_seed(results, system, sentences, tmp / "derived-work" / system)
    config = json.loads((results / "config.json").read_text())
    config["planned"] += [[s, 2] for s in SYSTEMS]
    (results / "config.json").write_text(json.dumps(config, indent=1))
    readme = tmp / "README.derived.md"
    readme.write_text((tmp / "README.original.md").read_text(encoding="utf-8"), encoding="utf-8")
    done = quality("report", "--results-dir", results, "--update-readme", "--readme", readme, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp, results, json.loads((tmp / "derived.json").read_text())


def lines(path: Path):
    return path.read_text(encoding="utf-8").split("\n")[:-1]


def run_files(res: Path, system: str, seed: int, name: str):
    eval_dir = res / "runs" / system / f"seed{seed}" / "eval"
    return lines(eval_dir / f"test.es-en.hyp.{name}"), lines(eval_dir / f"test.es-en.ref.{name}")


def in_history(commit: str) -> bool:
    """A commit of this checkout's history (others may commit while the runs train)."""
    return len(commit) == 40 and subprocess.run(["git", "merge-base", "--is-ancestor", commit, "HEAD"],
                                                cwd=REPO).returncode == 0


def test_runs_are_recorded_in_the_repository_layout(finished):
    tmp, res, _, report = finished
    for system in SYSTEMS:
        choice = json.loads((res / "lr_selection" / system / "choice.json").read_text())
        assert (res / "runs" / system / "seed1").resolve() == (res / "lr_selection" / system / f"lr{choice['lr']:g}")
        for seed in SEEDS:
            run = res / "runs" / system / f"seed{seed}"
            record = json.loads((run / "run.json").read_text())
            assert record["status"] == "finished" and record["seed"] == seed and record["arch"] == system
            assert record["lr"] == choice["lr"] and f"DEMO_LR={choice['lr']:g}" in record["commands"][0]
            assert "DEMO_DROPOUT=0.0" in record["commands"][0] and "--dropout 0.0" in record["demo_train_stamp"]
            assert record["wall_s"] > 0 and record["cpu_s"] > 0 and record["train_wall_s"] >= 0
            assert record["machine"]["cores"] == os.cpu_count() and record["training"]["updates"] == UPDATES
            assert f"DEMO_SEED={seed}" in record["commands"][0] and f"DEMO_ARCHS={system}" in record["commands"][0]
            assert "ea-fairseq-bleu" in record["commands"][1]
            # provenance: the commit, the environment, the logs, the collapse probe's output
            assert in_history(record["git"]["commit"]) and isinstance(record["git"]["dirty"], list)
            freeze = (run / "pip-freeze.txt").read_text()
            assert any(line.startswith("torch==") for line in freeze.splitlines())
            assert (run / "train.log").exists() and "[demo" in (run / "demo.log").read_text()
            assert "decoder NLL" in (run / "probe.txt").read_text() and record["probe_exit"] == 0
            # references are one shared copy, linked; the hypotheses are the run's own
            assert (run / "eval" / "test.es-en.ref.sacrebleu").is_symlink()
            assert len(lines(run / "eval" / "test.es-en.hyp.sacrebleu")) == TEST
    assert not list(res.glob("runs/*/.seed*.partial")) and not list(res.glob("lr_selection/*/.lr*.partial"))
    assert not list((tmp / "work").glob("lr_selection/realformer_lite/lr*/train/*/checkpoint_9_99.pt"))
    assert list((tmp / "work").glob("**/*.pt"))  # checkpoints live in the work dir, not in the results
    assert not list(res.glob("**/*.pt"))


def test_learning_rate_run_is_scored_on_the_validation_set(finished):
    """Seed 1 at each rate, its validation sacreBLEU and chrF computed from the validation set's
    stored translations (never the test set's); the choice and the scores in the report."""
    tmp, res, _, report = finished
    raw = lzma.open(tmp / "corpus" / "valid.en.xz", "rt", encoding="utf-8").read().splitlines()
    md = (tmp / "res.md").read_text(encoding="utf-8")
    for system in SYSTEMS:
        choice = json.loads((res / "lr_selection" / system / "choice.json").read_text())
        valid = {}
        for lr in LRS:
            d = res / "lr_selection" / system / f"lr{float(lr):g}"
            hyp = lines(d / "valid" / "valid.es-en.hyp.sacrebleu")
            assert lines(d / "valid" / "valid.es-en.ref.sacrebleu") == raw and len(hyp) == VALID
            # one copy of the references in refs/, as the test set's: links beside the hypotheses
            assert (d / "valid" / "valid.es-en.ref.sacrebleu").resolve() == (res / "refs" / "valid.es-en.ref.sacrebleu")
            valid[float(lr)] = (BLEU().corpus_score(hyp, [raw]).score, CHRF().corpus_score(hyp, [raw]).score)
            assert choice["valid"][f"{float(lr):g}"]["sacrebleu"] == pytest.approx(valid[float(lr)][0])
            assert choice["valid"][f"{float(lr):g}"]["chrf"] == pytest.approx(valid[float(lr)][1])
        assert choice["lr"] == max(valid, key=lambda lr: (*valid[lr], -lr))
        assert report["systems"][system]["lr_selection"] == choice and report["systems"][system]["lr"] == [f"{choice['lr']}"]
        row = f"| {system} | " + " | ".join(f"{valid[float(lr)][0]:.2f} / {valid[float(lr)][1]:.2f}"
                                            for lr in sorted(LRS, key=float)) + f" | {choice['lr']:g} |"
        assert row in md
    assert "chosen on the validation set" in md and "No learning-rate selection" not in md


def test_learning_rate_runs_not_chosen_are_reported_and_checked_like_the_tables(finished, tmp_path):
    """A learning-rate run that was not chosen (here realformer_lite's seed 1 at 0.001, a copy of
    its chosen run scoring 0 on the test set) is no row of the score tables, but the report
    counts it in the provenance, lists it under the runs, and flags it as it flags a table
    run, with the path of its collapse probe's output; the chosen run is listed once."""
    quality_results = benchmarks_module("quality_results")
    quality_report = benchmarks_module("quality_report")

    _, res, _, real = finished
    results = tmp_path / "res"
    shutil.copytree(res, results, symlinks=True)
    chosen = results / "lr_selection" / "realformer_lite" / f"lr{float(LRS[0]):g}"
    other = chosen.parent / "lr0.001"
    shutil.copytree(chosen, other, symlinks=True)
    record = json.loads((other / "run.json").read_text())
    (other / "run.json").write_text(json.dumps({**record, "lr": 0.001}))
    scores = json.loads((other / "eval" / "test.es-en.scores.json").read_text())
    for m in ("sacrebleu", "chrf"):
        scores["metrics"][m]["score"] = 0.0
    (other / "eval" / "test.es-en.scores.json").write_text(json.dumps(scores))

    out = quality_results.build(str(results))
    realformer = out["systems"]["realformer_lite"]
    assert list(realformer["lr_candidates"]) == ["0.001"]  # the chosen rate is seed 1, listed once
    assert realformer["lr_candidates"]["0.001"]["scores"] == {"sacrebleu": 0.0, "chrf": 0.0}
    assert realformer["metrics"] == real["systems"]["realformer_lite"]["metrics"]  # not in the tables
    assert not out["systems"]["transformer_lite"]["lr_candidates"]
    name = "realformer_lite seed 1 at lr 0.001 (learning-rate run, not chosen)"
    mine = [f for f in out["findings"] if f.startswith(name)]
    assert [f.split(": ")[1].split(" ")[0] for f in mine] == ["sacreBLEU", "chrF", "the"]
    assert mine[-1].endswith(f"`{os.path.relpath(other / 'probe.txt', REPO)}`")
    moved = [f.replace(os.path.relpath(results, REPO), os.path.relpath(res, REPO)) for f in out["findings"]]
    assert moved[:len(real["findings"])] == real["findings"] and len(moved) == len(real["findings"]) + len(mine)
    p = out["provenance"]
    assert p["runs"] == p["pip_freeze"] == len(SYSTEMS) * len(SEEDS) + 1
    assert name in next(iter(p["commits"].values()))
    md = quality_report.markdown(out, {"command": "", "output": ""})
    assert md.count("| realformer_lite | 1 (not chosen) | finished | 0.001 | ") == 1
    assert md.count("| realformer_lite | 1 | finished | ") == 1
    assert f"Runs finished: {len(SYSTEMS) * len(SEEDS)} of {len(SYSTEMS) * len(SEEDS)}, besides 1 other learning-rate " \
           "run(s) (listed under Runs)." in md
    # before the family's choice (its seed 1 not linked yet) every rate's run waits, none is "not chosen"
    (results / "lr_selection" / "realformer_lite" / "choice.json").unlink()
    (results / "runs" / "realformer_lite" / "seed1").unlink()
    out = quality_results.build(str(results))
    assert list(out["systems"]["realformer_lite"]["lr_candidates"]) == ["0.001", f"{float(LRS[0]):g}"]
    waiting = [f for f in out["findings"] if f.startswith("realformer_lite seed 1 at lr 0.001 (learning-rate run, "
                                                          "its family's rate not chosen yet): ")]
    assert len(waiting) == 3 and not [f for f in out["findings"] if "(learning-rate run, not chosen)" in f]


def test_report_arithmetic_matches_sacrebleu_and_scipy(finished, derived):
    """The runner's own report (one seed per system) and the report of the results with derived
    seeds: every score, mean, spread, Δ, test and CI recomputed from the stored hypotheses."""
    stats = pytest.importorskip("scipy.stats")
    tmp, real, _, real_report = finished
    raw = {lang: lzma.open(tmp / "corpus" / f"test.{lang}.xz", "rt", encoding="utf-8").read().splitlines()
           for lang in ("es", "en")}
    for m, metric in (("sacrebleu", BLEU), ("chrf", CHRF)):
        for s in SYSTEMS:
            hyp, ref = run_files(real, s, 1, "sacrebleu")
            assert ref == raw["en"]
            assert real_report["systems"][s]["runs"]["1"]["scores"][m] == pytest.approx(
                metric().corpus_score(hyp, [ref]).score)
            assert real_report["systems"][s]["metrics"][m]["mean"] == real_report["systems"][s]["runs"]["1"]["scores"][m]
    assert real_report["provenance"]["pip_freeze"] == 2 and not real_report["provenance"]["unrecorded"]

    _, res, report = derived
    copy = report["copy_source"]["metrics"]
    assert copy["sacrebleu"]["score"] == pytest.approx(sacrebleu.corpus_bleu(raw["es"], [raw["en"]]).score)
    assert copy["chrf"]["score"] == pytest.approx(sacrebleu.corpus_chrf(raw["es"], [raw["en"]]).score)
    assert set(report["systems"]) == set(SYSTEMS) and report["baseline"] == "transformer_lite"
    below, ps = set(), {}
    for m, metric in (("sacrebleu", BLEU), ("chrf", CHRF)):
        score = {}
        for s in SYSTEMS:
            for k in DERIVED_SEEDS:
                hyp, ref = run_files(res, s, k, "sacrebleu")
                assert ref == raw["en"]
                score[s, k] = metric().corpus_score(hyp, [ref]).score
                assert report["systems"][s]["runs"][str(k)]["scores"][m] == pytest.approx(score[s, k])
                if score[s, k] <= copy[m]["score"]:
                    below.add(f"{s} seed {k}: {'sacreBLEU' if m == 'sacrebleu' else 'chrF'}")
            x = report["systems"][s]["metrics"][m]
            values = [score[s, k] for k in DERIVED_SEEDS]
            assert x["mean"] == pytest.approx(statistics.fmean(values))
            assert x["std"] == pytest.approx(statistics.stdev(values)) and x["std"] > 0  # (the derivation sees to it)
        x = report["systems"]["realformer_lite"]["metrics"][m]
        base, other = ([score[s, k] for k in DERIVED_SEEDS] for s in SYSTEMS)
        assert x["delta"] == pytest.approx(statistics.fmean(other) - statistics.fmean(base))
        welch = stats.ttest_ind(other, base, equal_var=False)
        assert x["test"] == "Welch" and x["p"] == pytest.approx(welch.pvalue, rel=1e-6)
        assert x["welch_ci"] == [pytest.approx(welch.confidence_interval().low, rel=1e-6),
                                 pytest.approx(welch.confidence_interval().high, rel=1e-6)]
        ps[m] = x["p"]
        assert x["ci"][0] <= x["delta"] <= x["ci"][1]
        diffs = [b - a for a in base for b in other]
        assert x["sign"] == [sum(d > 0 for d in diffs) if x["delta"] > 0 else sum(d < 0 for d in diffs)
                             if x["delta"] < 0 else 0, 4]
        low, high = KOCMI[m]
        assert x["agreement_thresholds"] == [low, high]
        hull = x["agreement_ci"]
        assert hull[0] <= min(x["ci"][0], x["welch_ci"][0] if x["welch_ci"] else x["ci"][0])
        assert ("humans would prefer" in x["agreement"]) == ((hull[0] > 0 or hull[1] < 0) and x["p_holm"] < 0.05)
        if "humans would prefer" in x["agreement"]:
            assert x["agreement"].endswith("realformer_lite" if x["delta"] > 0 else "transformer_lite")
    # Holm over every reported test: one system in two metrics, one family of two
    low, high = sorted(ps.values())
    adjusted = {m: min(1.0, 2 * low) if p == low else max(min(1.0, 2 * low), min(1.0, high)) for m, p in ps.items()}
    for m in ps:
        assert report["systems"]["realformer_lite"]["metrics"][m]["p_holm"] == pytest.approx(adjusted[m])
    flagged = {f.split(",")[0].rsplit(" ", 1)[0] for f in report["findings"] if "copy-the-source" in f}
    assert flagged == below
    (commit, names), = report["provenance"]["commits"].items()  # one runner, one commit
    assert in_history(commit) and sorted(names) == sorted(f"{s} seed {k}" for s in SYSTEMS for k in DERIVED_SEEDS)
    assert report["provenance"]["pip_freeze"] == 4 and not report["provenance"]["unrecorded"]
    params = [report["systems"][s]["params"] for s in SYSTEMS]
    assert all(p and int(p.replace(",", "")) > 0 for p in params)


def test_markdown_readme_and_ea_fairseq_compare_agree(finished, derived):
    """quality.md (of the results with derived seeds) prints the report's numbers, as does
    ea-fairseq-compare's own table appended to it; both README updates (the runner's, the
    report command's) rewrite only the generated block, with the report's Δ and CI."""
    tmp, _, _, real_report = finished
    _, _, report = derived
    md = (tmp / "derived.md").read_text(encoding="utf-8")
    for text in (md, (tmp / "res.md").read_text(encoding="utf-8")):
        assert text.startswith(f"# Progress after {UPDATES} updates on a corpus of {TRAIN} training pairs: "
                               "every family from scratch")
        assert f"### sacreBLEU after {UPDATES} updates" in text
    for m in ("sacrebleu", "chrf"):
        x = report["systems"]["realformer_lite"]["metrics"][m]
        base = report["systems"]["transformer_lite"]["metrics"][m]
        assert f"| transformer_lite | 2 of 2 | {' / '.join(f'{v:.2f}' for v in base['scores'])} | " \
               f"{base['mean']:.2f} ± {base['std']:.2f} | – |" in md
        ci = f"[{x['ci'][0]:+.2f}, {x['ci'][1]:+.2f}]"
        assert f"| {x['delta']:+.2f} | {ci} | " in md
    # ea-fairseq-compare's own table (appended verbatim) prints the same Δ, CI and p
    compare = report["ea_fairseq_compare"]["output"]
    assert report["ea_fairseq_compare"]["command"].startswith("ea-fairseq-compare --agreement")
    rows = [[c.strip() for c in r.split("|")] for r in compare.splitlines() if r.startswith("| realformer_lite")]
    assert len(rows) == 2
    for row, m in zip(rows, ("sacrebleu", "chrf")):
        x = report["systems"]["realformer_lite"]["metrics"][m]
        assert row[5:7] == [f"{x['delta']:+.2f}", f"[{x['ci'][0]:+.2f}, {x['ci'][1]:+.2f}]"]
        assert row[8] == (f"{x['p']:.4f}" if x["p"] is not None else "–") and row[-2] == x["agreement"]
    original = (tmp / "README.original.md").read_text(encoding="utf-8")  # (the checkout's may change meanwhile)
    begin, end = "<!-- begin: generated", "<!-- end: generated"
    for name, rep, seeds in (("README.md", real_report, "1 of 1"), ("README.derived.md", report, "2 of 2")):
        readme = (tmp / name).read_text(encoding="utf-8")
        assert readme[:readme.index(begin)] == original[:original.index(begin)]
        assert readme[readme.index(end):] == original[original.index(end):]
        b = rep["systems"]["realformer_lite"]["metrics"]["sacrebleu"]
        ci = b["welch_ci"] or b["ci"]
        assert f"| realformer_lite | {seeds} | " in readme
        assert f"| {b['delta']:+.2f} [{ci[0]:+.2f}, {ci[1]:+.2f}] (p " in readme
        assert f"Progress after {UPDATES} updates on a corpus of {TRAIN} training pairs" in readme


def test_a_finished_run_is_kept_and_another_budget_refused(finished):
    tmp, res, common, _ = finished
    before = {p: p.read_bytes() for p in res.glob("runs/*/seed*/run.json")}
    again = quality("run", *common)
    assert "0 run(s) to do" in again.stderr
    assert {p: p.read_bytes() for p in res.glob("runs/*/seed*/run.json")} == before
    at = common.index("--updates") + 1
    other = quality("run", *common[:at], UPDATES + 1, *common[at + 1:], check=False)
    assert other.returncode != 0
    assert other.stderr.strip().splitlines()[-1].startswith("quality.py: ")
    assert "another budget" in other.stderr and "Traceback" not in other.stderr


def test_the_plans_other_comparisons_join_the_holm_family(derived, tmp_path):
    """A comparison config.json names beside the baseline's (here realformer_lite against
    transformer_lite: the baseline comparison itself under another name, so the same Δ and tests)
    is reported with its statistics and joins Holm's family, four tests where there were two; one
    whose system has no run is listed as not run; quality.md prints both."""
    quality_results, quality_report = benchmarks_module("quality_results"), benchmarks_module("quality_report")
    from ea_fairseq_cli import significance

    _, res, report = derived
    results = tmp_path / "res"
    shutil.copytree(res, results, symlinks=True)
    config = json.loads((results / "config.json").read_text())
    config["comparisons"] = [["realformer_lite", "transformer_lite"], ["realformer_lite", "ea_transformer_lite"]]
    (results / "config.json").write_text(json.dumps(config))
    out = quality_results.build(str(results))
    pair, missing = out["comparisons"]["realformer_lite vs transformer_lite"], out["comparisons"][
        "realformer_lite vs ea_transformer_lite"]
    assert missing is None
    tests = []
    for m in ("sacrebleu", "chrf"):
        alone = report["systems"]["realformer_lite"]["metrics"][m]
        assert pair[m]["delta"] == pytest.approx(alone["delta"]) and pair[m]["p"] == pytest.approx(alone["p"])
        assert pair[m]["ci"] == pytest.approx(alone["ci"]) and pair[m]["sign"] == alone["sign"]
        tests += [out["systems"]["realformer_lite"]["metrics"][m], pair[m]]
    assert [t["p_holm"] for t in tests] == pytest.approx(significance.holm([t["p"] for t in tests]))
    text = quality_report.markdown(out, {"command": "ea-fairseq-compare", "output": ""}, None)
    assert "### The plan's other comparisons" in text
    assert "| realformer_lite vs ea_transformer_lite | – | not run yet" in text
    assert f"| realformer_lite vs transformer_lite | sacreBLEU | {quality_results._f(pair['sacrebleu']['delta'], signed=True)} |" in text


def test_a_rerun_at_the_same_commit_translates_alike_and_a_difference_is_reported(finished, tmp_path):
    """``run --rerun`` trains the plan's transformer_lite seed 1 again into reruns/ (the fixture
    runs no EA): on the same code and machine its hypotheses are the stored run's, 0 of the
    test sentences differ; one hypothesis changed is reported as 1 of them."""
    quality_reruns = benchmarks_module("quality_reruns")
    tmp, res, common, _ = finished
    results = tmp_path / "res"
    shutil.copytree(res, results, symlinks=True)
    argv = [str(results) if str(a) == str(res) else a for a in common]
    done = quality("run", *argv, "--rerun", check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    trained = [line for line in done.stderr.splitlines() if ": training (" in line]
    assert len(trained) == 1 and "reruns/transformer_lite/seed1" in trained[0], done.stderr[-2000:]
    (row,) = quality_reruns.compared(str(results))
    assert (row["system"], row["seed"], row["different"], row["sentences"]) == ("transformer_lite", 1, 0, TEST)
    assert all(a == b for a, b in row["scores"].values()) and row["rerun"]["commit"] == row["stored"]["commit"]
    hyp = results / "reruns" / "transformer_lite" / "seed1" / "eval" / "test.es-en.hyp.sacrebleu"
    hyp.write_text("changed\n" + "".join(line + "\n" for line in lines(hyp)[1:]), encoding="utf-8")
    (row,) = quality_reruns.compared(str(results))
    assert row["different"] == 1
    assert f"| 1 of {TEST} |" in "\n".join(quality_reruns.section([row]))
    again = quality("run", *argv, "--rerun", check=False)  # done once: kept, not trained again
    assert again.returncode == 0 and "seed 1 again: finished, kept" in again.stderr, again.stderr[-2000:]
    record = results / "reruns" / "transformer_lite" / "seed1" / "run.json"
    record.write_text(json.dumps(dict(json.loads(record.read_text()), status="failed", failure="demo.sh exited 1")))
    (row,) = quality_reruns.compared(str(results))  # a failed re-run is a row that says so, not left out
    assert row["problem"] == "the re-run failed: demo.sh exited 1"
    assert "| the re-run failed: demo.sh exited 1 |" in "\n".join(quality_reruns.section([row]))


def test_a_comparison_over_some_seeds_takes_their_runs_alone(derived, monkeypatch):
    """The plan's sensitivity analysis compares the primary pair over some seeds alone (6 to
    10): here realformer_lite against transformer_lite over seed 2, whose Δ is the difference
    of those two runs' scores (not of the means over seeds 1 and 2); it joins Holm's family."""
    quality_results = benchmarks_module("quality_results")
    from ea_fairseq_cli import significance

    _, res, report = derived
    monkeypatch.setattr(quality_results, "SENSITIVITY", (("realformer_lite", "transformer_lite", (2,)),))
    out = quality_results.build(str(res))
    subset = out["comparisons"]["realformer_lite vs transformer_lite, seed 2"]
    tests = []
    for m in ("sacrebleu", "chrf"):
        scores = {s: report["systems"][s]["runs"]["2"]["scores"][m] for s in SYSTEMS}
        assert subset[m]["delta"] == pytest.approx(scores["realformer_lite"] - scores["transformer_lite"])
        assert subset[m]["delta"] != pytest.approx(out["systems"]["realformer_lite"]["metrics"][m]["delta"])
        tests += [out["systems"]["realformer_lite"]["metrics"][m], subset[m]]
    assert [t["p_holm"] for t in tests] == pytest.approx(significance.holm([t["p"] for t in tests]))
    with pytest.raises(ValueError, match="consecutive"):
        quality_results.comparison_name("realformer_lite", "transformer_lite", (6, 8))


def test_scored_learning_curve_points_give_the_report_its_section_and_figure(derived, tmp_path):
    """Results holding learning-curve points (quality_curves.py) report them: quality.md gets the
    section, with the figure beside the runs; results without them report as before."""
    quality_report = benchmarks_module("quality_report")
    _, res, _ = derived
    results = tmp_path / "quality"
    shutil.copytree(res, results, symlinks=True)
    point = results / "curves" / "ea_transformer_lite" / "seed6" / "update240"
    point.mkdir(parents=True)
    (point / "valid.es-en.scores.json").write_text(json.dumps(
        {"metrics": {"sacrebleu": {"score": 3.5}, "chrf": {"score": 21.0}}}))
    written = quality_report.report(str(results))
    text = (tmp_path / "quality.md").read_text()
    assert "## Learning curves" in text and "| 240 | 3.50 (1) | 21.00 (1) |" in text
    assert "![learning curves](quality/curves.svg)" in text and str(results / "curves.svg") in written
    shutil.rmtree(results / "curves")
    (results / "curves.svg").unlink()
    quality_report.report(str(results))
    assert "## Learning curves" not in (tmp_path / "quality.md").read_text()
    assert not (results / "curves.svg").exists()
