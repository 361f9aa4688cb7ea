"""Problem nsys_profile's report: per profiled cell the timer against the profiler, the top forward kernel,
the main non-matmul kernels, the matmul share of forward and of the full step, softmax against matmul inside
attention, the kernel tables, the variants beside the course's model and whether Nsight Systems could write
a report; with its answer. The package's benchmarks/nsys_profile.py measures them.
"""

from __future__ import annotations

from collections import defaultdict

from cs336_systems.model import size_order
from cs336_systems.profiling.kernels import short_name
from cs336_systems.reports import (
    NOT_A_NUMBER,
    Rendered,
    Reports,
    format_bytes,
    format_share,
    listing,
    markdown_table,
    mean_std,
    not_in_report,
    pivot,
    plural,
    select,
    span,
)
from cs336_systems.reports.e2e import HEADLINE_CONTEXT, split_variants, variant_column_label, variant_label
from cs336_systems.rows import ADAMW_NAMES, OOM, STEP_PHASES, Row
from cs336_systems.rows.nsys_profile import ATTENTION_RANGES, FORWARD_BACKWARD, MAIN_KERNEL_SHARE, STEP_RANGE

# Softmax over a row of scores: a max, a subtraction, an exp, a sum and a division per score.
SOFTMAX_FLOPS_PER_SCORE = 5


def _nsys_cells(rows: list[Row]) -> dict[tuple, dict]:
    """(size, context) -> {"cell": row, "range": {name: row}, "kernel": {range: [rows by rank]}}."""
    cells: dict[tuple, dict] = {}
    for r in rows:
        if r.get("table") not in ("cell", "range", "kernel"):
            continue
        cell = cells.setdefault((r["size"], r["context_length"]), {"cell": None, "range": {}, "kernel": defaultdict(list)})
        if r["table"] == "cell":
            cell["cell"] = r
        elif r["table"] == "range":
            cell["range"][r["range"]] = r
        else:
            cell["kernel"][r["range"]].append(r)
    for cell in cells.values():
        for kernels in cell["kernel"].values():
            kernels.sort(key=lambda r: r["rank"])
    return dict(sorted(cells.items(), key=lambda item: (size_order(item[0][0]), item[0][1])))


def _measured(cells: dict) -> dict:
    return {key: c for key, c in cells.items() if c["cell"] and c["cell"]["status"] == "ok" and "forward" in c["range"]}


def _forward_time_section(cells: dict, device: str) -> str:
    table, wall = [], []
    for (size, context), c in cells.items():
        cell, forward = c["cell"], c["range"]["forward"]
        wall.append(forward["wall_ms"] / cell["timer_forward_ms"])
        table.append({"size": size, "context": context,
                      "timer forward (ms)": mean_std(cell["timer_forward_ms"], cell["timer_forward_std_ms"], ".2f",
                                                     samples=cell.get("timed_steps")),
                      "profiled forward range (ms)": forward["wall_ms"], "forward work (ms)": forward["work_ms"],
                      "work / timer": f"{forward['work_ms'] / cell['timer_forward_ms']:.0%}"})
    work = "GPU kernel time" if device == "cuda" else "operator CPU time"
    gap = "the GPU waited for kernel launches" if device == "cuda" else "Python and the dispatcher ran"
    sample = next(iter(cells.values()))["cell"]
    return ("## (a) Forward time: profiler against the end-to-end timer\n\n"
            f"Timer: {sample['timer']}, {sample['timed_steps']} steps after "
            f"{sample['warmup']} warm-up; then one profiled step. Forward work: its {work}.\n\n" + markdown_table(table)
            + f"\n{_range_note(device, wall)}. Beyond forward work, {gap}.\n")


def _range_note(device: str, range_over_timer: list[float]) -> str:
    """What the profiled range's wall time is beside the timer's: on a GPU host time, which ends once the host has
    queued the forward's kernels, not when they finish; on a CPU the work itself, with the profiler's overhead."""
    share = f"{_span(range_over_timer)} of the timer's mean"
    if device == "cuda":
        return f"The profiled range is host time, ending once the kernels are queued: {share}"
    return f"The profiled range spans {share}, the profiler's overhead included"


