"""NVML's account of a timed step's clock (cs336_systems.clocks), against a stand-in NVML."""

import re
from types import SimpleNamespace

import pytest
import torch

from cs336_systems import rows
from cs336_systems.benchmarks import e2e
from cs336_systems.benchmarks.e2e import E2EConfig, benchmark_model
from cs336_systems.timing import timed_step
from cs336_systems.clocks import ClockSample, GpuClocks, clock_columns
from cs336_systems.reports import problems
from cs336_systems.timing import StepTimer


class FakeNvml:
    """NVML's calls that GpuClocks makes. Each read of the power counter advances it by `capped_ns`
    and the thermal one by `thermal_ns`, as if that much of the time since the last read was clock-limited."""
    NVML_PERF_POLICY_POWER, NVML_PERF_POLICY_THERMAL, NVML_CLOCK_SM, NVML_TEMPERATURE_GPU = 0, 1, 1, 0

    def __init__(self, capped_ns: int, thermal_ns: int, sm_clock_mhz: int = 1755, temperature_celsius: int = 86):
        self.counters = {0: 0, 1: 0}
        self.step_ns = {0: capped_ns, 1: thermal_ns}
        self.sm_clock_mhz, self.temperature_celsius = sm_clock_mhz, temperature_celsius

    def nvmlDeviceGetViolationStatus(self, handle, policy):
        self.counters[policy] += self.step_ns[policy]
        return SimpleNamespace(referenceTime=0, violationTime=self.counters[policy])

    def nvmlDeviceGetClockInfo(self, handle, clock):
        return self.sm_clock_mhz

    def nvmlDeviceGetTemperature(self, handle, sensor):
        return self.temperature_celsius


def test_no_clocks_on_a_cpu():
    assert GpuClocks.of("cpu") is None


def test_no_clocks_for_a_cuda_device_where_there_is_no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert GpuClocks.of("cuda") is None and GpuClocks.of("cuda:1") is None


def test_a_sample_is_the_difference_of_two_readings_in_milliseconds():
    clocks = GpuClocks(FakeNvml(capped_ns=3_000_000, thermal_ns=1_000_000), handle=None)
    before, after = clocks.read(), clocks.read()
    sample = clocks.sample(before, after)
    assert (sample.power_capped_ms, sample.thermal_ms) == (3.0, 1.0)
    assert sample.window_ms == (after.host_ns - before.host_ns) / 1e6
    assert (sample.sm_clock_mhz, sample.temperature_celsius) == (1755, 86)


def test_clock_columns_weigh_each_step_by_its_time_and_take_the_median_clock_and_the_hottest_step():
    samples = [ClockSample(window_ms=100.0, power_capped_ms=0.0, thermal_ms=0.0, sm_clock_mhz=1980, temperature_celsius=70),
               ClockSample(window_ms=100.0, power_capped_ms=50.0, thermal_ms=10.0, sm_clock_mhz=1700, temperature_celsius=88),
               ClockSample(window_ms=200.0, power_capped_ms=150.0, thermal_ms=30.0, sm_clock_mhz=1600, temperature_celsius=87)]
    assert clock_columns(samples) == {"power_capped_share": 0.5, "thermal_limited_share": 0.1, "sm_clock_mhz": 1700,
                                      "max_temperature_celsius": 88}
    assert clock_columns([]) == {}


def test_a_share_never_exceeds_the_whole_step():
    # NVML's counters tick on the device's own schedule, so a step can be credited a little more than its window.
    sample = ClockSample(window_ms=10.0, power_capped_ms=10.5, thermal_ms=0.0, sm_clock_mhz=1500, temperature_celsius=80)
    assert clock_columns([sample])["power_capped_share"] == 1.0


def test_each_timed_step_records_its_clock_where_nvml_can_be_read(monkeypatch):
    fake = GpuClocks(FakeNvml(capped_ns=2_000_000, thermal_ns=0), handle=None)
    monkeypatch.setattr(GpuClocks, "of", staticmethod(lambda device: fake))
    samples, timers = {}, []
    for _ in range(3):
        with timed_step("cpu", samples, timers) as phase, phase("forward"):
            pass
    clocks = [timer.clock for timer in timers]
    assert len(clocks) == 3 and {c.power_capped_ms for c in clocks} == {2.0}
    assert all(c.window_ms >= step_ms for c, step_ms in zip(clocks, samples["step"]))


