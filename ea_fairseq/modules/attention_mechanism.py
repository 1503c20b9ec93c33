"""What every attention of this plugin shares, whether it computes its logits from queries
and keys (:class:`~ea_fairseq.modules.attention_maps.LogitMapAttention`) or from positions
only (:class:`~ea_fairseq.modules.position_attention.PositionAttention`): the stack's
carrier, the map hooks, attention dropout or DropAttention, softmax and value product, and
the one cache of a decoding run (:class:`~ea_fairseq.modules.attention_cache.AttentionCache`)
with its one beam reorder."""
from collections import OrderedDict
from typing import Any, Callable, Dict, Optional

import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from .attention_cache import AttentionCache
from .attention_map_carrier import AttentionMapCarrier, shared_in_pass
from ea_ops.masks import fill_masked
from ea_ops.softmax import attention_weights, fully_masked_rows
from ea_ops.values import fairseq_weights, value_product

#: the key of a module's cache in fairseq's incremental state (prefixed with the module's id)
CACHE = "cache"


class AttentionMechanism:
    """A mixin for a module with ``embed_dim``, ``num_heads``, ``head_dim``, ``out_proj``,
    ``dropout_module`` and fairseq's incremental-state helpers
    (``fairseq.incremental_decoding_utils.with_incremental_state``)."""

    def init_mechanism(self) -> None:
        # instance attributes (a class attribute would shadow the registered submodule):
        self.attention_maps = None  # AttentionMapCarrier, set by attach()
        self.weight_dropout = None  # DropAttention, or None for fairseq's attention dropout
        self._map_hooks = OrderedDict()

    def attach(self, carrier: AttentionMapCarrier) -> None:
        self.attention_maps = carrier

    def set_weight_dropout(self, module: Optional[torch.nn.Module]) -> None:
        self.weight_dropout = module

    # -- intermediate maps, for analysis ---------------------------------------------------
    def register_map_hook(self, hook: Callable[[Dict[str, Tensor]], None]):
        """Call ``hook(maps)`` with the mechanism's intermediate maps (B, H, T, S) of every
        forward pass that computes them; whoever registers the hook knows which layer and
        slot it watches (the analysis tool binds them: ``AttentionCapture.record``).
        Masked entries hold zeros. The same maps whichever backend computes the mechanism
        (a mechanism asks its operation for them while a hook listens). Returns a handle
        with ``remove()``."""
        handle = RemovableHandle(self._map_hooks)
        self._map_hooks[handle.id] = hook
        return handle

    def report_maps(self, maps: Callable[[], Dict[str, Tensor]], masked: Optional[Tensor]) -> None:
        """Hand ``maps()`` -- computed only if a hook listens -- to the map hooks."""
        if self._map_hooks:
            reported = {k: (fill_masked(v.detach(), masked, 0.0) if v.dim() == 4 else v.detach()).clone()
                        for k, v in maps().items()}
            for hook in list(self._map_hooks.values()):
                hook(reported)

    # -- weights and values ----------------------------------------------------------------
    def drops_weights(self) -> bool:
        """Whether :meth:`drop_weights` changes the weights (training, or fairseq's
        ``--retain-dropout`` at inference)."""
        if self.weight_dropout is not None:
            return self.weight_dropout.training and self.weight_dropout.p > 0.0
        dropout = self.dropout_module
        return (dropout.training or dropout.apply_during_inference) and dropout.p > 0.0

    def drop_weights(self, probs: Tensor) -> Tensor:
        """Dropout on the attention weights ``(batch, heads, tgt, src)``."""
        if not self.drops_weights():
            return probs  # what the dropout module returns, without a call per decoding step
        if self.weight_dropout is not None:
            return self.weight_dropout(probs)
        return self.dropout_module(probs)

    def attend_with(self, logits: Tensor, v: Tensor, bsz: int, tgt_len: int,
                    need_weights: bool, need_head_weights: bool, empty: Optional[Tensor] = None):
        """softmax, dropout on the weights, values and output projection.

        ``logits`` is (B, H, T, S) with -inf where masked; ``v`` is (B_kv * H, S, head_dim);
        ``empty``: the rows where every key is masked (:meth:`empty_rows`), which get zero
        weights. Returns fairseq's ``(attn, weights)`` pair.
        """
        probs_float, probs = attention_weights(logits, v.dtype, empty)
        context = value_product(self.drop_weights(probs), v, bsz, tgt_len)
        return self.out_proj(context), fairseq_weights(probs_float, need_weights, need_head_weights)

    def empty_rows(self, masked: Optional[Tensor]) -> Optional[Tensor]:
        """:func:`ea_ops.softmax.fully_masked_rows` of ``masked``, once
        per pass of the stack (every layer gets the same masks)."""
        if masked is None:
            return None
        return shared_in_pass(self.attention_maps, "empty_rows", (masked,), lambda: fully_masked_rows(masked))

    # -- the decoding run's cache ----------------------------------------------------------
    def cache(self, incremental_state) -> AttentionCache:
        """This module's :class:`AttentionCache` in the run's ``incremental_state``."""
        cache = self.get_incremental_state(incremental_state, CACHE)
        if cache is None:
            cache = AttentionCache()
            self.set_incremental_state(incremental_state, CACHE, cache)
        return cache

    def get_mechanism_state(self, incremental_state) -> Dict[str, Any]:
        """The mechanism's own part of the cache (a dict, changed in place)."""
        return self.cache(incremental_state).mechanism

    def set_mechanism_state(self, incremental_state, state: Dict[str, Any]) -> None:
        self.cache(incremental_state).mechanism = state

    def reorder_incremental_state(self, incremental_state, new_order: Tensor):
        """Beam search's new order of hypotheses (fairseq's decoder calls this on every
        module that has it): the cache's one reorder."""
        cache = self.get_incremental_state(incremental_state, CACHE)
        if cache is not None:
            cache.reorder(new_order, self.reorder_mechanism_state)
        return incremental_state

    def reorder_mechanism_state(self, state: Dict[str, Any], new_order: Tensor) -> None:
        """Put the mechanism's state in the new order of hypotheses (in place); here every
        tensor, batch first. A mechanism whose state is laid out otherwise overrides this."""
        for k, v in state.items():
            if v is not None:
                state[k] = v.index_select(0, new_order)

    def set_beam_size(self, beam_size: int) -> None:
        """fairseq's generator announces its beam size (the decoder calls this on every
        module that has it): encoder keys are then computed once per sentence."""
        self.beam_size = beam_size

    # fairseq's decoder layer reads its self-attention's keys under fairseq's names
    # (--cross-self-attention) and hands in a previous state (prev_self_attn_state)
    def _get_input_buffer(self, incremental_state) -> Dict[str, Optional[Tensor]]:
        cache = self.get_incremental_state(incremental_state, CACHE)
        return {} if cache is None else cache.as_buffer()

    def _set_input_buffer(self, incremental_state, buffer: Dict[str, Optional[Tensor]]):
        self.cache(incremental_state).load_buffer(buffer)
        return incremental_state
