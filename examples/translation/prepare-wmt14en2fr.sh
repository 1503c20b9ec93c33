#!/usr/bin/env bash
# WMT'14 English-French (EA Table 5, RAN Table 1): Europarl v7, CommonCrawl, UN (2000),
# News Commentary v9 and the 10^9 corpus (Giga-FrEn), about 36M pairs; newstest2013 as
# valid, newstest2014 (full) as test. Same text processing as prepare-wmt14en2de.sh
# (normalize punctuation, remove non-printing characters, Moses tokenization with
# aggressive hyphen splitting, joint BPE 40k merges, train/valid cleaned after BPE to 1-250
# tokens, ratio 1.5). Untokenized test sentences: DEST/test.raw.en-fr.{en,fr}.
#
#   bash examples/translation/prepare-wmt14en2fr.sh [--raw-dir DIR] [--no-download]
#        [--work-dir DIR] [--dest-dir DIR] [--workers N] [--bpe-tokens N | --sentencepiece V]
#
# Raw data (file names as expected in --raw-dir): training-parallel-europarl-v7.tgz
#   training-parallel-commoncrawl.tgz training-parallel-un.tgz training-parallel-nc-v9.tgz
#   training-giga-fren.tar dev.tgz test-full.tgz
# Output: data-bin/wmt14_en_fr (joined dictionary). Tokenizing 36M pairs in Python
# takes hours: give it --workers.

source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
BPE_TOKENS="${BPE_TOKENS:-40000}"
ea_parse_args wmt14_en_fr "$@"
ea_no_extra_args

src=en
tgt=fr

# Downloads over HTTPS, each checked against the SHA-256 after '#sha256=' before it is used
# (common.sh, ea_fetch); the digests are those TensorFlow Datasets publishes for these URLs
# (tensorflow_datasets/url_checksums/wmt*_translate.txt). No SHA-256 is published for
# dev.tgz and test-full.tgz: give them (EA_SHA256="dev.tgz=... test-full.tgz=..."), set
# EA_ALLOW_UNVERIFIED_DOWNLOADS=1, or place the files in --raw-dir yourself (README.md).
ea_fetch \
  "training-parallel-europarl-v7.tgz=https://www.statmt.org/wmt13/training-parallel-europarl-v7.tgz#sha256=0224c7c710c8a063dfd893b0cc0830202d61f4c75c17eb8e31836103d27d96e7" \
  "training-parallel-commoncrawl.tgz=https://www.statmt.org/wmt13/training-parallel-commoncrawl.tgz#sha256=c7a74e2ea01ac6c920123108627e35278d4ccb5701e15428ffa34de86fa3a9e5" \
  "training-parallel-un.tgz=https://www.statmt.org/wmt13/training-parallel-un.tgz#sha256=29141b5c1eba149a94f7a59d3b1a834b2e47fe0f8758d68dcd77a3d3f497ee47" \
  "training-parallel-nc-v9.tgz=https://www.statmt.org/wmt14/training-parallel-nc-v9.tgz#sha256=cb8953f292298e6877ae433c98912b927cb0766b303f4540512ddd286c748485" \
  "training-giga-fren.tar=https://www.statmt.org/wmt10/training-giga-fren.tar#sha256=3ff8319f6919393520559bfbc7ad6a747ec81b3abc7be9993b338d4b017b4d9a" \
  "dev.tgz=https://www.statmt.org/wmt14/dev.tgz" \
  "test-full.tgz=https://www.statmt.org/wmt14/test-full.tgz"

ea_log "pre-processing train data"
for l in $src $tgt; do
  files=()
  for c in europarl-v7.fr-en.$l commoncrawl.fr-en.$l undoc.2000.fr-en.$l \
           news-commentary-v9.fr-en.$l "giga-fren.release2.fixed.$l*"; do
    f=$(ea_find "$c"); files+=("$f")
  done
  ea_wmt_tok $l "$TMP/tok/train.$l" "${files[@]}"
done

ea_wmt14_eval_sets fren
ea_done
