"""Problem flash_benchmarking's report: the sentences and table lines of the sweep of Triton FlashAttention against
naive attention and SDPA and what it shows, the 2025 leaderboard's attention cell, the speed-up gates and the host's
time to issue a call; with the answers of flash_forward / flash_backward, flash_benchmarking and the leaderboard.
the package's benchmarks/flash.py measures them; the tables and plots are declared in cs336_systems.reports.problems.
"""

from __future__ import annotations

from collections import defaultdict

from cs336_systems.reports import (
    Reports,
    format_ms,
    noisy_marked,
    not_in_report,
    oom_text,
    percentiles_noisy,
    plural,
    ratio_cell,
    select,
)
from cs336_systems.reports.flash_in_training import answer_flash_in_training
from cs336_systems.rows import OOM, Row, ok_rows, ran
from cs336_systems.rows.flash import (
    GATED_PROVIDERS,
    HEAD_DIMS,
    PRECISIONS,
    PROVIDER_LABELS,
    SEQ_LENS,
    provider_label,
)

RATIO_PAIRS = (("naive", "flash_triton"), ("sdpa", "flash_triton"))


def provider_order(provider: str) -> int:
    """Where a provider goes among the measured ones: this project's and the references in PROVIDER_LABELS' order,
    then the implementation under test's, in the order measured."""
    return list(PROVIDER_LABELS).index(provider) if provider in PROVIDER_LABELS else len(PROVIDER_LABELS)


def _providers_in(rows: list[Row]) -> list[str]:
    return sorted(dict.fromkeys(r["provider"] for r in rows), key=provider_order)


def _under_test(rows: list[Row]) -> list[str]:
    """The implementation under test's providers among `rows`."""
    return [p for p in _providers_in(rows) if p not in PROVIDER_LABELS]


def time_cell(row: Row | None) -> str:
    if not row:
        return ""
    if row["status"] == OOM:
        return oom_text(row)
    if row["status"] != "ok":
        return row["status"]
    return noisy_marked(f"{row['median_ms']:.3g}", percentiles_noisy(row))


def _tflops_cell(row: Row | None) -> str:
    return f"{row['tflops']:.3g}" if ran(row) else ""


def sweep_lines(rows: list[Row]) -> list[Row]:
    """A line per head dim and length of one precision and mode: each provider's time, each one's over Triton's (the
    naive and SDPA references', and the implementation under test's), and their TFLOP/s."""
    providers = _providers_in(rows)
    pairs = [(slow, fast) for slow, fast in RATIO_PAIRS if {slow, fast} <= set(providers)]
    pairs += [(p, "flash_triton") for p in _under_test(rows) if "flash_triton" in providers]
    lines = []
    for d, n in sorted({(r["head_dim"], r["seq_len"]) for r in rows}):
        cell = {r["provider"]: r for r in rows if (r["head_dim"], r["seq_len"]) == (d, n)}
        line = {"d": d, "N": n} | {f"{provider_label(p)} (ms)": time_cell(cell.get(p)) for p in providers}
        line |= {f"{provider_label(slow)} / {provider_label(fast)}": ratio_cell(cell.get(slow), cell.get(fast))
                 for slow, fast in pairs}
        line |= {f"{provider_label(p)} TFLOP/s": _tflops_cell(cell.get(p)) for p in providers if p != "naive"}
        lines.append(line)
    return lines


def _timer(rows: list[Row]) -> str:
    return next((r["timer"] for r in rows if r.get("timer")), "none (no cell ran)")


