"""Problem distributed_communication_single_node's report: the sentences and cells of its tables of all-reduce time
and bus bandwidth by backend, size and number of ranks, and what they show (the package's benchmarks/allreduce.py
measures them; the tables and the plot are declared in cs336_systems.reports.problems)."""

from __future__ import annotations

from collections.abc import Iterable

from cs336_systems.gpus import GB, MB
from cs336_systems.reports import (
    NOT_RUN,
    Reports,
    format_ms,
    listing,
    not_in_report,
    oom_text,
    select,
)
from cs336_systems.rows import OOM, Row
from cs336_systems.rows.allreduce import MAX_ITERATIONS, MIN_ITERATIONS, WARMUP


def _size_label(size_bytes: float) -> str:
    return f"{size_bytes / GB:g} GB" if size_bytes >= GB else f"{size_bytes / MB:g} MB"


# The largest size this far short of the best bus bandwidth is a decline.
DECLINE_SHARE = 0.9
# Across world sizes, bus bandwidth within this share of the first is "flat": the ring's extra bytes
# per link account for the extra time.
FLAT_BUS_BANDWIDTH = 0.15


def _ran_out(ooms: list[Row], what: str) -> str:
    """ "10 GB, the largest size, ran out of memory (predicted, not run)": the sizes of these OOM rows and `what`
    they are, as a sentence names them."""
    predicted = all(r.get("oom_predicted") for r in ooms)
    return (f"{listing([_size_label(r['size_bytes']) for r in ooms])}, {what}, ran out of memory"
            + (f" ({NOT_RUN})" if predicted else ""))


def _largest(ooms: list[Row]) -> str:
    return "the largest size" + ("s" if len(ooms) > 1 else "")


def _size_findings(backend: str, n: int, line: list[Row], ooms: list[Row]) -> str:
    """How bandwidth changes with size for one backend and world size, read from its measured rows (`line`) and its
    OOM rows, by size.

    At the smallest size, the share of the time beyond moving its bytes at the best bus bandwidth is the per-call
    cost: the time at bus bandwidth b is bytes / b, so at a share s of the best, 1 - s of it is that cost."""
    text = f"- {backend}, {n} ranks: "
    if not line:
        return text + _ran_out(ooms, "every size") + "."
    small, large = line[0], line[-1]
    best = max(line, key=lambda r: r["busbw_gbps"])
    share = small["busbw_gbps"] / best["busbw_gbps"]
    if best is small:
        text += (f"bus bandwidth is best at the smallest size, {best['busbw_gbps']:.3g} GB/s at "
                 f"{_size_label(small['size_bytes'])}")
    else:
        text += (f"at {_size_label(small['size_bytes'])}, {share:.0%} of the best bus bandwidth "
                 f"({best['busbw_gbps']:.3g} GB/s at {_size_label(best['size_bytes'])}), so per-call cost takes about "
                 f"{1 - share:.0%} of the time there")
    if best is not large and large["busbw_gbps"] < DECLINE_SHARE * best["busbw_gbps"]:
        text += (f", and past {_size_label(best['size_bytes'])} bandwidth falls "
                 f"({large['busbw_gbps'] / best['busbw_gbps']:.0%} of the best at {_size_label(large['size_bytes'])})")
    larger = [r for r in ooms if r["size_bytes"] > large["size_bytes"]]
    if larger:
        text += "; " + _ran_out(larger, _largest(larger))
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


def _by_size(rows: Iterable[Row]) -> list[Row]:
    return sorted(rows, key=lambda r: r["size_bytes"])


