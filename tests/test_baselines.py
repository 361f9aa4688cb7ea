"""The speed-up gate's policy (cs336_systems.baselines): a gate's floor is the higher of its test's
promise and its baseline less tolerance, its message names the bound that failed, and recording
baselines never lowers one unless a regression is accepted."""

from pathlib import Path

import pytest

from cs336_systems import baselines
from cs336_systems.baselines import Baseline

PATH = Path("perf/baselines/h100.json")


@pytest.mark.parametrize(("promise", "baseline", "floor"), [
    (1.0, Baseline(1.02), 1.0),  # 1.02 less 20% is 0.816: the promise binds
    (1.0, Baseline(19.4), 19.4 * 0.8),  # a lead far above the promise: the baseline binds
    (1.0, Baseline(2.0, tolerance=0.5), 1.0),
    (0.5, None, 0.5),
])
def test_the_floor_is_the_higher_of_the_promise_and_the_baseline_less_tolerance(promise, baseline, floor):
    result = baselines.check("g", 1.5, {"g": baseline} if baseline else {}, promise)
    assert result.floor == pytest.approx(floor)
    assert result.passed == (1.5 >= floor)


def test_a_ratio_below_the_promise_fails_even_within_tolerance_of_its_baseline():
    result = baselines.check("ddp", 0.99, {"ddp": Baseline(1.02)}, promise=1.0)
    assert (result.broke_promise, result.regressed, result.passed) == (True, False, False)
    assert result.message(PATH) == ("BROKEN PROMISE: ddp ratio 0.99 is below the promise 1 its test states; holds "
                                    "the baseline 1.02 less its 20% tolerance, 0.816; perf/baselines/h100.json")


def test_a_ratio_past_tolerance_below_its_baseline_fails_even_above_the_promise():
    result = baselines.check("flash", 12.0, {"flash": Baseline(19.4)}, promise=10.0)
    assert (result.broke_promise, result.regressed, result.passed) == (False, True, False)
    assert result.message(PATH).startswith("REGRESSION: flash ratio 12 is below the baseline 19.4 less its 20% "
                                           "tolerance, 15.5; holds the promise 10 its test states")


def test_a_ratio_below_both_bounds_names_both():
    message = baselines.check("g", 0.5, {"g": Baseline(1.0)}, promise=1.0).message(PATH)
    assert message.startswith("BROKEN PROMISE, REGRESSION: g ratio 0.5 is below the promise 1 its test states and "
                              "the baseline 1 less its 20% tolerance, 0.8;")
    assert "holds" not in message


def test_a_ratio_that_holds_both_bounds_passes_and_says_so():
    result = baselines.check("g", 1.1, {"g": Baseline(1.0)}, promise=1.0)
    assert result.passed
    assert result.message(PATH).startswith("ok: g ratio 1.1 holds the promise 1 its test states and the baseline 1")


def test_without_a_baseline_a_gate_passes_on_its_promise_and_says_where_to_record_one():
    result = baselines.check("new", 2.0, {}, promise=1.0)
    assert result.passed and not result.broke_promise
    assert not baselines.check("new", 0.9, {}, promise=1.0).passed
    assert result.message(PATH) == ("NO BASELINE: new ratio 2 holds the promise 1 its test states; "
                                    "perf/baselines/h100.json has no entry for it (--update-baselines records one)")


def test_within_is_the_least_ratio_of_a_time_at_most_that_share_longer():
    assert baselines.within(0.05) == pytest.approx(1 / 1.05)
    assert baselines.within(0) == 1.0
    # Ours at 1.05x torch's time is just within; a hair slower is not.
    assert baselines.speedup_ratio(100.0, 105.0) >= baselines.within(0.05) > baselines.speedup_ratio(100.0, 105.1)
    with pytest.raises(ValueError, match="at least 0"):
        baselines.within(-0.1)


@pytest.mark.parametrize("promise", [0.0, -1.0, float("nan")])
def test_a_promise_must_be_a_positive_ratio(promise):
    with pytest.raises(ValueError, match="a promise is a least ratio"):
        baselines.check("g", 1.0, {}, promise)


def test_lower_ratios_within_tolerance_never_wear_a_baseline_down():
    # Three runs each within 20% of the one before took a recorded 1.016 to 0.541 when every run was
    # recorded; kept at the higher ratio, the third is a regression.
    recorded = {"ddp": Baseline(1.016)}
    for measured in (0.85, 0.70):
        result = baselines.check("ddp", measured, recorded, promise=0.5)
        recorded["ddp"] = Baseline(baselines.ratio_to_record(result, accept_regression=False))
        assert recorded["ddp"].ratio == 1.016
    assert baselines.check("ddp", 0.70, recorded, promise=0.5).regressed


