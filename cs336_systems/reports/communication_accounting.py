"""Problem communication_accounting's answers (2025 handout): every answer and derivation, written from
the rows of cs336_systems.accounting.communication_accounting, which evaluates the closed-form models; its
tables and figure are declared in cs336_systems.reports.problems, and `write_communication_accounting` writes
it. The output is the same on every machine and every run, so it carries no device, versions or date.
"""

from __future__ import annotations

import math
from pathlib import Path

from cs336_systems.accounting.communication import COLLECTIVES
from cs336_systems.accounting.communication_accounting import (
    COLLECTIVE_DEVICE_COUNTS,
    DEFAULT_SEQUENCES,
    EXAMPLE_SEQ_LEN,
    FP8_BYTES,
    PLOTTED_MESHES,
    QUESTION_DATA_DEVICES,
    QUESTION_MESH,
    QUESTION_TENSOR_DEVICES,
    STAGE_MESH,
    US,
    communication_accounting_rows,
)
from cs336_systems.accounting.parallelism import BF16_BYTES
from cs336_systems.gpus import GB, MB
from cs336_systems.reports import (
    ANALYSIS_COMMAND,
    Reports,
    find,
    format_share,
    not_in_report,
    select,
    write_closed_form,
)
from cs336_systems.rows import Row

PROBLEM = "communication_accounting"


def _scalars(rows: list[Row]) -> dict[str, float]:
    return {r["name"]: r["value"] for r in select(rows, table="scalar")}


def _one(rows: list[Row], **equal) -> Row:
    found = select(rows, **equal)
    if len(found) != 1:
        raise ValueError(f"expected one row with {equal}, found {len(found)}")
    return found[0]


def _question(rows: list[Row]) -> Row:
    """The question's mesh in the scaling book's model with bf16 collectives."""
    return _one(rows, table="crossover", mesh=QUESTION_MESH, exact_ring=False, comm_bytes_per_element=BF16_BYTES)


def tokens(value: float) -> str:
    """A threshold in tokens as the strategies table shows it: "never", "any" or the number."""
    return "never" if value == float("inf") else "any" if value == 0 else f"{value:,.1f}"


def size(nbytes: float) -> str:
    for unit, scale in (("GB", GB), ("MB", MB), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.3g} bytes"


def xxl_model(rows: list[Row]) -> str:
    m = _one(rows, table="model")
    return (f"{m['num_blocks']} blocks of Linear(d_model -> d_ff) and Linear(d_ff -> d_model), no biases, "
            f"nonlinearity, attention or embeddings: 2 x {m['d_model']:,} x {m['d_ff']:,} x "
            f"{m['num_blocks']} = **{m['num_params']:,} parameters**.\n")


def saved_activations(rows: list[Row]) -> str:
    m, s = _one(rows, table="model"), _scalars(rows)
    return ("Saved for backward in bf16, with no checkpointing and each linear keeping only its input (In for "
            "dW_in = In^T dTmp, Tmp for dW_out = Tmp^T dOut; a block's output is the next block's In): "
            f"2 x ({m['d_model']:,} + {m['d_ff']:,}) = {s['activation_bytes_per_token_per_block']:,.0f} bytes per "
            f"token per block, {s['activation_bytes_per_token']:,.0f} bytes "
            f"({s['activation_bytes_per_token'] / MB:.2f} MB) over {m['num_blocks']} blocks:\n")


def memory_answer(rows: list[Row]) -> str:
    total, s = _one(rows, table="state", component="total"), _scalars(rows)
    gpus = s["state_h100s"]
    return (f"**Answer.** The fp32 master weights, gradients and Adam moments take {total['gb']:,.2f} GB "
            f"({total['gib']:,.1f} GiB), {gpus:.2f} H100 80GB GPUs' worth (so {math.ceil(gpus)} GPUs) before any "
            f"activation; activations add {s['activation_bytes_per_token'] / MB:.2f} MB per token.\n\n"
            f"An H100 80GB holds {s['h100_memory_bytes'] / GB:.0f} x 10^9 bytes; as 80 GiB, {total['gib']:,.1f} / 80 = "
            f"{s['state_h100s_if_80_gib']:.2f} gives {math.ceil(s['state_h100s_if_80_gib'])} GPUs: the unit differs, "
            "not the arithmetic.\n")


