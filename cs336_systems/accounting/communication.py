"""Ring collectives in the alpha-beta model: how long an all-gather, reduce-scatter or all-reduce takes.

The model. N devices form a ring; in each step every device sends one message to its successor and
receives one from its predecessor, all at once. A message of m bytes takes latency_s + m / w, where
w (`bandwidth_bytes_per_s`) is the rate at which one device can push bytes into the ring while it
receives at the same rate. A bidirectional ring is two rings, each carrying half of every message,
so the scaling book's bidirectional W_ici plugs in directly as w. `array_bytes` (V) is always the
size of the whole logical array, never a shard.

All-gather: each device starts with a shard of V / N bytes and ends with all N. In each of N - 1
steps every device forwards the shard it received last (its own first), so every shard visits every
device once:

    T_ag = (N - 1) latency_s + (N - 1) / N * V / w.

Reduce-scatter: each device starts with a full V-byte array of partial sums and ends with 1/N of
the total. Split the array into N chunks; in step k each device adds the chunk it received to its
own copy of that chunk and forwards the sum. After N - 1 steps each device holds one fully reduced
chunk: the same N - 1 messages of V / N bytes, so T_rs = T_ag.

All-reduce (ring, Patarasuk and Yuan 2009): a reduce-scatter phase then an all-gather phase inside
one algorithm, 2(N - 1) steps of V / N bytes:

    T_ar = 2 (N - 1) latency_s + 2 (N - 1) / N * V / w.

The alternate all-reduce of the course's handout passes whole arrays around the ring instead: in
step t = 1 ... N - 1 device i sends x^((i - t + 1) mod N), the array it received last (its own
first), and adds the one it receives to its running sum. After N - 1 steps every device has added
every other device's array, so it is an all-reduce, but each step moves all V bytes, not V / N:

    T_alt = (N - 1) latency_s + (N - 1) V / w,   N / 2 times the ring all-reduce's bandwidth term.

As N grows, (N - 1) / N -> 1: the bandwidth term of an all-gather tends to V / w whatever N is (the
scaling book's T = V / W_ici), while the latency term keeps growing with N. Below roughly
N * w * latency_s bytes the latency term is the larger one (`latency_bound_below_bytes`).
"""

from __future__ import annotations

from cs336_systems.checks import check_choice, check_non_negative, check_positive, check_positive_int


def _check(array_bytes: float, num_devices: int, bandwidth_bytes_per_s: float, latency_s: float) -> None:
    check_positive_int(num_devices=num_devices)
    check_non_negative(array_bytes=array_bytes)
    check_positive(bandwidth_bytes_per_s=bandwidth_bytes_per_s)
    check_non_negative(latency_s=latency_s)


def _ring_steps_s(steps: int, message_bytes: float, bandwidth_bytes_per_s: float, latency_s: float) -> float:
    """`steps` ring steps, each every device sending one `message_bytes` message to its successor."""
    return steps * (latency_s + message_bytes / bandwidth_bytes_per_s)


def all_gather_s(array_bytes: float, num_devices: int, bandwidth_bytes_per_s: float,
                 latency_s: float = 0.0) -> float:
    """(N - 1) latency + (N - 1) / N * V / w: gather N shards of a V-byte array onto every device."""
    _check(array_bytes, num_devices, bandwidth_bytes_per_s, latency_s)
    return _ring_steps_s(num_devices - 1, array_bytes / num_devices, bandwidth_bytes_per_s, latency_s)


def reduce_scatter_s(array_bytes: float, num_devices: int, bandwidth_bytes_per_s: float,
                     latency_s: float = 0.0) -> float:
    """(N - 1) latency + (N - 1) / N * V / w: sum N V-byte arrays, leaving 1/N of the sum on each device."""
    _check(array_bytes, num_devices, bandwidth_bytes_per_s, latency_s)
    return _ring_steps_s(num_devices - 1, array_bytes / num_devices, bandwidth_bytes_per_s, latency_s)


def all_reduce_s(array_bytes: float, num_devices: int, bandwidth_bytes_per_s: float,
                 latency_s: float = 0.0) -> float:
    """2 (N - 1) latency + 2 (N - 1) / N * V / w: the ring all-reduce, 2(N - 1) steps of V / N bytes."""
    _check(array_bytes, num_devices, bandwidth_bytes_per_s, latency_s)
    return _ring_steps_s(2 * (num_devices - 1), array_bytes / num_devices, bandwidth_bytes_per_s, latency_s)


def alternate_all_reduce_s(array_bytes: float, num_devices: int, bandwidth_bytes_per_s: float,
                           latency_s: float = 0.0) -> float:
    """(N - 1) latency + (N - 1) V / w: N - 1 steps, each passing a whole V-byte array to the next device."""
    _check(array_bytes, num_devices, bandwidth_bytes_per_s, latency_s)
    return _ring_steps_s(num_devices - 1, array_bytes, bandwidth_bytes_per_s, latency_s)


COLLECTIVES = {
    "all_gather": all_gather_s,
    "reduce_scatter": reduce_scatter_s,
    "all_reduce": all_reduce_s,
    "alternate_all_reduce": alternate_all_reduce_s,
}


def bytes_sent_per_device(collective: str, array_bytes: float, num_devices: int) -> float:
    """Bytes each device sends (and receives): (N - 1) / N * V, twice that for the ring all-reduce,
    (N - 1) V for the alternate all-reduce."""
    check_choice("collective", collective, COLLECTIVES)
    _check(array_bytes, num_devices, 1.0, 0.0)
    if collective == "alternate_all_reduce":
        return (num_devices - 1) * array_bytes
    phases = 1 if collective in ("all_gather", "reduce_scatter") else 2
    return phases * (num_devices - 1) / num_devices * array_bytes


def latency_bound_below_bytes(num_devices: int, bandwidth_bytes_per_s: float, latency_s: float) -> float:
    """The array size V at which a ring collective's latency and bandwidth terms are equal.

    (N - 1) latency = (N - 1) / N * V / w  <=>  V = N w latency; smaller arrays are latency bound.
    """
    _check(0.0, num_devices, bandwidth_bytes_per_s, latency_s)
    return num_devices * bandwidth_bytes_per_s * latency_s
