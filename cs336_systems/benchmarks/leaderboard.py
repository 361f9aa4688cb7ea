"""Problem leaderboard (Spring 2026 handout): a full AdamW training step of the 8B-class model
(cs336_systems.model.LEADERBOARD: d_model 4096, 34 layers, a 151,936-token vocabulary) at batch 2 x 32,768
tokens, bf16 weights, causal, on two GPUs; cs336_systems.reports.leaderboard renders it.

    rows = run_leaderboard(2, LeaderboardConfig(), device="cuda", timeout_s=600)

Each rank trains on its share of the batch (one sequence of 32,768 tokens on each of two GPUs), from the
same initial weights. Five variants run one after the other in the same ranks, from all the project's parts
to all torch's, one part changed at a time (cs336_systems.leaderboard_variants.VARIANTS, which says what each
is and builds it). Each checkpoints the fewest blocks with which its memory estimate fits on every rank (the
step's activations would take about 150 GB per GPU otherwise), so that memory a part saves is recomputation it
saves; all use torch's fused AdamW on the bf16 weights and, with `compile`, compile each block. The ranks'
allocator grows its segments (ALLOCATOR_ENVIRONMENT). On a GPU, rank 0 then times one block's attention alone in
the Triton kernels and SDPA's FA2 and cuDNN backends.

A step is timed as the handout's harness times it, the whole step from zero_grad to the optimizer step,
with one synchronisation at its end (cs336_systems.timing); a rank's step ends when its optimizer step
does, so each step's time is the slowest rank's. Rows give the median and spread of those, peak memory
per rank and the estimate the memory guard ran the variant on.

Correctness, in the same ranks (cs336_systems.distributed.equivalence.leaderboard_equivalence): one step of each
variant on a small model in fp32 against one process training the plain model (full logits, SDPA) on the whole
batch: the loss and every gradient after the ranks synchronised them.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from cs336_systems.accounting.activations import block_saved_bytes, parameter_count, parameter_counts
from cs336_systems.accounting.flops import step_flops
from cs336_systems.accounting.memory import GIB
from cs336_systems.benchmarks.flash import FlashCell, benchmark_flash_cell
from cs336_systems.benchmarks.harness import guarded_cell, release_memory
from cs336_systems.checks import check_positive_int
from cs336_systems.distributed import fsdp as our_fsdp
from cs336_systems.distributed.equivalence import gathered, leaderboard_equivalence
from cs336_systems.distributed.launch import launch, rank_device
from cs336_systems.leaderboard_variants import DDP, FSDP, VARIANTS, Variant, build, flash_source
from cs336_systems.linear_cross_entropy import DEFAULT_CHUNK_TOKENS
from cs336_systems.lm_training import random_batch
from cs336_systems.memory_guard import MemoryCheck, check_memory_on_every_rank
from cs336_systems.model import LEADERBOARD, ModelConfig
from cs336_systems.rows import OOM, Row
from cs336_systems.rows.flash import ATTENTION_MODES
from cs336_systems.timing import STEP_TIMER, Timings, tflops

# The attention kernels timed alone at one rank's shape.
KERNEL_PROVIDERS = ("flash_triton", "sdpa_flash", "sdpa_cudnn")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# Bytes per logit of the full-logits loss (lm_loss): in forward the bf16 logits, their fp32 copy and its
# log-softmax; at backward's start the log-softmax kept, its fp32 gradient and the logits' bf16 gradient, with
# the head's gradients and workspaces beside them: 11, as an H200 measured (91.1 GiB, every block checkpointed).
FULL_LOGITS_FORWARD_BYTES = 10
FULL_LOGITS_BACKWARD_BYTES = 11
# A block's backward works in this share of what it kept, beyond it (an H200: 1.0 GiB over 4.02).
BACKWARD_WORK_SHARE = 0.25
# Left free on a GPU beside the estimate when choosing how many blocks to checkpoint: the CUDA allocator's
# cache fragments among the step's many large tensors (the run that chose plans with none ran out beside 20
# GiB reserved but unusable, before ALLOCATOR_ENVIRONMENT).
PLAN_HEADROOM_BYTES = 6 * GIB
# The ranks' caching allocator maps memory in segments that grow: a 19 GB gradient of the logits then fits
# in what freed tensors left, where fixed segments would need one block that large.
ALLOCATOR_ENVIRONMENT = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
# Beyond the model's own tensors on a GPU: the CUDA context and allocator rounding, kernel workspaces, NCCL
# buffers.
OVERHEAD_BYTES = 3 * GIB


@dataclass(frozen=True)
class LeaderboardConfig:
    model: ModelConfig = field(default_factory=lambda: ModelConfig(**LEADERBOARD))
    batch_size: int = 2  # the whole step's sequences, shared out over the ranks
    dtype: str = "bf16"  # of the weights, and so of every matmul
    warmup: int = 2  # compiles, creates AdamW's state
    steps: int = 5
    compile: bool = True
    loss_chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    # Blocks run under activation checkpointing (the first ones); None: the fewest with which the step's
    # estimate fits on every rank, so that each variant recomputes only what its memory makes it.
    checkpointed_blocks: int | None = None

    def __post_init__(self):
        check_positive_int(batch_size=self.batch_size, warmup=self.warmup, steps=self.steps,
                           loss_chunk_tokens=self.loss_chunk_tokens)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        blocks = self.checkpointed_blocks
        if blocks is not None and (isinstance(blocks, bool) or not isinstance(blocks, int)):
            raise TypeError(f"checkpointed_blocks must be an int or None, got {type(blocks).__name__}")
        if blocks is not None and not 0 <= blocks <= self.model.num_layers:
            raise ValueError(f"checkpointed_blocks must be from 0 to the model's {self.model.num_layers} blocks, "
                             f"got {blocks}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def per_rank_batch(self, world_size: int) -> int:
        if self.batch_size % world_size:
            raise ValueError(f"batch size {self.batch_size} does not split evenly over world size {world_size}")
        return self.batch_size // world_size


def block_kept_bytes(cfg: LeaderboardConfig, batch: int) -> int:
    """What one plain block keeps for backward at `batch` sequences, its output (the next block's input)
    included. Compiled, with the weights in the activations' dtype: the two norms' outputs, q, k, v, attention's
    output, the residual between the sublayers and the output, three d_ff-wide tensors (w1's and w3's outputs,
    their gated product), the norms' and attention's per-token fp32 statistics; 4.02 GiB at the leaderboard's
    shape, as an H200 measured. Eager: the activation model of the autocast block (8% above the 6.46 GiB an
    eager bf16 block measured there)."""
    config = cfg.model
    tokens = batch * config.context_length
    element = cfg.torch_dtype.itemsize
    if cfg.compile:
        return (8 * tokens * config.d_model * element + 3 * tokens * config.d_ff * element
                + (2 + config.num_heads) * tokens * 4)
    precision = "fp32" if cfg.torch_dtype == torch.float32 else "bf16"
    return sum(size for name, size in block_saved_bytes(config, batch, config.context_length, precision,
                                                        "sdpa").items() if name != "weight_casts")


def estimated_peak_bytes(variant: Variant, cfg: LeaderboardConfig, world_size: int, checkpointed_blocks: int,
                         device_type: str = "cuda") -> int:
    """One rank's peak: what stays through the step, plus the most of three moments. Forward's end holds the
    checkpointed blocks' inputs, the plain blocks' activations and the loss at its largest; backward's start those
    blocks' memory, what the loss kept and the first block's backward work; backward's end the gradients. On two
    H200s (every variant, its plan of checkpoints) up to 1.8% above the measured peaks, and 1.4% below torch's.
    Our FSDP holds a few gathered layers beside the blocks' memory, and the LM head's gathered weight beside the
    loss's. A GPU's overhead (OVERHEAD_BYTES) is counted on `device_type` "cuda" only."""
    config, batch = cfg.model, cfg.per_rank_batch(world_size)
    element = cfg.torch_dtype.itemsize
    weights = parameter_count(config) * element
    head = config.vocab_size * config.d_model * element  # the embedding's size, and the LM head's
    tokens = batch * config.context_length
    hidden = tokens * config.d_model * element
    kept = block_kept_bytes(cfg, batch)
    plain = config.num_layers - checkpointed_blocks
    # A checkpointed block keeps its input; a plain one its activations and output, the first its input too.
    residuals = checkpointed_blocks * hidden + plain * kept + (hidden if plain else 0)
    # Backward's work in a block beyond what it kept; a checkpointed block first recomputes what it keeps.
    backward_work = kept * (BACKWARD_WORK_SHARE + (0 if plain else 1))
    # Whole weights gathered in a block's forward and backward (beside its memory) and for the loss.
    forward_gathered = backward_gathered = loss_gathered = 0
    if variant.parallelism == DDP:
        # Whole on every rank: the weights, AdamW's two moments and the buckets; then the gradients, and a copy
        # of the largest while the buckets are written back.
        persistent, backward_end = 4 * weights, weights + head
    elif variant.parallelism == FSDP:
        # Shards of the weights and moments; the root's embedding and head gathered for the whole step, two
        # blocks' weights at a time; then the gradients' shards.
        block_weights = (weights - 2 * head) / config.num_layers
        persistent, backward_end = 3 * weights / world_size + 2 * head + 2 * block_weights, weights / world_size
    else:
        # Shards of the Linear and Embedding weights and their moments, the RMSNorm weights whole. A block's layer
        # gathered with the next ones in flight; in backward the gradients being reduce-scattered too, and a
        # recomputed block (the first backward meets where every block is checkpointed) keeps all its layers
        # gathered until their backward. The LM head gathered for the loss. Backward ends with the gradients'
        # shards and the embedding's whole gradient.
        norms = parameter_counts(config)["norms"] * element
        shards = (weights - norms) / world_size + norms
        layer = max(config.d_model, config.d_ff) * config.d_model * element  # a block's largest (w1, w2, w3)
        block_weights = (4 * config.d_model + 3 * config.d_ff) * config.d_model * element
        forward_gathered = (1 + our_fsdp.MAX_PREFETCH_LAYERS) * layer
        backward_gathered = ((layer if plain else block_weights) + our_fsdp.MAX_PREFETCH_LAYERS * layer
                             + our_fsdp.REDUCE_SCATTERS_IN_FLIGHT * layer)
        loss_gathered = head
        persistent, backward_end = 3 * shards, shards + head
    if variant.fused_loss:
        # A chunk's fp32 logits beside their low-precision product (or gradient), the weight's fp32 gradient and
        # the hidden states' gradient. Backward keeps the two gradients.
        chunk = min(cfg.loss_chunk_tokens, tokens) * config.vocab_size
        loss_forward = chunk * (4 + element) + head * 4 // element + hidden
        loss_backward = head + hidden
    else:
        loss_forward = tokens * config.vocab_size * FULL_LOGITS_FORWARD_BYTES
        loss_backward = tokens * config.vocab_size * FULL_LOGITS_BACKWARD_BYTES
    checkpointed_forward = kept if checkpointed_blocks else 0  # a checkpointed block's activations, until it ends
    moments = (residuals + max(checkpointed_forward + forward_gathered, loss_forward + loss_gathered),
               residuals + loss_backward + backward_work + backward_gathered, backward_end)
    overhead = OVERHEAD_BYTES if device_type == "cuda" else 0
    return int(persistent + max(moments) + overhead)


def fewest_checkpoints(variant: Variant, cfg: LeaderboardConfig, world_size: int,
                       fits: Callable[[int], bool], device_type: str = "cuda") -> int:
    """The fewest blocks to checkpoint for the estimate to pass `fits` (the memory guard's check on every rank);
    every block where none does, for the guard to refuse."""
    for checkpointed in range(cfg.model.num_layers + 1):
        if fits(estimated_peak_bytes(variant, cfg, world_size, checkpointed, device_type)):
            return checkpointed
    return cfg.model.num_layers


def _measure(variant: Variant, cfg: LeaderboardConfig, checkpointed_blocks: int, rank: int, world_size: int,
             device: torch.device) -> dict:
    trainer = build(variant, cfg.model, device, cfg.torch_dtype, cfg.compile, cfg.loss_chunk_tokens,
                    checkpointed_blocks)
    inputs, targets = random_batch(cfg.model, cfg.per_rank_batch(world_size), cfg.model.context_length, device,
                                   seed=rank)
    timed = trainer.timed_steps(inputs, targets, cfg.warmup, cfg.steps)
    del trainer
    # The handout's backward finishes the gradients too.
    samples = timed.samples_ms
    synchronising = samples.pop("gradient_sync", [0.0] * len(samples["backward"]))
    samples["backward"] = [ms + sync_ms for ms, sync_ms in zip(samples["backward"], synchronising, strict=True)]
    peak = None if timed.peak_memory_bytes is None else timed.peak_memory_bytes / GIB
    return {"status": "ok", "samples": samples, "peak_gib": peak, "losses": timed.losses}


def _step_row(name: str, per_rank: list[dict], cfg: LeaderboardConfig, world_size: int,
              checkpointed_blocks: int, estimate_bytes: int) -> Row:
    config, variant = cfg.model, VARIANTS[name]
    row: Row = {"table": "step", "variant": name, "setup": variant.setup, "world_size": world_size,
                "backend": dist.get_backend(), **_config_columns(cfg), "source_hash": flash_source(),
                "checkpointed_blocks": checkpointed_blocks, "model_peak_gib": estimate_bytes / GIB}
    oom = next((stats for stats in per_rank if stats["status"] == OOM), None)
    if oom is not None:
        return {**row, **oom}
    # A step ends when its slowest rank's does.
    step_ms = [max(values) for values in zip(*(stats["samples"]["step"] for stats in per_rank))]
    timings = Timings(tuple(step_ms))
    flops = step_flops(config, cfg.batch_size, config.context_length, "train_step")
    row.update(status="ok", timer=STEP_TIMER, steps=len(step_ms), **timings.summary(),
               min_ms=min(step_ms), max_ms=max(step_ms),
               **{f"{phase}_ms": statistics.median(max(values) for values in zip(*(s["samples"][phase]
                                                                                  for s in per_rank)))
                  for phase in ("forward", "backward", "optimizer")},
               tflops=tflops(flops, timings.median_ms),
               tflops_per_gpu=tflops(flops, timings.median_ms) / world_size,
               tokens_per_s=cfg.batch_size * config.context_length / (timings.median_ms / 1e3),
               first_loss=per_rank[0]["losses"][0], last_loss=per_rank[0]["losses"][-1])
    peaks = [stats["peak_gib"] for stats in per_rank]
    if all(peak is not None for peak in peaks):
        row["peak_gib"] = max(peaks)
    return row


def _config_columns(cfg: LeaderboardConfig) -> Row:
    columns = {key: value for key, value in asdict(cfg).items() if key not in ("model", "checkpointed_blocks")}
    model = cfg.model
    return {**columns, "d_model": model.d_model, "d_ff": model.d_ff, "num_layers": model.num_layers,
            "num_heads": model.num_heads, "vocab_size": model.vocab_size, "seq_len": model.context_length,
            "parameters": parameter_count(model)}


def benchmark_leaderboard(rank: int, world_size: int, cfg: LeaderboardConfig,
                          variants: tuple[str, ...] = tuple(VARIANTS)) -> list[Row]:
    """Run under launch: the step row of each of `variants` (rank 0 returns them)."""
    device = rank_device()
    rows = []
    for name in variants:
        variant = VARIANTS[name]
        release_memory(device)  # what the variant before left, before the plan is fitted to what is free

        def check(estimate: int) -> MemoryCheck:
            return check_memory_on_every_rank(estimate, device, world_size)

        checkpointed = cfg.checkpointed_blocks
        if checkpointed is None:
            headroom = PLAN_HEADROOM_BYTES if device.type == "cuda" else 0
            checkpointed = fewest_checkpoints(variant, cfg, world_size,
                                              lambda estimate: check(estimate + headroom).fits, device.type)
        estimate = estimated_peak_bytes(variant, cfg, world_size, checkpointed, device.type)
        stats = guarded_cell(device, lambda: check(estimate),
                             measure=lambda columns: _measure(variant, cfg, checkpointed, rank, world_size,
                                                              device) | columns,
                             oom=lambda columns: columns, record_running_out=False)
        rows.append(_step_row(name, gathered(stats), cfg, world_size, checkpointed, estimate))
    return rows if rank == 0 else []


def attention_kernels(rank: int, world_size: int, cfg: LeaderboardConfig) -> list[Row]:
    """Run under launch: on a GPU, rank 0 times the attention of one rank's step alone (forward, backward and
    both; do_bench) in the Triton kernels and SDPA's FA2 and cuDNN backends, while the other ranks wait."""
    device = rank_device()
    rows = []
    if rank == 0 and device.type == "cuda":
        config = cfg.model
        cell = FlashCell(config.context_length, config.d_head, cfg.dtype, batch_size=cfg.per_rank_batch(world_size),
                         n_heads=config.num_heads)
        rows = [{**row, "table": "kernels"}
                for row in benchmark_flash_cell(cell, KERNEL_PROVIDERS, device, ATTENTION_MODES)]
    dist.barrier()
    return rows


def run_leaderboard(world_size: int, cfg: LeaderboardConfig, device: str, timeout_s: float) -> list[Row]:
    """Launch `leaderboard_problem` on `world_size` ranks, its ranks' allocator set up as ALLOCATOR_ENVIRONMENT
    (the environment as it was afterwards); rank 0's rows."""
    before = {name: os.environ.get(name) for name in ALLOCATOR_ENVIRONMENT}
    os.environ.update(ALLOCATOR_ENVIRONMENT)
    try:
        return launch(leaderboard_problem, world_size, cfg, device=device, timeout_s=timeout_s)[0]
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value


def leaderboard_problem(rank: int, world_size: int, cfg: LeaderboardConfig) -> list[Row]:
    """Run under launch: the correctness rows, then the benchmark's and the attention kernels'."""
    return (leaderboard_equivalence(rank, world_size) + benchmark_leaderboard(rank, world_size, cfg)
            + attention_kernels(rank, world_size, cfg))
