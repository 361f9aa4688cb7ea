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

Activation checkpointing. A layer called again in backward (torch.utils.checkpoint recomputing its
region; autograd's engine is running then) repeats the forward call still waiting for its backward,
the latest first, and takes that call's place in the orders above: it is not a new call. It gathers
ahead the calls that follow it in forward while they still wait for their backward (the recomputed
region ends where backward has already been), and it keeps its gathered weight for the call's
backward, which comes once the region is recomputed: a recomputed layer is gathered twice a step, as
a plain one is, and a recomputed region holds its layers' weights gathered until their backward.

Weights used directly. Code that computes with a sharded layer's weight itself instead of calling the
layer (a loss fused with the LM head takes the head's weight) asks for it with `full_weight(layer)`:
gathered as a call of the layer, its gradient reduce-scattered into the shard as the layer's would be.

torch.compile. Inside a compiled region (each Transformer block compiled on its own, say) a sharded
Linear is a pair of opaque `torch.library` ops (forward; backward), which run the same scheduling
and collectives as the eager layer, so that the compiler keeps the block in one graph around them and
every block of the same code shares that graph. A compiled op finds its layer by its shard (ops take
tensors, not Python objects). Two cases run the eager layer instead, at a graph break: an Embedding,
and a Linear whose input needs no gradient while its weight does (the backward op returns the input's
gradient, and a compiled graph drops an op whose outputs nothing uses, the reduce-scatter with it).

Contract. Every rank must call the same sharded layers in the same order (collectives pair up by
order, as with torch FSDP). Only exactly `Linear` and `Embedding` layers are sharded (a subclass
might compute differently), and a weight may not be shared between layers.
"""

from __future__ import annotations

import functools
import itertools
import math
import weakref
from collections import deque
from collections.abc import Iterator

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
        self.scheduler: weakref.ref | None = None  # set by FSDP, for the compiled ops (_owner)

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
        # This forward's calls whose backward has not run yet, as indices into `calls` by weight.
        self.awaiting_backward: dict[_ShardedWeight, list[int]] = {}
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

    def begin_forward(self) -> None:
        self.calls = []
        self.awaiting_backward = {}

    def weight_for_forward(self, weight: _ShardedWeight, used_in_backward: bool,
                           backward_follows: bool) -> tuple[torch.Tensor, int, bool]:
        """The full weight of this call, after starting the gathers of the next calls; the call's
        index in this forward pass; and whether the caller keeps the gathered weight after the call
        (a recomputed call whose backward uses it) instead of freeing it. `backward_follows`: the
        call's backward will run (it has an input or a weight that needs a gradient)."""
        awaiting = self.awaiting_backward.get(weight)
        if awaiting and _in_backward():  # recomputed by activation checkpointing (module docstring)
            index = awaiting[-1]
            region = itertools.takewhile(self._awaits_backward, range(index + 1, len(self.calls)))
            weight.start_gather()
            for later in itertools.islice(region, self.prefetch_layers):
                self.calls[later][0].start_gather()
            return weight.full(), index, self.calls[index][1]
        index = len(self.calls)
        self.calls.append((weight, used_in_backward))
        if backward_follows:
            self.awaiting_backward.setdefault(weight, []).append(index)
        weight.start_gather()
        for upcoming in self.forward_order[index + 1:index + 1 + self.prefetch_layers]:
            upcoming.start_gather()
        return weight.full(), index, False

    def _awaits_backward(self, index: int) -> bool:
        return index in self.awaiting_backward.get(self.calls[index][0], ())

    def latest_awaiting(self, weight: _ShardedWeight) -> int:
        """The index of `weight`'s latest call still waiting for its backward: the one a backward of
        the weight that does not know its call is for (backward runs calls latest first)."""
        awaiting = self.awaiting_backward.get(weight)
        if not awaiting:
            raise RuntimeError(f"FSDP: a backward of {weight.name} with no call of this forward waiting for it")
        return awaiting[-1]

    def backward_order_before(self, index: int) -> Iterator[_ShardedWeight]:
        """The weights backward will need after call `index`'s, nearest first: the earlier calls that
        use their weight in backward and have not run it yet."""
        return (self.calls[i][0] for i in range(index - 1, -1, -1) if self.calls[i][1] and self._awaits_backward(i))

    def weight_for_backward(self, weight: _ShardedWeight, index: int) -> torch.Tensor:
        weight.start_gather()
        for upcoming in itertools.islice(self.backward_order_before(index), self.prefetch_layers):
            upcoming.start_gather()
        return weight.full()

    def end_backward(self, weight: _ShardedWeight, index: int) -> None:
        """Call `index`'s backward has run."""
        awaiting = self.awaiting_backward.get(weight)
        if awaiting and index in awaiting:  # absent after a later forward began
            awaiting.remove(index)

    def end_forward(self, grad_enabled: bool) -> None:
        self.forward_order = [w for w, _ in self.calls]
        if grad_enabled:
            for upcoming in itertools.islice(self.backward_order_before(len(self.calls)), self.prefetch_layers):
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


def _in_backward() -> bool:
    """Whether autograd's engine is running a backward pass on this thread (torch's fully_shard asks
    the same to tell a recomputed forward)."""
    return torch._C._current_graph_task_id() != -1


def _linear_backward(grad_y: torch.Tensor, x: torch.Tensor, weight: _ShardedWeight, scheduler: _Scheduler,
                     index: int, want_input: bool, want_weight: bool) -> torch.Tensor | None:
    """Call `index`'s backward: the input's gradient in x's dtype (None unless `want_input`), after
    starting the reduce-scatter of the weight's gradient (if `want_weight`)."""
    full = scheduler.weight_for_backward(weight, index) if want_input else None
    grad_x = grad_weight = None
    with annotate(f"fsdp::backward {weight.name}"):
        grad_y = grad_y.to(x.dtype)
        if full is not None:
            grad_x = grad_y @ full.to(x.dtype)
        if want_weight:
            grad_weight = grad_y.reshape(-1, grad_y.shape[-1]).T @ x.reshape(-1, x.shape[-1])
    weight.free()
    scheduler.end_backward(weight, index)
    if grad_weight is not None:
        scheduler.reduce_scatter(weight, grad_weight)
    return grad_x


class _ShardedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shard, weight: _ShardedWeight, scheduler: _Scheduler):
        full, ctx.index, keep = scheduler.weight_for_forward(weight, used_in_backward=ctx.needs_input_grad[0],
                                                             backward_follows=any(ctx.needs_input_grad[:2]))
        with annotate(f"fsdp::forward {weight.name}"):
            dtype = scheduler.matmul_dtype(x.device.type)
            ctx.input_dtype = x.dtype
            if dtype is not None:
                x, full = x.to(dtype), full.to(dtype)
            with torch.autocast(x.device.type, enabled=False):  # the dtype is chosen above
                y = F.linear(x, full)
        if not keep:
            weight.free()
        ctx.save_for_backward(x)
        ctx.weight, ctx.scheduler = weight, scheduler
        return y

    @staticmethod
    def backward(ctx, grad_y):
        (x,) = ctx.saved_tensors
        grad_x = _linear_backward(grad_y, x, ctx.weight, ctx.scheduler, ctx.index, *ctx.needs_input_grad[:2])
        return None if grad_x is None else grad_x.to(ctx.input_dtype), None, None, None


class _ShardedEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, token_ids, shard, weight: _ShardedWeight, scheduler: _Scheduler):
        full, ctx.index, _ = scheduler.weight_for_forward(weight, used_in_backward=False,
                                                          backward_follows=ctx.needs_input_grad[1])
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
        scheduler.end_backward(weight, ctx.index)
        scheduler.reduce_scatter(weight, grad_weight)
        return None, None, None, None


