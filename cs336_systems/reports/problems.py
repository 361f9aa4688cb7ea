"""The table of the course's problems: for each, the perf module that measures it, its reports (the
rows' name, renderer and cell key) and the function that answers its written questions from those
rows. Everything that writes or reads a report finds it here:

    name -> measure (perf/<module>.py, marker) -> rows -> render (Report.render) -> answer (Problem.answer)

A problem family's measuring code is a benchmark module (cs336_systems.benchmarks.<family>), which returns
rows; the renderers of its reports and its answers are the reports module of the same name
(cs336_systems.reports.<family>); each report's cell key is in cs336_systems.rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from cs336_systems import provenance
from cs336_systems.reports import (
    Report,
    Reports,
    allreduce,
    attention,
    communication_accounting,
    ddp,
    e2e,
    flash,
    flash_in_training,
    format_ms,
    fsdp,
    gradient_checkpointing,
    leaderboard,
    memory_profiling,
    mixed_precision,
    nsys_profile,
    parallelism_calcs,
    sharding,
)
from cs336_systems.reports.spec import Column, Layout, Part, Table, Text, Versus, selected
from cs336_systems.rows import (
    ALLREDUCE_KEY,
    ATTENTION_KEY,
    E2E_KEY,
    FLASH_IN_TRAINING_KEY,
    FLASH_KEY,
    MIXED_PRECISION_KEY,
    NSYS_KEY,
    TORCH_COMPILE_KEY,
)

Answer = Callable[[Reports], list[str]]


def _step_table(baseline: str) -> Table:
    """The step table of the optimizer-state sharding and FSDP accounting reports: each variant's step, optimizer
    step, peaks and bytes communicated (the implementation under test's own communication is not counted: its cells
    stay empty), and how its step and peak compare with `baseline`'s."""
    ran = sharding.ran_value
    return Table(where={"table": "step"}, columns=(
        "variant", Column("step (ms)", sharding.step_cell),
        Column("optimizer step (ms)", ran(lambda r: r["optimizer_ms"])),
        Column("peak (GiB)", ran(lambda r: r.get("peak_gib"))),
        Column("model peak (GiB)", ran(lambda r: r["model_peak_gib"])),
        Column("communicated per step (GB)", ran(sharding.gigabytes("communicated_bytes"))),
        Column("sent per rank, ring (GB)", ran(sharding.gigabytes("ring_bytes_sent_per_rank"))),
        Versus(f"step vs {baseline}", "step_ms", {"variant": baseline}),
        Versus(f"peak vs {baseline}", "peak_gib", {"variant": baseline})))


MEMORY_TABLE = Table(where={"table": "memory"}, columns=sharding.MEMORY_COLUMNS, present_only=True,
                     empty=sharding.NO_MEMORY_POINTS)
MEMORY_HEADING = "## Memory at the phase points\n"


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


def _parallelism(name: str, answer: Answer) -> Problem:
    """A 2026 parallelism problem: computed in closed form, its renderer from parallelism_calcs."""
    return Problem(name, (Report(name, parallelism_calcs.RENDERERS[name]),), answer, device_independent=True)


# DDP
def _ddp_equivalence(*methods: str) -> Layout:
    """A DDP wrapper's report against single-process training: the run, a line per variant, and each one's verdict."""
    mine = ddp.equivalence_of(*methods)
    return Layout((Text(lambda rows: ddp.equivalence_setup(selected(rows, mine))),
                   Table(where=mine, columns=("variant", "world_size", "backend", "steps", "max_abs_difference",
                                              "tolerance", "matches")),
                   Text(lambda rows: ddp.equivalence_verdicts(selected(rows, mine)))), requires=mine)


