"""Problem nsys_profile: kernel tables per range (step, forward, backward, optimizer and the naive
attention's scores / softmax / final matmul) of one training step of the course's model (naive
attention, its own AdamW), from torch.profiler, beside the end-to-end timer's phase times; the same
for SDPA with fused AdamW where a run asks for it; and whether Nsight Systems could write a report
on the measuring machine, with the command for the same step.

    rows = profile_training_step(ProfileConfig("small", 512), "cuda")
    profiled_contexts("xl", capacity_bytes)   # the contexts above 128 up to the longest that fits

Each measuring function returns rows; cs336_systems.reports.nsys_profile answers the written questions
from them.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from cs336_systems.accounting.activations import ADAMW_IMPLEMENTATIONS, predict_peak_memory
from cs336_systems.benchmarks.e2e import DEFAULT_BATCH_SIZE, memory_model_attention, model_memory_check
from cs336_systems.benchmarks.harness import guarded_cell, training_step
from cs336_systems.lm_training import LEARNING_RATE, adamw, build_model, random_batch
from cs336_systems.memory_guard import FIT_SHARE
from cs336_systems.model import DEFAULT_SIZE_TABLE, ModelConfig
from cs336_systems.precision import check_precision
from cs336_systems.profiling.kernels import device_profile, kernel_tables, merge_tables
from cs336_systems.profiling.ranges import annotate
from cs336_systems.rows import STEP_PHASES, Row
from cs336_systems.rows.nsys_profile import ATTENTION_RANGES, FORWARD_BACKWARD, MAIN_KERNEL_SHARE, STEP_RANGE
from cs336_systems.timing import STEP_TIMER, timed_step

PROFILED_RANGES = (STEP_RANGE, *STEP_PHASES, *ATTENTION_RANGES)
# Kernel rows kept per range (beside every main non-matmul kernel); the rest become one summary row.
KERNELS_PER_RANGE = 12
# The handout profiles power-of-two contexts above this one, up to the longest that fits.
SHORTEST_EXCLUDED_CONTEXT = 128
CONTEXTS_PER_SIZE = 3
# Nsight Systems' own check: a trivial CUDA program profiled. Starting nsys and its daemon takes seconds; a
# machine where it hangs is one where it cannot profile either.
NSYS_PROBE_TIMEOUT_S = 120
NSYS_PROBE_PROGRAM = "import torch; torch.ones(1, device='cuda').sum().item()"


@dataclass(frozen=True)
class ProfileConfig:
    size: str
    context_length: int
    batch_size: int = DEFAULT_BATCH_SIZE
    precision: str = "fp32"
    attention: str = "naive"
    optimizer: str = "course"  # an AdamW implementation of harness.adamw
    warmup: int = 1  # untimed steps first: one-time costs (cuBLAS handles, AdamW state) stay out
    timed_steps: int = 3  # steps timed as the end-to-end benchmark times them, for comparison
    size_table: str = DEFAULT_SIZE_TABLE  # the handout whose size table `size` names

    def __post_init__(self):
        check_precision(self.precision)
        if self.warmup < 0 or self.timed_steps < 1:
            raise ValueError(f"need warmup >= 0 and timed_steps >= 1, got {self.warmup} and {self.timed_steps}")
        if self.optimizer not in ADAMW_IMPLEMENTATIONS:
            raise ValueError(f"unknown AdamW implementation {self.optimizer!r}; choose one of "
                             f"{', '.join(ADAMW_IMPLEMENTATIONS)}")
        self.model_config()  # validates size and context

    def model_config(self) -> ModelConfig:
        return ModelConfig.for_size(self.size, self.context_length, table=self.size_table)

    def estimate(self):
        """The step's predicted peak memory (cs336_systems.accounting.activations)."""
        return predict_peak_memory(self.model_config(), self.batch_size,
                                   self.context_length, self.precision, memory_model_attention(self.attention),
                                   adamw=self.optimizer)


def profiled_contexts(size: str, capacity_bytes: float, count: int = CONTEXTS_PER_SIZE, **config) -> list[int]:
    """The handout's contexts for `size`: the `count` longest powers of two above 128 whose training step
    is predicted to fit `capacity_bytes` (with the memory guard's margin), then the next one, which is
    expected not to fit (its cell records OOM, showing the longest that fits)."""
    context, fitting = 2 * SHORTEST_EXCLUDED_CONTEXT, []
    while ProfileConfig(size, context, **config).estimate().peak_bytes <= FIT_SHARE * capacity_bytes:
        fitting.append(context)
        context *= 2
    return fitting[-count:] + [context]


def profile_training_step(cfg: ProfileConfig, device: torch.device | str) -> list[Row]:
    """Rows for one cell: the timer's phase means ("cell"), each range's totals ("range") and its
    kernel table ("kernel"); one "cell" row with status OOM when the cell does not fit."""
    device = torch.device(device)
    config = cfg.model_config()
    base: Row = {"size": cfg.size, "context_length": cfg.context_length, "batch_size": cfg.batch_size,
                 "precision": cfg.precision, "attention": cfg.attention, "optimizer": cfg.optimizer,
                 "device": device.type, "d_head": config.d_head, "num_layers": config.num_layers}
    estimate = cfg.estimate()
    if device.type == "cuda":
        base["predicted_peak_bytes"] = estimate.peak_bytes

    def measure(columns: Row) -> list[Row]:
        samples, tables = _timed_then_profiled(cfg, config, device)
        cell = {**base, "table": "cell", "status": "ok", "warmup": cfg.warmup, "timed_steps": cfg.timed_steps,
                "timer": STEP_TIMER, **columns}
        for name, series in [(p, samples[p]) for p in (*STEP_PHASES, "step")]:
            cell[f"timer_{name}_ms"] = statistics.fmean(series)
            cell[f"timer_{name}_std_ms"] = statistics.stdev(series) if len(series) > 1 else 0.0
        rows = [cell]
        for table in tables.values():
            rows += _range_rows(base, table)
        return rows

    return guarded_cell(device, lambda: model_memory_check(estimate, device), measure,
                        oom=lambda columns: [{**base, "table": "cell", **columns}])


