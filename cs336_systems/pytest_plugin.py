"""pytest glue: options, markers, fixtures. The logic lives in the library; this only wires it.

Loaded by the repository's root conftest.py. Works under pytest-xdist: report rows and measured
ratios are staged per worker and merged by the controller when the session ends.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

MARKERS = {
    "e2e": "end-to-end model benchmarks (benchmarking_script, mixed precision, compiled model)",
    "profile": "kernel tables from torch.profiler and NVTX ranges (nsys_profile)",
    "memory": "memory snapshots, peak tables and activation checkpointing",
    "attention": "attention sweeps (pytorch_attention, torch_compile attention part)",
    "flash": "FlashAttention-2 correctness and benchmarks",
    "ddp": "distributed data parallel and the all-reduce benchmark",
    "sharding": "optimizer-state sharding",
    "fsdp": "fully sharded data parallel",
    "accounting": "closed-form memory, FLOP and communication models",
    "gpu": "needs a CUDA GPU; skipped when the run is on CPU",
    "multigpu": "needs --world-size CUDA GPUs; skipped when fewer are present",
    "slow": "takes more than a few seconds on a CPU",
}
DEFAULT_PRECISIONS = "fp32,bf16"
DEFAULT_WORLD_SIZE = 2
CPU_MODEL_SIZES = ("tiny",)
_STAGING_KEY = "cs336_staging_dir"


@dataclass(frozen=True)
class Settings:
    gpu_slug: str  # "cpu" when the run has no GPU
    gpu_spec: Any  # cs336_systems.gpus.GpuSpec, or None for CPU and GPUs not in the table
    precisions: tuple[str, ...]
    world_size: int
    report_root: Path
    update_baselines: bool
    accept_regression: bool  # --update-baselines may record a ratio below its baseline
    model_sizes: tuple[str, ...]
    size_table: str  # the handout whose model-size table the sizes name
    staging_dir: Path
    command: str
    baseline_dir: Path
    time_budget_s: float | None  # tests not started this long after the session began are skipped
    started: float  # time.monotonic() when the session was configured

    @property
    def on_gpu(self) -> bool:
        return self.gpu_slug != "cpu"

    @property
    def report_dir(self) -> Path:
        return self.report_root / self.gpu_slug

    @property
    def baseline_path(self) -> Path:
        return self.baseline_dir / f"{self.gpu_slug}.json"


_settings_key = pytest.StashKey[Settings]()
_restore_interpretation_key = pytest.StashKey[Callable[[], None]]()


def settings(config: pytest.Config) -> Settings:
    return config.stash[_settings_key]


def pytest_addoption(parser: pytest.Parser) -> None:
    from cs336_systems.precision import PRECISIONS

    group = parser.getgroup("cs336", "cs336-systems")
    group.addoption("--gpu", default="auto",
                    help="auto (detect), none (CPU, Triton interpreter), or a GPU name from "
                         "cs336_systems.gpus (a100, h100, h200, b200, ...): sets the spec used "
                         "for MFU columns and the baseline file")
    group.addoption("--world-size", type=int, default=DEFAULT_WORLD_SIZE,
                    help=f"ranks for distributed benchmarks (default {DEFAULT_WORLD_SIZE})")
    group.addoption("--precision", default=DEFAULT_PRECISIONS,
                    help=f"comma-separated subset of {', '.join(PRECISIONS)}, or all (default {DEFAULT_PRECISIONS})")
    group.addoption("--report-dir", default=None,
                    help="where reports go; each GPU gets a subdirectory (default: reports/ in pytest's rootdir, "
                         "the repository's root, from any folder)")
    group.addoption("--update-baselines", action="store_true",
                    help="write measured speed-up ratios to perf/baselines/<gpu>.json instead of gating")
    group.addoption("--accept-regression", action="store_true",
                    help="with --update-baselines: record ratios below the current baseline, even past its "
                         "tolerance (otherwise a lower ratio leaves the baseline as it was, and one past "
                         "tolerance is refused)")
    group.addoption("--time-budget", type=float, default=None, metavar="SECONDS",
                    help="skip the tests not started within SECONDS of the session's start; the ones "
                         "measured so far still reach the reports (for sweeps on borrowed time)")
    group.addoption("--model-sizes", default=None,
                    help="comma-separated model sizes for the model benchmarks (default: every size of "
                         f"the size table on a GPU, {','.join(CPU_MODEL_SIZES)} on CPU)")
    group.addoption("--size-table", default=None, choices=("2026", "2025"),
                    help="the handout whose model-size table sizes are looked up in: 2026 (xl = "
                         "2560/10240/32/32, and 10B; the default) or 2025 (xl = 1600/6400/48/25, and 2.7B)")


def _parse_precisions(value: str) -> tuple[str, ...]:
    from cs336_systems.precision import PRECISIONS

    chosen = tuple(PRECISIONS) if value == "all" else tuple(p.strip() for p in value.split(",") if p.strip())
    unknown = [p for p in chosen if p not in PRECISIONS]
    if unknown or not chosen:
        raise pytest.UsageError(f"--precision: unknown {', '.join(unknown) or repr(value)}; "
                                f"use any of {', '.join(PRECISIONS)} (comma-separated), or all")
    return chosen


def _parse_sizes(value: str | None, on_gpu: bool, size_table: str) -> tuple[str, ...]:
    from cs336_systems.model import model_sizes

    table = model_sizes(size_table)
    if value is None:
        return tuple(s for s in table if s not in CPU_MODEL_SIZES) if on_gpu else CPU_MODEL_SIZES
    sizes = tuple(s.strip() for s in value.split(",") if s.strip())
    unknown = [s for s in sizes if s not in table]
    if unknown or not sizes:
        raise pytest.UsageError(f"--model-sizes: unknown {', '.join(unknown) or repr(value)} in the {size_table} "
                                f"size table; choose from {', '.join(table)} (--size-table picks the table)")
    return sizes


def pytest_configure(config: pytest.Config) -> None:
    for name, description in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {description}")
    from cs336_systems.gpus import resolve_gpu
    from cs336_systems.interpretation import interpret_kernels

    try:
        gpu_slug, gpu_spec = resolve_gpu(config.getoption("--gpu"))
    except ValueError as error:
        raise pytest.UsageError(f"--gpu: {error}") from None
    # Before any test module imports the kernels (cs336_systems.interpretation says why it must be then).
    config.stash[_restore_interpretation_key] = interpret_kernels(on_gpu=gpu_slug != "cpu")
    world_size = config.getoption("--world-size")
    if world_size < 1:
        raise pytest.UsageError(f"--world-size must be at least 1, got {world_size}")
    time_budget_s = config.getoption("--time-budget")
    if time_budget_s is not None and time_budget_s < 0:
        raise pytest.UsageError(f"--time-budget must be at least 0 seconds, got {time_budget_s:g}")
    if config.getoption("--accept-regression") and not config.getoption("--update-baselines"):
        raise pytest.UsageError("--accept-regression only applies with --update-baselines")
    from cs336_systems.model import DEFAULT_SIZE_TABLE
    from cs336_systems.reports.staging import new_staging_dir

    size_table = config.getoption("--size-table") or DEFAULT_SIZE_TABLE
    precisions = _parse_precisions(config.getoption("--precision"))
    model_sizes = _parse_sizes(config.getoption("--model-sizes"), gpu_slug != "cpu", size_table)
    # Staged only once every option is known to be good: a usage error leaves nothing behind.
    worker_input = getattr(config, "workerinput", None)
    staging = Path(worker_input[_STAGING_KEY]) if worker_input else new_staging_dir()
    config.stash[_settings_key] = Settings(
        gpu_slug=gpu_slug,
        gpu_spec=gpu_spec,
        precisions=precisions,
        world_size=world_size,
        report_root=_report_root(config),
        update_baselines=config.getoption("--update-baselines"),
        accept_regression=config.getoption("--accept-regression"),
        model_sizes=model_sizes,
        size_table=size_table,
        staging_dir=staging,
        command=" ".join(["pytest", *config.invocation_params.args]),
        baseline_dir=config.rootpath / "perf" / "baselines",
        time_budget_s=time_budget_s,
        started=time.monotonic(),
    )


def _report_root(config: pytest.Config) -> Path:
    """--report-dir, relative to the folder pytest was started in; by default `reports/` in the rootdir, so a run
    from a subfolder (`cd perf && pytest test_e2e.py`) writes where a run from the root does."""
    from cs336_systems.reports import REPORTS_DIR_NAME

    chosen = config.getoption("--report-dir")
    if chosen is None:
        return config.rootpath / REPORTS_DIR_NAME
    return (config.invocation_params.dir / chosen).resolve()


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    """pytest-xdist: hand each worker the controller's staging directory."""
    node.workerinput[_STAGING_KEY] = str(settings(node.config).staging_dir)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    run = settings(config)
    gpus = torch.cuda.device_count() if run.on_gpu else 0
    for item in items:
        if "gpu" in item.keywords and not run.on_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (run is on CPU)"))
        if "multigpu" in item.keywords and gpus < run.world_size:
            item.add_marker(pytest.mark.skip(reason=f"needs {run.world_size} CUDA GPUs, {gpus} present"))


