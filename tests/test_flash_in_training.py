"""flash_in_training: the shapes it measures, its refusal to time CPU steps, and its report."""

import pytest

from cs336_systems.benchmarks.flash_in_training import TrainingCell, kernel_cell_of, training_steps
from cs336_systems.reports.flash_in_training import answer_flash_in_training
from cs336_systems.reports.problems import report
from cs336_systems.rows import OOM


def test_the_kernel_cell_is_the_attention_call_of_the_training_step():
    cell = kernel_cell_of(TrainingCell("2.7B", 2048, table="2025"))
    assert (cell.batch_size, cell.n_heads, cell.seq_len, cell.head_dim) == (4, 32, 2048, 80)
    assert cell.precision == "bf16" and cell.is_causal


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_training_steps_need_a_cuda_device(cuda_graphs):
    with pytest.raises(ValueError, match="need a CUDA device, got cpu"):
        training_steps(TrainingCell("tiny", 32), "cpu", cuda_graphs=cuda_graphs)


def _step(attention, median_ms, status="ok", table="step"):
    row = {"table": table, "size_table": "2025", "size": "xl", "d_model": 1600, "n_heads": 25, "head_dim": 64,
           "context_length": 512, "batch_size": 4, "attention": attention, "compile": "whole model, fullgraph", "precision": "bf16 autocast",
           "optimizer": "AdamW (fused)", "warmup": 5, "steps": 20, "status": status}
    if status == "ok":
        row |= {"median_ms": median_ms, "iqr_ms": 2.0, "mean_ms": median_ms,
                "std_ms": 2.0, "tflops": 300.0, "peak_memory_gib": 40.0, "first_loss": 9.2103}
    return row


def test_the_report_gives_each_step_against_sdpa_and_says_oom():
    body = report("flash_in_training").render([_step("sdpa", 100.0), _step("flash_triton", 95.0)]).body
    assert "| xl (2025 table) " in body and "0.950x" in body and "1.000x" in body and "9.2103" in body
    body = report("flash_in_training").render([_step("sdpa", 100.0), _step("flash_triton", None, OOM)]).body
    assert OOM in body


def test_graphed_steps_get_their_own_table_against_graphed_sdpa():
    rows = [_step("sdpa", 100.0), _step("flash_triton", 95.0),
            _step("sdpa", 90.0, table="graphed_step"), _step("flash_triton", 76.0, table="graphed_step")]
    body = report("flash_in_training").render(rows).body
    assert "## Training steps in CUDA graphs" in body
    graphed = body.split("## Training steps in CUDA graphs")[1]
    assert "0.844x" in graphed and "0.950x" not in graphed  # 76 / 90, the graphed SDPA step's
    assert "## Training steps in CUDA graphs" not in report("flash_in_training").render(rows[:2]).body


def test_the_answer_gives_the_uncaptured_step_against_sdpa_at_each_context_that_ran_both():
    at_2048 = [r | {"context_length": 2048} for r in (_step("sdpa", 300.0), _step("flash_triton", 306.0))]
    noisy_sdpa = _step("sdpa", 100.0) | {"std_ms": 30.0}
    rows = at_2048 + [noisy_sdpa, _step("flash_triton", 95.0), _step("flash_triton", 70.0, table="graphed_step")]
    (sentence,) = answer_flash_in_training(rows)
    assert sentence.endswith("over the SDPA step: 0.950x (noisy) at context 512 and 1.020x at context 2048.")
    assert "xl (2025 table; batch 4, bf16 autocast)" in sentence
    (sentence,) = answer_flash_in_training([_step("sdpa", 100.0), _step("flash_triton", None, OOM)])
    assert sentence == "A compiled training step where both the Triton op and SDPA ran is not in the report."


def _kernel_row(provider, median_ms, p20_ms, p80_ms):
    return {"table": "kernels", "batch_size": 4, "n_heads": 32, "seq_len": 512, "head_dim": 80, "mode": "backward",
            "provider": provider, "status": "ok", "median_ms": median_ms, "p20_ms": p20_ms, "p80_ms": p80_ms,
            "tflops": 30.0}


def test_a_kernel_time_spread_wide_is_marked_noisy_and_so_is_its_ratio():
    rows = [_kernel_row("flash_triton", 0.42, 0.26, 0.84), _kernel_row("sdpa_cudnn", 0.117, 0.116, 0.118),
            _kernel_row("sdpa_flash", 0.196, 0.195, 0.197)]
    body = report("flash_in_training").render(rows).body
    assert "| 0.42 (noisy) " in body and "| 0.117 " in body and "| 0.196 " in body
    assert "3.59x (noisy)" in body and "2.14x (noisy)" in body
    steady = report("flash_in_training").render([_kernel_row("flash_triton", 0.2, 0.19, 0.21), *rows[1:]]).body
    assert "noisy" not in steady.split("no finding.")[1] and "1.71x" in steady
