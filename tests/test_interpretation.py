"""Where the Triton kernels run (cs336_systems.interpretation): in the interpreter without a GPU,
compiled on one, and the environment put back as it was afterwards."""

import os

import pytest

from cs336_systems.attention.flash_triton import INTERPRETED
from cs336_systems.interpretation import INTERPRET_VARIABLE, interpret_kernels, interpreter_problem


@pytest.mark.parametrize("before", [None, "0"])
def test_a_run_without_a_gpu_interprets_the_kernels_until_it_restores_the_environment(monkeypatch, before):
    monkeypatch.delenv(INTERPRET_VARIABLE, raising=False)
    if before is not None:
        monkeypatch.setenv(INTERPRET_VARIABLE, before)
    restore = interpret_kernels(on_gpu=False)
    assert os.environ[INTERPRET_VARIABLE] == "1"
    restore()
    assert os.environ.get(INTERPRET_VARIABLE) == before


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
