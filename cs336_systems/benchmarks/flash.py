"""Problem flash_benchmarking: FlashAttention-2 in Triton against naive PyTorch attention and PyTorch
SDPA, forward, backward and forward+backward; and the 2025 leaderboard's attention cell, one kernel
on one GPU (the 2026 leaderboard times a whole training step of an 8B-class model on two GPUs instead).

    rows = benchmark_flash_cell(FlashCell(seq_len=4096, head_dim=64, precision="bf16"), PROVIDERS, "cuda")
    rows = leaderboard_2025_cell("cuda")
    rows = host_issue("cuda")

Inputs are (batch, heads, N, d) random normal tensors, causal. Timing is triton.testing.do_bench on a
GPU: after a first call and a five-call estimate, `warmup_ms` of untimed calls then `rep_ms` of
calls each timed with CUDA events, the L2 cache flushed before every one; we keep every sample and
report the median with the 20th and 80th percentiles. On a CPU (the Triton interpreter), where
do_bench's CUDA events do not exist, the host clock times a few calls (cs336_systems.timing).

Backward is timed alone: the closure calls o.backward(dO, retain_graph=True) on the output of one
forward run beforehand, so each sample holds exactly the backward's kernels (the gradients are
reset to None between samples, outside the timed region, so none accumulates). Forward+backward
times a closure that runs both.

Naive attention materialises N x N matrices: before running it, its predicted peak
(cs336_systems.accounting.attention) is compared with the free device memory, and a cell that
would not fit is recorded as OOM (oom_predicted) without running. Any cell that runs out of memory
anyway is recorded as OOM too, and the sweep goes on.

Host issue time (`host_issue`): the host's time to issue one forward+backward (torch.autograd.grad of
the output), the GPU kept busy beforehand so that nothing waits for it (cs336_systems.timing.issue_times),
for the Triton Function, the torch.library op and SDPA's flash and cuDNN backends, by the same method in
one run.

SDPA runs under torch.nn.attention.sdpa_kernel with one backend pinned, named in the rows:
"sdpa" takes the first of FLASH_ATTENTION, EFFICIENT_ATTENTION, MATH that accepts the inputs (flash
has no fp32 kernel, so fp32 gets EFFICIENT_ATTENTION on a GPU); "sdpa_flash" and "sdpa_cudnn" pin
FLASH_ATTENTION and CUDNN_ATTENTION and are "unsupported" where that backend refuses the inputs.
"""

from __future__ import annotations

import statistics
import warnings
from collections import defaultdict
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from cs336_systems.accounting.attention import attention_flops, naive_attention_memory
from cs336_systems.attention.reference import naive_attention
from cs336_systems.benchmarks.harness import guarded_cell, release_memory
from cs336_systems.checks import check_positive_int
from cs336_systems.memory_guard import check_memory, oom_columns
from cs336_systems.precision import Precision, check_precision
from cs336_systems.reports import (
    NOISY,
    OOM,
    Rendered,
    Reports,
    Row,
    format_ms,
    is_noisy,
    markdown_table,
    not_in_report,
    ok_rows,
    oom_text,
    select,
)
from cs336_systems.timing import issue_times, time_fn

SEQ_LENS = tuple(2**p for p in range(7, 17))  # 128 ... 65536
HEAD_DIMS = (16, 32, 64, 128)
PRECISIONS = ("bf16", "fp32")
MODES = ("forward", "backward", "forward_backward")
PROVIDERS = ("flash_triton", "naive", "sdpa")
UNSUPPORTED = "unsupported"
SDPA_BACKEND_ORDER = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)
PINNED_SDPA = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}

@dataclass(frozen=True)
class BenchSettings:
    warmup_ms: int = 25  # do_bench, GPU
    rep_ms: int = 100
    cpu_warmup: int = 1  # host clock, CPU
    cpu_steps: int = 3


@dataclass(frozen=True)
class FlashCell:
    seq_len: int
    head_dim: int
    precision: str
    batch_size: int = 1
    n_heads: int = 1
    is_causal: bool = True

    def __post_init__(self):
        check_positive_int(seq_len=self.seq_len, head_dim=self.head_dim, batch_size=self.batch_size,
                           n_heads=self.n_heads)
        check_precision(self.precision)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.batch_size, self.n_heads, self.seq_len, self.head_dim)

    def flops(self, mode: str) -> float:
        return attention_flops(self.batch_size * self.n_heads, self.seq_len, self.head_dim, self.is_causal, mode)


