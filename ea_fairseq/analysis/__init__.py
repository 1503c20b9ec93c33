"""Attention analysis: maps, layer-wise metrics, plots, params/FLOPs.

``python -m ea_fairseq.analysis {dump,metrics,plot,flops} --help``; see docs/analysis.md.
The Python API lives in the submodules: :mod:`.maps` (capture and dump attention maps),
:mod:`.metrics` (entropy, JS divergence, Div, Disagreement), :mod:`.plots` (matplotlib,
headless) and :mod:`.flops` (analytic params/FLOPs counts).
"""
