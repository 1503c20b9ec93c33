"""The one attention path of this plugin, whether an attention computes its logits from
queries and keys (:class:`~ea_fairseq.modules.attention_maps.LogitMapAttention`) or from
positions only (:class:`~ea_fairseq.modules.position_attention.PositionAttention`).

:meth:`AttentionMechanism.forward` is fairseq's attention call, in one path for every
mechanism:

1. the logit *source*, :meth:`~AttentionMechanism.attention_logits`: ``(logits, values,
   key padding, future mask)`` of a full pass or of a decoding step, logits unmasked (every
   entry finite) -- query·key products (``LogitMapAttention``: projections, the keys and
   values of a decoding run in its cache) or positions (``PositionAttention``: a Gaussian
   of the distance, learned matrices, RAN's matrices);
2. the masks as booleans, from the key padding and the future mask alone (never from the
   logits' values), the rows whose every key is masked, and the padded query rows: derived
   once per pass of the stack (:class:`~ea_fairseq.modules.attention_map_carrier.StackPass`);
3. the logit *transform*, :meth:`~AttentionMechanism.transform_logits`: what a mechanism
   does to the map (EA, PA, RealFormer; here: nothing), masking (``-inf``) last;
4. softmax (zero weights in a row whose every key is masked), attention dropout or
   DropAttention, the value product and the output projection
   (:meth:`~AttentionMechanism.attend_logits`, which a mechanism that computes weights and
   values itself overrides: EA's fused decoding step, RAN's decoding step with the weights
   its run keeps).

Beside it: the values a layer hands its attentions
(:class:`~ea_fairseq.modules.attention_map_carrier.LayerMaps`), the map hooks, and the one
cache of a decoding run (:class:`~ea_fairseq.modules.attention_cache.AttentionCache`) with
its one beam reorder.
"""
import math
from collections import OrderedDict
from typing import Any, Callable, Dict, Optional

import torch
import torch.nn as nn
from fairseq.modules.fairseq_dropout import FairseqDropout
from fairseq.modules.quant_noise import quant_noise
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from .attention_cache import AttentionCache
from .attention_map_carrier import LayerMaps
from ea_ops.masks import boolean_mask, fill_masked, fill_masked_
from ea_ops.softmax import attention_weights, fully_masked_rows
from ea_ops.values import fairseq_weights, value_product

#: the key of a module's cache in fairseq's incremental state (prefixed with the module's id)
CACHE = "cache"