# The 2025 leaderboard's attention configuration and what it is compared with: one kernel cell on one GPU. Its
# rows keep the table name "leaderboard".
LEADERBOARD_2025_CELL = FlashCell(seq_len=16384, head_dim=64, precision="bf16", n_heads=16)
LEADERBOARD_2025_PROVIDERS = ("flash_triton_compiled", "flash_triton", "sdpa_flash", "sdpa_cudnn")
COMPILED_PROVIDERS = ("flash_triton_compiled",)
PROVIDER_LABELS = {"flash_triton": "triton", "flash_triton_compiled": "triton (compiled)",
                   "flash_triton_op": "triton (torch.library op)", "naive": "naive", "sdpa": "sdpa",
                   "sdpa_flash": "sdpa flash", "sdpa_cudnn": "sdpa cuDNN"}


# ---------------------------------------------------------------------------------------- providers

def _sdpa_runs(backend: SDPBackend, q, k, v, is_causal: bool) -> bool:
    """Whether `backend` accepts these inputs: SDPA raises when the pinned backend cannot run them."""
    try:
        with warnings.catch_warnings(), sdpa_kernel(backend):
            warnings.simplefilter("ignore")  # the refusal's warnings repeat the reason the row records
            F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    except RuntimeError:
        return False
    return True


def _provider(name: str, q, k, v, is_causal: bool) -> tuple[Callable[[], torch.Tensor] | None, SDPBackend | None]:
    """(forward closure, SDPA backend to pin); a None closure means the SDPA backend refuses the inputs."""
    if name == "flash_triton":
        from cs336_systems.attention.flash_triton import FlashAttentionTriton

        return (lambda: FlashAttentionTriton.apply(q, k, v, is_causal)), None
    if name == "flash_triton_op":
        from cs336_systems.attention.flash_triton import flash_attention_forward

        return (lambda: flash_attention_forward(q, k, v, is_causal)[0]), None
    if name == "flash_triton_compiled":
        from cs336_systems.attention.flash_triton import flash_attention_triton

        compiled = torch.compile(flash_attention_triton)
        return (lambda: compiled(q, k, v, is_causal)), None
    if name == "naive":
        return (lambda: naive_attention(q, k, v, is_causal)), None
    if name == "sdpa" or name in PINNED_SDPA:
        backends = SDPA_BACKEND_ORDER if name == "sdpa" else (PINNED_SDPA[name],)
        backend = next((b for b in backends if _sdpa_runs(b, q, k, v, is_causal)), None)
        if backend is None:
            return None, backends[0]
        return (lambda: F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)), backend
    raise ValueError(f"unknown provider {name!r}; choose one of {', '.join(PROVIDER_LABELS)}")


# ------------------------------------------------------------------------------------------- timing

def _bench(fn: Callable[[], object], grads: tuple[torch.Tensor, ...], device: torch.device,
           settings: BenchSettings) -> Row:
    """Median and 20th/80th percentiles of `fn`'s time in ms; `grads` are reset to None before each call."""
    if device.type == "cuda":
        import triton.testing

        samples = triton.testing.do_bench(fn, warmup=settings.warmup_ms, rep=settings.rep_ms,
                                          grad_to_none=list(grads), return_mode="all")
        timer = f"do_bench (warm-up {settings.warmup_ms} ms, repetition {settings.rep_ms} ms)"
    else:
        def call() -> None:
            for t in grads:
                t.grad = None
            fn()

        samples = time_fn(call, warmup=settings.cpu_warmup, steps=settings.cpu_steps, device=device).samples_ms
        timer = f"host clock ({settings.cpu_warmup} warm-up, {settings.cpu_steps} timed calls)"
    return {**_spread(samples), "timer": timer}


def _spread(samples) -> Row:
    """The median and 20th/80th percentiles of samples in ms, and their count."""
    series = torch.tensor(samples, dtype=torch.float64)
    p20, p80 = series.quantile(torch.tensor([0.2, 0.8], dtype=torch.float64)).tolist()
    return {"median_ms": statistics.median(samples), "p20_ms": p20, "p80_ms": p80, "samples": len(samples)}


def _bench_mode(mode: str, forward: Callable[[], torch.Tensor], inputs: tuple[torch.Tensor, ...],
                grad_out: torch.Tensor, device: torch.device, settings: BenchSettings) -> Row:
    if mode == "forward":
        return _bench(forward, inputs, device, settings)
    if mode == "backward":
        out = forward()
        return _bench(lambda: out.backward(grad_out, retain_graph=True), inputs, device, settings)
    if mode == "forward_backward":
        return _bench(lambda: forward().backward(grad_out), inputs, device, settings)
    raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")


