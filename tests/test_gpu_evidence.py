"""GPU evidence that CPU CI checks, from the committed records of `make gpu-check` (reports/<gpu>/gpu_check/, a
history per GPU kind): the current FlashAttention source has a clean record on a Hopper GPU that ran the test list
the repository had when it was made, so a kernel change lands once it passes there; every run of every committed
report measured code that a clean record of its GPU kind, held to the same test list, tested (a run from before runs
recorded their measured code: the rule it was measured under); each record's Markdown twin is what it renders to;
and the gated speed-ups in the committed flash rows hold their floors. Newer code never fails a row: its report
marks it as measured on earlier code (cs336_systems.reports)."""

import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from cs336_systems import baselines, gpu_check
from cs336_systems.attention.flash_triton import source_hash
from cs336_systems.benchmarks.flash import gate_name, gate_ratios
from cs336_systems.runs import metadata_path, read_rows
from cs336_systems.reports.index import result_directories
from cs336_systems.rows.flash import GATED_PROVIDERS, GATE_PROMISES

REPO = Path(__file__).resolve().parents[1]
REPORTS = REPO / "reports"
RECORDS = {kind: gpu_check.records(REPORTS / kind) for kind in result_directories(REPORTS)}
RECORD_FILES = sorted(path.relative_to(REPO).as_posix()
                      for path in REPORTS.glob(f"*/{gpu_check.RECORD_NAME}/*.json"))
MEASURED_REPORTS = sorted(csv.relative_to(REPORTS).with_suffix("").as_posix()
                          for kind in result_directories(REPORTS) for csv in (REPORTS / kind).glob("*.csv")
                          if metadata_path(csv.parent, csv.stem).is_file())


@pytest.fixture(scope="module")
def test_list():
    """The suite's test files, as a record names them, and the names git has committed each under. A shallow clone
    has not the history that says which files a record had to run: the tests that need it skip, saying so, rather
    than fail a checkout that CI may have cloned shallow or pass records on a guess."""
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(REPO)
        test_files = gpu_check.suite_test_files()
    try:
        return test_files, gpu_check.committed_names(test_files, REPO)
    except gpu_check.ShallowHistory as error:
        pytest.skip(str(error))


def test_the_current_flash_attention_source_has_a_clean_gpu_check_of_the_tests_it_then_had_on_a_hopper_gpu(
        test_list):
    found = gpu_check.kernel_problems(RECORDS, source_hash(), *test_list)
    assert not found, "the current FlashAttention source has no clean GPU check: " + "; ".join(found)


@pytest.mark.parametrize("path", RECORD_FILES)
def test_each_kept_record_is_filed_under_the_code_it_checked(path):
    record = gpu_check.load_record(REPO / path)
    assert gpu_check.record_path(REPORTS / Path(path).parts[1], record) == REPO / path


@pytest.mark.parametrize("path", RECORD_FILES)
def test_each_kept_record_s_markdown_twin_is_what_it_renders_to(path):
    record = gpu_check.load_record(REPO / path)
    assert (REPO / path).with_suffix(".md").read_text() == gpu_check.render(record, Path(path).parts[1]), (
        f"{path[:-5]}.md is not what its record renders to: write gpu_check.render of it there and commit it")


@pytest.mark.parametrize("report", MEASURED_REPORTS)
def test_every_run_of_a_committed_report_measured_code_that_a_clean_gpu_check_of_its_kind_tested(report, test_list):
    kind, name = report.split("/")
    found = gpu_check.unbacked_runs(REPORTS / kind, name, RECORDS[kind], *test_list)
    assert not found, (f"reports/{report}.md: " + "; ".join(found) + f": run `make gpu-check` on a {kind} on the code "
                       "that measured them and commit its record, or measure them again after one")


# The GPUs with committed flash_benchmarking rows: each holds the speed-up gates' cell, whose promises hold on every
# GPU, with a baseline file or without one.
GATED_GPUS = sorted(path.parent.name for path in REPORTS.glob("*/flash_benchmarking.csv") if path.parent.name != "cpu")


def test_some_gpu_has_committed_flash_rows_and_a_baseline_file():
    assert set(GATED_GPUS) & {path.stem for path in (REPO / "perf" / "baselines").glob("*.json")}, (
        "no reports/<gpu>/flash_benchmarking.csv beside a perf/baselines/<gpu>.json")


@pytest.mark.parametrize("gpu", GATED_GPUS)
def test_committed_flash_gates_hold(gpu):
    rows = read_rows(REPORTS / gpu / "flash_benchmarking.csv")
    gate_rows = [r for r in rows if r.get("table") == "gate"]
    assert {r["provider"] for r in gate_rows} >= {"flash_triton", *GATED_PROVIDERS}, "the gate rows are missing"
    path = REPO / "perf" / "baselines" / f"{gpu}.json"
    recorded, ratios = baselines.load_baselines(path), gate_ratios(rows)
    for provider in GATED_PROVIDERS:
        name = gate_name(provider)
        assert ratios[name] is not None, f"{name}: a gated variant has no time in the committed rows"
        result = baselines.check(name, ratios[name], recorded, GATE_PROMISES[provider])
        assert result.passed, result.message(path)


def test_the_migrated_h100_record_did_not_run_the_test_files_added_after_it():
    (record,) = [record for record in RECORDS["h100"] if record.get("migrated")]
    assert gpu_check.problems(record, "h100") == []  # a clean run of its own source's 41 test files
    found = gpu_check.problems(record, "h100", [*record["test_files"], "tests/test_leaderboard.py",
                                                "tests/test_linear_cross_entropy.py"])
    assert found == ["its suite's runs left out 2 of the suite's 43 test files: tests/test_leaderboard.py, "
                     "tests/test_linear_cross_entropy.py"]
    # Relabelled, one test passed in each shard, it is refused in any folder.
    relabelled = record | {"device": "NVIDIA A100-SXM4-80GB",
                           "runs": {name: [run | {"passed": 1, "skipped": 0}]
                                    for name, run in gpu_check.latest_attempts(record).items()}}
    assert any("not on the h100 whose folder keeps it" in problem for problem in gpu_check.problems(relabelled, "h100"))
    assert any("1 tests ran over 6 test files" in problem for problem in gpu_check.problems(relabelled, "a100"))


def test_the_oldest_torch_and_triton_a_record_may_name_are_the_package_s_own():
    requirements = [Requirement(line) for line in
                    tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]]
    assert {requirement.name: str(requirement.specifier) for requirement in requirements
            if requirement.name in gpu_check.MINIMUM_VERSIONS} == {
        name: f">={minimum}" for name, minimum in gpu_check.MINIMUM_VERSIONS.items()}
