"""Building and loading the CPU accelerators' C++ extension (``csrc/``).

``torch.utils.cpp_extension`` compiles it on first use with the machine's C++ compiler and
``ninja`` (about 10 s on one core), then loads the cached library. The build directory is
``_build/<name>`` beside this file, or, where the package is read-only,
``~/.cache/ea_fairseq/<name>``; ``<name>`` carries a hash of everything ninja's build file
holds: the sources and where they are, the compiler, its flags, the torch installation and
Python's headers. Two checkouts or two environments never rebuild or overwrite each other's
library, and a changed source is a new build, never a stale one. Paths are taken with
symbolic links resolved: the package reached through a link (``--user-dir
/elsewhere/ea_fairseq`` linked to this one) is this copy, whose library ninja finds up to
date. Without a compiler or ``ninja`` the build fails once per process with a warning, and
every mechanism runs its PyTorch reference.
"""
import hashlib
import logging
import os
import sysconfig
import threading

import torch

logger = logging.getLogger(__name__)

HERE = os.path.dirname(os.path.realpath(__file__))
SOURCES = [os.path.join(HERE, "csrc", "evolving_attention.cpp")]
HEADERS = [os.path.join(HERE, "csrc", "evolving_attention_loops.h")]
CFLAGS = ("-O3", "-fno-trapping-math", "-fopenmp")
LDFLAGS = ("-fopenmp",)

_lock = threading.Lock()
_state = {"module": None, "tried": False}


def extension_name() -> str:
    from torch.utils import cpp_extension

    digest = hashlib.sha256()
    for path in SOURCES + HEADERS:
        with open(path, "rb") as f:
            digest.update(f.read())
    # what build.ninja names besides the flags, as torch writes it there (its paths unresolved)
    where = [HERE, *cpp_extension.include_paths(), cpp_extension.TORCH_LIB_PATH,
             sysconfig.get_path("include", scheme="posix_prefix"), os.environ.get("CXX", "c++")]
    digest.update("\n".join([*CFLAGS, *LDFLAGS, torch.__version__, *where]).encode())
    return f"ea_fairseq_cpu_{digest.hexdigest()[:12]}"


def build_directory(name: str) -> str:
    """``_build/<name>`` beside this file where writable, else the user's cache."""
    for root in (os.path.join(HERE, "_build"),
                 os.path.join(os.path.expanduser("~"), ".cache", "ea_fairseq")):
        path = os.path.join(root, name)
        try:
            os.makedirs(path, exist_ok=True)
        except OSError:
            continue
        if os.access(path, os.W_OK):
            return path
    raise OSError("no writable directory for the CPU accelerators' build")


def extension():
    """The compiled extension, or None (it could not be built: warned once per process)."""
    if _state["tried"]:
        return _state["module"]
    with _lock:
        if not _state["tried"]:
            _state["module"] = _build()
            _state["tried"] = True
    return _state["module"]


def _build():
    path = os.environ.get("PATH", "")
    try:
        from torch.utils.cpp_extension import load

        try:  # pip's ninja, also when its venv is not activated (e.g. .venv/bin/fairseq-generate)
            import ninja

            os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, path])
        except ImportError:
            pass
        name = extension_name()
        logger.info("loading ea_fairseq's CPU accelerators (compiled on first use, then cached)")
        # copies: torch appends its own flags to the lists it is given
        return load(name=name, sources=SOURCES, extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS),
                    build_directory=build_directory(name), verbose=False)
    except Exception as err:  # no compiler, no ninja, no writable directory, ...
        from .. import ENV_SWITCH

        logger.warning(
            "ea_fairseq's CPU accelerators could not be built (%s: %s); every mechanism runs "
            "its PyTorch reference: same results, slower on CPU. To build them, install a C++ "
            "compiler and `pip install ninja`; set %s=0 to silence this.",
            type(err).__name__, (str(err).strip().splitlines() or [""])[-1], ENV_SWITCH)
        return None
    finally:
        os.environ["PATH"] = path
