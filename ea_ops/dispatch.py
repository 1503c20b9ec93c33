"""Which backend runs a call of EA's operation (EA paper Eq. 4): every eligibility check of
every backend, in one table.

The backends compute the same values and gradients
(:func:`~ea_fairseq.modules.evolving_attention_op.evolving_attention` documents the
operation):

* :data:`REFERENCE`: the operation in PyTorch operations, for every device, dtype and
  call (autocast, autograd and analysis included);
* :data:`CPU_FULL_PASS`: whole maps on CPU, fused C++ passes around the convolution, with
  their own backward (:func:`ea_fairseq.accelerators.cpu.evolving_attention.full_pass`);
* :data:`CPU_STEP`: one decoding step on CPU, the whole of Eq. 4 in one C++ call
  (:func:`ea_fairseq.accelerators.cpu.evolving_attention.step`);
* :data:`CPU_STEP_ATTEND`: the same with the softmax and the value product in that call.

:func:`select` picks, for the facts of a call (:class:`Call`: shapes, dtypes, the device,
grad mode and switches, never a tensor's values, which on a GPU would wait for the
device), the first backend of :data:`PREFERENCE` whose every condition in :data:`TABLE`
holds; :func:`refusals` names the conditions that keep a backend from a call. The CPU
backends are switched off by ``EA_FAIRSEQ_ACCELERATORS=0`` and inside
:func:`ea_fairseq.accelerators.reference_only`, and their C++ extension is built on first
use (:mod:`ea_fairseq.accelerators.cpu.build`) -- only for a call that every other
condition gives to one of them.
"""
from typing import Callable, Dict, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from .. import accelerators
from ..accelerators.cpu import build
from .evolving_attention_types import EvolvingAttentionParams, StepState

REFERENCE, CPU_FULL_PASS, CPU_STEP, CPU_STEP_ATTEND = "reference", "cpu_full_pass", "cpu_step", "cpu_step_attend"

# A decoding step's softmax and value product run inside the CPU step (one call instead of
# half a dozen small tensor operations), except for encoder-decoder attention whose values
# are not shared by beams (beam 1) above this many hypotheses, where torch's softmax and
# batched matmul run them (the measurements behind the threshold: benchmarks/README.md).
STEP_VALUES_MAX_BATCH = 64


class Call(NamedTuple):
    """The facts of one call that decide its backend."""

    device_type: str
    dtype: torch.dtype
    accelerators_on: bool      # no EA_FAIRSEQ_ACCELERATORS=0, outside reference_only()
    built: bool                # the CPU extension is built (asked for last: see choose())
    grad_enabled: bool
    return_maps: bool          # the intermediate maps are asked for (analysis)
    has_conv: bool             # the attention has a map convolution
    kernel_size: int           # its k (0 without one)
    layout: str                # its layout: "full", "causal" or "rows"
    step: bool                 # a decoding step (a state given), else a full pass
    rows: int                  # query rows of the map (T)
    mask_per_head: bool        # a mask that differs between heads
    padded_query_rows: bool    # neutral entries beyond the masked ones (padded query rows)
    values: bool               # values given: weights and value product asked for
    hand_on: bool              # the finite A_logit is handed on to a later layer
    unshared_values_batch: int  # hypotheses, where each has its own encoder values (beam 1); else 0


class Condition(NamedTuple):
    name: str
    holds: Callable[[Call], bool]


ACCELERATED = (
    Condition("accelerators switched on", lambda c: c.accelerators_on),
    Condition("on a CPU", lambda c: c.device_type == "cpu"),
    Condition("float32 or float64", lambda c: c.dtype in (torch.float32, torch.float64)),
    Condition("no intermediate maps asked for", lambda c: not c.return_maps),
    Condition("a map convolution", lambda c: c.has_conv),
    Condition("the C++ extension built", lambda c: c.built),
)
STEP = (
    Condition("a decoding step", lambda c: c.step),
    Condition("autograd off", lambda c: not c.grad_enabled),
    Condition("one query row", lambda c: c.rows == 1),
    Condition("a kernel larger than 1x1", lambda c: c.kernel_size > 1),
    Condition("a shifted layout (causal or rows)", lambda c: c.layout in ("causal", "rows")),
    Condition("one mask for all heads", lambda c: not c.mask_per_head),
    Condition("no padded query rows", lambda c: not c.padded_query_rows),
)
ATTEND = (
    Condition("values given", lambda c: c.values),
    Condition("A_logit not handed on", lambda c: not c.hand_on),
    Condition(f"at most {STEP_VALUES_MAX_BATCH} hypotheses with values of their own",
              lambda c: c.unshared_values_batch <= STEP_VALUES_MAX_BATCH),
)
TABLE: Dict[str, Tuple[Condition, ...]] = {
    CPU_STEP_ATTEND: ACCELERATED + STEP + ATTEND,
    CPU_STEP: ACCELERATED + STEP,
    CPU_FULL_PASS: ACCELERATED + (Condition("a full pass", lambda c: not c.step),),
    REFERENCE: (),
}
PREFERENCE = (CPU_STEP_ATTEND, CPU_STEP, CPU_FULL_PASS, REFERENCE)


def refusals(call: Call, backend: str):
    """The names of the conditions of ``backend`` that ``call`` does not meet."""
    return [condition.name for condition in TABLE[backend] if not condition.holds(call)]


def select(call: Call) -> str:
    """The backend that runs ``call``: the first of :data:`PREFERENCE` that takes it."""
    return next(backend for backend in PREFERENCE if not refusals(call, backend))


def describe(logits: Tensor, masked: Optional[Tensor], neutral: Optional[Tensor],
             params: EvolvingAttentionParams, state: Optional[StepState], values: Optional[Tensor],
             hand_on: bool, return_maps: bool, built: bool = False) -> Call:
    """The :class:`Call` of the operation's arguments (see the operation)."""
    weight = params.weight
    bsz, heads = logits.size(0), logits.size(1)
    unshared = bsz if (values is not None and params.layout == "rows" and values.size(0) == bsz * heads) else 0
    return Call(
        device_type=logits.device.type, dtype=logits.dtype,
        accelerators_on=accelerators.switched_on(), built=built,
        grad_enabled=torch.is_grad_enabled(), return_maps=return_maps,
        has_conv=weight is not None, kernel_size=0 if weight is None else weight.size(-1),
        layout=params.layout, step=state is not None, rows=logits.size(2),
        mask_per_head=masked is not None and masked.dim() == 4 and masked.size(1) != 1,
        padded_query_rows=neutral is not None, values=values is not None, hand_on=hand_on,
        unshared_values_batch=unshared)


def choose(call: Call) -> str:
    """:func:`select` with the C++ extension's build asked for only where it decides."""
    backend = select(call._replace(built=True))
    if backend == REFERENCE:
        return backend
    return select(call._replace(built=build.extension() is not None))


def accelerated_dtype(device_type: str, dtype: torch.dtype) -> bool:
    """Whether an accelerator takes calls on ``device_type`` in ``dtype`` here and now
    (switches and build as they are): a full pass with a convolution, the call with the
    fewest conditions, is asked about."""
    call = Call(device_type=device_type, dtype=dtype, accelerators_on=accelerators.switched_on(),
                built=False, grad_enabled=False, return_maps=False, has_conv=True, kernel_size=3,
                layout="full", step=False, rows=1, mask_per_head=False, padded_query_rows=False,
                values=False, hand_on=False, unshared_values_batch=0)
    return choose(call) != REFERENCE
