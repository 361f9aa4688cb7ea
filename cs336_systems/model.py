"""A pre-norm decoder-only Transformer LM, architecturally identical to the CS336 basics model.

token embedding -> num_layers x [x + attn(RMSNorm(x)), x + SwiGLU(RMSNorm(x))] -> RMSNorm -> LM head

Attention is pluggable by name (see `cs336_systems.attention`); the model knows nothing of ranks,
devices or precisions: wrappers and autocast are applied from outside.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from cs336_systems.attention import get_attention
from cs336_systems.checks import check_positive, check_positive_int

VOCAB_SIZE = 10_000
ROPE_THETA = 10_000.0
RMSNORM_EPS = 1e-5

# The course's benchmark sizes, one table per handout. The Spring 2026 handout moved xl to the 2025
# table's 2.7B shape and added a 10B size; the 2025 table stays selectable because its tests and
# write-ups use it. The sizes in common are the same in both.
_SHARED_SIZES = {
    "small": dict(d_model=768, d_ff=3072, num_layers=12, num_heads=12),
    "medium": dict(d_model=1024, d_ff=4096, num_layers=24, num_heads=16),
    "large": dict(d_model=1280, d_ff=5120, num_layers=36, num_heads=20),
}
SIZE_TABLES: dict[str, dict[str, dict[str, int]]] = {
    "2026": {**_SHARED_SIZES, "xl": dict(d_model=2560, d_ff=10240, num_layers=32, num_heads=32),
             "10B": dict(d_model=4608, d_ff=12288, num_layers=50, num_heads=36)},
    "2025": {**_SHARED_SIZES, "xl": dict(d_model=1600, d_ff=6400, num_layers=48, num_heads=25),
             "2.7B": dict(d_model=2560, d_ff=10240, num_layers=32, num_heads=32)},
}
DEFAULT_SIZE_TABLE = "2026"
# The Spring 2026 handout's leaderboard model, an 8B-class LM with its own vocabulary, timed at batch 2 x
# 32,768 tokens (cs336_systems.benchmarks.leaderboard).
LEADERBOARD = dict(d_model=4096, d_ff=11008, num_layers=34, num_heads=32, vocab_size=151_936, context_length=32_768)
# "tiny" is ours, in every table: a size that runs in seconds on a CPU.
TINY = dict(d_model=64, d_ff=256, num_layers=2, num_heads=4)
# Sizes of both tables in increasing parameter count, for ordering rows.
SIZE_ORDER = ("tiny", "small", "medium", "large", "xl", "2.7B", "10B")


def _check_table(table: str) -> str:
    if table not in SIZE_TABLES:
        raise ValueError(f"unknown size table {table!r}; choose one of {', '.join(SIZE_TABLES)}")
    return table


def model_sizes(table: str = DEFAULT_SIZE_TABLE) -> dict[str, dict[str, int]]:
    """Size name -> d_model, d_ff, num_layers, num_heads, in `table`."""
    return {"tiny": TINY, **SIZE_TABLES[_check_table(table)]}


def size_name(name: str, table: str = DEFAULT_SIZE_TABLE) -> str:
    """The name `table` gives the size `name` spells in any case ("10b" -> "10B", "XL" -> "xl"), so that rows and
    reports carry one spelling; `name` itself where no size of the table matches, for the caller to refuse."""
    return {size.lower(): size for size in model_sizes(table)}.get(name.lower(), name)


def size_order(size: str) -> int:
    return SIZE_ORDER.index(size) if size in SIZE_ORDER else len(SIZE_ORDER)


@dataclass(frozen=True)
class ModelConfig:
    d_model: int
    d_ff: int
    num_layers: int
    num_heads: int
    context_length: int
    vocab_size: int = VOCAB_SIZE
    rope_theta: float = ROPE_THETA

    def __post_init__(self):
        check_positive_int(d_model=self.d_model, d_ff=self.d_ff, num_layers=self.num_layers, num_heads=self.num_heads,
                           context_length=self.context_length, vocab_size=self.vocab_size)
        check_positive(rope_theta=self.rope_theta)
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by num_heads {self.num_heads}")
        if (self.d_model // self.num_heads) % 2:
            raise ValueError(f"RoPE needs an even head dimension, got {self.d_model // self.num_heads}")

    @property
    def d_head(self) -> int:
        return self.d_model // self.num_heads

    @classmethod
    def for_size(cls, size: str, context_length: int, vocab_size: int = VOCAB_SIZE,
                 table: str = DEFAULT_SIZE_TABLE) -> ModelConfig:
        """The config of `size` in the size table `table`: a size name means different models in different
        tables, so whatever keeps a size name keeps its table beside it."""
        sizes = model_sizes(table)
        if size not in sizes:
            elsewhere = [name for name in SIZE_TABLES if size in SIZE_TABLES[name]]
            raise ValueError(f"unknown model size {size!r} in the {table} size table; choose one of "
                             f"{', '.join(sizes)}" + (f" (or select the {elsewhere[0]} table, which has it)"
                                                       if elsewhere else ""))
        return cls(**sizes[size], context_length=context_length, vocab_size=vocab_size)


class Linear(nn.Module):
    """y = x W^T with W stored as (d_out, d_in), no bias, truncated-normal init as in the course."""

    def __init__(self, d_in: int, d_out: int, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d_out, d_in, device=device, dtype=dtype))
        std = math.sqrt(2.0 / (d_in + d_out))
        nn.init.trunc_normal_(self.weight, std=std, a=-3 * std, b=3 * std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, device=device, dtype=dtype))
        nn.init.trunc_normal_(self.weight, std=1.0, a=-3.0, b=3.0)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        # F.embedding, not self.weight[token_ids]: indexing wraps a negative id round to the vocabulary's end,
        # a silent wrong answer, where F.embedding refuses every id outside [0, num_embeddings). On a CPU the
        # ids are checked here first, to name the problem; on a GPU that check would wait for the device every
        # step, and the kernel's own bounds check stops the process instead.
        if token_ids.device.type == "cpu" and not torch.compiler.is_compiling():
            low, high = token_ids.min().item(), token_ids.max().item()
            if low < 0 or high >= self.weight.shape[0]:
                raise ValueError(f"token ids must lie in [0, {self.weight.shape[0]}), the vocabulary; "
                                 f"got ids from {low} to {high}")
        return F.embedding(token_ids, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, d_model: int, eps: float = RMSNORM_EPS, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 at least: the mean of squares overflows fp16 and loses precision in bf16.
        # A float64 input stays float64; rounding it to fp32 here would put fp32 rounding into a
        # float64 model, and results that should agree to float64 precision (a step split over three
        # ranks against the whole batch's) would differ in fp32's last bits.
        in_dtype = x.dtype
        x = x.to(torch.promote_types(in_dtype, torch.float32))
        x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (x * self.weight).to(in_dtype)


class RotaryEmbedding(nn.Module):
    """Rotates each (even, odd) pair of a head's features by position * theta^(-2i/d_head)."""

    def __init__(self, d_head: int, context_length: int, theta: float = ROPE_THETA):
        super().__init__()
        inv_freq = theta ** (-torch.arange(0, d_head, 2, dtype=torch.float64) / d_head)
        angles = torch.outer(torch.arange(context_length, dtype=torch.float64), inv_freq)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x (..., d_head), rotated by the positions, which broadcast against x's dims before the last: (seq,)
        for (..., seq, d_head), (seq, 1) for (batch, seq, heads, d_head)."""
        cos = self.cos[positions].to(x.dtype)
        sin = self.sin[positions].to(x.dtype)
        x_even, x_odd = x[..., 0::2], x[..., 1::2]
        rotated = torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1)
        return rotated.flatten(-2)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig, attention: str):
        super().__init__()
        self.num_heads = config.num_heads
        self.q_proj = Linear(config.d_model, config.d_model)
        self.k_proj = Linear(config.d_model, config.d_model)
        self.v_proj = Linear(config.d_model, config.d_model)
        self.output_proj = Linear(config.d_model, config.d_model)
        self.rope = RotaryEmbedding(config.d_head, config.context_length, config.rope_theta)
        self.attention_name = attention
        self.attention = get_attention(attention)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, d_model = x.shape
        positions = torch.arange(seq, device=x.device)

        def heads(t: torch.Tensor) -> torch.Tensor:  # (batch, seq, d_model) -> (batch, seq, heads, d_head)
            return t.view(batch, seq, self.num_heads, -1)

        # RoPE rotates q and k while the heads still follow the sequence, so its outputs keep that memory
        # order once viewed as (batch, heads, seq, d_head): SDPA's backends and ours give o (and each
        # gradient) in their input's order, and merging o's heads for the output projection is then a view,
        # where a (batch, heads, seq, d_head) o would be copied.
        at = positions[:, None]
        q = self.rope(heads(self.q_proj(x)), at).transpose(1, 2)
        k = self.rope(heads(self.k_proj(x)), at).transpose(1, 2)
        out = self.attention(q, k, heads(self.v_proj(x)).transpose(1, 2), is_causal=True)
        return self.output_proj(out.transpose(1, 2).reshape(batch, seq, d_model))


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.w1 = Linear(d_model, d_ff)
        self.w2 = Linear(d_ff, d_model)
        self.w3 = Linear(d_model, d_ff)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, config: ModelConfig, attention: str):
        super().__init__()
        self.ln1 = RMSNorm(config.d_model)
        self.attn = CausalSelfAttention(config, attention)
        self.ln2 = RMSNorm(config.d_model)
        self.ffn = SwiGLU(config.d_model, config.d_ff)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ffn_sublayer(self.attention_sublayer(x))

    # The two residual sublayers, each a function of the residual stream alone: checkpointing can wrap
    # them one at a time.
    def attention_sublayer(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attn(self.ln1(x))

    def ffn_sublayer(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ffn(self.ln2(x))


class TransformerLM(nn.Module):
    def __init__(self, config: ModelConfig, attention: str = "sdpa"):
        super().__init__()
        self.config = config
        self.token_embeddings = Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(TransformerBlock(config, attention) for _ in range(config.num_layers))
        self.ln_final = RMSNorm(config.d_model)
        self.lm_head = Linear(config.d_model, config.vocab_size)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids (batch, seq) of integers -> logits (batch, seq, vocab_size)."""
        return self.lm_head(self.final_hidden(token_ids))

    def final_hidden(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids (batch, seq) -> the normalised residual stream (batch, seq, d_model) that the LM head reads:
        what a loss fused with the head (cs336_systems.linear_cross_entropy) takes in place of the logits."""
        if token_ids.dim() != 2 or token_ids.numel() == 0:
            raise ValueError(f"token_ids must be (batch, seq) with at least one token, got shape {tuple(token_ids.shape)}")
        if token_ids.dtype.is_floating_point or token_ids.dtype.is_complex or token_ids.dtype == torch.bool:
            raise TypeError(f"token_ids must be integers, got {token_ids.dtype}")
        if token_ids.shape[1] > self.config.context_length:
            raise ValueError(
                f"sequence length {token_ids.shape[1]} exceeds the model's context length "
                f"{self.config.context_length}"
            )
        x = self.token_embeddings(token_ids)
        for layer in self.layers:
            x = layer(x)
        return self.ln_final(x)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
