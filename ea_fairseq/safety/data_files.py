"""Files fairseq opens by name from a data or model directory, checked before it opens them.

fairseq trusts what it finds under the names it expects. Its binary datasets trust their
index files (``PREFIX.idx``, next to ``PREFIX.bin``): the legacy ``IndexedDataset`` reads its
item count from the header and allocates arrays of that many offsets (a 2^40 count asks for
8 TiB); ``MMapIndexedDataset`` takes the count and every item's offset and size from the index
and reads (``_warmup_mmap_file``) both files to their end. A dictionary (``dict.src.txt``) is
read whole with ``readlines()``, and so are the BPE files the hub picks up from a model
directory (``code``, ``bpecodes``, ``sentencepiece.bpe.model``, ``merges.txt``, ``vocab.json``)
or a command line names: a link to ``/dev/zero`` grows memory until the process dies, and a
FIFO makes the first ``open()`` wait forever.

:func:`check_file` is the one check of such a file (:func:`ea_fairseq.safety.confined.inside`):
a regular file inside the directory it is named in, links followed (a link out is refused before
fairseq prints the file it leads to), whatever language codes fairseq put in its name, and at
most a bound for its kind (:data:`DICTIONARY_LIMIT`, :data:`BPE_LIMIT`; a dictionary, while a
command that names a checkpoint runs, at most a line per byte of it: :func:`_check_lines`).
:func:`check` adds, for a binary split, a comparison of what the index declares with the sizes
of the two files and then every item's place with the data file and its length (at most :data:`ITEM_LIMIT`
tokens), no file with holes (a sparse file stores what it declares in no space), with nothing allocated
beyond the index itself (mapped, never copied), and the index's format with the one fairseq is
told to read it as; a raw-text split (``--dataset-impl raw``) must be a regular file.

The checks go where fairseq opens these files, each the one function every caller goes
through, looked up at each call, replaced once (no swap and restore; :mod:`ea_fairseq.side_effects`)
by a function that calls fairseq's own on files that passed (:data:`split_checks`, ...):

- ``fairseq.data.data_utils.load_indexed_dataset``: every split a task loads (``translation``
  and the plugin's ``translation_lines``, in ``fairseq-train``, ``fairseq-generate``, ...);
- ``fairseq.data.indexed_dataset.make_dataset``: every dataset format fairseq reads, named
  (``--dataset-impl``, a checkpoint) or inferred from an index, is one whose files are checked
  here (:data:`CHECKED_FORMATS`): ``fasta`` indexes its file through a shell command that holds
  the file's path, ``huffman`` opens a vocabulary beside the index;
- ``fairseq.data.data_utils.infer_language_pair``: a data directory fairseq lists to infer the
  language pair is there (else :class:`MissingDataFile`);
- ``fairseq.data.Dictionary.add_from_file``: every dictionary loaded from a path, by any task's
  ``load_dictionary``, ``Dictionary.load`` or a subclass (the hub, every command-line tool);
- ``fairseq.data.encoders.build_bpe``: every BPE the hub, ``fairseq-interactive`` and
  ``fairseq-generate`` build; each string field of the chosen BPE's configuration dataclass
  whose value names an existing file (a directory is left to fairseq) is checked.

A failure raises :class:`DataFileError`, printed by the command-line tools as one line naming
the file and what to do. A data directory or dictionary that is not there (the quickstart run
before the data is prepared, another pair's ``--source-lang``) raises fairseq's
``FileNotFoundError`` as :class:`MissingDataFile`, whose message says what to give instead.
"""
import itertools
import os
import struct
from typing import Optional

import numpy as np

from ..errors import OptionError
from . import budget, confined

LEGACY_MAGIC = b"TNTIDX\x00\x00"  # fairseq's IndexedDataset (--dataset-impl lazy / cached)
MMAP_MAGIC = b"MMIDIDX\x00\x00"  # fairseq's MMapIndexedDataset (--dataset-impl mmap, the default)


class DataFileError(OptionError):
    """A file fairseq would open from a data or model directory that is not a regular file of
    its kind's size, or a binary split whose index does not match its files; nothing was read
    beyond the index, nothing allocated."""


