#!/usr/bin/env bash
# Fine-tune a (converted) RoBERTa checkpoint on RACE with fairseq's sentence_ranking task and the
# official hyper-parameters of fairseq's examples/roberta/README.race.md (FLOATER paper, appendix B.3:
# the same script, with the FLOATER dynamics frozen: add --floater-freeze-dynamics).
#
#   examples/race/finetune.sh DATA_BIN ROBERTA_CHECKPOINT SAVE_DIR [extra fairseq-train options...]
#
# Environment: ARCH=roberta_floater_large, MAX_EPOCH=5, LR=1e-05, BATCH_SIZE=1 (per GPU), UPDATE_FREQ=8
#   (the README's 2 GPUs x 8 = 16 sequences per update; use UPDATE_FREQ=16 on one GPU), NUM_CLASSES=4,
#   MAX_OPTION_LENGTH=128, MAX_POSITIONS=512, MAX_UPDATE=0 (no limit), SEED=1, CPU=1 (CPU, no fp16).
set -euo pipefail
source "$(dirname "$(realpath "${BASH_SOURCE[0]}")")/../recipe_checks.sh"
help_if_asked "$@"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
DATA_BIN=${1:?usage: finetune.sh DATA_BIN ROBERTA_CHECKPOINT SAVE_DIR [options]}
ROBERTA=${2:?usage}
SAVE_DIR=${3:?usage}
shift 3
need_folder "$DATA_BIN" DATA_BIN
need_checkpoint "$ROBERTA" ROBERTA_CHECKPOINT
ARCH=${ARCH:-roberta_floater_large}
MAX_EPOCH=${MAX_EPOCH:-5}
LR=${LR:-1e-05}
NUM_CLASSES=${NUM_CLASSES:-4}
BATCH_SIZE=${BATCH_SIZE:-1}
UPDATE_FREQ=${UPDATE_FREQ:-8}
MAX_OPTION_LENGTH=${MAX_OPTION_LENGTH:-128}
MAX_POSITIONS=${MAX_POSITIONS:-512}
MAX_UPDATE=${MAX_UPDATE:-0}
SEED=${SEED:-1}
USER_DIR=${USER_DIR:-$REPO/posenc_fairseq}
FAIRSEQ_TRAIN=${FAIRSEQ_TRAIN:-fairseq-train}
set_device_options  # DEVICE
mkdir -p "$SAVE_DIR"
set -x
run_logged "$SAVE_DIR/train.log" "$FAIRSEQ_TRAIN" "$DATA_BIN" --user-dir "$USER_DIR" --ddp-backend=legacy_ddp \
    --restore-file "$ROBERTA" --reset-optimizer --reset-dataloader --reset-meters \
    --best-checkpoint-metric accuracy --maximize-best-checkpoint-metric \
    --task sentence_ranking --num-classes "$NUM_CLASSES" --init-token 0 --separator-token 2 \
    --max-option-length "$MAX_OPTION_LENGTH" --max-positions "$MAX_POSITIONS" --shorten-method truncate \
    --arch "$ARCH" --dropout 0.1 --attention-dropout 0.1 --weight-decay 0.01 \
    --criterion sentence_ranking \
    --optimizer adam --adam-betas '(0.9, 0.98)' --adam-eps 1e-06 --clip-norm 0.0 \
    --lr-scheduler fixed --lr "$LR" "${DEVICE[@]}" \
    --batch-size "$BATCH_SIZE" --required-batch-size-multiple 1 --update-freq "$UPDATE_FREQ" \
    --max-epoch "$MAX_EPOCH" --max-update "$MAX_UPDATE" \
    --save-dir "$SAVE_DIR" --no-epoch-checkpoints --seed "$SEED" --log-format simple \
    "$@"
