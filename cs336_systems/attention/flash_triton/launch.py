"""Launching the FlashAttention-2 kernels: inputs viewed as (batch, heads, n, d) on 16-byte boundaries,
the launch plan of each kernel (wide or narrow tiles, whole or split forward), and the launch itself.

    o, lse = forward(q, k, v, is_causal)
    dq, dk, dv = backward(q, k, v, o, lse, do, is_causal)

An eager call on a GPU whose signature (shapes, strides, dtypes, devices, causality) ran before skips
its checks, views, plan and launch arguments: it launches what that call kept, from C++ where the
extension in native.py is built (one call from Python to the driver), else from Python (KeptForward,
KeptBackward).

Leading dims are viewed as (batch, heads) and addressed by stride, so transposed heads and views out
of a fused QKV projection are read in place. A last dim with a stride other than 1, or data that does
not start on a 16-byte boundary, is copied first (as_batch_heads says why), and every launch refuses a
tensor off a 16-byte boundary: the kernels are only ever compiled for aligned ones.

Where a kernel takes its wide tiles and its tile set has TMA tiles, it streams its loop's tiles through
tensor descriptors over those views (`_streamed`), provided every stride is a multiple of 16 bytes (what
TMA needs) and the GPU has TMA (Hopper on); pointer loads serve every other case, and every traced call.

A launch takes one of three routes (`_launch`):
  - plain tensors on a GPU: the compiled kernel kept for the launch's key (what Triton specialises a
    compilation on: with every tensor on a 16-byte boundary, the int arguments) is called directly,
    with the tensors' addresses (KeptLaunch). Triton's JIT launch binds, specialises and keys every
    argument on each call, most of a launch's host time; it runs once per key, compiling or finding
    the kernel, which is then kept.
  - fake and functional tensors, while torch.compile traces the torch.library op: through
    torch.library.wrap_triton, so that each kernel becomes a node of the graph that the compiler
    launches itself.
  - under TRITON_INTERPRET=1 (no GPU): the interpreted kernels on CPU tensors, with small tiles
    (INTERPRETER_TILES) so short test sequences cross tile boundaries. The interpreter computes bf16
    tl.dot wrongly, so bf16 is refused there.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
import triton
from torch._subclasses.fake_tensor import is_fake
from torch.library import wrap_triton
from triton import knobs
from triton.tools.tensor_descriptor import TensorDescriptor

from cs336_systems.attention.flash_pytorch import check_inputs
from cs336_systems.attention.flash_triton import native
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
    head_group,
    kernel_tiles,
    longest_tile_keys,
    tiles_for,
    tma_tiles,
)

INTERPRETED = not isinstance(forward_kernel, triton.runtime.JITFunction)
# Triton specialises a compilation on whether each pointer is a multiple of this many bytes, and
# vectorises loads to that width only where it is: the widest load (16 bytes) and cp.async's. It is also
# what a tensor descriptor needs of its base and of each stride but the last.
ALIGNMENT_BYTES = 16
# The first compute capability with the Tensor Memory Accelerator (Hopper).
TMA_CAPABILITY = 9


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
    tma: dict[str, Tiles | None]  # per kernel, its tiles with descriptor loads (None: pointer loads only)

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
    tma = {kernel: tma_tiles(tile_set, kernel, tiles) if _has_tma(device) else None
           for kernel, tiles in chosen.items()}
    return LaunchPlan(ForwardPlan(chosen["forward"], split_keys), chosen["dq"], chosen["dkdv"], narrow, tma)


def _has_tma(device: torch.device) -> bool:
    """Whether kernels on `device` can load through tensor descriptors: a GPU from Hopper on, or the
    interpreter (which runs them on CPU tensors)."""
    if INTERPRETED:
        return True
    return device.type == "cuda" and torch.cuda.is_available() and _capability(device.index or 0) >= TMA_CAPABILITY


@functools.cache
def _capability(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


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


def empty_output(t: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor shaped like the input t and laid out as forward lays out o for q (and backward
    each gradient for its input): as the kernels' view of t, dense."""
    return torch.empty_like(as_batch_heads(t)).view(t.shape)


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


