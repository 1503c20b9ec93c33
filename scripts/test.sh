#!/usr/bin/env bash
# Set up the pinned environment (idempotent; from scratch on a fresh clone) and run the
# test suite. Extra arguments go to pytest, e.g. `bash scripts/test.sh -k causal`.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$repo/scripts/setup_env.sh"
venv="${EA_FAIRSEQ_VENV:-$repo/.venv}"
cd "$repo"
export PYTHONDONTWRITEBYTECODE=1
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider "$@" tests
