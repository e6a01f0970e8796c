#!/usr/bin/env bash
# Binarise a WikiText-style folder (wiki.train.tokens, wiki.valid.tokens, wiki.test.tokens) for
# fairseq's language_modeling task: word-level dictionary from the training split, as fairseq's
# examples/language_model README does for WikiText-103 (vocabulary 267,735 words).
#   examples/lm/preprocess.sh RAW_DIR OUT_BIN        (environment: WORKERS=20)
set -euo pipefail
source "$(dirname "$(realpath "${BASH_SOURCE[0]}")")/../recipe_checks.sh"
help_if_asked "$@"
RAW=${1:?usage: preprocess.sh RAW_DIR OUT_BIN}
OUT=${2:?usage: preprocess.sh RAW_DIR OUT_BIN}
WORKERS=${WORKERS:-20}
need_folder "$RAW" RAW_DIR
fairseq-preprocess --only-source \
    --trainpref "$RAW/wiki.train.tokens" --validpref "$RAW/wiki.valid.tokens" --testpref "$RAW/wiki.test.tokens" \
    --destdir "$OUT" --workers "$WORKERS"
