"""Reference attention: the materialised naive version (annotated for profilers), its compiled
twin, and PyTorch's scaled_dot_product_attention."""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from cs336_systems.profiling.ranges import annotate


def causal_mask(n_queries: int, n_keys: int, device: torch.device) -> torch.Tensor:
    """True where query i may attend to key j (j <= i), positions aligned at the start."""
    return torch.arange(n_queries, device=device)[:, None] >= torch.arange(n_keys, device=device)[None, :]


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v with the full (n_queries, n_keys) score matrix in memory."""
    with annotate("attention/scores"):
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        if is_causal:
            mask = causal_mask(q.shape[-2], k.shape[-2], q.device)
            scores = scores.masked_fill(~mask, float("-inf"))
    with annotate("attention/softmax"):
        weights = torch.softmax(scores, dim=-1)
    with annotate("attention/final_matmul"):
        return weights @ v


@functools.cache
def _compiled_naive():
    return torch.compile(naive_attention)


def compiled_naive_attention(q, k, v, is_causal: bool = False) -> torch.Tensor:
    return _compiled_naive()(q, k, v, is_causal=is_causal)


def sdpa_attention(q, k, v, is_causal: bool = False) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
