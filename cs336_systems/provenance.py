"""Hashes that name the code a run tested or measured, recorded beside its results.

`package_source_hash` names every source file of the package: the exact code a run had. `measured_code` names
the code on a measurement's path: the perf modules that measure a problem and every package module they import,
transitively, but not the package's rendering code. A report's run records both; a row whose measured code differs
from today's was measured on earlier code (cs336_systems.reports says so), and GPU evidence
(cs336_systems.gpu_check) records the measured code of every report it tested.

Why that granularity: one hash of the whole package would call every row stale on any edit (a renderer's wording,
a CPU-only check), so the marking would say nothing; a hash of the files a run's profile shows would miss code
that decides what runs without running long (a launch plan, a timer, an input check). The import closure of the
perf module is what a run can execute, and nothing it cannot.
"""

import ast
import functools
import hashlib
import sys
from collections.abc import Iterable
from pathlib import Path

PACKAGE_ROOT = Path(__file__).parent
REPOSITORY_ROOT = PACKAGE_ROOT.parent

# The package's source files by suffix: its Python and the C++ it builds (attention/flash_triton/native.cpp); not what
# building or running them leaves beside them (bytecode, compiled extensions, object files).
SOURCE_SUFFIXES = (".py", ".c", ".cc", ".cpp", ".cu", ".cuh", ".h", ".hpp")
CACHE_DIRS = ("__pycache__",)
# The package's folders that turn measured rows into words, tables and plots after the run: an edit there
# changes what a report says, never a number it holds.
RENDERING_ONLY = ("reports",)
# Every perf run goes through the pytest plugin: it chooses whether the kernels run in the Triton interpreter, and
# its fixtures launch the ranks; a perf module reaches it through pytest, not an import. The plugin imports this
# project's adapters (the default implementation under test) by their module's name, which no import names.
HARNESS = ("cs336_systems/pytest_plugin.py", "cs336_systems/adapters.py")


def source_digest(root: Path, relative_paths: Iterable[str]) -> str:
    """A short hash of the named files' paths and bytes: any edit to them, comments included, changes it. A
    name with no file there is hashed as missing."""
    digest = hashlib.sha256()
    for name in relative_paths:
        path = root / name
        digest.update(name.encode() + b"\0" + (path.read_bytes() if path.is_file() else b"\0missing") + b"\0")
    return digest.hexdigest()[:16]


def source_files(root: Path) -> list[str]:
    """The source files under `root` (SOURCE_SUFFIXES, outside CACHE_DIRS), as sorted paths relative to it."""
    return sorted(path.relative_to(root).as_posix() for path in root.rglob("*")
                  if path.suffix in SOURCE_SUFFIXES and path.is_file()
                  and not any(part in CACHE_DIRS for part in path.relative_to(root).parts))


@functools.cache  # one run measures with one source; its reports need not read it again each
def package_source_hash() -> str:
    """The hash of every source file of the package, Python and C++: the code a report's run measured with."""
    return source_digest(PACKAGE_ROOT, source_files(PACKAGE_ROOT))


def module_source_hash(module, package: Path | None = None) -> str:
    """The hash of the source of `module`'s top-level package (every source file under its folder), or of the
    module's file where it belongs to no package, and of the source of `package`, a folder, where given: the code
    of an implementation under test, whose adapters module sits in the package that holds the implementation or
    (the course's layout) beside it, in tests/."""
    top = sys.modules[module.__name__.split(".")[0]]
    folders = list(getattr(top, "__path__", []))
    if folders:
        root = Path(folders[0])
        digest = source_digest(root, source_files(root))
    else:
        path = Path(module.__file__)
        digest = source_digest(path.parent, [path.name])
    if package is None:
        return digest
    return hashlib.sha256(f"{digest}\0{source_digest(package, source_files(package))}".encode()).hexdigest()[:16]


def implementation_columns(adapters) -> dict[str, str]:
    """The columns that name an implementation under test in the rows it measured: its adapters module as
    reports name it (a cs336_systems.conformance.contract.Adapters' label) and its source hash, which covers its
    own cs336_systems where it has one."""
    return {"implementation": adapters.label,
            "implementation_source": module_source_hash(adapters.module, adapters.isolated_package)}


def package_imports(path: Path, package_root: Path = PACKAGE_ROOT) -> set[Path]:
    """The modules of the package at `package_root` that the module at `path` imports, anywhere in its code (an
    import inside a function runs when it is called all the same). `from package import name` names the submodule
    `name` where there is one, else the package's __init__."""
    package = (path.relative_to(package_root.parent).with_suffix("").parts[:-1]
               if path.is_relative_to(package_root.parent) else ())

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


def measured_path(roots: Iterable[Path], package_root: Path = PACKAGE_ROOT) -> list[Path]:
    """The files a run of the modules `roots` executes from the package, sorted: the roots, every package module
    they import, transitively, outside RENDERING_ONLY, the __init__ of every package above one (importing a module
    runs them), and the C++ sources beside any of those modules (a module there builds them:
    attention/flash_triton/native.py compiles native.cpp)."""
    rendering = [package_root / folder for folder in RENDERING_ONLY]
    found: set[Path] = set()
    queue = [Path(root) for root in roots]
    while queue:
        path = queue.pop()
        if path in found or any(path.is_relative_to(folder) for folder in rendering):
            continue
        found.add(path)
        if path.is_file() and path.suffix == ".py":
            queue += package_imports(path, package_root)
            if path.is_relative_to(package_root):
                queue += [parent / "__init__.py" for parent in path.parents
                          if parent.is_relative_to(package_root) and (parent / "__init__.py").is_file()]
    folders = {path.parent for path in found if path.is_relative_to(package_root)}
    found |= {path for folder in folders for path in folder.iterdir()
              if path.suffix in SOURCE_SUFFIXES and path.suffix != ".py" and path.is_file()}
    return sorted(found)


@functools.cache
def measured_code(perf_modules: tuple[str, ...], repository: Path = REPOSITORY_ROOT) -> str:
    """The hash of the code on the measured path of the perf modules `perf_modules` (paths in `repository`):
    those modules, the HARNESS and what `measured_path` finds from them, by their paths in the repository and
    their bytes. With no perf module named (a report no problem lists), every package module outside
    RENDERING_ONLY."""
    package_root = repository / PACKAGE_ROOT.name
    roots = ([repository / name for name in (*perf_modules, *HARNESS)] if perf_modules
             else [package_root / name for name in source_files(package_root)])
    files = measured_path(roots, package_root)
    return source_digest(repository, [path.relative_to(repository).as_posix() for path in files])
