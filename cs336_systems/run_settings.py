"""What a benchmark run chose: its GPU, precisions, ranks and model sizes, and where its reports and baselines go.

    run = choose_settings(gpu="none", precision="fp32,bf16", world_size=2, model_sizes=None, size_table="2026",
                          ...)

The pytest plugin reads each choice from its option (or the ini setting that mirrors it) and hands it here.
Every choice is checked before anything is created, so that a bad one is a ValueError naming its option
and leaves nothing behind; nothing here imports the Triton kernels (cs336_systems.interpretation says why
that matters).
"""

from __future__ import annotations

import time
from collections.abc import Container, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The markers tests are selected by (`-m ddp`); `gpu` and `multigpu` also say what a test needs (unmet_needs).
MARKERS = {
    "e2e": "end-to-end model benchmarks (benchmarking_script, mixed precision, compiled model)",
    "profile": "kernel tables from torch.profiler and NVTX ranges (nsys_profile)",
    "memory": "memory snapshots, peak tables and activation checkpointing",
    "attention": "attention sweeps (pytorch_attention, torch_compile attention part)",
    "flash": "FlashAttention-2 correctness and benchmarks",
    "ddp": "distributed data parallel and the all-reduce benchmark",
    "sharding": "optimizer-state sharding",
    "fsdp": "fully sharded data parallel",
    "leaderboard": "the 2026 leaderboard's training step of the 8B-class model",
    "accounting": "closed-form memory, FLOP and communication models",
    "gpu": "needs a CUDA GPU; skipped when the run is on CPU",
    "multigpu": "needs --world-size CUDA GPUs; skipped when fewer are present",
    "slow": "takes more than a few seconds on a CPU",
    "adapters": "adapters(name, ...): needs these adapter functions of the implementation under test; skipped, "
                "naming them, where it lacks one",
}
DEFAULT_PRECISIONS = "fp32,bf16"
DEFAULT_WORLD_SIZE = 2
# A CPU run is a smoke run of the same code: the smallest model only.
CPU_MODEL_SIZES = ("tiny",)


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
    # (reference, least ratio of its time over the implementation under test's) at the flash gate's cell
    under_test_promises: tuple[tuple[str, float], ...] = ()

    @property
    def on_gpu(self) -> bool:
        return self.gpu_slug != "cpu"

    @property
    def report_dir(self) -> Path:
        return self.report_root / self.gpu_slug

    @property
    def baseline_path(self) -> Path:
        return self.baseline_dir / f"{self.gpu_slug}.json"

    def unmet_needs(self, markers: Container[str]) -> list[str]:
        """Why a test marked with `markers` cannot run here: a `gpu` test on a CPU run, a `multigpu` one with
        fewer than world_size GPUs."""
        unmet = []
        if "gpu" in markers and not self.on_gpu:
            unmet.append("needs a CUDA GPU (run is on CPU)")
        if "multigpu" in markers:
            import torch

            gpus = torch.cuda.device_count() if self.on_gpu else 0
            if gpus < self.world_size:
                unmet.append(f"needs {self.world_size} CUDA GPUs, {gpus} present")
        return unmet

    def budget_spent(self) -> str | None:
        """Why a test starting now is skipped: the run's time budget is spent; None while it is not."""
        if self.time_budget_s is not None and time.monotonic() - self.started > self.time_budget_s:
            return f"--time-budget {self.time_budget_s:g} s was spent before this test started"
        return None


