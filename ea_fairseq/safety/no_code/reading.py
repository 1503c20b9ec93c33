"""Reading a checkpoint file: torch's weights-only unpickler, the classes of a fairseq
configuration and numpy's names for numeric values allow-listed only while a checkpoint is
read, no omegaconf value resolved while the file is unpickled, the archive read as torch reads
it (its own zip reader) and refused where a record would expand beyond the file; damaged files
reported as such."""
import argparse
import collections
import contextlib
import os
import re
import stat
import threading
import typing
from typing import Any, Dict, Iterator, List, Optional

import torch

from ...errors import CheckpointError, CorruptCheckpointError, UnsafeCheckpointError  # noqa: F401  (re-exported)
from ..confined import ConfinedPathError, inside


def fairseq_checkpoint_globals() -> List[Any]:
    """The classes a fairseq checkpoint's configuration is made of.

    ``fairseq-train`` writes its options as an ``argparse.Namespace``; checkpoints written
    through hydra or by older fairseq keep omegaconf containers, whose node classes are
    listed too. None of them runs code when unpickled, and :func:`sanitize` reads their
    stored content without calling any of their methods.
    """
    from omegaconf import DictConfig, ListConfig, nodes
    from omegaconf.base import ContainerMetadata, Metadata

    return [argparse.Namespace, DictConfig, ListConfig, ContainerMetadata, Metadata, nodes.AnyNode,
            typing.Any, collections.defaultdict, dict, list, int, str, float, bool]  # builtins: omegaconf metadata


def numpy_checkpoint_globals() -> List[Any]:
    """What unpickling numeric numpy arrays and scalars needs (fairseq's ``--eval-bleu`` keeps
    its BLEU counts as numpy values): numpy's names, resolving to the checked functions of
    :mod:`.numpy_values`, and the dtype classes of booleans and numbers."""
    from .numpy_values import allowed_globals

    return allowed_globals()


class _WhileAnyThreadNeedsIt:
    """A process-wide change (``enter()`` returns what ``leave(...)`` undoes) made while at
    least one thread is inside :meth:`held`: made by the first, undone by the last (counted
    under a lock), so that one thread leaving never undoes it under another."""

    def __init__(self, enter, leave):
        self._enter, self._leave = enter, leave
        self._lock = threading.Lock()
        self._count, self._undo = 0, None

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        with self._lock:
            if self._count == 0:
                self._undo = self._enter()
            self._count += 1
        try:
            yield
        finally:
            with self._lock:
                self._count -= 1
                if self._count == 0:
                    self._leave(self._undo)


def checkpoint_globals() -> List[Any]:
    """Every class a fairseq checkpoint may name, as torch's weights-only allow-list takes them."""
    return fairseq_checkpoint_globals() + numpy_checkpoint_globals()


def _allow_checkpoint_globals():
    allowed = checkpoint_globals()
    if not hasattr(torch.serialization, "get_safe_globals"):
        # torch 2.4 has the allow-list but no way to read it back: there the classes stay
        # allow-listed for the process.
        torch.serialization.add_safe_globals(allowed)
        return None
    before = torch.serialization.get_safe_globals()
    added = [g for g in allowed if g not in before]
    torch.serialization.add_safe_globals(added)
    return added


def _disallow(added) -> None:
    if added is None:
        return
    kept = [g for g in torch.serialization.get_safe_globals() if g not in added]
    torch.serialization.clear_safe_globals()
    torch.serialization.add_safe_globals(kept)


_allow_list = _WhileAnyThreadNeedsIt(_allow_checkpoint_globals, _disallow)


@contextlib.contextmanager
def checkpoint_globals_allowed() -> Iterator[None]:
    """Allow-list :func:`fairseq_checkpoint_globals` and :func:`numpy_checkpoint_globals`
    for weights-only loads in this block (a numpy array loads as a
    :class:`~.numpy_values.PendingArray`: :func:`~.hook.sanitize` puts its array in its place).

    torch keeps one allow-list per process: they are on it while any thread is in such a
    block, and come off when the last one leaves (what was allow-listed before stays)."""
    with _allow_list.held():
        yield


