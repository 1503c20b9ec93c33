"""Average the parameters of several fairseq checkpoints into one.

  # the last 10 epoch checkpoints (checkpointE.pt) of a run
  ea-fairseq-average-checkpoints --inputs CKPT_DIR --num-epoch-checkpoints 10 \\
      --output CKPT_DIR/averaged.pt
  # the last 5 update checkpoints (checkpoint_E_U.pt), none after update 50000
  ea-fairseq-average-checkpoints --inputs CKPT_DIR --num-update-checkpoints 5 \\
      --checkpoint-upper-bound 50000 --output avg.pt
  # explicit files
  ea-fairseq-average-checkpoints --inputs a.pt b.pt c.pt --output avg.pt

Every floating-point tensor of ``state["model"]`` is summed in float64, divided by the
number of checkpoints and cast back to its dtype. Other entries (integer buffers, non-tensor
values) must be identical in every input. The result keeps the rest of the first input's
state (its ``cfg``/``args``, ...); with the last-N options the first input is the newest
checkpoint. ``fairseq-generate --path`` loads the output like any checkpoint.

Inputs are read as fairseq reads them with the plugin (``ea_fairseq.safety.no_code``):
weights-only, the configuration rebuilt as plain data, the model family vouched for, every
tensor within its storage. They must hold one model trained on the same data
(:mod:`ea_fairseq.tools.average_inputs`: architecture, every model option, task, data
directory and languages; ``--data-dirs`` compares the dictionaries' checksums); options of
memory, speed and precision (``--checkpoint-activations``, ``--fp16``, ...) may differ. An input
refused there, one of another model or data, one holding NaN or infinite weights, or an
``--output`` that is one of the inputs stops the run before anything is written. The output
is written to a new temporary file in its directory and renamed (:mod:`ea_fairseq.safety.writers`):
no existing file or link is written through.
"""
import argparse
import collections
import os
import re
import sys
from typing import Any, Dict, List, Optional

from . import add_version_option
from .inputs import need_output_folder


class AverageError(ValueError):
    """Inputs that cannot be averaged (or found)."""


def last_checkpoints(directory: str, n: int, by_update: bool,
                     upper_bound: Optional[int] = None) -> List[str]:
    """The ``n`` newest checkpointE.pt (or checkpoint_E_U.pt) files in ``directory``, newest first."""
    if by_update:
        pattern, kind = re.compile(r"^checkpoint_\d+_(\d+)\.pt$"), "update checkpoints checkpoint_E_U.pt"
    else:
        pattern, kind = re.compile(r"^checkpoint(\d+)\.pt$"), "epoch checkpoints checkpointE.pt"
    if not os.path.isdir(directory):
        raise AverageError(f"{directory} is not a directory (with --num-*-checkpoints, "
                           "--inputs names the checkpoint directory)")
    found = []
    for name in os.listdir(directory):
        m = pattern.match(name)
        if m is None:
            continue
        number = int(m.group(1))
        if upper_bound is None or number <= upper_bound:
            found.append((number, os.path.join(directory, name)))
    bound = f" at or below {upper_bound}" if upper_bound is not None else ""
    if not found:
        raise AverageError(f"no {kind}{bound} in {directory}")
    if len(found) < n:
        raise AverageError(
            f"asked for the last {n} {kind} but {directory} has only {len(found)}{bound}: "
            f"{', '.join(os.path.basename(p) for _, p in sorted(found))}; average those with "
            f"--num-{'update' if by_update else 'epoch'}-checkpoints {len(found)}")
    found.sort(reverse=True)
    return [path for _, path in found[:n]]


def _weights(path: str) -> Dict[str, Any]:
    from ea_fairseq.safety.no_code import load_checkpoint, nonfinite_weights  # weights-only, sanitized

    # averaging builds no model: the averaged checkpoint meets the model check where fairseq loads it
    state = load_checkpoint(path, build_check=False)
    if not isinstance(state.get("model"), dict):
        raise AverageError(f"{path} has no 'model' entry: not a fairseq checkpoint")
    bad = nonfinite_weights(state["model"])
    if bad:
        raise AverageError(f"{path} holds NaN or infinite weights in {len(bad)} tensors: "
                           f"{', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}; averaging would spread them")
    return state


