"""A model directory is input: what a checkpoint, its archive and the files beside it carry
reaches fairseq only where fairseq's use of it is checked. Dataset formats are those whose
files the plugin checks (fasta runs a shell command holding a file name; huffman opens a
vocabulary beside the index), languages inferred from file names load as fairseq reads them, the archive is
read as torch reads it, tensors hold their data on the CPU, integers that size allocations are
bounded. Each attack goes through a real entry point (the analysis tool, fairseq-generate, the
hub), with a negative control showing the payload live without the guard, and what fairseq's
own tools write still loads."""
import os
import shutil
import struct
import threading
import time
import zlib

import numpy as np
import pytest
import torch
from fairseq import checkpoint_utils, options
from fairseq.data import Dictionary, data_utils, indexed_dataset
from fairseq.data.huffman.huffman_mmap_indexed_dataset import HuffmanMMapIndex, HuffmanMMapIndexedDataset
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import REPO
from ea_fairseq.safety import no_code as safety
from ea_fairseq.safety.data_files import CHECKED_FORMATS, DataFileError

FIXTURES = os.path.join(REPO, "tests", "fixtures", "checkpoints")
USER_DIR = os.path.join(REPO, "ea_fairseq")
SHELL = "`touch pwned`"  # a command substitution, legal in a file name
HOSTILE_SPLIT = f"test.{SHELL}-x.{SHELL}"  # fairseq infers the pair ('`touch pwned`', 'x') from it


def trusted_state():
    return torch.load(os.path.join(FIXTURES, "vanilla", "checkpoint.pt"), weights_only=False)  # our own file


@pytest.fixture(scope="module")
def sound_dir(tmp_path_factory):
    """A model directory as fairseq's tools write it: a checkpoint fairseq-train wrote (the vanilla
    fixture), its dictionaries and a test split binarized by fairseq-preprocess (in this process)."""
    import logging

    from fairseq_cli import preprocess

    raw, model = tmp_path_factory.mktemp("raw"), tmp_path_factory.mktemp("model")
    (raw / "test.src").write_text("s1 s2 s3\ns4 s5 s6 s7\n")
    (raw / "test.tgt").write_text("t3 t2 t1\nt7 t6 t5 t4\n")
    handlers = list(logging.getLogger("fairseq_cli.preprocess").handlers)
    preprocess.main(options.get_preprocessing_parser().parse_args([
        "--source-lang", "src", "--target-lang", "tgt", "--testpref", str(raw / "test"), "--destdir", str(model),
        "--srcdict", os.path.join(FIXTURES, "dict.src.txt"), "--tgtdict", os.path.join(FIXTURES, "dict.tgt.txt"),
        "--workers", "1"]))
    logging.getLogger("fairseq_cli.preprocess").handlers[:] = handlers
    shutil.copy(os.path.join(FIXTURES, "vanilla", "checkpoint.pt"), model / "c.pt")
    return model


@pytest.fixture
def model_dir(tmp_path, sound_dir, monkeypatch):
    """A copy of the sound directory; the working directory is an empty folder beside it."""
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    return shutil.copytree(sound_dir, tmp_path / "model")


def analysis_dump(directory, checkpoint="c.pt"):
    """``ea-fairseq-analysis dump`` on a checkpoint of ``directory`` (its data folder by default):
    ``(exit status or message, dump written)``."""
    from ea_fairseq_cli.analysis import main

    out = directory.parent / "dump.npz"
    try:
        code = main(["dump", str(directory / checkpoint), "--out", str(out)])
    except SystemExit as exit_:
        code = exit_.code
    return code, out.exists()


def hostile_names(directory):
    """Files whose names give fairseq the language pair (SHELL, 'x'): the dictionaries and a
    split of each format's files (fasta's, and the binary pair a split must have to exist);
    without the guard ``ea-fairseq-analysis dump`` runs the command and exits 0."""
    for lang in (SHELL, "x"):
        shutil.copy(directory / "dict.src.txt", directory / f"dict.{lang}.txt")
    for side, prefix in (("src", HOSTILE_SPLIT), ("tgt", f"test.{SHELL}-x.x")):
        for suffix in (".idx", ".bin"):
            shutil.copy(directory / f"test.src-tgt.{side}{suffix}", directory / f"{prefix}{suffix}")
        (directory / f"{prefix}.fasta").write_text(">s\ns1 s2\n")
    for name in os.listdir(directory):
        if name.startswith("test.src-tgt"):
            os.unlink(directory / name)