def sweep_setup(rows: list[Row]) -> str:
    """The sweep's setup, of its rows."""
    r = rows[0]
    reset_note = " outside the timed region" if _timer(rows).startswith("do_bench") else ""
    backends = sorted({(x["precision"], x["backend"]) for x in rows if x["provider"] == "sdpa" and x.get("backend")})
    backend_text = "; ".join(f"{p}: {b}" for p, b in backends) or "not measured"
    fp32_note = ""
    fp32 = [x for x in rows if x["precision"] == "fp32"]
    if any(x.get("device") == "cpu" for x in fp32):
        # The interpreter runs tl.dot as a NumPy matmul in the output's dtype, whatever input_precision says.
        fp32_note = " On a CPU fp32 is full fp32: the Triton interpreter computes tl.dot as a NumPy fp32 matmul."
    elif fp32:
        matmul = sorted({x["fp32_matmul_precision"] for x in fp32})
        fp32_note = (" In fp32, Triton's tl.dot defaults to TF32 tensor cores on NVIDIA GPUs; PyTorch's matmuls "
                     f"used float32_matmul_precision {', '.join(matmul)} ('highest' is full fp32).")
    return ("## Sweep\n\n"
            f"Causal attention on q, k, v of shape ({r['batch_size']}, {r['n_heads']}, N, d), random normal; "
            "medians in ms. Backward is timed alone, gradients reset"
            f"{reset_note}. Ratios are a provider's time over Triton's (above 1: Triton faster). Naive: the "
            "annotated reference, eager. A ratio is noisy where either time is. SDPA backend: "
            f"{backend_text}.{fp32_note}\n\nTFLOP/s counts useful FLOPs: forward 2·N²·d per head (causal: half of "
            "4·N²·d), backward 2.5x that, forward+backward 3.5x.\n")


# Up to this length, a time that barely grows while the work grows by orders of magnitude is the
# host's (Python and launch overhead per call), not the kernels'.
SHORT_SEQ_LEN = 4096
HOST_BOUND_MAX_SPREAD = 4  # largest/smallest time over the short lengths
HOST_BOUND_MIN_WORK_GROWTH = 64  # (longest/shortest N)^2 over the short lengths


def _work_growth(rows: list[Row]) -> float:
    """How much the attention work grows over these rows' sequence lengths: (longest/shortest N)^2."""
    lengths = [r["seq_len"] for r in rows]
    return (max(lengths) / min(lengths)) ** 2 if lengths else 1.0


def _host_bound_finding(rows: list[Row], precision: str) -> str | None:
    """A finding when Triton's forward+backward time stays nearly flat over the short lengths, read from the steady
    cells only; where the noisy cells left out leave too few to span the work's growth, it says so."""
    measured = [r for r in rows if (r["provider"], r["precision"], r["mode"]) == ("flash_triton", precision,
                                                                                  "forward_backward")
                and r["seq_len"] <= SHORT_SEQ_LEN and ran(r)]
    short = [r for r in measured if not percentiles_noisy(r)]
    noisy = len(measured) - len(short)
    growth = _work_growth(short)
    if growth < HOST_BOUND_MIN_WORK_GROWTH:
        if _work_growth(measured) < HOST_BOUND_MIN_WORK_GROWTH:
            return None
        return (f"- {precision}: N up to {SHORT_SEQ_LEN}: Triton's forward+backward is noisy in {noisy} of "
                f"{len(measured)} cells, too few steady ones to tell host time from kernel time.")
    shortest, longest = min(r["seq_len"] for r in short), max(r["seq_len"] for r in short)
    low, high = min(r["median_ms"] for r in short), max(r["median_ms"] for r in short)
    if high / low > HOST_BOUND_MAX_SPREAD:
        return None
    left_out = f" ({plural(noisy, 'noisy cell')} left out)" if noisy else ""
    return (f"- {precision}: N={shortest} to {longest}: Triton's forward+backward {low:.3g}-{high:.3g} ms at every d "
            f"while the work grows {growth:.0f}x{left_out}: host time, not kernel time (docs/flash_tuning.md).")


