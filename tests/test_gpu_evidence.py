"""GPU measurements that CPU CI checks: the committed flash_benchmarking rows of each GPU must have
measured the current FlashAttention source, and their gated speed-ups must hold against that GPU's
baselines. A kernel change therefore cannot land without measuring it again on the GPU."""

from pathlib import Path

import pytest

from cs336_systems import baselines
from cs336_systems.attention.flash_triton import source_hash
from cs336_systems.benchmarks.flash import GATE_PROMISES, GATED_PROVIDERS, gate_name, gate_ratios
from cs336_systems.reports import read_rows

REPO = Path(__file__).resolve().parents[1]
GATED_GPUS = sorted(path.stem for path in (REPO / "perf" / "baselines").glob("*.json")
                    if (REPO / "reports" / path.stem / "flash_benchmarking.csv").exists())


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
