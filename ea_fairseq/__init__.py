"""ea_fairseq: attention maps that evolve across layers, as a fairseq ``--user-dir`` plugin.

``fairseq-train DATA --user-dir ea_fairseq --arch ea_transformer_lite ...``
"""
__version__ = "0.1.0"

from ._compat import check_fairseq

check_fairseq()

from . import checkpoint_safety  # noqa: E402
from . import models  # noqa: E402,F401  (registers models and architectures)
from . import tasks  # noqa: E402,F401  (registers translation_lines)

# every checkpoint fairseq reads in this process is validated before fairseq evaluates any
# of its configuration (see checkpoint_safety)
checkpoint_safety.install()
