#!/usr/bin/env bash
# The README's demo: Transformer-Lite vs EA-Transformer-Lite on a small, real, offline
# Spanish->English corpus (the Bible, examples/translation/bible-es-en), on CPU.
#
#   bash scripts/demo.sh                      # about 20 min on an idle 2-core CPU, creating the venv included
#   DEMO_UPDATES=300 bash scripts/demo.sh     # quicker (and weaker) run
#
# Reference runs, 2-core VMs, torch 2.13, detokenized sacreBLEU after 1200 updates (~2 epochs,
# one seed): Intel Xeon copy 0.10, transformer_lite 11.93, ea_transformer_lite 13.36; AMD EPYC
# 0.10, 10.85, 15.30. A check of the whole pipeline, not a benchmark: the same CPU prints the
# same table again, another CPU other digits
# (README.md, "The two commands").
#
# Stages: (1) the pinned environment (scripts/setup_env.sh, reused when up to date); (2) data:
# decompress the shipped corpus, Moses-normalize and -tokenize as the recipes do
# (examples/translation/nmt_text.py and nmt_moses.py, the Perl scripts' port), learn and apply a
# joint BPE (subword-nmt), binarize (fairseq-preprocess --joined-dictionary); (3) train both
# architectures with the same seed and settings; (4) average each run's last checkpoints;
# (5) translate the test set (beam 5) and score it: detokenized sacreBLEU and fairseq's
# tokenized BLEU, next to a copy-the-source baseline; (6) plot every model's attention maps
# across layers for one test sentence (ea-fairseq-analysis: PNGs in DEMO_DIR/plots/ARCH/, for EA
# also its dot-product / convolution / logit maps); (7) a summary table, sample translations.
#
# Device: CPU unless torch sees a CUDA GPU (DEMO_DEVICE=cpu|cuda forces one). On CPU the
# budget is a fixed number of updates (about two epochs: not a trained model). On CUDA the
# models train in fp16 until the validation loss has not improved for DEMO_PATIENCE
# validations (DEMO_UPDATES caps it), as the papers' early stopping; the output says which
# budget ran and whether each model stopped early or hit the cap.
#
# Environment variables (defaults in brackets: CPU / CUDA):
#   DEMO_DIR          work directory [runs/demo in the repository]
#   DEMO_DEVICE       auto, cpu or cuda [auto]
#   DEMO_UPDATES      training updates per model [1200 / at most 30000]
#   DEMO_MAX_TOKENS   tokens per batch [2048 / 4096]
#   DEMO_LR           peak learning rate [0.002 / 0.001]    DEMO_WARMUP  warmup updates [300 / 1000]
#   DEMO_DROPOUT      dropout [0.0 / 0.2]                   DEMO_SEED    seed [1]
#   DEMO_PATIENCE, DEMO_VALIDATE_EVERY   CUDA: early stopping [5 validations, 500 updates apart]
#   DEMO_BPE_MERGES   joint BPE merge operations [6000]
#   DEMO_AVG          checkpoints averaged [5 / 10], saved every DEMO_SAVE_EVERY
#                     [DEMO_UPDATES/20 / DEMO_VALIDATE_EVERY] updates
#   DEMO_ARCHS        architectures ["transformer_lite ea_transformer_lite"]
#   DEMO_PLOT_SENTENCE  test sentence whose attention maps are plotted [the first of 8-14
#                     source and target tokens after BPE]
#   DEMO_MAX_MINUTES  optional wall-clock cap per training (fairseq --stop-time-hours); a run
#                     stopped by it has fewer updates (the table shows how many)
#   DEMO_PARALLEL     models trained (and evaluated) at the same time [all / one per GPU]
#   DEMO_THREADS      torch CPU threads per model [cores / DEMO_PARALLEL]
#   DEMO_TRAIN_ARGS   extra fairseq-train options, e.g. "--drop-attention element" [none]
#   DEMO_CORPUS       directory of the corpus' {train,valid,test}.{es,en}.xz
#                     [examples/translation/bible-es-en]
#   DEMO_STOP_AFTER   data: stop once the data is prepared; translation: once the test set
#                     is translated (no attention maps, no report) [run every stage]
#   DEMO_FRESH=1      redo every stage [reuse the finished stages of the same configuration]
#   EA_FAIRSEQ_VENV   the virtualenv scripts/setup_env.sh creates/uses [.venv in the repository]
#   EA_FAIRSEQ_SHOW_WARNINGS=1  show the warnings of fairseq's stack (hydra deprecations,
#                     torch FutureWarnings, ...) that the demo and the recipes filter out
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
work="${DEMO_DIR:-$repo/runs/demo}"
case "$work" in /*) ;; *) work="$PWD/$work" ;; esac  # absolute: the stages run inside it
updates="${DEMO_UPDATES:-}"
max_tokens="${DEMO_MAX_TOKENS:-}"
lr="${DEMO_LR:-}"
warmup="${DEMO_WARMUP:-}"
dropout="${DEMO_DROPOUT:-}"
seed="${DEMO_SEED:-1}"
merges="${DEMO_BPE_MERGES:-6000}"
n_avg="${DEMO_AVG:-}"
save_every="${DEMO_SAVE_EVERY:-}"
patience="${DEMO_PATIENCE:-5}"
validate_every="${DEMO_VALIDATE_EVERY:-500}"
archs="${DEMO_ARCHS:-transformer_lite ea_transformer_lite}"
max_minutes="${DEMO_MAX_MINUTES:-}"
corpus="${DEMO_CORPUS:-$repo/examples/translation/bible-es-en}"
stop_after="${DEMO_STOP_AFTER:-}"
read -r -a extra_train_args <<< "${DEMO_TRAIN_ARGS:-}"
src=es
tgt=en

t_start=$SECONDS
stage() { printf '\n[demo %s +%dm%02ds] %s\n' "$(date +%H:%M:%S)" $(( (SECONDS - t_start) / 60 )) $(( (SECONDS - t_start) % 60 )) "$*" >&2; }
info() { printf '[demo] %s\n' "$*" >&2; }
die() { printf '[demo] ERROR: %s\n' "$*" >&2; exit 1; }
source "$repo/examples/translation/common.sh"  # ea_is_name, ea_quiet: shared with the recipes
prefix() { local line; while IFS= read -r line; do printf '[%s] %s\n' "$1" "$line"; done; }
read -r -a arch_list <<< "$archs"
for arch in ${arch_list[@]+"${arch_list[@]}"}; do  # names, checked before any use
  ea_is_name "$arch" || die "DEMO_ARCHS holds $(ea_shown "$arch"), not an architecture name ([A-Za-z0-9_@-]+)"
done
for v in DEMO_UPDATES DEMO_MAX_TOKENS DEMO_WARMUP DEMO_SEED DEMO_BPE_MERGES DEMO_AVG DEMO_SAVE_EVERY \
         DEMO_PATIENCE DEMO_VALIDATE_EVERY DEMO_PARALLEL DEMO_THREADS DEMO_PLOT_SENTENCE; do
  [ -z "${!v:-}" ] || [[ "${!v}" =~ ^[0-9]+$ ]] || die "$v must be a whole number (got $(ea_shown "${!v}"))"
done  # (counts reach bash arithmetic, which would evaluate any other text as code)
trap 'rc=$?; [ $rc -eq 0 ] || printf "[demo] FAILED (exit %d) in the stage above; logs are in %s\n" $rc "$work" >&2' EXIT

case "$stop_after" in ""|data|translation) ;; *) die "DEMO_STOP_AFTER must be data or translation (got '$stop_after')" ;; esac
if [ -n "$max_minutes" ]; then [[ "$max_minutes" =~ ^[0-9]+([.][0-9]+)?$ ]] || die "DEMO_MAX_MINUTES must be a number of minutes"; fi
for split in train valid test; do
  for l in $src $tgt; do
    [ -f "$corpus/$split.$l.xz" ] || die "missing $corpus/$split.$l.xz (the shipped corpus; rebuild it with examples/translation/bible-es-en/build_corpus.py)"
  done
done
command -v xz >/dev/null || die "xz is not installed (apt-get install xz-utils)"

# ----------------------------------------------------------------------------- 1. environment
stage "1/7 environment: bash scripts/setup_env.sh"
bash "$repo/scripts/setup_env.sh" || die "scripts/setup_env.sh failed (see above)"
venv="${EA_FAIRSEQ_VENV:-$repo/.venv}"
py="$venv/bin/python"
for tool in python fairseq-preprocess fairseq-train fairseq-generate subword-nmt; do
  [ -x "$venv/bin/$tool" ] || die "$venv/bin/$tool not found: the environment is incomplete (remove $venv and rerun)"
done
"$py" -c "import sacrebleu, sacremoses, subword_nmt" 2>/dev/null || die "sacrebleu/sacremoses/subword-nmt missing in $venv"
if [ -z "${EA_FAIRSEQ_SHOW_WARNINGS:-}" ] || [ "$EA_FAIRSEQ_SHOW_WARNINGS" = 0 ]; then
  export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}"  # torchaudio's missing C extension etc.
fi

device="${DEMO_DEVICE:-auto}"
gpu_info=0  # DEMO_DEVICE=cpu asks torch nothing (an import of torch costs a second)
if [ "$device" != cpu ]; then
  gpu_info=$("$py" -c 'import torch
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
print(n, ";".join(torch.cuda.get_device_name(i) for i in range(n)))' 2>/dev/null || echo 0)
fi
read -r n_gpu gpu_names <<< "$gpu_info"
case "$device" in
  auto) if [ "${n_gpu:-0}" -gt 0 ]; then device=cuda; else device=cpu; fi ;;
  cpu) ;;
  cuda) [ "${n_gpu:-0}" -gt 0 ] || die "DEMO_DEVICE=cuda but torch sees no CUDA GPU (a CPU build of torch? examples/translation/README.md, 'GPUs')" ;;
  *) die "DEMO_DEVICE must be auto, cpu or cuda (got '$device')" ;;
esac
if [ "$device" = cuda ]; then
  updates="${updates:-30000}"; max_tokens="${max_tokens:-4096}"; lr="${lr:-0.001}"; warmup="${warmup:-1000}"
  dropout="${dropout:-0.2}"; n_avg="${n_avg:-10}"; save_every="${save_every:-$validate_every}"
else
  updates="${updates:-1200}"; max_tokens="${max_tokens:-2048}"; lr="${lr:-0.002}"; warmup="${warmup:-300}"
  dropout="${dropout:-0.0}"; n_avg="${n_avg:-5}"; save_every="${save_every:-$(( updates / 20 > 0 ? updates / 20 : 1 ))}"
fi
for v in "$updates" "$max_tokens" "$warmup" "$seed" "$merges" "$n_avg" "$save_every" "$patience" "$validate_every"; do
  [[ "$v" =~ ^[0-9]+$ ]] && [ "$v" -gt 0 ] || die "DEMO_UPDATES, DEMO_MAX_TOKENS, DEMO_WARMUP, DEMO_SEED, DEMO_BPE_MERGES, DEMO_AVG, DEMO_SAVE_EVERY, DEMO_PATIENCE and DEMO_VALIDATE_EVERY must be positive integers (got '$v')"
done
if [ "$device" = cuda ]; then
  budget="CUDA (${gpu_names//;/, }), fp16: up to $updates updates, stopped when the validation loss has not improved for $patience validations ($validate_every updates apart), i.e. trained to convergence; the last $n_avg checkpoints averaged"
else
  budget="CPU: $updates updates of $max_tokens tokens (a 20-minute budget: about two epochs, far from convergence); the last $n_avg checkpoints averaged"
fi
info "device and budget: $budget"
[ -z "${DEMO_FRESH:-}" ] || { info "DEMO_FRESH set: removing $work"; rm -rf "$work"; }
mkdir -p "$work"
cd "$work"

# A stage is reused when its stamp holds the same configuration string.
done_with() { [ -f "$1/.done" ] && [ "$(cat "$1/.done")" = "$2" ]; }

# ----------------------------------------------------------------------------- 2. data
data_cfg="corpus=$(cat "$corpus"/*.xz | sha256sum | cut -c1-16) tokenizer=$(cat "$repo"/examples/translation/nmt_{text,moses,corpus}.py | sha256sum | cut -c1-16) merges=$merges"
if done_with data "$data_cfg"; then
  stage "2/7 data: reusing $work/data ($data_cfg)"
else
  stage "2/7 data: decompress, normalize and tokenize (nmt_text.py), joint BPE ($merges merges), binarize"
  rm -rf data && mkdir -p data/raw data/tok data/bpe
  for split in train valid test; do
    for l in $src $tgt; do xz -dc "$corpus/$split.$l.xz" > "data/raw/$split.$l"; done
  done
  wc -l data/raw/* | sed 's/^/[demo]   /' >&2
  info "Moses normalization and tokenization (examples/translation/nmt_text.py, both languages in parallel)"
  pids=()
  for l in $src $tgt; do
    ( for split in train valid test; do
        "$py" "$repo/examples/translation/nmt_text.py" text --normalize-punct --tokenize --aggressive-dash \
          --no-escape -l "$l" -o "data/tok/$split.$l" "data/raw/$split.$l" || exit 1
      done ) &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || die "tokenization failed"; done
  info "learning a joint BPE with $merges merges on train.$src + train.$tgt"
  cat data/tok/train.$src data/tok/train.$tgt | "$venv/bin/subword-nmt" learn-bpe -s "$merges" > data/bpe/codes 2>/dev/null
  info "applying BPE"
  pids=()
  for l in $src $tgt; do
    ( for split in train valid test; do
        "$venv/bin/subword-nmt" apply-bpe -c data/bpe/codes < "data/tok/$split.$l" > "data/bpe/$split.$l"
      done ) &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || die "apply-bpe failed"; done
  info "fairseq-preprocess --joined-dictionary"
  "$venv/bin/fairseq-preprocess" --source-lang $src --target-lang $tgt \
    --trainpref data/bpe/train --validpref data/bpe/valid --testpref data/bpe/test \
    --destdir data/bin --joined-dictionary --workers 2 > data/preprocess.log 2>&1 \
    || { tail -20 data/preprocess.log >&2; die "fairseq-preprocess failed (log: $work/data/preprocess.log)"; }
  grep -E "Dictionary|sents" data/preprocess.log | sed 's/^.*| INFO | fairseq_cli.preprocess | /[demo]   /;s/^INFO:fairseq_cli.preprocess:/[demo]   /' >&2
  echo "$data_cfg" > data/.done
fi
if [ "$stop_after" = data ]; then stage "stopping after the data (DEMO_STOP_AFTER=data): $work/data"; exit 0; fi

# ----------------------------------------------------------------------------- 3. training
# The models train side by side, each with its own share of the cores (one core each on a
# 2-core machine): on CPU this beats training them one after the other with all cores,
# since a small model does not scale across threads, and an OpenMP thread pool slows down
# badly when a core is shared. Both runs see the same conditions, so their times compare.
n_arch=${#arch_list[@]}
[ "$n_arch" -gt 0 ] || die "DEMO_ARCHS is empty"
if [ -n "${DEMO_PARALLEL:-}" ]; then n_par="$DEMO_PARALLEL"
elif [ "$device" = cuda ]; then n_par=$(( n_arch < n_gpu ? n_arch : n_gpu ))  # one model per GPU
else n_par=$n_arch; fi
[[ "$n_par" =~ ^[1-9][0-9]*$ ]] || die "DEMO_PARALLEL must be a positive integer"
n_cpu=$(nproc 2>/dev/null || echo 2)
threads="${DEMO_THREADS:-$(( n_cpu / n_par > 0 ? n_cpu / n_par : 1 ))}"
[[ "$threads" =~ ^[1-9][0-9]*$ ]] || die "DEMO_THREADS must be a positive integer"
export OMP_NUM_THREADS="$threads" MKL_NUM_THREADS="$threads"

train_args=(
  data/bin --user-dir "$repo/ea_fairseq" --task translation --source-lang $src --target-lang $tgt
  --share-all-embeddings --optimizer adam --adam-betas '(0.9,0.98)' --clip-norm 0.0
  --lr "$lr" --lr-scheduler inverse_sqrt --warmup-updates "$warmup" --warmup-init-lr 1e-07
  --criterion label_smoothed_cross_entropy --label-smoothing 0.1 --dropout "$dropout"
  --max-tokens "$max_tokens" --max-update "$updates" --seed "$seed"
  --save-interval-updates "$save_every" --keep-interval-updates "$n_avg" --no-epoch-checkpoints
  --num-workers 0 --log-format simple --log-interval 25 --no-progress-bar
  ${extra_train_args[@]+"${extra_train_args[@]}"}
)
if [ "$device" = cuda ]; then  # validate every $validate_every updates (not per epoch), stop early
  train_args+=(--fp16 --validate-interval-updates "$validate_every" --validate-interval 1000000
               --patience "$patience")
else
  train_args+=(--disable-validation --cpu)
fi
[ -z "$max_minutes" ] || train_args+=(--stop-time-hours "$(awk -v m="$max_minutes" 'BEGIN { print m / 60 }')")
# fairseq's log, minus the known warnings of its stack (ea_quiet, shared with the recipes),
# blank lines and the model's printout (its indented lines)
quiet() { ea_quiet | { grep --line-buffered -vE "^\s*$|^  " || true; }; }

declare -A gpu_of
k=0
for arch in "${arch_list[@]}"; do gpu_of[$arch]=$(( n_gpu > 0 ? k % n_gpu : 0 )); k=$((k + 1)); done
on_device() {  # arch command...: the command on the arch's GPU (CUDA), or as it is (CPU)
  local arch=$1; shift
  if [ "$device" = cuda ]; then CUDA_VISIBLE_DEVICES="${gpu_of[$arch]}" "$@"; else "$@"; fi
}
train_one() {  # arch -> trains into train/$arch, logs there and (prefixed) to stderr
  local arch=$1 run="train/$1" t0=$SECONDS
  rm -rf "$run" && mkdir -p "$run"
  set +e
  on_device "$arch" "$venv/bin/fairseq-train" "${train_args[@]}" --arch "$arch" --save-dir "$run" 2>&1 \
    | quiet | tee "$run/train.log" | prefix "$arch" >&2
  local rc=${PIPESTATUS[0]}
  set -e
  [ "$rc" -eq 0 ] || { echo "[demo] ERROR: fairseq-train failed for $arch (exit $rc, log: $work/$run/train.log)" >&2; return "$rc"; }
  echo $(( SECONDS - t0 )) > "$run/train_seconds"
  train_stamp "$arch" > "$run/.done"
}
in_parallel() {  # FUNCTION WHAT ARCH...: FUNCTION ARCH for each arch, $n_par at a time
  local fn=$1 what=$2 arch p pids=()
  shift 2
  for arch in "$@"; do
    while [ "$(jobs -rp | wc -l)" -ge "$n_par" ]; do sleep 2; done
    "$fn" "$arch" &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || die "$what failed (see above)"; done
}
# run_stage FUNCTION WHAT DIR STAMP REUSED HEADLINE: per arch, the stage's directory (DIR with
# @ARCH@ replaced) is reused when its .done holds `STAMP arch` (the stage says REUSED), else
# FUNCTION runs on it, $n_par archs at a time, after HEADLINE (@ARCHS@: those it runs on);
# FUNCTION writes `STAMP arch` into .done when it succeeds.
run_stage() {
  local fn=$1 what=$2 dir=$3 stamp=$4 reused=$5 headline=$6 arch todo=()
  for arch in "${arch_list[@]}"; do
    if done_with "${dir//@ARCH@/$arch}" "$("$stamp" "$arch")"; then
      stage "${reused//@ARCH@/$arch}"
    else
      todo+=("$arch")
    fi
  done
  if [ ${#todo[@]} -gt 0 ]; then
    stage "${headline//@ARCHS@/${todo[*]}}"
    in_parallel "$fn" "$what" "${todo[@]}"
  fi
}
cfg_prefix="$data_cfg threads=$threads ${train_args[*]}"
train_stamp() { echo "$cfg_prefix --arch $1"; }
run_stage train_one "training" "train/@ARCH@" train_stamp "3/7 training: reusing $work/train/@ARCH@" \
  "3/7 training @ARCHS@: $budget; seed $seed, $max_tokens tokens/batch, $n_par at a time with $threads CPU thread(s) each (logs: $work/train/ARCH/train.log)"
declare -A train_secs
for arch in "${arch_list[@]}"; do train_secs[$arch]=$(cat "train/$arch/train_seconds"); done

# ----------------------------------------------------------------------------- 4.+5. averaging, translation
gen_args=(--source-lang $src --target-lang $tgt --gen-subset test --beam 5 --remove-bpe
          --max-tokens 6000 --required-batch-size-multiple 1 --max-len-a 1.5 --max-len-b 10
          --num-workers 0)
if [ "$device" = cpu ]; then gen_args+=(--cpu); fi
# --required-batch-size-multiple 1: with the default (8) fairseq 0.12 silently drops the last
# batch when it is not full, i.e. a few test sentences.

eval_one() {  # arch -> train/$arch/eval/{averaged.pt,generate.out}
  local arch=$1 run="train/$1" t0=$SECONDS
  rm -rf "$run/eval" && mkdir -p "$run/eval"
  "$venv/bin/ea-fairseq-average-checkpoints" --inputs "$run" --num-update-checkpoints "$n_avg" \
    --output "$run/eval/averaged.pt" 2>&1 | prefix "$arch" >&2
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "[demo] ERROR: ea-fairseq-average-checkpoints failed for $arch" >&2; return 1; }
  if ! on_device "$arch" "$venv/bin/fairseq-generate" data/bin --user-dir "$repo/ea_fairseq" --path "$run/eval/averaged.pt" \
      "${gen_args[@]}" > "$run/eval/generate.out" 2> "$run/eval/generate.log"; then
    tail -20 "$run/eval/generate.log" >&2
    echo "[demo] ERROR: fairseq-generate failed for $arch (log: $work/$run/eval/generate.log)" >&2
    return 1
  fi
  echo "[$arch] $(grep -E '^Generate test with beam' "$run/eval/generate.out" || true)" >&2
  echo "[$arch] translated in $(( SECONDS - t0 ))s" >&2
  eval_stamp "$arch" > "$run/eval/.done"
}
eval_stamp() { echo "$(cat "train/$1/.done") avg=$n_avg ${gen_args[*]}"; }
run_stage eval_one "averaging/translation" "train/@ARCH@/eval" eval_stamp \
  "4-5/7 reusing the averaged checkpoint and translations of @ARCH@" \
  "4-5/7 averaging the last $n_avg checkpoints and translating the test set (beam 5): @ARCHS@"
if [ "$stop_after" = translation ]; then
  stage "stopping after the translation (DEMO_STOP_AFTER=translation): $work/train/ARCH/eval/generate.out"
  exit 0
fi

# ----------------------------------------------------------------------------- 6. attention maps
# One test sentence, every layer and head of the three attentions of each model, with the
# analysis tool (docs/analysis.md): teacher-forced on the reference, from the averaged
# checkpoint. For EA also one head's dot-product, convolution and logit maps beside its
# weights (EA Fig. 11): what the convolutions add, layer by layer.
plot_sid="${DEMO_PLOT_SENTENCE:-$("$py" - "data/bpe/test.$src" "data/bpe/test.$tgt" <<'PY'
import sys
src, tgt = (open(p, encoding="utf-8").read().splitlines() for p in sys.argv[1:])
print(next((i for i, (s, t) in enumerate(zip(src, tgt)) if 8 <= len(s.split()) <= 14 and 8 <= len(t.split()) <= 14), 0))
PY
)}"
[[ "$plot_sid" =~ ^[0-9]+$ ]] || die "DEMO_PLOT_SENTENCE must be a test sentence id"
plot_one() {  # arch -> plots/$arch/*.png (the analysis CLI's dump and plots, one process)
  local arch=$1 out="plots/$1"
  rm -rf "$out" && mkdir -p "$out"
  if ! "$py" - "train/$arch/eval/averaged.pt" "$out" "$plot_sid" "$threads" > "$out/plot.log" 2>&1 <<'PY'
import json, sys
from ea_fairseq_cli.analysis import main
checkpoint, out, sid, threads = sys.argv[1:]
assert main(["dump", checkpoint, "--data", "data/bin", "--split", "test", "--ids", sid,
             "--threads", threads, "--out", f"{out}/maps.npz"]) == 0
assert main(["plot", "maps", f"{out}/maps.npz", "--sentence", sid, "--out-dir", out]) == 0
kinds = json.load(open(f"{out}/maps.json"))["sentences"][0]["maps"]
if any("convolution" in k for k in kinds.values()):  # EA: Fig. 11's maps of one head
    assert main(["plot", "kinds", f"{out}/maps.npz", "--sentence", sid, "--heads", "1", "--out-dir", out]) == 0
PY
  then
    tail -5 "$out/plot.log" >&2
    echo "[demo] ERROR: attention maps of $arch failed (log: $work/$out/plot.log)" >&2
    return 1
  fi
  plot_stamp "$arch" > "$out/.done"
}
plot_stamp() { echo "$(cat "train/$1/eval/.done") plot=$plot_sid"; }
run_stage plot_one "attention maps" "plots/@ARCH@" plot_stamp "6/7 reusing the attention maps of @ARCH@" \
  "6/7 attention maps of test sentence $plot_sid, every layer and head: @ARCHS@"

# ----------------------------------------------------------------------------- 7. report
stage "7/7 scoring and report"
train_secs_str="threads=$threads parallel=$n_par "
for arch in "${arch_list[@]}"; do train_secs_str+="$arch=${train_secs[$arch]} "; done
"$py" - "$work" "$src" "$tgt" "$train_secs_str" "$budget" "$updates" "$plot_sid" "${arch_list[@]}" <<'PY'
import glob, os, re, sys
import sacrebleu
from sacremoses import MosesDetokenizer

work, src, tgt, secs, budget, cap, plot_sid, *archs = sys.argv[1:]
secs = dict(kv.split("=") for kv in secs.split())
threads, parallel = secs.pop("threads"), secs.pop("parallel")
os.chdir(work)
read = lambda p: open(p, encoding="utf-8").read().splitlines()
raw_src, raw_ref = read(f"data/raw/test.{src}"), read(f"data/raw/test.{tgt}")
tok_src, tok_ref = read(f"data/tok/test.{src}"), read(f"data/tok/test.{tgt}")
detok = MosesDetokenizer(lang=tgt)

rows, hyps = [], {}
sig = None
# trivial baseline: the untranslated source (names and numbers overlap with the reference)
bleu = sacrebleu.corpus_bleu(raw_src, [raw_ref])
tok_bleu = sacrebleu.corpus_bleu(tok_src, [tok_ref], tokenize="none", force=True)
rows.append(("copy source (baseline)", "-", "-", "-", f"{bleu.score:.2f}", f"{tok_bleu.score:.2f}"))
for arch in archs:
    run = f"train/{arch}"
    out = read(f"{run}/eval/generate.out")
    h = {}
    for line in out:
        if line.startswith("H-"):
            i, _, text = line.split("\t", 2)
            h[int(i[2:])] = text
    if len(h) != len(raw_ref):
        sys.exit(f"[demo] ERROR: {run}/eval/generate.out has {len(h)} hypotheses for {len(raw_ref)} test sentences")
    hyp = [detok.detokenize(h[i].split()) for i in range(len(raw_ref))]
    hyps[arch] = hyp
    with open(f"{run}/eval/test.hyp.detok.{tgt}", "w", encoding="utf-8") as f:
        f.writelines(x + "\n" for x in hyp)
    bleu = sacrebleu.metrics.BLEU()
    score = bleu.corpus_score(hyp, [raw_ref])
    sig = bleu.get_signature()
    m = [l for l in out if l.startswith("Generate test with beam")]
    fs = re.search(r"BLEU4? = ([0-9.]+)", m[-1]).group(1) if m else "?"
    log = open(f"{run}/train.log", encoding="utf-8").read()
    ups = re.findall(r"num_updates[ =](\d+)", log)
    params = re.search(r"num\. shared model params: ([\d,]+)|num\. model params: ([\d,]+)", log)
    params = (params.group(1) or params.group(2)) if params else "?"
    t = int(secs[arch])
    rows.append((arch, params, ups[-1] if ups else "?", f"{t // 60}m{t % 60:02d}s", f"{score.score:.2f}", fs))
    print(f"[demo] {arch}: sacreBLEU {score}", file=sys.stderr)

print(f"\nTest set: {len(raw_ref)} verses of 1 Samuel and Romans (books unseen in training), "
      f"{src}->{tgt}, beam 5, averaged checkpoints.")
print(f"sacreBLEU: detokenized, against the raw references; signature: {sig}")
print("tok. BLEU: fairseq-generate's BLEU4 on Moses-tokenized, BPE-removed text "
      "(copy-source row: the same with sacrebleu tokenize=none)")
print(f"device and budget: {budget}")
for arch in archs:
    log = open(f"train/{arch}/train.log", encoding="utf-8").read()
    if "early stop since valid performance hasn't improved" in log:
        print(f"  {arch}: stopped early (converged)")
    elif "--disable-validation" not in open(f"train/{arch}/.done", encoding="utf-8").read():
        print(f"  {arch}: did not stop early (the {cap}-update cap or DEMO_MAX_MINUTES came first): not converged")
print(f"train time: wall clock of fairseq-train, {parallel} model(s) at a time with {threads} CPU thread(s) each\n")
head = ("system", "params", "updates", "train time", "sacreBLEU", "tok. BLEU")
w = [max(len(str(r[k])) for r in rows + [head]) for k in range(len(head))]
fmt = lambda r: "| " + " | ".join(str(c).ljust(w[k]) if k == 0 else str(c).rjust(w[k]) for k, c in enumerate(r)) + " |"
print(fmt(head))
print("|" + "|".join("-" * (x + 2) for x in w) + "|")
for r in rows:
    print(fmt(r))

# five samples, spread over the test set, short enough to read
short = [i for i, r in enumerate(raw_ref) if 8 <= len(r.split()) <= 22]
picks = [short[k * len(short) // 5 + len(short) // 10] for k in range(5)]
print("\nSample translations:")
for i in picks:
    pad = max(10, max(map(len, archs)) + 1)
    print(f"\n  [{i}]")
    print(f"       {'source:':<{pad}} {raw_src[i]}")
    print(f"       {'reference:':<{pad}} {raw_ref[i]}")
    for arch in archs:
        print(f"       {arch + ':':<{max(10, max(map(len, archs)) + 1)}} {hyps[arch][i]}")

print(f"\nAttention maps of test sentence {plot_sid} ({raw_src[int(plot_sid)]!r}), every layer (rows) and head "
      "(columns), teacher-forced on the reference (ea-fairseq-analysis, docs/analysis.md):")
for arch in archs:
    for png in sorted(glob.glob(f"plots/{arch}/*.png")):
        print(f"  {os.path.join(work, png)}")
PY
stage "done in $(( (SECONDS - t_start) / 60 ))m$(( (SECONDS - t_start) % 60 ))s; outputs in $work"
