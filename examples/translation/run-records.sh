# shellcheck shell=bash
# train.sh's run hygiene: the records it keeps in SAVE_DIR (train.settings, the resolved
# settings; train.command, every command that trained there; a copy of the data's subword
# model) and the check of train.settings before it resumes checkpoint_last.pt or trains anew
# over other checkpoints (a larger MAX_EPOCH or MAX_UPDATE alone resumes; other settings stop
# it unless ALLOW_CHANGED_SETTINGS=1). Sourced by train.sh, not run: its functions read
# train.sh's variables (SAVE_DIR, DATA, settings, eval_hint, cmd, ...) and stop through its die.

# budget_grows RECORDED NEW: the settings differ only in --max-epoch / --max-update, and
# neither limit is lower than before (none: no limit); prints the change
budget_grows() {
  local budget='^--(max-epoch|max-update) ' key old new changes=()
  [ "$(grep -Ev "$budget" <<< "$1" || true)" = "$(grep -Ev "$budget" <<< "$2" || true)" ] || return 1
  for key in max-epoch max-update; do
    old=$(sed -n "s/^--$key //p" <<< "$1"); new=$(sed -n "s/^--$key //p" <<< "$2")
    [ "$old" != "$new" ] || continue
    if [ -z "$old" ] || { [ -n "$new" ] && [ "$new" -lt "$old" ]; }; then return 1; fi
    changes+=("--$key ${old} -> ${new:-no limit}")
  done
  [ ${#changes[@]} -gt 0 ] || return 1
  (IFS=,; echo "${changes[*]}")
}

# settings_changes RECORDED NEW: the lines that differ, on one line ("was: A; B, now: C")
settings_changes() {
  local was now
  was=$(diff <(echo "$1") <(echo "$2") | sed -n 's/^< //p' | paste -sd';' - | sed 's/;/; /g' || true)
  now=$(diff <(echo "$1") <(echo "$2") | sed -n 's/^> //p' | paste -sd';' - | sed 's/;/; /g' || true)
  echo "was: ${was:-nothing}, now: ${now:-nothing}"
}

# check_save_dir RECORD: SAVE_DIR's checkpoints are resumed, or trained over, only where RECORD
# (its train.settings) holds these $settings or the budget alone grows; otherwise it stops
# (ALLOW_CHANGED_SETTINGS=1: it goes on, and RECORD is kept as RECORD.before-DATE)
check_save_dir() {
  local record="$1" problem grown earlier
  if [ -f "$SAVE_DIR/checkpoint_last.pt" ]; then
    if [ ! -f "$record" ]; then
      problem="its checkpoints have no record of the settings they were trained with ($record)"
    elif grown=$(budget_grows "$(grep -v '^#' "$record")" "$settings"); then
      problem=""
      echo "[train] resuming $SAVE_DIR/checkpoint_last.pt with a larger budget: $grown (other settings the same)" >&2
    elif [ "$(grep -v '^#' "$record")" != "$settings" ]; then
      problem="its checkpoints were trained with other settings:
$(diff <(grep -v '^#' "$record") <(echo "$settings") | grep '^[<>]' | sed 's/^</  was:/; s/^>/  now:/' || true)"
    else
      problem=""
      echo "[train] resuming $SAVE_DIR/checkpoint_last.pt (same settings)" >&2
    fi
    if [ -n "$problem" ]; then
      is_on "${ALLOW_CHANGED_SETTINGS:-}" \
        || die "not resuming $SAVE_DIR: $problem
  Train into another directory (SAVE_DIR=...), or resume with these settings anyway:
  ALLOW_CHANGED_SETTINGS=1"
      echo "[train] ALLOW_CHANGED_SETTINGS=1: resuming $SAVE_DIR with changed settings" >&2
      [ ! -f "$record" ] || mv "$record" "$record.before-$(date +%Y%m%d-%H%M%S)"
    fi
  elif earlier=$(cd "$SAVE_DIR" && ls -d checkpoint*.pt 2>/dev/null) && [ -n "$earlier" ]; then
    # checkpoints but no checkpoint_last.pt: fairseq-train starts anew and overwrites them
    # (checkpoint_best.pt, checkpointE.pt, ...), so another run's are not trained over silently
    earlier=$(head -3 <<< "$earlier" | paste -sd, - | sed 's/,/, /g')$([ "$(wc -l <<< "$earlier")" -le 3 ] || echo ", ...")
    if [ ! -f "$record" ]; then
      problem="its checkpoints ($earlier) have no record of their settings ($record)"
    elif [ "$(grep -v '^#' "$record")" != "$settings" ]; then
      problem="its checkpoints ($earlier) were trained with other settings ($(settings_changes "$(grep -v '^#' "$record")" "$settings"))"
    else
      problem=""
    fi
    if [ -n "$problem" ]; then
      is_on "${ALLOW_CHANGED_SETTINGS:-}" \
        || die "not training in $SAVE_DIR: $problem, and with no checkpoint_last.pt to resume fairseq-train would start anew and overwrite them; train into another directory (SAVE_DIR=...), or over them: ALLOW_CHANGED_SETTINGS=1"
      echo "[train] ALLOW_CHANGED_SETTINGS=1: training anew in $SAVE_DIR over checkpoints of other settings" >&2
      [ ! -f "$record" ] || mv "$record" "$record.before-$(date +%Y%m%d-%H%M%S)"
    fi
  fi
}

# write_run_records RECORD: the settings into RECORD, the command appended to train.command,
# the data's subword model copied
write_run_records() {
  local record="$1" f
  # ea_write: never through a link planted under these names in a received SAVE_DIR
  {
    echo "# resolved settings of the run in this directory (train.sh compares them before resuming)"
    echo "# evaluate with: $eval_hint"
    echo "$settings"
  } | ea_write "$record"
  {
    echo "# $(date '+%Y-%m-%d %H:%M:%S') on $(hostname): $devices_text, $precision"
    printf 'cd %q && ' "$PWD"
    if [ ${#caller_env[@]} -gt 0 ]; then printf '%q ' "${caller_env[@]}"; fi
    printf 'bash %q %q %q' "$0" "$family" "$pair"
    if [ ${#extra[@]} -gt 0 ]; then printf ' %q' "${extra[@]}"; fi
    echo
    printf '%q ' "${cmd[@]}"; echo
  } | ea_write --append "$SAVE_DIR/train.command"
  for f in code sentencepiece.bpe.model; do  # the data's subword model, where fairseq's hub looks
    # read as a received file (--from): a link out of DATA is refused, never copied into SAVE_DIR
    if [ -f "$DATA/$f" ]; then ea_write --from "$DATA/$f" "$SAVE_DIR/$f"; fi
  done
}