def average(paths: List[str], data_checked: bool = False) -> Dict[str, Any]:
    """Average ``state['model']`` over ``paths``; the rest of the state is ``paths[0]``'s.
    The inputs must hold the same model, trained on the same data (recorded names, or with
    ``data_checked`` the dictionaries' checksums compared by the caller)."""
    import torch

    from ea_fairseq.tools.average_inputs import check_same

    if not paths:
        raise AverageError("no checkpoints to average")
    first = _weights(paths[0])
    reference = first["model"]
    sums: Dict[str, Any] = {}
    for key, value in reference.items():
        if torch.is_tensor(value) and value.is_floating_point():
            sums[key] = value.detach().to(torch.float64).clone()
    for path in paths[1:]:
        state = _weights(path)
        check_same(path, state, paths[0], first, data_checked)
        model = state["model"]
        missing = [k for k in reference if k not in model]
        extra = [k for k in model if k not in reference]
        if missing or extra:
            what = []
            if missing:
                what.append(f"lacks {missing[:5]}{' ...' if len(missing) > 5 else ''}")
            if extra:
                what.append(f"has extra {extra[:5]}{' ...' if len(extra) > 5 else ''}")
            raise AverageError(f"{path} does not match {paths[0]}: it {' and '.join(what)}")
        for key, ref in reference.items():
            value = model[key]
            if torch.is_tensor(ref) != torch.is_tensor(value):
                raise AverageError(f"key {key!r}: a tensor in one checkpoint, not in {path}")
            if torch.is_tensor(ref):
                if value.shape != ref.shape:
                    raise AverageError(f"key {key!r}: shape {tuple(value.shape)} in {path} but "
                                       f"{tuple(ref.shape)} in {paths[0]}")
                if value.dtype != ref.dtype:
                    raise AverageError(f"key {key!r}: dtype {value.dtype} in {path} but "
                                       f"{ref.dtype} in {paths[0]}")
                if key in sums:
                    sums[key] += value.detach().to(torch.float64)
                elif not torch.equal(value, ref):
                    raise AverageError(f"key {key!r} ({ref.dtype}) differs between {paths[0]} and "
                                       f"{path}; only floating-point tensors are averaged")
            elif value != ref:
                raise AverageError(f"key {key!r} (non-tensor) differs between {paths[0]} and {path}")
        del model, state
    averaged = collections.OrderedDict()
    for key, ref in reference.items():
        if key in sums:
            averaged[key] = sums[key].div_(len(paths)).to(ref.dtype)
        else:
            averaged[key] = ref
    first["model"] = averaged
    return first


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--inputs", nargs="+", required=True, metavar="PATH",
                        help="checkpoint files, or with --num-*-checkpoints one directory")
    parser.add_argument("--output", required=True, metavar="FILE", help="where to write the average")
    last = parser.add_mutually_exclusive_group()
    last.add_argument("--num-epoch-checkpoints", type=int, metavar="N",
                      help="average the last N checkpointE.pt in the --inputs directory")
    last.add_argument("--num-update-checkpoints", type=int, metavar="N",
                      help="average the last N checkpoint_E_U.pt in the --inputs directory")
    parser.add_argument("--checkpoint-upper-bound", type=int, metavar="K",
                        help="with --num-*-checkpoints: ignore checkpoints after epoch/update K")
    parser.add_argument("--data-dirs", nargs="+", metavar="DIR",
                        help="each input's data directory, in the inputs' order: their dict.*.txt "
                             "must be equal; then the data directories the inputs record may differ")
    add_version_option(parser, "ea-fairseq-average-checkpoints")
    args = parser.parse_args(argv)
    need_output_folder("average_checkpoints", "--output", args.output)  # before minutes of averaging
    from ea_fairseq import load_plugin  # fairseq and torch, after the arguments (a fast --help)

    load_plugin()
    import torch

    from ea_fairseq.safety.no_code import CheckpointError
    from ea_fairseq.safety import writers
    from ea_fairseq.tools.average_inputs import InputMismatch, check_dictionaries

    try:
        n = args.num_epoch_checkpoints or args.num_update_checkpoints
        if n is not None:
            if n < 1:
                raise AverageError("--num-*-checkpoints must be at least 1")
            if len(args.inputs) != 1:
                raise AverageError("with --num-*-checkpoints, --inputs takes one directory")
            paths = last_checkpoints(args.inputs[0], n, by_update=args.num_update_checkpoints is not None,
                                     upper_bound=args.checkpoint_upper_bound)
        else:
            if args.checkpoint_upper_bound is not None:
                raise AverageError("--checkpoint-upper-bound needs --num-epoch-checkpoints or "
                                   "--num-update-checkpoints")
            paths = list(args.inputs)
            for path in paths:
                if not os.path.isfile(path):
                    raise AverageError(f"{path}: no such checkpoint file")
        for path in paths:
            if os.path.realpath(path) == os.path.realpath(args.output) or (
                    os.path.exists(args.output) and os.path.samefile(path, args.output)):
                raise AverageError(f"--output {args.output} is one of the inputs ({path}); "
                                   "write the average to another file")
        if args.data_dirs:
            check_dictionaries(paths, args.data_dirs)
        print(f"averaging {len(paths)} checkpoints: {', '.join(paths)}", file=sys.stderr)
        state = average(paths, data_checked=bool(args.data_dirs))
    except (AverageError, InputMismatch, CheckpointError) as err:
        print(f"average_checkpoints: error: {err}", file=sys.stderr)
        return 1
    try:
        with writers.replaced(args.output) as f:  # a new file renamed onto OUTPUT, never through a link
            torch.save(state, f)
    except OSError as err:
        print(f"average_checkpoints: error: --output {args.output}: {err.strerror or err}", file=sys.stderr)
        return 1
    print(f"wrote {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
