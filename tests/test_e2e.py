"""The end-to-end benchmark library and command, on a tiny CPU model."""

import gc
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from cs336_systems.__main__ import main
from cs336_systems.accounting.flops import step_flops
from cs336_systems.benchmarks import e2e, harness
from cs336_systems.benchmarks.e2e import E2EConfig, benchmark_model
from cs336_systems.timing import timed_step
from cs336_systems.cells import unmeasured
from cs336_systems.interpretation import interpreter_problem
from cs336_systems.memory_guard import MemoryCheck
from cs336_systems.model import ModelConfig
from cs336_systems.reports import NOISY_RELATIVE_STD, format_bytes
from cs336_systems.runs import read_rows
from cs336_systems.reports.e2e import (
    answer_benchmarking_mixed_precision,
    answer_benchmarking_script,
    answer_compiled_models,
    latest_cells,
    long_cell_note,
    mean_std,
)
from cs336_systems.reports import problems
from cs336_systems.reports.index import result_directories
from cs336_systems.rows import E2E_KEY, MIXED_PRECISION_KEY, OOM, REFERENCE_MODEL, STEP_PHASES, TORCH_COMPILE_KEY
from cs336_systems.rows.e2e import MODE_PHASES

REPORTS = Path(__file__).resolve().parents[1] / "reports"


def test_step_flops_worked_by_hand():
    config = ModelConfig(d_model=64, d_ff=256, num_layers=2, num_heads=4, context_length=16, vocab_size=10_000)
    # 32 tokens. Per layer: q, k, v, o 2 x 32 x 4 x 64^2 = 1,048,576; SwiGLU 2 x 32 x 3 x 64 x 256 = 3,145,728;
    # scores and weights @ v 4 x 2 x 16^2 x 64 = 131,072. LM head 2 x 32 x 64 x 10,000 = 40,960,000.
    forward = 2 * (1_048_576 + 3_145_728 + 131_072) + 40_960_000
    assert step_flops(config, 2, 16, "forward") == forward == 49_610_752
    assert step_flops(config, 2, 16, "backward") == 2 * forward
    assert step_flops(config, 2, 16, "train_step") == step_flops(config, 2, 16, "forward_backward") == 3 * forward
    assert step_flops(config, 2, 16, "optimizer") is None  # elementwise work, not counted


@pytest.mark.parametrize("args, error, message", [
    ((2, 16, "fwd"), ValueError, "unknown phase 'fwd'"),
    ((-4, 16, "forward"), ValueError, "batch_size must be >= 1"),
    ((2, 0, "forward"), ValueError, "seq_len must be >= 1"),
    ((2, 16.0, "forward"), TypeError, "seq_len must be an int"),
])
def test_step_flops_refuses_bad_input(args, error, message):
    with pytest.raises(error, match=message):
        step_flops(ModelConfig.for_size("tiny", 16), *args)


def test_train_mode_reports_every_phase():
    rows = benchmark_model(E2EConfig("tiny", 16, batch_size=2, warmup=1, steps=3), "cpu", peak_flops=1e12)
    by_phase = {r["phase"]: r for r in rows}
    assert list(by_phase) == ["forward", "backward", "optimizer", "forward_backward", "train_step"]
    assert {r["status"] for r in rows} == {"ok"}
    assert not unmeasured(rows, "mean_ms", "median_ms", "first_ms", "max_ms", "first_step_ms")
    assert "mfu" in by_phase["forward"] and "mfu" not in by_phase["optimizer"]


def test_train_step_is_the_whole_step_and_forward_backward_the_per_step_sum(monkeypatch):
    # Each phase and the whole step are timed from markers inside one step (cs336_systems.timing.StepTimer):
    # the train step is the whole step's time, gaps between phases included, not a sum of phase
    # statistics; forward+backward is their per-step sum (here median 11, not 12 from the phases'
    # medians; maximum 22, not 29).
    samples = {"forward": [1.0, 9.0, 2.0], "backward": [10.0, 1.0, 20.0], "optimizer": [1.0, 1.0, 1.0],
               "step": [12.5, 11.5, 23.5]}
    measured = e2e.Measured({k: list(v) for k, v in samples.items()}, 50.0)
    monkeypatch.setattr(e2e, "_measure", lambda cfg, device, reference, profiled_steps: measured)
    by_phase = {r["phase"]: r for r in benchmark_model(E2EConfig("tiny", 16, steps=3), "cpu")}
    for phase, per_step in (("forward_backward", [11.0, 10.0, 22.0]), ("train_step", samples["step"])):
        row = by_phase[phase]
        assert (row["first_ms"], row["median_ms"], row["max_ms"]) == (per_step[0], sorted(per_step)[1], max(per_step))
        assert row["mean_ms"] == pytest.approx(statistics.fmean(per_step))
        assert row["std_ms"] == pytest.approx(statistics.stdev(per_step))
    assert by_phase["train_step"]["iqr_ms"] == pytest.approx(6.0)  # quartiles 12.0 and 18.0
    assert {r["first_step_ms"] for r in by_phase.values()} == {50.0}


