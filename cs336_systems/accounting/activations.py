"""Closed-form activation memory of our LM, and a peak-memory predictor for inference and training.

Saved activations are counted op by op from what autograd keeps for backward in
`cs336_systems.model` (T = batch * seq tokens, d = d_model, f = d_ff, h = heads, N = seq):

- RMSNorm (x -> x * rsqrt(mean(x^2) + eps) * w) keeps its input x, the normalised x and the
  per-token rsqrt: 2 T d fp32 + T fp32. The model's parameters are fp32 and the embedding output is
  fp32, so the residual stream stays fp32 under autocast (fp32 + bf16 promotes to fp32): norms are
  fp32 in every precision.
- A Linear keeps its input. In fp32, q/k/v share one input tensor (and w1/w3 another); under autocast
  each Linear casts the fp32 norm output to bf16 itself, so q, k and v keep three bf16 copies and w1,
  w3 two. Autocast also keeps the bf16 copy of every weight for backward (2 bytes per weight).
- RoPE multiplies by cos/sin tables that need no gradient, so it keeps only the tables (4 tensors of
  N x d_head/2) and not its input.
- Naive attention keeps the rotated q and k (q k^T), the softmax output P (B h N^2) and a contiguous
  copy of v (P v reshapes the transposed v view), the causal mask (N^2 bools), and the head-merge copy
  that feeds the output projection. On CUDA, autocast runs softmax in fp32, so P is kept in fp32 and
  again as the bf16 copy P v casts it to: 6 bytes per score against 4 in fp32; CPU autocast runs
  softmax in bf16 (2 bytes).
- SDPA keeps q, k, v, its output and a logsumexp (B h N fp32), no N^2 term. Its backends, on CUDA and on
  CPU, lay the output out as q, whose heads follow the sequence in memory (the model rotates them in that
  order), so the head merge is a view.
- SwiGLU keeps w1's output (SiLU input), SiLU's output, w3's output and their product (w2's input):
  4 T f in the activation dtype.
- The head keeps the final norm's three tensors, the LM head's input and the log-softmax output of the
  loss (T x vocab, fp32 in both precisions: autocast runs log_softmax in fp32).

`tests/test_memory_model.py` checks these counts against the tensors autograd really saves.
"""

from __future__ import annotations

from dataclasses import dataclass

from cs336_systems.checks import check_choice, check_positive_int
from cs336_systems.model import ModelConfig
from cs336_systems.precision import Precision, check_precision

FP32_BYTES = 4
BOOL_BYTES = 1
ATTENTIONS = ("naive", "sdpa")
DEVICE_TYPES = ("cuda", "cpu")
# AdamW keeps two fp32 moments per parameter.
ADAMW_STATE_PER_PARAMETER = 2
MEMORY_MODES = ("inference", "forward_backward", "train_step")
# AdamW implementations and the temporary each allocates in its step: the course's (cs336_systems.optimizer)
# computes sqrt of the second moment one parameter at a time (the largest parameter's worth), foreach (torch's
# default on CUDA) for every parameter at once (one more copy of the parameters), fused updates in place.
ADAMW_IMPLEMENTATIONS = ("course", "foreach", "fused")


def _check(batch_size: int, seq_len: int, precision: str, attention: str = "naive", device_type: str = "cuda") -> None:
    check_positive_int(batch_size=batch_size, seq_len=seq_len)
    check_precision(precision)
    if attention not in ATTENTIONS:
        raise ValueError(f"no activation model for attention {attention!r}; choose one of {', '.join(ATTENTIONS)}")
    check_choice("device type", device_type, DEVICE_TYPES)


def _activation_bytes(precision: str) -> int:
    """Bytes of an activation a matmul produces: autocast's dtype, or fp32 without autocast."""
    return Precision.named(precision).bytes_per_element


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


