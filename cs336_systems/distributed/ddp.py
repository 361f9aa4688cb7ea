"""Distributed data parallel, four ways, each wrapping an unchanged module.

    model = BucketedDDP(model, bucket_size_mb=25)
    for batch in batches:
        model.on_train_batch_start()
        loss_fn(model(batch.x), batch.y).backward()
        model.finish_gradient_synchronization()   # gradients are now averaged over ranks
        optimizer.step(); optimizer.zero_grad()

An optimizer step over the model's parameters after a backward and before
finish_gradient_synchronization() raises (see `guard_optimizer_steps`): it would use each rank's own
gradients, or gradients with an all-reduce still in flight on them.

Each rank trains on its own rows of the step's batch, batch[batch_shard(len(batch), rank, world_size)]:
averaging the ranks' gradients then gives the whole batch's.

NaiveDDP            after backward, one blocking all-reduce per parameter.
FlatDDP             after backward, one all-reduce of all gradients flattened into one tensor.
OverlapIndividualDDP  during backward, an asynchronous all-reduce per parameter, started by a hook
                    as soon as that parameter's gradient is accumulated.
BucketedDDP         during backward, an asynchronous all-reduce per bucket of at most
                    bucket_size_mb, started as soon as the bucket's last gradient is ready.

All four broadcast rank 0's parameters and buffers when built (every rank starts from the same
model), average gradients, communicate a tied parameter once, and leave parameters with
requires_grad=False alone. Naive, flat and overlap-individual average inside the all-reduce on
NCCL (ReduceOp.AVG), which saves a pass over every gradient after communication; gloo has no AVG,
so there it is a SUM divided by the world size. Bucketed sums and divides while it copies the
buckets back into .grad, a pass it makes anyway. Each writes the result back into .grad through
`write_back_gradient`.

Every rank must issue the same collectives in the same order, or the job hangs. Two rules keep
that true when a parameter gets no gradient in a step (a branch not taken, on some ranks or all):
  - the overlapped wrappers launch their units (a parameter, or a bucket) in one fixed order, a
    unit only after every unit before it, and finish_gradient_synchronization launches the units
    that never became ready, with zeros standing in for the missing gradients;
  - after the gradients, one small all-reduce counts on how many ranks each parameter had a
    gradient. A parameter with none anywhere keeps its .grad untouched (None stays None, so an
    optimizer skips it exactly as in single-process training); one with a gradient somewhere gets
    the average, in which ranks without one contributed zeros.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from cs336_systems.checks import check_positive_finite
from cs336_systems.distributed.launch import require_process_group, require_same_on_every_rank

# bucket_size_mb counts mebibytes, as torch DDP's bucket_cap_mb does.
BYTES_PER_MB = 2**20

# The live wrappers every optimizer step is checked against (`guard_optimizer_steps`). Weak: the
# registry must never keep a wrapper, its module or its gradients alive.
_GUARDED_WRAPPERS: weakref.WeakSet = weakref.WeakSet()
_step_pre_hook: RemovableHandle | None = None  # registered with the first wrapper, not at import


def broadcast_from_rank0(module: nn.Module, what: str) -> None:
    """Overwrite every parameter and buffer of `module` with rank 0's values, once every rank is
    known to hold the same ones (by name, shape, dtype and requires_grad): `what`'s error otherwise."""
    named = list(itertools.chain(module.named_parameters(), module.named_buffers()))
    require_same_on_every_rank(f"{what}'s module (name, shape, dtype, requires_grad of each parameter and buffer)",
                               [(name, tuple(t.shape), str(t.dtype), t.requires_grad) for name, t in named])
    with torch.no_grad():
        for _, tensor in named:
            dist.broadcast(tensor, src=0)