BINARY = "a damaged or crafted data file; rebuild the data directory with fairseq-preprocess"
# the dataset formats (--dataset-impl) whose files are checked here; fairseq's others act beyond
# their files: "fasta" indexes its file through a shell command that holds the file's path,
# "huffman" opens a vocabulary beside the index
CHECKED_FORMATS = ("raw", "lazy", "cached", "mmap")
FORMATS = ("a dataset format whose files ea_fairseq checks (raw, lazy, cached, mmap: --dataset-impl mmap is "
           "what fairseq-preprocess writes); rebuild the data directory with fairseq-preprocess")
ITEM_LIMIT = 2 ** 24  # tokens in one item (a sentence), which fairseq reads whole, as int64s: a data
# file with holes (sparse) holds a declared item of any size in no space
DICTIONARY_LIMIT = 256 * 2 ** 20  # fairseq-preprocess writes a few MB for 100k types
BPE_LIMIT = 64 * 2 ** 20  # sentencepiece / BPE merges / vocab.json files are a few MB
DICTIONARY = (f"a fairseq dictionary is a regular text file of at most {DICTIONARY_LIMIT // 2 ** 20} MiB: use "
              "the one fairseq-preprocess wrote for this data (or that came with the model)")


class MissingDataFile(FileNotFoundError):
    """A data directory or dictionary fairseq is about to open that is not there: fairseq's own
    ``FileNotFoundError`` (its callers see the same exception type), with a message that says
    what to give instead, printed by the command-line tools as one line."""

    one_line = True


PREPARED = ("give the directory fairseq-preprocess wrote (its --destdir), e.g. data-bin/NAME of the recipes' "
            "examples/translation/prepare-*.sh")


def _shown(path: str) -> str:
    """A path as a one-line message shows it: itself where printable, else its ``repr``."""
    return path if path.isprintable() else repr(path)


def _check_data_directory(path) -> None:
    """fairseq lists ``path`` to infer the language pair: a missing one (a local path) is named as such."""
    if isinstance(path, str) and "://" not in path and not os.path.exists(path):
        raise MissingDataFile(f"{_shown(path)}: no such data directory: {PREPARED}")


def _languages_there(directory: str) -> str:
    """The languages of the dictionaries in ``directory`` (``dict.LANG.txt``, codes only), for a message."""
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return ""
    langs = [_shown(n[5:-4]) for n in names if n.startswith("dict.") and n.endswith(".txt")]
    return ", ".join(langs[:10]) + (", ..." if len(langs) > 10 else "")


def _error(path: str, what: str, remedy: str = BINARY) -> DataFileError:
    return DataFileError(f"{path}: {what}: {remedy}")


def _named_in(path: str) -> str:
    """The directory fairseq named ``path`` in (joined to a name built from codes): its
    directory, or the part before a name that steps out of it (``DIR/x/../..``)."""
    parts = path.split(os.sep)
    for i in range(1, len(parts) - 1):
        if parts[i] == ".." and parts[i - 1] not in ("", ".", ".."):
            return os.sep.join(parts[:i - 1]) or (os.sep if path.startswith(os.sep) else ".")
    return os.path.dirname(path) or "."


def check_file(path: str, remedy: str = BINARY, limit: Optional[int] = None) -> int:
    """The size of ``path``, a regular file inside the directory it is named in (links followed)
    of at most ``limit`` bytes; else :class:`DataFileError` naming it, ending with ``remedy``."""
    try:
        info = os.stat(confined.inside(path, _named_in(path)))
    except confined.ConfinedPathError as refusal:  # (its own remedy replaced by this kind's)
        raise DataFileError(f"{str(refusal).rpartition(': ')[0]}: {remedy}") from None
    if limit is not None and info.st_size > limit:
        raise _error(path, f"{info.st_size:,} bytes, more than the {limit // 2 ** 20} MiB allowed", remedy)
    return info.st_size


