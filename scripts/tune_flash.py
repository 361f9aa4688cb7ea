"""Tune the FlashAttention-2 Triton kernels' tiles on this GPU: for each (head dim, dtype) class, time
every candidate launch shape of each kernel (forward, dK/dV, dQ) alone with triton.testing.do_bench
(median), check it against the current table's output, and print the fastest next to the current
entry of TILE_TABLE; then time the whole Function with those tiles against SDPA flash and cuDNN.

    python scripts/tune_flash.py --head-dims 64 --precisions bf16 --json tune.json
    python scripts/tune_flash.py --head-dims 80 --precisions bf16 --batch 4 --heads 32 --seq-len 2048 --descriptors

With --descriptors the candidates are each kernel's TMA tiles: its loop's tiles streamed through tensor
descriptors (the inputs here are contiguous, which descriptors can always stream), against the table's TMA
entry where it has one.

The space is bounded (about 30 shapes per kernel) and compiled ahead of the timing in worker
processes that share Triton's on-disk cache, so a class takes a minute or two on an H100.
TFLOP/s columns count the matmuls each kernel does (forward 2, dK/dV 4, dQ 3 per score tile),
causal halved, so they compare with the tensor cores' ceiling.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import torch
import torch.nn.functional as F
import triton
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

from cs336_systems.attention.flash_triton import FlashAttentionTriton
from cs336_systems.attention.flash_triton import launch as ft
from cs336_systems.attention.flash_triton.tiles import Tiles, head_dim_chunks, tiles_for
from cs336_systems.precision import Precision

KERNELS = ("forward", "dkdv", "dq")
MATMULS = {"forward": 2, "dkdv": 4, "dq": 3}
STAGES = (2, 3, 4)
# (rows a program owns, rows it steps over): the owned tile is a multiple of the step, which the
# causal loop split relies on. The small ones are for grids of one head or a few, where a program's
# latency is the time.
OWNED_STEPPED = {2: ((64, 32), (64, 64), (128, 32), (128, 64), (128, 128), (64, 16), (128, 16), (32, 32), (32, 16),
                     (16, 16)),
                 4: ((32, 32), (64, 32), (64, 64), (128, 32), (64, 16), (32, 16), (16, 16))}
# Warps per owned-row count: eight warps over fewer than 64 rows leave warps without rows of their own.
WARPS = {16: (1, 2), 32: (1, 2, 4), 64: (4, 8), 128: (4, 8)}
COMPILE_SEQ_LEN = 256  # compiling needs only the launch signature; a short sequence keeps it quick
# Largest absolute difference from the current table's output that a candidate may show: other tiles
# sum in another order (bf16 outputs round at 2^-8 of values up to ~10; fp32 runs tf32 dots).
CHECK_TOLERANCE = {torch.bfloat16: 2e-1, torch.float32: 1e-2}


def candidates(kernel: str, head_dim: int, dtype: torch.dtype) -> list[Tiles]:
    element_bytes = torch.finfo(dtype).bits // 8
    shapes = []
    for (owned, stepped), stages in itertools.product(OWNED_STEPPED[element_bytes], STAGES):
        if sum(head_dim_chunks(head_dim)) > 96 and owned * stepped > 128 * 64:
            continue  # two fp32 accumulators 128 columns wide of this size spill registers
        for warps in WARPS[owned]:
            if kernel == "dkdv":
                shapes.append(Tiles(block_m=stepped, block_n=owned, num_warps=warps, num_stages=stages))
            else:
                shapes.append(Tiles(block_m=owned, block_n=stepped, num_warps=warps, num_stages=stages))
    return shapes


def _inputs(shape, dtype, seed=0):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(shape, generator=generator, device="cuda", dtype=dtype) for _ in range(4)]


def _run_kernel(kernel: str, tiles: Tiles, q, k, v, do, is_causal: bool, prepared=None, descriptors: bool = False):
    """A call of one kernel alone on `tiles`: through pointer loads, or as TMA tiles (descriptor loads)."""
    tma = tiles if descriptors else None
    if kernel == "forward":
        return lambda: ft.launch_forward(q, k, v, is_causal, tiles, tma=tma)
    o, lse, delta = prepared
    if kernel == "dkdv":
        return lambda: ft.launch_dkdv(q, k, v, do, lse, delta, is_causal, tiles, tma=tma)
    return lambda: ft.launch_dq(q, k, v, o, do, lse, is_causal, tiles, tma=tma)


def _prepare(q, k, v, do, is_causal):
    tile_set = tiles_for(q.shape[-1], q.dtype)
    o, lse = ft.launch_forward(q, k, v, is_causal, tile_set.forward)
    return o, lse, ft.launch_dq(q, k, v, o, do, lse, is_causal, tile_set.dq)[1]


def _compile_one(job) -> str | None:
    """Compile (and run once at a short length) one candidate; an error message if it cannot run."""
    kernel, tiles, head_dim, precision, is_causal, descriptors = job
    q, k, v, do = _inputs((1, 1, COMPILE_SEQ_LEN, head_dim), Precision.named(precision).dtype)
    try:
        _run_kernel(kernel, tiles, q, k, v, do, is_causal, _prepare(q, k, v, do, is_causal), descriptors)()
        torch.cuda.synchronize()
    except Exception as error:  # out of shared memory or registers: the shape is dropped
        return f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
    return None


def tune_class(head_dim, precision, shape, is_causal, pool, rep_ms, descriptors=False) -> dict:
    dtype = Precision.named(precision).dtype
    batch_heads = shape[0] * shape[1]
    n = shape[2]
    score_elements = batch_heads * n * n / (2 if is_causal else 1)
    q, k, v, do = _inputs(shape, dtype)
    prepared = _prepare(q, k, v, do, is_causal)
    current = tiles_for(head_dim, dtype)
    reference = {name: _run_kernel(name, getattr(current, name), q, k, v, do, is_causal, prepared)()
                 for name in KERNELS}
    result = {"head_dim": head_dim, "precision": precision, "shape": list(shape), "is_causal": is_causal,
              "descriptors": descriptors, "kernels": {}}
    for kernel in KERNELS:
        shapes = candidates(kernel, head_dim, dtype)
        started = time.perf_counter()
        jobs = [(kernel, t, head_dim, precision, is_causal, descriptors) for t in shapes]
        errors = list(pool.map(_compile_one, jobs))
        compile_s = time.perf_counter() - started
        timed = []
        for tiles, error in zip(shapes, errors):
            entry = {"tiles": vars(tiles)}
            if error:
                timed.append(entry | {"error": error})
                continue
            fn = _run_kernel(kernel, tiles, q, k, v, do, is_causal, prepared, descriptors)
            got = fn()
            mismatch = max((a.float() - b.float()).abs().max().item()
                           for a, b in zip(got if isinstance(got, tuple) else (got,),
                                           reference[kernel] if isinstance(reference[kernel], tuple)
                                           else (reference[kernel],)))
            ms = triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")
            flops = 2 * MATMULS[kernel] * score_elements * head_dim
            timed.append(entry | {"ms": ms, "tflops": flops / ms / 1e9, "max_diff": mismatch,
                                  "matches": mismatch <= CHECK_TOLERANCE[dtype]})
        ok = sorted((t for t in timed if "ms" in t and t["matches"]), key=lambda t: t["ms"])
        table_entry = getattr(current, f"tma_{kernel}" if descriptors else kernel)
        now = next((t for t in timed if table_entry is not None and t["tiles"] == vars(table_entry)), None)
        result["kernels"][kernel] = {"compile_s": compile_s, "current": now, "best": ok[:5], "all": timed}
        print(f"  {kernel}: {len(shapes)} shapes compiled in {compile_s:.0f} s; "
              f"current {_fmt(now)}; best {_fmt(ok[0] if ok else None)}", flush=True)
    return result


def time_splits(head_dim, precision, shape, is_causal, split_keys, rep_ms) -> dict:
    """The forward on narrow tiles, whole and with its keys cut into runs of each of `split_keys`
    (launch_split_forward), against SDPA's forward (flash in bf16, efficient attention in fp32)."""
    dtype = Precision.named(precision).dtype
    q, k, v, _ = _inputs(shape, dtype)
    tile_set = tiles_for(head_dim, dtype)
    tiles = tile_set.narrow_forward or tile_set.forward
    whole = ft.launch_forward(q, k, v, is_causal, tiles)
    backend = SDPBackend.FLASH_ATTENTION if precision == "bf16" else SDPBackend.EFFICIENT_ATTENTION
    with sdpa_kernel(backend):  # entered once: at microseconds a call, entering it per call would show
        sdpa = triton.testing.do_bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=is_causal),
                                       warmup=25, rep=rep_ms, return_mode="median")
    times = {"sdpa": sdpa,
             "whole": triton.testing.do_bench(lambda: ft.launch_forward(q, k, v, is_causal, tiles), warmup=25,
                                              rep=rep_ms, return_mode="median")}
    for keys in split_keys:
        if keys % tiles.block_m:
            continue
        run = (lambda keys: lambda: ft.launch_split_forward(q, k, v, is_causal, tiles, keys))(keys)
        got = run()
        mismatch = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, whole))
        if mismatch > CHECK_TOLERANCE[dtype]:
            raise AssertionError(f"split forward with runs of {keys} keys differs by {mismatch}")
        times[f"split {keys}"] = triton.testing.do_bench(run, warmup=25, rep=rep_ms, return_mode="median")
    print("  forward (us): " + ", ".join(f"{name} {ms * 1e3:.1f}" for name, ms in times.items()), flush=True)
    return {"head_dim": head_dim, "precision": precision, "shape": list(shape), "tiles": vars(tiles),
            "split_forward_ms": times}