def test_the_whole_step_row_gives_the_median_time_the_host_took_to_issue_a_step(monkeypatch):
    samples = {"forward": [1.0, 1.0, 1.0], "backward": [2.0, 2.0, 2.0], "optimizer": [1.0, 1.0, 1.0],
               "step": [5.0, 5.0, 5.0]}
    measured = e2e.Measured(samples, 50.0, host_ms=(4.0, 9.0, 4.5))
    monkeypatch.setattr(e2e, "_measure", lambda cfg, device, reference, profiled_steps: measured)
    by_phase = {r["phase"]: r for r in benchmark_model(E2EConfig("tiny", 16, steps=3), "cpu")}
    assert by_phase["train_step"]["host_ms"] == 4.5
    assert not any("host_ms" in by_phase[p] for p in ("forward", "backward", "optimizer", "forward_backward"))


def test_a_real_cpu_step_is_issued_by_the_host_in_about_its_own_time():
    # On a CPU every operation runs as it is issued: the host's time to issue a step is the step.
    [row] = [r for r in benchmark_model(E2EConfig("tiny", 16, warmup=1, steps=3), "cpu") if r["phase"] == "train_step"]
    assert row["host_ms"] == pytest.approx(row["median_ms"], rel=0.2)


def test_profiled_steps_break_each_phase_down_after_the_timed_ones():
    cfg = E2EConfig("tiny", 16, batch_size=1, warmup=1, steps=2, attention="sdpa", optimizer="fused")
    rows = benchmark_model(cfg, "cpu", profiled_steps=2)
    timed, profiled = e2e.split_breakdown(rows)
    breakdown = {r["phase"]: r for r in profiled}
    assert [r["phase"] for r in timed] == list(MODE_PHASES["train"])
    assert list(breakdown) == [*STEP_PHASES, "step"]
    for phase in STEP_PHASES:
        row = breakdown[phase]
        assert row["profiled_steps"] == 2 and row["work_ms"] > 0
        assert row["matmul_ms"] + row["attention_ms"] + row["other_ms"] == pytest.approx(row["work_ms"])
    # On a CPU the matmuls are aten::mm and kin, SDPA is fused attention, and AdamW does neither.
    assert breakdown["forward"]["matmul_ms"] > 0 and breakdown["forward"]["attention_ms"] > 0
    assert breakdown["optimizer"]["matmul_ms"] == breakdown["optimizer"]["attention_ms"] == 0
    # Busy and idle time are read from a GPU's timeline; a CPU step has only its time.
    assert breakdown["step"]["step_ms"] > 0 and "busy_ms" not in breakdown["step"]


def test_a_timed_step_holds_its_phases_and_collects_no_garbage_inside():
    samples: dict[str, list[float]] = {}
    with timed_step("cpu", samples) as phase:
        assert not gc.isenabled()
        with phase("forward"):
            time.sleep(0.01)
        time.sleep(0.01)  # between phases: in the step, in no phase
        with phase("backward"):
            time.sleep(0.01)
    assert gc.isenabled()
    assert set(samples) == {"forward", "backward", "step"}
    assert samples["step"][0] >= samples["forward"][0] + samples["backward"][0] + 10 > 30


def test_without_warmup_the_first_step_time_is_the_first_timed_step():
    # The first step's wall time, taken around the whole step, contains that step's timed phases.
    rows = benchmark_model(E2EConfig("tiny", 16, batch_size=1, warmup=0, steps=2), "cpu")
    first_step = {r["phase"]: r for r in rows}["train_step"]
    assert 0 < first_step["first_ms"] <= first_step["first_step_ms"]


@pytest.mark.parametrize("mode, phases", [("forward", ["forward"]),
                                           ("forward_backward", ["forward", "backward", "forward_backward"])])
def test_other_modes(mode, phases):
    rows = benchmark_model(E2EConfig("tiny", 16, batch_size=1, mode=mode, precision="bf16", warmup=0, steps=2), "cpu")
    assert [r["phase"] for r in rows] == phases


def test_out_of_memory_is_recorded_not_raised(monkeypatch):
    def run_out(cfg, device, reference, profiled_steps):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(e2e, "_measure", run_out)
    rows = benchmark_model(E2EConfig("tiny", 16), "cpu")
    assert {r["status"] for r in rows} == {OOM} and len(rows) == 5
    assert {r["oom_predicted"] for r in rows} == {False} and rows[0]["estimated_peak_bytes"] > 0


def test_memory_estimate_of_the_10b_model_is_its_state_on_a_training_step():
    # 12,832,823,808 parameters: fp32 weights, gradients and AdamW's two moments, 16 bytes each, and fused
    # AdamW adds no temporary: 205,325,180,928 bytes, which no single GPU of the table holds. The course's
    # AdamW adds sqrt(v) of its largest parameter, a 12,288 x 4,608 feed-forward weight.
    estimate = e2e.memory_estimate(E2EConfig("10B", 512, optimizer="fused"))
    assert estimate.peak_bytes == 16 * 12_832_823_808 and estimate.peak_phase == "optimizer step"
    assert e2e.memory_estimate(E2EConfig("10B", 512)).peak_bytes == 16 * 12_832_823_808 + 4 * 12_288 * 4_608
    # Forward only keeps the weights and one block's temporaries: it fits in 80 GB.
    assert 51e9 < e2e.memory_estimate(E2EConfig("10B", 512, mode="forward")).peak_bytes < 60e9


