"""Evolving Attention (EA-Transformer), EA paper Eq. (4), §3.3 and §3.5, as one operation.

For layer i of a stack, :func:`evolving_attention` computes::

    A_input^i = α · A_logit^(i-1) + (1 − α) · Attention(X)_logit^i     (α: skip connection)
    A_logit^i = β · ReLU(Conv(A_input^i)) + (1 − β) · A_input^i        (β: convolution)
    A^i       = softmax(A_logit^i)

``Attention(X)_logit = QK^T / sqrt(d)`` is the attention's own logit map (with its masks);
``A_logit^i`` is handed to the next layer by the caller. The first layer has no previous
map and uses ``A_input = Attention(X)_logit``. ``Conv`` is a heads-to-heads convolution in
the layout of the attention kind (Fig. 3, :mod:`ea_ops.map_conv`):
``full`` for encoder self-attention, ``causal`` (masked kernel + shift) for decoder
self-attention, ``rows`` (shift along the target axis) for encoder-decoder attention.
Without a convolution, ``A_logit = A_input``.

Masked entries (padding keys, future positions, padded query rows) enter the skip
connection and the convolution as neutral zeros -- never ``-inf`` or a dtype's minimum;
the map handed on to the next layer is finite (its masked entries hold whatever the
convolution put there, which the next layer's zero fill replaces), and ``-inf`` is written
only into the softmax's input.

The operation is a pure function, as ``scaled_dot_product_attention`` is: it returns new
tensors and writes into none of its arguments, and its state comes in and goes out. A
decoding step takes the :class:`~ea_ops.contract.StepState` the previous step returned (the
last ``k - 1`` rows of ``A_input``, exactly what the convolution reads of earlier steps, and
beam search's pending reorder) and returns the next one, which the caller stores; nothing
is kept anywhere else. The backends -- the PyTorch reference (:mod:`ea_ops.reference`, for
every device and dtype, autocast and autograd included), the CPU's fused passes
(:mod:`ea_ops.cpu`) and, on CUDA, Triton kernels (:mod:`ea_ops.triton`, in float16, bfloat16
and float32, with the softmax where the weights are asked for; the ``triton`` extra) for a
full pass (one kernel forward, two backward) and for a decoding step (one kernel, reading
the earlier rows in beam search's order) -- compute the same values and gradients; which
one runs a call is decided in one table (:mod:`ea_ops.dispatch`), once per configuration.
"""
from typing import Optional

from torch import Tensor

from . import dispatch
from .contract import BackendResult, EvolvingAttentionOutput, EvolvingAttentionParams, StepState
from .masks import fill_masked, fill_masked_
from .softmax import attention_weights
from .values import value_product


def evolving_attention(logits: Tensor, previous: Optional[Tensor], masked: Optional[Tensor],
                       neutral: Optional[Tensor], params: EvolvingAttentionParams, *,
                       state: Optional[StepState] = None, values: Optional[Tensor] = None,
                       empty: Optional[Tensor] = None, hand_on: bool = False,
                       return_maps: bool = False) -> EvolvingAttentionOutput:
    """EA Eq. (4) on this layer's logit map, by the backend the dispatcher chooses.

    ``logits``: ``Attention(X)_logit`` (B, H, T, S); ``previous``: the previous layer's
    finite ``A_logit`` or None; ``masked``: the entries the softmax must not see (``-inf``
    in the result), a broadcastable bool mask or None; ``neutral``: the entries entering
    Eq. (4) as zeros where they are more than ``masked`` (``masked`` and padded query
    rows), else None; ``params``: α, β and the convolution; ``state``: a decoding step's
    :class:`~ea_ops.contract.StepState` (``logits`` are the new
    rows; ``StepState()`` for the first step), or None for a full pass; ``values``
    (B_kv * H, S, head_dim), when given: the weights' softmax and value product are
    computed too (no dropout on the weights), with zero weights in the rows ``empty`` marks
    (every key masked, :func:`ea_ops.softmax.fully_masked_rows` of
    ``masked``; None where no row can be); ``hand_on``: also return the finite
    ``A_logit``; ``return_maps``: also return the intermediate maps (for analysis).
    A decoding step's output carries the state for the next step.
    """
    call = dispatch.describe(logits, masked, neutral, params, state, values, hand_on, return_maps)
    backend = dispatch.TABLE[dispatch.choose(call)]
    result = backend.run(logits, previous, masked, masked if neutral is None else neutral, params, state=state,
                         values=values if backend.attends else None, hand_on=hand_on, return_maps=return_maps)
    return finish(result, masked, hand_on, values, empty)


def finish(result: BackendResult, masked: Optional[Tensor], hand_on: bool, values: Optional[Tensor],
           empty: Optional[Tensor]) -> EvolvingAttentionOutput:
    """The operation's output from a backend's: ``-inf`` where ``masked`` (in the finite
    ``A_logit``, in place unless it is handed on), then with ``values`` the softmax (zero
    weights in ``empty`` rows) and the value product, where the backend did not."""
    if result.probs is not None:
        return EvolvingAttentionOutput(carried=result.carried, probs=result.probs, context=result.context,
                                       state=result.state)
    a_logit = result.a_logit
    carried = result.carried if result.carried is not None else a_logit if hand_on else None
    if not result.masked_filled:
        a_logit = (fill_masked if hand_on else fill_masked_)(a_logit, masked, float("-inf"))
    if values is None:
        return EvolvingAttentionOutput(a_logit, carried, maps=result.maps, state=result.state)
    probs_float, probs = attention_weights(a_logit, values.dtype, empty)
    context = value_product(probs, values, a_logit.size(0), a_logit.size(2))
    return EvolvingAttentionOutput(None, carried, probs_float, context, result.maps, result.state)
