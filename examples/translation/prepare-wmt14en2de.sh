#!/usr/bin/env bash
# WMT'14 English-German (EA Table 5, RAN Table 1, DropAttention): the WMT'14 training data
# (Europarl v7, CommonCrawl, News Commentary v9; 4.5M pairs), newstest2013 as valid,
# newstest2014 (full, 3003 sentences) as test. Punctuation normalization, non-printing
# characters removed, Moses tokenization with aggressive hyphen splitting (as the Perl scripts),
# joint BPE with 40k merges (subword-nmt), train/valid cleaned after BPE (1-250 tokens,
# ratio 1.5) as in fairseq's recipe. The untokenized test sentences are kept as
# DEST/test.raw.en-de.{en,de} for detokenized sacreBLEU.
#
#   bash examples/translation/prepare-wmt14en2de.sh [--wmt17-news-commentary]
#        [--raw-dir DIR] [--no-download] [--work-dir DIR] [--dest-dir DIR]
#        [--workers N] [--bpe-tokens N | --sentencepiece V]
#
# --wmt17-news-commentary: News Commentary v12 instead of v9, i.e. the training data of
#   fairseq's default prepare-wmt14en2de.sh (WMT'17's release; not what the papers used).
# Raw data (file names as the script expects them in --raw-dir):
#   training-parallel-europarl-v7.tgz training-parallel-commoncrawl.tgz
#   training-parallel-nc-v9.tgz (or training-parallel-nc-v12.tgz) dev.tgz test-full.tgz
# Output: data-bin/wmt14_en_de (data-bin/wmt14_en_de_nc12 with --wmt17-news-commentary).

source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
BPE_TOKENS="${BPE_TOKENS:-40000}"
name=wmt14_en_de
for arg in "$@"; do if [ "$arg" = --wmt17-news-commentary ]; then name=wmt14_en_de_nc12; fi; done
ea_parse_args $name "$@"

nc=v9
nc_url="https://www.statmt.org/wmt14/training-parallel-nc-v9.tgz#sha256=cb8953f292298e6877ae433c98912b927cb0766b303f4540512ddd286c748485"
for arg in ${EA_REST[@]+"${EA_REST[@]}"}; do
  case "$arg" in
    --wmt17-news-commentary)
      nc=v12
      nc_url="https://data.statmt.org/wmt17/translation-task/training-parallel-nc-v12.tgz#sha256=2b45f30ef1d550d302fd17dd3a5cbe19134ccc4c2cf50c2dae534aee600101a2" ;;
    *) ea_die "unknown option: $arg (see --help)" ;;
  esac
done

src=en
tgt=de

# Downloads over HTTPS, each checked against the SHA-256 after '#sha256=' before it is used
# (common.sh, ea_fetch); the digests are those TensorFlow Datasets publishes for these URLs
# (tensorflow_datasets/url_checksums/wmt*_translate.txt). No SHA-256 is published for
# dev.tgz and test-full.tgz: give them (EA_SHA256="dev.tgz=... test-full.tgz=..."), set
# EA_ALLOW_UNVERIFIED_DOWNLOADS=1, or place the files in --raw-dir yourself (README.md).
ea_fetch \
  "training-parallel-europarl-v7.tgz=https://www.statmt.org/wmt13/training-parallel-europarl-v7.tgz#sha256=0224c7c710c8a063dfd893b0cc0830202d61f4c75c17eb8e31836103d27d96e7" \
  "training-parallel-commoncrawl.tgz=https://www.statmt.org/wmt13/training-parallel-commoncrawl.tgz#sha256=c7a74e2ea01ac6c920123108627e35278d4ccb5701e15428ffa34de86fa3a9e5" \
  "training-parallel-nc-$nc.tgz=$nc_url" \
  "dev.tgz=https://www.statmt.org/wmt14/dev.tgz" \
  "test-full.tgz=https://www.statmt.org/wmt14/test-full.tgz"

corpora=("europarl-v7.de-en" "commoncrawl.de-en" "news-commentary-$nc.de-en")

ea_log "pre-processing train data"
for l in $src $tgt; do
  files=()
  for c in "${corpora[@]}"; do f=$(ea_find "$c.$l"); files+=("$f"); done
  ea_wmt_tok $l "$TMP/tok/train.$l" "${files[@]}"
done

ea_wmt14_eval_sets deen
ea_done
