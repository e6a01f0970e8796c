#!/usr/bin/env bash
# LFHC/GCDF paper table 3: train one transformer_lm_<encoding> per encoding on WikiText-103 with
# train.sh, score the test set at each memory length with evaluate.py, and write WORK_DIR/table3.md
# (the paper's perplexities beside ours).
#
#   examples/lm/run_table3.sh DATA_BIN WORK_DIR [extra fairseq-train options...]
#
# Environment: ENCODINGS="t5 shaw lfhc xl gcdf" (the paper's five), MEMORY="150 640", BLOCK=150,
#   EVAL_ARGS (extra evaluate.py options, e.g. "--batch-size 4"), and everything train.sh reads.
set -euo pipefail
source "$(dirname "$(realpath "${BASH_SOURCE[0]}")")/../recipe_checks.sh"
help_if_asked "$@"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON=${PYTHON:-python}
DATA_BIN=${1:?usage: run_table3.sh DATA_BIN WORK_DIR [fairseq-train options]}
WORK=${2:?usage}
shift 2
ENCODINGS=${ENCODINGS:-t5 shaw lfhc xl gcdf}
MEMORY=${MEMORY:-150 640}
BLOCK=${BLOCK:-150}
EVAL_CPU=()
[[ -n "${CPU:-}" ]] && EVAL_CPU=(--cpu)
mkdir -p "$WORK"
RESULTS=()
for ENCODING in $ENCODINGS; do
  rm -f "$WORK/$ENCODING"/checkpoint*.pt "$WORK/$ENCODING"/train.log "$WORK/ppl_$ENCODING.json"  # train.sh would resume an earlier run's (and append to its log)
  ARCH="transformer_lm_$ENCODING" "$HERE/train.sh" "$DATA_BIN" "$WORK/$ENCODING" "$@"
  # shellcheck disable=SC2086
  "$PYTHON" "$HERE/evaluate.py" "$DATA_BIN" "$WORK/$ENCODING/checkpoint_best.pt" --memory $MEMORY \
      --block "$BLOCK" "${EVAL_CPU[@]}" --json "$WORK/ppl_$ENCODING.json" ${EVAL_ARGS:-}
  RESULTS+=("$WORK/ppl_$ENCODING.json")
done
"$PYTHON" "$HERE/report.py" "${RESULTS[@]}" --out "$WORK/table3.md"
