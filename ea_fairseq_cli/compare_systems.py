"""Scores of several systems over their seeds, and a paired significance test against a
baseline, for every metric.

  ea-fairseq-compare [--metric NAME ...] [--test {bs,ar}] [--samples N] [--seed 12345]
      [--agreement] [-s SRC -t TGT] [--subset test] BASELINE [SYSTEM ...]

Each BASELINE/SYSTEM is a checkpoint directory that ``examples/translation/evaluate.sh`` has
scored: one run (``DIR/eval/SUBSET.SRC-TGT.scores.json``) or one run per seed
(``DIR/seed*/eval/...``, as ``SEEDS="1 2 3" train.sh`` lays them out); ``NAME=DIR`` names it
in the tables. One table per metric: every run's score, mean ± standard deviation over the
runs (ddof 1), and for each system the difference of means to the baseline and a p-value.

Metrics (``--metric``, default: all of them):

* the sacreBLEU metrics ea-fairseq-bleu wrote (names as in its scores.json): tok, split-fairseq,
  split-t2t, sacrebleu (BLEU variants), chrf, chrf++. The test is sacreBLEU's own
  ``sacrebleu.significance.PairedTest``: paired bootstrap resampling (``--test bs``, Koehn
  2004; sacreBLEU's ``--paired-bs``) or approximate randomisation (``--test ar``, Riezler and
  Maxwell 2005; ``--paired-ar``), ``--samples`` resamples/trials (sacreBLEU's defaults: 1000
  for bs, 10000 for ar), seeded with ``--seed`` (``SACREBLEU_SEED``, default 12345). The
  table's header holds the metric's sacreBLEU signature, with the test's settings.
* any other metric, from segment-level scores: a file ``SUBSET.SRC-TGT.seg.NAME`` beside each
  run's scores.json (``DIR/eval/`` or ``DIR/seedN/eval/``) with one score per line, in test-set
  order, for every translated sentence (the lines of ``SUBSET.SRC-TGT.hyp.tok``): COMET,
  MetricX, BLEURT, ... computed elsewhere. A run's score is the mean of its segment scores;
  the test is the same paired bootstrap (or approximate randomisation) applied to segment
  means: the same resampled sentence indices as sacreBLEU draws, the same p-value
  (``(c + 1) / (samples + 1)``, c counting resamples whose centred |difference| exceeds the
  observed one).

With several runs per system, every run of the system is tested against every run of the
baseline and the table shows the largest p-value (a difference is called significant only if
it is so for every pair of runs); with one run each, the p-value is sacreBLEU's. Identical
outputs get p = 1 (sacreBLEU's bootstrap would give 1/(samples+1)). The resampling measures
the test set's sampling noise, not the spread between training runs: read it with the std.

``--agreement``: beside each difference, how often a difference of that size agrees with human
judgements on which of two systems is better, and which system that is (the sign of Δ): the
deltas of 55% and 70% pairwise accuracy of Kocmi et al., 2024, "Navigating the Metrics Maze:
Reconciling Score Magnitudes and Accuracies", ACL (Table 1; the MT-Thresholds tool): BLEU 0.52 /
1.39, chrF 0.33 / 1.00, COMET-22 0.10 / 0.35 (on COMET's 0-100 scale). They were fitted on
sacreBLEU's BLEU and chrF with its default settings on detokenized text and on COMET-22
(``Unbabel/wmt22-comet-da``), so they are shown only for those: ``sacrebleu`` with sacreBLEU's
default signature, ``chrf`` where ea-fairseq-bleu scored detokenized text against raw
references (``--mode wmt14-en-de``/``wmt``, not ``iwslt``), and ``comet`` where every run's
scores.json names ``Unbabel/wmt22-comet-da`` (ea-fairseq-bleu records it). Tokenized and
compound-split BLEU, chrF on tokenized text, chrF++ and COMET of any other model get no
thresholds; a line under their table says why.
"""
import argparse
import glob
import hashlib
import json
import logging
import os
import re
import sys
from typing import Dict, List, Optional, Tuple

import numpy as np

