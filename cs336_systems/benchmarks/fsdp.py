"""Problems fsdp and fsdp_accounting: our FSDP against single-process training (correctness), and
its step time, peak memory and communication against torch FSDP (fully_shard on every Transformer
block and the root) and torch DDP, beside the closed-form memory model; plus a profiled step that
shows whether each all-gather finished before the layer that needs it.

    result = launch(benchmark_fsdp, 2, ShardingBenchmarkConfig(), device="cuda")[0]
    rows, timeline = result["rows"], result["timeline"]

Memory is probed as in cs336_systems.benchmarks.sharding (see there). Communication per step is
counted from what each variant sends: ours from the layers it gathered in the step (each weight
padded to a multiple of the world size; gathered in forward, and again in backward when its
gradient of the input needs it) and the gradients it reduce-scattered; torch FSDP's from its
defaults (every parameter gathered in forward, the blocks' again in backward, the root's kept
after forward; every gradient reduce-scattered); DDP's all-reduce of every gradient.

The readiness table. One more step of our FSDP runs under torch.profiler on rank 0. On a GPU
trace, each all-gather's range spans its NCCL kernel and each layer's compute range spans its
kernels; for every use of a gathered weight the table gives when the all-gather ended and when the
compute stream finished the kernel before the layer's: if the gather ended first, it was hidden
(prefetched in time); otherwise the stream stood idle for the difference. A CPU (gloo) trace has no
kernels: its times are the host's, when work was issued.
"""

from __future__ import annotations

import bisect
import json
import tempfile
from collections import defaultdict
from collections.abc import Callable
from copy import deepcopy
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from cs336_systems.accounting.communication import bytes_sent_per_device
from cs336_systems.accounting.memory import training_memory
from cs336_systems.benchmarks.ddp import step_setup, steps_by_variant
from cs336_systems.benchmarks.harness import LEARNING_RATE, adamw, build_model, lm_loss, random_batch
from cs336_systems.benchmarks.sharding import (
    BREAKDOWN_NOTE,
    ShardingBenchmarkConfig,
    TrainingSetup,
    ddp_adamw,
    communication_rows,
    estimated_peak_bytes,
    gather_rows,
    guarded_training,
    memory_rows,
    memory_table,
    optimizer_state_tensors,
    setup_sentence,
    step_row,
    step_table,
    within,
)
from cs336_systems.distributed.ddp import batch_shard
from cs336_systems.distributed.fsdp import FSDP, MAX_PREFETCH_LAYERS, REDUCE_SCATTERS_IN_FLIGHT
from cs336_systems.distributed.launch import rank_device
from cs336_systems.model import ModelConfig
from cs336_systems.precision import Precision
from cs336_systems.profiling.kernels import device_profile
from cs336_systems.profiling.timeline import COMPUTE, PHASE, Interval, intervals_from_events
from cs336_systems.reports import (
    Rendered,
    Reports,
    Row,
    format_ms,
    markdown_table,
    not_in_report,
    plural,
    select,
)
from cs336_systems.timing import synchronize

STEP_PHASES = ("forward", "backward", "optimizer")
OURS, OURS_NO_PREFETCH, TORCH_FSDP, TORCH_DDP = ("FSDP", "FSDP, no prefetch", "torch FSDP (fully_shard per block)",
                                                 "torch DDP")
RANGE_PREFIX = "fsdp::"
# Host-side and kernel timestamps carry launch jitter of a few microseconds; a gather that ends
# within this of the compute stream becoming free counts as on time.
ON_TIME_SLACK_MS = 0.01
WORST_SHOWN = 10
# What our FSDP should stay within, over torch FSDP.
TARGET_STEP_OVER_TORCH = 0.15
TARGET_PEAK_OVER_TORCH = 0.10


def _fsdp_collectives(model: FSDP) -> dict[str, int]:
    calls = model.scheduler.calls

    def gathered_bytes(weights) -> int:
        return sum(w.padded_numel * w.gather_dtype.itemsize for w in weights)

    replicated = [p for p in model.replicated if p.requires_grad]
    return {
        "all_gather (forward weights)": gathered_bytes(w for w, _ in calls),
        "all_gather (backward weights)": gathered_bytes(w for w, used in calls if used),
        "reduce_scatter (gradients)": sum(w.padded_numel * w.shard.element_size() for w, _ in calls
                                          if w.shard.requires_grad),
        # The replicated gradients and one has-gradient flag each.
        "all_reduce (replicated gradients)": sum(p.numel() * p.element_size() + p.element_size() for p in replicated),
    }


