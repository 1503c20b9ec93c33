"""What follows the attention weights: the value product (the output projection's input) and
the weights in the layout fairseq's attention returns them."""
from typing import Optional

import torch
from torch import Tensor


def value_product(probs: Tensor, v: Tensor, bsz: int, tgt_len: int) -> Tensor:
    """The weighted sum of values, (T, B, H * head_dim): the output projection's input.
    ``probs`` is (B, H, T, S), ``v`` (B_kv * H, S, head_dim)."""
    heads, src_len = probs.size(1), probs.size(-1)
    kv_bsz, head_dim = v.size(0) // heads, v.size(-1)
    if kv_bsz != bsz:
        # beam search shares the encoder's keys/values across a sentence's beams: the
        # beams' rows go into one matmul per sentence and head (a broadcasting matmul
        # would copy v once per beam)
        beams = bsz // kv_bsz
        rows = probs.view(kv_bsz, beams, heads, tgt_len, src_len).transpose(1, 2)
        out = torch.bmm(rows.reshape(kv_bsz * heads, beams * tgt_len, src_len), v)
        out = out.view(kv_bsz, heads, beams, tgt_len, head_dim).permute(3, 0, 2, 1, 4)
    else:
        out = torch.bmm(probs.view(bsz * heads, tgt_len, src_len), v)
        out = out.view(bsz, heads, tgt_len, head_dim).permute(2, 0, 1, 3)  # (T, B, H, head_dim)
    return out.reshape(tgt_len, bsz, heads * head_dim)


def fairseq_weights(probs: Tensor, need_weights: bool, need_head_weights: bool) -> Optional[Tensor]:
    """The weights fairseq's attention returns: per head (heads x batch x tgt x src) or
    averaged over heads, or None when not asked for."""
    if not (need_weights or need_head_weights):
        return None
    weights = probs.transpose(1, 0)
    return weights if need_head_weights else weights.mean(dim=0)
