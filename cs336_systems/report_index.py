"""The reports' index, `reports/README.md`: every problem's written answers in a few sentences whose
figures are read from its reports' rows, with links to its tables and plots, and, for each device,
the reports that are absent and the run that would write them.

    python -m cs336_systems index                   # writes reports/README.md
    write_index("reports")

Device reports live in `<reports>/<gpu-slug>/<problem>.md` (+ `.csv`, `.png`); the closed-form
communication_accounting report lives in `<reports>/` itself. A problem's answer function turns the
rows of its reports (`cs336_systems.reports.read_rows`) into sentences; where a row it quotes is not
in the report, the sentence says so instead of guessing. The index carries no date of its own (only
those quoted from report headers), so writing it again from the same reports gives the same bytes.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cs336_systems.accounting.ddp import optimal_bucket_bytes
from cs336_systems.benchmarks.attention import oom_when
from cs336_systems.benchmarks.parallelism_calcs import ANALYSIS_COMMAND, NODE_SIZE
from cs336_systems.benchmarks.e2e import PHASE_LABELS
from cs336_systems.benchmarks.flash import PROVIDER_LABELS
from cs336_systems.benchmarks.fsdp import OURS as OUR_FSDP
from cs336_systems.benchmarks.fsdp import TORCH_DDP, TORCH_FSDP
from cs336_systems.benchmarks.gradient_checkpointing import HANDOUT_CHECKPOINT_CONTEXT as CHECKPOINT_CONTEXT
from cs336_systems.benchmarks.memory_profiling import HANDOUT_MEMORY_CONTEXTS
from cs336_systems.benchmarks.nsys_profile import ATTENTION_RANGES, SOFTMAX_FLOPS_PER_SCORE, STEP_RANGE
from cs336_systems.distributed.ddp import BYTES_PER_MB
from cs336_systems.gpus import GB, GPU_SPECS, MB
from cs336_systems.model import DEFAULT_SIZE_TABLE as CURRENT_SIZE_TABLE
from cs336_systems.model import model_sizes, size_order
from cs336_systems.profiling.kernels import short_name
from cs336_systems.reports import (
    NOISY,
    NOISY_RELATIVE_STD,
    OOM,
    UNRECORDED_SIZE_TABLE,
    Reports,
    Row,
    find,
    format_bytes,
    format_ms,
    format_ratio,
    format_share,
    is_noisy,
    listing,
    markdown_table,
    mean_std,
    not_in_report,
    ok_rows,
    plural,
    read_rows,
    select,
    span,
)

INDEX_FILE = "README.md"
DEFAULT_REPORTS_ROOT = "reports"
INDEX_COMMAND = "python -m cs336_systems index"
CPU_SLUG = "cpu"
CPU_NOTE = (f"The `{CPU_SLUG}/` reports come from a CPU run: Triton kernels ran in the Triton interpreter and every "
            "time there is a CPU time, which shows that the code runs, not how fast a GPU runs it.\n")
KERNEL_NAME_CHARS = 60
# The training steps the first answer quotes: the two largest sizes measured, at context 512.
HEADLINE_SIZE_COUNT = 2
HEADLINE_CONTEXT = 512
# The accumulation experiment's definition (cs336_systems.benchmarks.mixed_precision): 0.01 added 1000 times.
ADDEND, ADDITIONS = 0.01, 1000
# The v5p mesh the communication_accounting question names: X = 16 (FSDP) by Y = 4 (TP).
ASKED_MESH = (16, 4)

Answer = Callable[[Reports], list[str]]


@dataclass(frozen=True)
class Problem:
    title: str  # as the assignment names it
    reports: tuple[str, ...]  # its report files, without extension; none for a correctness-only problem
    answer: Answer
    marker: str = ""  # the perf marker whose run writes its reports
    gpus: int = 1  # GPUs that run needs on a GPU machine
    device_independent: bool = False  # computed in closed form, reported once in the reports' root
    # What the reports' rows leave unanswered (a part not measured, an old run), beyond absent reports.
    open_items: Callable[[Reports], list[str]] | None = None


# ------------------------------------------------------------------------------------------ formatting

def _mean_std(row: Row) -> str:
    return mean_std(row["mean_ms"], row["std_ms"], ",.1f", ".1f", unit="ms")


def _noisy(*rows: Row, prefix: str = "") -> bool:
    """Whether any of these timings varied too much between repetitions to be read as one number."""
    return any(is_noisy(r[f"{prefix}mean_ms"], r[f"{prefix}std_ms"] or 0.0) for r in rows)


def _speedup(slow: Row, fast: Row) -> str:
    return format_ratio(slow["mean_ms"] / fast["mean_ms"]) + (f" ({NOISY})" if _noisy(slow, fast) else "")


def _decimal_size(num_bytes: float) -> str:
    return f"{num_bytes / GB:g} GB" if num_bytes >= GB else f"{num_bytes / MB:g} MB"


# ------------------------------------------------------------------------------- single-GPU problems

def _e2e_step(rows: list[Row], size: str, context: int, phase: str, precision: str = "fp32",
              compiled: bool = False) -> Row | None:
    row = find(rows, table="sweep", size=size, context_length=context, phase=phase, precision=precision,
               compile=compiled)
    return row if row and row.get("status") == "ok" else None


def _headline_cells(sweep: list[Row]) -> tuple[list[str], int]:
    """The sizes and context a training-step sentence quotes: the largest sizes the run measured, at the
    headline context, or, for a run that never measured that context (a CPU run of the tiny model), its
    largest size at its longest context."""
    steps = select(sweep, phase="train_step", precision="fp32", compile=False)
    if not steps or any(r["context_length"] == HEADLINE_CONTEXT for r in steps):
        largest = sorted({r["size"] for r in steps}, key=size_order, reverse=True)
        return largest[:HEADLINE_SIZE_COUNT], HEADLINE_CONTEXT
    largest = max(steps, key=lambda r: (size_order(r["size"]), r["context_length"]))
    return [largest["size"]], largest["context_length"]


def _benchmarking_script(reports: Reports) -> list[str]:
    rows = reports["benchmarking_script"]
    sweep = select(rows, table="sweep")
    sizes, context = _headline_cells(sweep)
    steps, batch_sizes = [], set()
    for size in sizes:
        step = find(sweep, size=size, context_length=context, phase="train_step", precision="fp32", compile=False)
        if step is None or step["status"] != "ok":
            steps.append(f"the {size} step is not in the report" if step is None else f"{size} ran out of memory")
            continue
        batch_sizes.add(step["batch_size"])
        phases = [(p, _e2e_step(sweep, size, context, p)) for p in ("forward", "backward", "optimizer")]
        detail = ", ".join(f"{p} {format_ms(r['mean_ms'])}" for p, r in phases if r)
        steps.append(f"{size} takes {_mean_std(step)}" + (f" ({detail})" if detail else ""))
    batch = f"batch {listing(sorted(map(str, batch_sizes)))}, " if batch_sizes else ""
    sentences = [f"A training step (forward, backward, AdamW) at {batch}context {context}, fp32, eager: "
                 + "; ".join(steps) + "." if steps else not_in_report("An fp32 eager training step")]
    measured = [r for r in ok_rows(sweep) if r["mean_ms"] > 0]
    if measured:
        spreads = [r["std_ms"] / r["mean_ms"] for r in measured]
        worst = max(measured, key=lambda r: r["std_ms"] / r["mean_ms"])
        noisy = sum(_noisy(r) for r in measured)
        sentences.append(f"Over the {plural(len(measured), 'measured cell')} the std is a median "
                         f"{statistics.median(spreads):.1%} of the mean (largest: {worst['size']} at context "
                         f"{worst['context_length']}, {PHASE_LABELS[worst['phase']]}, {max(spreads):.1%})"
                         + (f"; {noisy} of them vary by more than {NOISY_RELATIVE_STD:.0%} and are marked noisy."
                            if noisy else "."))
    cold = [r for r in ok_rows(select(rows, table="warmup", phase="train_step", warmup=0)) if r.get("first_ms")]
    warm = [r for r in ok_rows(select(rows, table="warmup", phase="train_step")) if r["warmup"] in (1, 2)]
    if cold and warm:
        slowest = max(cold, key=lambda r: r["first_ms"] / r["median_ms"])
        mildest = min(cold, key=lambda r: r["first_ms"] / r["median_ms"])
        warmed = max(select(rows, table="warmup", phase="train_step", size=slowest["size"]), key=lambda r: r["warmup"])
        first_step = (f"{format_ratio(slowest['first_ms'] / slowest['median_ms'])}" if mildest is slowest else
                      f"{format_ratio(mildest['first_ms'] / mildest['median_ms'])} ({mildest['size']}) to "
                      f"{format_ratio(slowest['first_ms'] / slowest['median_ms'])} ({slowest['size']})")
        sentences.append(
            f"Without warm-up the first timed step takes {first_step} the median step, so {slowest['size']}'s "
            f"{slowest['steps']}-step mean is {_mean_std(slowest)} against {_mean_std(warmed)} after "
            f"{plural(warmed['warmup'], 'warm-up step')}; after 1 or 2 warm-up steps the first timed step is at most "
            f"{format_ratio(max(r['first_ms'] / r['median_ms'] for r in warm))} the median.")
    else:
        sentences.append(not_in_report("The warm-up study"))
    return sentences


def _nsys_cells(rows: list[Row]) -> dict[tuple[str, int], dict]:
    """(size, context) -> {"cell": row, "range": {name: row}, "kernels": {range: rows by rank}} for cells that ran."""
    cells: dict[tuple[str, int], dict] = {}
    for r in select(rows, table="cell"):
        if r["status"] == "ok":
            cells[(r["size"], r["context_length"])] = {"cell": r, "range": {}, "kernels": {}}
    for r in rows:
        cell = cells.get((r.get("size"), r.get("context_length")))
        if cell is not None and r.get("table") == "range":
            cell["range"][r["range"]] = r
        elif cell is not None and r.get("table") == "kernel":
            cell["kernels"].setdefault(r["range"], []).append(r)
    for cell in cells.values():
        for kernels in cell["kernels"].values():
            kernels.sort(key=lambda r: r["rank"])
    return {key: c for key, c in cells.items() if "forward" in c["range"] and STEP_RANGE in c["range"]}


def _nsys_profile(reports: Reports) -> list[str]:
    rows = reports["nsys_profile"]
    cells = _nsys_cells(rows)
    if not cells:
        return [not_in_report("A profiled cell that ran to completion")]
    at_headline = [key for key in cells if key[1] == HEADLINE_CONTEXT] or list(cells)
    size, context = max(at_headline, key=lambda key: (size_order(key[0]), key[1]))
    shown = cells[(size, context)]
    sample = shown["cell"]
    ooms = [f"{r['size']} at context {r['context_length']}" for r in select(rows, table="cell", status=OOM)]
    forward_kernels = shown["kernels"].get("forward", [])
    sentences = []
    if forward_kernels:
        top = forward_kernels[0]
        other = next((k for k in forward_kernels if k.get("matmul") is False), None)
        sentences.append(
            f"Kernel tables from torch.profiler ({sample['attention']} attention, {sample['precision']}, batch "
            f"{sample['batch_size']}); at {size}, context {context}, the top forward kernel is "
            f"`{short_name(top['kernel'], KERNEL_NAME_CHARS)}` ({'a matmul, ' if top.get('matmul') else ''}"
            f"{top['share']:.1%} of forward kernel time, {top['calls_per_instance']:g} launches per forward pass)"
            + (f" and the largest non-matmul one `{short_name(other['kernel'], KERNEL_NAME_CHARS)}` "
               f"({other['share']:.1%})" if other else "")
            + (f"; out of memory: {listing(ooms)}." if ooms else "."))
    else:
        sentences.append(not_in_report(f"The forward kernel table of {size} at context {context}"))
    forward_shares = [c["range"]["forward"]["matmul_share"] for c in cells.values()]
    step_shares = [c["range"][STEP_RANGE]["matmul_share"] for c in cells.values()]
    sentences.append(
        f"Matmuls take {format_share(shown['range']['forward']['matmul_share'])} of forward kernel time and "
        f"{format_share(shown['range'][STEP_RANGE]['matmul_share'])} of the full training step there "
        f"({span(forward_shares, format_share)} and {span(step_shares, format_share)} over the "
        f"{plural(len(cells), 'profiled cell')})"
        + (f"; the optimizer's share is {format_share(shown['range']['optimizer']['matmul_share'])}."
           if "optimizer" in shown["range"] else "."))
    excess = {}
    for key, c in cells.items():
        if all(name in c["range"] for name in ATTENTION_RANGES):
            scores, softmax, final = (c["range"][name] for name in ATTENTION_RANGES)
            matmul_ms = scores["matmul_ms"] + final["matmul_ms"]
            if matmul_ms:
                flop_ratio = SOFTMAX_FLOPS_PER_SCORE / (4 * c["cell"]["d_head"])
                excess[key] = (softmax["work_ms"] / matmul_ms, flop_ratio)
    if (size, context) in excess:
        time_ratio, flop_ratio = excess[(size, context)]
        over_cells = span([t / f for t, f in excess.values()], "{:.0f}x".format)
        sentences.append(
            f"Inside attention softmax takes {time_ratio:.2f}x the matmuls' time against {flop_ratio:.2%} of their "
            f"FLOPs, {time_ratio / flop_ratio:.0f}x its FLOP share ({over_cells} over the cells): it is paced by "
            "memory traffic, not arithmetic.")
    else:
        sentences.append(not_in_report(f"The attention ranges (scores, softmax, final matmul) of {size} at context "
                                        f"{context}"))
    return sentences


def _mixed_precision_accumulation(reports: Reports) -> list[str]:
    variants = {r["variant"]: r for r in reports["mixed_precision_accumulation"]}
    if not variants:
        return [not_in_report("An accumulation variant")]
    sentences = [f"Adding {ADDEND:g} {ADDITIONS} times (exact sum {ADDEND * ADDITIONS:g}): "
                 + "; ".join(f"{name} gives {r['result']:.6g} (error {r['abs_error']:.3g})"
                             for name, r in variants.items()) + "."]
    pure, mixed = variants.get("fp16 += fp16"), variants.get("fp32 += fp16")
    if pure and mixed and math.isclose(mixed["result"], mixed["exact_sum_of_stored_addend"], rel_tol=1e-9):
        sentences.append(
            f"With an fp32 accumulator the fp16 addend costs only its own rounding ({ADDITIONS} x fp16({ADDEND:g}) = "
            f"{mixed['exact_sum_of_stored_addend']:.6g}), while the fp16 accumulator's error is "
            f"{pure['abs_error'] / mixed['abs_error']:.0f}x larger as its spacing grows with the sum: accumulate in "
            "fp32.")
    return sentences


def _benchmarking_mixed_precision(reports: Reports) -> list[str]:
    rows = reports["benchmarking_mixed_precision"]
    clauses = []
    dtypes = select(rows, table="autocast_dtypes")
    if dtypes:
        by_dtype: dict[str, list[str]] = {}
        for r in dtypes:
            by_dtype.setdefault(r["dtype"], []).append(r["tensor"])
        clauses.append(f"Under {dtypes[0]['autocast']} autocast on {dtypes[0]['device']} the toy model's "
                       + "; ".join(f"{listing(tensors)} {'is' if len(tensors) == 1 else 'are'} {dtype}"
                                   for dtype, tensors in by_dtype.items()))
    else:
        clauses.append("The autocast dtype table is not in the report")
    norms = {r["storage_dtype"]: r for r in select(rows, table="normalization")}
    if "float16" in norms and "bfloat16" in norms:
        fp16, bf16 = norms["float16"], norms["bfloat16"]
        clauses.append("the mean of squares of the report's test row "
                       + ("overflows to inf" if math.isinf(fp16["mean_square"]) else
                          f"is off by {fp16['relative_error']:.2%}")
                       + f" in fp16 and is off by {bf16['relative_error']:.2%} in bf16")
    sentences = ["; ".join(clauses) + "."]
    sweep = ok_rows(select(rows, table="sweep"))
    sizes = sorted({r["size"] for r in sweep}, key=size_order)
    if not sizes:
        sentences.append(not_in_report("The fp32 against bf16 timing sweep"))
        return sentences
    largest, smallest = sizes[-1], sizes[0]
    speedups = []
    for context in sorted({r["context_length"] for r in sweep if r["size"] == largest}):
        fp32, bf16 = (_e2e_step(sweep, largest, context, "train_step", p) for p in ("fp32", "bf16"))
        if fp32 and bf16:
            speedups.append(f"{_speedup(fp32, bf16)} at context {context} "
                            f"({format_ms(fp32['mean_ms'])} -> {format_ms(bf16['mean_ms'])})")
    if not speedups:
        sentences.append(not_in_report(f"A {largest} training step in both fp32 and bf16"))
        return sentences
    text = f"bf16 autocast over fp32 for a {largest} training step (eager): " + ", ".join(speedups)
    first_context = min(r["context_length"] for r in sweep if r["size"] == smallest)
    fp32, bf16 = (_e2e_step(sweep, smallest, first_context, "train_step", p) for p in ("fp32", "bf16"))
    if smallest != largest and fp32 and bf16:
        text += (f"; at {smallest}, context {first_context}, it is {_speedup(fp32, bf16)}"
                 + (" (bf16 slower)" if bf16["mean_ms"] > fp32["mean_ms"] else ""))
    sentences.append(text + ".")
    return sentences


MEMORY_MODE_LABELS = {"inference": "forward only (no_grad)", "train_step": "a training step"}


def _memory_profiling(reports: Reports) -> list[str]:
    rows = reports["memory_profiling"]
    peaks = select(rows, table="peak")
    if not peaks:
        return [not_in_report("A peak-memory cell")]
    on_gpu = any(r.get("peak_bytes") is not None for r in peaks)
    column = "peak_bytes" if on_gpu else "peak_increase_bytes"
    first = peaks[0]
    groups = []
    for mode, label in MEMORY_MODE_LABELS.items():
        for precision in dict.fromkeys(r["precision"] for r in peaks):
            cells = sorted(select(peaks, mode=mode, precision=precision), key=lambda r: r["context_length"])
            if not cells:
                continue
            values = [format_bytes(r[column], "bytes") if r["status"] == "ok" else OOM for r in cells]
            contexts = " / ".join(str(r["context_length"]) for r in cells)
            shown = (f"out of memory at every context ({contexts})" if set(values) == {OOM} else
                     f"{' / '.join(values)} at context {contexts}")
            groups.append(f"{label} in {precision}: {shown}")
    training_phases = {r["predicted_phase"] for r in ok_rows(select(peaks, mode="train_step"))
                       if r.get("predicted_phase")}
    sentences = [f"Peak memory{'' if on_gpu else ' above the start'} of {first['size']}, batch {first['batch_size']}, "
                 f"{first['attention']} attention: " + "; ".join(groups)
                 + (f" (the memory model places the training step's peak at the {training_phases.pop()})."
                    if len(training_phases) == 1 else ".")]
    residual = select(rows, table="residual")
    if residual:
        r = residual[0]
        match = all(x["measured_bytes"] == x["computed_bytes"] for x in residual)
        sentences.append(
            f"One residual-stream tensor at context {r['context_length']} is {r['batch_size']} x {r['context_length']} "
            f"x {r['d_model']} x 4 bytes = {format_bytes(r['computed_bytes'], 'bytes')}; the first block's output "
            "measured " + listing([f"{format_bytes(x['measured_bytes'], 'bytes')} ({x['dtype']}) under "
                                   f"{x['precision']}" for x in residual])
            + (", as computed." if match else ", which differs from the computed size."))
    else:
        sentences.append(not_in_report("The residual-stream size"))
    tops = select(rows, table="allocation", rank=1)
    if tops:
        top = select(tops, mode="train_step")[0] if select(tops, mode="train_step") else tops[0]
        sentences.append(f"The largest allocations of {MEMORY_MODE_LABELS[top['mode']]} in {top['precision']} at "
                         f"context {top['context_length']} are {top['count']} blocks of {top['size_mib']:.2f} MiB from "
                         f"`{top['source']}`.")
    blocks = ok_rows(select(rows, table="block"))
    if blocks:
        block = blocks[len(blocks) // 2]
        operations = sorted(select(rows, table="block_operation", precision=block["precision"]),
                            key=lambda r: r["rank"])
        text = (f"(f) In {block['precision']} at context {block['context_length']} a block saves "
                f"{format_bytes(block['saved_bytes'], 'bytes')} for backward (the model: "
                f"{format_bytes(block['predicted_saved_bytes'], 'bytes')})")
        if operations:
            text += (", " + format_share(sum(r["share"] for r in operations)) + " of it allocated by "
                     + listing([f"`{r['operation']}` ({format_share(r['share'])})" for r in operations]))
        text += (f"; its weight gradients take {format_bytes(block['weight_gradient_bytes'], 'bytes')}, 4 bytes for "
                 f"each of its {block['parameters']:,} parameters")
        if block.get("gradient_bytes") is not None:
            text += (f", and the allocator saw its backward add {format_bytes(block['gradient_bytes'], 'bytes')} of "
                     "gradients")
        sentences.append(text + ".")
    return sentences


def _memory_profiling_open(reports: Reports) -> list[str]:
    rows = reports["memory_profiling"]
    gaps = []
    if not select(rows, table="block"):
        gaps.append("part (f), residuals and gradients per block")
    if not select(rows, table="snapshot"):
        gaps.append("the memory_viz snapshots beside the report")
    contexts = {r["context_length"] for r in select(rows, table="peak")}
    missing = [str(n) for n in HANDOUT_MEMORY_CONTEXTS if n not in contexts]
    if missing:
        gaps.append(f"the 2026 handout's context {listing(missing)}")
    return [f"not in this run: {listing(gaps)} (`make single-gpu-reports` measures them)"] if gaps else []


def _gradient_checkpointing_open(reports: Reports) -> list[str]:
    sweep = select(reports["gradient_checkpointing"], table="sweep")
    if any(r.get("context_length") == CHECKPOINT_CONTEXT for r in sweep):
        return []
    return [f"the 2026 handout's (b) is xl at batch 4, context {CHECKPOINT_CONTEXT:,}; this run measured context "
            + listing(sorted({str(r["context_length"]) for r in sweep})) + " (`make single-gpu-reports` runs it)"]


def _nsys_profile_open(reports: Reports) -> list[str]:
    ranges = select(reports["nsys_profile"], table="range")
    if ranges and not any("self_work_ms" in r for r in ranges):
        return ["its kernel tables predate kernels being attributed once each (a kernel could count twice); "
                "`make single-gpu-reports` measures them again"]
    return []


def _every(k: int) -> str:
    return f"every {k} block{'s' if k != 1 else ''}"


def _plan_label(r: Row) -> str:
    if r["plan_kind"] == "every_k":
        return "no checkpointing" if r["k"] == "none" else _every(r["k"])
    return f"the optimal nested plan with {r['levels']} recomputation level{'s' if r['levels'] != 1 else ''}"


def _gradient_checkpointing(reports: Reports) -> list[str]:
    sweep = select(reports["gradient_checkpointing"], table="sweep")
    single = [r for r in ok_rows(sweep) if r["plan_kind"] == "every_k" and r["k"] != "none"]
    if not single:
        return [not_in_report("A single-level checkpoint plan that fit in memory")]
    r0 = single[0]
    layers, a, b = r0["num_layers"], r0["block_bytes"], r0["boundary_bytes"]
    best = min(single, key=lambda r: r["measured_peak_bytes"])
    rule = math.sqrt(layers)
    nearest = min(single, key=lambda r: abs(r["k"] - rule))
    none = find(sweep, plan_kind="every_k", k="none")
    baseline = (f"{format_bytes(none['measured_peak_bytes'], 'bytes')} without checkpointing, "
                if none and none["status"] == "ok" else "")
    sentences = [
        f"{r0['size']} ({layers} blocks), batch {r0['batch_size']}, context {r0['context_length']}, {r0['precision']}: "
        f"peak activation memory is {baseline}{format_bytes(best['measured_peak_bytes'], 'bytes')} at the best single "
        f"level ({_every(best['k'])}) and {format_bytes(nearest['measured_peak_bytes'], 'bytes')} at "
        f"{_every(nearest['k'])}, the measured k nearest the sqrt(L) estimate sqrt({layers}) = {rule:.1f}."]
    ooms = [_plan_label(r) for r in sweep if r["status"] == OOM]
    sentences.append(
        f"That estimate assumes a block keeps what a checkpoint boundary keeps; here it keeps {a / b:.0f}x as much, "
        f"which moves the optimum to sqrt(L b / a) = {math.sqrt(layers * b / a):.2f}"
        + (f" (out of memory at this context: {listing(ooms)})." if ooms else "."))
    nested = {r["levels"]: r for r in ok_rows(sweep) if r["plan_kind"] == "optimal"}
    unlimited, two = nested.get("unlimited"), nested.get(2)
    if unlimited:
        text = (f"The memory-optimal strategy nests checkpointed groups inside each other: with unlimited "
                f"recomputation it peaks at {format_bytes(unlimited['measured_peak_bytes'], 'bytes')}, recomputing "
                f"{plural(unlimited['recomputed_blocks'], 'block forward pass', 'block forward passes')} per step "
                f"in the {layers}-block model ({format_ratio(unlimited['step_ms'] / best['step_ms'])} the step time of "
                f"{_every(best['k'])}), O(1) memory for O(L^2) recomputation")
        if two:
            text += (f"; two levels reach {format_bytes(two['measured_peak_bytes'], 'bytes')} for "
                     f"{plural(two['recomputed_blocks'], 'recomputed block')} "
                     f"({format_ratio(two['step_ms'] / best['step_ms'])})")
        sentences.append(text + ".")
    else:
        sentences.append(not_in_report("The optimal nested plan with unlimited recomputation"))
    return sentences


def _pytorch_attention(reports: Reports) -> list[str]:
    rows = [r for r in reports["pytorch_attention"] if not r.get("compile")]
    if not rows:
        return [not_in_report("An eager attention cell")]
    r0 = rows[0]
    timed = [r for r in ok_rows(rows) if r.get("backward_mean_ms") is not None]
    sentences = []
    if timed:
        largest = max(timed, key=lambda r: (r["seq_len"], r["head_dim"]))
        memory = largest.get("memory_before_backward_bytes")
        sentences.append(
            f"Naive attention, batch {r0['batch_size']}, {r0['precision']}, {r0['passes']} passes each: the largest "
            f"cell that ran, d={largest['head_dim']}, N={largest['seq_len']}, takes "
            f"{format_ms(largest['forward_mean_ms'])} forward and {format_ms(largest['backward_mean_ms'])} backward"
            + (f" with {format_bytes(memory, 'bytes')} in use before backward." if memory is not None else "."))
    ooms = select(rows, status=OOM)
    if ooms:
        ooms.sort(key=lambda r: (r["seq_len"], r["head_dim"]))
        smallest = ooms[0]
        at_first = select(ooms, seq_len=smallest["seq_len"])
        text = f"Out of memory from N={smallest['seq_len']} (" + ", ".join(
            f"d={r['head_dim']} {oom_when(r)}" for r in at_first) + ")"
        if smallest.get("predicted_before_backward_bytes") is not None:
            text += (f"; the closed-form accounting puts d={smallest['head_dim']}, N={smallest['seq_len']} at "
                     f"{format_bytes(smallest['predicted_before_backward_bytes'], 'bytes')} in use before backward and "
                     f"{format_bytes(smallest['predicted_backward_peak_bytes'], 'bytes')} at the backward's peak")
            if smallest.get("device_memory_bytes"):
                text += f", against {format_bytes(smallest['device_memory_bytes'], 'bytes')} of device memory"
        sentences.append(text + ".")
    else:
        sentences.append(f"No configuration ran out of memory, up to N={max(r['seq_len'] for r in rows)}.")
    return sentences


def _torch_compile(reports: Reports) -> list[str]:
    rows = reports["torch_compile"]
    sweep = ok_rows(select(rows, table="sweep"))
    cells = {(r["size"], r["context_length"], r["precision"]) for r in sweep if r["phase"] == "train_step"}
    speedups = {}
    for size, context, precision in cells:
        eager, compiled = (_e2e_step(sweep, size, context, "train_step", precision, c) for c in (False, True))
        if eager and compiled:
            speedups[(size, context, precision)] = (eager, compiled)
    sentences = []
    if speedups:
        ratios = [e["mean_ms"] / c["mean_ms"] for e, c in speedups.values() if not _noisy(e, c)]
        noisy = len(speedups) - len(ratios)
        left_out = f"; {plural(noisy, 'noisy cell')} left out" if noisy else ""
        if ratios:
            sentences.append(f"Compiling each Transformer block makes the whole-model training step "
                             f"{span(ratios, format_ratio)} as fast as eager over {len(ratios)} size, context and "
                             f"precision {'cell' if len(ratios) == 1 else 'cells'} (median "
                             f"{format_ratio(statistics.median(ratios))}{left_out}).")
        else:
            sentences.append(f"Every eager and compiled training step here is noisy (std above "
                             f"{NOISY_RELATIVE_STD:.0%} of the mean), so no speed-up is read from them.")
        largest = max(speedups, key=lambda key: (size_order(key[0]), key[1] == HEADLINE_CONTEXT, key[1]))
        size, context = largest[:2]
        shown = [f"{precision} {format_ms(e['mean_ms'])} -> {format_ms(c['mean_ms'])}, {_speedup(e, c)}"
                 for (s, n, precision), (e, c) in sorted(speedups.items(), key=lambda item: item[0][2], reverse=True)
                 if (s, n) == (size, context)]
        sentences.append(f"At {size}, context {context}: " + ", ".join(shown) + ".")
    else:
        sentences.append(not_in_report("A whole-model training step both eager and compiled"))
    attention = [r for r in select(rows, table="attention") if r.get("status") == "ok"]
    pairs: dict[tuple, dict[bool, Row]] = {}
    for r in attention:
        pairs.setdefault((r["head_dim"], r["seq_len"]), {})[bool(r["compile"])] = r
    ratios, noisy = {}, {}
    for phase in ("forward", "backward"):
        timed = [p for p in pairs.values() if len(p) == 2 and all(r.get(f"{phase}_mean_ms") for r in p.values())]
        steady = [p for p in timed if not _noisy(*p.values(), prefix=f"{phase}_")]
        ratios[phase] = [p[False][f"{phase}_mean_ms"] / p[True][f"{phase}_mean_ms"] for p in steady]
        noisy[phase] = len(timed) - len(steady)
    parts = []
    for phase, values in ratios.items():
        if values:
            parts.append(f"{phase} {span(values, format_ratio)}"
                         + (f" ({plural(noisy[phase], 'noisy cell')} left out)" if noisy[phase] else ""))
        elif noisy[phase]:
            parts.append(f"{phase} noisy in every cell")
    if parts:
        sentences.append(f"Naive attention alone, compiled over eager ({plural(len(pairs), 'cell')}): "
                         + ", ".join(parts) + ".")
    else:
        sentences.append(not_in_report("The attention sweep compiled against eager (rows of table `attention`, "
                                        "which the `-m attention` perf run writes)"))
    return sentences


def _flash_forward_backward(reports: Reports) -> list[str]:
    return ["No report of their own: these are correctness problems, run on every machine by "
            "`pytest tests/test_flash_attention.py` (output, logsumexp and gradients against a float64 reference, L "
            "as the only tensor saved per query row, causal masking), for the tiled PyTorch and the Triton "
            "Functions; their speed is measured under flash_benchmarking."]


def _flash_benchmarking(reports: Reports) -> list[str]:
    rows = reports["flash_benchmarking"]
    sweep = select(rows, table="sweep")
    sentences = []
    index = {(r["precision"], r["mode"], r["head_dim"], r["seq_len"], r["provider"]): r for r in ok_rows(sweep)}
    for precision in dict.fromkeys(r["precision"] for r in sweep):
        both = [(d, n) for (p, mode, d, n, provider) in index if (p, mode, provider) ==
                (precision, "forward_backward", "naive") and (p, mode, d, n, "flash_triton") in index]
        if not both:
            continue
        d, n = max(both, key=lambda dn: (dn[1], dn[0]))
        triton, naive, sdpa = (index.get((precision, "forward_backward", d, n, provider))
                               for provider in ("flash_triton", "naive", "sdpa"))
        ooms = [r["seq_len"] for r in select(sweep, precision=precision, provider="naive", status=OOM)]
        sentences.append(
            f"{precision}, causal, forward+backward at the largest N where naive attention ran (d={d}, N={n}): Triton "
            f"{format_ms(triton['median_ms'])} against naive {format_ms(naive['median_ms'])} (naive takes "
            f"{naive['median_ms'] / triton['median_ms']:.3g}x Triton's time)"
            + (f" and SDPA {format_ms(sdpa['median_ms'])}" if sdpa else "")
            + (f"; naive runs out of memory from N={min(ooms)}." if ooms else "."))
    if not sentences:
        sentences.append(not_in_report("A forward+backward cell where both Triton and naive attention ran"))
    leaderboard = ok_rows(select(rows, table="leaderboard"))
    if leaderboard:
        r0 = leaderboard[0]
        sentences.append(
            f"Leaderboard configuration (batch {r0['batch_size']}, {r0['n_heads']} heads, d {r0['head_dim']}, "
            f"N {r0['seq_len']:,}, {r0['precision']}, causal, forward+backward): "
            + ", ".join(f"{PROVIDER_LABELS.get(r['provider'], r['provider'])} {format_ms(r['median_ms'])}"
                        for r in leaderboard) + ".")
    else:
        sentences.append(not_in_report("The leaderboard configuration"))
    return sentences


# ------------------------------------------------------------------------------ distributed problems

def _allreduce(reports: Reports) -> list[str]:
    rows = reports["distributed_communication_single_node"]
    sentences = []
    for backend, device in (("gloo", "CPU"), ("nccl", "GPUs")):
        mine = [r for r in select(rows, backend=backend) if r.get("status") != OOM]
        if not mine:
            sentences.append(not_in_report(f"{backend} on {device}") if backend == "gloo" else
                             not_in_report("NCCL on GPUs (it needs 2 GPUs)"))
            continue
        fewest = min(r["world_size"] for r in mine)
        line = sorted(select(mine, world_size=fewest), key=lambda r: r["size_bytes"])
        small, large = line[0], line[-1]
        text = (f"{backend} on {device}, {fewest} ranks: {format_ms(small['mean_rank_median_ms'])} for "
                f"{_decimal_size(small['size_bytes'])} ({small['busbw_gbps']:.3g} GB/s bus bandwidth) and "
                f"{format_ms(large['mean_rank_median_ms'])} for {_decimal_size(large['size_bytes'])} "
                f"({large['busbw_gbps']:.3g} GB/s)")
        at_size = sorted(select(mine, size_bytes=large["size_bytes"]), key=lambda r: r["world_size"])
        if len(at_size) > 1:
            text += (f"; at {_decimal_size(large['size_bytes'])} from {at_size[0]['world_size']} to "
                     f"{at_size[-1]['world_size']} ranks the time goes {format_ms(at_size[0]['mean_rank_median_ms'])} "
                     f"-> {format_ms(at_size[-1]['mean_rank_median_ms'])}")
        sentences.append(text + ".")
    return sentences


def _allreduce_open(reports: Reports) -> list[str]:
    rows = reports["distributed_communication_single_node"]
    gloo = {r["world_size"] for r in select(rows, backend="gloo")}
    missing = sorted(gloo - {r["world_size"] for r in select(rows, backend="nccl")})
    return [f"NCCL at {listing([str(n) for n in missing])} ranks: needs as many GPUs in one machine"] if missing else []


def _equivalence(rows: list[Row], methods: tuple[str, ...]) -> str:
    mine = [r for r in select(rows, table="equivalence") if r.get("method") in methods]
    if not mine:
        return not_in_report("The comparison with single-process training")
    r0 = mine[0]
    return (f"Against single-process training ({r0['world_size']} ranks, {r0['backend']}, {r0['steps']} steps): "
            + "; ".join(f"{r['variant']} differs by at most {r['max_abs_difference']:.3g} "
                        f"({'within' if r['matches'] else 'OUTSIDE'} the tolerance {r['tolerance']:g})" for r in mine)
            + ".")


def _ddp_steps(rows: list[Row]) -> dict[str, Row]:
    """Measured steps by variant."""
    return {r["variant"]: r for r in ok_rows(select(rows, table="step"))}


def _ddp_setup(step: Row) -> str:
    return (f"{step['size']}, context {step['context_length']}, batch {step['batch_size']} per rank on "
            f"{step['world_size']} ranks ({step['backend']})")


def _naive_ddp(reports: Reports) -> list[str]:
    sentences = []
    if "naive_ddp" in reports:
        sentences.append(_equivalence(reports["naive_ddp"], ("naive", "flat")))
    if "naive_ddp_benchmarking" in reports:
        steps = _ddp_steps(reports["naive_ddp_benchmarking"])
        naive, local = steps.get("naive"), steps.get("local")
        if naive:
            sentences.append(
                f"{_ddp_setup(naive)}: a naive DDP step takes {format_ms(naive['step_ms'])}, of which "
                f"{format_ms(naive['gradient_sync_ms'])} "
                f"({format_share(naive['gradient_sync_ms'] / naive['step_ms'])}) is its "
                f"{naive['all_reduces_per_step']} per-parameter all-reduces after backward"
                + (f"; without communication the step takes {format_ms(local['step_ms'])}." if local else "."))
        else:
            sentences.append(not_in_report("A measured naive DDP step"))
    return sentences


def _flat_ddp(reports: Reports) -> list[str]:
    steps = _ddp_steps(reports["minimal_ddp_flat_benchmarking"])
    naive, flat = steps.get("naive"), steps.get("flat")
    if not (naive and flat):
        return [not_in_report("A measured step of both naive and flat DDP")]
    return [f"{_ddp_setup(flat)}: one all-reduce of the flattened gradients leaves "
            f"{format_ms(flat['gradient_sync_ms'])} after backward against {format_ms(naive['gradient_sync_ms'])} for "
            f"{naive['all_reduces_per_step']} separate ones; steps take {format_ms(flat['step_ms'])} against "
            f"{format_ms(naive['step_ms'])}."]


def _overlap_individual(reports: Reports) -> list[str]:
    sentences = []
    if "ddp_overlap_individual_parameters" in reports:
        sentences.append(_equivalence(reports["ddp_overlap_individual_parameters"], ("overlap_individual",)))
    if "ddp_overlap_individual_parameters_benchmarking" in reports:
        steps = _ddp_steps(reports["ddp_overlap_individual_parameters_benchmarking"])
        overlap = steps.get("overlap_individual")
        if overlap:
            others = [f"{name} {format_ms(steps[name]['step_ms'])}" for name in ("naive", "flat") if name in steps]
            text = (f"{_ddp_setup(overlap)}: overlapping per-parameter all-reduces with backward gives "
                    f"{format_ms(overlap['step_ms'])} per step" + (f" (against {', '.join(others)})" if others else "")
                    + f", with {format_ms(overlap['gradient_sync_ms'])} left after backward")
            communication = overlap.get("profiled_communication_ms")
            if communication:
                text += (f"; {format_share(overlap['profiled_overlapped_ms'] / communication)} of its "
                         f"{format_ms(communication)} of communication ran beside compute")
            sentences.append(text + ".")
        else:
            sentences.append(not_in_report("A measured step of the overlapping DDP"))
    return sentences


def _bucketed(reports: Reports) -> list[str]:
    sentences = []
    if "ddp_overlap_bucketed" in reports:
        sentences.append(_equivalence(reports["ddp_overlap_bucketed"], ("bucketed",)))
    if "ddp_bucketed_benchmarking" not in reports:
        return sentences
    rows = reports["ddp_bucketed_benchmarking"]
    steps = _ddp_steps(rows)
    bucketed = [r for r in steps.values() if r["method"] == "bucketed"]
    if not bucketed:
        return sentences + [not_in_report("A measured step of bucketed DDP")]
    best, worst = min(bucketed, key=lambda r: r["step_ms"]), max(bucketed, key=lambda r: r["step_ms"])
    torch_ddp = steps.get("torch_ddp")
    sentences.append(f"{_ddp_setup(best)}: the fastest bucket size is {best['bucket_size_mb']:g} MB "
                     f"({format_ms(best['step_ms'])} per step, {format_ms(best['gradient_sync_ms'])} after "
                     f"backward), the slowest {worst['bucket_size_mb']:g} MB ({format_ms(worst['step_ms'])})"
                     + (f"; torch DDP takes {format_ms(torch_ddp['step_ms'])}." if torch_ddp else "."))
    probe = find(rows, table="allreduce_probe")
    if probe:
        model_bytes = best["trainable_bytes"]
        bucket_bytes = optimal_bucket_bytes(model_bytes, probe["algbw_gbps"] * GB, probe["per_call_overhead_ms"] * 1e-3)
        sentences.append(f"With the measured per-call cost o = {format_ms(probe['per_call_overhead_ms'])} and "
                         f"bandwidth w = {probe['algbw_gbps']:.3g} GB/s, the overhead model s / (n_b w) + n_b o puts "
                         f"the optimal bucket at sqrt(s w o) = {bucket_bytes / BYTES_PER_MB:.4g} MB for s = "
                         f"{model_bytes / GB:.3g} GB of gradients.")
    else:
        sentences.append(not_in_report("The all-reduce probe that gives the overhead model its o and w"))
    return sentences


SHARDING_MEMORY_POINTS = ("init", "before optimizer step", "after optimizer step")  # the points MISSION asks for


def _sharding(reports: Reports) -> list[str]:
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
        steps = _ddp_steps(rows)
        if not steps:
            return sentences + [not_in_report("A measured training step")]
        measured = "step time and peak memory" if any(r.get("peak_gib") for r in steps.values()) else "step time"
        sentences.append(f"{_ddp_setup(next(iter(steps.values())))}, {measured}: " + "; ".join(
            f"{name} {format_ms(r['step_ms'])}" + (f", {r['peak_gib']:.3g} GiB" if r.get("peak_gib") else "")
            for name, r in steps.items()) + ".")
        points = []
        for variant in steps:
            at = {r["point"]: r.get("allocated_gib") for r in select(rows, table="memory", variant=variant)}
            allocated = [at.get(point) for point in SHARDING_MEMORY_POINTS]
            if None not in allocated:
                points.append(f"{variant} " + " / ".join(f"{gib:.3g}" for gib in allocated) + " GiB")
        sentences.append("Allocated after initialisation / before / after the optimizer step: " + "; ".join(points)
                         + "." if points else not_in_report("Memory at the phase points (a GPU run measures it)"))
    return sentences


def _fsdp(reports: Reports) -> list[str]:
    sentences = []
    if "fsdp" in reports:
        equivalence = select(reports["fsdp"], table="equivalence")
        if equivalence:
            r0 = equivalence[0]
            verdicts = [f"{r['compute']} compute differs by at most {r['max_abs_difference']:.3g} "
                        f"({'within' if r['matches'] else 'OUTSIDE'} the tolerance {r['tolerance']:g}), master "
                        f"weights in {r['master_dtype']}" for r in equivalence]
            sentences.append(f"Against single-process training ({r0['world_size']} ranks, {r0['backend']}): "
                             + "; ".join(verdicts) + ".")
        else:
            sentences.append(not_in_report("The comparison with single-process training"))
    if "fsdp_accounting" in reports:
        rows = reports["fsdp_accounting"]
        steps = _ddp_steps(rows)
        shown = [f"{name} {format_ms(steps[name]['step_ms'])}"
                 + (f", peak {steps[name]['peak_gib']:.3g} GiB" if steps[name].get("peak_gib") else "")
                 for name in (OUR_FSDP, TORCH_FSDP, TORCH_DDP) if name in steps]
        sentences.append(f"{_ddp_setup(next(iter(steps.values())))}: " + "; ".join(shown) + "." if shown else
                         not_in_report("A measured FSDP training step"))
        readiness = select(rows, table="readiness")
        if readiness:
            sentences.append(f"In a profiled step {sum(r['on_time'] for r in readiness)} of "
                             f"{plural(len(readiness), 'all-gather')} finished before the layer that needs them; "
                             "compute waited "
                             f"{format_ms(sum(r['waited_ms'] for r in readiness))} in all.")
    return sentences


# --------------------------------------------------------------------------------------- analysis

def _communication_accounting(reports: Reports) -> list[str]:
    rows = reports["communication_accounting"]
    scalars = {r["name"]: r["value"] for r in select(rows, table="scalar")}
    model, total = find(rows, table="model"), find(rows, table="state", component="total")
    sentences = []
    if model and total and "state_h100s" in scalars and "activation_bytes_per_token" in scalars:
        sentences.append(
            f"(a) The XXL model has {model['num_params']:,} parameters; fp32 master weights, gradients and Adam's "
            f"moments take {total['gb']:,.2f} GB, {scalars['state_h100s']:.2f} H100 80GB GPUs' worth "
            f"({math.ceil(scalars['state_h100s'])} GPUs), and the activations saved for backward add "
            f"{scalars['activation_bytes_per_token'] / MB:.2f} MB per token in bf16.")
    else:
        sentences.append(not_in_report("The XXL model's memory"))
    fsdp = [r for r in select(rows, table="fsdp") if r.get("min_fsdp_devices") is not None]
    if fsdp and "fsdp_max_tokens" in scalars and "tpu_memory_bytes" in scalars:
        state_only = min(fsdp, key=lambda r: r["tokens"])
        most = max(fsdp, key=lambda r: r["tokens"])
        sentences.append(
            f"(b) On {scalars['tpu_memory_bytes'] / GB:g} GB devices the state alone needs N_FSDP >= "
            f"{state_only['min_fsdp_devices']}, and "
            f"{most['min_fsdp_devices']} with the activations of {most['tokens']:,} tokens; from "
            f"{scalars['fsdp_max_tokens']:,.0f} tokens on no N_FSDP is enough.")
    crossovers = [r for r in select(rows, table="crossover", strategy="fsdp_tp", exact_ring=False)
                  if r["comm_bytes_per_element"] == 2 and math.isfinite(r["min_tokens_per_device"])]
    asked = next((r for r in crossovers if (r["data_devices"], r["tensor_devices"]) == ASKED_MESH), None)
    if asked:
        best = min(crossovers, key=lambda r: r["min_tokens_per_device"])
        eight_bit = find(rows, table="crossover", mesh=asked["mesh"], exact_ring=False, comm_bytes_per_element=1)
        text = (f"(c, d) On the {asked['mesh']} v5p mesh a block's forward and backward passes are compute bound "
                f"from {asked['min_tokens_per_device']:.1f} tokens per chip ({asked['min_global_tokens']:,.0f} in the "
                f"batch); the {best['mesh']} split lowers that to {best['min_tokens_per_device']:.1f} "
                f"({best['min_global_tokens']:,.0f})")
        if eight_bit:
            text += (f", 8-bit collectives to {eight_bit['min_tokens_per_device']:.1f} "
                     f"({eight_bit['min_global_tokens']:,.0f})")
        bubbles = sorted(select(rows, table="pipeline"), key=lambda r: (r["stages"], r["microbatches"]))
        sentences.append(text + ", and pipeline parallelism removes the batch-dependent term at the price of an idle "
                         "bubble" + (" (" + ", ".join(f"{format_share(r['bubble_fraction'])} for {r['stages']} stages "
                                                      f"and {r['microbatches']} microbatches" for r in bubbles) + ")."
                                     if bubbles else "."))
    else:
        sentences.append(not_in_report(f"The compute-bound batch of the {ASKED_MESH[0]} x {ASKED_MESH[1]} mesh"))
    return sentences


def _setting(rows: list[Row]) -> Row | None:
    return find(rows, table="setting")


def _node(setting: Row) -> str:
    return (f"on {NODE_SIZE} NVLink GPUs (C = {setting['C_flops_per_s'] / 1e12:.1f} TFLOP/s, W = "
            f"{setting['W_bytes_per_s'] / GB:.0f} GB/s) with the {setting['size_table']} {setting['size']} FFN and "
            f"B = {setting['B']:,} tokens")


def _alternate_ring(reports: Reports) -> list[str]:
    rows = reports["alternate_ring_all_reduce"]
    node = select(rows, table="node")
    if not node:
        return [not_in_report("The worked figure")]
    largest = max(node, key=lambda r: r["N"])
    return [f"T = (N - 1) S / W, N/2 times the ring all-reduce's 2 (N - 1) S / (N W): for the xl model's FP16 "
            f"gradients ({largest['S_bytes'] / GB:.2f} GB) on {largest['N']} NVLink GPUs, "
            f"{format_ms(largest['alternate_ms'])} against {format_ms(largest['ring_ms'])}."]


def _bound_answer(reports: Reports, report: str, formulas: dict[str, str]) -> list[str]:
    rows = reports[report]
    setting = _setting(rows)
    if setting is None:
        return [not_in_report("The worked figure")]
    bounds = "; ".join(f"{phase}: {formula} = {find(rows, table='bound', phase=phase)['max_devices']:,.2f}"
                       for phase, formula in formulas.items() if find(rows, table="bound", phase=phase))
    return [f"Answered part by part in the handout's symbols; {_node(setting)}: {bounds}."]


def _data_parallel(reports: Reports) -> list[str]:
    return _bound_answer(reports, "data_parallel_calcs", {"backward": "N_DP <= 1 + B W / C"})


def _fsdp_calcs(reports: Reports) -> list[str]:
    return _bound_answer(reports, "fsdp_calcs", {"forward": "N_FSDP <= 1 + B W / C",
                                                "backward": "N_FSDP <= 1 + B W / C"})


def _tp_calcs(reports: Reports) -> list[str]:
    return _bound_answer(reports, "tp_calcs", {"forward": "N_TP <= 1 + 3 D_FF W / (2 C)",
                                              "backward": "N_TP <= 1 + 3 D_FF W / C"})


def _fsdp_tp_calcs(reports: Reports) -> list[str]:
    rows = reports["fsdp_tp_calcs"]
    setting = _setting(rows)
    overlapped, shared = find(rows, table="bound", axes="overlapped"), find(rows, table="bound", axes="shared")
    if setting is None or not (overlapped and shared):
        return [not_in_report("The worked figure")]
    return [f"Answered part by part in the handout's symbols; {_node(setting)}: with the axes overlapped N <= "
            f"(1 + B W / C)(1 + 3 D_FF W / (2 C)) = {overlapped['max_devices']:,.1f}, sharing the network N <= "
            f"(a b + a + b)^2 / (4 a b) = {shared['max_devices']:,.1f}."]


def _leaderboard(reports: Reports) -> list[str]:
    return ["No report: no benchmark of the leaderboard's full training step (the 8B-class model, d_model 4096, "
            "34 layers, vocabulary 151,936, batch 2 x 32,768 tokens, bf16, AdamW) exists in the project yet; it "
            "needs two GPUs. flash_benchmarking measures the attention part of the 2025 leaderboard."]


def _leaderboard_open(reports: Reports) -> list[str]:
    return ["the full training step of the 8B-class model on two GPUs: not implemented"]


PROBLEMS: tuple[Problem, ...] = (
    Problem("benchmarking_script", ("benchmarking_script",), _benchmarking_script, "e2e"),
    Problem("nsys_profile", ("nsys_profile",), _nsys_profile, "profile", open_items=_nsys_profile_open),
    Problem("mixed_precision_accumulation", ("mixed_precision_accumulation",), _mixed_precision_accumulation, "e2e"),
    Problem("benchmarking_mixed_precision", ("benchmarking_mixed_precision",), _benchmarking_mixed_precision, "e2e"),
    Problem("memory_profiling", ("memory_profiling",), _memory_profiling, "memory", open_items=_memory_profiling_open),
    Problem("gradient_checkpointing", ("gradient_checkpointing",), _gradient_checkpointing, "memory",
            open_items=_gradient_checkpointing_open),
    Problem("pytorch_attention", ("pytorch_attention",), _pytorch_attention, "attention"),
    Problem("torch_compile", ("torch_compile",), _torch_compile, "e2e"),
    Problem("flash_forward / flash_backward", (), _flash_forward_backward),
    Problem("flash_benchmarking", ("flash_benchmarking",), _flash_benchmarking, "flash"),
    Problem("distributed_communication_single_node", ("distributed_communication_single_node",), _allreduce, "ddp",
            open_items=_allreduce_open),
    Problem("naive_ddp / naive_ddp_benchmarking", ("naive_ddp", "naive_ddp_benchmarking"), _naive_ddp, "ddp", 2),
    Problem("minimal_ddp_flat_benchmarking", ("minimal_ddp_flat_benchmarking",), _flat_ddp, "ddp", 2),
    Problem("ddp_overlap_individual_parameters",
            ("ddp_overlap_individual_parameters", "ddp_overlap_individual_parameters_benchmarking"),
            _overlap_individual, "ddp", 2),
    Problem("ddp_overlap_bucketed", ("ddp_overlap_bucketed", "ddp_bucketed_benchmarking"), _bucketed, "ddp", 2),
    Problem("optimizer_state_sharding", ("optimizer_state_sharding", "optimizer_state_sharding_accounting"),
            _sharding, "sharding", 2),
    Problem("fsdp", ("fsdp", "fsdp_accounting"), _fsdp, "fsdp", 2),
    Problem("communication_accounting", ("communication_accounting",), _communication_accounting,
            device_independent=True),
    Problem("alternate_ring_all_reduce", ("alternate_ring_all_reduce",), _alternate_ring, device_independent=True),
    Problem("data_parallel_calcs", ("data_parallel_calcs",), _data_parallel, device_independent=True),
    Problem("fsdp_calcs", ("fsdp_calcs",), _fsdp_calcs, device_independent=True),
    Problem("tp_calcs", ("tp_calcs",), _tp_calcs, device_independent=True),
    Problem("fsdp_tp_calcs", ("fsdp_tp_calcs",), _fsdp_tp_calcs, device_independent=True),
    Problem("leaderboard", (), _leaderboard, gpus=2, open_items=_leaderboard_open),
)


# ---------------------------------------------------------------------------------------- the index

@dataclass(frozen=True)
class _Directory:
    """A directory of reports: a device's (`<root>/<slug>`) or the root's own."""
    path: Path
    prefix: str  # the directory relative to the index, "" or "<slug>/"

    def has(self, report: str) -> bool:
        return (self.path / f"{report}.csv").is_file()

    def rows(self, report: str) -> list[Row]:
        return read_rows(self.path / f"{report}.csv")

    def links(self, report: str) -> list[str]:
        """The report's table, and the plots its Markdown shows, as links relative to the index."""
        markdown = self.path / f"{report}.md"
        if not markdown.is_file():
            return []
        plots = dict.fromkeys(re.findall(r"!\[[^\]]*\]\(([^)\s]+\.png)\)", markdown.read_text()))
        return [f"[{name}]({self.prefix}{name})" for name in (f"{report}.md", *plots)
                if (self.path / name).is_file()]


