"""Launching the FlashAttention-2 kernels: inputs viewed as (batch, heads, n, d) on 16-byte boundaries,
the launch plan of each kernel (wide or narrow tiles, whole or split forward), and the launch itself.

    o, lse = forward(q, k, v, is_causal)
    dq, dk, dv = backward(q, k, v, o, lse, do, is_causal)

Leading dims are viewed as (batch, heads) and addressed by stride, so transposed heads and views out
of a fused QKV projection are read in place. A last dim with a stride other than 1, or data that does
not start on a 16-byte boundary, is copied first (as_batch_heads says why), and every launch refuses a
tensor off a 16-byte boundary: the kernels are only ever compiled for aligned ones.

A launch takes one of three routes (`_launch`):
  - plain tensors on a GPU: the compiled kernel kept for the launch's key (what Triton specialises a
    compilation on: with every tensor on a 16-byte boundary, the int arguments) is called directly.
    Triton's JIT launch binds, specialises and keys every argument on each call, most of a launch's
    host time; it runs once per key, compiling or finding the kernel, which is then kept.
  - fake and functional tensors, while torch.compile traces the torch.library op: through
    torch.library.wrap_triton, so that each kernel becomes a node of the graph that the compiler
    launches itself.
  - under TRITON_INTERPRET=1 (no GPU): the interpreted kernels on CPU tensors, with small tiles
    (INTERPRETER_TILES) so short test sequences cross tile boundaries. The interpreter computes bf16
    tl.dot wrongly, so bf16 is refused there.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
import triton
from torch._subclasses.fake_tensor import is_fake
from torch.library import wrap_triton

from cs336_systems.attention.flash_pytorch import check_inputs
from cs336_systems.attention.flash_triton.kernels import (
    LOG2E,
    dkdv_kernel,
    dq_kernel,
    forward_kernel,
    split_forward_kernel,
)
from cs336_systems.attention.flash_triton.tiles import (
    Tiles,
    cdiv,
    forward_split_keys,
    head_dim_chunks,
    kernel_tiles,
    longest_tile_keys,
    tiles_for,
)

INTERPRETED = not isinstance(forward_kernel, triton.runtime.JITFunction)
# Triton specialises a compilation on whether each pointer is a multiple of this many bytes, and
# vectorises loads to that width only where it is: the widest load (16 bytes) and cp.async's.
ALIGNMENT_BYTES = 16


@dataclass(frozen=True)
class ForwardPlan:
    """How the forward runs: on `tiles`, whole (split_keys None) or with each query tile's keys in runs
    of split_keys, a program each (the split forward)."""

    tiles: Tiles
    split_keys: int | None


@dataclass(frozen=True)
class LaunchPlan:
    """Each kernel's tiles for one input shape; `paths` names them as the tests count them."""

    forward: ForwardPlan
    dq: Tiles
    dkdv: Tiles
    narrow: dict[str, bool]  # per kernel, whether it took its narrow tiles

    @property
    def paths(self) -> dict[str, str]:
        forward = "split" if self.forward.split_keys is not None else self._width("forward")
        return {"forward": forward, "dq": self._width("dq"), "dkdv": self._width("dkdv")}

    def _width(self, kernel: str) -> str:
        return "narrow" if self.narrow[kernel] else "wide"


def launch_plan(batch_heads: int, n_queries: int, n_keys: int, head_dim: int, dtype: torch.dtype, is_causal: bool,
                device: torch.device) -> LaunchPlan:
    """The tiles each kernel takes for this shape: its narrow ones on grids too small to fill the GPU,
    where the forward also splits each query tile's keys into runs when there is more than one."""
    tile_set = tiles_for(head_dim, dtype, INTERPRETED)
    chosen = {"forward": kernel_tiles(tile_set, "forward", batch_heads, n_queries, device),
              "dq": kernel_tiles(tile_set, "dq", batch_heads, n_queries, device),
              "dkdv": kernel_tiles(tile_set, "dkdv", batch_heads, n_keys, device)}
    narrow = {kernel: tiles is not getattr(tile_set, kernel) for kernel, tiles in chosen.items()}
    split_keys = forward_split_keys(chosen["forward"], n_queries, n_keys, is_causal) if narrow["forward"] else None
    return LaunchPlan(ForwardPlan(chosen["forward"], split_keys), chosen["dq"], chosen["dkdv"], narrow)


