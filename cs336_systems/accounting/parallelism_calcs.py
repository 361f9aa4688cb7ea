"""The Spring 2026 handout's parallelism problems, one report each: alternate_ring_all_reduce,
data_parallel_calcs, fsdp_calcs, tp_calcs and fsdp_tp_calcs.

Nothing is measured: every answer is a closed form of `cs336_systems.accounting.ffn_parallelism`,
stated part by part in the handout's symbols (B, D, D_FF, N_DP / N_FSDP / N_TP, C, W, S) with its
derivation, then evaluated for one node of 8 NVLink GPUs. `ROWS` gives, per problem, every number its
report states; cs336_systems.reports.parallelism_calcs writes the reports (the same bytes on every run).
"""

from __future__ import annotations

from cs336_systems.accounting.activations import parameter_count
from cs336_systems.accounting.communication import all_reduce_s, alternate_all_reduce_s
from cs336_systems.accounting.ffn_parallelism import (
    FP16_BYTES,
    dp_backward_comm_s,
    dp_max_devices,
    flops_per_device,
    fsdp_comm_s,
    fsdp_max_devices,
    fsdp_tp_forward_comm,
    fsdp_tp_headroom,
    fsdp_tp_max_devices_overlapped,
    fsdp_tp_max_devices_shared,
    tp_comm_s,
    tp_max_devices,
)
from cs336_systems.accounting.parallelism import PASSES
from cs336_systems.gpus import GPU_SPECS, NVLINK_BYTES_PER_S_PER_DIRECTION
from cs336_systems.model import ModelConfig
from cs336_systems.rows import Row

PROBLEMS = ("alternate_ring_all_reduce", "data_parallel_calcs", "fsdp_calcs", "tp_calcs", "fsdp_tp_calcs")
MS = 1e3

# The worked figure: one node of 8 GPUs on NVLink 4. H100 SXM and H200 have the same dense FP16 peak
# and the same NVLink, so one figure serves both; W is one direction of a GPU's NVLink (the handout's
# egress bandwidth), C the datasheet's dense FP16 tensor-core peak.
NODE_GPUS = ("h100", "h200")
NODE_SIZE = 8
NODE_DEVICE_COUNTS = (2, 4, 8)
# The layer: an FFN of the 2026 table's xl model, and a global batch of 8 GPUs x 4 sequences of 512 tokens.
FIGURE_SIZE = "xl"
FIGURE_SIZE_TABLE = "2026"
FIGURE_SEQUENCES, FIGURE_CONTEXT = NODE_SIZE * 4, 512


def _node() -> dict[str, float]:
    specs = [GPU_SPECS[slug] for slug in NODE_GPUS]
    flops = {spec.bf16_flops for spec in specs}
    links = {NVLINK_BYTES_PER_S_PER_DIRECTION[slug] for slug in NODE_GPUS}
    if len(flops) != 1 or len(links) != 1:
        raise ValueError(f"{' and '.join(NODE_GPUS)} no longer share C and W: give each its own figure")
    return {"C": flops.pop(), "W": links.pop()}


def _layer() -> dict[str, int]:
    config = ModelConfig.for_size(FIGURE_SIZE, FIGURE_CONTEXT, table=FIGURE_SIZE_TABLE)
    return {"B": FIGURE_SEQUENCES * FIGURE_CONTEXT, "D": config.d_model, "D_FF": config.d_ff}


def _setting_rows(problem: str) -> list[Row]:
    node, layer = _node(), _layer()
    return [{"problem": problem, "table": "setting", "gpus": " / ".join(GPU_SPECS[s].name for s in NODE_GPUS),
             "C_flops_per_s": node["C"], "W_bytes_per_s": node["W"], "size": FIGURE_SIZE,
             "size_table": FIGURE_SIZE_TABLE, **layer, "sequences": FIGURE_SEQUENCES, "context_length": FIGURE_CONTEXT}]


def _timing(problem: str, strategy_devices: dict, phase: str, compute_s: float, comm_s: float, **extra) -> Row:
    return {"problem": problem, "table": "node", **strategy_devices, "phase": phase, "compute_ms": compute_s * MS,
            "comm_ms": comm_s * MS, **extra, "comm_bottlenecked": comm_s > compute_s}