def _ours(prefetch_layers: int) -> Callable[[nn.Module, torch.device], TrainingSetup]:
    def make(model: nn.Module, device: torch.device) -> TrainingSetup:
        fsdp = FSDP(model, prefetch_layers=prefetch_layers)
        optimizer = adamw(fsdp, LEARNING_RATE, "foreach")
        return TrainingSetup(fsdp, optimizer, lambda: optimizer_state_tensors(optimizer.state.values()),
                             after_backward=fsdp.finish_gradient_synchronization,
                             collectives=lambda: _fsdp_collectives(fsdp))

    return make


def _torch_fsdp(model: nn.Module, device: torch.device) -> TrainingSetup:
    from torch.distributed.fsdp import fully_shard

    block_bytes = sum(p.numel() * p.element_size() for block in model.layers for p in block.parameters())
    total_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    optimizer = adamw(model, LEARNING_RATE, "foreach")
    collectives = {"all_gather (forward weights)": total_bytes, "all_gather (backward weights)": block_bytes,
                   "reduce_scatter (gradients)": total_bytes}
    return TrainingSetup(model, optimizer, lambda: optimizer_state_tensors(optimizer.state.values()),
                         collectives=lambda: collectives)


# (label, strategy in the memory model, DDP buckets, builder)
VARIANTS = (
    (TORCH_DDP, "replicated", True, ddp_adamw),
    (TORCH_FSDP, "fsdp", False, _torch_fsdp),
    (OURS, "fsdp", False, _ours(MAX_PREFETCH_LAYERS)),
    (OURS_NO_PREFETCH, "fsdp", False, _ours(0)),
)


def _profiled(rank: int, device: torch.device) -> Callable:
    """Run one step under torch.profiler on rank 0 (the others run it plainly: its collectives need
    every rank) and return the trace's intervals."""

    def run(step) -> list[Interval] | None:
        if rank != 0:
            step()
            synchronize(device)
            return None
        with device_profile(device) as profiler:
            step()
            synchronize(device)
        with tempfile.TemporaryDirectory() as scratch:
            path = Path(scratch) / "trace.json"
            profiler.export_chrome_trace(str(path))
            data = json.loads(path.read_text())
        events = data["traceEvents"] if isinstance(data, dict) else data
        names = {e["name"] for e in events if str(e.get("name", "")).startswith(RANGE_PREFIX)}
        return intervals_from_events(events, names | set(STEP_PHASES))

    return run


def gather_readiness(intervals: list[Interval]) -> list[Row]:
    """For each all-gather in a profiled step: the use of its weight that came next (the layer's
    forward or backward range), when the gather ended, when the compute rows had finished the work
    before that use, and how long compute waited for the gather."""
    phases = sorted((i for i in intervals if i.kind == PHASE and i.name.startswith(RANGE_PREFIX)),
                    key=lambda i: i.start_ms)
    compute_ends = sorted(i.end_ms for i in intervals if i.kind == COMPUTE)
    uses: dict[str, list[Interval]] = defaultdict(list)
    for i in phases:
        kind, layer = i.name.removeprefix(RANGE_PREFIX).split(" ", 1)
        if kind in ("forward", "backward"):
            uses[layer].append(i)
    rows = []
    for gather in (i for i in phases if i.name.startswith(f"{RANGE_PREFIX}all_gather ")):
        layer = gather.name.split(" ", 1)[1]
        use = next((u for u in uses[layer] if u.start_ms >= gather.start_ms), None)
        if use is None:
            continue
        before = bisect.bisect_right(compute_ends, use.start_ms + ON_TIME_SLACK_MS) - 1
        free_ms = compute_ends[before] if before >= 0 else use.start_ms
        waited_ms = max(0.0, min(gather.end_ms, use.start_ms) - free_ms)
        rows.append({"table": "readiness", "layer": layer, "pass": use.name.split(" ")[0].removeprefix(RANGE_PREFIX),
                     "gather_start_ms": gather.start_ms, "gather_end_ms": gather.end_ms,
                     "compute_free_ms": free_ms, "use_start_ms": use.start_ms, "waited_ms": waited_ms,
                     "on_time": waited_ms <= ON_TIME_SLACK_MS})
    return rows


