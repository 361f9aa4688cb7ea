"""FlashAttention-2 from scratch, as the course's handout describes it: FlashAttention2Pytorch (tiled, plain
PyTorch) and FlashAttention2Triton (the same algorithm as Triton kernels: a forward kernel, then a dK/dV pass
and a dQ pass for backward, so no program writes where another does).

Both are torch.autograd.Functions called as `Function.apply(q, k, v, is_causal=False)` on tensors of shape
(batch..., n, d) - any number of leading dims, any strides, fp32, fp16 or bf16 - and return O in the inputs'
dtype. Scores are accumulated in fp32. Causal masking is the course's: query i attends key j where j <= i,
counted from the first query and the first key even when n_queries != n_keys, and a masked score gets
MASKED_SCORE_OFFSET added. The forward saves the logsumexp L (fp32, shape (batch..., n_queries)) with q, k, v
and O; the backward recomputes P = exp(S - L) tile by tile and uses D = rowsum(dO * O).
"""

from __future__ import annotations

import contextlib
import math

import torch
import triton
import triton.language as tl

# The course's causal mask adds this to a masked score rather than -inf.
MASKED_SCORE_OFFSET = -1e6
_MASKED_SCORE_OFFSET_IN_KERNELS = tl.constexpr(MASKED_SCORE_OFFSET)
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Tiles of the PyTorch Function: the handout asks for at least 16 x 16; 64 keeps the Python loop short.
TORCH_QUERY_TILE = 64
TORCH_KEY_TILE = 64
# The Triton kernels hold a tile's q, k, v (and dk, dv) rows on chip: 64 rows of a head dim up to 64, and
# 32 rows above that, keep them in registers on an H100-class GPU; the handout's course tests d <= 128.
TRITON_MAX_HEAD_DIM = 128
TRITON_WIDE_HEAD_DIM = 64
# tl.dot needs every dimension of its operands to be at least 16.
TRITON_MIN_BLOCK = 16
# A CUDA grid's second dimension (the kernels' batch axis, batch x heads) is at most this.
CUDA_MAX_GRID_Y = 65535
# Whether Triton runs kernels in its interpreter (TRITON_INTERPRET=1 when this module was imported): then
# the kernels take CPU tensors, otherwise CUDA tensors.
TRITON_INTERPRETED = bool(triton.knobs.runtime.interpret)


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> None:
    """A ValueError naming the problem where q, k, v are not attention inputs this module computes."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.ndim < 2:
            raise ValueError(f"{name} must have shape (batch..., n, d), got {tuple(x.shape)}")
        if x.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name} has dtype {x.dtype}; supported: {', '.join(map(str, SUPPORTED_DTYPES))}")
        if x.numel() == 0:
            raise ValueError(f"{name} is empty (shape {tuple(x.shape)})")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if not (q.shape[:-2] == k.shape[:-2] == v.shape[:-2]):
        raise ValueError(f"q, k, v must share their leading (batch) dims, got shapes "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"k and v must have as many keys, got shapes {tuple(k.shape)} and {tuple(v.shape)}")
    if not (q.shape[-1] == k.shape[-1] == v.shape[-1]):
        raise ValueError(f"q, k, v must share a head dim, got shapes {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if not isinstance(is_causal, bool):
        raise ValueError(f"is_causal must be a bool, got {is_causal!r}")


def _as_batch_of_matrices(x: torch.Tensor) -> torch.Tensor:
    """x as (batch, n, d), its leading dims merged: a view where the strides allow it, a copy where not."""
    return x.reshape(-1, *x.shape[-2:])


# ----------------------------------------------------------------------------------------------- PyTorch

def _causal_offsets(query_start: int, n_rows: int, key_start: int, n_cols: int, device) -> torch.Tensor:
    """MASKED_SCORE_OFFSET where key > query in this tile, 0 elsewhere (query and key counted from 0)."""
    queries = torch.arange(query_start, query_start + n_rows, device=device)[:, None]
    keys = torch.arange(key_start, key_start + n_cols, device=device)[None, :]
    return torch.where(keys > queries, MASKED_SCORE_OFFSET, 0.0)


def _tile_scores(q_tile, k_tile, scale, is_causal, query_start, key_start) -> torch.Tensor:
    """S for one (query tile, key tile) pair in fp32, the causal offsets added."""
    scores = q_tile @ k_tile.transpose(-1, -2) * scale
    if is_causal:
        scores = scores + _causal_offsets(query_start, q_tile.shape[-2], key_start, k_tile.shape[-2], q_tile.device)
    return scores


class FlashAttention2Pytorch(torch.autograd.Function):
    """FlashAttention-2 (the handout's Algorithm 1 and its backward) in plain PyTorch: Python loops over
    query tiles and key tiles, every tile computed in fp32."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False):
        _check_inputs(q, k, v, is_causal)
        q3, k3, v3 = map(_as_batch_of_matrices, (q, k, v))
        batch, n_queries, head_dim = q3.shape
        n_keys = k3.shape[1]
        scale = 1.0 / math.sqrt(head_dim)
        out = torch.empty_like(q3, memory_format=torch.contiguous_format)
        logsumexp = torch.empty(batch, n_queries, dtype=torch.float32, device=q.device)
        for query_start in range(0, n_queries, TORCH_QUERY_TILE):
            rows = slice(query_start, query_start + TORCH_QUERY_TILE)
            q_tile = q3[:, rows].float()
            n_rows = q_tile.shape[1]
            row_max = torch.full((batch, n_rows), -math.inf, device=q.device)
            row_sum = torch.zeros(batch, n_rows, device=q.device)
            acc = torch.zeros(batch, n_rows, head_dim, device=q.device)
            for key_start in range(0, n_keys, TORCH_KEY_TILE):
                cols = slice(key_start, key_start + TORCH_KEY_TILE)
                scores = _tile_scores(q_tile, k3[:, cols].float(), scale, is_causal, query_start, key_start)
                new_max = torch.maximum(row_max, scores.amax(dim=-1))
                p = torch.exp(scores - new_max[..., None])
                rescale = torch.exp(row_max - new_max)
                row_sum = rescale * row_sum + p.sum(dim=-1)
                acc = rescale[..., None] * acc + p @ v3[:, cols].float()
                row_max = new_max
            out[:, rows] = (acc / row_sum[..., None]).to(q.dtype)
            logsumexp[:, rows] = row_max + torch.log(row_sum)
        out = out.reshape(q.shape)
        logsumexp = logsumexp.reshape(q.shape[:-1])
        ctx.save_for_backward(logsumexp, q, k, v, out)
        ctx.is_causal = is_causal
        return out

    @staticmethod
    def backward(ctx, grad_out):
        logsumexp, q, k, v, out = ctx.saved_tensors
        is_causal = ctx.is_causal
        q3, k3, v3, do3 = map(_as_batch_of_matrices, (q, k, v, grad_out))
        lse = logsumexp.reshape(q3.shape[:2])
        n_queries, head_dim = q3.shape[1:]
        n_keys = k3.shape[1]
        scale = 1.0 / math.sqrt(head_dim)
        delta = (do3.float() * _as_batch_of_matrices(out).float()).sum(dim=-1)
        dq = torch.zeros(q3.shape, dtype=torch.float32, device=q.device)
        dk = torch.zeros(k3.shape, dtype=torch.float32, device=q.device)
        dv = torch.zeros(v3.shape, dtype=torch.float32, device=q.device)
        for key_start in range(0, n_keys, TORCH_KEY_TILE):
            cols = slice(key_start, key_start + TORCH_KEY_TILE)
            k_tile, v_tile = k3[:, cols].float(), v3[:, cols].float()
            for query_start in range(0, n_queries, TORCH_QUERY_TILE):
                rows = slice(query_start, query_start + TORCH_QUERY_TILE)
                q_tile, do_tile = q3[:, rows].float(), do3[:, rows].float()
                scores = _tile_scores(q_tile, k_tile, scale, is_causal, query_start, key_start)
                p = torch.exp(scores - lse[:, rows, None])
                dv[:, cols] += p.transpose(-1, -2) @ do_tile
                dp = do_tile @ v_tile.transpose(-1, -2)
                ds = p * (dp - delta[:, rows, None])
                dq[:, rows] += ds @ k_tile * scale
                dk[:, cols] += ds.transpose(-1, -2) @ q_tile * scale
        return (dq.to(q.dtype).reshape(q.shape), dk.to(k.dtype).reshape(k.shape), dv.to(v.dtype).reshape(v.shape),
                None)


# ------------------------------------------------------------------------------------------------ Triton
# Each kernel works on one (batch, n, d) matrix per program_id(1) and one tile of rows per program_id(0),
# reading every tensor through its strides. Head dims that are no power of two are padded to HEAD_DIM_PADDED
# columns (tl.arange needs a power of two) that load as zeros and are never stored; rows past the end of a
# matrix are masked the same way, and keys past the last one get -inf, so they weigh nothing.
# Every tl.dot accumulates in fp32. On a GPU it rounds fp32 operands to TF32 (Triton's default, as the course's
# kernels do: fp32's speed then comes from tensor cores); fp16 and bf16 operands are exact.

@triton.jit
def _load_tile(ptr, rows, n_rows, stride_row, cols, n_cols, stride_col):
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    return tl.load(ptr + rows[:, None] * stride_row + cols[None, :] * stride_col, mask=mask, other=0.0)


@triton.jit
def _store_tile(ptr, value, rows, n_rows, stride_row, cols, n_cols, stride_col):
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    tl.store(ptr + rows[:, None] * stride_row + cols[None, :] * stride_col, value.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _scores(q, k, query_rows, key_rows, scale, IS_CAUSAL: tl.constexpr):
    s = tl.dot(q, tl.trans(k)) * scale
    if IS_CAUSAL:
        s += tl.where(key_rows[None, :] > query_rows[:, None], _MASKED_SCORE_OFFSET_IN_KERNELS, 0.0)
    return s


@triton.jit
def _forward_kernel(
    Q, K, V, O, L,
    stride_qb, stride_qn, stride_qd,
    stride_kb, stride_kn, stride_kd,
    stride_vb, stride_vn, stride_vd,
    stride_ob, stride_on, stride_od,
    stride_lb, stride_ln,
    N_QUERIES, N_KEYS, scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr,
    Q_TILE: tl.constexpr, K_TILE: tl.constexpr, IS_CAUSAL: tl.constexpr,
):
    query_tile = tl.program_id(0)
    b = tl.program_id(1)
    query_rows = query_tile * Q_TILE + tl.arange(0, Q_TILE)
    cols = tl.arange(0, HEAD_DIM_PADDED)
    q = _load_tile(Q + b * stride_qb, query_rows, N_QUERIES, stride_qn, cols, HEAD_DIM, stride_qd)
    row_max = tl.full((Q_TILE,), float("-inf"), tl.float32)
    row_sum = tl.zeros((Q_TILE,), tl.float32)
    acc = tl.zeros((Q_TILE, HEAD_DIM_PADDED), tl.float32)
    # Under the causal mask, keys past this tile's last query are masked for all its rows: skip their tiles.
    # Every row keeps key 0, so skipping changes nothing (exp of a -1e6 offset is 0 in fp32).
    key_end = N_KEYS
    if IS_CAUSAL:
        key_end = tl.minimum((query_tile + 1) * Q_TILE, N_KEYS)
    for key_start in range(0, key_end, K_TILE):
        key_rows = key_start + tl.arange(0, K_TILE)
        k = _load_tile(K + b * stride_kb, key_rows, N_KEYS, stride_kn, cols, HEAD_DIM, stride_kd)
        v = _load_tile(V + b * stride_vb, key_rows, N_KEYS, stride_vn, cols, HEAD_DIM, stride_vd)
        s = _scores(q, k, query_rows, key_rows, scale, IS_CAUSAL)
        s = tl.where(key_rows[None, :] < N_KEYS, s, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(s, axis=1))
        p = tl.exp(s - new_max[:, None])
        rescale = tl.exp(row_max - new_max)
        row_sum = rescale * row_sum + tl.sum(p, axis=1)
        acc = tl.dot(p.to(v.dtype), v, acc=acc * rescale[:, None])
        row_max = new_max
    _store_tile(O + b * stride_ob, acc / row_sum[:, None], query_rows, N_QUERIES, stride_on, cols, HEAD_DIM,
                stride_od)
    tl.store(L + b * stride_lb + query_rows * stride_ln, row_max + tl.log(row_sum), mask=query_rows < N_QUERIES)


@triton.jit
def _backward_dk_dv_kernel(
    Q, K, V, DO, L, DELTA, DK, DV,
    stride_qb, stride_qn, stride_qd,
    stride_kb, stride_kn, stride_kd,
    stride_vb, stride_vn, stride_vd,
    stride_dob, stride_don, stride_dod,
    stride_lb, stride_ln,
    stride_deltab, stride_deltan,
    stride_dkb, stride_dkn, stride_dkd,
    stride_dvb, stride_dvn, stride_dvd,
    N_QUERIES, N_KEYS, scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr,
    Q_TILE: tl.constexpr, K_TILE: tl.constexpr, IS_CAUSAL: tl.constexpr,
):
    """One key tile's dK and dV, summed over the query tiles that see it."""
    key_tile = tl.program_id(0)
    b = tl.program_id(1)
    key_rows = key_tile * K_TILE + tl.arange(0, K_TILE)
    cols = tl.arange(0, HEAD_DIM_PADDED)
    k = _load_tile(K + b * stride_kb, key_rows, N_KEYS, stride_kn, cols, HEAD_DIM, stride_kd)
    v = _load_tile(V + b * stride_vb, key_rows, N_KEYS, stride_vn, cols, HEAD_DIM, stride_vd)
    dk = tl.zeros((K_TILE, HEAD_DIM_PADDED), tl.float32)
    dv = tl.zeros((K_TILE, HEAD_DIM_PADDED), tl.float32)
    # Under the causal mask, queries before this tile's first key see none of it: start at their tile.
    query_start = 0
    if IS_CAUSAL:
        query_start = (key_tile * K_TILE // Q_TILE) * Q_TILE
    for tile_start in range(query_start, N_QUERIES, Q_TILE):
        query_rows = tile_start + tl.arange(0, Q_TILE)
        q = _load_tile(Q + b * stride_qb, query_rows, N_QUERIES, stride_qn, cols, HEAD_DIM, stride_qd)
        do = _load_tile(DO + b * stride_dob, query_rows, N_QUERIES, stride_don, cols, HEAD_DIM, stride_dod)
        in_range = query_rows < N_QUERIES
        lse = tl.load(L + b * stride_lb + query_rows * stride_ln, mask=in_range, other=0.0)
        delta = tl.load(DELTA + b * stride_deltab + query_rows * stride_deltan, mask=in_range, other=0.0)
        s = _scores(q, k, query_rows, key_rows, scale, IS_CAUSAL)
        p = tl.where(in_range[:, None], tl.exp(s - lse[:, None]), 0.0)
        dv = tl.dot(tl.trans(p.to(do.dtype)), do, acc=dv)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dk = tl.dot(tl.trans(ds.to(q.dtype)), q, acc=dk)
    _store_tile(DK + b * stride_dkb, dk * scale, key_rows, N_KEYS, stride_dkn, cols, HEAD_DIM, stride_dkd)
    _store_tile(DV + b * stride_dvb, dv, key_rows, N_KEYS, stride_dvn, cols, HEAD_DIM, stride_dvd)


@triton.jit
def _backward_dq_kernel(
    Q, K, V, DO, L, DELTA, DQ,
    stride_qb, stride_qn, stride_qd,
    stride_kb, stride_kn, stride_kd,
    stride_vb, stride_vn, stride_vd,
    stride_dob, stride_don, stride_dod,
    stride_lb, stride_ln,
    stride_deltab, stride_deltan,
    stride_dqb, stride_dqn, stride_dqd,
    N_QUERIES, N_KEYS, scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr,
    Q_TILE: tl.constexpr, K_TILE: tl.constexpr, IS_CAUSAL: tl.constexpr,
):
    """One query tile's dQ, summed over the key tiles it sees."""
    query_tile = tl.program_id(0)
    b = tl.program_id(1)
    query_rows = query_tile * Q_TILE + tl.arange(0, Q_TILE)
    cols = tl.arange(0, HEAD_DIM_PADDED)
    q = _load_tile(Q + b * stride_qb, query_rows, N_QUERIES, stride_qn, cols, HEAD_DIM, stride_qd)
    do = _load_tile(DO + b * stride_dob, query_rows, N_QUERIES, stride_don, cols, HEAD_DIM, stride_dod)
    in_range = query_rows < N_QUERIES
    lse = tl.load(L + b * stride_lb + query_rows * stride_ln, mask=in_range, other=0.0)
    delta = tl.load(DELTA + b * stride_deltab + query_rows * stride_deltan, mask=in_range, other=0.0)
    dq = tl.zeros((Q_TILE, HEAD_DIM_PADDED), tl.float32)
    key_end = N_KEYS
    if IS_CAUSAL:
        key_end = tl.minimum((query_tile + 1) * Q_TILE, N_KEYS)
    for key_start in range(0, key_end, K_TILE):
        key_rows = key_start + tl.arange(0, K_TILE)
        k = _load_tile(K + b * stride_kb, key_rows, N_KEYS, stride_kn, cols, HEAD_DIM, stride_kd)
        v = _load_tile(V + b * stride_vb, key_rows, N_KEYS, stride_vn, cols, HEAD_DIM, stride_vd)
        s = _scores(q, k, query_rows, key_rows, scale, IS_CAUSAL)
        p = tl.where(key_rows[None, :] < N_KEYS, tl.exp(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, acc=dq)
    _store_tile(DQ + b * stride_dqb, dq * scale, query_rows, N_QUERIES, stride_dqn, cols, HEAD_DIM, stride_dqd)


def _triton_tiles(head_dim: int) -> tuple[int, int, int]:
    """(padded head dim, query tile rows, key tile rows) for the kernels: see TRITON_WIDE_HEAD_DIM."""
    head_dim_padded = max(TRITON_MIN_BLOCK, triton.next_power_of_2(head_dim))
    tile = 64 if head_dim_padded <= TRITON_WIDE_HEAD_DIM else 32
    return head_dim_padded, tile, tile


def _check_triton_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> None:
    _check_inputs(q, k, v, is_causal)
    if q.shape[-1] > TRITON_MAX_HEAD_DIM:
        raise ValueError(f"head dim {q.shape[-1]} is above the {TRITON_MAX_HEAD_DIM} the Triton kernels' tiles "
                         f"are sized for")
    if q.device.type == "cpu" and not TRITON_INTERPRETED:
        raise ValueError("the Triton kernels got CPU tensors: they need CUDA tensors, or TRITON_INTERPRET=1 "
                         "set before this module is imported to run in Triton's interpreter")
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"the Triton kernels run on CUDA devices (or on the CPU interpreted), got {q.device}")
    batch = q.numel() // (q.shape[-2] * q.shape[-1])
    if batch > CUDA_MAX_GRID_Y:
        raise ValueError(f"the leading dims {tuple(q.shape[:-2])} hold {batch} matrices, more than the "
                         f"{CUDA_MAX_GRID_Y} a launch grid's batch axis takes")


def _on_device(device: torch.device):
    """Launch on the inputs' GPU, whichever is current."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


class FlashAttention2Triton(torch.autograd.Function):
    """FlashAttention-2 whose forward and backward are the Triton kernels above."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False):
        _check_triton_inputs(q, k, v, is_causal)
        q3, k3, v3 = map(_as_batch_of_matrices, (q, k, v))
        batch, n_queries, head_dim = q3.shape
        n_keys = k3.shape[1]
        head_dim_padded, q_tile, k_tile = _triton_tiles(head_dim)
        out = torch.empty(q3.shape, dtype=q.dtype, device=q.device)
        logsumexp = torch.empty(batch, n_queries, dtype=torch.float32, device=q.device)
        with _on_device(q.device):
            _forward_kernel[(triton.cdiv(n_queries, q_tile), batch)](
                q3, k3, v3, out, logsumexp,
                *q3.stride(), *k3.stride(), *v3.stride(), *out.stride(), *logsumexp.stride(),
                n_queries, n_keys, 1.0 / math.sqrt(head_dim),
                HEAD_DIM=head_dim, HEAD_DIM_PADDED=head_dim_padded, Q_TILE=q_tile, K_TILE=k_tile,
                IS_CAUSAL=is_causal,
            )
        out = out.reshape(q.shape)
        logsumexp = logsumexp.reshape(q.shape[:-1])
        ctx.save_for_backward(logsumexp, q, k, v, out)
        ctx.is_causal = is_causal
        return out

    @staticmethod
    def backward(ctx, grad_out):
        logsumexp, q, k, v, out = ctx.saved_tensors
        q3, k3, v3, do3 = map(_as_batch_of_matrices, (q, k, v, grad_out))
        batch, n_queries, head_dim = q3.shape
        n_keys = k3.shape[1]
        lse = logsumexp.reshape(batch, n_queries)
        delta = (do3.float() * _as_batch_of_matrices(out).float()).sum(dim=-1)
        head_dim_padded, q_tile, k_tile = _triton_tiles(head_dim)
        dq = torch.empty(q3.shape, dtype=q.dtype, device=q.device)
        dk = torch.empty(k3.shape, dtype=k.dtype, device=q.device)
        dv = torch.empty(v3.shape, dtype=v.dtype, device=q.device)
        inputs = (q3, k3, v3, do3, lse, delta)
        input_strides = (*q3.stride(), *k3.stride(), *v3.stride(), *do3.stride(), *lse.stride(), *delta.stride())
        sizes = dict(HEAD_DIM=head_dim, HEAD_DIM_PADDED=head_dim_padded, Q_TILE=q_tile, K_TILE=k_tile,
                     IS_CAUSAL=ctx.is_causal)
        scale = 1.0 / math.sqrt(head_dim)
        with _on_device(q.device):
            _backward_dk_dv_kernel[(triton.cdiv(n_keys, k_tile), batch)](
                *inputs, dk, dv, *input_strides, *dk.stride(), *dv.stride(), n_queries, n_keys, scale, **sizes)
            _backward_dq_kernel[(triton.cdiv(n_queries, q_tile), batch)](
                *inputs, dq, *input_strides, *dq.stride(), n_queries, n_keys, scale, **sizes)
        return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape), None
