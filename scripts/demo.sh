#!/usr/bin/env bash
# The README's demo: Transformer-Lite vs EA-Transformer-Lite on a small, real, offline
# Spanish->English corpus (the Bible, examples/translation/bible-es-en), on CPU.
#
#   bash scripts/demo.sh                      # ~17 min on an idle 2-core CPU, setup included
#   DEMO_UPDATES=300 bash scripts/demo.sh     # quicker (and weaker) run
#
# Reference run (2 cores shared with other jobs, so slower than idle: 24 min in all, of
# which setup 1.5 min, data 1 min, training 16.7 / 19.7 min side by side, translation 2 min):
#   copy source 0.10, transformer_lite 4.56, ea_transformer_lite 4.18 detokenized sacreBLEU
# after 600 updates (~1.1 epochs): a smoke test of the whole pipeline, not a benchmark.
#
# Stages: (1) the pinned environment (scripts/setup_env.sh, reused when up to date);
# (2) data: decompress the shipped corpus, Moses-tokenize (sacremoses), learn and apply a
# joint BPE (subword-nmt), binarize (fairseq-preprocess --joined-dictionary); (3) train
# both architectures for the same number of updates with the same seed and settings;
# (4) average each run's last checkpoints; (5) translate the test set (beam 5) and score
# it: detokenized sacreBLEU and fairseq's tokenized BLEU, next to a copy-the-source
# baseline; (6) a summary table and a few sample translations.
#
# Environment variables (defaults in brackets):
#   DEMO_DIR          work directory [runs/demo in the repository]
#   DEMO_UPDATES      training updates per model [600]
#   DEMO_MAX_TOKENS   tokens per batch [2048]
#   DEMO_LR           peak learning rate [0.0015]      DEMO_WARMUP  warmup updates [200]
#   DEMO_DROPOUT      dropout [0.0]                   DEMO_SEED    seed [1]
#   DEMO_BPE_MERGES   joint BPE merge operations [6000]
#   DEMO_AVG          checkpoints averaged [5], saved every DEMO_SAVE_EVERY [DEMO_UPDATES/20] updates
#   DEMO_ARCHS        architectures ["transformer_lite ea_transformer_lite"]
#   DEMO_MAX_MINUTES  optional wall-clock cap per training (fairseq --stop-time-hours); a run
#                     stopped by it has fewer updates (the table shows how many)
#   DEMO_PARALLEL     models trained (and evaluated) at the same time [all of them]
#   DEMO_THREADS      torch CPU threads per model [cores / DEMO_PARALLEL]
#   DEMO_FRESH=1      redo every stage (by default finished stages of an identical
#                     configuration in DEMO_DIR are reused)
#   EA_FAIRSEQ_VENV   the virtualenv scripts/setup_env.sh creates/uses [.venv in the repository]
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
work="${DEMO_DIR:-$repo/runs/demo}"
updates="${DEMO_UPDATES:-600}"
max_tokens="${DEMO_MAX_TOKENS:-2048}"
lr="${DEMO_LR:-0.0015}"
warmup="${DEMO_WARMUP:-200}"
dropout="${DEMO_DROPOUT:-0.0}"
seed="${DEMO_SEED:-1}"
merges="${DEMO_BPE_MERGES:-6000}"
n_avg="${DEMO_AVG:-5}"
save_every="${DEMO_SAVE_EVERY:-$(( updates / 20 > 0 ? updates / 20 : 1 ))}"
archs="${DEMO_ARCHS:-transformer_lite ea_transformer_lite}"
max_minutes="${DEMO_MAX_MINUTES:-}"
corpus="$repo/examples/translation/bible-es-en"
src=es
tgt=en

t_start=$SECONDS
stage() { printf '\n[demo %s +%dm%02ds] %s\n' "$(date +%H:%M:%S)" $(( (SECONDS - t_start) / 60 )) $(( (SECONDS - t_start) % 60 )) "$*" >&2; }
info() { printf '[demo] %s\n' "$*" >&2; }
die() { printf '[demo] ERROR: %s\n' "$*" >&2; exit 1; }
trap 'rc=$?; [ $rc -eq 0 ] || printf "[demo] FAILED (exit %d) in the stage above; logs are in %s\n" $rc "$work" >&2' EXIT

for v in "$updates" "$max_tokens" "$warmup" "$seed" "$merges" "$n_avg" "$save_every"; do
  [[ "$v" =~ ^[0-9]+$ ]] && [ "$v" -gt 0 ] || die "DEMO_UPDATES, DEMO_MAX_TOKENS, DEMO_WARMUP, DEMO_SEED, DEMO_BPE_MERGES, DEMO_AVG and DEMO_SAVE_EVERY must be positive integers (got '$v')"