def _sweep_cell(context: int, phase: str, mean_ms: float, std_ms: float, **extra) -> dict:
    return {"table": "sweep", "size": "small", "context_length": context, "batch_size": 4, "mode": "train",
            "precision": "fp32", "compile": False, "attention": "sdpa", "optimizer": "fused", "warmup": 5, "steps": 10,
            "device": "cuda", "phase": phase, "status": "ok", "mean_ms": mean_ms, "std_ms": std_ms, **extra}


def test_the_report_and_the_index_quote_one_median_variation_of_the_cells():
    # std / mean of 1%, 2%, 4% and 30%: the median is 3.0% (the upper of the two middle values would be 4.0%).
    rows = [_sweep_cell(context, "train_step", 100.0, std) for context, std in ((128, 1.0), (256, 2.0), (512, 4.0),
                                                                              (1024, 30.0))]
    body = problems.report("benchmarking_script").render(rows).body
    answer = " ".join(answer_benchmarking_script({"benchmarking_script": rows}))
    assert "median std 3.0% of the mean; 3 of 4 cells under 5%" in body
    assert ("Over the 4 measured cells the std is a median 3.0% of the mean (largest: small at context 1024, train "
            "step, 30.0%); 1 of them varies by more than 20% and is marked noisy.") in answer


def test_the_index_says_whether_a_step_out_of_memory_was_run():
    gib = 2**30
    refused = _sweep_cell(512, "train_step", None, None, status=OOM, oom_predicted=True,
                          estimated_peak_bytes=191.2 * gib, available_bytes=79.2 * gib)
    answer = " ".join(answer_benchmarking_script({"benchmarking_script": [refused]}))
    assert "the small step was not run (estimated 191.20 GiB against 79.20 GiB free)" in answer
    ran_out = {**refused, "oom_predicted": False}
    assert "small ran out of memory" in " ".join(answer_benchmarking_script({"benchmarking_script": [ran_out]}))


def test_the_report_and_the_index_quote_one_compiled_speed_up_and_leave_out_noisy_cells():
    rows = []
    for context, eager_ms, compiled_ms, std_ms in ((128, 30.0, 20.0, 0.1), (256, 40.0, 20.0, 0.1),
                                                   (512, 90.0, 10.0, 20.0), (1024, 80.0, 40.0, 0.1)):
        rows += [_sweep_cell(context, "train_step", eager_ms, std_ms, first_step_ms=1.0),
                 _sweep_cell(context, "train_step", compiled_ms, 0.1, compile=True, first_step_ms=1.0)]
    body = _torch_compile(rows)
    answer = " ".join(answer_compiled_models(rows))
    # Steady ratios 1.5, 2 and 2 (median 2.00x); context 512's 9x is noisy and left out of both.
    assert "Compiled over eager by phase: train step: 1.50x to 2.00x (median 2.00x; 1 noisy cell left out)." in body
    assert ("makes the whole-model training step 1.50x to 2.00x as fast as eager over 3 size, context and precision "
            "cells (median 2.00x; 1 noisy cell left out).") in answer
    assert "| small | 512 | fp32 | train step | 90.0 ± 20.0 (noisy) | 10.0 ± 0.1 | 9.00x (noisy) |" in _flat(body)


def _flat(markdown: str) -> str:
    return " ".join(markdown.split())


def _torch_compile(rows: list[dict]) -> str:
    """The torch_compile report of `rows`: with only model rows, its whole-model part."""
    return problems.report("torch_compile").render(rows).body


def test_whole_model_eager_and_compiled_steps_of_different_runs_show_both_times_and_no_speed_up():
    # Context 128 timed both ways in run 1 (1.5x); context 256 eager again in run 2, 9x its compiled step of run 1.
    rows = [_sweep_cell(128, "train_step", 30.0, 0.1, run=1),
            _sweep_cell(128, "train_step", 20.0, 0.1, compile=True, run=1),
            _sweep_cell(256, "train_step", 90.0, 0.1, run=2),
            _sweep_cell(256, "train_step", 10.0, 0.1, compile=True, run=1)]
    body = _flat(_torch_compile(rows))
    assert "| small | 256 | fp32 | train step | 90.0 ± 0.1 | 10.0 ± 0.1 | none: different runs |" in body
    assert "Compiled over eager by phase: train step: 1.50x. 1 cell ran both ways but in different runs" in body
    assert "9.00x" not in body + " ".join(answer_compiled_models(rows))


def _reference_rows(project_run: int, reference_run: int) -> list[dict]:
    """A compiled small training step of the project and of the torch-native reference, at two contexts."""
    rows = []
    for context, project_ms, reference_ms in ((256, 40.0, 20.0), (512, 60.0, 50.0)):
        step = _sweep_cell(context, "train_step", project_ms, 0.1, compile=True, median_ms=project_ms)
        rows += [{**step, "run": project_run},
                 {**step, "table": "reference", "model": REFERENCE_MODEL, "mean_ms": reference_ms,
                  "median_ms": reference_ms, "run": reference_run}]
    return rows


