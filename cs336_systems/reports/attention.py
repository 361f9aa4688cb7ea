"""The answers of naive attention's reports: pytorch_attention (timings and memory by head dimension and sequence
length, the cells that run out of memory, the closed-form memory accounting against measurement) and the attention
part of torch_compile (eager against compiled, beside the whole model's part, whose text is
cs336_systems.reports.e2e's). Their tables and plot are declared in cs336_systems.reports.problems; the package's
benchmarks/attention.py measures them.
"""

from __future__ import annotations

import math
import statistics

from cs336_systems.accounting.attention import naive_attention_memory
from cs336_systems.gpus import GIB
from cs336_systems.reports import (
    NOT_RUN,
    UNPAIRED,
    Reports,
    SpeedUps,
    e2e,
    format_bytes,
    format_ms,
    is_noisy,
    mean_std,
    not_in_report,
    plural,
    runs_text,
    select,
    span,
    speedup_text,
)
from cs336_systems.reports.e2e import latest_cells
from cs336_systems.rows import OOM, TORCH_COMPILE_KEY, Row, ok_rows
from cs336_systems.runs import same_run

LOGSUMEXP_BYTES = 4  # FlashAttention keeps one fp32 logsumexp per query row
COUNTS = {3: "three", 4: "four"}  # the score matrices at the backward's peak, as the accounting names them
PHASES = ("forward", "backward")


def ms(phase: str):
    """A cell's time of `phase`, mean ± std in ms; OOM where it ran out of memory."""
    def cell(row: Row | None) -> str:
        if row is not None and row.get(f"{phase}_mean_ms") is not None:
            return mean_std(row[f"{phase}_mean_ms"], row[f"{phase}_std_ms"], ".3g", ".2g")
        return OOM if row is not None and row.get("status") == OOM else ""
    return cell


def oom_when(row: Row) -> str:
    """When a cell ran out of memory: predicted (and not run), or the stage that ran out."""
    return NOT_RUN if row.get("oom_predicted") else f"during {row['oom_during']}"


def gib(value: float | None) -> str | None:
    return None if value is None else f"{value / GIB:.3g}"


def cell_order(row: Row) -> tuple[int, int]:
    return row["head_dim"], row["seq_len"]


def memory_of(row: Row):
    return naive_attention_memory(row["batch_size"], row["seq_len"], row["seq_len"], row["head_dim"],
                                  row["precision"], row["is_causal"], row.get("device") or "cuda")


def capacity(rows: list[Row]) -> int | None:
    """The device's memory, where the rows measured it."""
    return next((r["device_memory_bytes"] for r in rows if r.get("device_memory_bytes")), None)


def _setup(rows: list[Row]) -> str:
    r = rows[0]
    mask = "causal" if r["is_causal"] else "no mask"
    return (f"Naive attention on q, k, v of shape ({r['batch_size']}, N, d), {r['precision']}, {mask}, "
            f"random normal; per cell {r['warmup']} untimed and {r['passes']} timed "
            "passes of forward, then of backward (each after its own untimed forward), synchronised around each; "
            "mean ± std in ms.")


def timings_setup(rows: list[Row]) -> str:
    if any(r.get("memory_before_backward_bytes") is not None for r in rows):
        memory = ("Memory before backward: torch.cuda.memory_allocated after the forward (q, k, v, dO, output, "
                  "saved tensors).")
    else:
        memory = "Memory is not measured on this device (no CUDA allocator statistics); predicted is the closed form."
    return f"## Timings and memory\n\n{_setup(rows)} {memory}\n"


def _exponent(n_small: int, small: float, n_large: int, large: float) -> float:
    """The power of N that takes a quantity from `small` at n_small to `large` at n_large."""
    return math.log(large / small) / math.log(n_large / n_small)


def retained(row: Row) -> float | None:
    """Bytes the forward added: memory before backward minus what was allocated before the forward."""
    if row.get("memory_before_backward_bytes") is None or row.get("allocated_before_forward_bytes") is None:
        return None
    return row["memory_before_backward_bytes"] - row["allocated_before_forward_bytes"]


def _scaling_findings(rows: list[Row]) -> list[str]:
    measured = any(retained(r) for r in rows)
    label = "the memory the forward leaves for backward" + \
        ("" if measured else " (predicted, not measured on this device)")

    def saved(row: Row) -> float | None:
        return retained(row) if measured else memory_of(row).retained_bytes

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
               for phase in PHASES)


