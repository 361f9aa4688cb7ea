"""The FlashAttention-2 Triton kernels: the forward (whole, and split into runs of keys for grids too
small to fill the GPU), dQ over query tiles (which also writes D = rowsum(dO * O)), then dK/dV over
key tiles, so that no kernel needs atomics on its outputs.

Every kernel takes (batch, heads, n, d) tensors by stride, rows of d contiguous elements. On chip a
row is one chunk of BLOCK_D columns, or, where that would pad much (d 80 in 128), a chunk of BLOCK_D
and a tail of TAIL_D (d 80 = 64 + 16): every dot over the head dim is then two dots into one
accumulator, and every output over it two tiles. Columns past the head dim (in BLOCK_D + TAIL_D, or in
the one chunk for small or odd head dims; tl.dot needs 16) are masked, read as zero.

Speed structure:
  - Scores are kept in base 2: S * log2(e) = q k^T * (log2(e) / sqrt(d)), one multiply, then exp2.
    L is stored in natural-log units, as the contract says.
  - Causal: key tiles wholly above the diagonal are never visited; the tiles that straddle it (and a
    partial tail tile) go through a masked copy of the loop, all other tiles through an unmasked one.
  - Launch order (_program_tile): heads in groups, each group's longest tiles first, so that the
    heads in flight share what they stream in L2 and every group ends on short programs.
  - DESCRIPTORS: the wide kernels can take the tiles their loop streams (K and V in the forward and dQ,
    Q and dO in dK/dV) through tensor descriptors (TMA on Hopper): one copy per tile, no per-element
    addresses, and rows past n read as zero by the hardware. Each such tensor comes as two descriptors
    over (batch, heads, n, d), the chunk's columns and the tail's; without DESCRIPTORS they are None.
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
_SIZE_ARGS = ["n_heads", "group_heads", "n_queries", "n_keys"]


@triton.jit
def _load_rows(ptrs, rows, n_rows, offs_d, CHECK_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, COLS_END: tl.constexpr):
    """A (rows, columns offs_d) tile, the columns ending at COLS_END; rows past n_rows and columns past
    HEAD_DIM read as zero (columns are masked only for a chunk that ends past HEAD_DIM)."""
    if CHECK_ROWS:
        if COLS_END <= HEAD_DIM:
            tile = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
        else:
            tile = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    else:
        if COLS_END <= HEAD_DIM:
            tile = tl.load(ptrs)
        else:
            tile = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    return tile


@triton.jit
def _program_tile(n_rows, n_heads, group_heads, BLOCK: tl.constexpr, LONGEST_LAST: tl.constexpr):
    """(batch x head, batch, head, tile index) of this program, in a 1-D grid of batch x heads x
    tiles; batch and head are int64, since batch offsets of long sequences pass 2^31.

    Programs start roughly in launch order. The batch x heads are taken in groups of group_heads
    (the last group may be smaller), a group's programs all before the next group's. Within a
    group every head's longest tile comes first, then every head's next longest, and so on: under
    a causal mask that is the last query tile for the forward and dQ (LONGEST_LAST), the first key
    tile for dK/dV. So each group starts on its longest programs and ends on short ones, and the
    heads in flight at once are few enough that their programs share the K and V (or Q and dO)
    they all stream in L2 (tiles.head_group sizes the groups; docs/flash_tuning.md, v22).
    """
    n_tiles = tl.cdiv(n_rows, BLOCK)
    n_batch_heads = tl.num_programs(0) // n_tiles
    pid = tl.program_id(0)
    group_programs = group_heads * n_tiles
    first_head = pid // group_programs * group_heads
    heads_here = tl.minimum(group_heads, n_batch_heads - first_head)
    in_group = pid % group_programs
    pid_bh = first_head + in_group % heads_here
    rank = in_group // heads_here
    tile = n_tiles - 1 - rank if LONGEST_LAST else rank
    return pid_bh, (pid_bh // n_heads).to(tl.int64), (pid_bh % n_heads).to(tl.int64), tile


@triton.jit
def _tile_ptrs(base, batch, head, stride_b, stride_h, stride_n, rows, offs_d):
    """Pointers to the (rows, columns offs_d) tile of one (batch, head) of a (batch, heads, n, d) tensor."""
    return base + batch * stride_b + head * stride_h + rows[:, None] * stride_n + offs_d[None, :]


@triton.jit
def _store_rows(ptrs, tile, rows, n_rows, offs_d, HEAD_DIM: tl.constexpr, COLS_END: tl.constexpr):
    """Store a (rows, columns offs_d) tile, the columns ending at COLS_END, as far as n_rows and HEAD_DIM."""
    if COLS_END <= HEAD_DIM:
        tl.store(ptrs, tile, mask=rows[:, None] < n_rows)
    else:
        tl.store(ptrs, tile, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def _tail_columns(offs_d, BLOCK_D: tl.constexpr, TAIL_D: tl.constexpr):
    """The tail chunk's columns, BLOCK_D to BLOCK_D + TAIL_D; without a tail, offs_d as a placeholder that no
    kernel reads (every use of the tail sits under `if TAIL_D > 0`)."""
    if TAIL_D > 0:
        offs_t = BLOCK_D + tl.arange(0, TAIL_D)
    else:
        offs_t = offs_d
    return offs_t


@triton.jit
def _load_row_chunks(base, stride_n, rows, n_rows, offs_d, offs_t, CHECK_ROWS: tl.constexpr,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, TAIL_D: tl.constexpr):
    """(chunk, tail) of the rows of one (batch, head) at base; without a tail, the chunk twice."""
    tile = _load_rows(base + rows[:, None] * stride_n + offs_d[None, :], rows, n_rows, offs_d, CHECK_ROWS,
                      HEAD_DIM, BLOCK_D)
    if TAIL_D > 0:
        tail = _load_rows(base + rows[:, None] * stride_n + offs_t[None, :], rows, n_rows, offs_t, CHECK_ROWS,
                          HEAD_DIM, BLOCK_D + TAIL_D)
    else:
        tail = tile
    return tile, tail


@triton.jit
def _load_described_rows(desc, desc_t, batch, head, start, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
                         TAIL_D: tl.constexpr):
    """(chunk, tail) of BLOCK rows from `start` of one (batch, head), through the chunk's and the tail's
    descriptors; rows past n and columns past the head dim read as zero. Without a tail, the chunk twice."""
    b = batch.to(tl.int32)
    h = head.to(tl.int32)
    tile = desc.load([b, h, start, 0]).reshape(BLOCK, BLOCK_D)
    if TAIL_D > 0:
        tail = desc_t.load([b, h, start, 0]).reshape(BLOCK, TAIL_D)
    else:
        tail = tile
    return tile, tail


@triton.jit
def _load_streamed_rows(desc, desc_t, base, stride_n, rows, n_rows, offs_d, offs_t, batch, head, start,
                        CHECK_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                        TAIL_D: tl.constexpr, BLOCK: tl.constexpr, DESCRIPTORS: tl.constexpr):
    """(chunk, tail) of the BLOCK rows `rows` (from `start`) a kernel's loop streams: through the descriptors
    where DESCRIPTORS is set, else through pointers from base (_load_row_chunks)."""
    if DESCRIPTORS:
        tile, tail = _load_described_rows(desc, desc_t, batch, head, start, BLOCK, BLOCK_D, TAIL_D)
    else:
        tile, tail = _load_row_chunks(base, stride_n, rows, n_rows, offs_d, offs_t, CHECK_ROWS, HEAD_DIM, BLOCK_D,
                                      TAIL_D)
    return tile, tail


@triton.jit
def _store_row_chunks(base, stride_n, tile, tail, rows, n_rows, offs_d, offs_t,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, TAIL_D: tl.constexpr):
    """Store (chunk, tail) as the rows of one (batch, head) at base, converted to its element type."""
    _store_rows(base + rows[:, None] * stride_n + offs_d[None, :], tile.to(base.dtype.element_ty), rows, n_rows,
                offs_d, HEAD_DIM, BLOCK_D)
    if TAIL_D > 0:
        _store_rows(base + rows[:, None] * stride_n + offs_t[None, :], tail.to(base.dtype.element_ty), rows, n_rows,
                    offs_t, HEAD_DIM, BLOCK_D + TAIL_D)


@triton.jit
def _dot_rows(a, b, a_t, b_t, TAIL_D: tl.constexpr):
    """a b^T over the head dim, chunk and tail: (rows of a, rows of b) fp32."""
    product = tl.dot(a, tl.trans(b))
    if TAIL_D > 0:
        product = tl.dot(a_t, tl.trans(b_t), product)
    return product


@triton.jit
def _forward_key_loop(acc, acc_t, l_i, m_i, q, q_t, k_base, v_base, stride_kn, stride_vn, key_start, key_end,
                      offs_m, offs_n, offs_d, offs_t, n_keys, qk_scale, KD, KT, VD, VT, batch, head,
                      MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, TAIL_D: tl.constexpr, BLOCK_N: tl.constexpr,
                      DESCRIPTORS: tl.constexpr):
    """Online softmax over key tiles [key_start, key_end), into acc (and acc_t, the tail's columns); MASKED
    applies the key-bound and causal masks, for tiles on the diagonal or past the end of the keys. K and V
    come through their descriptors (KD, KT, VD, VT) where DESCRIPTORS is set."""
    for start_n in range(key_start, key_end, BLOCK_N):
        cols = start_n + offs_n
        k, k_t = _load_streamed_rows(KD, KT, k_base, stride_kn, cols, n_keys, offs_d, offs_t, batch, head, start_n,
                                     MASKED, HEAD_DIM, BLOCK_D, TAIL_D, BLOCK_N, DESCRIPTORS)
        qk = _dot_rows(q, k, q_t, k_t, TAIL_D)
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
        v, v_t = _load_streamed_rows(VD, VT, v_base, stride_vn, cols, n_keys, offs_d, offs_t, batch, head, start_n,
                                     MASKED, HEAD_DIM, BLOCK_D, TAIL_D, BLOCK_N, DESCRIPTORS)
        acc = tl.dot(p.to(v.dtype), v, acc * correction[:, None])
        if TAIL_D > 0:
            acc_t = tl.dot(p.to(v_t.dtype), v_t, acc_t * correction[:, None])
        m_i = m_new
    return acc, acc_t, l_i, m_i


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
                      KD, KT, VD, VT,
                      IS_CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, TAIL_D: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DESCRIPTORS: tl.constexpr):
    """(normalised output, its tail columns, base-2 log-sum-exp) of the BLOCK_M queries from q_start over
    the keys in [key_lo, key_hi), both multiples of BLOCK_N or key_hi the end of the keys seen."""
    offs_m = q_start + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_t = _tail_columns(offs_d, BLOCK_D, TAIL_D)
    k_base = K + batch * stride_kb + head * stride_kh
    v_base = V + batch * stride_vb + head * stride_vh
    q, q_t = _load_row_chunks(Q + batch * stride_qb + head * stride_qh, stride_qn, offs_m, n_queries, offs_d, offs_t,
                              True, HEAD_DIM, BLOCK_D, TAIL_D)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if TAIL_D > 0:
        acc_t = tl.zeros([BLOCK_M, TAIL_D], dtype=tl.float32)
    else:
        acc_t = acc  # a placeholder the loop passes through unread
    full_keys_end = (n_keys // BLOCK_N) * BLOCK_N  # key tiles before this need no bound mask
    if IS_CAUSAL:
        # Tiles before the query tile are wholly below the diagonal (BLOCK_M is a multiple of
        # BLOCK_N); tiles after it are wholly above and never visited.
        masked_start = tl.minimum(q_start, full_keys_end)
    else:
        masked_start = full_keys_end
    acc, acc_t, l_i, m_i = _forward_key_loop(acc, acc_t, l_i, m_i, q, q_t, k_base, v_base, stride_kn, stride_vn,
                                             key_lo, tl.minimum(key_hi, masked_start), offs_m, offs_n, offs_d, offs_t,
                                             n_keys, qk_scale, KD, KT, VD, VT, batch, head, False, IS_CAUSAL,
                                             HEAD_DIM, BLOCK_D, TAIL_D, BLOCK_N, DESCRIPTORS)
    acc, acc_t, l_i, m_i = _forward_key_loop(acc, acc_t, l_i, m_i, q, q_t, k_base, v_base, stride_kn, stride_vn,
                                             tl.maximum(key_lo, masked_start), key_hi, offs_m, offs_n, offs_d, offs_t,
                                             n_keys, qk_scale, KD, KT, VD, VT, batch, head, True, IS_CAUSAL,
                                             HEAD_DIM, BLOCK_D, TAIL_D, BLOCK_N, DESCRIPTORS)
    return acc / l_i[:, None], acc_t / l_i[:, None], m_i + tl.math.log2(l_i)


@triton.jit(do_not_specialize=_SIZE_ARGS)
def forward_kernel(Q, K, V, O, L,
                   stride_qb, stride_qh, stride_qn,
                   stride_kb, stride_kh, stride_kn,
                   stride_vb, stride_vh, stride_vn,
                   stride_ob, stride_oh, stride_on,
                   n_heads, group_heads, n_queries, n_keys, qk_scale,
                   KD, KT, VD, VT,
                   IS_CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, TAIL_D: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DESCRIPTORS: tl.constexpr):
    """One program per (batch x head, query tile): o and L for BLOCK_M queries; K and V through the
    descriptors KD, KT, VD and VT where DESCRIPTORS is set (else they are None)."""
    # A float argument is fp32 when Triton's own launcher passes it and fp64 when torch.compile's does:
    # fp64 would spread through the scores into tl.dot, which refuses it.
    qk_scale = tl.cast(qk_scale, tl.float32)
    pid_bh, batch, head, pid_m = _program_tile(n_queries, n_heads, group_heads, BLOCK_M, True)
    q_start = pid_m * BLOCK_M
    o, o_t, lse2 = _attend_key_range(Q, K, V, batch, head, stride_qb, stride_qh, stride_qn, stride_kb, stride_kh,
                                     stride_kn, stride_vb, stride_vh, stride_vn, q_start, 0,
                                     _keys_seen_end(q_start, n_keys, IS_CAUSAL, BLOCK_M), n_queries, n_keys, qk_scale,
                                     KD, KT, VD, VT, IS_CAUSAL, HEAD_DIM, BLOCK_D, TAIL_D, BLOCK_M, BLOCK_N,
                                     DESCRIPTORS)
    _store_output(O, L, pid_bh, batch, head, stride_ob, stride_oh, stride_on, o, o_t, lse2,
                  q_start + tl.arange(0, BLOCK_M), n_queries, HEAD_DIM, BLOCK_D, TAIL_D)


@triton.jit
def _store_output(O, L, pid_bh, batch, head, stride_ob, stride_oh, stride_on, o, o_t, lse2, offs_m, n_queries,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, TAIL_D: tl.constexpr):
    """Store a query tile's output (chunk and tail) and its log-sum-exp, given in base 2 (L is stored in
    natural log units)."""
    offs_d = tl.arange(0, BLOCK_D)
    _store_row_chunks(O + batch * stride_ob + head * stride_oh, stride_on, o, o_t, offs_m, n_queries, offs_d,
                      _tail_columns(offs_d, BLOCK_D, TAIL_D), HEAD_DIM, BLOCK_D, TAIL_D)
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


@triton.jit
def _merge_runs(out_base, lse_base, lse2, rows, columns, n_splits, N_COLUMNS: tl.constexpr, ROW_WIDTH: tl.constexpr,
                RUNS: tl.constexpr, BLOCK_M: tl.constexpr):
    """The split forward's output in `columns` (N_COLUMNS of them): every run's partial output (rows of
    ROW_WIDTH in its slot) weighted by 2^(lse_run - lse2), summed over the runs this tile has. All loads of
    a column chunk are in flight at once; .cg reads at L2, where the other programs' stores are, past this
    SM's L1."""
    merged = tl.zeros([BLOCK_M, N_COLUMNS], dtype=tl.float32)
    for run in tl.static_range(RUNS):
        weight = tl.math.exp2(_run_lse(lse_base, run, rows, n_splits, BLOCK_M) - lse2)
        out_run = tl.load(out_base + run * (BLOCK_M * ROW_WIDTH) + rows[:, None] * ROW_WIDTH + columns[None, :],
                          mask=(rows[:, None] < BLOCK_M) & (run < n_splits), other=0.0, cache_modifier=".cg")
        merged += out_run * weight[:, None]
    return merged


