"""Principle 2, confine every open: a path read from a received directory, or named inside a
received file, resolves (links followed) to a regular file inside that directory, and is opened
so that a link swapped in afterwards is not followed.

:func:`inside` is the check, :func:`open_inside` the open; every reader of a received file calls
one of them: fairseq's dataset, dictionary and BPE readers and the hub (through the replacements
of :mod:`ea_fairseq.side_effects`), the plugin's tools (``scores.json`` and the files it names,
attention dumps, training logs).
"""
import os
import stat
from typing import IO, Optional

from ..errors import OptionError


class ConfinedPathError(OptionError):
    """A received path that leaves its directory, or is not a regular file."""


def _shown(path) -> str:
    path = os.fspath(path)
    return path if isinstance(path, str) and path.isprintable() else repr(path)


def _kind(mode: int) -> str:
    return ("a FIFO" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "a directory" if stat.S_ISDIR(mode) else "a socket" if stat.S_ISSOCK(mode) else "not a file")


def inside(path, root=None) -> str:
    """The real path of ``path``: links followed, a regular file inside ``root`` (None: the
    directory ``path`` is named in); else :class:`ConfinedPathError` naming both. A missing file
    raises ``FileNotFoundError``, as ``open`` would."""
    path = os.fspath(path)
    top = os.path.realpath(root if root is not None else (os.path.dirname(path) or "."))
    real = os.path.realpath(path)
    if os.path.commonpath([top, real]) != top:
        raise ConfinedPathError(f"{_shown(path)}: a link to {_shown(real)}, outside {_shown(top)}: a received "
                                "directory's files are read only from inside it; copy the file there instead")
    mode = os.stat(real).st_mode
    if not stat.S_ISREG(mode):
        raise ConfinedPathError(f"{_shown(path)}: is {_kind(mode)}, not a regular file: give the file itself")
    return real


def open_inside(path, root=None, mode: str = "rb", limit: Optional[int] = None, **kwargs) -> IO:
    """``open(path, mode)`` of a file that :func:`inside` accepts, opened without following a
    link swapped in since (``O_NOFOLLOW``, non-blocking, the opened file's identity compared with
    the checked one's); at most ``limit`` bytes where given."""
    if any(c in mode for c in "wax+"):
        raise ValueError("open_inside reads; writes go through ea_fairseq.safety.writers")
    real = inside(path, root)
    checked = os.stat(real)
    fd = os.open(real, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
                 | getattr(os, "O_CLOEXEC", 0))
    try:
        opened = os.fstat(fd)
        if (opened.st_dev, opened.st_ino) != (checked.st_dev, checked.st_ino) or not stat.S_ISREG(opened.st_mode):
            raise ConfinedPathError(f"{_shown(path)}: changed while it was opened: read it again from a "
                                    "directory nobody else writes to")
        if limit is not None and opened.st_size > limit:
            raise ConfinedPathError(f"{_shown(path)}: {opened.st_size:,} bytes, more than the {limit:,} this "
                                    "kind of file may have")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return open(fd, mode, **kwargs)
    except BaseException:
        os.close(fd)
        raise


def stored_bytes(path, size: int) -> int:
    """The bytes of the ``size`` that ``path`` declares which it stores from its start: up to
    its first hole (a sparse file declares its size in no space); ``size`` on a file system that
    cannot say."""
    if size == 0 or not hasattr(os, "SEEK_HOLE"):
        return size
    with open(path, "rb") as f:
        try:
            return min(size, os.lseek(f.fileno(), 0, os.SEEK_HOLE))
        except OSError:
            return size
