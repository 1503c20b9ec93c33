#!/usr/bin/env bash
# Train one cell of the papers' translation tables with that paper's hyper-parameters.
#
#   bash examples/translation/train.sh FAMILY PAIR [fairseq-train args ...]
#
# FAMILY  (the paper whose settings it takes; README.md maps every table cell to one)
#   EA      transformer_lite ea_lite              Transformer-Lite, EA-Transformer-Lite
#           transformer_base ea_base              Transformer-Base, EA-Transformer-Base
#   PA      transformer_lite_pa pa_lite           PA's Transformer (Lite dims), PA-Transformer
#           conv_lite_pa pa_conv_lite             PA's Conv-Transformer, PA-Conv-Transformer
#   RAN     transformer_ran                       RAN's Transformer baseline (TransF, Base dims)
#           ran_e ran_d ran_all                   RAN (Transformer-Base dims)
#           ran_e_lite ran_d_lite ran_all_lite    RAN with Transformer-Lite dims (EA's settings)
#           hcsa syn_r                            RAN's baselines HC-SA, Syn-R (Transformer-Base dims)
#           hcsa_lite syn_r_lite                  HC-SA, Syn-R with Transformer-Lite dims
#   DropAttention  transformer_dropattn dropattn  Transformer-Base without / with DropAttention
#   cross-layer baselines (no translation row in the papers; EA's settings of their size)
#           realformer_lite realformer_base       RealFormer (residual attention)
#           resformer_lite resformer_base         ResFormer (value residual learning)
# PAIR    iwslt14_de_en wmt14_en_de wmt14_en_fr
#         wmt17_en_lv wmt17_lv_en wmt17_en_fi wmt17_fi_en wmt17_en_tr wmt17_tr_en
#         own: the data set in DATA (required; e.g. prepare-own.sh's output), its direction
#           the only train.SRC-TGT.* there (or SRC=.. TGT=..); the family's settings for
#           IWSLT'14 De-En (1 GPU; the DropAttention families: its WMT settings)
#
# Devices and precision
#   CUDA GPUs by default; without a CUDA device it stops unless CPU=1 (train on CPU).
#   NGPUS   GPUs (all nodes) [the paper's GPU count, or the largest divisor of the paper's
#           batch not above the GPUs visible here]; with CPU=1 the number of CPU processes [1]
#   FP16=1 (default on CUDA) / FP16=0 (float32) / BF16=1 (bfloat16, Ampere or newer)
#   The effective batch (tokens per GPU x GPUs x update-freq) is kept at the paper's whatever
#   NGPUS is: UPDATE_FREQ [paper's GPUs x accumulation / NGPUS]; with more GPUs than the
#   paper's batch needs, MAX_TOKENS is divided instead. Both are printed before training.
#   LAUNCHER: a command that starts the processes, e.g. "torchrun --nnodes 2 ..." (README.md)
#
# Seeds and run directories
#   SEED [1]; SEEDS="1 2 3" trains one run per seed, one after another, into SAVE_DIR/seedN
#   SAVE_DIR [checkpoints/FAMILY.PAIR]: checkpoints, train.log (fairseq's log), train.command
#   (every command that trained it), train.settings (the resolved settings) and a copy of the
#   data's subword model (code or sentencepiece.bpe.model: fairseq's hub looks there). A
#   directory whose checkpoints were trained with other settings is not resumed: train.sh
#   stops and shows the difference; ALLOW_CHANGED_SETTINGS=1 resumes anyway. A larger
#   MAX_EPOCH or MAX_UPDATE alone (the budget grows) resumes the run. Checkpoints of other
#   settings (or of none recorded) without checkpoint_last.pt, which fairseq-train would
#   train over from scratch, stop it too (ALLOW_CHANGED_SETTINGS=1: train anew over them).
#
# Every value below can be overridden with the environment variable in capitals, and any
# fairseq-train option given after PAIR is passed through last (so it wins):
#   DATA LR DROPOUT ATTN_DROPOUT EA_ALPHA EA_BETA PA_ALPHA WARMUP LABEL_SMOOTHING MAX_TOKENS
#   MAX_UPDATE MAX_EPOCH PATIENCE KEEP_LAST_EPOCHS
#   WEIGHT_DECAY [0: no paper gives one; fairseq's IWSLT recipe and Lite Transformer: 0.0001]
#   SHARE_EMBEDDINGS all|decoder|none [all with a joined dictionary (dict.SRC = dict.TGT),
#     decoder (--share-decoder-input-output-embed) with separate ones]
#   DROP_ATTENTION=column|element DROP_ATTENTION_P DROP_ATTENTION_WINDOW (DropAttention, on
#   any family, transformer_* included; the paper's best for WMT En-De: element, p 0.2,
#   window 2, dropattn's default)
#   USER_DIR (this repository's ea_fairseq)  FAIRSEQ_TRAIN (fairseq-train)  PYTHON (python3)
#   LOG_INTERVAL  updates between fairseq's log lines [100 on GPUs; 5 with CPU=1, so that a
#     CPU run prints within a minute]
#   EVAL_BLEU=1   validation BLEU after every epoch (fairseq's --eval-bleu: beam 5, Moses-
#     detokenized, subwords removed, sacreBLEU), and checkpoint_best.pt and early stopping
#     chosen by it (--best-checkpoint-metric bleu --maximize-best-checkpoint-metric); with
#     --task translation_progress, which logs the validation's progress every 30 s
#     (--valid-progress-seconds N after PAIR changes that)
#   EA_FAIRSEQ_SHOW_WARNINGS=1  show the known warnings of fairseq's stack (hydra
#     deprecations, torch FutureWarnings, ...), which are filtered out otherwise
#   SHOW_CONFIG=1  print fairseq's configuration and the model's structure on the terminal too
#     (they are always in SAVE_DIR/train.log)
#   DRY_RUN=1 prints the command instead of running it (assuming GPUs where there are none).
#
# Where the defaults come from (README.md has the full table):
#   all: Adam (0.9, 0.98), inverse_sqrt with 4000 warm-up updates, label smoothing 0.1,
#     4096 tokens per GPU
#   EA/Transformer Lite+Base: lr 1e-3; dropout 0.2 De-En / 0.3 En-De / 0.1 En-Fr; 1 GPU for
#     De-En, 8 GPUs x 16 accumulation for En-De and En-Fr; alpha 0.1 (Lite) / 0.5 (Base),
#     beta 0.1; early stopping with patience 5 (EA Table 10, Appendix A.3)
#   PA-Lite, (PA-)Conv-Transformer and its Transformer (IWSLT'14 De-En only): lr 5e-4,
#     dropout 0.2, alpha 0.1, patience 5 (PA §4.1.1, Appendix B.2.1)
#   RAN and its baselines (Transformer, HC-SA, Syn-R) on WMT: residual dropout 0.1, attention
#     dropout 0.2 for RAN (not on En-Fr, not for the baselines), 250k updates on WMT'14, 150k
#     on WMT'17, 8 GPUs (2 for En-Tr), best checkpoint on valid, beam 4, length penalty 0.6
#     (RAN Settings); lr 7e-4 is not in the paper (fairseq's usual Base value)
#   DropAttention and its Transformer (WMT En-De, 32K joint BPE): "the configuration of the
#     original Transformer base", i.e. Vaswani et al.: dropout 0.1, 100k updates, the last
#     5 checkpoints averaged, beam 4, length penalty 0.6; lr 7e-4 and 8 GPUs x 4096 tokens
#     are fairseq's Base values
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
die() { echo "train.sh: error: $*" >&2; exit 1; }
is_on() { case "${1:-}" in ""|0|no|false) return 1 ;; *) return 0 ;; esac; }
source "$here/common.sh"  # ea_is_name, ea_shown, ea_quiet, ea_direction, ea_write
source "$here/paper-settings.sh"  # pair_data_set, family_settings: the papers' settings
source "$here/run-records.sh"  # check_save_dir, write_run_records: SAVE_DIR's records