def _naive_oom_finding(precision: str, ooms: list[Row]) -> str:
    """Where naive attention first ran out of memory, and the accounting's peak beside the memory free there:
    where a cell that ran out was estimated to fit, the finding says that the two disagree, as the
    pytorch_attention report does, rather than quote the estimate as the reason."""
    first = min(r["seq_len"] for r in ooms)
    at_first = [r for r in ooms if r["seq_len"] == first]
    head_dims = ", ".join(str(d) for d in sorted({r["head_dim"] for r in at_first}))
    how = "predicted and not run" if all(r.get("oom_predicted") for r in at_first) else "measured"
    text = f"- {precision}: naive attention runs out of memory from N={first} (d={head_dims}; {how}"
    fitted = [r for r in at_first if not r.get("oom_predicted") and r.get("free_memory_bytes")
              and (r["predicted_peak_bytes"] or 0) <= r["free_memory_bytes"]]
    if fitted:
        worst = max(fitted, key=lambda r: r["predicted_peak_bytes"])
        return (text + f"). The accounting's peak disagrees with the run: {worst['predicted_peak_bytes'] / 2**30:.3g} "
                f"GiB at d={worst['head_dim']}, within the {worst['free_memory_bytes'] / 2**30:.3g} GiB free, yet it "
                "ran out.")
    worst = max(at_first, key=lambda r: r["predicted_peak_bytes"] or 0)
    need = f"; the accounting puts its peak at {worst['predicted_peak_bytes'] / 2**30:.3g} GiB"
    if worst.get("free_memory_bytes"):
        need += f" against {worst['free_memory_bytes'] / 2**30:.3g} GiB free"
    return text + f"{need} at d={worst['head_dim']})."


def _lengths_text(lengths: list[int]) -> str:
    """Sequence lengths of the sweep, each unbroken run of SEQ_LENS as one range: "N 16,384-65,536",
    "N 128, 1,024-2,048"."""
    runs: list[list[int]] = []
    for n in lengths:
        if runs and SEQ_LENS.index(n) == SEQ_LENS.index(runs[-1][-1]) + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return "N " + ", ".join(f"{run[0]:,}" if len(run) == 1 else f"{run[0]:,}-{run[-1]:,}" for run in runs)


def _precisions_in(rows: list[Row]) -> list[str]:
    """The precisions of PRECISIONS that `rows` measured, in that order."""
    return [p for p in PRECISIONS if any(r["precision"] == p for r in rows)]


def _unmeasured_cells(sweep: list[Row]) -> str | None:
    """The cells of a GPU sweep's grid (HEAD_DIMS x SEQ_LENS, for each precision it swept) that no run measured,
    "bf16 d 64 N 16,384-65,536 and d 128" (a head dim alone: every N of it); None where every cell was measured,
    or the rows are a CPU run's, which sweeps a smaller grid of its own."""
    if not sweep or any(r.get("device") == "cpu" for r in sweep):
        return None
    measured = {(r["precision"], r["head_dim"], r["seq_len"]) for r in sweep}
    parts = []
    for precision in _precisions_in(sweep):
        missing = [f"d {d}" if lengths == list(SEQ_LENS) else f"d {d} {_lengths_text(lengths)}" for d in HEAD_DIMS
                   if (lengths := [n for n in SEQ_LENS if (precision, d, n) not in measured])]
        if missing:
            parts.append(f"{precision} {' and '.join(missing)}")
    return "; ".join(parts) or None


def unmeasured(sweep: list[Row]) -> str:
    missing = _unmeasured_cells(sweep)
    return f"Not measured: {missing}.\n" if missing else ""


def findings(sweep: list[Row]) -> str:
    lines = []
    for precision in _precisions_in(sweep):
        mine = [r for r in sweep if r["precision"] == precision]
        host_bound = _host_bound_finding(mine, precision)
        if host_bound:
            lines.append(host_bound)
        naive = [r for r in mine if r["provider"] == "naive"]
        ooms = [r for r in naive if r["status"] == OOM]
        if ooms:
            lines.append(_naive_oom_finding(precision, ooms))
        elif naive:
            longest = max(r["seq_len"] for r in naive)
            lines.append(f"- {precision}: naive attention ran at every N measured, up to {longest}.")
    return "## Findings\n\n" + "\n".join(lines) + "\n" if lines else ""


