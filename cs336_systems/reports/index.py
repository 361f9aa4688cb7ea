"""The reports' index, `reports/README.md`: every problem's written answers in a few sentences whose
figures are read from its reports' rows, with links to its tables and plots, and, for each device,
the reports that are absent and the run that would write them.

    python -m cs336_systems index                   # writes reports/README.md (and reports/cpu/README.md)
    write_index("reports")                          # the GPU reports' index
    write_index("reports", cpu=True)                # a CPU run's, in reports/cpu/

The committed index covers the GPU directories only. A CPU run's reports (`reports/cpu/`, git-ignored:
they show that the code runs, not how fast) get an index of their own inside that directory, so a CPU
run, `make perf` on a laptop, leaves every committed file as it was.

Device reports live in `<reports>/<gpu-slug>/<problem>.md` (+ `.csv`, `.png`); the closed-form
communication_accounting report lives in `<reports>/` itself. A problem's answer function,
`answer_<problem>` beside the renderer of its reports in cs336_systems.reports.<family>, turns the rows of
its reports (`cs336_systems.runs.read_rows`) into sentences; where a row it quotes is not in the
report, the sentence says so instead of guessing (`open_items_<problem>`, where there is one, names
what the rows leave unanswered). This module only assembles them: the table of problems
(cs336_systems.reports.problems) names each problem's reports and functions, and the index adds the links,
devices and status around them, and marks reports whose runs measured earlier code than their perf modules
run now (cs336_systems.reports.earlier_code_runs), with those runs' dates. The index carries no date of its own
(only those quoted from report headers), so writing it again from the same reports and code gives the same bytes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from cs336_systems.gpus import GPU_SPECS
from cs336_systems.model import DEFAULT_SIZE_TABLE as CURRENT_SIZE_TABLE
from cs336_systems.model import model_sizes
from cs336_systems.reports.problems import PROBLEMS, Problem
from cs336_systems.reports import (
    ANALYSIS_COMMAND,
    Report,
    Reports,
    earlier_code_runs,
    earlier_code_text,
    listing,
    markdown_table,
    measured_sizes,
    shown_figures,
    span,
)
from cs336_systems.rows import Row
from cs336_systems.runs import Metadata, RunRecord, metadata_path, read_rows

INDEX_FILE = "README.md"
INDEX_COMMAND = "python -m cs336_systems index"
CPU_SLUG = "cpu"
CPU_NOTE = (f"The `{CPU_SLUG}/` reports come from a CPU run: Triton kernels ran in the Triton interpreter and every "
            "time there is a CPU time, which shows that the code runs, not how fast a GPU runs it.\n")


# ---------------------------------------------------------------------------------------- the index

@dataclass(frozen=True)
class _Directory:
    """A directory of reports: a device's (`<root>/<slug>`) or the root's own."""
    path: Path
    prefix: str  # the directory relative to the index: "", "<slug>/" or "../"

    def has(self, report: str) -> bool:
        return (self.path / f"{report}.csv").is_file()

    def rows(self, report: str) -> list[Row]:
        return read_rows(self.path / f"{report}.csv")

    def earlier_code(self, report: str) -> list[tuple[int, RunRecord]]:
        """(number, run) of the report's runs that measured earlier code than its perf modules run now."""
        sidecar = metadata_path(self.path, report)
        return earlier_code_runs(Metadata.read(sidecar)) if sidecar.is_file() else []

    def links(self, report: str) -> list[str]:
        """The report's table, and the plots its Markdown shows, as links relative to the index."""
        markdown = self.path / f"{report}.md"
        if not markdown.is_file():
            return []
        return [f"[{path.name}]({self.prefix}{path.name})" for path in (markdown, *shown_figures(markdown))]


@dataclass(frozen=True)
class _Layout:
    """The reports an index reads and the folder it is written in, which its links are relative to."""
    reports_root: Path
    index_dir: Path

    def directory(self, slug: str = "") -> _Directory:
        """A device's directory, or with no slug the reports' root (the closed-form reports)."""
        path = self.reports_root / slug
        relative = Path(os.path.relpath(path, self.index_dir)).as_posix()
        return _Directory(path, "" if relative == "." else f"{relative}/")


