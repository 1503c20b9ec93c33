"""Seed-level inference for comparing translation systems: pure functions on scores.

A system is a set of runs (one per training seed) scored on one test set. Every run's score
is a corpus-level statistic of per-sentence sufficient statistics (``stats``: one row per
sentence; sacreBLEU's n-gram counts for BLEU and chrF, one segment score for metrics computed
elsewhere) and ``score_of`` turns their column sums into the corpus score.

* ``hierarchical_bootstrap``: a percentile CI of the difference of the systems' mean scores,
  resampling the test sentences (shared by every run: the runs translate the same sentences)
  and, within each system, its seeds (with replacement); both sources of variance in one
  interval.
* ``welch``: Welch's t on the per-seed scores (unequal variances): Δ, its CI and the
  two-sided p.
* ``randomisation_test``: two-sided approximate randomisation of one run against one run,
  centred on zero: each sentence's pair of statistics swapped with probability 1/2;
  p = (c + 1) / (trials + 1), c counting trials whose |difference| is at least the observed
  one. (sacreBLEU's ``--paired-ar`` counts only those above it, which gives p = 1/(trials+1)
  to two outputs of equal score; its ``--paired-bs`` compares |Δ*| - mean |Δ*| to |Δ|, a
  statistic not centred on zero that gives smaller p than the centred test.)
* ``permutation_test``: the two-sided permutation test of the difference of the mean
  per-seed scores: every assignment of the runs' scores to the two systems (exact up to
  :data:`EXACT_LIMIT` assignments, sampled beyond), with the smallest p the counts allow.
* ``holm``: Holm's step-down adjustment over a family of tests.
* ``sign_agreement``: of the pairs (baseline run, system run), how many differ in the
  direction of Δ.
* ``agreement_range``: Kocmi et al. (2024)'s pairwise accuracy bands for every difference
  in a CI.
* ``compare``: all of the above for several systems against a baseline, in one metric (what
  ea-fairseq-compare prints a table of); ``holm_over_metrics``: Holm over several metrics.

The t distribution is computed here (regularised incomplete beta function, Lentz's continued
fraction as in Numerical Recipes §6.4), so the tool needs numpy only.
"""
import itertools
import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

Scorer = Callable[[np.ndarray], float]  # column sums of the sentence statistics -> corpus score


# ----------------------------------------------------------------------------- Student's t
def _betacf(a: float, b: float, x: float) -> float:
    tiny, eps = 1e-300, 1e-15
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 10000):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < eps:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_sf2(t: float, df: float) -> float:
    """Two-sided tail probability P(|T| >= |t|) of Student's t with df degrees of freedom."""
    if math.isinf(t):
        return 0.0
    return betainc(df / 2.0, 0.5, df / (df + t * t))


def t_ppf(q: float, df: float) -> float:
    """The q-quantile of Student's t (0.5 < q < 1), by bisection of the tail probability."""
    if not 0.5 < q < 1.0:
        raise ValueError("t_ppf: q must lie in (0.5, 1)")
    target = 2.0 * (1.0 - q)  # two-sided tail beyond the quantile
    lo, hi = 0.0, 1.0
    while t_sf2(hi, df) > target:
        hi *= 2.0
    for _ in range(200):
        mid = (lo + hi) / 2.0
        if t_sf2(mid, df) > target:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-13 * hi:
            break
    return (lo + hi) / 2.0


# ----------------------------------------------------------------------------- seed level
def welch(base: Sequence[float], system: Sequence[float], level: float = 0.95) -> dict:
    """Welch's unequal-variance t test of mean(system) - mean(base): delta, t, df,
    two-sided p and the level CI. Needs two or more values on each side. With no spread on
    either side, p is 1 for no difference and undefined (nan) otherwise, the CI a point."""
    a, b = np.asarray(base, dtype=np.float64), np.asarray(system, dtype=np.float64)
    if len(a) < 2 or len(b) < 2:
        raise ValueError("welch: two or more runs per system")
    delta = float(b.mean() - a.mean())
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    se = math.sqrt(va + vb)
    if se == 0.0:
        return {"delta": delta, "t": math.nan, "df": math.nan, "p": 1.0 if delta == 0 else math.nan,
                "ci": (delta, delta)}
    df = (va + vb) ** 2 / ((va ** 2 / (len(a) - 1) if va else 0.0) + (vb ** 2 / (len(b) - 1) if vb else 0.0))
    t = delta / se
    half = t_ppf(0.5 + level / 2.0, df) * se
    return {"delta": delta, "t": t, "df": df, "p": t_sf2(t, df), "ci": (delta - half, delta + half)}


