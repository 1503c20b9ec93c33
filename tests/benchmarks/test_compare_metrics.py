"""ea-fairseq-bleu's chrF/chrF++ and ea-fairseq-compare's tests for every metric, held to
sacreBLEU's own command line; segment-score files (COMET, MetricX, ... computed elsewhere);
COMET through a stand-in ``comet`` package; the human-agreement column."""
import json
import os
import random
import re
import subprocess
import sys

import numpy as np
import pytest

from support import recipe_fixtures as fx
from ea_fairseq_cli import bleu
from ea_fairseq_cli import compare_systems as compare

SACREBLEU = os.path.join(os.path.dirname(sys.executable), "sacrebleu")
VOCAB = "the a cat dog sat ran on under mat house green big small today".split()


def _corpus(n=120, seed=0):
    rng = random.Random(seed)
    return [" ".join(rng.choice(VOCAB) for _ in range(rng.randint(5, 12))) for _ in range(n)]


def _noisy(refs, p, seed):
    g = random.Random(seed)
    return [" ".join(w if g.random() > p else g.choice(VOCAB) for w in r.split()) for r in refs]


def _tables(out: str):
    tables = {}
    for block in out.split("\n\n"):
        lines = block.splitlines()
        rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines if line.startswith("| ")]
        if rows:
            name = rows[0][2].rsplit(" of each run", 1)[0]
            tables[name] = {"title": "\n".join(l for l in lines if not l.startswith("|")),
                            "head": rows[0], **{row[0]: row for row in rows[1:]}}
    return tables


def _sacrebleu_cli(ref, base, system, *metric_args):
    """p-value, score and signature sacreBLEU's command line prints for a paired test."""
    out = subprocess.run([SACREBLEU, str(ref), "-i", str(base), str(system), *metric_args, "-f", "text"],
                         capture_output=True, text=True, check=True).stdout
    rows = [line for line in out.splitlines() if line.startswith("│")]
    score = float(rows[2].split("│")[2].split()[0])  # header, baseline, system, its p
    p = float(re.search(r"\(p = ([0-9.]+)\)", out).group(1))
    sig = re.search(r"^ - \S+\s+(nrefs:\S+)$", out, re.M).group(1)
    return p, score, sig


def test_bleu_prints_chrf_and_chrf_plus_plus_with_signatures(tmp_path, capsys):
    refs = _corpus()
    hyps = _noisy(refs, 0.2, 1)
    fx.write_scored_run(tmp_path / "a", refs, hyps)
    out = capsys.readouterr().out
    report = json.load(open(tmp_path / "a" / "eval" / "test.de-en.scores.json"))
    from sacrebleu.metrics import CHRF

    for name, metric in (("chrf", CHRF()), ("chrf++", CHRF(word_order=2))):
        expected = metric.corpus_score(hyps, [refs])
        assert report["metrics"][name]["score"] == pytest.approx(expected.score, abs=1e-9)
        assert report["metrics"][name]["signature"] == str(metric.get_signature())
        assert f": {expected.score:.2f}  [{expected}]  signature: {metric.get_signature()}" in out
    assert "nw:2" in report["metrics"]["chrf++"]["signature"] and "nw:0" in report["metrics"]["chrf"]["signature"]
    assert "COMET" not in out  # not asked for: no COMET line


def _stats(metric, hyps, refs):
    m = bleu.sacrebleu_metric(metric)
    return np.array(m._extract_corpus_statistics(hyps, [refs]), dtype=np.float64)


