"""Building the CPU backend's C++ extension (``csrc/``) ahead of any forward pass:

    python -m ea_ops.build [--verbose]   # compile it (a minute or so on one core), or find it up to date

``scripts/setup_env.sh`` and ``scripts/test.sh`` run it. ``torch.utils.cpp_extension``
compiles with the machine's C++ compiler and ``ninja`` in a child process, whose PATH, not
this process's, has pip's ``ninja`` (the Python environment's ``bin``, on no PATH where the
environment is not activated), into the directory :mod:`ea_ops.library` loads from.
"""
import os
import shutil
import subprocess
import sys
from typing import List, Optional

from . import library


class BuildError(RuntimeError):
    """The extension could not be compiled (no compiler, no ninja, a compile error)."""


def build_environment() -> dict:
    """This process's environment, with pip's ``ninja`` (if installed) first on PATH."""
    env = dict(os.environ)
    try:
        import ninja

        env["PATH"] = os.pathsep.join([ninja.BIN_DIR, env.get("PATH", "")])
    except ImportError:  # a system ninja, on PATH or missing
        pass
    return env


def build(verbose: bool = False) -> str:
    """Compile the extension of this copy's sources, or find it up to date; returns the
    library's path, or raises :class:`BuildError`. A library built before is checked by
    ninja alone (its build file is torch's, in the library's directory); a first build
    runs torch's in a child process."""
    name = library.extension_name()
    directory = library.build_directory(name)
    path = os.path.join(directory, name + library.LIBRARY_SUFFIX)
    if os.path.isfile(path) and library.cut_short(path):  # newer than its sources, to ninja
        os.remove(path)
    env = build_environment()
    ninja = shutil.which("ninja", path=env.get("PATH"))
    built = os.path.isfile(path) and os.path.isfile(os.path.join(directory, "build.ninja"))
    compiler = env.get("CXX", "c++")  # torch's choice of compiler, needed where nothing is built yet
    for tool, found in (("no ninja", ninja),
                        (f"no C++ compiler: {compiler}", built or shutil.which(compiler, path=env.get("PATH")))):
        if not found:
            raise BuildError(f"the CPU backend did not build ({tool} not found); {NEEDS}")
    if built:
        proc = subprocess.run([ninja, "-C", directory], env=env, capture_output=not verbose, text=True)
    else:
        code = ("import sys; sys.path.insert(0, sys.argv[1]); from ea_ops import build; "
                "build.compile_here(sys.argv[2], sys.argv[3], sys.argv[4] == '1')")
        proc = subprocess.run([sys.executable, "-c", code, os.path.dirname(library.HERE), name, directory,
                               "1" if verbose else "0"], env=env, capture_output=not verbose, text=True)
    if proc.returncode != 0 or not os.path.isfile(path):
        raise BuildError(f"the CPU backend did not build ({telling((proc.stderr or '') + (proc.stdout or ''))}); {NEEDS}")
    return path


def telling(output: str) -> str:
    """The line of a failed build that says why: the first error, else the last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    reasons = [line for line in lines if any(word in line for word in TELLING)]
    return (reasons or lines or ["see the output above"])[0 if reasons else -1]


TELLING = ("error:", "not found", "No such file", "is required")
NEEDS = "it needs a C++ compiler and ninja (pip install ninja)"


def compile_here(name: str, directory: str, verbose: bool) -> None:
    """The child process of :func:`build`: torch compiles (or finds up to date) and loads."""
    from torch.utils.cpp_extension import load

    # copies: torch appends its own flags to the lists it is given
    load(name=name, sources=library.SOURCES, extra_cflags=list(library.CFLAGS),
         extra_ldflags=list(library.LDFLAGS),
         build_directory=directory, verbose=verbose)


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv not in ([], ["--verbose"]):
        print(f"usage: {library.COMMAND} [--verbose]", file=sys.stderr)
        return 2
    try:
        path = build(verbose=argv == ["--verbose"])
    except (BuildError, OSError) as err:
        print(f"ea_ops.build: {err}", file=sys.stderr)
        return 1
    print(f"EA's CPU backend is built: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
