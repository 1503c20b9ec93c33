#!/usr/bin/env bash
# WMT'17 English-Latvian, English-Finnish or English-Turkish (RAN Table 1), both directions
# in one data-bin directory:
#   lv: Europarl v8, Rapid 2016, LETA v1, DCEP, Online Books (4.46M pairs); valid
#       newsdev2017, test newstest2017
#   fi: Europarl v8, Wiki Headlines, Rapid 2016 (2.63M pairs); valid newstest2016, test
#       newstest2017
#   tr: SETIMES2 (210K pairs); valid newstest2016, test newstest2017
# Text processing as the WMT'14 recipes (normalize punctuation, remove non-printing
# characters, Moses tokenization with aggressive hyphen splitting); training pairs with
# more than 256 words removed (RAN §Settings; length ratio limit 9, clean-corpus-n.perl's
# default, as RAN states none); joint BPE with 32k
# merges (RAN: "a joint vocabulary of ... 32K tokens for the others").
#
#   bash examples/translation/prepare-wmt17.sh {lv|fi|tr} [--raw-dir DIR] [--no-download]
#        [--work-dir DIR] [--dest-dir DIR] [--workers N] [--bpe-tokens N | --sentencepiece V]
#
# Output: data-bin/wmt17_en_LANG with train.en-LANG.* and the en->LANG valid/test sets, plus
# valid/test.LANG-en.* (the LANG->en dev and test sets, binarized with the same
# dictionary): `fairseq-train data-bin/wmt17_en_lv -s lv -t en` trains LANG->en on the same
# training data. Raw test sentences: DEST/test.raw.en-LANG.* and DEST/test.raw.LANG-en.*.
# Raw data (file names as expected in --raw-dir): dev.tgz and test.tgz (WMT'17 releases),
# and per language: lv: training-parallel-ep-v8.tgz rapid2016.tgz leta.v1.tgz
# dcep.lv-en.v1.tgz books.lv-en.v1.tgz; fi: training-parallel-ep-v8.tgz wiki-titles.tgz
# rapid2016.tgz; tr: en-tr.txt.zip (SETIMES2, Moses format).

source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
BPE_TOKENS="${BPE_TOKENS:-32000}"
lang="${1:-}"
case "$lang" in
  lv|fi|tr) shift ;;
  -h|--help) ea_parse_args wmt17 --help ;;
  *) echo "usage: $0 {lv|fi|tr} [options]  (--help for details)" >&2; exit 1 ;;
esac
ea_parse_args "wmt17_en_$lang" "$@"
ea_no_extra_args

src=en
tgt=$lang
# Downloads over HTTPS, each checked against the SHA-256 after '#sha256=' before it is used
# (common.sh, ea_fetch); the digests are those TensorFlow Datasets publishes for these URLs
# (tensorflow_datasets/url_checksums/wmt*_translate.txt);
# dev.tgz's, the one a public pipeline (stagedml) pins for this URL. No SHA-256 is published for
# test.tgz, training-parallel-ep-v8.tgz, rapid2016.tgz (at these URLs) and en-tr.txt.zip: give
# them (EA_SHA256="NAME=<sha256> ..."), set EA_ALLOW_UNVERIFIED_DOWNLOADS=1, or place the files in
# --raw-dir yourself (README.md).
wmt17=https://data.statmt.org/wmt17/translation-task
files=("dev.tgz=$wmt17/dev.tgz#sha256=9d5ff04a28496b7796904ea65e50e3837bab14dbdca88b1e063105f17513dca9"
       "test.tgz=$wmt17/test.tgz")