def alternate_rows() -> list[Row]:
    problem = "alternate_ring_all_reduce"
    node = _node()
    config = ModelConfig.for_size(FIGURE_SIZE, FIGURE_CONTEXT, table=FIGURE_SIZE_TABLE)
    gradient_bytes = FP16_BYTES * parameter_count(config)
    rows = _setting_rows(problem)
    for n in NODE_DEVICE_COUNTS:
        ring, alternate = all_reduce_s(gradient_bytes, n, node["W"]), alternate_all_reduce_s(gradient_bytes, n, node["W"])
        rows.append({"problem": problem, "table": "node", "N": n, "S_bytes": gradient_bytes, "ring_ms": ring * MS,
                     "alternate_ms": alternate * MS, "alternate_over_ring": alternate / ring})
    return rows


def _single_axis_rows(problem: str, devices: str, phases: tuple[str, ...], comm_s, max_devices) -> list[Row]:
    """The worked figure of a one-axis strategy: per phase, compute and communication time on 2, 4 and 8
    devices, and the bound. comm_s(layer, N, W, phase) and max_devices(layer, C, W, phase) take the
    layer's B, D and D_FF as a dict."""
    node, layer = _node(), _layer()
    rows = _setting_rows(problem)
    for phase in phases:
        for n in NODE_DEVICE_COUNTS:
            compute_s = flops_per_device(layer["B"], layer["D"], layer["D_FF"], n, phase) / node["C"]
            rows.append(_timing(problem, {devices: n}, phase, compute_s, comm_s(layer, n, node["W"], phase)))
        rows.append({"problem": problem, "table": "bound", "phase": phase,
                     "max_devices": max_devices(layer, node["C"], node["W"], phase)})
    return rows


def data_parallel_rows() -> list[Row]:
    return _single_axis_rows("data_parallel_calcs", "N_DP", ("backward",),
                             lambda layer, n, w, phase: dp_backward_comm_s(layer["D"], layer["D_FF"], n, w),
                             lambda layer, c, w, phase: dp_max_devices(layer["B"], c, w))


def fsdp_rows() -> list[Row]:
    return _single_axis_rows("fsdp_calcs", "N_FSDP", PASSES,
                             lambda layer, n, w, phase: fsdp_comm_s(layer["D"], layer["D_FF"], n, w, phase),
                             lambda layer, c, w, phase: fsdp_max_devices(layer["B"], c, w, phase))


def tp_rows() -> list[Row]:
    return _single_axis_rows("tp_calcs", "N_TP", PASSES,
                             lambda layer, n, w, phase: tp_comm_s(layer["B"], layer["D"], n, w),
                             lambda layer, c, w, phase: tp_max_devices(layer["D_FF"], c, w, phase))


def fsdp_tp_rows() -> list[Row]:
    problem = "fsdp_tp_calcs"
    node, layer = _node(), _layer()
    B, D, D_FF, C, W = layer["B"], layer["D"], layer["D_FF"], node["C"], node["W"]
    rows = _setting_rows(problem)
    compute_s = flops_per_device(B, D, D_FF, NODE_SIZE, "forward") / C
    for n_fsdp in (1, 2, 4, 8):
        n_tp = NODE_SIZE // n_fsdp
        times = fsdp_tp_forward_comm(B, D, D_FF, n_fsdp, n_tp, W)
        shared_s = times.total_s(overlapped=False)
        rows.append(_timing(problem, {"N_FSDP": n_fsdp, "N_TP": n_tp}, "forward", compute_s,
                            times.total_s(overlapped=True), fsdp_axis_ms=times.fsdp_s * MS, tp_axis_ms=times.tp_s * MS,
                            shared_comm_ms=shared_s * MS, shared_comm_bottlenecked=shared_s > compute_s))
    a, b = fsdp_tp_headroom(B, D_FF, C, W)
    rows.append({"problem": problem, "table": "headroom", "a": a, "b": b})
    for axes, bound in (("overlapped", fsdp_tp_max_devices_overlapped(B, D_FF, C, W)),
                        ("shared", fsdp_tp_max_devices_shared(B, D_FF, C, W))):
        rows.append({"problem": problem, "table": "bound", "phase": "forward", "axes": axes, "max_devices": bound.N,
                     "N_FSDP": bound.N_FSDP, "N_TP": bound.N_TP})
    return rows


ROWS = {"alternate_ring_all_reduce": alternate_rows, "data_parallel_calcs": data_parallel_rows,
        "fsdp_calcs": fsdp_rows, "tp_calcs": tp_rows, "fsdp_tp_calcs": fsdp_tp_rows}