def benchmark_fsdp(rank: int, world_size: int, cfg: ShardingBenchmarkConfig) -> dict | None:
    """Run under launch. Rank 0 returns {"rows": [...], "timeline": intervals of the profiled step}."""
    device = rank_device()
    rows: list[Row] = []
    timeline = None
    for label, strategy, ddp_buckets, make_setup in VARIANTS:
        profile = _profiled(rank, device) if label == OURS else None
        stats = guarded_training(make_setup, cfg, rank, world_size, device,
                                 estimated_peak_bytes(cfg, strategy, world_size, ddp_buckets), profile)
        trace = stats.pop("trace", None)  # the trace stays on rank 0
        per_rank = gather_rows(stats, world_size)
        rows.append(step_row(label, per_rank, cfg, world_size, strategy, ddp_buckets))
        rows += memory_rows(label, per_rank) + communication_rows(label, per_rank, world_size)
        if trace:
            timeline = trace
            rows += [{**r, "variant": label, "backend": dist.get_backend()} for r in gather_readiness(trace)]
    rows += _model_rows(cfg, world_size)
    return {"rows": rows, "timeline": timeline} if rank == 0 else None


def fsdp_problems(rank: int, world_size: int, cfg: ShardingBenchmarkConfig) -> dict | None:
    """Run under launch: both problems from one set of ranks (starting ranks costs seconds). Rank 0
    returns {"rows": equivalence and benchmark rows, "timeline": intervals of the profiled step}."""
    equivalence = fsdp_equivalence(rank, world_size)
    result = benchmark_fsdp(rank, world_size, cfg)
    return {"rows": equivalence + result["rows"], "timeline": result["timeline"]} if rank == 0 else None


def _model_rows(cfg: ShardingBenchmarkConfig, world_size: int) -> list[Row]:
    """The memory model's per-rank breakdown of each strategy, for the report's comparison."""
    config = cfg.model_config()
    cases = [("DDP (torch, gradient buckets)", "replicated", True), ("ZeRO stage 1", "optimizer_state", True),
             ("FSDP", "fsdp", False)]
    return [{"table": "memory_model", "strategy": name, "world_size": world_size,
             **training_memory(config, cfg.batch_size, cfg.context_length, attention=cfg.attention, strategy=strategy,
                               world_size=world_size, ddp_buckets=buckets,
                               fsdp_gathered_weights=MAX_PREFETCH_LAYERS + 1,
                               fsdp_reduce_scatters_in_flight=REDUCE_SCATTERS_IN_FLIGHT + 1).as_row()}
            for name, strategy, buckets in cases]


def timeline_intervals(intervals: list[Interval]) -> list[Interval]:
    """What the timeline figure draws: the step's phases, compute and communication rows (the
    per-layer ranges are hundreds of labels, left to the readiness table)."""
    return [i for i in intervals if i.kind != PHASE or not i.name.startswith(RANGE_PREFIX)]


# ------------------------------------------------------------------------------------ correctness

EQUIVALENCE_SIZE = "tiny"
EQUIVALENCE_CONTEXT = 16
EQUIVALENCE_BATCH_PER_RANK = 2
EQUIVALENCE_STEPS = 3
# fp32 differs from one process only in summation order; bf16 compute rounds every matmul to 8
# significant bits on both sides, in different orders.
EQUIVALENCE_TOLERANCES = {"fp32": 1e-5, "bf16": 5e-3}


