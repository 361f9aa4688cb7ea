"""Problem communication_accounting (2025 handout): the XXL model's memory, FSDP degree and compute-bound
batch on a TPU v5p mesh, with ring collectives and DP / FSDP / TP / FSDP+TP limits of its block on that
mesh. The 2026 handout's parallelism problems are `parallelism_calcs`.

Nothing here is measured: `communication_accounting_rows` evaluates the closed-form models of
`cs336_systems.accounting.communication` and `.parallelism`, and cs336_systems.reports.communication_accounting
writes every answer and derivation from those rows.
"""

from __future__ import annotations

from cs336_systems.accounting.communication import COLLECTIVES, latency_bound_below_bytes
from cs336_systems.accounting.parallelism import (
    BF16_BYTES,
    ICI_HOP_LATENCY_S,
    PASSES,
    TPU_V5P_FLOPS_PER_S,
    TPU_V5P_ICI_BYTES_PER_S,
    TPU_V5P_MEMORY_BYTES,
    XXL,
    fsdp_bytes_per_device,
    fsdp_tp_best_tensor_devices,
    fsdp_tp_min_tokens_lower_bound,
    layer_times,
    max_tokens_for_fsdp,
    min_fsdp_devices,
    min_tokens_per_device,
    network_intensity,
    pipeline_bubble_fraction,
    pipeline_send_to_compute_ratio,
    saved_activation_bytes,
    saved_activation_bytes_per_device,
    saved_activation_bytes_per_token,
    training_state_bytes,
)
from cs336_systems.gpus import GB, GIB, GPU_SPECS, MB
from cs336_systems.rows import Row

MS, US = 1e3, 1e6  # seconds -> milliseconds, microseconds

H100 = GPU_SPECS["h100"]  # memory_bytes is the datasheet's 80 GB = 80e9 bytes
FP8_BYTES = 1

# The question's mesh: 64 v5p chips, X = 16 FSDP over two mesh axes, Y = 4 TP over the third.
QUESTION_DATA_DEVICES, QUESTION_TENSOR_DEVICES = 16, 4
QUESTION_DATA_AXES, QUESTION_TENSOR_AXES = 2, 1
QUESTION_DEVICES = QUESTION_DATA_DEVICES * QUESTION_TENSOR_DEVICES
QUESTION_MESH = "FSDP 16 x TP 4"
QUESTION_MESH_SPEC = (QUESTION_MESH, "fsdp_tp", QUESTION_DATA_DEVICES, QUESTION_TENSOR_DEVICES, QUESTION_DATA_AXES,
                      QUESTION_TENSOR_AXES)
# Activations need a batch: sequences of 2,048 tokens; 4 sequences is the project's default batch.
EXAMPLE_SEQ_LEN = 2048
DEFAULT_SEQUENCES = 4
EXAMPLE_BATCH_SIZES = (1, DEFAULT_SEQUENCES, 16)
# The question's mesh and other ways to lay out the same 64 chips (label, strategy, X, Y, M_X, M_Y):
# DP and FSDP over all three axes, TP alone, and FSDP+TP splits with TP on one axis.
MESHES = (
    ("DP 64", "dp", 64, 1, 3, 1),
    ("FSDP 64", "fsdp", 64, 1, 3, 1),
    ("TP 4", "tp", 1, 4, 1, 1),
    ("TP 64", "tp", 1, 64, 1, 1),
    ("FSDP 32 x TP 2", "fsdp_tp", 32, 2, 2, 1),
    QUESTION_MESH_SPEC,
    ("FSDP 8 x TP 8", "fsdp_tp", 8, 8, 2, 1),
    ("FSDP 4 x TP 16", "fsdp_tp", 4, 16, 2, 1),
    ("FSDP 2 x TP 32", "fsdp_tp", 2, 32, 2, 1),
)
# A pipeline stage of 4 chips runs TP like this mesh: used for the pipeline answer in (d).
STAGE_MESH = "TP 4"
PLOTTED_MESHES = ("FSDP 64", "FSDP 32 x TP 2", "FSDP 16 x TP 4", "FSDP 8 x TP 8")
SWEEP_TOKENS_PER_DEVICE = tuple(2**k for k in range(5, 13))  # 32 ... 4,096
COLLECTIVE_SIZES_BYTES = (10_000, 1 * MB, 1000 * MB)  # latency bound, in between, bandwidth bound
COLLECTIVE_DEVICE_COUNTS = (4, 16, 64)
PIPELINE_STAGES = 16
PIPELINE_MICROBATCHES = (16, 64, 256)


