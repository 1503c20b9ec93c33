"""Attention whose logit map is visible, and the carrier that hands it to the next layer.

Every mechanism in this plugin works on the pre-softmax attention map of a fairseq
:class:`~fairseq.modules.MultiheadAttention`: EA and PA rewrite it (convolutions, skip
connections to the previous layer's map), DropAttention drops entries of the softmax
output. :class:`LogitMapAttention` is the one place where that map is exposed:

* ``super().forward(..., before_softmax=True)`` lets fairseq do everything up to the
  logits -- projections, key/value caching for incremental decoding, beam-shared
  encoder keys, the causal mask, and in decoding steps the key padding (all ``-inf``);
* :meth:`LogitMapAttention.transform_logits` is the hook a mechanism overrides; it
  masks (padded keys are masked there, once, in place, wherever the padding mask covers
  every key: full passes, and the encoder's keys in a decoding step); a mechanism reports
  its intermediate maps to whoever registered a hook for them
  (:meth:`LogitMapAttention.register_map_hook`: the analysis tool), at no cost otherwise;
* softmax, :meth:`drop_weights` (attention dropout), the value product and the output
  projection follow, as in fairseq. In a decoding step a mechanism may compute the
  weights and the value product in one go instead (:meth:`LogitMapAttention.attend_step`).

A fairseq-built ``MultiheadAttention`` becomes a mechanism in place with
:meth:`LogitMapAttention.promote`: parameters, their names in the state dict and their
initialisation stay exactly those of the vanilla module; the mechanism adds its own.
What does not depend on where the logits come from (carrier, map hooks, dropout, softmax
and value product, the mechanism's cache) is :class:`AttentionMechanism`, which RAN's
attention, a module of its own without query and key projections, shares.
"""
from collections import OrderedDict
from contextlib import contextmanager
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from fairseq.modules import MultiheadAttention
from torch import Tensor
from torch.utils.hooks import RemovableHandle


class AttentionMapCarrier:
    """Hands each layer's attention logits to the next layer of the same stack.

    One carrier is owned by an encoder or a decoder and shared by its layers' attention
    modules (``slot`` names the attention kind: ``"self"`` or ``"cross"``). It is a plain
    object, not a module: it never enters the state dict, and :meth:`scope` empties it
    before and after every forward pass of its stack, so no tensor (or autograd graph)
    outlives the pass that made it.
    """

    def __init__(self):
        self._last: Dict[str, Tensor] = {}

    @contextmanager
    def scope(self):
        self._last.clear()
        try:
            yield self
        finally:
            self._last.clear()

    def previous(self, slot: str) -> Optional[Tensor]:
        """The logits the previous layer handed on for ``slot`` (None in the first layer)."""
        return self._last.get(slot)

    def hand_on(self, slot: str, logits: Tensor) -> None:
        self._last[slot] = logits


