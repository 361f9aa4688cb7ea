"""Fully sharded data parallel (ZeRO stage 3) for the Linear and Embedding weights of a model.

    model = FSDP(TransformerLM(config).to(device), compute_dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)    # updates the fp32 shards
    loss_fn(model(batch), targets).backward()
    model.finish_gradient_synchronization()   # before the step, or the step raises
    optimizer.step()

Sharding. Every `Linear` and `Embedding` weight is flattened, padded with zeros to a multiple of
the world size and cut into equal shards; rank r keeps shard r, in the weight's own dtype (fp32:
the master weight), as a Parameter that takes the weight's place under the same name. So
`module.named_parameters()` lists the shards, an optimizer built on `parameters()` updates them,
and each rank holds ~1/world_size of those weights, their gradients and their optimizer state.
Other parameters (RMSNorm weights) stay whole on every rank, their gradients averaged over ranks.
Rank 0's parameters and buffers are broadcast first, so every rank shards the same model (a rank
whose model differs in a parameter's or buffer's name, shape or dtype makes every rank raise).

Forward. A sharded layer runs through an autograd Function that all-gathers its weight (each shard
cast to `compute_dtype` before the all-gather, so the traffic is in the compute dtype), computes,
and drops the gathered weight. Autograd saves the layer's input only, never the full weight.

Backward. A Linear all-gathers its weight again (an Embedding's gradient needs none), computes the
input and weight gradients and drops the weight; the weight gradient, cast to the master dtype
(fp32), is reduce-scattered asynchronously so that each rank receives the sum of its shard, which
is divided by the world size. At most `REDUCE_SCATTERS_IN_FLIGHT` of them are left running, so full-size gradients do not
pile up; `finish_gradient_synchronization()` waits for the rest, averages the replicated
gradients and must run before the optimizer step: a step over the model's parameters between a
backward and finish raises (`guard_optimizer_steps`), where it would use shards whose gradient is
missing or stale, and replicated gradients that are each rank's own.

Prefetch. All-gathers run ahead of the layers that need them, to overlap with compute, in the
order the previous forward pass called the layers (module order for the first one): when a layer
starts its forward, the gathers of the next `prefetch_layers` layers are started, so a weight is
gathered at most two layers ahead, and at most `prefetch_layers + 1` gathered weights are alive.
Backward prefetches in the reverse order; the end of forward starts the first gathers of backward.
A forward first drops the copies an earlier forward gathered for a backward that never came (a
forward with gradients on, for a metric, say): an optimizer step may have changed their shards since.

Mixed precision. With `compute_dtype`, a layer computes in that dtype (its input cast to it) while
master weights, the gradients the optimizer sees and the updates stay in the weights' dtype.
Without it, a layer follows autocast when autocast is on (computing in autocast's dtype), else it
computes in the dtypes it is given, as the unwrapped layer would.

Contract. Every rank must call the same sharded layers in the same order (collectives pair up by
order, as with torch FSDP). Only exactly `Linear` and `Embedding` layers are sharded (a subclass
might compute differently), and a weight may not be shared between layers.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections import deque

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cs336_systems.distributed.ddp import (
    broadcast_from_rank0,
    guard_optimizer_steps,
    require_dense_gradient,
    write_back_gradient,
)
from cs336_systems.distributed.launch import require_process_group
from cs336_systems.model import Embedding, Linear
from cs336_systems.profiling.ranges import annotate

SHARDED_LAYER_TYPES = (Linear, Embedding)
# A gather may start at most two layers before its weight is used: enough to hide it behind the
# compute of the layers in between, while keeping at most three gathered weights alive.
MAX_PREFETCH_LAYERS = 2
# Reduce-scatters left running in backward; each holds a full-size fp32 gradient until it is done.
REDUCE_SCATTERS_IN_FLIGHT = 2

# torch 2.13 renamed all_gather_into_tensor and reduce_scatter_tensor (and deprecates the old
# names); earlier releases have only the old ones. Same collectives under either name.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _ShardedWeight:
    """One layer's weight: this rank's shard (the Parameter) and, while in use, the full weight."""

    def __init__(self, name: str, layer: nn.Module, rank: int, world_size: int,
                 compute_dtype: torch.dtype | None):
        weight = layer.weight
        self.name = name
        self.layer = layer
        self.shape = weight.shape
        self.numel = weight.numel()
        self.shard_numel = math.ceil(self.numel / world_size)
        self.padded_numel = self.shard_numel * world_size
        self.gather_dtype = compute_dtype or weight.dtype
        start = rank * self.shard_numel
        own = weight.detach().reshape(-1)[start:start + self.shard_numel]
        shard = torch.zeros(self.shard_numel, dtype=weight.dtype, device=weight.device)
        shard[:own.numel()] = own  # the last shards end in padding
        self.shard = nn.Parameter(shard, requires_grad=weight.requires_grad)
        self._pending = None  # (work, output buffer, input) of an all-gather in flight
        self._full: torch.Tensor | None = None

    @property
    def in_memory(self) -> bool:
        """Whether a gathered copy exists or is being gathered."""
        return self._full is not None or self._pending is not None

    def start_gather(self) -> None:
        if self.in_memory:
            return
        send = self.shard.detach().to(self.gather_dtype)
        buffer = torch.empty(self.padded_numel, dtype=self.gather_dtype, device=send.device)
        # The range holds the collective alone, so that on a GPU trace it spans just its kernel.
        with annotate(f"fsdp::all_gather {self.name}"):
            self._pending = (_all_gather(buffer, send, async_op=True), buffer, send)

    def full(self) -> torch.Tensor:
        """The full weight in the gather dtype, gathering it now unless that was started earlier."""
        self.start_gather()
        if self._pending is not None:
            work, buffer, _ = self._pending
            work.wait()
            self._pending = None
            self._full = buffer[:self.numel].view(self.shape)
        return self._full

    def free(self) -> None:
        """Drop the gathered copy; a gather in flight is waited for first (its buffers are in use)."""
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None
        self._full = None


class _Scheduler:
    """Orders the all-gathers of one FSDP model and collects its reduce-scatters."""

    def __init__(self, weights: list[_ShardedWeight], world_size: int, compute_dtype: torch.dtype | None,
                 prefetch_layers: int):
        self.weights = weights
        self.world_size = world_size
        self.compute_dtype = compute_dtype
        self.prefetch_layers = prefetch_layers
        self.forward_order = list(weights)  # the previous forward's calls; module order at first
        self.calls: list[tuple[_ShardedWeight, bool]] = []  # this forward's: (weight, used in backward)
        self.reductions: deque = deque()
        # Set by a backward that produced any gradient (a reduce-scatter started, or a replicated
        # gradient accumulated); cleared by FSDP.finish_gradient_synchronization().
        self.has_unsynchronised_gradients = False

    def matmul_dtype(self, device_type: str) -> torch.dtype | None:
        if self.compute_dtype is not None:
            return self.compute_dtype
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
        return None

    def weight_for_forward(self, weight: _ShardedWeight, used_in_backward: bool) -> tuple[torch.Tensor, int]:
        """The full weight of this call, after starting the gathers of the next calls; and the
        call's index in this forward pass."""
        index = len(self.calls)
        self.calls.append((weight, used_in_backward))
        weight.start_gather()
        for upcoming in self.forward_order[index + 1:index + 1 + self.prefetch_layers]:
            upcoming.start_gather()
        return weight.full(), index

    def backward_order_before(self, index: int) -> list[_ShardedWeight]:
        """The weights backward will need after call `index`'s, nearest first."""
        return [w for w, used in reversed(self.calls[:index]) if used]

    def weight_for_backward(self, weight: _ShardedWeight, index: int) -> torch.Tensor:
        weight.start_gather()
        for upcoming in self.backward_order_before(index)[:self.prefetch_layers]:
            upcoming.start_gather()
        return weight.full()

    def end_forward(self, grad_enabled: bool) -> None:
        self.forward_order = [w for w, _ in self.calls]
        if grad_enabled:
            for upcoming in self.backward_order_before(len(self.calls))[:self.prefetch_layers]:
                upcoming.start_gather()

    def reduce_scatter(self, weight: _ShardedWeight, gradient: torch.Tensor) -> None:
        """Start summing this rank's shard of `gradient` (the full weight's) over ranks."""
        self.has_unsynchronised_gradients = True
        flat = gradient.reshape(-1).to(weight.shard.dtype)  # no copy for an fp32 gradient
        if weight.padded_numel > weight.numel:
            flat = torch.cat([flat, flat.new_zeros(weight.padded_numel - weight.numel)])
        shard_gradient = torch.empty(weight.shard_numel, dtype=flat.dtype, device=flat.device)
        with annotate(f"fsdp::reduce_scatter {weight.name}"):
            work = _reduce_scatter(shard_gradient, flat, async_op=True)
        self.reductions.append((work, weight, shard_gradient, flat))
        while len(self.reductions) > REDUCE_SCATTERS_IN_FLIGHT:
            self.finish_reduction()

    def finish_reduction(self) -> None:
        work, weight, shard_gradient, _ = self.reductions.popleft()
        work.wait()
        shard_gradient.div_(self.world_size)
        if weight.shard.grad is None:
            weight.shard.grad = shard_gradient
        else:
            weight.shard.grad += shard_gradient


