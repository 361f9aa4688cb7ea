"""What limits each FlashAttention-2 Triton kernel at one shape: time every kernel (forward, dQ, dK/dV) alone
with the launch plan the Function takes there, give its achieved TFLOP/s against a bf16 matmul measured in
the same run, and what Triton compiled it to (registers, spills, shared memory, whether its dots are
Hopper's warpgroup MMA). SDPA's cuDNN backend runs beside them, forward and backward, as the reference.

    python scripts/profile_flash.py --batch 4 --heads 32 --head-dim 80 --seq-len 512 2048

With --profile each kernel is launched once more between cudaProfilerStart and Stop, for Nsight Compute:

    ncu --profile-from-start off --clock-control none --section SpeedOfLight --section WarpStateStats \\
        --csv --page details python scripts/profile_flash.py --profile --seq-len 2048

TFLOP/s count the matmuls each kernel does (forward 2, dK/dV 4, dQ 3 per score tile), causal halved, as
scripts/tune_flash.py does.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
import triton
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

from cs336_systems.attention.flash_triton import launch as ft
from cs336_systems.attention.flash_triton import plan_for
from cs336_systems.attention.flash_triton.launch import LaunchPlan

MATMULS = {"forward": 2, "dkdv": 4, "dq": 3}
MATMUL_SIDE = 8192  # the ceiling's matmul: bf16, square, large enough to run at the tensor cores' pace


def _inputs(shape, dtype):
    generator = torch.Generator(device="cuda").manual_seed(0)
    return [torch.randn(shape, generator=generator, device="cuda", dtype=dtype) for _ in range(4)]


def kernel_runs(q, k, v, do, is_causal: bool) -> tuple[dict, LaunchPlan]:
    """Per kernel, a call that launches it alone on the Function's plan for these inputs (its TMA tiles and
    descriptor loads where the plan has them: these inputs are contiguous); and that plan."""
    plan = plan_for(q, k, is_causal)
    if plan.forward.split_keys is not None:
        raise SystemExit("this shape takes the split forward; profile a grid that fills the GPU")
    tma = plan.tma
    o, lse = ft.launch_forward(q, k, v, is_causal, plan.forward.tiles, tma=tma["forward"])
    _, delta = ft.launch_dq(q, k, v, o, do, lse, is_causal, plan.dq, tma=tma["dq"])
    return {"forward": lambda: ft.launch_forward(q, k, v, is_causal, plan.forward.tiles, tma=tma["forward"]),
            "dq": lambda: ft.launch_dq(q, k, v, o, do, lse, is_causal, plan.dq, tma=tma["dq"]),
            "dkdv": lambda: ft.launch_dkdv(q, k, v, do, lse, delta, is_causal, plan.dkdv, tma=tma["dkdv"])}, plan


def cudnn_forward_backward(q, k, v, do, is_causal: bool):
    """SDPA's cuDNN forward and backward on copies of the inputs that require grad."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))

    def run():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=is_causal), (q, k, v), do)
    return run


def compiled_kernels() -> dict:
    """The kept compiled kernels by kernel name (the launch key's call names its JIT function)."""
    names = {jit: name for name, jit in ft.KERNELS.items()}
    return {names[key[0].kernel]: compiled for key, compiled in ft._kept_kernels.items()}


def describe(compiled) -> str:
    ptx = compiled.asm.get("ptx", "")
    return (f"{compiled.n_regs} regs, {compiled.n_spills} spills, {compiled.metadata.shared} B shared, "
            f"{ptx.count('wgmma.mma_async')} wgmma / {ptx.count('mma.sync')} mma.sync in PTX")


def matmul_ceiling(rep_ms: int) -> float:
    a, b = (torch.randn(MATMUL_SIDE, MATMUL_SIDE, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ms = triton.testing.do_bench(lambda: a @ b, warmup=25, rep=rep_ms, return_mode="median")
    return 2 * MATMUL_SIDE**3 / ms / 1e9


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=80)
    parser.add_argument("--seq-len", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--no-causal", action="store_true")
    parser.add_argument("--rep-ms", type=int, default=100)
    parser.add_argument("--profile", action="store_true", help="launch each kernel once for a profiler, untimed")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("profiling the kernels needs a CUDA GPU")
    is_causal = not args.no_causal
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    ceiling = None if args.profile else matmul_ceiling(args.rep_ms)
    if ceiling:
        print(f"bf16 matmul {MATMUL_SIDE}^3: {ceiling:.0f} TFLOP/s")
    for n in args.seq_len:
        shape = (args.batch, args.heads, n, args.head_dim)
        q, k, v, do = _inputs(shape, torch.bfloat16)
        runs, plan = kernel_runs(q, k, v, do, is_causal)
        cudnn = cudnn_forward_backward(q, k, v, do, is_causal)
        for run in (*runs.values(), cudnn):
            run()
        torch.cuda.synchronize()
        print(f"shape {shape} causal={is_causal}")
        if args.profile:
            torch.cuda.cudart().cudaProfilerStart()
            for run in (*runs.values(), cudnn):
                run()
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
            continue
        scores = args.batch * args.heads * n * n / (2 if is_causal else 1)
        compiled = compiled_kernels()
        total = 0.0
        for name, run in runs.items():
            ms = triton.testing.do_bench(run, warmup=25, rep=args.rep_ms, return_mode="median")
            total += ms
            tflops = 2 * MATMULS[name] * scores * args.head_dim / ms / 1e9
            tiles = plan.tma[name] or (plan.forward.tiles if name == "forward" else getattr(plan, name))
            loads = "descriptors" if plan.tma[name] else "pointers"
            print(f"  {name}: {tiles.block_m}x{tiles.block_n} w{tiles.num_warps} s{tiles.num_stages} ({loads}), "
                  f"{ms:.4f} ms, {tflops:.0f} TFLOP/s ({tflops / ceiling:.0%} of the matmul's); "
                  f"{describe(compiled[name])}")
        cudnn_ms = triton.testing.do_bench(cudnn, warmup=25, rep=args.rep_ms, return_mode="median")
        print(f"  sum {total:.4f} ms; cuDNN forward+backward (host issue included) {cudnn_ms:.4f} ms")
        ft._kept_kernels.clear()  # the next shape's kernels, by name, alone
    return 0


if __name__ == "__main__":
    sys.exit(main())
