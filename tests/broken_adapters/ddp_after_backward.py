"""DDP that all-reduces only after backward: the gradients are averaged, but communication never overlaps
backward. A copy of examples/from_scratch/parallel.py's OverlappingDDP whose reducer's hook only notes a
gradient as ready; its all-reduces all start in finish_gradient_synchronization()."""

from __future__ import annotations

import torch
from torch import nn

from examples.from_scratch import parallel


class _AfterBackwardReducer(parallel._GradientReducer):
    def _gradient_ready(self, p: nn.Parameter) -> None:
        if p in self._ready:
            raise RuntimeError("a second backward produced a gradient before the first's were reduced: call "
                               "finish_gradient_synchronization() after each backward")
        self._ready.add(p)  # the bug: no bucket is issued here, finish() issues them all


class AfterBackwardDDP(parallel.OverlappingDDP):
    def __init__(self, module: nn.Module):
        nn.Module.__init__(self)
        parallel._require_process_group(type(self).__name__)
        self.module = module
        parallel._broadcast_from_rank_0(module)
        self._reducer = _AfterBackwardReducer([[p] for p in reversed(parallel._trainable_parameters(module))])


def get_ddp_individual_parameters(module: nn.Module) -> nn.Module:
    return AfterBackwardDDP(module)


def ddp_individual_parameters_on_after_backward(ddp_model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    ddp_model.finish_gradient_synchronization()


def get_ddp(module: nn.Module) -> nn.Module:
    return AfterBackwardDDP(module)


def ddp_on_after_backward(ddp_model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    ddp_model.finish_gradient_synchronization()
