"""IWSLT'14 De-En end to end, offline: prepare-iwslt14.sh on a tiny fixture archive, 2 epochs
through train.sh on CPU, evaluate.sh on the averaged checkpoints; the run's record and its
refusal to resume changed settings, SEEDS, and RAN's limit on sentence length."""
import re

import pytest

from support import recipe_fixtures as fx
from ea_fairseq_cli import bleu
from support.recipe_support import (REPO, RECIPES, TINY, TINY_RUN, TRAIN_SH_RUN, compare_table, env,  # noqa: F401
                            evaluate_recipe, fairseq_train_in_process, lines, prepare, run, score_in, tool)


def _iwslt14(root, env):
    """prepare-iwslt14.sh (separate dictionaries, as fairseq's recipe), then 2 epochs through
    train.sh on CPU (transformer_lite, tiny dims): fairseq-train accepts the data with
    --share-decoder-input-output-embed, which train.sh picks for separate dictionaries."""
    info = fx.iwslt14(root / "raw", n_train=200)
    data = prepare("prepare-iwslt14.sh", root / "raw", root, env)
    save = root / "checkpoints"
    train_env = dict(env, DATA=str(data), SAVE_DIR=str(save), MAX_EPOCH="2", MAX_TOKENS="1000", CPU="1")
    args = ["transformer_lite", "iwslt14_de_en", *TINY[2:], *TRAIN_SH_RUN]
    proc = run(["bash", RECIPES / "train.sh", *args], train_env, cwd=root)
    return dict(root=root, data=data, save=save, info=info, train_log=proc.stdout + proc.stderr,
                train_env=train_env, train_args=args)


@pytest.fixture(scope="module")
def iwslt(tmp_path_factory, env):  # noqa: F811
    return _iwslt14(tmp_path_factory.mktemp("iwslt14"), env)


def test_prepare_iwslt14(iwslt):
    data, prep = iwslt["data"], iwslt["root"] / "work" / "prep"
    for split in ("train", "valid", "test"):
        for lang in ("de", "en"):
            assert (data / f"{split}.de-en.{lang}.bin").is_file()
    # fairseq's recipe: one dictionary per language (the PA paper's 8,848 / 6,632 types)
    assert (data / "code").is_file() and (data / "dict.de.txt").read_text() != (data / "dict.en.txt").read_text()
    # fairseq's splits: valid = every 23rd of the cleaned training pairs; test = the 5 sets
    n_train, n_valid = len(lines(prep / "train.de")), len(lines(prep / "valid.de"))
    assert n_valid == (n_train + n_valid) // 23 and 150 < n_train + n_valid <= 202
    assert len(lines(prep / "test.en")) == iwslt["info"]["test_lines"] == len(lines(prep / "test.de"))
    text = (prep / "train.en").read_text() + (prep / "test.en").read_text()
    assert text == text.lower(), "IWSLT'14 is lowercased"
    assert "&quot;" in text and "<url>" not in text and "<title>" not in text
    assert "\u2019" not in (prep / "test.en").read_text()
    assert len(lines(data / "code")) > 10  # joint BPE merges learnt on de+en
    log = (iwslt["save"] / "train.log").read_text()  # fairseq's configuration: in its log file only
    assert "arch='transformer_lite'" not in iwslt["train_log"] and "num_updates" in iwslt["train_log"]
    assert "arch='transformer_lite'" in log and "num_updates" in log
    assert "share_decoder_input_output_embed=True" in log and "share_all_embeddings=False" in log
    assert (iwslt["save"] / "checkpoint2.pt").is_file()


def test_evaluate_iwslt_end_to_end(iwslt, env):
    proc = evaluate_recipe(iwslt, "iwslt", env)
    out = proc.stdout
    assert "average of the last 2 epoch checkpoints" in out
    assert re.search(r"^fairseq tokenized BLEU .*: BLEU4 = [0-9.]+", out, re.M), out
    assert "sacreBLEU" not in out
    ev = iwslt["save"] / "eval"
    assert (ev / "average_last2_epochs.pt").is_file()
    gen = (ev / "generate-test.de-en.txt").read_text()
    assert len(re.findall(r"^H-\d+\t", gen, re.M)) == iwslt["info"]["test_lines"]  # none dropped
    # fairseq's scorer and a whitespace-token BLEU of the same H/T lines agree
    parsed = bleu.parse_generate(str(ev / "generate-test.de-en.txt"))
    ids = sorted(parsed["H"])
    score, _ = bleu.tokenized_bleu([parsed["H"][i] for i in ids], [parsed["T"][i] for i in ids])
    assert abs(score.score - score_in(out.splitlines()[2])) < 0.01


