"""Attention analysis: maps, layer-wise metrics, plots, params/FLOPs (GitHub issue 6).

``python -m ea_fairseq.analysis {dump,metrics,plot,flops} --help``; see docs/analysis.md.
The Python API lives in the submodules: :mod:`.maps` (capture and dump attention maps),
:mod:`.metrics` (entropy, JS divergence, Div, Disagreement), :mod:`.plots` (matplotlib,
headless) and :mod:`.flops` (analytic params/FLOPs counts).
"""
