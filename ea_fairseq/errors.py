"""How the plugin's own refusals reach a user of fairseq's command-line tools.

fairseq's tools let every exception end the process with a traceback; argparse errors are
the only one-line errors they print. The plugin's option values are checked by argparse
where argparse sees them, but combinations (``--cross-self-attention`` with an EA decoder) and
values that reach a model another way (hydra, a checkpoint) are checked when the model is
built, deep inside fairseq. Those checks raise :class:`OptionError`, and in a process that
runs one of those tools or one of the plugin's own (:func:`serving_command_line`),
the ``sys.excepthook`` :func:`chained_excepthook` makes prints an uncaught one as a single line, as argparse would (the
process still exits with status 1), and so a checkpoint the plugin refuses or finds damaged
(an exception class with ``one_line = True``). Two errors of fairseq itself, recognised by type
and message, are one line too, saying what there is instead: a checkpoint file that is not there
(``--path``: the checkpoints nearest it in its folder) and a split the data directory lacks
(``--gen-subset``: the splits it has, :func:`did_you_mean`), a dictionary fairseq cannot read (a
malformed line, a duplicate word), a checkpoint trained with other dictionaries than the data
directory's (torch's size mismatch of the embeddings alone), and an
over-long input (with the option that sets the limit where a model built in this process limits
positions itself, :func:`note_position_limit`, and in ``fairseq-interactive`` the task that goes
on past such a line). Every other exception goes to the previous hook unchanged. In the same
processes argparse's refusal of a command line is its error line alone, an ``--arch`` or an
option the parser does not know naming the closest one (:func:`parser_error`).
"""
import ast
import difflib
import os
import re
import sys
from typing import Dict, Iterable, Optional

_SIZE_ERROR = re.compile(r"Size of sample #\d+ is invalid")
_MISSING_CHECKPOINT = re.compile(r"Model file not found: (?P<path>.+)")  # checkpoint_utils, IOError
_MISSING_SPLIT = re.compile(r"Dataset not found: (?P<split>[^\s()]+) \((?P<data>.+)\)")  # the tasks
_DICTIONARY = re.compile(r"Incorrect dictionary format, expected|Duplicate word found when loading Dictionary")
_ARCH_CHOICE = re.compile(r"argument --arch/-a: invalid choice: (?P<arch>.+?) \(choose from ")
_UNRECOGNIZED = "unrecognized arguments: "  # argparse's
_EMBEDDINGS = re.compile(r"\tsize mismatch for (?P<name>(encoder|decoder)\.embed_tokens\.weight|decoder\.output_projection"
                         r"\.weight): copying a param with shape torch\.Size\(\[(?P<saved>\d+), \d+\]\) from "
                         r"checkpoint, the shape in current model is torch\.Size\(\[(?P<built>\d+), \d+\]\)\.")
CHECKPOINT = "give a checkpoint fairseq-train wrote (e.g. SAVE_DIR/checkpoint_best.pt)"
_position_limits: Dict[str, None] = {}  # notes, in the order the models were built


class OptionError(ValueError):
    """An option value or combination the plugin refuses; its message says what to do."""


class CheckpointError(RuntimeError):
    """A checkpoint that does not load; nothing in it was run."""

    one_line = True  # its message says it all: the command-line tools print it as one line


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint refused for safety: it holds something other than plain data of the
    expected form, or asks fairseq to build far more than its weights."""


class CorruptCheckpointError(CheckpointError):
    """A file that is empty, truncated, damaged or not a torch checkpoint at all."""


def note_position_limit(note: str) -> None:
    """Record that a model built in this process refuses longer inputs (``note`` says why
    and what to do), for fairseq's over-long-input error."""
    _position_limits[note] = None


def did_you_mean(word: str, names: Iterable[str], prefix: str = "") -> str:
    """`` (did you mean PREFIXNAME?)`` with the name of ``names`` closest to ``word``, or nothing."""
    close = difflib.get_close_matches(word, list(names), n=1)
    return f" (did you mean {prefix}{close[0]}?)" if close else ""


