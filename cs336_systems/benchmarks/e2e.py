"""End-to-end model benchmarks (problems benchmarking_script, benchmarking_mixed_precision and the
whole-model part of torch_compile; cs336_systems.reports.e2e renders their reports).

The model is the course's (COURSE_VARIANT: its naive attention, its own AdamW) unless a cell names
another attention and AdamW; the perf sweep adds SDPA with torch's fused AdamW (FAST_VARIANT).
`benchmark_model` builds the LM, draws random tokens, runs `warmup` untimed steps and `steps`
timed ones, each with one synchronisation, at its end (cs336_systems.timing.StepTimer). In "train"
mode every step is forward, backward and an AdamW step, each phase timed from markers inside the
step, so one loop yields the forward, forward+backward and full-step times (forward is measured with
autograd recording, as in training). "forward" mode times inference (no autograd) alone; "forward_backward" leaves the
optimizer out. The whole step's row also gives the median time the host took to issue a step
(`host_ms`: where it reaches the step's time, the device waited for the host), and on a GPU what its
clock did (cs336_systems.clocks): the share of the timed steps' time the clock was held down by the
power limit or by heat, the median SM clock and the highest temperature.

`cell_cost` says before a cell runs how long its steps' matmuls should take on the device: the cell's
FLOPs (cs336_systems.accounting.flops) at the rate a matmul of the model's own shape runs at there.
"""

from __future__ import annotations

import math
import multiprocessing
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F

from cs336_systems.accounting.activations import (
    ADAMW_IMPLEMENTATIONS,
    MemoryPrediction,
    predict_peak_memory,
    state_bytes,
)
from cs336_systems.accounting.flops import step_flops
from cs336_systems.benchmarks.harness import autocast, guarded_cell, training_step
from cs336_systems.benchmarks.reference_lm import build_reference
from cs336_systems.clocks import ClockSample, clock_columns
from cs336_systems.lm_training import LEARNING_RATE, adamw, build_model, random_batch
from cs336_systems.memory_guard import MemoryCheck, check_memory
from cs336_systems.model import DEFAULT_SIZE_TABLE, ModelConfig
from cs336_systems.precision import check_precision
from cs336_systems.profiling.kernels import device_profile, device_timeline, is_fused_attention, kernel_tables
from cs336_systems.profiling.ranges import annotate
from cs336_systems.rows import BREAKDOWN_TABLE, COURSE_VARIANT, REFERENCE_MODEL, STEP_PHASES, Row
from cs336_systems.rows.e2e import MODE_PHASES, MODEL_MODES, CellCost
from cs336_systems.timing import STEP_TIMER, StepTimer, Timings, tflops, time_fn, timed_step

DEFAULT_WARMUP = 5
DEFAULT_STEPS = 10
DEFAULT_BATCH_SIZE = 4
# Where a mode's cell does not fit, the next smaller mode is measured: it yields a prefix of the phases.
SMALLER_MODE = {"train": "forward_backward", "forward_backward": "forward"}
# Rows of the matmul whose rate `cell_cost` measures (at most; a cell of fewer tokens uses its own): enough for a
# matmul to run near the device's rate, few enough that on one CPU core even the 10B model's (256 x 4608 by
# 4608 x 12288, 29 GFLOP) takes under a second.
RATE_PROBE_TOKENS = 256


