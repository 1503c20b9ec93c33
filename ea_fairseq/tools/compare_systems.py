"""BLEU of several systems over their seeds, and a paired bootstrap test against a baseline.

  ea-fairseq-compare [--metric NAME] [-s SRC -t TGT] [--subset test]
      [--samples 1000] [--seed 12345] BASELINE [SYSTEM ...]

Each BASELINE/SYSTEM is a checkpoint directory that ``examples/translation/evaluate.sh`` has scored: one
run (``DIR/eval/SUBSET.SRC-TGT.scores.json``) or one run per seed (``DIR/seed*/eval/...``,
as ``SEEDS="1 2 3" train.sh`` lays them out); ``NAME=DIR`` names it in the table. Printed,
one table: every run's BLEU, mean ± standard deviation over the runs (ddof 1), and for each
system the difference of means to the baseline, its 95% bootstrap interval and p-value.

The test resamples the test sentences with replacement (``--samples`` times, numpy seed
``--seed``; sacreBLEU's defaults 1000 and 12345) and scores each system on every resample
as the mean BLEU of its runs, from sacreBLEU's sufficient statistics of the files
evaluate.sh wrote. The p-value is sacreBLEU's ``--paired-bs`` (two-sided; with one run per
system the same number) except for ties: a resample whose difference is as large as the
observed one counts against significance, so two identical systems get p = 1, where
sacreBLEU 2.6 reports p = 0.001. The resampling measures the test set's sampling noise of
the seed-averaged systems, not the spread between training runs: read it with the std.

--metric: the BLEU to compare (names as ea-fairseq-bleu writes them): tok (tokenized, IWSLT's),
split-fairseq / split-t2t (WMT'14 En-De compound-split conventions), sacrebleu
(detokenized); default: the first BLEU of the evaluation mode (tok for iwslt and wmt,
split-fairseq for wmt14-en-de).
"""
import argparse
import glob
import hashlib
import json
import os
import re
import sys
from typing import Dict, List

import numpy as np

from . import bleu as bleu_script


def _seed_key(path: str):
    m = re.search(r"seed(\d+)$", os.path.basename(os.path.normpath(path)))
    return (int(m.group(1)) if m else 1 << 30, path)


def find_runs(path: str, pattern: str) -> List[str]:
    """The scores.json files of a system: its own run, or one per seed directory."""
    if path.endswith(".json"):
        return [path]
    own = sorted(glob.glob(os.path.join(path, "eval", pattern)))
    if own:
        return own[:1] if len(own) == 1 else _one(path, own)
    seeds = sorted(glob.glob(os.path.join(path, "seed*", "")), key=_seed_key)
    runs = []
    for seed_dir in seeds:
        found = sorted(glob.glob(os.path.join(seed_dir, "eval", pattern)))
        if found:
            runs.append(_one(seed_dir, found)[0])
    if not runs:
        raise SystemExit(f"ea-fairseq-compare: no {pattern} under {path}/eval or {path}/seed*/eval: "
                         "score it with examples/translation/evaluate.sh first")
    return runs


def _one(where: str, found: List[str]) -> List[str]:
    if len(found) > 1:
        raise SystemExit(f"ea-fairseq-compare: {where} holds scores of several test sets or directions "
                         f"({', '.join(os.path.basename(f) for f in found)}): give -s/-t/--subset")
    return found


def load_run(path: str, metric: str):
    with open(path, encoding="utf-8") as f:
        report = json.load(f)
    metric = metric or report["primary"]
    if metric not in report["metrics"] or "hyp" not in report["metrics"][metric]:
        raise SystemExit(f"ea-fairseq-compare: {path} has no '{metric}' files "
                         f"(it has: {', '.join(report['metrics'])})")
    entry = report["metrics"][metric]
    base = os.path.dirname(path)
    read = lambda name: open(os.path.join(base, name), encoding="utf-8").read().split("\n")[:-1]  # noqa: E731
    return dict(path=path, metric=metric, label=entry["label"], score=entry["score"],
                hyps=read(entry["hyp"]), refs=read(entry["ref"]), report=report)


def sufficient_stats(metric_name: str, hyps: List[str], refs: List[str]) -> np.ndarray:
    metric = bleu_script.bleu_metric(metric_name)
    return np.array(metric._extract_corpus_statistics(hyps, [refs]), dtype="float32")


