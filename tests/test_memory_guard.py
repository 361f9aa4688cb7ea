"""Benchmark cells that cannot fit are recorded as OOM, with their estimate, instead of being killed."""

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from cs336_systems import memory_guard
from cs336_systems.benchmarks import attention as attention_bench
from cs336_systems.benchmarks import e2e, nsys_profile
from cs336_systems.benchmarks.attention import AttentionCell, benchmark_attention
from cs336_systems.benchmarks.e2e import E2EConfig, benchmark_model, memory_estimate
from cs336_systems.benchmarks.flash import FlashCell, benchmark_flash_cell
from cs336_systems.benchmarks.harness import guarded_cell
from cs336_systems.memory_guard import (
    FIT_SHARE,
    GPU_TRY_SHARE,
    MemoryCheck,
    check_memory,
    is_out_of_memory,
    oom_columns,
)
from cs336_systems.runs import read_rows
from cs336_systems.reports.attention import oom_when
from cs336_systems.rows import OOM

GIB = 2**30
REPORTS = Path(__file__).resolve().parents[1] / "reports"
# The problems whose rows hold each training step's estimated and measured peak.
MEASURED_STEPS = ("benchmarking_script", "benchmarking_mixed_precision", "torch_compile")


@pytest.fixture
def free_ram(monkeypatch):
    """Pretend the host has this many bytes of RAM available."""
    def set_free(num_bytes: int):
        monkeypatch.setattr(memory_guard, "_available_ram_bytes", lambda: num_bytes)
    return set_free


def _never_run(*args, **kwargs):
    raise AssertionError("a cell predicted not to fit must not run")


def test_available_ram_is_what_the_kernel_reports_and_no_more_than_the_cgroup_allows(tmp_path, monkeypatch):
    (tmp_path / "meminfo").write_text("MemTotal:       24000000 kB\nMemAvailable:   20000000 kB\n")
    monkeypatch.setattr(memory_guard, "MEMINFO", tmp_path / "meminfo")
    monkeypatch.setattr(memory_guard, "CGROUP", tmp_path / "no-cgroup")
    assert memory_guard.available_bytes("cpu") == 20_000_000 * 1024
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    (cgroup / "memory.max").write_text("8000000000\n")
    (cgroup / "memory.current").write_text("3000000000\n")
    monkeypatch.setattr(memory_guard, "CGROUP", cgroup)
    assert memory_guard.available_bytes("cpu") == 5_000_000_000
    # Inactive page cache counts in the cgroup's usage, and the kernel reclaims it before the limit.
    (cgroup / "memory.stat").write_text("anon 1000000000\nfile 2000000000\ninactive_file 1500000000\n")
    assert memory_guard.available_bytes("cpu") == 6_500_000_000
    (cgroup / "memory.max").write_text("max\n")
    assert memory_guard.available_bytes("cpu") == 20_000_000 * 1024


@pytest.mark.parametrize("estimated_bytes, processes, error, message", [
    (-5, 1, ValueError, "estimated_bytes"),
    (math.nan, 1, ValueError, "estimated_bytes"),
    (math.inf, 1, ValueError, "estimated_bytes"),
    ("10", 1, TypeError, "estimated_bytes"),
    (10, 0, ValueError, "processes"),
    (10, 1.5, TypeError, "processes"),
])
def test_a_memory_check_refuses_an_estimate_or_a_process_count_that_is_no_such_thing(
        estimated_bytes, processes, error, message):
    with pytest.raises(error, match=message):
        check_memory(estimated_bytes, "cpu", processes)


def test_a_cell_fits_within_the_share_of_free_memory_its_processes_share(free_ram):
    free_ram(10 * GIB)
    assert check_memory(int(FIT_SHARE * 10 * GIB), "cpu").fits
    assert not check_memory(int(FIT_SHARE * 10 * GIB) + 1, "cpu").fits
    assert not check_memory(3 * GIB, "cpu", processes=4).fits  # four ranks on one host: 12 GiB
    check = MemoryCheck(estimated_bytes=20 * GIB, available_bytes=10 * GIB)
    assert oom_columns(True, check) == {"status": OOM, "oom_predicted": True,
                                        "estimated_peak_bytes": 20 * GIB, "available_bytes": 10 * GIB}
    assert oom_columns(False) == {"status": OOM, "oom_predicted": False}  # a cell with no estimate ran out


def test_a_lone_gpu_cell_is_tried_wherever_its_estimate_could_fit_and_ranks_keep_the_margin(monkeypatch):
    monkeypatch.setattr(memory_guard, "available_bytes", lambda device: 10 * GIB)
    assert check_memory(int(GPU_TRY_SHARE * 10 * GIB), "cuda").fits
    assert not check_memory(int(GPU_TRY_SHARE * 10 * GIB) + 1, "cuda").fits
    assert not check_memory(int(FIT_SHARE * 10 * GIB) + 1, "cuda", in_collectives=True).fits
    assert not check_memory(int(FIT_SHARE * 10 * GIB) + 1, "cpu").fits


