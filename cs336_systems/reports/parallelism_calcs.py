"""The answers of the Spring 2026 handout's parallelism problems, alternate_ring_all_reduce,
data_parallel_calcs, fsdp_calcs, tp_calcs and fsdp_tp_calcs: each part in the handout's symbols with its
derivation, then the worked figure for one node of 8 NVLink GPUs from the rows of
cs336_systems.accounting.parallelism_calcs (its tables are declared in cs336_systems.reports.problems).
`write_parallelism_calcs` writes them (the same bytes on every run).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

from cs336_systems.accounting.ffn_parallelism import TP_BACKWARD_EQUATIONS
from cs336_systems.accounting.parallelism_calcs import NODE_SIZE, PROBLEMS, ROWS
from cs336_systems.gpus import GB, TERA
from cs336_systems.reports import ANALYSIS_COMMAND, Reports, find, format_ms, not_in_report, select, write_closed_form
from cs336_systems.rows import Row

ASSUMPTIONS = ("Assumptions, as the handout sets them: FP16 weights, activations and communication (2 bytes); only "
               "matmuls count, (A, B) x (B, C) taking 2ABC FLOPs; B is the global batch in tokens; ring collectives "
               "take (N - 1) / N S / W (all-gather, reduce-scatter) and 2 (N - 1) / N S / W (all-reduce) with no "
               "latency term; computation and communication overlap, so a pass is communication bottlenecked when "
               "communication takes longer than computation. FLOPs and times are per device.\n")


def _setting(rows: list[Row]) -> Row:
    return select(rows, table="setting")[0]


def _node_sentence(rows: list[Row]) -> str:
    s = _setting(rows)
    return (f"Worked figure: one node of {NODE_SIZE} GPUs ({s['gpus']}, NVLink 4). W = {s['W_bytes_per_s'] / GB:.0f} "
            f"GB/s, one direction of a GPU's NVLink (its egress bandwidth); C = {s['C_flops_per_s'] / TERA:.1f} "
            "TFLOP/s, the dense FP16 tensor-core peak; both GPUs share C and W, so the figure holds for either; "
            f"C / W = {s['C_flops_per_s'] / s['W_bytes_per_s']:,.0f} FLOP per byte. The layer is the {s['size_table']} "
            f"table's {s['size']} FFN, D = {s['D']:,}, D_FF = {s['D_FF']:,}, and B = {s['B']:,} tokens "
            f"({s['sequences']} sequences of {s['context_length']}, 4 per GPU).")


def _bound(rows: list[Row], phase: str) -> float:
    return select(rows, table="bound", phase=phase)[0]["max_devices"]


def _devices(bound: float) -> str:
    return f"{bound:,.2f}, so up to {math.floor(bound):,} devices"


def yes_no(column: str):
    """A table cell of whether the row's `column` holds: "yes" or "no"."""
    return lambda row: "yes" if row[column] else "no"


def alternate(rows: list[Row]) -> str:
    largest = max(select(rows, table="node"), key=lambda r: r["N"])
    return "\n".join([
        "Each x(i) is S bytes and every device sends at W bytes/s. In step t = 1 ... N - 1, device i sends "
        "x((i - t + 1) mod N), the array it received in the step before (its own at t = 1), and adds the "
        "x((i - t) mod N) it receives to its sum y. After N - 1 steps y = x(1) + ... + x(N) on every device.\n",
        "**Answer.** T = (N - 1) S / W. Justification: each of the N - 1 steps has every device send a whole "
        "S-byte array, which takes S / W, and all devices send at once.\n",
        "The ring all-reduce (reduce-scatter then all-gather) sends S / N bytes per step for 2 (N - 1) steps, "
        "2 (N - 1) S / (N W): the alternate algorithm takes N / 2 times as long, the same for N = 2 and worse "
        "for every larger N, because it never splits the array.\n",
        _node_sentence(rows) + f" S is the {_setting(rows)['size']} model's FP16 gradients, "
        f"{largest['S_bytes'] / GB:.2f} GB.\n",
    ])


