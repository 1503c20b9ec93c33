#!/usr/bin/env bash
# RAN with the paper's settings: bash examples/translation/train-ran.sh VARIANT PAIR [fairseq-train args]
# VARIANT: e, d, all (Transformer-Base dims) or e_lite, d_lite, all_lite.
# (a shortcut for: bash examples/translation/train.sh ran_VARIANT PAIR ...; see train.sh --help)
if [ $# -lt 2 ]; then echo "usage: $0 {e|d|all}[_lite] PAIR [fairseq-train args]" >&2; exit 1; fi
variant="$1"; shift
exec bash "$(dirname "${BASH_SOURCE[0]}")/train.sh" "ran_$variant" "$@"
