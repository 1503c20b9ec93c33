"""What EA's operation (:func:`ea_ops.evolving_attention`, EA paper Eq. 4) takes and
returns, shared by the operation, its dispatcher (:mod:`ea_ops.dispatch`) and its backends."""
from typing import Dict, NamedTuple, Optional

from torch import Tensor


class EvolvingAttentionParams(NamedTuple):
    """The constants of one EA attention: α, β and the map convolution (``weight``
    (H, H, k, k), ``bias`` (H) or None, ``layout`` one of ``"full"``, ``"causal"``,
    ``"rows"``: :mod:`ea_ops.map_conv`), or ``weight`` None without
    one."""

    alpha: float
    beta: float
    weight: Optional[Tensor]
    bias: Optional[Tensor]
    layout: str


class StepState(NamedTuple):
    """What one decoding step of Eq. 4 leaves for the next of the same run, returned by the
    operation and stored by its caller (``StepState()`` before the first step).

    ``rows``: the last ``k - 1`` rows of ``A_input`` (B', H, k - 1, S' <= S), exactly what
    the convolution reads of earlier steps; ``order``: beam search's reorders not yet
    applied (hypothesis n reads ``rows[order[n]]``: composed by :meth:`reordered`, applied
    at the next step's read, so no step copies the rows twice); ``kernel``: the step's
    convolution kernel derived from the weights by the backend named ``kernel_of``, made
    once per run (never kept with autograd on, whose graph must not outlive the pass).
    """

    rows: Optional[Tensor] = None
    order: Optional[Tensor] = None
    kernel: Optional[Tensor] = None
    kernel_of: Optional[str] = None

    def reordered(self, new_order: Tensor) -> "StepState":
        """The state in beam search's new order of hypotheses (``new_order`` is kept, not
        copied: fairseq's generator hands a new tensor to every reorder)."""
        if self.rows is None:
            return self
        order = new_order if self.order is None else self.order.index_select(0, new_order)
        return self._replace(order=order)

    def kernel_for(self, backend: str) -> Optional[Tensor]:
        return self.kernel if self.kernel_of == backend else None


class BackendResult(NamedTuple):
    """What a backend of Eq. 4 returns to the operation, which finishes it (the ``-inf``
    of masked entries, the softmax and the value product, where the backend did not).

    ``a_logit``: ``A_logit`` (B, H, T, S), finite, or with ``-inf`` in the masked entries
    already where ``masked_filled``: a tensor of the backend's own, which the operation may
    fill in place (the input ``logits`` only where there is nothing to mask); ``probs`` and
    ``context`` instead, where the backend computed the weights and the value product
    itself; ``state``: a decoding step's :class:`StepState` for the next step (None in a
    full pass); ``maps``: the intermediate maps (the reference, when asked); ``carried``: the
    finite ``A_logit`` to hand on, where the backend wrote it beside the ``masked_filled``
    ``a_logit`` or the weights (else the operation hands on ``a_logit``).

    Every backend is a function of one signature, ``backend(logits, previous, masked,
    neutral, params, *, state, values, hand_on, return_maps) -> BackendResult`` (the
    operation's arguments, ``neutral`` defaulted to ``masked``; ``values`` only for a backend
    whose dispatcher row says it attends, else None), that never writes into its inputs.
    """

    a_logit: Optional[Tensor] = None
    masked_filled: bool = False
    probs: Optional[Tensor] = None
    context: Optional[Tensor] = None
    state: Optional[StepState] = None
    maps: Optional[Dict[str, Tensor]] = None
    carried: Optional[Tensor] = None


class EvolvingAttentionOutput(NamedTuple):
    """What the operation returns.

    ``logits``: ``A_logit`` with ``-inf`` where masked, the softmax's input (None when
    ``values`` were given); ``carried``: the finite ``A_logit`` for the next layer (with
    ``hand_on``, else None); ``probs`` and ``context`` (with ``values``): the weights
    ``softmax(A_logit)`` in at least float32 and the value product (T, B, H * head_dim);
    ``maps`` (with ``return_maps``): ``dot_product`` (``Attention(X)_logit``),
    ``convolution`` (``β · ReLU(Conv(A_input))``) and ``logits`` (``A_logit``), masked
    entries unspecified; ``state``: a decoding step's :class:`StepState` for the next step,
    which the caller stores (None in a full pass).
    """

    logits: Optional[Tensor] = None
    carried: Optional[Tensor] = None
    probs: Optional[Tensor] = None
    context: Optional[Tensor] = None
    maps: Optional[Dict[str, Tensor]] = None
    state: Optional[StepState] = None
