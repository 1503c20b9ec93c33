"""The plugin's command-line tools under the plugin's name (:mod:`ea_fairseq_cli` holds them:
``ea-fairseq-average-checkpoints``, ``ea-fairseq-bleu``, ``ea-fairseq-compare``), and what
averaging checks of its inputs (:mod:`.average_inputs`)."""
