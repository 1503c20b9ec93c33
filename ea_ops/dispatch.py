"""Which backend runs a call of EA's operation (EA paper Eq. 4): every backend, with every
condition of its eligibility, in one table.

The backends compute the same values and gradients (:func:`ea_ops.evolving_attention`
documents the operation):

* :data:`REFERENCE`: the operation in PyTorch operations, for every device, dtype and
  call (autocast, autograd and analysis included; :mod:`ea_ops.reference`);
* :data:`CPU_FULL_PASS`: whole maps on CPU, fused C++ passes around the convolution, with
  their own backward (:func:`ea_ops.cpu.full_pass`);
* :data:`CPU_STEP`: one decoding step on CPU, the whole of Eq. 4 in one C++ call
  (:func:`ea_ops.cpu.step`);
* :data:`CPU_STEP_ATTEND`: the same with the softmax and the value product in that call;
* :data:`TRITON_FULL_PASS`: whole maps on CUDA in float16, bfloat16 or float32, Triton
  kernels (one forward, two backward) with the softmax where the weights are asked for
  (:func:`ea_ops.triton.full_pass`; triton from the ``triton`` extra). Its tests give it CPU
  calls under Triton's interpreter (:func:`ea_ops.triton.interpret_on_cpu`);
* :data:`TRITON_STEP`: one decoding step on CUDA in float16, bfloat16 or float32, the whole
  of Eq. 4 in one Triton kernel with the softmax where the weights are asked for, the
  earlier rows read in beam search's order (:func:`ea_ops.triton.step`); the value product
  is a ``bmm`` after it. The same conditions as :data:`CPU_STEP`'s for the step, the
  Triton kernels' for the device.

A backend is a row of :data:`TABLE` (:class:`Backend`: its conditions, its function, whether
it computes the weights itself) and a place in :data:`PREFERENCE`; its function has the one
signature :class:`~ea_ops.contract.BackendResult` states. Adding one is adding its row and
its place: nothing else names the backends.

:func:`select` picks, for the facts of a call (:class:`Call`: shapes, dtypes, the device,
grad mode and switches, never a tensor's values, which on a GPU would wait for the
device), the first backend of :data:`PREFERENCE` whose every condition holds;
:func:`refusals` names the conditions that keep a backend from a call. :func:`choose` is
:func:`select` made once per configuration: cached by the call's facts, the switches
among them (``EA_FAIRSEQ_ACCELERATORS=0`` and :func:`ea_ops.accelerators.reference_only`
switch the accelerated backends off) and whether the CPU backend's extension is built
(:mod:`ea_ops.library`; its library is looked for only for a call that every other
condition gives to a CPU backend, and never compiled here).
"""
import functools
import logging
from typing import Callable, Dict, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from . import accelerators, cpu, library, reference
from . import triton as gpu
from .contract import BackendResult, EvolvingAttentionParams, StepState
from .map_conv import check_layout

logger = logging.getLogger(__name__)

REFERENCE, CPU_FULL_PASS, CPU_STEP, CPU_STEP_ATTEND = "reference", "cpu_full_pass", "cpu_step", "cpu_step_attend"
TRITON_FULL_PASS, TRITON_STEP = "triton_full_pass", "triton_step"

# A decoding step's softmax and value product run inside the CPU step (one call instead of
# half a dozen small tensor operations), except for encoder-decoder attention whose values
# are not shared by beams (beam 1) above this many hypotheses, where torch's softmax and
# batched matmul run them (the measurements behind the threshold: benchmarks/README.md).
STEP_VALUES_MAX_BATCH = 64


class Call(NamedTuple):
    """The facts of one call that decide its backend (hashable: the cache's key)."""

    device_type: str
    dtype: torch.dtype
    accelerators_on: bool      # no EA_FAIRSEQ_ACCELERATORS=0, outside reference_only()
    built: Optional[bool]      # the CPU extension is built (None: not looked for yet, see choose())
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
    triton: bool = False        # triton can be imported (ea_ops.triton.installed())
    triton_on_cpu: bool = False  # CPU calls may go to the Triton kernels (ea_ops.triton.on_cpu())
    row_elements: int = 0       # heads x keys of a query row, each rounded up to a power of two
    autocast: bool = False      # autocast is on for the call's device


