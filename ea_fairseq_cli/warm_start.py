"""Start any architecture of the plugin from a trained vanilla fairseq transformer.

  ea-fairseq-warm-start VANILLA.pt --arch ea_transformer_lite --output ea_init.pt \\
      [--seed 1] [options of the new arch, e.g. --ea-alpha 0.5]
  fairseq-train DATA --user-dir ea_fairseq --arch ea_transformer_lite <the vanilla run's
      model options> --finetune-from-model ea_init.pt ...      (or --restore-file ea_init.pt)

The new model takes the vanilla checkpoint's model options (dimensions, layers, heads,
dropout, embedding sharing, ...), the architecture's defaults for its mechanism and the
options given here. Every parameter the two models share is copied; the mechanism's own
parameters (EA's and PA's convolutions, RAN's matrices) are initialised as in training,
from ``--seed``; a report lists what was copied, what is new and what the new model does
not use (RAN replaces the self-attention's query and key projections). Different
dimensions are refused. With the mechanism switched off (e.g. ``--ea-alpha 0 --ea-beta 0``)
the new model computes exactly what the vanilla one does.

The output is a fairseq checkpoint with no optimizer state, at update 0, written once the new
model is built (its folder made, parents included, if missing): fine-tune it with
``--finetune-from-model`` or ``--restore-file`` (the command printed at the end repeats the
model options fairseq-train needs to rebuild the same model), or translate with it directly.
"""
import argparse
import collections
import copy
import os
import re
import shlex
import sys
from types import SimpleNamespace
from typing import Dict, List, NamedTuple, Optional, Sequence

from . import add_version_option
from .inputs import need_creatable_output_folder, need_file

# torch, fairseq and the plugin are imported where they are used: ``--help`` answers without them

# options that decide the shapes or the computation shared with the vanilla model
STRUCTURE = (
    "encoder_embed_dim", "decoder_embed_dim", "encoder_ffn_embed_dim", "decoder_ffn_embed_dim",
    "encoder_layers", "decoder_layers", "encoder_attention_heads", "decoder_attention_heads",
    "decoder_output_dim", "decoder_input_dim", "share_all_embeddings", "share_decoder_input_output_embed",
    "encoder_normalize_before", "decoder_normalize_before", "encoder_learned_pos", "decoder_learned_pos",
    "no_token_positional_embeddings", "layernorm_embedding", "no_scale_embedding", "no_cross_attention",
    "cross_self_attention", "activation_fn", "no_decoder_final_norm", "adaptive_softmax_cutoff",
    "tie_adaptive_weights", "adaptive_input",
)


class WarmStartError(ValueError):
    """A warm start that cannot be done as asked."""


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _model_args(state: dict, path: str) -> argparse.Namespace:
    from fairseq.models import ARCH_MODEL_REGISTRY

    from ea_fairseq.safety.no_code import architecture

    cfg = state.get("cfg")
    args = cfg.get("model") if isinstance(cfg, dict) else state.get("args")
    arch = architecture(args) if isinstance(args, (dict, argparse.Namespace)) else None
    if isinstance(args, dict) and arch in ARCH_MODEL_REGISTRY:  # fairseq-hydra-train's
        from ea_fairseq.models.hydra_config import namespace_from_config

        try:
            args = namespace_from_config(args, ARCH_MODEL_REGISTRY[arch])
        except ValueError as err:
            raise WarmStartError(f"{path}: {err}") from None
    if not isinstance(args, argparse.Namespace) or not arch:
        raise WarmStartError(f"{path}: no model options (an argparse Namespace with an arch) in the "
                             "checkpoint: not a checkpoint of fairseq's transformer")
    args.arch = arch  # the one fairseq builds
    return args


def _check_vanilla(args: argparse.Namespace, path: str) -> None:
    from fairseq.models import ARCH_MODEL_REGISTRY
    from fairseq.models.transformer import TransformerModel

    from ea_fairseq.models import attention_variants as variants
    from ea_fairseq.models.baseline import BaselineTransformerModel

    model = ARCH_MODEL_REGISTRY.get(args.arch)
    mechanism = [r for r in variants.ROLES if variants.variant_of(args, r) != "vanilla"]
    if model not in (TransformerModel, BaselineTransformerModel) or mechanism:
        raise WarmStartError(
            f"{path} is a checkpoint of --arch {args.arch}"
            + (f" with {', '.join(f'--{r}-attention {variants.variant_of(args, r)}' for r in mechanism)}"
               if mechanism else "")
            + "; a warm start takes a vanilla checkpoint of fairseq's transformer "
              "(--arch transformer, transformer_lite, transformer_iwslt_de_en, ...)")


