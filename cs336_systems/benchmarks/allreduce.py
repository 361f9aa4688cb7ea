"""Problem distributed_communication_single_node: all-reduce time and bandwidth by backend, data
size and number of ranks.

    rows = launch(allreduce_sweep, 6, SIZES_BYTES, (2, 4, 6), device="cpu")[0]

One launch of the largest world size serves the whole sweep: a smaller world size runs on a
subgroup of the first ranks while the others wait, so ranks start (and import torch) once.
Every rank times each all-reduce on its own (device synchronised, ranks released together by a
barrier before each one); the ranks' medians are gathered with all_gather_object into one row.

Bandwidths (nccl-tests' definitions): algorithm bandwidth = bytes / time. Bus bandwidth =
algbw * 2(n-1)/n: a ring all-reduce sends (and receives) 2(n-1)/n of the data on every rank's
link, so bus bandwidth is what each link carried per second in each direction. It is comparable
across world sizes and is the number to set against a link's nominal per-direction bandwidth.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import torch
import torch.distributed as dist

from cs336_systems.benchmarks.harness import guarded_cell
from cs336_systems.distributed.launch import rank_device
from cs336_systems.gpus import MB, spec_for_device_name
from cs336_systems.memory_guard import check_memory_on_every_rank
from cs336_systems.reports import (
    OOM,
    Rendered,
    Reports,
    Row,
    format_ms,
    listing,
    markdown_table,
    not_in_report,
    pivot,
    select,
)
from cs336_systems.timing import STEP_TIMER, synchronize, timed

GB = 10**9
SIZES_BYTES = (1 * MB, 10 * MB, 100 * MB, 1 * GB)
GLOO_WORLD_SIZES = (2, 4, 6)
NCCL_WORLD_SIZES = (2, 4, 6, 8)
FLOAT32_BYTES = 4
# What one rank holds for an all-reduce of a tensor: the tensor and, at most, a working copy of the
# same size that the backend reduces into.
ALLREDUCE_COPIES = 2
WARMUP = 5
# Timed iterations per cell: enough for a stable median, at most about SECONDS_PER_CELL of
# all-reduces (1 GB over gloo takes on the order of a second each).
MIN_ITERATIONS, MAX_ITERATIONS = 3, 20
SECONDS_PER_CELL = 3.0
# The all-reduce's ranks share the host's cores: with fewer than this many per rank of the
# largest world size, the 100 MB and 1 GB gloo cells would take minutes, so they are left out.
GLOO_CORES_PER_RANK_FOR_LARGE_SIZES = 2
GLOO_SIZE_LIMIT_ON_SMALL_HOSTS = 10 * MB

# Nominal NVLink bandwidth of one GPU, per direction (half the datasheet's bidirectional figure):
# NVLink 3 (A100) 600 GB/s, NVLink 4 (H100 SXM, H200) 900 GB/s, NVLink 5 (B200) 1.8 TB/s.
NVLINK_BYTES_PER_S_PER_DIRECTION = {
    "a100": 300 * GB, "a100-40gb": 300 * GB, "h100": 450 * GB, "h200": 450 * GB, "b200": 900 * GB,
}
NVLINK_GENERATION = {"a100": 3, "a100-40gb": 3, "h100": 4, "h200": 4, "b200": 5}


def bus_bandwidth(algbw_bytes_per_s: float, world_size: int) -> float:
    return algbw_bytes_per_s * 2 * (world_size - 1) / world_size


def gloo_sizes(cpu_count: int, max_world_size: int, sizes_bytes: Sequence[int] = SIZES_BYTES) -> tuple[int, ...]:
    """All sizes with at least GLOO_CORES_PER_RANK_FOR_LARGE_SIZES cores per rank, else those up to 10 MB."""
    if cpu_count >= GLOO_CORES_PER_RANK_FOR_LARGE_SIZES * max_world_size:
        return tuple(sizes_bytes)
    return tuple(s for s in sizes_bytes if s <= GLOO_SIZE_LIMIT_ON_SMALL_HOSTS)


def summarize(backend: str, device_name: str, world_size: int, size_bytes: int, iterations: int,
              rank_medians_s: Sequence[float]) -> Row:
    """One row from every rank's median time: the mean over ranks and the slowest rank."""
    if len(rank_medians_s) != world_size:
        raise ValueError(f"expected {world_size} per-rank medians, got {len(rank_medians_s)}")
    mean_s = statistics.fmean(rank_medians_s)
    algbw = size_bytes / mean_s
    row = {"backend": backend, "device": device_name, "world_size": world_size, "size_bytes": size_bytes,
           "size_mb": size_bytes / MB, "status": "ok", "iterations": iterations, "timer": STEP_TIMER,
           "mean_rank_median_ms": mean_s * 1e3, "max_rank_median_ms": max(rank_medians_s) * 1e3,
           "algbw_gbps": algbw / GB, "busbw_gbps": bus_bandwidth(algbw, world_size) / GB}
    spec = spec_for_device_name(device_name) if backend == "nccl" else None
    if spec is not None and spec.slug in NVLINK_BYTES_PER_S_PER_DIRECTION:
        row["nvlink_generation"] = NVLINK_GENERATION[spec.slug]
        row["nominal_link_gbps"] = NVLINK_BYTES_PER_S_PER_DIRECTION[spec.slug] / GB
    return row