@functools.cache
def _driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _driver_call(name: str, *arguments) -> None:
    result = getattr(_driver(), name)(*arguments)
    if result:
        error = ctypes.c_char_p()
        _driver().cuGetErrorName(result, ctypes.byref(error))
        raise RuntimeError(f"{name} failed: {(error.value or b'unknown').decode()} (CUDA driver error {result})")


def context_current() -> bool:
    """Whether this thread has a current CUDA context. The runtime makes one current only when a thread
    first does CUDA work, so a thread that has done none (autograd's backward thread, a caller's own) has
    none, though torch reports a current device there."""
    context = ctypes.c_void_p()
    _driver_call("cuCtxGetCurrent", ctypes.byref(context))
    return context.value is not None


def _bind_context(device_index: int) -> None:
    """Make the device's primary context (the one torch and Triton's kernels use) current on this thread
    where none is: Triton encodes a launch's tensor maps before its launcher binds a context, and the
    driver refuses to encode them without one."""
    if context_current():
        return
    device, context = ctypes.c_int(), ctypes.c_void_p()
    _driver_call("cuDeviceGet", ctypes.byref(device), device_index)
    _driver_call("cuDevicePrimaryCtxRetain", ctypes.byref(context), device)
    _driver_call("cuCtxSetCurrent", context)


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
    def no_descriptors(self) -> tuple[None, ...]:
        """What the kernel's descriptor arguments take where it loads through pointers: None each."""
        return (None,) * sum(name in DESCRIPTOR_ARGS for name in self.kernel.arg_names)

    @functools.cached_property
    def constant_values(self) -> tuple[int | bool, ...]:
        """The constants as a compiled kernel takes them: after the other arguments, in order."""
        return tuple(value for _, value in self.constants)


# By name: a JITFunction's hash takes a lock, microseconds on every cache lookup keyed on it.
KERNELS = {"forward": forward_kernel, "split_forward": split_forward_kernel, "dq": dq_kernel, "dkdv": dkdv_kernel}
# The kernels' tensor-descriptor arguments, after their scalars: the forward's and dQ's K and V, dK/dV's Q
# and dO, each as its chunk's and its tail's.
DESCRIPTOR_ARGS = ("KD", "KT", "VD", "VT", "QD", "QT", "DOD", "DOT")


@functools.cache
def kernel_call(kernel: str, head_dim: int, is_causal: bool, tiles: Tiles, **extra: int | bool) -> KernelCall:
    """The KernelCall of KERNELS[kernel] on `tiles` for a head dim and causality; `extra` are the kernel's
    own constants (DESCRIPTORS, or the split forward's RUNS and MERGE_COLUMNS)."""
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


@dataclass(frozen=True)
class Described:
    """A tensor descriptor as a kept launch makes it again for each call: over the call's address at
    `position` (in the launch's address list) plus `offset_bytes`, with the first call's shape, strides
    (in elements) and block."""

    position: int
    offset_bytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    block: tuple[int, ...]

    def at(self, addresses: tuple[int, ...]) -> TensorDescriptor:
        return TensorDescriptor(_Address(addresses[self.position] + self.offset_bytes, self.dtype), list(self.shape),
                                list(self.strides), list(self.block))


@dataclass(frozen=True)
class _Address:
    """What a TensorDescriptor reads of its base (its address and element type), for an address alone."""

    address: int
    dtype: torch.dtype

    def data_ptr(self) -> int:
        return self.address


def _describable(*tensors: torch.Tensor) -> bool:
    """Whether descriptors can stream these (batch, heads, n, d) views: eager tensors, none empty, every
    stride but the last (which is 1) a multiple of 16 bytes. Their starts are aligned (as_batch_heads)."""
    return all(not _traced(t) and t.numel() > 0 and t.stride(3) == 1
               and not any(stride * t.element_size() % ALIGNMENT_BYTES for stride in t.stride()[:3])
               for t in tensors)


def _streamed(tiles: Tiles, tma: Tiles | None, placed: tuple[tuple[int, torch.Tensor], ...], rows: str,
              head_dim: int) -> tuple[Tiles, tuple[Described, ...] | None]:
    """(tiles, descriptors) of a launch: the `tma` tiles and the descriptors of the views in `placed` (as
    _described, `rows` naming the tile dim a block spans), where `tma` is given and every view allows; else
    `tiles` and None (pointer loads)."""
    if tma is None or not _describable(*(t for _, t in placed)):
        return tiles, None
    return tma, _described(placed, getattr(tma, rows), head_dim)


