"""Self-attention whose weights depend on positions only, not on the tokens.

RAN's recurrent attention, hard-coded Gaussian attention (HC-SA) and the Random
Synthesizer (Syn-R) all attend with ``softmax(A)`` over the values, where the logit
``A[h, i, j]`` is a function of head ``h`` and of the positions of query ``i`` and key
``j`` within their sentence: no query or key projection, no token-to-token product.
:class:`PositionAttention` is what they share: fairseq's value and output projections
(names in the state dict, initialisation, dropout module), the value cache of a
decoding run, and the logit source of the plugin's one attention path
(:class:`~ea_fairseq.modules.attention_mechanism.AttentionMechanism`, which masks,
softmaxes and multiplies with the values as for every mechanism): a mechanism defines
only its logits (:meth:`PositionAttention.position_logits`).

Positions are counted per sentence the way fairseq's positional embeddings count them
(padding skipped, :func:`sentence_positions`), so a left-padded source attends exactly as
the same sentence alone. A decoding run's positions are its steps (fairseq's decoder
inputs are never left-padded).
"""
import contextlib
from typing import Callable, Optional, Tuple

import torch
import torch.nn as nn
from fairseq.incremental_decoding_utils import with_incremental_state
from torch import Tensor

from .attention_mechanism import AttentionMechanism


def sentence_positions(padding_mask: Optional[Tensor], length: int, device) -> Tensor:
    """0-based position of each token within its own sentence, (batch or 1, length).

    Padding is skipped as in fairseq's ``make_positions``; padded slots get position 0
    (they are masked as keys, and their query rows are never used).
    """
    if padding_mask is None:
        return torch.arange(length, device=device).unsqueeze(0)
    real = (~padding_mask.to(torch.bool)).long()
    return (real.cumsum(dim=1) - 1).clamp(min=0)


def full_precision(device: torch.device):
    """A region where autocast is off: the ops inside compute in their inputs' dtype."""
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def sentence_one_hot(padding_mask: Tensor, positions: Tensor, dtype: torch.dtype) -> Tensor:
    """``P`` (B, T, T) in ``dtype``: ``P[b, i, k] = 1`` where slot ``i`` of sentence ``b`` is a
    real token at position ``k`` (:func:`sentence_positions` gives ``positions``); zero rows
    for padding."""
    length = positions.size(-1)
    real = ~padding_mask.to(torch.bool)[:, :, None]
    return ((positions[:, :, None] == torch.arange(length, device=positions.device)) & real).to(dtype)


def sentence_logits(square: Tensor, padding_mask: Tensor, positions: Optional[Tensor] = None,
                    one_hot: Optional[Tensor] = None) -> Tensor:
    """``A[pos_i, pos_j]`` at ``(i, j)`` of each sentence (B, H, T, T) from ``square`` = the
    first T rows and columns of ``A`` (H, T, T), with positions counted per sentence
    (:func:`sentence_positions`); zero at padded slots' rows and columns.

    With ``P`` (B, T, T) mapping each real slot to its position (:func:`sentence_one_hot`)
    this is ``P A P^T``: exact (``P`` is 0/1, ``A`` finite, float32 matmuls without TF32,
    PyTorch's default), computed without autocast, as one matrix product with every head's
    ``A`` side by side and one batched product per sentence (nothing broadcast and copied
    per sentence); its backward is one product of each kind -- the sum over the batch in
    ``A``'s dtype, no scatter. ``positions``, ``one_hot``: :func:`sentence_positions` of
    ``padding_mask`` and ``P`` in ``square``'s dtype, where already made (once per pass of
    a stack).
    """
    heads, length = square.size(0), square.size(-1)
    bsz = padding_mask.size(0)
    if one_hot is None:
        if positions is None:
            positions = sentence_positions(padding_mask, length, square.device)
        one_hot = sentence_one_hot(padding_mask, positions, square.dtype)
    with full_precision(square.device):
        # (P A_h)[b, i, k] for every head, as (B, T, H, T): A's heads side by side
        left = torch.mm(one_hot.view(bsz * length, length), square.transpose(0, 1).reshape(length, heads * length))
        # ... times P_b^T per sentence, (B, T * H, T) -> (B, H, T, T)
        both = torch.bmm(left.view(bsz, length * heads, length), one_hot.transpose(1, 2))
    return both.view(bsz, length, heads, length).transpose(1, 2)


