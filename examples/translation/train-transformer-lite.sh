#!/usr/bin/env bash
# transformer_lite with the papers' settings: bash examples/translation/train-transformer-lite.sh PAIR [fairseq-train args]
# (a shortcut for: bash examples/translation/train.sh transformer_lite PAIR ...; see train.sh --help)
exec bash "$(dirname "${BASH_SOURCE[0]}")/train.sh" transformer_lite "$@"