def time_allreduce(size_bytes: int, group=None, warmup: int = WARMUP) -> tuple[float, int]:
    """(this rank's median seconds, timed iterations) for a float32 all-reduce of `size_bytes`.

    Every rank of `group` must call it. The iteration count comes from rank 0's warm-up pace, so
    that all ranks run the same number of all-reduces.
    """
    device = rank_device()
    tensor = torch.rand(size_bytes // FLOAT32_BYTES, device=device)
    warmup_ms: list[float] = []
    for _ in range(warmup):
        with timed(device, warmup_ms):
            dist.all_reduce(tensor, group=group)
    pace = [warmup_ms[-1] * 1e-3 if warmup_ms else None]
    dist.broadcast_object_list(pace, src=0, group=group)
    iterations = MAX_ITERATIONS if pace[0] is None else \
        max(MIN_ITERATIONS, min(MAX_ITERATIONS, int(SECONDS_PER_CELL / pace[0])))
    samples_ms: list[float] = []
    for _ in range(iterations):
        dist.barrier(group=group)  # start together: no rank's time includes waiting for a late one
        synchronize(device)
        with timed(device, samples_ms):
            dist.all_reduce(tensor, group=group)
    return statistics.median(samples_ms) * 1e-3, iterations


def _guarded_size(backend: str, device_name: str, device: torch.device, size_bytes: int, group,
                  group_size: int) -> Row:
    """One size's row on every rank of `group`, or its OOM row where its buffers do not fit on every rank
    (then no rank runs it) or an all-reduce runs out of memory."""
    def measure(columns: Row) -> Row:
        median_s, iterations = time_allreduce(size_bytes, group)
        medians: list[float | None] = [None] * group_size
        dist.all_gather_object(medians, median_s, group=group)
        return summarize(backend, device_name, group_size, size_bytes, iterations, medians)

    estimated_bytes = ALLREDUCE_COPIES * size_bytes
    return guarded_cell(device, lambda: check_memory_on_every_rank(estimated_bytes, device, group_size, group), measure,
                        oom=lambda columns: {"backend": backend, "device": device_name, "world_size": group_size,
                                             "size_bytes": size_bytes, "size_mb": size_bytes / MB, **columns})


def allreduce_sweep(rank: int, world_size: int, sizes_bytes: Sequence[int], world_sizes: Sequence[int]) -> list[Row]:
    """Run under launch with world_size = max(world_sizes); rank 0 returns the rows, others []."""
    if max(world_sizes) > world_size:
        raise ValueError(f"world sizes {tuple(world_sizes)} need {max(world_sizes)} ranks, the launch has {world_size}")
    backend = dist.get_backend()
    device = rank_device()
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    rows = []
    for group_size in world_sizes:
        group = dist.new_group(list(range(group_size)))  # every rank takes part in creating it
        if rank < group_size:
            rows += [_guarded_size(backend, device_name, device, size_bytes, group, group_size)
                     for size_bytes in sizes_bytes]
            dist.destroy_process_group(group)
        dist.barrier()
    return rows if rank == 0 else []


# ------------------------------------------------------------------------------------------ report

def _size_label(size_bytes: float) -> str:
    return f"{size_bytes / GB:g} GB" if size_bytes >= GB else f"{size_bytes / MB:g} MB"


# At the smallest size, a backend reaching under this share of its best bus bandwidth spends more than
# half the time on its fixed per-call cost; the largest size this far short of the best is a decline.
FIXED_COST_BOUND_SHARE = 0.5
DECLINE_SHARE = 0.9
# Across world sizes, bus bandwidth within this share of the first is "flat": the ring's extra bytes
# per link account for the extra time.
FLAT_BUS_BANDWIDTH = 0.15


def _size_findings(backend: str, n: int, line: list[Row]) -> str:
    """How bandwidth changes with size for one backend and world size, read from its rows."""
    small, large = line[0], line[-1]
    best = max(line, key=lambda r: r["busbw_gbps"])
    share = small["busbw_gbps"] / best["busbw_gbps"]
    text = (f"- {backend}, {n} ranks: at {_size_label(small['size_bytes'])}, {share:.0%} of the best bus bandwidth "
            f"({best['busbw_gbps']:.3g} GB/s at {_size_label(best['size_bytes'])}): ")
    if share < FIXED_COST_BOUND_SHARE:
        text += "a fixed per-call cost takes more than half the time there"
    else:
        text += "the per-call cost is small beside the transfer at every size measured"
    if best is not large and large["busbw_gbps"] < DECLINE_SHARE * best["busbw_gbps"]:
        text += (f", and past {_size_label(best['size_bytes'])} bandwidth falls "
                 f"({large['busbw_gbps'] / best['busbw_gbps']:.0%} of the best at {_size_label(large['size_bytes'])})")
    return text + "."


def _rank_findings(backend: str, at_size: list[Row]) -> str:
    """How time and bus bandwidth change with the world size at one size."""
    first, last = at_size[0], at_size[-1]
    ring = [2 * (r["world_size"] - 1) / r["world_size"] for r in (first, last)]
    spread = max(abs(r["busbw_gbps"] / first["busbw_gbps"] - 1) for r in at_size)
    text = (f"- {backend} at {_size_label(first['size_bytes'])}: from {first['world_size']} to {last['world_size']} "
            f"ranks the time grows {last['mean_rank_median_ms'] / first['mean_rank_median_ms']:.2f}x, a ring's "
            f"2(n-1)/n of the data per link {ring[1] / ring[0]:.2f}x. Bus bandwidth, which divides that factor out, ")
    if spread <= FLAT_BUS_BANDWIDTH:
        return text + f"stays within {spread:.0%}: the extra time is the extra bytes each rank's link carries."
    direction = "falls" if last["busbw_gbps"] < first["busbw_gbps"] else "rises"
    return text + f"{direction}: more ranks change more than the bytes per link."


def _findings(rows: list[Row]) -> list[str]:
    findings = []
    for backend in sorted({r["backend"] for r in rows}):
        mine = [r for r in rows if r["backend"] == backend]
        for n in sorted({r["world_size"] for r in mine}):
            findings.append(_size_findings(backend, n, sorted((r for r in mine if r["world_size"] == n),
                                                               key=lambda r: r["size_bytes"])))
        largest = max(r["size_bytes"] for r in mine)
        at_largest = sorted((r for r in mine if r["size_bytes"] == largest), key=lambda r: r["world_size"])
        if len(at_largest) > 1:
            findings.append(_rank_findings(backend, at_largest))
    common = [(g, n) for g in rows if g["backend"] == "gloo" for n in rows
              if n["backend"] == "nccl" and (n["world_size"], n["size_bytes"]) == (g["world_size"], g["size_bytes"])]
    if common:
        gloo, nccl = max(common, key=lambda pair: (pair[0]["size_bytes"], pair[0]["world_size"]))
        findings.append(
            f"- NCCL on GPUs against gloo on CPUs, {gloo['world_size']} ranks, {_size_label(gloo['size_bytes'])}: "
            f"{gloo['mean_rank_median_ms'] / nccl['mean_rank_median_ms']:.3g}x faster.")
    return findings


def _nominal_comparison(rows: list[Row]) -> str:
    linked = [r for r in rows if r.get("nominal_link_gbps")]
    if not linked:
        return ""
    best = max(linked, key=lambda r: r["busbw_gbps"])
    return (f"\nNVLink {best['nvlink_generation']} is nominally {2 * best['nominal_link_gbps']:.0f} GB/s "
            f"bidirectional per GPU, {best['nominal_link_gbps']:.0f} GB/s per direction; bus bandwidth counts "
            f"per-direction bytes, so the best measured, {best['busbw_gbps']:.0f} GB/s ({best['world_size']} ranks, "
            f"{_size_label(best['size_bytes'])}), is {best['busbw_gbps'] / best['nominal_link_gbps']:.0%} of "
            f"{best['nominal_link_gbps']:.0f} GB/s.\n")


def _plot(rows: list[Row]):
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4.5))
    axes = figure.subplots()
    for backend, n in sorted({(r["backend"], r["world_size"]) for r in rows}):
        line = sorted((r for r in rows if r["backend"] == backend and r["world_size"] == n),
                      key=lambda r: r["size_bytes"])
        axes.plot([r["size_mb"] for r in line], [r["busbw_gbps"] for r in line], marker="o",
                  label=f"{backend}, {n} ranks")
    for nominal in sorted({r["nominal_link_gbps"] for r in rows if r.get("nominal_link_gbps")}):
        axes.axhline(nominal, color="gray", linestyle="--", label=f"NVLink per direction ({nominal:.0f} GB/s)")
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlabel("all-reduce size (MB)")
    axes.set_ylabel("bus bandwidth (GB/s)")
    axes.set_title("all-reduce bus bandwidth")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    return figure