def _timed_then_profiled(cfg: ProfileConfig, config: ModelConfig, device: torch.device):
    model = build_model(config, device, cfg.attention)
    optimizer = adamw(model, LEARNING_RATE, cfg.optimizer)
    inputs, targets = random_batch(config, cfg.batch_size, cfg.context_length, device)

    def step(samples: dict[str, list[float]] | None = None) -> None:
        with timed_step(device, samples) as phase:
            training_step(model, optimizer, inputs, targets, precision=cfg.precision, phase=phase)

    for _ in range(cfg.warmup):
        with annotate("warmup"):
            step()
    samples: dict[str, list[float]] = defaultdict(list)
    for i in range(cfg.timed_steps):
        with annotate(f"step_{i}"):
            step(samples)
    with device_profile(device) as profiler:
        with annotate(STEP_RANGE):
            step()
    tables = kernel_tables(profiler.events(), device.type, PROFILED_RANGES)
    tables[FORWARD_BACKWARD] = merge_tables(FORWARD_BACKWARD, [tables["forward"], tables["backward"]])
    return samples, tables


def _range_rows(base: Row, table) -> list[Row]:
    rows = [{**base, "table": "range", "range": table.range, "instances": table.instances,
             "wall_ms": table.wall_us / 1e3, "work_ms": table.work_us / 1e3, "self_work_ms": table.self_work_us / 1e3,
             "matmul_ms": table.matmul_us / 1e3,
             "matmul_share": table.matmul_share, "kernel_calls": table.calls, "distinct_kernels": len(table.kernels)}]
    keep = [rank < KERNELS_PER_RANGE or (not k.matmul and k.share > MAIN_KERNEL_SHARE)
            for rank, k in enumerate(table.kernels)]
    kept = [k for k, keep_it in zip(table.kernels, keep) if keep_it]
    rest = [k for k, keep_it in zip(table.kernels, keep) if not keep_it]
    for rank, k in enumerate(kept, 1):
        rows.append({**base, "table": "kernel", "range": table.range, "rank": rank, "kernel": k.name,
                     "matmul": k.matmul, "calls": k.calls, "calls_per_instance": k.calls / table.instances,
                     "total_ms": k.total_us / 1e3, "share": k.share})
    if rest:
        rows.append({**base, "table": "kernel", "range": table.range, "rank": len(kept) + 1,
                     "kernel": f"({len(rest)} other kernels)", "calls": sum(k.calls for k in rest),
                     "calls_per_instance": sum(k.calls for k in rest) / table.instances,
                     "total_ms": sum(k.total_us for k in rest) / 1e3, "share": sum(k.share for k in rest)})
    return rows


def nsys_command(size: str, context_length: int, attention: str = "naive") -> str:
    """An Nsight Systems command for the same model step, NVTX ranges included (they come from
    `annotate`), through the end-to-end benchmark's command line."""
    return (f"nsys profile --trace=cuda,nvtx --output=nsys_{size}_ctx{context_length} --force-overwrite=true "
            f"python -m cs336_systems e2e --size {size} --context {context_length} --attention {attention} "
            f"--warmup 1 --steps 1 --device cuda")


def nsys_row(size: str, context_length: int) -> Row:
    """Whether Nsight Systems can profile here (`probe_nsys`), and the command that profiles one cell."""
    return {"table": "nsys", "size": size, "context_length": context_length, **probe_nsys(),
            "command": nsys_command(size, context_length)}


def probe_nsys() -> Row:
    """Whether `nsys` is on PATH and, where it is, whether it writes a report of a trivial CUDA program:
    nsys_report is "written", or why not (its last line of output, or the timeout)."""
    nsys = shutil.which("nsys")
    if nsys is None:
        return {"nsys_found": False, "nsys_report": "nsys is not installed"}
    with tempfile.TemporaryDirectory() as directory:
        output = Path(directory) / "probe"
        try:
            result = subprocess.run([nsys, "profile", "--trace=cuda", f"--output={output}", "--force-overwrite=true",
                                     sys.executable, "-c", NSYS_PROBE_PROGRAM],
                                    capture_output=True, text=True, timeout=NSYS_PROBE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return {"nsys_found": True, "nsys_report": f"nsys profile did not finish in {NSYS_PROBE_TIMEOUT_S} s"}
        if result.returncode == 0 and any(Path(directory).glob("probe.*rep")):
            return {"nsys_found": True, "nsys_report": "written"}
        lines = [line for line in (result.stderr + result.stdout).splitlines() if line.strip()]
        return {"nsys_found": True, "nsys_report": f"nsys profile exited {result.returncode}: "
                                                   + (lines[-1].strip() if lines else "no output")}
