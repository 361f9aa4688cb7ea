"""run_checks: once a check fails on one rank out of step, every rank stops, and that check alone is
reported failed; the checks after it are reported as not run, and no rank is left waiting. A check that
fails in step (CheckFailed, after its last collective) is reported failed, and the next ones run. Under
a CollectiveGuard, ranks about to issue different collectives fail in step, naming both, instead of
aborting inside gloo."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cs336_systems.distributed.launch import launch
from cs336_systems.conformance.rank_checks import (
    CheckFailed,
    CheckOutcome,
    CollectiveMismatch,
    assert_passed_on_every_rank,
    run_checks,
)

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
    assert str(failure.value) == (f"rank {last} (failure 1 of 1):\ncs336_systems.conformance.rank_checks.CheckFailed: "
                                  "the last rank's parameters differ\n")
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


def _ranks_all_reduce_different_sizes(rank: int, world_size: int) -> None:
    dist.all_reduce(torch.ones(2))
    dist.all_reduce(torch.ones(3 + rank))  # gloo would abort the process on this one


def _last_rank_all_reduces_once_more(rank: int, world_size: int) -> None:
    dist.all_reduce(torch.ones(2))
    if rank == world_size - 1:
        dist.all_reduce(torch.ones(2))


GUARDED = {
    "different_sizes": _ranks_all_reduce_different_sizes,
    "one_more": _last_rank_all_reduces_once_more,
    "after_them": _all_reduce_sums_the_ranks,
}


@pytest.fixture(scope="module")
def guarded_outcomes() -> list[dict[str, CheckOutcome]]:
    return launch(run_checks, 2, GUARDED, guard_collectives=True, device="cpu", timeout_s=LAUNCH_TIMEOUT_S)


def test_ranks_about_to_issue_different_collectives_fail_naming_both(guarded_outcomes):
    with pytest.raises(pytest.fail.Exception) as failure:
        assert_passed_on_every_rank("different_sizes", guarded_outcomes)
    message = str(failure.value)
    assert CollectiveMismatch.__name__ in message
    assert ("the ranks issued different collectives: collective 2 of the check is an all_reduce of 3 float32 "
            "elements on rank 0, an all_reduce of 4 float32 elements on rank 1") in message


def test_a_rank_issuing_a_collective_its_peers_never_issue_fails_naming_it(guarded_outcomes):
    with pytest.raises(pytest.fail.Exception, match="rank 1's collective 2 of the check is an all_reduce of 2 float32 "
                                                    "elements, and rank 0 finished the check without issuing it"):
        assert_passed_on_every_rank("one_more", guarded_outcomes)


def test_after_a_mismatch_the_ranks_are_in_step(guarded_outcomes):
    assert_passed_on_every_rank("after_them", guarded_outcomes)
