#!/usr/bin/env bash
# WMT14 En-De as plain text: the training corpora of fairseq's examples/translation/prepare-wmt14en2de.sh
# (Europarl v7, Common Crawl, News Commentary v12 — the "Attention is all you need" setup), valid =
# newstest2013, test = newstest2014 (full), the latter two taken through sacrebleu, without Moses
# tokenisation and BPE: prepare.py applies sentencepiece instead.
#   examples/translation/get_wmt14_en_de.sh OUT_DIR   -> OUT_DIR/{train,valid,test}.{en,de}
set -euo pipefail
source "$(dirname "$(realpath "${BASH_SOURCE[0]}")")/../recipe_checks.sh"
help_if_asked "$@"
OUT=${1:?usage: get_wmt14_en_de.sh OUT_DIR}
mkdir -p -- "$OUT/orig"
cd -- "$OUT"
for url in http://statmt.org/wmt13/training-parallel-europarl-v7.tgz \
           http://statmt.org/wmt13/training-parallel-commoncrawl.tgz \
           http://data.statmt.org/wmt17/translation-task/training-parallel-nc-v12.tgz; do
  wget -N -P orig "$url"
  tar zxf "orig/$(basename "$url")" -C orig
done
: > train.en; : > train.de
for corpus in orig/training/europarl-v7.de-en orig/commoncrawl.de-en orig/training/news-commentary-v12.de-en; do
  cat "$corpus.en" >> train.en
  cat "$corpus.de" >> train.de
done
sacrebleu -t wmt13 -l en-de --echo src > valid.en
sacrebleu -t wmt13 -l en-de --echo ref > valid.de
sacrebleu -t wmt14/full -l en-de --echo src > test.en
sacrebleu -t wmt14/full -l en-de --echo ref > test.de
wc -l train.en valid.en test.en
