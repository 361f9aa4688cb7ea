"""What a GPU's clock did while a step was timed, from NVML (the library behind nvidia-smi).

A GPU lowers its SM clock when it reaches its power limit or gets hot, so the same work takes longer:
on an H100 a training step that runs at 1980 MHz for its first seconds slows by 5-10% once the card
reaches its slowdown temperature. NVML counts, per cause, the nanoseconds its clock was held down;
reading the counters before and after a step tells how much of the step ran clock-limited, which is
what separates a slow step of a throttled GPU from one that did more work or waited for the host.

    clocks = GpuClocks.of("cuda")          # None without a GPU, the NVML bindings or a working NVML
    before = clocks.read()
    ...                                    # the step, ending in a synchronisation
    sample = clocks.sample(before, clocks.read())
    clock_columns([sample, ...])           # the row columns of a cell's timed steps

The bindings are NVIDIA's `nvidia-ml-py` (module `pynvml`, which torch.cuda also uses).
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Reading:
    host_ns: int  # time.perf_counter_ns() when read
    power_capped_ns: int  # NVML's running count of time the clock was held down by the power limit
    thermal_ns: int  # ... by temperature
    sm_clock_mhz: int
    temperature_celsius: int


@dataclass(frozen=True)
class ClockSample:
    """One timed step as NVML saw it, between a reading before the step and one after its synchronisation."""
    window_ms: float  # host time between the two readings; the step's device work lies inside it
    power_capped_ms: float
    thermal_ms: float
    sm_clock_mhz: int  # at the step's end
    temperature_celsius: int  # at the step's end


class GpuClocks:
    """NVML's counters and sensors of one CUDA device."""

    def __init__(self, nvml, handle):
        self._nvml = nvml
        self._handle = handle

    @staticmethod
    def of(device: torch.device | str) -> GpuClocks | None:
        """The device's clocks, or None where they cannot be read: not a CUDA device, no `pynvml`, or an
        NVML that fails (no driver, a device NVML does not expose)."""
        device = torch.device(device)
        if device.type != "cuda" or not torch.cuda.is_available():
            return None
        index = torch.cuda.current_device() if device.index is None else device.index
        return _clocks_of(index)

    def read(self) -> Reading:
        nvml, handle = self._nvml, self._handle
        return Reading(
            host_ns=time.perf_counter_ns(),
            power_capped_ns=nvml.nvmlDeviceGetViolationStatus(handle, nvml.NVML_PERF_POLICY_POWER).violationTime,
            thermal_ns=nvml.nvmlDeviceGetViolationStatus(handle, nvml.NVML_PERF_POLICY_THERMAL).violationTime,
            sm_clock_mhz=nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM),
            temperature_celsius=nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU),
        )

    @staticmethod
    def sample(before: Reading, after: Reading) -> ClockSample:
        return ClockSample(window_ms=(after.host_ns - before.host_ns) / 1e6,
                           power_capped_ms=(after.power_capped_ns - before.power_capped_ns) / 1e6,
                           thermal_ms=(after.thermal_ns - before.thermal_ns) / 1e6,
                           sm_clock_mhz=after.sm_clock_mhz, temperature_celsius=after.temperature_celsius)


@functools.cache
def _clocks_of(index: int) -> GpuClocks | None:
    try:
        import pynvml
    except ImportError:
        return None
    # NVML numbers devices in PCI order, CUDA by speed unless CUDA_DEVICE_ORDER says otherwise, and
    # CUDA_VISIBLE_DEVICES renumbers them: the PCI address names the same card for both.
    props = torch.cuda.get_device_properties(index)
    bus_id = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    try:
        pynvml.nvmlInit()
        clocks = GpuClocks(pynvml, pynvml.nvmlDeviceGetHandleByPciBusId(bus_id))
        clocks.read()
    except pynvml.NVMLError:
        return None
    return clocks


# The columns `clock_columns` gives.
CLOCK_COLUMNS = ("power_capped_share", "thermal_limited_share", "sm_clock_mhz", "max_temperature_celsius")


def clock_columns(samples: Sequence[ClockSample]) -> dict[str, float]:
    """A cell's clock columns over its timed steps: the share of the steps' time NVML counted the clock
    as held down by the power limit and by temperature, the median SM clock and the highest temperature
    at the steps' ends. Empty without samples."""
    if not samples:
        return {}
    window_ms = sum(s.window_ms for s in samples)
    values = (min(1.0, sum(s.power_capped_ms for s in samples) / window_ms),
              min(1.0, sum(s.thermal_ms for s in samples) / window_ms),
              statistics.median(s.sm_clock_mhz for s in samples),
              max(s.temperature_celsius for s in samples))
    return dict(zip(CLOCK_COLUMNS, values))
