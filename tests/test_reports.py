from dataclasses import replace
from pathlib import Path

import pytest

from cs336_systems import provenance, reports, runs
from cs336_systems.reports import Rendered, Report, markdown_table, problems, rerender, write_report
from cs336_systems.rows import OOM
from cs336_systems.runs import read_rows


def test_markdown_table_formats_numbers_and_keeps_strings():
    table = markdown_table([{"a": 1234.5678, "b": 0.000123, "c": OOM, "d": None, "e": 12345678}])
    assert "1,235" in table and "0.000123" in table and OOM in table and "12,345,678" in table
    assert table.splitlines()[0].startswith("| a")


TEST_REPORT = Report("_test_problem", lambda rows: Rendered(f"{len(rows)} rows; total {sum(r['x'] for r in rows)}"))


def test_write_report_has_header_csv_and_rerenders_from_csv(tmp_path):
    rows = [{"x": 1, "flag": True, "note": "a"}, {"x": 2.5, "flag": False, "note": None}]
    path = write_report(TEST_REPORT, rows, tmp_path, command="pytest perf/ -m e2e", device="cpu")
    text = path.read_text()
    assert text.startswith("# _test_problem\n")
    for field in ("- device: CPU", "- software: python", "torch ", "- run 1: 20", " UTC, `pytest perf/ -m e2e`"):
        assert field in text
    assert text.rstrip().endswith("2 rows; total 3.5")
    assert read_rows(tmp_path / "_test_problem.csv") == rows
    (tmp_path / "_test_problem.md").write_text(text.replace("total 3.5", "stale"))
    rerender(tmp_path, TEST_REPORT)
    assert (tmp_path / "_test_problem.md").read_text() == text


def test_metadata_sidecar_records_the_device_and_each_run_and_the_header_is_rendered_from_it(tmp_path):
    write_report(TEST_REPORT, [{"x": 1}], tmp_path, command="pytest perf/ -m e2e", device="cpu")
    metadata = runs.Metadata.read(tmp_path / "_test_problem.meta.json")
    assert metadata.problem == "_test_problem" and metadata.device.startswith("CPU") and not metadata.on_gpu
    (run,) = metadata.runs
    assert run.command == "pytest perf/ -m e2e" and run.software == runs.software_versions()
    assert run.source_hash == provenance.package_source_hash() and len(run.source_hash) == 16
    assert run.date.endswith(" UTC")
    # What the header says comes from the sidecar: an edit there shows on the next rendering.
    edited = replace(metadata, device="Some GPU", on_gpu=True, runs=(replace(run, command="pytest again"),))
    edited.write(tmp_path / "_test_problem.meta.json")
    text = rerender(tmp_path, TEST_REPORT).read_text()
    assert "- device: Some GPU" in text and "`pytest again` (source " in text and "- note: a CPU run" not in text


def test_runs_with_different_software_are_each_named():
    records = [runs.RunRecord("d1", "c1", {"torch": "2.10"}, None), runs.RunRecord("d2", "c2", {"torch": "2.11"}, "ab")]
    assert reports.software_line(records) == "- software: run 1: torch 2.10; run 2: torch 2.11"
    assert reports.software_line(records[:1]) == "- software: torch 2.10"
    assert reports.run_line(1, records[0], earlier_code=True) == "- run 1: d1, `c1` (measured code not known)"
    assert (reports.run_line(2, records[1], earlier_code=True)
            == "- run 2: d2, `c2` (source ab, measured code not known)")
    measured = replace(records[1], measured_code="cd")
    assert reports.run_line(2, measured, earlier_code=False) == "- run 2: d2, `c2` (source ab, measured code cd)"
    assert reports.run_line(2, measured, earlier_code=True) == "- run 2: d2, `c2` (source ab, measured code cd, earlier code)"


def test_a_run_names_the_code_it_measured_and_stays_marked_as_earlier_code_once_that_code_changes(tmp_path, monkeypatch):
    from cs336_systems.reports import problems as problem_table

    keyed = Report("_test_problem", TEST_REPORT.render, key=("cell",))
    monkeypatch.setattr(problem_table, "measured_code", lambda name: "code-a")
    write_report(keyed, [{"cell": 1, "x": 1}, {"cell": 2, "x": 2}], tmp_path, command="pytest perf/ -m e2e", device="cpu")
    (run,) = runs.Metadata.read(tmp_path / "_test_problem.meta.json").runs
    assert run.measured_code == "code-a" and run.measured_code_from is None
    text = (tmp_path / "_test_problem.md").read_text()
    assert "(source " in text and ", measured code code-a)" in text and "earlier code" not in text

    monkeypatch.setattr(problem_table, "measured_code", lambda name: "code-b")  # an edit on the measured path
    text = rerender(tmp_path, keyed).read_text()
    assert ", measured code code-a, earlier code)" in text
    assert (f"- measured on earlier code: run 1 ({run.date}): the code on its measured path has changed since, and "
            "its rows are that code's numbers") in text
    assert len(read_rows(tmp_path / "_test_problem.csv")) == 2  # the rows stay

    # A later run measures cell 1 again on the new code: its run is current; cell 2's run is still earlier code.
    write_report(keyed, [{"cell": 1, "x": 3}], tmp_path, command="pytest perf/ -m e2e", device="cpu")
    text = (tmp_path / "_test_problem.md").read_text()
    assert ", measured code code-a, earlier code)" in text and ", measured code code-b)" in text
    assert "- measured on earlier code: run 1 (" in text


