"""The plugin's own tools given a crafted input: what a received results folder, attention dump,
training log or split can make ``ea-fairseq-compare`` and ``ea-fairseq-analysis`` do. Each attack
through the tool's entry point, and beside it a control showing the payload acts without the guard."""
import json
import os
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

from support import recipe_fixtures as fx
from ea_fairseq.analysis.dumps import META_KEY
from ea_fairseq_cli import analysis as analysis_cli
from ea_fairseq_cli import compare_systems as compare
from ea_fairseq_cli import curves

BIN = Path(sys.executable).parent
REFS = ["a b c d", "e f g h", "i j k l"]
HYPS = ["a b c x", "e f g h", "i j x l"]


# -- 1. scores.json names the files ea-fairseq-compare opens -----------------------------------------
def _runs(tmp_path):
    for name in ("base", "sys"):
        fx.write_scored_run(tmp_path / name, REFS, HYPS)
    return tmp_path / "sys" / "eval" / "test.de-en.scores.json"


def _name_in_scores(scores: Path, name: str) -> None:
    report = json.loads(scores.read_text())
    report["metrics"]["tok"]["hyp"] = name
    scores.write_text(json.dumps(report))


@pytest.mark.parametrize("named", ["absolute", "dotdot", "link", "device"])
def test_compare_opens_only_files_inside_the_scores_directory(tmp_path, named):
    scores = _runs(tmp_path)
    secret = tmp_path / "secret.txt"
    secret.write_text("\n".join(HYPS) + "\n")
    ev = scores.parent
    name = {"absolute": str(secret), "dotdot": "../../secret.txt", "link": "hyp.link",
            "device": "zero.link"}[named]
    if named == "link":
        os.symlink(secret, ev / "hyp.link")
    if named == "device":
        os.symlink("/dev/zero", ev / "zero.link")
    _name_in_scores(scores, name)
    if named != "device":  # the control: a plain open of the named path reads the outside file
        with open(os.path.join(ev, name)) as f:
            assert f.read() == secret.read_text()
    proc = subprocess.run([str(BIN / "ea-fairseq-compare"), str(tmp_path / "base"), str(tmp_path / "sys"),
                           "--metric", "tok", "--bootstrap", "10", "--trials", "10"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and proc.stdout.count("|") == 0, proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert ("outside" in lines[0] or "device" in lines[0]) and "ea-fairseq-compare" in lines[0], lines[0]


def test_compare_follows_a_link_that_stays_inside(tmp_path, capsys):
    scores = _runs(tmp_path)
    ev = scores.parent
    os.symlink("test.de-en.hyp.tok", ev / "hyp.link")
    _name_in_scores(scores, "hyp.link")
    assert compare.main([str(tmp_path / "base"), str(tmp_path / "sys"), "--metric", "tok",
                         "--bootstrap", "10", "--trials", "10"]) == 0
    assert "| sys " in capsys.readouterr().out


def test_compare_follows_links_inside_the_results_dir_it_is_given(tmp_path, capsys):
    """The quality benchmark's layout: each run's references a link to one shared copy in the
    results folder, outside the run's eval directory: read within ``--results-dir``, refused
    without it (the file it leads to is outside the eval directory the scores name it in)."""
    scores = _runs(tmp_path)
    shared = tmp_path / "refs" / "test.de-en.ref.tok"
    shared.parent.mkdir()
    os.replace(scores.parent / "test.de-en.ref.tok", shared)
    os.symlink(os.path.relpath(shared, scores.parent), scores.parent / "test.de-en.ref.tok")
    argv = [str(tmp_path / "base"), str(tmp_path / "sys"), "--metric", "tok", "--bootstrap", "10", "--trials", "10"]
    with pytest.raises(SystemExit, match="outside"):
        compare.main(argv)
    assert compare.main([*argv, "--results-dir", str(tmp_path)]) == 0
    assert "| sys " in capsys.readouterr().out


def test_compare_refuses_a_scores_json_that_is_a_link_outside(tmp_path):
    scores = _runs(tmp_path)
    moved = tmp_path / "elsewhere.json"
    os.replace(scores, moved)
    os.symlink(moved, scores)
    with pytest.raises(SystemExit, match="outside"):
        compare.main([str(tmp_path / "base"), str(tmp_path / "sys"), "--metric", "tok"])


# -- 2. an attention dump's declared layers x heads and compression ----------------------------------
def _dump(path: Path, shape, sentences=1) -> None:
    meta = {"format": "ea_fairseq.analysis dump v1", "sentences": []}
    arrays = {}
    for sid in range(sentences):
        meta["sentences"].append({"id": sid, "source": ["a"] * shape[3], "target": ["b"] * shape[2],
                                  "decoder_input": ["b"] * shape[2], "maps": {"decoder.cross": ["weights"]}})
        arrays[f"{sid}/decoder.cross/weights"] = np.zeros(shape, np.float32)
    np.savez_compressed(path, **{META_KEY: np.array(json.dumps(meta)), **arrays})


def _plot(dump: Path, out: Path, *extra, timeout=120):
    return subprocess.run([str(BIN / "ea-fairseq-analysis"), "plot", "maps", str(dump), "--out-dir", str(out),
                           *extra], capture_output=True, text=True, timeout=timeout)


def test_plot_refuses_more_panels_than_a_figure_holds(tmp_path):
    """1000 layers x 1000 heads of one token each: 22 KB on disk, a million subplots undefended
    (the control: the dump declares them, and the plotter would draw one per layer and head)."""
    _dump(tmp_path / "d.npz", (1000, 1000, 1, 1))
    assert os.path.getsize(tmp_path / "d.npz") < 64_000
    with np.load(tmp_path / "d.npz") as npz:
        assert npz["0/decoder.cross/weights"].shape[:2] == (1000, 1000)
    proc = _plot(tmp_path / "d.npz", tmp_path / "fig")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1 and "--layers" in lines[0] and "panels" in lines[0], proc.stderr
    # a subset through the options the refusal names is drawn
    proc = _plot(tmp_path / "d.npz", tmp_path / "fig", "--layers", "1", "2", "--heads", "3", timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_plot_refuses_more_figures_than_a_dump_makes(tmp_path):
    from ea_fairseq_cli import plots

    _dump(tmp_path / "d.npz", (1, 1, 1, 1), sentences=plots.LIMIT_FIGURES + 1)
    proc = _plot(tmp_path / "d.npz", tmp_path / "fig")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1 and "--sentence" in lines[0], proc.stderr
    assert not (tmp_path / "fig").exists() or not os.listdir(tmp_path / "fig")


def test_dump_member_that_expands_beyond_its_compressed_size_is_refused_before_it_is_read(tmp_path, monkeypatch):
    """A 64 MiB map of zeros bzip2-compressed to a few hundred bytes: more than deflate (at most
    about 1032 bytes a compressed byte) ever inflates, a crafted zip. Refused from the zip's
    sizes, before numpy allocates or inflates it (the control: np.load of the same file inflates
    all of it). The same map deflated by np.savez_compressed is read: test_red_team_tools."""
    from ea_fairseq.analysis import dumps

    _dump(tmp_path / "d.npz", (1, 1, 4096, 4096))
    with zipfile.ZipFile(tmp_path / "d.npz") as z:
        members = {i.filename: z.read(i) for i in z.infolist()}
    with zipfile.ZipFile(tmp_path / "d.npz", "w", compression=zipfile.ZIP_BZIP2) as z:
        for name, data in members.items():
            z.writestr(name, data)
    size = os.path.getsize(tmp_path / "d.npz")
    with zipfile.ZipFile(tmp_path / "d.npz") as z:
        info = z.getinfo("0/decoder.cross/weights.npy")
        assert info.file_size > 2 * dumps.LIMIT_EXPANSION * info.compress_size
    with np.load(tmp_path / "d.npz") as npz:
        assert npz["0/decoder.cross/weights"].nbytes == 64 << 20 and size < 20_000
    read, real = [], dumps.np.lib.format.read_array
    monkeypatch.setattr(dumps.np.lib.format, "read_array",
                        lambda f, *a, **k: real(f, *a, **k) if META_KEY in f.name else read.append(f.name))
    dump = dumps.AttentionDump(str(tmp_path / "d.npz"))
    with pytest.raises(dumps.DumpError, match="compressed byte deflate reaches"):
        dump.get(0, "decoder.cross", "weights")
    assert read == []
    proc = _plot(tmp_path / "d.npz", tmp_path / "fig")
    assert proc.returncode != 0 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_dump_whose_members_share_their_compressed_bytes_is_refused(tmp_path):
    """Two zip entries pointing at the same compressed data (an overlapping zip bomb)."""
    from ea_fairseq.analysis import dumps

    _dump(tmp_path / "d.npz", (1, 1, 2, 2))
    with zipfile.ZipFile(tmp_path / "d.npz") as z:
        members = {i.filename: z.read(i) for i in z.infolist()}
    blob = bytearray((tmp_path / "d.npz").read_bytes())
    # the central directory names the first member twice more, at the same offset
    with zipfile.ZipFile(tmp_path / "d.npz") as z:
        infos = z.infolist()
    cd = blob.index(b"PK\x01\x02")
    entry_end = blob.index(b"PK\x01\x02", cd + 4)
    entry = bytes(blob[cd:entry_end])
    eocd = blob.index(b"PK\x05\x06")
    n = len(infos) + 1
    new_cd = blob[cd:eocd] + entry.replace(META_KEY.encode() + b".npy", b"x" * len(META_KEY) + b".npy")
    end = bytearray(blob[eocd:])
    end[8:10] = end[10:12] = n.to_bytes(2, "little")
    end[12:16] = len(new_cd).to_bytes(4, "little")
    (tmp_path / "d.npz").write_bytes(bytes(blob[:cd]) + bytes(new_cd) + bytes(end))
    assert members
    with pytest.raises(dumps.DumpError, match="overlap|share"):
        dumps.AttentionDump(str(tmp_path / "d.npz"))


# -- 3. a train.log line that makes the curves parser backtrack --------------------------------------
_OLD_JSON = re.compile(r"\| (?P<tag>train_inner|train|valid\w*) \| (?P<body>\{.*\})\s*$")
CRAFTED = "| train | {" * 5000  # 55 KB: every '| train | {' a start the old pattern scanned to the end from


def test_curves_parse_a_crafted_log_in_linear_time(tmp_path):
    good = ('2024-01-01 00:00:00 | INFO | train_inner | {"epoch": 1, "loss": "8.1", "num_updates": "5"}\n'
            '2024-01-01 00:00:00 | INFO | valid | {"epoch": 1, "valid_loss": "7.0", "valid_num_updates": "5"}\n')
    log = tmp_path / "train.log"
    log.write_text(good + (CRAFTED + "\n") * 30 + good)  # 1.6 MB
    assert log.stat().st_size > 1_500_000
    start = time.process_time()
    records = curves.parse_log(str(log))
    assert time.process_time() - start < 5
    assert [r["loss"] for r in records["train_inner"]] == [8.1, 8.1] and len(records["valid"]) == 2
    # the control: the old pattern on one of those lines costs orders of magnitude more than the
    # whole parse of that line
    line = tmp_path / "one.log"
    line.write_text(CRAFTED + "\n")
    start = time.process_time()
    curves.parse_log(str(line))
    new = time.process_time() - start
    start = time.process_time()
    assert _OLD_JSON.search(CRAFTED) is None
    old = time.process_time() - start
    assert old > 20 * new, (old, new)


def test_curves_parse_looks_at_each_character_a_bounded_number_of_times(tmp_path, monkeypatch):
    """The work of the parse as a step count: the characters its json.loads receives are at most
    those of the file, however the lines are crafted."""
    seen = []
    real = json.loads
    monkeypatch.setattr(curves.json, "loads", lambda s, *a, **k: seen.append(len(s)) or real(s, *a, **k))
    log = tmp_path / "train.log"
    log.write_text("| train | {" * 2000 + "}\n" + ("| valid | {" + '"a": 1, ' * 100 + "}  \n") * 10)
    curves.parse_log(str(log))
    assert sum(seen) <= log.stat().st_size and len(seen) <= 11


def test_curves_skip_a_line_longer_than_any_fairseq_writes(tmp_path):
    log = tmp_path / "train.log"
    body = json.dumps({"epoch": 1, "loss": "3", "num_updates": "1", "pad": "x" * (curves.LIMIT_LINE + 10)})
    ok = '| INFO | train_inner | {"epoch": 1, "loss": "2", "num_updates": "2"}'
    log.write_text(f"| INFO | train_inner | {body}\n{ok}\n")
    assert [r["loss"] for r in curves.parse_log(str(log))["train_inner"]] == [2.0]


def test_curves_refuse_a_device_in_one_line(tmp_path):
    os.symlink("/dev/zero", tmp_path / "train.log")
    proc = subprocess.run([str(BIN / "ea-fairseq-analysis"), "plot", "curves", str(tmp_path / "train.log"),
                           "--out", str(tmp_path / "c.png")], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-2000:]


# -- 4. a sentence longer than the model's max_positions in ea-fairseq-analysis dump ------------------
from test_analysis import tiny_checkpoint  # noqa: E402,F401  (a fixture)


def test_dump_skips_sentences_longer_than_max_positions(tiny_checkpoint, tiny_data_bin, tmp_path, capsys):  # noqa: F811
    from fairseq import utils

    from ea_fairseq.analysis import maps

    model, task, _ = maps.load_model(tiny_checkpoint, tiny_data_bin)
    limit = utils.resolve_max_positions(task.max_positions(), model.max_positions())
    words = [w for w in task.source_dictionary.symbols[task.source_dictionary.nspecial:] if "@" not in w][:5]
    long = " ".join(words[i % len(words)] for i in range(limit[0] + 10))
    short = " ".join(words[:3])
    (tmp_path / "src").write_text(f"{short}\n{long}\n")
    (tmp_path / "ref").write_text(f"{short}\n{short}\n")
    # the control: the model runs on it, a map of more queries than its positions
    dataset = maps.text_dataset(task, [short, long], [short, short])
    weights = maps.capture(model, dataset.collater([dataset[1]]))["encoder.self"]["weights"][0]
    assert weights.shape[-1] > limit[0]
    capsys.readouterr()
    assert analysis_cli.main(["dump", tiny_checkpoint, "--data", tiny_data_bin, "--input", str(tmp_path / "src"),
                              "--reference", str(tmp_path / "ref"), "--ids", "0", "1",
                              "--out", str(tmp_path / "maps.npz")]) == 0
    out = capsys.readouterr().out
    assert "skipped 1 sentence" in out and "max_positions" in out, out
    meta = json.loads((tmp_path / "maps.json").read_text())
    assert [s["id"] for s in meta["sentences"]] == [0]
    with pytest.raises(SystemExit, match="max_positions"):
        analysis_cli.main(["dump", tiny_checkpoint, "--data", tiny_data_bin, "--input", str(tmp_path / "src"),
                           "--reference", str(tmp_path / "ref"), "--ids", "1", "--out", str(tmp_path / "m2.npz")])


# -- every writer: a link planted under an output's name is replaced, not written through -------------
def test_bleu_scores_json_replaces_a_planted_link(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    ev = tmp_path / "eval"
    ev.mkdir()
    for name in ("test.de-en.scores.json", "test.de-en.hyp.tok"):
        os.symlink(victim, ev / name)
    gen = ev / "gen.txt"
    gen.write_text("".join(f"S-{i}\tx\nT-{i}\t{r}\nH-{i}\t-0.1\t{h}\nD-{i}\t-0.1\t{h}\n"
                           for i, (r, h) in enumerate(zip(REFS, HYPS))))
    from ea_fairseq_cli import bleu

    assert bleu.main([str(gen), "--mode", "iwslt", "--out-prefix", str(ev / "test.de-en")]) == 0
    assert victim.read_text() == "keep"
    assert not (ev / "test.de-en.scores.json").is_symlink() and json.loads((ev / "test.de-en.scores.json").read_text())


def test_plot_replaces_a_planted_link(tmp_path):
    victim = tmp_path / "victim.png"
    victim.write_bytes(b"keep")
    _dump(tmp_path / "d.npz", (1, 1, 2, 2))
    (tmp_path / "fig").mkdir()
    os.symlink(victim, tmp_path / "fig" / "s0_decoder.cross_weights.png")
    proc = _plot(tmp_path / "d.npz", tmp_path / "fig", timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert victim.read_bytes() == b"keep" and not (tmp_path / "fig" / "s0_decoder.cross_weights.png").is_symlink()
