"""Problem memory_profiling's answers: the sentences of its report (peak memory by mode, precision and context
against the memory model, saved activations, the residual stream's size, the active-memory timelines, memory_viz's
drawn from the kept snapshots, the largest allocations and part (f), each block's residuals and gradients), its
figures, its answer and what a run leaves open. The report's tables are declared in
cs336_systems.reports.problems; the package's benchmarks/memory_profiling.py measures them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from cs336_systems.accounting.activations import adamw_step_temporary_bytes
from cs336_systems.gpus import GIB
from cs336_systems.model import ModelConfig
from cs336_systems.profiling.memory import active_memory_layout, load_snapshot, plot_active_memory
from cs336_systems.reports import (
    Reports,
    format_bytes,
    format_share,
    listing,
    not_in_report,
    oom_text,
    select,
    span,
)
from cs336_systems.reports.spec import Table
from cs336_systems.rows import ADAMW_NAMES, OOM, Row, ok_rows
from cs336_systems.rows.memory_profiling import HANDOUT_MEMORY_CONTEXTS, PROFILED_MODES

MODE_LABELS = {"inference": "forward only (inference)", "train_step": "training step"}
# The analytical model should land within this share of a measured peak.
PREDICTION_TOLERANCE = 0.15
# memory_viz's Detail setting for the rendered timelines: the largest allocations drawn as bands of their own.
TIMELINE_BANDS = 1000


def cell_name(r: Row) -> str:
    """A measured cell as the tables and headings name it."""
    return f"{MODE_LABELS[r['mode']]}, {r['precision']}, context {r['context_length']}"


def setup(rows: list[Row]) -> str:
    peaks = select(rows, table="peak")
    r = peaks[0]
    contexts = ", ".join(str(c) for c in sorted({p["context_length"] for p in peaks}))
    precisions = ", ".join(dict.fromkeys(p["precision"] for p in peaks))
    train = next((p for p in peaks if p["mode"] == "train_step"), {})
    adamw = train.get("adamw")
    optimizer = ADAMW_NAMES[adamw] if adamw else "AdamW"
    text = (f"{r['size']} model, batch {r['batch_size']}, {r['attention']} attention, contexts {contexts}, "
            f"precisions {precisions} (bf16: autocast over fp32 parameters). Forward only runs under no_grad; the "
            f"training step (forward, backward, {optimizer} step, zero_grad) is measured after an unmeasured one.")
    if adamw == "course":
        config = ModelConfig.for_size(r["size"], 1, table=train["size_table"])
        text += (f" The course's AdamW takes sqrt(v) one parameter at a time "
                 f"(+{format_bytes(adamw_step_temporary_bytes(config, 'course'))} at its step); torch's default "
                 f"foreach AdamW takes it of every parameter at once "
                 f"(+{format_bytes(adamw_step_temporary_bytes(config, 'foreach'))}).")
    return text + "\n"


def peak_setup(rows: list[Row]) -> str:
    on_gpu = select(rows, table="peak")[0]["device"] == "cuda"
    return "## Peak memory\n\n" + ("Start: allocated before the measured work; peak: torch.cuda.max_memory_allocated; "
                                    "predicted: accounting.activations.predict_peak_memory.\n" if on_gpu else
                                    "On CPU: the most allocated at once above the start (torch.profiler's memory "
                                    "records).\n")


def in_table_order(peaks: list[Row]) -> list[Row]:
    """By mode, precision (as first measured) and context."""
    precisions = list(dict.fromkeys(r["precision"] for r in peaks))
    return sorted(peaks, key=lambda r: (PROFILED_MODES.index(r["mode"]), precisions.index(r["precision"]),
                                        r["context_length"]))


def gpu_ok(value):
    """A peak table cell of `value` where the row ran on a GPU (None elsewhere: an OOM or a CPU row)."""
    return lambda r: value(r) if r["status"] == "ok" and r["device"] == "cuda" else None


def peak_cell(r: Row) -> str | None:
    if r["status"] == OOM:
        return oom_text(r)
    return format_bytes(r["peak_bytes"]) if r["device"] == "cuda" else None


def predicted_cell(r: Row) -> str | None:
    return format_bytes(r.get("predicted_peak_bytes")) if r["status"] == OOM or r["device"] == "cuda" else None


def prediction_summary(rows: list[Row]) -> str:
    ok = ok_rows(select(rows, table="peak", device="cuda"))
    if not ok:
        return ""
    errors = [abs(r["peak_bytes"] / r["predicted_peak_bytes"] - 1) for r in ok]
    within = sum(error <= PREDICTION_TOLERANCE for error in errors)
    return (f"The model predicts {within} of {len(ok)} measured peaks within {PREDICTION_TOLERANCE:.0%} "
            f"(largest error {max(errors):.1%}).\n")


def autocast_note(rows: list[Row]) -> str:
    """Why bf16 autocast does not halve the peak, where both precisions ran (the table holds the peaks)."""
    ok = ok_rows(select(rows, table="peak"))
    if not {"fp32", "bf16"} <= {r["precision"] for r in ok}:
        return ""
    return ("Autocast keeps fp32 parameters, gradients and AdamW state, adds bf16 weight copies and halves only "
            "matmul outputs" + (" (softmax stays fp32 on CUDA).\n" if ok[0]["device"] == "cuda" else ".\n"))


def miss(r: Row) -> str | None:
    """Where a measured peak is off its prediction by more than the tolerance: the gap, and the predicted
    component nearest it in size (None where it is within)."""
    difference = r["peak_bytes"] - r["predicted_peak_bytes"]
    if abs(difference) <= PREDICTION_TOLERANCE * r["predicted_peak_bytes"]:
        return None
    components = {"parameters": r["predicted_parameters_bytes"], "gradients": r["predicted_gradients_bytes"],
                  "AdamW state": r["predicted_optimizer_state_bytes"],
                  "saved activations": r["predicted_activations_bytes"],
                  "autocast weight copies": r["predicted_weight_cache_bytes"],
                  "transients": r["predicted_transient_bytes"]}
    name, size = min(((n, v) for n, v in components.items() if v), key=lambda item: abs(abs(difference) - item[1]))
    return f"{'+' if difference > 0 else '-'}{format_bytes(abs(difference))}, {name} ({format_bytes(size)})"


SAVED_SETUP = ("## Saved activations: model against autograd\n\nWhat autograd saves in one forward with the loss "
               "(saved_tensors_hooks; parameters and inputs excluded) against "
               "accounting.activations.saved_activation_bytes.\n")
TIMELINE_SETUP = ("## Active memory over one step\n\nFrom each snapshot's allocator trace; each point is the highest "
                  "of its run of events.\n")
SNAPSHOT_SETUP = ("## memory_viz: Active Memory Timeline\n\nEach snapshot as pytorch.org/memory_viz draws it (x: "
                  f"allocator events), redrawn from the pickle with its {TIMELINE_BANDS} largest allocations as "
                  "bands.\n")


def has_saved_activations(r: Row) -> bool:
    return r.get("table") == "peak" and r["status"] == "ok" and r.get("measured_saved_bytes") is not None


def residual_setup(residual: list[Row]) -> str:
    return ("## Residual-stream activation size\n\nComputed, and measured on the first block's output."
            + (" It is fp32 under bf16 autocast too: the embedding output is fp32, and fp32 + bf16 is fp32."
               if all(r["dtype"] == "float32" for r in residual) else "") + "\n")


def timeline_figure(rows: list[Row]):
    """Active memory over one step, a panel per mode and precision, with the predicted peak marked."""
    from matplotlib.figure import Figure

    points = select(rows, table="timeline")
    modes = [m for m in PROFILED_MODES if any(p["mode"] == m for p in points)]
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
                ax.axhline(peak["predicted_peak_bytes"] / GIB, color="tab:red", ls="--", lw=1, label="predicted peak")
                ax.legend(loc="lower right", fontsize=8)
            ax.set_title(f"{MODE_LABELS[mode]}, {precision}, context {series[0]['context_length']}", fontsize=10)
            ax.set_xlabel("time (ms)")
            ax.set_ylabel("active memory (GiB)")
            ax.grid(alpha=0.3)
    figure.tight_layout()
    return figure


def snapshot_order(r: Row) -> tuple:
    return PROFILED_MODES.index(r["mode"]), r["context_length"]


def snapshot_images(snapshots: list[Row]) -> str:
    """Each kept snapshot's Active Memory Timeline (`render_snapshot_timelines` draws them)."""
    files = sorted(snapshots, key=snapshot_order)
    return "\n\n".join(f"![{MODE_LABELS[r['mode']]}, context {r['context_length']}]({timeline_file_name(r['file'])})"
                        for r in files) + "\n"


