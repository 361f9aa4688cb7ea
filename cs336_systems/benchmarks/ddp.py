"""Problems naive_ddp_benchmarking, minimal_ddp_flat_benchmarking,
ddp_overlap_individual_parameters_benchmarking and ddp_bucketed_benchmarking (one run measures
them all; cs336_systems.reports.ddp renders them, and the correctness reports naive_ddp,
ddp_overlap_individual_parameters and ddp_overlap_bucketed from the rows of
cs336_systems.distributed.equivalence.ddp_equivalence).

    result = launch(benchmark_ddp, 2, DDPBenchmarkConfig(), device="cuda")[0]
    rows, timelines = result["rows"], result["timelines"]

`benchmark_ddp` runs on every rank and trains the LM under each variant in turn, freeing memory
between them, so that all are measured on the same machine state:
  local               no communication: every rank trains alone (the compute-only floor)
  naive, flat, overlap_individual, bucketed (each bucket size)
  torch_ddp             torch.nn.parallel.DistributedDataParallel with its defaults
  torch_ddp_bucket_view the same with gradient_as_bucket_view=True: gradients live in its
                        buckets, so nothing is copied back (the stronger baseline)

and, where `benchmark_ddp` is given an adapters module other than this project's own (--adapters), the
implementation under test's wrappers after them, reached only through its adapter functions
(UNDER_TEST_METHODS: get_ddp_individual_parameters, get_ddp_bucketed at each bucket size, get_ddp, each with
its hooks), those it lacks left out. Their rows carry the columns that name it
(cs336_systems.provenance.implementation_columns); a variant of it that raises on every rank is recorded as
failed and the next one runs (one that fails on some ranks only leaves the others waiting in a collective,
and the launch's deadline ends the job).

Each step is timed by cs336_systems.timing with one synchronisation, at its end (synchronising inside
the step would stall the very overlap being measured): markers on the device's timeline (CUDA events
on the compute stream; the host clock on CPU) split it into forward, backward, gradient_sync
(finish_gradient_synchronization: for naive and flat all of the communication; for the overlapped
wrappers the part left after backward, the exposed communication) and optimizer.
torch DDP waits for its all-reduces inside backward, so its gradient_sync is empty; its cost shows
in the step time. One more step per variant runs under torch.profiler on rank 0: the trace gives
the total communication time (NCCL kernels, or gloo's work on CPU), how much of it ran beside
compute, and the timeline figure.

Every rank must run the same collectives, so a variant that runs out of memory on one rank but
not on another can hang the job; the launch's deadline then ends it. Ranks run the same shapes, so
in practice they run out together, and the variant is recorded as OOM.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from cs336_systems.accounting.ddp import allreduce_cost
from cs336_systems.accounting.memory import training_memory
from cs336_systems.benchmarks.allreduce import time_allreduce
from cs336_systems.benchmarks.harness import UnderTest, adapters_in_rank, foreach_adamw, guarded_cell
from cs336_systems.distributed.launch import rank_device
from cs336_systems.distributed.training import PHASES, Trainer, Wrap, Wrapped, our_ddp, torch_ddp, unwrapped
from cs336_systems.gpus import GIB
from cs336_systems.lm_training import build_model, logits_loss, random_batch
from cs336_systems.memory_guard import check_memory_on_every_rank
from cs336_systems.model import DEFAULT_SIZE_TABLE, ModelConfig
from cs336_systems.profiling.timeline import COMPUTE, CPU_COMPUTE_ROW, communication_summary, intervals_from_events
from cs336_systems.provenance import implementation_columns
from cs336_systems.rows import SAMPLE_TIMES, Row
from cs336_systems.rows.ddp import TORCH_DDP_METHODS, UNDER_TEST_METHODS, variant_label
from cs336_systems.timing import STEP_TIMER

log = logging.getLogger(__name__)

# The all-reduce probe that gives the overhead model its o (a small all-reduce is nearly all
# per-call cost) and w (bandwidth of a large one).
PROBE_SMALL_BYTES = 4096


@dataclass(frozen=True)
class DDPBenchmarkConfig:
    size: str = "xl"
    context_length: int = 512
    batch_size: int = 4  # per rank
    warmup: int = 3
    steps: int = 10
    bucket_sizes_mb: tuple[float, ...] = (1, 10, 100, 1000)
    attention: str = "sdpa"
    probe_large_bytes: int = 10**9
    size_table: str = DEFAULT_SIZE_TABLE  # the handout whose size table `size` names

    def __post_init__(self):
        if self.warmup < 0 or self.steps < 1:
            raise ValueError(f"need warmup >= 0 and steps >= 1, got {self.warmup} and {self.steps}")
        if self.batch_size < 1:
            raise ValueError(f"batch size per rank must be >= 1, got {self.batch_size}")
        if any(not b > 0 for b in self.bucket_sizes_mb):
            raise ValueError(f"bucket sizes must be positive, got {self.bucket_sizes_mb}")
        self.model_config()  # validates size and context

    def model_config(self) -> ModelConfig:
        return ModelConfig.for_size(self.size, self.context_length, table=self.size_table)

    def variants(self) -> list[tuple[str, float | None]]:
        return [("local", None), ("naive", None), ("flat", None), ("overlap_individual", None),
                *[("bucketed", b) for b in self.bucket_sizes_mb], ("torch_ddp", None), ("torch_ddp_bucket_view", None)]


def under_test_functions(method: str) -> tuple[str, ...]:
    """The adapter functions the implementation under test's variant `method` needs."""
    return (method, *(hook for hook in UNDER_TEST_METHODS[method] if hook))