class AttentionMechanism:
    """What every attention of this plugin shares, whether it computes its logits from
    queries and keys (:class:`LogitMapAttention`) or not (RAN's
    :class:`~ea_fairseq.modules.recurrent_attention.RecurrentAttention`): the stack's
    carrier, the map hooks, attention dropout or DropAttention, softmax and value product,
    and the mechanism's own incremental state.

    A mixin for a module with ``embed_dim``, ``num_heads``, ``head_dim``, ``out_proj``,
    ``dropout_module`` and fairseq's incremental-state helpers.
    """

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
        Masked entries hold zeros. The maps exist in the mechanisms' reference
        implementations, so run the hooked passes inside
        :func:`ea_fairseq.accelerators.reference_only`. Returns a handle with ``remove()``."""
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
                    need_weights: bool, need_head_weights: bool):
        """softmax, dropout on the weights, values and output projection.

        ``logits`` is (B, H, T, S) with -inf where masked; ``v`` is (B_kv * H, S, head_dim).
        Returns fairseq's ``(attn, weights)`` pair.
        """
        # softmax in at least float32 (fp16/bf16 upcast, as fairseq), double stays double;
        # the weights meet the values in the values' dtype
        if logits.dtype in (torch.float32, torch.float64):
            probs_float = logits.softmax(-1)  # (one decoding step: no casts to pay for)
        else:
            probs_float = logits.softmax(-1, dtype=torch.float32)
        probs = probs_float if probs_float.dtype == v.dtype else probs_float.to(v.dtype)
        attn = self._attend(self.drop_weights(probs), v, bsz, tgt_len)
        return attn, fairseq_weights(probs_float, need_weights, need_head_weights)

    def _attend(self, probs: Tensor, v: Tensor, bsz: int, tgt_len: int) -> Tensor:
        """Weighted sum of values and output projection; ``probs`` is (B, H, T, S)."""
        heads, src_len = self.num_heads, probs.size(-1)
        kv_bsz = v.size(0) // heads
        v = v.view(kv_bsz, heads, src_len, self.head_dim)
        if kv_bsz != bsz:
            # beam search shares the encoder's keys/values across a sentence's beams: the
            # beams' rows go into one matmul per sentence and head (a broadcasting matmul
            # would copy v once per beam)
            beams = bsz // kv_bsz
            rows = probs.view(kv_bsz, beams, heads, tgt_len, src_len).transpose(1, 2)
            out = torch.matmul(rows.reshape(kv_bsz, heads, beams * tgt_len, src_len), v)
            out = out.view(kv_bsz, heads, beams, tgt_len, self.head_dim).permute(3, 0, 2, 1, 4)
        else:
            out = torch.matmul(probs, v).permute(2, 0, 1, 3)  # (T, B, H, head_dim)
        return self.out_proj(out.reshape(tgt_len, bsz, self.embed_dim))

    # -- incremental state of a mechanism ----------------------------------------------
    def get_mechanism_state(self, incremental_state) -> Dict[str, Optional[Tensor]]:
        state = self.get_incremental_state(incremental_state, "mechanism_state")
        return state if state is not None else {}

    def set_mechanism_state(self, incremental_state, state: Dict[str, Optional[Tensor]]):
        self.set_incremental_state(incremental_state, "mechanism_state", state)

    def reorder_incremental_state(self, incremental_state, new_order: Tensor):
        """Reorder the mechanism's own cache (always: its earlier *target* rows depend on
        each beam's prefix)."""
        state = self.get_incremental_state(incremental_state, "mechanism_state")
        if state is not None:  # the dict stored in the incremental state, changed in place
            self.reorder_mechanism_state(state, new_order)
        return incremental_state

    def reorder_mechanism_state(self, state: Dict[str, Optional[Tensor]], new_order: Tensor) -> None:
        """Put the mechanism's cache in the new order of hypotheses (in place)."""
        for k, v in state.items():
            if v is not None:
                state[k] = v.index_select(0, new_order)