def test_the_project_and_the_reference_are_compared_only_where_one_run_timed_both():
    body = _flat(_torch_compile(_reference_rows(2, 2)))
    assert "timed the same way in the same run. Ratio of medians" in body
    assert "| small | 512 | fp32 | 60.0 ± 0.1 | 50.0 ± 0.1 | 1.20x |" in body
    answer = " ".join(answer_compiled_models(_reference_rows(2, 2)))
    assert "takes 1.20x its time (medians 60.0 ms and 50.0 ms); over 2 cells the ratio is 1.20x to 2.00x." in answer

    rows = _reference_rows(2, 3)
    body = _flat(_torch_compile(rows))
    assert "in the same run" not in body and "Ratio of medians" not in body
    assert ("timed the same way. The two steps of every cell ran in different runs (project: run 2; reference: "
            "run 3), so no ratio is read; `pytest perf/test_e2e.py -k \"compiled or reference\"` times both in one "
            "run.") in body
    assert "| small | 512 | fp32 | 60.0 ± 0.1 | 50.0 ± 0.1 | none: different runs |" in body
    answer = " ".join(answer_compiled_models(rows))
    assert "1.20x" not in answer and "2.00x" not in answer
    assert ("The torch-native reference's 2 training steps and the project's compiled steps of the same cells ran in "
            "different runs, so no ratio is read from them") in answer
    # One cell timed in one run is compared; the other is left out and said to be.
    rows[-1]["run"] = 2
    answer = " ".join(answer_compiled_models(rows))
    assert ("takes 1.20x its time (medians 60.0 ms and 50.0 ms); 1 cell whose two steps ran in different runs is "
            "left out.") in answer
    assert "The two steps of 1 of the 2 cells ran in different runs" in _flat(_torch_compile(rows))


def test_the_profiled_breakdown_is_shown_only_beside_the_reference_it_belongs_to():
    profiled = [_sweep_cell(512, "forward", None, None, table="breakdown", compile=True, profiled_steps=5,
                            work_ms=10.0, matmul_ms=8.0, attention_ms=1.0, other_ms=1.0),
                _sweep_cell(512, "step", None, None, table="breakdown", compile=True, profiled_steps=5,
                            step_ms=12.0, busy_ms=9.0, idle_ms=3.0)]
    body = _flat(_torch_compile(_reference_rows(2, 2) + profiled))
    assert "### Where the time goes 5 more steps of each model under torch.profiler" in body
    assert "| project | small | 512 | fp32 | forward | 10.0 | 80% | 10% | 10% | | | |" in body
    assert "| project | small | 512 | fp32 | step | | | | | 12.0 | 9.0 (75%) | 3.0 |" in body
    # The project's compiled steps, profiled, with no reference step to set them beside.
    project = [row for row in _reference_rows(2, 2) if row["table"] == "sweep"]
    body = _torch_compile(project + profiled)
    assert "## Whole model" in body and "Where the time goes" not in body and "| project |" not in body


def test_bf16_is_answered_at_the_largest_size_trained_in_both_precisions_and_forwards_alone_are_summarised_apart():
    rows = []
    # xl trains 2x faster in bf16; 10B cannot train, and its forward alone (no autograd) runs 5x faster in bf16.
    for precision, xl_forward_ms, xl_step_ms, ten_b_forward_ms in (("fp32", 40.0, 100.0, 1000.0),
                                                                   ("bf16", 20.0, 50.0, 200.0)):
        xl, ten_b = {"size": "xl", "precision": precision}, {"size": "10B", "precision": precision}
        rows += [_sweep_cell(512, "forward", xl_forward_ms, 0.1, **xl),
                 _sweep_cell(512, "train_step", xl_step_ms, 0.1, **xl),
                 _sweep_cell(512, "forward", ten_b_forward_ms, 0.1, measured_mode="forward", **ten_b),
                 _sweep_cell(512, "train_step", None, None, status=OOM, **ten_b)]
    answer = " ".join(answer_benchmarking_mixed_precision({"benchmarking_mixed_precision": rows}))
    assert "training step in both fp32 and bf16 is not in the report" not in answer
    assert ("bf16 autocast over fp32, eager, for a training step of SDPA + fused AdamW at xl, the largest size whose "
            "step ran in both precisions: 2.00x at context 512 (100.0 ms -> 50.0 ms).") in answer
    body = problems.report("benchmarking_mixed_precision").render(rows).body
    assert ("bf16 speed-up over fp32 by phase: forward: 2.00x; train step: 2.00x; forward only (no autograd, where "
            "training did not fit): 5.00x.") in body


def _warmup_cell(size: str, warmup: int, median_ms: float, first_ms: float) -> dict:
    return {**_sweep_cell(512, "train_step", median_ms, 0.1, size=size, warmup=warmup, median_ms=median_ms,
                          first_ms=first_ms, max_ms=first_ms), "table": "warmup"}


