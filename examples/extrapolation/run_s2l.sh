#!/usr/bin/env bash
# FLOATER paper section 4.3 / figure 2, "short to long": train on WMT14 En-De pairs with sources
# shorter than 80 tokens, report BLEU per source-length bin [80,100) [100,120) [120,140) [140,inf)
# on the long pairs, for each encoding in ENCODINGS, then one table and one plot.
#
#   examples/extrapolation/run_s2l.sh RAW_DIR WORK_DIR [extra fairseq-train options...]
#
# RAW_DIR: plain-text train/valid.{SRC,TGT} (e.g. from examples/translation/get_wmt14_en_de.sh).
# Environment: ENCODINGS="floater sinusoidal learned t5 at5 shaw xl alibi" (each trained as
#   transformer_<encoding>), SRC=en TGT=de THRESHOLD=80 BINS=80,100,120,140 VOCAB_SIZE=32000,
#   EVAL_ARGS (extra evaluate.py options, e.g. "--beam 4 --lenpen 0.6"), and everything
#   examples/translation/train.sh reads (LR, MAX_UPDATE, MAX_EPOCH, CPU, ...).
# Run again in the same WORK_DIR, it redoes everything (the split, the data, every model from scratch).
# Note: a learned absolute table (transformer_learned) cannot represent positions beyond its size;
# it is trained with --max-source-positions large enough for the test split, as in the paper.
set -euo pipefail
source "$(dirname "$(realpath "${BASH_SOURCE[0]}")")/../recipe_checks.sh"
help_if_asked "$@"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
TRANSLATION="$HERE/../translation"
PYTHON=${PYTHON:-python}
RAW=${1:?usage: run_s2l.sh RAW_DIR WORK_DIR [fairseq-train options]}
WORK=${2:?usage}
shift 2
ENCODINGS=${ENCODINGS:-floater sinusoidal learned t5 at5 shaw xl alibi}
SRC=${SRC:-en}
TGT=${TGT:-de}
THRESHOLD=${THRESHOLD:-80}
BINS=${BINS:-80,100,120,140}
VOCAB_SIZE=${VOCAB_SIZE:-32000}
need_outside "$RAW" "$WORK/data" "removes and remakes"
mkdir -p "$WORK"

rm -rf "$WORK/data"  # this recipe's own output, remade from the split below
"$PYTHON" "$HERE/make_s2l.py" "$RAW" "$WORK/raw" --src "$SRC" --tgt "$TGT" --threshold "$THRESHOLD"
"$PYTHON" "$TRANSLATION/prepare.py" "$WORK/raw" "$WORK/data" --src "$SRC" --tgt "$TGT" \
    --vocab-size "$VOCAB_SIZE" ${PREPARE_ARGS:-}
RESULTS=()
for ENCODING in $ENCODINGS; do
  rm -f "$WORK/$ENCODING"/checkpoint*.pt "$WORK/$ENCODING"/train.log  # train.sh would resume from an earlier run's (and append to its log)
  ARCH="transformer_$ENCODING" "$TRANSLATION/train.sh" "$WORK/data/bin" "$WORK/$ENCODING" \
      --no-epoch-checkpoints "$@"
  "$PYTHON" "$TRANSLATION/evaluate.py" "$WORK/data/bin" "$WORK/$ENCODING/checkpoint_best.pt" \
      --bins "$BINS" --json "$WORK/bleu_$ENCODING.json" ${EVAL_ARGS:-}
  RESULTS+=("$WORK/bleu_$ENCODING.json")
done
"$PYTHON" "$HERE/report.py" "${RESULTS[@]}" --out "$WORK/s2l"
