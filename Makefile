# `make demo` and `make test` work on a fresh clone: the venv is created on first use.
PY ?= python3
# Elsewhere than these machines (where pip finds the CPU wheel locally), point pip at the CPU build:
#   make TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu" test
TORCH_PIP_ARGS ?=
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-all install ui clean

$(STAMP): pyproject.toml native_nccl/cpu_alloc/counting_allocator.cpp
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# The CPU wheel of torch first, pinned: a bare or open-ended torch would pull a multi-GB CUDA build.
	$(BIN)/pip install --quiet $(TORCH_PIP_ARGS) torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	# the native counting allocator (exact peak memory), built once ahead of the rank processes
	$(BIN)/python -m prism_core.memory.native --build
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/prism run configs/demo.yaml

# the fast path (the tests marked slow left out): whole files spread over TEST_WORKERS pytest-xdist
# workers (a file's shared job runs once), the slowest files first (tests/conftest.py); the
# slowest tests listed, to keep its time in check
TEST_WORKERS ?= 2
test: $(STAMP)
	$(BIN)/python -m pytest -m "not slow" -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -q --durations=15

test-all: $(STAMP)
	$(BIN)/python -m pytest -q

# The Prefect UI over this project's runs (PREFECT_HOME=.prefect, as the prism commands use), on loopback only
PORT ?= 4200
ui: $(STAMP)
	PREFECT_HOME=$(CURDIR)/.prefect PREFECT_SERVER_ANALYTICS_ENABLED=false \
	  $(BIN)/prefect server start --host 127.0.0.1 --port $(PORT)

clean:
	rm -rf $(VENV) artifacts/*/ .pytest_cache .hypothesis
