"""Scores of several systems over their seeds, and seed-level inference on the difference of
each system to a baseline, for every metric.

  ea-fairseq-compare [--metric NAME ...] [--bootstrap 1000] [--trials 10000] [--seed 12345]
      [--agreement] [-s SRC -t TGT] [--subset test] BASELINE [SYSTEM ...]

Each BASELINE/SYSTEM is a checkpoint directory that ``examples/translation/evaluate.sh`` has
scored: one run (``DIR/eval/SUBSET.SRC-TGT.scores.json``) or one run per seed
(``DIR/seed*/eval/...``, as ``SEEDS="1 2 3" train.sh`` lays them out); ``NAME=DIR`` names it
in the tables. One table per metric: every run's score, mean ± standard deviation over the
runs (ddof 1), and for each system against the baseline:

* Δ: the difference of the mean scores over the runs;
* its 95% CI by a hierarchical bootstrap (``--bootstrap`` resamples, seeded with ``--seed``):
  the test sentences resampled (the same resample for every run) and, within each system,
  its runs (with replacement): the spread between seeds and the test set's sampling noise in
  one interval. With one run per system it is the paired bootstrap CI of the test sentences;
* Welch's t over the per-run scores (two or more runs per system): its 95% CI and two-sided p;
* the exact two-sided permutation test of Δ over the runs' scores (every assignment of the
  scores to the two systems; sampled beyond 200,000), with the smallest p its counts can give:
  3 runs against 3 cannot go below 0.1, 5 against 5 below 0.0079. It is the test where one
  system has a single run (a line under the table says its seed spread is unknown);
* for two single runs, no seed-level test exists: p is a two-sided approximate randomisation
  test centred on zero (``--trials``, default 10,000: each sentence's pair of outputs swapped
  with probability 1/2; p = (c + 1) / (trials + 1), c counting trials at least as extreme as
  the observed |Δ|, so two outputs of equal score get p = 1; sacreBLEU's paired tests give
  smaller p: ea_fairseq_cli.significance);
* p after Holm's correction over every test the command reports: each system against the
  baseline in each metric, BLEU and chrF together;
* the sign agreement: of the pairs (baseline run, system run), how many differ in Δ's direction.

Metrics (``--metric``, default: all of them):

* the sacreBLEU metrics ea-fairseq-bleu wrote (names as in its scores.json): tok, split-fairseq,
  split-t2t, sacrebleu (BLEU variants), chrf, chrf++, resampled from sacreBLEU's sentence
  statistics (the corpus score of a resample is sacreBLEU's, from the summed statistics). The
  table's header holds the metric's sacreBLEU signature.
* any other metric, from segment-level scores: a file ``SUBSET.SRC-TGT.seg.NAME`` beside each
  run's scores.json (``DIR/eval/`` or ``DIR/seedN/eval/``) with one score per line, in test-set
  order, for every translated sentence (the lines of ``SUBSET.SRC-TGT.hyp.tok``): COMET,
  MetricX, BLEURT, ... computed elsewhere. A run's score is the mean of its segment scores.

``--agreement``: beside each difference, the range of human pairwise accuracy implied by the
CIs of Δ (every difference the bootstrap CI or Welch's CI holds; not Δ alone: with few runs the
bootstrap's resampling of them underestimates their spread, and Welch's t ignores the test
set's sampling noise): Kocmi et al., 2024, "Navigating the Metrics Maze:
Reconciling Score Magnitudes and Accuracies", ACL (Table 1; the MT-Thresholds tool): deltas of
55% and 70% accuracy BLEU 0.52 / 1.39, chrF 0.33 / 1.00, COMET-22 0.10 / 0.35 (on COMET's
0-100 scale). The system humans would prefer is named only when the CIs exclude zero and the
Holm-adjusted p is below 0.05, and it is the one with the higher score. The thresholds were calibrated on differences between WMT
systems; for other systems (small models, few updates, another domain) they are a rough guide,
which a line under the table says. They were fitted on sacreBLEU's BLEU and chrF with its
default settings on detokenized text and on COMET-22 (``Unbabel/wmt22-comet-da``), so they are
shown only for those: ``sacrebleu`` with sacreBLEU's default signature, ``chrf`` where
ea-fairseq-bleu scored detokenized text against raw references (``--mode wmt14-en-de``/``wmt``,
not ``iwslt``), and ``comet`` where every run's scores.json names ``Unbabel/wmt22-comet-da``.
Tokenized and compound-split BLEU, chrF on tokenized text, chrF++ and COMET of any other model
get no thresholds; a line under their table says why.
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

from . import add_version_option
from . import bleu as bleu_script
from . import significance as sig
from ._safety import ConfinedPathError, open_inside

# Kocmi et al. (2024), Table 1: metric delta for 55% / 70% pairwise accuracy with humans
AGREEMENT = {"BLEU": (0.52, 1.39), "chrF": (0.33, 1.00), "COMET-22": (0.10, 0.35)}
COMET22 = "Unbabel/wmt22-comet-da"  # the COMET-22 of Kocmi et al.
SEGMENTS = re.compile(r"^(?P<prefix>.+)\.seg\.(?P<name>[^/]+)$")


def _unversioned(signature: str) -> str:
    return "|".join(part for part in str(signature).split("|") if not part.startswith("version:"))


def _signature(metric: str) -> str:
    """sacreBLEU's signature of ``metric`` with the settings ea-fairseq-bleu scores it with."""
    m = bleu_script.sacrebleu_metric(metric)
    m.corpus_score(["x"], [["x"]])  # (a signature names the number of references)
    return str(m.get_signature())


