"""Problem optimizer_state_sharding's reports: ShardedOptimizer against AdamW (correctness, and the
re-synchronisation methods' step times), and its accounting report (memory and time per step against torch
DDP with AdamW and with ZeroRedundancyOptimizer, memory at the phase points, and how both differ from ZeRO
stage 1); with its answer. The package's distributed/equivalence.py checks the correctness, its
benchmarks/sharding.py measures the rest. The step and memory tables here serve the FSDP reports too.
"""

from __future__ import annotations

from collections.abc import Callable

from cs336_systems.accounting.communication import bytes_sent_per_device
from cs336_systems.reports import (
    Reports,
    find,
    format_ms,
    format_share,
    markdown_table,
    not_in_report,
    select,
    span,
)
from cs336_systems.reports.ddp import step_setup, steps_by_variant
from cs336_systems.rows import Row


def setup_sentence(rows: list[Row]) -> str:
    r = select(rows, table="step")[0]
    return (f"{r['size']} model, context {r['context_length']}, batch {r['batch_size']} per rank, {r['world_size']} "
            f"ranks ({r['backend']}), fp32, AdamW, {r['attention']}; {r['warmup']} warm-up + {r['steps']} timed steps "
            "per variant, one run; step: mean over ranks and steps; peak: the largest rank's.")


def gigabytes(column: str) -> Callable[[Row], float | None]:
    return lambda row: None if row.get(column) is None else row[column] / 1e9


BREAKDOWN_NOTE = (
    "Memory (GiB) at points of one step after the timed ones: allocated, and the peak since the step started (at "
    "init: while building); parameters, gradients and optimizer state are this rank's tensors (local shards when "
    "sharded), activations what forward left allocated, other the rest (buckets, buffers, allocator rounding).\n")
MEMORY_COLUMNS = ("variant", "point", "allocated_gib", "peak_gib", "parameters_gib", "gradients_gib",
                  "optimizer_state_gib", "activations_gib", "other_gib")
NO_MEMORY_POINTS = "_no memory points (the run had no GPU: the CPU allocator keeps no statistics)_\n"


# What our sharded optimizer should stay within, over torch's ZeroRedundancyOptimizer.
TARGET_STEP_OVER_ZERO = 0.10
TARGET_PEAK_OVER_ZERO = 0.05


def within(ratio: float, target: float) -> str:
    return f"within the +{target:.0%} target" if ratio <= target else f"OVER the +{target:.0%} target"


def zero_comparison(rows: list[Row]) -> str:
    """Our sharded optimizer against torch's ZeroRedundancyOptimizer, and against the targets."""
    ok = steps_by_variant(rows)
    zero = ok.get("DDP + ZeroRedundancyOptimizer")
    ours = [r for name, r in ok.items() if name.startswith("DDP + ShardedOptimizer")]
    if zero is None or not ours:
        return ""
    # The step and peak ratios are the table's last columns; these lines say how they meet the targets.
    verdicts = {}
    for r in ours:
        verdict = f"step {within(r['step_ms'] / zero['step_ms'] - 1, TARGET_STEP_OVER_ZERO)}"
        if r.get("peak_gib") and zero.get("peak_gib"):
            verdict += f", peak {within(r['peak_gib'] / zero['peak_gib'] - 1, TARGET_PEAK_OVER_ZERO)}"
        verdicts[r["variant"]] = verdict
    if len(ours) > 1 and len(set(verdicts.values())) == 1:
        lines = [f"- Every ShardedOptimizer variant against ZeroRedundancyOptimizer: {next(iter(verdicts.values()))}."]
    else:
        lines = [f"- {variant} against ZeroRedundancyOptimizer: {verdict}." for variant, verdict in verdicts.items()]
    ddp = ok.get("DDP + AdamW")
    if ddp and ddp.get("peak_gib") and zero.get("peak_gib"):
        lines.append(f"- Sharding the optimizer state lowers the peak by "
                     f"{ddp['peak_gib'] - zero['peak_gib']:.3g} GiB; the memory model expected "
                     f"{ddp['model_peak_gib'] - zero['model_peak_gib']:.3g} GiB (all but 1/{zero['world_size']} of "
                     "AdamW's two fp32 moments).")
    fastest = min(ours, key=lambda r: r["optimizer_ms"])
    lines.append(f"- The faster re-synchronisation here is {fastest['variant'].split('(')[-1].rstrip(')')} "
                 "(optimizer step column).")
    return "\n".join(lines) + "\n"


