"""Model and data archives through fairseq's hub (``from_pretrained`` on a ``.tar.gz``), with
the plugin imported first: hostile members are refused before anything is written, a sound
archive loads and translates as its directory does and is left in place. Negative controls:
fairseq's own extraction writes every one of those members outside its folder, and, without
the plugin, a ``.py`` planted in a ``user_dir``'s ``models/`` runs in the same call."""
import gzip
import hashlib
import io
import os
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
import textwrap

import pytest
from fairseq.models.transformer import TransformerModel
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from ea_fairseq import side_effects
from ea_fairseq.safety import archives
from support.trained_checkpoints import ENV, USER_DIR, family_checkpoints


def add(tar, name, data=b"", kind=tarfile.REGTYPE, linkname=""):
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = kind, linkname, 0o644
    if kind == tarfile.REGTYPE:
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    else:
        tar.addfile(info)


def archive(path, *members):
    """A .tar.gz holding ``model/model.pt`` and then ``members`` ((name, data, kind, link) tuples)."""
    with tarfile.open(path, "w:gz") as tar:
        add(tar, "model", kind=tarfile.DIRTYPE)
        add(tar, "model/model.pt", b"not read")
        for member in members:
            add(tar, *member)
    return path


def hostile(outside):
    """attack -> (members, what fairseq's extraction creates outside its folder). The
    extraction folder is a fresh directory in ``outside/tmp`` (``tempfile.tempdir``)."""
    victim = outside / "victim.txt"
    return {
        "dotdot": ([("model/../../../planted.py", b"PWNED")], outside / "planted.py"),
        "absolute": ([(str(outside / "absolute.py"), b"PWNED")], outside / "absolute.py"),
        "symlink-out": ([("model/out", b"", tarfile.SYMTYPE, str(outside)),
                         ("model/out/through_link.py", b"PWNED")], outside / "through_link.py"),
        "hardlink-out": ([("model/h", b"", tarfile.LNKTYPE, str(victim)), ("model/h", b"PWNED")], victim),
        # a FIFO for a dictionary: reading it hangs (fairseq moves its folder to the archive's name)
        "fifo": ([("model/dict.src.txt", b"", tarfile.FIFOTYPE)], outside / "model.tar.gz" / "dict.src.txt"),
        "device": ([("model/dev", b"", tarfile.CHRTYPE)], None),  # inside; created only as root
    }


ATTACKS = ["dotdot", "absolute", "symlink-out", "hardlink-out", "fifo", "device"]
SHOWN = {"dotdot": "climbs out of the archive's folder with '..'", "absolute": "absolute name",
         "symlink-out": "a symbolic link",
         "hardlink-out": "a hard link", "fifo": "a FIFO", "device": "a character device"}


@pytest.fixture
def outside(tmp_path, monkeypatch):
    """A folder standing for 'anywhere': extraction folders are made in outside/tmp."""
    (tmp_path / "tmp").mkdir()
    (tmp_path / "victim.txt").write_text("intact")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    return tmp_path


def listing(root):
    return sorted(os.path.relpath(os.path.join(d, n), root) for d, dirs, files in os.walk(root)
                  for n in dirs + files)


@pytest.mark.parametrize("attack", [a for a in ATTACKS if a != "device"])
def test_fairseqs_own_extraction_writes_outside(outside, attack):
    """Negative control: fairseq's ``load_archive_file`` writes each member outside its
    folder (in this test's temporary directory), and deletes the user's archive."""
    members, target = hostile(outside)[attack]
    path = archive(outside / "model.tar.gz", *members)
    try:
        side_effects.original("fairseq.file_utils:load_archive_file")(str(path))
    except OSError:  # (for some, fairseq's moving of the folder fails afterwards)
        pass
    if attack == "fifo":
        assert stat.S_ISFIFO(os.lstat(target).st_mode)
    else:
        assert target.read_bytes() == b"PWNED"
    assert not path.is_file()  # fairseq deleted the archive


@pytest.mark.parametrize("which", ["model", "data"])
@pytest.mark.parametrize("attack", ATTACKS)
def test_hostile_members_are_refused_by_the_hub(outside, attack, which):
    members, _ = hostile(outside)[attack]
    path = archive(outside / "hostile.tar.gz", *members)
    before = listing(outside)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    model, data = (str(path), ".") if which == "model" else (str(outside), str(path))
    with pytest.raises(archives.ArchiveError) as refusal:
        TransformerModel.from_pretrained(model, checkpoint_file="model.pt", data_name_or_path=data,
                                         user_dir=USER_DIR)
    message = str(refusal.value)
    assert "\n" not in message and message.startswith(f"{path}: refused: member ")
    assert SHOWN[attack] in message and "nothing was extracted" in message
    assert listing(outside) == before  # nothing written anywhere, not even an empty folder
    assert (outside / "victim.txt").read_text() == "intact"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == digest  # the archive is kept


