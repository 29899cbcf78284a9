"""The benchmarks' SM clock, power and energy readings: a window's summary is the statistics of
its busy samples and the energy between its ends, a machine without NVML says why and reports
nothing, and on a GPU the monitor reads the device CUDA numbers 0 while it works."""
from __future__ import annotations

import statistics
import sys
import time

import pytest

from blink.gpu_engine.gpu_monitor import GPU_IDLE, POWER_CAP, THERMAL, GpuMonitor, GpuSample, \
    summarize
from gpu import requires_gpu


def test_a_window_leaves_idle_samples_out_of_its_medians():
    samples = [GpuSample(0.0, 345, 80, GPU_IDLE, 1000.0),        # between workloads
               GpuSample(0.1, 1980, 450, 0, 1030.0),
               GpuSample(0.2, 1605, 691, POWER_CAP, 1100.0),
               GpuSample(0.3, 1530, 693, POWER_CAP | THERMAL, 1170.0),
               GpuSample(0.4, 1710, 688, POWER_CAP, 1240.0)]
    got = summarize(samples, power_limit_w=700)
    busy = samples[1:]
    assert got.samples == 4
    assert got.sm_mhz_median == statistics.median(s.sm_mhz for s in busy) == 1657.5
    assert got.sm_mhz_min == 1530
    assert got.power_w_median == statistics.median(s.power_w for s in busy) == 689.5
    assert (got.power_capped_share, got.thermal_share) == (0.75, 0.25)
    assert got.energy_j == 240.0  # over the whole window, idle sample included
    assert got.describe() == ("SM clock 1,658 MHz median (min 1,530), 690 W median of 700 W, "
                              "power-capped 75% of 4 samples, thermal slowdown 25%, 240 J")
    assert summarize(samples[:1], power_limit_w=700) is None  # only idle: nothing to say
    no_counter = [GpuSample(s.t, s.sm_mhz, s.power_w, s.reasons, None) for s in samples]
    assert summarize(no_counter, power_limit_w=700).energy_j is None


def test_without_nvml_it_says_why_and_reports_nothing(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # as if nvidia-ml-py were not installed
    monitor = GpuMonitor(b"0000:00:06.0")
    assert monitor.unavailable.startswith("no NVML (ModuleNotFoundError")
    with monitor.reporting("bench x"):
        since = monitor.mark()
    assert monitor.summary(since) is None
    assert capsys.readouterr().out == (f"bench x: the SM clock and power are not reported: "
                                       f"{monitor.unavailable}\n")
    no_device = GpuMonitor(None, unavailable="no CUDA device 0 (test)")
    assert no_device.unavailable == "no CUDA device 0 (test)"


@pytest.mark.gpu
@requires_gpu()
def test_it_reads_the_gpu_while_it_works():
    pytest.importorskip("pynvml", reason="nvidia-ml-py is not installed (the gpu extra has it)")
    from blink.gpu_engine import cuda_runtime as cr
    monitor = GpuMonitor.for_cuda_device(0)
    assert monitor.unavailable is None, monitor.unavailable
    assert monitor.power_limit_w > 0
    cr.primary_context()
    n = 1 << 30
    a, b = cr.DeviceBuffer(n), cr.DeviceBuffer(n)
    stream = cr.new_stream()
    with monitor:
        since = monitor.mark()
        end = time.monotonic() + 1.0
        while time.monotonic() < end:  # copies back to back: the GPU is busy, not idle
            for _ in range(20):
                cr.check(cr.cu.cuMemcpyDtoDAsync(b.ptr, a.ptr, n, stream))
            cr.synchronize(stream)
        got = monitor.summary(since)
    a.free(), b.free()
    assert got is not None and got.samples >= 5
    assert 100 < got.sm_mhz_min <= got.sm_mhz_median < 5000
    assert 0 < got.power_w_median <= 1.5 * monitor.power_limit_w
    # about a second of copies: joules between a tenth of the limit's and all of it
    assert got.energy_j is None or 0.05 * monitor.power_limit_w < got.energy_j \
        < 1.5 * monitor.power_limit_w


# nvml.h: nvmlClocksEventReason*
NVML_GPU_IDLE = 0x0000000000000001
NVML_SW_POWER_CAP = 0x0000000000000004
NVML_SW_THERMAL = 0x0000000000000020
NVML_HW_THERMAL = 0x0000000000000040
NVML_HW_POWER_BRAKE = 0x0000000000000080


def test_the_reason_bits_are_nvmls():
    """The summaries' power-capped and thermal shares from NVML's clock event reasons, with
    the bit values written as nvml.h defines them (not taken from the module)."""
    samples = [GpuSample(0.0, 1980, 400, 0, None),
               GpuSample(0.1, 1400, 710, NVML_HW_POWER_BRAKE, None),   # brake: capped
               GpuSample(0.15, 1450, 705, NVML_HW_POWER_BRAKE, None),  # brake: capped
               GpuSample(0.2, 1500, 690, NVML_SW_POWER_CAP, None),     # capped
               GpuSample(0.3, 1300, 500, NVML_HW_THERMAL, None),       # thermal
               GpuSample(0.4, 1350, 500, NVML_SW_THERMAL, None),       # thermal
               GpuSample(0.5, 210, 70, NVML_GPU_IDLE, None)]           # idle: left out
    got = summarize(samples, power_limit_w=700)
    assert got.samples == 6
    assert got.power_capped_share == pytest.approx(3 / 6)
    assert got.thermal_share == pytest.approx(2 / 6)
    assert got.sm_mhz_median == statistics.median([1980, 1400, 1450, 1500, 1300, 1350]) == 1425
    assert got.sm_mhz_min == 1300


def test_a_summary_is_of_the_samples_since_its_mark():
    """A workload's summary (summary(since=)) leaves out the samples taken before its mark."""
    monitor = GpuMonitor(None, unavailable="no GPU in this test")
    monitor.power_limit_w = 700.0
    # as the sampling thread appends them: an earlier workload's, then this one's
    monitor._samples = [GpuSample(1.0, 1200, 700, NVML_SW_POWER_CAP, 100.0),
                        GpuSample(2.0, 1200, 700, NVML_SW_POWER_CAP, 800.0),
                        GpuSample(10.0, 1900, 300, 0, 900.0),
                        GpuSample(11.0, 1800, 350, 0, 1230.0)]
    got = monitor.summary(since=10.0)
    assert got.samples == 2
    assert got.sm_mhz_median == 1850 and got.power_w_median == 325
    assert got.power_capped_share == 0.0
    assert got.energy_j == pytest.approx(330.0)
    assert got.power_limit_w == 700.0
