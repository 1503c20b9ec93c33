"""The CPU backend's C++ extension (``csrc/``), built ahead by ``python -m ea_ops.build``
(:mod:`ea_ops.build`) and loaded here when a call needs it.

A forward pass never compiles. :func:`extension` loads the library built ahead, or, where
there is none, returns None: the dispatcher then gives every call to the PyTorch
reference (same results, slower on CPU) and a warning says once per process why, naming
the command.

The library lives in ``_build/<name>`` beside this file, or, where the package is
read-only, in ``~/.cache/ea_ops/<name>``; ``<name>`` carries a hash of everything ninja's
build file holds: the sources and where they are, the compiler, its flags, the torch
installation and Python's headers. Two checkouts or two environments never load or
overwrite each other's library, and a changed source is a new name, never a stale
library. A library cut short (a link that did not finish) is not loaded, which would
crash the process, and ``python -m ea_ops.build`` builds it again. Paths are taken with
symbolic links resolved: the package reached through a link is this copy, with this copy's
library.
"""
import hashlib
import logging
import os
import sysconfig
import threading
from typing import List, Optional

import torch

logger = logging.getLogger(__name__)

HERE = os.path.dirname(os.path.realpath(__file__))
SOURCES = [os.path.join(HERE, "csrc", "evolving_attention.cpp")]
HEADERS = [os.path.join(HERE, "csrc", "evolving_attention_loops.h")]
CFLAGS = ("-O3", "-fno-trapping-math", "-fopenmp")
LDFLAGS = ("-fopenmp",)
COMMAND = "python -m ea_ops.build"  # what builds it (ea_ops/build.py)
LIBRARY_SUFFIX = ".so"  # torch.utils.cpp_extension's name for the library on Linux and macOS

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
    return f"ea_ops_cpu_{digest.hexdigest()[:12]}"


def directories(name: str) -> List[str]:
    """Where the build of ``name`` lives: beside this file, else in the user's cache."""
    return [os.path.join(root, name) for root in (
        os.path.join(HERE, "_build"), os.path.join(os.path.expanduser("~"), ".cache", "ea_ops"))]


def library_path(name: Optional[str] = None) -> Optional[str]:
    """The built library of this copy's sources, or None where none is built."""
    name = name or extension_name()
    for directory in directories(name):
        path = os.path.join(directory, name + LIBRARY_SUFFIX)
        if os.path.isfile(path):
            return path
    return None


def build_directory(name: str) -> str:
    """The first of :func:`directories` that is writable (made where missing)."""
    for path in directories(name):
        try:
            os.makedirs(path, exist_ok=True)
        except OSError:
            continue
        if os.access(path, os.W_OK):
            return path
    raise OSError("no writable directory for the CPU backend's build")


def cut_short(path: str) -> bool:
    """Whether the ELF library at ``path`` ends before its segments or its section headers
    do (a link that did not finish, a copy cut short): loading it would crash the process
    (SIGBUS on the pages past its end), not raise. False for a complete or a non-ELF file."""
    import struct

    with open(path, "rb") as f:
        header = f.read(64)
        size = os.fstat(f.fileno()).st_size
        if len(header) < 52 or header[:4] != b"\x7fELF" or header[4] not in (1, 2) or header[5] not in (1, 2):
            return header[:4] == b"\x7fELF"  # an ELF header cut short
        order, wide = "<" if header[5] == 1 else ">", header[4] == 2
        if wide and len(header) < 64:
            return True
        # e_phoff, e_shoff; e_phentsize, e_phnum, e_shentsize, e_shnum
        ph, sh = struct.unpack_from(order + ("QQ" if wide else "II"), header, 32 if wide else 28)
        ph_size, ph_count, sh_size, sh_count = struct.unpack_from(order + "HHHH", header, 54 if wide else 42)
        if sh + sh_size * sh_count > size or ph + ph_size * ph_count > size:
            return True
        f.seek(ph)
        table = f.read(ph_size * ph_count)
    for i in range(ph_count):  # each segment's bytes in the file: p_offset, p_filesz
        offset, length = (struct.unpack_from(order + "QxxxxxxxxxxxxxxxxQ", table, i * ph_size + 8) if wide
                          else struct.unpack_from(order + "IxxxxxxxxI", table, i * ph_size + 4))
        if offset + length > size:
            return True
    return False


def status() -> Optional[bool]:
    """Whether :func:`extension` found the library: None before it was asked."""
    return (_state["module"] is not None) if _state["tried"] else None


def extension():
    """The built extension, loaded once per process, or None (not built: warned once)."""
    if _state["tried"]:
        return _state["module"]
    with _lock:
        if not _state["tried"]:
            _state["module"] = _load()
            _state["tried"] = True
    return _state["module"]


def _load():
    from .accelerators import ENV_SWITCH

    try:
        name = extension_name()
        path = library_path(name)
        if path is None:
            reason = "it is not built"
        elif cut_short(path):
            reason = f"{path} is cut short, a build that did not finish"
        else:
            import importlib.util

            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
    except Exception as err:  # a library that does not load, an unreadable source, ...
        reason = f"it does not load: {type(err).__name__}: {(str(err).strip().splitlines() or [''])[-1]}"
    logger.warning(
        "EA's CPU backend is not used (%s); EA's operation runs its PyTorch reference: same "
        "results, slower on CPU. Build it with `%s` (a C++ compiler and ninja: pip install "
        "ninja); set %s=0 to silence this.", reason, COMMAND, ENV_SWITCH)
    return None
