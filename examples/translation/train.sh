#!/usr/bin/env bash
# Train one cell of the papers' translation tables with the papers' hyper-parameters.
#
#   bash examples/translation/train.sh FAMILY PAIR [fairseq-train args ...]
#
# FAMILY  transformer_lite ea_lite pa_lite        Transformer-Lite, EA-/PA-Transformer-Lite
#         transformer_base ea_base                Transformer-Base, EA-Transformer-Base
#         ran_e ran_d ran_all                     RAN (Transformer-Base dims)
#         ran_e_lite ran_d_lite ran_all_lite      RAN with Transformer-Lite dims
# PAIR    iwslt14_de_en wmt14_en_de wmt14_en_fr
#         wmt17_en_lv wmt17_lv_en wmt17_en_fi wmt17_fi_en wmt17_en_tr wmt17_tr_en
#
# Every value below can be overridden with the environment variable in capitals, and any
# fairseq-train option given after PAIR is passed through last (so it wins):
#   DATA SAVE_DIR LR DROPOUT ATTN_DROPOUT EA_ALPHA EA_BETA PA_ALPHA WARMUP LABEL_SMOOTHING
#   MAX_TOKENS MAX_UPDATE MAX_EPOCH PATIENCE KEEP_LAST_EPOCHS SEED
#   NGPUS: devices (GPUs, or CPU processes with CPU=1) over all nodes [all visible GPUs;
#   0 = one CPU process]; UPDATE_FREQ [the paper's GPUs x accumulation / NGPUS, e.g.
#   8 x 16 / 2 = 64; when NGPUS exceeds the paper's GPUs, MAX_TOKENS is divided instead]
#   CPU=1: train on CPU processes (--cpu); LAUNCHER: a command that starts the processes,
#   e.g. LAUNCHER="torchrun --nnodes 2 --nproc_per_node 8 ..." (README.md, multi-node)
#   DROP_ATTENTION=column|element DROP_ATTENTION_P DROP_ATTENTION_WINDOW (DropAttention, on
#   any family, transformer_* included; paper's best for WMT En-De: element, p 0.2, window 2)
#   USER_DIR (this repository's ea_fairseq)  FAIRSEQ_TRAIN (fairseq-train)
#   DRY_RUN=1 prints the command instead of running it.
#
# Where the defaults come from (see README.md for the full table):
#   all: Adam (0.9, 0.98), inverse_sqrt with 4000 warm-up updates, label smoothing 0.1
#   EA/Transformer Lite+Base: lr 1e-3; dropout 0.2 De-En / 0.3 En-De / 0.1 En-Fr; 1 GPU for
#     De-En, 8 GPUs x 16 accumulation for En-De and En-Fr; alpha 0.1 (Lite) / 0.5 (Base),
#     beta 0.1; early stopping with patience 5 (EA Table 10, Appendix A.3)
#   PA-Lite (IWSLT'14 De-En only): lr 5e-4, dropout 0.2, alpha 0.1, patience 5 (PA §4.1.1,
#     Appendix B.2.1)
#   RAN on WMT: residual dropout 0.1, attention dropout 0.2 (not on En-Fr), 250k updates on
#     WMT'14, 150k on WMT'17, 8 GPUs (2 for En-Tr), best checkpoint on valid (RAN Settings);
#     lr 7e-4 and 4096 tokens per GPU are not in the paper (fairseq's usual Base values)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
die() { echo "train.sh: error: $*" >&2; exit 1; }

if [ $# -lt 2 ]; then
  case "${1:-}" in -h|--help) usage; exit 0 ;; esac
  usage >&2; exit 1
fi
family="$1"; pair="$2"; shift 2

# ---------------------------------------------------------------- data set of the pair
case "$pair" in
  iwslt14_de_en) data_dir=iwslt14.tokenized.de-en; src=de; tgt=en; size=iwslt ;;
  wmt14_en_de)   data_dir=wmt14_en_de; src=en; tgt=de; size=wmt14 ;;
  wmt14_en_fr)   data_dir=wmt14_en_fr; src=en; tgt=fr; size=wmt14 ;;
  wmt17_en_lv|wmt17_lv_en|wmt17_en_fi|wmt17_fi_en|wmt17_en_tr|wmt17_tr_en)
    src="${pair:6:2}"; tgt="${pair:9:2}"
    other="$src"; [ "$src" = en ] && other="$tgt"
    data_dir="wmt17_en_$other"; size=wmt17 ;;
  *) die "unknown PAIR '$pair' (see --help)" ;;
