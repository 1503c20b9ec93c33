"""Accelerators: faster implementations of a mechanism's equations on some devices and dtypes.

Every mechanism computes its equation once, in plain PyTorch, in its own module (the
reference: device- and dtype-agnostic, autocast-friendly, the code the tests prove exact),
behind one operation with a fixed signature (EA:
:func:`ea_fairseq.modules.evolving_attention.evolving_attention`). An accelerator
implements that same signature, faster where it can, with the same values and gradients:
it registers under the operation's name for a device type and a set of dtypes, and the
operation asks :func:`lookup` for one on every call; where none applies (another device or
dtype, one that could not be built, accelerators switched off, or the accelerator returns
``NotImplemented`` for the call's shapes) the reference runs. Nothing
device-specific lives in a mechanism's own module, and tests hold each accelerator to the
reference (``tests/test_accelerator_*.py``).

Registered here:

* ``evolving_attention`` on CPU, float32/float64: fused C++ passes around EA's map
  convolution and a fused decoding step (:mod:`ea_fairseq.accelerators.cpu`).

Switches: ``EA_FAIRSEQ_ACCELERATORS=0`` in the environment runs the reference everywhere
(read once per process); :func:`reference_only` does so within a ``with`` block (the tests
compare both that way).
"""
import os
import threading
from contextlib import contextmanager
from typing import Dict, FrozenSet, List, Optional

import torch

ENV_SWITCH = "EA_FAIRSEQ_ACCELERATORS"


class Accelerator:
    """Base class: what an operation's accelerator declares. Subclasses are called with the
    operation's signature and may refuse a call by returning ``NotImplemented`` (the
    operation then runs its reference)."""

    device_type: str = "cpu"
    dtypes: FrozenSet[torch.dtype] = frozenset()

    def available(self) -> bool:
        """Whether it can run in this process (built, loaded); decided once, cheaply after."""
        return True

    def supports(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self.device_type and tensor.dtype in self.dtypes


_registry: Dict[str, List[Accelerator]] = {}
_local = threading.local()


def enabled_by_environment() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


_ENABLED = enabled_by_environment()


def register(mechanism: str, accelerator: Accelerator) -> Accelerator:
    _registry.setdefault(mechanism, []).append(accelerator)
    return accelerator


def registered(mechanism: str) -> List[Accelerator]:
    return list(_registry.get(mechanism, ()))


def lookup(mechanism: str, tensor: torch.Tensor) -> Optional[Accelerator]:
    """The first accelerator of ``mechanism`` for ``tensor``'s device and dtype, or None."""
    if not _ENABLED or getattr(_local, "reference_only", 0):
        return None
    for accelerator in _registry.get(mechanism, ()):
        if accelerator.supports(tensor) and accelerator.available():
            return accelerator
    return None


@contextmanager
def reference_only():
    """Run every mechanism's reference implementation inside the block (this thread)."""
    _local.reference_only = getattr(_local, "reference_only", 0) + 1
    try:
        yield
    finally:
        _local.reference_only -= 1


from . import cpu  # noqa: E402,F401  (registers the CPU accelerators)
