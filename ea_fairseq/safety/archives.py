"""Model and data archives for fairseq's hub, extracted only where they belong.

``from_pretrained("model.tar.gz")`` (and a ``data_name_or_path`` archive) goes through
``fairseq.file_utils.load_archive_file``, which runs ``tarfile.extractall()`` without a
filter: a member named ``../x`` or ``/x`` is written anywhere the process may write (e.g. a
``.py`` into a ``--user-dir`` package's ``models/``, which fairseq imports in the same call),
a symbolic link leads later members outside, and a device or FIFO member is created. It then
deletes the user's archive and moves the extracted directory to its name.

:func:`archive_loader` replaces that function: every member is checked before anything
is written (:func:`check_members`): only regular files, directories and links to an earlier
regular file of the archive, no absolute name, no ``..``; then the archive is extracted with
tarfile's ``data`` filter into a fresh directory (``tempfile.mkdtemp``, removed at exit). The
archive is left in place. An archive whose files would not fit in the temporary directory's
free space (a small ``.tar.gz`` can expand to any size), of more than :data:`LIMIT_MEMBERS`
members, or a path that is not a regular file (a FIFO blocks ``open()``) is refused too. A
refusal raises :class:`ArchiveError`, one line naming the member, with nothing extracted.

Listing the members is bounded too, before tarfile reads what a header declares: tarfile
reads a GNU long name or link and a PAX extended header whole (its size field may say
gigabytes, in a few megabytes of ``.tar.gz``), so :class:`_Header` refuses one that declares
more than :data:`LIMIT_HEADER` bytes; the archive is read through :class:`_Listing`, which
refuses to read (not skip) more than :data:`LIMIT_LISTING` bytes in all while listing (chains
of headers, sparse maps); a file's contents are skipped, never read, and the running total of
the files is checked against the free space before tarfile decompresses past them.

Why a module function and not a method of the plugin's models: users load every model of
the plugin through fairseq's own ``TransformerModel.from_pretrained`` (the arch in the
checkpoint chooses the class), and fairseq's hub resolves archives before it imports a
``user_dir``; its only hook, ``hub_models()``, is a class method of fairseq's classes. The
hub looks ``load_archive_file`` up on its module at every call, so :func:`archive_loader`
replaces it there once (:mod:`ea_fairseq.side_effects`), for good (no swap and restore, so no race between threads); the replacement
never calls fairseq's extraction.
"""
import atexit
import contextlib
import bz2
import gzip
import lzma
import os
import posixpath
import shutil
import stat
import tarfile
import tempfile
import zlib
from typing import List, Optional


class ArchiveError(ValueError):
    """An archive the plugin refuses to extract; nothing of it was written."""


def _refusal(source: str, member: str, why: str) -> ArchiveError:
    return ArchiveError(
        f"{source}: refused: member {member!r} {why}; nothing was extracted. A model archive "
        "holds regular files and directories below one folder: extract one you trust yourself "
        "and pass its directory")


def _absolute(name: str) -> bool:
    return name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":")


def _inside(name: str) -> Optional[str]:
    """``name`` normalised, or None if it is absolute or climbs out (``..``)."""
    if not name or _absolute(name):
        return None
    parts = name.replace("\\", "/").split("/")
    if ".." in parts:
        return None
    return posixpath.normpath("/".join(parts))


LIMIT_MEMBERS = 10_000  # a model archive holds a few files; headers alone compress to nothing
LIMIT_HEADER = 64 * 1024  # one long name or link, or one PAX extended header
LIMIT_LISTING = 16 * 1024 * 1024  # all headers: 10,000 members with a PAX header each read 15 MB

_EXTENDED = {tarfile.GNUTYPE_LONGNAME: "GNU long name", tarfile.GNUTYPE_LONGLINK: "GNU long link",
             tarfile.XHDTYPE: "PAX extended header", tarfile.XGLTYPE: "PAX global header",
             tarfile.SOLARIS_XHDTYPE: "Solaris extended header"}


class _Refused(Exception):
    """Raised while tarfile lists the archive; :func:`extract` names the archive."""


class _Header(tarfile.TarInfo):
    """tarfile's header, refused if it declares more extended data than :data:`LIMIT_HEADER`
    (tarfile reads that data whole, right after parsing the header here)."""

    @classmethod
    def frombuf(cls, buf, encoding, errors):
        info = super().frombuf(buf, encoding, errors)
        if info.type in _EXTENDED and info.size > LIMIT_HEADER:
            raise _Refused(f"header {info.name!r} ({_EXTENDED[info.type]}) declares {info.size:,} bytes, "
                           f"more than the {LIMIT_HEADER:,} a name or extended header may hold")
        return info


_MAGIC = [(b"\x1f\x8b", lambda raw: gzip.GzipFile(fileobj=raw, mode="rb")),
          (b"BZh", lambda raw: bz2.BZ2File(raw, "rb")), (b"\xfd7zXZ\x00", lambda raw: lzma.LZMAFile(raw, "rb"))]


class _Listing:
    """The archive's tar stream (decompressed as tarfile's ``r:*`` would: gzip, bzip2, xz or
    plain). While ``left`` is set, reads (headers and their data; tarfile seeks past a file's
    contents) may take only ``left`` bytes in all; corrupt compressed data is a ReadError."""

    def __init__(self, path: str):
        self.raw = open(path, "rb")
        magic = self.raw.read(6)
        self.raw.seek(0)
        opener = next((o for m, o in _MAGIC if magic.startswith(m)), None)
        self.stream = opener(self.raw) if opener else self.raw
        self.left: Optional[int] = LIMIT_LISTING

    def _do(self, call, *args):
        try:
            return call(*args)
        except (OSError, EOFError, zlib.error, lzma.LZMAError) as err:
            raise tarfile.ReadError(f"corrupt compressed data: {err}") from None

    def read(self, size=-1):
        if self.left is not None:
            if size < 0 or size > self.left:
                raise _Refused(f"its headers hold more than {LIMIT_LISTING:,} bytes (names, extended "
                               "headers, sparse maps)")
            self.left -= size
        return self._do(self.stream.read, size)

    def seek(self, offset, whence=os.SEEK_SET):
        return self._do(self.stream.seek, offset, whence)

    def tell(self):
        return self.stream.tell()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stream.close()
        self.raw.close()