def guard_optimizer_steps(wrapper: nn.Module) -> None:
    """Make an optimizer step over any of `wrapper`'s parameters raise while
    `wrapper.has_unsynchronised_gradients` is true: a backward produced gradients that
    finish_gradient_synchronization() has not averaged yet.

    Forgetting finish would otherwise be a silent wrong answer: the step would use each rank's own
    gradients (the ranks' models drift apart), or gradients that a collective is still writing. At
    forward time a missing finish cannot be told from gradient accumulation (backward, backward,
    finish); at the step it is unambiguous. One global optimizer step pre-hook checks every wrapper;
    an optimizer over other parameters (another model in the process) is left alone.
    """
    global _step_pre_hook
    if _step_pre_hook is None:
        _step_pre_hook = register_optimizer_step_pre_hook(_refuse_unsynchronised_step)
    _GUARDED_WRAPPERS.add(wrapper)


def _refuse_unsynchronised_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    # The usual step finds every wrapper synchronised: a flag per live wrapper, nothing more.
    unsynchronised = [wrapper for wrapper in _GUARDED_WRAPPERS if wrapper.has_unsynchronised_gradients]
    if not unsynchronised:
        return
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for wrapper in unsynchronised:
        if any(id(p) in stepped for p in wrapper.parameters()):
            raise RuntimeError(
                f"{type(wrapper).__name__}: optimizer.step() after a backward whose gradients were not "
                "synchronised; call finish_gradient_synchronization() after backward and before the step")


def require_dense_gradient(what: str, name: str, gradient: torch.Tensor) -> None:
    """Refuse a sparse gradient where `what` packs gradients into one flat, dense tensor."""
    if gradient.layout != torch.strided:
        raise TypeError(f"{what} packs gradients into flat dense tensors, which the {gradient.layout} gradient of "
                        f"{name} cannot join (an nn.Embedding(sparse=True)?); give that layer dense gradients")


