"""Profiling problems: nsys_profile (kernel tables per range), memory_profiling (allocator snapshots,
peak tables, timelines, largest allocations, the analytical memory model against measurement) and
gradient_checkpointing (peak activation memory by checkpoint plan).

Each measuring function returns rows; the renderers below answer the written questions from them.
"""

from __future__ import annotations

import math
import shutil
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from cs336_systems.accounting.activations import (
    block_saved_bytes,
    head_saved_bytes,
    predict_peak_memory,
    residual_stream_bytes,
    saved_activation_bytes,
    state_bytes,
    training_transient_bytes,
)
from cs336_systems.benchmarks.e2e import DEFAULT_BATCH_SIZE, memory_model_attention
from cs336_systems.benchmarks.harness import (
    LEARNING_RATE,
    PRECISIONS,
    adamw,
    autocast,
    build_model,
    lm_loss,
    random_batch,
    release_memory,
    timed_phases,
    training_step,
)
from cs336_systems.gpus import GIB, MIB
from cs336_systems.memory_guard import MemoryCheck, check_memory, is_out_of_memory
from cs336_systems.model import ModelConfig, size_order
from cs336_systems.profiling.checkpointing import (
    apply_checkpointing,
    describe,
    every_k,
    optimal_plan,
    plan_cost,
    remove_checkpointing,
)
from cs336_systems.profiling.kernels import (
    kernel_tables,
    merge_tables,
    profiler_activities,
    short_name,
)
from cs336_systems.profiling.memory import (
    active_memory_timeline,
    downsample_peaks,
    largest_allocations,
    peak_memory_increase,
    record_memory_history,
    saved_tensor_bytes,
    take_snapshot,
)
from cs336_systems.profiling.ranges import annotate
from cs336_systems.profiling.residuals import block_memory
from cs336_systems.reports import OOM, Rendered, Row, markdown_table, mean_std, pivot, plural, renderer, span
from cs336_systems.timing import timed

def _gib(value) -> float | None:
    return None if value is None else value / GIB


def _size(value: float | None) -> str:
    """Bytes as text in the largest binary unit that keeps the number at 1 or more."""
    if value is None:
        return ""
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", 2**10)):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:.0f} B"


def _span(values: list[float], fmt: str = "{:.0%}") -> str:
    return span(values, fmt.format)


# =========================================================================================== nsys_profile

STEP_RANGE = "step"
TRAIN_PHASES = ("forward", "backward", "optimizer")
ATTENTION_RANGES = ("attention/scores", "attention/softmax", "attention/final_matmul")
FORWARD_BACKWARD = "forward+backward"
PROFILED_RANGES = (STEP_RANGE, *TRAIN_PHASES, *ATTENTION_RANGES)
# Softmax over a row of scores: a max, a subtraction, an exp, a sum and a division per score.
SOFTMAX_FLOPS_PER_SCORE = 5
# A non-matmul kernel above this share of forward kernel time counts as a main forward cost.
MAIN_KERNEL_SHARE = 0.02
# Kernel rows kept per range (beside every main non-matmul kernel); the rest become one summary row.
KERNELS_PER_RANGE = 12


@dataclass(frozen=True)
class ProfileConfig:
    size: str
    context_length: int
    batch_size: int = DEFAULT_BATCH_SIZE
    precision: str = "fp32"
    attention: str = "naive"
    warmup: int = 1  # untimed steps first: one-time costs (cuBLAS handles, AdamW state) stay out
    timed_steps: int = 3  # steps timed by the synchronising host clock, for comparison

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise ValueError(f"unknown precision {self.precision!r}; choose one of {', '.join(PRECISIONS)}")
        if self.warmup < 0 or self.timed_steps < 1:
            raise ValueError(f"need warmup >= 0 and timed_steps >= 1, got {self.warmup} and {self.timed_steps}")
        ModelConfig.for_size(self.size, self.context_length)  # validates size and context


def profile_training_step(cfg: ProfileConfig, device: torch.device | str) -> list[Row]:
    """Rows for one cell: the timer's phase means ("cell"), each range's totals ("range") and its
    kernel table ("kernel"); one "cell" row with status OOM when the cell does not fit."""
    device = torch.device(device)
    config = ModelConfig.for_size(cfg.size, cfg.context_length)
    base: Row = {"size": cfg.size, "context_length": cfg.context_length, "batch_size": cfg.batch_size,
                 "precision": cfg.precision, "attention": cfg.attention, "device": device.type,
                 "d_head": config.d_head, "num_layers": config.num_layers}
    estimate = predict_peak_memory(config, cfg.batch_size, cfg.context_length, cfg.precision,
                                   memory_model_attention(cfg.attention), adamw="fused")
    if device.type == "cuda":
        base["predicted_peak_bytes"] = estimate.peak_bytes
        total = torch.cuda.get_device_properties(device).total_memory
        if state_bytes(estimate) > total:
            # Parameters, gradients and AdamW state alone exceed the device: not worth building the model.
            return [{**base, "table": "cell", **MemoryCheck(estimate.peak_bytes, total).oom_columns(predicted=True)}]
    release_memory(device)
    memory = check_memory(estimate.peak_bytes, device)
    if not memory.fits:
        return [{**base, "table": "cell", **memory.oom_columns(predicted=True)}]
    try:
        samples, tables = _timed_then_profiled(cfg, config, device)
    except Exception as error:
        if not is_out_of_memory(error):
            raise
        samples = tables = None
    release_memory(device)
    if samples is None:
        return [{**base, "table": "cell", **memory.oom_columns(predicted=False)}]
    cell = {**base, "table": "cell", "status": "ok", "warmup": cfg.warmup, "timed_steps": cfg.timed_steps,
            **memory.columns()}
    steps = [sum(phase) for phase in zip(*(samples[p] for p in TRAIN_PHASES))]
    for name, series in [*((p, samples[p]) for p in TRAIN_PHASES), ("step", steps)]:
        cell[f"timer_{name}_ms"] = statistics.fmean(series)
        cell[f"timer_{name}_std_ms"] = statistics.stdev(series) if len(series) > 1 else 0.0
    rows = [cell]
    for table in tables.values():
        rows += _range_rows(base, table)
    return rows


def _timed_then_profiled(cfg: ProfileConfig, config: ModelConfig, device: torch.device):
    model = build_model(config, device, cfg.attention)
    optimizer = adamw(model, LEARNING_RATE)
    inputs, targets = random_batch(config, cfg.batch_size, cfg.context_length, device)

    def step(samples: dict[str, list[float]] | None = None) -> None:
        training_step(model, optimizer, inputs, targets, precision=cfg.precision, phase=timed_phases(device, samples))

    for _ in range(cfg.warmup):
        with annotate("warmup"):
            step()
    samples: dict[str, list[float]] = defaultdict(list)
    for i in range(cfg.timed_steps):
        with annotate(f"step_{i}"):
            step(samples)
    with torch.profiler.profile(activities=profiler_activities(device)) as profiler:
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
    """Whether nsys is on PATH here, and the command that profiles one cell with it."""
    return {"table": "nsys", "size": size, "context_length": context_length,
            "nsys_found": shutil.which("nsys") is not None, "command": nsys_command(size, context_length)}


# ------------------------------------------------------------------------------ nsys_profile report

def _nsys_cells(rows: list[Row]) -> dict[tuple, dict]:
    """(size, context) -> {"cell": row, "range": {name: row}, "kernel": {range: [rows by rank]}}."""
    cells: dict[tuple, dict] = {}
    for r in rows:
        if r.get("table") not in ("cell", "range", "kernel"):
            continue
        cell = cells.setdefault((r["size"], r["context_length"]), {"cell": None, "range": {}, "kernel": defaultdict(list)})
        if r["table"] == "cell":
            cell["cell"] = r
        elif r["table"] == "range":
            cell["range"][r["range"]] = r
        else:
            cell["kernel"][r["range"]].append(r)
    for cell in cells.values():
        for kernels in cell["kernel"].values():
            kernels.sort(key=lambda r: r["rank"])
    return dict(sorted(cells.items(), key=lambda item: (size_order(item[0][0]), item[0][1])))


def _measured(cells: dict) -> dict:
    return {key: c for key, c in cells.items() if c["cell"] and c["cell"]["status"] == "ok" and "forward" in c["range"]}


