"""ea_fairseq: attention maps that evolve across layers, as a fairseq ``--user-dir`` plugin.

``fairseq-train DATA --user-dir ea_fairseq --arch ea_transformer_lite ...``

Importing the package loads the plugin (:func:`load_plugin`: fairseq, the models and tasks, and
the replacements in fairseq listed in :mod:`ea_fairseq.side_effects`: checkpoint validation, safe
archive extraction, data file checks, ...), in every program alike.
The plugin's command-line tools live beside it, in :mod:`ea_fairseq_cli`, which imports
neither fairseq nor torch until a command needs them (a fast ``--help``; the metric tools
where fairseq is not installed).
"""
__version__ = "0.1.0"
_loaded = False


def load_plugin() -> None:
    """Import fairseq, register the plugin's models, architectures and tasks, and make the
    plugin's replacements in fairseq and the standard library: all of them, and why, are the
    table of :mod:`ea_fairseq.side_effects` (checkpoints sanitized before fairseq reads them,
    archives extracted safely, data files checked, fairseq's transformer archs taking
    DropAttention; in a process that runs a command line the plugin serves, one-line errors and
    fairseq's stack's known warnings not shown). Idempotent."""
    global _loaded
    from . import side_effects

    if not _loaded:
        with side_effects.fairseq_imported_quietly():
            from ._compat import check_fairseq

            check_fairseq()
            from . import models  # noqa: F401  (registers models and architectures)
            from . import tasks  # noqa: F401  (registers translation_lines)
        _loaded = True
    from . import errors

    side_effects.install(serving_command_line=errors.serving_command_line())


load_plugin()
