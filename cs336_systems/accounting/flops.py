"""Closed-form models: FLOPs, memory and communication. Units are in the names (bytes, flops).

FLOP counts use the usual convention: a matmul of (m, k) by (k, n) is 2mkn FLOPs; attention counts
the full n x n score and value matmuls even when causal (as in the Megatron/PaLM MFU formulas);
elementwise work (norms, softmax, SwiGLU gating, RoPE) is left out; backward is twice forward.
"""

from __future__ import annotations

from cs336_systems.checks import check_choice, check_positive_int
from cs336_systems.model import ModelConfig

# A benchmark phase's FLOPs as a multiple of one forward's; the optimizer step's few elementwise
# FLOPs per parameter are not counted (None).
PHASE_FORWARD_MULTIPLES = {"forward": 1, "backward": 2, "forward_backward": 3, "train_step": 3, "optimizer": None}


def forward_flops(config: ModelConfig, batch_size: int, seq_len: int) -> float:
    """Matmul FLOPs of one forward pass of the LM over batch_size x seq_len tokens."""
    check_positive_int(batch_size=batch_size, seq_len=seq_len)
    tokens = batch_size * seq_len
    d, d_ff = config.d_model, config.d_ff
    projections = 2 * tokens * 4 * d * d  # q, k, v, output
    feed_forward = 2 * tokens * 3 * d * d_ff  # w1, w3 up, w2 down
    attention = 2 * 2 * batch_size * seq_len * seq_len * d  # q k^T and weights @ v, all heads
    lm_head = 2 * tokens * d * config.vocab_size
    return config.num_layers * (projections + feed_forward + attention) + lm_head


def step_flops(config: ModelConfig, batch_size: int, seq_len: int, phase: str) -> float | None:
    """FLOPs of a benchmark phase: forward 1x, backward 2x, forward+backward and train step 3x;
    None for the optimizer step (see PHASE_FORWARD_MULTIPLES)."""
    check_choice("phase", phase, PHASE_FORWARD_MULTIPLES)
    multiple = PHASE_FORWARD_MULTIPLES[phase]
    return None if multiple is None else multiple * forward_flops(config, batch_size, seq_len)
