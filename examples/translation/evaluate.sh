#!/usr/bin/env bash
# Average the last checkpoints of a run, translate the test set, and report BLEU, labelled.
#
#   bash examples/translation/evaluate.sh CHECKPOINT_DIR DATA_BIN MODE [options] [-- fairseq-generate args]
#
# MODE
#   iwslt        fairseq tokenized BLEU, from fairseq-generate's own scorer (EA/PA papers'
#                IWSLT'14 De-En numbers; the data is lowercased).
#   wmt14-en-de  compound-split tokenized BLEU (##AT##-##AT##; sacrebleu tokenize=none on the
#                split Moses-tokenized text, i.e. multi-bleu.perl) and detokenized sacreBLEU
#                (sacremoses-detokenized hypotheses vs the raw references, with signature).
#   wmt          other WMT pairs (En-Fr, WMT'17): tokenized BLEU without compound split and
#                detokenized sacreBLEU.
#   fairseq-generate's own BLEU line is reported in every mode, labelled as such, and
#   chrF and chrF++ with their signatures (on the detokenized text where there are raw
#   references, else on the tokenized one).
# Subwords are removed as the data was segmented: SentencePiece when DATA_BIN holds
# sentencepiece.bpe.model (prepare-*.sh --sentencepiece), subword-nmt's @@ otherwise.
#
# CHECKPOINT_DIR holds one run, or one run per seed (seed*/, as SEEDS="1 2 3" train.sh
# makes them): each is scored, then its BLEUs are shown with their mean and deviation
# (ea-fairseq-compare, which also compares systems: README.md, "Seeds").
#
# Options (defaults in brackets; the environment variable of the same role in parentheses)
#   --num-avg N            average the last N checkpoints [10, or all a shorter run has] (NUM_AVG);
#                          1: no averaging, the newest epoch/update checkpoint. A run without
#                          such checkpoints (one shorter than an epoch) stops naming those it has
#   --avg-by epoch|update  checkpointE.pt or checkpoint_E_U.pt [epoch]
#   --checkpoint-upper-bound K   ignore checkpoints after epoch/update K
#   --best                 translate with the run's checkpoint_best.pt (RAN reports it)
#   --checkpoint FILE      translate with FILE instead of averaging (one run only)
#   --beam N [5]  --lenpen X [1.0]
#   --ran-wmt              RAN's WMT decoding: beam 4, length penalty 0.6
#   -s SRC -t TGT          direction (default: the only test.SRC-TGT.* in DATA_BIN)
#   --subset NAME          split to translate [test]
#   --raw-ref FILE         raw references for sacreBLEU [DATA_BIN/test.raw.SRC-TGT.TGT]
#   --out-dir DIR          generate output and scores [CHECKPOINT_DIR/eval]
#   --comet-model PATH     also score with this COMET checkpoint, in the COMET venv
#                          (bash scripts/setup_comet_env.sh; EA_FAIRSEQ_COMET_VENV to move it);
#                          sources: DATA_BIN/SUBSET.raw.SRC-TGT.SRC if present
#   --user-dir DIR         plugin [this repository's ea_fairseq]
#   --max-tokens N [4096]  --cpu
#   --progress S           report the sentences translated so far every S seconds [10]
#   --skip-long            translate the sentences a model accepts and skip longer ones
#                          (RAN's --ran-max-positions), every BLEU saying how many it
#                          covers; without it such a test set stops with the count
# Tools come from PATH: fairseq-generate, python3 (override with FAIRSEQ_GENERATE, PYTHON).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
FAIRSEQ_GENERATE="${FAIRSEQ_GENERATE:-fairseq-generate}"

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
die() { echo "evaluate.sh: error: $*" >&2; exit 1; }
source "$repo/examples/translation/common.sh"  # ea_is_name, ea_shown, ea_direction, ea_write

if [ $# -lt 3 ]; then
  case "${1:-}" in -h|--help) usage; exit 0 ;; esac
  usage >&2; exit 1
