"""The one way a benchmark cell deals with memory it may not have.

Before it runs, a cell estimates its peak from the closed-form models in `cs336_systems.accounting`
and is recorded as OOM, without running, when the estimate does not fit what is free: the GPU's free
memory, or on a CPU the RAM the kernel reports available. A cell that runs out all the same is
recorded the same way, with its estimate beside it, and the sweep goes on.

How much of what is free an estimate may ask for depends on what running out costs. On a CPU, Linux
overcommits memory, so a process that allocates more than the machine has is not told so but killed
by the kernel's OOM killer, with no error to catch; and a rank that runs out alone inside collectives
leaves its peers waiting. There a cell starts only with a margin (FIT_SHARE). A lone cell on a GPU
gets an error it can record, so it is tried wherever the estimate's error could make it fit
(GPU_TRY_SHARE), and its real outcome is recorded instead of a guess.

Benchmarks run their cells through `cs336_systems.benchmarks.harness.guarded_cell`, which puts these
pieces together: check, release memory, measure, record OOM, release memory again.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from pathlib import Path

import torch

from cs336_systems.checks import check_non_negative_finite, check_positive_int
from cs336_systems.rows import OOM, Row

# The estimates leave out allocator rounding and fragmentation, library workspaces and the
# interpreter's own memory: where running out cannot be recorded, a cell whose estimate needs more
# than this share of what is free is not started.
FIT_SHARE = 0.9
# Estimated over measured peak of the training steps measured on an H100: 0.936 to 0.994 eager, 0.966 to
# 1.194 compiled (the committed rows, checked by tests/test_memory_guard.py), and 1.23 compiled at context
# 2048 (xl, bf16: 93.3 GB estimated, a 70.6 GiB peak). A lone GPU cell is tried up to this multiple of
# what is free, so that no cell that fits is refused.
GPU_TRY_SHARE = 1.25
# What torch's CPU allocator raises when malloc fails (a RuntimeError, not torch.OutOfMemoryError).
CPU_ALLOCATOR_FAILURE = "DefaultCPUAllocator: can't allocate memory"
MEMINFO = Path("/proc/meminfo")
CGROUP = Path("/sys/fs/cgroup")


def available_bytes(device: torch.device | str) -> int:
    """Memory a new cell on `device` can still get: free CUDA memory once the allocator's cache is
    returned, or the host RAM available to this process."""
    device = torch.device(device)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(device)[0]
    return _available_ram_bytes()


def _available_ram_bytes() -> int:
    """MemAvailable, or less where a cgroup (a container's memory limit) leaves less. A cgroup's usage
    (memory.current) counts the page cache its files filled; the inactive part of it (inactive_file in
    memory.stat) the kernel reclaims before the limit is met, so it is counted as free, as container
    runtimes count a working set."""
    fields = dict(line.split(":", 1) for line in MEMINFO.read_text().splitlines() if ":" in line)
    available = int(fields["MemAvailable"].split()[0]) * 1024
    limit, current, stat = CGROUP / "memory.max", CGROUP / "memory.current", CGROUP / "memory.stat"
    if limit.is_file() and current.is_file() and limit.read_text().strip() != "max":
        counters = dict(line.split() for line in stat.read_text().splitlines()) if stat.is_file() else {}
        used = int(current.read_text()) - int(counters.get("inactive_file", 0))
        available = min(available, int(limit.read_text()) - used)
    return available


@dataclass(frozen=True)
class MemoryCheck:
    estimated_bytes: int  # one process's estimated peak
    available_bytes: int
    processes: int = 1  # processes sharing the memory (ranks on one CPU host)
    share: float = FIT_SHARE  # of the available bytes, what the estimates may ask for

    @property
    def fits(self) -> bool:
        """Whether the cell is started (see the module docstring)."""
        return self.estimated_bytes * self.processes <= self.share * self.available_bytes

    def columns(self) -> Row:
        return {"estimated_peak_bytes": self.estimated_bytes, "available_bytes": self.available_bytes}


def oom_columns(predicted: bool, check: MemoryCheck | None = None) -> Row:
    """A row's status OOM, whether it was predicted (not run) or happened, and the estimate where the
    cell had one."""
    return {"status": OOM, "oom_predicted": predicted, **(check.columns() if check is not None else {})}


def check_memory(estimated_bytes: int, device: torch.device | str, processes: int = 1, *,
                 in_collectives: bool = False) -> MemoryCheck:
    """Whether a cell of `estimated_bytes` per process starts on `device`: with a margin where running out
    cannot be recorded (host RAM, or ranks `in_collectives`), else wherever it could fit."""
    check_non_negative_finite(estimated_bytes=estimated_bytes)
    check_positive_int(processes=processes)
    recordable = torch.device(device).type == "cuda" and not in_collectives
    return MemoryCheck(int(estimated_bytes), available_bytes(device), processes,
                       GPU_TRY_SHARE if recordable else FIT_SHARE)


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` is an allocation failure, on a GPU or on the CPU."""
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and CPU_ALLOCATOR_FAILURE in str(error))


def check_memory_on_every_rank(estimated_bytes: int, device: torch.device | str, world_size: int,
                               group=None) -> MemoryCheck:
    """`check_memory` on every rank of `group` (world_size ranks), agreed: every rank must run a
    variant's collectives or none, so a variant runs only where it fits on every rank (the first
    rank's check that does not fit is returned). Ranks on one CPU host share its RAM; GPU ranks have a
    GPU each."""
    import torch.distributed as dist

    processes = world_size if torch.device(device).type == "cpu" else 1
    mine = check_memory(estimated_bytes, device, processes, in_collectives=True)
    checks: list[MemoryCheck | None] = [None] * world_size
    dist.all_gather_object(checks, mine, group=group)
    return next((check for check in checks if not check.fits), mine)
