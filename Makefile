# fastmt — `make help` lists the targets and variables. Every target sets itself up first
# (`make setup` is idempotent: seconds once done). The commands are also `.venv/bin/fastmt ...`.

SHELL       := /bin/bash
# A value given on the command line or in the environment is data: make never expands it, so a `$(shell ...)` or
# `$(...)` in one runs nothing. Each command-line variable becomes a simple variable holding its text as given
# (make expands a recursive one to export it to the recipes: that alone would run it), exported as that text;
# every variable a user may set is read through `raw` below, never as $(NAME).
$(foreach v,$(.VARIABLES),$(if $(filter command line,$(origin $v)),$(eval override $v := $$(value $v))$(eval export $v)))
# every variable that holds a path or a user's value is single-quoted in the recipes (`q`), so a space, `;`, `$`
# or a backtick in it is data, never shell syntax; ARGS alone is shell words (options for the command)
q            = '$(subst ','\'',$(1))'
qw           = $(foreach w,$(1),$(call q,$(w)))
empty       :=
space       := $(empty) $(empty)
esc          = $(subst $(space),\$(space),$(1))
VENV        ?= .venv
SETUP       ?= venv
BASE_PYTHON ?= $(shell command -v python3.11 || command -v python3)
TORCH_SPEC  ?= torch==2.13.0
# where pip gets torch; https://download.pytorch.org/whl/cpu: the CPU-only build (~200 MB instead of ~3 GB of CUDA)
TORCH_INDEX ?=
ARGS        ?=
CKPT        ?=
TEXT        ?=

# a value given on the command line or in the environment is used as it is: make never expands a `$` in it
raw          = $(if $(filter command line environment%,$(origin $(1))),$(value $(1)),$($(1)))
VENV_       := $(call raw,VENV)
VENV_MIN_    = $(call raw,VENV_MIN)
ARGS_       := $(call raw,ARGS)
TORCH_SPEC_ := $(call raw,TORCH_SPEC)
TORCH_INDEX_ := $(call raw,TORCH_INDEX)
BASE_PYTHON_ = $(call raw,BASE_PYTHON)

ifeq ($(call raw,SETUP),none)
PYTHON      ?= python3
RUNTIME     :=
DEV         :=
else
PYTHON      := $(VENV_)/bin/python
RUNTIME     := $(call esc,$(VENV_))/.fastmt-runtime
DEV         := $(call esc,$(VENV_))/.fastmt-dev
endif

# Local data: DATA_FILES (space-separated), else $FASTMT_DATA_FILES (read by fastmt itself: paths separated
# by ':'), else (a development checkout without Hub access) the stand-in corpus beside it if present; with
# none of them the data comes from the Hub (OPUS Books en-it).
# Not added when ARGS names the data itself (--data-files, --data.data_files, --data.dataset, --config).
STANDIN     ?= ../shared/data/opus_mt_testsets/en-it/train.jsonl
DATA_FILES  ?= $(if $(value FASTMT_DATA_FILES),,$(wildcard $(call raw,STANDIN)))
DATA_FLAGS  := --data-files --data.data_files --data.dataset --config
ARGS_DATA   := $(filter $(DATA_FLAGS) $(addsuffix =%,$(DATA_FLAGS)),$(ARGS_))
PYTHON_     := $(call raw,PYTHON)
DATA_FILES_ := $(call raw,DATA_FILES)
DATA_ARG    := $(if $(ARGS_DATA),,$(if $(DATA_FILES_),--data-files $(call qw,$(DATA_FILES_)),))
# `make train` picks the preset by device (--auto) unless ARGS chooses one
AUTO        := $(if $(filter --preset --preset=% --config --config=%,$(ARGS_)),,--auto)

.PHONY: help setup setup-dev train translate stats test kernel-test bench profile lint gpu-wheels clean

help:  ## this list
	@echo "usage: make TARGET [ARGS='--field value ...'] (targets set up .venv first)"
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/^([a-z-]+):.*## (.*)/  make \1\t\2/' | expand -t 22
	@echo "variables: ARGS (passed to the command; shell words), CKPT and TEXT (translate; passed as is),"
	@echo "  DATA_FILES (local jsonl/parquet/tsv files, space-separated; or FASTMT_DATA_FILES=a:b), TORCH_INDEX (pip index for torch;"
	@echo "  https://download.pytorch.org/whl/cpu: CPU-only), TORCH_SPEC, SETUP=none PYTHON=python3 (no venv)"

setup: $(RUNTIME)  ## create .venv with the runtime dependencies and the `fastmt` command

setup-dev: $(DEV)  ## setup + the dev and export extras (pytest, hypothesis, ruff, transformers, ctranslate2)

$(call esc,$(VENV_))/.fastmt-runtime: pyproject.toml constraints-cpu.txt
	@test -x $(call q,$(VENV_)/bin/python) || $(call q,$(BASE_PYTHON_)) -m venv $(call q,$(VENV_))
	@$(call q,$(VENV_)/bin/python) -c "import torch" 2>/dev/null || \
		$(call q,$(VENV_)/bin/pip) install -q $(if $(TORCH_INDEX_),--index-url $(call q,$(TORCH_INDEX_))) $(call q,$(TORCH_SPEC_))
	$(call q,$(VENV_)/bin/pip) install -q -e . -c constraints-cpu.txt
	@touch $(call q,$@)

$(call esc,$(VENV_))/.fastmt-dev: $(call esc,$(VENV_))/.fastmt-runtime
	$(call q,$(VENV_)/bin/pip) install -q -e ".[dev,export]" -c constraints-cpu.txt
	@touch $(call q,$@)

