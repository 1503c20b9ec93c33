from .attention_map_conv import AttentionMapConv
from .attention_maps import AttentionMapCarrier, AttentionMechanism, LogitMapAttention
from .drop_attention import DropAttention
from .evolving_attention import EvolvingAttention
from .hard_coded_attention import HardCodedGaussianAttention
from .position_attention import PositionAttention
from .predictive_attention import PredictiveAttention
from .recurrent_attention import RecurrentAttention, RecurrentAttentionMatrices
from .synthesizer_attention import RandomSynthesizerAttention

__all__ = [
    "AttentionMapConv", "AttentionMapCarrier", "AttentionMechanism", "LogitMapAttention", "DropAttention",
    "EvolvingAttention", "HardCodedGaussianAttention", "PositionAttention", "PredictiveAttention",
    "RandomSynthesizerAttention", "RecurrentAttention", "RecurrentAttentionMatrices",
]
