"""The one way to run a function on every rank: spawned on one host, or in place under torchrun.

    results = launch(train, world_size=2, device="cuda")   # results[rank] is what rank returned

Spawned: one process per rank (one GPU per rank with NCCL, gloo on CPU), meeting at a TCPStore the
parent opens on a free port the OS picks (so parallel test workers never collide). A rank that
raises fails the whole job at once with that rank's traceback; a deadline turns a hang into a
TimeoutError; every rank destroys its process group on the way out. The deadline counts from the last
sign of progress: a rank connecting, or calling `report_progress()`, so that a job of many steps that
each report is not taken for a hang on a busy machine, however long it runs in all.

Under torchrun (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set), `launch` runs the function
in the current process with env:// rendezvous, for one node or several, and all-gathers the
results so that every rank gets the same list.

Either way no rank starts the function before every rank's process group has finished connecting,
and `launch_store()` gives the function this launch's store, for agreeing with other ranks
outside the process group.
"""

from __future__ import annotations

import datetime as dt
import os
import pickle
import queue as queue_module
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 300.0
# How long finished ranks get to exit before they are killed. Spawned ranks also give their own
# collectives this much longer than the job's deadline, so that a hang surfaces as the parent's
# TimeoutError (naming the ranks that never finished) rather than as a rank's own timeout error.
EXIT_GRACE_S = 10.0
_POLL_S = 0.1
_TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# Counts the ranks that have connected, over every launch that shares one store.
_ARRIVALS_KEY = "launch/arrivals"
_CONNECTED_KEY = "connected"
# Counts the calls of report_progress(), under the launch's own prefix.
_PROGRESS_KEY = "progress"

# This rank's view of its launch's store while the launch's function runs (see launch_store()).
_store: dist.Store | None = None


class RankFailed(RuntimeError):
    """A rank raised or died; the message carries its traceback or exit code."""


def under_torchrun() -> bool:
    return all(v in os.environ for v in _TORCHRUN_VARIABLES)


