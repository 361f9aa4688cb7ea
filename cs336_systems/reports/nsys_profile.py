"""The answers of problem nsys_profile's report: per profiled cell the timer against the profiler, the top forward
kernel, the main non-matmul kernels, the matmul share of forward and of the full step, softmax against matmul inside
attention, the variants beside the course's model and whether Nsight Systems could write a report. Its tables are
declared in cs336_systems.reports.problems; the package's benchmarks/nsys_profile.py measures them.

The tables read profiled cells: {"size", "context", "cell": the cell's row, "range": {range: its row},
"kernel": {range: its kernels' rows, by rank}}, of the course's model where the rows have it.
"""

from __future__ import annotations

import functools
from collections import defaultdict

from cs336_systems.model import size_order
from cs336_systems.profiling.kernels import short_name
from cs336_systems.reports import (
    NOT_A_NUMBER,
    Reports,
    format_bytes,
    format_share,
    listing,
    mean_std,
    not_in_report,
    plural,
    select,
    span,
)
from cs336_systems.reports.e2e import HEADLINE_CONTEXT, split_variants, variant_column_label, variant_label
from cs336_systems.rows import ADAMW_NAMES, OOM, STEP_PHASES, Row
from cs336_systems.rows.nsys_profile import ATTENTION_RANGES, FORWARD_BACKWARD, MAIN_KERNEL_SHARE, STEP_RANGE

# Softmax over a row of scores: a max, a subtraction, an exp, a sum and a division per score.
SOFTMAX_FLOPS_PER_SCORE = 5
# Kernel names as the tables and the answer shorten them.
TABLE_NAME_CHARS = 70
KERNEL_TABLE_NAME_CHARS = 80
ANSWER_NAME_CHARS = 60
KERNEL_TABLE_RANGES = (*STEP_PHASES, *ATTENTION_RANGES)


def _cells(rows: list[Row]) -> list[dict]:
    """Every profiled cell of `rows` (its cell row None where only its ranges or kernels are there), in size then
    context order."""
    cells: dict[tuple, dict] = {}
    for r in rows:
        if r.get("table") not in ("cell", "range", "kernel"):
            continue
        cell = cells.setdefault((r["size"], r["context_length"]), {
            "size": r["size"], "context": r["context_length"], "cell": None, "range": {}, "kernel": defaultdict(list)})
        if r["table"] == "cell":
            cell["cell"] = r
        elif r["table"] == "range":
            cell["range"][r["range"]] = r
        else:
            cell["kernel"][r["range"]].append(r)
    for cell in cells.values():
        for kernels in cell["kernel"].values():
            kernels.sort(key=lambda r: r["rank"])
    return [cells[key] for key in sorted(cells, key=lambda key: (size_order(key[0]), key[1]))]


def _ran(cells: list[dict]) -> list[dict]:
    """The cells that ran to completion, with their forward and step ranges."""
    return [c for c in cells
            if c["cell"] and c["cell"]["status"] == "ok" and {"forward", STEP_RANGE} <= c["range"].keys()]


def _variants(rows: list[Row]) -> tuple[tuple, list[Row], dict[tuple, list[Row]]]:
    """The profiled cells' rows (not the Nsight Systems probe's) by variant, as e2e.split_variants splits them."""
    return split_variants([r for r in rows if r.get("table") in ("cell", "range", "kernel")])


def _main(rows: list[Row]) -> list[dict]:
    """The cells of the variant the report answers from."""
    return _cells(_variants(rows)[1])


def measured(rows: list[Row]) -> list[dict]:
    return _ran(_main(rows))


def when_measured(text: str):
    """`text` where some cell ran to completion, else nothing."""
    return lambda rows: text if measured(rows) else ""


def on_measured(write):
    """A Text's function of the rows that writes `write(cells)` of the cells that ran to completion; nothing where
    none did."""
    @functools.wraps(write)
    def text(rows: list[Row]) -> str:
        cells = measured(rows)
        return write(cells) if cells else ""
    return text


def in_range(name: str, field: str):
    """A cell's `field` of its range `name`."""
    return lambda cell: cell["range"][name][field]


def top_kernel(cell: dict, name: str = "forward") -> Row:
    return cell["kernel"][name][0]


def _shown(cells: list[dict]) -> dict:
    """The cell the kernel tables and the answer show: the largest size at the headline context (else the largest)."""
    at_headline = [c for c in cells if c["context"] == HEADLINE_CONTEXT] or cells
    return max(at_headline, key=lambda c: (size_order(c["size"]), c["context"]))