def _corrupt(path: str, cause: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{path}: corrupt or not a checkpoint: {cause}")


class _InterpolationDuringLoad(Exception):
    pass


_unpickling = threading.local()  # .attempted: set in a thread while it unpickles a checkpoint


#: the row of :mod:`ea_fairseq.side_effects` the gate is
GATED = "omegaconf.base:Container._maybe_resolve_interpolation"


def resolution_gate(original):
    """omegaconf's interpolation resolution (``original``) behind a gate: it refuses in a
    thread that is unpickling a checkpoint (:func:`_no_interpolation_resolved`) and resolves
    as omegaconf does in every other thread."""

    def gate(self, parent, key, value, *args, **kwargs):
        attempted = getattr(_unpickling, "attempted", None)
        if attempted is None:
            return original(self, parent, key, value, *args, **kwargs)
        attempted.append(str(getattr(value, "_value", lambda: value)()))
        raise _InterpolationDuringLoad(attempted[-1])

    return gate


def _gate_resolution():
    from ... import side_effects

    return side_effects.replace(GATED)


def _ungate_resolution(original) -> None:
    from ... import side_effects

    side_effects.restore(GATED, original)


_resolution_gate = _WhileAnyThreadNeedsIt(_gate_resolution, _ungate_resolution)


@contextlib.contextmanager
def _no_interpolation_resolved() -> Iterator[List[str]]:
    """While this thread unpickles a file, omegaconf resolves no interpolation in it: an
    allow-listed class called on an omegaconf container (``dict(DictConfig)``) would otherwise
    resolve its ``${...}`` (environment variables, exponential string chains) inside
    ``torch.load``, before the configuration is read. Yields the interpolations that were
    attempted. omegaconf has no switch for this: the gate is a class attribute, in place
    while any thread reads a checkpoint, refusing only in the threads that do."""
    attempted: List[str] = []
    outer = getattr(_unpickling, "attempted", None)
    with _resolution_gate.held():
        _unpickling.attempted = attempted
        try:
            yield attempted
        finally:
            _unpickling.attempted = outer


def read_checkpoint(path: str, source: Optional[str] = None) -> Dict[str, Any]:
    """The state stored in the checkpoint file ``path``, read weights-only onto the CPU
    (``source``: the name used in messages). Not yet sanitized: a numpy array is still a
    :class:`~.numpy_values.PendingArray` (the walk puts its array in its place)."""
    source = source or str(path)
    mode = os.stat(path).st_mode  # FileNotFoundError as it is; a symbolic link followed
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):  # (a directory: IsADirectoryError below)
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a character device" if stat.S_ISCHR(mode) else \
            "a block device" if stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode) else "not a file"
        raise _corrupt(source, f"not a regular file ({kind}); a checkpoint is a file torch.save wrote")
    if stat.S_ISREG(mode):  # read inside its own directory (a model dir, a save dir someone sent)
        try:
            path = inside(path)
        except ConfinedPathError as err:
            raise UnsafeCheckpointError(f"{source}: refused: {err}. Nothing in the checkpoint was run.") from None
    size = os.path.getsize(path)
    if size == 0:
        raise _corrupt(source, "the file is empty (0 bytes; a run that stopped while saving leaves one)")
    with open(path, "rb") as f:
        head = f.read(16)
    if head.startswith(ZIP_RECORD):  # torch reads a zip archive where the file begins with a record, and
        _check_records(path, size, source)  # a pickle (its legacy format) otherwise: so is it read here
    elif head.startswith(b"PK"):
        raise _corrupt(source, "a zip archive that does not begin with a record (torch reads only the archives "
                               "torch.save writes)")
    elif not head.startswith(b"\x80"):  # torch's legacy format is a pickle (protocol 2)
        raise _corrupt(source, "not a torch checkpoint (torch reads a zip archive where the file begins with one, "
                               "a pickle otherwise; it begins with neither)")
    with checkpoint_globals_allowed(), _no_interpolation_resolved() as resolved:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except (FileNotFoundError, IsADirectoryError, PermissionError):
            raise
        except Exception as err:
            if resolved:
                raise UnsafeCheckpointError(
                    f"{source}: refused: unpickling it reads the values of an omegaconf container "
                    f"({_shown(resolved[0])}, ...), which resolves their interpolations; a checkpoint "
                    "never does that (it calls an allow-listed class on a configuration while it is "
                    "unpickled). Nothing in the checkpoint was run.") from None
            raise _classify_load_error(source, err) from err
    if not isinstance(state, dict):
        raise _corrupt(source, f"it holds a {type(state).__name__}, not a fairseq checkpoint (a dict)")
    return state


