"""Hashes that name the code a run tested or measured, recorded beside its results."""

import functools
import hashlib
from collections.abc import Iterable
from pathlib import Path

PACKAGE_ROOT = Path(__file__).parent


def source_digest(root: Path, relative_paths: Iterable[str]) -> str:
    """A short hash of the named files' paths and bytes: any edit to them, comments included, changes it."""
    digest = hashlib.sha256()
    for name in relative_paths:
        digest.update(name.encode() + b"\0" + (root / name).read_bytes() + b"\0")
    return digest.hexdigest()[:16]


@functools.cache  # one run measures with one source; its reports need not read it again each
def package_source_hash() -> str:
    """The hash of every Python file of the package: the code a report's run measured with."""
    return source_digest(PACKAGE_ROOT, sorted(p.relative_to(PACKAGE_ROOT).as_posix()
                                              for p in PACKAGE_ROOT.rglob("*.py")))
