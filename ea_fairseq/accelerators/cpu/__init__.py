"""CPU accelerators (a C++ extension built on first use, see :mod:`.build`)."""
from .. import register
from .evolving_attention import EvolvingAttentionCPU

register("evolving_attention", EvolvingAttentionCPU())
