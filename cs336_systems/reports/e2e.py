"""The answers of the end-to-end model benchmarks' reports: benchmarking_script (time per phase by size and
context, the warm-up study), benchmarking_mixed_precision (autocast dtypes, normalisation statistics in low
precision, fp32 against bf16) and the whole-model part of torch_compile (eager against compiled, and against a
torch-native reference): their text parts, the cells their tables show, and the answers. Their tables are declared
in cs336_systems.reports.problems, all but fp32 against bf16, whose lines, with columns for each other variant the
sweep ran, are built here (precision_comparison). The package's benchmarks/e2e.py measures them.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from cs336_systems import reports
from cs336_systems.model import size_order
from cs336_systems.reports import (
    NOISY_RELATIVE_STD,
    UNPAIRED,
    Reports,
    SpeedUps,
    find,
    format_bytes,
    format_ms,
    format_ratio,
    format_share,
    is_noisy,
    listing,
    noisy_marked,
    not_in_report,
    oom_note,
    plural,
    runs_text,
    select,
    span,
    speedup_text,
)
from cs336_systems.rows import (
    BREAKDOWN_TABLE,
    COURSE_VARIANT,
    E2E_KEY,
    FAST_VARIANT,
    MIXED_PRECISION_KEY,
    OOM,
    REFERENCE_MODEL,
    REFERENCE_MODEL_SOURCE,
    STEP_PHASES,
    Row,
    ok_rows,
)
from cs336_systems.rows.e2e import CellCost
from cs336_systems.runs import run_of, same_run


VARIANT_LABELS = {COURSE_VARIANT: "the course's model (naive attention, its AdamW)", FAST_VARIANT: "SDPA + fused AdamW"}
PHASE_LABELS = {"forward": "forward", "backward": "backward", "optimizer": "optimizer",
                "forward_backward": "forward+backward", "train_step": "train step"}
# A cell whose std is under this share of its mean is called steady.
STEADY_RELATIVE_STD = 0.05


def mean_std(row: Row, unit: str = "") -> str:
    """A cell's time, or OOM; a forward measured on its own (no autograd) where training did not fit says so."""
    if row.get("status") == OOM:
        return reports.oom_text(row)
    alone = " (forward only)" if row.get("measured_mode") == "forward" else ""
    return reports.mean_std(row["mean_ms"], row["std_ms"], unit=unit) + alone


# What the command (python -m cs336_systems e2e) says about a cell, before it runs and after. Each mode as its
# messages name it, largest first, and a smaller mode as it stands in for a larger one that did not fit.
MODE_LABELS = {"train": "the train step", "forward_backward": "forward+backward", "forward": "the forward"}
STAND_IN_LABELS = {"forward_backward": "forward+backward without the optimizer step",
                   "forward": "the forward alone (no autograd)"}
# A cell whose steps the FLOP model expects to take this long or longer on the device is announced, with the
# estimate, before it starts: long enough that a command silent for it would seem to hang, and that a user may
# rather stop it and ask for a smaller cell.
LONG_CELL_S = 60.0


def command_status(row: Row) -> str:
    """A row's status as the command's table shows it: OOM, predicted and not run or run out; ok, naming the smaller
    mode that measured it where its own did not fit; and marked noisy where its time varied more than the reports
    allow (reports.is_noisy)."""
    if row.get("status") == OOM:
        return reports.oom_text(row)
    text = str(row.get("status"))
    measured_mode = row.get("measured_mode")
    if measured_mode not in (None, row.get("mode")):
        text += f" ({PHASE_LABELS[measured_mode]} only)"
    return noisy_marked(text, "mean_ms" in row and is_noisy(row["mean_ms"], row["std_ms"]))


def _modes_out_of_memory(rows: list[Row]) -> str:
    """Each mode of a cell's OOM rows, largest first, with what became of it and the memory model's estimate."""
    by_mode: dict[str, Row] = {}
    for row in rows:
        if row.get("status") == OOM:
            by_mode.setdefault(row.get("measured_mode") or row["mode"], row)
    return "; ".join(f"{MODE_LABELS[mode]}: {oom_note(by_mode[mode])}" for mode in MODE_LABELS if mode in by_mode)


def stand_in_note(did_not_fit: list[Row], measured_mode: str) -> str:
    """What the command says before it measures `measured_mode` in place of the larger modes that did not fit (their
    OOM rows)."""
    larger = {row.get("measured_mode") or row["mode"] for row in did_not_fit}
    return (f"{_modes_out_of_memory(did_not_fit)}; so {STAND_IN_LABELS[measured_mode]} is measured in "
            f"{'its' if len(larger) == 1 else 'their'} place")


def nothing_measured_note(rows: list[Row]) -> str | None:
    """What the command says after a cell (one model's rows) of which no mode could be measured; None where one
    was."""
    if ok_rows(rows):
        return None
    return f"{_modes_out_of_memory(rows)}; so nothing was measured"


def _duration(seconds: float) -> str:
    minutes = round(seconds / 60)
    return plural(minutes, "minute") if minutes < 90 else f"{seconds / 3600:.1f} hours"


def long_cell_note(cost: CellCost, mode: str) -> str | None:
    """What the command says before a cell whose steps it expects to take LONG_CELL_S or more: how long, and the
    estimate's parts; None for a shorter one."""
    if cost.expected_s < LONG_CELL_S:
        return None
    steps = [f"{cost.warmup} warm-up", f"{cost.timed} timed"] + ([f"{cost.profiled} profiled"] if cost.profiled else [])
    return (f"{MODE_LABELS[mode]} is expected to take about {_duration(cost.expected_s)} here: "
            f"{plural(cost.steps, 'step')} ({' + '.join(steps)}) of {cost.step_flops / 1e12:.3g} TFLOP of matmuls "
            f"each, at the {cost.flops_per_s / 1e9:.3g} GFLOP/s a matmul of the model's feed-forward shape ran at on "
            "this device just now; building the model and the work besides matmuls come on top")


