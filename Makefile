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

.PHONY: test perf gpu-check single-gpu-reports
test: $(STAMP)
	$(PYTHON) -m pytest tests/ cs336_systems/conformance -n $(PYTEST_WORKERS)

perf: $(STAMP)
	$(PYTHON) -m pytest perf/

# On a CUDA machine: every test in one process, compute-sanitizer on the FlashAttention launch paths, and
# the record CPU CI checks (reports/<gpu>/gpu_check/, one file per code checked). PYTHON=python3 runs these
# GPU targets with a Python that already has torch and triton, without setting up .venv.
GPU_SETUP := $(if $(filter $(VENV)/bin/python,$(PYTHON)),$(STAMP))
gpu-check: $(GPU_SETUP)
	$(PYTHON) -m cs336_systems.gpu_check

# On one GPU, the reports of pytorch_attention (eager), nsys_profile, memory_profiling (with its memory_viz
# snapshots and their timelines) and gradient_checkpointing, on the 2026 handout's model and settings (xl at
# contexts 128 and 2048); 3 minutes 40 seconds on an H100 80GB HBM3.
single-gpu-reports: $(GPU_SETUP)
	$(PYTHON) -m pytest perf/test_attention.py perf/test_profile.py perf/test_memory.py \
		-m "attention or profile or memory" -k "not compiled" --gpu auto -p no:cacheprovider -q
