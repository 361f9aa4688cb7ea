"""torch.profiler traces as timelines: what ran where and when, so that overlap is visible.

    prof.export_chrome_trace(path)
    intervals = load_intervals(path, phase_names={"forward", "backward"})
    communication_summary(intervals)     # {"communication_ms": ..., "overlapped_ms": ..., ...}
    plot_timeline(intervals, "bucketed DDP").savefig("timeline.png")

A GPU trace gives rows per CUDA stream: its NCCL kernels are communication, its other kernels,
copies and memsets compute (a stream that runs only NCCL kernels is communication throughout). A
stream can hold both: a collective with async_op=False runs on the caller's current stream. A CPU
trace (gloo) has no kernels: gloo's work shows as "gloo:..." ranges on its own threads
(communication), and operators on the other threads are compute.

Ranges named in `phase_names` (record_function / annotate) form a phases row on top, placed where
the device ran them: on a GPU a range spans the device work launched while it was open on the host
(a kernel and its launch share a correlation id), from the first start to the last end. Launches
are matched by time, not thread, since backward launches from autograd's thread while a
"backward" range waits on the main thread. The profiler's own device-side ranges
(gpu_user_annotation) are not used: in the H200 traces they were missing for ranges nested in
others (FSDP's per-layer ranges inside forward and backward).
"""

from __future__ import annotations

import bisect
import json
from collections import defaultdict
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path

COMPUTE, COMMUNICATION, PHASE = "compute", "communication", "phase"
CPU_COMPUTE_ROW = "compute (CPU)"
_DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
# Host-side events of the CUDA calls that put work on a stream (runtime and driver API).
_LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
_COLORS = {COMPUTE: "tab:blue", COMMUNICATION: "tab:red", PHASE: "tab:gray"}
# Bars are drawn at least this share of the time axis wide: a row of microsecond kernels (a blocking
# collective's on a compute stream) next to a step of hundreds of milliseconds would otherwise draw
# nothing at all, and its row look empty.
MIN_BAR_WIDTH_SHARE = 0.002


@dataclass(frozen=True)
class Interval:
    kind: str  # COMPUTE, COMMUNICATION or PHASE
    row: str  # the timeline row it is drawn on
    name: str
    start_ms: float  # from the first event of the trace
    end_ms: float


def load_intervals(trace_path: str | Path, phase_names: Collection[str] = ()) -> list[Interval]:
    """Intervals from a Chrome trace written by torch.profiler's export_chrome_trace."""
    data = json.loads(Path(trace_path).read_text())
    events = data["traceEvents"] if isinstance(data, dict) else data
    return intervals_from_events(events, phase_names)


def intervals_from_events(events: Iterable[dict], phase_names: Collection[str] = ()) -> list[Interval]:
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    on_device = [e for e in spans if e.get("cat") in _DEVICE_WORK]
    found = _gpu_intervals(spans, on_device, phase_names) if on_device else _cpu_intervals(spans, phase_names)
    if not found:
        return []
    origin = min(start for _, _, _, start, _ in found)
    return sorted((Interval(kind, row, name, (start - origin) / 1e3, (end - origin) / 1e3)
                   for kind, row, name, start, end in found), key=lambda i: (i.row, i.start_ms))


def _span(event: dict) -> tuple[float, float]:
    start = float(event["ts"])  # microseconds
    return start, start + float(event["dur"])


def _is_nccl(event: dict) -> bool:
    return "nccl" in event["name"].lower()


def _gpu_intervals(spans, on_device, phase_names):
    def stream(e: dict):
        return e.get("args", {}).get("stream")

    kernels = [e for e in on_device if e.get("cat") == "kernel"]
    compute_streams = {stream(e) for e in kernels if not _is_nccl(e)}
    nccl_only_streams = {stream(e) for e in kernels if _is_nccl(e)} - compute_streams
    found = []
    for e in on_device:
        kind = COMMUNICATION if _is_nccl(e) or stream(e) in nccl_only_streams else COMPUTE
        label = "NCCL" if kind == COMMUNICATION else "compute"
        found.append((kind, f"{label} (stream {stream(e)})", e["name"], *_span(e)))
    return found + [(PHASE, "phases", *span) for span in _device_spans_of_ranges(spans, on_device, phase_names)]


