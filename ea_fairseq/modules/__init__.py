from .attention_map_conv import AttentionMapConv
from .attention_maps import AttentionMapCarrier, AttentionMechanism, LogitMapAttention
from .drop_attention import DropAttention
from .evolving_attention import EvolvingAttention
from .predictive_attention import PredictiveAttention
from .recurrent_attention import RecurrentAttention, RecurrentAttentionMatrices

__all__ = [
    "AttentionMapConv", "AttentionMapCarrier", "AttentionMechanism", "LogitMapAttention", "DropAttention",
    "EvolvingAttention", "PredictiveAttention", "RecurrentAttention", "RecurrentAttentionMatrices",
]
