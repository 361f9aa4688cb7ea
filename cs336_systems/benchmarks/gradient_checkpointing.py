"""Problem gradient_checkpointing: peak activation memory of forward + backward under each
checkpoint plan (every k blocks, each block split into its two sublayers, and the memory-optimal
nested plans), against the closed-form model, and the longest context each plan is predicted to fit.

    rows = checkpoint_sweep(CheckpointSweepConfig(), "cuda")

Each measuring function returns rows; cs336_systems.reports.gradient_checkpointing answers the written
questions from them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cs336_systems.accounting.activations import (
    block_saved_bytes,
    head_saved_bytes,
    residual_stream_bytes,
    sublayer_saved_bytes,
    training_transient_bytes,
)
from cs336_systems.benchmarks.e2e import DEFAULT_BATCH_SIZE
from cs336_systems.benchmarks.harness import autocast, guarded_cell, release_memory
from cs336_systems.distributed.checkpointing import (
    apply_checkpointing,
    describe,
    every_k,
    every_sublayer,
    optimal_plan,
    plan_cost,
    remove_checkpointing,
)
from cs336_systems.lm_training import build_model, lm_loss, random_batch
from cs336_systems.model import DEFAULT_SIZE_TABLE, ModelConfig
from cs336_systems.precision import check_precision
from cs336_systems.profiling.memory import peak_memory_increase
from cs336_systems.rows import OOM, Row
from cs336_systems.rows.gradient_checkpointing import HANDOUT_CHECKPOINT_CONTEXT, single_level_rows
from cs336_systems.timing import STEP_TIMER, timed

# Checkpoint every k blocks for these k (None: no checkpointing); k above the depth equals k = depth. Part (b)
# compares the best single level with the next larger (2 blocks) and smaller (a block's two sublayers) units.
CHECKPOINT_KS = (1, 2, 4, 8, None)
# Recomputation levels of the memory-optimal nested plans (None: unlimited, part (a)'s strategy).
NESTED_LEVELS = (2, None)
# A context is predicted to fit when the predicted peak stays under this share of device memory: the
# rest is room for the CUDA context, cuBLAS workspaces, allocator rounding and what the model leaves out.
USABLE_MEMORY_SHARE = 0.9
# Longest context the prediction considers.
MAX_PREDICTED_CONTEXT = 131_072


@dataclass(frozen=True)
class CheckpointSweepConfig:
    size: str = "xl"
    context_length: int = HANDOUT_CHECKPOINT_CONTEXT
    batch_size: int = DEFAULT_BATCH_SIZE
    precision: str = "fp32"
    attention: str = "naive"  # the course's block, with its own attention
    ks: tuple[int | None, ...] = CHECKPOINT_KS
    sublayers: bool = True  # also split every block into its two checkpointed sublayers
    nested_levels: tuple[int | None, ...] = NESTED_LEVELS
    # Longest context run to confirm the predicted longest (CUDA only; longer ones are predicted only:
    # by its FLOPs, an fp32 forward + backward of the 2026 xl at 8,192 tokens x batch 4 with every block
    # recomputed is about half a minute on an H100, and twice the context more than doubles it; naive attention
    # does not fit past 4,096 on 80 GB).
    longest_context_run_limit: int = 4_096
    size_table: str = DEFAULT_SIZE_TABLE  # the handout whose size table `size` names

    def __post_init__(self):
        check_precision(self.precision)
        if any(k is not None and k < 1 for k in self.ks):
            raise ValueError(f"checkpoint every k blocks needs k >= 1, got {self.ks}")
        self.model_config(self.context_length)  # validates the size

    def model_config(self, context_length: int) -> ModelConfig:
        return ModelConfig.for_size(self.size, context_length, table=self.size_table)


@dataclass(frozen=True)
class _Sizes:
    """What the memory model prices plans with, at one context."""
    block: int  # a block's saved activations (a)
    boundary: int  # one residual-stream tensor (b)
    head: int  # what the final norm, LM head and loss keep
    transient: int  # the largest temporary beside them
    sublayers: tuple[int, int]  # (a_attn, a_ffn)


def _sizes(cfg: CheckpointSweepConfig, context: int, device_type: str) -> _Sizes:
    config = cfg.model_config(context)
    args = (config, cfg.batch_size, context, cfg.precision)
    return _Sizes(sum(block_saved_bytes(*args, cfg.attention, device_type).values()),
                  residual_stream_bytes(config, cfg.batch_size, context), sum(head_saved_bytes(*args).values()),
                  training_transient_bytes(*args, cfg.attention), sublayer_saved_bytes(*args, cfg.attention, device_type))


def _sweep_plans(cfg: CheckpointSweepConfig, num_layers: int, sizes: _Sizes) -> list[tuple]:
    """(kind, k, levels, plan) for every k of the sweep, the split blocks and every level count of the
    optimal plan."""
    plans, seen = [], set()
    for k in cfg.ks:
        plan = every_k(num_layers, k)
        if plan not in seen:  # k beyond the depth repeats k = depth
            seen.add(plan)
            plans.append(("every_k", "none" if k is None else min(k, num_layers), None, plan))
    if cfg.sublayers:
        plans.append(("sublayers", None, None, every_sublayer(num_layers)))
    for levels in cfg.nested_levels:
        plans.append(("optimal", None, "unlimited" if levels is None else levels,
                      optimal_plan(num_layers, sizes.block, sizes.boundary, levels)[0]))
    return plans


def _cost(plan, sizes: _Sizes):
    return plan_cost(plan, sizes.block, sizes.boundary, sizes.sublayers)


def checkpoint_sweep(cfg: CheckpointSweepConfig, device: torch.device | str) -> list[Row]:
    """Peak activation memory of forward + backward under each checkpoint plan, with predictions.

    Gradients are allocated by a warm-up step and kept (zeroed, not freed), so a measured peak above
    the start is activations and temporaries only. On CUDA, also the longest context predicted to fit
    for the best single-level plan, the optimal nested plan and no checkpointing, and one run at the
    single-level plan's longest context (up to `longest_context_run_limit`) to check it.
    """
    device = torch.device(device)
    on_gpu = device.type == "cuda"
    model_context = max(cfg.context_length, cfg.longest_context_run_limit if on_gpu else 0)
    config = cfg.model_config(model_context)
    release_memory(device)
    model = build_model(config, device, cfg.attention)
    sizes = _sizes(cfg, cfg.context_length, device.type)
    plans = _sweep_plans(cfg, config.num_layers, sizes)
    base = {"size": cfg.size, "batch_size": cfg.batch_size, "precision": cfg.precision, "attention": cfg.attention,
            "device": device.type, "num_layers": config.num_layers}
    # The warm-up runs the plan with the least memory, so it fits wherever anything does.
    apply_checkpointing(model, every_k(config.num_layers, 1))
    _forward_backward(model, cfg, cfg.context_length, device)
    rows = []
    for kind, k, levels, plan in plans:
        cost = _cost(plan, sizes)
        predicted_peak = cost.peak_bytes + sizes.head + sizes.transient
        measured = _measure_plan(model, plan, cfg, cfg.context_length, device, predicted_peak)
        rows.append({**base, "table": "sweep", "context_length": cfg.context_length, "plan_kind": kind, "k": k,
                     "levels": levels, "plan": describe(plan), "recomputed_blocks": cost.recomputed_blocks,
                     "block_bytes": sizes.block, "boundary_bytes": sizes.boundary,
                     "attention_sublayer_bytes": sizes.sublayers[0], "ffn_sublayer_bytes": sizes.sublayers[1],
                     "head_bytes": sizes.head, "transient_bytes": sizes.transient,
                     "predicted_peak_bytes": predicted_peak, "predicted_kept_bytes": cost.kept_bytes + sizes.head,
                     **measured})
    if on_gpu:
        rows += _longest_context_rows(model, cfg, config.num_layers, rows, base, device)
    remove_checkpointing(model)
    del model
    release_memory(device)
    return rows


def _forward_backward(model, cfg: CheckpointSweepConfig, context: int, device: torch.device, kept: dict | None = None):
    inputs, targets = random_batch(model.config, cfg.batch_size, context, device)
    with autocast(cfg.precision, device):
        loss = lm_loss(model(inputs), targets)
    if kept is not None and device.type == "cuda":
        kept["after_forward"] = torch.cuda.memory_allocated(device)
    loss.backward()
    # Zero the gradients in place: they stay allocated, so the next measurement starts with them.
    model.zero_grad(set_to_none=False)


def _measure_plan(model, plan, cfg: CheckpointSweepConfig, context: int, device: torch.device,
                  predicted_peak_bytes: int) -> Row:
    """A plan's forward + backward: its peak above the start (the model and its gradients), or OOM
    where the predicted peak does not fit what is free, or where it runs out."""
    apply_checkpointing(model, plan)

    def measure(columns: Row) -> Row:
        start = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
        kept: dict = {}
        samples: list[float] = []
        with timed(device, samples):
            increase, _ = peak_memory_increase(lambda: _forward_backward(model, cfg, context, device, kept), device)
        return {"status": "ok", "start_bytes": start, "measured_peak_bytes": increase,
                "measured_kept_bytes": kept["after_forward"] - start if kept else None, "step_ms": samples[0],
                "timer": STEP_TIMER, **columns}

    # Gradients are zeroed, not freed: the next plan starts from them, as this one did.
    return guarded_cell(device, predicted_peak_bytes, measure, oom=lambda columns: columns,
                        let_go=lambda: model.zero_grad(set_to_none=False))


def _predicted_peak(cfg: CheckpointSweepConfig, context: int, plan_for) -> float:
    sizes = _sizes(cfg, context, "cuda")
    return _cost(plan_for(sizes), sizes).peak_bytes + sizes.head + sizes.transient


def _plan_for(row: Row, num_layers: int):
    """sizes -> the plan of a sweep row, at any context."""
    if row["plan_kind"] == "sublayers":
        return lambda sizes: every_sublayer(num_layers)
    return lambda sizes: every_k(num_layers, row["k"])


def _longest_context_rows(model, cfg, num_layers, sweep, base, device) -> list[Row]:
    capacity = torch.cuda.get_device_properties(device).total_memory
    start = torch.cuda.memory_allocated(device)  # parameters, gradients, buffers
    budget = capacity * USABLE_MEMORY_SHARE - start
    single = single_level_rows(sweep)
    best = (min(single, key=lambda r: r["measured_peak_bytes"]) if single else
            min(single_level_rows(sweep, measured=False), key=lambda r: r["predicted_peak_bytes"]))
    candidates = [(best["plan_kind"], best["k"], None, _plan_for(best, num_layers)),
                  ("optimal", None, "unlimited", lambda sizes: optimal_plan(num_layers, sizes.block, sizes.boundary)[0]),
                  ("every_k", "none", None, lambda sizes: every_k(num_layers, None))]
    rows = []
    for index, (kind, k, levels, plan_for) in enumerate(candidates):
        contexts = [cfg.context_length * 2**i for i in range(int(math.log2(MAX_PREDICTED_CONTEXT / cfg.context_length)) + 1)]
        peaks = {n: _predicted_peak(cfg, n, plan_for) for n in contexts}
        fitting = [n for n in contexts if peaks[n] <= budget]
        longest = max(fitting) if fitting else None
        longer = min((n for n in contexts if longest is None or n > longest), default=None)
        row = {**base, "table": "longest", "plan_kind": kind, "k": k, "levels": levels,
               "capacity_bytes": capacity, "start_bytes": start, "usable_share": USABLE_MEMORY_SHARE,
               "predicted_longest_context": longest,
               "predicted_peak_bytes": None if longest is None else peaks[longest] + start,
               "next_context": longer, "next_predicted_peak_bytes": None if longer is None else peaks[longer] + start}
        if index == 0 and longest is not None:  # the best single level is run to check its prediction
            run_context = min(longest, cfg.longest_context_run_limit)
            predicted = _predicted_peak(cfg, run_context, plan_for)
            measured = _measure_plan(model, plan_for(_sizes(cfg, run_context, device.type)), cfg, run_context, device,
                                     predicted)
            row.update({"run_context": run_context, "run_status": measured["status"],
                        "run_peak_bytes": None if measured["status"] == OOM else measured["measured_peak_bytes"] + start,
                        "run_predicted_peak_bytes": predicted + start, "run_step_ms": measured.get("step_ms")})
        rows.append(row)
    return rows
