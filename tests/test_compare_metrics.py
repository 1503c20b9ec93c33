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

import recipe_fixtures as fx
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
    assert out.splitlines()[-1].startswith("COMET: not scored (")  # says how, in one line


@pytest.mark.parametrize("test, flag", [("bs", "--paired-bs"), ("ar", "--paired-ar")])
def test_compare_equals_sacrebleu_command_line_for_each_metric(tmp_path, capsys, test, flag):
    """One run per system: score, p-value and signature of every metric are what
    ``sacrebleu REF -i BASE SYS --paired-bs/-ar`` prints on the files evaluate.sh wrote."""
    refs = _corpus()
    base, system = _noisy(refs, 0.15, 1), _noisy(refs, 0.18, 2)
    ev = fx.write_scored_run(tmp_path / "base", refs, base)
    fx.write_scored_run(tmp_path / "sys", refs, system)
    capsys.readouterr()
    samples = ["--samples", "1000"] if test == "ar" else []  # (sacreBLEU's ar default is 10000)
    assert compare.main([str(tmp_path / "base"), str(tmp_path / "sys"), "--test", test, *samples]) == 0
    tables = _tables(capsys.readouterr().out)
    assert list(tables) == ["tok", "chrf", "chrf++"]
    for name, args in (("tok", ["-m", "bleu", "--tokenize", "none", "--smooth-method", "none", "--force"]),
                       ("chrf", ["-m", "chrf"]), ("chrf++", ["-m", "chrf", "--chrf-word-order", "2"])):
        cli_args = args + [flag] + (["--paired-ar-n", "1000"] if test == "ar" else [])
        p, score, sig = _sacrebleu_cli(ev / "test.de-en.ref.tok", ev / "test.de-en.hyp.tok",
                                       tmp_path / "sys" / "eval" / "test.de-en.hyp.tok", *cli_args)
        row = tables[name]["sys"]
        assert f"{p:.4f}" == row[5], name
        assert f"{score:.1f}" == f"{float(row[3]):.1f}", name
        assert f"sacreBLEU signature: {sig}" in tables[name]["title"], name


