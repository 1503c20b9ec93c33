#!/usr/bin/env bash
# Set up the pinned environment (idempotent; from scratch on a fresh clone) and run the
# test suite, then the exactness tests once more with every mechanism's PyTorch reference
# alone (EA_FAIRSEQ_ACCELERATORS=0: no accelerator, as on a device none is registered for).
# Extra arguments go to both pytest runs, e.g. `bash scripts/test.sh -k causal`.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$repo/scripts/setup_env.sh"
venv="${EA_FAIRSEQ_VENV:-$repo/.venv}"
cd "$repo"
export PYTHONDONTWRITEBYTECODE=1
"$venv/bin/python" -m pytest -q -p no:cacheprovider -rs "$@" tests
echo "[test] the exactness tests with the reference implementations alone" >&2
EA_FAIRSEQ_ACCELERATORS=0 "$venv/bin/python" -m pytest -q -p no:cacheprovider "$@" \
  tests/test_ea_exactness.py tests/test_ea_model.py tests/test_pa.py tests/test_ran.py \
  tests/test_drop_attention.py tests/test_precision.py
