"""What a run measures, staged on disk until it ends, then written into reports in one go.

    staging_dir = new_staging_dir()
    ProblemReport("naive_ddp", staging_dir, worker="gw0", size_table="2026").add(row)   # in any process
    stage_ratio(staging_dir, "gw0", "flash vs naive", 5.0)                             # --update-baselines
    written, errors = publish(staging_dir, report_dir, report_root, on_gpu, command, baseline_path)

A run's processes (one, or pytest-xdist's workers) share one staging directory and each appends to files
of its own, named after the problem (or the baselines) and the worker: no two writers share a file, and
a crash keeps what was measured. Files that go with a report (plots) wait in the assets folder. Nothing
reaches the report directory or the baseline file before `publish`, at the run's end.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from cs336_systems import baselines
from cs336_systems.reports import device_description, shown_figures, write_report
from cs336_systems.reports.index import index_path, write_index
from cs336_systems.reports.problems import report as problem_report
from cs336_systems.rows import without_samples

ASSETS_DIR = "assets"
# The stage that holds speed-up ratios rather than a problem's rows.
BASELINES_STAGE = "baselines"


def new_staging_dir() -> Path:
    """A fresh directory of its own for one run's staged rows."""
    return Path(tempfile.mkdtemp(prefix="cs336-report-rows-"))


class ProblemReport:
    """Rows for one problem's report, staged on disk as they arrive so a crash keeps them.

    Files that go with the report (plots) are staged too: nothing reaches the report directory
    until the run ends and its reports are written.
    """

    def __init__(self, problem: str, staging_dir: Path, worker: str, size_table: str):
        self.problem = problem
        self._staging_dir = staging_dir
        self._file = staging_dir / f"{problem}.{worker}.jsonl"
        self._size_table = size_table

    def add(self, row: dict[str, Any] | None = None, **fields: Any) -> None:
        record = without_samples({**(row or {}), **fields})  # its samples go to pytest-benchmark's store
        if "size" in record:
            # A size name means different models in different tables: the row says which it measured, the
            # run's table where the row does not name one.
            record.setdefault("size_table", self._size_table)
        _append(self._file, record)

    def asset_path(self, file_name: str) -> Path:
        """Where a file that goes with this report (a PNG, a trace) should be written."""
        assets = self._staging_dir / ASSETS_DIR
        assets.mkdir(exist_ok=True)
        return assets / file_name


def stage_ratio(staging_dir: Path, worker: str, name: str, ratio: float) -> None:
    """Stage the speed-up ratio that --update-baselines records for the gate `name`."""
    _append(staging_dir / f"{BASELINES_STAGE}.{worker}.jsonl", {"name": name, "ratio": ratio})


def _append(path: Path, record: dict[str, Any]) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record, default=str) + "\n")


def publish(staging_dir: Path, report_dir: Path, report_root: Path, on_gpu: bool, command: str,
            baseline_path: Path) -> tuple[list[Path], list[str]]:
    """Write the staged rows into reports, the reports' index, and the staged ratios into the baseline
    file; remove the staging directory. Returns the files written and the errors, one line each.

    Never raises: a report that cannot be written is named among the errors, and the others are
    still written.
    """
    if not staging_dir.exists():
        return [], []
    device = "cuda" if on_gpu else "cpu"
    written, errors = [], []
    staged = sorted(staging_dir.glob("*.jsonl"))
    names = sorted({_stage_of(f) for f in staged} - {BASELINES_STAGE})
    for problem in names:
        try:
            rows = [json.loads(line) for f in staged if _stage_of(f) == problem for line in f.read_text().splitlines()]
            markdown = write_report(problem_report(problem), rows, report_dir, command, device)
            written += [markdown, *shown_figures(markdown)]
        except Exception as error:  # one report's failure must not lose the others
            errors.append(f"{problem}: {type(error).__name__}: {error}")
    for asset in sorted((staging_dir / ASSETS_DIR).glob("*")):
        report_dir.mkdir(parents=True, exist_ok=True)
        written.append(Path(shutil.move(asset, report_dir / asset.name)))
    written = list(dict.fromkeys(written))  # a staged plot that a kept report already showed is listed once
    if written:  # the index of this run's kind of device answers from its reports, this run's included
        try:
            written.append(write_index(report_root, cpu=not on_gpu))
        except Exception as error:
            errors.append(f"{index_path(report_root, cpu=not on_gpu)}: {type(error).__name__}: {error}")
    ratios = {r["name"]: r["ratio"] for f in staged if _stage_of(f) == BASELINES_STAGE
              for r in map(json.loads, f.read_text().splitlines())}
    if ratios:
        try:
            baselines.update_baselines(baseline_path, ratios, device_description(device))
            written.append(baseline_path)
        except Exception as error:
            errors.append(f"{baseline_path}: {type(error).__name__}: {error}")
    shutil.rmtree(staging_dir, ignore_errors=True)
    return written, errors


def _stage_of(path: Path) -> str:
    """The problem (or BASELINES_STAGE) a staged file holds rows of."""
    return path.name.split(".")[0]
