"""Problem gradient_checkpointing's answers: the sentences of its report (peak activation memory by checkpoint
plan against the closed-form model, the memory-optimal nested strategy with its code and asymptotics, the
longest context each plan is predicted to fit), its figure, its answer and what a run leaves open. The report's
tables are declared in cs336_systems.reports.problems; the package's benchmarks/gradient_checkpointing.py
measures them.
"""

from __future__ import annotations

import inspect
import math

from cs336_systems.distributed.checkpointing import checkpoint_chain, describe, optimal_plan
from cs336_systems.gpus import GIB, MIB
from cs336_systems.reports import (
    NOT_RUN,
    Reports,
    find,
    format_bytes,
    format_ratio,
    listing,
    not_in_report,
    plural,
    select,
    span,
)
from cs336_systems.rows import OOM, Row, ok_rows
from cs336_systems.rows.gradient_checkpointing import HANDOUT_CHECKPOINT_CONTEXT, single_level_rows

# The mantissas of the figure's labelled y ticks (see sweep_figure).
Y_TICK_SUBS = (1.0, 1.5, 2.0, 3.0, 5.0, 7.0)
# Where a block split into its two sublayers sits on the figure's axis of blocks per checkpoint.
SUBLAYERS_X = 0.5


def plan_label(r: Row) -> str:
    """A plan as the tables name it (`_plan_phrase` is the sentences' longer name)."""
    if r["plan_kind"] == "every_k":
        return "no checkpointing" if r["k"] == "none" else "every " + plural(r["k"], "block")
    if r["plan_kind"] == "sublayers":
        return "each block's two sublayers"
    return f"optimal nested, {plural(r['levels'], 'recomputation level')}"


def blocks_per_checkpoint(r: Row) -> float:
    return SUBLAYERS_X if r["plan_kind"] == "sublayers" else r["k"]


def sweep_figure(rows: list[Row]):
    """Peak activation memory against blocks per checkpoint, predicted and measured, with the nested plans' and no
    checkpointing's peaks as lines across and sqrt(L) marked."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    sweep = select(rows, table="sweep")
    num_layers = sweep[0]["num_layers"]
    single = sorted(single_level_rows(sweep, measured=False), key=blocks_per_checkpoint)
    measured = [r for r in single if r["status"] == "ok"]
    lines = [r for r in sweep if r["status"] == "ok" and (r["plan_kind"] == "optimal" or r["k"] == "none")]
    largest = max([r["predicted_peak_bytes"] for r in single] + [r["measured_peak_bytes"] for r in measured + lines])
    scale, unit = (GIB, "GiB") if largest >= GIB else (MIB, "MiB")
    figure = Figure(figsize=(7, 4))
    ax = figure.subplots()
    ax.plot([blocks_per_checkpoint(r) for r in single], [r["predicted_peak_bytes"] / scale for r in single], "o--",
            color="tab:gray", label="predicted")
    if measured:
        ax.plot([blocks_per_checkpoint(r) for r in measured], [r["measured_peak_bytes"] / scale for r in measured],
                "o-", color="tab:blue", label="measured")
    colors = iter(["tab:green", "tab:purple", "tab:orange", "tab:red", "tab:brown", "tab:olive"])
    for r in lines:
        ax.axhline(r["measured_peak_bytes"] / scale, ls=":", color=next(colors, "black"), label=plan_label(r))
    ax.axvline(math.sqrt(num_layers), color="black", lw=0.8, alpha=0.5, label=f"sqrt(L) = {math.sqrt(num_layers):.1f}")
    ax.set_xscale("log", base=2)
    ax.set_xticks([blocks_per_checkpoint(r) for r in single],
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


def sweep_setup(rows: list[Row]) -> str:
    r0 = select(rows, table="sweep")[0]
    split = (f" (attention sublayer {format_bytes(r0['attention_sublayer_bytes'])}, feed-forward "
             f"{format_bytes(r0['ffn_sublayer_bytes'])})" if r0.get("attention_sublayer_bytes") else "")
    return (f"## Peak activation memory by checkpoint plan\n\n{r0['size']} ({r0['num_layers']} blocks), batch "
            f"{r0['batch_size']}, context {r0['context_length']}, {r0['precision']}, {r0['attention']} attention; one "
            "forward + backward per plan (non-reentrant torch.utils.checkpoint) with gradients allocated: the peak "
            "above the start is activations and temporaries. Model: a block keeps a = "
            f"{format_bytes(r0['block_bytes'])}{split}, a checkpoint its input b = {format_bytes(r0['boundary_bytes'])}; predicted peak = plan_cost + "
            f"head ({format_bytes(r0['head_bytes'])}) + largest temporary ({format_bytes(r0['transient_bytes'])})."
            + ("" if r0["device"] == "cuda" else " CPU peaks: torch.profiler's memory records.") + "\n")


def best_single_level(rows: list[Row]) -> str:
    sweep = select(rows, table="sweep")
    single = single_level_rows(sweep)
    if not single:
        return ""
    a, b, layers = sweep[0]["block_bytes"], sweep[0]["boundary_bytes"], sweep[0]["num_layers"]
    best = min(single, key=lambda r: r["measured_peak_bytes"])
    neighbours = [f"{plan_label(r)} {format_bytes(r['measured_peak_bytes'])}" for r in single
                  if r is not best and blocks_per_checkpoint(r) in (SUBLAYERS_X, 1, 2)]
    return (f"(b) One level of recomputation: the sqrt(L) rule assumes a = b; here a = {a / b:.0f} b, and minimising "
            f"b L / k + a k gives k = sqrt(L b / a) = {math.sqrt(layers * b / a):.2f} blocks. Measured best: "
            f"{plan_label(best)}, {format_bytes(best['measured_peak_bytes'])}"
            + (f"; {listing(neighbours)}." if neighbours else ".") + "\n")


def prediction_offsets(rows: list[Row]) -> str:
    sweep = select(rows, table="sweep")
    offsets = [r["measured_peak_bytes"] - r["predicted_peak_bytes"] for r in sweep if r["status"] == "ok"]
    if not offsets:
        return ""
    return (f"Measured minus predicted peak: {span(offsets, format_bytes)} "
            f"({span([x / sweep[0]['block_bytes'] for x in offsets], '{:+.2f}'.format)} blocks' worth).\n")


def _code_sketch() -> str:
    """checkpoint_chain's code, its docstring left out: the sketch part (a) asks for, as it runs."""
    lines = inspect.getsource(checkpoint_chain).splitlines()
    quotes = [i for i, line in enumerate(lines) if '"""' in line]
    return "\n".join(lines[:quotes[0]] + lines[quotes[1] + 1:])


