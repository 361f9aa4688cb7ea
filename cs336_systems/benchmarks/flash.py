"""Problem flash_benchmarking: FlashAttention-2 in Triton against naive PyTorch attention and PyTorch
SDPA, forward, backward and forward+backward; and the 2025 leaderboard's attention cell, one kernel
on one GPU (the 2026 leaderboard times a whole training step of an 8B-class model on two GPUs instead).
cs336_systems.reports.flash renders them.

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
times a closure that runs both. GRAPHED_MODE captures that closure in a CUDA graph and times its
replay: the kernels alone, no host time in the sample (the inputs' gradients are the graph's own
buffers, written on every replay).

Naive attention materialises N x N matrices: before running it, its predicted peak
(cs336_systems.accounting.attention) is compared with the free device memory, and a cell that
would not fit is recorded as OOM (oom_predicted) without running. Any cell that runs out of memory
anyway is recorded as OOM too, and the sweep goes on.

Host issue time (`host_issue`): the host's time to issue one forward+backward (torch.autograd.grad of
the output), the GPU kept busy beforehand so that nothing waits for it (cs336_systems.timing.issue_times),
for the Triton Function, the torch.library op and SDPA's flash and cuDNN backends, by the same method in
one run: a cell's providers take turns, call by call, so that all of them meet the same host.

The implementation under test (an adapters module other than this project's own, --adapters) joins the
sweep, the 2025 leaderboard's cell and the host issue times as providers named after its module
(`under_test_providers`: "adapters path/to/adapters.py: triton", and in torch.compile "...: triton
(compiled)"), reached only through its adapter function get_flashattention_autograd_function_triton; the
course's Functions take (batch, N, d), so the heads fold into the batch. Its rows carry the columns that
name it (cs336_systems.provenance.implementation_columns); a cell where it raises is recorded as failed
(cs336_systems.cells) and the sweep goes on.

Every timed row keeps its samples (rows.SAMPLE_TIMES), which the perf suite hands to pytest-benchmark's
store and no report writes.

SDPA runs under torch.nn.attention.sdpa_kernel with one backend pinned, named in the rows:
"sdpa" takes the first of FLASH_ATTENTION, EFFICIENT_ATTENTION, MATH that accepts the inputs (flash
has no fp32 kernel, so fp32 gets EFFICIENT_ATTENTION on a GPU); "sdpa_flash" and "sdpa_cudnn" pin
FLASH_ATTENTION and CUDNN_ATTENTION and are "unsupported" where that backend refuses the inputs.
"""

from __future__ import annotations

import functools
import random
import statistics
import warnings
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from cs336_systems.accounting.attention import attention_flops, naive_attention_memory
from cs336_systems.attention.reference import naive_attention
from cs336_systems.benchmarks.harness import guarded_cell, release_memory
from cs336_systems.cells import failure_columns
from cs336_systems.checks import check_positive_int
from cs336_systems.clocks import ClockSample, GpuClocks, clock_columns
from cs336_systems.memory_guard import check_memory, oom_columns
from cs336_systems.precision import Precision, check_precision
from cs336_systems.provenance import implementation_columns
from cs336_systems.rows import SAMPLE_TIMES, Row
from cs336_systems.rows.flash import (
    ATTENTION_MODES,
    GATED_PROVIDERS,
    GRAPHED_MODE,
    MODE_LABELS,
    PROVIDER_LABELS,
    median_ratio,
)
from cs336_systems.timing import issue_times, tflops, time_fn

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
        phase = "forward_backward" if mode == GRAPHED_MODE else mode
        return attention_flops(self.batch_size * self.n_heads, self.seq_len, self.head_dim, self.is_causal, phase)


# The 2025 leaderboard's attention configuration and what it is compared with: one kernel cell on one GPU. Its
# rows keep the table name "leaderboard".
LEADERBOARD_2025_CELL = FlashCell(seq_len=16384, head_dim=64, precision="bf16", n_heads=16)
LEADERBOARD_2025_PROVIDERS = ("flash_triton_compiled", "flash_triton", "sdpa_flash", "sdpa_cudnn")
COMPILED_PROVIDERS = ("flash_triton_compiled",)
# The implementation under test's providers, each named "<its adapters' label>: <kind>", with whether it runs in
# torch.compile; both are its Triton Function, which its adapters return from UNDER_TEST_FUNCTION.
UNDER_TEST_KINDS = {"triton": False, "triton (compiled)": True}
UNDER_TEST_FUNCTION = "get_flashattention_autograd_function_triton"


