"""The pytest plugin, exercised in isolated pytest runs (pytester)."""

import json
import os
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cs336_systems.runs import read_rows
from tests.inner_runs import pythonpath_with_this_checkout, runpytest

PLUGIN = ["-p", "cs336_systems.pytest_plugin", "-p", "no:cacheprovider"]
REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def importable_package(monkeypatch):
    """Subprocess runs import the plugin whether or not the package is installed."""
    monkeypatch.setenv("PYTHONPATH", pythonpath_with_this_checkout())


def run(pytester, *args, subprocess=False):
    if subprocess:
        return pytester.runpytest_subprocess(*PLUGIN, "--gpu", "none", *args)
    return runpytest(pytester, *PLUGIN, "--gpu", "none", *args)


def test_markers_are_registered_and_strict(pytester):
    pytester.makepyfile("""
        import pytest
        @pytest.mark.e2e
        @pytest.mark.ddp
        @pytest.mark.fsdp
        def test_marked():
            pass
    """)
    run(pytester, "--strict-markers").assert_outcomes(passed=1)


def test_a_conftest_that_names_the_plugin_makes_a_run_its_own_from_any_folder(pytester, monkeypatch):
    """As this repository's root conftest.py does: `pytest tests/` from another folder, with no option of ours."""
    pytester.makeini("[pytest]\naddopts = --strict-markers\n")
    pytester.makeconftest('pytest_plugins = ["cs336_systems.pytest_plugin"]')
    (pytester.path / "tests").mkdir()
    (pytester.path / "tests" / "test_ours.py").write_text(textwrap.dedent("""
        import pytest
        @pytest.mark.flash
        def test_ours(run_settings, adapters):
            assert adapters.is_own
    """))
    (pytester.path / "elsewhere").mkdir()
    monkeypatch.chdir(pytester.path / "elsewhere")
    runpytest(pytester, "-p", "no:cacheprovider", "../tests").assert_outcomes(passed=1)


def test_gpu_none_runs_triton_in_the_interpreter(pytester, monkeypatch):
    pytester.makepyfile("""
        import os
        def test_env(device, gpu_spec, run_settings):
            assert os.environ["TRITON_INTERPRET"] == "1"
            assert device.type == "cpu" and gpu_spec is None and run_settings.gpu_slug == "cpu"
    """)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # as in a GPU run
    run(pytester).assert_outcomes(passed=1)
    # A run inside this process leaves no Triton mode behind: kernels that inductor compiled later for
    # the GPU would run in the interpreter.
    assert "TRITON_INTERPRET" not in os.environ


def test_named_gpu_sets_the_spec_and_skips_gpu_tests_without_one(pytester):
    pytester.makepyfile("""
        import pytest
        def test_spec(request):
            from cs336_systems.pytest_plugin import settings
            assert settings(request.config).gpu_spec is None
        @pytest.mark.gpu
        def test_needs_gpu():
            raise AssertionError("must be skipped on CPU")
        @pytest.mark.multigpu
        def test_needs_gpus():
            raise AssertionError("must be skipped on CPU")
    """)
    run(pytester).assert_outcomes(passed=1, skipped=2)


def test_time_budget_skips_tests_that_would_start_after_it(pytester):
    pytester.makepyfile("""
        import time
        def test_first():
            time.sleep(2.5)
        def test_second():
            raise AssertionError("started after the budget was spent")
    """)
    result = run(pytester, "--time-budget", "2", "-rs")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["*--time-budget 2 s was spent before this test started*"])
    run(pytester, "--time-budget", "60").assert_outcomes(passed=1, failed=1)


def test_negative_time_budget_is_a_usage_error(pytester):
    result = run(pytester, "--time-budget", "-1")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--time-budget must be at least 0 seconds, got -1*"])


