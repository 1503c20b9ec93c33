"""``ea-fairseq-options ARCH``: the model options of an architecture, with the values
fairseq-train gives them and their help.

``fairseq-train --arch ARCH --help`` cannot list them: fairseq's parser answers ``--help``
on its first pass, before it adds the options of the chosen arch (and task, criterion,
optimizer, ...), for fairseq's own archs as for the plugin's. This command parses a
command line the way fairseq-train does (``fairseq.options.parse_args_and_arch``, every
fairseq-train option you add taken into account) and prints

* the options the plugin adds, then fairseq's transformer options, each with the value
  fairseq-train would use for ``--arch ARCH`` and the options given (the arch's default,
  or the plugin's where the arch leaves one unset);
* with ``--all``, the whole ``fairseq-train`` help with every option of the arch and of the
  ``--task``, ``--criterion``, ``--optimizer``, ``--lr-scheduler`` given, where
  fairseq-train's own ``--help`` lists only the generic ones.

Under ``fairseq-hydra-train`` the same options are ``model.NAME`` keys, with ``_`` for ``-``
(``--ea-alpha`` is ``model.ea_alpha``).

  ea-fairseq-options                             # the architectures
  ea-fairseq-options ea_transformer_lite         # its model options and values
  ea-fairseq-options ran_d --encoder-attention ea  # the values with an option given
  ea-fairseq-options transformer --all --criterion label_smoothed_cross_entropy | less
"""
import argparse
import os
import sys
from typing import List, Optional, Sequence

from . import add_version_option

PROG = "ea-fairseq-options"


def _error(message: str) -> SystemExit:
    return SystemExit(f"{PROG}: error: {message}")


def _value(value) -> str:
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value))
    return str(value)


def _listing(arch: str, args: argparse.Namespace) -> str:
    """The arch's model options in two groups, each option with its value and help."""
    from fairseq.models import ARCH_MODEL_REGISTRY

    from ea_fairseq.models.hydra_config import option_parser, plugin_option_names

    model_class = ARCH_MODEL_REGISTRY[arch]
    plugin = set(plugin_option_names(model_class))
    formatter = argparse.HelpFormatter(f"fairseq-train --arch {arch}", max_help_position=34)
    groups = {True: [], False: []}
    for action in option_parser(model_class)._actions:
        value = getattr(args, action.dest, None)
        if action.nargs == 0:
            shown = "on" if value else "off"
        else:
            shown = "unset" if value is None else _value(value)
        action = argparse.Action(action.option_strings, action.dest, nargs=action.nargs,
                                 help=f"{action.help or ''} [{shown}]".lstrip(),
                                 metavar=action.metavar, choices=action.choices)
        groups[action.dest in plugin].append(action)
    sections = [(f"the plugin's options of --arch {arch}", groups[True]),
                ("fairseq's transformer options", groups[False])]
    for title, actions in sections:
        if not actions:
            continue
        formatter.start_section(title)
        formatter.add_arguments(actions)
        formatter.end_section()
    return (f"fairseq-train --arch {arch}: model options [the value fairseq-train uses]; under "
            f"fairseq-hydra-train each is model.NAME with '_' for '-' (--ea-alpha: model.ea_alpha)\n"
            + formatter.format_help())


def _architectures() -> str:
    from fairseq.models import ARCH_MODEL_REGISTRY

    from ea_fairseq.models.ea_transformer import EATransformerModel

    plugin = sorted(a for a, m in ARCH_MODEL_REGISTRY.items() if issubclass(m, EATransformerModel))
    return ("architectures of the plugin (ea-fairseq-options ARCH lists one's options):\n  "
            + "\n  ".join(plugin)
            + "\nand every architecture of fairseq (transformer, transformer_iwslt_de_en, ...)")


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:  # its reader stopped early (| head, | less): nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _main(argv: Optional[Sequence[str]]) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("arch", nargs="?", help="the architecture (--arch of fairseq-train); "
                                                "none: list the plugin's")
    parser.add_argument("--arch", "-a", dest="arch_option", metavar="ARCH",
                        help="the same, written as for fairseq-train")
    parser.add_argument("--all", action="store_true",
                        help="print the whole fairseq-train help, with the options of the arch and "
                             "of the --task, --criterion, ... given")
    add_version_option(parser, PROG)
    args, train_options = parser.parse_known_args(argv)
    if args.arch and args.arch_option and args.arch != args.arch_option:
        raise _error(f"two architectures, {args.arch!r} and --arch {args.arch_option!r}: give one")
    args.arch = args.arch or args.arch_option
    from ea_fairseq import load_plugin  # fairseq and torch, after the arguments (a fast --help)

    load_plugin()
    from fairseq import options
    from fairseq.models import ARCH_MODEL_REGISTRY

    from ea_fairseq.errors import did_you_mean

    if args.arch is None:
        print(_architectures())
        return 0
    if args.arch not in ARCH_MODEL_REGISTRY:
        raise _error(f"{args.arch!r} is not an architecture{did_you_mean(args.arch, ARCH_MODEL_REGISTRY)}; "
                     "ea-fairseq-options with no argument lists the plugin's")
    train_parser = options.get_training_parser()
    train_parser.prog = "fairseq-train"

    def one_line(message: str):  # a value fairseq-train refuses: its message, not its usage
        raise _error(message)

    train_parser.error = one_line
    command: List[str] = ["DATA", "--arch", args.arch, *train_options]
    parsed, unknown = options.parse_args_and_arch(train_parser, command, parse_known=True)
    if unknown:
        known = [o for action in train_parser._actions for o in action.option_strings]
        hint = did_you_mean(unknown[0].split("=")[0], known)
        raise _error(f"not options of fairseq-train --arch {args.arch}: {' '.join(unknown)}{hint}")
    if args.all:
        print(train_parser.format_help())
        return 0
    from ea_fairseq.models import attention_variants
    from ea_fairseq.models.ea_transformer import EATransformerModel

    if issubclass(ARCH_MODEL_REGISTRY[args.arch], EATransformerModel):
        attention_variants.fill_defaults(parsed)  # what the model's build_model fills in
    print(_listing(args.arch, parsed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