fi
ckpt_dir="$1"; data="$2"; mode="$3"; shift 3
all_args=("$@")
case "$mode" in iwslt|wmt14-en-de|wmt) ;; *) die "MODE must be iwslt, wmt14-en-de or wmt (got '$mode')" ;; esac

num_avg="${NUM_AVG:-10}"; num_avg_given="${NUM_AVG:+1}"; avg_by=epoch; upper=""; checkpoint=""; best=""; skip_long=""
beam=5; lenpen=1.0; src=""; tgt=""; subset=test; raw_ref=""; out_dir=""; comet_model=""
user_dir="$repo/ea_fairseq"; max_tokens=4096; cpu=(); extra=(); progress_every=10
while [ $# -gt 0 ]; do
  case "$1" in
    --num-avg) num_avg="$2"; num_avg_given=1; shift 2 ;;
    --avg-by) avg_by="$2"; shift 2 ;;
    --checkpoint-upper-bound) upper="$2"; shift 2 ;;
    --checkpoint) checkpoint="$2"; shift 2 ;;
    --best) best=1; shift ;;
    --skip-long) skip_long=1; shift ;;
    --beam) beam="$2"; shift 2 ;;
    --lenpen) lenpen="$2"; shift 2 ;;
    --ran-wmt) beam=4; lenpen=0.6; shift ;;
    -s|--source-lang) src="$2"; shift 2 ;;
    -t|--target-lang) tgt="$2"; shift 2 ;;
    --subset) subset="$2"; shift 2 ;;
    --raw-ref) raw_ref="$2"; shift 2 ;;
    --out-dir) out_dir="$2"; shift 2 ;;
    --comet-model) comet_model="$2"; shift 2 ;;
    --user-dir) user_dir="$2"; shift 2 ;;
    --max-tokens) max_tokens="$2"; shift 2 ;;
    --cpu) cpu=(--cpu); shift ;;
    --progress) progress_every="$2"; shift 2 ;;
    --) shift; extra=("$@"); break ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown option '$1' (fairseq-generate options go after --)" ;;
  esac
done
case "$avg_by" in epoch|update) ;; *) die "--avg-by must be epoch or update" ;; esac
[[ "$num_avg" =~ ^[1-9][0-9]*$ ]] || die "--num-avg (NUM_AVG) takes a number of checkpoints, not $(ea_shown "$num_avg")"
[ -z "$upper" ] || [[ "$upper" =~ ^[0-9]+$ ]] || die "--checkpoint-upper-bound takes an epoch or update number, not $(ea_shown "$upper")"
ea_is_name "$subset" || die "--subset takes a split name ([A-Za-z0-9_@-]+), not $(ea_shown "$subset")"
for l in "$src" "$tgt"; do
  [ -z "$l" ] || ea_is_name "$l" || die "-s/-t take a language code ([A-Za-z0-9_@-]+), not $(ea_shown "$l")"
done
[ -d "$ckpt_dir" ] || die "checkpoint directory $ckpt_dir not found (train.sh's SAVE_DIR, e.g. checkpoints/ea_lite.iwslt14_de_en)"
[ -d "$data" ] || die "data-bin directory $data not found"
[ -d "$user_dir" ] || die "plugin directory $user_dir not found (--user-dir)"
[ -z "$best" ] || [ -z "$checkpoint" ] || die "--best and --checkpoint: choose one"
[[ "$progress_every" =~ ^[0-9]*\.?[0-9]+$ ]] && [ "$progress_every" != 0 ] \
  || die "--progress takes a number of seconds (got '$progress_every')"
remove_bpe=(--remove-bpe)
if [ -f "$data/sentencepiece.bpe.model" ]; then remove_bpe=(--remove-bpe sentencepiece); fi

