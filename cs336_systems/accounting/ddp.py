"""DDP communication overhead: how long a step waits for gradient all-reduces after backward ends.

Symbols: s, bytes of gradients to all-reduce (the trainable parameters); w, the all-reduce's
algorithm bandwidth (bytes of each rank's data over the time the all-reduce takes); o, a fixed
cost per all-reduce call (launch, synchronisation, latency); n_b, the number of buckets.

The course's model. Split the gradients into n_b equal buckets of s / n_b bytes, and assume that
computing one bucket's gradients takes as long as transferring it, c = s / (n_b w). Bucket i
(i = 1..n_b) is ready at i c; its all-reduce takes c + o and starts once it is ready and the one
before it has finished. By induction bucket i's all-reduce ends at (i + 1) c + i o: true for
i = 1 (ready at c, done at 2c + o), and if bucket i-1 ends at i c + (i-1) o >= i c, bucket i
starts then and ends c + o later. Backward ends at n_b c, so the overhead is

    overhead(n_b) = (n_b + 1) c + n_b o - n_b c = s / (n_b w) + n_b o.

More buckets hide more of the transfer behind backward but pay o more often. Setting
d overhead / d n_b = -s / (n_b^2 w) + o to zero gives

    n_b* = sqrt(s / (w o)),   bucket size b* = s / n_b* = sqrt(s w o),   overhead* = 2 sqrt(s o / w).

When backward takes longer than the transfer (compute per bucket > transfer per bucket), each
all-reduce finishes before the next bucket is ready and only the last bucket's is left after
backward: `pipelined_overhead_s` simulates that general case with measured backward time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from cs336_systems.checks import check_non_negative, check_positive


def ddp_overhead_s(model_bytes: float, bandwidth_bytes_per_s: float, per_call_overhead_s: float,
                   num_buckets: float) -> float:
    """s / (n_b w) + n_b o: time after backward until the gradients are reduced (course's model)."""
    check_positive(model_bytes=model_bytes, bandwidth_bytes_per_s=bandwidth_bytes_per_s, num_buckets=num_buckets)
    check_non_negative(per_call_overhead_s=per_call_overhead_s)
    return model_bytes / (num_buckets * bandwidth_bytes_per_s) + num_buckets * per_call_overhead_s


def optimal_num_buckets(model_bytes: float, bandwidth_bytes_per_s: float, per_call_overhead_s: float) -> float:
    """n_b* = sqrt(s / (w o)), the (real-valued) bucket count that minimises `ddp_overhead_s`."""
    check_positive(model_bytes=model_bytes, bandwidth_bytes_per_s=bandwidth_bytes_per_s,
                    per_call_overhead_s=per_call_overhead_s)
    return math.sqrt(model_bytes / (bandwidth_bytes_per_s * per_call_overhead_s))


def optimal_bucket_bytes(model_bytes: float, bandwidth_bytes_per_s: float, per_call_overhead_s: float) -> float:
    """b* = sqrt(s w o): the bucket size that minimises `ddp_overhead_s`."""
    return model_bytes / optimal_num_buckets(model_bytes, bandwidth_bytes_per_s, per_call_overhead_s)


def pipelined_overhead_s(bucket_bytes: Sequence[float], backward_s: float, bandwidth_bytes_per_s: float,
                         per_call_overhead_s: float) -> float:
    """Time after backward until the last bucket is reduced, gradients produced at a steady rate.

    Bucket i is ready when backward has produced all bytes up to and including it (at the rate
    sum(bucket_bytes) / backward_s); all-reduces run one at a time, each taking o + bytes / w.
    With equal buckets and backward_s = s / w this is exactly `ddp_overhead_s`.
    """
    if not bucket_bytes:
        raise ValueError("need at least one bucket")
    check_positive(backward_s=backward_s, bandwidth_bytes_per_s=bandwidth_bytes_per_s)
    check_positive(**{f"bucket_bytes[{i}]": size for i, size in enumerate(bucket_bytes)})
    check_non_negative(per_call_overhead_s=per_call_overhead_s)
    total = sum(bucket_bytes)
    produced = 0.0
    done_s = 0.0
    for size in bucket_bytes:
        produced += size
        ready_s = backward_s * produced / total
        done_s = max(done_s, ready_s) + per_call_overhead_s + size / bandwidth_bytes_per_s
    return done_s - backward_s


def allreduce_cost(small_bytes: float, small_s: float, large_bytes: float, large_s: float) -> tuple[float, float]:
    """(o, w) from two measured all-reduces: o is the small one's time (it is nearly all fixed
    cost), w the bandwidth the large one achieves once o is taken off."""
    check_positive(small_bytes=small_bytes, small_s=small_s, large_bytes=large_bytes, large_s=large_s)
    if not large_bytes > small_bytes:
        raise ValueError(f"the large all-reduce ({large_bytes} bytes) must be larger than the small one "
                         f"({small_bytes})")
    if not large_s > small_s:
        raise ValueError(f"the large all-reduce took {large_s} s, no longer than the small one's {small_s} s")
    return small_s, large_bytes / (large_s - small_s)