from . import bleu as bleu_script

# Kocmi et al. (2024), Table 1: metric delta for 55% / 70% pairwise accuracy with humans
AGREEMENT = {"BLEU": (0.52, 1.39), "chrF": (0.33, 1.00), "COMET-22": (0.10, 0.35)}
COMET22 = "Unbabel/wmt22-comet-da"  # the COMET-22 of Kocmi et al.
SEGMENTS = re.compile(r"^(?P<prefix>.+)\.seg\.(?P<name>[^/]+)$")


def _unversioned(signature: str) -> str:
    return "|".join(part for part in str(signature).split("|") if not part.startswith("version:"))


def agreement_of(metric: str, runs: List["Run"]) -> Tuple[Optional[str], str]:
    """The Kocmi et al. (2024) metric whose thresholds apply to ``metric`` as these runs computed
    it, or None and why not: the thresholds hold for the variant they were fitted on only."""
    if metric == "sacrebleu" or metric == "chrf":
        cls = "BLEU" if metric == "sacrebleu" else "chrF"
        default_metric = bleu_script.sacrebleu_metric(metric)
        default_metric.corpus_score(["x"], [["x"]])  # (a signature names the number of references)
        default = _unversioned(default_metric.get_signature())
        if any(_unversioned(r.report["metrics"][metric]["signature"]) != default for r in runs):
            return None, f"not sacreBLEU's default {cls} signature, which the thresholds were fitted on"
        if metric == "chrf" and any("sacrebleu" not in bleu_script.MODE_METRICS.get(r.report["mode"], [])
                                    for r in runs):
            return None, ("chrF on tokenized text (--mode iwslt); the thresholds were fitted on detokenized "
                          "text against raw references")
        return cls, ""
    if metric == "comet":
        models = {(r.report["metrics"].get("comet") or {}).get("model") for r in runs}
        if models == {COMET22}:
            return "COMET-22", ""
        named = ", ".join(sorted(str(m) for m in models if m)) or "not recorded in scores.json"
        return None, (f"the COMET model ({named}) is not {COMET22} (COMET-22), which the thresholds "
                      "were fitted on")
    if metric in ("tok", "split-fairseq", "split-t2t"):
        return None, ("tokenized BLEU; the thresholds were fitted on sacreBLEU's BLEU of detokenized text "
                      "(metric sacrebleu)")
    return None, "Kocmi et al. (2024) give no thresholds for it"


def agreement_label(diff: float, thresholds: Tuple[float, float], system: str, baseline: str) -> str:
    """How often humans agree with a difference this large, and on which system: the better one
    by the sign of ``diff`` (system minus baseline; every thresholded metric is higher-better)."""
    if diff == 0:
        return "no difference"
    better = system if diff > 0 else baseline
    if abs(diff) < thresholds[0]:
        return f"below 55% (humans may prefer either; {better} scores higher)"
    share = "55% to 70%" if abs(diff) < thresholds[1] else "70% or more"
    return f"{share}: humans would prefer {better}"


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


def _lines(path: str) -> List[str]:
    with open(path, encoding="utf-8") as f:
        return f.read().split("\n")[:-1]