def _ddp_steps(*methods: str) -> Table:
    """The DDP benchmarking reports' step table: each variant of `methods` with its phases, its time over local
    training, and how much of its profiled communication ran beside compute."""
    ran = sharding.ran_value
    return Table(where=ddp.steps_of(*methods), rows_of=ddp.with_time_over_local, columns=(
        "variant", Column("all-reduces", ran(lambda r: r.get("all_reduces_per_step"))), Column("step", ddp.step_cell),
        Column("forward", ran(lambda r: r["forward_ms"])), Column("backward", ran(lambda r: r["backward_ms"])),
        Column("gradient_sync", ran(lambda r: r["gradient_sync_ms"])),
        Column("optimizer", ran(lambda r: r["optimizer_ms"])), Column("over local", "over_local_ms"),
        Column("communication (profiled)", ran(lambda r: r.get("profiled_communication_ms"))),
        Column("overlapped with compute", ran(ddp.overlapped_share)),
        Column("peak GiB", ran(lambda r: r.get("peak_memory_gib")))))


def _ddp_benchmarking(methods: tuple[str, ...], *parts: Part, heading: str = "") -> Layout:
    """A DDP benchmarking report: the run, the step table of `methods` under `heading`, then `parts`."""
    return Layout((Text(ddp.setup), heading, _ddp_steps(*methods), *parts), requires={"table": "step"})


DDP_OVERHEAD_TABLE = Table(rows_of=ddp.overhead_by_bucket_size, columns=(
    Column(f"bucket {ddp.BUCKET_UNIT}", "bucket_size_mb"), Column("buckets", "all_reduces_per_step"),
    Column("course model (ms)", "course_model_ms"),
    Column("with measured backward (ms)", "pipelined_model_ms", optional=True),
    Column("measured gradient_sync (ms)", "gradient_sync_ms")))


# Leaderboard
_ran = sharding.ran_value
# Each variant's step: its setup, the blocks it checkpoints, its time and phases, throughput and memory; a variant that
# did not run shows why, and the columns no variant has a value in are left out.
LEADERBOARD_STEPS = Table(where={"table": "step"}, present_only=True, columns=(
    "variant", "setup", Column("checkpointed blocks", lambda r: f"{r['checkpointed_blocks']} of {r['num_layers']}"),
    Column("step (ms)", leaderboard.step_cell),
    Column("min to max (ms)", _ran(lambda r: f"{format_ms(r['min_ms'])} to {format_ms(r['max_ms'])}")),
    Column("forward", _ran(lambda r: format_ms(r["forward_ms"]))),
    Column("backward", _ran(lambda r: format_ms(r["backward_ms"]))),
    Column("optimizer", _ran(lambda r: format_ms(r["optimizer_ms"]))),
    Column("tokens/s", _ran(lambda r: f"{r['tokens_per_s']:,.0f}")),
    Column("model TFLOP/s per GPU", _ran(leaderboard.tflops_per("GPU"))),
    Column("model TFLOP/s per rank", _ran(leaderboard.tflops_per("rank"))),
    Column("peak per rank (GiB)", _ran(lambda r: None if r.get("peak_gib") is None else f"{r['peak_gib']:.1f}")),
    Column("estimate (GiB)", lambda r: f"{r['model_peak_gib']:.1f}")))
LEADERBOARD_REPORT = Layout((
    Text(leaderboard.correctness_setup),
    Table(where={"table": "equivalence"}, columns=("variant", "setup", "relative_loss_difference",
                                                   "max_relative_gradient_difference", "tolerance", "matches")),
    Text(leaderboard.step_setup), LEADERBOARD_STEPS, Text(leaderboard.step_sentences),
    Text(leaderboard.parts_section), Text(leaderboard.kernel_setup),
    Table(where=leaderboard.is_kernel, columns=(
        Column("provider", lambda r: leaderboard.provider_label(r["provider"])),
        Column("mode", leaderboard.mode_label), Column("median (ms)", lambda r: format_ms(r["median_ms"])),
        Column("TFLOP/s", lambda r: f"{r['tflops']:.0f}"))),
    Text(leaderboard.attention_per_step)))


