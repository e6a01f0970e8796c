#!/usr/bin/env bash
# LFHC/GCDF paper table 1: for each encoding and task, train.sh (from scratch) then evaluate.py;
# writes WORK_DIR/table1.md (the paper's numbers beside ours).
#
#   examples/classification/run_table1.sh DATA_DIR WORK_DIR [extra fairseq-train options...]
#
# DATA_DIR holds one <TASK>-bin folder per task (preprocess.py for IMDB/SNLI,
# examples/glue/preprocess_glue.py for the GLUE tasks). Environment: ENCODINGS="t5 shaw lfhc xl gcdf",
# TASKS="IMDB SST-2 SNLI QNLI QQP MNLI", EVAL_ARGS (extra evaluate.py options), and everything
# train.sh reads (CPU, MAX_UPDATE, ...).
set -euo pipefail
source "$(dirname "$(realpath "${BASH_SOURCE[0]}")")/../recipe_checks.sh"
help_if_asked "$@"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON=${PYTHON:-python}
DATA=${1:?usage: run_table1.sh DATA_DIR WORK_DIR [fairseq-train options]}
WORK=${2:?usage}
shift 2
ENCODINGS=${ENCODINGS:-t5 shaw lfhc xl gcdf}
TASKS=${TASKS:-IMDB SST-2 SNLI QNLI QQP MNLI}
EVAL_CPU=()
[[ -n "${CPU:-}" ]] && EVAL_CPU=(--cpu)
for ENCODING in $ENCODINGS; do
  for TASK in $TASKS; do
    # this recipe's own outputs: train.sh would resume an earlier run's checkpoint, report.py read its result
    rm -f "$WORK/$ENCODING/$TASK"/checkpoint*.pt "$WORK/$ENCODING/$TASK"/train.log "$WORK/$ENCODING/$TASK.json"
    ENCODING="$ENCODING" ARCH="roberta_$ENCODING" "$HERE/train.sh" "$TASK" "$DATA/$TASK-bin" "$WORK/$ENCODING/$TASK" "$@"
    # shellcheck disable=SC2086
    "$PYTHON" "$HERE/evaluate.py" "$TASK" "$DATA/$TASK-bin" "$WORK/$ENCODING/$TASK/checkpoint_best.pt" \
        "${EVAL_CPU[@]}" --json "$WORK/$ENCODING/$TASK.json" ${EVAL_ARGS:-}
  done
done
# shellcheck disable=SC2086
"$PYTHON" "$HERE/report.py" "$WORK" --out "$WORK/table1.md" --encodings $ENCODINGS