def choose_settings(*, gpu: str, precision: str, world_size: int, model_sizes: str | None, size_table: str,
                    report_root: Path, update_baselines: bool, accept_regression: bool, time_budget_s: float | None,
                    command: str, baseline_dir: Path, staging_dir: Path | None = None,
                    under_test_promises: Sequence[str] = ()) -> Settings:
    """The run's settings from its choices, as the options spell them; `staging_dir` is the run's own (a
    pytest-xdist worker's controller made it) or, when None, a new one, made once every choice is known
    to be good."""
    from cs336_systems.gpus import resolve_gpu
    from cs336_systems.model import SIZE_TABLES

    try:
        gpu_slug, gpu_spec = resolve_gpu(gpu)
    except ValueError as error:
        raise ValueError(f"--gpu: {error}") from None
    if world_size < 1:
        raise ValueError(f"--world-size must be at least 1, got {world_size}")
    if time_budget_s is not None and not time_budget_s >= 0:
        raise ValueError(f"--time-budget must be at least 0 seconds, got {time_budget_s:g}")
    if report_root.exists() and not report_root.is_dir():
        raise ValueError(f"--report-dir {report_root} is a file, not a folder")
    if accept_regression and not update_baselines:
        raise ValueError("--accept-regression only applies with --update-baselines")
    if size_table not in SIZE_TABLES:
        raise ValueError(f"--size-table: unknown size table {size_table!r}; choose one of {', '.join(SIZE_TABLES)}")
    precisions = parse_precisions(precision)
    sizes = parse_model_sizes(model_sizes, gpu_slug != "cpu", size_table)
    promises = parse_promises(under_test_promises)
    if staging_dir is None:
        from cs336_systems.reports.staging import new_staging_dir

        staging_dir = new_staging_dir()
    return Settings(gpu_slug=gpu_slug, gpu_spec=gpu_spec, precisions=precisions, world_size=world_size,
                    report_root=report_root, update_baselines=update_baselines, accept_regression=accept_regression,
                    model_sizes=sizes, size_table=size_table, staging_dir=staging_dir, command=command,
                    baseline_dir=baseline_dir, time_budget_s=time_budget_s, started=time.monotonic(),
                    under_test_promises=promises)


def parse_precisions(value: str) -> tuple[str, ...]:
    """--precision: comma-separated precision names, or all."""
    from cs336_systems.precision import PRECISIONS

    chosen = tuple(PRECISIONS) if value == "all" else tuple(p.strip() for p in value.split(",") if p.strip())
    unknown = [p for p in chosen if p not in PRECISIONS]
    if unknown or not chosen:
        raise ValueError(f"--precision: unknown {', '.join(unknown) or repr(value)}; "
                         f"use any of {', '.join(PRECISIONS)} (comma-separated), or all")
    _refuse_repeats("--precision", chosen)
    return chosen


def parse_promises(declared: Sequence[str]) -> tuple[tuple[str, float], ...]:
    """--adapters-promise: REFERENCE=RATIO declarations, each the least ratio of the reference's time over the
    implementation under test's at the flash speed-up gate's cell (1 for "at least as fast as")."""
    from cs336_systems.rows.flash import UNDER_TEST_REFERENCES

    promises = []
    for text in declared:
        reference, equals, ratio = (part.strip() for part in text.partition("="))
        if not equals or reference not in UNDER_TEST_REFERENCES:
            raise ValueError(f"--adapters-promise {text!r}: write REFERENCE=RATIO, REFERENCE one of "
                             f"{', '.join(UNDER_TEST_REFERENCES)} (sdpa_flash=1.0: at least as fast as "
                             "FlashAttention-2)")
        try:
            least = float(ratio)
        except ValueError:
            least = float("nan")
        if not least > 0:
            raise ValueError(f"--adapters-promise {text!r}: the ratio must be a number above 0, got {ratio!r}")
        promises.append((reference, least))
    _refuse_repeats("--adapters-promise", tuple(reference for reference, _ in promises))
    return tuple(promises)


def parse_model_sizes(value: str | None, on_gpu: bool, size_table: str) -> tuple[str, ...]:
    """--model-sizes: comma-separated sizes of `size_table`, in any case; None: every size of it on a GPU,
    CPU_MODEL_SIZES on a CPU."""
    from cs336_systems.model import model_sizes, size_name

    table = model_sizes(size_table)
    if value is None:
        return tuple(s for s in table if s not in CPU_MODEL_SIZES) if on_gpu else CPU_MODEL_SIZES
    sizes = tuple(size_name(s.strip(), size_table) for s in value.split(",") if s.strip())
    unknown = [s for s in sizes if s not in table]
    if unknown or not sizes:
        raise ValueError(f"--model-sizes: unknown {', '.join(unknown) or repr(value)} in the {size_table} "
                         f"size table; choose from {', '.join(table)} (--size-table picks the table)")
    _refuse_repeats("--model-sizes", sizes)
    return sizes


def _refuse_repeats(option: str, values: tuple[str, ...]) -> None:
    """A value given twice would run every test of it twice, under two ids."""
    from cs336_systems.checks import repeated

    if twice := repeated(values):
        raise ValueError(f"{option}: {', '.join(twice)} given more than once")