class _ShardedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shard, weight: _ShardedWeight, scheduler: _Scheduler):
        full, ctx.index = scheduler.weight_for_forward(weight, used_in_backward=ctx.needs_input_grad[0])
        with annotate(f"fsdp::forward {weight.name}"):
            dtype = scheduler.matmul_dtype(x.device.type)
            ctx.input_dtype = x.dtype
            if dtype is not None:
                x, full = x.to(dtype), full.to(dtype)
            with torch.autocast(x.device.type, enabled=False):  # the dtype is chosen above
                y = F.linear(x, full)
        weight.free()
        ctx.save_for_backward(x)
        ctx.weight, ctx.scheduler = weight, scheduler
        return y

    @staticmethod
    def backward(ctx, grad_y):
        (x,) = ctx.saved_tensors
        weight, scheduler = ctx.weight, ctx.scheduler
        full = scheduler.weight_for_backward(weight, ctx.index) if ctx.needs_input_grad[0] else None
        grad_x = grad_weight = None
        with annotate(f"fsdp::backward {weight.name}"):
            grad_y = grad_y.to(x.dtype)
            if full is not None:
                grad_x = (grad_y @ full.to(x.dtype)).to(ctx.input_dtype)
            if ctx.needs_input_grad[1]:
                grad_weight = grad_y.reshape(-1, grad_y.shape[-1]).T @ x.reshape(-1, x.shape[-1])
        weight.free()
        if grad_weight is not None:
            scheduler.reduce_scatter(weight, grad_weight)
        return grad_x, None, None, None


