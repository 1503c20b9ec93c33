"""Dictionaries and BPE files that fairseq opens by name from a model directory or a data-bin
(``dict.src.txt``; ``code``, ``sentencepiece.bpe.model`` picked up by the hub; ``--bpe-codes``)
are refused when they are a FIFO, a link to /dev/zero or larger than their kind allows (a
dictionary: more lines than the checkpoint the hub read before it has weights): through
the hub from a directory and ``fairseq-generate``, in one line naming the file, in bounded time
and memory. Unguarded, fairseq's own readers wait on the FIFO and read /dev/zero until memory
runs out (the controls, in the same process as the hub loads)."""
import json
import os
import shutil
import subprocess
import sys

import pytest
from fairseq.data import Dictionary
from fairseq.tasks.translation import TranslationTask

from conftest import cli
from ea_fairseq.safety.data_files import DICTIONARY_LIMIT, DataFileError
from test_data_files import run_measured
from support.trained_checkpoints import ENV, USER_DIR, family_checkpoints

DRIVER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "drivers", "hub_named_files.py")
FIFO, ZERO, HUGE = "a FIFO", "a link to /dev/zero, outside", "more than the 256 MiB allowed"
LINES = "more types than"  # a text file of more lines than the checkpoint's weights have elements


def payload(path, kind):
    if os.path.lexists(path):
        os.unlink(path)
    if kind == FIFO:
        os.mkfifo(path)
    elif kind == ZERO:
        os.symlink("/dev/zero", path)
    elif kind == LINES:  # 3.6 MB: the hub reads the checkpoint first, whose weights bound it
        with open(path, "w") as f:
            f.writelines(f"w{i:07d} 1\n" for i in range(300_000))
    else:  # a sparse regular file just over the dictionary bound
        with open(path, "wb") as f:
            f.truncate(DICTIONARY_LIMIT + 1)
    return str(path)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_data_bin):
    """A model directory as the hub takes it: a checkpoint and its two dictionaries."""
    checkpoint = family_checkpoints(tmp_path_factory, tiny_data_bin)["vanilla"]
    root = tmp_path_factory.mktemp("model")
    shutil.copy(checkpoint, root / "checkpoint_last.pt")
    for lang in ("src", "tgt"):
        shutil.copy(os.path.join(tiny_data_bin, f"dict.{lang}.txt"), root)
    return root


HUB_CASES = {  # name -> (file in the model dir, payload, --bpe, phrase in the message)
    "dictionary-fifo": ("dict.src.txt", FIFO, None, "a fairseq dictionary is a regular text file of at most 256 MiB"),
    "dictionary-dev-zero": ("dict.src.txt", ZERO, None, "a fairseq dictionary is a regular text file"),
    "dictionary-too-large": ("dict.tgt.txt", HUGE, None, "a fairseq dictionary is a regular text file"),
    "dictionary-too-many-lines": ("dict.src.txt", LINES, None, "weight elements): use the dictionaries the checkpoint"),
    "sentencepiece-fifo": ("sentencepiece.bpe.model", FIFO, "sentencepiece", "a BPE file (--sentencepiece-model)"),
    "bpe-codes-dev-zero": ("code", ZERO, "subword_nmt", "a BPE file (--bpe-codes) is a regular file of at most 64 MiB"),
}


def test_hub_from_a_directory(tmp_path, model_dir):
    cases, expected = [], {}
    for name, (file, kind, bpe, phrase) in HUB_CASES.items():
        directory = shutil.copytree(model_dir, tmp_path / name)
        expected[str(directory)] = (payload(directory / file, kind), kind, phrase)
        cases.append({"dir": str(directory), "checkpoint": "checkpoint_last.pt", "bpe": bpe})
    sound = shutil.copytree(model_dir, tmp_path / "sound")
    (sound / "code").write_text("#version: 0.2\ns 1\n")  # a real subword-nmt merge list
    cases.append({"dir": str(sound), "checkpoint": "checkpoint_last.pt", "bpe": "subword_nmt"})
    payload(tmp_path / "control.fifo", FIFO)
    payload(tmp_path / "control.zero", ZERO)
    proc = subprocess.run([sys.executable, DRIVER, USER_DIR, *map(json.dumps, cases), "--controls",
                           tmp_path / "control.fifo", tmp_path / "control.zero"],
                          capture_output=True, text=True, env=ENV, timeout=180)
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert proc.returncode == 0 and len(lines) == len(cases) + 4, proc.stderr[-3000:]
    results = {r["dir"]: r for r in lines[:len(cases)]}
    for directory, (named, kind, phrase) in expected.items():
        result = results[directory]
        assert result["outcome"] == "refused", result
        assert result["message"].startswith(f"{named}: ") and phrase in result["message"], result
        assert (kind in result["message"]) and "\n" not in result["message"]
        assert result["seconds"] < 30, result
    assert results[str(sound)]["outcome"] == "loaded" and results[str(sound)]["translation"], results[str(sound)]
    assert lines[len(cases)]["maxrss"] < 2 * 2 ** 30
    controls = {c["control"]: c for c in lines[len(cases) + 1:]}
    assert controls["dictionary-fifo"]["waits"] and controls["bpe-fifo"]["waits"]
    assert controls["dictionary-dev-zero"]["outcome"] == "MemoryError"


def test_every_way_a_task_loads_a_dictionary(tmp_path, tiny_data_bin):
    """In this process only the bounded payload (a sparse file over the bound: a FIFO or
    /dev/zero let through would hang or exhaust the test run; the hub test has those)."""
    class Subclass(Dictionary):  # as a task's own dictionary class
        pass

    path = payload(tmp_path / "dict.src.txt", HUGE)
    for load in (Dictionary.load, TranslationTask.load_dictionary, Subclass.load):
        with pytest.raises(DataFileError, match=f"^{path}: 268,435,457 bytes, {HUGE}: a fairseq dictionary"):
            load(path)
    sound = Dictionary.load(os.path.join(tiny_data_bin, "dict.src.txt"))
    assert len(sound) > sound.nspecial and sound.index("s1") != sound.unk()


@pytest.mark.parametrize("attack", ["dictionary-fifo", "bpe-codes-dev-zero"])
def test_fairseq_generate_fails_fast_in_one_line(tmp_path, attack, tmp_path_factory, tiny_data_bin):
    data = shutil.copytree(tiny_data_bin, tmp_path / "bin")
    checkpoint = family_checkpoints(tmp_path_factory, tiny_data_bin)["vanilla"]
    extra = []
    if attack == "dictionary-fifo":
        named, shown = payload(data / "dict.src.txt", FIFO), "is a FIFO, not a regular file: a fairseq dictionary"
    else:
        named, shown = payload(tmp_path / "code", ZERO), f"{ZERO} {tmp_path}: a BPE file (--bpe-codes)"
        extra = ["--bpe", "subword_nmt", "--bpe-codes", named]
    code, lines, rss, seconds = run_measured(
        [cli("fairseq-generate"), data, "--user-dir", USER_DIR, "--path", checkpoint, "--gen-subset", "test",
         "--beam", "2", "--cpu", "--required-batch-size-multiple", "1", *extra], tmp_path,
        address_space=6 * 2 ** 30, timeout=120)
    assert code == 1 and lines[-1].startswith(f"fairseq-generate: error: {named}: {shown}"), "\n".join(lines[-20:])
    assert rss < 2 * 2 ** 30 and seconds < 120, (rss, seconds)
