"""GPU evidence that CPU CI can check: on a CUDA machine, run the whole test suite in one process (an
illegal memory access poisons the process, so no other worker can hide it), compute-sanitizer memcheck on
the tests that reach every FlashAttention launch path, and racecheck on the split forward, whose programs
merge each other's results; then write a record of it, reports/<gpu>/gpu_check/<source>-<checked>.json (and
a Markdown twin): the device, versions, date, command, the suite's test files and what each run ran of them,
the package source tested, the FlashAttention GPU source within it, and the measured code of every report
(what a perf run of that report on the same source measures, cs336_systems.provenance). One record per GPU
kind and code checked (record_path): the folder is the history of the checks, and a record the history of its
runs: a run made again (a part's run that failed, say) adds an attempt after the earlier ones, which stay there and
in the Markdown twin; the latest attempt of each run is the one that counts.

    python -m cs336_systems.gpu_check                        # or: make gpu-check
    python -m cs336_systems.gpu_check --parts memcheck,racecheck
    python -m cs336_systems.gpu_check --parts tests:1/2,tests:2/2  # the one-process suite as two runs
    python -m cs336_systems.gpu_check --parts "tests:*/12,memcheck:*/2,racecheck:*/4"  # shorter runs, more of them
    python -m cs336_systems.gpu_check --no-warm-up  # Triton's cache is warm from an earlier run here

Most of a cold run is compiling kernels (a few hundred, seconds each): the parts' tests first run in
parallel, which fills Triton's on-disk cache, and then the one-process runs (the suite or its splits, and
each sanitizer or its splits) run side by side, each with its share of the cores' threads. A split deals a
part's tests, not its files, between its runs (this module is also the pytest plugin that deals them,
`-p cs336_systems.gpu_check --deal K/N`), so that the largest test file no longer sets the length of the
longest run; tests that share a fixture's setup stay in one run (deal_runs), which sets it up once.

`problems(record, kind, test_files)` says what is wrong with a record kept for GPU kind `kind` as evidence of
the code it tested; the command prints it when it ends. `kernel_problems` says whether the current
FlashAttention source has such a record on a Hopper GPU (what a kernel change needs to land), and
`unbacked_runs` which of a report's runs measured code that no clean record of its GPU kind tested.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import pytest
from packaging.version import InvalidVersion, Version

from cs336_systems.gpus import device_slug

RECORD_NAME = "gpu_check"  # the folder of a GPU kind's records, reports/<gpu>/gpu_check/
# The GPU kinds whose check lands a change to the FlashAttention source: Hopper, where the kernels load through
# tensor descriptors (TMA) and their tile table is tuned; a check elsewhere leaves those paths untested.
KERNEL_CHECK_KINDS = ("h100", "h200")
# What a record must name of the software it ran: the versions of the code under test and of the GPU's stack.
VERSIONS = ("python", "torch", "triton", "cuda", "driver")
UNKNOWN_VERSIONS = ("", "unknown", "not installed", "none (CPU build)")
# The oldest torch and triton this package supports, as pyproject.toml's dependencies state them (a test keeps the
# two equal): a record that names an older one did not run the code under test on the software it needs.
MINIMUM_VERSIONS = {"torch": "2.5", "triton": "3.2"}
# Runs dated before this recorded the package source they measured but not their measured code; git history gave
# them theirs once (cs336_systems.runs.RunRecord.measured_code_from says how). A later run records its own.
MEASURED_CODE_RECORDED_SINCE = "2026-12-02 00:00 UTC"
# The tests that check the committed record and the rows measured on the GPU source: a run for a new source
# is what replaces them, so they would fail in it by design (and so keep any record from being clean).
EVIDENCE_TESTS = "test_gpu_evidence.py"
# The folders of the suite's test files: this project's tests, and the conformance suite it ships, which reaches
# the kernels through this project's adapters.
SUITE_DIRS = (Path("tests"), Path("cs336_systems/conformance"))
WHOLE_SUITE = (*(f"{folder}/" for folder in SUITE_DIRS), "--ignore", f"tests/{EVIDENCE_TESTS}")
_EVIDENCE_TEST_ID = f"tests.{EVIDENCE_TESTS.removesuffix('.py')}::"  # as JUnit names its tests
TESTS = WHOLE_SUITE
# Every launch path on every head dim and alignment, the split forward against the whole, misaligned
# inputs, kept calls launched from C++ (tensor maps included), every kernel's descriptor and pointer loads:
# small explicit shapes (not the drawn examples), so that the sanitizer's slowdown stays in minutes.
MEMCHECK_TESTS = ("tests/test_flash_triton.py", "-k",
                  "(every_launch_path or split_forward or misaligned or from_cpp or descriptor_loads) and not drawn")
# racecheck tracks shared memory hazards within a program, far slower than memcheck: the split
# forward (its merge reads what other programs stored) on one dtype, every head dim and alignment.
RACECHECK_TESTS = ("tests/test_flash_triton.py", "-k", "every_launch_path and split and bf16 and not drawn")
# A record's sanitizer run must have run its tool's selection as defined here (sanitizer_command): a change to one
# makes the records of the old selection no evidence until the sanitizers run again.
SANITIZER_TOOLS = {"memcheck": MEMCHECK_TESTS, "racecheck": RACECHECK_TESTS}
# Each part's test selection: the suite, and each sanitizer's subset.
SELECTIONS = {"tests": TESTS, **SANITIZER_TOOLS}


OUTCOMES = ("passed", "failed", "errors", "skipped")


def parse_junit(path: Path) -> dict[str, Any]:
    """Counts of a pytest JUnit XML file, the ids of failed tests, the reasons tests were skipped, and the counts of
    each test file (`test_files`, by its path from the repository's root)."""
    counts = dict.fromkeys(OUTCOMES, 0)
    failures, skip_reasons, by_file = [], {}, {}
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        test_id = f"{case.get('classname')}::{case.get('name')}"
        outcome = next((child for child in case if child.tag in ("failure", "error", "skipped")), None)
        if outcome is None:
            kind = "passed"
        elif outcome.tag == "skipped":
            kind = "skipped"
            reason = (outcome.get("message") or "").removeprefix("Skipped: ")
            skip_reasons[reason] = skip_reasons.get(reason, 0) + 1
        else:
            kind = "failed" if outcome.tag == "failure" else "errors"
            failures.append(test_id)
        counts[kind] += 1
        file_counts = by_file.setdefault(junit_test_file(case.get("classname") or ""), dict.fromkeys(OUTCOMES, 0))
        file_counts[kind] += 1
    return {**counts, "failures": failures, "skip_reasons": skip_reasons, "test_files": dict(sorted(by_file.items()))}


def junit_test_file(classname: str) -> str:
    """The test file a JUnit classname names: "tests.test_a.TestB" -> "tests/test_a.py" (the module is the last
    part that starts "test_"; a class's name starts "Test")."""
    parts = classname.split(".")
    modules = [i for i, part in enumerate(parts) if part.startswith("test_")]
    return "/".join(parts[:modules[-1] + 1]) + ".py" if modules else classname


# The line compute-sanitizer prints, after its "========= " prefix, as each process it watched exits.
# memcheck (like initcheck and synccheck): "ERROR SUMMARY: 0 errors", "ERROR SUMMARY: 1 error".
# racecheck, whose hazards are errors or warnings: "RACECHECK SUMMARY: 0 hazards displayed (0 errors,
# 0 warnings)", "RACECHECK SUMMARY: 2 hazards displayed (1 error, 1 warning)". A process that made no
# CUDA call gets no summary, only "Error: Target application terminated before first instrumented API
# call"; neither does a run stopped before its end.
ERROR_SUMMARY = re.compile(r"^=+ ERROR SUMMARY: (\d+) errors?\b", re.MULTILINE)
RACECHECK_SUMMARY = re.compile(
    r"^=+ RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)", re.MULTILINE)


def sanitizer_error_count(output: str, tool: str) -> int | None:
    """What compute-sanitizer's `tool` reported in `output`, summed over the processes it watched: errors,
    or for racecheck hazards (its errors and warnings together); None where it printed no summary."""
    if tool == "racecheck":
        counts = [int(errors) + int(warnings) for _, errors, warnings in RACECHECK_SUMMARY.findall(output)]
    else:
        counts = [int(errors) for errors in ERROR_SUMMARY.findall(output)]
    return sum(counts) if counts else None


# An error's first line, after compute-sanitizer's "========= " prefix ("Invalid __global__ read of size 2 bytes",
# "Program hit cudaErrorIllegalAddress ..."), and the indented lines under it that say where ("at
# _attn_fwd_inner+0x1a30 in kernels.py:212") and why ("Address 0x7f3a5c000800 is out of bounds").
_ERROR_HEADLINE = re.compile(r"^={9} (?!ERROR SUMMARY|RACECHECK SUMMARY|COMPUTE-SANITIZER)(\S.*)$")
_ERROR_PLACE = re.compile(r"^={9} {2,}at (.+)$")
_ERROR_ADDRESS = re.compile(r"^={9} {2,}Address \S+ (.+)$")


def sanitizer_errors(output: str) -> list[str]:
    """The distinct errors compute-sanitizer printed in `output`, most frequent first, each as its first line,
    where it was (kernel and source line) and what was wrong with the address, with how often it occurred."""
    counts: dict[str, int] = {}
    headline = place = reason = None

    def close() -> None:
        if headline is not None:
            text = headline + (f" at {place}" if place else "") + (f": {reason}" if reason else "")
            counts[text] = counts.get(text, 0) + 1

    for line in output.splitlines():
        if match := _ERROR_PLACE.match(line):
            place = place or match[1]
        elif match := _ERROR_ADDRESS.match(line):
            reason = reason or match[1]
        elif match := _ERROR_HEADLINE.match(line):
            close()
            headline, place, reason = match[1], None, None
        elif not line.startswith("========="):
            close()
            headline = None
    close()
    ranked = sorted(counts.items(), key=lambda item: -item[1])
    return [text + (f" ({count} times)" if count > 1 else "") for text, count in ranked]


# A run that takes longer than this is stopped and recorded as an error rather than left hanging.
RUN_TIMEOUT_S = 1800


def threads_each(processes: int) -> dict[str, str]:
    """The environment that gives each of `processes` processes side by side an equal share of this machine's
    cores (at least one) for torch's threads and inductor's compile workers: left at torch's defaults, each process
    (a warm-up's worker, or one of a check's runs) took a thread and a compile process per core, so that a check of
    14 runs on 16 cores ran 14 times as many of each as there are cores."""
    share = str(max(1, len(os.sched_getaffinity(0)) // processes))
    return {"OMP_NUM_THREADS": share, "TORCHINDUCTOR_COMPILE_THREADS": share}


def _pytest(arguments: tuple[str, ...], junit: Path, prefix: tuple[str, ...] = (),
            environment: dict[str, str] | None = None) -> tuple[dict[str, Any], str]:
    """Run pytest with `arguments` (under `prefix`, a sanitizer, and with `environment` added to this one's), its
    output streamed to a log beside `junit`, so that a run stopped from outside still shows which tests had
    finished."""
    command = (*prefix, sys.executable, "-m", "pytest", *arguments, "-v", "-rfE", "--durations=10",
               "-p", "no:cacheprovider", f"--junitxml={junit}")
    environment = environment or {}
    log = junit.with_suffix(".log")
    started = time.monotonic()
    with log.open("w") as stream:
        stream.write(f"$ {_shell_prefix(environment)}{' '.join(command)}\n")
        stream.flush()
        try:
            result = subprocess.run(command, stdout=stream, stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S,
                                    env={**os.environ, **environment})
            ending = f"pytest exited {result.returncode} without a report"
        except subprocess.TimeoutExpired:
            ending = f"stopped after {RUN_TIMEOUT_S} s"
    output = log.read_text(errors="replace")
    sys.stdout.write(output[-6000:] + "\n")
    summary = parse_junit(junit) if junit.exists() else {"passed": 0, "failed": 0, "errors": 1, "skipped": 0,
                                                          "failures": [ending], "skip_reasons": {}, "test_files": {}}
    pytest_command = _shell_prefix(environment) + " ".join((*prefix, "python -m pytest", *arguments))
    return {"command": pytest_command, "seconds": round(time.monotonic() - started), **summary}, output


def _shell_prefix(environment: dict[str, str]) -> str:
    return "".join(f"{name}={value} " for name, value in environment.items())


PARTS = tuple(SELECTIONS)
# "<part>:K/N": the K-th of N one-process runs that deal the part's tests between them (deal_runs), for a machine that
# cannot give one run as long as the whole part takes; "<part>:*/N" names all N. A record needs every run of one
# split of each part (or the part's whole run).
_SPLIT = re.compile(r"(\w+):(\d+)/(\d+)")
DEALER = "cs336_systems.gpu_check"  # this module as pytest loads it, the plugin that deals a split's tests (--deal)


def split(part: str) -> tuple[str, int, int] | None:
    """(part, K, N) of a run "<part>:K/N" of PARTS with 1 <= K <= N; None for any other name."""
    match = _SPLIT.fullmatch(part)
    if match is None or match[1] not in SELECTIONS or not 1 <= int(match[2]) <= int(match[3]):
        return None
    return match[1], int(match[2]), int(match[3])


def part_of(run: str) -> str:
    """The part a run belongs to: "racecheck" of "racecheck:2/4" and of "racecheck"."""
    return found[0] if (found := split(run)) else run


def expand(parts: Sequence[str]) -> tuple[str, ...]:
    """`parts` with each "<part>:*/N" written out as its N runs."""
    runs: list[str] = []
    for part in parts:
        match = re.fullmatch(r"(\w+):\*/(\d+)", part)
        runs += [f"{match[1]}:{k}/{match[2]}" for k in range(1, int(match[2]) + 1)] if match else [part]
    return tuple(runs)


def selection(part: str) -> tuple[str, ...]:
    """pytest's arguments for a run of `parts`: its part's selection, dealt where it is one of a split."""
    if (found := split(part)) is None:
        return SELECTIONS[part]
    name, k, n = found
    return _dealt(name, (k,), n)


def _dealt(part: str, runs: Sequence[int], n: int) -> tuple[str, ...]:
    """pytest's arguments for runs `runs` of a split of `part` into `n`: its selection, dealt by DEALER."""
    return (*SELECTIONS[part], "-p", DEALER, "--deal", f"{','.join(map(str, runs))}/{n}")


def sanitizer_command(run: str) -> str:
    """The command of a sanitizer's run `run` ("memcheck", "racecheck:2/4") as its record writes it, after the
    environment it was given: the tool over pytest on the tool's selection (SANITIZER_TOOLS), dealt where split."""
    return " ".join((*_sanitizer(part_of(run)), "python -m pytest", *selection(run)))


def _sanitizer(tool: str) -> tuple[str, ...]:
    return ("compute-sanitizer", "--tool", tool)


TEST_FILE_PATTERN = "test_*.py"  # the suite's test files in each of SUITE_DIRS, as pytest collects them


def suite_test_files(test_dirs: Sequence[Path] = SUITE_DIRS) -> tuple[str, ...]:
    """The suite's test files, by name (the evidence tests left out): what a record's runs must cover."""
    return tuple(sorted(str(path) for folder in test_dirs for path in folder.glob(TEST_FILE_PATTERN)
                        if path.name != EVIDENCE_TESTS))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--deal", metavar="K/N", help="keep the K-th of N runs' share of the tests collected (after -k "
                     "and -m; tests sharing a fixture's setup go to one run), K a comma-separated list: one run of a "
                     "split of cs336_systems.gpu_check's parts")


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected theirs, so that a subset is dealt evenly
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if (deal := config.getoption("deal")) is None:
        return
    match = re.fullmatch(r"(\d+(?:,\d+)*)/(\d+)", deal)
    dealt, n = ({int(k) for k in match[1].split(",")}, int(match[2])) if match else (set(), 0)
    if not dealt or not all(1 <= k <= n for k in dealt):
        raise pytest.UsageError(f"--deal: expected K/N with 1 <= K <= N (K may be a comma-separated list), "
                                f"got {deal!r}")
    runs = deal_runs(items, n)
    config.hook.pytest_deselected(items=[item for item, run in zip(items, runs) if run not in dealt])
    items[:] = [item for item, run in zip(items, runs) if run in dealt]


# The fixture scopes a run sets up once for every test that shares the fixture's value.
SHARED_SCOPES = ("class", "module", "package")


def deal_runs(items: Sequence[pytest.Item], n: int) -> list[int]:
    """The run, 1 to `n`, of each of `items`: tests that share a fixture set up once for many (SHARED_SCOPES) go to
    one run, since a run that took any of them would set it up again (a distributed test module's fixture launches
    ranks that run every check of the module); then each group, largest first, and each other test, in the order
    collected, goes to the run with the fewest tests yet. Tests that share nothing are so dealt in turn."""
    groups = _sharing_groups(items)
    loads, runs = [0] * n, [0] * len(items)
    for group in sorted(groups, key=len, reverse=True):  # a stable sort: equal groups keep their order
        run = loads.index(min(loads))
        loads[run] += len(group)
        for index in group:
            runs[index] = run + 1
    return runs


def _sharing_groups(items: Sequence[pytest.Item]) -> list[list[int]]:
    """Indices of `items` grouped by the fixture values of SHARED_SCOPES they share, directly or through others."""
    parent = list(range(len(items)))

    def root(index: int) -> int:
        while parent[index] != index:
            parent[index] = parent[parent[index]]
            index = parent[index]
        return index

    first_user: dict[tuple[str, ...], int] = {}
    for index, item in enumerate(items):
        for value in _shared_fixture_values(item):
            parent[root(index)] = root(first_user.setdefault(value, index))
    groups: dict[int, list[int]] = {}
    for index in range(len(items)):
        groups.setdefault(root(index), []).append(index)
    return sorted(groups.values())


def _shared_fixture_values(item: pytest.Item) -> list[tuple[str, ...]]:
    """The fixtures of SHARED_SCOPES `item` uses, each with the node it is set up for and its parameter: the keys
    of the setups it shares with other tests (pytest keeps a Function's fixture definitions in _fixtureinfo)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return []
    params = getattr(getattr(item, "callspec", None), "params", {})
    values = []
    for name in info.names_closure:
        definitions = info.name2fixturedefs.get(name)
        if not definitions or (scope := definitions[-1].scope) not in SHARED_SCOPES:
            continue
        # A class-scoped fixture of a test in no class is set up for its module.
        node = item.getparent({"class": pytest.Class, "module": pytest.Module, "package": pytest.Package}[scope])
        node = node or item.getparent(pytest.Module)
        values.append((name, node.nodeid if node else "", repr(params.get(name))))
    return values


def new_record() -> dict[str, Any]:
    """The record of a check on this machine of the code here, before any run: the device, versions, date,
    command, the package source and the FlashAttention source within it, the suite's test files and the measured
    code of every report a perf module writes (see module docstring)."""
    import torch

    from cs336_systems.attention.flash_triton import source_hash
    from cs336_systems.provenance import package_source_hash
    from cs336_systems.reports.problems import MEASURED_BY, measured_code
    from cs336_systems.runs import device_description, software_versions

    if not torch.cuda.is_available():
        raise SystemExit("gpu_check needs a CUDA GPU; none is visible here")
    return {"device": device_description("cuda"), **software_versions(), "driver": _driver_version(),
            "date": dt.datetime.now(dt.timezone.utc).strftime(RECORD_DATE_FORMAT),
            "command": "python -m cs336_systems.gpu_check", "source": package_source_hash(),
            "kernel_source": source_hash(), "test_files": list(suite_test_files()),
            "measured_code": {name: measured_code(name) for name in sorted(MEASURED_BY)}, "runs": {}}


def run_checks(parts: tuple[str, ...], record: dict[str, Any], save=lambda record: None,
               log_dir: Path | None = None, warm_up: bool = True) -> dict[str, Any]:
    """Run `parts` here (the suite in one process, whole or split, each sanitizer on its subset, whole or split)
    into `record`'s runs, each as a new attempt dated as it ended after those the record holds, handing the record
    to `save` after each part. Without `warm_up`, the parts start at once, on the kernels an earlier run left in
    Triton's cache."""
    if shutil.which("compute-sanitizer") is None and {part_of(part) for part in parts} & set(SANITIZER_TOOLS):
        raise SystemExit("gpu_check needs compute-sanitizer (part of the CUDA toolkit) on the PATH")
    with tempfile.TemporaryDirectory() as temporary:
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)
        scratch = log_dir or Path(temporary)
        for number, arguments in enumerate(warm_ups(parts) if warm_up else [], 1):  # a worker per core
            _pytest((*arguments, "-n", "auto"), scratch / f"warm-up-{number}.xml",
                    environment=threads_each(len(os.sched_getaffinity(0))))
        # Each of these runs is one process, so they run side by side, each on its share of the cores; on one
        # GPU, which changes no result (no test asserts a time).
        # Each part is saved as it ends, so that a run stopped from outside keeps the parts that ended.
        environment = threads_each(len(parts))
        with ThreadPoolExecutor(max_workers=len(parts)) as pool:
            for future in as_completed([pool.submit(_one_process_run, part, scratch, environment)
                                        for part in parts]):
                name, run = future.result()
                ended = dt.datetime.now(dt.timezone.utc).strftime(RECORD_DATE_FORMAT)
                record["runs"].setdefault(name, []).append({"date": ended, **run})
                save(record)
    return record


def warm_ups(parts: tuple[str, ...]) -> list[tuple[str, ...]]:
    """The test selections run in parallel before `parts`: compiling is most of a cold run and each of the
    parts is one process, so the same tests on every core first leave their kernels in Triton's cache (what
    the warm-ups find is not the record's). One run for each part, of the tests its runs deal between them; none
    for a sanitizer where the whole suite is warmed, which holds its subset."""
    by_part: dict[str, list[str]] = {}
    for run in parts:
        by_part.setdefault(part_of(run), []).append(run)
    selections = {part: _warmed(part, runs) for part, runs in by_part.items()}
    whole_suite = selections.get("tests") == SELECTIONS["tests"]
    return [chosen for part, chosen in selections.items() if not (whole_suite and part in SANITIZER_TOOLS)]


def _warmed(part: str, runs: list[str]) -> tuple[str, ...]:
    """The tests of `part` that its `runs` take: the whole selection, unless they are some runs of one split."""
    found = [split(run) for run in runs]
    sizes = {f[2] for f in found if f is not None}
    dealt = sorted({f[1] for f in found if f is not None})
    if None in found or len(sizes) != 1 or len(dealt) == min(sizes):
        return SELECTIONS[part]
    return _dealt(part, dealt, sizes.pop())


def _one_process_run(part: str, scratch: Path, environment: dict[str, str]) -> tuple[str, dict[str, Any]]:
    junit = scratch / f"{part.replace(':', '-').replace('/', '-of-')}.xml"
    if (name := part_of(part)) == "tests":
        return part, _pytest(selection(part), junit, environment=environment)[0]
    run, output = _pytest(selection(part), junit, _sanitizer(name), environment)
    return part, run | {"sanitizer_errors": sanitizer_error_count(output, name)}


def _driver_version() -> str:
    result = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                            capture_output=True, text=True)
    return result.stdout.strip().splitlines()[0] if result.returncode == 0 and result.stdout.strip() else "unknown"


