"""The launcher: results by rank, failures and hangs surfaced fast, bad input refused, torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_for_futures
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from cs336_systems.distributed.launch import (
    RankFailed,
    _wait_until_every_rank_connected,
    launch,
    launch_store,
    rank_device,
    report_progress,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
# Long enough for ranks to import torch on a busy machine, short enough to fail fast.
FAIL_FAST_TIMEOUT_S = 120
FAIL_FAST_WITHIN_S = 60
HANG_TIMEOUT_S = 15
# The deadline counts from the ranks' connecting (after they import torch); after it the parent kills
# the ranks; starting and tearing down take seconds each on a busy machine.
HANG_REPORTED_WITHIN_S = HANG_TIMEOUT_S + 60
SLEEP_PAST_DEADLINE_S = 10 * HANG_TIMEOUT_S
# Steps each well inside the deadline that together outlast it.
STEP_S = 0.6 * HANG_TIMEOUT_S
STEPS = 2
TORCHRUN_TIMEOUT_S = 180
# Long enough for a thread that was free to go to have gone; a correct wait is still waiting.
STILL_WAITING_AFTER_S = 1.0


def _describe(rank: int, world_size: int, tag: str) -> tuple:
    # dist.all_reduce proves the group is live; its sum is known: 0 + 1 + ... + (world_size - 1)
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    return rank, world_size, tag, dist.get_rank(), dist.get_world_size(), total.item(), rank_device().type


def test_results_come_back_by_rank():
    results = launch(_describe, 3, "x", device="cpu", timeout_s=FAIL_FAST_TIMEOUT_S)
    assert results == [(rank, 3, "x", rank, 3, 3.0, "cpu") for rank in range(3)]


def test_no_rank_goes_on_before_every_rank_has_connected_also_on_a_store_used_again():
    """The meeting after init_process_group, as threads on one store: a second launch on the same
    store (several launches under one torchrun) waits for its own ranks and has keys of its own."""
    store, world_size = dist.HashStore(), 3
    with ThreadPoolExecutor(world_size) as pool:
        for launch_number in range(2):
            early = [pool.submit(_wait_until_every_rank_connected, store, world_size, FAIL_FAST_TIMEOUT_S)
                     for _ in range(world_size - 1)]
            _, waiting = wait_for_futures(early, timeout=STILL_WAITING_AFTER_S)
            assert len(waiting) == world_size - 1, f"launch {launch_number}: a rank went on before the last arrived"
            last = pool.submit(_wait_until_every_rank_connected, store, world_size, FAIL_FAST_TIMEOUT_S)
            own_stores = [future.result(timeout=FAIL_FAST_TIMEOUT_S) for future in (*early, last)]
            assert not own_stores[0].check(["written by the first launch"])
            own_stores[0].set("written by the first launch", "1")


def _exchange_through_the_store(rank: int, world_size: int) -> list[str]:
    store = launch_store()
    store.set(f"from rank {rank}", f"hello from {rank}")
    return [store.get(f"from rank {other}").decode() for other in range(world_size)]


def test_ranks_share_their_launch_s_store_and_only_ranks_have_one():
    assert launch(_exchange_through_the_store, 2, device="cpu", timeout_s=FAIL_FAST_TIMEOUT_S) == [
        ["hello from 0", "hello from 1"]] * 2
    with pytest.raises(RuntimeError, match="only available inside a function run by"):
        launch_store()


def _rank_one_raises(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank one is broken")
    dist.barrier()  # rank 0 would wait here for ever


def test_a_rank_that_raises_fails_the_job_at_once_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(RankFailed) as failure:
        launch(_rank_one_raises, 2, device="cpu", timeout_s=FAIL_FAST_TIMEOUT_S)
    message = str(failure.value)
    assert "rank 1 of 2" in message
    assert "ValueError: rank one is broken" in message
    assert "in _rank_one_raises" in message  # the traceback, not just the exception
    assert time.monotonic() - start < FAIL_FAST_WITHIN_S


def _rank_one_waits_for_rank_zero(rank: int, world_size: int) -> None:
    if rank == 0:
        time.sleep(SLEEP_PAST_DEADLINE_S)  # stuck outside the collective, but alive
    dist.barrier()


def test_a_rank_that_hangs_in_a_collective_times_out():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] of 2 did not finish within 15 s of the last sign"):
        launch(_rank_one_waits_for_rank_zero, 2, device="cpu", timeout_s=HANG_TIMEOUT_S)
    assert HANG_TIMEOUT_S <= time.monotonic() - start < HANG_REPORTED_WITHIN_S


def _steps_that_report_progress(rank: int, world_size: int) -> int:
    for _ in range(STEPS):
        time.sleep(STEP_S)
        report_progress()
    dist.barrier()
    return rank


def test_a_job_that_outlasts_its_deadline_while_reporting_progress_finishes():
    start = time.monotonic()
    assert launch(_steps_that_report_progress, 2, device="cpu", timeout_s=HANG_TIMEOUT_S) == [0, 1]
    assert time.monotonic() - start > HANG_TIMEOUT_S


def test_progress_is_reported_only_inside_a_launch():
    with pytest.raises(RuntimeError, match="only available inside a function run by"):
        report_progress()


def test_more_ranks_than_gpus_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="world size 2 needs 2 GPUs"):
        launch(_describe, 2, "x", device="cuda")


def test_a_function_that_cannot_be_pickled_is_refused():
    with pytest.raises(TypeError, match="picklable"):
        launch(lambda rank, world_size: rank, 2, device="cpu")


@pytest.mark.parametrize("world_size", [0, -1, 1.5])
def test_a_bad_world_size_is_refused(world_size):
    with pytest.raises(ValueError, match="world size"):
        launch(_describe, world_size, "x", device="cpu")


_TORCHRUN_JOB = """
    import json
    import os
    from pathlib import Path

    from cs336_systems.distributed.launch import launch
    from tests.test_launch import _describe

    if __name__ == "__main__":
        results = launch(_describe, 2, "torchrun", device="cpu")
        Path(f"results_{os.environ['RANK']}.json").write_text(json.dumps(results))
"""


def test_under_torchrun_every_rank_runs_in_place_and_gets_all_results(tmp_path):
    """torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; launch joins with env://.

    --standalone lets torchrun pick a free port, so this runs beside other test workers.
    """
    job = tmp_path / "job.py"
    job.write_text(textwrap.dedent(_TORCHRUN_JOB))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    finished = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(job)],
        capture_output=True, text=True, env=env, timeout=TORCHRUN_TIMEOUT_S, cwd=tmp_path)
    assert finished.returncode == 0, finished.stderr[-3000:]
    expected = [[rank, 2, "torchrun", rank, 2, 1.0, "cpu"] for rank in range(2)]
    for rank in range(2):
        assert json.loads((tmp_path / f"results_{rank}.json").read_text()) == expected
