"""The query, key and value projections of a logit-map attention, in as few matmuls as the
projections allow.

Projections that read the same input are one matmul (:func:`joined_projection`: their
weights stacked, head by head, so that each projection's output is a view of the joined
one's); a decoding run folds the query scaling into the query projection's weights once.
A projection other than a plain ``nn.Linear`` without hooks (fairseq's quantization noise,
value residual learning's projection) is computed by its own module, and the queries are
scaled after it, exactly as fairseq's attention computes them.
"""
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

Joined = Tuple[Tensor, Optional[Tensor]]


def joined_projection(modules: Sequence[nn.Module], heads: int, head_dim: int,
                      scaling: Optional[float] = None) -> Optional[Joined]:
    """``(weight, bias)`` of ``modules`` in one, their rows interleaved per head (head h's
    rows of each projection together); with ``scaling`` the first (the query projection)
    times it. None for a module other than a plain ``nn.Linear`` without hooks, or a mix of
    biased and unbiased projections."""
    if any(type(m) is not nn.Linear or m._forward_hooks or m._forward_pre_hooks for m in modules):
        return None
    biases = [m.bias for m in modules]
    if any(b is None for b in biases) and any(b is not None for b in biases):
        return None
    factor = [scaling if i == 0 else None for i in range(len(modules))]

    def joined(tensors):
        parts = [t if f is None else t * f for t, f in zip(tensors, factor)]
        if len(parts) == 1:
            return parts[0]
        shape = (heads, head_dim) + parts[0].shape[1:]
        return torch.stack([t.view(shape) for t in parts], 1).flatten(0, 2)

    return joined([m.weight for m in modules]), None if biases[0] is None else joined(biases)


def project(x: Tensor, modules: Sequence[nn.Module], heads: int, head_dim: int,
            joined: Optional[Joined] = None) -> List[Tensor]:
    """The projections ``modules`` of ``x`` (T, B, C), each as (T, B * H, head_dim): in one
    matmul where they join (or with ``joined``), else each by its module."""
    length, bsz = x.size(0), x.size(1)
    if joined is None and len(modules) > 1:
        joined = joined_projection(modules, heads, head_dim)
    if joined is not None:
        return list(F.linear(x, *joined).view(length, bsz * heads, len(modules), head_dim).unbind(2))
    return [m(x).view(length, bsz * heads, head_dim) for m in modules]
