"""Problem flash_benchmarking: Triton FlashAttention-2 against naive attention and PyTorch SDPA, one
test per (precision, head dim, sequence length); the 2025 leaderboard's attention cell; the speed-up gates
that fail CI on a GPU when the Triton kernels regress; the host's time to issue a forward+backward. Problem
flash_in_training: the kernels inside a compiled training step, uncaptured and in CUDA graphs, against SDPA.

With --adapters, the implementation under test's Triton Function is measured beside them, in the sweep, the
leaderboard's cell and the host issue times (cs336_systems.benchmarks.flash.under_test_providers); a cell where it
fails is recorded as failed, and its test fails naming the error. Every timed cell's samples also go to
pytest-benchmark's store (the `benchmark_store` fixture)."""

import pytest

from cs336_systems.benchmarks.flash import (
    HOST_ISSUE_CELLS,
    HOST_ISSUE_PROVIDERS,
    LEADERBOARD_2025_PROVIDERS,
    PROVIDERS,
    UNDER_TEST_KINDS,
    UNSUPPORTED,
    BenchSettings,
    FlashCell,
    benchmark_flash_cell,
    gate,
    gate_name,
    gate_providers,
    host_issue,
    leaderboard_2025_cell,
    under_test_providers,
)
from cs336_systems.benchmarks.flash_in_training import (
    ATTENTIONS,
    KERNEL_PROVIDERS,
    TrainingCell,
    attention_kernels,
    kernel_cell_of,
    training_steps,
)
from cs336_systems.cells import failures, require_some_ran, unmeasured
from cs336_systems.pytest_plugin import settings
from cs336_systems.rows import FAILED, FLASH_IN_TRAINING_KEY, FLASH_KEY, OOM
from cs336_systems.rows.flash import ATTENTION_MODES, GATED_PROVIDERS, GATE_PROMISES, HEAD_DIMS, KERNEL_MODES, SEQ_LENS

PROBLEM = "flash_benchmarking"
# What an ok row of do_bench (GPU) or the host clock (CPU) measured.
TIMED_COLUMNS = ("median_ms", "p20_ms", "p80_ms", "tflops")
# CPU runs the Triton kernels in the interpreter: a smoke version, a few calls on tiny shapes. The
# interpreter computes bf16 tl.dot wrongly, so only fp32 runs there.
CPU_SEQ_LENS = (16, 32)
CPU_HEAD_DIMS = (16,)
CPU_PRECISIONS = ("fp32",)
CPU_SETTINGS = BenchSettings(cpu_warmup=1, cpu_steps=3)
pytestmark = [
    pytest.mark.flash,
    # The Triton interpreter (CPU runs) turns loop bounds into ints through a NumPy conversion that
    # NumPy deprecates; the warning is the interpreter's and says nothing about the kernels.
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
]


def pytest_generate_tests(metafunc):
    if {"head_dim", "seq_len"} <= set(metafunc.fixturenames):
        on_gpu = settings(metafunc.config).on_gpu
        metafunc.parametrize("head_dim", HEAD_DIMS if on_gpu else CPU_HEAD_DIMS)
        metafunc.parametrize("seq_len", SEQ_LENS if on_gpu else CPU_SEQ_LENS)
    if "promise" in metafunc.fixturenames:
        promises = settings(metafunc.config).under_test_promises
        metafunc.parametrize("promise", promises or [None],
                             ids=[f"{reference}={least:g}" for reference, least in promises] or ["none declared"])


def _record(rows, report, benchmark_store) -> None:
    for row in rows:
        report(PROBLEM).add(row)
    benchmark_store.add_rows(PROBLEM, rows, FLASH_KEY, compared="provider")


