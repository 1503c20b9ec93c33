"""The translation recipes, offline, on tiny fixture archives (tests/recipe_fixtures.py).

Each prepare script runs with --raw-dir (so it never touches the network; EA_NO_DOWNLOAD is
set as well), its binarized output is trained on for a few updates with fairseq-train, and
examples/translation/evaluate.sh scores the resulting checkpoints end to end. The CLIs are the ones
installed next to the Python running the tests.
"""
import ast
import importlib.util
import json
import lzma
import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import recipe_fixtures as fx
from ea_fairseq_cli import bleu
from ea_fairseq_cli import compare_systems as compare

REPO = Path(__file__).resolve().parent.parent
RECIPES = REPO / "examples" / "translation"
BIN = Path(sys.executable).parent
TINY = ["--arch", "transformer", "--encoder-layers", "1", "--decoder-layers", "1",
        "--encoder-embed-dim", "16", "--decoder-embed-dim", "16",
        "--encoder-ffn-embed-dim", "32", "--decoder-ffn-embed-dim", "32",
        "--encoder-attention-heads", "2", "--decoder-attention-heads", "2"]
TINY_RUN = ["--required-batch-size-multiple", "1", "--no-progress-bar", "--num-workers", "0",
            "--log-format", "simple", "--seed", "1", "--cpu"]
# the same through train.sh, which sets the seed (SEED), the device (CPU=1) and the log format
TRAIN_SH_RUN = ["--required-batch-size-multiple", "1", "--no-progress-bar", "--num-workers", "0"]


def tool(name: str) -> str:
    path = BIN / name
    if not path.exists():
        pytest.skip(f"{name} is not installed next to {sys.executable}")
    return str(path)


