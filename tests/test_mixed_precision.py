"""Problems mixed_precision_accumulation and benchmarking_mixed_precision (a, b): the phenomena."""

import torch

from cs336_systems.benchmarks.mixed_precision import (
    accumulation_experiment,
    autocast_dtypes_experiment,
    normalization_precision_experiment,
)


def test_accumulation_errors_come_from_fp16_accumulation_and_fp16_representation():
    rows = {r["variant"]: r for r in accumulation_experiment()}
    assert rows["fp32 += fp32"]["abs_error"] < 1e-3
    assert rows["fp16 += fp16"]["abs_error"] > 0.02  # fp16 accumulation loses much of each addend
    for variant in ("fp32 += fp16", "fp32 += fp16.to(fp32)"):
        # fp32 accumulation of fp16(0.01): the error is that of representing 0.01 in fp16.
        assert abs(rows[variant]["result"] - rows[variant]["exact_sum_of_stored_addend"]) < 1e-3
        assert 1e-3 < rows[variant]["abs_error"] < 0.01
    assert rows["fp32 += fp16"]["result"] == rows["fp32 += fp16.to(fp32)"]["result"]


def test_autocast_keeps_parameters_gradients_and_loss_in_fp32():
    observed = {r["tensor"]: r for r in autocast_dtypes_experiment("cpu")}
    low = observed["parameters"]["autocast"]
    assert low in ("float16", "bfloat16")
    assert observed["parameters"]["dtype"] == observed["gradients"]["dtype"] == "float32"
    assert observed["loss"]["dtype"] == "float32"
    assert observed["fc1 output"]["dtype"] == observed["logits"]["dtype"] == low


def test_fp16_statistics_overflow_and_bf16_statistics_lose_precision():
    rows = {r["storage_dtype"]: r for r in normalization_precision_experiment()}
    assert rows["float32"]["relative_error"] < 1e-6
    assert rows["float16"]["mean_square"] == float("inf")
    assert 1e-4 < rows["bfloat16"]["relative_error"] < 0.05
    assert torch.finfo(torch.float16).max < 300.0**2


def test_accumulation_table_shows_the_digits_where_the_variants_differ(capsys):
    from cs336_systems.__main__ import main

    assert main(["accumulation"]) == 0
    table = capsys.readouterr().out
    rows = {r["variant"]: r for r in accumulation_experiment()}
    for variant in ("fp32 += fp32", "fp32 += fp16"):  # 10.0001 against 10.0021
        assert f"| {rows[variant]['result']:.6f} " in table