def _naive_fits(cell: FlashCell, device: torch.device) -> tuple[bool, int, int]:
    """(whether naive attention's predicted peak fits in the free memory, that peak, the free bytes)."""
    memory = naive_attention_memory(cell.batch_size * cell.n_heads, cell.seq_len, cell.seq_len, cell.head_dim,
                                    cell.precision, cell.is_causal)
    # q, k, v and dO are allocated already, so they are not part of what must still fit. The memory
    # guard's margin also covers do_bench's 256 MB L2-flush buffer.
    check = check_memory(memory.peak_bytes - memory.caller_bytes, device)
    return check.fits, memory.peak_bytes, check.available_bytes


def _cell_row(cell: FlashCell, provider: str, mode: str, device: torch.device) -> Row:
    from cs336_systems.attention.flash_triton import source_hash

    return {"table": "sweep", "provider": provider, "backend": None, "precision": cell.precision,
            "batch_size": cell.batch_size, "n_heads": cell.n_heads, "seq_len": cell.seq_len,
            "head_dim": cell.head_dim, "is_causal": cell.is_causal, "mode": mode, "device": device.type,
            "status": None, "oom_predicted": None, "median_ms": None, "p20_ms": None, "p80_ms": None,
            "samples": None, "timer": None, "tflops": None, "predicted_peak_bytes": None,
            "free_memory_bytes": None, "fp32_matmul_precision": torch.get_float32_matmul_precision(),
            "source_hash": source_hash()}


def _inputs(cell: FlashCell, device: torch.device) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    generator = torch.Generator(device=device).manual_seed(0)

    def randn(requires_grad: bool) -> torch.Tensor:
        return torch.randn(cell.shape, generator=generator, device=device, dtype=Precision.named(cell.precision).dtype,
                           requires_grad=requires_grad)

    return (randn(True), randn(True), randn(True)), randn(False)


def benchmark_flash_cell(cell: FlashCell, providers=PROVIDERS, device: torch.device | str = "cuda",
                         modes=MODES, settings: BenchSettings = BenchSettings()) -> list[Row]:
    """One row per (provider, mode): status ok / OOM / unsupported, times, TFLOP/s."""
    device = torch.device(device)
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
    for provider in providers:
        if provider not in PROVIDER_LABELS:
            raise ValueError(f"unknown provider {provider!r}; choose one of {', '.join(PROVIDER_LABELS)}")
        if provider in COMPILED_PROVIDERS and "backward" in modes:
            raise ValueError(f"{provider}: backward alone cannot be timed; a compiled backward refuses "
                             "retain_graph=True (its buffers are donated), so time forward_backward")
    inputs, grad_out = _inputs(cell, device)
    rows = []
    for provider in providers:
        base = [_cell_row(cell, provider, mode, device) for mode in modes]
        if provider == "naive":
            fits, peak_bytes, free_bytes = _naive_fits(cell, device)
            for row in base:
                row |= {"predicted_peak_bytes": peak_bytes, "free_memory_bytes": free_bytes}
            if not fits:
                rows += [{**row, **oom_columns(True)} for row in base]
                continue
        forward, backend = _provider(provider, *inputs, cell.is_causal)
        for row in base:
            row["backend"] = None if backend is None else backend.name
        if forward is None:
            rows += [{**row, "status": UNSUPPORTED} for row in base]
            continue
        rows += [_guarded_mode(cell, row, forward, backend, inputs, grad_out, device, settings) for row in base]
    return rows


def _guarded_mode(cell: FlashCell, row: Row, forward: Callable[[], torch.Tensor], backend: SDPBackend | None,
                  inputs: tuple[torch.Tensor, ...], grad_out: torch.Tensor, device: torch.device,
                  settings: BenchSettings) -> Row:
    """`row`'s mode timed, with its TFLOP/s, or OOM where it runs out of memory; the inputs' gradients
    are dropped after it, so that every mode starts without them."""
    def measure(columns: Row) -> Row:
        with sdpa_kernel(backend) if backend is not None else nullcontext():
            stats = _bench_mode(row["mode"], forward, inputs, grad_out, device, settings)
        tflops = cell.flops(row["mode"]) / (stats["median_ms"] * 1e-3) / 1e12
        return {**row, **stats, "status": "ok", "tflops": tflops}

    def drop_gradients() -> None:
        for t in inputs:
            t.grad = None

    return guarded_cell(device, None, measure, oom=lambda columns: {**row, **columns}, let_go=drop_gradients)


