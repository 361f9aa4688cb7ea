# `make perf` and `make test` set up .venv on first use (torch and triton pinned by constraints.txt).
PYTHON_BOOTSTRAP ?= python3
VENV := .venv
PYTHON := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_WORKERS ?= 2

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON_BOOTSTRAP) -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --upgrade pip
	$(PYTHON) -m pip install --quiet -c constraints.txt -e .
	touch $(STAMP)

.PHONY: test perf gpu-check
test: $(STAMP)
	$(PYTHON) -m pytest tests/ -n $(PYTEST_WORKERS)

perf: $(STAMP)
	$(PYTHON) -m pytest perf/

# On a CUDA machine: every test in one process, compute-sanitizer on the FlashAttention launch paths, and
# the record CPU CI checks (reports/<gpu>/gpu_check.json). PYTHON=python3 runs it with a Python that
# already has torch and triton, without setting up .venv.
gpu-check: $(if $(filter $(VENV)/bin/python,$(PYTHON)),$(STAMP))
	$(PYTHON) -m cs336_systems.gpu_check
