#!/usr/bin/env bash
# Fine-tune the dynamics-pretrained FLOATER RoBERTa (pretrain_dynamics.sh) on GLUE or RACE with the
# official RoBERTa hyper-parameters, the dynamics frozen (FREEZE_DYNAMICS=1, default; the paper's RACE
# setting) or trained along (FREEZE_DYNAMICS=0).
#
#   examples/floater_pretrain/finetune.sh glue TASK DATA_BIN CHECKPOINT SAVE_DIR [fairseq-train options]
#   examples/floater_pretrain/finetune.sh race DATA_BIN CHECKPOINT SAVE_DIR [fairseq-train options]
#
# ENCODING_ARGS: the encoding options pretrain_dynamics.sh was given (e.g. "--floater-method midpoint"):
# fairseq-train builds the model from its own options. All other environment variables are those of
# examples/glue/finetune.sh / examples/race/finetune.sh.
set -euo pipefail
source "$(dirname "$(realpath "${BASH_SOURCE[0]}")")/../recipe_checks.sh"
help_if_asked "$@"
if [[ -n "${CONVERT_ARGS:-}" ]]; then
  echo "CONVERT_ARGS is now ENCODING_ARGS: the encoding options, given to the conversion and to training" >&2; exit 2
fi
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
BENCH=${1:?usage: finetune.sh glue|race ...}
shift
case "${FREEZE_DYNAMICS:-1}" in
  1) FREEZE=(--floater-freeze-dynamics) ;;
  0) FREEZE=() ;;
  *) echo "FREEZE_DYNAMICS=${FREEZE_DYNAMICS}: give 1 (frozen) or 0 (trained along)" >&2; exit 2 ;;
esac
case "$BENCH" in
  glue) TASK=${1:?TASK}; DATA=${2:?DATA_BIN}; CKPT=${3:?CHECKPOINT}; SAVE=${4:?SAVE_DIR}; shift 4
        exec "$HERE/../glue/finetune.sh" "$TASK" "$DATA" "$CKPT" "$SAVE" "${FREEZE[@]}" ${ENCODING_ARGS:-} "$@" ;;
  race) DATA=${1:?DATA_BIN}; CKPT=${2:?CHECKPOINT}; SAVE=${3:?SAVE_DIR}; shift 3
        exec "$HERE/../race/finetune.sh" "$DATA" "$CKPT" "$SAVE" "${FREEZE[@]}" ${ENCODING_ARGS:-} "$@" ;;
  *) echo "first argument: glue or race" >&2; exit 2 ;;
esac
