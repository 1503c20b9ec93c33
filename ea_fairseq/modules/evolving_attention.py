"""Evolving Attention (EA-Transformer), EA paper Eq. (4), §3.3 and §3.5.

For layer i of a stack, :func:`evolving_attention` computes::

    A_input^i = α · A_logit^(i-1) + (1 − α) · Attention(X)_logit^i     (α: skip connection)
    A_logit^i = β · ReLU(Conv(A_input^i)) + (1 − β) · A_input^i        (β: convolution)
    A^i       = softmax(A_logit^i)

``Attention(X)_logit = QK^T / sqrt(d)`` is fairseq's own logit map (with its masks);
``A_logit^i`` is handed to the next layer through the stack's
:class:`~ea_fairseq.modules.attention_maps.AttentionMapCarrier`. The first layer has no
previous map and uses ``A_input = Attention(X)_logit``. ``Conv`` is an
:class:`~ea_fairseq.modules.attention_map_conv.AttentionMapConv` in the layout of the
attention kind (Fig. 3): ``full`` for encoder self-attention, ``causal`` (masked kernel +
shift) for decoder self-attention, ``rows`` (shift along the target axis) for
encoder-decoder attention. Without a convolution, ``A_logit = A_input``.

Masked entries (padding keys, future positions, padded query rows) enter the skip
connection and the convolution as neutral zeros -- never ``-inf`` or a dtype's minimum;
the map handed on to the next layer is finite (its masked entries hold whatever the
convolution put there, which the next layer's zero fill replaces), and ``-inf`` is written
only into the softmax's input. In incremental decoding the module caches the last
``k - 1`` rows of ``A_input`` (exactly what the convolution reads of earlier steps) and
reorders them with the beams.

:func:`evolving_attention` is the one reference implementation, plain PyTorch for every
device and dtype (autocast included). Where an accelerator is registered for the map's
device and dtype (:mod:`ea_fairseq.accelerators`; on CPU in float32/float64, fused C++
passes) it computes the same values and gradients instead.
"""
from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import accelerators
from .attention_map_conv import AttentionMapConv
from .attention_maps import LogitMapAttention, fill_masked, fill_masked_, neutral_entries, pad_rows_to


def evolving_attention(logits: Tensor, previous: Optional[Tensor], neutral: Optional[Tensor],
                       alpha: float, beta: float,
                       convolve: Optional[Callable[[Tensor], Tensor]]) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """EA Eq. (4): ``(A_logit, A_input, ReLU(Conv(A_input)))`` (the last None without a
    convolution).

    ``logits`` is this layer's ``Attention(X)_logit`` (B, H, T, S), which autograd does not
    keep (it is changed in place); ``previous`` the previous layer's finite ``A_logit``, or
    None; ``neutral`` the entries that enter both lines as zeros (broadcastable bool), or
    None. ``A_logit`` is finite: the caller writes ``-inf`` where the softmax must not look.
    """
    a_input = fill_masked_(logits, neutral, 0.0)
    if previous is not None:  # line 1, the α skip connection (previous's masked entries re-zeroed)
        a_input = fill_masked_(torch.lerp(a_input, previous, alpha), neutral, 0.0)
    if convolve is None:
        return a_input, a_input, None
    conv = F.relu(convolve(a_input))
    return torch.lerp(a_input, conv, beta), a_input, conv  # line 2, β·ReLU(Conv) + (1-β)·A_input


