"""Problem distributed_communication_single_node: all-reduce time and bandwidth by backend, data
size and number of ranks (cs336_systems.reports.allreduce renders them).

    rows = launch(allreduce_sweep, 6, SIZES_BYTES, (2, 4, 6), device="cpu")[0]

One launch of the largest world size serves the whole sweep: a smaller world size runs on a
subgroup of the first ranks while the others wait, so ranks start (and import torch) once.
Every rank times each all-reduce on its own (device synchronised, ranks released together by a
barrier before each one); the ranks' medians are gathered with all_gather_object into one row.

Bandwidths (nccl-tests' definitions): algorithm bandwidth = bytes / time. Bus bandwidth =
algbw * 2(n-1)/n: a ring all-reduce sends (and receives) 2(n-1)/n of the data on every rank's
link, so bus bandwidth is what each link carried per second in each direction. It is comparable
across world sizes and is the number to set against a link's nominal per-direction bandwidth.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import torch
import torch.distributed as dist

from cs336_systems.benchmarks.harness import guarded_cell
from cs336_systems.distributed.launch import rank_device
from cs336_systems.gpus import MB, NVLINK_BYTES_PER_S_PER_DIRECTION, NVLINK_GENERATION, spec_for_device_name
from cs336_systems.memory_guard import check_memory_on_every_rank
from cs336_systems.rows import Row
from cs336_systems.rows.allreduce import MAX_ITERATIONS, MIN_ITERATIONS, WARMUP
from cs336_systems.timing import STEP_TIMER, synchronize, timed

GB = 10**9
SIZES_BYTES = (1 * MB, 10 * MB, 100 * MB, 1 * GB)
GLOO_WORLD_SIZES = (2, 4, 6)
NCCL_WORLD_SIZES = (2, 4, 6, 8)
FLOAT32_BYTES = 4
# What one rank holds for an all-reduce of a tensor: the tensor and, at most, a working copy of the
# same size that the backend reduces into.
ALLREDUCE_COPIES = 2
# At most about this much time of all-reduces per cell (cs336_systems.rows.allreduce.MAX_ITERATIONS).
SECONDS_PER_CELL = 3.0
# The all-reduce's ranks share the host's cores: with fewer than this many per rank of the
# largest world size, the 100 MB and 1 GB gloo cells would take minutes, so they are left out.
GLOO_CORES_PER_RANK_FOR_LARGE_SIZES = 2
GLOO_SIZE_LIMIT_ON_SMALL_HOSTS = 10 * MB


def bus_bandwidth(algbw_bytes_per_s: float, world_size: int) -> float:
    return algbw_bytes_per_s * 2 * (world_size - 1) / world_size


def gloo_sizes(cpu_count: int, max_world_size: int, sizes_bytes: Sequence[int] = SIZES_BYTES) -> tuple[int, ...]:
    """All sizes with at least GLOO_CORES_PER_RANK_FOR_LARGE_SIZES cores per rank, else those up to 10 MB."""
    if cpu_count >= GLOO_CORES_PER_RANK_FOR_LARGE_SIZES * max_world_size:
        return tuple(sizes_bytes)
    return tuple(s for s in sizes_bytes if s <= GLOO_SIZE_LIMIT_ON_SMALL_HOSTS)


def summarize(backend: str, device_name: str, world_size: int, size_bytes: int, iterations: int,
              rank_medians_s: Sequence[float]) -> Row:
    """One row from every rank's median time: the mean over ranks and the slowest rank."""
    if len(rank_medians_s) != world_size:
        raise ValueError(f"expected {world_size} per-rank medians, got {len(rank_medians_s)}")
    mean_s = statistics.fmean(rank_medians_s)
    algbw = size_bytes / mean_s
    row = {"backend": backend, "device": device_name, "world_size": world_size, "size_bytes": size_bytes,
           "size_mb": size_bytes / MB, "status": "ok", "iterations": iterations, "timer": STEP_TIMER,
           "mean_rank_median_ms": mean_s * 1e3, "max_rank_median_ms": max(rank_medians_s) * 1e3,
           "algbw_gbps": algbw / GB, "busbw_gbps": bus_bandwidth(algbw, world_size) / GB}
    spec = spec_for_device_name(device_name) if backend == "nccl" else None
    if spec is not None and spec.slug in NVLINK_BYTES_PER_S_PER_DIRECTION:
        row["nvlink_generation"] = NVLINK_GENERATION[spec.slug]
        row["nominal_link_gbps"] = NVLINK_BYTES_PER_S_PER_DIRECTION[spec.slug] / GB
    return row


