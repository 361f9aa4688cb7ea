"""One rank-side training loop for every parallelism: parallelize the unchanged model, then train it.

    trainer = Trainer(model, wrap, build_optimizer, loss)
    timed = trainer.timed_steps(inputs, targets, warmup=3, steps=10)
    timed.samples_ms["step"], timed.samples_ms["backward"], timed.peak_memory_bytes

`wrap(model)` applies a parallelism (our DDP variants, FSDP, torch's DistributedDataParallel or fully_shard, or
nothing) and returns the `Wrapped` model: the module forward runs on, with what runs before each batch and after
backward (gradient synchronisation), each called with the optimizer. `build_optimizer(module)` builds the
optimizer over the wrapped module's parameters (AdamW, ZeroRedundancyOptimizer, ShardedOptimizer...). `loss(module,
inputs, targets)` is the step's loss.

A step is the handout's: zero_grad, (before the batch), forward and loss, backward, (gradient synchronisation),
the optimizer step; each in `phase(name)` for name in PHASES, "gradient_sync" only where the wrapper has something
to finish after backward. Warm-up and timed steps alike are timed with one synchronisation each, at the step's end
(cs336_systems.timing.timed_step: synchronising inside the step would stall the very overlap a wrapper is
measured for); the warm-up's times are dropped. Every step tells the launch that the rank is moving on.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from cs336_systems.distributed.ddp import BucketedDDP, FlatDDP, NaiveDDP, OverlapIndividualDDP
from cs336_systems.distributed.fsdp import FSDP
from cs336_systems.distributed.launch import report_progress
from cs336_systems.profiling.kernels import device_profile
from cs336_systems.profiling.ranges import annotate
from cs336_systems.timing import Phase, timed_step

PHASES = ("forward", "backward", "gradient_sync", "optimizer")

# Called with the optimizer: a wrapper's hooks, which the course's adapters pass it to.
Hook = Callable[[torch.optim.Optimizer], None]
Loss = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Wrapped:
    """A model made ready to train by a parallelism: the module forward runs on, what runs before each batch,
    and what finishes the gradients after backward (None: nothing to do)."""

    module: nn.Module
    after_backward: Hook | None = None
    before_batch: Hook | None = None


Wrap = Callable[[nn.Module], Wrapped]
BuildOptimizer = Callable[[nn.Module], torch.optim.Optimizer]


def unwrapped(model: nn.Module) -> Wrapped:
    """No parallelism: every rank trains alone."""
    return Wrapped(model)


def torch_ddp(model: nn.Module, gradient_as_bucket_view: bool = False) -> Wrapped:
    """torch.nn.parallel.DistributedDataParallel, which finishes its all-reduces inside backward."""
    device = next(model.parameters()).device
    device_ids = [device.index] if device.type == "cuda" else None
    return Wrapped(nn.parallel.DistributedDataParallel(model, device_ids=device_ids,
                                                       gradient_as_bucket_view=gradient_as_bucket_view))


# This project's DDP wrappers (cs336_systems.distributed.ddp) by the method names rows give them.
DDP_WRAPPERS = {"naive": NaiveDDP, "flat": FlatDDP, "overlap_individual": OverlapIndividualDDP, "bucketed": BucketedDDP}


def our_ddp(model: nn.Module, method: str, bucket_size_mb: float | None = None) -> Wrapped:
    """This project's DDP wrapper `method` (a key of DDP_WRAPPERS; the bucketed one with buckets of
    `bucket_size_mb`), which finishes its gradients after backward and, where it has that hook, starts each
    batch."""
    wrapper = BucketedDDP(model, bucket_size_mb=bucket_size_mb) if method == "bucketed" else DDP_WRAPPERS[method](model)
    before_batch = getattr(wrapper, "on_train_batch_start", None)
    return Wrapped(wrapper, lambda optimizer: wrapper.finish_gradient_synchronization(),
                   None if before_batch is None else lambda optimizer: before_batch())


def synchronised_fsdp(fsdp: FSDP) -> Wrapped:
    """Our FSDP, its gradients finished after backward."""
    return Wrapped(fsdp, lambda optimizer: fsdp.finish_gradient_synchronization())


@dataclass
class TimedSteps:
    """The timed steps' times by phase ("step": the whole step), the loss of every step (warm-up's first), and
    the peak memory allocated in the timed steps (None off a GPU)."""

    samples_ms: dict[str, list[float]]
    losses: list[float]
    peak_memory_bytes: int | None


class Trainer:
    """`model` wrapped by `wrap`, with the optimizer `build_optimizer` builds over the wrapped module."""

    def __init__(self, model: nn.Module, wrap: Wrap, build_optimizer: BuildOptimizer, loss: Loss):
        self.wrapped = wrap(model)
        self.module = self.wrapped.module
        self.optimizer = build_optimizer(self.module)
        self.loss = loss
        self.device = next(model.parameters()).device

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, phase: Phase = annotate,
             at: Callable[[str], None] | None = None) -> torch.Tensor:
        """One training step (module docstring); `at(point)`, if given, is called at its points ("step start",
        "after forward", "before optimizer step", "after optimizer step"). Returns the loss, detached."""
        wrapped, optimizer = self.wrapped, self.optimizer
        optimizer.zero_grad(set_to_none=True)
        if wrapped.before_batch is not None:
            wrapped.before_batch(optimizer)
        mark = at or (lambda point: None)
        mark("step start")
        with phase("forward"):
            loss = self.loss(self.module, inputs, targets)
        mark("after forward")
        with phase("backward"):
            loss.backward()
        if wrapped.after_backward is not None:
            with phase("gradient_sync"):
                wrapped.after_backward(optimizer)
        mark("before optimizer step")
        with phase("optimizer"):
            optimizer.step()
        mark("after optimizer step")
        return loss.detach()

    def timed_steps(self, inputs: torch.Tensor, targets: torch.Tensor, warmup: int, steps: int) -> TimedSteps:
        """`warmup` steps, then `steps` timed ones, all on the same batch."""
        losses = [self._timed_step(inputs, targets) for _ in range(warmup)]
        on_cuda = self.device.type == "cuda"
        if on_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        samples: dict[str, list[float]] = {}
        losses += [self._timed_step(inputs, targets, samples) for _ in range(steps)]
        peak = torch.cuda.max_memory_allocated(self.device) if on_cuda else None
        return TimedSteps(samples, [loss.item() for loss in losses], peak)

    def profiled_step(self, inputs: torch.Tensor, targets: torch.Tensor, profile: bool = True) -> list[dict] | None:
        """One more step, under torch.profiler where `profile` (the events of its Chrome trace); plainly, and None,
        elsewhere: a rank whose trace is not kept runs the step for its collectives."""
        if not profile:
            self._timed_step(inputs, targets)
            return None
        with device_profile(self.device) as profiler:
            self._timed_step(inputs, targets)
        with tempfile.TemporaryDirectory() as scratch:
            trace = Path(scratch) / "trace.json"
            profiler.export_chrome_trace(str(trace))
            data = json.loads(trace.read_text())
        return data["traceEvents"] if isinstance(data, dict) else data

    def _timed_step(self, inputs: torch.Tensor, targets: torch.Tensor,
                    samples: dict[str, list[float]] | None = None) -> torch.Tensor:
        with timed_step(self.device, samples) as phase:
            loss = self.step(inputs, targets, phase)
        report_progress()
        return loss
