#!/usr/bin/env bash
# Fine-tune a (converted) RoBERTa checkpoint on one GLUE task with fairseq's sentence_prediction task
# and the official RoBERTa hyper-parameters (fairseq examples/roberta/README.glue.md and
# examples/roberta/config/finetuning/*.yaml; the FLOATER paper, appendix B.3, uses the same).
#
#   examples/glue/finetune.sh TASK DATA_BIN ROBERTA_CHECKPOINT SAVE_DIR [extra fairseq-train options...]
#
# Environment (defaults: the official values for TASK): ARCH=roberta_floater_large (use
#   roberta_floater_base for the paper's base rows), LR, BATCH_SIZE, TOTAL_NUM_UPDATES, WARMUP_UPDATES,
#   NUM_CLASSES, MAX_EPOCH=10, MAX_POSITIONS=512, MAX_TOKENS=4400, SEED=1, CPU=1 (CPU, no fp16),
#   USER_DIR (default: this repository's posenc_fairseq).
set -euo pipefail
source "$(dirname "$(realpath "${BASH_SOURCE[0]}")")/../recipe_checks.sh"
help_if_asked "$@"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
TASK=${1:?usage: finetune.sh TASK DATA_BIN ROBERTA_CHECKPOINT SAVE_DIR [options]}
DATA_BIN=${2:?usage}
ROBERTA=${3:?usage}
SAVE_DIR=${4:?usage}
shift 4
need_folder "$DATA_BIN" DATA_BIN
need_checkpoint "$ROBERTA" ROBERTA_CHECKPOINT

#               classes  lr     batch  updates  warm-up
case "$TASK" in
  MNLI)  H=(3 1e-05 32 123873 7432) ;;
  QNLI)  H=(2 1e-05 32 33112 1986) ;;
  QQP)   H=(2 1e-05 32 113272 28318) ;;
  RTE)   H=(2 2e-05 16 2036 122) ;;
  SST-2) H=(2 1e-05 32 20935 1256) ;;
  MRPC)  H=(2 1e-05 16 2296 137) ;;
  CoLA)  H=(2 1e-05 16 5336 320) ;;
  STS-B) H=(1 2e-05 16 3598 214) ;;
  *) echo "unknown GLUE task $TASK" >&2; exit 2 ;;
esac
NUM_CLASSES=${NUM_CLASSES:-${H[0]}}
LR=${LR:-${H[1]}}
BATCH_SIZE=${BATCH_SIZE:-${H[2]}}
TOTAL_NUM_UPDATES=${TOTAL_NUM_UPDATES:-${H[3]}}
WARMUP_UPDATES=${WARMUP_UPDATES:-${H[4]}}
ARCH=${ARCH:-roberta_floater_large}
MAX_EPOCH=${MAX_EPOCH:-10}
MAX_POSITIONS=${MAX_POSITIONS:-512}
MAX_TOKENS=${MAX_TOKENS:-4400}
SEED=${SEED:-1}
USER_DIR=${USER_DIR:-$REPO/posenc_fairseq}
FAIRSEQ_TRAIN=${FAIRSEQ_TRAIN:-fairseq-train}

if [[ "$TASK" == "STS-B" ]]; then
  METRIC=(--regression-target --best-checkpoint-metric loss)
else
  METRIC=(--best-checkpoint-metric accuracy --maximize-best-checkpoint-metric)
fi
set_device_options  # DEVICE
mkdir -p "$SAVE_DIR"
set -x
run_logged "$SAVE_DIR/train.log" "$FAIRSEQ_TRAIN" "$DATA_BIN" --user-dir "$USER_DIR" \
    --restore-file "$ROBERTA" --reset-optimizer --reset-dataloader --reset-meters \
    --task sentence_prediction --criterion sentence_prediction --num-classes "$NUM_CLASSES" \
    --init-token 0 --separator-token 2 --max-positions "$MAX_POSITIONS" \
    --arch "$ARCH" --dropout 0.1 --attention-dropout 0.1 \
    --batch-size "$BATCH_SIZE" --max-tokens "$MAX_TOKENS" --required-batch-size-multiple 1 \
    --optimizer adam --adam-betas '(0.9, 0.98)' --adam-eps 1e-06 --weight-decay 0.1 --clip-norm 0.0 \
    --lr-scheduler polynomial_decay --lr "$LR" --total-num-update "$TOTAL_NUM_UPDATES" \
    --warmup-updates "$WARMUP_UPDATES" --max-update "$TOTAL_NUM_UPDATES" --max-epoch "$MAX_EPOCH" \
    --find-unused-parameters "${METRIC[@]}" "${DEVICE[@]}" \
    --save-dir "$SAVE_DIR" --no-epoch-checkpoints --seed "$SEED" --log-format simple \
    "$@"
