"""The reports of naive attention: pytorch_attention (timings and memory by head dimension and sequence
length, the cells that run out of memory, the closed-form memory accounting against measurement) and the
attention part of torch_compile (eager against compiled, beside the whole model's part from
cs336_systems.reports.e2e), with their answers. The package's benchmarks/attention.py measures them.
"""

from __future__ import annotations

import math
import statistics

from cs336_systems.accounting.attention import naive_attention_memory
from cs336_systems.gpus import GIB
from cs336_systems.reports import (
    NOT_RUN,
    UNPAIRED,
    Rendered,
    Reports,
    SpeedUps,
    e2e,
    format_bytes,
    format_ms,
    is_noisy,
    markdown_table,
    mean_std,
    not_in_report,
    plural,
    runs_text,
    same_run,
    select,
    span,
    speedup_text,
)
from cs336_systems.reports.e2e import latest_cells
from cs336_systems.rows import OOM, TORCH_COMPILE_KEY, Row, ok_rows

LOGSUMEXP_BYTES = 4  # FlashAttention keeps one fp32 logsumexp per query row
COUNTS = {3: "three", 4: "four"}  # the score matrices at the backward's peak, as the accounting names them


def _ms(row: Row, phase: str) -> str:
    if row.get(f"{phase}_mean_ms") is not None:
        return mean_std(row[f"{phase}_mean_ms"], row[f"{phase}_std_ms"], ".3g", ".2g")
    return OOM if row.get("status") == OOM else ""


def oom_when(row: Row) -> str:
    """When a cell ran out of memory: predicted (and not run), or the stage that ran out."""
    return NOT_RUN if row.get("oom_predicted") else f"during {row['oom_during']}"


def _gib_cell(value) -> str:
    return "" if value is None else f"{value / GIB:.3g}"


def _by_cell(rows: list[Row]) -> list[Row]:
    return sorted(rows, key=lambda r: (r["head_dim"], r["seq_len"]))


def _setup(rows: list[Row]) -> str:
    r = rows[0]
    mask = "causal" if r["is_causal"] else "no mask"
    return (f"Naive attention on q, k, v of shape ({r['batch_size']}, N, d), {r['precision']}, {mask}, "
            f"random normal; per cell {r['warmup']} untimed and {r['passes']} timed "
            "passes of forward, then of backward (each after its own untimed forward), synchronised around each; "
            "mean ± std in ms.")


def _memory_note(rows: list[Row]) -> str:
    if _memory_measured(rows):
        return ("Memory before backward: torch.cuda.memory_allocated after the forward (q, k, v, dO, output, "
                "saved tensors).")
    return "Memory is not measured on this device (no CUDA allocator statistics); predicted is the closed form."


def _memory_measured(rows: list[Row]) -> bool:
    return any(r.get("memory_before_backward_bytes") is not None for r in rows)


def _timing_table(rows: list[Row]) -> str:
    table = []
    for r in _by_cell(rows):
        entry = {"d": r["head_dim"], "N": r["seq_len"], "forward (ms)": _ms(r, "forward"),
                 "backward (ms)": _ms(r, "backward")}
        if _memory_measured(rows):
            entry["before backward (GiB)"] = _gib_cell(r.get("memory_before_backward_bytes"))
        entry["predicted (GiB)"] = _gib_cell(_memory_of(r).before_backward_bytes)
        entry["out of memory"] = oom_when(r) if r["status"] == OOM else ""
        table.append(entry)
    return markdown_table(table)


def _exponent(n_small: int, small: float, n_large: int, large: float) -> float:
    """The power of N that takes a quantity from `small` at n_small to `large` at n_large."""
    return math.log(large / small) / math.log(n_large / n_small)


def _retained(row: Row) -> float | None:
    """Bytes the forward added: memory before backward minus what was allocated before the forward."""
    if row.get("memory_before_backward_bytes") is None or row.get("allocated_before_forward_bytes") is None:
        return None
    return row["memory_before_backward_bytes"] - row["allocated_before_forward_bytes"]


