"""Attention analysis: maps, layer-wise metrics, plots, params/FLOPs.

``ea-fairseq-analysis {dump,metrics,plot,flops} --help`` (or ``python -m ea_fairseq.analysis``); see docs/analysis.md.
The Python API lives in the submodules: :mod:`.maps` (capture and dump attention maps),
:mod:`.metrics` (entropy, JS divergence, Div, Disagreement), :mod:`.plots` (matplotlib,
headless; :mod:`ea_fairseq_cli.plots`) and :mod:`.flops` (analytic params/FLOPs counts).
"""

from ea_fairseq_cli import ATTENTIONS  # noqa: F401  (the attentions of a model, in order)
