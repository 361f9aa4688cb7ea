"""FlashAttention-2 in Triton: the kernels (kernels.py), their launch shapes (tiles.py), how they are
launched (launch.py), and the torch.library op and autograd Function over them (op.py).

The input contract (shapes, dtypes, causal alignment, L) is flash_pytorch's, checked by the same
`check_inputs`.
"""

import hashlib
from pathlib import Path

from cs336_systems.attention.flash_triton.launch import INTERPRETED, backward, forward, launch_plan, plan_for
from cs336_systems.attention.flash_triton.op import (
    FlashAttentionTriton,
    flash_attention_backward,
    flash_attention_forward,
    flash_attention_triton,
)

# The files whose code runs on the GPU: the kernels and everything that decides how they launch. Their
# hash names the code a GPU test run or a benchmark measured.
GPU_SOURCES = ("kernels.py", "tiles.py", "launch.py", "op.py")


def source_hash() -> str:
    """A short hash of GPU_SOURCES' bytes: any edit to them, comments included, calls for a new GPU run."""
    digest = hashlib.sha256()
    for name in GPU_SOURCES:
        digest.update(name.encode() + b"\0" + (Path(__file__).parent / name).read_bytes() + b"\0")
    return digest.hexdigest()[:16]

__all__ = ["INTERPRETED", "GPU_SOURCES", "FlashAttentionTriton", "backward", "flash_attention_backward",
           "flash_attention_forward", "flash_attention_triton", "forward", "launch_plan", "plan_for", "source_hash"]