def variant(row: Row) -> tuple:
    """(attention, AdamW) of a row."""
    return row.get("attention"), row.get("optimizer")


def latest_cells(rows: list[Row], key: Sequence[str]) -> list[Row]:
    """`rows`, in their order, with one row per cell (its values of `key`): where runs measured a cell more than
    once, the latest run's row, as a report's merge keeps it."""
    latest: dict[tuple, Row] = {}
    for row in rows:
        cell = tuple(row.get(column) for column in key)
        if cell not in latest or run_of(row) >= run_of(latest[cell]):
            latest[cell] = row
    kept = {id(row) for row in latest.values()}
    return [row for row in rows if id(row) in kept]


def split_variants(rows: list[Row]) -> tuple[tuple, list[Row], dict[tuple, list[Row]]]:
    """(the variant the report answers from, its rows, the other variants' rows): the course's model where
    the rows have it."""
    variants = list(dict.fromkeys(variant(r) for r in rows))
    main = COURSE_VARIANT if COURSE_VARIANT in variants or not variants else variants[0]
    others = {v: [r for r in rows if variant(r) == v] for v in variants if v != main}
    return main, [r for r in rows if variant(r) == main], others


def variant_label(v: tuple) -> str:
    return VARIANT_LABELS.get(v, f"{v[0]} attention, {v[1]} AdamW")


def phase_index(row: Row) -> int:
    return list(PHASE_LABELS).index(row["phase"])


def _cell_order(row: Row) -> tuple:
    return size_order(row["size"]), row["context_length"], str(row.get("precision")), phase_index(row)


def phase_order(row: Row) -> tuple:
    """A sweep table's order: by size, phase, then context."""
    return size_order(row["size"]), phase_index(row), row["context_length"]


def _sweep_setup(rows: list[Row], extra: dict[tuple, list[Row]] | None = None) -> str:
    sample = rows[0]
    extras = f"; extra columns: {', '.join(variant_label(v) for v in extra)}" if extra else ""
    return (f"batch {sample['batch_size']}, {variant_label(variant(sample))}, random tokens, {sample['warmup']} "
            f"warm-up + {sample['steps']} timed steps per cell{extras}; times in ms, mean ± std")


def sweep_setup(sweep: list[Row]) -> str:
    _, sweep, extra = split_variants(sweep)
    return (f"## Time per phase by model size and context\n\n{_sweep_setup(sweep, extra)}; fp32, eager. Forward "
            "is timed inside training steps (autograd recording).\n")


def variant_columns(rows: list[Row]) -> list[Row]:
    """A sweep's rows as its table shows them: the main variant's (split_variants), then each other variant's whose
    size and phase the main one has, marked with the label its columns take (`variant_column`); phases by label."""
    _, main, others = split_variants(rows)
    lines = {(r["size"], r["phase"]) for r in main}
    extra = [{**r, "variant_column": variant_column_label(v)} for v, other in others.items() for r in other
             if (r["size"], r["phase"]) in lines]
    return [{**r, "phase": PHASE_LABELS[r["phase"]]} for r in main + extra]


def context_heading(row: Row) -> str:
    """A sweep table's column: the row's context, after its variant's label where it is not the main variant."""
    variant = f"{row['variant_column']}, " if row.get("variant_column") else ""
    return f"{variant}context {row['context_length']}"


# Each variant as a table's column heads it.
VARIANT_COLUMN_LABELS = {COURSE_VARIANT: "course model", FAST_VARIANT: "SDPA + fused"}


def variant_column_label(v: tuple) -> str:
    return VARIANT_COLUMN_LABELS.get(v, variant_label(v))


@dataclass(frozen=True)
class StepVariation:
    """How much the measured cells' times varied between steps: what the report's variation line and the
    index's answer both quote."""
    cells: int
    median_share: float  # the median over cells of std / mean
    worst: Row  # the cell whose std is the largest share of its mean
    steady: int  # cells under STEADY_RELATIVE_STD
    noisy: int  # cells over NOISY_RELATIVE_STD, marked noisy in the tables

    @property
    def worst_share(self) -> float:
        return self.worst["std_ms"] / self.worst["mean_ms"]


def step_variation(rows: list[Row]) -> StepVariation | None:
    """The variation of the cells that ran, or None where none did."""
    measured = [r for r in ok_rows(rows) if r["mean_ms"] > 0]
    if not measured:
        return None
    shares = [r["std_ms"] / r["mean_ms"] for r in measured]
    return StepVariation(len(measured), statistics.median(shares),
                         max(measured, key=lambda r: r["std_ms"] / r["mean_ms"]),
                         sum(share < STEADY_RELATIVE_STD for share in shares),
                         sum(is_noisy(r["mean_ms"], r["std_ms"]) for r in measured))


def variation_summary(sweep: list[Row]) -> str:
    _, rows, _ = split_variants(sweep)
    variation = step_variation(rows)
    if variation is None:
        return "No cell ran: every configuration ran out of memory."
    worst = variation.worst
    step = find(rows, **{k: worst.get(k) for k in ("size", "context_length", "precision", "compile")},
                phase="train_step")
    clock = f"; GPU clock {clock_note(step)}" if step and "sm_clock_mhz" in step else ""
    text = (f"Variation between steps: median std {variation.median_share:.1%} of the mean; {variation.steady} of "
            f"{plural(variation.cells, 'cell')} under {STEADY_RELATIVE_STD:.0%}; most variable: {worst['size']} at "
            f"context {worst['context_length']} ({PHASE_LABELS[worst['phase']]}: "
            f"{variation.worst_share:.1%} of {worst['mean_ms']:.1f} ms{clock}).")
    if any(r.get("status") == OOM for r in rows):
        text += " Out of memory: " + _oom_listing(rows) + "."
    return text + "\n"