def test_one_run_each_randomisation_test_and_bootstrap_ci(tmp_path, capsys):
    """One run per system: every metric's score is sacreBLEU's (scores.json), Δ its difference,
    the CI the sentence bootstrap's and p the two-sided approximate randomisation test's, on the
    sentence statistics of the files evaluate.sh wrote; no Welch (one run)."""
    refs = _corpus()
    base, system = _noisy(refs, 0.15, 1), _noisy(refs, 0.18, 2)
    fx.write_scored_run(tmp_path / "base", refs, base)
    fx.write_scored_run(tmp_path / "sys", refs, system)
    capsys.readouterr()
    assert compare.main([str(tmp_path / "base"), str(tmp_path / "sys"), "--trials", "1000", "--bootstrap", "300",
                         "--seed", "5"]) == 0
    out = capsys.readouterr().out
    tables = _tables(out)
    assert list(tables) == ["tok", "chrf", "chrf++"]
    assert "Holm: over the 3 tests reported" in out  # one system, three metrics: one family
    report = json.load(open(tmp_path / "sys" / "eval" / "test.de-en.scores.json"))
    base_report = json.load(open(tmp_path / "base" / "eval" / "test.de-en.scores.json"))
    ps = {}
    for name in tables:
        score_of = compare.scorer(name, len(refs), False)
        a, b = _stats(name, base, refs), _stats(name, system, refs)
        row = tables[name]["sys"]
        assert row[2] == f"{report['metrics'][name]['score']:.2f}", name
        assert row[4] == f"{report['metrics'][name]['score'] - base_report['metrics'][name]['score']:+.2f}", name
        ci = compare.sig.hierarchical_bootstrap([[a], [b]], score_of, 300, 5)["ci"](1, 0)
        assert row[5] == f"[{ci[0]:+.2f}, {ci[1]:+.2f}]" and ci[0] < float(row[4]) < ci[1], name
        assert row[6] == "–" and row[8] == "AR" and row[10] in ("1/1", "0/1") and row[11] == "–", name
        ps[name] = compare.sig.randomisation_test(a, b, score_of, 1000, 5)
        assert row[7] == f"{ps[name]:.4f}", name
        assert f"sacreBLEU signature: {report['metrics'][name]['signature']}" in tables[name]["title"], name
    for name, adjusted in zip(ps, compare.sig.holm(list(ps.values()))):
        assert tables[name]["sys"][9] == f"{adjusted:.4f}", name


def test_seeds_welch_holm_and_sign(tmp_path, capsys):
    """Three runs of the baseline, three and two of two systems: Welch's t (scipy's), Holm over
    the two systems, the sign agreement over the pairs of runs; the same CLI output twice
    (seeded resampling)."""
    stats = pytest.importorskip("scipy.stats")
    refs = _corpus(80)
    for k in range(3):
        fx.write_scored_run(tmp_path / "base" / f"seed{k + 1}", refs, _noisy(refs, 0.2 + 0.02 * k, k))
        fx.write_scored_run(tmp_path / "a" / f"seed{k + 1}", refs, _noisy(refs, 0.12 + 0.02 * k, 10 + k))
    for k in range(2):
        fx.write_scored_run(tmp_path / "b" / f"seed{k + 1}", refs, _noisy(refs, 0.19 + 0.03 * k, 20 + k))
    argv = [str(tmp_path / d) for d in ("base", "a", "b")] + ["--metric", "tok", "--bootstrap", "200"]
    capsys.readouterr()
    assert compare.main(argv) == 0
    out = capsys.readouterr().out
    assert compare.main(argv) == 0
    assert capsys.readouterr().out == out
    table = _tables(out)["tok"]
    scores = {n: [float(x) for x in table[n][2].split()] for n in ("base", "a", "b")}
    ps = {}
    for n in ("a", "b"):
        ref = stats.ttest_ind(scores[n], scores["base"], equal_var=False)
        ci = ref.confidence_interval()
        row = table[n]
        assert row[8] == "Welch" and row[1] == str(len(scores[n]))
        # (the table's scores are rounded to 2 digits, its statistics computed from the exact ones)
        assert float(row[7]) == pytest.approx(ref.pvalue, abs=0.02)
        lo, hi = (float(x) for x in row[6].strip("[]").split(","))
        assert lo == pytest.approx(ci.low, abs=0.05) and hi == pytest.approx(ci.high, abs=0.05)
        ps[n] = float(row[7])
        diffs = np.subtract.outer(scores[n], scores["base"])
        agree = np.sum(diffs > 0) if np.mean(scores[n]) > np.mean(scores["base"]) else np.sum(diffs < 0)
        assert row[10] == f"{agree}/{diffs.size}"
    low, high = sorted(ps.values())
    holm = {n: (min(1, 2 * low) if ps[n] == low else max(min(1, 2 * low), high)) for n in ps}
    for n in ps:
        assert float(table[n][9]) == pytest.approx(holm[n], abs=2e-4)


