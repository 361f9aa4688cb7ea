"""What became of a benchmark's cells. A cell ran (its rows have status "ok") or it did not: it ran out
of memory (OOM), its provider does not support it, or the implementation under test failed in it (FAILED,
`failure_columns`). A perf test whose cells all failed to run measured nothing, and must fail rather than
pass on an empty report; one whose cells ran must have measured every number it promises."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from cs336_systems.checks import is_positive_finite
from cs336_systems.rows import FAILED, Row, ok_rows


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


# How much of an error's message a failed cell keeps: enough to name the error, not a page of a report's table.
ERROR_TEXT_CHARS = 200


def failure_columns(error: BaseException) -> Row:
    """The columns of a cell whose implementation under test raised `error`: status FAILED, and the error's type
    and the first line of its message."""
    lines = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    if len(text) > ERROR_TEXT_CHARS:
        text = text[:ERROR_TEXT_CHARS - 3] + "..."
    return {"status": FAILED, "error": text}


def failures(rows: Iterable[Row], name_column: str) -> list[str]:
    """Each row whose implementation under test failed, as "<its name_column>: <error>"."""
    return [f"{row[name_column]}: {row.get('error')}" for row in rows if row.get("status") == FAILED]