def _scaling_findings(rows: list[Row]) -> list[str]:
    measured = any(_retained(r) for r in rows)
    label = "the memory the forward leaves for backward" + \
        ("" if measured else " (predicted, not measured on this device)")

    def saved(row: Row) -> float | None:
        return _retained(row) if measured else _memory_of(row).retained_bytes

    # The exponent between each head dim's two largest N, one line per such pair of N.
    exponents: dict[tuple[int, int], list[str]] = {}
    for d in sorted({r["head_dim"] for r in rows}):
        line = sorted((r for r in rows if r["head_dim"] == d and saved(r)), key=lambda r: r["seq_len"])
        if len(line) >= 2:
            small, large = line[-2], line[-1]
            exponent = _exponent(small["seq_len"], saved(small), large["seq_len"], saved(large))
            exponents.setdefault((small["seq_len"], large["seq_len"]), []).append(f"{exponent:.2f} (d={d})")
    findings = [f"- From N={small} to {large}, {label} grows as N to the power {', '.join(per_d)}."
                for (small, large), per_d in exponents.items()]
    by_n: dict[int, dict[int, float]] = {}
    for r in rows:
        if saved(r):
            by_n.setdefault(r["seq_len"], {})[r["head_dim"]] = saved(r)
    common = [n for n, per_d in by_n.items() if len(per_d) == len({r["head_dim"] for r in rows}) and len(per_d) > 1]
    if common:
        n = max(common)
        low, high = min(by_n[n]), max(by_n[n])
        findings.append(f"- At N={n}, d={high} leaves {by_n[n][high] / by_n[n][low]:.3g}x d={low}'s memory: "
                        "the N x N matrix does not depend on d.")
    timed_rows = [r for r in rows if r.get("forward_mean_ms") and r.get("backward_mean_ms")]
    steady = [r for r in timed_rows if not _noisy(r)]
    if steady:
        ratios = [r["backward_mean_ms"] / r["forward_mean_ms"] for r in steady]
        left_out = len(timed_rows) - len(steady)
        findings.append(f"- Backward takes {min(ratios):.2g}x to {max(ratios):.2g}x the forward's time "
                        f"(median {statistics.median(ratios):.2g}x, {plural(len(ratios), 'cell')}"
                        + (f"; {plural(left_out, 'noisy cell')} left out)." if left_out else ")."))
        largest_d = max(r["head_dim"] for r in timed_rows)
        line = sorted((r for r in timed_rows if r["head_dim"] == largest_d), key=lambda r: r["seq_len"])
        if len(line) >= 2:
            small, large = line[-2], line[-1]
            exponent = _exponent(small["seq_len"], small["forward_mean_ms"], large["seq_len"], large["forward_mean_ms"])
            findings.append(f"- Forward time at d={largest_d} grows as N to the power {exponent:.2f} "
                            f"(N={small['seq_len']} to {large['seq_len']}).")
    return findings


def _noisy(row: Row) -> bool:
    """Whether either of a cell's times is marked noisy in the table."""
    return any(row.get(f"{phase}_mean_ms") is not None and is_noisy(row[f"{phase}_mean_ms"], row[f"{phase}_std_ms"])
               for phase in ("forward", "backward"))


def _memory_of(row: Row):
    return naive_attention_memory(row["batch_size"], row["seq_len"], row["seq_len"], row["head_dim"],
                                  row["precision"], row["is_causal"], row.get("device") or "cuda")


def _first_predicted_oom(rows: list[Row]) -> Row | None:
    """When no measured cell ran out of memory: the smallest configuration the closed form says would
    not fit (the smallest head dim, N doubled past the largest measured), or None if the device's
    memory size is unknown."""
    capacity = next((r["device_memory_bytes"] for r in rows if r.get("device_memory_bytes")), None)
    if capacity is None:
        return None
    candidate = {**min(rows, key=lambda r: r["head_dim"]), "seq_len": max(r["seq_len"] for r in rows),
                 "memory_before_backward_bytes": None}
    while _memory_of(candidate).peak_bytes <= capacity:
        candidate["seq_len"] *= 2
    return candidate


