"""Whether a parallelism trains as one process does: a wrapped model trained beside a one-process reference on
the same batches, each rank on its rows of the batch (or all of it), and how far apart they end, over ranks.

    reference = Trainer(deepcopy(model), unwrapped, sgd, loss)
    trainer = Trainer(model, wrap, sgd, loss)
    train_beside(reference, trainer, batches)
    difference = worst_over_ranks(max_abs_difference(reference.module.parameters(), trainer.module.parameters()))

Below, the check of each problem that reports such a comparison (ddp_equivalence, sharded_optimizer_equivalence,
fsdp_equivalence, leaderboard_equivalence), run under launch: it chooses the models, batches and tolerances, and
rank 0 returns its rows; the benchmarks call it in the ranks they measure in. `equivalence_failures` words the
rows outside their tolerance.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from copy import deepcopy

import torch
import torch.distributed as dist
from torch import nn

from cs336_systems.distributed.ddp import batch_shard
from cs336_systems.distributed.fsdp import FSDP
from cs336_systems.distributed.launch import rank_device
from cs336_systems.distributed.sharded_optimizer import SYNC_METHODS, ShardedOptimizer
from cs336_systems.distributed.training import Trainer, our_ddp, synchronised_fsdp, unwrapped
from cs336_systems.leaderboard_variants import VARIANTS, build, flash_source, full_gradients
from cs336_systems.lm_training import build_model, lm_loss, logits_loss, random_batch
from cs336_systems.model import ModelConfig
from cs336_systems.precision import Precision
from cs336_systems.profiling.memory import local_bytes, optimizer_state_tensors
from cs336_systems.rows import Row
from cs336_systems.rows.ddp import variant_label
from cs336_systems.timing import synchronize


def train_beside(reference: Trainer, trainer: Trainer, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                 share: bool = True) -> None:
    """A step of `reference` on each whole batch, then one of `trainer` on this rank's rows of it (batch_shard)
    where `share`, on all of it otherwise."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    for inputs, targets in batches:
        reference.step(inputs, targets)
        rows = batch_shard(len(inputs), rank, world_size) if share else slice(None)
        trainer.step(inputs[rows], targets[rows])


def max_abs_difference(expected: Iterable[torch.Tensor], actual: Iterable[torch.Tensor]) -> float:
    """The largest elementwise difference between paired tensors."""
    return max((a.detach() - b.detach()).abs().max().item() for a, b in zip(expected, actual, strict=True))


