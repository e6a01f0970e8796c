#!/usr/bin/env bash
# Train a decoder-only transformer_lm_<encoding> on binarised WikiText-103 with the LFHC/GCDF paper's
# language-model setting (Qu et al. 2021, section 4.1 and table 4: the Transformer-XL base setting,
# 16 layers, 10 heads, d_model 410, FFN 2100, segments of 150 tokens, batch 60, AdamW lr 2.5e-4,
# no warm-up, cosine decay, clip 0.25, 200k updates, adaptive softmax with XL's cut-offs).
#
#   examples/lm/train.sh DATA_BIN SAVE_DIR [extra fairseq-train options...]
#
# Environment (defaults = the paper): ARCH=transformer_lm_gcdf  LAYERS=16  EMBED_DIM=410  HEADS=10
#   FFN_DIM=2100  TOKENS_PER_SAMPLE=150  BATCH_SIZE=60  UPDATE_FREQ=1  LR=2.5e-4  WARMUP=0
#   MAX_UPDATE=200000  DROPOUT=0.0 (table 4; Transformer-XL's own base config uses 0.1)
#   ATTENTION_DROPOUT=0.0  WEIGHT_DECAY=0.01  CLIP_NORM=0.25  MAX_POSITIONS=1024 (a learned table must
#   cover eval-time windows: context + block)  ADAPTIVE_SOFTMAX_CUTOFF=20000,40000,200000 (empty:
#   full softmax, needed for small vocabularies)  VALIDATE_INTERVAL_UPDATES=4000  SEED=1
#   K (shaw/lfhc clipping distance; default the paper's: 8 / 16)  CPU=1 (CPU,
#   no fp16)  USER_DIR (default: this repository's posenc_fairseq).
# transformer_lm_<encoding> is fairseq's `transformer_lm` (post-norm, as Transformer-XL); input and
# output dims are set to EMBED_DIM (fairseq's config would leave them at 512 and add projections).
# Head dimension 410/10 = 41 is odd: rotary leaves the last dimension of each head unrotated
# (EMBED_DIM=400 rotates them all).
set -euo pipefail
source "$(dirname "$(realpath "${BASH_SOURCE[0]}")")/../recipe_checks.sh"
help_if_asked "$@"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
DATA_BIN=${1:?usage: train.sh DATA_BIN SAVE_DIR [fairseq-train options]}
SAVE_DIR=${2:?usage: train.sh DATA_BIN SAVE_DIR [fairseq-train options]}
shift 2
need_folder "$DATA_BIN" DATA_BIN
FAIRSEQ_TRAIN=${FAIRSEQ_TRAIN:-fairseq-train}
USER_DIR=${USER_DIR:-$REPO/posenc_fairseq}
ARCH=${ARCH:-transformer_lm_gcdf}
LAYERS=${LAYERS:-16}
EMBED_DIM=${EMBED_DIM:-410}
HEADS=${HEADS:-10}
FFN_DIM=${FFN_DIM:-2100}
TOKENS_PER_SAMPLE=${TOKENS_PER_SAMPLE:-150}
BATCH_SIZE=${BATCH_SIZE:-60}
UPDATE_FREQ=${UPDATE_FREQ:-1}
LR=${LR:-2.5e-4}
WARMUP=${WARMUP:-0}
MAX_UPDATE=${MAX_UPDATE:-200000}
DROPOUT=${DROPOUT:-0.0}
ATTENTION_DROPOUT=${ATTENTION_DROPOUT:-0.0}
WEIGHT_DECAY=${WEIGHT_DECAY:-0.01}
CLIP_NORM=${CLIP_NORM:-0.25}
MAX_POSITIONS=${MAX_POSITIONS:-1024}
ADAPTIVE_SOFTMAX_CUTOFF=${ADAPTIVE_SOFTMAX_CUTOFF-20000,40000,200000}
VALIDATE_INTERVAL_UPDATES=${VALIDATE_INTERVAL_UPDATES:-4000}
SEED=${SEED:-1}
LOG_INTERVAL=${LOG_INTERVAL:-100}

OPTS=(--user-dir "$USER_DIR")
# Shaw/LFHC: the clipping distance k of the paper's table 3 rows (its table 7); K=... overrides
case "$ARCH" in
  transformer_lm_shaw*) OPTS+=(--shaw-k "${K:-8}") ;;
  transformer_lm_lfhc*) OPTS+=(--lfhc-k "${K:-16}") ;;
esac
if [[ -n "$ADAPTIVE_SOFTMAX_CUTOFF" ]]; then
  # Transformer-XL's WikiText-103 softmax: cut-offs 20k/40k/200k, div_val 1 (no projection shrink)
  # (fairseq's adaptive_loss refuses PyTorch's DDP wrapper, even on one GPU: legacy_ddp)
  OPTS+=(--criterion adaptive_loss --adaptive-softmax-cutoff "$ADAPTIVE_SOFTMAX_CUTOFF"
         --adaptive-softmax-factor 1 --adaptive-softmax-dropout 0.0 --ddp-backend legacy_ddp)
else
  OPTS+=(--criterion cross_entropy)
fi
if [[ -n "${CPU:-}" ]]; then
  OPTS+=(--cpu)
else
  OPTS+=(--fp16)
fi
say_if_resuming "$SAVE_DIR"
mkdir -p "$SAVE_DIR"
set -x
run_logged "$SAVE_DIR/train.log" "$FAIRSEQ_TRAIN" "$DATA_BIN" "${OPTS[@]}" \
    --task language_modeling --sample-break-mode none --tokens-per-sample "$TOKENS_PER_SAMPLE" \
    --max-target-positions "$MAX_POSITIONS" \
    --arch "$ARCH" --decoder-layers "$LAYERS" --decoder-embed-dim "$EMBED_DIM" \
    --decoder-input-dim "$EMBED_DIM" --decoder-output-dim "$EMBED_DIM" \
    --decoder-attention-heads "$HEADS" --decoder-ffn-embed-dim "$FFN_DIM" \
    --dropout "$DROPOUT" --attention-dropout "$ATTENTION_DROPOUT" \
    --optimizer adam --adam-betas '(0.9, 0.999)' --weight-decay "$WEIGHT_DECAY" --clip-norm "$CLIP_NORM" \
    --lr "$LR" --lr-scheduler cosine --warmup-updates "$WARMUP" --max-update "$MAX_UPDATE" \
    --batch-size "$BATCH_SIZE" --update-freq "$UPDATE_FREQ" --required-batch-size-multiple 1 \
    --validate-interval-updates "$VALIDATE_INTERVAL_UPDATES" --save-interval-updates "$VALIDATE_INTERVAL_UPDATES" \
    --keep-interval-updates 1 --no-epoch-checkpoints \
    --save-dir "$SAVE_DIR" --seed "$SEED" --log-format simple --log-interval "$LOG_INTERVAL" \
    "$@"
