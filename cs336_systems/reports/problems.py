"""The table of the course's problems: for each, the perf module that measures it, its reports (the
rows' name, declared layout and cell key) and the function that answers its written questions from those
rows. Everything that writes or reads a report finds it here:

    name -> measure (perf/<module>.py, marker) -> rows -> render (Report.render) -> answer (Problem.answer)

A problem family's measuring code is a benchmark module (the package's benchmarks/<family>.py; the distributed
families' checks against one process are in distributed/equivalence.py), which returns rows. Each report is
declared below (cs336_systems.reports.spec): its tables, plots and text parts, in order; the text parts and the
answers are the reports module of the family's name (cs336_systems.reports.<family>); each report's cell key is
in cs336_systems.rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cs336_systems import provenance
from cs336_systems.accounting.communication import COLLECTIVES
from cs336_systems.accounting.parallelism import BF16_BYTES
from cs336_systems.gpus import GIB, MIB
from cs336_systems.profiling.kernels import short_name
from cs336_systems.reports import (
    NOT_A_NUMBER,
    Report,
    Reports,
    allreduce,
    attention,
    communication_accounting,
    ddp,
    e2e,
    flash,
    flash_in_training,
    format_bytes,
    format_ms,
    fsdp,
    gradient_checkpointing,
    leaderboard,
    memory_profiling,
    mixed_precision,
    nsys_profile,
    oom_text,
    parallelism_calcs,
    sharding,
)
from cs336_systems.reports.spec import (
    LOG,
    LOG2,
    Column,
    Drawn,
    GridPlot,
    Layout,
    Part,
    Pivot,
    Plot,
    Reference,
    Table,
    Text,
    Versus,
    if_ran,
    when,
)
from cs336_systems.rows.flash import ATTENTION_MODES, MODE_LABELS, PRECISIONS, provider_label
from cs336_systems.rows.nsys_profile import STEP_RANGE
from cs336_systems.rows import (
    ALLREDUCE_KEY,
    ATTENTION_KEY,
    E2E_KEY,
    FAILED,
    FLASH_IN_TRAINING_KEY,
    FLASH_KEY,
    MIXED_PRECISION_KEY,
    NSYS_KEY,
    OOM,
    TORCH_COMPILE_KEY,
    Row,
    ran,
)

Answer = Callable[[Reports], list[str]]


def _step_table(baseline: str) -> Table:
    """The step table of the optimizer-state sharding and FSDP accounting reports: each variant's step, optimizer
    step, peaks and bytes communicated (the implementation under test's own communication is not counted: its cells
    stay empty), and how its step and peak compare with `baseline`'s."""
    return Table(where={"table": "step"}, columns=(
        "variant", Column("step (ms)", ddp.step_cell), Column("optimizer step (ms)", if_ran("optimizer_ms")),
        Column("peak (GiB)", if_ran("peak_gib")), Column("model peak (GiB)", if_ran("model_peak_gib")),
        Column("communicated per step (GB)", if_ran(sharding.gigabytes("communicated_bytes"))),
        Column("sent per rank, ring (GB)", if_ran(sharding.gigabytes("ring_bytes_sent_per_rank"))),
        Versus(f"step vs {baseline}", "step_ms", {"variant": baseline}),
        Versus(f"peak vs {baseline}", "peak_gib", {"variant": baseline})))


MEMORY_TABLE = Table(where={"table": "memory"}, columns=sharding.MEMORY_COLUMNS, present_only=True,
                     empty=sharding.NO_MEMORY_POINTS)
MEMORY_HEADING = "## Memory at the phase points\n"
# A problem's sweep rows: the end-to-end benchmarks' (the model), flash_benchmarking's (attention) and
# gradient_checkpointing's (the plans).
SWEEP = {"table": "sweep"}
# The checks of a distributed variant against one process (fsdp, leaderboard).
EQUIVALENCE = {"table": "equivalence"}


@dataclass(frozen=True)
class Problem:
    title: str  # as the assignment names it
    reports: tuple[Report, ...]  # none for a correctness-only problem
    answer: Answer
    marker: str = ""  # the perf marker whose run writes its reports
    measured_by: tuple[str, ...] = ()  # the perf modules that write its reports
    gpus: int = 1  # GPUs that run needs on a GPU machine
    # Computed in closed form (ANALYSIS_COMMAND writes it), reported once in the reports' root.
    device_independent: bool = False
    # What the reports' rows leave unanswered (a part not measured, an old run), beyond absent reports.
    open_items: Callable[[Reports], list[str]] | None = None
    # The one handout that asks it, where the other does not (the problems run and report all the same).
    only_in_handout: str | None = None
    # Whether it asks for every model size of the table (nsys_profile asks for two of the user's choice).
    every_size: bool = True

    @property
    def report_names(self) -> tuple[str, ...]:
        return tuple(report.name for report in self.reports)

    @property
    def label(self) -> str:
        """The title as the index heads it: with the handout it belongs to, where only one asks it."""
        return self.title + (f" ({self.only_in_handout} handout only)" if self.only_in_handout else "")


# gradient_checkpointing: peaks by checkpoint plan, the optimal nested strategy, the longest context that fits.
def _bytes(column: str) -> Callable[[Row], str]:
    """A table cell of the row's `column`, in bytes: "1.50 GiB"."""
    return lambda row: format_bytes(row.get(column))