def batch_shard(batch_size: int, rank: int, world_size: int) -> slice:
    """This rank's rows of a batch split evenly over `world_size` ranks.

    Averaging the ranks' gradients of their mean losses gives the whole batch's gradient only when
    every rank has as many rows as the others (uneven shards would weigh a row by one over its shard's
    size), so a batch that does not split evenly is refused.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not one of the {world_size} ranks")
    if batch_size % world_size:
        raise ValueError(f"a batch of {batch_size} does not split evenly over {world_size} ranks; use a multiple "
                         f"of {world_size} (uneven shards do not average to the whole batch's gradient)")
    rows = batch_size // world_size
    return slice(rank * rows, (rank + 1) * rows)


def write_back_gradient(param: torch.Tensor, reduced: torch.Tensor, summed_over: int, *, had_gradient: bool,
                        used_anywhere: bool, copy: bool = False) -> None:
    """Make `reduced`, the all-reduce of `param`'s gradient (param's shape; zeros where this rank had
    none), param's averaged .grad, dividing it by `summed_over` on the way (1 where the all-reduce
    averaged already):
      - into the .grad this rank had (in place when `reduced` is that .grad);
      - where only other ranks had one, as a new .grad: `reduced` itself, or with `copy` a copy, for a
        view of a buffer that is reused next step or holds more than this gradient;
      - a parameter no rank had a gradient for keeps its .grad None, as in single-process training.
    """
    if had_gradient:
        averaged = param.grad
    elif used_anywhere:
        averaged = param.grad = torch.empty_like(reduced) if copy else reduced
    else:
        return
    if summed_over != 1:
        torch.div(reduced, summed_over, out=averaged)  # one pass, in place where averaged is reduced
    elif averaged is not reduced:
        averaged.copy_(reduced)


def assign_buckets(sizes_bytes: Sequence[int], bucket_size_bytes: float,
                   kinds: Sequence[Hashable] | None = None) -> list[list[int]]:
    """Group parameters 0..n-1 into buckets for all-reduce; returns lists of parameter indices.

    Parameters are walked in reverse order, the order backward roughly produces their gradients,
    and packed greedily: a bucket closes when the next parameter would take it past
    `bucket_size_bytes`, so a bucket is over the limit only when one parameter alone is. A bucket
    also closes where `kinds` (e.g. (dtype, device)) changes, since one flat buffer holds one kind.
    """
    if not bucket_size_bytes > 0:
        raise ValueError(f"bucket size must be positive, got {bucket_size_bytes} bytes")
    if kinds is not None and len(kinds) != len(sizes_bytes):
        raise ValueError(f"got {len(kinds)} kinds for {len(sizes_bytes)} sizes")
    buckets: list[list[int]] = []
    current: list[int] = []
    current_bytes = 0
    for index in reversed(range(len(sizes_bytes))):
        kind_changed = kinds is not None and current and kinds[index] != kinds[current[-1]]
        if current and (current_bytes + sizes_bytes[index] > bucket_size_bytes or kind_changed):
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(index)
        current_bytes += sizes_bytes[index]
    if current:
        buckets.append(current)
    return buckets


def _gradient_ready_hook(wrapper: weakref.ref, index: int, param: torch.Tensor) -> None:
    alive = wrapper()
    if alive is not None:
        alive._on_gradient_ready(index, param)


class _DataParallel(nn.Module):
    """What the four wrappers share: construction, forward, a post-accumulate-grad hook per trained
    parameter, the optimizer-step guard, and the gradient-count bookkeeping."""

    def __init__(self, module: nn.Module):
        if not isinstance(module, nn.Module):
            raise TypeError(f"{type(self).__name__} wraps a torch.nn.Module, got {type(module).__name__}")
        require_process_group(type(self).__name__)
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        self._reduce_op = dist.ReduceOp.AVG if dist.get_backend() == "nccl" else dist.ReduceOp.SUM
        # parameters() yields a tied parameter once, so it is communicated once.
        trained = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        self._names = [name for name, _ in trained]
        self._params = [p for _, p in trained]
        if not self._params:
            raise ValueError(f"{type(self).__name__}: the module has no parameter with requires_grad=True")
        if dist.get_backend() == "nccl":
            off_gpu = sorted({str(p.device) for p in module.parameters() if p.device.type != "cuda"})
            if off_gpu:
                raise ValueError(f"the NCCL backend needs the module on a CUDA device; found parameters on {off_gpu}")
        broadcast_from_rank0(module, type(self).__name__)
        # Set as backward accumulates any gradient, cleared once finish_gradient_synchronization()
        # has averaged them all; an optimizer step in between raises (guard_optimizer_steps).
        self.has_unsynchronised_gradients = False
        # A parameter keeps its hooks where the garbage collector cannot see them, so a hook that
        # held the wrapper would keep the wrapper, the module and its gradients alive forever.
        wrapper = weakref.ref(self)
        for index, p in enumerate(self._params):
            p.register_post_accumulate_grad_hook(functools.partial(_gradient_ready_hook, wrapper, index))
        guard_optimizer_steps(self)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _on_gradient_ready(self, index: int, param: torch.Tensor) -> None:
        """Called once backward has accumulated parameter `index`'s gradient."""
        self.has_unsynchronised_gradients = True

    def _start_average(self, tensor: torch.Tensor, async_op: bool = False) -> dist.Work | None:
        """All-reduce `tensor` towards its average over ranks; `_write_back` completes it."""
        return dist.all_reduce(tensor, op=self._reduce_op, async_op=async_op)

    def _write_back(self, index: int, reduced: torch.Tensor, had_gradient: bool, used_anywhere: bool,
                    copy: bool = False) -> None:
        """`write_back_gradient` of parameter `index`, after the all-reduce `_start_average` started."""
        summed_over = self.world_size if self._reduce_op == dist.ReduceOp.SUM else 1
        write_back_gradient(self._params[index], reduced, summed_over, had_gradient=had_gradient,
                            used_anywhere=used_anywhere, copy=copy)

    def _start_gradient_count(self, had_gradient: list[bool]) -> tuple[torch.Tensor, dist.Work]:
        """All-reduce, asynchronously, on how many ranks each parameter had a gradient."""
        counts = torch.tensor(had_gradient, dtype=torch.int32, device=self._params[0].device)
        return counts, dist.all_reduce(counts, async_op=True)

    @staticmethod
    def _used_anywhere(had_gradient: list[bool], counts: torch.Tensor, work: dist.Work) -> list[bool]:
        work.wait()
        if all(had_gradient):
            # Used here, so used somewhere: no need to wait for the counts on the host.
            return had_gradient
        return [count > 0 for count in counts.tolist()]