train: setup  ## train: CUDA -> the `fast` preset, CPU -> `tiny` (or ARGS="--preset P ...")
	@$(if $(DATA_ARG),echo "make train: local data "$(call qw,$(DATA_FILES_)),)
	PYTHONUNBUFFERED=1 $(call q,$(PYTHON_)) -m train $(AUTO) $(DATA_ARG) $(ARGS_)

# CKPT and TEXT reach the command through the environment, unexpanded: make never reads `$`, and the shell
# never runs backticks or splits the text
translate: export FASTMT_CKPT = $(value CKPT)
translate: export FASTMT_TEXT = $(value TEXT)
translate: setup  ## translate TEXT='...' (or lines on stdin) with CKPT=runs/<name>/checkpoints/best.pt
	@test -n "$$FASTMT_CKPT" || { echo "make translate: set CKPT=runs/<name>/checkpoints/best.pt (and TEXT='...' or pipe lines on stdin)" >&2; exit 2; }
	$(call q,$(PYTHON_)) -m train.translate --ckpt "$$FASTMT_CKPT" $${FASTMT_TEXT:+"$$FASTMT_TEXT"} $(ARGS_)

stats: setup  ## what the data pipeline makes of the corpus under a preset (ARGS="--preset P ...")
	$(call q,$(PYTHON_)) -m train.stats $(AUTO) $(DATA_ARG) $(ARGS_)

test: setup-dev  ## the CPU test suite (what CI runs, with .ci/readme-smoke.sh)
	$(call q,$(PYTHON_)) -m pytest -q -m "not slow and not gpu" --timeout=600 $(ARGS_)

kernel-test: setup-dev  ## Triton kernels: the interpreter on CPU, the full grid on CUDA
	$(call q,$(PYTHON_)) -m pytest -q tests/kernels -m "not slow" --timeout=1800 --durations=15 $(ARGS_)

bench: setup  ## kernel benchmarks, then the speedup ladder (a small smoke run on CPU)
	PYTHONUNBUFFERED=1 $(call q,$(PYTHON_)) -m bench.kernels $(ARGS_)
	PYTHONUNBUFFERED=1 $(call q,$(PYTHON_)) -m bench.ladder $(DATA_ARG) $(ARGS_)

profile: setup  ## torch.profiler trace + graph-break / recompile report of the compiled step
	PYTHONUNBUFFERED=1 $(call q,$(PYTHON_)) -m bench.profile $(DATA_ARG) $(ARGS_)

lint: setup-dev  ## ruff
	$(call q,$(PYTHON_)) -m ruff check .

gpu-wheels: setup  ## download the wheels the GPU image lacks into .whl/ (CPU machine with PyPI)
	bash bench/gpu_wheels.sh

# --- oldest supported torch (the GPU image's: 2.11) ------------------------------------------------------
# `make test-torch-min`: a second, git-ignored venv with torch $(TORCH_MIN) (the registry's wheel, a CUDA build
# that runs on the CPU) and the project, then the tests of the code that meets torch's compiler and kernel APIs
# -- compile, decoding, kernels, training -- on it. .ci/run calls it after `make test`.
TORCH_MIN       ?= 2.11.0
VENV_MIN        ?= .venv-torch-min
TORCH_MIN_TESTS ?= tests/kernels tests/models/test_decoding.py tests/train
TORCH_MIN_      := $(call raw,TORCH_MIN)
.PHONY: test-torch-min
test-torch-min: $(call esc,$(VENV_MIN_))/.fastmt-torch-$(TORCH_MIN_)
	FASTMT_TORCH_MIN=$(call q,$(TORCH_MIN_)) $(call q,$(VENV_MIN_)/bin/python) -c "import os, torch, triton; assert torch.__version__.split('+')[0] == os.environ['FASTMT_TORCH_MIN'], torch.__version__; print(f'test-torch-min: torch {torch.__version__}, triton {triton.__version__}')"
	$(call q,$(VENV_MIN_)/bin/python) -m pytest -q -m "not slow and not gpu" --timeout=900 -p no:cacheprovider $(call qw,$(call raw,TORCH_MIN_TESTS)) $(ARGS_)

# one stamp per torch version: TORCH_MIN=2.12.0 reinstalls torch in the same venv
$(call esc,$(VENV_MIN_))/.fastmt-torch-$(TORCH_MIN_): pyproject.toml constraints-cpu.txt
	@test -x $(call q,$(VENV_MIN_)/bin/python) || $(call q,$(BASE_PYTHON_)) -m venv $(call q,$(VENV_MIN_))
	$(call q,$(VENV_MIN_)/bin/pip) install -q $(call q,torch==$(TORCH_MIN_))
	$(call q,$(VENV_MIN_)/bin/pip) install -q -e ".[dev]" -c constraints-cpu.txt $(call q,torch==$(TORCH_MIN_))
	@rm -f $(call q,$(VENV_MIN_))/.fastmt-torch-* && touch $(call q,$@)

clean:  ## remove .venv, .venv-torch-min and the caches (never runs/)
	rm -rf $(call q,$(VENV_)) $(call q,$(VENV_MIN_)) .cache .pytest_cache .ruff_cache

# make exports command-line and environment variables to the recipes, expanding them to do so: not these.
# (Last in the file: `unexport V` defines V, empty, so a later `V ?= default` would never take its default.)
unexport VENV VENV_MIN PYTHON DATA_FILES CKPT TEXT
