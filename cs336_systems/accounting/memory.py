"""Training memory of the Transformer LM in closed form: parameters, gradients, AdamW state, saved
activations and communication buffers, per device, for one process or sharded over ranks.

    memory = training_memory(ModelConfig.for_size("xl", 512), batch_size=4, seq_len=512,
                             strategy="fsdp", world_size=2)
    memory.peak, memory.as_row()

Training state. Parameters stay fp32 under autocast (autocast casts copies for each matmul), so
gradients are fp32 too, and AdamW keeps two fp32 moments per parameter (exp_avg, exp_avg_sq; its
per-tensor step counter is a scalar and left out).

Saved activations are the tensors autograd keeps for backward, counted op by op from the model's
code (`saved_activations` lists them by name). An op saves only what the gradients it must compute
need: RoPE's products keep the cos/sin tables but not q and k, since the tables need no gradient.
Under autocast every matmul casts its input itself, so q, k and v each save their own
low-precision copy of the normed input, and every Linear weight's low-precision copy is saved too
(autocast caches one cast per weight for the forward pass). The residual stream and RMSNorm's
statistics stay fp32. The loss saves fp32 log-probabilities (cross entropy runs in fp32 under
autocast). Fused SDPA kernels save q, k, v, the output and the log-sum-exp of the scores; naive
attention saves the (seq x seq) probabilities instead. Merging the heads for the output projection
copies the attention output, except after SDPA on CUDA, whose kernels write the output with heads
innermost, so that the merge is a view of it. Softmax is on CUDA autocast's fp32 list
(it saves fp32 probabilities and the following matmul a low-precision copy), but not on the CPU's.

Strategies, with N = `world_size`:
  replicated       every rank holds everything (one process, or data parallel)
  optimizer_state  ZeRO stage 1: AdamW state sharded, about 1/N per rank
  fsdp             Linear and Embedding weights, their gradients and state sharded (each weight
                   padded to a multiple of N); RMSNorm weights replicated. Weights are gathered one
                   layer at a time, so no low-precision weight copy outlives its layer.
Torch DDP (`ddp_buckets=True`) also keeps its gradient buckets: one more full copy of the
gradients (its default, gradient_as_bucket_view=False).

Peak. At the start of backward the saved activations are all alive and gradients are not yet
allocated (zero_grad(set_to_none=True)); as backward proceeds, activations are freed while gradients
appear. `peak` = persistent state + max(activations, gradients): what the model predicts at the
largest of those moments, without allocator fragmentation, kernel workspaces or temporaries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cs336_systems.gpus import GIB
from cs336_systems.model import ModelConfig

FP32_BYTES = 4
LOW_PRECISION_BYTES = 2  # bf16 and fp16
INDEX_BYTES = 8  # token ids and targets are int64
MASK_BYTES = 1  # bool
ADAMW_MOMENTS = 2  # exp_avg and exp_avg_sq
PRECISIONS = {"fp32": FP32_BYTES, "bf16": LOW_PRECISION_BYTES, "fp16": LOW_PRECISION_BYTES}
ATTENTIONS = ("sdpa", "naive")
STRATEGIES = ("replicated", "optimizer_state", "fsdp")


def _check_positive_int(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


def _check_choice(name: str, value: str, choices) -> None:
    if value not in choices:
        raise ValueError(f"unknown {name} {value!r}; choose one of {', '.join(choices)}")


# ------------------------------------------------------------------------------------- parameters

def parameter_counts(config: ModelConfig) -> dict[str, int]:
    """Parameters by part: embedding, attention projections, feed-forward, RMSNorms and LM head."""
    d, d_ff, layers, vocab = config.d_model, config.d_ff, config.num_layers, config.vocab_size
    return {
        "embedding": vocab * d,
        "attention": layers * 4 * d * d,  # q, k, v, output projections
        "feed_forward": layers * 3 * d * d_ff,  # w1, w3 up, w2 down
        "norms": (2 * layers + 1) * d,  # two per block and the final one
        "lm_head": d * vocab,
    }


def parameter_count(config: ModelConfig) -> int:
    return sum(parameter_counts(config).values())


def sharded_weight_shapes(config: ModelConfig) -> list[tuple[int, int]]:
    """The (rows, cols) of every Linear and Embedding weight: what FSDP shards."""
    d, d_ff = config.d_model, config.d_ff
    block = [(d, d)] * 4 + [(d_ff, d), (d, d_ff), (d_ff, d)]
    return [(config.vocab_size, d), *block * config.num_layers, (config.vocab_size, d)]


def fsdp_shard_elements(config: ModelConfig, world_size: int) -> int:
    """Elements of one rank's weight shards: each weight padded up to a multiple of world_size."""
    _check_positive_int(world_size=world_size)
    return sum(math.ceil(rows * cols / world_size) for rows, cols in sharded_weight_shapes(config))


