"""Whether the Triton kernels run in Triton's interpreter: decided here, once per process.

    restore = interpret_kernels(on_gpu=False)   # before anything imports the kernels
    ...
    restore()                                    # the environment as it was

A run without a CUDA GPU (no GPU found, or `--gpu none`) runs the FlashAttention kernels
(cs336_systems.attention.flash_triton) in Triton's interpreter, on CPU tensors: that is how their
correctness tests run on any machine. A run on a GPU compiles them.

Triton reads TRITON_INTERPRET when a kernel is decorated, that is when
cs336_systems.attention.flash_triton.kernels is first imported, not when a kernel is launched. So the
decision must be made before that import and holds for the rest of the process: made later it changes
nothing already imported. Processes started afterwards (distributed ranks, a fresh benchmark process)
inherit the environment, and so the decision. What actually happened is read from the kernels
themselves: cs336_systems.attention.flash_triton.launch.INTERPRETED.
"""

from __future__ import annotations

import os
from collections.abc import Callable

INTERPRET_VARIABLE = "TRITON_INTERPRET"


def interpret_kernels(on_gpu: bool) -> Callable[[], None]:
    """Make the Triton kernels imported from now on run in the interpreter unless the run is on a GPU
    (where the environment is left as it is); returns the function that puts TRITON_INTERPRET back as it
    was, for a run inside another process (pytest's own tests of the plugin) whose later kernels must
    not change mode."""
    if on_gpu:
        return lambda: None
    before = os.environ.get(INTERPRET_VARIABLE)
    os.environ[INTERPRET_VARIABLE] = "1"

    def restore() -> None:
        if before is None:
            os.environ.pop(INTERPRET_VARIABLE, None)
        else:
            os.environ[INTERPRET_VARIABLE] = before

    return restore
