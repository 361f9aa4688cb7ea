import sys
from pathlib import Path

import pytest
from hypothesis import settings

pytest_plugins = ["cs336_systems.pytest_plugin", "pytester"]

# No property test has a time limit: a per-example deadline is a wall-clock assertion, and it fails
# on a loaded machine (two suites sharing two cores) while the property holds.
settings.register_profile("no_deadline", deadline=None)
settings.load_profile("no_deadline")


@pytest.fixture(autouse=True)
def _in_process_runs_keep_the_modules_they_import(request, monkeypatch, tmp_path_factory):
    """An in-process pytest run (pytester) leaves imported every module it imported but the run's own files.

    pytester takes sys.modules back to what it was before each run, so that the next run imports its test files
    afresh. Most modules cannot be imported a second time in one process: torch's registries (inductor's cache
    artifacts, decompositions: "Artifact of type=autotune already registered", "duplicate registrations for
    aten..."), sympy's classes (an expression made by the first import compared with the second's: "Could not
    compare -oo <= oo"), triton's compiled core, this package's torch.library ops. A later test that compiled or
    launched a kernel failed, in whichever xdist worker had run the in-process pytest that first imported them."""
    if "pytester" not in request.fixturenames:
        return
    from _pytest import pytester

    runs_root = tmp_path_factory.getbasetemp().resolve()

    def not_the_runs_own(name: str) -> bool:
        file = getattr(sys.modules.get(name), "__file__", None)
        return file is None or not Path(file).resolve().is_relative_to(runs_root)

    class KeepingSnapshot(pytester.SysModulesSnapshot):
        def __init__(self, preserve=None):
            super().__init__(lambda name: not_the_runs_own(name) or (preserve is not None and preserve(name)))

    monkeypatch.setattr(pytester, "SysModulesSnapshot", KeepingSnapshot)
