"""DDP whose parameters() lists a weight shared by two layers once under each layer's name: an optimizer built
on the wrapper holds that weight twice and updates it twice a step. Its gradients are right, and so is its
communication. A copy of examples/from_scratch/parallel.py's OverlappingDDP with a parameters() that lists the
wrapped module's parameters as named_parameters(remove_duplicate=False) does."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from examples.from_scratch import parallel


class EveryNameDDP(parallel.OverlappingDDP):
    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        # the bug: a tied weight is listed under each of its names, so the optimizer steps it once for each
        return (p for _, p in self.module.named_parameters(remove_duplicate=False))


def get_ddp_individual_parameters(module: nn.Module) -> nn.Module:
    return EveryNameDDP(module)


def ddp_individual_parameters_on_after_backward(ddp_model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    ddp_model.finish_gradient_synchronization()
