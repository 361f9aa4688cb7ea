"""Problem flash_benchmarking's flash_in_training report: the compiled training step with the Triton
FlashAttention op against SDPA, and the attention kernels alone at those steps' shapes
(the package's benchmarks/flash_in_training.py measures them; the tables are declared in
cs336_systems.reports.problems). Here: their sentences, the tables' cells and the answer.
"""

from __future__ import annotations

from cs336_systems.reports import (
    NOISY_RELATIVE_STD,
    is_noisy,
    listing,
    noisy_marked,
    not_in_report,
    percentiles_noisy,
    ratio_cell,
)
from cs336_systems.rows import Row, ran
from cs336_systems.rows.flash import KERNEL_MODES, MODE_LABELS, median_ratio


def _cell_key(r: Row) -> tuple:
    return r["size_table"], r["size"], r["context_length"]


def against_sdpa(rows: list[Row]) -> list[Row]:
    """The steps grouped by cell (model size and context), each with its time over SDPA's step of the cell."""
    lines = []
    for key in dict.fromkeys(_cell_key(r) for r in rows):
        cell = {r["attention"]: r for r in rows if _cell_key(r) == key}
        lines += [{**r, "vs_sdpa": median_ratio(r, cell.get("sdpa"))} for r in cell.values()]
    return lines


def step_time(row: Row) -> str:
    return f"{row['median_ms']:.4g} (IQR {row['iqr_ms']:.2g})" if ran(row) else row["status"]


def steps_setup(steps: list[Row]) -> str:
    sample = steps[0]
    return ("## Training steps\n\n"
            f"Batch {sample['batch_size']}, {sample['precision']}, {sample['optimizer']}, the whole model under "
            f"torch.compile ({sample['compile']}), {sample['warmup']} warm-up steps then {sample['steps']} "
            "timed whole steps (CUDA events, one synchronisation per step). TFLOP/s counts the step's matmul "
            "FLOPs (accounting.flops.step_flops) over the median.\n")


GRAPHED_STEPS_SETUP = (
    "## Training steps in CUDA graphs\n\n"
    "The same steps compiled with mode \"reduce-overhead\": the forward and backward, the attention's "
    "kernels inside them, replay CUDA graphs; the loss and the optimizer step run eagerly between them. "
    "Warm-up, timing and TFLOP/s as above.\n")
KERNELS_SETUP = (
    "## Attention kernels at the training shapes\n\nCausal, bf16, do_bench medians; a ratio above 1 "
    "means the Triton kernels are slower. Each mode is timed as called (where the host takes longer to "
    "issue a call than the GPU to run it, the host's time), and forward+backward also as the replay of a "
    "CUDA graph that captured it (the kernels alone). A time is marked noisy where the middle 60% of its "
    f"samples spans more than {NOISY_RELATIVE_STD:.0%} of its median, and so is a ratio that uses one: "
    "no finding.\n")


def kernel_lines(rows: list[Row]) -> list[Row]:
    """One line per shape and mode: each provider's time, Triton's over each pinned SDPA backend's, Triton's TFLOP/s."""
    lines = []
    for shape in dict.fromkeys((r["batch_size"], r["n_heads"], r["seq_len"], r["head_dim"]) for r in rows):
        for mode in KERNEL_MODES:
            cell = {r["provider"]: r for r in rows
                    if (r["batch_size"], r["n_heads"], r["seq_len"], r["head_dim"], r["mode"]) == (*shape, mode)}
            if not cell:
                continue
            ours = cell.get("flash_triton")
            line = {"batch x heads x N x d": " x ".join(map(str, shape)), "mode": MODE_LABELS[mode]}
            line |= {f"{provider} ms": noisy_marked(f"{r['median_ms']:.4g}", percentiles_noisy(r)) if ran(r)
                     else r["status"] for provider, r in cell.items()}
            for provider in ("sdpa_cudnn", "sdpa_flash"):
                if ratio := ratio_cell(ours, cell.get(provider), ".2f"):  # "" unless both ran
                    line[f"triton / {provider}"] = ratio
            if ran(ours):
                line["triton TFLOP/s"] = f"{ours['tflops']:.0f}"
            lines.append(line)
    return lines


def answer_flash_in_training(rows: list[Row]) -> list[str]:
    """The index's sentence: the compiled step with the Triton op against SDPA's, at each cell where both ran
    (the two steps of a cell are measured in one run), marked noisy where either step's time was."""
    steps = [r for r in rows if r.get("table") == "step"]
    ratios = []
    for key in sorted(dict.fromkeys(_cell_key(r) for r in steps), key=lambda k: k[2]):
        cell = {r["attention"]: r for r in steps if _cell_key(r) == key}
        flash, sdpa = cell.get("flash_triton"), cell.get("sdpa")
        if ran(flash) and ran(sdpa):
            noisy = any(is_noisy(r["mean_ms"], r["std_ms"]) for r in (flash, sdpa))
            ratios.append(noisy_marked(f"{median_ratio(flash, sdpa):.3f}x", noisy) + f" at context {key[2]}")
    if not ratios:
        return [not_in_report("A compiled training step where both the Triton op and SDPA ran")]
    sample = steps[0]
    return [f"In the compiled training step of {sample['size']} ({sample['size_table']} table; batch "
            f"{sample['batch_size']}, {sample['precision']}), the step with the Triton FlashAttention op over the SDPA "
            f"step: {listing(ratios)}."]
