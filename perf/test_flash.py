"""Problem flash_benchmarking: Triton FlashAttention-2 against naive attention and PyTorch SDPA, one
test per (precision, head dim, sequence length); the leaderboard configuration; and the speed-up
gates that fail CI on a GPU when the Triton kernels regress."""

import pytest

from cs336_systems.benchmarks.flash import (
    HEAD_DIMS,
    PROVIDERS,
    SEQ_LENS,
    UNSUPPORTED,
    BenchSettings,
    FlashCell,
    benchmark_flash_cell,
    leaderboard,
)
from cs336_systems.pytest_plugin import settings
from cs336_systems.reports import OOM

PROBLEM = "flash_benchmarking"
# CPU runs the Triton kernels in the interpreter: a smoke version, a few calls on tiny shapes. The
# interpreter computes bf16 tl.dot wrongly, so only fp32 runs there.
CPU_SEQ_LENS = (16, 32)
CPU_HEAD_DIMS = (16,)
CPU_PRECISIONS = ("fp32",)
CPU_SETTINGS = BenchSettings(cpu_warmup=1, cpu_steps=3)
# Gated cell: the longest sequence at the head dim of most models, bf16, forward+backward, where the
# kernels take milliseconds. Shorter ones are not gated: at batch 1 x 1 head their forward+backward
# includes the host's launch overhead (most of a millisecond on an H100 host), which moves by more
# than the gate's tolerance from run to run.
GATED_SEQ_LENS = (65536,)
GATED_HEAD_DIM = 64
GATED_PRECISION = "bf16"

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


def test_flash_cell(precision, head_dim, seq_len, device, run_settings, report):
    if not run_settings.on_gpu and precision not in CPU_PRECISIONS:
        pytest.skip(f"{precision} on CPU: the Triton interpreter computes bf16 tl.dot wrongly; CPU runs fp32 only")
    bench = BenchSettings() if run_settings.on_gpu else CPU_SETTINGS
    rows = benchmark_flash_cell(FlashCell(seq_len, head_dim, precision), PROVIDERS, device, settings=bench)
    for row in rows:
        report(PROBLEM).add(row)
    assert {r["status"] for r in rows} <= {"ok", OOM, UNSUPPORTED}
    assert all(r["status"] == "ok" for r in rows if r["provider"] == "flash_triton")


@pytest.mark.gpu
def test_flash_leaderboard(device, report):
    rows = leaderboard(device)
    for row in rows:
        report(PROBLEM).add(row)
    assert all(r["status"] == "ok" for r in rows if r["provider"].startswith("flash_triton"))


@pytest.mark.gpu
@pytest.mark.parametrize("gated_seq_len", GATED_SEQ_LENS)
def test_flash_speedup_gate(gated_seq_len, device, speedup_gate):
    cell = FlashCell(gated_seq_len, GATED_HEAD_DIM, GATED_PRECISION)
    rows = benchmark_flash_cell(cell, ("flash_triton", "naive", "sdpa_flash"), device, ("forward_backward",))
    ms = {r["provider"]: r["median_ms"] for r in rows if r["status"] == "ok"}
    assert "flash_triton" in ms, rows
    prefix = f"{PROBLEM}/N={gated_seq_len},d={GATED_HEAD_DIM},{GATED_PRECISION},fwd+bwd"
    statuses = ", ".join(f"{r['provider']}: {r['status']}" for r in rows)
    speedup_gate(f"{prefix}: naive / triton", ms.get("naive"), ms["flash_triton"], note=statuses)
    speedup_gate(f"{prefix}: sdpa_flash / triton", ms.get("sdpa_flash"), ms["flash_triton"], note=statuses)
