"""``ea-fairseq-hydra-train`` (``python -m ea_fairseq_cli.hydra_train``): ``fairseq-hydra-train``,
its arguments and run unchanged, without the warnings fairseq's stack prints before the plugin
is loaded.

``fairseq-hydra-train`` loads the plugin only when hydra has composed the configuration (the
configs' callback, ``common.user_dir``). Before that, importing ``fairseq_cli.hydra_train``
makes hydra warn that ``version_base`` is not specified (its ``@hydra.main``), composing
warns twice that the config is validated against fairseq's schema of the same name, and
hydra logs two ``DEBUG`` lines because fairseq's import sets the root logger to DEBUG: some
18 lines before the run's first, none about the run. This command loads the plugin first,
which, in a process running a command line it serves, filters exactly those
(:mod:`ea_fairseq.known_warnings`; ``EA_FAIRSEQ_SHOW_WARNINGS=1`` shows them), then runs
fairseq's own ``cli_main``; everything else, errors included, is ``fairseq-hydra-train``'s, but
``--version``, which prints the plugin's version with fairseq's, torch's and hydra's before hydra
sees the command line (hydra's own ``--version`` names hydra's alone), and a ``--config-name``
that no config folder holds: fairseq stores its schema in hydra's config store under whatever
name is given, so hydra finds "the config", writes ``outputs/DATE/TIME/`` and fails on the
schema's defaults (``Must specify batch size``) without saying the file was never read; here
it is one line naming the closest config, before anything is written.
"""
import argparse
import importlib.util
import os
import sys
from typing import Optional, Sequence

from . import exit_on_version

PROG = "ea-fairseq-hydra-train"


def missing_config(argv: Sequence[str]) -> Optional[str]:
    """The error line for a ``--config-name`` that neither ``--config-dir`` nor fairseq's own
    config folder holds (a ``--config-path`` of one's own: hydra's to find), or None."""
    parser = argparse.ArgumentParser(add_help=False)
    for option in ("--config-name", "-cn"), ("--config-dir", "-cd"), ("--config-path", "-cp"):
        parser.add_argument(*option)
    given, _ = parser.parse_known_args(argv)
    if given.config_name is None or given.config_path is not None:
        return None
    name = given.config_name[:-len(".yaml")] if given.config_name.endswith(".yaml") else given.config_name
    fairseq = importlib.util.find_spec("fairseq").submodule_search_locations[0]
    folders = [f for f in (given.config_dir, os.path.join(fairseq, "config")) if f]
    if any(os.path.isfile(os.path.join(folder, f"{name}.yaml")) for folder in folders):
        return None
    from ea_fairseq.errors import did_you_mean

    names = [n[:-len(".yaml")] for n in (os.listdir(folders[0]) if os.path.isdir(folders[0]) else [])
             if n.endswith(".yaml")]
    return (f"{PROG}: error: --config-name {given.config_name}: no {name}.yaml in {folders[0]}"
            f"{did_you_mean(name, names)}; hydra would run fairseq's defaults instead")


def main() -> None:
    exit_on_version(sys.argv[1:], PROG, also=["hydra-core"])  # before hydra reads it (its --version: hydra's alone)
    refused = missing_config(sys.argv[1:])
    if refused:
        print(refused, file=sys.stderr)
        raise SystemExit(2)
    sys.argv[0] = PROG  # (the name the plugin's one-line errors begin with; hydra's --help shows it)
    import ea_fairseq  # noqa: F401  (loads the plugin: its warning filters, its one-line errors)
    from fairseq_cli.hydra_train import cli_main

    cli_main()


if __name__ == "__main__":
    main()
