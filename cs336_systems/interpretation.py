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

Not every install's interpreter can run them: `interpreter_problem()` names the one known to fail.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from importlib import metadata

INTERPRET_VARIABLE = "TRITON_INTERPRET"
# Triton before 3.9 turns a loop bound computed in a kernel into a Python int by int() of a one-element
# array, which numpy 2.4 refuses ("only 0-dimensional arrays can be converted to Python scalars").
FIRST_TRITON_FOR_NUMPY_2_4 = (3, 9)


def _major_minor(version: str) -> tuple[int, int]:
    """(major, minor) of a version string, whatever follows the minor's digits ("2.0rc1" is (2, 0))."""
    major, minor = version.split(".")[:2]
    return int(major), int(re.match(r"\d*", minor).group() or 0)


def interpreter_problem(triton_version: str | None = None, numpy_version: str | None = None) -> str | None:
    """Why Triton's interpreter cannot run the FlashAttention kernels with these versions (the installed
    ones by default, read from the package metadata: importing triton would settle its mode before
    interpret_kernels can), or None where it can."""
    triton_version = triton_version or metadata.version("triton")
    numpy_version = numpy_version or metadata.version("numpy")
    if _major_minor(triton_version) < FIRST_TRITON_FOR_NUMPY_2_4 and _major_minor(numpy_version) >= (2, 4):
        return (f"Triton {triton_version}'s interpreter cannot run the FlashAttention kernels with numpy "
                f"{numpy_version}: a loop bound computed in a kernel fails to convert to an int; install "
                "numpy<2.4 or triton>=3.9")
    return None


def mixed_mode_problem(kernels_interpreted: bool) -> str | None:
    """Why kernels decorated in this mode cannot run beside the triton.language already imported, or None.

    triton.language's own helpers (tl.cdiv and the rest of triton.language.standard) are decorated, and
    so take their mode, when triton is first imported, which torch does as a side effect (torch._dynamo,
    torch.compile, torch.compiler.disable). Interpreted kernels calling compiled helpers fail deep in
    Triton ("Cannot call @triton.jit'd outside of the scope of a kernel")."""
    standard = sys.modules.get("triton.language.standard")
    if standard is None:
        return None
    from triton.runtime import JITFunction

    if isinstance(standard.cdiv, JITFunction) != kernels_interpreted:
        return None
    imported, asked = ("compiled", "interpreted") if kernels_interpreted else ("interpreted", "compiled")
    return (f"triton.language was imported {imported} and the FlashAttention kernels {asked}: "
            f"{INTERPRET_VARIABLE} changed between the two imports. Set it in the environment before starting "
            "Python, or import nothing that imports triton (torch._dynamo, torch.compile) before the kernels' mode "
            "is decided")


def interpret_kernels(on_gpu: bool) -> Callable[[], None]:
    """Make the Triton kernels imported from now on run in the interpreter unless the run is on a GPU
    (where the environment is left as it is); returns the function that puts TRITON_INTERPRET back as it
    was, for a run inside another process (pytest's own tests of the plugin) whose later kernels must
    not change mode. Raises RuntimeError where triton was already imported compiled, so that interpreted
    kernels could not run (mixed_mode_problem)."""
    if on_gpu:
        return lambda: None
    if problem := mixed_mode_problem(kernels_interpreted=True):
        raise RuntimeError(problem)
    before = os.environ.get(INTERPRET_VARIABLE)
    os.environ[INTERPRET_VARIABLE] = "1"

    def restore() -> None:
        if before is None:
            os.environ.pop(INTERPRET_VARIABLE, None)
        else:
            os.environ[INTERPRET_VARIABLE] = before

    return restore
