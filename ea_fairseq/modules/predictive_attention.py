"""Predictive Attention (PA-Transformer), PA paper §3.3, Eq. (4).

For every encoder block but the first::

    A = softmax(α · CNN(A_pre_logits) + (1 − α) · Attention(X)_logits)

``A_pre_logits`` are the previous block's logits before its softmax (what this module
hands on to the next block, :mod:`~ea_fairseq.modules.attention_map_carrier`); ``CNN`` is
``--pa-conv-layers`` 3x3 heads-to-heads
convolutions (:class:`~ea_ops.map_conv.AttentionMapConv`, the same
convolution EA uses) each followed by a ReLU. With zero layers the prediction is the
previous logits themselves: the paper's "Transformer with RC" (Table 5). The first block
only hands its logits on. PA is defined for encoder self-attention (the paper's MT setup).

Masked entries and padded query rows are zero before every convolution, so padding looks
like the convolutions' zero border at every depth of the CNN.
"""
from typing import Optional

import torch.nn as nn
import torch.nn.functional as F

from ea_ops.map_conv import AttentionMapConv
from ea_ops.masks import fill_masked

from .attention_maps import LogitMapAttention


class PredictiveAttention(LogitMapAttention):
    """Encoder self-attention whose logits are predicted from the previous block's (Eq. 4)."""

    def setup_mechanism(self, alpha: float, conv_layers: int, predict: bool) -> None:
        self.alpha = float(alpha)
        # no prediction module in the first block (PA §3.3): no parameters there either
        self.predictor: Optional[nn.ModuleList] = (
            nn.ModuleList(AttentionMapConv(self.num_heads, 3, "full") for _ in range(conv_layers))
            if predict else None
        )

    def carried_names(self):
        return (("self",) if self.predictor is not None else ()), ("self",)

    def transform_logits(self, logits, masked, query_padding_mask, incremental_state):
        current = fill_masked(logits, masked, 0.0)
        previous = self.previous_map("self")  # None: the first block, or built alone
        prediction = None
        if self.predictor is not None and previous is not None:
            neutral = self.neutral_entries(masked, query_padding_mask)
            prediction = fill_masked(previous, neutral, 0.0)
            for conv in self.predictor:  # CNN: conv + ReLU per layer
                prediction = fill_masked(F.relu(conv(prediction)), neutral, 0.0)
            current = self.alpha * prediction + (1.0 - self.alpha) * current  # Eq. (4)
        # ``current`` is finite, zero where masked (both of its terms are), as the next
        # block's A_pre_logits must be
        self.hand_on("self", current)
        self.report_maps(lambda: {
            "dot_product": logits,
            "prediction": prediction if prediction is not None else current.new_zeros(()),
            "logits": current,
        }, masked)
        return fill_masked(current, masked, float("-inf"))