LONGEST = {"table": "longest"}
GRADIENT_CHECKPOINTING = Layout((
    Text(gradient_checkpointing.sweep_setup),
    Table(where=SWEEP, columns=(
        Column("plan", gradient_checkpointing.plan_label), Column("recomputed blocks", "recomputed_blocks"),
        Column("kept after forward", if_ran(_bytes("measured_kept_bytes"), oom_text)),
        Column("predicted kept", _bytes("predicted_kept_bytes")),
        Column("peak", if_ran(_bytes("measured_peak_bytes"), oom_text)),
        Column("predicted peak", _bytes("predicted_peak_bytes")), Column("step (ms)", if_ran("step_ms")))),
    Text(gradient_checkpointing.best_single_level), Text(gradient_checkpointing.prediction_offsets),
    Drawn("gradient_checkpointing.png", draw=gradient_checkpointing.sweep_figure,
          alt="peak activation memory by plan"),
    Text(gradient_checkpointing.nested_strategy),
    Table(where=SWEEP, rows_of=gradient_checkpointing.nested_plans, columns=(
        Column("recomputation levels", "levels"), Column("predicted peak", _bytes("peak_bytes")),
        Column("peak / a", lambda r: f"{r['peak_bytes'] / r['block_bytes']:.2f}"),
        Column("recomputed blocks", "recomputed_blocks"), "plan")),
    Text(gradient_checkpointing.longest_setup, LONGEST),
    Table(where=LONGEST, columns=(
        Column("plan", gradient_checkpointing.plan_label),
        Column("longest context predicted to fit", lambda r: r["predicted_longest_context"] or "none"),
        Column("predicted peak there", _bytes("predicted_peak_bytes")), Column("next context", "next_context"),
        Column("its predicted peak", _bytes("next_predicted_peak_bytes")))),
    Text(gradient_checkpointing.longest_runs, LONGEST)), requires=SWEEP)


# memory_profiling: peaks against the memory model, saved activations, timelines, allocations and part (f).
SNAPSHOT = {"table": "snapshot"}
MEMORY_PROFILING = Layout((
    Text(memory_profiling.setup), Text(memory_profiling.peak_setup),
    Table(where={"table": "peak"}, rows_of=memory_profiling.in_table_order, present_only=True, columns=(
        Column("mode", lambda r: memory_profiling.MODE_LABELS[r["mode"]]), "precision",
        Column("context", "context_length"),
        Column("peak above start", lambda r: format_bytes(r["peak_increase_bytes"])
               if r["status"] == "ok" and r["device"] != "cuda" else None),
        Column("start", memory_profiling.gpu_ok(_bytes("start_bytes"))), Column("peak", memory_profiling.peak_cell),
        Column("timeline peak", memory_profiling.gpu_ok(_bytes("timeline_peak_bytes"))),
        Column("predicted", memory_profiling.predicted_cell),
        Column("error", memory_profiling.gpu_ok(lambda r: f"{r['peak_bytes'] / r['predicted_peak_bytes'] - 1:+.1%}")),
        Column("predicted peak at", memory_profiling.gpu_ok(lambda r: r["predicted_phase"])),
        Column("a miss's gap, nearest component", memory_profiling.gpu_ok(memory_profiling.miss)))),
    Text(memory_profiling.prediction_summary), Text(memory_profiling.autocast_note),
    when(memory_profiling.has_saved_activations, memory_profiling.SAVED_SETUP),
    Table(where=memory_profiling.has_saved_activations, columns=(
        "precision", Column("context", "context_length"), Column("measured", _bytes("measured_saved_bytes")),
        Column("predicted", _bytes("predicted_saved_bytes")),
        Column("measured - predicted (bytes)", lambda r: r["measured_saved_bytes"] - r["predicted_saved_bytes"]),
        Column("error", lambda r: f"{r['measured_saved_bytes'] / r['predicted_saved_bytes'] - 1:+.2%}"))),
    Text(memory_profiling.residual_setup, {"table": "residual"}),
    Table(where={"table": "residual"}, columns=(
        "precision",
        Column("batch x context x d_model x 4 B", lambda r: f"{r['batch_size']} x {r['context_length']} x "
               f"{r['d_model']} x 4 = {r['computed_bytes'] / MIB:.2f} MiB"),
        Column("first block's output", lambda r: f"{r['shape']} {r['dtype']}"),
        Column("measured (MiB)", lambda r: r["measured_bytes"] / MIB),
        Column("match", lambda r: r["measured_bytes"] == r["computed_bytes"]))),
    when({"table": "timeline"}, memory_profiling.TIMELINE_SETUP),
    Drawn("memory_timeline.png", draw=memory_profiling.timeline_figure, where={"table": "timeline"},
          alt="active memory"),
    when(SNAPSHOT, memory_profiling.SNAPSHOT_SETUP),
    Table(where=SNAPSHOT, order=memory_profiling.snapshot_order, columns=(
        Column("cell", memory_profiling.cell_name), Column("snapshot", lambda r: f"[{r['file']}]({r['file']})"),
        Column("size", _bytes("file_bytes")), Column("stacks kept", lambda r: r.get("stacks", "")))),
    Text(memory_profiling.snapshot_images, SNAPSHOT),
    Text(memory_profiling.allocations(Table(order=lambda r: r["rank"], columns=(
        Column("size (MiB)", "size_mib"), "count", "source", Column("innermost frame", "innermost"))))),
    Text(memory_profiling.block_setup),
    Table(where=memory_profiling.is_block_row, rows_of=memory_profiling.block_summaries),
    Table(where=memory_profiling.is_block_row, rows_of=memory_profiling.block_operations, columns=(
        "precision", "block", "operation", Column("residuals", _bytes("bytes")),
        Column("share", lambda r: f"{r['share']:.1%}")))), requires={"table": "peak"})


