"""What a call runs beneath PyTorch: the aten ops it dispatches and the Triton kernels it launches, recorded for
any implementation without knowing its code.

    with recorded() as calls:
        o = Function.apply(q, k, v, True)
    calls.kernels          # ["forward_kernel"]: the Triton kernels launched, by name
    torch_attention(calls.ops, n_queries, n_keys, batch_heads)   # sentences naming attention done by torch ops

Aten ops are seen through a TorchDispatchMode (below autograd, so inside an autograd.Function's forward and
backward too; autograd carries the mode to its backward threads). Triton launches are seen where every launch
passes: on a GPU Triton's launch hook, which its JIT launch and a compiled kernel's launch both call (as
profilers use it); under TRITON_INTERPRET=1 the interpreter's InterpretedFunction.run, which a kernel's launch
and an autotuner's both end in.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Aten ops that compute attention's scores, weights or weighted sums: matrix products, softmax and its kin, and
# PyTorch's fused attention (by their names' stems, which cover every backend's and the backward ops).
MATRIX_PRODUCT_OPS = frozenset({"mm", "bmm", "matmul", "addmm", "baddbmm", "addbmm", "dot", "vdot", "mv", "linear",
                                "_addmm_activation", "_scaled_mm"})
SOFTMAX_OPS = frozenset({"softmax", "_softmax", "_safe_softmax", "log_softmax", "_log_softmax", "logsumexp",
                         "_softmax_backward_data", "_log_softmax_backward_data"})
FUSED_ATTENTION_STEMS = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")


@dataclass(frozen=True)
class OpCall:
    """One aten op as dispatched: its name (aten::mm) and the shapes of its tensor inputs and outputs."""

    name: str
    input_shapes: tuple[tuple[int, ...], ...]
    output_shapes: tuple[tuple[int, ...], ...]


@dataclass
class Calls:
    ops: list[OpCall] = field(default_factory=list)
    kernels: list[str] = field(default_factory=list)
    # While above 0 an interpreted kernel runs: the aten ops then are the interpreter's own (it copies each
    # argument's storage to the host and back), not the implementation's.
    interpreting: int = 0


def _tensor_shapes(values) -> tuple[tuple[int, ...], ...]:
    flat = torch.utils._pytree.tree_leaves(values)
    return tuple(tuple(t.shape) for t in flat if isinstance(t, torch.Tensor))


class _RecordOps(TorchDispatchMode):
    def __init__(self, calls: Calls):
        super().__init__()
        self.calls = calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.calls.interpreting:
            self.calls.ops.append(OpCall(f"aten::{func.overloadpacket.__name__}", _tensor_shapes((args, kwargs)),
                                         _tensor_shapes(out)))
        return out


def _kernel_name(metadata) -> str:
    """The kernel's name from what Triton's launch hook is given (a LazyDict of the launch's metadata)."""
    try:
        return str(metadata.get()["name"])
    except (AttributeError, KeyError, TypeError):
        return repr(metadata)


@contextlib.contextmanager
def recorded() -> Iterator[Calls]:
    """Record the aten ops dispatched and the Triton kernels launched in the block."""
    from triton import knobs
    from triton.runtime.interpreter import InterpretedFunction

    calls = Calls()

    def on_launch(metadata) -> None:
        calls.kernels.append(_kernel_name(metadata))

    interpreted_run = InterpretedFunction.run

    def run_recorded(self, *args, grid, warmup, **kwargs):
        if not warmup:
            calls.kernels.append(self.fn.__name__)
        calls.interpreting += 1
        try:
            return interpreted_run(self, *args, grid=grid, warmup=warmup, **kwargs)
        finally:
            calls.interpreting -= 1

    knobs.runtime.launch_enter_hook.add(on_launch)
    InterpretedFunction.run = run_recorded
    try:
        with _RecordOps(calls):
            yield calls
    finally:
        InterpretedFunction.run = interpreted_run
        knobs.runtime.launch_enter_hook.remove(on_launch)


def _shape_words(shape: tuple[int, ...]) -> str:
    return " x ".join(map(str, shape))


def torch_attention(ops: list[OpCall], n_queries: int, n_keys: int) -> list[str]:
    """Sentences naming the ops among `ops` that do attention's work in torch: a matrix product, a softmax or
    PyTorch's fused attention, and any op whose output is a query-by-key matrix (its last two dims n_queries
    and n_keys, either way round). Choose n_queries and n_keys unequal to each other, to the head dim and to
    the leading dims, so that no other tensor has those dims."""
    found = []
    for op in ops:
        stem = op.name.removeprefix("aten::")
        operands = " and ".join(_shape_words(shape) for shape in op.input_shapes) or "no tensors"
        if stem in MATRIX_PRODUCT_OPS or stem in SOFTMAX_OPS or any(s in stem for s in FUSED_ATTENTION_STEMS):
            found.append(f"ran {op.name} on {operands}")
            continue
        for shape in op.output_shapes:
            if sorted(shape[-2:]) == sorted((n_queries, n_keys)):
                found.append(f"ran {op.name}, which made a {_shape_words(shape)} tensor (n_q = {n_queries}, "
                             f"n_k = {n_keys}): the query-by-key matrix in memory")
                break
    return found
