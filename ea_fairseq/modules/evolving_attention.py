"""Evolving Attention (EA-Transformer), EA paper Eq. (4), §3.3 and §3.5.

For layer i of a stack::

    A_input^i = alpha * A_logit^(i-1) + (1 - alpha) * Attention(X)_logit^i     (α: skip connection)
    A_logit^i = beta * ReLU(Conv(A_input^i)) + (1 - beta) * A_input^i          (β: convolution)
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
connection and the convolution as neutral zeros -- never ``-inf`` or a dtype's minimum --
and are masked again (``-inf``) after it; the map handed on to the next layer is that
masked one (the next layer's zero fill, after its skip connection, replaces the ``-inf``).
Every fill works in place on tensors autograd does not keep. In incremental decoding the
module caches the last ``k - 1`` rows of ``A_input`` (exactly what the convolution reads
of earlier steps) and reorders them with the beams.

On CPU, for float32/float64 maps, the arithmetic around the convolution runs in the
fused kernels of :mod:`~ea_fairseq.modules.evolving_attention_kernels` (one pass
before it and one after it in full passes, forward and backward; one call per
attention in a decoding step); the PyTorch operations below are the reference path,
used for other devices and dtypes, for recording maps, and where the kernels cannot
be built. Tests hold both to the same values and gradients.
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from . import evolving_attention_kernels as fused
from .attention_map_conv import AttentionMapConv
from .attention_maps import LogitMapAttention, fill_masked, fill_masked_, neutral_entries, pad_rows_to


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
        carrier = self.attention_maps
        if incremental_state is not None and not carrier.recording:
            a_logit = self._fused_decoding_step(logits, masked, incremental_state)
            if a_logit is not None:
                if self.hand_on_maps:
                    carrier.hand_on(self.slot, a_logit)
                return a_logit
        recorded = fill_masked(logits, masked, 0.0) if carrier.recording else None
        # entries that enter the skip connection and the convolution as zeros
        neutral = neutral_entries(masked, query_padding_mask)
        previous = carrier.previous(self.slot) if self.alpha > 0.0 else None
        conv_term = None
        if (self.conv is not None and incremental_state is None and not carrier.recording
                and fused.full_map_applies(logits)):
            # Eq. (4), both lines, fused around the convolution (masked entries -> -inf)
            a_input = fused.evolving_attention_input(logits, previous, neutral, self.alpha)
            a_logit = fused.convolution_residual(a_input, self.conv(a_input, crop=False), masked,
                                                 self.beta)
        else:
            if previous is not None:
                # Eq. (4), line 1: the α skip connection, α·A_logit(i-1) + (1-α)·Attention(X)_logit
                # (the previous map holds -inf where masked: the fill below replaces it)
                a_input = fill_masked_(torch.lerp(logits, previous, self.alpha), neutral, 0.0)
            else:
                a_input = fill_masked_(logits, neutral, 0.0)
            a_logit = a_input
            if self.conv is not None:
                # Eq. (4), line 2: β·ReLU(Conv(A_input)) + (1-β)·A_input
                conv_term = F.relu(self._convolve(a_input, incremental_state), inplace=True)
                a_logit = torch.lerp(a_input, conv_term, self.beta)
            a_logit = fill_masked_(a_logit, masked, float("-inf"))
        if self.hand_on_maps:  # the next layer's A_logit(i-1)
            carrier.hand_on(self.slot, a_logit)
        if carrier.recording:
            carrier.log(
                self.slot,
                dot_product=recorded,
                convolution=self.beta * conv_term if conv_term is not None else torch.zeros_like(a_input),
                logits=fill_masked(a_logit, masked, 0.0),
            )
        return a_logit

    def attend_step(self, logits, masked, v, incremental_state):
        """A decoding step's Eq. (4), softmax and value product in one fused kernel call,
        when no later layer reads this layer's A_logit (else None: :meth:`transform_logits`,
        whose Eq. 4 is fused too), except for large steps of encoder-decoder attention
        whose values are not shared by beams (see ``STEP_VALUES_MAX_BATCH``)."""
        if self.hand_on_maps or self.attention_maps.recording:
            return None
        bsz = logits.size(0)
        if (self.encoder_decoder_attention and bsz > fused.STEP_VALUES_MAX_BATCH
                and v.size(0) == bsz * self.num_heads):
            return None
        return self._fused_decoding_step(logits, masked, incremental_state, values=v)

    def _fused_decoding_step(self, logits, masked, incremental_state, values=None):
        """Eq. (4) for one decoding step in one fused kernel (see
        :mod:`~ea_fairseq.modules.evolving_attention_kernels`): ``A_logit``, or with
        ``values`` the pair (context, weights); None where the kernel does not apply."""
        conv = self.conv
        if conv is None or conv.rows_needed == 0 or not fused.applies(logits):
            return None
        bsz, _, _, src_len = logits.shape
        keys = fused.key_mask(masked, bsz, src_len)
        if keys is False:
            return None
        previous = self.attention_maps.previous(self.slot) if self.alpha > 0.0 else None
        state = self.get_mechanism_state(incremental_state)
        earlier = state.get("conv_rows")
        out, rows, context = fused.evolving_attention_step(
            logits, previous, earlier, keys, conv.masked_weight(), conv.bias, self.alpha,
            self.beta, conv.col_padding[0], values, state.pop("conv_rows_order", None),
        )
        state["conv_rows"] = rows
        if earlier is None:  # the first step stores the dict; later steps update it in place
            self.set_mechanism_state(incremental_state, state)
        return out if values is None else (context, out)

    def reorder_mechanism_state(self, state, new_order):
        """Beam search's reorder of the cached conv rows, applied lazily: the order is kept
        (composed with one not yet applied) and the next step's kernel reads hypothesis
        n's rows at ``order[n]``, so no step copies the rows of every attention for it;
        the PyTorch path selects them before use. (``new_order`` is kept, not copied:
        fairseq's generator hands a new tensor to every step's reorder.)"""
        if state.get("conv_rows") is None:
            return
        pending = state.get("conv_rows_order")
        state["conv_rows_order"] = new_order if pending is None else pending.index_select(0, new_order)

    def _convolve(self, a_input: Tensor, incremental_state) -> Tensor:
        if incremental_state is None:
            return self.conv(a_input, keep_layout=True)
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
