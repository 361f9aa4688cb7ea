"""Problems fsdp and fsdp_accounting: FSDP against single-process training (fp32 and bf16
compute), then step time, peak memory and communication against torch FSDP (fully_shard per
Transformer block) and torch DDP, with a profiled step's timeline, all from one set of ranks.

On GPUs: the XL model, context 512, batch 4 per rank, fp32, NCCL on --world-size GPUs (the course
uses 2). On CPU: the tiny model over gloo, a smoke run of the same code in seconds.

With --adapters, the implementation under test's FSDP is measured in the same launch, after the others; its
test is skipped where the module lacks get_fsdp or fsdp_on_after_backward and fails where it failed.
"""

from dataclasses import replace

import pytest

from cs336_systems.baselines import at_world_size, within
from cs336_systems.benchmarks.fsdp import (
    UNDER_TEST_FUNCTIONS,
    VARIANTS,
    fsdp_problems,
    timeline_intervals,
    under_test_variant,
)
from cs336_systems.benchmarks.harness import under_test_of
from cs336_systems.benchmarks.sharding import ShardingBenchmarkConfig
from cs336_systems.cells import failures, require_some_ran, unmeasured
from cs336_systems.distributed.equivalence import equivalence_failures
from cs336_systems.distributed.launch import launch
from cs336_systems.profiling.timeline import plot_timeline
from cs336_systems.rows import FAILED, OOM
from cs336_systems.rows.fsdp import OURS, TORCH_FSDP

GPU_CONFIG = ShardingBenchmarkConfig()
CPU_CONFIG = ShardingBenchmarkConfig(size="tiny", context_length=32, batch_size=2, warmup=1, steps=3)
PROBLEMS = ("fsdp", "fsdp_accounting")
TIMELINE_FILE = "fsdp_timeline.png"
# Building the XL model four times, ~9 steps of each and one profiled step: about two minutes on
# two H200s.
LAUNCH_TIMEOUT_S = 600
# Ours takes at most 5% longer per step than torch's fully_shard per block: on two H100s (xl, NCCL) it
# was 2.5% faster, and such ratios move by a few percent from run to run.
TORCH_PARITY = within(0.05)
# What names a step's entry in pytest-benchmark's store (cs336_systems.benchmark_store).
STORE_CELL = ("table", "size", "context_length", "batch_size", "world_size", "backend", "variant")

pytestmark = pytest.mark.fsdp


@pytest.fixture(scope="module")
def rows(distributed_device, world_size, run_settings, report, adapters, benchmark_store):
    cfg = replace(GPU_CONFIG if distributed_device == "cuda" else CPU_CONFIG, size_table=run_settings.size_table)
    under_test = under_test_of(adapters)
    result = launch(fsdp_problems, world_size, cfg, under_test, device=distributed_device,
                    timeout_s=LAUNCH_TIMEOUT_S)[0]
    measured = result["rows"]
    if result["timeline"]:
        figure = plot_timeline(timeline_intervals(result["timeline"]),
                               f"{OURS}: one {cfg.size} training step, rank 0 of {world_size}")
        figure.savefig(report(PROBLEMS[1]).asset_path(TIMELINE_FILE), dpi=120, bbox_inches="tight")
        measured.append({"table": "timeline", "variant": OURS, "file": TIMELINE_FILE})
    for problem in PROBLEMS:
        for row in measured:
            report(problem).add(row)
    benchmark_store.add_rows(PROBLEMS[0], measured, STORE_CELL, compared="variant")
    return measured


def test_fsdp_matches_single_process(rows):
    equivalence = [r for r in rows if r["table"] == "equivalence"]
    assert [r["compute"] for r in equivalence] == ["fp32", "bf16"]
    failures = equivalence_failures(equivalence, label="compute")
    assert not failures, "differs from single-process training:\n" + "\n".join(failures)


def test_fsdp_accounting(rows):
    steps = [r for r in rows if r["table"] == "step" and not r.get("implementation")]
    assert [r["variant"] for r in steps] == [variant.label for variant in VARIANTS]
    assert {r["status"] for r in steps} <= {"ok", OOM}
    require_some_ran(steps, "the FSDP variants' training steps")
    assert not unmeasured(steps, "step_ms", "optimizer_ms")


def test_fsdp_speedup_gate(rows, world_size, speedup_gate):
    """On a device with a baseline file: torch FSDP's step time over ours is at least 1 / 1.05 (ours takes at
    most 5% longer) and within tolerance of the baseline recorded at this world size."""
    steps = {r["variant"]: r for r in rows if r["table"] == "step"}
    ours, theirs = steps[OURS], steps[TORCH_FSDP]
    speedup_gate(at_world_size("fsdp_vs_torch_fsdp", world_size), theirs.get("step_ms"), ours.get("step_ms"),
                 promise=TORCH_PARITY, note=f"torch FSDP: {theirs['status']}, ours: {ours['status']}")


@pytest.mark.adapters(*UNDER_TEST_FUNCTIONS)
def test_fsdp_implementation_under_test(implementation_under_test, rows):
    """The implementation under test's FSDP trained beside the references: its step ran, or ran out of memory; one
    that raised fails, naming its error."""
    steps = [r for r in rows if r["table"] == "step" and r.get("implementation")]
    assert [r["variant"] for r in steps] == [under_test_variant(implementation_under_test).label]
    assert {r["status"] for r in steps} <= {"ok", OOM, FAILED}
    assert not unmeasured(steps, "step_ms", "optimizer_ms")
    if failed := failures(steps, "variant"):
        pytest.fail(f"{implementation_under_test.label} failed:\n" + "\n".join(failed))
