"""Try two changes to the FlashAttention-2 Triton kernels that the kept kernels do not make, at one shape (by
default one block's attention in the 2026 leaderboard's model: batch 1, 32 heads, N 32768, d 128, bf16, causal),
beside the kernels as kept and SDPA's cuDNN in the same run:

  - a one-pass backward: one program per key tile forms dK and dV as the kept dK/dV kernel does and also each
    query tile's share of dQ, dS K, which it adds into an fp32 sum, by pointer atomics or (on a GPU with TMA) by
    a tensor descriptor's bulk reduce-add. The kept backward forms dQ in a second pass over query tiles: it does
    7 matmuls per score tile where this does 5, and needs no atomics. D = rowsum(dO * O) and the zeroed sum come
    from a first kernel, dQ from a cast of the sum.
  - a persistent, causal-balanced schedule for the forward and the dK/dV kernel: a fixed number of programs
    per SM, each walking work items (a head's tile) in the kept launch order, dealt snake-wise (odd rounds take
    the programs in reverse), so that every program's long and short causal tiles even out. The same kernels
    launched one program per item (the kept kernels' grid) are the control: they must time as the kept ones do.

Each variant's outputs are checked against the kept kernels' before it is timed (triton.testing.do_bench,
median), and what Triton compiled it to (registers, spills) is printed. docs/flash_tuning.md records the
measurements: the one-pass backward at d 80 after v16 and v21, and these tries at d 128.

    python scripts/try_flash_schedules.py --json tries.json
    TRITON_INTERPRET=1 python scripts/try_flash_schedules.py --check   # a CPU: against a float64 reference

(The interpreter has no descriptor reduce-add: --check covers the pointer atomics and the schedules.)
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.tools.tensor_descriptor import TensorDescriptor

from cs336_systems.attention.flash_triton import kernels as fk
from cs336_systems.attention.flash_triton import launch as ft
from cs336_systems.attention.flash_triton import plan_for
from cs336_systems.attention.flash_triton.tiles import Tiles, cdiv, head_dim_chunks, head_group
from cs336_systems.conformance.attention_reference import discrepancies, reference_attention, tolerance_for

_LOG2E = tl.constexpr(fk.LOG2E)
# How a key tile's program treats dQ: not at all (the two-pass dK/dV kernel), or adding its share to an fp32
# sum through pointer atomics or through a descriptor's reduce-add.
NO_DQ, ATOMIC_DQ, TMA_DQ = 0, 1, 2
DQ_MODES = {"atomic": ATOMIC_DQ, "tma": TMA_DQ}
# One-pass tiles to try, (queries stepped, keys owned, warps, stages): dK/dV's owned keys are a multiple of
# the stepped queries (the causal loop split relies on it). At d 128 the kept dK/dV takes 64 x 128 w8 s4.
ONE_PASS_TILES = (Tiles(64, 128, 8, 3), Tiles(64, 128, 8, 2), Tiles(32, 128, 8, 3), Tiles(64, 64, 4, 3),
                  Tiles(64, 64, 8, 3), Tiles(32, 64, 4, 3), Tiles(16, 128, 8, 3))
PROGRAMS_PER_SM = (1, 2)  # the persistent launches' programs per SM
# Largest difference from the kept kernels' result, over its largest magnitude, that a variant may show
# before it is timed: other tiles and the atomics sum in another order (bf16 rounds at 2^-8).
AGREEMENT = {torch.bfloat16: 2e-2, torch.float16: 2e-2, torch.float32: 1e-3}
# --check: small shapes that cover several tiles, a partial last tile, n_q != n_k, and d 80 (a tail chunk).
CHECK_SHAPES = ((1, 2, 77, 77, 64), (2, 1, 130, 130, 80), (1, 2, 50, 96, 32), (1, 1, 96, 40, 128))
CHECK_TILES = Tiles(16, 32, 1, 1)


@triton.jit
def _item_tile(item, n_rows, n_batch_heads, n_heads, group_heads, BLOCK: tl.constexpr, LONGEST_LAST: tl.constexpr):
    """kernels._program_tile's order, for work item `item` rather than the program's id: (batch x head, batch,
    head, tile). Were the persistent schedule kept, _program_tile would call this with its id."""
    n_tiles = tl.cdiv(n_rows, BLOCK)
    group_programs = group_heads * n_tiles
    first_head = item // group_programs * group_heads
    heads_here = tl.minimum(group_heads, n_batch_heads - first_head)
    in_group = item % group_programs
    pid_bh = first_head + in_group % heads_here
    rank = in_group // heads_here
    tile = n_tiles - 1 - rank if LONGEST_LAST else rank
    return pid_bh, (pid_bh // n_heads).to(tl.int64), (pid_bh % n_heads).to(tl.int64), tile


@triton.jit
def _dealt_item(round):
    """The work item this program takes in `round`: the programs take a round's items in order on even rounds
    and in reverse on odd ones, so that, items being longest first, each program's sum of lengths evens out.
    With one round and a program per item it is the program's id, as the kept kernels have it."""
    slot = tl.program_id(0)
    slots = tl.num_programs(0)
    return round * slots + tl.where(round % 2 == 0, slot, slots - 1 - slot)


