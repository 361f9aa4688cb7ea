"""Problem gradient_checkpointing: peak activation memory of forward + backward under each
checkpoint plan (every k blocks, each block split into its two sublayers, and the memory-optimal
nested plans), against the closed-form model, and the longest context each plan is predicted to fit.

    rows = checkpoint_sweep(CheckpointSweepConfig(), "cuda")

Each measuring function returns rows; the renderer below answers the written questions from them.
"""

from __future__ import annotations

import inspect
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
from cs336_systems.benchmarks.harness import autocast, build_model, guarded_cell, lm_loss, random_batch, release_memory
from cs336_systems.gpus import GIB, MIB
from cs336_systems.model import ModelConfig
from cs336_systems.precision import check_precision
from cs336_systems.profiling.checkpointing import (
    apply_checkpointing,
    checkpoint_chain,
    describe,
    every_k,
    every_sublayer,
    optimal_plan,
    plan_cost,
    remove_checkpointing,
)
from cs336_systems.profiling.memory import peak_memory_increase
from cs336_systems.reports import (
    OOM,
    Rendered,
    Reports,
    Row,
    find,
    format_bytes,
    format_ratio,
    listing,
    markdown_table,
    not_in_report,
    ok_rows,
    plural,
    select,
    span,
)
from cs336_systems.timing import STEP_TIMER, timed

# The 2026 handout's gradient_checkpointing (b): xl at batch 4 and this sequence length.
HANDOUT_CHECKPOINT_CONTEXT = 2048
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
Y_TICK_SUBS = (1.0, 1.5, 2.0, 3.0, 5.0, 7.0)


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

    def __post_init__(self):
        check_precision(self.precision)
        if any(k is not None and k < 1 for k in self.ks):
            raise ValueError(f"checkpoint every k blocks needs k >= 1, got {self.ks}")
        ModelConfig.for_size(self.size, self.context_length)


@dataclass(frozen=True)
class _Sizes:
    """What the memory model prices plans with, at one context."""
    block: int  # a block's saved activations (a)
    boundary: int  # one residual-stream tensor (b)
    head: int  # what the final norm, LM head and loss keep
    transient: int  # the largest temporary beside them
    sublayers: tuple[int, int]  # (a_attn, a_ffn)


def _sizes(cfg: CheckpointSweepConfig, context: int, device_type: str) -> _Sizes:
    config = ModelConfig.for_size(cfg.size, context)
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
    config = ModelConfig.for_size(cfg.size, model_context)
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


def _single_level(sweep: list[Row], measured: bool = True) -> list[Row]:
    """The sweep's single-level plans (every k blocks, or every block split) that ran, or all of them."""
    return [r for r in sweep if (r["plan_kind"] == "sublayers" or r["plan_kind"] == "every_k" and r["k"] != "none")
            and (r["status"] == "ok" or not measured)]


def _plan_for(row: Row, num_layers: int):
    """sizes -> the plan of a sweep row, at any context."""
    if row["plan_kind"] == "sublayers":
        return lambda sizes: every_sublayer(num_layers)
    return lambda sizes: every_k(num_layers, row["k"])


def _longest_context_rows(model, cfg, num_layers, sweep, base, device) -> list[Row]:
    capacity = torch.cuda.get_device_properties(device).total_memory
    start = torch.cuda.memory_allocated(device)  # parameters, gradients, buffers
    budget = capacity * USABLE_MEMORY_SHARE - start
    single = _single_level(sweep)
    best = (min(single, key=lambda r: r["measured_peak_bytes"]) if single else
            min(_single_level(sweep, measured=False), key=lambda r: r["predicted_peak_bytes"]))
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


# -------------------------------------------------------------------- gradient_checkpointing report

def _every(k: int) -> str:
    return f"every {k} block{'s' if k != 1 else ''}"


# Where a block split into its two sublayers sits on the figure's axis of blocks per checkpoint.
SUBLAYERS_X = 0.5


def _plan_label(r: Row) -> str:
    if r["plan_kind"] == "every_k":
        return "no checkpointing" if r["k"] == "none" else _every(r["k"])
    if r["plan_kind"] == "sublayers":
        return "each block's two sublayers"
    return f"optimal nested, {r['levels']} recomputation level{'s' if r['levels'] != 1 else ''}"


