"""nsys_profile: kernel tables per range from torch.profiler, over every model size x context with
naive attention in fp32 (one warm-up step, three timed steps, one profiled step per cell).

On a GPU the sweep is the course's (contexts 128 to 1024; about 4 minutes on one H100, the cells
that do not fit recorded as OOM). On CPU: the tiny model at contexts 16 and 32, in seconds.
"""

import shlex

import pytest

from cs336_systems.__main__ import build_parser
from cs336_systems.benchmarks.nsys_profile import ATTENTION_RANGES, ProfileConfig, nsys_row, profile_training_step
from cs336_systems.pytest_plugin import settings
from cs336_systems.reports import OOM, unmeasured

GPU_CONTEXTS = (128, 256, 512, 1024)
CPU_CONTEXTS = (16, 32)
# The Nsight Systems command shown in the report profiles this cell.
NSYS_CELL = ("xl", 512)
CPU_NSYS_CELL = ("tiny", 32)

pytestmark = pytest.mark.profile


def pytest_generate_tests(metafunc):
    if "context_length" in metafunc.fixturenames:
        on_gpu = settings(metafunc.config).on_gpu
        metafunc.parametrize("context_length", GPU_CONTEXTS if on_gpu else CPU_CONTEXTS)


def test_kernel_tables(model_size, context_length, device, run_settings, report):
    cfg = ProfileConfig(model_size, context_length)
    if not run_settings.on_gpu:
        cfg = ProfileConfig(model_size, context_length, batch_size=2, timed_steps=2)
    rows = profile_training_step(cfg, device)
    for row in rows:
        report("nsys_profile").add(row)
    cell = next(r for r in rows if r["table"] == "cell")
    assert cell["status"] in ("ok", OOM)
    if cell["status"] == "ok":
        assert not unmeasured([cell], *(f"timer_{phase}_ms" for phase in ("forward", "backward", "optimizer", "step")))
        ranges = {r["range"]: r for r in rows if r["table"] == "range"}
        assert {"step", "forward", "backward", "optimizer", *ATTENTION_RANGES} <= set(ranges)
        assert ranges["forward"]["work_ms"] <= ranges["step"]["work_ms"]
        assert {r["range"] for r in rows if r["table"] == "kernel"} == set(ranges)


def test_nsys_command(run_settings, report):
    size, context_length = NSYS_CELL if run_settings.on_gpu else CPU_NSYS_CELL
    row = nsys_row(size, context_length)
    report("nsys_profile").add(row)
    assert isinstance(row["nsys_found"], bool)
    # The command profiles this package's own end-to-end benchmark of the cell, with NVTX ranges.
    words = shlex.split(row["command"])
    assert words[:2] == ["nsys", "profile"] and "--trace=cuda,nvtx" in words
    args = build_parser().parse_args(words[words.index("cs336_systems") + 1:])
    assert (args.command, args.size, args.context, args.attention) == ("e2e", [size], [context_length], "naive")