def problems(record: dict[str, Any], kind: str, test_files: Sequence[str] | None = None) -> list[str]:
    """What makes `record`, kept in reports/<kind>/, fail as evidence of the code it tested (empty if nothing): a
    device of another kind; versions it does not name, or a torch or triton older than MINIMUM_VERSIONS; a missing
    run, or one whose latest attempt failed (attempt_problems); a test file of `test_files` (the suite's files at
    the record's own source where None) of which its suite's runs passed no test, or a run that names more test
    files than it ran tests."""
    found = []
    device = str(record.get("device", ""))
    device_kind = device_slug(re.sub(r"^\d+ x ", "", device))
    if device_kind != kind:
        found.append(f"it ran on {device or 'an unnamed device'} ({device_kind}), not on the {kind} whose folder "
                     "keeps it")
    unnamed = [name for name in VERSIONS if str(record.get(name, "")).strip() in UNKNOWN_VERSIONS]
    if unnamed:
        found.append(f"it does not name the {', '.join(unnamed)} version{'s' if len(unnamed) > 1 else ''} of a CUDA "
                     "run")
    found += _version_problems(record)
    runs = latest_attempts(record)
    evidence = evidence_runs(runs)
    for name in evidence:
        found += attempt_problems(name, runs[name]) if name in runs else [f"no {name} run in the record"]
    suite_runs = {name: runs[name] for name in evidence if part_of(name) == "tests" and name in runs}
    return found + _test_list_problems(record, suite_runs, test_files)


