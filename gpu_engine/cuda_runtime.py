"""Thin host-side CUDA plumbing for the GPU engine, over NVIDIA's cuda-python.

Kernels are compiled once by nvcc (the same compiler PyCUDA drives) into sm_90a cubins and cached
on disk; code that launches graphs from the device is compiled relocatable and linked with
cudadevrt through the driver's linker. Everything here runs at start-up only. PyCUDA has no
graph API and its host registration breaks under NumPy 2 (README.md), so this module uses
`cuda.bindings` for modules, launches, graphs and host registration.

Importing this module needs cuda-python but no GPU; calls need a GPU. CPU code never imports it.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from cuda.bindings import driver as cu

from blink.gpu_engine.engine_layout import GpuSetupError

CSRC = Path(__file__).resolve().parent / "csrc"


class CudaError(GpuSetupError):
    pass


def check(result, what: str = ""):
    """cuda-python calls return (error, *values): raise on error, return the values."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        _, name = cu.cuGetErrorName(err)
        _, text = cu.cuGetErrorString(err)
        raise CudaError(f"{what or 'CUDA call'} failed: {name.decode() if name else err}: "
                        f"{text.decode() if text else ''}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def gpu_unusable_reason() -> str | None:
    """None when a CUDA GPU can be used here, else why not (for skips and engine choice)."""
    try:
        check(cu.cuInit(0))
        count = check(cu.cuDeviceGetCount())
    except Exception as e:  # no driver library, no device, ...
        return f"no usable CUDA driver/GPU ({type(e).__name__}: {e})"
    if count < 1:
        return "no CUDA device"
    return None


_context = None


def device_attribute(name: str, device: int = 0) -> int:
    """CU_DEVICE_ATTRIBUTE_<name> of a device (MULTIPROCESSOR_COUNT, ...)."""
    primary_context()
    attribute = getattr(cu.CUdevice_attribute, f"CU_DEVICE_ATTRIBUTE_{name}")
    return int(check(cu.cuDeviceGetAttribute(attribute, check(cu.cuDeviceGet(device)))))


def primary_context():
    """Retains and makes current the primary context of device 0 (shared with the runtime API,
    cuBLAS and PyCUDA's autoprimaryctx)."""
    global _context
    if _context is None:
        check(cu.cuInit(0))
        dev = check(cu.cuDeviceGet(0))
        _context = check(cu.cuDevicePrimaryCtxRetain(dev))
    check(cu.cuCtxSetCurrent(_context))
    return _context


def cache_dir(kind: str = "kernels") -> Path:
    """BLINK_CACHE_DIR (default ~/.cache/blink)/kind: compiled kernels, tuned GEMM choices."""
    root = os.environ.get("BLINK_CACHE_DIR") or Path.home() / ".cache" / "blink"
    path = Path(root) / kind
    path.mkdir(parents=True, exist_ok=True)
    return path


def nvcc_path() -> str | None:
    for cand in (os.environ.get("BLINK_NVCC"), shutil.which("nvcc"),
                 os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def _sources(path: Path, found: dict[str, str] | None = None) -> dict[str, str]:
    """name -> text of a source and every csrc header it includes, recursively."""
    found = {} if found is None else found
    found[path.name] = path.read_text()
    for inc in re.findall(r'^#include "([^"]+)"', found[path.name], re.M):
        if inc not in found and (CSRC / inc).is_file():
            _sources(CSRC / inc, found)
    return found


def nvcc_cubin(source: Path, *, arch: str = "90a", relocatable: bool = False,
               defines: dict | None = None, max_registers: int | None = None) -> bytes:
    """One .cu file compiled to a cubin for `arch`, cached under $BLINK_CACHE_DIR/kernels by a
    hash of the flags, the compiler version and the sources it includes. max_registers: every
    function's cap (-maxrregcount; with relocatable code each device function the kernel calls
    gets its own allocation, and linking gives the kernel the largest). $BLINK_NVCC_DEFINES
    ("NAME=VALUE,NAME") adds macros to every module's: a kernel variant behind a macro is timed
    against the default by running a benchmark once with it and once without."""
    defines = dict(defines or {})
    for item in filter(None, os.environ.get("BLINK_NVCC_DEFINES", "").split(",")):
        name, _, value = item.partition("=")
        defines[name.strip()] = value.strip() or 1
    nvcc = nvcc_path()
    if nvcc is None:
        raise CudaError("nvcc not found (set BLINK_NVCC or put CUDA's bin folder on PATH)")
    flags = ["-cubin", f"-gencode=arch=compute_{arch},code=sm_{arch}", "-O3", "-std=c++17",
             "-lineinfo", f"-I{CSRC}"]
    if relocatable:
        flags.append("-rdc=true")
    if max_registers is not None:
        flags.append(f"-maxrregcount={max_registers}")
    flags += [f"-D{k}={v}" for k, v in sorted(defines.items())]
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256(("\0".join(flags) + version).encode())
    for name, text in sorted(_sources(source).items()):
        digest.update(name.encode() + b"\0" + text.encode())
    out = cache_dir() / f"{source.stem}-{digest.hexdigest()[:24]}.cubin"
    if not out.exists():
        with tempfile.TemporaryDirectory() as tmp:
            tmp_out = Path(tmp) / out.name
            proc = subprocess.run([nvcc, *flags, "-o", str(tmp_out), str(source)],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                raise CudaError(f"nvcc failed on {source.name}:\n{proc.stderr}{proc.stdout}")
            os.replace(tmp_out, out)
    return out.read_bytes()


def cudadevrt_path() -> Path:
    nvcc = Path(nvcc_path() or "/usr/local/cuda/bin/nvcc").resolve()
    for cand in (nvcc.parents[1] / "lib64" / "libcudadevrt.a",
                 nvcc.parents[1] / "targets" / "x86_64-linux" / "lib" / "libcudadevrt.a",
                 Path("/usr/local/cuda/lib64/libcudadevrt.a")):
        if cand.exists():
            return cand
    raise CudaError("libcudadevrt.a not found next to nvcc: device graph launch needs it")


def link_device_runtime(cubin: bytes) -> bytes:
    """Links a relocatable cubin with cudadevrt (needed for device-side graph launch)."""
    primary_context()
    state = check(cu.cuLinkCreate(0, [], []))
    try:
        check(cu.cuLinkAddData(state, cu.CUjitInputType.CU_JIT_INPUT_CUBIN, cubin, len(cubin),
                               b"blink", 0, [], []))
        check(cu.cuLinkAddFile(state, cu.CUjitInputType.CU_JIT_INPUT_LIBRARY,
                               str(cudadevrt_path()).encode(), 0, [], []))
        ptr, size = check(cu.cuLinkComplete(state))
        return ctypes.string_at(int(ptr), int(size))
    finally:
        cu.cuLinkDestroy(state)


class Module:
    """A loaded cubin and its kernels."""

    def __init__(self, image: bytes):
        primary_context()
        self.handle = check(cu.cuModuleLoadData(image))
        self._functions: dict[str, object] = {}

    def function(self, name: str):
        if name not in self._functions:
            self._functions[name] = check(cu.cuModuleGetFunction(self.handle, name.encode()))
        return self._functions[name]

    def global_ptr(self, name: str) -> tuple[int, int]:
        ptr, size = check(cu.cuModuleGetGlobal(self.handle, name.encode()))
        return int(ptr), int(size)


def launch(func, grid: int | tuple, block: int | tuple, args: tuple, types: tuple,
           stream=0, shared_bytes: int = 0) -> None:
    """cuLaunchKernel with cuda-python's (values, ctypes types) parameter packing."""
    gx, gy, gz = (grid, 1, 1) if isinstance(grid, int) else grid
    bx, by, bz = (block, 1, 1) if isinstance(block, int) else block
    check(cu.cuLaunchKernel(func, gx, gy, gz, bx, by, bz, shared_bytes, stream,
                            (args, types), 0))


def new_stream():
    primary_context()
    return check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING.value))


def synchronize(stream) -> None:
    check(cu.cuStreamSynchronize(stream), "cuStreamSynchronize")


def capture_device_graph(stream, record) -> object:
    """Captures what `record(stream)` launches into a graph instantiated for device launch
    (kernel nodes only) and uploaded, so a kernel can launch it with cudaGraphLaunch."""
    check(cu.cuStreamBeginCapture(stream, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL))
    try:
        record(stream)
    except BaseException:
        err, graph = cu.cuStreamEndCapture(stream)  # leave capture mode, drop what was captured
        if int(err) == 0 and graph is not None:
            cu.cuGraphDestroy(graph)
        raise
    graph = check(cu.cuStreamEndCapture(stream))
    try:
        exec_ = check(cu.cuGraphInstantiate(
            graph, cu.CUgraphInstantiate_flags.CUDA_GRAPH_INSTANTIATE_FLAG_DEVICE_LAUNCH))
    finally:
        check(cu.cuGraphDestroy(graph))  # the executable graph does not need it
    check(cu.cuGraphUpload(exec_, stream))
    check(cu.cuStreamSynchronize(stream))
    return exec_


def graph_exec_handle(exec_) -> int:
    """The raw cudaGraphExec_t value a kernel casts back (driver and runtime handles agree)."""
    return int(exec_)


class DeviceBuffer:
    def __init__(self, nbytes: int):
        primary_context()
        self.nbytes = max(1, nbytes)
        self.ptr = int(check(cu.cuMemAlloc(self.nbytes)))

    def upload(self, data: bytes | memoryview, offset: int = 0) -> None:
        check(cu.cuMemcpyHtoD(self.ptr + offset, data, len(data)))

    def download(self, nbytes: int | None = None, offset: int = 0) -> bytes:
        out = bytearray(nbytes if nbytes is not None else self.nbytes - offset)
        check(cu.cuMemcpyDtoH(out, self.ptr + offset, len(out)))
        return bytes(out)

    def zero(self) -> None:
        check(cu.cuMemsetD8(self.ptr, 0, self.nbytes))

    def free(self) -> None:
        if self.ptr:
            cu.cuMemFree(self.ptr)
            self.ptr = 0


# What a NIC can register of GPU memory: whole GPU pages (dma-buf ranges must be page-aligned).
GPU_PAGE_BYTES = 1 << 16


def dmabuf_unsupported_reason() -> str | None:
    """None when device 0's memory can be exported as dma-buf (for a NIC to register), else why
    not, said for an operator."""
    try:
        supported = device_attribute("DMA_BUF_SUPPORTED")
    except Exception as e:  # no driver, no device
        return f"no usable CUDA GPU ({type(e).__name__}: {e})"
    if not supported:
        return ("the CUDA driver cannot export GPU memory as dma-buf here "
                "(CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED is 0: it needs NVIDIA's open kernel "
                "modules and a Linux kernel >= 5.12)")
    return None


class DeviceRing(DeviceBuffer):
    """The ring in GPU memory, for a NIC to reach by RDMA (--ring-memory gpu): whole GPU pages,
    zeroed, with synchronous memory operations (CU_POINTER_ATTRIBUTE_SYNC_MEMOPS: the driver
    then orders its own copies to and from this range against what a peer device wrote, as
    GPUDirect RDMA asks)."""

    def __init__(self, nbytes: int):
        # cuMemAlloc aligns small allocations to less than a GPU page: take one page more and
        # start at the first page boundary in it
        pages = -(-nbytes // GPU_PAGE_BYTES)
        super().__init__((pages + 1) * GPU_PAGE_BYTES)
        self.base = self.ptr
        self.ptr = -(-self.base // GPU_PAGE_BYTES) * GPU_PAGE_BYTES
        self.nbytes = pages * GPU_PAGE_BYTES
        check(cu.cuPointerSetAttribute(
            1, cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_SYNC_MEMOPS, self.ptr),
            "cuPointerSetAttribute(SYNC_MEMOPS)")
        self.zero()

    def export_dmabuf(self) -> int:
        """A new dma-buf file descriptor for the whole range (the caller closes it)."""
        return int(check(cu.cuMemGetHandleForAddressRange(
            self.ptr, self.nbytes,
            cu.CUmemRangeHandleType.CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0),
            "cuMemGetHandleForAddressRange(DMA_BUF_FD)"))

    def free(self) -> None:
        if self.ptr:
            cu.cuMemFree(self.base)
            self.ptr = 0


class HostMapping:
    """Page-locks a mapped region (e.g. the /dev/shm ring) and maps it into the GPU's address
    space, so kernels read and write it directly (system-scope atomics and fences order it)."""

    def __init__(self, buffer):
        primary_context()
        self._anchor = ctypes.c_char.from_buffer(buffer)  # keeps the buffer exported
        self.host_ptr = ctypes.addressof(self._anchor)
        self.nbytes = len(buffer)
        flags = (cu.CU_MEMHOSTREGISTER_PORTABLE | cu.CU_MEMHOSTREGISTER_DEVICEMAP)
        check(cu.cuMemHostRegister(self.host_ptr, self.nbytes, flags))
        self.device_ptr = int(check(cu.cuMemHostGetDevicePointer(self.host_ptr, 0)))

    def close(self) -> None:
        if self._anchor is not None:
            cu.cuMemHostUnregister(self.host_ptr)
            self._anchor = None


class EventTimer:
    """`with EventTimer(stream) as t: ...` then t.seconds: device time between two events."""

    def __init__(self, stream):
        primary_context()
        self.stream = stream
        self.start = check(cu.cuEventCreate(0))
        self.end = check(cu.cuEventCreate(0))
        self.seconds = 0.0

    def __enter__(self) -> "EventTimer":
        check(cu.cuEventRecord(self.start, self.stream))
        return self

    def __exit__(self, *exc) -> None:
        check(cu.cuEventRecord(self.end, self.stream))
        check(cu.cuEventSynchronize(self.end))
        self.seconds = check(cu.cuEventElapsedTime(self.start, self.end)) / 1e3
        cu.cuEventDestroy(self.start)
        cu.cuEventDestroy(self.end)
