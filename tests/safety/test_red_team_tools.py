"""What a red team found the recipes and tools still read or wrote through a link out of a
received directory (principle 2, :mod:`ea_fairseq.safety.confined`; principle 4,
:mod:`ea_fairseq.safety.writers`), and a dump the plugin wrote that ``plot maps`` refused
(principle 3, :mod:`ea_fairseq.analysis.maps`). Each attack goes through the entry point a
user runs; each control shows what is still accepted."""
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from support import recipe_fixtures as fx
from ea_fairseq.analysis.dumps import META_KEY
from ea_fairseq_cli import bleu
from support.recipe_support import RECIPES, REPO, env, run as recipe_run  # noqa: F401  (fixture)

BIN = Path(sys.executable).parent
SECRET = "SECRET=an outside file: not the run's to read\n"
REFS = ["a b c d", "e f g h", "i j k l"]
HYPS = ["a b c x", "e f g h", "i j x l"]


# -- train.sh copies the data's subword model into SAVE_DIR ----------------------------------------
def _train_sh(env, tmp_path, code_target):
    """train.sh (fairseq-train itself: ``true``) on a data dir whose ``code`` is a link to
    ``code_target``; (the process, SAVE_DIR)."""
    data = tmp_path / "own"
    data.mkdir()
    for name in ("train.xx-yy.xx.idx", "train.xx-yy.yy.idx", "dict.xx.txt", "dict.yy.txt"):
        (data / name).write_text("a 1\n")
    os.symlink(code_target, data / "code")
    save = tmp_path / "save"
    train = dict(env, DATA=str(data), SAVE_DIR=str(save), CPU="1", FAIRSEQ_TRAIN="true")
    return recipe_run(["bash", RECIPES / "train.sh", "pa_lite", "own"], train, tmp_path, check=False), save


@pytest.mark.parametrize("outside", ["file", "proc"])
def test_train_sh_copies_no_file_from_outside_the_data_dir_into_save_dir(env, tmp_path, outside):
    secret = tmp_path / "secret.txt"
    secret.write_text(SECRET)
    target = secret if outside == "file" else Path("/proc/self/environ")
    proc, save = _train_sh(env, tmp_path, target)
    assert proc.returncode == 1, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("safe_write.py: error: ") and "outside" in last and "Traceback" not in proc.stderr, last
    assert not os.path.lexists(save / "code")
    assert not any(name.endswith(".tmp") for name in os.listdir(save))


def test_train_sh_copies_a_subword_model_linked_inside_the_data_dir(env, tmp_path):
    """The control: a link that stays in DATA is the data's own file, copied."""
    (tmp_path / "code.real").write_text("a@@ b\n")
    proc, save = _train_sh(env, tmp_path, "../code.real")  # a link out of DATA ...
    assert proc.returncode == 1
    os.remove(tmp_path / "own" / "code")
    os.replace(tmp_path / "code.real", tmp_path / "own" / "code.real")
    os.symlink("code.real", tmp_path / "own" / "code")  # ... and one inside it
    recipe_run(["bash", RECIPES / "train.sh", "pa_lite", "own"],
               dict(env, DATA=str(tmp_path / "own"), SAVE_DIR=str(save), CPU="1", FAIRSEQ_TRAIN="true"), tmp_path)
    assert (save / "code").read_text() == "a@@ b\n" and not (save / "code").is_symlink()


def test_safe_write_from_refuses_a_link_out_of_its_directory_and_a_device(tmp_path):
    (tmp_path / "secret.txt").write_text(SECRET)
    (tmp_path / "data").mkdir()
    os.symlink(tmp_path / "secret.txt", tmp_path / "data" / "code")
    os.symlink("/dev/zero", tmp_path / "data" / "zero")
    for name in ("code", "zero"):
        proc = subprocess.run([sys.executable, REPO / "scripts" / "safe_write.py", "--from", tmp_path / "data" / name,
                               tmp_path / "out"], capture_output=True, text=True, timeout=60)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 1 and len(lines) == 1 and ("outside" in lines[0] or "device" in lines[0]), lines
        assert not os.path.lexists(tmp_path / "out")
    # the control: cp SRC FILE of the data's own file
    (tmp_path / "data" / "own").write_text("mine\n")
    subprocess.run([sys.executable, REPO / "scripts" / "safe_write.py", "--from", tmp_path / "data" / "own",
                    tmp_path / "out"], check=True, timeout=60)
    assert (tmp_path / "out").read_text() == "mine\n"


