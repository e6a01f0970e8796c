#!/usr/bin/env bash
# Prepare .gpu/ here, for a GPU machine that has torch but no fairseq and no network (the device tool's
# machines: Python 3.12, torch, pytest, torchdiffeq installed). Run from the repository root after
# `make venv`; then name .gpu in the device call's carry. scripts/gpu_device_setup.sh uses it there.
#   .gpu/site/  pure-Python copies of fairseq, fairseq_cli, hydra, omegaconf, antlr4 and their dist-info
#               from .venv, without compiled files, fairseq's examples' test data and notebooks
#   .gpu/whl/   bitarray's wheel for that machine's Python (fairseq imports it at start-up)
#   .gpu/source_commit  this tree's commit (`-dirty` where it differs), which the copy's records name
# About 16 MiB; /.gpu/ is added to .git/info/exclude, so it never travels unless carried.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1  # (its paths are the repository's, wherever it is run from)
PYTHON_VERSION=${GPU_PYTHON_VERSION:-3.12}
site_packages=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
rm -rf .gpu
mkdir -p .gpu/site .gpu/whl
for name in fairseq fairseq_cli hydra omegaconf antlr4; do
    cp -r "$site_packages/$name" .gpu/site/
done
for pattern in 'fairseq_fixed-*.dist-info' 'hydra_core-*.dist-info' 'omegaconf-*.dist-info' 'antlr4_python3_runtime-*.dist-info'; do
    cp -r "$site_packages"/$pattern .gpu/site/
done
rm -rf .gpu/site/fairseq/examples/hubert/tests .gpu/site/fairseq/examples/mms/asr/tutorial
find .gpu/site \( -name '*.so' -o -name '*.ipynb' -o -name '*.npy' \) -delete
find .gpu/site -name __pycache__ -type d -prune -exec rm -rf {} +
bitarray=$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("bitarray"))')
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .gpu/whl "bitarray==$bitarray"
.venv/bin/python -c 'from posenc_fairseq.provenance import source_commit; print(source_commit() or "")' \
    >.gpu/source_commit
mkdir -p .git/info
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
du -sh .gpu