# A plan depends on the shape alone, so calls of one shape (every layer of a training step) share it.
# Bounded, for processes that see ever new sequence lengths.
PLANS_KEPT = 1024
_kept_plan = functools.lru_cache(maxsize=PLANS_KEPT)(launch_plan)


def plan_for(q: torch.Tensor, k: torch.Tensor, is_causal: bool) -> LaunchPlan:
    """launch_plan for (..., n, d) inputs (kept per shape; worked out afresh while tracing, where sizes
    may be symbolic and cannot key a cache)."""
    plan = launch_plan if _traced(q) else _kept_plan
    return plan(math.prod(q.shape[:-2]), q.shape[-2], k.shape[-2], q.shape[-1], q.dtype, is_causal, q.device)


# ------------------------------------------------------------------------------------------- inputs

def _traced(t: torch.Tensor) -> bool:
    """Whether `t` is being traced: under torch.compile the op's body sees fake (and functional) tensors,
    which have no data and whose kernels must become graph nodes (wrap_triton). Plain tensors are
    told apart by their type alone, the cheap test that every eager call takes."""
    return type(t) is not torch.Tensor and is_fake(t)


def _starts_aligned(t: torch.Tensor) -> bool:
    """Whether t's first element sits on a 16-byte boundary. Traced tensors have no address: their
    offset into storage decides (the compiler aligns the storages it allocates and copies graph inputs
    that are not)."""
    if _traced(t):
        return t.storage_offset() * t.element_size() % ALIGNMENT_BYTES == 0
    return t.data_ptr() % ALIGNMENT_BYTES == 0


def as_batch_heads(t: torch.Tensor) -> torch.Tensor:
    """(..., n, d) as a 4-D (batch, heads, n, d) view with unit stride along d, starting on a 16-byte
    boundary.

    3-D inputs get a batch of one; more than two leading dims are folded into the batch (a copy only
    when the strides do not allow a view). A strided last dim is copied: the kernels read rows of d
    contiguous elements, which is what makes their loads wide. So is a tensor that starts off a
    16-byte boundary, one element past it say: Triton then compiles the kernels for an unaligned
    pointer, whose loads are 2 or 4 bytes wide and, for 16-bit types, not pipelined at all; on an
    H100 those compilations crashed (misaligned address) with fp32 causal inputs at d 32 and 64. The
    copy is one pass over the input, against the kernels' N^2 work; allocations start aligned.
    """
    if t.stride(-1) != 1 or not _starts_aligned(t):
        t = t.clone(memory_format=torch.contiguous_format)
    if t.dim() == 4:
        return t
    if t.dim() == 2:
        return t[None, None]
    if t.dim() == 3:
        return t[None]
    return t.reshape(-1, *t.shape[-3:])


def check_device(q: torch.Tensor) -> None:
    """Refuse inputs the compiled kernels (or the interpreter) cannot run, naming why."""
    if INTERPRETED:
        if q.dtype == torch.bfloat16:
            raise TypeError("bf16 is not supported under TRITON_INTERPRET=1: the Triton interpreter computes "
                            "bf16 tl.dot wrongly; use fp32 or fp16 on CPU, or run on a GPU")
        return
    if not q.is_cuda:
        raise ValueError(f"FlashAttentionTriton needs CUDA tensors, got {q.device}; on a machine without a "
                         "GPU set TRITON_INTERPRET=1 before this module is imported")


def _on_device(t: torch.Tensor):
    """Triton launches on the current CUDA device: make it t's for the launch (traced launches are the
    compiler's to place)."""
    if INTERPRETED or _traced(t) or t.device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(t.device)