def resolve_device_type(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' asked for, but torch sees no CUDA GPU")
    return device


def backend_for(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def rank_device() -> torch.device:
    """The device this rank computes on: its GPU in an NCCL group, the CPU in a gloo group."""
    require_process_group("rank_device()")
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def require_process_group(what: str) -> None:
    """Raise a clear error when `what` is built before torch.distributed is initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{what} needs an initialised process group: call torch.distributed.init_process_group "
            "first, or run the code through cs336_systems.distributed.launch"
        )


def require_same_on_every_rank(what: str, entries: list[tuple]) -> None:
    """Collective: raise on every rank, naming the first difference, unless every rank passes equal
    `entries` (such as each parameter's name, shape and dtype).

    Collectives pair up by their order alone, so ranks that go on to communicate tensors that differ
    in number or shape hang, or abort inside the backend; this one small gather tells them first.
    """
    gathered: list[list[tuple] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, entries)
    first = gathered[0]
    for rank, other in enumerate(gathered):
        if other == first:
            continue
        at = next((i for i, (a, b) in enumerate(zip(first, other)) if a != b), min(len(first), len(other)))
        raise ValueError(
            f"{what} differs between ranks: rank 0 has {len(first)} entries, rank {rank} {len(other)}; the first "
            f"difference is entry {at}, {first[at] if at < len(first) else 'nothing'} on rank 0 against "
            f"{other[at] if at < len(other) else 'nothing'} on rank {rank}")


def launch_store() -> dist.Store:
    """The key-value store of the launch this rank runs in, with keys of its own launch only.

    For agreement that must not depend on the process group: after a rank has failed and left the
    group, a collective on its peers fails or waits, while the store still answers them all.
    """
    if _store is None:
        raise RuntimeError("launch_store() is only available inside a function run by "
                           "cs336_systems.distributed.launch")
    return _store


def report_progress() -> None:
    """Tell the launcher that this rank is alive and moving on (after a step or a check): a spawned
    launch's deadline starts again from here."""
    launch_store().add(_PROGRESS_KEY, 1)


def launch(fn: Callable[..., Any], world_size: int, *args: Any, device: str = "auto",
           timeout_s: float = DEFAULT_TIMEOUT_S, **kwargs: Any) -> list[Any]:
    """Run `fn(rank, world_size, *args, **kwargs)` on `world_size` ranks; return the results by rank.
    Spawned ranks that show no progress (see module docstring) for `timeout_s` raise TimeoutError."""
    device_type = resolve_device_type(device)
    if under_torchrun():
        return _run_in_place(fn, world_size, args, kwargs, device_type, timeout_s)
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world size must be a positive integer, got {world_size!r}")
    if device_type == "cuda" and world_size > torch.cuda.device_count():
        raise ValueError(
            f"world size {world_size} needs {world_size} GPUs (one per rank), "
            f"but {torch.cuda.device_count()} are present"
        )
    try:
        pickle.dumps((fn, args, kwargs))
    except Exception as error:
        raise TypeError(
            "the function and arguments must be picklable to reach spawned ranks "
            f"(a module-level function, not a lambda or closure): {error}"
        ) from error
    return _spawn(fn, world_size, args, kwargs, device_type, timeout_s)


def _init_rank(rank: int, world_size: int, device_type: str, timeout_s: float, store: dist.Store,
               threads: int) -> None:
    """Join the process group, then wait for every rank to have joined; sets launch_store()."""
    global _store
    device_id = None
    if device_type == "cuda":
        device_id = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device_id)
    else:
        # Ranks share their launcher's cores (`threads` each); left alone each starts a thread per core.
        torch.set_num_threads(threads)
    dist.init_process_group(
        backend_for(device_type),
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=dt.timedelta(seconds=timeout_s),
        # Binding the group to this rank's GPU creates the NCCL communicator now, and lets
        # barrier() and object collectives know which device to use.
        device_id=device_id,
    )
    _store = _wait_until_every_rank_connected(store, world_size, timeout_s)


def _wait_until_every_rank_connected(store: dist.Store, world_size: int, timeout_s: float) -> dist.Store:
    """Return once every rank has come out of init_process_group; returns this launch's own store.

    Gloo connects each pair of ranks inside init_process_group, and a rank comes out of it once its
    own side is connected. A rank that then ran a function without collectives and left would close
    its sockets while a slower peer was still connecting to it, failing that peer's init ("Gloo
    connectFullMesh failed ... Connection closed by peer"). The ranks meet at the store, not in a
    barrier of the group being set up, and wait no longer than the launch's deadline.
    """
    arrival = store.add(_ARRIVALS_KEY, 1)
    # Launches in sequence on one store (several under one torchrun) count on: each is a new
    # generation of world_size arrivals, with keys under its own prefix.
    own = _own_store(store, generation=(arrival - 1) // world_size)
    if arrival % world_size == 0:
        own.set(_CONNECTED_KEY, "1")
    own.wait([_CONNECTED_KEY], dt.timedelta(seconds=timeout_s))
    return own


def _own_store(store: dist.Store, generation: int) -> dist.Store:
    return dist.PrefixStore(f"launch/{generation}", store)


def _run_in_place(fn, world_size, args, kwargs, device_type, timeout_s) -> list[Any]:
    env_world_size = int(os.environ["WORLD_SIZE"])
    if world_size not in (None, env_world_size):
        raise ValueError(f"asked for world size {world_size}, but torchrun started {env_world_size}")
    rank = int(os.environ["RANK"])
    # torchrun's store (its agent's, or one that rank 0 hosts), as init_process_group("env://") finds it.
    store, _, _ = next(dist.rendezvous("env://", rank, env_world_size, timeout=dt.timedelta(seconds=timeout_s)))
    try:
        _init_rank(rank, env_world_size, device_type, timeout_s, store, max(1, (os.cpu_count() or 1) // env_world_size))
        result = fn(rank, env_world_size, *args, **kwargs)
        gathered: list[Any] = [None] * env_world_size
        dist.all_gather_object(gathered, result)
        return gathered
    finally:
        _leave()


def _leave() -> None:
    global _store
    _store = None
    if dist.is_initialized():
        dist.destroy_process_group()


def _worker(rank, world_size, port, fn, args, kwargs, device_type, timeout_s, threads, results) -> None:
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size=None, is_master=False,
                              timeout=dt.timedelta(seconds=timeout_s))
        _init_rank(rank, world_size, device_type, timeout_s + EXIT_GRACE_S, store, threads)
        payload = pickle.dumps(fn(rank, world_size, *args, **kwargs))
        results.put((rank, "ok", payload))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        _leave()


def _spawn(fn, world_size, args, kwargs, device_type, timeout_s) -> list[Any]:
    context = mp.get_context("spawn")
    results = context.Queue()
    # Port 0: the OS picks a free port and the store keeps it bound, so nothing can take it.
    store = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True,
                          timeout=dt.timedelta(seconds=timeout_s), wait_for_workers=False)
    # The ranks share the threads this process was given (OMP_NUM_THREADS, or a core each): a launch from
    # one of several test workers must not start a thread per core in every rank.
    ranks_threads = max(1, torch.get_num_threads() // world_size)
    processes = [
        context.Process(target=_worker, daemon=True,
                        args=(rank, world_size, store.port, fn, args, kwargs, device_type, timeout_s,
                              ranks_threads, results))
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    outputs: dict[int, Any] = {}
    # This store serves one launch: its ranks are the first generation to arrive.
    own = _own_store(store, generation=0)
    progress, deadline = 0, time.monotonic() + timeout_s
    try:
        while len(outputs) < world_size:
            try:
                rank, status, payload = results.get(timeout=_POLL_S)
            except queue_module.Empty:
                for rank, process in enumerate(processes):
                    if rank not in outputs and process.exitcode not in (None, 0):
                        raise RankFailed(f"rank {rank} of {world_size} died with exit code {process.exitcode}")
                if (latest := store.add(_ARRIVALS_KEY, 0) + own.add(_PROGRESS_KEY, 0)) != progress:
                    progress, deadline = latest, time.monotonic() + timeout_s
                elif time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(outputs))
                    raise TimeoutError(
                        f"ranks {missing} of {world_size} did not finish within {timeout_s:.0f} s "
                        "of the last sign of progress (a collective that some rank never joined?)"
                    )
                continue
            if status == "error":
                raise RankFailed(f"rank {rank} of {world_size} failed:\n{payload}")
            outputs[rank] = pickle.loads(payload)
        for process in processes:
            process.join(EXIT_GRACE_S)
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join()
        results.close()
        del store
    return [outputs[rank] for rank in range(world_size)]
