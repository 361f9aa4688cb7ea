"""A sharded optimizer that builds each rank's wrapped optimizer once, from the groups it was constructed with:
a group added later with add_param_group joins the wrapper's param_groups but reaches no rank's optimizer, so
its parameters are never updated. A copy of examples/from_scratch/parallel.py's ShardedOptimizer whose
add_param_group, once construction is over, is torch.optim.Optimizer's alone."""

from __future__ import annotations

import torch

from examples.from_scratch import parallel


class BuiltOnceOptimizer(parallel.ShardedOptimizer):
    def __init__(self, params, optimizer_cls: type[torch.optim.Optimizer], **kwargs):
        self._constructed = False
        super().__init__(params, optimizer_cls, **kwargs)
        self._constructed = True

    def add_param_group(self, param_group: dict) -> None:
        if self._constructed:
            torch.optim.Optimizer.add_param_group(self, param_group)  # the bug: no owner, no wrapped optimizer
            return
        super().add_param_group(param_group)


def get_sharded_optimizer(params, optimizer_cls: type[torch.optim.Optimizer], **kwargs) -> torch.optim.Optimizer:
    return BuiltOnceOptimizer(params, optimizer_cls, **kwargs)
