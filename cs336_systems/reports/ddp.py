"""The DDP reports' sentences: naive_ddp, ddp_overlap_individual_parameters and ddp_overlap_bucketed (each
wrapper against single-process training) and their benchmarking reports (time per step by variant, the overhead
model and the optimal bucket size, the targets, the profiled timelines), whose tables are declared in
cs336_systems.reports.problems; with their answers. The package's distributed/equivalence.py checks the wrappers,
its benchmarks/ddp.py measures them. The step helpers here serve the optimizer state sharding and FSDP reports
too, whose step tables have the same shape.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from cs336_systems.accounting.ddp import ddp_overhead_s, optimal_bucket_bytes, optimal_num_buckets, pipelined_overhead_s
from cs336_systems.distributed.ddp import BYTES_PER_MB, assign_buckets
from cs336_systems.gpus import GB
from cs336_systems.model import ModelConfig, TransformerLM
from cs336_systems.reports import (
    Reports,
    find,
    format_ms,
    format_share,
    mean_std,
    not_in_report,
    select,
    tolerance_verdict,
)
from cs336_systems.rows import FAILED, OOM, Row, ok_rows
from cs336_systems.rows.ddp import TORCH_DDP_METHODS, UNDER_TEST_METHODS

# The unit of BucketedDDP's bucket_size_mb (BYTES_PER_MB bytes: mebibytes, as torch DDP's bucket_cap_mb counts), in
# which the reports write bucket sizes; gradient bytes and bandwidths are in the package's decimal units (GB = 10^9
# bytes, cs336_systems.gpus). Each size a report writes names its unit.
BUCKET_UNIT = {2**20: "MiB", 10**6: "MB"}[BYTES_PER_MB]

# What the bucketed wrapper should reach on two GPUs: a step within 5% of torch DDP's, and for the
# overlapped wrappers less than 10% of the step spent on communication left after backward.
TARGET_STEP_OVER_TORCH_DDP = 0.05
TARGET_EXPOSED_SHARE = 0.10


# The implementation under test's wrappers that overlap per parameter, as overlap_individual does: the 2025 and the
# 2026 adapter functions.
UNDER_TEST_INDIVIDUAL = ("get_ddp_individual_parameters", "get_ddp")
# The variants the benchmarking reports' step tables show: the wrappers without buckets, then those with them.
UNBUCKETED_METHODS = ("local", "naive", "flat", "overlap_individual")
BUCKETED_METHODS = ("bucketed", *TORCH_DDP_METHODS, *UNDER_TEST_METHODS)
TIMELINES_HEADING = "## Timelines (one profiled step on rank 0)\n"
TIMELINE_ROWS = ("Rows: the step's phases as the device ran them, compute kernels, and communication (NCCL kernels "
                 "on their own stream, or gloo's work on CPU). They stand in for the handout's Nsight Systems "
                 "screenshots, since Nsight Systems cannot write reports on the machines measured here.\n")


def steps_of(*methods: str) -> Callable[[Row], bool]:
    """Which rows a step table of `methods` shows."""
    return lambda row: row.get("table") == "step" and row["method"] in methods


def equivalence_of(*methods: str) -> Callable[[Row], bool]:
    """Which rows an equivalence report of the wrappers `methods` shows."""
    return lambda row: row.get("table") == "equivalence" and row["method"] in methods


def steps_by_variant(rows: list[Row]) -> dict[str, Row]:
    """Measured steps by variant, in the step tables of DDP, optimizer state sharding and FSDP alike."""
    return {r["variant"]: r for r in ok_rows(select(rows, table="step"))}


def step_setup(step: Row) -> str:
    """The model, batch and ranks a step was measured with, as a sentence opens."""
    return (f"{step['size']}, context {step['context_length']}, batch {step['batch_size']} per rank on "
            f"{step['world_size']} ranks ({step['backend']})")


def missed_text(row: Row) -> str:
    """A step that did not run, as a table shows it: OOM, or the implementation under test's failure with its
    error."""
    return f"{FAILED}: {row.get('error')}" if row["status"] == FAILED else OOM


def step_cell(row: Row) -> str:
    """A DDP step's time as its table shows it: mean ± std over each rank's timed steps, or why it did not run."""
    if row["status"] != "ok":
        return missed_text(row)
    samples = row["steps"] * row["world_size"] if row.get("steps") and row.get("world_size") else None
    return mean_std(row["step_ms"], row["step_std_ms"], samples=samples)


def with_time_over_local(steps: list[Row]) -> list[Row]:
    """The steps, each with its time over local training's (over_local_ms) where both ran."""
    local = steps_by_variant(steps).get("local")
    return [{**r, "over_local_ms": r["step_ms"] - local["step_ms"] if local and r["status"] == "ok" else None}
            for r in steps]