def _oom_listing(rows: list[Row]) -> str:
    """The cells that did not fit, per size and precision: their contexts, the memory model's estimate of
    the step, whether they were run (cs336_systems.memory_guard says where a cell is not), and which smaller
    mode ran in their place, if one did."""
    groups: dict[tuple, list[Row]] = {}
    for r in sorted((r for r in rows if r.get("status") == OOM), key=_cell_order):
        groups.setdefault((r["size"], r.get("precision")), []).append(r)
    listed = []
    for (size, precision), ooms in groups.items():
        contexts = sorted({r["context_length"] for r in ooms})
        # A cell's largest estimate is that of its whole step.
        estimates = [max(r.get("estimated_peak_bytes") or 0 for r in ooms if r["context_length"] == n) for n in contexts]
        notes = [f"estimate {span([e / 2**30 for e in estimates], '{:,.1f}'.format)} GiB"] if all(estimates) else []
        if all(r.get("oom_predicted") for r in ooms):
            notes.append("not run")
        smaller = {r.get("measured_mode") for r in rows if r.get("status") == "ok" and r["size"] == size
                   and r.get("precision") == precision and r["context_length"] in contexts}
        if "forward_backward" in smaller:
            notes.append("forward and backward ran without the optimizer")
        elif "forward" in smaller:
            notes.append("the forward alone ran")
        listed.append(f"{size} at context{'s' if len(contexts) > 1 else ''} {listing([str(n) for n in contexts])}"
                      + (f" in {precision}" if precision else "") + (f" ({'; '.join(notes)})" if notes else ""))
    return ", ".join(listed)


def _first_step_ratio(row: Row) -> float:
    """The first timed step's time over the median step's: what a run without warm-up pays once."""
    return row["first_ms"] / row["median_ms"]


def _one_time_costs(device_type: str) -> str:
    if device_type == "cuda":
        costs = ("cuBLAS/cuDNN handles and workspaces, loading each kernel's module on first use (CUDA lazy "
                 "loading), the caching allocator requesting driver memory, and AdamW creating its state")
    else:
        costs = ("the allocator obtaining memory from the OS, oneDNN/BLAS setting up kernels and thread pools, "
                 "and AdamW creating its state")
    return f"A first step pays one-time costs: {costs}."


def warmup_study_setup(study: list[Row]) -> str:
    return (f"## Warm-up study\n\nOne fresh process per cell: {_warmup_setup(study)}, "
            f"context {study[0]['context_length']}, {study[0]['steps']} timed training steps after "
            f"{', '.join(str(w) for w in sorted({r['warmup'] for r in study}))} warm-up steps.\n")


def is_warmup_part(row: Row) -> bool:
    """A row of the warm-up study's table: a part of the step (forward, backward, optimizer)."""
    return row.get("table") == "warmup" and row["phase"] in ("forward", "backward", "optimizer")


def warmup_order(row: Row) -> tuple:
    return size_order(row["size"]), row["warmup"], phase_index(row)


def warmup_findings(study: list[Row]) -> str:
    ok = ok_rows(study)
    findings = []
    for size in sorted({r["size"] for r in ok}, key=size_order):
        steps = {r["warmup"]: r for r in ok if r["size"] == size and r["phase"] == "train_step"}
        if 0 not in steps or len(steps) < 2:
            continue
        cold, most = steps[0], steps[max(steps)]
        findings.append(f"- {size}: without warm-up the first training step takes {cold['first_ms']:.1f} ms "
                        f"({format_ratio(_first_step_ratio(cold))} the median); mean {mean_std(cold, 'ms')} "
                        f"against {mean_std(most, 'ms')} after {plural(max(steps), 'warm-up step')}.")
    if not findings:
        return ""
    return "\n".join(findings) + "\n\n" + _one_time_costs(study[0].get("device", "cpu")) + "\n"


def _warmup_setup(rows: list[Row]) -> str:
    """The model variant, precision and batch the warm-up study ran, which need not be the sweep's."""
    variants = listing(list(dict.fromkeys(variant_label(variant(r)) for r in rows)))
    precisions = listing(list(dict.fromkeys(str(r.get("precision")) for r in rows)))
    batch_sizes = listing(list(dict.fromkeys(str(r["batch_size"]) for r in rows)))
    return f"{variants}, {precisions}, batch {batch_sizes}"


def _index_keys(key: str) -> list[str]:
    """The columns that name a cell of a comparison over `key`."""
    return [k for k in ("size", "context_length", "precision", "phase") if k != key]


def _paired_cells(rows: list[Row], key: str, base_value, other_value) -> dict[tuple, tuple[Row | None, Row | None]]:
    """(size, context, precision, phase), less `key` -> the rows of that cell with `key` at each of two values."""
    index_keys = _index_keys(key)
    cells: dict[tuple, dict] = {}
    for r in sorted(rows, key=_cell_order):
        cells.setdefault(tuple(r[k] for k in index_keys), {})[r[key]] = r
    return {index: (pair.get(base_value), pair.get(other_value)) for index, pair in cells.items()}


def _both_ran(base: Row | None, other: Row | None) -> bool:
    return bool(base and other) and base.get("status") == other.get("status") == "ok"


def _paired(base: Row | None, other: Row | None) -> bool:
    """Whether a cell's two rows are compared: both ran, in one run."""
    return _both_ran(base, other) and same_run(base, other)