def _device_directories(reports_root: Path) -> list[str]:
    """The slugs of the subdirectories that hold at least one report."""
    return sorted(p.name for p in reports_root.iterdir() if p.is_dir() and any(p.glob("*.csv")))


def _header_fields(markdown: Path) -> dict[str, list[str]]:
    """A report header's device, software and run dates."""
    fields: dict[str, list[str]] = {"device": [], "software": [], "dates": []}
    blocks = markdown.read_text().split("\n\n", 2)  # title, header, body
    for line in (blocks[1] if len(blocks) > 1 else "").splitlines():
        if line.startswith("- device: "):
            fields["device"].append(line.removeprefix("- device: "))
        elif line.startswith("- software: "):
            fields["software"].append(line.removeprefix("- software: "))
        elif re.match(r"- run \d+: ", line):
            fields["dates"].append(line.split(": ", 1)[1].split(", `", 1)[0])
    return fields


def _device_table(reports_root: Path, slugs: list[str]) -> str:
    table = []
    for slug in slugs:
        # The problems' reports (each beside its rows), not records such as gpu_check.md.
        fields = [_header_fields(md) for md in sorted((reports_root / slug).glob("*.md")) if md.with_suffix(".csv").exists()]
        devices = dict.fromkeys(d for f in fields for d in f["device"])
        software = dict.fromkeys(s for f in fields for s in f["software"])
        dates = sorted(d for f in fields for d in f["dates"])
        table.append({"directory": f"[{slug}/]({slug}/)", "device": "; ".join(devices),
                      "software": "; ".join(software),
                      "runs": f"{dates[0]} to {dates[-1]}" if len(set(dates)) > 1 else "".join(dates[:1])})
    return markdown_table(table)


