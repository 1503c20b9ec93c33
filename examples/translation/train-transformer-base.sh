#!/usr/bin/env bash
# transformer_base with the papers' settings: bash examples/translation/train-transformer-base.sh PAIR [fairseq-train args]
# (a shortcut for: bash examples/translation/train.sh transformer_base PAIR ...; see train.sh --help)
exec bash "$(dirname "${BASH_SOURCE[0]}")/train.sh" transformer_base "$@"