esac

# ---------------------------------------------------------------- family: arch + settings
alpha=""; beta=""; pa_alpha=""; attn_dropout=0.0; patience=5; max_update=""; keep_updates=""
case "$family" in
  transformer_lite) arch=transformer_lite; kind=ea_lite ;;
  ea_lite)          arch=ea_transformer_lite; kind=ea_lite; alpha=0.1; beta=0.1 ;;
  transformer_base) arch=transformer; kind=ea_base ;;
  ea_base)          arch=ea_transformer_base; kind=ea_base; alpha=0.5; beta=0.1 ;;
  pa_lite)          arch=pa_transformer_lite; kind=pa_lite; pa_alpha=0.1 ;;
  ran_e|ran_d|ran_all) arch="$family"; kind=ran ;;
  ran_e_lite|ran_d_lite|ran_all_lite) arch="$family"; kind=ran_lite ;;
  *) die "unknown FAMILY '$family' (see --help)" ;;
esac

# EA Table 10 (also used for the Transformer baselines, and for RAN outside its WMT tasks)
ea_table() {
  case "$pair" in
    iwslt14_de_en) lr=1e-3; dropout=0.2; paper_gpus=1; paper_accum=1 ;;
    wmt14_en_de)   lr=1e-3; dropout=0.3; paper_gpus=8; paper_accum=16 ;;
    wmt14_en_fr)   lr=1e-3; dropout=0.1; paper_gpus=8; paper_accum=16 ;;
    *) [ -n "${LR:-}" ] && [ -n "${DROPOUT:-}" ] \
         || die "no paper gives a $family setting for $pair: set LR, DROPOUT (and UPDATE_FREQ)"
       lr="$LR"; dropout="$DROPOUT"; paper_gpus=1; paper_accum=1 ;;
  esac
}
max_tokens=4096
case "$kind" in
  ea_lite|ea_base) ea_table ;;
  pa_lite)
    [ "$pair" = iwslt14_de_en ] || die "the PA paper trains translation on IWSLT'14 De-En only"
    lr=5e-4; dropout=0.2; paper_gpus=1; paper_accum=1 ;;
  ran|ran_lite)
    attn_dropout=0.2
    if [ "$size" = iwslt ]; then
      ea_table  # RAN has no IWSLT setting: the EA table's values, RAN's attention dropout
    else
      if [ "$kind" = ran ]; then
        lr=7e-4; dropout=0.1; paper_gpus=8; paper_accum=1
        case "$pair" in wmt17_en_tr|wmt17_tr_en) paper_gpus=2 ;; esac
      else
        ea_table  # RAN-Lite: the Lite values of the EA table
      fi
      case "$pair" in wmt14_en_fr) attn_dropout=0.0 ;; esac  # "0.2 ... except on En-Fr"
      if [ "$size" = wmt14 ]; then max_update=250000; else max_update=150000; fi
      patience=-1  # RAN trains for a fixed number of steps and picks the best checkpoint
      keep_updates=10
    fi ;;
esac

