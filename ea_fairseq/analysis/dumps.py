"""Reading an attention dump (:func:`ea_fairseq.analysis.maps.dump` writes it) as received
input: a zip of ``.npy`` members and its metadata, read inside its own directory
(:func:`~ea_fairseq.safety.confined.open_inside`), each member's inflated size and declared
array bounded from the zip's own sizes before numpy inflates or allocates anything, of a map only
the part a figure draws kept (:meth:`AttentionDump.get`), and the metadata's names checked before
figures are named after them (``ea-fairseq-analysis plot``).
"""
import json
import re
import reprlib
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np

from . import ATTENTIONS
from ..safety.confined import open_inside

META_KEY = "meta.json"


@dataclass
class SentenceMaps:
    id: int
    source: List[str]
    decoder_input: List[str]
    target: List[str]
    kinds: Dict[str, List[str]]


class DumpError(ValueError):
    """A file that is not a dump :func:`dump` wrote (its names are not those it writes)."""


_KIND = re.compile(r"[A-Za-z0-9_]{1,64}(\.layer[0-9]{1,4})?")  # a mechanism's map, per layer where shapes differ
LIMIT_SENTENCE_ID = 1 << 31
LIMIT_MAP_ELEMENTS = 1 << 28  # one stored map (layers x heads x queries x keys), 1 GiB of float32
LIMIT_META_BYTES = 1 << 28  # the dump's metadata (its tokens)
# deflate inflates at most about 1032 bytes per compressed byte: a member declaring more is a
# crafted zip, not deflate (a dump's own maps reach ~640: an HC-SA map of underflowed zeros)
LIMIT_EXPANSION = 1100  # bytes a member inflates to per compressed byte, above LIMIT_PLAIN
LIMIT_PLAIN = 1 << 24  # bytes a member may inflate to whatever its compressed size
LIMIT_INFLATED = 1 << 30  # bytes the members one dump reader inflates take in all: the real budget


def _checked_meta(meta, path: str) -> dict:
    """``meta`` if its sentence ids, attentions and kinds are those :func:`dump` writes (an
    int id, one of :data:`ATTENTIONS`, a map name): the figures' file names are made of them."""
    def refuse(what, value):
        raise DumpError(f"{path}: {what} {reprlib.repr(value)}: not what ea-fairseq-analysis dump writes (the "
                        "figures' file names are made of it); refused, nothing plotted. Make the dump again "
                        "with ea-fairseq-analysis dump")
    if not isinstance(meta, dict) or not isinstance(meta.get("sentences"), list):
        refuse("the metadata", type(meta).__name__)
    for s in meta["sentences"]:
        if not isinstance(s, dict):
            refuse("a sentence entry", s)
        if type(s.get("id")) is not int or not 0 <= s["id"] < LIMIT_SENTENCE_ID:
            refuse("the sentence id", s.get("id"))
        if not isinstance(s.get("maps"), dict):
            refuse("the maps of a sentence", s.get("maps"))
        for attention, kinds in s["maps"].items():
            if attention not in ATTENTIONS:
                refuse("the attention", attention)
            if not isinstance(kinds, list):
                refuse("the kinds of an attention", kinds)
            for kind in kinds:
                if type(kind) is not str or not _KIND.fullmatch(kind):
                    refuse("the kind", kind)
        for side in ("source", "decoder_input", "target"):
            if not isinstance(s.get(side), list) or not all(type(t) is str for t in s[side]):
                refuse(f"the {side} tokens", s.get(side))
    return meta