def _unpaired_note(variants: Iterable[list[Row]], key: str, base_value, other_value) -> str:
    """A sentence on the cells, of each variant's rows, whose two halves ran in different runs, which no speed-up
    compares ("" for none)."""
    unpaired = sum(_both_ran(base, other) and not same_run(base, other) for rows in variants
                   for base, other in _paired_cells(rows, key, base_value, other_value).values())
    if not unpaired:
        return ""
    return (f" {plural(unpaired, 'cell')} ran both ways but in different runs, so no speed-up is read from "
            f"{'it' if unpaired == 1 else 'them'}; `pytest perf/test_e2e.py -m e2e` measures both in one run.")


def _forward_alone(row: Row) -> bool:
    """Whether a row is a forward measured on its own (no autograd) where a training step did not fit."""
    return row.get("measured_mode") == "forward"


def phase_speedups(rows: list[Row], key: str, base_value, other_value, phase: str,
                   forward_alone: bool = False) -> SpeedUps:
    """How much faster the rows with `key` = `other_value` ran than those with `base_value`, in one phase, over
    the cells where both ran in one run, timed the same way: within training steps, or with `forward_alone` the
    forwards measured on their own. The report's summary and the index's answer read this one computation."""
    return SpeedUps.of((base, other, "") for base, other in _paired_cells(rows, key, base_value, other_value).values()
                       if _paired(base, other) and base["phase"] == phase
                       and _forward_alone(base) == _forward_alone(other) == forward_alone)


def _speedup_summary(rows: list[Row], key: str, base_value, other_value) -> str:
    """ "forward: 1.04x to 2.40x (median 1.44x; 4 noisy cells left out); backward: ...": the phases that ran, and
    apart from them the forwards measured alone."""
    phases = [(PHASE_LABELS[phase], phase_speedups(rows, key, base_value, other_value, phase).summary())
              for phase in ("forward", "backward", "train_step")]
    phases.append(("forward only (no autograd, where training did not fit)",
                   phase_speedups(rows, key, base_value, other_value, "forward", forward_alone=True).summary()))
    return "; ".join(f"{label}: {summary}" for label, summary in phases if summary)


def comparison_lines(rows: list[Row], key: str, base_value, other_value) -> list[Row]:
    """One line per cell (size, context, precision, phase, less `key`): its values of those columns, and under "base"
    and "other" its rows with `key` at each value (None where not measured)."""
    return [{**dict(zip(_index_keys(key), index)), "base": base, "other": other}
            for index, (base, other) in _paired_cells(rows, key, base_value, other_value).items()]


def phase_cell(line: Row) -> str:
    return PHASE_LABELS[line["phase"]]


def time_cell(way: str) -> Callable[[Row], str]:
    """A line's time of `way` (its row under that name), as `mean_std` shows it; "" where not measured."""
    return lambda line: mean_std(line[way]) if line[way] else ""


def speedup_cell(line: Row) -> str:
    """A comparison line's speed-up of "other" over "base", where one run timed both."""
    base, other = line["base"], line["other"]
    return speedup_text(base, other) if _paired(base, other) else UNPAIRED if _both_ran(base, other) else ""


def mfu_cell(way: str) -> Callable[[Row], str | None]:
    """A comparison line's MFU of `way`; None where its row has none (an optimizer step has no FLOP count)."""
    def cell(line: Row) -> str | None:
        row = line[way]
        return f"{row['mfu']:.1%}" if row and row.get("mfu") is not None else None
    return cell


def _comparison_table(rows: list[Row], key: str, base_value, other_value, base_label: str, other_label: str) -> list[Row]:
    """One row per cell (size, context, precision, phase minus `key`): both variants' times and their ratio."""
    table = []
    for line in comparison_lines(rows, key, base_value, other_value):
        entry = {k: line[k] for k in _index_keys(key)}
        entry["phase"] = phase_cell(line)
        entry[f"{base_label} (ms)"] = time_cell("base")(line)
        entry[f"{other_label} (ms)"] = time_cell("other")(line)
        entry["speed-up"] = speedup_cell(line)
        for label, way in ((base_label, "base"), (other_label, "other")):
            mfu = mfu_cell(way)(line)
            if mfu is not None:
                entry[f"{label} MFU"] = mfu
        table.append(entry)
    return table


def autocast_setup(dtypes: list[Row]) -> str:
    autocast_dtype = dtypes[0]["autocast"]
    note = "" if autocast_dtype == "float16" else " (this device's autocast does not support fp16)"
    return (f"## (a) dtypes inside a toy-model step under autocast\n\nObserved with forward hooks on "
            f"{dtypes[0]['device']}, autocast dtype {autocast_dtype}{note}.\n")


def autocast_findings(dtypes: list[Row]) -> str:
    observed = {r["tensor"]: r["dtype"] for r in dtypes}
    autocast_dtype = dtypes[0]["autocast"]
    low = [t for t, d in observed.items() if d == autocast_dtype]
    full = [t for t, d in observed.items() if d == "float32"]
    return (f"In {autocast_dtype}: {', '.join(low) or 'nothing'}. In float32: {', '.join(full) or 'nothing'}. "
            "Autocast leaves parameters (and so their gradients) in fp32 and casts copies of the weights for each "
            "matmul, whose outputs come out in the low-precision dtype; ops on its fp32 list (the loss, and on CUDA "
            "layer norm) run in fp32. Which ops are on that list differs by device: compare the layer norm row "
            "across devices.\n")


NORMALISATION_SETUP = ("## (b) normalisation statistics in low precision\n\nMean of squares of a 1024-wide row of "
                       "magnitude ~300, against a float64 reference:\n")


