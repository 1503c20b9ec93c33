#!/usr/bin/env bash
# fairseq-hydra-train with one of the recipe configs (examples/translation/config), the known
# warnings of fairseq's stack left out of its output (hydra's deprecation warnings and DEBUG
# lines, torch's FutureWarnings: common.sh, ea_quiet; EA_FAIRSEQ_SHOW_WARNINGS=1 shows them):
#
#   bash examples/translation/hydra-train.sh CONFIG_NAME [hydra overrides ...]
#
# runs  fairseq-hydra-train --config-dir examples/translation/config --config-name CONFIG_NAME
# [overrides ...]  (FAIRSEQ_HYDRA_TRAIN: the command, fairseq-hydra-train from PATH). A config
# the run cannot start with stops it before anything is written, in one line naming the
# override to change (ea_fairseq/hydra_checks.py).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/common.sh"  # ea_is_name, ea_shown, ea_quiet
die() { echo "hydra-train.sh: error: $*" >&2; exit 1; }
case "${1:-}" in
  ""|-h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; [ -n "${1:-}" ] || exit 1; exit 0 ;;
esac
name="$1"; shift
ea_is_name "$name" && [ -f "$here/config/$name.yaml" ] \
  || die "no config $(ea_shown "$name") in $here/config (its *.yaml files, without .yaml)"
set +e
{ "${FAIRSEQ_HYDRA_TRAIN:-fairseq-hydra-train}" --config-dir "$here/config" --config-name "$name" "$@" \
    2>&1 1>&3 3>&- | ea_quiet >&2 3>&-; status=${PIPESTATUS[0]}; } 3>&1
exit "$status"