def test_the_warm_up_study_names_the_model_variant_and_precision_it_ran():
    rows = [_warmup_cell("small", 0, 50.0, 250.0), _warmup_cell("small", 1, 50.0, 50.0),
            _warmup_cell("small", 5, 50.0, 50.0)]
    body = problems.report("benchmarking_script").render(rows).body
    assert ("One fresh process per cell: SDPA + fused AdamW, fp32, batch 4, context 512, 10 timed training steps after "
            "0, 1, 5 warm-up steps.") in body
    answer = " ".join(answer_benchmarking_script({"benchmarking_script": rows}))
    assert ("In the warm-up study (SDPA + fused AdamW, fp32, batch 4, context 512), without warm-up the first timed "
            "step takes 5.00x the median step") in answer


@pytest.mark.parametrize("report, key", [("benchmarking_script", E2E_KEY),
                                         ("benchmarking_mixed_precision", MIXED_PRECISION_KEY),
                                         ("torch_compile", TORCH_COMPILE_KEY)])
def test_each_committed_e2e_report_holds_one_row_per_cell(report, key):
    for slug in result_directories(REPORTS):
        if (REPORTS / slug / f"{report}.csv").exists():
            rows = read_rows(REPORTS / slug / f"{report}.csv")
            assert latest_cells(rows, key) == rows, f"reports/{slug}/{report}.csv holds a cell more than once"


def test_report_lists_cells_out_of_memory_with_their_estimates():
    cell = {"table": "sweep", "size": "10B", "context_length": 128, "batch_size": 4, "mode": "train", "precision": "fp32",
            "compile": False, "attention": "sdpa", "warmup": 5, "steps": 10, "device": "cuda", "status": OOM}
    ok = {**cell, "size": "small", "status": "ok", "mean_ms": 50.0, "std_ms": 1.0}
    rows = [{**cell, "phase": "train_step", "estimated_peak_bytes": 191.2 * 2**30, "oom_predicted": True},
            {**cell, "context_length": 512, "phase": "train_step", "estimated_peak_bytes": 191.4 * 2**30,
             "oom_predicted": False},
            {**ok, "phase": "train_step"}]
    body = problems.report("benchmarking_script").render(rows).body
    # One was not run, one ran out: not every cell of the size was skipped.
    assert "Out of memory: 10B at contexts 128 and 512 in fp32 (estimate 191.2 to 191.4 GiB)." in body
    # Where the forward alone ran in a cell's place, the listing says so.
    forward = {**cell, "phase": "forward", "status": "ok", "mean_ms": 900.0, "std_ms": 1.0, "measured_mode": "forward"}
    body = problems.report("benchmarking_script").render(rows[:1] + [forward, {**ok, "phase": "train_step"}]).body
    assert "10B at context 128 in fp32 (estimate 191.2 GiB; not run; the forward alone ran)" in body
    assert "| 900.0 ± 1.0 (forward only) |" in body.replace("  ", "")


@pytest.mark.parametrize("kwargs, message", [
    (dict(size="huge"), "unknown model size"),
    (dict(steps=0), "steps must be >= 1"),
    (dict(warmup=-1), "warm-up steps"),
    (dict(mode="inference"), "unknown mode"),
    (dict(precision="fp8"), "unknown precision"),
    (dict(model_context_length=8), "exceeds the model's context length 8"),
])
def test_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        E2EConfig(**{"size": "tiny", "context_length": 16, **kwargs})


@pytest.fixture
def kernels_mode_kept(monkeypatch):
    """The e2e command, run here in this process: its CPU run would turn the kernels' mode to interpreted before it
    imports them, which a process that has imported Triton compiled (a test process on a GPU) refuses. The tests
    that use this run no kernel, so the mode stays as it is; test_command_runs_the_triton_kernels_interpreted_on_a_cpu
    checks the command's own choice, in a process of its own."""
    monkeypatch.setattr("cs336_systems.interpretation.interpret_kernels", lambda on_gpu: lambda: None)


@pytest.mark.parametrize("argv, message", [
    (["--size", "huge", "--context", "16"], "unknown model size 'huge'"),
    (["--size-table", "2025", "--size", "10B", "--context", "16"], "unknown model size '10B' in the 2025 size table"),
    (["--size", "tiny", "--context", "16", "--steps", "0"], "--steps: must be a positive integer"),
    (["--size", "tiny", "--context", "0"], "--context: must be a positive integer"),
    (["--size", "tiny", "--context", "64", "--model-context", "32"], "exceeds the model's context length 32"),
])
def test_command_bad_input_is_one_line(argv, message):
    result = subprocess.run([sys.executable, "-m", "cs336_systems", "e2e", *argv], capture_output=True, text=True)
    assert result.returncode == 2
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.usefixtures("kernels_mode_kept")
@pytest.mark.parametrize("argv, message", [
    (["--size", ",", "--context", "16"], "argument --size: needs at least one value, got ','"),
    (["--size", "tiny,tiny", "--context", "16"], "argument --size: tiny given more than once"),
    (["--size", "tiny", "--context", "16, 16"], "argument --context: 16 given more than once"),
    (["--size", "tiny", "--context", "16", "--precision", "fp32,"], None),
    (["--size", "tiny, huge", "--context", "16"], "unknown model size 'huge'"),
    (["--size", "tiny,TINY", "--context", "16"], "--size: tiny given more than once"),
    (["--size", "tiny", "--context", "16", "--mode", "forward", "--optimizer", "fused"],
     "--optimizer: a forward step runs no optimizer; it applies to --mode train"),
])
def test_command_lists_are_trimmed_and_refuse_nothing_or_a_repeat_and_options_that_do_nothing(argv, message, capsys,
                                                                                              monkeypatch):
    monkeypatch.setattr("cs336_systems.benchmarks.e2e.benchmark_model", lambda cell, *args, **kwargs: [])
    if message is None:  # a trailing comma is no value
        assert main(["e2e", *argv, "--device", "cpu"]) == 0
        return
    try:
        code = main(["e2e", *argv, "--device", "cpu"])
    except SystemExit as exit_:  # argparse's errors
        code = exit_.code
    assert code == 2 and message in capsys.readouterr().err


