"""pytest glue: options (each mirrored by an ini setting), markers, fixtures. The logic lives in the library
(run_settings, interpretation, baselines, reports.staging, conformance.contract, benchmark_store); this only
wires it. Registered through the package's pytest11 entry point wherever it is installed, and by this
repository's root conftest.py where it is not (under the entry point's name, so never twice); works under
pytest-xdist, whose workers stage rows that the controller merges when the session ends.

The entry point loads the plugin into every pytest run of the environment, so it acts only in a run that is its
own, which pytest_configure decides before it imports anything heavy:
- a run that names the plugin: `-p cs336_systems.pytest_plugin`, or a conftest.py's pytest_plugins (this
  repository's root conftest.py does: `pytest tests/` and `pytest perf/` from any folder);
- a run of the tests shipped inside this package: an argument that is a path into it, or its module name under
  --pyargs (`pytest --pyargs cs336_systems.conformance`);
- a run given any of the plugin's options, on the command line or in the ini file (`--adapters`, `--gpu`, ...).
Any other run, such as one in another project's folder, gets the options (`pytest --help` lists them; adding them
imports nothing heavy) and nothing else: no marker, hook or fixture of ours, no torch imported, TRITON_INTERPRET
as it was."""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cs336_systems.rows.flash import UNDER_TEST_REFERENCES
from cs336_systems.run_settings import CPU_MODEL_SIZES, DEFAULT_PRECISIONS, DEFAULT_WORLD_SIZE, MARKERS, Settings

_STAGING_KEY = "cs336_staging_dir"
_settings_key = pytest.StashKey[Settings]()
_restore_interpretation_key = pytest.StashKey[Callable[[], None]]()
_published_key = pytest.StashKey[tuple[list, list]]()  # the lines the session's end wrote, and its errors
_adapters_key = pytest.StashKey[Any]()  # the implementation under test: a conformance.contract.Adapters
_PACKAGE_DIR = Path(__file__).resolve().parent

# Each option, mirrored by the ini setting of its dest's name (as pytest-xdist's are; the command line wins):
# its help, and what else argparse (and, for "ini_type", addini) is told. No default here: pytest_configure
# applies them, so that an option given anywhere can be told from one left out.
_OPTIONS: dict[str, dict[str, Any]] = {
    "gpu": dict(help="auto (detect; the default), none (CPU, Triton interpreter), or a GPU name from "
                     "cs336_systems.gpus (a100, h100, h200, b200, ...): sets the spec used for MFU columns and the "
                     "baseline file"),
    "world-size": dict(help=f"ranks for distributed benchmarks (default {DEFAULT_WORLD_SIZE})", type=int),
    "precision": dict(help="comma-separated precision names (those of cs336_systems.precision: fp32, bf16, ...), "
                           f"or all (default {DEFAULT_PRECISIONS})"),
    "report-dir": dict(help="where reports go; each GPU gets a subdirectory (default: reports/ in pytest's "
                            "rootdir, the repository's root, from any folder; an ini setting is relative to the ini "
                            "file's folder)"),
    "update-baselines": dict(help="write measured speed-up ratios to perf/baselines/<gpu>.json instead of gating",
                             action="store_true", ini_type="bool"),
    "accept-regression": dict(help="with --update-baselines: record ratios below the current baseline, even past "
                                   "its tolerance (otherwise a lower ratio leaves the baseline as it was, and one "
                                   "past tolerance is refused)", action="store_true", ini_type="bool"),
    "time-budget": dict(help="skip the tests not started within SECONDS of the session's start; the ones measured "
                             "so far still reach the reports (for a sweep with a deadline)", type=float,
                        metavar="SECONDS"),
    "model-sizes": dict(help="comma-separated model sizes for the model benchmarks, in any case (default: every "
                             f"size of the size table on a GPU, {','.join(CPU_MODEL_SIZES)} on CPU)"),
    "size-table": dict(help="the handout whose model-size table sizes are looked up in: 2026 (xl = "
                            "2560/10240/32/32, and 10B; the default) or 2025 (xl = 1600/6400/48/25, and 2.7B)"),
    "adapters": dict(help="the implementation under test: a module name or a .py file implementing the course's "
                          "adapter functions (tests/adapters.py of a course repository); default: this project's "
                          "own (cs336_systems.adapters)", metavar="MODULE_OR_FILE"),
    "adapters-promise": dict(help="a speed-up the implementation under test must hold at the flash gate's cell, "
                                  "REFERENCE=RATIO: the reference's time over its Triton Function's is at least RATIO "
                                  "(sdpa_flash=1.0: at least as fast as FlashAttention-2; references: "
                                  f"{', '.join(UNDER_TEST_REFERENCES)}); repeatable, an ini setting of one a line",
                             action="append", metavar="REFERENCE=RATIO", ini_type="linelist"),
}


