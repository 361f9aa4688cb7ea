"""Kernel tables per profiler range, from torch.profiler (no Nsight needed).

    with device_profile(device) as prof:
        with annotate("forward"):
            ...
    tables = kernel_tables(prof.events(), device.type, ranges=["forward", "backward"])
    tables["forward"].kernels[0]     # KernelStat(name, calls, total_us, share, matmul)

The work of a CUDA run is every kernel (and memcpy / memset) the GPU ran, each one device event of
the profile. A kernel and the host call that launched it (cudaLaunchKernel and kin) share a CUPTI
correlation id, and the launch happened at a known host time, on whatever thread launched it. A CPU
run launches nothing: there the work is each operator's own (self) CPU time, placed at its start.

Each piece of work is attributed once, to the innermost range (record_function / NVTX) open at its
launch: of the ranges open then, the one that started last. This is containment in time, not by
thread: backward operators launch from autograd's own thread while the "backward" range, on the
main thread, waits for loss.backward() to return. A range's table holds the work attributed to it or
to a range nested in it ("forward" includes "attention/softmax"), each kernel once; `self_work_us` is
the part attributed to the range itself, and the self parts of all ranges add up to at most the
profile's work. Kernels are not read from an operator's `FunctionEvent.kernels`: torch.profiler
appends a kernel there for every host event whose id equals the kernel's linked correlation id, and
a host call that belongs to no operator (a cudaStreamSynchronize, say) carries an id of its own
that can equal an operator's, so the same kernel can be listed twice.
"""

from __future__ import annotations

import bisect
import logging
import os
import re
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.autograd import DeviceType

from cs336_systems.profiling.timeline import length, union

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
# torch.profiler's activity types (the Chrome trace's categories): work on the device, the host calls
# that put it there, and operators.
DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCHES = ("cuda_runtime", "cuda_driver")
OPERATOR = "cpu_op"


def is_matmul(name: str) -> bool:
    """True for a matrix-multiply kernel or operator name."""
    return bool(_MATMUL.search(name)) and not is_fused_attention(name)


def is_fused_attention(name: str) -> bool:
    """True for a fused attention kernel (SDPA's flash or memory-efficient kernels, ours)."""
    return bool(_FUSED_ATTENTION.search(name))


# Kineto tears CUPTI down on a thread of its own, which flushes CUPTI's buffers and then waits for the exit
# callback of some CUDA runtime call to detach it. A profile on a loaded machine (the test suite on every core)
# ended with its one synchronisation before that thread was ready, and the process hung at exit (torch 2.11,
# H200): so device_profile calls the runtime until the thread has gone, polling this often, for at most this
# long (it took milliseconds).
CUPTI_TEARDOWN_POLL_S = 0.001
CUPTI_TEARDOWN_TIMEOUT_S = 60.0

log = logging.getLogger(__name__)


@contextmanager
def device_profile(device: torch.device | str) -> Iterator[torch.profiler.profile]:
    """torch.profiler over the host and, on CUDA, the device's kernels. On CUDA, CUPTI is torn down
    when the profile ends (TEARDOWN_CUPTI=1, unless the environment says otherwise): left attached, it
    slows every kernel launch after it in the process, which made host-bound training steps measured
    after a profile up to 1.36x slower (large, bf16, context 512, on an H100).

    Kineto detaches CUPTI from a thread it starts as the profile stops, in the exit callback of the first
    CUDA runtime call made once that thread is ready. A process whose last profile was followed by no such
    call hung at exit (torch 2.11, H100), and so did one whose single synchronisation came before the thread
    was ready (on a loaded H200): the profile ends, also when its body raised, only once the threads that
    stopping it started have finished, making a runtime call (a device synchronisation) each time it looks."""
    cuda = torch.device(device).type == "cuda"
    if cuda:
        os.environ.setdefault("TEARDOWN_CUPTI", "1")
    profiler = torch.profiler.profile(activities=profiler_activities(device))
    profiler.start()
    try:
        yield profiler
    finally:
        running = thread_ids()
        profiler.stop()
        if cuda:
            call_until_finished(thread_ids() - running, lambda: torch.cuda.synchronize(device))


