#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment with the tested, pinned set of
# packages (constraints.txt), install ea_fairseq (and ea_ops, EA's operation) into it in
# editable mode with its test, recipe, analysis and corpus extras (pyproject.toml) and the
# console tools, and build EA's CPU backend (python -m ea_ops.build).
#
#   bash scripts/setup_env.sh            # -> .venv/ next to this repo
#   EA_FAIRSEQ_VENV=/path/venv bash scripts/setup_env.sh
#
# Idempotent: a venv whose stamp matches constraints.txt + pyproject.toml is reused as is.
# torch is installed first, pinned, and every later pip call is constrained to that
# exact version, so pip can never swap it for a (multi-GB) CUDA build on its own.
# Set TORCH_INDEX_URL (e.g. https://download.pytorch.org/whl/cpu) on machines where
# the pinned CPU wheel is not available locally.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${EA_FAIRSEQ_VENV:-$repo/.venv}"
python="${PYTHON:-python3}"
stamp="$venv/.ea_fairseq_stamp"
want="$(cat "$repo/constraints.txt" "$repo/pyproject.toml" | sha256sum | cut -d' ' -f1)"

# The stamp is written only after the finished environment imported torch, fairseq and
# ea_fairseq (below). While nothing was installed into it since (site-packages not changed
# after the stamp), reuse needs no import; otherwise the import is checked again (it costs
# seconds: fairseq imports scikit-learn and scipy) and a broken environment is rebuilt.
site=("$venv"/lib/python3*/site-packages)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] \
   && { [ "$stamp" -nt "${site[0]}" ] || { "$venv/bin/python" -c "import torch, fairseq, ea_fairseq" 2>/dev/null && touch "$stamp"; }; }; then
  echo "[setup] environment up to date: $venv" >&2
  exit 0
fi

"$python" - <<'PY'
import sys
if sys.version_info[:2] != (3, 11):
    sys.exit(f"[setup] ea_fairseq's pinned environment targets Python 3.11; found {sys.version.split()[0]}. "
             "Set PYTHON=/path/to/python3.11 and run again.")
PY

echo "[setup] creating $venv" >&2
"$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
torch_pin="$(grep -E '^torch==' "$repo/constraints.txt")"
constraints="$repo/constraints.txt"  # torch pinned there too: no later pip call can swap it
extra=()
if [ -n "${TORCH_INDEX_URL:-}" ]; then extra=(--extra-index-url "$TORCH_INDEX_URL"); fi

echo "[setup] installing $torch_pin" >&2
# under the constraints as every later call: torch's own requirements (sympy, networkx, ...) pinned too
"${pip[@]}" install -q "${extra[@]}" -c "$constraints" "$torch_pin"
echo "[setup] installing fairseq and ea_fairseq[test,corpus] (editable) under constraints.txt" >&2
"${pip[@]}" install -q "${extra[@]}" -c "$constraints" setuptools
"${pip[@]}" install -q "${extra[@]}" -c "$constraints" --no-build-isolation \
  ve-fairseq -e "$repo[test,corpus]"
"$venv/bin/python" - <<'PY'
import torch, fairseq, ea_fairseq
print(f"[setup] torch {torch.__version__} (cuda: {torch.version.cuda}), fairseq {fairseq.__version__}, "
      f"ea_fairseq {ea_fairseq.__version__}")
PY
# EA's CPU backend (C++), built ahead; without a compiler the PyTorch reference runs (said once per run)
"$venv/bin/python" -m ea_ops.build || echo "[setup] EA's CPU backend not built: the PyTorch reference runs" >&2
echo "$want" > "$stamp"