class LogitMapAttention(AttentionMechanism, MultiheadAttention):
    """``MultiheadAttention`` with a hook on its logit map (see module docstring).

    With the identity :meth:`transform_logits` and plain dropout it computes exactly
    fairseq's attention; mechanisms subclass it.
    """

    @classmethod
    def promote(cls, attn: MultiheadAttention, **options) -> "LogitMapAttention":
        """Turn a fairseq-built ``MultiheadAttention`` into ``cls`` in place."""
        if not isinstance(attn, MultiheadAttention):
            raise TypeError(f"expected a fairseq MultiheadAttention, got {type(attn).__name__}")
        if attn.bias_k is not None or attn.add_zero_attn:
            raise ValueError(
                f"{cls.__name__} works on the token-by-token attention map and cannot take "
                "the extra key column of --add-bias-kv / --add-zero-attn; drop those options."
            )
        if getattr(attn, "use_xformers", False):
            raise ValueError(
                f"{cls.__name__} needs the attention logits, which xformers attention does "
                "not expose; drop --encoder/--decoder-xformers-att-config."
            )
        attn.__class__ = cls
        attn.init_mechanism()
        # fairseq's fused training path (F.multi_head_attention_forward) ignores
        # before_softmax; skipping the embed-dim check is what routes every call through
        # the path that returns the logits.
        attn.skip_embed_dim_check = True
        attn.setup_mechanism(**options)
        return attn

    def setup_mechanism(self, **options) -> None:
        """Add the mechanism's own parameters and settings (subclasses)."""
        if options:
            raise TypeError(f"unexpected options {sorted(options)}")

    # -- hooks ---------------------------------------------------------------------------
    def transform_logits(
        self,
        logits: Tensor,
        masked: Optional[Tensor],
        query_padding_mask: Optional[Tensor],
        incremental_state,
    ) -> Tensor:
        """Rewrite the logits ``(batch, heads, tgt, src)`` before the softmax.

        ``masked`` marks the masked entries (padding keys, future positions), broadcastable
        to ``logits``, or is None when nothing is masked. In ``logits`` they hold ``-inf``
        where fairseq masked them (future positions; padded keys in decoding steps) and the
        raw scores otherwise (padded keys in a full pass, see :meth:`forward`); in the
        result they must hold ``-inf``, written right before the softmax (a mechanism does
        no arithmetic on ``-inf``).
        ``logits`` is fairseq's fresh score tensor, which autograd does not keep: it may be
        changed in place. ``query_padding_mask`` (batch, tgt) marks padded query rows
        (self-attention in a full forward pass only). Here: just the masking.
        """
        return fill_masked_(logits, masked, float("-inf"))

    def attend_step(self, logits: Tensor, masked: Optional[Tensor], v: Tensor,
                    incremental_state) -> Optional[Tuple[Tensor, Tensor]]:
        """One decoding step's attention after QK^T in one go, or None (here: always) for
        :meth:`transform_logits`, softmax, :meth:`drop_weights` and the value product.

        ``logits``, ``masked`` as for :meth:`transform_logits` (a step has no padded query
        rows), ``v`` (B_kv * H, S, head_dim) as for :meth:`attend_with`. Returns
        ``(context, weights)``: the value product (T, B, embed_dim), the output projection's
        input, and the weights ``softmax(transform_logits(...))`` (B, H, T, S). Only called
        where :meth:`drops_weights` is False.
        """
        return None

    # -- forward -------------------------------------------------------------------------
    def forward(
        self,
        query: Tensor,
        key: Optional[Tensor],
        value: Optional[Tensor],
        key_padding_mask: Optional[Tensor] = None,
        incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]] = None,
        need_weights: bool = True,
        static_kv: bool = False,
        attn_mask: Optional[Tensor] = None,
        before_softmax: bool = False,
        need_head_weights: bool = False,
    ):
        tgt_len, bsz, _ = query.size()
        # Where the padding mask covers every key -- a full pass, or the encoder's keys in a
        # decoding step (static_kv: the caller hands them, and their mask, to every step) --
        # the padded keys are masked once, in place, by transform_logits (or attend_step);
        # fairseq would mask them out of place first, only for a mechanism to overwrite the
        # same entries again. Otherwise (decoder self-attention steps, whose cached keys
        # fairseq pads itself; any other mask shape) fairseq masks them and masked_entries
        # reads its -inf back.
        own_padding = (
            (incremental_state is None or static_kv) and key_padding_mask is not None
            and key is not None and key_padding_mask.shape == (bsz, key.size(0))
        )
        logits, v = super().forward(
            query,
            key,
            value,
            key_padding_mask=None if own_padding else key_padding_mask,
            incremental_state=incremental_state,
            need_weights=False,
            static_kv=static_kv,
            attn_mask=attn_mask,
            before_softmax=True,
        )
        logits = logits.view(bsz, self.num_heads, tgt_len, -1)
        masked = masked_entries(logits, key_padding_mask, attn_mask)
        if incremental_state is not None and not before_softmax and not self.drops_weights():
            step = self.attend_step(logits, masked, v, incremental_state)
            if step is not None:
                context, probs = step
                return self.out_proj(context), fairseq_weights(probs, need_weights, need_head_weights)
        query_padding_mask = None
        if self.self_attention and incremental_state is None and key_padding_mask is not None:
            query_padding_mask = key_padding_mask.to(torch.bool)
        logits = self.transform_logits(logits, masked, query_padding_mask, incremental_state)
        if before_softmax:
            return logits.view(bsz * self.num_heads, tgt_len, -1), v
        return self.attend_with(logits, v, bsz, tgt_len, need_weights, need_head_weights)

    def reorder_incremental_state(self, incremental_state, new_order: Tensor):
        """Reorder fairseq's key/value cache, then the mechanism's own cache.

        fairseq's encoder-decoder attention returns early when the batch size did not
        change (its keys and values are the same for all beams of a sentence); the
        mechanism's cache is reordered all the same.
        """
        incremental_state = MultiheadAttention.reorder_incremental_state(self, incremental_state, new_order)
        return super().reorder_incremental_state(incremental_state, new_order)