def fsdp_memory(rows: list[Row]) -> str:
    state, s = _one(rows, table="state", component="total"), _scalars(rows)
    memory_gb = s["tpu_memory_bytes"] / GB
    return ("S (weights, gradients, optimizer state) and half of A (saved activations, every second layer) are split "
            "N_FSDP ways; the other half of A stays whole on every device:\n\n"
            "    memory per device = (S + A/2) / N_FSDP + A/2\n"
            f"    S = {state['gb']:,.2f} GB,  A = {s['activation_bytes_per_token']:,.0f} bytes x tokens\n\n"
            f"Below {memory_gb:.0f} GB per device (a v5p chip): N_FSDP > (S + A/2) / "
            f"({memory_gb:.0f} GB - A/2), which has a solution only while A/2 < {memory_gb:.0f} GB, that is below "
            f"{s['fsdp_max_tokens']:,.0f} tokens.\n")


def fsdp_answer(rows: list[Row]) -> str:
    state, s = _one(rows, table="state", component="total"), _scalars(rows)
    fsdp = {r["tokens"]: r for r in select(rows, table="fsdp")}
    memory_gb = s["tpu_memory_bytes"] / GB
    example = fsdp.get(DEFAULT_SEQUENCES * EXAMPLE_SEQ_LEN)
    example_text = (f", and {example['min_fsdp_devices']} with the activations of {DEFAULT_SEQUENCES} x "
                    f"{EXAMPLE_SEQ_LEN:,} tokens" if example and example["min_fsdp_devices"] is not None else "")
    return (f"**Answer.** For the state alone N_FSDP must be at least {fsdp[0]['min_fsdp_devices']} "
            f"({state['gb']:,.2f} / {memory_gb:.0f} = {state['gb'] / memory_gb:.2f}){example_text}; past the token "
            "limit above, none is enough.\n")


def compute_bound_model(rows: list[Row]) -> str:
    q, m, s = _question(rows), _one(rows, table="model"), _scalars(rows)
    x, y, mx, my = q["data_devices"], q["tensor_devices"], q["data_axes"], q["tensor_axes"]
    return "\n".join([
        f"## (c) Compute-bound batch on TPU v5p, X = {x} (FSDP, M_X = {mx}), Y = {y} (TP, M_Y = {my})\n",
        f"C = {s['flops_per_s']:.2g} FLOP/s, W_ici = {s['ici_bytes_per_s']:.2g} bytes/s per mesh axis (both "
        f"ways), alpha = C / W_ici = {s['alpha']:,.1f} FLOP/byte; one block's forward pass on one chip, batch "
        f"B tokens, N = X Y = {x * y}, D = d_model, F = d_ff; a bf16 collective of V bytes over M axes takes "
        "V / (M W) (the scaling book's model):\n",
        "    T_math = 2 x 2 B D F / (N C)                 two matmuls, split over all N chips",
        "    T_FSDP = 2 x (2 D F / Y) / (M_X W)           all-gather W_in[D, F_Y] and W_out[F_Y, D] over X",
        "    T_TP   = 2 x (2 B D / X) / (M_Y W)           all-gather In[B_X, D], reduce-scatter Out over Y\n",
        "Collectives overlap the matmuls but not each other: compute bound when T_math >= T_FSDP + T_TP; dividing "
        "by 4 D / W, with b = B / N (B / X = b Y):\n",
        "    F / (Y M_X) + b Y / M_Y <= b F / alpha",
        f"    b >= F / (Y M_X) / (F / alpha - Y / M_Y) = {m['d_ff'] / (y * mx):,.0f} / ({m['d_ff'] / s['alpha']:.2f} - "
        f"{y / my:g}) = {q['forward_min_tokens_per_device']:.1f} tokens per chip\n",
    ])


def compute_bound_answer(rows: list[Row]) -> str:
    q, s = _question(rows), _scalars(rows)
    exact = _one(rows, table="crossover", mesh=QUESTION_MESH, exact_ring=True)
    n, forward = q["data_devices"] * q["tensor_devices"], q["forward_min_tokens_per_device"]
    binding = "forward" if forward >= q["backward_min_tokens_per_device"] else "backward"
    chip_bytes = s["question_state_bytes_per_device"] + s["question_activation_bytes_per_device"]
    return (f"**Answer.** The forward pass is compute bound from {forward:.1f} tokens per chip, an overall batch of "
            f"{n} x {forward:.1f} = {forward * n:,.0f} tokens.\n\n"
            f"Checks: exact ring factors ((N - 1) / N) lower it to {exact['forward_min_tokens_per_device']:.1f} "
            f"({exact['forward_min_tokens_per_device'] * n:,.0f} overall); the backward pass needs "
            f"{q['backward_min_tokens_per_device']:.1f}, so the {binding} pass sets the batch; each chip then holds "
            f"{s['question_state_bytes_per_device'] / GB:.1f} GB of fp32 state and "
            f"{s['question_activation_bytes_per_device'] / GB:.1f} GB of saved activations, "
            f"{'within' if chip_bytes < s['tpu_memory_bytes'] else 'beyond'} {s['tpu_memory_bytes'] / GB:.0f} GB.\n")


