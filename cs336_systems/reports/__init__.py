"""The reports: rows -> Markdown, CSV and PNG, with a header naming the device, versions, dates and commands.

    problems.py   the table of problems: each report's declared layout and cell key, each problem's answer
    spec.py       the one renderer that draws every layout
    <family>.py   one per problem family, named as its benchmark (e2e, attention, flash, ddp, ...): the
                  sentences that interpret its rows, and the answers to its problems
    index.py      reports/README.md, every problem answered from its reports' rows
    staging.py    a run's rows, staged until it ends, then written as reports

This module is what they share: the formatting of cells and sentences, and `write_report`, which renders a
report's rows and writes `<problem>.md` beside the CSV and metadata of its runs (cs336_systems.runs) and its
figures. The Markdown header is rendered from that metadata, never parsed back; it marks a run whose measured
code is not the code the report's perf modules run now as measured on earlier code (its rows stay, as that
code's numbers).
"""

from __future__ import annotations

import math
import os
import re
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from tabulate import tabulate

from cs336_systems.checks import is_finite, is_positive_finite
from cs336_systems.provenance import PACKAGE_ROOT
from cs336_systems.rows import OOM, Row, from_long, to_long, without_samples
from cs336_systems.rows.flash import median_ratio
from cs336_systems.runs import (
    Metadata,
    RunRecord,
    device_description,
    merge_runs,
    metadata_path,
    on_cuda,
    read_rows,
    replace_text,
    run_of,
    staging_path,
    this_run,
    write_csv,
)

Reports = dict[str, list[Row]]  # report name -> its rows, for the reports of a problem that exist
# A cell the memory model said would not fit was never started: tables say so, not just OOM.
NOT_RUN = "predicted, not run"
PREDICTED_OOM = f"OOM ({NOT_RUN})"
# A cell whose std is above this share of its mean varied too much between repetitions to be read as
# one number; its table cell says so.
NOISY_RELATIVE_STD = 0.20
NOISY = "noisy"
# What a table or sentence shows for a number that was not measured (NaN, or a time that is not finite): never a
# blank, which reads as a column that does not apply, and never "nan" or "nanx", which read as numbers.
NOT_A_NUMBER = "n/a"


@dataclass
class Rendered:
    body: str
    figures: dict[str, Any] = field(default_factory=dict)  # file name -> matplotlib Figure


Renderer = Callable[[list[Row]], Rendered]


def plain_table(rows: list[Row]) -> Rendered:
    """Every row, every column: the rendering of a report the problems table does not name."""
    return Rendered(markdown_table(rows))


@dataclass(frozen=True)
class Report:
    """One report: its name (the stem of its files), the function that renders its rows, and `key`, the
    columns that identify a measured cell.

    With a key, a report accumulates runs: a later run's rows replace earlier rows with the same key
    and the others stay, so a long sweep can be measured in parts; the header lists every run that
    still contributes rows. Without a key, each run replaces the whole report. The reports of the
    course's problems are listed in cs336_systems.reports.problems. `needs_gpu`: every perf test that writes it
    is marked gpu, so a CPU run never does.
    """
    name: str
    render: Renderer = plain_table
    key: tuple[str, ...] | None = None
    needs_gpu: bool = False

    def cell(self, row: Row) -> tuple:
        """The measured cell `row` belongs to: its values of `key`."""
        return tuple(row.get(k) for k in self.key)


def format_value(value: Any) -> str:
    """A table cell's text: "" for None (no such value), NOT_A_NUMBER for NaN (not measured). An infinity is a
    result, a float16 sum that overflowed say, and reads "inf"."""
    if isinstance(value, bool) or value is None:
        return "" if value is None else str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return NOT_A_NUMBER
        if value == 0:
            return "0"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        if abs(value) >= 1:
            return f"{value:.2f}"
        return f"{value:.3g}"
    if isinstance(value, int):
        return f"{value:,}" if abs(value) >= 10_000 else str(value)
    return str(value)


