"""The `gpu` marker's skip: GPU tests run only where a CUDA GPU and cuda-python are usable."""
from __future__ import annotations

import pytest


def gpu_skip_reason() -> str | None:
    try:
        from blink.gpu_engine.cuda_runtime import gpu_unusable_reason, nvcc_path
    except Exception as e:  # cuda-python missing (CI installs no GPU packages)
        return f"cuda-python is not installed ({e})"
    return gpu_unusable_reason() or (None if nvcc_path() else "nvcc not found")


def requires_gpu():
    reason = gpu_skip_reason()
    return pytest.mark.skipif(reason is not None, reason=f"needs an NVIDIA GPU: {reason}")


@pytest.fixture(autouse=True)
def free_device_arrays_after_each_test():
    """Frees the device arrays a test allocated once it ends. The kernel tests hold their
    buffers in locals, and a DeviceArray is freed only on request (an engine's graphs keep raw
    pointers, so it has no finalizer): 3,493 tests on 4 xdist workers ran an 80 GB H100 out of
    memory (2026-12-05), where the 141 GB H200 had room. Module fixtures are set up before this
    one, so their arrays (the models, their engines) stay."""
    from blink.gpu_engine import cuda_forward
    made = []
    init = cuda_forward.DeviceArray.__init__

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cuda_forward.DeviceArray, "__init__", recording_init)
        yield
    # A kernel may still be running on them; after a fault the context is gone and every call
    # fails, which the test has already reported.
    if int(cuda_forward.driver.cuCtxSynchronize()[0]) != 0:
        return
    for array in made:
        array.free()