class NaiveDDP(_DataParallel):
    """After backward, a blocking all-reduce of each parameter's gradient, one at a time."""

    def finish_gradient_synchronization(self) -> None:
        had_gradient = [p.grad is not None for p in self._params]
        reduced = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self._params]
        for grad in reduced:
            self._start_average(grad)
        used = self._used_anywhere(had_gradient, *self._start_gradient_count(had_gradient))
        for index, grad in enumerate(reduced):
            self._write_back(index, grad, had_gradient[index], used[index])
        self.has_unsynchronised_gradients = False


class FlatDDP(_DataParallel):
    """After backward, one all-reduce of every gradient concatenated into a single flat tensor.

    (One per dtype and device when the module mixes them: a flat tensor holds one dtype on one device.)
    """

    def finish_gradient_synchronization(self) -> None:
        had_gradient = [p.grad is not None for p in self._params]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self._params]
        for name, grad in zip(self._names, grads):
            require_dense_gradient(type(self).__name__, name, grad)
        by_kind: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        for index, grad in enumerate(grads):
            by_kind.setdefault((grad.dtype, grad.device), []).append(index)
        flats = [torch.cat([grads[i].reshape(-1) for i in indices]) for indices in by_kind.values()]
        for flat in flats:
            self._start_average(flat)
        used = self._used_anywhere(had_gradient, *self._start_gradient_count(had_gradient))
        for indices, flat in zip(by_kind.values(), flats):
            for i, chunk in zip(indices, flat.split([grads[i].numel() for i in indices])):
                self._write_back(i, chunk.view_as(self._params[i]), had_gradient[i], used[i])
        self.has_unsynchronised_gradients = False


class _OverlappedDataParallel(_DataParallel):
    """Gradients grouped into units (subclasses decide: a parameter, or a bucket), each all-reduced
    asynchronously as soon as all its gradients are ready, in the same order on every rank."""

    def _track(self, units: list[list[int]]) -> None:
        """Launch gradients by units as their hooks fire; `units` lists parameter indices in launch order."""
        self._units = units
        self._unit_of = {i: u for u, unit in enumerate(units) for i in unit}
        self._ready = [False] * len(self._params)
        self._waiting_in_unit = [len(unit) for unit in units]
        self._works: list[dist.Work] = []  # async all-reduce of each launched unit, in unit order

    def _on_gradient_ready(self, index: int, param: torch.Tensor) -> None:
        if self._ready[index]:
            raise RuntimeError(
                f"{type(self).__name__}: a parameter's gradient was produced twice before "
                "finish_gradient_synchronization(); call it after every backward")
        super()._on_gradient_ready(index, param)
        self._ready[index] = True
        self._gradient_ready(index)
        unit = self._unit_of[index]
        self._waiting_in_unit[unit] -= 1
        # Launch in unit order only: a unit that became ready early waits for those before it.
        while len(self._works) < len(self._units) and self._waiting_in_unit[len(self._works)] == 0:
            self._works.append(self._launch(len(self._works)))

    def on_train_batch_start(self) -> None:
        """Check that the previous step's communication was finished before a new step begins."""
        if self.has_unsynchronised_gradients:
            raise RuntimeError(
                f"{type(self).__name__}: the previous backward was not followed by "
                "finish_gradient_synchronization()")

    def finish_gradient_synchronization(self) -> None:
        # Units still unlaunched hold a parameter that got no gradient this step: launch them
        # anyway (zeros stand in), so every rank issues the same all-reduces.
        while len(self._works) < len(self._units):
            self._works.append(self._launch(len(self._works)))
        had_gradient = list(self._ready)
        counts, count_work = self._start_gradient_count(had_gradient)
        for work in self._works:
            work.wait()
        self._write_back_units(had_gradient, self._used_anywhere(had_gradient, counts, count_work))
        self._works.clear()
        self._ready = [False] * len(self._params)
        self._waiting_in_unit = [len(unit) for unit in self._units]
        self.has_unsynchronised_gradients = False

    def _gradient_ready(self, index: int) -> None:
        """Called in the hook, before launching: a chance to stage the gradient."""

    def _launch(self, unit: int) -> dist.Work:
        raise NotImplementedError

    def _write_back_units(self, had_gradient: list[bool], used_anywhere: list[bool]) -> None:
        raise NotImplementedError


