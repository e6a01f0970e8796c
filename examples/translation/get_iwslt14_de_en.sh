#!/usr/bin/env bash
# IWSLT14 De-En as plain text, following fairseq's examples/translation/prepare-iwslt14.sh (same
# archive, same tag stripping, same valid split: every 23rd training line; test = the dev2010,
# tst2010-2012 sets) but without Moses tokenisation and subword-nmt BPE: prepare.py applies
# sentencepiece instead.
#   examples/translation/get_iwslt14_de_en.sh OUT_DIR   -> OUT_DIR/{train,valid,test}.{de,en}
set -euo pipefail
source "$(dirname "$(realpath "${BASH_SOURCE[0]}")")/../recipe_checks.sh"
help_if_asked "$@"
OUT=${1:?usage: get_iwslt14_de_en.sh OUT_DIR}
mkdir -p -- "$OUT"
cd -- "$OUT"
wget -N http://dl.fbaipublicfiles.com/fairseq/data/iwslt14/de-en.tgz
tar zxf de-en.tgz
for l in de en; do
  grep -v '<url>' de-en/train.tags.de-en.$l | grep -v '<talkid>' | grep -v '<keywords>' \
    | grep -v '<speaker>' | grep -v '<reviewer' | grep -v '<translator' | grep -v '<doc' | grep -v '</doc>' \
    | sed -e 's/<title>//g; s/<\/title>//g; s/<description>//g; s/<\/description>//g' \
    | sed -e 's/^\s*//; s/\s*$//' > train.tags.$l
  awk '{if (NR%23 == 0) print $0; }' train.tags.$l > valid.$l
  awk '{if (NR%23 != 0) print $0; }' train.tags.$l > train.$l
  : > test.$l
  for f in de-en/IWSLT14.TED.dev2010.de-en.$l.xml de-en/IWSLT14.TEDX.dev2012.de-en.$l.xml \
           de-en/IWSLT14.TED.tst2010.de-en.$l.xml de-en/IWSLT14.TED.tst2011.de-en.$l.xml \
           de-en/IWSLT14.TED.tst2012.de-en.$l.xml; do
    grep '<seg id' "$f" | sed -e 's/<seg id="[0-9]*">\s*//g; s/\s*<\/seg>\s*//g' | sed -e "s/\’/\'/g" >> test.$l
  done
done
# fairseq's script drops pairs longer than 175 tokens (clean-corpus-n); prepare.py keeps everything
wc -l train.de valid.de test.de
