#!/usr/bin/env bash
# Train a transformer_<encoding> on binarised translation data with the papers' Transformer-base
# settings (Vaswani et al. 2017 / fairseq scaling_nmt; FLOATER paper: peak lr 7e-4).
#
#   examples/translation/train.sh DATA_BIN SAVE_DIR [extra fairseq-train options...]
#
# Every hyper-parameter is an environment variable (defaults = WMT14 En-De, Transformer-base):
#   ARCH=transformer_floater  LR=7e-4  WARMUP=4000  MAX_TOKENS=4096  UPDATE_FREQ=8
#   MAX_UPDATE=0 (0: no limit)  MAX_EPOCH=0 (0: no limit)  DROPOUT=0.1  LABEL_SMOOTHING=0.1
#   WEIGHT_DECAY=0.0  CLIP_NORM=0.0  SEED=1  SAVE_INTERVAL_UPDATES=0  KEEP_LAST_EPOCHS=-1
#   RESTORE=<checkpoint to warm-start from, optimizer/lr-scheduler/meters are reset>
#   CPU=1 to train on CPU; USER_DIR defaults to this repository's posenc_fairseq.
# IWSLT14 De-En (transformer_iwslt_de_en sizes): DROPOUT=0.3 WEIGHT_DECAY=0.0001 LR=5e-4 and
#   pass --encoder-ffn-embed-dim 1024 --decoder-ffn-embed-dim 1024 --encoder-attention-heads 4
#   --decoder-attention-heads 4 (see README).
set -euo pipefail
source "$(dirname "$(realpath "${BASH_SOURCE[0]}")")/../recipe_checks.sh"
help_if_asked "$@"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
DATA_BIN=${1:?usage: train.sh DATA_BIN SAVE_DIR [fairseq-train options]}
SAVE_DIR=${2:?usage: train.sh DATA_BIN SAVE_DIR [fairseq-train options]}
shift 2
need_folder "$DATA_BIN" DATA_BIN
[[ -n "${RESTORE:-}" ]] && need_checkpoint "$RESTORE" RESTORE
FAIRSEQ_TRAIN=${FAIRSEQ_TRAIN:-fairseq-train}
USER_DIR=${USER_DIR:-$REPO/posenc_fairseq}
ARCH=${ARCH:-transformer_floater}
LR=${LR:-7e-4}
WARMUP=${WARMUP:-4000}
MAX_TOKENS=${MAX_TOKENS:-4096}
UPDATE_FREQ=${UPDATE_FREQ:-8}
MAX_UPDATE=${MAX_UPDATE:-0}
MAX_EPOCH=${MAX_EPOCH:-0}
DROPOUT=${DROPOUT:-0.1}
LABEL_SMOOTHING=${LABEL_SMOOTHING:-0.1}
WEIGHT_DECAY=${WEIGHT_DECAY:-0.0}
CLIP_NORM=${CLIP_NORM:-0.0}
SEED=${SEED:-1}
SAVE_INTERVAL_UPDATES=${SAVE_INTERVAL_UPDATES:-0}
KEEP_LAST_EPOCHS=${KEEP_LAST_EPOCHS:--1}
LOG_INTERVAL=${LOG_INTERVAL:-100}

# the plugin is loaded for stock architectures too (it makes checkpoints loadable on torch >= 2.6)
OPTS=(--user-dir "$USER_DIR")
[[ -n "${RESTORE:-}" ]] && OPTS+=(--restore-file "$RESTORE" --reset-optimizer --reset-lr-scheduler
                                   --reset-dataloader --reset-meters)
[[ -n "${CPU:-}" ]] && OPTS+=(--cpu)
[[ -z "${RESTORE:-}" ]] && say_if_resuming "$SAVE_DIR"
mkdir -p "$SAVE_DIR"
set -x
run_logged "$SAVE_DIR/train.log" "$FAIRSEQ_TRAIN" "$DATA_BIN" "${OPTS[@]}" \
    --arch "$ARCH" --share-all-embeddings \
    --optimizer adam --adam-betas '(0.9, 0.98)' --clip-norm "$CLIP_NORM" \
    --lr "$LR" --lr-scheduler inverse_sqrt --warmup-updates "$WARMUP" --warmup-init-lr 1e-07 \
    --dropout "$DROPOUT" --weight-decay "$WEIGHT_DECAY" \
    --criterion label_smoothed_cross_entropy --label-smoothing "$LABEL_SMOOTHING" \
    --max-tokens "$MAX_TOKENS" --update-freq "$UPDATE_FREQ" \
    --max-update "$MAX_UPDATE" --max-epoch "$MAX_EPOCH" \
    --save-dir "$SAVE_DIR" --save-interval-updates "$SAVE_INTERVAL_UPDATES" \
    --keep-last-epochs "$KEEP_LAST_EPOCHS" --seed "$SEED" \
    --log-format simple --log-interval "$LOG_INTERVAL" \
    "$@"
