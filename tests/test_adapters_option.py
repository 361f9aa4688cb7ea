"""--adapters: the implementation under test, chosen by module name or file, and the plugin's entry point that
makes the option exist wherever the package is installed (pytester runs, and pytest in a folder of its own) while
leaving the runs that are not the plugin's own alone; and the wheel that `pip install` builds, which must hold
every file of the packages."""

import os
import shutil
import subprocess
import sys
import textwrap
import tomllib
import zipfile
from importlib.metadata import PackageNotFoundError, distribution, entry_points
from pathlib import Path

import pytest

from cs336_systems.conformance.contract import (
    ADAPTER_FUNCTIONS,
    OWN_ADAPTERS,
    MissingAdapter,
    is_unimplemented,
    load_adapters,
)
from tests.inner_runs import runpytest

PLUGIN = ["-p", "cs336_systems.pytest_plugin", "-p", "no:cacheprovider", "--gpu", "none"]
REPO_ROOT = Path(__file__).resolve().parents[1]

# A module implementing two of the interface's functions, a third as the course's skeleton leaves it.
PARTIAL_ADAPTERS = '''
    def get_ddp(module):
        return module

    def ddp_on_after_backward(ddp_model, optimizer):
        pass

    def get_fsdp(module, compute_dtype=None):
        """Returns the FSDP container."""
        raise NotImplementedError
'''
NEEDS = '''
    import pytest

    @pytest.mark.adapters("get_ddp", "ddp_on_after_backward")
    def test_ddp(adapters):
        assert adapters.function("get_ddp")(3) == 3

    @pytest.mark.adapters("get_ddp", "get_fsdp")
    def test_fsdp(adapters):
        raise AssertionError("must be skipped: get_fsdp is the skeleton's")

    @pytest.mark.adapters("get_sharded_optimizer")
    def test_sharded(adapters):
        raise AssertionError("must be skipped: no get_sharded_optimizer")
'''


def _installed() -> bool:
    try:
        distribution("cs336-systems")
    except PackageNotFoundError:
        return False
    return True


# What only an installed package has: its entry point.
needs_installed_package = pytest.mark.skipif(
    not _installed(), reason="cs336-systems is imported from a checkout here, not installed: only `pip install` "
                             "(make test does) registers its entry point")


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


@needs_installed_package
def test_the_plugin_is_a_pytest11_entry_point_of_the_installed_package_named_as_the_conftest_names_it():
    plugins = {point.name: point.value for point in entry_points(group="pytest11")}
    assert plugins.get("cs336_systems.pytest_plugin") == "cs336_systems.pytest_plugin"
    conftest = (REPO_ROOT / "conftest.py").read_text()
    assert '"cs336_systems.pytest_plugin"' in conftest  # the same name: registered once, by whichever comes first


def _pytest_in_another_project(folder: Path, *args: str, pyproject: str = "") -> subprocess.CompletedProcess:
    """pytest run in `folder`, a project of its own (`pyproject` adds to its pyproject.toml): no conftest, no
    PYTHONPATH, so only the installed package's entry point can load the plugin; and no TRITON_INTERPRET, which this
    run's own plugin may have set."""
    _write(folder / "pyproject.toml", "[project]\nname = 'elsewhere'\n" + pyproject)
    environment = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "TRITON_INTERPRET")}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=folder,
                          env=environment, capture_output=True, text=True, timeout=300)


@needs_installed_package
def test_pytest_in_another_project_lists_the_options(tmp_path):
    result = _pytest_in_another_project(tmp_path, "--help")
    assert result.returncode == 0, result.stderr
    for option in ("--adapters=MODULE_OR_FILE", "--gpu=GPU", "--world-size=WORLD_SIZE", "--report-dir"):
        assert option in result.stdout


