"""Staged report rows (cs336_systems.reports.staging), without pytest's plugin: each worker stages to
files of its own, and publishing merges them into one report, moves the assets, records the ratios and
leaves no staging behind."""

import json
import shutil

from cs336_systems.runs import read_rows
from cs336_systems.reports.staging import ProblemReport, new_staging_dir, publish, stage_ratio


def _publish(staging, tmp_path):
    return publish(staging, tmp_path / "reports" / "cpu", tmp_path / "reports", on_gpu=False, command="pytest perf",
                   baseline_path=tmp_path / "baselines" / "cpu.json")


def test_rows_of_every_worker_reach_one_report_and_the_staging_is_removed(tmp_path):
    staging = new_staging_dir()
    for worker in ("gw0", "gw1"):
        ProblemReport("_staged", staging, worker, size_table="2025").add({"i": int(worker[-1])}, size="xl")
    ProblemReport("_staged", staging, "gw1", size_table="2025").asset_path("plot.png").write_bytes(b"png")
    written, errors = _publish(staging, tmp_path)
    report_dir = tmp_path / "reports" / "cpu"
    assert errors == [] and not staging.exists()
    assert {report_dir / "_staged.md", report_dir / "plot.png", report_dir / "README.md"} <= set(written)
    rows = read_rows(report_dir / "_staged.csv")
    assert sorted((r["i"], r["size"], r["size_table"]) for r in rows) == [(0, "xl", "2025"), (1, "xl", "2025")]


def test_a_row_that_names_its_size_table_keeps_it(tmp_path):
    staging = new_staging_dir()
    ProblemReport("_staged", staging, "main", size_table="2026").add(size="xl", size_table="2025")
    (line,) = (staging / "_staged.main.jsonl").read_text().splitlines()
    assert json.loads(line)["size_table"] == "2025"
    shutil.rmtree(staging)


def test_staged_ratios_reach_the_baseline_file_and_a_report_that_fails_keeps_the_others(tmp_path):
    staging = new_staging_dir()
    stage_ratio(staging, "gw0", "flash vs naive", 5.0)
    ProblemReport("mixed_precision_accumulation", staging, "gw0", size_table="2026").add(x=1)  # not its rows
    ProblemReport("_staged", staging, "gw1", size_table="2026").add(x=2)
    written, errors = _publish(staging, tmp_path)
    assert [e.split(":")[0] for e in errors] == ["mixed_precision_accumulation"]
    assert tmp_path / "reports" / "cpu" / "_staged.md" in written
    recorded = json.loads((tmp_path / "baselines" / "cpu.json").read_text())["ratios"]
    assert recorded == {"flash vs naive": {"ratio": 5.0, "tolerance": 0.2}}


def test_publishing_twice_writes_nothing_the_second_time(tmp_path):
    staging = new_staging_dir()
    ProblemReport("_staged", staging, "main", size_table="2026").add(x=1)
    _publish(staging, tmp_path)
    assert _publish(staging, tmp_path) == ([], [])
