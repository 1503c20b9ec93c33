"""Principle 2 (confine every open) where fairseq opens files by name from a data or model
directory: a split's ``.bin``/``.idx`` or a ``dict.*.txt`` that is a symbolic link to a file
outside the directory (index and dictionary crafted to fit) is refused, through the real
``fairseq-generate`` and ``ea-fairseq-analysis dump``, in one line naming the link; unguarded
(fairseq's own readers) the outside file's content comes out (S- lines, the dictionary
error's quote). A link that stays inside the directory loads. Principle 5 (refuse by use):
a language code fairseq-preprocess and fairseq-train accept (``sr@latin``) trains and
generates with the plugin; confinement, not a pattern of codes, keeps file names inside."""
import os
import shutil

import pytest
from fairseq import options
from fairseq.data import Dictionary

from conftest import REPO, cli, write_synthetic_corpus
from ea_fairseq import side_effects
from ea_fairseq.safety.data_files import DataFileError
from support.trained_checkpoints import USER_DIR, run, train_command

FIXTURES = os.path.join(REPO, "tests", "fixtures", "checkpoints")
SECRET = "madeupword0002 t7 madeupword0001 s0"  # what the outside split holds (words of the dictionary)
SECRET_LINE = "root-password-hunter2"  # an outside text file's line (no count: not a dictionary line)
SPLIT = "test.src-tgt.src"


def preprocess(*args):
    import logging

    from fairseq_cli import preprocess as fairseq_preprocess

    handlers = list(logging.getLogger("fairseq_cli.preprocess").handlers)
    try:
        fairseq_preprocess.main(options.get_preprocessing_parser().parse_args([*map(str, args), "--workers", "1"]))
    finally:
        for handler in logging.getLogger("fairseq_cli.preprocess").handlers:
            if handler not in handlers:
                handler.close()
        logging.getLogger("fairseq_cli.preprocess").handlers[:] = handlers


def binarized(raw, dest, source):
    """A test split of one sentence ``source`` (its target reversed), the fixtures' dictionaries."""
    raw.mkdir()
    (raw / "test.src").write_text(source + "\n")
    (raw / "test.tgt").write_text(" ".join(reversed(source.split())) + "\n")
    preprocess("--source-lang", "src", "--target-lang", "tgt", "--testpref", raw / "test", "--destdir", dest,
               "--srcdict", os.path.join(FIXTURES, "dict.src.txt"), "--tgtdict", os.path.join(FIXTURES, "dict.tgt.txt"))
    return dest


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(a model directory as fairseq's tools write it: the vanilla fixture checkpoint, its
    dictionaries, a test split; an outside folder holding a split of SECRET and a text file)."""
    root = tmp_path_factory.mktemp("confined")
    model = binarized(root / "raw", root / "model", "s1 s2 s3")
    shutil.copy(os.path.join(FIXTURES, "vanilla", "checkpoint.pt"), model / "c.pt")
    outside = binarized(root / "raw-outside", root / "outside", SECRET)
    (outside / "secret.txt").write_text(SECRET_LINE + "\n")
    return model, outside


@pytest.fixture
def model_dir(tmp_path, built, monkeypatch):
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    return shutil.copytree(built[0], tmp_path / "model", symlinks=True)


def link_split_outside(model, outside):
    """The split's data file a link to the outside split's, its index a copy of the outside one."""
    os.unlink(model / f"{SPLIT}.bin")
    os.symlink(outside / f"{SPLIT}.bin", model / f"{SPLIT}.bin")
    shutil.copy(outside / f"{SPLIT}.idx", model / f"{SPLIT}.idx")
    return model / f"{SPLIT}.bin"


def link_dictionary_outside(model, outside):
    os.unlink(model / "dict.src.txt")
    os.symlink(outside / "secret.txt", model / "dict.src.txt")
    return model / "dict.src.txt"


def generate(model, *extra):
    return run([cli("fairseq-generate"), model, "--user-dir", USER_DIR, "--path", model / "c.pt", "--gen-subset",
                "test", "--beam", "2", "--cpu", "--required-batch-size-multiple", "1", *extra], expect_ok=False,
               timeout=300)


def analysis_dump(model):
    from ea_fairseq_cli.analysis import main

    try:
        return main(["dump", str(model / "c.pt"), "--out", str(model.parent / "dump.npz")])
    except SystemExit as exit_:
        return exit_.code


def test_a_split_linked_outside_is_printed_by_fairseqs_own_reader(model_dir, built):
    """Negative control: without the plugin's check, the outside split is what fairseq reads."""
    link_split_outside(model_dir, built[1])
    load = side_effects.original("fairseq.data.data_utils:load_indexed_dataset")
    dictionary = Dictionary.load(str(built[1] / "dict.src.txt"))
    dataset = load(str(model_dir / SPLIT), dictionary)
    assert dictionary.string(dataset[0][:-1]) == SECRET


