"""ea_fairseq_cli.significance, each statistic against scipy, sacreBLEU or the textbook
computation written out on fixed data."""
import math
import tracemalloc

import numpy as np
import pytest
from sacrebleu.metrics import BLEU, CHRF
from sacrebleu.significance import PairedTest

from ea_fairseq_cli import significance as sig

stats = pytest.importorskip("scipy.stats")

# per-seed sacreBLEU of the quality benchmark's transformer_lite and ea_transformer_lite (fixed data)
BASE, EA = [10.63, 10.36, 11.45], [14.71, 12.13, 13.35]
VOCAB = "the a cat dog sat ran on under mat house green big small today".split()


def _corpus(n, seed, p=0.0, refs=None):
    rng = np.random.default_rng(seed)
    if refs is None:
        return [" ".join(rng.choice(VOCAB, size=rng.integers(5, 12))) for _ in range(n)]
    return [" ".join(w if rng.random() > p else str(rng.choice(VOCAB)) for w in r.split()) for r in refs]


def _stats(metric, hyps, refs):
    return np.array(metric._extract_corpus_statistics(hyps, [refs]), dtype=np.float64)


def _score_of(metric):
    return lambda sums: metric._compute_score_from_stats(list(sums)).score


@pytest.mark.parametrize("df", [1, 2, 2.7459, 4, 10, 250])
def test_student_t_against_scipy(df):
    for t in (0.0, 0.3, 1.0, 2.5, 8.0):
        assert sig.t_sf2(t, df) == pytest.approx(2 * stats.t.sf(t, df), rel=1e-10, abs=1e-14)
    for q in (0.9, 0.975, 0.995):
        assert sig.t_ppf(q, df) == pytest.approx(stats.t.ppf(q, df), rel=1e-9)


def test_student_t_quantiles_of_the_textbook_table():
    # two-sided 95% critical values (any t table)
    for df, value in ((1, 12.706), (2, 4.303), (4, 2.776), (10, 2.228), (30, 2.042)):
        assert sig.t_ppf(0.975, df) == pytest.approx(value, abs=5e-4)


def test_welch_against_scipy():
    w = sig.welch(BASE, EA)
    ref = stats.ttest_ind(EA, BASE, equal_var=False)
    ci = ref.confidence_interval(0.95)
    assert w["delta"] == pytest.approx(np.mean(EA) - np.mean(BASE), rel=1e-12)
    assert w["t"] == pytest.approx(ref.statistic, rel=1e-10)
    assert w["df"] == pytest.approx(ref.df, rel=1e-10)
    assert w["p"] == pytest.approx(ref.pvalue, rel=1e-8)
    assert w["ci"] == (pytest.approx(ci.low, rel=1e-8), pytest.approx(ci.high, rel=1e-8))
    # five against three, other level
    a, b = [1.0, 2.5, 1.7, 0.4, 2.2], [3.1, 2.0, 2.9]
    w, ref = sig.welch(a, b, level=0.9), stats.ttest_ind(b, a, equal_var=False)
    assert w["p"] == pytest.approx(ref.pvalue, rel=1e-8)
    assert w["ci"][0] == pytest.approx(ref.confidence_interval(0.9).low, rel=1e-8)
    # no spread: p 1 for no difference, undefined otherwise; one run: refused
    assert sig.welch([2.0, 2.0], [2.0, 2.0])["p"] == 1.0
    assert math.isnan(sig.welch([2.0, 2.0], [3.0, 3.0])["p"])
    with pytest.raises(ValueError):
        sig.welch([1.0], [1.0, 2.0])


def test_holm_against_the_textbook_steps():
    # sorted 0.005, 0.01, 0.03, 0.04 times 4, 3, 2, 1: 0.02, 0.03, 0.06, 0.04 -> monotone 0.06
    assert sig.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    # None: no test, not in the family (m = 2); nan counts as 1; capped at 1
    assert sig.holm([0.02, None, 0.6]) == [pytest.approx(0.04), None, pytest.approx(0.6)]
    assert sig.holm([float("nan"), 0.01]) == [1.0, pytest.approx(0.02)]
    assert sig.holm([0.7, 0.8]) == [1.0, 1.0]


