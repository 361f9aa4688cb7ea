"""FSDP whose shards are views of full-size copies of the weights, which they keep alive at rest: its training
is right, its memory that of unsharded weights (and then some). A copy of
examples/from_scratch/parallel.py's FullyShardedDP._shard without the clone of this rank's part."""

from __future__ import annotations

import torch
from torch import nn

from examples.from_scratch import parallel


class FullWeightsFSDP(parallel.FullyShardedDP):
    def _shard(self, weight: nn.Parameter) -> parallel._ShardedWeight:
        flat = weight.detach().reshape(-1)
        shard_numel = -(-flat.numel() // self.world_size)
        padded = torch.cat([flat, flat.new_zeros(shard_numel * self.world_size - flat.numel())])
        # the bug: a view of `padded`, the whole weight, where a copy of this rank's part belongs
        shard = nn.Parameter(padded[self.rank * shard_numel:(self.rank + 1) * shard_numel],
                             requires_grad=weight.requires_grad)
        return parallel._ShardedWeight(shape=weight.shape, numel=weight.numel(), shard=shard)


def get_fsdp(module: nn.Module, compute_dtype: torch.dtype | None = None) -> nn.Module:
    return FullWeightsFSDP(module, compute_dtype=compute_dtype)


def fsdp_on_after_backward(fsdp_model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    fsdp_model.finish_gradient_synchronization()


def fsdp_gather_full_params(fsdp_model: nn.Module) -> dict[str, torch.Tensor]:
    return fsdp_model.gather_full_params()