def render_snapshot_timelines(rows: list[Row], directory: Path) -> list[Path]:
    """memory_viz's Active Memory Timeline of each snapshot the rows name, drawn from its pickle in
    `directory` to a PNG beside it (`timeline_file_name`); returns the PNGs' paths."""
    import matplotlib.pyplot as plt

    written = []
    for r in rows:
        if r.get("table") != "snapshot":
            continue
        layout = active_memory_layout(load_snapshot(directory / r["file"]), r.get("device_index") or 0,
                                      max_allocations=TIMELINE_BANDS)
        figure = plot_active_memory(layout, f"{r['size']}, {MODE_LABELS[r['mode']]}, {r['precision']}, context "
                                            f"{r['context_length']}, batch {r['batch_size']}")
        path = directory / timeline_file_name(r["file"])
        figure.savefig(path, dpi=120, bbox_inches="tight", metadata={"Software": None})
        plt.close(figure)
        written.append(path)
    return written


def timeline_file_name(snapshot_file: str) -> str:
    return snapshot_file.removesuffix(".pickle") + ".png"


def allocations(table: Table) -> Callable[[list[Row]], str]:
    """The largest allocations section: under a heading per kept snapshot, `table` (a spec.Table) of its rows."""
    def section(rows: list[Row]) -> str:
        found = select(rows, table="allocation")
        if not found:
            return ""
        parts = ["## Largest allocations\n\nPer kept snapshot: the largest blocks, the line of this package that "
                 "asked and the innermost frame.\n"]
        cells = dict.fromkeys((r["mode"], r["precision"], r["context_length"]) for r in found)
        for mode, precision, context in sorted(cells, key=lambda c: (PROFILED_MODES.index(c[0]), c[2], c[1])):
            cell = select(found, mode=mode, precision=precision, context_length=context)
            parts += [f"### {cell_name(cell[0])}\n", table.render(cell)]
        return "\n".join(parts)

    return section


