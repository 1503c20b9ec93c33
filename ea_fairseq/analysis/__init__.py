"""Attention analysis: maps, layer-wise metrics, plots, params/FLOPs.

``ea-fairseq-analysis {dump,metrics,plot,flops} --help`` (or ``python -m ea_fairseq_cli.analysis``);
see docs/analysis.md. The Python API lives in the submodules: :mod:`.maps` (capture and dump
attention maps), :mod:`.dumps` (read a dump), :mod:`.metrics` (entropy, JS divergence, Div, Disagreement) and :mod:`.flops`
(analytic params/FLOPs counts); the plots (matplotlib, headless) in :mod:`ea_fairseq_cli.plots`.
"""

from ea_fairseq_cli import ATTENTIONS  # noqa: F401  (the attentions of a model, in order)