@dataclass(frozen=True)
class E2EConfig:
    size: str
    context_length: int
    batch_size: int = DEFAULT_BATCH_SIZE
    mode: str = "train"
    precision: str = "fp32"
    compile: bool = False
    attention: str = COURSE_VARIANT[0]
    optimizer: str = COURSE_VARIANT[1]  # an AdamW implementation of harness.adamw
    warmup: int = DEFAULT_WARMUP
    steps: int = DEFAULT_STEPS
    # The model's maximum context; None means the benchmark's context length.
    model_context_length: int | None = None
    size_table: str = DEFAULT_SIZE_TABLE  # the handout whose size table `size` names

    def __post_init__(self):
        if self.mode not in MODEL_MODES:
            raise ValueError(f"unknown mode {self.mode!r}; choose one of {', '.join(MODEL_MODES)}")
        check_precision(self.precision)
        if self.warmup < 0:
            raise ValueError(f"warm-up steps must be >= 0, got {self.warmup}")
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.batch_size < 1:
            raise ValueError(f"batch size must be >= 1, got {self.batch_size}")
        if self.context_length < 1:
            raise ValueError(f"context length must be >= 1, got {self.context_length}")
        if self.optimizer not in ADAMW_IMPLEMENTATIONS:
            raise ValueError(f"unknown AdamW implementation {self.optimizer!r}; choose one of "
                             f"{', '.join(ADAMW_IMPLEMENTATIONS)}")
        model = self.model_config()  # validates the size
        if self.context_length > model.context_length:
            raise ValueError(f"context length {self.context_length} exceeds the model's context length "
                             f"{model.context_length}")

    def model_config(self) -> ModelConfig:
        return ModelConfig.for_size(self.size, self.model_context_length or self.context_length, table=self.size_table)


def memory_model_attention(attention: str) -> str:
    """The attention the memory model counts for an attention variant: only naive attention (compiled
    or not) keeps N x N scores; the others keep SDPA's O(N) tensors."""
    return "naive" if attention.startswith("naive") else "sdpa"


Step = Callable[[dict[str, list[float]] | None, list[StepTimer] | None], None]


def _workload(cfg: E2EConfig, device: torch.device, reference: bool) -> Step:
    """One step of the cell, as a function: given a dict of lists, it appends each phase's time and
    the whole step's, and given a list, the step's timer (timing.timed_step). The model is the
    torch-native reference LM (compiled whole if `cfg.compile`) when `reference`."""
    config = cfg.model_config()
    if reference:
        model = build_reference(config, device, compile=cfg.compile)
    else:
        model = build_model(config, device, cfg.attention, compile=cfg.compile)
    optimizer = adamw(model, LEARNING_RATE, cfg.optimizer) if cfg.mode == "train" else None
    inputs, targets = random_batch(config, cfg.batch_size, cfg.context_length, device)

    def step(samples: dict[str, list[float]] | None, timers: list[StepTimer] | None = None) -> None:
        with timed_step(device, samples, timers) as phase:
            if cfg.mode == "forward":
                with phase("forward"), torch.no_grad(), autocast(cfg.precision, device):
                    model(inputs)
                return
            training_step(model, optimizer, inputs, targets, precision=cfg.precision, phase=phase,
                          keep_logits=True)

    return step


@dataclass(frozen=True)
class Profile:
    events: list  # torch.profiler's events of the profiled steps
    step_ms: tuple[float, ...]  # each profiled step's time, as the step timer measured it


@dataclass(frozen=True)
class Measured:
    samples: dict[str, list[float]]  # per phase and "step", each timed step's time in ms
    first_step_ms: float  # the first step's wall time
    host_ms: tuple[float, ...] = ()  # how long the host took to issue each timed step
    clocks: tuple[ClockSample, ...] = ()  # NVML's account of each timed step, where it can be read
    profile: Profile | None = None  # the profiled steps after the timed ones, if any


