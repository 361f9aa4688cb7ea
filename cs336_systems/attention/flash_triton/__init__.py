"""FlashAttention-2 in Triton: the kernels (kernels.py), their launch shapes (tiles.py), how they are
launched (launch.py), and the torch.library op and autograd Function over them (op.py).

The input contract (shapes, dtypes, causal alignment, L) is flash_pytorch's, checked by the same
`check_inputs`.
"""

from pathlib import Path

from cs336_systems.attention.flash_triton.launch import INTERPRETED, backward, forward, launch_plan, plan_for
from cs336_systems.attention.flash_triton.op import (
    FlashAttentionTriton,
    flash_attention_backward,
    flash_attention_forward,
    flash_attention_triton,
)
from cs336_systems.provenance import source_digest

# The files whose code runs on the GPU: the kernels and everything that decides how they launch. Their
# hash names the code a GPU test run or a benchmark measured.
GPU_SOURCES = ("kernels.py", "tiles.py", "launch.py", "op.py")


def source_hash() -> str:
    """A short hash of GPU_SOURCES' bytes: any edit to them, comments included, calls for a new GPU run."""
    return source_digest(Path(__file__).parent, GPU_SOURCES)

__all__ = ["INTERPRETED", "GPU_SOURCES", "FlashAttentionTriton", "backward", "flash_attention_backward",
           "flash_attention_forward", "flash_attention_triton", "forward", "launch_plan", "plan_for", "source_hash"]
