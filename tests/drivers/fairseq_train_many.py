"""Run ``fairseq-train`` once per command line, in one process (one import of torch and
fairseq instead of one per run); each argument is a JSON list: one fairseq-train command
line without the program name. The process ends with ``os._exit`` once every run is done:
it may load no plugin, and fairseq's prefetch thread can abort Python's finalization
(``ea_fairseq.side_effects.prefetching_finished_at_exit`` says how; the plugin's command lines
stop it)."""
import json
import os
import sys

from fairseq import distributed_utils, options
from fairseq_cli import train

if __name__ == "__main__":
    for argv in sys.argv[1:]:
        args = options.parse_args_and_arch(options.get_training_parser(), json.loads(argv))
        cfg = train.convert_namespace_to_omegaconf(args)
        distributed_utils.call_main(cfg, train.main)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