def _accounting_target(rows: list[Row]) -> tuple[Row, str]:
    """The configuration to account for, and a sentence saying why it was chosen."""
    ooms = [r for r in rows if r["status"] == OOM]
    if ooms:
        target = min(ooms, key=lambda r: _memory_of(r).peak_bytes)
        return target, (f"The smallest configuration that ran out of memory is d={target['head_dim']}, "
                        f"N={target['seq_len']} ({oom_when(target)}).")
    target = _first_predicted_oom(rows)
    if target is not None:
        return target, (f"No configuration ran out of memory on this device "
                        f"({target['device_memory_bytes'] / GIB:.3g} GiB). The smallest that the accounting says "
                        f"would not fit is d={target['head_dim']}, N={target['seq_len']} (not run).")
    target = max(rows, key=lambda r: _memory_of(r).peak_bytes)
    return target, (f"No configuration ran out of memory, and this device's memory is not measured; the accounting "
                    f"of the largest, d={target['head_dim']}, N={target['seq_len']}.")


def _accounting_section(rows: list[Row]) -> str:
    target, intro = _accounting_target(rows)
    memory = _memory_of(target)
    breakdown = [{"tensor": b["tensor"], "shape": b["shape"], "GiB": f"{b['bytes'] / GIB:.4g}", "note": b["note"]}
                 for b in memory.breakdown()]
    capacity = target.get("device_memory_bytes")
    totals = [("before backward: q, k, v, dO, O and what autograd saved", memory.before_backward_bytes,
               target.get("memory_before_backward_bytes")),
              ("forward peak: two score matrices (the last S, and P) and O", memory.forward_peak_bytes, None),
              (f"backward peak: {COUNTS[memory.backward_peak_score_matrices]} score matrices (P, dP, dS"
               + (", dP * P" if memory.backward_peak_score_matrices == 4 else "") + "), O and dv",
               memory.backward_peak_bytes, None)]
    total_rows = [{"total": name, "predicted (GiB)": f"{predicted / GIB:.4g}", "measured (GiB)": _gib_cell(measured),
                   "share of device memory": f"{predicted / capacity:.0%}" if capacity else ""}
                  for name, predicted, measured in totals]
    lse_bytes = target["batch_size"] * target["seq_len"] * LOGSUMEXP_BYTES
    return "\n".join([
        f"## Memory accounting\n\n{intro}\n",
        markdown_table(breakdown),
        markdown_table(total_rows),
        f"Backward saves the softmax output P, {memory.scores_bytes / GIB:.3g} GiB here (B·N²·"
        f"{memory.element_bytes} bytes): softmax's gradient uses its output, and P @ v needs P for dv. P grows as "
        f"N², q, k, v and O as N: P is {memory.scores_bytes / memory.query_sized_bytes:,.0f}x O.\n",
        f"To remove this cost, store only each query row's logsumexp L ({lse_bytes / 2**20:.3g} MiB here, fp32) "
        "and recompute P tile by tile in the backward, as FlashAttention-2 does: memory linear in N "
        "(flash_benchmarking report).\n",
    ])


def _validation_section(rows: list[Row]) -> str:
    measured = [r for r in _by_cell(rows) if r.get("backward_peak_bytes") is not None]
    if not measured:
        return ""
    table, added_ratios, backward_ratios = [], [], []
    for r in measured:
        memory = _memory_of(r)
        held = r["allocated_before_forward_bytes"]  # q, k, v, dO and cuBLAS workspaces
        added_ratios.append((r["seq_len"], _retained(r) / memory.retained_bytes))
        backward_ratios.append((r["seq_len"], (r["backward_peak_bytes"] - held)
                                / (memory.backward_peak_bytes - memory.caller_bytes)))
        table.append({
            "d": r["head_dim"], "N": r["seq_len"],
            "added by forward: measured (GiB)": _gib_cell(_retained(r)),
            "predicted (GiB)": _gib_cell(memory.retained_bytes),
            "forward peak: measured / predicted":
                f"{(r['forward_peak_bytes'] - held) / (memory.forward_peak_bytes - memory.caller_bytes):.3f}",
            "backward peak: measured / predicted":
                f"{(r['backward_peak_bytes'] - held) / (memory.backward_peak_bytes - memory.caller_bytes):.3f}",
        })
    largest = max(n for n, _ in added_ratios)
    at_largest = [ratio for n, ratio in added_ratios if n == largest]
    return "\n".join([
        "## Accounting against measurement\n\nEach measured cell, above what was allocated before the forward "
        "(q, k, v, dO, cuBLAS workspaces; not in the closed form).\n",
        markdown_table(table),
        f"At N={largest} the forward's added memory is {span(at_largest, '{:.3f}x'.format)} the prediction, the "
        f"backward peak {span([ratio for n, ratio in backward_ratios if n == largest], '{:.3f}x'.format)}; at small "
        "N, cuBLAS workspaces and "
        "allocator rounding weigh more than the score matrices.\n",
    ])


