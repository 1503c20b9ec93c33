"""Run ``fairseq-train`` with ``--bf16`` on a GPU (or the CPU) instead of a TPU.

fairseq's option parser makes ``--bf16`` imply ``--tpu`` (bfloat16 was a TPU feature
there), and its trainer then asks torch_xla for the device. This driver undoes only that
implication, unless ``--tpu`` is on the command line; everything else is fairseq's own
``--bf16`` path: its trainer casts the model and every batch to bfloat16, and its
FP16Optimizer keeps float32 master weights (without loss scaling, as for bfloat16).
"""
import sys

from fairseq import options
from fairseq_cli.train import cli_main  # as the console script does: the plugin serves this command line

_parse_args_and_arch = options.parse_args_and_arch


def parse_args_and_arch(*args, **kwargs):
    parsed = _parse_args_and_arch(*args, **kwargs)
    namespace = parsed[0] if isinstance(parsed, tuple) else parsed
    if getattr(namespace, "bf16", False) and "--tpu" not in sys.argv:
        namespace.tpu = False
    return parsed


options.parse_args_and_arch = parse_args_and_arch

if __name__ == "__main__":
    cli_main()
