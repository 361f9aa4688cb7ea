"""Problem memory_profiling: peak memory of inference and of a training step per precision and
context (allocator snapshots, timelines and largest allocations on CUDA), the analytical memory
model against measurement, the residual stream's size, and what each block saves and its gradients
take (part f).

    rows = memory_profile(MemoryProfileConfig(), "cuda", snapshot_dir=Path("reports/h100"))

Each measuring function returns rows; cs336_systems.reports.memory_profiling answers the written
questions from them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from cs336_systems.accounting.activations import (
    block_saved_bytes,
    predict_peak_memory,
    residual_stream_bytes,
    saved_activation_bytes,
)
from cs336_systems.benchmarks.e2e import DEFAULT_BATCH_SIZE, memory_model_attention
from cs336_systems.benchmarks.harness import autocast, guarded_cell, release_memory, training_step
from cs336_systems.gpus import GIB, MIB
from cs336_systems.lm_training import LEARNING_RATE, adamw, build_model, lm_loss, random_batch
from cs336_systems.model import DEFAULT_SIZE_TABLE, ModelConfig
from cs336_systems.precision import PRECISIONS
from cs336_systems.profiling.memory import (
    active_memory_timeline,
    compact_snapshot,
    downsample_peaks,
    largest_allocations,
    peak_memory_increase,
    record_memory_history,
    saved_tensor_bytes,
    take_snapshot,
    write_snapshot,
)
from cs336_systems.profiling.residuals import block_memory
from cs336_systems.rows import OOM, Row
from cs336_systems.rows.memory_profiling import HANDOUT_MEMORY_CONTEXTS, PROFILED_MODES

# The handout profiles the step with the model's own AdamW (cs336_systems.optimizer): it allocates sqrt(v) one
# parameter at a time, where torch's default foreach AdamW adds a copy of every parameter at its step.
MEMORY_ADAMW = "course"
# A kept snapshot's pickle should stay small enough for a repository. If its stacks make it larger,
# allocations under SNAPSHOT_STACKS_MIN_BYTES lose theirs (memory_viz's timeline shows them, without a stack),
# and past that every stack goes.
SNAPSHOT_BUDGET_BYTES = 8 * MIB
SNAPSHOT_STACKS_MIN_BYTES = MIB


@dataclass(frozen=True)
class MemoryProfileConfig:
    size: str = "xl"
    contexts: tuple[int, ...] = HANDOUT_MEMORY_CONTEXTS
    precisions: tuple[str, ...] = ("fp32", "bf16")
    batch_size: int = DEFAULT_BATCH_SIZE
    attention: str = "naive"
    timeline_points: int = 300  # per plotted cell: enough to show every phase, few enough for the CSV
    top_allocations: int = 5
    # The context whose timelines and per-block residuals the report shows; None: the shortest, where a
    # training step fits if any does. Snapshots are kept for every cell of the first precision.
    detail_context: int | None = None
    size_table: str = DEFAULT_SIZE_TABLE  # the handout whose size table `size` names

    def __post_init__(self):
        unknown = [p for p in self.precisions if p not in PRECISIONS]
        if unknown or not self.precisions:
            raise ValueError(f"unknown precisions {unknown}; choose from {', '.join(PRECISIONS)}")
        if not self.contexts or min(self.contexts) < 1:
            raise ValueError(f"need positive context lengths, got {self.contexts}")
        if self.detail_context is not None and self.detail_context not in self.contexts:
            raise ValueError(f"detail_context {self.detail_context} is not one of the contexts {self.contexts}")
        self.model_config(max(self.contexts))  # validates the size

    def model_config(self, context_length: int) -> ModelConfig:
        return ModelConfig.for_size(self.size, context_length, table=self.size_table)

    @property
    def shown_context(self) -> int:
        return self.detail_context or min(self.contexts)


def memory_profile(cfg: MemoryProfileConfig, device: torch.device | str, snapshot_dir: Path | None = None) -> list[Row]:
    """Peak memory of inference and of a steady-state training step per precision and context, and
    at the shown context what each block saves for backward and what its gradients take (part f).

    On CUDA every cell also records the allocator's history: its snapshot gives the active-memory
    timeline and, for the first precision's cells, the largest allocations and a compacted copy in
    `snapshot_dir` (the pickle pytorch.org/memory_viz opens; cs336_systems.reports.memory_profiling's
    `render_snapshot_timelines` draws them).
    On CPU, peaks come from torch.profiler's memory records and there are no snapshots. Inference cells
    run first, before AdamW exists; each training cell runs one step first, so the measured step has
    AdamW's state. AdamW is the course's (MEMORY_ADAMW).
    """
    device = torch.device(device)
    config = cfg.model_config(max(cfg.contexts))
    release_memory(device)
    model = build_model(config, device, cfg.attention)
    rows = [_residual_row(cfg, model, precision, device) for precision in cfg.precisions]
    optimizer = None
    for mode in PROFILED_MODES:
        if mode == "train_step":
            optimizer = adamw(model, LEARNING_RATE, MEMORY_ADAMW)
        for precision in cfg.precisions:
            for context in cfg.contexts:
                rows += _memory_cell(cfg, mode, precision, context, model, optimizer, device, snapshot_dir)
    del optimizer
    for precision in cfg.precisions:
        rows += _block_rows(cfg, model, precision, device)
    del model
    release_memory(device)
    return rows


def _memory_base(cfg: MemoryProfileConfig, device: torch.device, **fields) -> Row:
    return {"size": cfg.size, "size_table": cfg.size_table, "batch_size": cfg.batch_size, "attention": cfg.attention,
            "device": device.type, **fields}


def _residual_row(cfg: MemoryProfileConfig, model, precision: str, device: torch.device) -> Row:
    """The residual stream's size from the formula against the first block's real output."""
    context = cfg.shown_context
    inputs, _ = random_batch(model.config, cfg.batch_size, context, device)
    captured = {}

    def capture(module, args, output):
        captured.update(shape="x".join(map(str, output.shape)), dtype=str(output.dtype).removeprefix("torch."),
                        measured_bytes=output.numel() * output.element_size())

    handle = model.layers[0].register_forward_hook(capture)
    try:
        with torch.no_grad(), autocast(precision, device):
            model(inputs)
    finally:
        handle.remove()
    config = cfg.model_config(context)
    return _memory_base(cfg, device, table="residual", precision=precision, context_length=context,
                        d_model=config.d_model, computed_bytes=residual_stream_bytes(config, cfg.batch_size, context),
                        **captured)


def _memory_cell(cfg, mode, precision, context, model, optimizer, device, snapshot_dir) -> list[Row]:
    base = _memory_base(cfg, device, mode=mode, precision=precision, context_length=context)
    if mode == "train_step":
        base["adamw"] = MEMORY_ADAMW
    config = cfg.model_config(context)
    # The predictor follows CUDA's autocast rules: on a CPU it only bounds what the cell may need.
    prediction = predict_peak_memory(config, cfg.batch_size, context, precision, memory_model_attention(cfg.attention),
                                     mode, adamw=MEMORY_ADAMW)
    if device.type == "cuda":
        base["predicted_peak_bytes"] = prediction.peak_bytes
    inputs, targets = random_batch(model.config, cfg.batch_size, context, device)
    params = list(model.parameters())

    def inference():
        with torch.no_grad(), autocast(precision, device):
            model(inputs)

    def loss():
        with autocast(precision, device):
            return lm_loss(model(inputs), targets)

    def train():
        training_step(model, optimizer, inputs, targets, precision=precision)

    run = inference if mode == "inference" else train
    shown = context == cfg.shown_context
    kept = precision == cfg.precisions[0]  # the cells whose snapshots and largest allocations the report shows
    snapshot = None

    def measure(columns: Row) -> Row:
        nonlocal snapshot
        if mode == "train_step":
            run()  # the first step creates AdamW's state; the measured one is a steady-state step
        start = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
        if device.type == "cuda":
            with record_memory_history():
                increase, _ = peak_memory_increase(run, device)
                snapshot = take_snapshot()
        else:
            increase, _ = peak_memory_increase(run, device)
        return {**base, "table": "peak", "status": "ok", "start_bytes": start, "peak_increase_bytes": increase,
                "peak_bytes": None if start is None else start + increase, **columns}

    # The model, and AdamW's state once a step has made it, are allocated already: what must still
    # fit is the rest of the predicted peak.
    resident = prediction.parameters_bytes + (prediction.optimizer_state_bytes if optimizer and optimizer.state else 0)
    peak = guarded_cell(device, prediction.peak_bytes - resident, measure,
                        oom=lambda columns: {**base, "table": "peak", **columns},
                        let_go=lambda: model.zero_grad(set_to_none=True))
    if peak["status"] == OOM:
        return [peak]
    if mode == "train_step":
        # None where the forward that counts them runs out of memory.
        peak["measured_saved_bytes"] = guarded_cell(
            device, None, lambda columns: saved_tensor_bytes(loss, exclude=[*params, inputs, targets]),
            oom=lambda columns: None)
        peak["predicted_saved_bytes"] = saved_activation_bytes(config, cfg.batch_size, context, precision,
                                                               cfg.attention, device.type)
    if device.type == "cuda":  # the predictor follows CUDA's autocast rules
        peak.update(predicted_phase=prediction.peak_phase,
                    predicted_parameters_bytes=prediction.parameters_bytes,
                    predicted_gradients_bytes=prediction.gradients_bytes,
                    predicted_optimizer_state_bytes=prediction.optimizer_state_bytes,
                    predicted_activations_bytes=prediction.saved_activations_bytes,
                    predicted_weight_cache_bytes=prediction.autocast_weight_cache_bytes,
                    predicted_transient_bytes=prediction.transient_bytes)
    rows = [peak]
    if snapshot is None:
        return rows
    gpu = torch.cuda.current_device()
    timeline = active_memory_timeline(snapshot, gpu)
    if timeline:
        peak.update(timeline_peak_bytes=max(active for _, active in timeline), trace_events=len(timeline))
    if shown and timeline:
        origin = timeline[0][0]
        rows += [{**base, "table": "timeline", "time_ms": (t - origin) / 1e3, "active_gib": active / GIB}
                 for t, active in downsample_peaks(timeline, cfg.timeline_points)]
    if kept:
        rows += [{**base, "table": "allocation", "rank": rank, "size_mib": a.size_bytes / MIB, "count": a.count,
                  "source": a.source, "innermost": a.innermost}
                 for rank, a in enumerate(largest_allocations(snapshot, cfg.top_allocations, gpu), 1)]
        if snapshot_dir is not None:
            path = snapshot_dir / snapshot_file_name(cfg.size, mode, precision, context)
            rows.append({**base, "table": "snapshot", "file": path.name, **_keep_snapshot(snapshot, gpu, path)})
    return rows


def _keep_snapshot(snapshot: dict, device: int, path: Path) -> Row:
    """Write the snapshot compacted to fit SNAPSHOT_BUDGET_BYTES, dropping the stacks of smaller
    allocations and then all stacks only where it must; returns its size and the stacks it kept."""
    for min_bytes, stacks in ((0, "all"), (SNAPSHOT_STACKS_MIN_BYTES, f">= {SNAPSHOT_STACKS_MIN_BYTES / MIB:.2f} MiB"),
                              (float("inf"), "none")):
        size = write_snapshot(compact_snapshot(snapshot, device, min_frames_bytes=min_bytes), path)
        if size <= SNAPSHOT_BUDGET_BYTES:
            break
    return {"file_bytes": size, "stacks": stacks, "events": len(snapshot["device_traces"][device]),
            "device_index": device}


def snapshot_file_name(size: str, mode: str, precision: str, context: int) -> str:
    """The snapshot's file beside the report: the pickle pytorch.org/memory_viz opens."""
    return f"memory_{size}_{mode}_{precision}_ctx{context}.pickle"