def _forward_time_section(cells: dict, device: str) -> str:
    table, busy, wall = [], [], []
    for (size, context), c in cells.items():
        cell, forward = c["cell"], c["range"]["forward"]
        busy.append(forward["work_ms"] / cell["timer_forward_ms"])
        wall.append(forward["wall_ms"] / cell["timer_forward_ms"])
        table.append({"size": size, "context": context,
                      "timer forward (ms)": mean_std(cell["timer_forward_ms"], cell["timer_forward_std_ms"], ".2f"),
                      "profiled forward range (ms)": forward["wall_ms"], "forward work (ms)": forward["work_ms"],
                      "work / timer": f"{busy[-1]:.0%}"})
    work = "GPU kernel time" if device == "cuda" else "operator CPU time"
    lowest = min(cells.items(), key=lambda item: item[1]["range"]["forward"]["work_ms"] / item[1]["cell"]["timer_forward_ms"])
    gap = ("the GPU sat idle between kernels, waiting for the CPU to launch the next one" if device == "cuda"
           else "Python and the dispatcher ran between operators")
    sample = next(iter(cells.values()))["cell"]
    return ("## (a) Forward time: profiler against the end-to-end timer\n\n"
            f"The timer is the synchronising host clock of the end-to-end benchmark, mean ± std over "
            f"{sample['timed_steps']} steps after {sample['warmup']} warm-up; the profiled step is the next one. "
            f"\"Forward work\" sums the {work} the profiler attributes to the forward range.\n\n" + markdown_table(table) +
            f"\nThe profiled forward range lasted {_span(wall)} of the timer's forward mean (the profiler's own "
            f"overhead is in the range, not in the work), and forward work covered {_span(busy)} of it; the rest "
            f"is time when {gap}. The share is lowest for {lowest[0][0]} at context {lowest[0][1]}.\n")


def _top_kernel_section(cells: dict) -> str:
    table, same = [], 0
    for (size, context), c in cells.items():
        forward, both = c["kernel"]["forward"][0], c["kernel"][FORWARD_BACKWARD][0]
        same += forward["kernel"] == both["kernel"]
        table.append({"size": size, "context": context, "top forward kernel": short_name(forward["kernel"], 70),
                      "share of forward": f"{forward['share']:.0%}",
                      "calls per forward pass": f"{forward['calls_per_instance']:g}",
                      "top over forward+backward": "same" if forward["kernel"] == both["kernel"]
                      else short_name(both["kernel"], 70),
                      "its share": f"{both['share']:.0%}"})
    (size, context), first = next(iter(cells.items()))
    top = first["kernel"]["forward"][0]
    layers = first["cell"]["num_layers"]
    return ("## (b) The top forward kernel\n\n" + markdown_table(table) +
            f"\nIn {same} of {len(cells)} cells the kernel that takes the most forward time is also the top one over "
            f"forward and backward together. Calls count launches: a forward pass of {size} runs 7 Linears per block "
            f"and the LM head, {7 * layers + 1} matmuls, plus 2 batched attention matmuls per block; at context "
            f"{context} the top kernel (`{short_name(top['kernel'], 60)}`) was launched {top['calls_per_instance']:g} "
            f"times per forward pass{', a matmul' if top.get('matmul') else ''}.\n")


def _main_kernels_section(cells: dict) -> str:
    largest: dict[str, tuple] = {}
    for key in cells:  # per size, the longest context measured
        largest[key[0]] = key
    table, seen = [], defaultdict(int)
    for key in largest.values():
        for k in cells[key]["kernel"]["forward"]:
            if k.get("matmul") is False and k["share"] > MAIN_KERNEL_SHARE:
                seen[short_name(k["kernel"], 70)] += 1
                table.append({"size": key[0], "context": key[1], "kernel": short_name(k["kernel"], 70),
                              "share of forward": f"{k['share']:.1%}", "calls": k["calls"]})
    text = (f"## (c) Non-matmul kernels above {MAIN_KERNEL_SHARE:.0%} of forward time\n\nFor each size at the longest "
            "context it ran.\n\n")
    if not table:
        return text + f"No non-matmul kernel reached {MAIN_KERNEL_SHARE:.0%} of forward time in these cells.\n"
    common = sorted(seen.items(), key=lambda item: -item[1])
    return (text + markdown_table(table) + "\nPresent in the most sizes: " +
            ", ".join(f"`{name}` ({count} of {len(largest)})" for name, count in common[:4]) + ".\n")


def _matmul_share_section(cells: dict) -> str:
    rows, forward_shares, step_shares, optimizer_shares = [], [], [], []
    for (size, context), c in cells.items():
        forward, step = c["range"]["forward"]["matmul_share"], c["range"][STEP_RANGE]["matmul_share"]
        forward_shares.append(forward)
        step_shares.append(step)
        optimizer_shares.append(c["range"]["optimizer"]["matmul_share"])
        rows.append({"size": size, "context_length": context, "value": f"{forward:.0%} / {step:.0%}"})
    table = pivot(rows, index=["size"], column="context_length", value="value", label="context")
    lower = sum(s < f for f, s in zip(forward_shares, step_shares))
    trends = []
    for size in dict.fromkeys(size for size, _ in cells):
        contexts = sorted(n for s, n in cells if s == size)
        if len(contexts) > 1:
            first, last = (cells[(size, n)]["range"]["forward"]["matmul_share"] for n in (contexts[0], contexts[-1]))
            trends.append(f"{size} {first:.0%} at context {contexts[0]} to {last:.0%} at {contexts[-1]}")
    text = ("## (d) Matmul share: forward against the full training step\n\nShare of kernel time in matmul kernels, "
            "forward / full step (forward, backward, AdamW).\n\n" + markdown_table(table) +
            f"\nMatmuls take {_span(forward_shares)} of forward time and {_span(step_shares)} of a full step; the full "
            f"step's share is the lower one in {lower} of {len(cells)} cells. The optimizer range's matmul share is "
            f"{_span(optimizer_shares)}: AdamW is elementwise work over every parameter and both moments.")
    if trends:
        text += " With context, the forward share goes from " + "; ".join(trends) + "."
    return text + "\n"


def _attention_section(cells: dict) -> str:
    table, time_ratios, excess = [], [], []
    for (size, context), c in cells.items():
        ranges = c["range"]
        if not all(name in ranges for name in ATTENTION_RANGES):
            continue
        matmul = ranges["attention/scores"]["matmul_ms"] + ranges["attention/final_matmul"]["matmul_ms"]
        softmax = ranges["attention/softmax"]["work_ms"]
        d_head = c["cell"]["d_head"]
        flop_ratio = SOFTMAX_FLOPS_PER_SCORE / (4 * d_head)
        time_ratio = softmax / matmul if matmul else float("nan")
        time_ratios.append(time_ratio)
        excess.append(time_ratio / flop_ratio)
        table.append({"size": size, "context": context, "d_head": d_head, "matmul (ms)": matmul,
                      "softmax (ms)": softmax,
                      "scale + mask (ms)": ranges["attention/scores"]["work_ms"] - ranges["attention/scores"]["matmul_ms"],
                      "softmax / matmul time": f"{time_ratio:.2f}", "FLOP ratio": f"{flop_ratio:.4f}",
                      "time ratio / FLOP ratio": f"{time_ratio / flop_ratio:.0f}x"})
    if not table:
        return "## (e) Softmax against matmul inside attention\n\nNo cell ran the annotated naive attention.\n"
    d_heads = sorted({r["d_head"] for r in table})
    return ("## (e) Softmax against matmul inside attention\n\n"
            f"FLOPs per score element (one query-key pair, one head): q k^T takes 2 d_head multiply-adds' worth "
            f"(2 d_head FLOPs) and P v another 2 d_head, 4 d_head in all; softmax takes about "
            f"{SOFTMAX_FLOPS_PER_SCORE} (max, subtract, exp, sum, divide). The FLOP ratio softmax : matmul is "
            f"{SOFTMAX_FLOPS_PER_SCORE} / (4 d_head), {', '.join(f'{SOFTMAX_FLOPS_PER_SCORE / (4 * d):.2%} for d_head {d}' for d in d_heads)}. "
            "Times come from the attention ranges of the forward pass (matmul kernels of the scores and final "
            "ranges; all kernels of the softmax range).\n\n" + markdown_table(table) +
            f"\nSoftmax takes {_span(time_ratios, '{:.2f}')} of the matmuls' time, {_span(excess, '{:.0f}x')} its FLOP "
            "share." + (" Per score element softmax reads and writes 4-byte values for about 5 FLOPs (under 1 FLOP per "
            "byte), while q k^T does 2 d_head FLOPs per score from q and k tiles it reuses across the row (about "
            f"d_head / 2 FLOPs per byte, {d_heads[0] / 2:.0f} for d_head {d_heads[0]}): softmax is paced by memory "
            "traffic, the matmuls by arithmetic.\n" if min(excess) > 1 else
            " In some cells softmax took no more than its FLOP share of the time.\n"))


