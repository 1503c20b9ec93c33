"""The switches of the accelerated backends of EA's operation.

The operation (:func:`ea_ops.evolving_attention`) computes its equation in PyTorch
operations (the reference, :mod:`ea_ops.reference`: device- and dtype-agnostic,
autocast-friendly, the code the tests prove exact). An accelerated backend (the CPU's
fused C++ passes, :mod:`ea_ops.cpu`) computes the same values and gradients, faster where
it can; the dispatcher (:mod:`ea_ops.dispatch`) decides, in one table, which calls it
takes, and tests hold each backend to the reference (``tests/ops/test_accelerator_*.py``).

Switches: ``EA_FAIRSEQ_ACCELERATORS=0`` in the environment runs the reference everywhere
(read once per process); :func:`reference_only` does so within a ``with`` block (this
thread; the tests compare both that way). Both are facts of every call the dispatcher
sees (:attr:`ea_ops.dispatch.Call.accelerators_on`), so its cached choices follow them.
"""
import os
import threading
from contextlib import contextmanager

ENV_SWITCH = "EA_FAIRSEQ_ACCELERATORS"

_local = threading.local()


def enabled_by_environment() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


_ENABLED = enabled_by_environment()


def switched_on() -> bool:
    """Whether accelerated backends may run here: not switched off by the environment, not
    inside :func:`reference_only` (in this thread)."""
    return _ENABLED and not getattr(_local, "reference_only", 0)


@contextmanager
def reference_only():
    """Run the reference backend inside the block (this thread)."""
    _local.reference_only = getattr(_local, "reference_only", 0) + 1
    try:
        yield
    finally:
        _local.reference_only -= 1