def data_parallel(rows: list[Row]) -> str:
    bound = _bound(rows, "backward")
    return "\n".join([
        "Each of N_DP devices holds the whole layer and x(i), a (B / N_DP, D) slice of the batch.\n",
        "**(a)** 12 B D D_FF / N_DP FLOPs per device. Justification: the backward (equations 24-30) is six "
        "matmuls with a (B / N_DP) x D x D_FF shape each, 2 (B / N_DP) D D_FF FLOPs apiece: dz = dy W3^T, "
        "dx1 W1^T and dx2 W2^T (summed into dx), and dW3 = z^T dy, dW2 = x^T dx2, dW1 = x^T dx1 (12 B D D_FF over "
        "all devices, as on one).\n",
        "**(b)** 12 (N_DP - 1) D D_FF / (N_DP W) seconds. Justification: the three weight gradients, "
        "3 D D_FF FP16 values, S = 6 D D_FF bytes, are all-reduced, 2 (N_DP - 1) / N_DP S / W; the batch does not "
        "enter.\n",
        "**(c)** N_DP <= 1 + B W / C. Justification: compute bound while 12 (N_DP - 1) D D_FF / (N_DP W) <= "
        "12 B D D_FF / (N_DP C); N_DP and D D_FF cancel, leaving N_DP - 1 <= B W / C: more devices add traffic "
        "per device (towards 2 S) while cutting each one's compute, and only a larger batch buys room.\n",
        _node_sentence(rows) + f" Then 1 + B W / C = {_devices(bound)}.\n",
    ])


def fsdp(rows: list[Row]) -> str:
    forward, backward = _bound(rows, "forward"), _bound(rows, "backward")
    return "\n".join([
        "Each of N_FSDP devices holds a 1 / N_FSDP shard of W1, W2 and W3 (D D_FF / N_FSDP values each) and a "
        "(B / N_FSDP, D) slice of the batch. The forward all-gathers the three weights before use (equations "
        "34-36); they are freed after, so the backward all-gathers them again and reduce-scatters the three "
        "gradients (equations 42-44).\n",
        "**(a)** Backward: 12 B D D_FF / N_FSDP FLOPs per device; forward: 6 B D D_FF / N_FSDP. Justification: "
        "once gathered, the weights are whole, so each device runs the unsharded layer on its B / N_FSDP tokens: "
        "three matmuls of 2 (B / N_FSDP) D D_FF forward, six backward.\n",
        "**(b)** Backward: 12 (N_FSDP - 1) D D_FF / (N_FSDP W) seconds; forward: 6 (N_FSDP - 1) D D_FF / "
        "(N_FSDP W). Justification: the forward is one all-gather of S = 3 x 2 D D_FF bytes, (N_FSDP - 1) / "
        "N_FSDP S / W; the backward is that all-gather again plus a reduce-scatter of the same size, twice as "
        "long (the same bytes as DP's all-reduce).\n",
        "**(c)** Backward: N_FSDP <= 1 + B W / C; forward: N_FSDP <= 1 + B W / C. Justification: forward "
        "6 (N_FSDP - 1) D D_FF / (N_FSDP W) <= 6 B D D_FF / (N_FSDP C) gives N_FSDP - 1 <= B W / C; the backward "
        "doubles both sides, so the same bound, which is also DP's: FSDP moves the weights twice instead of the "
        "gradients once, but splits the compute the same way.\n",
        _node_sentence(rows) + f" Then 1 + B W / C = {_devices(forward)} for the forward and "
        f"{_devices(backward)} for the backward.\n",
    ])


def tp(rows: list[Row]) -> str:
    forward, backward = _bound(rows, "forward"), _bound(rows, "backward")
    return "\n".join([
        "Each of N_TP devices holds W1(i) and W2(i), (D, D_FF / N_TP) column shards, and W3(i), the matching "
        "(D_FF / N_TP, D) row shard, and the whole batch: x1(i) = x W1(i), x2(i) = x W2(i), z(i) = f(x1(i)) * "
        "x2(i), y(i) = z(i) W3(i), y = all-reduce({y(i)}) (equations 47-51).\n",
        "**(a)** The backward on device i, given dY (B, D), the same on every device since y was all-reduced, and "
        "the saved x, x1(i), x2(i), z(i):\n",
        "\n".join(f"    {line}" for line in TP_BACKWARD_EQUATIONS) + "\n",
        "Each device's weight gradients use only its own columns of D_FF, so they need no communication; the two "
        "products into dx are summed on the device and all-reduced once. (`cs336_systems.accounting."
        "ffn_parallelism.tp_backward` evaluates these equations; the tests compare it with autograd on the "
        "unsharded layer.)\n",
        "**(b)** Forward: 6 B D D_FF / N_TP FLOPs per device; backward: 12 B D D_FF / N_TP. Justification: every "
        "matmul keeps all B tokens and D but only D_FF / N_TP of the hidden width: three forward and six backward "
        "matmuls of 2 B D D_FF / N_TP.\n",
        "**(c)** Forward: 4 (N_TP - 1) B D / (N_TP W) seconds; backward: 4 (N_TP - 1) B D / (N_TP W). "
        "Justification: the forward all-reduces y, the backward dx, each B D FP16 values, S = 2 B D bytes, "
        "2 (N_TP - 1) / N_TP S / W; the weights never move.\n",
        "**(d)** Backward: N_TP <= 1 + 3 D_FF W / C; forward: N_TP <= 1 + 3 D_FF W / (2 C). Justification: "
        "4 (N_TP - 1) B D / (N_TP W) <= 12 B D D_FF / (N_TP C) gives N_TP - 1 <= 3 D_FF W / C, and against the "
        "forward's 6 B D D_FF half that; the batch cancels (both sides grow with it), so TP's limit is set by the "
        "layer's width, and the forward, with half the FLOPs for the same traffic, binds first.\n",
        _node_sentence(rows) + f" Then the forward allows {_devices(forward)} and the backward {_devices(backward)}.\n",
    ])


