"""Memory: the CUDA allocator's history and snapshots, the active-memory timeline, the largest
allocations and where they come from, and the bytes autograd saves for backward.

    with record_memory_history():                 # CUDA only
        train_step()
        snapshot = take_snapshot("step.pickle")   # also loadable in pytorch.org/memory_viz
    timeline = active_memory_timeline(snapshot)   # (time_us, active bytes) after every event
    largest_allocations(snapshot)                 # biggest blocks, by the package line that asked

A snapshot (torch.cuda.memory._snapshot()) holds "segments" (the allocator's state when it was
taken: each block with its size and state) and "device_traces" (one list per device of allocator
events: alloc, free_requested, free_completed, segment_alloc, ... each with addr, size, time_us and
the Python frames that caused it, innermost first). A block is active from its "alloc" to its
"free_completed": a free completes once every stream that used the block is done with it. When no
other stream uses a block, its free is requested and completed at once, and active memory equals
torch.cuda.memory_allocated.
"""

from __future__ import annotations

import pickle
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

# Allocator events kept in the ring buffer. One training step of the 2.7B model makes a few tens of
# thousands; a million leaves room for many steps at ~100 bytes each.
MAX_HISTORY_EVENTS = 1_000_000
# Frames from files under a directory of this name are ours (matched by name, not by absolute path,
# which differs between a checkout, a symlinked one and an installed copy).
PACKAGE = "cs336_systems"
ACTIVE_STATES = ("active_allocated", "active_pending_free")