def nested_strategy(rows: list[Row]) -> str:
    r0 = select(rows, table="sweep")[0]
    unlimited = optimal_plan(r0["num_layers"], r0["block_bytes"], r0["boundary_bytes"])[1]
    return ("## (a) The memory-optimal strategy\n\nNest checkpoints so that backward of block i recomputes blocks "
            "0..i-1 from the model's input (distributed.checkpointing.checkpoint_chain, run on the blocks):\n\n"
            f"```python\n{_code_sketch()}\n```\n\nPeak a + b, O(1) in L, for L(L - 1)/2 = "
            f"{unlimited.recomputed_blocks} recomputed block forwards, O(L^2). With r levels "
            "(distributed.checkpointing.optimal_plan): about a + r L^(1/r) b for at most r L recomputations; r = log2 L: "
            "O(log L) memory, O(L log L) compute.\n")


def nested_plans(sweep: list[Row]) -> list[Row]:
    """The optimal nested plan for the sweep's model at 1, 2, 3, log2 L and unlimited levels of recomputation."""
    r0 = sweep[0]
    a, layers = r0["block_bytes"], r0["num_layers"]
    plans = []
    for levels in sorted({1, 2, 3, max(1, math.ceil(math.log2(layers)))}) + [None]:
        plan, cost = optimal_plan(layers, a, r0["boundary_bytes"], levels)
        plans.append({"levels": "unlimited" if levels is None else levels, "peak_bytes": cost.peak_bytes,
                      "block_bytes": a, "recomputed_blocks": cost.recomputed_blocks, "plan": describe(plan)[:100]})
    return plans


def longest_setup(rows: list[Row]) -> str:
    r0 = rows[0]
    return ("## Longest context that fits\n\nPredicted: parameters, gradients and buffers "
            f"({format_bytes(r0['start_bytes'])}) plus the plan's peak, against {r0['usable_share']:.0%} of "
            f"{format_bytes(r0['capacity_bytes'])}.\n")


def longest_runs(longest: list[Row]) -> str:
    """The longest context each plan was run at: its peak and time, or out of memory."""
    return "\n".join(
        f"Run at context {r['run_context']} ({plan_label(r)}): "
        + (f"out of memory, against a predicted {format_bytes(r['run_predicted_peak_bytes'])}.\n"
           if r["run_status"] == OOM else
           f"peak {format_bytes(r['run_peak_bytes'])}, predicted {format_bytes(r['run_predicted_peak_bytes'])}, "
           f"{r['run_step_ms'] / 1e3:.1f} s for forward + backward.\n")
        for r in longest if r.get("run_context"))


# ---------------------------------------------------------------------------------------------- answers

def _plan_phrase(r: Row) -> str:
    """A plan as a sentence names it."""
    if r["plan_kind"] == "sublayers":
        return "checkpointing each block's two sublayers"
    if r["plan_kind"] == "optimal":
        return f"the optimal nested plan with {plural(r['levels'], 'recomputation level')}"
    return plan_label(r)


def answer_gradient_checkpointing(reports: Reports) -> list[str]:
    sweep = select(reports["gradient_checkpointing"], table="sweep")
    single = single_level_rows(sweep)
    if not single:
        return [not_in_report("A single-level checkpoint plan that fit in memory")]
    r0 = single[0]
    layers, a, b = r0["num_layers"], r0["block_bytes"], r0["boundary_bytes"]
    best = min(single, key=lambda r: r["measured_peak_bytes"])
    none = find(sweep, plan_kind="every_k", k="none")
    baseline = (f"{format_bytes(none['measured_peak_bytes'], 'bytes')} without checkpointing, "
                if none and none["status"] == "ok" else "")
    others = [f"{format_bytes(r['measured_peak_bytes'], 'bytes')} {_plan_phrase(r)}" for r in single
              if r is not best and blocks_per_checkpoint(r) in (SUBLAYERS_X, 1, 2)]
    sentences = [
        f"{r0['size']} ({layers} blocks), batch {r0['batch_size']}, context {r0['context_length']}, {r0['precision']}"
        + (f", {r0['attention']} attention" if r0.get("attention") else "") + f": peak activation memory is {baseline}"
        f"{format_bytes(best['measured_peak_bytes'], 'bytes')} at the best single level ({_plan_phrase(best)})"
        + (f", against {listing(others)}." if others else ".")]
    ooms = [_plan_phrase(r) + (f" ({NOT_RUN})" if r.get("oom_predicted") else "") for r in sweep
            if r["status"] == OOM]
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
