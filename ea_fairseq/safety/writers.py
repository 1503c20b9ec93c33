"""Principle 4, every writer is safe: every output into a directory goes to a new temporary file
(``O_EXCL``, in the destination's directory) renamed into place, so a link planted under the
output's name is replaced, never written through.

:func:`replaced` is the one writer; fairseq's checkpoint saver and the plugin's tools write
through it, and the recipes' shell redirections through ``scripts/safe_write.py``.
"""
import contextlib
import os
import tempfile
from typing import IO, Iterator


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def replaced(path, mode: str = "wb", **kwargs) -> Iterator[IO]:
    """A file object on a new file beside ``path`` (created exclusively, never through a link),
    renamed onto ``path`` when the block ends without an error, removed when it raises."""
    path = os.fspath(path)
    directory, name = os.path.split(path)
    fd, tmp = tempfile.mkstemp(dir=directory or ".", prefix=f".{name}.", suffix=".tmp")  # O_EXCL | O_NOFOLLOW
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with open(fd, mode, **kwargs) as f:
            yield f
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_bytes(path, data: bytes) -> None:
    with replaced(path, "wb") as f:
        f.write(data)


def write_text(path, text: str) -> None:
    with replaced(path, "w", encoding="utf-8") as f:
        f.write(text)
