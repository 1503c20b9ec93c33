#!/usr/bin/env bash
# EA's Triton kernels (Eq. 4, ea_ops/triton) against the float64 reference, on
# this CPU under Triton's interpreter (TRITON_INTERPRET=1): installs the `triton` extra into the
# venv where it is missing (triton has no dependencies: the venv's torch stays as it is), then runs
# tests/ops/test_triton_*.py: the full pass's values and gradients (_full_pass), the decoding
# step (_step), the arguments refused and the variants compiled (_guards), the compilation for
# sm_90 and the launches (_registers_and_launches), the torch.library operators under opcheck,
# torch.compile and CUDA graphs (_operators). The
# default suite (scripts/test.sh) skips those files without the interpreter or a GPU.
# Extra arguments go to pytest, e.g. `bash scripts/test_triton.sh -k causal`.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${EA_FAIRSEQ_VENV:-$repo/.venv}"
cd "$repo"
if ! "$venv/bin/python" -c "import triton" 2>/dev/null; then
  "$venv/bin/python" -m pip install --no-deps -c "$repo/constraints.txt" "triton>=3.0"
fi
export PYTHONDONTWRITEBYTECODE=1 TRITON_INTERPRET=1
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider -rs -n 0 "$@" tests/ops/test_triton_*.py