class Condition(NamedTuple):
    name: str
    holds: Callable[[Call], bool]


class Backend(NamedTuple):
    """A row of :data:`TABLE`: the conditions a call must meet, the function that runs it
    (the signature of :class:`~ea_ops.contract.BackendResult`), and whether that function
    computes the weights and the value product itself (it is handed the values; otherwise
    None, and the operation finishes its ``A_logit``)."""

    conditions: Tuple[Condition, ...]
    run: Callable[..., BackendResult]
    attends: bool = False


ACCELERATED = (
    Condition("accelerators switched on", lambda c: c.accelerators_on),
    Condition("on a CPU", lambda c: c.device_type == "cpu"),
    Condition("float32 or float64", lambda c: c.dtype in (torch.float32, torch.float64)),
    Condition("no intermediate maps asked for", lambda c: not c.return_maps),
    Condition("a map convolution", lambda c: c.has_conv),
    Condition("the C++ extension built", lambda c: bool(c.built)),
    # the reference follows autocast's dtypes (its convolution in autocast's); the fused
    # passes take the maps' dtype alone
    Condition("autocast off", lambda c: not c.autocast),
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
FULL_PASS = Condition("a full pass", lambda c: not c.step)
TRITON = (
    ACCELERATED[0],  # switched on
    Condition("on CUDA (on a CPU: inside ea_ops.triton.interpret_on_cpu(), under Triton's interpreter)",
              lambda c: c.device_type == "cuda" or (c.device_type == "cpu" and c.triton_on_cpu)),
    Condition("float16, bfloat16 or float32", lambda c: c.dtype in (torch.float16, torch.bfloat16, torch.float32)),
    ACCELERATED[3],  # no intermediate maps
    ACCELERATED[4],  # a map convolution
    Condition("triton installed (the triton extra)", lambda c: c.triton),
)
ROW_IN_REGISTERS = Condition(f"at most {gpu.MAX_ROW_ELEMENTS} heads x keys a row (powers of two)",
                             lambda c: c.row_elements <= gpu.MAX_ROW_ELEMENTS)
TABLE: Dict[str, Backend] = {
    TRITON_FULL_PASS: Backend(TRITON + (FULL_PASS,), gpu.full_pass, attends=True),
    TRITON_STEP: Backend(TRITON + STEP + (ROW_IN_REGISTERS,), gpu.step, attends=True),
    CPU_STEP_ATTEND: Backend(ACCELERATED + STEP + ATTEND, cpu.step, attends=True),
    CPU_STEP: Backend(ACCELERATED + STEP, cpu.step),
    CPU_FULL_PASS: Backend(ACCELERATED + (FULL_PASS,), cpu.full_pass),
    REFERENCE: Backend((), reference.evolving_attention_reference),
}
PREFERENCE = (TRITON_FULL_PASS, TRITON_STEP, CPU_STEP_ATTEND, CPU_STEP, CPU_FULL_PASS, REFERENCE)


def refusals(call: Call, backend: str):
    """The names of the conditions of ``backend`` that ``call`` does not meet."""
    return [condition.name for condition in TABLE[backend].conditions if not condition.holds(call)]


def select(call: Call) -> str:
    """The backend that runs ``call``: the first of :data:`PREFERENCE` that takes it."""
    return next(backend for backend in PREFERENCE if not refusals(call, backend))


def describe(logits: Tensor, masked: Optional[Tensor], neutral: Optional[Tensor],
             params: EvolvingAttentionParams, state: Optional[StepState], values: Optional[Tensor],
             hand_on: bool, return_maps: bool) -> Call:
    """The :class:`Call` of the operation's arguments (see the operation), with the
    switches as they are and the build as far as it was looked for."""
    weight = params.weight
    bsz, heads, rows, keys = logits.shape
    unshared = bsz if (values is not None and params.layout == "rows" and values.size(0) == bsz * heads) else 0
    # the sizes as far as a condition tells them apart (one row or more; within a limit or
    # over it), so that the calls of a decoding run, whose keys grow every step, and of
    # batches of any length are a handful of configurations, each chosen once
    return Call(logits.device.type, logits.dtype, accelerators.switched_on(), library.status(),
                torch.is_grad_enabled(), return_maps, weight is not None,
                0 if weight is None else weight.size(-1), params.layout, state is not None, min(rows, 2),
                masked is not None and masked.dim() >= 3 and masked.size(-3) != 1,
                neutral is not None, values is not None, hand_on, min(unshared, STEP_VALUES_MAX_BATCH + 1),
                gpu.installed(), gpu.on_cpu(), min(gpu.row_elements(heads, keys), 2 * gpu.MAX_ROW_ELEMENTS),
                autocast_on(logits.device.type))


def autocast_on(device_type: str) -> bool:
    """Whether autocast is on for ``device_type`` (off for a device autocast does not know:
    the meta device)."""
    return torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)


