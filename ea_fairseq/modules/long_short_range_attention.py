"""Long-Short Range Attention (LSRA), the multi-branch block of Wu et al. 2020, *Lite
Transformer with Long-Short Range Attention*, §3 (Fig. 3), which the PA paper's
Conv-Transformer and PA-Conv-Transformer use (PA paper §4.1, appendix B.1, Fig. 4).

The block's input ``X`` (width d) is split along its channels: the first half goes to an
attention of width d/2 (the global, *long-range* branch: whatever attention the role uses --
fairseq's, PA, EA, RealFormer, ... -- built at half width with the role's number of heads),
the second half to a convolution branch of width d/2 (the *local* branch); their outputs are
concatenated::

    LSRA(X) = [ Attention(X[:, :d/2]) ; W_out · LightConv(W_in · X[:, d/2:]) ]

``LightConv`` is fairseq's lightweight convolution
(:class:`fairseq.modules.LightweightConv1dTBC`: depthwise over time, one softmax-normalised
kernel per head shared by the head's channels, weight dropout), centred in the encoder and
causal (``padding_l = k − 1``) in the decoder, with the linear layers in front and behind that
Lite Transformer adds to it (``--conv-linear``). Kernel sizes per layer default to Lite
Transformer's ``3 7 15 31 31 31``.

Padded positions enter the convolution as zeros (after ``W_in``), so that padding is exactly
the convolution's zero border and a sentence gives the same output alone or in a padded batch.
Incremental decoding: fairseq's convolution keeps its last ``k − 1`` inputs in the
incremental state and reorders them with the beams; the attention keeps its own cache.
"""
from typing import Optional

import torch
import torch.nn as nn
from fairseq.modules import LightweightConv1dTBC
from torch import Tensor

#: the roles LSRA is defined for (Lite Transformer: encoder and decoder self-attention)
ROLES = ("encoder", "decoder")
#: Lite Transformer's kernel sizes per layer (its --encoder/--decoder-kernel-size-list)
LITE_KERNEL_SIZES = (3, 7, 15, 31, 31, 31)


class LightweightConvBranch(LightweightConv1dTBC):
    """fairseq's lightweight convolution with Lite Transformer's input and output linear
    layers (its ``with_linear``); padded positions are zeroed after the input layer."""

    def __init__(self, dim: int, kernel_size: int, num_heads: int, causal: bool,
                 weight_dropout: float):
        super().__init__(dim, kernel_size, padding_l=kernel_size - 1 if causal else kernel_size // 2,
                         num_heads=num_heads, weight_dropout=weight_dropout, weight_softmax=True)
        self.linear_in = nn.Linear(dim, dim)
        self.linear_out = nn.Linear(dim, dim)
        for linear in (self.linear_in, self.linear_out):
            nn.init.xavier_uniform_(linear.weight)
            nn.init.zeros_(linear.bias)

    def forward(self, x: Tensor, incremental_state=None, padding_mask: Optional[Tensor] = None,
                unfold: bool = False) -> Tensor:
        """``x`` (T, B, dim); ``padding_mask`` (B, T), True where padded, or None."""
        x = self.linear_in(x)
        if padding_mask is not None:
            x = x.masked_fill(padding_mask.transpose(0, 1).unsqueeze(-1).to(torch.bool), 0.0)
        return self.linear_out(super().forward(x, incremental_state, unfold))


class LongShortRangeAttention(nn.Module):
    """An attention of half the width beside a lightweight-convolution branch (see module
    docstring); an :class:`~ea_fairseq.modules.attention_protocol.AttentionModule` in
    self-attention. Its attention and convolution keep (and reorder) their own decoding
    state; the cache it shows fairseq's decoder layer is its attention's."""

    def __init__(self, attention: nn.Module, conv: LightweightConvBranch):
        super().__init__()
        self.attention = attention
        self.conv = conv
        self.split = attention.embed_dim
        self.embed_dim = attention.embed_dim + conv.input_size
        # what fairseq's decoder layer reads of its self-attention
        self.num_heads = attention.num_heads
        self.head_dim = attention.head_dim

    def forward(self, query: Tensor, key: Optional[Tensor], value: Optional[Tensor],
                key_padding_mask: Optional[Tensor] = None, incremental_state=None,
                need_weights: bool = True, static_kv: bool = False,
                attn_mask: Optional[Tensor] = None, before_softmax: bool = False,
                need_head_weights: bool = False):
        if before_softmax:
            raise ValueError("LSRA concatenates an attention and a convolution; it has no single "
                             "pre-softmax map to return")
        split = self.split
        half = query[..., :split]
        out, weights = self.attention(
            half, None if key is None else key[..., :split], None if value is None else value[..., :split],
            key_padding_mask=key_padding_mask, incremental_state=incremental_state,
            need_weights=need_weights, static_kv=static_kv, attn_mask=attn_mask,
            need_head_weights=need_head_weights,
        )
        query_padding = None
        if key_padding_mask is not None:  # the queries' own columns: the last T keys
            query_padding = key_padding_mask[:, -query.size(0):]
        local = self.conv(query[..., split:], incremental_state, query_padding)
        return torch.cat([out, local], dim=-1), weights

    # AttentionModule: fairseq's decoder layer reads (and may set) its self-attention's cache
    def _get_input_buffer(self, incremental_state):
        return self.attention._get_input_buffer(incremental_state)

    def _set_input_buffer(self, incremental_state, buffer):
        return self.attention._set_input_buffer(incremental_state, buffer)
