"""The FlashAttention-2 Triton kernels: the forward (whole, and split into runs of keys for grids too
small to fill the GPU), dQ over query tiles (which also writes D = rowsum(dO * O)), then dK/dV over
key tiles, so that no kernel needs atomics on its outputs.

Every kernel takes (batch, heads, n, d) tensors by stride, rows of d contiguous elements, and pads
head dims that are no power of two (or below 16, what tl.dot needs) with masked columns on chip.

Speed structure:
  - Scores are kept in base 2: S * log2(e) = q k^T * (log2(e) / sqrt(d)), one multiply, then exp2.
    L is stored in natural-log units, as the contract says.
  - Causal: key tiles wholly above the diagonal are never visited; the tiles that straddle it (and a
    partial tail tile) go through a masked copy of the loop, all other tiles through an unmasked one.
  - Launch order (_program_tile): the forward and dQ start the longest query tiles of every head
    first; dK/dV keeps a head's key tiles together so they share its queries in L2.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

from cs336_systems.attention.flash_pytorch import MASKED_SCORE_BIAS

LOG2E = math.log2(math.e)
# The kernels see these as compile-time constants (Triton reads only constexpr globals).
_LOG2E = tl.constexpr(LOG2E)
_LN2 = tl.constexpr(math.log(2.0))
_MASKED_SCORE_BIAS_LOG2 = tl.constexpr(MASKED_SCORE_BIAS * LOG2E)  # the bias in base-2 score units
# Sizes are not specialised on (Triton would otherwise compile a variant for every length that is 1
# or a multiple of 16); strides still are, since their alignment is what lets loads vectorise.
_SIZE_ARGS = ["n_heads", "n_queries", "n_keys"]


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
    for dK/dV, slower for the forward and dQ; docs/flash_tuning.md).
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
    """Online softmax over key tiles [key_start, key_end), into acc; MASKED
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
        v = _load_rows(v_base + cols[:, None] * stride_vn + offs_d[None, :], cols, n_keys, offs_d,
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
                      IS_CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(normalised output, base-2 log-sum-exp) of the BLOCK_M queries from q_start over the keys in
    [key_lo, key_hi), both multiples of BLOCK_N or key_hi the end of the keys seen."""
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
        # BLOCK_N); tiles after it are wholly above and never visited.
        masked_start = tl.minimum(q_start, full_keys_end)
    else:
        masked_start = full_keys_end
    acc, l_i, m_i = _forward_key_loop(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn,
                                      key_lo, tl.minimum(key_hi, masked_start), offs_m, offs_n, offs_d,
                                      n_keys, qk_scale, False, IS_CAUSAL, HEAD_DIM, BLOCK_D, BLOCK_N)
    acc, l_i, m_i = _forward_key_loop(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn,
                                      tl.maximum(key_lo, masked_start), key_hi, offs_m, offs_n, offs_d,
                                      n_keys, qk_scale, True, IS_CAUSAL, HEAD_DIM, BLOCK_D, BLOCK_N)
    return acc / l_i[:, None], m_i + tl.math.log2(l_i)


@triton.jit(do_not_specialize=_SIZE_ARGS)
def forward_kernel(Q, K, V, O, L,
                   stride_qb, stride_qh, stride_qn,
                   stride_kb, stride_kh, stride_kn,
                   stride_vb, stride_vh, stride_vn,
                   stride_ob, stride_oh, stride_on,
                   n_heads, n_queries, n_keys, qk_scale,
                   IS_CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per (batch x head, query tile): o and L for BLOCK_M queries."""
    # A float argument is fp32 when Triton's own launcher passes it and fp64 when torch.compile's does:
    # fp64 would spread through the scores into tl.dot, which refuses it.
    qk_scale = tl.cast(qk_scale, tl.float32)
    pid_bh, batch, head, pid_m = _program_tile(n_queries, n_heads, BLOCK_M, True)
    q_start = pid_m * BLOCK_M
    o, lse2 = _attend_key_range(Q, K, V, batch, head, stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                                stride_vb, stride_vh, stride_vn, q_start, 0,
                                _keys_seen_end(q_start, n_keys, IS_CAUSAL, BLOCK_M), n_queries, n_keys, qk_scale,
                                IS_CAUSAL, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N)
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
def split_forward_kernel(Q, K, V, O, L, Partial, Arrivals,
                         stride_qb, stride_qh, stride_qn,
                         stride_kb, stride_kh, stride_kn,
                         stride_vb, stride_vh, stride_vn,
                         stride_ob, stride_oh, stride_on,
                         n_heads, n_queries, n_keys, split_keys, qk_scale,
                         IS_CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         RUNS: tl.constexpr, MERGE_COLUMNS: tl.constexpr):
    """The forward for grids too small to fill the GPU, where one program walking all of a long
    query tile's keys is the time: a query tile's keys are cut into runs of split_keys (a multiple
    of BLOCK_M, so the causal diagonal lies in the last run), the run on grid axis 1.

    A tile with one run stores o and L as forward_kernel does. Otherwise each program stores its
    run's normalised output and base-2 log-sum-exp in Partial, then counts itself in its tile's
    Arrivals slot (zeroed by the caller); the last to arrive merges the runs (out_s weighted by
    2^(lse_s - lse)) and stores o and L.

    The merge reads every run's lse first, so that the weights are known, then merges MERGE_COLUMNS
    columns at a time over all RUNS (the grid's runs, unrolled, masked past this tile's): a chunk's
    loads are all in flight at once, within the registers a chunk needs.
    """
    # fp32 scales, whichever launcher passed them (see forward_kernel).
    qk_scale = tl.cast(qk_scale, tl.float32)
    pid_bh, batch, head, pid_m = _program_tile(n_queries, n_heads, BLOCK_M, True)
    split = tl.program_id(1)
    q_start = pid_m * BLOCK_M
    keys_end = _keys_seen_end(q_start, n_keys, IS_CAUSAL, BLOCK_M)
    n_splits = tl.cdiv(keys_end, split_keys)
    if split < n_splits:
        key_lo = split * split_keys
        o, lse2 = _attend_key_range(Q, K, V, batch, head, stride_qb, stride_qh, stride_qn, stride_kb, stride_kh,
                                    stride_kn, stride_vb, stride_vh, stride_vn, q_start, key_lo,
                                    tl.minimum(key_lo + split_keys, keys_end), n_queries, n_keys, qk_scale,
                                    IS_CAUSAL, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N)
        offs_m = q_start + tl.arange(0, BLOCK_M)
        if n_splits == 1:
            _store_output(O, L, pid_bh, batch, head, stride_ob, stride_oh, stride_on, o, lse2, offs_m,
                          tl.arange(0, BLOCK_D), n_queries, HEAD_DIM, BLOCK_D)
        else:
            # Partial: per (tile, run) slot, BLOCK_M x BLOCK_D outputs; after all slots, BLOCK_M lse each.
            tile_slot = pid_bh.to(tl.int64) * tl.cdiv(n_queries, BLOCK_M) + pid_m
            n_slots = tl.num_programs(0).to(tl.int64) * RUNS
            rows = tl.arange(0, BLOCK_M)
            offs_d = tl.arange(0, BLOCK_D)
            out_base = Partial + tile_slot * RUNS * (BLOCK_M * BLOCK_D)
            lse_base = Partial + n_slots * (BLOCK_M * BLOCK_D) + tile_slot * RUNS * BLOCK_M
            tl.store(out_base + split * (BLOCK_M * BLOCK_D) + rows[:, None] * BLOCK_D + offs_d[None, :], o)
            tl.store(lse_base + split * BLOCK_M + rows, lse2)
            # Every warp's stores come before the count (one thread's release, as a semaphore does).
            tl.debug_barrier()
            arrived = tl.atomic_add(Arrivals + tile_slot, 1, sem="acq_rel", scope="gpu")
            if arrived == n_splits - 1:
                # .cg reads at L2, where the other programs' stores are, past this SM's L1.
                lse_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
                for run in tl.static_range(RUNS):
                    lse_max = tl.maximum(lse_max, _run_lse(lse_base, run, rows, n_splits, BLOCK_M))
                weight_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
                for run in tl.static_range(RUNS):
                    weight_sum += tl.math.exp2(_run_lse(lse_base, run, rows, n_splits, BLOCK_M) - lse_max)
                lse2 = lse_max + tl.math.log2(weight_sum)
                columns = tl.arange(0, MERGE_COLUMNS)
                for first in tl.static_range(0, BLOCK_D, MERGE_COLUMNS):
                    merged = tl.zeros([BLOCK_M, MERGE_COLUMNS], dtype=tl.float32)
                    for run in tl.static_range(RUNS):
                        weight = tl.math.exp2(_run_lse(lse_base, run, rows, n_splits, BLOCK_M) - lse2)
                        out_run = tl.load(out_base + run * (BLOCK_M * BLOCK_D) + rows[:, None] * BLOCK_D
                                          + (first + columns)[None, :],
                                          mask=(rows[:, None] < BLOCK_M) & (run < n_splits), other=0.0,
                                          cache_modifier=".cg")
                        merged += out_run * weight[:, None]
                    out_columns = first + columns
                    _store_rows(_tile_ptrs(O, batch, head, stride_ob, stride_oh, stride_on, offs_m, out_columns),
                                merged.to(O.dtype.element_ty), offs_m, n_queries, out_columns, HEAD_DIM, BLOCK_D)
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
def dkdv_kernel(Q, K, V, DO, L, Delta, DK, DV,
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
    # fp32 scales, whichever launcher passed them (see forward_kernel).
    qk_scale = tl.cast(qk_scale, tl.float32)
    sm_scale = tl.cast(sm_scale, tl.float32)
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
def dq_kernel(Q, K, V, O, DO, L, Delta, DQ,
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
    # fp32 scales, whichever launcher passed them (see forward_kernel).
    qk_scale = tl.cast(qk_scale, tl.float32)
    sm_scale = tl.cast(sm_scale, tl.float32)
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

