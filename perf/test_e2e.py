"""End-to-end model benchmarks: problems benchmarking_script, benchmarking_mixed_precision,
mixed_precision_accumulation and the whole-model part of torch_compile.

The course's model (naive attention, its own AdamW) as the handout times it, and SDPA with fused AdamW
beside it, eager; torch_compile compiles the SDPA model, as its torch-native reference is."""

import math

import pytest

from cs336_systems.benchmarks.e2e import E2EConfig, benchmark_in_fresh_process, benchmark_model, split_breakdown
from cs336_systems.benchmarks.mixed_precision import (
    ACCUMULATION_VARIANTS,
    accumulation_experiment,
    autocast_dtypes_experiment,
    normalization_precision_experiment,
)
from cs336_systems.cells import require_some_ran, unmeasured
from cs336_systems.model import size_order
from cs336_systems.pytest_plugin import settings
from cs336_systems.rows import COURSE_VARIANT, FAST_VARIANT, OOM, REFERENCE_MODEL, STEP_PHASES
from cs336_systems.rows.e2e import MODE_PHASES

GPU_CONTEXTS = (128, 256, 512, 1024)
CPU_CONTEXTS = (32, 64)
WARMUP_STEPS_STUDIED = (0, 1, 2, 5)
GPU_WARMUP_STUDY_CONTEXT = 512
REFERENCE_GPU_CONTEXT = 512
CPU_WARMUP_STUDY_CONTEXT = 64
# Steps profiled (torch.profiler) after the timed ones, in the compiled cells the reference is timed at.
PROFILED_STEPS = 5
# Every timed column of an ok row: summaries of the timed steps, and the first step's wall time.
TIMED_COLUMNS = ("mean_ms", "median_ms", "first_ms", "max_ms", "first_step_ms")
# What torch's autocast documents for the toy model's layers (the Autocast Op Reference): linear is
# on the low-precision list of both devices and the cross-entropy loss on both float32 lists;
# layer_norm is on CUDA's float32 list but on no CPU list, so on a CPU it runs in its input's dtype,
# the low-precision output of fc1 (through ReLU). Parameters and their gradients are never cast.
LAYER_NORM_IN_FLOAT32 = {"cuda": True, "cpu": False}

pytestmark = pytest.mark.e2e


def _contexts(on_gpu: bool) -> tuple[int, ...]:
    return GPU_CONTEXTS if on_gpu else CPU_CONTEXTS


def pytest_generate_tests(metafunc):
    if "context_length" in metafunc.fixturenames:
        metafunc.parametrize("context_length", _contexts(settings(metafunc.config).on_gpu))


def _smallest_size(run_settings) -> str:
    """The smallest model size swept. Memory grows with the size and the context, so where the smallest size
    at the shortest context cannot run, no cell of a sweep can: that cell must run, where others may run
    out of memory."""
    return min(run_settings.model_sizes, key=size_order)


@pytest.mark.parametrize("variant, compiled", [(COURSE_VARIANT, False), (FAST_VARIANT, False), (FAST_VARIANT, True)],
                         ids=["course-eager", "sdpa-fused-eager", "sdpa-fused-compiled"])
def test_model_step(model_size, context_length, precision, variant, compiled, device, gpu_spec, run_settings, report):
    attention, optimizer = variant
    cfg = E2EConfig(size=model_size, context_length=context_length, precision=precision, compile=compiled,
                    attention=attention, optimizer=optimizer, size_table=run_settings.size_table)
    profiled = compiled and context_length == _reference_context(run_settings)
    rows = benchmark_model(cfg, device, gpu_spec.peak_flops(precision) if gpu_spec else None,
                           profiled_steps=PROFILED_STEPS if profiled else 0)
    steps, breakdown = split_breakdown(rows)
    for row in steps:
        row["table"] = "sweep"
        if precision == "fp32" and not compiled:
            report("benchmarking_script").add(row)
        if not compiled:
            report("benchmarking_mixed_precision").add(row)
    if variant == FAST_VARIANT:
        for row in rows:
            report("torch_compile").add(row)
    assert [r["phase"] for r in steps] == list(MODE_PHASES[cfg.mode])
    assert {(r["attention"], r["optimizer"]) for r in steps} == {variant}
    assert {r["status"] for r in steps} <= {"ok", OOM}
    if (model_size, context_length) == (_smallest_size(run_settings), min(_contexts(run_settings.on_gpu))):
        require_some_ran(steps, f"the sweep's smallest cell, {model_size} at context {context_length}")
    assert not unmeasured(steps, *TIMED_COLUMNS)
    _check_breakdown(breakdown, steps, expected=profiled, device=device)


