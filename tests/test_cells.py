"""A perf test whose cells all failed to run fails, saying what became of them (cs336_systems.cells)."""

import pytest

from cs336_systems.cells import require_some_ran
from cs336_systems.reports import OOM


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