def _measure(cfg: E2EConfig, device: torch.device, reference: bool = False, profiled_steps: int = 0) -> Measured:
    """The timed steps after the warm-up ones; then, given `profiled_steps`, that many more steps under
    torch.profiler."""
    step = _workload(cfg, device, reference)
    samples: dict[str, list[float]] = {phase: [] for phase in ("forward", "backward", "optimizer", "step")}
    timers: list[StepTimer] = []
    first_step_ms = float("nan")
    for i in range(cfg.warmup):
        with annotate("warmup"):
            start = time.perf_counter()
            step(None)
            if i == 0:
                first_step_ms = (time.perf_counter() - start) * 1e3
    for i in range(cfg.steps):
        with annotate(f"step_{i}"):
            start = time.perf_counter()
            step(samples, timers)
            if i == 0 and cfg.warmup == 0:
                first_step_ms = (time.perf_counter() - start) * 1e3
    host_ms = tuple(timer.host_ms for timer in timers)
    clocks = tuple(timer.clock for timer in timers if timer.clock is not None)
    if not profiled_steps:
        return Measured(samples, first_step_ms, host_ms, clocks)
    profiled: dict[str, list[float]] = {}
    with device_profile(device) as profiler:
        for i in range(profiled_steps):
            with annotate(f"profiled_step_{i}"):
                step(profiled)
    return Measured(samples, first_step_ms, host_ms, clocks, Profile(list(profiler.events()), tuple(profiled["step"])))


# The `timer` of breakdown rows.
PROFILER_TIMER = "torch.profiler over steps after the timed ones, kernel times on the device's clock"


def split_breakdown(rows: list[Row]) -> tuple[list[Row], list[Row]]:
    """`benchmark_model`'s rows as (the timed phases' rows, the breakdown's rows)."""
    breakdown = [r for r in rows if r.get("table") == BREAKDOWN_TABLE]
    return [r for r in rows if r.get("table") != BREAKDOWN_TABLE], breakdown


def cell_cost(cfg: E2EConfig, device: torch.device | str, profiled_steps: int = 0) -> CellCost:
    """The cell's steps (warm-up, timed and `profiled_steps`), each its mode's whole step, and the rate of the
    model's feed-forward up-projection on `device` in the cell's precision, over at most RATE_PROBE_TOKENS
    tokens: one call to warm up, then one timed (cs336_systems.timing.time_fn)."""
    device = torch.device(device)
    config = cfg.model_config()
    step = step_flops(config, cfg.batch_size, cfg.context_length, MODE_PHASES[cfg.mode][-1])
    tokens = min(RATE_PROBE_TOKENS, cfg.batch_size * cfg.context_length)
    activations = torch.randn(tokens, config.d_model, device=device)
    weight = torch.randn(config.d_ff, config.d_model, device=device)
    with autocast(cfg.precision, device):
        timings = time_fn(lambda: F.linear(activations, weight), warmup=1, steps=1, device=device)
    flops = 2 * tokens * config.d_model * config.d_ff
    # A matmul too quick for the host's clock: no step of this model will take long.
    rate = flops / (timings.median_ms * 1e-3) if timings.median_ms > 0 else math.inf
    return CellCost(cfg.warmup, cfg.steps, profiled_steps, step, rate)


def breakdown_rows(base: Row, profile: Profile, device_type: str) -> list[Row]:
    """Per phase, its device work per step (kernel time on a GPU, operators' own time on a CPU) split
    into matmuls, fused attention and the rest; then the step: its profiled time, and on a GPU how
    much of it some kernel ran (busy) and how long the device waited for the host (idle)."""
    steps = len(profile.step_ms)
    tables = kernel_tables(profile.events, device_type, ranges=STEP_PHASES)
    rows = []
    for phase in STEP_PHASES:
        if phase not in tables:
            continue
        table = tables[phase]
        attention_us = sum(k.total_us for k in table.kernels if is_fused_attention(k.name))
        rows.append({**base, "table": BREAKDOWN_TABLE, "phase": phase, "status": "ok", "timer": PROFILER_TIMER,
                     "profiled_steps": steps,
                     "work_ms": table.work_us / steps / 1e3, "matmul_ms": table.matmul_us / steps / 1e3,
                     "attention_ms": attention_us / steps / 1e3,
                     "other_ms": (table.work_us - table.matmul_us - attention_us) / steps / 1e3})
    step_ms = statistics.fmean(profile.step_ms)
    step: Row = {**base, "table": BREAKDOWN_TABLE, "phase": "step", "status": "ok", "timer": PROFILER_TIMER,
                 "profiled_steps": steps, "step_ms": step_ms}
    if device_type == "cuda":
        # The profile spans the profiled steps and the host's gaps between them.
        span_us, busy_us = device_timeline(profile.events)
        step["busy_ms"] = busy_us / steps / 1e3
        step["idle_ms"] = step_ms - step["busy_ms"]
        step["span_ms"] = span_us / steps / 1e3
    rows.append(step)
    return rows