def leaderboard_2025_cell(device: torch.device | str = "cuda", settings: BenchSettings = BenchSettings()) -> list[Row]:
    """The 2025 leaderboard's attention cell, forward+backward, for each of LEADERBOARD_2025_PROVIDERS."""
    torch.compiler.reset()  # compile the Triton Function afresh, with no earlier graphs in dynamo's caches
    rows = benchmark_flash_cell(LEADERBOARD_2025_CELL, LEADERBOARD_2025_PROVIDERS, device, ("forward_backward",),
                                settings)
    return [{**row, "table": "leaderboard"} for row in rows]


# The speed-up gates: the longest sequence at the head dim of most models, bf16, forward+backward, where
# the kernels take milliseconds. Shorter ones are not gated: at batch 1 x 1 head their time includes the
# host's launch overhead, which moves by more than a gate's tolerance from run to run.
GATE_CELL = FlashCell(seq_len=65536, head_dim=64, precision="bf16")
# The least ratio of each gated provider's time over Triton's that the gate promises at GATE_CELL. Naive
# attention writes and reads the N x N scores and probabilities (8 GiB each in bf16) where the kernels keep
# them on chip: on an H100 it took 19.4x Triton's time, and half that lead is promised. SDPA's
# FlashAttention-2 took 1.42x Triton's time there: Triton is promised to be no slower.
GATE_PROMISES = {"naive": 10.0, "sdpa_flash": 1.0}
GATED_PROVIDERS = tuple(GATE_PROMISES)


def gate(device: torch.device | str = "cuda", settings: BenchSettings = BenchSettings()) -> list[Row]:
    """The gated cell's rows: Triton and the providers whose time over Triton's is gated."""
    rows = benchmark_flash_cell(GATE_CELL, ("flash_triton", *GATED_PROVIDERS), device, ("forward_backward",), settings)
    return [{**row, "table": "gate"} for row in rows]


# Host issue time per forward+backward at: a training shape (the 2026 xl's attention at batch 4, context
# 512: wide tiles), 16 heads at N 1024 (on an H100, narrow tiles and the split forward, which allocates and
# launches once more), and the 2025 leaderboard's grid.
HOST_ISSUE_CELLS = (FlashCell(512, 80, "bf16", batch_size=4, n_heads=32), FlashCell(1024, 64, "bf16", n_heads=16),
                    LEADERBOARD_2025_CELL)
HOST_ISSUE_PROVIDERS = ("flash_triton", "flash_triton_op", "sdpa_flash", "sdpa_cudnn")
# Untimed calls first: kernels compiled and kept, the allocator's blocks cached.
HOST_ISSUE_WARMUP = 20
# Each sample waits out a spin of timing.ISSUE_BUSY_MS on the GPU: about a second per provider and cell.
HOST_ISSUE_SAMPLES = 200


