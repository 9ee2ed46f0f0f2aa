# fastmt — every target sets itself up first (`make setup` is idempotent: seconds when done).
#
#   make train        CUDA: `fast` preset, 18 epochs on OPUS Books en-it; CPU: `tiny` preset
#   make test         the CPU test suite (what CI runs)
#   make kernel-test  Triton kernels: interpreter on CPU, the full grid on CUDA
#   make bench        kernel benchmarks, then the speedup ladder (tiny smoke run on CPU)
#   make profile      torch.profiler trace + graph-break / recompile report
#   make translate    beam-search translations from a checkpoint (CKPT=..., TEXT="...")
#   make lint         ruff
#   make gpu-wheels   download the wheels the GPU image lacks into .whl/ (CPU machine with PyPI)
#
# Variables: ARGS="--field value ..." is passed to the Python entry point;
# DATA_FILES (or FASTMT_DATA_FILES) points at local jsonl/parquet/tsv files instead of the Hub;
# SETUP=none PYTHON=python3 uses an existing interpreter (the GPU runbook does this).

SHELL       := /bin/bash
VENV        ?= .venv
SETUP       ?= venv
BASE_PYTHON ?= $(shell command -v python3.11 || command -v python3)
TORCH_SPEC  ?= torch==2.13.0
ARGS        ?=
CKPT        ?=
TEXT        ?=

ifeq ($(SETUP),none)
PYTHON      ?= python3
STAMP       :=
else
PYTHON      := $(VENV)/bin/python
STAMP       := $(VENV)/.fastmt-installed
endif

# Local data: DATA_FILES, else FASTMT_DATA_FILES, else the stand-in corpus beside this checkout
# (a workplace without Hub access); real users leave all unset and get Helsinki-NLP/opus_books.
STANDIN     ?= ../shared/data/opus_mt_testsets/en-it/train.jsonl
DATA_FILES  ?= $(or $(FASTMT_DATA_FILES),$(wildcard $(STANDIN)))
DATA_ARG    := $(if $(DATA_FILES),--data-files $(DATA_FILES),)

.PHONY: setup train test kernel-test bench profile translate lint gpu-wheels clean

setup: $(STAMP)

$(VENV)/.fastmt-installed: pyproject.toml constraints-cpu.txt
	@test -x $(VENV)/bin/python || $(BASE_PYTHON) -m venv $(VENV)
	@$(VENV)/bin/python -c "import torch" 2>/dev/null || $(VENV)/bin/pip install -q "$(TORCH_SPEC)"
	$(VENV)/bin/pip install -q -e ".[dev]" -c constraints-cpu.txt
	@touch $@

train: setup
	@$(if $(DATA_FILES),echo "make train: local data $(DATA_FILES)",)
	PYTHONUNBUFFERED=1 $(PYTHON) -m train --auto $(DATA_ARG) $(ARGS)

test: setup
	$(PYTHON) -m pytest -q -m "not slow and not gpu" --timeout=600 $(ARGS)

kernel-test: setup
	$(PYTHON) -m pytest -q tests/kernels -m "not slow" --timeout=1800 --durations=15 $(ARGS)

bench: setup
	PYTHONUNBUFFERED=1 $(PYTHON) -m bench.kernels $(ARGS)
	PYTHONUNBUFFERED=1 $(PYTHON) -m bench.ladder $(DATA_ARG) $(ARGS)

profile: setup
	PYTHONUNBUFFERED=1 $(PYTHON) -m bench.profile $(DATA_ARG) $(ARGS)

translate: setup
	@test -n "$(CKPT)" || { echo "make translate: set CKPT=runs/<name>/checkpoints/best.pt (and TEXT=\"...\" or pipe lines on stdin)"; exit 2; }
	$(PYTHON) -m train.translate --ckpt $(CKPT) $(if $(TEXT),"$(TEXT)",) $(ARGS)

lint: setup
	$(PYTHON) -m ruff check .

gpu-wheels: setup
	bash bench/gpu_wheels.sh

# --- oldest supported torch (the GPU image's: 2.11) ------------------------------------------------------
# `make test-torch-min`: a second, git-ignored venv with torch $(TORCH_MIN) (the registry's wheel, a CUDA build
# that runs on the CPU) and the project, then the tests of the code that meets torch's compiler and kernel APIs
# -- compile, decoding, kernels, training -- on it. .ci/run calls it after `make test`.
TORCH_MIN       ?= 2.11.0
VENV_MIN        ?= .venv-torch-min
TORCH_MIN_TESTS ?= tests/kernels tests/models/test_decoding.py tests/train
.PHONY: test-torch-min
test-torch-min: $(VENV_MIN)/.fastmt-torch-$(TORCH_MIN)
	$(VENV_MIN)/bin/python -c "import torch, triton; assert torch.__version__.split('+')[0] == '$(TORCH_MIN)', torch.__version__; print(f'test-torch-min: torch {torch.__version__}, triton {triton.__version__}')"
	$(VENV_MIN)/bin/python -m pytest -q -m "not slow and not gpu" --timeout=900 -p no:cacheprovider $(TORCH_MIN_TESTS) $(ARGS)

# one stamp per torch version: TORCH_MIN=2.12.0 reinstalls torch in the same venv
$(VENV_MIN)/.fastmt-torch-$(TORCH_MIN): pyproject.toml constraints-cpu.txt
	@test -x $(VENV_MIN)/bin/python || $(BASE_PYTHON) -m venv $(VENV_MIN)
	$(VENV_MIN)/bin/pip install -q "torch==$(TORCH_MIN)"
	$(VENV_MIN)/bin/pip install -q -e ".[dev]" -c constraints-cpu.txt "torch==$(TORCH_MIN)"
	@rm -f $(VENV_MIN)/.fastmt-torch-* && touch $@

clean:
	rm -rf $(VENV) $(VENV_MIN) .cache .pytest_cache .ruff_cache
