#!/usr/bin/env bash
# One device call that does a GPU session's checks, in order of what only a GPU shows, each with its own
# time limit, its results under $OUT (else docs/data/gpu_session/; a relative OUT is the repository's, wherever
# the script is run from). From the repository root, .gpu carried
# (scripts/gpu_carry.sh prepares it):
#
#   bash scripts/gpu_session.sh                 # about 8 minutes on one H100/H200
#
# 1. FLOATER's C++ extension built in the background (its loops serve the default CUDA solve);
# 2. the tests a GPU changes on CUDA (make test-cuda's selection, 8 workers), once the extension is in;
# 3. scripts/gpu_benchmark.py in bf16, FLOATER with and without CUDA graphs, each encoding with relative
#    terms with the Triton kernel and without (POSENC_TRITON_ATTENTION the other way from its default);
# 4. scripts/gpu_check.py --only t: the Triton kernel against the other paths, both from float64.
# The limits (seconds) may be changed: PYTEST_S, BENCH_BUDGET_S, CHECK_T_S (0: skip 4); GPU_BENCH_ARGS adds
# benchmark options (e.g. --archs ..., --gen-max-length 0; its time is BENCH_BUDGET_S, not --budget). All
# ends by SESSION_S (570) from the start, inside the device call's 600 s: each step's limit is cut to the time
# left after the later steps' (the benchmark keeps at least BENCH_MIN_S, 120), and the benchmark writes each
# model's records as it is done, so a step cut short still leaves what it finished under $OUT.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1  # (its paths are the repository's, wherever it is run from)
OUT=${OUT:-docs/data/gpu_session}
SESSION_S=${SESSION_S:-570}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# the commit of the tree this copy was made from (gpu_carry.sh records it): the copy's own git may be stale
[ -s .gpu/source_commit ] && export POSENC_SOURCE_COMMIT="$(cat .gpu/source_commit)"
check_t=${CHECK_T_S:-90}
after_bench=$(( check_t > 0 ? check_t + 30 : 0 ))  # check t's limit
left() { echo $(( SESSION_S - SECONDS )); }
smaller() { echo $(( $1 < $2 ? $1 : $2 )); }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$OUT/gpu.txt" 2>&1
(timeout 240 python3 setup.py build_ext -b /tmp/posenc_extension -t /tmp/posenc_extension_build >"$OUT/build_ext.log" 2>&1
 echo "build_ext exit code $?" >>"$OUT/build_ext.log") &
build=$!
export POSENC_BUILD_EXTENSION=0  # (built above, beside fairseq's set-up)
. scripts/gpu_device_setup.sh || exit 1
wait $build
tail -1 "$OUT/build_ext.log"
cp /tmp/posenc_extension/posenc_fairseq/_floater_solve*.so posenc_fairseq/ 2>/dev/null
pytest_s=$(smaller "${PYTEST_S:-150}" $(( $(left) - after_bench - ${BENCH_MIN_S:-120} - 60 )))
if [ "$pytest_s" -ge 30 ]; then  # INT first: pytest then writes its report of what ran
    timeout -s INT -k 15 "$pytest_s" python3 -m pytest tests -m device --device cuda -p no:cacheprovider -n 8 -q \
        -rfEs --junitxml="$OUT/pytest_cuda.xml" >"$OUT/pytest_cuda.log" 2>&1
    echo "pytest exit code $? (limit $pytest_s s)"
    grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest_cuda.log" | tail -20
else
    echo "pytest skipped: $(left) s left"
fi
budget=$(smaller "${BENCH_BUDGET_S:-230}" $(( $(left) - after_bench - 60 )))
if [ "$budget" -ge 30 ]; then
    timeout $((budget + 60)) python3 scripts/gpu_benchmark.py --device cuda --dtypes bf16 --floater-graphs --triton \
        --out "$OUT/gpu_benchmark.json" ${GPU_BENCH_ARGS:-} --budget "$budget" >"$OUT/gpu_benchmark.log" 2>&1
    echo "gpu_benchmark exit code $? (budget $budget s)"
    grep -v USDT "$OUT/gpu_benchmark.log" | tail -45
else
    echo "gpu_benchmark skipped: $(left) s left"
fi
check_t=$(smaller "$check_t" $(( $(left) - 30 )))
if [ "$check_t" -gt 0 ]; then
    timeout $((check_t + 30)) python3 scripts/gpu_check.py --device cuda --only t --budget "$check_t" \
        >"$OUT/gpu_check_t.md" 2>"$OUT/gpu_check_t.log"
    echo "gpu_check t exit code $?"
    grep -E "^\| (t5|shaw|xl|alibi|at5|at5_nob|gcdf|lfhc|t5_nob)|FAIL" "$OUT/gpu_check_t.md" | cut -c1-220
fi
echo "gpu_session: done in $SECONDS s (of SESSION_S $SESSION_S)"