@pytest.mark.usefixtures("kernels_mode_kept")
def test_command_prints_rows_naming_a_size_as_its_table_does_in_whatever_case_it_was_given(capsys):
    assert main(["e2e", "--size", "TINY", "--context", "8", "--batch-size", "1", "--warmup", "0",
                 "--steps", "1", "--mode", "forward", "--device", "cpu"]) == 0
    assert "| tiny" in capsys.readouterr().out


def test_command_runs_the_triton_kernels_interpreted_on_a_cpu():
    # A fresh process, as a user runs it: nothing has set TRITON_INTERPRET before the kernels are imported.
    environment = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "cs336_systems", "e2e", "--size", "tiny", "--context", "16",
                             "--batch-size", "1", "--warmup", "0", "--steps", "1", "--attention", "flash_triton",
                             "--device", "cpu"], capture_output=True, text=True, env=environment)
    if problem := interpreter_problem():  # an install whose interpreter cannot run the kernels is told so
        assert result.returncode == 1 and result.stderr.strip().endswith(problem), result.stderr[-2000:]
        return
    assert result.returncode == 0, result.stderr[-2000:]
    assert sum(line.startswith("| tiny") and "| ok " in line for line in result.stdout.splitlines()) == 5, result.stdout


def test_fresh_process_benchmark_returns_rows_of_the_config_it_was_given():
    # Not the default size table: a process that rebuilt the config from its common fields would lose it.
    cfg = E2EConfig("tiny", 8, batch_size=1, mode="forward", warmup=0, steps=1, size_table="2025")
    rows = e2e.benchmark_in_fresh_process(cfg, "cpu")
    assert [r["phase"] for r in rows] == ["forward"] and rows[0]["status"] == "ok"
    assert rows[0]["size_table"] == "2025"


def test_command_without_arguments_lists_the_commands():
    result = subprocess.run([sys.executable, "-m", "cs336_systems"], capture_output=True, text=True)
    assert result.returncode == 2
    listed = {line.split()[0] for line in result.stderr.splitlines() if line.startswith("    ") and line.strip()}
    assert {"e2e", "accumulation", "autocast-dtypes", "index"} <= listed, result.stderr


