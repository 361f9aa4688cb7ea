"""Timed cells in pytest-benchmark's store (cs336_systems.benchmark_store): the samples a benchmark measured
reach --benchmark-json and --benchmark-autosave unchanged, a later run is judged against a saved one by
--benchmark-compare-fail, and a run without pytest-benchmark, or with it disabled (pytest-xdist), still passes and
stores nothing."""

import json
import os
from pathlib import Path

import pytest

from cs336_systems.runs import read_rows
from cs336_systems.rows import SAMPLE_TIMES
from tests.inner_runs import runpytest

PLUGIN = ["-p", "cs336_systems.pytest_plugin", "-p", "no:cacheprovider", "--gpu", "none"]
REPO_ROOT = Path(__file__).resolve().parents[1]
SAMPLES_MS = [1.0, 2.0, 4.5]


def _cells(samples_ms: list[float]) -> str:
    """A test module whose cells are a timed one, of these samples, and one that ran out of memory, as a perf test
    hands them to its report and to the store."""
    return f"""
        import pytest
        from cs336_systems.rows import SAMPLE_TIMES

        ROWS = [{{"table": "sweep", "provider": "mine", "status": "ok", "median_ms": 2.0, "timer": "host clock",
                  SAMPLE_TIMES: {samples_ms!r}}},
                {{"table": "sweep", "provider": "naive", "status": "OOM"}}]

        def test_cells(benchmark_store, report):
            for row in ROWS:
                report("_store_problem").add(row)
            added = benchmark_store.add_rows("_store_problem", ROWS, ("table", "provider"), compared="provider")
            assert added == (1 if benchmark_store.enabled else 0)
    """


CELLS = _cells(SAMPLES_MS)


@pytest.fixture(autouse=True)
def importable_package(monkeypatch):
    """Subprocess runs import the plugin whether or not the package is installed; and no run is taken for a
    pytest-xdist worker's (under which pytest-benchmark turns itself off) when this file runs in one."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)


def _stored(path: Path) -> list[Path]:
    return [p for p in path.rglob("*") if p.is_file()] if path.exists() else []


def test_a_cells_samples_reach_the_benchmark_json_as_measured_and_the_report_keeps_its_statistics_alone(pytester):
    pytest.importorskip("pytest_benchmark")
    pytester.makepyfile(CELLS)
    result = runpytest(pytester, *PLUGIN, "--report-dir", "out", "--benchmark-json", "bench.json",
                       "--benchmark-autosave")
    result.assert_outcomes(passed=1)
    benchmarks = json.loads((pytester.path / "bench.json").read_text())["benchmarks"]
    assert [(b["name"], b["group"]) for b in benchmarks] == [
        ("_store_problem[table=sweep,provider=mine]", "_store_problem[table=sweep]")]
    entry = benchmarks[0]
    assert entry["stats"]["data"] == [ms / 1e3 for ms in SAMPLES_MS]  # seconds, each sample exactly
    assert entry["stats"]["rounds"] == len(SAMPLES_MS) and entry["stats"]["max"] == max(SAMPLES_MS) / 1e3
    assert entry["extra_info"]["median_ms"] == 2.0 and SAMPLE_TIMES not in entry["extra_info"]
    assert entry["options"]["timer"].startswith("cs336_systems samples")
    assert [p.suffix for p in _stored(pytester.path / ".benchmarks")] == [".json"]  # --benchmark-autosave's
    rows = read_rows(pytester.path / "out" / "cpu" / "_store_problem.csv")
    assert [r["provider"] for r in rows] == ["mine", "naive"] and all(SAMPLE_TIMES not in r for r in rows)


def test_a_run_whose_cells_are_slower_than_the_saved_run_past_the_threshold_fails_the_comparison(pytester):
    """The samples are the cells' own, not timed here: the first run saves them, a later run's are scaled."""
    pytest.importorskip("pytest_benchmark")
    pytester.makepyfile(CELLS)
    runpytest(pytester, *PLUGIN, "--report-dir", "out", "--benchmark-autosave").assert_outcomes(passed=1)
    compare = ("--report-dir", "out", "--benchmark-compare=0001", "--benchmark-compare-fail=median:5%")

    pytester.makepyfile(_cells([ms * 1.02 for ms in SAMPLES_MS]))  # a median 2% slower: within the threshold
    assert runpytest(pytester, *PLUGIN, *compare).ret == pytest.ExitCode.OK

    pytester.makepyfile(_cells([ms * 1.5 for ms in SAMPLES_MS]))
    # In a process of its own: pytest-benchmark fails the run by raising out of pytest's terminal summary, which it
    # leaves without its outcome line.
    result = pytester.runpytest_subprocess(*PLUGIN, *compare)
    assert result.ret != pytest.ExitCode.OK
    result.stderr.fnmatch_lines(["*Performance has regressed:*",
                                 "*_store_problem?table=sweep,provider=mine?*Field 'median' has failed "
                                 "PercentageRegressionCheck: 50.000000000 > 5.000000000*"])


def test_without_a_store_option_pytest_benchmark_writes_no_file(pytester):
    pytester.makepyfile(CELLS)
    runpytest(pytester, *PLUGIN, "--report-dir", "out").assert_outcomes(passed=1)
    assert _stored(pytester.path / ".benchmarks") == []


def test_without_pytest_benchmark_the_cells_are_still_reported(pytester):
    pytester.makepyfile(CELLS)
    runpytest(pytester, *PLUGIN, "-p", "no:benchmark", "--report-dir", "out").assert_outcomes(passed=1)
    assert len(read_rows(pytester.path / "out" / "cpu" / "_store_problem.csv")) == 2


def test_under_xdist_pytest_benchmark_is_off_and_the_run_says_why_nothing_was_stored(pytester):
    pytest.importorskip("pytest_benchmark")
    pytester.makepyfile(CELLS)
    result = pytester.runpytest_subprocess(*PLUGIN, "-n", "2", "--report-dir", "out", "--benchmark-json", "bench.json")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*pytest-benchmark is disabled in this run*no timed cell reached its store*"])
    stored = pytester.path / "bench.json"  # pytest-benchmark before 5.3 creates it, empty, as it parses the option
    assert not stored.exists() or stored.read_bytes() == b""