# communication_accounting: the XXL model's memory, FSDP, the compute-bound batch, collectives and layouts.
COMMUNICATION_ACCOUNTING = Layout((
    "## The XXL model\n", Text(communication_accounting.xxl_model),
    "## (a) Memory on one device\n",
    Table(where={"table": "state"}, columns=(
        "component", Column("bytes/param", "bytes_per_param"), Column("bytes", lambda r: f"{r['bytes']:,}"),
        Column("GB", "gb"), Column("GiB", "gib"))),
    Text(communication_accounting.saved_activations),
    Table(where={"table": "activations"}, columns=(
        Column("batch", lambda r: f"{r['sequences']} x {r['tokens'] // r['sequences']:,} tokens"),
        Column("saved activations (GB)", "activation_gb"), Column("(GiB)", "activation_gib"),
        Column("with the fp32 state (GB)", "with_state_gb"), Column("H100 80GB equivalents", "h100s"))),
    Text(communication_accounting.memory_answer),
    "## (b) FSDP across N_FSDP devices\n", Text(communication_accounting.fsdp_memory),
    Table(where={"table": "fsdp"}, columns=(
        Column("tokens", lambda r: f"{r['tokens']:,}"), Column("A, saved activations (GB)", "activation_gb"),
        Column("smallest N_FSDP", lambda r: "none: A/2 alone exceeds a chip" if r["min_fsdp_devices"] is None
               else r["min_fsdp_devices"]),
        Column("GB per device at that N_FSDP", "gb_per_device"))),
    Text(communication_accounting.fsdp_answer),
    Text(communication_accounting.compute_bound_model),
    Table(where={"table": "layer_times", "mesh": communication_accounting.QUESTION_MESH}, columns=(
        Column("tokens / device", "tokens_per_device"), Column("batch (tokens)", lambda r: f"{r['tokens']:,}"),
        Column("compute (ms)", "compute_ms"), Column("FSDP gathers (ms)", "weight_comm_ms"),
        Column("TP gather + scatter (ms)", "activation_comm_ms"),
        Column("compute bound", parallelism_calcs.yes_no("compute_bound")))),
    Text(communication_accounting.compute_bound_answer),
    Text(communication_accounting.smaller_batches),
    "## Beyond the question: ring collectives and parallel layouts on the v5p mesh\n",
    "### Ring collectives\n", Text(communication_accounting.ring_latency),
    Table(where={"table": "collective"}, rows_of=communication_accounting.collective_cells, columns=(
        Column("array", lambda r: communication_accounting.size(r["array_bytes"])), Column("N", "devices"),
        *(Column(f"{name} (us)", name) for name in COLLECTIVES),
        Column("all_gather latency share", "all_gather_latency_share"))),
    "### Compute vs communication per block: DP, FSDP, TP, FSDP+TP\n",
    "Per block and phase in (c)'s model (cs336_systems.accounting.parallelism.layer_times): DP and FSDP need "
    "b >= alpha / M_X. \"any\"/\"never\": compute bound at every/no batch; min batch = N x the larger threshold.\n",
    Table(where={"table": "crossover", "exact_ring": False, "comm_bytes_per_element": BF16_BYTES}, columns=(
        Column("mesh (64 v5p chips)", "mesh"), Column("X", "data_devices"), Column("Y", "tensor_devices"),
        Column("M_X", "data_axes"), Column("M_Y", "tensor_axes"),
        *(Column(header, lambda r, column=column: communication_accounting.tokens(r[column])) for header, column in (
            ("forward b_min", "forward_min_tokens_per_device"), ("backward b_min", "backward_min_tokens_per_device"),
            ("min batch (tokens)", "min_global_tokens"))))),
    Plot("communication_accounting_forward.png", x="tokens_per_device",
         y=lambda r: r["compute_ms"] / (r["weight_comm_ms"] + r["activation_comm_ms"]), series="mesh",
         where=communication_accounting.plotted, series_order=communication_accounting.PLOTTED_MESHES.index,
         xscale=LOG2, yscale=LOG,
         references=(Reference(lambda rows: [(1.0, "compute = communication")]),),
         xlabel="tokens per chip (B / N)", ylabel="forward compute time / communication time",
         title="XXL block on 64 TPU v5p chips (model, not measured)", alt="forward compute / communication",
         grid=True, legend_fontsize=8),
    "### Activation memory of an XXL block (bf16)\n",
    "    per device, X x Y mesh          2 (D + F / Y) L B / X   (In gathered over Y is kept; Tmp is sharded)\n"))


# parallelism_calcs: the handout's assumptions, each problem's answers, then the worked figure's table.
def _node_table(*devices: str) -> Table:
    """Each split of one node, per pass: compute, communication and whether communication bottlenecks it."""
    return Table(where={"table": "node"}, columns=(
        *devices, Column("pass", "phase"), Column("compute (ms)", "compute_ms"),
        Column("communication (ms)", "comm_ms"),
        Column("communication bottlenecked", parallelism_calcs.yes_no("comm_bottlenecked"))))


def _parallelism(name: str, answers: Callable[[list], str], table: Table, answer: Answer) -> Problem:
    """A 2026 parallelism problem: computed in closed form, reported as its answers and one table."""
    layout = Layout((parallelism_calcs.ASSUMPTIONS, Text(answers), table))
    return Problem(name, (Report(name, layout),), answer, device_independent=True)


ALTERNATE_TABLE = Table(where={"table": "node"}, columns=(
    "N", Column("ring all-reduce (ms)", "ring_ms"), Column("alternate (ms)", "alternate_ms"),
    Column("alternate / ring", lambda r: f"{r['alternate_over_ring']:.2f} (N / 2 = {r['N'] / 2:g})")))
FSDP_TP_TABLE = Table(where={"table": "node"}, columns=(
    Column("N_FSDP x N_TP", lambda r: f"{r['N_FSDP']} x {r['N_TP']}"), Column("compute (ms)", "compute_ms"),
    Column("FSDP axis (ms)", "fsdp_axis_ms"), Column("TP axis (ms)", "tp_axis_ms"),
    Column("overlapped: bottlenecked", parallelism_calcs.yes_no("comm_bottlenecked")),
    Column("shared: bottlenecked", parallelism_calcs.yes_no("shared_comm_bottlenecked"))))