# ------------------------------------------------------------------------------------ activations

@dataclass(frozen=True)
class SavedTensor:
    name: str
    count: int  # how many such tensors one forward pass saves
    elements: int  # elements in each
    bytes_per_element: int

    @property
    def total_bytes(self) -> int:
        return self.count * self.elements * self.bytes_per_element


def saved_activations(config: ModelConfig, batch_size: int, seq_len: int, precision: str = "fp32",
                      attention: str = "sdpa", device_type: str = "cuda",
                      weight_copies: bool = True) -> list[SavedTensor]:
    """What one forward pass and loss of the LM save for backward, tensor by tensor.

    `precision` is the autocast dtype (fp32: no autocast). `weight_copies=False` leaves out
    autocast's saved low-precision weight copies (FSDP gathers weights per layer instead).
    """
    _check_positive_int(batch_size=batch_size, seq_len=seq_len)
    _check_choice("precision", precision, PRECISIONS)
    _check_choice("attention", attention, ATTENTIONS)
    _check_choice("device_type", device_type, ("cuda", "cpu"))
    low = PRECISIONS[precision]
    mixed = precision != "fp32"
    layers, d, d_ff = config.num_layers, config.d_model, config.d_ff
    tokens = batch_size * seq_len
    rows_of_d = tokens * d
    norms = 2 * layers + 1
    # Under autocast each matmul casts its input itself: q, k and v cast the same normed input three
    # times, w1 and w3 twice; without autocast they share one tensor.
    attention_input_copies, ffn_input_copies = (3, 2) if mixed else (1, 1)
    saved = [
        SavedTensor("token ids", 1, tokens, INDEX_BYTES),
        # RMSNorm: pow saves its input, x * rsqrt saves the rsqrt, (normed * weight) the normed x.
        SavedTensor("RMSNorm input", norms, rows_of_d, FP32_BYTES),
        SavedTensor("RMSNorm rsqrt", norms, tokens, FP32_BYTES),
        SavedTensor("RMSNorm normed", norms, rows_of_d, FP32_BYTES),
        SavedTensor("q/k/v input", layers * attention_input_copies, rows_of_d, low),
        SavedTensor("RoPE cos/sin", layers * 4, seq_len * config.d_head // 2, low),
        SavedTensor("w1/w3 input", layers * ffn_input_copies, rows_of_d, low),
        SavedTensor("w1, silu, w3 outputs", layers * 3, tokens * d_ff, low),
        SavedTensor("w2 input", layers, tokens * d_ff, low),
        SavedTensor("final norm output (LM head input)", 1, rows_of_d, low),
        SavedTensor("log-probabilities", 1, tokens * config.vocab_size, FP32_BYTES),
        SavedTensor("targets", 1, tokens, INDEX_BYTES),
        SavedTensor("cross-entropy normaliser", 1, 1, FP32_BYTES),
    ]
    saved.append(SavedTensor("q, k (rotated), v", layers * 3, rows_of_d, low))
    if not (attention == "sdpa" and device_type == "cuda"):
        saved.append(SavedTensor("output projection input (heads merged)", layers, rows_of_d, low))
    if attention == "sdpa":
        saved += [SavedTensor("attention output", layers, rows_of_d, low),
                  SavedTensor("attention log-sum-exp", layers, batch_size * config.num_heads * seq_len, FP32_BYTES)]
    else:
        scores = batch_size * config.num_heads * seq_len * seq_len
        saved.append(SavedTensor("causal mask", layers, seq_len * seq_len, MASK_BYTES))
        if mixed and device_type == "cuda":
            saved += [SavedTensor("attention probabilities (softmax, fp32)", layers, scores, FP32_BYTES),
                      SavedTensor("attention probabilities (matmul copy)", layers, scores, low)]
        else:
            saved.append(SavedTensor("attention probabilities", layers, scores, low))
    if mixed and weight_copies:
        linear = parameter_count(config) - parameter_counts(config)["embedding"] - parameter_counts(config)["norms"]
        saved.append(SavedTensor("low-precision Linear weight copies", 1, linear, low))
    return saved


def activation_bytes(config: ModelConfig, batch_size: int, seq_len: int, precision: str = "fp32",
                     attention: str = "sdpa", device_type: str = "cuda", weight_copies: bool = True) -> int:
    return sum(t.total_bytes for t in saved_activations(config, batch_size, seq_len, precision, attention,
                                                        device_type, weight_copies))


def residual_stream_bytes(config: ModelConfig, batch_size: int, seq_len: int) -> int:
    """One (batch, seq, d_model) tensor of the residual stream, which stays fp32 under autocast."""
    _check_positive_int(batch_size=batch_size, seq_len=seq_len)
    return batch_size * seq_len * config.d_model * FP32_BYTES


# ---------------------------------------------------------------------------------------- totals

@dataclass(frozen=True)
class TrainingMemory:
    """Bytes one device holds, by kind."""

    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    buffers: int  # communication buffers: torch DDP's gradient buckets, FSDP's gathered weights

    @property
    def persistent(self) -> int:
        """What stays allocated across steps (gradients freed by zero_grad(set_to_none=True))."""
        return self.parameters + self.optimizer_state + self.buffers

    @property
    def peak(self) -> int:
        return self.persistent + max(self.activations, self.gradients)

    def as_row(self, unit: float = GIB, suffix: str = "_gib") -> dict[str, float]:
        fields = {"parameters": self.parameters, "gradients": self.gradients,
                  "optimizer_state": self.optimizer_state, "activations": self.activations,
                  "buffers": self.buffers, "peak": self.peak}
        return {f"{name}{suffix}": value / unit for name, value in fields.items()}


def training_memory(config: ModelConfig, batch_size: int, seq_len: int, precision: str = "fp32",
                    attention: str = "sdpa", *, strategy: str = "replicated", world_size: int = 1,
                    ddp_buckets: bool = False, fsdp_gathered_weights: int = 3,
                    fsdp_reduce_scatters_in_flight: int = 3, device_type: str = "cuda") -> TrainingMemory:
    """Per-device memory of training with AdamW; `batch_size` is per device.

    FSDP's buffers are `fsdp_gathered_weights` gathered weights in the compute precision (the layer
    in use and those prefetched) and `fsdp_reduce_scatters_in_flight` fp32 full-size gradients
    waiting to be reduce-scattered, each as large as the largest weight.
    """
    _check_choice("strategy", strategy, STRATEGIES)
    _check_positive_int(world_size=world_size)
    total = parameter_count(config)
    if strategy == "fsdp":
        local = fsdp_shard_elements(config, world_size) + parameter_counts(config)["norms"]
        largest = max(rows * cols for rows, cols in sharded_weight_shapes(config))
        buffers = largest * (fsdp_gathered_weights * PRECISIONS[precision]
                             + fsdp_reduce_scatters_in_flight * FP32_BYTES)
        state_elements = local
    else:
        local = total
        buffers = 0
        state_elements = math.ceil(total / world_size) if strategy == "optimizer_state" else total
    if ddp_buckets:
        if strategy == "fsdp":
            raise ValueError("FSDP reduce-scatters gradients itself; it has no DDP buckets")
        buffers += total * FP32_BYTES
    activations = activation_bytes(config, batch_size, seq_len, precision, attention, device_type,
                                   weight_copies=strategy != "fsdp")
    return TrainingMemory(parameters=local * FP32_BYTES, gradients=local * FP32_BYTES,
                          optimizer_state=state_elements * ADAMW_MOMENTS * FP32_BYTES,
                          activations=activations, buffers=buffers)
