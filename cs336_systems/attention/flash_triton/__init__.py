"""FlashAttention-2 in Triton: the kernels (kernels.py), their launch shapes (tiles.py), how they are
launched (launch.py), and the torch.library op and autograd Function over them (op.py).

The input contract (shapes, dtypes, causal alignment, L) is flash_pytorch's, checked by the same
`check_inputs`.
"""

from cs336_systems.attention.flash_triton.launch import INTERPRETED, backward, forward, launch_plan, plan_for
from cs336_systems.attention.flash_triton.op import (
    FlashAttentionTriton,
    flash_attention_backward,
    flash_attention_forward,
    flash_attention_triton,
)
from cs336_systems.interpretation import mixed_mode_problem
from cs336_systems.provenance import PACKAGE_ROOT, source_digest

# Kernels that triton.language's own helpers could not run beside (interpreted kernels calling compiled tl.cdiv)
# fail at their first launch, deep in Triton: name the cause at import instead.
if _mixed := mixed_mode_problem(INTERPRETED):
    raise ImportError(_mixed)

# The package's files whose code runs on the GPU or decides what runs there: this package's kernels, tiles,
# launch code (native.cpp's C++ too) and op, and every package module they import (flash_pytorch: the
# masking bias the kernels add, the input checks and head-dim limit their launch applies);
# tests/test_gpu_evidence.py derives that set from the imports and the package's C++ sources. Their hash
# names the code a GPU test run or a benchmark measured.
GPU_SOURCES = ("attention/flash_pytorch.py", "attention/flash_triton/kernels.py", "attention/flash_triton/launch.py",
               "attention/flash_triton/native.cpp", "attention/flash_triton/native.py", "attention/flash_triton/op.py",
               "attention/flash_triton/tiles.py")


def source_hash() -> str:
    """A short hash of GPU_SOURCES' bytes: any edit to them, comments included, calls for a new GPU run."""
    return source_digest(PACKAGE_ROOT, GPU_SOURCES)

__all__ = ["INTERPRETED", "GPU_SOURCES", "FlashAttentionTriton", "backward", "flash_attention_backward",
           "flash_attention_forward", "flash_attention_triton", "forward", "launch_plan", "plan_for", "source_hash"]