def test_two_untrained_systems_at_zero_bleu_are_not_different(tmp_path, capsys):
    """Two different outputs that share no word with the references: BLEU 0 both, Δ +0.00 and
    p 1 (not the 1/(trials+1) of a test that counts only trials above |Δ|)."""
    refs = _corpus(60)
    fx.write_scored_run(tmp_path / "a", refs, ["xx yy zz"] * 60)
    fx.write_scored_run(tmp_path / "b", refs, ["qq rr"] * 60)
    capsys.readouterr()
    assert compare.main([str(tmp_path / "a"), str(tmp_path / "b"), "--metric", "tok", "--bootstrap", "100",
                         "--trials", "1000"]) == 0
    row = _tables(capsys.readouterr().out)["tok"]["b"]
    assert row[2] == "0.00" and row[4] == "+0.00" and row[5] == "[+0.00, +0.00]"
    assert row[7] == "1.0000" and row[8] == "AR" and row[10] == "0/1"


def test_segment_scores_mean_std_and_welch(tmp_path, capsys):
    """A metric computed elsewhere: mean ± std over seeds of the segment means, Δ and Welch's t
    of the segment means, 4 digits on a 0-1 scale; a system identical to the baseline: Δ 0, p 1."""
    refs = _corpus(80)
    rng = np.random.default_rng(0)
    base_seg = [rng.uniform(0.6, 0.9, size=80) for _ in range(2)]
    seeds_seg = [base_seg[0] + rng.normal(0.01, 0.05, size=80) for _ in range(3)]
    for k, seg in enumerate(base_seg, 1):
        fx.write_scored_run(tmp_path / "base" / f"seed{k}", refs, _noisy(refs, 0.1, k), {"metricx": seg})
    for k, seg in enumerate(seeds_seg, 1):
        fx.write_scored_run(tmp_path / "sys" / f"seed{k}", refs, _noisy(refs, 0.1, 10 + k), {"metricx": seg})
    capsys.readouterr()
    assert compare.main([str(tmp_path / "base"), str(tmp_path / "sys"), "--metric", "metricx", "chrf",
                         "--bootstrap", "200"]) == 0
    tables = _tables(capsys.readouterr().out)
    assert list(tables) == ["chrf", "metricx"]
    row = tables["metricx"]["sys"]
    means, base_means = np.array([s.mean() for s in seeds_seg]), np.array([s.mean() for s in base_seg])
    assert row[1] == "3" and row[2] == " ".join(f"{m:.4f}" for m in means)
    assert row[3] == f"{means.mean():.4f} ± {means.std(ddof=1):.4f}"
    assert row[4] == f"{means.mean() - base_means.mean():+.4f}"
    w = compare.sig.welch(base_means, means)
    assert row[6] == f"[{w['ci'][0]:+.4f}, {w['ci'][1]:+.4f}]" and row[7] == f"{w['p']:.4f}"
    for k, seg in enumerate(base_seg, 1):
        fx.write_scored_run(tmp_path / "same" / f"seed{k}", refs, _noisy(refs, 0.1, k), {"metricx": seg})
    capsys.readouterr()
    assert compare.main([str(tmp_path / "base"), str(tmp_path / "same"), "--metric", "metricx", "tok",
                         "--bootstrap", "50"]) == 0
    tables = _tables(capsys.readouterr().out)
    assert tables["metricx"]["same"][4] == "+0.0000" and tables["metricx"]["same"][7] == "1.0000"
    assert tables["tok"]["same"][4] == "+0.00" and tables["tok"]["same"][7] == "1.0000"