def test_command_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["e2e", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for default in (f"(default: {e2e.DEFAULT_BATCH_SIZE})", f"(default: {e2e.DEFAULT_WARMUP})",
                    f"(default: {e2e.DEFAULT_STEPS})", "(default: train)", "(default: fp32)", "(default: naive",
                        "(default: course)",
                    "(default: auto"):
        assert default in text


@pytest.mark.usefixtures("kernels_mode_kept")
def test_command_says_a_cell_too_large_for_this_machine_was_predicted_out_of_memory_and_not_run(
        capsys, caplog, monkeypatch):
    from cs336_systems import memory_guard

    monkeypatch.setattr(memory_guard, "_available_ram_bytes", lambda: 2**30)
    monkeypatch.setattr(e2e, "_measure",
                        lambda cfg, device, reference, profiled_steps: pytest.fail("a cell that cannot fit was run"))
    assert main(["e2e", "--size", "tiny", "--context", "100000", "--device", "cpu"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| tiny")]
    assert len(rows) == 5 and all("| OOM (predicted, not run) " in row and "1,073,741,824" in row for row in rows)
    train, forward_backward, forward = (
        format_bytes(e2e.memory_estimate(E2EConfig("tiny", 100000, mode=mode)).peak_bytes)
        for mode in ("train", "forward_backward", "forward"))
    assert caplog.messages == [
        f"tiny at context 100,000, fp32: the train step: OOM (predicted, not run): the memory model estimates a peak "
        f"of {train} against 1.00 GiB available; forward+backward: OOM (predicted, not run): the memory model "
        f"estimates a peak of {forward_backward} against 1.00 GiB available; the forward: OOM (predicted, not run): "
        f"the memory model estimates a peak of {forward} against 1.00 GiB available; so nothing was measured"]


def _forward_alone_fits(monkeypatch) -> int:
    """The memory check of a tiny cell, where its forward alone fits and neither forward+backward nor its train step
    does: the bytes available, the forward's estimate."""
    fits_bytes = e2e.memory_estimate(E2EConfig("tiny", 16, mode="forward")).peak_bytes
    assert e2e.memory_estimate(E2EConfig("tiny", 16, mode="forward_backward")).peak_bytes > fits_bytes
    monkeypatch.setattr(e2e, "model_memory_check",
                        lambda estimate, device: MemoryCheck(estimate.peak_bytes, fits_bytes, share=1.0))
    return fits_bytes


def _forward_steps(*forward_ms: float) -> e2e.Measured:
    return e2e.Measured({"forward": list(forward_ms), "backward": [], "optimizer": [], "step": list(forward_ms)},
                        forward_ms[0])


@pytest.mark.usefixtures("kernels_mode_kept")
def test_command_says_before_a_smaller_mode_runs_that_it_stands_in_for_the_modes_that_did_not_fit(
        capsys, caplog, monkeypatch):
    # A train step that does not fit, nor its forward+backward; the forward alone does, and it runs: the command says
    # so before it runs (the estimates of both modes that did not fit), never that nothing ran, and its table says
    # which rows the forward alone measured.
    available = format_bytes(_forward_alone_fits(monkeypatch))
    said_before_measuring = []

    def measure(cfg, device, reference, profiled_steps):
        said_before_measuring.append((cfg.mode, list(caplog.messages)))
        return _forward_steps(10.0, 10.5)

    monkeypatch.setattr(e2e, "_measure", measure)
    assert main(["e2e", "--size", "tiny", "--context", "16", "--device", "cpu"]) == 0
    train, forward_backward = (format_bytes(e2e.memory_estimate(E2EConfig("tiny", 16, mode=mode)).peak_bytes)
                               for mode in ("train", "forward_backward"))
    [(mode, messages)] = said_before_measuring
    assert mode == "forward" and messages == [
        f"tiny at context 16, fp32: the train step: OOM (predicted, not run): the memory model estimates a peak of "
        f"{train} against {available} available; forward+backward: OOM (predicted, not run): the memory model "
        f"estimates a peak of {forward_backward} against {available} available; so the forward alone (no autograd) is "
        "measured in their place"]
    assert caplog.messages == messages  # and nothing after the cell
    statuses = {line.split("|")[7].strip(): line.split("|")[8].strip()
                for line in capsys.readouterr().out.splitlines() if line.startswith("| tiny")}
    assert statuses == {"forward": "ok (forward only)", "backward": "OOM (predicted, not run)",
                        "optimizer": "OOM (predicted, not run)", "forward_backward": "OOM (predicted, not run)",
                        "train_step": "OOM (predicted, not run)"}


@pytest.mark.usefixtures("kernels_mode_kept")
def test_command_says_before_a_cell_how_long_the_flop_model_expects_it_to_take_where_that_is_minutes(
        caplog, monkeypatch):
    # The estimate, not a clock: each step 3.48 TFLOP at 26.7 GFLOP/s, the xl forward at context 128 on a loaded
    # CPU core; a cell of 2 steps at that rate takes 4 minutes and is announced, a cell of 1 step in a second is not.
    said_before_measuring = []
    costs = {2: e2e.CellCost(1, 1, 0, 3.48e12, 26.7e9), 1: e2e.CellCost(0, 1, 0, 1e9, 1e9)}
    monkeypatch.setattr(e2e, "cell_cost", lambda cfg, device, profiled_steps: costs[cfg.warmup + cfg.steps])

    def measure(cfg, device, reference, profiled_steps):
        said_before_measuring.append(list(caplog.messages))
        return _forward_steps(*[10.0] * cfg.steps)

    monkeypatch.setattr(e2e, "_measure", measure)
    for warmup in ("1", "0"):
        assert main(["e2e", "--size", "tiny", "--context", "16", "--mode", "forward", "--warmup", warmup, "--steps",
                     "1", "--device", "cpu"]) == 0
    assert said_before_measuring == [[
        "tiny at context 16, fp32: the forward is expected to take about 4 minutes here: 2 steps (1 warm-up + 1 timed) "
        "of 3.48 TFLOP of matmuls each, at the 26.7 GFLOP/s a matmul of the model's feed-forward shape ran at on this "
        "device just now; building the model and the work besides matmuls come on top"]] * 2


@pytest.mark.parametrize("cost, expected", [
    (e2e.CellCost(5, 1, 0, 3.48e12, 26.7e9), "about 13 minutes here: 6 steps (5 warm-up + 1 timed) of 3.48 TFLOP"),
    (e2e.CellCost(0, 1, 2, 1e12, 1e9), "about 50 minutes here: 3 steps (0 warm-up + 1 timed + 2 profiled) of 1 TFLOP"),
    (e2e.CellCost(5, 10, 0, 1e15, 1e12), "about 4.2 hours here: 15 steps"),
    (e2e.CellCost(1, 1, 0, 30e9, 1e9), "about 1 minute here: 2 steps"),
    (e2e.CellCost(1, 1, 0, 29.9e9, 1e9), None),
])
def test_a_cell_is_announced_with_its_expected_time_from_a_minute_of_matmuls(cost, expected):
    note = long_cell_note(cost, "train")
    if expected is None:
        assert note is None
    else:
        assert expected in note


def test_the_cell_cost_is_every_step_of_the_mode_at_the_rate_of_the_models_feed_forward_matmul(monkeypatch):
    # The rate from the probe's one timed call (2 ms here), over the feed-forward's FLOPs at the cell's own tokens
    # (fewer than RATE_PROBE_TOKENS).
    monkeypatch.setattr(e2e, "time_fn", lambda fn, warmup, steps, device: e2e.Timings((2.0,)))
    config = ModelConfig.for_size("tiny", 16)
    cost = e2e.cell_cost(E2EConfig("tiny", 16, batch_size=2, mode="forward_backward", warmup=3, steps=4), "cpu", 1)
    assert (cost.warmup, cost.timed, cost.profiled, cost.steps) == (3, 4, 1, 8)
    assert cost.step_flops == step_flops(config, 2, 16, "forward_backward")
    assert cost.flops_per_s == 2 * 32 * config.d_model * config.d_ff / 2e-3
    assert cost.expected_s == 8 * cost.step_flops / cost.flops_per_s


# Forward times whose std is 0.3 of their mean, and 0.2: the reports mark a spread above a fifth noisy.
@pytest.mark.usefixtures("kernels_mode_kept")
@pytest.mark.parametrize("forward_ms, status", [((7.0, 10.0, 13.0), "ok (noisy)"), ((8.0, 10.0, 12.0), "ok")])
def test_command_table_marks_a_row_whose_time_varied_by_more_than_a_fifth_noisy_as_the_reports_do(
        forward_ms, status, capsys, monkeypatch):
    share = statistics.stdev(forward_ms) / statistics.fmean(forward_ms)
    assert (share > NOISY_RELATIVE_STD) == (status != "ok")
    monkeypatch.setattr(e2e, "_measure", lambda cfg, device, reference, profiled_steps: _forward_steps(*forward_ms))
    assert main(["e2e", "--size", "tiny", "--context", "16", "--mode", "forward", "--steps", "3",
                 "--device", "cpu"]) == 0
    [row] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| tiny")]
    assert row.split("|")[8].strip() == status


def test_a_10b_step_is_not_run_on_80_gb_but_its_forward_alone_is(monkeypatch):
    # An 80 GB device: the 10B model's weights, gradients and AdamW state (205 GB) cannot fit, nor its weights and
    # gradients (103 GB) for forward+backward; its weights and one block's temporaries for a forward alone can.
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80e9))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 60e9)
    monkeypatch.setattr(harness, "release_memory", lambda device: None)
    monkeypatch.setattr(e2e, "check_memory", lambda estimate, device: MemoryCheck(estimate, 80e9))
    modes = []

    def measure(cfg, device, reference, profiled_steps):
        modes.append(cfg.mode)
        return e2e.Measured({"forward": [900.0, 910.0], "backward": [], "optimizer": [], "step": [900.0, 910.0]}, 950.0)

    monkeypatch.setattr(e2e, "_measure", measure)
    rows = {r["phase"]: r for r in benchmark_model(E2EConfig("10B", 128), "cuda")}
    assert modes == ["forward"] and list(rows) == list(MODE_PHASES["train"])
    assert rows["train_step"]["oom_predicted"] and rows["train_step"]["estimated_peak_bytes"] > 16 * 12_832_823_808
    assert rows["backward"]["oom_predicted"] and rows["backward"]["measured_mode"] == "forward_backward"
    assert rows["backward"]["estimated_peak_bytes"] >= 8 * 12_832_823_808
    forward = rows["forward"]
    assert (forward["status"], forward["mode"], forward["measured_mode"], forward["mean_ms"]) == ("ok", "train",
                                                                                                  "forward", 905.0)
    assert forward["estimated_peak_bytes"] < 0.9 * 80e9
    assert mean_std(forward) == "905.0 ± 7.1 (forward only)"