def under_test_providers(adapters, kinds=("triton",)) -> tuple[str, ...]:
    """The providers of the implementation under test (a conformance.contract.Adapters) of each of `kinds`: none
    where it is this project's own (its Triton Function is flash_triton already) or lacks UNDER_TEST_FUNCTION."""
    if adapters is None or adapters.is_own or adapters.missing(UNDER_TEST_FUNCTION):
        return ()
    return tuple(f"{adapters.label}: {kind}" for kind in kinds)


def _under_test_kind(name: str, adapters) -> str | None:
    """The kind of the implementation under test's provider `name`, or None where `name` is not one of them."""
    return next((kind for kind, provider in zip(UNDER_TEST_KINDS, under_test_providers(adapters, UNDER_TEST_KINDS))
                 if provider == name), None)


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


def provider_call(name: str, q, k, v, is_causal: bool,
                  adapters=None) -> tuple[Callable[[], torch.Tensor] | None, SDPBackend | None]:
    """(forward closure, SDPA backend to pin); a None closure means the SDPA backend refuses the inputs. The
    implementation under test's providers come from `adapters` (raising whatever its adapter function raises)."""
    if (kind := _under_test_kind(name, adapters)) is not None:
        return _under_test_call(adapters, UNDER_TEST_KINDS[kind], q, k, v, is_causal), None
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


def _under_test_call(adapters, compiled: bool, q, k, v, is_causal: bool) -> Callable[[], torch.Tensor]:
    """The forward closure of the implementation under test's Triton Function, on (batch, N, d) views of the
    (batch, heads, N, d) inputs, its output viewed back."""
    function = adapters.function(UNDER_TEST_FUNCTION)()

    def attention(q, k, v, is_causal):
        folded = [t.reshape(-1, *t.shape[-2:]) for t in (q, k, v)]
        return function.apply(*folded, is_causal).reshape(q.shape)

    run = torch.compile(attention) if compiled else attention
    return lambda: run(q, k, v, is_causal)


def _check_providers(providers, adapters=None) -> None:
    known = (*PROVIDER_LABELS, *under_test_providers(adapters, UNDER_TEST_KINDS))
    for provider in providers:
        if provider not in known:
            raise ValueError(f"unknown provider {provider!r}; choose one of {', '.join(known)}")


def _compiled(provider: str, adapters=None) -> bool:
    kind = _under_test_kind(provider, adapters)
    return provider in COMPILED_PROVIDERS or (kind is not None and UNDER_TEST_KINDS[kind])


# ------------------------------------------------------------------------------------------- timing

def _bench(fn: Callable[[], object], grads: tuple[torch.Tensor, ...], device: torch.device,
           settings: BenchSettings) -> Row:
    """Median and 20th/80th percentiles of `fn`'s time in ms; `grads` are reset to None before each call."""
    samples, timer = _samples(fn, grads, device, settings)
    return {**_spread(samples), "timer": timer, SAMPLE_TIMES: samples}


def _samples(fn: Callable[[], object], grads: tuple[torch.Tensor, ...], device: torch.device,
             settings: BenchSettings) -> tuple[list[float], str]:
    """`fn`'s times in ms, and how they were taken; `grads` are reset to None before each call."""
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
    return samples, timer


def relative_range(values) -> float:
    """(max - min) / median of values: how far apart timings of one thing lie."""
    return (max(values) - min(values)) / statistics.median(values)


def _drop_gradients(inputs: tuple[torch.Tensor, ...]) -> None:
    """Drop the gradients a timing left on its inputs, so that the next starts without them."""
    for t in inputs:
        t.grad = None


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
    if mode == GRAPHED_MODE:
        graph = _captured(lambda: forward().backward(grad_out), inputs, device)
        return _bench(graph.replay, (), device, settings)
    raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODE_LABELS)}")


# Untimed calls on a side stream before a capture: kernels compiled, the allocator's blocks cached.
CAPTURE_WARMUP = 3


