from ea_ops.map_conv import AttentionMapConv
from .attention_map_carrier import LayerMaps, StackPass, layer_maps
from .attention_maps import LogitMapAttention
from .attention_mechanism import AttentionMechanism
from .attention_protocol import AttentionModule
from .drop_attention import DropAttention
from .evolving_attention import EvolvingAttention
from .hard_coded_attention import HardCodedGaussianAttention
from .position_attention import PositionAttention
from .predictive_attention import PredictiveAttention
from .recurrent_attention import RecurrentAttention, RecurrentAttentionMatrices
from .synthesizer_attention import RandomSynthesizerAttention

__all__ = [
    "AttentionMapConv", "AttentionMechanism", "AttentionModule", "LogitMapAttention", "DropAttention",
    "EvolvingAttention", "HardCodedGaussianAttention", "PositionAttention", "PredictiveAttention",
    "RandomSynthesizerAttention", "RecurrentAttention", "RecurrentAttentionMatrices",
    "LayerMaps", "StackPass", "layer_maps",
]
