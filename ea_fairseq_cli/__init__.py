"""The plugin's command-line tools, which import neither fairseq nor torch until a command needs
them: ``ea-fairseq-bleu`` (:mod:`.bleu`) and ``ea-fairseq-compare`` (:mod:`.compare_systems`)
never do, ``ea-fairseq-average-checkpoints`` (:mod:`.average_checkpoints`) and
``ea-fairseq-analysis`` (:mod:`.analysis`; its figures :mod:`.plots` and learning curves
:mod:`.curves`) and ``python -m ea_fairseq_cli.warm_start`` (:mod:`.warm_start`) load the plugin
(``import ea_fairseq``) after parsing their arguments, for the commands that read a checkpoint
or build a model. Each is also ``python -m ea_fairseq_cli.NAME``.

They live beside the plugin's package, not in it: importing anything under :mod:`ea_fairseq`
loads the plugin (fairseq, torch, the models), whatever the program, so ``--help`` stays fast
and the metric tools run where fairseq is not installed (the COMET environment).
"""

ATTENTIONS = ("encoder.self", "decoder.self", "decoder.cross")  # the attentions of a model, in order
