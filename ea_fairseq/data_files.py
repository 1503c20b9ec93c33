"""A data directory's binary files, checked against their sizes before fairseq opens them.

fairseq's binary datasets trust their index files (``PREFIX.idx``, next to ``PREFIX.bin``):
the legacy ``IndexedDataset`` reads its item count from the header and allocates arrays of
that many offsets (a 2^40 count asks for 8 TiB); ``MMapIndexedDataset`` takes the count and
every item's offset and size from the index and reads (``_warmup_mmap_file``) both files to
their end, so a ``.bin`` that is a link to ``/dev/zero`` never ends, and a FIFO makes the first
``open()`` wait forever.

:func:`check` reads the header of an index, compares what it declares with the sizes of the
two files and then every item's place with the data file, with nothing allocated beyond the
index itself (mapped, never copied). :func:`install` runs it on every file
``fairseq.data.data_utils.load_indexed_dataset`` is about to open: fairseq's tasks
(``translation`` and the plugin's ``translation_lines``, in ``fairseq-train``,
``fairseq-generate``, ...) load their splits through that module function, looked up on the
module at each call; the replacement is installed once (no swap and restore) and calls
fairseq's own function on files that passed. A failure raises :class:`DataFileError`, printed
by the command-line tools as one line naming the file.
"""
import functools
import itertools
import os
import stat
import struct

import numpy as np

from .errors import OptionError

LEGACY_MAGIC = b"TNTIDX\x00\x00"  # fairseq's IndexedDataset (--dataset-impl lazy / cached)
MMAP_MAGIC = b"MMIDIDX\x00\x00"  # fairseq's MMapIndexedDataset (--dataset-impl mmap, the default)


class DataFileError(OptionError):
    """A binary data file whose index does not match its files; nothing was allocated."""


def _error(path: str, what: str) -> DataFileError:
    return DataFileError(f"{path}: {what}: a damaged or crafted data file; rebuild the data "
                         "directory with fairseq-preprocess")


def _regular_size(path: str) -> int:
    info = os.stat(path)  # follows links: a link to /dev/zero is a device
    if not stat.S_ISREG(info.st_mode):
        kind = ("a FIFO" if stat.S_ISFIFO(info.st_mode) else "a device" if stat.S_ISCHR(info.st_mode)
                or stat.S_ISBLK(info.st_mode) else "a directory" if stat.S_ISDIR(info.st_mode) else "not a file")
        raise _error(path, f"is {kind}, not a regular file")
    return info.st_size


def _dtypes():
    from fairseq.data.indexed_dataset import _code_to_dtype

    return _code_to_dtype


def _check_legacy(idx: str, size: int, data_bytes: int) -> None:
    if size < 48:
        raise _error(idx, f"{size} bytes, shorter than its 48-byte header")
    with open(idx, "rb") as f:
        _, version, code, element_size, n, s = struct.unpack("<8sQQQQQ", f.read(48))
    dtype = _dtypes().get(code)
    if version != 1 or dtype is None or element_size != np.dtype(dtype).itemsize:
        raise _error(idx, f"header of version {version}, type code {code}, element size {element_size}")
    need = 48 + 8 * (2 * (n + 1) + s)
    if need != size:
        raise _error(idx, f"declares {n:,} items and {s:,} sizes, which take {need:,} bytes of index; "
                          f"the file has {size:,}")
    longs = np.memmap(idx, dtype="<i8", mode="r", offset=48, shape=(2 * (n + 1) + s,))
    dims, offsets, sizes = longs[:n + 1], longs[n + 1:2 * (n + 1)], longs[2 * (n + 1):]
    if dims[0] != 0 or dims[-1] != s or (np.diff(dims) != 1).any():
        raise _error(idx, "items that are not sequences of one dimension (translation data)")
    if offsets[0] != 0 or (sizes < 0).any() or (np.diff(offsets) != sizes).any():
        raise _error(idx, "item offsets that do not follow the item sizes")
    if int(offsets[-1]) * element_size > data_bytes:
        raise _error(idx, f"items that end at byte {int(offsets[-1]) * element_size:,} of a data file "
                          f"of {data_bytes:,} bytes")


def _check_mmap(idx: str, size: int, data_bytes: int) -> None:
    if size < 26:
        raise _error(idx, f"{size} bytes, shorter than its 26-byte header")
    with open(idx, "rb") as f:
        _, version, code, n = struct.unpack("<9sQBQ", f.read(26))
    dtype = _dtypes().get(code)
    if version != 1 or dtype is None:
        raise _error(idx, f"header of version {version}, type code {code}")
    need = 26 + 12 * n
    if need > size:
        raise _error(idx, f"declares {n:,} items, which take {need:,} bytes of index; the file has {size:,}")
    if n == 0:
        return
    sizes = np.memmap(idx, dtype="<i4", mode="r", offset=26, shape=(n,))
    pointers = np.memmap(idx, dtype="<i8", mode="r", offset=26 + 4 * n, shape=(n,))
    if (sizes < 0).any() or (pointers < 0).any():
        raise _error(idx, "negative item sizes or offsets")
    end = int((pointers + sizes.astype("<i8") * np.dtype(dtype).itemsize).max())
    if end > data_bytes:
        raise _error(idx, f"items that end at byte {end:,} of a data file of {data_bytes:,} bytes")


def check(prefix: str) -> bool:
    """Check ``prefix.idx`` against itself and ``prefix.bin``; False if neither exists."""
    idx, data = prefix + ".idx", prefix + ".bin"
    if not (os.path.lexists(idx) or os.path.lexists(data)):
        return False
    if not os.path.exists(idx) or not os.path.exists(data):
        return True  # fairseq reports the missing file itself
    size, data_bytes = _regular_size(idx), _regular_size(data)
    with open(idx, "rb") as f:
        magic = f.read(9)
    if magic[:8] == LEGACY_MAGIC:
        _check_legacy(idx, size, data_bytes)
    elif magic == MMAP_MAGIC:
        _check_mmap(idx, size, data_bytes)
    return True  # other formats (raw text, fasta, huffman): fairseq's own readers


def install() -> None:
    """Check every split ``data_utils.load_indexed_dataset`` loads before it opens the files
    (all of ``PREFIX``, ``PREFIX1``, ... with ``combine``). Idempotent."""
    from fairseq.data import data_utils

    original = data_utils.load_indexed_dataset
    if getattr(original, "ea_fairseq_checks", False):
        return

    @functools.wraps(original)
    def load_indexed_dataset(path, dictionary=None, dataset_impl=None, combine=False, default="cached"):
        for k in itertools.count():
            if not check(path + (str(k) if k > 0 else "")) or not combine:
                break
        return original(path, dictionary, dataset_impl, combine, default)

    load_indexed_dataset.ea_fairseq_checks = True
    data_utils.load_indexed_dataset = load_indexed_dataset