def _check_references_and_implementation(rows, under_test) -> None:
    """The references ran or ran out of memory (SDPA's pinned backends may refuse a cell); the implementation
    under test may also have failed, which fails the test, naming its errors, after its rows were recorded."""
    references = [r for r in rows if r["provider"] not in under_test]
    assert {r["status"] for r in references} <= {"ok", OOM, UNSUPPORTED}
    assert {r["status"] for r in rows if r["provider"] in under_test} <= {"ok", OOM, FAILED}
    assert not unmeasured(rows, *TIMED_COLUMNS)
    if failed := failures(rows, "provider"):
        pytest.fail("the implementation under test failed:\n" + "\n".join(sorted(set(failed))))


def test_flash_cell(precision, head_dim, seq_len, device, run_settings, report, adapters, benchmark_store):
    if not run_settings.on_gpu and precision not in CPU_PRECISIONS:
        pytest.skip(f"{precision} on CPU: the Triton interpreter computes bf16 tl.dot wrongly; CPU runs fp32 only")
    bench = BenchSettings() if run_settings.on_gpu else CPU_SETTINGS
    under_test = under_test_providers(adapters)
    providers = (*PROVIDERS, *under_test)
    rows = benchmark_flash_cell(FlashCell(seq_len, head_dim, precision), providers, device, settings=bench,
                                adapters=adapters)
    _record(rows, report, benchmark_store)
    assert [(r["provider"], r["mode"]) for r in rows] == [(p, mode) for p in providers for mode in ATTENTION_MODES]
    assert all(r["status"] == "ok" for r in rows if r["provider"] == "flash_triton")
    _check_references_and_implementation(rows, under_test)


@pytest.mark.gpu
def test_flash_leaderboard_2025_cell(device, report, adapters, benchmark_store):
    rows = leaderboard_2025_cell(device, adapters=adapters)
    _record(rows, report, benchmark_store)
    under_test = under_test_providers(adapters, UNDER_TEST_KINDS)
    assert [r["provider"] for r in rows] == [*LEADERBOARD_2025_PROVIDERS, *under_test]
    assert all(r["status"] == "ok" for r in rows if r["provider"].startswith("flash_triton"))
    _check_references_and_implementation(rows, under_test)


@pytest.fixture(scope="module")
def gate_rows(device, report, benchmark_store, adapters, run_settings):
    """The gated cell's rows, measured once for every gate: the implementation under test's among them, beside the
    references its promises name."""
    rows = gate(device, adapters=adapters, references=_promised_references(run_settings))
    _record(rows, report, benchmark_store)
    return rows


def _promised_references(run_settings) -> list[str]:
    return [reference for reference, _ in run_settings.under_test_promises]


def _gate_times(gate_rows, adapters, run_settings) -> tuple[dict[str, float], str]:
    """Each provider's median ms at the gated cell, where it ran, and every provider's status."""
    assert [r["provider"] for r in gate_rows] == list(gate_providers(adapters, _promised_references(run_settings)))
    assert not unmeasured(gate_rows, *TIMED_COLUMNS)
    ms = {r["provider"]: r["median_ms"] for r in gate_rows if r["status"] == "ok"}
    return ms, ", ".join(f"{r['provider']}: {r['status']}" for r in gate_rows)


@pytest.mark.gpu
@pytest.mark.parametrize("provider", GATED_PROVIDERS)
def test_flash_speedup_gate(provider, gate_rows, speedup_gate, adapters, run_settings):
    """On a GPU, at batch 1, 1 head, N 65,536, d 64, bf16, causal, forward+backward: the provider's time over
    Triton's is at least its promise (GATE_PROMISES: naive attention takes at least 10 times Triton's time, SDPA's
    FlashAttention-2 at least Triton's) and within tolerance of the baseline, where one is recorded."""
    ms, statuses = _gate_times(gate_rows, adapters, run_settings)
    speedup_gate(gate_name(provider), ms.get(provider), ms.get("flash_triton"), promise=GATE_PROMISES[provider],
                 note=statuses)


