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
    measured by scripts/tune_flash.py; grids too small to fill the GPU take each kernel's narrow tiles,
    and there the forward also cuts each query tile's keys into runs, a program each, merged by the
    last to finish (_split_forward_kernel); where twice those programs still fit on the SMs, the
    output's columns are also shared between two programs per run.
  - Launch order (_program_tile): the forward and dQ start the longest query tiles of every head
    first; dK/dV keeps a head's key tiles together so they share its queries in L2.
  - Host time, which decides short sequences: after the first call of a shape the compiled kernels are
    launched directly, past Triton's per-call argument binding (_prepare_launch); from the third, a
    forward with a known input signature also skips the input checks and tile choice (prepare_forward).
    The Function's apply skips torch's Python preamble, and it launches its forward after everything
    else it does.
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
from triton import knobs
from triton.runtime.driver import driver
from triton.runtime.interpreter import InterpretedFunction
from torch._C._functorch import unwrap_if_dead

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


def _cdiv(a: int, b: int) -> int:
    """Ceiling division on the host: plain ints (triton.cdiv costs microseconds a call there)."""
    return -(-a // b)


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
                      offs_m, offs_n, offs_d, offs_v, n_keys, qk_scale,
                      MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    """Online softmax over key tiles [key_start, key_end), into acc over V's columns offs_v; MASKED
    applies the key-bound and causal masks, for tiles on the diagonal or past the end of the keys."""
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
        v = _load_rows(v_base + cols[:, None] * stride_vn + offs_v[None, :], cols, n_keys, offs_v,
                       MASKED, HEAD_DIM, BLOCK_D)
        acc = tl.dot(p.to(v.dtype), v, acc * correction[:, None])
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _keys_seen_end(q_start, n_keys, IS_CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr):
    """End of the keys the query tile starting at q_start sees: under a causal mask, those up to its
    last row."""
    if IS_CAUSAL:
        end = tl.minimum(q_start + BLOCK_M, n_keys)
    else:
        end = n_keys
    return end


@triton.jit
def _attend_key_range(Q, K, V, batch, head, stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                      stride_vb, stride_vh, stride_vn, q_start, key_lo, key_hi, n_queries, n_keys, qk_scale,
                      v_start, IS_CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr):
    """(normalised output over V's BLOCK_DV columns from v_start, base-2 log-sum-exp) of the BLOCK_M
    queries from q_start over the keys in [key_lo, key_hi), both multiples of BLOCK_N or key_hi the
    end of the keys seen."""
    offs_m = q_start + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_v = v_start + tl.arange(0, BLOCK_DV)
    k_base = K + batch * stride_kb + head * stride_kh
    v_base = V + batch * stride_vb + head * stride_vh
    q = _load_rows(_tile_ptrs(Q, batch, head, stride_qb, stride_qh, stride_qn, offs_m, offs_d),
                   offs_m, n_queries, offs_d, True, HEAD_DIM, BLOCK_D)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    full_keys_end = (n_keys // BLOCK_N) * BLOCK_N  # key tiles before this need no bound mask
    if IS_CAUSAL:
        # Tiles before the query tile are wholly below the diagonal (BLOCK_M is a multiple of
        # BLOCK_N); tiles after it are wholly above and never visited.
        masked_start = tl.minimum(q_start, full_keys_end)
    else:
        masked_start = full_keys_end
    acc, l_i, m_i = _forward_key_loop(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn,
                                      key_lo, tl.minimum(key_hi, masked_start), offs_m, offs_n, offs_d, offs_v,
                                      n_keys, qk_scale, False, IS_CAUSAL, HEAD_DIM, BLOCK_D, BLOCK_N)
    acc, l_i, m_i = _forward_key_loop(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn,
                                      tl.maximum(key_lo, masked_start), key_hi, offs_m, offs_n, offs_d, offs_v,
                                      n_keys, qk_scale, True, IS_CAUSAL, HEAD_DIM, BLOCK_D, BLOCK_N)
    return acc / l_i[:, None], m_i + tl.math.log2(l_i)


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
    o, lse2 = _attend_key_range(Q, K, V, batch, head, stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                                stride_vb, stride_vh, stride_vn, q_start, 0,
                                _keys_seen_end(q_start, n_keys, IS_CAUSAL, BLOCK_M), n_queries, n_keys, qk_scale,
                                0, IS_CAUSAL, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, BLOCK_D)
    _store_output(O, L, pid_bh, batch, head, stride_ob, stride_oh, stride_on, o, lse2,
                  q_start + tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_D), n_queries, HEAD_DIM, BLOCK_D)


@triton.jit
def _store_output(O, L, pid_bh, batch, head, stride_ob, stride_oh, stride_on, o, lse2, offs_m, offs_d, n_queries,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Store a query tile's output and its log-sum-exp, given in base 2 (L is stored in natural log units)."""
    _store_rows(_tile_ptrs(O, batch, head, stride_ob, stride_oh, stride_on, offs_m, offs_d),
                o.to(O.dtype.element_ty), offs_m, n_queries, offs_d, HEAD_DIM, BLOCK_D)
    _store_lse(L, pid_bh, lse2, offs_m, n_queries)


@triton.jit
def _store_lse(L, pid_bh, lse2, offs_m, n_queries):
    """Store a query tile's log-sum-exp, given in base 2, in natural log units as L holds it."""
    tl.store(L + pid_bh.to(tl.int64) * n_queries + offs_m, lse2 * _LN2, mask=offs_m < n_queries)


@triton.jit
def _run_lse(lse_base, run, rows, n_splits, BLOCK_M: tl.constexpr):
    """One run's stored base-2 lse per row of a split forward's tile; -inf for runs the tile does not have.
    (rows < BLOCK_M holds everywhere: it spreads the run's mask over the rows.)"""
    return tl.load(lse_base + run * BLOCK_M + rows, mask=(rows < BLOCK_M) & (run < n_splits), other=float("-inf"),
                   cache_modifier=".cg")


@triton.jit(do_not_specialize=_SIZE_ARGS + ["split_keys"])
def _split_forward_kernel(Q, K, V, O, L, Partial, Arrivals,
                          stride_qb, stride_qh, stride_qn,
                          stride_kb, stride_kh, stride_kn,
                          stride_vb, stride_vh, stride_vn,
                          stride_ob, stride_oh, stride_on,
                          n_heads, n_queries, n_keys, split_keys, qk_scale,
                          IS_CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          RUNS: tl.constexpr, SHARES: tl.constexpr, MERGE_COLUMNS: tl.constexpr):
    """The forward for grids too small to fill the GPU, where one program walking all of a long
    query tile's keys is the time: a query tile's keys are cut into runs of split_keys (a multiple
    of BLOCK_M, so the causal diagonal lies in the last run), the run on grid axis 1, and where
    even that leaves SMs idle, the output's columns into SHARES shares, on grid axis 2. A program
    computes its run's scores in full, but P V, its partial and the merge for its share only.

    A tile with one run stores o and L as _forward_kernel does (L from share 0). Otherwise each
    program stores its run's normalised output and base-2 log-sum-exp in Partial, then counts
    itself in its (tile, share) Arrivals slot; the last to arrive merges the runs (out_s weighted
    by 2^(lse_s - lse)), stores o (and L, in share 0), and sets the slot back to zero for the next
    launch.

    One program reads all of a share's partials from L2, so the merge is bound by what one SM
    reads: sharing the columns divides that. The merge reads every run's lse first, so that the
    weights are known, then merges MERGE_COLUMNS columns at a time over all RUNS (the grid's runs,
    unrolled, masked past this tile's): a chunk's loads are all in flight at once, within the
    registers a chunk needs.
    """
    BLOCK_DV: tl.constexpr = BLOCK_D // SHARES
    pid_bh, batch, head, pid_m = _program_tile(n_queries, n_heads, BLOCK_M, True)
    split = tl.program_id(1)
    share = tl.program_id(2)
    q_start = pid_m * BLOCK_M
    keys_end = _keys_seen_end(q_start, n_keys, IS_CAUSAL, BLOCK_M)
    n_splits = tl.cdiv(keys_end, split_keys)
    if split < n_splits:
        key_lo = split * split_keys
        o, lse2 = _attend_key_range(Q, K, V, batch, head, stride_qb, stride_qh, stride_qn, stride_kb, stride_kh,
                                    stride_kn, stride_vb, stride_vh, stride_vn, q_start, key_lo,
                                    tl.minimum(key_lo + split_keys, keys_end), n_queries, n_keys, qk_scale,
                                    share * BLOCK_DV, IS_CAUSAL, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, BLOCK_DV)
        offs_m = q_start + tl.arange(0, BLOCK_M)
        offs_dv = tl.arange(0, BLOCK_DV)
        if n_splits == 1:
            out_columns = share * BLOCK_DV + offs_dv
            _store_rows(_tile_ptrs(O, batch, head, stride_ob, stride_oh, stride_on, offs_m, out_columns),
                        o.to(O.dtype.element_ty), offs_m, n_queries, out_columns, HEAD_DIM, BLOCK_D)
            if share == 0:
                _store_lse(L, pid_bh, lse2, offs_m, n_queries)
        else:
            # Partial: per (tile, share, run) slot, BLOCK_M x BLOCK_DV outputs; after all slots, BLOCK_M lse each.
            n_tiles = tl.cdiv(n_queries, BLOCK_M)
            tile_slot = (pid_bh.to(tl.int64) * n_tiles + pid_m) * SHARES + share
            n_slots = tl.num_programs(0).to(tl.int64) * RUNS * SHARES
            rows = tl.arange(0, BLOCK_M)
            out_base = Partial + tile_slot * RUNS * (BLOCK_M * BLOCK_DV)
            lse_base = Partial + n_slots * (BLOCK_M * BLOCK_DV) + tile_slot * RUNS * BLOCK_M
            tl.store(out_base + split * (BLOCK_M * BLOCK_DV) + rows[:, None] * BLOCK_DV + offs_dv[None, :], o)
            tl.store(lse_base + split * BLOCK_M + rows, lse2)
            # Every warp's stores come before the count (one thread's release, as a semaphore does).
            tl.debug_barrier()
            arrived = tl.atomic_add(Arrivals + tile_slot, 1, sem="acq_rel", scope="gpu")
            if arrived == n_splits - 1:
                tl.store(Arrivals + tile_slot, 0)
                # .cg reads at L2, where the other programs' stores are, past this SM's L1.
                lse_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
                for run in tl.static_range(RUNS):
                    lse_max = tl.maximum(lse_max, _run_lse(lse_base, run, rows, n_splits, BLOCK_M))
                weight_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
                for run in tl.static_range(RUNS):
                    weight_sum += tl.math.exp2(_run_lse(lse_base, run, rows, n_splits, BLOCK_M) - lse_max)
                lse2 = lse_max + tl.math.log2(weight_sum)
                columns = tl.arange(0, MERGE_COLUMNS)
                for first in tl.static_range(0, BLOCK_DV, MERGE_COLUMNS):
                    merged = tl.zeros([BLOCK_M, MERGE_COLUMNS], dtype=tl.float32)
                    for run in tl.static_range(RUNS):
                        weight = tl.math.exp2(_run_lse(lse_base, run, rows, n_splits, BLOCK_M) - lse2)
                        out_run = tl.load(out_base + run * (BLOCK_M * BLOCK_DV) + rows[:, None] * BLOCK_DV
                                          + (first + columns)[None, :],
                                          mask=(rows[:, None] < BLOCK_M) & (run < n_splits), other=0.0,
                                          cache_modifier=".cg")
                        merged += out_run * weight[:, None]
                    out_columns = share * BLOCK_DV + first + columns
                    _store_rows(_tile_ptrs(O, batch, head, stride_ob, stride_oh, stride_on, offs_m, out_columns),
                                merged.to(O.dtype.element_ty), offs_m, n_queries, out_columns, HEAD_DIM, BLOCK_D)
                if share == 0:
                    _store_lse(L, pid_bh, lse2, offs_m, n_queries)


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
    # Each kernel's tiles for grids too small to fill the GPU (short sequences, few heads): then a
    # program's latency, one tile after another, is the time, and smaller tiles shorten it. None
    # where the wide tiles are the fastest there too.
    narrow_forward: Tiles | None = None
    narrow_dkdv: Tiles | None = None
    narrow_dq: Tiles | None = None


# Measured on an H100 by scripts/tune_flash.py, keyed on (head dim class, bytes per element); TUNING.md
# has each version's figures. Wide tiles: causal, batch 1 x 16 heads, N 16384 in bf16 and 8192 in
# fp32. Narrow tiles: the shape fastest over N 1024, 4096 and 16384 at batch 1 x 1 head.
# Invariants the causal loop split relies on: forward/dq block_m % block_n == 0, dkdv block_n %
# block_m == 0. fp32 runs tf32 dots on tiles of half the bf16 ones' bytes, within shared memory.
TILE_TABLE: dict[tuple[int, int], TileSet] = {
    (64, 2): TileSet(forward=Tiles(128, 128, 4, 3), dkdv=Tiles(64, 64, 4, 3), dq=Tiles(128, 64, 4, 3),
                     narrow_forward=Tiles(64, 64, 4, 4), narrow_dq=Tiles(64, 64, 4, 4)),
    (128, 2): TileSet(forward=Tiles(128, 64, 8, 4), dkdv=Tiles(64, 128, 8, 4), dq=Tiles(128, 64, 8, 4),
                      narrow_forward=Tiles(64, 64, 4, 3), narrow_dkdv=Tiles(64, 64, 4, 3),
                      narrow_dq=Tiles(64, 64, 4, 3)),
    (64, 4): TileSet(forward=Tiles(128, 32, 4, 3), dkdv=Tiles(32, 128, 8, 3), dq=Tiles(128, 32, 8, 2),
                     narrow_forward=Tiles(64, 64, 4, 4), narrow_dkdv=Tiles(64, 64, 4, 4),
                     narrow_dq=Tiles(64, 64, 4, 4)),
    (128, 4): TileSet(forward=Tiles(128, 32, 8, 3), dkdv=Tiles(32, 128, 8, 2), dq=Tiles(128, 32, 8, 2),
                      narrow_forward=Tiles(32, 32, 4, 3), narrow_dkdv=Tiles(32, 32, 4, 4),
                      narrow_dq=Tiles(32, 32, 4, 4)),
}
# The interpreter runs programs one after another in Python: tiles small enough that tests with
# a few dozen tokens cover several tiles, unequal so the diagonal logic is exercised.
INTERPRETER_TILES = TileSet(forward=Tiles(32, 16, 1, 1), dkdv=Tiles(16, 32, 1, 1), dq=Tiles(32, 16, 1, 1))


def tiles_for(head_dim: int, dtype: torch.dtype) -> TileSet:
    if INTERPRETED:
        return INTERPRETER_TILES
    head_dim_class = 64 if head_dim <= 64 else 128
    return TILE_TABLE[(head_dim_class, torch.finfo(dtype).bits // 8)]


# Below this many programs per SM a kernel's wide tiles leave the GPU short of work. Measured on an
# H100 at batch x heads 1: at N 16384 (128 wide programs of 128 rows, on 132 SMs) every kernel's
# narrow tiles were 1.1-1.6x faster; at N 32768 (256 programs) narrow tiles were up to 2x slower.
NARROW_GRID_PROGRAMS_PER_SM = 1


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def kernel_tiles(tile_set: TileSet, kernel: str, batch_heads: int, n_rows: int, device: torch.device) -> Tiles:
    """One kernel's tiles for this grid ("forward", "dkdv" or "dq"; n_rows are the queries, or the
    keys for dK/dV): its narrow tiles when its wide ones would not fill the GPU."""
    wide = getattr(tile_set, kernel)
    narrow = getattr(tile_set, f"narrow_{kernel}")
    if narrow is None or device.type != "cuda":
        return wide
    owned_rows = wide.block_n if kernel == "dkdv" else wide.block_m
    if batch_heads * _cdiv(n_rows, owned_rows) < NARROW_GRID_PROGRAMS_PER_SM * _sm_count(device.index or 0):
        return narrow
    return wide


# On grids that take the narrow tiles the forward also splits keys (_split_forward_kernel): the longest
# query tile's keys in this many runs. Measured on an H100 at batch x heads 1, causal, runs of 128 to
# 4096 keys: a quarter of N was the fastest or within noise of it at N 1024 to 8192 (bf16 N 8192:
# 72 -> 42 us at d 64, 99 -> 68 us at d 128); TUNING.md has the table.
SPLIT_RUNS = 4


def _longest_tile_keys(block_m: int, n_queries: int, n_keys: int, is_causal: bool) -> int:
    """How many keys the query tile that sees the most of them sees: under a causal mask, the last tile's."""
    return min(_cdiv(n_queries, block_m) * block_m, n_keys) if is_causal else n_keys


def forward_split_keys(tiles: Tiles, n_queries: int, n_keys: int, is_causal: bool) -> int | None:
    """Keys per run for the split forward on narrow tiles, or None where the longest query tile's
    keys make a single run."""
    longest = _longest_tile_keys(tiles.block_m, n_queries, n_keys, is_causal)
    split_keys = _cdiv(longest, SPLIT_RUNS * tiles.block_m) * tiles.block_m
    return split_keys if split_keys < longest else None


def forward_column_shares(programs: int, head_dim: int, device: torch.device) -> int:
    """Shares of the output's columns for a split forward of `programs` (query tiles x runs) programs: two
    where that many programs twice over still fit on the SMs at once, so the merge's reads are halved
    across two SMs (H100, one head, d 128, N 1024: kernel 11.3 -> 8.2 us; TUNING.md v11), one where the
    extra programs would wait for a second wave (N 2048: slower) or a share would be narrower than a
    dot's 16 columns."""
    if _block_d(head_dim) >= 2 * MIN_DOT_DIM and 2 * programs <= _sm_count(device.index or 0):
        return 2
    return 1


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


@functools.cache
def _block_d(head_dim: int) -> int:
    return max(MIN_DOT_DIM, triton.next_power_of_2(head_dim))


def _launch_options(head_dim: int, is_causal: bool, tiles: Tiles) -> dict:
    """The compile-time constants and launch shape the forward, dK/dV and dQ kernels all take."""
    return dict(IS_CAUSAL=is_causal, HEAD_DIM=head_dim, BLOCK_D=_block_d(head_dim), BLOCK_M=tiles.block_m,
                BLOCK_N=tiles.block_n, num_warps=tiles.num_warps, num_stages=tiles.num_stages)


def _merge_columns(share_columns: int) -> int:
    """Columns the split forward's merge takes at a time, of a share of `share_columns`: half of it from 64
    columns up (measured fastest at d 64 and 128 on an H100, TUNING.md v10), else all of it."""
    return share_columns // 2 if share_columns >= 64 else share_columns


def _scales(head_dim: int) -> tuple[float, float]:
    """(scale of q k^T in base-2 score units, softmax scale 1/sqrt(d))."""
    return LOG2E / math.sqrt(head_dim), 1.0 / math.sqrt(head_dim)


# Compiled kernels with their launcher and arguments after the tensors, by launch key: see _prepare_launch.
_LAUNCHES: dict[tuple, tuple] = {}
_MAX_LAUNCHES = 4096
_DATA_PTR = torch.Tensor.data_ptr


def _prepare_launch(kernel, key: tuple, tensors: tuple[torch.Tensor, ...],
                    arguments: Callable[[], tuple[int | tuple[int, int], tuple, dict]]) -> Callable[[], object]:
    """The launch of `kernel` on its tensors, ready to call, followed by the integer and float
    arguments and compile-time options that `arguments()` gives as (grid: programs on axis 0, or per
    axis; scalars; options), in the kernel's signature order.

    Triton's JIT launch binds and specialises every argument on each call, about 40 us of host time
    on an H100 host, where handing a compiled kernel's launcher its arguments takes about 10. So the
    first launch for a key goes through the JIT launch (compiling if need be) and keeps the compiled
    kernel with its grid and scalars; later launches with that key call its launcher directly, on
    the current stream of the key's device, with the tensors' addresses (a tensor would cost a
    data_ptr() call and a driver query of the pointer apiece). The key must therefore fix everything
    the scalars, the grid and Triton's specialisation depend on: the kernel, dtypes, the device,
    shapes and strides, each input pointer's alignment (data_ptr % 16), causality and tiles. Tensors
    the launchers allocate (contiguous, from the caching allocator, so aligned) are fixed by the
    input shapes.
    """
    if INTERPRETED:
        grid, scalars, options = arguments()
        return functools.partial(kernel[_grid3(grid)], *tensors, *scalars, **options)
    kept = _LAUNCHES.get(key)
    if kept is None:
        return functools.partial(_first_launch, kernel, key, tensors, arguments)
    if _launch_hooks_installed():  # a profiler's hooks get the launch metadata Triton's own launch builds
        compiled, _, grid, tail, _, _ = kept
        return functools.partial(compiled[grid], *tensors, *tail)
    return _kept_launch(kept, map(_DATA_PTR, tensors))


def _kept_launch(kept: tuple, pointers) -> Callable[[], object]:
    """A kept launch (an entry of _LAUNCHES) bound to its tensors' addresses, on the current stream."""
    compiled, launcher, grid, tail, device_index, current_stream = kept
    return functools.partial(launcher, *grid, current_stream(device_index), compiled.function,
                             compiled.packed_metadata, None, None, None, *pointers, *tail)


def _first_launch(kernel, key: tuple, tensors: tuple[torch.Tensor, ...], arguments) -> None:
    """Triton's JIT launch, keeping the compiled kernel for `key`'s later launches (_prepare_launch)."""
    grid, scalars, options = arguments()
    compiled = kernel[_grid3(grid)](*tensors, *scalars, **options)
    constants = tuple(options[name] for name in kernel.arg_names[len(tensors) + len(scalars):])
    if len(_LAUNCHES) >= _MAX_LAUNCHES:
        _LAUNCHES.clear()
    _LAUNCHES[key] = (compiled, compiled.run, _grid3(grid), (*scalars, *constants), torch.cuda.current_device(),
                      driver.active.get_current_stream)


def _launch_hooks_installed() -> bool:
    """Whether anything hooks Triton's kernel launches (the hooks are chains, empty unless a profiler
    such as Proton adds to them; older Triton versions have None)."""
    return any(hook is not None and getattr(hook, "calls", True)
               for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook))


def _contiguous_like(t: torch.Tensor) -> torch.Tensor:
    """An uninitialised contiguous tensor shaped like t. empty_like is the cheapest allocation on the
    host, but it copies t's layout, so it serves only when that is contiguous."""
    return torch.empty_like(t) if t.is_contiguous() else t.new_empty(t.shape)


def _grid3(grid: int | tuple[int, ...]) -> tuple[int, int, int]:
    return (grid, 1, 1) if isinstance(grid, int) else (*grid, *(1,) * (3 - len(grid)))


def _alignment(*tensors: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.data_ptr() % 16 for t in tensors)


def _prepare_forward(q4, k4, v4, is_causal: bool, tiles: Tiles) -> tuple[torch.Tensor, torch.Tensor, Callable, tuple]:
    """The forward kernel on (batch, heads, n, d) views: (o4 contiguous, L (batch, heads, n_queries) fp32,
    the launch that fills them, its launch key)."""
    shape = q4.shape
    batch, heads, n_queries, head_dim = shape
    o4 = _contiguous_like(q4)
    lse = q4.new_empty((batch, heads, n_queries), dtype=torch.float32)

    def arguments():
        n_keys = k4.shape[2]
        scalars = (*q4.stride()[:3], *k4.stride()[:3], *v4.stride()[:3], *o4.stride()[:3],
                   heads, n_queries, n_keys, _scales(head_dim)[0])
        return batch * heads * _cdiv(n_queries, tiles.block_m), scalars, _launch_options(head_dim, is_causal, tiles)

    key = (_forward_kernel, shape, q4.stride(), k4.shape, k4.stride(), v4.stride(), _alignment(q4, k4, v4),
           q4.dtype, q4.get_device(), is_causal, tiles)
    return o4, lse, _prepare_launch(_forward_kernel, key, (q4, k4, v4, o4, lse), arguments), key


def launch_forward(q4, k4, v4, is_causal: bool, tiles: Tiles) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward kernel on (batch, heads, n, d) views: (o4 contiguous, L (batch, heads, n_queries) fp32)."""
    o4, lse, launch, _ = _prepare_forward(q4, k4, v4, is_causal, tiles)
    launch()
    return o4, lse


# Per (device, stream): the split forward's arrival counts, zero between launches (each launch sets
# the slots it used back to zero), and its workspace for the runs' partial outputs, both grown when a
# launch needs more. Launches on one stream run one after another, so they can share them; other
# streams get their own. Kept rather than allocated per call, which would cost host time at the
# short sequences the split forward is for; at most a few tens of MB, since only grids too small to
# fill the GPU take it. A launch captured into a CUDA graph gets buffers of its own instead: the graph
# replays on its buffers' addresses long after the capture, which a later launch on the stream must
# neither replace (freeing them) nor share.
_SPLIT_BUFFERS: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}


def _split_buffers(device: torch.device, tiles: int, workspace_floats: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(arrival counts for `tiles` query tiles, int32 zeros; a workspace of at least `workspace_floats` fp32)."""
    if INTERPRETED or torch.cuda.is_current_stream_capturing():
        return (torch.zeros(tiles, dtype=torch.int32, device=device),
                torch.empty(workspace_floats, dtype=torch.float32, device=device))
    key = (device.index, driver.active.get_current_stream(device.index))
    buffers = _SPLIT_BUFFERS.get(key)
    if buffers is None or buffers[0].numel() < tiles or buffers[1].numel() < workspace_floats:
        if buffers is not None:
            tiles, workspace_floats = max(tiles, buffers[0].numel()), max(workspace_floats, buffers[1].numel())
        buffers = _SPLIT_BUFFERS[key] = (torch.zeros(max(tiles, 1024), dtype=torch.int32, device=device),
                                         torch.empty(workspace_floats, dtype=torch.float32, device=device))
    return buffers


def _split_buffer_sizes(grid: tuple[int, int, int], tiles: Tiles, head_dim: int) -> tuple[int, int]:
    """(arrival slots, workspace floats) of a split forward's grid (query tiles, runs, column shares): a slot
    per (tile, share), and per (tile, share, run) a share of a tile of outputs and its lse."""
    tiles_runs_shares = grid[0] * grid[1] * grid[2]
    return grid[0] * grid[2], tiles_runs_shares * tiles.block_m * (_block_d(head_dim) // grid[2] + 1)


def _prepare_split_forward(q4, k4, v4, is_causal: bool, tiles: Tiles, split_keys: int,
                           shares: int | None = None) -> tuple[torch.Tensor, torch.Tensor, Callable, tuple]:
    """The split forward (_split_forward_kernel), runs of `split_keys` keys, the output's columns in `shares`
    shares (None: as forward_column_shares takes them): returns like _prepare_forward."""
    shape = q4.shape
    batch, heads, n_queries, head_dim = shape
    n_keys = k4.shape[2]
    if split_keys % tiles.block_m:
        raise ValueError(f"split_keys {split_keys} must be a multiple of the query tile, {tiles.block_m}")
    longest = _longest_tile_keys(tiles.block_m, n_queries, n_keys, is_causal)
    tiles_runs = (batch * heads * _cdiv(n_queries, tiles.block_m), _cdiv(longest, split_keys))
    if shares is None:
        shares = forward_column_shares(tiles_runs[0] * tiles_runs[1], head_dim, q4.device)
    block_d = _block_d(head_dim)
    if shares not in (1, 2, 4, 8) or block_d // shares < MIN_DOT_DIM:
        raise ValueError(f"shares {shares} must be a power of two of at most {block_d // MIN_DOT_DIM} at head dim "
                         f"{head_dim}: each share of its {block_d} padded columns needs at least {MIN_DOT_DIM}")
    grid = (*tiles_runs, shares)
    o4 = _contiguous_like(q4)
    lse = q4.new_empty((batch, heads, n_queries), dtype=torch.float32)
    arrivals, partial = _split_buffers(q4.device, *_split_buffer_sizes(grid, tiles, head_dim))

    def arguments():
        scalars = (*q4.stride()[:3], *k4.stride()[:3], *v4.stride()[:3], *o4.stride()[:3],
                   heads, n_queries, n_keys, split_keys, _scales(head_dim)[0])
        return grid, scalars, dict(_launch_options(head_dim, is_causal, tiles), RUNS=grid[1], SHARES=shares,
                                   MERGE_COLUMNS=_merge_columns(block_d // shares))

    key = (_split_forward_kernel, shape, q4.stride(), k4.shape, k4.stride(), v4.stride(), _alignment(q4, k4, v4),
           q4.dtype, q4.get_device(), is_causal, tiles, split_keys, shares)
    tensors = (q4, k4, v4, o4, lse, partial, arrivals)
    return o4, lse, _prepare_launch(_split_forward_kernel, key, tensors, arguments), key


def launch_split_forward(q4, k4, v4, is_causal: bool, tiles: Tiles, split_keys: int,
                         shares: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The split forward (_split_forward_kernel), runs of `split_keys` keys, the output's columns in `shares`
    shares: returns like launch_forward."""
    o4, lse, launch, _ = _prepare_split_forward(q4, k4, v4, is_causal, tiles, split_keys, shares)
    launch()
    return o4, lse


def launch_dkdv(q4, k4, v4, do4, lse, delta, is_causal: bool, tiles: Tiles) -> tuple[torch.Tensor, torch.Tensor]:
    """The dK/dV kernel: (dk4, dv4), contiguous; lse and delta are (batch, heads, n_queries) fp32, contiguous."""
    batch, heads, n_queries, head_dim = q4.shape
    n_keys = k4.shape[2]
    dk4, dv4 = _contiguous_like(k4), _contiguous_like(v4)

    def arguments():
        scalars = (*q4.stride()[:3], *k4.stride()[:3], *v4.stride()[:3], *do4.stride()[:3],
                   *dk4.stride()[:3], *dv4.stride()[:3], heads, n_queries, n_keys, *_scales(head_dim))
        return batch * heads * _cdiv(n_keys, tiles.block_n), scalars, _launch_options(head_dim, is_causal, tiles)

    key = (_dkdv_kernel, q4.shape, q4.stride(), k4.shape, k4.stride(), v4.stride(), do4.stride(),
           _alignment(q4, k4, v4, do4, lse, delta), q4.dtype, q4.get_device(), is_causal, tiles)
    _prepare_launch(_dkdv_kernel, key, (q4, k4, v4, do4, lse, delta, dk4, dv4), arguments)()
    return dk4, dv4


def launch_dq(q4, k4, v4, o4, do4, lse, is_causal: bool, tiles: Tiles) -> tuple[torch.Tensor, torch.Tensor]:
    """The dQ kernel: (dq4 contiguous, D = rowsum(dO * O) (batch, heads, n_queries) fp32)."""
    shape = q4.shape
    batch, heads, n_queries, head_dim = shape
    dq4 = _contiguous_like(q4)
    delta = q4.new_empty((batch, heads, n_queries), dtype=torch.float32)

    def arguments():
        scalars = (*q4.stride()[:3], *k4.stride()[:3], *v4.stride()[:3], *o4.stride()[:3], *do4.stride()[:3],
                   *dq4.stride()[:3], heads, n_queries, k4.shape[2], *_scales(head_dim))
        return batch * heads * _cdiv(n_queries, tiles.block_m), scalars, _launch_options(head_dim, is_causal, tiles)

    key = (_dq_kernel, shape, q4.stride(), k4.shape, k4.stride(), v4.stride(), o4.stride(), do4.stride(),
           _alignment(q4, k4, v4, o4, do4, lse), q4.dtype, q4.get_device(), is_causal, tiles)
    _prepare_launch(_dq_kernel, key, (q4, k4, v4, o4, do4, lse, delta, dq4), arguments)()
    return dq4, delta


# Per forward input signature, from its second call: its kept launch, the sizes of the split
# forward's buffers (None for the whole forward), and a prototype of L (one float expanded to L's
# shape: empty_like of it costs a third of allocating L by shape and dtype). A call that finds its
# signature allocates its outputs and launches, past the input checks, choosing tiles and building
# the launch key (see prepare_forward).
_FORWARD_PLANS: dict[tuple, tuple] = {}


def _plan_signature(q, k, v, is_causal) -> tuple | None:
    """What the input checks and the forward's launch depend on: shapes, strides, dtypes, devices
    (and the current one), causality and each input's alignment; None unless the inputs are three
    tensors, q on a GPU, and a bool. Plans are kept only for inputs that passed the checks, so a call
    whose signature has a plan passes them too."""
    if type(is_causal) is not bool or not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
                                           and isinstance(v, torch.Tensor)) or not q.is_cuda:
        return None
    return (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype,
            q.get_device(), k.get_device(), v.get_device(), torch.cuda.current_device(), is_causal,
            q.data_ptr() % 16, k.data_ptr() % 16, v.data_ptr() % 16)


def prepare_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    is_causal: bool) -> tuple[torch.Tensor, torch.Tensor, Callable[[], object]]:
    """(o, L, launch): o like q (contiguous) and L (..., n_queries) fp32, allocated, and the launch that
    fills them. Raises as check_inputs does on inputs that break the contract."""
    signature = None if INTERPRETED else _plan_signature(q, k, v, is_causal)
    plan = _FORWARD_PLANS.get(signature)
    if plan is not None and not _launch_hooks_installed():
        kept, split_buffers, lse_prototype = plan
        o = _contiguous_like(q)
        lse = torch.empty_like(lse_prototype, memory_format=torch.contiguous_format)
        if split_buffers is None:
            buffers = ()
        else:
            arrivals, partial = _split_buffers(q.device, *split_buffers)
            buffers = (partial.data_ptr(), arrivals.data_ptr())
        return o, lse, _kept_launch(kept, (q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse.data_ptr(),
                                           *buffers))
    check_inputs(q, k, v, is_causal)
    _check_triton_device(q)
    q4, k4, v4 = _as_batch_heads(q), _as_batch_heads(k), _as_batch_heads(v)
    batch, heads, n_queries, head_dim = q4.shape
    tile_set = tiles_for(head_dim, q.dtype)
    tiles = kernel_tiles(tile_set, "forward", batch * heads, n_queries, q.device)
    split_keys = None if tiles is tile_set.forward else forward_split_keys(tiles, n_queries, k4.shape[2], is_causal)
    if split_keys is None:
        o4, lse, launch, key = _prepare_forward(q4, k4, v4, is_causal, tiles)
    else:
        o4, lse, launch, key = _prepare_split_forward(q4, k4, v4, is_causal, tiles, split_keys)
    kept = _LAUNCHES.get(key)
    # Inputs _as_batch_heads copied are not read in place, so their calls take this path each time.
    if (signature is not None and kept is not None
            and all(t4.data_ptr() == t.data_ptr() for t, t4 in ((q, q4), (k, k4), (v, v4)))):
        if len(_FORWARD_PLANS) >= _MAX_LAUNCHES:
            _FORWARD_PLANS.clear()
        split_buffers = None if split_keys is None else _split_buffer_sizes(kept[2], tiles, head_dim)
        lse_prototype = torch.empty(1, dtype=torch.float32, device=q.device).expand(q.shape[:-1])
        _FORWARD_PLANS[signature] = (kept, split_buffers, lse_prototype)
    return _shaped(o4, q.shape), _shaped(lse, q.shape[:-1]), launch


def triton_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   is_causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, L): o like q (contiguous), L (..., n_queries) fp32."""
    o, lse, launch = prepare_forward(q, k, v, is_causal)
    launch()
    return o, lse


def triton_backward(q, k, v, o, lse, do, is_causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv (shapes and dtypes of q, k, v): dQ over query tiles (writing D on the way), then
    dK/dV over key tiles."""
    q4, k4, v4, o4, do4 = (_as_batch_heads(t) for t in (q, k, v, o, do))
    batch, heads, n_queries, head_dim = q4.shape
    tile_set = tiles_for(head_dim, q.dtype)
    dq_tiles = kernel_tiles(tile_set, "dq", batch * heads, n_queries, q.device)
    dkdv_tiles = kernel_tiles(tile_set, "dkdv", batch * heads, k4.shape[2], q.device)
    dq4, delta = launch_dq(q4, k4, v4, o4, do4, lse, is_causal, dq_tiles)
    dk4, dv4 = launch_dkdv(q4, k4, v4, do4, lse, delta, is_causal, dkdv_tiles)
    return _shaped(dq4, q.shape), _shaped(dk4, k.shape), _shaped(dv4, v.shape)


# Opaque to torch.compile: inductor (torch 2.11) fails to compile these kernels (a tl.dot
# accumulator assertion), so a compiled caller runs them as they are, between its graphs. Eager
# calls skip the wrapper, which costs tens of microseconds of host time a call.
_opaque_forward = torch.compiler.disable(triton_forward)
_opaque_backward = torch.compiler.disable(triton_backward)


# The C++ core of Function.apply, called with the Function class first.
_FUNCTION_BASE_APPLY = torch._C._FunctionBase.__dict__["apply"]


class FlashAttentionTriton(torch.autograd.Function):
    """FlashAttention-2 in Triton. apply(q, k, v, is_causal=False) -> o; saves L, q, k, v, o."""

    @classmethod
    def apply(cls, q, k, v, is_causal=False):
        """torch's Function.apply, less its Python preamble where that has nothing to do: it costs
        several microseconds of host time a call, which short sequences see. The preamble binds
        default arguments for Functions with a setup_context (this one has none), unwraps dead
        functorch wrappers (done here, on the tensors) and hands calls under functorch transforms to
        their own path (taken here too). torch.compile does not run this method: it traces the
        forward and backward below."""
        if torch._C._are_functorch_transforms_active():
            return super().apply(q, k, v, is_causal)
        if isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor):
            q, k, v = unwrap_if_dead(q), unwrap_if_dead(k), unwrap_if_dead(v)
        # (Otherwise the forward's checks raise, naming the argument that is not a tensor.)
        return _FUNCTION_BASE_APPLY(cls, q, k, v, is_causal)

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
        if torch.compiler.is_compiling():
            check_inputs(q, k, v, is_causal)
            _check_triton_device(q)
            o, lse = _opaque_forward(q, k, v, is_causal)
            launch = None
        else:
            o, lse, launch = prepare_forward(q, k, v, is_causal)
        ctx.save_for_backward(lse, q, k, v, o)
        ctx.is_causal = is_causal
        if launch is not None:
            # Launched last: at short sequences the kernel is shorter than the host's work around it,
            # and host work after the launch adds to the call's time as the GPU sees it.
            launch()
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