if [ $# -lt 2 ]; then
  case "${1:-}" in -h|--help) usage; exit 0 ;; esac
  usage >&2; exit 1
fi
family="$1"; pair="$2"; shift 2

# the variables the caller set, for train.command (before any default is filled in)
known_vars=(DATA SRC TGT SAVE_DIR LR DROPOUT ATTN_DROPOUT EA_ALPHA EA_BETA PA_ALPHA WARMUP LABEL_SMOOTHING
            MAX_TOKENS MAX_UPDATE MAX_EPOCH PATIENCE KEEP_LAST_EPOCHS SEED SEEDS UPDATE_FREQ NGPUS LOG_INTERVAL EVAL_BLEU
            CPU FP16 BF16 WEIGHT_DECAY SHARE_EMBEDDINGS DROP_ATTENTION DROP_ATTENTION_P
            DROP_ATTENTION_WINDOW LAUNCHER USER_DIR FAIRSEQ_TRAIN ALLOW_CHANGED_SETTINGS)
caller_env=()
for v in "${known_vars[@]}"; do
  if [ -n "${!v+set}" ] && { [ "$v" != SEEDS ] || [ -n "${!v}" ]; }; then caller_env+=("$v=${!v}"); fi
done

# ---------------------------------------------------------------- one run per seed
if [ -n "${SEEDS:-}" ]; then
  base="${SAVE_DIR:-checkpoints/$family.$pair}"
  read -r -a seeds <<< "$SEEDS"
  for s in "${seeds[@]}"; do [[ "$s" =~ ^[0-9]+$ ]] || die "SEEDS must be integers (got '$s')"; done
  for s in "${seeds[@]}"; do
    echo "[train] seed $s of SEEDS=\"$SEEDS\": $base/seed$s" >&2
    SEEDS="" SEED="$s" SAVE_DIR="$base/seed$s" bash "$0" "$family" "$pair" "$@" \
      || die "the run with seed $s failed (the runs before it are in $base)"
  done
  echo "[train] ${#seeds[@]} runs: $base/seed{$(echo "${seeds[*]}" | tr ' ' ',')}" >&2
  last="$base/seed${seeds[-1]}"
  if [ -f "$last/train.settings" ]; then  # the runs' evaluation, on the directory of all seeds
    hint=$(sed -n 's/^# evaluate with: //p' "$last/train.settings")
    runner="$(printf '%q ' bash examples/translation/evaluate.sh)"  # the quoted words before SAVE_DIR
    rest="${hint#"$runner$(printf '%q' "$last") "}"
    if [ "$rest" != "$hint" ]; then
      echo "[train] evaluate every seed (mean ± std) with: $runner$(printf '%q' "$base") $rest" >&2
    fi
  fi
  exit 0