def fsdp_equivalence(rank: int, world_size: int) -> list[Row]:
    """FSDP against one process training the tiny LM on the whole batch (SGD), in fp32 and with bf16
    compute (the single process casting its Linear and Embedding weights to bf16 for compute)."""
    from torch.func import functional_call

    device = rank_device()
    config = ModelConfig.for_size(EQUIVALENCE_SIZE, EQUIVALENCE_CONTEXT)
    rows = []
    for precision in EQUIVALENCE_TOLERANCES:
        compute_dtype = Precision.named(precision).autocast_dtype  # None: fp32 computes in the master weights
        reference = build_model(config, device, seed=0)
        model = FSDP(deepcopy(reference), compute_dtype=compute_dtype)
        sharded = {f"{w.name}.weight" for w in model.weights}
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
        for step in range(EQUIVALENCE_STEPS):
            inputs, targets = random_batch(config, EQUIVALENCE_BATCH_PER_RANK * world_size, EQUIVALENCE_CONTEXT, device,
                                           seed=step)
            rows_here = batch_shard(len(inputs), rank, world_size)
            params = {n: p.to(compute_dtype) if compute_dtype and n in sharded else p
                      for n, p in reference.named_parameters()}
            reference_optimizer.zero_grad(set_to_none=True)
            logits = functional_call(reference, params, (inputs,))
            lm_loss(logits, targets).backward()
            reference_optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            logits = model(inputs[rows_here])
            lm_loss(logits, targets[rows_here]).backward()
            model.finish_gradient_synchronization()
            optimizer.step()
        full = model.gather_full_params()
        difference = max((p.detach() - full[n]).abs().max().item() for n, p in reference.named_parameters())
        master_dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()})
        rows.append({"table": "equivalence", "compute": precision, "world_size": world_size,
                     "backend": dist.get_backend(), "model": f"{EQUIVALENCE_SIZE} LM", "steps": EQUIVALENCE_STEPS,
                     "logits_dtype": str(logits.dtype).removeprefix("torch."), "master_dtype": ", ".join(master_dtypes),
                     "max_abs_difference": difference, "tolerance": EQUIVALENCE_TOLERANCES[precision]})
    per_rank = gather_rows(rows, world_size)
    merged = [{**row, "max_abs_difference": max(r[i]["max_abs_difference"] for r in per_rank)}
              for i, row in enumerate(per_rank[0])]
    for row in merged:
        row["matches"] = row["max_abs_difference"] <= row["tolerance"]
    return merged if rank == 0 else []


# ------------------------------------------------------------------------------------------ reports

MEMORY_MODEL_FIELDS = ("parameters", "gradients", "optimizer_state", "activations", "buffers", "peak")


def _against_torch(steps: dict[str, Row]) -> str:
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


def _expected_saving(rows: list[Row], steps: dict[str, Row]) -> str:
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


def _zero_differences(rows: list[Row], steps: dict[str, Row]) -> str:
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


def _readiness_section(rows: list[Row]) -> str:
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


def render_fsdp_accounting(rows: list[Row]) -> Rendered:
    if not any(r.get("table") == "step" for r in rows):
        return Rendered("_no rows_\n")
    steps = steps_by_variant(rows)
    body = [f"{setup_sentence(rows)} {OURS} shards every Linear and Embedding weight, prefetching two layers "
            f"('{OURS_NO_PREFETCH}' does not); torch FSDP wraps every Transformer block and the root (fully_shard)."
            "\n",
            step_table(rows, baseline=TORCH_FSDP), _against_torch(steps), _expected_saving(rows, steps),
            "## Memory at the phase points\n",
            BREAKDOWN_NOTE + "The init peak of FSDP runs includes the whole model, built before sharding.\n",
            memory_table(rows), _zero_differences(rows, steps), _readiness_section(rows)]
    return Rendered("\n".join(part for part in body if part))


def render_fsdp(rows: list[Row]) -> Rendered:
    equivalence = [r for r in rows if r.get("table") == "equivalence"]
    if not equivalence:
        return Rendered("_no rows_\n")
    first = equivalence[0]
    verdicts = [f"- {r['compute']} compute: largest difference {r['max_abs_difference']:.3g}, "
                + ("within" if r["matches"] else "OUTSIDE") + f" the tolerance {r['tolerance']:g}; logits in "
                f"{r['logits_dtype']}, master weights in {r['master_dtype']}." for r in equivalence]
    return Rendered(
        f"Each rank trains the {first['model']} wrapped in FSDP on its slice of a batch ({first['world_size']} ranks, "
        f"{first['backend']}), SGD, {first['steps']} steps; one process trains the same model on the whole batch, "
        "casting its Linear and Embedding weights to the compute dtype for bf16.\n\n"
        + markdown_table(equivalence, ["compute", "world_size", "backend", "steps", "logits_dtype", "master_dtype",
                                       "max_abs_difference", "tolerance", "matches"])
        + "\n" + "\n".join(verdicts) + "\n")


# ---------------------------------------------------------------------------------------------- answers

def answer_fsdp(reports: Reports) -> list[str]:
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
