"""Models and architectures: importing this package registers them with fairseq."""
from . import transformer_lite  # noqa: F401  (registers transformer_lite)
from . import ea_transformer  # noqa: F401  (registers ea_transformer and its archs)
from . import baseline  # noqa: F401  (DropAttention on fairseq's transformer archs)
from . import comparison_archs  # noqa: F401  (Conv-Transformer, RealFormer, ResFormer archs)
