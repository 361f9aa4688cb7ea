"""The checker of GPU evidence (cs336_systems.gpu_check): what makes a `make gpu-check` record fail as
evidence, and how it reads pytest's and compute-sanitizer's output."""

from pathlib import Path

import pytest

from cs336_systems import gpu_check


def _run(**changes):
    return {"command": "python -m pytest", "passed": 10, "failed": 0, "errors": 0, "skipped": 1, "failures": [],
            "skip_reasons": {"needs 2 CUDA GPUs, 1 present": 1}, "seconds": 5, **changes}


def _record(source_hash="abc", **runs):
    clean = {"tests": _run()}
    clean |= {tool: _run(sanitizer_errors=0) for tool in gpu_check.SANITIZER_TOOLS}
    return {"source_hash": source_hash, "runs": {name: run for name, run in (clean | runs).items() if run}}


def test_a_clean_record_of_the_current_source_has_no_problems():
    assert gpu_check.problems(_record(), "abc") == []


@pytest.mark.parametrize(("record", "problem"), [
    (_record(source_hash="old"), "tested GPU source old, not the current abc"),
    (_record(tests=_run(failed=2, failures=["tests/x.py::test_a"])), "tests: 2 failed"),
    (_record(tests=_run(errors=1)), "tests: 0 failed, 1 errors"),
    (_record(tests=_run(passed=0)), "tests: no test passed"),
    (_record(tests=None), "no tests run in the record"),
    (_record(memcheck=_run(sanitizer_errors=269)), "memcheck: compute-sanitizer reported 269 errors"),
    (_record(racecheck=_run(sanitizer_errors=2)), "racecheck: compute-sanitizer reported 2 hazards"),
    (_record(racecheck=_run(sanitizer_errors=None)), "racecheck: compute-sanitizer printed no summary"),
    (_record(racecheck=None), "no racecheck run in the record"),
], ids=["stale source", "failed tests", "errors", "nothing passed", "no tests", "sanitizer errors", "racecheck hazards", "no sanitizer summary", "missing racecheck"])
def test_a_record_that_is_no_evidence_says_why(record, problem):
    assert any(problem in found for found in gpu_check.problems(record, "abc"))


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


def test_shards_deal_every_test_file_but_the_evidence_tests_into_exactly_one_run():
    tests_dir = Path(__file__).parent
    every = sorted(str(path) for path in tests_dir.glob("test_*.py") if path.name != gpu_check.EVIDENCE_TESTS)
    assert len(every) == len(list(tests_dir.glob("test_*.py"))) - 1
    for n in (1, 2, 3):
        dealt = [file for k in range(1, n + 1) for file in gpu_check.shard_files(k, n, tests_dir)]
        assert sorted(dealt) == every
    assert gpu_check.shard("tests:2/3") == (2, 3)
    assert [gpu_check.shard(part) for part in ("tests:0/2", "tests:3/2", "tests", "memcheck")] == [None] * 4


def test_one_warm_up_takes_the_files_of_every_suite_part_and_a_sanitizer_subset_only_where_they_miss_it(
        monkeypatch):
    monkeypatch.chdir(Path(__file__).parent.parent)  # gpu_check runs from the repository root
    flash = gpu_check.MEMCHECK_TESTS[0]
    holder = next(f"tests:{k}/8" for k in range(1, 9) if flash in gpu_check.shard_files(k, 8))
    other = next(f"tests:{k}/8" for k in range(1, 9) if flash not in gpu_check.shard_files(k, 8))
    files = {part: gpu_check.shard_files(*gpu_check.shard(part)) for part in (holder, other)}

    assert gpu_check.warm_ups((holder, other, "memcheck", "racecheck")) == [
        tuple(sorted(files[holder] + files[other]))]
    assert gpu_check.warm_ups((other, "memcheck")) == [files[other], gpu_check.MEMCHECK_TESTS]
    assert gpu_check.warm_ups(("racecheck",)) == [gpu_check.RACECHECK_TESTS]
    assert gpu_check.warm_ups(gpu_check.PARTS) == [gpu_check.shard_files(1, 1)]