def _blocks_per_checkpoint(r: Row) -> float:
    return SUBLAYERS_X if r["plan_kind"] == "sublayers" else r["k"]


def _sweep_figure(sweep: list[Row], num_layers: int):
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    single = sorted(_single_level(sweep, measured=False), key=_blocks_per_checkpoint)
    measured = [r for r in single if r["status"] == "ok"]
    lines = [r for r in sweep if r["status"] == "ok" and (r["plan_kind"] == "optimal" or r["k"] == "none")]
    largest = max([r["predicted_peak_bytes"] for r in single] + [r["measured_peak_bytes"] for r in measured + lines])
    scale, unit = (GIB, "GiB") if largest >= GIB else (MIB, "MiB")
    figure = Figure(figsize=(7, 4))
    ax = figure.subplots()
    ax.plot([_blocks_per_checkpoint(r) for r in single], [r["predicted_peak_bytes"] / scale for r in single], "o--",
            color="tab:gray", label="predicted")
    if measured:
        ax.plot([_blocks_per_checkpoint(r) for r in measured], [r["measured_peak_bytes"] / scale for r in measured],
                "o-", color="tab:blue", label="measured")
    colors = iter(["tab:green", "tab:purple", "tab:orange", "tab:red", "tab:brown", "tab:olive"])
    for r in lines:
        ax.axhline(r["measured_peak_bytes"] / scale, ls=":", color=next(colors, "black"), label=_plan_label(r))
    ax.axvline(math.sqrt(num_layers), color="black", lw=0.8, alpha=0.5, label=f"sqrt(L) = {math.sqrt(num_layers):.1f}")
    ax.set_xscale("log", base=2)
    ax.set_xticks([_blocks_per_checkpoint(r) for r in single],
                  ["1/2 (sublayers)" if r["plan_kind"] == "sublayers" else str(r["k"]) for r in single])
    ax.set_yscale("log")
    # Labels at 1, 1.5, 2, 3, 5 and 7 of each decade: a label in every stretch of a plot that spans one
    # or two decades, none crowding the next (every minor tick labelled overlapped between 6 and 10).
    ax.yaxis.set_major_locator(LogLocator(subs=Y_TICK_SUBS))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("blocks per checkpoint")
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
              "kept after forward": format_bytes(r.get("measured_kept_bytes")) if r["status"] == "ok" else OOM,
              "predicted kept": format_bytes(r["predicted_kept_bytes"]),
              "peak": format_bytes(r["measured_peak_bytes"]) if r["status"] == "ok" else OOM,
              "predicted peak": format_bytes(r["predicted_peak_bytes"]),
              "step (ms)": r.get("step_ms") if r["status"] == "ok" else None} for r in sweep]
    split = (f" (attention sublayer {format_bytes(r0['attention_sublayer_bytes'])}, feed-forward "
             f"{format_bytes(r0['ffn_sublayer_bytes'])})" if r0.get("attention_sublayer_bytes") else "")
    parts = [f"## Peak activation memory by checkpoint plan\n\n{r0['size']} ({layers} blocks), batch "
             f"{r0['batch_size']}, context {r0['context_length']}, {r0['precision']}, {r0['attention']} attention; one "
             "forward + backward per plan (non-reentrant torch.utils.checkpoint) with gradients allocated: the peak "
             f"above the start is activations and temporaries. Model: a block keeps a = {format_bytes(a)}{split}, a "
             f"checkpoint its input b = {format_bytes(b)}; predicted peak = plan_cost + head "
             f"({format_bytes(r0['head_bytes'])}) + largest temporary ({format_bytes(r0['transient_bytes'])})."
             + ("" if on_gpu else " CPU peaks: torch.profiler's memory records.") + "\n", markdown_table(table)]
    single = _single_level(sweep)
    if single:
        best = min(single, key=lambda r: r["measured_peak_bytes"])
        neighbours = [f"{_plan_label(r)} {format_bytes(r['measured_peak_bytes'])}" for r in single
                      if r is not best and _blocks_per_checkpoint(r) in (SUBLAYERS_X, 1, 2)]
        parts.append(f"(b) One level of recomputation: the sqrt(L) rule assumes a = b; here a = {a / b:.0f} b, and "
                     f"minimising b L / k + a k gives k = sqrt(L b / a) = {math.sqrt(layers * b / a):.2f} blocks. "
                     f"Measured best: {_plan_label(best)}, {format_bytes(best['measured_peak_bytes'])}"
                     + (f"; {listing(neighbours)}." if neighbours else ".") + "\n")
    offsets = [r["measured_peak_bytes"] - r["predicted_peak_bytes"] for r in sweep if r["status"] == "ok"]
    if offsets:
        parts.append(f"Measured minus predicted peak: {span(offsets, format_bytes)} "
                     f"({span([x / a for x in offsets], '{:+.2f}'.format)} blocks' worth).\n")
    return "\n".join(parts)


