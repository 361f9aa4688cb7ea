"""The checker of GPU evidence (cs336_systems.gpu_check): what makes a `make gpu-check` record fail as
evidence, and how it reads pytest's and compute-sanitizer's output."""

import datetime as dt
import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace
from unittest.mock import ANY

import pytest

from cs336_systems import gpu_check


SUITE = ("tests/test_a.py", "tests/test_b.py")


def _run(**changes):
    return {"command": "python -m pytest", "passed": 10, "failed": 0, "errors": 0, "skipped": 1, "failures": [],
            "skip_reasons": {"needs 2 CUDA GPUs, 1 present": 1}, "seconds": 5,
            "test_files": {"tests/test_a.py": {"passed": 4, "failed": 0, "errors": 0, "skipped": 1},
                           "tests/test_b.py": {"passed": 6, "failed": 0, "errors": 0, "skipped": 0}}, **changes}


def _sanitizer_run(name, **changes):
    """A clean attempt of the sanitizer's run `name` ("memcheck", "racecheck:1/2") on its tool's selection."""
    return _run(**{"command": gpu_check.sanitizer_command(name), "sanitizer_errors": 0, **changes})


VERSIONS = {"python": "3.12.3", "torch": "2.11.0+cu130", "triton": "3.6.0", "cuda": "13.0", "driver": "580.159.04"}


def _record(kernel_source="abc", device="NVIDIA H100 80GB HBM3", **runs):
    """A record whose runs are each the one attempt given (a clean one where not given, none where None)."""
    clean = {"tests": _run()} | {tool: _sanitizer_run(tool) for tool in gpu_check.SANITIZER_TOOLS}
    return {"device": device, **VERSIONS, "source": "s1", "kernel_source": kernel_source, "test_files": list(SUITE),
            "measured_code": {"naive_ddp": "m1"},
            "runs": {name: [run] for name, run in (clean | runs).items() if run}}


def test_a_clean_record_has_no_problems():
    assert gpu_check.problems(_record(), "h100") == []
    assert gpu_check.problems(_record(device="2 x NVIDIA H100 80GB HBM3"), "h100") == []


@pytest.mark.parametrize(("record", "problem"), [
    (_record(tests=_run(failed=2, failures=["tests/x.py::test_a"])), "tests: 2 failed"),
    (_record(tests=_run(errors=1)), "tests: 0 failed, 1 errors"),
    (_record(tests=_run(passed=0)), "tests: no test passed"),
    (_record(tests=None), "no tests run in the record"),
    (_record(memcheck=_sanitizer_run("memcheck", sanitizer_errors=269)),
     "memcheck: compute-sanitizer reported 269 errors"),
    (_record(racecheck=_sanitizer_run("racecheck", sanitizer_errors=2)),
     "racecheck: compute-sanitizer reported 2 hazards"),
    (_record(racecheck=_sanitizer_run("racecheck", sanitizer_errors=None)),
     "racecheck: compute-sanitizer printed no summary"),
    (_record(racecheck=None), "no racecheck run in the record"),
], ids=["failed tests", "errors", "nothing passed", "no tests", "sanitizer errors", "racecheck hazards",
        "no sanitizer summary", "missing racecheck"])
def test_a_record_that_is_no_evidence_says_why(record, problem):
    assert any(problem in found for found in gpu_check.problems(record, "h100"))


@pytest.mark.parametrize(("device", "kind"), [("NVIDIA A100-SXM4-80GB", "h100"), ("NVIDIA H100 80GB HBM3", "h200"),
                                              ("NVIDIA H200", "h100"), ("", "h100")])
def test_a_record_of_one_gpu_kind_in_another_kinds_folder_is_refused(device, kind):
    found = gpu_check.problems(_record(device=device), kind)
    assert len(found) == 1 and f"not on the {kind} whose folder keeps it" in found[0]


@pytest.mark.parametrize(("name", "value"), [("driver", "unknown"), ("cuda", "none (CPU build)"), ("torch", ""),
                                             ("triton", "not installed")])
def test_a_record_that_does_not_name_its_versions_is_refused(name, value):
    assert gpu_check.problems(_record() | {name: value}, "h100") == [
        f"it does not name the {name} version of a CUDA run"]


def test_a_record_whose_runs_left_out_a_test_file_of_the_suite_is_incomplete():
    record = _record()
    assert gpu_check.problems(record, "h100", (*SUITE, "tests/test_c.py")) == [
        "its suite's runs left out 1 of the suite's 3 test files: tests/test_c.py"]
    # Without a list given, the record is held to its own source's: a file it names that no run ran.
    found = gpu_check.problems(record | {"test_files": [*SUITE, "tests/test_c.py"]}, "h100")
    assert found == ["its suite's runs left out 1 of the suite's 3 test files: tests/test_c.py"]
    assert any("does not name the suite's test files" in f
               for f in gpu_check.problems({k: v for k, v in record.items() if k != "test_files"}, "h100"))


