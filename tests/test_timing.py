import contextlib
import functools
import gc
import math
import time

import pytest

from cs336_systems.timing import StepTimer, Timings, issue_times, tflops, time_fn


def test_time_fn_runs_warmup_then_times_each_step():
    calls = []
    timings = time_fn(lambda: calls.append(1), warmup=3, steps=4, device="cpu")
    assert len(calls) == 7 and len(timings.samples_ms) == 4
    assert all(t >= 0 for t in timings.samples_ms)


def test_timings_statistics():
    t = Timings((1.0, 2.0, 6.0))
    assert (t.mean_ms, t.median_ms) == (3.0, 2.0)
    assert t.std_ms == pytest.approx(2.6457513)
    assert Timings((5.0,)).std_ms == 0.0


def test_interquartile_range_is_the_spread_of_the_middle_half_and_ignores_an_outlier():
    assert Timings((1.0, 2.0, 3.0, 4.0, 5.0)).iqr_ms == 2.0
    assert Timings((1.0, 2.0, 3.0, 4.0, 500.0)).iqr_ms == 2.0
    assert Timings((5.0,)).iqr_ms == 0.0
    assert Timings((1.0, 2.0, 6.0, 7.0)).summary() == {"mean_ms": 4.0, "std_ms": pytest.approx(2.9439203),
                                                       "median_ms": 4.0, "iqr_ms": 4.5}


@pytest.mark.parametrize("samples", [(), (1.0, math.nan), (math.inf,), (-1.0, 2.0), ("3",)])
def test_timings_refuse_no_samples_or_a_sample_that_is_no_time(samples):
    with pytest.raises(ValueError, match="samples_ms"):
        Timings(samples)


@pytest.mark.parametrize("ms", [0.0, -1.0, math.nan])
def test_a_rate_needs_a_positive_time(ms):
    with pytest.raises(ValueError, match="ms must be positive"):
        tflops(1e12, ms)
    assert tflops(2e12, 1000.0) == 2.0


@pytest.mark.parametrize("warmup, steps", [(-1, 1), (0, 0)])
def test_time_fn_rejects_bad_counts(warmup, steps):
    with pytest.raises(ValueError, match="warmup"):
        time_fn(lambda: None, warmup=warmup, steps=steps, device="cpu")


def test_issue_times_need_a_gpu_queue_to_keep_busy():
    with pytest.raises(ValueError, match="cpu has no queue to keep busy"):
        issue_times([lambda: None], warmup=0, samples=1, device="cpu")


@pytest.mark.parametrize("fns, contexts", [([], None), ([lambda: None] * 2, [contextlib.nullcontext])])
def test_issue_times_need_a_call_and_a_context_for_each(fns, contexts):
    with pytest.raises(ValueError, match=f"got {len(fns)} calls"):
        issue_times(fns, warmup=0, samples=1, device="cpu", contexts=contexts)


@pytest.mark.gpu
def test_issued_calls_take_turns_each_within_its_context_and_keep_their_own_host_time():
    calls, entered = [], []

    @contextlib.contextmanager
    def context(name):
        entered.append(name)
        yield
        time.sleep(0.0005)  # outside the timed call: counted in no sample

    def call(name, sleep_s):
        def fn():
            assert entered[-1] == name
            calls.append(name)
            time.sleep(sleep_s)
        return fn

    fns = [call("quick", 0.0), call("slow", 0.001), call("still", 0.0)]
    timings = issue_times(fns, warmup=2, samples=6, device="cuda",
                          contexts=[functools.partial(context, name) for name in ("quick", "slow", "still")])
    assert calls[:6] == ["quick"] * 2 + ["slow"] * 2 + ["still"] * 2
    order = ["quick", "slow", "still"]
    rounds = [calls[i:i + 3] for i in range(6, len(calls), 3)]
    assert all(r in (order, order[1:] + order[:1], order[2:] + order[:2]) for r in rounds)
    assert {r[0] for r in rounds} == set(order)  # each takes the first turn
    assert [len(t.samples_ms) for t in timings] == [6, 6, 6]
    assert timings[1].median_ms >= 1.0 > timings[0].median_ms and timings[2].median_ms < 1.0


def test_step_timer_sums_a_phase_entered_twice_and_restores_collection_after_an_error():
    timer = StepTimer("cpu")
    with timer.step():
        for _ in range(2):
            with timer.phase("forward"):
                time.sleep(0.005)
    assert set(timer.phase_ms) == {"forward"} and 10 <= timer.phase_ms["forward"] <= timer.step_ms
    with pytest.raises(RuntimeError, match="inside the step"), timer.step():
        raise RuntimeError("inside the step")
    assert gc.isenabled()


def test_a_steps_host_time_is_what_the_host_spent_issuing_it():
    timer = StepTimer("cpu")
    with timer.step():
        time.sleep(0.02)
    assert 20 <= timer.host_ms <= timer.step_ms + 1
