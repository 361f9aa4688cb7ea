"""How this package times device work: one way, used by every benchmark.

`StepTimer`: a step of several phases (forward, backward, optimizer) timed with one synchronisation,
at its end. A marker is recorded where the step and each phase start and end, a CUDA event on the
current stream (the host clock on CPU, where work is synchronous), so times come from the device's own
timeline and the queue is not drained inside a step, as it is not in training. Garbage collection is
off inside the step, so that a collection does not land in one sample. Asked to, on a GPU whose NVML
can be read, each step also records what the clock did during it (cs336_systems.clocks): a step
slowed by the power limit or by heat says so.

`timed` is a StepTimer step without phases; `time_fn` times a callable's calls with it, after warm-up.
`Timings` gives the statistics every row reports: mean +- std, and median and interquartile range,
which a few slow outliers do not move.

`issue_times` times the host alone: how long calls take to issue their device work, with the device
kept busy beforehand so that no call waits for it, the calls compared taking turns.

Kernel-level micro-benchmarks use `triton.testing.do_bench` instead (CUDA events, median).
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass

import torch

from cs336_systems.checks import check_positive_finite, is_non_negative_finite
from cs336_systems.clocks import ClockSample, GpuClocks
from cs336_systems.profiling.ranges import annotate


def synchronize(device: torch.device | str) -> None:
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# A step's phases: `phase(name)` is the context its work named `name` runs in (a profiler range, timed by timed_step).
Phase = Callable[[str], AbstractContextManager]

# The `timer` of rows that StepTimer measured; rows without one had every phase between synchronisations.
STEP_TIMER = "one synchronisation per step, phases from markers inside it"


class StepTimer:
    """Times one step and its phases with one synchronisation (see module docstring):

        timer = StepTimer(device, read_clocks=True)
        with timer.step():
            with timer.phase("forward"): ...
            with timer.phase("backward"): ...
        timer.step_ms, timer.phase_ms   # the whole step; each phase (summed if entered twice)
        timer.host_ms                   # how long the host took to issue the step
        timer.clock                     # NVML's account of the step (None where NVML cannot be read
                                        # or read_clocks is False)

    A step whose `host_ms` reaches its `step_ms` was issued no faster than the device ran it: the
    device waited for the host, and the step's time is the host's.
    """

    def __init__(self, device: torch.device | str, read_clocks: bool = False):
        self.device = torch.device(device)
        # Off by default: the reads cost host time around every step (no device time), which a caller
        # that keeps no clock account, or whose ranks must start a collective together, should not pay.
        self._clocks = GpuClocks.of(self.device) if read_clocks else None
        self._phases: list[tuple[str, object, object]] = []
        self.step_ms = float("nan")
        self.host_ms = float("nan")
        self.phase_ms: dict[str, float] = {}
        self.clock: ClockSample | None = None

    def _mark(self) -> object:
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _elapsed_ms(self, start: object, end: object) -> float:
        if self.device.type == "cuda":
            return start.elapsed_time(end)
        return (end - start) * 1e3

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = self._mark()
        yield
        self._phases.append((name, start, self._mark()))

    @contextmanager
    def step(self) -> Iterator[StepTimer]:
        self._phases = []
        collecting = gc.isenabled()
        gc.disable()
        try:
            # Read before the first marker and after the synchronisation: the reads take host time
            # (about a millisecond) but no device time, and the step's device work lies between them.
            clock_before = self._clocks.read() if self._clocks else None
            start = self._mark()
            host_start = time.perf_counter()
            yield self
            end = self._mark()
            self.host_ms = (time.perf_counter() - host_start) * 1e3
            synchronize(self.device)
            self.clock = self._clocks.sample(clock_before, self._clocks.read()) if self._clocks else None
        finally:
            if collecting:
                gc.enable()
        self.step_ms = self._elapsed_ms(start, end)
        self.phase_ms = {}
        for name, phase_start, phase_end in self._phases:
            self.phase_ms[name] = self.phase_ms.get(name, 0.0) + self._elapsed_ms(phase_start, phase_end)


@contextmanager
def timed_step(device: torch.device | str, samples: dict[str, list[float]] | None = None,
               timers: list[StepTimer] | None = None) -> Iterator[Phase]:
    """One step, its phases in named ranges and timed with one synchronisation at the step's end
    (cs336_systems.timing.StepTimer); given a dict of lists, each phase's time in ms is appended
    under its name and the whole step's under "step"; given a list, the step's finished timer is
    appended to it (its host time and NVML's account of its clock, read only then)."""
    timer = StepTimer(device, read_clocks=timers is not None)

    @contextmanager
    def phase(name: str) -> Iterator[None]:
        with annotate(name), timer.phase(name):
            yield

    with timer.step():
        yield phase
    if samples is not None:
        for name, ms in timer.phase_ms.items():
            samples.setdefault(name, []).append(ms)
        samples.setdefault("step", []).append(timer.step_ms)
    if timers is not None:
        timers.append(timer)



@contextmanager
def timed(device: torch.device | str, samples_ms: list[float]) -> Iterator[None]:
    """Append the time of the enclosed device work, in milliseconds, to `samples_ms` (a StepTimer step)."""
    timer = StepTimer(device)
    with timer.step():
        yield
    samples_ms.append(timer.step_ms)


@dataclass(frozen=True)
class Timings:
    samples_ms: tuple[float, ...]

    def __post_init__(self):
        if not self.samples_ms:
            raise ValueError("samples_ms is empty: a timing needs at least one sample")
        bad = [ms for ms in self.samples_ms if not is_non_negative_finite(ms)]
        if bad:
            raise ValueError(f"samples_ms must be finite numbers of milliseconds >= 0; got {bad[:3]}")

    @property
    def mean_ms(self) -> float:
        return statistics.fmean(self.samples_ms)

    @property
    def std_ms(self) -> float:
        return statistics.stdev(self.samples_ms) if len(self.samples_ms) > 1 else 0.0

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples_ms)

    @property
    def iqr_ms(self) -> float:
        """The spread of the middle half of the samples (quartiles by linear interpolation)."""
        if len(self.samples_ms) < 2:
            return 0.0
        first, _, third = statistics.quantiles(self.samples_ms, n=4, method="inclusive")
        return third - first

    def summary(self) -> dict[str, float]:
        return {"mean_ms": self.mean_ms, "std_ms": self.std_ms, "median_ms": self.median_ms, "iqr_ms": self.iqr_ms}