def _kernel_tables_section(cells: dict) -> str:
    preferred = [key for key in cells if key[1] == 512] or list(cells)
    key = max(preferred, key=lambda k: (size_order(k[0]), k[1]))
    c = cells[key]
    parts = [f"## Kernel tables: {key[0]} at context {key[1]}\n\nOne profiled training step; the other cells' "
             "tables are in the CSV. Share is of the range's total kernel time; calls per instance divide by the "
             "times the range was entered (the attention ranges once per block).\n"]
    for name in (*TRAIN_PHASES, *ATTENTION_RANGES):
        if name not in c["range"]:
            continue
        r = c["range"][name]
        parts.append(f"### {name}\n\n{plural(r['instances'], 'instance')}, {r['work_ms']:.2f} ms of kernel time, "
                     f"{r['matmul_share']:.0%} in matmuls, {r['kernel_calls']} launches of {r['distinct_kernels']} kernels.\n")
        parts.append(markdown_table([{"kernel": short_name(k["kernel"], 80),
                                      "matmul": {True: "yes", False: "no"}.get(k.get("matmul"), ""),
                                      "calls": k["calls"], "calls per instance": f"{k['calls_per_instance']:g}",
                                      "total (ms)": k["total_ms"], "share": f"{k['share']:.1%}"}
                                     for k in c["kernel"][name]]))
    return "\n".join(parts)


def _nsys_section(rows: list[Row]) -> str:
    found = [r for r in rows if r.get("table") == "nsys"]
    if not found:
        return ""
    r = found[-1]
    state = ("`nsys` was on PATH on the measuring machine. To see the same ranges in Nsight Systems:"
             if r["nsys_found"] else "`nsys` was not on PATH on the measuring machine, so the tables above come "
             "from torch.profiler alone. Where Nsight Systems is installed, the same ranges show up with:")
    return (f"## Nsight Systems\n\n{state}\n\n```\n{r['command']}\n```\n\nThen `nsys stats --report cuda_gpu_kern_sum "
            f"nsys_{r['size']}_ctx{r['context_length']}.nsys-rep` prints the kernel summary; the NVTX ranges "
            "(warmup, step_0, forward, backward, optimizer, attention/...) come from the same annotations.\n")


def _attribution_note(cells: dict) -> str:
    """How kernels were attributed, and the check that none was counted twice, from the rows."""
    if not any("self_work_ms" in r for c in cells.values() for r in c["range"].values()):
        return ("These rows were measured before kernels were attributed once each: a kernel could be counted "
                "under two launching events, so a range's work may exceed its time; a new run replaces them.")
    excess = []
    for (size, context), c in cells.items():
        ranges = {name: r for name, r in c["range"].items() if name != FORWARD_BACKWARD}
        own = sum(r["self_work_ms"] for r in ranges.values())
        if own > ranges[STEP_RANGE]["work_ms"] * (1 + 1e-9):
            excess.append(f"{size} at context {context}")
    return ("Each kernel is attributed once, to the innermost range (record_function/NVTX) open when its launch "
            "call ran, kernel and launch linked by CUPTI correlation id; a range's table also holds the kernels of "
            "the ranges nested in it (forward includes attention/*), each once. "
            + ("In every cell the ranges' own kernel time adds up to no more than the step's."
               if not excess else f"The ranges' own kernel time exceeds the step's in {', '.join(excess)}."))


@renderer("nsys_profile", key=("table", "size", "context_length", "precision", "attention"))
def render_nsys_profile(rows: list[Row]) -> Rendered:
    cells = _nsys_cells(rows)
    measured = _measured(cells)
    parts = []
    if cells:
        sample = next(iter(cells.values()))["cell"] or {}
        device = sample.get("device", "cuda")
        ooms = [f"{s} at context {n}" + (f" (estimate {_size(c['cell']['predicted_peak_bytes'])}"
                                        + ("; not run" if c["cell"].get("oom_predicted") else "") + ")"
                                        if c["cell"].get("predicted_peak_bytes") else "")
                for (s, n), c in cells.items() if c["cell"] and c["cell"]["status"] == OOM]
        parts.append(f"Kernel tables from torch.profiler for one training step (AdamW) per cell: "
                     f"{sample.get('attention', 'naive')} attention, {sample.get('precision', 'fp32')}, batch "
                     f"{sample.get('batch_size')}." + (" " + _attribution_note(measured) if measured else "")
                     + (f" Out of memory: {', '.join(ooms)}." if ooms else "") + "\n")
        if measured:
            parts += [_forward_time_section(measured, device), _top_kernel_section(measured),
                      _main_kernels_section(measured), _matmul_share_section(measured),
                      _attention_section(measured), _kernel_tables_section(measured)]
        else:
            parts.append("No cell ran to completion.\n")
    parts.append(_nsys_section(rows))
    return Rendered("\n".join(parts))


# ======================================================================================= memory_profiling

MEMORY_MODES = ("inference", "train_step")
# The 2026 handout's memory_profiling contexts (for its xl).
HANDOUT_MEMORY_CONTEXTS = (128, 2048)
MODE_LABELS = {"inference": "forward only (inference)", "train_step": "training step"}
# The analytical model should land within this share of a measured peak.
PREDICTION_TOLERANCE = 0.15


@dataclass(frozen=True)
class MemoryProfileConfig:
    size: str = "xl"
    contexts: tuple[int, ...] = HANDOUT_MEMORY_CONTEXTS
    precisions: tuple[str, ...] = ("fp32", "bf16")
    batch_size: int = DEFAULT_BATCH_SIZE
    attention: str = "naive"
    timeline_points: int = 300  # per plotted cell: enough to show every phase, few enough for the CSV
    top_allocations: int = 8
    # The context whose timelines, snapshots, largest allocations and per-block residuals the report
    # shows; None: the shortest, where a training step fits if any does.
    detail_context: int | None = None

    def __post_init__(self):
        unknown = [p for p in self.precisions if p not in PRECISIONS]
        if unknown or not self.precisions:
            raise ValueError(f"unknown precisions {unknown}; choose from {', '.join(PRECISIONS)}")
        if not self.contexts or min(self.contexts) < 1:
            raise ValueError(f"need positive context lengths, got {self.contexts}")
        if self.detail_context is not None and self.detail_context not in self.contexts:
            raise ValueError(f"detail_context {self.detail_context} is not one of the contexts {self.contexts}")
        ModelConfig.for_size(self.size, max(self.contexts))

    @property
    def shown_context(self) -> int:
        return self.detail_context or min(self.contexts)


def memory_profile(cfg: MemoryProfileConfig, device: torch.device | str, snapshot_dir: Path | None = None) -> list[Row]:
    """Peak memory of inference and of a steady-state training step per precision and context, and
    at the shown context what each block saves for backward and what its gradients take (part f).

    On CUDA every cell also records the allocator's history: its snapshot gives the active-memory
    timeline and the largest allocations, and at the shown context it is dumped to `snapshot_dir`
    (the pickle pytorch.org/memory_viz opens). On CPU, peaks come from torch.profiler's memory records
    and there are no snapshots. Inference cells run first, before AdamW exists; each training cell
    runs one step first, so the measured step has AdamW's state. AdamW is fused on CUDA, as in the
    end-to-end benchmarks.
    """
    device = torch.device(device)
    config = ModelConfig.for_size(cfg.size, max(cfg.contexts))
    release_memory(device)
    model = build_model(config, device, cfg.attention)
    rows = [_residual_row(cfg, model, precision, device) for precision in cfg.precisions]
    optimizer = None
    for mode in MEMORY_MODES:
        if mode == "train_step":
            optimizer = adamw(model, LEARNING_RATE)
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
    return {"size": cfg.size, "batch_size": cfg.batch_size, "attention": cfg.attention, "device": device.type, **fields}


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
    config = ModelConfig.for_size(cfg.size, context)
    return _memory_base(cfg, device, table="residual", precision=precision, context_length=context,
                        d_model=config.d_model, computed_bytes=residual_stream_bytes(config, cfg.batch_size, context),
                        **captured)


