# `make demo` and `make test` each work on a fresh clone: they create .venv, install the CPU
# build of torch when no GPU is present, install the project, then run.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_CPU_VERSION := 2.13.0
# Use the local CPU wheel cache when the machine has one, otherwise PyTorch's CPU index.
TORCH_CPU_SOURCE := $(if $(wildcard /opt/wheels/torch-$(TORCH_CPU_VERSION)+cpu*),,--extra-index-url https://download.pytorch.org/whl/cpu)

.PHONY: install demo demo-moe test lint format bench wheelhouse clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	if ! nvidia-smi -L >/dev/null 2>&1; then \
		$(BIN)/pip install -q "torch==$(TORCH_CPU_VERSION)" $(TORCH_CPU_SOURCE); fi
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

install: $(BIN)/.installed

demo: install
	PATH=$(CURDIR)/$(BIN):$$PATH bash launch/demo.sh

demo-moe: install
	PATH=$(CURDIR)/$(BIN):$$PATH bash launch/demo.sh moe

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Two test processes: a multi-rank test's ranks wait on each other and on the disk, so one
# process left a core idle about a third of the time (67 CPU-minutes in 47 minutes on 2 cores).
TEST_WORKERS ?= 2

test: lint
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=40

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# A 1.2 GiB checkpoint (80M parameters with fp32 Adam state) for the save benchmark.
CKPT_BENCH_MODEL = model.preset=small model.num_layers=6 model.hidden_size=1024 model.ffn_hidden_size=2816 \
	model.num_attention_heads=16 model.num_query_groups=8

bench: install
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python benchmarks/overhead.py
	for layout in "4 parallel.tensor=2 parallel.pipeline=2" "2 parallel.tensor=1 parallel.pipeline=1" \
	              "4 parallel.tensor=1 parallel.pipeline=1"; do set -- $$layout; nproc=$$1; shift; \
	  PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python benchmarks/checkpoint_save.py --nproc $$nproc --repeats 6 \
	    $(CKPT_BENCH_MODEL) "$$@" || exit 1; done

# An offline install kit for a GPU node that already has torch (see README).
PY ?= 3.12
wheelhouse: install
	PYTHON=$(BIN)/python bash tools/build_wheelhouse.sh --python $(PY)

clean:
	rm -rf $(VENV) runs