@pytest.mark.parametrize("args, message", [
    (["--time-budget", "nan"], "--time-budget must be at least 0 seconds, got nan"),
    (["--precision", "fp32, fp32"], "--precision: fp32 given more than once"),
    (["--model-sizes", "tiny,tiny"], "--model-sizes: tiny given more than once"),
    (["--report-dir", ""], "--report-dir is empty"),
    (["--report-dir", "a-file"], "is a file, not a folder"),
])
def test_an_option_that_would_run_nothing_or_twice_or_lose_the_reports_is_a_usage_error(pytester, args, message):
    pytester.makepyfile(ROW_WRITING_TEST)
    (pytester.path / "a-file").write_text("")
    result = run(pytester, *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*{message}*"])


def test_unknown_gpu_is_a_usage_error(pytester):
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest(*PLUGIN, "--gpu", "v100")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--gpu: unknown GPU 'v100'*"])


@pytest.mark.parametrize("option, count", [("fp32", 1), ("fp32,fp16", 2), ("all", 3)])
def test_precision_option_parametrizes_tests(pytester, option, count):
    pytester.makepyfile("""
        import torch
        def test_p(precision, dtype):
            assert dtype in (torch.float32, torch.bfloat16, torch.float16)
    """)
    run(pytester, "--precision", option).assert_outcomes(passed=count)


def test_bad_precision_and_world_size_are_usage_errors(pytester):
    pytester.makepyfile("def test_x(): pass")
    result = run(pytester, "--precision", "fp32,fp64")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: --precision: unknown fp64; use any of fp32, bf16, fp16 (comma-separated), "
                                 "or all"])
    assert run(pytester, "--world-size", "0").ret == pytest.ExitCode.USAGE_ERROR


ROW_WRITING_TEST = """
    def test_row(report):
        report("_plugin_problem").add(x=1)
"""


def test_a_named_gpu_this_machine_lacks_is_a_usage_error_that_writes_nothing(pytester, monkeypatch):
    # A process that sees no GPU, on any machine: in this one, on a GPU, triton is already imported compiled.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    pytester.makepyfile(ROW_WRITING_TEST)
    result = pytester.runpytest_subprocess(*PLUGIN, "--gpu", "h100", "--report-dir", "out")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: --gpu: h100 is the NVIDIA H100 80GB HBM3, but torch sees no CUDA GPU on "
                                 "this machine; pass none (or auto) to run on the CPU"])
    assert "Traceback" not in result.stderr.str() and not (pytester.path / "out").exists()


def test_a_gpu_choice_this_machine_cannot_run_is_named_before_the_kernels_mode_is_decided(pytester, monkeypatch):
    """The kernels' mode is decided for the GPU asked for: where that choice is refused and triton was already
    imported compiled (a plugin test in a GPU run's process), the refused choice is the error named."""
    import torch

    from cs336_systems import interpretation

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(interpretation, "mixed_mode_problem", lambda kernels_interpreted: "triton imported compiled")
    pytester.makepyfile(ROW_WRITING_TEST)
    result = pytester.runpytest(*PLUGIN, "--gpu", "h100", "--report-dir", "out")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: --gpu: h100 is the NVIDIA H100 80GB HBM3, but torch sees no CUDA GPU*"])
    assert "triton imported compiled" not in result.stderr.str()


def test_a_report_that_cannot_be_written_fails_the_run_leaves_nothing_and_keeps_the_others(pytester):
    # Rows that are not the mixed_precision_accumulation report's: its renderer cannot render them.
    pytester.makepyfile("""
        def test_rows(report):
            report("mixed_precision_accumulation").add(x=1)
            report("_plugin_problem").add(x=2)
    """)
    result = run(pytester, "--report-dir", "out")
    result.assert_outcomes(passed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*cs336-systems reports not written*",
                                 "mixed_precision_accumulation: KeyError: *"])
    written = sorted(p.name for p in (pytester.path / "out" / "cpu").iterdir())
    assert written == ["README.md", "_plugin_problem.csv", "_plugin_problem.md", "_plugin_problem.meta.json"]