def leaderboard_setup(rows: list[Row]) -> str:
    r, measured = rows[0], [x for x in rows if ran(x)]
    how = (f"the providers in turns over {max(x['rounds'] for x in measured)} shuffled rounds (median of all samples)"
           if any(x.get("rounds") for x in measured) else "one run")
    return ("## The 2025 leaderboard's attention cell, one GPU\n\n"
            f"Batch {r['batch_size']}, {r['n_heads']} heads, d_head {r['head_dim']}, N {r['seq_len']}, {r['precision']}, "
            f"causal, forward+backward, {how}; triton (compiled) is the Triton Function in torch.compile. (The 2026 "
            "leaderboard is a whole 8B-class training step on two GPUs.)\n")


def leaderboard_lines(rows: list[Row]) -> list[Row]:
    """A line per provider: its time and TFLOP/s, how far its turns' medians spread and how often the GPU was power
    capped where measured, and its time over every provider's that ran."""
    measured = [x for x in rows if ran(x)]
    in_turns = any(x.get("rounds") for x in measured)
    clocked = any(x.get("power_capped_share") is not None for x in measured)
    return [{"provider": provider_label(x["provider"]), "backend": x.get("backend") or "",
             "median (ms)": time_cell(x), "TFLOP/s": _tflops_cell(x)}
            | ({"turns' medians spread": f"{x['round_spread']:.1%}" if ran(x) else ""} if in_turns else {})
            | ({"power-capped (NVML)": f"{x['power_capped_share']:.0%}" if ran(x) else ""} if clocked else {})
            | {f"time / {provider_label(y['provider'])}": ratio_cell(x, y) for y in measured}
            for x in rows]


def host_issue_setup(rows: list[Row]) -> str:
    return ("## Host time to issue forward+backward\n\n"
            f"{rows[0]['precision']}, causal; the host's time per call, median [p20-p80] in us, the GPU kept busy, so no call waits ({rows[0]['timer']}).\n")


def host_issue_lines(rows: list[Row]) -> list[Row]:
    """A line per shape: each provider's time to issue a call, and ours (and the implementation under test's) over
    each pinned SDPA backend's."""
    providers, lines = _providers_in(rows), []
    for shape in dict.fromkeys((r["batch_size"], r["n_heads"], r["seq_len"], r["head_dim"]) for r in rows):
        cell = {r["provider"]: r for r in rows if (r["batch_size"], r["n_heads"], r["seq_len"], r["head_dim"]) == shape}
        line = {"batch x heads x N x d": " x ".join(map(str, shape))}
        for p in providers:
            row = cell.get(p)
            line[f"{provider_label(p)} (us)"] = (
                noisy_marked(f"{row['median_ms'] * 1e3:.0f} [{row['p20_ms'] * 1e3:.0f}-{row['p80_ms'] * 1e3:.0f}]",
                             percentiles_noisy(row)) if ran(row) else (row or {}).get("status", ""))
        for ours in ("flash_triton", "flash_triton_op", *_under_test(rows)):
            for sdpa in ("sdpa_cudnn", "sdpa_flash"):
                ratio = ratio_cell(cell.get(ours), cell.get(sdpa), ".2f")
                if ratio:
                    line[f"{provider_label(ours)} / {provider_label(sdpa)}"] = ratio
        lines.append(line)
    return lines


def gate_setup(rows: list[Row]) -> str:
    measured = {r["provider"]: r for r in rows}
    cell = next(iter(measured.values()))  # every gate row is of the one gated cell
    ratios = "; ".join(f"{provider} / triton " + (ratio_cell(measured.get(provider), measured.get("flash_triton"))
                                                  or "did not run") for provider in GATED_PROVIDERS)
    return (f"## Speed-up gates\n\nBatch 1, 1 head, N {cell['seq_len']}, d {cell['head_dim']}, {cell['precision']}, "
            f"causal, forward+backward, gated against perf/baselines/<gpu>.json: {ratios}.\n")


