"""pytest runs that the tests start (pytester), in this process where they can be."""

import os
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]


def pythonpath_with_this_checkout() -> str:
    """PYTHONPATH for a new process that must import this checkout's package, installed or not."""
    return os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))


def runpytest(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    """pytester's run of `args`: in this process, or in a new one where the run interprets the FlashAttention kernels
    (`--gpu none`) and this process has a GPU. No process holds both modes (cs336_systems.interpretation): after a
    test here has run a kernel the run is refused, and before, it would leave Triton imported interpreted for the
    GPU tests after it (conftest.py keeps what an in-process run imports). The new process imports this checkout's
    package whether or not it is installed."""
    interprets = any(option == "--gpu" and value == "none" for option, value in zip(args, args[1:]))
    if not (interprets and torch.cuda.is_available()):
        return pytester.runpytest(*args)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", pythonpath_with_this_checkout())
        return pytester.runpytest_subprocess(*args)