def _fmt(entry) -> str:
    if not entry or "ms" not in entry:
        return "-"
    t = entry["tiles"]
    return (f"{t['block_m']}x{t['block_n']} w{t['num_warps']} s{t['num_stages']} "
            f"{entry['ms']:.3f} ms ({entry['tflops']:.0f} TFLOP/s)")


def compare_whole(head_dim, precision, shape, is_causal, rep_ms) -> dict:
    """The Function forward, backward and forward+backward with the current table, and SDPA's backends."""
    dtype = Precision.named(precision).dtype
    q, k, v, do = (t.requires_grad_(i < 3) for i, t in enumerate(_inputs(shape, dtype, seed=1)))
    grads = [q, k, v]
    out = {}
    runners = {"triton": lambda: FlashAttentionTriton.apply(q, k, v, is_causal)}
    for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
        runners[name] = (lambda b: lambda: _sdpa(b, q, k, v, is_causal))(backend)
    for name, forward in runners.items():
        try:
            o = forward()
            out[name] = {
                "forward": triton.testing.do_bench(forward, warmup=25, rep=rep_ms, return_mode="median"),
                "backward": triton.testing.do_bench(lambda: o.backward(do, retain_graph=True), warmup=25,
                                                    rep=rep_ms, grad_to_none=grads, return_mode="median"),
                "forward_backward": triton.testing.do_bench(lambda: forward().backward(do), warmup=25, rep=rep_ms,
                                                            grad_to_none=grads, return_mode="median"),
            }
        except RuntimeError as error:
            out[name] = {"error": str(error).splitlines()[0][:120]}
        print(f"  {name}: " + ", ".join(f"{m} {t:.3f} ms" if isinstance(t, float) else t
                                        for m, t in out[name].items()), flush=True)
    return out


