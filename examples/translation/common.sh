# Shared steps of the prepare-*.sh recipes: fetch/unpack, tokenize, clean, BPE, binarize;
# and what every recipe (train.sh, evaluate.sh, scripts/demo.sh) shares: the check of names
# taken from file names and arguments, and the filter of fairseq's known warnings.
# Sourced, not run. The text work is done by examples/translation/nmt_text.py (the Moses Perl scripts,
# ported to Python in nmt_moses.py and tested against their outputs) and subword-nmt's Python modules;
# binarization by fairseq-preprocess.
#
# Options every prepare script accepts (each also as an environment variable):
#   --raw-dir DIR     (EA_RAW_DIR)     already-downloaded archives; nothing is downloaded then
#   --no-download     (EA_NO_DOWNLOAD=1) never touch the network
# Downloads (HTTPS) are checked against the SHA-256 the recipe keeps after '#sha256=' before
# they are used, and refused otherwise (exit code 4). A file with no published digest is not
# downloaded unless EA_SHA256="NAME=HEX ..." gives one or EA_ALLOW_UNVERIFIED_DOWNLOADS=1
# accepts it unverified (its digest is printed); EA_DOWNLOAD_MIRROR=BASE fetches NAME from
# BASE/NAME (checked the same way). Files in --raw-dir are used as they are.
#   --work-dir DIR    (EA_WORK_DIR)    raw/tokenized/BPE text       [work/NAME]
#   --dest-dir DIR    (EA_DEST_DIR)    fairseq-preprocess output    [data-bin/NAME]
#   --workers N       (WORKERS)        processes for tokenization/BPE/binarization [nproc]
#   --bpe-tokens N    (BPE_TOKENS)     BPE merge operations          [recipe's value]
#   --sentencepiece V (SENTENCEPIECE=V) SentencePiece instead of subword-nmt's BPE: one joint
#                     unigram model of at most V pieces, learnt and applied where the BPE would
#                     be (on the tokenized text), kept as DEST/sentencepiece.bpe.model
# Tools: PYTHON (python3 from PATH), which must have fairseq, sacremoses, regex, subword-nmt
# (and sentencepiece for --sentencepiece).

set -euo pipefail

EA_REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-python3}"

# ea_is_name VALUE: VALUE is a plain name ([A-Za-z0-9_@-]+: a language such as sr@latin, a
# split, an arch).
# Names taken from file names or arguments are checked with it before any use; none is ever
# pasted into a sed/awk program or eval.
ea_is_name() { [[ "$1" =~ ^[A-Za-z0-9_@-]+$ ]]; }
# ea_write [--append] [--from SRC] [--within DIR] FILE: standard input (or SRC, a regular file
# inside its own directory) to FILE (for > FILE, >> FILE, cp SRC FILE) through a new file renamed
# onto it (scripts/safe_write.py): a link planted under FILE's name is never written through;
# --within: refused unless FILE's directory resolves inside DIR.
ea_write() { "$PYTHON" "$EA_REPO/scripts/safe_write.py" "$@"; }
# ea_inside DIR TOP: DIR, links followed, resolves inside TOP (ea_write --within's test);
# otherwise false, with where it leads on standard output, one line
ea_inside() { "$PYTHON" "$EA_REPO/scripts/safe_write.py" --within "$2" --check "$1"; }
# ea_shown VALUE: VALUE quoted for a one-line message (newlines and control characters
# escaped, as bash's printf %q writes them).
ea_shown() { printf '%q' "$1"; }