def test_a_run_whose_measured_code_is_not_known_reads_as_earlier_code(tmp_path, monkeypatch):
    from cs336_systems.reports import problems as problem_table

    monkeypatch.setattr(problem_table, "measured_code", lambda name: "code-a")
    metadata = runs.Metadata("_test_problem", "Some GPU", True, (
        runs.RunRecord("2026-11-24 03:59 UTC", "pytest perf/", {"torch": "2.11"}, None, None,
                          "not known: the run predates recording any source"),
        runs.RunRecord("2026-12-01 10:00 UTC", "pytest perf/", {"torch": "2.11"}, "ab", "code-a")))
    text = reports.header(metadata)
    assert "- run 1: 2026-11-24 03:59 UTC, `pytest perf/` (measured code not known)" in text
    assert "- run 2: 2026-12-01 10:00 UTC, `pytest perf/` (source ab, measured code code-a)" in text
    assert "- measured on earlier code: run 1 (2026-11-24 03:59 UTC, code not known): the code on its" in text


def test_the_header_says_how_the_rows_were_timed_each_way_once():
    rows = [{"status": "ok", "timer": "events"}, {"status": "ok", "timer": "events"}, {"status": "OOM"},
            {"status": "ok", "timer": "do_bench"}]
    assert reports.timing_lines(rows) == ["- timing: events; do_bench"]
    assert reports.timing_lines(rows[:3]) == ["- timing: events"]
    assert reports.timing_lines([{"status": "OOM"}]) == []


def test_a_report_no_problem_names_renders_as_a_plain_table(tmp_path):
    assert problems.report("_unregistered") == Report("_unregistered")
    path = write_report(problems.report("_unregistered"), [{"k": 1}], tmp_path, command="c", device="cpu")
    assert "| k" in path.read_text()


def test_software_versions_name_torch_and_triton():
    versions = runs.software_versions()
    assert {"python", "torch", "triton", "cuda"} <= set(versions)


@pytest.mark.parametrize("value, text", [(0.0, "0"), (None, ""), (3.14159, "3.14"), (True, "True"),
                                         (float("inf"), "inf")])
def test_format_value(value, text):
    assert reports.format_value(value) == text


def test_nan_reads_as_not_measured_never_as_a_blank_or_a_number():
    nan = float("nan")
    assert reports.format_value(nan) == reports.NOT_A_NUMBER == "n/a"
    assert "| n/a " in markdown_table([{"ms": nan}])
    assert reports.mean_std(nan, nan) == "n/a" and reports.mean_std(nan, 1.0, unit="ms") == "n/a"
    # A mean whose spread is not a number cannot be vouched for as one number: flagged, like a wide spread.
    assert reports.mean_std(10.0, nan) == "10.0 ± n/a (noisy)"
    assert reports.is_noisy(10.0, nan) and reports.is_noisy(nan, 1.0)
    assert [reports.format_ms(nan), reports.format_ratio(nan), reports.format_share(nan)] == ["n/a"] * 3
    assert reports.speedup_text({"mean_ms": nan, "std_ms": 0.1}, {"mean_ms": 1.0, "std_ms": 0.1}) == "n/a"


def _timed(mean_ms: float, std_ms: float = 0.1) -> dict:
    return {"mean_ms": mean_ms, "std_ms": std_ms}


def test_speed_ups_leave_out_unmeasured_cells_and_say_so():
    nan = float("nan")
    pairs = [(_timed(2.0), _timed(1.0), "a"), (_timed(nan), _timed(1.0), "b"), (_timed(3.0), _timed(nan), "c"),
             (_timed(4.0, 2.0), _timed(1.0), "d")]
    speed_ups = reports.SpeedUps.of(pairs)
    assert (speed_ups.ratios, speed_ups.noisy, speed_ups.unmeasured) == ((2.0,), 1, 2)
    assert speed_ups.summary() == "2.00x (1 noisy cell and 2 unmeasured cells left out)"
    assert reports.SpeedUps.of(pairs[1:3]).summary() == "no steady cell (2 unmeasured cells left out)"
    assert "nan" not in reports.SpeedUps.of(pairs).summary()


