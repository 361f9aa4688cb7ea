"""The declared reports' renderer (cs336_systems.reports.spec): tables, comparisons, pivots, plots and layouts
drawn from rows as their declarations say."""

import pytest

from cs336_systems.reports.spec import (
    LOG2,
    NO_ROWS,
    Column,
    Drawn,
    GridPlot,
    Layout,
    Pivot,
    Plot,
    Reference,
    Table,
    Text,
    Versus,
    when,
)

STEPS = [
    {"table": "step", "variant": "torch", "status": "ok", "step_ms": 100.0, "peak_gib": 10.0},
    {"table": "step", "variant": "ours", "status": "ok", "step_ms": 90.0, "peak_gib": None},
    {"table": "step", "variant": "theirs", "status": "OOM", "step_ms": None, "peak_gib": None},
    {"table": "memory", "variant": "ours", "point": "init", "allocated_gib": 1.5, "peak_gib": None},
]


def _lines(markdown: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in markdown.splitlines()]


def test_a_table_shows_the_selected_rows_declared_columns_in_order():
    table = Table(where={"table": "step"}, order=lambda r: r["variant"],
                  columns=("variant", Column("step (ms)", lambda r: r["step_ms"] and r["step_ms"] / 2)))
    lines = _lines(table.render(STEPS))
    assert lines[0] == ["variant", "step (ms)"]
    assert [line[0] for line in lines[2:]] == ["ours", "theirs", "torch"]
    assert lines[2][1] == "45.00" and lines[3][1] == ""


def test_a_comparison_with_a_baseline_row_is_relative_and_left_out_where_nothing_compares():
    table = Table(where={"table": "step"}, columns=("variant", Versus("step vs torch", "step_ms", {"variant": "torch"}),
                                                    Versus("peak vs torch", "peak_gib", {"variant": "torch"})))
    lines = _lines(table.render(STEPS))
    assert lines[0] == ["variant", "step vs torch", "peak vs torch"]
    assert [line[1:] for line in lines[2:]] == [["+0.0%", "+0.0%"], ["-10.0%", ""], ["", ""]]
    without_peak = Table(where={"table": "step"}, columns=("variant", Versus("peak vs ours", "peak_gib",
                                                                             {"variant": "ours"})))
    assert _lines(without_peak.render(STEPS))[0] == ["variant"]
    no_baseline = Table(where={"variant": "ours"}, columns=("variant", Versus("vs torch", "step_ms", {"variant": "x"})))
    assert _lines(no_baseline.render(STEPS))[0] == ["variant"]


def test_present_only_leaves_out_empty_columns_and_an_empty_selection_says_what_is_missing():
    table = Table(where={"table": "memory"}, columns=("variant", "point", "allocated_gib", "peak_gib"),
                  present_only=True, empty="_none_\n")
    assert _lines(table.render(STEPS))[0] == ["variant", "point", "allocated_gib"]
    assert table.render(STEPS[:3]) == "_none_\n"
    assert Table(where={"table": "memory"}).render(STEPS[:3]) == ""


def test_a_pivot_has_a_line_per_index_and_a_column_per_value():
    rows = [{"backend": b, "size": s, "ms": i} for i, (b, s) in enumerate([("gloo", 1), ("gloo", 2), ("nccl", 1)])]
    lines = _lines(Table(pivot=Pivot(("backend",), "size", "ms", label="MB")).render(rows))
    assert lines[0] == ["backend", "MB 1", "MB 2"]
    assert lines[2:] == [["gloo", "0", "1"], ["nccl", "2", ""]]


def test_a_pivot_heading_puts_each_row_under_the_column_it_names():
    rows = [{"size": 1, "variant": v, "ms": i} for i, v in enumerate(["ours", "torch", "ours"])]
    rows[2]["size"] = 2
    pivot = Pivot(("size",), "variant", "ms", heading=lambda r: f"{r['variant']} (ms)")
    lines = _lines(Table(pivot=pivot).render(rows))
    assert lines[0] == ["size", "ours (ms)", "torch (ms)"]
    assert lines[2:] == [["1", "0", "1"], ["2", "2", ""]]


def test_a_text_with_a_filter_reads_the_rows_it_selects_and_is_left_out_without_them():
    text = Text(lambda rows: f"{len(rows)} of them.\n", where={"table": "memory"})
    assert text.render(STEPS) == "1 of them.\n"
    assert text.render(STEPS[:3]) == ""
    assert Text(lambda rows: f"{len(rows)} of them.\n").render([]) == "0 of them.\n"


def test_a_layout_renders_the_rows_its_rows_of_gives():
    layout = Layout((Text(lambda rows: f"{len(rows)} of them.\n"),), requires={"table": "step"},
                    rows_of=lambda rows: [r for r in rows if r["table"] == "step"][:1])
    assert layout(STEPS).body == "1 of them.\n"
    assert layout(STEPS[3:]).body == NO_ROWS


