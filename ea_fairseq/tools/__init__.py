"""The plugin's command-line tools, installed as console scripts (pyproject.toml):
``ea-fairseq-average-checkpoints``, ``ea-fairseq-bleu``, ``ea-fairseq-compare``; the
analysis tool is ``ea-fairseq-analysis`` (:mod:`ea_fairseq.analysis`). Each is also
``python -m ea_fairseq.tools.NAME``."""
