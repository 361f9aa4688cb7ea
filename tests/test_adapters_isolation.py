"""An implementation whose repository has its own cs336_systems package, as the course's does, is imported beside
this harness's package of that name (cs336_systems.conformance.isolation). Each case runs in a fresh process: a
process imports one such implementation."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import cs336_systems

OURS = str(Path(cs336_systems.__file__).resolve())


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip())


def _course_repository(root: Path) -> Path:
    """A course-like repository: its package cs336_systems (every form of absolute import of it, and a relative
    one), and its adapters in a package of tests beside it that imports a neighbour."""
    repo = root / "repo"
    _write(repo / "cs336_systems" / "__init__.py", "WHOSE = 'theirs'\n")
    _write(repo / "cs336_systems" / "helpers.py", "def twice(x):\n    return 2 * x\n")
    _write(repo / "cs336_systems" / "flash.py", """
        import cs336_systems.helpers
        import cs336_systems.helpers as aliased
        from cs336_systems import WHOSE
        from . import helpers as relative
        from cs336_basics.model import Linear


        class Function:
            whose = WHOSE
            layer = Linear

            @staticmethod
            def apply(x):
                return (cs336_systems.helpers.twice(x), aliased.twice(x), relative.twice(x))
    """)
    _write(repo / "suite" / "__init__.py", "")
    _write(repo / "suite" / "common.py", "from cs336_systems.flash import Function\n")
    _write(repo / "suite" / "adapters.py", """
        from cs336_systems.flash import Function as Imported
        from .common import Function


        def get_flashattention_autograd_function_pytorch():
            assert Function is Imported
            return Function
    """)
    return repo


def _run(script: str, cwd: Path) -> dict:
    """What `script` prints as JSON on its last line, run in a fresh interpreter."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=cwd, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_course_repository_s_own_cs336_systems_is_imported_under_another_name_beside_the_harness_s(tmp_path):
    repo = _course_repository(tmp_path)
    # Bytecode a plain import cached (the original names) must not be what runs.
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(repo)], check=True)
    found = _run("""
        import inspect, json, sys
        from pathlib import Path
        import cs336_basics.model, cs336_systems
        from cs336_systems.conformance.contract import load_adapters
        from cs336_systems.provenance import implementation_columns

        def source_hash(adapters):
            return implementation_columns(adapters)["implementation_source"]

        def edit_their_package():
            helpers = Path("repo/cs336_systems/helpers.py")
            helpers.write_text(helpers.read_text() + "# edited\\n")

        adapters = load_adapters("repo/suite/adapters.py")
        function = adapters.function("get_flashattention_autograd_function_pytorch")()
        print(json.dumps({"whose": function.whose, "apply": function.apply(3), "module": function.__module__,
                          "ours": cs336_systems.__file__, "theirs": sys.modules["under_test_cs336_systems"].__file__,
                          "shared_basics": function.layer is cs336_basics.model.Linear,
                          "source": inspect.getsource(sys.modules[function.__module__]).splitlines()[0],
                          "again": load_adapters(adapters.spec).module is adapters.module,
                          "hashes": [source_hash(adapters), edit_their_package() or source_hash(adapters)]}))
    """, tmp_path)
    hashes = found.pop("hashes")
    assert found == {"whose": "theirs", "apply": [6, 6, 6], "module": "under_test_cs336_systems.flash", "ours": OURS,
                     "theirs": str(repo / "cs336_systems" / "__init__.py"), "shared_basics": True,
                     "source": "import cs336_systems.helpers", "again": True}
    assert hashes[0] != hashes[1]  # the rows' source hash covers the implementation, not only its adapters


def test_a_second_implementation_with_its_own_cs336_systems_needs_a_process_of_its_own(tmp_path):
    _course_repository(tmp_path / "a")
    _course_repository(tmp_path / "b")
    found = _run("""
        import json
        from cs336_systems.conformance.contract import AdaptersImportError, load_adapters

        load_adapters("a/repo/suite/adapters.py")
        try:
            load_adapters("b/repo/suite/adapters.py")
        except AdaptersImportError as error:
            print(json.dumps(str(error)))
    """, tmp_path)
    assert found == (f"--adapters b/repo/suite/adapters.py: this process already imports "
                     f"{tmp_path / 'a' / 'repo' / 'cs336_systems'} as under_test_cs336_systems; an implementation "
                     f"with another cs336_systems ({tmp_path / 'b' / 'repo' / 'cs336_systems'}) needs a process of "
                     "its own")


def test_an_import_the_harness_s_cs336_basics_lacks_is_told_why(tmp_path):
    repo = _course_repository(tmp_path)
    _write(repo / "suite" / "adapters.py", """
        from cs336_basics.optimizer import AdamW

        def get_sharded_optimizer(params, optimizer_cls, **kwargs):
            return AdamW
    """)
    found = _run("""
        import json
        from cs336_systems.conformance.contract import AdaptersImportError, load_adapters

        try:
            load_adapters("repo/suite/adapters.py")
        except AdaptersImportError as error:
            print(json.dumps(str(error)))
    """, tmp_path)
    assert "No module named 'cs336_basics.optimizer'" in found
    assert "cs336_basics here is the harness's" in found and "import anything else from elsewhere" in found


def test_ranks_a_launch_spawns_import_the_harness_s_cs336_systems_and_the_implementation_s_under_its_new_name(
        tmp_path):
    """A spawned rank inherits sys.path and imports the adapters again: the repository's folder must not come
    before the harness's package there."""
    _course_repository(tmp_path)
    _write(tmp_path / "rank_probe.py", """
        import cs336_systems
        from cs336_systems.conformance.contract import load_adapters


        def whose(rank, world_size, spec):
            function = load_adapters(spec).function("get_flashattention_autograd_function_pytorch")()
            return cs336_systems.__file__, function.whose
    """)
    found = _run("""
        import json
        from cs336_systems.conformance.contract import load_adapters
        from cs336_systems.distributed.launch import launch
        import rank_probe

        adapters = load_adapters("repo/suite/adapters.py")
        print(json.dumps(launch(rank_probe.whose, 2, adapters.spec, device="cpu")))
    """, tmp_path)
    assert found == [[OURS, "theirs"], [OURS, "theirs"]]
