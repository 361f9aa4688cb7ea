"""Bucketed DDP that ignores bucket_size_mb: its buckets are always of 25 MB. A copy of
examples/from_scratch/parallel.py's BucketedDDP.__init__ that plans with a constant instead."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from examples.from_scratch import parallel

FIXED_BUCKET_SIZE_MB = 25


class FixedBucketDDP(parallel.BucketedDDP):
    def __init__(self, module: nn.Module, bucket_size_mb: float):
        nn.Module.__init__(self)
        parallel._require_process_group(type(self).__name__)
        self.module = module
        self.world_size = dist.get_world_size()
        parallel._broadcast_from_rank_0(module)
        # the bug: FIXED_BUCKET_SIZE_MB where bucket_size_mb belongs
        plan = parallel.plan_buckets(parallel._trainable_parameters(module)[::-1],
                                     FIXED_BUCKET_SIZE_MB * parallel.BYTES_PER_MB)
        self.buckets = [parallel._Bucket(parameters) for parameters in plan]
        for bucket in self.buckets:
            for p in bucket.parameters:
                p.register_post_accumulate_grad_hook(lambda p, bucket=bucket: self._gradient_ready(bucket))


def get_ddp_bucketed(module: nn.Module, bucket_size_mb: float) -> nn.Module:
    return FixedBucketDDP(module, bucket_size_mb)


def ddp_bucketed_on_after_backward(ddp_model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    ddp_model.finish_gradient_synchronization()


def ddp_bucketed_on_train_batch_start(ddp_model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    pass