case "$lang" in
  lv) files+=("training-parallel-ep-v8.tgz=$wmt17/training-parallel-ep-v8.tgz"
              "rapid2016.tgz=$wmt17/rapid2016.tgz"
              "leta.v1.tgz=$wmt17/leta.v1.tgz#sha256=af3f1a4cbeb503a231856baa9f1fb06c628d43ebb78b6f35a4f71e0a53f60e49"
              "dcep.lv-en.v1.tgz=$wmt17/dcep.lv-en.v1.tgz#sha256=871df6e7c96dc878f73a3864a8a2300c1c43725b3d24a7fdb560735e584bf515"
              "books.lv-en.v1.tgz=$wmt17/books.lv-en.v1.tgz#sha256=0eb70ad3e8420b131ddd29d1988d1055c72c13cef3768975a1c1a8f7662f361b")
      corpora=("europarl-v8.lv-en" "rapid2016.en-lv" "LETA-lv-en/leta" "dcep.en-lv/dcep" "farewell/farewell")
      dev=newsdev2017 ;;
  fi) files+=("training-parallel-ep-v8.tgz=$wmt17/training-parallel-ep-v8.tgz"
              "rapid2016.tgz=$wmt17/rapid2016.tgz"
              "wiki-titles.tgz=https://www.statmt.org/wmt15/wiki-titles.tgz#sha256=cd7cf81dbc99ef00b57e3106a4731b54cebcb7cff19088913cdab1c8114d3660")
      corpora=("europarl-v8.fi-en" "rapid2016.en-fi")
      dev=newstest2016 ;;
  tr) files+=("en-tr.txt.zip=https://object.pouta.csc.fi/OPUS-SETIMES/v2/moses/en-tr.txt.zip")
      corpora=("SETIMES*.en-tr")
      dev=newstest2016 ;;
esac
ea_fetch "${files[@]}"

ea_log "pre-processing train data"
for l in $src $tgt; do
  inputs=()
  for c in "${corpora[@]}"; do f=$(ea_find "$c.$l"); inputs+=("$f"); done
  ea_wmt_tok $l "$TMP/tok/train.all.$l" "${inputs[@]}"
  if [ "$lang" = fi ]; then  # Wiki Headlines: one "finnish ||| english" pair per line
    f=$(ea_find "titles.fi-en")
    if [ $l = fi ]; then side=0; else side=1; fi
    ea_wmt_tok $l "$TMP/tok/train.all.$l" --append --input-format bitext --side $side "$f"
  fi
done
ea_check_parallel "$TMP/tok/train.all.$src" "$TMP/tok/train.all.$tgt"
ea_clean "$TMP/tok/train.all" $src $tgt "$TMP/tok/train" 1 256 9

ea_log "pre-processing valid ($dev) and test (newstest2017) data, both directions"
for dir in "$src $tgt" "$tgt $src"; do
  set -- $dir
  code="$1$2"
  for l in "$1" "$2"; do
    if [ $l = "$1" ]; then t=src; else t=ref; fi
    f=$(ea_find "$dev-$code-$t.$l.sgm")
    mkdir -p "$TMP/tok/$1-$2"
    ea_wmt_tok $l "$TMP/tok/$1-$2/valid.$l" --input-format sgm "$f"
  done
  s=$(ea_find "newstest2017-$code-src.$1.sgm")
  r=$(ea_find "newstest2017-$code-ref.$2.sgm")
  ea_wmt_test "$1" "$2" "$s" "$r" "test.$1-$2"
done
for l in $src $tgt; do
  cp "$TMP/tok/$src-$tgt/valid.$l" "$TMP/tok/valid.$l"
  cp "$TMP/tok/test.$src-$tgt.$l" "$TMP/tok/test.$l"
  cp "$TMP/test.$src-$tgt.raw.$l" "$TMP/test.raw.$l"
done

ea_wmt_bpe $src $tgt 0
ea_log "subwords for the $tgt->$src valid/test sets"
mkdir -p "$PREP/$tgt-$src"
for l in $src $tgt; do
  ea_subword_apply "$TMP/tok/$tgt-$src/valid.$l" "$PREP/$tgt-$src/valid.$l"
  ea_subword_apply "$TMP/tok/test.$tgt-$src.$l" "$PREP/$tgt-$src/test.$l"
done
ea_binarize $src $tgt "$PREP" "$DEST" "$PREP/$tgt-$src"
ea_keep_subword_model
ea_keep_raw_test $src $tgt "$TMP/test.raw.$src" "$TMP/test.raw.$tgt" "$DEST"
ea_keep_raw_test $tgt $src "$TMP/test.$tgt-$src.raw.$tgt" "$TMP/test.$tgt-$src.raw.$src" "$DEST"
ea_done