fi

# ---------------------------------------------------------------- the paper's settings
pair_data_set    # data_dir, src, tgt, size, mode: the data set of the pair
family_settings  # arch and the settings of its paper for the pair (lr, dropout, paper_gpus, ...)

# ---------------------------------------------------------------- overrides
DATA="${DATA:-data-bin/$data_dir}"
SAVE_DIR="${SAVE_DIR:-checkpoints/$family.$pair}"
LR="${LR:-$lr}"; DROPOUT="${DROPOUT:-$dropout}"; ATTN_DROPOUT="${ATTN_DROPOUT:-$attn_dropout}"
EA_ALPHA="${EA_ALPHA:-$alpha}"; EA_BETA="${EA_BETA:-$beta}"; PA_ALPHA="${PA_ALPHA:-$pa_alpha}"
WARMUP="${WARMUP:-4000}"; LABEL_SMOOTHING="${LABEL_SMOOTHING:-0.1}"
MAX_TOKENS_SET="${MAX_TOKENS:-}"; MAX_TOKENS="${MAX_TOKENS:-$max_tokens}"; MAX_UPDATE="${MAX_UPDATE:-$max_update}"
MAX_EPOCH="${MAX_EPOCH:-}"; PATIENCE="${PATIENCE:-$patience}"
KEEP_LAST_EPOCHS="${KEEP_LAST_EPOCHS:-10}"; SEED="${SEED:-1}"; WEIGHT_DECAY="${WEIGHT_DECAY:-0.0}"
DROP_ATTENTION="${DROP_ATTENTION:-$drop_default}"
USER_DIR="${USER_DIR:-$repo/ea_fairseq}"; FAIRSEQ_TRAIN="${FAIRSEQ_TRAIN:-fairseq-train}"
PYTHON="${PYTHON:-python3}"
[[ "$SEED" =~ ^[0-9]+$ ]] || die "SEED must be an integer (got $(ea_shown "$SEED"))"
# counts that reach bash arithmetic, which would evaluate any other text as code
for v in NGPUS UPDATE_FREQ MAX_TOKENS; do
  [ -z "${!v:-}" ] || [[ "${!v}" =~ ^[0-9]+$ ]] || die "$v must be a whole number (got $(ea_shown "${!v}"))"
