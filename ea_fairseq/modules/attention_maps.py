"""Attention whose logit map is visible, and the carrier that hands it to the next layer.

Every mechanism in this plugin works on the pre-softmax attention map of a fairseq
:class:`~fairseq.modules.MultiheadAttention`: EA and PA rewrite it (convolutions, skip
connections to the previous layer's map), DropAttention drops entries of the softmax
output. :class:`LogitMapAttention` is the one place where that map is exposed:

* :meth:`LogitMapAttention.forward` computes the logits ``QK^T / sqrt(d)`` with
  fairseq's projections and into fairseq's key/value cache, in fewer kernels than
  fairseq's unfused path (which is the only one that exposes them): the projections that
  read the same input in one matmul, a decoding run's query scaling folded into its
  projection, no in-place scaling on a view for autograd to copy back
  (:meth:`LogitMapAttention.full_pass_logits`, :meth:`LogitMapAttention.step_logits`).
  Where the masks do not describe the whole map (a self-attention's key padding in a
  decoding step, other mask shapes) or a projection has hooks (quantization noise, value
  residual), ``super().forward(..., before_softmax=True)`` lets fairseq compute them,
  with its ``-inf`` where it masked;
* :meth:`LogitMapAttention.transform_logits` is the hook a mechanism overrides; it
  masks (padded keys are masked there, once, in place, wherever the padding mask covers
  every key: full passes, and the encoder's keys in a decoding step); a mechanism reports
  its intermediate maps to whoever registered a hook for them
  (:meth:`LogitMapAttention.register_map_hook`: the analysis tool), at no cost otherwise;
* softmax (:mod:`~ea_fairseq.modules.masked_softmax`: zero weights in a row whose every
  key is masked, as torch's fused attention gives), :meth:`drop_weights` (attention
  dropout), the value product and the output projection follow, as in fairseq. A mechanism that computes the weights and the value
  product itself overrides :meth:`LogitMapAttention.attend_logits` (everything after QK^T)
  instead.

The boolean masks every layer derives alike from the pass's padding and future masks are
computed once per forward pass of the stack (:meth:`AttentionMapCarrier.shared`).

A fairseq-built ``MultiheadAttention`` becomes a mechanism in place with
:meth:`LogitMapAttention.promote`: parameters, their names in the state dict and their
initialisation stay exactly those of the vanilla module; the mechanism adds its own.
What does not depend on where the logits come from (carrier, map hooks, dropout, softmax
and value product, the mechanism's cache) is :class:`AttentionMechanism`, which RAN's
attention, a module of its own without query and key projections, shares.
"""
import inspect
from collections import OrderedDict
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from fairseq.modules import MultiheadAttention
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from .attention_map_carrier import AttentionMapCarrier, shared_in_pass  # noqa: F401  (re-exported)
from .attention_masks import (fill_masked, fill_masked_, masked_entries,  # noqa: F401  (re-exported)
                              neutral_entries, pad_rows_to)
