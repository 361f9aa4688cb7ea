"""memory_profiling and gradient_checkpointing.

memory_profiling: the handout's model and contexts (2026: xl at 128 and 2048; with --size-table 2025,
2.7B at 128, 256 and 512), forward only and a training step with the course's AdamW, in each
--precision (fp32 and bf16 by default): peaks, allocator snapshots (CUDA; those of the first precision
are kept beside the report for pytorch.org/memory_viz, with their Active Memory Timelines drawn to
PNGs), largest allocations, the analytical model against them, and part (f): each block's residuals
and its gradients' memory.

gradient_checkpointing: xl, batch 4, fp32, the course's block (naive attention) at context 2048: peak
activation memory for checkpointing every k blocks, each block's two sublayers and the optimal nested
plans, then the longest context predicted to fit, checked by one run of the best single-level plan
(up to 4,096).

On CPU both run the tiny model in seconds (no snapshots; peaks from torch.profiler's memory records).
"""

import pytest

from cs336_systems.benchmarks.gradient_checkpointing import CheckpointSweepConfig, checkpoint_sweep
from cs336_systems.benchmarks.memory_profiling import SNAPSHOT_BUDGET_BYTES, MemoryProfileConfig, memory_profile
from cs336_systems.cells import require_some_ran, unmeasured
from cs336_systems.reports.memory_profiling import render_snapshot_timelines, timeline_file_name
from cs336_systems.rows import OOM
from cs336_systems.rows.memory_profiling import HANDOUT_MEMORY_CONTEXTS, PROFILED_MODES

CPU_MEMORY_CONFIG = dict(size="tiny", contexts=(16, 32), batch_size=2)
# Each handout's memory_profiling model and contexts, by size table.
HANDOUT_MEMORY_CONFIG = {"2026": dict(size="xl", contexts=HANDOUT_MEMORY_CONTEXTS),
                         "2025": dict(size="2.7B", contexts=(128, 256, 512))}
CPU_CHECKPOINT_CONFIG = dict(size="tiny", context_length=32, batch_size=2)

pytestmark = pytest.mark.memory


def test_memory_profile(device, run_settings, report):
    fields = HANDOUT_MEMORY_CONFIG[run_settings.size_table] if run_settings.on_gpu else CPU_MEMORY_CONFIG
    cfg = MemoryProfileConfig(precisions=run_settings.precisions, size_table=run_settings.size_table, **fields)
    snapshot_dir = None
    if run_settings.on_gpu:  # beside the report, whose Markdown links them for memory_viz
        snapshot_dir = run_settings.report_dir
        snapshot_dir.mkdir(parents=True, exist_ok=True)
    rows = memory_profile(cfg, device, snapshot_dir=snapshot_dir)
    for row in rows:
        report("memory_profiling").add(row)
    peaks = [r for r in rows if r["table"] == "peak"]
    cells = [(mode, precision, context)
             for mode in PROFILED_MODES for precision in cfg.precisions for context in cfg.contexts]
    assert [(r["mode"], r["precision"], r["context_length"]) for r in peaks] == cells
    assert {r["status"] for r in peaks} <= {"ok", OOM}
    require_some_ran(peaks, "the peak memory cells")
    assert not unmeasured(peaks, "peak_increase_bytes")
    residual = [r for r in rows if r["table"] == "residual"]
    assert [r["precision"] for r in residual] == list(cfg.precisions)
    assert all(r["measured_bytes"] == r["computed_bytes"] for r in residual), residual
    # Part (f): every block of the model, in each precision, unless that precision ran out of memory.
    num_layers = cfg.model_config(cfg.shown_context).num_layers
    for precision in cfg.precisions:
        mine = [r for r in rows if r["table"] == "block" and r["precision"] == precision]
        assert [r["status"] for r in mine] in (["ok"] * num_layers, [OOM]), mine
    blocks = [r for r in rows if r["table"] == "block" and r["status"] == "ok"]
    # Parameters stay fp32 under autocast, so their gradients take 4 bytes each.
    assert blocks and all(r["weight_gradient_bytes"] == 4 * r["parameters"] for r in blocks)
    if run_settings.on_gpu:
        assert any(r["table"] == "timeline" for r in rows) and any(r["table"] == "allocation" for r in rows)
        snapshots = [r for r in rows if r["table"] == "snapshot"]
        # One per cell of the first precision that ran, each small enough to keep, each with its timeline.
        assert len(snapshots) == sum(r["status"] == "ok" and r["precision"] == cfg.precisions[0] for r in peaks)
        assert all(r["file_bytes"] <= SNAPSHOT_BUDGET_BYTES for r in snapshots), snapshots
        images = render_snapshot_timelines(rows, snapshot_dir)
        assert [p.name for p in images] == [timeline_file_name(r["file"]) for r in snapshots]


def test_checkpoint_sweep(device, run_settings, report):
    cfg = CheckpointSweepConfig(size_table=run_settings.size_table,
                                **({} if run_settings.on_gpu else CPU_CHECKPOINT_CONFIG))
    rows = checkpoint_sweep(cfg, device)
    for row in rows:
        report("gradient_checkpointing").add(row)
    sweep = [r for r in rows if r["table"] == "sweep"]
    assert {r["k"] for r in sweep if r["plan_kind"] == "every_k"} >= {1, 2, "none"}
    assert [r["plan_kind"] for r in sweep].count("sublayers") == 1
    levels = ["unlimited" if n is None else n for n in cfg.nested_levels]
    assert [r["levels"] for r in sweep if r["plan_kind"] == "optimal"] == levels
    assert {r["status"] for r in sweep} <= {"ok", OOM}
    require_some_ran(sweep, "the checkpointing plans")
    assert not unmeasured(sweep, "measured_peak_bytes", "step_ms")
    if run_settings.on_gpu:
        longest = [r for r in rows if r["table"] == "longest"]
        assert [r["plan_kind"] for r in longest][1:] == ["optimal", "every_k"] and longest[-1]["k"] == "none"
        assert longest[0]["plan_kind"] in ("every_k", "sublayers")
        assert {r.get("run_status") for r in longest} <= {None, "ok", OOM}
