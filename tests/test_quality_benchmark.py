"""benchmarks/quality.py end to end on a tiny budget: two systems x two seeds trained through the
demo on a few hundred short verses of the shipped corpus, scored, and reported. The report's
arithmetic is checked against sacreBLEU itself (scores, paired bootstrap p-values of every pair
of runs on the same files) and the statistics module; Kocmi et al.'s thresholds are the paper's."""
import json
import lzma
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import sacrebleu
from sacrebleu.metrics import BLEU, CHRF
from sacrebleu.significance import PairedTest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "quality.py"
SYSTEMS, SEEDS = ("transformer_lite", "realformer_lite"), (1, 2)
BUDGET = ["--updates", "4", "--bpe-merges", "100", "--avg", "2", "--max-tokens", "512", "--warmup", "2"]
KOCMI = {"sacrebleu": (0.52, 1.39), "chrf": (0.33, 1.00)}  # Kocmi et al. (2024), Table 1


def tiny_corpus(out: Path) -> None:
    """Short verse pairs of the shipped corpus (quick BPE, training and beam search)."""
    out.mkdir()
    corpus = REPO / "examples" / "translation" / "bible-es-en"
    for split, n in (("train", 300), ("valid", 10), ("test", 16)):
        es = lzma.open(corpus / f"{split}.es.xz", "rt", encoding="utf-8").read().splitlines()
        en = lzma.open(corpus / f"{split}.en.xz", "rt", encoding="utf-8").read().splitlines()
        pairs = [(s, t) for s, t in zip(es, en) if len(s.split()) <= 12 and len(t.split()) <= 12][:n]
        assert len(pairs) == n
        for lang, k in (("es", 0), ("en", 1)):
            with lzma.open(out / f"{split}.{lang}.xz", "wt", encoding="utf-8") as f:
                f.writelines(p[k] + "\n" for p in pairs)


