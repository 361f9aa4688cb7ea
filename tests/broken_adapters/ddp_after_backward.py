"""DDP that all-reduces only after backward: the gradients are averaged, but communication never overlaps
backward. A copy of examples/from_scratch/parallel.py's OverlappingDDP whose hook only notes the gradient; the
all-reduces start in finish_gradient_synchronization()."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from examples.from_scratch import parallel


class _AfterBackwardReducer(parallel._GradientAllReducer):
    def _all_reduce(self, p: nn.Parameter) -> None:
        self._in_flight.append((None, p))  # the bug: the all-reduce waits for finish()

    def finish(self) -> None:
        works = [(dist.all_reduce(p.grad, async_op=True), p) for _, p in self._in_flight]
        for work, p in works:
            work.wait()
            p.grad.div_(self.world_size)
        self._in_flight.clear()


class AfterBackwardDDP(parallel.OverlappingDDP):
    def __init__(self, module: nn.Module):
        nn.Module.__init__(self)
        parallel._require_process_group(type(self).__name__)
        self.module = module
        parallel._broadcast_from_rank_0(module)
        self._reducer = _AfterBackwardReducer(parallel._trainable_parameters(module))


def get_ddp_individual_parameters(module: nn.Module) -> nn.Module:
    return AfterBackwardDDP(module)


def ddp_individual_parameters_on_after_backward(ddp_model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    ddp_model.finish_gradient_synchronization()


def get_ddp(module: nn.Module) -> nn.Module:
    return AfterBackwardDDP(module)


def ddp_on_after_backward(ddp_model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    ddp_model.finish_gradient_synchronization()