def check_members(archive: tarfile.TarFile, source: str, room: int) -> List[tarfile.TarInfo]:
    """The archive's members, each checked before anything is extracted (and before tarfile
    reads past it); the files may hold ``room`` bytes in all."""
    members, files, total = [], set(), 0
    for m in archive:
        if len(members) == LIMIT_MEMBERS:
            raise ArchiveError(f"{source}: refused: more than {LIMIT_MEMBERS:,} members; nothing was extracted")
        members.append(m)
        m.pax_headers = {}  # applied to m already; tarfile copies the global ones into every member
        name = _inside(m.name)
        if name is None:
            raise _refusal(source, m.name, "has an absolute name" if _absolute(m.name) else
                           "climbs out of the archive's folder with '..'")
        if m.sparse is not None or m.type == tarfile.GNUTYPE_SPARSE:
            raise _refusal(source, m.name, "is a sparse file")
        if m.isreg():
            files.add(name)
            total += m.size
            if total > room:
                raise ArchiveError(f"{source}: its files hold {total:,} bytes, more than the {room:,} free "
                                   f"in {tempfile.gettempdir()} (member {m.name!r} and those before it); "
                                   "nothing was extracted")
        elif m.isdir():
            continue
        elif m.issym() or m.islnk():
            target = m.linkname if m.islnk() else posixpath.join(posixpath.dirname(name), m.linkname)
            if _inside(posixpath.normpath(target)) not in files:  # (an absolute one is None)
                kind = "a symbolic link" if m.issym() else "a hard link"
                raise _refusal(source, m.name, f"is {kind} to {m.linkname!r}, not to a file stored "
                                               "before it in the archive")
        else:
            kind = ("a FIFO" if m.isfifo() else "a character device" if m.ischr() else
                    "a block device" if m.isblk() else f"of tar type {m.type!r}")
            raise _refusal(source, m.name, f"is {kind}, not a file or directory")
    return members


def _top(members: List[tarfile.TarInfo]) -> str:
    """The one folder every member lies in (fairseq's archives' layout), or ''."""
    firsts = {_inside(m.name).split("/")[0] for m in members}
    if len(firsts) != 1:
        return ""
    top = firsts.pop()
    if top in (".", "") or any(m.name.rstrip("/") == top and not m.isdir() for m in members):
        return ""
    return top


def _remove_at_exit(directory: str) -> None:
    atexit.register(shutil.rmtree, directory, ignore_errors=True)


@contextlib.contextmanager
def _listed(source: str):
    """:class:`_Refused` (and a chain of headers deeper than Python's stack) as one line."""
    try:
        yield
    except _Refused as err:
        raise ArchiveError(f"{source}: refused: {err}; nothing was extracted. A model archive holds "
                           "regular files and directories below one folder: extract one you trust "
                           "yourself and pass its directory") from None
    except RecursionError:
        raise ArchiveError(f"{source}: refused: a chain of extended headers deeper than Python's "
                           "stack; nothing was extracted") from None


def extract(path: str, source: Optional[str] = None) -> str:
    """Extract the tar archive ``path`` into a fresh directory; returns its top folder."""
    source = source or path
    if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO would block tarfile's open()
        raise ArchiveError(f"{source}: not a model directory nor a regular file")
    try:
        stream = _Listing(path)
    except OSError as err:
        raise ArchiveError(f"{source}: cannot be read ({err.strerror})") from None
    with stream, _listed(source):
        try:
            archive = tarfile.open(fileobj=stream, mode="r:", tarinfo=_Header)
        except tarfile.TarError:
            raise ArchiveError(f"{source}: not a model directory nor a tar archive (plain, gzip, bzip2 "
                               "or xz): give from_pretrained the folder holding the checkpoint") from None
        with archive:
            try:
                members = check_members(archive, source, shutil.disk_usage(tempfile.gettempdir()).free)
            except tarfile.TarError as err:
                raise ArchiveError(f"{source}: corrupt tar archive ({err})") from None
            stream.left = None  # listed: extraction reads the files' contents
            destination = tempfile.mkdtemp(prefix="ea_fairseq_archive_")
            _remove_at_exit(destination)
            try:
                archive.extractall(destination, members=members, filter="data")
            except (tarfile.TarError, OSError) as err:
                shutil.rmtree(destination, ignore_errors=True)
                raise ArchiveError(f"{source}: could not be extracted ({err})") from None
    return os.path.join(destination, _top(members))


def archive_loader(fairseq_load_archive_file):
    """fairseq's ``file_utils.load_archive_file`` (``fairseq_load_archive_file``), with
    :func:`extract` for archives (installed by :mod:`ea_fairseq.side_effects`)."""

    def load_archive_file(archive_file):
        """An archive extracted by :func:`extract`; a directory (or URL already cached as one)
        returned as is, a missing path as fairseq reports it (None, logged)."""
        from fairseq import file_utils

        try:
            resolved = file_utils.cached_path(archive_file, cache_dir=None)
        except EnvironmentError:
            resolved = None
        if resolved is None or os.path.isdir(resolved):
            return fairseq_load_archive_file(archive_file)  # no extraction on these paths
        return extract(resolved, str(archive_file))

    return load_archive_file
