"""FSDP that starts the first layer's all-gather for the next forward as soon as a backward's gradients are
synchronised, to overlap it with the optimizer step; but that step is what updates the shard. From the second
step on, each forward uses the first layer's weight from before the last step. A copy of
examples/from_scratch/parallel.py's FullyShardedDP.finish_gradient_synchronization that prefetches the gather
there."""

from __future__ import annotations

import torch
from torch import nn

from examples.from_scratch import parallel


class EarlyPrefetchFSDP(parallel.FullyShardedDP):
    def finish_gradient_synchronization(self) -> None:
        for work, shard_grad, _, weight in self._reduce_scatters:
            work.wait()
            shard_grad.div_(self.world_size)
            shard = weight.shard
            shard.grad = shard_grad.to(shard.dtype) if shard.grad is None else shard.grad.add_(shard_grad)
        self._reduce_scatters.clear()
        self._replicated_reducer.finish()
        self._prefetched[0] = self._start_gather(0)  # the bug: gathered before the optimizer step updates it


def get_fsdp(module: nn.Module, compute_dtype: torch.dtype | None = None) -> nn.Module:
    return EarlyPrefetchFSDP(module, compute_dtype=compute_dtype)


def fsdp_on_after_backward(fsdp_model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    fsdp_model.finish_gradient_synchronization()


def fsdp_gather_full_params(fsdp_model: nn.Module) -> dict[str, torch.Tensor]:
    return fsdp_model.gather_full_params()