def saved(state, directory, name="c.pt"):
    torch.save(state, directory / name)
    return directory / name


def one_line(text) -> str:
    text = str(text)
    assert "\n" not in text and "Traceback" not in text, text
    return text


# -- 1. a shell command from a model directory -------------------------------------------------
def test_fasta_runs_a_file_name_through_a_shell_without_the_guard(model_dir):
    """Negative control: fairseq's fasta reader indexes its file with a shell command that holds
    the file's path, so a command substitution in a file name runs."""
    hostile_names(model_dir)
    dictionary = Dictionary.load(str(model_dir / "dict.x.txt"))
    make_dataset = indexed_dataset.make_dataset.__wrapped__
    make_dataset(str(model_dir / HOSTILE_SPLIT), "fasta", dictionary=dictionary)
    assert os.path.exists("pwned")


@pytest.mark.parametrize("layout", ["dataset", "task"])
def test_a_checkpoint_naming_the_fasta_format_is_refused_by_the_analysis_tool(model_dir, layout):
    state = trusted_state()
    state["cfg"][layout]["dataset_impl"] = "fasta"  # (languages left to be inferred: the default)
    saved(state, model_dir)
    hostile_names(model_dir)
    code, written = analysis_dump(model_dir)
    message = one_line(code)
    assert f"refused: cfg.{layout}.dataset_impl = 'fasta': not one of {list(CHECKED_FORMATS)}" in message
    assert not os.path.exists("pwned") and not written


def test_languages_inferred_from_file_names_are_only_names(model_dir):
    """A sound checkpoint (fairseq's inferred-format default) in a directory whose file names
    give the language pair ('`touch pwned`', 'x'): fairseq reads the binary split of that name
    (refuse by use: only fasta's shell would run it, and that format is refused); no command runs."""
    hostile_names(model_dir)
    code, written = analysis_dump(model_dir)
    assert code == 0 and written and not os.path.exists("pwned")


@pytest.mark.parametrize("impl", ["fasta", "huffman"])
def test_formats_the_plugin_does_not_check_are_refused_where_fairseq_reads_data(model_dir, impl):
    """The layer every task goes through (``--dataset-impl`` on a command line, a task of
    another family): ``load_indexed_dataset`` and ``make_dataset``."""
    hostile_names(model_dir)
    dictionary = Dictionary.load(str(model_dir / "dict.x.txt"))
    for load in (data_utils.load_indexed_dataset, indexed_dataset.make_dataset):
        with pytest.raises(DataFileError, match=f"dataset format '{impl}': a dataset format whose files"):
            load(str(model_dir / HOSTILE_SPLIT), dictionary=dictionary, **(
                {"dataset_impl": impl} if load is data_utils.load_indexed_dataset else {"impl": impl}))
    assert not os.path.exists("pwned")


def test_what_fairseq_writes_still_loads_in_the_analysis_tool(model_dir):
    """Negative control: the checkpoint fairseq-train wrote, with the split fairseq-preprocess
    wrote, languages inferred from the file names."""
    code, written = analysis_dump(model_dir)
    assert code == 0 and written


# -- 4. files fairseq opens beside the ones checked --------------------------------------------
def huffman_split(prefix, vocabulary: str):
    """A split as fairseq's huffman writer lays it out (its index writer), its vocabulary a FIFO
    or a link to /dev/zero."""
    with HuffmanMMapIndex.writer(f"{prefix}.idx", 4) as index:
        index.write([2], [4])
    with open(f"{prefix}.bin", "wb") as f:
        f.write(b"\x00" * 4)
    if vocabulary == "fifo":
        os.mkfifo(f"{prefix}.vocab")
    else:
        os.symlink("/dev/zero", f"{prefix}.vocab")


def test_a_huffman_vocabulary_fifo_hangs_fairseq_without_the_guard(tmp_path):
    prefix = str(tmp_path / "test.src-tgt.src")
    huffman_split(prefix, "fifo")
    reader = threading.Thread(target=HuffmanMMapIndexedDataset, args=(prefix,), daemon=True)
    reader.start()
    reader.join(1.0)
    assert reader.is_alive()  # waiting in open() for a writer that never comes
    with open(f"{prefix}.vocab", "w"):
        pass  # let it go
    reader.join(5.0)