class AttentionMechanism:
    """A mixin for an ``nn.Module`` with fairseq's incremental-state helpers
    (``fairseq.incremental_decoding_utils.with_incremental_state``) and ``self_attention``,
    ``encoder_decoder_attention``; :meth:`init_mechanism` gives it what every attention of
    the plugin has of fairseq's ``MultiheadAttention``: its sizes, its attention dropout
    module and, with :meth:`projection` and :meth:`reset_projections`, its projections."""

    def init_mechanism(self, embed_dim: int, num_heads: int, dropout: float,
                       kdim: Optional[int] = None, vdim: Optional[int] = None) -> None:
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self.head_dim = embed_dim // num_heads
        if self.head_dim * num_heads != embed_dim:
            raise ValueError(f"embed_dim {embed_dim} is not divisible by num_heads {num_heads}")
        # fairseq's module name, so that --retain-dropout-modules MultiheadAttention covers it
        self.dropout_module = FairseqDropout(dropout, module_name="MultiheadAttention")
        # instance attributes (a class attribute would shadow the registered submodule):
        self.layer_maps: Optional[LayerMaps] = None  # set by its layer while the layer runs
        # the names of what every layer of a pass derives alike from its masks
        slot = "cross" if self.encoder_decoder_attention else "self"
        self.masked_name, self.empty_name, self.neutral_name = f"{slot}:masked", f"{slot}:empty", f"{slot}:neutral"
        self.weight_dropout = None  # DropAttention, or None for fairseq's attention dropout
        self._map_hooks = OrderedDict()

    def projection(self, in_features: int, bias: bool, q_noise: float, qn_block_size: int,
                   make: Callable[..., nn.Linear] = nn.Linear) -> nn.Module:
        """A projection to ``embed_dim`` as fairseq's ``MultiheadAttention`` makes it (with its
        quantisation noise); ``make``: the ``nn.Linear`` (value residual's mixes values in)."""
        return quant_noise(make(in_features, self.embed_dim, bias=bias), q_noise, qn_block_size)

    def reset_projections(self) -> None:
        """fairseq's ``MultiheadAttention.reset_parameters`` for the projections this module has."""
        gain = 1 / math.sqrt(2) if self.kdim == self.vdim == self.embed_dim else 1.0
        for name in ("k_proj", "v_proj", "q_proj"):
            if hasattr(self, name):
                nn.init.xavier_uniform_(getattr(self, name).weight, gain=gain)
        nn.init.xavier_uniform_(self.out_proj.weight)
        if self.out_proj.bias is not None:
            nn.init.constant_(self.out_proj.bias, 0.0)

    # -- what the layers of a stack hand each other ----------------------------------------
    def carried_names(self):
        """``(reads, writes)``: the names of the values this module reads from the layers
        before it and hands on to the layers after it (:mod:`~ea_fairseq.modules.attention_map_carrier`);
        the stack hands on only what a later layer reads."""
        return (), ()

    @classmethod
    def stack_shared(cls, modules, cfg, heads: int):
        """What the attentions ``modules`` of this class in one stack share across its layers:
        ``(name, module)``, a module the stack owns under ``name`` and asks, at every pass,
        for the values it provides (``provided_names()``, ``pass_values(length,
        incremental_state)``); None (here): nothing."""
        return None

    def previous_map(self, name: str) -> Optional[Tensor]:
        """The value ``name`` an earlier layer of the pass handed on (None: the first layer,
        or a module run alone)."""
        maps = self.layer_maps
        return None if maps is None else maps.previous(name)

    def hand_on(self, name: str, tensor: Tensor) -> None:
        if self.layer_maps is not None:
            self.layer_maps.hand_on(name, tensor)

    def derived(self, name: str, compute):
        """``compute()``, once per pass of the stack (what every layer derives alike from
        the pass's masks); every call outside a stack."""
        maps = self.layer_maps
        if maps is None or maps.stack_pass is None:
            return compute()
        return maps.stack_pass.derive(name, compute)

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

    # -- the one path ----------------------------------------------------------------------
    def forward(self, query: Tensor, key: Optional[Tensor], value: Optional[Tensor],
                key_padding_mask: Optional[Tensor] = None,
                incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]] = None,
                need_weights: bool = True, static_kv: bool = False, attn_mask: Optional[Tensor] = None,
                before_softmax: bool = False, need_head_weights: bool = False):
        """fairseq's attention call (:class:`~ea_fairseq.modules.attention_protocol.AttentionModule`)."""
        tgt_len, bsz, _ = query.size()
        logits, v, key_padding_mask, attn_mask = self.attention_logits(
            query, key, value, key_padding_mask, attn_mask, incremental_state, static_kv)
        src_len = logits.size(-1)
        if key_padding_mask is not None and key_padding_mask.shape != (bsz, src_len):
            raise ValueError(f"{type(self).__name__}: key_padding_mask of shape {tuple(key_padding_mask.shape)} "
                             f"does not cover the (batch, keys) = ({bsz}, {src_len}) of this call")
        if attn_mask is not None and attn_mask.shape != (tgt_len, src_len):
            raise ValueError(f"{type(self).__name__}: attn_mask of shape {tuple(attn_mask.shape)} is not the "
                             f"(queries, keys) = ({tgt_len}, {src_len}) future mask fairseq's layers pass")
        masked = None
        if key_padding_mask is not None or attn_mask is not None:
            masked = self.derived(self.masked_name, lambda: boolean_mask(key_padding_mask, attn_mask))
        # Rows with every key masked: where the key padding meets a future mask (a full pass
        # of a decoder fed left-padded targets) or the cached keys of a decoding step (a
        # left-padded prefix). Key padding alone empties a row only for a sentence that is
        # all padding, which fairseq never batches: no per-layer cost for it.
        empty = None
        if key_padding_mask is not None and (attn_mask is not None or (
                incremental_state is not None and not self.encoder_decoder_attention)):
            empty = self.empty_rows(masked)
        query_padding_mask = None
        if self.self_attention and incremental_state is None and key_padding_mask is not None:
            query_padding_mask = key_padding_mask.to(torch.bool)
        elif self.encoder_decoder_attention:
            # the target padding, which the decoder layer hands its attentions (left-padded targets)
            target_padding = self.previous_map("target_padding")
            if target_padding is not None and target_padding.shape == (bsz, tgt_len):
                query_padding_mask = target_padding.to(torch.bool)
        if before_softmax:
            logits = self.transform_logits(logits, masked, query_padding_mask, incremental_state)
            return logits.reshape(bsz * self.num_heads, tgt_len, -1), v
        return self.attend_logits(logits, masked, query_padding_mask, v, incremental_state,
                                  bsz, tgt_len, need_weights, need_head_weights, empty)

    def attention_logits(self, query: Tensor, key: Optional[Tensor], value: Optional[Tensor],
                         key_padding_mask: Optional[Tensor], attn_mask: Optional[Tensor],
                         incremental_state, static_kv: bool):
        """The logit source: ``(logits (B or 1, H, T, S), values (B_kv * H, S, head_dim), key
        padding (B, S) or None, future mask (T, S) or None)`` of this call, the logits with no
        mask in them (every entry finite); in a decoding step the key padding of every key the
        step sees."""
        raise NotImplementedError

    def transform_logits(self, logits: Tensor, masked: Optional[Tensor],
                         query_padding_mask: Optional[Tensor], incremental_state) -> Tensor:
        """The logit transform: rewrite the logits ``(batch, heads, tgt, src)`` before the softmax.

        ``masked`` marks the masked entries (padding keys, future positions), broadcastable
        to ``logits``, or is None when nothing is masked; in ``logits`` they hold the raw
        scores, in the result they must hold ``-inf``, written right before the softmax (a
        mechanism does no arithmetic on ``-inf``). ``logits`` is a fresh score tensor, which
        autograd does not keep: it may be changed in place. ``query_padding_mask`` (batch,
        tgt) marks padded query rows (self-attention in a full pass; encoder-decoder
        attention where its decoder layer hands on the target padding), or is None. Here:
        just the masking.
        """
        return fill_masked_(logits, masked, float("-inf"))

    def attend_logits(self, logits: Tensor, masked: Optional[Tensor],
                      query_padding_mask: Optional[Tensor], v: Tensor, incremental_state,
                      bsz: int, tgt_len: int, need_weights: bool, need_head_weights: bool,
                      empty: Optional[Tensor] = None):
        """Everything after the source: fairseq's ``(attn, weights)`` pair. Here
        :meth:`transform_logits`, then softmax (zero weights in the rows ``empty`` marks),
        dropout, values and output projection (:meth:`attend_with`); a mechanism that
        computes the weights and the value product itself overrides this."""
        logits = self.transform_logits(logits, masked, query_padding_mask, incremental_state)
        return self.attend_with(logits, v, bsz, tgt_len, need_weights, need_head_weights, empty)

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
        """:func:`~ea_ops.softmax.fully_masked_rows` of ``masked``, once
        per pass of the stack (every layer gets the same masks)."""
        if masked is None:
            return None
        return self.derived(self.empty_name, lambda: fully_masked_rows(masked))

    # -- the decoding run's cache ----------------------------------------------------------
    def cache(self, incremental_state) -> AttentionCache:
        """This module's :class:`AttentionCache` in the run's ``incremental_state``."""
        cache = self.get_incremental_state(incremental_state, CACHE)
        if cache is None:
            cache = AttentionCache()
            self.set_incremental_state(incremental_state, CACHE, cache)
        return cache

    def get_mechanism_state(self, incremental_state) -> Any:
        """The mechanism's own part of the cache: a dict of tensors (changed in place; empty
        at a run's first step), or what the mechanism stored with :meth:`set_mechanism_state`."""
        return self.cache(incremental_state).mechanism

    def set_mechanism_state(self, incremental_state, state: Any) -> None:
        self.cache(incremental_state).mechanism = state

    def reorder_incremental_state(self, incremental_state, new_order: Tensor):
        """Beam search's new order of hypotheses (fairseq's decoder calls this on every
        module that has it): the cache's one reorder."""
        cache = self.get_incremental_state(incremental_state, CACHE)
        if cache is not None:
            cache.reorder(new_order, self.reorder_mechanism_state)
        return incremental_state

    def reorder_mechanism_state(self, state: Any, new_order: Tensor) -> Any:
        """The mechanism's state in the new order of hypotheses; here a dict whose every
        tensor is batch first, reordered in place. A mechanism whose state is laid out
        otherwise overrides this."""
        for k, v in state.items():
            if v is not None:
                state[k] = v.index_select(0, new_order)
        return state

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
