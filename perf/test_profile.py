"""nsys_profile: kernel tables per range from torch.profiler, over every model size x context with
naive attention in fp32 (one warm-up step, three timed steps, one profiled step per cell).

On a GPU the sweep is the course's (contexts 128 to 1024; about 4 minutes on one H100, the cells
that do not fit recorded as OOM). On CPU: the tiny model at contexts 16 and 32, in seconds.
"""

import shlex

import pytest

from cs336_systems.__main__ import build_parser
from cs336_systems.benchmarks.nsys_profile import ATTENTION_RANGES, ProfileConfig, nsys_row, profile_training_step
from cs336_systems.cells import require_some_ran
from cs336_systems.model import size_order
from cs336_systems.pytest_plugin import settings
from cs336_systems.reports import OOM, unmeasured

GPU_CONTEXTS = (128, 256, 512, 1024)
CPU_CONTEXTS = (16, 32)
# The Nsight Systems command shown in the report profiles this cell.
NSYS_CELL = ("xl", 512)
CPU_NSYS_CELL = ("tiny", 32)

pytestmark = pytest.mark.profile


def _contexts(on_gpu: bool) -> tuple[int, ...]:
    return GPU_CONTEXTS if on_gpu else CPU_CONTEXTS


def pytest_generate_tests(metafunc):
    if "context_length" in metafunc.fixturenames:
        metafunc.parametrize("context_length", _contexts(settings(metafunc.config).on_gpu))


def test_kernel_tables(model_size, context_length, device, run_settings, report):
    """Each cell is profiled or runs out of memory, and the smallest size at the shortest context runs:
    where it cannot, no cell of the sweep can."""
    cfg = ProfileConfig(model_size, context_length)
    if not run_settings.on_gpu:
        cfg = ProfileConfig(model_size, context_length, batch_size=2, timed_steps=2)
    rows = profile_training_step(cfg, device)
    for row in rows:
        report("nsys_profile").add(row)
    cell = next(r for r in rows if r["table"] == "cell")
    assert cell["status"] in ("ok", OOM)
    smallest = (min(run_settings.model_sizes, key=size_order), min(_contexts(run_settings.on_gpu)))
    if (model_size, context_length) == smallest:
        require_some_ran([cell], f"the sweep's smallest cell, {model_size} at context {context_length}")
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