def test_run_hygiene_log_record_and_refusal_to_resume_changed_settings(iwslt, env):
    save, root = iwslt["save"], iwslt["root"]
    assert "num_updates" in (save / "train.log").read_text()  # fairseq's log, in the run directory
    command = (save / "train.command").read_text()
    assert "train.sh transformer_lite iwslt14_de_en" in command and "fairseq-train" in command
    assert "CPU=1" in command and "MAX_EPOCH=2" in command
    settings = (save / "train.settings").read_text()
    assert "family=transformer_lite" in settings and "\n--lr 1e-3\n" in settings
    assert "# evaluate with: bash examples/translation/evaluate.sh" in settings
    train_sh = ["bash", RECIPES / "train.sh", *iwslt["train_args"]]
    proc = run(train_sh, dict(iwslt["train_env"], LR="5e-4"), root, check=False)
    assert proc.returncode != 0 and "not resuming" in proc.stderr, proc.stderr
    assert "was: --lr 1e-3" in proc.stderr and "now: --lr 5e-4" in proc.stderr
    assert "ALLOW_CHANGED_SETTINGS=1" in proc.stderr
    assert (save / "train.settings").read_text() == settings
    # the same settings resume (fairseq finds epoch 2 done and stops)
    proc = run(train_sh, iwslt["train_env"], root)
    assert "resuming" in proc.stderr
    assert len(re.findall(r"^# \d{4}-\d\d-\d\d ", (save / "train.command").read_text(), re.M)) == 2  # two starts


def test_seeds_train_one_run_each_and_evaluate_to_one_table(iwslt, env, tmp_path):
    """SEEDS="1 2": one run per seed in SAVE_DIR/seedN; evaluate.sh scores each (its
    checkpoint_best.pt: averaging is test_evaluate_iwslt_end_to_end's) and prints their mean
    and deviation; compare_systems.py puts two systems in one table."""
    base = tmp_path / "seeds"
    proc = run(["bash", RECIPES / "train.sh", *iwslt["train_args"]],
               dict(iwslt["train_env"], SAVE_DIR=str(base), MAX_EPOCH="1", SEEDS="1 2"), tmp_path)
    assert "2 runs" in proc.stderr and f"evaluate every seed (mean ± std) with: bash examples/translation/evaluate.sh {base} " in proc.stderr
    for seed in (1, 2):
        run_dir = base / f"seed{seed}"
        assert (run_dir / "checkpoint1.pt").is_file() and (run_dir / "train.log").is_file()
        assert f"--seed {seed} " in (run_dir / "train.command").read_text()
    assert not list(base.glob("*.pt"))
    out = run(["bash", RECIPES / "evaluate.sh", base, iwslt["data"], "iwslt", "--best",
               "--cpu", "--", "--max-len-a", "0", "--max-len-b", "6"], env, tmp_path).stdout
    row = compare_table(out)["seeds"]
    assert row[1] == "2" and len(row[2].split()) == 2 and "±" in row[3]
    for seed in (1, 2):
        assert (base / f"seed{seed}" / "eval" / "test.de-en.scores.json").is_file()
    if not (iwslt["save"] / "eval" / "test.de-en.scores.json").is_file():
        evaluate_recipe(iwslt, "iwslt", env)
    out = run([tool("ea-fairseq-compare"), f"two_epochs={iwslt['save']}",
               f"one_epoch={base}"], env, tmp_path).stdout
    table = compare_table(out)
    assert table["two_epochs"][1] == "1" and table["one_epoch"][1] == "2"
    assert re.fullmatch(r"[+-][0-9.]+", table["one_epoch"][4])
    assert re.fullmatch(r"\[[+-][0-9.]+, [+-][0-9.]+\]", table["one_epoch"][5])  # the bootstrap CI
    # one run against two: no Welch; the permutation test over the three runs, its smallest p 1/3
    assert table["one_epoch"][6] == "–" and table["one_epoch"][8] == "permutation"
    assert float(table["one_epoch"][7]) >= 1 / 3 - 1e-4 and "two_epochs has one run: its seed spread is unknown" in out


def test_ran_with_over_long_test_sentences(iwslt, env, tmp_path):
    """A RAN model accepts sentences up to --ran-max-positions: evaluate.sh stops with the
    count, or with --skip-long translates the rest and labels every BLEU with its coverage.
    (The model: one epoch of fairseq-train in this process; train.sh's runs are the fixture's.)"""
    save = tmp_path / "ran"
    fairseq_train_in_process(iwslt["data"], "--user-dir", REPO / "ea_fairseq", "--arch", "ran_e_lite", *TINY[2:],
                             "--share-decoder-input-output-embed", "--ran-max-positions", "12",
                             "--skip-invalid-size-inputs-valid-test", "--optimizer", "adam", "--lr", "1e-3",
                             "--max-tokens", "1000", "--max-epoch", "1", "--save-dir", save, *TINY_RUN)
    assert (save / "checkpoint_best.pt").is_file()
    sizes = bleu.idx_sizes(str(iwslt["data"] / "test.de-en.de.idx"))
    n_long, n_all = int((sizes > 12).sum()), len(sizes)
    assert 0 < n_long < n_all
    evaluate = ["bash", RECIPES / "evaluate.sh", save, iwslt["data"], "iwslt", "--best", "--cpu"]
    proc = run(evaluate, env, tmp_path, check=False)
    assert proc.returncode != 0
    assert f"{n_long} of the {n_all} test sentences are longer than this model accepts" in proc.stderr
    assert "--skip-long" in proc.stderr and "--ran-max-positions" in proc.stderr
    out = run([*evaluate, "--skip-long", "--", "--max-len-a", "0", "--max-len-b", "6"], env, tmp_path).stdout
    assert f"[on {n_all - n_long} of {n_all} sentences: {n_long} not translated" in out