def _device_spans_of_ranges(spans, on_device, names) -> list[tuple[str, float, float]]:
    """(name, start, end) on the device of each host range named in `names` that launched device work."""
    work_by_correlation: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for e in on_device:
        correlation = e.get("args", {}).get("correlation")
        if correlation is not None:
            work_by_correlation[correlation].append(_span(e))
    launches = sorted((float(e["ts"]), e["args"]["correlation"]) for e in spans
                      if e.get("cat") in _LAUNCH_CATEGORIES and e.get("args", {}).get("correlation") in work_by_correlation)
    launch_times = [t for t, _ in launches]
    found = []
    for e in spans:
        if e.get("cat") != "user_annotation" or e["name"] not in names:
            continue
        start, end = _span(e)
        launched = launches[bisect.bisect_left(launch_times, start):bisect.bisect_right(launch_times, end)]
        work = [span for _, correlation in launched for span in work_by_correlation[correlation]]
        if work:
            found.append((e["name"], min(begin for begin, _ in work), max(finish for _, finish in work)))
    return found


def _cpu_intervals(spans, phase_names):
    gloo = [e for e in spans if e.get("cat") == "user_annotation" and e["name"].startswith("gloo:")]
    gloo_threads = {e.get("tid") for e in gloo}
    found = [(COMMUNICATION, "gloo", e["name"], *_span(e)) for e in gloo]
    found += [(COMPUTE, CPU_COMPUTE_ROW, e["name"], *_span(e)) for e in spans
              if e.get("cat") == "cpu_op" and e.get("tid") not in gloo_threads]
    found += [(PHASE, "phases", e["name"], *_span(e)) for e in spans
              if e.get("cat") == "user_annotation" and e["name"] in phase_names]
    return found


def union(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def length(spans: Iterable[tuple[float, float]]) -> float:
    return sum(end - start for start, end in spans)


def _intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length where two unions of disjoint sorted spans overlap."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def communication_summary(intervals: Iterable[Interval]) -> dict[str, float]:
    """Busy time of communication and of compute, and how much of the communication overlapped
    compute (both running at once) or was exposed (communication with no compute beside it)."""
    intervals = list(intervals)
    communication = union((i.start_ms, i.end_ms) for i in intervals if i.kind == COMMUNICATION)
    compute = union((i.start_ms, i.end_ms) for i in intervals if i.kind == COMPUTE)
    overlapped = _intersection(communication, compute)
    return {"communication_ms": length(communication), "compute_ms": length(compute),
            "overlapped_ms": overlapped, "exposed_ms": length(communication) - overlapped}


def plot_timeline(intervals: Iterable[Interval], title: str):
    """A matplotlib Figure: phases on top, then compute rows, then communication rows."""
    from matplotlib.figure import Figure

    intervals = list(intervals)
    order = {PHASE: 0, COMPUTE: 1, COMMUNICATION: 2}
    rows = sorted({(order[i.kind], i.row) for i in intervals})
    figure = Figure(figsize=(14, 1.2 + 0.6 * len(rows)))
    axes = figure.subplots()
    min_width = MIN_BAR_WIDTH_SHARE * (max(i.end_ms for i in intervals) - min(i.start_ms for i in intervals))
    for y, (_, row) in enumerate(rows):
        in_row = [i for i in intervals if i.row == row]
        kind = in_row[0].kind
        # Kernels are drawn as merged busy spans: the same picture as thousands of bars, much faster.
        spans = [(i.start_ms, i.end_ms) for i in in_row]
        if kind != PHASE:
            spans = union((start, max(end, start + min_width)) for start, end in spans)
        axes.broken_barh([(start, end - start) for start, end in spans], (y - 0.35, 0.7),
                         facecolors=_COLORS[kind], edgecolor="white" if kind == PHASE else "none")
        if kind == PHASE:
            for i in in_row:
                axes.text((i.start_ms + i.end_ms) / 2, y, i.name, ha="center", va="center", fontsize=8, color="white")
    axes.set_yticks(range(len(rows)), [row for _, row in rows])
    axes.invert_yaxis()
    axes.set_xlabel("time (ms)")
    axes.set_title(title)
    axes.grid(axis="x", alpha=0.3)
    figure.tight_layout()
    return figure
