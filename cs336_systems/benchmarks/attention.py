"""Problems pytorch_attention and the attention part of torch_compile: naive attention, eager and
torch.compile'd, timed forward and backward over head dimension x sequence length, with the memory
in use before backward and the cells that run out of memory (cs336_systems.reports.attention renders
them).

    row = benchmark_attention(AttentionCell(head_dim=64, seq_len=4096), "cuda")
    rows = attention_sweep("cuda", compiled=True)

q, k and v are (batch, N, d), no head dimension, random normal. A cell runs its forward passes first
(`warmup` untimed, then `passes` timed, outputs dropped), then its backward passes (each after an
untimed forward of its own, `warmup` untimed then `passes` timed), with the device synchronised around
every timed pass. A cell whose closed-form peak does not fit the free memory is recorded as OOM
without running; an out-of-memory error ends a cell with status OOM, keeping what was measured
before it (the forward times when only the backward runs out); either way the sweep goes on.

Memory (CUDA only) is read on the first backward pass: torch.cuda.memory_allocated before its
forward (q, k, v, dO and workspaces), after it (adding the output and what autograd saved: the
"memory before backward") and the peaks of that forward and of the backward. Eager cells carry the
closed-form prediction of `cs336_systems.accounting.attention` beside what was measured.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cs336_systems.accounting.attention import naive_attention_memory
from cs336_systems.attention.reference import naive_attention
from cs336_systems.benchmarks.harness import guarded_cell
from cs336_systems.checks import check_positive_int
from cs336_systems.precision import Precision, check_precision
from cs336_systems.rows import Row
from cs336_systems.timing import STEP_TIMER, Timings, synchronize, time_fn, timed

BATCH_SIZE = 8
HEAD_DIMS = (16, 32, 64, 128)
SEQ_LENS = (256, 1024, 4096, 8192, 16384)
PASSES = 100
# Untimed passes before each timed series. The first compiles (torch.compile) and loads kernels; the
# next let cuBLAS heuristics and the caching allocator settle.
WARMUP_PASSES = 5


@dataclass(frozen=True)
class AttentionCell:
    head_dim: int
    seq_len: int
    batch_size: int = BATCH_SIZE
    precision: str = "fp32"
    compiled: bool = False
    is_causal: bool = False
    passes: int = PASSES
    warmup: int = WARMUP_PASSES

    def __post_init__(self):
        check_positive_int(head_dim=self.head_dim, seq_len=self.seq_len, batch_size=self.batch_size,
                           passes=self.passes, warmup=self.warmup)
        check_precision(self.precision)


def _attention_fn(compiled: bool):
    if not compiled:
        return naive_attention
    # A fresh compile per cell, with static shapes so Inductor specialises its kernels to this cell.
    # Resetting first keeps earlier cells' graphs from counting towards dynamo's recompile limit,
    # past which it would run the function eagerly without saying so.
    torch.compiler.reset()
    return torch.compile(naive_attention, dynamic=False)


def _empty_row(cell: AttentionCell, device: torch.device) -> Row:
    """The cell's identity and every measured column (None until measured), in report order."""
    row: Row = {"attention": "naive", "compile": cell.compiled, "precision": cell.precision,
                "batch_size": cell.batch_size, "seq_len": cell.seq_len, "head_dim": cell.head_dim,
                "is_causal": cell.is_causal, "passes": cell.passes, "warmup": cell.warmup, "device": device.type,
                "status": None, "oom_during": None}
    for phase in ("forward", "backward"):
        row |= {f"{phase}_mean_ms": None, f"{phase}_std_ms": None, f"{phase}_median_ms": None}
    row |= {"first_forward_ms": None, "first_backward_ms": None, "allocated_before_forward_bytes": None,
            "memory_before_backward_bytes": None, "forward_peak_bytes": None, "backward_peak_bytes": None}
    if not cell.compiled:  # the closed form models eager autograd; compiled graphs save what Inductor decides
        memory = naive_attention_memory(cell.batch_size, cell.seq_len, cell.seq_len, cell.head_dim,
                                        cell.precision, cell.is_causal, device.type)
        row |= memory.as_row()
    on_cuda = device.type == "cuda"
    row["device_memory_bytes"] = torch.cuda.get_device_properties(device).total_memory if on_cuda else None
    return row


