"""A perf test whose cells all failed to run fails, saying what became of them, and one whose cells ran has
measured every number it promises (cs336_systems.cells)."""

import pytest

from cs336_systems.cells import require_some_ran, unmeasured
from cs336_systems.rows import OOM


def test_one_cell_that_ran_is_enough():
    require_some_ran([{"status": OOM}, {"status": "ok"}, {"status": "unsupported"}], "the variants")


@pytest.mark.parametrize(("rows", "said"), [
    ([{"status": OOM}, {"status": "unsupported"}, {"status": OOM}],
     "the variants: none of 3 rows ran (2 OOM, 1 unsupported); nothing was measured"),
    ([{"status": OOM}], "the variants: none of 1 rows ran (1 OOM); nothing was measured"),
    ([{"step_ms": 1.0}], "the variants: none of 1 rows ran (1 None); nothing was measured"),
    ([], "the variants: none of 0 rows ran (there are none); nothing was measured"),
], ids=["out of memory and unsupported", "one cell", "no status", "no rows"])
def test_cells_none_of_which_ran_fail_naming_their_statuses(rows, said):
    with pytest.raises(AssertionError) as raised:
        require_some_ran(rows, "the variants")
    assert str(raised.value) == said


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf"), None, True, "12"])
def test_an_ok_row_without_a_positive_finite_measurement_is_unmeasured(value):
    rows = [{"status": "ok", "ms": 1.5, "bytes": 4096}, {"status": "ok", "ms": value, "bytes": 4096}]
    assert unmeasured(rows, "ms", "bytes") == [f"ms = {value!r} in {rows[1]}"]


def test_only_ok_rows_need_measurements():
    rows = [{"status": OOM, "ms": None}, {"status": "unsupported"}, {"status": "ok", "ms": 0.25}]
    assert unmeasured(rows, "ms") == []
    assert unmeasured([{"status": "ok"}], "ms") == ["ms = None in {'status': 'ok'}"]