def test_sign_agreement_is_mann_whitney_u():
    a, b = [10.63, 10.36, 11.45, 9.9], [8.47, 11.65, 10.85]
    k, n = sig.sign_agreement(a, b)
    u_b = stats.mannwhitneyu(b, a).statistic  # pairs where b's run is above a's
    assert n == 12 and np.mean(b) < np.mean(a) and k == n - u_b  # Δ < 0: the pairs where b is below
    assert sig.sign_agreement(BASE, EA) == (9, 9)
    assert sig.sign_agreement([1.0, 2.0], [2.0, 1.0]) == (0, 4)  # no difference: no direction


def _ar_loop(base, system, score_of, trials, seed):
    """Approximate randomisation as the textbook states it (Riezler and Maxwell 2005; Noreen
    1989): per trial, swap each sentence's pair with probability 1/2; count trials with a
    difference at least as large as the observed one; (c + 1) / (trials + 1)."""
    swaps = np.random.default_rng(seed).integers(2, size=(trials, len(base)), dtype=bool)
    observed = abs(score_of(system.sum(0)) - score_of(base.sum(0)))
    c = 0
    for swap in swaps:
        x = np.where(swap[:, None], system, base).sum(0)
        y = np.where(swap[:, None], base, system).sum(0)
        c += abs(score_of(x) - score_of(y)) >= observed - 1e-9
    return (c + 1) / (trials + 1)


def _sacrebleu_ar(monkeypatch, metric, base, system, refs, trials, seed):
    monkeypatch.setenv("SACREBLEU_SEED", str(seed))
    _, scores = PairedTest([("b", base), ("s", system)], {"m": metric}, [refs], test_type="ar", n_samples=trials)()
    return next(v for k, v in scores.items() if k != "System")[1].p_value


def test_randomisation_test_against_the_loop_and_sacrebleu(monkeypatch):
    refs = _corpus(60, 0)
    base, system = _corpus(0, 1, 0.2, refs), _corpus(0, 2, 0.24, refs)
    for metric in (BLEU(), CHRF()):
        a, b = _stats(metric, base, refs), _stats(metric, system, refs)
        p = sig.randomisation_test(a, b, _score_of(metric), 500, 7)
        assert p == pytest.approx(_ar_loop(a, b, _score_of(metric), 500, 7))
        assert 0.05 < p < 0.5  # (a p between the extremes: the count matters)
        # sacreBLEU's --paired-ar draws the same swaps; it counts only trials above |Δ|, the same
        # count here where no trial ties the observed difference
        assert _sacrebleu_ar(monkeypatch, metric, base, system, refs, 500, 7) == pytest.approx(p)


def test_randomisation_test_of_equal_scores_is_one(monkeypatch):
    """Two different outputs that both score 0 BLEU: no evidence of a difference, p = 1
    (sacreBLEU's AR gives 1/(trials + 1) here: it counts only trials above |Δ| = 0)."""
    refs = _corpus(40, 0)
    a = _stats(BLEU(), ["xx yy zz"] * 40, refs)
    b = _stats(BLEU(), ["qq rr"] * 40, refs)
    assert _score_of(BLEU())(a.sum(0)) == 0 == _score_of(BLEU())(b.sum(0))
    assert sig.randomisation_test(a, b, _score_of(BLEU()), 1000, 1) == 1.0
    # the statistic this tool does not use
    assert _sacrebleu_ar(monkeypatch, BLEU(), ["xx yy zz"] * 40, ["qq rr"] * 40, refs, 1000, 1) == pytest.approx(1 / 1001)


