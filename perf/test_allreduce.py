"""Problem distributed_communication_single_node: all-reduce time and bandwidth, gloo on CPU
processes (always) and NCCL on GPUs (when the run has them)."""

import os

import pytest

from cs336_systems.benchmarks.allreduce import (
    GLOO_WORLD_SIZES,
    NCCL_WORLD_SIZES,
    SIZES_BYTES,
    allreduce_sweep,
    gloo_sizes,
)
from cs336_systems.cells import require_some_ran, unmeasured
from cs336_systems.distributed.launch import launch
from cs336_systems.rows import OOM

PROBLEM = "distributed_communication_single_node"
# 1 GB over gloo on 6 ranks takes about a second per all-reduce; a hang ends here instead.
LAUNCH_TIMEOUT_S = 600

pytestmark = pytest.mark.ddp


def _check_sweep(rows, backend, sizes_bytes, world_sizes):
    """One row per (world size, size) in sweep order, each measured or out of memory, and some measured."""
    cells = [(world_size, size) for world_size in world_sizes for size in sizes_bytes]
    assert [(r["world_size"], r["size_bytes"]) for r in rows] == cells
    assert {r["backend"] for r in rows} == {backend}
    assert {r["status"] for r in rows} <= {"ok", OOM}
    require_some_ran(rows, f"the {backend} all-reduce cells")
    assert not unmeasured(rows, "iterations", "mean_rank_median_ms", "max_rank_median_ms", "algbw_gbps", "busbw_gbps")


def test_allreduce_gloo(report):
    sizes = gloo_sizes(len(os.sched_getaffinity(0)), max(GLOO_WORLD_SIZES))
    rows = launch(allreduce_sweep, max(GLOO_WORLD_SIZES), sizes, GLOO_WORLD_SIZES,
                  device="cpu", timeout_s=LAUNCH_TIMEOUT_S)[0]
    for row in rows:
        report(PROBLEM).add(row)
    _check_sweep(rows, "gloo", sizes, GLOO_WORLD_SIZES)


@pytest.mark.gpu
@pytest.mark.multigpu
def test_allreduce_nccl(run_settings, report):
    world_sizes = [n for n in NCCL_WORLD_SIZES if n <= run_settings.world_size]
    if not world_sizes:
        pytest.skip(f"--world-size {run_settings.world_size}: an all-reduce needs at least 2 GPUs")
    rows = launch(allreduce_sweep, max(world_sizes), SIZES_BYTES, world_sizes,
                  device="cuda", timeout_s=LAUNCH_TIMEOUT_S)[0]
    for row in rows:
        report(PROBLEM).add(row)
    _check_sweep(rows, "nccl", SIZES_BYTES, world_sizes)