@pytest.fixture(scope="module")
def env():
    e = dict(os.environ)
    e.update(PATH=f"{BIN}{os.pathsep}{e.get('PATH', '')}", PYTHON=sys.executable,
             FAIRSEQ_GENERATE=tool("fairseq-generate"),
             FAIRSEQ_TRAIN=tool("fairseq-train"), WORKERS="1", EA_NO_DOWNLOAD="1",
             OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    for var in ("EA_RAW_DIR", "EA_WORK_DIR", "EA_DEST_DIR", "BPE_TOKENS", "CUDA_VISIBLE_DEVICES", "NGPUS",
                "CPU", "FP16", "BF16", "SEED", "SEEDS", "SAVE_DIR", "DATA", "ALLOW_CHANGED_SETTINGS",
                "LOG_INTERVAL", "EVAL_BLEU", "EA_FAIRSEQ_SHOW_WARNINGS"):
        e.pop(var, None)
    e["CUDA_VISIBLE_DEVICES"] = ""
    return e


def run(cmd, env, cwd, check=True):
    proc = subprocess.run([str(c) for c in cmd], env=env, cwd=cwd, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise AssertionError(f"{cmd[:3]} exited {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\n"
                             f"stderr:\n{proc.stderr[-5000:]}")
    return proc


def prepare(script, raw, work, env, *args):
    dest = work / "data-bin"
    run(["bash", RECIPES / script, *args, "--raw-dir", raw, "--work-dir", work / "work",
         "--dest-dir", dest], env, cwd=work)
    return dest


def train(data, save, env, *args, epochs=2):
    run([tool("fairseq-train"), data, *TINY, "--share-all-embeddings", "--optimizer", "adam",
         "--lr", "1e-3", "--max-tokens", "1000", "--max-epoch", str(epochs), "--save-dir", save,
         *TINY_RUN, *args], env, cwd=save.parent)
    return save


def lines(path: Path):
    return path.read_text(encoding="utf-8").splitlines()


# ------------------------------------------------------------------ prepared + trained runs
# The recipes run two at a time (the machines have 2 cores; each recipe is mostly serial
# process start-up), every one on its own fixture archives in its own directory.


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


def _iwslt14_joined(root, env):
    fx.iwslt14(root / "raw", n_train=40)
    return dict(root=root, data=prepare("prepare-iwslt14.sh", root / "raw", root, env, "--joined-dictionary"))


def _wmt14_en_de(root, env):
    tests = fx.wmt14(root / "raw", "de")
    data = prepare("prepare-wmt14en2de.sh", root / "raw", root, env)
    save = train(data, root / "checkpoints", env)
    return dict(root=root, data=data, save=save, tests=tests)


def _wmt14_en_fr(root, env):
    fx.wmt14(root / "raw", "fr")
    data = prepare("prepare-wmt14en2fr.sh", root / "raw", root, env)
    train(data, root / "checkpoints", env, "--max-update", "2", "--no-save", epochs=1)
    return dict(root=root, data=data)


def _wmt17_lv(root, env):
    """Both directions: LV->EN trains on the en-lv pairs and validates on the lv-en set."""
    tests = fx.wmt17(root / "raw", "lv")
    data = prepare("prepare-wmt17.sh", root / "raw", root, env, "lv")
    train(data, root / "checkpoints", env, "-s", "lv", "-t", "en", "--max-update", "2",
          "--no-save", epochs=1)
    return dict(root=root, data=data, tests=tests)


def _wmt17(lang):
    def job(root, env):
        fx.wmt17(root / "raw", lang)
        return dict(root=root, data=prepare("prepare-wmt17.sh", root / "raw", root, env, lang))
    return job


def _iwslt14_spm(root, env):
    fx.iwslt14(root / "raw", n_train=40)
    return dict(root=root, data=prepare("prepare-iwslt14.sh", root / "raw", root, env, "--sentencepiece", "300"))


# --------------------------------------------- the own-data walk-through, as the README writes it
BIBLE = RECIPES / "bible-es-en"
WALK_SIZES = {"train": 150, "valid": 20, "test": 12}


def doc_block(doc: Path, heading: str, lang: str) -> str:
    """The first ```LANG block after HEADING in DOC."""
    text = doc.read_text(encoding="utf-8")
    return re.search(rf"^{re.escape(heading)}\n.*?```{lang}\n(.*?)```", text, re.S | re.M).group(1)


def doc_commands(doc: Path, heading: str):
    """The shell commands of that block, continuation lines joined, comments dropped."""
    block = doc_block(doc, heading, "bash").replace("\\\n", " ")
    return [line.strip() for line in block.splitlines() if line.strip() and not line.startswith("#")]


def walk_through_tree(root: Path) -> None:
    """ROOT laid out as the repository is, for commands run from its root: the recipes and
    the plugin linked, the Bible corpus replaced by its first sentence pairs (.xz, as shipped)."""
    recipes = root / "examples" / "translation"
    recipes.mkdir(parents=True)
    for f in RECIPES.iterdir():
        if f.name != "bible-es-en":
            (recipes / f.name).symlink_to(f)
    (root / "ea_fairseq").symlink_to(REPO / "ea_fairseq")
    (recipes / "bible-es-en").mkdir()
    for split, n in WALK_SIZES.items():
        for lang in ("es", "en"):
            with lzma.open(BIBLE / f"{split}.{lang}.xz", "rt", encoding="utf-8") as f:
                head = [next(f) for _ in range(n)]
            with lzma.open(recipes / "bible-es-en" / f"{split}.{lang}.xz", "wt", encoding="utf-8") as f:
                f.writelines(head)


def _own_walk_through(root, env):
    """examples/translation/README.md's own-data commands, run as written from a copy of the
    repository's layout; on this machine CPU=1, one epoch (MAX_EPOCH) of a one-layer model
    (options appended to train.sh), that epoch's checkpoint scored (NUM_AVG), generation kept
    short (options appended to evaluate.sh)."""
    walk_through_tree(root)
    commands = doc_commands(RECIPES / "README.md", "### Your own parallel text")
    assert [c.split()[:3] for c in commands] == [
        ["bash", "examples/translation/prepare-own.sh", "es"],
        ["DATA=data-bin/bible.es-en", "bash", "examples/translation/train.sh"],
        ["bash", "examples/translation/evaluate.sh", "checkpoints/ea_lite.own"]]
    walk_env = dict(env, CPU="1", MAX_EPOCH="1", MAX_TOKENS="2000", NUM_AVG="1")
    appended = ["", " --encoder-layers 1 --decoder-layers 1 " + " ".join(TRAIN_SH_RUN),
                " --cpu --progress 0.5 -- --max-len-a 0 --max-len-b 8"]
    outputs = [run(["bash", "-c", command + extra], walk_env, cwd=root)
               for command, extra in zip(commands, appended)]
    return dict(root=root, commands=commands, outputs=outputs)


JOBS = {"own_walk_through": _own_walk_through, "iwslt14": _iwslt14, "wmt14_en_de": _wmt14_en_de, "iwslt14_joined": _iwslt14_joined,
        "wmt14_en_fr": _wmt14_en_fr,
        "wmt17_lv": _wmt17_lv, "wmt17_fi": _wmt17("fi"), "wmt17_tr": _wmt17("tr"), "iwslt14_spm": _iwslt14_spm}


@pytest.fixture(scope="module")
def recipes(tmp_path_factory, env):
    """Start every recipe job, two at a time; ``recipes(name)`` waits for one's result."""
    pool = ThreadPoolExecutor(max_workers=2)
    futures = {name: pool.submit(job, tmp_path_factory.mktemp(name), env) for name, job in JOBS.items()}
    yield lambda name: futures[name].result()
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(scope="module")
def iwslt(recipes):
    return recipes("iwslt14")


@pytest.fixture(scope="module")
def wmt14_en_de(recipes):
    return recipes("wmt14_en_de")


# ------------------------------------------------------------------ Moses parity

MOSES = Path(__file__).parent / "fixtures" / "moses"
# the steps of each fixture file, as nmt_text.py's text options (make_fixtures.sh: the Perl)
MOSES_PIPELINES = {
    "normalize": ["--normalize-punct"],
    "wmt": ["--normalize-punct", "--remove-non-printing", "--tokenize", "--aggressive-dash"],
    "wmt-test": ["--fix-apostrophe", "--tokenize", "--aggressive-dash"],
    "iwslt": ["--tokenize", "--lowercase"],
}


def _read_exact(path: Path):
    with open(path, encoding="utf-8", newline="\n") as f:  # keep \r and trailing spaces
        return f.read().split("\n")[:-1]


def load_nmt_text():
    spec = importlib.util.spec_from_file_location("ea_recipes_nmt_text", RECIPES / "nmt_text.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("step", sorted(MOSES_PIPELINES))
def test_moses_steps_equal_the_perl_scripts(step, tmp_path):
    """nmt_text.py gives the Moses Perl scripts' bytes on every fixture line (outputs made once
    from mosesdecoder's scripts by tests/fixtures/moses/make_fixtures.sh)."""
    checked = 0
    for expected in sorted(MOSES.glob(f"{step}.*")):
        lang = expected.suffix[1:]
        out = tmp_path / f"{step}.{lang}"
        assert load_nmt_text().main(["text", "-l", lang, *MOSES_PIPELINES[step], "-o", str(out),
                                     str(MOSES / f"input.{lang}")]) == 0
        inputs, want, got = _read_exact(MOSES / f"input.{lang}"), _read_exact(expected), _read_exact(out)
        assert len(want) == len(inputs)
        diffs = [(src, w, g) for src, w, g in zip(inputs, want, got, strict=True) if w != g]
        assert not diffs, f"{step}.{lang}: differs from the Perl on {len(diffs)} lines: {diffs[:3]}"
        checked += len(want)
    assert checked >= 10


def test_clean_equals_clean_corpus_n_perl(tmp_path):
    """nmt_text.py clean keeps and rewrites the pairs clean-corpus-n.perl does (fixture made
    once from the Perl script): pipes removed, Unicode white space folded but not \\x1c,
    \\r inside a line, empty / too long / too short / over-ratio / 1001-character-word pairs
    dropped."""
    assert load_nmt_text().main(["clean", "--ratio", "1.5", str(MOSES / "clean-input"), "de", "en",
                                 str(tmp_path / "clean"), "1", "10"]) == 0
    for lang in ("de", "en"):
        want, got = _read_exact(MOSES / f"clean.{lang}"), _read_exact(tmp_path / f"clean.{lang}")
        assert got == want
    assert len(_read_exact(MOSES / "clean-input.de")) > len(want) >= 8  # it does drop pairs


def test_moses_cases_sacremoses_gets_wrong():
    """The cases that made the recipes' data differ from the papers': Perl's normalizer maps
    ’ to a double quote and moves a sentence-final period out of a closing quote; its fi/sv
    rule keeps colons inside words; its last word's period is always split."""
    m = load_nmt_text()
    assert m.PunctNormalizer("en").normalize("Rock ’n’ roll is ‘here’") == 'Rock "n" roll is \'here"'
    assert m.PunctNormalizer("de").normalize("Er sagte: „Wir kommen.“") == 'Er sagte: "Wir kommen".'
    fi = m.MosesTokenizer("fi", aggressive_dash=True)
    assert fi.tokenize("EU:ssa on 20:00, S:t USA:n") == "EU:ssa on 20 : 00 , S:t USA:n"
    assert m.MosesTokenizer("sv").tokenize("I EU:s budget: 20:e maj.") == "I EU:s budget : 20:e maj ."
    assert m.MosesTokenizer("en").tokenize("EU:ssa") == "EU : ssa"
    assert m.MosesTokenizer("de").tokenize("Ein Satz endet mit U.S.A.") == "Ein Satz endet mit U.S.A ."
    # the fixtures hold these cases, so the file comparison above covers them too
    assert "EU:ssa on 27" in (MOSES / "wmt.fi").read_text(encoding="utf-8")
    normalized = _read_exact(MOSES / "normalize.en") + _read_exact(MOSES / "normalize.de")
    assert 'Rock "n" roll is \'here" to stay.' in normalized and 'Er sagte: "Wir kommen".' in normalized


# ------------------------------------------------------------------ prepare scripts


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


def test_prepare_iwslt14_joined_dictionary(recipes):
    data = recipes("iwslt14_joined")["data"]
    assert (data / "dict.de.txt").read_text() == (data / "dict.en.txt").read_text()
    assert (data / "train.de-en.en.idx").is_file()


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


def test_prepare_wmt14en2fr(recipes):
    res = recipes("wmt14_en_fr")
    prep = res["root"] / "work" / "prep"
    # five corpora of 60 pairs (Giga-FrEn read from its .gz), minus what cleaning drops
    assert 240 < len(lines(prep / "train.fr")) <= 300
    assert (res["data"] / "test.raw.en-fr.fr").is_file()


def test_prepare_wmt17_lv_both_directions(recipes):
    res = recipes("wmt17_lv")
    data, tests = res["data"], res["tests"]
    for name in ("train.en-lv.lv", "valid.en-lv.lv", "test.en-lv.lv", "valid.lv-en.lv", "test.lv-en.en"):
        assert (data / f"{name}.idx").is_file(), name
    assert not (data / "train.lv-en.lv.idx").exists()
    assert lines(data / "test.raw.en-lv.lv") == tests["en-lv"][1]
    assert lines(data / "test.raw.lv-en.en") == tests["lv-en"][1]
    assert (data / "preprocess.log").read_text().count("Wrote preprocessed data") == 1


@pytest.mark.parametrize("lang", ["fi", "tr"])
def test_prepare_wmt17(recipes, lang):
    res = recipes(f"wmt17_{lang}")
    prep = res["root"] / "work" / "prep"
    n = len(lines(prep / f"train.{lang}"))
    assert n == len(lines(prep / "train.en"))
    assert n == (180 if lang == "fi" else 60)  # fi: Europarl + Rapid + Wiki Headlines (|||)
    for name in (f"train.en-{lang}.{lang}", f"test.{lang}-en.en", f"valid.{lang}-en.{lang}"):
        assert (res["data"] / f"{name}.idx").is_file(), name


def test_prepare_iwslt14_sentencepiece(recipes):
    """--sentencepiece: the subword step is SentencePiece, its model kept beside the data."""
    res = recipes("iwslt14_spm")
    data, prep = res["data"], res["root"] / "work" / "prep"
    assert (data / "sentencepiece.bpe.model").is_file() and not (data / "code").exists()
    text = (prep / "train.de").read_text(encoding="utf-8")
    assert "\u2581" in text and "@@" not in text
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(data / "sentencepiece.bpe.model"))
    assert 100 < sp.get_piece_size() <= 300
    first = lines(prep / "train.de")[0]  # the pieces decode to the tokenized, lowercased line
    assert sp.decode(first.split()) == first.replace(" ", "").replace("\u2581", " ").strip()


def test_prepare_wmt14en2de_alternative_data_is_asked_for(tmp_path, env):
    """--wmt17-news-commentary wants News Commentary v12; without it, it names the file."""
    fx.wmt14(tmp_path / "raw", "de")
    proc = run(["bash", RECIPES / "prepare-wmt14en2de.sh", "--wmt17-news-commentary",
                "--raw-dir", tmp_path / "raw", "--work-dir", tmp_path / "w"], env, tmp_path, check=False)
    assert proc.returncode == 2
    assert "training-parallel-nc-v12.tgz" in proc.stderr and "--raw-dir" in proc.stderr
    assert "training-parallel-nc-v9.tgz" not in proc.stderr


def test_prepare_without_data_lists_the_files(tmp_path, env):
    (tmp_path / "empty").mkdir()
    proc = run(["bash", RECIPES / "prepare-wmt17.sh", "tr", "--raw-dir", tmp_path / "empty",
                "--work-dir", tmp_path / "w"], env, tmp_path, check=False)
    assert proc.returncode == 2
    for name in ("dev.tgz", "test.tgz", "en-tr.txt.zip"):
        assert name in proc.stderr
    proc = run(["bash", RECIPES / "prepare-iwslt14.sh", "--work-dir", tmp_path / "w2"],
               env, tmp_path, check=False)  # EA_NO_DOWNLOAD=1 in env
    assert proc.returncode == 2 and "de-en.tgz" in proc.stderr and "EA_NO_DOWNLOAD" in proc.stderr


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_prepare_with_a_damaged_archive_says_so_in_one_line(tmp_path, env, damage):
    fx.iwslt14(tmp_path / "raw", n_train=10)
    archive = tmp_path / "raw" / "de-en.tgz"
    data = archive.read_bytes()
    archive.write_bytes(b"<html>404 Not Found</html>\n" if damage == "garbage" else data[: len(data) // 2])
    proc = run(["bash", RECIPES / "prepare-iwslt14.sh", "--raw-dir", tmp_path / "raw", "--work-dir", tmp_path / "w"],
               env, tmp_path, check=False)
    assert proc.returncode == 3
    errors = [line for line in proc.stderr.splitlines() if not line.startswith("[fetch] unpacking")]
    assert len(errors) == 1, proc.stderr
    assert f"{archive} is not a readable archive" in errors[0] and "download it again" in errors[0]
    assert "Traceback" not in proc.stderr and "missing" not in proc.stderr


@pytest.mark.parametrize("pair, script", [("iwslt14_de_en", "prepare-iwslt14.sh"),
                                          ("wmt17_tr_en", "prepare-wmt17.sh tr")])
def test_train_sh_before_the_data_names_the_recipe(env, tmp_path, pair, script):
    proc = run(["bash", RECIPES / "train.sh", "ea_lite" if pair.startswith("iwslt") else "ran_d", pair],
               dict(env, CPU="1"), tmp_path, check=False)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert f"run bash examples/translation/{script} first" in proc.stderr
    assert not (tmp_path / "checkpoints").exists()
    proc = run(["bash", RECIPES / "train.sh", "ea_lite", "own"], dict(env, CPU="1"), tmp_path, check=False)
    assert proc.returncode == 1 and "DATA=" in proc.stderr and "prepare-own.sh" in proc.stderr


# ------------------------------------------------------------------ training / evaluation


def _dry(env, cwd, family, pair, check=True, **extra):
    """train.sh DRY_RUN=1: (command, stderr). Without CUDA here it shows the GPU command;
    PYTHON=true skips its torch probe (a second each), as on a machine without torch."""
    proc = run(["bash", RECIPES / "train.sh", family, pair], dict(env, DRY_RUN="1", PYTHON="true", **extra),
               cwd, check=check)
    return proc.stdout, proc.stderr


def test_train_sh_defaults_follow_the_papers(env, tmp_path):
    def dry(family, pair, **extra):
        return _dry(env, tmp_path, family, pair, **extra)[0]

    cmd = dry("ea_lite", "wmt14_en_de", CPU="1")
    assert "--lr 1e-3" in cmd and "--dropout 0.3" in cmd and "--update-freq 128" in cmd
    assert "--ea-alpha 0.1 --ea-beta 0.1" in cmd and "--patience 5" in cmd and "--cpu" in cmd
    assert "--warmup-updates 4000" in cmd and "--label-smoothing 0.1" in cmd
    assert "--share-all-embeddings" in cmd and "--weight-decay 0.0" in cmd and "--fp16" not in cmd
    cmd = dry("ea_base", "wmt14_en_fr", NGPUS="2")
    assert "--update-freq 64" in cmd and "--dropout 0.1" in cmd and "--ea-alpha 0.5" in cmd
    assert "--distributed-world-size 2" in cmd and "--fp16" in cmd and "--cpu" not in cmd
    cmd = dry("pa_lite", "iwslt14_de_en", CPU="1")
    assert "--arch pa_transformer_lite" in cmd and "--lr 5e-4" in cmd and "--dropout 0.2" in cmd
    # IWSLT'14 as fairseq binarizes it: separate dictionaries, decoder embeddings shared
    assert "--share-decoder-input-output-embed" in cmd and "--share-all-embeddings" not in cmd
    cmd = dry("ran_d", "wmt17_tr_en", NGPUS="1")
    assert "--source-lang tr --target-lang en" in cmd and "data-bin/wmt17_en_tr" in cmd
    assert "--attention-dropout 0.2" in cmd and "--max-update 150000" in cmd
    assert "--update-freq 2" in cmd and "--patience" not in cmd
    cmd = dry("ran_all", "wmt14_en_fr", NGPUS="8", LR="5e-4", DROP_ATTENTION="element")
    assert "--max-update 250000" in cmd and "--lr 5e-4" in cmd and "--update-freq 1" in cmd
    assert "--drop-attention element --drop-attention-p 0.2 --drop-attention-window 2" in cmd
    cmd = dry("ea_lite", "iwslt14_de_en", WEIGHT_DECAY="0.0001", SEED="7")
    assert "--weight-decay 0.0001" in cmd and "--seed 7" in cmd
    proc = run(["bash", RECIPES / "train.sh", "pa_lite", "wmt14_en_de"], dict(env, DRY_RUN="1", PYTHON="true"),
               tmp_path, check=False)
    assert proc.returncode != 0 and "IWSLT" in proc.stderr


def test_train_sh_baselines_take_their_papers_settings(env, tmp_path):
    """One command per baseline row: RAN's and PA's Transformers, DropAttention's."""
    cmd, err = _dry(env, tmp_path, "transformer_ran", "wmt17_tr_en")
    assert "--arch transformer " in cmd and "--dropout 0.1" in cmd and "--attention-dropout 0.0" in cmd
    assert "--max-update 150000" in cmd and "--lr 7e-4" in cmd and "--patience" not in cmd
    assert "--update-freq 1" in cmd and "--distributed-world-size 2" in cmd  # RAN: 2 GPUs for En-Tr
    assert "-s tr -t en --best --ran-wmt" in err  # best checkpoint, beam 4, length penalty 0.6
    cmd, _ = _dry(env, tmp_path, "transformer_ran", "wmt14_en_de")
    assert "--max-update 250000" in cmd and "--distributed-world-size 8" in cmd
    cmd, _ = _dry(env, tmp_path, "transformer_lite_pa", "iwslt14_de_en")
    assert "--arch transformer_lite " in cmd and "--lr 5e-4" in cmd and "--dropout 0.2" in cmd
    assert "--pa-alpha" not in cmd
    cmd, err = _dry(env, tmp_path, "dropattn", "wmt14_en_de")
    assert "data-bin/wmt14_en_de_bpe32k" in cmd and "--arch transformer " in cmd  # DropAttention on the paper's model
    assert "--drop-attention element --drop-attention-p 0.2 --drop-attention-window 2" in cmd
    assert "--max-update 100000" in cmd and "--num-avg 5 --avg-by update --beam 4 --lenpen 0.6" in err
    cmd, _ = _dry(env, tmp_path, "transformer_dropattn", "wmt14_en_de")
    assert "--arch transformer " in cmd and "--drop-attention" not in cmd and "--dropout 0.1" in cmd
    _, err = _dry(env, tmp_path, "transformer_base", "wmt17_en_fi", check=False)
    assert "transformer_ran" in err  # the EA paper has no WMT'17 setting; RAN's baseline does
    for family in ("hcsa", "syn_r"):  # RAN's other baselines: its settings, no attention dropout
        cmd, err = _dry(env, tmp_path, family, "wmt17_tr_en")
        assert f"--arch {family} " in cmd and "--attention-dropout 0.0" in cmd and "--lr 7e-4" in cmd
        assert "--max-update 150000" in cmd and "-s tr -t en --best --ran-wmt" in err
    cmd, _ = _dry(env, tmp_path, "hcsa_lite", "iwslt14_de_en")
    assert "--arch hcsa_lite " in cmd and "--attention-dropout 0.0" in cmd and "--patience 5" in cmd


def test_train_sh_conv_transformers_and_cross_layer_baselines(env, tmp_path):
    """PA Table 1's Conv-Transformer rows take PA's settings; RealFormer and ResFormer (no
    translation row in the papers) take EA's settings of their size."""
    for family, arch in (("conv_lite_pa", "conv_transformer_lite"), ("pa_conv_lite", "pa_conv_transformer_lite")):
        cmd, _ = _dry(env, tmp_path, family, "iwslt14_de_en")
        assert f"--arch {arch} " in cmd and "--lr 5e-4" in cmd and "--dropout 0.2" in cmd
        assert ("--pa-alpha 0.1" in cmd) == family.startswith("pa_")
    _, err = _dry(env, tmp_path, "pa_conv_lite", "wmt14_en_de", check=False)
    assert "IWSLT" in err
    cmd, _ = _dry(env, tmp_path, "realformer_lite", "iwslt14_de_en")
    assert "--arch realformer_lite " in cmd and "--lr 1e-3" in cmd and "--ea-alpha" not in cmd
    cmd, _ = _dry(env, tmp_path, "resformer_base", "wmt14_en_de")
    assert "--arch resformer_base " in cmd and "--dropout 0.3" in cmd


def test_train_sh_devices_precision_and_batch(env, tmp_path):
    def dry(family, pair, check=True, **extra):
        return _dry(env, tmp_path, family, pair, check=check, **extra)

    # the paper's single-GPU IWSLT batch: 1 GPU by default; spread over 8 it stays 4096 tokens
    cmd, err = dry("ea_lite", "iwslt14_de_en")
    assert "--distributed-world-size" not in cmd and "--max-tokens 4096 --update-freq 1" in cmd
    assert "precision: fp16" in err and "= 4096 tokens per update (paper: 1 GPU(s)" in err
    cmd, err = dry("ea_lite", "iwslt14_de_en", NGPUS="8")
    assert "--max-tokens 512 --update-freq 1" in cmd and "--distributed-world-size 8" in cmd
    assert "effective batch: 512 tokens x 8 device(s) x update-freq 1 = 4096 tokens per update" in err
    cmd, err = dry("ea_lite", "wmt14_en_de", NGPUS="4")
    assert "--update-freq 32" in cmd and "= 524288 tokens per update" in err
    cmd, err = dry("ea_lite", "iwslt14_de_en", UPDATE_FREQ="2")
    assert "note: the effective batch is not the paper's" in err
    assert "--bf16" in dry("ea_lite", "iwslt14_de_en", BF16="1")[0]
    cmd = dry("ea_lite", "iwslt14_de_en", FP16="0")[0]
    assert "--fp16" not in cmd and "--bf16" not in cmd
    _, err = dry("ea_lite", "iwslt14_de_en", check=False, CPU="1", FP16="1")
    assert "FP16=1 needs CUDA" in err
    _, err = dry("ea_lite", "iwslt14_de_en", check=False, CPU="1", NGPUS="1", SEED="x")
    assert "SEED must be an integer" in err
    for bad in (["--cpu"], ["--fp16"], ["--save-dir", "x"], ["--seed", "3"]):
        proc = run(["bash", RECIPES / "train.sh", "ea_lite", "iwslt14_de_en", *bad],
                   dict(env, DRY_RUN="1", PYTHON="true"), tmp_path, check=False)
        assert proc.returncode != 0 and "train.sh: error:" in proc.stderr, bad


def test_train_sh_refuses_cpu_without_cpu_1(env, tmp_path):
    """No CUDA device and no CPU=1: a clear refusal, before anything is written or trained."""
    proc = run(["bash", RECIPES / "train.sh", "ea_lite", "iwslt14_de_en"],
               dict(env, SAVE_DIR=str(tmp_path / "ck")), tmp_path, check=False)
    assert proc.returncode != 0
    assert "no CUDA device visible" in proc.stderr and "CPU=1" in proc.stderr, proc.stderr
    assert not (tmp_path / "ck").exists()


def test_train_sh_own_data_direction_and_settings(env, tmp_path):
    """PAIR own: the direction from DATA's file names (or SRC/TGT), the family's IWSLT'14
    settings, and a clear stop where DATA is missing or ambiguous."""
    data = tmp_path / "own"
    data.mkdir()
    for name in ("train.xx-yy.xx.idx", "train.xx-yy.yy.idx", "dict.xx.txt", "dict.yy.txt"):
        (data / name).write_text("a 1\n")
    cmd, err = _dry(env, tmp_path, "pa_lite", "own", DATA=str(data))
    assert f"{data} --user-dir" in cmd and "--source-lang xx --target-lang yy" in cmd
    assert "--arch pa_transformer_lite" in cmd and "--lr 5e-4" in cmd and "--pa-alpha 0.1" in cmd
    assert "--share-all-embeddings" in cmd  # the dictionaries are equal: one joined dictionary
    assert f"evaluate.sh checkpoints/pa_lite.own {data} wmt" in err
    cmd, _ = _dry(env, tmp_path, "ran_d", "own", DATA=str(data))
    assert "--lr 1e-3 --lr-scheduler" in cmd and "--attention-dropout 0.2" in cmd and "--patience 5" in cmd
    (data / "train.yy-xx.yy.idx").write_text("")
    _, err = _dry(env, tmp_path, "ea_lite", "own", check=False, DATA=str(data))
    assert "holds several directions (xx yy yy xx): give SRC=.. TGT=.." in err
    cmd, _ = _dry(env, tmp_path, "ea_lite", "own", DATA=str(data), SRC="yy", TGT="xx")
    assert "--source-lang yy --target-lang xx" in cmd


def _evaluate(run_info, mode, env, *args):
    return run(["bash", RECIPES / "evaluate.sh", run_info["save"], run_info["data"], mode,
                "--num-avg", "2", "--cpu", *args, "--", "--max-len-a", "0", "--max-len-b", "6"],
               env, cwd=run_info["root"])


def _score(line: str) -> float:
    return float(re.search(r": (?:BLEU4 = )?([0-9.]+)", line).group(1))


def test_evaluate_iwslt_end_to_end(iwslt, env):
    proc = _evaluate(iwslt, "iwslt", env)
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
    assert abs(score.score - _score(out.splitlines()[2])) < 0.01


def test_evaluate_wmt14_en_de_end_to_end(wmt14_en_de, env):
    out = _evaluate(wmt14_en_de, "wmt14-en-de", env, "--ran-wmt").stdout
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
    exit status 3 (COMET was asked for)."""
    env = dict(env, EA_FAIRSEQ_COMET_VENV=str(tmp_path / "no-comet-venv"))
    info = wmt14_en_de
    proc = run(["bash", RECIPES / "evaluate.sh", info["save"], info["data"], "wmt", "--num-avg", "2", "--cpu",
                "--comet-model", str(tmp_path / "model.ckpt"), "--out-dir", str(tmp_path / "eval"), "--",
                "--max-len-a", "0", "--max-len-b", "6"], env, info["root"], check=False)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert re.search(r"^detokenized sacreBLEU .*: [0-9.]+", proc.stdout, re.M), proc.stdout
    assert "chrF" in proc.stdout
    assert "[evaluate] error: COMET not scored" in proc.stderr and "setup_comet_env.sh" in proc.stderr


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


def _table(out: str, metric: str = None):
    """The rows of ea-fairseq-compare's table of ``metric`` (default: the first table), by system."""
    tables = {}
    for block in out.split("\n\n"):
        rows = [[c.strip() for c in line.strip("|").split("|")] for line in block.splitlines() if line.startswith("| ")]
        if rows:
            tables[rows[0][2].rsplit(" of each run", 1)[0]] = {row[0]: row for row in rows[1:]}
    return tables[metric] if metric else next(iter(tables.values()))


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
    table = _table(out, "tok")
    assert table["same"][4] == "+0.00" and table["same"][7:9] == ["1.0000", "AR"]  # identical: nothing to see
    assert float(table["worse"][4]) < -10 and float(table["worse"][7]) < 0.01  # clearly different
    assert table["seeds"][1] == "3" and len(table["seeds"][2].split()) == 3 and "±" in table["seeds"][3]
    assert table["seeds"][7:9] == ["–", "–"]  # one run against three: no seed-level test, only the CI
    assert "150 sentences" in out.splitlines()[0] and "tokenized BLEU" in out.splitlines()[3]
    assert set(_table(out, "chrf")) == set(_table(out, "chrf++")) == set(table)  # every metric
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
    """SEEDS="1 2": one run per seed in SAVE_DIR/seedN; evaluate.sh scores each and prints
    their mean and deviation; compare_systems.py puts two systems in one table."""
    base = tmp_path / "seeds"
    proc = run(["bash", RECIPES / "train.sh", *iwslt["train_args"]],
               dict(iwslt["train_env"], SAVE_DIR=str(base), MAX_EPOCH="1", SEEDS="1 2"), tmp_path)
    assert "2 runs" in proc.stderr and f"evaluate every seed (mean ± std) with: bash examples/translation/evaluate.sh {base} " in proc.stderr
    for seed in (1, 2):
        run_dir = base / f"seed{seed}"
        assert (run_dir / "checkpoint1.pt").is_file() and (run_dir / "train.log").is_file()
        assert f"--seed {seed} " in (run_dir / "train.command").read_text()
    assert not list(base.glob("*.pt"))
    out = run(["bash", RECIPES / "evaluate.sh", base, iwslt["data"], "iwslt", "--num-avg", "1",
               "--cpu", "--", "--max-len-a", "0", "--max-len-b", "6"], env, tmp_path).stdout
    row = _table(out)["seeds"]
    assert row[1] == "2" and len(row[2].split()) == 2 and "±" in row[3]
    for seed in (1, 2):
        assert (base / f"seed{seed}" / "eval" / "test.de-en.scores.json").is_file()
    if not (iwslt["save"] / "eval" / "test.de-en.scores.json").is_file():
        _evaluate(iwslt, "iwslt", env)
    out = run([tool("ea-fairseq-compare"), f"two_epochs={iwslt['save']}",
               f"one_epoch={base}"], env, tmp_path).stdout
    table = _table(out)
    assert table["two_epochs"][1] == "1" and table["one_epoch"][1] == "2"
    assert re.fullmatch(r"[+-][0-9.]+", table["one_epoch"][4])
    assert re.fullmatch(r"\[[+-][0-9.]+, [+-][0-9.]+\]", table["one_epoch"][5])  # the bootstrap CI
    assert table["one_epoch"][7] == "–"  # one run against two: no seed-level test


def test_ran_with_over_long_test_sentences(iwslt, env, tmp_path):
    """A RAN model accepts sentences up to --ran-max-positions: evaluate.sh stops with the
    count, or with --skip-long translates the rest and labels every BLEU with its coverage."""
    save = tmp_path / "ran"
    run(["bash", RECIPES / "train.sh", "ran_e_lite", "iwslt14_de_en", *TINY[2:], "--ran-max-positions", "12",
         "--skip-invalid-size-inputs-valid-test", *TRAIN_SH_RUN],
        dict(iwslt["train_env"], SAVE_DIR=str(save), MAX_EPOCH="1"), tmp_path)
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


def test_own_data_walk_through(recipes):
    """Your own text -> SentencePiece -> binarized -> train.sh FAMILY own -> evaluate.sh."""
    res = recipes("own_walk_through")
    root = res["root"]
    prepare_out, train_out, evaluate_out = res["outputs"]
    data, save = root / "data-bin" / "bible.es-en", root / "checkpoints" / "ea_lite.own"
    assert (data / "sentencepiece.bpe.model").is_file() and not (data / "code").exists()
    for split, n in WALK_SIZES.items():
        assert f"{split}: {n} pairs" in prepare_out.stderr
    assert len(lines(data / "test.raw.es-en.en")) == WALK_SIZES["test"]
    assert "\u2581" in (root / "work" / "own.es-en" / "prep" / "train.es").read_text(encoding="utf-8")
    assert "arch='ea_transformer_lite'" in (save / "train.log").read_text()
    assert (save / "checkpoint1.pt").is_file() and (save / "sentencepiece.bpe.model").is_file()
    assert "evaluate with: bash examples/translation/evaluate.sh checkpoints/ea_lite.own data-bin/bible.es-en wmt" \
        in train_out.stderr
    out, err = evaluate_out.stdout, evaluate_out.stderr
    assert re.search(r"^detokenized sacreBLEU .*: [0-9.]+ .*signature: ", out, re.M), out
    assert "its log: checkpoints/ea_lite.own/eval/generate-test.es-en.log" in err
    # progress while translating (every 0.5 s here: the test set is known before the model loads)
    assert re.search(rf"^\[evaluate\] \d+ of {WALK_SIZES['test']} sentences translated$", err, re.M), err
    assert f"[evaluate] {WALK_SIZES['test']} sentences translated in" in err
    hyps = lines(save / "eval" / "test.es-en.hyp.sacrebleu")  # SentencePiece removed, detokenized
    assert len(hyps) == WALK_SIZES["test"] and not any("\u2581" in h for h in hyps)


HUB_CHECKS = """
import json
sentence = "And God said, Let there be light: and there was light."
hyp = ea.generate([ea.encode("Y dijo Dios: Sea la luz.")], beam=5)[0][0]["tokens"]
print("CHECKS", json.dumps(dict(
    spanish=ea.tokenize("Vea la pág. 12 de la Sra. García."), pieces=ea.apply_bpe(ea.tokenize(sentence)),
    round_trip=ea.decode(ea.encode(sentence)), first=ea.decode(hyp))))
"""


def test_readme_hub_example_takes_raw_text(recipes, env):
    """README.md's hub example, run as written on the walk-through's model (in a Python of its
    own, from the repository layout's root): raw Spanish in, detokenized English out, Spanish
    Moses rules on the way in."""
    root = recipes("own_walk_through")["root"]
    code = doc_block(REPO / "README.md", "### Translating from Python (fairseq's hub)", "python")
    out = run([sys.executable, "-c", code + HUB_CHECKS], env, cwd=root).stdout.splitlines()
    translations = ast.literal_eval(out[-2])  # the example's print: a list of strings
    checks = json.loads(out[-1].removeprefix("CHECKS "))
    assert len(translations) == 2 and all(isinstance(t, str) and t for t in translations)
    assert not any("\u2581" in t for t in translations)
    assert checks["first"] == translations[0]  # the pieces, joined and detokenized
    assert checks["spanish"] == "Vea la pág. 12 de la Sra. García ."  # Spanish abbreviations
    # raw in, raw out: into pieces and back, spacing and punctuation restored
    assert "\u2581" in checks["pieces"]
    assert checks["round_trip"] == "And God said, Let there be light: and there was light."


def test_readme_interactive_example_takes_raw_text(recipes):
    """README.md's fairseq-interactive command, run as written: detokenized D- lines, the
    hub's translations."""
    root = recipes("own_walk_through")["root"]
    (command,) = doc_commands(REPO / "README.md", "### fairseq-interactive")
    assert command.startswith("fairseq-interactive ") and command.endswith("< raw.es")
    raw = ["Y dijo Dios: Sea la luz.", "¿Dónde está el rey?", "Y fué la tarde y la mañana el día primero."]
    (root / "raw.es").write_text("".join(line + "\n" for line in raw), encoding="utf-8")
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", CUDA_VISIBLE_DEVICES="")
    short = " --max-len-a 0 --max-len-b 10"  # an untrained model's output is long otherwise
    out = run(["bash", "-c", command.replace(" < raw.es", short + " < raw.es")], env, cwd=root).stdout
    detok = dict(re.findall(r"^D-(\d+)\t\S+\t(.*)$", out, re.M))
    assert sorted(detok) == ["0", "1", "2"]
    assert not any("\u2581" in d for d in detok.values())
    from fairseq.models.transformer import TransformerModel

    save = root / "checkpoints" / "ea_lite.own"
    hub = TransformerModel.from_pretrained(str(save), checkpoint_file="checkpoint_best.pt",
                                           data_name_or_path=str(root / "data-bin" / "bible.es-en"),
                                           user_dir=str(REPO / "ea_fairseq"), tokenizer="moses",
                                           source_lang="es", target_lang="en", bpe="sentencepiece")
    assert [detok[str(i)] for i in range(3)] == hub.translate(raw, beam=5, max_len_a=0, max_len_b=10)


def test_documented_generate_commands_translate_every_sentence():
    """fairseq drops a last batch smaller than --required-batch-size-multiple (default 8):
    every fairseq-generate command in the documentation sets it to 1."""
    found = 0
    for doc in [REPO / "README.md", RECIPES / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for block in re.findall(r"```[a-z]*\n(.*?)```", doc.read_text(encoding="utf-8"), re.S):
            for command in block.replace("\\\n", " ").splitlines():
                if re.match(r"\s*fairseq-generate(\s|$)", command):  # (not its "fairseq-generate: error" lines)
                    found += 1
                    assert "--required-batch-size-multiple 1" in command, f"{doc.name}: {command}"
    assert found


# ------------------------------------------------------------ names from files and arguments
# A language that closes GNU sed's s::: command and then runs its e command: the sed program
# evaluate.sh built from the data-bin's file names ran it (the negative control below).
HOSTILE = "::;etouch${IFS}pwned;#"
OLD_PROGRESS_SED = r'sed -n "s:.*loaded \([0-9,]*\) examples from\: .*/$subset\.$src-$tgt\.$src\$:\1:p" "$log"'


def test_hostile_names_are_refused_in_one_line_not_run(env, tmp_path):
    """A data-bin whose file names carry a shell command in the language, and the same name
    as an argument (-s, --subset, SRC, prepare-own.sh's SRC, DEMO_ARCHS): every recipe stops
    with one line before using it, and the command never runs."""
    data = tmp_path / "data-bin"
    data.mkdir()
    for split in ("train", "test"):
        for lang in (HOSTILE, "en"):
            (data / f"{split}.{HOSTILE}-en.{lang}.idx").write_text("")
    (data / "dict.en.txt").write_text("a 1\n")
    ckpt = tmp_path / "checkpoint.pt"
    ckpt.write_text("")
    stub = tmp_path / "generate"  # fairseq-generate as far as evaluate.sh's progress report sees it
    stub.write_text("#!/bin/sh\necho '| loaded 3 examples from: x' >&2\nsleep 1\n")
    stub.chmod(0o755)
    marker = tmp_path / "pwned"
    # negative control: the sed program evaluate.sh used to paste these names into runs the command
    log = tmp_path / "generate.log"
    log.write_text("| loaded 3 examples from: x\n")
    subprocess.run(["bash", "-c", OLD_PROGRESS_SED], env=dict(env, subset="test", src=HOSTILE, tgt="en", log=str(log)),
                   cwd=tmp_path, capture_output=True)
    assert marker.exists()
    marker.unlink()

    evaluate = ["bash", RECIPES / "evaluate.sh", tmp_path, data, "wmt", "--checkpoint", ckpt, "--cpu", "--progress", "0.1"]
    cases = [
        (evaluate, {}),
        (evaluate + ["-s", HOSTILE, "-t", "en"], {}),
        (evaluate + ["-s", "de", "-t", "en", "--subset", HOSTILE], {}),
        (["bash", RECIPES / "train.sh", "ea_lite", "own"], {"DATA": str(data), "DRY_RUN": "1", "PYTHON": "true"}),
        (["bash", RECIPES / "train.sh", "ea_lite", "own"], {"DATA": str(data), "DRY_RUN": "1", "PYTHON": "true",
                                                           "SRC": HOSTILE, "TGT": "en"}),
        (["bash", RECIPES / "prepare-own.sh", HOSTILE, "en", tmp_path], {}),
        (["bash", REPO / "scripts" / "demo.sh"], {"DEMO_DIR": str(tmp_path / "demo"),
                                                   "DEMO_ARCHS": f"transformer_lite {HOSTILE}"}),
    ]
    for cmd, extra in cases:
        proc = run(cmd, dict(env, FAIRSEQ_GENERATE=str(stub), **extra), tmp_path, check=False)
        lines_ = proc.stderr.splitlines()
        assert proc.returncode == 1 and len(lines_) == 1, (cmd, proc.stderr)
        assert "error" in lines_[0].lower() and "[A-Za-z0-9_-]+" in lines_[0], lines_
        assert "\\$\\{IFS\\}" in lines_[0]  # the name shown quoted, as one line
        assert not marker.exists(), cmd
    assert not (tmp_path / "demo").exists()


# bash evaluates array subscripts in arithmetic, so a count pasted into $((...)) or [[ -gt ]] runs code
ARITHMETIC = "a[$(touch pwned)]"


def test_hostile_counts_are_refused_before_bash_arithmetic(env, tmp_path):
    """Counts the recipes compute with (NGPUS, --max-tokens after PAIR, --num-avg,
    DEMO_UPDATES) are whole numbers or a one-line refusal; bash's arithmetic would run the
    command in the text otherwise (the negative control)."""
    marker = tmp_path / "pwned"
    subprocess.run(["bash", "-c", 'echo $(( x + 1 ))'], env=dict(env, x=ARITHMETIC), cwd=tmp_path, capture_output=True)
    assert marker.exists()
    marker.unlink()
    dry = dict(env, DRY_RUN="1", PYTHON="true")
    cases = [
        (["bash", RECIPES / "train.sh", "ea_lite", "wmt14_en_de"], dict(dry, NGPUS=ARITHMETIC)),
        (["bash", RECIPES / "train.sh", "ea_lite", "wmt14_en_de"], dict(dry, UPDATE_FREQ=ARITHMETIC)),
        (["bash", RECIPES / "train.sh", "ea_lite", "wmt14_en_de", "--max-tokens", ARITHMETIC], dry),
        (["bash", RECIPES / "evaluate.sh", tmp_path, tmp_path, "wmt", "--num-avg", ARITHMETIC], env),
        (["bash", REPO / "scripts" / "demo.sh"], dict(env, DEMO_DIR=str(tmp_path / "demo"), DEMO_UPDATES=ARITHMETIC)),
    ]
    for cmd, cmd_env in cases:
        proc = run(cmd, cmd_env, tmp_path, check=False)
        assert proc.returncode == 1 and len(proc.stderr.splitlines()) == 1, (cmd, proc.stderr)
        assert "\\$\\(touch\\ pwned\\)" in proc.stderr, proc.stderr  # the value shown quoted
        assert not marker.exists(), cmd


# ------------------------------------------------------------ output and feedback
KNOWN_WARNINGS = """\
/v/hydra/experimental/initialize.py:45: Hydra14MigrationWarning: 
The version_base parameter is not specified.
Hydra will assume defaults for version 1.1.
See https://hydra.cc/docs/upgrades/1.3_to_1.4/prepare_for_1_4/ for preparation instructions.
  self.delegate = real_initialize(
DEBUG:hydra.core.utils:Setting JobRuntime:name=UNKNOWN_NAME
sys:1: UserWarning: 
'config' is validated against ConfigStore schema with the same name.
This behavior is deprecated in Hydra 1.1 and will be removed in Hydra 1.2.
See https://hydra.cc/docs/1.2/upgrades/1.0_to_1.1/automatic_schema_matching for migration instructions.
/v/hydra/compose.py:56: UserWarning: 
The strict flag in the compose API is deprecated.
See https://hydra.cc/docs/1.2/upgrades/0.11_to_1.0/strict_mode_flag_deprecated for more info.

  deprecation_warning(
/v/torch/utils/data/dataloader.py:1102: UserWarning: 'pin_memory' argument is set as true but no accelerator is found, then device pinned memory won't be used.
  super().__init__(loader)
/v/fairseq/tasks/fairseq_task.py:531: FutureWarning: `torch.cuda.amp.autocast(args...)` is deprecated. Please use `torch.amp.autocast('cuda', args...)` instead.
  with torch.cuda.amp.autocast(enabled=(isinstance(optimizer, AMPOptimizer))):
"""
OTHER_OUTPUT = """\
2026-01-01 00:00:00 | INFO | train | epoch 001 | loss 7.397
/v/ea_fairseq/x.py:3: UserWarning: something a user must see
  warnings.warn("something a user must see")
Traceback (most recent call last):
  File "/v/fairseq_cli/train.py", line 96, in main
    model = task.build_model(cfg.model)
ValueError: a real error
"""


def test_ea_quiet_leaves_out_the_known_warnings_and_nothing_else():
    """The recipes' filter (common.sh): the known warnings go, each with its message lines and
    source line; another warning, log lines and a traceback pass unchanged, in order;
    EA_FAIRSEQ_SHOW_WARNINGS=1 passes everything."""
    text = KNOWN_WARNINGS + OTHER_OUTPUT + KNOWN_WARNINGS
    quiet = ["bash", "-c", f"source {RECIPES / 'common.sh'} && ea_quiet"]
    env = {k: v for k, v in os.environ.items() if k != "EA_FAIRSEQ_SHOW_WARNINGS"}
    out = subprocess.run(quiet, input=text, capture_output=True, text=True, env=env, check=True).stdout
    assert out == OTHER_OUTPUT
    shown = subprocess.run(quiet, input=text, capture_output=True, text=True, check=True,
                           env=dict(env, EA_FAIRSEQ_SHOW_WARNINGS="1")).stdout
    assert shown == text


def test_train_sh_log_interval(env, tmp_path):
    assert "--log-interval 100" in _dry(env, tmp_path, "ea_lite", "iwslt14_de_en")[0]
    assert "--log-interval 5" in _dry(env, tmp_path, "ea_lite", "iwslt14_de_en", CPU="1")[0]
    assert "--log-interval 20" in _dry(env, tmp_path, "ea_lite", "iwslt14_de_en", CPU="1", LOG_INTERVAL="20")[0]
    _, err = _dry(env, tmp_path, "ea_lite", "iwslt14_de_en", check=False, LOG_INTERVAL="often")
    assert "LOG_INTERVAL must be a positive number of updates" in err
    tokens = shlex.split(_dry(env, tmp_path, "ea_lite", "iwslt14_de_en", EVAL_BLEU="1")[0])
    at = tokens.index("--eval-bleu")
    assert tokens[at:at + 9] == ["--eval-bleu", "--eval-bleu-args", '{"beam": 5, "max_len_a": 1.2, "max_len_b": 10}',
                                 "--eval-bleu-detok", "moses", "--eval-bleu-remove-bpe",
                                 "--best-checkpoint-metric", "bleu", "--maximize-best-checkpoint-metric"]
    assert "--eval-bleu" not in _dry(env, tmp_path, "ea_lite", "iwslt14_de_en")[0]


def _short_cpu_run(env, root, data, **extra):
    """train.sh transformer_lite own (tiny dims) on CPU for 6 updates, shorter than the
    data's first epoch (11 batches of 300 tokens)."""
    save = root / "ck"
    proc = run(["bash", RECIPES / "train.sh", "transformer_lite", "own", *TINY[2:], *TRAIN_SH_RUN],
               {**env, "DATA": str(data), "SAVE_DIR": str(save), "CPU": "1", "MAX_UPDATE": "6", "MAX_TOKENS": "300",
                **extra}, root)
    return save, proc


@pytest.fixture(scope="module")
def eval_bleu_run(env, tiny_data_bin, tmp_path_factory):
    return _short_cpu_run(env, tmp_path_factory.mktemp("eval_bleu"), tiny_data_bin, EVAL_BLEU="1")


def test_a_short_cpu_run_gives_feedback_and_evaluate_names_its_checkpoints(env, tmp_path, tiny_data_bin):
    """train.sh on CPU, shorter than an epoch: fairseq's loss every 5 updates, none of the
    known warnings on stderr (they are there without the filter); evaluate.sh then finds no
    epoch checkpoint and names what the run has in one line, and --best, one of them, scores it."""
    save, proc = _short_cpu_run(env, tmp_path, tiny_data_bin)
    log = (save / "train.log").read_text()
    assert re.search(r"^epoch 001:\s+5 / \d+ loss=.*num_updates=5,", log, re.M), log[-2000:]
    assert "--log-interval 5" in (save / "train.command").read_text()
    assert not re.search(r"Warning|DEBUG:hydra", proc.stderr), proc.stderr
    (tmp_path / "shown").mkdir()
    # the whole first epoch (11 batches): stopped after 1 update, fairseq-train now and then
    # aborted at exit ("terminate called without an active exception"; 2 of 16 runs under
    # load), most likely its batch-prefetching thread (BackgroundConsumer) still in torch
    _, shown = _short_cpu_run(env, tmp_path / "shown", tiny_data_bin, MAX_UPDATE="11", EA_FAIRSEQ_SHOW_WARNINGS="1")
    assert re.search(r"pin_memory|torch\.cuda\.amp", shown.stderr), shown.stderr

    evaluate = ["bash", RECIPES / "evaluate.sh", save, tiny_data_bin, "iwslt", "--cpu"]
    proc = run(evaluate, env, tmp_path, check=False)
    assert proc.returncode == 1 and proc.stderr.splitlines() == [
        f"evaluate.sh: error: no epoch checkpoints to average in {save} (the run stopped before saving one): "
        f"evaluate with --best (checkpoint_best.pt); or --checkpoint {save}/checkpoint_last.pt"], proc.stderr
    out = run(evaluate + ["--best", "--", "--max-len-a", "0", "--max-len-b", "6"], env, tmp_path).stdout
    assert f"model: {save}/checkpoint_best.pt" in out and re.search(r"^fairseq tokenized BLEU .*BLEU4 = ", out, re.M)


def test_evaluate_sh_names_the_checkpoints_a_run_has(env, tmp_path):
    """No epoch checkpoints but update ones (a RAN run stopped early): the pointer names
    averaging by update with as many as there are; none at all: one line saying so."""
    data, run_dir = tmp_path / "data", tmp_path / "run"
    data.mkdir()
    run_dir.mkdir()
    for name in ("test.de-en.de.idx", "test.de-en.en.idx"):
        (data / name).write_text("")
    evaluate = ["bash", RECIPES / "evaluate.sh", run_dir, data, "iwslt", "--cpu"]
    proc = run(evaluate, env, tmp_path, check=False)
    assert proc.returncode == 1 and proc.stderr.splitlines() == [
        f"evaluate.sh: error: no checkpoints in {run_dir} (checkpointE.pt, checkpoint_E_U.pt, checkpoint_best.pt, "
        "checkpoint_last.pt)"], proc.stderr
    for name in ("checkpoint_1_5000.pt", "checkpoint_2_10000.pt", "checkpoint_last.pt"):
        (run_dir / name).write_bytes(b"")
    proc = run(evaluate, env, tmp_path, check=False)
    assert proc.returncode == 1 and proc.stderr.splitlines() == [
        f"evaluate.sh: error: no epoch checkpoints to average in {run_dir} (the run stopped before saving one): "
        "evaluate with --avg-by update --num-avg 2 (averages its last 2 update checkpoints checkpoint_E_U.pt); "
        f"or --checkpoint {run_dir}/checkpoint_last.pt"], proc.stderr


def test_eval_bleu_validates_with_bleu_and_keeps_the_best_by_it(eval_bleu_run):
    """EVAL_BLEU=1: a BLEU in every validation line, and checkpoint_best.pt saved with that
    BLEU as its score (not the loss)."""
    save, proc = eval_bleu_run
    log = (save / "train.log").read_text()
    bleu = re.search(r"^epoch 001 \| valid on 'valid' subset .*\| bleu ([0-9.]+) .*num_updates 6", log, re.M)
    best = re.search(r"Saved checkpoint .*checkpoint_best\.pt \(epoch 1 @ 6 updates, score ([0-9.]+)\)", proc.stdout)
    assert bleu and best and float(best.group(1)) == float(bleu.group(1)), proc.stdout[-2000:]
    assert "--best-checkpoint-metric bleu" in (save / "train.settings").read_text()


def test_an_eval_bleu_checkpoint_is_scored_by_evaluate_sh(eval_bleu_run, env, tiny_data_bin):
    """fairseq keeps the BLEU counts of --eval-bleu as numpy values in extra_state['metrics']:
    the checkpoint loads (weights-only) and scores."""
    save, _ = eval_bleu_run
    out = run(["bash", RECIPES / "evaluate.sh", save, tiny_data_bin, "iwslt", "--cpu", "--best", "--",
               "--max-len-a", "0", "--max-len-b", "6"], env, save.parent).stdout
    assert re.search(r"^fairseq tokenized BLEU .*BLEU4 = ", out, re.M)