# Naive attention (pytorch_attention)
PYTORCH_ATTENTION = Layout((
    Text(attention.timings_setup),
    Table(order=attention.cell_order, columns=(
        Column("d", "head_dim"), Column("N", "seq_len"), Column("forward (ms)", attention.ms("forward")),
        Column("backward (ms)", attention.ms("backward")),
        Column("before backward (GiB)", lambda r: attention.gib(r.get("memory_before_backward_bytes")), optional=True),
        Column("predicted (GiB)", lambda r: attention.gib(attention.memory_of(r).before_backward_bytes)),
        Column("out of memory", lambda r: attention.oom_when(r) if r["status"] == OOM else ""))),
    Text(attention.findings),
    Text(attention.accounting_intro),
    Table(rows_of=attention.accounting_breakdown, columns=(
        "tensor", "shape", Column("GiB", lambda b: f"{b['bytes'] / GIB:.4g}"), "note")),
    Table(rows_of=attention.accounting_totals, columns=(
        "total", Column("predicted (GiB)", lambda t: f"{t['predicted'] / GIB:.4g}"),
        Column("measured (GiB)", lambda t: attention.gib(t["measured"])),
        Column("share of device memory", lambda t: f"{t['predicted'] / t['device']:.0%}" if t["device"] else ""))),
    Text(attention.accounting_notes),
    Text(attention.validation_intro),
    Table(where=attention.peaks_measured, order=attention.cell_order, columns=(
        Column("d", "head_dim"), Column("N", "seq_len"),
        Column("added by forward: measured (GiB)", lambda r: attention.gib(attention.retained(r))),
        Column("predicted (GiB)", lambda r: attention.gib(attention.memory_of(r).retained_bytes)),
        Column("forward peak: measured / predicted", lambda r: f"{attention.peak_ratio('forward')(r):.3f}"),
        Column("backward peak: measured / predicted", lambda r: f"{attention.peak_ratio('backward')(r):.3f}"))),
    Text(attention.validation_finding),
    Plot("pytorch_attention_memory.png", x="seq_len", y="gib", series=lambda p: (p["head_dim"], p["kind"]),
         label=lambda series: f"d={series[0]}, {series[1]}", rows_of=attention.memory_points,
         style=lambda series: {"linestyle": "--", "marker": None} if series[1] == "predicted" else {},
         colour_of=lambda series: series[0], references=(Reference(attention.device_memory_line, linestyle=":"),),
         xscale=LOG2, yscale=LOG, xlabel="sequence length N", ylabel="memory before backward (GiB)",
         title="Naive attention: memory in use before backward", alt="memory before backward against N",
         tight_layout=False)), requires={"attention": "naive"})


# Kernel tables of a training step (nsys_profile)
def _kernel_column(header: str, name: str, chars: int = nsys_profile.TABLE_NAME_CHARS) -> Column:
    return Column(header, lambda row: short_name(row[name], chars))


KERNEL_TABLE = (
    _kernel_column("kernel", "kernel", nsys_profile.KERNEL_TABLE_NAME_CHARS),
    Column("matmul", lambda k: {True: "yes", False: "no"}.get(k.get("matmul"), "")), "calls",
    Column("calls per instance", lambda k: f"{k['calls_per_instance']:g}"), Column("total (ms)", "total_ms"),
    Column("share", lambda k: f"{k['share']:.1%}"))
NSYS_PROFILE = Layout((
    Text(nsys_profile.setup),
    Text(nsys_profile.forward_time_setup),
    Table(rows_of=nsys_profile.measured, columns=(
        "size", "context", Column("timer forward (ms)", nsys_profile.timer_forward),
        Column("profiled forward range (ms)", nsys_profile.in_range("forward", "wall_ms")),
        Column("forward work (ms)", nsys_profile.in_range("forward", "work_ms")),
        Column("work / timer", lambda c: f"{c['range']['forward']['work_ms'] / c['cell']['timer_forward_ms']:.0%}"))),
    Text(nsys_profile.forward_time_note),
    Text(nsys_profile.when_measured("## (b) The top forward kernel\n")),
    Table(rows_of=nsys_profile.measured, columns=(
        "size", "context",
        Column("top forward kernel", lambda c: short_name(nsys_profile.top_kernel(c)["kernel"],
                                                          nsys_profile.TABLE_NAME_CHARS)),
        Column("share of forward", lambda c: f"{nsys_profile.top_kernel(c)['share']:.0%}"),
        Column("calls per forward pass", lambda c: f"{nsys_profile.top_kernel(c)['calls_per_instance']:g}"),
        Column("top over forward+backward", nsys_profile.top_over_forward_backward),
        Column("its share",
               lambda c: f"{nsys_profile.top_kernel(c, nsys_profile.FORWARD_BACKWARD)['share']:.0%}"))),
    Text(nsys_profile.calls_note),
    Text(nsys_profile.when_measured(f"## (c) Non-matmul kernels above {nsys_profile.MAIN_KERNEL_SHARE:.0%} of forward "
                                    "time\n\nFor each size at the longest context it ran.\n")),
    Table(rows_of=nsys_profile.main_kernels, columns=(
        "size", Column("context", "context_length"), _kernel_column("kernel", "kernel"),
        Column("share of forward", lambda k: f"{k['share']:.1%}"), "calls")),
    Text(nsys_profile.no_main_kernel),
    Text(nsys_profile.when_measured("## (d) Matmul share: forward against the full training step\n\n"
                                    "Matmul share of kernel time, forward / full step.\n")),
    Table(rows_of=nsys_profile.measured,
          pivot=Pivot(("size",), "context", label="context", value=lambda c: " / ".join(
              f"{c['range'][name]['matmul_share']:.0%}" for name in ("forward", STEP_RANGE)))),
    Text(nsys_profile.matmul_share_note),
    Text(nsys_profile.attention_setup),
    Table(rows_of=nsys_profile.attention_cells, columns=(
        "size", "context", Column("d_head", lambda c: c["cell"]["d_head"]),
        Column("matmul (ms)", nsys_profile.attention_matmul_ms),
        Column("softmax (ms)", nsys_profile.in_range("attention/softmax", "work_ms")),
        Column("scale + mask (ms)", lambda c: (c["range"]["attention/scores"]["work_ms"]
                                             - c["range"]["attention/scores"]["matmul_ms"])),
        Column("softmax / matmul time", lambda c: NOT_A_NUMBER if (ratio := nsys_profile.softmax_time_ratio(c)) is None
               else f"{ratio:.2f}"),
        Column("FLOP ratio", lambda c: f"{nsys_profile.softmax_flop_ratio(c):.4f}"),
        Column("time ratio / FLOP ratio", nsys_profile.time_over_flop_ratio))),
    Text(nsys_profile.attention_finding),
    Text(nsys_profile.beside_variants_heading),
    Table(rows_of=nsys_profile.beside_variants),
    Text(nsys_profile.kernel_tables_heading),
    *(part for name in nsys_profile.KERNEL_TABLE_RANGES
      for part in (Text(nsys_profile.range_heading(name)), Table(rows_of=nsys_profile.kernels_of(name),
                                                                 columns=KERNEL_TABLE))),
    Text(nsys_profile.nsys_section, {"table": "nsys"})))