class EvolvingAttention(LogitMapAttention):
    """Multi-head attention with EA's residual convolution over attention maps, Eq. (4)."""

    def setup_mechanism(
        self,
        slot: str,
        alpha: float,
        beta: float,
        kernel_size: int,
        conv_layout: Optional[str],
        hand_on: bool,
    ) -> None:
        for name, value in (("alpha", alpha), ("beta", beta)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"EA's {name} must lie in [0, 1] (paper Eq. 4), got {value}")
        self.slot = slot
        self.alpha = float(alpha)
        self.beta = float(beta)
        self.hand_on_maps = hand_on
        self.conv = (
            AttentionMapConv(self.num_heads, kernel_size, conv_layout)
            if conv_layout is not None
            else None
        )

    def transform_logits(self, logits, masked, query_padding_mask, incremental_state):
        previous = self.attention_maps.previous(self.slot) if self.alpha > 0.0 else None
        accelerator = self._accelerator(logits)
        a_logit = None
        if accelerator is not None and incremental_state is None:
            a_logit = accelerator.full_pass(
                logits, previous, neutral_entries(masked, query_padding_mask),
                None if self.hand_on_maps else masked, self.conv, self.alpha, self.beta)
            if not self.hand_on_maps:
                return a_logit  # its masked entries are -inf already
        elif accelerator is not None:
            a_logit = self._accelerated_step(accelerator, logits, previous, masked, incremental_state)
        if a_logit is None:
            neutral = neutral_entries(masked, query_padding_mask)
            convolve = None if self.conv is None else lambda x: self._convolve(x, incremental_state)
            a_logit, _, conv = evolving_attention(logits, previous, neutral, self.alpha, self.beta, convolve)
            self.report_maps(lambda: {
                "dot_product": logits,  # Attention(X)_logit, zero where neutral
                "convolution": self.beta * conv if conv is not None else torch.zeros_like(logits),
                "logits": a_logit,
            }, masked)
        if self.hand_on_maps:  # the next layer's A_logit(i-1)
            self.attention_maps.hand_on(self.slot, a_logit)
            return fill_masked(a_logit, masked, float("-inf"))
        return fill_masked_(a_logit, masked, float("-inf"))

    def attend_step(self, logits, masked, v, incremental_state):
        """A decoding step's Eq. (4), softmax and value product in one accelerated call,
        when no later layer reads this layer's ``A_logit`` and an accelerator takes it
        (else None: :meth:`transform_logits` and the softmax)."""
        accelerator = None if self.hand_on_maps else self._accelerator(logits)
        if accelerator is None:
            return None
        previous = self.attention_maps.previous(self.slot) if self.alpha > 0.0 else None
        return self._accelerated_step(accelerator, logits, previous, masked, incremental_state, values=v)

    def _accelerator(self, logits: Tensor):
        if self.conv is None:
            return None
        return accelerators.lookup("evolving_attention", logits)

    def _accelerated_step(self, accelerator, logits, previous, masked, incremental_state, values=None):
        """One decoding step through the accelerator, reading and storing the cached conv
        rows: ``A_logit`` (or with ``values`` the pair (context, weights)), or None where
        the accelerator does not take the step."""
        state = self.get_mechanism_state(incremental_state)
        earlier = state.get("conv_rows")
        step = accelerator.step(logits, previous, masked, earlier, state.get("conv_rows_order"),
                                self.conv, self.alpha, self.beta, values,
                                cross_attention=self.encoder_decoder_attention)
        if step is None:
            return None
        out, rows, context = step
        state.pop("conv_rows_order", None)
        state["conv_rows"] = rows
        if earlier is None:  # the first step stores the dict; later steps update it in place
            self.set_mechanism_state(incremental_state, state)
        return out if values is None else (context, out)

    def reorder_mechanism_state(self, state, new_order):
        """Beam search's reorder of the cached conv rows, applied lazily: the order is kept
        (composed with one not yet applied) and the next step reads hypothesis n's rows at
        ``order[n]`` (an accelerator inside its step; the reference by one
        ``index_select``), so no step copies the rows of every attention twice.
        (``new_order`` is kept, not copied: fairseq's generator hands a new tensor to
        every step's reorder.)"""
        if state.get("conv_rows") is None:
            return
        pending = state.get("conv_rows_order")
        state["conv_rows_order"] = new_order if pending is None else pending.index_select(0, new_order)

    def _convolve(self, a_input: Tensor, incremental_state) -> Tensor:
        if incremental_state is None:
            return self.conv(a_input)
        # Incremental decoding: the convolution reads the k-1 rows of A_input before the
        # current one; they are cached here (zeros before the first target position,
        # exactly the zero border of the full pass).
        needed = self.conv.rows_needed
        if needed == 0:
            return self.conv(a_input, pad_rows=False)
        state = self.get_mechanism_state(incremental_state)
        earlier = state.get("conv_rows")
        order = state.pop("conv_rows_order", None)
        if earlier is not None and order is not None:
            earlier = earlier.index_select(0, order)
        bsz, heads, _, src_len = a_input.shape
        if earlier is None:
            earlier = a_input.new_zeros(bsz, heads, needed, src_len)
        else:
            # decoder self-attention: earlier rows had fewer keys; the new ones are masked
            earlier = pad_rows_to(earlier, src_len)
        rows = torch.cat([earlier, a_input], dim=2)
        state["conv_rows"] = rows[:, :, -needed:]
        self.set_mechanism_state(incremental_state, state)
        return self.conv(rows, pad_rows=False)
