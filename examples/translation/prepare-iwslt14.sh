#!/usr/bin/env bash
# IWSLT'14 German-English, the fairseq recipe (as used by the EA and PA papers):
# Moses tokenization (as tokenizer.perl), clean (1-175 tokens, ratio 1.5), lowercase,
# joint BPE with 10k merges (subword-nmt); valid = every 23rd training pair; test =
# IWSLT14.TED.dev2010 + TEDX.dev2012 + TED.tst2010-2012 concatenated (fairseq's order).
#
#   bash examples/translation/prepare-iwslt14.sh [--joined-dictionary] [--raw-dir DIR]
#        [--no-download] [--work-dir DIR] [--dest-dir DIR] [--workers N] [--bpe-tokens N | --sentencepiece V]
#
# Dictionaries: one per language, as fairseq's recipe binarizes (8,848 German and 6,632
# English types on the full data, the PA paper's vocabulary sizes); train with
# --share-decoder-input-output-embed (train.sh does). --joined-dictionary: one dictionary
# for both, for --share-all-embeddings, into data-bin/iwslt14.joined-dictionary.de-en.
# Raw data: de-en.tgz (the WIT3 release; its original host is gone, fairseq keeps a copy
# at the URL below). With --raw-dir DIR (or EA_RAW_DIR) the file is taken from DIR and
# nothing is downloaded. Output: data-bin/iwslt14.tokenized.de-en (fairseq's name).

source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
BPE_TOKENS="${BPE_TOKENS:-10000}"
name=iwslt14.tokenized.de-en
for arg in "$@"; do if [ "$arg" = --joined-dictionary ]; then name=iwslt14.joined-dictionary.de-en; fi; done
ea_parse_args $name "$@"
EA_SEPARATE_DICTS=1
for arg in ${EA_REST[@]+"${EA_REST[@]}"}; do
  case "$arg" in
    --joined-dictionary) EA_SEPARATE_DICTS="" ;;
    *) ea_die "unknown option: $arg (see --help)" ;;
  esac
done

src=de
tgt=en
lang=de-en

# Downloaded over HTTPS. No SHA-256 of this archive is published, so ea_fetch does not download it
# unless given one (EA_SHA256="de-en.tgz=<sha256>") or told to use it unverified
# (EA_ALLOW_UNVERIFIED_DOWNLOADS=1); or place it in --raw-dir yourself (README.md).
ea_fetch "de-en.tgz=https://dl.fbaipublicfiles.com/fairseq/data/iwslt14/de-en.tgz"

ea_log "pre-processing train data"
# fairseq lowercases after cleaning; lowercasing leaves the token counts alone, so doing it
# in the same pass gives the same corpus.
for l in $src $tgt; do
  f=$(ea_find "train.tags.$lang.$l")
  ea_text --input-format iwslt-train --tokenize --lowercase -l $l -o "$TMP/train.tags.$lang.tok.$l" "$f"
done
ea_check_parallel "$TMP/train.tags.$lang.tok.$src" "$TMP/train.tags.$lang.tok.$tgt"
ea_clean "$TMP/train.tags.$lang.tok" $src $tgt "$TMP/train.tags.$lang" 1 175 1.5

ea_log "pre-processing valid/test data"
for l in $src $tgt; do
  files=()
  for t in IWSLT14.TED.dev2010 IWSLT14.TEDX.dev2012 IWSLT14.TED.tst2010 IWSLT14.TED.tst2011 IWSLT14.TED.tst2012; do
    f=$(ea_find "$t.$lang.$l.xml")
    files+=("$f")
  done
  ea_text --input-format sgm --fix-apostrophe --tokenize --lowercase -l $l -o "$TMP/test.$l" "${files[@]}"
done
ea_check_parallel "$TMP/test.$src" "$TMP/test.$tgt"

ea_log "creating train, valid, test"
for l in $src $tgt; do
  "$PYTHON" "$EA_REPO/examples/translation/nmt_text.py" split 23 "$TMP/train.tags.$lang.$l" "$TMP/valid.$l" "$TMP/train.$l"
done

ea_bpe "$TMP" "$PREP" $src $tgt train valid test
ea_binarize $src $tgt "$PREP" "$DEST"
ea_keep_subword_model
ea_done