def overlapped_share(row: Row) -> str | None:
    """How much of a step's profiled communication ran beside compute kernels: "96%"."""
    communication = row.get("profiled_communication_ms")
    return f"{row['profiled_overlapped_ms'] / communication:.0%}" if communication else None


def setup(rows: list[Row]) -> str:
    r = next(r for r in rows if r.get("table") == "step")
    return (f"{r['size']} model, context {r['context_length']}, batch {r['batch_size']} per rank on "
            f"{r['world_size']} ranks ({r['backend']}), fp32, AdamW, {r['attention']} attention; {r['warmup']} warm-up "
            f"and {r['steps']} timed steps per variant; ms, means over ranks and steps. gradient_sync: communication "
            "left after backward. Profiled: one extra step under torch.profiler, rank 0. torch DDP (25 MiB buckets) "
            "waits inside backward, so its backward holds its exposed communication.\n")


def timelines(*methods: str) -> Callable[[list[Row]], str]:
    """The profiled timelines of the variants of `methods`, in their step table's order."""
    shown = steps_of(*methods)

    def links(rows: list[Row]) -> str:
        files = {r["variant"]: r["file"] for r in rows if r.get("table") == "timeline"}
        variants = (r["variant"] for r in rows if shown(r))
        return "\n".join(f"### {v}\n\n![{v} timeline]({files[v]})\n" for v in variants if v in files)
    return links


def equivalence_setup(rows: list[Row]) -> str:
    first = rows[0]
    return (f"Each rank trains the {first['model']} on its shard of a batch ({first['world_size']} ranks, "
            f"{first['backend']}); a single process trains the same starting model on the whole batch. Ranks start "
            "from different random models, so matching also shows that the wrapper broadcast rank 0's.\n")


def equivalence_verdicts(rows: list[Row]) -> str:
    return "\n".join(f"- {r['variant']}: after {r['steps']} AdamW steps the largest parameter difference from "
                     f"single-process training is {r['max_abs_difference']:.3g}, {tolerance_verdict(r)}."
                     for r in rows) + "\n"


def naive_cost(rows: list[Row]) -> str:
    steps = steps_by_variant(rows)
    naive, local = steps.get("naive"), steps.get("local")
    if not naive:
        return ""
    text = (f"Naive DDP takes {naive['step_ms']:.1f} ms per step, of which {naive['gradient_sync_ms']:.1f} ms "
            f"({format_share(naive['gradient_sync_ms'] / naive['step_ms'])}) is the {naive['all_reduces_per_step']} "
            "all-reduces after backward, one per parameter tensor.")
    if local:
        text += (f" The same step without any communication takes {local['step_ms']:.1f} ms, so data parallelism "
                 f"costs {naive['step_ms'] - local['step_ms']:.1f} ms per step here.")
    return text + "\n"


