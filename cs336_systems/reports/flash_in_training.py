"""Problem flash_benchmarking's flash_in_training report: the compiled training step with the Triton
FlashAttention op against SDPA, and the attention kernels alone at those steps' shapes
(the package's benchmarks/flash_in_training.py measures them).
"""

from __future__ import annotations

from cs336_systems.reports import (
    NOISY_RELATIVE_STD,
    Rendered,
    is_noisy,
    listing,
    markdown_table,
    noisy_marked,
    not_in_report,
    percentiles_noisy,
)
from cs336_systems.rows import Row
from cs336_systems.rows.flash import KERNEL_MODES, MODE_LABELS


def _time(row: Row) -> str:
    if row["status"] != "ok":
        return row["status"]
    return f"{row['median_ms']:.4g} (IQR {row['iqr_ms']:.2g})"


def _kernel_time(row: Row) -> str:
    if row["status"] != "ok":
        return row["status"]
    return noisy_marked(f"{row['median_ms']:.4g}", percentiles_noisy(row))


def _cell_key(r: Row) -> tuple:
    return r["size_table"], r["size"], r["context_length"]


def _steps_table(rows: list[Row]) -> str:
    """One line per (cell, attention): its step against SDPA's of the same kind."""
    table = []
    for key in dict.fromkeys(_cell_key(r) for r in rows):
        cell = {r["attention"]: r for r in rows if _cell_key(r) == key}
        sdpa = cell.get("sdpa")
        for attention, r in cell.items():
            ok = r["status"] == "ok"
            ratio = r["median_ms"] / sdpa["median_ms"] if ok and sdpa and sdpa["status"] == "ok" else None
            table.append({"size": f"{key[1]} ({key[0]} table)",
                          "d_model / heads / d_head": f"{r['d_model']} / {r['n_heads']} / {r['head_dim']}",
                          "context": key[2], "attention": attention, "step ms, median (IQR)": _time(r),
                          "std / mean": f"{r['std_ms'] / r['mean_ms']:.1%}" if ok else "",
                          "vs SDPA": f"{ratio:.3f}x" if ratio else "",
                          "TFLOP/s": f"{r['tflops']:.0f}" if ok else "",
                          "peak GiB": f"{r['peak_memory_gib']:.1f}" if r.get("peak_memory_gib") else "",
                          "first loss": f"{r['first_loss']:.4f}" if ok else ""})
    return markdown_table(table)


def _steps_section(rows: list[Row]) -> str:
    sample = rows[0]
    return ("## Training steps\n\n"
            f"Batch {sample['batch_size']}, {sample['precision']}, {sample['optimizer']}, the whole model under "
            f"torch.compile ({sample['compile']}), {sample['warmup']} warm-up steps then {sample['steps']} "
            "timed whole steps (CUDA events, one synchronisation per step). TFLOP/s counts the step's matmul "
            "FLOPs (accounting.flops.step_flops) over the median.\n\n" + _steps_table(rows))


def _graphed_steps_section(rows: list[Row]) -> str:
    return ("## Training steps in CUDA graphs\n\n"
            "The same steps compiled with mode \"reduce-overhead\": the forward and backward, the attention's "
            "kernels inside them, replay CUDA graphs; the loss and the optimizer step run eagerly between them. "
            "Warm-up, timing and TFLOP/s as above.\n\n" + _steps_table(rows))


def _kernels_section(rows: list[Row]) -> str:
    table = []
    shapes = dict.fromkeys((r["batch_size"], r["n_heads"], r["seq_len"], r["head_dim"]) for r in rows)
    for shape in shapes:
        for mode in KERNEL_MODES:
            cell = {r["provider"]: r for r in rows
                    if (r["batch_size"], r["n_heads"], r["seq_len"], r["head_dim"], r["mode"]) == (*shape, mode)}
            if not cell:
                continue
            ours = cell.get("flash_triton")
            entry = {"batch x heads x N x d": " x ".join(map(str, shape)), "mode": MODE_LABELS[mode]}
            for provider, r in cell.items():
                entry[f"{provider} ms"] = _kernel_time(r)
            for provider in ("sdpa_cudnn", "sdpa_flash"):
                other = cell.get(provider)
                if ours and other and ours["status"] == other["status"] == "ok":
                    ratio = f"{ours['median_ms'] / other['median_ms']:.2f}x"
                    noisy = percentiles_noisy(ours) or percentiles_noisy(other)
                    entry[f"triton / {provider}"] = noisy_marked(ratio, noisy)
            if ours and ours["status"] == "ok":
                entry["triton TFLOP/s"] = f"{ours['tflops']:.0f}"
            table.append(entry)
    return ("## Attention kernels at the training shapes\n\nCausal, bf16, do_bench medians; a ratio above 1 "
            "means the Triton kernels are slower. Each mode is timed as called (where the host takes longer to "
            "issue a call than the GPU to run it, the host's time), and forward+backward also as the replay of a "
            "CUDA graph that captured it (the kernels alone). A time is marked noisy where the middle 60% of its "
            f"samples spans more than {NOISY_RELATIVE_STD:.0%} of its median, and so is a ratio that uses one: "
            "no finding.\n\n" + markdown_table(table))


def render_flash_in_training(rows: list[Row]) -> Rendered:
    steps = [r for r in rows if r.get("table") == "step"]
    graphed = [r for r in rows if r.get("table") == "graphed_step"]
    kernels = [r for r in rows if r.get("table") == "kernels"]
    parts = [_steps_section(steps) if steps else "", _graphed_steps_section(graphed) if graphed else "",
             _kernels_section(kernels) if kernels else ""]
    return Rendered("\n".join(p for p in parts if p))


def answer_flash_in_training(rows: list[Row]) -> list[str]:
    """The index's sentence: the compiled step with the Triton op against SDPA's, at each cell where both ran
    (the two steps of a cell are measured in one run), marked noisy where either step's time was."""
    steps = [r for r in rows if r.get("table") == "step"]
    ratios = []
    for key in sorted(dict.fromkeys(_cell_key(r) for r in steps), key=lambda k: k[2]):
        cell = {r["attention"]: r for r in steps if _cell_key(r) == key}
        flash, sdpa = cell.get("flash_triton"), cell.get("sdpa")
        if flash and sdpa and flash["status"] == sdpa["status"] == "ok":
            noisy = any(is_noisy(r["mean_ms"], r["std_ms"]) for r in (flash, sdpa))
            ratios.append(noisy_marked(f"{flash['median_ms'] / sdpa['median_ms']:.3f}x", noisy)
                          + f" at context {key[2]}")
    if not ratios:
        return [not_in_report("A compiled training step where both the Triton op and SDPA ran")]
    sample = steps[0]
    return [f"In the compiled training step of {sample['size']} ({sample['size_table']} table; batch "
            f"{sample['batch_size']}, {sample['precision']}), the step with the Triton FlashAttention op over the SDPA "
            f"step: {listing(ratios)}."]
