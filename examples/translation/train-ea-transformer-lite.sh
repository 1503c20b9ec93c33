#!/usr/bin/env bash
# ea_lite with the papers' settings: bash examples/translation/train-ea-transformer-lite.sh PAIR [fairseq-train args]
# (a shortcut for: bash examples/translation/train.sh ea_lite PAIR ...; see train.sh --help)
exec bash "$(dirname "${BASH_SOURCE[0]}")/train.sh" ea_lite "$@"