def flattening(rows: list[Row]) -> str:
    steps = steps_by_variant(rows)
    n, f = steps.get("naive"), steps.get("flat")
    if not (n and f):
        return ""
    return (f"One all-reduce of the flattened gradients takes {f['gradient_sync_ms']:.1f} ms against "
            f"{n['gradient_sync_ms']:.1f} ms for {n['all_reduces_per_step']} separate ones; steps take "
            f"{f['step_ms']:.1f} against {n['step_ms']:.1f} ms. "
            + ("Flattening wins: it pays the per-call cost once instead of once per parameter, and one large "
               "message runs at the link's best bandwidth; concatenating and copying the gradients back costs "
               "less than that." if f["gradient_sync_ms"] < n["gradient_sync_ms"] else
               "Flattening does not win here: the per-parameter calls were already large enough to run near full "
               "bandwidth, and concatenating the gradients and copying them back costs more than the per-call "
               "overhead it saves.") + "\n")


def overlap_ranking(rows: list[Row]) -> str:
    steps = {m: r for m, r in steps_by_variant(rows).items() if m in UNBUCKETED_METHODS}
    if "overlap_individual" not in steps:
        return ""
    ranked = sorted((r for m, r in steps.items() if m != "local"), key=lambda r: r["step_ms"])
    overlaps = [steps[m] for m in ("naive", "overlap_individual") if m in steps and overlapped_share(steps[m])]
    return ("From fastest to slowest step: " + ", ".join(f"{r['variant']} {r['step_ms']:.1f} ms" for r in ranked)
            + ".\n\n" + "\n".join(
                f"- {r['variant']}: {r['profiled_communication_ms']:.1f} ms of communication in the profiled step, "
                f"{format_share(r['profiled_overlapped_ms'] / r['profiled_communication_ms'])} of it while compute "
                f"kernels ran; {r['gradient_sync_ms']:.1f} ms left after backward." for r in overlaps) + "\n")


def _bucket_trend(bucketed: list[Row]) -> str:
    """What the measured step times do as buckets grow, judged against step-to-step noise."""
    times = [r["step_ms"] for r in sorted(bucketed, key=lambda r: r["bucket_size_mb"])]
    noise_ms = max(r["step_std_ms"] for r in bucketed)
    if max(times) - min(times) <= noise_ms:
        return (f"Measured: the spread, {max(times) - min(times):.1f} ms, is within the step-to-step standard "
                f"deviation ({noise_ms:.1f} ms), so bucket size makes no measurable difference here.")
    best = times.index(min(times))
    if 0 < best < len(times) - 1:
        return "Measured: it falls, then rises, as expected."
    if best == len(times) - 1:
        return "Measured: lowest at the largest buckets, where the calls saved outweigh a later start."
    return ("Measured: it is lowest at the smallest buckets; starting communication early matters more than the "
            "per-call cost.")


def bucket_sizes(rows: list[Row]) -> str:
    steps = steps_by_variant(rows)
    bucketed = [r for r in steps.values() if r["method"] == "bucketed"]
    if not bucketed:
        return ""
    text = ("Expected: small buckets pay the per-call cost many times, large ones start late: time should fall, then "
            "rise. " + _bucket_trend(bucketed))
    naive, local = steps.get("naive"), steps.get("local")
    if naive and naive.get("profiled_communication_ms") and local:
        share = naive["profiled_communication_ms"] / local["backward_ms"]
        text += (f" Naive's communication (profiled) is {naive['profiled_communication_ms']:.1f} ms, {share:.0%} of "
                 "backward: " + ("little to hide, so bucket sizes differ little; a slower link, more ranks or less "
                                 "compute per gradient byte would make them matter." if share < 0.5 else
                                 "a large share, so hiding it matters."))
    return text + "\n"