def _code_sketch() -> str:
    """checkpoint_chain's code, its docstring left out: the sketch part (a) asks for, as it runs."""
    lines = inspect.getsource(checkpoint_chain).splitlines()
    quotes = [i for i, line in enumerate(lines) if '"""' in line]
    return "\n".join(lines[:quotes[0]] + lines[quotes[1] + 1:])


def _strategy_section(sweep: list[Row]) -> str:
    r0 = sweep[0]
    a, b, layers = r0["block_bytes"], r0["boundary_bytes"], r0["num_layers"]
    table = []
    for levels in sorted({1, 2, 3, max(1, math.ceil(math.log2(layers)))}) + [None]:
        plan, cost = optimal_plan(layers, a, b, levels)
        table.append({"recomputation levels": "unlimited" if levels is None else levels,
                      "predicted peak": format_bytes(cost.peak_bytes), "peak / a": f"{cost.peak_bytes / a:.2f}",
                      "recomputed blocks": cost.recomputed_blocks, "plan": describe(plan)[:100]})
    unlimited = optimal_plan(layers, a, b)[1]
    return ("## (a) The memory-optimal strategy\n\nNest checkpoints so that backward of block i recomputes blocks "
            "0..i-1 from the model's input (profiling.checkpointing.checkpoint_chain, run on the blocks):\n\n"
            f"```python\n{_code_sketch()}\n```\n\nPeak a + b, O(1) in L, for L(L - 1)/2 = "
            f"{unlimited.recomputed_blocks} recomputed block forwards, O(L^2). With r levels "
            "(profiling.checkpointing.optimal_plan): about a + r L^(1/r) b for at most r L recomputations; r = log2 L: "
            "O(log L) memory, O(L log L) compute.\n\n" + markdown_table(table))


def _longest_section(rows: list[Row]) -> str:
    longest = [r for r in rows if r.get("table") == "longest"]
    if not longest:
        return ""
    r0 = longest[0]
    table = [{"plan": _plan_label(r), "longest context predicted to fit": r["predicted_longest_context"] or "none",
              "predicted peak there": format_bytes(r["predicted_peak_bytes"]),
              "next context": r["next_context"], "its predicted peak": format_bytes(r["next_predicted_peak_bytes"])}
             for r in longest]
    text = ("## Longest context that fits\n\nPredicted: parameters, gradients and buffers "
            f"({format_bytes(r0['start_bytes'])}) plus the plan's peak, against {r0['usable_share']:.0%} of "
            f"{format_bytes(r0['capacity_bytes'])}.\n\n" + markdown_table(table))
    for r in longest:
        if r.get("run_context"):
            if r["run_status"] == OOM:
                text += (f"\nRun at context {r['run_context']} ({_plan_label(r)}): out of memory, against a predicted "
                         f"{format_bytes(r['run_predicted_peak_bytes'])}.\n")
            else:
                text += (f"\nRun at context {r['run_context']} ({_plan_label(r)}): peak "
                         f"{format_bytes(r['run_peak_bytes'])}, predicted {format_bytes(r['run_predicted_peak_bytes'])}, "
                         f"{r['run_step_ms'] / 1e3:.1f} s for forward + backward.\n")
    return text


def render_gradient_checkpointing(rows: list[Row]) -> Rendered:
    sweep = [r for r in rows if r.get("table") == "sweep"]
    if not sweep:
        return Rendered("_no rows_\n")
    parts = [_sweep_section(sweep), _strategy_section(sweep), _longest_section(rows)]
    figure = _sweep_figure(sweep, sweep[0]["num_layers"])
    parts.insert(1, "![peak activation memory by plan](gradient_checkpointing.png)\n")
    return Rendered("\n".join(p for p in parts if p), {"gradient_checkpointing.png": figure})


