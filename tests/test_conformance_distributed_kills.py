"""The distributed half of the conformance suite run on broken adapters modules (tests/broken_adapters, one bug
each), which it must fail with a message naming the bug, and on correct ones (examples/from_scratch, written
without this project's classes, and this project's own), which it must pass.

Each run is the suite as a user runs it (`pytest --pyargs cs336_systems.conformance.test_ddp --adapters FILE`),
here inside pytester, at 2 gloo ranks for a broken module (one launch of ranks, its checks all in it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
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

@dataclass(frozen=True)
class Kill:
    """A broken module, the suite that must catch it, the checks (at 2 ranks) that must fail with words each
    failure must contain, the checks the same bug also fails, legitimately (a summed gradient also trains
    differently), and those not run because a check before them failed out of step. Every other check the
    module has the adapter functions for must pass."""

    suite: str
    fails: dict[str, str]
    also_fails: tuple[str, ...] = ()
    not_run: tuple[str, ...] = ()


def _ddp(variant: str, *checks: str) -> tuple[str, ...]:
    return tuple(f"{variant}: {check}" for check in checks)


MATCHES_SINGLE_PROCESS = ("matches single-process training (toy_model)",
                          "matches single-process training (tied_weights)")
WITHOUT_GRADIENTS = ("parameters without gradients break nothing", "a branch some ranks skip breaks nothing")
SHARDED_STATE = "each rank keeps about 1/world_size of the optimizer state"
KILLS = {
    "ddp_after_backward": Kill("test_ddp", {
        check: "no all-reduce was issued before backward returned"
        for check in _ddp("individual_parameters", "communication overlaps backward")
        + _ddp("get_ddp", "communication overlaps backward")}),
    "ddp_summed": Kill(
        "test_ddp", {"individual_parameters: gradients are averaged (toy_model)":
                     "gradients were summed, not averaged: rank 1's fc1.weight grad is 2.00x the single-process one"},
        _ddp("individual_parameters", "gradients are averaged (tied_weights)", *WITHOUT_GRADIENTS,
             *MATCHES_SINGLE_PROCESS)),
    "ddp_no_broadcast": Kill(
        "test_ddp", {"get_ddp: starts from rank 0's parameters":
                     "rank 1's fc1.weight is still its own initial value, not rank 0's: the wrapper did not broadcast "
                     "rank 0's parameters"},
        _ddp("get_ddp", *MATCHES_SINGLE_PROCESS)),
    "ddp_bucket_size_ignored": Kill(
        "test_ddp", {"bucketed: reductions follow the bucket plan":
                     "1 all-reduce per step, the plan for bucket_size_mb=0.005 has 3 buckets (the last partial)"},
        # One bucket for the whole model is issued once backward is over.
        _ddp("bucketed", "communication overlaps backward")),
    "ddp_partial_bucket_dropped": Kill(
        "test_ddp", {"bucketed: reductions follow the bucket plan":
                     "2 all-reduces per step, the plan for bucket_size_mb=0.005 has 3 buckets (the last partial)",
                     "bucketed: each gradient is reduced once a step": "some gradients were never reduced"},
        _ddp("bucketed", "gradients are averaged (toy_model)", "gradients are averaged (tied_weights)",
             *WITHOUT_GRADIENTS, *MATCHES_SINGLE_PROCESS)),
    "ddp_tied_reduced_twice": Kill("test_ddp", {
        "bucketed: each gradient is reduced once a step":
            "a gradient was reduced more than once (the tied weight, fc2.weight and fc4.weight, counts once)"}),
    "ddp_no_gradient_breaks": Kill(
        "test_ddp", {"bucketed: parameters without gradients break nothing":
                     "where branch.* gets a gradient on ranks [0, 1] and never_used.* on none, rank 0 raised "
                     "AttributeError: 'NoneType' object has no attribute 'reshape'"},
        not_run=_ddp("bucketed", WITHOUT_GRADIENTS[1], *MATCHES_SINGLE_PROCESS)),
    "ddp_tied_weight_stepped_twice": Kill("test_ddp", {
        "individual_parameters: matches single-process training (tied_weights)":
            "ddp_model.parameters() lists fc2.weight and fc4.weight (one tensor) 2 times: an optimizer built on it "
            "updates that parameter 2 times a step"}),
    "sharded_state_everywhere": Kill("test_sharded_optimizer", {SHARDED_STATE: "rank 0 holds 100% of the optimizer "
                                                                                "state"}),
    "sharded_last_rank_owns_nothing": Kill("test_sharded_optimizer", {
        SHARDED_STATE: "rank 1 holds 0% of the optimizer state (0 bytes; an unsharded AdamW keeps 15,024), expected "
                       "about 50%: at least 35%"}),
    "sharded_no_sync": Kill(
        "test_sharded_optimizer", {"parameters are equal on every rank after each step":
                                   "the sharded optimizer did not synchronise parameters after step"},
        ("matches the unsharded AdamW (two groups, tied weights)", "matches the unsharded SGD with momentum",
         "add_param_group during training")),
    "sharded_added_group_ignored": Kill("test_sharded_optimizer", {
        "add_param_group during training": "step 2 left rank 1's extra.weight where it was, the unsharded AdamW moved "
                                           "it by up to"}),
    "fsdp_full_weights_at_rest": Kill("test_fsdp", {"weights are sharded at rest":
                                                    "the full weights are kept alive at rest"}),
    "fsdp_saved_for_backward": Kill("test_fsdp", {"forward gathers a few weights at a time":
                                                  "gathered weights are kept after use (saved for backward, or never "
                                                  "freed)"}),
    "fsdp_summed": Kill("test_fsdp", {"gradients are averaged":
                                      "gradients were summed, not averaged: rank 0's linear1.weight gradient (read "
                                      "back from one SGD step) is 2.00x the single-process one"},
                        ("matches single-process training (fp32)",
                         "matches single-process training (compute_dtype=bf16)")),
    "fsdp_stale_prefetch": Kill("test_fsdp", {
        "matches single-process training (fp32)": "something carried from one step into the next is stale"}),
    "fsdp_bf16_master_weights": Kill("test_fsdp", {
        "matches single-process training (compute_dtype=bf16)":
            "rank 0's parameter module.embedding.weight (what the optimizer updates) is torch.bfloat16: master "
            "weights must stay float32"}),
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


def test_every_check_a_kill_names_is_one_of_its_suite_s():
    for module, kill in KILLS.items():
        named = [*kill.fails, *kill.also_fails, *kill.not_run]
        assert set(named) <= set(SUITE_CHECKS[kill.suite]), (module, set(named) - set(SUITE_CHECKS[kill.suite]))
        assert len(named) == len(set(named)), f"{module} names a check twice"


@pytest.mark.parametrize("module", KILLS)
def test_the_suite_fails_a_broken_module_naming_its_bug_in_the_check_that_catches_it(pytester, from_scratch,
                                                                                   module):
    kill = KILLS[module]
    adapters = load_adapters(str(BROKEN / f"{module}.py"))
    result = _run_suite(pytester, kill.suite, adapters.spec, "-v", "-k", "gloo-2ranks")
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()
    reached = {check for check, run in SUITE_MODULES[kill.suite].CHECKS.items() if not adapters.missing(*run.needs)}
    fails = {*kill.fails, *kill.also_fails}
    expected = {"PASSED": reached - fails - set(kill.not_run), "FAILED": fails,
                "SKIPPED": set(SUITE_CHECKS[kill.suite]) - reached | set(kill.not_run)}
    outcomes = {outcome: {check for _, check in found} for outcome, found in _subtests(result).items()}
    assert outcomes == expected, result.stdout.str()
    failures = _failure_texts(result)
    for check, message in kill.fails.items():
        assert message in failures[check], f"{module}: check {check!r} failed without saying {message!r}:\n" \
                                            f"{failures[check]}"


# How a verbose run names each subtest's outcome: "...::test_ddp[gloo-2ranks] SUBPASSED[check name]  [ 50%]".
SUBTEST_OUTCOME = re.compile(r"::\w+\[(?P<placement>[\w-]+)\] SUB(?P<outcome>PASSED|FAILED|SKIPPED)\[(?P<check>.+?)\]")
# The heading of a subtest's failure in the run's report: "_____ test_ddp[gloo-2ranks] [check name] _____"; its text
# runs to the next heading of any kind.
FAILURE_HEADING = re.compile(r"^_+ \w+\[[\w-]+\] \[(?P<check>.+)\] _+$")
ANY_HEADING = re.compile(r"^(_{3,}|={3,}) ")


def _subtests(result: pytest.RunResult) -> dict[str, set[tuple[str, str]]]:
    """(placement, check) of each subtest by outcome (PASSED, FAILED, SKIPPED), from a run with -v."""
    outcomes: dict[str, set[tuple[str, str]]] = {"PASSED": set(), "FAILED": set(), "SKIPPED": set()}
    for match in map(SUBTEST_OUTCOME.search, result.stdout.lines):
        if match:
            outcomes[match["outcome"]].add((match["placement"], match["check"]))
    return outcomes


def _failure_texts(result: pytest.RunResult) -> dict[str, str]:
    """Each failed subtest's report, by check, from a run of one placement."""
    texts: dict[str, list[str]] = {}
    check = None
    for line in result.stdout.lines:
        if heading := FAILURE_HEADING.match(line):
            check = heading["check"]
            texts[check] = []
        elif ANY_HEADING.match(line):
            check = None
        elif check is not None:
            texts[check].append(line)
    return {check: "\n".join(lines) for check, lines in texts.items()}


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