def _perf_command(problem: Problem, slug: str) -> str:
    gpu = "none" if slug == CPU_SLUG else slug if slug in GPU_SPECS else "auto"
    world_size = f" --world-size {problem.gpus}" if problem.gpus > 1 else ""
    return f"`pytest perf/ -m {problem.marker} --gpu {gpu}{world_size}`"


def _not_measured(problem: Problem, reports: list[str], slug: str) -> str:
    files = listing([f"`{slug}/{report}.md`" for report in reports])
    absent = f"{files} {'is' if len(reports) == 1 else 'are'} absent"
    them = "it" if len(reports) == 1 else "them"
    if problem.gpus > 1 and slug != CPU_SLUG:
        return (f"- {slug}: not measured: needs {problem.gpus} GPUs. {absent}: no {_perf_command(problem, slug)} "
                f"run on a {problem.gpus}-GPU machine has written {them} yet.")
    return f"- {slug}: not measured: {absent}: no {_perf_command(problem, slug)} run has written {them} yet."


def _device(reports_root: Path, slug: str) -> _Directory:
    return _Directory(reports_root / slug, f"{slug}/")


def _device_paragraph(problem: Problem, reports_root: Path, slug: str) -> str:
    directory = _device(reports_root, slug)
    present = [r for r in problem.reports if directory.has(r)]
    absent = [r for r in problem.reports if r not in present]
    lines = []
    if present:
        links = [link for report in present for link in directory.links(report)]
        sentences = problem.answer({report: directory.rows(report) for report in present})
        lines.append(f"**{slug}**" + (f" ({', '.join(links)})" if links else "") + ": " + " ".join(sentences))
    if absent:
        lines.append(_not_measured(problem, absent, slug))
    return "\n\n".join(lines)


