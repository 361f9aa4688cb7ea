"""Bucketed DDP that fails on a parameter without a gradient (a layer the forward did not use): a bucket issued
after backward concatenates its gradients as they are, None included. A copy of
examples/from_scratch/parallel.py's reducer's _issue_next_bucket without the zeros standing in for a missing
gradient."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from examples.from_scratch import parallel


class _NoneGradientReducer(parallel._GradientReducer):
    def _issue_next_bucket(self) -> None:
        bucket = self.buckets[len(self._in_flight)]
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])  # the bug: None for a parameter without a gradient
        self._in_flight.append((dist.all_reduce(flat, async_op=True), flat))


class NoneGradientDDP(parallel.BucketedDDP):
    def __init__(self, module: nn.Module, bucket_size_mb: float):
        nn.Module.__init__(self)
        parallel._require_process_group(type(self).__name__)
        self.module = module
        parallel._broadcast_from_rank_0(module)
        plan = parallel.plan_buckets(list(reversed(parallel._trainable_parameters(module))),
                                     bucket_size_mb * parallel.BYTES_PER_MB)
        self._reducer = _NoneGradientReducer(plan)


def get_ddp_bucketed(module: nn.Module, bucket_size_mb: float) -> nn.Module:
    return NoneGradientDDP(module, bucket_size_mb)


def ddp_bucketed_on_after_backward(ddp_model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    ddp_model.finish_gradient_synchronization()


def ddp_bucketed_on_train_batch_start(ddp_model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    pass
