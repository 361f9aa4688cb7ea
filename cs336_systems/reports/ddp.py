"""The DDP reports: naive_ddp, ddp_overlap_individual_parameters and ddp_overlap_bucketed (each wrapper
against single-process training) and their benchmarking reports (time per step by variant, the overhead
model and the optimal bucket size, the targets, the profiled timelines); with their answers.
The package's benchmarks/ddp.py measures them. The step helpers here serve the optimizer state sharding and
FSDP reports too, whose step tables have the same shape.
"""

from __future__ import annotations

import functools

import torch

from cs336_systems.accounting.ddp import ddp_overhead_s, optimal_bucket_bytes, optimal_num_buckets, pipelined_overhead_s
from cs336_systems.distributed.ddp import BYTES_PER_MB, assign_buckets
from cs336_systems.gpus import GB
from cs336_systems.model import ModelConfig, TransformerLM
from cs336_systems.reports import (
    Rendered,
    Reports,
    find,
    format_ms,
    format_share,
    markdown_table,
    mean_std,
    not_in_report,
    select,
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


def _steps(rows: list[Row], *methods: str) -> list[Row]:
    return [r for r in rows if r.get("table") == "step" and r["method"] in methods]


def _setup(rows: list[Row]) -> str:
    r = next(r for r in rows if r.get("table") == "step")
    return (f"{r['size']} model, context {r['context_length']}, batch {r['batch_size']} per rank on "
            f"{r['world_size']} ranks ({r['backend']}), fp32, AdamW, {r['attention']} attention; {r['warmup']} warm-up "
            f"and {r['steps']} timed steps per variant; ms, means over ranks and steps. gradient_sync: communication "
            "left after backward. Profiled: one extra step under torch.profiler, rank 0. torch DDP (25 MiB buckets) "
            "waits inside backward, so its backward holds its exposed communication.\n")


def _local_step_ms(rows: list[Row]) -> float | None:
    local = ok_rows(_steps(rows, "local"))
    return local[0]["step_ms"] if local else None


def _pooled_steps(row: Row) -> int | None:
    """How many step times a step row's mean and std pool: each rank's timed steps (None for rows without them)."""
    return row["steps"] * row["world_size"] if row.get("steps") and row.get("world_size") else None


def _step_table(rows: list[Row], methods: tuple[str, ...]) -> str:
    local_ms = _local_step_ms(rows)
    table = []
    for r in _steps(rows, *methods):
        if r["status"] != "ok":
            table.append({"variant": r["variant"], "step": missed_text(r)})
            continue
        communication = r.get("profiled_communication_ms")
        table.append({
            "variant": r["variant"], "all-reduces": r.get("all_reduces_per_step"),
            "step": mean_std(r["step_ms"], r["step_std_ms"], samples=_pooled_steps(r)),
            "forward": r["forward_ms"], "backward": r["backward_ms"], "gradient_sync": r["gradient_sync_ms"],
            "optimizer": r["optimizer_ms"],
            "over local": None if local_ms is None else r["step_ms"] - local_ms,
            "communication (profiled)": communication,
            "overlapped with compute": f"{r['profiled_overlapped_ms'] / communication:.0%}" if communication else None,
            "peak GiB": r.get("peak_memory_gib"),
        })
    return markdown_table(table)


def missed_text(row: Row) -> str:
    """A step that did not run, as a table shows it: OOM, or the implementation under test's failure with its
    error."""
    return f"{FAILED}: {row.get('error')}" if row["status"] == FAILED else OOM


def _variants_of(rows: list[Row], *methods: str) -> tuple[str, ...]:
    """The variants of `methods` among the step rows, in their order."""
    return tuple(r["variant"] for r in _steps(rows, *methods))


def _timeline_links(rows: list[Row], variants: tuple[str, ...]) -> str:
    links = {r["variant"]: r["file"] for r in rows if r.get("table") == "timeline"}
    return "".join(f"\n### {variant}\n\n![{variant} timeline]({links[variant]})\n"
                   for variant in variants if variant in links)


def _equivalence_report(rows: list[Row], methods: tuple[str, ...]) -> Rendered:
    mine = [r for r in rows if r.get("table") == "equivalence" and r["method"] in methods]
    if not mine:
        return Rendered("_no rows_\n")
    verdicts = [f"- {r['variant']}: after {r['steps']} AdamW steps the largest parameter difference from "
                f"single-process training is {r['max_abs_difference']:.3g}, "
                + ("within" if r["matches"] else "OUTSIDE") + f" the tolerance {r['tolerance']:g}." for r in mine]
    first = mine[0]
    return Rendered(
        f"Each rank trains the {first['model']} on its shard of a batch ({first['world_size']} ranks, "
        f"{first['backend']}); a single process trains the same starting model on the whole batch. Ranks start from "
        "different random models, so matching also shows that the wrapper broadcast rank 0's.\n\n"
        + markdown_table(mine, ["variant", "world_size", "backend", "steps", "max_abs_difference", "tolerance",
                                "matches"])
        + "\n" + "\n".join(verdicts) + "\n")


def render_naive_ddp(rows: list[Row]) -> Rendered:
    return _equivalence_report(rows, ("naive", "flat"))


def render_overlap_individual(rows: list[Row]) -> Rendered:
    return _equivalence_report(rows, ("overlap_individual",))


def render_overlap_bucketed(rows: list[Row]) -> Rendered:
    return _equivalence_report(rows, ("bucketed",))


def render_naive_ddp_benchmarking(rows: list[Row]) -> Rendered:
    parts = [_setup(rows), _step_table(rows, ("local", "naive"))]
    naive = ok_rows(_steps(rows, "naive"))
    if naive:
        r = naive[0]
        text = (f"Naive DDP takes {r['step_ms']:.1f} ms per step, of which {r['gradient_sync_ms']:.1f} ms "
                f"({format_share(r['gradient_sync_ms'] / r['step_ms'])}) is the {r['all_reduces_per_step']} "
                "all-reduces after backward, one per parameter tensor.")
        local_ms = _local_step_ms(rows)
        if local_ms is not None:
            text += (f" The same step without any communication takes {local_ms:.1f} ms, so data parallelism costs "
                     f"{r['step_ms'] - local_ms:.1f} ms per step here.")
        parts.append(text + "\n")
    parts.append("## Timelines (one profiled step on rank 0)\n" + _timeline_links(rows, ("local", "naive")))
    return Rendered("\n".join(parts))


def render_flat_benchmarking(rows: list[Row]) -> Rendered:
    parts = [_setup(rows), _step_table(rows, ("local", "naive", "flat"))]
    naive, flat = ok_rows(_steps(rows, "naive")), ok_rows(_steps(rows, "flat"))
    if naive and flat:
        n, f = naive[0], flat[0]
        faster = f["gradient_sync_ms"] < n["gradient_sync_ms"]
        parts.append(
            f"One all-reduce of the flattened gradients takes {f['gradient_sync_ms']:.1f} ms against "
            f"{n['gradient_sync_ms']:.1f} ms for {n['all_reduces_per_step']} separate ones; steps take "
            f"{f['step_ms']:.1f} against {n['step_ms']:.1f} ms. "
            + ("Flattening wins: it pays the per-call cost once instead of once per parameter, and one large "
               "message runs at the link's best bandwidth; concatenating and copying the gradients back costs "
               "less than that." if faster else
               "Flattening does not win here: the per-parameter calls were already large enough to run near full "
               "bandwidth, and concatenating the gradients and copying them back costs more than the per-call "
               "overhead it saves.") + "\n")
    parts.append("## Timeline (one profiled step on rank 0)\n" + _timeline_links(rows, ("flat",)))
    return Rendered("\n".join(parts))


def _overlap_sentence(r: Row) -> str:
    communication = r.get("profiled_communication_ms")
    if not communication:
        return ""
    return (f"{r['variant']}: {communication:.1f} ms of communication in the profiled step, "
            f"{format_share(r['profiled_overlapped_ms'] / communication)} of it while compute kernels ran; "
            f"{r['gradient_sync_ms']:.1f} ms left after backward.")


# The implementation under test's wrappers that overlap per parameter, as overlap_individual does: the 2025 and the
# 2026 adapter functions.
UNDER_TEST_INDIVIDUAL = ("get_ddp_individual_parameters", "get_ddp")


def render_overlap_individual_benchmarking(rows: list[Row]) -> Rendered:
    methods = ("local", "naive", "flat", "overlap_individual")
    parts = [_setup(rows), _step_table(rows, (*methods, *UNDER_TEST_INDIVIDUAL))]
    measured = {r["method"]: r for r in ok_rows(_steps(rows, *methods))}
    if "overlap_individual" in measured:
        ranked = sorted((r for m, r in measured.items() if m != "local"), key=lambda r: r["step_ms"])
        parts.append("From fastest to slowest step: "
                     + ", ".join(f"{r['variant']} {r['step_ms']:.1f} ms" for r in ranked) + ".\n")
        parts.append("\n".join(f"- {_overlap_sentence(measured[m])}" for m in ("naive", "overlap_individual")
                               if m in measured and _overlap_sentence(measured[m])) + "\n")
    parts.append("## Timelines (one profiled step on rank 0)\n\nRows: the step's phases as the device ran them, "
                 "compute kernels, and communication (NCCL kernels on their own stream, or gloo's work on CPU). "
                 "They stand in for the handout's Nsight Systems screenshots, since Nsight Systems cannot write "
                 "reports on the machines measured here.\n"
                 + _timeline_links(rows, ("naive", "overlap_individual",
                                          *_variants_of(rows, *UNDER_TEST_INDIVIDUAL))))
    return Rendered("\n".join(parts))


def _bucket_trend(bucketed: list[Row]) -> str:
    """What the measured step times do as buckets grow, judged against step-to-step noise."""
    by_size = sorted(bucketed, key=lambda r: r["bucket_size_mb"])
    times = [r["step_ms"] for r in by_size]
    noise_ms = max(r["step_std_ms"] for r in by_size)
    if max(times) - min(times) <= noise_ms:
        return (f"Measured: the spread, {max(times) - min(times):.1f} ms, is within the step-to-step standard "
                f"deviation ({noise_ms:.1f} ms), so bucket size makes no measurable difference here.")
    best = times.index(min(times))
    if 0 < best < len(times) - 1:
        return "Measured: it falls, then rises, as expected."
    if best == len(times) - 1:
        return "Measured: lowest at the largest buckets, where the calls saved outweigh a later start."
    return "Measured: it is lowest at the smallest buckets; starting communication early matters more than the per-call cost."


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


def _model_section(rows: list[Row]) -> str:
    probe = next((r for r in rows if r.get("table") == "allreduce_probe"), None)
    bucketed = ok_rows(_steps(rows, "bucketed"))
    local = ok_rows(_steps(rows, "local"))
    if probe is None or not bucketed:
        return ""
    per_call_s, bandwidth = probe["per_call_overhead_ms"] * 1e-3, probe["algbw_gbps"] * 1e9
    model_bytes = bucketed[0]["trainable_bytes"]
    best_bytes = optimal_bucket_bytes(model_bytes, bandwidth, per_call_s)
    best_overhead_s = ddp_overhead_s(model_bytes, bandwidth, per_call_s, model_bytes / best_bytes)
    table = []
    for r in sorted(bucketed, key=lambda r: r["bucket_size_mb"]):
        buckets = r["all_reduces_per_step"]
        entry = {f"bucket {BUCKET_UNIT}": r["bucket_size_mb"], "buckets": buckets,
                 "course model (ms)": ddp_overhead_s(model_bytes, bandwidth, per_call_s, buckets) * 1e3}
        if local:
            entry["with measured backward (ms)"] = pipelined_overhead_s(
                _bucket_bytes(r), local[0]["backward_ms"] * 1e-3, bandwidth, per_call_s) * 1e3
        entry["measured gradient_sync (ms)"] = r["gradient_sync_ms"]
        table.append(entry)
    text = [
        "## (b) The overhead model\n",
        "s = gradient bytes, w = all-reduce bandwidth, o = cost per call, n_b buckets. If a bucket's gradients "
        "take as long to compute as to send, c = s / (n_b w), bucket i's all-reduce ends at (i + 1) c + i o and "
        "backward at n_b c, leaving\n",
        "    overhead(n_b) = s / (n_b w) + n_b o,   minimal at n_b* = sqrt(s / (w o)):   b* = sqrt(s w o)\n",
        f"Measured: o = {probe['per_call_overhead_ms']:.3g} ms ({probe['small_bytes']:,}-byte all-reduce), "
        f"w = {probe['algbw_gbps']:.3g} GB/s ({probe['large_bytes'] / 1e9:g} GB, o taken off), "
        f"s = {model_bytes / 1e9:.3g} GB: n_b* = {optimal_num_buckets(model_bytes, bandwidth, per_call_s):.3g}, "
        f"b* = {best_bytes / BYTES_PER_MB:.4g} {BUCKET_UNIT}, overhead {best_overhead_s * 1e3:.3g} ms. The second "
        "column spreads BucketedDDP's buckets over local's measured backward.\n",
        markdown_table(table),
    ]
    if local:
        transfer_ms = model_bytes / bandwidth * 1e3
        backward_ms = local[0]["backward_ms"]
        text.append(
            f"Sending all gradients takes {transfer_ms:.3g} ms at w, backward {backward_ms:.3g} ms"
            + (": unlike the course's model, each bucket is sent long before the next is ready, leaving the last "
               "bucket." if backward_ms > 2 * transfer_ms else ": comparable, as the course's model assumes.")
            + " Measured gradient_sync also holds the write-back: dividing the buckets into .grad "
            f"reads and writes {2 * model_bytes / 1e9:.3g} GB.\n")
    return "\n".join(text)


def _targets(rows: list[Row]) -> str:
    """The targets, each against what was measured."""
    measured = ok_rows(_steps(rows, "overlap_individual", "bucketed", *TORCH_DDP_METHODS))
    bucketed = [r for r in measured if r["method"] == "bucketed"]
    table = []
    if bucketed:
        best = min(bucketed, key=lambda r: r["step_ms"])
        for theirs in (r for r in measured if r["method"] in TORCH_DDP_METHODS):
            over = best["step_ms"] / theirs["step_ms"] - 1
            table.append({"target": f"bucketed step within {TARGET_STEP_OVER_TORCH_DDP:.0%} of {theirs['variant']}",
                          "measured": f"{best['variant']} {best['step_ms']:.1f} ms against {theirs['step_ms']:.1f} ms "
                                      f"({over:+.1%})",
                          "met": "yes" if over <= TARGET_STEP_OVER_TORCH_DDP else "NO"})
    for r in (r for r in measured if r["method"] in ("overlap_individual", "bucketed")):
        share = r["gradient_sync_ms"] / r["step_ms"]
        table.append({"target": f"{r['variant']}: communication left after backward under "
                                f"{TARGET_EXPOSED_SHARE:.0%} of the step",
                      "measured": f"{r['gradient_sync_ms']:.2f} of {r['step_ms']:.1f} ms ({share:.1%})",
                      "met": "yes" if share < TARGET_EXPOSED_SHARE else "NO"})
    return "## Targets\n\n" + markdown_table(table) if table else ""


def render_bucketed_benchmarking(rows: list[Row]) -> Rendered:
    methods = ("local", "naive", "flat", "overlap_individual", "bucketed", *TORCH_DDP_METHODS)
    parts = [_setup(rows), "## (a) Time per step by bucket size\n",
             _step_table(rows, (*methods, *UNDER_TEST_METHODS)), _targets(rows)]
    measured = ok_rows(_steps(rows, *methods))
    bucketed = [r for r in measured if r["method"] == "bucketed"]
    others = {r["method"]: r for r in measured if r["method"] != "bucketed"}
    if bucketed:
        text = ["Expected: small buckets pay the per-call cost many times, large ones start late: time should "
                "fall, then rise. " + _bucket_trend(bucketed)]
        naive = others.get("naive")
        if naive and naive.get("profiled_communication_ms") and "local" in others:
            share = naive["profiled_communication_ms"] / others["local"]["backward_ms"]
            text.append(
                f"Naive's communication (profiled) is {naive['profiled_communication_ms']:.1f} ms, {share:.0%} of "
                "backward: " + ("little to hide, so bucket sizes differ little; a slower link, more ranks or less "
                                "compute per gradient byte would make them matter." if share < 0.5 else
                                "a large share, so hiding it matters."))
        parts.append(" ".join(text) + "\n")
    parts.append(_model_section(rows))
    parts.append("## Timelines (one profiled step on rank 0)\n"
                 + _timeline_links(rows, _variants_of(rows, "bucketed", *TORCH_DDP_METHODS, *UNDER_TEST_METHODS)))
    return Rendered("\n".join(parts))


# ---------------------------------------------------------------------------------------------- answers

def fastest_and_slowest_buckets(rows: list[Row]) -> tuple[Row, Row] | None:
    """The measured steps of the bucket sizes that were fastest and slowest, as the index quotes them; None
    where no bucketed step ran."""
    bucketed = [r for r in steps_by_variant(rows).values() if r["method"] == "bucketed"]
    if not bucketed:
        return None
    return min(bucketed, key=lambda r: r["step_ms"]), max(bucketed, key=lambda r: r["step_ms"])


def steps_by_variant(rows: list[Row]) -> dict[str, Row]:
    """Measured steps by variant, in the step tables of DDP, optimizer state sharding and FSDP alike."""
    return {r["variant"]: r for r in ok_rows(select(rows, table="step"))}


def step_setup(step: Row) -> str:
    """The model, batch and ranks a step was measured with, as a sentence opens."""
    return (f"{step['size']}, context {step['context_length']}, batch {step['batch_size']} per rank on "
            f"{step['world_size']} ranks ({step['backend']})")


def _equivalence_answer(rows: list[Row], methods: tuple[str, ...]) -> str:
    mine = [r for r in select(rows, table="equivalence") if r.get("method") in methods]
    if not mine:
        return not_in_report("The comparison with single-process training")
    r0 = mine[0]
    return (f"Against single-process training ({r0['world_size']} ranks, {r0['backend']}, {r0['steps']} steps): "
            + "; ".join(f"{r['variant']} differs by at most {r['max_abs_difference']:.3g} "
                        f"({'within' if r['matches'] else 'OUTSIDE'} the tolerance {r['tolerance']:g})" for r in mine)
            + ".")


def answer_naive_ddp(reports: Reports) -> list[str]:
    sentences = []
    if "naive_ddp" in reports:
        sentences.append(_equivalence_answer(reports["naive_ddp"], ("naive", "flat")))
    if "naive_ddp_benchmarking" in reports:
        steps = steps_by_variant(reports["naive_ddp_benchmarking"])
        naive, local = steps.get("naive"), steps.get("local")
        if naive:
            sentences.append(
                f"{step_setup(naive)}: a naive DDP step takes {format_ms(naive['step_ms'])}, of which "
                f"{format_ms(naive['gradient_sync_ms'])} "
                f"({format_share(naive['gradient_sync_ms'] / naive['step_ms'])}) is its "
                f"{naive['all_reduces_per_step']} per-parameter all-reduces after backward"
                + (f"; without communication the step takes {format_ms(local['step_ms'])}." if local else "."))
        else:
            sentences.append(not_in_report("A measured naive DDP step"))
    return sentences


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
    sentences = []
    if "ddp_overlap_individual_parameters" in reports:
        sentences.append(_equivalence_answer(reports["ddp_overlap_individual_parameters"], ("overlap_individual",)))
    if "ddp_overlap_individual_parameters_benchmarking" in reports:
        steps = steps_by_variant(reports["ddp_overlap_individual_parameters_benchmarking"])
        overlap = steps.get("overlap_individual")
        if overlap:
            others = [f"{name} {format_ms(steps[name]['step_ms'])}" for name in ("naive", "flat") if name in steps]
            text = (f"{step_setup(overlap)}: overlapping per-parameter all-reduces with backward gives "
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


def answer_ddp_overlap_bucketed(reports: Reports) -> list[str]:
    sentences = []
    if "ddp_overlap_bucketed" in reports:
        sentences.append(_equivalence_answer(reports["ddp_overlap_bucketed"], ("bucketed",)))
    if "ddp_bucketed_benchmarking" not in reports:
        return sentences
    rows = reports["ddp_bucketed_benchmarking"]
    extremes = fastest_and_slowest_buckets(rows)
    if extremes is None:
        return sentences + [not_in_report("A measured step of bucketed DDP")]
    best, worst = extremes
    torch_ddp = steps_by_variant(rows).get("torch_ddp")
    sentences.append(f"{step_setup(best)}: the fastest bucket size is {best['bucket_size_mb']:g} {BUCKET_UNIT} "
                     f"({format_ms(best['step_ms'])} per step, {format_ms(best['gradient_sync_ms'])} after "
                     f"backward), the slowest {worst['bucket_size_mb']:g} {BUCKET_UNIT} ({format_ms(worst['step_ms'])})"
                     + (f"; torch DDP takes {format_ms(torch_ddp['step_ms'])}." if torch_ddp else "."))
    probe = find(rows, table="allreduce_probe")
    if probe:
        model_bytes = best["trainable_bytes"]
        bucket_bytes = optimal_bucket_bytes(model_bytes, probe["algbw_gbps"] * GB, probe["per_call_overhead_ms"] * 1e-3)
        sentences.append(f"With the measured per-call cost o = {format_ms(probe['per_call_overhead_ms'])} and "
                         f"bandwidth w = {probe['algbw_gbps']:.3g} GB/s, the overhead model s / (n_b w) + n_b o puts "
                         f"the optimal bucket at sqrt(s w o) = {bucket_bytes / BYTES_PER_MB:.4g} {BUCKET_UNIT} for s = "
                         f"{model_bytes / GB:.3g} GB of gradients.")
    else:
        sentences.append(not_in_report("The all-reduce probe that gives the overhead model its o and w"))
    return sentences
