"""A tiny ctypes binding of cuBLAS: a handle bound to one stream and one user workspace, and
GemmEx with bf16 operands and fp32 accumulation.

A user workspace is what makes cuBLAS calls capturable into a graph that is instantiated for
device launch: without one cuBLAS may allocate inside the capture. No dependency beyond ctypes;
the caller owns the CUDA context (cuBLAS uses the device's primary context).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import sys
from pathlib import Path

# cublasOperation_t
OP_N, OP_T = 0, 1
# cudaDataType_t
R_32F, R_16BF = 0, 14
# cublasComputeType_t
COMPUTE_32F = 68
# cublasGemmAlgo_t
GEMM_DEFAULT = -1
# cublasPointerMode_t
POINTER_MODE_HOST, POINTER_MODE_DEVICE = 0, 1


class CublasError(RuntimeError):
    pass


def _candidates() -> list[str]:
    """Where libcublas may be, most specific first."""
    found = []
    if os.environ.get("BLINK_LIBCUBLAS"):
        found.append(os.environ["BLINK_LIBCUBLAS"])
    # The nvidia-cublas wheel (pip's CUDA libraries: nvidia/cublas/lib, or nvidia/cu13/lib).
    for root in sys.path:
        for pattern in ("nvidia/cublas/lib/libcublas.so*", "nvidia/cu1*/lib/libcublas.so*"):
            found += sorted(glob.glob(os.path.join(root, pattern)), reverse=True)
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            found += sorted(glob.glob(os.path.join(home, "lib64", "libcublas.so*")), reverse=True)
    name = ctypes.util.find_library("cublas")
    if name:
        found.append(name)
    found += ["libcublas.so.13", "libcublas.so.12", "libcublas.so"]
    return list(dict.fromkeys(found))


def load_library() -> tuple[ctypes.CDLL, str]:
    """(the loaded libcublas, the path or name it was loaded from)."""
    errors = []
    for cand in _candidates():
        path = Path(cand)
        if path.is_absolute():
            # Load cublasLt from the same folder first, so the pair always match.
            for lt in sorted(path.parent.glob("libcublasLt.so*"), reverse=True):
                try:
                    ctypes.CDLL(str(lt), mode=ctypes.RTLD_GLOBAL)
                    break
                except OSError:
                    continue
        try:
            return ctypes.CDLL(cand, mode=ctypes.RTLD_GLOBAL), cand
        except OSError as e:
            errors.append(f"{cand}: {e}")
    raise CublasError("libcublas not found; set BLINK_LIBCUBLAS. Tried:\n  " + "\n  ".join(errors))


def _fn(lib: ctypes.CDLL, *names: str):
    for name in names:
        f = getattr(lib, name, None)
        if f is not None:
            f.restype = ctypes.c_int
            return f
    raise CublasError(f"libcublas lacks {' / '.join(names)}")


class Cublas:
    """One cuBLAS handle. Call set_stream before set_workspace: cublasSetStream resets the
    workspace to cuBLAS's own pool."""

    def __init__(self):
        self.lib, self.path = load_library()
        lib = self.lib
        self._create = _fn(lib, "cublasCreate_v2", "cublasCreate")
        self._destroy = _fn(lib, "cublasDestroy_v2", "cublasDestroy")
        self._set_stream = _fn(lib, "cublasSetStream_v2", "cublasSetStream")
        self._set_workspace = _fn(lib, "cublasSetWorkspace_v2", "cublasSetWorkspace")
        self._set_pointer_mode = _fn(lib, "cublasSetPointerMode_v2", "cublasSetPointerMode")
        self._get_version = _fn(lib, "cublasGetVersion_v2", "cublasGetVersion")
        self._gemm_ex = _fn(lib, "cublasGemmEx")
        self._create.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        self._destroy.argtypes = [ctypes.c_void_p]
        self._set_stream.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self._set_workspace.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        self._set_pointer_mode.argtypes = [ctypes.c_void_p, ctypes.c_int]
        self._get_version.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
        self._gemm_ex.argtypes = [
            ctypes.c_void_p, ctypes.c_int, ctypes.c_int,                      # handle, transa, transb
            ctypes.c_int, ctypes.c_int, ctypes.c_int,                         # m, n, k
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,     # alpha, A, Atype, lda
            ctypes.c_void_p, ctypes.c_int, ctypes.c_int,                      # B, Btype, ldb
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,     # beta, C, Ctype, ldc
            ctypes.c_int, ctypes.c_int,                                       # computeType, algo
        ]
        handle = ctypes.c_void_p()
        self._check(self._create(ctypes.byref(handle)), "cublasCreate")
        self.handle = handle
        # Host scalars, read by cuBLAS at call time (captured by value into graphs).
        self._one, self._zero = ctypes.c_float(1.0), ctypes.c_float(0.0)

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise CublasError(f"{what} failed with cublasStatus_t {status}")

    @property
    def version(self) -> int:
        v = ctypes.c_int()
        self._check(self._get_version(self.handle, ctypes.byref(v)), "cublasGetVersion")
        return v.value

    def set_stream(self, stream: int) -> None:
        self._check(self._set_stream(self.handle, ctypes.c_void_p(stream)), "cublasSetStream")

    def set_workspace(self, ptr: int, nbytes: int) -> None:
        self._check(self._set_workspace(self.handle, ctypes.c_void_p(ptr), nbytes),
                    "cublasSetWorkspace")

    def set_pointer_mode(self, device: bool) -> None:
        mode = POINTER_MODE_DEVICE if device else POINTER_MODE_HOST
        self._check(self._set_pointer_mode(self.handle, mode), "cublasSetPointerMode")

    def gemm_ex(self, transa: int, transb: int, m: int, n: int, k: int, alpha, a: int, a_type: int,
                lda: int, b: int, b_type: int, ldb: int, beta, c: int, c_type: int, ldc: int,
                compute: int = COMPUTE_32F, algo: int = GEMM_DEFAULT) -> None:
        """Column-major C[m, n] = alpha op(A) op(B) + beta C; alpha/beta: ctypes.c_float (host
        pointer mode) or device pointers (device pointer mode)."""
        def ref(s):  # the scalar's address: a host c_float, or a device pointer as int
            return ctypes.addressof(s) if isinstance(s, ctypes.c_float) else s
        self._check(self._gemm_ex(self.handle, transa, transb, m, n, k, ref(alpha), a, a_type, lda,
                                  b, b_type, ldb, ref(beta), c, c_type, ldc, compute, algo),
                    f"cublasGemmEx(m={m}, n={n}, k={k})")

    def linear(self, x: int, w: int, out: int, rows: int, in_features: int, out_features: int,
               out_type: int = R_16BF, accumulate: bool = False) -> None:
        """Row-major out[rows, out_features] (+)= x[rows, in_features] @ w[out_features, in]^T.

        x and w bf16; out bf16 or fp32 (R_32F; accumulate=True adds into it, beta = 1, the
        residual add folded into the GEMM). Column-major view: out^T = w^T(op T) x^T.
        """
        if accumulate and out_type != R_32F:
            raise ValueError("accumulate needs an fp32 output")
        self.gemm_ex(OP_T, OP_N, out_features, rows, in_features, self._one, w, R_16BF,
                     in_features, x, R_16BF, in_features,
                     self._one if accumulate else self._zero, out, out_type, out_features)

    def close(self) -> None:
        if self.handle is not None:
            self._destroy(self.handle)
            self.handle = None