def _parse_new_options(arch: str, options: Sequence[str]) -> argparse.Namespace:
    """The options given for the new model (only those: the arch fills the rest)."""
    from fairseq.models import ARCH_MODEL_REGISTRY

    if arch not in ARCH_MODEL_REGISTRY:
        raise WarmStartError(f"--arch {arch}: not a registered architecture")
    parser = argparse.ArgumentParser(prog=f"warm start --arch {arch}", add_help=False,
                                     argument_default=argparse.SUPPRESS)
    ARCH_MODEL_REGISTRY[arch].add_args(parser)
    given, unknown = parser.parse_known_args(list(options))
    if unknown:
        raise WarmStartError(f"not options of --arch {arch}: {' '.join(unknown)}")
    return given


def _dictionary(size: int):
    """A stand-in dictionary of ``size`` symbols: fairseq's specials and a length, no symbol
    stored per row (a checkpoint's embedding of many one-byte rows costs the build nothing more)."""
    from ea_fairseq.models.building import SizedDictionary

    return SizedDictionary(size)


def _grouped(keys: Sequence[str]) -> List[str]:
    """Keys with layer numbers folded: ``encoder.layers.*.self_attn.conv.weight (x6)``."""
    counts = collections.Counter(re.sub(r"\.layers\.\d+\.", ".layers.*.", k) for k in keys)
    return [f"{k} (x{n})" if n > 1 else k for k, n in counts.items()]


def _words(flag: str, value) -> List[str]:
    if value is True:
        return [flag]
    return [flag, *map(str, value)] if isinstance(value, (list, tuple)) else [flag, str(value)]


def _finetune_command(arch: str, args: argparse.Namespace, given: argparse.Namespace, output: str) -> List[str]:
    """A fairseq-train command line (its words) that rebuilds this model (the options that
    differ from --arch's)."""
    from fairseq import options

    default = options.parse_args_and_arch(options.get_training_parser(), ["DATA", "--arch", arch])
    flags = []
    for name in STRUCTURE:
        value, base = getattr(args, name, None), getattr(default, name, None)
        if name == "share_decoder_input_output_embed" and getattr(args, "share_all_embeddings", False):
            continue  # implied
        if name in ("decoder_output_dim", "decoder_input_dim") and value == args.decoder_embed_dim:
            continue  # fairseq's default
        if value == base or (value in (None, False) and base in (None, False)):
            continue
        flags += _words(_flag(name), value)
    for name, value in vars(given).items():
        if name not in STRUCTURE:
            flags += _words(_flag(name), value)
    return ["fairseq-train", "DATA", "--user-dir", "ea_fairseq", "--arch", arch, *flags,
            "--finetune-from-model", output]


def shell_command(words: Sequence[str]) -> str:
    """``words`` as one shell command line, every word quoted where the shell would read it
    otherwise, then `` ...`` (the rest of the run's options)."""
    return shlex.join(words) + " ..."


class WarmStart(NamedTuple):
    state: dict  # the checkpoint to save
    report: Dict[str, List[str]]  # copied / new / unused (vanilla tensors with no place) -> keys
    finetune: List[str]  # the words of a fairseq-train command that rebuilds this model (OUT.pt: the file)