def _oom_text(rows: list[Row]) -> str:
    """Where naive attention first ran out of memory, per head dimension, and whether the accounting predicted each
    cell's outcome."""
    ooms = sorted((r for r in rows if r["status"] == OOM), key=cell_order)
    sentences = []  # with no OOM, the table's out-of-memory column and the accounting section say so
    if ooms:
        sentences.append(
            "Out of memory: " + ", ".join(f"d={r['head_dim']} N={r['seq_len']} (during {r['oom_during']})"
                                          for r in ooms) +
            f". The smallest sequence length that ran out is N={min(r['seq_len'] for r in ooms)}: " + "; ".join(
                f"d={d} from N={min(r['seq_len'] for r in ooms if r['head_dim'] == d)}"
                for d in sorted({r["head_dim"] for r in ooms})) + ".")
    device = capacity(rows)
    if device is not None:
        # A cell that ran must be predicted to fit and a cell that ran out predicted not to.
        wrong = [r for r in sorted(rows, key=cell_order) if (r["status"] == OOM) != (memory_of(r).peak_bytes > device)]
        if not wrong:
            sentences.append(f"The accounting agrees with the run on which cells fit in {device / GIB:.3g} GiB.")
        else:
            sentences.append("The accounting's peak disagrees with the run for " + ", ".join(
                f"d={r['head_dim']} N={r['seq_len']} ({'ran' if r['status'] != OOM else 'out of memory'}, predicted "
                f"{memory_of(r).peak_bytes / GIB:.3g} GiB of {device / GIB:.3g})" for r in wrong) + ".")
    return " ".join(sentences)


def findings(rows: list[Row]) -> str:
    return "\n\n".join(filter(None, (_oom_text(rows), "\n".join(_scaling_findings(rows))))) + "\n"


def _accounting_target(rows: list[Row]) -> tuple[Row, str]:
    """The configuration to account for, and a sentence saying why it was chosen: the smallest that ran out of
    memory; else the smallest the closed form says would not fit (the smallest head dim, N doubled past the largest
    measured); else, the device's memory unknown, the largest measured."""
    ooms = [r for r in rows if r["status"] == OOM]
    if ooms:
        target = min(ooms, key=lambda r: memory_of(r).peak_bytes)
        return target, (f"The smallest configuration that ran out of memory is d={target['head_dim']}, "
                        f"N={target['seq_len']} ({oom_when(target)}).")
    device = capacity(rows)
    if device is not None:
        target = {**min(rows, key=lambda r: r["head_dim"]), "seq_len": max(r["seq_len"] for r in rows),
                  "memory_before_backward_bytes": None}
        while memory_of(target).peak_bytes <= device:
            target["seq_len"] *= 2
        return target, (f"No configuration ran out of memory on this device "
                        f"({target['device_memory_bytes'] / GIB:.3g} GiB). The smallest that the accounting says "
                        f"would not fit is d={target['head_dim']}, N={target['seq_len']} (not run).")
    target = max(rows, key=lambda r: memory_of(r).peak_bytes)
    return target, (f"No configuration ran out of memory, and this device's memory is not measured; the accounting "
                    f"of the largest, d={target['head_dim']}, N={target['seq_len']}.")


def accounting_intro(rows: list[Row]) -> str:
    return f"## Memory accounting\n\n{_accounting_target(rows)[1]}\n"


def accounting_breakdown(rows: list[Row]) -> list[Row]:
    """The accounted configuration's tensors: name, shape, bytes and a note."""
    return memory_of(_accounting_target(rows)[0]).breakdown()


def accounting_totals(rows: list[Row]) -> list[Row]:
    """The accounted configuration's memory before backward and at the forward's and backward's peaks, predicted and,
    before backward, measured; with the device's memory."""
    target = _accounting_target(rows)[0]
    memory = memory_of(target)
    backward = (f"backward peak: {COUNTS[memory.backward_peak_score_matrices]} score matrices (P, dP, dS"
                + (", dP * P" if memory.backward_peak_score_matrices == 4 else "") + "), O and dv")
    totals = [("before backward: q, k, v, dO, O and what autograd saved", memory.before_backward_bytes,
               target.get("memory_before_backward_bytes")),
              ("forward peak: two score matrices (the last S, and P) and O", memory.forward_peak_bytes, None),
              (backward, memory.backward_peak_bytes, None)]
    return [{"total": name, "predicted": predicted, "measured": measured, "device": target.get("device_memory_bytes")}
            for name, predicted, measured in totals]