done

# options after PAIR that train.sh must know about (the batch they change is printed; those
# with a variable of their own must be given that way, so the run's record stays true)
extra=("$@"); extra_tokens=""; extra_freq=""; rank=0
for ((i = 0; i < ${#extra[@]}; i++)); do
  a="${extra[$i]}"; next="${extra[$((i + 1))]:-}"
  case "$a" in
    --max-tokens) extra_tokens="$next" ;; --max-tokens=*) extra_tokens="${a#*=}" ;;
    --update-freq) extra_freq="$next" ;; --update-freq=*) extra_freq="${a#*=}" ;;
    --distributed-rank) rank="$next" ;; --distributed-rank=*) rank="${a#*=}" ;;
    --save-dir|--save-dir=*) die "give the checkpoint directory as SAVE_DIR=..., not $a" ;;
    --seed|--seed=*) die "give the seed as SEED=... (or SEEDS=\"1 2 3\"), not $a" ;;
    --fp16|--bf16|--amp|--memory-efficient-fp16|--memory-efficient-bf16) die "precision is FP16=1 / FP16=0 / BF16=1, not $a" ;;
    --cpu) die "training on CPU is CPU=1, not --cpu" ;;
  esac
done

for v in "$extra_tokens" "$extra_freq"; do
  [ -z "$v" ] || [[ "$v" =~ ^[1-9][0-9]*$ ]] || die "--max-tokens and --update-freq take one whole number here (got $(ea_shown "$v"))"
done

# ---------------------------------------------------------------- devices and precision
total=$((paper_gpus * paper_accum))
cpu=""; is_on "${CPU:-}" && cpu=1
probe=""
if [ -z "$cpu" ]; then
  probe=$("$PYTHON" - <<'PY' 2>/dev/null || true
import torch
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
names = ";".join(torch.cuda.get_device_name(i) for i in range(n))
cap = min((torch.cuda.get_device_capability(i)[0] for i in range(n)), default=0)
print(f"{n}|{torch.__version__}|{torch.version.cuda or 'none'}|{cap}|{names}")
PY
)
fi
IFS='|' read -r n_cuda torch_version torch_cuda capability gpu_names <<< "${probe:-0|?|?|0|}"
n_cuda="${n_cuda:-0}"
if [ -z "$cpu" ] && [ "$n_cuda" -eq 0 ]; then
  if is_on "${DRY_RUN:-}"; then
    echo "[train] DRY_RUN: no CUDA device here; the command as it would run on GPUs" >&2
  else
    die "no CUDA device visible to $PYTHON (torch $torch_version, built for CUDA: $torch_cuda).
  The papers' settings take days on a CPU; train.sh does not fall back to it silently.
  Train on CPU anyway with CPU=1, or install a CUDA build of torch next to the pinned
  stack (examples/translation/README.md, 'GPUs')."
  fi
fi
if [ -n "$cpu" ]; then
  NGPUS="${NGPUS:-1}"; [ "$NGPUS" -gt 0 ] || NGPUS=1
  devices_text="CPU, $NGPUS process(es)"
else
  visible=$(( n_cuda > 0 ? n_cuda : paper_gpus ))
  if [ -z "${NGPUS:-}" ]; then
    NGPUS=$(( visible < paper_gpus ? visible : paper_gpus ))
    while [ $((total % NGPUS)) -ne 0 ]; do NGPUS=$((NGPUS - 1)); done
  fi
  [ "$NGPUS" -gt 0 ] || die "NGPUS=0 means no GPU: train on CPU with CPU=1"
  devices_text="$NGPUS GPU(s)"
  [ "$n_cuda" -eq 0 ] || devices_text+=" of $n_cuda visible: ${gpu_names//;/, } (torch $torch_version, CUDA $torch_cuda)"
