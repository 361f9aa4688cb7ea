"""GPU evidence that CPU CI can check: on a CUDA machine, run the whole test suite in one process (an
illegal memory access poisons the process, so no other worker can hide it), compute-sanitizer memcheck on
the tests that reach every FlashAttention launch path, and racecheck on the split forward, whose programs
merge each other's results; then write reports/<gpu>/gpu_check.json (and a Markdown twin) with the
device, versions, date, command, counts and the hash of the GPU source that was tested.

    python -m cs336_systems.gpu_check                        # or: make gpu-check
    python -m cs336_systems.gpu_check --parts memcheck,racecheck
    python -m cs336_systems.gpu_check --parts tests:1/2,tests:2/2  # the one-process suite as two runs
    python -m cs336_systems.gpu_check --no-warm-up  # Triton's cache is warm from an earlier run here

Most of a cold run is compiling kernels (a few hundred, seconds each): the parts' tests first run in
parallel, which fills Triton's on-disk cache, and then the one-process runs (the suite or its shards, and
each sanitizer) run side by side.

`problems(record, source_hash)` says what is wrong with a record as evidence for the current source;
the command prints it when it ends.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

RECORD_NAME = "gpu_check"
# The tests that check the committed record and the rows measured on the GPU source: a run for a new source
# is what replaces them, so they would fail in it by design (and so keep any record from being clean).
EVIDENCE_TESTS = "test_gpu_evidence.py"
WHOLE_SUITE = ("tests/", "--ignore", f"tests/{EVIDENCE_TESTS}")
_EVIDENCE_TEST_ID = f"tests.{EVIDENCE_TESTS.removesuffix('.py')}::"  # as JUnit names its tests
# The sanitizers' warm-up runs a worker per core, and so a thread per worker: left at torch's defaults,
# each worker also ran a thread and an inductor compile process per core.
ONE_THREAD_PER_WORKER = {"OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1"}
TESTS = WHOLE_SUITE
# Every launch path on every head dim and alignment, the split forward against the whole, misaligned
# inputs, kept calls launched from C++ (tensor maps included), every kernel's descriptor and pointer loads:
# small explicit shapes (not the drawn examples), so that the sanitizer's slowdown stays in minutes.
MEMCHECK_TESTS = ("tests/test_flash_triton.py", "-k",
                  "(every_launch_path or split_forward or misaligned or from_cpp or descriptor_loads) and not drawn")
# racecheck tracks shared memory hazards within a program, far slower than memcheck: the split
# forward (its merge reads what other programs stored) on one dtype, every head dim and alignment.
RACECHECK_TESTS = ("tests/test_flash_triton.py", "-k", "every_launch_path and split and bf16 and not drawn")
SANITIZER_TOOLS = {"memcheck": MEMCHECK_TESTS, "racecheck": RACECHECK_TESTS}


def parse_junit(path: Path) -> dict[str, Any]:
    """Counts of a pytest JUnit XML file, the ids of failed tests and the reasons tests were skipped."""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures, skip_reasons = [], {}
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        test_id = f"{case.get('classname')}::{case.get('name')}"
        outcome = next((child for child in case if child.tag in ("failure", "error", "skipped")), None)
        if outcome is None:
            counts["passed"] += 1
        elif outcome.tag == "skipped":
            counts["skipped"] += 1
            reason = (outcome.get("message") or "").removeprefix("Skipped: ")
            skip_reasons[reason] = skip_reasons.get(reason, 0) + 1
        else:
            counts["failed" if outcome.tag == "failure" else "errors"] += 1
            failures.append(test_id)
    return {**counts, "failures": failures, "skip_reasons": skip_reasons}


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


def _pytest(arguments: tuple[str, ...], junit: Path, prefix: tuple[str, ...] = ()) -> tuple[dict[str, Any], str]:
    """Run pytest with `arguments` (under `prefix`, a sanitizer), its output streamed to a log beside
    `junit`, so that a run stopped from outside still shows which tests had finished."""
    command = (*prefix, sys.executable, "-m", "pytest", *arguments, "-v", "-rfE", "--durations=10",
               "-p", "no:cacheprovider", f"--junitxml={junit}")
    environment = ONE_THREAD_PER_WORKER if "-n" in arguments else {}
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
                                                          "failures": [ending], "skip_reasons": {}}
    pytest_command = _shell_prefix(environment) + " ".join(("python -m pytest", *arguments))
    return {"command": pytest_command, "seconds": round(time.monotonic() - started), **summary}, output


def _shell_prefix(environment: dict[str, str]) -> str:
    return "".join(f"{name}={value} " for name, value in environment.items())


PARTS = ("tests", *SANITIZER_TOOLS)
# "tests:K/N": the K-th of N one-process runs that share the suite's test files between them, for a
# machine that cannot give one run as long as the whole suite takes; a record needs all N of one split
# (or the whole suite's run).
_SHARD = re.compile(r"tests:(\d+)/(\d+)")


def shard(part: str) -> tuple[int, int] | None:
    """(K, N) of a part "tests:K/N" with 1 <= K <= N; None for any other part."""
    match = _SHARD.fullmatch(part)
    if match is None or not 1 <= int(match[1]) <= int(match[2]):
        return None
    return int(match[1]), int(match[2])


def shard_files(k: int, n: int, tests_dir: Path = Path("tests")) -> tuple[str, ...]:
    """The test files of run K of N: every N-th file, by name, from the K-th (the evidence tests left out)."""
    files = sorted(path for path in tests_dir.glob("test_*.py") if path.name != EVIDENCE_TESTS)
    return tuple(str(path) for path in files[k - 1::n])


def run_checks(parts: tuple[str, ...] = PARTS, earlier: dict[str, Any] | None = None,
               save=lambda record: None, log_dir: Path | None = None, warm_up: bool = True) -> dict[str, Any]:
    """Run `parts` here (the suite in one process, whole or a shard, each sanitizer on its subset); the record
    (see module docstring), handed to `save` after each part, keeping the parts of `earlier` not run
    again when it tested the same source on the same device. Without `warm_up`, the parts start at once,
    on the kernels an earlier run left in Triton's cache."""
    import torch

    from cs336_systems.attention.flash_triton import source_hash
    from cs336_systems.reports import device_description, software_versions

    if not torch.cuda.is_available():
        raise SystemExit("gpu_check needs a CUDA GPU; none is visible here")
    if shutil.which("compute-sanitizer") is None and set(parts) & set(SANITIZER_TOOLS):
        raise SystemExit("gpu_check needs compute-sanitizer (part of the CUDA toolkit) on the PATH")
    record: dict[str, Any] = {"device": device_description("cuda"), **software_versions(),
                              "driver": _driver_version(),
                              "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                              "command": "python -m cs336_systems.gpu_check", "source_hash": source_hash(),
                              "runs": {}}
    if earlier and all(earlier.get(k) == record[k] for k in ("device", "source_hash", "torch", "triton")):
        record["runs"] = dict(earlier.get("runs", {}))
    with tempfile.TemporaryDirectory() as temporary:
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)
        scratch = log_dir or Path(temporary)
        for number, arguments in enumerate(warm_ups(parts) if warm_up else [], 1):
            _pytest((*arguments, "-n", "auto"), scratch / f"warm-up-{number}.xml")
        # Each of these runs is one process on one core, so they run side by side; on one GPU, which
        # changes no result (no test asserts a time).
        # Each part is saved as it ends, so that a run stopped from outside keeps the parts that ended.
        with ThreadPoolExecutor(max_workers=len(parts)) as pool:
            for future in as_completed([pool.submit(_one_process_run, part, scratch) for part in parts]):
                name, run = future.result()
                record["runs"][name] = run
                save(record)
    return record