def fsdp_tp(rows: list[Row]) -> str:
    headroom = select(rows, table="headroom")[0]
    overlapped = select(rows, table="bound", axes="overlapped")[0]
    shared = select(rows, table="bound", axes="shared")[0]
    a, b = headroom["a"], headroom["b"]
    return "\n".join([
        "N = N_FSDP N_TP devices in a grid: device (i, j) holds W1(i, j), W2(i, j), W3(i, j), the FSDP shards "
        "(1 / N_FSDP) of TP shard i, and x(j), a (B / N_FSDP, D) slice of the batch. The forward all-gathers "
        "W1(i), W2(i), W3(i) over the FSDP axis, runs TP shard i on x(j), and all-reduces y(i, j) over the TP "
        "axis (equations 52-59).\n",
        "**(a)** 6 B D D_FF / (N_FSDP N_TP) FLOPs per device. Justification: three matmuls, each on B / N_FSDP "
        "tokens and D_FF / N_TP hidden units, 2 (B / N_FSDP) D (D_FF / N_TP) FLOPs apiece.\n",
        "**(b)** max(6 (N_FSDP - 1) D D_FF / (N_FSDP N_TP W), 4 (N_TP - 1) B D / (N_TP N_FSDP W)) seconds. "
        "Justification: the FSDP axis all-gathers three (D, D_FF / N_TP) shards, S = 6 D D_FF / N_TP bytes, "
        "(N_FSDP - 1) / N_FSDP S / W; the TP axis all-reduces y(j), S = 2 B D / N_FSDP bytes, 2 (N_TP - 1) / N_TP "
        "S / W; the two overlap, so the longer one counts.\n",
        "**(c)** N <= (1 + B W / C)(1 + 3 D_FF W / (2 C)). Justification: with compute 6 B D D_FF / (N_FSDP N_TP "
        "C), the FSDP term stays below it while N_FSDP - 1 <= B W / C = a and the TP term while N_TP - 1 <= "
        "3 D_FF W / (2 C) = b (the DP/FSDP and TP forward bounds, unchanged by the other axis, since each "
        "collective and the compute shrink by the other degree alike). The two conditions are independent, so "
        "the optimal setting takes each to its limit, N_FSDP = 1 + a, N_TP = 1 + b, and N = (1 + a)(1 + b): the "
        "product of the two single-axis limits, about B D_FF (3/2) (W / C)^2 for large a and b.\n",
        "**(d)** N <= (a b + a + b)^2 / (4 a b) with a = B W / C, b = 3 D_FF W / (2 C), when a >= b / (1 + b) and "
        "b >= a / (1 + a); otherwise N <= 1 + b (all TP) if a < b / (1 + b), N <= 1 + a (all FSDP) if "
        "b < a / (1 + a). Justification: now the two collectives add, so dividing by the compute the condition is "
        "(N_FSDP - 1) / a + (N_TP - 1) / b <= 1. N = N_FSDP N_TP is largest on that line; with N_TP = 1 + "
        "b (1 - (N_FSDP - 1) / a), N is a downward parabola in N_FSDP with its top at N_FSDP = a L / 2, N_TP = "
        "b L / 2, L = 1 + 1 / a + 1 / b, where N = a b L^2 / 4 = (a b + a + b)^2 / (4 a b). If that top needs "
        "N_FSDP < 1 (or N_TP < 1), the line's end on the other axis is the best. For large a and b, N -> a b / 4: "
        "sharing the network costs a factor of about 4 against (c), since each axis gets half the time budget "
        "and so half its degree.\n",
        _node_sentence(rows) + f" Then a = {a:,.2f} and b = {b:,.2f}: with overlap, N <= {overlapped['max_devices']:,.1f} "
        f"(N_FSDP = {overlapped['N_FSDP']:,.2f}, N_TP = {overlapped['N_TP']:,.2f}); sharing the network, N <= "
        f"{shared['max_devices']:,.1f} (N_FSDP = {shared['N_FSDP']:,.2f}, N_TP = {shared['N_TP']:,.2f}). The "
        f"splits of one {NODE_SIZE}-GPU node, forward pass:\n"
    ])


