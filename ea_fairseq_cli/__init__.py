"""The plugin's command-line tools, which import neither fairseq nor torch until a command needs
them: ``ea-fairseq-bleu`` (:mod:`.bleu`) and ``ea-fairseq-compare`` (:mod:`.compare_systems`)
never do, ``ea-fairseq-average-checkpoints`` (:mod:`.average_checkpoints`) and
``ea-fairseq-analysis`` (:mod:`.analysis`; its figures :mod:`.plots` and learning curves
:mod:`.curves`) and ``ea-fairseq-warm-start`` (:mod:`.warm_start`) load the plugin
(``import ea_fairseq``) after parsing their arguments, for the commands that read a checkpoint
or build a model. Each is also ``python -m ea_fairseq_cli.NAME``.

They live beside the plugin's package, not in it: importing anything under :mod:`ea_fairseq`
loads the plugin (fairseq, torch, the models), whatever the program, so ``--help`` stays fast
and the metric tools run where fairseq is not installed (the COMET environment).

Every tool answers ``--version`` (:func:`add_version_option`) with the plugin's version and
those of fairseq and torch, read from the installed distributions' metadata, without
importing either.
"""
import argparse
import ast
import importlib.metadata
import importlib.util
import sys
from typing import Optional, Sequence

ATTENTIONS = ("encoder.self", "decoder.self", "decoder.cross")  # the attentions of a model, in order

# the distributions named in a version line; fairseq's first one installed (it is published
# under several names that all install the `fairseq` package: pyproject.toml)
_STACK = (("fairseq", ("ve-fairseq", "fairseq")), ("torch", ("torch",)))


def plugin_version() -> str:
    """``ea_fairseq.__version__``, read from the package's ``__init__.py`` without importing it
    (which would load fairseq and torch): the source that runs, even where the installed
    metadata is older."""
    loaded = getattr(sys.modules.get("ea_fairseq"), "__version__", None)
    if loaded:
        return loaded
    try:
        origin = importlib.util.find_spec("ea_fairseq").origin
        with open(origin, encoding="utf-8") as f:
            tree = ast.parse(f.read(), origin)
        for node in tree.body:
            if (isinstance(node, ast.Assign) and len(node.targets) == 1
                    and getattr(node.targets[0], "id", None) == "__version__"):
                return ast.literal_eval(node.value)
    except (AttributeError, OSError, SyntaxError, ValueError):
        pass
    try:
        return importlib.metadata.version("ea_fairseq")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _installed(distributions: Sequence[str]) -> Optional[str]:
    for name in distributions:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def version_line(prog: str, also: Sequence[str] = ()) -> str:
    """``PROG VERSION (fairseq V, torch V)``: the stack's packages that are installed (the metric
    tools run where fairseq is not), and the distributions ``also`` names."""
    parts = [(label, _installed(names)) for label, names in _STACK] + [(d, _installed([d])) for d in also]
    stack = ", ".join(f"{label} {version}" for label, version in parts if version)
    return f"{prog} {plugin_version()}" + (f" ({stack})" if stack else "")


class _VersionAction(argparse.Action):
    """argparse's ``version`` action with the line made when asked for, not at every start."""

    def __init__(self, option_strings, dest, prog: str, also: Sequence[str] = (), **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)
        self.prog, self.also = prog, also

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_line(self.prog, self.also))
        parser.exit()


def add_version_option(parser: argparse.ArgumentParser, prog: str) -> None:
    """``--version``: print :func:`version_line` for ``prog`` (the console command's name) and exit 0."""
    parser.add_argument("--version", action=_VersionAction, prog=prog,
                        help="print the version of the plugin, fairseq and torch, and exit")


def exit_on_version(argv: Sequence[str], prog: str, also: Sequence[str] = ()) -> None:
    """For a command line that argparse does not read (``ea-fairseq-hydra-train``'s, hydra's):
    ``--version`` among its words prints :func:`version_line` and exits 0."""
    if "--version" in argv:
        print(version_line(prog, also))
        raise SystemExit(0)