@pytest.mark.parametrize("links", [False, True])
def test_a_sound_archive_loads_and_translates_as_its_directory(tmp_path_factory, tiny_data_bin, outside, links):
    """Links to a file stored before them are extracted (inside the fresh folder)."""
    checkpoint = family_checkpoints(tmp_path_factory, tiny_data_bin)["ea"]
    path = outside / "ea.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        tar.add(checkpoint, "ea_model/model.pt")
        for name in ("dict.src.txt", "dict.tgt.txt"):
            tar.add(os.path.join(tiny_data_bin, name), f"ea_model/{name}")
        if links:
            add(tar, "ea_model/best.pt", kind=tarfile.SYMTYPE, linkname="model.pt")
            add(tar, "ea_model/sub", kind=tarfile.DIRTYPE)
            add(tar, "ea_model/sub/last.pt", kind=tarfile.LNKTYPE, linkname="ea_model/model.pt")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    langs = dict(source_lang="src", target_lang="tgt", user_dir=USER_DIR)
    hub = TransformerModel.from_pretrained(str(path), checkpoint_file="model.pt", **langs)
    reference = TransformerModel.from_pretrained(str(checkpoint.parent), checkpoint_file=checkpoint.name,
                                                 data_name_or_path=tiny_data_bin, **langs)
    sentences = ["s1 s2 s3", "s4 s5 s6 s7"]
    assert hub.translate(sentences, beam=2) == reference.translate(sentences, beam=2)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == digest  # the archive is kept
    # the archive went into one fresh folder of its own (other temporary files the load
    # makes, e.g. fairseq's, may sit beside it)
    [folder] = [name for name in os.listdir(outside / "tmp") if name.startswith("ea_fairseq_archive_")]
    if links:
        extracted = outside / "tmp" / folder / "ea_model"
        assert (extracted / "best.pt").read_bytes() == (extracted / "sub" / "last.pt").read_bytes() \
            == checkpoint.read_bytes()


def test_an_archive_larger_than_the_free_space_is_refused_unwritten(outside, monkeypatch):
    """(A .tar.gz of kilobytes can hold gigabytes of zeros.) The free space is made small here."""
    path = archive(outside / "bomb.tar.gz", ("model/zeros.bin", bytes(100_000)))
    assert path.stat().st_size < 1000
    usage = shutil.disk_usage(outside)
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage._replace(free=50_000))
    with pytest.raises(archives.ArchiveError, match=r"hold 100,008 bytes, more than the 50,000 free in "):
        TransformerModel.from_pretrained(str(path), user_dir=USER_DIR)
    assert os.listdir(outside / "tmp") == []


def test_a_fifo_or_too_many_members_are_refused_unread(outside):
    os.mkfifo(outside / "fifo.tar.gz")  # tarfile would wait in open() for a writer
    with pytest.raises(archives.ArchiveError, match="not a model directory nor a regular file"):
        TransformerModel.from_pretrained(str(outside / "fifo.tar.gz"), user_dir=USER_DIR)
    path = archive(outside / "many.tar.gz", *((f"model/{i}", b"") for i in range(archives.LIMIT_MEMBERS)))
    with pytest.raises(archives.ArchiveError, match="more than 10,000 members; nothing was extracted"):
        TransformerModel.from_pretrained(str(path), user_dir=USER_DIR)
    assert os.listdir(outside / "tmp") == []


def header_bomb(path, kind):
    """A .tar.gz of about a kilobyte whose first header (a GNU long name or a PAX extended
    header) declares 3 GiB of data; the stream ends after 1 MiB of it."""
    bomb = tarfile.TarInfo("././@LongLink")
    bomb.type, bomb.size = kind, 3 << 30
    with gzip.open(path, "wb") as stream:
        stream.write(bomb.tobuf(format=tarfile.GNU_FORMAT) + b"a" * (1 << 20))
    return path