def warm_start(vanilla_path: str, arch: str, options: Sequence[str] = (), seed: int = 1) -> WarmStart:
    """Start ``arch`` (with ``options``, command-line style) from ``vanilla_path``."""
    import torch
    from fairseq.models import ARCH_CONFIG_REGISTRY, ARCH_MODEL_REGISTRY

    from ea_fairseq.safety.no_code import CheckpointError, load_checkpoint, nonfinite_weights

    try:
        vanilla = load_checkpoint(vanilla_path)
    except CheckpointError as err:
        raise WarmStartError(str(err)) from err
    old_args = _model_args(vanilla, vanilla_path)
    _check_vanilla(old_args, vanilla_path)
    given = _parse_new_options(arch, options)

    args = copy.deepcopy(old_args)
    for name in _plugin_options() & set(vars(args)):  # e.g. a vanilla run's DropAttention
        delattr(args, name)  # (training only): the new arch chooses its own
    args.arch = args._name = arch
    for name, value in vars(given).items():
        setattr(args, name, value)
    ARCH_CONFIG_REGISTRY[arch](args)
    changed = [name for name in STRUCTURE if getattr(args, name, None) != getattr(old_args, name, None)]
    if changed:
        raise WarmStartError(
            "the dimensions differ: " + "; ".join(
                f"{_flag(n)} is {getattr(old_args, n, None)} in {vanilla_path}, {getattr(args, n, None)} "
                f"for the new model" for n in changed)
            + ". A warm start copies the vanilla model into one of the same dimensions: drop "
              "those options, or start from a vanilla model trained with them.")

    weights = vanilla["model"]
    bad = nonfinite_weights(weights)
    if bad:
        raise WarmStartError(f"{vanilla_path} holds NaN or infinite weights in {len(bad)} tensors: "
                             f"{', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}; start from a "
                             "checkpoint of a healthy run")
    src = _dictionary(weights["encoder.embed_tokens.weight"].shape[0])
    tgt = src if args.share_all_embeddings else _dictionary(weights["decoder.embed_tokens.weight"].shape[0])
    torch.manual_seed(seed)  # what fairseq-train --seed does before it builds the model
    try:
        model = ARCH_MODEL_REGISTRY[arch].build_model(args, SimpleNamespace(source_dictionary=src,
                                                                           target_dictionary=tgt))
    except ValueError as err:
        raise WarmStartError(f"--arch {arch} {' '.join(options)}: {err}") from err
    weights = dict(weights)
    model.upgrade_state_dict(weights)  # fairseq's renames of old checkpoints' keys
    mine = model.state_dict()
    mismatched = [f"{k}: {tuple(weights[k].shape)} in {vanilla_path}, {tuple(v.shape)} in the new model"
                  for k, v in mine.items() if k in weights and weights[k].shape != v.shape]
    if mismatched:
        raise WarmStartError("the dimensions differ: " + "; ".join(mismatched[:5])
                             + (f"; and {len(mismatched) - 5} more" if len(mismatched) > 5 else ""))
    report = {"copied": [k for k in mine if k in weights],
              "new": [k for k in mine if k not in weights],
              "unused": [k for k in weights if k not in mine]}
    model.load_state_dict({**mine, **{k: weights[k] for k in report["copied"]}}, strict=True)

    old_optim = (vanilla.get("optimizer_history") or [{}])[-1]
    state = {
        "args": None if vanilla.get("cfg") is not None else args,
        "cfg": None,
        "model": model.state_dict(),
        "optimizer_history": [{"criterion_name": old_optim.get("criterion_name", "CrossEntropyCriterion"),
                               "optimizer_name": old_optim.get("optimizer_name", "Adam"),
                               "lr_scheduler_state": {"best": None}, "num_updates": 0}],
        "task_state": vanilla.get("task_state", {}),
        "extra_state": {"train_iterator": {"epoch": 1, "iterations_in_epoch": 0, "version": 2},
                        "warm_start": {"from": os.path.abspath(vanilla_path), "from_arch": old_args.arch,
                                       **{k: len(v) for k, v in report.items()}}},
    }
    if vanilla.get("cfg") is not None:
        state["cfg"] = dict(vanilla["cfg"], model=args)
    return WarmStart(state, report, _finetune_command(arch, args, given, "OUT.pt"))


def _plugin_options() -> set:
    """Destinations of every model option the plugin adds to fairseq's transformer."""
    from ea_fairseq.models import attention_variants as variants

    parser = argparse.ArgumentParser(add_help=False, argument_default=argparse.SUPPRESS)
    variants.add_args(parser)
    return {action.dest for action in parser._actions}


def format_report(report: Dict[str, List[str]], vanilla_path: str, arch: str) -> str:
    lines = [f"warm start of --arch {arch} from {vanilla_path}:",
             f"  copied from the vanilla model: {len(report['copied'])} tensors"]
    lines.append(f"  new, initialised as in training: {len(report['new'])} tensors"
                 + (":" if report["new"] else ""))
    lines += [f"    {k}" for k in _grouped(report["new"])]
    if report["unused"]:
        lines.append(f"  in the vanilla model, not used by {arch}: {len(report['unused'])} tensors:")
        lines += [f"    {k}" for k in _grouped(report["unused"])]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ea-fairseq-warm-start", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("vanilla", help="checkpoint of a vanilla fairseq transformer")
    parser.add_argument("--arch", required=True, help="architecture of the plugin to start")
    parser.add_argument("--output", required=True, metavar="FILE", help="checkpoint to write")
    parser.add_argument("--seed", type=int, default=1,
                        help="seed for the new parameters (fairseq-train's --seed; default 1)")
    add_version_option(parser, "ea-fairseq-warm-start")
    args, model_options = parser.parse_known_args(argv)
    need_file("warm_start", args.vanilla, "the checkpoint of a vanilla fairseq transformer "
                                         "(e.g. SAVE_DIR/checkpoint_best.pt)")
    need_creatable_output_folder("warm_start", "--output", args.output)  # made once there is a model to write
    from ea_fairseq import load_plugin  # fairseq and torch, after the arguments (a fast --help)

    load_plugin()  # registers the architectures
    import torch

    from ea_fairseq.safety import writers

    try:
        state, report, command = warm_start(args.vanilla, args.arch, model_options, seed=args.seed)
    except (WarmStartError, FileNotFoundError) as err:
        print(f"warm_start: error: {err}", file=sys.stderr)
        return 1
    command = shell_command(command[:-1] + [args.output])
    try:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)  # parents included
        with writers.replaced(args.output) as f:  # a new file renamed onto OUTPUT, never through a link
            torch.save(state, f)
    except OSError as err:
        print(f"warm_start: error: --output {args.output}: {err.strerror or err}", file=sys.stderr)
        return 1
    print(format_report(report, args.vanilla, args.arch))
    print(f"wrote {args.output}; fine-tune it with:\n  {command}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