def _out_of_memory(row: Row) -> bool:
    return row.get("status") == OOM  # rows measured before the status column read as measured


ALLREDUCE_KEY = ("backend", "world_size", "size_bytes")


def render_allreduce(rows: list[Row]) -> Rendered:
    rows = sorted(rows, key=lambda r: (r["backend"], r["world_size"], r["size_bytes"]))
    labelled = [{**r, "size": _size_label(r["size_bytes"])} for r in rows]
    devices = ", ".join(sorted({f"{r['backend']} on {r['device']}" for r in rows}))
    times = pivot(labelled, ["backend", "world_size"], "size", "mean_rank_median_ms",
                  fmt=lambda r: OOM if _out_of_memory(r) else
                  f"{r['mean_rank_median_ms']:.3g} (max {r['max_rank_median_ms']:.3g})")
    bandwidths = pivot(labelled, ["backend", "world_size"], "size", "busbw_gbps",
                       fmt=lambda r: OOM if _out_of_memory(r) else f"{r['busbw_gbps']:.3g} ({r['algbw_gbps']:.3g})")
    rows = [r for r in rows if not _out_of_memory(r)]
    body = [
        f"float32 all-reduce (sum), {devices}; {WARMUP} warm-up, then {MIN_ITERATIONS}-{MAX_ITERATIONS} timed "
        "all-reduces per cell, each after a barrier, device synchronised. Each rank takes its median; tables show "
        "the mean of the ranks' medians (the slowest rank's in brackets). 1 MB = 10^6 bytes.\n",
        "## Time (ms)\n", markdown_table(times),
        "## Bus bandwidth, GB/s (algorithm bandwidth in brackets)\n", markdown_table(bandwidths),
        _nominal_comparison(rows),
        "## Findings\n", "\n".join(_findings(rows)) + "\n",
        "\n![bus bandwidth](allreduce_bus_bandwidth.png)\n",
    ]
    return Rendered("\n".join(body), figures={"allreduce_bus_bandwidth.png": _plot(rows)})


