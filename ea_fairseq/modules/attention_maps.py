"""Multi-head attention whose logit map is visible: the module every logit-map mechanism of
this plugin is.

Every mechanism here works on the pre-softmax attention map ``QK^T / sqrt(d)``: EA and PA
rewrite it (convolutions, skip connections to the previous layer's map), RealFormer adds
the previous layer's, DropAttention drops entries of the softmax output.
:class:`LogitMapAttention` is fairseq's multi-head attention (the same parameters under the
same names -- ``q_proj``, ``k_proj``, ``v_proj``, ``out_proj`` -- initialised alike, so a
checkpoint of either loads into the other): the logit source ``QK^T / sqrt(d)`` of the
plugin's one attention path (:class:`~ea_fairseq.modules.attention_mechanism.AttentionMechanism`,
which masks, transforms, softmaxes and multiplies with the values alike for every
mechanism). The logits of a full pass (:meth:`LogitMapAttention.full_pass_logits`) or of a
decoding step (:meth:`LogitMapAttention.step_logits`, keys and values in the run's
:class:`~ea_fairseq.modules.attention_cache.AttentionCache`) come with no mask in them: the
projections that read the same input in one matmul, a decoding run's query scaling folded
into its projection (:mod:`~ea_fairseq.modules.attention_projections`). A mechanism
overrides :meth:`~ea_fairseq.modules.attention_mechanism.AttentionMechanism.transform_logits`
(masking with ``-inf``, once, in place, last), and reports its intermediate maps to whoever
registered a hook for them (the analysis tool), at no cost otherwise; a mechanism that
computes the weights and the value product itself overrides
:meth:`~ea_fairseq.modules.attention_mechanism.AttentionMechanism.attend_logits`.

With the identity transform it computes fairseq's attention. The layer builders make it
directly (``EvolvingAttention(embed_dim, heads, self_attention=True, slot="self", ...)``:
fairseq's ``MultiheadAttention`` arguments, then the mechanism's options).
"""
import inspect
from typing import Callable, Optional, Tuple

import torch
import torch.nn as nn
from fairseq.incremental_decoding_utils import with_incremental_state
from torch import Tensor

from ea_ops.masks import neutral_entries

from .attention_mechanism import AttentionMechanism
from .attention_projections import joined_projection, project