@pytest.mark.parametrize("vocabulary", ["fifo", "dev-zero"])
def test_an_index_of_another_format_is_refused_by_fairseq_generate(model_dir, vocabulary):
    from fairseq_cli import generate

    prefix = model_dir / "test.src-tgt.src"
    for suffix in (".idx", ".bin"):
        os.unlink(f"{prefix}{suffix}")
    huffman_split(prefix, vocabulary)
    args = options.parse_args_and_arch(options.get_generation_parser(), [
        str(model_dir), "--user-dir", USER_DIR, "--path", str(model_dir / "c.pt"), "--gen-subset", "test",
        "--cpu", "--beam", "2", "--source-lang", "src", "--target-lang", "tgt"])
    start = time.perf_counter()
    with pytest.raises(DataFileError) as refusal:
        generate.main(args)
    assert time.perf_counter() - start < 10
    assert one_line(refusal.value).startswith(f"{prefix}.idx: an index of another format (it begins with "
                                              "b'HUFFIDX\\x00\\x00'): a dataset format whose files ea_fairseq checks")


# -- 3. tensors without data ---------------------------------------------------------------------
def test_meta_weights_defeat_the_budget_without_the_guard():
    """Negative control: a meta tensor has a shape and no data; counted as weights, it would
    let a build create any model (2**16 x 2**18 floats: 64 GiB)."""
    from ea_fairseq.safety.budget import Budget

    big = torch.empty(2 ** 16, 2 ** 18, device="meta")
    with Budget.for_weights({"encoder.embed_tokens.weight": big}, "c.pt"), torch.device("meta"):
        torch.nn.Linear(2 ** 16, 2 ** 18)


@pytest.mark.parametrize("where", ["model", "last_optimizer_state", "extra_state.ema", "criterion"])
def test_tensors_without_data_are_refused_everywhere_in_the_state(tmp_path, where):
    state = trusted_state()
    big = torch.empty(2 ** 16, 2 ** 18, device="meta")
    if where == "model":
        state["model"]["encoder.embed_tokens.weight"] = big
    elif where == "extra_state.ema":
        state["extra_state"]["ema"] = {"encoder.embed_tokens.weight": big}
    elif where == "last_optimizer_state":
        state["last_optimizer_state"] = {"state": {0: {"exp_avg": big}}, "param_groups": []}
    else:
        state["criterion"] = {"scale": big}
    path = saved(state, tmp_path)
    assert path.stat().st_size < 200_000
    for load in (checkpoint_utils.load_checkpoint_to_cpu, safety.load_checkpoint):
        with pytest.raises(safety.UnsafeCheckpointError) as refusal:
            load(str(path))
        assert "a tensor on the meta device, (65536, 262144) torch.float32 with no data" in one_line(refusal.value)


# -- 2. two zip readers ----------------------------------------------------------------------------
def _deflated(data: bytes) -> bytes:
    packer = zlib.compressobj(9, zlib.DEFLATED, -15)
    return packer.compress(data) + packer.flush()


def two_views(tmp_path, numel: int):
    """One file, two archives: Python's zipfile finds the sound checkpoint (its offsets shifted
    by the bytes before it), torch's reader finds the same records with one tensor's record
    holding ``numel`` zero floats, deflated."""
    import io
    import zipfile

    sound = trusted_state()
    buffer = io.BytesIO()
    torch.save(sound, buffer)
    with zipfile.ZipFile(buffer) as archive:
        safe = [(info.filename, archive.read(info)) for info in archive.infolist()]
    swapped = dict(sound, model=dict(sound["model"]))
    swapped["model"]["encoder.layers.0.fc1.weight"] = torch.zeros(numel)
    buffer = io.BytesIO()
    torch.save(swapped, buffer)
    with zipfile.ZipFile(buffer) as archive:
        loaded = [(info.filename, archive.read(info)) for info in archive.infolist()]
    assert [n for n, _ in loaded] == [n for n, _ in safe]

    def records(entries, deflate_largest, gap=0):
        largest = max(range(len(entries)), key=lambda i: len(entries[i][1]))
        out = bytearray(b"\x00" * gap)  # (no reader minds bytes between records)
        directory = bytearray()
        for i, (name, data) in enumerate(entries):
            packed = _deflated(data) if deflate_largest and i == largest else data
            method, encoded, crc = (8 if packed is not data else 0), name.encode(), zlib.crc32(data)
            directory += struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, method, 0, 0, crc, len(packed),
                                     len(data), len(encoded), 0, 0, 0, 0, 0, len(out)) + encoded
            out += struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, method, 0, 0, crc, len(packed), len(data),
                               len(encoded), 0) + encoded + packed
        return bytes(out), bytes(directory)

    torch_body, torch_directory = records(loaded, True)
    safe_body, safe_directory = records(safe, False, gap=len(torch_body))
    assert len(torch_directory) == len(safe_directory)
    at = len(safe_body)  # torch reads its directory there (absolute); zipfile there + the bytes before
    before = torch_body + b"\x00" * (at - len(torch_body)) + torch_directory
    eocd = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(safe), len(safe), len(safe_directory), at, 0)
    path = tmp_path / "c.pt"
    path.write_bytes(before + safe_body + safe_directory + eocd)
    return path


