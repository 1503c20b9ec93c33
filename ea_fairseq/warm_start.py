"""Warm start (:mod:`ea_fairseq_cli.warm_start`), under the plugin's name: this module is that one.

The tools live in :mod:`ea_fairseq_cli`, a package that imports neither fairseq nor torch, so that
``python -m ea_fairseq_cli.warm_start --help`` answers fast; importing :mod:`ea_fairseq` loads the
plugin."""
import sys

import ea_fairseq_cli.warm_start as _tool

sys.modules[__name__] = _tool

if __name__ == "__main__":
    sys.exit(_tool.main())