def benchmark_in_fresh_process(cfg: E2EConfig, device: torch.device | str,
                               peak_flops: float | None = None) -> list[Row]:
    """`benchmark_model` in a new Python process, so that nothing is warm from earlier work
    (CUDA context, loaded kernels, allocator pool, compile caches): what the warm-up study needs. The
    process is spawned, not forked (a fork starts with this one's state), and gets `cfg` pickled; an
    error in it is raised here."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as fresh:
        return fresh.submit(benchmark_model, cfg, torch.device(device), peak_flops).result()


# The memory model's name for each benchmark mode.
_MEMORY_MODES = {"forward": "inference", "forward_backward": "forward_backward", "train": "train_step"}


def memory_estimate(cfg: E2EConfig):
    """The cell's peak device memory by the closed-form model (cs336_systems.accounting.activations):
    CUDA's autocast rules, the cell's AdamW, eager attention (compiled blocks save what Inductor decides).
    Attention other than naive is modelled as SDPA."""
    return predict_peak_memory(cfg.model_config(), cfg.batch_size, cfg.context_length, cfg.precision,
                               memory_model_attention(cfg.attention), _MEMORY_MODES[cfg.mode], adamw=cfg.optimizer)


def model_memory_check(estimate: MemoryPrediction, device: torch.device) -> MemoryCheck:
    """`check_memory` of a model cell's predicted peak, except where its parameters, gradients and AdamW
    state alone exceed a GPU's whole memory: then the check is against that whole memory, which no
    batch or context fits whatever else is free."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        if state_bytes(estimate) > total:
            return MemoryCheck(estimate.peak_bytes, total)
    return check_memory(estimate.peak_bytes, device)


# Called just before a cell's steps run: the configuration measured (the cell's, or a smaller mode's where the
# cell's did not fit), and the OOM rows of the larger modes it stands in for (none for the cell's own).
Announce = Callable[[E2EConfig, list[Row]], None]


def benchmark_model(cfg: E2EConfig, device: torch.device | str, peak_flops: float | None = None,
                    reference: bool = False, profiled_steps: int = 0, announce: Announce | None = None) -> list[Row]:
    """Rows, one per reported phase: mean / std / median ms and, given a peak, TFLOP/s and MFU.
    `reference` times the torch-native LM of the same architecture instead (benchmarks.reference_lm;
    SDPA attention, compiled whole if `cfg.compile`); its rows say model "torch reference".
    `profiled_steps` more steps under torch.profiler add the rows of table "breakdown" (`breakdown_rows`).

    A configuration whose estimated peak does not fit the free memory is not run, and one that runs
    out of memory stops; both give rows with status "OOM" and the estimate (cs336_systems.memory_guard).
    Then the next smaller mode (SMALLER_MODE) is estimated and measured in its place, down to forward
    only: each phase's row comes from the smallest mode that has it, measured or OOM with that mode's
    estimate, in `measured_mode` (a 10B forward fits where its training step does not). A profiled cell's
    breakdown rows are then those of the mode that ran, after the phases' rows.

    `announce(measured, did_not_fit)`, if given, is called before any mode's steps run (Announce), so that a
    caller can say what runs, and in whose place, before it takes its time.
    """
    rows = _benchmark_mode(cfg, device, peak_flops, reference, profiled_steps,
                           starting=None if announce is None else lambda: announce(cfg, []))
    smaller = SMALLER_MODE.get(cfg.mode)
    if smaller is None or any(r.get("status") == "ok" for r in rows):
        return rows

    def in_place_of_this_mode(measured: E2EConfig, did_not_fit: list[Row]) -> None:
        announce(measured, [*rows, *did_not_fit])

    def in_this_mode(row: Row) -> Row:
        return {**row, "mode": cfg.mode, "measured_mode": row.get("measured_mode", row["mode"])}

    # The breakdown names phases too: kept apart, so that its rows never stand in for the timed ones.
    timed, breakdown = split_breakdown(benchmark_model(replace(cfg, mode=smaller), device, peak_flops, reference,
                                                       profiled_steps,
                                                       None if announce is None else in_place_of_this_mode))
    by_phase = {r["phase"]: in_this_mode(r) for r in timed}
    return [by_phase.get(r["phase"], r) for r in rows] + [in_this_mode(r) for r in breakdown]