def _top_kernel_section(cells: dict) -> str:
    table = []
    for (size, context), c in cells.items():
        forward, both = c["kernel"]["forward"][0], c["kernel"][FORWARD_BACKWARD][0]
        table.append({"size": size, "context": context, "top forward kernel": short_name(forward["kernel"], 70),
                      "share of forward": f"{forward['share']:.0%}",
                      "calls per forward pass": f"{forward['calls_per_instance']:g}",
                      "top over forward+backward": "same" if forward["kernel"] == both["kernel"]
                      else short_name(both["kernel"], 70),
                      "its share": f"{both['share']:.0%}"})
    (size, _), first = next(iter(cells.items()))
    layers = first["cell"]["num_layers"]
    return ("## (b) The top forward kernel\n\n" + markdown_table(table) +
            f"\nCalls count launches: a {size} forward pass runs {7 * layers + 1} matmuls (7 Linears per block and "
            "the LM head) plus 2 batched attention matmuls per block.\n")


def _main_kernels_section(cells: dict) -> str:
    largest: dict[str, tuple] = {}
    for key in cells:  # per size, the longest context measured
        largest[key[0]] = key
    table = []
    for key in largest.values():
        for k in cells[key]["kernel"]["forward"]:
            if k.get("matmul") is False and k["share"] > MAIN_KERNEL_SHARE:
                table.append({"size": key[0], "context": key[1], "kernel": short_name(k["kernel"], 70),
                              "share of forward": f"{k['share']:.1%}", "calls": k["calls"]})
    text = (f"## (c) Non-matmul kernels above {MAIN_KERNEL_SHARE:.0%} of forward time\n\nFor each size at the longest "
            "context it ran.\n\n")
    if not table:
        return text + f"No non-matmul kernel reached {MAIN_KERNEL_SHARE:.0%} of forward time in these cells.\n"
    return text + markdown_table(table)


def _matmul_share_section(cells: dict) -> str:
    rows, lower, optimizer_shares = [], 0, []
    for (size, context), c in cells.items():
        forward, step = c["range"]["forward"]["matmul_share"], c["range"][STEP_RANGE]["matmul_share"]
        lower += step < forward
        optimizer_shares.append(c["range"]["optimizer"]["matmul_share"])
        rows.append({"size": size, "context_length": context, "value": f"{forward:.0%} / {step:.0%}"})
    table = pivot(rows, index=["size"], column="context_length", value="value", label="context")
    return ("## (d) Matmul share: forward against the full training step\n\nMatmul share of kernel time, "
            "forward / full step.\n\n" + markdown_table(table) +
            f"\nThe full step's share is lower in {lower} of {len(cells)} cells; the optimizer's is "
            f"{_span(optimizer_shares)}: AdamW is elementwise.\n")


def _ran_attention(cell: dict) -> bool:
    """Whether a cell's profile holds the annotated naive attention's ranges."""
    return all(name in cell["range"] for name in ATTENTION_RANGES)


def _attention_matmul_ms(cell: dict) -> float:
    return cell["range"]["attention/scores"]["matmul_ms"] + cell["range"]["attention/final_matmul"]["matmul_ms"]


def _softmax_flop_ratio(cell: dict) -> float:
    """Softmax's FLOPs over the attention matmuls': per score, SOFTMAX_FLOPS_PER_SCORE against 4 d_head."""
    return SOFTMAX_FLOPS_PER_SCORE / (4 * cell["cell"]["d_head"])


def _softmax_time_ratio(cell: dict) -> float | None:
    """Softmax's time over the attention matmuls' in a cell that ran the annotated attention; None where its profile
    holds no matmul time there, which leaves no ratio to take. The report and the index's answer both read it, so
    they leave out the same cells."""
    matmul_ms = _attention_matmul_ms(cell)
    return cell["range"]["attention/softmax"]["work_ms"] / matmul_ms if matmul_ms > 0 else None