def _attribution_note(cells: list[dict]) -> str:
    """How kernels were attributed, and the check that none was counted twice, from the rows."""
    excess = [f"{c['size']} at context {c['context']}" for c in cells
              if sum(r["self_work_ms"] for name, r in c["range"].items() if name != FORWARD_BACKWARD)
              > c["range"][STEP_RANGE]["work_ms"] * (1 + 1e-9)]
    return ("Each kernel counts once, in the innermost range open at its launch (a range's table includes those "
            "nested in it); "
            + ("in every cell the ranges' own kernel time adds up to no more than the step's."
               if not excess else f"the ranges' own kernel time exceeds the step's in {', '.join(excess)}."))


def setup(rows: list[Row]) -> str:
    main = _variants(rows)[0]
    cells = _main(rows)
    if not cells:
        return ""
    sample = cells[0]["cell"] or {}
    ran = _ran(cells)
    ooms = [f"{c['size']} at context {c['context']}" + (f" (estimate {format_bytes(c['cell']['predicted_peak_bytes'])}"
                                                       + ("; not run" if c["cell"].get("oom_predicted") else "") + ")"
                                                       if c["cell"].get("predicted_peak_bytes") else "")
            for c in cells if c["cell"] and c["cell"]["status"] == OOM]
    return (f"torch.profiler kernel tables of one training step per cell: {main[0]} attention, {ADAMW_NAMES[main[1]]}, "
            f"{sample.get('precision', 'fp32')}, batch {sample.get('batch_size')}."
            + (" " + _attribution_note(ran) if ran else "") + (f" Out of memory: {', '.join(ooms)}." if ooms else "")
            + "\n" + ("" if ran else "\nNo cell ran to completion.\n"))


def _device(cells: list[dict]) -> str:
    return cells[0]["cell"].get("device", "cuda")


@on_measured
def forward_time_setup(cells: list[dict]) -> str:
    sample = cells[0]["cell"]
    work = "GPU kernel time" if _device(cells) == "cuda" else "operator CPU time"
    return ("## (a) Forward time: profiler against the end-to-end timer\n\n"
            f"Timer: {sample['timer']}, {sample['timed_steps']} steps after {sample['warmup']} warm-up; then one profiled step. "
            f"Forward work: its {work}.\n")


def timer_forward(cell: dict) -> str:
    row = cell["cell"]
    return mean_std(row["timer_forward_ms"], row["timer_forward_std_ms"], ".2f", samples=row.get("timed_steps"))


@on_measured
def forward_time_note(cells: list[dict]) -> str:
    """What the profiled range's wall time is beside the timer's: on a GPU host time, which ends once the host has
    queued the forward's kernels, not when they finish; on a CPU the work itself, with the profiler's overhead."""
    share = span([c["range"]["forward"]["wall_ms"] / c["cell"]["timer_forward_ms"] for c in cells], format_share)
    share += " of the timer's mean"
    if _device(cells) == "cuda":
        return (f"The profiled range is host time, ending once the kernels are queued: {share}. Beyond forward work, "
                "the GPU waited for kernel launches.\n")
    return (f"The profiled range spans {share}, the profiler's overhead included. Beyond forward work, Python and the "
            "dispatcher ran.\n")


def top_over_forward_backward(cell: dict) -> str:
    forward, both = top_kernel(cell), top_kernel(cell, FORWARD_BACKWARD)
    return "same" if forward["kernel"] == both["kernel"] else short_name(both["kernel"], TABLE_NAME_CHARS)


@on_measured
def calls_note(cells: list[dict]) -> str:
    return (f"Calls count launches: a {cells[0]['size']} forward pass runs {7 * cells[0]['cell']['num_layers'] + 1} "
            "matmuls (7 Linears per block and the LM head) plus 2 batched attention matmuls per block.\n")


def main_kernels(rows: list[Row]) -> list[Row]:
    """The forward's non-matmul kernels above MAIN_KERNEL_SHARE, of each size's longest context."""
    longest = {c["size"]: c for c in measured(rows)}
    return [k for c in longest.values() for k in c["kernel"]["forward"]
            if k.get("matmul") is False and k["share"] > MAIN_KERNEL_SHARE]


def no_main_kernel(rows: list[Row]) -> str:
    if not measured(rows) or main_kernels(rows):
        return ""
    return f"No non-matmul kernel reached {MAIN_KERNEL_SHARE:.0%} of forward time in these cells.\n"


