"""Speed-up regression gating against a checked-in baseline per GPU.

A perf test measures two times in one run and declares their ratio (A's time over B's, so a
ratio above 1 means B is faster). Each gate states its promise: the least ratio its test guarantees
(1.0 for "B is faster than A"; `within(0.05)` for "B takes at most 5% longer than A").
`perf/baselines/<gpu>.json` holds the ratio measured when the baseline was last accepted. A gate
fails below its floor, the higher of two bounds: the promise, and the baseline less its tolerance.
Recording a baseline only raises it, unless a lower ratio is accepted as a regression.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# Ratios of two timings from the same run on the same GPU move by a few percent between runs
# (clocks, allocator state, autotuner picks); a 20% drop is outside that noise and worth a look.
DEFAULT_TOLERANCE = 0.20


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
        """Whether the ratio holds its floor; a gate with no baseline does not pass."""
        return self.baseline is not None and self.measured >= self.floor

    def message(self, path: Path) -> str:
        """The verdict, the ratio, and each bound it fell below or holds."""
        bounds = [(f"the promise {self.promise:.3g} its test states", self.broke_promise)]
        if self.baseline is not None:
            bounds.append((f"the baseline {self.baseline.ratio:.3g} less its {self.baseline.tolerance:.0%} tolerance, "
                           f"{self.baseline.floor:.3g}", self.regressed))
        verdict = ", ".join(v for v, fails in (("BROKEN PROMISE", self.broke_promise), ("REGRESSION", self.regressed),
                                               ("NO BASELINE", self.baseline is None)) if fails) or "ok"
        failed = [bound for bound, fails in bounds if fails]
        held = [bound for bound, fails in bounds if not fails]
        said = [f"{verb} {' and '.join(listed)}" for verb, listed in (("is below", failed), ("holds", held)) if listed]
        where = (f"{path} has no entry for it (--update-baselines records one)" if self.baseline is None
                 else str(path))
        return f"{verdict}: {self.name} ratio {self.measured:.3g} {'; '.join(said)}; {where}"


def no_baseline_file(path: Path) -> str:
    """Why a gate does not run on a device that has never recorded baselines."""
    return f"speed-up gate not run: no baseline file {path} for this device (--update-baselines writes one)"


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
