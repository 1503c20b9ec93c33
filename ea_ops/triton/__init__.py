"""EA Eq. (4) on CUDA as Triton kernels: backends of the operation
:func:`ea_ops.evolving_attention`, which its dispatcher (:mod:`ea_ops.dispatch`) gives calls
on CUDA in float16, bfloat16 and float32 where triton is installed (the ``triton`` extra):
full passes (:mod:`.evolving_attention`: one kernel forward, two backward) and decoding
steps (:mod:`.decoding_step`: one kernel a step).

This module imports neither triton nor the kernels (:func:`full_pass` and :func:`step` do,
at their first call): it says whether they can run and holds the switch that gives them CPU
calls under Triton's interpreter (``TRITON_INTERPRET=1``, set before triton is imported), which is how
their tests run on a machine without a GPU (``bash scripts/test_triton.sh``).
"""
import functools
import importlib
import importlib.util
import os
import threading
from contextlib import contextmanager

# The kernels keep one query row of every head in registers (the softmax's row and the
# convolution's heads): next_pow2(heads) * next_pow2(keys) float32 values per row.
MAX_ROW_ELEMENTS = 16384

_local = threading.local()


@functools.lru_cache(maxsize=None)
def installed() -> bool:
    """Whether triton can be imported (asked of the import system once, without importing it)."""
    return importlib.util.find_spec("triton") is not None


def row_elements(heads: int, keys: int) -> int:
    """The float32 values of one query row the kernels hold: heads x keys, each rounded up
    to a power of two (at most :data:`MAX_ROW_ELEMENTS`)."""
    return (1 << max(heads - 1, 0).bit_length()) * (1 << max(keys - 1, 0).bit_length())


def full_pass(*args, **kwargs):
    """:func:`ea_ops.triton.evolving_attention.full_pass` (the backend's signature of
    :class:`~ea_ops.contract.BackendResult`), imported at the first call."""
    return _kernels("evolving_attention").full_pass(*args, **kwargs)


def step(*args, **kwargs):
    """:func:`ea_ops.triton.decoding_step.step` (the backend's signature of
    :class:`~ea_ops.contract.BackendResult`), imported at the first call."""
    return _kernels("decoding_step").step(*args, **kwargs)


@functools.lru_cache(maxsize=None)
def _kernels(module: str):
    """The kernels' module ``module`` of this package, imported once (it imports triton)."""
    return importlib.import_module(f"{__name__}.{module}")


def interpreted() -> bool:
    """Whether triton runs its kernels in its interpreter here (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip() == "1"


def on_cpu() -> bool:
    """Whether CPU calls go to the kernels: inside :func:`interpret_on_cpu`, under the interpreter."""
    return bool(getattr(_local, "on_cpu", 0)) and interpreted()


@contextmanager
def interpret_on_cpu():
    """Give CPU calls of the operation that the kernels take to the kernels, run by Triton's
    interpreter, inside the block (this thread): their tests on a machine without a GPU.
    Without ``TRITON_INTERPRET=1`` in the environment the block changes nothing."""
    _local.on_cpu = getattr(_local, "on_cpu", 0) + 1
    try:
        yield
    finally:
        _local.on_cpu -= 1
