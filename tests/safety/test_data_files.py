"""Binary data files whose index declares more than the files hold (a 2^40 item count, items
past the end of the data file), FIFOs and devices are refused before fairseq allocates or
opens anything, by fairseq-train and fairseq-generate in one line naming the file and with
bounded memory; fairseq's own readers, unguarded, try the 8 TiB allocation or wait forever."""
import os
import resource
import shutil
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from fairseq.data import Dictionary, data_utils, indexed_dataset

from conftest import cli
from ea_fairseq.safety.data_files import DataFileError
from support.trained_checkpoints import ENV, TINY, USER_DIR, family_checkpoints

HUGE = 2 ** 40
SPLIT = "test.src-tgt.src"


@pytest.fixture
def data(tmp_path, tiny_data_bin):
    """A copy of the tiny data-bin (mmap format, as fairseq-preprocess writes it)."""
    return shutil.copytree(tiny_data_bin, tmp_path / "bin")


def legacy_copy(prefix_from, prefix_to):
    """The same split in fairseq's legacy IndexedDataset format (IndexedDatasetBuilder)."""
    source = indexed_dataset.MMapIndexedDataset(str(prefix_from))
    builder = indexed_dataset.IndexedDatasetBuilder(str(prefix_to) + ".bin", dtype=np.int32)
    for i in range(len(source)):
        builder.add_item(source[i])
    builder.finalize(str(prefix_to) + ".idx")
    return [source[i].tolist() for i in range(len(source))]


def craft(prefix, attack):
    idx, bin_ = str(prefix) + ".idx", str(prefix) + ".bin"
    if attack == "legacy-2^40-items":
        with open(idx, "wb") as f:
            f.write(struct.pack("<8sQQQQQ", b"TNTIDX\x00\x00", 1, 4, 4, HUGE, HUGE))
        return idx, "declares 1,099,511,627,776 items and 1,099,511,627,776 sizes"
    if attack == "mmap-2^40-items":
        with open(idx, "wb") as f:
            f.write(struct.pack("<9sQBQ", b"MMIDIDX\x00\x00", 1, 4, HUGE))
        return idx, "declares 1,099,511,627,776 items"
    if attack in ("legacy-past-the-data", "mmap-past-the-data"):
        if attack.startswith("legacy"):
            legacy_copy(prefix, str(prefix) + ".legacy")
            os.replace(str(prefix) + ".legacy.idx", idx)
            os.replace(str(prefix) + ".legacy.bin", bin_)
        os.truncate(bin_, os.path.getsize(bin_) // 2)
        return idx, "items that end at byte"
    if attack == "legacy-element-size":
        legacy_copy(prefix, str(prefix) + ".legacy")
        raw = bytearray(open(str(prefix) + ".legacy.idx", "rb").read())
        raw[24:32] = struct.pack("<Q", 1)  # int32 items read as bytes
        open(idx, "wb").write(raw)
        return idx, "element size 1"
    if attack == "fifo-index":
        os.unlink(idx)
        os.mkfifo(idx)
        return idx, "is a FIFO, not a regular file"
    if attack == "dev-zero-data":
        os.unlink(bin_)
        os.symlink("/dev/zero", bin_)
        return bin_, "a link to /dev/zero, outside"
    if attack == "fifo-raw-text":
        os.mkfifo(str(prefix))  # a raw-text split (--dataset-impl raw) of that name, read whole
        return str(prefix), "is a FIFO, not a regular file"
    raise KeyError(attack)


ATTACKS = ["legacy-2^40-items", "mmap-2^40-items", "legacy-past-the-data", "mmap-past-the-data",
           "legacy-element-size", "fifo-index", "dev-zero-data", "fifo-raw-text"]


@pytest.mark.parametrize("attack", ATTACKS)
def test_refused_where_fairseqs_tasks_load_data(data, attack):
    """fairseq's translation task loads every split through data_utils.load_indexed_dataset."""
    named, shown = craft(data / SPLIT, attack)
    start = time.perf_counter()
    with pytest.raises(DataFileError) as refusal:
        data_utils.load_indexed_dataset(str(data / SPLIT), Dictionary.load(str(data / "dict.src.txt")))
    assert time.perf_counter() - start < 5
    message = str(refusal.value)
    assert message.startswith(f"{named}: ") and shown in message and "\n" not in message
    assert message.endswith("rebuild the data directory with fairseq-preprocess")


def test_sound_files_load_as_before_in_both_formats(data):
    items = legacy_copy(data / SPLIT, data / "legacy")
    for prefix, impl in ((data / SPLIT, None), (data / "legacy", "lazy")):
        dataset = data_utils.load_indexed_dataset(str(prefix), None, dataset_impl=impl)
        assert [dataset[i].tolist() for i in range(len(dataset))] == items
    empty = indexed_dataset.IndexedDatasetBuilder(str(data / "empty.bin"))
    empty.finalize(str(data / "empty.idx"))
    assert len(data_utils.load_indexed_dataset(str(data / "empty"), None)) == 0


def test_negative_control_fairseqs_own_readers(data):
    """Unguarded: the legacy reader attempts the 8 TiB allocation; the index of a FIFO blocks."""
    original = data_utils.load_indexed_dataset.__wrapped__
    craft(data / SPLIT, "legacy-2^40-items")
    with pytest.raises(MemoryError, match="8.00 TiB"):
        original(str(data / SPLIT), None)
    craft(data / "test.src-tgt.tgt", "fifo-index")
    reader = threading.Thread(target=indexed_dataset.infer_dataset_impl, args=(str(data / "test.src-tgt.tgt"),),
                              daemon=True)
    reader.start()
    reader.join(1.0)
    assert reader.is_alive()  # waiting in open() for a writer that never comes
    with open(data / "test.src-tgt.tgt.idx", "wb"):
        pass  # let it go
    reader.join(5.0)
    assert not reader.is_alive()


MAXRSS = ("import resource, subprocess, sys; code = subprocess.run(sys.argv[1:]).returncode; "
          "print('maxrss_kb', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); "
          "sys.exit(code)")


def run_measured(cmd, cwd, address_space=None, timeout=300):
    """Exit status, stderr lines, peak RSS and seconds of ``cmd``; with ``address_space`` (bytes)
    its virtual memory is bounded (a reader of /dev/zero let through ends in MemoryError)."""
    def bound():
        if address_space:
            resource.setrlimit(resource.RLIMIT_AS, (address_space, resource.getrlimit(resource.RLIMIT_AS)[1]))

    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", MAXRSS, *map(str, cmd)], capture_output=True, text=True,
                          env=ENV, cwd=cwd, timeout=timeout, preexec_fn=bound)
    lines = proc.stderr.strip().splitlines()
    return proc.returncode, lines[:-1], int(lines[-1].split()[1]) * 1024, time.perf_counter() - start