def test_a_cpu_run_that_writes_reports_rebuilds_its_own_index_and_leaves_the_gpu_index_alone(pytester):
    from cs336_systems.reports.index import render_index

    pytester.makepyfile(ROW_WRITING_TEST)
    run(pytester, "--report-dir", "out").assert_outcomes(passed=1)
    index = pytester.path / "out" / "cpu" / "README.md"
    assert index.read_text() == render_index(pytester.path / "out", cpu=True)
    assert "[cpu/](./)" in index.read_text()  # the device table lists this run's directory
    assert not (pytester.path / "out" / "README.md").exists()


def test_a_run_from_a_subfolder_writes_reports_under_the_rootdir(pytester, monkeypatch):
    pytester.makeini("[pytest]\n")  # the rootdir, as pyproject.toml makes the repository's root
    (pytester.path / "perf").mkdir()
    (pytester.path / "perf" / "test_rows.py").write_text(textwrap.dedent(ROW_WRITING_TEST))
    monkeypatch.chdir(pytester.path / "perf")
    run(pytester, "test_rows.py").assert_outcomes(passed=1)
    assert (pytester.path / "reports" / "cpu" / "_plugin_problem.md").is_file()
    assert not (pytester.path / "perf" / "reports").exists()
    # A --report-dir is read from the folder pytest started in, as any path on its command line is.
    run(pytester, "test_rows.py", "--report-dir", "out").assert_outcomes(passed=1)
    assert (pytester.path / "perf" / "out" / "cpu" / "_plugin_problem.md").is_file()


def test_report_assets_reach_the_report_directory_only_when_the_session_ends(pytester):
    pytester.makepyfile("""
        def test_asset(report, run_settings):
            path = report("_plugin_problem").asset_path("plot.png")
            path.write_bytes(b"png")
            assert not run_settings.report_dir.exists()
            report("_plugin_problem").add(file="plot.png")
    """)
    run(pytester, "--report-dir", "out").assert_outcomes(passed=1)
    assert (pytester.path / "out" / "cpu" / "plot.png").read_bytes() == b"png"


def test_the_list_of_written_files_names_every_plot_a_report_shows(pytester):
    # The committed gradient_checkpointing rows: its renderer draws a plot; the staged asset is a second file.
    pytester.makepyfile(f"""
        from cs336_systems.runs import read_rows
        def test_rows(report):
            for row in read_rows({str(REPO_ROOT / "reports" / "h100" / "gradient_checkpointing.csv")!r}):
                report("gradient_checkpointing").add(row)
            report("gradient_checkpointing").asset_path("trace.png").write_bytes(b"png")
    """)
    result = run(pytester, "--report-dir", "out")
    result.assert_outcomes(passed=1)
    listed = result.stdout.str().split("cs336-systems reports", 1)[1].split()
    out = pytester.path / "out" / "cpu"
    assert [Path(line) for line in listed if line.startswith(str(out))] == [
        out / "gradient_checkpointing.md", out / "gradient_checkpointing.png", out / "trace.png", out / "README.md"]


# The tests that read the committed reports, run again in a copy of the repository after a CPU perf run.
COMMITTED_REPORT_TESTS = ("test_report_prose.py", "test_report_index.py", "test_rows.py")


