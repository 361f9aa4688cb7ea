"""run_checks: once a check fails on one rank out of step, every rank stops, and that check alone is
reported failed; the checks after it are reported as not run, and no rank is left waiting. A check that
fails in step (CheckFailed, after its last collective) is reported failed, and the next ones run."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cs336_systems.distributed.launch import launch
from cs336_systems.conformance.rank_checks import CheckFailed, CheckOutcome, assert_passed_on_every_rank, run_checks

# Long enough for ranks to import torch on a busy machine; a rank left waiting in a collective
# would end the launch here with a TimeoutError instead of returning outcomes.
LAUNCH_TIMEOUT_S = 120


def _rank_one_raises_before_a_collective(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank one is broken")
    dist.barrier()  # the other ranks wait here for rank 1


def _all_reduce_sums_the_ranks(rank: int, world_size: int) -> None:
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    assert total.item() == sum(range(world_size))


def _last_rank_finds_a_difference_after_the_collective(rank: int, world_size: int) -> None:
    _all_reduce_sums_the_ranks(rank, world_size)
    if rank == world_size - 1:
        raise CheckFailed("the last rank's parameters differ")


IN_STEP_FIRST = {
    "in_step": _last_rank_finds_a_difference_after_the_collective,
    "after_it": _all_reduce_sums_the_ranks,
}
CHECKS = {
    "first": _rank_one_raises_before_a_collective,
    "second": _all_reduce_sums_the_ranks,
    "third": _all_reduce_sums_the_ranks,
}


@pytest.fixture(scope="module", params=(2, 3), ids=lambda n: f"{n}ranks")
def outcomes(request) -> list[dict[str, CheckOutcome]]:
    # One launch for both lists: the in-step failure, then the ones that stop every rank.
    return launch(run_checks, request.param, {**IN_STEP_FIRST, **CHECKS}, device="cpu", timeout_s=LAUNCH_TIMEOUT_S)


def test_a_check_failed_in_step_is_reported_by_its_message_and_the_next_checks_run(outcomes):
    last = len(outcomes) - 1
    with pytest.raises(pytest.fail.Exception) as failure:
        assert_passed_on_every_rank("in_step", outcomes)
    assert str(failure.value) == (f"rank {last} (failure 1 of 1):\n"
                                  "cs336_systems.conformance.rank_checks.CheckFailed: the last rank's parameters differ\n")
    assert_passed_on_every_rank("after_it", outcomes)


def test_the_check_that_failed_is_reported_with_the_failing_rank_s_traceback_first(outcomes):
    with pytest.raises(pytest.fail.Exception) as failure:
        assert_passed_on_every_rank("first", outcomes)
    message = str(failure.value)
    assert message.startswith(f"rank 1 (failure 1 of {len(outcomes)}):\nTraceback")
    first_failure = message.split("\nrank ")[0]
    assert "in _rank_one_raises_before_a_collective" in first_failure
    assert "ValueError: rank one is broken" in first_failure
    # The others failed in the barrier, once rank 1 had left the group.
    assert [outcome["first"].failure_number for outcome in outcomes][1] == 1
    assert all(outcome["first"].traceback and "barrier" in outcome["first"].traceback
               for rank, outcome in enumerate(outcomes) if rank != 1)


@pytest.mark.parametrize("check", ["second", "third"])
def test_the_checks_after_it_are_not_run_on_any_rank(check, outcomes):
    assert all(by_check[check] == CheckOutcome(not_run_because="first") for by_check in outcomes)
    with pytest.raises(pytest.skip.Exception, match="not run: check 'first' failed before it"):
        assert_passed_on_every_rank(check, outcomes)


def test_a_check_that_passed_on_every_rank_passes():
    assert_passed_on_every_rank("first", [{"first": CheckOutcome()}, {"first": CheckOutcome()}])


def test_a_check_that_failed_on_one_rank_fails_though_the_others_passed():
    failed = CheckOutcome(traceback="Traceback ...\nAssertionError: differs", failure_number=1)
    with pytest.raises(pytest.fail.Exception, match=r"^rank 1 \(failure 1 of 1\):\nTraceback ...\nAssertionError"):
        assert_passed_on_every_rank("first", [{"first": CheckOutcome()}, {"first": failed}])
