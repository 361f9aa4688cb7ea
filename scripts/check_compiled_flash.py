"""Check that both FlashAttention Functions run under torch.compile (causal) and
give the eager results (output and gradients), per compile backend. Needs a CUDA GPU for the
Triton Function; prints one line per (Function, backend) and exits non-zero on a mismatch."""

import sys

import torch

from cs336_systems.attention.flash_pytorch import FlashAttentionPytorch
from cs336_systems.attention.flash_triton import FlashAttentionTriton

BACKENDS = ("aot_eager", "inductor")
SHAPE = (2, 4, 300, 64)  # batch, heads, tokens (no multiple of any tile), head dim


def _run(attend, q, k, v, do):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = attend(q, k, v)
    return (out, *torch.autograd.grad(out, (q, k, v), do))


def main() -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    functions = ([FlashAttentionTriton] if device == "cuda" else []) + [FlashAttentionPytorch]
    failed = False
    for function in functions:
        def attend(q, k, v):
            return function.apply(q, k, v, True)

        q, k, v, do = (torch.randn(SHAPE, device=device) for _ in range(4))
        eager = _run(attend, q, k, v, do)
        for backend in BACKENDS:
            torch._dynamo.reset()
            explanation = torch._dynamo.explain(attend)(q, k, v)
            compiled = _run(torch.compile(attend, backend=backend), q, k, v, do)
            errors = {name: (got - want).abs().max().item()
                      for name, got, want in zip(("o", "dq", "dk", "dv"), compiled, eager)}
            ok = all(error <= 1e-5 for error in errors.values())
            failed |= not ok
            print(f"{function.__name__} {backend}: {explanation.graph_count} graph(s), "
                  f"{explanation.graph_break_count} break(s); largest |compiled - eager|: "
                  + ", ".join(f"{name} {error:.2e}" for name, error in errors.items())
                  + ("" if ok else "  MISMATCH"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