# Part (f) reports the operations behind this many of a block's largest residuals.
TOP_RESIDUAL_OPERATIONS = 5


def _block_rows(cfg: MemoryProfileConfig, model, precision: str, device: torch.device) -> list[Row]:
    """Part (f) at the shown context: each block's residuals and, on CUDA, its gradients' memory."""
    context = cfg.shown_context
    base = _memory_base(cfg, device, precision=precision, context_length=context)
    config = cfg.model_config(context)
    inputs, targets = random_batch(model.config, cfg.batch_size, context, device)

    def loss():
        with autocast(precision, device):
            return lm_loss(model(inputs), targets)

    def measure(columns: Row) -> list[Row]:
        profile = block_memory(model, loss, model.layers, exclude=[inputs, targets])
        predicted = sum(block_saved_bytes(config, cfg.batch_size, context, precision, cfg.attention,
                                          device.type).values())
        rows = [{**base, "table": "block", "status": "ok", "block": b.index, "saved_bytes": b.saved_bytes,
                 "predicted_saved_bytes": predicted, "input_bytes": b.allocated_elsewhere_bytes,
                 "forward_allocated_bytes": b.forward_allocated_bytes,
                 "backward_allocated_bytes": b.backward_allocated_bytes,
                 "gradient_bytes": b.gradient_bytes, "weight_gradient_bytes": b.gradient_parameter_bytes,
                 "parameters": b.parameter_count,
                 "residual_stream_bytes": residual_stream_bytes(config, cfg.batch_size, context)}
                for b in profile.blocks]
        middle = profile.blocks[len(profile.blocks) // 2]
        rows += [{**base, "table": "block_operation", "block": middle.index, "rank": rank, "operation": op,
                  "bytes": size, "share": share}
                 for rank, (op, size, share) in enumerate(middle.top_operations(TOP_RESIDUAL_OPERATIONS), 1)]
        return rows

    model.zero_grad(set_to_none=True)  # the backward allocates the gradients afresh, as after zero_grad
    return guarded_cell(device, None, measure, oom=lambda columns: [{**base, "table": "block", **columns}],
                        let_go=lambda: model.zero_grad(set_to_none=True))
