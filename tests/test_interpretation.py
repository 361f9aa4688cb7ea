"""Where the Triton kernels run (cs336_systems.interpretation): in the interpreter without a GPU,
compiled on one, and the environment put back as it was afterwards."""

import os

import pytest

from cs336_systems.attention.flash_triton import INTERPRETED
from cs336_systems.interpretation import INTERPRET_VARIABLE, interpret_kernels


@pytest.mark.parametrize("before", [None, "0"])
def test_a_run_without_a_gpu_interprets_the_kernels_until_it_restores_the_environment(monkeypatch, before):
    monkeypatch.delenv(INTERPRET_VARIABLE, raising=False)
    if before is not None:
        monkeypatch.setenv(INTERPRET_VARIABLE, before)
    restore = interpret_kernels(on_gpu=False)
    assert os.environ[INTERPRET_VARIABLE] == "1"
    restore()
    assert os.environ.get(INTERPRET_VARIABLE) == before


def test_a_run_on_a_gpu_leaves_the_environment_alone(monkeypatch):
    monkeypatch.delenv(INTERPRET_VARIABLE, raising=False)
    restore = interpret_kernels(on_gpu=True)
    assert INTERPRET_VARIABLE not in os.environ
    monkeypatch.setenv(INTERPRET_VARIABLE, "1")  # a user's own choice, made during the run, stays
    restore()
    assert os.environ[INTERPRET_VARIABLE] == "1"


def test_the_kernels_of_this_run_run_where_the_plugin_decided(run_settings):
    assert INTERPRETED == (not run_settings.on_gpu)