# ---------------------------------------------------------------------------------------------- answers

def answer_distributed_communication_single_node(reports: Reports) -> list[str]:
    rows = reports["distributed_communication_single_node"]
    sentences = []
    for backend, device in (("gloo", "CPU"), ("nccl", "GPUs")):
        mine = [r for r in select(rows, backend=backend) if r.get("status") != OOM]
        if not mine:
            sentences.append(not_in_report(f"{backend} on {device}") if backend == "gloo" else
                             not_in_report("NCCL on GPUs (it needs 2 GPUs)"))
            continue
        fewest = min(r["world_size"] for r in mine)
        line = sorted(select(mine, world_size=fewest), key=lambda r: r["size_bytes"])
        small, large = line[0], line[-1]
        text = (f"{backend} on {device}, {fewest} ranks: {format_ms(small['mean_rank_median_ms'])} for "
                f"{_size_label(small['size_bytes'])} ({small['busbw_gbps']:.3g} GB/s bus bandwidth) and "
                f"{format_ms(large['mean_rank_median_ms'])} for {_size_label(large['size_bytes'])} "
                f"({large['busbw_gbps']:.3g} GB/s)")
        at_size = sorted(select(mine, size_bytes=large["size_bytes"]), key=lambda r: r["world_size"])
        if len(at_size) > 1:
            text += (f"; at {_size_label(large['size_bytes'])} from {at_size[0]['world_size']} to "
                     f"{at_size[-1]['world_size']} ranks the time goes {format_ms(at_size[0]['mean_rank_median_ms'])} "
                     f"-> {format_ms(at_size[-1]['mean_rank_median_ms'])}")
        sentences.append(text + ".")
    return sentences


def open_items_distributed_communication_single_node(reports: Reports) -> list[str]:
    rows = reports["distributed_communication_single_node"]
    gloo = {r["world_size"] for r in select(rows, backend="gloo")}
    missing = sorted(gloo - {r["world_size"] for r in select(rows, backend="nccl")})
    return [f"NCCL at {listing([str(n) for n in missing])} ranks: needs as many GPUs in one machine"] if missing else []