# The paper's mixed-precision Adam: fp16 parameters and gradients (2 bytes each), and K = 12 bytes of
# optimizer state per parameter (fp32 master weights, momentum and variance), which P_os shards.
ZERO_PAPER_BYTES = {"parameters": 2, "gradients": 2, "sharded state": 12}
# Here, fp32 training with AdamW: the fp32 parameters are the master weights, only the moments are state.
FP32_ADAMW_BYTES = {"parameters": 4, "gradients": 4, "sharded state": 8}


def zero_stage_1_section(rows: list[Row]) -> str:
    """(c): our approach (and torch's ZeroRedundancyOptimizer) against ZeRO-DP P_os, from the run's sizes."""
    steps = steps_by_variant(rows)
    ddp = find(rows, table="communication", variant="DDP + AdamW")
    ours = next((name for name in steps if name.startswith("DDP + ShardedOptimizer")), None)
    if ddp is None or ours is None:
        return ""
    n = steps[ours]["world_size"]
    psi = ddp["payload_bytes"]  # every gradient once: the fp32 parameters' bytes
    ours_sent = bytes_sent_per_device("all_reduce", psi, n) + bytes_sent_per_device("all_gather", psi, n)
    zero_sent = bytes_sent_per_device("reduce_scatter", psi, n) + bytes_sent_per_device("all_gather", psi, n)
    table = [{"": "communication per rank and step",
              "ours / ZeroRedundancyOptimizer": "all-reduce gradients + broadcast parameters, 3 (N-1)/N Psi "
                                                f"= {ours_sent / 1e9:.3g} GB",
              "ZeRO stage 1 (P_os)": f"reduce-scatter gradients + all-gather parameters, 2 (N-1)/N Psi = "
                                     f"{zero_sent / 1e9:.3g} GB"},
             {"": "memory per parameter and rank (bytes)",
              "ours / ZeroRedundancyOptimizer": "{parameters} + {gradients} + {sharded state} / N (fp32 AdamW)".format(
                  **FP32_ADAMW_BYTES),
              "ZeRO stage 1 (P_os)": "{parameters} + {gradients} + {sharded state} / N (the paper's mixed-precision "
                                     "Adam)".format(**ZERO_PAPER_BYTES)}]
    return "\n".join([
        "## (c) Against ZeRO stage 1\n",
        "ZeRO stage 1 (ZeRO-DP P_os, Rajbhandari et al. 2020) partitions the optimizer state over the N data-parallel "
        "ranks, as ShardedOptimizer and ZeroRedundancyOptimizer do: the same memory saving, more communication. "
        f"Psi is the parameters' bytes, {psi / 1e9:.3g} GB here (fp32), N = {n}.\n",
        markdown_table(table),
        "**Communication.** DDP's all-reduce gives each rank every gradient's sum though it uses only its shard's; "
        "ZeRO stage 1's reduce-scatter gives just that shard, so ours sends 1.5x ZeRO stage 1's bytes: "
        f"{ours_sent / 1e9:.3g} GB against {zero_sent / 1e9:.3g} GB per rank per step here.\n",
        "**Memory.** Both keep parameters and gradients whole (sharding gradients is stage 2) and divide the "
        "optimizer state by N: the paper's K = 12 bytes per parameter (fp32 master weights, momentum, variance); "
        "here, in fp32, AdamW's two moments, the parameters being the master weights.\n",
    ])