def normalisation_findings(rows: list[Row]) -> str:
    norms = {r["storage_dtype"]: r for r in rows}
    fp16, bf16 = norms.get("float16"), norms.get("bfloat16")
    if not (fp16 and bf16):
        return ""
    return (f"In fp16 the result is {fp16['mean_square']} (largest finite fp16 value: 65504; 300² is 9e4): a layer "
            f"norm or RMSNorm whose statistics are computed in fp16 overflows. bf16 keeps fp32's exponent range, so it "
            f"does not overflow, but with 8 mantissa bits its mean is off by {bf16['relative_error']:.2%}. So under "
            "fp16 the norms must run in fp32; under bf16 they can run without overflow, though accumulating the "
            "statistics in fp32 (as our RMSNorm does) is still more accurate.\n")


def precision_setup(sweep: list[Row]) -> str:
    _, timings, extra = split_variants(sweep)
    return (f"## (c) fp32 against bf16 autocast\n\n{_sweep_setup(timings, extra)}; eager. Speed-up is the ratio of "
            "means; MFU is against the device's dense peak for the precision (fp32 peak for fp32 cells, bf16 "
            "tensor-core peak for bf16 cells).\n")


def precision_comparison(rows: list[Row]) -> list[Row]:
    """The fp32 against bf16 table's lines, of a sweep's rows: the main variant's cells, with each other variant's
    times and speed-up as extra columns, matched by size, context and phase."""
    def lines(variant_rows: list[Row]) -> list[Row]:
        return _comparison_table(variant_rows, "precision", "fp32", "bf16", "fp32", "bf16")

    def cell(line: Row) -> tuple:
        return line["size"], line["context_length"], line["phase"]

    _, timings, extra = split_variants(rows)
    table = lines(timings)
    for v, other in extra.items():
        by_cell = {cell(line): line for line in lines(other)}
        for line in table:
            match = by_cell.get(cell(line), {})
            line.update({f"{variant_column_label(v)}: {column}": match.get(column, "")
                         for column in ("fp32 (ms)", "bf16 (ms)", "speed-up")})
    return table


def precision_speedups(sweep: list[Row]) -> str:
    _, timings, extra = split_variants(sweep)
    summary = _speedup_summary(timings, "precision", "fp32", "bf16")
    return ((f"bf16 speed-up over fp32 by phase: {summary}." if summary else "")
            + _unpaired_note([timings, *extra.values()], "precision", "fp32", "bf16") + "\n")


def compiled_models_setup(sweep: list[Row]) -> str:
    return (f"## Whole model: eager against torch.compile\n\n{_sweep_setup(sweep)}. Compiled cells compile each "
            "Transformer block (regional compilation); embedding, final norm, LM head and AdamW run eagerly. The "
            "compiling first warm-up step is not timed.\n")


def compiled_speedups(sweep: list[Row]) -> str:
    """Compiled over eager by phase, how long the compiling first step took, and the cells no speed-up compares."""
    summary = _speedup_summary(sweep, "compile", False, True)
    compiled_first = [r for r in ok_rows(sweep) if r["compile"] and r["phase"] == "forward"]
    compile_note = ""
    if compiled_first:
        slowest = max(compiled_first, key=lambda r: r["first_step_ms"])
        compile_note = (f" The first (compiling) step took up to {slowest['first_step_ms'] / 1e3:.1f} s "
                        f"({slowest['size']}, context {slowest['context_length']}, {slowest['precision']}).")
    return ((f"Compiled over eager by phase: {summary}.{compile_note}" if summary else "")
            + _unpaired_note([sweep], "compile", False, True) + "\n")


# Measures the project's compiled steps and the reference's in one run, which pairs them.
REFERENCE_COMMAND = 'pytest perf/test_e2e.py -k "compiled or reference"'


def reference_setup(rows: list[Row]) -> str:
    """The section setting the compiled training step beside the torch-native reference's of the same cell: what
    the reference is, and whether one run timed both; "" where no cell has both."""
    steps = _reference_steps(rows)
    if not steps:
        return ""
    unpaired = [pair for pair in steps.values() if not same_run(*pair)]
    if not unpaired:
        runs = " in the same run"
    else:
        cells = "every cell" if len(unpaired) == len(steps) else f"{len(unpaired)} of the {len(steps)} cells"
        project_runs, reference_runs = (runs_text(half) for half in zip(*unpaired))
        runs = (f". The two steps of {cells} ran in different runs (project: {project_runs}; reference: "
                f"{reference_runs}), so no ratio is read; `{REFERENCE_COMMAND}` times both in one run")
    ratio = (" Ratio of medians: above 1, the project's model and harness cost that much more."
             if len(unpaired) < len(steps) else "")
    return ("## The compiled step against a torch-native reference\n\n"
            f"The reference is the same architecture in torch's own modules ({REFERENCE_MODEL_SOURCE}), compiled as "
            f"one graph, with the same AdamW, timed the same way{runs}.{ratio}\n")


def reference_lines(rows: list[Row]) -> list[Row]:
    """One line per cell (size, context, precision) of `_reference_steps`: under "project" and "reference" its two
    training steps."""
    return [{"size": size, "context_length": context, "precision": precision, "project": ours, "reference": theirs}
            for (size, context, precision), (ours, theirs) in _reference_steps(rows).items()]


def ratio_cell(line: Row) -> str:
    """A reference line's project median over the reference's, where one run timed both."""
    ours, theirs = line["project"], line["reference"]
    return format_ratio(ours["median_ms"] / theirs["median_ms"]) if same_run(ours, theirs) else UNPAIRED