def _described(placed: tuple[tuple[int, torch.Tensor], ...], rows: int, head_dim: int) -> tuple[Described, ...]:
    """For each (position, view) in `placed`, the descriptors of its chunk's and its tail's columns (the
    chunk's twice without a tail), `rows` rows a block."""
    block_d, tail_d = head_dim_chunks(head_dim)
    found = []
    for position, t in placed:
        shape, strides = tuple(t.shape), tuple(t.stride())
        chunk = Described(position, 0, t.dtype, shape, strides, (1, 1, rows, block_d))
        tail = chunk if tail_d == 0 else Described(position, block_d * t.element_size(), t.dtype,
                                                   (*shape[:3], head_dim - block_d), strides, (1, 1, rows, tail_d))
        found += [chunk, tail]
    return tuple(found)


@dataclass(frozen=True, eq=False)
class KeptLaunch:
    """A compiled kernel with its grid and every argument after its pointers (ints and floats, its
    descriptors, then the constants): a launch that takes only its tensors' addresses, in the kernel's order.

    Addresses go to Triton's launcher as ints. Given a tensor it asks the driver whether each pointer is
    a device one (cuPointerGetAttribute), a driver call per pointer per launch; what reaches a launch here
    was checked before (check_device, one device for all, 16-byte boundaries), and the allocator made the
    rest on that device. Descriptors are made again over each call's addresses."""

    compiled: Any  # the CompiledKernel Triton's JIT launch returned
    grid: tuple[int, int, int]
    scalars: tuple
    descriptors: tuple[Described | None, ...]  # None each where the kernel loads through pointers
    constants: tuple
    device_index: int

    @functools.cached_property
    def described(self) -> bool:
        return any(d is not None for d in self.descriptors)

    def __call__(self, *addresses: int) -> None:
        descriptors = self.descriptors
        if self.described:
            _bind_context(self.device_index)
            descriptors = tuple(d.at(addresses) for d in self.descriptors)
        self.compiled[self.grid](*addresses, *self.scalars, *descriptors, *self.constants)


def _launch(call: KernelCall, grid: tuple[int, int, int], tensors: tuple[torch.Tensor, ...], scalars: tuple,
            kept: list[KeptLaunch] | None = None, described: tuple[Described, ...] | None = None) -> None:
    """Launch `call` on a three-dim `grid` (a compiled kernel takes no other) with its arguments, the
    tensors then the scalars (strides, sizes, scales) and the descriptors (`described` over `tensors`, or
    None each) in order, by the route the module docstring describes. A compiled kernel's launch is
    appended to `kept`, where given."""
    if _traced(tensors[0]):
        wrap_triton(call.kernel)[grid](*tensors, *scalars, *call.no_descriptors, **call.options)
        return
    check_aligned(tensors)
    descriptors = call.no_descriptors if described is None else described
    if INTERPRETED:
        call.kernel[grid](*tensors, *scalars, *_descriptor_arguments(descriptors, tensors), **call.options)
        return
    key = launch_key(call, tensors, scalars)
    compiled = _kept_kernels.get(key)
    launched = compiled is None
    if launched:
        if described is not None:
            _bind_context(tensors[0].device.index)
        # Triton's JIT launch, which compiles if need be and returns the compiled kernel.
        compiled = call.kernel[grid](*tensors, *scalars, *_descriptor_arguments(descriptors, tensors), **call.options)
        if len(_kept_kernels) >= LAUNCHES_KEPT:
            _kept_kernels.clear()
        _kept_kernels[key] = compiled
    launch = KeptLaunch(compiled, grid, scalars, descriptors, call.constant_values, tensors[0].device.index)
    if not launched:
        launch(*(t.data_ptr() for t in tensors))
    if kept is not None:
        kept.append(launch)