def findings(rows: list[Row]) -> str:
    """What the rows show, each backend's OOM rows among them: a size that ran out of memory is named, never taken
    for one that was not in the sweep. A blank line more stands between them and the plot."""
    lines = []
    for backend in sorted({r["backend"] for r in rows}):
        mine = [r for r in rows if r["backend"] == backend and not out_of_memory(r)]
        ooms = [r for r in rows if r["backend"] == backend and out_of_memory(r)]
        for n in sorted({r["world_size"] for r in rows if r["backend"] == backend}):
            lines.append(_size_findings(backend, n, _by_size(select(mine, world_size=n)),
                                      _by_size(select(ooms, world_size=n))))
        if not mine:
            continue
        largest = max(r["size_bytes"] for r in mine)
        at_largest = sorted((r for r in mine if r["size_bytes"] == largest), key=lambda r: r["world_size"])
        if len(at_largest) > 1:
            lines.append(_rank_findings(backend, at_largest))
    measured = [r for r in rows if not out_of_memory(r)]
    common = [(g, n) for g in measured if g["backend"] == "gloo" for n in measured
              if n["backend"] == "nccl" and (n["world_size"], n["size_bytes"]) == (g["world_size"], g["size_bytes"])]
    if common:
        gloo, nccl = max(common, key=lambda pair: (pair[0]["size_bytes"], pair[0]["world_size"]))
        lines.append(
            f"- NCCL on GPUs against gloo on CPUs, {gloo['world_size']} ranks, {_size_label(gloo['size_bytes'])}: "
            f"{gloo['mean_rank_median_ms'] / nccl['mean_rank_median_ms']:.3g}x faster.")
    return "## Findings\n\n" + "\n".join(lines) + "\n\n"


def setup(rows: list[Row]) -> str:
    devices = ", ".join(sorted({f"{r['backend']} on {r['device']}" for r in rows}))
    return (f"float32 all-reduce (sum), {devices}; {WARMUP} warm-up, then {MIN_ITERATIONS}-{MAX_ITERATIONS} timed "
            "all-reduces per cell, each after a barrier, device synchronised. Each rank takes its median; tables show "
            "the mean of the ranks' medians (the slowest rank's in brackets). 1 MB = 10^6 bytes.\n")


def in_order(rows: list[Row]) -> list[Row]:
    """The rows by backend, world size and size, each with its size as the tables head it ("size 1 GB")."""
    return [{**r, "size": _size_label(r["size_bytes"])}
            for r in sorted(rows, key=lambda r: (r["backend"], r["world_size"], r["size_bytes"]))]


def time_cell(row: Row) -> str:
    if out_of_memory(row):
        return oom_text(row)
    return f"{row['mean_rank_median_ms']:.3g} (max {row['max_rank_median_ms']:.3g})"


def bandwidth_cell(row: Row) -> str:
    if out_of_memory(row):
        return oom_text(row)
    return f"{row['busbw_gbps']:.3g} ({row['algbw_gbps']:.3g})"


def nominal_comparison(rows: list[Row]) -> str:
    linked = [r for r in rows if r.get("nominal_link_gbps") and not out_of_memory(r)]
    if not linked:
        return ""
    best = max(linked, key=lambda r: r["busbw_gbps"])
    return (f"\nNVLink {best['nvlink_generation']} is nominally {2 * best['nominal_link_gbps']:.0f} GB/s "
            f"bidirectional per GPU, {best['nominal_link_gbps']:.0f} GB/s per direction; bus bandwidth counts "
            f"per-direction bytes, so the best measured, {best['busbw_gbps']:.0f} GB/s ({best['world_size']} ranks, "
            f"{_size_label(best['size_bytes'])}), is {best['busbw_gbps'] / best['nominal_link_gbps']:.0%} of "
            f"{best['nominal_link_gbps']:.0f} GB/s.\n")


def nominal_links(rows: list[Row]) -> list[tuple[float, str]]:
    """The plot's reference lines: each link's nominal bandwidth per direction."""
    return [(nominal, f"NVLink per direction ({nominal:.0f} GB/s)")
            for nominal in sorted({r["nominal_link_gbps"] for r in rows if r.get("nominal_link_gbps")})]


def out_of_memory(row: Row) -> bool:
    return row["status"] == OOM


# ---------------------------------------------------------------------------------------------- answers

def answer_distributed_communication_single_node(reports: Reports) -> list[str]:
    rows = reports["distributed_communication_single_node"]
    sentences = []
    for backend, device in (("gloo", "CPU"), ("nccl", "GPUs")):
        mine = [r for r in select(rows, backend=backend) if not out_of_memory(r)]
        ooms = _by_size(r for r in select(rows, backend=backend) if out_of_memory(r))
        if ooms and not mine:
            sentences.append(f"{backend} on {device}: " + _ran_out(ooms, "every size") + ".")
            continue
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
        larger = _by_size(r for r in select(rows, backend=backend, world_size=fewest)
                          if out_of_memory(r) and r["size_bytes"] > large["size_bytes"])
        if larger:
            text += "; " + _ran_out(larger, _largest(larger))
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