@contextmanager
def record_memory_history(max_events: int = MAX_HISTORY_EVENTS) -> Iterator[None]:
    """Record every CUDA allocation (with its Python stack) and free inside the block.

    History left from earlier recordings is cleared first, so a snapshot taken inside holds this
    block's events only.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("memory history records the CUDA caching allocator, and torch sees no CUDA GPU")
    # Stacks of allocations only (frees are matched by address), Python frames only: C++ frames cost
    # seconds per thousand events to symbolise and say little here.
    torch.cuda.memory._record_memory_history(context="alloc", stacks="python", max_entries=max_events,
                                             clear_history=True)
    try:
        yield
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def take_snapshot(path: str | Path | None = None) -> dict:
    """The allocator's snapshot as a dict; with `path`, dumped there first (the pickle
    pytorch.org/memory_viz reads) and read back."""
    if path is None:
        return torch.cuda.memory._snapshot()
    torch.cuda.memory._dump_snapshot(str(path))
    return load_snapshot(path)


def load_snapshot(path: str | Path) -> dict:
    return pickle.loads(Path(path).read_bytes())


def _trace(snapshot: dict, device: int) -> list[dict]:
    traces = snapshot.get("device_traces")
    if traces is None or "segments" not in snapshot:
        raise ValueError("not a memory snapshot: expected 'segments' and 'device_traces' keys")
    if not 0 <= device < len(traces):
        raise ValueError(f"snapshot has traces for {len(traces)} device(s), asked for device {device}")
    return traces[device]


def active_bytes_at_snapshot(snapshot: dict, device: int = 0) -> int:
    return sum(block["size"] for segment in snapshot["segments"] if segment.get("device", 0) == device
               for block in segment["blocks"] if block["state"] in ACTIVE_STATES)


def active_memory_timeline(snapshot: dict, device: int = 0) -> list[tuple[float, int]]:
    """(time_us, active bytes) after each alloc / free_completed event of `device`.

    Blocks allocated before the recording started appear in no event; the starting level is
    recovered from the end state: active bytes in the snapshot's segments minus the net change of
    the trace.
    """
    trace = _trace(snapshot, device)
    changes = [(event["time_us"], event["size"] if event["action"] == "alloc" else -event["size"])
               for event in trace if event["action"] in ("alloc", "free_completed")]
    active = active_bytes_at_snapshot(snapshot, device) - sum(change for _, change in changes)
    timeline = []
    for time_us, change in changes:
        active += change
        timeline.append((time_us, active))
    return timeline


def downsample_peaks(timeline: Sequence[tuple[float, int]], max_points: int) -> list[tuple[float, int]]:
    """At most `max_points` points, each the highest of its run of events: peaks survive."""
    if max_points < 1:
        raise ValueError(f"max_points must be positive, got {max_points}")
    if len(timeline) <= max_points:
        return list(timeline)
    bucket = -(-len(timeline) // max_points)  # ceiling division
    return [max(timeline[i:i + bucket], key=lambda point: point[1]) for i in range(0, len(timeline), bucket)]


def source_frame(frames: Sequence[dict], package: str = PACKAGE) -> str:
    """The innermost frame in `package`, as "<package>/<file>:<line> (<function>)"."""
    marker = f"/{package}/"
    for frame in frames:
        filename = frame.get("filename", "")
        if marker in filename:
            return f"{package}/{filename.rsplit(marker, 1)[1]}:{frame['line']} ({frame['name']})"
    return f"outside {package}"


def _short_frame(frame: dict) -> str:
    path = frame.get("filename", "?")
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            path = path.split(marker, 1)[1]
    return f"{path}:{frame.get('line', '?')} ({frame.get('name', '?')})"


@dataclass(frozen=True)
class Allocation:
    size_bytes: int
    count: int  # allocations of this size from this source line
    source: str  # the innermost frame in our package
    innermost: str  # the innermost Python frame of all (often inside torch)


def largest_allocations(snapshot: dict, top: int = 10, device: int = 0,
                        package: str = PACKAGE) -> list[Allocation]:
    """The `top` largest allocation sizes of the trace with the package line that asked for them;
    allocations of the same size from the same line are counted together."""
    counts: Counter[tuple[int, str, str]] = Counter()
    for event in _trace(snapshot, device):
        if event["action"] == "alloc":
            frames = event.get("frames", [])
            innermost = _short_frame(frames[0]) if frames else "no Python frame"
            counts[(event["size"], source_frame(frames, package), innermost)] += 1
    ordered = sorted(counts.items(), key=lambda item: -item[0][0])[:top]
    return [Allocation(size, count, source, innermost) for (size, source, innermost), count in ordered]


def saved_tensor_bytes(fn: Callable[[], object], exclude: Sequence[torch.Tensor] = ()) -> int:
    """Bytes of the distinct storages autograd saves for backward while `fn` runs.

    Tensors sharing a storage (views, one input saved by several ops) count once; storages of
    `exclude` (parameters, the inputs) are not counted, since they exist whether or not autograd
    saves them. Under autocast, the bf16 weight copies are counted: they exist only because a
    Linear saved them.
    """
    excluded = {t.untyped_storage().data_ptr() for t in exclude}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in excluded:
            saved[storage.data_ptr()] = storage.nbytes()
        # A detached alias keeps the storage alive like the tensor would. The tensor itself would not
        # do: an op that saves its own output would then hold its output, whose grad_fn is the op, a
        # reference cycle through C++ that no collector frees (every measured graph leaked).
        return tensor.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = fn()
    total = sum(saved.values())
    # The result holds the graph and so every saved storage: none was freed, and its address reused
    # by another, before being counted.
    del result
    return total


def peak_memory_increase(fn: Callable[[], object], device: torch.device | str) -> tuple[int, int]:
    """(peak, end) bytes allocated on `device` while `fn` runs, above what was allocated before it.

    On CUDA from the caching allocator's counters. On CPU, which keeps no such counters, from the
    allocations and frees torch.profiler records with profile_memory=True.
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before, torch.cuda.memory_allocated(device) - before
    if device.type != "cpu":
        raise ValueError(f"peak memory is measured on cuda or cpu, not {device.type}")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    records = sorted((e for e in prof.profiler.kineto_results.events()
                      if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU),
                     key=lambda e: e.start_ns())
    allocated = peak = 0
    for record in records:
        allocated += record.nbytes()
        peak = max(peak, allocated)
    return peak, allocated
