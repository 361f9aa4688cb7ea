"""The benchmarks measure an implementation under test (an adapters module, --adapters) beside their references:
its providers and variants are named after its module, come only from the functions it implements, and a cell
where it fails is recorded as failed while the sweep goes on."""

import textwrap
from pathlib import Path

import pytest

from cs336_systems.benchmarks.allreduce import MB
from cs336_systems.benchmarks.ddp import DDPBenchmarkConfig, benchmark_ddp, under_test_variants
from cs336_systems.benchmarks.flash import (
    UNDER_TEST_KINDS,
    BenchSettings,
    FlashCell,
    benchmark_flash_cell,
    gate_providers,
    under_test_providers,
)
from cs336_systems.benchmarks.harness import guarded_cell, under_test_of
from cs336_systems.conformance.contract import load_adapters
from cs336_systems.distributed.launch import launch
from cs336_systems.provenance import module_source_hash
from cs336_systems.reports import write_report
from cs336_systems.runs import read_rows
from cs336_systems.reports.problems import report
from cs336_systems.rows import FAILED, SAMPLE_TIMES, ran
from cs336_systems.rows.ddp import variant_label
from cs336_systems.rows.flash import ATTENTION_MODES
from tests.inner_runs import runpytest

TINY_BENCH = BenchSettings(cpu_warmup=0, cpu_steps=2)
CELL = FlashCell(16, 16, "fp32")
# Its "Triton" Function is SDPA: what a benchmark times is whatever the adapters return.
MEASURED = '''
    import torch

    class Attention:
        @staticmethod
        def apply(q, k, v, is_causal):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal)

    def get_flashattention_autograd_function_triton():
        return Attention
'''
FAILING = '''
    class Attention:
        @staticmethod
        def apply(q, k, v, is_causal):
            raise ValueError("no kernel yet")

    def get_flashattention_autograd_function_triton():
        return Attention

    def get_ddp(module):
        raise RuntimeError("get_ddp is not written")

    def ddp_on_after_backward(ddp_model, optimizer):
        pass

    def get_ddp_bucketed(module, bucket_size_mb):
        import torch
        return torch.nn.parallel.DistributedDataParallel(module, bucket_cap_mb=bucket_size_mb)

    def ddp_bucketed_on_after_backward(ddp_model, optimizer):
        pass

    def ddp_bucketed_on_train_batch_start(ddp_model, optimizer):
        pass
'''
# The 2026 DDP alone.
DDP_ONLY = '''
    def get_ddp(module):
        return module

    def ddp_on_after_backward(ddp_model, optimizer):
        pass
'''


def _adapters(folder: Path, name: str, source: str):
    """The adapters module `name` (each test its own name: one process imports a module name once), named by a
    path relative to `folder`, as a user names one relative to where pytest runs."""
    (folder / f"{name}.py").write_text(textwrap.dedent(source))
    return load_adapters(f"{name}.py", relative_to=folder)


def test_the_implementation_under_test_is_a_provider_named_after_its_module_beside_the_references(tmp_path):
    adapters = _adapters(tmp_path, "measured_adapters", MEASURED)
    providers = under_test_providers(adapters)
    assert providers == (f"{adapters.label}: triton",)
    rows = benchmark_flash_cell(CELL, ("naive", *providers), "cpu", settings=TINY_BENCH, adapters=adapters)
    assert [(r["provider"], r["mode"]) for r in rows] == [(p, m) for p in ("naive", *providers)
                                                          for m in ATTENTION_MODES]
    assert all(ran(r) and len(r[SAMPLE_TIMES]) == TINY_BENCH.cpu_steps for r in rows)
    theirs = [r for r in rows if r["provider"] in providers]
    assert {(r["implementation"], r["implementation_source"]) for r in theirs} == {
        (adapters.label, module_source_hash(adapters.module))}
    assert not any("implementation" in r for r in rows if r["provider"] == "naive")

    markdown = write_report(report("flash_benchmarking"), rows, tmp_path / "out", "pytest perf/", "cpu").read_text()
    assert f"- implementation under test: {adapters.label} (source " in markdown
    assert f"{providers[0]} (ms)" in markdown
    assert all(SAMPLE_TIMES not in r for r in read_rows(tmp_path / "out" / "flash_benchmarking.csv"))


def test_the_gated_cell_measures_the_implementation_under_test_beside_the_references_its_promises_name(tmp_path):
    adapters = _adapters(tmp_path, "promised_adapters", MEASURED)
    assert gate_providers() == ("flash_triton", "naive", "sdpa_flash")
    assert gate_providers(load_adapters(), ("sdpa_cudnn",)) == ("flash_triton", "naive", "sdpa_flash")
    assert gate_providers(adapters, ("sdpa_cudnn", "naive", "flash_triton", "sdpa_cudnn")) == (
        "flash_triton", "naive", "sdpa_flash", "sdpa_cudnn", f"{adapters.label}: triton")