def test_a_run_that_ran_fewer_tests_than_the_files_it_names_is_incomplete():
    # One test passed in a shard of two files, as a record edited to look clean would say it; a run from before
    # runs counted their files names its files only, and its total is what can be checked.
    one_test = _run(passed=1, skipped=0, test_files=dict.fromkeys(SUITE))
    assert gpu_check.problems(_record(tests=one_test) | {"migrated": "from an earlier format"}, "h100") == [
        "tests: 1 tests ran over 2 test files, so some file ran none"]
    forged = _run(test_files={"tests/test_a.py": _run()["test_files"]["tests/test_a.py"],
                              "tests/test_b.py": dict.fromkeys(gpu_check.OUTCOMES, 0)})
    assert gpu_check.problems(_record(tests=forged), "h100") == [
        "tests: no test of tests/test_b.py ran",
        "its suite's runs left out 1 of the suite's 2 test files: tests/test_b.py"]


def test_only_a_migrated_record_may_name_test_files_without_their_counts():
    uncounted = _record(tests=_run(test_files=dict.fromkeys(SUITE)))
    assert gpu_check.problems(uncounted, "h100") == [
        "tests: it names test files without their counts, as only a record migrated from before runs counted them "
        "may"]
    assert gpu_check.problems(uncounted | {"migrated": "from an earlier format"}, "h100") == []


def test_a_test_file_whose_every_test_skipped_in_the_suite_s_runs_fails_the_record():
    # Every test of the flash file skipped (as where the kernels could not launch), every other file passing one.
    skipped = {"passed": 0, "failed": 0, "errors": 0, "skipped": 40}
    one_passed = {"passed": 1, "failed": 0, "errors": 0, "skipped": 0}
    flash = ("tests/test_flash_triton.py", "tests/test_model.py")
    all_skipped = _run(passed=1, skipped=40, test_files={flash[0]: skipped, flash[1]: one_passed})
    assert gpu_check.problems(_record(tests=all_skipped), "h100", flash) == [
        "its suite's runs passed no test of tests/test_flash_triton.py: each test they ran of it skipped or failed"]
    # Across a split's runs, a file counts once any of them passed one of its tests.
    split = {"tests:1/2": all_skipped, "tests:2/2": _run(test_files={flash[0]: one_passed})}
    assert gpu_check.problems(_record(tests=None, **split), "h100", flash) == []


@pytest.mark.parametrize(("run", "command"), [
    ("memcheck", "compute-sanitizer --tool memcheck python -m pytest tests/test_flash_triton.py -k every_launch_path"),
    ("racecheck", f"compute-sanitizer --tool memcheck python -m pytest {' '.join(gpu_check.RACECHECK_TESTS)}"),
    ("racecheck:1/2", gpu_check.sanitizer_command("racecheck:1/3")),
    ("memcheck", f"python -m pytest {' '.join(gpu_check.MEMCHECK_TESTS)}"),
], ids=["fewer tests", "other tool", "other split", "no sanitizer"])
def test_a_sanitizer_run_of_any_selection_but_its_tool_s_is_refused(run, command):
    record = _record(**{gpu_check.part_of(run): None, run: _sanitizer_run(run, command=command)},
                     **({"racecheck:2/2": _sanitizer_run("racecheck:2/2")} if run == "racecheck:1/2" else {}))
    assert gpu_check.problems(record, "h100") == [
        f"{run}: it ran `{command}`, not {gpu_check.part_of(run)}'s selection: `{gpu_check.sanitizer_command(run)}`"]
    # The environment a run was given comes first in its command.
    given = _sanitizer_run(run, command="OMP_NUM_THREADS=8 TORCHINDUCTOR_COMPILE_THREADS=8 "
                                        + gpu_check.sanitizer_command(run))
    assert gpu_check.problems(record | {"runs": record["runs"] | {run: [given]}}, "h100") == []


@pytest.mark.parametrize(("name", "value", "problem"), [
    ("torch", "1.0.0", "it ran torch 1.0.0, older than the 2.5 this package needs"),
    ("triton", "3.1.0", "it ran triton 3.1.0, older than the 3.2 this package needs"),
    ("torch", "two", "its torch version 'two' is no version"),
])
def test_a_record_of_a_torch_or_triton_older_than_the_package_needs_is_refused(name, value, problem):
    assert gpu_check.problems(_record() | {name: value}, "h100") == [problem]


def test_a_vendor_s_build_of_the_oldest_release_counts_as_that_release():
    assert gpu_check.problems(_record() | {"torch": "2.5.0a0+e000cf0", "triton": "3.2.0"}, "h100") == []


def test_the_kernel_source_lands_with_a_clean_record_of_it_on_either_hopper_gpu_and_the_test_list_it_then_had():
    h200 = _record(device="NVIDIA H200")
    assert gpu_check.kernel_problems({"h200": [h200]}, "abc", SUITE) == []
    assert gpu_check.kernel_problems({"h100": [_record("old")], "h200": [h200]}, "abc", SUITE) == []
    assert gpu_check.kernel_problems({"h100": [_record("old")]}, "abc", SUITE) == [
        "no record of an h100 or h200 check of the FlashAttention source abc: run `make gpu-check` on one and "
        "commit its record"]
    stale_list = gpu_check.kernel_problems({"h200": [h200]}, "abc", (*SUITE, "tests/test_c.py"))
    assert stale_list == [f"{gpu_check.record_path(Path('reports/h200'), h200).as_posix()}: its suite's runs left out 1 of the suite's 3 test files: "
                          "tests/test_c.py"]
    a100 = _record(device="NVIDIA A100-SXM4-80GB")
    assert "no record of an h100 or h200 check" in gpu_check.kernel_problems({"a100": [a100]}, "abc", SUITE)[0]


