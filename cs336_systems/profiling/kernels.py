"""Kernel tables per profiler range, from torch.profiler (no Nsight needed).

    with torch.profiler.profile(activities=profiler_activities(device)) as prof:
        with annotate("forward"):
            ...
    tables = kernel_tables(prof.events(), device.type, ranges=["forward", "backward"])
    tables["forward"].kernels[0]     # KernelStat(name, calls, total_us, share, matmul)

The work of a CUDA run is every kernel (and memcpy / memset) the GPU ran. The profiler links each of
them by correlation id to the CPU operator that launched it, and lists them, with their GPU
durations, in that operator's `FunctionEvent.kernels`. A CPU run launches nothing: there the work is
each operator's own (self) CPU time, so the same tables come out of a CPU profile.

A piece of work belongs to a range (a record_function / NVTX range, recorded on the CPU) when the
CPU interval of the operator that launched it lies inside one of the range's intervals. This is
containment in time, not by thread: backward operators run on autograd's own thread while the
"backward" range, on the main thread, waits for loss.backward() to return. Work in nested ranges
counts in each of them ("forward" includes "attention/softmax").
"""

from __future__ import annotations

import bisect
import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch.autograd import DeviceType

# Kernel and operator names of matrix multiplies: cuBLAS / cuBLASLt (gemm, gemv, xmma, nvjet and
# their split-K reduction), CUTLASS, and the aten matmul operators whose self time is the matmul on CPU.
_MATMUL = re.compile(
    r"gemm|gemv|xmma|nvjet|cublas|cutlass|splitkreduce"
    r"|^aten::(mm|addmm|bmm|baddbmm|addbmm|matmul|linear|mv|dot|_scaled_mm)$",
    re.IGNORECASE,
)
# Fused attention kernels contain matmuls but also the softmax; CUTLASS-based ones (fmha_cutlass*)
# would otherwise match above.
_FUSED_ATTENTION = re.compile(r"fmha|flash|attention", re.IGNORECASE)


def is_matmul(name: str) -> bool:
    """True for a matrix-multiply kernel or operator name."""
    return bool(_MATMUL.search(name)) and not _FUSED_ATTENTION.search(name)


def profiler_activities(device: torch.device | str) -> list[torch.profiler.ProfilerActivity]:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.device(device).type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return activities


@dataclass(frozen=True)
class Work:
    name: str
    start_us: float  # CPU interval of the launching operator (the operator itself on CPU)
    end_us: float
    duration_us: float  # on the device (GPU kernel) or the operator's self CPU time


def _cpu_operators(events: Iterable) -> list:
    return [e for e in events
            if e.device_type == DeviceType.CPU and not e.is_user_annotation and not e.is_async]


def device_work(events: Iterable, device_type: str) -> list[Work]:
    """The work of a profile: GPU kernels by launching operator (cuda), or operators' self time (cpu)."""
    events = list(events)
    operators = _cpu_operators(events)
    if device_type == "cuda":
        # Kineto mirrors each range onto the GPU timeline as a span named like it; should one be linked
        # to an operator, it is still not a kernel.
        range_names = {e.name for e in events if e.is_user_annotation}
        work = [Work(k.name, e.time_range.start, e.time_range.end, k.duration)
                for e in operators for k in e.kernels if k.name not in range_names]
        if not work:
            raise RuntimeError("the profile holds no CUDA kernels: was it recorded with "
                               "ProfilerActivity.CUDA, and can the profiler reach CUPTI?")
        return work
    if device_type == "cpu":
        return [Work(e.name, e.time_range.start, e.time_range.end, e.self_cpu_time_total)
                for e in operators if e.self_cpu_time_total > 0]
    raise ValueError(f"kernel tables support cuda and cpu profiles, not {device_type!r}")


def range_intervals(events: Iterable, names: Sequence[str] | None = None) -> dict[str, list[tuple[float, float]]]:
    """CPU intervals (start_us, end_us) of each record_function range, sorted; all ranges by default."""
    found: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for e in events:
        if e.is_user_annotation and e.device_type == DeviceType.CPU and (names is None or e.name in names):
            found[e.name].append((e.time_range.start, e.time_range.end))
    return {name: sorted(spans) for name, spans in found.items()}


@dataclass(frozen=True)
class KernelStat:
    name: str
    calls: int
    total_us: float
    share: float  # of the range's total work time
    matmul: bool


@dataclass(frozen=True)
class RangeTable:
    range: str
    instances: int  # how many times the range was entered
    wall_us: float  # summed length of its CPU intervals
    work_us: float  # summed work inside it: GPU kernel time, or operator CPU time
    kernels: tuple[KernelStat, ...]  # by total time, largest first

    @property
    def matmul_us(self) -> float:
        return sum(k.total_us for k in self.kernels if k.matmul)

    @property
    def matmul_share(self) -> float:
        return self.matmul_us / self.work_us if self.work_us else 0.0

    @property
    def calls(self) -> int:
        return sum(k.calls for k in self.kernels)


def _table(name: str, instances: int, wall_us: float, totals: dict[str, list]) -> RangeTable:
    work_us = sum(total for _, total in totals.values())
    stats = [KernelStat(kernel, calls, total, total / work_us if work_us else 0.0, is_matmul(kernel))
             for kernel, (calls, total) in totals.items()]
    stats.sort(key=lambda k: (-k.total_us, k.name))
    return RangeTable(name, instances, wall_us, work_us, tuple(stats))


def kernel_tables(events: Iterable, device_type: str, ranges: Sequence[str] | None = None) -> dict[str, RangeTable]:
    """One RangeTable per range found in the profile (`ranges` limits which)."""
    events = list(events)
    work = device_work(events, device_type)
    tables = {}
    for name, spans in range_intervals(events, ranges).items():
        starts = [start for start, _ in spans]
        totals: dict[str, list] = defaultdict(lambda: [0, 0.0])
        for w in work:
            # Instances of one range do not overlap, so only the last one starting before w can hold it.
            i = bisect.bisect_right(starts, w.start_us) - 1
            if i >= 0 and w.end_us <= spans[i][1]:
                totals[w.name][0] += 1
                totals[w.name][1] += w.duration_us
        tables[name] = _table(name, len(spans), sum(end - start for start, end in spans), totals)
    return tables


def merge_tables(name: str, tables: Sequence[RangeTable]) -> RangeTable:
    """The tables of disjoint ranges as one (e.g. forward and backward as "forward+backward")."""
    totals: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for table in tables:
        for k in table.kernels:
            totals[k.name][0] += k.calls
            totals[k.name][1] += k.total_us
    instances = max((t.instances for t in tables), default=0)
    return _table(name, instances, sum(t.wall_us for t in tables), totals)


def short_name(name: str, limit: int = 90) -> str:
    """A kernel name fit for a table: no "void", no argument list, and, when still too long, no
    namespaces inside, then cut with an ellipsis. CUDA kernel names are whole C++ signatures."""
    name = name.removeprefix("void ").replace("(anonymous namespace)::", "")
    depth = 0
    for i, char in enumerate(name):
        depth += (char == "<") - (char == ">")
        if char == "(" and depth == 0 and i > 0:
            name = name[:i]
            break
    if len(name) > limit:
        name = re.sub(r"\b\w+::", "", name)
    return name if len(name) <= limit else name[: limit - 1] + "…"
