#!/usr/bin/env python3
"""fairseq-preprocess, several runs in one process (importing fairseq is most of its cost).

  python examples/translation/binarize.py FAIRSEQ_PREPROCESS_ARGS [--- FAIRSEQ_PREPROCESS_ARGS ...]

Each run takes exactly the options of ``fairseq-preprocess`` and writes what it writes.
"""
import sys


def main(argv) -> int:
    from fairseq import options
    from fairseq_cli import preprocess

    runs, current = [], []
    for arg in argv:
        if arg == "---":
            runs.append(current)
            current = []
        else:
            current.append(arg)
    runs.append(current)
    for run in runs:
        args = options.get_preprocessing_parser().parse_args(run)
        before = list(preprocess.logger.handlers)
        try:
            preprocess.main(args)
        finally:  # each run logs to its own DESTDIR/preprocess.log only
            for handler in list(preprocess.logger.handlers):
                if handler not in before:
                    preprocess.logger.removeHandler(handler)
                    handler.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