def test_segment_scores_mean_std_and_paired_bootstrap(tmp_path, capsys):
    """A metric computed elsewhere: mean ± std over seeds of the segment means; the paired
    bootstrap over segment means with sacreBLEU's resamples (numpy default_rng(seed).choice)
    and p-value, here written out as a loop."""
    refs = _corpus(80)
    rng = np.random.default_rng(0)
    base_seg = rng.uniform(0.6, 0.9, size=80)
    seeds_seg = [base_seg + rng.normal(0.01, 0.05, size=80) for _ in range(3)]
    fx.write_scored_run(tmp_path / "base", refs, _noisy(refs, 0.1, 1), {"metricx": base_seg})
    for k, seg in enumerate(seeds_seg, 1):
        fx.write_scored_run(tmp_path / "sys" / f"seed{k}", refs, _noisy(refs, 0.1, 10 + k), {"metricx": seg})
    capsys.readouterr()
    assert compare.main([str(tmp_path / "base"), str(tmp_path / "sys"), "--metric", "metricx", "chrf"]) == 0
    tables = _tables(capsys.readouterr().out)
    assert list(tables) == ["chrf", "metricx"]
    row = tables["metricx"]["sys"]
    means = np.array([s.mean() for s in seeds_seg])
    assert row[1] == "3" and row[2] == " ".join(f"{m:.4f}" for m in means)  # (4 digits on a 0-1 scale)
    assert row[3] == f"{means.mean():.4f} ± {means.std(ddof=1):.4f}"
    assert row[4] == f"{means.mean() - base_seg.mean():+.4f}"

    def koehn(a, b, samples=1000, seed=12345):
        idxs = np.random.default_rng(seed).choice(len(a), size=(samples, len(a)), replace=True)
        observed = abs(b.mean() - a.mean())
        diffs = np.array([abs(b[i].mean() - a[i].mean()) for i in idxs])
        return (np.sum(diffs - diffs.mean() > observed) + 1) / (samples + 1)

    assert row[5] == f"{max(koehn(base_seg, s) for s in seeds_seg):.4f}"
    assert 0.001 < float(row[5]) < 1
    # a system identical to the baseline: p = 1
    fx.write_scored_run(tmp_path / "same", refs, _noisy(refs, 0.1, 1), {"metricx": base_seg})
    capsys.readouterr()
    assert compare.main([str(tmp_path / "base"), str(tmp_path / "same"), "--metric", "metricx", "tok"]) == 0
    tables = _tables(capsys.readouterr().out)
    assert tables["metricx"]["same"][4:] == ["+0.0000", "1.0000"] and tables["tok"]["same"][4:] == ["+0.00", "1.0000"]


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
    assert compare.main(["base=" + str(tmp_path / "base"), "worse=" + str(tmp_path / "worse"), "--agreement"]) == 0
    out = capsys.readouterr().out
    tables = _tables(out)
    assert list(tables) == ["tok", "sacrebleu", "chrf", "chrf++", "comet"]
    assert tables["sacrebleu"]["head"][-1].endswith("(55% / 70% at BLEU 0.52 / 1.39)")
    delta = float(tables["sacrebleu"]["worse"][4])
    assert delta < -1.39  # worse is worse: humans would prefer the baseline, not "worse"
    assert tables["sacrebleu"]["worse"][-1] == "70% or more: humans would prefer base"
    assert tables["chrf"]["head"][-1].endswith("(55% / 70% at chrF 0.33 / 1)")
    assert tables["chrf"]["worse"][-1] == "70% or more: humans would prefer base"
    # COMET-22 on its 0-1 scale: the 0-100 thresholds divided by 100; -0.0025 is 55% to 70%
    assert tables["comet"]["head"][-1].endswith("(55% / 70% at COMET-22 0.001 / 0.0035, scores on a 0-1 scale)")
    assert tables["comet"]["worse"][4] == "-0.0025" and tables["comet"]["worse"][-1] == "55% to 70%: humans would prefer base"
    for name in ("tok", "chrf++"):
        assert len(tables[name]["head"]) == 6, name  # no column
    assert "(no human-agreement thresholds: tokenized BLEU;" in out
    assert "Kocmi et al. (2024) give no thresholds for it" in out
    # the other direction: the system is better, the label names it
    capsys.readouterr()
    assert compare.main(["worse=" + str(tmp_path / "worse"), "base=" + str(tmp_path / "base"), "--agreement",
                         "--metric", "sacrebleu", "comet"]) == 0
    tables = _tables(capsys.readouterr().out)
    assert tables["sacrebleu"]["base"][-1] == "70% or more: humans would prefer base"
    assert tables["comet"]["base"][4] == "+0.0025"

    # COMET of another model, chrF on tokenized text (iwslt): no thresholds
    _wmt_run(tmp_path / "b2", refs, _noisy(refs, 0.1, 1), [0.8] * n, model="Unbabel/wmt20-comet-da")
    _wmt_run(tmp_path / "s2", refs, _noisy(refs, 0.4, 2), [0.9] * n, model="Unbabel/wmt20-comet-da")
    fx.write_scored_run(tmp_path / "i1", refs, _noisy(refs, 0.1, 1))
    fx.write_scored_run(tmp_path / "i2", refs, _noisy(refs, 0.4, 2))
    capsys.readouterr()
    assert compare.main([str(tmp_path / "b2"), str(tmp_path / "s2"), "--agreement", "--metric", "comet"]) == 0
    out = capsys.readouterr().out
    assert len(_tables(out)["comet"]["head"]) == 6
    assert "(no human-agreement thresholds: the COMET model (Unbabel/wmt20-comet-da) is not Unbabel/wmt22-comet-da" in out
    assert compare.main([str(tmp_path / "i1"), str(tmp_path / "i2"), "--agreement", "--metric", "chrf"]) == 0
    out = capsys.readouterr().out
    assert len(_tables(out)["chrf"]["head"]) == 6 and "chrF on tokenized text (--mode iwslt)" in out


def test_agreement_label_follows_the_sign():
    t = compare.AGREEMENT["BLEU"]
    assert compare.agreement_label(+2.0, t, "sys", "base") == "70% or more: humans would prefer sys"
    assert compare.agreement_label(-2.0, t, "sys", "base") == "70% or more: humans would prefer base"
    assert compare.agreement_label(-1.0, t, "sys", "base") == "55% to 70%: humans would prefer base"
    assert compare.agreement_label(0.3, t, "sys", "base").startswith("below 55%")
    assert compare.agreement_label(0.0, t, "sys", "base") == "no difference"


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