def test_a_timer_reads_nvml_only_when_asked(monkeypatch):
    # A timed collective or a kernel micro-benchmark keeps no clock account and must not pay the reads.
    nvml = FakeNvml(capped_ns=1_000_000, thermal_ns=0)
    monkeypatch.setattr(GpuClocks, "of", staticmethod(lambda device: GpuClocks(nvml, handle=None)))
    timer = StepTimer("cpu")
    with timer.step():
        pass
    with timed_step("cpu", {}):
        pass
    assert timer.clock is None and nvml.counters == {0: 0, 1: 0}


def test_without_nvml_a_step_records_no_clock():
    timers = []
    with timed_step("cpu", {}, timers):
        pass
    assert timers[0].clock is None


def test_the_whole_step_row_alone_carries_the_clock_columns(monkeypatch):
    sample = ClockSample(window_ms=20.0, power_capped_ms=5.0, thermal_ms=0.0, sm_clock_mhz=1900, temperature_celsius=75)
    steps = [10.0, 11.0]
    measured = e2e.Measured({"forward": [3.0, 3.0], "backward": [5.0, 6.0], "optimizer": [1.0, 1.0], "step": steps},
                            first_step_ms=40.0, clocks=(sample, sample))
    monkeypatch.setattr(e2e, "_measure", lambda cfg, device, reference, profiled_steps: measured)
    by_phase = {r["phase"]: r for r in benchmark_model(E2EConfig("tiny", 16, steps=2), "cpu")}
    assert by_phase["train_step"]["power_capped_share"] == 0.25
    assert by_phase["train_step"]["sm_clock_mhz"] == 1900
    assert not any("sm_clock_mhz" in by_phase[phase] for phase in ("forward", "backward", "optimizer", "forward_backward"))


@pytest.mark.parametrize("column, unit", [("sm_clock_mhz", "MHz"), ("max_temperature_celsius", "degC"),
                                          ("power_capped_share", "")])
def test_clock_columns_are_long_rows_with_their_units(column, unit):
    record = {"size": "xl", "status": "ok", column: 1755}
    [row] = rows.to_long([record])
    assert row["unit"] == unit
    assert rows.from_long([row]) == [record]


# What the torch_compile report's whole-model setup quotes of a compiled step's run.
STEP_RUN = {"batch_size": 4, "warmup": 5, "steps": 10}


def test_the_reference_table_sets_both_models_clocks_side_by_side():
    step = {**STEP_RUN, "size": "xl", "context_length": 512, "precision": "bf16", "compile": True, "phase": "train_step",
            "status": "ok", "mean_ms": 130.0, "std_ms": 1.0, "median_ms": 130.0}
    ours = {**step, "table": "sweep", "sm_clock_mhz": 1755, "power_capped_share": 0.4, "thermal_limited_share": 0.12,
            "max_temperature_celsius": 88}
    theirs = {**step, "table": "reference", "model": rows.REFERENCE_MODEL, "median_ms": 125.0, "sm_clock_mhz": 1980,
              "power_capped_share": 0.0, "thermal_limited_share": 0.0, "max_temperature_celsius": 70}
    table = problems.report("torch_compile").render([ours, theirs]).body
    assert re.search(r"\| 1,755 MHz, power-capped 40%, hot 12%; 1,980 MHz +\|", table)


@pytest.mark.gpu
def test_a_gpu_step_reads_its_clock_from_nvml():
    pytest.importorskip("pynvml")
    assert GpuClocks.of("cuda") is not None, "NVML could not be read on this GPU"
    a = torch.randn(4096, 4096, device="cuda")
    samples, timers = {}, []
    for _ in range(3):
        with timed_step("cuda", samples, timers):
            for _ in range(10):
                a @ a
    clocks = [timer.clock for timer in timers]
    assert None not in clocks
    for sample, step_ms in zip(clocks, samples["step"]):
        # The readings bracket the step: the host window holds the step's device time.
        assert sample.window_ms >= step_ms > 0
        assert sample.sm_clock_mhz > 0 and sample.temperature_celsius > 0
        assert 0 <= sample.power_capped_ms and 0 <= sample.thermal_ms


def test_the_reference_table_says_how_much_of_each_step_the_host_took_to_issue():
    step = {**STEP_RUN, "size": "small", "context_length": 512, "precision": "bf16", "compile": True,
            "phase": "train_step", "status": "ok", "mean_ms": 20.0, "std_ms": 1.0}
    ours = {**step, "table": "sweep", "median_ms": 20.0, "host_ms": 19.0}
    theirs = {**step, "table": "reference", "model": rows.REFERENCE_MODEL, "median_ms": 16.0, "host_ms": 8.0}
    assert re.search(r"\| 95%; 50% +\|", problems.report("torch_compile").render([ours, theirs]).body)
