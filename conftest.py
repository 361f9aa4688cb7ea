import importlib
import pkgutil

import pytest
from hypothesis import settings

pytest_plugins = ["cs336_systems.pytest_plugin", "pytester"]

# No property test has a time limit: a per-example deadline is a wall-clock assertion, and it fails
# on a loaded machine (two suites sharing two cores) while the property holds.
settings.register_profile("no_deadline", deadline=None)
settings.load_profile("no_deadline")


@pytest.fixture(autouse=True)
def _modules_an_in_process_run_imports(request):
    """Before a test that runs pytest in this process (pytester), every module such a run may import. pytester
    takes sys.modules back to what it was before each run, and some modules cannot be imported twice: triton's
    compiled core, torch._inductor's and this package's registrations (torch.library ops, inductor's cache
    artifacts: "Artifact of type=autotune already registered"). Imported first, they stay."""
    if "pytester" in request.fixturenames:
        _import_package_once()


_imported = []


def _import_package_once() -> None:
    if _imported:
        return
    import cs336_systems

    # What a torch.compile imports lazily that registers artifacts in torch.compiler's cache.
    for name in ("torch._inductor.codecache", "torch._functorch._aot_autograd.autograd_cache", "torch._dynamo.pgo"):
        importlib.import_module(name)

    for module in pkgutil.walk_packages(cs336_systems.__path__, "cs336_systems."):
        if not module.name.rpartition(".")[2].startswith("test_"):  # test modules hold no registrations
            importlib.import_module(module.name)
    _imported.append(True)