def _captured(fn: Callable[[], object], inputs: tuple[torch.Tensor, ...], device: torch.device):
    """`fn` captured in a CUDA graph, the inputs' gradients None at capture so that the graph allocates and
    writes them itself."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(CAPTURE_WARMUP):
            for t in inputs:
                t.grad = None
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    for t in inputs:
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


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


def cell_inputs(cell: FlashCell, device: torch.device) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    generator = torch.Generator(device=device).manual_seed(0)

    def randn(requires_grad: bool) -> torch.Tensor:
        return torch.randn(cell.shape, generator=generator, device=device, dtype=Precision.named(cell.precision).dtype,
                           requires_grad=requires_grad)

    return (randn(True), randn(True), randn(True)), randn(False)


def benchmark_flash_cell(cell: FlashCell, providers=PROVIDERS, device: torch.device | str = "cuda",
                         modes=ATTENTION_MODES, settings: BenchSettings = BenchSettings(), adapters=None) -> list[Row]:
    """One row per (provider, mode): status ok / OOM / unsupported (or failed, for the implementation under test
    that `adapters` give), times, TFLOP/s."""
    device = torch.device(device)
    for mode in modes:
        if mode not in MODE_LABELS:
            raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODE_LABELS)}")
    if GRAPHED_MODE in modes and device.type != "cuda":
        raise ValueError(f"{GRAPHED_MODE} captures a CUDA graph and needs a CUDA device, got {device}")
    _check_providers(providers, adapters)
    for provider in providers:
        if _compiled(provider, adapters) and "backward" in modes:
            raise ValueError(f"{provider}: backward alone cannot be timed; a compiled backward refuses "
                             "retain_graph=True (its buffers are donated), so time forward_backward")
    inputs, grad_out = cell_inputs(cell, device)
    rows = []
    for provider in providers:
        under_test = _under_test_kind(provider, adapters) is not None
        base = [_cell_row(cell, provider, mode, device) | (implementation_columns(adapters) if under_test else {})
                for mode in modes]
        if provider == "naive":
            fits, peak_bytes, free_bytes = _naive_fits(cell, device)
            for row in base:
                row |= {"predicted_peak_bytes": peak_bytes, "free_memory_bytes": free_bytes}
            if not fits:
                rows += [{**row, **oom_columns(True)} for row in base]
                continue
        try:
            forward, backend = provider_call(provider, *inputs, cell.is_causal, adapters)
        except Exception as error:
            if not under_test:
                raise
            rows += [{**row, **failure_columns(error)} for row in base]
            continue
        for row in base:
            row["backend"] = None if backend is None else backend.name
        if forward is None:
            rows += [{**row, "status": UNSUPPORTED} for row in base]
            continue
        rows += [_guarded_mode(cell, row, forward, backend, inputs, grad_out, device, settings, under_test)
                 for row in base]
    return rows


def _guarded_mode(cell: FlashCell, row: Row, forward: Callable[[], torch.Tensor], backend: SDPBackend | None,
                  inputs: tuple[torch.Tensor, ...], grad_out: torch.Tensor, device: torch.device,
                  settings: BenchSettings, under_test: bool = False) -> Row:
    """`row`'s mode timed, with its TFLOP/s, or OOM where it runs out of memory (or failed, where the
    implementation under test raises); the inputs' gradients are dropped after it, so that every mode starts
    without them."""
    def measure(columns: Row) -> Row:
        with sdpa_kernel(backend) if backend is not None else nullcontext():
            stats = _bench_mode(row["mode"], forward, inputs, grad_out, device, settings)
        return {**row, **stats, "status": "ok", "tflops": tflops(cell.flops(row["mode"]), stats["median_ms"])}

    return guarded_cell(device, None, measure, oom=lambda columns: {**row, **columns},
                        let_go=functools.partial(_drop_gradients, inputs),
                        failed=(lambda columns: {**row, **columns}) if under_test else None)


@dataclass
class ProviderTurns:
    """One provider's part in benchmark_in_turns: its call, its SDPA backend, and its turns' samples and
    clock samples."""

    forward: Callable[[], torch.Tensor]
    backend: SDPBackend | None
    samples: list[list[float]] = field(default_factory=list)
    clocks: list[ClockSample] = field(default_factory=list)

    def take(self, inputs: tuple[torch.Tensor, ...], grad_out: torch.Tensor, device: torch.device,
             settings: BenchSettings, clocks: GpuClocks | None) -> str:
        """One turn: a timing of the forward+backward, its samples kept, and NVML's clock sample over it where
        `clocks` reads one; how it was timed."""
        before = clocks.read() if clocks is not None else None
        with sdpa_kernel(self.backend) if self.backend is not None else nullcontext():
            samples, timer = _samples(lambda: self.forward().backward(grad_out), inputs, device, settings)
        if clocks is not None:
            self.clocks.append(clocks.sample(before, clocks.read()))
        self.samples.append(samples)
        return timer


def benchmark_in_turns(cell: FlashCell, providers, device: torch.device | str, rounds: int,
                       settings: BenchSettings = BenchSettings(), adapters=None) -> list[Row]:
    """One forward+backward row per provider, the providers taking turns for `rounds` rounds, each turn a
    timing as benchmark_flash_cell's: the median and 20th/80th percentiles of all its turns' samples, the
    spread of its turns' medians ((max - min) / median), and on a GPU the clock columns over its turns'
    windows (cs336_systems.clocks: the share NVML counted as power-capped or hot). Each round takes the
    providers in its own (seeded) shuffled order: a GPU that one provider drove to its power limit stays
    held down into the next one's turn, so no provider always follows the same one. A provider that runs
    out of memory gets an OOM row and sits out the later rounds, and so does the implementation under test
    (from `adapters`) where it fails."""
    device = torch.device(device)
    check_positive_int(rounds=rounds)
    _check_providers(providers, adapters)
    inputs, grad_out = cell_inputs(cell, device)
    clocks = GpuClocks.of(device)
    rows, turns = {}, {}
    under_test = {p for p in providers if _under_test_kind(p, adapters) is not None}
    for provider in providers:
        rows[provider] = _cell_row(cell, provider, "forward_backward", device)
        if provider in under_test:
            rows[provider] |= implementation_columns(adapters)
        try:
            forward, backend = provider_call(provider, *inputs, cell.is_causal, adapters)
        except Exception as error:
            if provider not in under_test:
                raise
            rows[provider] |= failure_columns(error)
            continue
        rows[provider]["backend"] = None if backend is None else backend.name
        if forward is None:
            rows[provider]["status"] = UNSUPPORTED
        else:
            turns[provider] = ProviderTurns(forward, backend)

    for round_index in range(rounds):
        order = list(turns)
        random.Random(round_index).shuffle(order)
        for provider in order:
            done = guarded_cell(device, None,
                                lambda columns: {"timer": turns[provider].take(inputs, grad_out, device, settings,
                                                                               clocks)},
                                oom=lambda columns: columns, let_go=functools.partial(_drop_gradients, inputs),
                                failed=(lambda columns: columns) if provider in under_test else None)
            if "status" in done:  # ran out of memory, or the implementation under test failed
                rows[provider] |= done
                del turns[provider]
            else:
                rows[provider]["timer"] = f"{done['timer']}, providers taking turns, {rounds} rounds"
    for provider, taken in turns.items():
        medians = [statistics.median(samples) for samples in taken.samples]
        pooled = [t for samples in taken.samples for t in samples]
        rows[provider] |= {**_spread(pooled), "status": "ok", "rounds": rounds, "round_spread": relative_range(medians),
                           **clock_columns(taken.clocks), SAMPLE_TIMES: pooled}
        rows[provider]["tflops"] = tflops(cell.flops("forward_backward"), rows[provider]["median_ms"])
    return [rows[provider] for provider in providers]


# The leaderboard's providers take turns: an H100 at its power limit runs this cell slower, and a provider
# timed first in a process, or after a light one, meets it below that limit (the Triton Function 5%
# faster; docs/flash_tuning.md, v25).
LEADERBOARD_ROUNDS = 5


def leaderboard_2025_cell(device: torch.device | str = "cuda", settings: BenchSettings = BenchSettings(),
                          rounds: int = LEADERBOARD_ROUNDS, adapters=None) -> list[Row]:
    """The 2025 leaderboard's attention cell, forward+backward, for each of LEADERBOARD_2025_PROVIDERS and the
    implementation under test's Triton Function, eager and compiled (from `adapters`), the providers taking turns
    (benchmark_in_turns)."""
    torch.compiler.reset()  # compile the Triton Function afresh, with no earlier graphs in dynamo's caches
    providers = (*LEADERBOARD_2025_PROVIDERS, *under_test_providers(adapters, UNDER_TEST_KINDS))
    rows = benchmark_in_turns(LEADERBOARD_2025_CELL, providers, device, rounds, settings, adapters)
    return [{**row, "table": "leaderboard"} for row in rows]


# The speed-up gates: the longest sequence at the head dim of most models, bf16, forward+backward, where
# the kernels take milliseconds. Shorter ones are not gated: at batch 1 x 1 head their time includes the
# host's launch overhead, which moves by more than a gate's tolerance from run to run.
GATE_CELL = FlashCell(seq_len=65536, head_dim=64, precision="bf16")


def gate_providers(adapters=None, references: Iterable[str] = ()) -> tuple[str, ...]:
    """The gated cell's providers: Triton, the providers whose time over Triton's is gated, and where `adapters`
    give an implementation under test, its Triton Function and the `references` its promises name."""
    under_test = under_test_providers(adapters)
    extra = [reference for reference in references if reference not in ("flash_triton", *GATED_PROVIDERS)]
    return ("flash_triton", *GATED_PROVIDERS, *(dict.fromkeys(extra) if under_test else ()), *under_test)


def gate(device: torch.device | str = "cuda", settings: BenchSettings = BenchSettings(), adapters=None,
         references: Iterable[str] = ()) -> list[Row]:
    """The gated cell's rows (gate_providers), measured in one run."""
    rows = benchmark_flash_cell(GATE_CELL, gate_providers(adapters, references), device, ("forward_backward",),
                                settings, adapters)
    return [{**row, "table": "gate"} for row in rows]


