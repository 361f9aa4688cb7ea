"""Check that both FlashAttention Functions run under torch.compile (causal) and give the eager
results (output and gradients), per dtype and compile backend. Needs a CUDA GPU for the Triton
Function and for bf16; prints one line per case and exits non-zero on a mismatch or failure."""

import sys

import torch

from cs336_systems.attention.flash_pytorch import FlashAttentionPytorch
from cs336_systems.attention.flash_triton import FlashAttentionTriton

BACKENDS = ("aot_eager", "inductor")
SHAPE = (2, 4, 300, 64)  # batch, heads, tokens (no multiple of any tile), head dim
# Compiled against eager: the same kernels give identical results; inductor's fused PyTorch code may
# round differently, within a few units of the dtype's last place at these magnitudes.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _run(attend, q, k, v, do):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = attend(q, k, v)
    return (out, *torch.autograd.grad(out, (q, k, v), do))


def _check(function, dtype, backend, device) -> bool:
    def attend(q, k, v):
        return function.apply(q, k, v, True)

    name = f"{function.__name__} {str(dtype).removeprefix('torch.')} {backend}"
    q, k, v, do = (torch.randn(SHAPE, device=device, dtype=dtype) for _ in range(4))
    eager = _run(attend, q, k, v, do)
    torch.compiler.reset()
    try:
        explanation = torch._dynamo.explain(attend)(q, k, v)
        compiled = _run(torch.compile(attend, backend=backend), q, k, v, do)
    except Exception as error:  # report it and go on with the other cases
        print(f"{name}: FAILED {type(error).__name__}: {str(error)[:400]}")
        return False
    errors = {label: (got.float() - want.float()).abs().max().item()
              for label, got, want in zip(("o", "dq", "dk", "dv"), compiled, eager)}
    ok = all(error <= TOLERANCE[dtype] for error in errors.values())
    print(f"{name}: {explanation.graph_count} graph(s), {explanation.graph_break_count} break(s); "
          "largest |compiled - eager|: " + ", ".join(f"{label} {error:.2e}" for label, error in errors.items())
          + ("" if ok else "  MISMATCH"))
    return ok


def main() -> int:
    on_gpu = torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    functions = ([FlashAttentionTriton] if on_gpu else []) + [FlashAttentionPytorch]
    dtypes = (torch.float32, torch.bfloat16) if on_gpu else (torch.float32,)
    results = [_check(function, dtype, backend, device)
               for function in functions for dtype in dtypes for backend in BACKENDS]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