def _mesh_row(label: str, strategy: str, x: int, y: int, mx: int, my: int, comm_bytes: int = BF16_BYTES,
              exact_ring: bool = False) -> Row:
    model = XXL
    thresholds = {phase: min_tokens_per_device(strategy, phase, model.d_model, model.d_ff, x, y, TPU_V5P_FLOPS_PER_S,
                                               TPU_V5P_ICI_BYTES_PER_S, mx, my, comm_bytes, exact_ring)
                  for phase in PASSES}
    binding = max(thresholds.values())
    return {"table": "crossover", "mesh": label, "strategy": strategy, "data_devices": x, "tensor_devices": y,
            "data_axes": mx, "tensor_axes": my, "comm_bytes_per_element": comm_bytes, "exact_ring": exact_ring,
            "forward_min_tokens_per_device": thresholds["forward"],
            "backward_min_tokens_per_device": thresholds["backward"],
            "min_tokens_per_device": binding, "min_global_tokens": binding * x * y}


def communication_accounting_rows() -> list[Row]:
    """Every number the report states, as rows; `table` says which part of the report uses a row."""
    model = XXL
    state = training_state_bytes(model)
    per_token = saved_activation_bytes_per_token(model)
    rows: list[Row] = [{"table": "model", "d_model": model.d_model, "d_ff": model.d_ff,
                        "num_blocks": model.num_blocks, "num_params": model.num_params}]

    def scalar(name: str, value: float, unit: str) -> None:
        rows.append({"table": "scalar", "name": name, "value": value, "unit": unit})

    # (a) one device
    for component, nbytes in (("master weights (fp32)", state.master_weights),
                              ("accumulated gradients (fp32)", state.gradients),
                              ("Adam moments (2 x fp32)", state.optimizer),
                              ("total", state.total)):
        rows.append({"table": "state", "component": component, "bytes_per_param": nbytes // model.num_params,
                     "bytes": nbytes, "gb": nbytes / GB, "gib": nbytes / GIB})
    scalar("activation_bytes_per_token_per_block", per_token / model.num_blocks, "bytes")
    scalar("activation_bytes_per_token", per_token, "bytes")
    scalar("h100_memory_bytes", H100.memory_bytes, "bytes")
    scalar("state_h100s", state.total / H100.memory_bytes, "GPUs")
    scalar("state_h100s_if_80_gib", state.total / (80 * GIB), "GPUs")
    for sequences in EXAMPLE_BATCH_SIZES:
        tokens = sequences * EXAMPLE_SEQ_LEN
        activations = saved_activation_bytes(model, tokens)
        rows.append({"table": "activations", "sequences": sequences, "tokens": tokens,
                     "activation_bytes": activations, "activation_gb": activations / GB,
                     "activation_gib": activations / GIB, "with_state_gb": (state.total + activations) / GB,
                     "h100s": (state.total + activations) / H100.memory_bytes})

    # (b) FSDP on v5p
    scalar("tpu_memory_bytes", TPU_V5P_MEMORY_BYTES, "bytes")
    max_tokens = max_tokens_for_fsdp(model, TPU_V5P_MEMORY_BYTES)
    scalar("fsdp_max_tokens", max_tokens, "tokens")
    for tokens in (0, *(s * EXAMPLE_SEQ_LEN for s in EXAMPLE_BATCH_SIZES)):
        activations = saved_activation_bytes(model, tokens)
        fits = tokens < max_tokens
        devices = min_fsdp_devices(state.total, activations, TPU_V5P_MEMORY_BYTES) if fits else None
        rows.append({"table": "fsdp", "tokens": tokens, "activation_gb": activations / GB,
                     "min_fsdp_devices": devices,
                     "gb_per_device": fsdp_bytes_per_device(state.total, activations, devices) / GB if fits else None})

    # (c) and the parallelism calculations on 64 v5p chips
    scalar("flops_per_s", TPU_V5P_FLOPS_PER_S, "FLOP/s")
    scalar("ici_bytes_per_s", TPU_V5P_ICI_BYTES_PER_S, "bytes/s")
    scalar("alpha", network_intensity(TPU_V5P_FLOPS_PER_S, TPU_V5P_ICI_BYTES_PER_S), "FLOP/byte")
    for label, strategy, x, y, mx, my in MESHES:
        rows.append(_mesh_row(label, strategy, x, y, mx, my))
    rows.append(_mesh_row(*QUESTION_MESH_SPEC, exact_ring=True))
    rows.append(_mesh_row(*QUESTION_MESH_SPEC, comm_bytes=FP8_BYTES))
    scalar("best_tensor_devices", fsdp_tp_best_tensor_devices(model.d_ff, TPU_V5P_FLOPS_PER_S, TPU_V5P_ICI_BYTES_PER_S,
                                                              QUESTION_TENSOR_AXES), "devices")
    scalar("fsdp_tp_floor_tokens_per_device",
           fsdp_tp_min_tokens_lower_bound(model.d_ff, TPU_V5P_FLOPS_PER_S, TPU_V5P_ICI_BYTES_PER_S,
                                          QUESTION_DATA_AXES, QUESTION_TENSOR_AXES), "tokens")
    for label, strategy, x, y, mx, my in MESHES:
        if label not in PLOTTED_MESHES:
            continue
        for per_device in SWEEP_TOKENS_PER_DEVICE:
            tokens = per_device * x * y
            times = layer_times(strategy, "forward", tokens, model.d_model, model.d_ff, x, y, TPU_V5P_FLOPS_PER_S,
                                TPU_V5P_ICI_BYTES_PER_S, mx, my)
            rows.append({"table": "layer_times", "mesh": label, "tokens_per_device": per_device, "tokens": tokens,
                         "compute_ms": times.compute_s * MS, "weight_comm_ms": times.weight_comm_s * MS,
                         "activation_comm_ms": times.activation_comm_s * MS, "compute_bound": times.compute_bound})

    # memory of the question's mesh at its compute-bound batch
    tokens = _mesh_row(*QUESTION_MESH_SPEC)["min_global_tokens"]
    scalar("question_state_bytes_per_device", state.total / QUESTION_DEVICES, "bytes")
    scalar("question_activation_bytes_per_device",
           saved_activation_bytes_per_device(model, tokens, QUESTION_DATA_DEVICES, QUESTION_TENSOR_DEVICES), "bytes")

    # ring collectives on one v5p ICI axis
    scalar("ici_hop_latency_s", ICI_HOP_LATENCY_S, "s")
    for size in COLLECTIVE_SIZES_BYTES:
        for devices in COLLECTIVE_DEVICE_COUNTS:
            for collective, time_s in COLLECTIVES.items():
                total = time_s(size, devices, TPU_V5P_ICI_BYTES_PER_S, ICI_HOP_LATENCY_S)
                bandwidth_only = time_s(size, devices, TPU_V5P_ICI_BYTES_PER_S)
                rows.append({"table": "collective", "collective": collective, "array_bytes": size,
                             "devices": devices, "total_us": total * US, "bandwidth_term_us": bandwidth_only * US,
                             "latency_term_us": (total - bandwidth_only) * US})
    for devices in COLLECTIVE_DEVICE_COUNTS:
        scalar(f"latency_bound_below_bytes_{devices}",
               latency_bound_below_bytes(devices, TPU_V5P_ICI_BYTES_PER_S, ICI_HOP_LATENCY_S), "bytes")

    scalar("pipeline_send_to_compute", pipeline_send_to_compute_ratio(
        model.d_ff, model.num_blocks, PIPELINE_STAGES, TPU_V5P_FLOPS_PER_S, TPU_V5P_ICI_BYTES_PER_S), "ratio")
    for microbatches in PIPELINE_MICROBATCHES:
        rows.append({"table": "pipeline", "stages": PIPELINE_STAGES, "microbatches": microbatches,
                     "bubble_fraction": pipeline_bubble_fraction(PIPELINE_STAGES, microbatches)})
    return rows