def settings(config: pytest.Config) -> Settings:
    return config.stash[_settings_key]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("cs336", "cs336-systems")
    for option, spec in _OPTIONS.items():
        spec = dict(spec)
        ini_type = spec.pop("ini_type", "string")
        group.addoption(f"--{option}", default=None, **spec)
        parser.addini(_dest(option), f"the value of --{option} where the command line gives none", type=ini_type,
                      default=None)


def _dest(option: str) -> str:
    return option.replace("-", "_")


def _option(config: pytest.Config, name: str, convert: Callable[[str], Any] | None = None,
            default: Any = None) -> Any:
    """Option `name` (its dest) from the command line, else its ini setting's text parsed by `convert`, else
    `default`."""
    value = config.getoption(name)
    if value is None:
        try:
            value = config.getini(name)
        except (ValueError, pytest.UsageError) as error:  # a bool pytest cannot read: "invalid truth value 'maybe'"
            raise pytest.UsageError(f"the {name} ini setting: {error}") from None
    if value is None:
        return default
    try:
        return convert(value) if convert and isinstance(value, str) else value
    except ValueError:
        raise pytest.UsageError(f"the {name} ini setting: invalid {convert.__name__} value: {value!r}") from None


def _is_its_own_run(config: pytest.Config) -> bool:
    """Whether the run is the plugin's own (the module's docstring gives the rule)."""
    named_by = [*config.option.plugins, *(name for plugin in config.pluginmanager.get_plugins()
                                          for name in _names_in_pytest_plugins(plugin))]
    return (__name__ in named_by
            or any(_is_in_this_package(arg, config) for arg in config.args)
            or any(_given(config, _dest(option)) for option in _OPTIONS))


def _given(config: pytest.Config, name: str) -> bool:
    """Whether option `name` (its dest) is given, on the command line or in the ini file."""
    try:
        return config.getoption(name) is not None or config.getini(name) is not None
    except (ValueError, pytest.UsageError):  # given, but unreadable: pytest_configure's _option says why
        return True


def _names_in_pytest_plugins(plugin: object) -> tuple[str, ...]:
    """The plugins a module (a conftest.py) names in its pytest_plugins: a name, or a sequence of them."""
    names = getattr(plugin, "pytest_plugins", ())
    return (names,) if isinstance(names, str) else tuple(names)


def _is_in_this_package(arg: str, config: pytest.Config) -> bool:
    """Whether a command-line argument (a path or node id; a module name under --pyargs) lies in this package."""
    target = arg.split("::")[0]
    if config.option.pyargs and (target == __package__ or target.startswith(f"{__package__}.")):
        return True
    return (config.invocation_params.dir / target).resolve().is_relative_to(_PACKAGE_DIR)


def pytest_configure(config: pytest.Config) -> None:
    if not _is_its_own_run(config):
        return
    # Registered before the kernels' mode is decided, so that its pytest_unconfigure puts the mode back even
    # where a choice below is refused.
    config.pluginmanager.register(_OwnRun, f"{__name__}.own_run")
    for name, description in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {description}")
    from cs336_systems.interpretation import interpret_kernels
    from cs336_systems.run_settings import choose_settings

    worker_input = getattr(config, "workerinput", None)
    # Before anything else is imported (choose_settings imports the reports, and through them code that imports
    # triton): cs336_systems.interpretation says why the kernels' mode must be decided first.
    gpu = _option(config, "gpu", default="auto")
    try:
        config.stash[_restore_interpretation_key] = interpret_kernels(_on_gpu(gpu))
    except RuntimeError as error:
        raise pytest.UsageError(str(error)) from None
    from cs336_systems.model import DEFAULT_SIZE_TABLE

    try:
        run = choose_settings(gpu=gpu, precision=_option(config, "precision", default=DEFAULT_PRECISIONS),
                              world_size=_option(config, "world_size", int, default=DEFAULT_WORLD_SIZE),
                              model_sizes=_option(config, "model_sizes"),
                              size_table=_option(config, "size_table", default=DEFAULT_SIZE_TABLE),
                              update_baselines=_option(config, "update_baselines", default=False),
                              accept_regression=_option(config, "accept_regression", default=False),
                              time_budget_s=_option(config, "time_budget", float), report_root=_report_root(config),
                              command=" ".join(["pytest", *config.invocation_params.args]),
                              baseline_dir=config.rootpath / "perf" / "baselines",
                              staging_dir=Path(worker_input[_STAGING_KEY]) if worker_input else None,
                              under_test_promises=_option(config, "adapters_promise", default=()))
    except ValueError as error:
        raise pytest.UsageError(str(error)) from None
    config.stash[_settings_key] = run
    config.stash[_adapters_key] = adapters = _adapters(config)
    if run.under_test_promises and adapters.is_own:
        raise pytest.UsageError("--adapters-promise declares what an implementation under test promises: name it "
                                "with --adapters (this project's own kernels hold the promises of their own gates)")