def _history(day: int, *names: str) -> list[tuple[dt.datetime, str]]:
    """A test file's names, the first committed on November `day` and each later one a day after the one before."""
    return [(dt.datetime(2026, 11, day + i, tzinfo=dt.timezone.utc), name) for i, name in enumerate(names)]


def test_a_test_file_added_after_a_record_was_made_does_not_fail_it_but_one_it_left_out_does():
    h200 = _record(device="NVIDIA H200") | {"date": "2026-11-27 10:00 UTC"}
    suite = (*SUITE, "tests/test_c.py")

    def committed(day: int) -> dict[str, list[tuple[dt.datetime, str]]]:
        return {file: _history(day, file) for file in suite}

    assert gpu_check.kernel_problems({"h200": [h200]}, "abc", suite, committed(28)) == []  # newer code
    assert gpu_check.kernel_problems({"h200": [h200]}, "abc", suite, {}) == []  # never committed: newer still
    left_out = gpu_check.kernel_problems({"h200": [h200]}, "abc", suite, committed(26))
    assert left_out == [f"{gpu_check.record_path(Path('reports/h200'), h200).as_posix()}: its suite's runs left out "
                        "1 of the suite's 3 test files: tests/test_c.py"]


def test_a_record_is_held_to_a_renamed_test_file_by_the_name_it_had_when_the_record_was_made():
    h200 = _record(device="NVIDIA H200") | {"date": "2026-11-20 10:00 UTC"}  # it ran tests/test_b.py
    renamed = {"tests/test_a.py": _history(1, "tests/test_a.py"),
               "tests/test_c.py": _history(20, "tests/test_b.py", "tests/test_c.py")}  # test_b.py till the 21st
    assert gpu_check.files_when_made(h200, tuple(renamed), renamed) == list(SUITE)
    assert gpu_check.kernel_problems({"h200": [h200]}, "abc", tuple(renamed), renamed) == []
    # Made after the rename, it should have run the file by its new name.
    later = h200 | {"date": "2026-11-22 10:00 UTC", "test_files": ["tests/test_a.py", "tests/test_c.py"]}
    assert gpu_check.problems(later, "h200", gpu_check.files_when_made(later, tuple(renamed), renamed)) == [
        "its suite's runs left out 1 of the suite's 2 test files: tests/test_c.py"]


def _git_repository(path: Path):
    """An empty git repository at `path`, and a function that commits its tree on a given day of November 2026."""
    def git(*args, day=1):
        date = f"2026-11-{day:02}T10:00:00+01:00"
        subprocess.run(["git", *args], cwd=path, check=True, capture_output=True,
                       env={**os.environ, "GIT_COMMITTER_DATE": date, "GIT_AUTHOR_DATE": date})

    def commit(day):
        git("add", "-A", day=day)
        git("commit", "-q", "-m", f"day {day}", day=day)

    path.mkdir(exist_ok=True)
    git("init", "-q")
    git("config", "user.email", "a@b.c")
    git("config", "user.name", "a")
    return commit


def test_committed_names_follows_a_test_file_through_its_renames(tmp_path):
    assert gpu_check.committed_names(["tests/test_a.py"], tmp_path) is None  # no git history to ask
    commit = _git_repository(tmp_path)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_old.py").write_text("def test_x():\n    assert True\n")
    commit(20)
    (tmp_path / "tests" / "test_old.py").rename(tmp_path / "tests" / "test_new.py")
    commit(25)
    (tmp_path / "tests" / "test_old.py").write_text("def test_y():\n    assert 2 > 1\n")  # another file, the old name
    commit(27)
    (tmp_path / "tests" / "test_uncommitted.py").write_text("")
    at = {day: dt.datetime(2026, 11, day, 9, tzinfo=dt.timezone.utc) for day in (20, 25, 27)}
    files = ["tests/test_new.py", "tests/test_old.py", "tests/test_uncommitted.py"]
    assert gpu_check.committed_names(files, tmp_path) == {
        "tests/test_new.py": [(at[20], "tests/test_old.py"), (at[25], "tests/test_new.py")],
        "tests/test_old.py": [(at[27], "tests/test_old.py")]}


def test_a_shallow_clone_cannot_say_which_test_files_a_record_had_to_run(tmp_path):
    commit = _git_repository(tmp_path / "origin")
    (tmp_path / "origin" / "tests").mkdir()
    (tmp_path / "origin" / "tests" / "test_a.py").write_text("")
    commit(20)
    (tmp_path / "origin" / "tests" / "test_b.py").write_text("")
    commit(25)
    subprocess.run(["git", "clone", "-q", "--depth", "1", (tmp_path / "origin").as_uri(), str(tmp_path / "clone")],
                   check=True, capture_output=True)
    with pytest.raises(gpu_check.ShallowHistory, match=r"shallow clone.*`git fetch --unshallow`"):
        gpu_check.committed_names(["tests/test_a.py", "tests/test_b.py"], tmp_path / "clone")


