"""GPU evidence that CPU CI checks: each committed `make gpu-check` record must be a clean run of the
current FlashAttention source, every committed row that measured the kernels must have measured that
source, and the gated speed-ups in those rows must hold their floors. A kernel change therefore cannot
land without testing and measuring it again on the GPU."""

import ast
from collections import Counter
from pathlib import Path

import pytest

from cs336_systems import baselines, gpu_check
from cs336_systems.attention.flash_triton import GPU_SOURCES, source_hash
from cs336_systems.benchmarks.flash import GATE_PROMISES, GATED_PROVIDERS, gate_name, gate_ratios
from cs336_systems.provenance import PACKAGE_ROOT
from cs336_systems.reports import read_rows
from cs336_systems.reports.problems import PROBLEMS

REPO = Path(__file__).resolve().parents[1]
FLASH_TRITON = PACKAGE_ROOT / "attention" / "flash_triton"
GPU_CHECKED = sorted(path.parent.name for path in (REPO / "reports").glob(f"*/{gpu_check.RECORD_NAME}.json"))


def test_some_gpu_has_a_committed_gpu_check_record():
    assert GPU_CHECKED, f"no reports/<gpu>/{gpu_check.RECORD_NAME}.json: run `make gpu-check` on a CUDA machine"


@pytest.mark.parametrize("gpu", GPU_CHECKED)
def test_committed_gpu_check_record_is_a_clean_run_of_the_current_source(gpu):
    found = gpu_check.problems(gpu_check.load_record(REPO / "reports" / gpu), source_hash())
    assert not found, (f"reports/{gpu}/{gpu_check.RECORD_NAME}.json is no evidence for the current source: "
                       + "; ".join(found))


# The reports whose rows measured the FlashAttention kernels; every row names the GPU source it measured. The
# perf module that measures each, from the problems table.
FLASH_MEASURING_REPORTS = ("flash_benchmarking", "flash_in_training", "leaderboard")
MEASURED_BY = {name: " ".join(problem.measured_by) for problem in PROBLEMS for name in problem.report_names
               if name in FLASH_MEASURING_REPORTS}
FLASH_REPORTS = sorted(path.relative_to(REPO).as_posix() for problem in FLASH_MEASURING_REPORTS
                       for path in (REPO / "reports").glob(f"*/{problem}.csv"))


@pytest.mark.parametrize("report", FLASH_REPORTS)
def test_every_committed_flash_row_measured_the_current_source(report):
    rows, current = read_rows(REPO / report), source_hash()
    sources = Counter(r.get("source_hash") or "none recorded" for r in rows)
    other = {source: count for source, count in sources.items() if source != current}
    path = Path(report)
    assert not other, (f"{report}: {sum(other.values())} of {len(rows)} rows did not measure the current FlashAttention "
                       f"source {current} (rows by source: {other}); measure them again on that GPU: "
                       f"`pytest {MEASURED_BY[path.stem]} --gpu {path.parent.name}`")


# The GPUs whose committed flash_benchmarking rows hold the speed-up gates' cell, and a baseline file.
GATED_GPUS = sorted(path.stem for path in (REPO / "perf" / "baselines").glob("*.json")
                    if (REPO / "reports" / path.stem / "flash_benchmarking.csv").exists())


def test_some_gpu_has_committed_flash_rows_and_baselines():
    assert GATED_GPUS, "no reports/<gpu>/flash_benchmarking.csv beside a perf/baselines/<gpu>.json"


@pytest.mark.parametrize("gpu", GATED_GPUS)
def test_committed_flash_gates_hold(gpu):
    rows = read_rows(REPO / "reports" / gpu / "flash_benchmarking.csv")
    gate_rows = [r for r in rows if r.get("table") == "gate"]
    assert {r["provider"] for r in gate_rows} >= {"flash_triton", *GATED_PROVIDERS}, "the gate rows are missing"
    path = REPO / "perf" / "baselines" / f"{gpu}.json"
    recorded, ratios = baselines.load_baselines(path), gate_ratios(rows)
    for provider in GATED_PROVIDERS:
        name = gate_name(provider)
        assert ratios[name] is not None, f"{name}: a gated variant has no time in the committed rows"
        result = baselines.check(name, ratios[name], recorded, GATE_PROMISES[provider])
        assert result.passed, result.message(path)


def package_imports(path: Path, package_root: Path) -> set[Path]:
    """The modules of the package at `package_root` that the module at `path` imports, anywhere in its
    code (an import inside a function runs at launch time all the same). `from package import name`
    names the submodule `name` where there is one, else the package's __init__."""
    package = path.relative_to(package_root.parent).with_suffix("").parts[:-1]

    def module_file(parts: tuple[str, ...]) -> Path | None:
        if not parts or parts[0] != package_root.name:
            return None
        base = package_root.parent.joinpath(*parts)
        return next((file for file in (base.with_suffix(".py"), base / "__init__.py") if file.is_file()), None)

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {module_file(tuple(alias.name.split("."))) for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = tuple(node.module.split(".")) if node.module else ()
            if node.level:
                base = package[:len(package) - node.level + 1] + base
            found |= {module_file(base + (alias.name,)) or module_file(base) for alias in node.names}
    return found - {None}


def test_the_import_walk_finds_every_form_of_import_within_the_package(tmp_path):
    root = tmp_path / "pkg"
    (root / "sub").mkdir(parents=True)
    for name in ("__init__", "a", "b", "c", "d", "sub/__init__", "sub/e", "sub/f"):
        (root / f"{name}.py").write_text("VALUE = 1\n")
    (root / "sub" / "main.py").write_text(
        "import torch\nimport pkg.a\nfrom pkg import b, VALUE\nfrom pkg.sub import e\nfrom . import f\n"
        "from ..c import VALUE\n\ndef launch():\n    from pkg import d\n")
    found = package_imports(root / "sub" / "main.py", root)
    assert {p.relative_to(root).as_posix() for p in found} == {
        "a.py", "b.py", "__init__.py", "sub/e.py", "sub/f.py", "c.py", "d.py"}


def test_the_gpu_source_hash_covers_the_kernels_and_every_package_module_they_import():
    """GPU_SOURCES is this package's modules (kernels, tiles, launch, native, op), its C++ source, and
    everything they import from cs336_systems, transitively: an edit to any of them changes what runs on
    the GPU."""
    hashed = {PACKAGE_ROOT / name for name in GPU_SOURCES}
    assert all(path.is_file() for path in hashed), sorted(map(str, hashed))
    needed = set(FLASH_TRITON.glob("*.cpp"))
    queue = [path for path in FLASH_TRITON.glob("*.py") if path.name != "__init__.py"]
    while queue:
        path = queue.pop()
        if path not in needed:
            needed.add(path)
            queue += package_imports(path, PACKAGE_ROOT)
    named = {path.relative_to(PACKAGE_ROOT).as_posix() for path in needed}
    assert named == set(GPU_SOURCES), (f"not hashed: {sorted(named - set(GPU_SOURCES))}; "
                                       f"hashed but not imported: {sorted(set(GPU_SOURCES) - named)}")