def _record(row: Row, phase: str, timings: Timings) -> None:
    row |= {f"{phase}_mean_ms": timings.mean_ms, f"{phase}_std_ms": timings.std_ms,
            f"{phase}_median_ms": timings.median_ms, "timer": STEP_TIMER}


def _measure(cell: AttentionCell, device: torch.device, row: Row) -> None:
    """Fill `row` stage by stage, so that an out-of-memory error keeps what was measured before it."""
    generator = torch.Generator(device=device).manual_seed(0)
    shape = (cell.batch_size, cell.seq_len, cell.head_dim)

    def randn(requires_grad: bool) -> torch.Tensor:
        return torch.randn(shape, generator=generator, device=device, dtype=Precision.named(cell.precision).dtype,
                           requires_grad=requires_grad)

    q, k, v = randn(True), randn(True), randn(True)
    grad_out = randn(False)
    attention = _attention_fn(cell.compiled)

    def forward() -> torch.Tensor:
        return attention(q, k, v, is_causal=cell.is_causal)

    row["oom_during"] = "forward"
    first: list[float] = []
    with timed(device, first):
        forward()
    row["first_forward_ms"] = first[0]
    _record(row, "forward", time_fn(forward, warmup=cell.warmup - 1, steps=cell.passes, device=device))

    row["oom_during"] = "backward"
    warmup_ms: list[float] = []
    samples_ms: list[float] = []
    measure_memory = device.type == "cuda"
    for i in range(cell.warmup + cell.passes):
        q.grad = k.grad = v.grad = None  # every backward allocates fresh gradients, as after zero_grad
        # Memory is read on the first pass, so a cell whose backward runs out still reports it.
        measure = i == 0 and measure_memory
        if measure:
            synchronize(device)
            row["allocated_before_forward_bytes"] = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        out = forward()
        if measure:
            synchronize(device)
            row["memory_before_backward_bytes"] = torch.cuda.memory_allocated(device)
            row["forward_peak_bytes"] = torch.cuda.max_memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        with timed(device, samples_ms if i >= cell.warmup else warmup_ms):
            out.backward(grad_out)
        if measure:
            row["backward_peak_bytes"] = torch.cuda.max_memory_allocated(device)
        del out
    row["first_backward_ms"] = warmup_ms[0]
    _record(row, "backward", Timings(tuple(samples_ms)))
    row["oom_during"] = None


def benchmark_attention(cell: AttentionCell, device: torch.device | str) -> Row:
    """One cell's row: status "ok", or OOM, predicted (not run) or with `oom_during` naming the stage
    that ran out."""
    device = torch.device(device)
    row = _empty_row(cell, device)
    # Eager attention's peak; a compiled graph keeps at most what eager autograd does.
    peak_bytes = naive_attention_memory(cell.batch_size, cell.seq_len, cell.seq_len, cell.head_dim, cell.precision,
                                        cell.is_causal).peak_bytes

    def measure(columns: Row) -> Row:
        _measure(cell, device, row)
        return row | {"status": "ok", **columns}

    # A cell that runs out keeps what `_measure` filled in before it did.
    return guarded_cell(device, peak_bytes, measure, oom=lambda columns: row | columns)


def attention_sweep(device: torch.device | str, head_dims=HEAD_DIMS, seq_lens=SEQ_LENS, **cell_options) -> list[Row]:
    """Rows of every (head_dim, seq_len) cell; `cell_options` are AttentionCell's other fields."""
    cells = [AttentionCell(d, n, **cell_options) for d in head_dims for n in seq_lens]  # bad input fails first
    return [benchmark_attention(cell, device) for cell in cells]
