"""Memory: the CUDA allocator's history and snapshots, the active-memory timeline, the largest
allocations and where they come from, the bytes autograd saves for backward, and what a rank holds of a
sharded tensor and of an optimizer's state.

    with record_memory_history():                 # CUDA only
        train_step()
        snapshot = take_snapshot()
    timeline = active_memory_timeline(snapshot)   # (time_us, active bytes) after every event
    largest_allocations(snapshot)                 # biggest blocks, by the package line that asked
    plot_active_memory(active_memory_layout(snapshot), title)   # memory_viz's Active Memory Timeline
    write_snapshot(compact_snapshot(snapshot), "step.pickle")     # small enough to keep in a repository

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


def take_snapshot() -> dict:
    """The allocator's snapshot as a dict (`write_snapshot` pickles it for pytorch.org/memory_viz)."""
    return torch.cuda.memory._snapshot()


def load_snapshot(path: str | Path) -> dict:
    return pickle.loads(Path(path).read_bytes())


def write_snapshot(snapshot: dict, path: str | Path) -> int:
    """Pickle `snapshot` to `path` (what pytorch.org/memory_viz opens); returns the file's bytes."""
    data = pickle.dumps(snapshot)
    Path(path).write_bytes(data)
    return len(data)


# Frames kept per event where none is in the package (an allocation inside torch's own code).
FRAMES_OUTSIDE_PACKAGE = 4


def _package_frames(frames: Sequence[dict], package: str) -> list[dict]:
    """The frames from the innermost to the outermost one in `package`: the library calls that
    allocated and the package code that called them, without the test runner or interpreter below;
    file names relative to the package's or the libraries' directory (`short_path`)."""
    marker = f"/{package}/"
    ours = [i for i, frame in enumerate(frames) if marker in frame.get("filename", "")]
    kept = frames[:ours[-1] + 1] if ours else frames[:FRAMES_OUTSIDE_PACKAGE]
    return [{**frame, "filename": short_path(frame.get("filename", "?"), package)} for frame in kept]


def short_path(path: str, package: str = PACKAGE) -> str:
    """A source file's name from the package's or the installed libraries' directory on (`cs336_systems/...`,
    `torch/...`), not the machine's own directories; other paths as they are."""
    for marker in (f"/{package}/", "site-packages/", "dist-packages/"):
        if marker in path:
            tail = path.split(marker, 1)[1]
            return f"{package}/{tail}" if marker == f"/{package}/" else tail
    return path


def compact_snapshot(snapshot: dict, device: int = 0, package: str = PACKAGE,
                     min_frames_bytes: int = 0) -> dict:
    """A copy of `snapshot` that memory_viz still draws, at a fraction of the size: `device`'s trace
    only (the others emptied), each event's stack cut below the package's outermost frame (pytest's or
    a script's frames repeat in every event), stacks kept only for allocations of at least
    `min_frames_bytes`, and no stacks on the segments' blocks (the timeline reads their sizes)."""
    _trace(snapshot, device)  # refuses what is not a snapshot with this device
    compact = {key: value for key, value in snapshot.items() if key not in ("segments", "device_traces")}
    compact["segments"] = [{**segment, "blocks": [{k: v for k, v in block.items() if k != "frames"}
                                                  for block in segment.get("blocks", [])]}
                           for segment in snapshot["segments"]]
    compact["device_traces"] = [
        [{**event, "frames": _package_frames(event.get("frames", []), package)
          if event["size"] >= min_frames_bytes else []} for event in trace] if index == device else []
        for index, trace in enumerate(snapshot["device_traces"])]
    return compact


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


# ---------------------------------------------------------------------- memory_viz's Active Memory Timeline

@dataclass(frozen=True)
class Area:
    """A region of the stacked plot: from steps[i] to the next step it spans bottoms[i] to tops[i]. Step 0
    is the state before the first event; step k, the state after the k-th."""
    kind: str  # "allocation", PREEXISTING or SMALLER
    steps: tuple[int, ...]
    bottoms: tuple[int, ...]
    tops: tuple[int, ...]


PREEXISTING = "allocated before recording"
SMALLER = "smaller allocations"


@dataclass(frozen=True)
class ActiveMemoryLayout:
    """The Active Memory Timeline as pytorch.org/memory_viz draws it: the x axis counts allocator
    events, and every live allocation is a band stacked on those allocated before it, sliding down when
    one below it is freed. Memory allocated before recording (parameters, optimizer state) lies at the
    bottom; the largest allocations (memory_viz's Detail setting) are bands of their own, and the rest
    are summed into one band on top."""
    events: int
    areas: tuple[Area, ...]
    peak_bytes: int


class _Series:
    def __init__(self, kind: str):
        self.kind, self.steps, self.bottoms, self.tops = kind, [], [], []

    def at(self, step: int, bottom: int, top: int) -> None:
        if self.steps and self.steps[-1] == step:
            self.bottoms[-1], self.tops[-1] = bottom, top
        elif not self.steps or (self.bottoms[-1], self.tops[-1]) != (bottom, top):
            self.steps.append(step)
            self.bottoms.append(bottom)
            self.tops.append(top)

    def area(self, end: int) -> Area:
        return Area(self.kind, (*self.steps, end), (*self.bottoms, self.bottoms[-1]), (*self.tops, self.tops[-1]))