def largest_parameter_count(config: ModelConfig) -> int:
    """Elements of the model's largest parameter: the embedding or LM head (vocab x d_model), or a
    feed-forward weight (d_ff x d_model)."""
    return max(config.vocab_size, config.d_ff, config.d_model) * config.d_model


def adamw_step_temporary_bytes(config: ModelConfig, adamw: str) -> int:
    """What an AdamW step allocates beside parameters, gradients and moments (fp32 parameters)."""
    check_choice("AdamW implementation", adamw, ADAMW_IMPLEMENTATIONS)
    per_parameter = {"course": largest_parameter_count(config), "foreach": parameter_count(config), "fused": 0}
    return per_parameter[adamw] * FP32_BYTES


def matmul_weight_count(config: ModelConfig) -> int:
    """Parameters that go through a matmul (every Linear): the ones autocast casts to bf16."""
    counts = parameter_counts(config)
    return counts["attention"] + counts["feed_forward"] + counts["lm_head"]


def residual_stream_bytes(config: ModelConfig, batch_size: int, seq_len: int) -> int:
    """One residual-stream tensor (batch, seq, d_model). Always fp32: the embedding output is fp32 and
    adding a bf16 sublayer output to it promotes back to fp32, so autocast does not change it."""
    check_positive_int(batch_size=batch_size, seq_len=seq_len)
    return batch_size * seq_len * config.d_model * FP32_BYTES