def _benchmark_mode(cfg: E2EConfig, device: torch.device | str, peak_flops: float | None, reference: bool,
                    profiled_steps: int, starting: Callable[[], None] | None = None) -> list[Row]:
    device = torch.device(device)
    if reference and cfg.attention != "sdpa":
        raise ValueError(f"the torch reference uses SDPA attention; got attention {cfg.attention!r}")
    base: Row = {k: v for k, v in asdict(cfg).items() if k != "model_context_length"}
    base["device"] = device.type
    if reference:
        base["model"] = REFERENCE_MODEL
    estimate = memory_estimate(cfg)

    def measure(columns: Row) -> list[Row]:
        if starting is not None:
            starting()
        measured = _measure(cfg, device, reference, profiled_steps)
        peak_memory = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        return _measured_rows(cfg, {**base, **columns}, measured, peak_memory, peak_flops, device)

    return guarded_cell(device, lambda: model_memory_check(estimate, device), measure,
                        oom=lambda columns: [{**base, "phase": phase, **columns} for phase in MODE_PHASES[cfg.mode]])


def _measured_rows(cfg: E2EConfig, base: Row, measured: Measured, peak_memory: int | None, peak_flops: float | None,
                   device: torch.device) -> list[Row]:
    """One row per reported phase of a cell that ran, and its breakdown rows if it was profiled."""
    samples = measured.samples
    # Forward and backward are adjacent on the device's timeline: their sum is the interval they span.
    # A train step is the whole step, from the first event to the last.
    samples["forward_backward"] = [f + b for f, b in zip(samples["forward"], samples["backward"])]
    samples["train_step"] = samples["step"]
    rows = []
    for phase in MODE_PHASES[cfg.mode]:
        timings = Timings(tuple(samples[phase]))
        row = {**base, "phase": phase, "status": "ok", **timings.summary(), "timer": STEP_TIMER,
               "first_ms": timings.samples_ms[0],
               "max_ms": max(timings.samples_ms),
               "first_step_ms": measured.first_step_ms,
               "peak_memory_gib": None if peak_memory is None else peak_memory / 2**30}
        if phase == MODE_PHASES[cfg.mode][-1]:
            # The whole step's row: how long the host took to issue a step (the median), and what the
            # GPU's clock did during the timed steps.
            if measured.host_ms:
                row["host_ms"] = statistics.median(measured.host_ms)
            row.update(clock_columns(measured.clocks))
        flops = step_flops(cfg.model_config(), cfg.batch_size, cfg.context_length,
                           "forward" if cfg.mode == "forward" else phase)
        if flops is not None:
            row["tflops"] = tflops(flops, row["median_ms"])
            if peak_flops:
                row["mfu"] = flops / (row["median_ms"] * 1e-3) / peak_flops
        rows.append(row)
    if measured.profile is not None:
        rows += breakdown_rows(base, measured.profile, device.type)
    return rows