def _descriptor_arguments(descriptors: tuple[Described | None, ...],
                          tensors: tuple[torch.Tensor, ...]) -> tuple[TensorDescriptor | None, ...]:
    """A launch's descriptor arguments as Triton's JIT takes them: over the tensors themselves (whose
    element type and device it reads), or None each."""
    found = []
    for d in descriptors:
        if d is None:
            found.append(None)
            continue
        base = tensors[d.position]
        if d.offset_bytes:
            base = base[..., d.offset_bytes // base.element_size():]
        found.append(TensorDescriptor(base, list(d.shape), list(d.strides), list(d.block)))
    return tuple(found)


def launch_forward(q4, k4, v4, is_causal: bool, tiles: Tiles, kept: list[KeptLaunch] | None = None,
                   tma: Tiles | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole forward on (batch, heads, n, d) views: (o4 laid out as q4, L (batch, heads, n_queries) fp32).
    Each launch_* function appends its compiled launch to `kept`, where given (_launch), and streams its
    loop's tiles through descriptors on the `tma` tiles, where given and the views allow."""
    batch, heads, n_queries, _ = q4.shape
    head_dim = _head_dim(q4)
    tiles, described = _streamed(tiles, tma, ((1, k4), (2, v4)), "block_n", head_dim)
    o4 = torch.empty_like(q4)
    lse = q4.new_empty((batch, heads, n_queries), dtype=torch.float32)
    n_tiles = cdiv(n_queries, tiles.block_m)
    group = head_group(batch * heads, n_tiles, q4.device)
    _launch(kernel_call("forward", head_dim, is_causal, tiles, DESCRIPTORS=described is not None),
            (batch * heads * n_tiles, 1, 1), (q4, k4, v4, o4, lse),
            (*_strides(q4, k4, v4, o4), heads, group, n_queries, k4.shape[2], _scales(head_dim)[0]), kept, described)
    return o4, lse


def launch_split_forward(q4, k4, v4, is_causal: bool, tiles: Tiles, split_keys: int,
                         kept: list[KeptLaunch] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The split forward, each query tile's keys in runs of `split_keys` (a multiple of tiles.block_m):
    returns like launch_forward."""
    batch, heads, n_queries, _ = q4.shape
    head_dim = _head_dim(q4)
    n_keys = k4.shape[2]
    if split_keys <= 0 or split_keys % tiles.block_m:
        raise ValueError(f"split_keys {split_keys} must be a positive multiple of the query tile, {tiles.block_m}")
    n_tiles = cdiv(n_queries, tiles.block_m)
    tiles_runs = (batch * heads * n_tiles,
                  cdiv(longest_tile_keys(tiles.block_m, n_queries, n_keys, is_causal), split_keys))
    block_d, tail_d = head_dim_chunks(head_dim)
    o4 = torch.empty_like(q4)
    lse = q4.new_empty((batch, heads, n_queries), dtype=torch.float32)
    partial, arrivals = _split_workspaces(q4, *_split_workspace_sizes(tiles_runs, tiles.block_m, head_dim))
    call = kernel_call("split_forward", head_dim, is_causal, tiles, RUNS=int(tiles_runs[1]),
                       MERGE_COLUMNS=_merge_columns(block_d))
    _launch(call, (*tiles_runs, 1), (q4, k4, v4, o4, lse, partial, arrivals),
            (*_strides(q4, k4, v4, o4), heads, head_group(batch * heads, n_tiles, q4.device),
             n_queries, n_keys, split_keys, _scales(head_dim)[0]), kept)
    return o4, lse


def _split_workspace_sizes(tiles_runs: tuple[int, int], block_m: int, head_dim: int) -> tuple[int, int]:
    """Elements of the split forward's workspaces: per (query tile, run), a tile of normalised outputs
    (chunk and tail columns) and its lse, fp32; per query tile, an int32 count of the runs done."""
    return tiles_runs[0] * tiles_runs[1] * block_m * (sum(head_dim_chunks(head_dim)) + 1), tiles_runs[0]


def _split_workspaces(like: torch.Tensor, partial_size: int, arrivals_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The split forward's partials and its zeroed arrival counts, on `like`'s device."""
    return (like.new_empty(partial_size, dtype=torch.float32),
            torch.zeros(arrivals_size, dtype=torch.int32, device=like.device))


def launch_dq(q4, k4, v4, o4, do4, lse, is_causal: bool, tiles: Tiles, kept: list[KeptLaunch] | None = None,
              tma: Tiles | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The dQ kernel: (dq4 laid out as q4, D = rowsum(dO * O) (batch, heads, n_queries) fp32)."""
    batch, heads, n_queries, _ = q4.shape
    head_dim = _head_dim(q4)
    tiles, described = _streamed(tiles, tma, ((1, k4), (2, v4)), "block_n", head_dim)
    dq4 = torch.empty_like(q4)
    delta = q4.new_empty((batch, heads, n_queries), dtype=torch.float32)
    n_tiles = cdiv(n_queries, tiles.block_m)
    group = head_group(batch * heads, n_tiles, q4.device)
    _launch(kernel_call("dq", head_dim, is_causal, tiles, DESCRIPTORS=described is not None),
            (batch * heads * n_tiles, 1, 1), (q4, k4, v4, o4, do4, lse, delta, dq4),
            (*_strides(q4, k4, v4, o4, do4, dq4), heads, group, n_queries, k4.shape[2], *_scales(head_dim)), kept,
            described)
    return dq4, delta


def launch_dkdv(q4, k4, v4, do4, lse, delta, is_causal: bool, tiles: Tiles, kept: list[KeptLaunch] | None = None,
                tma: Tiles | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The dK/dV kernel: (dk4, dv4), laid out as k4 and v4; lse and delta are (batch, heads, n_queries) fp32,
    contiguous."""
    batch, heads, n_queries, _ = q4.shape
    head_dim = _head_dim(q4)
    n_keys = k4.shape[2]
    tiles, described = _streamed(tiles, tma, ((0, q4), (3, do4)), "block_m", head_dim)
    dk4, dv4 = torch.empty_like(k4), torch.empty_like(v4)
    n_tiles = cdiv(n_keys, tiles.block_n)
    group = head_group(batch * heads, n_tiles, k4.device)
    _launch(kernel_call("dkdv", head_dim, is_causal, tiles, DESCRIPTORS=described is not None),
            (batch * heads * n_tiles, 1, 1), (q4, k4, v4, do4, lse, delta, dk4, dv4),
            (*_strides(q4, k4, v4, do4, dk4, dv4), heads, group, n_queries, n_keys, *_scales(head_dim)), kept,
            described)
    return dk4, dv4


# ------------------------------------------------------------------------------- forward, backward
#
# An eager call on a GPU is worked out once per signature: the input shapes, strides, dtypes and devices
# and causality, all that its checks, views, plans and launch arguments depend on. Its first call takes
# the whole path and keeps its compiled launches (a KeptForward or KeptBackward), and hands them to the
# C++ extension (native.py); a later call of that signature whose inputs start on 16-byte boundaries
# allocates its outputs and launches them with its own addresses, in C++ where the extension took them.
# On an H100's host the whole path's Python was 30% of a forward+backward's host time at the 2026 xl's
# attention, and the kept path's Python and Triton's launcher most of the rest beyond autograd's own
# (docs/flash_tuning.md, v16 and v17).

# Pointers each kernel takes, first among its arguments, in the order KeptForward and KeptBackward (and
# native.cpp's forward and backward) pass them: the forward's q, k, v, o, L (and the split forward's
# partials and arrival counts); dQ's q, k, v, o, dO, L, D, dQ; dK/dV's q, k, v, dO, L, D, dK, dV.
FORWARD_ADDRESSES, SPLIT_FORWARD_ADDRESSES, BACKWARD_ADDRESSES = 5, 7, (8, 8)


@dataclass(frozen=True, eq=False)
class KeptForward:
    """The forward's launch for one signature, o's strides (as the first call laid it out) and the split
    forward's workspace sizes (None: whole)."""

    launch: KeptLaunch
    o_strides: tuple[int, ...]
    split_workspace_sizes: tuple[int, int] | None

    def __call__(self, q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
        o = _empty_laid_out(q, self.o_strides)
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        # Workspaces are held until the launch is queued: freed before it, their blocks could be handed out
        # again and written first.
        workspaces = () if self.split_workspace_sizes is None else _split_workspaces(q, *self.split_workspace_sizes)
        with _on_device(q):
            self.launch(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse.data_ptr(),
                        *(t.data_ptr() for t in workspaces))
        return o, lse


@dataclass(frozen=True, eq=False)
class KeptBackward:
    """The dQ and dK/dV launches for one signature, and the strides of dQ, dK and dV (as the first call
    laid them out)."""

    dq: KeptLaunch
    dkdv: KeptLaunch
    gradient_strides: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]

    def __call__(self, q, k, v, o, lse, do) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dq, dk, dv = (_empty_laid_out(t, strides) for t, strides in zip((q, k, v), self.gradient_strides))
        delta = q.new_empty(q.shape[:-1], dtype=torch.float32)
        q_at, k_at, v_at, do_at, lse_at, delta_at = (t.data_ptr() for t in (q, k, v, do, lse, delta))
        with _on_device(q):
            self.dq(q_at, k_at, v_at, o.data_ptr(), do_at, lse_at, delta_at, dq.data_ptr())
            self.dkdv(q_at, k_at, v_at, do_at, lse_at, delta_at, dk.data_ptr(), dv.data_ptr())
        return dq, dk, dv


def _empty_laid_out(like: torch.Tensor, strides: tuple[int, ...]) -> torch.Tensor:
    """An uninitialised tensor shaped like `like`, with these strides."""
    return torch.empty_strided(like.shape, strides, dtype=like.dtype, device=like.device)


# Bounded like LAUNCHES_KEPT: signatures hold sizes.
SIGNATURES_KEPT = 1024
_kept_forwards: dict[tuple, KeptForward] = {}
_kept_backwards: dict[tuple, KeptBackward] = {}
# The C++ extension once it keeps a launch (native.py); until then every call takes the Python path.
_native: Any = None


def _plain(is_causal, *tensors: torch.Tensor) -> bool:
    """Whether a call may be kept at all: plain tensors (not traced or subclassed) and a bool."""
    return type(is_causal) is bool and all(type(t) is torch.Tensor for t in tensors)


def _launches_hooked() -> bool:
    """Whether something hooks Triton's launches (a profiler such as Proton): then kept calls launch
    through Triton's launcher, which calls the hooks, and not from C++, which would pass them by. A hook
    chain is truthy by the hooks it holds."""
    runtime = knobs.runtime
    return any(getattr(hook, "calls", hook) for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook))


def _keep_native(keep: str, tensors: tuple[torch.Tensor, ...], is_causal: bool, launches: list[KeptLaunch],
                 n_addresses: tuple[int, ...], *extra: int) -> None:
    """Hand a call's kept launches to the extension's `keep` (keep_forward or keep_backward), each launch
    taking n_addresses pointers; a launch the extension cannot make leaves the call to KeptForward or
    KeptBackward."""
    global _native
    extension = native.module()
    if extension is None:
        return
    native_launches = [native.as_launch(extension, kept, n) for kept, n in zip(launches, n_addresses, strict=True)]
    if None in native_launches:
        return
    getattr(extension, keep)(*tensors, is_causal, *native_launches, *extra, SIGNATURES_KEPT)
    _native = extension


def _signature(is_causal: bool, *tensors: torch.Tensor) -> tuple | None:
    """What an eager call's checks, views, plan and launch arguments depend on; None for calls that are
    not kept: traced or interpreted ones, and tensor subclasses."""
    if INTERPRETED or not _plain(is_causal, *tensors):
        return None
    return is_causal, *((t.shape, t.stride(), t.dtype, t.device) for t in tensors)


def _starts_in_place(views: tuple[torch.Tensor, ...], tensors: tuple[torch.Tensor, ...]) -> bool:
    """Whether as_batch_heads viewed every tensor in place (a copy's strides are not the signature's)."""
    return all(view.data_ptr() == t.data_ptr() for view, t in zip(views, tensors))


def _keep(kept: dict[tuple, Any], signature: tuple, entry: Any) -> None:
    if len(kept) >= SIGNATURES_KEPT:
        kept.clear()
    kept[signature] = entry


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, L): o shaped like q and laid out as the kernels' view of it (as_batch_heads: q's own layout
    where that has rows of d contiguous elements, dense), L (..., n_queries) fp32, contiguous. Raises naming
    the problem on inputs that break the contract (flash_pytorch.check_inputs)."""
    if _native is not None and _plain(is_causal, q, k, v) and not _launches_hooked():
        found = _native.forward(q, k, v, is_causal)
        if found is not None:
            return found
    signature = _signature(is_causal, q, k, v)
    kept = _kept_forwards.get(signature) if signature is not None else None
    if kept is not None and not (q.data_ptr() | k.data_ptr() | v.data_ptr()) % ALIGNMENT_BYTES:
        return kept(q, k, v)
    check_inputs(q, k, v, is_causal)
    check_device(q)
    q4, k4, v4 = as_batch_heads(q), as_batch_heads(k), as_batch_heads(v)
    plan = plan_for(q, k, is_causal)
    tiles, split_keys = plan.forward.tiles, plan.forward.split_keys
    launches: list[KeptLaunch] = []
    with _on_device(q):
        if split_keys is None:
            o4, lse = launch_forward(q4, k4, v4, is_causal, tiles, launches, plan.tma["forward"])
        else:
            o4, lse = launch_split_forward(q4, k4, v4, is_causal, tiles, split_keys, launches)
    # Each view or reshape costs microseconds of host time: none where the shapes match.
    o, lse = (o4, lse) if q.dim() == 4 else (o4.view(q.shape), lse.view(q.shape[:-1]))
    if signature is not None and _starts_in_place((q4, k4, v4), (q, k, v)):
        workspaces = None if split_keys is None else _split_workspace_sizes(launches[0].grid[:2], tiles.block_m,
                                                                             q.shape[-1])
        _keep(_kept_forwards, signature, KeptForward(launches[0], o.stride(), workspaces))
        n_addresses = FORWARD_ADDRESSES if workspaces is None else SPLIT_FORWARD_ADDRESSES
        _keep_native("keep_forward", (q, k, v), is_causal, launches, (n_addresses,), o.stride(),
                     *(workspaces or (-1, 0)))
    return o, lse


def backward(q, k, v, o, lse, do, is_causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv (shapes and dtypes of q, k, v, each laid out as forward lays out o for its input): dQ over
    query tiles (writing D on the way), then dK/dV over key tiles."""
    if _native is not None and _plain(is_causal, q, k, v, o, lse, do) and not _launches_hooked():
        found = _native.backward(q, k, v, o, lse, do, is_causal)
        if found is not None:
            return found
    signature = _signature(is_causal, q, k, v, o, lse, do)
    kept = _kept_backwards.get(signature) if signature is not None else None
    if kept is not None and not (q.data_ptr() | k.data_ptr() | v.data_ptr() | o.data_ptr() | lse.data_ptr()
                                 | do.data_ptr()) % ALIGNMENT_BYTES:
        return kept(q, k, v, o, lse, do)
    q4, k4, v4, o4, do4 = (as_batch_heads(t) for t in (q, k, v, o, do))
    lse4 = lse if lse.shape == q4.shape[:3] else lse.reshape(q4.shape[:3])
    if not (lse4.is_contiguous() and _starts_aligned(lse4)):  # the kernels index L by row; L as saved is so
        lse4 = lse4.clone(memory_format=torch.contiguous_format)
    plan = plan_for(q, k, is_causal)
    launches: list[KeptLaunch] = []
    with _on_device(q):
        dq4, delta = launch_dq(q4, k4, v4, o4, do4, lse4, is_causal, plan.dq, launches, plan.tma["dq"])
        dk4, dv4 = launch_dkdv(q4, k4, v4, do4, lse4, delta, is_causal, plan.dkdv, launches, plan.tma["dkdv"])
    gradients = (dq4, dk4, dv4) if q.dim() == 4 else (dq4.view(q.shape), dk4.view(k.shape), dv4.view(v.shape))
    if signature is not None and _starts_in_place((q4, k4, v4, o4, do4, lse4), (q, k, v, o, do, lse)):
        strides = tuple(t.stride() for t in gradients)
        _keep(_kept_backwards, signature, KeptBackward(*launches, strides))
        _keep_native("keep_backward", (q, k, v, o, lse, do), is_causal, launches, BACKWARD_ADDRESSES, *strides)
    return gradients
