"""Speed-up regression gating against a checked-in baseline per GPU.

A perf test measures two times in one run and declares their ratio (A's time over B's, so a
ratio above 1 means B is faster). Each gate states its promise: the least ratio its test guarantees
(1.0 for "B is faster than A"; `within(0.05)` for "B takes at most 5% longer than A").
`perf/baselines/<gpu>.json` holds the ratio measured when the baseline was last accepted. A gate
fails below its floor, the higher of two bounds: the promise, and the baseline less its tolerance. The
promise is judged on every GPU, with a baseline file or without one; a recorded baseline only adds its
floor (a file with no entry for a gate warns that it has none). Recording a baseline only raises it, unless a
lower ratio is accepted as a regression.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# Ratios of two timings from the same run on the same GPU move by a few percent between runs
# (clocks, allocator state, autotuner picks); a 20% drop is outside that noise and worth a look.
DEFAULT_TOLERANCE = 0.20


class MissingBaselineWarning(UserWarning):
    """A gate held its promise on a GPU whose baseline file has no entry for it: nothing guards its ratio against
    regressions until --update-baselines records one."""


@dataclass(frozen=True)
class Baseline:
    ratio: float
    tolerance: float = DEFAULT_TOLERANCE

    @property
    def floor(self) -> float:
        """The lowest ratio within tolerance of the recorded one."""
        return self.ratio * (1 - self.tolerance)


def within(share: float) -> float:
    """The promise that B takes at most `share` longer than A: A's time over B's is at least 1 / (1 + share)."""
    if not share >= 0:
        raise ValueError(f"a share of extra time must be at least 0, got {share}")
    return 1 / (1 + share)


def at_world_size(name: str, world_size: int) -> str:
    """The baseline entry of a distributed gate: ranks change the ratio, so each world size keeps its own."""
    return f"{name}/world_size={world_size}"


@dataclass(frozen=True)
class GateResult:
    name: str
    measured: float
    promise: float
    baseline: Baseline | None

    @property
    def broke_promise(self) -> bool:
        return self.measured < self.promise

    @property
    def regressed(self) -> bool:
        return self.baseline is not None and self.measured < self.baseline.floor

    @property
    def floor(self) -> float:
        return max(self.promise, self.baseline.floor) if self.baseline else self.promise

    @property
    def passed(self) -> bool:
        """Whether the ratio holds its floor: the promise, and the baseline's floor where one is recorded."""
        return self.measured >= self.floor

    def message(self, path: Path, baseline_file: bool = True) -> str:
        """The verdict, the ratio, and each bound it fell below or holds; without a `baseline_file` at `path`, the
        promise is the only bound, and the missing entry goes unsaid."""
        bounds = [(f"the promise {self.promise:.3g} its test states", self.broke_promise)]
        if self.baseline is not None:
            bounds.append((f"the baseline {self.baseline.ratio:.3g} less its {self.baseline.tolerance:.0%} tolerance, "
                           f"{self.baseline.floor:.3g}", self.regressed))
        no_entry = self.baseline is None and baseline_file
        verdict = ", ".join(v for v, fails in (("BROKEN PROMISE", self.broke_promise), ("REGRESSION", self.regressed),
                                               ("NO BASELINE", no_entry)) if fails) or "ok"
        failed = [bound for bound, fails in bounds if fails]
        held = [bound for bound, fails in bounds if not fails]
        said = [f"{verb} {' and '.join(listed)}" for verb, listed in (("is below", failed), ("holds", held)) if listed]
        if not baseline_file:
            where = f"no baseline file {path} adds a floor (--update-baselines writes one)"
        elif self.baseline is None:
            where = f"{path} has no entry for it (--update-baselines records one)"
        else:
            where = str(path)
        return f"{verdict}: {self.name} ratio {self.measured:.3g} {'; '.join(said)}; {where}"


def no_gpu(path: Path) -> str:
    """Why a gate does not run on a CPU run without a baseline file: there is no GPU whose speed-up it could judge."""
    return (f"speed-up gate not run: a CPU run, whose times say nothing of a GPU's speed-ups, and no baseline file "
            f"{path} (on a GPU the promise is judged without one)")


def speedup_ratio(slow_ms: float, fast_ms: float) -> float:
    """A's time over B's: how many times faster B is than A."""
    if not (slow_ms > 0 and fast_ms > 0):
        raise ValueError(f"timings must be positive, got {slow_ms} and {fast_ms}")
    return slow_ms / fast_ms


def load_baselines(path: Path) -> dict[str, Baseline]:
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    return {name: Baseline(**entry) for name, entry in data.get("ratios", {}).items()}


