#!/usr/bin/env bash
# Train the LFHC/GCDF paper's text classifier from scratch (Qu et al. 2021, section 4.1 and table 4):
# an 8-layer, 8-head, 512-dim Transformer encoder (FFN 2048) with one encoding, fairseq's
# sentence_prediction task, AdamW lr 2e-5, batch 64, dropout 0.15, clip 0.25, the paper's warm-up and
# number of updates per data set, validation every "eval interval" updates, best checkpoint by accuracy.
#
#   examples/classification/train.sh TASK DATA_BIN SAVE_DIR [extra fairseq-train options...]
#
# TASK: IMDB SST-2 SNLI QNLI QQP MNLI (DATA_BIN from preprocess.py / examples/glue/preprocess_glue.py).
# Environment (defaults = the paper): ENCODING=gcdf (architecture roberta_<ENCODING>), LAYERS=8
#   EMBED_DIM=512 HEADS=8 FFN_DIM=2048 LR=2e-5 BATCH_SIZE=64 DROPOUT=0.15 CLIP_NORM=0.25
#   WEIGHT_DECAY=0.01 WARMUP_UPDATES MAX_UPDATE VALIDATE_INTERVAL_UPDATES (table 4, per TASK)
#   NUM_CLASSES MAX_POSITIONS=512 (longer inputs are truncated) K (shaw/lfhc clipping distance;
#   default the paper's per task) SEED=1 CPU=1 (CPU, no fp16)
#   USER_DIR (default: this repository's posenc_fairseq).
set -euo pipefail
source "$(dirname "$(realpath "${BASH_SOURCE[0]}")")/../recipe_checks.sh"
help_if_asked "$@"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
TASK=${1:?usage: train.sh TASK DATA_BIN SAVE_DIR [options]}
DATA_BIN=${2:?usage}
SAVE_DIR=${3:?usage}
shift 3
need_folder "$DATA_BIN" DATA_BIN

# table 4:      classes  warm-up  updates  eval interval
case "$TASK" in
  IMDB)  H=(2 200 4000 200) ;;
  SST-2) H=(2 1000 20000 500) ;;
  SNLI)  H=(3 5000 80000 5000) ;;
  QNLI)  H=(2 4000 40000 1000) ;;
  QQP)   H=(2 4000 80000 4000) ;;
  MNLI)  H=(3 4000 120000 4000) ;;
  *) echo "unknown task $TASK (IMDB SST-2 SNLI QNLI QQP MNLI)" >&2; exit 2 ;;
esac
NUM_CLASSES=${NUM_CLASSES:-${H[0]}}
WARMUP_UPDATES=${WARMUP_UPDATES:-${H[1]}}
MAX_UPDATE=${MAX_UPDATE:-${H[2]}}
VALIDATE_INTERVAL_UPDATES=${VALIDATE_INTERVAL_UPDATES:-${H[3]}}
ENCODING=${ENCODING:-gcdf}
ARCH=${ARCH:-roberta_$ENCODING}
LAYERS=${LAYERS:-8}
EMBED_DIM=${EMBED_DIM:-512}
HEADS=${HEADS:-8}
FFN_DIM=${FFN_DIM:-2048}
LR=${LR:-2e-05}
BATCH_SIZE=${BATCH_SIZE:-64}
DROPOUT=${DROPOUT:-0.15}
CLIP_NORM=${CLIP_NORM:-0.25}
WEIGHT_DECAY=${WEIGHT_DECAY:-0.01}
MAX_POSITIONS=${MAX_POSITIONS:-512}
SEED=${SEED:-1}
LOG_INTERVAL=${LOG_INTERVAL:-100}
USER_DIR=${USER_DIR:-$REPO/posenc_fairseq}
FAIRSEQ_TRAIN=${FAIRSEQ_TRAIN:-fairseq-train}

# Shaw/LFHC: the clipping distance k of the paper's table 1 rows (its table 5); K=... overrides
case "$ENCODING:$TASK" in
  shaw:SNLI|shaw:MNLI) PAPER_K=16 ;;
  shaw:*) PAPER_K=4 ;;
  lfhc:SNLI) PAPER_K=2 ;;
  lfhc:MNLI) PAPER_K=8 ;;
  lfhc:*) PAPER_K=4 ;;
  *) PAPER_K= ;;
esac
K_OPTS=()
[[ -n "$PAPER_K" ]] && K_OPTS=("--$ENCODING-k" "${K:-$PAPER_K}")

set_device_options  # DEVICE
say_if_resuming "$SAVE_DIR"
mkdir -p "$SAVE_DIR"
set -x
run_logged "$SAVE_DIR/train.log" "$FAIRSEQ_TRAIN" "$DATA_BIN" --user-dir "$USER_DIR" \
    --task sentence_prediction --criterion sentence_prediction --num-classes "$NUM_CLASSES" \
    --init-token 0 --separator-token 2 --max-positions "$MAX_POSITIONS" --shorten-method truncate \
    --arch "$ARCH" --encoder-layers "$LAYERS" --encoder-embed-dim "$EMBED_DIM" \
    --encoder-attention-heads "$HEADS" --encoder-ffn-embed-dim "$FFN_DIM" "${K_OPTS[@]}" \
    --dropout "$DROPOUT" --attention-dropout "$DROPOUT" \
    --batch-size "$BATCH_SIZE" --required-batch-size-multiple 1 \
    --optimizer adam --adam-betas '(0.9, 0.999)' --adam-eps 1e-08 --weight-decay "$WEIGHT_DECAY" \
    --clip-norm "$CLIP_NORM" --lr-scheduler polynomial_decay --lr "$LR" --total-num-update "$MAX_UPDATE" \
    --warmup-updates "$WARMUP_UPDATES" --max-update "$MAX_UPDATE" --max-epoch 0 \
    --validate-interval-updates "$VALIDATE_INTERVAL_UPDATES" --save-interval-updates "$VALIDATE_INTERVAL_UPDATES" \
    --keep-interval-updates 1 --no-epoch-checkpoints \
    --best-checkpoint-metric accuracy --maximize-best-checkpoint-metric \
    "${DEVICE[@]}" --save-dir "$SAVE_DIR" --seed "$SEED" --log-format simple --log-interval "$LOG_INTERVAL" \
    "$@"