# ---------------------------------------------------------------------------------------------- answers

def _plan_phrase(r: Row) -> str:
    """A plan as a sentence names it (`_plan_label` is the table's shorter name)."""
    if r["plan_kind"] == "every_k":
        return "no checkpointing" if r["k"] == "none" else _every(r["k"])
    if r["plan_kind"] == "sublayers":
        return "checkpointing each block's two sublayers"
    return f"the optimal nested plan with {r['levels']} recomputation level{'s' if r['levels'] != 1 else ''}"


def answer_gradient_checkpointing(reports: Reports) -> list[str]:
    sweep = select(reports["gradient_checkpointing"], table="sweep")
    single = _single_level(sweep)
    if not single:
        return [not_in_report("A single-level checkpoint plan that fit in memory")]
    r0 = single[0]
    layers, a, b = r0["num_layers"], r0["block_bytes"], r0["boundary_bytes"]
    best = min(single, key=lambda r: r["measured_peak_bytes"])
    none = find(sweep, plan_kind="every_k", k="none")
    baseline = (f"{format_bytes(none['measured_peak_bytes'], 'bytes')} without checkpointing, "
                if none and none["status"] == "ok" else "")
    others = [f"{format_bytes(r['measured_peak_bytes'], 'bytes')} {_plan_phrase(r)}" for r in single
              if r is not best and _blocks_per_checkpoint(r) in (SUBLAYERS_X, 1, 2)]
    sentences = [
        f"{r0['size']} ({layers} blocks), batch {r0['batch_size']}, context {r0['context_length']}, {r0['precision']}"
        + (f", {r0['attention']} attention" if r0.get("attention") else "") + f": peak activation memory is {baseline}"
        f"{format_bytes(best['measured_peak_bytes'], 'bytes')} at the best single level ({_plan_phrase(best)})"
        + (f", against {listing(others)}." if others else ".")]
    ooms = [_plan_phrase(r) for r in sweep if r["status"] == OOM]
    sentences.append(
        f"The sqrt(L) rule (k = sqrt({layers}) = {math.sqrt(layers):.1f}) assumes a block keeps what a checkpoint "
        f"keeps; here it keeps {a / b:.0f}x as much, which moves the optimum to sqrt(L b / a) = "
        f"{math.sqrt(layers * b / a):.2f} blocks" + (f" (out of memory at this context: {listing(ooms)})." if ooms else "."))
    nested = {r["levels"]: r for r in ok_rows(sweep) if r["plan_kind"] == "optimal"}
    unlimited, two = nested.get("unlimited"), nested.get(2)
    if unlimited:
        text = (f"The memory-optimal strategy nests checkpointed groups inside each other: with unlimited "
                f"recomputation it peaks at {format_bytes(unlimited['measured_peak_bytes'], 'bytes')}, recomputing "
                f"{plural(unlimited['recomputed_blocks'], 'block forward pass', 'block forward passes')} per step "
                f"in the {layers}-block model ({format_ratio(unlimited['step_ms'] / best['step_ms'])} the step time of "
                f"{_plan_phrase(best)}), O(1) memory for O(L^2) recomputation")
        if two:
            text += (f"; two levels reach {format_bytes(two['measured_peak_bytes'], 'bytes')} for "
                     f"{plural(two['recomputed_blocks'], 'recomputed block')} "
                     f"({format_ratio(two['step_ms'] / best['step_ms'])})")
        sentences.append(text + ".")
    else:
        sentences.append(not_in_report("The optimal nested plan with unlimited recomputation"))
    return sentences


def open_items_gradient_checkpointing(reports: Reports) -> list[str]:
    sweep = select(reports["gradient_checkpointing"], table="sweep")
    if any(r.get("context_length") == HANDOUT_CHECKPOINT_CONTEXT for r in sweep):
        return []
    return [f"the 2026 handout's (b) is xl at batch 4, context {HANDOUT_CHECKPOINT_CONTEXT:,}; this run measured "
            "context " + listing(sorted({str(r["context_length"]) for r in sweep}))
            + " (`make single-gpu-reports` runs it)"]