def resampled_scores(metric_name: str, stats: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """BLEU of each resample (rows of ``counts``: how often each sentence is drawn)."""
    metric = bleu_script.bleu_metric(metric_name)
    sums = counts @ stats
    return np.array([metric._compute_score_from_stats(s).score for s in sums])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("systems", nargs="+", metavar="[NAME=]DIR", help="the first is the baseline")
    p.add_argument("--metric", choices=sorted(bleu_script.METRICS), help="default: the mode's first BLEU")
    p.add_argument("-s", "--source-lang")
    p.add_argument("-t", "--target-lang")
    p.add_argument("--subset", default="test")
    p.add_argument("--samples", type=int, default=1000, help="bootstrap resamples [1000]")
    p.add_argument("--seed", type=int, default=12345, help="numpy seed of the resampling [12345]")
    args = p.parse_args(argv)

    direction = f"{args.source_lang}-{args.target_lang}" if args.source_lang and args.target_lang else "*"
    pattern = f"{args.subset}.{direction}.scores.json"
    systems: Dict[str, List[dict]] = {}
    for spec in args.systems:
        name, sep, path = spec.partition("=")
        if not sep:
            name, path = os.path.basename(os.path.normpath(spec)), spec
        if name in systems:
            raise SystemExit(f"ea-fairseq-compare: two systems named {name}: name them NAME=DIR")
        systems[name] = [load_run(f, args.metric) for f in find_runs(path, pattern)]

    first = next(iter(systems.values()))[0]
    metric = args.metric or first["metric"]
    refs_hash = hashlib.sha256("\n".join(first["refs"]).encode()).hexdigest()
    for name, runs in systems.items():
        for run in runs:
            if run["metric"] != metric:
                raise SystemExit(f"ea-fairseq-compare: {run['path']} defaults to {run['metric']}, "
                                 f"{first['path']} to {metric}: give --metric")
            if hashlib.sha256("\n".join(run["refs"]).encode()).hexdigest() != refs_hash:
                raise SystemExit(f"ea-fairseq-compare: {run['path']} was scored on other references "
                                 f"(or other sentences) than {first['path']}: not comparable")
    n = len(first["refs"])
    rng = np.random.default_rng(args.seed)
    idxs = rng.choice(n, size=(args.samples, n), replace=True)  # as sacreBLEU draws them
    counts = np.zeros((args.samples, n), dtype="float32")
    np.add.at(counts, (np.arange(args.samples)[:, None], idxs), 1)

    rows, base = [], None
    for k, (name, runs) in enumerate(systems.items()):
        scores = np.array([run["score"] for run in runs])
        samples = np.mean([resampled_scores(metric, sufficient_stats(metric, run["hyps"], run["refs"]), counts)
                           for run in runs], axis=0)
        mean = scores.mean()
        spread = f"{mean:.2f} ± {scores.std(ddof=1):.2f}" if len(scores) > 1 else f"{mean:.2f}"
        row = [name, str(len(runs)), " ".join(f"{s:.2f}" for s in scores), spread]
        if base is None:
            base = (mean, samples)
            row += ["–", "–", "–"]
        else:
            diff = mean - base[0]
            sample_diffs = samples - base[1]
            spread = np.abs(sample_diffs)
            centred = spread - spread.mean()
            p_value = (np.sum(centred >= abs(diff)).item() + 1) / (args.samples + 1)
            low, high = np.percentile(sample_diffs, [2.5, 97.5])
            row += [f"{diff:+.2f}", f"[{low:+.2f}, {high:+.2f}]", f"{p_value:.4f}"]
        rows.append(row)

    report = first["report"]
    coverage = (f"{report['translated']} of {report['sentences']} sentences"
                if report["translated"] != report["sentences"] else f"{n} sentences")
    print(f"{first['label']}; {args.subset} set, {coverage}")
    print(f"p: paired bootstrap, {args.samples} resamples of the test sentences (seed {args.seed}), "
          "each system scored as the mean of its runs; baseline: " + next(iter(systems)))
    head = ["system", "runs", "BLEU of each run", "mean ± std", "Δ mean", "95% CI of Δ", "p"]
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    fmt = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    print(fmt(head))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print(fmt(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