# What compute-sanitizer prints around a pytest run: its banner, the tests' output, what it found, and a
# summary line as the process exits (trimmed to the lines that matter).
PYTEST_OUTPUT = """\
============================= test session starts ==============================
tests/test_flash_triton.py::test_every_launch_path_matches_the_reference[split-64-bf16] PASSED [ 50%]
tests/test_flash_triton.py::test_every_launch_path_matches_the_reference[split-128-bf16] PASSED [100%]
====================== 16 passed, 1114 deselected in 91.02s ======================
"""
CLEAN_MEMCHECK = f"========= COMPUTE-SANITIZER\n{PYTEST_OUTPUT}========= ERROR SUMMARY: 0 errors\n"
MEMCHECK_ERRORS = f"""\
========= COMPUTE-SANITIZER
{PYTEST_OUTPUT}========= Invalid __global__ read of size 2 bytes
=========     at _attn_fwd_inner+0x1a30 in kernels.py:212
=========     by thread (64,0,0) in block (3,0,0)
=========     Address 0x7f3a5c000800 is out of bounds
=========
========= ERROR SUMMARY: 269 errors
"""
CLEAN_RACECHECK = (f"========= COMPUTE-SANITIZER\n{PYTEST_OUTPUT}"
                   "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n")
RACECHECK_HAZARDS = f"""\
========= COMPUTE-SANITIZER
{PYTEST_OUTPUT}========= Error: Race reported between Write access at _attn_fwd_split+0x2f40 in kernels.py:301
=========     and Read access at _attn_fwd_split+0x3a10 in kernels.py:318 [128 hazards]
=========
========= Warning: Race reported between Read access at _attn_fwd_split+0x3a10 in kernels.py:318
=========     and Write access at _attn_fwd_split+0x2f40 in kernels.py:301 [2 hazards]
=========
========= RACECHECK SUMMARY: 2 hazards displayed (1 error, 1 warning)
"""
NO_CUDA_CALL = ("========= COMPUTE-SANITIZER\n" + PYTEST_OUTPUT
                + "========= Error: Target application terminated before first instrumented API call\n")


@pytest.mark.parametrize(("tool", "output", "count"), [
    ("memcheck", CLEAN_MEMCHECK, 0),
    ("memcheck", MEMCHECK_ERRORS, 269),
    ("memcheck", CLEAN_MEMCHECK.replace("0 errors", "1 error"), 1),
    ("memcheck", MEMCHECK_ERRORS + CLEAN_MEMCHECK, 269),  # one summary per process watched, summed
    ("racecheck", CLEAN_RACECHECK, 0),
    ("racecheck", RACECHECK_HAZARDS, 2),
    ("racecheck", CLEAN_RACECHECK.replace("0 hazards displayed (0 errors", "1 hazard displayed (1 error"), 1),
    ("memcheck", NO_CUDA_CALL, None),
    ("racecheck", NO_CUDA_CALL, None),
    ("racecheck", CLEAN_MEMCHECK, None),  # memcheck's summary is not racecheck's
    ("memcheck", RACECHECK_HAZARDS, None),
    ("racecheck", RACECHECK_HAZARDS.rsplit("=========", 1)[0], None),  # stopped before its summary
    ("memcheck", "Segmentation fault (core dumped)\n", None),
], ids=["clean memcheck", "memcheck errors", "one error", "two processes", "clean racecheck", "racecheck hazards",
        "one hazard", "no CUDA call (memcheck)", "no CUDA call (racecheck)", "another tool's summary",
        "racecheck's summary to memcheck", "cut short", "crash"])
def test_each_tools_summary_line_is_read_in_all_its_forms(tool, output, count):
    assert gpu_check.sanitizer_error_count(output, tool) == count


def test_each_memcheck_error_is_named_by_its_first_line_place_and_reason_most_frequent_first():
    second = ("========= Invalid __global__ write of size 4 bytes\n=========     at dq_kernel+0x90 in kernels.py:480\n"
              "=========     by thread (1,0,0) in block (0,0,0)\n=========     Address 0x7f00 is misaligned\n")
    output = MEMCHECK_ERRORS.replace("=========\n========= ERROR", f"=========\n{second}{second}========= ERROR")
    output += "========= Program hit cudaErrorLaunchFailure (error 719) on CUDA API call to cudaFree.\n"
    assert gpu_check.sanitizer_errors(output) == [
        "Invalid __global__ write of size 4 bytes at dq_kernel+0x90 in kernels.py:480: is misaligned (2 times)",
        "Invalid __global__ read of size 2 bytes at _attn_fwd_inner+0x1a30 in kernels.py:212: is out of bounds",
        "Program hit cudaErrorLaunchFailure (error 719) on CUDA API call to cudaFree."]
    assert gpu_check.sanitizer_errors(CLEAN_MEMCHECK) == []