def test_reference_step(model_size, precision, device, gpu_spec, run_settings, report):
    # The torch-native LM of the same architecture, compiled whole, at one context per size and
    # precision: the torch_compile report sets the project's compiled step beside it.
    cfg = E2EConfig(size=model_size, context_length=_reference_context(run_settings), precision=precision,
                    compile=True, attention=FAST_VARIANT[0], optimizer=FAST_VARIANT[1],
                    size_table=run_settings.size_table)
    rows = benchmark_model(cfg, device, gpu_spec.peak_flops(precision) if gpu_spec else None, reference=True,
                           profiled_steps=PROFILED_STEPS)
    steps, breakdown = split_breakdown(rows)
    for row in steps:
        report("torch_compile").add(row, table="reference")
    for row in breakdown:
        report("torch_compile").add(row)
    assert [r["phase"] for r in steps] == list(MODE_PHASES[cfg.mode])
    assert {r["model"] for r in rows} == {REFERENCE_MODEL}
    assert {r["status"] for r in steps} <= {"ok", OOM}
    if model_size == _smallest_size(run_settings):
        require_some_ran(steps, f"the reference model's smallest size, {model_size}")
    assert not unmeasured(steps, *TIMED_COLUMNS)
    _check_breakdown(breakdown, steps, expected=True, device=device)


def _reference_context(run_settings) -> int:
    return REFERENCE_GPU_CONTEXT if run_settings.on_gpu else CPU_CONTEXTS[-1]


def _check_breakdown(breakdown, steps, expected, device):
    """A profiled cell that ran, in its own mode or, where that did not fit, a smaller one, has a row per
    phase of the mode that ran, whose parts add up to its work, and a step row; on a GPU the device was
    busy for part of the profiled step, never more than all of it."""
    ran = [r for r in steps if r["status"] == "ok"]
    if not expected or not ran:
        assert breakdown == []
        return
    measured_mode = ran[0].get("measured_mode", ran[0]["mode"])
    assert {r.get("measured_mode", r["mode"]) for r in ran + breakdown} == {measured_mode}
    phases = [r for r in breakdown if r["phase"] != "step"]
    assert [r["phase"] for r in phases] == [p for p in STEP_PHASES if p in MODE_PHASES[measured_mode]]
    assert not unmeasured(phases, "work_ms")
    for r in phases:
        assert min(r["matmul_ms"], r["attention_ms"], r["other_ms"]) >= 0
        assert math.isclose(r["matmul_ms"] + r["attention_ms"] + r["other_ms"], r["work_ms"], rel_tol=1e-9)
    (step,) = [r for r in breakdown if r["phase"] == "step"]
    assert not unmeasured([step], "step_ms")
    if device.type == "cuda":
        assert 0 < step["busy_ms"] <= step["span_ms"]
        assert step["busy_ms"] <= step["step_ms"] * 1.01  # the step's events bracket its kernels


@pytest.mark.parametrize("warmup", WARMUP_STEPS_STUDIED)
def test_warmup_study(model_size, warmup, device, gpu_spec, run_settings, report):
    context = GPU_WARMUP_STUDY_CONTEXT if run_settings.on_gpu else CPU_WARMUP_STUDY_CONTEXT
    cfg = E2EConfig(size=model_size, context_length=context, warmup=warmup, size_table=run_settings.size_table)
    rows = benchmark_in_fresh_process(cfg, device, gpu_spec.peak_flops(cfg.precision) if gpu_spec else None)
    for row in rows:
        report("benchmarking_script").add(row, table="warmup")
    assert [r["phase"] for r in rows] == list(MODE_PHASES["train"])
    assert {(r["warmup"], r["context_length"]) for r in rows} == {(warmup, context)}
    assert {r["status"] for r in rows} <= {"ok", OOM}
    if model_size == _smallest_size(run_settings):
        require_some_ran(rows, f"the warm-up study's smallest size, {model_size}")
    assert not unmeasured(rows, *TIMED_COLUMNS)


def test_mixed_precision_accumulation(report):
    rows = accumulation_experiment()
    for row in rows:
        report("mixed_precision_accumulation").add(row)
    error = {r["variant"]: r["abs_error"] for r in rows}
    assert list(error) == [variant for variant, *_ in ACCUMULATION_VARIANTS]
    # fp32 accumulation of fp32 addends is the most accurate; fp32 accumulation of fp16 addends
    # carries fp16's error in 0.01, the same whether the upcast is explicit or not; an fp16
    # accumulator rounds away part of every addend once the sum is large, the least accurate.
    assert error["fp32 += fp32"] < error["fp32 += fp16"] == error["fp32 += fp16.to(fp32)"] < error["fp16 += fp16"]


def test_autocast_dtypes(device, report):
    dtypes = autocast_dtypes_experiment(device)
    for row in dtypes:
        report("benchmarking_mixed_precision").add(row, table="autocast_dtypes")
    observed = {r["tensor"]: r["dtype"] for r in dtypes}
    low = dtypes[0]["autocast"]
    assert low in ("float16", "bfloat16")
    layer_norm = "float32" if LAYER_NORM_IN_FLOAT32[device.type] else low
    assert observed == {"parameters": "float32", "fc1 output": low, "layer norm output": layer_norm,
                        "logits": low, "loss": "float32", "gradients": "float32"}

    norms = normalization_precision_experiment()
    for row in norms:
        report("benchmarking_mixed_precision").add(row, table="normalization")
    error = {r["storage_dtype"]: r["relative_error"] for r in norms}
    assert list(error) == ["float32", "float16", "bfloat16"]
    # Squares of ~300 pass fp16's largest finite value; bf16 keeps the range and loses mantissa bits.
    assert math.isinf(error["float16"]) and error["float32"] < error["bfloat16"] < math.inf
