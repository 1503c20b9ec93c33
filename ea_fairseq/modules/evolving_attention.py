"""Evolving Attention (EA-Transformer): multi-head attention whose logit map evolves across
layers, EA paper Eq. (4), §3.3 and §3.5.

The equation is one operation, :func:`~ea_ops.operation.evolving_attention`
(its module documents it); this module is the attention that calls it once per attention
with its α, β and map convolution (:class:`~ea_ops.map_conv.AttentionMapConv`),
takes the previous layer's ``A_logit`` from what its layer hands it
(:class:`~ea_fairseq.modules.attention_map_carrier.LayerMaps`) and hands its own on where a
later layer reads it, and
keeps the operation's state of a decoding run in fairseq's incremental state: what a step
returns is stored there for the next, and beam search's reorders are composed into it.
"""
from typing import Optional

from ea_ops.contract import EvolvingAttentionParams, StepState
from ea_ops.map_conv import AttentionMapConv
from ea_ops.operation import evolving_attention
from ea_ops.values import fairseq_weights

from .attention_maps import LogitMapAttention


class EvolvingAttention(LogitMapAttention):
    """Multi-head attention with EA's residual convolution over attention maps, Eq. (4)."""

    def setup_mechanism(
        self,
        slot: str,
        alpha: float,
        beta: float,
        kernel_size: int,
        conv_layout: Optional[str],
        hand_on: bool,
    ) -> None:
        self.slot = slot
        self.alpha = float(alpha)
        self.beta = float(beta)
        self.hand_on_maps = hand_on
        self.conv = (
            AttentionMapConv(self.num_heads, kernel_size, conv_layout)
            if conv_layout is not None
            else None
        )

    def params(self) -> EvolvingAttentionParams:
        conv = self.conv
        if conv is None:
            return EvolvingAttentionParams(self.alpha, self.beta, None, None, "full")
        return EvolvingAttentionParams(self.alpha, self.beta, conv.weight, conv.bias, conv.layout)

    def carried_names(self):
        return ((self.slot,) if self.alpha > 0.0 else ()), ((self.slot,) if self.hand_on_maps else ())

    def evolve(self, logits, masked, query_padding_mask, incremental_state, values=None, empty=None):
        """The one call of :func:`evolving_attention` of this attention; a decoding step's
        state comes from fairseq's incremental state, and what the step returns goes back."""
        maps, previous, hand_on = self.layer_maps, None, False
        if maps is not None:
            previous = maps.inputs.get(self.slot) if self.alpha > 0.0 else None
            hand_on = self.hand_on_maps and self.slot in maps.wanted  # a later layer reads it
        cache = state = None
        if incremental_state is not None and self.conv is not None:
            cache = self.cache(incremental_state)
            state = cache.mechanism or StepState()  # (empty at a run's first step)
        neutral = None if query_padding_mask is None else self.neutral_entries(masked, query_padding_mask)
        out = evolving_attention(logits, previous, masked, neutral, self.params(), state=state,
                                 values=values, empty=empty, hand_on=hand_on,
                                 return_maps=bool(self._map_hooks))
        if out.state is not None:
            cache.mechanism = out.state
        if hand_on:  # the next layer's A_logit(i-1)
            maps.outgoing[self.slot] = out.carried
        if out.maps is not None:
            self.report_maps(lambda: out.maps, masked)
        return out

    def transform_logits(self, logits, masked, query_padding_mask, incremental_state):
        return self.evolve(logits, masked, query_padding_mask, incremental_state).logits

    def attend_logits(self, logits, masked, query_padding_mask, v, incremental_state, bsz, tgt_len,
                      need_weights, need_head_weights, empty=None):
        """Eq. (4), softmax and value product in one operation where no dropout acts on
        the weights (a backend may fuse them: the CPU accelerator's decoding step)."""
        if self.drops_weights():
            return super().attend_logits(logits, masked, query_padding_mask, v, incremental_state,
                                         bsz, tgt_len, need_weights, need_head_weights, empty)
        out = self.evolve(logits, masked, query_padding_mask, incremental_state, values=v, empty=empty)
        return self.out_proj(out.context), fairseq_weights(out.probs, need_weights, need_head_weights)

    def reorder_mechanism_state(self, state, new_order):
        """The stored :class:`StepState` in beam search's new order (composed, applied at
        the next step's read)."""
        return state.reordered(new_order) if isinstance(state, StepState) else state
