"""Problem memory_profiling: peak memory of inference and of a training step per precision and
context (allocator snapshots, timelines and largest allocations on CUDA), the analytical memory
model against measurement, the residual stream's size, and what each block saves and its gradients
take (part f).

    rows = memory_profile(MemoryProfileConfig(), "cuda", snapshot_dir=Path("reports/h100"))

Each measuring function returns rows; the renderer below answers the written questions from them.
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
from cs336_systems.benchmarks.harness import (
    LEARNING_RATE,
    PRECISIONS,
    adamw,
    autocast,
    build_model,
    lm_loss,
    random_batch,
    release_memory,
    training_step,
)
from cs336_systems.gpus import GIB, MIB
from cs336_systems.memory_guard import check_memory, is_out_of_memory
from cs336_systems.model import ModelConfig
from cs336_systems.profiling.memory import (
    active_memory_timeline,
    downsample_peaks,
    largest_allocations,
    peak_memory_increase,
    record_memory_history,
    saved_tensor_bytes,
    take_snapshot,
)
from cs336_systems.profiling.residuals import block_memory
from cs336_systems.reports import (
    OOM,
    Rendered,
    Reports,
    Row,
    format_bytes,
    format_share,
    listing,
    markdown_table,
    not_in_report,
    ok_rows,
    select,
)

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
            optimizer = adamw(model, LEARNING_RATE, "fused")
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
        training_step(model, optimizer, inputs, targets, precision=precision)

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
            entry["predicted"] = format_bytes(r.get("predicted_peak_bytes"))
        elif on_gpu:
            entry.update({"start": format_bytes(r["start_bytes"]), "peak": format_bytes(r["peak_bytes"]),
                          "timeline peak": format_bytes(r.get("timeline_peak_bytes")),
                          "predicted": format_bytes(r["predicted_peak_bytes"]),
                          "error": f"{r['peak_bytes'] / r['predicted_peak_bytes'] - 1:+.1%}",
                          "predicted peak at": r["predicted_phase"]})
        else:
            entry["peak above start"] = format_bytes(r["peak_increase_bytes"])
        table.append(entry)
    text = ["## Peak memory\n\n" + ("Start: allocated before the measured work (parameters, and for training "
            "AdamW's state); peak: torch.cuda.max_memory_allocated; timeline peak: the snapshot trace's highest point; "
            "predicted: cs336_systems.accounting.activations.predict_peak_memory.\n" if on_gpu else
            "On CPU the peak is the most memory allocated at once above the start, from torch.profiler's memory "
            "records; snapshots and the predictor (which follows CUDA's rules) are for CUDA runs.\n"),
            markdown_table(table)]
    ok = [r for r in peaks if r["status"] == "ok"]
    if on_gpu and ok:
        text.append(_prediction_summary(ok))
    text.append(_autocast_note(ok))
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
                 f"{format_bytes(r['peak_bytes'])} against {format_bytes(r['predicted_peak_bytes'])} predicted, "
                 f"{format_bytes(abs(difference))} {'more' if difference > 0 else 'less'}; of the predicted components "
                 f"the gap is closest in size to the {name} ({format_bytes(size)}).")
    return text + "\n"


def _autocast_note(ok: list[Row]) -> str:
    """Why bf16 autocast does not halve the peak, where both precisions ran (the table holds the peaks)."""
    if not {"fp32", "bf16"} <= {r["precision"] for r in ok}:
        return ""
    return ("Autocast keeps fp32 parameters (and AdamW state and gradients), adds bf16 copies of the weights, and "
            "halves only the activations that come out of matmuls; the residual stream and norms stay fp32"
            + (", and so does softmax (CUDA autocast runs it in fp32).\n" if ok[0]["device"] == "cuda" else ".\n"))


def _saved_section(peaks: list[Row]) -> str:
    rows = [r for r in peaks if r["status"] == "ok" and r.get("measured_saved_bytes") is not None]
    if not rows:
        return ""
    table = [{"precision": r["precision"], "context": r["context_length"],
              "measured": format_bytes(r["measured_saved_bytes"]), "predicted": format_bytes(r["predicted_saved_bytes"]),
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
             "line of this package that asked for them and the innermost Python frame; allocations of one size from "
             "one line are counted together.\n"]
    for mode in MEMORY_MODES:
        for precision in dict.fromkeys(r["precision"] for r in allocations):
            cell = sorted((r for r in allocations if r["mode"] == mode and r["precision"] == precision),
                          key=lambda r: r["rank"])
            if cell:
                parts.append(f"### {MODE_LABELS[mode]}, {precision}, context {cell[0]['context_length']}\n")
                parts.append(markdown_table([{"size (MiB)": r["size_mib"], "count": r["count"], "source": r["source"],
                                              "innermost frame": r["innermost"]} for r in cell]))
    return "\n".join(parts)


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
            f"(accounting.activations.block_saved_bytes) gives {format_bytes(r0['predicted_saved_bytes'])}"
            + (", to the byte." if all(s == r0["predicted_saved_bytes"] for s in saved) else
               f", {saved[len(saved) // 2] - r0['predicted_saved_bytes']:+,} bytes off in the middle block.")
            + f" Of that, {format_bytes(blocks[len(blocks) // 2]['input_bytes'])} is the block's input (one residual-stream "
            f"tensor is {format_bytes(r0['residual_stream_bytes'])}).\n"]
    if operations:
        middle = operations[0]["block"]
        top = sorted(operations, key=lambda r: r["rank"])
        text.append(f"The {len(top)} operations that allocated the most of block {middle}'s residuals, which "
                    f"together hold {sum(r['share'] for r in top):.1%} of them:\n")
        text.append(markdown_table([{"operation": r["operation"], "residuals": format_bytes(r["bytes"]),
                                     "share": f"{r['share']:.1%}"} for r in top]))
    expected = 4 * r0["parameters"]
    weight = [r["weight_gradient_bytes"] for r in blocks]
    text.append(f"Gradients: each block has {r0['parameters']:,} parameters, so its weight gradients should take "
                f"4 x {r0['parameters']:,} = {format_bytes(expected)} (fp32 whatever the autocast precision); the "
                f".grad storages found after each block's backward take {_span_bytes(weight)}"
                + (", as expected." if all(w == expected for w in weight) else ", not what was expected."))
    measured = [r for r in blocks if r.get("gradient_bytes") is not None]
    if measured:
        gradients = [r["gradient_bytes"] for r in measured]
        middle = measured[len(measured) // 2]
        extra = middle["gradient_bytes"] - expected
        text.append(f" Read from the allocator: over block {middle['block']}'s backward memory changed by "
                    f"{_signed_size(middle['backward_allocated_bytes'])} while it freed its "
                    f"{format_bytes(middle['saved_bytes'])} of residuals, so the new gradients took "
                    f"{format_bytes(middle['gradient_bytes'])} ({_span_bytes(gradients)} over the blocks): the weight "
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
    return format_bytes(low) if low == high else f"{format_bytes(low)} to {format_bytes(high)}"


def _signed_size(value: float) -> str:
    return ("-" if value < 0 else "+") + format_bytes(abs(value))


def _gib(value) -> float | None:
    return None if value is None else value / GIB


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
        sentences.append(f"The largest allocations of {ANSWER_MODE_LABELS[top['mode']]} in {top['precision']} at "
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