def accounting_notes(rows: list[Row]) -> str:
    target = _accounting_target(rows)[0]
    memory = memory_of(target)
    lse_bytes = target["batch_size"] * target["seq_len"] * LOGSUMEXP_BYTES
    return (f"Backward saves the softmax output P, {memory.scores_bytes / GIB:.3g} GiB here (B·N²·"
            f"{memory.element_bytes} bytes): softmax's gradient uses its output, and P @ v needs P for dv. P grows as "
            f"N², q, k, v and O as N: P is {memory.scores_bytes / memory.query_sized_bytes:,.0f}x O.\n\n"
            f"To remove this cost, store only each query row's logsumexp L ({lse_bytes / 2**20:.3g} MiB here, fp32) "
            "and recompute P tile by tile in the backward, as FlashAttention-2 does: memory linear in N "
            "(flash_benchmarking report).\n")


def peaks_measured(row: Row) -> bool:
    return row.get("backward_peak_bytes") is not None


def peak_ratio(peak: str):
    """A cell's measured `peak` ("forward" or "backward") over the closed form's, both above what the caller held
    before the forward (q, k, v, dO and cuBLAS workspaces)."""
    def ratio(row: Row) -> float:
        memory = memory_of(row)
        return ((row[f"{peak}_peak_bytes"] - row["allocated_before_forward_bytes"])
                / (getattr(memory, f"{peak}_peak_bytes") - memory.caller_bytes))
    return ratio


def validation_intro(rows: list[Row]) -> str:
    if not any(map(peaks_measured, rows)):
        return ""
    return ("## Accounting against measurement\n\nEach measured cell, above what was allocated before the forward "
            "(q, k, v, dO, cuBLAS workspaces; not in the closed form).\n")


def validation_finding(rows: list[Row]) -> str:
    measured = [r for r in rows if peaks_measured(r)]
    if not measured:
        return ""
    largest = [r for r in measured if r["seq_len"] == max(r["seq_len"] for r in measured)]
    added = [retained(r) / memory_of(r).retained_bytes for r in largest]
    return (f"At N={largest[0]['seq_len']} the forward's added memory is {span(added, '{:.3f}x'.format)} the "
            f"prediction, the backward peak {span([peak_ratio('backward')(r) for r in largest], '{:.3f}x'.format)}; "
            "at small N, cuBLAS workspaces and allocator rounding weigh more than the score matrices.\n")


def memory_points(rows: list[Row]) -> list[Row]:
    """The memory plot's points: each cell's memory before backward as measured (where it was) and as predicted."""
    measured = [{**r, "kind": "measured", "gib": r["memory_before_backward_bytes"] / GIB}
                for r in rows if r.get("memory_before_backward_bytes") is not None]
    return measured + [{**r, "kind": "predicted", "gib": memory_of(r).before_backward_bytes / GIB} for r in rows]


def device_memory_line(points: list[Row]) -> list[tuple[float, str]]:
    device = capacity(points)
    return [(device / GIB, "device memory")] if device else []


# ------------------------------------------------------------------------------ torch_compile (part)

def compiled_pairs(rows: list[Row]) -> list[Row]:
    """One line per (d, N) of the attention sweep (torch_compile's rows of table "attention"): that cell's eager and
    compiled rows (None where not measured)."""
    pairs: dict[tuple[int, int], Row] = {}
    for r in sorted(select(rows, table="attention"), key=cell_order):
        pair = pairs.setdefault(cell_order(r), {"d": r["head_dim"], "N": r["seq_len"], "eager": None, "compiled": None})
        pair["compiled" if r["compile"] else "eager"] = r
    return list(pairs.values())


def _both_timed(pair: Row, phase: str) -> bool:
    return all(pair[way] and pair[way].get(f"{phase}_mean_ms") for way in ("eager", "compiled"))


def _paired(pair: Row, phase: str) -> bool:
    """Whether a cell's eager and compiled times of `phase` are compared: both timed, in one run."""
    return _both_timed(pair, phase) and same_run(pair["eager"], pair["compiled"])


def _timed_both_ways(pair: Row) -> bool:
    """Whether a cell has an eager and a compiled time of either phase, in whichever runs."""
    return any(_both_timed(pair, phase) for phase in PHASES)