def test_segment_scores_bad_files_are_refused(tmp_path):
    refs = _corpus(30)
    fx.write_scored_run(tmp_path / "base", refs, refs, {"comet": [0.5] * 30})
    fx.write_scored_run(tmp_path / "short", refs, refs, {"comet": [0.5] * 29})
    ev = fx.write_scored_run(tmp_path / "text", refs, refs, {"comet": [0.5] * 30})
    (ev / "test.de-en.seg.comet").write_text("0.5\n" * 29 + "n/a\n")
    with pytest.raises(SystemExit, match="has 29 scores but the run translated 30"):
        compare.main([str(tmp_path / "base"), str(tmp_path / "short"), "--metric", "comet"])
    with pytest.raises(SystemExit, match="line 30: 'n/a' is not a number"):
        compare.main([str(tmp_path / "base"), str(tmp_path / "text"), "--metric", "comet"])
    with pytest.raises(SystemExit, match="neither a metric of ea-fairseq-bleu .* nor a segment-score file"):
        compare.main([str(tmp_path / "base"), str(tmp_path / "text"), "--metric", "bleurt"])
    scores = ev / "test.de-en.scores.json"
    report = json.loads(scores.read_text())
    for broken in ({k: v for k, v in report.items() if k != "translated"}, {**report, "sentences": "30"}, [report]):
        scores.write_text(json.dumps(broken))
        with pytest.raises(SystemExit, match=r"test.de-en.scores.json is not a scores file as ea-fairseq-bleu writes "
                                             r"it \(a dict with mode \(str\), sentences \(int\), translated"):
            compare.main([str(tmp_path / "base"), str(tmp_path / "text")])


def _wmt_run(directory, refs, hyps, comet=None, model=compare.COMET22):
    """A run scored in --mode wmt (detokenized sacreBLEU and chrF on raw references), with COMET
    segment scores and the model ea-fairseq-bleu records for them."""
    ev = directory / "eval"
    ev.mkdir(parents=True)
    gen = ev / "generate-test.de-en.txt"
    gen.write_text("".join(f"S-{i}\tx\nT-{i}\t{r}\nH-{i}\t-0.1\t{h}\n" for i, (r, h) in enumerate(zip(refs, hyps))))
    (ev / "raw.en").write_text("".join(r + "\n" for r in refs))
    assert bleu.main([str(gen), "--mode", "wmt", "--target-lang", "en", "--raw-ref", str(ev / "raw.en"),
                      "--out-prefix", str(ev / "test.de-en")]) == 0
    if comet is not None:
        (ev / "test.de-en.seg.comet").write_text("".join(f"{v!r}\n" for v in comet))
        path = ev / "test.de-en.scores.json"
        report = json.loads(path.read_text())
        report["metrics"]["comet"] = {"label": "COMET", "score": float(np.mean(comet)), "model": model}
        path.write_text(json.dumps(report))


