"""FSDP that lets autograd keep each gathered weight for backward: every full weight stays alive from its
layer's forward until backward, where the handout frees it after use and gathers it again. A copy of
examples/from_scratch/parallel.py's FullyShardedDP._before_layer without the saved-tensors hooks."""

from __future__ import annotations

import torch
from torch import nn

from examples.from_scratch import parallel


class SavedWeightsFSDP(parallel.FullyShardedDP):
    def _before_layer(self, index: int, args: tuple):
        use = self._uses[index]
        gather = self._prefetched.pop(index, None) or self._start_gather(index)
        if index + 1 < len(self._uses) and index + 1 not in self._prefetched:
            self._prefetched[index + 1] = self._start_gather(index + 1)
        full = parallel._GatheredWeight.apply(use.weight.shard, gather, self)
        use.module._parameters["weight"] = full  # the bug: no saved-tensors hooks, so autograd keeps `full`
        if self.compute_dtype is None:
            return None
        return tuple(a.to(self.compute_dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args)


def get_fsdp(module: nn.Module, compute_dtype: torch.dtype | None = None) -> nn.Module:
    return SavedWeightsFSDP(module, compute_dtype=compute_dtype)


def fsdp_on_after_backward(fsdp_model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    fsdp_model.finish_gradient_synchronization()


def fsdp_gather_full_params(fsdp_model: nn.Module) -> dict[str, torch.Tensor]:
    return fsdp_model.gather_full_params()
