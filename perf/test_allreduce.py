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
from cs336_systems.distributed.launch import launch

PROBLEM = "distributed_communication_single_node"
# 1 GB over gloo on 6 ranks takes about a second per all-reduce; a hang ends here instead.
LAUNCH_TIMEOUT_S = 600

pytestmark = pytest.mark.ddp


def test_allreduce_gloo(report):
    sizes = gloo_sizes(len(os.sched_getaffinity(0)), max(GLOO_WORLD_SIZES))
    rows = launch(allreduce_sweep, max(GLOO_WORLD_SIZES), sizes, GLOO_WORLD_SIZES,
                  device="cpu", timeout_s=LAUNCH_TIMEOUT_S)[0]
    for row in rows:
        report(PROBLEM).add(row)
    assert len(rows) == len(sizes) * len(GLOO_WORLD_SIZES)


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
    assert len(rows) == len(SIZES_BYTES) * len(world_sizes)