done
if [ -n "$max_minutes" ]; then [[ "$max_minutes" =~ ^[0-9]+([.][0-9]+)?$ ]] || die "DEMO_MAX_MINUTES must be a number of minutes"; fi
for split in train valid test; do
  for l in $src $tgt; do
    [ -f "$corpus/$split.$l.xz" ] || die "missing $corpus/$split.$l.xz (the shipped corpus; rebuild it with scripts/build_bible_corpus.py)"
  done
done
command -v xz >/dev/null || die "xz is not installed (apt-get install xz-utils)"

# ----------------------------------------------------------------------------- 1. environment
stage "1/6 environment: bash scripts/setup_env.sh"
bash "$repo/scripts/setup_env.sh" || die "scripts/setup_env.sh failed (see above)"
venv="${EA_FAIRSEQ_VENV:-$repo/.venv}"
py="$venv/bin/python"
for tool in python fairseq-preprocess fairseq-train fairseq-generate subword-nmt; do
  [ -x "$venv/bin/$tool" ] || die "$venv/bin/$tool not found: the environment is incomplete (remove $venv and rerun)"
done
"$py" -c "import sacrebleu, sacremoses, subword_nmt" 2>/dev/null || die "sacrebleu/sacremoses/subword-nmt missing in $venv"
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}"  # torchaudio's missing C extension etc.
[ -z "${DEMO_FRESH:-}" ] || { info "DEMO_FRESH set: removing $work"; rm -rf "$work"; }
mkdir -p "$work"
cd "$work"

# A stage is reused when its stamp holds the same configuration string.
done_with() { [ -f "$1/.done" ] && [ "$(cat "$1/.done")" = "$2" ]; }

# ----------------------------------------------------------------------------- 2. data
data_cfg="corpus=$(cat "$corpus"/*.xz | sha256sum | cut -c1-16) merges=$merges"
if done_with data "$data_cfg"; then
  stage "2/6 data: reusing $work/data ($data_cfg)"