def tflops(flops: float, ms: float) -> float:
    """The rate, in TFLOP/s, of `flops` done in `ms` milliseconds."""
    check_positive_finite(ms=ms)
    return flops / (ms * 1e-3) / 1e12


def time_fn(fn: Callable[[], object], *, warmup: int, steps: int, device: torch.device | str) -> Timings:
    """Run `fn` `warmup` times untimed, then `steps` times, each timed on its own."""
    if warmup < 0 or steps < 1:
        raise ValueError(f"need warmup >= 0 and steps >= 1, got warmup={warmup}, steps={steps}")
    for _ in range(warmup):
        fn()
    samples: list[float] = []
    for _ in range(steps):
        with timed(device, samples):
            fn()
    return Timings(tuple(samples))


# The device's queue is filled with a spin kernel this long before each round of issues is timed, doubled
# for a round whose issue outlasted it (up to the most), so that the host never waits for the device
# while it issues: what is timed is the host's own work.
ISSUE_BUSY_MS = 5.0
ISSUE_MAX_BUSY_MS = 2000.0
# Cycles torch.cuda._sleep spins for the calibration: a few milliseconds on any GPU.
_CALIBRATION_CYCLES = 10_000_000


def _spin_cycles_per_ms(device: torch.device) -> float:
    """GPU clock cycles per millisecond of torch.cuda._sleep's spin on `device`, measured with events."""
    with torch.cuda.device(device):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(_CALIBRATION_CYCLES)
        end.record()
        end.synchronize()
        return _CALIBRATION_CYCLES / start.elapsed_time(end)


def issue_times(fns: Sequence[Callable[[], object]], *, warmup: int, samples: int, device: torch.device | str,
                contexts: Sequence[Callable[[], AbstractContextManager]] | None = None) -> list[Timings]:
    """How long the host takes to issue each of `fns`' device work, in ms per call: host time only, the
    device kept busy so that no call waits for it. The calls take turns: each round queues one spin
    kernel (ISSUE_BUSY_MS), then times one call of every fn with perf_counter, garbage collection off,
    in an order rotated from round to round, so that paths compared in one run meet the same host (whose
    speed drifts by hundreds of microseconds within minutes) and each takes the round's first, coldest
    turn as often. `contexts`, one per fn, are entered around each call outside its timed region (an
    SDPA backend pinned, say). A round counts only if its spin was still running when its last call
    returned, else it is taken again with a longer spin."""
    if warmup < 0 or samples < 1:
        raise ValueError(f"need warmup >= 0 and samples >= 1, got warmup={warmup}, samples={samples}")
    contexts = [nullcontext] * len(fns) if contexts is None else list(contexts)
    if not fns or len(contexts) != len(fns):
        raise ValueError(f"need at least one call and one context per call, got {len(fns)} calls and "
                         f"{len(contexts)} contexts")
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"issue time is measured against a busy GPU; {device} has no queue to keep busy")
    for fn, context in zip(fns, contexts):
        with context():
            for _ in range(warmup):
                fn()
    cycles_per_ms = _spin_cycles_per_ms(device)
    busy_ms = ISSUE_BUSY_MS
    issued_ms: list[list[float]] = [[] for _ in fns]
    collecting = gc.isenabled()
    gc.disable()
    try:
        while len(issued_ms[0]) < samples:
            first = len(issued_ms[0]) % len(fns)
            order = [*range(first, len(fns)), *range(first)]
            round_ms = {}
            with torch.cuda.device(device):
                torch.cuda._sleep(int(busy_ms * cycles_per_ms))
                spun = torch.cuda.Event()
                spun.record()
                for i in order:
                    with contexts[i]():
                        start = time.perf_counter()
                        fns[i]()
                        round_ms[i] = (time.perf_counter() - start) * 1e3
                still_busy = not spun.query()
            synchronize(device)
            if still_busy:
                for i, elapsed_ms in round_ms.items():
                    issued_ms[i].append(elapsed_ms)
            elif busy_ms < ISSUE_MAX_BUSY_MS:
                busy_ms *= 2
            else:
                raise RuntimeError(f"issuing one round of calls outlasted a {busy_ms:.0f} ms spin kernel: a call "
                                   "waits for the device (a synchronisation inside it), so its host time is not "
                                   "measurable")
    finally:
        if collecting:
            gc.enable()
    return [Timings(tuple(ms)) for ms in issued_ms]
