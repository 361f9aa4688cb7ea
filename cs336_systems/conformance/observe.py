"""What the distributed checks observe of an implementation without knowing its classes: the collectives it
issues, the memory its tensors hold, the state its optimizer keeps.

    with CollectiveLog() as log:                  # every collective issued on this thread and by backward
        loss.backward()
    log.reductions()                              # [Collective("all_reduce", float64, 550), ...]

    with LiveStorages() as storages:              # every tensor storage created or used from here on
        model = get_fsdp(build())
        storages.live_bytes()                     # bytes of those still alive

Both are TorchDispatchModes: every torch operation passes through them, the collectives of
torch.distributed included (c10d's ops, and the functional collectives), whether an implementation calls
dist.all_reduce, a process group's method or anything else that reaches the backend, and whether it runs in
a hook during backward or not. So they see what an implementation does, not what it says it does.
"""

from __future__ import annotations

import types
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# The operator namespaces of torch.distributed's collectives: c10d (dist.all_reduce and the process groups'
# methods) and the functional collectives.
COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")
# Which argument of each collective holds the data it sends (an input the output is computed from).
_INPUT_ARGUMENT = {
    "allreduce_": 0, "allreduce_coalesced_": 0, "reduce_": 0, "broadcast_": 0,
    "reduce_scatter_": 1, "_reduce_scatter_base_": 1, "reduce_scatter_tensor_coalesced_": 1,
    "allgather_": 1, "_allgather_base_": 1, "allgather_coalesced_": 1, "allgather_into_tensor_coalesced_": 1,
    "all_reduce": 0, "all_reduce_": 0, "all_reduce_coalesced": 0, "all_reduce_coalesced_": 0,
    "reduce_scatter_tensor": 0, "reduce_scatter_tensor_coalesced": 0,
    "all_gather_into_tensor": 0, "all_gather_into_tensor_coalesced": 0, "broadcast": 0,
}
REDUCTIONS = ("all_reduce", "reduce_scatter", "reduce")


@dataclass(frozen=True)
class Collective:
    """One collective as issued: its kind (all_reduce, reduce_scatter, reduce, all_gather, broadcast), the
    dtype of the data it sends and how many elements that data has."""

    kind: str
    dtype: torch.dtype | None
    numel: int
    operator: str


def _kind(name: str) -> str:
    plain = name.replace("_", "")
    for kind in ("reducescatter", "allreduce", "allgather", "broadcast"):
        if kind in plain:
            return {"reducescatter": "reduce_scatter", "allreduce": "all_reduce", "allgather": "all_gather"}.get(
                kind, kind)
    return "reduce" if plain == "reduce" else name


def _tensors(value) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


class CollectiveLog(TorchDispatchMode):
    """Records every collective issued while it is active (`issued`, in order). `mark()` returns how many
    have been issued so far, for a hook to note where backward had got to."""

    def __init__(self):
        super().__init__()
        self.issued: list[Collective] = []

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        if func.namespace in COLLECTIVE_NAMESPACES and func._opname in _INPUT_ARGUMENT:
            sent = _tensors(args[_INPUT_ARGUMENT[func._opname]])
            self.issued.append(Collective(_kind(func._opname), sent[0].dtype if sent else None,
                                          sum(t.numel() for t in sent), str(func._schema.name)))
        return func(*args, **(kwargs or {}))

    def mark(self) -> int:
        return len(self.issued)

    def reductions(self, dtype: torch.dtype | None = None, start: int = 0, end: int | None = None) -> list[Collective]:
        """The all-reduces, reduce-scatters and reduces among issued[start:end], of `dtype` if given (the
        gradients' dtype: an implementation may all-reduce its own bookkeeping, such as counts, besides)."""
        return [c for c in self.issued[start:end] if c.kind in REDUCTIONS and (dtype is None or c.dtype == dtype)]


class LiveStorages(TorchDispatchMode):
    """Tracks the storage of every tensor an operation creates or returns while it is active, weakly: its
    live bytes are what those tensors still hold, however they are kept alive (an attribute, a hook's
    closure, autograd's saved tensors, a collective in flight). Tensors created before it are not counted.

    `watch_peak()` starts recording the most bytes alive at any operation (`peak_bytes`), `stop_peak()`
    ends it.
    """

    def __init__(self):
        super().__init__()
        self._storages: dict[int, StorageWeakRef] = {}
        self.peak_bytes: int | None = None
        self._watching = False

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in _tensors(out):
            self._see(tensor)
        if self._watching:
            self.peak_bytes = max(self.peak_bytes, self.live_bytes())
        return out

    def _see(self, tensor: torch.Tensor) -> None:
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a tensor without one storage (sparse, nested)
            return
        key = storage._cdata
        known = self._storages.get(key)
        if known is None or known.expired():  # an address reused by a new storage
            self._storages[key] = StorageWeakRef(storage)

    def live_bytes(self, excluding: Iterable[torch.Tensor] = ()) -> int:
        """Bytes of the tracked storages still alive (as they are now: a storage resized to 0 holds none),
        less those of the `excluding` tensors' storages."""
        skip = {storage_key(t) for t in excluding}
        total = 0
        for key, ref in list(self._storages.items()):
            if ref.expired():
                del self._storages[key]
            elif key not in skip:
                total += torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes()
        return total

    def watch_peak(self) -> None:
        self.peak_bytes, self._watching = self.live_bytes(), True

    def stop_peak(self) -> int:
        self._watching = False
        return self.peak_bytes


def storage_key(tensor: torch.Tensor) -> int:
    """What identifies the memory a tensor views: tensors of one key share their bytes."""
    return tensor.untyped_storage()._cdata


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages the tensors view (a view of a large tensor counts the whole)."""
    distinct = {}
    for t in tensors:
        distinct[storage_key(t)] = t.untyped_storage().nbytes()
    return sum(distinct.values())


# Objects the walk of an optimizer does not enter: code, classes, modules (a model's own tensors are not its
# optimizer's state), and the process group's handles.
_OPAQUE = (type, types.ModuleType, types.FunctionType, types.MethodType, types.BuiltinFunctionType,
           torch.nn.Module, torch.dtype, torch.device)


def reachable_tensors(root: object, excluding: Iterable[torch.Tensor] = ()) -> list[torch.Tensor]:
    """Every tensor reachable from `root` through attributes, dicts (keys and values), lists, tuples and sets,
    an optimizer's inner optimizers and state included, less those sharing storage with `excluding` (the
    parameters and their gradients: an optimizer refers to them, but they are not its state)."""
    skip = {storage_key(t) for t in excluding}
    found: dict[int, torch.Tensor] = {}
    seen: set[int] = set()
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _OPAQUE) or obj is None or isinstance(obj, (str, bytes, int, float)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.layout == torch.strided and storage_key(obj) not in skip:
                found.setdefault(storage_key(obj), obj)
            continue
        if isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        else:
            stack.extend(getattr(obj, "__dict__", {}).values())
            for slot in getattr(type(obj), "__slots__", ()):
                stack.append(getattr(obj, slot, None))
    return list(found.values())
