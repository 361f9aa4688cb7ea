"""Problems fsdp and fsdp_accounting: our FSDP against single-process training (correctness:
cs336_systems.distributed.equivalence), and its step time, peak memory and communication against
torch FSDP (fully_shard on every Transformer block and the root) and torch DDP, beside the
closed-form memory model; plus a profiled step that shows whether each all-gather finished before
the layer that needs it (cs336_systems.reports.fsdp renders them).

    result = launch(benchmark_fsdp, 2, ShardingBenchmarkConfig(), device="cuda")[0]
    rows, timeline = result["rows"], result["timeline"]

Where `benchmark_fsdp` is given an adapters module other than this project's own (--adapters), the
implementation under test's FSDP (its get_fsdp and fsdp_on_after_backward, fp32 as the others) is measured after
them; its rows carry the columns that name it, a run where it raises on every rank is recorded as failed, and
its communication is its own, not counted.

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
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn

from cs336_systems.accounting.memory import training_memory
from cs336_systems.benchmarks.harness import UnderTest, adapters_in_rank, foreach_adamw
from cs336_systems.benchmarks.sharding import (
    DDP_ADAMW,
    ShardingBenchmarkConfig,
    Variant,
    communication_rows,
    guarded_training,
    memory_rows,
    step_row,
)
from cs336_systems.distributed.equivalence import fsdp_equivalence, gathered
from cs336_systems.distributed.fsdp import FSDP, MAX_PREFETCH_LAYERS, REDUCE_SCATTERS_IN_FLIGHT
from cs336_systems.distributed.launch import rank_device
from cs336_systems.distributed.training import PHASES, Trainer, Wrap, Wrapped, synchronised_fsdp
from cs336_systems.profiling.timeline import COMPUTE, PHASE, Interval, intervals_from_events
from cs336_systems.provenance import implementation_columns
from cs336_systems.rows import Row
from cs336_systems.rows.fsdp import OURS, OURS_NO_PREFETCH, TORCH_DDP, TORCH_FSDP
RANGE_PREFIX = "fsdp::"
# Host-side and kernel timestamps carry launch jitter of a few microseconds; a gather that ends
# within this of the compute stream becoming free counts as on time.
ON_TIME_SLACK_MS = 0.01


def _fsdp_collectives(model: FSDP) -> dict[str, int]:
    calls = model.scheduler.calls

    def gathered_bytes(weights) -> int:
        return sum(w.padded_numel * w.gather_dtype.itemsize for w in weights)

    replicated = [p for p in model.replicated.values() if p.requires_grad]
    return {
        "all_gather (forward weights)": gathered_bytes(w for w, _ in calls),
        "all_gather (backward weights)": gathered_bytes(w for w, used in calls if used),
        "reduce_scatter (gradients)": sum(w.padded_numel * w.shard.element_size() for w, _ in calls
                                          if w.shard.requires_grad),
        # The replicated gradients and one has-gradient flag each.
        "all_reduce (replicated gradients)": sum(p.numel() * p.element_size() + p.element_size() for p in replicated),
    }


def _ours(prefetch_layers: int) -> Wrap:
    return lambda model: synchronised_fsdp(FSDP(model, prefetch_layers=prefetch_layers))


def _torch_fsdp(model: nn.Module) -> Wrapped:
    from torch.distributed.fsdp import fully_shard

    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    return Wrapped(model)


def _torch_fsdp_collectives(model: nn.Module) -> dict[str, int]:
    """torch FSDP's defaults: every parameter gathered in forward, the blocks' again in backward (the root's kept
    after forward), every gradient reduce-scattered; the sizes are the whole parameters' (a DTensor's global)."""
    block_bytes = sum(p.numel() * p.element_size() for block in model.layers for p in block.parameters())
    total_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"all_gather (forward weights)": total_bytes, "all_gather (backward weights)": block_bytes,
            "reduce_scatter (gradients)": total_bytes}


VARIANTS = (
    replace(DDP_ADAMW, label=TORCH_DDP),
    Variant(TORCH_FSDP, "fsdp", _torch_fsdp, foreach_adamw, _torch_fsdp_collectives, ddp_buckets=False),
    Variant(OURS, "fsdp", _ours(MAX_PREFETCH_LAYERS), foreach_adamw, _fsdp_collectives, ddp_buckets=False),
    Variant(OURS_NO_PREFETCH, "fsdp", _ours(0), foreach_adamw, _fsdp_collectives, ddp_buckets=False),
)
# The adapter functions the implementation under test's FSDP is built and synchronised with.
UNDER_TEST_FUNCTIONS = ("get_fsdp", "fsdp_on_after_backward")


def under_test_variant(adapters) -> Variant | None:
    """The implementation under test's variant; None where it is this project's own (measured above) or lacks
    UNDER_TEST_FUNCTIONS."""
    if adapters is None or adapters.is_own or adapters.missing(*UNDER_TEST_FUNCTIONS):
        return None
    build, finish = (adapters.function(name) for name in UNDER_TEST_FUNCTIONS)

    def wrap(model: nn.Module) -> Wrapped:
        fsdp = build(model)
        return Wrapped(fsdp, lambda optimizer: finish(fsdp, optimizer))

    return Variant(f"{adapters.label}: get_fsdp", "fsdp", wrap, foreach_adamw, ddp_buckets=False)


def _profiled(rank: int) -> Callable[[Trainer, torch.Tensor, torch.Tensor], list[Interval] | None]:
    """One more step, under torch.profiler on rank 0 (the others run it plainly: its collectives need every
    rank); the trace's intervals."""

    def run(trainer: Trainer, inputs: torch.Tensor, targets: torch.Tensor) -> list[Interval] | None:
        events = trainer.profiled_step(inputs, targets, profile=rank == 0)
        if events is None:
            return None
        names = {e["name"] for e in events if str(e.get("name", "")).startswith(RANGE_PREFIX)}
        return intervals_from_events(events, names | set(PHASES))

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


