"""What checkpoint averaging checks of its inputs (:mod:`.average_inputs`); the command-line
tools themselves (``ea-fairseq-average-checkpoints``, ``ea-fairseq-bleu``,
``ea-fairseq-compare``, ``ea-fairseq-analysis``, warm start) live in :mod:`ea_fairseq_cli`."""