def mean_std(mean: float, std: float, spec: str = ".1f", std_spec: str | None = None, unit: str = "",
             samples: int | None = None) -> str:
    """ "mean ± std [unit]", flagged noisy when the std is above NOISY_RELATIVE_STD of the mean or is not a finite
    number. A mean that is not a finite number was not measured: NOT_A_NUMBER. Given the number of `samples`, one
    sample shows as "mean (n=1)": it has no spread to show, and its std of 0 would read as a steady time."""
    suffix = f" {unit}" if unit else ""
    if not is_finite(mean):
        return NOT_A_NUMBER
    if samples == 1:
        return f"{mean:{spec}} (n=1){suffix}"
    spread = f"{std:{std_spec or spec}}" if is_finite(std) else NOT_A_NUMBER
    return noisy_marked(f"{mean:{spec}} ± {spread}{suffix}", is_noisy(mean, std))


def oom_text(row: Row) -> str:
    """An OOM cell as a table shows it: predicted by the memory model and not run, or run out of memory."""
    return PREDICTED_OOM if row.get("oom_predicted") else OOM


def oom_note(row: Row) -> str:
    """An OOM cell in words, as a command prints it: predicted and never run, or run out of memory, with the
    memory model's estimate (cs336_systems.memory_guard). What the command did instead is the caller's to say."""
    estimate = (f"the memory model estimates a peak of {format_bytes(row['estimated_peak_bytes'])} against "
                f"{format_bytes(row['available_bytes'])} available")
    if row.get("oom_predicted"):
        return f"{PREDICTED_OOM}: {estimate}"
    return f"{OOM}: it ran out of memory ({estimate})"


def is_noisy(mean: float, std: float) -> bool:
    """Whether a time varied too much to be read as one number: its std above NOISY_RELATIVE_STD of its mean, or
    either not a finite number, so that how much it varied cannot be told."""
    if not (is_finite(mean) and is_finite(std)):
        return True
    return mean > 0 and std / mean > NOISY_RELATIVE_STD


def noisy_marked(text: str, noisy: bool) -> str:
    """`text`, followed by "(noisy)" where it is."""
    return f"{text} ({NOISY})" if noisy else text


def percentiles_noisy(row: Row) -> bool:
    """Whether a do_bench row's middle 60% of samples (p20 to p80) spans more than NOISY_RELATIVE_STD of its
    median."""
    return is_noisy(row["median_ms"], row["p80_ms"] - row["p20_ms"])


def ratio_cell(slow: Row | None, fast: Row | None, spec: str = ".3g") -> str:
    """`slow`'s median over `fast`'s, "3.8x", marked noisy where either time is, as each time's own cell is; ""
    unless both ran."""
    ratio = median_ratio(slow, fast)
    return "" if ratio is None else noisy_marked(f"{ratio:{spec}}x", percentiles_noisy(slow) or percentiles_noisy(fast))


def span(values: Sequence[float], fmt: Callable[[float], str]) -> str:
    """ "low to high", or one value where both read the same: never "X to X"."""
    low, high = fmt(min(values)), fmt(max(values))
    return low if low == high else f"{low} to {high}"


def format_bytes(num_bytes: float | None, byte_unit: str = "B") -> str:
    """Bytes in the largest binary unit that keeps the number at 1 or more ("" for None); under a KiB,
    in `byte_unit` (the index's sentences spell out "bytes", the tables write "B")."""
    if num_bytes is None:
        return ""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(num_bytes) >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{num_bytes:.0f} {byte_unit}"


def format_ms(value: float) -> str:
    """A time as a sentence quotes it: one decimal from 10 ms, three significant digits below."""
    if not is_finite(value):
        return NOT_A_NUMBER
    return f"{value:,.1f} ms" if abs(value) >= 10 else f"{value:.3g} ms"


def format_ratio(value: float) -> str:
    return f"{value:.2f}x" if is_finite(value) else NOT_A_NUMBER


def format_share(value: float) -> str:
    return f"{value:.0%}" if is_finite(value) else NOT_A_NUMBER


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """ "1 block", "3 blocks" (or `nouns` where the plural is not noun + s)."""
    return f"{format_value(count)} {noun if count == 1 else nouns or noun + 's'}"