def test_a_cpu_perf_run_leaves_the_committed_reports_and_the_tests_that_read_them_as_they_were(pytester, monkeypatch):
    """`make perf` then `make test` on a CPU, in small: a perf session, started in a subfolder of a copy of the
    repository, writes real reports (the committed h100 rows of torch_compile, whose CPU header takes it past
    the prose limit, and of gradient_checkpointing, with its plot); then every committed file is as it was
    and the tests that read the committed reports pass against the copy."""
    from cs336_systems.reports.index import CPU_SLUG

    project = pytester.path
    shutil.copytree(REPO_ROOT / "reports", project / "reports", ignore=shutil.ignore_patterns(CPU_SLUG))
    (project / "pyproject.toml").write_text("[tool.pytest.ini_options]\n")  # the rootdir, as in the repository
    committed = {path: path.read_bytes() for path in (project / "reports").rglob("*") if path.is_file()}
    (project / "perf").mkdir()
    (project / "perf" / "test_replay.py").write_text(textwrap.dedent(f"""
        import pytest
        from cs336_systems.runs import read_rows

        @pytest.mark.parametrize("problem", ["torch_compile", "gradient_checkpointing"])
        def test_rows(report, problem):
            for row in read_rows({str(REPO_ROOT / "reports" / "h100")!r} + f"/{{problem}}.csv"):
                report(problem).add(row)
    """))
    monkeypatch.chdir(project / "perf")
    # pytest-benchmark, where installed, keeps its own store in the folder a run starts in: not ours to check.
    run(pytester, "test_replay.py", "-p", "no:benchmark", subprocess=True).assert_outcomes(passed=2)

    written = {path for path in (project / "reports").rglob("*") if path.is_file()} - set(committed)
    assert {path.parent.name for path in written} == {CPU_SLUG}
    assert {"README.md", "torch_compile.md", "gradient_checkpointing.png"} <= {path.name for path in written}
    assert all(path.read_bytes() == data for path, data in committed.items()), "a committed report changed"
    assert sorted(path.name for path in (project / "perf").iterdir() if path.name != "__pycache__") == ["test_replay.py"]

    (project / "tests").mkdir()
    for name in COMMITTED_REPORT_TESTS:
        shutil.copy(REPO_ROOT / "tests" / name, project / "tests" / name)
    monkeypatch.chdir(project)
    result = pytester.runpytest_subprocess("tests", "-p", "no:cacheprovider", "-k", "committed or prose")
    outcomes = result.parseoutcomes()
    assert result.ret == pytest.ExitCode.OK and outcomes["passed"] > len(COMMITTED_REPORT_TESTS), result.stdout.str()


def test_report_rows_from_xdist_workers_are_merged_into_one_report(pytester):
    pytester.makepyfile("""
        import pytest
        @pytest.mark.parametrize("i", range(6))
        def test_row(report, i):
            report("_plugin_problem").add(i=i, square=i * i)
    """)
    report_dir = pytester.path / "out"
    result = run(pytester, "-n", "2", "--report-dir", str(report_dir), subprocess=True)
    result.assert_outcomes(passed=6)
    rows = read_rows(report_dir / "cpu" / "_plugin_problem.csv")
    assert sorted((r["i"], r["square"]) for r in rows) == [(i, i * i) for i in range(6)]
    markdown = (report_dir / "cpu" / "_plugin_problem.md").read_text()
    assert "UTC, `pytest" in markdown and "-n 2" in markdown


@pytest.mark.parametrize("option, xl_d_model, default_gpu_sizes", [
    ((), 2560, ("small", "medium", "large", "xl", "10B")),
    (("--size-table", "2025"), 1600, ("small", "medium", "large", "xl", "2.7B")),
])
def test_size_table_option_picks_the_sizes_and_report_rows_name_it(pytester, option, xl_d_model, default_gpu_sizes):
    pytester.makepyfile(f"""
        from cs336_systems.model import ModelConfig
        from cs336_systems.run_settings import parse_model_sizes
        def test_sizes(report, run_settings):
            assert ModelConfig.for_size("xl", 16, table=run_settings.size_table).d_model == {xl_d_model}
            assert parse_model_sizes(None, True, run_settings.size_table) == {default_gpu_sizes!r}
            report("_plugin_sizes").add(size="xl", ms=1.0)
            report("_plugin_sizes").add(name="no model", ms=2.0)
    """)
    report_dir = pytester.path / "out"
    run(pytester, *option, "--report-dir", str(report_dir), subprocess=True).assert_outcomes(passed=1)
    table = option[1] if option else "2026"
    rows = read_rows(report_dir / "cpu" / "_plugin_sizes.csv")
    assert [r.get("size_table") for r in rows] == [table, None]
    markdown = (report_dir / "cpu" / "_plugin_sizes.md").read_text()
    assert f"- model sizes: the {table} size table, xl {xl_d_model}/" in markdown


