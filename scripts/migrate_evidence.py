"""Give the committed reports' runs and GPU check records their measured code, once, from git history.

Runs recorded the package source they measured (a hash of every package source file) but not the code on
their measured path. For each run, the commit whose package source is the run's is found by hashing the
package at every commit since reports recorded it; the run's measured code is computed from that commit's
files (cs336_systems.provenance.measured_code over the perf modules that write the report today). A run whose
package source no commit has measured uncommitted code, and one that recorded no source is older than the
records: their measured code is not known, and their metadata says why.

Each reports/<gpu>/gpu_check.json named only the FlashAttention source it tested. The code it tested is
taken to be that of the commit that committed it, where that commit's FlashAttention source and test files
are the record's; the record moves to reports/<gpu>/gpu_check/ (gpu_check.record_path) with that commit's
package source, measured code per report and test files, its runs naming the test files of their commands.

    python scripts/migrate_evidence.py     # from the repository's root; it re-renders the reports and index
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
import subprocess
import tempfile
from functools import cache
from pathlib import Path

from cs336_systems import gpu_check, provenance
from cs336_systems.__main__ import main as cs336_systems_main
from cs336_systems.reports import Metadata
from cs336_systems.reports.index import result_directories
from cs336_systems.reports.problems import MEASURED_BY

REPO = provenance.REPOSITORY_ROOT
# The commit that gave reports their metadata sidecars: no run is older than its first package source hash.
FIRST_RECORDED = "16d475d"
PACKAGE = provenance.PACKAGE_ROOT.name
# The suffixes the package source hash covered: Python alone until it took the C++ sources too.
HASHED_SUFFIXES = ((".py",), provenance.SOURCE_SUFFIXES)


def git(*arguments: str) -> str:
    return subprocess.run(["git", *arguments], cwd=REPO, capture_output=True, check=True, text=True).stdout


def blob(commit: str, path: str) -> bytes:
    return subprocess.run(["git", "show", f"{commit}:{path}"], cwd=REPO, capture_output=True, check=True).stdout


def package_hashes(commit: str) -> set[str]:
    """The package source hash of `commit` under each definition the reports used."""
    names = sorted(line.removeprefix(f"{PACKAGE}/") for line in git("ls-tree", "-r", "--name-only", commit,
                                                                    PACKAGE).split())
    hashes = set()
    for suffixes in HASHED_SUFFIXES:
        digest = hashlib.sha256()
        for name in (n for n in names if n.endswith(suffixes)):
            digest.update(name.encode() + b"\0" + blob(commit, f"{PACKAGE}/{name}") + b"\0")
        hashes.add(digest.hexdigest()[:16])
    return hashes


@cache
def tree(commit: str) -> Path:
    """The commit's package, perf modules and tests, in a folder of their own."""
    folder = Path(tempfile.mkdtemp(prefix=f"migrate-{commit[:12]}-"))
    subprocess.run(f"git archive {commit} {PACKAGE} perf tests | tar -x -C {folder}", shell=True, cwd=REPO,
                   check=True)
    return folder


def measured_code_at(commit: str, name: str) -> str:
    return provenance.measured_code.__wrapped__(MEASURED_BY.get(name, ()), tree(commit))


def kernel_source_at(commit: str) -> str:
    """The FlashAttention source hash as the commit's own code defined it (its GPU_SOURCES)."""
    init = tree(commit) / PACKAGE / "attention" / "flash_triton" / "__init__.py"
    assignment = next(node for node in ast.walk(ast.parse(init.read_text())) if isinstance(node, ast.Assign)
                      and getattr(node.targets[0], "id", "") == "GPU_SOURCES")
    names = ast.literal_eval(assignment.value)
    root = tree(commit) / PACKAGE if names[0].startswith("attention/") else init.parent
    return provenance.source_digest(root, names)


def package_source_at(commit: str) -> str:
    """The package source hash as the commit's own code defined it: the runs measured then name the same."""
    package = tree(commit) / PACKAGE
    with_cpp = "SOURCE_SUFFIXES" in (package / "provenance.py").read_text()
    names = provenance.source_files(package) if with_cpp else sorted(
        path.relative_to(package).as_posix() for path in package.rglob("*.py"))
    return provenance.source_digest(package, names)