def test_the_whole_suite_run_leaves_out_the_tests_of_the_record_it_replaces():
    assert gpu_check.TESTS[:3] == ("tests/", "--ignore", f"tests/{gpu_check.EVIDENCE_TESTS}")


def test_failures_of_the_evidence_tests_count_for_nothing_and_others_still_do():
    evidence_test = "tests.test_gpu_evidence::test_committed_gpu_check_record_is_a_clean_run_of_the_current_source[h100]"
    only_evidence = _record(tests=_run(failed=1, failures=[evidence_test]))
    assert gpu_check.problems(only_evidence, "abc") == []
    assert "1 failed tests checked the committed record" in gpu_check.render(_rendered(only_evidence))
    also_another = _record(tests=_run(failed=1, errors=1, failures=[evidence_test, "tests.test_a::test_b"]))
    assert gpu_check.problems(also_another, "abc") == ["tests: 1 failed, 1 errors (tests.test_a::test_b)"]


def test_a_run_outside_the_evidence_is_shown_but_counts_for_nothing():
    record = _record(**{"parallel tests": _run(errors=46, failures=["tests.test_ddp::test_ddp[2ranks-x]"] * 46)})
    assert gpu_check.problems(record, "abc") == []
    text = gpu_check.render(_rendered(record))
    assert "| parallel tests |" in text and "parallel tests is not part of the evidence" in text
    assert "As evidence for its source: clean." in text


def test_a_rendered_record_says_what_makes_it_no_evidence():
    text = gpu_check.render(_rendered(_record(racecheck=None)))
    assert "As evidence for its source: no racecheck run in the record." in text


def _rendered(record):
    return record | {"device": "NVIDIA H100 80GB HBM3", "python": "3.12", "torch": "2.11", "triton": "3.6",
                     "cuda": "13.0", "driver": "580", "date": "2026-11-26 19:06 UTC",
                     "command": "python -m cs336_systems.gpu_check"}


def test_a_split_suite_counts_only_when_every_run_of_one_split_is_there():
    whole = _record(tests=None, **{"tests:1/2": _run(), "tests:2/2": _run()})
    assert gpu_check.problems(whole, "abc") == []
    half = _record(tests=None, **{"tests:1/2": _run(), "tests:1/3": _run(), "tests:2/3": _run()})
    assert any("no tests run" in found for found in gpu_check.problems(half, "abc"))
    failed = _record(tests=None, **{"tests:1/2": _run(), "tests:2/2": _run(failed=1, failures=["tests/x.py::t"])})
    assert any("tests:2/2: 1 failed" in found for found in gpu_check.problems(failed, "abc"))


def test_parts_are_checked_before_anything_runs():
    for parts in ("tests:3/2", "unit", ""):
        with pytest.raises(SystemExit):
            gpu_check.main(["--parts", parts])


@pytest.mark.parametrize("warm_up", [True, False])
def test_the_parts_start_at_once_where_the_warm_up_is_left_out(warm_up, monkeypatch):
    import torch

    from cs336_systems import reports

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(reports, "device_description", lambda device: "a GPU")
    monkeypatch.setattr(gpu_check, "_driver_version", lambda: "1")
    warmed = []
    monkeypatch.setattr(gpu_check, "_pytest", lambda arguments, junit, prefix=(): warmed.append(arguments))
    monkeypatch.setattr(gpu_check, "_one_process_run", lambda part, scratch: (part, _run()))
    record = gpu_check.run_checks(("tests:1/2",), warm_up=warm_up)
    assert record["runs"] == {"tests:1/2": _run()}
    assert warmed == ([(*gpu_check.shard_files(1, 2), "-n", "auto")] if warm_up else [])
