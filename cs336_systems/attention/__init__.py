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


def _flash_pytorch() -> AttentionFn:
    from cs336_systems.attention.flash_pytorch import flash_attention_pytorch

    return flash_attention_pytorch


def _flash_triton() -> AttentionFn:
    from cs336_systems.attention.flash_triton import flash_attention_triton

    return flash_attention_triton


_VARIANTS: dict[str, Callable[[], AttentionFn]] = {
    "naive": _naive,
    "naive_compiled": _naive_compiled,
    "sdpa": _sdpa,
    "flash_pytorch": _flash_pytorch,
    "flash_triton": _flash_triton,
}

ATTENTION_VARIANTS = tuple(_VARIANTS)


def get_attention(name: str) -> AttentionFn:
    if name not in _VARIANTS:
        raise ValueError(f"unknown attention {name!r}; choose one of {', '.join(_VARIANTS)}")
    return _VARIANTS[name]()