BOUNDED = textwrap.dedent("""
    import resource, sys, tarfile
    if sys.argv[2] == "plugin":
        import ea_fairseq  # noqa: F401
        from fairseq.models.transformer import TransformerModel
    status = open("/proc/self/status").read()
    room = int(status.split("VmSize:")[1].split()[0]) * 1024 + (1 << 30)  # 1 GiB above the imports
    resource.setrlimit(resource.RLIMIT_AS, (room, room))
    try:
        if sys.argv[2] == "plugin":
            TransformerModel.from_pretrained(sys.argv[1], user_dir=sys.argv[3])
        else:
            tarfile.open(sys.argv[1]).getmembers()
    except Exception as err:  # MemoryError included
        print(f"{type(err).__name__}: {err}")
""")


@pytest.mark.parametrize("kind,shown", [(tarfile.GNUTYPE_LONGNAME, "GNU long name"),
                                        (tarfile.XHDTYPE, "PAX extended header")])
def test_a_header_declaring_gigabytes_is_refused_before_it_is_read(tmp_path, kind, shown):
    """Negative control: tarfile alone tries to read the declared 3 GiB while listing (a
    MemoryError under 1 GiB more than the imports take). Through the hub after ``import
    ea_fairseq``, under the same limit: one line naming the header, nothing extracted."""
    (tmp_path / "tmp").mkdir()
    path = header_bomb(tmp_path / "bomb.tar.gz", kind)
    assert path.stat().st_size < 10_000
    env = dict(ENV, TMPDIR=str(tmp_path / "tmp"))
    runs = {mode: subprocess.run([sys.executable, "-c", BOUNDED, str(path), mode, USER_DIR], capture_output=True,
                                 text=True, env=env, timeout=120) for mode in ("tarfile", "plugin")}
    assert runs["tarfile"].stdout.startswith("MemoryError"), runs["tarfile"].stdout + runs["tarfile"].stderr
    out = runs["plugin"].stdout
    assert out.startswith(f"ArchiveError: {path}: refused: header '././@LongLink' ({shown}) declares "
                          "3,221,225,472 bytes, more than the 65,536"), out + runs["plugin"].stderr
    assert out.count("\n") == 1 and "nothing was extracted" in out and "extract one you trust" in out
    assert os.listdir(tmp_path / "tmp") == [] and path.is_file()


def test_headers_read_while_listing_are_bounded_in_all(outside, monkeypatch):
    """Names and extended headers each under the per-header bound still count towards the
    archive's total (chains of headers, sparse maps): made small here, a sound archive whose
    long names exceed it is refused while listing."""
    path = archive(outside / "names.tar.gz", *((f"model/{'n' * 3000}{i}", b"") for i in range(4)))
    monkeypatch.setattr(archives, "LIMIT_LISTING", 10_000)
    with pytest.raises(archives.ArchiveError, match=r"refused: its headers hold more than 10,000 bytes") as err:
        TransformerModel.from_pretrained(str(path), user_dir=USER_DIR)
    assert "\n" not in str(err.value) and os.listdir(outside / "tmp") == []


def test_a_file_larger_than_the_free_space_is_refused_before_it_is_skipped(outside):
    """A header declaring a petabyte, then the stream ends: refused from its size while
    listing, not decompressed past (that would end in a corrupt-archive error)."""
    path = outside / "huge.tar.gz"
    huge = tarfile.TarInfo("model/huge.bin")
    huge.size = 1 << 50
    with gzip.open(path, "wb") as stream:
        stream.write(huge.tobuf(format=tarfile.GNU_FORMAT) + bytes(1 << 20))
    with pytest.raises(archives.ArchiveError, match=r"hold 1,125,899,906,842,624 bytes, more than the .* "
                                                    r"\(member 'model/huge.bin' and those before it\)"):
        TransformerModel.from_pretrained(str(path), user_dir=USER_DIR)
    assert os.listdir(outside / "tmp") == []


def test_a_sparse_member_is_refused(outside):
    path = outside / "sparse.tar"
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        add(tar, "model/sparse.bin", b"x" * 10, kind=tarfile.GNUTYPE_SPARSE)
    with pytest.raises(archives.ArchiveError, match=r"member 'model/sparse.bin' is a sparse file"):
        TransformerModel.from_pretrained(str(path), user_dir=USER_DIR)


def test_a_file_that_is_not_an_archive_is_one_line(outside):
    (outside / "model.pt").write_bytes(b"\x80\x02not a tar")
    with pytest.raises(archives.ArchiveError, match=r"not a model directory nor a tar archive") as err:
        TransformerModel.from_pretrained(str(outside / "model.pt"), user_dir=USER_DIR)
    assert "\n" not in str(err.value)


