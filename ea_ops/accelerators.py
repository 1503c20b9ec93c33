"""Accelerators: faster implementations of a mechanism's equations on some devices and dtypes.

Every mechanism computes its equation once, in plain PyTorch, in its own module (the
reference: device- and dtype-agnostic, autocast-friendly, the code the tests prove exact),
behind one operation (EA: :func:`ea_fairseq.modules.evolving_attention_op.evolving_attention`).
An accelerator computes the same values and gradients, faster where it can; it imports
only the operation's types (:mod:`ea_fairseq.ops`), and the operation's dispatcher
(:mod:`ea_fairseq.ops.evolving_attention_dispatch`) decides, in one table, which calls it
takes. Nothing device-specific lives in a mechanism's own module, and tests hold each
accelerator to the reference (``tests/test_accelerator_*.py``).

Here:

* EA Eq. 4 on CPU, float32/float64: fused C++ passes around EA's map convolution and a
  fused decoding step (:mod:`ea_fairseq.accelerators.cpu`).

Switches: ``EA_FAIRSEQ_ACCELERATORS=0`` in the environment runs the reference everywhere
(read once per process); :func:`reference_only` does so within a ``with`` block (the tests
compare both that way).
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
    """Whether accelerators may run here: not switched off by the environment, not inside
    :func:`reference_only` (in this thread)."""
    return _ENABLED and not getattr(_local, "reference_only", 0)


@contextmanager
def reference_only():
    """Run every mechanism's reference implementation inside the block (this thread)."""
    _local.reference_only = getattr(_local, "reference_only", 0) + 1
    try:
        yield
    finally:
        _local.reference_only -= 1
