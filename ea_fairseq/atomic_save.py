"""Write a checkpoint the plugin's tools produce without following anything planted.

The file is written to a new temporary file that :func:`tempfile.mkstemp` creates in the
output's directory (``O_CREAT | O_EXCL``: an existing name, a symbolic link included, is
never opened), then renamed over the output with :func:`os.replace`, which replaces a link
named like the output instead of writing through it. A reader sees the old file or the
whole new one; a failed write leaves no temporary file behind. The file gets the mode a
plain ``open()`` would give it (0666 less the umask), not mkstemp's 0600.
"""
import os
import tempfile


def save(state, path: str) -> None:
    """``torch.save(state)`` to ``path`` through a fresh temporary file in its directory."""
    import torch

    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        umask = os.umask(0o022)  # read it (the tools that call this are single-threaded)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