# distributed_communication_single_node
ALLREDUCE_LINES = ("backend", "world_size")
ALLREDUCE_REPORT = Layout((
    Text(allreduce.setup),
    "## Time (ms)\n",
    Table(rows_of=allreduce.in_order, pivot=Pivot(ALLREDUCE_LINES, "size", allreduce.time_cell)),
    "## Bus bandwidth, GB/s (algorithm bandwidth in brackets)\n",
    Table(rows_of=allreduce.in_order, pivot=Pivot(ALLREDUCE_LINES, "size", allreduce.bandwidth_cell)),
    Text(allreduce.nominal_comparison),
    Text(allreduce.findings),
    Plot("allreduce_bus_bandwidth.png", x="size_mb", y="busbw_gbps", series=lambda r: (r["backend"], r["world_size"]),
         label=lambda line: f"{line[0]}, {line[1]} ranks", where=lambda r: not allreduce.out_of_memory(r),
         xscale=LOG, yscale=LOG, xlabel="all-reduce size (MB)", ylabel="bus bandwidth (GB/s)",
         title="all-reduce bus bandwidth", alt="bus bandwidth", references=(Reference(allreduce.nominal_links),),
         grid=True, legend_fontsize=8)))


# flash_benchmarking
LEADERBOARD, GATE, HOST_ISSUE = {"table": "leaderboard"}, {"table": "gate"}, {"table": "host_issue"}


def _flash_sweep(precision: str) -> tuple[Part, ...]:
    """A precision's sweep: a table per mode under its heading, then the plot of every mode's times."""
    tables: list[Part] = []
    for mode in ATTENTION_MODES:
        where = {"table": "sweep", "precision": precision, "mode": mode}
        heading = f"### {precision}, {MODE_LABELS[mode]}\n"
        tables += [when(where, heading), Table(where=where, rows_of=flash.sweep_lines)]
    return (*tables, GridPlot(
        f"flash_benchmarking_{precision}.png", x="seq_len", y="median_ms", series="provider",
        label=provider_label, series_order=flash.provider_order,
        where=lambda r: r.get("table") == "sweep" and r["precision"] == precision and ran(r),
        facet="head_dim", facet_row="mode", facet_row_order=ATTENTION_MODES.index,
        panel_title=lambda mode, d: f"{MODE_LABELS[mode]}, d={d}",
        xscale=LOG2, yscale=LOG, xlabel="N", ylabel="ms",
        title=f"Causal attention, batch 1, {precision}: time against sequence length",
        alt=f"{precision}: time against N", markersize=3, legend_fontsize="x-small"))


FLASH_REPORT = Layout((
    Text(flash.sources), Text(flash.sweep_setup, SWEEP), Text(flash.unmeasured, SWEEP),
    *(part for precision in PRECISIONS for part in _flash_sweep(precision)),
    Text(flash.findings, SWEEP),
    Text(flash.leaderboard_setup, LEADERBOARD), Table(where=LEADERBOARD, rows_of=flash.leaderboard_lines),
    Text(flash.gate_setup, GATE),
    Table(where=GATE, columns=(Column("provider", lambda r: provider_label(r["provider"])), "backend",
                               Column("median (ms)", flash.time_cell))),
    Text(flash.host_issue_setup, HOST_ISSUE), Table(where=HOST_ISSUE, rows_of=flash.host_issue_lines),
    when({"status": FAILED}, "## Failures of the implementation under test\n"),
    Table(where={"status": FAILED}, columns=(
        "table", "provider", "precision", Column("d", "head_dim"), Column("N", "seq_len"),
        Column("mode", lambda r: MODE_LABELS.get(r["mode"], r["mode"])), "error"))))


# flash_benchmarking: flash_in_training
def _training_steps(table: str) -> Table:
    """The training steps of `table` (uncaptured or in CUDA graphs), each against SDPA's step of its cell."""
    return Table(where={"table": table}, rows_of=flash_in_training.against_sdpa, columns=(
        Column("size", lambda r: f"{r['size']} ({r['size_table']} table)"),
        Column("d_model / heads / d_head", lambda r: f"{r['d_model']} / {r['n_heads']} / {r['head_dim']}"),
        Column("context", "context_length"), "attention",
        Column("step ms, median (IQR)", flash_in_training.step_time),
        Column("std / mean", if_ran(lambda r: f"{r['std_ms'] / r['mean_ms']:.1%}")),
        Column("vs SDPA", lambda r: f"{r['vs_sdpa']:.3f}x" if r["vs_sdpa"] else None),
        Column("TFLOP/s", if_ran(lambda r: f"{r['tflops']:.0f}")),
        Column("peak GiB", lambda r: f"{r['peak_memory_gib']:.1f}" if r.get("peak_memory_gib") else None),
        Column("first loss", if_ran(lambda r: f"{r['first_loss']:.4f}"))))


FLASH_IN_TRAINING_REPORT = Layout((
    Text(flash_in_training.steps_setup, {"table": "step"}), _training_steps("step"),
    when({"table": "graphed_step"}, flash_in_training.GRAPHED_STEPS_SETUP), _training_steps("graphed_step"),
    when({"table": "kernels"}, flash_in_training.KERNELS_SETUP),
    Table(where={"table": "kernels"}, rows_of=flash_in_training.kernel_lines)))


# The end-to-end model benchmarks (reports.e2e): time per phase, the warm-up study, mixed precision.
WARMUP = {"table": "warmup"}
AUTOCAST_DTYPES, NORMALISATION = {"table": "autocast_dtypes"}, {"table": "normalization"}
BENCHMARKING_SCRIPT = Layout((
    Text(e2e.sweep_setup, SWEEP),
    # One line per size and phase, a column per context: the main variant's, then each other variant's.
    Table(where=SWEEP, order=e2e.phase_order, rows_of=e2e.variant_columns,
          pivot=Pivot(("size", "phase"), "context_length", e2e.mean_std, heading=e2e.context_heading)),
    Text(e2e.variation_summary, SWEEP),
    Text(e2e.warmup_study_setup, WARMUP),
    Table(where=e2e.is_warmup_part, order=e2e.warmup_order, columns=(
        "size", Column("warm-up steps", "warmup"), "phase", Column("mean ± std (ms)", e2e.mean_std),
        Column("median (ms)", "median_ms"), Column("first timed step (ms)", "first_ms"),
        Column("slowest step (ms)", "max_ms"))),
    Text(e2e.warmup_findings, WARMUP)), rows_of=lambda rows: e2e.latest_cells(rows, E2E_KEY))
