"""The masks of an attention map: which entries are masked (padding keys, future
positions), which a map transform treats as neutral zeros, and the fills that write them."""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor


def boolean_mask(key_padding_mask: Optional[Tensor], attn_mask: Optional[Tensor]) -> Tensor:
    """The entries fairseq's masks mask, as a bool mask broadcastable to (B, H, T, S): padded
    keys (``key_padding_mask`` B x S) and future positions (``attn_mask`` T x S, fairseq's
    additive ``-inf`` mask, or bool). Derived from the masks alone, never from the logits."""
    masked = None
    if key_padding_mask is not None:
        if key_padding_mask.dtype != torch.bool:
            key_padding_mask = key_padding_mask.to(torch.bool)
        masked = key_padding_mask[:, None, None, :]
    if attn_mask is not None:
        future = attn_mask if attn_mask.dtype == torch.bool else torch.isneginf(attn_mask)
        masked = future[None, None] if masked is None else masked | future[None, None]
    return masked


def neutral_entries(masked: Optional[Tensor], query_padding_mask: Optional[Tensor]) -> Optional[Tensor]:
    """Entries a map transform must treat as neutral zeros: ``masked`` plus padded query rows."""
    if query_padding_mask is None:
        return masked
    padded_rows = query_padding_mask[:, None, :, None]
    return padded_rows if masked is None else masked | padded_rows


def fill_masked(values: Tensor, mask: Optional[Tensor], fill: float) -> Tensor:
    """``values.masked_fill(mask, fill)``; ``values`` itself when ``mask`` is None."""
    return values if mask is None else values.masked_fill(mask, fill)


def fill_masked_(values: Tensor, mask: Optional[Tensor], fill: float) -> Tensor:
    """In-place :func:`fill_masked`."""
    if mask is None:
        return values
    if values.requires_grad and values._base is not None:
        return values.masked_fill(mask, fill)
    return values.masked_fill_(mask, fill)


def pad_rows_to(rows: Tensor, width: int) -> Tensor:
    """Right-pad cached map rows (B, H, R, S') with zeros to ``width`` key columns."""
    missing = width - rows.size(-1)
    return F.pad(rows, (0, missing)) if missing > 0 else rows
