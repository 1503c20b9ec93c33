"""The recipes' scorers on known examples: WMT'14 En-De's two compound-split conventions
against fairseq-score, and ea-fairseq-compare's significance tests on known different and
identical systems."""
import re
import subprocess

import pytest

from support import recipe_fixtures as fx
from ea_fairseq_cli import bleu
from ea_fairseq_cli import compare_systems as compare
from support.recipe_support import compare_table, tool


def test_compound_split_conventions_on_a_known_example(tmp_path):
    """WMT'14 En-De: fairseq's compound_split_bleu.sh splits generate's lines as they are, the
    tensor2tensor convention joins the aggressive-hyphen "@-@" first; both are reported."""
    line = "das Bundes @-@ Land , E-Mail x-y-z e - f"
    assert bleu.compound_split_fairseq(line) == \
        "das Bundes @ ##AT##-##AT## @ Land , E ##AT##-##AT## Mail x ##AT##-##AT## y-z e - f"
    assert bleu.compound_split(line) == \
        "das Bundes ##AT##-##AT## Land , E ##AT##-##AT## Mail x ##AT##-##AT## y-z e - f"
    hyp = ["das Bundes @-@ Land ist groß", "eine E-Mail kam heute"]
    ref = ["das Bundes @-@ Land ist klein", "eine E-Mail kam gestern"]
    gen = tmp_path / "generate.txt"
    gen.write_text("".join(f"S-{i}\tx\nT-{i}\t{r}\nH-{i}\t-0.1\t{h}\nD-{i}\t-0.1\t{h}\n"
                           for i, (h, r) in enumerate(zip(hyp, ref))), encoding="utf-8")
    raw = tmp_path / "raw.de"
    raw.write_text("das Bundes-Land ist klein\neine E-Mail kam gestern\n", encoding="utf-8")
    out = subprocess.run([tool("ea-fairseq-bleu"), gen, "--mode", "wmt14-en-de",
                          "--target-lang", "de", "--raw-ref", raw, "--out-prefix", tmp_path / "t"],
                         capture_output=True, text=True, check=True).stdout
    scores = {m.group(1): float(m.group(2)) for m in
              re.finditer(r"^compound-split BLEU, (\S+) convention .*?: ([0-9.]+) ", out, re.M)}
    # the fairseq convention counts the "@" around each "@-@" as two more matching tokens
    assert scores == {"fairseq": 80.91, "tensor2tensor": 75.98}
    # each equals what fairseq-score (compound_split_bleu.sh's scorer) prints on its files:
    # fairseq_cli/score.py's default branch, in this process
    from fairseq.data import Dictionary
    from fairseq.scoring import bleu as fairseq_bleu

    for name, convention in (("split-fairseq", "fairseq"), ("split-t2t", "tensor2tensor")):
        d = Dictionary()
        scorer = fairseq_bleu.Scorer(fairseq_bleu.BleuConfig(pad=d.pad(), eos=d.eos(), unk=d.unk()))
        with open(tmp_path / f"t.hyp.{name}") as fsys, open(tmp_path / f"t.ref.{name}") as fref:
            for sys_tok, ref_tok in zip(fsys.readlines(), fref.readlines()):
                scorer.add(d.encode_line(ref_tok), d.encode_line(sys_tok))
        assert scorer.result_string(4).startswith(f"BLEU4 = {scores[convention]:.2f},")


def test_significance_on_known_different_and_identical_systems(tmp_path, capsys, monkeypatch):
    import random
    from sacrebleu.metrics import BLEU
    from sacrebleu.significance import PairedTest

    rng = random.Random(0)
    vocab = "the a cat dog sat ran on under mat house green big small today".split()
    refs = [" ".join(rng.choice(vocab) for _ in range(rng.randint(5, 12))) for _ in range(150)]

    def noisy(p, seed):
        g = random.Random(seed)
        return [" ".join(w if g.random() > p else g.choice(vocab) for w in r.split()) for r in refs]

    good, bad = noisy(0.1, 1), noisy(0.4, 2)
    fx.write_scored_run(tmp_path / "base", refs, good)
    fx.write_scored_run(tmp_path / "same", refs, good)
    fx.write_scored_run(tmp_path / "worse", refs, bad)
    for seed in (1, 2, 3):
        fx.write_scored_run(tmp_path / "seeds" / f"seed{seed}", refs, noisy(0.1, 10 + seed))
    capsys.readouterr()
    assert compare.main([str(tmp_path / d) for d in ("base", "same", "worse", "seeds")]) == 0
    out = capsys.readouterr().out
    table = compare_table(out, "tok")
    assert table["same"][4] == "+0.00" and table["same"][7:9] == ["1.0000", "AR"]  # identical: nothing to see
    assert float(table["worse"][4]) < -10 and float(table["worse"][7]) < 0.01  # clearly different
    assert table["seeds"][1] == "3" and len(table["seeds"][2].split()) == 3 and "±" in table["seeds"][3]
    # one run against three: no Welch; the permutation test over the four runs (its smallest p 1/4)
    assert table["seeds"][6] == "–" and table["seeds"][8] == "permutation" and float(table["seeds"][7]) >= 0.25
    assert "base has one run: its seed spread is unknown" in out
    assert "150 sentences" in out.splitlines()[0] and "tokenized BLEU" in out.splitlines()[3]
    assert set(compare_table(out, "chrf")) == set(compare_table(out, "chrf++")) == set(table)  # every metric
    # one run per system: approximate randomisation with sacreBLEU's draws (seed 12345, 10,000
    # trials), which here (no trial ties |Δ|) gives sacreBLEU's --paired-ar p
    monkeypatch.setenv("SACREBLEU_SEED", "12345")
    test = PairedTest([("base", good), ("worse", bad)], {"BLEU": BLEU(tokenize="none", smooth_method="none")},
                      [refs], test_type="ar", n_samples=10000)
    assert f"{test()[1]['BLEU'][1].p_value:.4f}" == table["worse"][7]
    # systems scored on other references are not compared
    fx.write_scored_run(tmp_path / "other", [r + " x" for r in refs], good)
    with pytest.raises(SystemExit, match="other references"):
        compare.main([str(tmp_path / "base"), str(tmp_path / "other")])
