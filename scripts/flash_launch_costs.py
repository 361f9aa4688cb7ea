"""Where the time of a short-sequence FlashAttention call goes: the host's cost per call of each
layer (the autograd Function, the launcher, the bare Triton launch) against SDPA's, and the GPU time
of the forward kernel per tile shape when batch x heads is 1, and of the split forward per run
length, from torch.profiler's kernel records.
Two more rows split a backward's host cost: SDPA's backward operator called directly (its launches
alone), and the backward of an identity autograd Function (what autograd costs any Function).

    python scripts/flash_launch_costs.py [--host-profile] [--bench-loop [--only]]

--host-profile adds cProfile's top functions (by own time) for the Function's forward and for
triton_backward (the autograd engine runs the Function's backward on a thread cProfile does not see).
--bench-loop runs do_bench's timing loop by hand for the forwards of a few one-head shapes: the host
time of each call inside that loop (between the L2 flush and the end event) next to the GPU-timed
samples, how far ahead of the GPU the host was, and how many samples came out over twice the 10th
percentile and how many of those followed a GPU wait for the host; --only stops there.
"""

from __future__ import annotations

import cProfile
import functools
import itertools
import pstats
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from cs336_systems.attention import flash_triton as ft

HOST_CALLS = 200
SEQ_LENS = (1024, 2048, 4096, 8192, 16384)
FORWARD_SHAPES = [ft.Tiles(m, n, w, s) for (m, n), w, s in itertools.product(
    ((64, 32), (64, 64), (128, 64), (128, 128)), (4, 8), (2, 3))]