def pytest_runtest_setup(item: pytest.Item) -> None:
    run = settings(item.config)
    if run.time_budget_s is not None and time.monotonic() - run.started > run.time_budget_s:
        pytest.skip(f"--time-budget {run.time_budget_s:g} s was spent before this test started")


def pytest_unconfigure(config: pytest.Config) -> None:
    if _restore_interpretation_key in config.stash:
        config.stash[_restore_interpretation_key]()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    run = settings(metafunc.config)
    if "precision" in metafunc.fixturenames and "precision" not in _parametrized(metafunc):
        metafunc.parametrize("precision", run.precisions)
    if "model_size" in metafunc.fixturenames and "model_size" not in _parametrized(metafunc):
        metafunc.parametrize("model_size", run.model_sizes)
    if "distributed_device" in metafunc.fixturenames:
        # Where a distributed benchmark's ranks run: one GPU each over NCCL (skipped without
        # --world-size GPUs), or CPU processes over gloo. Module scope, so a module fixture that
        # launches the ranks once can take it.
        device = pytest.param("cuda", marks=pytest.mark.multigpu) if run.on_gpu else "cpu"
        metafunc.parametrize("distributed_device", [device], scope="module")


def _parametrized(metafunc: pytest.Metafunc) -> set[str]:
    return {name for marker in metafunc.definition.iter_markers("parametrize")
            for name in (marker.args[0].split(",") if isinstance(marker.args[0], str) else marker.args[0])}