def warm_ups(parts: tuple[str, ...]) -> list[tuple[str, ...]]:
    """The test selections run in parallel before `parts`: compiling is most of a cold run and each of the
    parts is one process, so the same tests on every core first leave their kernels in Triton's cache (what
    the warm-ups find is not the record's). One run takes every test file of the suite's parts, and one
    each sanitizer's subset where those files leave it out."""
    files = sorted({name for part in parts if part not in SANITIZER_TOOLS
                    for name in shard_files(*(shard(part) or (1, 1)))})
    subsets = [SANITIZER_TOOLS[part] for part in parts
               if part in SANITIZER_TOOLS and SANITIZER_TOOLS[part][0] not in files]
    return ([tuple(files)] if files else []) + subsets


def _one_process_run(part: str, scratch: Path) -> tuple[str, dict[str, Any]]:
    if part == "tests":
        return "tests", _pytest(TESTS, scratch / "tests.xml")[0]
    if part not in SANITIZER_TOOLS:
        k, n = shard(part)
        return part, _pytest(shard_files(k, n), scratch / f"tests-{k}-of-{n}.xml")[0]
    run, output = _pytest(SANITIZER_TOOLS[part], scratch / f"{part}.xml", ("compute-sanitizer", "--tool", part))
    return part, run | {"command": f"compute-sanitizer --tool {part} {run['command']}",
                        "sanitizer_errors": sanitizer_error_count(output, part)}


def _driver_version() -> str:
    result = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                            capture_output=True, text=True)
    return result.stdout.strip().splitlines()[0] if result.returncode == 0 and result.stdout.strip() else "unknown"