def sources(rows: list[Row]) -> str:
    """The FlashAttention source each run's rows measured, named once where every run measured the same."""
    by_run: dict[int, set[str]] = defaultdict(set)
    for r in rows:
        by_run[int(r.get("run") or 1)].add(r["source_hash"])
    runs = sorted(by_run.items())
    if all(hashes == runs[0][1] for _, hashes in runs):
        every = f" (all {len(runs)} runs)" if len(runs) > 1 else ""
        return f"FlashAttention GPU source measured: {', '.join(sorted(runs[0][1]))}{every}.\n"
    return ("FlashAttention GPU source measured: "
            + "; ".join(f"run {run}: {', '.join(sorted(hashes))}" for run, hashes in runs) + ".\n")


# ---------------------------------------------------------------------------------------------- answers

def answer_flash_forward_backward(reports: Reports) -> list[str]:
    return ["No report of their own: these are correctness problems, run on every machine by "
            "`pytest tests/test_flash_attention.py` (output, logsumexp and gradients against a float64 reference, L "
            "as the only tensor saved per query row, causal masking), for the tiled PyTorch and the Triton "
            "Functions; their speed is measured under flash_benchmarking."]


def answer_flash_benchmarking(reports: Reports) -> list[str]:
    """The index's answer from whichever of the problem's two reports a device has."""
    sentences = _answer_sweep(reports["flash_benchmarking"]) if "flash_benchmarking" in reports else []
    if "flash_in_training" in reports:
        sentences += answer_flash_in_training(reports["flash_in_training"])
    return sentences


def _answer_sweep(rows: list[Row]) -> list[str]:
    sweep = select(rows, table="sweep")
    sentences = []
    index = {(r["precision"], r["mode"], r["head_dim"], r["seq_len"], r["provider"]): r for r in ok_rows(sweep)}
    for precision in dict.fromkeys(r["precision"] for r in sweep):
        both = [(d, n) for (p, mode, d, n, provider) in index if (p, mode, provider) ==
                (precision, "forward_backward", "naive") and (p, mode, d, n, "flash_triton") in index]
        if not both:
            continue
        d, n = max(both, key=lambda dn: (dn[1], dn[0]))
        triton, naive, sdpa = (index.get((precision, "forward_backward", d, n, provider))
                               for provider in ("flash_triton", "naive", "sdpa"))
        ooms = [r["seq_len"] for r in select(sweep, precision=precision, provider="naive", status=OOM)]
        sentences.append(
            f"{precision}, causal, forward+backward at the largest N where naive attention ran (d={d}, N={n}): Triton "
            f"{format_ms(triton['median_ms'])} against naive {format_ms(naive['median_ms'])} (naive takes "
            f"{naive['median_ms'] / triton['median_ms']:.3g}x Triton's time)"
            + (f" and SDPA {format_ms(sdpa['median_ms'])}" if sdpa else "")
            + (f"; naive runs out of memory from N={min(ooms)}." if ooms else "."))
    if not sentences:
        sentences.append(not_in_report("A forward+backward cell where both Triton and naive attention ran"))
    unmeasured = _unmeasured_cells(sweep)
    if unmeasured:
        sentences.append(f"Not measured in the sweep, so not among the cells above: {unmeasured}.")
    leaderboard = ok_rows(select(rows, table="leaderboard"))
    if leaderboard:
        r0 = leaderboard[0]
        sentences.append(
            f"The 2025 leaderboard's attention cell on one GPU (batch {r0['batch_size']}, {r0['n_heads']} heads, d "
            f"{r0['head_dim']}, "
            f"N {r0['seq_len']:,}, {r0['precision']}, causal, forward+backward): "
            + ", ".join(f"{PROVIDER_LABELS.get(r['provider'], r['provider'])} {format_ms(r['median_ms'])}"
                        for r in leaderboard) + ".")
    else:
        sentences.append(not_in_report("The 2025 leaderboard's attention cell"))
    return sentences