def test_two_zip_readers_see_two_checkpoints_without_the_guard(tmp_path):
    """Negative control: Python's zipfile lists stored records no larger than the file (what a
    check by zipfile passes); torch's reader, which torch.load opens, sees a 64 MiB record."""
    import zipfile

    path = two_views(tmp_path, 2 ** 24)
    size = path.stat().st_size
    with zipfile.ZipFile(path) as archive:
        assert all(i.compress_type == zipfile.ZIP_STORED and i.file_size < size for i in archive.infolist())
    reader = torch._C.PyTorchFileReader(str(path))
    assert max(reader.get_record_size(name) for name in reader.get_all_records()) == 2 ** 26 > 100 * size
    with safety.checkpoint_globals_allowed():
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    assert loaded["model"]["encoder.layers.0.fc1.weight"].numel() == 2 ** 24


def test_the_archive_is_checked_as_torch_reads_it(tmp_path):
    from fairseq.models.transformer import TransformerModel

    path = two_views(tmp_path, 2 ** 24)
    for name in ("dict.src.txt", "dict.tgt.txt"):
        shutil.copy(os.path.join(FIXTURES, name), tmp_path)
    with pytest.raises(safety.UnsafeCheckpointError) as refusal:
        TransformerModel.from_pretrained(str(tmp_path), checkpoint_file="c.pt", data_name_or_path=str(tmp_path),
                                         user_dir=USER_DIR)
    assert "bytes, where the file holds" in one_line(refusal.value) and "compressed records" in str(refusal.value)
    code, written = analysis_dump(tmp_path)
    assert "compressed records" in one_line(code) and not written


def test_bytes_before_an_archive_make_it_what_torch_reads_it_as(tmp_path):
    """torch reads a zip archive only where the file begins with one: an archive behind other
    bytes is what torch would read, not a checkpoint (zipfile would still list it)."""
    import zipfile

    path = tmp_path / "c.pt"
    path.write_bytes(b"#!/bin/sh\n" + open(os.path.join(FIXTURES, "vanilla", "checkpoint.pt"), "rb").read())
    assert zipfile.is_zipfile(path)
    with pytest.raises(safety.CorruptCheckpointError, match="not a torch checkpoint .torch reads a zip archive where"):
        safety.load_checkpoint(str(path))


# -- 6. unbounded integers -------------------------------------------------------------------------
def test_a_padding_multiple_sizes_the_batch_without_the_guard():
    """Negative control: fairseq pads a batch of one 2-token sentence to the multiple's width
    (2**22 here: 32 MiB; 10**10 asks for 80 GB)."""
    batch = data_utils.collate_tokens([torch.tensor([5, 2])], pad_idx=1, pad_to_multiple=2 ** 22)
    assert tuple(batch.shape) == (1, 2 ** 22)


@pytest.mark.parametrize("section,field,value", [
    ("task", "required_seq_len_multiple", 10 ** 10), ("dataset", "required_seq_len_multiple", 10 ** 10),
    ("task", "num_batch_buckets", 4 * 10 ** 9), ("task", "max_source_positions", 10 ** 12),
    ("task", "upsample_primary", 10 ** 9), ("dataset", "required_batch_size_multiple", 10 ** 9),
    ("common", "seed", 2 ** 70)])
def test_integers_are_bounded_in_the_analysis_tool(model_dir, section, field, value):
    state = trusted_state()
    state["cfg"][section][field] = value
    saved(state, model_dir)
    start = time.perf_counter()
    code, written = analysis_dump(model_dir)
    assert f"refused: cfg.{section}.{field} = {value}: not an integer from " in one_line(code)
    assert time.perf_counter() - start < 10 and not written


