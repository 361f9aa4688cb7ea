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

.PHONY: test perf
test: $(STAMP)
	$(PYTHON) -m pytest tests/ -n $(PYTEST_WORKERS)

perf: $(STAMP)
	$(PYTHON) -m pytest perf/
