"""FlashAttention-2 in Triton: the forward kernel, the two backward kernels (dQ over query tiles,
which also writes D = rowsum(dO * O), then dK/dV over key tiles, so no atomics), and the
autograd.Function that launches them.

The input contract (shapes, dtypes, causal alignment, L) is flash_pytorch's, checked by the same
`check_inputs`. Leading dims are viewed as (batch, heads) and addressed by stride, so transposed
heads and views out of a fused QKV projection are read in place.

Speed structure:
  - Scores are kept in base 2: S * log2(e) = q k^T * (log2(e) / sqrt(d)), one multiply, then exp2.
    L is stored in natural-log units, as the contract says.
  - Causal: key tiles wholly above the diagonal are never visited; the tiles that straddle it (and a
    partial tail tile) go through a masked copy of the loop, all other tiles through an unmasked one.
  - Tile sizes, warps and pipeline stages come from TILE_TABLE, per head dimension and dtype, as
    measured by scripts/tune_flash.py; grids too small to fill the GPU take narrower forward tiles.
  - Launch order (_program_tile): the forward and dQ start the longest query tiles of every head
    first; dK/dV keeps a head's key tiles together so they share its queries in L2.
  - TUNING.md holds each version's prediction and measured time.

Under TRITON_INTERPRET=1 (no GPU) the kernels run on CPU tensors in the interpreter, with small
tiles (INTERPRETER_TILES) so short test sequences cross tile boundaries. The interpreter computes
bf16 tl.dot wrongly, so bf16 is refused there.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from cs336_systems.attention.flash_pytorch import MASKED_SCORE_BIAS, check_inputs

LOG2E = math.log2(math.e)
# The kernels see these as compile-time constants (Triton reads only constexpr globals).
_LOG2E = tl.constexpr(LOG2E)
_LN2 = tl.constexpr(math.log(2.0))
_MASKED_SCORE_BIAS_LOG2 = tl.constexpr(MASKED_SCORE_BIAS * LOG2E)  # the bias in base-2 score units
# tl.dot needs every dimension to be at least 16; smaller head dims are zero-padded on chip.
MIN_DOT_DIM = 16
# Sizes are not specialised on (Triton would otherwise compile a variant for every length that is 1
# or a multiple of 16); strides still are, since their alignment is what lets loads vectorise.
_SIZE_ARGS = ["n_heads", "n_queries", "n_keys"]


# ------------------------------------------------------------------------------------------ kernels

@triton.jit
def _load_rows(ptrs, rows, n_rows, offs_d, CHECK_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """A (rows, BLOCK_D) tile; rows past n_rows and columns past HEAD_DIM read as zero."""
    if CHECK_ROWS:
        if BLOCK_D == HEAD_DIM:
            tile = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
        else:
            tile = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    else:
        if BLOCK_D == HEAD_DIM:
            tile = tl.load(ptrs)
        else:
            tile = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    return tile


@triton.jit
def _program_tile(n_rows, n_heads, BLOCK: tl.constexpr, HEADS_FASTEST: tl.constexpr):
    """(batch x head, batch, head, tile index) of this program, in a 1-D grid of batch x heads x
    tiles; batch and head are int64, since batch offsets of long sequences pass 2^31.

    Programs start roughly in launch order. HEADS_FASTEST gives every head's last tile first, then
    every head's last but one, and so on: under a causal mask the forward's and dQ's last query
    tiles see the most keys, so the longest programs start first and the final wave is short.
    Otherwise a head's tiles run together, in order: dK/dV's first key tiles are its longest, and
    its programs, which all stream the same head's queries, share them in L2 (measured faster
    for dK/dV, slower for the forward and dQ; TUNING.md).
    """
    n_tiles = tl.cdiv(n_rows, BLOCK)
    pid = tl.program_id(0)
    if HEADS_FASTEST:
        n_batch_heads = tl.num_programs(0) // n_tiles
        pid_bh = pid % n_batch_heads
        tile = n_tiles - 1 - pid // n_batch_heads
    else:
        pid_bh = pid // n_tiles
        tile = pid % n_tiles
    return pid_bh, (pid_bh // n_heads).to(tl.int64), (pid_bh % n_heads).to(tl.int64), tile


@triton.jit
def _tile_ptrs(base, batch, head, stride_b, stride_h, stride_n, rows, offs_d):
    """Pointers to the (rows, BLOCK_D) tile of one (batch, head) of a (batch, heads, n, d) tensor."""
    return base + batch * stride_b + head * stride_h + rows[:, None] * stride_n + offs_d[None, :]


@triton.jit
def _store_rows(ptrs, tile, rows, n_rows, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    if BLOCK_D == HEAD_DIM:
        tl.store(ptrs, tile, mask=rows[:, None] < n_rows)
    else:
        tl.store(ptrs, tile, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def _forward_key_loop(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, key_start, key_end,
                      offs_m, offs_n, offs_d, n_keys, qk_scale,
                      MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    """Online softmax over key tiles [key_start, key_end); MASKED applies the key-bound and causal
    masks, for tiles on the diagonal or past the end of the keys."""
    for start_n in range(key_start, key_end, BLOCK_N):
        cols = start_n + offs_n
        k = _load_rows(k_base + cols[:, None] * stride_kn + offs_d[None, :], cols, n_keys, offs_d,
                       MASKED, HEAD_DIM, BLOCK_D)
        qk = tl.dot(q, tl.trans(k))
        if MASKED:
            s = qk * qk_scale  # scores in base-2 units
            if IS_CAUSAL:
                s = tl.where(cols[None, :] <= offs_m[:, None], s, s + _MASKED_SCORE_BIAS_LOG2)
            s = tl.where(cols[None, :] < n_keys, s, float("-inf"))  # keys that do not exist
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.math.exp2(s - m_new[:, None])
        else:
            # The row max of the unscaled scores (the scale is positive), so that scaling and
            # subtracting the max is one fused multiply-add per score.
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        correction = tl.math.exp2(m_i - m_new)
        l_i = l_i * correction + tl.sum(p, 1)
        v = _load_rows(v_base + cols[:, None] * stride_vn + offs_d[None, :], cols, n_keys, offs_d,
                       MASKED, HEAD_DIM, BLOCK_D)
        acc = tl.dot(p.to(v.dtype), v, acc * correction[:, None])
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=_SIZE_ARGS)
def _forward_kernel(Q, K, V, O, L,
                    stride_qb, stride_qh, stride_qn,
                    stride_kb, stride_kh, stride_kn,
                    stride_vb, stride_vh, stride_vn,
                    stride_ob, stride_oh, stride_on,
                    n_heads, n_queries, n_keys, qk_scale,
                    IS_CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per (batch x head, query tile): o and L for BLOCK_M queries."""
    pid_bh, batch, head, pid_m = _program_tile(n_queries, n_heads, BLOCK_M, True)
    q_start = pid_m * BLOCK_M
    offs_m = q_start + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k_base = K + batch * stride_kb + head * stride_kh
    v_base = V + batch * stride_vb + head * stride_vh
    q = _load_rows(_tile_ptrs(Q, batch, head, stride_qb, stride_qh, stride_qn, offs_m, offs_d),
                   offs_m, n_queries, offs_d, True, HEAD_DIM, BLOCK_D)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    full_keys_end = (n_keys // BLOCK_N) * BLOCK_N  # key tiles before this need no bound mask
    if IS_CAUSAL:
        # Tiles before the query tile are wholly below the diagonal (BLOCK_M is a multiple of
        # BLOCK_N); tiles after it are wholly above and skipped.
        masked_start = tl.minimum(q_start, full_keys_end)
        masked_end = tl.minimum(q_start + BLOCK_M, n_keys)
    else:
        masked_start = full_keys_end
        masked_end = n_keys
    acc, l_i, m_i = _forward_key_loop(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, 0, masked_start,
                                      offs_m, offs_n, offs_d, n_keys, qk_scale,
                                      False, IS_CAUSAL, HEAD_DIM, BLOCK_D, BLOCK_N)
    acc, l_i, m_i = _forward_key_loop(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, masked_start,
                                      masked_end, offs_m, offs_n, offs_d, n_keys, qk_scale,
                                      True, IS_CAUSAL, HEAD_DIM, BLOCK_D, BLOCK_N)

    o = acc / l_i[:, None]
    _store_rows(_tile_ptrs(O, batch, head, stride_ob, stride_oh, stride_on, offs_m, offs_d),
                o.to(O.dtype.element_ty), offs_m, n_queries, offs_d, HEAD_DIM, BLOCK_D)
    lse = (m_i + tl.math.log2(l_i)) * _LN2  # base 2 -> natural log
    tl.store(L + pid_bh.to(tl.int64) * n_queries + offs_m, lse, mask=offs_m < n_queries)


@triton.jit
def _dkdv_query_loop(dk, dv, k, v, q_base, do_base, l_base, delta_base, stride_qn, stride_don,
                     query_start, query_end, cols, offs_m, offs_d, n_queries, qk_scale,
                     CHECK_ROWS: tl.constexpr, CAUSAL_MASK: tl.constexpr,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """Accumulate dK and dV of one key tile over query tiles [query_start, query_end).

    Works on transposed tiles (keys x queries) so that dV = P^T dO and dK = dS^T Q are plain dots.
    Query rows past n_queries load as zero with L = +inf, so their P, and every term, is zero.
    """
    for start_m in range(query_start, query_end, BLOCK_M):
        rows = start_m + offs_m
        q = _load_rows(q_base + rows[:, None] * stride_qn + offs_d[None, :], rows, n_queries, offs_d,
                       CHECK_ROWS, HEAD_DIM, BLOCK_D)
        do = _load_rows(do_base + rows[:, None] * stride_don + offs_d[None, :], rows, n_queries, offs_d,
                        CHECK_ROWS, HEAD_DIM, BLOCK_D)
        if CHECK_ROWS:
            lse = tl.load(l_base + rows, mask=rows < n_queries, other=float("inf"))
            delta = tl.load(delta_base + rows, mask=rows < n_queries, other=0.0)
        else:
            lse = tl.load(l_base + rows)
            delta = tl.load(delta_base + rows)
        s_t = tl.dot(k, tl.trans(q)) * qk_scale
        p_t = tl.math.exp2(s_t - lse[None, :] * _LOG2E)
        if CAUSAL_MASK:
            p_t = tl.where(rows[None, :] >= cols[:, None], p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv)
        dp_t = tl.dot(v, tl.trans(do))
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk)
    return dk, dv


@triton.jit(do_not_specialize=_SIZE_ARGS)
def _dkdv_kernel(Q, K, V, DO, L, Delta, DK, DV,
                 stride_qb, stride_qh, stride_qn,
                 stride_kb, stride_kh, stride_kn,
                 stride_vb, stride_vh, stride_vn,
                 stride_dob, stride_doh, stride_don,
                 stride_dkb, stride_dkh, stride_dkn,
                 stride_dvb, stride_dvh, stride_dvn,
                 n_heads, n_queries, n_keys, qk_scale, sm_scale,
                 IS_CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per (batch x head, key tile): dK and dV for BLOCK_N keys, in one pass over
    the queries that can see them."""
    pid_bh, batch, head, pid_n = _program_tile(n_keys, n_heads, BLOCK_N, False)
    k_start = pid_n * BLOCK_N
    cols = k_start + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    # Key rows past n_keys load as zero; their dK and dV rows are never stored.
    k = _load_rows(_tile_ptrs(K, batch, head, stride_kb, stride_kh, stride_kn, cols, offs_d),
                   cols, n_keys, offs_d, True, HEAD_DIM, BLOCK_D)
    v = _load_rows(_tile_ptrs(V, batch, head, stride_vb, stride_vh, stride_vn, cols, offs_d),
                   cols, n_keys, offs_d, True, HEAD_DIM, BLOCK_D)
    q_base = Q + batch * stride_qb + head * stride_qh
    do_base = DO + batch * stride_dob + head * stride_doh
    l_base = L + pid_bh.to(tl.int64) * n_queries
    delta_base = Delta + pid_bh.to(tl.int64) * n_queries

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    full_queries_end = (n_queries // BLOCK_M) * BLOCK_M  # query tiles before this need no bound mask
    if IS_CAUSAL:
        # Queries before the key tile see none of its keys; the query tiles level with it straddle
        # the diagonal (BLOCK_N is a multiple of BLOCK_M); later ones see all of it.
        diagonal_end = tl.minimum(k_start + BLOCK_N, n_queries)
        dk, dv = _dkdv_query_loop(dk, dv, k, v, q_base, do_base, l_base, delta_base, stride_qn, stride_don,
                                  k_start, diagonal_end, cols, offs_m, offs_d, n_queries, qk_scale,
                                  True, True, HEAD_DIM, BLOCK_D, BLOCK_M)
        unmasked_start = k_start + BLOCK_N
    else:
        unmasked_start = 0
    dk, dv = _dkdv_query_loop(dk, dv, k, v, q_base, do_base, l_base, delta_base, stride_qn, stride_don,
                              unmasked_start, full_queries_end, cols, offs_m, offs_d, n_queries, qk_scale,
                              False, False, HEAD_DIM, BLOCK_D, BLOCK_M)
    dk, dv = _dkdv_query_loop(dk, dv, k, v, q_base, do_base, l_base, delta_base, stride_qn, stride_don,
                              tl.maximum(unmasked_start, full_queries_end), n_queries, cols, offs_m, offs_d,
                              n_queries, qk_scale, True, False, HEAD_DIM, BLOCK_D, BLOCK_M)

    _store_rows(_tile_ptrs(DK, batch, head, stride_dkb, stride_dkh, stride_dkn, cols, offs_d),
                (dk * sm_scale).to(DK.dtype.element_ty), cols, n_keys, offs_d, HEAD_DIM, BLOCK_D)
    _store_rows(_tile_ptrs(DV, batch, head, stride_dvb, stride_dvh, stride_dvn, cols, offs_d),
                dv.to(DV.dtype.element_ty), cols, n_keys, offs_d, HEAD_DIM, BLOCK_D)


@triton.jit
def _dq_key_loop(dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_vn, key_start, key_end,
                 offs_m, offs_n, offs_d, n_keys, qk_scale,
                 MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    """Accumulate dQ of one query tile over key tiles [key_start, key_end)."""
    for start_n in range(key_start, key_end, BLOCK_N):
        cols = start_n + offs_n
        k = _load_rows(k_base + cols[:, None] * stride_kn + offs_d[None, :], cols, n_keys, offs_d,
                       MASKED, HEAD_DIM, BLOCK_D)
        v = _load_rows(v_base + cols[:, None] * stride_vn + offs_d[None, :], cols, n_keys, offs_d,
                       MASKED, HEAD_DIM, BLOCK_D)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        p = tl.math.exp2(s - lse[:, None])
        if MASKED:
            keep = cols[None, :] < n_keys
            if IS_CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None])
            p = tl.where(keep, p, 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq)
    return dq


@triton.jit(do_not_specialize=_SIZE_ARGS)
def _dq_kernel(Q, K, V, O, DO, L, Delta, DQ,
               stride_qb, stride_qh, stride_qn,
               stride_kb, stride_kh, stride_kn,
               stride_vb, stride_vh, stride_vn,
               stride_ob, stride_oh, stride_on,
               stride_dob, stride_doh, stride_don,
               stride_dqb, stride_dqh, stride_dqn,
               n_heads, n_queries, n_keys, qk_scale, sm_scale,
               IS_CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per (batch x head, query tile): D = rowsum(dO * O) for its BLOCK_M queries,
    stored for the dK/dV kernel that runs next, then dQ, with the forward's loop structure
    (unmasked tiles below the diagonal, masked diagonal and tail tiles)."""
    pid_bh, batch, head, pid_m = _program_tile(n_queries, n_heads, BLOCK_M, True)
    q_start = pid_m * BLOCK_M
    offs_m = q_start + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_rows(_tile_ptrs(Q, batch, head, stride_qb, stride_qh, stride_qn, offs_m, offs_d),
                   offs_m, n_queries, offs_d, True, HEAD_DIM, BLOCK_D)
    do = _load_rows(_tile_ptrs(DO, batch, head, stride_dob, stride_doh, stride_don, offs_m, offs_d),
                    offs_m, n_queries, offs_d, True, HEAD_DIM, BLOCK_D)
    o = _load_rows(_tile_ptrs(O, batch, head, stride_ob, stride_oh, stride_on, offs_m, offs_d),
                   offs_m, n_queries, offs_d, True, HEAD_DIM, BLOCK_D)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)  # rows past n_queries load as zero: D = 0
    tl.store(Delta + pid_bh.to(tl.int64) * n_queries + offs_m, delta, mask=offs_m < n_queries)
    # Rows past n_queries get L = 0: finite, and their dQ is never stored.
    lse = tl.load(L + pid_bh.to(tl.int64) * n_queries + offs_m, mask=offs_m < n_queries, other=0.0) * _LOG2E
    k_base = K + batch * stride_kb + head * stride_kh
    v_base = V + batch * stride_vb + head * stride_vh

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    full_keys_end = (n_keys // BLOCK_N) * BLOCK_N
    if IS_CAUSAL:
        masked_start = tl.minimum(q_start, full_keys_end)
        masked_end = tl.minimum(q_start + BLOCK_M, n_keys)
    else:
        masked_start = full_keys_end
        masked_end = n_keys
    dq = _dq_key_loop(dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_vn, 0, masked_start,
                      offs_m, offs_n, offs_d, n_keys, qk_scale, False, IS_CAUSAL, HEAD_DIM, BLOCK_D, BLOCK_N)
    dq = _dq_key_loop(dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_vn, masked_start, masked_end,
                      offs_m, offs_n, offs_d, n_keys, qk_scale, True, IS_CAUSAL, HEAD_DIM, BLOCK_D, BLOCK_N)
    _store_rows(_tile_ptrs(DQ, batch, head, stride_dqb, stride_dqh, stride_dqn, offs_m, offs_d),
                (dq * sm_scale).to(DQ.dtype.element_ty), offs_m, n_queries, offs_d, HEAD_DIM, BLOCK_D)


INTERPRETED = isinstance(_forward_kernel, InterpretedFunction)


# ---------------------------------------------------------------------------------------- launching

@dataclass(frozen=True)
class Tiles:
    """One kernel's launch shape: its main tile (rows per program) and the step of its loop."""

    block_m: int  # queries per tile
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class TileSet:
    forward: Tiles  # forward and dQ: a program owns block_m queries and steps over block_n keys
    dkdv: Tiles  # dK/dV: a program owns block_n keys and steps over block_m queries
    dq: Tiles
    # The forward's tiles for grids too small to fill the GPU (short sequences, few heads): then a
    # program's latency, one key tile after another, is the time, and smaller tiles shorten it.
    narrow_forward: Tiles | None = None


# Measured on an H100 by scripts/tune_flash.py (causal, batch 1 x 16 heads, N 16384 in bf16 and 8192
# in fp32), keyed on (head dim class, bytes per element); TUNING.md has each version's figures.
# Invariants the causal loop split relies on: forward/dq block_m % block_n == 0, dkdv block_n %
# block_m == 0. fp32 runs tf32 dots on tiles of half the bf16 ones' bytes, within shared memory.
TILE_TABLE: dict[tuple[int, int], TileSet] = {
    (64, 2): TileSet(forward=Tiles(128, 128, 4, 3), dkdv=Tiles(64, 64, 4, 3), dq=Tiles(128, 64, 4, 3),
                     narrow_forward=Tiles(64, 64, 4, 3)),
    (128, 2): TileSet(forward=Tiles(128, 64, 8, 4), dkdv=Tiles(64, 128, 8, 4), dq=Tiles(128, 64, 8, 4),
                      narrow_forward=Tiles(64, 64, 4, 3)),
    (64, 4): TileSet(forward=Tiles(128, 32, 4, 3), dkdv=Tiles(32, 128, 8, 3), dq=Tiles(128, 32, 8, 2)),
    (128, 4): TileSet(forward=Tiles(128, 32, 8, 3), dkdv=Tiles(32, 128, 8, 2), dq=Tiles(128, 32, 8, 2)),
}
# The interpreter runs programs one after another in Python: tiles small enough that tests with
# a few dozen tokens cover several tiles, unequal so the diagonal logic is exercised.
INTERPRETER_TILES = TileSet(forward=Tiles(32, 16, 1, 1), dkdv=Tiles(16, 32, 1, 1), dq=Tiles(32, 16, 1, 1))


def tiles_for(head_dim: int, dtype: torch.dtype) -> TileSet:
    if INTERPRETED:
        return INTERPRETER_TILES
    head_dim_class = 64 if head_dim <= 64 else 128
    return TILE_TABLE[(head_dim_class, torch.finfo(dtype).bits // 8)]


# Below this many programs per SM the wide forward tiles leave the GPU short of work (measured on an
# H100: at batch x heads 1, N 16384, d 64, 64x64 tiles take 156 us and 128x128 ones 258 us; at 16
# heads the wide tiles are the faster).
NARROW_GRID_PROGRAMS_PER_SM = 2


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def forward_tiles(tile_set: TileSet, batch_heads: int, n_queries: int, device: torch.device) -> Tiles:
    """The forward's tiles for this grid: narrow_forward when the wide tiles would not fill the GPU."""
    wide = tile_set.forward
    if tile_set.narrow_forward is None or device.type != "cuda":
        return wide
    programs = batch_heads * triton.cdiv(n_queries, wide.block_m)
    if programs < NARROW_GRID_PROGRAMS_PER_SM * _sm_count(device.index or 0):
        return tile_set.narrow_forward
    return wide


def _as_batch_heads(t: torch.Tensor) -> torch.Tensor:
    """(..., n, d) as a 4-D (batch, heads, n, d) view with unit stride along d.

    3-D inputs get a batch of one; more than two leading dims are folded into the batch (a copy
    only when the strides do not allow a view). A strided last dim is copied: the kernels read
    rows of d contiguous elements, which is what makes their loads wide.
    """
    if t.stride(-1) != 1:
        t = t.contiguous()
    if t.dim() == 4:  # the common case returns at once: each view costs microseconds of host time
        return t
    if t.dim() == 2:
        return t[None, None]
    if t.dim() == 3:
        return t[None]
    return t.reshape(-1, *t.shape[-3:])


def _shaped(t4: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """`t4` viewed back to the caller's shape (a no-op for 4-D callers)."""
    return t4 if t4.shape == shape else t4.view(shape)


def _check_triton_device(q: torch.Tensor) -> None:
    if INTERPRETED:
        if q.dtype == torch.bfloat16:
            raise TypeError("bf16 is not supported under TRITON_INTERPRET=1: the Triton interpreter computes "
                            "bf16 tl.dot wrongly; use fp32 or fp16 on CPU, or run on a GPU")
        return
    if not q.is_cuda:
        raise ValueError(f"FlashAttentionTriton needs CUDA tensors, got {q.device}; on a machine without a "
                         "GPU set TRITON_INTERPRET=1 before this module is imported")
    if not torch.compiler.is_compiling() and q.device.index != torch.cuda.current_device():
        # Triton launches on the current device; pointers into another GPU's memory would be wrong.
        raise ValueError(f"q is on {q.device} but the current CUDA device is {torch.cuda.current_device()}; "
                         "call torch.cuda.set_device first")


def _block_d(head_dim: int) -> int:
    return max(MIN_DOT_DIM, triton.next_power_of_2(head_dim))


def _launch_options(head_dim: int, is_causal: bool, tiles: Tiles) -> dict:
    """The compile-time constants and launch shape the forward, dK/dV and dQ kernels all take."""
    return dict(IS_CAUSAL=is_causal, HEAD_DIM=head_dim, BLOCK_D=_block_d(head_dim), BLOCK_M=tiles.block_m,
                BLOCK_N=tiles.block_n, num_warps=tiles.num_warps, num_stages=tiles.num_stages)


def _scales(head_dim: int) -> tuple[float, float]:
    """(scale of q k^T in base-2 score units, softmax scale 1/sqrt(d))."""
    return LOG2E / math.sqrt(head_dim), 1.0 / math.sqrt(head_dim)


# (compiled kernel's launcher, its arguments after the tensors) by launch key: see _launch.
_LAUNCHES: dict[tuple, tuple[Callable, tuple]] = {}
_MAX_LAUNCHES = 4096


def _launch(kernel, key: tuple, tensors: tuple[torch.Tensor, ...],
            arguments: Callable[[], tuple[int, tuple, dict]]) -> None:
    """Run `kernel` on its tensors, then the integer and float arguments and compile-time options
    that `arguments()` gives as (grid size, scalars, options), in the kernel's signature order.

    Triton's JIT launch binds and specialises every argument on each call, about 40 us of host time
    on an H100 host, where handing a compiled kernel its arguments takes about 10. So the first call
    for a key goes through the JIT launch (compiling if need be) and keeps the compiled kernel with
    its grid and scalars; later calls with that key pass the tensors to it directly. The key must
    therefore fix everything the scalars, the grid and Triton's specialisation depend on: the
    kernel, dtypes, the device, shapes and strides, each input pointer's alignment (data_ptr % 16),
    causality and tiles. Tensors the launcher allocates (contiguous, from the caching allocator, so
    aligned) are fixed by the input shapes.
    """
    if INTERPRETED:
        grid, scalars, options = arguments()
        kernel[(grid,)](*tensors, *scalars, **options)
        return
    launch = _LAUNCHES.get(key)
    if launch is None:
        grid, scalars, options = arguments()
        compiled = kernel[(grid,)](*tensors, *scalars, **options)
        constants = tuple(options[name] for name in kernel.arg_names[len(tensors) + len(scalars):])
        if len(_LAUNCHES) >= _MAX_LAUNCHES:
            _LAUNCHES.clear()
        _LAUNCHES[key] = compiled[(grid, 1, 1)], (*scalars, *constants)
        return
    runner, tail = launch
    runner(*tensors, *tail)


def _alignment(*tensors: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.data_ptr() % 16 for t in tensors)


def launch_forward(q4, k4, v4, is_causal: bool, tiles: Tiles) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward kernel on (batch, heads, n, d) views: (o4 contiguous, L (batch, heads, n_queries) fp32)."""
    shape = q4.shape
    batch, heads, n_queries, head_dim = shape
    o4 = torch.empty(shape, dtype=q4.dtype, device=q4.device)
    lse = torch.empty((batch, heads, n_queries), dtype=torch.float32, device=q4.device)

    def arguments():
        n_keys = k4.shape[2]
        scalars = (*q4.stride()[:3], *k4.stride()[:3], *v4.stride()[:3], *o4.stride()[:3],
                   heads, n_queries, n_keys, _scales(head_dim)[0])
        return batch * heads * triton.cdiv(n_queries, tiles.block_m), scalars, _launch_options(head_dim, is_causal, tiles)

    key = (_forward_kernel, shape, q4.stride(), k4.shape, k4.stride(), v4.stride(), _alignment(q4, k4, v4),
           q4.dtype, q4.get_device(), is_causal, tiles)
    _launch(_forward_kernel, key, (q4, k4, v4, o4, lse), arguments)
    return o4, lse


def launch_dkdv(q4, k4, v4, do4, lse, delta, is_causal: bool, tiles: Tiles) -> tuple[torch.Tensor, torch.Tensor]:
    """The dK/dV kernel: (dk4, dv4), contiguous; lse and delta are (batch, heads, n_queries) fp32, contiguous."""
    batch, heads, n_queries, head_dim = q4.shape
    n_keys = k4.shape[2]
    dk4 = torch.empty(k4.shape, dtype=k4.dtype, device=k4.device)
    dv4 = torch.empty(v4.shape, dtype=v4.dtype, device=v4.device)

    def arguments():
        scalars = (*q4.stride()[:3], *k4.stride()[:3], *v4.stride()[:3], *do4.stride()[:3],
                   *dk4.stride()[:3], *dv4.stride()[:3], heads, n_queries, n_keys, *_scales(head_dim))
        return batch * heads * triton.cdiv(n_keys, tiles.block_n), scalars, _launch_options(head_dim, is_causal, tiles)

    key = (_dkdv_kernel, q4.shape, q4.stride(), k4.shape, k4.stride(), v4.stride(), do4.stride(),
           _alignment(q4, k4, v4, do4, lse, delta), q4.dtype, q4.get_device(), is_causal, tiles)
    _launch(_dkdv_kernel, key, (q4, k4, v4, do4, lse, delta, dk4, dv4), arguments)
    return dk4, dv4


def launch_dq(q4, k4, v4, o4, do4, lse, is_causal: bool, tiles: Tiles) -> tuple[torch.Tensor, torch.Tensor]:
    """The dQ kernel: (dq4 contiguous, D = rowsum(dO * O) (batch, heads, n_queries) fp32)."""
    shape = q4.shape
    batch, heads, n_queries, head_dim = shape
    dq4 = torch.empty(shape, dtype=q4.dtype, device=q4.device)
    delta = torch.empty((batch, heads, n_queries), dtype=torch.float32, device=q4.device)

    def arguments():
        scalars = (*q4.stride()[:3], *k4.stride()[:3], *v4.stride()[:3], *o4.stride()[:3], *do4.stride()[:3],
                   *dq4.stride()[:3], heads, n_queries, k4.shape[2], *_scales(head_dim))
        return batch * heads * triton.cdiv(n_queries, tiles.block_m), scalars, _launch_options(head_dim, is_causal, tiles)

    key = (_dq_kernel, shape, q4.stride(), k4.shape, k4.stride(), v4.stride(), o4.stride(), do4.stride(),
           _alignment(q4, k4, v4, o4, do4, lse), q4.dtype, q4.get_device(), is_causal, tiles)
    _launch(_dq_kernel, key, (q4, k4, v4, o4, do4, lse, delta, dq4), arguments)
    return dq4, delta


def triton_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   is_causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, L): o like q (contiguous), L (..., n_queries) fp32."""
    q4, k4, v4 = _as_batch_heads(q), _as_batch_heads(k), _as_batch_heads(v)
    batch, heads, n_queries, head_dim = q4.shape
    tiles = forward_tiles(tiles_for(head_dim, q.dtype), batch * heads, n_queries, q.device)
    o4, lse = launch_forward(q4, k4, v4, is_causal, tiles)
    return _shaped(o4, q.shape), _shaped(lse, q.shape[:-1])


def triton_backward(q, k, v, o, lse, do, is_causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv (shapes and dtypes of q, k, v): dQ over query tiles (writing D on the way), then
    dK/dV over key tiles."""
    q4, k4, v4, o4, do4 = (_as_batch_heads(t) for t in (q, k, v, o, do))
    tile_set = tiles_for(q4.shape[-1], q.dtype)
    dq4, delta = launch_dq(q4, k4, v4, o4, do4, lse, is_causal, tile_set.dq)
    dk4, dv4 = launch_dkdv(q4, k4, v4, do4, lse, delta, is_causal, tile_set.dkdv)
    return _shaped(dq4, q.shape), _shaped(dk4, k.shape), _shaped(dv4, v.shape)


# Opaque to torch.compile: inductor (torch 2.11) fails to compile these kernels (a tl.dot
# accumulator assertion), so a compiled caller runs them as they are, between its graphs. Eager
# calls skip the wrapper, which costs tens of microseconds of host time a call.
_opaque_forward = torch.compiler.disable(triton_forward)
_opaque_backward = torch.compiler.disable(triton_backward)


class FlashAttentionTriton(torch.autograd.Function):
    """FlashAttention-2 in Triton. apply(q, k, v, is_causal=False) -> o; saves L, q, k, v, o."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
        check_inputs(q, k, v, is_causal)
        _check_triton_device(q)
        o, lse = (_opaque_forward if torch.compiler.is_compiling() else triton_forward)(q, k, v, is_causal)
        ctx.save_for_backward(lse, q, k, v, o)
        ctx.is_causal = is_causal
        return o

    @staticmethod
    def backward(ctx, do: torch.Tensor):
        lse, q, k, v, o = ctx.saved_tensors
        backward = _opaque_backward if torch.compiler.is_compiling() else triton_backward
        dq, dk, dv = backward(q, k, v, o, lse, do, ctx.is_causal)
        return dq, dk, dv, None


def flash_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
    """FlashAttentionTriton as an attention function (q, k, v, is_causal) -> o."""
    return FlashAttentionTriton.apply(q, k, v, is_causal)