class _ShardedEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, token_ids, shard, weight: _ShardedWeight, scheduler: _Scheduler):
        full, ctx.index = scheduler.weight_for_forward(weight, used_in_backward=False)
        with annotate(f"fsdp::forward {weight.name}"):
            y = full[token_ids]
        weight.free()
        ctx.save_for_backward(token_ids)
        ctx.weight, ctx.scheduler = weight, scheduler
        return y

    @staticmethod
    def backward(ctx, grad_y):
        (token_ids,) = ctx.saved_tensors
        weight, scheduler = ctx.weight, ctx.scheduler
        with annotate(f"fsdp::backward {weight.name}"):
            # What indexing's backward does: rows of grad_y summed into the rows they came from.
            grad_weight = torch.zeros(weight.shape, dtype=grad_y.dtype, device=grad_y.device)
            grad_weight.index_put_((token_ids.reshape(-1),), grad_y.reshape(-1, grad_y.shape[-1]), accumulate=True)
        scheduler.reduce_scatter(weight, grad_weight)
        return None, None, None, None


def _sharded_forward(function: type[torch.autograd.Function], weight: _ShardedWeight, scheduler: _Scheduler):
    def forward(x: torch.Tensor) -> torch.Tensor:
        return function.apply(x, weight.shard, weight, scheduler)

    return forward


