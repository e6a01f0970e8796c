#!/usr/bin/env bash
# Make fairseq importable on a GPU machine that has torch but no fairseq and no network, build
# FLOATER's compiled solve there, then run the command given, if any:
#
#   bash scripts/gpu_device_setup.sh python3 scripts/gpu_check.py --device cuda
#   . scripts/gpu_device_setup.sh        # sourced: only sets PYTHONPATH in this shell
#
# Run from the repository root. What it needs travels in .gpu/ (untracked, see .git/info/exclude):
#   .gpu/site/  pure-Python copies of fairseq, fairseq_cli, hydra, omegaconf, antlr4 (with their
#               dist-info), without fairseq's compiled .so files: the model code path does not use
#               them (fairseq imports its Cython/C++ helpers lazily, for data loading and scoring)
#   .gpu/whl/   wheels of the compiled packages fairseq imports at start-up (bitarray), built for
#               that machine's Python (`pip download --python-version 3.12 ...`), and for the test
#               suite (`make test-cuda`) pytest's and torchdiffeq's where the machine lacks them
# Where fairseq already imports, nothing is added. Messages go to stderr.
_posenc_setup() {
    local repo site python
    repo=$(pwd)
    python=${PYTHON:-python3}
    if [ ! -f "$repo/setup.py" ] || [ ! -d "$repo/posenc_fairseq" ]; then
        echo "gpu_device_setup: run from the repository root (no setup.py / posenc_fairseq here)" >&2
        return 1
    fi
    if ! "$python" -c "import fairseq" 2>/dev/null; then
        if [ ! -d "$repo/.gpu/site/fairseq" ]; then
            echo "gpu_device_setup: fairseq does not import and .gpu/site/fairseq is missing (carry .gpu)" >&2
            return 1
        fi
        site=${POSENC_GPU_SITE:-/tmp/posenc_gpu_site}
        mkdir -p "$site"
        if compgen -G "$repo/.gpu/whl/*.whl" >/dev/null; then
            "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
                --target "$site" "$repo"/.gpu/whl/*.whl >&2 || return 1
        fi
        export PYTHONPATH="$repo/.gpu/site:$site${PYTHONPATH:+:$PYTHONPATH}"
        # fairseq's commands, which the tests run by name (fairseq-preprocess makes their data): no console
        # scripts come with the copies, so each is a script that runs its fairseq_cli module
        local command_name interpreter
        interpreter=$(command -v "$python")
        mkdir -p "$site/bin"
        for command_name in preprocess train generate interactive validate eval_lm score; do
            printf '#!/bin/sh\nexec "%s" -m fairseq_cli.%s "$@"\n' "$interpreter" "$command_name" \
                >"$site/bin/fairseq-${command_name//_/-}"
            chmod +x "$site/bin/fairseq-${command_name//_/-}"
        done
        export PATH="$site/bin:$PATH"
    fi
    export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
    # fairseq-train batches with fairseq's Cython batch_by_size: a pure-Python port where it is missing
    if ! "$python" -c "import fairseq.data.data_utils_fast" 2>/dev/null && [ -d "$repo/.gpu/site/fairseq/data" ]; then
        cp "$repo/scripts/fairseq_data_utils_fast.py" "$repo/.gpu/site/fairseq/data/data_utils_fast.py"
    fi
    if ! "$python" -c "import fairseq, hydra, omegaconf, bitarray" >&2; then
        echo "gpu_device_setup: fairseq still does not import (above)" >&2
        return 1
    fi
    # FLOATER's solve loops as a C++ extension (without it FLOATER's CPU solve runs the same loops
    # in Python: correct, slower). A failed build is reported and the run goes on. POSENC_BUILD_EXTENSION=0
    # skips it (a caller that builds it meanwhile, in the background, and copies it in later).
    if [ "${POSENC_BUILD_EXTENSION:-1}" != 0 ] && ! compgen -G "$repo/posenc_fairseq/_floater_solve*$("$python" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')" >/dev/null; then
        local log=/tmp/posenc_build_ext.log
        if timeout 300 "$python" setup.py build_ext --inplace >"$log" 2>&1; then
            echo "gpu_device_setup: built $(ls "$repo"/posenc_fairseq/_floater_solve*.so | tr '\n' ' ')" >&2
        else
            echo "gpu_device_setup: FLOATER's C++ extension did not build (Python loops instead); end of $log:" >&2
            tail -20 "$log" >&2
        fi
    fi
    "$python" -c "import torch, fairseq, posenc_fairseq, posenc_fairseq.encodings.floater.solver as f
print('gpu_device_setup: torch', torch.__version__, '| fairseq', fairseq.__version__, 'from', fairseq.__file__,
      '| floater extension:', f.floater_solve is not None)" >&2
}

if [ "${BASH_SOURCE[0]}" != "$0" ]; then  # sourced
    _posenc_setup
else
    set -o pipefail
    _posenc_setup || exit 1
    if [ "$#" -gt 0 ]; then
        exec "$@"
    fi
fi