# -- evaluate.sh writes through a planted eval directory link --------------------------------------
def _received_run(tmp_path):
    run = tmp_path / "received"
    run.mkdir()
    for name in ("checkpoint1.pt", "checkpoint2.pt"):
        (run / name).write_bytes(b"")  # never read: the refusal comes first
    (tmp_path / "elsewhere").mkdir()
    return run


def _evaluate(env, run, data, tmp_path, *extra):
    return recipe_run(["bash", RECIPES / "evaluate.sh", run, data, "iwslt", "--cpu", "--num-avg", "2", *extra],
                      env, cwd=tmp_path, check=False)


def test_evaluate_sh_writes_nothing_through_an_eval_directory_link(env, tiny_data_bin, tmp_path):
    run = _received_run(tmp_path)
    os.symlink(tmp_path / "elsewhere", run / "eval")
    proc = _evaluate(env, run, tiny_data_bin, tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert lines[0].startswith("evaluate.sh: error: ") and "outside the run" in lines[0], lines[0]
    assert os.listdir(tmp_path / "elsewhere") == []


def test_evaluate_sh_writes_nothing_through_a_seed_directory_link(env, tiny_data_bin, tmp_path):
    run = tmp_path / "received"
    run.mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "checkpoint1.pt").write_bytes(b"")
    os.symlink(tmp_path / "elsewhere", run / "seed1")
    proc = _evaluate(env, run, tiny_data_bin, tmp_path)
    assert proc.returncode == 1 and "outside the run" in proc.stderr.strip().splitlines()[-1], proc.stderr[-2000:]
    assert os.listdir(tmp_path / "elsewhere") == ["checkpoint1.pt"]


def test_evaluate_sh_writes_into_an_out_dir_its_caller_names(env, tiny_data_bin, tmp_path):
    """The control: --out-dir outside the run is the caller's, and an eval/ linked inside the
    run stays in it: both pass the check (and fail later, on the empty checkpoints)."""
    run = _received_run(tmp_path)
    proc = _evaluate(env, run, tiny_data_bin, tmp_path, "--out-dir", tmp_path / "elsewhere")
    assert "outside the run" not in proc.stderr and proc.returncode != 0
    (run / "evals").mkdir()
    os.symlink("evals", run / "eval")
    proc = _evaluate(env, run, tiny_data_bin, tmp_path)
    assert "outside the run" not in proc.stderr and proc.returncode != 0