else
  stage "2/6 data: decompress, tokenize (sacremoses), joint BPE ($merges merges), binarize"
  rm -rf data && mkdir -p data/raw data/tok data/bpe
  for split in train valid test; do
    for l in $src $tgt; do xz -dc "$corpus/$split.$l.xz" > "data/raw/$split.$l"; done
  done
  wc -l data/raw/* | sed 's/^/[demo]   /' >&2
  info "Moses tokenization (both languages in parallel)"
  pids=()
  for l in $src $tgt; do
    "$py" - "$l" data/raw data/tok <<'PY' &
import sys
from sacremoses import MosesPunctNormalizer, MosesTokenizer
lang, raw, out = sys.argv[1:]
norm, tok = MosesPunctNormalizer(lang=lang), MosesTokenizer(lang=lang)
for split in ("train", "valid", "test"):
    with open(f"{raw}/{split}.{lang}", encoding="utf-8") as fin, open(f"{out}/{split}.{lang}", "w", encoding="utf-8") as fout:
        for line in fin:
            fout.write(tok.tokenize(norm.normalize(line.strip()), escape=False, return_str=True,
                                    aggressive_dash_splits=True) + "\n")
PY
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

# ----------------------------------------------------------------------------- 3. training
# The models train side by side, each with its own share of the cores (one core each on a
# 2-core machine): on CPU this beats training them one after the other with all cores,
# since a small model does not scale across threads, and an OpenMP thread pool slows down
# badly when a core is shared. Both runs see the same conditions, so their times compare.
read -r -a arch_list <<< "$archs"
n_arch=${#arch_list[@]}
[ "$n_arch" -gt 0 ] || die "DEMO_ARCHS is empty"
if [ -n "${DEMO_PARALLEL:-}" ]; then n_par="$DEMO_PARALLEL"; else n_par=$n_arch; fi
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
  --disable-validation --cpu --num-workers 0 --log-format simple --log-interval 25 --no-progress-bar
)
[ -z "$max_minutes" ] || train_args+=(--stop-time-hours "$(awk "BEGIN{print $max_minutes/60}")")
# fairseq's log, minus Python warnings (torchaudio's missing C extension, hydra deprecations)
quiet() { grep --line-buffered -vE "Warning|warn\(|deprecat|torchaudio|tensorboardX|^\s*$|^  " || true; }

train_one() {  # arch -> trains into train/$arch, logs there and (prefixed) to stderr
  local arch=$1 run="train/$1" t0=$SECONDS
  rm -rf "$run" && mkdir -p "$run"
  set +e
  "$venv/bin/fairseq-train" "${train_args[@]}" --arch "$arch" --save-dir "$run" 2>&1 \
    | quiet | tee "$run/train.log" | sed -u "s/^/[$arch] /" >&2
  local rc=${PIPESTATUS[0]}
  set -e
  [ "$rc" -eq 0 ] || { echo "[demo] ERROR: fairseq-train failed for $arch (exit $rc, log: $work/$run/train.log)" >&2; return "$rc"; }
  echo $(( SECONDS - t0 )) > "$run/train_seconds"
  echo "$cfg_prefix --arch $arch" > "$run/.done"
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
cfg_prefix="$data_cfg threads=$threads ${train_args[*]}"
todo=()
for arch in "${arch_list[@]}"; do
  if done_with "train/$arch" "$cfg_prefix --arch $arch"; then
    stage "3/6 training: reusing $work/train/$arch"
  else
    todo+=("$arch")
  fi
done
if [ ${#todo[@]} -gt 0 ]; then
  stage "3/6 training ${todo[*]}: $updates updates each, seed $seed, $max_tokens tokens/batch, $n_par at a time with $threads thread(s) each (logs: $work/train/ARCH/train.log)"
  in_parallel train_one "training" "${todo[@]}"
fi
declare -A train_secs
for arch in "${arch_list[@]}"; do train_secs[$arch]=$(cat "train/$arch/train_seconds"); done

# ----------------------------------------------------------------------------- 4.+5. averaging, translation
gen_args=(--source-lang $src --target-lang $tgt --gen-subset test --beam 5 --remove-bpe
          --max-tokens 6000 --required-batch-size-multiple 1 --max-len-a 1.5 --max-len-b 10
          --cpu --num-workers 0)
# --required-batch-size-multiple 1: with the default (8) fairseq 0.12 silently drops the last
# batch when it is not full (facebookresearch/fairseq#5036), i.e. a few test sentences.

eval_one() {  # arch -> train/$arch/eval/{averaged.pt,generate.out}
  local arch=$1 run="train/$1" t0=$SECONDS
  rm -rf "$run/eval" && mkdir -p "$run/eval"
  if [ -f "$repo/scripts/average_checkpoints.py" ]; then
    "$py" "$repo/scripts/average_checkpoints.py" --inputs "$run" --num-update-checkpoints "$n_avg" \
      --output "$run/eval/averaged.pt" 2>&1 | sed "s/^/[$arch] /" >&2
    [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "[demo] ERROR: scripts/average_checkpoints.py failed for $arch" >&2; return 1; }
  else
    echo "[$arch] scripts/average_checkpoints.py not found: translating with checkpoint_last.pt" >&2
    cp "$run/checkpoint_last.pt" "$run/eval/averaged.pt"
  fi
  if ! "$venv/bin/fairseq-generate" data/bin --user-dir "$repo/ea_fairseq" --path "$run/eval/averaged.pt" \
      "${gen_args[@]}" > "$run/eval/generate.out" 2> "$run/eval/generate.log"; then
    tail -20 "$run/eval/generate.log" >&2
    echo "[demo] ERROR: fairseq-generate failed for $arch (log: $work/$run/eval/generate.log)" >&2
    return 1
  fi
  echo "[$arch] $(grep -E '^Generate test with beam' "$run/eval/generate.out" || true)" >&2
  echo "[$arch] translated in $(( SECONDS - t0 ))s" >&2
  echo "$(cat "$run/.done") avg=$n_avg ${gen_args[*]}" > "$run/eval/.done"
}
todo=()
for arch in "${arch_list[@]}"; do
  if done_with "train/$arch/eval" "$(cat "train/$arch/.done") avg=$n_avg ${gen_args[*]}"; then
    stage "4-5/6 reusing the averaged checkpoint and translations of $arch"
  else
    todo+=("$arch")
  fi
done
if [ ${#todo[@]} -gt 0 ]; then
  stage "4-5/6 averaging the last $n_avg checkpoints and translating the test set (beam 5): ${todo[*]}"
  in_parallel eval_one "averaging/translation" "${todo[@]}"
fi

# ----------------------------------------------------------------------------- 6. report
stage "6/6 scoring and report"
train_secs_str="threads=$threads parallel=$n_par "
for arch in "${arch_list[@]}"; do train_secs_str+="$arch=${train_secs[$arch]} "; done
"$py" - "$work" "$src" "$tgt" "$train_secs_str" "${arch_list[@]}" <<'PY'
import os, re, sys
import sacrebleu
from sacremoses import MosesDetokenizer

work, src, tgt, secs, *archs = sys.argv[1:]
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
PY
stage "done in $(( (SECONDS - t_start) / 60 ))m$(( (SECONDS - t_start) % 60 ))s; outputs in $work"
