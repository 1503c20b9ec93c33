from .attention_map_conv import AttentionMapConv
from .attention_maps import AttentionMapCarrier, LogitMapAttention
from .evolving_attention import EvolvingAttention

__all__ = ["AttentionMapConv", "AttentionMapCarrier", "LogitMapAttention", "EvolvingAttention"]