def _memory_cell(cfg, mode, precision, context, model, optimizer, device, snapshot_dir) -> list[Row]:
    base = _memory_base(cfg, device, mode=mode, precision=precision, context_length=context)
    if mode == "train_step":
        base["adamw"] = "fused" if optimizer.defaults.get("fused") else None
    config = ModelConfig.for_size(cfg.size, context)
    # The predictor follows CUDA's autocast rules: on a CPU it only bounds what the cell may need.
    prediction = predict_peak_memory(config, cfg.batch_size, context, precision, memory_model_attention(cfg.attention),
                                     mode, adamw="fused" if base.get("adamw") == "fused" else "foreach")
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
        training_step(model, optimizer, inputs, targets, precision=precision, phase=timed_phases(device))

    run = inference if mode == "inference" else train
    shown = context == cfg.shown_context
    snapshot_path = (snapshot_dir / snapshot_file_name(cfg.size, mode, precision, context)
                     if snapshot_dir and shown else None)
    release_memory(device)
    # The model, and AdamW's state once a step has made it, are allocated already: what must still
    # fit is the rest of the predicted peak.
    resident = prediction.parameters_bytes + (prediction.optimizer_state_bytes if optimizer and optimizer.state else 0)
    memory = check_memory(prediction.peak_bytes - resident, device)
    if not memory.fits:
        return [{**base, "table": "peak", **memory.oom_columns(predicted=True)}]
    try:
        if mode == "train_step":
            run()  # the first step creates AdamW's state; the measured one is a steady-state step
        start = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
        snapshot = None
        if device.type == "cuda":
            with record_memory_history():
                increase, _ = peak_memory_increase(run, device)
                snapshot = take_snapshot(snapshot_path)
        else:
            increase, _ = peak_memory_increase(run, device)
    except Exception as error:
        if not is_out_of_memory(error):
            raise
        increase = None
    if increase is None:
        model.zero_grad(set_to_none=True)
        release_memory(device)
        return [{**base, "table": "peak", **memory.oom_columns(predicted=False)}]
    peak = {**base, "table": "peak", "status": "ok", "start_bytes": start, "peak_increase_bytes": increase,
            "peak_bytes": None if start is None else start + increase, **memory.columns()}
    if mode == "train_step":
        try:
            peak["measured_saved_bytes"] = saved_tensor_bytes(loss, exclude=[*params, inputs, targets])
        except Exception as error:
            if not is_out_of_memory(error):
                raise
            peak["measured_saved_bytes"] = None
        release_memory(device)
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
    if snapshot_path is not None:
        rows.append({**base, "table": "snapshot", "file": snapshot_path.name})
    timeline = active_memory_timeline(snapshot, torch.cuda.current_device()) if snapshot is not None else []
    if timeline:
        peak.update(timeline_peak_bytes=max(active for _, active in timeline), trace_events=len(timeline))
        if shown:
            origin = timeline[0][0]
            rows += [{**base, "table": "timeline", "time_ms": (t - origin) / 1e3, "active_gib": active / GIB}
                     for t, active in downsample_peaks(timeline, cfg.timeline_points)]
            rows += [{**base, "table": "allocation", "rank": rank, "size_mib": a.size_bytes / MIB, "count": a.count,
                      "source": a.source, "innermost": a.innermost}
                     for rank, a in enumerate(largest_allocations(snapshot, cfg.top_allocations,
                                                                  torch.cuda.current_device()), 1)]
    return rows


def snapshot_file_name(size: str, mode: str, precision: str, context: int) -> str:
    """The snapshot's file beside the report: the pickle pytorch.org/memory_viz opens."""
    return f"memory_{size}_{mode}_{precision}_ctx{context}.pickle"


# Part (f) reports the operations behind this many of a block's largest residuals.
TOP_RESIDUAL_OPERATIONS = 5


