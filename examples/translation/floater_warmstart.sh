#!/usr/bin/env bash
# FLOATER warm start (paper appendix B.2):
#   1. train the stock transformer (30 epochs on WMT14 En-De)
#   2.-3. copy its best checkpoint into a FLOATER model (scripts/convert_transformer_checkpoint.py;
#      the dynamics start at zero, so the converted model equals the stock one)
#   4. halve the peak learning rate (7e-4 -> 3.5e-4)
#   5. retrain from the converted checkpoint (10 epochs En-De, 1 epoch En-Fr)
#   6. average the last 5 epoch checkpoints and score BLEU on the test split
#
#   examples/translation/floater_warmstart.sh DATA_BIN WORK_DIR [extra fairseq-train options...]
#
# Environment: STOCK_ARCH=transformer (fairseq's own), ARCH=transformer_floater, ENCODING=floater,
#   LR=7e-4 (peak lr of step 1; step 5 uses LR/2), STOCK_EPOCHS=30, RETRAIN_EPOCHS=10, AVERAGE=5,
#   SKIP_STOCK=1 with STOCK_CHECKPOINT=... to start from an existing stock model, and everything
#   train.sh reads (WARMUP, MAX_TOKENS, UPDATE_FREQ, MAX_UPDATE, CPU, ...). EVAL_ARGS: extra options
#   for evaluate.py (e.g. "--beam 4 --lenpen 0.6"); ENCODING_ARGS: encoding options for the conversion
#   and the FLOATER training (e.g. "--floater-method rk4"; fairseq-train builds the model from its own
#   options, --restore-file only loads weights); FLOATER_ARGS: other fairseq-train options for the
#   FLOATER step only.
# A rerun into the same WORK_DIR resumes the stock step from WORK_DIR/stock (fairseq-train's own resume;
# remove that folder to train it anew) and redoes the conversion, the FLOATER step (WORK_DIR/floater is
# emptied first: its epoch checkpoints from an earlier run would otherwise be averaged) and the scoring.
set -euo pipefail
source "$(dirname "$(realpath "${BASH_SOURCE[0]}")")/../recipe_checks.sh"
help_if_asked "$@"
if [[ -n "${CONVERT_ARGS:-}" ]]; then
  echo "CONVERT_ARGS is now ENCODING_ARGS: the encoding options, given to the conversion and to training" >&2; exit 2
fi
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
PYTHON=${PYTHON:-python}
DATA_BIN=${1:?usage: floater_warmstart.sh DATA_BIN WORK_DIR [fairseq-train options]}
WORK=${2:?usage: floater_warmstart.sh DATA_BIN WORK_DIR [fairseq-train options]}
shift 2
need_folder "$DATA_BIN" DATA_BIN
[[ -n "${SKIP_STOCK:-}" ]] && need_checkpoint "${STOCK_CHECKPOINT:-}" "STOCK_CHECKPOINT, with SKIP_STOCK"
STOCK_ARCH=${STOCK_ARCH:-transformer}
FLOATER_ARCH=${ARCH:-transformer_floater}
ENCODING=${ENCODING:-floater}
LR=${LR:-7e-4}
STOCK_EPOCHS=${STOCK_EPOCHS:-30}
RETRAIN_EPOCHS=${RETRAIN_EPOCHS:-10}
AVERAGE=${AVERAGE:-5}
for input in "$DATA_BIN" ${STOCK_CHECKPOINT:+"$STOCK_CHECKPOINT"}; do
  need_outside "$input" "$WORK/floater" "empties before its FLOATER step"
done
mkdir -p "$WORK"

# 1. the stock transformer
if [[ -z "${SKIP_STOCK:-}" ]]; then
  ARCH=$STOCK_ARCH LR=$LR MAX_EPOCH=$STOCK_EPOCHS \
      "$HERE/train.sh" "$DATA_BIN" "$WORK/stock" --no-epoch-checkpoints "$@"
fi
STOCK_CHECKPOINT=${STOCK_CHECKPOINT:-$WORK/stock/checkpoint_best.pt}

# 2.-3. convert (weights copied, dynamics initialised so that the model is unchanged; --force: $WORK is
# this recipe's own folder, a re-run replaces its earlier conversion)
"$PYTHON" "$REPO/scripts/convert_transformer_checkpoint.py" "$STOCK_CHECKPOINT" "$WORK/floater_init.pt" --force \
    --encoding "$ENCODING" ${ENCODING_ARGS:-}

# 4.-5. retrain with half the peak learning rate, keeping every epoch checkpoint (from nothing earlier)
rm -rf "$WORK/floater"
HALF_LR=$("$PYTHON" -c "print(float('$LR') / 2)")
ARCH=$FLOATER_ARCH LR=$HALF_LR MAX_EPOCH=$RETRAIN_EPOCHS RESTORE="$WORK/floater_init.pt" \
    "$HERE/train.sh" "$DATA_BIN" "$WORK/floater" ${ENCODING_ARGS:-} ${FLOATER_ARGS:-} "$@"

# 6. average the last 5 epoch checkpoints, score BLEU
"$PYTHON" "$HERE/average_checkpoints.py" --inputs "$WORK/floater" \
    --num-epoch-checkpoints "$AVERAGE" --output "$WORK/floater/averaged.pt"
"$PYTHON" "$HERE/evaluate.py" "$DATA_BIN" "$WORK/floater/averaged.pt" --json "$WORK/bleu.json" ${EVAL_ARGS:-}
