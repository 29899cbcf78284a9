"""A tiny ctypes binding of cuBLAS: a handle bound to one stream and one user workspace, and
GemmEx with bf16 operands and fp32 accumulation; for shapes where a tuner found a faster one
(gemm_tuning.py), cuBLASLt's matmul with that algorithm. FP8 projections (linear_fp8) run on
cuBLASLt alone: E4M3 operands with a float32 scale per weight row and per token row (outer-vector
scaling, compute capability 9.0), fp32 accumulation.

A user workspace is what makes cuBLAS calls capturable into a graph that is instantiated for
device launch: without one cuBLAS may allocate inside the capture. No dependency beyond ctypes;
the caller owns the CUDA context (cuBLAS uses the device's primary context).
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import glob
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from blink.gpu_engine.engine_layout import GpuSetupError

log = logging.getLogger(__name__)

# cublasOperation_t
OP_N, OP_T = 0, 1
# cudaDataType_t
R_32F, R_16BF, R_8F_E4M3 = 0, 14, 28
# cublasComputeType_t
COMPUTE_32F = 68
# cublasGemmAlgo_t
GEMM_DEFAULT = -1
# cublasPointerMode_t
POINTER_MODE_HOST, POINTER_MODE_DEVICE = 0, 1
# cublasStatus_t
STATUS_NOT_SUPPORTED = 15
# cublasLt attributes: cublasLtMatmulDescAttributes_t, cublasLtMatmulPreferenceAttributes_t,
# cublasLtMatmulAlgoConfigAttributes_t
LT_DESC_TRANSA, LT_DESC_TRANSB, LT_DESC_SM_COUNT_TARGET = 3, 4, 15
LT_DESC_A_SCALE_POINTER, LT_DESC_B_SCALE_POINTER = 17, 18
LT_DESC_FAST_ACCUM = 25
LT_DESC_A_SCALE_MODE, LT_DESC_B_SCALE_MODE = 31, 32
# cublasLtMatmulMatrixScale_t: a float32 per row of op(A) and per column of op(B)
LT_SCALE_OUTER_VEC_32F = 3
LT_PREF_MAX_WORKSPACE_BYTES = 1
LT_CONFIG_ID, LT_CONFIG_TILE_ID, LT_CONFIG_SPLITK_NUM, LT_CONFIG_REDUCTION_SCHEME = 0, 1, 2, 3
# cublasLtReductionScheme_t: how a split-K algorithm sums its parts. INPLACE adds them into the
# output in the output's type (in turn: the workspace holds only counters that order them);
# COMPUTE_TYPE sums them in fp32 in the workspace, then writes the output.
LT_REDUCTION_NONE, LT_REDUCTION_INPLACE, LT_REDUCTION_COMPUTE_TYPE = 0, 1, 2

# Split-K variants the tuner also times (Cublas.split_k): a GEMM of few rows has few output
# tiles (8B's o projection at 128 rows: 32 for 132 SMs), so cutting K fills the GPU. Each
# count is tried on the heuristic's first SPLIT_K_BASES algorithms, for shapes of up to
# SPLIT_K_MAX_ROWS rows (above, the output tiles fill the GPU by themselves).
SPLIT_K_COUNTS = (2, 3, 4, 6, 8)
SPLIT_K_BASES = 3
SPLIT_K_MAX_ROWS = 256


@dataclass(frozen=True)
class GemmShape:
    """One projection as Cublas.linear computes it: row-major out[rows, out_features] (+)=
    x[rows, in_features] @ w[out_features, in_features]^T, x and w bf16 (fp8: E4M3 codes, each
    token row of x and each row of w with its float32 scale: Cublas.linear_fp8)."""
    rows: int
    in_features: int
    out_features: int
    out_type: int      # R_16BF or R_32F
    accumulate: bool   # beta = 1: added into an fp32 out (the residual stream)
    fp8: bool = False
    # fp8: the MMAs accumulate in the tensor cores' own precision, never promoted to fp32 in
    # between (cuBLASLt's FAST_ACCUM; Cublas.fp8_fast_accum)
    fast_accum: bool = False

    def __post_init__(self):
        if self.fast_accum and not self.fp8:
            raise ValueError("fast_accum is an FP8 GEMM's accumulation mode")

    @property
    def key(self) -> str:
        out = "f32+=" if self.accumulate else "f32" if self.out_type == R_32F else "bf16"
        kind = ("fp8fa:" if self.fast_accum else "fp8:") if self.fp8 else ""
        return f"{kind}{self.rows}x{self.in_features}->" \
               f"{self.out_features}:{out}"

    @property
    def x_bytes(self) -> int:
        return self.rows * self.in_features * (1 if self.fp8 else 2)


@dataclass(frozen=True)
class GemmCall:
    """A linear() or linear_fp8() call as recorded (Cublas.recording): its shape and device
    pointers (fp8: the scales' too)."""
    shape: GemmShape
    x: int
    w: int
    out: int
    x_scale: int = 0
    w_scale: int = 0


class LtAlgo(ctypes.Structure):
    """cublasLtMatmulAlgo_t: opaque, 64 bytes; the library documents that it may be stored and
    restored for use with the same cuBLAS version, which is how tuned choices are cached."""
    _fields_ = [("data", ctypes.c_uint64 * 8)]

    def to_hex(self) -> str:
        return bytes(self).hex()

    @classmethod
    def from_hex(cls, text: str) -> "LtAlgo":
        raw = bytes.fromhex(text)
        if len(raw) != ctypes.sizeof(cls):
            raise ValueError(f"a cublasLtMatmulAlgo_t is {ctypes.sizeof(cls)} bytes, "
                             f"not {len(raw)}")
        return cls.from_buffer_copy(raw)


class _LtHeuristicResult(ctypes.Structure):
    """cublasLtMatmulHeuristicResult_t."""
    _fields_ = [("algo", LtAlgo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


class CublasError(GpuSetupError):
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
            for lt in _lt_beside(path):
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


def _lt_beside(libcublas: Path) -> list[Path]:
    """The libcublasLt files in libcublas's folder, newest name first."""
    return sorted(libcublas.parent.glob("libcublasLt.so*"), reverse=True)


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
        self._set_sm_count_target = _fn(lib, "cublasSetSmCountTarget")
        self._gemm_ex = _fn(lib, "cublasGemmEx")
        self._create.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        self._destroy.argtypes = [ctypes.c_void_p]
        self._set_stream.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self._set_workspace.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        self._set_pointer_mode.argtypes = [ctypes.c_void_p, ctypes.c_int]
        self._get_version.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
        self._set_sm_count_target.argtypes = [ctypes.c_void_p, ctypes.c_int]
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
        self.stream, self.workspace, self.workspace_bytes = 0, 0, 0
        self.sm_count_target = 0  # 0: the device's SMs
        # True: FP8 GEMMs accumulate without cuBLASLt's periodic promotion to fp32 (GemmShape's
        # fast_accum), as vLLM's and TensorRT-LLM's FP8 GEMMs do; False, cuBLAS's default
        self.fp8_fast_accum = False
        # True: lt_candidates adds split-K variants of the heuristic's first algorithms for
        # shapes of few rows (what the tuner then times; SPLIT_K_COUNTS)
        self.split_k = False
        # shape -> the cuBLASLt algorithm linear() runs it with (others: GemmEx's own choice)
        self.algos: dict[GemmShape, LtAlgo] = {}
        self._calls: list[GemmCall] | None = None  # linear() records here instead (recording)
        self._lt = None         # (cublasLt functions, handle), made on first use
        self._lt_plans = {}     # shape -> (matmul descriptor, A, B, C layouts)
        self._fp8_defaults: dict[GemmShape, LtAlgo] = {}  # the heuristic's first, per shape

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
        self.stream = stream

    def set_workspace(self, ptr: int, nbytes: int) -> None:
        self._check(self._set_workspace(self.handle, ctypes.c_void_p(ptr), nbytes),
                    "cublasSetWorkspace")
        self.workspace, self.workspace_bytes = ptr, nbytes

    def set_sm_count_target(self, sms: int) -> None:
        """Size GEMMs for `sms` SMs (0: the device's), as when another kernel holds the rest:
        cublasSetSmCountTarget for GemmEx, the matmul descriptors' SM_COUNT_TARGET for
        cuBLASLt (its heuristic's candidates, and the calls)."""
        self._check(self._set_sm_count_target(self.handle, sms), "cublasSetSmCountTarget")
        self.sm_count_target = sms
        self._destroy_lt_plans()  # their descriptors carry the old target
        self._fp8_defaults.clear()

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

    _CHOSEN = object()  # linear()'s default algo: the one self.algos holds for the shape

    def linear(self, x: int, w: int, out: int, rows: int, in_features: int, out_features: int,
               out_type: int = R_16BF, accumulate: bool = False, algo=_CHOSEN) -> None:
        """Row-major out[rows, out_features] (+)= x[rows, in_features] @ w[out_features, in]^T.

        x and w bf16; out bf16 or fp32 (R_32F; accumulate=True adds into it, beta = 1, the
        residual add folded into the GEMM). Column-major view: out^T = w^T(op T) x^T.
        algo: an LtAlgo runs cuBLASLt's matmul with it, None runs GemmEx (cuBLAS's own choice);
        by default, self.algos's choice for the shape, else GemmEx.
        """
        if accumulate and out_type != R_32F:
            raise ValueError("accumulate needs an fp32 output")
        shape = GemmShape(rows, in_features, out_features, out_type, accumulate)
        if self._calls is not None:
            self._calls.append(GemmCall(shape, x, w, out))
            return
        if algo is self._CHOSEN:
            algo = self.algos.get(shape)
        if algo is not None:
            self._lt_matmul(shape, algo, x, w, out)
            return
        self.gemm_ex(OP_T, OP_N, out_features, rows, in_features, self._one, w, R_16BF,
                     in_features, x, R_16BF, in_features,
                     self._one if accumulate else self._zero, out, out_type, out_features)

    def linear_fp8(self, x: int, x_scale: int, w: int, w_scale: int, out: int, rows: int,
                   in_features: int, out_features: int, out_type: int = R_16BF,
                   accumulate: bool = False, algo=_CHOSEN) -> None:
        """linear() on E4M3 codes: out[r, n] (+)= x_scale[r] * w_scale[n] * sum_k x[r, k]
        w[n, k], x [rows, in] and w [out, in] row-major codes, x_scale [rows] and w_scale [out]
        float32 (device pointers), fp32 accumulation. cuBLASLt only (outer-vector scaling);
        algo None: its heuristic's first choice for the shape (fp8_supported says whether
        there is one)."""
        if accumulate and out_type != R_32F:
            raise ValueError("accumulate needs an fp32 output")
        shape = self.fp8_shape(rows, in_features, out_features, out_type, accumulate)
        if self._calls is not None:
            self._calls.append(GemmCall(shape, x, w, out, x_scale, w_scale))
            return
        if algo is self._CHOSEN:
            algo = self.algos.get(shape)
        if algo is None:
            algo = self._fp8_default(shape)
        self._lt_matmul(shape, algo, x, w, out, x_scale, w_scale)

    def fp8_shape(self, rows: int, in_features: int, out_features: int, out_type: int,
                  accumulate: bool) -> GemmShape:
        """The shape linear_fp8 runs such a call as (with this handle's fp8_fast_accum)."""
        return GemmShape(rows, in_features, out_features, out_type, accumulate, fp8=True,
                         fast_accum=self.fp8_fast_accum)

    def _fp8_default(self, shape: GemmShape) -> LtAlgo:
        algo = self._fp8_defaults.get(shape)
        if algo is None:
            candidates = self._lt_heuristic(shape, count=1)
            if not candidates:
                raise CublasError(f"cuBLASLt has no FP8 GEMM with per-row scales for "
                                  f"{shape.key} on this GPU (it needs compute capability 9.0 "
                                  f"and cuBLAS 12.9 or later)")
            algo = self._fp8_defaults[shape] = candidates[0]
        return algo

    def fp8_supported(self, shape: GemmShape) -> str | None:
        """None where cuBLASLt offers an FP8 GEMM with per-row scales for the shape, else why
        not (the engine's start-up check)."""
        try:
            self._fp8_default(shape)
        except CublasError as e:
            return str(e)
        return None

    @contextlib.contextmanager
    def recording(self):
        """`with blas.recording() as calls:` linear() launches nothing and appends a GemmCall
        to `calls` instead (how the tuner learns a forward pass's GEMMs and their operands)."""
        calls: list[GemmCall] = []
        self._calls = calls
        try:
            yield calls
        finally:
            self._calls = None

    # --- cuBLASLt -------------------------------------------------------------------------------

    def _lt_api(self):
        if self._lt is None:
            lib = self.lib  # libcublas depends on libcublasLt: its handle resolves Lt's symbols
            if getattr(lib, "cublasLtCreate", None) is None:
                path = Path(self.path)
                found = _lt_beside(path) if path.is_absolute() else []
                lib = ctypes.CDLL(str(found[0]) if found else "libcublasLt.so")
            p = ctypes.c_void_p
            sig = {
                "cublasLtCreate": [ctypes.POINTER(p)],
                "cublasLtDestroy": [p],
                "cublasLtMatmulDescCreate": [ctypes.POINTER(p), ctypes.c_int, ctypes.c_int],
                "cublasLtMatmulDescDestroy": [p],
                "cublasLtMatmulDescSetAttribute": [p, ctypes.c_int, p, ctypes.c_size_t],
                "cublasLtMatrixLayoutCreate": [ctypes.POINTER(p), ctypes.c_int, ctypes.c_uint64,
                                               ctypes.c_uint64, ctypes.c_int64],
                "cublasLtMatrixLayoutDestroy": [p],
                "cublasLtMatmulPreferenceCreate": [ctypes.POINTER(p)],
                "cublasLtMatmulPreferenceDestroy": [p],
                "cublasLtMatmulPreferenceSetAttribute": [p, ctypes.c_int, p, ctypes.c_size_t],
                "cublasLtMatmulAlgoGetHeuristic": [p, p, p, p, p, p, p, ctypes.c_int,
                                                   ctypes.POINTER(_LtHeuristicResult),
                                                   ctypes.POINTER(ctypes.c_int)],
                "cublasLtMatmulAlgoConfigGetAttribute": [ctypes.POINTER(LtAlgo), ctypes.c_int,
                                                         p, ctypes.c_size_t,
                                                         ctypes.POINTER(ctypes.c_size_t)],
                "cublasLtMatmulAlgoConfigSetAttribute": [ctypes.POINTER(LtAlgo), ctypes.c_int,
                                                         p, ctypes.c_size_t],
                "cublasLtMatmulAlgoCheck": [p, p, p, p, p, p, ctypes.POINTER(LtAlgo),
                                            ctypes.POINTER(_LtHeuristicResult)],
                "cublasLtMatmul": [p, p, p, p, p, p, p, p, p, p, p, p, ctypes.POINTER(LtAlgo), p,
                                   ctypes.c_size_t, p],
            }
            api = {}
            for name, argtypes in sig.items():
                f = _fn(lib, name)
                f.argtypes = argtypes
                api[name] = f
            handle = ctypes.c_void_p()
            self._check(api["cublasLtCreate"](ctypes.byref(handle)), "cublasLtCreate")
            self._lt = (api, handle)
        return self._lt

    def _lt_plan(self, shape: GemmShape):
        """The matmul descriptor and layouts of a shape (column-major view as in linear())."""
        plan = self._lt_plans.get(shape)
        if plan is None:
            api, _ = self._lt_api()
            desc = ctypes.c_void_p()
            self._check(api["cublasLtMatmulDescCreate"](ctypes.byref(desc), COMPUTE_32F, R_32F),
                        "cublasLtMatmulDescCreate")
            attrs = [(LT_DESC_TRANSA, ctypes.c_int32(OP_T)), (LT_DESC_TRANSB, ctypes.c_int32(OP_N)),
                     (LT_DESC_SM_COUNT_TARGET, ctypes.c_int32(self.sm_count_target))]
            if shape.fp8:
                if not self.workspace:
                    raise CublasError("FP8 GEMMs need the workspace set first (set_workspace)")
                # a scale per row of w (op(A)'s rows) and per token (op(B)'s columns); the
                # heuristic refuses these modes without scale pointers (cublasStatus_t 7), so
                # the workspace stands in for them until a call sets its own (_lt_matmul)
                attrs += [(LT_DESC_A_SCALE_MODE, ctypes.c_int32(LT_SCALE_OUTER_VEC_32F)),
                          (LT_DESC_B_SCALE_MODE, ctypes.c_int32(LT_SCALE_OUTER_VEC_32F)),
                          (LT_DESC_A_SCALE_POINTER, ctypes.c_void_p(self.workspace)),
                          (LT_DESC_B_SCALE_POINTER, ctypes.c_void_p(self.workspace))]
                if shape.fast_accum:
                    attrs.append((LT_DESC_FAST_ACCUM, ctypes.c_int8(1)))
            for attr, value in attrs:
                self._check(api["cublasLtMatmulDescSetAttribute"](
                    desc, attr, ctypes.byref(value), ctypes.sizeof(value)),
                    "cublasLtMatmulDescSetAttribute")
            operand = R_8F_E4M3 if shape.fp8 else R_16BF
            layouts = []
            for dtype, rows, cols in ((operand, shape.in_features, shape.out_features),  # w^T
                                      (operand, shape.in_features, shape.rows),          # x^T
                                      (shape.out_type, shape.out_features, shape.rows)):  # out^T
                layout = ctypes.c_void_p()
                self._check(api["cublasLtMatrixLayoutCreate"](ctypes.byref(layout), dtype, rows,
                                                              cols, rows),
                            "cublasLtMatrixLayoutCreate")
                layouts.append(layout)
            plan = self._lt_plans[shape] = (desc, *layouts)
        return plan

    def lt_candidates(self, shape: GemmShape, count: int = 16) -> list[LtAlgo]:
        """The algorithms the tuner times for the shape: cuBLASLt's heuristic's `count`, best
        guess first, then (split_k, shapes of up to SPLIT_K_MAX_ROWS rows) split-K variants of
        its first SPLIT_K_BASES; all fit the workspace (set_workspace first)."""
        found = self._lt_heuristic(shape, count)
        if self.split_k and shape.rows <= SPLIT_K_MAX_ROWS:
            found += self._lt_split_k(shape, found[:SPLIT_K_BASES])
        unique: dict[bytes, LtAlgo] = {}  # a variant the heuristic offers too: its place
        for algo in found:
            unique.setdefault(bytes(algo), algo)
        return list(unique.values())

    def _lt_split_k(self, shape: GemmShape, bases: list[LtAlgo]) -> list[LtAlgo]:
        """Each base algorithm with each of SPLIT_K_COUNTS, where cuBLASLt accepts it for the
        shape within the workspace (cublasLtMatmulAlgoCheck). The parts are summed in fp32:
        in place where the output is fp32, in the workspace otherwise (a bf16 output summed
        in place would round at every part)."""
        api, handle = self._lt_api()
        desc, a, b, c = self._lt_plan(shape)
        schemes = (LT_REDUCTION_INPLACE, LT_REDUCTION_COMPUTE_TYPE) \
            if shape.out_type == R_32F else (LT_REDUCTION_COMPUTE_TYPE,)
        variants = []
        for base in bases:
            for parts in SPLIT_K_COUNTS:
                for scheme in schemes:  # the first that cuBLASLt accepts
                    algo = LtAlgo.from_buffer_copy(base)
                    if any(api["cublasLtMatmulAlgoConfigSetAttribute"](
                            ctypes.byref(algo), attr, ctypes.byref(v), ctypes.sizeof(v)) != 0
                           for attr, v in ((LT_CONFIG_SPLITK_NUM, ctypes.c_uint32(parts)),
                                           (LT_CONFIG_REDUCTION_SCHEME,
                                            ctypes.c_uint32(scheme)))):
                        continue  # an attribute this algorithm does not take
                    result = _LtHeuristicResult()
                    status = api["cublasLtMatmulAlgoCheck"](handle, desc, a, b, c, c,
                                                            ctypes.byref(algo),
                                                            ctypes.byref(result))
                    if status == 0 and result.workspace_size <= self.workspace_bytes:
                        variants.append(algo)
                        break
        return variants

    def _lt_heuristic(self, shape: GemmShape, count: int) -> list[LtAlgo]:
        """cuBLASLt's heuristic's algorithms for the shape, best guess first, those that fit
        the workspace."""
        api, handle = self._lt_api()
        desc, a, b, c = self._lt_plan(shape)
        pref = ctypes.c_void_p()
        self._check(api["cublasLtMatmulPreferenceCreate"](ctypes.byref(pref)),
                    "cublasLtMatmulPreferenceCreate")
        try:
            limit = ctypes.c_uint64(self.workspace_bytes)
            self._check(api["cublasLtMatmulPreferenceSetAttribute"](
                pref, LT_PREF_MAX_WORKSPACE_BYTES, ctypes.byref(limit), ctypes.sizeof(limit)),
                "cublasLtMatmulPreferenceSetAttribute")
            results = (_LtHeuristicResult * count)()
            found = ctypes.c_int()
            status = api["cublasLtMatmulAlgoGetHeuristic"](handle, desc, a, b, c, c, pref, count,
                                                           results, ctypes.byref(found))
        finally:
            api["cublasLtMatmulPreferenceDestroy"](pref)
        if status != 0:
            if status != STATUS_NOT_SUPPORTED:  # anything else is unexpected: say so
                log.warning("cublasLtMatmulAlgoGetHeuristic(%s): cublasStatus_t %d, no "
                            "candidates", shape.key, status)
            return []
        return [LtAlgo.from_buffer_copy(r.algo) for r in results[:found.value]
                if r.state == 0 and r.workspace_size <= self.workspace_bytes]

    def lt_describe(self, algo: LtAlgo) -> str:
        """The algorithm's id, tile, split-K count and reduction scheme, for logs."""
        api, _ = self._lt_api()
        parts = []
        for attr, name in ((LT_CONFIG_ID, "id"), (LT_CONFIG_TILE_ID, "tile"),
                           (LT_CONFIG_SPLITK_NUM, "split-k"),
                           (LT_CONFIG_REDUCTION_SCHEME, "reduction")):
            value, written = ctypes.c_uint32(), ctypes.c_size_t()
            status = api["cublasLtMatmulAlgoConfigGetAttribute"](
                ctypes.byref(algo), attr, ctypes.byref(value), ctypes.sizeof(value),
                ctypes.byref(written))
            parts.append(f"{name} {value.value if status == 0 else '?'}")
        return " ".join(parts)

    def _lt_matmul(self, shape: GemmShape, algo: LtAlgo, x: int, w: int, out: int,
                   x_scale: int = 0, w_scale: int = 0) -> None:
        api, handle = self._lt_api()
        desc, a, b, c = self._lt_plan(shape)
        if shape.fp8:  # this call's scale vectors (read when the matmul is enqueued)
            for attr, ptr in ((LT_DESC_A_SCALE_POINTER, w_scale),
                              (LT_DESC_B_SCALE_POINTER, x_scale)):
                value = ctypes.c_void_p(ptr)
                self._check(api["cublasLtMatmulDescSetAttribute"](
                    desc, attr, ctypes.byref(value), ctypes.sizeof(value)),
                    "cublasLtMatmulDescSetAttribute(scale pointer)")
        beta = self._one if shape.accumulate else self._zero
        self._check(api["cublasLtMatmul"](
            handle, desc, ctypes.byref(self._one), ctypes.c_void_p(w), a, ctypes.c_void_p(x), b,
            ctypes.byref(beta), ctypes.c_void_p(out), c, ctypes.c_void_p(out), c,
            ctypes.byref(algo), ctypes.c_void_p(self.workspace), self.workspace_bytes,
            ctypes.c_void_p(self.stream)), f"cublasLtMatmul({shape.key})")

    def _destroy_lt_plans(self) -> None:
        if self._lt is not None:
            api, _ = self._lt
            for desc, *layouts in self._lt_plans.values():
                api["cublasLtMatmulDescDestroy"](desc)
                for layout in layouts:
                    api["cublasLtMatrixLayoutDestroy"](layout)
        self._lt_plans.clear()

    def close(self) -> None:
        self._destroy_lt_plans()
        if self._lt is not None:
            api, handle = self._lt
            api["cublasLtDestroy"](handle)
            self._lt = None
        if self.handle is not None:
            self._destroy(self.handle)
            self.handle = None
