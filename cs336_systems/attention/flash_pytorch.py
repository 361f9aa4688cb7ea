"""FlashAttention-2 in plain PyTorch: a tiled forward with online softmax, and a backward that
recomputes the attention weights from the saved logsumexp L instead of storing them.

It is the readable twin of the Triton version (flash_triton.py) and its debugging reference: the
same input contract (checked by `check_inputs`, shared by both), the same masking, the same saved
tensors. It is not fast; the Python loop over tiles launches many small kernels. Its backward is
one torch.compile'd function that recomputes P for all keys at once, so it holds (n_queries,
n_keys) matrices while it runs; the Triton backward is the one whose memory stays linear.

Contract, for both Functions:
  q (..., n_queries, d), k and v (..., n_keys, d), the same leading (batch, head, ...) dims;
  n_queries and n_keys any length >= 1; d from 1 to MAX_HEAD_DIM; fp32, bf16 or fp16 (all alike);
  non-contiguous views accepted. Output has the input dtype; L is (..., n_queries) in fp32.
  is_causal: query i attends to keys j <= i, positions counted from the start of both sequences
  (top-left alignment, as torch's scaled_dot_product_attention and our naive attention). With
  n_queries > n_keys the late queries see every key; with n_queries < n_keys the trailing keys are
  seen by no query. Every query sees key 0, so no row is fully masked.
  Masked scores get MASKED_SCORE_BIAS added, as the course's reference does.
"""

from __future__ import annotations

import functools
import math
import shutil

import torch

# Tiles of the forward loop, at least 16 x 16 as FlashAttention-2 is specified. Small on purpose:
# short test sequences then cross tile boundaries and the causal diagonal spans several key tiles.
QUERY_TILE_SIZE = 32
KEY_TILE_SIZE = 16

# Added to masked scores (the course's reference value): exp(s - 1e6 - L) is exactly 0 in fp32.
MASKED_SCORE_BIAS = -1e6

# Largest head dimension accepted. The Triton kernels keep a (tile, d) block of Q, K, V and the
# accumulators on chip; their tile table is sized for d <= 128.
MAX_HEAD_DIM = 128
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _meets_contract(q, k, v, is_causal) -> bool:
    """The whole contract in one expression: half of check_inputs' host time in the common case, which
    matters for short sequences, where a call's host time is most of its time."""
    if type(is_causal) is not bool or not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
                                           and isinstance(v, torch.Tensor)):
        return False
    q_shape, k_shape = q.shape, k.shape
    return (q.dtype in SUPPORTED_DTYPES and q.dtype == k.dtype == v.dtype and q.device == k.device == v.device
            and len(q_shape) >= 2 and len(k_shape) >= 2 and k_shape == v.shape and q_shape[:-2] == k_shape[:-2]
            and q_shape[-1] == k_shape[-1] <= MAX_HEAD_DIM and q.numel() > 0 and k.numel() > 0)


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> None:
    """Raise TypeError / ValueError naming the problem if (q, k, v, is_causal) break the contract."""
    if _meets_contract(q, k, v, is_causal):
        return
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} has dtype {t.dtype}; attention needs a floating-point dtype")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; supported are fp32, bf16 and fp16")
        if t.dim() < 2:
            raise ValueError(f"{name} must be (..., sequence, head_dim), got shape {tuple(t.shape)}")
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if not q.shape[:-2] == k.shape[:-2] == v.shape[:-2]:
        raise ValueError(
            f"q, k, v must have the same batch dimensions, got {tuple(q.shape[:-2])}, "
            f"{tuple(k.shape[:-2])}, {tuple(v.shape[:-2])}"
        )
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"k and v must have the same number of keys, got {k.shape[-2]} and {v.shape[-2]}")
    if not q.shape[-1] == k.shape[-1] == v.shape[-1]:
        raise ValueError(f"q, k, v must share one head dimension, got {q.shape[-1]}, {k.shape[-1]}, {v.shape[-1]}")
    if q.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"head dimension {q.shape[-1]} is not supported; the most is {MAX_HEAD_DIM}")
    for name, t in (("q", q), ("k", k)):
        if t.numel() == 0:
            raise ValueError(f"{name} is empty (shape {tuple(t.shape)}); attention needs at least one query and key")


def _causal_keep(query_start: int, n_rows: int, key_start: int, n_cols: int, device) -> torch.Tensor:
    """(n_rows, n_cols) bool tile: True where query i may see key j (j <= i)."""
    rows = torch.arange(query_start, query_start + n_rows, device=device)
    cols = torch.arange(key_start, key_start + n_cols, device=device)
    return cols[None, :] <= rows[:, None]


def flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  is_causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, L) by tiles: for each query tile, one pass over key tiles with a running max m and a
    running softmax denominator l, so no (n_queries, n_keys) matrix is ever formed."""
    n_queries, n_keys, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(d)
    # Compute in fp32 whatever the input dtype, like the on-chip accumulators of the kernel.
    q32, k32, v32 = q.float(), k.float(), v.float()
    o = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    L = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    for q_start in range(0, n_queries, QUERY_TILE_SIZE):
        q_end = min(q_start + QUERY_TILE_SIZE, n_queries)
        q_tile = q32[..., q_start:q_end, :]
        m = torch.full(q_tile.shape[:-1], -math.inf, device=q.device)
        l = torch.zeros(q_tile.shape[:-1], device=q.device)
        acc = torch.zeros_like(q_tile)
        # Keys after the tile's last query are masked for every row: skip their tiles.
        keys_end = min(q_end, n_keys) if is_causal else n_keys
        for k_start in range(0, keys_end, KEY_TILE_SIZE):
            k_end = min(k_start + KEY_TILE_SIZE, n_keys)
            s = q_tile @ k32[..., k_start:k_end, :].transpose(-2, -1) * scale
            if is_causal and k_end - 1 > q_start:  # the tile reaches past the diagonal
                keep = _causal_keep(q_start, q_end - q_start, k_start, k_end - k_start, q.device)
                s = torch.where(keep, s, s + MASKED_SCORE_BIAS)
            m_new = torch.maximum(m, s.amax(dim=-1))
            p = torch.exp(s - m_new[..., None])
            correction = torch.exp(m - m_new)  # rescales what was summed under the old maximum
            l = correction * l + p.sum(dim=-1)
            acc = correction[..., None] * acc + p @ v32[..., k_start:k_end, :]
            m = m_new
        o[..., q_start:q_end, :] = acc / l[..., None]
        L[..., q_start:q_end] = m + torch.log(l)
    return o.to(q.dtype), L


def _attention_gradients(q, k, v, o, do, L, is_causal: bool):
    """dq, dk, dv by recomputation (FlashAttention-2, eqs. 13-19), all (batch, n, d) fp32.

    P = exp(S - L) needs no softmax, and D = rowsum(dO * O) = rowsum(P * dP) replaces the
    softmax Jacobian. The (n_queries, n_keys) matrices exist only inside this function.
    """
    scale = q.shape[-1] ** -0.5  # from the (symbolic) shape, so no recompile per head dimension
    D = (do * o).sum(dim=-1, keepdim=True)
    s = q @ k.transpose(-2, -1) * scale
    if is_causal:
        keys, queries = torch.arange(k.shape[-2], device=q.device), torch.arange(q.shape[-2], device=q.device)
        keep = keys[None, :] <= queries[:, None]
        s = torch.where(keep, s, s + MASKED_SCORE_BIAS)
    p = torch.exp(s - L[..., None])
    dv = p.transpose(-2, -1) @ do
    dp = do @ v.transpose(-2, -1)
    ds = p * (dp - D)
    return ds @ k * scale, ds.transpose(-2, -1) @ q * scale, dv


def _compile_available(device: torch.device) -> bool:
    """torch.compile needs Triton on a GPU (always shipped with CUDA torch) and a C++ compiler on a CPU."""
    if device.type == "cuda":
        return True
    from torch._inductor import config as inductor_config

    return shutil.which(inductor_config.cpp.cxx[-1]) is not None


@functools.cache
def _gradients_fn(device_type: str):
    """The compiled gradient function, built on first use (compiling costs seconds).

    dynamic=True: one graph serves every sequence length and head dimension instead of one compile
    per shape. Where no compiler exists (a CPU machine without a C++ toolchain) the same function
    runs eagerly: identical math, only slower.
    """
    if _compile_available(torch.device(device_type)):
        return torch.compile(_attention_gradients, dynamic=True)
    return _attention_gradients


# Opaque to torch.compile: dynamo (torch 2.11) traced this backward, inlined into an enclosing graph,
# into wrong gradients; run as is, it calls the gradient function compiled on its own.
@torch.compiler.disable
def flash_backward(q, k, v, o, L, do, is_causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv in the dtypes and shapes of q, k, v."""

    def flat32(t: torch.Tensor) -> torch.Tensor:  # leading dims folded into one batch dim, fp32
        return t.reshape(-1, *t.shape[-2:]).float()

    gradients = _gradients_fn(q.device.type)
    dq, dk, dv = gradients(flat32(q), flat32(k), flat32(v), flat32(o), flat32(do),
                           L.reshape(-1, L.shape[-1]), is_causal)
    return dq.view(q.shape).to(q.dtype), dk.view(k.shape).to(k.dtype), dv.view(v.shape).to(v.dtype)


class FlashAttentionPytorch(torch.autograd.Function):
    """FlashAttention-2 in PyTorch. apply(q, k, v, is_causal=False) -> o; saves L, q, k, v, o."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
        check_inputs(q, k, v, is_causal)
        o, L = flash_forward(q, k, v, is_causal)
        ctx.save_for_backward(L, q, k, v, o)
        ctx.is_causal = is_causal
        return o

    @staticmethod
    def backward(ctx, do: torch.Tensor):
        L, q, k, v, o = ctx.saved_tensors
        dq, dk, dv = flash_backward(q, k, v, o, L, do, ctx.is_causal)
        return dq, dk, dv, None


def flash_attention_pytorch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
    """FlashAttentionPytorch as an attention function (q, k, v, is_causal) -> o."""
    return FlashAttentionPytorch.apply(q, k, v, is_causal)
