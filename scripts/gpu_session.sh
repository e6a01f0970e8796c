#!/usr/bin/env bash
# One device call that does a GPU session's checks, in order of what only a GPU shows, each with its own
# time limit, its results under $OUT (else docs/data/gpu_session/). From the repository root, .gpu carried
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
# benchmark options (e.g. --archs ..., --gen-max-length 0). The defaults add up to about 560 s at most.
set -uo pipefail
OUT=${OUT:-docs/data/gpu_session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$OUT/gpu.txt" 2>&1
(timeout 240 python3 setup.py build_ext -b /tmp/posenc_extension -t /tmp/posenc_extension_build >"$OUT/build_ext.log" 2>&1
 echo "build_ext exit code $?" >>"$OUT/build_ext.log") &
build=$!
export POSENC_BUILD_EXTENSION=0  # (built above, beside fairseq's set-up)
. scripts/gpu_device_setup.sh || exit 1
wait $build
tail -1 "$OUT/build_ext.log"
cp /tmp/posenc_extension/posenc_fairseq/_floater_solve*.so posenc_fairseq/ 2>/dev/null
timeout "${PYTEST_S:-150}" python3 -m pytest tests -m device --device cuda -p no:cacheprovider -n 8 -q -rfEs \
    --junitxml="$OUT/pytest_cuda.xml" >"$OUT/pytest_cuda.log" 2>&1
echo "pytest exit code $?"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest_cuda.log" | tail -20
budget=${BENCH_BUDGET_S:-230}
timeout $((budget + 60)) python3 scripts/gpu_benchmark.py --device cuda --dtypes bf16 --floater-graphs --triton \
    --budget "$budget" --out "$OUT/gpu_benchmark.json" ${GPU_BENCH_ARGS:-} >"$OUT/gpu_benchmark.log" 2>&1
echo "gpu_benchmark exit code $?"
grep -v USDT "$OUT/gpu_benchmark.log" | tail -45
check_t=${CHECK_T_S:-90}
if [ "$check_t" -gt 0 ]; then
    timeout $((check_t + 30)) python3 scripts/gpu_check.py --device cuda --only t --budget "$check_t" \
        >"$OUT/gpu_check_t.md" 2>"$OUT/gpu_check_t.log"
    echo "gpu_check t exit code $?"
    grep -E "^\| (t5|shaw|xl|alibi|at5|at5_nob|gcdf|lfhc|t5_nob)|FAIL" "$OUT/gpu_check_t.md" | cut -c1-220
fi
