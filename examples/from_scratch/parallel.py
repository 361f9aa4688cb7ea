"""Data parallelism from scratch, as the course's handout describes it: DDP that all-reduces each gradient as
backward produces it (OverlappingDDP) or in buckets (BucketedDDP), optimizer state sharding (ShardedOptimizer)
and fully sharded data parallelism (FullyShardedDP).

The rank contract, for every class here: torch.distributed's default process group is initialised before a
wrapper is built, every rank builds the same module and runs the same steps (forward, backward, then
`finish_gradient_synchronization()` before the optimizer's step), and only the batch differs between ranks.
The collectives are issued in the same order on every rank because the steps are the same.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

# bucket_size_mb counts mebibytes, as torch's own DDP counts bucket_cap_mb.
BYTES_PER_MB = 1024 * 1024


def _require_process_group(who: str) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{who} needs torch.distributed's default process group: call "
                           f"torch.distributed.init_process_group(...) on every rank first")


def _broadcast_from_rank_0(module: nn.Module) -> None:
    """Every rank starts from rank 0's parameters and buffers."""
    with torch.no_grad():
        for tensor in itertools.chain(module.parameters(), module.buffers()):
            dist.broadcast(tensor, src=0)


def _all_gather_async(output: torch.Tensor, local: torch.Tensor) -> dist.Work:
    """Every rank's equal-sized `local`, concatenated into `output`. torch 2.13 names the collective
    all_gather_single and warns on the older all_gather_into_tensor, which earlier releases have alone."""
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return all_gather(output, local, async_op=True)


def _reduce_scatter_async(output: torch.Tensor, full: torch.Tensor) -> dist.Work:
    """The sum over ranks of `full`'s rank-th equal part, into `output` (named as _all_gather_async's)."""
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return reduce_scatter(output, full, async_op=True)


