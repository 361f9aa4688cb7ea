"""Bucketed DDP whose last bucket, the partial one that holds the first parameters, is never reduced: its
gradients stay each rank's own. A copy of examples/from_scratch/parallel.py's BucketedDDP.__init__ that hands
its reducer every bucket but the last."""

from __future__ import annotations

import torch
from torch import nn

from examples.from_scratch import parallel


class DroppedLastBucketDDP(parallel.BucketedDDP):
    def __init__(self, module: nn.Module, bucket_size_mb: float):
        nn.Module.__init__(self)
        parallel._require_process_group(type(self).__name__)
        self.module = module
        parallel._broadcast_from_rank_0(module)
        plan = parallel.plan_buckets(list(reversed(parallel._trainable_parameters(module))),
                                     bucket_size_mb * parallel.BYTES_PER_MB)
        self._reducer = parallel._GradientReducer(plan[:-1])  # the bug: the last bucket is left out


def get_ddp_bucketed(module: nn.Module, bucket_size_mb: float) -> nn.Module:
    return DroppedLastBucketDDP(module, bucket_size_mb)


def ddp_bucketed_on_after_backward(ddp_model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    ddp_model.finish_gradient_synchronization()


def ddp_bucketed_on_train_batch_start(ddp_model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    pass