def test_files_at(commit: str) -> list[str]:
    return [Path(path).relative_to(tree(commit)).as_posix() for path in gpu_check.suite_test_files(tree(commit) / "tests")]


def migrate_runs(commits_by_hash: dict[str, list[str]]) -> None:
    for slug in result_directories(REPO / "reports"):
        for sidecar in sorted((REPO / "reports" / slug).glob("*.meta.json")):
            name = sidecar.name.removesuffix(".meta.json")
            metadata = Metadata.read(sidecar)
            runs = []
            for run in metadata.runs:
                commits = commits_by_hash.get(run.source_hash or "", [])
                if not run.source_hash:
                    code, found = None, "not known: the run is older than reports recording the source they measured"
                elif not commits:
                    code, found = None, (f"not known: no commit has the run's package source {run.source_hash}, so "
                                         "it measured code that was never committed")
                else:
                    codes = {measured_code_at(commit, name) for commit in commits}
                    if len(codes) > 1:
                        raise SystemExit(f"{sidecar}: commits {commits} share the package source but not the "
                                         "measured code")
                    code = codes.pop()
                    later = f" (and {len(commits) - 1} later with the same package source)" if len(commits) > 1 else ""
                    found = (f"from commit {commits[0][:12]}{later}, the first whose package source is the run's "
                             f"{run.source_hash}, with the perf modules that write this report now")
                runs.append(type(run)(run.date, run.command, run.software, run.source_hash, code, found))
            type(metadata)(metadata.problem, metadata.device, metadata.on_gpu, tuple(runs)).write(sidecar)


def migrate_records() -> None:
    for old in sorted((REPO / "reports").glob(f"*/{gpu_check.RECORD_NAME}.json")):
        slug, relative = old.parent.name, old.relative_to(REPO).as_posix()
        record = json.loads(old.read_text())
        commit = next(c for c in git("log", "--reverse", "--format=%H", "--", relative).split()
                      if blob(c, relative) == old.read_bytes())
        if kernel_source_at(commit) != record["source_hash"]:
            raise SystemExit(f"{relative}: commit {commit[:12]} has another FlashAttention source")
        runs = {}
        for name, run in record["runs"].items():
            files = [word for word in run["command"].split() if re.fullmatch(r"tests/test_\w+\.py", word)]
            runs[name] = run | {"test_files": dict.fromkeys(files)}
        suite = test_files_at(commit)
        ran = {file for name in gpu_check.evidence_runs(runs) for file in runs[name]["test_files"]
               if name not in gpu_check.SANITIZER_TOOLS}
        if ran != set(suite):
            raise SystemExit(f"{relative}: its runs' test files are not commit {commit[:12]}'s")
        source = package_source_at(commit)
        migrated = {key: value for key, value in record.items() if key not in ("source_hash", "runs")}
        migrated |= {
            "source": source, "kernel_source": record["source_hash"], "test_files": suite,
            "measured_code": {name: measured_code_at(commit, name) for name in sorted(MEASURED_BY)}, "runs": runs,
            "migrated": (f"from {relative} as commit {commit[:12]} committed it, which named only the FlashAttention "
                         f"source it tested ({record['source_hash']}). The code it tested is taken to be that "
                         "commit's, whose FlashAttention source and test files are the record's; its package source (as "
                         "that commit hashed it), measured code and test files are that commit's. Its runs name the "
                         "test files of their "
                         "commands, not how many tests of each file ran, nor which tests.")}
        path = gpu_check.record_path(old.parent, migrated)
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(migrated, indent=1) + "\n")
        path.with_suffix(".md").write_text(gpu_check.render(migrated, slug))
        old.unlink()
        old.with_suffix(".md").unlink()


def main() -> None:
    commits_by_hash: dict[str, list[str]] = {}
    for commit in git("rev-list", "--reverse", f"{FIRST_RECORDED}^..HEAD").split():
        for package_hash in package_hashes(commit):
            commits_by_hash.setdefault(package_hash, []).append(commit)
    migrate_runs(commits_by_hash)
    migrate_records()
    cs336_systems_main(["rerender"])


if __name__ == "__main__":
    main()