def test_ini_settings_mirror_the_options_and_the_command_line_wins(pytester):
    pytester.makeini("""
        [pytest]
        world_size = 3
        precision = bf16
        size_table = 2025
        report_dir = ini-reports
    """)
    pytester.makepyfile("""
        def test_settings(run_settings):
            assert (run_settings.world_size, run_settings.precisions, run_settings.size_table) == (3, ("bf16",), "2025")
            assert run_settings.report_root.name == "ini-reports"
    """)
    run(pytester).assert_outcomes(passed=1)
    pytester.makepyfile("""
        def test_settings(run_settings):
            assert (run_settings.world_size, run_settings.precisions, run_settings.size_table) == (4, ("fp32",), "2025")
    """)
    run(pytester, "--world-size", "4", "--precision", "fp32").assert_outcomes(passed=1)


@pytest.mark.parametrize("setting, message", [
    ("world_size = two", "the world_size ini setting: invalid int value: 'two'"),
    ("world_size = 0", "--world-size must be at least 1, got 0"),
    ("size_table = 2024", "--size-table: unknown size table '2024'; choose one of 2026, 2025"),
    ("update_baselines = maybe", "the update_baselines ini setting: invalid truth value 'maybe'"),
    ("report_dir =", "the report_dir ini setting is empty"),
])
def test_a_bad_ini_setting_is_a_usage_error(pytester, setting, message):
    pytester.makeini(f"[pytest]\n{setting}\n")
    pytester.makepyfile("def test_x(): pass")
    result = run(pytester)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*{message}*"])


def test_model_sizes_are_named_in_any_case_and_kept_as_their_table_spells_them():
    from cs336_systems.run_settings import parse_model_sizes

    assert parse_model_sizes("10b, XL", True, "2026") == ("10B", "xl")
    with pytest.raises(ValueError, match="--model-sizes: xl given more than once"):
        parse_model_sizes("xl,XL", True, "2026")
    with pytest.raises(ValueError, match="unknown 2.7b in the 2026 size table"):
        parse_model_sizes("2.7b", True, "2026")


def test_size_missing_from_the_table_is_a_usage_error(pytester):
    pytester.makepyfile("def test_x(): pass")
    result = run(pytester, "--model-sizes", "2.7B")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*unknown 2.7B in the 2026 size table*"])
    assert run(pytester, "--size-table", "2025", "--model-sizes", "2.7B").ret == pytest.ExitCode.OK


GATED_TEST = """
    def test_speedup(speedup_gate):
        speedup_gate("flash vs naive", slow_ms=10.0, fast_ms=2.0, promise=1.0)  # measured ratio 5.0
"""


def write_baseline(pytester, ratio, tolerance=0.2):
    path = pytester.path / "perf" / "baselines" / "cpu.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"device": "test", "ratios": {"flash vs naive": {"ratio": ratio, "tolerance": tolerance}}}))
    return path


def test_gate_fails_when_the_ratio_regressed_past_tolerance(pytester):
    pytester.makepyfile(GATED_TEST)
    write_baseline(pytester, ratio=8.0)  # 5.0 < 8.0 * 0.8
    result = run(pytester)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*REGRESSION: flash vs naive ratio 5 is below the baseline 8 less its 20% tolerance, "
                                 "6.4; holds the promise 1 its test states*"])


