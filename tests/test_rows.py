import csv
import json
import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from cs336_systems.accounting.communication_accounting import communication_accounting_rows
from cs336_systems.accounting.parallelism_calcs import ROWS
from cs336_systems.runs import read_rows, write_csv
from cs336_systems.reports.index import result_directories
from cs336_systems.rows import LONG_COLUMNS, UNIT_NAMES, UNIT_SUFFIXES, split_statistic, statistic_column, to_long

REPORTS = Path(__file__).resolve().parents[1] / "reports"
COMMITTED_CSVS = sorted(p.relative_to(REPORTS).as_posix() for p in [
    *REPORTS.glob("*.csv"), *(csv for slug in result_directories(REPORTS) for csv in (REPORTS / slug).glob("*.csv"))])

# CSV text cannot hold NUL or lone surrogates; everything else, commas, quotes and newlines included.
TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=12)
VALUES = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), TEXT,
                   st.sampled_from([2.0, -0.0, 1e300, "", "2026", "True", 'a "quoted", spaced ±']))
# Declared columns of every role, names that look like them, and arbitrary ones.
COLUMNS = st.one_of(st.sampled_from(["device", "status", "run", "precision", "dtype", "size", "context_length",
                                     "warmup", "mean_ms", "tflops", "mfu", "W_bytes_per_s", "bytes", "variant",
                                     "value", "cell", "_ms", "ms", "tflops_ms"]), TEXT)
RECORDS = st.lists(st.dictionaries(COLUMNS, VALUES, max_size=8), max_size=5)


def _typed(records):
    """Each value as (type, repr): 2 and 2.0 and True differ, and nan equals nan."""
    return [{column: (type(value), repr(value)) for column, value in record.items()} for record in records]


def _every_column(records):
    columns = dict.fromkeys(column for record in records for column in record)
    return [{column: record.get(column) for column in columns} for record in records]


