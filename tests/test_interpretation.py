"""Where the Triton kernels run (cs336_systems.interpretation): in the interpreter without a GPU,
compiled on one, and the environment put back as it was afterwards."""

import os
import subprocess
import sys

import pytest

from cs336_systems.attention.flash_triton import INTERPRETED
from cs336_systems.interpretation import INTERPRET_VARIABLE, interpret_kernels, interpreter_problem


@pytest.mark.parametrize(("triton_version", "numpy_version", "fails"), [
    ("3.6.0", "2.4.6", True), ("3.6.0", "2.3.5", False), ("3.9.0", "2.4.0", False), ("3.10.1", "2.5.0", False),
    ("3.5.1+git1a2b", "2.4.0rc1", True), ("3.6.0", "2.3rc4", False)])
def test_the_interpreter_known_to_fail_is_named_with_its_versions(triton_version, numpy_version, fails):
    problem = interpreter_problem(triton_version, numpy_version)
    if fails:
        assert f"Triton {triton_version}" in problem and f"numpy {numpy_version}" in problem
    else:
        assert problem is None


def test_a_run_on_a_gpu_leaves_the_environment_alone(monkeypatch):
    monkeypatch.delenv(INTERPRET_VARIABLE, raising=False)
    restore = interpret_kernels(on_gpu=True)
    assert INTERPRET_VARIABLE not in os.environ
    monkeypatch.setenv(INTERPRET_VARIABLE, "1")  # a user's own choice, made during the run, stays
    restore()
    assert os.environ[INTERPRET_VARIABLE] == "1"


def test_the_kernels_of_this_run_run_where_the_plugin_decided(run_settings):
    assert INTERPRETED == (not run_settings.on_gpu)


def _fresh_python(code: str) -> subprocess.CompletedProcess:
    """`code` run in a new process that starts with TRITON_INTERPRET unset, as a user's does."""
    environment = {name: value for name, value in os.environ.items() if name != INTERPRET_VARIABLE}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environment)


@pytest.mark.parametrize("before", [None, "0"])
def test_a_run_without_a_gpu_interprets_the_kernels_until_it_restores_the_environment(before):
    # In a new process: this one, on a GPU, may have imported Triton compiled, and then refuses the interpreter.
    setting = f"os.environ[{INTERPRET_VARIABLE!r}] = {before!r}; " if before is not None else ""
    result = _fresh_python(
        f"import os; {setting}from cs336_systems.interpretation import interpret_kernels; "
        f"restore = interpret_kernels(on_gpu=False); assert os.environ[{INTERPRET_VARIABLE!r}] == '1'; restore(); "
        f"assert os.environ.get({INTERPRET_VARIABLE!r}) == {before!r}")
    assert result.returncode == 0, result.stderr[-2000:]


# torch.compiler.disable imports torch._dynamo, which imports triton: its language then takes the compiled mode.
TRITON_IMPORTED_COMPILED = "import os, torch._dynamo; os.environ['TRITON_INTERPRET'] = '1'; "


def test_kernels_imported_interpreted_beside_a_compiled_triton_language_name_the_cause():
    result = _fresh_python(TRITON_IMPORTED_COMPILED + "import cs336_systems.attention.flash_triton")
    assert result.returncode == 1
    assert "ImportError: triton.language was imported compiled and the FlashAttention kernels interpreted" in \
        result.stderr, result.stderr[-2000:]


def test_deciding_to_interpret_after_triton_was_imported_compiled_is_refused():
    result = _fresh_python(TRITON_IMPORTED_COMPILED.replace("os.environ['TRITON_INTERPRET'] = '1'; ", "")
                           + "from cs336_systems.interpretation import interpret_kernels; "
                           "interpret_kernels(on_gpu=False)")
    assert result.returncode == 1
    assert "RuntimeError: triton.language was imported compiled" in result.stderr, result.stderr[-2000:]


def test_a_run_in_one_process_without_a_gpu_runs_the_kernels_interpreted(pytester, monkeypatch):
    # One process, as `make perf` runs: the plugin prepares the run's reports (their imports reach triton, through
    # torch.compiler.disable) in the process that then runs the kernels. Under pytest-xdist the workers do not.
    if problem := interpreter_problem():
        pytest.skip(f"this install's interpreter cannot run the kernels: {problem}")
    pytester.makepyfile("""
        import torch
        from cs336_systems.attention.flash_triton import INTERPRETED, FlashAttentionTriton

        def test_kernels():
            assert INTERPRETED
            q, k, v = (torch.randn(1, 20, 16) for _ in range(3))
            expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            torch.testing.assert_close(FlashAttentionTriton.apply(q, k, v, True), expected)
    """)
    monkeypatch.delenv(INTERPRET_VARIABLE, raising=False)
    result = pytester.runpytest_subprocess("-p", "cs336_systems.pytest_plugin", "-p", "no:cacheprovider",
                                           "--gpu", "none", "--report-dir", str(pytester.path / "reports"))
    result.assert_outcomes(passed=1)