class FSDP(nn.Module):
    """Shards `module`'s Linear and Embedding weights over the ranks of the default process group."""

    def __init__(self, module: nn.Module, compute_dtype: torch.dtype | None = None,
                 prefetch_layers: int = MAX_PREFETCH_LAYERS):
        super().__init__()
        require_process_group("FSDP")
        if not isinstance(module, nn.Module):
            raise TypeError(f"FSDP wraps a torch.nn.Module, got {type(module).__name__}")
        floating = isinstance(compute_dtype, torch.dtype) and compute_dtype.is_floating_point
        if compute_dtype is not None and not floating:
            raise TypeError(f"compute_dtype must be a floating-point torch.dtype or None, got {compute_dtype!r}")
        if isinstance(prefetch_layers, bool) or not isinstance(prefetch_layers, int) or \
                not 0 <= prefetch_layers <= MAX_PREFETCH_LAYERS:
            raise ValueError(f"prefetch_layers must be an int from 0 to {MAX_PREFETCH_LAYERS}, got {prefetch_layers!r}")
        self.module = module
        self.compute_dtype = compute_dtype
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        layers = [(name, layer) for name, layer in module.named_modules(remove_duplicate=False)
                  if type(layer) in SHARDED_LAYER_TYPES]
        _check_not_shared(module, layers)
        broadcast_from_rank0(module, "FSDP")
        self.weights = [_ShardedWeight(name, layer, self.rank, self.world_size, compute_dtype)
                        for name, layer in layers]
        self.scheduler = _Scheduler(self.weights, self.world_size, compute_dtype, prefetch_layers)
        for weight in self.weights:
            weight.layer.weight = weight.shard
            function = _ShardedLinear if isinstance(weight.layer, Linear) else _ShardedEmbedding
            weight.layer.forward = _sharded_forward(function, weight, self.scheduler)
        sharded = {id(w.shard) for w in self.weights}
        self.replicated = {name: p for name, p in module.named_parameters() if id(p) not in sharded}
        # The shards' gradients bypass autograd's accumulation (the reduce-scatters mark them), the
        # replicated ones do not: a hook marks those, so that a backward that produced only replicated
        # gradients counts too. Weak, as in DDP: a parameter's hooks must not keep the wrapper alive.
        wrapper = weakref.ref(self)
        for p in self.replicated.values():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(functools.partial(_replicated_gradient_hook, wrapper))
        guard_optimizer_steps(self)

    @property
    def has_unsynchronised_gradients(self) -> bool:
        """Whether a backward produced gradients that finish_gradient_synchronization() has not
        synchronised yet; an optimizer step over the model's parameters raises while it is true."""
        return self.scheduler.has_unsynchronised_gradients

    def forward(self, *args, **kwargs):
        for weight in self.weights:
            weight.free()  # gathered by an earlier forward for a backward that did not follow
        self.scheduler.calls = []
        output = self.module(*args, **kwargs)
        self.scheduler.end_forward(torch.is_grad_enabled())
        return output

    def finish_gradient_synchronization(self) -> None:
        """After backward, before the optimizer step: wait for the reduce-scatters, average the
        replicated gradients, and drop gathered weights (the step is about to change the shards)."""
        while self.scheduler.reductions:
            self.scheduler.finish_reduction()
        self._average_replicated_gradients()
        for weight in self.weights:
            weight.free()
        self.scheduler.has_unsynchronised_gradients = False

    @torch.no_grad()
    def _average_replicated_gradients(self) -> None:
        """One all-reduce per dtype of every replicated gradient and a has-gradient flag each: a
        parameter no rank produced a gradient for keeps None, as in single-process training."""
        if self.world_size == 1:
            return
        by_dtype: dict[tuple, list[nn.Parameter]] = {}
        for name, p in self.replicated.items():
            if p.grad is not None:
                require_dense_gradient("FSDP", name, p.grad)
            if p.requires_grad:
                by_dtype.setdefault((p.dtype, p.device), []).append(p)
        for (dtype, device), params in by_dtype.items():
            flags = torch.tensor([p.grad is not None for p in params], dtype=dtype, device=device)
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
                             + [flags])
            dist.all_reduce(flat)
            *summed, ranks_with_gradient = flat.split([*(p.numel() for p in params), len(params)])
            for p, gradient, ranks in zip(params, summed, ranks_with_gradient.tolist()):
                # A new .grad is a copy: a view would keep the whole flat tensor alive.
                write_back_gradient(p, gradient.view_as(p), self.world_size, had_gradient=p.grad is not None,
                                    used_anywhere=ranks > 0, copy=True)

    @torch.no_grad()
    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """Collective: every parameter of the wrapped module by name, sharded ones all-gathered to
        their original shape and dtype (the master weights, not the compute dtype)."""
        by_shard = {id(w.shard): w for w in self.weights}
        full = {}
        for name, p in self.module.named_parameters():
            weight = by_shard.get(id(p))
            if weight is None:
                full[name] = p.detach().clone()
                continue
            buffer = torch.empty(weight.padded_numel, dtype=p.dtype, device=p.device)
            _all_gather(buffer, p.detach())
            full[name] = buffer[:weight.numel].view(weight.shape)
        return full


def _replicated_gradient_hook(wrapper: weakref.ref, param: torch.Tensor) -> None:
    alive = wrapper()
    if alive is not None:
        alive.scheduler.has_unsynchronised_gradients = True


def _check_not_shared(module: nn.Module, layers: list[tuple[str, nn.Module]]) -> None:
    """A weight shared with another layer (tied embeddings) would be sharded twice: refuse it."""
    owners: dict[int, list[str]] = {}
    for name, layer in module.named_modules(remove_duplicate=False):
        for param_name, p in layer.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append(f"{name}.{param_name}" if name else param_name)
    for name, layer in layers:
        users = owners[id(layer.weight)]
        if len(users) > 1:
            raise ValueError(f"FSDP shards each Linear/Embedding weight on its own, but {name}.weight is shared "
                             f"({', '.join(users)}); tied weights are not supported")