def _attention_section(cells: dict) -> str:
    table, excess, without_matmul = [], [], 0
    for (size, context), c in cells.items():
        if not _ran_attention(c):
            continue
        ranges = c["range"]
        time_ratio, flop_ratio = _softmax_time_ratio(c), _softmax_flop_ratio(c)
        if time_ratio is None:
            without_matmul += 1
        else:
            excess.append(time_ratio / flop_ratio)
        table.append({"size": size, "context": context, "d_head": c["cell"]["d_head"],
                      "matmul (ms)": _attention_matmul_ms(c), "softmax (ms)": ranges["attention/softmax"]["work_ms"],
                      "scale + mask (ms)": ranges["attention/scores"]["work_ms"] - ranges["attention/scores"]["matmul_ms"],
                      "softmax / matmul time": NOT_A_NUMBER if time_ratio is None else f"{time_ratio:.2f}",
                      "FLOP ratio": f"{flop_ratio:.4f}",
                      "time ratio / FLOP ratio": (NOT_A_NUMBER if time_ratio is None
                                                  else f"{time_ratio / flop_ratio:.0f}x")})
    if not table:
        return "## (e) Softmax against matmul inside attention\n\nNo cell ran the annotated naive attention.\n"
    left_out = (f" ({plural(without_matmul, 'cell')} without matmul time in attention left out)"
                if without_matmul else "")
    if not excess:
        finding = "No cell's profile holds matmul time inside attention: there is no ratio to take.\n"
    else:
        finding = (f"Softmax's time is {_span(excess, '{:.0f}x')} its FLOP share{left_out}" + (
            ": under 1 FLOP per byte, it waits on memory; the matmuls, at about d_head / 2, on arithmetic.\n"
            if min(excess) > 1 else "; in some cells no more.\n"))
    return ("## (e) Softmax against matmul inside attention\n\n"
            f"FLOPs per score: 4 d_head in the matmuls (q k^T, P v), about {SOFTMAX_FLOPS_PER_SCORE} in softmax (max, "
            "subtract, exp, sum, divide).\n\n" + markdown_table(table) + "\n" + finding)


def _kernel_tables_section(cells: dict) -> str:
    preferred = [key for key in cells if key[1] == 512] or list(cells)
    key = max(preferred, key=lambda k: (size_order(k[0]), k[1]))
    c = cells[key]
    parts = [f"## Kernel tables: {key[0]} at context {key[1]}\n\nThe other cells' tables are in the CSV.\n"]
    for name in (*STEP_PHASES, *ATTENTION_RANGES):
        if name not in c["range"]:
            continue
        parts.append(f"### {name}\n")
        parts.append(markdown_table([{"kernel": short_name(k["kernel"], 80),
                                      "matmul": {True: "yes", False: "no"}.get(k.get("matmul"), ""),
                                      "calls": k["calls"], "calls per instance": f"{k['calls_per_instance']:g}",
                                      "total (ms)": k["total_ms"], "share": f"{k['share']:.1%}"}
                                     for k in c["kernel"][name]]))
    return "\n".join(parts)


def _nsys_section(rows: list[Row]) -> str:
    found = [r for r in rows if r.get("table") == "nsys"]
    if not found:
        return ""
    r = found[-1]
    outcome = r["nsys_report"]
    if outcome == "written":
        state = "Nsight Systems wrote a report of a CUDA program on the measuring machine."
    else:
        state = (f"Nsight Systems cannot make reports on the measuring machine ({outcome}): the tables above are "
                 "torch.profiler's (CUPTI).")
    return f"## Nsight Systems\n\n{state} Where it can, this shows the same NVTX ranges:\n\n```\n{r['command']}\n```\n"


def _profiled(rows: list[Row]) -> list[Row]:
    """The rows of profiled cells (not the Nsight Systems probe's)."""
    return [r for r in rows if r.get("table") in ("cell", "range", "kernel")]


