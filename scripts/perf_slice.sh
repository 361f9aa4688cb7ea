#!/usr/bin/env bash
# Run part of the perf suite within a time budget on a host whose Python already has torch (no .venv),
# from the repository root; logs and a tarball of reports/ and perf/baselines/ land in $OUT (default ./out).
#   scripts/perf_slice.sh <seconds> <pytest arguments...>
# SIGINT at the deadline lets pytest finish its session, so the rows measured so far reach the reports.
set -uo pipefail
budget_s=$1; shift
out=${OUT:-out}; mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
python3 -c "import torch, triton, pytest; print('torch', torch.__version__, 'triton', triton.__version__, 'pytest', pytest.__version__)"
timeout -s INT "$budget_s" python3 -m pytest -p no:cacheprovider -q -rfE "$@" 2>&1 | tee -a "$out/perf.log"
tar czf "$out/reports.tgz" reports perf/baselines