@needs_installed_package
def test_pytest_in_another_project_runs_untouched_by_the_plugin(tmp_path):
    """No Triton mode chosen, no torch imported, no marker or fixture of ours: a run that is not the plugin's own."""
    _write(tmp_path / "test_elsewhere.py", """
        import os
        import sys

        import pytest

        def test_untouched(request):
            assert os.environ.get("TRITON_INTERPRET") is None
            assert "torch" not in sys.modules
            assert not [line for line in request.config.getini("markers") if line.startswith("flash:")]
            with pytest.raises(pytest.FixtureLookupError):
                request.getfixturevalue("run_settings")
    """)
    result = _pytest_in_another_project(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_installed_package
@pytest.mark.parametrize("args, pyproject", [
    (["--gpu", "none"], ""),
    ([], "[tool.pytest.ini_options]\ngpu = 'none'\n"),
], ids=["command line", "ini file"])
def test_an_option_of_the_plugin_makes_a_run_in_another_project_its_own(tmp_path, args, pyproject):
    _write(tmp_path / "test_elsewhere.py", """
        import os

        def test_ours(run_settings):
            assert os.environ["TRITON_INTERPRET"] == "1" and run_settings.gpu_slug == "cpu"
    """)
    result = _pytest_in_another_project(tmp_path, *args, pyproject=pyproject)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_installed_package
def test_the_shipped_suite_runs_from_another_folder_with_no_option(tmp_path):
    """`pytest --pyargs cs336_systems.conformance`: the run names the package's own tests, and so is the plugin's."""
    result = _pytest_in_another_project(tmp_path, "--pyargs", "cs336_systems.conformance.test_flash_attention",
                                        "-k", "is_causal_is_optional")
    assert result.returncode == 0, result.stdout + result.stderr
    assert " passed" in result.stdout.splitlines()[-1]


def test_a_built_wheel_holds_every_file_the_packages_track(tmp_path):
    """`pip install path/to/this/repository` installs a wheel, which holds a package's files other than its modules
    (the C++ that attention/flash_triton/native.py builds at run time) only where pyproject.toml names them."""
    # Asked in a subprocess: looking pip up in this process (importlib.util.find_spec) sets off setuptools'
    # distutils shim, which then swaps distutils under every later C++ extension build of the process.
    if unbuildable := [name for name in ("pip", "setuptools")
                       if subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True).returncode]:
        pytest.skip(f"building a wheel offline needs {' and '.join(unbuildable)}, which this Python lacks")
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    packages = [pattern.rstrip("*") for pattern in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]]
    listed = subprocess.run(["git", "ls-files", "-z", "pyproject.toml", pyproject["project"]["readme"], *packages],
                            cwd=REPO_ROOT, capture_output=True, text=True) if shutil.which("git") else None
    if listed is None or listed.returncode != 0:
        pytest.skip("the repository is not a git checkout here: which files it tracks is unknown")
    tracked = listed.stdout.split("\0")[:-1]
    source = tmp_path / "source"  # a copy: a build in the checkout leaves build/ and an egg-info there
    for name in tracked:
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO_ROOT / name, source / name)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                            "--no-cache-dir", "--disable-pip-version-check", "--quiet", "--wheel-dir",
                            str(tmp_path / "wheel"), str(source)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = (tmp_path / "wheel").glob("*.whl")
    in_wheel = set(zipfile.ZipFile(wheel).namelist())
    data = [name for name in tracked if name.split("/")[0] in packages and not name.endswith(".py")]
    assert "cs336_systems/attention/flash_triton/native.cpp" in data
    assert [name for name in data if name not in in_wheel] == []


def test_this_repository_registers_the_plugin_once(pytester):
    pytester.makeconftest('pytest_plugins = ["cs336_systems.pytest_plugin"]')
    pytester.makepyfile("""
        def test_once(request):
            import cs336_systems.pytest_plugin as plugin
            registered = [p for p in request.config.pluginmanager.get_plugins() if p is plugin]
            assert len(registered) == 1
    """)
    runpytest(pytester, "-p", "no:cacheprovider", "--gpu", "none").assert_outcomes(passed=1)


def test_tests_needing_a_function_the_module_lacks_are_skipped_naming_it(pytester):
    _write(pytester.path / "mine" / "adapters.py", PARTIAL_ADAPTERS)
    pytester.makepyfile(NEEDS)
    result = runpytest(pytester, *PLUGIN, "--adapters", "mine/adapters.py", "-rs")
    result.assert_outcomes(passed=1, skipped=2)
    result.stdout.fnmatch_lines(["*implementation under test: adapters mine/adapters.py*",
                                 "*adapters mine/adapters.py does not implement get_fsdp",
                                 "*adapters mine/adapters.py does not implement get_sharded_optimizer"])


