"""Timed cells in pytest-benchmark's store, beside the reports: each cell's samples, as this project measured
them (CUDA events, triton's do_bench, the host clock on a CPU), become one entry of pytest-benchmark's
session, so that --benchmark-json, --benchmark-autosave, `pytest-benchmark compare` and
--benchmark-compare-fail see them as they see any benchmark of theirs.

    store = BenchmarkStore.of(config)          # the plugin's `benchmark_store` fixture
    store.add_rows("flash_benchmarking", rows, cell_columns=FLASH_KEY, compared="provider")

A row gives its samples in rows.SAMPLE_TIMES (milliseconds); a row without samples, or of a cell that did not run,
adds nothing. Its entry is named "<problem>[column=value,...]" from `cell_columns` (pytest-benchmark matches runs
by that name), grouped with the rows that differ only in `compared`, and keeps the row's other columns in its
extra_info.

pytest-benchmark times a function with its own clock, which around asynchronous GPU work would time the host's
issue alone. The samples are handed over through its pedantic mode instead, with a clock that replays them: one
round per sample, the clock reading 0 when the round starts and the sample when it ends.

Inert where pytest-benchmark is not installed, or not enabled: with --benchmark-disable, and under pytest-xdist,
where it turns itself off (`disabled_note` says so when a store was asked for).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from types import SimpleNamespace
from typing import Any

from cs336_systems.rows import SAMPLE_TIMES, Row, ran, without_samples

# pytest-benchmark's options that ask for its store: where a run gives one while pytest-benchmark is disabled,
# nothing is stored, and the run is told why.
STORE_OPTIONS = ("benchmark_json", "benchmark_save", "benchmark_autosave", "benchmark_compare")


class ReplayClock:
    """A timer for pytest-benchmark's pedantic mode whose rounds last the given samples: `reset` (the round's
    setup) sets it to 0, `tick` (the round's call) moves it on by the next sample, so a round's end reading less
    its start reading is the sample, exactly."""

    __name__ = "cs336_systems samples (CUDA events on a GPU, the host clock on a CPU)"

    def __init__(self, samples_s: Sequence[float]):
        self._samples = iter(samples_s)
        self._now = 0.0

    def __call__(self) -> float:
        return self._now

    def reset(self) -> None:
        self._now = 0.0

    def tick(self) -> None:
        self._now += next(self._samples)


class BenchmarkStore:
    """Where a run's timed cells reach pytest-benchmark (see the module's docstring)."""

    def __init__(self, session: Any | None):
        self._session = session  # pytest-benchmark's BenchmarkSession; None where it is not installed

    @classmethod
    def of(cls, config) -> BenchmarkStore:
        """The store of a pytest run: pytest-benchmark's session, which its plugin keeps on the config (it has no
        public accessor), or none where the plugin is not loaded."""
        return cls(getattr(config, "_benchmarksession", None))

    @property
    def enabled(self) -> bool:
        return self._session is not None and not self._session.disabled and not self._session.skip

    def add(self, name: str, group: str, samples_ms: Sequence[float], extra_info: Row) -> bool:
        """One entry: `samples_ms` under `name` in `group`, with `extra_info`; False where nothing is stored."""
        if not self.enabled or not samples_ms:
            return False
        _pytest_benchmark_entry(self._session, name, group, [ms / 1e3 for ms in samples_ms], extra_info)
        return True

    def add_rows(self, problem: str, rows: Iterable[Row], cell_columns: Sequence[str], compared: str) -> int:
        """An entry for each row of a cell that ran and kept its samples; how many were added."""
        added = 0
        for row in rows:
            if not ran(row) or not row.get(SAMPLE_TIMES):
                continue
            group = f"{problem}[{cell_text(row, [c for c in cell_columns if c != compared])}]"
            name = f"{problem}[{cell_text(row, [*[c for c in cell_columns if c != compared], compared])}]"
            added += self.add(name, group, row[SAMPLE_TIMES], without_samples(row))
        return added

    def disabled_note(self, config) -> str | None:
        """Why a run that asked for pytest-benchmark's store stored no timed cell: pytest-benchmark was disabled."""
        if self._session is None or self.enabled:
            return None
        if not any(config.getoption(option, None) for option in STORE_OPTIONS):
            return None
        return ("pytest-benchmark is disabled in this run (--benchmark-disable or --benchmark-skip, or pytest-xdist, "
                "under which it turns itself off), so no timed cell reached its store; run without them")


def cell_text(row: Row, columns: Iterable[str]) -> str:
    """ "column=value,..." for the columns of `row` that hold a value."""
    return ",".join(f"{column}={row[column]}" for column in columns if row.get(column) is not None)


def _pytest_benchmark_entry(session, name: str, group: str, samples_s: list[float], extra_info: Row) -> None:
    """Add one entry to pytest-benchmark's session. Its public way in, the `benchmark` fixture, adds one entry per
    test, and a test here measures many cells: so the fixture's class is built here as the `benchmark` fixture
    builds it (pytest_benchmark.plugin.benchmark: the session's options, its list of benchmarks, its logger),
    the only use of pytest-benchmark's internals, and is then driven through its public pedantic mode with the
    replaying clock as its timer."""
    from pytest_benchmark.fixture import BenchmarkFixture
    from pytest_benchmark.utils import NameWrapper

    clock = ReplayClock(samples_s)
    node = SimpleNamespace(name=name, nodeid=name, _nodeid=name)  # pytest-benchmark before 5.3 reads _nodeid
    fixture = BenchmarkFixture(node, add_stats=session.benchmarks.append,
                               logger=session.logger, warner=warnings.warn, disabled=False,
                               **{**session.options, "timer": NameWrapper(clock), "cprofile": False}, group=group)
    fixture.extra_info.update(extra_info)
    fixture.pedantic(clock.tick, setup=clock.reset, rounds=len(samples_s))