def smaller_batches(rows: list[Row]) -> str:
    q, s = _question(rows), _scalars(rows)
    fp8 = _one(rows, table="crossover", mesh=QUESTION_MESH, comm_bytes_per_element=FP8_BYTES)
    stage = _one(rows, table="crossover", mesh=STAGE_MESH)
    pipeline = select(rows, table="pipeline")
    model = _one(rows, table="model")
    n = q["data_devices"] * q["tensor_devices"]
    bubbles = ", ".join(f"{r['bubble_fraction']:.0%} with m = {r['microbatches']}" for r in pipeline)
    stage_bound = stage["min_tokens_per_device"] == 0
    if q["forward_min_tokens_per_device"] >= q["backward_min_tokens_per_device"]:
        recompute_text = ("Activation recomputation does not lower the threshold (it adds forward FLOPs to the "
                          "backward pass; the forward binds) but frees memory for less FSDP and more TP.")
    else:
        recompute_text = ("Activation recomputation adds forward FLOPs to the backward pass, which binds here, "
                          "so it lowers the backward threshold as well as freeing memory.")
    stage_text = (f"TP at Y = {stage['tensor_devices']} is "
                  f"{'compute bound at any batch' if stage_bound else 'communication bound at every batch'} "
                  f"(F / alpha = {model['d_ff'] / s['alpha']:.1f} {'>=' if stage_bound else '<'} Y)")
    return "\n".join([
        "## (d) Smaller batches at full throughput\n",
        f"The forward threshold is smallest at Y* = F M_Y / (2 alpha) = {s['best_tensor_devices']:.1f}, the scaling "
        f"book's floor 4 alpha^2 / (F M_X M_Y) = {s['fsdp_tp_floor_tokens_per_device']:.1f} tokens per chip "
        f"({s['fsdp_tp_floor_tokens_per_device'] * n:,.0f} on {n} chips; Austin et al., How to Scale Your Model): "
        "more TP shrinks the weight gathers while Y < F M_Y / alpha keeps activation traffic below compute. 8-bit "
        f"gathers (ZeRO++, Wang et al. 2023) bring {q['data_devices']} x {q['tensor_devices']} to "
        f"{fp8['min_tokens_per_device']:.1f} ({fp8['min_global_tokens']:,.0f}). Pipeline parallelism (GPipe, 1F1B) "
        f"moves no weights: {stage_text}, a "
        f"microbatch's [b, D] send costs {s['pipeline_send_to_compute']:.2%} of a stage's matmul time "
        f"(e alpha P / (4 F L), P = {pipeline[0]['stages']}); the price is the bubble (P - 1) / (m + P - 1), "
        f"{bubbles}, so small batches need many microbatches or a zero-bubble schedule (Qi et al. 2023). "
        f"{recompute_text}\n",
    ])


def ring_latency(rows: list[Row]) -> str:
    s = _scalars(rows)
    crossovers = ", ".join(f"{size(s[f'latency_bound_below_bytes_{n}'])} at N = {n}" for n in COLLECTIVE_DEVICE_COUNTS)
    return ("Ring times on one v5p ICI axis (cs336_systems.accounting.communication; "
            f"{s['ici_hop_latency_s'] * US:g} us per hop) are latency bound below N w latency: {crossovers}.\n")


def plotted(row: Row) -> bool:
    """A layer-times row of a mesh the figure draws."""
    return row.get("table") == "layer_times" and row["mesh"] in PLOTTED_MESHES


def collective_cells(collectives: list[Row]) -> list[Row]:
    """One line per (array bytes, devices): each collective's total time, and all-gather's latency share."""
    cells: dict[tuple, dict[str, Row]] = {}
    for r in collectives:
        cells.setdefault((r["array_bytes"], r["devices"]), {})[r["collective"]] = r
    return [{"array_bytes": nbytes, "devices": devices, **{name: cell[name]["total_us"] for name in COLLECTIVES},
             "all_gather_latency_share": cell["all_gather"]["latency_term_us"] / cell["all_gather"]["total_us"]}
            for (nbytes, devices), cell in sorted(cells.items())]


