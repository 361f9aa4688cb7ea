"""The leaderboard's ways to train its model (Spring 2026 handout; cs336_systems.benchmarks.leaderboard times them,
cs336_systems.distributed.equivalence checks them): from all the project's parts to all torch's, one part changed at
a time (VARIANTS), and how each one's trainer is built.

    trainer = build(VARIANTS[OURS_FSDP], ModelConfig(**LEADERBOARD), device, torch.bfloat16, compile=True,
                    chunk_tokens=DEFAULT_CHUNK_TOKENS, checkpointed_blocks=17)
    loss = trainer.step(inputs, targets)

- ours with FSDP: the project's FSDP (cs336_systems.distributed.fsdp: each Linear and Embedding weight
  sharded, gathered layer by layer, the LM head's gathered for the fused loss), its Triton FlashAttention
  op, and the LM head fused with the loss (cs336_systems.linear_cross_entropy), which never holds the
  (tokens, vocabulary) logits; its sharded weights, gradients and AdamW moments leave as much memory for
  activations as torch's fully_shard does, about 37 GiB a GPU more than replicated ones (the estimate);
- ours: the project's bucketed DDP in place of its FSDP (replicated weights, gradients and moments);
- ours with SDPA; then torch FSDP in place of the DDP (torch with the fused loss);
- torch: torch FSDP (fully_shard on every block and the root), SDPA, and the full logits through
  cross-entropy; the strongest composition of torch's own parts that fits in memory: under torch DDP the
  replicated weights, gradients and AdamW moments (61 GiB per GPU in bf16) beside the full-logits loss (46
  GiB at its peak) do not fit in an H200's 141 GB.
All use torch's fused AdamW and, with `compile`, compile each block (regional compilation: one graph serves every
block; our FSDP's sharded layers are opaque ops inside it).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from cs336_systems.distributed import fsdp as our_fsdp
from cs336_systems.distributed.checkpointing import Checkpoint, Plan, apply_checkpointing
from cs336_systems.distributed.ddp import BucketedDDP
from cs336_systems.distributed.training import Trainer, Wrapped, our_ddp, synchronised_fsdp
from cs336_systems.linear_cross_entropy import linear_cross_entropy
from cs336_systems.lm_training import LEARNING_RATE, adamw, build_model, lm_loss
from cs336_systems.model import ModelConfig, TransformerLM
from cs336_systems.rows.leaderboard import OURS, OURS_FSDP, OURS_SDPA, TORCH, TORCH_FUSED_LOSS

DDP, FSDP, OUR_FSDP = "bucketed DDP", "torch FSDP (fully_shard per block)", "our FSDP (gathers layer by layer)"
ATTENTION_LABELS = {"flash_triton": "Triton FlashAttention", "sdpa": "SDPA"}
FUSED, FULL_LOGITS = "LM head fused with the loss", "full logits and cross-entropy"


@dataclass(frozen=True)
class Variant:
    """One way to train the model: how the ranks share the work, the attention, and the loss."""

    parallelism: str  # DDP, FSDP or OUR_FSDP
    attention: str  # a key of ATTENTION_LABELS
    fused_loss: bool

    @property
    def setup(self) -> str:
        return f"{self.parallelism}, {ATTENTION_LABELS[self.attention]}, {FUSED if self.fused_loss else FULL_LOGITS}"


# From all the project's parts to all torch's, one part at a time: each neighbouring pair differs in one.
VARIANTS = {
    OURS_FSDP: Variant(OUR_FSDP, "flash_triton", fused_loss=True),
    OURS: Variant(DDP, "flash_triton", fused_loss=True),
    OURS_SDPA: Variant(DDP, "sdpa", fused_loss=True),
    TORCH_FUSED_LOSS: Variant(FSDP, "sdpa", fused_loss=True),
    TORCH: Variant(FSDP, "sdpa", fused_loss=False),
}
# DDP buckets of 100 MiB: about 160 all-reduces of the 16 GB gradient, each large enough for most of NVLink's
# bandwidth, the last ready soon after backward's last block.
BUCKET_SIZE_MB = 100.0


class LossModel(nn.Module):
    """The LM and its loss as one module, (inputs, targets) -> mean cross-entropy, so that a wrapper's forward
    hooks (FSDP's gathering of the root's weights) run around the loss too: with `fused_loss` the head's
    matmul runs inside linear_cross_entropy, never making the whole logits."""

    def __init__(self, lm: TransformerLM, fused_loss: bool, chunk_tokens: int):
        super().__init__()
        self.lm, self.fused_loss, self.chunk_tokens = lm, fused_loss, chunk_tokens

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if not self.fused_loss:
            return lm_loss(self.lm(inputs), targets)
        return linear_cross_entropy(self.lm.final_hidden(inputs), self.head_weight(), targets,
                                    chunk_tokens=self.chunk_tokens)

    def head_weight(self) -> torch.Tensor:
        """The LM head's weight as the fused loss computes with it; a wrapper that shards the head (our FSDP)
        puts in its place one that gathers it."""
        return self.lm.lm_head.weight


def checkpoint_plan(num_layers: int, checkpointed_blocks: int) -> Plan:
    """The first `checkpointed_blocks` blocks checkpointed one at a time, the rest run plainly: backward meets the
    plain blocks first and frees their activations before it recomputes any checkpointed block."""
    return (*(Checkpoint((block,)) for block in range(checkpointed_blocks)), *range(checkpointed_blocks, num_layers))


def build(variant: Variant, config: ModelConfig, device: torch.device, dtype: torch.dtype, compile: bool,
          chunk_tokens: int, checkpointed_blocks: int, seed: int = 0) -> Trainer:
    """The trainer of `variant`: the model (in `dtype`, the same weights for every seed, its first
    `checkpointed_blocks` blocks checkpointed) wrapped for its parallelism, with fused AdamW."""
    lm = build_model(config, device, variant.attention, dtype=dtype, seed=seed, compile=compile)
    apply_checkpointing(lm, checkpoint_plan(config.num_layers, checkpointed_blocks))
    return Trainer(LossModel(lm, variant.fused_loss, chunk_tokens), functools.partial(_wrap, variant.parallelism),
                   _fused_adamw, _loss)


def _wrap(parallelism: str, model: LossModel) -> Wrapped:
    if parallelism == DDP:
        return our_ddp(model, "bucketed", BUCKET_SIZE_MB)
    if parallelism == OUR_FSDP:
        fsdp = our_fsdp.FSDP(model)
        model.head_weight = functools.partial(fsdp.full_weight, model.lm.lm_head)
        return synchronised_fsdp(fsdp)
    from torch.distributed.fsdp import fully_shard

    for block in model.lm.layers.blocks():
        fully_shard(block)
    fully_shard(model)
    return Wrapped(model)


def _fused_adamw(module: nn.Module) -> torch.optim.Optimizer:
    return adamw(module, LEARNING_RATE, "fused")


def _loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return model(inputs, targets)  # a LossModel, wrapped


def full_gradients(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Once the gradients are finished, collective: the LM's gradients by parameter name, whole (each gathered
    where our FSDP shards it, or torch FSDP holds it as a sharded DTensor)."""
    if isinstance(trainer.module, our_fsdp.FSDP):
        return {name.removeprefix("lm."): grad for name, grad in trainer.module.gather_full_gradients().items()}
    model = trainer.module.module if isinstance(trainer.module, BucketedDDP) else trainer.module
    return {name: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            for name, p in model.lm.named_parameters()}


def flash_source() -> str:
    """The FlashAttention GPU source the rows measured. Imported here, not with the module: the kernels must not
    be imported before a run decides whether they are interpreted (cs336_systems.interpretation)."""
    from cs336_systems.attention.flash_triton import source_hash

    return source_hash()