def listing(items: Sequence[str]) -> str:
    """ "a", "a and b", "a, b and c"."""
    items = list(items)
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def not_in_report(what: str) -> str:
    """What an answer says where a row it would quote is missing, instead of guessing."""
    return f"{what} is not in the report."


def tolerance_verdict(row: Row) -> str:
    """An equivalence row's result: "within the tolerance 1e-05", or OUTSIDE it in capitals."""
    return f"{'within' if row['matches'] else 'OUTSIDE'} the tolerance {row['tolerance']:g}"


def _times_noisy(*rows: Row, prefix: str = "") -> bool:
    """Whether any of these rows' times (`<prefix>mean_ms`, `<prefix>std_ms`) varied too much to be one number."""
    return any(is_noisy(r[f"{prefix}mean_ms"], r[f"{prefix}std_ms"] or 0.0) for r in rows)


def _times_measured(*rows: Row, prefix: str = "") -> bool:
    """Whether each of these rows' mean times (`<prefix>mean_ms`) is a number above zero and finite: one that is
    not was not measured, and no ratio can be taken of it."""
    return all(is_positive_finite(r[f"{prefix}mean_ms"]) for r in rows)


def speedup_text(slow: Row, fast: Row, prefix: str = "") -> str:
    """The ratio of two rows' mean times, "2.00x", marked noisy where either time is; NOT_A_NUMBER where either
    time was not measured."""
    if not _times_measured(slow, fast, prefix=prefix):
        return NOT_A_NUMBER
    ratio = format_ratio(slow[f"{prefix}mean_ms"] / fast[f"{prefix}mean_ms"])
    return noisy_marked(ratio, _times_noisy(slow, fast, prefix=prefix))


@dataclass(frozen=True)
class SpeedUps:
    """How much faster one variant ran than another over many cells, read only from the cells where both times
    were measured and are steady: a ratio of two noisy means is no finding, nor is one of a time that is not a
    number. A report's findings and the index's answer quote the same SpeedUps, so they quote the same figures."""
    ratios: tuple[float, ...]  # the steady cells' slow mean over fast mean
    cells: tuple[str, ...]  # the cell of each ratio, as a finding names it
    noisy: int  # measured cells left out
    unmeasured: int = 0  # cells left out where a mean time is not a finite number above zero

    @classmethod
    def of(cls, pairs: Iterable[tuple[Row, Row, str]], prefix: str = "") -> SpeedUps:
        """From (slow row, fast row, cell name) triples whose rows hold `<prefix>mean_ms` and `<prefix>std_ms`."""
        pairs = list(pairs)
        measured = [(slow, fast, cell) for slow, fast, cell in pairs if _times_measured(slow, fast, prefix=prefix)]
        steady = [(slow[f"{prefix}mean_ms"] / fast[f"{prefix}mean_ms"], cell) for slow, fast, cell in measured
                  if not _times_noisy(slow, fast, prefix=prefix)]
        return cls(tuple(r for r, _ in steady), tuple(c for _, c in steady), len(measured) - len(steady),
                   len(pairs) - len(measured))

    @property
    def median(self) -> float:
        return statistics.median(self.ratios)

    def range_text(self, with_cells: bool = False) -> str:
        """ "0.54x to 1.64x", with each end's cell where asked: "0.54x (d=32, N=1024) to 1.64x (d=16, N=8192)"."""
        if not with_cells or len(set(self.ratios)) == 1:
            return span(self.ratios, format_ratio)
        (low, low_cell), (high, high_cell) = min(zip(self.ratios, self.cells)), max(zip(self.ratios, self.cells))
        return f"{format_ratio(low)} ({low_cell}) to {format_ratio(high)} ({high_cell})"

    def details(self) -> str:
        """ "median 1.33x; 4 noisy cells left out", the parts that apply ("" for one steady cell and none left out)."""
        median = f"median {format_ratio(self.median)}" if len(self.ratios) > 1 else ""
        left_out = [plural(count, f"{kind} cell") for count, kind in ((self.noisy, "noisy"),
                                                                      (self.unmeasured, "unmeasured")) if count]
        return "; ".join(filter(None, (median, f"{listing(left_out)} left out" if left_out else "")))

    def summary(self) -> str:
        """ "1.04x to 2.30x (median 1.33x; 4 noisy cells left out)", "noisy in every cell", "no steady cell (...)"
        where some were not measured either, or "" for no cell."""
        if not self.ratios:
            if self.unmeasured:
                return f"no steady cell ({self.details()})"
            return "noisy in every cell" if self.noisy else ""
        details = self.details()
        return self.range_text() + (f" ({details})" if details else "")


