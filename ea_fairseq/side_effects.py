"""Everything loading the plugin changes outside the plugin: one table, installed by one call.

fairseq offers hooks for registering models, architectures and tasks, and the plugin uses
them (``register_model``, ``register_model_architecture``, ``register_task``: new names
added, none replaced). Where fairseq has no hook, the plugin replaces an attribute of
fairseq, of the standard library or of omegaconf; each such replacement is a row of
:data:`SIDE_EFFECTS`, and :func:`install` (called once by :func:`ea_fairseq.load_plugin`) makes
the permanent ones. This module is the only place the plugin assigns to another package's
module, class or registry; a test compares fairseq's modules before and after the plugin is
imported, so a replacement made anywhere else fails it (``tests/cli/test_side_effects.py``).

Each row names

* ``target``: what is replaced, ``module:attribute`` (``module:Class.attribute`` for a class
  attribute, ``module:REGISTRY[selector]`` for the registry items whose value is
  ``selector``), or, for the rows that change no attribute (``how`` ``"call"``), what changes;
* ``replacement``: ``module:name`` of what makes the new value: a function given the original
  value, returning what takes its place; for ``how="call"``, the function that makes the change;
* ``why``: one line; docs/fairseq-internals.md section 2 says what each relies on and which
  tests fail if fairseq changes;
* ``scope``: :data:`EVERY_PROCESS` (installed whenever the plugin is loaded),
  :data:`SERVED_COMMAND_LINES` (only in a process that runs a command line the plugin serves:
  :func:`ea_fairseq.errors.serving_command_line`), or a scoped change made and undone by the
  plugin's code around one operation (:data:`WHILE_FAIRSEQ_IS_IMPORTED`,
  :data:`WHILE_A_CHECKPOINT_IS_READ`), which :func:`install` does not make.

A replaced value keeps the original as ``__wrapped__`` and names its row in
``ea_fairseq_replaces`` (:func:`original` returns it); installing twice changes nothing.
"""
import atexit
import contextlib
import importlib
import logging
import queue
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

EVERY_PROCESS = "every process"
SERVED_COMMAND_LINES = "command lines the plugin serves"
WHILE_FAIRSEQ_IS_IMPORTED = "while fairseq is imported"
WHILE_A_CHECKPOINT_IS_READ = "while any thread reads a checkpoint"

#: the attribute a replacement carries: the row (``target``) it was installed for
MARK = "ea_fairseq_replaces"


@dataclass(frozen=True)
class SideEffect:
    target: str
    replacement: str
    why: str
    scope: str
    how: str = "attribute"  # "attribute", "registry items" or "call"