def _memory_plot(rows: list[Row]):
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4.5))
    axes = figure.subplots()
    colors = {}
    for d in sorted({r["head_dim"] for r in rows}):
        line = sorted((r for r in rows if r["head_dim"] == d), key=lambda r: r["seq_len"])
        shown = [r for r in line if r.get("memory_before_backward_bytes") is not None]
        if shown:
            (plotted,) = axes.plot([r["seq_len"] for r in shown],
                                   [r["memory_before_backward_bytes"] / GIB for r in shown],
                                   marker="o", label=f"d={d}, measured")
            colors[d] = plotted.get_color()
        axes.plot([r["seq_len"] for r in line], [_memory_of(r).before_backward_bytes / GIB for r in line],
                  linestyle="--", color=colors.get(d), label=f"d={d}, predicted")
    capacity = next((r["device_memory_bytes"] for r in rows if r.get("device_memory_bytes")), None)
    if capacity:
        axes.axhline(capacity / GIB, color="gray", linestyle=":", label="device memory")
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.set_xlabel("sequence length N")
    axes.set_ylabel("memory before backward (GiB)")
    axes.set_title("Naive attention: memory in use before backward")
    axes.legend(fontsize="small")
    return figure


def _oom_text(rows: list[Row]) -> str:
    """Where naive attention first ran out of memory, per head dimension, read from the table's rows, and
    whether the accounting predicted each cell's outcome."""
    ooms = _by_cell([r for r in rows if r["status"] == OOM])
    sentences = []  # with no OOM, the table's out-of-memory column and the accounting section say so
    if ooms:
        sentences.append(
            "Out of memory: " + ", ".join(f"d={r['head_dim']} N={r['seq_len']} (during {r['oom_during']})"
                                          for r in ooms) +
            f". The smallest sequence length that ran out is N={min(r['seq_len'] for r in ooms)}: " + "; ".join(
                f"d={d} from N={min(r['seq_len'] for r in ooms if r['head_dim'] == d)}"
                for d in sorted({r["head_dim"] for r in ooms})) + ".")
    capacity = next((r["device_memory_bytes"] for r in rows if r.get("device_memory_bytes")), None)
    if capacity is not None:
        # A cell that ran must be predicted to fit and a cell that ran out predicted not to.
        wrong = [r for r in _by_cell(rows) if (r["status"] == OOM) != (_memory_of(r).peak_bytes > capacity)]
        if not wrong:
            sentences.append(f"The accounting agrees with the run on which cells fit in {capacity / GIB:.3g} GiB.")
        else:
            sentences.append("The accounting's peak disagrees with the run for " + ", ".join(
                f"d={r['head_dim']} N={r['seq_len']} ({'ran' if r['status'] != OOM else 'out of memory'}, predicted "
                f"{_memory_of(r).peak_bytes / GIB:.3g} GiB of {capacity / GIB:.3g})" for r in wrong) + ".")
    return " ".join(sentences)


def render_pytorch_attention(rows: list[Row]) -> Rendered:
    rows = [r for r in rows if not r.get("compile")]
    if not rows:
        return Rendered("")
    oom_text = _oom_text(rows)
    findings = "\n".join(_scaling_findings(rows))
    return Rendered("\n".join([
        f"## Timings and memory\n\n{_setup(rows)} {_memory_note(rows)}\n",
        _timing_table(rows),
        "\n\n".join(filter(None, (oom_text, findings))) + "\n",
        _accounting_section(rows),
        _validation_section(rows),
        "![memory before backward against N](pytorch_attention_memory.png)\n",
    ]), figures={"pytorch_attention_memory.png": _memory_plot(rows)})


# ------------------------------------------------------------------------------ torch_compile (part)

def _compiled_pairs(rows: list[Row]) -> dict[tuple[int, int], dict[bool, Row]]:
    """(d, N) -> that cell's rows by whether attention was compiled."""
    pairs: dict[tuple[int, int], dict[bool, Row]] = {}
    for r in _by_cell(rows):
        pairs.setdefault((r["head_dim"], r["seq_len"]), {})[bool(r["compile"])] = r
    return pairs