# ea_direction DATA SUBSET HOW: sets ea_src and ea_tgt to the one direction of the binarized
# files DATA/SUBSET.SRC-TGT.SRC.idx, each language checked with ea_is_name before use; dies
# (the caller's die) on none, on several, or on a name that is not a language code, with HOW
# (how to give the direction instead, e.g. "SRC=.. TGT..") in the message.
ea_direction() {
  local data="$1" subset="$2" how="$3" f name l found pairs=()
  for f in "$data/$subset".*.idx; do
    name="${f#"$data/$subset".}"
    [[ "$name" =~ ^([^.]*)-([^.]*)\.([^.]*)\.idx$ ]] && [ "${BASH_REMATCH[1]}" = "${BASH_REMATCH[3]}" ] || continue
    found=("${BASH_REMATCH[1]}" "${BASH_REMATCH[2]}")  # (ea_is_name resets BASH_REMATCH)
    for l in "${found[@]}"; do
      ea_is_name "$l" || die "$data: the file name $(ea_shown "${f##*/}") gives the language $(ea_shown "$l"), not a language code ([A-Za-z0-9_@-]+): refused; rename the files or give $how"
    done
    pairs+=("${found[*]}")
  done
  [ ${#pairs[@]} -gt 0 ] || die "no $subset.SRC-TGT.SRC.idx in $data: is it fairseq-preprocess output? (examples/translation/prepare-own.sh)"
  [ ${#pairs[@]} -eq 1 ] || die "$data holds several directions (${pairs[*]}): give $how"
  read -r ea_src ea_tgt <<< "${pairs[0]}"
}

# ea_quiet: stdin to stdout without the warnings fairseq's stack prints on every run (hydra's
# deprecation warnings, hydra's DEBUG lines, torch.cuda.amp's FutureWarning, the pin_memory
# and mismatched-mask UserWarnings, torchaudio's missing extension), each with the lines of
# its message and its source line; everything else, tracebacks and errors included, passes
# unchanged. EA_FAIRSEQ_SHOW_WARNINGS=1 turns the filter off.
ea_quiet() {
  if [ -n "${EA_FAIRSEQ_SHOW_WARNINGS:-}" ] && [ "${EA_FAIRSEQ_SHOW_WARNINGS}" != 0 ]; then cat; return; fi
  awk '
    function known(text) {
      return text ~ /is no longer experimental|version_base parameter is not specified|deprecated keyword in package header|is validated against ConfigStore schema|strict flag in the compose API is deprecated|torch\.cuda\.amp\.[A-Za-z_]*\(args\.\.\.\)` is deprecated|.pin_memory. argument is set as true but no accelerator|mismatched key_padding_mask and attn_mask is deprecated|Failed to load image Python extension|torchaudio\/_extension|No module named .torchaudio/
    }
    function flush() { if (n && !drop) for (i = 1; i <= n; i++) print buf[i]; n = 0; drop = 0; sys = 0 }
    /^DEBUG:hydra[.:]/ { flush(); fflush(); next }
    /^(sys:[0-9]+|[^ \t].*:[0-9]+): [A-Za-z0-9_.]*Warning: ?/ {
      flush(); buf[++n] = $0; drop = known($0); sys = ($0 ~ /^sys:/); next
    }
    n && /^  / { buf[++n] = $0; if (known($0)) drop = 1; flush(); fflush(); next }
    n && sys && /^See https:\/\/hydra\.cc\// { buf[++n] = $0; flush(); fflush(); next }
    n && (/^Traceback / || /^\[/ || n > 12) { flush(); print; fflush(); next }
    n { buf[++n] = $0; if (known($0)) drop = 1; next }
    { print; fflush() }
    END { flush() }
  '
}

ea_log() { echo "[$EA_NAME] $*" >&2; }
ea_die() { echo "[$EA_NAME] error: $*" >&2; exit 1; }

# ea_parse_args NAME "$@": sets RAW_DIR NO_DOWNLOAD WORK DEST WORKERS BPE_TOKENS ORIG TMP PREP;
# options the recipe itself defines are left in the array EA_REST.
ea_parse_args() {
  EA_NAME="$1"; shift
  SENTENCEPIECE="${SENTENCEPIECE:-}"
  RAW_DIR="${EA_RAW_DIR:-}"
  NO_DOWNLOAD="${EA_NO_DOWNLOAD:-}"
  WORK="${EA_WORK_DIR:-work/$EA_NAME}"
  DEST="${EA_DEST_DIR:-data-bin/$EA_NAME}"
  WORKERS="${WORKERS:-$(nproc 2>/dev/null || echo 1)}"
  EA_REST=()
  while [ $# -gt 0 ]; do
    case "$1" in
      --raw-dir) RAW_DIR="$2"; shift 2 ;;
      --no-download) NO_DOWNLOAD=1; shift ;;
      --work-dir) WORK="$2"; shift 2 ;;
      --dest-dir) DEST="$2"; shift 2 ;;
      --workers) WORKERS="$2"; shift 2 ;;
      --bpe-tokens) BPE_TOKENS="$2"; EA_BPE_TOKENS_GIVEN=1; shift 2 ;;
      --sentencepiece) SENTENCEPIECE="$2"; shift 2 ;;
      -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
      *) EA_REST+=("$1"); shift ;;
    esac
  done
  if [ -n "$RAW_DIR" ] && [ ! -d "$RAW_DIR" ]; then ea_die "--raw-dir $RAW_DIR is not a directory"; fi
  if [ -n "$SENTENCEPIECE" ]; then
    [[ "$SENTENCEPIECE" =~ ^[1-9][0-9]*$ ]] || ea_die "--sentencepiece takes a vocabulary size (got '$SENTENCEPIECE')"
    [ -z "${EA_BPE_TOKENS_GIVEN:-}" ] || ea_die "--bpe-tokens and --sentencepiece: choose one subword model"
    "$PYTHON" -c "import sentencepiece" 2>/dev/null \
      || ea_die "--sentencepiece needs the sentencepiece package in $PYTHON: pip install 'ea_fairseq[recipes]'"
  fi
  ORIG="$WORK/orig"; TMP="$WORK/tmp"; PREP="$WORK/prep"
  mkdir -p "$ORIG" "$TMP" "$PREP"
}

ea_no_extra_args() {
  if [ ${#EA_REST[@]} -gt 0 ]; then ea_die "unknown option(s): ${EA_REST[*]} (see --help)"; fi
}

# ea_fetch NAME=URL ...: every file into $ORIG (from $RAW_DIR, else downloaded) and unpacked
# to $ORIG/<NAME without extension>/; stops with the list of missing files otherwise.
ea_fetch() {
  local opts=()
  if [ -n "$RAW_DIR" ]; then opts+=(--raw-dir "$RAW_DIR"); fi
  if [ -n "$NO_DOWNLOAD" ]; then opts+=(--no-download); fi
  local rc=0
  "$PYTHON" "$EA_REPO/examples/translation/nmt_text.py" fetch --orig "$ORIG" ${opts[@]+"${opts[@]}"} "$@" || rc=$?
  case $rc in
    0) ;;
    2) echo "[$EA_NAME] stopped: raw data missing (see above)" >&2; exit 2 ;;
    *) exit $rc ;;  # a damaged archive: nmt_text.py said which
  esac
}

# ea_find PATTERN...: path of the first file under $ORIG matching the first matching glob.
ea_find() { "$PYTHON" "$EA_REPO/examples/translation/nmt_text.py" find --any "$ORIG" "$@"; }

# ea_text [nmt_text.py text options] INPUT...
ea_text() { "$PYTHON" "$EA_REPO/examples/translation/nmt_text.py" text --workers "$WORKERS" "$@"; }

ea_lines() { wc -l < "$1" | tr -d ' '; }

# ea_check_parallel A B: same number of lines, or stop.
ea_check_parallel() {
  local a b; a=$(ea_lines "$1"); b=$(ea_lines "$2")
  [ "$a" = "$b" ] || ea_die "$1 has $a lines but $2 has $b"
}

# ea_clean IN_PREFIX L1 L2 OUT_PREFIX MIN MAX [RATIO]: clean-corpus-n.perl.
ea_clean() {
  "$PYTHON" "$EA_REPO/examples/translation/nmt_text.py" clean --ratio "${7:-1.5}" "$1" "$2" "$3" "$4" "$5" "$6"
}

# The subword model of the recipe: subword-nmt's BPE codes, or with --sentencepiece a
# SentencePiece model (fairseq's file name for one, which its hub finds in a model directory).
EA_SPM_MODEL=sentencepiece.bpe.model
ea_subword_model() { if [ -n "$SENTENCEPIECE" ]; then echo "$PREP/$EA_SPM_MODEL"; else echo "$PREP/code"; fi; }

# ea_subword_apply IN OUT: segment IN with the learnt model.
ea_subword_apply() {
  if [ -n "$SENTENCEPIECE" ]; then
    "$PYTHON" "$EA_REPO/examples/translation/nmt_text.py" spm-encode --model "$PREP/$EA_SPM_MODEL" \
      --workers "$WORKERS" -i "$1" -o "$2"
  else
    "$PYTHON" -m subword_nmt.apply_bpe -c "$PREP/code" --num-workers "$WORKERS" -i "$1" -o "$2"
  fi
}

# ea_bpe DIR_IN DIR_OUT SRC TGT SPLIT...: learn a joint subword model on DIR_IN/train.{SRC,TGT}
# (BPE of BPE_TOKENS merges, or SentencePiece of SENTENCEPIECE pieces) and apply it to
# DIR_IN/SPLIT.{SRC,TGT} -> DIR_OUT/SPLIT.{SRC,TGT}.
ea_bpe() {
  local din="$1" dout="$2" src="$3" tgt="$4"; shift 4
  if [ -n "$SENTENCEPIECE" ]; then
    ea_log "learning a joint SentencePiece model (at most $SENTENCEPIECE pieces) on $din/train.{$src,$tgt}"
    "$PYTHON" "$EA_REPO/examples/translation/nmt_text.py" spm-learn --vocab-size "$SENTENCEPIECE" \
      --model-prefix "$PREP/${EA_SPM_MODEL%.model}" --workers "$WORKERS" "$din/train.$src" "$din/train.$tgt"
  else
    ea_log "learning joint BPE ($BPE_TOKENS merges) on $din/train.{$src,$tgt}"
    cat "$din/train.$src" "$din/train.$tgt" > "$TMP/bpe-train.joint"
    "$PYTHON" -m subword_nmt.learn_bpe -s "$BPE_TOKENS" --num-workers "$WORKERS" \
      -i "$TMP/bpe-train.joint" -o "$PREP/code"
    rm -f "$TMP/bpe-train.joint"
  fi
  local split l
  for split in "$@"; do
    for l in "$src" "$tgt"; do ea_subword_apply "$din/$split.$l" "$dout/$split.$l"; done
  done
}

# ea_keep_subword_model: the subword model next to the binarized data (and not the other kind,
# which evaluate.sh would take for this data's)
ea_keep_subword_model() {
  rm -f "$DEST/code" "$DEST/$EA_SPM_MODEL"
  cp "$(ea_subword_model)" "$DEST/"
}

# ea_binarize SRC TGT TEXT_DIR DEST [REVERSE_TEXT_DIR]: fairseq-preprocess of
# TEXT_DIR/{train,valid,test}.{SRC,TGT} into DEST, with a joined dictionary, or with one
# dictionary per language when EA_SEPARATE_DICTS=1 (fairseq's IWSLT'14 recipe); with
# REVERSE_TEXT_DIR also its valid/test sets as the TGT->SRC direction, same dictionary
# (DEST/{valid,test}.TGT-SRC.*). Both runs share one process (examples/translation/binarize.py).
ea_binarize() {
  local src="$1" tgt="$2" dir="$3" dest="$4" rev="${5:-}" dict=(--joined-dictionary)
  if [ -n "${EA_SEPARATE_DICTS:-}" ]; then dict=(); fi
  ea_log "binarizing $dir -> $dest (${dict[*]:-separate dictionaries})"
  mkdir -p "$dest"
  rm -f "$dest/dict.$src.txt" "$dest/dict.$tgt.txt"
  local runs=(--source-lang "$src" --target-lang "$tgt"
              --trainpref "$dir/train" --validpref "$dir/valid" --testpref "$dir/test"
              --destdir "$dest" ${dict[@]+"${dict[@]}"} --workers "$WORKERS")
  local scratch="$TMP/binarize-$tgt-$src"
  rm -rf "$scratch"
  if [ -n "$rev" ]; then
    runs+=(--- --source-lang "$tgt" --target-lang "$src"
           --validpref "$rev/valid" --testpref "$rev/test"
           --srcdict "$dest/dict.$tgt.txt" --tgtdict "$dest/dict.$src.txt"
           --destdir "$scratch" --workers "$WORKERS")
  fi
  "$PYTHON" "$EA_REPO/examples/translation/binarize.py" "${runs[@]}"
  if [ -n "$rev" ]; then
    mv "$scratch"/*.bin "$scratch"/*.idx "$dest"/
    rm -rf "$scratch"
  fi
}

# ea_keep_raw_test SRC TGT RAW_SRC RAW_TGT DEST: the untokenized test sentences, next to the
# binarized data, as DEST/test.raw.SRC-TGT.{SRC,TGT}: evaluate.sh scores sacreBLEU against them.
ea_keep_raw_test() {
  cp "$3" "$5/test.raw.$1-$2.$1"
  cp "$4" "$5/test.raw.$1-$2.$2"
}

ea_done() {
  local model="BPE codes in $DEST/code"
  [ -z "$SENTENCEPIECE" ] || model="SentencePiece model in $DEST/$EA_SPM_MODEL"
  ea_log "done: $DEST ($(ls "$DEST" | wc -l | tr -d ' ') files); $model"
}

# ---------------------------------------------------------------- WMT steps (shared by the
# prepare-wmt*.sh recipes): normalize punctuation, drop non-printing characters, tokenize
# with aggressive hyphen splitting, as fairseq's WMT recipes.

# ea_wmt_tok LANG OUT [nmt_text.py text options] FILE...
ea_wmt_tok() {
  local l="$1" out="$2"; shift 2
  mkdir -p "$(dirname "$out")"
  ea_text --normalize-punct --remove-non-printing --tokenize --aggressive-dash -l "$l" -o "$out" "$@"
}

# ea_wmt_test SRC TGT SRC_SGM TGT_SGM [NAME]: NAME (test) from SGML: the raw sentences to
# $TMP/NAME.raw.{SRC,TGT} (sacreBLEU references), tokenized ones to $TMP/tok/NAME.*
# (fairseq's recipes tokenize test sets without punctuation normalization).
ea_wmt_test() {
  local src="$1" tgt="$2" name="${5:-test}"
  mkdir -p "$TMP/tok"
  ea_text --input-format sgm --raw-output "$TMP/$name.raw.$src" --fix-apostrophe --tokenize \
    --aggressive-dash -l "$src" -o "$TMP/tok/$name.$src" "$3"
  ea_text --input-format sgm --raw-output "$TMP/$name.raw.$tgt" --fix-apostrophe --tokenize \
    --aggressive-dash -l "$tgt" -o "$TMP/tok/$name.$tgt" "$4"
  ea_check_parallel "$TMP/tok/$name.$src" "$TMP/tok/$name.$tgt"
}

# ea_wmt_bpe SRC TGT MAXLEN: joint BPE (or SentencePiece) learnt on $TMP/tok/train.*, applied to
# train/valid/test; train and valid cleaned after BPE (1-MAXLEN tokens, ratio 1.5; MAXLEN 0:
# no cleaning) -> $PREP/{train,valid,test}.*
ea_wmt_bpe() {
  local src="$1" tgt="$2" maxlen="$3" l split
  ea_check_parallel "$TMP/tok/train.$src" "$TMP/tok/train.$tgt"
  ea_check_parallel "$TMP/tok/valid.$src" "$TMP/tok/valid.$tgt"
  mkdir -p "$TMP/bpe"
  ea_bpe "$TMP/tok" "$TMP/bpe" "$src" "$tgt" train valid test
  for split in train valid; do
    if [ "$maxlen" -gt 0 ]; then
      ea_clean "$TMP/bpe/$split" "$src" "$tgt" "$PREP/$split" 1 "$maxlen" 1.5
    else
      for l in "$src" "$tgt"; do cp "$TMP/bpe/$split.$l" "$PREP/$split.$l"; done
    fi
  done
  for l in "$src" "$tgt"; do cp "$TMP/bpe/test.$l" "$PREP/test.$l"; done
}

# ea_wmt_finish SRC TGT MAXLEN: ea_wmt_bpe, then binarize to $DEST with the subword model and
# the raw test sentences ($TMP/test.raw.*).
ea_wmt_finish() {
  ea_wmt_bpe "$1" "$2" "$3"
  ea_binarize "$1" "$2" "$PREP" "$DEST"
  ea_keep_subword_model
  ea_keep_raw_test "$1" "$2" "$TMP/test.raw.$1" "$TMP/test.raw.$2" "$DEST"
}

# WMT'14 valid (newstest2013) and test (newstest2014) sets, then the shared finish.
# $1: the test set's pair code in the sgm file names (deen, fren).
ea_wmt14_eval_sets() {
  local pair=$1 l f fmt
  ea_log "pre-processing valid (newstest2013) and test (newstest2014) data"
  for l in $src $tgt; do
    f=$(ea_find "dev/newstest2013.$l" "newstest2013-src.$l.sgm" "newstest2013-ref.$l.sgm")
    fmt=plain; case "$f" in *.sgm) fmt=sgm ;; esac
    ea_wmt_tok $l "$TMP/tok/valid.$l" --input-format $fmt "$f"
  done
  ea_wmt_test $src $tgt "$(ea_find "newstest2014-$pair-src.$src.sgm")" "$(ea_find "newstest2014-$pair-ref.$tgt.sgm")"
  ea_wmt_finish $src $tgt 250
}
