#!/usr/bin/env bash
# pa_lite with the papers' settings: bash examples/translation/train-pa-transformer-lite.sh PAIR [fairseq-train args]
# (a shortcut for: bash examples/translation/train.sh pa_lite PAIR ...; see train.sh --help)
exec bash "$(dirname "${BASH_SOURCE[0]}")/train.sh" pa_lite "$@"
