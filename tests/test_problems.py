"""The table of problems: every report a perf module writes is found there, once, with the module
and marker that measure it."""

from pathlib import Path

import pytest

from cs336_systems.reports import problems
from cs336_systems.reports.problems import PROBLEMS, REPORTS

ROOT = Path(__file__).resolve().parents[1]


def test_every_report_is_named_once():
    names = [report.name for problem in PROBLEMS for report in problem.reports]
    assert len(names) == len(set(names)) == len(REPORTS)


@pytest.mark.parametrize("problem", [p for p in PROBLEMS if p.reports and not p.device_independent],
                         ids=lambda p: p.title)
def test_a_measured_problem_names_the_perf_modules_and_marker_that_write_its_reports(problem):
    assert problem.measured_by and problem.marker
    sources = {module: (ROOT / module).read_text() for module in problem.measured_by}
    assert any(f"pytest.mark.{problem.marker}" in source for source in sources.values()), (
        f"none of {problem.measured_by} is marked {problem.marker}")
    for name in problem.report_names:
        assert any(f'"{name}"' in source for source in sources.values()), (
            f"no module of {problem.measured_by} writes the {name} report")


def test_every_report_a_perf_module_writes_is_in_the_table():
    written = set()
    for module in (ROOT / "perf").glob("test_*.py"):
        written |= {name for name in REPORTS if f'"{name}"' in module.read_text()}
    measured = {name for problem in PROBLEMS if not problem.device_independent for name in problem.report_names}
    assert written == measured


def test_a_name_no_problem_has_gets_a_plain_table_and_a_known_one_its_own_renderer():
    assert problems.report("flash_benchmarking") is REPORTS["flash_benchmarking"]
    assert problems.report("my_experiment").render([{"k": 1}]).body.startswith("| k")


def test_the_problems_only_the_2025_handout_asks_are_marked_and_still_measured():
    only_2025 = {problem.title for problem in PROBLEMS if problem.only_in_handout == "2025"}
    assert only_2025 == {"communication_accounting", "ddp_overlap_bucketed"}
    bucketed = next(p for p in PROBLEMS if p.title == "ddp_overlap_bucketed")
    assert bucketed.label == "ddp_overlap_bucketed (2025 handout only)" and bucketed.marker == "ddp"
    assert next(p for p in PROBLEMS if p.title == "fsdp").label == "fsdp"