@triton.jit(do_not_specialize=_SIZE_ARGS + ["split_keys"])
def split_forward_kernel(Q, K, V, O, L, Partial, Arrivals,
                         stride_qb, stride_qh, stride_qn,
                         stride_kb, stride_kh, stride_kn,
                         stride_vb, stride_vh, stride_vn,
                         stride_ob, stride_oh, stride_on,
                         n_heads, group_heads, n_queries, n_keys, split_keys, qk_scale,
                         IS_CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, TAIL_D: tl.constexpr,
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
    columns of the chunk at a time, then the tail, over all RUNS (the grid's runs, unrolled, masked past
    this tile's): a chunk's loads are all in flight at once, within the registers a chunk needs.
    """
    # fp32 scales, whichever launcher passed them (see forward_kernel).
    qk_scale = tl.cast(qk_scale, tl.float32)
    pid_bh, batch, head, pid_m = _program_tile(n_queries, n_heads, group_heads, BLOCK_M, True)
    split = tl.program_id(1)
    q_start = pid_m * BLOCK_M
    keys_end = _keys_seen_end(q_start, n_keys, IS_CAUSAL, BLOCK_M)
    n_splits = tl.cdiv(keys_end, split_keys)
    if split < n_splits:
        key_lo = split * split_keys
        o, o_t, lse2 = _attend_key_range(Q, K, V, batch, head, stride_qb, stride_qh, stride_qn, stride_kb, stride_kh,
                                         stride_kn, stride_vb, stride_vh, stride_vn, q_start, key_lo,
                                         tl.minimum(key_lo + split_keys, keys_end), n_queries, n_keys, qk_scale,
                                         None, None, None, None, IS_CAUSAL, HEAD_DIM, BLOCK_D, TAIL_D, BLOCK_M,
                                         BLOCK_N, False)
        offs_m = q_start + tl.arange(0, BLOCK_M)
        if n_splits == 1:
            _store_output(O, L, pid_bh, batch, head, stride_ob, stride_oh, stride_on, o, o_t, lse2, offs_m,
                          n_queries, HEAD_DIM, BLOCK_D, TAIL_D)
        else:
            # Partial: per (tile, run) slot, BLOCK_M rows of BLOCK_D + TAIL_D outputs; after all slots,
            # BLOCK_M lse each.
            row_width: tl.constexpr = BLOCK_D + TAIL_D
            tile_slot = pid_bh.to(tl.int64) * tl.cdiv(n_queries, BLOCK_M) + pid_m
            n_slots = tl.num_programs(0).to(tl.int64) * RUNS
            rows = tl.arange(0, BLOCK_M)
            offs_d = tl.arange(0, BLOCK_D)
            offs_t = _tail_columns(offs_d, BLOCK_D, TAIL_D)
            out_base = Partial + tile_slot * RUNS * (BLOCK_M * row_width)
            lse_base = Partial + n_slots * (BLOCK_M * row_width) + tile_slot * RUNS * BLOCK_M
            _store_row_chunks(out_base + split * (BLOCK_M * row_width), row_width, o, o_t, rows, BLOCK_M, offs_d,
                              offs_t, row_width, BLOCK_D, TAIL_D)
            tl.store(lse_base + split * BLOCK_M + rows, lse2)
            # Every warp's stores come before the count (one thread's release, as a semaphore does).
            tl.debug_barrier()
            arrived = tl.atomic_add(Arrivals + tile_slot, 1, sem="acq_rel", scope="gpu")
            if arrived == n_splits - 1:
                lse_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
                for run in tl.static_range(RUNS):
                    lse_max = tl.maximum(lse_max, _run_lse(lse_base, run, rows, n_splits, BLOCK_M))
                weight_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
                for run in tl.static_range(RUNS):
                    weight_sum += tl.math.exp2(_run_lse(lse_base, run, rows, n_splits, BLOCK_M) - lse_max)
                lse2 = lse_max + tl.math.log2(weight_sum)
                o_base = O + batch * stride_ob + head * stride_oh
                for first in tl.static_range(0, BLOCK_D, MERGE_COLUMNS):
                    columns = first + tl.arange(0, MERGE_COLUMNS)
                    merged = _merge_runs(out_base, lse_base, lse2, rows, columns, n_splits, MERGE_COLUMNS, row_width,
                                         RUNS, BLOCK_M)
                    _store_rows(o_base + offs_m[:, None] * stride_on + columns[None, :], merged.to(O.dtype.element_ty),
                                offs_m, n_queries, columns, HEAD_DIM, BLOCK_D)
                if TAIL_D > 0:
                    merged = _merge_runs(out_base, lse_base, lse2, rows, offs_t, n_splits, TAIL_D, row_width, RUNS,
                                         BLOCK_M)
                    _store_rows(o_base + offs_m[:, None] * stride_on + offs_t[None, :], merged.to(O.dtype.element_ty),
                                offs_m, n_queries, offs_t, HEAD_DIM, row_width)
                _store_lse(L, pid_bh, lse2, offs_m, n_queries)


@triton.jit
def _dkdv_query_loop(dk, dv, dk_t, dv_t, k, v, k_t, v_t, q_base, do_base, l_base, delta_base, stride_qn, stride_don,
                     query_start, query_end, cols, offs_m, offs_d, offs_t, n_queries, qk_scale, QD, QT, DOD, DOT,
                     batch, head, CHECK_ROWS: tl.constexpr, CAUSAL_MASK: tl.constexpr,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, TAIL_D: tl.constexpr, BLOCK_M: tl.constexpr,
                     DESCRIPTORS: tl.constexpr):
    """Accumulate dK and dV of one key tile (and of its tail columns) over query tiles [query_start, query_end).

    Works on transposed tiles (keys x queries) so that dV = P^T dO and dK = dS^T Q are plain dots.
    Query rows past n_queries load as zero with L = +inf, so their P, and every term, is zero. Q and dO
    come through their descriptors (QD, QT, DOD, DOT) where DESCRIPTORS is set.
    """
    for start_m in range(query_start, query_end, BLOCK_M):
        rows = start_m + offs_m
        q, q_t = _load_streamed_rows(QD, QT, q_base, stride_qn, rows, n_queries, offs_d, offs_t, batch, head,
                                     start_m, CHECK_ROWS, HEAD_DIM, BLOCK_D, TAIL_D, BLOCK_M, DESCRIPTORS)
        do, do_t = _load_streamed_rows(DOD, DOT, do_base, stride_don, rows, n_queries, offs_d, offs_t, batch, head,
                                       start_m, CHECK_ROWS, HEAD_DIM, BLOCK_D, TAIL_D, BLOCK_M, DESCRIPTORS)
        if CHECK_ROWS:
            lse = tl.load(l_base + rows, mask=rows < n_queries, other=float("inf"))
            delta = tl.load(delta_base + rows, mask=rows < n_queries, other=0.0)
        else:
            lse = tl.load(l_base + rows)
            delta = tl.load(delta_base + rows)
        s_t = _dot_rows(k, q, k_t, q_t, TAIL_D) * qk_scale
        p_t = tl.math.exp2(s_t - lse[None, :] * _LOG2E)
        if CAUSAL_MASK:
            p_t = tl.where(rows[None, :] >= cols[:, None], p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv)
        if TAIL_D > 0:
            dv_t = tl.dot(p_t.to(do_t.dtype), do_t, dv_t)
        dp_t = _dot_rows(v, do, v_t, do_t, TAIL_D)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk)
        if TAIL_D > 0:
            dk_t = tl.dot(ds_t.to(q_t.dtype), q_t, dk_t)
    return dk, dv, dk_t, dv_t


@triton.jit(do_not_specialize=_SIZE_ARGS)
def dkdv_kernel(Q, K, V, DO, L, Delta, DK, DV,
                stride_qb, stride_qh, stride_qn,
                stride_kb, stride_kh, stride_kn,
                stride_vb, stride_vh, stride_vn,
                stride_dob, stride_doh, stride_don,
                stride_dkb, stride_dkh, stride_dkn,
                stride_dvb, stride_dvh, stride_dvn,
                n_heads, group_heads, n_queries, n_keys, qk_scale, sm_scale,
                QD, QT, DOD, DOT,
                IS_CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, TAIL_D: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DESCRIPTORS: tl.constexpr):
    """One program per (batch x head, key tile): dK and dV for BLOCK_N keys, in one pass over
    the queries that can see them; Q and dO through the descriptors QD, QT, DOD and DOT where
    DESCRIPTORS is set (else they are None)."""
    # fp32 scales, whichever launcher passed them (see forward_kernel).
    qk_scale = tl.cast(qk_scale, tl.float32)
    sm_scale = tl.cast(sm_scale, tl.float32)
    pid_bh, batch, head, pid_n = _program_tile(n_keys, n_heads, group_heads, BLOCK_N, False)
    k_start = pid_n * BLOCK_N
    cols = k_start + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_t = _tail_columns(offs_d, BLOCK_D, TAIL_D)
    # Key rows past n_keys load as zero; their dK and dV rows are never stored.
    k, k_t = _load_row_chunks(K + batch * stride_kb + head * stride_kh, stride_kn, cols, n_keys, offs_d, offs_t,
                              True, HEAD_DIM, BLOCK_D, TAIL_D)
    v, v_t = _load_row_chunks(V + batch * stride_vb + head * stride_vh, stride_vn, cols, n_keys, offs_d, offs_t,
                              True, HEAD_DIM, BLOCK_D, TAIL_D)
    q_base = Q + batch * stride_qb + head * stride_qh
    do_base = DO + batch * stride_dob + head * stride_doh
    l_base = L + pid_bh.to(tl.int64) * n_queries
    delta_base = Delta + pid_bh.to(tl.int64) * n_queries

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    if TAIL_D > 0:
        dk_t = tl.zeros([BLOCK_N, TAIL_D], dtype=tl.float32)
        dv_t = tl.zeros([BLOCK_N, TAIL_D], dtype=tl.float32)
    else:
        dk_t, dv_t = dk, dv  # placeholders the loops pass through unread
    full_queries_end = (n_queries // BLOCK_M) * BLOCK_M  # query tiles before this need no bound mask
    if IS_CAUSAL:
        # Queries before the key tile see none of its keys; the query tiles level with it straddle
        # the diagonal (BLOCK_N is a multiple of BLOCK_M); later ones see all of it.
        diagonal_end = tl.minimum(k_start + BLOCK_N, n_queries)
        dk, dv, dk_t, dv_t = _dkdv_query_loop(dk, dv, dk_t, dv_t, k, v, k_t, v_t, q_base, do_base, l_base, delta_base,
                                              stride_qn, stride_don, k_start, diagonal_end, cols, offs_m, offs_d,
                                              offs_t, n_queries, qk_scale, QD, QT, DOD, DOT, batch, head, True,
                                              True, HEAD_DIM, BLOCK_D, TAIL_D, BLOCK_M, DESCRIPTORS)
        unmasked_start = k_start + BLOCK_N
    else:
        unmasked_start = 0
    dk, dv, dk_t, dv_t = _dkdv_query_loop(dk, dv, dk_t, dv_t, k, v, k_t, v_t, q_base, do_base, l_base, delta_base,
                                          stride_qn, stride_don, unmasked_start, full_queries_end, cols, offs_m,
                                          offs_d, offs_t, n_queries, qk_scale, QD, QT, DOD, DOT, batch, head, False,
                                          False, HEAD_DIM, BLOCK_D, TAIL_D, BLOCK_M, DESCRIPTORS)
    dk, dv, dk_t, dv_t = _dkdv_query_loop(dk, dv, dk_t, dv_t, k, v, k_t, v_t, q_base, do_base, l_base, delta_base,
                                          stride_qn, stride_don, tl.maximum(unmasked_start, full_queries_end),
                                          n_queries, cols, offs_m, offs_d, offs_t, n_queries, qk_scale, QD, QT, DOD,
                                          DOT, batch, head, True, False, HEAD_DIM, BLOCK_D, TAIL_D, BLOCK_M,
                                          DESCRIPTORS)

    # The columns again, rather than kept live through the loops, which descriptor loads do not need them in.
    store_d = tl.arange(0, BLOCK_D)
    store_t = _tail_columns(store_d, BLOCK_D, TAIL_D)
    _store_row_chunks(DK + batch * stride_dkb + head * stride_dkh, stride_dkn, dk * sm_scale, dk_t * sm_scale, cols,
                      n_keys, store_d, store_t, HEAD_DIM, BLOCK_D, TAIL_D)
    _store_row_chunks(DV + batch * stride_dvb + head * stride_dvh, stride_dvn, dv, dv_t, cols, n_keys, store_d, store_t,
                      HEAD_DIM, BLOCK_D, TAIL_D)


@triton.jit
def _dq_key_loop(dq, dq_t, q, q_t, do, do_t, lse, delta, k_base, v_base, stride_kn, stride_vn, key_start, key_end,
                 offs_m, offs_n, offs_d, offs_t, n_keys, qk_scale, KD, KT, VD, VT, batch, head,
                 MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, TAIL_D: tl.constexpr, BLOCK_N: tl.constexpr,
                 DESCRIPTORS: tl.constexpr):
    """Accumulate dQ (and its tail columns) of one query tile over key tiles [key_start, key_end); K and V
    through their descriptors where DESCRIPTORS is set."""
    for start_n in range(key_start, key_end, BLOCK_N):
        cols = start_n + offs_n
        k, k_t = _load_streamed_rows(KD, KT, k_base, stride_kn, cols, n_keys, offs_d, offs_t, batch, head, start_n,
                                     MASKED, HEAD_DIM, BLOCK_D, TAIL_D, BLOCK_N, DESCRIPTORS)
        v, v_t = _load_streamed_rows(VD, VT, v_base, stride_vn, cols, n_keys, offs_d, offs_t, batch, head, start_n,
                                     MASKED, HEAD_DIM, BLOCK_D, TAIL_D, BLOCK_N, DESCRIPTORS)
        s = _dot_rows(q, k, q_t, k_t, TAIL_D) * qk_scale
        p = tl.math.exp2(s - lse[:, None])
        if MASKED:
            keep = cols[None, :] < n_keys
            if IS_CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None])
            p = tl.where(keep, p, 0.0)
        dp = _dot_rows(do, v, do_t, v_t, TAIL_D)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq)
        if TAIL_D > 0:
            dq_t = tl.dot(ds.to(k_t.dtype), k_t, dq_t)
    return dq, dq_t


@triton.jit(do_not_specialize=_SIZE_ARGS)
def dq_kernel(Q, K, V, O, DO, L, Delta, DQ,
              stride_qb, stride_qh, stride_qn,
              stride_kb, stride_kh, stride_kn,
              stride_vb, stride_vh, stride_vn,
              stride_ob, stride_oh, stride_on,
              stride_dob, stride_doh, stride_don,
              stride_dqb, stride_dqh, stride_dqn,
              n_heads, group_heads, n_queries, n_keys, qk_scale, sm_scale,
              KD, KT, VD, VT,
              IS_CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, TAIL_D: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DESCRIPTORS: tl.constexpr):
    """One program per (batch x head, query tile): D = rowsum(dO * O) for its BLOCK_M queries,
    stored for the dK/dV kernel that runs next, then dQ, with the forward's loop structure
    (unmasked tiles below the diagonal, masked diagonal and tail tiles)."""
    # fp32 scales, whichever launcher passed them (see forward_kernel).
    qk_scale = tl.cast(qk_scale, tl.float32)
    sm_scale = tl.cast(sm_scale, tl.float32)
    pid_bh, batch, head, pid_m = _program_tile(n_queries, n_heads, group_heads, BLOCK_M, True)
    q_start = pid_m * BLOCK_M
    offs_m = q_start + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_t = _tail_columns(offs_d, BLOCK_D, TAIL_D)
    q, q_t = _load_row_chunks(Q + batch * stride_qb + head * stride_qh, stride_qn, offs_m, n_queries, offs_d, offs_t,
                              True, HEAD_DIM, BLOCK_D, TAIL_D)
    do, do_t = _load_row_chunks(DO + batch * stride_dob + head * stride_doh, stride_don, offs_m, n_queries, offs_d,
                                offs_t, True, HEAD_DIM, BLOCK_D, TAIL_D)
    o, o_t = _load_row_chunks(O + batch * stride_ob + head * stride_oh, stride_on, offs_m, n_queries, offs_d, offs_t,
                              True, HEAD_DIM, BLOCK_D, TAIL_D)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)  # rows past n_queries load as zero: D = 0
    if TAIL_D > 0:
        delta += tl.sum(o_t.to(tl.float32) * do_t.to(tl.float32), 1)
    tl.store(Delta + pid_bh.to(tl.int64) * n_queries + offs_m, delta, mask=offs_m < n_queries)
    # Rows past n_queries get L = 0: finite, and their dQ is never stored.
    lse = tl.load(L + pid_bh.to(tl.int64) * n_queries + offs_m, mask=offs_m < n_queries, other=0.0) * _LOG2E
    k_base = K + batch * stride_kb + head * stride_kh
    v_base = V + batch * stride_vb + head * stride_vh

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if TAIL_D > 0:
        dq_t = tl.zeros([BLOCK_M, TAIL_D], dtype=tl.float32)
    else:
        dq_t = dq  # a placeholder the loops pass through unread
    full_keys_end = (n_keys // BLOCK_N) * BLOCK_N
    if IS_CAUSAL:
        masked_start = tl.minimum(q_start, full_keys_end)
        masked_end = tl.minimum(q_start + BLOCK_M, n_keys)
    else:
        masked_start = full_keys_end
        masked_end = n_keys
    dq, dq_t = _dq_key_loop(dq, dq_t, q, q_t, do, do_t, lse, delta, k_base, v_base, stride_kn, stride_vn, 0,
                            masked_start, offs_m, offs_n, offs_d, offs_t, n_keys, qk_scale, KD, KT, VD, VT, batch, head,
                            False, IS_CAUSAL, HEAD_DIM, BLOCK_D, TAIL_D, BLOCK_N, DESCRIPTORS)
    dq, dq_t = _dq_key_loop(dq, dq_t, q, q_t, do, do_t, lse, delta, k_base, v_base, stride_kn, stride_vn, masked_start,
                            masked_end, offs_m, offs_n, offs_d, offs_t, n_keys, qk_scale, KD, KT, VD, VT, batch, head,
                            True, IS_CAUSAL, HEAD_DIM, BLOCK_D, TAIL_D, BLOCK_N, DESCRIPTORS)
    store_d = tl.arange(0, BLOCK_D)  # as in dK/dV: not kept live through the loops
    _store_row_chunks(DQ + batch * stride_dqb + head * stride_dqh, stride_dqn, dq * sm_scale, dq_t * sm_scale, offs_m,
                      n_queries, store_d, _tail_columns(store_d, BLOCK_D, TAIL_D), HEAD_DIM, BLOCK_D, TAIL_D)