def test_agreement_only_for_the_variants_the_thresholds_were_fitted_on(tmp_path, capsys):
    """sacreBLEU's detokenized BLEU and chrF, COMET-22: thresholds, and the label names the system
    humans would prefer by the sign of Δ. Tokenized BLEU, chrF on tokenized text, chrF++ and COMET of
    another model: none, with the reason under the table."""
    refs = _corpus()
    n = len(refs)
    _wmt_run(tmp_path / "base", refs, _noisy(refs, 0.1, 1), [0.80] * n)
    _wmt_run(tmp_path / "worse", refs, _noisy(refs, 0.4, 2), [0.7975] * n)
    capsys.readouterr()
    assert compare.main(["base=" + str(tmp_path / "base"), "worse=" + str(tmp_path / "worse"), "--agreement",
                         "--bootstrap", "200", "--trials", "500"]) == 0
    out = capsys.readouterr().out
    tables = _tables(out)
    assert list(tables) == ["tok", "sacrebleu", "chrf", "chrf++", "comet"]
    assert tables["sacrebleu"]["head"][-1].endswith("(55% / 70% at BLEU 0.52 / 1.39; a preferred system at Holm p < 0.05)")
    delta = float(tables["sacrebleu"]["worse"][4])
    hi = float(tables["sacrebleu"]["worse"][5].strip("[]").split(",")[1])
    assert delta < hi < -1.39  # worse is worse: humans would prefer the baseline, not "worse"
    assert tables["sacrebleu"]["worse"][-1] == "70% or more: humans would prefer base"
    assert tables["chrf"]["head"][-1].endswith("(55% / 70% at chrF 0.33 / 1; a preferred system at Holm p < 0.05)")
    assert tables["chrf"]["worse"][-1] == "70% or more: humans would prefer base"
    # COMET-22 on its 0-1 scale: the 0-100 thresholds divided by 100; -0.0025 is 55% to 70%
    assert tables["comet"]["head"][-1].endswith(
        "(55% / 70% at COMET-22 0.001 / 0.0035, scores on a 0-1 scale; a preferred system at Holm p < 0.05)")
    assert tables["comet"]["worse"][4] == "-0.0025" and tables["comet"]["worse"][-1] == "55% to 70%: humans would prefer base"
    for name in ("tok", "chrf++"):
        assert len(tables[name]["head"]) == 12, name  # no column
    assert "(no human-agreement thresholds: tokenized BLEU;" in out
    assert "Kocmi et al. (2024) give no thresholds for it" in out
    # the other direction: the system is better, the label names it
    capsys.readouterr()
    assert compare.main(["worse=" + str(tmp_path / "worse"), "base=" + str(tmp_path / "base"), "--agreement",
                         "--metric", "sacrebleu", "comet", "--bootstrap", "200", "--trials", "500"]) == 0
    tables = _tables(capsys.readouterr().out)
    assert tables["sacrebleu"]["base"][-1] == "70% or more: humans would prefer base"
    assert tables["comet"]["base"][4] == "+0.0025"

    # COMET of another model, chrF on tokenized text (iwslt): no thresholds
    _wmt_run(tmp_path / "b2", refs, _noisy(refs, 0.1, 1), [0.8] * n, model="Unbabel/wmt20-comet-da")
    _wmt_run(tmp_path / "s2", refs, _noisy(refs, 0.4, 2), [0.9] * n, model="Unbabel/wmt20-comet-da")
    fx.write_scored_run(tmp_path / "i1", refs, _noisy(refs, 0.1, 1))
    fx.write_scored_run(tmp_path / "i2", refs, _noisy(refs, 0.4, 2))
    capsys.readouterr()
    assert compare.main([str(tmp_path / "b2"), str(tmp_path / "s2"), "--agreement", "--metric", "comet",
                         "--bootstrap", "50", "--trials", "100"]) == 0
    out = capsys.readouterr().out
    assert len(_tables(out)["comet"]["head"]) == 12
    assert "(no human-agreement thresholds: the COMET model (Unbabel/wmt20-comet-da) is not Unbabel/wmt22-comet-da" in out
    assert compare.main([str(tmp_path / "i1"), str(tmp_path / "i2"), "--agreement", "--metric", "chrf",
                         "--bootstrap", "50", "--trials", "100"]) == 0
    out = capsys.readouterr().out
    assert len(_tables(out)["chrf"]["head"]) == 12 and "chrF on tokenized text (--mode iwslt)" in out


def test_agreement_names_the_system_with_the_higher_score(tmp_path, capsys):
    """Two nearly untrained systems, chrF about 1 and 5: whichever is the baseline, the system
    humans would prefer is the one with the higher chrF, and Δ's sign says the same."""
    refs = _corpus()
    junk = lambda seed: [" ".join(random.Random(seed * 1000 + i).choice(["zq", "xv", "tk"])  # noqa: E731
                                  for _ in range(6)) for i in range(len(refs))]
    _wmt_run(tmp_path / "ea", refs, junk(1))
    _wmt_run(tmp_path / "base", refs, [h if i % 4 else r.split()[0] + " " + h for i, (h, r) in
                                       enumerate(zip(junk(2), refs))])
    for order in (["ea", "base"], ["base", "ea"]):
        capsys.readouterr()
        assert compare.main([f"{n}={tmp_path / n}" for n in order] + ["--agreement", "--metric", "chrf",
                                                                       "--bootstrap", "200", "--trials", "200"]) == 0
        table = _tables(capsys.readouterr().out)["chrf"]
        first, second = (float(table[n][3]) for n in order)
        assert first < 10 and second < 10 and abs(first - second) > 1
        higher = order[0] if first > second else order[1]
        row = table[order[1]]
        assert (float(row[4]) > 0) == (higher == order[1])
        assert row[-1].endswith(f"humans would prefer {higher}"), row[-1]