#: assignments a permutation test enumerates; beyond it, it draws this many at random
EXACT_LIMIT = 200_000


def permutation_test(base: Sequence[float], system: Sequence[float], seed: Optional[int] = None) -> dict:
    """Two-sided permutation test of mean(system) - mean(base) over the runs' scores: of the
    C(n, k) ways to call k of the n pooled scores the system's, the share whose |Δ| is at
    least the observed |Δ| (to a relative 1e-9) is p. ``exact``: every assignment counted
    (at most :data:`EXACT_LIMIT`), else that many drawn from ``default_rng(seed)``, p then
    (c + 1) / (draws + 1). ``p_min``: the smallest p these counts can give (the share of
    assignments as extreme as the most extreme one), which no difference goes below."""
    a, b = np.asarray(base, dtype=np.float64), np.asarray(system, dtype=np.float64)
    pooled, k = np.concatenate([a, b]), len(b)
    n = len(pooled)
    observed = abs(b.mean() - a.mean())
    total = math.comb(n, k)
    exact = total <= EXACT_LIMIT
    combinations, rng, blocks = itertools.combinations(range(n), k), np.random.default_rng(seed), []
    for start, stop in row_blocks(min(total, EXACT_LIMIT), n):  # a block of assignments at a time
        if exact:
            picks = np.zeros((stop - start, n), dtype=bool)
            for row, chosen in enumerate(itertools.islice(combinations, stop - start)):
                picks[row, list(chosen)] = True
        else:
            picks = np.argsort(rng.random((stop - start, n)), axis=1) < k
        sums = picks @ pooled
        blocks.append(np.abs(sums / k - (pooled.sum() - sums) / (n - k)))
    deltas = np.concatenate(blocks)
    tolerance = 1e-9 * max(observed, 1e-300)
    count = int(np.sum(deltas >= observed - tolerance))
    extreme = int(np.sum(deltas >= deltas.max() - 1e-9 * max(deltas.max(), 1e-300)))
    draws = len(deltas)
    if exact:
        return {"p": count / total, "p_min": extreme / total, "assignments": total, "exact": True}
    return {"p": (count + 1) / (draws + 1), "p_min": 1 / (draws + 1), "assignments": total, "exact": False}


def holm(pvalues: Sequence[Optional[float]]) -> List[Optional[float]]:
    """Holm's (1979) step-down adjusted p-values of a family of tests (None: no test, left
    out of the family; nan counts as 1)."""
    tested = [(i, 1.0 if p is None or math.isnan(p) else float(p)) for i, p in enumerate(pvalues) if p is not None]
    m = len(tested)
    out: List[Optional[float]] = [None] * len(pvalues)
    running = 0.0
    for rank, (i, p) in enumerate(sorted(tested, key=lambda x: x[1])):
        running = max(running, min(1.0, (m - rank) * p))
        out[i] = running
    return out


def sign_agreement(base: Sequence[float], system: Sequence[float]) -> Tuple[int, int]:
    """(k, n): of the n pairs (baseline run, system run), k differ in the direction of the
    difference of means (ties and a zero difference agree with nothing)."""
    a, b = np.asarray(base, dtype=np.float64), np.asarray(system, dtype=np.float64)
    delta = b.mean() - a.mean()
    diffs = b[None, :] - a[:, None]
    k = int(np.sum(diffs > 0)) if delta > 0 else int(np.sum(diffs < 0)) if delta < 0 else 0
    return k, diffs.size


# ----------------------------------------------------------------------------- resampling
def _scores(score_of: Scorer, sums: np.ndarray) -> np.ndarray:
    return np.array([score_of(row) for row in sums], dtype=np.float64)


#: elements of one block of draws: the resamples and trials are drawn and scored a block of rows
#: at a time, so memory stays this size however many sentences a test set has
BLOCK_ELEMENTS = 1 << 22