def _both_timed(eager: Row | None, compiled: Row | None, phase: str) -> bool:
    return bool(eager and compiled and eager.get(f"{phase}_mean_ms") and compiled.get(f"{phase}_mean_ms"))


def _paired(eager: Row | None, compiled: Row | None, phase: str) -> bool:
    """Whether a cell's eager and compiled times of `phase` are compared: both timed, in one run."""
    return _both_timed(eager, compiled, phase) and same_run(eager, compiled)


def _timed_both_ways(pair: dict[bool, Row]) -> bool:
    """Whether a cell has an eager and a compiled time of either phase, in whichever runs."""
    return any(_both_timed(pair.get(False), pair.get(True), phase) for phase in ("forward", "backward"))


def _unpaired(pairs: dict[tuple[int, int], dict[bool, Row]]) -> list[dict[bool, Row]]:
    """The cells timed both eager and compiled, but in different runs: no speed-up is read from them."""
    return [pair for pair in pairs.values() if _timed_both_ways(pair) and not same_run(pair[False], pair[True])]


# Times eager and compiled attention in one run, which pairs them.
PAIRING_COMMAND = "pytest perf/test_attention.py -m attention"


def compiled_attention_speedups(rows: list[Row]) -> dict[str, SpeedUps]:
    """Phase -> how much faster compiled attention ran than eager, over the cells where both were timed in one
    run: the report's findings and the index's answer read this one computation."""
    pairs = _compiled_pairs(rows)
    return {phase: SpeedUps.of(((p[False], p[True], f"d={d}, N={n}") for (d, n), p in pairs.items()
                                if _paired(p.get(False), p.get(True), phase)), prefix=f"{phase}_")
            for phase in ("forward", "backward")}


def _compiled_attention_section(rows: list[Row]) -> str:
    pairs = _compiled_pairs(rows)
    table = []
    for (d, n), pair in pairs.items():
        eager, compiled = pair.get(False), pair.get(True)
        entry = {"d": d, "N": n}
        for phase in ("forward", "backward"):
            entry[f"{phase} eager (ms)"] = _ms(eager, phase) if eager else ""
            entry[f"{phase} compiled (ms)"] = _ms(compiled, phase) if compiled else ""
            entry[f"{phase} speed-up"] = (speedup_text(eager, compiled, prefix=f"{phase}_")
                                          if _paired(eager, compiled, phase) else
                                          UNPAIRED if _both_timed(eager, compiled, phase) else "")
        if _memory_measured(rows):
            for label, r in (("eager", eager), ("compiled", compiled)):
                entry[f"before backward, {label} (GiB)"] = _gib_cell(r.get("memory_before_backward_bytes")) if r else ""
        first_ms = [compiled.get(f"first_{phase}_ms") for phase in ("forward", "backward")] if compiled else [None]
        entry["compiled: first fwd+bwd (s)"] = f"{sum(first_ms) / 1e3:.2g}" if None not in first_ms else ""
        table.append(entry)
    findings = []
    for phase, speedups in compiled_attention_speedups(rows).items():
        if speedups.ratios:
            details = speedups.details()
            findings.append(f"- {phase}: compiled runs {speedups.range_text(with_cells=True)} as fast as eager"
                            + (f" ({details})." if details else "."))
        elif speedups.noisy:
            findings.append(f"- {phase}: every cell is noisy, so no speed-up is read from them.")
    unpaired = _unpaired(pairs)
    if unpaired:
        timed = sum(map(_timed_both_ways, pairs.values()))
        eager_runs, compiled_runs = (runs_text(pair[compiled] for pair in unpaired) for compiled in (False, True))
        which = "Every cell" if len(unpaired) == len(pairs) else f"{len(unpaired)} of the {timed} cells timed both ways"
        findings.append(f"- {which} ran eager ({eager_runs}) and compiled ({compiled_runs}) in different runs, so no "
                        f"speed-up is read from them; `{PAIRING_COMMAND}`, compiled included, times both in one run.")
    for (d, n), pair in pairs.items():
        if len(pair) == 2 and {pair[False]["status"], pair[True]["status"]} == {"ok", OOM}:
            ran = "compiled" if pair[True]["status"] == "ok" else "eager"
            findings.append(f"- d={d}, N={n}: only {ran} attention fits in memory.")
    return "\n".join([
        f"## Attention: eager against torch.compile\n\n{_setup(rows)} Compiled cells compile afresh with static "
        "shapes; compiling passes are untimed. Speed-up: eager's mean over compiled's.\n",
        markdown_table(table),
        "\n".join(findings) + "\n" if findings else "",
    ])