@pytest.mark.gpu
def test_under_test_speedup_gate(promise, gate_rows, speedup_gate, adapters, run_settings):
    """The implementation under test's promises at the same cell, as a course declares them (--adapters-promise
    sdpa_flash=1.0: its Triton Function at least as fast as SDPA's FlashAttention-2): the reference's time over its
    Triton Function's is at least the ratio promised."""
    if promise is None:
        pytest.skip("no promise declared for the implementation under test (--adapters-promise REFERENCE=RATIO)")
    (under_test,) = under_test_providers(adapters)
    reference, least = promise
    ms, statuses = _gate_times(gate_rows, adapters, run_settings)
    speedup_gate(f"{under_test} vs {reference}", ms.get(reference), ms.get(under_test), promise=least, note=statuses)


@pytest.mark.gpu
def test_flash_host_issue(device, report, adapters, benchmark_store):
    under_test = under_test_providers(adapters)
    providers = (*HOST_ISSUE_PROVIDERS, *under_test)
    rows = host_issue(device, providers=providers, adapters=adapters)
    _record(rows, report, benchmark_store)
    assert [(r["seq_len"], r["provider"]) for r in rows] == [
        (cell.seq_len, provider) for cell in HOST_ISSUE_CELLS for provider in providers]
    assert all(r["status"] == "ok" for r in rows if r["provider"].startswith("flash_triton"))
    assert not unmeasured(rows, "median_ms", "p20_ms", "p80_ms")
    if failed := failures(rows, "provider"):
        pytest.fail("the implementation under test failed:\n" + "\n".join(sorted(set(failed))))


# ---------------------------------------------------------------------------------- flash_in_training

# The 2026 handout's xl (d_head 80) at the contexts it trains at.
TRAINING_CELLS = tuple(TrainingCell("xl", context) for context in (512, 2048))


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("cell", TRAINING_CELLS, ids=lambda c: f"{c.size}-{c.context_length}")
def test_flash_in_training(cell, device, report, benchmark_store):
    rows = training_steps(cell, device) + attention_kernels(kernel_cell_of(cell), device)
    for row in rows:
        report("flash_in_training").add(row)
    benchmark_store.add_rows("flash_in_training", rows, FLASH_IN_TRAINING_KEY, compared="provider")
    steps = {r["attention"]: r["status"] for r in rows if r["table"] == "step"}
    assert list(steps) == list(ATTENTIONS)
    assert steps["flash_triton"] == "ok" or steps["flash_triton"] == steps["sdpa"] == OOM, steps
    kernels = [r for r in rows if r["table"] == "kernels"]
    assert [(r["provider"], r["mode"]) for r in kernels] == [(p, m) for p in KERNEL_PROVIDERS for m in KERNEL_MODES]
    assert all(r["status"] in ("ok", UNSUPPORTED) for r in kernels), kernels
    require_some_ran(rows, f"the {cell.size} cell at context {cell.context_length}")
    assert not unmeasured(rows, "median_ms")


# Loss of the first step, flash against SDPA, both captured: the same weights and batch through different
# attention kernels in bf16 (the uncaptured steps agreed to 1e-4 at the 2026 xl).
FIRST_LOSS_TOLERANCE = 1e-2


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("cell", TRAINING_CELLS, ids=lambda c: f"{c.size}-{c.context_length}")
def test_cuda_graphed_training_step(cell, device, report):
    rows = training_steps(cell, device, cuda_graphs=True)
    for row in rows:
        report("flash_in_training").add(row)
    steps = {r["attention"]: r for r in rows}
    assert list(steps) == list(ATTENTIONS)
    flash, sdpa = steps["flash_triton"], steps["sdpa"]
    assert flash["status"] == "ok" or flash["status"] == sdpa["status"] == OOM, (flash, sdpa)
    if flash["status"] == sdpa["status"] == "ok":
        assert abs(flash["first_loss"] - sdpa["first_loss"]) < FIRST_LOSS_TOLERANCE, (flash, sdpa)
    require_some_ran(rows, f"the captured {cell.size} step at context {cell.context_length}")
    assert not unmeasured(rows, "median_ms")
