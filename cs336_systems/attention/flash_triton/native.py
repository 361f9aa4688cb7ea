"""The C++ side of kept eager calls (native.cpp): built once per machine by torch's extension loader, it
finds a call's kept launches by its signature, allocates the outputs and launches the compiled kernels
with cuLaunchKernel, where launch.py's kept path pays Python for each of those steps.

    extension = module()                  # the built extension, or None where it cannot be built
    kernel = as_launch(extension, kept, n_addresses)   # a KeptLaunch as the extension launches it

Kernels that load through tensor descriptors get a CUtensorMap encoded for each launch over that call's
addresses (cuTensorMapEncodeTiled), as Triton's launcher encodes it.

Set CS336_FLASH_NATIVE=0 to keep every eager launch in Python. A machine that cannot build the extension
(no C++ compiler, say) warns once and launches from Python too.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import triton

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native.cpp")
SWITCH = "CS336_FLASH_NATIVE"
# cuda.h for the driver's types: Triton ships it with its NVIDIA backend, so no CUDA toolkit is needed.
CUDA_INCLUDE = Path(triton.__file__).parent / "backends" / "nvidia" / "include"

# A kept launch's parameter kinds (native.cpp's Kind) by Triton's signature type; a kernel with any other
# type of parameter is launched from Python. A tensor descriptor is a CUtensorMap made for each launch
# (TENSOR_MAP), then its shape as i32s and its strides as i64s, as Triton's launcher passes it.
ADDRESS, SCALAR_KINDS, TENSOR_MAP = 0, {"i32": 1, "i64": 2, "fp32": 3}, 4
# Triton's launcher passes a null scratch pointer after the parameters for each of these metadata fields
# the compiled kernel has (a kernel that needs scratch memory is launched from Python).
SCRATCH_FIELDS = ("global_scratch_size", "profile_scratch_size")


@functools.cache
def module() -> Any | None:
    """The built extension (torch.utils.cpp_extension caches the build per machine, rebuilding on an edit
    of native.cpp), or None: switched off, or not buildable here, which warns once with the reason."""
    if os.environ.get(SWITCH, "1") == "0":
        return None
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None:  # the loader runs ninja from the PATH; pip's ninja may be off it
        with contextlib.suppress(ImportError):
            import ninja
            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    log.info("building %s (once per machine and edit)", SOURCE.name)
    try:
        return cpp_extension.load(name="cs336_flash_native", sources=[str(SOURCE)],
                                  extra_include_paths=[str(CUDA_INCLUDE)], extra_cflags=["-O2"])
    except (OSError, RuntimeError, ImportError) as error:  # no compiler, a failed build, a load error
        warnings.warn(f"FlashAttentionTriton launches its kept calls from Python: building {SOURCE.name} "
                      f"failed ({error}); set {SWITCH}=0 to skip the build", RuntimeWarning, stacklevel=2)
        return None


def parameters(signature: dict[str, str], values: tuple, n_addresses: int,
               tensordesc_meta: list[dict] | None = None) -> tuple[list, list, list, list] | None:
    """The kernel parameters native.cpp packs, as (kinds, ints, floats, tensor maps) lists, for a compiled
    kernel's `signature` (argument name: Triton type, "constexpr" for an argument compiled in) and a
    launch's argument values in order, the first `n_addresses` of them pointers (given here as their
    position in the call's address list). A tensor descriptor's value is launch.py's Described, and
    `tensordesc_meta` what Triton compiled for each descriptor in order (its swizzle, element type and size,
    and block): each becomes a tensor map (tensor_map's list) and its shape and strides. None where a type
    has no native kind."""
    if len(signature) != len(values):
        raise ValueError(f"a compiled signature of {len(signature)} arguments for {len(values)} values")
    kinds, ints, floats, maps = [], [], [], []
    metas = iter(tensordesc_meta or ())
    for position, (ty, value) in enumerate(zip(signature.values(), values)):
        if ty == "constexpr":  # compiled in: a constant, or an int Triton specialised on (equal to 1)
            continue
        if ty.startswith("*") != (position < n_addresses):  # pointers first, and only pointers
            return None
        if ty.startswith("*"):
            kinds.append(ADDRESS)
            ints.append(position)
            floats.append(0.0)
        elif ty in SCALAR_KINDS:
            kinds.append(SCALAR_KINDS[ty])
            ints.append(int(value) if ty != "fp32" else 0)
            floats.append(float(value) if ty == "fp32" else 0.0)
        elif ty.startswith("tensordesc"):
            meta = next(metas, None)
            if meta is None or meta.get("fp4_padded"):  # lowered without a CUtensorMap, or packed fp4
                return None
            kinds.append(TENSOR_MAP)
            ints.append(len(maps))
            floats.append(0.0)
            maps.append(tensor_map(value, meta))
            for scalars, kind in ((value.shape, SCALAR_KINDS["i32"]), (value.strides, SCALAR_KINDS["i64"])):
                kinds += [kind] * len(scalars)
                ints += [int(x) for x in scalars]
                floats += [0.0] * len(scalars)
        else:
            return None
    return kinds, ints, floats, maps


def tensor_map(described: Any, meta: dict) -> list[int]:
    """A descriptor's CUtensorMap as native.cpp encodes it for each launch, in the order of its
    TensorMapSpec: the address's position and byte offset, the element type (cuTensorMapEncodeTiled's
    enum), rank, swizzle and element size, then the shape, strides (in elements) and block, outermost
    first, as Triton's own launcher encodes them (fill_tma_descriptor)."""
    from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST

    return [described.position, described.offset_bytes, TMA_DTYPE_DEVICE_TO_HOST[meta["elem_type"]],
            len(described.shape), meta["swizzle"], meta["elem_size"], *described.shape, *described.strides,
            *meta["block_size"]]


def as_launch(extension: Any, kept: Any, n_addresses: int) -> Any | None:
    """launch.py's KeptLaunch `kept` as the extension's Launch, or None where the compiled kernel needs
    what native.cpp does not do: clusters, cooperative or programmatic launches, scratch memory, or a
    parameter type without a native kind."""
    compiled, metadata = kept.compiled, kept.compiled.metadata
    if (getattr(metadata, "num_ctas", 1) != 1 or getattr(metadata, "launch_cooperative_grid", False)
            or getattr(metadata, "launch_pdl", False) or any(getattr(metadata, field, 0) for field in SCRATCH_FIELDS)):
        return None
    found = parameters(compiled.src.signature, (*range(n_addresses), *kept.scalars, *kept.descriptors, *kept.constants),
                       n_addresses, getattr(metadata, "tensordesc_meta", None))
    if found is None:
        return None
    kinds, ints, floats, maps = found
    return extension.Launch(function=compiled.function, grid=list(kept.grid), threads=32 * metadata.num_warps,
                            shared_bytes=metadata.shared,
                            null_pointers=sum(hasattr(metadata, field) for field in SCRATCH_FIELDS),
                            kinds=kinds, integers=ints, reals=floats, tensor_maps=maps)
