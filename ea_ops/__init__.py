"""EA's operation (EA paper Eq. 4), its types, its backends and its dispatcher; torch only.

    from ea_ops import EvolvingAttentionParams, evolving_attention

Importing this package imports torch and nothing of fairseq or of the ``ea_fairseq``
plugin, whose attention modules call the operation (``ea_fairseq.modules.evolving_attention``).

* :mod:`ea_ops.operation`: :func:`evolving_attention`, the one entry point, a pure function;
* :mod:`ea_ops.contract`: what it takes and returns, and the one signature of a backend;
* :mod:`ea_ops.dispatch`: every backend and its conditions, in one table, chosen once per
  configuration;
* :mod:`ea_ops.reference`: the PyTorch reference backend;
* :mod:`ea_ops.cpu`, ``csrc/``, :mod:`ea_ops.build` and :mod:`ea_ops.library`: the CPU
  backend's fused C++ passes, built ahead with ``python -m ea_ops.build``;
* :mod:`ea_ops.triton`: the CUDA backend's Triton kernels of a full pass (the ``triton``
  extra; their tests run on CPU under Triton's interpreter);
* :mod:`ea_ops.accelerators`: the switches (``EA_FAIRSEQ_ACCELERATORS=0``, :func:`reference_only`);
* the pieces the operation is made of and the attention modules reuse: the map convolution
  in the layouts of EA Fig. 3 (:mod:`ea_ops.map_conv`), the masks (:mod:`ea_ops.masks`), the
  softmax of fully masked rows (:mod:`ea_ops.softmax`), the value product (:mod:`ea_ops.values`).
"""
from .accelerators import reference_only
from .contract import BackendResult, EvolvingAttentionOutput, EvolvingAttentionParams, StepState
from .operation import evolving_attention
from .reference import evolving_attention_reference

__all__ = ["BackendResult", "EvolvingAttentionOutput", "EvolvingAttentionParams", "StepState",
           "evolving_attention", "evolving_attention_reference", "reference_only"]