def test_this_projects_own_adapters_add_no_provider_and_no_variant():
    """Without --adapters the implementation under test is this project's own, which the references measure."""
    own = load_adapters()
    assert under_test_providers(own, UNDER_TEST_KINDS) == ()
    assert under_test_variants(own) == []


def test_a_function_the_module_lacks_leaves_its_provider_and_variants_out(tmp_path):
    adapters = _adapters(tmp_path, "ddp_only_adapters", DDP_ONLY)
    assert under_test_providers(adapters, UNDER_TEST_KINDS) == ()
    assert under_test_variants(adapters, (1, 10)) == [("get_ddp", None)]


def test_the_run_names_every_function_the_implementation_under_test_lacks(pytester, tmp_path):
    path = tmp_path / "header_adapters.py"
    path.write_text(textwrap.dedent(MEASURED))
    pytester.makepyfile("def test_nothing():\n    pass\n")
    result = runpytest(pytester, "-p", "cs336_systems.pytest_plugin", "-p", "no:cacheprovider", "--gpu", "none",
                       "--adapters", str(path))
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([f"*implementation under test: adapters {path}",
                                 f"*adapters {path} does not implement get_flashattention_autograd_function_pytorch, "
                                 "get_ddp_individual_parameters, *fsdp_gather_full_params: the tests and benchmarks "
                                 "that need them skip or leave them out"])


def test_a_failing_implementation_is_recorded_as_failed_and_the_sweep_goes_on(tmp_path):
    adapters = _adapters(tmp_path, "failing_adapters", FAILING)
    providers = (*under_test_providers(adapters), "naive")  # the implementation under test first, then a reference
    rows = benchmark_flash_cell(CELL, providers, "cpu", settings=TINY_BENCH, adapters=adapters)
    theirs = [r for r in rows if r["provider"] == providers[0]]
    assert [(r["status"], r["error"]) for r in theirs] == [(FAILED, "ValueError: no kernel yet")] * len(ATTENTION_MODES)
    assert all(ran(r) for r in rows if r["provider"] == "naive")

    markdown = write_report(report("flash_benchmarking"), rows, tmp_path / "out", "pytest perf/", "cpu").read_text()
    assert "## Failures of the implementation under test" in markdown and "ValueError: no kernel yet" in markdown


def test_a_reference_that_fails_is_an_error_not_a_result():
    def measure(columns):
        raise RuntimeError("the harness is broken")

    with pytest.raises(RuntimeError, match="the harness is broken"):
        guarded_cell("cpu", None, measure, oom=lambda columns: columns)
    failed = guarded_cell("cpu", None, measure, oom=lambda columns: columns, failed=lambda columns: columns)
    assert failed == {"status": FAILED, "error": "RuntimeError: the harness is broken"}


# One bucket size and one timed step: the launch measures the seven reference variants and two of the module's.
DDP_CONFIG = DDPBenchmarkConfig(size="tiny", context_length=16, batch_size=1, warmup=0, steps=1, bucket_sizes_mb=(1,),
                                probe_large_bytes=10 * MB)
LAUNCH_TIMEOUT_S = 300


def test_ddp_measures_the_modules_wrappers_after_the_references_and_records_one_that_fails(tmp_path):
    adapters = _adapters(tmp_path, "ddp_failing_adapters", FAILING)
    result = launch(benchmark_ddp, 2, DDP_CONFIG, under_test_of(adapters), device="cpu", timeout_s=LAUNCH_TIMEOUT_S)
    rows = result[0]["rows"]
    steps = [r for r in rows if r["table"] == "step"]
    theirs = [(m, mb) for m, mb in under_test_variants(adapters, DDP_CONFIG.bucket_sizes_mb)]
    assert theirs == [("get_ddp_bucketed", 1), ("get_ddp", None)]  # get_ddp_individual_parameters: not implemented
    assert [r["variant"] for r in steps] == ([variant_label(m, mb) for m, mb in DDP_CONFIG.variants()]
                                             + [variant_label(m, mb, adapters.label) for m, mb in theirs])
    assert all(ran(r) for r in steps[:-1])  # the references, and the module's bucketed DDP (torch's, here)
    assert steps[-1]["status"] == FAILED and steps[-1]["error"] == "RuntimeError: get_ddp is not written"
    # Named as the process that chose the module names it, though the ranks import it from its resolved path.
    assert {r.get("implementation") for r in steps[-2:]} == {adapters.label} == {"adapters ddp_failing_adapters.py"}