def agreement_of(metric: str, runs: List["Run"]) -> Tuple[Optional[str], str]:
    """The Kocmi et al. (2024) metric whose thresholds apply to ``metric`` as these runs computed
    it, or None and why not: the thresholds hold for the variant they were fitted on only."""
    if metric == "sacrebleu" or metric == "chrf":
        cls = "BLEU" if metric == "sacrebleu" else "chrF"
        default = _unversioned(_signature(metric))
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


LIMIT_TEXT = 1 << 30  # bytes of a hypothesis, reference or segment-score file
LIMIT_SCORES = 1 << 24  # bytes of a scores.json


def _lines(path: str, root: str) -> List[str]:
    """The lines of ``path``, a file in the results directory ``root`` (links followed only
    within it: a scores.json names the files it opens)."""
    with open_inside(path, root, "r", limit=LIMIT_TEXT, encoding="utf-8") as f:
        return f.read().split("\n")[:-1]


#: what every scores.json ea-fairseq-bleu writes holds, and of which type
SCORES_FIELDS = {"mode": str, "sentences": int, "translated": int, "metrics": dict}


class Run:
    """One evaluated run: its scores.json, the texts each sacreBLEU metric scored, and the
    segment-score files beside it."""

    def __init__(self, path: str, root: Optional[str] = None):
        self.path = path
        self.dir = os.path.dirname(path)
        self.root = root if root is not None else self.dir  # what the files it names may resolve inside
        with open_inside(path, self.root, "r", limit=LIMIT_SCORES, encoding="utf-8") as f:
            self.report = json.load(f)
        if type(self.report) is not dict or any(type(self.report.get(k)) is not t for k, t in SCORES_FIELDS.items()):
            raise SystemExit(f"ea-fairseq-compare: {path} is not a scores file as ea-fairseq-bleu writes it (a dict "
                             f"with {', '.join(f'{k} ({t.__name__})' for k, t in SCORES_FIELDS.items())}): score the "
                             "run again with ea-fairseq-bleu")
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
        if not all(isinstance(entry.get(side), str) for side in ("hyp", "ref")):
            raise SystemExit(f"ea-fairseq-compare: {self.path}: the '{metric}' files are not file names: "
                             "score the run again with examples/translation/evaluate.sh")
        return (_lines(os.path.join(self.dir, entry["hyp"]), self.root),
                _lines(os.path.join(self.dir, entry["ref"]), self.root))

    def segments(self, metric: str) -> np.ndarray:
        path = self.segment_files.get(metric)
        if path is None:
            raise SystemExit(f"ea-fairseq-compare: no segment scores {self.prefix}.seg.{metric} "
                             "(one score per line per translated sentence)")
        values = []
        for i, line in enumerate(_lines(path, self.root), 1):
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


def scorer(metric: str, sentences: int, segment: bool) -> sig.Scorer:
    """The corpus score from the column sums of the sentence statistics: sacreBLEU's own
    computation for its metrics, the mean for segment scores."""
    if segment:
        return lambda sums: float(sums[0]) / sentences
    m = bleu_script.sacrebleu_metric(metric)
    return lambda sums: float(m._compute_score_from_stats(list(sums)).score)


