"""The runs behind a report, on disk: what measured its rows, in the sidecar `<problem>.meta.json` (the device, and
each run's date, command, software versions and code: `Metadata`), and the rows themselves, in the CSV
`<problem>.csv` in the long format of cs336_systems.rows, each row numbered by the run that measured it. A report's
renderer reads both (cs336_systems.reports); so do the GPU checks that vouch for the code a run measured
(cs336_systems.gpu_check).
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from cs336_systems.provenance import package_source_hash
from cs336_systems.rows import LONG_COLUMNS, Row, from_long, to_long

RUN_COLUMN = "run"
METADATA_SUFFIX = ".meta.json"


def run_of(row: Row) -> int:
    """The number of the run that measured a row in its report (rows not merged into one yet are all one run)."""
    return row.get(RUN_COLUMN) or 1


def same_run(*rows: Row) -> bool:
    """Whether the rows were measured in one run. Only such rows are set against each other: between runs the
    clocks, the temperature, the machine's other work and the source itself may differ."""
    return len({run_of(row) for row in rows}) == 1


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


@dataclass(frozen=True)
class RunRecord:
    """One run that contributed rows to a report."""
    date: str
    command: str
    software: dict[str, str]
    source_hash: str | None  # the package's source (provenance); None for runs from before reports recorded it
    # The code on the run's measured path (the report's perf modules and the package code they run:
    # provenance.measured_code); None where it cannot be known.
    measured_code: str | None = None
    # For a run from before runs recorded their measured code: how it was found (the commit whose code it was),
    # or why it cannot be known. None for a run that recorded its own.
    measured_code_from: str | None = None

    @property
    def software_text(self) -> str:
        """ "python 3.12.3, torch 2.11.0, ...": the versions as a header or the index quotes them."""
        return ", ".join(f"{name} {version}" for name, version in self.software.items())

    def on_earlier_code(self, current_code: str) -> bool:
        """Whether the run measured code other than `current_code`, the measured code of its report now, or code
        that cannot be known: its rows stay, as that code's numbers."""
        return self.measured_code != current_code


@dataclass(frozen=True)
class Metadata:
    """A report's sidecar: what measured its rows, written beside them as <problem>.meta.json."""
    problem: str
    device: str  # as device_description() words it
    on_gpu: bool
    runs: tuple[RunRecord, ...]

    def write(self, path: Path) -> None:
        record = {"problem": self.problem, "device": self.device, "on_gpu": self.on_gpu,
                  "runs": [vars(run) for run in self.runs]}
        replace_text(path, json.dumps(record, indent=2) + "\n")

    @classmethod
    def read(cls, path: Path) -> Metadata:
        record = json.loads(path.read_text())
        return cls(record["problem"], record["device"], record["on_gpu"],
                   tuple(RunRecord(**run) for run in record["runs"]))



def this_run(command: str, measured_code: str) -> RunRecord:
    """The run measuring now, with `command`, the code on its measured path hashing to `measured_code`."""
    return RunRecord(_now(), command, software_versions(), package_source_hash(), measured_code)


def metadata_path(report_dir: Path | str, problem: str) -> Path:
    return Path(report_dir) / f"{problem}{METADATA_SUFFIX}"


def merge_runs(earlier: list[Row], earlier_runs: Sequence[RunRecord], rows: list[Row],
               run: RunRecord) -> tuple[list[Row], tuple[RunRecord, ...]]:
    """Earlier rows then this run's, with run numbers renumbered over the runs that still have rows."""
    used = sorted({run_of(r) for r in earlier})
    renumber = {old: new for new, old in enumerate(used, 1)}
    runs = tuple(earlier_runs[old - 1] for old in used) + (run,)
    merged = [{**r, RUN_COLUMN: renumber[run_of(r)]} for r in earlier]
    merged += [{**r, RUN_COLUMN: len(runs)} for r in rows]
    return merged, runs



def on_cuda(device: torch.device | str | None) -> bool:
    return torch.device(device).type == "cuda" if device is not None else torch.cuda.is_available()


def device_description(device: torch.device | str | None = None) -> str:
    if on_cuda(device):
        device = torch.device(device) if device is not None else None
        count = torch.cuda.device_count()
        name = torch.cuda.get_device_name(device if device is not None and device.index is not None else 0)
        return f"{count} x {name}" if count > 1 else name
    return f"CPU ({platform.processor() or platform.machine()}, {_cpu_count()} cores)"


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def software_versions() -> dict[str, str]:
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        import triton

        versions["triton"] = triton.__version__
    except ImportError:
        versions["triton"] = "not installed"
    versions["cuda"] = torch.version.cuda or "none (CPU build)"
    if torch.cuda.is_available() and torch.distributed.is_nccl_available():
        versions["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return versions



def write_csv(path: Path, rows: Sequence[Row]) -> None:
    replace_text(path, _csv_text(rows))


def _csv_text(rows: Sequence[Row]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=LONG_COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(to_long(rows))
    return buffer.getvalue()


def staging_path(path: Path) -> Path:
    """A sibling to write first and rename over `path`, with `path`'s suffix (matplotlib reads it)."""
    return path.with_name(f".{path.stem}.partial{path.suffix}")


def replace_text(path: Path, text: str) -> None:
    """Write `path` whole or not at all: a reader never finds half a file."""
    partial = staging_path(path)
    partial.write_text(text)
    os.replace(partial, path)



def read_rows(csv_path: Path | str) -> list[Row]:
    """The rows of a report's CSV (see cs336_systems.rows), each with every column of them all, None
    where a row has none."""
    with open(csv_path, newline="") as f:
        return from_long(csv.DictReader(f))