class _Identity(torch.autograd.Function):
    """The cheapest Python autograd Function: its backward measures what autograd itself costs."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def host_us(fn) -> float:
    """Host time per call with the GPU kept busy far ahead, so no call waits for it."""
    fn()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(HOST_CALLS):
        fn()
    elapsed = time.perf_counter() - started
    torch.cuda.synchronize()
    return elapsed / HOST_CALLS * 1e6


def kernel_us(fn, name: str, calls: int = 20) -> float:
    """Median GPU time of the kernels whose name contains `name`, per call."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    times = sorted(e.device_time for e in prof.events() if name in e.name and e.device_time > 0)
    return times[len(times) // 2] if times else float("nan")


def host_profile(label: str, fn, top: int = 25) -> None:
    fn()
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(HOST_CALLS):
        fn()
    profiler.disable()
    torch.cuda.synchronize()
    print(f"{label}: cProfile over {HOST_CALLS} calls, by own time")
    pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(top)


def _quantiles(values) -> str:
    ordered = sorted(values)
    n = len(ordered)
    return f"p10 {ordered[n // 10]:.0f}, p50 {ordered[n // 2]:.0f}, p90 {ordered[9 * n // 10]:.0f}"


def bench_loop(fn, grads, iterations: int = 1500, skipped: int = 200) -> dict[str, list[float]]:
    """do_bench's loop (reset grads, flush L2, start event, call, end event), with one more event
    before the flush, timed from both sides, per iteration after the first `skipped` (us):

    - host: the call's host time, taken around it;
    - gpu: the GPU-timed sample (start event to end event);
    - flush: the GPU time of the L2 flush before it, which is how much host time the call can take
      without the GPU waiting for it, when the host is not ahead;
    - lead: how long before the GPU reached the start event the host had finished the call, on the
      host's clock (the GPU's events are placed on it through a reference event recorded on an idle
      GPU, so to within a few us). Negative: the GPU reached the start event first and the sample
      includes its wait for the host.
    """
    from triton import runtime

    flush = runtime.driver.active.get_empty_cache_for_benchmark()
    for _ in range(3):
        fn()
    befores, starts, ends = ([torch.cuda.Event(enable_timing=True) for _ in range(iterations)] for _ in range(3))
    reference = torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    reference.record()
    reference_host = time.perf_counter()
    host, done = [], []
    for before, start, end in zip(befores, starts, ends):
        for t in grads:
            t.grad = None
        before.record()
        runtime.driver.active.clear_cache(flush)
        start.record()
        began = time.perf_counter()
        fn()
        finished = time.perf_counter()
        host.append((finished - began) * 1e6)
        done.append((finished - reference_host) * 1e6)
        end.record()
    torch.cuda.synchronize()
    gpu = [start.elapsed_time(end) * 1e3 for start, end in zip(starts, ends)]
    flushed = [before.elapsed_time(start) * 1e3 for before, start in zip(befores, starts)]
    lead = [reference.elapsed_time(start) * 1e3 - at for start, at in zip(starts, done)]
    return {"host": host[skipped:], "gpu": gpu[skipped:], "flush": flushed[skipped:], "lead": lead[skipped:]}


def print_bench_loops() -> None:
    print("do_bench's loop by hand, bf16 causal forward, batch 1 x 1 head (us); lead: how far ahead of the "
          "GPU the host finished each call (negative: the GPU waited for it):")
    for d, n in ((64, 1024), (128, 1024), (64, 2048)):
        q, k, v = (torch.randn(1, 1, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            for label, fn in (("Function", lambda: ft.FlashAttentionTriton.apply(q, k, v, True)),
                              ("triton_forward", lambda: ft.triton_forward(q, k, v, True)),
                              ("F.sdpa (flash)", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))):
                loop = bench_loop(fn, (q, k, v))
                gpu = loop["gpu"]
                cut = 2 * sorted(gpu)[len(gpu) // 10]
                slow = [i for i, g in enumerate(gpu) if g > cut]
                waited = sum(lead < 0 for lead in loop["lead"])
                slow_waited = sum(loop["lead"][i] < 0 for i in slow)
                print(f"  d={d} N={n} {label:15s} host {_quantiles(loop['host'])}; GPU-timed {_quantiles(gpu)}; "
                      f"flush {_quantiles(loop['flush'])}; lead {_quantiles(loop['lead'])}; "
                      f"GPU waited in {waited} of {len(gpu)}; {len(slow)} samples over {cut:.0f}, "
                      f"{slow_waited} of them after a wait")


def main() -> None:
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    if "--bench-loop" in sys.argv:
        print_bench_loops()
        if "--only" in sys.argv:
            return
    for d in (64, 128):
        q, k, v, do = (torch.randn(1, 1, 1024, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        for t in (q, k, v):
            t.requires_grad_()
        out = ft.FlashAttentionTriton.apply(q, k, v, True)
        tiles = ft.tiles_for(d, q.dtype)
        o4, lse = ft.launch_forward(q, k, v, True, tiles.forward)
        delta = ft.launch_dq(q, k, v, o4, do, lse, True, tiles.dq)[1]
        identity_out = _Identity.apply(q)

        def sdpa():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        sdpa_out = sdpa()
        flash = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)
        sdpa_backward_op = functools.partial(torch.ops.aten._scaled_dot_product_flash_attention_backward,
                                             do, q, k, v, flash[0], flash[1], *flash[2:6], 0.0, True, *flash[6:8])
        # Triton's own JIT launch of the forward kernel, which launch_forward makes only on a key's first call.
        jit_grid = (-(-1024 // tiles.forward.block_m),)
        jit_args = (q, k, v, o4, lse, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o4.stride()[:3],
                    1, 1024, 1024, ft._scales(d)[0])
        jit_options = ft._launch_options(d, True, tiles.forward)
        layers = {
            "Function.apply forward": lambda: ft.FlashAttentionTriton.apply(q, k, v, True),
            "triton_forward": lambda: ft.triton_forward(q, k, v, True),
            "launch_forward": lambda: ft.launch_forward(q, k, v, True, tiles.forward),
            "Triton JIT launch (no allocations)": lambda: ft._forward_kernel[jit_grid](*jit_args, **jit_options),
            "launch_dq (writes D)": lambda: ft.launch_dq(q, k, v, o4, do, lse, True, tiles.dq),
            "launch_dkdv": lambda: ft.launch_dkdv(q, k, v, do, lse, delta, True, tiles.dkdv),
            "triton_backward": lambda: ft.triton_backward(q, k, v, o4, lse, do, True),
            "Function backward (autograd)": lambda: out.backward(do, retain_graph=True),
            "sdpa flash forward": sdpa,
            "F.scaled_dot_product_attention (flash)": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            "sdpa flash backward": lambda: sdpa_out.backward(do, retain_graph=True),
            "sdpa flash backward op (no autograd)": sdpa_backward_op,
            "identity Function backward (autograd)": lambda: identity_out.backward(do, retain_graph=True),
        }
        print(f"d={d}, host time per call (us):")
        for label, fn in layers.items():
            print(f"  {label:36s} {host_us(fn):8.1f}")
        if "--host-profile" in sys.argv and d == 64:
            host_profile("Function forward", layers["Function.apply forward"])
            host_profile("triton_backward", layers["triton_backward"])
    print("forward kernel GPU time (us), batch 1 x 1 head, causal, bf16:")
    for d, n in itertools.product((64, 128), SEQ_LENS):
        q, k, v = (torch.randn(1, 1, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            reference = kernel_us(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), "flash")
        times = []
        for tiles in FORWARD_SHAPES:
            try:
                times.append((kernel_us(lambda: ft.launch_forward(q, k, v, True, tiles), "_forward_kernel"), tiles))
            except Exception:  # a shape that does not fit this head dim
                continue
        times.sort(key=lambda t: t[0])
        best = ", ".join(f"{t.block_m}x{t.block_n} w{t.num_warps} s{t.num_stages}: {us:.1f}" for us, t in times[:4])
        table = ft.tiles_for(d, torch.bfloat16).forward
        current = next((us for us, t in times if t == table), float("nan"))
        print(f"  d={d} N={n}: sdpa flash {reference:.1f}; table {current:.1f}; best {best}")
        narrow = ft.tiles_for(d, torch.bfloat16).narrow_forward
        runs = [keys for keys in (2**p for p in range(6, 14)) if keys % narrow.block_m == 0 and keys < n]
        split = ", ".join(
            f"{keys}: {kernel_us(lambda: ft.launch_split_forward(q, k, v, True, narrow, keys), '_split_forward'):.1f}"
            for keys in runs)
        print(f"    split forward on {narrow.block_m}x{narrow.block_n} tiles, by keys per run: {split} "
              f"(taken: {ft.forward_split_keys(narrow, n, n, True)})")


if __name__ == "__main__":
    main()