def test_junit_counts_outcomes_failures_and_skip_reasons(tmp_path):
    junit = tmp_path / "tests.xml"
    junit.write_text("""<?xml version="1.0"?><testsuites><testsuite>
      <testcase classname="tests.test_a" name="test_ok"/>
      <testcase classname="tests.test_a" name="test_bad"><failure message="boom"/></testcase>
      <testcase classname="tests.test_a" name="test_broken"><error message="fixture"/></testcase>
      <testcase classname="tests.test_a" name="test_skip"><skipped message="needs 2 CUDA GPUs, 1 present"/></testcase>
    </testsuite></testsuites>""")
    summary = gpu_check.parse_junit(junit)
    assert {k: summary[k] for k in ("passed", "failed", "errors", "skipped")} == {
        "passed": 1, "failed": 1, "errors": 1, "skipped": 1}
    assert summary["failures"] == ["tests.test_a::test_bad", "tests.test_a::test_broken"]
    assert summary["skip_reasons"] == {"needs 2 CUDA GPUs, 1 present": 1}
    assert summary["test_files"] == {"tests/test_a.py": {"passed": 1, "failed": 1, "errors": 1, "skipped": 1}}


def test_a_junit_classname_names_its_test_file():
    assert gpu_check.junit_test_file("tests.test_flash_triton") == "tests/test_flash_triton.py"
    assert gpu_check.junit_test_file("tests.test_plugin.TestGates") == "tests/test_plugin.py"


def test_a_split_names_its_part_and_its_run_and_star_names_all_its_runs():
    assert gpu_check.split("tests:2/3") == ("tests", 2, 3)
    assert gpu_check.split("racecheck:4/4") == ("racecheck", 4, 4)
    assert [gpu_check.split(part) for part in ("tests:0/2", "tests:3/2", "unit:1/2", "tests", "memcheck")] == [None] * 5
    assert gpu_check.expand(["tests:*/3", "memcheck", "racecheck:*/2"]) == (
        "tests:1/3", "tests:2/3", "tests:3/3", "memcheck", "racecheck:1/2", "racecheck:2/2")
    assert gpu_check.part_of("racecheck:1/2") == "racecheck" and gpu_check.part_of("tests") == "tests"
    assert gpu_check.selection("memcheck:1/2") == (*gpu_check.MEMCHECK_TESTS, "-p", gpu_check.DEALER, "--deal", "1/2")
    assert gpu_check.selection("tests") == gpu_check.TESTS


DEALT = """
import pytest

@pytest.mark.parametrize("i", range(7))
def test_kept(i):
    pass

@pytest.mark.parametrize("i", range(5))
def test_left_out(i):
    pass
"""


