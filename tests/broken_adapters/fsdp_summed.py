"""FSDP whose gradients are summed over ranks, not averaged: the reduce-scatter's sums reach the shards as
they are. A copy of examples/from_scratch/parallel.py's FullyShardedDP.finish_gradient_synchronization without
the division by the world size."""

from __future__ import annotations

import torch
from torch import nn

from examples.from_scratch import parallel


class SummingFSDP(parallel.FullyShardedDP):
    def finish_gradient_synchronization(self) -> None:
        for work, shard_grad, _, weight in self._reduce_scatters:
            work.wait()  # the bug: no shard_grad.div_(self.world_size)
            shard = weight.shard
            shard.grad = shard_grad.to(shard.dtype) if shard.grad is None else shard.grad.add_(shard_grad)
        self._reduce_scatters.clear()
        self._replicated_reducer.finish()


def get_fsdp(module: nn.Module, compute_dtype: torch.dtype | None = None) -> nn.Module:
    return SummingFSDP(module, compute_dtype=compute_dtype)


def fsdp_on_after_backward(fsdp_model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    fsdp_model.finish_gradient_synchronization()


def fsdp_gather_full_params(fsdp_model: nn.Module) -> dict[str, torch.Tensor]:
    return fsdp_model.gather_full_params()