def markdown_table(rows: Sequence[Row], columns: Sequence[str] | None = None) -> str:
    """A GitHub Markdown table of `rows`; columns default to every key, in first-seen order."""
    if not rows:
        return "_no rows_\n"
    columns = list(columns) if columns is not None else all_columns(rows)
    body = [[format_value(row.get(c)) for c in columns] for row in rows]
    return tabulate(body, headers=columns, tablefmt="github", disable_numparse=True) + "\n"


def all_columns(rows: Iterable[Row]) -> list[str]:
    columns: dict[str, None] = {}
    for row in rows:
        columns.update(dict.fromkeys(row))
    return list(columns)


def select(rows: Iterable[Row], **equal: Any) -> list[Row]:
    return [row for row in rows if all(row.get(k) == v for k, v in equal.items())]


def find(rows: Iterable[Row], **equal: Any) -> Row | None:
    """The first row that `select` would return, or None."""
    found = select(rows, **equal)
    return found[0] if found else None


REPORTS_DIR_NAME = "reports"


def default_reports_root() -> Path:
    """Where reports go unless a command names a directory: `reports/` in the repository's root (the folder
    that holds this package and pyproject.toml), from whatever folder the command runs in. A copy of the
    package installed without its repository has no such root; it writes `reports/` in the current folder."""
    repository = PACKAGE_ROOT.parent
    return (repository if (repository / "pyproject.toml").is_file() else Path.cwd()) / REPORTS_DIR_NAME


# A table's comparison cell where both halves ran, but in different runs: no ratio is read from it.
UNPAIRED = "none: different runs"


def runs_text(rows: Iterable[Row]) -> str:
    """ "run 2", "runs 1 and 4": the runs that measured `rows`."""
    runs = sorted({run_of(row) for row in rows})
    return ("run " if len(runs) == 1 else "runs ") + listing([str(run) for run in runs])


def earlier_code_runs(metadata: Metadata) -> list[tuple[int, RunRecord]]:
    """(number, run) of each of the report's runs that measured earlier code than its perf modules run now."""
    from cs336_systems.reports.problems import measured_code

    current = measured_code(metadata.problem)
    return [(number, run) for number, run in enumerate(metadata.runs, 1) if run.on_earlier_code(current)]


def earlier_code_text(runs: Sequence[tuple[int, RunRecord]]) -> str:
    """ "run 1 (2026-11-26 18:25 UTC)", "runs 1 (...) and 3 (..., code not known)": runs on earlier code, dated."""
    described = [f"{number} ({run.date}{'' if run.measured_code else ', code not known'})" for number, run in runs]
    return ("run " if len(runs) == 1 else "runs ") + listing(described)


CPU_NOTE = ("- note: a CPU run. Triton kernels ran in the Triton interpreter, which emulates the GPU program "
            "on the host, and every time here is a CPU time: these numbers show that the code runs, not how fast "
            "a GPU runs it.")


def measured_sizes(rows: Iterable[Row]) -> dict[str, list[str]]:
    """Size table -> the model sizes the rows measured, smallest first (of the rows that name their size table: a
    benchmark of the user's own may use `size` otherwise); the newest table first."""
    from cs336_systems.model import size_order

    used: dict[str, set[str]] = {}
    for row in rows:
        if row.get("size") and row.get("size_table"):
            used.setdefault(row["size_table"], set()).add(row["size"])
    return {table: sorted(sizes, key=size_order) for table, sizes in sorted(used.items(), reverse=True)}