from .masked_softmax import attention_weights, fully_masked_rows  # noqa: F401  (one softmax for all)
from .weighted_values import fairseq_weights, value_product  # noqa: F401  (re-exported)

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
        """:func:`~ea_fairseq.modules.masked_softmax.fully_masked_rows` of ``masked``, once
        per pass of the stack (every layer gets the same masks)."""
        if masked is None:
            return None
        return shared_in_pass(self.attention_maps, "empty_rows", (masked,), lambda: fully_masked_rows(masked))

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
    fairseq's attention; mechanisms subclass it. Built either from a fairseq-built module
    (:meth:`promote`, what the models do) or directly, with ``MultiheadAttention``'s
    arguments and the mechanism's options as keywords
    (``EvolvingAttention(16, 4, self_attention=True, slot="self", alpha=0.0, beta=0.1,
    kernel_size=3, conv_layout="causal", hand_on=False)``).
    """

    def __init__(self, *args, **kwargs):
        options = {k: kwargs.pop(k) for k in list(kwargs) if k in self.mechanism_options()}
        missing = [k for k, p in inspect.signature(self.setup_mechanism).parameters.items()
                   if p.default is inspect.Parameter.empty and k not in options
                   and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
        if missing:
            raise TypeError(
                f"{type(self).__name__} needs its mechanism's options {missing} as keywords, "
                f"after MultiheadAttention's arguments (e.g. {type(self).__name__}(16, 4, "
                f"self_attention=True, {', '.join(f'{k}=...' for k in missing)})); or build it "
                f"from a fairseq MultiheadAttention with {type(self).__name__}.promote(attn, ...), "
                "as the models of this plugin do."
            )
        super().__init__(*args, **kwargs)
        self._become_mechanism(options)

    @classmethod
    def mechanism_options(cls):
        return [k for k, p in inspect.signature(cls.setup_mechanism).parameters.items()
                if k != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]

    @classmethod
    def promote(cls, attn: MultiheadAttention, **options) -> "LogitMapAttention":
        """Turn a fairseq-built ``MultiheadAttention`` into ``cls`` in place."""
        if not isinstance(attn, MultiheadAttention):
            raise TypeError(f"expected a fairseq MultiheadAttention, got {type(attn).__name__}")
        attn.__class__ = cls
        attn._become_mechanism(options)
        return attn

    def _become_mechanism(self, options) -> None:
        cls = type(self)
        if self.bias_k is not None or self.add_zero_attn:
            raise ValueError(
                f"{cls.__name__} works on the token-by-token attention map and cannot take "
                "the extra key column of --add-bias-kv / --add-zero-attn; drop those options."
            )
        if getattr(self, "use_xformers", False):
            raise ValueError(
                f"{cls.__name__} needs the attention logits, which xformers attention does "
                "not expose; drop --encoder/--decoder-xformers-att-config."
            )
        self.init_mechanism()
        # fairseq's fused training path (F.multi_head_attention_forward) ignores
        # before_softmax; skipping the embed-dim check is what routes every call through
        # the path that returns the logits.
        self.skip_embed_dim_check = True
        self.setup_mechanism(**options)

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
        where fairseq's path masked them (see :meth:`forward`) and the raw scores otherwise;
        in the result they must hold ``-inf``, written right before the softmax (a mechanism
        does no arithmetic on ``-inf``).
        ``logits`` is a fresh score tensor, which autograd does not keep: it may be
        changed in place. ``query_padding_mask`` (batch, tgt) marks padded query rows
        (self-attention in a full forward pass; encoder-decoder attention where its
        decoder layer hands on the target padding), or is None. Here: just the masking.
        """
        return fill_masked_(logits, masked, float("-inf"))

    def attend_logits(self, logits: Tensor, masked: Optional[Tensor],
                      query_padding_mask: Optional[Tensor], v: Tensor, incremental_state,
                      bsz: int, tgt_len: int, need_weights: bool, need_head_weights: bool,
                      empty: Optional[Tensor] = None):
        """Everything after QK^T: fairseq's ``(attn, weights)`` pair. Here
        :meth:`transform_logits`, then softmax (zero weights in the rows ``empty`` marks),
        dropout, values and output projection (:meth:`attend_with`); a mechanism that
        computes the weights and the value product itself overrides this."""
        logits = self.transform_logits(logits, masked, query_padding_mask, incremental_state)
        return self.attend_with(logits, v, bsz, tgt_len, need_weights, need_head_weights, empty)

    def neutral_entries(self, masked: Optional[Tensor], query_padding_mask: Optional[Tensor]):
        """:func:`neutral_entries`, computed once per pass of the stack."""
        if masked is None or query_padding_mask is None:
            return neutral_entries(masked, query_padding_mask)
        return shared_in_pass(self.attention_maps, "neutral", (masked, query_padding_mask),
                              lambda: neutral_entries(masked, query_padding_mask))

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
        # the padded keys are masked once, in place, by the mechanism; fairseq would mask
        # them out of place first, only for a mechanism to overwrite the same entries
        # again. Otherwise (decoder self-attention steps, whose cached keys fairseq pads
        # itself; any other mask shape) fairseq masks them and masked_entries reads its
        # -inf back.
        own_padding = (
            (incremental_state is None or static_kv) and key_padding_mask is not None
            and key is not None and key_padding_mask.shape == (bsz, key.size(0))
        )
        # The logits are computed here (no mask in them: the mechanism masks) where the
        # masks describe the whole map: a key padding mask over every key, a (T, S) future
        # mask; fairseq's own path otherwise, and for fairseq's beam-shared encoder keys in
        # a full pass.
        computed = None
        if key_padding_mask is None or own_padding:
            if incremental_state is None:
                src_len = tgt_len if key is None else key.size(0)
                if ((attn_mask is None or attn_mask.shape == (tgt_len, src_len))
                        and not (self.encoder_decoder_attention and self.beam_size > 1)):
                    computed = self.full_pass_logits(query, key, value)
            elif attn_mask is None:
                computed = self.step_logits(query, key, key_padding_mask, incremental_state, static_kv)
        if computed is not None:
            logits, v = computed
        else:
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
            if self.self_attention and incremental_state is not None:
                # a decoding step: fairseq masked the cached keys' padding too (a step without
                # padding of its own after padded ones); its saved mask covers every key
                key_padding_mask = self._get_input_buffer(incremental_state).get(
                    "prev_key_padding_mask", key_padding_mask)
        masked = masked_entries(logits, key_padding_mask, attn_mask, self.attention_maps)
        # Rows with every key masked: where the key padding meets a future mask (a full pass
        # of a decoder fed left-padded targets) or the cached keys of a decoding step (a
        # left-padded prefix). Key padding alone empties a row only for a sentence that is
        # all padding, which fairseq never batches: no per-layer cost for it.
        empty = None
        if key_padding_mask is not None and (attn_mask is not None or (
                self.self_attention and incremental_state is not None)):
            empty = self.empty_rows(masked)
        query_padding_mask = None
        if self.self_attention and incremental_state is None and key_padding_mask is not None:
            query_padding_mask = key_padding_mask.to(torch.bool)
        elif self.encoder_decoder_attention and self.attention_maps is not None:
            # the target padding, which the decoder layer hands on (left-padded targets)
            target_padding = self.attention_maps.previous("target_padding")
            if target_padding is not None and target_padding.shape == (bsz, tgt_len):
                query_padding_mask = target_padding.to(torch.bool)
        if before_softmax:
            logits = self.transform_logits(logits, masked, query_padding_mask, incremental_state)
            return logits.view(bsz * self.num_heads, tgt_len, -1), v
        return self.attend_logits(logits, masked, query_padding_mask, v, incremental_state,
                                  bsz, tgt_len, need_weights, need_head_weights, empty)

    def full_pass_logits(self, query: Tensor, key: Optional[Tensor], value: Optional[Tensor]):
        """``(QK^T / sqrt(d) as (B, H, T, S), V as (B * H, S, head_dim))`` of a full pass, with
        no mask: every entry is finite. fairseq's projections and scaling, the projections
        that read the same input in one matmul (:meth:`joined_projection`); the queries are
        scaled out of place (fairseq scales them in place, on a view of their projection,
        which makes autograd copy the whole projection back in the backward pass)."""
        tgt_len, bsz, _ = query.size()
        if self.self_attention:
            q, k, v = self.project(query, ("q_proj", "k_proj", "v_proj"))
        else:
            (q,) = self.project(query, ("q_proj",))
            if key is value:
                k, v = self.project(key, ("k_proj", "v_proj"))
            else:
                (k,), (v,) = self.project(key, ("k_proj",)), self.project(value, ("v_proj",))
        q = (q * self.scaling).transpose(0, 1)
        logits = torch.bmm(q, k.transpose(0, 1).transpose(1, 2))
        return logits.view(bsz, self.num_heads, tgt_len, -1), v.transpose(0, 1)

    def project(self, x: Tensor, names: Tuple[str, ...],
                joined: Optional[Tuple[Tensor, Optional[Tensor]]] = None) -> List[Tensor]:
        """The projections ``names`` of ``x`` (T, B, C), each as (T, B * H, head_dim):
        in one matmul where :meth:`joined_projection` (or ``joined``) joins them, else
        each by its module."""
        length, bsz = x.size(0), x.size(1)
        heads, head_dim = self.num_heads, self.head_dim
        if joined is None and len(names) > 1:
            joined = self.joined_projection(names)
        if joined is not None:
            return list(F.linear(x, *joined).view(length, bsz * heads, len(names), head_dim).unbind(2))
        return [getattr(self, n)(x).view(length, bsz * heads, head_dim) for n in names]

    def joined_projection(self, names: Tuple[str, ...], scaled: bool = False
                          ) -> Optional[Tuple[Tensor, Optional[Tensor]]]:
        """``(weight, bias)`` of the projections ``names`` in one, their rows interleaved per
        head (head h's rows of each projection together, so that each projection's output
        is a view of the joined one's); with ``scaled`` the query projection's (the first)
        times fairseq's scaling. None for a projection other than a plain ``nn.Linear``
        without hooks (quantization noise, value residual), which only its own ``forward``
        computes, or a mix of biased and unbiased projections."""
        modules = [getattr(self, name) for name in names]
        if any(type(m) is not nn.Linear or m._forward_hooks or m._forward_pre_hooks for m in modules):
            return None
        biases = [m.bias for m in modules]
        if any(b is None for b in biases) and any(b is not None for b in biases):
            return None
        factor = [self.scaling if scaled and i == 0 else None for i in range(len(modules))]

        def joined(tensors):
            parts = [t if f is None else t * f for t, f in zip(tensors, factor)]
            if len(parts) == 1:
                return parts[0]
            shape = (self.num_heads, self.head_dim) + parts[0].shape[1:]
            return torch.stack([t.view(shape) for t in parts], 1).flatten(0, 2)

        return joined([m.weight for m in modules]), None if biases[0] is None else joined(biases)

    def step_logits(self, query: Tensor, key: Optional[Tensor], key_padding_mask: Optional[Tensor],
                    incremental_state, static_kv: bool):
        """What :meth:`full_pass_logits` returns, for a decoding step, reading and writing
        fairseq's key/value cache (the same entries in the same layout, so that fairseq's
        reorder and its own path read them alike). The queries' projection with the
        scaling folded in -- joined with the key and value projections in a self-attention
        -- is made once per decoding run (:meth:`step_projection`). None where fairseq's
        path must run: a self-attention's key padding, a projection of another kind."""
        saved = self._get_input_buffer(incremental_state)
        if self.self_attention:
            if key_padding_mask is not None or saved.get("prev_key_padding_mask") is not None:
                return None
        elif not (self.encoder_decoder_attention and static_kv):
            return None
        names = ("q_proj", "k_proj", "v_proj") if self.self_attention else ("q_proj",)
        projection = self.step_projection(incremental_state, names)
        if projection is None:
            return None
        tgt_len, bsz, _ = query.size()
        heads, head_dim = self.num_heads, self.head_dim
        if self.self_attention:
            q, k, v = (x.transpose(0, 1) for x in self.project(query, names, joined=projection))
            if "prev_key" in saved:
                k = torch.cat([saved["prev_key"].view(bsz * heads, -1, head_dim), k], dim=1)
                v = torch.cat([saved["prev_value"].view(bsz * heads, -1, head_dim), v], dim=1)
            kv_bsz = bsz
        else:  # encoder-decoder attention
            q = self.project(query, names, joined=projection)[0].transpose(0, 1)
            if "prev_key" in saved:
                k, v = saved["prev_key"], saved["prev_value"]
                kv_bsz = k.size(0)
                k, v = k.view(kv_bsz * heads, -1, head_dim), v.view(kv_bsz * heads, -1, head_dim)
            else:
                if self.beam_size > 1 and bsz == key.size(1):  # fairseq's beam-shared keys
                    key = key.view(key.size(0), -1, self.beam_size, key.size(2))[:, :, 0, :]
                    if key_padding_mask is not None:
                        key_padding_mask = key_padding_mask.view(-1, self.beam_size, key_padding_mask.size(1))[:, 0, :]
                kv_bsz = key.size(1)
                # kept for the whole run and read at every step: contiguous, once
                k, v = (x.transpose(0, 1).contiguous() for x in self.project(key, ("k_proj", "v_proj")))
        saved["prev_key"] = k.view(kv_bsz, heads, -1, head_dim)
        saved["prev_value"] = v.view(kv_bsz, heads, -1, head_dim)
        saved["prev_key_padding_mask"] = MultiheadAttention._append_prev_key_padding_mask(
            key_padding_mask if self.encoder_decoder_attention else None,
            saved.get("prev_key_padding_mask"), kv_bsz, k.size(1), static_kv)
        self._set_input_buffer(incremental_state, saved)
        if kv_bsz != bsz:  # beams of a sentence share its keys
            logits = torch.einsum("bxhtd,bhsd->bxhts", q.view(kv_bsz, -1, heads, tgt_len, head_dim),
                                  k.view(kv_bsz, heads, -1, head_dim))
        else:
            logits = torch.bmm(q, k.transpose(1, 2))
        return logits.reshape(bsz, heads, tgt_len, -1), v

    def step_projection(self, incremental_state, names: Tuple[str, ...]
                        ) -> Optional[Tuple[Tensor, Optional[Tensor]]]:
        """:meth:`joined_projection` of ``names``, scaled: once per decoding run (every
        step where autograd records)."""
        if torch.is_grad_enabled():
            return self.joined_projection(names, scaled=True)
        memo = self.get_incremental_state(incremental_state, "step_projection")
        if memo is not None:
            return memo["weight"], memo.get("bias")
        projection = self.joined_projection(names, scaled=True)
        if projection is not None:
            weight, bias = projection
            self.set_incremental_state(incremental_state, "step_projection",
                                       {"weight": weight} if bias is None else {"weight": weight, "bias": bias})
        return projection

    def reorder_incremental_state(self, incremental_state, new_order: Tensor):
        """Reorder fairseq's key/value cache, then the mechanism's own cache.

        fairseq's encoder-decoder attention returns early when the batch size did not
        change (its keys and values are the same for all beams of a sentence); the
        mechanism's cache is reordered all the same.
        """
        incremental_state = MultiheadAttention.reorder_incremental_state(self, incremental_state, new_order)
        return super().reorder_incremental_state(incremental_state, new_order)