def render_torch_compile(rows: list[Row]) -> Rendered:
    """The attention sweep (rows with table "attention"), then the whole-model part rendered by e2e."""
    rows = latest_cells(rows, TORCH_COMPILE_KEY)
    attention_rows = [r for r in rows if r.get("table") == "attention"]
    model = e2e.render_compiled_models(rows)
    parts = [_compiled_attention_section(attention_rows) if attention_rows else "", model.body]
    return Rendered("\n".join(p for p in parts if p), figures=model.figures)


# ---------------------------------------------------------------------------------------------- answers

def answer_torch_compile(reports: Reports) -> list[str]:
    rows = latest_cells(reports["torch_compile"], TORCH_COMPILE_KEY)
    sentences = e2e.answer_compiled_models(rows)
    attention = [r for r in select(rows, table="attention") if r.get("status") == "ok"]
    speedups = compiled_attention_speedups(attention)
    parts = [f"{phase} {s.summary()}" for phase, s in speedups.items() if s.summary()]
    pairs = _compiled_pairs(attention)
    unpaired = len(_unpaired(pairs))
    left_out = f"; {unpaired} more ran eager and compiled in different runs and are left out" if unpaired else ""
    if parts:
        paired = sum(map(_timed_both_ways, pairs.values())) - unpaired
        sentences.append(f"Naive attention alone, compiled over eager ({plural(paired, 'cell')}{left_out}): "
                         + ", ".join(parts) + ".")
    elif unpaired:
        sentences.append(f"Naive attention alone: its {plural(unpaired, 'cell')} ran eager and compiled in different "
                         f"runs, so no speed-up is read from them; `{PAIRING_COMMAND}` times both in one run.")
    else:
        sentences.append(not_in_report("The attention sweep compiled against eager (rows of table `attention`, "
                                        "which the `-m attention` perf run writes)"))
    return sentences


def answer_pytorch_attention(reports: Reports) -> list[str]:
    rows = [r for r in reports["pytorch_attention"] if not r.get("compile")]
    if not rows:
        return [not_in_report("An eager attention cell")]
    r0 = rows[0]
    timed = [r for r in ok_rows(rows) if r.get("backward_mean_ms") is not None]
    sentences = []
    if timed:
        largest = max(timed, key=lambda r: (r["seq_len"], r["head_dim"]))
        memory = largest.get("memory_before_backward_bytes")
        sentences.append(
            f"Naive attention, batch {r0['batch_size']}, {r0['precision']}, {r0['passes']} passes each: the largest "
            f"cell that ran, d={largest['head_dim']}, N={largest['seq_len']}, takes "
            f"{format_ms(largest['forward_mean_ms'])} forward and {format_ms(largest['backward_mean_ms'])} backward"
            + (f" with {format_bytes(memory, 'bytes')} in use before backward." if memory is not None else "."))
    ooms = select(rows, status=OOM)
    if ooms:
        ooms.sort(key=lambda r: (r["seq_len"], r["head_dim"]))
        smallest = ooms[0]
        at_first = select(ooms, seq_len=smallest["seq_len"])
        text = f"Out of memory from N={smallest['seq_len']} (" + ", ".join(
            f"d={r['head_dim']} {oom_when(r)}" for r in at_first) + ")"
        if smallest.get("predicted_before_backward_bytes") is not None:
            text += (f"; the closed-form accounting puts d={smallest['head_dim']}, N={smallest['seq_len']} at "
                     f"{format_bytes(smallest['predicted_before_backward_bytes'], 'bytes')} in use before backward and "
                     f"{format_bytes(smallest['predicted_backward_peak_bytes'], 'bytes')} at the backward's peak")
            if smallest.get("device_memory_bytes"):
                text += f", against {format_bytes(smallest['device_memory_bytes'], 'bytes')} of device memory"
        sentences.append(text + ".")
    else:
        sentences.append(f"No configuration ran out of memory, up to N={max(r['seq_len'] for r in rows)}.")
    return sentences
