"""What became of a benchmark's cells. A cell ran (its rows have status "ok") or it did not: it ran out
of memory (OOM), or its provider does not support it. A perf test whose cells all failed to run
measured nothing, and must fail rather than pass on an empty report; one whose cells ran must have
measured every number it promises."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from cs336_systems.checks import is_positive_finite
from cs336_systems.rows import Row, ok_rows


def require_some_ran(rows: Iterable[Row], what: str) -> None:
    """Raise AssertionError when none of `rows` ran, saying what they are and how many had each status."""
    rows = list(rows)
    if ok_rows(rows):
        return
    statuses = Counter(str(row.get("status")) for row in rows)
    counts = ", ".join(f"{count} {status}" for status, count in statuses.most_common()) or "there are none"
    raise AssertionError(f"{what}: none of {len(rows)} rows ran ({counts}); nothing was measured")


def unmeasured(rows: Iterable[Row], *columns: str) -> list[str]:
    """Each of `columns` that a row with status "ok" holds as anything but a positive, finite number
    (a time or a size that was never measured, or measured wrongly), as "column = value in row".
    Empty when every ok row has them all; rows of any other status are not looked at."""
    return [f"{column} = {row.get(column)!r} in {row}" for row in ok_rows(rows)
            for column in columns if not is_positive_finite(row.get(column))]