fi
precision=fp32; precision_flags=()
if is_on "${BF16:-}"; then
  ! is_on "${FP16:-}" || die "FP16=1 and BF16=1: choose one"
  [ -n "$cpu" ] || [ "$n_cuda" -eq 0 ] || [ "$capability" -ge 8 ] \
    || die "BF16=1 needs a GPU of compute capability 8.0 or newer (found $capability.x): use FP16=1"
  precision=bf16; precision_flags=(--bf16)
elif [ -n "$cpu" ]; then
  ! is_on "${FP16:-}" || die "FP16=1 needs CUDA (fp16 on CPU is not supported): drop it, or BF16=1"
elif [ "${FP16:-1}" != 0 ]; then
  precision=fp16; precision_flags=(--fp16)
fi

devices=$NGPUS
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
eff_tokens="${extra_tokens:-$MAX_TOKENS}"; eff_freq="${extra_freq:-$UPDATE_FREQ}"
effective=$((eff_tokens * devices * eff_freq)); paper_effective=$((max_tokens * total))

# ---------------------------------------------------------------- embeddings
share="${SHARE_EMBEDDINGS:-}"
joined=""
if [ -f "$DATA/dict.$src.txt" ] && [ -f "$DATA/dict.$tgt.txt" ]; then
  if cmp -s "$DATA/dict.$src.txt" "$DATA/dict.$tgt.txt"; then joined=yes; else joined=no; fi
fi
if [ -z "$share" ]; then
  case "$joined" in
    yes) share=all ;; no) share=decoder ;;
    *) if [ "$size" = iwslt ]; then share=decoder; else share=all; fi ;;  # the recipes' default data
  esac
fi
case "$share" in
  all) [ "$joined" != no ] || die "SHARE_EMBEDDINGS=all needs a joined dictionary; $DATA has separate ones (prepare-iwslt14.sh --joined-dictionary makes one)"
       share_flags=(--share-all-embeddings) ;;
  decoder) share_flags=(--share-decoder-input-output-embed) ;;
  none) share_flags=() ;;
  *) die "SHARE_EMBEDDINGS must be all, decoder or none (got '$share')" ;;
esac

# ---------------------------------------------------------------- the command
# run: what defines the experiment (train.settings); layout: how it is spread over devices
# (EVAL_BLEU=1: the plugin's translation_progress, fairseq's translation task that logs how far
# the validation's translation has got)
task=translation; ! is_on "${EVAL_BLEU:-}" || task=translation_progress
run=("$DATA" --user-dir "$USER_DIR" --task "$task"
     --source-lang "$src" --target-lang "$tgt" --arch "$arch" "${share_flags[@]}"
     --optimizer adam --adam-betas "(0.9, 0.98)" --clip-norm 0.0 --weight-decay "$WEIGHT_DECAY"
     --lr "$LR" --lr-scheduler inverse_sqrt --warmup-updates "$WARMUP" --warmup-init-lr 1e-07
     --criterion label_smoothed_cross_entropy --label-smoothing "$LABEL_SMOOTHING"
     --dropout "$DROPOUT" --attention-dropout "$ATTN_DROPOUT"
     --keep-last-epochs "$KEEP_LAST_EPOCHS" --seed "$SEED")
if [ -n "$EA_ALPHA" ]; then run+=(--ea-alpha "$EA_ALPHA"); fi
if [ -n "$EA_BETA" ]; then run+=(--ea-beta "$EA_BETA"); fi
if [ -n "$PA_ALPHA" ]; then run+=(--pa-alpha "$PA_ALPHA"); fi
if [ "$PATIENCE" != -1 ]; then run+=(--patience "$PATIENCE"); fi
if [ -n "$MAX_UPDATE" ]; then run+=(--max-update "$MAX_UPDATE"); fi
if [ -n "$MAX_EPOCH" ]; then run+=(--max-epoch "$MAX_EPOCH"); fi
if [ -n "$keep_updates" ]; then run+=(--save-interval-updates 5000 --keep-interval-updates "$keep_updates"); fi
if is_on "${EVAL_BLEU:-}"; then
  bleu_remove=(--eval-bleu-remove-bpe)
  [ ! -f "$DATA/sentencepiece.bpe.model" ] || bleu_remove=(--eval-bleu-remove-bpe sentencepiece)
  run+=(--eval-bleu --eval-bleu-args '{"beam": 5, "max_len_a": 1.2, "max_len_b": 10}'
        --eval-bleu-detok moses "${bleu_remove[@]}"
        --best-checkpoint-metric bleu --maximize-best-checkpoint-metric)