def _blocks_by_precision(rows: list[Row]) -> dict[str, tuple[list[Row], list[Row]]]:
    """Per precision whose blocks ran (as first measured): its blocks in order, and its top operations by rank."""
    blocks = ok_rows(select(rows, table="block"))
    return {precision: (sorted(select(blocks, precision=precision), key=lambda r: r["block"]),
                        sorted(select(rows, table="block_operation", precision=precision), key=lambda r: r["rank"]))
            for precision in dict.fromkeys(r["precision"] for r in blocks)}


def block_setup(rows: list[Row]) -> str:
    """Part (f): residuals per TransformerBlock, the operations behind them, gradients in backward."""
    heading = "## (f) Residuals and gradients per TransformerBlock\n\n"
    blocks = ok_rows(select(rows, table="block"))
    if not blocks:
        return heading + "Out of memory.\n" if select(rows, table="block") else ""
    return (heading + "One forward and backward after zero_grad(set_to_none=True). Residuals: the storages autograd "
            "saved while a block's forward ran (saved-tensor hooks), each from the aten call that allocated it. "
            "Gradients (CUDA): memory_allocated's change over a block's backward plus the residuals it freed; beyond "
            "the weight gradients it holds the gradient of the block's input, one residual-stream tensor "
            f"({format_bytes(blocks[0]['residual_stream_bytes'])}).\n")