# ---------------------------------------------------------------- overrides
DATA="${DATA:-data-bin/$data_dir}"
SAVE_DIR="${SAVE_DIR:-checkpoints/$family.$pair}"
LR="${LR:-$lr}"; DROPOUT="${DROPOUT:-$dropout}"; ATTN_DROPOUT="${ATTN_DROPOUT:-$attn_dropout}"
EA_ALPHA="${EA_ALPHA:-$alpha}"; EA_BETA="${EA_BETA:-$beta}"; PA_ALPHA="${PA_ALPHA:-$pa_alpha}"
WARMUP="${WARMUP:-4000}"; LABEL_SMOOTHING="${LABEL_SMOOTHING:-0.1}"
MAX_TOKENS_SET="${MAX_TOKENS:-}"; MAX_TOKENS="${MAX_TOKENS:-$max_tokens}"; MAX_UPDATE="${MAX_UPDATE:-$max_update}"
MAX_EPOCH="${MAX_EPOCH:-}"; PATIENCE="${PATIENCE:-$patience}"
KEEP_LAST_EPOCHS="${KEEP_LAST_EPOCHS:-10}"; SEED="${SEED:-1}"
USER_DIR="${USER_DIR:-$repo/ea_fairseq}"; FAIRSEQ_TRAIN="${FAIRSEQ_TRAIN:-fairseq-train}"
if [ -z "${NGPUS:-}" ]; then
  NGPUS=$(python3 -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
fi
if [ "$NGPUS" -eq 0 ]; then CPU=1; fi
CPU="${CPU:-}"
total=$((paper_gpus * paper_accum))
devices=$(( NGPUS > 0 ? NGPUS : 1 ))
if [ -z "${UPDATE_FREQ:-}" ]; then
  if [ $((total % devices)) -eq 0 ]; then
    UPDATE_FREQ=$((total / devices))
  elif [ $((devices % total)) -eq 0 ] && [ -z "${MAX_TOKENS_SET:-}" ]; then
    # more devices than the paper's batch needs: split each batch instead of accumulating
    UPDATE_FREQ=1; MAX_TOKENS=$((MAX_TOKENS * total / devices))
  else
    die "the paper's $paper_gpus GPU(s) x $paper_accum step(s) do not divide over $devices devices: set UPDATE_FREQ"
  fi
fi

cmd=("$FAIRSEQ_TRAIN" "$DATA" --user-dir "$USER_DIR" --task translation
     --source-lang "$src" --target-lang "$tgt" --arch "$arch" --share-all-embeddings
     --optimizer adam --adam-betas "(0.9, 0.98)" --clip-norm 0.0
     --lr "$LR" --lr-scheduler inverse_sqrt --warmup-updates "$WARMUP" --warmup-init-lr 1e-07
     --criterion label_smoothed_cross_entropy --label-smoothing "$LABEL_SMOOTHING"
     --dropout "$DROPOUT" --attention-dropout "$ATTN_DROPOUT"
     --max-tokens "$MAX_TOKENS" --update-freq "$UPDATE_FREQ"
     --save-dir "$SAVE_DIR" --keep-last-epochs "$KEEP_LAST_EPOCHS" --seed "$SEED"
     --log-format simple --log-interval 100)
if [ -n "$EA_ALPHA" ]; then cmd+=(--ea-alpha "$EA_ALPHA"); fi
if [ -n "$EA_BETA" ]; then cmd+=(--ea-beta "$EA_BETA"); fi
if [ -n "$PA_ALPHA" ]; then cmd+=(--pa-alpha "$PA_ALPHA"); fi
if [ "$PATIENCE" != -1 ]; then cmd+=(--patience "$PATIENCE"); fi
if [ -n "$MAX_UPDATE" ]; then cmd+=(--max-update "$MAX_UPDATE"); fi
if [ -n "$MAX_EPOCH" ]; then cmd+=(--max-epoch "$MAX_EPOCH"); fi
if [ -n "$keep_updates" ]; then cmd+=(--save-interval-updates 5000 --keep-interval-updates "$keep_updates"); fi
if [ -n "${DROP_ATTENTION:-}" ]; then
  cmd+=(--drop-attention "$DROP_ATTENTION" --drop-attention-p "${DROP_ATTENTION_P:-0.2}"
        --drop-attention-window "${DROP_ATTENTION_WINDOW:-2}")
fi
if [ -n "$CPU" ]; then
  cmd+=(--cpu)
elif [ "$NGPUS" -gt 1 ] && [ -z "${LAUNCHER:-}" ]; then
  cmd+=(--distributed-world-size "$NGPUS")
fi
if [ -n "${LAUNCHER:-}" ]; then  # e.g. torchrun ... for several nodes: it runs fairseq-train's file
  read -r -a launcher <<< "$LAUNCHER"
  cmd[0]="$(command -v "${cmd[0]}")" || die "${cmd[0]} not found"
  cmd=("${launcher[@]}" "${cmd[@]}")
fi
cmd+=("$@")

echo "[train] $family on $pair: paper $paper_gpus GPU(s) x $paper_accum accumulation x $max_tokens tokens;" \
     "here $devices device(s) x update-freq $UPDATE_FREQ x $MAX_TOKENS tokens" >&2
if [ -n "${DRY_RUN:-}" ]; then
  printf '%q ' "${cmd[@]}"; echo
  exit 0
fi
mkdir -p "$SAVE_DIR"
exec "${cmd[@]}"
