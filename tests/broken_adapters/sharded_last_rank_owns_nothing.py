"""A sharded optimizer whose ownership assignment leaves out the last rank (an off-by-one in the ranks it picks
from): its training is right, but the last rank keeps no optimizer state and the others keep its share. A copy
of examples/from_scratch/parallel.py's ShardedOptimizer.add_param_group that picks owners among ranks 0 to
world_size - 2."""

from __future__ import annotations

import torch

from examples.from_scratch import parallel


class LastRankIdleOptimizer(parallel.ShardedOptimizer):
    def add_param_group(self, param_group: dict) -> None:
        torch.optim.Optimizer.add_param_group(self, param_group)
        group = self.param_groups[-1]
        owned = []
        for p in sorted(group["params"], key=lambda p: -p.numel() * p.element_size()):
            # the bug: range(self.world_size - 1), which never picks the last rank
            owner = min(range(self.world_size - 1), key=lambda rank: self._owned_bytes[rank])
            self._owner[p] = owner
            self._owned_bytes[owner] += p.numel() * p.element_size()
            if owner == self.rank:
                owned.append(p)
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
    return LastRankIdleOptimizer(params, optimizer_cls, **kwargs)