@on_measured
def matmul_share_note(cells: list[dict]) -> str:
    lower = sum(c["range"][STEP_RANGE]["matmul_share"] < c["range"]["forward"]["matmul_share"] for c in cells)
    return (f"The full step's share is lower in {lower} of {len(cells)} cells; the optimizer's is "
            f"{span([c['range']['optimizer']['matmul_share'] for c in cells], format_share)}: AdamW is elementwise.\n")


def _ran_attention(cell: dict) -> bool:
    """Whether a cell's profile holds the annotated naive attention's ranges."""
    return all(name in cell["range"] for name in ATTENTION_RANGES)


def attention_cells(rows: list[Row]) -> list[dict]:
    return [c for c in measured(rows) if _ran_attention(c)]


def attention_matmul_ms(cell: dict) -> float:
    return cell["range"]["attention/scores"]["matmul_ms"] + cell["range"]["attention/final_matmul"]["matmul_ms"]


def softmax_flop_ratio(cell: dict) -> float:
    """Softmax's FLOPs over the attention matmuls': per score, SOFTMAX_FLOPS_PER_SCORE against 4 d_head."""
    return SOFTMAX_FLOPS_PER_SCORE / (4 * cell["cell"]["d_head"])


def softmax_time_ratio(cell: dict) -> float | None:
    """Softmax's time over the attention matmuls' in a cell that ran the annotated attention; None where its profile
    holds no matmul time there, which leaves no ratio to take. The report and the index's answer both read it, so
    they leave out the same cells."""
    matmul_ms = attention_matmul_ms(cell)
    return cell["range"]["attention/softmax"]["work_ms"] / matmul_ms if matmul_ms > 0 else None


def time_over_flop_ratio(cell: dict) -> str:
    time_ratio = softmax_time_ratio(cell)
    return NOT_A_NUMBER if time_ratio is None else f"{time_ratio / softmax_flop_ratio(cell):.0f}x"


@on_measured
def attention_setup(cells: list[dict]) -> str:
    heading = "## (e) Softmax against matmul inside attention\n\n"
    if not any(map(_ran_attention, cells)):
        return heading + "No cell ran the annotated naive attention.\n"
    return (heading + f"FLOPs per score: 4 d_head in the matmuls (q k^T, P v), about {SOFTMAX_FLOPS_PER_SCORE} in "
            "softmax (max, subtract, exp, sum, divide).\n")


def attention_finding(rows: list[Row]) -> str:
    cells = attention_cells(rows)
    if not cells:
        return ""
    excess = [time_ratio / softmax_flop_ratio(c) for c in cells if (time_ratio := softmax_time_ratio(c)) is not None]
    if not excess:
        return "No cell's profile holds matmul time inside attention: there is no ratio to take.\n"
    without_matmul = len(cells) - len(excess)
    left_out = (f" ({plural(without_matmul, 'cell')} without matmul time in attention left out)"
                if without_matmul else "")
    return (f"Softmax's time is {span(excess, '{:.0f}x'.format)} its FLOP share{left_out}" + (
        ": under 1 FLOP per byte, it waits on memory; the matmuls, at about d_head / 2, on arithmetic.\n"
        if min(excess) > 1 else "; in some cells no more.\n"))


def beside_variants(rows: list[Row]) -> list[Row]:
    """Other variants' cells beside the course model's at the same size and context."""
    main, mine, others = _variants(rows)
    ours = {(c["size"], c["context"]): c for c in _ran(_cells(mine))}
    table = []
    for other, their_rows in others.items():
        for theirs in _ran(_cells(their_rows)):
            cell = ours.get((theirs["size"], theirs["context"]))
            if cell is None:
                continue
            entry = {"size": theirs["size"], "context": theirs["context"]}
            for label, c in ((variant_column_label(main), cell), (variant_column_label(other), theirs)):
                entry[f"{label}: step (ms)"] = mean_std(c["cell"]["timer_step_ms"], c["cell"]["timer_step_std_ms"],
                                                        ".1f", samples=c["cell"].get("timed_steps"))
                entry[f"{label}: optimizer (ms)"] = f"{c['cell']['timer_optimizer_ms']:.1f}"
                entry[f"{label}: forward matmul share"] = format_share(c["range"]["forward"]["matmul_share"])
            table.append(entry)
    return table


def beside_variants_heading(rows: list[Row]) -> str:
    if not beside_variants(rows):
        return ""
    others = _variants(rows)[2]
    return f"## Beside {listing([variant_label(v) for v in others])}\n\nTheir kernel tables are in the CSV.\n"