def _sdpa(backend, q, k, v, is_causal):
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--precisions", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp32"])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq-len", type=int, nargs="+", default=[16384])
    parser.add_argument("--fp32-seq-len", type=int, nargs="+", default=[8192], help="fp32 runs take longer; shorter N")
    parser.add_argument("--no-causal", action="store_true")
    parser.add_argument("--rep-ms", type=int, default=100)
    parser.add_argument("--workers", type=int, default=12)
    parser.add_argument("--skip-tuning", action="store_true", help="only time the Function against SDPA")
    parser.add_argument("--skip-whole", action="store_true", help="only time the kernels, not the Function")
    parser.add_argument("--split-keys", type=int, nargs="+",
                        help="time only the forward, whole and split into runs of these many keys")
    parser.add_argument("--descriptors", action="store_true",
                        help="tune each kernel's TMA tiles (descriptor loads) instead of its pointer-load tiles")
    parser.add_argument("--json", help="write every measurement here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("tuning needs a CUDA GPU")
    is_causal = not args.no_causal
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    results = []
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(args.workers, mp_context=context) as pool:
        for precision, head_dim in itertools.product(args.precisions, args.head_dims):
            for n in args.seq_len if precision == "bf16" else args.fp32_seq_len:
                shape = (args.batch, args.heads, n, head_dim)
                print(f"{precision} d={head_dim} shape {shape} causal={is_causal}", flush=True)
                if args.split_keys:
                    results.append(time_splits(head_dim, precision, shape, is_causal, args.split_keys, args.rep_ms))
                    continue
                entry = {} if args.skip_tuning else tune_class(head_dim, precision, shape, is_causal, pool,
                                                               args.rep_ms, args.descriptors)
                if not args.skip_whole:
                    entry["whole"] = compare_whole(head_dim, precision, shape, is_causal, args.rep_ms)
                results.append(entry)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