def accounting_setup(rows: list[Row]) -> str:
    return (f"{setup_sentence(rows)} All variants wrap torch DDP (25 MB buckets). 'model peak': "
            "cs336_systems.accounting.memory; 'sent per rank' is what a ring moves: 2(N-1)/N of an all-reduce's "
            "payload, (N-1)/N of a broadcast's.\n")


def equivalence_text(rows: list[Row]) -> str:
    equivalence = select(rows, table="equivalence")
    if not equivalence:
        return ""
    first = equivalence[0]
    return (f"ShardedOptimizer(AdamW) against AdamW on the {first['model']}, {first['steps']} steps on the same "
            f"batches on every rank ({first['world_size']} ranks, {first['backend']}). Each rank's state is the "
            "share of AdamW's it holds.\n\n"
            + markdown_table(equivalence, ["sync", "world_size", "backend", "steps", "max_abs_difference",
                                           "state_share_min", "state_share"])
            + "\n" + "\n".join(
                f"- {r['sync']}: " + ("identical to AdamW" if r["max_abs_difference"] == 0 else
                                      f"largest difference {r['max_abs_difference']:.3g}")
                + f"; each rank holds {span([r['state_share_min'], r['state_share']], '{:.0%}'.format)} of the state."
                for r in equivalence) + "\n")


def is_sharded_step(row: Row) -> bool:
    return row.get("table") == "step" and row["status"] == "ok" and row["variant"].startswith("DDP + ShardedOptimizer")


def resynchronisation_text(rows: list[Row]) -> str:
    steps = [r for r in rows if is_sharded_step(r)]
    if not steps:
        return ""
    return ("## Re-synchronising the parameters\n\nOptimizer step time (the update and the "
            "re-synchronisation) with each method, from the optimizer_state_sharding_accounting run:\n")


def fastest_resynchronisation(rows: list[Row]) -> str:
    steps = [r for r in rows if is_sharded_step(r)]
    return f"Here {min(steps, key=lambda r: r['optimizer_ms'])['variant']} is the faster.\n" if steps else ""


# ---------------------------------------------------------------------------------------------- answers

MEMORY_POINTS = ("init", "before optimizer step", "after optimizer step")  # the points the handout asks for


def answer_optimizer_state_sharding(reports: Reports) -> list[str]:
    sentences = []
    if "optimizer_state_sharding" in reports:
        equivalence = select(reports["optimizer_state_sharding"], table="equivalence")
        if equivalence:
            sentences.append("ShardedOptimizer(AdamW) against AdamW: " + "; ".join(
                f"{r['sync']} re-synchronisation differs by at most {r['max_abs_difference']:.3g}, each rank holding "
                f"{span([r['state_share_min'], r['state_share']], format_share)} of the state"
                for r in equivalence) + ".")
        else:
            sentences.append(not_in_report("The comparison with unsharded AdamW"))
    if "optimizer_state_sharding_accounting" in reports:
        rows = reports["optimizer_state_sharding_accounting"]
        steps = steps_by_variant(rows)
        if not steps:
            return sentences + [not_in_report("A measured training step")]
        measured = "step time and peak memory" if any(r.get("peak_gib") for r in steps.values()) else "step time"
        sentences.append(f"{step_setup(next(iter(steps.values())))}, {measured}: " + "; ".join(
            f"{name} {format_ms(r['step_ms'])}" + (f", {r['peak_gib']:.3g} GiB" if r.get("peak_gib") else "")
            for name, r in steps.items()) + ".")
        points = []
        for variant in steps:
            at = {r["point"]: r.get("allocated_gib") for r in select(rows, table="memory", variant=variant)}
            allocated = [at.get(point) for point in MEMORY_POINTS]
            if None not in allocated:
                points.append(f"{variant} " + " / ".join(f"{gib:.3g}" for gib in allocated) + " GiB")
        sentences.append("Allocated after initialisation / before / after the optimizer step: " + "; ".join(points)
                         + "." if points else not_in_report("Memory at the phase points (a GPU run measures it)"))
    return sentences