def _variant_section(main: tuple, cells: dict, others: dict[tuple, list[Row]]) -> str:
    """Other variants' cells beside the course model's at the same size and context."""
    table = []
    for other, rows in others.items():
        for key, c in _measured(_nsys_cells(rows)).items():
            ours = cells.get(key)
            if ours is None:
                continue
            entry = {"size": key[0], "context": key[1]}
            for label, cell in ((variant_column_label(main), ours), (variant_column_label(other), c)):
                entry[f"{label}: step (ms)"] = mean_std(cell["cell"]["timer_step_ms"], cell["cell"]["timer_step_std_ms"],
                                                        ".1f", samples=cell["cell"].get("timed_steps"))
                entry[f"{label}: optimizer (ms)"] = f"{cell['cell']['timer_optimizer_ms']:.1f}"
                entry[f"{label}: forward matmul share"] = format_share(cell["range"]["forward"]["matmul_share"])
            table.append(entry)
    if not table:
        return ""
    return (f"## Beside {listing([variant_label(v) for v in others])}\n\nTheir kernel tables are in the CSV.\n\n"
            + markdown_table(table))


def _attribution_note(cells: dict) -> str:
    """How kernels were attributed, and the check that none was counted twice, from the rows."""
    excess = []
    for (size, context), c in cells.items():
        ranges = {name: r for name, r in c["range"].items() if name != FORWARD_BACKWARD}
        own = sum(r["self_work_ms"] for r in ranges.values())
        if own > ranges[STEP_RANGE]["work_ms"] * (1 + 1e-9):
            excess.append(f"{size} at context {context}")
    return ("Each kernel counts once, in the innermost range open at its launch (a range's table includes those "
            "nested in it); "
            + ("in every cell the ranges' own kernel time adds up to no more than the step's."
               if not excess else f"the ranges' own kernel time exceeds the step's in {', '.join(excess)}."))


def render_nsys_profile(rows: list[Row]) -> Rendered:
    main, mine, others = split_variants(_profiled(rows))
    cells = _nsys_cells(mine)
    measured = _measured(cells)
    parts = []
    if cells:
        sample = next(iter(cells.values()))["cell"] or {}
        device = sample.get("device", "cuda")
        ooms = [f"{s} at context {n}" + (f" (estimate {format_bytes(c['cell']['predicted_peak_bytes'])}"
                                        + ("; not run" if c["cell"].get("oom_predicted") else "") + ")"
                                        if c["cell"].get("predicted_peak_bytes") else "")
                for (s, n), c in cells.items() if c["cell"] and c["cell"]["status"] == OOM]
        parts.append(f"torch.profiler kernel tables of one training step per cell: {main[0]} attention, "
                     f"{ADAMW_NAMES[main[1]]}, {sample.get('precision', 'fp32')}, batch {sample.get('batch_size')}."
                     + (" " + _attribution_note(measured) if measured else "")
                     + (f" Out of memory: {', '.join(ooms)}." if ooms else "") + "\n")
        if measured:
            parts += [_forward_time_section(measured, device), _top_kernel_section(measured),
                      _main_kernels_section(measured), _matmul_share_section(measured),
                      _attention_section(measured), _variant_section(main, measured, others),
                      _kernel_tables_section(measured)]
        else:
            parts.append("No cell ran to completion.\n")
    parts.append(_nsys_section(rows))
    return Rendered("\n".join(p for p in parts if p))


def _span(values: list[float], fmt: str = "{:.0%}") -> str:
    return span(values, fmt.format)


# ---------------------------------------------------------------------------------------------- answers

KERNEL_NAME_CHARS = 60


def _cells_that_ran(rows: list[Row]) -> dict[tuple[str, int], dict]:
    """(size, context) -> {"cell": row, "range": {name: row}, "kernels": {range: rows by rank}}."""
    cells: dict[tuple[str, int], dict] = {}
    for r in select(rows, table="cell"):
        if r["status"] == "ok":
            cells[(r["size"], r["context_length"])] = {"cell": r, "range": {}, "kernels": {}}
    for r in rows:
        cell = cells.get((r.get("size"), r.get("context_length")))
        if cell is not None and r.get("table") == "range":
            cell["range"][r["range"]] = r
        elif cell is not None and r.get("table") == "kernel":
            cell["kernels"].setdefault(r["range"], []).append(r)
    for cell in cells.values():
        for kernels in cell["kernels"].values():
            kernels.sort(key=lambda r: r["rank"])
    return {key: c for key, c in cells.items() if "forward" in c["range"] and STEP_RANGE in c["range"]}