def _device_directories(reports_root: Path) -> list[str]:
    """The slugs of the subdirectories that hold at least one report."""
    return sorted(p.name for p in reports_root.iterdir() if p.is_dir() and any(p.glob("*.csv")))


def result_directories(reports_root: Path | str) -> list[str]:
    """The device directories whose reports are results to keep, the ones the repository commits: every one that
    holds a report but a CPU run's, which shows that the code runs (reports/cpu/ is git-ignored)."""
    return [slug for slug in _device_directories(Path(reports_root)) if slug != CPU_SLUG]


def _device_table(layout: _Layout, slugs: list[str]) -> str:
    table = []
    for slug in slugs:
        # The problems' reports (each a CSV with its metadata).
        metadata = [Metadata.read(metadata_path(csv.parent, csv.stem))
                    for csv in sorted((layout.reports_root / slug).glob("*.csv"))]
        devices = dict.fromkeys(m.device for m in metadata)
        software = dict.fromkeys(run.software_text for m in metadata for run in m.runs)
        dates = sorted(run.date for m in metadata for run in m.runs)
        table.append({"directory": f"[{slug}/]({layout.directory(slug).prefix or './'})", "device": "; ".join(devices),
                      "software": "; ".join(software),
                      "runs": f"{dates[0]} to {dates[-1]}" if len(set(dates)) > 1 else "".join(dates[:1])})
    return markdown_table(table)


def _perf_command(problem: Problem, slug: str) -> str:
    gpu = "none" if slug == CPU_SLUG else slug if slug in GPU_SPECS else "auto"
    world_size = f" --world-size {problem.gpus}" if problem.gpus > 1 else ""
    return f"`pytest perf/ -m {problem.marker} --gpu {gpu}{world_size}`"


def _skipped_on_cpu(report: Report, slug: str) -> bool:
    """Whether `report` is absent from `slug` because a CPU run skips the tests that write it."""
    return slug == CPU_SLUG and report.needs_gpu


def _not_measured(problem: Problem, reports: list[Report], slug: str) -> list[str]:
    lines = []
    for gpu_only in (False, True):
        names = [report.name for report in reports if _skipped_on_cpu(report, slug) == gpu_only]
        if not names:
            continue
        files = listing([f"`{slug}/{name}.md`" for name in names])
        absent = f"{files} {'is' if len(names) == 1 else 'are'} absent"
        them, its = ("it", "its") if len(names) == 1 else ("them", "their")
        if gpu_only:
            lines.append(f"- {slug}: not measured: {absent}: {its} perf tests need a CUDA GPU, so a CPU run skips "
                         f"them; `pytest perf/ -m {problem.marker} --gpu auto` on a GPU writes {them}.")
        elif problem.gpus > 1 and slug != CPU_SLUG:
            lines.append(f"- {slug}: not measured: needs {problem.gpus} GPUs. {absent}: no "
                         f"{_perf_command(problem, slug)} run on a {problem.gpus}-GPU machine has written {them} yet.")
        else:
            lines.append(f"- {slug}: not measured: {absent}: no {_perf_command(problem, slug)} run has written {them} "
                         "yet.")
    return lines


def _device_paragraph(problem: Problem, layout: _Layout, slug: str) -> str:
    directory = layout.directory(slug)
    present = [r.name for r in problem.reports if directory.has(r.name)]
    absent = [r for r in problem.reports if r.name not in present]
    lines = []
    if present:
        links = [link for report in present for link in directory.links(report)]
        sentences = problem.answer({report: directory.rows(report) for report in present})
        lines.append(f"**{slug}**" + (f" ({', '.join(links)})" if links else "") + ": " + " ".join(sentences))
    earlier = [(report, runs) for report in present if (runs := directory.earlier_code(report))]
    if earlier:
        described = listing([f"`{slug}/{report}.md` {earlier_code_text(runs)}" for report, runs in earlier])
        its, it = ("its", "it") if sum(len(runs) for _, runs in earlier) == 1 else ("their", "them")
        lines.append(f"- {slug}: measured on earlier code: {described}; the code on {its} measured path has changed "
                     f"since, and {_perf_command(problem, slug)} measures {it} on the current code.")
    return "\n\n".join(lines + _not_measured(problem, absent, slug))


