"""Training memory of the Transformer LM in closed form: parameters, gradients, AdamW state, saved
activations and communication buffers, per device, for one process or sharded over ranks.

    memory = training_memory(ModelConfig.for_size("xl", 512), batch_size=4, seq_len=512,
                             strategy="fsdp", world_size=2)
    memory.peak, memory.as_row()

Training state. Parameters stay fp32 under autocast (autocast casts copies for each matmul), so
gradients are fp32 too, and AdamW keeps two fp32 moments per parameter (exp_avg, exp_avg_sq; its
per-tensor step counter is a scalar and left out).

Saved activations are counted by `cs336_systems.accounting.activations` (op by op, checked against
what autograd saves), plus the batch itself: the token ids the embedding keeps and the targets the
loss keeps, int64 each.

Strategies, with N = `world_size`:
  replicated       every rank holds everything (one process, or data parallel)
  optimizer_state  ZeRO stage 1: AdamW state sharded, about 1/N per rank
  fsdp             Linear and Embedding weights, their gradients and state sharded (each weight
                   padded to a multiple of N); RMSNorm weights replicated. Weights are gathered one
                   layer at a time, so no low-precision weight copy outlives its layer.
Torch DDP (`ddp_buckets=True`) also keeps its gradient buckets: one more full copy of the
gradients (its default, gradient_as_bucket_view=False).

Peak. At the start of backward the saved activations are all alive and gradients are not yet
allocated (zero_grad(set_to_none=True)); as backward proceeds, activations are freed while gradients
appear. `peak` = persistent state + max(activations, gradients): what the model predicts at the
largest of those moments, without allocator fragmentation, kernel workspaces or temporaries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cs336_systems.accounting.activations import (
    ADAMW_STATE_PER_PARAMETER,
    FP32_BYTES,
    parameter_count,
    parameter_counts,
    saved_activation_bytes,
)
from cs336_systems.checks import check_choice, check_positive_int
from cs336_systems.gpus import GIB
from cs336_systems.model import ModelConfig
from cs336_systems.precision import Precision

INDEX_BYTES = 8  # token ids and targets are int64
STRATEGIES = ("replicated", "optimizer_state", "fsdp")


# ----------------------------------------------------------------------------------- FSDP shards

def sharded_weight_shapes(config: ModelConfig) -> list[tuple[int, int]]:
    """The (rows, cols) of every Linear and Embedding weight: what FSDP shards."""
    d, d_ff = config.d_model, config.d_ff
    block = [(d, d)] * 4 + [(d_ff, d), (d, d_ff), (d_ff, d)]
    return [(config.vocab_size, d), *block * config.num_layers, (config.vocab_size, d)]


def fsdp_shard_elements(config: ModelConfig, world_size: int) -> int:
    """Elements of one rank's weight shards: each weight padded up to a multiple of world_size."""
    check_positive_int(world_size=world_size)
    return sum(math.ceil(rows * cols / world_size) for rows, cols in sharded_weight_shapes(config))


# ---------------------------------------------------------------------------------------- totals

@dataclass(frozen=True)
class TrainingMemory:
    """Bytes one device holds, by kind."""

    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    buffers: int  # communication buffers: torch DDP's gradient buckets, FSDP's gathered weights

    @property
    def persistent(self) -> int:
        """What stays allocated across steps (gradients freed by zero_grad(set_to_none=True))."""
        return self.parameters + self.optimizer_state + self.buffers

    @property
    def peak(self) -> int:
        return self.persistent + max(self.activations, self.gradients)

    def as_row(self, unit: float = GIB, suffix: str = "_gib") -> dict[str, float]:
        fields = {"parameters": self.parameters, "gradients": self.gradients,
                  "optimizer_state": self.optimizer_state, "activations": self.activations,
                  "buffers": self.buffers, "peak": self.peak}
        return {f"{name}{suffix}": value / unit for name, value in fields.items()}


def training_memory(config: ModelConfig, batch_size: int, seq_len: int, precision: str = "fp32",
                    attention: str = "sdpa", *, strategy: str = "replicated", world_size: int = 1,
                    ddp_buckets: bool = False, fsdp_gathered_weights: int = 3,
                    fsdp_reduce_scatters_in_flight: int = 3, device_type: str = "cuda") -> TrainingMemory:
    """Per-device memory of training with AdamW; `batch_size` is per device.

    FSDP's buffers are `fsdp_gathered_weights` gathered weights in the compute precision (the layer
    in use and those prefetched) and `fsdp_reduce_scatters_in_flight` fp32 full-size gradients
    waiting to be reduce-scattered, each as large as the largest weight.
    """
    check_choice("strategy", strategy, STRATEGIES)
    check_positive_int(batch_size=batch_size, seq_len=seq_len, world_size=world_size,
                       fsdp_gathered_weights=fsdp_gathered_weights,
                       fsdp_reduce_scatters_in_flight=fsdp_reduce_scatters_in_flight)
    activations = (saved_activation_bytes(config, batch_size, seq_len, precision, attention, device_type,
                                          weight_copies=strategy != "fsdp")
                   + 2 * batch_size * seq_len * INDEX_BYTES)
    total = parameter_count(config)
    if strategy == "fsdp":
        local = fsdp_shard_elements(config, world_size) + parameter_counts(config)["norms"]
        largest = max(rows * cols for rows, cols in sharded_weight_shapes(config))
        buffers = largest * (fsdp_gathered_weights * Precision.named(precision).bytes_per_element
                             + fsdp_reduce_scatters_in_flight * FP32_BYTES)
        state_elements = local
    else:
        local = total
        buffers = 0
        state_elements = math.ceil(total / world_size) if strategy == "optimizer_state" else total
    if ddp_buckets:
        if strategy == "fsdp":
            raise ValueError("FSDP reduce-scatters gradients itself; it has no DDP buckets")
        buffers += total * FP32_BYTES
    return TrainingMemory(parameters=local * FP32_BYTES, gradients=local * FP32_BYTES,
                          optimizer_state=state_elements * ADAMW_STATE_PER_PARAMETER * FP32_BYTES,
                          activations=activations, buffers=buffers)
