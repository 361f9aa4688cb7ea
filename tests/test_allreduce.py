"""The all-reduce benchmark: bandwidth arithmetic, aggregation over ranks, the sweep itself (gloo)."""

from __future__ import annotations

import pytest

from cs336_systems.benchmarks.allreduce import (
    GB,
    MB,
    SIZES_BYTES,
    allreduce_sweep,
    bus_bandwidth,
    gloo_sizes,
    summarize,
)
from cs336_systems.distributed.launch import RankFailed, launch
from cs336_systems.reports.allreduce import answer_distributed_communication_single_node
from cs336_systems.reports.problems import report
from cs336_systems.rows import OOM

LAUNCH_TIMEOUT_S = 180
TINY_SIZES_BYTES = (4096, 64 * 1024)


@pytest.mark.parametrize("world_size, factor", [(2, 1.0), (4, 1.5), (8, 1.75)])
def test_bus_bandwidth_is_algorithm_bandwidth_times_2_n_minus_1_over_n(world_size, factor):
    assert bus_bandwidth(100e9, world_size) == pytest.approx(100e9 * factor)


def test_summary_takes_the_mean_and_the_slowest_rank():
    row = summarize("gloo", "CPU", 2, 10 * MB, 7, [0.010, 0.030])
    assert row["mean_rank_median_ms"] == pytest.approx(20.0)
    assert row["max_rank_median_ms"] == pytest.approx(30.0)
    assert row["algbw_gbps"] == pytest.approx(10 * MB / 0.020 / GB)
    assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"])  # 2 ranks: 2(n-1)/n = 1
    with pytest.raises(ValueError, match="per-rank medians"):
        summarize("gloo", "CPU", 3, MB, 7, [0.01, 0.02])


def test_summary_names_the_nvlink_bandwidth_of_known_gpus_only():
    h200 = summarize("nccl", "NVIDIA H200", 2, GB, 20, [0.004, 0.004])
    assert h200["nominal_link_gbps"] == 450 and h200["nvlink_generation"] == 4
    assert "nominal_link_gbps" not in summarize("nccl", "NVIDIA L4", 2, GB, 20, [0.05, 0.05])


def test_gloo_runs_every_size_only_with_two_cores_per_rank():
    assert gloo_sizes(16, 6) == SIZES_BYTES
    assert gloo_sizes(2, 6) == (1 * MB, 10 * MB)


def test_sweep_gives_one_row_per_world_size_and_size():
    by_rank = launch(allreduce_sweep, 3, TINY_SIZES_BYTES, (2, 3), device="cpu", timeout_s=LAUNCH_TIMEOUT_S)
    rows = by_rank[0]
    assert by_rank[1:] == [[], []]
    assert [(r["world_size"], r["size_bytes"]) for r in rows] == [(n, s) for n in (2, 3) for s in TINY_SIZES_BYTES]
    for row in rows:
        assert row["backend"] == "gloo"
        assert 0 < row["mean_rank_median_ms"] <= row["max_rank_median_ms"]
        assert row["busbw_gbps"] == pytest.approx(bus_bandwidth(row["algbw_gbps"], row["world_size"]))


def test_sweep_refuses_world_sizes_beyond_the_launch():
    with pytest.raises(RankFailed, match="need 4 ranks"):
        launch(allreduce_sweep, 2, TINY_SIZES_BYTES, (2, 4), device="cpu", timeout_s=LAUNCH_TIMEOUT_S)


def test_report_states_what_the_rows_show():
    rows = [summarize("nccl", "NVIDIA H200", 2, size, 20, [seconds, seconds])
            for size, seconds in [(MB, 40e-6), (GB, 3.2e-3)]]
    rows += [summarize("gloo", "CPU", 2, size, 5, [seconds, seconds]) for size, seconds in [(MB, 1e-3), (GB, 0.8)]]
    rendered = report("distributed_communication_single_node").render(rows)
    assert "allreduce_bus_bandwidth.png" in rendered.figures
    assert "312 GB/s" in rendered.body and "69% of" in rendered.body  # 1 GB / 3.2 ms against 450 GB/s
    assert "250x faster" in rendered.body  # 0.8 s against 3.2 ms


