#!/usr/bin/env bash
# Run part of the perf suite within a time budget on a host whose Python already has torch (no .venv),
# from the repository root; logs and a tarball of reports/ and perf/baselines/ land in $OUT (default ./out).
#   scripts/perf_slice.sh <seconds> <pytest arguments...>
# Tests start only within <seconds> (--time-budget); the one running then finishes and the session
# writes its reports. A test still running GRACE_S later gets SIGINT, which also lets pytest finish its
# session. So the whole run takes at most <seconds> + GRACE_S, plus writing the reports.
set -uo pipefail
GRACE_S=150
budget_s=$1; shift
out=${OUT:-out}; mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
python3 -c "import torch, triton, pytest; print('torch', torch.__version__, 'triton', triton.__version__, 'pytest', pytest.__version__)"
timeout -s INT "$((budget_s + GRACE_S))" python3 -m pytest -p no:cacheprovider -q -rfE --time-budget "$budget_s" "$@" \
    2>&1 | tee -a "$out/perf.log"
tar czf "$out/reports.tgz" reports perf/baselines
