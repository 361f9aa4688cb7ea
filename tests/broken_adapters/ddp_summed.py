"""DDP whose gradients are summed over ranks, not averaged. A copy of examples/from_scratch/parallel.py's
OverlappingDDP whose reducer's finish() leaves out the division by the world size."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from examples.from_scratch import parallel


class _SummingReducer(parallel._GradientReducer):
    def finish(self) -> None:
        while len(self._in_flight) < len(self.buckets):
            self._issue_next_bucket()
        parameters = [p for bucket in self.buckets for p in bucket]
        if not parameters:
            return
        ranks_with_gradient = torch.tensor([p in self._ready for p in parameters], dtype=torch.int32,
                                           device=parameters[0].device)
        dist.all_reduce(ranks_with_gradient)
        got_gradient = iter(ranks_with_gradient.tolist())
        for (work, flat), bucket in zip(self._in_flight, self.buckets):
            work.wait()  # the bug: no flat.div_(self.world_size)
            for p, summed in zip(bucket, flat.split([p.numel() for p in bucket])):
                if not next(got_gradient):
                    continue
                if p.grad is None:
                    p.grad = summed.view_as(p)
                else:
                    p.grad.copy_(summed.view_as(p))
        self._in_flight.clear()
        self._ready.clear()


class SummingDDP(parallel.OverlappingDDP):
    def __init__(self, module: nn.Module):
        nn.Module.__init__(self)
        parallel._require_process_group(type(self).__name__)
        self.module = module
        parallel._broadcast_from_rank_0(module)
        self._reducer = _SummingReducer([[p] for p in reversed(parallel._trainable_parameters(module))])


def get_ddp_individual_parameters(module: nn.Module) -> nn.Module:
    return SummingDDP(module)


def ddp_individual_parameters_on_after_backward(ddp_model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    ddp_model.finish_gradient_synchronization()