def test_fairseq_train_fails_fast_in_one_line(tmp_path, data):
    named, shown = craft(data / "train.src-tgt.src", "legacy-2^40-items")
    code, lines, rss, seconds = run_measured(
        [cli("fairseq-train"), data, "--user-dir", USER_DIR, "--arch", "transformer_lite", *TINY,
         "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "600", "--max-update", "1", "--save-dir",
         tmp_path / "ck", "--cpu", "--disable-validation", "--num-workers", "0"], tmp_path)
    assert code == 1 and lines[-1].startswith(f"fairseq-train: error: {named}: {shown}"), "\n".join(lines[-20:])
    assert rss < 2 * 2 ** 30 and seconds < 120, (rss, seconds)


def test_fairseq_generate_fails_fast_in_one_line(tmp_path, data, tmp_path_factory, tiny_data_bin):
    checkpoint = family_checkpoints(tmp_path_factory, tiny_data_bin)["vanilla"]
    named, shown = craft(data / SPLIT, "mmap-2^40-items")
    code, lines, rss, seconds = run_measured(
        [cli("fairseq-generate"), data, "--user-dir", USER_DIR, "--path", checkpoint, "--gen-subset", "test",
         "--beam", "2", "--cpu", "--required-batch-size-multiple", "1"], tmp_path)
    assert code == 1 and lines[-1].startswith(f"fairseq-generate: error: {named}: {shown}"), "\n".join(lines[-20:])
    assert rss < 2 * 2 ** 30 and seconds < 120, (rss, seconds)