def test_safe_write_within_refuses_a_directory_that_resolves_outside(tmp_path):
    run = _received_run(tmp_path)
    os.symlink(tmp_path / "elsewhere", run / "eval")
    cmd = [sys.executable, REPO / "scripts" / "safe_write.py", "--within", run]
    proc = subprocess.run([*cmd, run / "eval" / "x.txt"], input="x", capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "outside" in proc.stderr and os.listdir(tmp_path / "elsewhere") == []
    subprocess.run([*cmd, run / "x.txt"], input="x", check=True, text=True, timeout=60)
    assert (run / "x.txt").read_text() == "x"


# -- ea-fairseq-compare reads through a directory link out of the system ---------------------------
def _compare(*systems, check_refused=True):
    proc = subprocess.run([str(BIN / "ea-fairseq-compare"), *map(str, systems), "--metric", "tok",
                           "--bootstrap", "10", "--trials", "10"], capture_output=True, text=True, timeout=120)
    if check_refused:
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode != 0 and proc.stdout.count("|") == 0, proc.stdout
        assert len(lines) == 1 and "outside" in lines[0] and "Traceback" not in proc.stderr, proc.stderr
    return proc


def test_compare_refuses_an_eval_directory_linked_out_of_the_system(tmp_path):
    fx.write_scored_run(tmp_path / "base", REFS, HYPS)
    fx.write_scored_run(tmp_path / "outside", REFS, HYPS)
    (tmp_path / "sys").mkdir()
    os.symlink(tmp_path / "outside" / "eval", tmp_path / "sys" / "eval")
    _compare(tmp_path / "base", tmp_path / "sys")


def test_compare_refuses_a_seed_directory_linked_out_of_the_system(tmp_path):
    fx.write_scored_run(tmp_path / "base", REFS, HYPS)
    fx.write_scored_run(tmp_path / "sys" / "seed2", REFS, HYPS)
    fx.write_scored_run(tmp_path / "outside", REFS, HYPS)
    os.symlink(tmp_path / "outside", tmp_path / "sys" / "seed1")
    _compare(tmp_path / "base", tmp_path / "sys")


def test_compare_reads_a_system_named_through_a_link_and_links_inside_it(tmp_path):
    """The controls: the directory the user names may itself be a link (theirs), and an eval
    directory linked within the system, or a scores.json named directly, is read."""
    fx.write_scored_run(tmp_path / "base", REFS, HYPS)
    fx.write_scored_run(tmp_path / "real", REFS, HYPS)
    os.symlink(tmp_path / "real", tmp_path / "sys")
    assert _compare(tmp_path / "base", tmp_path / "sys", check_refused=False).returncode == 0
    os.replace(tmp_path / "real" / "eval", tmp_path / "real" / "evals")
    os.symlink("evals", tmp_path / "real" / "eval")
    proc = _compare(tmp_path / "base", tmp_path / "sys", check_refused=False)
    assert proc.returncode == 0 and "| sys " in proc.stdout, proc.stderr
    scores = tmp_path / "real" / "evals" / "test.de-en.scores.json"
    assert _compare(tmp_path / "base", f"sys={scores}", check_refused=False).returncode == 0


# -- plot maps refuses a dump the plugin itself wrote ----------------------------------------------
def _zero_dump(path: Path, shape) -> None:
    """A dump of one sentence whose encoder.self weights are zeros of ``shape``, as np.savez_compressed
    writes it, its map written a megabyte at a time (nothing of its size allocated here)."""
    meta = {"format": "ea_fairseq.analysis dump v1", "sentences": [
        {"id": 0, "source": ["a"] * shape[3], "target": ["b"] * shape[2], "decoder_input": ["b"] * shape[2],
         "maps": {"encoder.self": ["weights"]}}]}
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        with z.open(META_KEY + ".npy", "w") as f:
            np.save(f, np.array(json.dumps(meta)))
        with z.open("0/encoder.self/weights.npy", "w") as f:
            np.lib.format.write_array_header_1_0(f, {"descr": "<f4", "fortran_order": False, "shape": shape})
            left = 4 * int(np.prod(shape))
            while left:
                left -= f.write(bytes(min(left, 1 << 20)))


def test_plot_maps_draws_a_dump_of_underflowed_zeros(tmp_path):
    """An HC-SA dump: 6 layers x 8 heads of one 1000-token sentence, its maps zeros (underflowed),
    which deflate compresses about a thousandfold: drawn, not refused as a zip bomb."""
    from ea_fairseq.analysis import dumps

    _zero_dump(tmp_path / "d.npz", (6, 8, 1000, 1000))
    with zipfile.ZipFile(tmp_path / "d.npz") as z:
        info = z.getinfo("0/encoder.self/weights.npy")
        assert info.file_size > max(dumps.LIMIT_PLAIN, 500 * info.compress_size)  # what 64:1 refused
    assert dumps.AttentionDump(str(tmp_path / "d.npz")).get(0, "encoder.self").shape == (6, 8, 1000, 1000)
    proc = subprocess.run([str(BIN / "ea-fairseq-analysis"), "plot", "maps", str(tmp_path / "d.npz"),
                           "--out-dir", str(tmp_path / "fig"), "--layers", "1", "--heads", "1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and os.listdir(tmp_path / "fig"), proc.stderr[-2000:]


def test_plot_maps_holds_the_crop_it_draws_not_the_map_a_dump_declares(tmp_path):
    """A 0.6 MB dump of one 8192-token sentence (2 heads of 8192 x 8192 zeros: 512 MiB inflated,
    within every cap) drawn as the crop that fits, 66 x 66: only the crop's rows are kept as the
    map inflates. The control: a dump of the crop's size, drawn by the same command, peaks no lower."""
    from test_data_files import run_measured

    _zero_dump(tmp_path / "big.npz", (1, 2, 8192, 8192))
    _zero_dump(tmp_path / "crop.npz", (1, 2, 66, 66))
    assert os.path.getsize(tmp_path / "big.npz") < 10 ** 6
    peaks = {}
    for name in ("crop", "big"):
        code, lines, peaks[name], _ = run_measured(
            [BIN / "ea-fairseq-analysis", "plot", "maps", tmp_path / f"{name}.npz", "--out-dir", tmp_path / name],
            tmp_path)
        assert code == 0 and os.listdir(tmp_path / name), "\n".join(lines[-20:])
    assert "queries 1-66 of 8192" in "\n".join(lines)
    assert peaks["big"] < peaks["crop"] + 2 ** 27, peaks


def test_dump_reader_refuses_more_inflated_maps_in_all_than_its_budget(tmp_path, monkeypatch):
    """Each member within its caps, together over what one command reads."""
    from ea_fairseq.analysis import dumps

    _zero_dump(tmp_path / "d.npz", (1, 1, 2048, 2048))  # 16 MiB
    monkeypatch.setattr(dumps, "LIMIT_INFLATED", 40 << 20)
    dump = dumps.AttentionDump(str(tmp_path / "d.npz"))
    dump.get(0, "encoder.self")
    dump.get(0, "encoder.self")
    with pytest.raises(dumps.DumpError, match="--sentence"):
        dump.get(0, "encoder.self")


# -- ea-fairseq-bleu reads --raw-ref / --raw-src through a link out of the data dir -----------------
@pytest.mark.parametrize("option", ["--raw-ref", "--raw-src"])
def test_bleu_refuses_raw_texts_linked_out_of_their_directory(tmp_path, option, capsys):
    (tmp_path / "secret.txt").write_text("\n".join(REFS) + "\n")
    data, ev = tmp_path / "data", tmp_path / "eval"
    data.mkdir()
    ev.mkdir()
    (data / "test.raw.de-en.en").write_text("\n".join(REFS) + "\n")
    (data / "test.raw.de-en.de").write_text("x\n" * 3)
    linked = data / ("test.raw.de-en.en" if option == "--raw-ref" else "test.raw.de-en.de")
    gen = ev / "gen.txt"
    gen.write_text("".join(f"S-{i}\tx\nT-{i}\t{r}\nH-{i}\t-0.1\t{h}\nD-{i}\t-0.1\t{h}\n"
                           for i, (r, h) in enumerate(zip(REFS, HYPS))))
    argv = [str(gen), "--mode", "wmt", "--target-lang", "en", "--source-lang", "de", "--out-prefix",
            str(ev / "test.de-en"), "--raw-ref", str(data / "test.raw.de-en.en"),
            "--raw-src", str(data / "test.raw.de-en.de")]
    assert bleu.main(argv) == 0  # the control: the data's own files
    capsys.readouterr()
    os.replace(linked, tmp_path / "moved")
    os.symlink(tmp_path / "secret.txt", linked)
    os.remove(ev / "test.de-en.scores.json")
    with pytest.raises(SystemExit) as refused:
        bleu.main(argv)
    assert "outside" in str(refused.value) and str(refused.value).startswith("ea-fairseq-bleu: error: ")
    assert "\n" not in str(refused.value) and not (ev / "test.de-en.scores.json").exists()