fi
if [ -n "$DROP_ATTENTION" ]; then
  run+=(--drop-attention "$DROP_ATTENTION" --drop-attention-p "${DROP_ATTENTION_P:-0.2}"
        --drop-attention-window "${DROP_ATTENTION_WINDOW:-2}")
fi
run+=(${precision_flags[@]+"${precision_flags[@]}"})
if [ -n "$cpu" ]; then LOG_INTERVAL="${LOG_INTERVAL:-5}"; else LOG_INTERVAL="${LOG_INTERVAL:-100}"; fi
[[ "$LOG_INTERVAL" =~ ^[1-9][0-9]*$ ]] || die "LOG_INTERVAL must be a positive number of updates (got $(ea_shown "$LOG_INTERVAL"))"
layout=(--max-tokens "$MAX_TOKENS" --update-freq "$UPDATE_FREQ" --save-dir "$SAVE_DIR"
        --log-format simple --log-interval "$LOG_INTERVAL")
if [ "$rank" = 0 ]; then layout+=(--log-file "$SAVE_DIR/train.log"); fi
if [ -n "$cpu" ]; then
  layout+=(--cpu)
elif [ "$NGPUS" -gt 1 ] && [ -z "${LAUNCHER:-}" ]; then
  layout+=(--distributed-world-size "$NGPUS")
fi
cmd=("$FAIRSEQ_TRAIN" "${run[@]}" "${layout[@]}")
if [ -n "${LAUNCHER:-}" ]; then  # e.g. torchrun ... for several nodes: it runs fairseq-train's file
  read -r -a launcher <<< "$LAUNCHER"
  cmd[0]="$(command -v "${cmd[0]}")" || die "${cmd[0]} not found"
  cmd=("${launcher[@]}" "${cmd[@]}")
fi
cmd+=(${extra[@]+"${extra[@]}"})

# the options after PAIR, minus those that only say how processes and logs are laid out
settings_extra=()
for ((i = 0; i < ${#extra[@]}; i++)); do
  a="${extra[$i]}"
  case "$a" in
    --distributed-*=*|--device-id=*|--num-workers=*|--log-*=*|--ddp-backend=*|--max-tokens=*|--update-freq=*) ;;
    --valid-progress-seconds=*) ;;
    --distributed-no-spawn|--no-progress-bar) ;;
    --distributed-*|--device-id|--num-workers|--log-*|--ddp-backend|--max-tokens|--update-freq|--tensorboard-logdir \
      |--valid-progress-seconds)
      i=$((i + 1)) ;;
    *) settings_extra+=("$a") ;;
  esac
done
# the evaluation command, each word quoted (printf %q): a shell reads it back as these words
eval_words=(bash examples/translation/evaluate.sh "$SAVE_DIR" "$DATA" "$mode")
case "$size" in wmt17) eval_words+=(-s "$src" -t "$tgt") ;; esac
eval_words+=(${eval_opts[@]+"${eval_opts[@]}"})
eval_hint=$(printf '%q ' "${eval_words[@]}"); eval_hint="${eval_hint% }"
# the data as an absolute path and the plugin's location left out, so that a resume from
# another working directory or checkout compares equal
data_abs=$(cd "$DATA" 2>/dev/null && pwd || echo "$DATA")
options_by_line() {  # one option a line, with its value
  local a line=""
  for a in "$@"; do
    if [[ "$a" == --* ]]; then [ -z "$line" ] || echo "$line"; line="$a"; else line+=" $a"; fi
  done
  [ -z "$line" ] || echo "$line"
}
settings=$(
  echo "family=$family"
  echo "pair=$pair"
  echo "data=$data_abs"
  echo "effective_batch_tokens=$effective"
  echo "precision=$precision"
  echo "fairseq-train options (data, plugin directory, batch layout and logging left out):"
  options_by_line "${run[@]:3}" ${settings_extra[@]+"${settings_extra[@]}"}
)