@with_incremental_state
class LogitMapAttention(AttentionMechanism, nn.Module):
    """Multi-head attention with a hook on its logit map (see module docstring).

    ``value_projection(in_features, out_features, bias=...)`` makes the value projection
    (an ``nn.Linear``; value residual learning's mixes in the first layer's values).
    """

    def __init__(self, embed_dim: int, num_heads: int, kdim: Optional[int] = None,
                 vdim: Optional[int] = None, dropout: float = 0.0, bias: bool = True,
                 add_bias_kv: bool = False, add_zero_attn: bool = False, self_attention: bool = False,
                 encoder_decoder_attention: bool = False, q_noise: float = 0.0, qn_block_size: int = 8,
                 xformers_att_config: Optional[str] = None,
                 value_projection: Callable[..., nn.Linear] = nn.Linear, **options):
        name = type(self).__name__
        missing = [k for k, p in inspect.signature(self.setup_mechanism).parameters.items()
                   if p.default is inspect.Parameter.empty and k not in options
                   and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
        if missing:
            raise TypeError(
                f"{name} needs its mechanism's options {missing} as keywords, after "
                f"MultiheadAttention's arguments (e.g. {name}(16, 4, self_attention=True, "
                f"{', '.join(f'{k}=...' for k in missing)}))")
        if add_bias_kv or add_zero_attn:
            raise ValueError(
                f"{name} works on the token-by-token attention map and cannot take the extra "
                "key column of --add-bias-kv / --add-zero-attn; drop those options.")
        if xformers_att_config:
            raise ValueError(
                f"{name} needs the attention logits, which xformers attention does not expose; "
                "drop --encoder/--decoder-xformers-att-config.")
        super().__init__()
        self.self_attention = self_attention
        self.encoder_decoder_attention = encoder_decoder_attention
        self.init_mechanism(embed_dim, num_heads, dropout, kdim, vdim)
        if self_attention and not (self.kdim == self.vdim == embed_dim):
            raise ValueError("self-attention needs keys and values of the queries' width")
        self.scaling = self.head_dim ** -0.5
        self.beam_size = 1  # fairseq's generator sets it (set_beam_size)
        # fairseq's projections, made in fairseq's order (the same random initial weights)
        self.k_proj = self.projection(self.kdim, bias, q_noise, qn_block_size)
        self.v_proj = self.projection(self.vdim, bias, q_noise, qn_block_size, value_projection)
        self.q_proj = self.projection(embed_dim, bias, q_noise, qn_block_size)
        self.out_proj = self.projection(embed_dim, bias, q_noise, qn_block_size)
        self.reset_projections()
        self.setup_mechanism(**options)

    def setup_mechanism(self, **options) -> None:
        """Add the mechanism's own parameters and settings (subclasses)."""
        if options:
            raise TypeError(f"unexpected options {sorted(options)}")

    def neutral_entries(self, masked: Optional[Tensor], query_padding_mask: Optional[Tensor]):
        """:func:`neutral_entries`, computed once per pass of the stack."""
        if masked is None or query_padding_mask is None:
            return neutral_entries(masked, query_padding_mask)
        return self.derived(self.neutral_name, lambda: neutral_entries(masked, query_padding_mask))

    # -- the logit source: Q K^T / sqrt(d) ---------------------------------------------------
    def attention_logits(self, query: Tensor, key: Optional[Tensor], value: Optional[Tensor],
                         key_padding_mask: Optional[Tensor], attn_mask: Optional[Tensor],
                         incremental_state, static_kv: bool):
        if key is None:
            key = value = query
        elif value is None:
            value = key
        if incremental_state is None:
            logits, v = self.full_pass_logits(query, key, value)
        else:
            logits, v, key_padding_mask = self.step_logits(query, key, value, key_padding_mask,
                                                           incremental_state, static_kv)
        return logits, v, key_padding_mask, attn_mask

    def projections(self, x: Tensor, names: Tuple[str, ...], joined=None):
        return project(x, [getattr(self, n) for n in names], self.num_heads, self.head_dim, joined)

    def beam_shared(self, key: Tensor, bsz: int) -> bool:
        """Whether the encoder's keys of this call are one per sentence, shared by the
        sentence's beams (fairseq's generator repeats them per beam)."""
        return self.encoder_decoder_attention and self.beam_size > 1 and bsz == key.size(1)

    def sentence_rows(self, x: Tensor) -> Tensor:
        """The first beam's rows of ``x`` (S, B * beams, C): one per sentence."""
        return x.view(x.size(0), -1, self.beam_size, x.size(2))[:, :, 0, :]

    def full_pass_logits(self, query: Tensor, key: Tensor, value: Tensor):
        """``(QK^T / sqrt(d) as (B, H, T, S), V as (B_kv * H, S, head_dim))`` of a full pass,
        with no mask: every entry is finite. The queries are scaled out of place (fairseq
        scales them in place, on a view of their projection, which makes autograd copy the
        whole projection back in the backward pass)."""
        tgt_len, bsz, _ = query.size()
        if self.self_attention:  # (fairseq's self-attention projects the queries alone)
            q, k, v = self.projections(query, ("q_proj", "k_proj", "v_proj"))
        else:
            (q,) = self.projections(query, ("q_proj",))
            if self.beam_shared(key, bsz):
                key = value = self.sentence_rows(key)
            k, v = self.key_value(key, value)
        q = (q * self.scaling).transpose(0, 1)
        return self.dot_products(q, k.transpose(0, 1), bsz, tgt_len), v.transpose(0, 1)

    def key_value(self, key: Tensor, value: Tensor):
        """The key and value projections (S, B, C each): one joined matmul when ``key`` is
        ``value`` (fairseq's encoder-decoder attention passes the encoder's output as both)."""
        if key is value:
            return tuple(self.projections(key, ("k_proj", "v_proj")))
        return self.projections(key, ("k_proj",))[0], self.projections(value, ("v_proj",))[0]

    def dot_products(self, q: Tensor, k: Tensor, bsz: int, tgt_len: int) -> Tensor:
        """``q k^T`` as (B, H, T, S) for ``q`` (B * H, T, d) and ``k`` (B_kv * H, S, d);
        beams that share their sentence's keys in one product per sentence."""
        heads, head_dim = self.num_heads, self.head_dim
        kv_bsz = k.size(0) // heads
        if kv_bsz != bsz:
            logits = torch.einsum("bxhtd,bhsd->bxhts", q.reshape(kv_bsz, -1, heads, tgt_len, head_dim),
                                  k.view(kv_bsz, heads, -1, head_dim))
            return logits.reshape(bsz, heads, tgt_len, -1)
        return torch.bmm(q, k.transpose(1, 2)).view(bsz, heads, tgt_len, -1)

    def step_logits(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Optional[Tensor],
                    incremental_state, static_kv: bool):
        """What :meth:`full_pass_logits` returns, for a decoding step, and the key padding
        of every key the step sees: the keys and values of the run so far are in its
        :class:`~ea_fairseq.modules.attention_cache.AttentionCache` (the encoder's, computed
        at the first step; or the earlier steps', which this step's join). The queries'
        projection with the scaling folded in -- joined with the key and value projections
        in a self-attention -- is made once per decoding run (:meth:`step_projection`)."""
        cache = self.cache(incremental_state)
        tgt_len, bsz, _ = query.size()
        heads, head_dim = self.num_heads, self.head_dim
        static = self.encoder_decoder_attention and static_kv
        own = self.self_attention  # (fairseq's self-attention projects the queries alone)
        names = ("q_proj", "k_proj", "v_proj") if own else ("q_proj",)
        projection = self.step_projection(cache, names)
        if own:
            q, k, v = (x.transpose(0, 1) for x in self.projections(query, names, joined=projection))
        else:
            q = self.projections(query, names, joined=projection)[0].transpose(0, 1)
        if projection is None:  # projections of their own kind: fairseq's scaling
            q = q * self.scaling
        if static:
            if cache.keys is None:
                if self.beam_shared(key, bsz):
                    key = value = self.sentence_rows(key)
                # kept for the whole run and read at every step: contiguous, once
                k, v = (x.transpose(0, 1).contiguous() for x in self.key_value(key, value))
                kv_bsz = key.size(1)
                cache.keys, cache.values = k.view(kv_bsz, heads, -1, head_dim), v.view(kv_bsz, heads, -1, head_dim)
                cache.static, cache.beam_size = True, self.beam_size
            kv_bsz = cache.keys.size(0)
            k = cache.keys.view(kv_bsz * heads, -1, head_dim)
            v = cache.values.view(kv_bsz * heads, -1, head_dim)
        else:
            if not own:
                k, v = (x.transpose(0, 1) for x in self.key_value(key, value))
            k, v, key_padding_mask = cache.extend(k.view(bsz, heads, -1, head_dim), v.view(bsz, heads, -1, head_dim),
                                                  key_padding_mask)
            k, v = k.view(bsz * heads, -1, head_dim), v.view(bsz * heads, -1, head_dim)
        return self.dot_products(q, k, bsz, tgt_len), v, key_padding_mask

    def step_projection(self, cache, names: Tuple[str, ...]):
        """The scaled joined projection of ``names``: once per decoding run (every step
        where autograd records); None for projections that do not join."""
        modules = [getattr(self, n) for n in names]
        if torch.is_grad_enabled():
            return joined_projection(modules, self.num_heads, self.head_dim, self.scaling)
        memo = cache.memo.get("step_projection")
        if memo is None:
            memo = cache.memo["step_projection"] = (
                joined_projection(modules, self.num_heads, self.head_dim, self.scaling),)
        return memo[0]
