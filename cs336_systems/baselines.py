"""Speed-up regression gating against a checked-in baseline per GPU.

A perf test measures two times in one run and declares their ratio (A's time over B's, so a
ratio above 1 means B is faster). `perf/baselines/<gpu>.json` holds the ratio measured when the
baseline was last accepted; a new ratio below baseline x (1 - tolerance) is a regression.
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


@dataclass(frozen=True)
class GateResult:
    name: str
    measured: float
    baseline: Baseline | None

    @property
    def floor(self) -> float | None:
        return None if self.baseline is None else self.baseline.ratio * (1 - self.baseline.tolerance)

    @property
    def passed(self) -> bool:
        return self.baseline is None or self.measured >= self.floor

    def message(self, path: Path) -> str:
        if self.baseline is None:
            return f"no baseline for {self.name!r} in {path}; run with --update-baselines to record {self.measured:.3g}"
        verdict = "ok" if self.passed else "REGRESSION"
        return (
            f"{verdict}: {self.name} ratio {self.measured:.3g} vs baseline {self.baseline.ratio:.3g} "
            f"(fails below {self.floor:.3g}, tolerance {self.baseline.tolerance:.0%}; {path})"
        )


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


def check(name: str, measured: float, baselines: dict[str, Baseline]) -> GateResult:
    return GateResult(name, measured, baselines.get(name))


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
