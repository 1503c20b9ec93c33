#!/usr/bin/env python3
"""Write standard input to FILE as every writer of the plugin writes (``ea_fairseq.safety.writers``):
a new file beside FILE, renamed onto it, so a link planted under FILE's name is replaced, never
written through. The recipes' redirections into a directory go through it (``ea_write`` in
examples/translation/common.sh):

    cmd | python scripts/safe_write.py FILE             # for  cmd > FILE
    cmd | python scripts/safe_write.py --append FILE    # for  cmd >> FILE
    python scripts/safe_write.py --from SRC FILE        # for  cp SRC FILE  (SRC a received file)
    python scripts/safe_write.py --within DIR FILE      # FILE's directory resolves inside DIR
    python scripts/safe_write.py --within DIR --check D # D resolves inside DIR (nothing written)

``--append`` starts the new file with FILE's content: FILE is then absent or a regular file; a
link or anything else is refused in one line (exit 1), FILE left as it is. ``--from SRC`` copies
SRC instead of standard input, SRC read as every received file is (``ea_fairseq.safety.confined``):
a regular file inside its own directory, a link out of it refused. ``--within DIR`` refuses a
FILE whose directory, links followed, is not inside DIR (a received run's ``eval`` linked
elsewhere): a directory's outputs stay in it.
"""
import argparse
import errno
import importlib
import os
import shutil
import stat
import sys


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def safety():
    """The plugin's read and write primitives (``ea_fairseq_cli._safety``: ea_fairseq/safety's
    modules, standard library only), from this repository: importing the package ``ea_fairseq``
    would load fairseq and torch."""
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    return importlib.import_module("ea_fairseq_cli._safety")


def append_from(path, out) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, "a link: not appended to") from None
        raise
    with open(fd, "rb") as old:
        if not stat.S_ISREG(os.fstat(old.fileno()).st_mode):
            raise OSError(errno.EINVAL, "not a regular file: not appended to")
        shutil.copyfileobj(old, out)


def read_from(path: str, safe):
    """``path`` opened as a received file: a regular file inside its own directory."""
    try:
        return safe.open_inside(path, os.path.dirname(path) or ".")
    except OSError as err:
        raise safe.ConfinedPathError(f"{path}: {err.strerror or err}") from None


def outside(path: str, directory: str):
    """Where ``path`` leads, links followed, when that is outside ``directory``'s real path
    (one line); None when it is inside. The recipes' one test of "inside a run"."""
    top, real = os.path.realpath(directory), os.path.realpath(path)
    if os.path.commonpath([top, real]) == top:
        return None
    shown = lambda p: p if p.isprintable() else ascii(p)  # noqa: E731  (one line, whatever the name)
    return f"{shown(path)} resolves to {shown(real)}, outside the run {shown(top)}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file")
    parser.add_argument("--append", action="store_true", help="after FILE's content (a regular file)")
    parser.add_argument("--from", dest="source", metavar="SRC",
                        help="copy SRC, a regular file inside its own directory, instead of standard input")
    parser.add_argument("--within", metavar="DIR", help="refuse unless FILE's directory resolves inside DIR")
    parser.add_argument("--check", action="store_true",
                        help="with --within: write nothing; FILE (a directory) outside DIR is printed as where it "
                             "leads, exit 1")
    args = parser.parse_args(argv)
    if args.check:
        where = outside(args.file, args.within or parser.error("--check takes --within DIR"))
        print(where or "", end="\n" if where else "")
        return 1 if where else 0
    safe = safety()
    try:
        where = args.within and outside(os.path.dirname(args.file) or ".", args.within)
        if where:
            raise safe.ConfinedPathError(f"{where}: a run's outputs are written only inside it; remove the link "
                                         "(or give the output directory itself)")
        source = sys.stdin.buffer if args.source is None else read_from(args.source, safe)
        with source, safe.replaced(args.file) as out:
            if args.append:
                append_from(args.file, out)
            shutil.copyfileobj(source, out)
    except safe.ConfinedPathError as err:
        print(f"safe_write.py: error: {err}", file=sys.stderr)
        return 1
    except OSError as err:
        print(f"safe_write.py: error: {args.file}: {err.strerror or err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
