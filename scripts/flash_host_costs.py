"""Where the host's time to issue one FlashAttention forward+backward goes: the Triton Function and the
torch.library op as shipped (kept calls launched from C++), the Function with its kept calls launched from
Python, the same with every kernel launch skipped (our Python and autograd alone; for the op, also its
CUDA autograd Function called past the dispatcher, since CPU tensors take the autograd register_autograd
made), an autograd.Function that only allocates the outputs (what autograd charges any Python Function),
and, on a GPU, SDPA's flash and cuDNN backends.

    python scripts/flash_host_costs.py                      # on a GPU: 4 x 32 x 512 x 80, bf16
    python scripts/flash_host_costs.py --back-to-back       # on a GPU: 1 x 1 x 16 x 80, calls back to back
    python scripts/flash_host_costs.py --shape 4 32 16 80   # without one: the launch-free rows only

On a GPU every path's calls are timed against a busy device, the paths taking turns
(cs336_systems.timing.issue_times), as the flash report's host-issue table is: medians in us. With
--back-to-back, each path's calls run back to back instead, as in a training loop, timed by the host
clock (timeit: the best of BACK_TO_BACK_RUNS runs of --samples calls, us per call), on a shape whose
kernels take less time than the host does. Without a GPU, each whole call is timed by
cs336_systems.timing.time_fn on fp16 CPU tensors, and the kernels are never launched: medians in us.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
import timeit

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from cs336_systems.attention.flash_triton import launch
from cs336_systems.attention.flash_triton.op import FlashAttentionTriton, _CudaAutograd, flash_attention_forward
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
def python_launches():
    """Kept calls launched from Python (KeptForward, KeptBackward), as where the C++ extension is not built."""
    saved = launch._native, launch._keep_native
    launch._native, launch._keep_native = None, lambda *args: None
    try:
        yield
    finally:
        launch._native, launch._keep_native = saved


@contextlib.contextmanager
def launches_skipped():
    """Every kernel launch of launch.py skipped, what is left being the host work around the kernels, on
    the Python path. On a GPU the kept launches are skipped (a call's first, which compiles, still runs);
    on a CPU, where nothing is compiled, the whole path's launches and device checks too, each kept as a
    launch that is never made."""
    saved = launch.KeptLaunch.__call__, launch._launch, launch.check_device, launch._on_device
    launch.KeptLaunch.__call__ = lambda self, *addresses: None
    if not torch.cuda.is_available():
        launch._launch = (lambda call, grid, tensors, scalars, kept=None, described=None:
                          kept.append(launch.KeptLaunch(None, grid, (), (), (), 0)))
        launch.check_device = lambda q: None
        launch._on_device = lambda t: contextlib.nullcontext()
    try:
        with python_launches():
            yield
    finally:
        launch.KeptLaunch.__call__, launch._launch, launch.check_device, launch._on_device = saved


# timeit's habit: the best of a few runs is the run least disturbed by the rest of the machine.
BACK_TO_BACK_RUNS = 5


def back_to_back_us(call, context, warmup: int, calls: int) -> float:
    """Host time per call of `call` made `calls` times back to back inside `context`, in us (best run)."""
    with context():
        for _ in range(warmup):
            call()
        torch.cuda.synchronize()
        best_s = min(timeit.repeat(call, number=calls, repeat=BACK_TO_BACK_RUNS))
        torch.cuda.synchronize()
    return best_s / calls * 1e6


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs=4, metavar=("BATCH", "HEADS", "N", "D"))
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--samples", type=int, default=500)
    parser.add_argument("--back-to-back", action="store_true", help="time each path's calls back to back")
    args = parser.parse_args(argv)
    if launch.INTERPRETED:
        parser.error("unset TRITON_INTERPRET: the interpreter's launches are not what is measured here")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.back_to_back and device.type != "cuda":
        parser.error("--back-to-back times calls that launch kernels: it needs a GPU")
    gpu_shape = (1, 1, 16, 80) if args.back_to_back else (4, 32, 512, 80)
    shape = tuple(args.shape or (gpu_shape if device.type == "cuda" else (4, 32, 16, 80)))
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
        paths["Function, kept calls launched from Python"] = function, python_launches
        paths["SDPA flash"] = sdpa, functools.partial(sdpa_kernel, SDPBackend.FLASH_ATTENTION)
        paths["SDPA cuDNN"] = sdpa, functools.partial(sdpa_kernel, SDPBackend.CUDNN_ATTENTION)
    paths["Function, launches skipped"] = function, launches_skipped
    paths["op, launches skipped"] = op, launches_skipped
    paths["op's CUDA autograd Function, launches skipped"] = (fwd_bwd(lambda: _CudaAutograd.apply(q, k, v, True)[0]),
                                                            launches_skipped)
    paths["autograd.Function that only allocates"] = (fwd_bwd(lambda: AllocatingFunction.apply(q, k, v, True)),
                                                      contextlib.nullcontext)
    calls, contexts = [call for call, _ in paths.values()], [context for _, context in paths.values()]
    if args.back_to_back:
        us = [back_to_back_us(call, context, args.warmup, args.samples) for call, context in zip(calls, contexts)]
    elif device.type == "cuda":
        timings = issue_times(calls, warmup=args.warmup, samples=args.samples, device=device, contexts=contexts)
        us = [t.median_ms * 1e3 for t in timings]
    else:
        us = []
        for call, context in zip(calls, contexts):
            with context():
                us.append(time_fn(call, warmup=args.warmup, steps=args.samples, device=device).median_ms * 1e3)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    how = "back to back, best run" if args.back_to_back else "median"
    print(f"{name}, torch {torch.__version__}; host time per forward+backward, {shape}, {dtype}, causal ({how}, us)")
    for label, path_us in zip(paths, us):
        print(f"  {label}: {path_us:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