PLANT = textwrap.dedent("""
    import sys, tempfile
    tempfile.tempdir = sys.argv[1] + "/tmp"
    if sys.argv[3] == "plugin-first":
        import ea_fairseq  # noqa: F401
    from fairseq.models.transformer import TransformerModel
    try:
        TransformerModel.from_pretrained(sys.argv[2], user_dir=sys.argv[1] + "/victim_plugin")
    except Exception as err:
        print(f"{type(err).__name__}: {err}")
""")


@pytest.mark.parametrize("mode", ["fairseq-alone", "plugin-first"])
def test_a_module_planted_in_a_user_dirs_models_runs_only_without_the_plugin(tmp_path, mode):
    """The archive writes ``victim_plugin/models/evil.py`` (a temporary stand-in for the
    plugin's package); fairseq imports every module of a ``user_dir``'s ``models/`` in the
    same ``from_pretrained`` call. With ``import ea_fairseq`` first: refused, nothing written."""
    (tmp_path / "tmp").mkdir()
    plugin = tmp_path / "victim_plugin"
    (plugin / "models").mkdir(parents=True)
    (plugin / "__init__.py").write_text("")
    marker = tmp_path / "ran"
    evil = f"open({str(marker)!r}, 'w').write('code ran')\n".encode()
    path = archive(tmp_path / "pretrained.tar.gz", ("model/../../../victim_plugin/models/evil.py", evil))
    proc = subprocess.run([sys.executable, "-c", PLANT, str(tmp_path), str(path), mode],
                          capture_output=True, text=True, env=ENV, timeout=120)
    if mode == "fairseq-alone":
        assert marker.read_text() == "code ran" and (plugin / "models" / "evil.py").exists()
    else:
        assert not marker.exists() and not (plugin / "models" / "evil.py").exists()
        assert path.is_file() and os.listdir(tmp_path / "tmp") == []
        assert proc.stdout.strip().startswith(f"ArchiveError: {path}: refused: member "), proc.stdout + proc.stderr


SEGMENTS = ["model"] * 4 + ["a"] * 2 + ["model.pt"] * 3 + ["..", ".", ""]  # mostly sound names
KINDS = [tarfile.REGTYPE] * 3 + [tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.FIFOTYPE]


@st.composite
def hostile_archives(draw):
    def name():
        lead = draw(st.sampled_from(["", "", "", "/", "./"]))
        return lead + "/".join(draw(st.lists(st.sampled_from(SEGMENTS), min_size=1, max_size=4)))

    return [(name(), draw(st.sampled_from(KINDS)), draw(st.one_of(st.just("OUTSIDE"), st.just(""), st.builds(
        lambda: name())))) for _ in range(draw(st.integers(1, 6)))]


@settings(max_examples=150, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(members=hostile_archives())
# sound, in two top folders (not one model folder): every run extracts one such archive
@example(members=[("model/model.pt", tarfile.REGTYPE, ""), ("a/model.pt", tarfile.REGTYPE, "")])
def test_any_archive_is_refused_or_extracted_inside_a_fresh_folder(tmp_path_factory, members):
    """Names of '..', '.', '' and absolute parts, links and FIFOs in any order: either one
    refusal with nothing written, or every path created lies inside the fresh folder."""
    root = tmp_path_factory.mktemp("any")
    (root / "tmp").mkdir()
    path = root / "a.tar"
    with tarfile.open(path, "w") as tar:
        for name, kind, link in members:
            add(tar, name, b"x", kind, str(root) if link == "OUTSIDE" else link)
    before = listing(root)
    old, tempfile.tempdir = tempfile.tempdir, str(root / "tmp")
    try:
        folder = archives.extract(str(path))
    except archives.ArchiveError as err:
        event("refused")
        assert "\n" not in str(err) and listing(root) == before
        return
    finally:
        tempfile.tempdir = old
    event("extracted")
    [fresh] = os.listdir(root / "tmp")
    fresh = os.path.realpath(root / "tmp" / fresh)
    assert os.path.realpath(folder).startswith(fresh)
    assert [p for p in listing(root) if not p.startswith("tmp" + os.sep)] == before
    for directory, dirs, files in os.walk(fresh):
        for entry in dirs + files:
            full = os.path.join(directory, entry)
            assert os.path.realpath(full).startswith(fresh + os.sep), full
            assert stat.S_ISREG(os.lstat(full).st_mode) or os.path.isdir(full) or os.path.islink(full)
