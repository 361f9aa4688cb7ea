"""The rows that benchmarks return and reports render, what both sides name in them, and the long format
of every report's CSV.

A measuring function returns rows, flat dicts of strings, numbers, booleans and None, one per measured
cell (a record); the reports package renders them. A cell that ran has status "ok" (`ran`, `ok_rows`);
one that ran out of memory, or that the memory model said would not fit, has status OOM
(cs336_systems.memory_guard). Beside these, the values a benchmark writes and a report reads back: the
model variants of the end-to-end rows, the breakdown table's name and phases, and each report's key, the
columns that identify one of its cells. What one problem family's benchmark and report both name (its variants,
labels, sweep grids, orders) is in the family's module of this package (cs336_systems.rows.flash, .ddp, ...), so
that a report reads its rows without importing the code that measured them.

On disk each record becomes long rows with the columns LONG_COLUMNS:

    cell, run, device, dtype, shape, variant, status, statistic, value, unit

`cell` numbers the record within its report, so a record comes back whole even where two cells have
the same dimensions; `run` is the record's run number. `device`, `dtype` and `status` hold the
record's text of those roles (DTYPE_COLUMNS names the columns that count as the dtype, the first
holding text wins). `shape` holds the workload-size columns (SHAPE_COLUMNS) and `variant` every
other column that is not a statistic, each as a compact JSON object, keys in the record's order. A
statistic is a number (not a boolean) in a column that is neither a size nor a setting
(SETTING_COLUMNS): each gets a row of its own, its column name split into `statistic` and `unit`
(`mean_ms` -> mean, ms; UNIT_SUFFIXES), its value written so that it reads back as the same int or
float. A record with no statistic still gets one row, with `statistic`, `value` and `unit` empty.

`from_long(to_long(records))` gives the records back, value for value and type for type, whatever
their columns: a column the tables above do not name is a statistic (a number, no unit) or a
variant, and a value that does not fit its plain column (a run that is not an int, text with a line
break) goes in the variant's JSON.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from cs336_systems.checks import is_number

Row = dict[str, Any]  # a measured cell: column -> value
LongRow = dict[str, str]  # LONG_COLUMNS -> the text of a CSV cell

# The status of a cell that ran out of memory, or that the memory model said would not fit and so never ran.
OOM = "OOM"
# The status of a cell whose implementation under test (an adapters module's) raised an error other than running
# out of memory; its `error` column says which (cs336_systems.cells.failure_columns).
FAILED = "failed"
# The column of a timed cell's samples, each in ms, as the project measured them: the perf suite hands them to
# pytest-benchmark's store (cs336_systems.benchmark_store), and no report writes them (`without_samples`), so a
# report's CSV holds the statistics alone.
SAMPLE_TIMES = "sample_times_ms"


def without_samples(row: Row) -> Row:
    """`row` without its samples (SAMPLE_TIMES), as reports keep it."""
    return {column: value for column, value in row.items() if column != SAMPLE_TIMES}


def ran(row: Row | None) -> bool:
    """Whether `row` is a cell that ran (status "ok"); not a cell that ran out of memory or was not run, or no row."""
    return bool(row) and row.get("status") == "ok"


def ok_rows(rows: Iterable[Row]) -> list[Row]:
    """The rows of cells that ran (status "ok"), not those that ran out of memory or were not run."""
    return [row for row in rows if ran(row)]


# The end-to-end model benchmarks' rows (cs336_systems.benchmarks.e2e), which the nsys_profile and torch_compile
# reports read as well. (attention, AdamW) of the course's model, which the handout benchmarks, and of the faster
# variant beside it:
COURSE_VARIANT = ("naive", "course")
FAST_VARIANT = ("sdpa", "fused")
# The `model` of rows that time benchmarks.reference_lm; the project's own rows carry no `model`.
REFERENCE_MODEL = "torch reference"
# Its source, as reports name it.
REFERENCE_MODEL_SOURCE = "cs336_systems/benchmarks/reference_lm.py"
# Each AdamW implementation (a row's `optimizer` or `adamw`) as reports name it.
ADAMW_NAMES = {"course": "the course's AdamW", "fused": "fused AdamW", "foreach": "foreach AdamW"}
# The phases of a training step, each an annotated range (cs336_systems.profiling.ranges) that the end-to-end,
# profiling and FSDP benchmarks time or profile.
STEP_PHASES = ("forward", "backward", "optimizer")
# Where a step's time goes: its phases' device work by kind, and how much of the step the device was busy.
BREAKDOWN_TABLE = "breakdown"

# Each report's key: the columns that identify one of its measured cells, so that a later run replaces the rows of
# the cells it measures again and keeps the others (cs336_systems.reports.Report). benchmarking_script's:
E2E_KEY = ("table", "model", "size", "context_length", "batch_size", "mode", "precision", "compile", "attention",
           "optimizer", "warmup", "steps", "phase")
NSYS_KEY = ("table", "size", "context_length", "precision", "attention", "optimizer")
# benchmarking_mixed_precision also holds the autocast dtype rows, one per tensor of the toy model.
MIXED_PRECISION_KEY = E2E_KEY + ("tensor", "autocast", "storage_dtype")
ATTENTION_KEY = ("attention", "compile", "precision", "batch_size", "seq_len", "head_dim", "is_causal", "passes",
                 "warmup")
# torch_compile holds the whole model's cells and the attention sweep's.
TORCH_COMPILE_KEY = E2E_KEY + ("seq_len", "head_dim", "is_causal", "passes")
FLASH_KEY = ("table", "provider", "precision", "batch_size", "n_heads", "seq_len", "head_dim", "is_causal", "mode")
FLASH_IN_TRAINING_KEY = ("table", "size_table", "size", "context_length", "attention", "provider", "batch_size",
                         "n_heads", "seq_len", "head_dim", "mode")
ALLREDUCE_KEY = ("backend", "world_size", "size_bytes")


# ------------------------------------------------------------------------------------------ the long format

LONG_COLUMNS = ("cell", "run", "device", "dtype", "shape", "variant", "status", "statistic", "value", "unit")

DTYPE_COLUMNS = ("precision", "dtype")
# The workload's size: model and attention dimensions, tokens, ranks and devices, message sizes.
SHAPE_COLUMNS = frozenset({
    "size", "d_model", "d_ff", "d_head", "num_layers", "num_blocks", "num_params", "n_heads", "head_dim",
    "context_length", "seq_len", "batch_size", "sequences", "tokens", "tokens_per_device", "shape",
    "B", "D", "D_FF", "N", "N_DP", "N_FSDP", "N_TP", "S_bytes",
    "world_size", "devices", "data_devices", "tensor_devices", "data_axes", "tensor_axes", "stages", "microbatches",
    "size_bytes", "size_mb", "array_bytes", "payload_bytes",
})
# Numbers that say how a cell was run rather than what it measured.
SETTING_COLUMNS = frozenset({
    "warmup", "steps", "timed_steps", "passes", "iterations", "seed", "rank", "k", "levels", "size_table",
    "bytes_per_param", "comm_bytes_per_element", "tolerance", "usable_share", "state_share_min",
    "nvlink_generation",
})
# A statistic's column name ends in its unit's suffix: one suffix per unit and one unit per suffix, so
# that (statistic, unit) gives the column name back.
UNIT_SUFFIXES = {
    "_flops_per_s": "FLOP/s", "_bytes_per_s": "B/s", "_bytes": "B", "_gbps": "GB/s",
    "_gib": "GiB", "_mib": "MiB", "_gb": "GB", "_mb": "MB", "_ms": "ms", "_us": "us",
    "_mhz": "MHz", "_celsius": "degC",
}
# A statistic named after its unit alone.
UNIT_NAMES = {"tflops": "TFLOP/s"}
_SUFFIX_OF_UNIT = {unit: suffix for suffix, unit in UNIT_SUFFIXES.items()}
_NOT_STATISTICS = SHAPE_COLUMNS | SETTING_COLUMNS


def split_statistic(column: str) -> tuple[str, str]:
    """A statistic column's (statistic, unit): `mean_ms` -> (mean, ms), `tflops` -> (tflops, TFLOP/s),
    `mfu` -> (mfu, "")."""
    if column in UNIT_NAMES:
        return column, UNIT_NAMES[column]
    for suffix, unit in UNIT_SUFFIXES.items():
        if column.endswith(suffix) and len(column) > len(suffix):
            return column.removesuffix(suffix), unit
    return column, ""


def statistic_column(statistic: str, unit: str) -> str:
    """The column that `split_statistic` split into (statistic, unit)."""
    if not unit or UNIT_NAMES.get(statistic) == unit:
        return statistic
    return statistic + _SUFFIX_OF_UNIT[unit]


def to_long(records: Sequence[Row]) -> list[LongRow]:
    """The long rows of `records`: one per statistic of each record, or one for a record without any.

    An empty (None) value is left out, except in a column that no record has a value for: there every
    record holds it, as null in the shape or variant, so that the column comes back and writing what
    `from_long` reads gives the same rows."""
    valued = {column for record in records for column, value in record.items() if value is not None}
    empty = dict.fromkeys(column for record in records for column in record if column not in valued)
    return [row for cell, record in enumerate(records) for row in _cell_rows(cell, record, valued, empty)]


def _cell_rows(cell: int, record: Row, valued: set[str], empty: dict[str, None]) -> list[LongRow]:
    record = {column: value for column, value in record.items() if value is not None} | empty
    run = record.pop("run") if _is_int(record.get("run")) else ""
    device = record.pop("device") if _is_text(record.get("device")) else ""
    status = record.pop("status") if _is_text(record.get("status")) else ""
    dtype_column = _dtype_column(record, valued)
    dtype = record.pop(dtype_column) if dtype_column else ""
    # The reader gives the dtype to the first dtype column that the record's other columns do not
    # name, so the variant names those before it that the record lacks, as null.
    skipped = DTYPE_COLUMNS[:DTYPE_COLUMNS.index(dtype_column)] if dtype_column else ()
    shape = {c: v for c, v in record.items() if c in SHAPE_COLUMNS}
    # A statistic's name goes in a plain CSV cell.
    statistics = {c: v for c, v in record.items() if is_number(v) and c not in _NOT_STATISTICS and c.isprintable()}
    variant = {c: None for c in skipped if c not in record}
    variant |= {c: v for c, v in record.items() if c not in shape and c not in statistics}
    common = {"cell": str(cell), "run": str(run), "device": device, "dtype": dtype,
              "shape": _json(shape), "variant": _json(variant), "status": status}
    if not statistics:
        return [{**common, "statistic": "", "value": "", "unit": ""}]
    return [{**common, **dict(zip(("statistic", "unit"), split_statistic(column))), "value": _number_text(value)}
            for column, value in statistics.items()]


def _dtype_column(record: Row, valued: set[str]) -> str | None:
    """The first dtype column that holds text; none where a dtype column before it is one that the
    record lacks and no record has a value in (naming it as null would add a column)."""
    for column in DTYPE_COLUMNS:
        if _is_text(record.get(column)):
            return column
        if column not in record and column not in valued:
            return None
    return None


def from_long(rows: Iterable[LongRow]) -> list[Row]:
    """The records that `to_long` made `rows` from, each with every column of them all (None where a
    record has none), in the order: device, dtype, shape, variant, status, statistics, run."""
    cells: dict[str, list[LongRow]] = {}
    for row in rows:
        cells.setdefault(row["cell"], []).append(row)
    records = [_record(cell_rows) for cell_rows in cells.values()]
    columns = dict.fromkeys(column for record in records for column in record)
    return [{column: record.get(column) for column in columns} for record in records]


def _record(rows: list[LongRow]) -> Row:
    first = rows[0]
    shape, variant = _unjson(first["shape"]), _unjson(first["variant"])
    statistics = {statistic_column(r["statistic"], r["unit"]): _parse_number(r["value"]) for r in rows if r["value"]}
    record: Row = {"device": first["device"]} if first["device"] else {}
    if first["dtype"]:
        named = shape | variant | statistics
        record[next(c for c in DTYPE_COLUMNS if c not in named)] = first["dtype"]
    record |= shape | variant
    if first["status"]:
        record["status"] = first["status"]
    record |= statistics
    if first["run"]:
        record["run"] = int(first["run"])
    return record


def _is_text(value: Any) -> bool:
    """Text that a plain CSV cell holds as it is (other strings go in the variant's JSON)."""
    return isinstance(value, str) and value != "" and value.isprintable()


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _json(columns: Row) -> str:
    return json.dumps(columns, separators=(",", ":"), ensure_ascii=False) if columns else ""


def _unjson(text: str) -> Row:
    return json.loads(text) if text else {}


def _number_text(value: int | float) -> str:
    """An int as its digits, a float as its repr: 2.0 reads back as a float, every digit kept."""
    return repr(value) if isinstance(value, float) else str(value)


def _parse_number(text: str) -> int | float:
    try:
        return int(text)
    except ValueError:
        return float(text)