def _earlier_code_days(problem: Problem, directory: _Directory) -> str:
    """ " on earlier code (2026-11-26 to 2026-11-28)": the days its runs on earlier code measured the problem's
    reports in `directory`; "" where none did."""
    days = sorted({run.date.split()[0] for report in problem.report_names if directory.has(report)
                   for _, run in directory.earlier_code(report)})
    return f" on earlier code ({span(days, str)})" if days else ""


def _status(problem: Problem, layout: _Layout, slug: str) -> str:
    if not problem.report_names:
        return "open" if problem.open_items else "no report (correctness tests)"
    if problem.device_independent:
        return "device-independent" if layout.directory().has(problem.report_names[0]) else "not computed"
    present = [r for r in problem.report_names if layout.directory(slug).has(r)]
    if not present:
        return "not measured"
    earlier = _earlier_code_days(problem, layout.directory(slug))
    if len(present) < len(problem.report_names):
        return f"{len(present)} of {len(problem.report_names)} reports{earlier}"
    return f"measured{earlier}"


def _section(number: int, problem: Problem, layout: _Layout, slugs: list[str]) -> str:
    head = f"## {number}. {problem.label}\n\n"
    if not problem.report_names:
        return head + " ".join(problem.answer({})) + "\n"
    if problem.device_independent:
        root, report = layout.directory(), problem.report_names[0]
        if not root.has(report):
            return head + f"- not computed: `{report}.md` is absent; `{ANALYSIS_COMMAND}` writes it.\n"
        links = root.links(report)
        return (head + "Device-independent, closed form" + (f" ({', '.join(links)})" if links else "") + ": "
                + " ".join(problem.answer({report: root.rows(report)})) + "\n")
    if not slugs:
        return head + "- not measured: no device directory under the reports holds a report yet.\n"
    return head + "\n\n".join(_device_paragraph(problem, layout, slug) for slug in slugs) + "\n"


def _measured(problem: Problem, layout: _Layout, slugs: list[str]) -> dict[str, Reports]:
    """slug -> the problem's reports present there ("" for the reports' root, closed forms)."""
    if problem.device_independent:
        root = layout.directory()
        if not root.has(problem.report_names[0]):
            return {}
        return {"": {r: root.rows(r) for r in problem.report_names if root.has(r)}}
    found = {}
    for slug in slugs:
        directory = layout.directory(slug)
        present = {r: directory.rows(r) for r in problem.report_names if directory.has(r)}
        if present:
            found[slug] = present
    return found


def _open(problem: Problem, measured: dict[str, Reports], sizes: dict[str, list[str]]) -> list[str]:
    """What is left to answer: runs no machine here has made, old runs, parts the rows lack."""
    items = []
    if not problem.report_names:
        return problem.open_items({}) if problem.open_items else []
    complete = [slug for slug, reports in measured.items() if len(reports) == len(problem.report_names)]
    if not complete and measured and not problem.device_independent:  # some of its reports, on some devices
        for slug, reports in measured.items():
            missing = [r for r in problem.reports if r.name not in reports]
            for gpu_only in (False, True):
                names = [r.name for r in missing if _skipped_on_cpu(r, slug) == gpu_only]
                if names and gpu_only:
                    items.append(f"{slug}: {listing(names)} needs a CUDA GPU: `pytest perf/ -m {problem.marker} "
                                 "--gpu auto` on one")
                elif names:
                    items.append(f"{slug}: {listing(names)} not measured: " + _perf_command(problem, slug))
    elif not complete:
        if problem.device_independent:
            items.append(f"not computed: `{ANALYSIS_COMMAND}`")
        elif problem.gpus > 1:
            items.append(f"needs a machine with {problem.gpus} GPUs: `pytest perf/ -m {problem.marker} "
                         f"--world-size {problem.gpus}`")
        else:
            items.append(f"not measured on a GPU: `pytest perf/ -m {problem.marker} --gpu auto`")
    items += _size_gaps(sizes, problem.every_size)
    if problem.open_items:
        items += [f"{slug}: {item}" if slug else item for slug, reports in measured.items()
                  if len(reports) == len(problem.report_names) for item in problem.open_items(reports)]
    return items