def _hierarchical_loop(systems, score_of, samples, seed):
    """The two-stage bootstrap written out: per resample, the sentences (one draw for every
    run), then per system its runs with replacement; the mean over the drawn runs."""
    rng = np.random.default_rng(seed)
    n = systems[0][0].shape[0]
    idx = rng.integers(0, n, size=(samples, n))
    picks = [rng.integers(0, len(runs), size=(samples, len(runs))) for runs in systems]
    means = np.zeros((len(systems), samples))
    for b in range(samples):
        for s, runs in enumerate(systems):
            means[s, b] = np.mean([score_of(runs[r][idx[b]].sum(0)) for r in picks[s][b]])
    return means


def test_hierarchical_bootstrap_against_the_loop():
    refs = _corpus(50, 0)
    metric = BLEU()
    systems = [[_stats(metric, _corpus(0, 10 + k, 0.25, refs), refs) for k in range(3)],
               [_stats(metric, _corpus(0, 20 + k, 0.15, refs), refs) for k in range(2)]]
    out = sig.hierarchical_bootstrap(systems, _score_of(metric), 200, 3)
    loop = _hierarchical_loop(systems, _score_of(metric), 200, 3)
    np.testing.assert_allclose(out["means"][0], loop[0], rtol=1e-12)
    np.testing.assert_allclose(out["means"][1], loop[1], rtol=1e-12)
    d = loop[1] - loop[0]
    assert out["ci"](1, 0) == (pytest.approx(np.percentile(d, 2.5)), pytest.approx(np.percentile(d, 97.5)))
    # one run each: the paired bootstrap of the sentences (Koehn 2004) as a percentile CI
    one = sig.hierarchical_bootstrap([systems[0][:1], systems[1][:1]], _score_of(metric), 200, 3)
    rng = np.random.default_rng(3)
    idx = rng.integers(0, 50, size=(200, 50))
    d1 = [_score_of(metric)(systems[1][0][i].sum(0)) - _score_of(metric)(systems[0][0][i].sum(0)) for i in idx]
    assert one["ci"](1, 0) == (pytest.approx(np.percentile(d1, 2.5)), pytest.approx(np.percentile(d1, 97.5)))


def test_agreement_range_names_the_better_system_only_when_the_ci_excludes_zero():
    chrf = (0.33, 1.00)
    # a system at chrF 1.05 against a baseline at 5.14: Δ -4.09, the baseline is preferred
    assert sig.agreement_range((-4.6, -3.5), chrf, "ea", "base") == "70% or more: humans would prefer base"
    assert sig.agreement_range((3.5, 4.6), chrf, "base", "ea") == "70% or more: humans would prefer base"
    assert sig.agreement_range((0.5, 4.0), chrf, "ea", "base") == "55% or more: humans would prefer ea"
    assert sig.agreement_range((0.1, 0.8), chrf, "ea", "base") == "below 55% up to 70%: humans would prefer ea"
    assert sig.agreement_range((-0.2, -0.1), chrf, "ea", "base") == "below 55%: humans would prefer base"
    assert sig.agreement_range((0.1, 4.0), chrf, "ea", "base").startswith("anywhere from below 55% to 70% or more")
    for ci in ((-0.15, 5.3), (0.0, 2.0), (-0.1, 0.1)):
        assert sig.agreement_range(ci, chrf, "ea", "base").startswith("no preferred system, the CI includes 0")
        assert "prefer" not in sig.agreement_range(ci, chrf, "ea", "base").replace("no preferred", "")
    # each side reaches the band of the CI's end on that side, not of the farther end
    assert sig.agreement_range((-0.63, 3.87), chrf, "pa", "base").endswith(
        "(up to 70% or more for pa, up to 70% for base)")
    assert sig.agreement_range((-3.87, 0.2), chrf, "pa", "base").endswith(
        "(below 55% for pa, up to 70% or more for base)")
    assert sig.agreement_range((-1.5, 1.2), chrf, "pa", "base").endswith("(up to 70% or more for either)")