def test_comet_scores_through_unbabel_comet_api(tmp_path, capsys, monkeypatch):
    """--comet-model: unbabel-comet's load_from_checkpoint/predict (a stand-in package with
    the same API: COMET itself is an optional extra), segment scores beside the other files,
    compared like any segment metric."""
    pkg = tmp_path / "fake" / "comet"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        "class _Out:\n"
        "    def __init__(self, scores): self.scores = scores; self.system_score = sum(scores) / len(scores)\n"
        "class _Model:\n"
        "    def predict(self, data, batch_size=8, gpus=1):\n"
        "        assert gpus == 0 and set(data[0]) == {'src', 'mt', 'ref'}\n"
        "        return _Out([len(set(d['mt'].split()) & set(d['ref'].split())) / 10 for d in data])\n"
        "def load_from_checkpoint(path):\n"
        "    assert open(path).read() == 'ckpt'\n"
        "    return _Model()\n")
    monkeypatch.syspath_prepend(str(tmp_path / "fake"))
    model = tmp_path / "model.ckpt"
    model.write_text("ckpt")
    refs = _corpus(40)
    hyps = _noisy(refs, 0.3, 1)
    ev = tmp_path / "eval"
    ev.mkdir()
    gen = ev / "generate-test.de-en.txt"
    gen.write_text("".join(f"S-{i}\tsrc {i}\nT-{i}\t{r}\nH-{i}\t-0.1\t{h}\n" for i, (r, h) in enumerate(zip(refs, hyps))))
    assert bleu.main([str(gen), "--mode", "iwslt", "--out-prefix", str(ev / "test.de-en"),
                      "--comet-model", str(model), "--comet-gpus", "0"]) == 0
    expected = [len(set(h.split()) & set(r.split())) / 10 for h, r in zip(hyps, refs)]
    assert [float(x) for x in (ev / "test.de-en.seg.comet").read_text().split()] == expected
    assert f": {np.mean(expected):.4f}" in capsys.readouterr().out.splitlines()[-1]
    report = json.load(open(ev / "test.de-en.scores.json"))
    assert report["metrics"]["comet"]["score"] == pytest.approx(np.mean(expected))
    capsys.readouterr()
    assert bleu.main([str(gen), "--mode", "iwslt", "--comet-model", str(tmp_path / "missing.ckpt")]) == 3
    assert capsys.readouterr().out.splitlines()[-1].startswith(
        f"COMET: not scored: COMET model {tmp_path / 'missing.ckpt'} is not a checkpoint file")



def test_one_run_against_several_is_tested_by_permutation_and_said_so(tmp_path, capsys):
    """One baseline run against three of a system: no Welch; the exact permutation test over the
    four runs is the test (its smallest p 1/4: the baseline run is one of four that could be
    the odd one out), and a line says the single run's seed spread is unknown."""
    refs = _corpus(60)
    fx.write_scored_run(tmp_path / "base" / "seed1", refs, _noisy(refs, 0.3, 1))
    for k in range(3):
        fx.write_scored_run(tmp_path / "ea" / f"seed{k + 1}", refs, _noisy(refs, 0.1 + 0.01 * k, 10 + k))
    capsys.readouterr()
    assert compare.main([str(tmp_path / "base"), str(tmp_path / "ea"), "--metric", "tok", "--bootstrap", "50"]) == 0
    out = capsys.readouterr().out
    row = _tables(out)["tok"]["ea"]
    scores = [float(x) for x in row[2].split()]
    assert row[6] == "–" and row[8] == "permutation" and row[11] == "0.2500 (0.2500)"
    assert row[7] == "0.2500" and len(scores) == 3
    assert "(warning: base has one run: its seed spread is unknown" in out
    assert "Holm: over the 1 test reported" in out


def test_a_one_sentence_test_set_is_warned_of_and_counts_are_named(tmp_path, capsys):
    refs = _corpus(1)
    fx.write_scored_run(tmp_path / "a", refs, _noisy(refs, 0.2, 1))
    fx.write_scored_run(tmp_path / "b", refs, _noisy(refs, 0.3, 2))
    capsys.readouterr()
    assert compare.main([str(tmp_path / "a"), str(tmp_path / "b"), "--metric", "tok", "--bootstrap", "20",
                         "--trials", "20"]) == 0
    assert "warning: the test set has 1 sentence" in capsys.readouterr().out
    more = _corpus(3)
    fx.write_scored_run(tmp_path / "c", more, _noisy(more, 0.2, 1))
    with pytest.raises(SystemExit, match=r"translated 3 sentences, .* 1: not comparable"):
        compare.main([str(tmp_path / "a"), str(tmp_path / "c"), "--metric", "tok"])
