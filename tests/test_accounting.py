"""Closed-form accounting: ring collectives, the XXL memory and FSDP answers, compute-vs-communication
limits of DP / FSDP / TP / FSDP+TP, and the communication_accounting report.

Expected values are worked by hand in the comments, independently of the code under test.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cs336_systems.accounting.communication import (
    COLLECTIVES,
    all_gather_s,
    all_reduce_s,
    bytes_sent_per_device,
    latency_bound_below_bytes,
    reduce_scatter_s,
    alternate_all_reduce_s,
)
from cs336_systems.accounting.communication_accounting import communication_accounting_rows
from cs336_systems.accounting.parallelism import (
    PASSES,
    STRATEGIES,
    TPU_V5P_FLOPS_PER_S,
    TPU_V5P_ICI_BYTES_PER_S,
    TPU_V5P_MEMORY_BYTES,
    XXL,
    FeedForwardStack,
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
from cs336_systems.gpus import GB, GIB, GPU_SPECS
from cs336_systems.runs import read_rows
from cs336_systems.reports.communication_accounting import write_communication_accounting
from cs336_systems.reports.problems import report

C, W = TPU_V5P_FLOPS_PER_S, TPU_V5P_ICI_BYTES_PER_S
D, F = XXL.d_model, XXL.d_ff

array_bytes = st.floats(min_value=1.0, max_value=1e12)
device_counts = st.integers(min_value=1, max_value=4096)
bandwidths = st.floats(min_value=1e6, max_value=1e13)
latencies = st.floats(min_value=0.0, max_value=1e-3)
collectives = st.sampled_from(sorted(COLLECTIVES))


# ---------------------------------------------------------------------------------- ring collectives

def test_ring_collective_times_worked_by_hand():
    # 1 GB over a ring of 4 on one v5p ICI axis (1.8e11 bytes/s) with 1 us per step:
    # all-gather: 3 steps of 1e9 / 4 = 2.5e8 bytes, each 1e-6 + 2.5e8 / 1.8e11 = 1.389889e-3 s -> 4.169667e-3 s.
    assert all_gather_s(1e9, 4, 1.8e11, 1e-6) == pytest.approx(4.169667e-3, rel=1e-6)
    assert reduce_scatter_s(1e9, 4, 1.8e11, 1e-6) == pytest.approx(4.169667e-3, rel=1e-6)
    # all-reduce: 6 such steps -> 8.339333e-3 s. The alternate: 3 steps of the whole 1e9 bytes,
    # 3 x (1e-6 + 1e9 / 1.8e11) = 1.6669667e-2 s.
    assert all_reduce_s(1e9, 4, 1.8e11, 1e-6) == pytest.approx(8.339333e-3, rel=1e-6)
    assert alternate_all_reduce_s(1e9, 4, 1.8e11, 1e-6) == pytest.approx(1.6669667e-2, rel=1e-6)
    # 2 devices, no latency: one step of half the array, 0.5e9 / 1e11 = 5 ms; all-reduce twice that.
    assert all_gather_s(1e9, 2, 1e11) == pytest.approx(5e-3)
    assert all_reduce_s(1e9, 2, 1e11) == pytest.approx(10e-3)
    # Bytes each of 8 devices sends for a 1 GB all-reduce: 2 x 7/8 x 1e9 = 1.75e9.
    assert bytes_sent_per_device("all_reduce", 1e9, 8) == pytest.approx(1.75e9)
    # Latency and bandwidth terms meet at N w latency: 16 x 1.8e11 x 1e-6 = 2.88 MB.
    assert latency_bound_below_bytes(16, 1.8e11, 1e-6) == pytest.approx(2.88e6)


@given(collectives, array_bytes, device_counts, bandwidths)
def test_doubling_bandwidth_halves_the_bandwidth_term(collective, size, n, bandwidth):
    time_s = COLLECTIVES[collective]
    assert time_s(size, n, 2 * bandwidth) == pytest.approx(time_s(size, n, bandwidth) / 2, rel=1e-12)


@given(array_bytes, st.integers(min_value=2, max_value=4096), bandwidths)
def test_alternate_all_reduce_takes_n_over_2_times_the_ring_all_reduce(size, n, bandwidth):
    assert alternate_all_reduce_s(size, n, bandwidth) == pytest.approx(
        n / 2 * all_reduce_s(size, n, bandwidth), rel=1e-12)


@given(collectives, array_bytes, device_counts, bandwidths, latencies)
def test_latency_term_is_one_latency_per_ring_step(collective, size, n, bandwidth, latency):
    steps = (n - 1) * (2 if collective == "all_reduce" else 1)
    time_s = COLLECTIVES[collective]
    bandwidth_term = time_s(size, n, bandwidth)
    # The difference of two floats near the total loses digits relative to the total, not to the latency.
    assert time_s(size, n, bandwidth, latency) - bandwidth_term == pytest.approx(
        steps * latency, rel=1e-9, abs=1e-12 * bandwidth_term)


@given(collectives, array_bytes, device_counts, bandwidths)
def test_bandwidth_term_is_bytes_sent_over_bandwidth(collective, size, n, bandwidth):
    assert COLLECTIVES[collective](size, n, bandwidth) == pytest.approx(
        bytes_sent_per_device(collective, size, n) / bandwidth, rel=1e-12)


@given(array_bytes, st.integers(min_value=1, max_value=4095), bandwidths)
def test_all_gather_grows_with_devices_towards_array_over_bandwidth(size, n, bandwidth):
    fewer, more = all_gather_s(size, n, bandwidth), all_gather_s(size, n + 1, bandwidth)
    assert fewer <= more < size / bandwidth


@given(array_bytes, bandwidths, latencies)
def test_one_device_communicates_nothing(size, bandwidth, latency):
    assert all(time_s(size, 1, bandwidth, latency) == 0 for time_s in COLLECTIVES.values())


@given(st.integers(min_value=2, max_value=4096), bandwidths, st.floats(min_value=1e-9, max_value=1e-3))
def test_at_the_latency_bound_size_both_terms_are_equal(n, bandwidth, latency):
    size = latency_bound_below_bytes(n, bandwidth, latency)
    assert all_gather_s(size, n, bandwidth) == pytest.approx((n - 1) * latency, rel=1e-9)


def test_collectives_reject_bad_input():
    with pytest.raises(ValueError, match="num_devices"):
        all_gather_s(1e6, 0, 1e9)
    with pytest.raises(TypeError, match="num_devices"):
        all_reduce_s(1e6, 2.0, 1e9)
    with pytest.raises(ValueError, match="bandwidth"):
        reduce_scatter_s(1e6, 4, 0)
    with pytest.raises(ValueError, match="latency"):
        all_gather_s(1e6, 4, 1e9, -1e-6)
    with pytest.raises(ValueError, match="array_bytes"):
        all_gather_s(-1, 4, 1e9)
    with pytest.raises(ValueError, match="unknown collective"):
        bytes_sent_per_device("broadcast", 1e6, 4)


# ----------------------------------------------------------------------------- (a) and (b): memory
#
# Other answers we compared with, and why they differ from ours:
# - "819 GB" of master weights and 3,276 GB in total, hence 41 H100s: those are GiB (2^30 bytes), 4 x P / 2^30
#   = 819.0 exactly. 3,276 GiB / 80 GB mixes units; in one unit it is 3,517.6 GB / 80 GB = 43.97 -> 44, or
#   3,276 GiB / 80 GiB = 40.95 -> 41. The report gives both readings; the H100's datasheet figure is decimal.
# - "Memory saved for backward" answered as the bytes saved by bf16 weights and gradients (879 GB): the question
#   asks for the size of the activations kept for backward.
# - 102.1 GB of activations for 4 x 2,048 tokens: only the d_ff-wide Tmp was counted. dW_in = In^T dTmp also
#   needs the d_model-wide In, so it is 2 x (16,384 + 53,248) x 126 x 8,192 = 143.7 GB (133.9 GiB).
# - 0.016314 GB per token: matches neither 17,547,264 bytes in GB (0.017547) nor in GiB (0.016342); the formula
#   it was written next to, n_l (n_l d_ff + d_model) / 2, is not the count either.
# - N_FSDP > 34 ("3,276 / 95"): GiB over GB again, and without the half of the activations that is replicated.
#   In GB the state alone needs 3,517.6 / 95 = 37.03 -> 38.
# - N_FSDP >= 76 with the 102.1 GB activations: the formula (S + A/2) / N + A/2 is ours, but A misses In and
#   S is in GiB; with A = 143.7 GB, (3,517.6 + 71.9) / (95 - 71.9) = 155.2 -> 156.

def test_xxl_parameter_count():
    # 16,384 x 53,248 = 872,415,232 per linear; x 2 linears x 126 blocks = 219,848,638,464.
    assert XXL.num_params == 219_848_638_464


def test_xxl_training_state_worked_by_hand():
    state = training_state_bytes(XXL)
    # 4 bytes x 219,848,638,464 = 879,394,553,856 = 879.39 GB; P = 2^28 x 819, so exactly 819 GiB.
    assert state.master_weights == state.gradients == 879_394_553_856
    assert state.master_weights / GIB == 819
    assert state.optimizer == 2 * 879_394_553_856
    # 16 bytes per parameter: 3,517,578,215,424 bytes = 3,517.58 GB = 3,276 GiB.
    assert state.total == 3_517_578_215_424
    assert state.total / GIB == 3276
    # H100 80GB = 80e9 bytes: 3,517.58 / 80 = 43.97 of them, so 44 GPUs.
    assert state.total / GPU_SPECS["h100"].memory_bytes == pytest.approx(43.97, abs=0.005)


def test_xxl_saved_activations_worked_by_hand():
    # Per token per block: In (16,384) + Tmp (53,248) values x 2 bytes = 139,264; x 126 = 17,547,264.
    assert saved_activation_bytes_per_token(XXL) == 17_547_264
    # 4 sequences of 2,048 tokens: 8,192 x 17,547,264 = 143,747,186,688 bytes.
    assert saved_activation_bytes(XXL, 8192) == 143_747_186_688
    # fp32 activations would be twice as many bytes
    assert saved_activation_bytes_per_token(XXL, activation_bytes=4) == 2 * 17_547_264


def test_fsdp_devices_for_a_v5p_worked_by_hand():
    state = training_state_bytes(XXL).total
    # State only: N > 3,517.578 / 95 = 37.03 -> 38; 37 devices would hold 95.07 GB each.
    assert min_fsdp_devices(state, 0, TPU_V5P_MEMORY_BYTES) == 38
    assert fsdp_bytes_per_device(state, 0, 37) > TPU_V5P_MEMORY_BYTES
    # 8,192 tokens: A/2 = 71.874 GB, N > (3,517.578 + 71.874) / (95 - 71.874) = 155.2 -> 156.
    assert min_fsdp_devices(state, saved_activation_bytes(XXL, 8192), TPU_V5P_MEMORY_BYTES) == 156
    # The unsharded half fills a chip at 2 x 95e9 / 17,547,264 = 10,827.9 tokens.
    assert max_tokens_for_fsdp(XXL, TPU_V5P_MEMORY_BYTES) == pytest.approx(10_827.9, abs=0.05)
    with pytest.raises(ValueError, match="no number of FSDP devices"):
        min_fsdp_devices(state, saved_activation_bytes(XXL, 10_828), TPU_V5P_MEMORY_BYTES)


@given(st.floats(min_value=0, max_value=1e13), st.floats(min_value=0, max_value=1e11),
       st.floats(min_value=1e9, max_value=1e11))
def test_min_fsdp_devices_is_the_first_count_that_fits(state, activations, memory):
    if activations / 2 >= memory:
        with pytest.raises(ValueError):
            min_fsdp_devices(state, activations, memory)
        return
    n = min_fsdp_devices(state, activations, memory)
    assert fsdp_bytes_per_device(state, activations, n) < memory * (1 + 1e-12)
    if n > 1:
        assert fsdp_bytes_per_device(state, activations, n - 1) >= memory * (1 - 1e-12)


@given(st.floats(min_value=0, max_value=1e13), st.floats(min_value=0, max_value=1e12),
       st.integers(min_value=1, max_value=10_000))
def test_fsdp_memory_falls_with_more_devices_but_not_below_the_replicated_half(state, activations, n):
    assert fsdp_bytes_per_device(state, activations, n + 1) <= fsdp_bytes_per_device(state, activations, n)
    assert fsdp_bytes_per_device(state, activations, n) >= activations / 2


@given(st.integers(min_value=0, max_value=10**6), st.integers(min_value=1, max_value=64))
def test_per_device_activations_split_over_the_data_axis(tokens, x):
    # Without TP each device saves its B / X tokens' activations.
    per_device = saved_activation_bytes_per_device(XXL, tokens, x, 1)
    assert per_device == pytest.approx(saved_activation_bytes(XXL, tokens) / x)


def test_memory_functions_reject_bad_input():
    with pytest.raises(ValueError, match="d_ff"):
        FeedForwardStack(d_model=16, d_ff=0, num_blocks=2)
    with pytest.raises(TypeError, match="num_devices"):
        fsdp_bytes_per_device(1e9, 0, 2.5)
    with pytest.raises(ValueError, match="device_memory_bytes"):
        min_fsdp_devices(1e9, 0, 0)
    with pytest.raises(ValueError, match="tokens"):
        saved_activation_bytes(XXL, -1)


# ------------------------------------------------------------------- (c): compute vs communication
#
# Other answers to (c) we compared with:
# - "B < 641" (global): the compute side was 2 D F B / C, one matmul on one chip. The forward pass has two
#   matmuls (4 B D F) split over N = 64 chips, so T_math = 4 B D F / (64 C); with that the threshold is
#   395.3 tokens per chip, 25,302 tokens overall.
# - "b' > 13.3 sequences of 2,048": counted fp32 weight gathers over the whole step against compute divided by
#   Y only, leaving out M_X and TP traffic. The question fixes bf16 communication and the scaling book's model.

def test_question_c_worked_by_hand():
    # alpha = 4.6e14 / 1.8e11 = 2,555.56; F / alpha = 53,248 / 2,555.56 = 20.8362.
    assert network_intensity(C, W) == pytest.approx(2555.556, rel=1e-6)
    # b >= F / (Y M_X) / (F / alpha - Y / M_Y) = (53,248 / 8) / (20.8362 - 4) = 6,656 / 16.8362 = 395.34.
    b = min_tokens_per_device("fsdp_tp", "forward", D, F, 16, 4, C, W, data_axes=2, tensor_axes=1)
    assert b == pytest.approx(395.34, abs=0.01)
    assert 64 * b == pytest.approx(25_301.7, abs=1)
    # Exact ring factors 15/16 and 3/4: (15/16 x 6,656) / (20.8362 - 3/4 x 4) = 6,240 / 17.8362 = 349.85.
    exact = min_tokens_per_device("fsdp_tp", "forward", D, F, 16, 4, C, W, 2, 1, exact_ring=True)
    assert exact == pytest.approx(349.85, abs=0.01)
    # Backward: 2 x 6,656 / (2 x 20.8362 - 4) = 13,312 / 37.6725 = 353.36, below the forward's.
    backward = min_tokens_per_device("fsdp_tp", "backward", D, F, 16, 4, C, W, 2, 1)
    assert backward == pytest.approx(353.36, abs=0.01) and backward < b
    # fp8 collectives halve every byte: 3,328 / (20.8362 - 2) = 176.68.
    assert min_tokens_per_device("fsdp_tp", "forward", D, F, 16, 4, C, W, 2, 1, comm_bytes_per_element=1) == \
        pytest.approx(176.68, abs=0.01)


def test_layer_times_worked_by_hand():
    # 25,600 tokens (400 per chip) on the 16 x 4 mesh:
    # compute 4 x 25,600 x 16,384 x 53,248 / (64 x 4.6e14) = 8.93353e13 / 2.944e16 = 3.03449e-3 s
    # FSDP 2 x (2 x 16,384 x 53,248 / 4) / (2 x 1.8e11) = 8.72415e8 / 3.6e11 = 2.42338e-3 s
    # TP 2 x (2 x 25,600 x 16,384 / 16) / 1.8e11 = 1.04858e8 / 1.8e11 = 5.82542e-4 s; sum 3.00592e-3 < compute.
    times = layer_times("fsdp_tp", "forward", 25_600, D, F, 16, 4, C, W, 2, 1)
    assert times.compute_s == pytest.approx(3.03449e-3, rel=1e-5)
    assert times.weight_comm_s == pytest.approx(2.42338e-3, rel=1e-5)
    assert times.activation_comm_s == pytest.approx(5.82542e-4, rel=1e-5)
    assert times.compute_bound


def test_strategy_limits_match_the_scaling_book():
    # DP and FSDP over three axes: B / X >= alpha / 3 = 851.85, DP's forward is free.
    assert min_tokens_per_device("fsdp", "forward", D, F, 64, 1, C, W, 3) == pytest.approx(851.85, abs=0.01)
    assert min_tokens_per_device("dp", "backward", D, F, 64, 1, C, W, 3) == pytest.approx(851.85, abs=0.01)
    assert min_tokens_per_device("dp", "forward", D, F, 64, 1, C, W, 3) == 0.0
    # TP: compute bound at any batch while F >= alpha Y (Y = 4: 53,248 >= 10,222), at none past F / alpha = 20.8.
    assert min_tokens_per_device("tp", "forward", D, F, 1, 4, C, W) == 0.0
    assert min_tokens_per_device("tp", "forward", D, F, 1, 21, C, W) == math.inf
    assert min_tokens_per_device("tp", "forward", D, F, 1, 20, C, W) == 0.0
    # FSDP+TP floor 2 alpha^2 / F (M_X = 2, M_Y = 1) = 2 x 6,530,864 / 53,248 = 245.30 at Y* = F / (2 alpha) = 10.42.
    assert fsdp_tp_min_tokens_lower_bound(F, C, W, 2, 1) == pytest.approx(245.30, abs=0.01)
    assert fsdp_tp_best_tensor_devices(F, C, W, 1) == pytest.approx(10.418, abs=0.001)


def _book_fsdp_tp_threshold(y: float, mx: float, my: float) -> float:
    """b >= F / (Y M_X) / (F / alpha - Y / M_Y), for real Y; inf where TP alone is communication bound."""
    alpha = C / W
    return F / (y * mx) / (F / alpha - y / my) if F / alpha > y / my else math.inf


meshes = st.tuples(st.integers(min_value=2, max_value=256), st.integers(min_value=2, max_value=64),
                   st.sampled_from([1, 2, 3]), st.sampled_from([1, 2, 3]))


@given(meshes)
def test_fsdp_tp_threshold_is_the_closed_form_and_never_below_the_floor(mesh):
    x, y, mx, my = mesh
    b = min_tokens_per_device("fsdp_tp", "forward", D, F, x, y, C, W, mx, my)
    assert b == pytest.approx(_book_fsdp_tp_threshold(y, mx, my), rel=1e-9)
    assert b >= fsdp_tp_min_tokens_lower_bound(F, C, W, mx, my) * (1 - 1e-12)


@given(st.sampled_from([1, 2, 3]), st.sampled_from([1, 2, 3]))
def test_the_floor_is_reached_at_the_best_tensor_degree(mx, my):
    best = fsdp_tp_best_tensor_devices(F, C, W, my)
    floor = fsdp_tp_min_tokens_lower_bound(F, C, W, mx, my)
    assert _book_fsdp_tp_threshold(best, mx, my) == pytest.approx(floor, rel=1e-12)
    assert _book_fsdp_tp_threshold(best * 1.01, mx, my) > floor < _book_fsdp_tp_threshold(best * 0.99, mx, my)


strategy_meshes = st.sampled_from([("dp", 8, 1), ("fsdp", 8, 1), ("tp", 1, 8), ("fsdp_tp", 8, 4), ("fsdp_tp", 2, 2)])


@given(strategy_meshes, st.sampled_from(PASSES), st.floats(min_value=1, max_value=1e7))
def test_compute_doubles_with_tokens_and_weight_traffic_does_not_change(mesh, phase, tokens):
    strategy, x, y = mesh
    one = layer_times(strategy, phase, tokens, D, F, x, y, C, W)
    two = layer_times(strategy, phase, 2 * tokens, D, F, x, y, C, W)
    assert two.compute_s == pytest.approx(2 * one.compute_s, rel=1e-12)
    assert two.activation_comm_s == pytest.approx(2 * one.activation_comm_s, rel=1e-12)
    assert two.weight_comm_s == one.weight_comm_s


@given(strategy_meshes, st.sampled_from(PASSES), st.floats(min_value=1, max_value=1e7))
def test_doubling_bandwidth_halves_communication_and_doubling_flops_halves_compute(mesh, phase, tokens):
    strategy, x, y = mesh
    base = layer_times(strategy, phase, tokens, D, F, x, y, C, W)
    faster_links = layer_times(strategy, phase, tokens, D, F, x, y, C, 2 * W)
    faster_chips = layer_times(strategy, phase, tokens, D, F, x, y, 2 * C, W)
    assert faster_links.comm_s == pytest.approx(base.comm_s / 2, rel=1e-12)
    assert faster_chips.compute_s == pytest.approx(base.compute_s / 2, rel=1e-12)


@given(st.sampled_from([("dp", "backward"), ("fsdp", "forward"), ("fsdp", "backward")]),
       st.integers(min_value=2, max_value=1024), st.sampled_from([1, 2, 3]))
def test_data_parallel_threshold_halves_with_double_bandwidth(case, x, mx):
    strategy, phase = case
    base = min_tokens_per_device(strategy, phase, D, F, x, 1, C, W, mx)
    assert min_tokens_per_device(strategy, phase, D, F, x, 1, C, 2 * W, mx) == pytest.approx(base / 2, rel=1e-9)


@given(meshes, st.sampled_from(PASSES))
def test_the_threshold_separates_communication_bound_from_compute_bound(mesh, phase):
    x, y, mx, my = mesh
    b = min_tokens_per_device("fsdp_tp", phase, D, F, x, y, C, W, mx, my)
    if math.isinf(b):
        assert not layer_times("fsdp_tp", phase, 1e9 * x * y, D, F, x, y, C, W, mx, my).compute_bound
        return
    at = layer_times("fsdp_tp", phase, b * x * y, D, F, x, y, C, W, mx, my)
    assert at.compute_s == pytest.approx(at.comm_s, rel=1e-9)
    assert layer_times("fsdp_tp", phase, 1.01 * b * x * y, D, F, x, y, C, W, mx, my).compute_bound
    assert not layer_times("fsdp_tp", phase, 0.99 * b * x * y, D, F, x, y, C, W, mx, my).compute_bound


@given(meshes, st.sampled_from(PASSES))
def test_exact_ring_never_needs_a_larger_batch_than_the_large_ring_limit(mesh, phase):
    x, y, mx, my = mesh
    book = min_tokens_per_device("fsdp_tp", phase, D, F, x, y, C, W, mx, my)
    exact = min_tokens_per_device("fsdp_tp", phase, D, F, x, y, C, W, mx, my, exact_ring=True)
    assert exact <= book


def test_pipeline_worked_by_hand():
    # (P - 1) / (m + P - 1): 16 stages, 64 microbatches -> 15 / 79 = 0.18987; one stage never idles.
    assert pipeline_bubble_fraction(16, 64) == pytest.approx(15 / 79)
    assert pipeline_bubble_fraction(1, 8) == 0
    # e alpha P / (4 F L) = 2 x 2,555.56 x 16 / (4 x 53,248 x 126) = 81,777.8 / 26,836,992 = 0.003047.
    assert pipeline_send_to_compute_ratio(F, XXL.num_blocks, 16, C, W) == pytest.approx(0.003047, abs=1e-6)
    with pytest.raises(ValueError, match="at least one block"):
        pipeline_send_to_compute_ratio(F, XXL.num_blocks, 127, C, W)


@pytest.mark.parametrize("strategy, x, y, message", [
    ("zero3", 4, 1, "unknown strategy"),
    ("fsdp", 4, 2, "tensor_devices must be 1"),
    ("dp", 4, 2, "tensor_devices must be 1"),
    ("tp", 2, 4, "data_devices must be 1"),
    ("fsdp_tp", 0, 4, "data_devices must be >= 1"),
])
def test_layer_times_rejects_a_bad_mesh(strategy, x, y, message):
    with pytest.raises(ValueError, match=message):
        layer_times(strategy, "forward", 1024, D, F, x, y, C, W)


def test_layer_times_rejects_bad_values():
    with pytest.raises(ValueError, match="unknown phase"):
        layer_times("fsdp", "update", 1024, D, F, 4, 1, C, W)
    with pytest.raises(ValueError, match="tokens"):
        layer_times("fsdp", "forward", -1, D, F, 4, 1, C, W)
    with pytest.raises(ValueError, match="bandwidth_bytes_per_s"):
        layer_times("fsdp", "forward", 1024, D, F, 4, 1, C, 0)
    with pytest.raises(TypeError, match="tensor_devices"):
        layer_times("fsdp_tp", "forward", 1024, D, F, 4, 2.0, C, W)
    assert set(STRATEGIES) == {"dp", "fsdp", "tp", "fsdp_tp"}


# --------------------------------------------------------------------------------------- the report

def test_report_states_the_computed_answers(tmp_path):
    path = write_communication_accounting(tmp_path, command="python -m cs336_systems accounting")
    text = path.read_text()
    assert text.startswith("# communication_accounting\n")
    assert "- command: `python -m cs336_systems accounting`" in text
    for answer in ("219,848,638,464 parameters", "3,517.58 GB (3,276.0 GiB)", "so 44 GPUs", "17,547,264 bytes",
                   "at least 38", "156 with the activations", "10,828 tokens", "395.3 tokens per chip",
                   "25,302 tokens", "349.9", "245.3"):
        assert answer in text, answer
    assert (tmp_path / "communication_accounting_forward.png").stat().st_size > 0
    # The report has no date, so it regenerates identically.
    first = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    write_communication_accounting(tmp_path, command="python -m cs336_systems accounting")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == first


def test_report_renders_the_same_from_its_csv(tmp_path):
    write_communication_accounting(tmp_path)
    render = report("communication_accounting").render
    from_csv = render(read_rows(tmp_path / "communication_accounting.csv"))
    assert from_csv.body == render(communication_accounting_rows()).body


def test_report_rows_follow_the_functions():
    rows = communication_accounting_rows()
    total = next(r for r in rows if r.get("component") == "total")
    assert total["bytes"] == training_state_bytes(XXL).total and total["gb"] == total["bytes"] / GB
    alternate = {(r["array_bytes"], r["devices"]): r["bandwidth_term_us"] for r in rows
                 if r.get("collective") == "alternate_all_reduce"}
    ring = {(r["array_bytes"], r["devices"]): r["bandwidth_term_us"] for r in rows
            if r.get("collective") == "all_reduce"}
    assert alternate.keys() == ring.keys() and all(alternate[k] == pytest.approx(k[1] / 2 * ring[k]) for k in ring)