def matrix_logits(matrix: Tensor, tgt_len: int, src_len: int, padding_mask: Optional[Tensor],
                  start: int = 0, positions: Optional[Tensor] = None, one_hot: Optional[Tensor] = None) -> Tensor:
    """``matrix[h, pos_i, pos_j]`` (B or 1, H, T, S) for a logit matrix ``matrix`` (H, R, L)
    indexed by positions: a full pass's tokens (T = S, positions per sentence,
    :func:`sentence_logits` where padded), or a decoding run's queries ``start .. start +
    T - 1`` over keys ``0 .. S - 1`` (a slice)."""
    if padding_mask is None:
        # every token's position is its index: a plain slice (whose backward, after the
        # broadcast over the batch, is a sum over the batch)
        return matrix[:, start : start + tgt_len, :src_len].unsqueeze(0)
    return sentence_logits(matrix[:, :tgt_len, :tgt_len], padding_mask, positions, one_hot)


def additive_mask(masked: Tensor, like: Tensor) -> Tensor:
    """0 where ``masked`` is False, ``-inf`` where True, in ``like``'s dtype and device."""
    return torch.zeros((), dtype=like.dtype, device=like.device).masked_fill(masked, float("-inf"))


@with_incremental_state
class PositionAttention(AttentionMechanism, nn.Module):
    """Self-attention ``softmax(A) V`` with logits ``A`` that depend on positions only.

    Only the value and output projections of fairseq's ``MultiheadAttention`` (same
    names, same initialisation, same attention dropout); the softmax, dropout (or
    DropAttention) and value product are the plugin's shared ones
    (:class:`~ea_fairseq.modules.attention_mechanism.AttentionMechanism`). A subclass defines
    :meth:`position_logits`; a decoder's (``causal``) cannot see later positions.
    """

    self_attention = True
    encoder_decoder_attention = False
    #: name of the maps handed to map hooks (analysis)
    map_name = "position"

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 causal: bool = False, q_noise: float = 0.0, qn_block_size: int = 8,
                 value_projection: Callable[..., nn.Linear] = nn.Linear):
        super().__init__()
        self.init_mechanism(embed_dim, num_heads, dropout)
        self.v_proj = self.projection(embed_dim, bias, q_noise, qn_block_size, value_projection)
        self.out_proj = self.projection(embed_dim, bias, q_noise, qn_block_size)
        self.causal = causal
        self.reset_projections()

    def cached_values(self, query: Tensor, incremental_state,
                      key_padding_mask: Optional[Tensor] = None) -> Tuple[Tensor, int, Optional[Tensor]]:
        """In a decoding run, ``(v, start, key_padding_mask)``: the values (B, H, S, head_dim)
        of this call's tokens, after those of the run's earlier steps (kept in its
        :class:`~ea_fairseq.modules.attention_cache.AttentionCache`, one row per hypothesis);
        ``start``, the position of this call's first token; the padding mask of all ``S``
        keys (None if nothing is padded)."""
        tgt_len, bsz, _ = query.size()
        v = self.v_proj(query).view(tgt_len, bsz, self.num_heads, self.head_dim).permute(1, 2, 0, 3)
        _, v, key_padding_mask = self.cache(incremental_state).extend(None, v, key_padding_mask)
        return v, v.size(2) - tgt_len, key_padding_mask

    def run_positions(self, length: int, incremental_state, device) -> Tensor:
        """``0 .. length - 1`` (1, length) in a decoding run: a view of positions made once per
        run (16 at its first step, doubled whenever a step goes past them), not per step."""
        memo = self.cache(incremental_state).memo
        kept = memo.get("positions")
        if kept is None or kept.size(-1) < length:
            kept = memo["positions"] = torch.arange(max(16, 2 * length), device=device).unsqueeze(0)
        return kept[:, :length]

    def pass_one_hot(self, padding_mask: Tensor, positions: Tensor, dtype: torch.dtype) -> Tensor:
        """:func:`sentence_one_hot`, made once per pass of the stack (every layer alike)."""
        return self.derived(f"self:one_hot:{dtype}", lambda: sentence_one_hot(padding_mask, positions, dtype))

    def position_logits(self, query_positions: Tensor, key_positions: Tensor,
                        padding_mask: Optional[Tensor], start: int, dtype: torch.dtype) -> Tensor:
        """The logits ``A[h, pos_i, pos_j]``, (B or 1, H, T, S) in ``dtype``, for queries at
        ``query_positions`` (B or 1, T) and keys at ``key_positions`` (B or 1, S).
        ``padding_mask`` is the full pass's key padding (None in a decoding run, whose
        queries are positions ``start .. start + T - 1`` and keys ``0 .. S - 1``)."""
        raise NotImplementedError

    def decoding_step_weights(self, start: int, tgt_len: int, src_len: int, incremental_state,
                              dtype: torch.dtype) -> Optional[Tensor]:
        """The softmax weights (H, T, S) of a causal decoding step, shared by the whole batch,
        where a mechanism can give them without a softmax of its logits (RAN: rows of a causal
        softmax kept for the run); None: the step softmaxes its logits as a full pass does."""
        return None

    def attend_logits(self, logits, masked, query_padding_mask, v, incremental_state, bsz, tgt_len,
                      need_weights, need_head_weights, empty=None):
        """A causal decoding step whose weights are the same for every hypothesis (nothing
        padded, no dropout, nobody asking for weights or maps) multiplies the values with
        :meth:`decoding_step_weights`; every other call softmaxes its logits."""
        if (incremental_state is not None and self.causal and not torch.is_grad_enabled()
                and not (need_weights or need_head_weights or self._map_hooks or self.drops_weights())
                and self.cache(incremental_state).key_padding is None):
            src_len = v.size(1)
            weights = self.decoding_step_weights(src_len - tgt_len, tgt_len, src_len, incremental_state, v.dtype)
            if weights is not None:  # one set of weights for the batch
                out = torch.matmul(weights, v.view(bsz, self.num_heads, src_len, self.head_dim))
                return self.out_proj(out.permute(2, 0, 1, 3).reshape(tgt_len, bsz, self.embed_dim)), None
        return super().attend_logits(logits, masked, query_padding_mask, v, incremental_state, bsz, tgt_len,
                                     need_weights, need_head_weights, empty)

    def attention_logits(self, query, key, value, key_padding_mask, attn_mask, incremental_state, static_kv):
        """The logit source: :meth:`position_logits` at the positions of this call's queries
        and keys (per sentence, padding skipped; a decoding run's steps), in at least float32,
        and the values; a decoding step of several queries gets its own future mask."""
        tgt_len, bsz, _ = query.size()
        if incremental_state is None:  # (B * H, T, head_dim), as the value product reads them
            v = self.v_proj(query).view(tgt_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)
            dtype = torch.float64 if v.dtype == torch.float64 else torch.float32
            # the same for every layer of the pass: counted once
            positions = self.derived("self:positions",
                                     lambda: sentence_positions(key_padding_mask, tgt_len, query.device))
            logits = self.position_logits(positions, positions, key_padding_mask, 0, dtype)
        else:
            v, start, key_padding_mask = self.cached_values(query, incremental_state, key_padding_mask)
            src_len = v.size(2)
            v = v.reshape(bsz * self.num_heads, src_len, self.head_dim)
            dtype = torch.float64 if v.dtype == torch.float64 else torch.float32
            k_pos = self.run_positions(src_len, incremental_state, query.device)
            q_pos = k_pos[:, start : start + tgt_len]
            logits = self.position_logits(q_pos, k_pos, None, start, dtype)
            if self.causal and tgt_len > 1:
                attn_mask = k_pos[0][None, :] > q_pos[0][:, None]
        if logits.size(0) != bsz:  # (the same logits for every sentence)
            logits = logits.expand(bsz, -1, -1, -1)
        return logits, v, key_padding_mask, attn_mask

    def transform_logits(self, logits, masked, query_padding_mask, incremental_state):
        """The masking, out of place (the source's logits may be a view of a parameter): an
        additive mask, 0 or ``-inf``, made from ``masked`` once per pass of the stack (a sum's
        backward costs nothing where a masked fill's is another fill, per layer)."""
        self.report_maps(lambda: {self.map_name: logits}, masked)
        if masked is None:
            return logits
        return logits + self.derived(f"self:additive_mask:{logits.dtype}", lambda: additive_mask(masked, logits))