def host_issue(device: torch.device | str = "cuda", cells=HOST_ISSUE_CELLS, providers=HOST_ISSUE_PROVIDERS,
               warmup: int = HOST_ISSUE_WARMUP, samples: int = HOST_ISSUE_SAMPLES) -> list[Row]:
    """One row per (cell, provider): the host's time to issue a forward+backward (median, p20, p80 in ms)."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"host issue time is measured against a busy GPU and needs a CUDA device, got {device}")
    rows = []
    for cell in cells:
        inputs, grad_out = _inputs(cell, device)
        for provider in providers:
            row = {**_cell_row(cell, provider, "forward_backward", device), "table": "host_issue"}
            forward, backend = _provider(provider, *inputs, cell.is_causal)
            row["backend"] = None if backend is None else backend.name
            if forward is None:
                rows.append({**row, "status": UNSUPPORTED})
                continue
            with sdpa_kernel(backend) if backend is not None else nullcontext():
                timings = issue_times(lambda: torch.autograd.grad(forward(), inputs, grad_out), warmup=warmup,
                                      samples=samples, device=device)
            rows.append({**row, **_spread(timings.samples_ms), "status": "ok",
                         "timer": f"host issue ({warmup} warm-up, GPU kept busy)"})
        del inputs, grad_out
        release_memory(device)
    return rows


def gate_name(provider: str) -> str:
    """The baseline entry of `provider`'s time over Triton's at the gated cell."""
    cell = GATE_CELL
    return f"flash_benchmarking/N={cell.seq_len},d={cell.head_dim},{cell.precision},fwd+bwd: {provider} / triton"


def gate_ratios(rows: list[Row]) -> dict[str, float | None]:
    """Gate name -> the gated provider's time over Triton's in the gate rows; None where either did not run."""
    measured = {r["provider"]: r for r in rows if r.get("table") == "gate"}
    return {gate_name(p): _ratio(measured.get(p), measured.get("flash_triton")) for p in GATED_PROVIDERS}


# ------------------------------------------------------------------------------------------ reports

FLASH_KEY = ("table", "provider", "precision", "batch_size", "n_heads", "seq_len", "head_dim", "is_causal", "mode")
MODE_LABELS = {"forward": "forward", "backward": "backward", "forward_backward": "forward+backward"}
RATIO_PAIRS = (("naive", "flash_triton"), ("sdpa", "flash_triton"))


def _ok(row: Row | None) -> bool:
    return bool(row) and row.get("status") == "ok"


def _time_cell(row: Row | None) -> str:
    if not row:
        return ""
    if row["status"] == OOM:
        return oom_text(row)
    if row["status"] != "ok":
        return row["status"]
    # The middle 60% of the samples against the median: the spread do_bench's percentiles give.
    noisy = is_noisy(row["median_ms"], row["p80_ms"] - row["p20_ms"])
    return f"{row['median_ms']:.3g}" + (f" ({NOISY})" if noisy else "")


def _ratio(slow: Row | None, fast: Row | None) -> float | None:
    return slow["median_ms"] / fast["median_ms"] if _ok(slow) and _ok(fast) else None


def _index(rows: list[Row]) -> dict[tuple, Row]:
    return {(r["precision"], r["mode"], r["head_dim"], r["seq_len"], r["provider"]): r for r in rows}


def _sweep_table(rows: list[Row], precision: str, mode: str) -> str:
    index = _index(rows)
    providers = [p for p in PROVIDER_LABELS if any(r["provider"] == p for r in rows)]
    table = []
    for d, n in sorted({(r["head_dim"], r["seq_len"]) for r in rows
                        if r["precision"] == precision and r["mode"] == mode}):
        cell = {p: index.get((precision, mode, d, n, p)) for p in providers}
        entry = {"d": d, "N": n}
        entry |= {f"{PROVIDER_LABELS[p]} (ms)": _time_cell(cell[p]) for p in providers}
        for slow, fast in RATIO_PAIRS:
            if slow in cell and fast in cell:
                ratio = _ratio(cell[slow], cell[fast])
                entry[f"{PROVIDER_LABELS[slow]} / {PROVIDER_LABELS[fast]}"] = "" if ratio is None else f"{ratio:.3g}x"
        entry |= {f"{PROVIDER_LABELS[p]} TFLOP/s": f"{cell[p]['tflops']:.3g}" if _ok(cell[p]) else ""
                  for p in providers if p != "naive"}
        table.append(entry)
    return markdown_table(table)


def _timer(rows: list[Row]) -> str:
    return next((r["timer"] for r in rows if r.get("timer")), "none (no cell ran)")


def _setup(rows: list[Row]) -> str:
    r = rows[0]
    reset_note = " outside do_bench's timed region" if _timer(rows).startswith("do_bench") else ""
    backends = sorted({(x["precision"], x["backend"]) for x in rows if x["provider"] == "sdpa" and x.get("backend")})
    backend_text = "; ".join(f"{p}: {b}" for p, b in backends) or "not measured"
    fp32_note = ""
    fp32 = [x for x in rows if x["precision"] == "fp32"]
    if any(x.get("device") == "cpu" for x in fp32):
        # The interpreter runs tl.dot as a NumPy matmul in the output's dtype, whatever input_precision says.
        fp32_note = " On a CPU fp32 is full fp32: the Triton interpreter computes tl.dot as a NumPy fp32 matmul."
    elif fp32:
        matmul = sorted({x["fp32_matmul_precision"] for x in fp32})
        fp32_note = (" In fp32, Triton's tl.dot defaults to TF32 tensor cores on NVIDIA GPUs; PyTorch's matmuls "
                     f"used float32_matmul_precision {', '.join(matmul)} ('highest' is full fp32).")
    return (f"Causal attention on q, k, v of shape ({r['batch_size']}, {r['n_heads']}, N, d), random normal; the "
            "median, in ms. Backward is timed alone, on a forward run beforehand, gradients reset"
            f"{reset_note}. Ratios are a provider's time over Triton's: above 1, Triton is faster. Naive is the "
            "annotated reference, eager. SDPA backend: "
            f"{backend_text}.{fp32_note}\n\nTFLOP/s counts useful FLOPs: forward 2·N²·d per head (causal: half of "
            "4·N²·d), backward 2.5x that, forward+backward 3.5x.\n")


# Up to this length, a time that barely grows while the work grows by orders of magnitude is the
# host's (Python and launch overhead per call), not the kernels'.
SHORT_SEQ_LEN = 4096
HOST_BOUND_MAX_SPREAD = 4  # largest/smallest time over the short lengths
HOST_BOUND_MIN_WORK_GROWTH = 64  # (longest/shortest N)^2 over the short lengths


def _host_bound_finding(rows: list[Row], precision: str) -> str | None:
    """A finding when Triton's forward+backward time stays nearly flat over the short lengths."""
    short = [r for r in rows if (r["provider"], r["precision"], r["mode"]) == ("flash_triton", precision,
                                                                               "forward_backward")
             and r["seq_len"] <= SHORT_SEQ_LEN and _ok(r)]
    if len({r["seq_len"] for r in short}) < 2:
        return None
    shortest, longest = min(r["seq_len"] for r in short), max(r["seq_len"] for r in short)
    low, high = min(r["median_ms"] for r in short), max(r["median_ms"] for r in short)
    growth = (longest / shortest) ** 2
    if high / low > HOST_BOUND_MAX_SPREAD or growth < HOST_BOUND_MIN_WORK_GROWTH:
        return None
    return (f"- {precision}: from N={shortest} to N={longest}, Triton's forward+backward takes {low:.3g} to "
            f"{high:.3g} ms at every d while the work grows {growth:.0f}x: the time is the host's (launch "
            "overhead; docs/flash_tuning.md), not the kernels'.")


