"""Evolving Attention (EA-Transformer), EA paper Eq. (4), §3.3 and §3.5.

For layer i of a stack, :func:`evolving_attention` computes::

    A_input^i = α · A_logit^(i-1) + (1 − α) · Attention(X)_logit^i     (α: skip connection)
    A_logit^i = β · ReLU(Conv(A_input^i)) + (1 − β) · A_input^i        (β: convolution)
    A^i       = softmax(A_logit^i)

``Attention(X)_logit = QK^T / sqrt(d)`` is fairseq's own logit map (with its masks);
``A_logit^i`` is handed to the next layer through the stack's
:class:`~ea_fairseq.modules.attention_maps.AttentionMapCarrier`. The first layer has no
previous map and uses ``A_input = Attention(X)_logit``. ``Conv`` is a heads-to-heads
convolution in the layout of the attention kind (Fig. 3,
:mod:`~ea_fairseq.modules.attention_map_conv`): ``full`` for encoder self-attention,
``causal`` (masked kernel + shift) for decoder self-attention, ``rows`` (shift along the
target axis) for encoder-decoder attention. Without a convolution, ``A_logit = A_input``.

Masked entries (padding keys, future positions, padded query rows) enter the skip
connection and the convolution as neutral zeros -- never ``-inf`` or a dtype's minimum;
the map handed on to the next layer is finite (its masked entries hold whatever the
convolution put there, which the next layer's zero fill replaces), and ``-inf`` is written
only into the softmax's input. In incremental decoding a :class:`ConvRowCache` keeps the
last ``k - 1`` rows of ``A_input`` (exactly what the convolution reads of earlier steps)
and follows beam search's reorders.

:func:`evolving_attention` is the one operation :class:`EvolvingAttention` calls, once per
attention, as ``scaled_dot_product_attention`` is one operation with several backends: its
PyTorch reference (:func:`evolving_attention_reference`, for every device and dtype,
autocast included) and the accelerators registered for the map's device and dtype
(:mod:`ea_fairseq.accelerators`; on CPU in float32/float64, fused C++ passes) implement the
same signature and compute the same values and gradients.
"""
from typing import Callable, Dict, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .attention_map_conv import AttentionMapConv, convolve, layout_kernel
from .attention_maps import (LogitMapAttention, attention_weights, fairseq_weights, fill_masked,
                             fill_masked_, pad_rows_to, value_product)


class EvolvingAttentionParams(NamedTuple):
    """The constants of one EA attention: α, β and the map convolution (``weight``
    (H, H, k, k), ``bias`` (H) or None, ``layout`` one of
    :data:`~ea_fairseq.modules.attention_map_conv.LAYOUTS`), or ``weight`` None without
    one."""

    alpha: float
    beta: float
    weight: Optional[Tensor]
    bias: Optional[Tensor]
    layout: str


class EvolvingAttentionOutput(NamedTuple):
    """What :func:`evolving_attention` returns.

    ``logits``: ``A_logit`` with ``-inf`` where masked, the softmax's input (None when
    ``values`` were given); ``carried``: the finite ``A_logit`` for the next layer (with
    ``hand_on``, else None); ``probs`` and ``context`` (with ``values``): the weights
    ``softmax(A_logit)`` in at least float32 and the value product (T, B, H * head_dim);
    ``maps`` (with ``return_maps``): ``dot_product`` (``Attention(X)_logit``),
    ``convolution`` (``β · ReLU(Conv(A_input))``) and ``logits`` (``A_logit``), masked
    entries unspecified.
    """

    logits: Optional[Tensor] = None
    carried: Optional[Tensor] = None
    probs: Optional[Tensor] = None
    context: Optional[Tensor] = None
    maps: Optional[Dict[str, Tensor]] = None