class Run:
    """One evaluated run: its scores.json, the texts each sacreBLEU metric scored, and the
    segment-score files beside it."""

    def __init__(self, path: str):
        self.path = path
        with open(path, encoding="utf-8") as f:
            self.report = json.load(f)
        self.dir = os.path.dirname(path)
        self.prefix = path[:-len(".scores.json")] if path.endswith(".scores.json") else os.path.splitext(path)[0]
        self.segment_files = {m.group("name"): f for f in glob.glob(glob.escape(self.prefix) + ".seg.*")
                              if (m := SEGMENTS.match(f))}
        self.sentences = self.report["translated"]

    def sacrebleu_names(self) -> List[str]:
        """The metrics of the run's evaluation mode, in ea-fairseq-bleu's order."""
        order = bleu_script.MODE_METRICS.get(self.report["mode"], [])
        return [m for m in order if m in self.report["metrics"]]

    def texts(self, metric: str) -> Tuple[List[str], List[str]]:
        entry = self.report["metrics"].get(metric)
        if entry is None or "hyp" not in entry:
            raise SystemExit(f"ea-fairseq-compare: {self.path} has no '{metric}' files "
                             f"(it has: {', '.join(self.report['metrics'])})")
        return _lines(os.path.join(self.dir, entry["hyp"])), _lines(os.path.join(self.dir, entry["ref"]))

    def segments(self, metric: str) -> np.ndarray:
        path = self.segment_files.get(metric)
        if path is None:
            raise SystemExit(f"ea-fairseq-compare: no segment scores {self.prefix}.seg.{metric} "
                             "(one score per line per translated sentence)")
        values = []
        for i, line in enumerate(_lines(path), 1):
            try:
                values.append(float(line))
            except ValueError:
                raise SystemExit(f"ea-fairseq-compare: {path} line {i}: {line[:40]!r} is not a number "
                                 "(one score per line)") from None
        if len(values) != self.sentences:
            raise SystemExit(f"ea-fairseq-compare: {path} has {len(values)} scores but the run translated "
                             f"{self.sentences} sentences: one score per line, in test-set order")
        if not np.all(np.isfinite(values)):
            raise SystemExit(f"ea-fairseq-compare: {path} holds a non-finite score")
        return np.array(values, dtype=np.float64)


def _p_value(sample_stats: np.ndarray, observed: float) -> float:
    """sacreBLEU's p-value of a paired test: (c + 1) / (n + 1), c counting samples above the
    observed statistic (as ``bootstrap-hypothesis-difference-significance.pl`` and multeval)."""
    return (np.sum(sample_stats > observed).item() + 1) / (len(sample_stats) + 1)


def segment_test(base: np.ndarray, system: np.ndarray, test: str, samples: int, seed: Optional[int]) -> float:
    """p-value of the difference of segment means, with the resamples sacreBLEU draws.

    ``bs``: paired bootstrap (Koehn 2004): the mean of each system over the same resampled
    sentences; the statistic is |difference| centred on its resampling mean.
    ``ar``: approximate randomisation: each sentence's pair of scores swapped with
    probability 1/2; the statistic is the |difference| of the shuffled systems."""
    n = len(base)
    observed = abs(system.mean() - base.mean())
    rng = np.random.default_rng(seed)
    if test == "bs":
        idxs = rng.choice(n, size=(samples, n), replace=True)
        diffs = np.abs(system[idxs].mean(1) - base[idxs].mean(1))
        return _p_value(diffs - diffs.mean(), observed)
    pos = rng.integers(2, size=(samples, n), dtype=bool)
    a = np.where(pos, base, system).mean(1)
    b = np.where(pos, system, base).mean(1)
    return _p_value(np.abs(a - b), observed)


def sacrebleu_tests(metric: str, baseline: List[Run], systems: Dict[str, List[Run]], test: str,
                    samples: int) -> Tuple[Dict[str, float], str]:
    """Largest p-value over (baseline run, system run) pairs, per system, from sacreBLEU's
    PairedTest; and the metric's signature with the test's settings."""
    from sacrebleu.significance import PairedTest

    worst: Dict[str, float] = {name: 0.0 for name in systems}
    signature = ""
    for base in baseline:
        base_hyps, refs = base.texts(metric)
        named = [("baseline", base_hyps)]
        owner = {}
        for name, runs in systems.items():
            for i, run in enumerate(runs):
                hyps = run.texts(metric)[0]
                if hyps == base_hyps:  # identical outputs: no difference to test
                    continue
                named.append((f"{name}#{i}", hyps))
                owner[f"{name}#{i}"] = name
        if len(named) > 1:
            paired = PairedTest(named, {metric: bleu_script.sacrebleu_metric(metric)}, [refs],
                                test_type=test, n_samples=samples)
            signatures, scores = paired()
            key = next(iter(signatures))  # PairedTest keys its results by the score's name (BLEU, chrF2, ...)
            signature = signatures[key].format()
            for sys_name, result in zip(scores["System"][1:], scores[key][1:]):
                worst[owner[sys_name]] = max(worst[owner[sys_name]], result.p_value)
        for name, runs in systems.items():
            if any(run.texts(metric)[0] == base_hyps for run in runs):
                worst[name] = 1.0
    if not signature:  # every output identical to the baseline's: no test run
        signature = baseline[0].report["metrics"][metric]["signature"]
    return worst, signature