def test_gate_fails_below_its_promise_whatever_the_baseline(pytester):
    pytester.makepyfile(GATED_TEST.replace("promise=1.0", "promise=6.0"))
    write_baseline(pytester, ratio=5.5)  # 5.0 >= 5.5 * 0.8, but below the promise 6
    result = run(pytester)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*BROKEN PROMISE: flash vs naive ratio 5 is below the promise 6 its test states; "
                                 "holds the baseline 5.5 less its 20% tolerance, 4.4*"])


def test_gate_passes_within_tolerance(pytester):
    pytester.makepyfile(GATED_TEST)
    write_baseline(pytester, ratio=6.0)  # 5.0 >= 6.0 * 0.8
    run(pytester).assert_outcomes(passed=1)


def test_gate_on_a_cpu_without_a_baseline_file_is_skipped_saying_why_and_update_writes_one(pytester):
    pytester.makepyfile(GATED_TEST)
    result = run(pytester, "-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["SKIPPED [[]1[]] *: speed-up gate not run: a CPU run, whose times say nothing of a "
                                 "GPU's speed-ups, and no baseline file *cpu.json (on a GPU the promise is judged "
                                 "without one)"])
    run(pytester, "--update-baselines").assert_outcomes(passed=1)
    data = json.loads((pytester.path / "perf" / "baselines" / "cpu.json").read_text())
    assert data["ratios"]["flash vs naive"] == {"ratio": 5.0, "tolerance": 0.2}
    run(pytester).assert_outcomes(passed=1)


def test_a_gate_the_baseline_file_has_no_entry_for_passes_on_its_promise_and_warns(pytester):
    pytester.makepyfile(GATED_TEST.replace("flash vs naive", "a new comparison"))
    write_baseline(pytester, ratio=5.0)
    result = run(pytester)
    result.assert_outcomes(passed=1, warnings=1)
    result.stdout.fnmatch_lines(["*MissingBaselineWarning: NO BASELINE: a new comparison ratio 5 holds the promise 1 "
                                 "its test states; *cpu.json has no entry for it (--update-baselines records one)*"])


@pytest.mark.parametrize(("arguments", "message"), [
    (("--adapters-promise", "sdpa_flash=1.0"), "--adapters-promise declares what an implementation under test "
                                               "promises: name it with --adapters"),
    (("--adapters-promise", "fa2=1.0"), "--adapters-promise 'fa2=1.0': write REFERENCE=RATIO, REFERENCE one of "
                                        "naive, sdpa_flash, sdpa_cudnn, flash_triton"),
    (("--adapters-promise", "sdpa_flash=-1"), "the ratio must be a number above 0, got '-1'"),
    (("--adapters-promise", "naive=2", "--adapters-promise", "naive=3"), "--adapters-promise: naive given more than "
                                                                          "once"),
])
def test_a_promise_of_the_implementation_under_test_that_cannot_hold_is_a_usage_error(pytester, arguments, message):
    pytester.makepyfile("def test_x():\n    pass\n")
    result = run(pytester, *arguments)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: *{message}*"])


@pytest.mark.parametrize("update", [False, True])
def test_gate_fails_when_a_variant_did_not_run(pytester, update):
    pytester.makepyfile("""
        def test_speedup(speedup_gate):
            speedup_gate("flash vs naive", slow_ms=None, fast_ms=2.0, promise=1.0, note="naive: OOM")
    """)
    path = write_baseline(pytester, ratio=5.0)
    result = run(pytester, *(["--update-baselines"] if update else []))
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*flash vs naive: the slower variant has no time, so the gate cannot hold "
                                 "(naive: OOM)*"])
    assert json.loads(path.read_text())["ratios"]["flash vs naive"]["ratio"] == 5.0