def max_relative_difference(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> float:
    """The largest difference between tensors of the same name, each relative to the expected one's largest
    magnitude; the names must be the same."""
    if expected.keys() != actual.keys():
        raise RuntimeError(f"tensors of other names than expected: {sorted(expected.keys() ^ actual.keys())}")
    return max(((actual[name] - want).abs().max() / want.abs().max()).item() for name, want in expected.items())


def gathered(value: object) -> list:
    """`value` from every rank, by rank."""
    values: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def worst_over_ranks(difference: float) -> float:
    return max(gathered(difference))


def equivalence_failures(rows: list[dict], label: str = "variant") -> list[str]:
    """Each equivalence row outside its tolerance as "<label>: <difference> > <tolerance>"."""
    return [f"{r[label]}: max abs difference {r['max_abs_difference']:.3g} > tolerance {r['tolerance']:g}"
            for r in rows if not r["matches"]]


# The DDP, sharded-optimizer and FSDP checks train the tiny LM at a short context.
MODEL_SIZE = "tiny"
CONTEXT_LENGTH = 16

# ---------------------------------------------------------------------------------------------------- DDP

DDP_BATCH_PER_RANK = 2
DDP_STEPS = 5
# Both sides train in float64, so only the order of summation differs.
DDP_TOLERANCE = 1e-9
# Many small buckets, and one bucket holding everything.
DDP_BUCKET_SIZES_MB = (0.05, 1000)


def ddp_equivalence(rank: int, world_size: int) -> list[Row]:
    """Each wrapper against single-process training of the tiny LM (float64, AdamW, fresh data)."""
    device = rank_device()
    config = ModelConfig.for_size(MODEL_SIZE, CONTEXT_LENGTH)
    cases = [("naive", None), ("flat", None), ("overlap_individual", None),
             *[("bucketed", b) for b in DDP_BUCKET_SIZES_MB]]
    batches = [random_batch(config, DDP_BATCH_PER_RANK * world_size, CONTEXT_LENGTH, device, seed=step)
               for step in range(DDP_STEPS)]  # the same full batch on every rank
    rows = []
    for method, bucket_size_mb in cases:
        trainer = Trainer(build_model(config, device, dtype=torch.float64, seed=rank),
                          lambda lm: our_ddp(lm, method, bucket_size_mb), _adamw, logits_loss)
        # Built after the wrapper broadcast rank 0's parameters.
        reference = Trainer(deepcopy(trainer.module.module), unwrapped, _adamw, logits_loss)
        train_beside(reference, trainer, batches)
        difference = worst_over_ranks(max_abs_difference(reference.module.parameters(),
                                                         trainer.module.module.parameters()))
        rows.append({"table": "equivalence", "method": method, "variant": variant_label(method, bucket_size_mb),
                     "model": f"{MODEL_SIZE} LM, float64", "world_size": world_size,
                     "backend": dist.get_backend(), "steps": DDP_STEPS, "max_abs_difference": difference,
                     "tolerance": DDP_TOLERANCE, "matches": difference <= DDP_TOLERANCE})
    return rows if rank == 0 else []


def _adamw(module: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(module.parameters(), lr=1e-3)


# -------------------------------------------------------------------------------------- sharded optimizer

SHARDED_OPTIMIZER_BATCH = 4
SHARDED_OPTIMIZER_STEPS = 5


def sharded_optimizer_equivalence(rank: int, world_size: int) -> list[Row]:
    """ShardedOptimizer(AdamW) against AdamW on the tiny LM, the same batches on every rank: each
    parameter's update is the same arithmetic on its owner, so the results must be identical."""
    device = rank_device()
    config = ModelConfig.for_size(MODEL_SIZE, CONTEXT_LENGTH)
    batches = [random_batch(config, SHARDED_OPTIMIZER_BATCH, CONTEXT_LENGTH, device, seed=step)
               for step in range(SHARDED_OPTIMIZER_STEPS)]
    rows = []
    for sync in SYNC_METHODS:
        reference = Trainer(build_model(config, device, seed=0), unwrapped,
                            lambda module: torch.optim.AdamW(module.parameters(), lr=1e-3, weight_decay=0.1),
                            logits_loss)
        trainer = Trainer(deepcopy(reference.module), unwrapped,
                          lambda module: ShardedOptimizer(module.parameters(), torch.optim.AdamW, sync=sync, lr=1e-3,
                                                          weight_decay=0.1), logits_loss)
        train_beside(reference, trainer, batches, share=False)
        state_bytes, reference_state_bytes = (sum(map(local_bytes, optimizer_state_tensors(t.optimizer)))
                                              for t in (trainer, reference))
        rows.append({"table": "equivalence", "sync": sync, "world_size": world_size, "backend": dist.get_backend(),
                     "model": f"{MODEL_SIZE} LM, fp32", "steps": SHARDED_OPTIMIZER_STEPS,
                     "max_abs_difference": max_abs_difference(reference.module.parameters(),
                                                              trainer.module.parameters()),
                     "state_share": state_bytes / reference_state_bytes})
    per_rank = gathered(rows)
    merged = []
    for i, row in enumerate(per_rank[0]):
        shares = [rank_rows[i]["state_share"] for rank_rows in per_rank]
        merged.append({**row, "max_abs_difference": max(r[i]["max_abs_difference"] for r in per_rank),
                       "state_share": max(shares), "state_share_min": min(shares)})
    return merged if rank == 0 else []


# --------------------------------------------------------------------------------------------------- FSDP

FSDP_BATCH_PER_RANK = 2
FSDP_STEPS = 3
# fp32 differs from one process only in summation order; bf16 compute rounds every matmul to 8
# significant bits on both sides, in different orders.
FSDP_TOLERANCES = {"fp32": 1e-5, "bf16": 5e-3}


def fsdp_equivalence(rank: int, world_size: int) -> list[Row]:
    """FSDP against one process training the tiny LM on the whole batch (SGD), in fp32 and with bf16
    compute (the single process casting its Linear and Embedding weights to bf16 for compute)."""
    from torch.func import functional_call

    device = rank_device()
    config = ModelConfig.for_size(MODEL_SIZE, CONTEXT_LENGTH)
    batches = [random_batch(config, FSDP_BATCH_PER_RANK * world_size, CONTEXT_LENGTH, device, seed=step)
               for step in range(FSDP_STEPS)]
    rows = []
    for precision in FSDP_TOLERANCES:
        compute_dtype = Precision.named(precision).autocast_dtype  # None: fp32 computes in the master weights
        model = build_model(config, device, seed=0)
        logits_dtypes: list[str] = []
        trainer = Trainer(deepcopy(model), lambda lm: synchronised_fsdp(FSDP(lm, compute_dtype=compute_dtype)), _sgd,
                          _recording_loss(logits_dtypes))
        sharded = {f"{w.name}.weight" for w in trainer.module.weights}

        def reference_loss(lm: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            params = {n: p.to(compute_dtype) if compute_dtype and n in sharded else p for n, p in lm.named_parameters()}
            return lm_loss(functional_call(lm, params, (inputs,)), targets)

        reference = Trainer(model, unwrapped, _sgd, reference_loss)
        train_beside(reference, trainer, batches)
        full = trainer.module.gather_full_params()
        expected = dict(reference.module.named_parameters())
        difference = worst_over_ranks(max_abs_difference(expected.values(), (full[n] for n in expected)))
        master_dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in trainer.module.parameters()})
        tolerance = FSDP_TOLERANCES[precision]
        rows.append({"table": "equivalence", "compute": precision, "world_size": world_size,
                     "backend": dist.get_backend(), "model": f"{MODEL_SIZE} LM", "steps": FSDP_STEPS,
                     "logits_dtype": logits_dtypes[-1], "master_dtype": ", ".join(master_dtypes),
                     "max_abs_difference": difference, "tolerance": tolerance, "matches": difference <= tolerance})
    return rows if rank == 0 else []


def _sgd(module: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(module.parameters(), lr=0.1)


def _recording_loss(logits_dtypes: list[str]):
    """The LM's loss, appending the dtype of each step's logits to `logits_dtypes`."""
    def loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = model(inputs)
        logits_dtypes.append(str(logits.dtype).removeprefix("torch."))
        return lm_loss(logits, targets)

    return loss


# ------------------------------------------------------------------------------------------- leaderboard

# A small model in fp32 with a vocabulary larger than a loss chunk, so that the fused loss runs in chunks.
LEADERBOARD_MODEL = ModelConfig(d_model=64, d_ff=176, num_layers=2, num_heads=4, context_length=32, vocab_size=300)
LEADERBOARD_BATCH_PER_RANK = 1
LEADERBOARD_CHUNK_TOKENS = 24
LEADERBOARD_CHECKPOINTED_BLOCKS = 1  # of 2: one block recomputed in backward, one run plainly
# By device, relative to each gradient's largest magnitude (and to the loss). On a CPU everything is fp32: the
# ranks' gradients differ from one process's in summation order, FlashAttention's in the order of its online
# softmax. On a GPU the FlashAttention kernels' fp32 dots run in tf32 (10 mantissa bits, a relative error of
# up to 2^-11 a product), SDPA's in fp32.
LEADERBOARD_TOLERANCES = {"cpu": 1e-4, "cuda": 5e-3}


def leaderboard_equivalence(rank: int, world_size: int, variants: tuple[str, ...] = tuple(VARIANTS)) -> list[Row]:
    """One step of each of `variants` against one process training the plain model (SDPA, full logits) on
    the whole batch: the difference in the loss, relative to it, and the largest difference in any gradient,
    relative to that gradient's largest magnitude."""
    device = rank_device()
    config = LEADERBOARD_MODEL
    inputs, targets = random_batch(config, LEADERBOARD_BATCH_PER_RANK * world_size, config.context_length, device)
    reference = build_model(config, device, "sdpa", seed=0)
    reference_loss = lm_loss(reference(inputs), targets)
    reference_loss.backward()
    expected = {name: p.grad for name, p in reference.named_parameters()}  # checkpointing keeps the blocks' names
    mine = batch_shard(len(inputs), rank, world_size)
    rows = []
    for name in variants:
        variant = VARIANTS[name]
        trainer = build(variant, config, device, torch.float32, compile=False,
                        chunk_tokens=LEADERBOARD_CHUNK_TOKENS, checkpointed_blocks=LEADERBOARD_CHECKPOINTED_BLOCKS)
        gradients = {}

        def finished(point: str) -> None:
            if point == "before optimizer step":
                gradients.update(full_gradients(trainer))

        loss = trainer.step(inputs[mine], targets[mine], at=finished)
        loss_difference = abs(statistics.fmean(gathered(loss.item())) - reference_loss.item())
        tolerance = LEADERBOARD_TOLERANCES[device.type]
        rows.append({"table": "equivalence", "variant": name, "setup": variant.setup, "source_hash": flash_source(),
                     "world_size": world_size, "backend": dist.get_backend(), "model": _model_text(config),
                     "relative_loss_difference": loss_difference / abs(reference_loss.item()),
                     "max_relative_gradient_difference": max_relative_difference(expected, gradients),
                     "tolerance": tolerance})
        del trainer
    for row in rows:
        row["matches"] = max(row["relative_loss_difference"], row["max_relative_gradient_difference"]) <= row["tolerance"]
    synchronize(device)
    return rows if rank == 0 else []


def _model_text(config: ModelConfig) -> str:
    return (f"d_model {config.d_model}, {config.num_layers} layers, vocabulary {config.vocab_size}, "
            f"context {config.context_length}, fp32")