def _render_keyed(rows):
    return Rendered(" ".join(f"{r['cell']}={r['ms']}@{r['run']}" for r in sorted(rows, key=lambda r: r["cell"])))


KEYED_REPORT = Report("_test_keyed", _render_keyed, key=("cell",))


def test_keyed_report_accumulates_runs_and_drops_runs_left_without_rows(tmp_path):
    write_report(KEYED_REPORT, [{"cell": "a", "ms": 1}, {"cell": "b", "ms": 2}], tmp_path, "first", "cpu")
    write_report(KEYED_REPORT, [{"cell": "b", "ms": 3}, {"cell": "c", "ms": 4}], tmp_path, "second", "cpu")
    text = (tmp_path / "_test_keyed.md").read_text()
    assert "`first`" in text and "`second`" in text and text.rstrip().endswith("a=1@1 b=3@2 c=4@2")
    write_report(KEYED_REPORT, [{"cell": "a", "ms": 5}], tmp_path, "third", "cpu")
    text = (tmp_path / "_test_keyed.md").read_text()
    assert "`first`" not in text  # its only remaining row was measured again
    assert "- run 1: " in text and "`second`" in text and "- run 2: " in text and "`third`" in text
    assert text.rstrip().endswith("a=5@2 b=3@1 c=4@1")
    assert len(read_rows(tmp_path / "_test_keyed.csv")) == 3


def test_a_later_run_adds_its_lines_and_leaves_the_earlier_runs_lines_as_they_were(tmp_path):
    # Each run's records name their columns in an order of their own; a committed CSV's diff is then its new rows.
    csv_path = tmp_path / "_test_keyed.csv"
    write_report(KEYED_REPORT, [{"cell": "a", "batch_size": 4, "size": "xl", "ms": 1.5, "mode": "train"}],
                 tmp_path, "first", "cpu")
    write_report(KEYED_REPORT, [{"size": "xl", "mode": "eval", "cell": "b", "ms": 2.5, "batch_size": 8, "gib": 3}],
                 tmp_path, "second", "cpu")
    earlier = csv_path.read_text().splitlines()
    write_report(KEYED_REPORT, [{"ms": 3.5, "cell": "c", "mode": "train", "batch_size": 2, "size": "xl"}],
                 tmp_path, "third", "cpu")
    later = csv_path.read_text().splitlines()
    assert later[:len(earlier)] == earlier and len(later) > len(earlier)
    assert _render_keyed(read_rows(csv_path)).body == "a=1.5@1 b=2.5@2 c=3.5@3"


def test_a_cpu_report_says_its_times_are_cpu_times_and_triton_ran_in_the_interpreter(tmp_path):
    text = write_report(TEST_REPORT, [{"x": 1}], tmp_path, command="c", device="cpu").read_text()
    header = text.split("\n\n")[1]
    assert "- note: a CPU run." in header and "Triton interpreter" in header and "CPU time" in header


@pytest.mark.parametrize("mean, std, text", [
    (10.0, 2.0, "10.0 ± 2.0"), (10.0, 2.1, "10.0 ± 2.1 (noisy)"), (0.0, 0.0, "0.0 ± 0.0")])
def test_a_spread_above_a_fifth_of_the_mean_is_flagged_noisy(mean, std, text):
    assert reports.mean_std(mean, std) == text


def test_one_sample_shows_that_it_has_no_spread_instead_of_a_std_of_zero():
    assert reports.mean_std(10.0, 0.0, samples=1, unit="ms") == "10.0 (n=1) ms"
    assert reports.mean_std(10.0, 0.0, samples=2) == "10.0 ± 0.0"
    assert reports.mean_std(10.0, 0.0) == "10.0 ± 0.0"  # a row that does not say how many samples it pools


def _render_broken(rows):
    raise RuntimeError("renderer broke")


BROKEN_REPORT = Report("_test_broken", _render_broken)


def test_a_report_that_fails_to_render_leaves_no_directory_and_no_file(tmp_path):
    with pytest.raises(RuntimeError, match="renderer broke"):
        write_report(BROKEN_REPORT, [{"x": 1}], tmp_path / "a100", command="c", device="cpu")
    assert not (tmp_path / "a100").exists()
    (tmp_path / "a100").mkdir()
    write_report(TEST_REPORT, [{"x": 1}], tmp_path / "a100", command="c", device="cpu")
    with pytest.raises(RuntimeError, match="renderer broke"):
        write_report(BROKEN_REPORT, [{"x": 1}], tmp_path / "a100", command="c", device="cpu")
    assert sorted(p.name for p in (tmp_path / "a100").iterdir()) == [
        "_test_problem.csv", "_test_problem.md", "_test_problem.meta.json"]