def test_update_refuses_a_regression_unless_it_is_accepted(pytester):
    pytester.makepyfile(GATED_TEST)
    path = write_baseline(pytester, ratio=8.0)  # 5.0 < 8.0 * 0.8
    result = run(pytester, "--update-baselines")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*refusing to record REGRESSION: flash vs naive ratio 5 is below the baseline 8*"
                                 "pass --accept-regression to record it*"])
    assert json.loads(path.read_text())["ratios"]["flash vs naive"]["ratio"] == 8.0
    run(pytester, "--update-baselines", "--accept-regression").assert_outcomes(passed=1)
    assert json.loads(path.read_text())["ratios"]["flash vs naive"]["ratio"] == 5.0


def test_update_never_records_a_broken_promise(pytester):
    pytester.makepyfile(GATED_TEST.replace("promise=1.0", "promise=6.0"))
    result = run(pytester, "--update-baselines", "--accept-regression")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*refusing to record BROKEN PROMISE, NO BASELINE: flash vs naive ratio 5 is below "
                                 "the promise 6 its test states*"])
    assert not (pytester.path / "perf" / "baselines" / "cpu.json").exists()


def test_accept_regression_needs_update_baselines(pytester):
    pytester.makepyfile(GATED_TEST)
    result = run(pytester, "--accept-regression")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--accept-regression only applies with --update-baselines*"])


def test_update_keeps_a_stated_tolerance(pytester):
    pytester.makepyfile(GATED_TEST)
    path = write_baseline(pytester, ratio=4.0, tolerance=0.5)
    run(pytester, "--update-baselines").assert_outcomes(passed=1)
    assert json.loads(path.read_text())["ratios"]["flash vs naive"] == {"ratio": 5.0, "tolerance": 0.5}


def test_update_keeps_a_higher_recorded_ratio_unless_a_regression_is_accepted(pytester):
    pytester.makepyfile(GATED_TEST)
    path = write_baseline(pytester, ratio=6.0)  # 5.0 is lower, but within tolerance: the gate holds
    run(pytester, "--update-baselines").assert_outcomes(passed=1)
    assert json.loads(path.read_text())["ratios"]["flash vs naive"]["ratio"] == 6.0
    run(pytester, "--update-baselines", "--accept-regression").assert_outcomes(passed=1)
    assert json.loads(path.read_text())["ratios"]["flash vs naive"]["ratio"] == 5.0


def test_spawn_fixture_runs_a_function_on_each_rank(pytester):
    pytester.makepyfile(ranks="""
        import torch.distributed as dist
        def report_rank(rank, world_size):
            return (rank, world_size, dist.get_rank(), dist.get_backend())
    """)
    pytester.makepyfile("""
        from ranks import report_rank
        def test_spawn(spawn):
            assert spawn(report_rank, 2) == [(0, 2, 0, "gloo"), (1, 2, 1, "gloo")]
    """)
    pytester.syspathinsert()
    run(pytester, subprocess=True).assert_outcomes(passed=1)


def test_the_single_gpu_reports_target_collects_the_four_problems_tests():
    makefile = (REPO_ROOT / "Makefile").read_text()
    recipe = makefile.split("single-gpu-reports: $(GPU_SETUP)\n", 1)[1].split("\n\n", 1)[0]
    args = shlex.split(recipe.replace("\\\n", " "))
    assert args[:3] == ["$(PYTHON)", "-m", "pytest"] and "--gpu" in args
    args[args.index("--gpu") + 1] = "none"  # collected as on CPU, where the parametrisation is smaller
    args += [] if "-q" in args else ["-q"]  # one node id per line
    result = subprocess.run([sys.executable, "-m", "pytest", *args[3:], "--collect-only"], cwd=REPO_ROOT,
                            capture_output=True, text=True)
    collected = [line for line in result.stdout.splitlines() if "::" in line]
    modules = {line.split("::")[0] for line in collected}
    assert modules == {"perf/test_attention.py", "perf/test_profile.py", "perf/test_memory.py"}, result.stdout
    assert not any("compiled" in line for line in collected) and any("eager" in line for line in collected)