def under_test_variants(adapters, bucket_sizes_mb=DDPBenchmarkConfig.bucket_sizes_mb) -> list[tuple[str, float | None]]:
    """The implementation under test's (method, bucket size) variants, in UNDER_TEST_METHODS' order, the bucketed
    one at each bucket size: none where it is this project's own (its variants are measured already), and none of a
    method whose adapter functions it lacks."""
    if adapters is None or adapters.is_own:
        return []
    return [(method, bucket) for method in UNDER_TEST_METHODS if not adapters.missing(*under_test_functions(method))
            for bucket in (bucket_sizes_mb if method == "get_ddp_bucketed" else (None,))]


def wrap(method: str, bucket_size_mb: float | None = None, adapters=None) -> Wrap:
    """How variant `method` wraps the model; the implementation under test's methods come from `adapters`."""
    def apply(model: torch.nn.Module) -> Wrapped:
        if method == "local":
            return unwrapped(model)
        if method in TORCH_DDP_METHODS:
            return torch_ddp(model, gradient_as_bucket_view=method == "torch_ddp_bucket_view")
        if method in UNDER_TEST_METHODS:
            return _wrap_under_test(method, bucket_size_mb, model, adapters)
        return our_ddp(model, method, bucket_size_mb)

    return apply


def _wrap_under_test(method: str, bucket_size_mb: float | None, model: torch.nn.Module, adapters) -> Wrapped:
    """The implementation under test's wrapper and hooks, through its adapter functions."""
    after_backward, before_batch = UNDER_TEST_METHODS[method]
    build = adapters.function(method)
    wrapper = build(model, bucket_size_mb) if bucket_size_mb is not None else build(model)

    def hook(name: str | None):
        if name is None:
            return None
        function = adapters.function(name)
        return lambda optimizer: function(wrapper, optimizer)

    return Wrapped(wrapper, hook(after_backward), hook(before_batch))


def _all_reduces_per_step(method: str, module: torch.nn.Module) -> int | None:
    """Gradient all-reduce calls per step (our wrappers add one small all-reduce of gradient counts);
    None for torch DDP and the local run."""
    if method == "bucketed":
        return len(module.buckets)
    if method in ("naive", "overlap_individual"):
        return sum(p.requires_grad for p in module.module.parameters())
    return 1 if method == "flat" else None  # the implementation under test's are not counted


