#!/usr/bin/env bash
# FLOATER paper, appendix B.3: plug FLOATER into a pretrained RoBERTa and train only the dynamics h
# with the masked-LM loss on WikiText-103 for one epoch (every other weight frozen).
#
#   examples/floater_pretrain/pretrain_dynamics.sh ROBERTA_MODEL_PT WIKITEXT_BIN WORK_DIR [fairseq-train options]
#
# 1. scripts/convert_roberta_checkpoint.py ROBERTA_MODEL_PT WORK_DIR/roberta_floater.pt --encoding floater
#    (the converted model equals RoBERTa: h starts at zero); ENCODING_ARGS adds encoding options,
#    e.g. "--floater-method midpoint" (the paper's solver for RoBERTa, appendix B.1).
# 2. fairseq-train --task masked_lm --floater-train-dynamics-only --max-epoch 1 from it, with the same
#    ENCODING_ARGS (fairseq-train builds the model from its own options: --restore-file only loads
#    weights); the result is WORK_DIR/dynamics/checkpoint_last.pt, the starting point of finetune.sh
#    (give it the same ENCODING_ARGS).
# The paper does not give the optimiser settings of this step; the defaults follow fairseq's RoBERTa
# pre-training recipe (README.pretraining.md: adam (0.9,0.98) eps 1e-6, polynomial decay, 512 tokens
# per sample, 16 x 16 sequences per update) with a lower peak lr for this small, fresh module:
#   ARCH=roberta_floater_large (roberta_floater_base for the base rows), LR=1e-4, WARMUP_UPDATES=100,
#   TOTAL_NUM_UPDATES=800 (about one epoch of WikiText-103 at 256 x 512 tokens), MAX_EPOCH=1,
#   TOKENS_PER_SAMPLE=512, BATCH_SIZE=16, UPDATE_FREQ=16, MAX_UPDATE=0 (no limit), CPU=1.
set -euo pipefail
source "$(dirname "$(realpath "${BASH_SOURCE[0]}")")/../recipe_checks.sh"
help_if_asked "$@"
if [[ -n "${CONVERT_ARGS:-}" ]]; then
  echo "CONVERT_ARGS is now ENCODING_ARGS: the encoding options, given to the conversion and to training" >&2; exit 2
fi
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
PYTHON=${PYTHON:-python}
ROBERTA=${1:?usage: pretrain_dynamics.sh ROBERTA_MODEL_PT WIKITEXT_BIN WORK_DIR [options]}
DATA_BIN=${2:?usage}
WORK=${3:?usage}
shift 3
need_checkpoint "$ROBERTA" ROBERTA_MODEL_PT
need_folder "$DATA_BIN" WIKITEXT_BIN
ARCH=${ARCH:-roberta_floater_large}
LR=${LR:-1e-4}
WARMUP_UPDATES=${WARMUP_UPDATES:-100}
TOTAL_NUM_UPDATES=${TOTAL_NUM_UPDATES:-800}
MAX_EPOCH=${MAX_EPOCH:-1}
MAX_UPDATE=${MAX_UPDATE:-0}
TOKENS_PER_SAMPLE=${TOKENS_PER_SAMPLE:-512}
BATCH_SIZE=${BATCH_SIZE:-16}
UPDATE_FREQ=${UPDATE_FREQ:-16}
SEED=${SEED:-1}
FAIRSEQ_TRAIN=${FAIRSEQ_TRAIN:-fairseq-train}
if [[ -n "${CPU:-}" ]]; then DEVICE=(--cpu); else DEVICE=(--fp16); fi
say_if_resuming "$WORK/dynamics"
mkdir -p "$WORK/dynamics"

"$PYTHON" "$REPO/scripts/convert_roberta_checkpoint.py" "$ROBERTA" "$WORK/roberta_floater.pt" --force \
    --encoding floater ${ENCODING_ARGS:-}

set -x
run_logged "$WORK/dynamics/train.log" "$FAIRSEQ_TRAIN" "$DATA_BIN" --user-dir "$REPO/posenc_fairseq" \
    --restore-file "$WORK/roberta_floater.pt" --reset-optimizer --reset-dataloader --reset-meters \
    --reset-lr-scheduler --task masked_lm --criterion masked_lm --arch "$ARCH" \
    --floater-train-dynamics-only ${ENCODING_ARGS:-} \
    --sample-break-mode complete --tokens-per-sample "$TOKENS_PER_SAMPLE" \
    --optimizer adam --adam-betas '(0.9, 0.98)' --adam-eps 1e-6 --clip-norm 0.0 --weight-decay 0.01 \
    --lr-scheduler polynomial_decay --lr "$LR" --warmup-updates "$WARMUP_UPDATES" \
    --total-num-update "$TOTAL_NUM_UPDATES" --dropout 0.1 --attention-dropout 0.1 \
    --batch-size "$BATCH_SIZE" --update-freq "$UPDATE_FREQ" \
    --max-epoch "$MAX_EPOCH" --max-update "$MAX_UPDATE" "${DEVICE[@]}" \
    --save-dir "$WORK/dynamics" --no-epoch-checkpoints --seed "$SEED" --log-format simple \
    "$@"