def host_issue_cell(line: Row) -> str | None:
    """The share of each model's median step the host took to issue it, where both were measured."""
    ours, theirs = line["project"], line["reference"]
    if not (ours.get("host_ms") and theirs.get("host_ms")):
        return None
    return "; ".join(format_share(step["host_ms"] / step["median_ms"]) for step in (ours, theirs))


def clock_cell(line: Row) -> str | None:
    """Each model's GPU clock during its steps (`clock_note`), where both were read."""
    ours, theirs = line["project"], line["reference"]
    if "sm_clock_mhz" not in ours or "sm_clock_mhz" not in theirs:
        return None
    return f"{clock_note(ours)}; {clock_note(theirs)}"


def clock_note(row: Row) -> str:
    """A whole-step row's clock columns in words: `1,755 MHz, power-capped 40%, hot 12%`."""
    note = f"{row['sm_clock_mhz']:,.0f} MHz"
    limits = [f"{name} {format_share(row[column])}" for name, column in
              (("power-capped", "power_capped_share"), ("hot", "thermal_limited_share")) if row[column] >= 0.005]
    return ", ".join([note, *limits])


def _reference_steps(rows: list[Row]) -> dict[tuple, tuple[Row, Row]]:
    """(size, context, precision) -> the project's compiled train step and the reference's, where both ran, in
    whichever runs."""
    def steps(table: str) -> dict[tuple, Row]:
        return {(r["size"], r["context_length"], r["precision"]): r for r in ok_rows(rows)
                if r.get("table") == table and r["compile"] and r["phase"] == "train_step"}

    project, reference = steps("sweep"), steps("reference")
    cells = sorted(set(project) & set(reference), key=lambda cell: (size_order(cell[0]), cell[1], cell[2]))
    return {cell: (project[cell], reference[cell]) for cell in cells}


def _profiled(rows: list[Row]) -> list[Row]:
    """The rows of the steps profiled under torch.profiler, where the reference section shows (they belong to it)."""
    return select(rows, table=BREAKDOWN_TABLE) if _reference_steps(rows) else []


def breakdown_setup(rows: list[Row]) -> str:
    profiled = _profiled(rows)
    if not profiled:
        return ""
    steps = profiled[0].get("profiled_steps")
    return (f"### Where the time goes\n\n{plural(steps, 'more step')} of each model under torch.profiler: per "
            "phase, kernel time per step split into matmuls, fused attention and the rest; per step, its time under "
            "the profiler (which adds host work), GPU busy, and GPU idle (waiting for the host). Kernels can "
            "overlap, so the phases' kernel times may exceed the busy time.\n")


def breakdown_lines(rows: list[Row]) -> list[Row]:
    """The profiled rows as their table shows them: by cell, the project's before the reference's, phases in the
    order a step runs them and the whole step last."""
    return sorted(_profiled(rows), key=lambda r: (size_order(r["size"]), r["context_length"], r["precision"],
                                                 r.get("model") or "", (*STEP_PHASES, "step").index(r["phase"])))


def breakdown_phase_cell(row: Row) -> str:
    """A profiled row's phase; a step that is a smaller mode's, where the cell's own step did not fit, says so."""
    measured_mode = row.get("measured_mode")
    if row["phase"] == "step" and measured_mode not in (None, row.get("mode")):
        return f"step ({PHASE_LABELS[measured_mode]} only)"
    return row["phase"]


def kernel_share_cell(column: str) -> Callable[[Row], str]:
    """A profiled phase's kernel time of one kind (`column`) as a share of all its kernel time."""
    return lambda row: format_share(row[column] / row["work_ms"] if row["work_ms"] else 0.0)


def busy_cell(row: Row) -> str:
    """A profiled step's GPU busy time and its share of the step; "" where not measured."""
    busy = row.get("busy_ms")
    return "" if busy is None else f"{busy:.1f} ({format_share(busy / row['step_ms'])})"


def idle_cell(row: Row) -> str:
    """A profiled step's GPU idle time (waiting for the host); "" where its busy time was not measured."""
    return "" if row.get("busy_ms") is None else f"{row['idle_ms']:.1f}"


# ---------------------------------------------------------------------------------------------- answers

# The training steps the first answer quotes: the two largest sizes measured, at context 512.
HEADLINE_SIZE_COUNT = 2
HEADLINE_CONTEXT = 512


def _mean_std_ms(row: Row) -> str:
    """A time as the answers quote it: thousands separated, where the tables' `mean_std` is not."""
    return reports.mean_std(row["mean_ms"], row["std_ms"], ",.1f", ".1f", unit="ms")


def _e2e_step(rows: list[Row], size: str, context: int, phase: str, precision: str = "fp32") -> Row | None:
    """An eager sweep cell's row, where it ran."""
    row = find(rows, table="sweep", size=size, context_length=context, phase=phase, precision=precision,
               compile=False)
    return row if row and row.get("status") == "ok" else None


def _headline_cells(sweep: list[Row]) -> tuple[list[str], int]:
    """The sizes and context a training-step sentence quotes: the largest sizes the run measured, at the
    headline context, or, for a run that never measured that context (a CPU run of the tiny model), its
    largest size at its longest context."""
    steps = select(sweep, phase="train_step", precision="fp32", compile=False)
    if not steps or any(r["context_length"] == HEADLINE_CONTEXT for r in steps):
        largest = sorted({r["size"] for r in steps}, key=size_order, reverse=True)
        return largest[:HEADLINE_SIZE_COUNT], HEADLINE_CONTEXT
    largest = max(steps, key=lambda r: (size_order(r["size"]), r["context_length"]))
    return [largest["size"]], largest["context_length"]


def _step_out_of_memory(step: Row) -> str:
    """An OOM training step in the index's words: refused by the memory estimate, or run out of memory."""
    if step.get("oom_predicted"):
        return (f"the {step['size']} step was not run (estimated {format_bytes(step['estimated_peak_bytes'])} "
                f"against {format_bytes(step['available_bytes'])} free)")
    return f"{step['size']} ran out of memory"