def model_size_lines(rows: Iterable[Row]) -> list[str]:
    """"- model sizes: ..." lines naming the size table, shape and parameter count of each model size the rows
    measured."""
    from cs336_systems.accounting.activations import parameter_count
    from cs336_systems.model import ModelConfig, model_sizes

    lines = []
    for table, sizes in measured_sizes(rows).items():
        shapes = model_sizes(table)
        described = []
        for size in sizes:
            if size not in shapes:
                described.append(size)
                continue
            # The parameter count does not depend on the context length.
            count = parameter_count(ModelConfig.for_size(size, context_length=1, table=table))
            described.append(f"{size} {'/'.join(str(v) for v in shapes[size].values())} ({count / 1e6:,.0f}M)")
        lines.append(f"- model sizes: the {table} size table, {', '.join(described)} "
                     "(d_model/d_ff/layers/heads, parameters)")
    return lines


def timing_lines(rows: Iterable[Row]) -> list[str]:
    """"- timing: ...": how the rows' times were taken (their `timer`)."""
    timers = dict.fromkeys(str(r["timer"]) for r in rows if r.get("timer"))
    return ["- timing: " + "; ".join(timers)] if timers else []


def implementation_lines(rows: Iterable[Row]) -> list[str]:
    """"- implementation under test: ..." for each implementation under test (an adapters module, --adapters) whose
    rows stand beside the references', with its source hash (cs336_systems.provenance.implementation_columns)."""
    named = dict.fromkeys((str(r["implementation"]), r.get("implementation_source")) for r in rows
                          if r.get("implementation"))
    return [f"- implementation under test: {label}" + (f" (source {source})" if source else "")
            for label, source in named]


def software_line(runs: Sequence[RunRecord]) -> str:
    """The software the runs measured with: one list, or one per run where they differ."""
    described = {i: run.software_text for i, run in enumerate(runs, 1)}
    if len(set(described.values())) == 1:
        return f"- software: {described[1]}"
    return "- software: " + "; ".join(f"run {i}: {text}" for i, text in described.items())


def run_line(number: int, run: RunRecord, earlier_code: bool) -> str:
    """The run's date, command, package source and measured code, marked where that code is earlier code."""
    source = f"source {run.source_hash}, " if run.source_hash else ""
    code = (f"measured code {run.measured_code}{', earlier code' if earlier_code else ''}" if run.measured_code
            else "measured code not known")
    return f"- run {number}: {run.date}, `{run.command}` ({source}{code})"


def header(metadata: Metadata, rows: Iterable[Row] = ()) -> str:
    """The report's title and provenance, from its metadata; the model-size lines from its rows."""
    lines = [f"# {metadata.problem}", "", f"- device: {metadata.device}", software_line(metadata.runs)]
    lines += model_size_lines(rows) + timing_lines(rows) + implementation_lines(rows)
    earlier = earlier_code_runs(metadata)
    earlier_numbers = {number for number, _ in earlier}
    lines += [run_line(i, run, i in earlier_numbers) for i, run in enumerate(metadata.runs, 1)]
    if earlier:
        its = "its" if len(earlier) == 1 else "their"
        lines.append(f"- measured on earlier code: {earlier_code_text(earlier)}: the code on {its} measured path has "
                     f"changed since, and {its} rows are that code's numbers")
    if not metadata.on_gpu:
        lines.append(CPU_NOTE)
    return "\n".join(lines) + "\n"


