#!/usr/bin/env bash
# Your own parallel text, prepared as the WMT recipes prepare theirs: punctuation
# normalization, non-printing characters removed, Moses tokenization with aggressive hyphen
# splitting (as the Perl scripts), a joint subword model (subword-nmt BPE, or SentencePiece),
# train/valid cleaned after it (1-MAXLEN tokens, ratio 1.5), one dictionary for both languages.
#
#   bash examples/translation/prepare-own.sh SRC TGT TEXT_DIR [--dest-dir DIR] [--work-dir DIR]
#        [--workers N] [--bpe-tokens N | --sentencepiece V] [--max-len MAXLEN]
#
# TEXT_DIR holds train.SRC train.TGT valid.SRC valid.TGT test.SRC test.TGT: UTF-8, one
# untokenized sentence a line, line N of one language the translation of line N of the other
# (each file may be compressed: .gz or .xz). The test set is never cleaned, and its
# untokenized sentences are kept as DEST/test.raw.SRC-TGT.{SRC,TGT} (the references of
# detokenized sacreBLEU in evaluate.sh's wmt mode).
# --bpe-tokens N  joint BPE with N merges [10000]
# --sentencepiece V  SentencePiece instead: a joint unigram model of at most V pieces, kept as
#                 DEST/sentencepiece.bpe.model (fairseq: --bpe sentencepiece --sentencepiece-model)
# --max-len MAXLEN  train/valid pairs with a side longer than MAXLEN subwords are dropped [250;
#                 0: none]
# Output: data-bin/own.SRC-TGT (--dest-dir). Then: train.sh FAMILY own with DATA=DEST, and
# evaluate.sh CHECKPOINTS DEST wmt (examples/translation/README.md, "Your own parallel text").

if [ $# -lt 3 ] || [[ "$1" == -* ]] || [[ "$2" == -* ]] || [[ "$3" == -* ]]; then
  case "${1:-}" in
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
  esac
  echo "usage: bash $0 SRC TGT TEXT_DIR [options] (see --help)" >&2; exit 1
fi
src="$1"; tgt="$2"; text="$3"; shift 3
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
for l in "$src" "$tgt"; do
  ea_is_name "$l" || { echo "prepare-own.sh: error: SRC and TGT take a language code ([A-Za-z0-9_@-]+), not $(ea_shown "$l")" >&2; exit 1; }
done
BPE_TOKENS="${BPE_TOKENS:-10000}"
ea_parse_args "own.$src-$tgt" "$@"
maxlen=250
set -- ${EA_REST[@]+"${EA_REST[@]}"}
while [ $# -gt 0 ]; do
  case "$1" in
    --max-len) maxlen="${2:-}"; shift 2 || ea_die "--max-len takes a number" ;;
    *) ea_die "unknown option: $1 (see --help)" ;;
  esac
done
[[ "$maxlen" =~ ^[0-9]+$ ]] || ea_die "--max-len takes a number of subwords (got '$maxlen')"
[ "$src" != "$tgt" ] || ea_die "SRC and TGT are the same language ($src)"
[ -d "$text" ] || ea_die "$text is not a directory (TEXT_DIR: train/valid/test.{$src,$tgt})"

ea_log "tokenizing $text/{train,valid,test}.{$src,$tgt}"
mkdir -p "$TMP/tok"
for split in train valid test; do
  for l in $src $tgt; do
    f=""
    for ext in "" .gz .xz; do if [ -f "$text/$split.$l$ext" ]; then f="$text/$split.$l$ext"; break; fi; done
    [ -n "$f" ] || ea_die "no $text/$split.$l (nor .gz, .xz): TEXT_DIR must hold {train,valid,test}.{$src,$tgt}"
    raw=()
    if [ $split = test ]; then raw=(--raw-output "$TMP/test.raw.$l"); fi
    ea_wmt_tok $l "$TMP/tok/$split.$l" ${raw[@]+"${raw[@]}"} "$f"
  done
  ea_check_parallel "$TMP/tok/$split.$src" "$TMP/tok/$split.$tgt"
  ea_log "$split: $(ea_lines "$TMP/tok/$split.$src") pairs"
done
ea_wmt_bpe $src $tgt "$maxlen"
ea_binarize $src $tgt "$PREP" "$DEST"
ea_keep_subword_model
ea_keep_raw_test $src $tgt "$TMP/test.raw.$src" "$TMP/test.raw.$tgt" "$DEST"
ea_done
