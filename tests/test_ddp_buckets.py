"""Bucketed DDP: bucket assignment (properties), the course's bucketed test, and the overhead model."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cs336_systems.accounting.ddp import (
    allreduce_cost,
    ddp_overhead_s,
    optimal_bucket_bytes,
    optimal_num_buckets,
    pipelined_overhead_s,
)
from cs336_systems.distributed.ddp import BYTES_PER_MB, BucketedDDP, assign_buckets
from cs336_systems.distributed.launch import launch
from tests import adapters
from tests.common import (
    CheckOutcome,
    ToyModel,
    ToyModelWithTiedWeights,
    assert_passed_on_every_rank,
    course_ddp_check,
    run_checks,
)

LAUNCH_TIMEOUT_S = 180
# The course's bucket sizes for its toy models: several buckets, one parameter per bucket, one bucket.
COURSE_BUCKET_SIZES_MB = (0.0016, 0.0001, 0.01)
REUSE_STEPS = 3

sizes_bytes = st.lists(st.integers(min_value=1, max_value=10_000), max_size=40)
bucket_limits = st.floats(min_value=1, max_value=20_000, allow_nan=False)


# ------------------------------------------------------------------------------ bucket assignment

@given(sizes_bytes, bucket_limits)
def test_every_parameter_is_in_exactly_one_bucket(sizes, limit):
    buckets = assign_buckets(sizes, limit)
    assert sorted(i for bucket in buckets for i in bucket) == list(range(len(sizes)))
    assert all(buckets)


@given(sizes_bytes, bucket_limits)
def test_buckets_follow_reverse_parameter_order(sizes, limit):
    buckets = assign_buckets(sizes, limit)
    assert [i for bucket in buckets for i in bucket] == list(reversed(range(len(sizes))))


@given(sizes_bytes, bucket_limits)
def test_a_bucket_exceeds_the_limit_only_when_one_parameter_alone_does(sizes, limit):
    for bucket in assign_buckets(sizes, limit):
        if sum(sizes[i] for i in bucket) > limit:
            assert len(bucket) == 1 and sizes[bucket[0]] > limit


@given(sizes_bytes, bucket_limits)
def test_a_bucket_closes_only_when_the_next_parameter_would_not_fit(sizes, limit):
    buckets = assign_buckets(sizes, limit)
    for bucket, following in zip(buckets, buckets[1:]):
        assert sum(sizes[i] for i in bucket) + sizes[following[0]] > limit


@given(st.lists(st.sampled_from(["float32", "bfloat16"]), min_size=1, max_size=30))
def test_a_bucket_never_mixes_kinds(kinds):
    buckets = assign_buckets([4] * len(kinds), bucket_size_bytes=1e9, kinds=kinds)
    assert all(len({kinds[i] for i in bucket}) == 1 for bucket in buckets)
    # ...and closes only where the kind changes: a huge limit otherwise packs everything together
    assert len(buckets) == 1 + sum(a != b for a, b in zip(kinds, kinds[1:]))


def test_bucket_assignment_rejects_bad_input():
    with pytest.raises(ValueError, match="bucket size"):
        assign_buckets([4, 4], 0)
    with pytest.raises(ValueError, match="kinds"):
        assign_buckets([4, 4], 10, kinds=["float32"])


@pytest.mark.parametrize(("bucket_size_mb", "error"), [
    (0, ValueError), (-1.0, ValueError), (math.inf, ValueError), (math.nan, ValueError),
    ("10", TypeError), (None, TypeError), (True, TypeError)])
def test_bucketed_ddp_rejects_a_bad_bucket_size(bucket_size_mb, error):
    with pytest.raises(error, match="bucket_size_mb"):
        BucketedDDP(ToyModel(), bucket_size_mb=bucket_size_mb)


# ---------------------------------------------------------------- bucketed DDP inside a process group

def _buckets_are_assigned_and_reused(rank: int, world_size: int, bucket_size_mb: float) -> None:
    """Buckets as assign_buckets says; their buffers allocated once and reused every step."""
    model = BucketedDDP(ToyModelWithTiedWeights(), bucket_size_mb=bucket_size_mb)
    params = [p for p in model.module.parameters() if p.requires_grad]
    expected = assign_buckets([p.numel() * p.element_size() for p in params], bucket_size_mb * BYTES_PER_MB)
    assert [bucket.indices for bucket in model.buckets] == expected
    addresses = [bucket.buffer.data_ptr() for bucket in model.buckets]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(REUSE_STEPS):
        model.on_train_batch_start()
        optimizer.zero_grad()
        model(torch.randn(4, 10)).sum().backward()
        model.finish_gradient_synchronization()
        optimizer.step()
        assert [bucket.buffer.data_ptr() for bucket in model.buckets] == addresses, f"step {step}"


CHECKS = {
    **{f"course_bucketed_{bucket_size_mb}MB_{cls.__name__}": functools.partial(
        course_ddp_check, model_class=cls,
        make_ddp=functools.partial(adapters.get_ddp_bucketed, bucket_size_mb=bucket_size_mb),
        after_backward=adapters.ddp_bucketed_on_after_backward,
        before_batch=adapters.ddp_bucketed_on_train_batch_start)
       for bucket_size_mb in COURSE_BUCKET_SIZES_MB for cls in (ToyModel, ToyModelWithTiedWeights)},
    **{f"buckets_assigned_and_reused_{bucket_size_mb}MB": functools.partial(
        _buckets_are_assigned_and_reused, bucket_size_mb=bucket_size_mb) for bucket_size_mb in COURSE_BUCKET_SIZES_MB},
}


@pytest.fixture(scope="module")
def outcomes() -> list[dict[str, CheckOutcome]]:
    return launch(run_checks, 2, CHECKS, device="cpu", timeout_s=LAUNCH_TIMEOUT_S)


@pytest.mark.parametrize("check", CHECKS)
def test_bucketed_ddp(check, outcomes):
    assert_passed_on_every_rank(check, outcomes)


# ------------------------------------------------------------------------------- overhead model

MODEL_BYTES = 8e9  # about the XL model's fp32 gradients
BANDWIDTH = 300e9
PER_CALL_S = 50e-6


def test_optimal_bucket_count_minimises_the_overhead():
    best = optimal_num_buckets(MODEL_BYTES, BANDWIDTH, PER_CALL_S)
    brute_force = min(range(1, 10_000), key=lambda n: ddp_overhead_s(MODEL_BYTES, BANDWIDTH, PER_CALL_S, n))
    assert abs(best - brute_force) <= 1
    at_best = ddp_overhead_s(MODEL_BYTES, BANDWIDTH, PER_CALL_S, best)
    assert at_best == pytest.approx(2 * math.sqrt(MODEL_BYTES * PER_CALL_S / BANDWIDTH))
    assert optimal_bucket_bytes(MODEL_BYTES, BANDWIDTH, PER_CALL_S) == pytest.approx(
        math.sqrt(MODEL_BYTES * BANDWIDTH * PER_CALL_S))


@pytest.mark.parametrize("num_buckets", [1, 7, 100])
def test_pipeline_reduces_to_the_closed_form_when_compute_equals_transfer(num_buckets):
    buckets = [MODEL_BYTES / num_buckets] * num_buckets
    simulated = pipelined_overhead_s(buckets, MODEL_BYTES / BANDWIDTH, BANDWIDTH, PER_CALL_S)
    assert simulated == pytest.approx(ddp_overhead_s(MODEL_BYTES, BANDWIDTH, PER_CALL_S, num_buckets))


def test_pipeline_with_slow_backward_leaves_only_the_last_bucket():
    buckets = [1e9, 2e9, 5e8]
    # Backward ten times longer than the transfer: every all-reduce but the last is hidden.
    overhead = pipelined_overhead_s(buckets, 10 * sum(buckets) / BANDWIDTH, BANDWIDTH, PER_CALL_S)
    assert overhead == pytest.approx(PER_CALL_S + buckets[-1] / BANDWIDTH)


def test_allreduce_cost_takes_latency_from_the_small_and_bandwidth_from_the_large():
    per_call_s, bandwidth = allreduce_cost(4096, 40e-6, 1e9, 40e-6 + 1e9 / BANDWIDTH)
    assert per_call_s == 40e-6
    assert bandwidth == pytest.approx(BANDWIDTH)
    with pytest.raises(ValueError, match="no longer"):
        allreduce_cost(4096, 1e-3, 1e9, 1e-3)


def test_overhead_model_rejects_nonsense():
    with pytest.raises(ValueError, match="num_buckets"):
        ddp_overhead_s(MODEL_BYTES, BANDWIDTH, PER_CALL_S, 0)
    with pytest.raises(ValueError, match="per_call_overhead_s"):
        optimal_num_buckets(MODEL_BYTES, BANDWIDTH, 0)
    with pytest.raises(ValueError, match="per_call_overhead_s"):
        ddp_overhead_s(MODEL_BYTES, BANDWIDTH, math.nan, 4)
    with pytest.raises(ValueError, match=r"bucket_bytes\[1\]"):
        pipelined_overhead_s([1e6, 0.0], 1e-3, BANDWIDTH, PER_CALL_S)
    with pytest.raises(ValueError, match="per_call_overhead_s"):
        pipelined_overhead_s([1e6], 1e-3, BANDWIDTH, -1.0)