def test_findings_follow_each_backends_rows():
    def row(n, size, ms):
        return summarize("gloo", "CPU", n, size, 5, [ms * 1e-3] * n)

    # Bandwidth peaks at 10 MB and falls after; 1 MB already gets 80% of the best, so 20% of its time is per-call cost.
    flat = [row(2, MB, 0.5), row(2, 10 * MB, 4.0), row(2, GB, 500.0)]
    # Four ranks: bus bandwidth 0.5 GB/s at 1 MB against 2 GB/s at 1 GB: 75% of the time at 1 MB is per-call cost.
    costly = [row(4, MB, 3.0), row(4, 10 * MB, 8.0), row(4, GB, 750.0)]
    body = report("distributed_communication_single_node").render(flat + costly).body
    assert ("- gloo, 2 ranks: at 1 MB, 80% of the best bus bandwidth (2.5 GB/s at 10 MB), so per-call cost takes about "
            "20% of the time there, and past 10 MB bandwidth falls (80% of the best at 1 GB).") in body
    assert ("- gloo, 4 ranks: at 1 MB, 25% of the best bus bandwidth (2 GB/s at 1 GB), so per-call cost takes about "
            "75% of the time there.") in body
    # 500 -> 750 ms from 2 to 4 ranks is the ring's 1.00 -> 1.50 bytes per link: bus bandwidth stays at 2 GB/s.
    assert ("from 2 to 4 ranks the time grows 1.50x, a ring's 2(n-1)/n of the data per link 1.50x. Bus bandwidth, "
            "which divides that factor out, stays within 0%") in body
    assert "bandwidth grows with size" not in body


@pytest.mark.parametrize("bandwidth_share, cost_share", [(0.52, "48%"), (0.48, "52%")])
def test_the_per_call_cost_finding_quotes_its_share_of_the_time_on_both_sides_of_one_half(bandwidth_share, cost_share):
    """Bus bandwidth at a share s of the best means 1 - s of the time goes beyond moving the bytes at the best rate:
    52% and 48% of the best are 48% and 52% per-call cost, not one "small" and the other "more than half"."""
    best_s = 10 * MB / (2.5 * GB)  # 10 MB at 2.5 GB/s
    rows = [summarize("gloo", "CPU", 2, MB, 5, [best_s / 10 / bandwidth_share] * 2),
            summarize("gloo", "CPU", 2, 10 * MB, 5, [best_s] * 2)]
    body = report("distributed_communication_single_node").render(rows).body
    assert f"so per-call cost takes about {cost_share} of the time there." in body
    assert "small beside the transfer" not in body and "more than half" not in body


def test_a_largest_size_that_ran_out_of_memory_is_named_in_the_findings_and_the_answer():
    measured = [summarize("nccl", "NVIDIA H200", 2, size, 20, [seconds, seconds])
                for size, seconds in [(MB, 40e-6), (GB, 3.2e-3)]]
    oom = {"backend": "nccl", "device": "NVIDIA H200", "world_size": 2, "size_bytes": 10 * GB, "size_mb": 10 * GB / MB,
           "status": OOM, "oom_predicted": True}
    body = report("distributed_communication_single_node").render(measured + [oom]).body
    assert "OOM (predicted, not run)" in body
    assert ("so per-call cost takes about 92% of the time there; 10 GB, the largest size, ran out of memory "
            "(predicted, not run).") in body
    answer = " ".join(answer_distributed_communication_single_node({"distributed_communication_single_node":
                                                                    measured + [oom]}))
    assert "for 1 GB (312 GB/s); 10 GB, the largest size, ran out of memory (predicted, not run)." in answer
    # Every size out of memory: said, not taken for a backend that was never run.
    answer = " ".join(answer_distributed_communication_single_node({"distributed_communication_single_node": [oom]}))
    assert "nccl on GPUs: 10 GB, every size, ran out of memory (predicted, not run)." in answer