class AttentionDump:
    """Reads a dump written by :func:`dump` (:class:`DumpError` for another file)."""

    def __init__(self, path: str):
        self.path = path
        self._inflated = 0  # bytes of the members read so far (LIMIT_INFLATED)
        self._npz = np.load(open_inside(path), allow_pickle=False)
        self._disjoint()
        try:
            self._stored_size(META_KEY, LIMIT_META_BYTES)
            self._inflating(META_KEY)
            meta = json.loads(str(self._npz[META_KEY]))
        except (KeyError, ValueError, RecursionError) as err:
            raise DumpError(f"{path}: no dump metadata ({META_KEY}) that ea-fairseq-analysis dump writes "
                            f"({type(err).__name__}); make the dump again with ea-fairseq-analysis dump") from None
        self.meta = _checked_meta(meta, path)
        self.sentences = {
            s["id"]: SentenceMaps(s["id"], s["source"], s["decoder_input"], s["target"], s["maps"])
            for s in self.meta["sentences"]
        }

    def _refuse(self, why: str):
        raise DumpError(f"{self.path}: {why}; not a dump ea-fairseq-analysis dump wrote: make the dump again")

    def _disjoint(self) -> None:
        """Refuse a zip whose members share compressed bytes (an overlapping zip bomb: each
        member's expansion bounded, their number not): each member's data ends before the next
        member's header."""
        zf = getattr(self._npz, "zip", None)
        infos = sorted(zf.infolist(), key=lambda i: i.header_offset) if zf else []
        for a, b in zip(infos, infos[1:]):
            if a.header_offset + 30 + len(a.orig_filename.encode()) + a.compress_size > b.header_offset:
                self._refuse(f"the members {a.filename} and {b.filename} overlap")

    def _header(self, key: str) -> Tuple[tuple, bool, np.dtype, int]:
        """Member ``key``'s array as its ``.npy`` header declares it: (shape, Fortran order, dtype,
        where the data begins), inflating the header only."""
        with self._npz.zip.open(key + ".npy") as f:
            version = np.lib.format.read_magic(f)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            return (*read(f), f.tell())

    def _stored_size(self, key: str, limit: int) -> Optional[Tuple[tuple, bool, np.dtype, int]]:
        """Refuse member ``key`` unless it inflates to at most :data:`LIMIT_EXPANSION` bytes a
        compressed byte (above :data:`LIMIT_PLAIN`) and ``limit`` bytes, from the zip's sizes,
        before anything is inflated; and unless the array its header declares is what the
        member holds: numpy allocates the declared array before it reads. Its :meth:`_header`."""
        zf, name = getattr(self._npz, "zip", None), key + ".npy"
        if zf is None or name not in zf.namelist():
            return None  # (not stored: the caller's KeyError)
        info = zf.getinfo(name)
        if info.file_size > max(LIMIT_PLAIN, LIMIT_EXPANSION * info.compress_size) or info.file_size > limit + 4096:
            self._refuse(f"{key} inflates from {info.compress_size:,} compressed bytes to {info.file_size:,}, over "
                         f"the {LIMIT_EXPANSION} a compressed byte deflate reaches (or the {limit:,} bytes a "
                         "dump's maps take)")
        header = shape, _, dtype, start = self._header(key)
        declared, stored = int(np.prod(shape, dtype=object)) * dtype.itemsize, info.file_size - start
        if declared > limit or declared != stored:
            raise DumpError(f"{self.path}: {key} declares a {'x'.join(map(str, shape)) or 'scalar'} {dtype} "
                            f"array ({declared} bytes) but holds {stored} bytes" + (
                                f", over the {limit} bytes a dump holds there" if declared > limit else "")
                            + "; not a dump ea-fairseq-analysis dump wrote: make the dump again")
        return header

    def _inflating(self, key: str) -> None:
        """Count member ``key`` as read; refused if it brings the members read to more than
        :data:`LIMIT_INFLATED` bytes inflated."""
        size = self._npz.zip.getinfo(key + ".npy").file_size
        if self._inflated + size > LIMIT_INFLATED:
            raise DumpError(f"{self.path}: {key} would bring the maps read to {self._inflated + size:,} "
                            f"bytes, over the {LIMIT_INFLATED:,} one command reads from a dump; pick some with "
                            "--sentence, --attention or --kind")
        self._inflated += size

    def _key(self, sid: int, attention: str, kind: str) -> str:
        key = f"{sid}/{attention}/{kind}"
        if key not in self._npz.files:
            known = self.sentences[sid].kinds.get(attention) if sid in self.sentences else None
            raise KeyError(f"{key} not in {self.path} (sentence ids {sorted(self.sentences)}; "
                           f"kinds of {attention}: {known})")
        return key

    def shape(self, sid: int, attention: str, kind: str = "weights") -> tuple:
        """The shape of a map, as its member holds it (:meth:`_stored_size`), nothing inflated but
        its header."""
        return self._stored_size(self._key(sid, attention, kind), LIMIT_MAP_ELEMENTS * 4)[0]

    def get(self, sid: int, attention: str, kind: str = "weights", part=None) -> np.ndarray:
        """A map, (layers, heads, queries, keys); with ``part`` (layer indices, head indices,
        query slice, key slice) only that part of it, taken from the rows it spans as the member
        inflates: what a figure draws is what it holds in memory, whatever the map declares."""
        key = self._key(sid, attention, kind)
        shape, fortran, dtype, start = self._stored_size(key, LIMIT_MAP_ELEMENTS * 4)
        self._inflating(key)
        if part is None:
            return self._npz[key]
        if len(shape) != 4 or fortran:
            self._refuse(f"{key} is not a (layers, heads, queries, keys) map in C order")
        layers, heads, rows, cols = part
        n_layers, n_heads, n_queries, n_keys = shape
        layers, heads = np.arange(n_layers)[layers], np.arange(n_heads)[heads]  # (numpy's IndexError)
        first, last, step = rows.indices(n_queries)
        if step != 1:
            raise ValueError("a part's queries are a slice of consecutive rows")
        count, row = max(0, last - first), n_keys * dtype.itemsize
        out = np.empty((len(layers), len(heads), count, len(range(n_keys)[cols])), dtype)
        blocks = sorted(((layer * n_heads + head) * n_queries + first, i, j)
                        for i, layer in enumerate(layers) for j, head in enumerate(heads))
        with self._npz.zip.open(key + ".npy") as f:
            for offset, i, j in blocks:  # forward only: the member inflates once
                f.seek(start + offset * row)
                out[i, j] = np.frombuffer(f.read(count * row), dtype).reshape(count, n_keys)[:, cols]
        return out

    def axis_tokens(self, sid: int, attention: str) -> Tuple[List[str], List[str]]:
        """(row labels, column labels) of ``attention`` for sentence ``sid``."""
        s = self.sentences[sid]
        if attention.startswith("encoder"):
            return s.source, s.source
        if attention == "decoder.cross":
            return s.target, s.source
        return s.target, s.decoder_input
