"""Principle 4, every writer is safe: every output into a directory goes to a new temporary file
(``O_EXCL``, in the destination's directory) renamed into place, so a link planted under the
output's name is replaced, never written through.

:func:`replaced` is the one writer; fairseq's checkpoint saver and the plugin's tools write
through it, and the recipes' shell redirections through ``scripts/safe_write.py``.
"""
import argparse
import contextlib
import os
import shutil
import tempfile
from typing import IO, Iterator, List


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def replaced(path, mode: str = "wb", **kwargs) -> Iterator[IO]:
    """A file object on a new file beside ``path`` (created exclusively, never through a link),
    renamed onto ``path`` when the block ends without an error, removed when it raises."""
    path = os.fspath(path)
    directory, name = os.path.split(path)
    fd, tmp = tempfile.mkstemp(dir=directory or ".", prefix=f".{name}.", suffix=".tmp")  # O_EXCL | O_NOFOLLOW
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with open(fd, mode, **kwargs) as f:
            yield f
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_bytes(path, data: bytes) -> None:
    with replaced(path, "wb") as f:
        f.write(data)


def write_text(path, text: str) -> None:
    with replaced(path, "w", encoding="utf-8") as f:
        f.write(text)


def checkpoint_path_manager(path_manager: type) -> type:
    """fairseq's ``PathManager`` as ``fairseq.checkpoint_utils`` sees it (a row of
    :data:`ea_fairseq.side_effects.SIDE_EFFECTS`): on a local path, what it opens for writing
    (``torch_persistent_save``'s file, synchronously where asked to write asynchronously) and
    what it copies (checkpoint_best/last and the other names of a saved checkpoint) are written
    by :func:`replaced`; any other call, and any path of an iopath backend, is fairseq's."""

    def local(path) -> bool:
        return not path_manager.path_requires_pathmanager(os.fspath(path))

    class WritingByRename(path_manager):
        @staticmethod
        def open(path, mode="r", *args, **kwargs):
            if "w" in mode and local(path):
                return replaced(path, mode, *args, **kwargs)
            return path_manager.open(path, mode, *args, **kwargs)

        @staticmethod
        def opena(path, mode="r", *args, **kwargs):
            if "w" in mode and local(path):
                return replaced(path, mode, *args, **kwargs)
            return path_manager.opena(path, mode, *args, **kwargs)

        @staticmethod
        def copy(src_path, dst_path, overwrite=False):
            if not local(src_path) or not local(dst_path):
                return path_manager.copy(src_path, dst_path, overwrite)
            if not overwrite and os.path.lexists(dst_path):
                return False
            with open(src_path, "rb") as src, replaced(dst_path) as dst:
                shutil.copyfileobj(src, dst)
            return True

    return WritingByRename


def checkpoint_directory_probe(verify_checkpoint_directory):
    """fairseq's ``verify_checkpoint_directory`` opens ``SAVE_DIR/dummy`` with ``open(.., "w")``,
    truncating what a link of that name points to: the same check (the save dir can be created
    and written in), by a new file created exclusively and removed."""

    def verify(save_dir: str) -> None:
        os.makedirs(save_dir, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=save_dir, prefix=".dummy.")
        os.close(fd)
        os.unlink(probe)

    return verify


def _command_outputs(cfg) -> List[str]:
    """The files fairseq's command line opens for writing by the name its configuration gives:
    ``--log-file`` (fairseq-train appends to it) and ``--results-path``'s
    ``generate-SUBSET.txt`` (fairseq-generate truncates it)."""
    def field(section: str, name: str):
        return getattr(cfg if isinstance(cfg, argparse.Namespace) else getattr(cfg, section, None), name, None)

    outputs = [field("common", "log_file")]
    results = field("common_eval", "results_path")
    if results is not None:
        outputs.append(os.path.join(results, f"generate-{field('dataset', 'gen_subset')}.txt"))
    return [path for path in outputs if path]


def command_outputs_not_linked(main):
    """fairseq-train's and fairseq-generate's ``main`` (rows of
    :data:`ea_fairseq.side_effects.SIDE_EFFECTS`): before fairseq opens an output the
    configuration names (:func:`_command_outputs`) with the builtin ``open`` or a
    ``logging.FileHandler``, a link planted under its name is replaced by a new empty file, so
    fairseq writes or appends to a file of its own; a regular file is left as it is. The
    checkpoints the command names bound the dictionaries it reads before them
    (:func:`ea_fairseq.safety.budget.checkpoints_named`)."""

    def run(cfg, *args, **kwargs):
        from .budget import checkpoints_named

        for path in _command_outputs(cfg):
            if os.path.islink(path):
                write_bytes(path, b"")
        with checkpoints_named(cfg):
            return main(cfg, *args, **kwargs)

    return run
