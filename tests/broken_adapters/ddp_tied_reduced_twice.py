"""Bucketed DDP that reduces a weight shared by two layers twice a step, once under each name: the result is
right, the communication for it doubled. A copy of examples/from_scratch/parallel.py's BucketedDDP.__init__
that lists the parameters with named_parameters(remove_duplicate=False), beside a copy of its reducer's
__init__ that hooks each distinct parameter once (the original, hooking a tied one twice, would refuse its
second hook as a second backward)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from examples.from_scratch import parallel


class _OneHookEachReducer(parallel._GradientReducer):
    def __init__(self, buckets: list[list[nn.Parameter]]):
        self.world_size = dist.get_world_size()
        self.buckets = buckets
        self._ready: set[nn.Parameter] = set()
        self._in_flight: list[tuple[dist.Work, torch.Tensor]] = []
        for p in dict.fromkeys(p for bucket in buckets for p in bucket):
            p.register_post_accumulate_grad_hook(self._gradient_ready)


class TiedTwiceDDP(parallel.BucketedDDP):
    def __init__(self, module: nn.Module, bucket_size_mb: float):
        nn.Module.__init__(self)
        parallel._require_process_group(type(self).__name__)
        self.module = module
        parallel._broadcast_from_rank_0(module)
        # the bug: a tied parameter is listed under each of its names
        trainable = [p for _, p in module.named_parameters(remove_duplicate=False) if p.requires_grad]
        plan = parallel.plan_buckets(list(reversed(trainable)), bucket_size_mb * parallel.BYTES_PER_MB)
        self._reducer = _OneHookEachReducer(plan)


def get_ddp_bucketed(module: nn.Module, bucket_size_mb: float) -> nn.Module:
    return TiedTwiceDDP(module, bucket_size_mb)


def ddp_bucketed_on_after_backward(ddp_model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    ddp_model.finish_gradient_synchronization()


def ddp_bucketed_on_train_batch_start(ddp_model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    pass