def fairseq_weights(probs: Tensor, need_weights: bool, need_head_weights: bool) -> Optional[Tensor]:
    """The weights fairseq's attention returns: per head (heads x batch x tgt x src) or
    averaged over heads, or None when not asked for."""
    if not (need_weights or need_head_weights):
        return None
    weights = probs.transpose(1, 0)
    return weights if need_head_weights else weights.mean(dim=0)


def masked_entries(logits: Tensor, key_padding_mask: Optional[Tensor],
                   attn_mask: Optional[Tensor]) -> Optional[Tensor]:
    """The entries fairseq masked in ``logits`` (B, H, T, S), as a broadcastable bool mask.

    fairseq writes both masks as ``-inf``: padded keys (``key_padding_mask``, B x S) and
    future positions (``attn_mask``, T x S, additive). Built from the small masks when they
    describe the whole map, from the logits themselves otherwise (e.g. the key padding of
    one incremental step, which fairseq extends with its cached keys). None when there is no
    mask at all, so that callers skip the masking passes. Decided from shapes only: no
    look at the masks' values, which on a GPU would wait for the device.
    """
    bsz, _, tgt_len, src_len = logits.shape
    masked = None
    if key_padding_mask is not None:
        if key_padding_mask.shape != (bsz, src_len):
            return torch.isneginf(logits)
        if key_padding_mask.dtype != torch.bool:
            key_padding_mask = key_padding_mask.to(torch.bool)
        masked = key_padding_mask[:, None, None, :]
    if attn_mask is not None:
        if attn_mask.shape != (tgt_len, src_len):
            return torch.isneginf(logits)
        future = attn_mask if attn_mask.dtype == torch.bool else torch.isneginf(attn_mask)
        masked = future[None, None] if masked is None else masked | future[None, None]
    return masked


def neutral_entries(masked: Optional[Tensor], query_padding_mask: Optional[Tensor]) -> Optional[Tensor]:
    """Entries a map transform must treat as neutral zeros: ``masked`` plus padded query rows."""
    if query_padding_mask is None:
        return masked
    padded_rows = query_padding_mask[:, None, :, None]
    return padded_rows if masked is None else masked | padded_rows


def fill_masked(values: Tensor, mask: Optional[Tensor], fill: float) -> Tensor:
    """``values.masked_fill(mask, fill)``; ``values`` itself when ``mask`` is None."""
    return values if mask is None else values.masked_fill(mask, fill)


def fill_masked_(values: Tensor, mask: Optional[Tensor], fill: float) -> Tensor:
    """In-place :func:`fill_masked`."""
    return values if mask is None else values.masked_fill_(mask, fill)


def pad_rows_to(rows: Tensor, width: int) -> Tensor:
    """Right-pad cached map rows (B, H, R, S') with zeros to ``width`` key columns."""
    missing = width - rows.size(-1)
    return F.pad(rows, (0, missing)) if missing > 0 else rows