@on_measured
def kernel_tables_heading(cells: list[dict]) -> str:
    shown = _shown(cells)
    return (f"## Kernel tables: {shown['size']} at context {shown['context']}\n\nThe other cells' tables are in the "
            "CSV.\n")


def kernels_of(name: str):
    """The kernel table of range `name` in the shown cell."""
    def kernels(rows: list[Row]) -> list[Row]:
        cells = measured(rows)
        return _shown(cells)["kernel"].get(name, []) if cells else []
    return kernels


def range_heading(name: str):
    return lambda rows: f"### {name}\n" if kernels_of(name)(rows) else ""


def nsys_section(probes: list[Row]) -> str:
    r = probes[-1]
    outcome = r["nsys_report"]
    if outcome == "written":
        state = "Nsight Systems wrote a report of a CUDA program on the measuring machine."
    else:
        state = (f"Nsight Systems cannot make reports on the measuring machine ({outcome}): the tables above are "
                 "torch.profiler's (CUPTI).")
    return f"## Nsight Systems\n\n{state} Where it can, this shows the same NVTX ranges:\n\n```\n{r['command']}\n```\n"


# ---------------------------------------------------------------------------------------------- answers

def answer_nsys_profile(reports: Reports) -> list[str]:
    rows = reports["nsys_profile"]
    cells = measured(rows)
    if not cells:
        return [not_in_report("A profiled cell that ran to completion")]
    shown = _shown(cells)
    size, context, sample = shown["size"], shown["context"], shown["cell"]
    ooms = [f"{r['size']} at context {r['context_length']}" for r in select(_variants(rows)[1], table="cell",
                                                                           status=OOM)]
    forward_kernels = shown["kernel"].get("forward", [])
    sentences = []
    if forward_kernels:
        top = forward_kernels[0]
        other = next((k for k in forward_kernels if k.get("matmul") is False), None)
        sentences.append(
            f"Kernel tables from torch.profiler ({sample['attention']} attention, "
            f"{ADAMW_NAMES[sample['optimizer']]}, {sample['precision']}, batch "
            f"{sample['batch_size']}); at {size}, context {context}, the top forward kernel is "
            f"`{short_name(top['kernel'], ANSWER_NAME_CHARS)}` ({'a matmul, ' if top.get('matmul') else ''}"
            f"{top['share']:.1%} of forward kernel time, {top['calls_per_instance']:g} launches per forward pass)"
            + (f" and the largest non-matmul one `{short_name(other['kernel'], ANSWER_NAME_CHARS)}` "
               f"({other['share']:.1%})" if other else "")
            + (f"; out of memory: {listing(ooms)}." if ooms else "."))
    else:
        sentences.append(not_in_report(f"The forward kernel table of {size} at context {context}"))
    forward_shares = [c["range"]["forward"]["matmul_share"] for c in cells]
    step_shares = [c["range"][STEP_RANGE]["matmul_share"] for c in cells]
    sentences.append(
        f"Matmuls take {format_share(shown['range']['forward']['matmul_share'])} of forward kernel time and "
        f"{format_share(shown['range'][STEP_RANGE]['matmul_share'])} of the full training step there "
        f"({span(forward_shares, format_share)} and {span(step_shares, format_share)} over the "
        f"{plural(len(cells), 'profiled cell')})"
        + (f"; the optimizer's share is {format_share(shown['range']['optimizer']['matmul_share'])}."
           if "optimizer" in shown["range"] else "."))
    attention = attention_cells(rows)
    ratios = {(c["size"], c["context"]): (time_ratio, softmax_flop_ratio(c)) for c in attention
              if (time_ratio := softmax_time_ratio(c)) is not None}
    if (size, context) in ratios:
        time_ratio, flop_ratio = ratios[(size, context)]
        over_cells = span([t / f for t, f in ratios.values()], "{:.0f}x".format)
        left_out = len(attention) - len(ratios)
        sentences.append(
            f"Inside attention softmax takes {time_ratio:.2f}x the matmuls' time against {flop_ratio:.2%} of their "
            f"FLOPs, {time_ratio / flop_ratio:.0f}x its FLOP share ({over_cells} over the cells"
            + (f"; {plural(left_out, 'cell')} without matmul time in attention left out" if left_out else "")
            + "): it is paced by memory traffic, not arithmetic.")
    elif _ran_attention(shown):
        sentences.append(f"Inside attention at {size}, context {context}, the profile holds no matmul time: there is "
                         "no ratio of softmax's time to take.")
    else:
        sentences.append(not_in_report(f"The attention ranges (scores, softmax, final matmul) of {size} at context "
                                        f"{context}"))
    return sentences
