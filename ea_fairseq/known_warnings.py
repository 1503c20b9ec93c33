"""The warnings fairseq's tools print on every run that say nothing about the run.

``fairseq-generate`` and ``fairseq-interactive`` (and ``fairseq-train``) turn their arguments
into a configuration with hydra's deprecated ``hydra.experimental`` API and fairseq's old
config files: five hydra deprecation warnings, and two DEBUG lines of hydra's (fairseq's import
sets the root logger to DEBUG). On a CPU, torch's data loader adds that memory pinning needs an
accelerator; in training, torch says that fairseq's ``torch.cuda.amp.autocast(...)`` and its
boolean padding mask beside a float attention mask are deprecated. None of them is about the
user's run, and none can be acted on by the user.

:func:`install` ignores exactly these, each by its category and the start of its message (the
standard library's ``warnings.filterwarnings``), and sets hydra's logger to INFO; every other
warning is shown as before. It is called (by :mod:`ea_fairseq.side_effects`) when the plugin is loaded in a
process that runs a command line the plugin serves (:func:`ea_fairseq.errors.serving_command_line`),
never in a program of one's own, and does nothing with ``EA_FAIRSEQ_SHOW_WARNINGS=1``. The recipes' shell
filter (``ea_quiet`` in ``examples/translation/common.sh``) drops the same messages where they
are printed before the plugin is loaded (``fairseq-hydra-train``; ``ea-fairseq-hydra-train``
loads the plugin first).
"""
import logging
import os
import warnings

#: (category, regular expression the message starts with) of each known warning
KNOWN = (
    (UserWarning, r"hydra\.experimental\.initialize\(\) is no longer experimental"),
    (UserWarning, r"hydra\.experimental\.compose\(\) is no longer experimental"),
    (Warning, r"\s*The version_base parameter is not specified"),  # hydra's Hydra14MigrationWarning
    (UserWarning, r"In '[^']*': Usage of deprecated keyword in package header"),
    (UserWarning, r"\s*'[^']*' is validated against ConfigStore schema with the same name"),
    (UserWarning, r"\s*The strict flag in the compose API is deprecated"),
    (UserWarning, r"'pin_memory' argument is set as true but no accelerator is found"),
    (FutureWarning, r"`torch\.cuda\.amp\.[A-Za-z_]+\(args\.\.\.\)` is deprecated"),
    (UserWarning, r"Support for mismatched key_padding_mask and attn_mask is deprecated"),
)


def shown() -> bool:
    """``EA_FAIRSEQ_SHOW_WARNINGS=1``: every warning is shown."""
    return os.environ.get("EA_FAIRSEQ_SHOW_WARNINGS", "") not in ("", "0")


def install() -> None:
    if shown():
        return
    for category, message in KNOWN:
        warnings.filterwarnings("ignore", message=message, category=category)
    hydra = logging.getLogger("hydra")
    if hydra.getEffectiveLevel() < logging.INFO:
        hydra.setLevel(logging.INFO)
