"""End-to-end model benchmarks: problems benchmarking_script, benchmarking_mixed_precision,
mixed_precision_accumulation and the whole-model part of torch_compile."""

import pytest

from cs336_systems.benchmarks.e2e import E2EConfig, benchmark_in_fresh_process, benchmark_model
from cs336_systems.benchmarks.mixed_precision import (
    accumulation_experiment,
    autocast_dtypes_experiment,
    normalization_precision_experiment,
)
from cs336_systems.pytest_plugin import settings
from cs336_systems.reports import OOM

GPU_CONTEXTS = (128, 256, 512, 1024)
CPU_CONTEXTS = (32, 64)
WARMUP_STEPS_STUDIED = (0, 1, 2, 5)
GPU_WARMUP_STUDY_CONTEXT = 512
CPU_WARMUP_STUDY_CONTEXT = 64

pytestmark = pytest.mark.e2e


def pytest_generate_tests(metafunc):
    if "context_length" in metafunc.fixturenames:
        on_gpu = settings(metafunc.config).on_gpu
        metafunc.parametrize("context_length", GPU_CONTEXTS if on_gpu else CPU_CONTEXTS)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_model_step(model_size, context_length, precision, compiled, device, gpu_spec, report):
    cfg = E2EConfig(size=model_size, context_length=context_length, precision=precision, compile=compiled)
    rows = benchmark_model(cfg, device, gpu_spec.peak_flops(precision) if gpu_spec else None)
    for row in rows:
        row["table"] = "sweep"
        if precision == "fp32" and not compiled:
            report("benchmarking_script").add(row)
        if not compiled:
            report("benchmarking_mixed_precision").add(row)
        report("torch_compile").add(row)
    assert {r["status"] for r in rows} <= {"ok", OOM}


@pytest.mark.parametrize("warmup", WARMUP_STEPS_STUDIED)
def test_warmup_study(model_size, warmup, device, run_settings, report):
    context = GPU_WARMUP_STUDY_CONTEXT if run_settings.on_gpu else CPU_WARMUP_STUDY_CONTEXT
    cfg = E2EConfig(size=model_size, context_length=context, warmup=warmup)
    rows = benchmark_in_fresh_process(cfg, device)
    for row in rows:
        report("benchmarking_script").add(row, table="warmup")
    assert rows


def test_mixed_precision_accumulation(report):
    for row in accumulation_experiment():
        report("mixed_precision_accumulation").add(row)


def test_autocast_dtypes(device, report):
    for row in autocast_dtypes_experiment(device):
        report("benchmarking_mixed_precision").add(row, table="autocast_dtypes")
    for row in normalization_precision_experiment():
        report("benchmarking_mixed_precision").add(row, table="normalization")
