"""Hashes that name the code a run tested or measured, recorded beside its results."""

import functools
import hashlib
import sys
from collections.abc import Iterable
from pathlib import Path

PACKAGE_ROOT = Path(__file__).parent

# The package's source files by suffix: its Python and the C++ it builds (attention/flash_triton/native.cpp); not what
# building or running them leaves beside them (bytecode, compiled extensions, object files).
SOURCE_SUFFIXES = (".py", ".c", ".cc", ".cpp", ".cu", ".cuh", ".h", ".hpp")
CACHE_DIRS = ("__pycache__",)


def source_digest(root: Path, relative_paths: Iterable[str]) -> str:
    """A short hash of the named files' paths and bytes: any edit to them, comments included, changes it."""
    digest = hashlib.sha256()
    for name in relative_paths:
        digest.update(name.encode() + b"\0" + (root / name).read_bytes() + b"\0")
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


def module_source_hash(module) -> str:
    """The hash of the source of `module`'s top-level package (every source file under its folder), or of the
    module's file where it belongs to no package: the code of an implementation under test, whose adapters
    module most often sits in the package that holds the implementation."""
    top = sys.modules[module.__name__.split(".")[0]]
    folders = list(getattr(top, "__path__", []))
    if folders:
        root = Path(folders[0])
        return source_digest(root, source_files(root))
    path = Path(module.__file__)
    return source_digest(path.parent, [path.name])


def implementation_columns(adapters) -> dict[str, str]:
    """The columns that name an implementation under test in the rows it measured: its adapters module as
    reports name it (a cs336_systems.conformance.contract.Adapters' label) and its source hash."""
    return {"implementation": adapters.label, "implementation_source": module_source_hash(adapters.module)}