def write_parallelism_calcs(report_dir: Path | str, command: str = ANALYSIS_COMMAND) -> list[Path]:
    """Write <report_dir>/<problem>.md and .csv for each of PROBLEMS; returns the .md paths."""
    from cs336_systems.reports.problems import report

    return [write_closed_form(report(problem), ROWS[problem](), report_dir, command,
                              "`cs336_systems.accounting.ffn_parallelism`") for problem in PROBLEMS]


# ---------------------------------------------------------------------------------------------- answers

def _node_clause(setting: Row) -> str:
    return (f"on {NODE_SIZE} NVLink GPUs (C = {setting['C_flops_per_s'] / 1e12:.1f} TFLOP/s, W = "
            f"{setting['W_bytes_per_s'] / GB:.0f} GB/s) with the {setting['size_table']} {setting['size']} FFN and "
            f"B = {setting['B']:,} tokens")


def answer_alternate_ring_all_reduce(reports: Reports) -> list[str]:
    rows = reports["alternate_ring_all_reduce"]
    node = select(rows, table="node")
    if not node:
        return [not_in_report("The worked figure")]
    largest = max(node, key=lambda r: r["N"])
    return [f"T = (N - 1) S / W, N/2 times the ring all-reduce's 2 (N - 1) S / (N W): for the xl model's FP16 "
            f"gradients ({largest['S_bytes'] / GB:.2f} GB) on {largest['N']} NVLink GPUs, "
            f"{format_ms(largest['alternate_ms'])} against {format_ms(largest['ring_ms'])}."]


def _bound_answer(report: str, formulas: dict[str, str]) -> Callable[[Reports], list[str]]:
    """The answer of a problem whose report gives a bound on the devices per pass: each pass's formula (of
    `formulas`, by pass) and its value in the worked figure."""
    def answer(reports: Reports) -> list[str]:
        rows = reports[report]
        setting = find(rows, table="setting")
        if setting is None:
            return [not_in_report("The worked figure")]
        bounds = "; ".join(f"{phase}: {formula} = {find(rows, table='bound', phase=phase)['max_devices']:,.2f}"
                           for phase, formula in formulas.items() if find(rows, table="bound", phase=phase))
        return [f"Answered part by part in the handout's symbols; {_node_clause(setting)}: {bounds}."]
    return answer


answer_data_parallel_calcs = _bound_answer("data_parallel_calcs", {"backward": "N_DP <= 1 + B W / C"})
answer_fsdp_calcs = _bound_answer("fsdp_calcs", {"forward": "N_FSDP <= 1 + B W / C",
                                                   "backward": "N_FSDP <= 1 + B W / C"})
answer_tp_calcs = _bound_answer("tp_calcs", {"forward": "N_TP <= 1 + 3 D_FF W / (2 C)",
                                             "backward": "N_TP <= 1 + 3 D_FF W / C"})


def answer_fsdp_tp_calcs(reports: Reports) -> list[str]:
    rows = reports["fsdp_tp_calcs"]
    setting = find(rows, table="setting")
    overlapped, shared = find(rows, table="bound", axes="overlapped"), find(rows, table="bound", axes="shared")
    if setting is None or not (overlapped and shared):
        return [not_in_report("The worked figure")]
    return [f"Answered part by part in the handout's symbols; {_node_clause(setting)}: with the axes overlapped N <= "
            f"(1 + B W / C)(1 + 3 D_FF W / (2 C)) = {overlapped['max_devices']:,.1f}, sharing the network N <= "
            f"(a b + a + b)^2 / (4 a b) = {shared['max_devices']:,.1f}."]