def _on_gpu(gpu: str) -> bool:
    """Whether --gpu chose a GPU run. A choice this machine cannot run is the usage error named, before the
    kernels' mode is decided: where triton was already imported (a plugin test in a GPU run's process), that
    decision's own error would hide it."""
    from cs336_systems.gpus import resolve_gpu

    try:
        return resolve_gpu(gpu)[0] != "cpu"
    except ValueError as error:
        raise pytest.UsageError(f"--gpu: {error}") from None


def _adapters(config: pytest.Config):
    """--adapters (its ini setting read from the ini file's folder), imported now: a module that cannot be
    imported is a usage error before any test runs."""
    from cs336_systems.conformance.contract import AdaptersImportError, load_adapters

    chosen, relative_to = config.getoption("adapters"), config.invocation_params.dir
    if chosen is None and (chosen := config.getini("adapters")) is not None:
        relative_to = config.inipath.parent if config.inipath else config.rootpath
    try:
        return load_adapters(chosen, relative_to)
    except AdaptersImportError as error:
        raise pytest.UsageError(str(error)) from None


def _report_root(config: pytest.Config) -> Path:
    """--report-dir from the folder pytest started in (its ini setting from the ini file's); by default reports/ in
    the rootdir, so a run from a subfolder (`cd perf && pytest test_e2e.py`) writes where one from the root does."""
    from cs336_systems.reports import REPORTS_DIR_NAME

    chosen, relative_to, source = config.getoption("report_dir"), config.invocation_params.dir, "--report-dir"
    if chosen is None:
        chosen, relative_to = config.getini("report_dir"), config.inipath.parent if config.inipath else config.rootpath
        source = "the report_dir ini setting"
    if chosen is not None and not chosen.strip():
        raise ValueError(f"{source} is empty; name the folder reports go to")
    return config.rootpath / REPORTS_DIR_NAME if chosen is None else (relative_to / chosen).resolve()


def _parametrized(metafunc: pytest.Metafunc) -> set[str]:
    return {name for marker in metafunc.definition.iter_markers("parametrize")
            for name in (marker.args[0].split(",") if isinstance(marker.args[0], str) else marker.args[0])}


def _worker() -> str:
    """This process's name among pytest-xdist's workers ("main" without xdist): its staged files carry it."""
    return os.environ.get("PYTEST_XDIST_WORKER", "main")


