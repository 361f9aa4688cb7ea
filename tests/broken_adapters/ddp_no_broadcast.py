"""DDP that does not broadcast rank 0's parameters when built: each rank trains from its own initial model. A
copy of examples/from_scratch/parallel.py's OverlappingDDP.__init__ without the broadcast."""

from __future__ import annotations

import torch
from torch import nn

from examples.from_scratch import parallel


class UnbroadcastDDP(parallel.OverlappingDDP):
    def __init__(self, module: nn.Module):
        nn.Module.__init__(self)
        parallel._require_process_group(type(self).__name__)
        self.module = module  # the bug: no _broadcast_from_rank_0(module)
        self._reducer = parallel._GradientReducer([[p] for p in reversed(parallel._trainable_parameters(module))])


def get_ddp(module: nn.Module) -> nn.Module:
    return UnbroadcastDDP(module)


def ddp_on_after_backward(ddp_model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    ddp_model.finish_gradient_synchronization()