class ConvRowCache:
    """The rows of ``A_input`` a decoding run's next step convolves, in the attention's
    incremental state (``state``, a dict that fairseq keeps per module and run).

    Beam search's reorders are composed and applied when the next step reads the rows
    (:attr:`order`: hypothesis n reads ``rows[order[n]]``), so no step copies the rows
    twice. What the convolution derives from the weights (its masked, padded kernel) is
    made once per run (:meth:`memo`); nothing outlives the run.
    """

    def __init__(self, state: Dict[str, Optional[Tensor]]):
        self.state = state

    @property
    def rows(self) -> Optional[Tensor]:
        """(B', H, k - 1, S' <= S) or None before the first step."""
        return self.state.get("conv_rows")

    @property
    def order(self) -> Optional[Tensor]:
        return self.state.get("conv_rows_order")

    def ordered_rows(self) -> Optional[Tensor]:
        rows, order = self.rows, self.order
        return rows if rows is None or order is None else rows.index_select(0, order)

    def store(self, rows: Tensor) -> None:
        self.state["conv_rows"] = rows
        self.state.pop("conv_rows_order", None)

    def reorder(self, new_order: Tensor) -> None:
        """Beam search's new order of hypotheses, applied at the next read. (``new_order``
        is kept, not copied: fairseq's generator hands a new tensor to every reorder.)"""
        if self.rows is None:
            return
        pending = self.order
        self.state["conv_rows_order"] = new_order if pending is None else pending.index_select(0, new_order)

    def memo(self, name: str, compute: Callable[[], Tensor]) -> Tensor:
        """``compute()`` once per decoding run (every time with autograd on, whose graph
        must not outlive the pass)."""
        if torch.is_grad_enabled():
            return compute()
        key = "kernel." + name
        value = self.state.get(key)
        if value is None:
            value = self.state[key] = compute()
        return value


def evolving_attention(logits: Tensor, previous: Optional[Tensor], masked: Optional[Tensor],
                       neutral: Optional[Tensor], params: EvolvingAttentionParams, *,
                       cache: Optional[ConvRowCache] = None, values: Optional[Tensor] = None,
                       empty: Optional[Tensor] = None, hand_on: bool = False,
                       return_maps: bool = False) -> EvolvingAttentionOutput:
    """EA Eq. (4) on this layer's logit map, by the first backend that takes the call.

    ``logits``: ``Attention(X)_logit`` (B, H, T, S), a fresh score tensor, which
    autograd does not keep (it may be changed in place); ``previous``: the previous layer's
    finite ``A_logit`` or None; ``masked``: the entries the softmax must not see (``-inf``
    in the result), ``neutral``: those entering Eq. (4) as zeros (``masked`` and padded
    query rows), both broadcastable bool or None; ``params``: α, β and the convolution;
    ``cache``: a decoding run's :class:`ConvRowCache` (``logits`` are the new rows), or None
    for a full pass; ``values`` (B_kv * H, S, head_dim), when given: the weights' softmax and
    value product are computed too (no dropout on the weights), with zero weights in the rows
    ``empty`` marks (every key masked, :func:`~ea_fairseq.modules.masked_softmax.fully_masked_rows`
    of ``masked``; None where no row can be); ``hand_on``: also return the
    finite ``A_logit``; ``return_maps``: also return the intermediate maps (for analysis).
    """
    if not return_maps:
        backend = accelerators.lookup("evolving_attention", logits)
        if backend is not None:
            out = backend(logits, previous, masked, neutral, params, cache=cache, values=values,
                          empty=empty, hand_on=hand_on)
            if out is not NotImplemented:
                return out
    return evolving_attention_reference(logits, previous, masked, neutral, params, cache=cache,
                                        values=values, empty=empty, hand_on=hand_on,
                                        return_maps=return_maps)


def evolving_attention_reference(logits, previous, masked, neutral, params, *, cache=None,
                                 values=None, empty=None, hand_on=False,
                                 return_maps=False) -> EvolvingAttentionOutput:
    """EA Eq. (4) in PyTorch operations: the reference every backend is held to
    (:func:`evolving_attention` documents the arguments)."""
    a_input = fill_masked_(logits, neutral, 0.0)
    dot_product = a_input.clone() if return_maps and previous is not None else a_input
    if previous is not None:  # line 1, the α skip connection (previous's masked entries re-zeroed)
        a_input = fill_masked_(torch.lerp(a_input, previous, params.alpha), neutral, 0.0)
    conv = None  # ReLU(Conv(A_input))
    if params.weight is None:
        a_logit = a_input
    else:
        conv = F.relu(convolve_rows(a_input, params, cache))
        a_logit = torch.lerp(a_input, conv, params.beta)  # line 2, β·ReLU(Conv) + (1-β)·A_input
    maps = None
    if return_maps:
        maps = {"dot_product": dot_product,
                "convolution": params.beta * conv if conv is not None else torch.zeros_like(a_logit),
                "logits": a_logit.clone()}
    return finish(a_logit, masked, hand_on, values, maps, empty)