@triton.jit(do_not_specialize=fk._SIZE_ARGS + ["n_batch_heads", "rounds"])
def dealt_forward_kernel(Q, K, V, O, L,
                         stride_qb, stride_qh, stride_qn,
                         stride_kb, stride_kh, stride_kn,
                         stride_vb, stride_vh, stride_vn,
                         stride_ob, stride_oh, stride_on,
                         n_heads, group_heads, n_queries, n_keys, qk_scale, n_batch_heads, rounds,
                         IS_CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, TAIL_D: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """kernels.forward_kernel's work (pointer loads), its query tiles dealt over the programs (_dealt_item)."""
    qk_scale = tl.cast(qk_scale, tl.float32)
    n_items = n_batch_heads * tl.cdiv(n_queries, BLOCK_M)
    for round in range(0, rounds, 1):
        item = _dealt_item(round)
        if item < n_items:
            pid_bh, batch, head, pid_m = _item_tile(item, n_queries, n_batch_heads, n_heads, group_heads, BLOCK_M,
                                                    True)
            q_start = pid_m * BLOCK_M
            o, o_t, lse2 = fk._attend_key_range(Q, K, V, batch, head, stride_qb, stride_qh, stride_qn, stride_kb,
                                                stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, q_start, 0,
                                                fk._keys_seen_end(q_start, n_keys, IS_CAUSAL, BLOCK_M), n_queries,
                                                n_keys, qk_scale, None, None, None, None, IS_CAUSAL, HEAD_DIM, BLOCK_D,
                                                TAIL_D, BLOCK_M, BLOCK_N, False)
            fk._store_output(O, L, pid_bh, batch, head, stride_ob, stride_oh, stride_on, o, o_t, lse2,
                             q_start + tl.arange(0, BLOCK_M), n_queries, HEAD_DIM, BLOCK_D, TAIL_D)


@triton.jit
def _reduce_dq(part, dq_rows, desc, pid_bh, start_m, rows, columns, n_queries, HEAD_DIM: tl.constexpr,
               COLUMN_START: tl.constexpr, COLUMNS_END: tl.constexpr, BLOCK_M: tl.constexpr,
               DQ_MODE: tl.constexpr):
    """Add a query tile's share of dQ in `columns` (COLUMN_START to COLUMNS_END) into the fp32 sum: by pointer
    atomics at dq_rows (its (batch x head)'s rows, HEAD_DIM apart), or by the descriptor's reduce-add, which
    drops what lies past n_queries and HEAD_DIM."""
    if DQ_MODE == ATOMIC_DQ:
        ptrs = dq_rows + rows[:, None] * HEAD_DIM + columns[None, :]
        if COLUMNS_END <= HEAD_DIM:
            tl.atomic_add(ptrs, part, mask=rows[:, None] < n_queries, sem="relaxed")
        else:
            tl.atomic_add(ptrs, part, mask=(rows[:, None] < n_queries) & (columns[None, :] < HEAD_DIM),
                          sem="relaxed")
    else:
        desc.atomic_add([pid_bh.to(tl.int32), start_m, COLUMN_START],
                        part.reshape(1, BLOCK_M, COLUMNS_END - COLUMN_START))


@triton.jit
def _key_tile_query_loop(dk, dv, dk_t, dv_t, k, v, k_t, v_t, q_base, do_base, l_base, delta_base, dq_rows, dq_desc,
                         dq_desc_t, pid_bh, stride_qn, stride_don, query_start, query_end, cols, offs_m, offs_d,
                         offs_t, n_queries, qk_scale, CHECK_ROWS: tl.constexpr, CAUSAL_MASK: tl.constexpr,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, TAIL_D: tl.constexpr, BLOCK_M: tl.constexpr,
                         DQ_MODE: tl.constexpr):
    """kernels._dkdv_query_loop (pointer loads), and where DQ_MODE asks, each query tile's dQ share dS K added
    into the sum: one more matmul on the dS tile."""
    for start_m in range(query_start, query_end, BLOCK_M):
        rows = start_m + offs_m
        q, q_t = fk._load_row_chunks(q_base, stride_qn, rows, n_queries, offs_d, offs_t, CHECK_ROWS, HEAD_DIM,
                                     BLOCK_D, TAIL_D)
        do, do_t = fk._load_row_chunks(do_base, stride_don, rows, n_queries, offs_d, offs_t, CHECK_ROWS, HEAD_DIM,
                                       BLOCK_D, TAIL_D)
        if CHECK_ROWS:
            lse = tl.load(l_base + rows, mask=rows < n_queries, other=float("inf"))
            delta = tl.load(delta_base + rows, mask=rows < n_queries, other=0.0)
        else:
            lse = tl.load(l_base + rows)
            delta = tl.load(delta_base + rows)
        p_t = tl.math.exp2(fk._dot_rows(k, q, k_t, q_t, TAIL_D) * qk_scale - lse[None, :] * _LOG2E)
        if CAUSAL_MASK:
            p_t = tl.where(rows[None, :] >= cols[:, None], p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv)
        if TAIL_D > 0:
            dv_t = tl.dot(p_t.to(do_t.dtype), do_t, dv_t)
        ds_t = p_t * (fk._dot_rows(v, do, v_t, do_t, TAIL_D) - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk)
        if TAIL_D > 0:
            dk_t = tl.dot(ds_t.to(q_t.dtype), q_t, dk_t)
        if DQ_MODE != NO_DQ:
            ds = tl.trans(ds_t.to(k.dtype))
            _reduce_dq(tl.dot(ds, k), dq_rows, dq_desc, pid_bh, start_m, rows, offs_d, n_queries, HEAD_DIM, 0,
                       BLOCK_D, BLOCK_M, DQ_MODE)
            if TAIL_D > 0:
                _reduce_dq(tl.dot(ds, k_t), dq_rows, dq_desc_t, pid_bh, start_m, rows, offs_t, n_queries, HEAD_DIM,
                           BLOCK_D, BLOCK_D + TAIL_D, BLOCK_M, DQ_MODE)
    return dk, dv, dk_t, dv_t


@triton.jit(do_not_specialize=fk._SIZE_ARGS + ["n_batch_heads", "rounds"])
def dealt_key_tiles_kernel(Q, K, V, DO, L, Delta, DK, DV, DQ_SUM, DQ_DESC, DQ_DESC_T,
                           stride_qb, stride_qh, stride_qn,
                           stride_kb, stride_kh, stride_kn,
                           stride_vb, stride_vh, stride_vn,
                           stride_dob, stride_doh, stride_don,
                           stride_dkb, stride_dkh, stride_dkn,
                           stride_dvb, stride_dvh, stride_dvn,
                           n_heads, group_heads, n_queries, n_keys, qk_scale, sm_scale, n_batch_heads, rounds,
                           IS_CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                           TAIL_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           DQ_MODE: tl.constexpr):
    """kernels.dkdv_kernel's work (pointer loads), its key tiles dealt over the programs (_dealt_item); with
    DQ_MODE, the one-pass backward's, dQ's shares summed into DQ_SUM ((batch x heads, n_queries, HEAD_DIM) fp32,
    zeroed; DQ_DESC and DQ_DESC_T describe its chunk's and tail's columns for TMA_DQ)."""
    qk_scale = tl.cast(qk_scale, tl.float32)
    sm_scale = tl.cast(sm_scale, tl.float32)
    n_items = n_batch_heads * tl.cdiv(n_keys, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_t = fk._tail_columns(offs_d, BLOCK_D, TAIL_D)
    full_queries_end = (n_queries // BLOCK_M) * BLOCK_M
    for round in range(0, rounds, 1):
        item = _dealt_item(round)
        if item < n_items:
            pid_bh, batch, head, pid_n = _item_tile(item, n_keys, n_batch_heads, n_heads, group_heads, BLOCK_N,
                                                    False)
            k_start = pid_n * BLOCK_N
            cols = k_start + tl.arange(0, BLOCK_N)
            k, k_t = fk._load_row_chunks(K + batch * stride_kb + head * stride_kh, stride_kn, cols, n_keys, offs_d,
                                         offs_t, True, HEAD_DIM, BLOCK_D, TAIL_D)
            v, v_t = fk._load_row_chunks(V + batch * stride_vb + head * stride_vh, stride_vn, cols, n_keys, offs_d,
                                         offs_t, True, HEAD_DIM, BLOCK_D, TAIL_D)
            q_base = Q + batch * stride_qb + head * stride_qh
            do_base = DO + batch * stride_dob + head * stride_doh
            l_base = L + pid_bh.to(tl.int64) * n_queries
            delta_base = Delta + pid_bh.to(tl.int64) * n_queries
            dq_rows = DQ_SUM + pid_bh.to(tl.int64) * n_queries * HEAD_DIM
            dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
            dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
            if TAIL_D > 0:
                dk_t = tl.zeros([BLOCK_N, TAIL_D], dtype=tl.float32)
                dv_t = tl.zeros([BLOCK_N, TAIL_D], dtype=tl.float32)
            else:
                dk_t, dv_t = dk, dv
            # The kept kernel's three loops: the diagonal's query tiles (causal), the whole ones, the partial last.
            if IS_CAUSAL:
                dk, dv, dk_t, dv_t = _key_tile_query_loop(
                    dk, dv, dk_t, dv_t, k, v, k_t, v_t, q_base, do_base, l_base, delta_base, dq_rows, DQ_DESC,
                    DQ_DESC_T, pid_bh, stride_qn, stride_don, k_start, tl.minimum(k_start + BLOCK_N, n_queries), cols,
                    offs_m, offs_d, offs_t, n_queries, qk_scale, True, True, HEAD_DIM, BLOCK_D, TAIL_D, BLOCK_M,
                    DQ_MODE)
                unmasked_start = k_start + BLOCK_N
            else:
                unmasked_start = 0
            dk, dv, dk_t, dv_t = _key_tile_query_loop(
                dk, dv, dk_t, dv_t, k, v, k_t, v_t, q_base, do_base, l_base, delta_base, dq_rows, DQ_DESC, DQ_DESC_T,
                pid_bh, stride_qn, stride_don, unmasked_start, full_queries_end, cols, offs_m, offs_d, offs_t,
                n_queries, qk_scale, False, False, HEAD_DIM, BLOCK_D, TAIL_D, BLOCK_M, DQ_MODE)
            dk, dv, dk_t, dv_t = _key_tile_query_loop(
                dk, dv, dk_t, dv_t, k, v, k_t, v_t, q_base, do_base, l_base, delta_base, dq_rows, DQ_DESC, DQ_DESC_T,
                pid_bh, stride_qn, stride_don, tl.maximum(unmasked_start, full_queries_end), n_queries, cols, offs_m,
                offs_d, offs_t, n_queries, qk_scale, True, False, HEAD_DIM, BLOCK_D, TAIL_D, BLOCK_M, DQ_MODE)
            fk._store_row_chunks(DK + batch * stride_dkb + head * stride_dkh, stride_dkn, dk * sm_scale,
                                 dk_t * sm_scale, cols, n_keys, offs_d, offs_t, HEAD_DIM, BLOCK_D, TAIL_D)
            fk._store_row_chunks(DV + batch * stride_dvb + head * stride_dvh, stride_dvn, dv, dv_t, cols, n_keys,
                                 offs_d, offs_t, HEAD_DIM, BLOCK_D, TAIL_D)


@triton.jit
def delta_kernel(O, DO, Delta, DQ_SUM, stride_ob, stride_oh, stride_on, stride_dob, stride_doh, stride_don,
                 n_heads, n_queries, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, TAIL_D: tl.constexpr,
                 BLOCK_M: tl.constexpr):
    """The one-pass backward's first kernel, a program per (batch x head, BLOCK_M queries): D = rowsum(dO * O),
    and the rows' dQ sum zeroed."""
    pid_bh = tl.program_id(0).to(tl.int64)
    batch = pid_bh // n_heads
    head = pid_bh % n_heads
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_t = fk._tail_columns(offs_d, BLOCK_D, TAIL_D)
    o, o_t = fk._load_row_chunks(O + batch * stride_ob + head * stride_oh, stride_on, rows, n_queries, offs_d,
                                 offs_t, True, HEAD_DIM, BLOCK_D, TAIL_D)
    do, do_t = fk._load_row_chunks(DO + batch * stride_dob + head * stride_doh, stride_don, rows, n_queries, offs_d,
                                   offs_t, True, HEAD_DIM, BLOCK_D, TAIL_D)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if TAIL_D > 0:
        delta += tl.sum(o_t.to(tl.float32) * do_t.to(tl.float32), 1)
    tl.store(Delta + pid_bh * n_queries + rows, delta, mask=rows < n_queries)
    zeros = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    zeros_t = tl.zeros([BLOCK_M, TAIL_D if TAIL_D > 0 else BLOCK_D], dtype=tl.float32)
    fk._store_row_chunks(DQ_SUM + pid_bh * n_queries * HEAD_DIM, HEAD_DIM, zeros, zeros_t, rows, n_queries, offs_d,
                         offs_t, HEAD_DIM, BLOCK_D, TAIL_D)


def _constants(head_dim: int, is_causal: bool, tiles: Tiles) -> dict:
    block_d, tail_d = head_dim_chunks(head_dim)
    return dict(IS_CAUSAL=is_causal, HEAD_DIM=head_dim, BLOCK_D=block_d, TAIL_D=tail_d, BLOCK_M=tiles.block_m,
                BLOCK_N=tiles.block_n, num_warps=tiles.num_warps, num_stages=tiles.num_stages)


def _strides(*tensors: torch.Tensor) -> tuple[int, ...]:
    return tuple(s for t in tensors for s in t.stride()[:3])


def _deal(items: int, programs: int | None) -> tuple[int, int]:
    """(grid, rounds): a program per item, or `programs` of them walking the items."""
    return (items, 1) if programs is None else (min(programs, items), cdiv(items, min(programs, items)))


def dealt_forward(q, k, v, is_causal: bool, tiles: Tiles, programs: int | None, compiled: dict):
    """(o, L) by dealt_forward_kernel on (batch, heads, n, d) tensors."""
    batch, heads, n_queries, head_dim = q.shape
    o = torch.empty_like(q)
    lse = q.new_empty((batch, heads, n_queries), dtype=torch.float32)
    n_tiles = cdiv(n_queries, tiles.block_m)
    grid, rounds = _deal(batch * heads * n_tiles, programs)
    compiled["forward"] = dealt_forward_kernel[(grid,)](
        q, k, v, o, lse, *_strides(q, k, v, o), heads, head_group(batch * heads, n_tiles, q.device), n_queries,
        k.shape[2], head_dim**-0.5 * fk.LOG2E, batch * heads, rounds, **_constants(head_dim, is_causal, tiles))
    return o, lse


def dealt_backward(q, k, v, o, lse, do, is_causal: bool, tiles: Tiles, dq_mode: str | None, programs: int | None,
                   compiled: dict, dq_tiles: Tiles | None = None):
    """(dq, dk, dv): with dq_mode, the one-pass backward (delta_kernel, dealt_key_tiles_kernel summing dQ, a cast);
    without, the kept dQ kernel on dq_tiles and then dealt_key_tiles_kernel as the dK/dV kernel."""
    batch, heads, n_queries, head_dim = q.shape
    n_keys = k.shape[2]
    block_d, tail_d = head_dim_chunks(head_dim)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    if dq_mode is None:
        dq, delta = ft.launch_dq(q, k, v, o, do, lse, is_causal, dq_tiles)
        dq_sum = delta  # unread without a dQ mode
    else:
        delta = q.new_empty((batch, heads, n_queries), dtype=torch.float32)
        dq_sum = q.new_empty((batch * heads, n_queries, head_dim), dtype=torch.float32)
        delta_kernel[(batch * heads, cdiv(n_queries, tiles.block_m))](
            o, do, delta, dq_sum, *_strides(o, do), heads, n_queries, HEAD_DIM=head_dim, BLOCK_D=block_d,
            TAIL_D=tail_d, BLOCK_M=tiles.block_m)
    descriptors = (None, None)
    if dq_mode == "tma":
        descriptors = tuple(TensorDescriptor.from_tensor(dq_sum, [1, tiles.block_m, columns])
                            for columns in (block_d, tail_d or block_d))
    n_tiles = cdiv(n_keys, tiles.block_n)
    grid, rounds = _deal(batch * heads * n_tiles, programs)
    qk_scale = head_dim**-0.5 * fk.LOG2E
    compiled["dkdv"] = dealt_key_tiles_kernel[(grid,)](
        q, k, v, do, lse, delta, dk, dv, dq_sum, *descriptors, *_strides(q, k, v, do, dk, dv), heads,
        head_group(batch * heads, n_tiles, q.device), n_queries, n_keys, qk_scale, head_dim**-0.5, batch * heads,
        rounds, DQ_MODE=DQ_MODES.get(dq_mode, NO_DQ), **_constants(head_dim, is_causal, tiles))
    if dq_mode is not None:
        dq = (dq_sum * head_dim**-0.5).to(q.dtype).view(q.shape)
    return dq, dk, dv


def describe(compiled) -> str:
    return f"{compiled.n_regs} regs, {compiled.n_spills} spills" if hasattr(compiled, "n_regs") else "interpreted"


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30)).item()


def check(device: str) -> int:
    """Every variant against the float64 reference on CHECK_SHAPES, fp32 and fp16, causal and not."""
    failures = 0
    for batch, heads, n_queries, n_keys, head_dim in CHECK_SHAPES:
        for dtype in (torch.float32, torch.float16):
            for is_causal in (False, True):
                torch.manual_seed(0)
                q = torch.randn(batch, heads, n_queries, head_dim, dtype=dtype, device=device)
                k, v = (torch.randn(batch, heads, n_keys, head_dim, dtype=dtype, device=device) for _ in range(2))
                do = torch.randn_like(q)
                reference = reference_attention(q, k, v, do, is_causal)
                tolerance = tolerance_for(q.device, dtype)
                for programs in (None, 3):
                    compiled: dict = {}
                    o, lse = dealt_forward(q, k, v, is_causal, Tiles(32, 16, 1, 1), programs, compiled)
                    for dq_mode in (None, "atomic"):
                        grads = dealt_backward(q, k, v, o, lse, do, is_causal, CHECK_TILES, dq_mode, programs,
                                               compiled, dq_tiles=Tiles(32, 16, 1, 1))
                        got = dict(zip(("o", "L", "dq", "dk", "dv"), (o, lse, *grads), strict=True))
                        found = discrepancies(got, reference, tolerance, dtype)
                        label = (f"{batch}x{heads}x{n_queries}x{n_keys} d {head_dim} {dtype} causal={is_causal} "
                                 f"programs={programs} dq={dq_mode or 'two-pass'}")
                        print(f"{'FAIL' if found else 'ok'}  {label}", *found, sep="\n    " if found else "")
                        failures += bool(found)
    return 1 if failures else 0


def _time(run, rep_ms: int) -> float:
    return triton.testing.do_bench(run, warmup=25, rep=rep_ms, return_mode="median")


def measure(shape, is_causal: bool, dtype, rep_ms: int) -> list[dict]:
    """Every variant at one shape, checked against the kept kernels and then timed; one row each."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(shape, generator=generator, device="cuda", dtype=dtype) for _ in range(4))
    plan = plan_for(q, k, is_causal)
    if plan.forward.split_keys is not None:
        raise SystemExit(f"{shape} takes the split forward: try a grid that fills the GPU")
    o, lse = ft.launch_forward(q, k, v, is_causal, plan.forward.tiles)
    dq, delta = ft.launch_dq(q, k, v, o, do, lse, is_causal, plan.dq)
    dk, dv = ft.launch_dkdv(q, k, v, do, lse, delta, is_causal, plan.dkdv)
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    rows = []

    def row(kernel: str, variant: str, run, outputs, want, compiled=None) -> None:
        error = max(_relative_error(got, w) for got, w in zip(outputs, want, strict=True)) if want else 0.0
        agrees = error <= AGREEMENT[dtype]
        ms = _time(run, rep_ms) if agrees else None
        rows.append({"kernel": kernel, "variant": variant, "ms": ms, "error": error,
                     "compiled": describe(compiled) if compiled is not None else ""})
        timing = f"{ms:.3f} ms" if agrees else f"NOT TIMED: differs from the kept kernels by {error:.2e}"
        print(f"  {kernel:9s} {variant:44s} {timing}  (error {error:.1e}) {rows[-1]['compiled']}", flush=True)

    kept = (f"kept, pointers {plan.forward.tiles.block_m}x{plan.forward.tiles.block_n} "
            f"w{plan.forward.tiles.num_warps} s{plan.forward.tiles.num_stages}")
    row("forward", kept, lambda: ft.launch_forward(q, k, v, is_causal, plan.forward.tiles), (), ())
    for programs in (None, *(per_sm * sms for per_sm in PROGRAMS_PER_SM)):
        compiled: dict = {}
        got = dealt_forward(q, k, v, is_causal, plan.forward.tiles, programs, compiled)
        name = "a program per tile (control)" if programs is None else f"persistent, {programs} programs"
        row("forward", name, lambda p=programs: dealt_forward(q, k, v, is_causal, plan.forward.tiles, p, {}), got,
            (o, lse), compiled["forward"])

    def two_pass():
        dq_, delta_ = ft.launch_dq(q, k, v, o, do, lse, is_causal, plan.dq)
        return dq_, *ft.launch_dkdv(q, k, v, do, lse, delta_, is_causal, plan.dkdv)
    row("backward", "kept two-pass (dQ, then dK/dV)", two_pass, (), ())
    row("dQ", "kept", lambda: ft.launch_dq(q, k, v, o, do, lse, is_causal, plan.dq), (), ())
    row("dK/dV", "kept", lambda: ft.launch_dkdv(q, k, v, do, lse, delta, is_causal, plan.dkdv), (), ())
    for programs in (None, *(per_sm * sms for per_sm in PROGRAMS_PER_SM)):
        compiled = {}
        got = dealt_backward(q, k, v, o, lse, do, is_causal, plan.dkdv, None, programs, compiled, plan.dq)
        name = "a program per tile (control)" if programs is None else f"persistent, {programs} programs"
        row("backward", f"two-pass, dK/dV {name}",
            lambda p=programs: dealt_backward(q, k, v, o, lse, do, is_causal, plan.dkdv, None, p, {}, plan.dq), got,
            (dq, dk, dv), compiled["dkdv"])
    modes = ("atomic", "tma") if torch.cuda.get_device_capability(q.device) >= (9, 0) else ("atomic",)
    for dq_mode in modes:
        for tiles in ONE_PASS_TILES:
            compiled = {}
            try:
                got = dealt_backward(q, k, v, o, lse, do, is_causal, tiles, dq_mode, None, compiled)
            except triton.runtime.errors.OutOfResources as error:  # shared memory past the SM's
                print(f"  backward  one-pass {dq_mode} {tiles}: {error}")
                continue
            name = (f"one-pass, dQ by {dq_mode}, {tiles.block_m}x{tiles.block_n} w{tiles.num_warps} "
                    f"s{tiles.num_stages}")
            row("backward", name,
                lambda t=tiles, m=dq_mode: dealt_backward(q, k, v, o, lse, do, is_causal, t, m, None, {}), got,
                (dq, dk, dv), compiled["dkdv"])

    q_, k_, v_ = (t.detach().requires_grad_() for t in (q, k, v))

    def cudnn_forward():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q_, k_, v_, is_causal=is_causal)

    def cudnn_forward_backward():
        return torch.autograd.grad(cudnn_forward(), (q_, k_, v_), do)
    row("forward", "SDPA cuDNN", cudnn_forward, (), ())
    row("fwd+bwd", "SDPA cuDNN (its backward: this less its forward)", cudnn_forward_backward, (), ())
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--seq-len", type=int, nargs="+", default=[32768])
    parser.add_argument("--precision", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--no-causal", action="store_true")
    parser.add_argument("--rep-ms", type=int, default=200)
    parser.add_argument("--check", action="store_true",
                        help="only check every variant against a float64 reference at small shapes (CPU or GPU)")
    parser.add_argument("--json", help="write every row here")
    args = parser.parse_args(argv)
    if args.check:
        return check("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        parser.error("timing needs a CUDA GPU (--check runs on a CPU, under TRITON_INTERPRET=1)")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.precision]
    header = f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}"
    print(header)
    results = {"device": header, "shapes": {}}
    for n in args.seq_len:
        shape = (args.batch, args.heads, n, args.head_dim)
        print(f"shape {shape} {args.precision} causal={not args.no_causal}", flush=True)
        results["shapes"][str(shape)] = measure(shape, not args.no_causal, dtype, args.rep_ms)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
