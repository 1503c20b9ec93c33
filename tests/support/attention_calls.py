"""Record what every attention module of a model was called with and returned, so that a
test can recompute a layer's output from the paper's equation and compare."""
from contextlib import contextmanager

import torch


@contextmanager
def recorded_attention_calls(model):
    """Yields ``calls``: ``{"encoder.self": [per layer: (query, key, key_padding_mask,
    output)], "decoder.self": ..., "decoder.cross": ...}`` of the forward passes run inside."""
    calls = {}
    handles = []
    for stack_name in ("encoder", "decoder"):
        for layer in getattr(model, stack_name).layers:
            for slot, attr in (("self", "self_attn"), ("cross", "encoder_attn")):
                module = getattr(layer, attr, None)
                if module is None:
                    continue
                record = calls.setdefault(f"{stack_name}.{slot}", [])

                def hook(mod, args, kwargs, output, record=record):
                    query = kwargs.get("query", args[0] if args else None)
                    key = kwargs.get("key", args[1] if len(args) > 1 else None)
                    record.append((query.detach(), None if key is None else key.detach(),
                                   kwargs.get("key_padding_mask"), output[0].detach()))

                handles.append(module.register_forward_hook(hook, with_kwargs=True))
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


def real_slots(padding_mask, b: int, length: int):
    """Indices of sentence ``b``'s real tokens (all ``length`` if nothing is padded)."""
    if padding_mask is None:
        return torch.arange(length)
    return (~padding_mask[b].to(torch.bool)).nonzero().flatten()


def project_out(module, heads_context):
    """``W_O [head_1; ...; head_H] + b_O`` for per-head contexts (H, T, head_dim)."""
    h, t, d = heads_context.shape
    return torch.nn.functional.linear(heads_context.permute(1, 0, 2).reshape(t, h * d),
                                      module.out_proj.weight, module.out_proj.bias)


def values_of(module, x):
    """The value projection of ``x`` (T, C) per head: (H, T, head_dim)."""
    v = torch.nn.functional.linear(x, module.v_proj.weight, module.v_proj.bias)
    return v.view(x.size(0), module.num_heads, -1).transpose(0, 1)