def sentence_statistics(metric: str, run: Run, segment: bool) -> np.ndarray:
    """(sentences, k) statistics of a run: sacreBLEU's per-sentence sufficient statistics
    (n-gram matches and counts) of the files the run was scored on, or its segment scores."""
    if segment:
        return run.segments(metric)[:, None]
    hyps, refs = run.texts(metric)
    m = bleu_script.sacrebleu_metric(metric)
    stats = np.array(m._extract_corpus_statistics(hyps, [refs]), dtype=np.float64)
    recorded = run.report["metrics"][metric]["score"]
    computed = float(m._compute_score_from_stats(list(stats.sum(0))).score)
    if abs(computed - recorded) > 1e-6 * max(1.0, abs(recorded)):
        raise SystemExit(f"ea-fairseq-compare: {run.path} records {metric} {recorded} but its files score "
                         f"{computed}: the files were changed after scoring; score the run again")
    return stats


def _p(x: Optional[float]) -> str:
    return "–" if x is None else "undefined" if np.isnan(x) else f"{x:.4f}"


def _table(rows: List[List[str]], head: List[str]) -> List[str]:
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    fmt = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return [fmt(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [fmt(r) for r in rows]


CAVEAT = ("human agreement: Kocmi et al. (2024), Navigating the Metrics Maze, ACL: the range of pairwise accuracy "
          "against human judgements that the differences in the CIs of Δ (both of them) reach; calibrated on differences "
          "between WMT systems, a rough guide for other systems (small models, few updates, another domain)")


def main(argv=None) -> int:
    try:
        return _main(argv)
    except ConfinedPathError as err:  # a results folder naming a file outside it: one line
        raise SystemExit(f"ea-fairseq-compare: error: {err}") from None


def _main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("systems", nargs="+", metavar="[NAME=]DIR", help="the first is the baseline")
    p.add_argument("--metric", nargs="+", metavar="NAME",
                   help="metrics to compare: names of ea-fairseq-bleu's scores.json (tok, split-fairseq, "
                        "split-t2t, sacrebleu, chrf, chrf++) or of segment-score files SUBSET.SRC-TGT.seg.NAME "
                        "(default: every metric all runs have)")
    p.add_argument("--bootstrap", type=int, default=1000,
                   help="resamples of the hierarchical bootstrap (sentences and seeds) [1000]")
    p.add_argument("--trials", type=int, default=10000,
                   help="approximate randomisation trials, for one run against one run [10000]")
    p.add_argument("--seed", type=int, default=12345, help="seed of the resampling [12345]")
    p.add_argument("--agreement", action="store_true",
                   help="beside each difference, the range of human agreement its CI implies (Kocmi et al., "
                        "2024): for sacreBLEU's detokenized BLEU and chrF and for COMET-22 "
                        "(Unbabel/wmt22-comet-da) only, the variants the thresholds were fitted on")
    p.add_argument("-s", "--source-lang")
    p.add_argument("-t", "--target-lang")
    p.add_argument("--subset", default="test")
    p.add_argument("--results-dir", metavar="DIR",
                   help="the results folder the runs belong to: a scores.json and the files it names may "
                        "be links anywhere inside it (the quality benchmark's runs share one copy of the "
                        "references); by default each stays inside the system's DIR (a scores.json "
                        "named: its folder)")
    add_version_option(p, "ea-fairseq-compare")
    args = p.parse_args(argv)
    logging.basicConfig(format="%(levelname)s | %(name)s | %(message)s", level=logging.WARNING)
    if args.bootstrap < 1 or args.trials < 1:
        raise SystemExit("ea-fairseq-compare: --bootstrap and --trials must be at least 1")

    direction = f"{args.source_lang}-{args.target_lang}" if args.source_lang and args.target_lang else "*"
    pattern = f"{args.subset}.{direction}.scores.json"
    systems: Dict[str, List[Run]] = {}
    for spec in args.systems:
        name, sep, path = spec.partition("=")
        if not sep:
            name, path = os.path.basename(os.path.normpath(spec)), spec
        if name in systems:
            raise SystemExit(f"ea-fairseq-compare: two systems named {name}: name them NAME=DIR")
        # the files of a system resolve inside the directory named for it (a seed or eval
        # directory linked out of it refused), or inside --results-dir where given
        root = args.results_dir if args.results_dir is not None else (
            os.path.dirname(path) or "." if path.endswith(".json") else path)
        systems[name] = [Run(f, root) for f in find_runs(path, pattern)]

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
        if run.sentences != first.sentences:
            raise SystemExit(f"ea-fairseq-compare: {run.path} translated {run.sentences} sentences, "
                             f"{first.path} {first.sentences}: not comparable")
        if ref_metric and hashlib.sha256("\n".join(run.texts(ref_metric)[1]).encode()).hexdigest() != refs_hash:
            raise SystemExit(f"ea-fairseq-compare: {run.path} was scored on other references "
                             f"(or other sentences) than {first.path}: not comparable")

    names = list(systems)
    report = first.report
    results = {}
    for metric in sacre + segment:
        is_segment = metric not in sacre
        print(f"ea-fairseq-compare: {metric} ...", file=sys.stderr, flush=True)
        stats = {n: [sentence_statistics(metric, r, is_segment) for r in rs] for n, rs in systems.items()}
        results[metric] = sig.compare(stats, scorer(metric, first.sentences, is_segment), args.bootstrap,
                                      args.trials, args.seed)
    family = sig.holm_over_metrics(results)
    coverage = (f"{report['translated']} of {report['sentences']} sentences"
                if report["translated"] != report["sentences"] else f"{report['translated']} sentences")
    print(f"{args.subset} set, {coverage}; baseline: {names[0]}")
    if first.sentences < 2:
        print(f"warning: the test set has {first.sentences} sentence: the bootstrap has no sentences to resample "
              "and every difference rests on it alone")
    if len(names) > 1:
        print(f"Δ: difference of the mean scores; 95% CI: hierarchical bootstrap over the runs and the test "
              f"sentences ({args.bootstrap} resamples, seed {args.seed}) and Welch's t over the runs; p: Welch's t "
              f"(two or more runs each), a permutation test over the runs (one run against several) or a "
              f"two-sided approximate randomisation test ({args.trials} trials; one run each); Holm: over the "
              f"{family} test{'s' if family != 1 else ''} reported (every system in every metric); permutation: "
              "the exact permutation test over the runs, and the smallest p it can give; sign: pairs of runs "
              "differing in Δ's direction. With few runs the bootstrap's resampling of them underestimates their "
              "spread: read it with Welch's CI")
    for metric, result in results.items():
        is_segment = metric not in sacre
        if is_segment:
            title = f"{metric}: mean of the segment scores in {first.prefix}.seg.{metric} (and each run's)"
        else:
            title = f"{report['metrics'][metric]['label']}\nsacreBLEU signature: {_signature(metric)}"
        agreed, why_not = agreement_of(metric, runs) if args.agreement else (None, "")
        thresholds = AGREEMENT[agreed] if agreed else None
        small = is_segment and all(abs(x) <= 1.5 for e in result.values() for x in e["scores"])  # COMET: 0-1
        digits = 4 if small else 2
        head = ["system", "runs", f"{metric} of each run", "mean ± std", "Δ mean", "95% CI, bootstrap",
                "95% CI, Welch", "p", "test", "p, Holm", "sign", "p, permutation (smallest)"]
        if thresholds:
            scale = ""
            if is_segment and small:
                thresholds, scale = (thresholds[0] / 100, thresholds[1] / 100), ", scores on a 0-1 scale"
            head.append(f"human agreement implied by the CIs (55% / 70% at {agreed} "
                        f"{thresholds[0]:.4g} / {thresholds[1]:.4g}{scale}; a preferred system at Holm p < 0.05)")
        rng = lambda ci: f"[{ci[0]:+.{digits}f}, {ci[1]:+.{digits}f}]"  # noqa: E731
        rows, single = [], []
        for n in names:
            e = result[n]
            spread = f"{e['mean']:.{digits}f}" + ("" if e["std"] is None else f" ± {e['std']:.{digits}f}")
            row = [n, str(len(e["scores"])), " ".join(f"{x:.{digits}f}" for x in e["scores"]), spread]
            if n == names[0]:
                row += ["–"] * (len(head) - 4)
            else:
                perm = e["permutation"]
                row += [f"{e['delta']:+.{digits}f}", rng(e["ci"]), rng(e["welch"]["ci"]) if e["welch"] else "–",
                        _p(e["p"]), e["test"] or "–", _p(e["p_holm"]), "{}/{}".format(*e["sign"]),
                        f"{_p(perm['p'])} ({_p(perm['p_min'])})" if perm else "–"]
                if thresholds:
                    row.append(sig.agreement_range(e["agreement_ci"], thresholds, n, names[0], e["p_holm"]))
                if e["test"] == "permutation":
                    single.append(names[0] if len(result[names[0]]["scores"]) == 1 else n)
            rows.append(row)
        print()
        print(title)
        print("\n".join(_table(rows, head)))
        for n in dict.fromkeys(single):
            print(f"(warning: {n} has one run: its seed spread is unknown, so the bootstrap CI resamples the other "
                  "side's runs only and Welch's t cannot be computed; the permutation test cannot go below its "
                  "smallest p. Train more seeds of it)")
        if why_not:
            print(f"(no human-agreement thresholds: {why_not})")
    if args.agreement:
        print(f"\n{CAVEAT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
