"""reports/README.md, the index: figures read from the rows, links to files that exist, absent
reports listed as not measured, the same bytes on every regeneration."""

import re
import shutil
from pathlib import Path

import pytest

from cs336_systems.__main__ import main
from cs336_systems.accounting.communication_accounting import communication_accounting_rows
from cs336_systems.reports import (
    header,
    plural,
    problems,
    rerender,
    span,
)
from cs336_systems.reports.index import (
    CPU_SLUG,
    INDEX_COMMAND,
    index_path,
    render_index,
    result_directories,
    write_index,
    write_indexes,
)
from cs336_systems.reports.problems import PROBLEMS
from cs336_systems.rows import Row
from cs336_systems.runs import Metadata, RunRecord, metadata_path, read_rows, write_csv

RUN_DATE = "2030-01-02 03:04 UTC"


def write_fake_report(directory: Path, problem: str, rows: list[Row], plots: tuple[str, ...] = (),
                      measured_code: str | None = None) -> None:
    """A report as write_report leaves it (header, CSV, image links), without its renderer; its run measured the
    current code unless `measured_code` says other."""
    directory.mkdir(parents=True, exist_ok=True)
    write_csv(directory / f"{problem}.csv", rows)
    metadata = Metadata(problem, "Fake GPU 80GB", True,
                        (RunRecord(RUN_DATE, "pytest perf/ -m e2e", {"python": "3.12", "torch": "9.9"}, None,
                                   measured_code or problems.measured_code(problem)),))
    metadata.write(metadata_path(directory, problem))
    images = "".join(f"\n![plot]({name})\n" for name in plots)
    (directory / f"{problem}.md").write_text(header(metadata, rows) + f"\nbody\n{images}")


def e2e_row(size: str, context: int, phase: str, mean_ms: float) -> Row:
    return {"table": "sweep", "size": size, "size_table": "2025", "context_length": context, "batch_size": 4,
            "precision": "fp32", "compile": False, "phase": phase, "status": "ok", "mean_ms": mean_ms,
            "std_ms": mean_ms / 100, "median_ms": mean_ms, "first_ms": mean_ms, "steps": 10, "warmup": 5}


def step_rows(size: str, times_ms: dict[str, float]) -> list[Row]:
    return [e2e_row(size, 512, phase, ms) for phase, ms in times_ms.items()]


@pytest.fixture
def reports_root(tmp_path) -> Path:
    gpu = tmp_path / "h100"
    write_fake_report(gpu, "benchmarking_script",
                      step_rows("2.7B", {"train_step": 1234.5, "forward": 400.25, "backward": 800.0,
                                         "optimizer": 34.25})
                      + step_rows("xl", {"train_step": 700.0}))
    write_fake_report(gpu, "mixed_precision_accumulation", [
        {"variant": "fp32 += fp32", "result": 10.000134, "abs_error": 0.000134, "exact_sum_of_stored_addend": 10.0},
        {"variant": "fp16 += fp16", "result": 9.953125, "abs_error": 0.046875, "exact_sum_of_stored_addend": 10.0021},
        {"variant": "fp32 += fp16", "result": 10.00213623046875, "abs_error": 0.00213623046875,
         "exact_sum_of_stored_addend": 10.00213623046875}])
    write_fake_report(gpu, "gradient_checkpointing", [
        {"table": "sweep", "size": "xl", "batch_size": 4, "precision": "fp32", "context_length": 1024, "num_layers": 16,
         "plan_kind": "every_k", "k": k, "levels": None, "block_bytes": 26 * 2**20, "boundary_bytes": 2**20,
         "status": "ok", "measured_peak_bytes": peak_gib * 2**30, "recomputed_blocks": 16, "step_ms": 100.0}
        for k, peak_gib in ((1, 1.5), (4, 2.25), (16, 9.0))], plots=("gradient_checkpointing.png", "missing.png"))
    (gpu / "gradient_checkpointing.png").write_bytes(b"\x89PNG")
    write_fake_report(gpu, "naive_ddp_benchmarking", [
        {"table": "step", "variant": "naive", "method": "naive", "status": "ok", "size": "xl", "context_length": 512,
         "batch_size": 4, "world_size": 2, "backend": "nccl", "step_ms": 700.0, "gradient_sync_ms": 175.0,
         "all_reduces_per_step": 435},
        {"table": "step", "variant": "local", "method": "local", "status": "ok", "size": "xl", "context_length": 512,
         "batch_size": 4, "world_size": 2, "backend": "nccl", "step_ms": 520.0, "gradient_sync_ms": 0.0,
         "all_reduces_per_step": 0}])
    write_csv(tmp_path / "communication_accounting.csv", communication_accounting_rows())
    (tmp_path / "communication_accounting.md").write_text("# communication_accounting\n\n- device: none\n\nbody\n")
    return tmp_path