@settings(max_examples=40, deadline=None, database=None)
@given(field=st.sampled_from(["required_seq_len_multiple", "num_batch_buckets", "max_source_positions",
                              "max_target_positions", "upsample_primary", "seed", "max_epoch"]),
       section=st.sampled_from(["task", "dataset", "common", "optimization"]),
       value=st.integers(min_value=-(2 ** 80), max_value=2 ** 80))
def test_every_integer_arrives_within_its_bounds_or_is_refused(field, section, value):
    from ea_fairseq.safety.no_code.fields import INTEGER_BOUNDS, LIMIT_INTEGER

    state = trusted_state()
    state["cfg"][section][field] = value
    try:
        out = safety.sanitize(state, "c.pt", build_check=False)
    except safety.UnsafeCheckpointError as refusal:
        assert f"cfg.{section}.{field} = " in one_line(refusal) and "not an integer from" in str(refusal)
        return
    received = out["cfg"][section].get(field)
    least, most = INTEGER_BOUNDS.get(field, (-LIMIT_INTEGER - 1, LIMIT_INTEGER))
    assert received is None or least <= received <= most


# -- the red team's own: items in holes, a format read as another -----------------------------------
def sparse_split(prefix, tokens: int):
    """An mmap split (fairseq's own index writer) of one item of ``tokens`` uint16 tokens, its
    data file all one hole: the declared size, none of it stored."""
    with indexed_dataset.MMapIndexedDataset.Index.writer(f"{prefix}.idx", np.uint16) as index:
        index.write([tokens])
    with open(f"{prefix}.bin", "wb") as f:
        f.truncate(2 * tokens)


def test_an_item_in_a_hole_is_read_whole_without_the_guard(tmp_path):
    """Negative control: a data file of no stored bytes gives fairseq an item it reads whole
    (2**24 + 8 tokens: 128 MiB as int64; the index could declare 2**31)."""
    from ea_fairseq.safety.data_files import ITEM_LIMIT

    prefix = str(tmp_path / "test.src-tgt.src")
    sparse_split(prefix, ITEM_LIMIT + 8)
    assert os.stat(f"{prefix}.bin").st_blocks * 512 < 2 ** 20
    assert indexed_dataset.MMapIndexedDataset(prefix)[0].numel() == ITEM_LIMIT + 8


@pytest.mark.parametrize("items", [1, 64], ids=["one-long-item", "many-items"])
def test_a_data_file_with_holes_is_refused_by_the_analysis_tool(model_dir, items):
    from ea_fairseq.safety.data_files import ITEM_LIMIT

    prefix = model_dir / "test.src-tgt.src"
    if items == 1:  # one item longer than a sentence may be
        sparse_split(str(prefix), ITEM_LIMIT + 8)
        os.truncate(f"{prefix}.bin", 0)
        with open(f"{prefix}.bin", "wb") as f:  # (stored, so that the item's length is what is refused)
            f.write(b"\x01" * 64)
        shown = f"test.src-tgt.src.idx: an item of {ITEM_LIMIT + 8:,} tokens, more than the"
    else:  # sentence-long items in a data file that stores none of them
        with indexed_dataset.MMapIndexedDataset.Index.writer(f"{prefix}.idx", np.uint16) as index:
            index.write([ITEM_LIMIT] * items)
        with open(f"{prefix}.bin", "wb") as f:
            f.truncate(2 * ITEM_LIMIT * items)
        shown = f"test.src-tgt.src.bin: a file with holes ({2 * ITEM_LIMIT * items:,} bytes declared"
    code, written = analysis_dump(model_dir)
    assert shown in one_line(code) and not written


def test_an_index_read_as_another_format_is_one_line(model_dir):
    """A checkpoint (or --dataset-impl) naming the legacy format for fairseq-preprocess's mmap
    split: one line saying which format the index is, not fairseq's assertion deep inside."""
    state = trusted_state()
    state["cfg"]["dataset"]["dataset_impl"] = state["cfg"]["task"]["dataset_impl"] = "lazy"
    saved(state, model_dir)
    code, written = analysis_dump(model_dir)
    assert "test.src-tgt.src.idx: an index of the mmap format (fairseq-preprocess --dataset-impl mmap), read as " \
           "'lazy': give --dataset-impl mmap" in one_line(code)
    assert not written
