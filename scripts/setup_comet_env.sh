#!/usr/bin/env bash
# Create (or reuse) the venv for COMET scores: ea_fairseq with its `comet` extra under
# constraints-comet.txt (unbabel-comet needs numpy<2, so it cannot share .venv; see that file).
#
#   bash scripts/setup_comet_env.sh             # -> .venv-comet/ next to this repo
#   EA_FAIRSEQ_COMET_VENV=/path/venv bash scripts/setup_comet_env.sh
#   .venv-comet/bin/ea-fairseq-bleu OUT --mode wmt ... --comet-model PATH/checkpoints/model.ckpt
#
# Set TORCH_INDEX_URL (e.g. https://download.pytorch.org/whl/cpu) where the pinned CPU wheel
# is not available locally.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${EA_FAIRSEQ_COMET_VENV:-$repo/.venv-comet}"
python="${PYTHON:-python3}"
stamp="$venv/.ea_fairseq_stamp"
want="$(cat "$repo/constraints-comet.txt" "$repo/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$venv/bin/python" -W ignore -c "import comet" 2>/dev/null; then
  echo "[setup-comet] environment up to date: $venv" >&2
  exit 0
fi
extra=()
if [ -n "${TORCH_INDEX_URL:-}" ]; then extra=(--extra-index-url "$TORCH_INDEX_URL"); fi
"$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
"${pip[@]}" install -q "${extra[@]}" "$(grep -E '^torch==' "$repo/constraints-comet.txt")"
"${pip[@]}" install -q "${extra[@]}" -c "$repo/constraints-comet.txt" setuptools -e "$repo[comet]"
"$venv/bin/python" -W ignore -c "import comet, numpy, torch; print(f'[setup-comet] unbabel-comet imports: numpy {numpy.__version__}, torch {torch.__version__}')"
echo "$want" > "$stamp"
