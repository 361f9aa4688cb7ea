"""FSDP that, given a compute dtype, keeps its shards in it: with compute_dtype=bf16 the master weights the
optimizer updates are bf16, and an update smaller than a bf16 weight's rounding step is lost. A copy of
examples/from_scratch/parallel.py's FullyShardedDP._shard that casts each shard to the compute dtype."""

from __future__ import annotations

import torch
from torch import nn

from examples.from_scratch import parallel


class BF16MasterFSDP(parallel.FullyShardedDP):
    def _shard(self, weight: nn.Parameter) -> parallel._ShardedWeight:
        flat = weight.detach().reshape(-1)
        shard_numel = -(-flat.numel() // self.world_size)
        padded = torch.cat([flat, flat.new_zeros(shard_numel * self.world_size - flat.numel())])
        # the bug: cast to the compute dtype, where the master weight belongs in the weight's own
        part = padded[self.rank * shard_numel:(self.rank + 1) * shard_numel].to(self.compute_dtype or weight.dtype)
        shard = nn.Parameter(part.clone(), requires_grad=weight.requires_grad)
        return parallel._ShardedWeight(shape=weight.shape, numel=weight.numel(), shard=shard)


def get_fsdp(module: nn.Module, compute_dtype: torch.dtype | None = None) -> nn.Module:
    return BF16MasterFSDP(module, compute_dtype=compute_dtype)


def fsdp_on_after_backward(fsdp_model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    fsdp_model.finish_gradient_synchronization()


def fsdp_gather_full_params(fsdp_model: nn.Module) -> dict[str, torch.Tensor]:
    return fsdp_model.gather_full_params()
