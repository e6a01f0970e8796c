#!/usr/bin/env bash
# Download WikiText-103 and binarise it with RoBERTa's GPT-2 BPE and dictionary, exactly as fairseq's
# examples/roberta/README.pretraining.md does.
#   examples/floater_pretrain/get_wikitext103.sh OUT_DIR      -> OUT_DIR/wikitext-103-bin
set -euo pipefail
source "$(dirname "$(realpath "${BASH_SOURCE[0]}")")/../recipe_checks.sh"
help_if_asked "$@"
OUT=${1:?usage: get_wikitext103.sh OUT_DIR}
PYTHON=${PYTHON:-python}
WORKERS=${WORKERS:-16}
mkdir -p -- "$OUT"
cd -- "$OUT"
wget -N https://s3.amazonaws.com/research.metamind.io/wikitext/wikitext-103-raw-v1.zip
unzip -o wikitext-103-raw-v1.zip
mkdir -p gpt2_bpe
for f in encoder.json vocab.bpe dict.txt; do
  wget -N -P gpt2_bpe "https://dl.fbaipublicfiles.com/fairseq/gpt2_bpe/$f"
done
for SPLIT in train valid test; do
  "$PYTHON" -m fairseq.examples.roberta.multiprocessing_bpe_encoder \
      --encoder-json gpt2_bpe/encoder.json --vocab-bpe gpt2_bpe/vocab.bpe \
      --inputs "wikitext-103-raw/wiki.${SPLIT}.raw" --outputs "wikitext-103-raw/wiki.${SPLIT}.bpe" \
      --keep-empty --workers "$WORKERS"
done
fairseq-preprocess --only-source --srcdict gpt2_bpe/dict.txt \
    --trainpref wikitext-103-raw/wiki.train.bpe --validpref wikitext-103-raw/wiki.valid.bpe \
    --testpref wikitext-103-raw/wiki.test.bpe --destdir wikitext-103-bin --workers "$WORKERS"