def _unpaired(pairs: list[Row]) -> list[Row]:
    """The cells timed both eager and compiled, but in different runs: no speed-up is read from them."""
    return [pair for pair in pairs if _timed_both_ways(pair) and not same_run(pair["eager"], pair["compiled"])]


def speedup(phase: str):
    """A cell's eager time of `phase` over its compiled time, where one run timed both."""
    def cell(pair: Row) -> str:
        if _paired(pair, phase):
            return speedup_text(pair["eager"], pair["compiled"], prefix=f"{phase}_")
        return UNPAIRED if _both_timed(pair, phase) else ""
    return cell


def first_pass_s(pair: Row) -> str:
    """The compiled cell's first (compiling) forward and backward, in s."""
    first = [pair["compiled"].get(f"first_{phase}_ms") for phase in PHASES] if pair["compiled"] else [None]
    return f"{sum(first) / 1e3:.2g}" if None not in first else ""


# Times eager and compiled attention in one run, which pairs them.
PAIRING_COMMAND = "pytest perf/test_attention.py -m attention"


def compiled_attention_speedups(pairs: list[Row]) -> dict[str, SpeedUps]:
    """Phase -> how much faster compiled attention ran than eager, over the cells where both were timed in one
    run: the report's findings and the index's answer read this one computation."""
    return {phase: SpeedUps.of(((p["eager"], p["compiled"], f"d={p['d']}, N={p['N']}") for p in pairs
                                if _paired(p, phase)), prefix=f"{phase}_")
            for phase in PHASES}


def compiled_setup(sweep: list[Row]) -> str:
    return (f"## Attention: eager against torch.compile\n\n{_setup(sweep)} Compiled cells compile afresh with static "
            "shapes; compiling passes are untimed. Speed-up: eager's mean over compiled's.\n")


def compiled_findings(rows: list[Row]) -> str:
    pairs = compiled_pairs(rows)
    lines = []
    for phase, speedups in compiled_attention_speedups(pairs).items():
        if speedups.ratios:
            details = speedups.details()
            lines.append(f"- {phase}: compiled runs {speedups.range_text(with_cells=True)} as fast as eager"
                         + (f" ({details})." if details else "."))
        elif speedups.noisy:
            lines.append(f"- {phase}: every cell is noisy, so no speed-up is read from them.")
    unpaired = _unpaired(pairs)
    if unpaired:
        timed = sum(map(_timed_both_ways, pairs))
        eager_runs, compiled_runs = (runs_text(pair[way] for pair in unpaired) for way in ("eager", "compiled"))
        which = "Every cell" if len(unpaired) == len(pairs) else f"{len(unpaired)} of the {timed} cells timed both ways"
        lines.append(f"- {which} ran eager ({eager_runs}) and compiled ({compiled_runs}) in different runs, so no "
                     f"speed-up is read from them; `{PAIRING_COMMAND}`, compiled included, times both in one run.")
    for pair in pairs:
        if pair["eager"] and pair["compiled"] and {pair["eager"]["status"], pair["compiled"]["status"]} == {"ok", OOM}:
            ran = "compiled" if pair["compiled"]["status"] == "ok" else "eager"
            lines.append(f"- d={pair['d']}, N={pair['N']}: only {ran} attention fits in memory.")
    return "\n".join(lines) + "\n" if lines else ""


# ---------------------------------------------------------------------------------------------- answers

def answer_torch_compile(reports: Reports) -> list[str]:
    rows = latest_cells(reports["torch_compile"], TORCH_COMPILE_KEY)
    sentences = e2e.answer_compiled_models(rows)
    pairs = compiled_pairs([r for r in rows if r.get("status") == "ok"])
    parts = [f"{phase} {s.summary()}" for phase, s in compiled_attention_speedups(pairs).items() if s.summary()]
    unpaired = len(_unpaired(pairs))
    left_out = f"; {unpaired} more ran eager and compiled in different runs and are left out" if unpaired else ""
    if parts:
        paired = sum(map(_timed_both_ways, pairs)) - unpaired
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
    rows = reports["pytorch_attention"]
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
    ooms = sorted(select(rows, status=OOM), key=lambda r: (r["seq_len"], r["head_dim"]))
    if ooms:
        smallest = ooms[0]
        text = f"Out of memory from N={smallest['seq_len']} (" + ", ".join(
            f"d={r['head_dim']} {oom_when(r)}" for r in select(ooms, seq_len=smallest["seq_len"])) + ")"
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
