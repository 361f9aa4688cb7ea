"""Where the host's time to issue one FlashAttention forward+backward goes: the Triton Function and the
torch.library op as shipped, the same with every kernel launch skipped (our Python and autograd alone), an
autograd.Function that only allocates the outputs (what autograd charges any Python Function), and, on a
GPU, SDPA's flash and cuDNN backends.

    python scripts/flash_host_costs.py                      # on a GPU: 4 x 32 x 512 x 80, bf16
    python scripts/flash_host_costs.py --shape 4 32 16 80   # without one: the launch-free rows only

On a GPU every path's calls are timed against a busy device, the paths taking turns
(cs336_systems.timing.issue_times), as the flash report's host-issue table is; without one, each whole
call by cs336_systems.timing.time_fn on fp16 CPU tensors, and the kernels are never launched. Medians
in us.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from cs336_systems.attention.flash_triton import launch
from cs336_systems.attention.flash_triton.op import FlashAttentionTriton, flash_attention_forward
from cs336_systems.timing import issue_times, time_fn


class AllocatingFunction(torch.autograd.Function):
    """Allocates what the Function returns and saves what it saves, and launches nothing."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal):
        ctx.save_for_backward(q, k, v)
        return q.new_empty(q.shape)

    @staticmethod
    def backward(ctx, do):
        q, k, v = ctx.saved_tensors
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), None


@contextlib.contextmanager
def launches_skipped():
    """Every kernel launch of launch.py skipped, what is left being the host work around the kernels. On
    a GPU the kept launches are skipped (a call's first, which compiles, still runs); on a CPU, where
    nothing is compiled, the whole path's launches and device checks too, each kept as a launch that is
    never made."""
    saved = launch.KeptLaunch.__call__, launch._launch, launch.check_device, launch._on_device
    launch.KeptLaunch.__call__ = lambda self, *addresses: None
    if not torch.cuda.is_available():
        launch._launch = lambda call, grid, tensors, scalars, kept=None: kept.append(launch.KeptLaunch(None, grid, ()))
        launch.check_device = lambda q: None
        launch._on_device = lambda t: contextlib.nullcontext()
    try:
        yield
    finally:
        launch.KeptLaunch.__call__, launch._launch, launch.check_device, launch._on_device = saved


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs=4, metavar=("BATCH", "HEADS", "N", "D"))
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--samples", type=int, default=500)
    args = parser.parse_args(argv)
    if launch.INTERPRETED:
        parser.error("unset TRITON_INTERPRET: the interpreter's launches are not what is measured here")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = tuple(args.shape or ((4, 32, 512, 80) if device.type == "cuda" else (4, 32, 16, 80)))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    do = torch.randn(shape, device=device, dtype=dtype)

    def fwd_bwd(attend):
        return lambda: torch.autograd.grad(attend(), (q, k, v), do)

    function = fwd_bwd(lambda: FlashAttentionTriton.apply(q, k, v, True))
    op = fwd_bwd(lambda: flash_attention_forward(q, k, v, True)[0])
    sdpa = fwd_bwd(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    paths = {}  # label: (call, context it runs in)
    if device.type == "cuda":
        paths["Function"] = function, contextlib.nullcontext
        paths["op"] = op, contextlib.nullcontext
        paths["SDPA flash"] = sdpa, functools.partial(sdpa_kernel, SDPBackend.FLASH_ATTENTION)
        paths["SDPA cuDNN"] = sdpa, functools.partial(sdpa_kernel, SDPBackend.CUDNN_ATTENTION)
    paths["Function, launches skipped"] = function, launches_skipped
    paths["op, launches skipped"] = op, launches_skipped
    paths["autograd.Function that only allocates"] = (fwd_bwd(lambda: AllocatingFunction.apply(q, k, v, True)),
                                                      contextlib.nullcontext)
    if device.type == "cuda":
        timings = issue_times([call for call, _ in paths.values()], warmup=args.warmup, samples=args.samples,
                              device=device, contexts=[context for _, context in paths.values()])
    else:
        timings = []
        for call, context in paths.values():
            with context():
                timings.append(time_fn(call, warmup=args.warmup, steps=args.samples, device=device))
    rows = {label: t.median_ms * 1e3 for label, t in zip(paths, timings)}
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}; host time per forward+backward, {shape}, {dtype}, causal (median us)")
    for label, us in rows.items():
        print(f"  {label}: {us:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
