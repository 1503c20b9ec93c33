"""What a role's attention module offers fairseq's transformer layers: the protocol every
attention of this plugin follows (:class:`AttentionModule`), whatever it computes.

fairseq's ``TransformerEncoderLayerBase`` and ``TransformerDecoderLayerBase`` call the module
their ``build_self_attention`` / ``build_encoder_attention`` returned as they call fairseq's
``MultiheadAttention``: :meth:`AttentionModule.forward` with its arguments, in the layout
(time, batch, channels). Beyond that the decoder layer reads ``num_heads`` and ``head_dim``
of its self-attention, and at every call its self-attention's cache under fairseq's names
(:meth:`AttentionModule._get_input_buffer`; it looks into it only for
``--cross-self-attention``); it writes one (:meth:`AttentionModule._set_input_buffer`) only
when its caller hands it a previous state. fairseq's decoder walks its modules for
``reorder_incremental_state`` and ``set_beam_size`` and calls them on each that has them, so a
module holding no state of its own (LSRA, whose attention and convolution hold theirs) needs
neither. Implementations: :class:`~ea_fairseq.modules.attention_maps.LogitMapAttention` (every
mechanism on the logit map ``QK^T``), :class:`~ea_fairseq.modules.position_attention.PositionAttention`
(RAN, HC-SA, Syn-R: logits from positions only),
:class:`~ea_fairseq.modules.long_short_range_attention.LongShortRangeAttention` (LSRA).
"""
from typing import Dict, Optional, Protocol, Tuple, runtime_checkable

from torch import Tensor

IncrementalState = Optional[Dict[str, Dict[str, Optional[Tensor]]]]


@runtime_checkable
class AttentionModule(Protocol):
    """A role's attention, as fairseq's transformer layers call it (see module docstring)."""

    embed_dim: int
    num_heads: int
    head_dim: int

    def forward(self, query: Tensor, key: Optional[Tensor], value: Optional[Tensor],
                key_padding_mask: Optional[Tensor] = None, incremental_state: IncrementalState = None,
                need_weights: bool = True, static_kv: bool = False, attn_mask: Optional[Tensor] = None,
                before_softmax: bool = False, need_head_weights: bool = False
                ) -> Tuple[Tensor, Optional[Tensor]]:
        """``(output (T, B, C), weights or None)``. ``key_padding_mask`` (B, S) is True at
        padded keys; ``attn_mask`` (T, S) is fairseq's additive future mask (``-inf`` where a
        query must not look); ``incremental_state``: a decoding run's state (the call is one
        step; ``static_kv``: the keys are the encoder's, the same at every step);
        ``need_weights`` / ``need_head_weights``: return the weights averaged over heads
        (B, T, S) or per head (H, B, T, S); ``before_softmax``: return
        ``(logits (B * H, T, S), values)`` instead, where the module has one logit map."""
        ...

    def _get_input_buffer(self, incremental_state: IncrementalState) -> Dict[str, Optional[Tensor]]:
        """The keys and values cached in this run under fairseq's names (``prev_key``,
        ``prev_value``, ``prev_key_padding_mask``), or ``{}``."""
        ...

    def _set_input_buffer(self, incremental_state: IncrementalState,
                          buffer: Dict[str, Optional[Tensor]]) -> IncrementalState:
        """Cache ``buffer`` (fairseq's names) as this run's keys and values."""
        ...