def test_index_quotes_the_figures_of_the_rows(reports_root):
    index = render_index(reports_root)
    assert "2.7B takes 1,234.5 ± 12.3 ms (forward 400.2 ms, backward 800.0 ms, optimizer 34.2 ms)" in index
    assert "fp16 += fp16 gives 9.95312 (error 0.0469)" in index
    assert "peak activation memory is 1.50 GiB at the best single level (every 1 block)." in index
    assert "The sqrt(L) rule (k = sqrt(16) = 4.0) assumes a block keeps what a checkpoint keeps; here it keeps 26x" in index
    assert "a naive DDP step takes 700.0 ms, of which 175.0 ms (25%) is its 435 per-parameter all-reduces" in index
    assert "without communication the step takes 520.0 ms" in index
    assert "219,848,638,464 parameters" in index


def test_index_links_only_to_files_that_exist(reports_root):
    index = render_index(reports_root)
    targets = re.findall(r"\]\(([^)]+)\)", index)
    assert "h100/gradient_checkpointing.png" in targets
    assert "h100/benchmarking_script.md" in targets
    assert not any("missing.png" in t for t in targets)
    assert all((reports_root / target).exists() for target in targets)


def test_absent_reports_are_listed_as_not_measured_with_the_file_and_the_reason(reports_root):
    index = render_index(reports_root)
    assert ("- h100: not measured: `h100/pytorch_attention.md` is absent: no `pytest perf/ -m attention --gpu h100` "
            "run has written it yet.") in index
    assert "- h100: not measured: needs 2 GPUs. `h100/fsdp.md` and `h100/fsdp_accounting.md` are absent" in index
    # Half of a two-report problem: its answer and the missing half.
    naive_ddp = index[index.index("## 12. naive_ddp / naive_ddp_benchmarking"):].split("\n## ")[0]
    assert "a naive DDP step takes" in naive_ddp and "`h100/naive_ddp.md` is absent" in naive_ddp
    assert re.search(r"\| 12\. naive_ddp / naive_ddp_benchmarking +\| 1 of 2 reports", index)


def test_a_row_that_is_not_in_the_report_is_named_as_absent(tmp_path):
    # The two largest sizes measured are quoted; 10B was measured only at context 128.
    write_fake_report(tmp_path / "h100", "benchmarking_script", step_rows("xl", {"train_step": 700.0})
                      + [e2e_row("10B", 128, "train_step", 2000.0)])
    write_fake_report(tmp_path / "h100", "torch_compile", step_rows("xl", {"train_step": 700.0}))
    index = render_index(tmp_path)
    assert "context 512, fp32, eager: the 10B step is not in the report; xl takes 700.0 ± 7.0 ms." in index
    assert "The attention sweep compiled against eager" in index


def warmup_row(size: str, warmup: int, first_ms: float, median_ms: float) -> Row:
    return {**e2e_row(size, 64, "train_step", median_ms), "table": "warmup", "warmup": warmup, "first_ms": first_ms}


