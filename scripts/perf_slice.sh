#!/usr/bin/env bash
# Run part of the perf suite within a time limit on a host whose Python already has torch (no .venv),
# from the repository root; logs and a tarball of reports/ and perf/baselines/ land in $OUT (default ./out).
#   scripts/perf_slice.sh <limit seconds> <pytest arguments...>
# The whole run, tarball included, ends within the limit. Tests start only within the limit less
# GRACE_S and END_S (--time-budget); the one running then finishes, or gets SIGINT END_S before the
# limit, which also lets pytest finish its session: writing the reports of the tests that ended takes
# tens of seconds (a pytest still running 45 s after SIGINT is killed), and the tarball a few.
set -uo pipefail
GRACE_S=150
END_S=60
limit_s=$1; shift
if (( limit_s <= GRACE_S + END_S )); then
    echo "perf_slice.sh: a limit of ${limit_s} s leaves no time to start a test (it needs over $((GRACE_S + END_S)) s)" >&2
    exit 2
fi
out=${OUT:-out}; mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
python3 -c "import torch, triton, pytest; print('torch', torch.__version__, 'triton', triton.__version__, 'pytest', pytest.__version__)"
timeout -s INT -k 45 "$((limit_s - END_S))" python3 -m pytest -p no:cacheprovider -q -rfE --durations=15 \
    --time-budget "$((limit_s - END_S - GRACE_S))" "$@" 2>&1 | tee -a "$out/perf.log"
tar czf "$out/reports.tgz" reports perf/baselines