def row_blocks(rows: int, n: int, multiple: int = 1) -> List[Tuple[int, int]]:
    """``[start, stop)`` blocks of ``rows`` rows of ``n`` draws each, about
    :data:`BLOCK_ELEMENTS` a block and a multiple of ``multiple`` rows but the last: numpy's
    generator then draws the same numbers block by block as all at once (64-bit integers and
    floats one at a time; booleans 32 to a word, so a block of them is a multiple of 32 rows),
    so the results do not depend on the block size."""
    step = max(multiple, BLOCK_ELEMENTS // max(n, 1) // multiple * multiple)
    return [(start, min(start + step, rows)) for start in range(0, rows, step)]


def sentence_weights(rng: np.random.Generator, n: int, samples: int) -> np.ndarray:
    """(samples, n) counts of each sentence in each bootstrap resample of n sentences."""
    idx = rng.integers(0, n, size=(samples, n))
    weights = np.empty((samples, n), dtype=np.float64)
    for row, drawn in zip(weights, idx):
        row[:] = np.bincount(drawn, minlength=n)
    return weights


def hierarchical_bootstrap(systems: Sequence[Sequence[np.ndarray]], score_of: Scorer, samples: int,
                           seed: Optional[int], level: float = 0.95) -> dict:
    """Bootstrap of the mean score of each system over its runs, resampling the sentences
    (one resample shared by every run) and each system's runs (with replacement).

    ``systems[s][r]``: the (sentences, k) statistics of run r of system s. Draws, in this
    order, from ``numpy.random.default_rng(seed)``: the sentence indices (samples x sentences),
    then per system in order the run indices (samples x runs of the system). Returns the
    replicated means ``means[s]`` (samples,) and ``ci(s, base)``, the percentile CI of
    means[s] - means[base]."""
    rng = np.random.default_rng(seed)
    n = systems[0][0].shape[0]
    blocks = [[[] for _ in runs] for runs in systems]  # per system and run: its scores, a block of resamples each
    for start, stop in row_blocks(samples, n):
        weights = sentence_weights(rng, n, stop - start)
        for scores, runs in zip(blocks, systems):
            for block, stats in zip(scores, runs):
                block.append(_scores(score_of, weights @ stats))
    means = []
    for scores, runs in zip(blocks, systems):
        per_run = np.stack([np.concatenate(block) for block in scores], axis=1)  # (samples, runs)
        pick = rng.integers(0, len(runs), size=(samples, len(runs)))
        means.append(np.take_along_axis(per_run, pick, axis=1).mean(axis=1))
    tail = (1.0 - level) / 2.0 * 100.0

    def ci(s: int, base: int = 0) -> Tuple[float, float]:
        d = means[s] - means[base]
        return float(np.percentile(d, tail)), float(np.percentile(d, 100.0 - tail))
    return {"means": means, "ci": ci}


def _product(mask: np.ndarray, stats: np.ndarray) -> np.ndarray:
    """``mask @ stats`` for a boolean (rows, n) ``mask``, converted to floats a block of about
    :data:`BLOCK_ELEMENTS` at a time (one product where the block holds it all)."""
    step = max(1, BLOCK_ELEMENTS // max(mask.shape[0], 1))
    if step >= mask.shape[1]:
        return mask @ stats
    return sum(mask[:, c:c + step] @ stats[c:c + step] for c in range(0, mask.shape[1], step))


def randomisation_test(base: np.ndarray, system: np.ndarray, score_of: Scorer, trials: int,
                       seed: Optional[int]) -> float:
    """Two-sided approximate randomisation p of score(system) - score(base), one run each:
    the swap of each sentence's statistics drawn as ``default_rng(seed).integers(2, size=
    (trials, sentences), dtype=bool)`` (sacreBLEU's draw); p = (c + 1) / (trials + 1), c the
    trials with |difference| >= the observed |difference| (to a relative 1e-9: a difference
    equal to the observed one is as extreme)."""
    observed = abs(score_of(system.sum(0)) - score_of(base.sum(0)))
    rng = np.random.default_rng(seed)
    # a trial's sums: the system's with the swapped sentences' statistics exchanged for the base's
    # (a = system + swapped (base - system)), and the base's the other way (b = base - the same)
    gain, a, b = base - system, [], []
    for start, stop in row_blocks(trials, base.shape[0], multiple=32):
        moved = _product(rng.integers(2, size=(stop - start, base.shape[0]), dtype=bool), gain)
        a.append(_scores(score_of, system.sum(0) + moved))
        b.append(_scores(score_of, base.sum(0) - moved))
    c = int(np.sum(np.abs(np.concatenate(a) - np.concatenate(b)) >= observed - 1e-9 * max(observed, 1.0)))
    return (c + 1) / (trials + 1)


# ----------------------------------------------------------------------------- systems
def compare(stats: Dict[str, List[np.ndarray]], score_of: Scorer, bootstrap: int, trials: int,
            seed: Optional[int], level: float = 0.95) -> Dict[str, dict]:
    """Per system (the first is the baseline): its runs' scores, mean and std; for the others
    Δ, the hierarchical bootstrap CI, Welch's t (two or more runs each), the permutation test
    over the runs (two runs or more in all), the p of the test the pair allows (Welch; the
    permutation test where one side has a single run; approximate randomisation for one run
    against one run) and the sign agreement of the pairs of runs. Holm's adjustment is over
    every test reported: :func:`holm_over_metrics`."""
    names = list(stats)
    boot = hierarchical_bootstrap([stats[n] for n in names], score_of, bootstrap, seed, level)
    out: Dict[str, dict] = {}
    base = np.array([score_of(x.sum(0)) for x in stats[names[0]]])
    for i, n in enumerate(names):
        scores = np.array([score_of(x.sum(0)) for x in stats[n]])
        entry = {"scores": scores.tolist(), "mean": float(scores.mean()),
                 "std": float(scores.std(ddof=1)) if len(scores) > 1 else None}
        if i:
            entry.update(delta=float(scores.mean() - base.mean()), ci=boot["ci"](i, 0), welch=None, p=None,
                         test=None, sign=sign_agreement(base, scores))
            entry["permutation"] = permutation_test(base, scores, seed) if len(scores) + len(base) > 2 else None
            if len(scores) > 1 and len(base) > 1:
                entry["welch"] = welch(base, scores, level)
                entry["p"], entry["test"] = entry["welch"]["p"], "Welch"
            elif len(scores) == 1 and len(base) == 1:
                entry["p"] = randomisation_test(stats[names[0]][0], stats[n][0], score_of, trials, seed)
                entry["test"] = "AR"
            else:  # one run against several: the seed spread of one side unknown
                entry["p"], entry["test"] = entry["permutation"]["p"], "permutation"
            # the human-agreement range: every difference either CI holds (a bootstrap of few seeds
            # underestimates their spread, Welch's t ignores the test set's sampling noise)
            w = entry["welch"]["ci"] if entry["welch"] else entry["ci"]
            entry["agreement_ci"] = (min(entry["ci"][0], w[0]), max(entry["ci"][1], w[1]))
        out[n] = entry
    return out


def holm_over_metrics(results: Dict[str, Dict[str, dict]]) -> int:
    """Holm's adjusted p (``p_holm``) of every test in ``results`` ({metric: compare()'s
    result}): one family, every system in every metric; the number of tests in it."""
    entries = [e for result in results.values() for e in result.values() if "p" in e]
    for e, adjusted in zip(entries, holm([e["p"] for e in entries])):
        e["p_holm"] = adjusted
    return sum(e["p"] is not None for e in entries)


# ----------------------------------------------------------------------------- human agreement
def _band(x: float, thresholds: Tuple[float, float]) -> int:
    return 0 if x < thresholds[0] else 1 if x < thresholds[1] else 2


#: (band of the smallest |Δ| in the CI, band of the largest) -> the range of pairwise accuracy
SPANS = {(0, 0): "below 55%", (1, 1): "55% to 70%", (2, 2): "70% or more", (0, 1): "below 55% up to 70%",
         (0, 2): "anywhere from below 55% to 70% or more", (1, 2): "55% or more"}
UPPER = ("below 55%", "up to 70%", "up to 70% or more")


def agreement_range(ci: Tuple[float, float], thresholds: Tuple[float, float], system: str, baseline: str,
                    p_holm: Optional[float] = 0.0, alpha: float = 0.05) -> str:
    """Kocmi et al.'s pairwise-accuracy bands that the differences in ``ci`` (system minus
    baseline, higher-better metric) fall in, and the system humans would prefer: named only
    when the CI excludes zero and the difference's Holm-adjusted p is below ``alpha``, and then
    the one whose score is higher; a CI that includes zero reaches, on each side, the band of
    its end on that side."""
    lo, hi = ci
    if lo > 0 or hi < 0:
        near, far = sorted((abs(lo), abs(hi)))
        span = SPANS[_band(near, thresholds), _band(far, thresholds)]
        if p_holm is None or math.isnan(p_holm) or p_holm >= alpha:
            shown = "no test" if p_holm is None else f"Holm p {p_holm:.4f}"
            return f"{span} if the difference holds; no preferred system ({shown}, not below {alpha:g})"
        better = system if lo > 0 else baseline
        return f"{span}: humans would prefer {better}"
    for_system, for_baseline = UPPER[_band(hi, thresholds)], UPPER[_band(-lo, thresholds)]
    reach = (f"{for_system} for either" if for_system == for_baseline
             else f"{for_system} for {system}, {for_baseline} for {baseline}")
    return f"no preferred system, the CI includes 0 ({reach})"