def answer_benchmarking_script(reports: Reports) -> list[str]:
    rows = latest_cells(reports["benchmarking_script"], E2E_KEY)
    main, sweep, extra = split_variants(select(rows, table="sweep"))
    sizes, context = _headline_cells(sweep)
    steps, batch_sizes = [], set()
    for size in sizes:
        step = find(sweep, size=size, context_length=context, phase="train_step", precision="fp32", compile=False)
        if step is None or step["status"] != "ok":
            steps.append(f"the {size} step is not in the report" if step is None else _step_out_of_memory(step))
            continue
        batch_sizes.add(step["batch_size"])
        phases = [(p, _e2e_step(sweep, size, context, p)) for p in ("forward", "backward", "optimizer")]
        detail = ", ".join(f"{p} {format_ms(r['mean_ms'])}" for p, r in phases if r)
        steps.append(f"{size} takes {_mean_std_ms(step)}" + (f" ({detail})" if detail else ""))
        for v, other in extra.items():
            fast = _e2e_step(other, size, context, "train_step")
            if fast:
                steps[-1] += f"; with {variant_label(v)} {_mean_std_ms(fast)}"
    batch = f"batch {listing(sorted(map(str, batch_sizes)))}, " if batch_sizes else ""
    sentences = [f"A training step (forward, backward, AdamW) of {variant_label(main)} at {batch}context {context}, "
                 "fp32, eager: " + "; ".join(steps) + "." if steps else not_in_report("An fp32 eager training step")]
    variation = step_variation(sweep)
    if variation:
        worst, noisy = variation.worst, variation.noisy
        sentences.append(f"Over the {plural(variation.cells, 'measured cell')} the std is a median "
                         f"{variation.median_share:.1%} of the mean (largest: {worst['size']} at context "
                         f"{worst['context_length']}, {PHASE_LABELS[worst['phase']]}, {variation.worst_share:.1%})"
                         + (f"; {noisy} of them {'varies' if noisy == 1 else 'vary'} by more than "
                            f"{NOISY_RELATIVE_STD:.0%} and {'is' if noisy == 1 else 'are'} marked noisy." if noisy else "."))
    cold = [r for r in ok_rows(select(rows, table="warmup", phase="train_step", warmup=0)) if r.get("first_ms")]
    warm = [r for r in ok_rows(select(rows, table="warmup", phase="train_step")) if r["warmup"] in (1, 2)]
    if cold and warm:
        slowest = max(cold, key=_first_step_ratio)
        mildest = min(cold, key=_first_step_ratio)
        warmed = max(select(rows, table="warmup", phase="train_step", size=slowest["size"]), key=lambda r: r["warmup"])
        first_step = (f"{format_ratio(_first_step_ratio(slowest))}" if mildest is slowest else
                      f"{format_ratio(_first_step_ratio(mildest))} ({mildest['size']}) to "
                      f"{format_ratio(_first_step_ratio(slowest))} ({slowest['size']})")
        study = select(rows, table="warmup")
        sentences.append(
            f"In the warm-up study ({_warmup_setup(study)}, context {study[0]['context_length']}), without warm-up "
            f"the first timed step takes {first_step} the median step, so {slowest['size']}'s "
            f"{slowest['steps']}-step mean is {_mean_std_ms(slowest)} against {_mean_std_ms(warmed)} after "
            f"{plural(warmed['warmup'], 'warm-up step')}; after 1 or 2 warm-up steps the first timed step is at most "
            f"{format_ratio(max(map(_first_step_ratio, warm)))} the median.")
    else:
        sentences.append(not_in_report("The warm-up study"))
    return sentences


def answer_benchmarking_mixed_precision(reports: Reports) -> list[str]:
    rows = latest_cells(reports["benchmarking_mixed_precision"], MIXED_PRECISION_KEY)
    main, main_sweep, _ = split_variants(select(rows, table="sweep"))
    clauses = []
    dtypes = select(rows, table="autocast_dtypes")
    if dtypes:
        by_dtype: dict[str, list[str]] = {}
        for r in dtypes:
            by_dtype.setdefault(r["dtype"], []).append(r["tensor"])
        clauses.append(f"Under {dtypes[0]['autocast']} autocast on {dtypes[0]['device']} the toy model's "
                       + "; ".join(f"{listing(tensors)} {'is' if len(tensors) == 1 else 'are'} {dtype}"
                                   for dtype, tensors in by_dtype.items()))
    else:
        clauses.append("The autocast dtype table is not in the report")
    norms = {r["storage_dtype"]: r for r in select(rows, table="normalization")}
    if "float16" in norms and "bfloat16" in norms:
        fp16, bf16 = norms["float16"], norms["bfloat16"]
        clauses.append("the mean of squares of the report's test row "
                       + ("overflows to inf" if math.isinf(fp16["mean_square"]) else
                          f"is off by {fp16['relative_error']:.2%}")
                       + f" in fp16 and is off by {bf16['relative_error']:.2%} in bf16")
    sentences = ["; ".join(clauses) + "."]
    sweep = ok_rows(main_sweep)
    # (size, context) -> its fp32 and bf16 training steps, where both ran in one run; a size too large to train
    # (its forward alone measured) has none.
    steps: dict[tuple[str, int], tuple[Row, Row]] = {}
    cells = sorted({(r["size"], r["context_length"]) for r in sweep}, key=lambda cell: (size_order(cell[0]), cell[1]))
    for size, context in cells:
        fp32, bf16 = (_e2e_step(sweep, size, context, "train_step", p) for p in ("fp32", "bf16"))
        if _paired(fp32, bf16):
            steps[size, context] = fp32, bf16
    if not steps:
        sentences.append(not_in_report("A training step in both fp32 and bf16"))
        return sentences
    sizes = sorted({size for size, _ in steps}, key=size_order)
    largest, smallest = sizes[-1], sizes[0]
    speedups = [f"{speedup_text(fp32, bf16)} at context {context} ({format_ms(fp32['mean_ms'])} -> "
                f"{format_ms(bf16['mean_ms'])})" for (size, context), (fp32, bf16) in steps.items() if size == largest]
    text = (f"bf16 autocast over fp32, eager, for a training step of {variant_label(main)} at {largest}, the largest "
            "size whose step ran in both precisions: " + ", ".join(speedups))
    first_context = min(context for size, context in steps if size == smallest)
    fp32, bf16 = steps[smallest, first_context]
    if smallest != largest:
        text += (f"; at {smallest}, context {first_context}, it is {speedup_text(fp32, bf16)}"
                 + (" (bf16 slower)" if bf16["mean_ms"] > fp32["mean_ms"] else ""))
    sentences.append(text + ".")
    return sentences