if ! is_on "${DRY_RUN:-}" && { [ ! -f "$DATA/dict.$src.txt" ] || [ ! -f "$DATA/dict.$tgt.txt" ]; }; then
  case "$pair" in
    iwslt14_de_en) how="bash examples/translation/prepare-iwslt14.sh" ;;
    wmt14_en_de) how="bash examples/translation/prepare-wmt14en2de.sh"
      [ "$kind" != vaswani ] || how+=" --bpe-tokens 32000 --dest-dir $DATA" ;;
    wmt14_en_fr) how="bash examples/translation/prepare-wmt14en2fr.sh" ;;
    wmt17_*) how="bash examples/translation/prepare-wmt17.sh $other" ;;
    *) how="bash examples/translation/prepare-own.sh $src $tgt TEXT_DIR --dest-dir $DATA" ;;
  esac
  die "no prepared data in $DATA (dict.$src.txt, dict.$tgt.txt): run $how first, or set DATA=..."
fi
echo "[train] $family on $pair, seed $SEED -> $SAVE_DIR" >&2
echo "[train] devices: $devices_text; precision: $precision" >&2
echo "[train] effective batch: $eff_tokens tokens x $devices device(s) x update-freq $eff_freq = $effective tokens per update" \
     "(paper: $paper_gpus GPU(s) x $paper_accum accumulation x $max_tokens tokens = $paper_effective)" >&2
if [ "$effective" != "$paper_effective" ]; then
  echo "[train] note: the effective batch is not the paper's ($paper_effective tokens)" >&2
fi
echo "[train] evaluate with: $eval_hint" >&2
if is_on "${DRY_RUN:-}"; then
  printf '%q ' "${cmd[@]}"; echo
  exit 0
fi

# train_output: fairseq-train's stdout as the terminal shows it. fairseq's configuration (one
# line of some 12,000 characters), the model's structure and the data loader's bookkeeping
# (fairseq_task's "can_reuse_epoch_itr = True", ... at every epoch and validation) go to
# SAVE_DIR/train.log only (fairseq's --log-file, which rank 0 writes; SHOW_CONFIG=1 shows them
# here too).
train_output() {
  local line skipping="" quiet=""
  if [ "$rank" = 0 ] && ! is_on "${SHOW_CONFIG:-}"; then quiet=1; fi
  while IFS= read -r line; do
    if [ -n "$skipping" ]; then [ "$line" != ")" ] || skipping=""; continue; fi
    if [ -n "$quiet" ]; then
      case "$line" in
        *" | INFO | fairseq_cli.train | {'_name': "*)
          echo "[train] fairseq's configuration and the model's structure: in $SAVE_DIR/train.log (SHOW_CONFIG=1 shows them here)"
          continue ;;
        *" | INFO | fairseq_cli.train | "*"Model(") skipping=1; continue ;;
        *" | INFO | fairseq.tasks.fairseq_task | can_reuse_epoch_itr = "* \
          | *" | INFO | fairseq.tasks.fairseq_task | reuse_dataloader = "* \
          | *" | INFO | fairseq.tasks.fairseq_task | rebuild_batches = "* \
          | *" | INFO | fairseq.tasks.fairseq_task | creating new batches for epoch "*) continue ;;
      esac
    fi
    printf '%s\n' "$line"
  done
}

# ---------------------------------------------------------------- run hygiene
if [ "$rank" = 0 ]; then
  mkdir -p "$SAVE_DIR"
  check_save_dir "$SAVE_DIR/train.settings"  # resume or train over checkpoints only as recorded
  write_run_records "$SAVE_DIR/train.settings"  # train.settings, train.command, subword model
fi
# fairseq-train's stdout through train_output (line by line: PYTHONUNBUFFERED), its stderr
# without the known warnings of its stack (ea_quiet); its exit status kept
set +e
{ { PYTHONUNBUFFERED=1 "${cmd[@]}" 2>&1 1>&3 3>&- | ea_quiet >&2 3>&-; exit "${PIPESTATUS[0]}"; } 3>&1 \
    | train_output; status=${PIPESTATUS[0]}; }
set -e
[ "$status" -eq 0 ] || exit "$status"
echo "[train] done: $SAVE_DIR; evaluate with: $eval_hint" >&2