def _check_stored(path: str, size: int) -> None:
    """``path`` stores every byte it declares: no hole (a sparse file declares its size in no
    space, and fairseq reads or allocates by the size; fairseq-preprocess never writes one)."""
    hole = confined.stored_bytes(path, size)
    if hole < size:
        raise _error(path, f"a file with holes ({size:,} bytes declared, the first hole at byte {hole:,}: a sparse "
                           "file stores what it declares in no space)")


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
    _check_items(idx, sizes)
    if int(offsets[-1]) * element_size > data_bytes:
        raise _error(idx, f"items that end at byte {int(offsets[-1]) * element_size:,} of a data file "
                          f"of {data_bytes:,} bytes")


def _check_items(idx: str, sizes) -> None:
    longest = int(sizes.max()) if len(sizes) else 0
    if longest > ITEM_LIMIT:
        raise _error(idx, f"an item of {longest:,} tokens, more than the {ITEM_LIMIT:,} a sentence may hold "
                          "(fairseq reads an item whole)")


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
    _check_items(idx, sizes)
    end = int((pointers + sizes.astype("<i8") * np.dtype(dtype).itemsize).max())
    if end > data_bytes:
        raise _error(idx, f"items that end at byte {end:,} of a data file of {data_bytes:,} bytes")


def check(prefix: str, impl: Optional[str] = None) -> bool:
    """Check ``prefix.idx`` against itself and ``prefix.bin`` (and ``prefix`` itself, a raw-text
    split, which fairseq reads whole), as fairseq would read them with dataset format ``impl``
    (None: the format fairseq infers from the files); False if none of them exists. An index of
    another format than fairseq's two binary ones is refused where fairseq would read it."""
    if impl is not None:
        _check_format(prefix, impl)
    raw = os.path.lexists(prefix) and not os.path.isdir(prefix)
    if raw and os.path.exists(prefix):
        _check_stored(prefix, check_file(prefix))
    idx, data = prefix + ".idx", prefix + ".bin"
    if not (os.path.lexists(idx) or os.path.lexists(data)):
        return raw
    if not os.path.exists(idx) or not os.path.exists(data):
        return True  # fairseq reports the missing file itself
    size, data_bytes = check_file(idx), check_file(data)
    _check_stored(idx, size)
    _check_stored(data, data_bytes)
    with open(idx, "rb") as f:
        magic = f.read(9)
    found = "lazy" if magic[:8] == LEGACY_MAGIC else "mmap" if magic == MMAP_MAGIC else None
    if found and impl not in (None, "raw") and (impl == "mmap") != (found == "mmap"):
        raise _error(idx, f"an index of the {found} format (fairseq-preprocess --dataset-impl {found}), read as "
                          f"'{impl}'", f"give --dataset-impl {found} (or leave it unset: fairseq reads the index's "
                                       "own format)")
    if found == "lazy":
        _check_legacy(idx, size, data_bytes)
    elif found == "mmap":
        _check_mmap(idx, size, data_bytes)
    elif impl != "raw" and not (impl is None and raw):  # fairseq reads this index (huffman: and a vocabulary)
        raise _error(idx, f"an index of another format (it begins with {magic!r})", FORMATS)
    return True


def _bpe_files(cfg):
    """(field, path) for each string field of the BPE ``cfg`` chooses whose value names an
    existing file; ``cfg`` as ``encoders.build_bpe`` takes it (DictConfig, Namespace, name).
    A file the BPE needs and was not given (omegaconf's missing value) is named in one line."""
    import dataclasses

    from fairseq.registry import REGISTRIES
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import MissingMandatoryValue

    if cfg is None or isinstance(cfg, str):
        return []
    choice = cfg.get("_name") if isinstance(cfg, DictConfig) else getattr(cfg, "bpe", None)
    dataclass = REGISTRIES["bpe"]["dataclass_registry"].get(choice)
    if dataclass is None:
        return []
    found = []
    for field in dataclasses.fields(dataclass):
        try:
            if isinstance(cfg, DictConfig) and OmegaConf.is_missing(cfg, field.name):
                raise MissingMandatoryValue(field.name)
            value = cfg.get(field.name) if isinstance(cfg, DictConfig) else getattr(cfg, field.name, None)
        except MissingMandatoryValue:
            raise DataFileError(
                f"the {choice} BPE needs its file: pass {field.name}=PATH in the hub (--{field.name.replace('_', '-')} "
                "on the command line), e.g. the data directory's sentencepiece.bpe.model or code; fairseq's hub "
                "finds it by itself only in the checkpoint's directory, where examples/translation/train.sh "
                "copies it") from None
        except Exception:  # an unresolvable value: fairseq's own error when it builds the BPE
            continue
        if isinstance(value, str) and os.path.exists(value) and not os.path.isdir(value):
            found.append((field.name, value))
    return found


