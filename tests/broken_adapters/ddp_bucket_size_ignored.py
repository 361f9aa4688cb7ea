"""Bucketed DDP that ignores bucket_size_mb: its buckets are always of 25 MB. A copy of
examples/from_scratch/parallel.py's BucketedDDP.__init__ that plans with a constant instead."""

from __future__ import annotations

import torch
from torch import nn

from examples.from_scratch import parallel

FIXED_BUCKET_SIZE_MB = 25


class FixedBucketDDP(parallel.BucketedDDP):
    def __init__(self, module: nn.Module, bucket_size_mb: float):
        nn.Module.__init__(self)
        parallel._require_process_group(type(self).__name__)
        self.module = module
        parallel._broadcast_from_rank_0(module)
        # the bug: FIXED_BUCKET_SIZE_MB where bucket_size_mb belongs
        plan = parallel.plan_buckets(list(reversed(parallel._trainable_parameters(module))),
                                     FIXED_BUCKET_SIZE_MB * parallel.BYTES_PER_MB)
        self._reducer = parallel._GradientReducer(plan)


def get_ddp_bucketed(module: nn.Module, bucket_size_mb: float) -> nn.Module:
    return FixedBucketDDP(module, bucket_size_mb)


def ddp_bucketed_on_after_backward(ddp_model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    ddp_model.finish_gradient_synchronization()


def ddp_bucketed_on_train_batch_start(ddp_model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    pass