def finish(a_logit: Tensor, masked: Optional[Tensor], hand_on: bool, values: Optional[Tensor],
           maps: Optional[Dict[str, Tensor]] = None, empty: Optional[Tensor] = None) -> EvolvingAttentionOutput:
    """The output of :func:`evolving_attention` from the finite ``A_logit`` (changed in
    place unless it is handed on): ``-inf`` where ``masked``, then with ``values`` the
    softmax (zero weights in ``empty`` rows) and value product."""
    carried = a_logit if hand_on else None
    a_logit = (fill_masked if hand_on else fill_masked_)(a_logit, masked, float("-inf"))
    if values is None:
        return EvolvingAttentionOutput(a_logit, carried, maps=maps)
    probs_float, probs = attention_weights(a_logit, values.dtype, empty)
    context = value_product(probs, values, a_logit.size(0), a_logit.size(2))
    return EvolvingAttentionOutput(None, carried, probs_float, context, maps)


def convolve_rows(a_input: Tensor, params: EvolvingAttentionParams,
                  cache: Optional[ConvRowCache]) -> Tensor:
    """``Conv(A_input)``; in a decoding step on the cached earlier rows and the new ones
    (zeros before the first target position, exactly the zero border of the full pass)."""
    k = params.weight.size(-1)
    if cache is None or k == 1:
        kernel, padding = layout_kernel(params.weight, params.layout)
        return convolve(a_input, kernel, params.bias, padding)
    kernel, padding = cache.memo(params.layout, lambda: layout_kernel(params.weight, params.layout, True))
    earlier = cache.ordered_rows()
    bsz, heads, _, src_len = a_input.shape
    if earlier is None:
        earlier = a_input.new_zeros(bsz, heads, k - 1, src_len)
    else:
        # decoder self-attention: earlier rows had fewer keys; the new ones are masked
        earlier = pad_rows_to(earlier, src_len)
    rows = torch.cat([earlier, a_input], dim=2)
    cache.store(rows[:, :, -(k - 1):])
    return convolve(rows, kernel, params.bias, padding)


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

    def params(self) -> EvolvingAttentionParams:
        conv = self.conv
        if conv is None:
            return EvolvingAttentionParams(self.alpha, self.beta, None, None, "full")
        return EvolvingAttentionParams(self.alpha, self.beta, conv.weight, conv.bias, conv.layout)

    def evolve(self, logits, masked, query_padding_mask, incremental_state, values=None, empty=None):
        """The one call of :func:`evolving_attention` of this attention."""
        carrier = self.attention_maps
        previous = carrier.previous(self.slot) if self.alpha > 0.0 and carrier is not None else None
        cache = None
        if incremental_state is not None and self.conv is not None:
            state = self.get_mechanism_state(incremental_state)
            if not state:  # the first step stores the dict; later steps update it in place
                self.set_mechanism_state(incremental_state, state)
            cache = ConvRowCache(state)
        hand_on = self.hand_on_maps and carrier is not None
        out = evolving_attention(logits, previous, masked, self.neutral_entries(masked, query_padding_mask),
                                 self.params(), cache=cache, values=values,
                                 empty=empty,
                                 hand_on=hand_on, return_maps=bool(self._map_hooks))
        if hand_on:  # the next layer's A_logit(i-1)
            carrier.hand_on(self.slot, out.carried)
        if out.maps is not None:
            self.report_maps(lambda: out.maps, masked)
        return out

    def transform_logits(self, logits, masked, query_padding_mask, incremental_state):
        return self.evolve(logits, masked, query_padding_mask, incremental_state).logits

    def attend_logits(self, logits, masked, query_padding_mask, v, incremental_state, bsz, tgt_len,
                      need_weights, need_head_weights, empty=None):
        """Eq. (4), softmax and value product in one operation where no dropout acts on
        the weights (a backend may fuse them: the CPU accelerator's decoding step)."""
        if self.drops_weights():
            return super().attend_logits(logits, masked, query_padding_mask, v, incremental_state,
                                         bsz, tgt_len, need_weights, need_head_weights, empty)
        out = self.evolve(logits, masked, query_padding_mask, incremental_state, values=v, empty=empty)
        return self.out_proj(out.context), fairseq_weights(out.probs, need_weights, need_head_weights)

    def reorder_mechanism_state(self, state, new_order):
        ConvRowCache(state).reorder(new_order)


# last: the accelerators registered for this operation import its output types from here
from .. import accelerators  # noqa: E402