def problems(record: dict[str, Any], current_hash: str) -> list[str]:
    """What makes `record` fail as evidence for the source whose hash is `current_hash` (empty if nothing)."""
    found = []
    if record.get("source_hash") != current_hash:
        found.append(f"it tested GPU source {record.get('source_hash')}, not the current {current_hash}: "
                     "run `make gpu-check` on a CUDA machine and commit its record")
    runs = record.get("runs", {})
    for name in evidence_runs(runs):
        run = runs.get(name)
        if not run:
            found.append(f"no {name} run in the record")
            continue
        discounted = _evidence_test_failures(run)
        if run["failed"] + run["errors"] > len(discounted):
            failures = [test for test in run["failures"] if test not in discounted]
            found.append(f"{name}: {run['failed']} failed, {run['errors']} errors ({', '.join(failures[:5])})")
        if not run["passed"]:
            found.append(f"{name}: no test passed")
        if name in SANITIZER_TOOLS and run.get("sanitizer_errors") is None:
            found.append(f"{name}: compute-sanitizer printed no summary (it did not finish, or saw no CUDA call)")
        elif name in SANITIZER_TOOLS and run["sanitizer_errors"]:
            found.append(f"{name}: compute-sanitizer reported {run['sanitizer_errors']} "
                         + ("hazards" if name == "racecheck" else "errors"))
    return found


def _evidence_test_failures(run: dict[str, Any]) -> list[str]:
    """The failed evidence tests of a run that included them: they checked the record and rows that the run
    was made to replace, and count for nothing."""
    return [test for test in run["failures"] if test.startswith(_EVIDENCE_TEST_ID)]


def evidence_runs(runs: dict[str, Any]) -> list[str]:
    """The runs a record needs: the suite in one process, whole or as every run of one split (shards of
    several splits do not add up to the suite), and each sanitizer. A record may hold others (a run of
    the suite in parallel, which an earlier version of this command made): shown, but no evidence."""
    splits: dict[int, set[int]] = {}
    for name in runs:
        if (found := shard(name)) is not None:
            splits.setdefault(found[1], set()).add(found[0])
    complete = [n for n, ks in sorted(splits.items()) if ks == set(range(1, n + 1))]
    tests = ["tests"] if "tests" in runs or not complete else [f"tests:{k}/{complete[0]}"
                                                                for k in range(1, complete[0] + 1)]
    return [*tests, *SANITIZER_TOOLS]


def render(record: dict[str, Any]) -> str:
    """The record as Markdown, for people."""
    lines = [f"# {RECORD_NAME}", "", f"- device: {record['device']}",
             f"- software: python {record['python']}, torch {record['torch']}, triton {record['triton']}, "
             f"cuda {record['cuda']}, driver {record['driver']}",
             f"- date: {record['date']}", f"- command: `{record['command']}`",
             f"- FlashAttention GPU source: {record['source_hash']}", "",
             "| run | command | passed | failed | errors | skipped | sanitizer errors | seconds |",
             "|---|---|---|---|---|---|---|---|"]
    runs = list(record["runs"].items())
    for name, run in runs:
        lines.append(f"| {name} | `{run['command']}` | {run['passed']} | {run['failed']} | {run['errors']} | "
                     f"{run['skipped']} | {run.get('sanitizer_errors', '')} | {run['seconds']} |")
    evidence = evidence_runs(record["runs"])
    found = problems(record, record["source_hash"])
    lines += ["", "As evidence for its source: " + ("; ".join(found) if found else "clean") + "."]
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


def load_record(report_dir: Path) -> dict[str, Any] | None:
    path = report_dir / f"{RECORD_NAME}.json"
    return json.loads(path.read_text()) if path.exists() else None


def main(argv: list[str] | None = None) -> int:
    from cs336_systems.gpus import resolve_gpu

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report-dir", default="reports", help="the record goes to REPORT_DIR/<gpu>/")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated subset of {', '.join(PARTS)} (default all), or tests:K/N for the "
                             "K-th of N one-process runs that share the test files; a record of the same source "
                             "keeps the parts not run again")
    parser.add_argument("--log-dir", type=Path, help="keep each run's output (PART.log) and JUnit XML here")
    parser.add_argument("--no-warm-up", action="store_true",
                        help="start the parts at once: an earlier run on this machine left their kernels in "
                             "Triton's cache (a cold warm-up of the whole suite takes minutes)")
    args = parser.parse_args(argv)
    parts = tuple(p.strip() for p in args.parts.split(",") if p.strip())
    if not parts or any(part not in PARTS and shard(part) is None for part in parts):
        parser.error(f"--parts: choose from {', '.join(PARTS)} or tests:K/N (1 <= K <= N), got {args.parts!r}")
    slug, _ = resolve_gpu("auto")
    out = Path(args.report_dir) / slug
    out.mkdir(parents=True, exist_ok=True)

    def save(record):
        (out / f"{RECORD_NAME}.json").write_text(json.dumps(record, indent=1) + "\n")
        (out / f"{RECORD_NAME}.md").write_text(render(record))

    record = run_checks(parts, load_record(out), save, args.log_dir, warm_up=not args.no_warm_up)
    found = problems(record, record["source_hash"])
    print(f"wrote {out / RECORD_NAME}.json and .md" + "".join(f"\n  problem: {p}" for p in found))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