def _status(problem: Problem, reports_root: Path, slug: str) -> str:
    if not problem.reports:
        return "open" if problem.open_items else "no report (correctness tests)"
    if problem.device_independent:
        return "device-independent" if _Directory(reports_root, "").has(problem.reports[0]) else "not computed"
    present = [r for r in problem.reports if _device(reports_root, slug).has(r)]
    if not present:
        return "not measured"
    if len(present) < len(problem.reports):
        return f"{len(present)} of {len(problem.reports)} reports"
    return "measured"


def _section(number: int, problem: Problem, reports_root: Path, slugs: list[str]) -> str:
    head = f"## {number}. {problem.title}\n\n"
    if not problem.reports:
        return head + " ".join(problem.answer({})) + "\n"
    if problem.device_independent:
        root, report = _Directory(reports_root, ""), problem.reports[0]
        if not root.has(report):
            return head + f"- not computed: `{report}.md` is absent; `{ANALYSIS_COMMAND}` writes it.\n"
        links = root.links(report)
        return (head + "Device-independent, closed form" + (f" ({', '.join(links)})" if links else "") + ": "
                + " ".join(problem.answer({report: root.rows(report)})) + "\n")
    if not slugs:
        return head + "- not measured: no device directory under the reports holds a report yet.\n"
    return head + "\n\n".join(_device_paragraph(problem, reports_root, slug) for slug in slugs) + "\n"