def active_memory_layout(snapshot: dict, device: int = 0, max_allocations: int = 1000) -> ActiveMemoryLayout:
    """The stacked layout of `device`'s trace, its `max_allocations` largest allocations drawn one by
    one (the rest summed). At every event, the top of the stack is the active memory
    `active_memory_timeline` gives."""
    if max_allocations < 0:
        raise ValueError(f"max_allocations must be >= 0, got {max_allocations}")
    events = [e for e in _trace(snapshot, device) if e["action"] in ("alloc", "free_completed")]
    allocations = [i for i, e in enumerate(events) if e["action"] == "alloc"]
    shown = set(sorted(allocations, key=lambda i: (-events[i]["size"], i))[:max_allocations])
    level = active_bytes_at_snapshot(snapshot, device) - sum(
        e["size"] if e["action"] == "alloc" else -e["size"] for e in events)
    preexisting, smaller = _Series(PREEXISTING), _Series(SMALLER)
    stack: dict[int, int] = {}  # address -> size of the shown live allocations, in allocation order
    bands: dict[int, _Series] = {}  # address -> the band of the shown allocation live there
    small: dict[int, int] = {}  # address -> size of the other live allocations
    finished: list[Area] = []
    shown_bytes = small_bytes = 0
    peak = level

    def place(step: int) -> None:
        bottom = level
        for address, size in stack.items():
            bands[address].at(step, bottom, bottom + size)
            bottom += size
        preexisting.at(step, 0, level)
        smaller.at(step, bottom, bottom + small_bytes)

    place(0)
    for step, event in enumerate(events, 1):
        address, size = event["addr"], event["size"]
        if event["action"] == "alloc" and step - 1 in shown:
            stack[address], bands[address] = size, _Series("allocation")
            shown_bytes += size
        elif event["action"] == "alloc":
            small[address] = size
            small_bytes += size
        elif address in stack:
            shown_bytes -= stack.pop(address)
            finished.append(bands.pop(address).area(step))
        elif address in small:
            small_bytes -= small.pop(address)
        else:  # allocated before recording
            level -= size
        place(step)
        peak = max(peak, level + shown_bytes + small_bytes)
    end = len(events) + 1  # the state after the last event is drawn one step wide too
    areas = [preexisting.area(end), *finished, *(band.area(end) for band in bands.values()), smaller.area(end)]
    return ActiveMemoryLayout(len(events), tuple(areas), peak)


def plot_active_memory(layout: ActiveMemoryLayout, title: str):
    """A matplotlib Figure of the layout, in memory_viz's manner: a band per allocation, the summed
    smaller ones in grey, what was allocated before recording in a darker grey."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    figure = Figure(figsize=(10, 4))
    ax = figure.subplots()
    palette = colormaps["tab20"].colors
    shades = {PREEXISTING: "0.55", SMALLER: "0.8"}
    allocation = 0
    for area in layout.areas:
        if area.kind == "allocation":
            color, allocation = palette[allocation % len(palette)], allocation + 1
        else:
            color = shades[area.kind]
        ax.fill_between(area.steps, [b / 2**30 for b in area.bottoms], [t / 2**30 for t in area.tops], step="post",
                        color=color, linewidth=0)
    ax.legend(handles=[Patch(color=shades[kind], label=kind) for kind in (PREEXISTING, SMALLER)]
              + [Patch(color=palette[0], label="one allocation (a band each)")], loc="upper left", fontsize=8)
    ax.set_xlim(0, layout.events + 1)
    ax.set_ylim(0, layout.peak_bytes / 2**30 * 1.05 or 1)
    ax.set_xlabel("allocator events (allocations and frees)")
    ax.set_ylabel("active memory (GiB)")
    ax.set_title(title, fontsize=10)
    figure.tight_layout()
    return figure


def source_frame(frames: Sequence[dict], package: str = PACKAGE) -> str:
    """The innermost frame in `package`, as "<package>/<file>:<line> (<function>)"."""
    marker = f"/{package}/"
    for frame in frames:
        filename = frame.get("filename", "")
        if marker in filename:
            return f"{package}/{filename.rsplit(marker, 1)[1]}:{frame['line']} ({frame['name']})"
    return f"outside {package}"


def _short_frame(frame: dict) -> str:
    return f"{short_path(frame.get('filename', '?'))}:{frame.get('line', '?')} ({frame.get('name', '?')})"


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


def local_bytes(t: torch.Tensor) -> int:
    """Bytes this rank holds for `t` (a DTensor's local shard, not its global size)."""
    if hasattr(t, "to_local"):
        t = t.to_local()
    return t.numel() * t.element_size()


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The state tensors an optimizer holds on this rank, each once: in its own per-parameter states and in those
    of the optimizers it keeps as attributes (a wrapper's, as ZeroRedundancyOptimizer's `optim`)."""
    inner = [value for value in vars(optimizer).values()
             if isinstance(value, torch.optim.Optimizer) and value is not optimizer]
    tensors = {id(value): value for held in (optimizer, *inner) for state in held.state.values()
               for value in state.values() if torch.is_tensor(value)}
    return list(tensors.values())
