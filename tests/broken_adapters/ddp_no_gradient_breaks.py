"""Bucketed DDP that fails on a parameter without a gradient (a layer the forward did not use): a bucket
reduced after backward concatenates its gradients as they are, None included. A copy of
examples/from_scratch/parallel.py's BucketedDDP._all_reduce without the zeros standing in for a missing
gradient."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from examples.from_scratch import parallel


class NoneGradientDDP(parallel.BucketedDDP):
    def _all_reduce(self, bucket: parallel._Bucket) -> None:
        gradients = [p.grad for p in bucket.parameters]  # the bug: None for a parameter without a gradient
        bucket.flat_gradients = torch.cat([g.reshape(-1) for g in gradients])
        bucket.work = dist.all_reduce(bucket.flat_gradients, async_op=True)


def get_ddp_bucketed(module: nn.Module, bucket_size_mb: float) -> nn.Module:
    return NoneGradientDDP(module, bucket_size_mb)


def ddp_bucketed_on_after_backward(ddp_model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    ddp_model.finish_gradient_synchronization()


def ddp_bucketed_on_train_batch_start(ddp_model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    pass