def _measured(problem: Problem, reports_root: Path, slugs: list[str]) -> dict[str, Reports]:
    """slug -> the problem's reports present there ("" for the reports' root, closed forms)."""
    if problem.device_independent:
        root = _Directory(reports_root, "")
        return {"": {r: root.rows(r) for r in problem.reports if root.has(r)}} if root.has(problem.reports[0]) else {}
    found = {}
    for slug in slugs:
        directory = _device(reports_root, slug)
        present = {r: directory.rows(r) for r in problem.reports if directory.has(r)}
        if present:
            found[slug] = present
    return found


def _model_sizes(measured: dict[str, Reports]) -> dict[str, list[str]]:
    """Size table -> the model sizes the rows measured (rows that predate the size_table column: 2025)."""
    tables: dict[str, set[str]] = {}
    for reports in measured.values():
        for rows in reports.values():
            for r in rows:
                if r.get("size"):
                    tables.setdefault(str(r.get("size_table") or UNRECORDED_SIZE_TABLE), set()).add(r["size"])
    return {table: sorted(sizes, key=size_order) for table, sizes in sorted(tables.items(), reverse=True)}


def _open(problem: Problem, measured: dict[str, Reports], sizes: dict[str, list[str]]) -> list[str]:
    """What is left to answer: runs no machine here has made, old runs, parts the rows lack."""
    items = []
    if not problem.reports:
        return problem.open_items({}) if problem.open_items else []
    complete = [slug for slug, reports in measured.items() if len(reports) == len(problem.reports)]
    if not complete:
        if problem.device_independent:
            items.append(f"not computed: `{ANALYSIS_COMMAND}`")
        elif problem.gpus > 1:
            items.append(f"needs a machine with {problem.gpus} GPUs: `pytest perf/ -m {problem.marker} "
                         f"--world-size {problem.gpus}`")
        else:
            items.append(f"not measured on a GPU: `pytest perf/ -m {problem.marker} --gpu auto`")
    items += _size_gaps(sizes)
    if problem.open_items:
        items += [f"{slug}: {item}" if slug else item for slug, reports in measured.items()
                  if len(reports) == len(problem.reports) for item in problem.open_items(reports)]
    return items