def test_sentences_read_as_written_for_a_cpu_run_of_one_small_size(tmp_path):
    cpu = tmp_path / "cpu"
    write_fake_report(cpu, "benchmarking_script", [
        e2e_row("tiny", 32, "train_step", 10.0), e2e_row("tiny", 64, "train_step", 20.0),
        warmup_row("tiny", 0, first_ms=21.0, median_ms=20.0), warmup_row("tiny", 1, first_ms=20.0, median_ms=20.0)])
    write_fake_report(cpu, "gradient_checkpointing", [
        {"table": "sweep", "size": "tiny", "batch_size": 2, "precision": "fp32", "context_length": 32,
         "num_layers": 2, "plan_kind": kind, "k": k, "levels": levels, "block_bytes": 2**20,
         "boundary_bytes": 2**16, "status": "ok", "measured_peak_bytes": 2**20, "recomputed_blocks": 1,
         "step_ms": 10.0} for kind, k, levels in (("every_k", 1, None), ("optimal", None, "unlimited"))])
    index = render_index(tmp_path, cpu=True)
    assert "context 64, fp32, eager: tiny takes 20.0 ± 0.2 ms" in index
    assert "xl" not in index.split("## 2. ")[0].split("## 1. ")[1]  # the run had no xl, so no word of it
    assert "Over the 2 measured cells" in index
    assert "first timed step takes 1.05x the median step" in index and "1.05x (tiny) to" not in index
    assert "after 1 warm-up step;" in index
    assert "recomputing 1 block forward pass per step in the 2-block model" in index


@pytest.mark.parametrize("count, text", [(0, "0 cells"), (1, "1 cell"), (1128, "1128 cells"), (12345, "12,345 cells")])
def test_plural(count, text):
    assert plural(count, "cell") == text


def test_span_names_one_value_once():
    assert span([1.0, 1.0004], "{:.2f}x".format) == "1.00x"
    assert span([2.0, 1.0], "{:.2f}x".format) == "1.00x to 2.00x"


@pytest.mark.parametrize("problem", [p for p in PROBLEMS if p.reports], ids=lambda p: p.title)
def test_every_answer_names_what_an_empty_report_lacks(problem):
    sentences = problem.answer({report: [] for report in problem.report_names})
    assert sentences and any("not in the report" in s for s in sentences)


@pytest.mark.parametrize("problem, present", [(p, name) for p in PROBLEMS if len(p.report_names) > 1
                                              for name in p.report_names],
                         ids=lambda v: v if isinstance(v, str) else v.title)
def test_every_answer_reads_any_one_of_its_reports_alone(problem, present):
    """A device can hold one of a problem's reports without the other (a run of one perf test, say; the
    flash_in_training report alone once stopped the index): the answer reads what is there."""
    sentences = problem.answer({present: []})
    assert sentences and any("not in the report" in s for s in sentences)


def test_regenerating_gives_the_same_bytes_and_no_date_but_the_reports(reports_root):
    first = write_index(reports_root).read_bytes()
    second = write_index(reports_root).read_bytes()
    assert first == second
    dates = set(re.findall(r"\d{4}-\d{2}-\d{2}[^|`]*UTC", first.decode()))
    assert dates == {RUN_DATE}


def test_index_states_its_command_and_answers_every_problem(reports_root):
    index = render_index(reports_root)
    assert f"Generated by `{INDEX_COMMAND}`" in index.split("\n## ")[0]
    assert [int(n) for n in re.findall(r"^## (\d+)\. ", index, re.MULTILINE)] == list(range(1, len(PROBLEMS) + 1))


def test_index_without_device_reports_says_nothing_was_measured(tmp_path):
    index = render_index(tmp_path)
    assert index.count("no device directory under the reports holds a report yet") == 17
    assert "`communication_accounting.md` is absent" in index


def test_command_writes_the_index_and_records_a_non_default_root(reports_root, capsys):
    assert main(["index", "--reports", str(reports_root)]) == 0
    written = reports_root / "README.md"
    assert capsys.readouterr().out.strip() == str(written)
    assert f"Generated by `{INDEX_COMMAND} --reports {reports_root}`" in written.read_text()


def test_rerender_writes_each_report_from_its_rows_and_metadata_then_the_index(tmp_path, capsys):
    write_fake_report(tmp_path / "h100", "my_benchmark", [{"size": "xl", "step_ms": 700.0}])  # a plain table
    stale = tmp_path / "h100" / "my_benchmark.md"
    assert main(["rerender", "--reports", str(tmp_path)]) == 0
    assert capsys.readouterr().out.split() == [str(stale), str(tmp_path / "README.md")]
    assert stale.read_text().endswith("| xl     | 700.00    |\n") and "- run 1: " in stale.read_text()
    assert (tmp_path / "README.md").read_text() == render_index(tmp_path, f"{INDEX_COMMAND} --reports {tmp_path}")