def _findings(rows: list[Row]) -> list[str]:
    findings = []
    for precision in [p for p in PRECISIONS if any(r["precision"] == p for r in rows)]:
        mine = [r for r in rows if r["precision"] == precision]
        host_bound = _host_bound_finding(mine, precision)
        if host_bound:
            findings.append(host_bound)
        naive = [r for r in mine if r["provider"] == "naive"]
        ooms = [r for r in naive if r["status"] == OOM]
        if ooms:
            first = min(r["seq_len"] for r in ooms)
            at_first = [r for r in ooms if r["seq_len"] == first]
            head_dims = ", ".join(str(d) for d in sorted({r["head_dim"] for r in at_first}))
            worst = max(at_first, key=lambda r: r["predicted_peak_bytes"] or 0)
            how = "predicted and not run" if all(r.get("oom_predicted") for r in at_first) else "measured"
            need = f"; the accounting puts its peak at {worst['predicted_peak_bytes'] / 2**30:.3g} GiB"
            if worst.get("free_memory_bytes"):
                need += f" against {worst['free_memory_bytes'] / 2**30:.3g} GiB free"
            findings.append(f"- {precision}: naive attention runs out of memory from N={first} (d={head_dims}; "
                            f"{how}{need} at d={worst['head_dim']}).")
        elif naive:
            ran = max(r["seq_len"] for r in naive)
            findings.append(f"- {precision}: naive attention ran at every N measured, up to {ran}.")
    return findings


def _leaderboard_section(rows: list[Row]) -> str:
    if not rows:
        return ""
    r = rows[0]
    measured = [x for x in rows if _ok(x)]
    table = [{"provider": PROVIDER_LABELS[x["provider"]], "backend": x.get("backend") or "",
              "median (ms)": _time_cell(x), "TFLOP/s": f"{x['tflops']:.3g}" if _ok(x) else ""}
             | {f"time / {PROVIDER_LABELS[y['provider']]}": f"{x['median_ms'] / y['median_ms']:.3g}x"
                if _ok(x) else "" for y in measured}
             for x in rows]
    return "\n".join([
        f"## The 2025 leaderboard's attention cell, one GPU\n\nBatch {r['batch_size']}, {r['n_heads']} heads, d_head "
        f"{r['head_dim']}, N {r['seq_len']}, {r['precision']}, causal, forward+backward, one run; triton (compiled) is "
        "the Triton Function in torch.compile. (The 2026 leaderboard is a whole 8B-class training step on two GPUs.)\n",
        markdown_table(table),
    ])