def _trainable_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters that get gradients, each once: module.parameters() lists a tied parameter once."""
    return [p for p in module.parameters() if p.requires_grad]


class _GradientReducer:
    """Averages gradients over ranks in buckets: each bucket, a list of parameters, is all-reduced asynchronously
    as one flat tensor once backward has produced its gradients (a parameter's post-accumulate-grad hook runs
    when backward has summed every contribution to its gradient, a tied parameter's included).

    The buckets are issued in one fixed order, each as soon as it and every bucket before it are ready, so that
    every rank issues the same collectives in the same order even where a parameter gets a gradient on some ranks
    only (a branch that some ranks take): finish() issues the buckets still waiting, counting a missing gradient
    as zeros. As torch's DDP does, a parameter that got no gradient on any rank is left without one."""

    def __init__(self, buckets: list[list[nn.Parameter]]):
        self.world_size = dist.get_world_size()
        self.buckets = buckets
        self._ready: set[nn.Parameter] = set()
        self._in_flight: list[tuple[dist.Work, torch.Tensor]] = []  # one per bucket issued, in bucket order
        for bucket in buckets:
            for p in bucket:
                p.register_post_accumulate_grad_hook(self._gradient_ready)

    def _gradient_ready(self, p: nn.Parameter) -> None:
        if p in self._ready:
            raise RuntimeError("a second backward produced a gradient before the first's were reduced: call "
                               "finish_gradient_synchronization() after each backward")
        self._ready.add(p)
        while len(self._in_flight) < len(self.buckets) and self._ready.issuperset(self.buckets[len(self._in_flight)]):
            self._issue_next_bucket()

    def _issue_next_bucket(self) -> None:
        bucket = self.buckets[len(self._in_flight)]
        flat = torch.cat([(p.grad if p in self._ready else torch.zeros_like(p)).reshape(-1) for p in bucket])
        self._in_flight.append((dist.all_reduce(flat, async_op=True), flat))

    def finish(self) -> None:
        while len(self._in_flight) < len(self.buckets):
            self._issue_next_bucket()
        parameters = [p for bucket in self.buckets for p in bucket]
        if not parameters:
            return
        ranks_with_gradient = torch.tensor([p in self._ready for p in parameters], dtype=torch.int32,
                                           device=parameters[0].device)
        dist.all_reduce(ranks_with_gradient)
        got_gradient = iter(ranks_with_gradient.tolist())
        for (work, flat), bucket in zip(self._in_flight, self.buckets):
            work.wait()
            flat.div_(self.world_size)
            for p, averaged in zip(bucket, flat.split([p.numel() for p in bucket])):
                if not next(got_gradient):
                    continue
                if p.grad is None:
                    p.grad = averaged.view_as(p)
                else:
                    p.grad.copy_(averaged.view_as(p))
        self._in_flight.clear()
        self._ready.clear()


class OverlappingDDP(nn.Module):
    """DDP that all-reduces each parameter's gradient during backward, so communication overlaps the rest of
    backward: in reverse parameter order, the order backward usually produces gradients in, each as soon as it
    and the gradients before it in that order are ready."""

    def __init__(self, module: nn.Module):
        super().__init__()
        _require_process_group(type(self).__name__)
        self.module = module
        _broadcast_from_rank_0(module)
        self._reducer = _GradientReducer([[p] for p in reversed(_trainable_parameters(module))])

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        """Wait for every gradient's all-reduce and average: call after backward, before the optimizer step."""
        self._reducer.finish()


def plan_buckets(parameters: list[nn.Parameter], bucket_size_bytes: float) -> list[list[nn.Parameter]]:
    """Consecutive runs of `parameters`, each of at most bucket_size_bytes; a parameter larger than that is a
    bucket of its own. A bucket holds one dtype on one device, since it is reduced as one flat tensor."""
    buckets: list[list[nn.Parameter]] = []
    bucket_bytes = 0
    for p in parameters:
        size = p.numel() * p.element_size()
        fits = buckets and bucket_bytes + size <= bucket_size_bytes
        if not (fits and p.dtype == buckets[-1][0].dtype and p.device == buckets[-1][0].device):
            buckets.append([])
            bucket_bytes = 0
        buckets[-1].append(p)
        bucket_bytes += size
    return buckets


class BucketedDDP(nn.Module):
    """DDP that all-reduces gradients in buckets of at most bucket_size_mb, filled in reverse parameter order
    (backward produces the last layers' gradients first), each bucket as one flat tensor as soon as backward has
    produced its gradients (and those of the buckets before it)."""

    def __init__(self, module: nn.Module, bucket_size_mb: float):
        super().__init__()
        _require_process_group(type(self).__name__)
        if isinstance(bucket_size_mb, bool) or not isinstance(bucket_size_mb, int | float) or not bucket_size_mb > 0:
            raise ValueError(f"bucket_size_mb must be a positive number, got {bucket_size_mb!r}")
        self.module = module
        _broadcast_from_rank_0(module)
        plan = plan_buckets(list(reversed(_trainable_parameters(module))), bucket_size_mb * BYTES_PER_MB)
        self._reducer = _GradientReducer(plan)

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        """Wait for every bucket's all-reduce and average: call after backward, before the optimizer step."""
        self._reducer.finish()


# ------------------------------------------------------------------------------------- optimizer sharding

class ShardedOptimizer(torch.optim.Optimizer):
    """Wraps an optimizer class so that each rank's instance holds only the parameters this rank owns, about
    1/world_size of the parameter bytes and so of the optimizer state; after each step every owner broadcasts
    its parameters' new values to the other ranks.

    Ownership is assigned as parameter groups arrive (the constructor's, then any add_param_group): each
    parameter, largest first, goes to the rank that owns the fewest bytes so far; every rank computes the same
    assignment.
    `state` is this rank's wrapped optimizer's state: the parameters it owns.
    """

    def __init__(self, params, optimizer_cls: type[torch.optim.Optimizer], **kwargs):
        _require_process_group(type(self).__name__)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self._optimizer_cls = optimizer_cls
        self._optimizer_kwargs = kwargs
        self._owner: dict[nn.Parameter, int] = {}
        self._owned_bytes = [0] * self.world_size
        self._local_optimizer: torch.optim.Optimizer | None = None  # built when this rank first owns a parameter
        # (this wrapper's group, the wrapped optimizer's group holding the owned part of it)
        self._local_groups: list[tuple[dict, dict]] = []
        super().__init__(params, defaults=kwargs)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        owned = []
        # Largest first, so that the small parameters even out the ranks' totals.
        for p in sorted(group["params"], key=lambda p: -p.numel() * p.element_size()):
            owner = min(range(self.world_size), key=lambda rank: self._owned_bytes[rank])
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

    @torch.no_grad()
    def step(self, closure=None, **kwargs):
        loss = None
        if self._local_optimizer is not None:
            # Hyperparameters set on this wrapper's groups since (a learning-rate schedule) apply to the owned part.
            for group, local_group in self._local_groups:
                local_group.update({key: value for key, value in group.items() if key != "params"})
            loss = self._local_optimizer.step(closure, **kwargs)
        elif closure is not None:
            with torch.enable_grad():
                loss = closure()
        broadcasts = [dist.broadcast(p, src=owner, async_op=True) for p, owner in self._owner.items()]
        for work in broadcasts:
            work.wait()
        return loss


# ----------------------------------------------------------------------------------------------------- FSDP

def _is_sharded_kind(module: nn.Module) -> bool:
    """Linear and Embedding layers (torch's, or any class of those names, as the course's own are) are sharded."""
    return isinstance(module, nn.Linear | nn.Embedding) or type(module).__name__ in ("Linear", "Embedding")


@dataclass(eq=False)
class _ShardedWeight:
    """One Linear or Embedding weight: flattened, padded to a multiple of the world size, and split evenly;
    `shard` (an fp32 Parameter when the weight was fp32) is this rank's part, the master weight the optimizer
    updates."""

    shape: torch.Size
    numel: int
    shard: nn.Parameter

    @property
    def padded_numel(self) -> int:
        return self.shard.numel() * dist.get_world_size()


class _AllGather:
    """An asynchronous all-gather of a weight's shards, cast to the compute dtype before communicating."""

    def __init__(self, weight: _ShardedWeight, dtype: torch.dtype):
        self.local = weight.shard.detach().to(dtype)
        self.flat = torch.empty(weight.padded_numel, dtype=dtype, device=self.local.device)
        self.work = _all_gather_async(self.flat, self.local)
        self.weight = weight

    def wait(self) -> torch.Tensor:
        """The full weight, a view of the gathered buffer."""
        self.work.wait()
        return self.flat[:self.weight.numel].view(self.weight.shape)


class _GatheredWeight(torch.autograd.Function):
    """The full weight in the forward; in the backward, the full weight's gradient is handed to the FSDP
    wrapper to reduce-scatter, and the shard gets its gradient in finish_gradient_synchronization()."""

    @staticmethod
    def forward(ctx, shard, gather, fsdp):
        ctx.weight, ctx.fsdp = gather.weight, fsdp
        return gather.wait()

    @staticmethod
    def backward(ctx, grad_full):
        ctx.fsdp._reduce_scatter(ctx.weight, grad_full)
        return None, None, None


@dataclass(eq=False)
class _Use:
    """One sharded layer: the weight it reads (two layers share one where weights are tied) and what is in
    flight for it during its forward."""

    module: nn.Module
    weight: _ShardedWeight
    saved_tensors_hooks: torch.autograd.graph.saved_tensors_hooks | None = None


class FullyShardedDP(nn.Module):
    """FSDP over the handout's recipe: every Linear and Embedding weight is sharded across ranks; a layer's
    full weight is all-gathered ahead of its forward (the next layer's gather starts as a layer starts, that is
    once the layer two before it has finished), used, and freed after the forward; backward gathers it again
    where autograd needs it, and its gradient is reduce-scattered and averaged. Other parameters (norms) are
    replicated and their gradients all-reduced.

    With compute_dtype, each shard is cast to it before the all-gather and the layer's floating-point inputs
    are cast to it too; the shards stay fp32 master weights, and their gradients arrive in fp32.
    Parameter names are the wrapped module's: `gather_full_params()` returns the full tensors by those names.
    """

    def __init__(self, module: nn.Module, compute_dtype: torch.dtype | None = None):
        super().__init__()
        _require_process_group(type(self).__name__)
        is_float_dtype = isinstance(compute_dtype, torch.dtype) and compute_dtype.is_floating_point
        if compute_dtype is not None and not is_float_dtype:
            raise ValueError(f"compute_dtype must be a floating-point torch.dtype or None, got {compute_dtype!r}")
        self.module = module
        self.compute_dtype = compute_dtype
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        _broadcast_from_rank_0(module)
        self._uses: list[_Use] = []
        sharded: dict[nn.Parameter, _ShardedWeight] = {}
        for sub in module.modules():
            weight = sub._parameters.get("weight")
            if not (_is_sharded_kind(sub) and isinstance(weight, nn.Parameter)):
                continue
            if weight not in sharded:
                sharded[weight] = self._shard(weight)
            sub._parameters["weight"] = sharded[weight].shard
            self._uses.append(_Use(sub, sharded[weight]))
        self._shards = {w.shard: w for w in sharded.values()}
        for index, use in enumerate(self._uses):
            use.module.register_forward_pre_hook(lambda m, args, index=index: self._before_layer(index, args))
            use.module.register_forward_hook(lambda m, args, out, index=index: self._after_layer(index),
                                             always_call=True)
        replicated = [p for p in _trainable_parameters(module) if p not in self._shards]
        self._replicated_reducer = _GradientReducer([[p] for p in reversed(replicated)])
        self._prefetched: dict[int, _AllGather] = {}
        self._reduce_scatters: list[tuple[dist.Work, torch.Tensor, torch.Tensor, _ShardedWeight]] = []

    def _shard(self, weight: nn.Parameter) -> _ShardedWeight:
        flat = weight.detach().reshape(-1)
        shard_numel = -(-flat.numel() // self.world_size)
        padded = torch.cat([flat, flat.new_zeros(shard_numel * self.world_size - flat.numel())])
        shard = nn.Parameter(padded[self.rank * shard_numel:(self.rank + 1) * shard_numel].clone(),
                             requires_grad=weight.requires_grad)
        return _ShardedWeight(shape=weight.shape, numel=weight.numel(), shard=shard)

    def _gather_dtype(self, weight: _ShardedWeight) -> torch.dtype:
        return self.compute_dtype or weight.shard.dtype

    def _start_gather(self, index: int) -> _AllGather:
        weight = self._uses[index].weight
        return _AllGather(weight, self._gather_dtype(weight))

    def _before_layer(self, index: int, args: tuple):
        use = self._uses[index]
        gather = self._prefetched.pop(index, None) or self._start_gather(index)
        if index + 1 < len(self._uses) and index + 1 not in self._prefetched:
            self._prefetched[index + 1] = self._start_gather(index + 1)
        full = _GatheredWeight.apply(use.weight.shard, gather, self)
        use.module._parameters["weight"] = full
        use.saved_tensors_hooks = self._saved_tensors_hooks(use.weight, full)
        use.saved_tensors_hooks.__enter__()
        if self.compute_dtype is None:
            return None
        return tuple(a.to(self.compute_dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args)

    def _after_layer(self, index: int) -> None:
        use = self._uses[index]
        use.module._parameters["weight"] = use.weight.shard
        if use.saved_tensors_hooks is not None:
            use.saved_tensors_hooks.__exit__(None, None, None)
            use.saved_tensors_hooks = None

    def _saved_tensors_hooks(self, weight: _ShardedWeight, full: torch.Tensor):
        """Autograd keeps, in place of the full weight (or a view of it) that the layer's backward needs, how to
        gather it again; so the full weight is freed after the forward."""
        full_storage = full.untyped_storage().data_ptr()
        dtype = full.dtype

        def pack(tensor):
            if tensor.untyped_storage().data_ptr() != full_storage:
                return tensor
            return (tensor.shape, tensor.stride(), tensor.storage_offset())

        def unpack(packed):
            if torch.is_tensor(packed):
                return packed
            shape, stride, offset = packed
            gathered = _AllGather(weight, dtype)
            gathered.wait()
            return gathered.flat.as_strided(shape, stride, offset)

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def _reduce_scatter(self, weight: _ShardedWeight, grad_full: torch.Tensor) -> None:
        """Start summing the full weight's gradient across ranks into this rank's shard of it, in fp32."""
        flat = grad_full.new_zeros(weight.padded_numel, dtype=torch.float32)
        flat[:weight.numel] = grad_full.reshape(-1)
        shard_grad = flat.new_empty(weight.shard.numel())
        work = _reduce_scatter_async(shard_grad, flat)
        self._reduce_scatters.append((work, shard_grad, flat, weight))

    def forward(self, *inputs, **kwargs):
        try:
            return self.module(*inputs, **kwargs)
        finally:
            self._drop_prefetched()

    def _drop_prefetched(self) -> None:
        """A gather started for a layer the forward did not run next is finished and dropped."""
        for gather in self._prefetched.values():
            gather.work.wait()
        self._prefetched.clear()

    def finish_gradient_synchronization(self) -> None:
        """Wait for the reduce-scatters and all-reduces and average: call after backward, before the optimizer
        step."""
        for work, shard_grad, _, weight in self._reduce_scatters:
            work.wait()
            shard_grad.div_(self.world_size)
            shard = weight.shard
            shard.grad = shard_grad.to(shard.dtype) if shard.grad is None else shard.grad.add_(shard_grad)
        self._reduce_scatters.clear()
        self._replicated_reducer.finish()

    @torch.no_grad()
    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """Every parameter of the wrapped module by its name there: sharded weights all-gathered (fp32 master
        values, a collective every rank must call), replicated ones as they are."""
        full = {}
        for name, p in self.module.named_parameters():
            if p in self._shards:
                weight = self._shards[p]
                full[name] = _AllGather(weight, p.dtype).wait().clone()
            else:
                full[name] = p.detach()
        return full