@settings(max_examples=300, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(records=RECORDS)
@example(records=[{"dtype": "float32"}, {"precision": "fp32"}])  # the dtype from its second column
@example(records=[{"precision": 0, "dtype": "0"}])  # an earlier dtype column holding a statistic
@example(records=[{"\r": 0.0, "device": "a\rb"}])  # a line break the csv module does not quote
def test_records_come_back_from_the_csv_with_every_column_value_and_type(records, tmp_path):
    write_csv(tmp_path / "rows.csv", records)
    assert _typed(read_rows(tmp_path / "rows.csv")) == _typed(_every_column(records))


@given(column=COLUMNS)
def test_statistic_and_unit_give_the_column_name_back(column):
    assert statistic_column(*split_statistic(column)) == column


def test_unit_tables_give_each_unit_one_name():
    units = [*UNIT_SUFFIXES.values(), *UNIT_NAMES.values()]
    assert len(set(units)) == len(units)


def _csv_lines(path):
    with open(path, newline="") as f:
        return list(csv.reader(f))


def test_a_csv_has_the_long_columns_and_one_row_per_statistic(tmp_path):
    records = [
        {"size": "small", "context_length": 128, "mode": "train", "precision": "bf16", "warmup": 5, "device": "cuda",
         "status": "ok", "mean_ms": 2.0, "std_ms": 0.125, "tflops": 31.5, "mfu": 0.25, "run": 1},
        {"size": "small", "context_length": 256, "mode": "train", "precision": "bf16", "warmup": 5, "device": "cuda",
         "status": "OOM", "mean_ms": None, "std_ms": None, "tflops": None, "mfu": None, "run": 2},
    ]
    write_csv(tmp_path / "rows.csv", records)
    cell = ["cuda", "bf16", '{"size":"small","context_length":128}', '{"mode":"train","warmup":5}', "ok"]
    assert _csv_lines(tmp_path / "rows.csv") == [
        list(LONG_COLUMNS),
        ["0", "1", *cell, "mean", "2.0", "ms"],
        ["0", "1", *cell, "std", "0.125", "ms"],
        ["0", "1", *cell, "tflops", "31.5", "TFLOP/s"],
        ["0", "1", *cell, "mfu", "0.25", ""],
        ["1", "2", "cuda", "bf16", '{"size":"small","context_length":256}', '{"mode":"train","warmup":5}', "OOM",
         "", "", ""],
    ]
    assert _typed(read_rows(tmp_path / "rows.csv")) == _typed(records)


def test_an_undeclared_column_is_a_unitless_statistic_or_a_variant_and_comes_back(tmp_path):
    records = [{"colour": "red", "spin": 3, "spin_ms": 1.5, "flag": True}]
    write_csv(tmp_path / "rows.csv", records)
    lines = _csv_lines(tmp_path / "rows.csv")[1:]
    assert [line[5] for line in lines] == ['{"colour":"red","flag":true}'] * 2
    assert [line[-3:] for line in lines] == [["spin", "3", ""], ["spin", "1.5", "ms"]]
    assert _typed(read_rows(tmp_path / "rows.csv")) == _typed(records)


def test_two_cells_with_the_same_dimensions_stay_two_records(tmp_path):
    records = [{"size": "small", "mean_ms": 1.0}, {"size": "small", "mean_ms": 1.0}]
    write_csv(tmp_path / "rows.csv", records)
    assert read_rows(tmp_path / "rows.csv") == records


@pytest.mark.parametrize("csv_name", COMMITTED_CSVS)
def test_each_committed_csv_is_long_and_reads_back_into_the_records_it_holds(csv_name):
    committed = REPORTS / csv_name
    assert _csv_lines(committed)[0] == list(LONG_COLUMNS)
    records = read_rows(committed)
    assert records and len({tuple(record) for record in records}) == 1
    # Every row of the file is one the writer makes of the records it reads back.
    assert _canonical(to_long(records)) == _canonical(csv.DictReader(committed.open(newline="")))


def _canonical(long_rows):
    """Long rows as sorted text, with the keys of their shape and variant sorted: the order of a cell's
    columns and statistics does not count."""
    return sorted(json.dumps({**row, "shape": row["shape"] and json.loads(row["shape"]),
                              "variant": row["variant"] and json.loads(row["variant"])}, sort_keys=True)
                  for row in long_rows)


@pytest.mark.parametrize("name, rows", [*ROWS.items(), ("communication_accounting", communication_accounting_rows)])
def test_each_committed_closed_form_csv_holds_the_rows_its_code_computes(name, rows, tmp_path):
    write_csv(tmp_path / f"{name}.csv", rows())
    assert (tmp_path / f"{name}.csv").read_text() == (REPORTS / f"{name}.csv").read_text(), (
        f"reports/{name}.csv is stale: run `python -m cs336_systems analysis` and commit it")


def test_a_float_that_is_a_whole_number_or_not_finite_stays_a_float(tmp_path):
    records = [{"a_ms": 2.0, "b_ms": math.inf, "c_ms": -math.inf, "n": 2**70}]
    write_csv(tmp_path / "rows.csv", records)
    assert _typed(read_rows(tmp_path / "rows.csv")) == _typed(records)


def test_writing_what_was_read_gives_the_same_file(tmp_path):
    # A later run's records lack a column that earlier ones hold empty (a keyed report keeps both): the
    # column still comes back, and writing the records read back changes nothing.
    records = [{"size": "xl", "oom_during": None, "mean_ms": 1.5}, {"size": "small", "mean_ms": 2.5}]
    write_csv(tmp_path / "first.csv", records)
    read = read_rows(tmp_path / "first.csv")
    assert [r["oom_during"] for r in read] == [None, None]
    write_csv(tmp_path / "second.csv", read)
    assert (tmp_path / "second.csv").read_text() == (tmp_path / "first.csv").read_text()
