"""The GPU's SM clock and power while a benchmark runs, sampled through NVML (nvidia-ml-py).

Why benchmarks print them: on the H200 the same forward graph runs 8-18% slower in a sustained
live run than in `bench_decode`'s bursts of replays (docs/performance.md, *Power*). Both meet the
board's 700 W limit, but a sustained run stays there, and the driver holds the SM clock lower
(a median of ~1,600 MHz against ~1,860 MHz). A time per step means little without the clock it
ran at, so `bench_serving` and `bench_decode` report the median SM clock, the median power, and
the share of samples the driver marked as power-capped, for every workload and point.

    monitor = GpuMonitor.for_cuda_device(0)   # None fields (and a reason) without NVML
    with monitor:
        since = monitor.mark()
        ...                                   # the workload
        print(monitor.summary(since).describe())
"""
from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass

SAMPLE_PERIOD_S = 0.05
# nvmlClocksEventReason* bits (nvml.h): the clock held down by the software power cap, by
# thermal slowdown (software or hardware), or by the hardware's power brake.
POWER_CAP = 0x4
THERMAL = 0x20 | 0x40
POWER_BRAKE = 0x80
GPU_IDLE = 0x1


@dataclass(frozen=True)
class GpuSample:
    t: float          # time.monotonic()
    sm_mhz: float
    power_w: float
    reasons: int      # nvmlClocksEventReason* bits


@dataclass(frozen=True)
class GpuClocks:
    """What the GPU ran at over a window of samples (the idle ones left out)."""
    samples: int
    sm_mhz_median: float
    sm_mhz_min: float
    power_w_median: float
    power_limit_w: float
    power_capped: float   # share of the samples with the power cap (or brake) holding the clock
    thermal: float        # share with a thermal slowdown

    def describe(self) -> str:
        return (f"SM clock {self.sm_mhz_median:,.0f} MHz median (min {self.sm_mhz_min:,.0f}), "
                f"{self.power_w_median:.0f} W median of {self.power_limit_w:.0f} W, "
                f"power-capped {self.power_capped:.0%} of {self.samples} samples"
                + (f", thermal slowdown {self.thermal:.0%}" if self.thermal else ""))


def summarize(samples: list[GpuSample], power_limit_w: float) -> GpuClocks | None:
    """The window's samples, except those the driver marked idle (between workloads the clock
    falls to idle); None when none is left."""
    busy = [s for s in samples if not s.reasons & GPU_IDLE]
    if not busy:
        return None
    clocks = [s.sm_mhz for s in busy]
    return GpuClocks(
        samples=len(busy), sm_mhz_median=statistics.median(clocks), sm_mhz_min=min(clocks),
        power_w_median=statistics.median(s.power_w for s in busy), power_limit_w=power_limit_w,
        power_capped=sum(bool(s.reasons & (POWER_CAP | POWER_BRAKE)) for s in busy) / len(busy),
        thermal=sum(bool(s.reasons & THERMAL) for s in busy) / len(busy))


class GpuMonitor:
    """A thread sampling one GPU every SAMPLE_PERIOD_S while in its `with` block. Without NVML
    (no nvidia-ml-py, no driver) it samples nothing: `unavailable` says why and summaries are
    None, so a benchmark still runs and says what it could not report."""

    def __init__(self, pci_bus_id: bytes | None, unavailable: str | None = None):
        self.unavailable = unavailable
        self.power_limit_w = 0.0
        self._handle = None
        self._samples: list[GpuSample] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if unavailable is None:
            try:
                import pynvml
                pynvml.nvmlInit()
                self._nvml = pynvml
                self._handle = pynvml.nvmlDeviceGetHandleByPciBusId(pci_bus_id)
                self.power_limit_w = pynvml.nvmlDeviceGetEnforcedPowerLimit(self._handle) / 1e3
            except Exception as e:  # ImportError, NVMLError
                self.unavailable = f"no NVML ({type(e).__name__}: {e}; pip install nvidia-ml-py)"

    @classmethod
    def for_cuda_device(cls, ordinal: int = 0) -> "GpuMonitor":
        """The GPU that CUDA numbers `ordinal` in this process (CUDA_VISIBLE_DEVICES applied;
        NVML's own numbering ignores it, the PCI bus id does not)."""
        try:
            from blink.gpu_engine import cuda_runtime as cr
            cr.check(cr.cu.cuInit(0))
            bus = cr.check(cr.cu.cuDeviceGetPCIBusId(32, cr.check(cr.cu.cuDeviceGet(ordinal))))
            bus = bus if isinstance(bus, bytes) else str(bus).encode()
            return cls(bus.split(b"\0")[0])
        except Exception as e:
            return cls(None, unavailable=f"no CUDA device {ordinal} ({type(e).__name__}: {e})")

    def __enter__(self) -> "GpuMonitor":
        if self._handle is not None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="gpu-monitor", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def mark(self) -> float:
        """A point in time to summarize from."""
        return time.monotonic()

    def summary(self, since: float, until: float | None = None) -> GpuClocks | None:
        until = time.monotonic() if until is None else until
        with self._lock:
            window = [s for s in self._samples if since <= s.t <= until]
        return summarize(window, self.power_limit_w)

    def _run(self) -> None:
        nvml, h = self._nvml, self._handle
        while not self._stop.wait(SAMPLE_PERIOD_S):
            try:
                sample = GpuSample(time.monotonic(),
                                   float(nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM)),
                                   nvml.nvmlDeviceGetPowerUsage(h) / 1e3,
                                   int(nvml.nvmlDeviceGetCurrentClocksEventReasons(h)))
            except Exception as e:  # the driver went away: stop sampling, say so once
                self.unavailable = f"NVML stopped answering ({type(e).__name__}: {e})"
                return
            with self._lock:
                self._samples.append(sample)
