#!/usr/bin/env bash
# Average the last checkpoints of a run, translate the test set, and report BLEU, labelled.
#
#   bash scripts/evaluate.sh CHECKPOINT_DIR DATA_BIN MODE [options] [-- fairseq-generate args]
#
# MODE
#   iwslt        fairseq tokenized BLEU, from fairseq-generate's own scorer (EA/PA papers'
#                IWSLT'14 De-En numbers; the data is lowercased).
#   wmt14-en-de  compound-split tokenized BLEU (##AT##-##AT##; sacrebleu tokenize=none on the
#                split Moses-tokenized text, i.e. multi-bleu.perl) and detokenized sacreBLEU
#                (sacremoses-detokenized hypotheses vs the raw references, with signature).
#   wmt          other WMT pairs (En-Fr, WMT'17): tokenized BLEU without compound split and
#                detokenized sacreBLEU.
#   fairseq-generate's own BLEU line is reported in every mode, labelled as such.
#
# Options (defaults in brackets; the environment variable of the same role in parentheses)
#   --num-avg N            average the last N checkpoints [10] (NUM_AVG); 1: no averaging,
#                          the newest epoch/update checkpoint
#   --avg-by epoch|update  checkpointE.pt or checkpoint_E_U.pt [epoch]
#   --checkpoint-upper-bound K   ignore checkpoints after epoch/update K
#   --checkpoint FILE      translate with FILE (e.g. CHECKPOINT_DIR/checkpoint_best.pt, as RAN
#                          reports) instead of averaging
#   --beam N [5]  --lenpen X [1.0]
#   --ran-wmt              RAN's WMT decoding: beam 4, length penalty 0.6
#   -s SRC -t TGT          direction (default: the only test.SRC-TGT.* in DATA_BIN)
#   --subset NAME          split to translate [test]
#   --raw-ref FILE         raw references for sacreBLEU [DATA_BIN/test.raw.SRC-TGT.TGT]
#   --out-dir DIR          generate output and scores [CHECKPOINT_DIR/eval]
#   --user-dir DIR         plugin [this repository's ea_fairseq]
#   --max-tokens N [4096]  --cpu
# Tools come from PATH: fairseq-generate, python3 (override with FAIRSEQ_GENERATE, PYTHON).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
FAIRSEQ_GENERATE="${FAIRSEQ_GENERATE:-fairseq-generate}"

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
die() { echo "evaluate.sh: error: $*" >&2; exit 1; }

if [ $# -lt 3 ]; then
  case "${1:-}" in -h|--help) usage; exit 0 ;; esac
  usage >&2; exit 1
fi
ckpt_dir="$1"; data="$2"; mode="$3"; shift 3
case "$mode" in iwslt|wmt14-en-de|wmt) ;; *) die "MODE must be iwslt, wmt14-en-de or wmt (got '$mode')" ;; esac

num_avg="${NUM_AVG:-10}"; avg_by=epoch; upper=""; checkpoint=""
beam=5; lenpen=1.0; src=""; tgt=""; subset=test; raw_ref=""; out_dir=""
user_dir="$repo/ea_fairseq"; max_tokens=4096; cpu=(); extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --num-avg) num_avg="$2"; shift 2 ;;
    --avg-by) avg_by="$2"; shift 2 ;;
    --checkpoint-upper-bound) upper="$2"; shift 2 ;;
    --checkpoint) checkpoint="$2"; shift 2 ;;
    --beam) beam="$2"; shift 2 ;;
    --lenpen) lenpen="$2"; shift 2 ;;
    --ran-wmt) beam=4; lenpen=0.6; shift ;;
    -s|--source-lang) src="$2"; shift 2 ;;
    -t|--target-lang) tgt="$2"; shift 2 ;;
    --subset) subset="$2"; shift 2 ;;
    --raw-ref) raw_ref="$2"; shift 2 ;;
    --out-dir) out_dir="$2"; shift 2 ;;
    --user-dir) user_dir="$2"; shift 2 ;;
    --max-tokens) max_tokens="$2"; shift 2 ;;
    --cpu) cpu=(--cpu); shift ;;
    --) shift; extra=("$@"); break ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown option '$1' (fairseq-generate options go after --)" ;;
  esac
done
case "$avg_by" in epoch|update) ;; *) die "--avg-by must be epoch or update" ;; esac
[ -d "$data" ] || die "data-bin directory $data not found"
[ -d "$user_dir" ] || die "plugin directory $user_dir not found (--user-dir)"

if [ -z "$src" ] || [ -z "$tgt" ]; then
  pairs=$(ls "$data" | sed -n "s/^$subset\.\([^.]*\)-\([^.]*\)\.\1\.idx$/\1 \2/p" | sort -u)
  [ -n "$pairs" ] || die "no $subset.SRC-TGT.SRC.idx in $data"
  [ "$(echo "$pairs" | wc -l)" -eq 1 ] || die "$data holds several directions ($(echo $pairs)): give -s SRC -t TGT"
  read -r src tgt <<< "$pairs"
fi
out_dir="${out_dir:-$ckpt_dir/eval}"
mkdir -p "$out_dir"

if [ -n "$checkpoint" ]; then
  model="$checkpoint"
  [ -f "$model" ] || die "checkpoint $model not found"
  what="$model"
else
  model="$out_dir/average_last${num_avg}_${avg_by}s${upper:+_upto$upper}.pt"
  opts=(--inputs "$ckpt_dir" "--num-${avg_by}-checkpoints" "$num_avg" --output "$model")
  if [ -n "$upper" ]; then opts+=(--checkpoint-upper-bound "$upper"); fi
  "$PYTHON" "$repo/scripts/average_checkpoints.py" "${opts[@]}"
  what="average of the last $num_avg $avg_by checkpoints of $ckpt_dir"
fi

gen="$out_dir/generate-$subset.$src-$tgt.txt"
echo "[evaluate] translating $subset ($src->$tgt) with beam $beam, lenpen $lenpen: $what" >&2
"$FAIRSEQ_GENERATE" "$data" --user-dir "$user_dir" --path "$model" \
  --source-lang "$src" --target-lang "$tgt" --gen-subset "$subset" \
  --beam "$beam" --lenpen "$lenpen" --remove-bpe --max-tokens "$max_tokens" \
  --required-batch-size-multiple 1 \
  ${cpu[@]+"${cpu[@]}"} ${extra[@]+"${extra[@]}"} > "$gen"

# fairseq (upstream main) drops a last batch smaller than --required-batch-size-multiple
# (default 8), i.e. up to 7 test sentences, hence the option above and this check.
score_opts=(--mode "$mode" --target-lang "$tgt" --out-prefix "$out_dir/$subset.$src-$tgt"
            --expect-idx "$data/$subset.$src-$tgt.$src.idx")
if [ "$mode" != iwslt ]; then
  raw_ref="${raw_ref:-$data/$subset.raw.$src-$tgt.$tgt}"
  [ -f "$raw_ref" ] || die "raw references $raw_ref not found (--raw-ref): detokenized sacreBLEU needs them"
  score_opts+=(--raw-ref "$raw_ref")
fi
scores="$out_dir/bleu-$subset.$src-$tgt.txt"
{
  echo "model: $what"
  echo "data: $data ($subset, $src->$tgt), beam $beam, lenpen $lenpen"
  "$PYTHON" "$repo/scripts/bleu.py" "$gen" "${score_opts[@]}"
} > "$scores"
cat "$scores"