# Host issue time per forward+backward at: a training shape (the 2026 xl's attention at batch 4, context
# 512: wide tiles), 16 heads at N 1024 (on an H100, narrow tiles and the split forward, which allocates and
# launches once more), and the 2025 leaderboard's grid.
HOST_ISSUE_CELLS = (FlashCell(512, 80, "bf16", batch_size=4, n_heads=32), FlashCell(1024, 64, "bf16", n_heads=16),
                    LEADERBOARD_2025_CELL)
HOST_ISSUE_PROVIDERS = ("flash_triton", "flash_triton_op", "sdpa_flash", "sdpa_cudnn")
# Untimed calls first: kernels compiled and kept, the allocator's blocks cached.
HOST_ISSUE_WARMUP = 20
# Each round of a cell's providers waits out a spin of timing.ISSUE_BUSY_MS (or more) on the GPU: a second or
# two per cell.
HOST_ISSUE_SAMPLES = 200


def host_issue(device: torch.device | str = "cuda", cells=HOST_ISSUE_CELLS, providers=HOST_ISSUE_PROVIDERS,
               warmup: int = HOST_ISSUE_WARMUP, samples: int = HOST_ISSUE_SAMPLES, adapters=None) -> list[Row]:
    """One row per (cell, provider): the host's time to issue a forward+backward (median, p20, p80 in ms),
    a cell's providers taking turns (timing.issue_times); the implementation under test's providers among
    `providers` come from `adapters`."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"host issue time is measured against a busy GPU and needs a CUDA device, got {device}")
    rows = []
    for cell in cells:
        rows += _host_issue_cell(cell, providers, device, warmup, samples, adapters)
        release_memory(device)  # the cell's inputs went with its calls
    return rows


def _host_issue_cell(cell: FlashCell, providers, device: torch.device, warmup: int, samples: int,
                     adapters=None) -> list[Row]:
    """One cell's host-issue rows, its providers taking turns. The implementation under test's providers make one
    call first, outside the turns: one that fails there is recorded as failed and sits out."""
    inputs, grad_out = cell_inputs(cell, device)
    rows, timed, fns, contexts = [], [], [], []
    for provider in providers:
        row = {**_cell_row(cell, provider, "forward_backward", device), "table": "host_issue"}
        if _under_test_kind(provider, adapters) is not None:
            row |= implementation_columns(adapters)
            try:
                forward, backend = provider_call(provider, *inputs, cell.is_causal, adapters)
                _forward_backward(forward, inputs, grad_out)
            except Exception as error:
                rows.append({**row, **failure_columns(error)})
                continue
        else:
            forward, backend = provider_call(provider, *inputs, cell.is_causal)
        row["backend"] = None if backend is None else backend.name
        row["status"] = UNSUPPORTED if forward is None else "ok"
        rows.append(row)
        if forward is not None:
            timed.append(row)
            fns.append(functools.partial(_forward_backward, forward, inputs, grad_out))
            contexts.append(nullcontext if backend is None else functools.partial(sdpa_kernel, backend))
    if fns:
        timings = issue_times(fns, warmup=warmup, samples=samples, device=device, contexts=contexts)
        for row, t in zip(timed, timings):
            row.update(_spread(t.samples_ms), timer=f"host issue ({warmup} warm-up, GPU kept busy, providers taking "
                                                     "turns)")
            row[SAMPLE_TIMES] = list(t.samples_ms)
    return rows


def _forward_backward(forward: Callable[[], torch.Tensor], inputs: tuple[torch.Tensor, ...],
                      grad_out: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad(forward(), inputs, grad_out)


def gate_name(provider: str) -> str:
    """The baseline entry of `provider`'s time over Triton's at the gated cell."""
    cell = GATE_CELL
    return f"flash_benchmarking/N={cell.seq_len},d={cell.head_dim},{cell.precision},fwd+bwd: {provider} / triton"


def gate_ratios(rows: list[Row]) -> dict[str, float | None]:
    """Gate name -> the gated provider's time over Triton's in the gate rows; None where either did not run."""
    measured = {r["provider"]: r for r in rows if r.get("table") == "gate"}
    return {gate_name(p): median_ratio(measured.get(p), measured.get("flash_triton")) for p in GATED_PROVIDERS}