BENCHMARKING_MIXED_PRECISION = Layout((
    Text(e2e.autocast_setup, AUTOCAST_DTYPES), Table(where=AUTOCAST_DTYPES, columns=("tensor", "dtype")),
    Text(e2e.autocast_findings, AUTOCAST_DTYPES),
    when(NORMALISATION, e2e.NORMALISATION_SETUP),
    Table(where=NORMALISATION, columns=("storage_dtype", "mean_square", "relative_error")),
    Text(e2e.normalisation_findings, NORMALISATION),
    # fp32 against bf16 per cell: two rows and their ratio on each line, which no pivot shows.
    Text(e2e.precision_setup, SWEEP), Table(where=SWEEP, rows_of=e2e.precision_comparison),
    Text(e2e.precision_speedups, SWEEP)), rows_of=lambda rows: e2e.latest_cells(rows, MIXED_PRECISION_KEY))


# torch_compile: naive attention (reports.attention), then the whole model (reports.e2e): eager against
# compiled, and the compiled step against a torch-native reference; the latest run's row of each cell.
def _compiled_ms(way: str, phase: str) -> Column:
    return Column(f"{phase} {way} (ms)", lambda pair: attention.ms(phase)(pair[way]))


def _compiled_memory(way: str) -> Column:
    return Column(f"before backward, {way} (GiB)", optional=True,
                  value=lambda pair: pair[way] and attention.gib(pair[way].get("memory_before_backward_bytes")))


def _of_phases(value: Callable[[Row], Any]) -> Callable[[Row], Any]:
    """A profiled phase's cell of `value`; none on a whole step's line."""
    return lambda row: None if row["phase"] == "step" else value(row)


def _of_steps(value: Callable[[Row], Any]) -> Callable[[Row], Any]:
    """A profiled whole step's cell of `value`; none on a phase's line."""
    return lambda row: value(row) if row["phase"] == "step" else None


TORCH_COMPILE = Layout((
    Text(attention.compiled_setup, {"table": "attention"}),
    Table(where={"table": "attention"}, rows_of=attention.compiled_pairs, columns=(
        "d", "N", *(column for phase in attention.PHASES for column in (
            _compiled_ms("eager", phase), _compiled_ms("compiled", phase),
            Column(f"{phase} speed-up", attention.speedup(phase)))),
        _compiled_memory("eager"), _compiled_memory("compiled"),
        Column("compiled: first fwd+bwd (s)", attention.first_pass_s))),
    Text(attention.compiled_findings),
    Text(e2e.compiled_models_setup, SWEEP),
    # A line per cell: its eager and compiled rows side by side, and their ratio.
    Table(where=SWEEP, rows_of=lambda rows: e2e.comparison_lines(rows, "compile", False, True), columns=(
        "size", "context_length", "precision", Column("phase", e2e.phase_cell),
        Column("eager (ms)", e2e.time_cell("base")), Column("compiled (ms)", e2e.time_cell("other")),
        Column("speed-up", e2e.speedup_cell), Column("eager MFU", e2e.mfu_cell("base"), optional=True),
        Column("compiled MFU", e2e.mfu_cell("other"), optional=True))),
    Text(e2e.compiled_speedups, SWEEP),
    Text(e2e.reference_setup),
    Table(rows_of=e2e.reference_lines, columns=(
        "size", Column("context", "context_length"), "precision", Column("project (ms)", e2e.time_cell("project")),
        Column("torch reference (ms)", e2e.time_cell("reference")), Column("project / reference", e2e.ratio_cell),
        Column("host issue / step: project; reference", e2e.host_issue_cell, optional=True),
        Column("GPU clock: project; reference", e2e.clock_cell, optional=True))),
    Text(e2e.breakdown_setup),
    # Phases split their kernel time, steps their wall time: each kind of line leaves the other's columns empty.
    Table(rows_of=e2e.breakdown_lines, columns=(
        Column("model", lambda r: r.get("model") or "project"), "size", Column("context", "context_length"),
        "precision", Column("phase", e2e.breakdown_phase_cell),
        Column("kernels (ms)", _of_phases(lambda r: f"{r['work_ms']:.1f}"), optional=True),
        *(Column(kind, _of_phases(e2e.kernel_share_cell(f"{kind}_ms")), optional=True)
          for kind in ("matmul", "attention", "other")),
        Column("step (ms)", _of_steps(lambda r: f"{r['step_ms']:.1f}"), optional=True),
        Column("GPU busy (ms)", _of_steps(e2e.busy_cell), optional=True),
        Column("GPU idle (ms)", _of_steps(e2e.idle_cell), optional=True)))),
    rows_of=lambda rows: e2e.latest_cells(rows, TORCH_COMPILE_KEY))


# Mixed-precision accumulation (reports.mixed_precision).
MIXED_PRECISION_ACCUMULATION = Layout((
    Text(mixed_precision.setup), mixed_precision.ACCUMULATION_TABLE, Text(mixed_precision.findings)))


# DDP
def _ddp_equivalence(*methods: str) -> Layout:
    """A DDP wrapper's report against single-process training: the run, a line per variant, and each one's verdict."""
    mine = ddp.equivalence_of(*methods)
    return Layout((Text(ddp.equivalence_setup, mine),
                   Table(where=mine, columns=("variant", "world_size", "backend", "steps", "max_abs_difference",
                                              "tolerance", "matches")),
                   Text(ddp.equivalence_verdicts, mine)), requires=mine)


def _ddp_steps(*methods: str) -> Table:
    """The DDP benchmarking reports' step table: each variant of `methods` with its phases, its time over local
    training, and how much of its profiled communication ran beside compute."""
    return Table(where=ddp.steps_of(*methods), rows_of=ddp.with_time_over_local, columns=(
        "variant", Column("all-reduces", if_ran("all_reduces_per_step")), Column("step", ddp.step_cell),
        *(Column(phase, if_ran(f"{phase}_ms")) for phase in ("forward", "backward", "gradient_sync", "optimizer")),
        Column("over local", "over_local_ms"), Column("communication (profiled)", if_ran("profiled_communication_ms")),
        Column("overlapped with compute", if_ran(ddp.overlapped_share)), Column("peak GiB", if_ran("peak_memory_gib"))))


