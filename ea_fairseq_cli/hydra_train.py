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
sees the command line (hydra's own ``--version`` names hydra's alone).
"""
import sys

from . import exit_on_version

PROG = "ea-fairseq-hydra-train"


def main() -> None:
    exit_on_version(sys.argv[1:], PROG, also=["hydra-core"])  # before hydra reads it (its --version: hydra's alone)
    sys.argv[0] = PROG  # (the name the plugin's one-line errors begin with; hydra's --help shows it)
    import ea_fairseq  # noqa: F401  (loads the plugin: its warning filters, its one-line errors)
    from fairseq_cli.hydra_train import cli_main

    cli_main()


if __name__ == "__main__":
    main()
