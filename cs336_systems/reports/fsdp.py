"""Problem fsdp's reports: our FSDP against single-process training (correctness), and its accounting
report (step time, peak memory and communication against torch FSDP and torch DDP, beside the memory
model; how it differs from optimizer state sharding and ZeRO stage 1; whether each all-gather finished
before the layer that needs it); with its answer. The package's distributed/equivalence.py checks the
correctness, its benchmarks/fsdp.py measures the rest.
"""

from __future__ import annotations

from cs336_systems.accounting.communication import bytes_sent_per_device
from cs336_systems.reports import Reports, format_ms, markdown_table, not_in_report, plural, select, tolerance_verdict
from cs336_systems.reports.ddp import step_setup, steps_by_variant
from cs336_systems.reports.sharding import setup_sentence, within
from cs336_systems.rows import Row
from cs336_systems.rows.fsdp import OURS, OURS_NO_PREFETCH, TORCH_DDP, TORCH_FSDP

# The longest waits for an all-gather that the readiness table lists.
WORST_SHOWN = 10
# What our FSDP should stay within, over torch FSDP.
TARGET_STEP_OVER_TORCH = 0.15
TARGET_PEAK_OVER_TORCH = 0.10
MEMORY_MODEL_FIELDS = ("parameters", "gradients", "optimizer_state", "activations", "buffers", "peak")


def against_torch(rows: list[Row]) -> str:
    steps = steps_by_variant(rows)
    ours, theirs = steps.get(OURS), steps.get(TORCH_FSDP)
    if not (ours and theirs):
        return ""
    # The ratios themselves are the step table's last columns.
    text = f"Against torch FSDP: step {within(ours['step_ms'] / theirs['step_ms'] - 1, TARGET_STEP_OVER_TORCH)}"
    if ours.get("peak_gib") and theirs.get("peak_gib"):
        text += f", peak {within(ours['peak_gib'] / theirs['peak_gib'] - 1, TARGET_PEAK_OVER_TORCH)}"
    text += "."
    no_prefetch = steps.get(OURS_NO_PREFETCH)
    if no_prefetch:
        saved = no_prefetch["step_ms"] - ours["step_ms"]
        text += (f" Prefetching {'saves' if saved > 0 else 'costs'} {abs(saved):.1f} ms per step "
                 f"({no_prefetch['step_ms']:.1f} ms without it).")
    return text + "\n"


def expected_saving(rows: list[Row]) -> str:
    steps = steps_by_variant(rows)
    models = {r["strategy"]: r for r in rows if r.get("table") == "memory_model"}
    ddp_model, fsdp_model = models.get("DDP (torch, gradient buckets)"), models.get("FSDP")
    if not (ddp_model and fsdp_model):
        return ""
    # The model's fields by name and in its order: rows read back from the CSV carry every column.
    table = [{"per rank (GiB)": name, **{k: r[f"{k}_gib"] for k in MEMORY_MODEL_FIELDS}} for name, r in models.items()]
    text = ["## Expected against measured\n",
            "The closed-form model (cs336_systems.accounting.memory), per rank; FSDP's buffers: three gathered "
            "weights and three fp32 gradients in flight, each the largest weight's size:\n",
            markdown_table(table)]
    expected = ddp_model["peak_gib"] - fsdp_model["peak_gib"]
    sentence = f"Expected saving of FSDP over torch DDP: {expected:.3g} GiB per rank"
    ddp, ours = steps.get(TORCH_DDP), steps.get(OURS)
    if ddp and ours and ddp.get("peak_gib") and ours.get("peak_gib"):
        sentence += f"; measured {ddp['peak_gib'] - ours['peak_gib']:.3g} GiB"
    # Each variant's measured peak and the model's stand side by side in the step table.
    text.append(sentence + ". The model leaves out temporaries, kernel workspaces and allocator rounding.\n")
    return "\n".join(text)


def zero_differences(rows: list[Row]) -> str:
    steps = steps_by_variant(rows)
    communication = [r for r in rows if r.get("table") == "communication" and r["variant"] in (OURS, TORCH_DDP)]
    ddp = next((r for r in communication if r["variant"] == TORCH_DDP), None)
    ours = [r for r in communication if r["variant"] == OURS]
    if not (ddp and ours):
        return ""
    world_size = next(iter(steps.values()))["world_size"]
    gradient_bytes = ddp["payload_bytes"]

    def same_sizes(variant: str, collectives: tuple[tuple[str, str], ...]) -> list[Row]:
        return [{"variant": f"{variant} (same sizes)", "collective": label, "payload_bytes": gradient_bytes,
                 "ring_bytes_sent_per_rank": bytes_sent_per_device(kind, gradient_bytes, world_size)}
                for label, kind in collectives]

    sharded = same_sizes("optimizer-state sharding", (("all_reduce (DDP gradients)", "all_reduce"),
                                                      ("broadcast (updated parameters)", "all_gather")))
    zero = same_sizes("ZeRO stage 1", (("reduce_scatter (gradients)", "reduce_scatter"),
                                       ("all_gather (updated parameters)", "all_gather")))
    table = [{**r, "payload (GB)": r["payload_bytes"] / 1e9, "sent per rank (GB)": r["ring_bytes_sent_per_rank"] / 1e9}
             for r in ours + sharded + zero]
    ours_total, sharded_total, zero_total = (sum(r["ring_bytes_sent_per_rank"] for r in group)
                                             for group in (ours, sharded, zero))
    return ("## How this differs from optimizer-state sharding and ZeRO stage 1\n\n"
            "FSDP all-gathers each weight before each use and reduce-scatters each gradient as backward produces it, "
            "spread over the step where compute can hide it. Bytes per step (optimizer-state sharding's and ZeRO "
            "stage 1's from the same gradient sizes):\n\n"
            + markdown_table(table, ["variant", "collective", "payload (GB)", "sent per rank (GB)"])
            + f"\nEach rank sends {ours_total / 1e9:.3g} GB per step under FSDP, {sharded_total / 1e9:.3g} GB under "
            f"optimizer-state sharding and {zero_total / 1e9:.3g} GB under ZeRO stage 1, as much as DDP alone "
            f"({ddp['ring_bytes_sent_per_rank'] / 1e9:.3g} GB).\n")