class _OwnRun:
    """The hooks and fixtures of a run that is the plugin's own, registered (the class itself, as a namespace: its
    functions take no self) by pytest_configure: in any other run no fixture of these names exists."""

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(node) -> None:
        """pytest-xdist: hand each worker the controller's staging directory."""
        node.workerinput[_STAGING_KEY] = str(settings(node.config).staging_dir)

    def pytest_report_header(config: pytest.Config) -> list[str]:
        from cs336_systems.conformance.contract import ADAPTER_FUNCTIONS

        adapters = config.stash[_adapters_key]
        lines = [f"cs336-systems: implementation under test: {adapters.label}"]
        if lacking := adapters.why_missing(*ADAPTER_FUNCTIONS):
            lines.append(f"cs336-systems: {lacking}: the tests and benchmarks that need them skip or leave them out")
        return lines

    def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
        adapters = config.stash[_adapters_key]
        for item in items:
            reasons = settings(config).unmet_needs(item.keywords)
            reasons += [reason for marker in item.iter_markers("adapters")
                        if (reason := adapters.why_missing(*marker.args))]
            for reason in reasons:
                item.add_marker(pytest.mark.skip(reason=reason))

    def pytest_runtest_setup(item: pytest.Item) -> None:
        if spent := settings(item.config).budget_spent():
            pytest.skip(spent)

    def pytest_unconfigure(config: pytest.Config) -> None:
        config.stash.get(_restore_interpretation_key, lambda: None)()

    def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
        run = settings(metafunc.config)
        if "precision" in metafunc.fixturenames and "precision" not in _parametrized(metafunc):
            metafunc.parametrize("precision", run.precisions)
        if "model_size" in metafunc.fixturenames and "model_size" not in _parametrized(metafunc):
            metafunc.parametrize("model_size", run.model_sizes)
        if "distributed_device" in metafunc.fixturenames:
            # Where a distributed benchmark's ranks run: one GPU each over NCCL (skipped without --world-size GPUs),
            # or CPU processes over gloo. Module scope, so a module fixture that launches the ranks once can take it.
            device = pytest.param("cuda", marks=pytest.mark.multigpu) if run.on_gpu else "cpu"
            metafunc.parametrize("distributed_device", [device], scope="module")

    # ------------------------------------------------------------------------------------- fixtures

    @pytest.fixture(scope="session")
    def run_settings(pytestconfig) -> Settings:
        """Everything the command line chose: GPU, precisions, world size, report and baseline paths."""
        return settings(pytestconfig)

    @pytest.fixture(scope="session")
    def adapters(pytestconfig):
        """The implementation under test (--adapters; this project's own by default), a
        cs336_systems.conformance.contract.Adapters: `.function(name)`, and `.spec` for ranks to import it again.
        Mark a test `@pytest.mark.adapters("get_ddp", ...)` to skip it, naming them, where the module lacks one."""
        return pytestconfig.stash[_adapters_key]

    @pytest.fixture(scope="session")
    def implementation_under_test(adapters):
        """The adapters of an implementation under test other than this project's own, which a benchmark measures
        beside its references; skips the test without --adapters, where this project's own, the references, are it."""
        if adapters.is_own:
            pytest.skip("no --adapters: the implementation under test is this project's own, which the references "
                        "measure")
        return adapters

    @pytest.fixture(scope="session")
    def benchmark_store(pytestconfig):
        """benchmark_store.add_rows(problem, rows, cell_columns, compared): each timed row's samples (ms, as the
        benchmark measured them) as an entry of pytest-benchmark's store; inert without pytest-benchmark, or where it
        is disabled (cs336_systems.benchmark_store)."""
        from cs336_systems.benchmark_store import BenchmarkStore

        return BenchmarkStore.of(pytestconfig)

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

    @pytest.fixture(scope="session")
    def speedup_gate(run_settings):
        """speedup_gate(name, slow_ms, fast_ms, *, promise, note=""): the ratio slow/fast against its floor, the higher
        of `promise` (the least ratio the calling test guarantees) and the baseline less its tolerance; fails, skips
        or records it (--update-baselines, when the session ends) as cs336_systems.baselines.SpeedupGates says."""
        from cs336_systems.baselines import MissingBaselineWarning, SpeedupGates
        from cs336_systems.reports.staging import stage_ratio

        gates = SpeedupGates(run_settings.baseline_path, run_settings.on_gpu, run_settings.update_baselines,
                             run_settings.accept_regression)

        def gate(name: str, slow_ms: float | None, fast_ms: float | None, *, promise: float, note: str = "") -> float:
            verdict = gates.judge(name, slow_ms, fast_ms, promise, note)
            if verdict.failure:
                pytest.fail(verdict.failure)
            if verdict.skip:
                pytest.skip(verdict.skip)
            if verdict.warning:
                warnings.warn(MissingBaselineWarning(verdict.warning), stacklevel=2)
            if verdict.record is not None:
                stage_ratio(run_settings.staging_dir, _worker(), name, verdict.record)
            return verdict.ratio

        return gate

    # ----------------------------------------------------------------------------------- session end

    def pytest_sessionfinish(session: pytest.Session) -> None:
        """Write the staged rows into reports, the reports' index, and the staged ratios into the baseline
        file (cs336_systems.reports.staging.publish); a report that cannot be written fails the session."""
        config = session.config
        if hasattr(config, "workerinput"):
            return  # xdist workers leave merging to the controller
        from cs336_systems.reports.staging import publish

        run = settings(config)
        written, errors = publish(run.staging_dir, run.report_dir, run.report_root, run.on_gpu, run.command,
                                  run.baseline_path)
        config.stash[_published_key] = written, errors
        if errors and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
        from cs336_systems.benchmark_store import BenchmarkStore

        if note := BenchmarkStore.of(config).disabled_note(config):
            terminalreporter.section("cs336-systems timings", yellow=True)
            terminalreporter.write_line(note)
        written, errors = config.stash.get(_published_key, ([], []))
        for title, lines, red in (("cs336-systems reports", written, False),
                                  ("cs336-systems reports not written", errors, True)):
            if lines:
                terminalreporter.section(title, red=red)
                for line in lines:
                    terminalreporter.write_line(str(line))