def time_allreduce(size_bytes: int, group=None, warmup: int = WARMUP) -> tuple[float, int]:
    """(this rank's median seconds, timed iterations) for a float32 all-reduce of `size_bytes`.

    Every rank of `group` must call it. The iteration count comes from rank 0's warm-up pace, so
    that all ranks run the same number of all-reduces.
    """
    device = rank_device()
    tensor = torch.rand(size_bytes // FLOAT32_BYTES, device=device)
    warmup_ms: list[float] = []
    for _ in range(warmup):
        with timed(device, warmup_ms):
            dist.all_reduce(tensor, group=group)
    pace = [warmup_ms[-1] * 1e-3 if warmup_ms else None]
    dist.broadcast_object_list(pace, src=0, group=group)
    iterations = MAX_ITERATIONS if pace[0] is None else \
        max(MIN_ITERATIONS, min(MAX_ITERATIONS, int(SECONDS_PER_CELL / pace[0])))
    samples_ms: list[float] = []
    for _ in range(iterations):
        dist.barrier(group=group)  # start together: no rank's time includes waiting for a late one
        synchronize(device)
        with timed(device, samples_ms):
            dist.all_reduce(tensor, group=group)
    return statistics.median(samples_ms) * 1e-3, iterations


def _guarded_size(backend: str, device_name: str, device: torch.device, size_bytes: int, group,
                  group_size: int) -> Row:
    """One size's row on every rank of `group`, or its OOM row where its buffers do not fit on every rank
    (then no rank runs it). Running out inside the all-reduces fails the launch at once: one rank that
    recorded it and went on would leave the others waiting in a collective."""
    def measure(columns: Row) -> Row:
        median_s, iterations = time_allreduce(size_bytes, group)
        medians: list[float | None] = [None] * group_size
        dist.all_gather_object(medians, median_s, group=group)
        return summarize(backend, device_name, group_size, size_bytes, iterations, medians)

    estimated_bytes = ALLREDUCE_COPIES * size_bytes
    return guarded_cell(device, lambda: check_memory_on_every_rank(estimated_bytes, device, group_size, group), measure,
                        oom=lambda columns: {"backend": backend, "device": device_name, "world_size": group_size,
                                             "size_bytes": size_bytes, "size_mb": size_bytes / MB, **columns},
                        record_running_out=False)


def allreduce_sweep(rank: int, world_size: int, sizes_bytes: Sequence[int], world_sizes: Sequence[int]) -> list[Row]:
    """Run under launch with world_size = max(world_sizes); rank 0 returns the rows, others []."""
    if max(world_sizes) > world_size:
        raise ValueError(f"world sizes {tuple(world_sizes)} need {max(world_sizes)} ranks, the launch has {world_size}")
    backend = dist.get_backend()
    device = rank_device()
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    rows = []
    for group_size in world_sizes:
        group = dist.new_group(list(range(group_size)))  # every rank takes part in creating it
        if rank < group_size:
            rows += [_guarded_size(backend, device_name, device, size_bytes, group, group_size)
                     for size_bytes in sizes_bytes]
            dist.destroy_process_group(group)
        dist.barrier()
    return rows if rank == 0 else []
