"""The GPU's SM clock, power and energy while a benchmark runs, sampled through NVML
(nvidia-ml-py).

Why benchmarks print them: an H200 running Blink's saturation workloads sits at its 700 W
limit and the driver holds its SM clock down (a median of ~1,600 MHz, against 1,980 when it
is not capped), and how much depends on the data (docs/performance.md, *Power*: until
45f6628, `bench_decode`'s constant inputs drew less power than a live step and ran ~10-16%
faster at saturation's step shapes). A time per step means little without the clock it ran at, so
`bench_decode` and `bench_serving` report, for every timed line and workload, the median SM
clock, the median power against the enforced limit, the share of samples the driver marked as
held by the power cap, and the energy used.

    monitor = GpuMonitor.for_cuda_device(0)   # monitor.unavailable: why nothing is sampled
    with monitor:
        since = monitor.mark()
        ...                                   # the workload
        clocks = monitor.summary(since)       # None when nothing was sampled
"""
from __future__ import annotations

import contextlib
import statistics
import threading
import time
from dataclasses import dataclass

SAMPLE_PERIOD_S = 0.05
# nvmlClocksEventReason* bits (nvml.h). GPU_IDLE: the clock is down because nothing runs (such
# samples are left out of a summary); the others hold a busy GPU's clock down: the software
# power cap or the hardware's power brake, and thermal slowdown (software or hardware).
GPU_IDLE = 0x1
POWER_CAP = 0x4
POWER_BRAKE = 0x80
THERMAL = 0x20 | 0x40


@dataclass(frozen=True)
class GpuSample:
    t: float                 # time.monotonic()
    sm_mhz: float
    power_w: float           # instantaneous where the driver has it (a 1 s average otherwise)
    reasons: int             # nvmlClocksEventReason* bits
    energy_j: float | None   # the board's energy counter (since the driver loaded)


@dataclass(frozen=True)
class GpuClocks:
    """What the GPU ran at over a window of samples."""
    samples: int                 # busy ones (the idle ones left out of the medians and shares)
    sm_mhz_median: float
    sm_mhz_min: float
    power_w_median: float
    power_limit_w: float
    power_capped_share: float    # of the busy samples: the power cap (or brake) held the clock
    thermal_share: float         # of the busy samples: a thermal slowdown held it
    energy_j: float | None       # used between the window's first and last sample (all of them)

    def describe(self) -> str:
        energy = f", {self.energy_j:,.0f} J" if self.energy_j is not None else ""
        thermal = (f", thermal slowdown {self.thermal_share:.0%}" if self.thermal_share else "")
        return (f"SM clock {self.sm_mhz_median:,.0f} MHz median (min {self.sm_mhz_min:,.0f}), "
                f"{self.power_w_median:.0f} W median of {self.power_limit_w:.0f} W, "
                f"power-capped {self.power_capped_share:.0%} of {self.samples} samples"
                f"{thermal}{energy}")


def summarize(samples: list[GpuSample], power_limit_w: float) -> GpuClocks | None:
    """The window's busy samples (between workloads the GPU idles and its clock falls), and
    the energy over the whole window; None when no sample was busy."""
    busy = [s for s in samples if not s.reasons & GPU_IDLE]
    if not busy:
        return None
    clocks = [s.sm_mhz for s in busy]
    first, last = samples[0].energy_j, samples[-1].energy_j
    return GpuClocks(
        samples=len(busy), sm_mhz_median=statistics.median(clocks), sm_mhz_min=min(clocks),
        power_w_median=statistics.median(s.power_w for s in busy), power_limit_w=power_limit_w,
        power_capped_share=sum(bool(s.reasons & (POWER_CAP | POWER_BRAKE))
                               for s in busy) / len(busy),
        thermal_share=sum(bool(s.reasons & THERMAL) for s in busy) / len(busy),
        energy_j=last - first if first is not None and last is not None else None)