SIDE_EFFECTS: Tuple[SideEffect, ...] = (
    SideEffect("fairseq.checkpoint_utils:load_checkpoint_to_cpu",
               "ea_fairseq.safety.no_code.hook:checkpoint_loader",
               "every checkpoint fairseq's tools, trainer and hub load is read weights-only and sanitized "
               "before fairseq converts or evaluates any of it", EVERY_PROCESS),
    SideEffect("fairseq.checkpoint_utils:torch",
               "ea_fairseq.safety.no_code.hook:torch_for_checkpoint_utils",
               "inside that loader, in its thread, fairseq's torch.load returns the sanitized state instead "
               "of unpickling the file again; torch itself everywhere else", EVERY_PROCESS),
    SideEffect("fairseq.checkpoint_utils:load_model_ensemble_and_task", "ea_fairseq.safety.budget:loading_budgeted",
               "what loading a checkpoint builds after reading it (its task's build_model, the model's "
               "load_state_dict and the upgrades there: classification heads) is under that checkpoint's budget "
               "until the call returns (the hub, fairseq-generate, -interactive, -validate, -eval-lm load through it)",
               EVERY_PROCESS),
    SideEffect("fairseq.models:build_model", "ea_fairseq.safety.budget:build_model",
               "a model fairseq builds from a checkpoint (every task's build_model calls this) is built under "
               "the budget of the weights this thread read last: nothing is allocated past it", EVERY_PROCESS),
    SideEffect("fairseq.checkpoint_utils:PathManager", "ea_fairseq.safety.writers:checkpoint_path_manager",
               "the checkpoints fairseq saves and copies are new files renamed into place, never written "
               "through a link planted in the save dir", EVERY_PROCESS),
    SideEffect("fairseq.checkpoint_utils:verify_checkpoint_directory",
               "ea_fairseq.safety.writers:checkpoint_directory_probe",
               "fairseq-train's check that the save dir is writable creates a new file instead of truncating "
               "what SAVE_DIR/dummy links to", EVERY_PROCESS),
    SideEffect("fairseq.file_utils:load_archive_file", "ea_fairseq.safety.archives:archive_loader",
               "the hub extracts a model or data archive only into a fresh folder, its members checked",
               EVERY_PROCESS),
    SideEffect("fairseq.data.data_utils:load_indexed_dataset", "ea_fairseq.safety.data_files:split_checks",
               "every binary split is checked against its index before fairseq opens it", EVERY_PROCESS),
    SideEffect("fairseq.data.indexed_dataset:make_dataset", "ea_fairseq.safety.data_files:format_check",
               "only the dataset formats whose files are checked are read", EVERY_PROCESS),
    SideEffect("fairseq.data.data_utils:infer_language_pair", "ea_fairseq.safety.data_files:directory_check",
               "a data directory fairseq lists for its language pair that is not there is named as such",
               EVERY_PROCESS),
    SideEffect("fairseq.data.dictionary:Dictionary.add_from_file", "ea_fairseq.safety.data_files:dictionary_check",
               "a dictionary file is a regular file of bounded size before fairseq reads it", EVERY_PROCESS),
    SideEffect("fairseq.data.encoders:build_bpe", "ea_fairseq.safety.data_files:bpe_check",
               "the BPE's files are regular files of bounded size before fairseq's BPE reads them",
               EVERY_PROCESS),
    SideEffect("fairseq.models:ARCH_MODEL_REGISTRY[fairseq.models.transformer:TransformerModel]",
               "ea_fairseq.models.baseline:with_plugin_options",
               "fairseq's transformer archs take --drop-attention and --no-{encoder,decoder}-positional-"
               "embeddings (DropAttention's and RAN Table 2's settings); without them the model built is "
               "fairseq's TransformerModel itself", EVERY_PROCESS, how="registry items"),
    SideEffect("fairseq_cli.train:main", "ea_fairseq.safety.writers:command_outputs_not_linked",
               "fairseq-train's --log-file, which it appends to, is a file of its own, never written through a "
               "link planted under that name", SERVED_COMMAND_LINES),
    SideEffect("fairseq_cli.generate:main", "ea_fairseq.safety.writers:command_outputs_not_linked",
               "fairseq-generate's --results-path output is a file of its own, never written through a link "
               "planted under that name; the checkpoints it names bound the dictionaries it reads before them",
               SERVED_COMMAND_LINES),
    SideEffect("sys:excepthook", "ea_fairseq.errors:chained_excepthook",
               "the plugin's option errors and checkpoint refusals print as one line, as argparse's do",
               SERVED_COMMAND_LINES),
    SideEffect("fairseq.distributed.utils:call_main", "ea_fairseq.device_checks:checked_call_main",
               "a run the machine cannot run (fairseq-train --fp16 without a CUDA GPU, --bf16 without torch_xla, "
               "a world size above its GPUs) is one line before fairseq writes its save dir or starts processes; "
               "the checkpoints it names bound the dictionaries it reads before them",
               SERVED_COMMAND_LINES),
    SideEffect("argparse:ArgumentParser.error", "ea_fairseq.errors:parser_error",
               "a refused command line is argparse's error line without the usage; an --arch or an option the "
               "parser does not know names the closest one, not every arch's name", SERVED_COMMAND_LINES),
    SideEffect("warnings filters and the 'hydra' logger's level", "ea_fairseq.known_warnings:install",
               "the warnings fairseq's stack prints on every run that say nothing about it are not shown",
               SERVED_COMMAND_LINES, how="call"),
    SideEffect("fairseq's batch-prefetch threads (fairseq.data.iterators:BackgroundConsumer) at exit",
               "ea_fairseq.side_effects:prefetching_finished_at_exit",
               "a command line that stops mid-epoch (--max-update) exits with its status instead of aborting "
               "when Python finalizes while the prefetch thread is inside torch", SERVED_COMMAND_LINES, how="call"),
    SideEffect("fairseq.checkpoint_utils:load_model_ensemble", "ea_fairseq.tasks.direction:direction_checked",
               "a checkpoint decoded in another direction than its --source-lang/--target-lang (fairseq-generate "
               "-s/-t the other way round on a joint dictionary) is one warning line; the loading is fairseq's",
               SERVED_COMMAND_LINES),
    SideEffect("the root logger's level and logging.disable", "ea_fairseq.side_effects:fairseq_imported_quietly",
               "fairseq's import sets the root logger to DEBUG and logs a tensorboardX hint: put back, not shown",
               WHILE_FAIRSEQ_IS_IMPORTED, how="call"),
    SideEffect("torch's weights-only allow-list (torch.serialization.add_safe_globals)",
               "ea_fairseq.safety.no_code.reading:checkpoint_globals_allowed",
               "a checkpoint's configuration classes and numpy's names for numbers unpickle; the plugin's "
               "additions come off when the last reading thread is done", WHILE_A_CHECKPOINT_IS_READ, how="call"),
    SideEffect("omegaconf.base:Container._maybe_resolve_interpolation",
               "ea_fairseq.safety.no_code.reading:resolution_gate",
               "no omegaconf interpolation (environment variables, string chains) resolves inside torch.load "
               "in a thread that unpickles a checkpoint; other threads resolve as omegaconf does",
               WHILE_A_CHECKPOINT_IS_READ),
)


#: the plugin's package as this process loaded it: ``ea_fairseq``, or the name of the folder
#: fairseq's ``--user-dir`` gave it (the table's ``ea_fairseq.`` names are this package's
#: modules, never a second copy of the plugin imported under its own name)
PLUGIN = __name__.rpartition(".")[0]