class _FullWeight(torch.autograd.Function):
    """A sharded layer's whole weight, for code that computes with it directly (FSDP.full_weight)."""

    @staticmethod
    def forward(ctx, shard, weight: _ShardedWeight, scheduler: _Scheduler):
        full, ctx.index, _ = scheduler.weight_for_forward(weight, used_in_backward=False,
                                                          backward_follows=ctx.needs_input_grad[0])
        weight.free()  # the caller's reference is then the only one: the copy goes when the caller is done with it
        ctx.weight, ctx.scheduler = weight, scheduler
        return full

    @staticmethod
    def backward(ctx, grad_full):
        ctx.scheduler.end_backward(ctx.weight, ctx.index)
        ctx.scheduler.reduce_scatter(ctx.weight, grad_full)
        return None, None, None


# ------------------------------------------------------------------------------ inside torch.compile

LINEAR_OP, LINEAR_BACKWARD_OP = "cs336_systems::fsdp_linear", "cs336_systems::fsdp_linear_backward"
# Every live FSDP layer's weight, and a cache of them by their shard's address: a compiled op is handed the
# shard's storage under another tensor object (the graph passes its inputs on detached), so it finds its
# layer by the address. Weak, so that neither keeps an FSDP alive.
_LIVE_WEIGHTS: weakref.WeakSet[_ShardedWeight] = weakref.WeakSet()
_WEIGHT_AT: dict[int, weakref.ref] = {}