def _given(value: str) -> str:
    """``value`` as this process's command line gave it: ``--option value`` where an option's
    value is it or lists it (``--path a.pt:b.pt``, ``--valid-subset valid,test``)."""
    argv = sys.argv[1:]
    for i, arg in enumerate(argv):
        option, equals, given = arg.partition("=")
        if not option.startswith("--"):
            continue
        if not equals:
            if i + 1 == len(argv):
                continue
            given = argv[i + 1]
        if value == given or value in given.split(os.pathsep) or value in given.split(","):
            return f"{option} {value}"
    return value


def _missing_checkpoint(path: str) -> str:
    folder = os.path.dirname(path) or "."
    missing = f"{_given(path)}: no such file"
    if not os.path.isdir(folder):
        return f"{missing} (no folder {folder}); {CHECKPOINT}"
    names = [n for n in os.listdir(folder) if n.startswith("checkpoint") and n.endswith(".pt")]
    if not names:
        return f"{missing}, nor any checkpoint*.pt in {folder}; {CHECKPOINT}"
    nearest = difflib.get_close_matches(os.path.basename(path), names, n=3, cutoff=0)
    more = f" (and {len(names) - len(nearest)} more)" if len(names) > len(nearest) else ""
    return f"{missing}; {folder} has {', '.join(nearest)}{more}"


def _missing_split(split: str, data: str) -> Optional[str]:
    folder = data if os.path.isdir(data) else os.path.dirname(data)  # (a directory, or DATA/SPLIT)
    try:
        splits = sorted({n.split(".")[0] for n in os.listdir(folder) if n.endswith(".idx")})
    except OSError:
        return None
    if not splits or split in splits:  # (no binarized split; the split for other languages): fairseq's
        return None
    return f"{_given(split)}: no such split in {folder}{did_you_mean(split, splits)}; it has {', '.join(splits)}"


def _other_dictionaries(message: str) -> Optional[str]:
    """torch's refusal of a checkpoint whose embeddings alone differ from the model built from
    the data directory's dictionaries."""
    lines = message.split("\n")[1:]
    mismatches = [_EMBEDDINGS.fullmatch(line) for line in lines]
    if not lines or not all(mismatches):
        return None
    side = lambda m: "source" if m["name"].startswith("encoder") else "target"  # noqa: E731
    sizes = {side(m): (m["saved"], m["built"]) for m in mismatches}
    saved = ", ".join(f"{k} {v[0]}" for k, v in sizes.items())
    built = ", ".join(f"{k} {v[1]}" for k, v in sizes.items())
    return (f"the checkpoint was trained with other dictionaries (embedding rows: {saved}; the data directory's "
            f"dict.*.txt make {built}): give the data directory it was trained on, or binarize with its "
            "dictionaries (fairseq-preprocess --srcdict/--tgtdict)")


def _too_long(message: str) -> str:
    """fairseq's refusal of a sentence longer than the model's positions, with what this process
    knows of the limit and, in fairseq-interactive, the task that goes on past such a line."""
    notes = list(_position_limits)
    if "interactive" in os.path.basename(sys.argv[0]):
        notes.append("fairseq-interactive --task translation_lines reports such a line and translates the others")
    return "; ".join([re.sub(r"np\.\w+\((\d+)\)", r"\1", message), *notes])  # (numpy 2's repr of a size)