def check(name: str, measured: float, baselines: dict[str, Baseline], promise: float) -> GateResult:
    if not promise > 0:
        raise ValueError(f"{name}: a promise is a least ratio of two times, above 0; got {promise}")
    return GateResult(name, measured, promise, baselines.get(name))


def ratio_to_record(result: GateResult, accept_regression: bool) -> float:
    """What --update-baselines records for `result`: the measured ratio where there is no baseline yet,
    where it is at least the recorded one, or where --accept-regression accepts a lower one; otherwise
    the recorded ratio stays, so that lower measurements within tolerance cannot wear it down run by run."""
    if result.baseline is None or accept_regression or result.measured >= result.baseline.ratio:
        return result.measured
    return result.baseline.ratio


@dataclass(frozen=True)
class Verdict:
    """What a gate does: pass, giving `ratio` back (with a `warning` where its GPU's baseline file has no entry
    for it); fail or skip saying why; and with --update-baselines, stage `record` for the baseline file. `ratio` is
    None when a variant has no time."""

    ratio: float | None
    failure: str | None = None
    skip: str | None = None
    record: float | None = None
    warning: str | None = None


class SpeedupGates:
    """The gates of one run against the baseline file at `path`, read once when the run starts.

    A gate's floor is the higher of its test's promise and the baseline less its tolerance (the promise alone
    where the gate has no baseline). On a GPU the promise is judged with or without a baseline file: the gate fails
    below the floor, naming the bound that failed, and when either time is None (a variant that ran out of memory
    or errored gates nothing, so it cannot pass); one that holds its promise where the baseline file exists but has
    no entry for it passes with a warning saying so. A CPU run (`on_gpu` False) without a baseline
    file skips its gates, saying why: a CPU's times say nothing of a GPU's speed-ups. With `update`
    (--update-baselines) it records the ratio instead: a broken promise is never recorded, one past tolerance
    below the baseline only with `accept_regression`, and a lower one within tolerance leaves the recorded ratio
    as it was (and gates against it) unless `accept_regression`.
    """

    def __init__(self, path: Path, on_gpu: bool, update: bool = False, accept_regression: bool = False):
        self.path = path
        self.on_gpu = on_gpu
        self.update = update
        self.accept_regression = accept_regression
        self._recorded = load_baselines(path)

    def judge(self, name: str, slow_ms: float | None, fast_ms: float | None, promise: float,
              note: str = "") -> Verdict:
        """The verdict on `name`'s ratio slow_ms / fast_ms; `note` (the variants' statuses, say) is added
        to a failure's message."""
        noted = f" ({note})" if note else ""
        baseline_file = self.path.exists()
        if not (self.on_gpu or baseline_file or self.update):
            return Verdict(None if slow_ms is None or fast_ms is None else speedup_ratio(slow_ms, fast_ms),
                           skip=no_gpu(self.path))
        if slow_ms is None or fast_ms is None:
            unmeasured = [side for side, ms in (("slower", slow_ms), ("faster", fast_ms)) if ms is None]
            have = "variants have" if len(unmeasured) > 1 else "variant has"
            return Verdict(None, failure=f"{name}: the {' and '.join(unmeasured)} {have} no time, so the gate "
                                         f"cannot hold{noted}")
        ratio = speedup_ratio(slow_ms, fast_ms)
        result = check(name, ratio, self._recorded, promise)
        if self.update:
            if result.broke_promise:
                return Verdict(ratio, failure=f"refusing to record {result.message(self.path)}{noted}")
            if result.regressed and not self.accept_regression:
                return Verdict(ratio, failure=f"refusing to record {result.message(self.path)}; pass "
                                              "--accept-regression to record it")
            return Verdict(ratio, record=ratio_to_record(result, self.accept_regression))
        if not result.passed:
            return Verdict(ratio, failure=result.message(self.path, baseline_file) + noted)
        if baseline_file and result.baseline is None:
            return Verdict(ratio, warning=result.message(self.path))
        return Verdict(ratio)


def update_baselines(path: Path, measured: dict[str, float], device: str) -> None:
    """Record `measured` ratios in `path`, keeping other entries and their tolerances."""
    baselines = load_baselines(path)
    for name, ratio in measured.items():
        tolerance = baselines[name].tolerance if name in baselines else DEFAULT_TOLERANCE
        baselines[name] = Baseline(round(ratio, 4), tolerance)
    data = {
        "device": device,
        "ratios": {name: vars(b) for name, b in sorted(baselines.items())},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