def _owner(shard: torch.Tensor) -> tuple[_ShardedWeight, _Scheduler]:
    address = shard.data_ptr()
    entry = _WEIGHT_AT.get(address)
    weight = entry() if entry is not None else None
    if weight is None or weight.shard.data_ptr() != address:  # new, or moved since (module.to(), say)
        _WEIGHT_AT.clear()
        _WEIGHT_AT.update((live.shard.data_ptr(), weakref.ref(live)) for live in _LIVE_WEIGHTS)
        entry = _WEIGHT_AT.get(address)
        weight = entry() if entry is not None else None
    scheduler = weight.scheduler() if weight is not None else None
    if scheduler is None:
        raise RuntimeError(f"{LINEAR_OP} was given a tensor that is not the shard of a live FSDP layer")
    return weight, scheduler


@torch.library.custom_op(LINEAR_OP, mutates_args=())
def _linear_op(x: torch.Tensor, shard: torch.Tensor, out_features: int, backward_follows: bool) -> torch.Tensor:
    """A sharded Linear's call in a compiled graph, in x's dtype: the eager layer's forward."""
    weight, scheduler = _owner(shard)
    full, _, keep = scheduler.weight_for_forward(weight, used_in_backward=backward_follows,
                                                 backward_follows=backward_follows)
    with annotate(f"fsdp::forward {weight.name}"):
        with torch.autocast(x.device.type, enabled=False):
            y = F.linear(x, full.to(x.dtype))
    if not keep:
        weight.free()
    return y


@_linear_op.register_fake
def _linear_op_fake(x, shard, out_features, backward_follows):
    return x.new_empty((*x.shape[:-1], out_features))


