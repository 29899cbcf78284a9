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