def _scales(head_dim: int) -> tuple[float, float]:
    """(scale of q k^T in base-2 score units, softmax scale 1/sqrt(d))."""
    return LOG2E / math.sqrt(head_dim), 1.0 / math.sqrt(head_dim)


def _strides(*tensors: torch.Tensor) -> tuple[int, ...]:
    """Batch, head and row strides of 4-D tensors, in order."""
    return sum((t.stride()[:3] for t in tensors), ())


def _head_dim(t4: torch.Tensor) -> int:
    """The head dim, a compile-time constant of the kernels: traced with symbolic sizes, it is specialised on."""
    return int(t4.shape[3])


def _merge_columns(block_d: int) -> int:
    """Columns the split forward's merge takes at a time: half of them from 64 columns up (measured fastest
    at d 64 and 128 on an H100, docs/flash_tuning.md v10), else all."""
    return block_d // 2 if block_d >= 64 else block_d


# ------------------------------------------------------------------------------------------ launches

@dataclass(frozen=True, eq=False)  # one per (kernel, constants), made once by kernel_call: hashed by identity
class KernelCall:
    """A kernel with its compile-time constants and launch shape: all a launch takes besides its grid
    and the tensors, strides, sizes and scales it passes."""

    kernel: Any  # triton JITFunction (InterpretedFunction under TRITON_INTERPRET=1)
    constants: tuple[tuple[str, int | bool], ...]  # constexpr (name, value), in the kernel's argument order
    num_warps: int
    num_stages: int

    @functools.cached_property
    def options(self) -> dict[str, Any]:
        """The keyword arguments of a launch through Triton's JIT (or wrap_triton)."""
        return dict(self.constants, num_warps=self.num_warps, num_stages=self.num_stages)

    @functools.cached_property
    def constant_values(self) -> tuple[int | bool, ...]:
        """The constants as a compiled kernel takes them: after the other arguments, in order."""
        return tuple(value for _, value in self.constants)


# By name: a JITFunction's hash takes a lock, microseconds on every cache lookup keyed on it.
KERNELS = {"forward": forward_kernel, "split_forward": split_forward_kernel, "dq": dq_kernel, "dkdv": dkdv_kernel}


@functools.cache
def kernel_call(kernel: str, head_dim: int, is_causal: bool, tiles: Tiles, **extra: int) -> KernelCall:
    """The KernelCall of KERNELS[kernel] on `tiles` for a head dim and causality; `extra` are the kernel's
    own constants (the split forward's RUNS and MERGE_COLUMNS)."""
    jit = KERNELS[kernel]
    block_d, tail_d = head_dim_chunks(head_dim)
    constants = dict(IS_CAUSAL=is_causal, HEAD_DIM=head_dim, BLOCK_D=block_d, TAIL_D=tail_d, BLOCK_M=tiles.block_m,
                     BLOCK_N=tiles.block_n, **extra)
    ordered = tuple((name, constants.pop(name)) for name in jit.arg_names if name in constants)
    if constants:
        raise TypeError(f"the {kernel} kernel takes no constants {sorted(constants)}")
    return KernelCall(jit, ordered, tiles.num_warps, tiles.num_stages)


# Compiled kernels kept per launch key (launch_key). Bounded: keys hold sizes, and a process that sees
# ever new sequence lengths would otherwise grow it without end; a key that is not kept costs one
# Triton JIT launch, which finds the compiled kernel in Triton's own cache.
LAUNCHES_KEPT = 4096
_kept_kernels: dict[tuple, Any] = {}


def launch_key(call: KernelCall, tensors: tuple[torch.Tensor, ...], scalars: tuple) -> tuple:
    """What a compiled kernel is specific to, for tensors that start on 16-byte boundaries (_launch
    requires it): the call, the device, each tensor's dtype (the element type of its pointer), and each
    int argument's value, of which Triton specialises on divisibility by 16, equality to 1 and width.
    Floats are not specialised on."""
    return call, tensors[0].device.index, tuple(t.dtype for t in tensors), scalars


