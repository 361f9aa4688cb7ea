"""What each TransformerBlock saves for backward (its residuals), which operations allocated them, and
how much memory the gradients of a block take in the backward pass: memory_profiling part (f),
measured from PyTorch itself instead of Nsight Systems' memory rows.

    profile = block_memory(model, loss_fn, model.layers)   # loss_fn() runs forward and the loss
    profile.blocks[i].saved_bytes, profile.blocks[i].by_operation
    profile.blocks[i].gradient_bytes      # CUDA: allocated change over its backward + what it freed

Residuals. A saved-tensor hook sees every tensor autograd keeps for backward; the block whose forward
was running when it was saved owns it. Each storage counts once (q, k and v save views of one
projection output, and several ops save the same input). Which operation allocated a residual comes
from a dispatch mode that watches every aten call below autograd and notes each output whose storage
is new (not one of the call's inputs: views and in-place ops allocate nothing). A block's input, the
residual stream, was allocated by the previous block's last addition (or the embedding) and is
saved by this block's first RMSNorm, so it is this block's residual, allocated by an operation
before it.

Gradients. During the backward pass a block's residuals are freed while the gradients of its weights
appear. On CUDA the allocated memory is read when autograd reaches the block's output gradient and
again once the gradient of its input is computed; the change plus the residuals it freed is what the
new gradients took: its weights' gradients, fp32 (4 bytes per parameter) under autocast too, and the
gradient of its input, allocated while that of its output is still held.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _storages(values) -> dict[int, int]:
    """data_ptr -> bytes of the storages of every tensor among `values` (nested containers too)."""
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in tree_leaves(values) if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes()}


class AllocatingOperations(TorchDispatchMode):
    """Notes, for each storage an aten call creates, the operation and the block running at the time."""

    def __init__(self, current_block: Callable[[], int | None]):
        super().__init__()
        self.current_block = current_block
        self.allocated_by: dict[int, tuple[str, int | None]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = _storages((args, kwargs))
        for pointer in _storages(out):
            if pointer not in inputs:  # a later storage at a freed address replaces the old entry
                self.allocated_by[pointer] = (func._schema.name, self.current_block())
        return out


@dataclass
class BlockMemory:
    index: int
    saved_bytes: int = 0
    by_operation: dict[str, int] = field(default_factory=dict)  # allocating op -> bytes of residuals
    allocated_elsewhere_bytes: int = 0  # of saved_bytes, allocated before this block's forward (its input)
    forward_allocated_bytes: int | None = None  # CUDA: memory_allocated change over the block's forward
    backward_allocated_bytes: int | None = None  # CUDA: change over the block's backward
    gradient_parameter_bytes: int = 0  # the block's .grad storages right after its backward
    parameter_count: int = 0

    @property
    def gradient_bytes(self) -> int | None:
        """What the block's backward allocated for gradients: the change plus the residuals it freed."""
        if self.backward_allocated_bytes is None:
            return None
        return self.backward_allocated_bytes + self.saved_bytes

    def top_operations(self, count: int) -> list[tuple[str, int, float]]:
        """(op, bytes, share of the block's residuals), largest first."""
        ranked = sorted(self.by_operation.items(), key=lambda item: (-item[1], item[0]))[:count]
        return [(op, size, size / self.saved_bytes if self.saved_bytes else 0.0) for op, size in ranked]


@dataclass
class BlockMemoryProfile:
    blocks: list[BlockMemory]
    saved_outside_blocks_bytes: int  # embedding, final norm, LM head and loss


def _allocated(device: torch.device) -> int | None:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def block_memory(model: nn.Module, loss_fn: Callable[[], torch.Tensor], blocks: Sequence[nn.Module],
                 exclude: Sequence[torch.Tensor] = ()) -> BlockMemoryProfile:
    """Run loss_fn() (forward and loss) then its backward once, measuring each block (see the module
    docstring). Gradients must be None beforehand, so the backward allocates them afresh; storages
    of `exclude` (the parameters are excluded anyway) are not residuals."""
    device = next(model.parameters()).device
    index_of = {id(block): i for i, block in enumerate(blocks)}
    found = [BlockMemory(i, parameter_count=sum(p.numel() for p in block.parameters()))
             for i, block in enumerate(blocks)]
    running: list[int] = []  # the block whose forward is running, innermost last
    excluded = set(_storages([*model.parameters(), *exclude]))
    saved_by: dict[int, tuple[int | None, int]] = {}  # storage -> (block that saved it, bytes)
    allocations = AllocatingOperations(lambda: running[-1] if running else None)
    before: dict[int, int | None] = {}

    def forward_pre(block, args):
        running.append(index_of[id(block)])
        before[running[-1]] = _allocated(device)

    def forward_post(block, args, output):
        i = running.pop()
        if before[i] is not None:
            found[i].forward_allocated_bytes = _allocated(device) - before[i]

    def backward_pre(block, grad_output):
        before[index_of[id(block)]] = _allocated(device)

    def backward_post(block, grad_input, grad_output):
        i = index_of[id(block)]
        if before[i] is not None:
            found[i].backward_allocated_bytes = _allocated(device) - before[i]
        found[i].gradient_parameter_bytes = sum(p.grad.untyped_storage().nbytes() for p in block.parameters()
                                                if p.grad is not None)

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in excluded:
            saved_by.setdefault(storage.data_ptr(), (running[-1] if running else None, storage.nbytes()))
        # A detached alias keeps the storage alive as the tensor would, without the reference cycle an op
        # saving its own output would make (see profiling.memory.saved_tensor_bytes).
        return tensor.detach()

    handles = []
    for block in blocks:
        handles += [block.register_forward_pre_hook(forward_pre), block.register_forward_hook(forward_post),
                    block.register_full_backward_pre_hook(backward_pre),
                    block.register_full_backward_hook(backward_post)]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), allocations:
            loss = loss_fn()
        outside = 0
        for pointer, (block, size) in saved_by.items():
            if block is None:
                outside += size
                continue
            operation, allocated_in = allocations.allocated_by.get(pointer, ("(allocated before the forward)", None))
            found[block].saved_bytes += size
            found[block].by_operation[operation] = found[block].by_operation.get(operation, 0) + size
            if allocated_in != block:
                found[block].allocated_elsewhere_bytes += size
        loss.backward()
    finally:
        for handle in handles:
            handle.remove()
    return BlockMemoryProfile(found, outside)
