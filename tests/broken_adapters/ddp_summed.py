"""DDP whose gradients are summed over ranks, not averaged. A copy of examples/from_scratch/parallel.py's
OverlappingDDP whose finish_gradient_synchronization() leaves out the division by the world size."""

from __future__ import annotations

import torch
from torch import nn

from examples.from_scratch import parallel


class _SummingReducer(parallel._GradientAllReducer):
    def finish(self) -> None:
        for work, _ in self._in_flight:
            work.wait()  # the bug: no p.grad.div_(self.world_size)
        self._in_flight.clear()


class SummingDDP(parallel.OverlappingDDP):
    def __init__(self, module: nn.Module):
        nn.Module.__init__(self)
        parallel._require_process_group(type(self).__name__)
        self.module = module
        parallel._broadcast_from_rank_0(module)
        self._reducer = _SummingReducer(parallel._trainable_parameters(module))


def get_ddp_individual_parameters(module: nn.Module) -> nn.Module:
    return SummingDDP(module)


def ddp_individual_parameters_on_after_backward(ddp_model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    ddp_model.finish_gradient_synchronization()