def write_communication_accounting(report_dir: Path | str, command: str = ANALYSIS_COMMAND) -> Path:
    """Write <report_dir>/communication_accounting.md, .csv (every row) and its figure; returns the .md path.

    The report has no date or device in it, so writing it again gives identical files.
    """
    from cs336_systems.reports.problems import report

    sources = "`cs336_systems.accounting.communication` and `cs336_systems.accounting.parallelism`"
    return write_closed_form(report(PROBLEM), communication_accounting_rows(), report_dir, command, sources)


# ---------------------------------------------------------------------------------------------- answers

def answer_communication_accounting(reports: Reports) -> list[str]:
    rows = reports["communication_accounting"]
    scalars = _scalars(rows)
    model, total = find(rows, table="model"), find(rows, table="state", component="total")
    sentences = []
    if model and total and "state_h100s" in scalars and "activation_bytes_per_token" in scalars:
        sentences.append(
            f"(a) The XXL model has {model['num_params']:,} parameters; fp32 master weights, gradients and Adam's "
            f"moments take {total['gb']:,.2f} GB, {scalars['state_h100s']:.2f} H100 80GB GPUs' worth "
            f"({math.ceil(scalars['state_h100s'])} GPUs), and the activations saved for backward add "
            f"{scalars['activation_bytes_per_token'] / MB:.2f} MB per token in bf16.")
    else:
        sentences.append(not_in_report("The XXL model's memory"))
    fsdp = [r for r in select(rows, table="fsdp") if r.get("min_fsdp_devices") is not None]
    if fsdp and "fsdp_max_tokens" in scalars and "tpu_memory_bytes" in scalars:
        state_only = min(fsdp, key=lambda r: r["tokens"])
        most = max(fsdp, key=lambda r: r["tokens"])
        sentences.append(
            f"(b) On {scalars['tpu_memory_bytes'] / GB:g} GB devices the state alone needs N_FSDP >= "
            f"{state_only['min_fsdp_devices']}, and "
            f"{most['min_fsdp_devices']} with the activations of {most['tokens']:,} tokens; from "
            f"{scalars['fsdp_max_tokens']:,.0f} tokens on no N_FSDP is enough.")
    crossovers = [r for r in select(rows, table="crossover", strategy="fsdp_tp", exact_ring=False)
                  if r["comm_bytes_per_element"] == 2 and math.isfinite(r["min_tokens_per_device"])]
    asked_mesh = (QUESTION_DATA_DEVICES, QUESTION_TENSOR_DEVICES)
    asked = next((r for r in crossovers if (r["data_devices"], r["tensor_devices"]) == asked_mesh), None)
    if asked:
        best = min(crossovers, key=lambda r: r["min_tokens_per_device"])
        eight_bit = find(rows, table="crossover", mesh=asked["mesh"], exact_ring=False, comm_bytes_per_element=1)
        text = (f"(c, d) On the {asked['mesh']} v5p mesh a block's forward and backward passes are compute bound "
                f"from {asked['min_tokens_per_device']:.1f} tokens per chip ({asked['min_global_tokens']:,.0f} in the "
                f"batch); the {best['mesh']} split lowers that to {best['min_tokens_per_device']:.1f} "
                f"({best['min_global_tokens']:,.0f})")
        if eight_bit:
            text += (f", 8-bit collectives to {eight_bit['min_tokens_per_device']:.1f} "
                     f"({eight_bit['min_global_tokens']:,.0f})")
        bubbles = sorted(select(rows, table="pipeline"), key=lambda r: (r["stages"], r["microbatches"]))
        sentences.append(text + ", and pipeline parallelism removes the batch-dependent term at the price of an idle "
                         "bubble" + (" (" + ", ".join(f"{format_share(r['bubble_fraction'])} for {r['stages']} stages "
                                                      f"and {r['microbatches']} microbatches" for r in bubbles) + ")."
                                     if bubbles else "."))
    else:
        sentences.append(not_in_report(f"The compute-bound batch of the {QUESTION_DATA_DEVICES} x "
                                       f"{QUESTION_TENSOR_DEVICES} mesh"))
    return sentences
