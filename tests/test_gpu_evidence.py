"""GPU evidence that CPU CI checks: each committed `make gpu-check` record must be a clean run of the
current FlashAttention source, and the committed flash_benchmarking rows of each GPU must have measured
that source, their gated speed-ups holding against that GPU's baselines. A kernel change therefore
cannot land without testing and measuring it again on the GPU."""

from pathlib import Path

import pytest

from cs336_systems import baselines, gpu_check
from cs336_systems.attention.flash_triton import source_hash
from cs336_systems.benchmarks.flash import GATE_PROMISES, GATED_PROVIDERS, gate_name, gate_ratios
from cs336_systems.reports import read_rows

REPO = Path(__file__).resolve().parents[1]
GATED_GPUS = sorted(path.stem for path in (REPO / "perf" / "baselines").glob("*.json")
                    if (REPO / "reports" / path.stem / "flash_benchmarking.csv").exists())


GPU_CHECKED = sorted(path.parent.name for path in (REPO / "reports").glob(f"*/{gpu_check.RECORD_NAME}.json"))


def test_some_gpu_has_a_committed_gpu_check_record():
    assert GPU_CHECKED, f"no reports/<gpu>/{gpu_check.RECORD_NAME}.json: run `make gpu-check` on a CUDA machine"


@pytest.mark.parametrize("gpu", GPU_CHECKED)
def test_committed_gpu_check_record_is_a_clean_run_of_the_current_source(gpu):
    found = gpu_check.problems(gpu_check.load_record(REPO / "reports" / gpu), source_hash())
    assert not found, (f"reports/{gpu}/{gpu_check.RECORD_NAME}.json is no evidence for the current source: "
                       + "; ".join(found))


def test_some_gpu_has_committed_flash_rows_and_baselines():
    assert GATED_GPUS, "no reports/<gpu>/flash_benchmarking.csv beside a perf/baselines/<gpu>.json"


@pytest.mark.parametrize("gpu", GATED_GPUS)
def test_committed_flash_gates_measured_the_current_source_and_hold(gpu):
    rows = read_rows(REPO / "reports" / gpu / "flash_benchmarking.csv")
    current = source_hash()
    gate_rows = [r for r in rows if r.get("table") == "gate"]
    assert {r["provider"] for r in gate_rows} >= {"flash_triton", *GATED_PROVIDERS}, "the gate rows are missing"
    stale = {r.get("source_hash") for r in gate_rows} - {current}
    assert not stale, (f"reports/{gpu}/flash_benchmarking.csv gates measured FlashAttention source {stale}, not the "
                       f"current {current}: run `pytest perf/test_flash.py --gpu {gpu} -m flash` on that GPU")
    # Rows that name a source name the current one; rows from before sources were recorded name none.
    named = {r["source_hash"] for r in rows if r.get("source_hash")}
    assert named <= {current}, f"rows measured other sources: {sorted(named - {current})}"
    path = REPO / "perf" / "baselines" / f"{gpu}.json"
    recorded, ratios = baselines.load_baselines(path), gate_ratios(rows)
    for provider in GATED_PROVIDERS:
        name = gate_name(provider)
        assert ratios[name] is not None, f"{name}: a gated variant has no time in the committed rows"
        result = baselines.check(name, ratios[name], recorded, GATE_PROMISES[provider])
        assert result.passed, result.message(path)