@pytest.mark.parametrize("command", ["index", "analysis", "rerender"])
@pytest.mark.parametrize("where, message", [
    ("", "--reports is empty"),
    ("a-file", "is a file, not a folder"),
    ("missing", "no such folder"),
])
def test_commands_refuse_a_reports_root_that_is_no_folder_and_write_nothing(tmp_path, monkeypatch, capsys,
                                                                           command, where, message):
    (tmp_path / "a-file").write_text("")
    monkeypatch.chdir(tmp_path)
    before = sorted(tmp_path.iterdir())
    code = main([command, "--reports", where])
    if command == "analysis" and where == "missing":  # analysis makes the folder it writes to
        assert code == 0 and (tmp_path / "missing" / "communication_accounting.md").is_file()
        return
    assert code == 2 and message in capsys.readouterr().err
    assert sorted(tmp_path.iterdir()) == before


def test_noisy_times_are_marked_and_left_out_of_speed_ups(tmp_path):
    def step(context: int, mean_ms: float, std_ms: float, compiled: bool) -> Row:
        return {**e2e_row("tiny", context, "train_step", mean_ms), "std_ms": std_ms, "compile": compiled}

    write_fake_report(tmp_path / "cpu", "torch_compile", [
        step(64, 10.0, 5.0, False), step(64, 5.0, 0.1, True), step(32, 8.0, 0.1, False), step(32, 4.0, 0.1, True)])
    index = render_index(tmp_path, cpu=True)
    assert ("makes the whole-model training step 2.00x as fast as eager over 1 size, context and precision cell "
            "(1 noisy cell left out)") in index
    assert "At tiny, context 64: fp32 10.0 ms -> 5 ms, 2.00x (noisy)." in index
    assert "The `cpu/` reports come from a CPU run" in index


def _status_row(index: str, title: str) -> list[str]:
    line = next(line for line in index.splitlines() if re.match(rf"\| \d+\. {re.escape(title)} +\|", line))
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_status_names_the_size_table_of_every_measured_size_and_what_the_current_one_lacks(reports_root):
    index = render_index(reports_root)
    header = [cell.strip() for cell in index.split("## Status", 1)[1].split("\n| ", 1)[1].split("\n")[0].strip("|").split("|")]
    assert header[-2:] == ["model sizes", "open"]
    row = _status_row(index, "benchmarking_script")
    # The 2025 table's 2.7B is the 2026 xl, its xl is no size of the 2026 table, and of the 2026 sizes only xl was
    # measured.
    assert row[-2] == "2025: xl, 2.7B"
    assert row[-1] == ("measured on the 2025 table's xl, which the 2026 table does not have; the 2026 table's "
                       "small, medium, large and 10B are not measured")
    write_fake_report(reports_root / "h100", "benchmarking_script",
                      [{**r, "size_table": "2026"} for r in step_rows("xl", {"train_step": 700.0})
                       + step_rows("10B", {"train_step": 2000.0})])
    row = _status_row(render_index(reports_root), "benchmarking_script")
    assert row[-2] == "2026: xl, 10B" and row[-1] == "the 2026 table's small, medium and large are not measured"


def test_open_items_name_runs_that_need_more_gpus_and_parts_the_rows_lack(reports_root):
    write_fake_report(reports_root / "h200", "distributed_communication_single_node", [
        {"backend": backend, "world_size": n, "size_bytes": 10**6, "status": "ok", "mean_rank_median_ms": 1.0,
         "busbw_gbps": 1.0}
        for backend, sizes in (("gloo", (2, 4, 6)), ("nccl", (2,))) for n in sizes])
    index = render_index(reports_root)
    assert _status_row(index, "distributed_communication_single_node")[-1] == (
        "h200: NCCL at 4 and 6 ranks: needs as many GPUs in one machine")
    assert _status_row(index, "fsdp")[-1] == "needs a machine with 2 GPUs: `pytest perf/ -m fsdp --world-size 2`"
    assert _status_row(index, "gradient_checkpointing")[-1].endswith(
        "h100: the 2026 handout's (b) is xl at batch 4, context 2,048; this run measured context 1024 "
        "(`make single-gpu-reports` runs it)")
    assert _status_row(index, "leaderboard (2026 handout only)")[-1] == "needs a machine with 2 GPUs: `pytest perf/ -m leaderboard --world-size 2`"
    # A problem the 2026 handout dropped is still indexed, and says which handout asks it.
    assert _status_row(index, "ddp_overlap_bucketed (2025 handout only)")
    assert "## 18. communication_accounting (2025 handout only)" in index