def _one_line(value) -> Optional[str]:
    """The line that says all of a known fairseq error, or None."""
    if _SIZE_ERROR.match(str(value)):
        return _too_long(str(value))
    if isinstance(value, RuntimeError) and str(value).startswith("Error(s) in loading state_dict"):
        return _other_dictionaries(str(value))
    if isinstance(value, (ValueError, RuntimeError)) and _DICTIONARY.match(str(value)):  # Dictionary.add_from_file
        return (f"a dictionary fairseq read: {str(value).splitlines()[0].rstrip('.')}; give the dictionaries "
                "fairseq-preprocess wrote for this data")
    if not isinstance(value, OSError):
        return None
    match = _MISSING_CHECKPOINT.fullmatch(str(value))
    if match:
        return _missing_checkpoint(match["path"])
    match = _MISSING_SPLIT.fullmatch(str(value))
    return _missing_split(match["split"], match["data"]) if match else None


def excepthook(kind, value, tb, previous=None) -> None:
    previous = previous or sys.__excepthook__
    line = str(value) if isinstance(value, OptionError) or getattr(kind, "one_line", False) else _one_line(value)
    if line is not None:  # (checkpoint refusals too)
        print(f"{os.path.basename(sys.argv[0]) or 'python'}: error: {line}", file=sys.stderr)
        return
    previous(kind, value, tb)


def serving_command_line() -> bool:
    """Whether this process runs a command-line entry point the plugin serves: one of
    fairseq's (``fairseq-train``, ``fairseq-generate``, ``fairseq-interactive``, ...: a console
    script that imported ``cli_main`` from ``fairseq_cli``, or ``python -m fairseq_cli.NAME``)
    or the plugin's own tools (``ea-fairseq-*``, ``python -m ea_fairseq_cli.NAME``). Read from the main module, which names the program:
    fairseq offers no hook for how its command line reports an error
    (docs/fairseq-internals.md)."""
    main = sys.modules.get("__main__")
    names = [getattr(getattr(main, "__spec__", None), "name", None)]
    names += [getattr(getattr(main, attr, None), "__module__", None) for attr in ("cli_main", "main")]
    return any(isinstance(name, str) and name.startswith(("fairseq_cli.", "ea_fairseq.", "ea_fairseq_cli."))
               for name in names)


def chained_excepthook(previous):
    """``sys.excepthook`` with :func:`excepthook` in front of ``previous``. Installed (by
    :mod:`ea_fairseq.side_effects`) in a process that runs a command line the plugin serves
    (:func:`serving_command_line`), never by importing the plugin into a program of one's own."""

    def hook(kind, value, tb):
        excepthook(kind, value, tb, previous=previous)

    return hook


def parser_error(error):
    """``argparse.ArgumentParser.error`` (a row of :data:`ea_fairseq.side_effects.SIDE_EFFECTS`,
    in the same processes as :func:`chained_excepthook`): every refusal of a command line is
    argparse's error line alone, exit status 2 as argparse's, without the usage before it
    (fairseq-train's is some 200 lines); an ``--arch`` fairseq's parser does not know (its
    ``choices`` are ``ARCH_MODEL_REGISTRY``, every arch's name in the message) names the closest
    arch instead of all of them, and an option no argument of the parser takes the closest
    option it has."""

    def one_line(self, message):
        match = _ARCH_CHOICE.match(message)
        if match is not None:
            from fairseq.models import ARCH_MODEL_REGISTRY

            try:
                arch = str(ast.literal_eval(match["arch"]))  # (argparse writes its repr)
            except (ValueError, SyntaxError):
                arch = match["arch"]
            message = (f"argument --arch/-a: invalid choice: {match['arch']}{did_you_mean(arch, ARCH_MODEL_REGISTRY)}"
                       "; `ea-fairseq-options` lists the plugin's architectures")
        elif message.startswith(_UNRECOGNIZED):
            options = [o for o in self._option_string_actions if o.startswith("--")]
            meant = [did_you_mean(word.split("=")[0], options) for word in message[len(_UNRECOGNIZED):].split()
                     if word.startswith("--")]
            message += "".join(meant) or f"; `{self.prog} --help` lists the options"
        self.exit(2, f"{self.prog}: error: {message}\n")

    return one_line
