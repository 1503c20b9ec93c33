"""The files a tool's command line names, checked before the tool does any work.

A missing input, a folder given for a file, or an output whose folder does not exist ends
the tool at once with one line, ``PROGRAM: error: ...``, that names the argument and what to
give instead (exit status 1), instead of a traceback from ``open()`` after minutes of work.
Pure checks of the file system: no torch, no fairseq.
"""
import os
import shlex
from typing import Iterable, Optional


def refusal(program: str, message: str) -> SystemExit:
    """The exception that ends ``program`` with ``message`` as one line on stderr."""
    return SystemExit(f"{program}: error: {message}")


def need_file(program: str, path: Optional[str], what: str) -> None:
    """``path`` is a readable file; ``what`` says what it should be, e.g. "the output of
    fairseq-generate"."""
    if path is None:
        return
    if os.path.isdir(path):
        raise refusal(program, f"{path} is a folder; give {what}")
    if not os.path.exists(path):
        raise refusal(program, f"{path}: no such file; give {what}")
    if not os.access(path, os.R_OK):
        raise refusal(program, f"{path}: not readable (permissions); give {what}")


def need_files(program: str, paths: Iterable[str], what: str) -> None:
    for path in paths or ():
        need_file(program, path, what)


def need_folder(program: str, path: Optional[str], what: str) -> None:
    """``path`` is an existing folder."""
    if path is not None and not os.path.isdir(path):
        problem = "not a folder" if os.path.exists(path) else "no such folder"
        raise refusal(program, f"{path}: {problem}; give {what}")


def need_output_folder(program: str, option: str, path: Optional[str]) -> None:
    """The folder an output named by ``option`` (a file or a prefix) goes to exists."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(folder):
        return
    problem = "is not a folder" if os.path.exists(folder) else "does not exist"
    raise refusal(program, f"{option} {path}: the folder {folder} {problem}; create it "
                           f"(mkdir -p {shlex.quote(folder)}) or give a path in an existing folder")


def need_creatable_output_folder(program: str, option: str, path: Optional[str]) -> None:
    """The folder an output named by ``option`` goes to exists or can be made: the nearest of
    its folders that exists is a folder (the tool makes the others, ``mkdir -p``, when it writes)."""
    if path is None:
        return
    existing = os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise refusal(program, f"{option} {path}: {existing} is not a folder; give a path in a folder")