class OverlapIndividualDDP(_OverlappedDataParallel):
    """Each gradient all-reduced asynchronously, in place, from its post-accumulate-grad hook.

    Gradients are launched in reverse parameter order (roughly the order backward produces
    them); finish_gradient_synchronization() waits for all of them.
    """

    def __init__(self, module: nn.Module):
        super().__init__(module)
        self._stand_ins: dict[int, torch.Tensor] = {}  # zeros reduced for parameters without a gradient
        self._track([[i] for i in reversed(range(len(self._params)))])

    def _launch(self, unit: int) -> dist.Work:
        (index,) = self._units[unit]
        if self._ready[index]:
            tensor = self._params[index].grad
        else:
            tensor = self._stand_ins[index] = torch.zeros_like(self._params[index])
        return self._start_average(tensor, async_op=True)

    def _write_back_units(self, had_gradient: list[bool], used_anywhere: list[bool]) -> None:
        for index, p in enumerate(self._params):
            reduced = p.grad if had_gradient[index] else self._stand_ins[index]
            self._write_back(index, reduced, had_gradient[index], used_anywhere[index])
        self._stand_ins.clear()


@dataclass
class Bucket:
    indices: list[int]  # parameter indices, in the order their slices sit in the buffer
    buffer: torch.Tensor  # flat, allocated once, reused every step
    offsets: list[int]  # where each parameter's gradient starts in the buffer

    def slot(self, position: int, param: torch.Tensor) -> torch.Tensor:
        start = self.offsets[position]
        return self.buffer[start:start + param.numel()]


class BucketedDDP(_OverlappedDataParallel):
    """Gradients copied into flat buckets of at most bucket_size_mb (reverse parameter order);
    a bucket is all-reduced (summed) asynchronously as soon as its last gradient arrives, and
    divided by the world size on its way back into .grad."""

    def __init__(self, module: nn.Module, bucket_size_mb: float):
        check_positive_finite(bucket_size_mb=bucket_size_mb)
        super().__init__(module)
        # A sum on every backend: the division by the world size rides on the copy back into .grad, a
        # pass the buckets make anyway.
        self._reduce_op = dist.ReduceOp.SUM
        self.bucket_size_mb = bucket_size_mb
        units = assign_buckets([p.numel() * p.element_size() for p in self._params],
                               bucket_size_mb * BYTES_PER_MB,
                               kinds=[(p.dtype, p.device) for p in self._params])
        self.buckets = []
        for indices in units:
            sizes = [self._params[i].numel() for i in indices]
            first = self._params[indices[0]]
            self.buckets.append(Bucket(indices, torch.zeros(sum(sizes), dtype=first.dtype, device=first.device),
                                       [0, *itertools.accumulate(sizes)][:-1]))
        self._position = {i: (b, pos) for b, bucket in enumerate(self.buckets) for pos, i in enumerate(bucket.indices)}
        self._track(units)

    def _gradient_ready(self, index: int) -> None:
        bucket, position = self._position[index]
        p = self._params[index]
        require_dense_gradient(type(self).__name__, self._names[index], p.grad)
        self.buckets[bucket].slot(position, p).copy_(p.grad.reshape(-1))

    def _launch(self, unit: int) -> dist.Work:
        bucket = self.buckets[unit]
        for position, index in enumerate(bucket.indices):
            if not self._ready[index]:
                # The buffer still holds last step's value here; this rank contributes zero.
                bucket.slot(position, self._params[index]).zero_()
        return self._start_average(bucket.buffer, async_op=True)

    def _write_back_units(self, had_gradient: list[bool], used_anywhere: list[bool]) -> None:
        for bucket in self.buckets:
            for position, index in enumerate(bucket.indices):
                p = self._params[index]
                # The bucket's buffer is reused next step, so a new .grad is a copy of its slot.
                self._write_back(index, bucket.slot(position, p).view_as(p), had_gradient[index],
                                 used_anywhere[index], copy=True)
