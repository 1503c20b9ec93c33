"""Tasks: importing this package registers them with fairseq."""
from . import translation_lines  # noqa: F401  (registers translation_lines)
from . import translation_progress  # noqa: F401  (registers translation_progress)
