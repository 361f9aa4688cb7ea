"""nsys_profile: kernel tables per range from torch.profiler, for one training step of the course's
model (naive attention, its own AdamW) in fp32 (one warm-up step, three timed steps, one profiled step
per cell).

On a GPU, as the handout asks: two sizes (small and xl, or those --model-sizes names), each at the
three longest power-of-two contexts above 128 predicted to fit the GPU, and at the next one, which
records OOM; at each size's longest that fits, also SDPA with fused AdamW (estimated at about a
minute on one H100).
On CPU: the tiny model at contexts 16 and 32, in seconds.
"""

import shlex
from dataclasses import replace

import pytest

from cs336_systems.__main__ import build_parser
from cs336_systems.benchmarks.nsys_profile import (
    ATTENTION_RANGES,
    ProfileConfig,
    nsys_row,
    profile_training_step,
    profiled_contexts,
)
from cs336_systems.cells import require_some_ran, unmeasured
from cs336_systems.model import size_order
from cs336_systems.pytest_plugin import settings
from cs336_systems.rows import COURSE_VARIANT, FAST_VARIANT, OOM

GPU_SIZES = ("small", "xl")
CPU_CONTEXTS = (16, 32)
# The Nsight Systems command shown in the report profiles this cell.
NSYS_CELL = ("xl", 512)
CPU_NSYS_CELL = ("tiny", 32)

pytestmark = pytest.mark.profile


def _cells(config) -> list[tuple[str, int, tuple]]:
    """(size, context, variant) of every cell this run profiles."""
    run = settings(config)
    if not run.on_gpu:
        return [(size, context, variant) for size in run.model_sizes for context in CPU_CONTEXTS
                for variant in (COURSE_VARIANT, FAST_VARIANT) if variant == COURSE_VARIANT or context == CPU_CONTEXTS[-1]]
    import torch

    capacity = torch.cuda.get_device_properties(0).total_memory
    cells = []
    for size in [s for s in run.model_sizes if s in GPU_SIZES] or run.model_sizes:
        *fitting, beyond = profiled_contexts(size, capacity, size_table=run.size_table)
        cells += [(size, context, COURSE_VARIANT) for context in (*fitting, beyond)]
        if fitting:
            cells.append((size, fitting[-1], FAST_VARIANT))
    return cells


def pytest_generate_tests(metafunc):
    if "profiled_cell" in metafunc.fixturenames:
        cells = _cells(metafunc.config)
        metafunc.parametrize("profiled_cell", cells, ids=[f"{s}-{n}-{'+'.join(v)}" for s, n, v in cells])


def test_kernel_tables(profiled_cell, device, run_settings, report, pytestconfig):
    """Each cell is profiled or runs out of memory, and the smallest size at its shortest context runs:
    where it cannot, no cell of the sweep can."""
    size, context_length, (attention, optimizer) = profiled_cell
    cfg = ProfileConfig(size, context_length, attention=attention, optimizer=optimizer,
                        size_table=run_settings.size_table)
    if not run_settings.on_gpu:
        cfg = replace(cfg, batch_size=2, timed_steps=2)
    rows = profile_training_step(cfg, device)
    for row in rows:
        report("nsys_profile").add(row)
    cell = next(r for r in rows if r["table"] == "cell")
    assert cell["status"] in ("ok", OOM)
    assert (cell["attention"], cell["optimizer"]) == (attention, optimizer)
    smallest = min(_cells(pytestconfig), key=lambda c: (size_order(c[0]), c[1]))
    if profiled_cell == smallest:
        require_some_ran([cell], f"the sweep's smallest cell, {size} at context {context_length}")
    if cell["status"] == "ok":
        assert not unmeasured([cell], *(f"timer_{phase}_ms" for phase in ("forward", "backward", "optimizer", "step")))
        ranges = {r["range"]: r for r in rows if r["table"] == "range"}
        assert {"step", "forward", "backward", "optimizer"} <= set(ranges)
        assert (set(ATTENTION_RANGES) <= set(ranges)) == (attention == "naive")
        assert ranges["forward"]["work_ms"] <= ranges["step"]["work_ms"]
        assert {r["range"] for r in rows if r["table"] == "kernel"} == set(ranges)


def test_nsys_command(run_settings, report):
    size, context_length = NSYS_CELL if run_settings.on_gpu else CPU_NSYS_CELL
    row = nsys_row(size, context_length)
    report("nsys_profile").add(row)
    assert isinstance(row["nsys_found"], bool) and row["nsys_report"]
    assert row["nsys_found"] or row["nsys_report"] == "nsys is not installed"
    # The command profiles this package's own end-to-end benchmark of the cell, with NVTX ranges.
    words = shlex.split(row["command"])
    assert words[:2] == ["nsys", "profile"] and "--trace=cuda,nvtx" in words
    args = build_parser().parse_args(words[words.index("cs336_systems") + 1:])
    assert (args.command, args.size, args.context, args.attention) == ("e2e", [size], [context_length], "naive")
