"""ea_fairseq: attention maps that evolve across layers, as a fairseq ``--user-dir`` plugin.

``fairseq-train DATA --user-dir ea_fairseq --arch ea_transformer_lite ...``
"""
__version__ = "0.1.0"

from ._compat import check_fairseq

check_fairseq()

from . import checkpoint_safety  # noqa: E402  (allow-lists fairseq checkpoint classes)
from . import models  # noqa: E402,F401  (registers models and architectures)

checkpoint_safety.allow_fairseq_checkpoints()
