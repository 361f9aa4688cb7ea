"""The table of the course's problems: for each, the perf module that measures it, its reports (the
rows' name, renderer and cell key) and the function that answers its written questions from those
rows. Everything that writes or reads a report finds it here:

    name -> measure (perf/<module>.py, marker) -> rows -> render (Report.render) -> answer (Problem.answer)

A problem family's measuring code is a benchmark module (the package's benchmarks/<family>.py), which returns
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
    fsdp,
    gradient_checkpointing,
    leaderboard,
    memory_profiling,
    mixed_precision,
    nsys_profile,
    parallelism_calcs,
    sharding,
)
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


PROBLEMS: tuple[Problem, ...] = (
    Problem("benchmarking_script",
            (Report("benchmarking_script", e2e.render_benchmarking_script, E2E_KEY),),
            e2e.answer_benchmarking_script, "e2e", ("perf/test_e2e.py",)),
    Problem("nsys_profile", (Report("nsys_profile", nsys_profile.render_nsys_profile, NSYS_KEY),),
            nsys_profile.answer_nsys_profile, "profile", ("perf/test_profile.py",),
            every_size=False),
    Problem("mixed_precision_accumulation",
            (Report("mixed_precision_accumulation", mixed_precision.render_accumulation),),
            mixed_precision.answer_mixed_precision_accumulation, "e2e", ("perf/test_e2e.py",)),
    Problem("benchmarking_mixed_precision",
            (Report("benchmarking_mixed_precision", e2e.render_benchmarking_mixed_precision, MIXED_PRECISION_KEY),),
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
            (Report("torch_compile", attention.render_torch_compile, TORCH_COMPILE_KEY),),
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
            (Report("naive_ddp", ddp.render_naive_ddp),
             Report("naive_ddp_benchmarking", ddp.render_naive_ddp_benchmarking)),
            ddp.answer_naive_ddp, "ddp", ("perf/test_ddp.py",), 2),
    Problem("minimal_ddp_flat_benchmarking",
            (Report("minimal_ddp_flat_benchmarking", ddp.render_flat_benchmarking),),
            ddp.answer_minimal_ddp_flat_benchmarking, "ddp", ("perf/test_ddp.py",), 2),
    Problem("ddp_overlap_individual_parameters",
            (Report("ddp_overlap_individual_parameters", ddp.render_overlap_individual),
             Report("ddp_overlap_individual_parameters_benchmarking", ddp.render_overlap_individual_benchmarking)),
            ddp.answer_ddp_overlap_individual_parameters, "ddp", ("perf/test_ddp.py",), 2),
    Problem("ddp_overlap_bucketed",
            (Report("ddp_overlap_bucketed", ddp.render_overlap_bucketed),
             Report("ddp_bucketed_benchmarking", ddp.render_bucketed_benchmarking)),
            ddp.answer_ddp_overlap_bucketed, "ddp", ("perf/test_ddp.py",), 2, only_in_handout="2025"),
    Problem("optimizer_state_sharding",
            (Report("optimizer_state_sharding", sharding.render_sharding),
             Report("optimizer_state_sharding_accounting", sharding.render_sharding_accounting)),
            sharding.answer_optimizer_state_sharding, "sharding", ("perf/test_sharding.py",), 2),
    Problem("fsdp", (Report("fsdp", fsdp.render_fsdp), Report("fsdp_accounting", fsdp.render_fsdp_accounting)),
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
    Problem("leaderboard", (Report("leaderboard", leaderboard.render_leaderboard),), leaderboard.answer_leaderboard,
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
