"""The persistent-kernel mechanism on the GPU: a loop kernel launching a child graph from the
device every step, surviving the fire-and-forget launch limit by tail-launching itself."""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
from gpu import requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu()]

LOOP_STATE = np.dtype([("child_graph", "<u8"), ("steps", "<u8"), ("target_steps", "<u8"),
                       ("t_start_ns", "<u8"), ("t_end_ns", "<u8"), ("done_counter", "<u4"),
                       ("runs", "<u4"), ("retries", "<u4"), ("error", "<i4"),
                       ("finished", "<u4"), ("pad", "<u4")])


def test_device_loop_survives_launch_limit():
    from blink.gpu_engine import cuda_runtime as cr
    src = Path(__file__).parent / "csrc" / "device_loop_probe.cu"
    module = cr.Module(cr.link_device_runtime(cr.nvcc_cubin(src, relocatable=True)))
    state = cr.DeviceBuffer(LOOP_STATE.itemsize)
    stream = cr.new_stream()
    child = cr.capture_device_graph(stream, lambda s: cr.launch(
        module.function("child_step"), 1, 32, (state.ptr,), (ctypes.c_void_p,), s))
    loop = cr.capture_device_graph(stream, lambda s: cr.launch(
        module.function("loop_run"), 1, 32, (state.ptr,), (ctypes.c_void_p,), s))
    init = np.zeros(1, LOOP_STATE)
    init["child_graph"] = cr.graph_exec_handle(child)
    init["target_steps"] = 100_000
    state.upload(init.tobytes())
    cr.check(cr.cu.cuGraphLaunch(loop, stream))
    cr.check(cr.cu.cuStreamSynchronize(stream))
    s = np.frombuffer(state.download(), LOOP_STATE)[0]
    per_step_us = (int(s["t_end_ns"]) - int(s["t_start_ns"])) / int(s["steps"]) / 1e3
    print(f"device loop: {int(s['steps'])} steps, {int(s['runs'])} runs, "
          f"{int(s['retries'])} launch retries, {per_step_us:.2f} us/step")
    assert int(s["error"]) == 0
    assert int(s["finished"]) == 1 and int(s["steps"]) == 100_000
    assert int(s["done_counter"]) == 100_000
    assert int(s["runs"]) >= 100_000 // 100
