"""Learning curves from fairseq-train logs (:mod:`ea_fairseq_cli.curves`), under the plugin's name: this module is that one.

The tools live in :mod:`ea_fairseq_cli`, a package that imports neither fairseq nor torch, so that
their ``--help`` and the metric tools answer fast (and in an environment without fairseq);
importing :mod:`ea_fairseq` loads the plugin."""
import sys

import ea_fairseq_cli.curves as _tool

sys.modules[__name__] = _tool