def test_a_dictionary_linked_outside_is_quoted_by_fairseqs_own_reader(model_dir, built):
    link_dictionary_outside(model_dir, built[1])
    with pytest.raises(ValueError, match=SECRET_LINE):
        Dictionary().add_from_file.__wrapped__(Dictionary(), str(model_dir / "dict.src.txt"))


def test_fairseq_generate_refuses_a_split_linked_outside(model_dir, built):
    link = link_split_outside(model_dir, built[1])
    code, out = generate(model_dir)
    assert code == 1 and SECRET not in out, out[-3000:]
    last = out.strip().splitlines()[-1]
    assert last.startswith(f"fairseq-generate: error: {link}: a link to {built[1] / (SPLIT + '.bin')}, outside "
                           f"{model_dir}"), out[-3000:]


def test_fairseq_generate_refuses_a_dictionary_linked_outside(model_dir, built):
    link = link_dictionary_outside(model_dir, built[1])
    code, out = generate(model_dir)
    assert code == 1 and SECRET_LINE not in out, out[-3000:]
    assert out.strip().splitlines()[-1].startswith(f"fairseq-generate: error: {link}: a link to "), out[-3000:]


def test_the_analysis_tool_refuses_a_dictionary_linked_outside(model_dir, built):
    link = link_dictionary_outside(model_dir, built[1])
    message = str(analysis_dump(model_dir))
    assert message.startswith(f"ea-fairseq-analysis dump: error: {link}: a link to ") and "\n" not in message
    assert SECRET_LINE not in message
    assert not (model_dir.parent / "dump.npz").exists()


def test_a_name_stepping_out_of_its_directory_is_refused(model_dir, built):
    """A language with a '/' (a checkpoint's, a command line's) puts '..' in the name fairseq
    joins to the directory: the directory it was named in is still the one it must stay in."""
    (model_dir / "dict.x").mkdir()
    stepping = model_dir / "dict.x" / ".." / ".." / os.path.relpath(built[1] / "secret.txt", model_dir.parent)
    with pytest.raises(DataFileError, match="outside"):
        Dictionary.load(str(stepping))


def test_links_inside_the_directory_load(model_dir):
    """What stays inside the directory loads, through the same fairseq-generate."""
    (model_dir / "kept").mkdir()
    for name in (f"{SPLIT}.bin", f"{SPLIT}.idx", "dict.src.txt"):
        os.replace(model_dir / name, model_dir / "kept" / name)
        os.symlink(os.path.join("kept", name), model_dir / name)
    code, out = generate(model_dir)
    assert code == 0 and "S-0\ts1 s2 s3" in out, out[-3000:]


def test_a_language_fairseq_accepts_trains_and_generates(tmp_path):
    """``sr@latin``: fairseq-preprocess and fairseq-train take it; so does fairseq-generate
    with the checkpoint the plugin's trainer wrote (the pair inferred from the file names)."""
    raw = tmp_path / "raw"
    raw.mkdir()
    write_synthetic_corpus(str(raw), sizes=(("train", 40), ("valid", 8), ("test", 4)))
    for split in ("train", "valid", "test"):
        os.replace(raw / f"{split}.src", raw / f"{split}.sr@latin")
        os.replace(raw / f"{split}.tgt", raw / f"{split}.en")
    data = tmp_path / "bin"
    preprocess("--source-lang", "sr@latin", "--target-lang", "en", "--trainpref", raw / "train", "--validpref",
               raw / "valid", "--testpref", raw / "test", "--destdir", data, "--joined-dictionary")
    run(train_command(data, "transformer_lite", tmp_path / "ck", updates=1), timeout=300)
    code, out = run([cli("fairseq-generate"), data, "--user-dir", USER_DIR, "--path", tmp_path / "ck" /
                     "checkpoint_last.pt", "--gen-subset", "test", "--beam", "2", "--cpu", "--required-batch-size-multiple", "1"],
                    expect_ok=False, timeout=300)
    assert code == 0 and "S-0\t" in out, out[-3000:]


@pytest.mark.parametrize("target", ["relative", "absolute"])
def test_an_archive_member_linked_out_of_its_folder_is_refused_by_the_hub(tmp_path, built, monkeypatch, target):
    """The same principle for the hub's archives, checked on the members' names before anything
    is written: a dictionary that is a symbolic link out of the archive's folder is refused."""
    import tarfile
    import tempfile

    from fairseq.models.transformer import TransformerModel

    from ea_fairseq.safety.archives import ArchiveError
    from test_archives import archive

    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    secret = built[1] / "secret.txt"
    link = str(secret) if target == "absolute" else "../" * 8 + str(secret).lstrip("/")
    path = archive(tmp_path / "model.tar.gz", ("model/dict.src.txt", b"", tarfile.SYMTYPE, link))
    with pytest.raises(ArchiveError, match="member 'model/dict.src.txt' is a symbolic link to .*nothing was extracted"):
        TransformerModel.from_pretrained(str(path), checkpoint_file="model.pt", user_dir=USER_DIR)
    assert os.listdir(tmp_path / "tmp") == []