@pytest.mark.parametrize("n", [1, 3, 4])
def test_the_runs_of_a_split_deal_every_selected_test_into_exactly_one_of_them(pytester, n):
    # Dealt after -k deselects, so that a sanitizer's subset of a file is dealt evenly and not as the whole file was.
    pytester.makepyfile(test_dealt=DEALT)
    ran = []
    for k in range(1, n + 1):
        result = pytester.runpytest("-p", gpu_check.DEALER, "--deal", f"{k}/{n}", "-k", "kept", "-v")
        ids = [line.split("::")[1].split(" ")[0] for line in result.outlines if " PASSED" in line]
        assert len(ids) in (7 // n, 7 // n + 1)
        ran += ids
    assert sorted(ran) == sorted(f"test_kept[{i}]" for i in range(7))
    together = pytester.runpytest("-p", gpu_check.DEALER, "--deal", "1,2/3", "-k", "kept")
    together.assert_outcomes(passed=5)


SHARED_SETUP = """
import pytest

@pytest.fixture(scope="module", params=[2, 3])
def launched(request):
    with open("setups.txt", "a") as setups:
        setups.write(f"{request.param}\\n")
    return request.param

@pytest.mark.parametrize("check", range(4))
def test_check(launched, check):
    pass

@pytest.mark.parametrize("i", range(6))
def test_alone(i):
    pass
"""


def test_the_tests_that_share_a_fixture_s_setup_go_to_one_run_which_sets_it_up_once(pytester):
    # Dealt one by one, each of the three runs would set up both values of the module's fixture.
    pytester.makepyfile(test_shared=SHARED_SETUP)
    dealt = []
    for k in range(1, 4):
        result = pytester.runpytest("-p", gpu_check.DEALER, "--deal", f"{k}/3", "-v")
        dealt.append({line.split("::")[1].split(" ")[0] for line in result.outlines if " PASSED" in line})
    assert sorted(test for run in dealt for test in run) == sorted(
        [f"test_check[{n}-{check}]" for n in (2, 3) for check in range(4)] + [f"test_alone[{i}]" for i in range(6)])
    for n in (2, 3):
        assert sum(bool({f"test_check[{n}-{check}]" for check in range(4)} & run) for run in dealt) == 1
    assert [len(run) for run in dealt] == [5, 5, 4]
    assert sorted((pytester.path / "setups.txt").read_text().split()) == ["2", "3"]


def test_a_deal_out_of_range_is_a_usage_error(pytester):
    pytester.makepyfile(test_dealt=DEALT)
    result = pytester.runpytest("-p", gpu_check.DEALER, "--deal", "4/3")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--deal: expected K/N with 1 <= K <= N*got '4/3'*"])


def test_one_warm_up_takes_the_tests_each_part_deals_and_a_sanitizer_subset_only_where_the_suite_is_not_whole():
    dealt = ("-p", gpu_check.DEALER, "--deal")
    assert gpu_check.warm_ups(gpu_check.PARTS) == [gpu_check.TESTS]
    assert gpu_check.warm_ups(gpu_check.expand(["tests:*/8", "memcheck:*/2", "racecheck"])) == [gpu_check.TESTS]
    assert gpu_check.warm_ups(("tests:1/8", "tests:3/8", "racecheck:2/4", "memcheck")) == [
        (*gpu_check.TESTS, *dealt, "1,3/8"), (*gpu_check.RACECHECK_TESTS, *dealt, "2/4"), gpu_check.MEMCHECK_TESTS]
    assert gpu_check.warm_ups(("racecheck",)) == [gpu_check.RACECHECK_TESTS]
    # Runs of two splits of one part (or a split beside the whole run): the whole part.
    assert gpu_check.warm_ups(("memcheck:1/2", "memcheck:1/3")) == [gpu_check.MEMCHECK_TESTS]


def test_the_whole_suite_run_takes_the_conformance_suite_and_leaves_out_the_tests_of_the_record_it_replaces():
    assert gpu_check.TESTS[:4] == ("tests/", "cs336_systems/conformance/", "--ignore",
                                   f"tests/{gpu_check.EVIDENCE_TESTS}")


def test_failures_of_the_evidence_tests_count_for_nothing_and_others_still_do():
    evidence_test = "tests.test_gpu_evidence::test_committed_gpu_check_record_is_a_clean_run_of_the_current_source[h100]"
    only_evidence = _record(tests=_run(failed=1, failures=[evidence_test]))
    assert gpu_check.problems(only_evidence, "h100") == []
    assert "1 failed tests checked the committed record" in gpu_check.render(_rendered(only_evidence), "h100")
    also_another = _record(tests=_run(failed=1, errors=1, failures=[evidence_test, "tests.test_a::test_b"]))
    assert gpu_check.problems(also_another, "h100") == ["tests: 1 failed, 1 errors (tests.test_a::test_b)"]


def test_a_run_outside_the_evidence_is_shown_but_counts_for_nothing():
    record = _record(**{"parallel tests": _run(errors=46, failures=["tests.test_ddp::test_ddp[2ranks-x]"] * 46)})
    assert gpu_check.problems(record, "h100") == []
    text = gpu_check.render(_rendered(record), "h100")
    assert "| parallel tests |" in text and "parallel tests is not part of the evidence" in text
    assert "As evidence of the code it tested: clean." in text


def test_a_rendered_record_says_what_makes_it_no_evidence():
    text = gpu_check.render(_rendered(_record(racecheck=None)), "h100")
    assert "As evidence of the code it tested: no racecheck run in the record." in text
    assert "- package source: s1" in text and "- FlashAttention GPU source: abc" in text


def _rendered(record):
    return record | {"date": "2026-11-26 19:06 UTC", "command": "python -m cs336_systems.gpu_check"}


def test_a_split_part_counts_only_when_every_run_of_one_split_is_there():
    first, second = ({file: counts} for file, counts in _run()["test_files"].items())
    whole = _record(tests=None, **{"tests:1/2": _run(test_files=first), "tests:2/2": _run(test_files=second)})
    assert gpu_check.problems(whole, "h100") == []
    half = _record(tests=None, **{"tests:1/2": _run(), "tests:1/3": _run(), "tests:2/3": _run()})
    assert any("no tests run" in found for found in gpu_check.problems(half, "h100"))
    failed = _record(tests=None, **{"tests:1/2": _run(), "tests:2/2": _run(failed=1, failures=["tests/x.py::t"])})
    assert any("tests:2/2: 1 failed" in found for found in gpu_check.problems(failed, "h100"))
    # A sanitizer too: each of its runs holds its own summary.
    racecheck = {f"racecheck:{k}/2": _sanitizer_run(f"racecheck:{k}/2") for k in (1, 2)}
    assert gpu_check.problems(_record(racecheck=None, **racecheck), "h100") == []
    assert gpu_check.problems(_record(racecheck=None, **{"racecheck:1/2": racecheck["racecheck:1/2"]}), "h100") == [
        "no racecheck run in the record"]
    hazards = racecheck | {"racecheck:2/2": _sanitizer_run("racecheck:2/2", sanitizer_errors=2)}
    assert gpu_check.problems(_record(racecheck=None, **hazards), "h100") == [
        "racecheck:2/2: compute-sanitizer reported 2 hazards"]
    unsummarised = {"memcheck:1/1": _sanitizer_run("memcheck:1/1", sanitizer_errors=None)}
    assert gpu_check.problems(_record(memcheck=None, **unsummarised), "h100") == [
        "memcheck:1/1: compute-sanitizer printed no summary (it did not finish, or saw no CUDA call)"]


def test_parts_are_checked_before_anything_runs():
    for parts in ("tests:3/2", "unit", "", "unit:*/2", "racecheck:0/2"):
        with pytest.raises(SystemExit):
            gpu_check.main(["--parts", parts])


@pytest.mark.parametrize("warm_up", [True, False])
def test_the_parts_start_at_once_where_the_warm_up_is_left_out(warm_up, monkeypatch):
    warmed = []
    monkeypatch.setattr(gpu_check, "_pytest", lambda arguments, junit, environment: warmed.append(arguments))
    monkeypatch.setattr(gpu_check, "_one_process_run", lambda part, scratch, environment: (part, _run()))
    record = gpu_check.run_checks(("tests:1/2",), {"runs": {}}, warm_up=warm_up)
    assert record["runs"] == {"tests:1/2": [{"date": ANY, **_run()}]}
    assert warmed == ([(*gpu_check.TESTS, "-p", gpu_check.DEALER, "--deal", "1/2", "-n", "auto")] if warm_up else [])


def test_a_run_made_again_adds_an_attempt_and_its_earlier_failure_stays_in_view(monkeypatch):
    flaky = _run(passed=9, failed=1, failures=["tests.test_a::test_flaky"])
    record = _rendered(_record(**{"tests": None, "tests:1/2": _run(), "tests:2/2": flaky}))
    assert gpu_check.problems(record, "h100") == ["tests:2/2: 1 failed, 0 errors (tests.test_a::test_flaky)"]
    monkeypatch.setattr(gpu_check, "_one_process_run", lambda part, scratch, environment: (part, _run()))
    gpu_check.run_checks(("tests:2/2",), record, warm_up=False)
    assert record["runs"]["tests:2/2"] == [flaky, {"date": ANY, **_run()}]
    assert gpu_check.problems(record, "h100") == []  # its latest attempt passed
    text = gpu_check.render(record, "h100")
    assert "As evidence of the code it tested: clean." in text
    assert ("Earlier attempts, each replaced as evidence by a later attempt of its run:\n\n- tests:2/2, undated: "
            "9 passed, 1 failed, 0 errors, 1 skipped; failed: 1 failed, 0 errors (tests.test_a::test_flaky)\n") in text


def test_runs_side_by_side_share_the_cores(monkeypatch):
    # Left at torch's defaults, each of a check's 14 runs on 16 cores took 16 threads and 16 compile processes.
    monkeypatch.setattr(gpu_check.os, "sched_getaffinity", lambda pid: set(range(16)))
    given = {}

    def one_process_run(part, scratch, environment):
        given[part] = environment
        return part, _run()

    monkeypatch.setattr(gpu_check, "_one_process_run", one_process_run)
    gpu_check.run_checks(("tests:1/3", "tests:2/3", "tests:3/3"), {"runs": {}}, warm_up=False)
    assert given == dict.fromkeys(("tests:1/3", "tests:2/3", "tests:3/3"),
                                  {"OMP_NUM_THREADS": "5", "TORCHINDUCTOR_COMPILE_THREADS": "5"})
    assert gpu_check.threads_each(40) == {"OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1"}


def test_a_run_is_launched_with_its_share_of_the_cores_and_its_command_names_it(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check.os, "sched_getaffinity", lambda pid: set(range(16)))
    launched = []
    monkeypatch.setattr(gpu_check.subprocess, "run",
                        lambda command, env, **kwargs: launched.append(env) or SimpleNamespace(returncode=0))
    _, run = gpu_check._one_process_run("racecheck:1/2", tmp_path, gpu_check.threads_each(2))
    assert launched[0]["OMP_NUM_THREADS"] == launched[0]["TORCHINDUCTOR_COMPILE_THREADS"] == "8"
    assert run["command"].startswith("OMP_NUM_THREADS=8 TORCHINDUCTOR_COMPILE_THREADS=8 compute-sanitizer --tool "
                                     "racecheck python -m pytest tests/test_flash_triton.py ")


def _report(kind_dir: Path, *runs, rows=({"x": 1},)):
    from cs336_systems.runs import Metadata, metadata_path, write_csv

    kind_dir.mkdir(parents=True, exist_ok=True)
    write_csv(kind_dir / "naive_ddp.csv", [{**row, "run": 1} for row in rows])
    Metadata("naive_ddp", "2 x NVIDIA H100 80GB HBM3", True, runs).write(metadata_path(kind_dir, "naive_ddp"))
    return kind_dir


def _measured_run(measured_code="m1", torch_version="2.11.0+cu130", date="2026-12-10 10:00 UTC", found=None):
    from cs336_systems.runs import RunRecord

    return RunRecord(date, "pytest perf/ -m ddp", {"torch": torch_version, "triton": "3.6.0"}, "s1", measured_code,
                     found)


def test_a_run_is_backed_by_a_clean_record_of_its_kind_that_tested_its_measured_code_on_its_versions(tmp_path):
    kind_dir = _report(tmp_path / "h100", _measured_run())
    assert gpu_check.unbacked_runs(kind_dir, "naive_ddp", [_record()], SUITE) == []
    newer = "run 1 (2026-12-10 10:00 UTC) measured code m1 with torch 2.11.0+cu130, triton 3.6.0, which no clean h100"
    assert gpu_check.unbacked_runs(kind_dir, "naive_ddp", [_record(device="NVIDIA H200")], SUITE) == [
        f"{newer} record tested"]
    assert gpu_check.unbacked_runs(kind_dir, "naive_ddp", [_record(tests=None)], SUITE) == [f"{newer} record tested"]
    assert gpu_check.unbacked_runs(kind_dir, "naive_ddp", [_record() | {"torch": "2.13.0+cu130"}], SUITE) == [
        f"{newer} record tested"]
    later_code = _report(tmp_path / "other" / "h100", _measured_run("m2"))
    assert gpu_check.unbacked_runs(later_code, "naive_ddp", [_record()], SUITE)[0].startswith(
        "run 1 (2026-12-10 10:00 UTC) measured code m2")


def test_a_record_backs_a_run_only_if_it_ran_the_suite_s_test_files_it_then_had_not_only_those_it_names(tmp_path):
    # A record that names one test file and ran it is clean by its own list, not by the suite's.
    first, _ = ({file: counts} for file, counts in _run()["test_files"].items())
    one_file = _record(tests=_run(test_files=first)) | {"test_files": ["tests/test_a.py"],
                                                        "date": "2026-11-27 10:00 UTC"}
    assert gpu_check.problems(one_file, "h100") == []
    kind_dir = _report(tmp_path / "h100", _measured_run())
    assert gpu_check.unbacked_runs(kind_dir, "naive_ddp", [one_file], SUITE) == [
        "run 1 (2026-12-10 10:00 UTC) measured code m1 with torch 2.11.0+cu130, triton 3.6.0, which no clean h100 "
        "record tested"]
    # A test file first committed after the record was made is newer code, which it could not run.
    committed = {"tests/test_a.py": _history(20, "tests/test_a.py"), "tests/test_b.py": _history(28, "tests/test_b.py")}
    assert gpu_check.unbacked_runs(kind_dir, "naive_ddp", [one_file], SUITE, committed) == []


def test_a_run_from_before_runs_recorded_their_code_needs_evidence_only_of_the_kernels_its_rows_measured(tmp_path):
    migrated = _measured_run(None, date="2026-11-26 18:25 UTC", found="not known: never committed")
    kernel_rows = ({"x": 1, "source_hash": "abc"},)
    assert gpu_check.unbacked_runs(_report(tmp_path / "a" / "h100", migrated), "naive_ddp", [], SUITE) == []
    kernels = _report(tmp_path / "b" / "h100", migrated, rows=kernel_rows)
    assert gpu_check.unbacked_runs(kernels, "naive_ddp", [_record("abc")], SUITE) == []
    assert gpu_check.unbacked_runs(kernels, "naive_ddp", [_record("old")], SUITE) == [
        "run 1 (2026-11-26 18:25 UTC) measured FlashAttention source abc, which no clean h100 record tested"]
    # Only runs that predate recording measured code may say how theirs was found.
    claimed = _report(tmp_path / "c" / "h100", _measured_run(found="from commit 0123"))
    assert gpu_check.unbacked_runs(claimed, "naive_ddp", [_record()], SUITE) == [
        "run 1 (2026-12-10 10:00 UTC) says how its measured code was found, as only runs from before "
        f"{gpu_check.MEASURED_CODE_RECORDED_SINCE} do: a run records its own"]


def test_each_source_checked_on_a_gpu_kind_gets_a_record_of_its_own_and_a_later_part_joins_its_sources(
        tmp_path, monkeypatch):
    import torch

    from cs336_systems import gpus, provenance, runs

    monkeypatch.chdir(Path(__file__).parent.parent)  # gpu_check runs from the repository's root
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpus, "resolve_gpu", lambda choice: ("h100", None))
    monkeypatch.setattr(runs, "device_description", lambda device: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(gpu_check, "_driver_version", lambda: "580.159.04")
    monkeypatch.setattr(gpu_check, "_one_process_run", lambda part, scratch, environment: (part, _run()))
    monkeypatch.setattr(provenance, "package_source_hash", lambda: "source-1")
    monkeypatch.setattr(gpu_check.shutil, "which", lambda tool: f"/usr/bin/{tool}")
    arguments = ["--report-dir", str(tmp_path), "--no-warm-up", "--parts"]
    gpu_check.main([*arguments, "tests"])
    gpu_check.main([*arguments, "memcheck,racecheck"])
    (first,) = (tmp_path / "h100" / gpu_check.RECORD_NAME).glob("*.json")
    assert first.name.startswith("source-1-")
    assert set(gpu_check.load_record(first)["runs"]) == {"tests", "memcheck", "racecheck"}
    assert first.with_suffix(".md").read_text().startswith("# gpu_check\n")
    first.write_text(json.dumps(gpu_check.load_record(first) | {"date": "2026-11-20 10:00 UTC"}))
    gpu_check.main([*arguments, "tests"])  # the same code checked again: an attempt joins its record, made then
    again = gpu_check.load_record(first)
    assert again["date"] == "2026-11-20 10:00 UTC"
    assert {name: len(attempts) for name, attempts in again["runs"].items()} == {"tests": 2, "memcheck": 1,
                                                                                 "racecheck": 1}
    monkeypatch.setattr(provenance, "package_source_hash", lambda: "source-2")
    gpu_check.main([*arguments, "tests"])
    assert [record["source"] for record in gpu_check.records(tmp_path / "h100")] == ["source-1", "source-2"]
    assert set(gpu_check.load_record(first)["runs"]) == {"tests", "memcheck", "racecheck"}  # kept as it was
    monkeypatch.setattr(gpu_check, "suite_test_files", lambda: ("tests/test_a.py",))  # same package, other tests
    gpu_check.main([*arguments, "tests"])
    assert len(gpu_check.records(tmp_path / "h100")) == 3
