"""EA Eq. (4) on CUDA as Triton kernels: backends of the operation
:func:`ea_ops.evolving_attention`, which its dispatcher (:mod:`ea_ops.dispatch`) gives calls
on CUDA in float16, bfloat16 and float32 where triton is installed (the ``triton`` extra):
full passes (:mod:`.evolving_attention`: one kernel forward, two backward; launched by the
``torch.library`` operators of :mod:`.operators`) and decoding
steps (:mod:`.decoding_step`: one kernel a step).

This module imports neither triton nor the kernels (:func:`full_pass` and :func:`step` do,
at their first call): it says whether they can run and holds the switch that gives them CPU
calls under Triton's interpreter (``TRITON_INTERPRET=1``, set before triton is imported), which is how
their tests run on a machine without a GPU (``bash scripts/test_triton.sh``); and what both
kernels' hosts do before a launch: refuse what a kernel would read or write beyond
(:func:`checked`) and make the tensors' device current (:func:`on_device`).
"""
import contextlib
import importlib
import importlib.util
import os
import threading
from contextlib import contextmanager

import torch

# The decoding step keeps one query row of every head in registers (the softmax's row and the
# convolution's heads): next_pow2(heads) * next_pow2(keys) float32 values per row. (The full
# pass takes the keys in blocks: any length.)
MAX_ROW_ELEMENTS = 16384

_local = threading.local()


_INSTALLED = importlib.util.find_spec("triton") is not None


def installed() -> bool:
    """Whether triton can be imported (asked of the import system once, when this module is
    imported, without importing triton: a constant where torch.compile traces a call)."""
    return _INSTALLED


def row_elements(heads: int, keys: int) -> int:
    """The float32 values of one query row the decoding step holds: heads x keys, each rounded
    up to a power of two (at most :data:`MAX_ROW_ELEMENTS`)."""
    return (1 << max(heads - 1, 0).bit_length()) * (1 << max(keys - 1, 0).bit_length())


def full_pass(*args, **kwargs):
    """:func:`ea_ops.triton.operators.full_pass` (the backend's signature of
    :class:`~ea_ops.contract.BackendResult`), imported at the first call."""
    from . import operators  # (an import statement: torch.compile traces through it)

    return operators.full_pass(*args, **kwargs)


def step(*args, **kwargs):
    """:func:`ea_ops.triton.operators.step` (the backend's signature of
    :class:`~ea_ops.contract.BackendResult`), imported at the first call."""
    from . import operators

    return operators.step(*args, **kwargs)


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


def on_device(tensor):
    """The block in which the kernels launch for ``tensor``: with its CUDA device current
    (Triton launches on the current device and its current stream, which need not be the
    tensors': a model on ``cuda:1``)."""
    return torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext()


def checked(logits, previous, weight, bias, masks, state=()) -> None:
    """Refuse, in one line, arguments the kernels would read or write outside of: ``logits``
    (B, H, T, S); ``previous`` None or broadcasting to them; ``weight`` (H, H, k, k) with k
    odd; ``bias`` None or (H,); each of ``masks`` None or a bool tensor that broadcasts to the
    logits; every tensor (``state``'s too) on the logits' device. The kernels take pointers and trust these
    shapes: a smaller map would be read, and in the backward written, beyond its end."""
    shape = tuple(logits.shape)
    heads = shape[1] if len(shape) == 4 else None
    k = weight.size(-1)
    wrong = [what for bad, what in (
        (len(shape) != 4, f"logits {shape}, not (B, H, T, S)"),
        (previous is not None and not _broadcasts(_shape(previous), shape),
         f"previous {_shape(previous)}, not broadcasting to {shape}"),
        (_shape(weight) != (heads, heads, k, k) or not k % 2,
         f"weight {_shape(weight)}, not ({heads}, {heads}, k, k), k odd"),
        (bias is not None and _shape(bias) != (heads,), f"bias {_shape(bias)}, not ({heads},)"),
        *((mask.dtype != torch.bool or not _broadcasts(_shape(mask), shape),
           f"a mask {mask.dtype} {_shape(mask)}, not bool (True: masked) broadcasting to {shape}")
          for mask in masks if mask is not None),
        *((t.device != logits.device, f"a tensor on {t.device} beside logits on {logits.device}")
          for t in (previous, weight, bias, *masks, *state) if t is not None),
    ) if bad]
    if wrong:
        raise ValueError(f"EA's Triton kernels: {'; '.join(dict.fromkeys(wrong))}: pass the shapes "
                         "ea_ops.evolving_attention documents, on one device")


def _shape(tensor):
    return tuple(tensor.shape) if tensor is not None else ()


def _broadcasts(shape, target) -> bool:
    """Whether a tensor of ``shape`` broadcasts to ``target`` (without growing it)."""
    return len(shape) <= len(target) and all(s in (1, t) for s, t in zip(reversed(shape), reversed(target)))