# one run per seed: score each, then their mean and deviation
if ! ls "$ckpt_dir"/checkpoint*.pt >/dev/null 2>&1 && ls -d "$ckpt_dir"/seed*/ >/dev/null 2>&1; then
  [ -z "$checkpoint" ] && [ -z "$out_dir" ] \
    || die "$ckpt_dir holds one run per seed: --checkpoint and --out-dir apply to one run"
  mapfile -t seed_dirs < <(for d in "$ckpt_dir"/seed*/; do echo "${d%/}"; done | sort -V)
  for d in "${seed_dirs[@]}"; do
    where=$(ea_inside "$d" "$ckpt_dir") || die "$where: refused, nothing written"
    echo "[evaluate] $d" >&2
    bash "$0" "$d" "$data" "$mode" ${all_args[@]+"${all_args[@]}"} || die "scoring $d failed"
  done
  compare=("$ckpt_dir")
  if [ -n "$src" ] && [ -n "$tgt" ]; then compare+=(-s "$src" -t "$tgt"); fi
  echo
  "$PYTHON" -m ea_fairseq_cli.compare_systems --subset "$subset" "${compare[@]}"
  exit 0
fi

if [ -z "$src" ] || [ -z "$tgt" ]; then
  ea_direction "$data" "$subset" "-s SRC -t TGT"
  src="$ea_src" tgt="$ea_tgt"
fi
# a received run's outputs stay in it: its eval/ (a link planted there included) must resolve
# inside the run; an --out-dir the caller names is theirs
within="${out_dir:-$ckpt_dir}"
out_dir="${out_dir:-$ckpt_dir/eval}"
mkdir -p "$out_dir"
where=$(ea_inside "$out_dir" "$within") \
  || die "$where: refused, nothing written; remove the link or give --out-dir DIR"

if [ -n "$best" ]; then checkpoint="$ckpt_dir/checkpoint_best.pt"; fi
if [ -n "$checkpoint" ]; then
  model="$checkpoint"
  [ -f "$model" ] || die "checkpoint $model not found"
  what="$model"