@functools.cache
def _gradient_sizes_bytes(size: str, table: str, context_length: int) -> tuple[int, ...]:
    """The LM's trainable parameter sizes in registration order, from a model built on the meta
    device (shapes only: no memory, no initialisation)."""
    with torch.device("meta"):
        model = TransformerLM(ModelConfig.for_size(size, context_length, table=table))
    return tuple(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def _bucket_bytes(row: Row) -> list[int]:
    """The sizes of the buckets BucketedDDP built in the run `row` describes, in launch order."""
    sizes = _gradient_sizes_bytes(row["size"], row["size_table"], row["context_length"])
    return [sum(sizes[i] for i in bucket) for bucket in assign_buckets(sizes, row["bucket_size_mb"] * BYTES_PER_MB)]


def _link(probe: Row) -> tuple[float, float]:
    """The all-reduce probe's cost per call (s) and bandwidth (bytes/s): the overhead model's o and w."""
    return probe["per_call_overhead_ms"] * 1e-3, probe["algbw_gbps"] * GB


def _overhead_run(rows: list[Row]) -> tuple[Row, list[Row], Row | None] | None:
    """The all-reduce probe, the bucketed steps that ran (by bucket size) and local's step: what the overhead model
    is set against; None without a probe or a bucketed step."""
    probe = find(rows, table="allreduce_probe")
    steps = steps_by_variant(rows)
    bucketed = sorted((r for r in steps.values() if r["method"] == "bucketed"), key=lambda r: r["bucket_size_mb"])
    return (probe, bucketed, steps.get("local")) if probe and bucketed else None


def overhead_model(rows: list[Row]) -> str:
    if (run := _overhead_run(rows)) is None:
        return ""
    probe, bucketed, _ = run
    per_call_s, bandwidth = _link(probe)
    model_bytes = bucketed[0]["trainable_bytes"]
    best_bytes = optimal_bucket_bytes(model_bytes, bandwidth, per_call_s)
    best_overhead_s = ddp_overhead_s(model_bytes, bandwidth, per_call_s, model_bytes / best_bytes)
    return ("## (b) The overhead model\n\n"
            "s = gradient bytes, w = all-reduce bandwidth, o = cost per call, n_b buckets. If a bucket's gradients "
            "take as long to compute as to send, c = s / (n_b w), bucket i's all-reduce ends at (i + 1) c + i o and "
            "backward at n_b c, leaving\n\n"
            "    overhead(n_b) = s / (n_b w) + n_b o,   minimal at n_b* = sqrt(s / (w o)):   b* = sqrt(s w o)\n\n"
            f"Measured: o = {probe['per_call_overhead_ms']:.3g} ms ({probe['small_bytes']:,}-byte all-reduce), "
            f"w = {probe['algbw_gbps']:.3g} GB/s ({probe['large_bytes'] / 1e9:g} GB, o taken off), "
            f"s = {model_bytes / 1e9:.3g} GB: n_b* = {optimal_num_buckets(model_bytes, bandwidth, per_call_s):.3g}, "
            f"b* = {best_bytes / BYTES_PER_MB:.4g} {BUCKET_UNIT}, overhead {best_overhead_s * 1e3:.3g} ms. The second "
            "column spreads BucketedDDP's buckets over local's measured backward.\n")


def overhead_by_bucket_size(rows: list[Row]) -> list[Row]:
    """The bucketed steps, each with the overhead the course's model predicts (course_model_ms) and the overhead of
    its buckets spread over local's measured backward (pipelined_model_ms, where local ran)."""
    if (run := _overhead_run(rows)) is None:
        return []
    probe, bucketed, local = run
    per_call_s, bandwidth = _link(probe)
    return [{**r, "course_model_ms": ddp_overhead_s(r["trainable_bytes"], bandwidth, per_call_s,
                                                    r["all_reduces_per_step"]) * 1e3,
             "pipelined_model_ms": None if local is None else pipelined_overhead_s(
                 _bucket_bytes(r), local["backward_ms"] * 1e-3, bandwidth, per_call_s) * 1e3} for r in bucketed]


def transfer_against_backward(rows: list[Row]) -> str:
    if (run := _overhead_run(rows)) is None or run[2] is None:
        return ""
    probe, bucketed, local = run
    model_bytes = bucketed[0]["trainable_bytes"]
    transfer_ms = model_bytes / _link(probe)[1] * 1e3
    return (f"Sending all gradients takes {transfer_ms:.3g} ms at w, backward {local['backward_ms']:.3g} ms"
            + (": unlike the course's model, each bucket is sent long before the next is ready, leaving the last "
               "bucket." if local["backward_ms"] > 2 * transfer_ms else ": comparable, as the course's model assumes.")
            + " Measured gradient_sync also holds the write-back: dividing the buckets into .grad "
            f"reads and writes {2 * model_bytes / 1e9:.3g} GB.\n")


def targets(rows: list[Row]) -> list[Row]:
    """The targets, each against what was measured: a row per target (target, measured, met)."""
    measured = [r for r in steps_by_variant(rows).values() if r["method"] in ("overlap_individual", "bucketed",
                                                                               *TORCH_DDP_METHODS)]
    bucketed = [r for r in measured if r["method"] == "bucketed"]
    best = min(bucketed, key=lambda r: r["step_ms"]) if bucketed else None
    against_torch = [(theirs, best["step_ms"] / theirs["step_ms"] - 1) for theirs in measured
                     if best and theirs["method"] in TORCH_DDP_METHODS]
    exposed = [(r, r["gradient_sync_ms"] / r["step_ms"]) for r in measured if r["method"] not in TORCH_DDP_METHODS]
    return [{"target": f"bucketed step within {TARGET_STEP_OVER_TORCH_DDP:.0%} of {theirs['variant']}",
             "measured": f"{best['variant']} {best['step_ms']:.1f} ms against {theirs['step_ms']:.1f} ms ({over:+.1%})",
             "met": "yes" if over <= TARGET_STEP_OVER_TORCH_DDP else "NO"} for theirs, over in against_torch] + [
            {"target": f"{r['variant']}: communication left after backward under {TARGET_EXPOSED_SHARE:.0%} of the "
                       "step",
             "measured": f"{r['gradient_sync_ms']:.2f} of {r['step_ms']:.1f} ms ({share:.1%})",
             "met": "yes" if share < TARGET_EXPOSED_SHARE else "NO"} for r, share in exposed]


def targets_heading(rows: list[Row]) -> str:
    return "## Targets\n" if targets(rows) else ""


# ---------------------------------------------------------------------------------------------- answers

def _equivalence_answer(reports: Reports, name: str, *methods: str) -> list[str]:
    """The sentence on the report `name`'s comparison with single-process training; none without the report."""
    if name not in reports:
        return []
    mine = [r for r in reports[name] if equivalence_of(*methods)(r)]
    if not mine:
        return [not_in_report("The comparison with single-process training")]
    r0 = mine[0]
    return [f"Against single-process training ({r0['world_size']} ranks, {r0['backend']}, {r0['steps']} steps): "
            + "; ".join(f"{r['variant']} differs by at most {r['max_abs_difference']:.3g} "
                        f"({tolerance_verdict(r)})" for r in mine)
            + "."]


def answer_naive_ddp(reports: Reports) -> list[str]:
    sentences = _equivalence_answer(reports, "naive_ddp", "naive", "flat")
    if "naive_ddp_benchmarking" not in reports:
        return sentences
    steps = steps_by_variant(reports["naive_ddp_benchmarking"])
    naive, local = steps.get("naive"), steps.get("local")
    if not naive:
        return sentences + [not_in_report("A measured naive DDP step")]
    return sentences + [
        f"{step_setup(naive)}: a naive DDP step takes {format_ms(naive['step_ms'])}, of which "
        f"{format_ms(naive['gradient_sync_ms'])} ({format_share(naive['gradient_sync_ms'] / naive['step_ms'])}) is "
        f"its {naive['all_reduces_per_step']} per-parameter all-reduces after backward"
        + (f"; without communication the step takes {format_ms(local['step_ms'])}." if local else ".")]


def answer_minimal_ddp_flat_benchmarking(reports: Reports) -> list[str]:
    steps = steps_by_variant(reports["minimal_ddp_flat_benchmarking"])
    naive, flat = steps.get("naive"), steps.get("flat")
    if not (naive and flat):
        return [not_in_report("A measured step of both naive and flat DDP")]
    return [f"{step_setup(flat)}: one all-reduce of the flattened gradients leaves "
            f"{format_ms(flat['gradient_sync_ms'])} after backward against {format_ms(naive['gradient_sync_ms'])} for "
            f"{naive['all_reduces_per_step']} separate ones; steps take {format_ms(flat['step_ms'])} against "
            f"{format_ms(naive['step_ms'])}."]


def answer_ddp_overlap_individual_parameters(reports: Reports) -> list[str]:
    sentences = _equivalence_answer(reports, "ddp_overlap_individual_parameters", "overlap_individual")
    if "ddp_overlap_individual_parameters_benchmarking" not in reports:
        return sentences
    steps = steps_by_variant(reports["ddp_overlap_individual_parameters_benchmarking"])
    overlap = steps.get("overlap_individual")
    if not overlap:
        return sentences + [not_in_report("A measured step of the overlapping DDP")]
    others = [f"{name} {format_ms(steps[name]['step_ms'])}" for name in ("naive", "flat") if name in steps]
    text = (f"{step_setup(overlap)}: overlapping per-parameter all-reduces with backward gives "
            f"{format_ms(overlap['step_ms'])} per step" + (f" (against {', '.join(others)})" if others else "")
            + f", with {format_ms(overlap['gradient_sync_ms'])} left after backward")
    if communication := overlap.get("profiled_communication_ms"):
        text += (f"; {format_share(overlap['profiled_overlapped_ms'] / communication)} of its "
                 f"{format_ms(communication)} of communication ran beside compute")
    return sentences + [text + "."]


def answer_ddp_overlap_bucketed(reports: Reports) -> list[str]:
    sentences = _equivalence_answer(reports, "ddp_overlap_bucketed", "bucketed")
    if "ddp_bucketed_benchmarking" not in reports:
        return sentences
    rows = reports["ddp_bucketed_benchmarking"]
    steps = steps_by_variant(rows)
    bucketed = [r for r in steps.values() if r["method"] == "bucketed"]
    if not bucketed:
        return sentences + [not_in_report("A measured step of bucketed DDP")]
    best, worst = min(bucketed, key=lambda r: r["step_ms"]), max(bucketed, key=lambda r: r["step_ms"])
    torch_ddp = steps.get("torch_ddp")
    sentences.append(f"{step_setup(best)}: the fastest bucket size is {best['bucket_size_mb']:g} {BUCKET_UNIT} "
                     f"({format_ms(best['step_ms'])} per step, {format_ms(best['gradient_sync_ms'])} after "
                     f"backward), the slowest {worst['bucket_size_mb']:g} {BUCKET_UNIT} ({format_ms(worst['step_ms'])})"
                     + (f"; torch DDP takes {format_ms(torch_ddp['step_ms'])}." if torch_ddp else "."))
    probe = find(rows, table="allreduce_probe")
    if not probe:
        return sentences + [not_in_report("The all-reduce probe that gives the overhead model its o and w")]
    model_bytes = best["trainable_bytes"]
    per_call_s, bandwidth = _link(probe)
    bucket_bytes = optimal_bucket_bytes(model_bytes, bandwidth, per_call_s)
    return sentences + [f"With the measured per-call cost o = {format_ms(probe['per_call_overhead_ms'])} and "
                        f"bandwidth w = {probe['algbw_gbps']:.3g} GB/s, the overhead model s / (n_b w) + n_b o puts "
                        f"the optimal bucket at sqrt(s w o) = {bucket_bytes / BYTES_PER_MB:.4g} {BUCKET_UNIT} for s = "
                        f"{model_bytes / GB:.3g} GB of gradients."]
