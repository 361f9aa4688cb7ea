"""The distributed half of the conformance suite run on broken adapters modules (tests/broken_adapters, one bug
each), which it must fail with a message naming the bug, and on correct ones (examples/from_scratch, written
without this project's classes, and this project's own), which it must pass.

Each run is the suite as a user runs it (`pytest --pyargs cs336_systems.conformance.test_ddp --adapters FILE`),
here inside pytester, at 2 gloo ranks for a broken module (one launch of ranks, its checks all in it).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cs336_systems.conformance import test_ddp, test_fsdp, test_sharded_optimizer
from cs336_systems.conformance.contract import OWN_ADAPTERS, load_adapters
from cs336_systems.conformance.test_ddp import BYTES_PER_MB, PLANNED_BUCKET_SIZES_MB, bucket_plan
from tests.inner_runs import runpytest

REPO_ROOT = Path(__file__).resolve().parents[1]
BROKEN = REPO_ROOT / "tests" / "broken_adapters"
FROM_SCRATCH = REPO_ROOT / "examples" / "from_scratch" / "adapters.py"
PLUGIN = ["-p", "cs336_systems.pytest_plugin", "-p", "no:cacheprovider", "--gpu", "none"]
SUITE_MODULES = {module.__name__.rsplit(".", 1)[1]: module for module in (test_ddp, test_sharded_optimizer, test_fsdp)}
SUITE_CHECKS = {suite: module.CHECKS for suite, module in SUITE_MODULES.items()}
SUITE_WORLD_SIZES = {suite: module.WORLD_SIZES for suite, module in SUITE_MODULES.items()}

# Each broken module, the suite that must catch it, and words its failure must contain.
KILLS = {
    "ddp_after_backward": ("test_ddp", "no all-reduce was issued before backward returned"),
    "ddp_summed": ("test_ddp", "gradients were summed, not averaged: rank 1's fc1.weight grad is 2.00x the "
                               "single-process one"),
    "ddp_no_broadcast": ("test_ddp", "rank 1's fc1.weight is still its own initial value, not rank 0's: the wrapper "
                                     "did not broadcast rank 0's parameters"),
    "ddp_bucket_size_ignored": ("test_ddp", "1 all-reduce per step, the plan for bucket_size_mb=0.005 has 3 buckets "
                                            "(the last partial)"),
    "ddp_partial_bucket_dropped": ("test_ddp", "2 all-reduces per step, the plan for bucket_size_mb=0.005 has 3 "
                                               "buckets (the last partial)"),
    "ddp_tied_reduced_twice": ("test_ddp", "a gradient was reduced more than once (the tied weight, fc2.weight and "
                                           "fc4.weight, counts once)"),
    "ddp_no_gradient_breaks": ("test_ddp", "where branch.* gets a gradient on ranks [0, 1] and never_used.* on none, "
                                           "rank 0 raised AttributeError: 'NoneType' object has no attribute "
                                           "'reshape'"),
    "sharded_state_everywhere": ("test_sharded_optimizer", "rank 0 holds 100% of the optimizer state"),
    "sharded_no_sync": ("test_sharded_optimizer", "the sharded optimizer did not synchronise parameters after step"),
    "fsdp_full_weights_at_rest": ("test_fsdp", "the full weights are kept alive at rest"),
    "fsdp_saved_for_backward": ("test_fsdp", "gathered weights are kept after use (saved for backward, or never "
                                             "freed)"),
    "fsdp_summed": ("test_fsdp", "gradients were summed, not averaged: rank 0's linear1.weight gradient (read back "
                                 "from one SGD step) is 2.00x the single-process one"),
}


def _run_suite(pytester: pytest.Pytester, suite: str, adapters: Path | str, *selection: str) -> pytest.RunResult:
    return runpytest(pytester, *PLUGIN, "--pyargs", f"cs336_systems.conformance.{suite}", "--adapters", str(adapters),
                     *selection)


# The broken modules of the distributed parts, by their names; the rest are FlashAttention's
# (tests/test_conformance_flash_kills.py).
DISTRIBUTED_PREFIXES = ("ddp_", "sharded_", "fsdp_")
FLASH_PREFIX = "flash_"


def test_every_broken_distributed_module_is_tried_and_every_module_is_of_a_family_a_self_test_tries():
    modules = sorted(path.stem for path in BROKEN.glob("*.py") if path.stem != "__init__")
    assert sorted(KILLS) == [module for module in modules if module.startswith(DISTRIBUTED_PREFIXES)]
    assert all(module.startswith((*DISTRIBUTED_PREFIXES, FLASH_PREFIX)) for module in modules), modules


@pytest.mark.parametrize("module", KILLS)
def test_the_suite_fails_a_broken_module_naming_its_bug(pytester, module):
    suite, message = KILLS[module]
    result = _run_suite(pytester, suite, BROKEN / f"{module}.py", "-k", "gloo-2ranks")
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()
    assert message in result.stdout.str(), result.stdout.str()


# How a verbose run names each subtest's outcome: "...::test_ddp[gloo-2ranks] SUBPASSED[check name]  [ 50%]".
SUBTEST_OUTCOME = re.compile(r"::\w+\[(?P<placement>[\w-]+)\] SUB(?P<outcome>PASSED|FAILED|SKIPPED)\[(?P<check>.+?)\]")


def _subtests(result: pytest.RunResult) -> dict[str, set[tuple[str, str]]]:
    """(placement, check) of each subtest by outcome (PASSED, FAILED, SKIPPED), from a run with -v."""
    outcomes: dict[str, set[tuple[str, str]]] = {"PASSED": set(), "FAILED": set(), "SKIPPED": set()}
    for match in map(SUBTEST_OUTCOME.search, result.stdout.lines):
        if match:
            outcomes[match["outcome"]].add((match["placement"], match["check"]))
    return outcomes


@pytest.fixture(scope="session")  # not by module, which would keep its tests in one run of a split (gpu_check)
def from_scratch():
    """The from-scratch adapters, imported here first: its flash module imports triton, whose compiled module
    cannot be imported a second time in one process, as each in-process run would after the one before
    unloaded it."""
    return load_adapters(str(FROM_SCRATCH))


@pytest.mark.parametrize("suite", SUITE_MODULES)
def test_a_from_scratch_implementation_passes(pytester, from_scratch, suite):
    result = _run_suite(pytester, suite, Path(from_scratch.spec), "-v")
    placements = [f"gloo-{n}ranks" for n in SUITE_WORLD_SIZES[suite]]
    every_check = {(placement, check) for placement in placements for check in SUITE_CHECKS[suite]}
    assert _subtests(result) == {"PASSED": every_check, "FAILED": set(), "SKIPPED": set()}, result.stdout.str()


@pytest.mark.parametrize("suite", SUITE_MODULES)
def test_this_projects_adapters_pass(pytester, suite):
    """At 2 ranks: the test command runs the whole suite on them as well (it is the default)."""
    result = _run_suite(pytester, suite, OWN_ADAPTERS, "-v", "-k", "gloo-2ranks")
    assert _subtests(result) == {"PASSED": {("gloo-2ranks", check) for check in SUITE_CHECKS[suite]},
                                 "FAILED": set(), "SKIPPED": set()}, result.stdout.str()


@pytest.mark.parametrize("bucket_size_mb", PLANNED_BUCKET_SIZES_MB)
def test_the_bucket_plans_checked_are_the_same_whatever_a_megabyte_is(bucket_size_mb):
    """The handout does not say whether bucket_size_mb counts 10^6 bytes or 2^20: the suite's plans must not
    depend on it (5 layers of 16 features, float64: weights of 2,048 bytes, biases of 128)."""
    sizes = [2048, 128] * 5
    plans = [bucket_plan(sizes, bucket_size_mb * mb) for mb in BYTES_PER_MB]
    assert plans[0] == plans[1]