def quality(*args, check=True):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, check=check)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("quality")
    tiny_corpus(tmp / "corpus")
    readme = tmp / "README.md"
    readme.write_text((REPO / "README.md").read_text(encoding="utf-8"), encoding="utf-8")
    res = tmp / "res"
    # what a run killed half-way leaves: its staging directory and its work files
    (res / "runs" / "realformer_lite" / ".seed2.partial" / "eval").mkdir(parents=True)
    (res / "runs" / "realformer_lite" / ".seed2.partial" / "eval" / "test.es-en.scores.json").write_text("{")
    (tmp / "work" / "runs" / "realformer_lite" / "seed2" / "train" / "realformer_lite").mkdir(parents=True)
    (tmp / "work" / "runs" / "realformer_lite" / "seed2" / "train" / "realformer_lite" / "checkpoint_9_99.pt").write_text("")
    common = ["--results-dir", res, "--work-dir", tmp / "work", "--corpus", tmp / "corpus", *BUDGET,
              "--systems", *SYSTEMS, "--seeds", *SEEDS]
    done = quality("run", *common, "--update-readme", "--readme", readme, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp, res, common, json.loads((tmp / "res.json").read_text())


def lines(path: Path):
    return path.read_text(encoding="utf-8").split("\n")[:-1]


def run_files(res: Path, system: str, seed: int, name: str):
    eval_dir = res / "runs" / system / f"seed{seed}" / "eval"
    return lines(eval_dir / f"test.es-en.hyp.{name}"), lines(eval_dir / f"test.es-en.ref.{name}")


def sacrebleu_p(metric, base, hyp, refs) -> float:
    if base == hyp:  # ea-fairseq-compare's rule for identical outputs
        return 1.0
    os.environ["SACREBLEU_SEED"] = "12345"
    _, scores = PairedTest([("base", base), ("sys", hyp)], {"m": metric}, [refs], test_type="bs", n_samples=1000)()
    return next(v for k, v in scores.items() if k != "System")[1].p_value


def test_runs_are_recorded_in_the_repository_layout(finished):
    tmp, res, _, report = finished
    for system in SYSTEMS:
        for seed in SEEDS:
            run = res / "runs" / system / f"seed{seed}"
            record = json.loads((run / "run.json").read_text())
            assert record["status"] == "finished" and record["seed"] == seed and record["arch"] == system
            assert record["wall_s"] > 0 and record["cpu_s"] > 0 and record["train_wall_s"] >= 0
            assert record["machine"]["cores"] == os.cpu_count() and record["training"]["updates"] == 4
            assert f"DEMO_SEED={seed}" in record["commands"][0] and f"DEMO_ARCHS={system}" in record["commands"][0]
            assert "ea-fairseq-bleu" in record["commands"][1]
            assert (run / "train.log").exists()
            # references are one shared copy, linked; the hypotheses are the run's own
            assert (run / "eval" / "test.es-en.ref.sacrebleu").is_symlink()
            assert len(lines(run / "eval" / "test.es-en.hyp.sacrebleu")) == 16
    assert not list(res.glob("runs/*/.seed*.partial"))  # the half-finished run started again, cleanly
    assert not list((tmp / "work").glob("runs/realformer_lite/seed2/train/*/checkpoint_9_99.pt"))
    assert list((tmp / "work").glob("**/*.pt"))  # checkpoints live in the work dir, not in the results
    assert not list(res.glob("**/*.pt"))


def test_report_arithmetic_matches_sacrebleu(finished):
    tmp, res, _, report = finished
    raw = {lang: lzma.open(tmp / "corpus" / f"test.{lang}.xz", "rt", encoding="utf-8").read().splitlines()
           for lang in ("es", "en")}
    copy = report["copy_source"]["metrics"]
    assert copy["sacrebleu"]["score"] == pytest.approx(sacrebleu.corpus_bleu(raw["es"], [raw["en"]]).score)
    assert copy["chrf"]["score"] == pytest.approx(sacrebleu.corpus_chrf(raw["es"], [raw["en"]]).score)
    assert set(report["systems"]) == set(SYSTEMS) and report["baseline"] == "transformer_lite"
    below = set()
    for m, metric in (("sacrebleu", BLEU), ("chrf", CHRF)):
        score = {}
        for s in SYSTEMS:
            for k in SEEDS:
                hyp, ref = run_files(res, s, k, "sacrebleu")
                assert ref == raw["en"]
                score[s, k] = metric().corpus_score(hyp, [ref]).score
                assert report["systems"][s]["runs"][str(k)]["scores"][m] == pytest.approx(score[s, k])
                if score[s, k] <= copy[m]["score"]:
                    below.add(f"{s} seed {k}: {'sacreBLEU' if m == 'sacrebleu' else 'chrF'}")
            x = report["systems"][s]["metrics"][m]
            values = [score[s, k] for k in SEEDS]
            assert x["mean"] == pytest.approx(statistics.fmean(values))
            assert x["std"] == pytest.approx(statistics.stdev(values))
        x = report["systems"]["realformer_lite"]["metrics"][m]
        delta = statistics.fmean(score["realformer_lite", k] - score["transformer_lite", k] for k in SEEDS)
        assert x["delta"] == pytest.approx(delta)
        p = {(i, k): sacrebleu_p(metric(), run_files(res, "transformer_lite", i, "sacrebleu")[0],
                                 run_files(res, "realformer_lite", k, "sacrebleu")[0], raw["en"])
             for i in SEEDS for k in SEEDS}
        assert {int(k): v for k, v in x["p_same_seed"].items()} == {k: pytest.approx(p[k, k]) for k in SEEDS}
        assert x["p_all_pairs"] == pytest.approx(max(p.values()))
        low, high = KOCMI[m]
        assert x["agreement_thresholds"] == [low, high]
        assert x["agreement"] == ("below 55%" if abs(delta) < low else "55% to 70%" if abs(delta) < high
                                  else "70% or more")
    flagged = {f.split(",")[0].rsplit(" ", 1)[0] for f in report["findings"] if "copy-the-source" in f}
    assert flagged == below


def test_markdown_readme_and_ea_fairseq_compare_agree(finished):
    tmp, res, _, report = finished
    md = (tmp / "res.md").read_text(encoding="utf-8")
    for m in ("sacrebleu", "chrf"):
        x = report["systems"]["realformer_lite"]["metrics"][m]
        base = report["systems"]["transformer_lite"]["metrics"][m]
        assert f"| transformer_lite | 2 of 2 | {' / '.join(f'{v:.2f}' for v in base['scores'])} | " \
               f"{base['mean']:.2f} ± {base['std']:.2f} | – |" in md
        assert f"| {x['delta']:+.2f} | {x['p_same_seed']['1']:.4f} / {x['p_same_seed']['2']:.4f} | " \
               f"{x['p_all_pairs']:.4f} | {x['agreement']} |" in md
    # ea-fairseq-compare's own table (appended verbatim) prints the same largest p
    compare = report["ea_fairseq_compare"]["output"]
    assert report["ea_fairseq_compare"]["command"].startswith("ea-fairseq-compare --agreement")
    rows = [r for r in compare.splitlines() if r.startswith("| realformer_lite")]
    assert [r.split("|")[6].strip() for r in rows] == \
        [f"{report['systems']['realformer_lite']['metrics'][m]['p_all_pairs']:.4f}" for m in ("sacrebleu", "chrf")]
    readme = (tmp / "README.md").read_text(encoding="utf-8")
    original = (REPO / "README.md").read_text(encoding="utf-8")
    begin, end = "<!-- begin: generated", "<!-- end: generated"
    assert readme[:readme.index(begin)] == original[:original.index(begin)]
    assert readme[readme.index(end):] == original[original.index(end):]
    b = report["systems"]["realformer_lite"]["metrics"]["sacrebleu"]
    assert f"| {b['delta']:+.2f} (p {b['p_all_pairs']:.4f}; {b['agreement']}) |" in readme
    assert "CPU budget (4 updates, one CPU thread per run)" in readme


def test_a_finished_run_is_kept_and_another_budget_refused(finished):
    tmp, res, common, _ = finished
    before = {p: p.read_bytes() for p in res.glob("runs/*/seed*/run.json")}
    again = quality("run", *common)
    assert "0 run(s) to do" in again.stderr
    assert {p: p.read_bytes() for p in res.glob("runs/*/seed*/run.json")} == before
    other = quality("run", *[a if a != "4" else "5" for a in common], check=False)
    assert other.returncode != 0
    assert other.stderr.strip().splitlines()[-1].startswith("quality.py: ")
    assert "another budget" in other.stderr and "Traceback" not in other.stderr


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