def _block_rows(cfg: MemoryProfileConfig, model, precision: str, device: torch.device) -> list[Row]:
    """Part (f) at the shown context: each block's residuals and, on CUDA, its gradients' memory."""
    context = cfg.shown_context
    base = _memory_base(cfg, device, precision=precision, context_length=context)
    config = ModelConfig.for_size(cfg.size, context)
    inputs, targets = random_batch(model.config, cfg.batch_size, context, device)

    def loss():
        with autocast(precision, device):
            return lm_loss(model(inputs), targets)

    model.zero_grad(set_to_none=True)  # the backward allocates the gradients afresh, as after zero_grad
    release_memory(device)
    try:
        profile = block_memory(model, loss, model.layers, exclude=[inputs, targets])
    except torch.OutOfMemoryError:
        profile = None
    model.zero_grad(set_to_none=True)
    release_memory(device)
    if profile is None:
        return [{**base, "table": "block", "status": OOM}]
    predicted = sum(block_saved_bytes(config, cfg.batch_size, context, precision, cfg.attention, device.type).values())
    rows = [{**base, "table": "block", "status": "ok", "block": b.index, "saved_bytes": b.saved_bytes,
             "predicted_saved_bytes": predicted, "input_bytes": b.allocated_elsewhere_bytes,
             "forward_allocated_bytes": b.forward_allocated_bytes, "backward_allocated_bytes": b.backward_allocated_bytes,
             "gradient_bytes": b.gradient_bytes, "weight_gradient_bytes": b.gradient_parameter_bytes,
             "parameters": b.parameter_count, "residual_stream_bytes": residual_stream_bytes(config, cfg.batch_size,
                                                                                                 context)}
            for b in profile.blocks]
    middle = profile.blocks[len(profile.blocks) // 2]
    rows += [{**base, "table": "block_operation", "block": middle.index, "rank": rank, "operation": op,
              "bytes": size, "share": share}
             for rank, (op, size, share) in enumerate(middle.top_operations(TOP_RESIDUAL_OPERATIONS), 1)]
    return rows


# -------------------------------------------------------------------------- memory_profiling report

def _memory_setup(peaks: list[Row]) -> str:
    r = peaks[0]
    contexts = ", ".join(str(c) for c in sorted({p["context_length"] for p in peaks}))
    precisions = ", ".join(dict.fromkeys(p["precision"] for p in peaks))
    # Runs before AdamW was fused here used torch's default, the foreach (multi-tensor) implementation.
    fused = any(p.get("adamw") == "fused" for p in peaks)
    optimizer = "fused AdamW" if fused else "foreach AdamW" if r["device"] == "cuda" else "AdamW"
    return (f"{r['size']} model, batch {r['batch_size']}, {r['attention']} attention, contexts {contexts}, "
            f"precisions {precisions} (bf16 is autocast over fp32 parameters). Forward only runs under "
            f"torch.no_grad(); the training step (forward, backward, {optimizer} step, zero_grad) is measured after "
            "one unmeasured step, so AdamW's state already exists.\n")


def _peak_section(peaks: list[Row]) -> str:
    on_gpu = peaks[0]["device"] == "cuda"
    table = []
    precisions = list(dict.fromkeys(r["precision"] for r in peaks))
    for r in sorted(peaks, key=lambda r: (MEMORY_MODES.index(r["mode"]), precisions.index(r["precision"]),
                                          r["context_length"])):
        entry = {"mode": MODE_LABELS[r["mode"]], "precision": r["precision"], "context": r["context_length"]}
        if r["status"] == OOM:
            entry["peak"] = OOM
            entry["predicted"] = _size(r.get("predicted_peak_bytes"))
        elif on_gpu:
            entry.update({"start": _size(r["start_bytes"]), "peak": _size(r["peak_bytes"]),
                          "timeline peak": _size(r.get("timeline_peak_bytes")),
                          "predicted": _size(r["predicted_peak_bytes"]),
                          "error": f"{r['peak_bytes'] / r['predicted_peak_bytes'] - 1:+.1%}",
                          "predicted peak at": r["predicted_phase"]})
        else:
            entry["peak above start"] = _size(r["peak_increase_bytes"])
        table.append(entry)
    text = ["## Peak memory\n\n" + ("Start is what was allocated before the measured work (parameters, and for "
            "training AdamW's state); peak is torch.cuda.max_memory_allocated; the timeline peak is the highest "
            "point of the snapshot's trace, which should agree. Predicted is "
            "cs336_systems.accounting.activations.predict_peak_memory.\n" if on_gpu else
            "On CPU the peak is the most memory allocated at once above the start, from torch.profiler's memory "
            "records; snapshots and the predictor (which follows CUDA's rules) are for CUDA runs.\n"),
            markdown_table(table)]
    ok = [r for r in peaks if r["status"] == "ok"]
    if on_gpu and ok:
        text.append(_prediction_summary(ok))
    text.append(_growth_summary(ok, "peak_bytes" if on_gpu else "peak_increase_bytes"))
    return "\n".join(text)


def _prediction_summary(ok: list[Row]) -> str:
    errors = [(abs(r["peak_bytes"] / r["predicted_peak_bytes"] - 1), r) for r in ok]
    within = [r for e, r in errors if e <= PREDICTION_TOLERANCE]
    worst_error, worst = max(errors, key=lambda item: item[0])
    text = (f"The model predicts {len(within)} of {len(ok)} measured peaks within {PREDICTION_TOLERANCE:.0%} "
            f"(largest error {worst_error:.1%}: {MODE_LABELS[worst['mode']]}, {worst['precision']}, context "
            f"{worst['context_length']}).")
    for _, r in (item for item in errors if item[0] > PREDICTION_TOLERANCE):
        difference = r["peak_bytes"] - r["predicted_peak_bytes"]
        components = {"parameters": r["predicted_parameters_bytes"], "gradients": r["predicted_gradients_bytes"],
                      "AdamW state": r["predicted_optimizer_state_bytes"],
                      "saved activations": r["predicted_activations_bytes"],
                      "autocast weight copies": r["predicted_weight_cache_bytes"],
                      "transients": r["predicted_transient_bytes"]}
        name, size = min(((n, s) for n, s in components.items() if s), key=lambda item: abs(abs(difference) - item[1]))
        text += (f" {MODE_LABELS[r['mode']]}, {r['precision']}, context {r['context_length']}: measured "
                 f"{_size(r['peak_bytes'])} against {_size(r['predicted_peak_bytes'])} predicted, "
                 f"{_size(abs(difference))} {'more' if difference > 0 else 'less'}; of the predicted components "
                 f"the gap is closest in size to the {name} ({_size(size)}).")
    return text + "\n"


def _growth_summary(ok: list[Row], value: str) -> str:
    lines = []
    for mode in MEMORY_MODES:
        for precision in dict.fromkeys(r["precision"] for r in ok):
            series = sorted((r for r in ok if r["mode"] == mode and r["precision"] == precision),
                            key=lambda r: r["context_length"])
            if len(series) > 1:
                first, last = series[0], series[-1]
                growth = last[value] - first[value]
                lines.append(f"{MODE_LABELS[mode]} in {precision}: {_size(first[value])} at context "
                             f"{first['context_length']} to {_size(last[value])} at {last['context_length']} "
                             f"({'+' if growth >= 0 else '-'}{_size(abs(growth))})")
    precision_pairs = []
    for mode in MEMORY_MODES:
        by_precision = {r["precision"]: r for r in ok if r["mode"] == mode and r["context_length"] == max(
            p["context_length"] for p in ok)}
        if "fp32" in by_precision and "bf16" in by_precision:
            fp32, bf16 = by_precision["fp32"][value], by_precision["bf16"][value]
            precision_pairs.append(f"{MODE_LABELS[mode]}: bf16 the same as fp32" if bf16 == fp32 else
                                   f"{MODE_LABELS[mode]}: bf16 {'above' if bf16 > fp32 else 'below'} fp32 by "
                                   f"{_size(abs(bf16 - fp32))}")
    text = "Growth with context: " + "; ".join(lines) + "." if lines else ""
    if precision_pairs:
        text += (" At the longest context, " + "; ".join(precision_pairs) + ". Autocast keeps fp32 parameters (and "
                 "AdamW state and gradients), adds bf16 copies of the weights, and halves only the activations that "
                 "come out of matmuls; the residual stream and norms stay fp32"
                 + (", and so does softmax (CUDA autocast runs it in fp32)." if ok[0]["device"] == "cuda" else "."))
    return text + "\n" if text else ""


def _saved_section(peaks: list[Row]) -> str:
    rows = [r for r in peaks if r["status"] == "ok" and r.get("measured_saved_bytes") is not None]
    if not rows:
        return ""
    table = [{"precision": r["precision"], "context": r["context_length"],
              "measured": _size(r["measured_saved_bytes"]), "predicted": _size(r["predicted_saved_bytes"]),
              "measured - predicted (bytes)": r["measured_saved_bytes"] - r["predicted_saved_bytes"],
              "error": f"{r['measured_saved_bytes'] / r['predicted_saved_bytes'] - 1:+.2%}"} for r in rows]
    exact = sum(r["measured_saved_bytes"] == r["predicted_saved_bytes"] for r in rows)
    return ("## Saved activations: model against autograd\n\nBytes of the distinct tensors autograd saves for "
            "backward in one forward pass with the loss (saved_tensors_hooks; parameters and inputs excluded), "
            "against cs336_systems.accounting.activations.saved_activation_bytes.\n\n" + markdown_table(table) +
            f"\n{exact} of {len(rows)} cells match to the byte.\n")


def _residual_section(rows: list[Row]) -> str:
    residual = [r for r in rows if r.get("table") == "residual"]
    if not residual:
        return ""
    table = [{"precision": r["precision"], "batch x context x d_model x 4 B": f"{r['batch_size']} x {r['context_length']} x "
              f"{r['d_model']} x 4 = {r['computed_bytes'] / MIB:.2f} MiB", "first block's output": f"{r['shape']} "
              f"{r['dtype']}", "measured (MiB)": r["measured_bytes"] / MIB,
              "match": r["measured_bytes"] == r["computed_bytes"]} for r in residual]
    all_match = all(entry["match"] for entry in table)
    return ("## Residual-stream activation size\n\nOne residual-stream tensor, computed, and measured on the first "
            "block's output with a forward hook.\n\n" + markdown_table(table) +
            ("\nThey agree. It is 4 bytes per value under bf16 autocast too: the embedding output is fp32 and each "
             "block adds its bf16 sublayer outputs to it, which promotes back to fp32.\n" if all_match else
             "\nThey disagree in some cells: see the dtype column.\n"))


def _timeline_figure(rows: list[Row]):
    from matplotlib.figure import Figure

    points = [r for r in rows if r.get("table") == "timeline"]
    if not points:
        return None
    modes = [m for m in MEMORY_MODES if any(p["mode"] == m for p in points)]
    precisions = list(dict.fromkeys(p["precision"] for p in points))
    figure = Figure(figsize=(6 * len(precisions), 3.2 * len(modes)))
    axes = figure.subplots(len(modes), len(precisions), squeeze=False)
    peaks = {(r["mode"], r["precision"], r["context_length"]): r for r in rows if r.get("table") == "peak"}
    for i, mode in enumerate(modes):
        for j, precision in enumerate(precisions):
            ax = axes[i][j]
            series = [p for p in points if p["mode"] == mode and p["precision"] == precision]
            if not series:
                ax.set_visible(False)
                continue
            ax.plot([p["time_ms"] for p in series], [p["active_gib"] for p in series], color="tab:blue", lw=1)
            peak = peaks.get((mode, precision, series[0]["context_length"]))
            if peak and peak.get("predicted_peak_bytes"):
                ax.axhline(_gib(peak["predicted_peak_bytes"]), color="tab:red", ls="--", lw=1, label="predicted peak")
                ax.legend(loc="lower right", fontsize=8)
            ax.set_title(f"{MODE_LABELS[mode]}, {precision}, context {series[0]['context_length']}", fontsize=10)
            ax.set_xlabel("time (ms)")
            ax.set_ylabel("active memory (GiB)")
            ax.grid(alpha=0.3)
    figure.tight_layout()
    return figure


def _allocation_section(rows: list[Row]) -> str:
    allocations = [r for r in rows if r.get("table") == "allocation"]
    if not allocations:
        return ""
    parts = ["## Largest allocations\n\nThe largest blocks allocated in each measured window, with the innermost "
             "line of this package that asked for them and the innermost Python frame of all (the snapshots hold "
             "every allocation's whole stack); allocations of one size from one line are counted together.\n"]
    for mode in MEMORY_MODES:
        for precision in dict.fromkeys(r["precision"] for r in allocations):
            cell = sorted((r for r in allocations if r["mode"] == mode and r["precision"] == precision),
                          key=lambda r: r["rank"])
            if cell:
                parts.append(f"### {MODE_LABELS[mode]}, {precision}, context {cell[0]['context_length']}\n")
                parts.append(markdown_table([{"size (MiB)": r["size_mib"], "count": r["count"], "source": r["source"],
                                              "innermost frame": r["innermost"]} for r in cell]))
                top = cell[0]
                parts.append(f"The largest, {top['size_mib']:.1f} MiB x {top['count']}, comes from `{top['source']}`.\n")
    return "\n".join(parts)


@renderer("memory_profiling")
def render_memory_profiling(rows: list[Row]) -> Rendered:
    peaks = [r for r in rows if r.get("table") == "peak"]
    if not peaks:
        return Rendered("_no rows_\n")
    parts = [_memory_setup(peaks), _peak_section(peaks), _saved_section(peaks), _residual_section(rows)]
    figures = {}
    figure = _timeline_figure(rows)
    if figure is not None:
        figures["memory_timeline.png"] = figure
        parts.append("## Active memory over one step\n\nFrom each snapshot's allocator trace (allocations and "
                     "completed frees); each plotted point is the highest of its run of events."
                     + _snapshot_note(rows) + "\n\n![active memory](memory_timeline.png)\n")
    parts += [_allocation_section(rows), _block_section(rows)]
    return Rendered("\n".join(p for p in parts if p), figures)


def _snapshot_note(rows: list[Row]) -> str:
    files = [r for r in rows if r.get("table") == "snapshot"]
    if not files:
        return ""
    return (" The snapshots open in pytorch.org/memory_viz (its Active Memory Timeline, with every allocation's "
            "stack): " + ", ".join(f"[{r['file']}]({r['file']})" for r in files) + ".")


def _block_section(rows: list[Row]) -> str:
    """Part (f): residuals per TransformerBlock, the operations behind them, gradients in backward."""
    blocks = [r for r in rows if r.get("table") == "block" and r.get("status") == "ok"]
    if not blocks:
        failed = [r for r in rows if r.get("table") == "block"]
        return ("## (f) Residuals and gradients per TransformerBlock\n\nOut of memory.\n" if failed else "")
    parts = ["## (f) Residuals and gradients per TransformerBlock\n\n"
             "One forward and backward at the shown context after zero_grad(set_to_none=True). A block's residuals "
             "are the distinct storages autograd saved while its forward ran (saved-tensor hooks); the operation "
             "behind each is the aten call that allocated it (a dispatch mode under autograd; its input, the "
             "residual stream, was allocated by the previous block's last addition). In backward, on CUDA, "
             "memory_allocated is read when autograd reaches the block and once the gradient of its input is "
             "computed; that change plus the residuals the block freed is what its gradients took.\n"]
    for precision in dict.fromkeys(r["precision"] for r in blocks):
        mine = sorted((r for r in blocks if r["precision"] == precision), key=lambda r: r["block"])
        parts.append(_block_precision_text(precision, mine, [r for r in rows if r.get("table") == "block_operation"
                                                             and r["precision"] == precision]))
    return "\n".join(parts)


def _block_precision_text(precision: str, blocks: list[Row], operations: list[Row]) -> str:
    r0 = blocks[0]
    saved = [r["saved_bytes"] for r in blocks]
    text = [f"### {precision}, context {r0['context_length']}\n",
            f"Each of the {len(blocks)} blocks saves {_span_bytes(saved)} for backward "
            f"({'all alike' if len(set(saved)) == 1 else 'blocks differ'}); the accounting model "
            f"(accounting.activations.block_saved_bytes) gives {_size(r0['predicted_saved_bytes'])}"
            + (", to the byte." if all(s == r0["predicted_saved_bytes"] for s in saved) else
               f", {saved[len(saved) // 2] - r0['predicted_saved_bytes']:+,} bytes off in the middle block.")
            + f" Of that, {_size(blocks[len(blocks) // 2]['input_bytes'])} is the block's input (one residual-stream "
            f"tensor is {_size(r0['residual_stream_bytes'])}).\n"]
    if operations:
        middle = operations[0]["block"]
        top = sorted(operations, key=lambda r: r["rank"])
        text.append(f"The {len(top)} operations that allocated the most of block {middle}'s residuals, which "
                    f"together hold {sum(r['share'] for r in top):.1%} of them:\n")
        text.append(markdown_table([{"operation": r["operation"], "residuals": _size(r["bytes"]),
                                     "share": f"{r['share']:.1%}"} for r in top]))
    expected = 4 * r0["parameters"]
    weight = [r["weight_gradient_bytes"] for r in blocks]
    text.append(f"Gradients: each block has {r0['parameters']:,} parameters, so its weight gradients should take "
                f"4 x {r0['parameters']:,} = {_size(expected)} (fp32 whatever the autocast precision); the "
                f".grad storages found after each block's backward take {_span_bytes(weight)}"
                + (", as expected." if all(w == expected for w in weight) else ", not what was expected."))
    measured = [r for r in blocks if r.get("gradient_bytes") is not None]
    if measured:
        gradients = [r["gradient_bytes"] for r in measured]
        middle = measured[len(measured) // 2]
        extra = middle["gradient_bytes"] - expected
        text.append(f" Read from the allocator: over block {middle['block']}'s backward memory changed by "
                    f"{_signed_size(middle['backward_allocated_bytes'])} while it freed its "
                    f"{_size(middle['saved_bytes'])} of residuals, so the new gradients took "
                    f"{_size(middle['gradient_bytes'])} ({_span_bytes(gradients)} over the blocks): the weight "
                    f"gradients and {_signed_size(extra)} more"
                    + (", one residual-stream tensor: the gradient of the block's input, allocated while that of "
                       "its output is still held."
                       if abs(extra - r0["residual_stream_bytes"]) <= 0.01 * r0["residual_stream_bytes"] else "."))
        forward = [r["forward_allocated_bytes"] for r in measured if r.get("forward_allocated_bytes") is not None]
        if forward:
            text.append(f" Over each block's forward allocated memory grew by {_span_bytes(forward)}: what it "
                        "allocated and keeps for backward, and its output, which stands in for the input it saved "
                        "but did not allocate.")
    return "\n".join(text) + "\n"


def _span_bytes(values: list[float]) -> str:
    low, high = min(values), max(values)
    return _size(low) if low == high else f"{_size(low)} to {_size(high)}"


def _signed_size(value: float) -> str:
    return ("-" if value < 0 else "+") + _size(abs(value))


# ================================================================================= gradient_checkpointing

# The 2026 handout's gradient_checkpointing (b): xl at batch 4 and this sequence length.
HANDOUT_CHECKPOINT_CONTEXT = 2048
# Checkpoint every k blocks for these k (None: no checkpointing); k above the depth equals k = depth.
CHECKPOINT_KS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 48, None)
# Recomputation levels of the memory-optimal nested plans (None: unlimited).
NESTED_LEVELS = (1, 2, 3, None)
# A context is predicted to fit when the predicted peak stays under this share of device memory: the
# rest is room for the CUDA context, cuBLAS workspaces, allocator rounding and what the model leaves out.
USABLE_MEMORY_SHARE = 0.9
# Longest context the prediction considers.
MAX_PREDICTED_CONTEXT = 131_072
Y_TICK_SUBS = (1.0, 1.5, 2.0, 3.0, 5.0, 7.0)


@dataclass(frozen=True)
class CheckpointSweepConfig:
    size: str = "xl"
    context_length: int = HANDOUT_CHECKPOINT_CONTEXT
    batch_size: int = DEFAULT_BATCH_SIZE
    precision: str = "fp32"
    attention: str = "sdpa"
    ks: tuple[int | None, ...] = CHECKPOINT_KS
    nested_levels: tuple[int | None, ...] = NESTED_LEVELS
    # Longest context run to confirm the predicted longest (CUDA only; longer ones are predicted only:
    # by its FLOPs, an fp32 forward + backward of the 2026 xl at 8,192 tokens x batch 4 with every block
    # recomputed is about half a minute on an H100, and twice the context more than doubles it).
    longest_context_run_limit: int = 8_192

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise ValueError(f"unknown precision {self.precision!r}; choose one of {', '.join(PRECISIONS)}")
        if any(k is not None and k < 1 for k in self.ks):
            raise ValueError(f"checkpoint every k blocks needs k >= 1, got {self.ks}")
        ModelConfig.for_size(self.size, self.context_length)


def _block_sizes(cfg: CheckpointSweepConfig, context: int, device_type: str) -> tuple[int, int, int, int]:
    """(block, boundary, head, transient) bytes: one block's saved activations, one residual-stream
    tensor, what the final norm, LM head and loss keep, and the largest temporary beside them."""
    config = ModelConfig.for_size(cfg.size, context)
    block = sum(block_saved_bytes(config, cfg.batch_size, context, cfg.precision, cfg.attention, device_type).values())
    head = sum(head_saved_bytes(config, cfg.batch_size, context, cfg.precision).values())
    transient = training_transient_bytes(config, cfg.batch_size, context, cfg.precision, cfg.attention)
    return block, residual_stream_bytes(config, cfg.batch_size, context), head, transient


def _sweep_plans(cfg: CheckpointSweepConfig, num_layers: int, block: int, boundary: int) -> list[tuple]:
    """(kind, k, levels, plan) for every k of the sweep and every level count of the optimal plan."""
    plans, seen = [], set()
    for k in cfg.ks:
        plan = every_k(num_layers, k)
        if plan not in seen:  # k beyond the depth repeats k = depth
            seen.add(plan)
            plans.append(("every_k", "none" if k is None else min(k, num_layers), None, plan))
    for levels in cfg.nested_levels:
        plans.append(("optimal", None, "unlimited" if levels is None else levels,
                      optimal_plan(num_layers, block, boundary, levels)[0]))
    return plans


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
    config = ModelConfig.for_size(cfg.size, model_context)
    release_memory(device)
    model = build_model(config, device, cfg.attention)
    block, boundary, head, transient = _block_sizes(cfg, cfg.context_length, device.type)
    plans = _sweep_plans(cfg, config.num_layers, block, boundary)
    base = {"size": cfg.size, "batch_size": cfg.batch_size, "precision": cfg.precision, "attention": cfg.attention,
            "device": device.type, "num_layers": config.num_layers}
    # The warm-up runs the plan with the least memory, so it fits wherever anything does.
    apply_checkpointing(model, every_k(config.num_layers, 1))
    _forward_backward(model, cfg, cfg.context_length, device)
    rows = []
    for kind, k, levels, plan in plans:
        cost = plan_cost(plan, block, boundary)
        predicted_peak = cost.peak_bytes + head + transient
        measured = _measure_plan(model, plan, cfg, cfg.context_length, device, predicted_peak)
        rows.append({**base, "table": "sweep", "context_length": cfg.context_length, "plan_kind": kind, "k": k,
                     "levels": levels, "plan": describe(plan), "recomputed_blocks": cost.recomputed_blocks,
                     "block_bytes": block, "boundary_bytes": boundary, "head_bytes": head,
                     "transient_bytes": transient, "predicted_peak_bytes": predicted_peak,
                     "predicted_kept_bytes": cost.kept_bytes + head,
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
    release_memory(device)
    memory = check_memory(predicted_peak_bytes, device)
    if not memory.fits:
        return memory.oom_columns(predicted=True)
    start = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    kept: dict = {}
    samples: list[float] = []
    try:
        with timed(device, samples):
            increase, _ = peak_memory_increase(lambda: _forward_backward(model, cfg, context, device, kept), device)
    except Exception as error:
        if not is_out_of_memory(error):
            raise
        increase = None
    if increase is None:
        model.zero_grad(set_to_none=False)
        release_memory(device)
        return memory.oom_columns(predicted=False)
    return {"status": "ok", "start_bytes": start, "measured_peak_bytes": increase,
            "measured_kept_bytes": kept["after_forward"] - start if kept else None, "step_ms": samples[0],
            **memory.columns()}


def _predicted_peak(cfg: CheckpointSweepConfig, context: int, plan_for) -> float:
    block, boundary, head, transient = _block_sizes(cfg, context, "cuda")
    return plan_cost(plan_for(block, boundary), block, boundary).peak_bytes + head + transient


def _longest_context_rows(model, cfg, num_layers, sweep, base, device) -> list[Row]:
    capacity = torch.cuda.get_device_properties(device).total_memory
    start = torch.cuda.memory_allocated(device)  # parameters, gradients, buffers
    budget = capacity * USABLE_MEMORY_SHARE - start
    single = [r for r in sweep if r["plan_kind"] == "every_k" and r["k"] != "none" and r["status"] == "ok"]
    best_k = (min(single, key=lambda r: r["measured_peak_bytes"])["k"] if single else
              min((r for r in sweep if r["plan_kind"] == "every_k" and r["k"] != "none"),
                  key=lambda r: r["predicted_peak_bytes"])["k"])
    candidates = [("every_k", best_k, None, lambda a, b: every_k(num_layers, best_k)),
                  ("optimal", None, "unlimited", lambda a, b: optimal_plan(num_layers, a, b)[0]),
                  ("every_k", "none", None, lambda a, b: every_k(num_layers, None))]
    rows = []
    for kind, k, levels, plan_for in candidates:
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
        if kind == "every_k" and k == best_k and longest is not None:
            run_context = min(longest, cfg.longest_context_run_limit)
            measured = _measure_plan(model, every_k(num_layers, best_k), cfg, run_context, device,
                                     _predicted_peak(cfg, run_context, plan_for))
            row.update({"run_context": run_context, "run_status": measured["status"],
                        "run_peak_bytes": None if measured["status"] == OOM else measured["measured_peak_bytes"] + start,
                        "run_predicted_peak_bytes": _predicted_peak(cfg, run_context, plan_for) + start,
                        "run_step_ms": measured.get("step_ms")})
        rows.append(row)
    return rows


# -------------------------------------------------------------------- gradient_checkpointing report

def _levels(levels: int | str) -> str:
    return f"{levels} levels" if levels == "unlimited" else plural(levels, "level")


def _plan_label(r: Row) -> str:
    if r["plan_kind"] == "every_k":
        return "no checkpointing" if r["k"] == "none" else f"every {r['k']} block{'s' if r['k'] != 1 else ''}"
    return f"optimal nested, {r['levels']} recomputation level{'s' if r['levels'] != 1 else ''}"


def _sweep_figure(sweep: list[Row], num_layers: int):
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    single = sorted((r for r in sweep if r["plan_kind"] == "every_k" and r["k"] != "none"), key=lambda r: r["k"])
    measured = [r for r in single if r["status"] == "ok"]
    lines = [r for r in sweep if r["status"] == "ok" and (r["plan_kind"] == "optimal" or r["k"] == "none")]
    largest = max([r["predicted_peak_bytes"] for r in single] + [r["measured_peak_bytes"] for r in measured + lines])
    scale, unit = (GIB, "GiB") if largest >= GIB else (MIB, "MiB")
    figure = Figure(figsize=(7, 4))
    ax = figure.subplots()
    ax.plot([r["k"] for r in single], [r["predicted_peak_bytes"] / scale for r in single], "o--", color="tab:gray",
            label="predicted (every k)")
    if measured:
        ax.plot([r["k"] for r in measured], [r["measured_peak_bytes"] / scale for r in measured], "o-",
                color="tab:blue", label="measured (every k)")
    colors = iter(["tab:green", "tab:purple", "tab:orange", "tab:red", "tab:brown", "tab:olive"])
    for r in lines:
        ax.axhline(r["measured_peak_bytes"] / scale, ls=":", color=next(colors, "black"), label=_plan_label(r))
    ax.axvline(math.sqrt(num_layers), color="black", lw=0.8, alpha=0.5, label=f"sqrt(L) = {math.sqrt(num_layers):.1f}")
    ax.set_xscale("log", base=2)
    ax.set_xticks([r["k"] for r in single], [str(r["k"]) for r in single])
    ax.set_yscale("log")
    # Labels at 1, 1.5, 2, 3, 5 and 7 of each decade: a label in every stretch of a plot that spans one
    # or two decades, none crowding the next (every minor tick labelled overlapped between 6 and 10).
    ax.yaxis.set_major_locator(LogLocator(subs=Y_TICK_SUBS))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("checkpoint every k blocks")
    ax.set_ylabel(f"peak activation memory ({unit})")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    figure.tight_layout()
    return figure


def _sweep_section(sweep: list[Row]) -> str:
    r0 = sweep[0]
    on_gpu = r0["device"] == "cuda"
    a, b, layers = r0["block_bytes"], r0["boundary_bytes"], r0["num_layers"]
    table = [{"plan": _plan_label(r), "recomputed blocks": r["recomputed_blocks"],
              "kept after forward": _size(r.get("measured_kept_bytes")) if r["status"] == "ok" else OOM,
              "predicted kept": _size(r["predicted_kept_bytes"]),
              "peak": _size(r["measured_peak_bytes"]) if r["status"] == "ok" else OOM,
              "predicted peak": _size(r["predicted_peak_bytes"]),
              "step (ms)": r.get("step_ms") if r["status"] == "ok" else None} for r in sweep]
    parts = [f"## Peak activation memory by checkpoint plan\n\n{r0['size']} ({layers} blocks), batch "
             f"{r0['batch_size']}, context {r0['context_length']}, {r0['precision']}, {r0['attention']} attention; one "
             "forward + backward per plan (torch.utils.checkpoint, non-reentrant). Gradients were allocated by a "
             "warm-up step and kept, so the peak above the start is activations and temporaries. The model "
             f"(accounting.activations): a block keeps a = {_size(a)}, a checkpointed group keeps its input "
             f"b = {_size(b)} (one residual-stream tensor), the head and loss keep {_size(r0['head_bytes'])}, and the "
             f"largest temporary (accounting.activations.training_transient_bytes) is {_size(r0['transient_bytes'])}; "
             "predicted peak = the plan's peak under the model (profiling.checkpointing.plan_cost) + head + "
             "temporary." +
             ("" if on_gpu else " On CPU, peaks come from torch.profiler's memory records and step times include "
              "the profiler's overhead.") + "\n", markdown_table(table)]
    single = [r for r in sweep if r["plan_kind"] == "every_k" and r["k"] != "none" and r["status"] == "ok"]
    if single:
        best = min(single, key=lambda r: r["measured_peak_bytes"])
        predicted_best = min((r for r in sweep if r["plan_kind"] == "every_k" and r["k"] != "none"),
                             key=lambda r: r["predicted_peak_bytes"])
        rule, refined = math.sqrt(layers), math.sqrt(layers * b / a)
        closer = "sqrt(L b / a)" if abs(best["k"] - refined) < abs(best["k"] - rule) else "sqrt(L)"
        text = (f"Best single level: every {plural(best['k'], 'block')}, {_size(best['measured_peak_bytes'])} "
                f"(the model's "
                f"best: every {predicted_best['k']}). The sqrt(L) rule gives k = sqrt({layers}) = {rule:.1f}; it "
                "assumes a block keeps as much as a boundary. Minimising b L / k + a k instead gives "
                f"k = sqrt(L b / a) = {refined:.2f}, since a block here keeps {a / b:.0f}x its input (projections, "
                "attention inputs and the d_ff-wide SwiGLU activations). The measured best is closer to "
                f"{closer}.")
        text += _neighbours(sweep, best)
        none = [r for r in sweep if r["k"] == "none"]
        if none and none[0]["status"] == "ok":
            text += (f" Against no checkpointing ({_size(none[0]['measured_peak_bytes'])}) it keeps "
                     f"{best['measured_peak_bytes'] / none[0]['measured_peak_bytes']:.1%} of the peak for "
                     f"{plural(best['recomputed_blocks'], 'recomputed block')}.")
        elif none:
            text += " Without checkpointing this context does not fit."
        parts.append(text + "\n")
        nested = [r for r in sweep if r["plan_kind"] == "optimal" and r["status"] == "ok"]
        if nested:
            parts.append("Optimal nested plans (profiling.checkpointing.optimal_plan): " + "; ".join(
                f"{_levels(r['levels'])}: {_size(r['measured_peak_bytes'])} measured, "
                f"{_size(r['predicted_peak_bytes'])} predicted, {plural(r['recomputed_blocks'], 'recomputed block')}, "
                f"{r['step_ms'] / best['step_ms']:.2f}x the best single level's step time" for r in nested) + ".\n")
    offsets = [r["measured_peak_bytes"] - r["predicted_peak_bytes"] for r in sweep if r["status"] == "ok"]
    if offsets:
        parts.append(f"Measured minus predicted peak: {span(offsets, _size)} "
                     f"({span([x / a for x in offsets], '{:+.2f}'.format)} blocks' worth).\n")
    return "\n".join(parts)


def _neighbours(sweep: list[Row], best: Row) -> str:
    """The measured peaks of the next smaller and next larger k of the sweep, beside the best one's."""
    ks = sorted((r for r in sweep if r["plan_kind"] == "every_k" and r["k"] != "none"), key=lambda r: r["k"])
    at = next(i for i, r in enumerate(ks) if r["k"] == best["k"])
    around = [ks[i] for i in (at - 1, at + 1) if 0 <= i < len(ks)]
    if not around:
        return ""
    return (" To be sure, the next " + " and ".join(
        f"{'smaller' if r['k'] < best['k'] else 'larger'} group, every {r['k']}, peaks at "
        + (_size(r["measured_peak_bytes"]) if r["status"] == "ok" else "out of memory") for r in around)
        + f", against {_size(best['measured_peak_bytes'])}.")


# The memory-optimal nesting as code, for the report: what optimal_plan builds with no limit on levels.
NESTED_SKETCH = """    from torch.utils.checkpoint import checkpoint

    def run(blocks, x):
        # Keeps one block's activations and a few residual-stream tensors at any time; backward
        # recomputes the prefix before each block from x, (L - 1) L / 2 blocks in all.
        if len(blocks) == 1:
            return blocks[0](x)
        prefix_out = checkpoint(run, blocks[:-1], x, use_reentrant=False)  # keeps only x
        return blocks[-1](prefix_out)
"""


def _strategy_section(sweep: list[Row]) -> str:
    r0 = sweep[0]
    a, b, layers = r0["block_bytes"], r0["boundary_bytes"], r0["num_layers"]
    table = []
    for levels in sorted({1, 2, 3, 4, max(1, math.ceil(math.log2(layers)))}) + [None]:
        plan, cost = optimal_plan(layers, a, b, levels)
        table.append({"recomputation levels": "unlimited" if levels is None else levels,
                      "predicted peak": _size(cost.peak_bytes), "peak / a": f"{cost.peak_bytes / a:.2f}",
                      "recomputed blocks": cost.recomputed_blocks, "plan": describe(plan)[:120]})
    unlimited = optimal_plan(layers, a, b)[1]
    two_levels = optimal_plan(layers, a, b, 2)[1]
    return ("## The memory-optimal strategy\n\nUnder the model, a plan's peak is the most that backward holds at "
            "once: what earlier items kept plus the peak inside the item being backpropagated (a for a plain block, "
            "b plus its inner plan's peak for a recomputed group). Dynamic programming over the first item of each "
            "sequence gives the least peak for each limit on how often a block may be recomputed (nesting depth):\n\n"
            + markdown_table(table) +
            f"\nWith no limit the least peak is {'a + b = ' if math.isclose(unlimited.peak_bytes, a + b) else ''}"
            f"{_size(unlimited.peak_bytes)}: groups nested inside "
            f"each other recompute every block from the model's input, {unlimited.recomputed_blocks} recomputed blocks "
            f"for {layers}, O(1) memory for O(L^2) recomputation. Limiting the depth to r levels gives a peak of about "
            "a + r L^(1/r) b for at most r L recomputed blocks: r = 1 is single-level checkpointing (O(sqrt L) memory), "
            "and r = log2 L recursive halving, a + O(b log L) memory for O(L log L) recomputation. Here a block "
            f"keeps {a / b:.0f}x its input, so the a term sets the floor: two levels come within "
            f"{two_levels.peak_bytes / unlimited.peak_bytes - 1:.0%} of the unlimited optimum for "
            f"{two_levels.recomputed_blocks} recomputed blocks instead of {unlimited.recomputed_blocks}.\n\n"
            "The unlimited plan as code: each checkpoint keeps only the model's input, and in backward the "
            "blocks before the current one are recomputed from it, nested once per block:\n\n"
            + NESTED_SKETCH)


def _longest_section(rows: list[Row]) -> str:
    longest = [r for r in rows if r.get("table") == "longest"]
    if not longest:
        return ""
    r0 = longest[0]
    sweep = [r for r in rows if r.get("table") == "sweep"]
    fits = sum(r["status"] == "ok" for r in sweep)
    table = [{"plan": _plan_label(r), "longest context predicted to fit": r["predicted_longest_context"] or "none",
              "predicted peak there": _size(r["predicted_peak_bytes"]),
              "next context": r["next_context"], "its predicted peak": _size(r["next_predicted_peak_bytes"])}
             for r in longest]
    text = (f"## Longest context that fits\n\nThe sweep above ran at context {sweep[0]['context_length']}, where "
            f"{fits} of {len(sweep)} plans fit" + (", so the curve over k is measured whole" if fits == len(sweep) else "")
            + "; the longest context is predicted from the model and checked with one run. Predicted: parameters, "
            "gradients and buffers as measured "
            f"({_size(r0['start_bytes'])}) plus the plan's predicted activation peak, against "
            f"{r0['usable_share']:.0%} of the device's {_size(r0['capacity_bytes'])}; contexts double from the "
            "sweep's.\n\n" + markdown_table(table))
    for r in longest:
        if r.get("run_context"):
            if r["run_status"] == OOM:
                text += (f"\nRun at context {r['run_context']} ({_plan_label(r)}): out of memory, against a predicted "
                         f"{_size(r['run_predicted_peak_bytes'])}: the prediction is too optimistic there.\n")
            else:
                text += (f"\nRun at context {r['run_context']} ({_plan_label(r)}): it fits, peak "
                         f"{_size(r['run_peak_bytes'])} against {_size(r['run_predicted_peak_bytes'])} "
                         f"predicted, {r['run_step_ms'] / 1e3:.1f} s for forward + backward.")
                if r["run_context"] < r["predicted_longest_context"]:
                    text += (f" Context {r['predicted_longest_context']} was not run (a step there takes minutes); it "
                             "is the prediction.")
                text += "\n"
    return text


@renderer("gradient_checkpointing")
def render_gradient_checkpointing(rows: list[Row]) -> Rendered:
    sweep = [r for r in rows if r.get("table") == "sweep"]
    if not sweep:
        return Rendered("_no rows_\n")
    parts = [_sweep_section(sweep), _strategy_section(sweep), _longest_section(rows)]
    figure = _sweep_figure(sweep, sweep[0]["num_layers"])
    parts.insert(1, "![peak activation memory by plan](gradient_checkpointing.png)\n")
    return Rendered("\n".join(p for p in parts if p), {"gradient_checkpointing.png": figure})