def test_a_layout_joins_its_parts_leaves_out_empty_ones_and_needs_its_rows():
    layout = Layout(("Setup.\n", Text(lambda rows: ""), Table(where={"table": "step"}, columns=("variant",)),
                     Text(lambda rows: f"{len(rows)} rows.\n")), requires={"table": "step"})
    body = layout(STEPS).body
    assert body.startswith("Setup.\n\n| variant") and body.endswith("\n4 rows.\n")
    assert layout(STEPS[3:]).body == NO_ROWS


def test_a_plot_draws_a_line_per_series_sorted_by_x_and_its_references():
    pytest.importorskip("matplotlib")
    rows = [{"n": n, "d": d, "ms": n * d, "memory": 100.0} for n in (4, 1, 2) for d in (16, 32)]
    plot = Plot("p.png", x="n", y="ms", series="d", label=lambda d: f"d={d}", xscale=LOG2, title="time",
                references=(Reference(lambda rows: [(rows[0]["memory"], "device memory")]),))
    layout = Layout((plot,))
    rendered = layout(rows)
    assert rendered.body == "![time](p.png)\n"
    (axes,) = rendered.figures["p.png"].axes
    lines = {line.get_label(): list(line.get_xdata()) for line in axes.get_lines()}
    assert lines == {"d=16": [1, 2, 4], "d=32": [1, 2, 4], "device memory": [0, 1]}
    assert axes.get_xscale() == "log"
    assert layout([]).body == NO_ROWS


def test_a_plot_draws_derived_points_with_a_series_style_and_a_colour_shared_by_its_group():
    pytest.importorskip("matplotlib")
    rows = [{"n": n, "measured": n * 2.0 if n > 1 else None} for n in (1, 2, 4)]

    def points(rows):
        return ([{**r, "kind": "measured", "y": r["measured"]} for r in rows if r["measured"] is not None]
                + [{**r, "kind": "predicted", "y": r["n"] * 2.0} for r in rows])

    plot = Plot("p.png", x="n", y="y", series="kind", rows_of=points, colour_of=lambda kind: "one",
                style=lambda kind: {"linestyle": "--", "marker": None} if kind == "predicted" else {},
                tight_layout=False)
    (axes,) = plot.figure(rows).axes
    measured, predicted = axes.get_lines()
    assert list(measured.get_xdata()) == [2, 4] and list(predicted.get_xdata()) == [1, 2, 4]
    assert predicted.get_linestyle() == "--" and predicted.get_marker() == "None" and measured.get_marker() == "o"
    assert predicted.get_color() == measured.get_color()


def test_a_drawn_figure_comes_from_its_draw_function_and_shows_where_its_rows_are():
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    drawn = []
    layout = Layout((Drawn("d.png", draw=lambda rows: drawn.append(len(rows)) or Figure(), where={"table": "step"},
                           alt="steps"),))
    rendered = layout(STEPS)
    assert rendered.body == "![steps](d.png)\n" and isinstance(rendered.figures["d.png"], Figure)
    assert drawn == [len(STEPS)]
    assert layout(STEPS[3:]).body == NO_ROWS and drawn == [len(STEPS)]


def test_a_paragraph_declared_when_rows_exist_shows_only_with_them():
    heading = when({"table": "memory"}, "## Memory\n")
    assert heading.write(STEPS) == "## Memory\n"
    assert heading.write(STEPS[:3]) == ""


def test_a_grid_plot_has_a_panel_per_pair_of_facets_labels_on_its_edges_and_one_legend():
    pytest.importorskip("matplotlib")
    rows = [{"mode": m, "d": d, "n": n, "ms": n * d, "provider": p} for m in ("backward", "forward")
            for d in (32, 16) for n in (1, 2) for p in ("b", "a")]
    plot = GridPlot("g.png", x="n", y="ms", series="provider", facet="d", facet_row="mode",
                    facet_row_order=("forward", "backward").index, panel_title=lambda m, d: f"{m}, d={d}",
                    xlabel="N", ylabel="ms", title="time")
    figure = plot.figure(rows)
    axes = figure.axes
    assert [a.get_title() for a in axes] == ["forward, d=16", "forward, d=32", "backward, d=16", "backward, d=32"]
    assert [a.get_xlabel() for a in axes] == ["", "", "N", "N"]
    assert [a.get_ylabel() for a in axes] == ["ms", "", "ms", ""]
    assert [a.get_legend() is not None for a in axes] == [True, False, False, False]
    assert [line.get_label() for line in axes[0].get_lines()] == ["a", "b"]
    assert list(figure.get_size_inches()) == [6.4, 5.2]
