"""WMT'14 En-De end to end, offline: prepare-wmt14en2de.sh on tiny fixture archives, 2 epochs
of fairseq-train (its entry point, in this process), evaluate.sh's tokenized, compound-split
and detokenized scores, its other modes and errors, and a run without COMET."""
import re

import pytest

from support import recipe_fixtures as fx
from ea_fairseq_cli import bleu
from support.recipe_support import RECIPES, env, evaluate_recipe, lines, prepare, run, train_in_process  # noqa: F401  (fixture)


def _wmt14_en_de(root, env):
    tests = fx.wmt14(root / "raw", "de")
    data = prepare("prepare-wmt14en2de.sh", root / "raw", root, env)
    save = train_in_process(data, root / "checkpoints")
    return dict(root=root, data=data, save=save, tests=tests)


@pytest.fixture(scope="module")
def wmt14_en_de(tmp_path_factory, env):  # noqa: F811
    return _wmt14_en_de(tmp_path_factory.mktemp("wmt14_en_de"), env)


def test_prepare_wmt14en2de(wmt14_en_de):
    data, prep = wmt14_en_de["data"], wmt14_en_de["root"] / "work" / "prep"
    for split in ("train", "valid", "test"):
        assert (data / f"{split}.en-de.de.idx").is_file()
    # raw test sentences kept for sacreBLEU, in test-set order; tokenized with -a
    assert lines(data / "test.raw.en-de.de") == wmt14_en_de["tests"]["test_de"]
    assert lines(data / "test.raw.en-de.en") == wmt14_en_de["tests"]["test_en"]
    assert " @-@ " in (prep / "test.de").read_text().replace("@@ ", "")
    assert len(lines(prep / "valid.en")) == 6  # newstest2013, not a slice of train
    assert (wmt14_en_de["save"] / "checkpoint2.pt").is_file()


def test_evaluate_wmt14_en_de_end_to_end(wmt14_en_de, env):
    out = evaluate_recipe(wmt14_en_de, "wmt14-en-de", env, "--ran-wmt").stdout
    assert "beam 4, lenpen 0.6" in out
    for convention in ("fairseq convention", "tensor2tensor convention"):  # both, labelled
        assert re.search(rf"^compound-split BLEU, {convention} .*: [0-9.]+ .*tok:none", out, re.M), out
    assert re.search(r"^detokenized sacreBLEU .*: [0-9.]+ .*signature: nrefs:1\|case:mixed\|eff:no\|"
                     r"tok:13a\|smooth:exp\|version:", out, re.M), out
    ev = wmt14_en_de["save"] / "eval"
    assert " @ ##AT##-##AT## @ " in (ev / "test.en-de.ref.split-fairseq").read_text()
    assert " @ " not in (ev / "test.en-de.ref.split-t2t").read_text()
    assert "##AT##" not in (ev / "test.en-de.ref.tok").read_text()
    assert len(lines(ev / "test.en-de.hyp.sacrebleu")) == len(wmt14_en_de["tests"]["test_de"])


def test_evaluate_other_wmt_mode_and_errors(wmt14_en_de, env, capsys):
    info = wmt14_en_de
    ev = info["save"] / "eval"
    # --mode wmt (En-Fr, WMT'17): tokenized BLEU without the compound split, and sacreBLEU
    assert bleu.main([str(ev / "generate-test.en-de.txt"), "--mode", "wmt", "--target-lang", "de",
                      "--raw-ref", str(info["data"] / "test.raw.en-de.de"),
                      "--expect-idx", str(info["data"] / "test.en-de.en.idx")]) == 0
    out = capsys.readouterr().out
    assert "tokenized BLEU (generate's tokenized H/T lines" in out and "compound-split" not in out
    assert "detokenized sacreBLEU" in out
    # a reference file that does not match the test set is refused
    short = info["root"] / "short.de"
    short.write_text("one line\n")
    assert bleu.main([str(ev / "generate-test.en-de.txt"), "--mode", "wmt", "--target-lang", "de",
                      "--raw-ref", str(short)]) == 1
    assert "has 1 lines" in capsys.readouterr().err
    # fewer checkpoints than asked for: a clear error before anything is translated
    proc = run(["bash", RECIPES / "evaluate.sh", info["save"], info["data"], "wmt",
                "--num-avg", "5", "--cpu"], env, info["root"], check=False)
    assert proc.returncode != 0 and "evaluate with --num-avg 2" in proc.stderr
    proc = run(["bash", RECIPES / "evaluate.sh", info["save"], info["data"], "bogus"],
               env, info["root"], check=False)
    assert proc.returncode != 0 and "MODE must be" in proc.stderr


def test_evaluate_without_comet_scores_bleu_and_says_why(wmt14_en_de, env, tmp_path):
    """--comet-model where no COMET venv exists: BLEU and chrF are still scored and shown,
    one line says COMET was not and how to get it, and the run fails with ea-fairseq-bleu's
    exit status 3 (COMET was asked for). The run's last epoch checkpoint is scored as it is
    (averaging is the end-to-end test's)."""
    env = dict(env, EA_FAIRSEQ_COMET_VENV=str(tmp_path / "no-comet-venv"))
    info = wmt14_en_de
    proc = run(["bash", RECIPES / "evaluate.sh", info["save"], info["data"], "wmt",
                "--checkpoint", info["save"] / "checkpoint2.pt", "--cpu",
                "--comet-model", str(tmp_path / "model.ckpt"), "--out-dir", str(tmp_path / "eval"), "--",
                "--max-len-a", "0", "--max-len-b", "6"], env, info["root"], check=False)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert re.search(r"^detokenized sacreBLEU .*: [0-9.]+", proc.stdout, re.M), proc.stdout
    assert "chrF" in proc.stdout
    assert "[evaluate] error: COMET not scored" in proc.stderr and "setup_comet_env.sh" in proc.stderr