def _ddp_benchmarking(methods: tuple[str, ...], *parts: Part, heading: str = "") -> Layout:
    """A DDP benchmarking report: the run, the step table of `methods` under `heading`, then `parts`."""
    return Layout((Text(ddp.setup), heading, _ddp_steps(*methods), *parts), requires={"table": "step"})


DDP_OVERHEAD_TABLE = Table(rows_of=ddp.overhead_by_bucket_size, columns=(
    Column(f"bucket {ddp.BUCKET_UNIT}", "bucket_size_mb"), Column("buckets", "all_reduces_per_step"),
    Column("course model (ms)", "course_model_ms"),
    Column("with measured backward (ms)", "pipelined_model_ms", optional=True),
    Column("measured gradient_sync (ms)", "gradient_sync_ms")))


# Leaderboard
# Each variant's step: its setup, the blocks it checkpoints, its time and phases, throughput and memory; a variant that
# did not run shows why, and the columns no variant has a value in are left out.
LEADERBOARD_STEPS = Table(where={"table": "step"}, present_only=True, columns=(
    "variant", "setup", Column("checkpointed blocks", lambda r: f"{r['checkpointed_blocks']} of {r['num_layers']}"),
    Column("step (ms)", leaderboard.step_cell),
    Column("min to max (ms)", if_ran(lambda r: f"{format_ms(r['min_ms'])} to {format_ms(r['max_ms'])}")),
    *(Column(phase, if_ran(lambda r, phase=phase: format_ms(r[f"{phase}_ms"])))
      for phase in ("forward", "backward", "optimizer")),
    Column("tokens/s", if_ran(lambda r: f"{r['tokens_per_s']:,.0f}")),
    Column("model TFLOP/s per GPU", if_ran(leaderboard.tflops_per("GPU"))),
    Column("model TFLOP/s per rank", if_ran(leaderboard.tflops_per("rank"))),
    Column("peak per rank (GiB)", if_ran(lambda r: None if r.get("peak_gib") is None else f"{r['peak_gib']:.1f}")),
    Column("estimate (GiB)", lambda r: f"{r['model_peak_gib']:.1f}")))
LEADERBOARD_REPORT = Layout((
    Text(leaderboard.correctness_setup, EQUIVALENCE),
    Table(where=EQUIVALENCE, columns=("variant", "setup", "relative_loss_difference",
                                                   "max_relative_gradient_difference", "tolerance", "matches")),
    Text(leaderboard.step_setup, {"table": "step"}), LEADERBOARD_STEPS, Text(leaderboard.step_sentences),
    Text(leaderboard.parts_section), Text(leaderboard.kernel_setup, leaderboard.is_kernel),
    Table(where=leaderboard.is_kernel, columns=(
        Column("provider", lambda r: provider_label(r["provider"])), Column("mode", lambda r: MODE_LABELS[r["mode"]]),
        Column("median (ms)", lambda r: format_ms(r["median_ms"])),
        Column("TFLOP/s", lambda r: f"{r['tflops']:.0f}"))),
    Text(leaderboard.attention_per_step)))