def _table(rows: List[List[str]], head: List[str]) -> List[str]:
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    fmt = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return [fmt(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [fmt(r) for r in rows]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("systems", nargs="+", metavar="[NAME=]DIR", help="the first is the baseline")
    p.add_argument("--metric", nargs="+", metavar="NAME",
                   help="metrics to compare: names of ea-fairseq-bleu's scores.json (tok, split-fairseq, "
                        "split-t2t, sacrebleu, chrf, chrf++) or of segment-score files SUBSET.SRC-TGT.seg.NAME "
                        "(default: every metric all runs have)")
    p.add_argument("--test", choices=("bs", "ar"), default="bs",
                   help="paired bootstrap resampling (bs, default) or approximate randomisation (ar)")
    p.add_argument("--samples", type=int, default=None,
                   help="bootstrap resamples / randomisation trials [sacreBLEU's: 1000 for bs, 10000 for ar]")
    p.add_argument("--seed", type=int, default=12345, help="seed of the resampling [12345, sacreBLEU's]")
    p.add_argument("--agreement", action="store_true",
                   help="beside each difference, how often humans agree on which system is better "
                        "(Kocmi et al., 2024): for sacreBLEU's detokenized BLEU and chrF and for COMET-22 "
                        "(Unbabel/wmt22-comet-da) only, the variants the thresholds were fitted on")
    p.add_argument("-s", "--source-lang")
    p.add_argument("-t", "--target-lang")
    p.add_argument("--subset", default="test")
    args = p.parse_args(argv)
    logging.basicConfig(format="%(levelname)s | %(name)s | %(message)s", level=logging.WARNING)
    samples = args.samples or {"bs": 1000, "ar": 10000}[args.test]
    if samples < 1:
        raise SystemExit("ea-fairseq-compare: --samples must be at least 1")
    os.environ["SACREBLEU_SEED"] = str(args.seed)  # how sacreBLEU's PairedTest is seeded

    direction = f"{args.source_lang}-{args.target_lang}" if args.source_lang and args.target_lang else "*"
    pattern = f"{args.subset}.{direction}.scores.json"
    systems: Dict[str, List[Run]] = {}
    for spec in args.systems:
        name, sep, path = spec.partition("=")
        if not sep:
            name, path = os.path.basename(os.path.normpath(spec)), spec
        if name in systems:
            raise SystemExit(f"ea-fairseq-compare: two systems named {name}: name them NAME=DIR")
        systems[name] = [Run(f) for f in find_runs(path, pattern)]

    runs = [run for rs in systems.values() for run in rs]
    first = runs[0]
    sacre = [m for m in first.sacrebleu_names() if all(m in r.report["metrics"] for r in runs)]
    segment = sorted(set.intersection(*(set(r.segment_files) for r in runs)))
    if args.metric:
        for m in args.metric:
            if m not in bleu_script.METRICS and not all(m in r.segment_files for r in runs):
                lacking = next(r for r in runs if m not in r.segment_files)
                raise SystemExit(f"ea-fairseq-compare: '{m}' is neither a metric of ea-fairseq-bleu "
                                 f"({', '.join(bleu_script.METRICS)}) nor a segment-score file "
                                 f"{lacking.prefix}.seg.{m}")
        sacre = [m for m in args.metric if m in bleu_script.METRICS]
        segment = [m for m in args.metric if m not in bleu_script.METRICS]

    ref_metric = "tok" if "tok" in first.report["metrics"] else sacre[0] if sacre else None
    refs_hash = hashlib.sha256("\n".join(first.texts(ref_metric)[1]).encode()).hexdigest() if ref_metric else None
    for run in runs:
        if run.report["mode"] != first.report["mode"] and sacre:
            raise SystemExit(f"ea-fairseq-compare: {run.path} was scored in mode {run.report['mode']}, "
                             f"{first.path} in {first.report['mode']}: not comparable")
        if ref_metric and hashlib.sha256("\n".join(run.texts(ref_metric)[1]).encode()).hexdigest() != refs_hash:
            raise SystemExit(f"ea-fairseq-compare: {run.path} was scored on other references "
                             f"(or other sentences) than {first.path}: not comparable")

    names = list(systems)
    baseline, others = systems[names[0]], {n: systems[n] for n in names[1:]}
    report = first.report
    coverage = (f"{report['translated']} of {report['sentences']} sentences"
                if report["translated"] != report["sentences"] else f"{report['translated']} sentences")
    test_name = {"bs": f"paired bootstrap, {samples} resamples",
                 "ar": f"approximate randomisation, {samples} trials"}[args.test]
    print(f"{args.subset} set, {coverage}; baseline: {names[0]}; p: {test_name} of the test "
          f"sentences (seed {args.seed}), the largest over pairs of runs")
    for metric in sacre + segment:
        print(f"ea-fairseq-compare: {metric}: {test_name} ...", file=sys.stderr, flush=True)
        if metric in sacre:
            scores = {n: np.array([r.report["metrics"][metric]["score"] for r in rs]) for n, rs in systems.items()}
            pvalues, signature = sacrebleu_tests(metric, baseline, others, args.test, samples)
            label = report["metrics"][metric]["label"]
            title = f"{label}\nsacreBLEU signature: {signature}"
        else:
            segs = {n: [r.segments(metric) for r in rs] for n, rs in systems.items()}
            scores = {n: np.array([s.mean() for s in ss]) for n, ss in segs.items()}
            pvalues = {}
            for n in others:
                pvalues[n] = max(1.0 if np.array_equal(b, s) else
                                 segment_test(b, s, args.test, samples, args.seed)
                                 for b in segs[names[0]] for s in segs[n])
            title = f"{metric}: mean of the segment scores in {first.prefix}.seg.{metric} (and each run's)"
        agreed, why_not = agreement_of(metric, runs) if args.agreement else (None, "")
        thresholds = AGREEMENT[agreed] if agreed else None
        small = all(np.abs(x).max() <= 1.5 for x in scores.values())  # e.g. COMET's 0-1 scale
        digits = 4 if small else 2
        head = ["system", "runs", f"{metric} of each run", "mean ± std", "Δ mean", "p"]
        if thresholds:
            scale = ""
            if metric in segment and small:
                thresholds, scale = (thresholds[0] / 100, thresholds[1] / 100), ", scores on a 0-1 scale"
            head.append(f"human agreement of Δ (55% / 70% at {agreed} "
                        f"{thresholds[0]:.4g} / {thresholds[1]:.4g}{scale})")
        rows = []
        base_mean = scores[names[0]].mean()
        for n in names:
            s = scores[n]
            spread = (f"{s.mean():.{digits}f} ± {s.std(ddof=1):.{digits}f}" if len(s) > 1
                      else f"{s.mean():.{digits}f}")
            row = [n, str(len(s)), " ".join(f"{x:.{digits}f}" for x in s), spread]
            if n == names[0]:
                row += ["–", "–"] + (["–"] if thresholds else [])
            else:
                diff = s.mean() - base_mean
                row += [f"{diff:+.{digits}f}", f"{pvalues[n]:.4f}"]
                if thresholds:
                    row.append(agreement_label(diff, thresholds, n, names[0]))
            rows.append(row)
        print()
        print(title)
        print("\n".join(_table(rows, head)))
        if why_not:
            print(f"(no human-agreement thresholds: {why_not})")
    if args.agreement:
        print("\nhuman agreement: Kocmi et al. (2024), Navigating the Metrics Maze, ACL; "
              "the pairwise accuracy a metric difference of that size reaches against human judgements")
    return 0


if __name__ == "__main__":
    sys.exit(main())
