"""memory_profiling and gradient_checkpointing.

memory_profiling: the 2.7B model at contexts 128, 256 and 512, forward only and a training step, in
each --precision (fp32 and bf16 by default): peaks, allocator snapshots (CUDA), active-memory
timelines, largest allocations, and the analytical model against them. About 3 minutes on one H100.

gradient_checkpointing: xl, batch 4, fp32, SDPA attention at context 1024: peak activation memory
for checkpointing every k blocks and for the optimal nested plans, then the longest context predicted
to fit, checked by one run of the best single-level plan (up to 16,384). About 2 minutes on one H100.

On CPU both run the tiny model in seconds (no snapshots; peaks from torch.profiler's memory records).
"""

import pytest

from cs336_systems.benchmarks.profiling import (
    CheckpointSweepConfig,
    MemoryProfileConfig,
    checkpoint_sweep,
    memory_profile,
)
from cs336_systems.reports import OOM

CPU_MEMORY_CONFIG = dict(size="tiny", contexts=(16, 32), batch_size=2)
CPU_CHECKPOINT_CONFIG = dict(size="tiny", context_length=32, batch_size=2)

pytestmark = pytest.mark.memory


def test_memory_profile(device, run_settings, report, tmp_path):
    fields = {} if run_settings.on_gpu else CPU_MEMORY_CONFIG
    cfg = MemoryProfileConfig(precisions=run_settings.precisions, **fields)
    rows = memory_profile(cfg, device, snapshot_dir=tmp_path if run_settings.on_gpu else None)
    for row in rows:
        report("memory_profiling").add(row)
    peaks = [r for r in rows if r["table"] == "peak"]
    assert len(peaks) == 2 * len(cfg.contexts) * len(cfg.precisions)
    assert {r["status"] for r in peaks} <= {"ok", OOM}
    residual = [r for r in rows if r["table"] == "residual"]
    assert all(r["measured_bytes"] == r["computed_bytes"] for r in residual), residual
    if run_settings.on_gpu:
        assert any(r["table"] == "timeline" for r in rows) and any(r["table"] == "allocation" for r in rows)


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
