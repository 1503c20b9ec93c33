#!/usr/bin/env python3
"""Write standard input to FILE as every writer of the plugin writes (``ea_fairseq.safety.writers``):
a new file beside FILE, renamed onto it, so a link planted under FILE's name is replaced, never
written through. The recipes' redirections into a directory go through it (``ea_write`` in
examples/translation/common.sh):

    cmd | python scripts/safe_write.py FILE             # for  cmd > FILE
    cmd | python scripts/safe_write.py --append FILE    # for  cmd >> FILE

``--append`` starts the new file with FILE's content: FILE is then absent or a regular file; a
link or anything else is refused in one line (exit 1), FILE left as it is.
"""
import argparse
import errno
import importlib.util
import os
import shutil
import stat
import sys


def writers():
    """ea_fairseq/safety/writers.py itself (standard library only): importing the package
    ``ea_fairseq`` would load fairseq and torch."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ea_fairseq", "safety",
                        "writers.py")
    spec = importlib.util.spec_from_file_location("ea_fairseq_safety_writers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file")
    parser.add_argument("--append", action="store_true", help="after FILE's content (a regular file)")
    args = parser.parse_args(argv)
    try:
        with writers().replaced(args.file) as out:
            if args.append:
                append_from(args.file, out)
            shutil.copyfileobj(sys.stdin.buffer, out)
    except OSError as err:
        print(f"safe_write.py: error: {args.file}: {err.strerror or err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
