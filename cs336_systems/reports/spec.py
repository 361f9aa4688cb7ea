"""Reports declared, and the one renderer that draws them.

A report is a sequence of parts, rendered in order from its rows and joined by blank lines; a part that
renders to nothing is left out:

    Report("fsdp_accounting", parts=(Text(setup), Table(where={"table": "step"}, columns=...), Plot(...)))

- `Table`: a Markdown table of the rows a filter selects, with declared columns (a row's column or a
  function of the row), an order, and optionally a pivot (one line per index, one column per value).
- `Plot`: a figure of lines, one per series, x against y, on declared scales, optionally one panel per
  facet; the report shows it as an image under its file name.
- `Text`: the sentences that interpret the numbers, written by the problem family's module (the answers);
  a plain string is a fixed paragraph.

`requires` names the rows a report needs at all: without them it renders `_no rows_`. Everything a report
shows is declared in cs336_systems.reports.problems; the family modules hold only the text functions.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

from cs336_systems.reports import Rendered, markdown_table
from cs336_systems.rows import Row

# A row's value: the column of that name, or a function of the row.
Value = Union[str, Callable[[Row], Any]]
# Which rows a part takes: those whose columns equal these values, or those a predicate accepts.
Where = Union[Mapping[str, Any], Callable[[Row], bool]]

NO_ROWS = "_no rows_\n"


def value_of(value: Value, row: Row) -> Any:
    return row.get(value) if isinstance(value, str) else value(row)


def if_ran(value: Value, otherwise: Callable[[Row], Any] | None = None) -> Callable[[Row], Any]:
    """A cell of `value` where the row ran; where it did not, `otherwise(row)` (why not, say), or nothing."""
    return lambda row: value_of(value, row) if row["status"] == "ok" else otherwise and otherwise(row)


def selected(rows: Sequence[Row], where: Where | None) -> list[Row]:
    if where is None:
        return list(rows)
    if callable(where):
        return [row for row in rows if where(row)]
    return [row for row in rows if all(row.get(k) == v for k, v in where.items())]


@dataclass(frozen=True)
class Column:
    """A table column: its header, and its cells' value (by default the row's column of the header's name).
    An `optional` column is left out where no row has a value in it."""
    header: str
    value: Value | None = None
    optional: bool = False

    def cells(self, rows: Sequence[Row]) -> list[Any]:
        value = self.header if self.value is None else self.value
        return [value_of(value, row) for row in rows]


@dataclass(frozen=True)
class Versus:
    """A column comparing each row's `value` with the baseline row's (the first of the table's rows that ran
    whose columns equal `baseline`): the relative difference, "+4.0%"; empty where either has no value, and
    left out where no row has one."""
    header: str
    value: str
    baseline: Mapping[str, Any]
    spec: str = "+.1%"
    optional: bool = True

    def cells(self, rows: Sequence[Row]) -> list[Any]:
        base = next((r for r in rows if r.get("status") == "ok"
                     and all(r.get(k) == v for k, v in self.baseline.items())), None)
        if base is None or not base.get(self.value):
            return [None] * len(rows)
        return [None if row.get("status") != "ok" or not row.get(self.value) else
                f"{row[self.value] / base[self.value] - 1:{self.spec}}" for row in rows]


@dataclass(frozen=True)
class Pivot:
    """One table line per distinct `index`, one column per distinct value of `column`, headed
    "<label> <value>" (label: the column's name unless given), holding `value` of the row there. `heading`, where
    given, names the column a row's value goes under instead (a column per variant and value, say)."""
    index: tuple[str, ...]
    column: str
    value: Value
    label: str | None = None
    heading: Callable[[Row], str] | None = None


@dataclass(frozen=True)
class Table:
    """A Markdown table of the rows `where` selects, in `order` (a sort key) or as they come.

    `columns`: each a column name, a Column or a Versus; None for every column. `present_only` leaves out every
    column no row has a value in. `rows_of` replaces the selected rows before the columns are read (rows derived from
    them: a comparison with a baseline row, say). `empty`: the text where no row is selected (None: nothing)."""
    where: Where | None = None
    columns: tuple[str | Column | Versus, ...] | None = None
    order: Callable[[Row], Any] | None = None
    pivot: Pivot | None = None
    present_only: bool = False
    rows_of: Callable[[list[Row]], list[Row]] | None = None
    empty: str | None = None

    def render(self, rows: Sequence[Row]) -> str:
        chosen = selected(rows, self.where)
        if self.order is not None:
            chosen = sorted(chosen, key=self.order)
        if self.rows_of is not None:
            chosen = self.rows_of(chosen)
        if not chosen:
            return self.empty or ""
        if self.pivot is not None:
            chosen = _pivoted(chosen, self.pivot)
        if self.columns is None:
            return markdown_table(chosen)
        columns = [Column(c) if isinstance(c, str) else c for c in self.columns]
        cells = {c.header: c.cells(chosen) for c in columns}
        headers = [c.header for c in columns if not ((self.present_only or c.optional)
                                                      and all(v is None for v in cells[c.header]))]
        return markdown_table([{h: cells[h][i] for h in headers} for i in range(len(chosen))], headers)


def _pivoted(rows: list[Row], pivot: Pivot) -> list[Row]:
    table: dict[tuple, Row] = {}
    for row in rows:
        key = tuple(row.get(i) for i in pivot.index)
        line = table.setdefault(key, dict(zip(pivot.index, key)))
        heading = pivot.heading(row) if pivot.heading else f"{pivot.label or pivot.column} {row.get(pivot.column)}"
        line[heading] = value_of(pivot.value, row)
    return list(table.values())


@dataclass(frozen=True)
class Scale:
    """An axis scale as matplotlib names it ("linear", "log"), with the log's base."""
    kind: str = "linear"
    base: float = 10


LOG = Scale("log")
LOG2 = Scale("log", 2)


@dataclass(frozen=True)
class Reference:
    """Horizontal lines at values the rows give (a device's memory, a link's nominal bandwidth): `at(rows)` returns
    (y, label) pairs."""
    at: Callable[[list[Row]], list[tuple[float, str]]]
    color: str = "gray"
    linestyle: str = "--"


@dataclass(frozen=True)
class Plot:
    """Lines of `y` against `x`, one per distinct `series` value (its legend label `label(series value)`), each
    sorted by x, over the rows `where` selects; one panel per distinct `facet` value where given (titled
    `facet_title(value)`), side by side. The report shows it as `![title](file)`.

    `rows_of` replaces the selected rows before the lines are drawn (points derived from them: a measured and a
    predicted point per row, say). `style(series value)`: that line's own matplotlib keywords (a linestyle; its
    marker, over `marker`). Series with one `colour_of(series value)` share the colour of the first drawn (a
    prediction beside its measurement). `tight_layout`: whether the panels are fitted to the figure."""
    file: str
    x: Value
    y: Value
    series: Value
    label: Callable[[Any], str] = str
    where: Where | None = None
    facet: Value | None = None
    facet_title: Callable[[Any], str] = str
    xscale: Scale = Scale()
    yscale: Scale = Scale()
    xlabel: str = ""
    ylabel: str = ""
    title: str = ""
    alt: str | None = None  # the image's text in the Markdown; the title by default
    references: tuple[Reference, ...] = ()
    marker: str = "o"
    figsize: tuple[float, float] = (7, 4.5)
    grid: bool = False
    legend_fontsize: str | int = "small"
    series_order: Callable[[Any], Any] | None = None
    rows_of: Callable[[list[Row]], list[Row]] | None = None
    style: Callable[[Any], Mapping[str, Any]] | None = None
    colour_of: Callable[[Any], Any] | None = None
    tight_layout: bool = True

    def figure(self, rows: Sequence[Row]):
        from matplotlib.figure import Figure

        chosen = selected(rows, self.where)
        if self.rows_of is not None:
            chosen = self.rows_of(chosen)
        facets = _distinct(chosen, self.facet) if self.facet is not None else [None]
        figure = Figure(figsize=self.figsize)
        panels = figure.subplots(1, len(facets), squeeze=False)[0]
        for axes, facet in zip(panels, facets):
            here = [r for r in chosen if facet is None or value_of(self.facet, r) == facet]
            colours: dict[Any, Any] = {}
            for key, xs, ys in self.lines(here):
                style = {"marker": self.marker, **(self.style(key) if self.style else {})}
                if self.colour_of is not None:
                    style["color"] = colours.get(self.colour_of(key))
                (drawn,) = axes.plot(xs, ys, label=self.label(key), **style)
                if self.colour_of is not None:
                    colours.setdefault(self.colour_of(key), drawn.get_color())
            for reference in self.references:
                for y, label in reference.at(here):
                    axes.axhline(y, color=reference.color, linestyle=reference.linestyle, label=label)
            self.set_scales(axes)
            axes.set_xlabel(self.xlabel)
            axes.set_ylabel(self.ylabel)
            axes.set_title(self.title if facet is None else self.facet_title(facet))
            if self.grid:
                axes.grid(True, which="both", alpha=0.3)
            axes.legend(fontsize=self.legend_fontsize)
        if self.facet is not None and self.title:
            figure.suptitle(self.title)
        if self.tight_layout:
            figure.tight_layout()
        return figure

    def lines(self, rows: Sequence[Row]):
        """Each series of `rows` in `series_order`: its value, and its points' x and y values, sorted by x."""
        for key in sorted(_distinct(rows, self.series), key=self.series_order):
            line = sorted((r for r in rows if value_of(self.series, r) == key), key=lambda r: value_of(self.x, r))
            yield key, [value_of(self.x, r) for r in line], [value_of(self.y, r) for r in line]

    def set_scales(self, axes) -> None:
        for set_scale, scale in ((axes.set_xscale, self.xscale), (axes.set_yscale, self.yscale)):
            if scale.kind == "log":
                set_scale("log", base=scale.base)
            else:
                set_scale(scale.kind)


@dataclass(frozen=True)
class Drawn(Plot):
    """A figure no Plot declares (a grid of panels, lines styled one by one, ticks of its own): the family module's
    `draw(rows)` returns it, a matplotlib Figure. The report shows it as a Plot, where `where` selects rows."""
    x: Value = ""
    y: Value = ""
    series: Value = ""
    draw: Callable[[list[Row]], Any] | None = None

    def figure(self, rows: Sequence[Row]):
        return self.draw(list(rows))


@dataclass(frozen=True)
class GridPlot(Plot):
    """A Plot with a panel per pair of facets: a row of panels per distinct `facet_row` value (in `facet_row_order`), a
    column per distinct `facet` value (sorted), sharing the x axis. Each panel is `panel_size` inches, titled
    `panel_title(row value, column value)` in a small font; markers are `markersize` points. The x label stands under
    the bottom row, the y label beside the first column, the legend in the first panel with a line, `title` above
    them all."""
    facet_row: Value = ""
    facet_row_order: Callable[[Any], Any] | None = None
    panel_title: Callable[[Any, Any], str] = "{}, {}".format
    panel_size: tuple[float, float] = (3.2, 2.6)
    markersize: float | None = None

    def figure(self, rows: Sequence[Row]):
        from matplotlib.figure import Figure

        chosen = selected(rows, self.where)
        grid_rows = sorted(_distinct(chosen, self.facet_row), key=self.facet_row_order)
        grid_columns = sorted(_distinct(chosen, self.facet))
        width, height = self.panel_size
        figure = Figure(figsize=(width * len(grid_columns), height * len(grid_rows)))
        panels = figure.subplots(len(grid_rows), len(grid_columns), squeeze=False, sharex=True)
        for i, row_value in enumerate(grid_rows):
            for j, column_value in enumerate(grid_columns):
                axes = panels[i][j]
                here = [r for r in chosen
                        if value_of(self.facet_row, r) == row_value and value_of(self.facet, r) == column_value]
                for key, xs, ys in self.lines(here):
                    axes.plot(xs, ys, marker=self.marker, markersize=self.markersize, label=self.label(key))
                self.set_scales(axes)
                axes.set_title(self.panel_title(row_value, column_value), fontsize="small")
                if i == len(grid_rows) - 1:
                    axes.set_xlabel(self.xlabel)
                if j == 0:
                    axes.set_ylabel(self.ylabel)
        labelled = next((axes for line in panels for axes in line if axes.get_legend_handles_labels()[0]), None)
        if labelled is not None:
            labelled.legend(fontsize=self.legend_fontsize)
        figure.suptitle(self.title)
        figure.tight_layout()
        return figure


def _distinct(rows: Sequence[Row], value: Value) -> list[Any]:
    return list(dict.fromkeys(value_of(value, r) for r in rows))


@dataclass(frozen=True)
class Text:
    """Sentences from the rows, written by the problem family's module: `write(rows)`, "" for none. With `where`,
    `write` reads only the rows it selects, and where it selects none there is no text."""
    write: Callable[[list[Row]], str]
    where: Where | None = None

    def render(self, rows: Sequence[Row]) -> str:
        chosen = selected(rows, self.where)
        return self.write(chosen) if chosen or self.where is None else ""


def when(where: Where, text: str) -> Text:
    """A fixed paragraph (a section's heading, a table's setup) shown only where `where` selects rows."""
    return Text(lambda rows: text if selected(rows, where) else "")


Part = Union[str, Text, Table, Plot]


@dataclass(frozen=True)
class Layout:
    """A report's parts in order, and the rows it needs at all (`requires`: without any it renders NO_ROWS).
    `rows_of` replaces the report's rows before any part reads them (the latest run's row of each cell, say)."""
    parts: tuple[Part, ...]
    requires: Where | None = None
    rows_of: Callable[[list[Row]], list[Row]] | None = None

    def __call__(self, rows: list[Row]) -> Rendered:
        if self.rows_of is not None:
            rows = self.rows_of(rows)
        if self.requires is not None and not selected(rows, self.requires):
            return Rendered(NO_ROWS)
        body, figures = [], {}
        for part in self.parts:
            if isinstance(part, Plot):
                shown = selected(rows, part.where)
                if shown:
                    figures[part.file] = part.figure(rows)
                    body.append(f"![{part.alt if part.alt is not None else part.title}]({part.file})\n")
            elif isinstance(part, Table):
                body.append(part.render(rows))
            elif isinstance(part, Text):
                body.append(part.render(rows))
            else:
                body.append(part)
        return Rendered("\n".join(text for text in body if text) or NO_ROWS, figures)
