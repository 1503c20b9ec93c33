"""Independent re-implementations of attention equations, for the tests: written from the
papers with plain tensor operations and a module's parameters only (never its forward), and
a way to capture what fairseq's layers hand to a model's attention modules."""
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


class Calls:
    """Records the inputs and outputs of every call of the given modules (forward hooks)."""

    def __init__(self, modules):
        self.calls = {id(m): [] for m in modules}
        self.handles = [m.register_forward_hook(self._hook(m), with_kwargs=True) for m in modules]

    def _hook(self, module):
        def hook(mod, args, kwargs, output):
            names = ("query", "key", "value", "key_padding_mask", "incremental_state")
            call = dict(zip(names, args))
            call.update(kwargs)
            call["output"] = output[0] if isinstance(output, tuple) else output
            self.calls[id(module)].append(call)
        return hook

    def of(self, module):
        return self.calls[id(module)]

    def remove(self):
        for h in self.handles:
            h.remove()