def readiness_section(rows: list[Row]) -> str:
    readiness = [r for r in rows if r.get("table") == "readiness"]
    timeline = next((r for r in rows if r.get("table") == "timeline"), None)
    if not readiness:
        return ("## Did each all-gather finish before the layer that needs it?\n\nThe profiled step's trace "
                "held no per-layer ranges (fsdp::...), so there is no table.\n" if timeline else "")
    on_time = sum(r["on_time"] for r in readiness)
    waited = sum(r["waited_ms"] for r in readiness)
    by_pass = {p: [r for r in readiness if r["pass"] == p] for p in ("forward", "backward")}
    summary = "; ".join(f"{p}: {sum(r['on_time'] for r in rs)} of {len(rs)} on time, "
                        f"{sum(r['waited_ms'] for r in rs):.2f} ms waited" for p, rs in by_pass.items() if rs)
    worst = sorted(readiness, key=lambda r: -r["waited_ms"])[:WORST_SHOWN]
    host_only = readiness[0]["backend"] != "nccl"
    text = ["## Did each all-gather finish before the layer that needs it?\n",
            f"One profiled step of {OURS}, rank 0. "
            + ("This is a CPU (gloo) trace: no kernels, so the times are the host's, when work was issued and "
               "waited for; the GPU run answers the question. " if host_only else "")
            + f"{on_time} of {len(readiness)} all-gathers ended before compute finished the work before the layer "
              f"that needs them; compute waited {waited:.2f} ms in all"
            + ("" if on_time == len(readiness) else f" ({summary})")
            + f". The {len(worst)} longest waits (ms from the trace's start):\n",
            markdown_table(worst, ["layer", "pass", "gather_start_ms", "gather_end_ms", "compute_free_ms",
                                   "use_start_ms", "waited_ms", "on_time"])]
    if timeline:
        text.append(f"\n![{OURS} timeline]({timeline['file']})\n")
    return "\n".join(text)


def accounting_setup(rows: list[Row]) -> str:
    return (f"{setup_sentence(rows)} {OURS} shards every Linear and Embedding weight, prefetching two layers "
            f"('{OURS_NO_PREFETCH}' does not); torch FSDP wraps every Transformer block and the root (fully_shard).\n")


def equivalence_setup(rows: list[Row]) -> str:
    first = rows[0]
    return (f"Each rank trains the {first['model']} wrapped in FSDP on its slice of a batch ({first['world_size']} "
            f"ranks, {first['backend']}), SGD, {first['steps']} steps; one process trains the same model on the whole "
            "batch, casting its Linear and Embedding weights to the compute dtype for bf16.\n")


def equivalence_verdicts(rows: list[Row]) -> str:
    return "\n".join(f"- {r['compute']} compute: largest difference {r['max_abs_difference']:.3g}, "
                     f"{tolerance_verdict(r)}; logits in {r['logits_dtype']}, master weights in {r['master_dtype']}."
                     for r in rows) + "\n"


# ---------------------------------------------------------------------------------------------- answers

def answer_fsdp(reports: Reports) -> list[str]:
    sentences = []
    if "fsdp" in reports:
        equivalence = select(reports["fsdp"], table="equivalence")
        if equivalence:
            r0 = equivalence[0]
            verdicts = [f"{r['compute']} compute differs by at most {r['max_abs_difference']:.3g} "
                        f"({tolerance_verdict(r)}), master weights in {r['master_dtype']}" for r in equivalence]
            sentences.append(f"Against single-process training ({r0['world_size']} ranks, {r0['backend']}): "
                             + "; ".join(verdicts) + ".")
        else:
            sentences.append(not_in_report("The comparison with single-process training"))
    if "fsdp_accounting" in reports:
        rows = reports["fsdp_accounting"]
        steps = steps_by_variant(rows)
        shown = [f"{name} {format_ms(steps[name]['step_ms'])}"
                 + (f", peak {steps[name]['peak_gib']:.3g} GiB" if steps[name].get("peak_gib") else "")
                 for name in (OURS, TORCH_FSDP, TORCH_DDP) if name in steps]
        sentences.append(f"{step_setup(next(iter(steps.values())))}: " + "; ".join(shown) + "." if shown else
                         not_in_report("A measured FSDP training step"))
        readiness = select(rows, table="readiness")
        if readiness:
            sentences.append(f"In a profiled step {sum(r['on_time'] for r in readiness)} of "
                             f"{plural(len(readiness), 'all-gather')} finished before the layer that needs them; "
                             "compute waited "
                             f"{format_ms(sum(r['waited_ms'] for r in readiness))} in all.")
    return sentences
