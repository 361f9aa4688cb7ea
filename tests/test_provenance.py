"""The hashes that name the code a run tested or measured (cs336_systems.provenance): which files a measurement's
path takes in, so that an edit there, and only there, names new measured code."""

from pathlib import Path

from cs336_systems import provenance
from cs336_systems.attention.flash_triton import GPU_SOURCES
from cs336_systems.provenance import PACKAGE_ROOT, measured_code, measured_path, package_imports
from cs336_systems.reports.problems import MEASURED_BY, PROBLEMS

FLASH_TRITON = PACKAGE_ROOT / "attention" / "flash_triton"


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


def _repository(tmp_path: Path) -> Path:
    """A repository whose perf module imports a benchmark, which imports a kernel package that builds C++; a
    renderer and a module no measurement imports beside them."""
    files = {
        "perf/test_x.py": "from pkg.benchmarks import x\n",
        "pkg/__init__.py": "",
        "pkg/benchmarks/__init__.py": "",
        "pkg/benchmarks/x.py": "def measure():\n    from pkg.ops.native import launch\n",
        "pkg/ops/__init__.py": "",
        "pkg/ops/native.py": "launch = 1\n",
        "pkg/ops/native.cpp": "int launch;\n",
        "pkg/reports/__init__.py": "",
        "pkg/reports/x.py": "from pkg.benchmarks import x\n",
        "pkg/unused.py": "",
        "pkg/pytest_plugin.py": "from pkg.reports import x\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


def test_the_measured_path_is_the_perf_module_and_what_it_runs_but_no_renderer(tmp_path, monkeypatch):
    repository = _repository(tmp_path)
    monkeypatch.setattr(provenance, "HARNESS", ("pkg/pytest_plugin.py",))
    found = measured_path([repository / "perf/test_x.py", repository / "pkg/pytest_plugin.py"], repository / "pkg")
    assert [path.relative_to(repository).as_posix() for path in found] == [
        "perf/test_x.py", "pkg/__init__.py", "pkg/benchmarks/__init__.py", "pkg/benchmarks/x.py",
        "pkg/ops/__init__.py", "pkg/ops/native.cpp", "pkg/ops/native.py", "pkg/pytest_plugin.py"]


def test_measured_code_changes_with_an_edit_on_the_measured_path_and_with_no_other(tmp_path, monkeypatch):
    repository = _repository(tmp_path)
    monkeypatch.setattr(provenance, "HARNESS", ("pkg/pytest_plugin.py",))
    monkeypatch.setattr(provenance, "PACKAGE_ROOT", repository / "pkg")

    def code() -> str:
        return measured_code.__wrapped__(("perf/test_x.py",), repository)

    before = code()
    (repository / "pkg/reports/x.py").write_text("WORDS = 'reworded'\n")
    (repository / "pkg/unused.py").write_text("X = 2\n")
    assert code() == before
    for edited in ("pkg/ops/native.cpp", "perf/test_x.py", "pkg/ops/__init__.py"):
        (repository / edited).write_text((repository / edited).read_text() + "\n")
        assert code() != before, edited
        before = code()


def test_every_report_a_perf_module_writes_names_its_measured_code_from_its_problems_perf_modules():
    assert set(MEASURED_BY) == {report.name for problem in PROBLEMS if problem.measured_by
                                for report in problem.reports}
    assert measured_code(MEASURED_BY["naive_ddp"]) == measured_code(MEASURED_BY["naive_ddp_benchmarking"])
    assert measured_code(MEASURED_BY["naive_ddp"]) != measured_code(MEASURED_BY["flash_benchmarking"])
