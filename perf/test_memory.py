"""memory_profiling and gradient_checkpointing.

memory_profiling: the handout's model and contexts (2026: xl at 128 and 2048; with --size-table 2025,
2.7B at 128, 256 and 512), forward only and a training step, in each --precision (fp32 and bf16 by
default): peaks, allocator snapshots (CUDA; those of the shortest context are kept beside the report
for pytorch.org/memory_viz), active-memory timelines, largest allocations, the analytical model
against them, and part (f): each block's residuals and its gradients' memory.

gradient_checkpointing: xl, batch 4, fp32, SDPA attention at context 2048: peak activation memory
for checkpointing every k blocks and for the optimal nested plans, then the longest context predicted
to fit, checked by one run of the best single-level plan (up to 8,192).

On CPU both run the tiny model in seconds (no snapshots; peaks from torch.profiler's memory records).
"""

import pytest

from cs336_systems.benchmarks.gradient_checkpointing import CheckpointSweepConfig, checkpoint_sweep
from cs336_systems.benchmarks.memory_profiling import HANDOUT_MEMORY_CONTEXTS, MemoryProfileConfig, memory_profile
from cs336_systems.reports import OOM

CPU_MEMORY_CONFIG = dict(size="tiny", contexts=(16, 32), batch_size=2)
# Each handout's memory_profiling model and contexts, by size table.
HANDOUT_MEMORY_CONFIG = {"2026": dict(size="xl", contexts=HANDOUT_MEMORY_CONTEXTS),
                         "2025": dict(size="2.7B", contexts=(128, 256, 512))}
CPU_CHECKPOINT_CONFIG = dict(size="tiny", context_length=32, batch_size=2)

pytestmark = pytest.mark.memory


def test_memory_profile(device, run_settings, report):
    fields = HANDOUT_MEMORY_CONFIG[run_settings.size_table] if run_settings.on_gpu else CPU_MEMORY_CONFIG
    cfg = MemoryProfileConfig(precisions=run_settings.precisions, **fields)
    snapshot_dir = None
    if run_settings.on_gpu:  # beside the report, whose Markdown links them for memory_viz
        snapshot_dir = run_settings.report_dir
        snapshot_dir.mkdir(parents=True, exist_ok=True)
    rows = memory_profile(cfg, device, snapshot_dir=snapshot_dir)
    for row in rows:
        report("memory_profiling").add(row)
    peaks = [r for r in rows if r["table"] == "peak"]
    assert len(peaks) == 2 * len(cfg.contexts) * len(cfg.precisions)
    assert {r["status"] for r in peaks} <= {"ok", OOM}
    residual = [r for r in rows if r["table"] == "residual"]
    assert all(r["measured_bytes"] == r["computed_bytes"] for r in residual), residual
    blocks = [r for r in rows if r["table"] == "block" and r["status"] == "ok"]
    assert blocks and all(r["weight_gradient_bytes"] == 4 * r["parameters"] for r in blocks)
    if run_settings.on_gpu:
        assert any(r["table"] == "timeline" for r in rows) and any(r["table"] == "allocation" for r in rows)
        assert any(r["table"] == "snapshot" for r in rows)


def test_checkpoint_sweep(device, run_settings, report):
    cfg = CheckpointSweepConfig(**({} if run_settings.on_gpu else CPU_CHECKPOINT_CONFIG))
    rows = checkpoint_sweep(cfg, device)
    for row in rows:
        report("gradient_checkpointing").add(row)
    sweep = [r for r in rows if r["table"] == "sweep"]
    assert {r["status"] for r in sweep} <= {"ok", OOM}
    assert any(r["status"] == "ok" for r in sweep)
    if run_settings.on_gpu:
        assert any(r["table"] == "longest" for r in rows)