def check_aligned(tensors: tuple[torch.Tensor, ...]) -> None:
    """Refuse a tensor that starts off a 16-byte boundary: as_batch_heads copies inputs that do, and the
    kernels' outputs and workspaces come from the allocator, so one that reaches a launch is a bug."""
    for t in tensors:
        if t.data_ptr() % ALIGNMENT_BYTES:
            raise ValueError(f"a {tuple(t.shape)} kernel argument starts at {t.data_ptr():#x}, off a "
                             f"{ALIGNMENT_BYTES}-byte boundary; as_batch_heads copies such inputs")


def _launch(call: KernelCall, grid: tuple[int, int, int], tensors: tuple[torch.Tensor, ...], scalars: tuple) -> None:
    """Launch `call` on a three-dim `grid` (a compiled kernel takes no other) with its arguments, the
    tensors then the scalars (strides, sizes, scales) in order, by the route the module docstring
    describes."""
    if _traced(tensors[0]):
        wrap_triton(call.kernel)[grid](*tensors, *scalars, **call.options)
        return
    check_aligned(tensors)
    if INTERPRETED:
        call.kernel[grid](*tensors, *scalars, **call.options)
        return
    key = launch_key(call, tensors, scalars)
    compiled = _kept_kernels.get(key)
    if compiled is None:
        # Triton's JIT launch, which compiles if need be and returns the compiled kernel.
        compiled = call.kernel[grid](*tensors, *scalars, **call.options)
        if len(_kept_kernels) >= LAUNCHES_KEPT:
            _kept_kernels.clear()
        _kept_kernels[key] = compiled
    else:
        compiled[grid](*tensors, *scalars, *call.constant_values)


def launch_forward(q4, k4, v4, is_causal: bool, tiles: Tiles) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole forward on (batch, heads, n, d) views: (o4 contiguous, L (batch, heads, n_queries) fp32)."""
    batch, heads, n_queries, _ = q4.shape
    head_dim = _head_dim(q4)
    o4 = q4.new_empty(q4.shape)
    lse = q4.new_empty((batch, heads, n_queries), dtype=torch.float32)
    grid = (batch * heads * cdiv(n_queries, tiles.block_m), 1, 1)
    _launch(kernel_call("forward", head_dim, is_causal, tiles), grid, (q4, k4, v4, o4, lse),
            (*_strides(q4, k4, v4, o4), heads, n_queries, k4.shape[2], _scales(head_dim)[0]))
    return o4, lse


def launch_split_forward(q4, k4, v4, is_causal: bool, tiles: Tiles,
                         split_keys: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The split forward, each query tile's keys in runs of `split_keys` (a multiple of tiles.block_m):
    returns like launch_forward."""
    batch, heads, n_queries, _ = q4.shape
    head_dim = _head_dim(q4)
    n_keys = k4.shape[2]
    if split_keys <= 0 or split_keys % tiles.block_m:
        raise ValueError(f"split_keys {split_keys} must be a positive multiple of the query tile, {tiles.block_m}")
    tiles_runs = (batch * heads * cdiv(n_queries, tiles.block_m),
                  cdiv(longest_tile_keys(tiles.block_m, n_queries, n_keys, is_causal), split_keys))
    block_d, tail_d = head_dim_chunks(head_dim)
    o4 = q4.new_empty(q4.shape)
    lse = q4.new_empty((batch, heads, n_queries), dtype=torch.float32)
    # Per (tile, run): a tile of normalised outputs (chunk and tail columns) and its lse; per tile, a count of
    # the runs done.
    slots = tiles_runs[0] * tiles_runs[1]
    partial = q4.new_empty(slots * tiles.block_m * (block_d + tail_d + 1), dtype=torch.float32)
    arrivals = torch.zeros(tiles_runs[0], dtype=torch.int32, device=q4.device)
    call = kernel_call("split_forward", head_dim, is_causal, tiles, RUNS=int(tiles_runs[1]),
                       MERGE_COLUMNS=_merge_columns(block_d))
    _launch(call, (*tiles_runs, 1), (q4, k4, v4, o4, lse, partial, arrivals),
            (*_strides(q4, k4, v4, o4), heads, n_queries, n_keys, split_keys, _scales(head_dim)[0]))
    return o4, lse


