"""The prepare scripts of the translation recipes, offline, on tiny fixture archives
(tests/support/recipe_fixtures.py): each runs with --raw-dir (so it never touches the network;
EA_NO_DOWNLOAD is set as well) and its binarized output is checked; WMT'14 En-Fr and WMT'17
Lv-En are trained on for a few updates with fairseq-train (its entry point, in this process).
IWSLT'14 (prepared, trained and evaluated) is in test_recipe_iwslt14.py, WMT'14 En-De in
test_recipe_wmt14.py, README.md's quickstart in test_recipe_walk_through.py; what they share
is in recipe_support.py.
"""
import pytest

from support import recipe_fixtures as fx
from support.recipe_support import RECIPES, env, lines, prepare, run, train_in_process, two_at_a_time  # noqa: F401  (fixture)




def _wmt14_en_fr(root, env):
    fx.wmt14(root / "raw", "fr")
    return dict(root=root, data=prepare("prepare-wmt14en2fr.sh", root / "raw", root, env))


def _wmt17_lv(root, env):
    tests = fx.wmt17(root / "raw", "lv")
    return dict(root=root, data=prepare("prepare-wmt17.sh", root / "raw", root, env, "lv"), tests=tests)


def _wmt17(lang):
    def job(root, env):
        fx.wmt17(root / "raw", lang)
        return dict(root=root, data=prepare("prepare-wmt17.sh", root / "raw", root, env, lang))
    return job


def _iwslt14_joined_spm(root, env):
    """--joined-dictionary and --sentencepiece in one run: the dictionary option is
    fairseq-preprocess's, the subword option the step before it (the BPE path with separate
    dictionaries is test_recipe_iwslt14.py's)."""
    fx.iwslt14(root / "raw", n_train=40)
    return dict(root=root, data=prepare("prepare-iwslt14.sh", root / "raw", root, env, "--joined-dictionary",
                                        "--sentencepiece", "300"))


JOBS = {"iwslt14_joined_spm": _iwslt14_joined_spm, "wmt14_en_fr": _wmt14_en_fr, "wmt17_lv": _wmt17_lv,
        "wmt17_fi": _wmt17("fi"), "wmt17_tr": _wmt17("tr")}


@pytest.fixture(scope="module")
def recipes(tmp_path_factory, env):  # noqa: F811
    """Every job started, two at a time; ``recipes(name)`` waits for one's result."""
    with two_at_a_time(JOBS, tmp_path_factory, env) as result:
        yield result


def test_prepare_iwslt14_joined_dictionary(recipes):
    data = recipes("iwslt14_joined_spm")["data"]
    assert (data / "dict.de.txt").read_text() == (data / "dict.en.txt").read_text()
    assert (data / "train.de-en.en.idx").is_file()


def test_prepare_wmt14en2fr(recipes):
    res = recipes("wmt14_en_fr")
    prep = res["root"] / "work" / "prep"
    # five corpora of 60 pairs (Giga-FrEn read from its .gz), minus what cleaning drops
    assert 240 < len(lines(prep / "train.fr")) <= 300
    assert (res["data"] / "test.raw.en-fr.fr").is_file()
    train_in_process(res["data"], res["root"] / "checkpoints", "--max-update", "2", "--no-save", epochs=1)


def test_prepare_wmt17_lv_both_directions(recipes):
    """Both directions: LV->EN trains on the en-lv pairs and validates on the lv-en set."""
    res = recipes("wmt17_lv")
    data, tests = res["data"], res["tests"]
    for name in ("train.en-lv.lv", "valid.en-lv.lv", "test.en-lv.lv", "valid.lv-en.lv", "test.lv-en.en"):
        assert (data / f"{name}.idx").is_file(), name
    assert not (data / "train.lv-en.lv.idx").exists()
    assert lines(data / "test.raw.en-lv.lv") == tests["en-lv"][1]
    assert lines(data / "test.raw.lv-en.en") == tests["lv-en"][1]
    assert (data / "preprocess.log").read_text().count("Wrote preprocessed data") == 1
    train_in_process(data, res["root"] / "checkpoints", "-s", "lv", "-t", "en", "--max-update", "2",
                     "--no-save", epochs=1)


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
    res = recipes("iwslt14_joined_spm")
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