@pytest.mark.parametrize("newline", ["\n", "\r"], ids=["lf", "lone-cr"])
def test_fairseq_generate_refuses_a_dictionary_its_checkpoint_stores_no_rows_for_before_reading_it(
        tmp_path, data, tmp_path_factory, tiny_data_bin, newline):
    """fairseq-generate reads the data directory's dictionaries before the checkpoint. Each type is
    a row of an embedding the checkpoint stores, a byte at least: a dictionary of more lines than
    the checkpoint has bytes is refused as it is counted, before fairseq reads it, its lines split
    as fairseq's text-mode reading splits them (a lone carriage return ends a line too). The
    control: the same command on the directory it was trained on translates, and peaks no lower."""
    checkpoint = family_checkpoints(tmp_path_factory, tiny_data_bin)["vanilla"]
    size = os.path.getsize(checkpoint)  # 0.5 MB
    command = [cli("fairseq-generate"), data, "--user-dir", USER_DIR, "--path", checkpoint, "--gen-subset", "test",
               "--beam", "2", "--cpu", "--required-batch-size-multiple", "1"]
    code, lines, control_rss, _ = run_measured(command, tmp_path)
    assert code == 0, "\n".join(lines[-20:])
    with open(data / "dict.src.txt", "a", newline="") as f:
        # short lines that fairseq's Dictionary keeps as a few hundred bytes each: 2 million (28 MB of file)
        # cost fairseq-generate half a gigabyte before the model's budget applies
        f.writelines(f"w{i:09d} 1{newline}" for i in range(4 * size))
    code, lines, rss, seconds = run_measured(command, tmp_path)
    assert code == 1 and lines[-1] == (
        f"fairseq-generate: error: {data / 'dict.src.txt'}: more than {size:,} lines, more types than {checkpoint} "
        f"stores a row for ({size:,} bytes): use the dictionaries the checkpoint was trained with"), \
        "\n".join(lines[-20:])
    assert rss < control_rss + 2 ** 27, (rss, control_rss)


def test_fairseq_train_reads_a_large_dictionary_no_checkpoint_bounds(tmp_path, data):
    """Training reads no checkpoint before its dictionaries: 50,000 types more train as fairseq does."""
    with open(data / "dict.src.txt", "a") as f:
        f.writelines(f"w{i:09d} 1\n" for i in range(50_000))
    code, lines, _, _ = run_measured(
        [cli("fairseq-train"), data, "--user-dir", USER_DIR, "--arch", "transformer_lite", *TINY,
         "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "600", "--max-update", "1", "--save-dir",
         tmp_path / "ck", "--cpu", "--disable-validation", "--num-workers", "0"], tmp_path)
    assert code == 0, "\n".join(lines[-20:])


def test_a_checkpoint_lends_the_dictionaries_only_the_bytes_it_stores(tmp_path):
    """The bound a command line's checkpoint sets its dictionaries (read before the checkpoint is)
    counts what the files fairseq will load for it (its suffix, its shards) store inside their
    directory: a sparse file's blocks, nothing for a link out of the directory."""
    import argparse

    from ea_fairseq.safety import budget

    model = tmp_path / "model"
    model.mkdir()
    (model / "real.pt").write_bytes(b"x" * 10_000)
    with open(model / "sparse.pt", "wb") as f:
        f.truncate(1 << 30)
    os.symlink(sys.executable, model / "outside.pt")
    bounds = {}
    for name in ("real.pt", "sparse.pt", "outside.pt"):
        with budget.checkpoints_named(argparse.Namespace(path=str(model / name), lm_path=None)):
            bounds[name] = budget.dictionary_bound()[0]
    assert bounds["real.pt"] == 10_000 and bounds["sparse.pt"] < 1 << 16 and bounds["outside.pt"] == 0, bounds
    (model / "ck-best.pt").write_bytes(b"x" * 5_000)  # the file fairseq loads for --checkpoint-suffix -best
    with budget.checkpoints_named(argparse.Namespace(path=str(model / "ck.pt"), checkpoint_suffix="-best",
                                                     lm_path=None)):
        assert budget.dictionary_bound()[:2] == (5_000, str(model / "ck-best.pt"))