def _size_gaps(sizes: dict[str, list[str]]) -> list[str]:
    """The current table's sizes a sweep left out, and sizes measured that the current table lacks. A size
    of another table with the same shape counts as measured (the 2025 table's 2.7B is the 2026 xl)."""
    current = {name: shape for name, shape in model_sizes(CURRENT_SIZE_TABLE).items() if name != "tiny"}
    shapes = {(table, name): model_sizes(table).get(name) for table, names in sizes.items() for name in names}
    foreign = [f"{table} table's {name}" for (table, name), shape in shapes.items()
               if name != "tiny" and shape not in current.values()]
    items = [f"measured on the {listing(foreign)}, which the {CURRENT_SIZE_TABLE} table does not have"] if foreign else []
    if len([name for _, name in shapes if name != "tiny"]) > 1:  # a sweep over sizes
        missing = [name for name, shape in current.items() if shape not in shapes.values()]
        if missing:
            items.append(f"the {CURRENT_SIZE_TABLE} table's {listing(missing)} {'is' if len(missing) == 1 else 'are'} "
                         "not measured")
    return items


def render_index(reports_root: Path | str, command: str = INDEX_COMMAND) -> str:
    reports_root = Path(reports_root)
    if not reports_root.is_dir():
        raise ValueError(f"no reports directory {reports_root}")
    slugs = _device_directories(reports_root)
    status = []
    for number, problem in enumerate(PROBLEMS, 1):
        measured = _measured(problem, reports_root, slugs)
        sizes = _model_sizes(measured)
        status.append({"problem": f"{number}. {problem.title}", **{s: _status(problem, reports_root, s) for s in slugs},
                       "model sizes": "; ".join(f"{table}: {', '.join(names)}" for table, names in sizes.items()),
                       "open": "; ".join(_open(problem, measured, sizes))})
    parts = [
        "# Reports index\n",
        f"Generated by `{command}` from the reports' CSVs; run it again rather than editing this file. Every "
        "figure below is read from the rows of the report linked beside it, whose header names the device, "
        "software versions, dates and command that measured it.\n",
        "## Devices\n",
        _device_table(reports_root, slugs) if slugs else "No device reports yet.\n",
        *([CPU_NOTE] if CPU_SLUG in slugs else []),
        "## Status\n",
        "Per problem and device directory: whether its reports are there, the model sizes they measured (by size "
        "table) and what is still open.\n",
        markdown_table(status),
        *(_section(number, problem, reports_root, slugs) for number, problem in enumerate(PROBLEMS, 1)),
    ]
    return "\n".join(parts)


def write_index(reports_root: Path | str, command: str = INDEX_COMMAND) -> Path:
    """Write `<reports_root>/README.md` from the reports under it; returns its path."""
    path = Path(reports_root) / INDEX_FILE
    path.write_text(render_index(reports_root, command))
    return path
