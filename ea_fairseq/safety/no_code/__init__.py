"""Principle 1, no code: fairseq checkpoints load without letting them run code.

A checkpoint is input. It is read once and handed to fairseq only after the configuration
fairseq receives has been generated here from it (docs/safety.md):

1. **Reading** (:mod:`.reading`): torch's weights-only unpickler, never switched off; the
   classes of a fairseq configuration, and numpy's names for arrays and scalars of
   booleans and numbers (fairseq's ``--eval-bleu`` counts) resolving to checked functions
   (:mod:`.numpy_values`: made from a type code and the bytes stored, nothing else),
   allow-listed only while a checkpoint is read; no omegaconf value resolved while the file is
   unpickled; compressed records refused; the file read inside its own directory
   (:mod:`ea_fairseq.safety.confined`); a file that is empty, truncated or not a torch
   checkpoint reported as such (:class:`CorruptCheckpointError`), not as a refusal.
2. **Plain data** (:mod:`.plain`): the configuration rebuilt from ``None``, booleans, numbers,
   strings and lists, dicts and Namespaces of them, walked once with depth and size bounded;
   no string holding ``${``, and none that, read as Python
   (families ``eval()`` fields of their own that no list here can be sure to hold), calls a
   function or builds a value beyond the literal bounds; every tensor within its storage; outside the configuration,
   numpy values only arrays and scalars of booleans and numbers, counted by their elements.
3. **A generated configuration** (:mod:`.schema`, :mod:`.model`): every section built field by
   field from fairseq's dataclasses and the model's own option table (any family: a
   transformer's fields typed by ``TransformerConfig``, another's by its options and its
   architecture's defaults), each value converted to the field's declared type, unknown fields
   dropped, the legacy ``args`` layout converted into the same form (fairseq never converts it
   itself); evaluated fields (:data:`EVALUATED_FIELDS`) written here as ``repr()`` of a checked
   literal (:mod:`.literals`); the result checked as fairseq receives it (``OmegaConf.create``):
   no interpolation anywhere.
4. **Neutralised where they act** (principle 5): the checkpoint's ``generation`` section is not
   applied, paths fairseq would open while loading (:data:`PATH_FIELDS`, and a task's fields
   naming files elsewhere) are not honoured (logged).
5. **The weights and the training state** (:mod:`.consistency`), where the caller builds the
   model: the configured model, built on ``meta`` under the budget of its weights
   (:mod:`ea_fairseq.safety.budget`), must take them; the meters ``--restore-file`` reads back
   (which fairseq calls by name) must be fairseq's, and the counts it reads numbers.

:func:`~.hook.checkpoint_loader` (installed when the plugin is loaded:
:mod:`ea_fairseq.side_effects`) puts this in front of
``fairseq.checkpoint_utils.load_checkpoint_to_cpu``, through which fairseq's command-line
tools, ``--restore-file``/``--finetune-from-model`` and the hub read a checkpoint;
:func:`load_checkpoint` does the same for the plugin's own tools.
"""
from .fields import LIMIT_POSITIONS
from .hook import load_checkpoint, nonfinite_weights, sanitize
from .literals import EVALUATED_FIELDS, LIMIT_CHARS, LIMIT_ITEMS, Form
from .plain import LIMIT_AMPLIFICATION, LIMIT_CONFIG_NODES, LIMIT_DEPTH, LIMIT_STATE_NODES
from .reading import (CheckpointError, CorruptCheckpointError, UnsafeCheckpointError,
                      checkpoint_globals, checkpoint_globals_allowed, fairseq_checkpoint_globals,
                      numpy_checkpoint_globals, read_checkpoint)
from .model import architecture
from .schema import PATH_FIELDS, Generator

__all__ = [
    "CheckpointError", "CorruptCheckpointError", "architecture", "EVALUATED_FIELDS", "Form", "Generator", "LIMIT_AMPLIFICATION",
    "LIMIT_CHARS", "LIMIT_CONFIG_NODES", "LIMIT_DEPTH", "LIMIT_ITEMS", "LIMIT_POSITIONS", "LIMIT_STATE_NODES",
    "PATH_FIELDS", "UnsafeCheckpointError",
    "checkpoint_globals", "checkpoint_globals_allowed", "fairseq_checkpoint_globals", "load_checkpoint",
    "nonfinite_weights", "numpy_checkpoint_globals", "read_checkpoint", "sanitize",
]