def test_the_ini_setting_names_the_module_relative_to_the_ini_file(pytester, monkeypatch):
    _write(pytester.path / "mine" / "adapters.py", PARTIAL_ADAPTERS)
    pytester.makeini("[pytest]\nadapters = mine/adapters.py\n")
    _write(pytester.path / "sub" / "test_needs.py", NEEDS)
    monkeypatch.chdir(pytester.path / "sub")
    runpytest(pytester, *PLUGIN, "test_needs.py").assert_outcomes(passed=1, skipped=2)


def test_without_the_option_the_implementation_under_test_is_this_projects_own(pytester):
    pytester.makepyfile("""
        def test_own(adapters):
            assert adapters.spec == "cs336_systems.adapters" and adapters.is_own
            assert not adapters.missing(*adapters.implemented)
    """)
    runpytest(pytester, *PLUGIN).assert_outcomes(passed=1)
    assert load_adapters().implemented == frozenset(ADAPTER_FUNCTIONS)


@pytest.mark.parametrize("content, message", [
    ("import no_such_package_anywhere\n", "--adapters broken.py (*broken.py, imported as broken) failed to import: "
                                          "ModuleNotFoundError: No module named 'no_such_package_anywhere'"),
    ("raise SystemExit(3)\n", "failed to import: SystemExit: 3"),
    ("def something_else():\n    pass\n", "defines none of the course's adapter functions"),
])
def test_a_module_that_cannot_serve_is_a_usage_error_before_any_test_runs(pytester, content, message):
    _write(pytester.path / "broken.py", content)
    pytester.makepyfile("def test_x():\n    raise AssertionError('no test may run')\n")
    result = runpytest(pytester, *PLUGIN, "--adapters", "broken.py")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: *{message}*"])


@pytest.mark.parametrize("spec, message", [
    ("missing/adapters.py", "no such file or folder"),
    ("no_such_module_for_adapters", "failed to import: ModuleNotFoundError"),
    ("  ", "--adapters is empty"),
])
def test_a_module_that_does_not_exist_is_a_usage_error(pytester, spec, message):
    pytester.makepyfile("def test_x():\n    pass\n")
    result = runpytest(pytester, *PLUGIN, "--adapters", spec)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: *{message}*"])


def test_a_file_inside_packages_is_imported_under_its_dotted_name_so_relative_imports_work(tmp_path):
    _write(tmp_path / "course" / "__init__.py", "")
    _write(tmp_path / "course" / "tests" / "__init__.py", "")
    _write(tmp_path / "course" / "tests" / "helpers.py", "def wrap(module):\n    return ('wrapped', module)\n")
    _write(tmp_path / "course" / "tests" / "adapters.py", """
        from .helpers import wrap

        def get_ddp(module):
            return wrap(module)
    """)
    adapters = load_adapters("course/tests/adapters.py", relative_to=tmp_path)
    assert adapters.module.__name__ == "course.tests.adapters"
    assert adapters.function("get_ddp")(1) == ("wrapped", 1)
    assert adapters.spec == str(tmp_path / "course" / "tests" / "adapters.py")
    assert load_adapters(adapters.spec).module is adapters.module  # what a rank passes imports the same module
    with pytest.raises(MissingAdapter, match="does not implement get_fsdp"):
        adapters.function("get_fsdp")


def test_only_a_body_that_just_raises_not_implemented_counts_as_unimplemented():
    def skeleton():
        """Docstring."""
        raise NotImplementedError

    def skeleton_with_message():
        raise NotImplementedError("implement me")

    def guarded(x):
        if x:
            raise NotImplementedError
        return x

    def other_error():
        raise ValueError

    assert is_unimplemented(skeleton) and is_unimplemented(skeleton_with_message)
    assert not is_unimplemented(guarded) and not is_unimplemented(other_error) and not is_unimplemented(len)


def test_asking_for_a_name_outside_the_interface_is_an_error():
    with pytest.raises(ValueError, match="not adapter functions of the course's interface: get_ddp_flat"):
        load_adapters(OWN_ADAPTERS).missing("get_ddp", "get_ddp_flat")