def _reference_answer(rows: list[Row]) -> list[str]:
    """The compiled step against the torch-native reference: the largest cell, where the ratio
    ranges, and how busy the project's GPU was where the ratio is worst; only cells whose two steps ran in
    one run are compared."""
    steps = _reference_steps(rows)
    cells = {cell: pair for cell, pair in steps.items() if same_run(*pair)}  # only these ratios are read
    unpaired = len(steps) - len(cells)
    if not cells:
        return [f"The torch-native reference's {plural(unpaired, 'training step')} and the project's compiled steps "
                f"of the same cells ran in different runs, so no ratio is read from them; `{REFERENCE_COMMAND}` times "
                "both in one run."] if unpaired else []
    ratios = {cell: ours["median_ms"] / theirs["median_ms"] for cell, (ours, theirs) in cells.items()}
    (size, context, precision), (ours, theirs) = list(cells.items())[-1]
    sentences = [f"Against a torch-native LM of the same architecture compiled whole, the compiled {size} {precision} "
                 f"training step at context {context} takes {format_ratio(ratios[size, context, precision])} its "
                 f"time (medians {format_ms(ours['median_ms'])} and {format_ms(theirs['median_ms'])})"
                 + (f"; over {plural(len(cells), 'cell')} the ratio is {span(ratios.values(), format_ratio)}"
                    if len(cells) > 1 else "")
                 + (f"; {plural(unpaired, 'cell')} whose two steps ran in different runs "
                    f"{'is' if unpaired == 1 else 'are'} left out." if unpaired else ".")]
    worst = max(ratios, key=ratios.get)
    busy = {model: find(rows, table=BREAKDOWN_TABLE, phase="step", size=worst[0], context_length=worst[1],
                        precision=worst[2], model=model) for model in (None, REFERENCE_MODEL)}
    if all(row and row.get("busy_ms") is not None for row in busy.values()) and same_run(*busy.values()):
        project, reference = busy.values()
        extra_step = project["step_ms"] - reference["step_ms"]
        extra_busy = project["busy_ms"] - reference["busy_ms"]
        sentence = (f"Where the ratio is highest ({worst[0]}, context {worst[1]}, {worst[2]}), the GPU was busy for "
                    f"{format_share(project['busy_ms'] / project['step_ms'])} of the project's profiled step and "
                    f"{format_share(reference['busy_ms'] / reference['step_ms'])} of the reference's")
        if extra_step > 0:
            sentence += (f"; of the project's extra {format_ms(extra_step)} per profiled step, "
                         f"{format_ms(max(extra_busy, 0.0))} is kernel time and the rest the GPU waiting for the host")
        sentences.append(sentence + ".")
    return sentences


def answer_compiled_models(rows: list[Row]) -> list[str]:
    """The whole-model part of the torch_compile answer (attention.answer_torch_compile gives it all): compiled
    against eager, then against the torch-native reference."""
    sweep = select(rows, table="sweep")
    # (size, context, precision, phase) -> the eager and the compiled training step, where both ran in one run.
    pairs = {index: (eager, compiled) for index, (eager, compiled) in _paired_cells(sweep, "compile", False, True).items()
             if _paired(eager, compiled) and eager["phase"] == "train_step"}
    if not pairs:
        return [not_in_report("A whole-model training step both eager and compiled in one run"),
                *_reference_answer(rows)]
    speedups = phase_speedups(sweep, "compile", False, True, "train_step")
    if speedups.ratios:
        details = speedups.details()
        sentences = [f"Compiling each Transformer block makes the whole-model training step {speedups.range_text()} "
                     f"as fast as eager over {len(speedups.ratios)} size, context and precision "
                     f"{'cell' if len(speedups.ratios) == 1 else 'cells'}" + (f" ({details})." if details else ".")]
    else:
        sentences = [f"Every eager and compiled training step here is noisy (std above {NOISY_RELATIVE_STD:.0%} of "
                     "the mean), so no speed-up is read from them."]
    largest = max(pairs, key=lambda key: (size_order(key[0]), key[1] == HEADLINE_CONTEXT, key[1]))
    size, context = largest[:2]
    shown = [f"{precision} {format_ms(e['mean_ms'])} -> {format_ms(c['mean_ms'])}, {speedup_text(e, c)}"
             for (s, n, precision, _), (e, c) in sorted(pairs.items(), key=lambda item: item[0][2], reverse=True)
             if (s, n) == (size, context)]
    sentences.append(f"At {size}, context {context}: " + ", ".join(shown) + ".")
    return sentences + _reference_answer(rows)