def benchmark_fsdp(rank: int, world_size: int, cfg: ShardingBenchmarkConfig,
                   under_test: UnderTest | None = None) -> dict | None:
    """Run under launch. Rank 0 returns {"rows": [...], "timeline": intervals of the profiled step}. `under_test`:
    the implementation whose FSDP is measured after the others (harness.under_test_of); None for none."""
    adapters = adapters_in_rank(under_test)
    device = rank_device()
    rows: list[Row] = []
    timeline = None
    theirs = under_test_variant(adapters)
    for variant in (*VARIANTS, *([theirs] if theirs else [])):
        is_theirs = variant is theirs
        profile = _profiled(rank) if variant.label == OURS else None
        stats = guarded_training(variant, cfg, rank, world_size, device, profile, is_theirs)
        trace = stats.pop("trace", None)  # the trace stays on rank 0
        per_rank = gathered(stats)
        rows.append(step_row(variant, per_rank, cfg, world_size, implementation_columns(adapters) if is_theirs else None))
        rows += memory_rows(variant.label, per_rank) + communication_rows(variant.label, per_rank, world_size)
        if trace:
            timeline = trace
            rows += [{**r, "variant": variant.label, "backend": dist.get_backend()} for r in gather_readiness(trace)]
    rows += _model_rows(cfg, world_size)
    return {"rows": rows, "timeline": timeline} if rank == 0 else None


def fsdp_problems(rank: int, world_size: int, cfg: ShardingBenchmarkConfig,
                  under_test: UnderTest | None = None) -> dict | None:
    """Run under launch: both problems from one set of ranks (starting ranks costs seconds). Rank 0
    returns {"rows": equivalence and benchmark rows, "timeline": intervals of the profiled step}."""
    equivalence = fsdp_equivalence(rank, world_size)
    result = benchmark_fsdp(rank, world_size, cfg, under_test)
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