def _size_gaps(sizes: dict[str, list[str]], every_size: bool = True) -> list[str]:
    """The current table's sizes a sweep over `every_size` left out, and sizes measured that the current table
    lacks. A size of another table with the same shape counts as measured (the 2025 table's 2.7B is the 2026 xl)."""
    current = {name: shape for name, shape in model_sizes(CURRENT_SIZE_TABLE).items() if name != "tiny"}
    shapes = {(table, name): model_sizes(table).get(name) for table, names in sizes.items() for name in names}
    foreign = [f"{table} table's {name}" for (table, name), shape in shapes.items()
               if name != "tiny" and shape not in current.values()]
    items = [f"measured on the {listing(foreign)}, which the {CURRENT_SIZE_TABLE} table does not have"] if foreign else []
    if every_size and len([name for _, name in shapes if name != "tiny"]) > 1:  # a sweep over sizes
        missing = [name for name, shape in current.items() if shape not in shapes.values()]
        if missing:
            items.append(f"the {CURRENT_SIZE_TABLE} table's {listing(missing)} {'is' if len(missing) == 1 else 'are'} "
                         "not measured")
    return items


def index_path(reports_root: Path | str, cpu: bool = False) -> Path:
    """Where the index goes: `<reports_root>/README.md` for the reports kept (every GPU's), or a CPU run's own
    `<reports_root>/cpu/README.md`, so that a CPU run never changes the committed index."""
    return Path(reports_root) / (CPU_SLUG if cpu else "") / INDEX_FILE


def render_index(reports_root: Path | str, command: str = INDEX_COMMAND, cpu: bool = False) -> str:
    """The index of the GPU reports under `reports_root`, or with `cpu` the index of a CPU run's reports."""
    reports_root = Path(reports_root)
    if not reports_root.is_dir():
        raise ValueError(f"no reports directory {reports_root}")
    layout = _Layout(reports_root, index_path(reports_root, cpu).parent)
    if cpu:
        slugs = [CPU_SLUG] if CPU_SLUG in _device_directories(reports_root) else []
        scope = (f"This index covers a CPU run's reports, `{CPU_SLUG}/`, which are not committed; "
                 f"[../{INDEX_FILE}](../{INDEX_FILE}) indexes the GPU reports.\n\n{CPU_NOTE}")
    else:
        slugs = result_directories(reports_root)
        scope = (f"This index covers the GPU reports. A CPU run's reports, `{CPU_SLUG}/`, are not committed; such a run "
                 f"writes an index of its own, `{CPU_SLUG}/{INDEX_FILE}`.\n")
    status = []
    for number, problem in enumerate(PROBLEMS, 1):
        measured = _measured(problem, layout, slugs)
        sizes = measured_sizes(r for reports in measured.values() for rows in reports.values() for r in rows)
        status.append({"problem": f"{number}. {problem.label}", **{s: _status(problem, layout, s) for s in slugs},
                       "model sizes": "; ".join(f"{table}: {', '.join(names)}" for table, names in sizes.items()),
                       "open": "; ".join(_open(problem, measured, sizes))})
    parts = [
        "# Reports index\n",
        f"Generated by `{command}` from the reports' CSVs; run it again rather than editing this file. Every "
        "figure below is read from the rows of the report linked beside it, whose header names the device, "
        "software versions, dates and command that measured it. Each CSV has one line per measured number: "
        "`cell, run, device, dtype, shape, variant, status, statistic, value, unit` (`cs336_systems/rows.py`).\n",
        scope,
        "## Devices\n",
        _device_table(layout, slugs) if slugs else "No device reports yet.\n",
        "## Status\n",
        "Per problem and device directory: whether its reports are there, the model sizes they measured (by size "
        "table) and what is still open.\n",
        markdown_table(status),
        *(_section(number, problem, layout, slugs) for number, problem in enumerate(PROBLEMS, 1)),
    ]
    return "\n".join(parts)


def write_index(reports_root: Path | str, command: str = INDEX_COMMAND, cpu: bool = False) -> Path:
    """Write the index `render_index` gives at `index_path`; returns its path."""
    path = index_path(reports_root, cpu)
    path.write_text(render_index(reports_root, command, cpu))
    return path


def write_indexes(reports_root: Path | str, command: str = INDEX_COMMAND) -> list[Path]:
    """The GPU reports' index and, where a CPU run left reports, the CPU run's own; returns their paths."""
    with_cpu = CPU_SLUG in _device_directories(Path(reports_root))
    return [write_index(reports_root, command), *([write_index(reports_root, command, cpu=True)] if with_cpu else [])]