def test_permutation_test_against_its_enumeration_written_out():
    """3 runs against 3: the 20 ways to call three of the six scores the system's, each |Δ|
    written out; p the share at least as extreme as the observed assignment."""
    base, system = [20.0, 21.0, 23.0], [22.0, 24.0, 25.0]
    pooled = base + system
    deltas = []
    for i in range(6):
        for j in range(i + 1, 6):
            for k in range(j + 1, 6):
                chosen = [pooled[i], pooled[j], pooled[k]]
                rest = [x for n, x in enumerate(pooled) if n not in (i, j, k)]
                deltas.append(abs(sum(chosen) / 3 - sum(rest) / 3))
    observed = abs(sum(system) / 3 - sum(base) / 3)  # 2.333
    out = sig.permutation_test(base, system)
    assert out["exact"] and out["assignments"] == len(deltas) == 20
    assert out["p"] == pytest.approx(sum(d >= observed - 1e-12 for d in deltas) / 20) == pytest.approx(4 / 20)
    assert out["p_min"] == pytest.approx(2 / 20)  # no 3-against-3 difference goes below 0.1
    # the smallest p for the counts of the quality benchmark's plans, and one run against five
    assert sig.permutation_test([1, 2, 3, 4, 5], [6, 7, 8, 9, 10])["p"] == pytest.approx(2 / 252)
    ten = sig.permutation_test(list(range(10)), list(range(10, 20)))
    assert ten["exact"] and ten["p"] == ten["p_min"] == pytest.approx(2 / 184756)
    assert sig.permutation_test([1.0], [2, 3, 4, 5, 6])["p"] == pytest.approx(2 / 6)
    assert sig.permutation_test([1, 2, 3], [1, 2, 3])["p"] == 1.0  # no difference: every assignment as extreme


def test_permutation_test_samples_beyond_its_limit_reproducibly():
    base, system = list(np.linspace(0, 1, 12)), list(np.linspace(0.5, 1.5, 12))  # C(24, 12) = 2,704,156
    one, two = sig.permutation_test(base, system, seed=3), sig.permutation_test(base, system, seed=3)
    assert not one["exact"] and one == two and one["p_min"] == 1 / (sig.EXACT_LIMIT + 1) <= one["p"] < 0.05


def test_agreement_names_a_preferred_system_only_below_the_holm_threshold():
    chrf = (0.33, 1.00)
    assert sig.agreement_range((0.5, 4.0), chrf, "ea", "base", 0.0499) == "55% or more: humans would prefer ea"
    for p in (0.0502, None, float("nan")):
        text = sig.agreement_range((0.5, 4.0), chrf, "ea", "base", p)
        assert text.startswith("55% or more if the difference holds; no preferred system (") and "prefer ea" not in text


def test_resampling_memory_is_a_block_of_rows_whatever_the_sentences(monkeypatch):
    """The bootstrap's resamples, the randomisation's trials and the permutation test's
    assignments are made and scored a block of rows at a time (``row_blocks``): a test set of
    100,000 sentences costs a block's memory, not resamples x sentences (205 MB of weights here,
    and as much again of indices), nor 6,000 runs 6,000 x 6,000 assignments; the draws are the
    same as all at once (the randomisation's p equal, the bootstrap's to summation order)."""
    rng = np.random.default_rng(0)
    n, rows = 100_000, 256
    runs = [[rng.random((n, 2))], [rng.random((n, 2))]]
    score = lambda row: float(row[0] / row[1])  # noqa: E731
    tracemalloc.start()
    try:
        blocked = sig.hierarchical_bootstrap(runs, score, rows, 3)
        p = sig.randomisation_test(runs[0][0], runs[1][0], score, rows, 7)
        many = sig.permutation_test(rng.random(5999), [0.5])  # 6,000 runs: every assignment, 6,000 x 6,000
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 100 * 2 ** 20, peak
    assert many["exact"] and many["assignments"] == 6000
    monkeypatch.setattr(sig, "BLOCK_ELEMENTS", rows * n)  # one block: everything at once
    whole = sig.hierarchical_bootstrap(runs, score, rows, 3)
    assert all(np.allclose(a, b, rtol=1e-12, atol=0) for a, b in zip(blocked["means"], whole["means"]))
    assert sig.randomisation_test(runs[0][0], runs[1][0], score, rows, 7) == p
