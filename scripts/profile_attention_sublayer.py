"""Where a compiled attention sublayer's time goes, kernel by kernel, with each attention: one
CausalSelfAttention of a model size (the q, k, v and output projections, RoPE and the attention) under
torch.compile(fullgraph=True), forward and backward, at batch x context, bf16.

    python scripts/profile_attention_sublayer.py --size xl --batch 4 --context 512 2048

For each context and attention it prints the sublayer's median time (CUDA events, one synchronisation a
step) and its spread, then every CUDA kernel torch.profiler saw in the profiled steps, by time a step, and
the strides of the q and o the attention took and gave while the compiler traced it: whether merging o's
heads for the output projection is a view or a copy.
"""

from __future__ import annotations

import argparse
import sys

import torch

from cs336_systems.model import CausalSelfAttention, ModelConfig
from cs336_systems.profiling.kernels import RangeTable, device_profile, kernel_tables
from cs336_systems.profiling.ranges import annotate
from cs336_systems.timing import time_fn

ATTENTIONS = ("sdpa", "flash_triton")


def traced_layouts(module: CausalSelfAttention) -> list[str]:
    """Wraps the module's attention so that a traced call notes the strides it takes and gives."""
    seen: list[str] = []
    attend = module.attention

    def noting(q, k, v, is_causal):
        o = attend(q, k, v, is_causal=is_causal)
        if not seen:
            seen.append(f"q {tuple(q.stride())}, k {tuple(k.stride())}, v {tuple(v.stride())} -> o {tuple(o.stride())}")
        return o

    module.attention = noting
    return seen


def kernel_table(step, steps: int) -> RangeTable:
    """The kernels `steps` profiled steps ran, longest first (totals over all the steps)."""
    with device_profile("cuda") as profiler:
        for _ in range(steps):
            with annotate("step"):
                step()
        torch.cuda.synchronize()
    return kernel_tables(profiler.events(), "cuda", ranges=["step"])["step"]


def profile_one(size: str, batch: int, context: int, attention: str, steps: int) -> None:
    torch.manual_seed(0)
    config = ModelConfig.for_size(size, context)
    module = CausalSelfAttention(config, attention).to("cuda", torch.bfloat16)
    layouts = traced_layouts(module)
    compiled = torch.compile(module, fullgraph=True)
    x = torch.randn(batch, context, config.d_model, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)

    def step():
        compiled(x).backward(grad)

    timings = time_fn(step, warmup=5, steps=steps, device="cuda")  # the warm-up compiles
    print(f"\n## {size}, batch {batch}, context {context}, {attention}: {timings.median_ms:.3f} ms a step "
          f"(IQR {timings.iqr_ms:.3f}, {steps} steps)")
    print(f"traced: {layouts[0] if layouts else 'no call seen'}")
    profiled = 5
    table = kernel_table(step, profiled)
    print(f"kernels, us a step (sum {table.work_us / profiled:.0f}):")
    for k in table.kernels:
        print(f"  {k.total_us / profiled:9.1f}  x{k.calls // profiled:<3d} {k.name[:150]}")
    torch.compiler.reset()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="xl")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--context", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for context in args.context:
        for attention in ATTENTIONS:
            profile_one(args.size, args.batch, context, attention, args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