def choose(call: Call) -> str:
    """:func:`select`, once per configuration: the CPU extension's library is looked for
    (loaded, or warned about once) only where it decides the call."""
    cached = _cached.__wrapped__ if torch.compiler.is_compiling() else _cached  # (traced once per graph)
    backend = cached(call)
    if backend is None:
        library.extension()
        backend = cached(call._replace(built=library.status()))
    return backend


@functools.lru_cache(maxsize=4096)
def _cached(call: Call) -> Optional[str]:
    """:func:`select`'s answer, or None where it depends on a build not looked for yet; a
    convolution no backend computes (an even kernel, an unknown layout) is refused here, once
    per configuration, with what to pass instead."""
    if call.has_conv:
        check_layout(call.layout, call.kernel_size)
    if call.built is not None:
        return _told(call, select(call))
    backend = select(call._replace(built=True))
    return _told(call, backend) if backend == REFERENCE or backend == select(call._replace(built=False)) else None


def _told(call: Call, backend: str) -> str:
    """``backend``, with one log line where a call with a map convolution on CUDA does not go
    to the Triton kernels (once per configuration: :func:`_cached` calls it once), naming the
    conditions that keep it from them: analysis asking for the maps, a dtype, triton not
    installed, a decoding step the kernel does not take (its row too long among them)."""
    if call.device_type == "cuda" and call.has_conv and backend not in (TRITON_FULL_PASS, TRITON_STEP):
        kernels = TRITON_STEP if call.step else TRITON_FULL_PASS
        logger.info("EA's attention on CUDA runs on %s, not the Triton kernels, for %s %s in %s (layout %s): "
                    "not %s", backend, "decoding steps" if call.step else "full passes",
                    "with autograd" if call.grad_enabled else "without autograd", str(call.dtype).replace("torch.", ""),
                    call.layout, "; not ".join(refusals(call, kernels)))
    return backend


def forget() -> None:
    """Drop the cached choices (for a test that changes the table or its constants)."""
    _cached.cache_clear()


def accelerated_dtype(device_type: str, dtype: torch.dtype) -> bool:
    """Whether an accelerated backend takes calls on ``device_type`` in ``dtype`` here and
    now (switches and build as they are): a full pass with a convolution, the call with the
    fewest conditions, is asked about."""
    call = Call(device_type=device_type, dtype=dtype, accelerators_on=accelerators.switched_on(),
                built=library.status(), grad_enabled=False, return_maps=False, has_conv=True, kernel_size=3,
                layout="full", step=False, rows=1, mask_per_head=False, padded_query_rows=False,
                values=False, hand_on=False, unshared_values_batch=0, triton=gpu.installed(),
                triton_on_cpu=gpu.on_cpu(), autocast=autocast_on(device_type))
    return choose(call) != REFERENCE