def write_report(report: Report, rows: list[Row], report_dir: Path | str, command: str,
                 device: torch.device | str | None = None) -> Path:
    """Render `rows` with the report's renderer and write its .md, .csv, .meta.json and figures.

    For a report with a key, rows of earlier runs on the same device that this run did not measure
    again are kept (see `Report`). A row's samples are not written (cs336_systems.rows.without_samples).
    """
    from cs336_systems.reports.problems import measured_code

    report_dir = Path(report_dir)
    problem, key = report.name, report.key
    rows = [without_samples(row) for row in rows]
    run = this_run(command, measured_code(problem))
    metadata = Metadata(problem, device_description(device), on_cuda(device), (run,))
    csv_path, sidecar = report_dir / f"{problem}.csv", metadata_path(report_dir, problem)
    if key:
        kept: list[Row] = []
        earlier = Metadata.read(sidecar) if csv_path.exists() and sidecar.exists() else None
        if earlier is not None and earlier.device == metadata.device:
            measured = {report.cell(r) for r in rows}
            kept = [r for r in read_rows(csv_path) if report.cell(r) not in measured]
        rows, runs = merge_runs(kept, earlier.runs if kept else (), rows, metadata.runs[0])
        metadata = replace(metadata, runs=runs)
        # In the column order reading the CSV gives (every record in its file's order of columns), so that
        # the next run writes this run's lines as they are now: a later run's diff is its own rows.
        rows = from_long(to_long(rows))
    # Everything that can fail (rendering, the device query) happens before a file is written, so a
    # failure leaves no report directory, CSV without Markdown, or half a file behind.
    head = header(metadata, rows)
    rendered = report.render(rows)
    report_dir.mkdir(parents=True, exist_ok=True)
    if rows:
        write_csv(csv_path, rows)
    metadata.write(sidecar)
    return _write_rendered(problem, rendered, report_dir, head)


# The command that writes the closed-form reports: communication_accounting and the 2026 parallelism problems.
ANALYSIS_COMMAND = "python -m cs336_systems analysis"


def _closed_form_header(problem: str, command: str, sources: str) -> str:
    """The header of a report computed in closed form: no device, versions or date, so writing it
    again from the same code gives the same bytes."""
    return "\n".join([
        f"# {problem}", "",
        f"- device: none; computed in closed form by {sources}, nothing is measured",
        f"- command: `{command}`",
        "- units: bytes; GB = 10^9 bytes, GiB = 2^30 bytes, MB = 10^6 bytes; FLOP/s; batches in tokens", "",
    ])


def write_closed_form(report: Report, rows: list[Row], report_dir: Path | str, command: str, sources: str) -> Path:
    """Write a closed-form report's .md, .csv and figures (no metadata: nothing was measured, and the
    files depend only on the code, `sources` naming the modules that compute it); returns the .md path."""
    report_dir = Path(report_dir)
    rendered = report.render(rows)
    report_dir.mkdir(parents=True, exist_ok=True)
    write_csv(report_dir / f"{report.name}.csv", rows)
    return _write_rendered(report.name, rendered, report_dir, _closed_form_header(report.name, command, sources))


def shown_figures(markdown_path: Path) -> list[Path]:
    """The PNG files beside a report's Markdown that it shows (`![...](name.png)`), in order, each once, the
    ones present."""
    names = dict.fromkeys(re.findall(r"!\[[^\]]*\]\(([^)\s]+\.png)\)", markdown_path.read_text()))
    return [markdown_path.parent / name for name in names if (markdown_path.parent / name).is_file()]


def _write_rendered(problem: str, rendered: Rendered, report_dir: Path, head: str) -> Path:
    import matplotlib.pyplot as plt

    for file_name, figure in rendered.figures.items():
        partial = staging_path(report_dir / file_name)
        # No software metadata: a figure's bytes depend only on what it draws.
        figure.savefig(partial, dpi=120, bbox_inches="tight", metadata={"Software": None})
        os.replace(partial, report_dir / file_name)
        plt.close(figure)
    path = report_dir / f"{problem}.md"
    replace_text(path, head + "\n" + rendered.body.rstrip() + "\n")
    return path


def rerender(report_dir: Path | str, report: Report) -> Path:
    """Re-render a report's Markdown and figures from its CSV and metadata: the measurements, device,
    dates, commands and versions stay those of the runs that made them."""
    report_dir = Path(report_dir)
    rows = read_rows(report_dir / f"{report.name}.csv")
    head = header(Metadata.read(metadata_path(report_dir, report.name)), rows)
    return _write_rendered(report.name, report.render(rows), report_dir, head)
