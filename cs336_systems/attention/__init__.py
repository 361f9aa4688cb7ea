"""Attention implementations, each a function (q, k, v, is_causal=False) -> output.

q is (..., n_queries, d), k and v are (..., n_keys, d). The model picks one by name.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

AttentionFn = Callable[..., torch.Tensor]


def _naive() -> AttentionFn:
    from cs336_systems.attention.reference import naive_attention

    return naive_attention


def _naive_compiled() -> AttentionFn:
    from cs336_systems.attention.reference import compiled_naive_attention

    return compiled_naive_attention


def _sdpa() -> AttentionFn:
    from cs336_systems.attention.reference import sdpa_attention

    return sdpa_attention


_VARIANTS: dict[str, Callable[[], AttentionFn]] = {
    "naive": _naive,
    "naive_compiled": _naive_compiled,
    "sdpa": _sdpa,
}

ATTENTION_VARIANTS = tuple(_VARIANTS)


def get_attention(name: str) -> AttentionFn:
    if name not in _VARIANTS:
        raise ValueError(f"unknown attention {name!r}; choose one of {', '.join(_VARIANTS)}")
    return _VARIANTS[name]()
