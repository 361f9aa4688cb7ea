"""Problems optimizer_state_sharding and optimizer_state_sharding_accounting: ShardedOptimizer
against unsharded AdamW (correctness: cs336_systems.distributed.equivalence), and memory and time
per step against torch DDP with AdamW and with torch's ZeroRedundancyOptimizer, all in one run
(cs336_systems.reports.sharding renders them, with how both differ from ZeRO stage 1).

    rows = launch(benchmark_optimizer_sharding, 2, ShardingBenchmarkConfig(), device="cuda")[0]

The training-memory probe here (`measure_training`) also serves the fsdp_accounting benchmark.

Where `benchmark_optimizer_sharding` is given an adapters module other than this project's own (--adapters),
the implementation under test's sharded optimizer (its get_sharded_optimizer, over AdamW, under torch DDP as
ours is) is measured after the others; its rows carry the columns that name it, and a run where it raises on
every rank is recorded as failed. Its communication is its own, and not counted.

How memory is measured and broken down (GPU). After the model, wrapper and optimizer are built,
`memory_allocated` is read (the "init" point; its peak is the highest point while building). Then,
after the warm-up and timed steps, one more step is run with the device synchronised at its phase
points: step start, after forward (loss computed), before the optimizer step (after backward and
gradient synchronisation) and after the optimizer step. The peak at a step point is the highest
allocation since that step started. At each point the sizes of the tensors the run knows are
added up: parameters, gradients (.grad) and optimizer state (this rank's local parts only: shards
for sharded runs); "activations" is what forward left allocated (after forward minus step start:
saved activations, logits and loss); "other" is the allocated memory none of those explain: torch
DDP's gradient buckets, communication buffers, allocator rounding. AdamW creates its state in its
first step, so "init" holds no optimizer state yet.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch import nn

from cs336_systems.accounting.communication import bytes_sent_per_device
from cs336_systems.accounting.memory import GIB, training_memory
from cs336_systems.benchmarks.harness import UnderTest, adapters_in_rank, foreach_adamw, guarded_cell
from cs336_systems.distributed.equivalence import gathered, sharded_optimizer_equivalence
from cs336_systems.distributed.launch import rank_device
from cs336_systems.distributed.sharded_optimizer import SYNC_METHODS, ShardedOptimizer
from cs336_systems.distributed.training import BuildOptimizer, Trainer, Wrap, torch_ddp
from cs336_systems.lm_training import LEARNING_RATE, build_model, logits_loss, random_batch
from cs336_systems.memory_guard import check_memory_on_every_rank
from cs336_systems.model import DEFAULT_SIZE_TABLE, ModelConfig
from cs336_systems.profiling.memory import local_bytes, optimizer_state_tensors
from cs336_systems.provenance import implementation_columns
from cs336_systems.rows import SAMPLE_TIMES, Row
from cs336_systems.timing import STEP_TIMER, synchronize

@dataclass(frozen=True)
class ShardingBenchmarkConfig:
    size: str = "xl"
    context_length: int = 512
    batch_size: int = 4  # per rank
    warmup: int = 2
    steps: int = 5
    attention: str = "sdpa"
    size_table: str = DEFAULT_SIZE_TABLE  # the handout whose size table `size` names

    def __post_init__(self):
        if self.warmup < 1 or self.steps < 1:
            # One warm-up step at least: AdamW creates its state in the first step.
            raise ValueError(f"need warmup >= 1 and steps >= 1, got {self.warmup} and {self.steps}")
        if self.batch_size < 1:
            raise ValueError(f"batch size per rank must be >= 1, got {self.batch_size}")
        self.model_config()  # validates size and context

    def model_config(self) -> ModelConfig:
        return ModelConfig.for_size(self.size, self.context_length, table=self.size_table)


@dataclass(frozen=True)
class Variant:
    """One way to train: its label, its strategy in the memory model, how it wraps the model and builds the
    optimizer, and the collectives of one step (kind -> payload bytes per rank) given the wrapped module, as known
    from the sizes communicated (None where they are not known: the implementation under test's own)."""

    label: str
    strategy: str
    wrap: Wrap
    build_optimizer: BuildOptimizer
    collectives: Callable[[nn.Module], dict[str, int]] | None = None
    ddp_buckets: bool = True  # whether the memory model counts DDP's flattened gradient buckets


class _MemoryProbe:
    def __init__(self, device: torch.device):
        self.on_cuda = device.type == "cuda"
        self.device = device
        self.points: list[Row] = []
        self._step_start_bytes: int | None = None

    def record(self, point: str, trainer: Trainer) -> None:
        """The memory at `point`; "after forward" counts as activations what forward left allocated since the
        step started."""
        synchronize(self.device)
        params = list(trainer.module.parameters())
        allocated = torch.cuda.memory_allocated(self.device) if self.on_cuda else None
        if point == "step start":
            self._step_start_bytes = allocated
        activations = (allocated - self._step_start_bytes if point == "after forward" and allocated is not None
                       else None)
        row: Row = {"point": point,
                    "parameters_gib": sum(map(local_bytes, params)) / GIB,
                    "gradients_gib": sum(local_bytes(p.grad) for p in params if p.grad is not None) / GIB,
                    "optimizer_state_gib": sum(map(local_bytes, optimizer_state_tensors(trainer.optimizer))) / GIB,
                    "activations_gib": None if activations is None else activations / GIB}
        if self.on_cuda:
            known = (row["parameters_gib"] + row["gradients_gib"] + row["optimizer_state_gib"]
                     + (row["activations_gib"] or 0))
            row.update(allocated_gib=allocated / GIB, peak_gib=torch.cuda.max_memory_allocated(self.device) / GIB,
                       other_gib=allocated / GIB - known)
        self.points.append(row)

    def step(self, trainer: Trainer, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        """A step of `trainer` recorded at its points, each point's peak the highest since the step started."""
        if self.on_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        trainer.step(inputs, targets, at=lambda point: self.record(point, trainer))


def measure_training(variant: Variant, cfg: ShardingBenchmarkConfig, rank: int, device: torch.device,
                     profile: Callable[[Trainer, torch.Tensor, torch.Tensor], object] | None = None) -> dict:
    """Time `cfg.steps` training steps of `variant`, and probe its memory.

    `profile`, if given, is called with the trainer and batch, runs one more step under the profiler and returns
    what the stats keep of it. Run it through `guarded_training`, which releases what earlier variants left first.
    """
    probe = _MemoryProbe(device)
    # The same model on every rank, also for wrappers that broadcast nothing.
    trainer = Trainer(build_model(cfg.model_config(), device, cfg.attention, seed=0), variant.wrap,
                      variant.build_optimizer, logits_loss)
    probe.record("init", trainer)
    # Every rank trains on its own data.
    inputs, targets = random_batch(cfg.model_config(), cfg.batch_size, cfg.context_length, device, seed=rank)
    timed = trainer.timed_steps(inputs, targets, cfg.warmup, cfg.steps)
    probe.step(trainer, inputs, targets)
    trace = profile(trainer, inputs, targets) if profile is not None else None
    collectives = variant.collectives(trainer.module) if variant.collectives is not None else None
    return {"status": "ok", "step_ms": timed.samples_ms["step"], "optimizer_ms": timed.samples_ms["optimizer"],
            "memory": probe.points, "collectives": collectives, "trace": trace}


# ----------------------------------------------------------------------------------------- variants

def replicated_collectives(module: nn.Module) -> dict[str, int]:
    """torch DDP's all-reduce of every gradient."""
    return {"all_reduce (DDP gradients)": _gradient_bytes(module)}


def _zero_collectives(module: nn.Module) -> dict[str, int]:
    """torch DDP's gradients, then the updated parameters from their owners."""
    return replicated_collectives(module) | {"broadcast (updated parameters)": _parameter_bytes(module)}


def _zero(module: nn.Module) -> torch.optim.Optimizer:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(module.parameters(), optimizer_class=torch.optim.AdamW, lr=LEARNING_RATE)


def _sharded(sync: str) -> BuildOptimizer:
    return lambda module: ShardedOptimizer(module.parameters(), torch.optim.AdamW, sync=sync, lr=LEARNING_RATE)


UNDER_TEST_FUNCTION = "get_sharded_optimizer"


def under_test_variant(adapters) -> Variant | None:
    """The implementation under test's variant: its sharded optimizer over AdamW, under torch DDP; None where it is
    this project's own (measured above) or lacks the function."""
    if adapters is None or adapters.is_own or adapters.missing(UNDER_TEST_FUNCTION):
        return None
    build = adapters.function(UNDER_TEST_FUNCTION)
    return Variant(f"DDP + {adapters.label}: {UNDER_TEST_FUNCTION}", "optimizer_state", torch_ddp,
                   lambda module: build(module.parameters(), torch.optim.AdamW, lr=LEARNING_RATE))


def _gradient_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)


def _parameter_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


DDP_ADAMW = Variant("DDP + AdamW", "replicated", torch_ddp, foreach_adamw, replicated_collectives)
VARIANTS = (
    DDP_ADAMW,
    Variant("DDP + ZeroRedundancyOptimizer", "optimizer_state", torch_ddp, _zero, _zero_collectives),
    *[Variant(f"DDP + ShardedOptimizer ({sync})", "optimizer_state", torch_ddp, _sharded(sync), _zero_collectives)
      for sync in SYNC_METHODS],
)


def estimated_peak_bytes(cfg: ShardingBenchmarkConfig, strategy: str, world_size: int, ddp_buckets: bool) -> int:
    """One rank's peak from the memory model (cs336_systems.accounting.memory)."""
    return training_memory(cfg.model_config(), cfg.batch_size, cfg.context_length, attention=cfg.attention,
                           strategy=strategy, world_size=world_size, ddp_buckets=ddp_buckets).peak


def guarded_training(variant: Variant, cfg: ShardingBenchmarkConfig, rank: int, world_size: int,
                     device: torch.device, profile: Callable | None = None, under_test: bool = False) -> dict:
    """`measure_training`, or OOM stats where the memory model's estimate does not fit on every rank (then no rank
    runs it) or where it runs out of memory, or, `under_test`, failed stats where the implementation under test
    raises; the estimate goes with the stats either way."""
    estimated_bytes = estimated_peak_bytes(cfg, variant.strategy, world_size, variant.ddp_buckets)

    def measure(columns: Row) -> dict:
        return measure_training(variant, cfg, rank, device, profile=profile) | columns

    return guarded_cell(device, lambda: check_memory_on_every_rank(estimated_bytes, device, world_size), measure,
                        oom=lambda columns: columns, failed=(lambda columns: columns) if under_test else None)


def step_row(variant: Variant, per_rank: list[dict], cfg: ShardingBenchmarkConfig, world_size: int,
             implementation: Row | None = None) -> Row:
    """One variant's row: time (over ranks and steps), peak memory (the largest rank's), the memory
    model's prediction beside it, and communication per rank and step (where known); with the columns that
    name the implementation under test, for its variant."""
    row: Row = {"table": "step", "variant": variant.label, **asdict(cfg), "world_size": world_size,
                "backend": dist.get_backend(), **(implementation or {})}
    # A variant that ran out of memory, or failed, on any rank did not run.
    missed = next((stats for stats in per_rank if stats["status"] != "ok"), None)
    if missed is not None:
        return {**row, **missed}
    steps = [x for stats in per_rank for x in stats["step_ms"]]
    optimizer = [x for stats in per_rank for x in stats["optimizer_ms"]]
    row.update(status="ok", timer=STEP_TIMER, step_ms=statistics.fmean(steps),
               step_std_ms=statistics.stdev(steps) if len(steps) > 1 else 0.0,
               optimizer_ms=statistics.fmean(optimizer))
    # The training peak: step points only (building a model can peak higher, e.g. before sharding).
    peaks = [point.get("peak_gib") for stats in per_rank for point in stats["memory"] if point["point"] != "init"]
    if all(peak is not None for peak in peaks):
        row["peak_gib"] = max(peaks)
    row["model_peak_gib"] = estimated_peak_bytes(cfg, variant.strategy, world_size, variant.ddp_buckets) / GIB
    collectives = per_rank[0]["collectives"]
    if collectives is not None:
        row["communicated_bytes"] = sum(collectives.values())
        row["ring_bytes_sent_per_rank"] = sum(
            bytes_sent_per_device("all_reduce" if kind.startswith("all_reduce") else "all_gather", payload, world_size)
            for kind, payload in collectives.items())
    row[SAMPLE_TIMES] = steps
    return row


def memory_rows(label: str, per_rank: list[dict]) -> list[Row]:
    """The memory points of the rank with the highest peak (ranks differ little; sharded state can)."""
    if any(stats["status"] != "ok" for stats in per_rank):
        return []
    rank = max(range(len(per_rank)), key=lambda r: max(p.get("peak_gib") or 0 for p in per_rank[r]["memory"]
                                                        if p["point"] != "init"))
    return [{"table": "memory", "variant": label, "rank": rank, **point} for point in per_rank[rank]["memory"]]


def communication_rows(label: str, per_rank: list[dict], world_size: int) -> list[Row]:
    if any(stats["status"] != "ok" for stats in per_rank) or per_rank[0]["collectives"] is None:
        return []
    return [{"table": "communication", "variant": label, "collective": kind, "payload_bytes": payload,
             "ring_bytes_sent_per_rank": bytes_sent_per_device(
                 "all_reduce" if kind.startswith("all_reduce") else "all_gather", payload, world_size)}
            for kind, payload in per_rank[0]["collectives"].items()]


def benchmark_optimizer_sharding(rank: int, world_size: int, cfg: ShardingBenchmarkConfig,
                                 under_test: UnderTest | None = None) -> list[Row]:
    """Run under launch. Rank 0 returns the rows of every variant. `under_test`: the implementation whose sharded
    optimizer is measured after the others (harness.under_test_of); None for none."""
    adapters = adapters_in_rank(under_test)
    device = rank_device()
    rows: list[Row] = []
    theirs = under_test_variant(adapters)
    for variant in (*VARIANTS, *([theirs] if theirs else [])):
        is_theirs = variant is theirs
        per_rank = gathered(guarded_training(variant, cfg, rank, world_size, device, under_test=is_theirs))
        rows.append(step_row(variant, per_rank, cfg, world_size, implementation_columns(adapters) if is_theirs else None))
        rows += memory_rows(variant.label, per_rank) + communication_rows(variant.label, per_rank, world_size)
    return rows if rank == 0 else []


def optimizer_sharding_problems(rank: int, world_size: int, cfg: ShardingBenchmarkConfig,
                                under_test: UnderTest | None = None) -> list[Row]:
    """Run under launch: both problems' rows from one set of ranks (starting ranks costs seconds)."""
    return (sharded_optimizer_equivalence(rank, world_size)
            + benchmark_optimizer_sharding(rank, world_size, cfg, under_test))
