"""ea_fairseq: attention maps that evolve across layers, as a fairseq ``--user-dir`` plugin.

``fairseq-train DATA --user-dir ea_fairseq --arch ea_transformer_lite ...``

Importing the package loads the plugin (:func:`load_plugin`: fairseq, the models and tasks,
checkpoint validation, safe archive extraction, data file checks), in every program alike.
The plugin's command-line tools live beside it, in :mod:`ea_fairseq_cli`, which imports
neither fairseq nor torch until a command needs them (a fast ``--help``; the metric tools
where fairseq is not installed).
"""
__version__ = "0.1.0"
_loaded = False


def load_plugin() -> None:
    """Import fairseq and register the plugin's models, architectures and tasks; every
    checkpoint fairseq reads in this process is sanitized before fairseq converts or evaluates
    any of it (:mod:`ea_fairseq.checkpoint_safety`), the hub's archives are extracted only
    inside a fresh folder (:mod:`ea_fairseq.archives`), binary data files are checked against
    their sizes before fairseq opens them (:mod:`ea_fairseq.data_files`). In a process that runs
    a command line the plugin serves (fairseq's tools, the plugin's own), the plugin's option
    errors print as one line (:mod:`ea_fairseq.errors`) and the known warnings of fairseq's
    stack are not shown (:mod:`ea_fairseq.known_warnings`). Idempotent.

    fairseq's import sets the root logger to DEBUG (``logging.basicConfig`` in
    ``fairseq.models.wav2vec``) and logs a tensorboardX hint at INFO: the root level is put
    back and messages below WARNING are not shown while fairseq is imported."""
    global _loaded
    if not _loaded:
        _load()
        _loaded = True
    from . import errors

    if errors.serving_command_line():  # fairseq-train ... --user-dir ea_fairseq, the plugin's tools
        errors.install_excepthook()  # the plugin's option errors as one line on the command line
        from . import known_warnings

        known_warnings.install()  # fairseq's stack's warnings that say nothing about the run


def _load() -> None:
    import logging
    import sys

    root = logging.getLogger()
    level, disabled = root.level, logging.root.manager.disable
    first = "fairseq" not in sys.modules
    if first:
        logging.disable(logging.INFO)
    try:
        from ._compat import check_fairseq

        check_fairseq()
        from . import archives, checkpoint_safety, data_files
        from . import models  # noqa: F401  (registers models and architectures)
        from . import tasks  # noqa: F401  (registers translation_lines)
    finally:
        if first:
            logging.disable(disabled)
            root.setLevel(level)
    checkpoint_safety.install()
    archives.install()  # the hub extracts model and data archives safely (ea_fairseq.archives)
    data_files.install()  # binary data files checked against their sizes before fairseq reads them


load_plugin()