def _plot(rows: list[Row], precision: str):
    from matplotlib.figure import Figure

    head_dims = sorted({r["head_dim"] for r in rows})
    figure = Figure(figsize=(3.2 * len(head_dims), 2.6 * len(MODES)))
    axes = figure.subplots(len(MODES), len(head_dims), squeeze=False, sharex=True)
    for i, mode in enumerate(MODES):
        for j, d in enumerate(head_dims):
            ax = axes[i][j]
            for provider in [p for p in PROVIDER_LABELS if any(r["provider"] == p for r in rows)]:
                line = sorted((r for r in rows if (r["provider"], r["mode"], r["head_dim"]) == (provider, mode, d)
                               and _ok(r)), key=lambda r: r["seq_len"])
                if line:
                    ax.plot([r["seq_len"] for r in line], [r["median_ms"] for r in line], marker="o", markersize=3,
                            label=PROVIDER_LABELS[provider])
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{MODE_LABELS[mode]}, d={d}", fontsize="small")
            if i == len(MODES) - 1:
                ax.set_xlabel("N")
            if j == 0:
                ax.set_ylabel("ms")
    labelled = next((ax for row in axes for ax in row if ax.get_legend_handles_labels()[0]), None)
    if labelled is not None:  # the first panel with a line: a partial sweep may leave the top left one empty
        labelled.legend(fontsize="x-small")
    figure.suptitle(f"Causal attention, batch 1, {precision}: time against sequence length")
    figure.tight_layout()
    return figure


def _host_issue_section(rows: list[Row]) -> str:
    if not rows:
        return ""
    providers = [p for p in PROVIDER_LABELS if any(r["provider"] == p for r in rows)]
    table = []
    for shape in dict.fromkeys((r["batch_size"], r["n_heads"], r["seq_len"], r["head_dim"]) for r in rows):
        cell = {r["provider"]: r for r in rows if (r["batch_size"], r["n_heads"], r["seq_len"], r["head_dim"]) == shape}
        entry = {"batch x heads x N x d": " x ".join(map(str, shape))}
        for p in providers:
            row = cell.get(p)
            entry[f"{PROVIDER_LABELS[p]} (us)"] = (f"{row['median_ms'] * 1e3:.0f} [{row['p20_ms'] * 1e3:.0f}-"
                                                   f"{row['p80_ms'] * 1e3:.0f}]" if _ok(row)
                                                   else (row or {}).get("status", ""))
        for ours in ("flash_triton", "flash_triton_op"):
            for sdpa in ("sdpa_cudnn", "sdpa_flash"):
                ratio = _ratio(cell.get(ours), cell.get(sdpa))
                if ratio is not None:
                    entry[f"{PROVIDER_LABELS[ours]} / {PROVIDER_LABELS[sdpa]}"] = f"{ratio:.2f}x"
        table.append(entry)
    r = rows[0]
    return (f"## Host time to issue forward+backward\n\n{r['precision']}, causal; the host's time per call, median "
            f"[p20-p80] in us, the GPU kept busy so that no call waits for it ({r['timer']}).\n\n"
            + markdown_table(table))


def _gate_section(rows: list[Row]) -> str:
    if not rows:
        return ""
    cell = GATE_CELL
    table = [{"provider": PROVIDER_LABELS[r["provider"]], "backend": r.get("backend") or "",
              "median (ms)": _time_cell(r)} for r in rows]
    ratios = "; ".join(f"{provider} / triton " + ("did not run" if ratio is None else f"{ratio:.3g}x")
                       for provider, ratio in zip(GATED_PROVIDERS, gate_ratios(rows).values()))
    return (f"## Speed-up gates\n\nBatch 1, 1 head, N {cell.seq_len}, d {cell.head_dim}, {cell.precision}, causal, "
            "forward+backward. The perf suite and the CPU tests check these ratios against perf/baselines/<gpu>.json: "
            f"{ratios}.\n\n" + markdown_table(table))


def _sources(rows: list[Row]) -> str:
    """The FlashAttention source each run's rows measured (rows written before hashes were recorded
    carry none)."""
    by_run: dict[int, set[str]] = defaultdict(set)
    for r in rows:
        by_run[int(r.get("run") or 1)].add(str(r.get("source_hash") or "not recorded"))
    runs = sorted(by_run.items())
    if len(runs) == 1:
        return f"FlashAttention GPU source measured: {', '.join(sorted(runs[0][1]))}.\n"
    return ("FlashAttention GPU source measured: "
            + "; ".join(f"run {run}: {', '.join(sorted(hashes))}" for run, hashes in runs) + ".\n")


