"""reports/README.md, the index: figures read from the rows, links to files that exist, absent
reports listed as not measured, the same bytes on every regeneration."""

import re
from pathlib import Path

import pytest

from cs336_systems.__main__ import main
from cs336_systems.benchmarks.communication_accounting import communication_accounting_rows
from cs336_systems.report_index import INDEX_COMMAND, PROBLEMS, render_index, write_index
from cs336_systems.reports import Row, write_csv

RUN_DATE = "2030-01-02 03:04 UTC"


def write_fake_report(directory: Path, problem: str, rows: list[Row], plots: tuple[str, ...] = ()) -> None:
    """A report as write_report leaves it (header, CSV, image links), without its renderer."""
    directory.mkdir(parents=True, exist_ok=True)
    write_csv(directory / f"{problem}.csv", rows)
    images = "".join(f"\n![plot]({name})\n" for name in plots)
    (directory / f"{problem}.md").write_text(
        f"# {problem}\n\n- device: Fake GPU 80GB\n- software: python 3.12, torch 9.9\n"
        f"- run 1: {RUN_DATE}, `pytest perf/ -m e2e`\n\nbody\n{images}")


def e2e_row(size: str, context: int, phase: str, mean_ms: float) -> Row:
    return {"table": "sweep", "size": size, "context_length": context, "batch_size": 4, "precision": "fp32",
            "compile": False, "phase": phase, "status": "ok", "mean_ms": mean_ms, "std_ms": mean_ms / 100,
            "median_ms": mean_ms, "first_ms": mean_ms, "steps": 10, "warmup": 5}


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
    assert "2.25 GiB at every 4 blocks, the measured k nearest the sqrt(L) estimate sqrt(16) = 4.0" in index
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
    write_fake_report(tmp_path / "h100", "benchmarking_script", step_rows("xl", {"train_step": 700.0}))
    write_fake_report(tmp_path / "h100", "torch_compile", step_rows("xl", {"train_step": 700.0}))
    index = render_index(tmp_path)
    assert "the 2.7B step is not in the report" in index
    assert "xl takes 700.0 ± 7.0 ms" in index
    assert "The attention sweep compiled against eager" in index


@pytest.mark.parametrize("problem", [p for p in PROBLEMS if p.reports], ids=lambda p: p.title)
def test_every_answer_names_what_an_empty_report_lacks(problem):
    sentences = problem.answer({report: [] for report in problem.reports})
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
    assert index.count("no device directory under the reports holds a report yet") == 16
    assert "`communication_accounting.md` is absent" in index


def test_command_writes_the_index_and_records_a_non_default_root(reports_root, capsys):
    assert main(["index", "--reports", str(reports_root)]) == 0
    written = reports_root / "README.md"
    assert capsys.readouterr().out.strip() == str(written)
    assert f"Generated by `{INDEX_COMMAND} --reports {reports_root}`" in written.read_text()
