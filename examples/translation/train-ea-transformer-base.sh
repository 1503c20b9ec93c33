#!/usr/bin/env bash
# ea_base with the papers' settings: bash examples/translation/train-ea-transformer-base.sh PAIR [fairseq-train args]
# (a shortcut for: bash examples/translation/train.sh ea_base PAIR ...; see train.sh --help)
exec bash "$(dirname "${BASH_SOURCE[0]}")/train.sh" ea_base "$@"