def _estimate_over_measured_peak() -> list[tuple[str, float]]:
    """(where, estimated / measured peak) of every committed training step that ran on a GPU."""
    ratios = []
    for path in sorted(path for problem in MEASURED_STEPS for path in REPORTS.glob(f"*/{problem}.csv")):
        for row in read_rows(path):
            if row.get("estimated_peak_bytes") and row.get("peak_memory_gib"):
                where = f"{path.parent.name}/{path.stem}: {row['size']} context {row['context_length']} " \
                        f"{row['precision']}{' compiled' if row.get('compile') else ''}"
                ratios.append((where, row["estimated_peak_bytes"] / (row["peak_memory_gib"] * GIB)))
    return ratios


def test_no_committed_step_that_ran_would_have_been_refused_by_its_estimate():
    # A cell is refused on a GPU only where its estimate exceeds GPU_TRY_SHARE times what is free: that
    # is no false out-of-memory as long as no estimate exceeds its measured peak by more.
    ratios = _estimate_over_measured_peak()
    assert ratios, f"no committed rows of {', '.join(MEASURED_STEPS)} with an estimate and a measured peak"
    over = [(where, round(ratio, 3)) for where, ratio in ratios if ratio > GPU_TRY_SHARE]
    assert not over, f"estimates past {GPU_TRY_SHARE} x the measured peak would refuse cells that fit: {over}"


def test_cpu_and_gpu_allocation_failures_count_as_out_of_memory_and_nothing_else_does():
    with pytest.raises(RuntimeError) as cpu_failure:
        torch.empty(2**62, dtype=torch.uint8)
    assert is_out_of_memory(cpu_failure.value)
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    assert not is_out_of_memory(ValueError(memory_guard.CPU_ALLOCATOR_FAILURE))


def _run_out(columns):
    torch.empty(2**62, dtype=torch.uint8)  # the CPU allocator refuses: a real out-of-memory error


def test_a_guarded_cell_that_cannot_fit_gives_its_predicted_oom_rows_and_never_runs(free_ram):
    free_ram(1 * GIB)
    rows = guarded_cell("cpu", 2 * GIB, measure=_never_run, oom=lambda columns: [{"cell": 1, **columns}])
    assert rows == [{"cell": 1, "status": OOM, "oom_predicted": True, "estimated_peak_bytes": 2 * GIB,
                     "available_bytes": 1 * GIB}]


def test_a_guarded_cell_that_fits_gives_its_rows_with_the_estimate(free_ram):
    free_ram(4 * GIB)
    rows = guarded_cell("cpu", 1 * GIB, measure=lambda columns: [{"cell": 1, "status": "ok", **columns}],
                        oom=_never_run)
    assert rows == [{"cell": 1, "status": "ok", "estimated_peak_bytes": 1 * GIB, "available_bytes": 4 * GIB}]


def test_a_guarded_cell_that_runs_out_gives_its_measured_oom_rows_after_letting_go(free_ram):
    free_ram(4 * GIB)
    let_go = []
    rows = guarded_cell("cpu", 1 * GIB, measure=_run_out, oom=lambda columns: [columns],
                        let_go=lambda: let_go.append(True))
    assert rows == [{"status": OOM, "oom_predicted": False, "estimated_peak_bytes": 1 * GIB,
                     "available_bytes": 4 * GIB}] and let_go == [True]


def test_a_guarded_cell_without_an_estimate_always_runs_and_records_only_that_it_ran_out():
    assert guarded_cell("cpu", None, measure=lambda columns: columns, oom=_never_run) == {}
    assert guarded_cell("cpu", None, measure=_run_out, oom=lambda columns: columns) == {
        "status": OOM, "oom_predicted": False}


def test_a_guarded_cell_takes_the_check_it_is_given():
    impossible = MemoryCheck(estimated_bytes=3 * GIB, available_bytes=2 * GIB, processes=2)
    rows = guarded_cell("cpu", lambda: impossible, measure=_never_run, oom=lambda columns: columns)
    assert rows["oom_predicted"] and rows["available_bytes"] == 2 * GIB


def test_a_guarded_cell_lets_an_error_that_is_not_out_of_memory_through():
    def fail(columns):
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError, match="a bug"):
        guarded_cell("cpu", None, measure=fail, oom=_never_run)