ZIP_RECORD = b"PK\x03\x04"  # what torch.load tests the start of a file for


def _check_records(path: str, size: int, source: str) -> None:
    """The archive as torch reads it (its own zip reader, the one ``torch.load`` opens): every
    record's bytes, as many as torch's reader says it holds, lie in the file between its header
    and the next record's, so that no record expands beyond the file (torch.save stores records
    uncompressed, one after the other) and what is checked is what torch loads."""
    try:
        reader = torch._C.PyTorchFileReader(path)
        records = sorted((reader.get_record_header_offset(name), reader.get_record_offset(name),
                          reader.get_record_size(name), name) for name in reader.get_all_records())
    except RuntimeError as err:
        cause = str(err).split(". This is an internal")[0]
        if "central directory" in cause:
            raise _corrupt(source, "a zip archive without its central directory (truncated: the file was cut "
                                   "short or is still being written)") from err
        raise _corrupt(source, f"a damaged zip archive ({cause[:200]})") from err
    for i, (header, start, length, name) in enumerate(records):
        room = (records[i + 1][0] if i + 1 < len(records) else size) - start
        if not header <= start <= size or length > room:
            raise UnsafeCheckpointError(
                f"{source}: refused: torch reads its record {_shown(name)} as {length} bytes, where the file holds "
                f"{max(room, 0)} bytes for it (compressed records, or records that overlap or lie outside the file), "
                "which torch.save never writes: torch would allocate what the record declares, beyond the file's "
                "size. Nothing in the checkpoint was run.")


def _classify_load_error(source: str, err: Exception) -> CheckpointError:
    from .numpy_values import NumpyValueRefused

    if isinstance(err, NumpyValueRefused):
        return UnsafeCheckpointError(f"{source}: refused: it holds {err}. Nothing in it was run.")
    text = str(err)
    found = (re.search(r"GLOBAL ([\w.]+)", text) or re.search(r"(?:Can only build|Can only create new object)"
                                                           r".*? but got <class '([\w.]+)'>", text))
    if found:  # the unpickler met a class it does not allow (or fill in): a refusal, not damage
        return UnsafeCheckpointError(
            f"{source}: refused: the file holds an object of {found.group(1)}, which torch's "
            "weights-only loader does not unpickle (a checkpoint is read as tensors, numeric numpy "
            "values and a fairseq configuration only, so that loading it cannot run code). Nothing in it was run.")
    detail = re.search(r"WeightsUnpickler error:\s*(.*?)(?:\n\n|$)", text, re.S)
    cause = detail.group(1).strip() if detail else text.split(". This is an internal")[0].strip()
    cause = f"{type(err).__name__}: {cause}" if cause else type(err).__name__
    if isinstance(err, EOFError):
        cause = "the file ends early (EOFError)"
    return _corrupt(source, cause[:300])




def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 100 else text[:97] + "..."