def _measure_variant(method: str, bucket_size_mb: float | None, cfg: DDPBenchmarkConfig, rank: int,
                     device: torch.device, profile: bool, adapters=None) -> tuple[dict, list | None]:
    config = cfg.model_config()
    # A different initial model on every rank: the wrappers must broadcast.
    model = build_model(config, device, cfg.attention, seed=rank)
    trainable_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    trainer = Trainer(model, wrap(method, bucket_size_mb, adapters), foreach_adamw, logits_loss)
    # Every rank trains on its own data.
    inputs, targets = random_batch(config, cfg.batch_size, cfg.context_length, device, seed=rank)
    timed = trainer.timed_steps(inputs, targets, cfg.warmup, cfg.steps)
    stats = {"status": "ok", "samples_ms": timed.samples_ms, "trainable_bytes": trainable_bytes,
             "all_reduces_per_step": _all_reduces_per_step(method, trainer.module),
             "peak_memory_gib": None if timed.peak_memory_bytes is None else timed.peak_memory_bytes / GIB}
    events = trainer.profiled_step(inputs, targets, profile)
    return stats, None if events is None else _timeline(events, device)


def _timeline(events: list[dict], device: torch.device) -> list | None:
    """A profiled step's timeline, or None when the trace holds no device work."""
    intervals = intervals_from_events(events, phase_names=PHASES)
    if device.type == "cuda" and all(i.row == CPU_COMPUTE_ROW for i in intervals if i.kind == COMPUTE):
        # Without CUPTI the profiler records no kernels; communication would wrongly read as zero.
        log.warning("the profiler recorded no CUDA kernels; communication columns and timelines are left out")
        return None
    return intervals


def _allreduce_probe(cfg: DDPBenchmarkConfig, rank: int, world_size: int) -> Row:
    """o and w for the overhead model, measured on the same ranks just before the variants."""
    times = {}
    for size_bytes in (PROBE_SMALL_BYTES, cfg.probe_large_bytes):
        median_s, _ = time_allreduce(size_bytes)
        medians: list[float | None] = [None] * world_size
        dist.all_gather_object(medians, median_s)
        times[size_bytes] = statistics.fmean(medians)
    per_call_s, bandwidth = allreduce_cost(PROBE_SMALL_BYTES, times[PROBE_SMALL_BYTES],
                                           cfg.probe_large_bytes, times[cfg.probe_large_bytes])
    return {"table": "allreduce_probe", "small_bytes": PROBE_SMALL_BYTES, "small_ms": times[PROBE_SMALL_BYTES] * 1e3,
            "large_bytes": cfg.probe_large_bytes, "large_ms": times[cfg.probe_large_bytes] * 1e3,
            "per_call_overhead_ms": per_call_s * 1e3, "algbw_gbps": bandwidth / 1e9}


