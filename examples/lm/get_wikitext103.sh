#!/usr/bin/env bash
# Download WikiText-103 (word level, the tokenised release) and binarise it, as fairseq's
# examples/language_model/prepare-wikitext-103.sh + README do.
#   examples/lm/get_wikitext103.sh OUT_DIR      -> OUT_DIR/wikitext-103 (raw), OUT_DIR/wikitext-103-bin
set -euo pipefail
source "$(dirname "$(realpath "${BASH_SOURCE[0]}")")/../recipe_checks.sh"
help_if_asked "$@"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT=${1:?usage: get_wikitext103.sh OUT_DIR}
mkdir -p "$OUT"
(
  cd "$OUT"
  wget -N https://s3.amazonaws.com/research.metamind.io/wikitext/wikitext-103-v1.zip
  unzip -o wikitext-103-v1.zip
)
"$HERE/preprocess.sh" "$OUT/wikitext-103" "$OUT/wikitext-103-bin"
