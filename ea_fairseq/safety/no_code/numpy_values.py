"""Numeric numpy values in a checkpoint (fairseq's ``--eval-bleu`` keeps its BLEU counts as
numpy arrays in ``extra_state['metrics']``), rebuilt while it is unpickled from a type code of
booleans or numbers and the bytes stored in the file, nothing else.

numpy pickles an array as ``_reconstruct(ndarray, (0,), b'b')`` filled in by ``BUILD`` with
``(version, shape, dtype, fortran_order, data)``, a dtype as ``dtype('i8', False, True)``
filled in by its class's ``__setstate__``, a scalar as ``scalar(dtype, data)``. The names a
checkpoint may use for them (:func:`allowed_globals`) resolve to the functions here: a dtype
only of booleans and numbers; an array or scalar only from data of its exact size, with a
dtype made afresh from the type code (whatever ``__setstate__`` did to the stored dtype is
left behind, so no array can hold object pointers); ``numpy.ndarray`` names no class, so no
array is made with a shape the file does not hold. An array is unpickled as a
:class:`PendingArray`, which the walk (:meth:`~.plain._Walk.check`) replaces by its array.
"""
import math
import re
from typing import Any, List

import numpy as np

try:
    from numpy._core import multiarray
except ImportError:  # numpy < 2
    from numpy.core import multiarray

_CODE = re.compile(r"[biufc]\d{1,2}")  # numpy's type code of a boolean or number dtype ('b1', 'i8', 'f4')


class NumpyValueRefused(Exception):
    """A numpy value in a checkpoint that is not an array or scalar of booleans or numbers
    stored whole; raised while the file is unpickled."""


def _dtype_of(dtype) -> np.dtype:
    """A fresh dtype of the type code of ``dtype`` (booleans and numbers only)."""
    code = dtype.str if isinstance(dtype, np.dtype) else None
    if code is None or code[:1] not in "<>|=" or not _CODE.fullmatch(code[1:]):
        raise NumpyValueRefused(f"a numpy value of dtype {dtype!r}: numpy values may only be arrays and scalars "
                                "of booleans and numbers")
    return np.dtype(code)


def dtype(code, align=False, copy=False) -> np.dtype:
    """``numpy.dtype`` as numpy pickles it: a type code of booleans or numbers, a new dtype."""
    if type(code) is not str or not _CODE.fullmatch(code):
        raise NumpyValueRefused(f"a numpy dtype {code!r}: numpy values may only be arrays and scalars of "
                                "booleans and numbers")
    return np.dtype(code, bool(align), True)  # a copy: its __setstate__ leaves numpy's own dtype alone


class _NdarrayName:
    """What ``numpy.ndarray`` names in a checkpoint: the first argument of ``_reconstruct``,
    not a class (no array of a shape the file does not hold is made)."""

    __slots__ = ()

    def __new__(cls, *args):
        if not isinstance(cls, type):  # the unpickler's NEWOBJ: numpy.ndarray.__new__(numpy.ndarray, *args)
            raise NumpyValueRefused("a numpy.ndarray made directly (numpy pickles an array through _reconstruct)")
        return super().__new__(cls)

    def __call__(self, *args):
        raise NumpyValueRefused("a numpy.ndarray made directly (numpy pickles an array through _reconstruct)")

    def __repr__(self):
        return "numpy.ndarray"


NDARRAY = _NdarrayName()


class PendingArray:
    """A numpy array being unpickled: its state (``BUILD``) checked and turned into
    :attr:`value`, an array of exactly the data stored."""

    __slots__ = ("value",)

    def __setstate__(self, state):
        if type(state) is tuple and len(state) == 4:
            state = (1,) + state
        if type(state) is not tuple or len(state) != 5:
            raise NumpyValueRefused(f"a numpy array with the state {type(state).__name__}, not numpy's")
        version, shape, stored, fortran, data = state
        if type(shape) is not tuple or not all(type(n) is int and n >= 0 for n in shape) or type(data) is not bytes \
                or type(fortran) is not bool or version != 1:
            raise NumpyValueRefused("a numpy array whose state is not numpy's (a shape, a dtype and its data)")
        kind = _dtype_of(stored)
        declared = math.prod(shape) * kind.itemsize
        if declared != len(data):
            raise NumpyValueRefused(f"a numpy array declaring {declared} bytes (shape {shape}, {kind}) over "
                                    f"{len(data)} bytes of data")
        value = np.empty(shape, kind, order="F" if fortran else "C")
        value.__setstate__((1, shape, kind, fortran, data))
        self.value = value


def reconstruct(cls, shape, code) -> PendingArray:
    """``numpy._core.multiarray._reconstruct`` as numpy pickles an array: an empty one."""
    if cls is not NDARRAY or shape != (0,):
        raise NumpyValueRefused(f"_reconstruct({cls!r}, {shape!r}, ...): numpy pickles an array as "
                                "_reconstruct(numpy.ndarray, (0,), ...)")
    return PendingArray()


def scalar(dtype, data=None):
    """``numpy._core.multiarray.scalar``: a scalar of booleans or numbers from its bytes."""
    kind = _dtype_of(dtype)
    if type(data) is not bytes or len(data) != kind.itemsize:
        raise NumpyValueRefused(f"a numpy {kind} scalar from {type(data).__name__} data, not its {kind.itemsize} bytes")
    return multiarray.scalar(kind, data)


def _empty_bytes() -> bytes:
    """``builtins.bytes`` as pickle calls it: ``bytes()``, for an empty string (the data of
    an empty array; other strings are pickled as ``_codecs.encode``); it allocates nothing."""
    return b""


def allowed_globals() -> List[Any]:
    """The names numpy's pickles use, each resolving to its function here, the classes whose
    ``__setstate__`` is run (numpy's dtypes of booleans and numbers, :class:`PendingArray`);
    numpy 1.x wrote ``numpy.core``, numpy 2 ``numpy._core``."""
    numeric = np.typecodes["AllInteger"] + np.typecodes["AllFloat"] + "?"
    dtype_classes = sorted({type(np.dtype(code)) for code in numeric}, key=lambda cls: cls.__name__)
    named = [(NDARRAY, "numpy.ndarray"), (dtype, "numpy.dtype"), (_empty_bytes, "builtins.bytes")]
    for package in ("numpy._core", "numpy.core"):
        named += [(reconstruct, f"{package}.multiarray._reconstruct"), (scalar, f"{package}.multiarray.scalar")]
    return [PendingArray, *dtype_classes, *named]