def answer_nsys_profile(reports: Reports) -> list[str]:
    _, rows, _ = split_variants(_profiled(reports["nsys_profile"]))
    cells = _cells_that_ran(rows)
    if not cells:
        return [not_in_report("A profiled cell that ran to completion")]
    at_headline = [key for key in cells if key[1] == HEADLINE_CONTEXT] or list(cells)
    size, context = max(at_headline, key=lambda key: (size_order(key[0]), key[1]))
    shown = cells[(size, context)]
    sample = shown["cell"]
    ooms = [f"{r['size']} at context {r['context_length']}" for r in select(rows, table="cell", status=OOM)]
    forward_kernels = shown["kernels"].get("forward", [])
    sentences = []
    if forward_kernels:
        top = forward_kernels[0]
        other = next((k for k in forward_kernels if k.get("matmul") is False), None)
        sentences.append(
            f"Kernel tables from torch.profiler ({sample['attention']} attention, "
            f"{ADAMW_NAMES[sample['optimizer']]}, {sample['precision']}, batch "
            f"{sample['batch_size']}); at {size}, context {context}, the top forward kernel is "
            f"`{short_name(top['kernel'], KERNEL_NAME_CHARS)}` ({'a matmul, ' if top.get('matmul') else ''}"
            f"{top['share']:.1%} of forward kernel time, {top['calls_per_instance']:g} launches per forward pass)"
            + (f" and the largest non-matmul one `{short_name(other['kernel'], KERNEL_NAME_CHARS)}` "
               f"({other['share']:.1%})" if other else "")
            + (f"; out of memory: {listing(ooms)}." if ooms else "."))
    else:
        sentences.append(not_in_report(f"The forward kernel table of {size} at context {context}"))
    forward_shares = [c["range"]["forward"]["matmul_share"] for c in cells.values()]
    step_shares = [c["range"][STEP_RANGE]["matmul_share"] for c in cells.values()]
    sentences.append(
        f"Matmuls take {format_share(shown['range']['forward']['matmul_share'])} of forward kernel time and "
        f"{format_share(shown['range'][STEP_RANGE]['matmul_share'])} of the full training step there "
        f"({span(forward_shares, format_share)} and {span(step_shares, format_share)} over the "
        f"{plural(len(cells), 'profiled cell')})"
        + (f"; the optimizer's share is {format_share(shown['range']['optimizer']['matmul_share'])}."
           if "optimizer" in shown["range"] else "."))
    attention = {key: c for key, c in cells.items() if _ran_attention(c)}
    excess = {key: (time_ratio, _softmax_flop_ratio(c)) for key, c in attention.items()
              if (time_ratio := _softmax_time_ratio(c)) is not None}
    if (size, context) in excess:
        time_ratio, flop_ratio = excess[(size, context)]
        over_cells = span([t / f for t, f in excess.values()], "{:.0f}x".format)
        left_out = len(attention) - len(excess)
        sentences.append(
            f"Inside attention softmax takes {time_ratio:.2f}x the matmuls' time against {flop_ratio:.2%} of their "
            f"FLOPs, {time_ratio / flop_ratio:.0f}x its FLOP share ({over_cells} over the cells"
            + (f"; {plural(left_out, 'cell')} without matmul time in attention left out" if left_out else "")
            + "): it is paced by memory traffic, not arithmetic.")
    elif (size, context) in attention:
        sentences.append(f"Inside attention at {size}, context {context}, the profile holds no matmul time: there is "
                         "no ratio of softmax's time to take.")
    else:
        sentences.append(not_in_report(f"The attention ranges (scores, softmax, final matmul) of {size} at context "
                                        f"{context}"))
    return sentences