def block_saved_bytes(config: ModelConfig, batch_size: int, seq_len: int, precision: str = "fp32",
                      attention: str = "naive", device_type: str = "cuda") -> dict[str, int]:
    """Bytes one Transformer block keeps for backward, by component (see the module docstring)."""
    _check(batch_size, seq_len, precision, attention, device_type)
    act = _activation_bytes(precision)
    low = precision != "fp32"
    t, n = batch_size * seq_len, seq_len
    d, f, h, dh = config.d_model, config.d_ff, config.num_heads, config.d_head
    scores = batch_size * h * n * n
    norm = 2 * t * d * FP32_BYTES + t * FP32_BYTES
    parts = {
        "attention_norm": norm,
        "qkv_inputs": 3 * t * d * act if low else t * d * FP32_BYTES,
        "rope_tables": 4 * n * (dh // 2) * act,
    }
    if attention == "naive":
        softmax_bytes = FP32_BYTES if (device_type == "cuda" or not low) else act
        cast_for_pv = act if low and device_type == "cuda" else 0
        parts["attention_qkv"] = 3 * t * d * act  # rotated q, rotated k, contiguous v
        parts["attention_scores"] = scores * (softmax_bytes + cast_for_pv)
        parts["causal_mask"] = n * n * BOOL_BYTES
        parts["output_proj_input"] = t * d * act
    else:
        parts["attention_qkv"] = 4 * t * d * act  # q, k, v and the output
        parts["logsumexp"] = batch_size * h * n * FP32_BYTES
    parts["ffn_norm"] = norm
    parts["ffn_inputs"] = 2 * t * d * act if low else t * d * FP32_BYTES
    parts["ffn_hidden"] = 4 * t * f * act
    if low:
        parts["weight_casts"] = (4 * d * d + 3 * d * f) * act
    return parts


# The parts of block_saved_bytes that the feed-forward sublayer keeps (the rest, the attention sublayer's); of
# autocast's weight copies, the attention projections' 4 d^2 and the feed-forward's 3 d d_ff.
FFN_PARTS = ("ffn_norm", "ffn_inputs", "ffn_hidden")


def sublayer_saved_bytes(config: ModelConfig, batch_size: int, seq_len: int, precision: str = "fp32",
                         attention: str = "naive", device_type: str = "cuda") -> tuple[int, int]:
    """(attention sublayer, feed-forward sublayer) bytes of `block_saved_bytes`: what each keeps for backward,
    its input included (each RMSNorm keeps the residual stream it normalises)."""
    parts = block_saved_bytes(config, batch_size, seq_len, precision, attention, device_type)
    casts = parts.pop("weight_casts", 0)
    d, f = config.d_model, config.d_ff
    ffn_casts = casts * 3 * d * f // (4 * d * d + 3 * d * f)
    ffn = sum(parts[name] for name in FFN_PARTS) + ffn_casts
    attention_part = sum(size for name, size in parts.items() if name not in FFN_PARTS) + casts - ffn_casts
    return attention_part, ffn


def head_saved_bytes(config: ModelConfig, batch_size: int, seq_len: int, precision: str = "fp32") -> dict[str, int]:
    """Bytes the final norm, LM head and cross-entropy loss keep for backward."""
    _check(batch_size, seq_len, precision)
    act = _activation_bytes(precision)
    t, d, v = batch_size * seq_len, config.d_model, config.vocab_size
    parts = {
        "final_norm": 2 * t * d * FP32_BYTES + t * FP32_BYTES,
        "lm_head_input": t * d * act,
        "log_softmax": t * v * FP32_BYTES,
        "loss_total_weight": FP32_BYTES,  # nll_loss keeps the sum of its class weights, one fp32 scalar
    }
    if precision != "fp32":
        parts["lm_head_weight_cast"] = v * d * act
    return parts


# The parts that are autocast's low-precision weight copies, kept by each Linear for backward.
WEIGHT_COPY_PARTS = ("weight_casts", "lm_head_weight_cast")


def saved_activation_bytes(config: ModelConfig, batch_size: int, seq_len: int, precision: str = "fp32",
                           attention: str = "naive", device_type: str = "cuda", weight_copies: bool = True) -> int:
    """Everything a forward pass (with the loss) keeps for backward, over all blocks and the head.
    `weight_copies=False` leaves out autocast's weight copies (FSDP gathers weights one layer at a time
    and drops them after use)."""
    def total(parts: dict[str, int]) -> int:
        return sum(size for name, size in parts.items() if weight_copies or name not in WEIGHT_COPY_PARTS)

    block = total(block_saved_bytes(config, batch_size, seq_len, precision, attention, device_type))
    return config.num_layers * block + total(head_saved_bytes(config, batch_size, seq_len, precision))


def _score_bytes(config: ModelConfig, batch_size: int, seq_len: int) -> int:
    return batch_size * config.num_heads * seq_len * seq_len


def inference_transient_bytes(config: ModelConfig, batch_size: int, seq_len: int, precision: str = "fp32",
                              attention: str = "naive") -> int:
    """The most activation memory alive at once in a no-grad forward (CUDA autocast rules).

    Nothing is kept between blocks except the residual stream, so the peak is inside one block or the
    head: the residual and the norm output (fp32), plus the attention stage (rotated q, k and v, and
    for naive attention the masked scores beside the fp32 softmax output, with the fp32 copy softmax
    makes of bf16 scores), the SwiGLU stage (SiLU output, w3 output and their product), or the logits.
    """
    _check(batch_size, seq_len, precision, attention)
    act = _activation_bytes(precision)
    t, d, f, v = batch_size * seq_len, config.d_model, config.d_ff, config.vocab_size
    carried = 2 * t * d * FP32_BYTES
    if attention == "naive":
        bytes_per_score = act + FP32_BYTES + (FP32_BYTES if precision != "fp32" else 0)
        attention_stage = 3 * t * d * act + _score_bytes(config, batch_size, seq_len) * bytes_per_score
    else:
        attention_stage = 4 * t * d * act
    return carried + max(attention_stage, 3 * t * f * act, t * v * act)


def training_transient_bytes(config: ModelConfig, batch_size: int, seq_len: int, precision: str = "fp32",
                             attention: str = "naive") -> int:
    """Temporaries alive beside the saved activations in forward and backward (CUDA autocast rules).

    The largest are the loss's gradients (d loss / d log-softmax and d loss / d logits, fp32, plus
    the bf16 copy of the latter under autocast), two score-sized tensors in naive attention (scores
    before and after masking in forward; the gradients of P and of the scores in backward), and the
    gradients of q, k and v in SDPA's backward.
    """
    _check(batch_size, seq_len, precision, attention)
    act = _activation_bytes(precision)
    t, d, v = batch_size * seq_len, config.d_model, config.vocab_size
    loss_gradients = t * v * (2 * FP32_BYTES + (act if precision != "fp32" else 0))
    if attention == "naive":
        attention_gradients = 2 * _score_bytes(config, batch_size, seq_len) * FP32_BYTES
    else:
        attention_gradients = 3 * t * d * act
    return max(loss_gradients, attention_gradients)


@dataclass(frozen=True)
class MemoryPrediction:
    """Predicted bytes by component and the peak; `peak_phase` names where the peak falls."""
    mode: str
    parameters_bytes: int
    gradients_bytes: int
    optimizer_state_bytes: int
    saved_activations_bytes: int
    autocast_weight_cache_bytes: int
    transient_bytes: int
    peak_bytes: int
    peak_phase: str


def predict_peak_memory(config: ModelConfig, batch_size: int, seq_len: int, precision: str = "fp32",
                        attention: str = "naive", mode: str = "train_step",
                        adamw: str = "foreach") -> MemoryPrediction:
    """Peak device memory of one inference forward, one forward+backward or one steady-state AdamW
    training step on CUDA.

    Inference (no grad): parameters, plus under autocast the bf16 copies of every matmul weight (the
    autocast cache keeps them until the autocast region exits), plus the forward's transient peak.

    Training step (after a first step created the AdamW state): the peak is the larger of two moments.
    At the end of forward the parameters, AdamW state (2P) and every saved activation are alive, with
    the loss's or attention's temporaries on top. During backward, activations are freed about as fast
    as gradients appear, so the end of backward (P + 2P + G) is below the optimizer step, where foreach
    AdamW allocates one more parameter-sized temporary (sqrt of the second moment) beside parameters,
    gradients and state: 5P, with P the bytes of the fp32 parameters (fp32 under autocast too); fused
    AdamW updates in place, 4P; the course's AdamW allocates that temporary one parameter at a time,
    4P plus the largest parameter. Forward+backward has no AdamW state: the larger of the end of forward
    and the end of backward (P + G).
    """
    check_choice("mode", mode, MEMORY_MODES)
    step_temporary = adamw_step_temporary_bytes(config, adamw)
    _check(batch_size, seq_len, precision, attention)
    params = parameter_count(config) * FP32_BYTES
    cast_weights = matmul_weight_count(config) * _activation_bytes(precision) if precision != "fp32" else 0
    if mode == "inference":
        transient = inference_transient_bytes(config, batch_size, seq_len, precision, attention)
        return MemoryPrediction(mode, params, 0, 0, 0, cast_weights, transient,
                                params + cast_weights + transient, "forward")
    grads = params
    state = ADAMW_STATE_PER_PARAMETER * params if mode == "train_step" else 0
    saved = saved_activation_bytes(config, batch_size, seq_len, precision, attention)
    transient = training_transient_bytes(config, batch_size, seq_len, precision, attention)
    # Under autocast, the weight copies are among the saved activations (each Linear keeps its own).
    moments = [("end of forward", params + state + saved + transient)]
    if mode == "train_step":
        moments.append(("optimizer step", params + grads + state + step_temporary))
    else:
        moments.append(("end of backward", params + grads))
    phase, peak = max(moments, key=lambda p: p[1])
    return MemoryPrediction(mode, params, grads, state, saved, 0, transient, peak, phase)


def state_bytes(prediction: MemoryPrediction) -> int:
    """Parameters, gradients and optimizer state: memory a step needs whatever the batch or context."""
    return prediction.parameters_bytes + prediction.gradients_bytes + prediction.optimizer_state_bytes