def test_cpu_reports_are_not_tracked():
    from pathlib import Path

    ignored = (Path(__file__).resolve().parents[1] / ".gitignore").read_text().splitlines()
    assert "reports/cpu/" in ignored


def test_header_names_the_size_table_and_parameters_of_each_measured_size_and_rerender_derives_it(tmp_path):
    rows = [{"size": "xl", "size_table": "2026", "ms": 1.0}, {"size": "10B", "size_table": "2026", "ms": None},
            {"size": "2.7B", "size_table": "2025", "ms": 3.0}]
    text = write_report(Report("_test_problem_sizes"), rows, tmp_path, command="c", device="cpu").read_text()
    # 10B: 12,832,823,808 parameters (the memory model's count, test_e2e).
    assert ("- model sizes: the 2026 size table, xl 2560/10240/32/32 (3,407M), 10B 4608/12288/50/36 (12,833M) "
            "(d_model/d_ff/layers/heads, parameters)") in text
    assert "- model sizes: the 2025 size table, 2.7B 2560/10240/32/32 (3,407M)" in text
    # A report written before the line existed gets it when re-rendered; its run lines stay.
    (tmp_path / "_test_problem_sizes.md").write_text(
        "\n".join(line for line in text.splitlines() if not line.startswith("- model sizes")) + "\n")
    assert rerender(tmp_path, Report("_test_problem_sizes")).read_text() == text
    assert "- model sizes" not in write_report(Report("_test_no_sizes"), [{"k": 1}], tmp_path, "c", "cpu").read_text()


def fake_checkout(root, with_pyproject: bool):
    """A folder holding a package directory, as a clone (with pyproject.toml) or an installed copy (without)."""
    package = root / "cs336_systems"
    package.mkdir(parents=True)
    if with_pyproject:
        (root / "pyproject.toml").write_text("[project]\nname = 'cs336-systems'\n")
    return package


def test_reports_go_to_the_repository_root_from_any_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(reports, "PACKAGE_ROOT", fake_checkout(tmp_path / "clone", with_pyproject=True))
    monkeypatch.chdir((tmp_path / "clone" / "cs336_systems"))
    assert reports.default_reports_root() == tmp_path / "clone" / "reports"


def test_an_installed_package_without_its_repository_writes_reports_in_the_current_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(reports, "PACKAGE_ROOT", fake_checkout(tmp_path / "site-packages", with_pyproject=False))
    monkeypatch.chdir(tmp_path)
    assert reports.default_reports_root() == tmp_path / "reports"


def test_this_checkout_writes_its_reports_beside_the_package():
    assert reports.default_reports_root() == Path(reports.__file__).resolve().parents[2] / "reports"


def test_an_oom_cell_says_whether_it_was_predicted_and_never_run_or_ran_out():
    predicted = {"status": OOM, "oom_predicted": True, "estimated_peak_bytes": 3 * 2**30, "available_bytes": 2**30}
    ran_out = {**predicted, "oom_predicted": False}
    assert reports.oom_text(predicted) == "OOM (predicted, not run)" and reports.oom_text(ran_out) == OOM
    assert reports.oom_note(predicted) == ("OOM (predicted, not run): the memory model estimates a peak of 3.00 GiB "
                                           "against 1.00 GiB available")
    assert reports.oom_note(ran_out) == ("OOM: it ran out of memory (the memory model estimates a peak of 3.00 GiB "
                                         "against 1.00 GiB available)")


def test_the_package_source_hash_covers_its_cpp_sources_and_leaves_out_build_products(tmp_path, monkeypatch):
    from cs336_systems import provenance

    assert "attention/flash_triton/native.cpp" in provenance.source_files(provenance.PACKAGE_ROOT)
    (tmp_path / "ops" / "__pycache__").mkdir(parents=True)
    (tmp_path / "model.py").write_text("X = 1\n")
    (tmp_path / "ops" / "launcher.cpp").write_text("int x = 1;\n")
    (tmp_path / "ops" / "__pycache__" / "model.cpython-312.pyc").write_bytes(b"\0")
    (tmp_path / "ops" / "launcher.so").write_bytes(b"\0")
    monkeypatch.setattr(provenance, "PACKAGE_ROOT", tmp_path)
    assert provenance.source_files(tmp_path) == ["model.py", "ops/launcher.cpp"]
    package_hash = provenance.package_source_hash.__wrapped__  # uncached: it reads the files each call
    before = package_hash()
    (tmp_path / "ops" / "launcher.so").write_bytes(b"\1")
    (tmp_path / "ops" / "__pycache__" / "model.cpython-312.pyc").write_bytes(b"\1")
    assert package_hash() == before
    (tmp_path / "ops" / "launcher.cpp").write_text("int x = 2;\n")
    assert package_hash() != before