def _version_problems(record: dict[str, Any]) -> list[str]:
    """The torch and triton versions a record names that are no version or older than MINIMUM_VERSIONS, compared
    by release number, so that a vendor's build of a release (NVIDIA's containers name theirs 2.5.0a0+...) counts
    as that release."""
    found = []
    for name, minimum in MINIMUM_VERSIONS.items():
        named = str(record.get(name, "")).strip()
        if named in UNKNOWN_VERSIONS:
            continue  # said as an unnamed version
        try:
            release = Version(named).release
        except InvalidVersion:
            found.append(f"its {name} version {named!r} is no version")
            continue
        if release < Version(minimum).release:
            found.append(f"it ran {name} {named}, older than the {minimum} this package needs")
    return found


def latest_attempts(record: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each of a record's runs by its latest attempt, the one that counts as evidence: a record keeps every attempt
    of each run, oldest first (a run made again adds one, and a check of the same code again adds them to its
    record), so that a failure that a later attempt made good stays in view."""
    return {name: attempts[-1] for name, attempts in record.get("runs", {}).items() if attempts}


def attempt_problems(name: str, attempt: dict[str, Any]) -> list[str]:
    """What fails in one attempt of the run `name`: a failed test (other than an evidence test's), no test passed;
    for a sanitizer, errors or hazards it reported, no summary of them, or a selection other than its tool's as
    defined now (sanitizer_command)."""
    found = []
    discounted, tool = _evidence_test_failures(attempt), part_of(name)
    if attempt["failed"] + attempt["errors"] > len(discounted):
        failures = [test for test in attempt["failures"] if test not in discounted]
        found.append(f"{name}: {attempt['failed']} failed, {attempt['errors']} errors ({', '.join(failures[:5])})")
    if not attempt["passed"]:
        found.append(f"{name}: no test passed")
    if tool not in SANITIZER_TOOLS:
        return found
    expected = sanitizer_command(name)
    if not re.fullmatch(rf"(?:\w+=\S* )*{re.escape(expected)}", attempt["command"]):  # after its environment
        found.append(f"{name}: it ran `{attempt['command']}`, not {tool}'s selection: `{expected}`")
    if attempt.get("sanitizer_errors") is None:
        found.append(f"{name}: compute-sanitizer printed no summary (it did not finish, or saw no CUDA call)")
    elif attempt["sanitizer_errors"]:
        found.append(f"{name}: compute-sanitizer reported {attempt['sanitizer_errors']} "
                     + ("hazards" if tool == "racecheck" else "errors"))
    return found


def _test_list_problems(record: dict[str, Any], suite_runs: dict[str, dict[str, Any]],
                        test_files: Sequence[str] | None) -> list[str]:
    """Which of the suite's test files the record's suite runs (their latest attempts) left out or passed no test
    of, and runs that ran fewer tests than the files they name (one test a split's run, say). A run names its files
    with their counts (from its JUnit XML), or, in a record migrated from before runs counted them, with None: of
    such a file, only that a run named it can be checked. No test file of the suite skips all its tests on a GPU,
    so a file whose every test skipped there did not test the code."""
    expected = test_files if test_files is not None else record.get("test_files")
    if expected is None:
        return ["it does not name the suite's test files, so which tests ran cannot be checked"]
    found, ran, passed = [], set(), {}
    for name, run in suite_runs.items():
        files = run.get("test_files") or {}
        if not files:
            found.append(f"{name}: it does not name the test files it ran")
        counted = {file: counts for file, counts in files.items() if counts is not None}
        if len(counted) < len(files) and not record.get("migrated"):
            found.append(f"{name}: it names test files without their counts, as only a record migrated from before "
                         "runs counted them may")
        empty = sorted(file for file, counts in counted.items() if not sum(counts.values()))
        if empty:
            found.append(f"{name}: no test of {', '.join(empty)} ran")
        outcomes = sum(run.get(outcome, 0) for outcome in OUTCOMES)
        if outcomes < len(files):
            found.append(f"{name}: {outcomes} tests ran over {len(files)} test files, so some file ran none")
        ran |= {file for file in files if file not in empty}
        for file, counts in files.items():  # None where some run did not count its tests
            so_far = passed.get(file, 0)
            passed[file] = None if counts is None or so_far is None else so_far + counts["passed"]
    missing = sorted(set(expected) - ran)
    if missing:
        found.append(f"its suite's runs left out {len(missing)} of the suite's {len(expected)} test files: "
                     f"{', '.join(missing[:6])}{' and more' if len(missing) > 6 else ''}")
    unpassed = sorted(file for file in set(expected) & ran if passed[file] == 0)
    if unpassed:
        found.append(f"its suite's runs passed no test of {', '.join(unpassed)}: each test they ran of it skipped "
                     "or failed")
    return found


def records(kind_dir: Path) -> list[dict[str, Any]]:
    """The records kept for a GPU kind (reports/<kind>/gpu_check/*.json), oldest first."""
    paths = sorted((kind_dir / RECORD_NAME).glob("*.json"))
    return sorted((json.loads(path.read_text()) for path in paths), key=lambda record: record.get("date", ""))


# What a record checked: a record with the same values checked the same code with the same software, and a later
# check of it adds its runs there; any other is a record of its own.
CHECKED = ("source", "kernel_source", "measured_code", "test_files", "python", "torch", "triton", "cuda")


def record_path(kind_dir: Path, record: dict[str, Any]) -> Path:
    """Where a record kept for a GPU kind goes: named by its package source and a hash of the rest of what it
    checked (CHECKED), so that no check of other code or software overwrites it."""
    checked = json.dumps({key: record.get(key) for key in CHECKED[1:]}, sort_keys=True)
    return kind_dir / RECORD_NAME / f"{record['source']}-{hashlib.sha256(checked.encode()).hexdigest()[:8]}.json"


# The names a test file has had in git's history, each with when a commit first gave it that name, oldest first
# (committed_names).
History = list[tuple[dt.datetime, str]]


def kernel_problems(records_by_kind: dict[str, list[dict[str, Any]]], kernel_source: str,
                    test_files: Sequence[str], histories: dict[str, History] | None = None) -> list[str]:
    """Empty where a record of a KERNEL_CHECK_KINDS GPU is clean evidence of the FlashAttention source
    `kernel_source` that ran the suite's `test_files` (what a change to that source needs to land); else what
    each record of that source lacks, or that there is none.

    With `histories` (committed_names), a record is held to the files the repository had when it was made,
    by the names they then had: a test file added since is newer code, which the next check of a changed source
    runs, and never makes an earlier check of an unchanged source fail (a file missing from it was never
    committed, and so is newer than any record)."""
    found = []
    for kind in KERNEL_CHECK_KINDS:
        for record in records_by_kind.get(kind, []):
            if record.get("kernel_source") != kernel_source:
                continue
            lacking = problems(record, kind, files_when_made(record, test_files, histories))
            if not lacking:
                return []
            found.append(f"{record_path(Path('reports') / kind, record).as_posix()}: {'; '.join(lacking)}")
    return found or [f"no record of an {' or '.join(KERNEL_CHECK_KINDS)} check of the FlashAttention source "
                     f"{kernel_source}: run `make gpu-check` on one and commit its record"]


# How a record writes its date (new_record).
RECORD_DATE_FORMAT = "%Y-%m-%d %H:%M UTC"


def files_when_made(record: dict[str, Any], test_files: Sequence[str],
                    histories: dict[str, History] | None) -> Sequence[str]:
    """Which of `test_files` the repository had when `record` was made, by the names they had then (all of them,
    by their names now, where `histories` is None)."""
    if histories is None:
        return test_files
    made = dt.datetime.strptime(record["date"], RECORD_DATE_FORMAT).replace(tzinfo=dt.timezone.utc)
    return [[name for since, name in histories[file] if since <= made][-1]
            for file in test_files if file in histories and histories[file][0][0] <= made]


class ShallowHistory(RuntimeError):
    """The repository is a shallow clone: its history starts at the cut, where every file seems first committed."""


def committed_names(files: Sequence[str], repository: Path = Path(".")) -> dict[str, History] | None:
    """The names each of `files` (test files, by their paths relative to `repository`) has had in git's history,
    each with when a commit first gave it that name, oldest first (its name now last): a test file renamed keeps
    its age, and a record made before the rename is held to the name it ran it by. A file git has never committed
    is left out; one deleted and added again dates from its last addition. None where the repository has no git
    history to ask (a copy without .git): then every file counts, as if it had always been there.

    A shallow clone raises ShallowHistory: there every file would date from the cut, and so excuse every record
    made before it from every test file."""
    # Every test file of the files' folders, so that a rename from another test file's name is seen as one.
    folders = sorted({Path(file).parent.as_posix() for file in files})
    try:
        shallow = _git(["rev-parse", "--is-shallow-repository"], repository)
        log = _git(["log", "--reverse", "--find-renames", "--diff-filter=ADR", "--name-status", "--format=%x00%cI",
                    "--", *(f":(glob){folder}/{TEST_FILE_PATTERN}" for folder in folders)], repository)
    except (OSError, subprocess.CalledProcessError):
        return None
    if shallow.strip() == "true":
        raise ShallowHistory(f"{repository.resolve()} is a shallow clone, whose history dates every test file from "
                             "its oldest commit there, so which test files a GPU check's record had to run cannot be "
                             "told: fetch the rest of the history (`git fetch --unshallow`) and run again")
    histories: dict[str, History] = {}
    for commit in log.split("\0")[1:]:
        date, *changes = commit.strip().splitlines()
        committed = dt.datetime.fromisoformat(date).astimezone(dt.timezone.utc)
        for status, *paths in (change.split("\t") for change in changes if change):
            if status == "A":
                histories[paths[0]] = [(committed, paths[0])]
            elif status == "D":
                histories.pop(paths[0], None)
            else:  # R<similarity> old new
                old, new = paths
                histories[new] = [*histories.pop(old, []), (committed, new)]
    return {file: histories[file] for file in files if file in histories}


def _git(arguments: list[str], repository: Path) -> str:
    return subprocess.run(["git", *arguments], cwd=repository, capture_output=True, text=True, check=True).stdout


def unbacked_runs(report_dir: Path, report: str, kind_records: list[dict[str, Any]], test_files: Sequence[str],
                  histories: dict[str, History] | None = None) -> list[str]:
    """The runs of the report at reports/<kind>/<report> whose rows no clean record of that GPU kind backs, one line
    each; a record is clean as kernel_problems holds it, to the suite's `test_files` it had when it was made. A run
    that recorded its measured code needs a clean record of the same measured code for its report, run with the
    same torch and triton. A run from before runs recorded it is held to the rule it was measured under: its rows
    that name the FlashAttention source they measured (source_hash) need a clean record of that source."""
    from cs336_systems.runs import Metadata, metadata_path, read_rows, run_of

    kind = report_dir.name
    clean = [record for record in kind_records
             if not problems(record, kind, files_when_made(record, test_files, histories))]
    metadata = Metadata.read(metadata_path(report_dir, report))
    rows = read_rows(report_dir / f"{report}.csv")
    found = []
    tested_kernels = {record.get("kernel_source") for record in clean}
    for number, run in enumerate(metadata.runs, 1):
        if run.measured_code_from is None:
            if not any(record.get("measured_code", {}).get(report) == run.measured_code
                       and all(record.get(name) == run.software.get(name) for name in ("torch", "triton"))
                       for record in clean):
                found.append(f"run {number} ({run.date}) measured code {run.measured_code} with torch "
                             f"{run.software.get('torch')}, triton {run.software.get('triton')}, which no clean "
                             f"{kind} record tested")
        elif run.date >= MEASURED_CODE_RECORDED_SINCE:
            found.append(f"run {number} ({run.date}) says how its measured code was found, as only runs from before "
                         f"{MEASURED_CODE_RECORDED_SINCE} do: a run records its own")
        else:
            kernels = {str(row["source_hash"]) for row in rows if run_of(row) == number and row.get("source_hash")}
            untested = sorted(kernels - tested_kernels)
            if untested:
                found.append(f"run {number} ({run.date}) measured FlashAttention source {', '.join(untested)}, which "
                             f"no clean {kind} record tested")
    return found


def _evidence_test_failures(run: dict[str, Any]) -> list[str]:
    """The failed evidence tests of a run that included them: they checked the record and rows that the run
    was made to replace, and count for nothing."""
    return [test for test in run["failures"] if test.startswith(_EVIDENCE_TEST_ID)]


def evidence_runs(runs: dict[str, Any]) -> list[str]:
    """The runs a record needs: the suite and each sanitizer in one process, each whole or as every run of one split
    (runs of several splits do not add up to the part). A record may hold others (a run of the suite in parallel,
    which an earlier version of this command made): shown, but no evidence."""
    needed = []
    for part in PARTS:
        splits: dict[int, set[int]] = {}
        for name in runs:
            if (found := split(name)) is not None and found[0] == part:
                splits.setdefault(found[2], set()).add(found[1])
        complete = [n for n, ks in sorted(splits.items()) if ks == set(range(1, n + 1))]
        needed += [part] if part in runs or not complete else [f"{part}:{k}/{complete[0]}"
                                                               for k in range(1, complete[0] + 1)]
    return needed


def render(record: dict[str, Any], kind: str) -> str:
    """The record, kept for GPU kind `kind`, as Markdown, for people: each run by its latest attempt, and every
    earlier attempt with what failed in it."""
    test_files = record.get("test_files")
    lines = [f"# {RECORD_NAME}", "", f"- device: {record['device']}",
             f"- software: python {record['python']}, torch {record['torch']}, triton {record['triton']}, "
             f"cuda {record['cuda']}, driver {record['driver']}",
             f"- date: {record['date']}", f"- command: `{record['command']}`",
             f"- package source: {record.get('source') or 'not recorded'}",
             f"- FlashAttention GPU source: {record['kernel_source']}",
             f"- the suite's test files: {len(test_files) if test_files is not None else 'not recorded'}"]
    if record.get("migrated"):
        lines.append(f"- migrated: {record['migrated']}")
    lines += ["", "| run | command | passed | failed | errors | skipped | sanitizer errors | seconds |",
              "|---|---|---|---|---|---|---|---|"]
    runs = list(latest_attempts(record).items())
    for name, run in runs:
        lines.append(f"| {name} | `{run['command']}` | {run['passed']} | {run['failed']} | {run['errors']} | "
                     f"{run['skipped']} | {run.get('sanitizer_errors', '')} | {run['seconds']} |")
    evidence = evidence_runs(record["runs"])
    found = problems(record, kind)
    lines += ["", "As evidence of the code it tested: " + ("; ".join(found) if found else "clean") + "."]
    earlier = [(name, attempt) for name, attempts in record["runs"].items() for attempt in attempts[:-1]]
    if earlier:
        lines += ["", "Earlier attempts, each replaced as evidence by a later attempt of its run:", ""]
        for name, attempt in earlier:
            failed = "; ".join(problem.removeprefix(f"{name}: ") for problem in attempt_problems(name, attempt))
            lines.append(f"- {name}, {attempt.get('date', 'undated')}: {attempt['passed']} passed, "
                         f"{attempt['failed']} failed, {attempt['errors']} errors, {attempt['skipped']} skipped; "
                         + (f"failed: {failed}" if failed else "passed"))
    notes = []
    for name, run in runs:
        evidence_failures = _evidence_test_failures(run)
        if name not in evidence:
            notes.append(f"- {name} is not part of the evidence (only the one-process suite and the sanitizers are).")
        elif evidence_failures:
            notes.append(f"- In {name}, {len(evidence_failures)} failed tests checked the committed record and rows "
                         "that this run replaces, and count for nothing.")
    lines += ["", *notes] if notes else []
    for name, run in runs:
        if run["skip_reasons"]:
            lines += ["", f"Skipped in {name}:", ""]
            lines += [f"- {count} x {reason}" for reason, count in sorted(run["skip_reasons"].items())]
    return "\n".join(lines) + "\n"


def load_record(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


def main(argv: list[str] | None = None) -> int:
    from cs336_systems.gpus import resolve_gpu

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report-dir", default="reports",
                        help=f"the record goes to REPORT_DIR/<gpu>/{RECORD_NAME}/, one file for each code checked")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated subset of {', '.join(PARTS)} (default all), each also as PART:K/N, the "
                             "K-th of N one-process runs that deal the part's tests between them, or PART:*/N for "
                             "all N; a record of the same code keeps every earlier attempt of each run, the "
                             "latest of which counts")
    parser.add_argument("--log-dir", type=Path, help="keep each run's output (PART.log) and JUnit XML here")
    parser.add_argument("--no-warm-up", action="store_true",
                        help="start the parts at once: an earlier run on this machine left their kernels in "
                             "Triton's cache (a cold warm-up of the whole suite takes minutes)")
    args = parser.parse_args(argv)
    parts = expand([p.strip() for p in args.parts.split(",") if p.strip()])
    if not parts or any(part not in PARTS and split(part) is None for part in parts):
        parser.error(f"--parts: choose from {', '.join(PARTS)}, each also as PART:K/N (1 <= K <= N) or PART:*/N, "
                     f"got {args.parts!r}")
    slug, _ = resolve_gpu("auto")
    record = new_record()
    path = record_path(Path(args.report_dir) / slug, record)
    path.parent.mkdir(parents=True, exist_ok=True)
    if (earlier := load_record(path)) is not None:  # a check of the same code: the new attempts join its own
        record["date"], record["runs"] = earlier["date"], earlier["runs"]

    def save(record):
        path.write_text(json.dumps(record, indent=1) + "\n")
        path.with_suffix(".md").write_text(render(record, slug))

    run_checks(parts, record, save, args.log_dir, warm_up=not args.no_warm_up)
    found = problems(record, slug)
    print(f"wrote {path} and .md" + "".join(f"\n  problem: {p}" for p in found))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