else
  # a run that stopped before the checkpoints asked for (e.g. before its first epoch ended):
  # one line naming what it does have
  shopt -s nullglob
  have_epoch=("$ckpt_dir"/checkpoint[0-9]*.pt); have_update=("$ckpt_dir"/checkpoint_[0-9]*_[0-9]*.pt)
  shopt -u nullglob
  if [ "$avg_by" = epoch ]; then have=${#have_epoch[@]}; else have=${#have_update[@]}; fi
  if [ "$have" -eq 0 ]; then
    alternatives=()
    if [ "$avg_by" = epoch ] && [ ${#have_update[@]} -gt 0 ]; then
      n=$(( ${#have_update[@]} < num_avg ? ${#have_update[@]} : num_avg ))
      alternatives+=("--avg-by update --num-avg $n (averages its last $n update checkpoints checkpoint_E_U.pt)")
    fi
    if [ "$avg_by" = update ] && [ ${#have_epoch[@]} -gt 0 ]; then
      n=$(( ${#have_epoch[@]} < num_avg ? ${#have_epoch[@]} : num_avg ))
      alternatives+=("--avg-by epoch --num-avg $n")
    fi
    [ ! -f "$ckpt_dir/checkpoint_best.pt" ] || alternatives+=("--best (checkpoint_best.pt)")
    [ ! -f "$ckpt_dir/checkpoint_last.pt" ] || alternatives+=("--checkpoint $(printf '%q' "$ckpt_dir/checkpoint_last.pt")")
    [ ${#alternatives[@]} -gt 0 ] || die "no checkpoints in $ckpt_dir (checkpointE.pt, checkpoint_E_U.pt, checkpoint_best.pt, checkpoint_last.pt)"
    joined=$(printf '%s; or ' "${alternatives[@]}")
    die "no $avg_by checkpoints to average in $ckpt_dir (the run stopped before saving one): evaluate with ${joined%; or }"
  fi
  if [ "$have" -lt "$num_avg" ] && [ -z "$upper" ]; then  # a run shorter than the checkpoints asked for
    [ -z "$num_avg_given" ] \
      || die "--num-avg $num_avg, but $ckpt_dir has $have $avg_by checkpoint(s): evaluate with --num-avg $have"
    echo "[evaluate] $ckpt_dir has $have $avg_by checkpoint(s), fewer than the default $num_avg: averaging" \
         "those $have (--num-avg N chooses)" >&2
    num_avg=$have
  fi
  model="$out_dir/average_last${num_avg}_${avg_by}s${upper:+_upto$upper}.pt"
  opts=(--inputs "$ckpt_dir" "--num-${avg_by}-checkpoints" "$num_avg" --output "$model")
  if [ -n "$upper" ]; then opts+=(--checkpoint-upper-bound "$upper"); fi
  "$PYTHON" -m ea_fairseq_cli.average_checkpoints "${opts[@]}"
  what="average of the last $num_avg $avg_by checkpoints of $ckpt_dir"
fi

gen="$out_dir/generate-$subset.$src-$tgt.txt"
gen_log="$out_dir/generate-$subset.$src-$tgt.log"
skip=()
if [ -n "$skip_long" ]; then skip=(--skip-invalid-size-inputs-valid-test); fi
echo "[evaluate] translating $subset ($src->$tgt) with beam $beam, lenpen $lenpen: $what" >&2
echo "[evaluate] fairseq-generate's output: $gen, its log: $gen_log" >&2
# fairseq-generate writes into a private folder (the progress count reads it as it grows);
# ea_write puts each file in place in $out_dir, never through a link planted there
own=$(mktemp -d)
gen_out="$own/generate.txt" gen_err="$own/generate.log"

# every $1 seconds, how many of the subset's sentences fairseq-generate has written, when it
# changed (the wait is bash's own read -t: no sleep process outlives the loop)
loaded_count() {  # the count of fairseq-generate's "loaded N examples from: .../SUBSET.SRC-TGT.SRC"
  local line
  [ -f "$gen_err" ] || return 0
  while IFS= read -r line; do
    if [[ "$line" == *"/$subset.$src-$tgt.$src" && "$line" =~ loaded\ ([0-9,]+)\ examples\ from:\  ]]; then
      echo "${BASH_REMATCH[1]}"; return 0
    fi
  done < "$gen_err"
}
report_progress() {
  local total="" n shown=""
  exec 3<> <(:)
  while ! read -r -t "$1" -u 3 _; do
    [ -n "$total" ] || total=$(loaded_count)
    [ -n "$total" ] || continue
    n=$(grep -c '^H-' "$gen_out" 2>/dev/null || true)
    [ "${n:-0}" != "$shown" ] || continue
    shown="${n:-0}"
    echo "[evaluate] $shown of $total sentences translated" >&2
  done
}
report_progress "$progress_every" &
progress_pid=$!
trap 'kill "$progress_pid" 2>/dev/null || true; rm -rf "$own"' EXIT
t0=$SECONDS
# --required-batch-size-multiple 1: fairseq (upstream main) drops a last batch smaller than
# it (default 8), i.e. up to 7 test sentences; bleu.py checks none is missing.
# PYTHONUNBUFFERED: hypotheses reach $gen_out as they are made (the progress count reads it).
generated=0
PYTHONUNBUFFERED=1 "$FAIRSEQ_GENERATE" "$data" --user-dir "$user_dir" --path "$model" \
    --source-lang "$src" --target-lang "$tgt" --gen-subset "$subset" \
    --beam "$beam" --lenpen "$lenpen" "${remove_bpe[@]}" --max-tokens "$max_tokens" \
    --required-batch-size-multiple 1 ${skip[@]+"${skip[@]}"} \
    ${cpu[@]+"${cpu[@]}"} ${extra[@]+"${extra[@]}"} > "$gen_out" 2> "$gen_err" || generated=$?
kill "$progress_pid" 2>/dev/null || true
ea_write --within "$within" "$gen" < "$gen_out"
ea_write --within "$within" "$gen_log" < "$gen_err"
if [ "$generated" != 0 ]; then
  limits=$(sed -n 's/.*since max_positions=(\([0-9]*\), \([0-9]*\)).*/\1 \2/p' "$gen_log" | tail -1)
  if [ -n "$limits" ]; then
    read -r max_src max_tgt <<< "$limits"
    counts=$("$PYTHON" -c 'import sys; from ea_fairseq_cli import bleu
s, t = bleu.idx_sizes(sys.argv[1]), bleu.idx_sizes(sys.argv[2])
long = (s > int(sys.argv[3])) | (t > int(sys.argv[4]))
print(int(long.sum()), len(s), " ".join(map(str, long.nonzero()[0][:10])))' \
      "$data/$subset.$src-$tgt.$src.idx" "$data/$subset.$src-$tgt.$tgt.idx" "$max_src" "$max_tgt")
    read -r n_long n_all first_long <<< "$counts"
    die "$n_long of the $n_all $subset sentences are longer than this model accepts
  (max_positions=($max_src, $max_tgt) tokens with </s>, source and target; for RAN, its
  --ran-max-positions): ids $first_long ... Retrain with a larger --ran-max-positions, or
  evaluate with --skip-long to translate the other $((n_all - n_long)) (every BLEU then says so)."
  fi
  if grep -q "ZeroDivisionError" "$gen_log"; then
    die "fairseq-generate translated no sentence of $subset (all skipped as too long?); log: $gen_log"
  fi
  ea_quiet < "$gen_log" | tail -20 >&2
  die "fairseq-generate failed (log: $gen_log)"
fi
echo "[evaluate] $(grep -c '^H-' "$gen" || true) sentences translated in $((SECONDS - t0)) s" >&2

score_opts=(--mode "$mode" --target-lang "$tgt" --out-prefix "$out_dir/$subset.$src-$tgt"
            --expect-idx "$data/$subset.$src-$tgt.$src.idx")
if [ -n "$skip_long" ]; then score_opts+=(--allow-missing); fi
if [ "$mode" != iwslt ]; then
  raw_ref="${raw_ref:-$data/$subset.raw.$src-$tgt.$tgt}"
  [ -f "$raw_ref" ] || die "raw references $raw_ref not found (--raw-ref): detokenized sacreBLEU needs them"
  score_opts+=(--raw-ref "$raw_ref")
fi
if [ -n "$comet_model" ]; then
  score_opts+=(--comet-model "$comet_model" --source-lang "$src")
  raw_src="$data/$subset.raw.$src-$tgt.$src"
  if [ -f "$raw_src" ]; then score_opts+=(--raw-src "$raw_src"); fi
fi
scorer="$PYTHON"
if [ -n "$comet_model" ]; then
  # unbabel-comet needs numpy<2: it lives in its own venv (scripts/setup_comet_env.sh)
  comet_venv="${EA_FAIRSEQ_COMET_VENV:-$repo/.venv-comet}"
  if [ -x "$comet_venv/bin/python" ]; then scorer="$comet_venv/bin/python"; fi
fi
scores="$out_dir/bleu-$subset.$src-$tgt.txt"
status=0
{
  echo "model: $what"
  echo "data: $data ($subset, $src->$tgt), beam $beam, lenpen $lenpen"
  "$scorer" -m ea_fairseq_cli.bleu "$gen" "${score_opts[@]}" || status=$?
} > "$own/scores.txt"
ea_write --within "$within" "$scores" < "$own/scores.txt"
cat "$scores"
# ea-fairseq-bleu exits 3 when BLEU and chrF are scored but COMET could not run (it said why)
if [ "$status" = 3 ]; then
  if [ "$scorer" = "$PYTHON" ]; then
    how="COMET runs in its own venv: bash scripts/setup_comet_env.sh (or EA_FAIRSEQ_COMET_VENV=DIR)"
  else
    how="it ran in the COMET venv $comet_venv"
  fi
  echo "[evaluate] error: COMET not scored (the line above says why; $how); BLEU and chrF are in $scores" >&2
fi
[ "$status" = 0 ] || exit "$status"