def thread_ids() -> set[int]:
    """The ids of this process's threads (Linux's /proc/self/task); empty where the system does not list them."""
    try:
        return {int(name) for name in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def call_until_finished(started: set[int], call: Callable[[], object]) -> None:
    """`call` until none of the threads `started` is running, or CUPTI_TEARDOWN_TIMEOUT_S has passed (logged)."""
    deadline = time.monotonic() + CUPTI_TEARDOWN_TIMEOUT_S
    while True:
        call()
        running = started & thread_ids()
        if not running:
            return
        if time.monotonic() >= deadline:
            log.warning("%d thread(s) the profiler started still run %g s after it stopped; CUPTI may still be "
                        "attached", len(running), CUPTI_TEARDOWN_TIMEOUT_S)
            return
        time.sleep(CUPTI_TEARDOWN_POLL_S)


def profiler_activities(device: torch.device | str) -> list[torch.profiler.ProfilerActivity]:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.device(device).type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return activities


@dataclass(frozen=True)
class Work:
    name: str
    launch_us: float  # host time of the launch call (of the operator itself on CPU)
    duration_us: float  # on the device (GPU kernel) or the operator's self CPU time


def activity(event) -> str:
    """torch.profiler's activity type of `event` (a Chrome trace category). Builds that do not record
    it on FunctionEvent (torch 2.11 among them) list device events with device_type CUDA and launch
    calls under their CUDA API names, which tell the same."""
    recorded = getattr(event, "activity_type", None)
    if recorded:
        return recorded
    if event.device_type == DeviceType.CUDA:
        if event.is_user_annotation:
            return "gpu_user_annotation"
        return {"Memcpy": "gpu_memcpy", "Memset": "gpu_memset"}.get(event.name.split(" ")[0], "kernel")
    if event.is_user_annotation:
        return "user_annotation"
    if re.match(r"cuda[A-Z]|cu[A-Z]", event.name):
        return "cuda_runtime"
    return OPERATOR


def device_work(events: Iterable, device_type: str) -> list[Work]:
    """The work of a profile, each piece once: GPU kernels placed at their launch call (cuda), or
    operators' self time placed at their start (cpu)."""
    events = [(activity(e), e) for e in events]
    if device_type == "cuda":
        launches = {e.id: e for kind, e in events if kind in LAUNCHES}
        operators = {e.id: e for kind, e in events if kind == OPERATOR}
        work = []
        for kind, e in events:
            if kind not in DEVICE_WORK:
                continue
            # The launch call by CUPTI correlation id (a launch links to the same operator as its kernel);
            # failing that, the operator the kernel is linked to (where the build records links).
            linked = getattr(e, "linked_correlation_id", 0)
            launch = launches.get(e.id)
            if launch is None or getattr(launch, "linked_correlation_id", 0) != linked:
                launch = operators.get(linked) if linked else None
            if launch is not None:
                work.append(Work(e.name, launch.time_range.start, e.time_range.end - e.time_range.start))
        if not work:
            raise RuntimeError("the profile holds no CUDA kernels: was it recorded with "
                               "ProfilerActivity.CUDA, and can the profiler reach CUPTI?")
        return work
    if device_type == "cpu":
        return [Work(e.name, e.time_range.start, e.self_cpu_time_total) for kind, e in events
                if kind == OPERATOR and not e.is_async and e.self_cpu_time_total > 0]
    raise ValueError(f"kernel tables support cuda and cpu profiles, not {device_type!r}")


def device_timeline(events: Iterable) -> tuple[float, float]:
    """(span_us, busy_us) of a CUDA profile: from the start of its first kernel, copy or memset to the
    end of its last, and how much of that span some of them were running (the union of their
    intervals on the device's clock). The rest of the span the device sat idle, waiting for the host."""
    spans = [(e.time_range.start, e.time_range.end) for e in events
             if e.device_type == DeviceType.CUDA and activity(e) in DEVICE_WORK]
    if not spans:
        raise RuntimeError("the profile holds no CUDA kernels: was it recorded with ProfilerActivity.CUDA?")
    busy = union(spans)
    return busy[-1][1] - busy[0][0], length(busy)


def range_intervals(events: Iterable, names: Sequence[str] | None = None) -> dict[str, list[tuple[float, float]]]:
    """CPU intervals (start_us, end_us) of each record_function range, sorted; all ranges by default."""
    found: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for e in events:
        if e.is_user_annotation and e.device_type == DeviceType.CPU and (names is None or e.name in names):
            found[e.name].append((e.time_range.start, e.time_range.end))
    return {name: sorted(spans) for name, spans in found.items()}


_OPEN, _WORK, _CLOSE = 0, 1, 2  # at equal times a range opens before, and closes after, the work there


def attribute(work: Sequence[Work], ranges: dict[str, list[tuple[float, float]]]) -> list[tuple[str | None, set[str]]]:
    """For each piece of work, the innermost range open at its launch (None outside every range) and
    the names of every range open then: the innermost and those it is nested in."""
    spans = [(start, end, name) for name, intervals in ranges.items() for start, end in intervals]
    points = [(start, _OPEN, i) for i, (start, _, _) in enumerate(spans)]
    points += [(end, _CLOSE, i) for i, (_, end, _) in enumerate(spans)]
    points += [(w.launch_us, _WORK, i) for i, w in enumerate(work)]
    # Open ranges by (start, -end): the innermost, last started and of those the first to end, is last.
    open_ranges: list[tuple[float, float, int]] = []
    found: list[tuple[str | None, set[str]]] = [(None, set())] * len(work)
    for _, kind, i in sorted(points, key=lambda point: point[:2]):
        if kind == _OPEN:
            bisect.insort(open_ranges, (spans[i][0], -spans[i][1], i))
        elif kind == _CLOSE:
            open_ranges.remove((spans[i][0], -spans[i][1], i))
        elif open_ranges:
            found[i] = (spans[open_ranges[-1][2]][2], {spans[j][2] for _, _, j in open_ranges})
    return found


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
    work_us: float  # work inside it, nested ranges' included: GPU kernel time, or operator CPU time
    kernels: tuple[KernelStat, ...]  # by total time, largest first
    self_work_us: float = 0.0  # the part of work_us whose innermost range is this one

    @property
    def matmul_us(self) -> float:
        return sum(k.total_us for k in self.kernels if k.matmul)

    @property
    def matmul_share(self) -> float:
        return self.matmul_us / self.work_us if self.work_us else 0.0

    @property
    def calls(self) -> int:
        return sum(k.calls for k in self.kernels)


def _table(name: str, instances: int, wall_us: float, totals: dict[str, list], self_work_us: float) -> RangeTable:
    work_us = sum(total for _, total in totals.values())
    stats = [KernelStat(kernel, calls, total, total / work_us if work_us else 0.0, is_matmul(kernel))
             for kernel, (calls, total) in totals.items()]
    stats.sort(key=lambda k: (-k.total_us, k.name))
    return RangeTable(name, instances, wall_us, work_us, tuple(stats), self_work_us)


def kernel_tables(events: Iterable, device_type: str, ranges: Sequence[str] | None = None) -> dict[str, RangeTable]:
    """One RangeTable per range found in the profile (`ranges` limits which). Attribution looks at
    every range of the profile, so work in a range left out of `ranges` is not counted as self work
    of the range around it."""
    events = list(events)
    work = device_work(events, device_type)
    every_range = range_intervals(events)
    totals: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(lambda: [0, 0.0]))
    self_us: dict[str, float] = defaultdict(float)
    for w, (innermost, open_names) in zip(work, attribute(work, every_range)):
        if innermost is not None:
            self_us[innermost] += w.duration_us
        for name in open_names:
            totals[name][w.name][0] += 1
            totals[name][w.name][1] += w.duration_us
    return {name: _table(name, len(spans), sum(end - start for start, end in spans), totals[name], self_us[name])
            for name, spans in every_range.items() if ranges is None or name in ranges}


def merge_tables(name: str, tables: Sequence[RangeTable]) -> RangeTable:
    """The tables of disjoint ranges as one (e.g. forward and backward as "forward+backward")."""
    totals: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for table in tables:
        for k in table.kernels:
            totals[k.name][0] += k.calls
            totals[k.name][1] += k.total_us
    instances = max((t.instances for t in tables), default=0)
    return _table(name, instances, sum(t.wall_us for t in tables), totals, sum(t.self_work_us for t in tables))


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