PROBLEMS: tuple[Problem, ...] = (
    Problem("benchmarking_script",
            (Report("benchmarking_script", e2e.render_benchmarking_script, E2E_KEY, cell_of=e2e.cell_key),),
            e2e.answer_benchmarking_script, "e2e", ("perf/test_e2e.py",)),
    Problem("nsys_profile", (Report("nsys_profile", nsys_profile.render_nsys_profile, NSYS_KEY),),
            nsys_profile.answer_nsys_profile, "profile", ("perf/test_profile.py",),
            open_items=nsys_profile.open_items_nsys_profile, every_size=False),
    Problem("mixed_precision_accumulation",
            (Report("mixed_precision_accumulation", mixed_precision.render_accumulation),),
            mixed_precision.answer_mixed_precision_accumulation, "e2e", ("perf/test_e2e.py",)),
    Problem("benchmarking_mixed_precision",
            (Report("benchmarking_mixed_precision", e2e.render_benchmarking_mixed_precision, MIXED_PRECISION_KEY,
                    cell_of=e2e.cell_key),),
            e2e.answer_benchmarking_mixed_precision, "e2e", ("perf/test_e2e.py",)),
    Problem("memory_profiling", (Report("memory_profiling", memory_profiling.render_memory_profiling),),
            memory_profiling.answer_memory_profiling, "memory", ("perf/test_memory.py",),
            open_items=memory_profiling.open_items_memory_profiling),
    Problem("gradient_checkpointing",
            (Report("gradient_checkpointing", gradient_checkpointing.render_gradient_checkpointing),),
            gradient_checkpointing.answer_gradient_checkpointing, "memory", ("perf/test_memory.py",),
            open_items=gradient_checkpointing.open_items_gradient_checkpointing),
    Problem("pytorch_attention",
            (Report("pytorch_attention", attention.render_pytorch_attention, ATTENTION_KEY),),
            attention.answer_pytorch_attention, "attention", ("perf/test_attention.py",)),
    Problem("torch_compile",
            (Report("torch_compile", attention.render_torch_compile, TORCH_COMPILE_KEY, cell_of=e2e.cell_key),),
            attention.answer_torch_compile, "e2e", ("perf/test_e2e.py", "perf/test_attention.py")),
    Problem("flash_forward / flash_backward", (), flash.answer_flash_forward_backward),
    Problem("flash_benchmarking",
            (Report("flash_benchmarking", flash.render_flash_benchmarking, FLASH_KEY),
             Report("flash_in_training", flash_in_training.render_flash_in_training, FLASH_IN_TRAINING_KEY,
                    needs_gpu=True)),
            flash.answer_flash_benchmarking, "flash", ("perf/test_flash.py",)),
    Problem("distributed_communication_single_node",
            (Report("distributed_communication_single_node", allreduce.render_allreduce, ALLREDUCE_KEY),),
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
            Text(fsdp.equivalence_setup),
            Table(where={"table": "equivalence"}, columns=(
                "compute", "world_size", "backend", "steps", "logits_dtype", "master_dtype", "max_abs_difference",
                "tolerance", "matches")),
            Text(fsdp.equivalence_verdicts)), requires={"table": "equivalence"})),
        Report("fsdp_accounting", Layout((
            Text(fsdp.accounting_setup), _step_table(fsdp.TORCH_FSDP), Text(fsdp.against_torch), Text(fsdp.expected_saving),
            MEMORY_HEADING, sharding.BREAKDOWN_NOTE + "The init peak of FSDP runs includes the whole model, built "
            "before sharding.\n", MEMORY_TABLE, Text(fsdp.zero_differences), Text(fsdp.readiness_section)),
            requires={"table": "step"}))),
            fsdp.answer_fsdp, "fsdp", ("perf/test_fsdp.py",), 2),
    Problem("communication_accounting",
            (Report("communication_accounting", communication_accounting.render_communication_accounting),),
            communication_accounting.answer_communication_accounting, device_independent=True,
            only_in_handout="2025"),
    _parallelism("alternate_ring_all_reduce", parallelism_calcs.answer_alternate_ring_all_reduce),
    _parallelism("data_parallel_calcs", parallelism_calcs.answer_data_parallel_calcs),
    _parallelism("fsdp_calcs", parallelism_calcs.answer_fsdp_calcs),
    _parallelism("tp_calcs", parallelism_calcs.answer_tp_calcs),
    _parallelism("fsdp_tp_calcs", parallelism_calcs.answer_fsdp_tp_calcs),
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