def _named(dotted: str) -> Any:
    module, _, name = dotted.partition(":")
    if module.split(".")[0] == "ea_fairseq":
        module = PLUGIN + module[len("ea_fairseq"):]
    value = importlib.import_module(module)
    for part in name.split(".") if name else ():
        value = getattr(value, part)
    return value


def _owner(target: str) -> Tuple[Any, str]:
    module, _, name = target.partition(":")
    path, _, attribute = name.rpartition(".")
    return _named(f"{module}:{path}"), attribute


def _row(target: str) -> SideEffect:
    return next(row for row in SIDE_EFFECTS if row.target == target)


def replace(target: str, value: Any = None) -> Any:
    """Put the replacement of row ``target`` in place (``value``, or what the row's
    ``replacement`` makes of the original); the original is returned, and kept as the new
    value's ``__wrapped__``. Nothing is done (the original is still returned) where the row's
    replacement is already there."""
    owner, attribute = _owner(target)
    current = getattr(owner, attribute)
    if getattr(current, MARK, None) == target:
        return current.__wrapped__
    if value is None:
        value = _named(_row(target).replacement)(current)
    setattr(value, MARK, target)
    value.__wrapped__ = current
    setattr(owner, attribute, value)
    return current


def restore(target: str, original: Any) -> None:
    """Put ``original`` back in place of row ``target``'s replacement (the scoped rows)."""
    owner, attribute = _owner(target)
    setattr(owner, attribute, original)


_replaced_items: Dict[Tuple[str, str], Any] = {}  # (row, key): the registry's original value


def _replace_items(row: SideEffect) -> None:
    registry, _, selector = row.target.partition("[")
    registry = _named(registry)
    selected = _named(selector.rstrip("]"))
    make = _named(row.replacement)
    for key, value in list(registry.items()):
        if value is selected:
            registry[key] = make(value)
            _replaced_items[(row.target, key)] = value


def original(target: str, key: Optional[str] = None) -> Any:
    """What row ``target`` replaced (for a registry row, the item ``key``'s original value)."""
    if key is not None:
        return _replaced_items[(target, key)]
    owner, attribute = _owner(target)
    current = getattr(owner, attribute)
    return current.__wrapped__ if getattr(current, MARK, None) == target else current


def installed(serving_command_line: bool) -> List[SideEffect]:
    """The rows :func:`install` makes in such a process."""
    scopes = (EVERY_PROCESS, SERVED_COMMAND_LINES) if serving_command_line else (EVERY_PROCESS,)
    return [row for row in SIDE_EFFECTS if row.scope in scopes]


def install(serving_command_line: bool) -> None:
    """Make the replacements of :data:`EVERY_PROCESS`, and of :data:`SERVED_COMMAND_LINES` when
    ``serving_command_line``. Idempotent."""
    for row in installed(serving_command_line):
        if row.how == "attribute":
            replace(row.target)
        elif row.how == "registry items":
            _replace_items(row)
        else:
            _named(row.replacement)()


@contextlib.contextmanager
def fairseq_imported_quietly() -> Iterator[None]:
    """The first import of fairseq in this block shows no message below WARNING and leaves the
    root logger's level as it was (fairseq's import calls ``logging.basicConfig`` at DEBUG, in
    ``fairseq.models.wav2vec``)."""
    root = logging.getLogger()
    level, disabled = root.level, logging.root.manager.disable
    first = "fairseq" not in sys.modules
    if first:
        logging.disable(logging.INFO)
    try:
        yield
    finally:
        if first:
            logging.disable(disabled)
            root.setLevel(level)


PREFETCH_WAIT_S = 30.0  # the most the exit waits for fairseq's prefetch threads, in all


def prefetching_finished_at_exit() -> None:
    """At exit, let fairseq's prefetch threads finish the batch they are making and stop.

    ``BufferedIterator`` (``--data-buffer-size``, 10 by default) fills its queue from a daemon
    thread. When a run stops mid-epoch, Python finalizes while that thread may be inside a torch
    call; CPython (before 3.14) ends such a thread with ``pthread_exit`` where it next takes the
    GIL, which unwinds through a ``noexcept`` C++ frame: ``terminate called without an active
    exception``, status 134, after the run has finished and saved. This registers (once) an
    ``atexit`` function, which runs before daemon threads are ended: it tells each live consumer
    to stop after its current item (its ``_max_len``), empties its queue so that it can put it,
    and joins it, :data:`PREFETCH_WAIT_S` at most."""
    atexit.unregister(_finish_prefetching)
    atexit.register(_finish_prefetching)


def _finish_prefetching() -> None:
    iterators = sys.modules.get("fairseq.data.iterators")
    if iterators is None:
        return
    deadline = time.monotonic() + PREFETCH_WAIT_S
    for thread in threading.enumerate():
        if not isinstance(thread, iterators.BackgroundConsumer):
            continue
        thread._max_len = 0
        while thread.is_alive() and time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):
                while True:
                    thread._queue.get_nowait()
            thread.join(0.01)