# ----------------------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="session")
def run_settings(pytestconfig) -> Settings:
    """Everything the command line chose: GPU, precisions, world size, report and baseline paths."""
    return settings(pytestconfig)


@pytest.fixture(scope="session")
def gpu_spec(run_settings):
    """The GpuSpec of the GPU in use (peak FLOP/s, bandwidth, memory), or None on CPU."""
    return run_settings.gpu_spec


@pytest.fixture(scope="session")
def device(run_settings):
    """torch.device("cuda") on a GPU run, torch.device("cpu") otherwise."""
    import torch

    return torch.device("cuda" if run_settings.on_gpu else "cpu")


@pytest.fixture
def dtype(precision):
    """The torch dtype of the `precision` parameter (fp32, bf16, fp16)."""
    from cs336_systems.precision import Precision

    return Precision.named(precision).dtype


@pytest.fixture(scope="session")
def world_size(run_settings) -> int:
    """--world-size: how many ranks distributed benchmarks use."""
    return run_settings.world_size


@pytest.fixture(scope="session")
def spawn(device):
    """spawn(fn, world_size, *args, **kwargs) -> results by rank; see cs336_systems.distributed.launch."""
    from cs336_systems.distributed.launch import launch

    return functools.partial(launch, device=device.type)


@pytest.fixture(scope="session")
def report(run_settings):
    """report("<problem>") -> a writer whose .add(row) lands in reports/<gpu>/<problem>.md and .csv."""
    from cs336_systems.reports.staging import ProblemReport

    return functools.cache(lambda problem: ProblemReport(problem, run_settings.staging_dir, _worker(),
                                                         run_settings.size_table))


def _worker() -> str:
    """This process's name among pytest-xdist's workers ("main" without xdist): its staged files carry it."""
    return os.environ.get("PYTEST_XDIST_WORKER", "main")


@pytest.fixture(scope="session")
def speedup_gate(run_settings):
    """speedup_gate(name, slow_ms, fast_ms, *, promise, note=""): the ratio slow/fast against its floor, the
    higher of `promise` (the least ratio the calling test guarantees) and the baseline less its tolerance.
    Fails or skips as cs336_systems.baselines.SpeedupGates says; with --update-baselines the ratio is
    recorded when the session ends."""
    from cs336_systems.baselines import SpeedupGates
    from cs336_systems.reports.staging import stage_ratio

    gates = SpeedupGates(run_settings.baseline_path, run_settings.update_baselines, run_settings.accept_regression)

    def gate(name: str, slow_ms: float | None, fast_ms: float | None, *, promise: float, note: str = "") -> float:
        verdict = gates.judge(name, slow_ms, fast_ms, promise, note)
        if verdict.failure:
            pytest.fail(verdict.failure)
        if verdict.skip:
            pytest.skip(verdict.skip)
        if verdict.record is not None:
            stage_ratio(run_settings.staging_dir, _worker(), name, verdict.record)
        return verdict.ratio

    return gate


# ------------------------------------------------------------------------------------ session end

def pytest_sessionfinish(session: pytest.Session) -> None:
    """Write the staged rows into reports, the reports' index, and the staged ratios into the baseline
    file (cs336_systems.reports.staging.publish); a report that cannot be written fails the session."""
    config = session.config
    if hasattr(config, "workerinput") or _settings_key not in config.stash:
        return  # xdist workers leave merging to the controller
    from cs336_systems.reports.staging import publish

    run = settings(config)
    written, errors = publish(run.staging_dir, run.report_dir, run.report_root, run.on_gpu, run.command,
                              run.baseline_path)
    config.stash[_written_key] = written
    config.stash[_errors_key] = errors
    if errors and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


_written_key = pytest.StashKey[list]()
_errors_key = pytest.StashKey[list]()


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    written, errors = config.stash.get(_written_key, []), config.stash.get(_errors_key, [])
    if written:
        terminalreporter.section("cs336-systems reports")
        for path in written:
            terminalreporter.write_line(str(path))
    if errors:
        terminalreporter.section("cs336-systems reports not written", red=True)
        for error in errors:
            terminalreporter.write_line(error)
