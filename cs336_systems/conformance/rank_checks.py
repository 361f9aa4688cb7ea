"""Many distributed checks in one launch of ranks, each reported as a test (or subtest) of its own.

    outcomes = launch(run_checks, 2, {"averaged": check_a, "overlaps": check_b}, device="cpu")
    assert_passed_on_every_rank("averaged", outcomes)        # in the test of check "averaged"

    run_on_ranks(subtests, adapters, CHECKS, placement, timeout_s)   # the conformance suite's: one test,
                                                                     # a subtest per check

Starting ranks costs seconds of imports, so a test module launches once and runs its checks in order on
every rank (`check(rank, world_size)`). A failing check must never leave its peers waiting in a collective
it will not join, and the checks after it should still run where that is safe. So a check says how it failed:

  - `CheckFailed`, raised once the check has issued its last collective (a check that compares collects its
    findings and raises them at its end): the ranks are still in step, and the next check runs;
  - any other exception (an implementation that raised half-way through a step, say) may leave peers inside
    a collective: the failing rank leaves the process group at once, which makes such a collective fail on
    its gloo peers (an NCCL peer waits for the group's timeout), and no later check runs, on any rank.

After every check the ranks agree at the launch's store, not in a collective, on how it went, and report
progress to the launch (whose deadline is then one check's, not the whole list's).
"""

from __future__ import annotations

import functools
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch.distributed as dist

from cs336_systems.distributed.launch import launch_store, report_progress


class CheckFailed(AssertionError):
    """A check's failure, raised after its last collective: the ranks are still in step with each other."""


@dataclass(frozen=True)
class CheckOutcome:
    """One check on one rank: passed (all None), failed here (this rank's traceback, and 1 if this rank was the
    first to fail it, 2 if the second, ...), or not run (the earlier check that failed out of step)."""

    traceback: str | None = None
    failure_number: int | None = None
    not_run_because: str | None = None


def run_checks(rank: int, world_size: int, checks: dict) -> dict[str, CheckOutcome]:
    """The checks in order on this rank, inside ranks started by launch; after one that failed out of step
    (anything but CheckFailed) on any rank, the rest are not run on any rank. The failures are numbered in
    the order the ranks met them: a peer whose collective failed because the first rank left comes after it."""
    store = launch_store()
    outcomes: dict[str, CheckOutcome] = {}
    stopped_by = None
    for name, check in checks.items():
        if stopped_by is not None:
            outcomes[name] = CheckOutcome(not_run_because=stopped_by)
            continue
        failures_key, out_of_step_key = f"run_checks/{name}/failures", f"run_checks/{name}/out_of_step"
        try:
            check(rank, world_size)
            outcomes[name] = CheckOutcome()
        except CheckFailed as failure:
            # Its message says what is wrong; the frames of the check that raised it add nothing.
            outcomes[name] = CheckOutcome(traceback="".join(traceback.format_exception_only(failure)),
                                          failure_number=store.add(failures_key, 1))
        except Exception:
            outcomes[name] = CheckOutcome(traceback=traceback.format_exc(), failure_number=store.add(failures_key, 1))
            store.add(out_of_step_key, 1)
            if dist.is_initialized():
                dist.destroy_process_group()
        store.set(f"run_checks/{name}/finished/{rank}", "")
        store.wait([f"run_checks/{name}/finished/{other}" for other in range(world_size)])
        report_progress()
        if store.add(out_of_step_key, 0):
            stopped_by = name
    return outcomes


def assert_passed_on_every_rank(check: str, outcomes: list[dict[str, CheckOutcome]]) -> None:
    """Fail with the tracebacks of the ranks where `check` failed, the first to fail first; skip it where it
    was not run because an earlier check failed."""
    import pytest

    by_rank = [by_check[check] for by_check in outcomes]
    failures = sorted((o.failure_number, rank, o.traceback) for rank, o in enumerate(by_rank) if o.traceback)
    if failures:
        pytest.fail("\n".join(f"rank {rank} (failure {number} of {len(failures)}):\n{text}"
                               for number, rank, text in failures), pytrace=False)
    not_run_because = sorted({o.not_run_because for o in by_rank if o.not_run_because})
    if not_run_because:
        pytest.skip(f"not run: check {' and '.join(map(repr, not_run_because))} failed before it")


# ------------------------------------------------------------------------------- the test's side

@dataclass(frozen=True)
class Check:
    """A check for ranks: `function(adapters_spec, rank, world_size, **arguments)`, which imports the
    implementation under test with load_adapters(adapters_spec) in the rank's own process; `needs` are the
    adapter functions it calls."""

    function: Callable
    needs: tuple[str, ...]
    arguments: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Placement:
    """Where a launch's ranks run: CPU processes over gloo, or one GPU each over NCCL."""

    device: str
    world_size: int

    @property
    def name(self) -> str:
        return f"{'nccl' if self.device == 'cuda' else 'gloo'}-{self.world_size}ranks"


def placements(on_gpu: bool, world_sizes: tuple[int, ...]) -> list:
    """pytest params of the placements a suite runs at: gloo at each world size, and on a GPU run NCCL too,
    skipped, naming the count, where there are fewer GPUs than ranks."""
    import pytest
    import torch

    params = [pytest.param(Placement("cpu", n), id=Placement("cpu", n).name) for n in world_sizes]
    if on_gpu:
        gpus = torch.cuda.device_count()
        params += [pytest.param(Placement("cuda", n), id=Placement("cuda", n).name,
                                marks=[pytest.mark.multigpu, pytest.mark.skipif(
                                    gpus < n, reason=f"NCCL with {n} ranks needs {n} GPUs, {gpus} present")])
                   for n in world_sizes]
    return params


def run_on_ranks(subtests, adapters, checks: dict[str, Check], placement: Placement, timeout_s: float) -> None:
    """Launch once the checks the implementation under test has the functions for, and report each as a
    subtest: its failure on any rank fails it, a check whose adapter functions are missing is skipped,
    naming them (and the test with it when no check can run)."""
    import pytest

    from cs336_systems.distributed.launch import launch

    runnable = {name: check for name, check in checks.items() if not adapters.missing(*check.needs)}
    if not runnable:
        needed = dict.fromkeys(name for check in checks.values() for name in check.needs)
        pytest.skip(adapters.why_missing(*needed))
    launched = {name: functools.partial(check.function, adapters.spec, **check.arguments)
                for name, check in runnable.items()}
    outcomes = launch(run_checks, placement.world_size, launched, device=placement.device, timeout_s=timeout_s)
    for name, check in checks.items():
        with subtests.test(name):
            if name not in runnable:
                pytest.skip(adapters.why_missing(*check.needs))
            assert_passed_on_every_rank(name, outcomes)