def test_a_problem_with_some_of_its_reports_names_the_missing_ones_and_the_run_that_writes_them(reports_root):
    write_fake_report(reports_root / "h100", "optimizer_state_sharding", [{"table": "step", "status": "ok"}])
    row = _status_row(render_index(reports_root), "optimizer_state_sharding")
    assert row[1] == "1 of 2 reports"
    assert row[-1] == ("h100: optimizer_state_sharding_accounting not measured: "
                       "`pytest perf/ -m sharding --gpu h100 --world-size 2`")


def test_the_2026_parallelism_problems_are_answered_from_their_reports(tmp_path):
    from cs336_systems.reports.parallelism_calcs import write_parallelism_calcs

    write_parallelism_calcs(tmp_path)
    index = render_index(tmp_path)
    section = index[index.index("## 19. alternate_ring_all_reduce"):index.index("## 24. leaderboard")]
    assert "T = (N - 1) S / W, N/2 times the ring all-reduce's" in section
    assert "N_TP <= 1 + 3 D_FF W / (2 C) = 7.99" in section and "N_DP <= 1 + B W / C = 8.45" in section
    assert "sharing the network N <= (a b + a + b)^2 / (4 a b) = 21.2" in section


def test_memory_profiling_answer_includes_part_f(tmp_path):
    base = {"size": "xl", "size_table": "2026", "batch_size": 4, "attention": "naive", "precision": "fp32",
            "context_length": 128}
    rows = [{**base, "table": "peak", "mode": mode, "status": "ok", "peak_bytes": 60 * 2**30}
            for mode in ("inference", "train_step")]
    rows += [{**base, "table": "block", "status": "ok", "block": i, "saved_bytes": 166 * 2**20,
              "predicted_saved_bytes": 166 * 2**20, "weight_gradient_bytes": 4 * 104_862_720, "parameters": 104_862_720,
              "gradient_bytes": 405 * 2**20} for i in range(32)]
    rows += [{**base, "table": "block_operation", "block": 16, "rank": 1, "operation": "aten::mm", "bytes": 40 * 2**20,
              "share": 0.24}, {**base, "table": "snapshot", "file": "memory_xl_train_step_fp32_ctx128.pickle"},
             {**base, "context_length": 2048, "table": "peak", "mode": "train_step", "status": "OOM"}]
    write_fake_report(tmp_path / "h100", "memory_profiling", rows)
    index = render_index(tmp_path)
    assert ("(f) In fp32 at context 128 a block saves 166.00 MiB for backward (the model: 166.00 MiB), 24% of it "
            "allocated by `aten::mm` (24%); its weight gradients should take 4 bytes x 104,862,720 parameters = "
            "400.02 MiB and take 400.02 MiB; the allocator saw its backward add 405.00 MiB of gradients, 4.98 MiB "
            "beyond the weights'.") in index
    assert _status_row(index, "memory_profiling")[-1] == ""


COMMITTED = Path(__file__).resolve().parents[1] / "reports"


def test_the_committed_index_is_the_one_the_committed_rows_give():
    assert (COMMITTED / "README.md").read_text() == render_index(COMMITTED), (
        f"reports/README.md is stale: run `{INDEX_COMMAND}` and commit it")


def test_a_cpu_run_changes_neither_the_index_of_the_gpu_reports_nor_what_the_committed_checks_read(reports_root):
    before = render_index(reports_root)
    write_fake_report(reports_root / CPU_SLUG, "benchmarking_script", step_rows("tiny", {"train_step": 10.0}))
    assert render_index(reports_root) == before
    assert result_directories(reports_root) == ["h100"]
    assert index_path(reports_root, cpu=True) == reports_root / CPU_SLUG / "README.md"


