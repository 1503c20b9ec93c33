"""The attention softmax of every mechanism of this plugin, fully masked rows included.

A query row whose every key is masked has no distribution to attend with: ``softmax`` of
a row of ``-inf`` is ``0/0``, NaN, and NaN spreads -- to the real positions through
``0 x NaN`` in every later product, and to the gradients. Such rows arise in a decoder's
self-attention with left-padded targets (fairseq's ``--left-pad-target``: a padded
leading position sees only padded keys), in a decoding step fed a left-padded prefix, and
for a sentence that is all padding. PyTorch's fused attention gives these rows zero
weights (its output there is the output projection's bias); so does :func:`masked_softmax`,
forward and backward, in every dtype:

* ``empty`` (:func:`fully_masked_rows`, derived once per pass of a stack from the masks,
  never from the logits' values: no wait for the device) marks the rows;
* their logits are set to 0 before the softmax, so the softmax and its backward see a
  finite row (a masked fill's backward gives those rows a zero gradient: nothing flows
  back from them);
* their weights are set to 0 after it.

Rows with at least one visible key are untouched: the same softmax as ``torch.softmax``,
in at least float32 (fp16/bf16 logits upcast, as fairseq does; float64 stays float64).
"""
from typing import Optional, Tuple

import torch
from torch import Tensor


def fully_masked_rows(masked: Optional[Tensor]) -> Optional[Tensor]:
    """Rows of a bool mask (..., T, S) whose every key is masked, as (..., T, 1); None for
    no mask."""
    return None if masked is None else masked.all(-1, keepdim=True)


def masked_softmax(logits: Tensor, empty: Optional[Tensor] = None) -> Tensor:
    """``softmax(logits)`` over the last axis, in at least float32, with zero weights in the
    rows ``empty`` marks (broadcastable to ``logits``; None: no such row can occur). Masked
    entries of ``logits`` hold ``-inf`` (see the module docstring)."""
    if empty is not None:
        logits = logits.masked_fill(empty, 0.0)
    if logits.dtype in (torch.float32, torch.float64):
        probs = logits.softmax(-1)
    else:
        probs = logits.softmax(-1, dtype=torch.float32)
    return probs if empty is None else probs.masked_fill(empty, 0.0)


def attention_weights(logits: Tensor, dtype: torch.dtype,
                      empty: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """``(masked_softmax(logits, empty), the same in dtype)``: the weights meet the values
    in the values' ``dtype``."""
    probs_float = masked_softmax(logits, empty)
    return probs_float, probs_float if probs_float.dtype == dtype else probs_float.to(dtype)
