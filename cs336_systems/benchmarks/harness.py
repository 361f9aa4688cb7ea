"""What every model benchmark shares beside the LM's own training pieces (cs336_systems.lm_training: the model,
AdamW, a batch of random tokens, the loss): autocast, one training step, and running each cell guarded against
running out of memory.

    model = build_model(ModelConfig.for_size("small", 512), "cuda", attention="naive")
    optimizer = adamw(model, lr=LEARNING_RATE)   # the course's AdamW; "fused" for torch's fused kernel
    inputs, targets = random_batch(model.config, 4, 512, "cuda")
    samples = defaultdict(list)
    with timed_step("cuda", samples) as phase:   # cs336_systems.timing.timed_step
        training_step(model, optimizer, inputs, targets, precision="bf16", phase=phase)

A step runs its phases (forward, backward, the optimizer) inside `phase(name)`, which names the range
for profilers (`annotate`, the default); `timed_step` also times each phase and the whole step from
events on the device's timeline, synchronising once, when the step ends (cs336_systems.timing).

Every benchmark cell runs through `guarded_cell`: not at all where its estimated peak does not fit,
recorded as OOM where it runs out all the same, the sweep going on either way:

    rows = guarded_cell(device, estimated_peak_bytes,
                        measure=lambda columns: [{**row, "status": "ok", **measured(), **columns}],
                        oom=lambda columns: [{**row, **columns}])
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from typing import TypeVar

import torch

from cs336_systems.cells import failure_columns
from cs336_systems.lm_training import LEARNING_RATE, adamw, lm_loss
from cs336_systems.memory_guard import MemoryCheck, check_memory, is_out_of_memory, oom_columns
from cs336_systems.precision import Precision
from cs336_systems.profiling.ranges import annotate
from cs336_systems.rows import Row
from cs336_systems.timing import Phase

Rows = TypeVar("Rows")


def autocast(precision: str, device: torch.device | str) -> AbstractContextManager:
    """bf16/fp16 autocast on `device`, or nothing for fp32."""
    dtype = Precision.named(precision).autocast_dtype
    return nullcontext() if dtype is None else torch.autocast(torch.device(device).type, dtype=dtype)


def foreach_adamw(module: torch.nn.Module) -> torch.optim.Optimizer:
    """torch's AdamW at LEARNING_RATE, as the distributed benchmarks build their optimizers."""
    return adamw(module, LEARNING_RATE, "foreach")


def training_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, inputs: torch.Tensor,
                  targets: torch.Tensor, *, precision: str = "fp32", phase: Phase = annotate,
                  after_backward: Callable[[], None] | None = None, keep_logits: bool = False) -> torch.Tensor:
    """Forward and loss under `precision`'s autocast, backward, `after_backward` (gradient
    synchronisation) if given, then the optimizer step and zero_grad(set_to_none=True); each in
    `phase(name)`. Without an optimizer, the gradients are dropped instead. Returns the loss.

    The logits are freed once the loss is computed, as in training; `keep_logits` holds them to the
    end of the step, one (tokens x vocabulary) tensor more in backward and the optimizer step, as the
    end-to-end and flash_in_training benchmarks measured their peak memory."""
    with phase("forward"), autocast(precision, inputs.device):
        logits = model(inputs)
        loss = lm_loss(logits, targets)
    if not keep_logits:
        del logits
    with phase("backward"):
        loss.backward()
    if after_backward is not None:
        with phase("gradient_sync"):
            after_backward()
    if optimizer is None:
        model.zero_grad(set_to_none=True)
        return loss
    with phase("optimizer"):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return loss


# The implementation under test as a distributed benchmark's ranks receive it: its adapters module's spec (what
# load_adapters imports again) and its label (how the process that chose it names it: a file's label is the path
# as given there, which a rank, given the resolved path, would word differently).
UnderTest = tuple[str, str]


def under_test_of(adapters) -> UnderTest | None:
    """What a launch hands its ranks of the implementation under test `adapters` (a conformance.contract.Adapters);
    None where it is this project's own, whose implementations the benchmarks' references measure already."""
    return None if adapters.is_own else (adapters.spec, adapters.label)


def adapters_in_rank(under_test: UnderTest | None):
    """The implementation under test in a rank: its adapters module imported again, named as it was chosen."""
    if under_test is None:
        return None
    from cs336_systems.conformance.contract import load_adapters

    spec, label = under_test
    return replace(load_adapters(spec), label=label)


def release_memory(device: torch.device | str) -> None:
    """Free what earlier cells left (a failed cell's tensors included) and return the allocator's cached
    blocks, so that the next cell starts from a clean pool; reset the peak counter for it."""
    device = torch.device(device)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def guarded_cell(device: torch.device | str, memory: int | Callable[[], MemoryCheck] | None,
                 measure: Callable[[Row], Rows], oom: Callable[[Row], Rows], *,
                 let_go: Callable[[], None] | None = None, record_running_out: bool = True,
                 failed: Callable[[Row], Rows] | None = None) -> Rows:
    """One benchmark cell, run only where its memory fits (cs336_systems.memory_guard): its rows, or
    its OOM rows, predicted (not run) or measured (it ran out), and the sweep goes on.

    `memory` is the cell's estimated peak in bytes, checked against what `device` has free (what
    earlier cells left is collected first); or a function that makes the check (on every rank, say);
    or None for a cell with no estimate, which always runs. `measure(columns)` runs the cell, in memory
    released just before, and returns its rows, given the estimate's columns to record in them ({}
    without an estimate); `oom(columns)` returns the rows of a cell that did not run or ran out, given
    its OOM columns (status, oom_predicted and the estimate). After the cell `let_go`, if given, drops
    what it kept alive outside its frames (gradients, say), and memory is released again. An error
    that is not out-of-memory propagates, and so does running out with `record_running_out=False`: for a
    cell inside collectives, where a rank that ran out alone and went on would leave its peers waiting. Given
    `failed`, a cell that runs an implementation under test, whose failure is a result: an error that is not
    out-of-memory is recorded instead, `failed(columns)` its rows, given its FAILED columns
    (cs336_systems.cells.failure_columns).
    """
    check = memory() if callable(memory) else None if memory is None else check_memory(memory, device)
    if check is not None and not check.fits:
        return oom(oom_columns(True, check))
    release_memory(device)
    ran_out, failure = False, None
    try:
        rows = measure({} if check is None else check.columns())
    except Exception as error:
        if record_running_out and is_out_of_memory(error):
            ran_out = True
        elif failed is not None and not is_out_of_memory(error):
            failure = failure_columns(error)
        else:
            raise
    # Outside the except block: its traceback held the failed cell's frames, and their tensors, alive.
    if let_go is not None:
        let_go()
    release_memory(device)
    if failure is not None:
        return failed(failure)
    return oom(oom_columns(False, check)) if ran_out else rows