def test_a_cpu_runs_index_lives_in_its_directory_and_links_from_there(reports_root):
    write_fake_report(reports_root / CPU_SLUG, "gradient_checkpointing",
                      read_rows(reports_root / "h100" / "gradient_checkpointing.csv"),
                      plots=("gradient_checkpointing.png",))
    (reports_root / CPU_SLUG / "gradient_checkpointing.png").write_bytes(b"\x89PNG")
    paths = write_indexes(reports_root)
    assert paths == [reports_root / "README.md", reports_root / CPU_SLUG / "README.md"]
    index = paths[1].read_text()
    targets = re.findall(r"\]\(([^)]+)\)", index)
    assert {"gradient_checkpointing.md", "gradient_checkpointing.png", "../communication_accounting.md"} <= set(targets)
    assert all((paths[1].parent / target).exists() for target in targets)
    assert "h100" not in index and "The `cpu/` reports come from a CPU run" in index
    assert "The `cpu/` reports" not in paths[0].read_text() and "cpu/README.md" in paths[0].read_text()


def test_a_report_that_only_gpu_tests_write_is_not_asked_of_a_cpu_run(tmp_path):
    write_fake_report(tmp_path / CPU_SLUG, "flash_benchmarking", [
        {"table": "sweep", "provider": provider, "precision": "fp32", "mode": "forward_backward", "head_dim": 16,
         "seq_len": 128, "status": "ok", "median_ms": ms} for provider, ms in (("naive", 2.0), ("flash_triton", 1.0))])
    index = render_index(tmp_path, cpu=True)
    assert "--gpu none" not in index[index.index("## 10. flash_benchmarking"):].split("\n## ")[0]
    assert ("- cpu: not measured: `cpu/flash_in_training.md` is absent: its perf tests need a CUDA GPU, so a CPU "
            "run skips them; `pytest perf/ -m flash --gpu auto` on a GPU writes it.") in index
    assert _status_row(index, "flash_benchmarking")[-1] == (
        "cpu: flash_in_training needs a CUDA GPU: `pytest perf/ -m flash --gpu auto` on one")
    # A report that CPU runs do write is still asked of one, with the command that writes it.
    assert "no `pytest perf/ -m e2e --gpu none` run has written it yet" in index


@pytest.mark.parametrize("csv", sorted(f"{slug}/{p.name}" for slug in result_directories(COMMITTED)
                                       for p in (COMMITTED / slug).glob("*.csv")))
def test_each_committed_report_is_the_one_its_rows_and_metadata_give(csv, tmp_path):
    report = COMMITTED / csv
    copy = tmp_path / report.parent.name
    copy.mkdir()
    for suffix in (".csv", ".meta.json", ".md"):
        shutil.copy(report.with_suffix(suffix), copy)
    assert rerender(copy, problems.report(report.stem)).read_text() == report.with_suffix(".md").read_text(), (
        f"reports/{csv[:-4]}.md is not what its rows and metadata give (after an edit on its measured path, its header "
        "marks the runs that edit leaves on earlier code): run `python -m cs336_systems rerender` and commit it")


def test_a_problem_that_picks_its_sizes_is_not_told_the_others_are_missing(tmp_path):
    rows = [{"table": "cell", "size": size, "size_table": "2026", "context_length": 512, "status": "ok"}
            for size in ("small", "xl")]
    write_fake_report(tmp_path / "h100", "nsys_profile", rows)
    write_fake_report(tmp_path / "h100", "benchmarking_script",
                      [{**e2e_row(size, 512, "train_step", 100.0), "size_table": "2026"} for size in ("small", "xl")])
    index = render_index(tmp_path)
    assert "not measured" not in _status_row(index, "nsys_profile")[-1]
    assert "the 2026 table's medium, large and 10B are not measured" in _status_row(index, "benchmarking_script")[-1]


def test_a_report_measured_on_earlier_code_is_marked_so_with_its_date_and_the_run_that_measures_it_again(tmp_path):
    rows = step_rows("xl", {"train_step": 700.0})
    write_fake_report(tmp_path / "h100", "benchmarking_script", rows, measured_code="0123456789abcdef")
    write_fake_report(tmp_path / "h200", "benchmarking_script", rows)
    index = render_index(tmp_path)
    assert _status_row(index, "benchmarking_script")[1:3] == [f"measured on earlier code ({RUN_DATE.split()[0]})",
                                                              "measured"]
    assert (f"- h100: measured on earlier code: `h100/benchmarking_script.md` run 1 ({RUN_DATE}); the code on its "
            "measured path has changed since, and `pytest perf/ -m e2e --gpu h100` measures it on the current "
            "code.") in index
    assert "- h200: measured on earlier code" not in index
