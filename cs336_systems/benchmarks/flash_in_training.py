"""Problem flash_in_training: the Triton FlashAttention op inside a compiled training step, against
PyTorch SDPA, at the sizes and contexts people train at; and the attention kernels alone at those
steps' shapes, where the step's attention time comes from.

    rows = training_steps(TrainingCell("xl", 512, table="2025"), "cuda")
    rows = attention_kernels(kernel_cell_of(TrainingCell("xl", 512, table="2025")), "cuda")

A training step is the whole model under torch.compile(fullgraph=True) (a graph break fails the cell)
with bf16 autocast, cross-entropy, backward, a fused AdamW step and zero_grad. Both attentions run in
one process, one after the other, from the same initial weights and batch; whole steps are timed by
cs336_systems.timing (CUDA events, one synchronisation per step, garbage collection off): the median
and interquartile range, and the mean and std. The first step's loss is recorded so that the two attentions can be
seen to compute the same function. cs336_systems.reports.flash_in_training renders them.

With cuda_graphs, the model is compiled with mode "reduce-overhead": its forward and backward are captured
in CUDA graphs and replayed (torch.compiler.cudagraph_mark_step_begin opens each step), the kernels of the
flash op inside them; the loss and the optimizer step run eagerly between the replays. Those rows are
table "graphed_step".
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from cs336_systems.accounting.flops import step_flops
from cs336_systems.benchmarks.flash import BenchSettings, FlashCell, benchmark_flash_cell
from cs336_systems.benchmarks.harness import guarded_cell, training_step
from cs336_systems.lm_training import LEARNING_RATE, adamw, build_model, random_batch
from cs336_systems.model import ModelConfig
from cs336_systems.rows import Row
from cs336_systems.rows.flash import KERNEL_MODES
from cs336_systems.timing import STEP_TIMER, tflops, time_fn

ATTENTIONS = ("sdpa", "flash_triton")
KERNEL_PROVIDERS = ("flash_triton", "sdpa_cudnn", "sdpa_flash")
DEFAULT_WARMUP = 5
DEFAULT_STEPS = 20
# Per kind of step, uncaptured (False) or in CUDA graphs (True): its "compile" column and its rows' table.
COMPILE_LABELS = {False: "whole model, fullgraph", True: "whole model, fullgraph, CUDA graphs (mode reduce-overhead)"}
STEP_TABLES = {False: "step", True: "graphed_step"}


@dataclass(frozen=True)
class TrainingCell:
    """A model size of a size table (cs336_systems.model.SIZE_TABLES) at a context and batch size."""

    size: str
    context_length: int
    batch_size: int = 4
    table: str = "2026"

    def model_config(self) -> ModelConfig:
        return ModelConfig.for_size(self.size, self.context_length, table=self.table)


def kernel_cell_of(cell: TrainingCell) -> FlashCell:
    """The attention call inside `cell`'s training step (causal, bf16)."""
    config = cell.model_config()
    return FlashCell(cell.context_length, config.d_model // config.num_heads, "bf16", batch_size=cell.batch_size,
                     n_heads=config.num_heads)


def _no_range(name: str) -> nullcontext:
    """Steps timed whole: no profiler ranges inside them."""
    return nullcontext()


def _training_step_row(cell: TrainingCell, attention: str, device: torch.device, warmup: int, steps: int,
                       cuda_graphs: bool) -> Row:
    from cs336_systems.attention.flash_triton import source_hash

    config = cell.model_config()
    row: Row = {"table": STEP_TABLES[cuda_graphs], "size_table": cell.table, "size": cell.size,
                "d_model": config.d_model, "n_heads": config.num_heads,
                "head_dim": config.d_model // config.num_heads, "context_length": cell.context_length,
                "batch_size": cell.batch_size, "attention": attention, "compile": COMPILE_LABELS[cuda_graphs],
                "precision": "bf16 autocast", "optimizer": "AdamW (fused)", "warmup": warmup,
                "source_hash": source_hash()}

    def measure(columns: Row) -> Row:
        model = build_model(config, device, attention, seed=0)
        optimizer = adamw(model, LEARNING_RATE, "fused")
        inputs, targets = random_batch(config, cell.batch_size, cell.context_length, device)
        torch.compiler.reset()
        compiled = torch.compile(model, fullgraph=True, mode="reduce-overhead" if cuda_graphs else None)
        losses = []

        def step():
            if cuda_graphs:  # the previous step's graph outputs (logits, activations) are done with
                torch.compiler.cudagraph_mark_step_begin()
            loss = training_step(compiled, optimizer, inputs, targets, precision="bf16", phase=_no_range,
                                 keep_logits=True)
            if not losses:
                losses.append(loss.item())

        # The steps' peak, not the model's construction's.
        torch.cuda.reset_peak_memory_stats(device)
        timings = time_fn(step, warmup=warmup, steps=steps, device=device)
        stats = {**timings.summary(), "steps": steps, "timer": STEP_TIMER}
        flops = step_flops(config, cell.batch_size, cell.context_length, "train_step")
        return {**row, "status": "ok", **stats, "tflops": tflops(flops, stats["median_ms"]),
                "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30, "first_loss": losses[0]}

    return guarded_cell(device, None, measure, oom=lambda columns: {**row, **columns})


def training_steps(cell: TrainingCell, device: torch.device | str = "cuda", attentions=ATTENTIONS,
                   warmup: int = DEFAULT_WARMUP, steps: int = DEFAULT_STEPS, cuda_graphs: bool = False) -> list[Row]:
    """One row per attention: the compiled training step's time, TFLOP/s, peak memory and first loss; with
    cuda_graphs, of the step whose forward and backward replay CUDA graphs."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"training steps are timed with CUDA events and need a CUDA device, got {device}")
    return [_training_step_row(cell, attention, device, warmup, steps, cuda_graphs) for attention in attentions]


def attention_kernels(cell: FlashCell, device: torch.device | str = "cuda",
                      settings: BenchSettings = BenchSettings()) -> list[Row]:
    """Forward, backward and forward+backward (eagerly, then from a CUDA graph) of the Triton kernels and
    SDPA's cuDNN and FA2 backends at `cell`'s shape, timed by do_bench."""
    rows = benchmark_flash_cell(cell, KERNEL_PROVIDERS, device, KERNEL_MODES, settings)
    return [{**row, "table": "kernels"} for row in rows]
