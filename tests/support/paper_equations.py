"""Batched pieces of multi-head attention written with plain tensor operations from a
module's parameters only (never its forward), for the tests that recompute a layer from its
paper's equation (with :func:`attention_calls.recorded_attention_calls`)."""
import torch


def heads(x, linear, num_heads):
    """(T, B, E) -> linear(x) as (B, H, T, head_dim)."""
    y = x @ linear.weight.T + linear.bias
    t, b, e = y.shape
    return y.view(t, b, num_heads, e // num_heads).permute(1, 2, 0, 3)


def dot_product_logits(attn, query, key):
    """QK^T / sqrt(d) of fairseq's attention ``attn`` (B, H, T, S)."""
    q = heads(query, attn.q_proj, attn.num_heads) * attn.head_dim ** -0.5
    k = heads(key, attn.k_proj, attn.num_heads)
    return q @ k.transpose(-1, -2)


def masked_softmax(logits, key_padding_mask=None, causal=False):
    """softmax over keys with padded keys (B, S) and, if ``causal``, future keys excluded."""
    logits = logits.clone()
    if key_padding_mask is not None:
        logits = logits.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
    if causal:
        t, s = logits.shape[-2:]
        future = torch.ones(t, s, dtype=torch.bool).triu(1 + s - t)
        logits = logits.masked_fill(future, float("-inf"))
    return logits.softmax(-1)


def attend(attn, weights, values):
    """out_proj(A V): ``weights`` (B, H, T, S), ``values`` (B, H, S, head_dim) -> (T, B, E)."""
    out = (weights @ values).permute(2, 0, 1, 3)
    t, b = out.shape[:2]
    out = out.reshape(t, b, -1)
    return out @ attn.out_proj.weight.T + attn.out_proj.bias
