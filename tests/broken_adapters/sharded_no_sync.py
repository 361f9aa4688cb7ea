"""A sharded optimizer that does not synchronise parameters after its step: each rank updates the parameters
it owns, and the others keep their old values there. A copy of examples/from_scratch/parallel.py's
ShardedOptimizer.step without the broadcasts."""

from __future__ import annotations

import torch

from examples.from_scratch import parallel


class UnsynchronisedOptimizer(parallel.ShardedOptimizer):
    @torch.no_grad()
    def step(self, closure=None, **kwargs):
        loss = None
        if self._local_optimizer is not None:
            for group, local_group in self._local_groups:
                local_group.update({key: value for key, value in group.items() if key != "params"})
            loss = self._local_optimizer.step(closure, **kwargs)
        elif closure is not None:
            with torch.enable_grad():
                loss = closure()
        return loss  # the bug: no owner broadcasts its updated parameters


def get_sharded_optimizer(params, optimizer_cls: type[torch.optim.Optimizer], **kwargs) -> torch.optim.Optimizer:
    return UnsynchronisedOptimizer(params, optimizer_cls, **kwargs)