class GpuMonitor:
    """A thread sampling one GPU every SAMPLE_PERIOD_S while in its `with` block. Without NVML
    (no nvidia-ml-py, no driver, a driver without the calls) it samples nothing: `unavailable`
    says why and summaries are None, so a benchmark still runs and says what it cannot report.
    One sample is read at construction, so a failing call shows before the benchmark starts."""

    def __init__(self, pci_bus_id: bytes | None, unavailable: str | None = None):
        self.unavailable = unavailable
        self.power_limit_w = 0.0
        self._samples: list[GpuSample] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sample = None
        if unavailable is None:
            try:
                self._sample = self._nvml_sampler(pci_bus_id)
                self._sample()
            except Exception as e:  # ImportError, NVMLError (FunctionNotFound: an old driver)
                self._sample = None
                self.unavailable = f"no NVML ({type(e).__name__}: {e}; pip install nvidia-ml-py)"

    def _nvml_sampler(self, pci_bus_id: bytes):
        """A function reading one GpuSample of the GPU at pci_bus_id."""
        import pynvml as nvml
        nvml.nvmlInit()
        h = nvml.nvmlDeviceGetHandleByPciBusId(pci_bus_id)
        self.power_limit_w = nvml.nvmlDeviceGetEnforcedPowerLimit(h) / 1e3
        # nvmlDeviceGetPowerUsage is a 1 s average on this generation: a short benchmark line
        # would see its predecessor's power; the instantaneous field where the driver has it
        field = nvml.nvmlDeviceGetFieldValues(h, [nvml.NVML_FI_DEV_POWER_INSTANT])[0]
        instant = field.nvmlReturn == nvml.NVML_SUCCESS

        def power_w() -> float:
            if instant:
                value = nvml.nvmlDeviceGetFieldValues(h, [nvml.NVML_FI_DEV_POWER_INSTANT])[0]
                if value.nvmlReturn == nvml.NVML_SUCCESS:
                    return value.value.uiVal / 1e3  # mW
            return nvml.nvmlDeviceGetPowerUsage(h) / 1e3

        try:
            nvml.nvmlDeviceGetTotalEnergyConsumption(h)
            has_energy = True
        except nvml.NVMLError:  # a board without the counter: no energy, the rest still
            has_energy = False

        def sample() -> GpuSample:
            return GpuSample(
                time.monotonic(), float(nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM)),
                power_w(), int(nvml.nvmlDeviceGetCurrentClocksEventReasons(h)),
                nvml.nvmlDeviceGetTotalEnergyConsumption(h) / 1e3 if has_energy else None)
        return sample

    @classmethod
    def for_cuda_device(cls, ordinal: int = 0) -> "GpuMonitor":
        """The GPU that CUDA numbers `ordinal` in this process (CUDA_VISIBLE_DEVICES applied;
        NVML's own numbering ignores it, the PCI bus id does not)."""
        try:
            from blink.gpu_engine import cuda_runtime as cr
            cr.check(cr.cu.cuInit(0))
            bus = cr.check(cr.cu.cuDeviceGetPCIBusId(32, cr.check(cr.cu.cuDeviceGet(ordinal))))
            return cls(bytes(bus).split(b"\0")[0])
        except Exception as e:
            return cls(None, unavailable=f"no CUDA device {ordinal} ({type(e).__name__}: {e})")

    def __enter__(self) -> "GpuMonitor":
        if self._sample is not None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="gpu-monitor", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    @contextlib.contextmanager
    def reporting(self, who: str):
        """`with monitor.reporting("bench decode"):` samples in the block, and prints why the
        clock and power are missing from its lines: before it (never read) or after it (NVML
        stopped answering)."""
        unread = self.unavailable
        if unread:
            print(f"{who}: the SM clock and power are not reported: {unread}")
        with self:
            yield self
        if self.unavailable != unread:
            print(f"{who}: the SM clock and power stopped: {self.unavailable}")

    def mark(self) -> float:
        """A point in time to summarize from."""
        return time.monotonic()

    def summary(self, since: float) -> GpuClocks | None:
        """The samples from `since` until now."""
        with self._lock:
            window = [s for s in self._samples if s.t >= since]
        return summarize(window, self.power_limit_w)

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_PERIOD_S):
            try:
                sample = self._sample()
            except Exception as e:  # the driver went away mid-run: stop sampling, say why
                self.unavailable = f"NVML stopped answering ({type(e).__name__}: {e})"
                return
            with self._lock:
                self._samples.append(sample)