@pytest.mark.parametrize(("baseline", "measured", "accept_regression", "recorded"), [
    (None, 0.9, False, 0.9),  # the first record
    (Baseline(1.0), 1.1, False, 1.1),  # a higher ratio raises the baseline
    (Baseline(1.0), 0.9, False, 1.0),  # a lower one within tolerance leaves it
    (Baseline(1.0), 0.9, True, 0.9),  # unless it is accepted
    (Baseline(1.0), 0.5, True, 0.5),
])
def test_the_ratio_recorded_is_the_measured_one_only_where_it_lowers_nothing_unaccepted(
        baseline, measured, accept_regression, recorded):
    result = baselines.check("g", measured, {"g": baseline} if baseline else {}, promise=0.1)
    assert baselines.ratio_to_record(result, accept_regression) == recorded


def test_a_distributed_gate_keeps_a_baseline_per_world_size():
    two, four = baselines.at_world_size("fsdp_vs_torch_fsdp", 2), baselines.at_world_size("fsdp_vs_torch_fsdp", 4)
    assert (two, four) == ("fsdp_vs_torch_fsdp/world_size=2", "fsdp_vs_torch_fsdp/world_size=4")
    at_four = baselines.check(four, 1.0, {two: Baseline(2.0)}, promise=0.9)
    assert at_four.baseline is None and at_four.floor == 0.9  # 2 ranks' baseline is no floor at 4


def _gates(tmp_path, recorded: dict[str, float] | None, update=False, accept_regression=False, on_gpu=True):
    path = tmp_path / "h100.json"
    if recorded is not None:
        baselines.update_baselines(path, recorded, "test device")
    return baselines.SpeedupGates(path, on_gpu, update, accept_regression)


@pytest.mark.parametrize(("recorded", "update", "on_gpu", "verdict"), [
    ({"g": 1.0}, False, True, "fail"),  # a baseline to hold, and nothing to hold it with
    ({}, True, True, "fail"),  # nothing to record
    (None, False, True, "fail"),  # a GPU without a baseline file still has a promise to hold
    (None, False, False, "skip"),  # a CPU run without a baseline file gates nothing
])
def test_a_gate_whose_variant_did_not_run_cannot_pass(tmp_path, recorded, update, on_gpu, verdict):
    judged = _gates(tmp_path, recorded, update, on_gpu=on_gpu).judge("g", None, 2.0, promise=1.0, note="naive: OOM")
    assert judged.ratio is None and judged.record is None
    if verdict == "fail":
        assert judged.failure == "g: the slower variant has no time, so the gate cannot hold (naive: OOM)"
    else:
        assert judged.failure is None and judged.skip.startswith("speed-up gate not run: a CPU run")


def test_a_gate_passes_fails_or_is_skipped_by_its_floor_and_the_baseline_file(tmp_path):
    gates = _gates(tmp_path, {"g": 5.0})
    assert gates.judge("g", 10.0, 2.0, promise=1.0) == baselines.Verdict(5.0)
    assert gates.judge("g", 10.0, 4.0, promise=1.0).failure.startswith("REGRESSION: g ratio 2.5")
    assert gates.judge("new", 10.0, 2.0, promise=1.0) == baselines.Verdict(5.0, warning=(
        f"NO BASELINE: new ratio 5 holds the promise 1 its test states; {tmp_path / 'h100.json'} has no entry for it "
        "(--update-baselines records one)"))
    assert gates.judge("new", 1.0, 2.0, promise=1.0).failure.startswith("BROKEN PROMISE, NO BASELINE: new ratio 0.5")
    assert _gates(tmp_path / "elsewhere", None, on_gpu=False).judge("g", 10.0, 2.0, promise=1.0).skip is not None


def test_on_a_gpu_without_a_baseline_file_the_promise_is_still_judged(tmp_path):
    gates = _gates(tmp_path / "b200", None)  # a GPU kind that never recorded baselines
    broken = gates.judge("g", 1.0, 2.0, promise=1.0)  # ratio 0.5 against a promise of 1
    assert broken.skip is None and broken.failure == (
        f"BROKEN PROMISE: g ratio 0.5 is below the promise 1 its test states; no baseline file "
        f"{tmp_path / 'b200' / 'h100.json'} adds a floor (--update-baselines writes one)")
    assert gates.judge("g", 3.0, 2.0, promise=1.0) == baselines.Verdict(1.5)  # held: passes, no floor to add


def test_a_recorded_baseline_only_adds_its_floor_to_the_promise(tmp_path):
    broken = _gates(tmp_path, {"g": 0.4}).judge("g", 1.0, 2.0, promise=1.0)  # far above the baseline's floor
    assert broken.failure.startswith("BROKEN PROMISE: g ratio 0.5 is below the promise 1")


@pytest.mark.parametrize(("accept_regression", "failure", "record"), [
    (False, "refusing to record REGRESSION", None),
    (True, None, 2.5),
])
def test_updating_records_a_regression_only_when_it_is_accepted(tmp_path, accept_regression, failure, record):
    judged = _gates(tmp_path, {"g": 5.0}, update=True, accept_regression=accept_regression).judge(
        "g", 10.0, 4.0, promise=1.0)
    assert judged.record == record
    assert judged.failure is None if failure is None else judged.failure.startswith(failure)
    broken = _gates(tmp_path, {"g": 5.0}, update=True, accept_regression=True).judge("g", 1.0, 2.0, promise=1.0)
    assert broken.failure.startswith("refusing to record BROKEN PROMISE") and broken.record is None