def _row(method: str, bucket_size_mb: float | None, per_rank: list[dict], summary: dict | None,
         cfg: DDPBenchmarkConfig, world_size: int, adapters=None) -> Row:
    under_test = implementation_columns(adapters) if method in UNDER_TEST_METHODS else {}
    row: Row = {"table": "step", "variant": variant_label(method, bucket_size_mb, under_test.get("implementation")),
                "method": method, "bucket_size_mb": bucket_size_mb, **asdict(cfg), "world_size": world_size,
                "backend": dist.get_backend()}
    for sweep_only in ("bucket_sizes_mb", "probe_large_bytes"):
        row.pop(sweep_only)
    row |= under_test
    # A variant that ran out of memory, or failed, on any rank did not run.
    missed = next((stats for stats in per_rank if stats["status"] != "ok"), None)
    if missed is not None:
        return {**row, **missed}
    pooled = {key: [x for stats in per_rank for x in stats["samples_ms"].get(key, ())] for key in ("step", *PHASES)}
    row.update(status="ok", timer=STEP_TIMER, trainable_bytes=per_rank[0]["trainable_bytes"],
               all_reduces_per_step=per_rank[0]["all_reduces_per_step"],
               step_ms=statistics.fmean(pooled["step"]),
               step_std_ms=statistics.stdev(pooled["step"]) if len(pooled["step"]) > 1 else 0.0,
               # Nothing ran after backward in the local run and torch DDP: their gradient_sync took no time.
               **{f"{phase}_ms": statistics.fmean(pooled[phase]) if pooled[phase] else 0.0 for phase in PHASES})
    peaks = [stats["peak_memory_gib"] for stats in per_rank if stats["peak_memory_gib"] is not None]
    row["peak_memory_gib"] = max(peaks) if peaks else None
    if summary is not None:
        row.update({f"profiled_{key}": value for key, value in summary.items()})
    row[SAMPLE_TIMES] = pooled["step"]
    return row


def _estimated_peak_bytes(method: str, cfg: DDPBenchmarkConfig, world_size: int) -> int:
    """One rank's peak from the memory model: the flat and bucketed wrappers and torch DDP (without
    gradient_as_bucket_view) keep a second, flattened copy of the gradients."""
    # The implementation under test's bucketed wrapper is taken to keep flattened buckets as ours does.
    return training_memory(cfg.model_config(), cfg.batch_size, cfg.context_length,
                           attention=cfg.attention, world_size=world_size,
                           ddp_buckets=method in ("flat", "bucketed", "torch_ddp", "get_ddp_bucketed")).peak


def _guarded_variant(method: str, bucket_size_mb: float | None, cfg: DDPBenchmarkConfig, rank: int, world_size: int,
                     device: torch.device, adapters=None) -> tuple[dict, list | None]:
    """`_measure_variant`'s stats, with the estimate, and timeline; or OOM stats and no timeline where the
    estimate does not fit on every rank (then no rank runs it) or the variant runs out of memory; or, for the
    implementation under test, failed stats where it raises."""
    def measure(columns: Row) -> tuple[dict, list | None]:
        stats, intervals = _measure_variant(method, bucket_size_mb, cfg, rank, device, rank == 0, adapters)
        return stats | columns, intervals

    estimated_bytes = _estimated_peak_bytes(method, cfg, world_size)
    return guarded_cell(device, lambda: check_memory_on_every_rank(estimated_bytes, device, world_size), measure,
                        oom=lambda columns: (columns, None),
                        failed=(lambda columns: (columns, None)) if method in UNDER_TEST_METHODS else None)


def benchmark_ddp(rank: int, world_size: int, cfg: DDPBenchmarkConfig,
                  under_test: UnderTest | None = None) -> dict | None:
    """Run under launch. Rank 0 returns {"rows": [...], "timelines": {variant: intervals}}. `under_test`: the
    implementation whose wrappers are measured after this project's (harness.under_test_of); None for none."""
    adapters = adapters_in_rank(under_test)
    device = rank_device()
    rows = [{**_allreduce_probe(cfg, rank, world_size), "world_size": world_size}]
    timelines = {}
    for method, bucket_size_mb in cfg.variants() + under_test_variants(adapters, cfg.bucket_sizes_mb):
        stats, intervals = _guarded_variant(method, bucket_size_mb, cfg, rank, world_size, device, adapters)
        per_rank: list[dict | None] = [None] * world_size
        dist.all_gather_object(per_rank, stats)
        row = _row(method, bucket_size_mb, per_rank, communication_summary(intervals) if intervals else None,
                   cfg, world_size, adapters)
        if intervals:
            timelines[row["variant"]] = intervals
        rows.append(row)
    return {"rows": rows, "timelines": timelines} if rank == 0 else None