def block_summaries(rows: list[Row]) -> list[Row]:
    """A line per precision: the middle block's residuals against the model, its top operations' share, its
    weight gradients and what the allocator saw (a span over the blocks where they differ)."""
    lines = []
    for precision, (mine, top) in _blocks_by_precision(rows).items():
        middle = mine[len(mine) // 2]
        gradients = [r["gradient_bytes"] for r in mine if r.get("gradient_bytes") is not None]
        lines.append({"precision": precision, "context": middle["context_length"],
                      "residuals per block": span([r["saved_bytes"] for r in mine], format_bytes),
                      "model": format_bytes(middle["predicted_saved_bytes"]),
                      f"top {len(top)} operations": format_share(sum(r["share"] for r in top)) if top else "",
                      "weight gradients: 4 B x parameters": f"4 x {middle['parameters']:,} = "
                                                            f"{format_bytes(4 * middle['parameters'])}",
                      ".grad after its backward": span([r["weight_gradient_bytes"] for r in mine], format_bytes),
                      "gradients, from the allocator": span(gradients, format_bytes) if gradients else ""})
    return lines


def block_operations(rows: list[Row]) -> list[Row]:
    """The top operations of each precision whose blocks ran."""
    return [r for _, top in _blocks_by_precision(rows).values() for r in top]


def is_block_row(r: Row) -> bool:
    return r.get("table") in ("block", "block_operation")


# ---------------------------------------------------------------------------------------------- answers

# The modes as the answers' sentences name them (MODE_LABELS heads the tables).
ANSWER_MODE_LABELS = {"inference": "forward only (no_grad)", "train_step": "a training step"}


def answer_memory_profiling(reports: Reports) -> list[str]:
    rows = reports["memory_profiling"]
    peaks = select(rows, table="peak")
    if not peaks:
        return [not_in_report("A peak-memory cell")]
    on_gpu = any(r.get("peak_bytes") is not None for r in peaks)
    column = "peak_bytes" if on_gpu else "peak_increase_bytes"
    first = peaks[0]
    groups = []
    for mode, label in ANSWER_MODE_LABELS.items():
        for precision in dict.fromkeys(r["precision"] for r in peaks):
            cells = sorted(select(peaks, mode=mode, precision=precision), key=lambda r: r["context_length"])
            if not cells:
                continue
            values = [format_bytes(r[column], "bytes") if r["status"] == "ok" else oom_text(r) for r in cells]
            contexts = " / ".join(str(r["context_length"]) for r in cells)
            shown = (f"out of memory at every context ({contexts})" if all(r["status"] == OOM for r in cells) else
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
        # Part (e) asks about the forward pass: its longest context, where the largest tensors are.
        top = max(tops, key=lambda r: (r["mode"] == "inference", r["context_length"]))
        sentences.append(f"The largest allocations of {ANSWER_MODE_LABELS[top['mode']]} in {top['precision']} at "
                         f"context {top['context_length']} are {top['count']} blocks of {top['size_mib']:.2f} MiB from "
                         f"`{top['source']}`.")
    blocks = ok_rows(select(rows, table="block"))
    if blocks:
        blocks = select(blocks, precision=blocks[0]["precision"])  # the first precision measured: fp32 by default
        block = blocks[len(blocks) // 2]
        operations = sorted(select(rows, table="block_operation", precision=block["precision"]),
                            key=lambda r: r["rank"])
        text = (f"(f) In {block['precision']} at context {block['context_length']} a block saves "
                f"{format_bytes(block['saved_bytes'], 'bytes')} for backward (the model: "
                f"{format_bytes(block['predicted_saved_bytes'], 'bytes')})")
        if operations:
            text += (", " + format_share(sum(r["share"] for r in operations)) + " of it allocated by "
                     + listing([f"`{r['operation']}` ({format_share(r['share'])})" for r in operations]))
        expected = 4 * block["parameters"]
        text += (f"; its weight gradients should take 4 bytes x {block['parameters']:,} parameters = "
                 f"{format_bytes(expected, 'bytes')} and take {format_bytes(block['weight_gradient_bytes'], 'bytes')}")
        if block.get("gradient_bytes") is not None:
            text += (f"; the allocator saw its backward add {format_bytes(block['gradient_bytes'], 'bytes')} of "
                     f"gradients, {format_bytes(block['gradient_bytes'] - expected, 'bytes')} beyond the weights'")
            if block.get("residual_stream_bytes"):
                text += (" (the gradient of its input is one residual-stream tensor, "
                         f"{format_bytes(block['residual_stream_bytes'], 'bytes')})")
        sentences.append(text + ".")
    return sentences


def open_items_memory_profiling(reports: Reports) -> list[str]:
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