def test_a_profiled_cell_whose_step_does_not_fit_breaks_down_the_forward_and_backward_that_ran(monkeypatch):
    # The compiled 10B reference on a 141 GB GPU: its training step does not fit, its forward+backward does. The
    # breakdown of the steps that ran names phases too, and must not take the place of their timed rows.
    checks = []

    def train_step_does_not_fit(estimate, device):
        checks.append(estimate.peak_bytes)
        return MemoryCheck(estimate.peak_bytes, 0 if len(checks) == 1 else 2 * estimate.peak_bytes)

    monkeypatch.setattr(e2e, "model_memory_check", train_step_does_not_fit)
    cfg = E2EConfig("tiny", 16, batch_size=1, warmup=1, steps=2, attention="sdpa", optimizer="fused")
    timed, profiled = e2e.split_breakdown(benchmark_model(cfg, "cpu", profiled_steps=2))
    assert len(checks) == 2
    assert [(r["phase"], r["status"]) for r in timed] == [("forward", "ok"), ("backward", "ok"), ("optimizer", OOM),
                                                          ("forward_backward", "ok"), ("train_step", OOM)]
    assert [r["phase"] for r in profiled] == ["forward", "backward", "step"]
    assert {(r["mode"], r["measured_mode"]) for r in timed + profiled if r["status"] == "ok"} == {
        ("train", "forward_backward")}
    assert all(r["work_ms"] > 0 for r in profiled[:2]) and profiled[2]["step_ms"] > 0
    # The report says whose step the breakdown timed.
    body = _flat(_torch_compile(_reference_rows(2, 2) + profiled))
    assert "| project | tiny | 16 | fp32 | step (forward+backward only) |" in body