def _checked_first(checked):
    """What makes of a fairseq function one that runs ``checked(*args)`` first, then fairseq's
    with the same arguments (installed by :mod:`ea_fairseq.side_effects`)."""

    def replacement(original):
        def checked_call(*args, **kwargs):
            checked(*args, **kwargs)
            return original(*args, **kwargs)

        return checked_call

    return replacement


def _check_splits(path, dictionary=None, dataset_impl=None, combine=False, default="cached"):
    for k in itertools.count():  # PREFIX, PREFIX1, ... with combine
        if not check(path + (str(k) if k > 0 else ""), dataset_impl) or not combine:
            break


def _check_format(path, impl, *args, **kwargs):
    """``impl``, the format fairseq reads ``path`` as (named, or inferred from the files: fasta,
    huffman), is one of :data:`CHECKED_FORMATS`."""
    if impl not in CHECKED_FORMATS:
        raise _error(path, f"dataset format '{impl}'", FORMATS)


def _check_dictionary(dictionary, f):
    if not isinstance(f, str) or "://" in f:  # a file object; a URL: fairseq's own error
        return
    if os.path.exists(f):
        check_file(f, DICTIONARY, DICTIONARY_LIMIT)
        _check_lines(f)
        return
    directory = os.path.dirname(f) or "."
    if not os.path.exists(directory):
        raise MissingDataFile(f"{_shown(directory)}: no such data directory: {PREPARED}")
    there = _languages_there(directory)
    raise MissingDataFile(
        f"{_shown(f)}: no such dictionary: "
        + (f"the languages of {_shown(directory)} are {there}: give them as --source-lang/--target-lang "
           "(source_lang=/target_lang= in the hub)" if there else
           f"{_shown(directory)} has no dict.LANG.txt: {PREPARED}"))


def _check_lines(path: str) -> None:
    """Dictionary ``path``, read for a checkpoint, holds at most a line per byte or weight of it
    (:func:`ea_fairseq.safety.budget.dictionary_bound`): counted a megabyte at a time, stopping
    past that, before fairseq reads the file whole."""
    bound = budget.dictionary_bound()
    if bound is None:
        return
    limit, checkpoint, unit = bound
    lines, carriage = 0, False  # lines as fairseq's text-mode reading splits them: \n, \r\n and a lone \r
    with confined.open_inside(path, _named_in(path)) as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            lines += chunk.count(b"\n") + chunk.count(b"\r") - chunk.count(b"\r\n") - (carriage and chunk[:1] == b"\n")
            carriage = chunk[-1:] == b"\r"
            if lines > limit:
                raise _error(path, f"more than {limit:,} lines, more types than {_shown(checkpoint)} stores a row "
                                   f"for ({limit:,} {unit})", "use the dictionaries the checkpoint was trained with")


def _check_bpe(cfg, *args, **kwargs):
    for field, path in _bpe_files(cfg):
        option = "--" + field.replace("_", "-")
        check_file(path, f"a BPE file ({option}) is a regular file of at most {BPE_LIMIT // 2 ** 20} MiB: "
                         f"put the model's own file there or pass one with {option}", BPE_LIMIT)


#: fairseq's readers, each checking first what it is about to open (:mod:`ea_fairseq.side_effects`):
#: every split (``data_utils.load_indexed_dataset``), every dataset format (``indexed_dataset.make_dataset``),
#: every data directory listed for its language pair (``data_utils.infer_language_pair``), every dictionary
#: (``Dictionary.add_from_file``) and BPE file (``encoders.build_bpe``)
split_checks = _checked_first(_check_splits)
format_check = _checked_first(_check_format)
directory_check = _checked_first(_check_data_directory)
dictionary_check = _checked_first(_check_dictionary)
bpe_check = _checked_first(_check_bpe)