def render_flash_benchmarking(rows: list[Row]) -> Rendered:
    sweep = [r for r in rows if r.get("table") == "sweep"]
    parts, figures = [_sources(rows)], {}
    if sweep:
        parts.append(f"## Sweep\n\n{_setup(sweep)}")
        for precision in [p for p in PRECISIONS if any(r["precision"] == p for r in sweep)]:
            for mode in MODES:
                if any(r["precision"] == precision and r["mode"] == mode for r in sweep):
                    parts += [f"### {precision}, {MODE_LABELS[mode]}\n", _sweep_table(sweep, precision, mode)]
            name = f"flash_benchmarking_{precision}.png"
            figures[name] = _plot([r for r in sweep if r["precision"] == precision], precision)
            parts.append(f"![{precision}: time against N]({name})\n")
        findings = _findings(sweep)
        if findings:
            parts.append("## Findings\n\n" + "\n".join(findings) + "\n")
    parts.append(_leaderboard_section([r for r in rows if r.get("table") == "leaderboard"]))
    parts.append(_gate_section([r for r in rows if r.get("table") == "gate"]))
    parts.append(_host_issue_section([r for r in rows if r.get("table") == "host_issue"]))
    return Rendered("\n".join(p for p in parts if p), figures=figures)


# ---------------------------------------------------------------------------------------------- answers

def answer_flash_forward_backward(reports: Reports) -> list[str]:
    return ["No report of their own: these are correctness problems, run on every machine by "
            "`pytest tests/test_flash_attention.py` (output, logsumexp and gradients against a float64 reference, L "
            "as the only tensor saved per query row, causal masking), for the tiled PyTorch and the Triton "
            "Functions; their speed is measured under flash_benchmarking."]


def answer_flash_benchmarking(reports: Reports) -> list[str]:
    rows = reports["flash_benchmarking"]
    sweep = select(rows, table="sweep")
    sentences = []
    index = {(r["precision"], r["mode"], r["head_dim"], r["seq_len"], r["provider"]): r for r in ok_rows(sweep)}
    for precision in dict.fromkeys(r["precision"] for r in sweep):
        both = [(d, n) for (p, mode, d, n, provider) in index if (p, mode, provider) ==
                (precision, "forward_backward", "naive") and (p, mode, d, n, "flash_triton") in index]
        if not both:
            continue
        d, n = max(both, key=lambda dn: (dn[1], dn[0]))
        triton, naive, sdpa = (index.get((precision, "forward_backward", d, n, provider))
                               for provider in ("flash_triton", "naive", "sdpa"))
        ooms = [r["seq_len"] for r in select(sweep, precision=precision, provider="naive", status=OOM)]
        sentences.append(
            f"{precision}, causal, forward+backward at the largest N where naive attention ran (d={d}, N={n}): Triton "
            f"{format_ms(triton['median_ms'])} against naive {format_ms(naive['median_ms'])} (naive takes "
            f"{naive['median_ms'] / triton['median_ms']:.3g}x Triton's time)"
            + (f" and SDPA {format_ms(sdpa['median_ms'])}" if sdpa else "")
            + (f"; naive runs out of memory from N={min(ooms)}." if ooms else "."))
    if not sentences:
        sentences.append(not_in_report("A forward+backward cell where both Triton and naive attention ran"))
    leaderboard = ok_rows(select(rows, table="leaderboard"))
    if leaderboard:
        r0 = leaderboard[0]
        sentences.append(
            f"The 2025 leaderboard's attention cell on one GPU (batch {r0['batch_size']}, {r0['n_heads']} heads, d "
            f"{r0['head_dim']}, "
            f"N {r0['seq_len']:,}, {r0['precision']}, causal, forward+backward): "
            + ", ".join(f"{PROVIDER_LABELS.get(r['provider'], r['provider'])} {format_ms(r['median_ms'])}"
                        for r in leaderboard) + ".")
    else:
        sentences.append(not_in_report("The 2025 leaderboard's attention cell"))
    return sentences


def answer_leaderboard(reports: Reports) -> list[str]:
    return ["No report: no benchmark of the leaderboard's full training step (the 8B-class model, d_model 4096, "
            "34 layers, vocabulary 151,936, batch 2 x 32,768 tokens, bf16, AdamW) exists in the project yet; it "
            "needs two GPUs. flash_benchmarking measures the attention part of the 2025 leaderboard."]


def open_items_leaderboard(reports: Reports) -> list[str]:
    return ["the full training step of the 8B-class model on two GPUs: not implemented"]
