# Two entry points for a newcomer: `make demo` and `make test`.
# Both create .venv/ on first use (about 5 minutes: fairseq compiles its extensions) and reuse it.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
PYTEST_ARGS ?= -n 2
# Work stealing whatever PYTEST_ARGS says (CI gives its own -n 2): with xdist's default (load) the last
# tests were already queued to one worker while the other sat idle. Without -n it does nothing.
PYTEST_DIST := --dist worksteal

.PHONY: venv demo test test-fast test-cuda clean
venv: $(STAMP)

# Order matters: torch pinned first (an open torch requirement pulls a multi-GB CUDA build),
# then fairseq-fixed's build needs (it imports torch, numpy and Cython while compiling),
# then fairseq-fixed without its deps (its torchaudio requirement has no CPU build),
# then fairseq's runtime needs and ours; this package last (it compiles FLOATER's solve loops against torch).
# requests: fairseq fetches GPT-2's BPE files with it (RoBERTa's hub interface, bpe='gpt2' by default),
# importing it even when they are cached; fairseq-fixed does not list it.
# triton: the kernels of POSENC_TRITON_ATTENTION, tested on the CPU in Triton's interpreter (CUDA builds
# of torch bring their own triton).
$(STAMP): setup.py posenc_fairseq/csrc/floater_solve.cpp
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip setuptools wheel
	$(PIP) install torch==2.13.0
	$(PIP) install Cython "numpy<2.4"
	$(PIP) install --no-build-isolation --no-deps fairseq-fixed==0.12.3.1
	$(PIP) install hydra-core==1.3.2 omegaconf==2.3.0 regex tqdm bitarray scikit-learn packaging cffi
	$(PIP) install torchdiffeq sacrebleu sentencepiece matplotlib tensorboardX pytest pytest-xdist ninja requests
	$(PIP) install triton==3.7.1
	$(PIP) install --no-build-isolation --no-deps -e .
	touch $(STAMP)

DEMO_ARGS ?=
demo: $(STAMP)
	$(VENV)/bin/python examples/demo/run_demo.py $(DEMO_ARGS)

test: $(STAMP)
	$(VENV)/bin/python -m pytest tests $(PYTEST_DIST) $(PYTEST_ARGS)

# the same suite without the tests marked @pytest.mark.slow (the long end-to-end runs; see tests/conftest.py)
test-fast: $(STAMP)
	$(VENV)/bin/python -m pytest tests -m "not slow" $(PYTEST_DIST) $(PYTEST_ARGS)

# On a GPU machine: only the tests a GPU changes (marker `device`), on CUDA (tests/devices.py), after
# scripts/gpu_device_setup.sh has made fairseq importable where there is no venv (it needs pytest there).
# What ran, with the card, goes to a JUnit XML report: $OUT/pytest_cuda.xml where $OUT is set, else
# docs/data/pytest_cuda.xml; -rA lists every test's outcome in the output too.
CUDA_PYTHON ?= python3
CUDA_REPORT ?= $(if $(OUT),$(OUT),docs/data)/pytest_cuda.xml
CUDA_PYTEST_ARGS ?=
test-cuda:
	bash scripts/gpu_device_setup.sh $(CUDA_PYTHON) -m pytest tests -m device --device cuda -p no:cacheprovider \
		-rA --junitxml=$(CUDA_REPORT) $(CUDA_PYTEST_ARGS)

clean:
	rm -rf work/ .pytest_cache