def test_e2e_cell_that_cannot_fit_is_oom_with_its_estimate_and_never_runs(free_ram, monkeypatch):
    free_ram(1 * GIB)
    monkeypatch.setattr(e2e, "_measure", _never_run)
    cfg = E2EConfig("tiny", 100_000)
    rows = benchmark_model(cfg, "cpu")
    assert len(rows) == 5 and all(r["status"] == OOM and r["oom_predicted"] for r in rows)
    # Each phase carries the estimate of the smallest mode that has it (its forward alone, too, needs the
    # 400,000 tokens' logits, 16 GB, and far more for their attention scores).
    smallest = {"forward": "forward", "backward": "forward_backward", "forward_backward": "forward_backward",
                "optimizer": "train", "train_step": "train"}
    for r in rows:
        assert r["estimated_peak_bytes"] == memory_estimate(replace(cfg, mode=smallest[r["phase"]])).peak_bytes
        assert r["estimated_peak_bytes"] > 16 * 10**9 and r.get("measured_mode") in (None, smallest[r["phase"]])
    assert all(r["available_bytes"] == 1 * GIB for r in rows)


@pytest.mark.parametrize("mode", ["forward", "forward_backward", "train"])
def test_e2e_estimate_grows_with_what_a_mode_keeps(mode):
    forward, chosen = (memory_estimate(E2EConfig("tiny", 512, mode=m)).peak_bytes for m in ("forward", mode))
    train = memory_estimate(E2EConfig("tiny", 512)).peak_bytes
    assert forward <= chosen <= train


def test_e2e_cell_that_runs_out_on_the_cpu_is_oom_with_its_estimate(monkeypatch):
    def run_out(cfg, device, reference, profiled_steps):
        torch.empty(2**62, dtype=torch.uint8)

    monkeypatch.setattr(e2e, "_measure", run_out)
    rows = benchmark_model(E2EConfig("tiny", 16), "cpu")
    assert all(r["status"] == OOM and r["oom_predicted"] is False and r["estimated_peak_bytes"] > 0 for r in rows)


def test_an_error_that_is_not_out_of_memory_still_raises(monkeypatch):
    def fail(cfg, device, reference, profiled_steps):
        raise RuntimeError("a bug")

    monkeypatch.setattr(e2e, "_measure", fail)
    with pytest.raises(RuntimeError, match="a bug"):
        benchmark_model(E2EConfig("tiny", 16), "cpu")


def test_attention_cell_that_cannot_fit_is_predicted_oom(free_ram, monkeypatch):
    free_ram(1 * GIB)
    monkeypatch.setattr(attention_bench, "_measure", _never_run)
    row = benchmark_attention(AttentionCell(16, 16384), "cpu")  # three (8, 16384, 16384) fp32 matrices: 24 GiB
    assert row["status"] == OOM and row["oom_predicted"] and row["estimated_peak_bytes"] > 24 * GIB
    assert oom_when(row) == "predicted, not run"


def test_flash_naive_cell_that_cannot_fit_in_ram_is_predicted_oom(free_ram):
    free_ram(1 * GIB)
    rows = benchmark_flash_cell(FlashCell(65536, 16, "fp32"), ("naive",), "cpu", ("forward",))
    assert [(r["status"], r["oom_predicted"], r["free_memory_bytes"]) for r in rows] == [(OOM, True, 1 * GIB)]


def test_profiled_cell_that_cannot_fit_is_predicted_oom(free_ram, monkeypatch):
    free_ram(1 * GIB)
    monkeypatch.setattr(nsys_profile, "_timed_then_profiled", _never_run)
    rows = nsys_profile.profile_training_step(nsys_profile.ProfileConfig("tiny", 16384, batch_size=4), "cpu")
    assert [(r["table"], r["status"], r["oom_predicted"]) for r in rows] == [("cell", OOM, True)]


def _checks_on_each_rank(rank, world_size):
    """Whether rank 1 alone asking for more than any machine has stops both ranks; then a cell both fit."""
    impossible = memory_guard.check_memory_on_every_rank(2**60 if rank == 1 else 1, "cpu", world_size)
    possible = memory_guard.check_memory_on_every_rank(1, "cpu", world_size)
    return impossible.fits, impossible.estimated_bytes, possible.fits


def test_ranks_agree_that_a_variant_runs_only_where_it_fits_on_every_rank():
    from cs336_systems.distributed.launch import launch

    assert launch(_checks_on_each_rank, 2, device="cpu") == [(False, 2**60, True)] * 2


def test_a_guarded_cell_inside_collectives_lets_running_out_through():
    # A rank that recorded running out and went on would leave its peers waiting in a collective.
    with pytest.raises(Exception) as raised:
        guarded_cell("cpu", None, measure=_run_out, oom=_never_run, record_running_out=False)
    assert is_out_of_memory(raised.value)
