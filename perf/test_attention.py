"""Problems pytorch_attention and the attention part of torch_compile: naive attention, eager and
compiled, timed forward and backward over head dimension x sequence length, one test per cell."""

import pytest

from cs336_systems.benchmarks.attention import HEAD_DIMS, SEQ_LENS, AttentionCell, benchmark_attention
from cs336_systems.cells import require_some_ran, unmeasured
from cs336_systems.pytest_plugin import settings
from cs336_systems.rows import OOM

# CPU runs a small version of the sweep: a few passes over tiny shapes, seconds in all (each compiled
# cell still pays a few seconds of compilation).
CPU_BATCH_SIZE = 2
CPU_HEAD_DIMS = (16, 32)
CPU_SEQ_LENS = (64, 128)
CPU_PASSES = 3
CPU_WARMUP = 1

pytestmark = pytest.mark.attention


def _sweep(on_gpu: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The head dims and sequence lengths swept."""
    return (HEAD_DIMS, SEQ_LENS) if on_gpu else (CPU_HEAD_DIMS, CPU_SEQ_LENS)


def pytest_generate_tests(metafunc):
    if {"head_dim", "seq_len"} <= set(metafunc.fixturenames):
        head_dims, seq_lens = _sweep(settings(metafunc.config).on_gpu)
        metafunc.parametrize("head_dim", head_dims)
        metafunc.parametrize("seq_len", seq_lens)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_attention_cell(head_dim, seq_len, compiled, device, run_settings, report):
    """Each cell runs or runs out of memory, and the smallest cell runs: memory grows with both the head dim
    and the sequence length, so where it cannot run no cell of the sweep can."""
    if run_settings.on_gpu:
        cell = AttentionCell(head_dim, seq_len, compiled=compiled)
    else:
        cell = AttentionCell(head_dim, seq_len, batch_size=CPU_BATCH_SIZE, compiled=compiled,
                             passes=CPU_PASSES, warmup=CPU_WARMUP)
    row = benchmark_attention(cell, device)
    if not compiled:
        report("pytorch_attention").add(row)
    report("torch_compile").add(row, table="attention")
    assert (row["head_dim"], row["seq_len"], row["compile"]) == (head_dim, seq_len, compiled)
    assert row["status"] in ("ok", OOM)
    if (head_dim, seq_len) == tuple(map(min, _sweep(run_settings.on_gpu))):
        require_some_ran([row], f"the sweep's smallest cell, d {head_dim} at N {seq_len}")
    assert not unmeasured([row], "forward_mean_ms", "forward_median_ms", "first_forward_ms",
                          "backward_mean_ms", "backward_median_ms", "first_backward_ms")