PROBLEMS: tuple[Problem, ...] = (
    Problem("benchmarking_script",
            (Report("benchmarking_script", BENCHMARKING_SCRIPT, E2E_KEY),),
            e2e.answer_benchmarking_script, "e2e", ("perf/test_e2e.py",)),
    Problem("nsys_profile", (Report("nsys_profile", NSYS_PROFILE, NSYS_KEY),),
            nsys_profile.answer_nsys_profile, "profile", ("perf/test_profile.py",),
            every_size=False),
    Problem("mixed_precision_accumulation",
            (Report("mixed_precision_accumulation", MIXED_PRECISION_ACCUMULATION),),
            mixed_precision.answer_mixed_precision_accumulation, "e2e", ("perf/test_e2e.py",)),
    Problem("benchmarking_mixed_precision",
            (Report("benchmarking_mixed_precision", BENCHMARKING_MIXED_PRECISION, MIXED_PRECISION_KEY),),
            e2e.answer_benchmarking_mixed_precision, "e2e", ("perf/test_e2e.py",)),
    Problem("memory_profiling", (Report("memory_profiling", MEMORY_PROFILING),),
            memory_profiling.answer_memory_profiling, "memory", ("perf/test_memory.py",),
            open_items=memory_profiling.open_items_memory_profiling),
    Problem("gradient_checkpointing",
            (Report("gradient_checkpointing", GRADIENT_CHECKPOINTING),),
            gradient_checkpointing.answer_gradient_checkpointing, "memory", ("perf/test_memory.py",),
            open_items=gradient_checkpointing.open_items_gradient_checkpointing),
    Problem("pytorch_attention",
            (Report("pytorch_attention", PYTORCH_ATTENTION, ATTENTION_KEY),),
            attention.answer_pytorch_attention, "attention", ("perf/test_attention.py",)),
    Problem("torch_compile",
            (Report("torch_compile", TORCH_COMPILE, TORCH_COMPILE_KEY),),
            attention.answer_torch_compile, "e2e", ("perf/test_e2e.py", "perf/test_attention.py")),
    Problem("flash_forward / flash_backward", (), flash.answer_flash_forward_backward),
    Problem("flash_benchmarking",
            (Report("flash_benchmarking", FLASH_REPORT, FLASH_KEY),
             Report("flash_in_training", FLASH_IN_TRAINING_REPORT, FLASH_IN_TRAINING_KEY,
                    needs_gpu=True)),
            flash.answer_flash_benchmarking, "flash", ("perf/test_flash.py",)),
    Problem("distributed_communication_single_node",
            (Report("distributed_communication_single_node", ALLREDUCE_REPORT, ALLREDUCE_KEY),),
            allreduce.answer_distributed_communication_single_node, "ddp", ("perf/test_allreduce.py",),
            open_items=allreduce.open_items_distributed_communication_single_node),
    Problem("naive_ddp / naive_ddp_benchmarking",
            (Report("naive_ddp", _ddp_equivalence("naive", "flat")),
             Report("naive_ddp_benchmarking", _ddp_benchmarking(
                 ("local", "naive"), Text(ddp.naive_cost), ddp.TIMELINES_HEADING,
                 Text(ddp.timelines("local", "naive"))))),
            ddp.answer_naive_ddp, "ddp", ("perf/test_ddp.py",), 2),
    Problem("minimal_ddp_flat_benchmarking",
            (Report("minimal_ddp_flat_benchmarking", _ddp_benchmarking(
                ("local", "naive", "flat"), Text(ddp.flattening), "## Timeline (one profiled step on rank 0)\n",
                Text(ddp.timelines("flat")))),),
            ddp.answer_minimal_ddp_flat_benchmarking, "ddp", ("perf/test_ddp.py",), 2),
    Problem("ddp_overlap_individual_parameters",
            (Report("ddp_overlap_individual_parameters", _ddp_equivalence("overlap_individual")),
             Report("ddp_overlap_individual_parameters_benchmarking", _ddp_benchmarking(
                 (*ddp.UNBUCKETED_METHODS, *ddp.UNDER_TEST_INDIVIDUAL), Text(ddp.overlap_ranking),
                 ddp.TIMELINES_HEADING + "\n" + ddp.TIMELINE_ROWS,
                 Text(ddp.timelines("naive", "overlap_individual", *ddp.UNDER_TEST_INDIVIDUAL))))),
            ddp.answer_ddp_overlap_individual_parameters, "ddp", ("perf/test_ddp.py",), 2),
    Problem("ddp_overlap_bucketed",
            (Report("ddp_overlap_bucketed", _ddp_equivalence("bucketed")),
             Report("ddp_bucketed_benchmarking", _ddp_benchmarking(
                 (*ddp.UNBUCKETED_METHODS, *ddp.BUCKETED_METHODS),
                 Text(ddp.targets_heading), Table(rows_of=ddp.targets, columns=("target", "measured", "met")),
                 Text(ddp.bucket_sizes), Text(ddp.overhead_model), DDP_OVERHEAD_TABLE,
                 Text(ddp.transfer_against_backward), ddp.TIMELINES_HEADING,
                 Text(ddp.timelines(*ddp.BUCKETED_METHODS)), heading="## (a) Time per step by bucket size\n"))),
            ddp.answer_ddp_overlap_bucketed, "ddp", ("perf/test_ddp.py",), 2, only_in_handout="2025"),
    Problem("optimizer_state_sharding",
            (Report("optimizer_state_sharding", Layout((
                Text(sharding.equivalence_text), Text(sharding.resynchronisation_text),
                Table(where=sharding.is_sharded_step, columns=(
                    "variant", Column("optimizer step (ms)", "optimizer_ms"), Column("training step (ms)", "step_ms"))),
                Text(sharding.fastest_resynchronisation)))),
             Report("optimizer_state_sharding_accounting", Layout((
                 Text(sharding.accounting_setup), _step_table("DDP + ZeroRedundancyOptimizer"),
                 Text(sharding.zero_comparison), MEMORY_HEADING, sharding.BREAKDOWN_NOTE, MEMORY_TABLE,
                 Text(sharding.zero_stage_1_section)), requires={"table": "step"}))),
            sharding.answer_optimizer_state_sharding, "sharding", ("perf/test_sharding.py",), 2),
    Problem("fsdp", (
        Report("fsdp", Layout((
            Text(fsdp.equivalence_setup, EQUIVALENCE),
            Table(where=EQUIVALENCE, columns=(
                "compute", "world_size", "backend", "steps", "logits_dtype", "master_dtype", "max_abs_difference",
                "tolerance", "matches")),
            Text(fsdp.equivalence_verdicts, EQUIVALENCE)), requires=EQUIVALENCE)),
        Report("fsdp_accounting", Layout((
            Text(fsdp.accounting_setup), _step_table(fsdp.TORCH_FSDP), Text(fsdp.against_torch), Text(fsdp.expected_saving),
            MEMORY_HEADING, sharding.BREAKDOWN_NOTE + "The init peak of FSDP runs includes the whole model, built "
            "before sharding.\n", MEMORY_TABLE, Text(fsdp.zero_differences), Text(fsdp.readiness_section)),
            requires={"table": "step"}))),
            fsdp.answer_fsdp, "fsdp", ("perf/test_fsdp.py",), 2),
    Problem("communication_accounting",
            (Report("communication_accounting", COMMUNICATION_ACCOUNTING),),
            communication_accounting.answer_communication_accounting, device_independent=True,
            only_in_handout="2025"),
    _parallelism("alternate_ring_all_reduce", parallelism_calcs.alternate, ALTERNATE_TABLE,
                 parallelism_calcs.answer_alternate_ring_all_reduce),
    _parallelism("data_parallel_calcs", parallelism_calcs.data_parallel, _node_table("N_DP"),
                 parallelism_calcs.answer_data_parallel_calcs),
    _parallelism("fsdp_calcs", parallelism_calcs.fsdp, _node_table("N_FSDP"), parallelism_calcs.answer_fsdp_calcs),
    _parallelism("tp_calcs", parallelism_calcs.tp, _node_table("N_TP"), parallelism_calcs.answer_tp_calcs),
    _parallelism("fsdp_tp_calcs", parallelism_calcs.fsdp_tp, FSDP_TP_TABLE, parallelism_calcs.answer_fsdp_tp_calcs),
    Problem("leaderboard", (Report("leaderboard", LEADERBOARD_REPORT),), leaderboard.answer_leaderboard,
            "leaderboard", ("perf/test_leaderboard.py",), 2, open_items=leaderboard.open_items_leaderboard,
            only_in_handout="2026"),
)

REPORTS: dict[str, Report] = {report.name: report for problem in PROBLEMS for report in problem.reports}


def report(name: str) -> Report:
    """The report called `name`; a name no problem has (a user's own benchmark) renders as a plain table."""
    return REPORTS.get(name, Report(name))


MEASURED_BY: dict[str, tuple[str, ...]] = {report.name: problem.measured_by for problem in PROBLEMS
                                           for report in problem.reports if problem.measured_by}


def measured_code(name: str) -> str:
    """The hash of the code a run of the report called `name` measures with now (cs336_systems.provenance): the
    perf modules that write it and the package code they run; for a name no perf module writes, every package
    module that measures."""
    return provenance.measured_code(MEASURED_BY.get(name, ()))
