"""The one way this package times device work: synchronise, read the host clock, synchronise.

A host clock around asynchronous CUDA work measures only the launch; synchronising the device on
both sides makes the interval cover the work itself (and the launch overhead, which is real cost).
Kernel-level micro-benchmarks use `triton.testing.do_bench` instead (CUDA events, median).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


def synchronize(device: torch.device | str) -> None:
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def timed(device: torch.device | str, samples_ms: list[float]) -> Iterator[None]:
    """Append the wall time of the enclosed device work, in milliseconds, to `samples_ms`."""
    synchronize(device)
    start = time.perf_counter()
    yield
    synchronize(device)
    samples_ms.append((time.perf_counter() - start) * 1e3)


@dataclass(frozen=True)
class Timings:
    samples_ms: tuple[float, ...]

    @property
    def mean_ms(self) -> float:
        return statistics.fmean(self.samples_ms)

    @property
    def std_ms(self) -> float:
        return statistics.stdev(self.samples_ms) if len(self.samples_ms) > 1 else 0.0

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples_ms)

    def summary(self) -> dict[str, float]:
        return {"mean_ms": self.mean_ms, "std_ms": self.std_ms, "median_ms": self.median_ms}


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
