"""A "sharded" optimizer that keeps every parameter's state on every rank: its training is right, its memory
that of the unsharded optimizer. A copy of examples/from_scratch/parallel.py's
ShardedOptimizer.add_param_group that hands every parameter to this rank's optimizer, not only those it owns."""

from __future__ import annotations

import torch

from examples.from_scratch import parallel


class UnshardedStateOptimizer(parallel.ShardedOptimizer):
    def add_param_group(self, param_group: dict) -> None:
        torch.optim.Optimizer.add_param_group(self, param_group)
        group = self.param_groups[-1]
        owned = []
        for p in sorted(group["params"], key=lambda p: -p.numel() * p.element_size()):
            owner = min(range(self.world_size), key=lambda rank: self._owned_bytes[rank])
            self._owner[p] = owner
            self._owned_bytes[owner] += p.numel() * p.element_size()
            owned.append(p)  # the bug: every parameter, owned here or not
        if not owned:
            return
        local_group = {key: value for key, value in group.items() if key != "params"} | {"params": owned}
        if self._local_optimizer is None:
            self._local_optimizer = self._optimizer_cls([local_group], **self._optimizer_kwargs)
            self.state = self._local_optimizer.state
        else:
            self._local_optimizer.add_param_group(local_group)
        self._local_groups.append((group, self._local_optimizer.param_groups[-1]))


def get_sharded_optimizer(params, optimizer_cls: type[torch.optim.Optimizer], **kwargs) -> torch.optim.Optimizer:
    return UnshardedStateOptimizer(params, optimizer_cls, **kwargs)