@torch.library.custom_op(LINEAR_BACKWARD_OP, mutates_args=())
def _linear_backward_op(grad_y: torch.Tensor, x: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
    """The input's gradient of a compiled call, after the eager layer's gathers and reduce-scatter; for the
    latest call of the layer still waiting for its backward (the op cannot carry the call's index)."""
    weight, scheduler = _owner(shard)
    return _linear_backward(grad_y, x, weight, scheduler, scheduler.latest_awaiting(weight), want_input=True,
                            want_weight=weight.shard.requires_grad)


@_linear_backward_op.register_fake
def _linear_backward_op_fake(grad_y, x, shard):
    return x.new_empty(x.shape)  # contiguous, as the matmul's result is whatever x's strides


def _linear_op_setup_context(ctx, inputs, output) -> None:
    x, shard, _, _ = inputs
    ctx.save_for_backward(x, shard)


def _linear_op_backward(ctx, grad_y):
    x, shard = ctx.saved_tensors
    return _linear_backward_op(grad_y, x, shard), None, None, None


_linear_op.register_autograd(_linear_op_backward, setup_context=_linear_op_setup_context)


@torch.compiler.disable
def _eager_call(function: type[torch.autograd.Function], x: torch.Tensor, weight: _ShardedWeight,
                scheduler: _Scheduler) -> torch.Tensor:
    """The eager layer, at a graph break, for the calls the compiled op does not take (module docstring)."""
    return function.apply(x, weight.shard, weight, scheduler)


def _compiled_linear(x: torch.Tensor, weight: _ShardedWeight, scheduler: _Scheduler) -> torch.Tensor:
    """A sharded Linear's call as torch.compile traces it: the op, its input cast to the matmul dtype here
    (so that the graph saves the cast input and casts the input's gradient back), where it computes as
    the eager layer does; the eager layer otherwise."""
    backward_follows = torch.is_grad_enabled() and (x.requires_grad or weight.shard.requires_grad)
    dtype = scheduler.matmul_dtype(x.device.type)
    if (backward_follows and not x.requires_grad) or (dtype is None and x.dtype != weight.gather_dtype):
        return _eager_call(_ShardedLinear, x, weight, scheduler)  # the latter raises the eager layer's error
    if dtype is not None:
        x = x.to(dtype)
    return _linear_op(x, weight.shard, weight.shape[0], backward_follows)


def _sharded_forward(function: type[torch.autograd.Function], weight: _ShardedWeight, scheduler: _Scheduler):
    linear = function is _ShardedLinear  # decided here: torch.compile cannot compare Function classes

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            return function.apply(x, weight.shard, weight, scheduler)
        if linear:
            return _compiled_linear(x, weight, scheduler)
        return _eager_call(function, x, weight, scheduler)

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
            weight.scheduler = weakref.ref(self.scheduler)
            _LIVE_WEIGHTS.add(weight)
        self._weight_of_layer = {id(weight.layer): weight for weight in self.weights}
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
        self.scheduler.begin_forward()
        output = self.module(*args, **kwargs)
        self.scheduler.end_forward(torch.is_grad_enabled())
        return output

    def full_weight(self, layer: nn.Module) -> torch.Tensor:
        """The whole weight of `layer`, a layer this FSDP shards, for code that computes with the weight
        itself instead of calling the layer (a loss fused with the LM head), inside this wrapper's forward:
        gathered in the gather dtype as a call of the layer, its gradient reduce-scattered into the shard."""
        weight = self._weight_of_layer.get(id(layer))
        if weight is None:
            raise ValueError(f"full_weight needs a layer this FSDP shards, got a {type(layer).__name__} it does not")
        return _FullWeight.apply(weight.shard, weight, self.scheduler)

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
        return {name: _whole(by_shard.get(id(p)), p) for name, p in self.module.named_parameters()}

    @torch.no_grad()
    def gather_full_gradients(self) -> dict[str, torch.Tensor | None]:
        """Collective, after finish_gradient_synchronization(): every parameter's gradient by name, as
        gather_full_params gives the parameters (None for a parameter without one, on every rank alike)."""
        by_shard = {id(w.shard): w for w in self.weights}
        return {name: None if p.grad is None else _whole(by_shard.get(id(p)), p.grad)
                for name, p in self.module.named_parameters()}


def _whole(weight: _ShardedWeight | None, tensor: torch.Tensor) -> torch.Tensor:
    """Collective where `weight` is not None: `tensor` (a shard, or its gradient) all-gathered to the
    weight's shape; a copy of `tensor` (a replicated parameter or gradient) otherwise."""
    if weight is None:
        return tensor.detach().clone()
    buffer = torch.empty(weight.padded_numel, dtype=tensor.dtype, device=tensor.device)
    _all_gather(buffer, tensor.detach())
    return buffer[:weight.numel].view(weight.shape)


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