def launch_dq(q4, k4, v4, o4, do4, lse, is_causal: bool, tiles: Tiles) -> tuple[torch.Tensor, torch.Tensor]:
    """The dQ kernel: (dq4 contiguous, D = rowsum(dO * O) (batch, heads, n_queries) fp32)."""
    batch, heads, n_queries, _ = q4.shape
    head_dim = _head_dim(q4)
    dq4 = q4.new_empty(q4.shape)
    delta = q4.new_empty((batch, heads, n_queries), dtype=torch.float32)
    grid = (batch * heads * cdiv(n_queries, tiles.block_m), 1, 1)
    _launch(kernel_call("dq", head_dim, is_causal, tiles), grid, (q4, k4, v4, o4, do4, lse, delta, dq4),
            (*_strides(q4, k4, v4, o4, do4, dq4), heads, n_queries, k4.shape[2], *_scales(head_dim)))
    return dq4, delta


def launch_dkdv(q4, k4, v4, do4, lse, delta, is_causal: bool, tiles: Tiles) -> tuple[torch.Tensor, torch.Tensor]:
    """The dK/dV kernel: (dk4, dv4), contiguous; lse and delta are (batch, heads, n_queries) fp32, contiguous."""
    batch, heads, n_queries, _ = q4.shape
    head_dim = _head_dim(q4)
    n_keys = k4.shape[2]
    dk4, dv4 = k4.new_empty(k4.shape), v4.new_empty(v4.shape)
    grid = (batch * heads * cdiv(n_keys, tiles.block_n), 1, 1)
    _launch(kernel_call("dkdv", head_dim, is_causal, tiles), grid, (q4, k4, v4, do4, lse, delta, dk4, dv4),
            (*_strides(q4, k4, v4, do4, dk4, dv4), heads, n_queries, n_keys, *_scales(head_dim)))
    return dk4, dv4


# ------------------------------------------------------------------------------- forward, backward

def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, L): o shaped like q (contiguous), L (..., n_queries) fp32. Raises naming the problem on inputs
    that break the contract (flash_pytorch.check_inputs)."""
    check_inputs(q, k, v, is_causal)
    check_device(q)
    q4, k4, v4 = as_batch_heads(q), as_batch_heads(k), as_batch_heads(v)
    plan = plan_for(q, k, is_causal).forward
    with _on_device(q):
        if plan.split_keys is None:
            o4, lse = launch_forward(q4, k4, v4, is_causal, plan.tiles)
        else:
            o4, lse = launch_split_forward(q4, k4, v4, is_causal, plan.tiles, plan.split_keys)
    if q.dim() == 4:  # each view or reshape costs microseconds of host time: none where the shapes match
        return o4, lse
    return o4.view(q.shape), lse.view(q.shape[:-1])


def backward(q, k, v, o, lse, do, is_causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv (shapes and dtypes of q, k, v, contiguous): dQ over query tiles (writing D on the way),
    then dK/dV over key tiles."""
    q4, k4, v4, o4, do4 = (as_batch_heads(t) for t in (q, k, v, o, do))
    lse4 = lse if lse.shape == q4.shape[:3] else lse.reshape(q4.shape[:3])
    if not (lse4.is_contiguous() and _starts_aligned(lse4)):  # the kernels index L by row; L as saved is so
        lse4 = lse4.clone(memory_format=torch.contiguous_format)
    plan = plan_for(q, k, is_causal)
    with _on_device(q):
        dq4, delta = launch_dq(q4, k4, v4, o4, do4, lse4, is_causal, plan.dq)
        dk4, dv4 = launch_dkdv(q4, k4, v4, do4, lse4, delta, is_causal, plan.dkdv)
    if q.dim() == 4:
        return dq4, dk4, dv4
    return dq4.view(q.shape), dk4.view(k.shape), dv4.view(v.shape)
