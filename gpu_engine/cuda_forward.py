"""The CUDA forward pass: bf16 weights and activations (fp32 residual stream and accumulation),
cuBLAS for the projections, our kernels (gpu_engine/csrc) for the rest, one CUDA graph per
token-count bucket, instantiated for device launch so the persistent scheduler kernel can launch
it, and uploaded. Kernels are launched with programmatic dependent launch: inside the graph each
one is resident before its predecessor ends and waits for it in-kernel (csrc/utils.cuh).

Every kernel reads the live batch from device memory (BatchDesc and the arrays beside it, see
csrc/batch.cuh), so a bucket's graph serves any batch of up to `bucket` tokens: the scheduler
writes the arrays, launches `graph_execs[bucket_for(T)]` and waits for `done_counter` to move.

All CUDA imports of the engine live in gpu_engine/cuda_*.py: importing this module needs
cuda-python (cuda.bindings) and a driver; CPU code paths never import it.
"""
from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
from cuda.bindings import driver

from .cuda_runtime import CSRC, CudaError, cache_dir, check, device_attribute, launch, \
    new_stream, nvcc_cubin, primary_context, synchronize

from . import engine_layout
from .checkpoint import ModelConfig, ModelWeights, rope_inv_freq
from .cublas import R_16BF, R_32F, Cublas
from .gemm_tuning import ChoiceCache, GemmTuner, cache_file
from .roofline import layer_projection_weights
from .demo_model import float32_to_bf16_bits
from .forward_batch import ForwardBatch
from .weight_layout import FUSED_PROJECTIONS, interleave_gate_up, rope_pair_order, \
    served_bf16, stored_fp8
from .fp8 import (calibration_count, calibration_tokens, fp8_refusal, kv_scales_from_amax,
                  per_head_kv_scales)

log = logging.getLogger(__name__)


# The Python view of blink::BatchDesc (csrc/batch.cuh); a test checks the two agree.
BATCH_DESC_DTYPE = np.dtype([("num_tokens", "<i4"), ("num_seqs", "<i4"), ("num_logits", "<i4"),
                             ("done_counter", "<i4")])

# bf16 lives in NumPy as its uint16 bit pattern.
BF16 = np.dtype(np.uint16)

# Output modes of the skinny linear kernel (csrc/gemv.cuh, enum GemvOut).
SKINNY_BF16, SKINNY_F32, SKINNY_F32_ADD, SKINNY_SILU_MUL = 0, 1, 2, 3

# The infix of the FP8-weight entry points' names (blink_skinny_linear_fp8_1x1, ...), by fp8.
_FP8 = {False: "", True: "_fp8"}


def to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (round to nearest even), finite inputs."""
    return float32_to_bf16_bits(np.asarray(x, np.float32))


def from_bf16(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32)


class DeviceArray:
    """Device memory for one array of fixed shape and dtype (bf16 as BF16 = uint16 bits)."""

    def __init__(self, shape, dtype):
        self.shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else
                                            (shape,)))
        self.dtype = np.dtype(dtype)
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        self.ptr = int(check(driver.cuMemAlloc(max(self.nbytes, 1)), "cuMemAlloc"))

    @classmethod
    def from_numpy(cls, arr: np.ndarray) -> DeviceArray:
        arr = np.ascontiguousarray(arr)
        dev = cls(arr.shape, arr.dtype)
        dev.upload(arr)
        return dev

    def upload(self, arr: np.ndarray, stream=None, offset_bytes: int = 0) -> None:
        """Writes arr (cast to this dtype) at a byte offset: stream-ordered when a stream is
        given (and must then stay alive until the stream passes the copy), else synchronous."""
        arr = np.ascontiguousarray(arr, self.dtype)
        if offset_bytes + arr.nbytes > self.nbytes:
            raise ValueError(f"{arr.nbytes} bytes at {offset_bytes} overflow {self.nbytes}")
        if arr.nbytes == 0:
            return
        if stream is None:
            check(driver.cuMemcpyHtoD(self.ptr + offset_bytes, arr.ctypes.data, arr.nbytes),
                  "cuMemcpyHtoD")
        else:
            check(driver.cuMemcpyHtoDAsync(self.ptr + offset_bytes, arr.ctypes.data, arr.nbytes,
                                           stream), "cuMemcpyHtoDAsync")

    def download(self, count: int | None = None) -> np.ndarray:
        """The first `count` elements (all by default), flat when count is given. Synchronous:
        synchronize the producing stream first."""
        n = int(np.prod(self.shape, dtype=np.int64)) if count is None else count
        out = np.empty(n, self.dtype)
        if out.nbytes:
            check(driver.cuMemcpyDtoH(out.ctypes.data, self.ptr, out.nbytes), "cuMemcpyDtoH")
        return out.reshape(self.shape) if count is None else out

    def fill_bytes(self, value: int) -> None:
        """Every byte set to `value` (0xFF: NaN for f32/bf16, -1 for ints: the test poison)."""
        check(driver.cuMemsetD8(self.ptr, value, self.nbytes), "cuMemsetD8")
        check(driver.cuCtxSynchronize(), "cuCtxSynchronize")

    def free(self) -> None:
        if self.ptr:
            check(driver.cuMemFree(self.ptr), "cuMemFree")
            self.ptr = 0


# --- kernels -------------------------------------------------------------------------------

def _ptr(p) -> ctypes.c_uint64:
    return ctypes.c_uint64(int(p or 0))


def _i32(v) -> ctypes.c_int32:
    return ctypes.c_int32(int(v))


def _u32(v) -> ctypes.c_uint32:
    return ctypes.c_uint32(v)


def _f32(v) -> ctypes.c_float:
    return ctypes.c_float(float(v))


class ChainProjection(ctypes.Structure):
    """blink::ChainProjection (csrc/gemv_chain.cuh): one projection of projection_chain's
    argument; the module exports its size, which ForwardKernels checks."""
    _fields_ = [("x", ctypes.c_uint64), ("w", ctypes.c_uint64), ("w_tile_stride", ctypes.c_uint32),
                ("N", ctypes.c_int32), ("K", ctypes.c_int32), ("out", ctypes.c_uint64),
                ("shadow", ctypes.c_uint64), ("w_scale", ctypes.c_uint64),
                ("norm_w", ctypes.c_uint64)]


class ForwardKernels:
    """The compiled module of csrc/forward_kernels.cu for one head_dim, and one typed launcher
    per entry point: each validates its sizes, computes the grid and launches on `stream`.
    Pointer arguments are device addresses as ints (0 for null)."""

    # (row tiles, column tiles) shapes of the skinny linear kernel (csrc/gemv.cuh)
    SKINNY_SHAPES = ((1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (2, 4))
    SKINNY_MAX_ROWS = 32  # 4 column tiles of 8 token rows
    SKINNY_NORM_MAX_ROWS = 16  # the RMSNorm-folding variants: one or two column tiles
    # The shapes whose K may be split across clusters of two CTAs (the _k2 entry points: the
    # plain and the qkv + RoPE ones; gemv.cuh SkinnyAccumulate's kSplits)
    SKINNY_SPLIT_SHAPES = ((1, 1), (1, 2))
    SKINNY_SPLIT_KINDS = ("linear", "qkv_rope_norm")
    ENTRY_POINTS = ("blink_embedding", "blink_embedding_xf16", "blink_rms_norm",
                    "blink_rms_norm_xf16", "blink_rope_kv_write",
                    *(f"blink_paged_attention{variant}{layout}"
                      for variant in ("", "_small", "_small_wide", "_wgmma", "_roomy")
                      for layout in ("", "_any_block")),
                    "blink_silu_mul",
                    "blink_sample", "blink_sampling_uniform",
                    "blink_hold_sm", "blink_pdl_noop", "blink_tile_weights",
                    "blink_splitk_add_linear",
                    "blink_splitk_add_linear_x2", "blink_splitk_add_linear_x4",
                    "blink_rowblock_silu_mul", "blink_rowblock_silu_mul_x2",
                    "blink_rowblock_silu_mul_x4", "blink_projection_chain",
                    "blink_projection_chain_fp8",
                    *(f"blink_skinny_linear_{a}x{c}" for a, c in SKINNY_SHAPES),
                    *(f"blink_skinny_{kind}_{a}x{c}_k2" for kind, (a, c)
                      in itertools.product(SKINNY_SPLIT_KINDS, SKINNY_SPLIT_SHAPES)),
                    *(f"blink_skinny_{kind}_{a}x{c}" for kind in ("linear_norm", "qkv_rope_norm")
                      for a in (1, 2) for c in (1, 2)),
                    *(f"blink_skinny_qkv_rope_{a}x4" for a in (1, 2)),
                    # FP8 weights (the _fp8 entries: gemv.cuh Fp8Weights) and their quantizers
                    *(f"blink_skinny_{kind}_fp8_{a}x{c}" for kind in
                      ("linear", "linear_norm", "qkv_rope_norm") for a in (1, 2) for c in (1, 2)),
                    *(f"blink_skinny_{kind}_fp8_{a}x{c}_k2" for kind, (a, c)
                      in itertools.product(SKINNY_SPLIT_KINDS, SKINNY_SPLIT_SHAPES)),
                    # x's f16 form handed over (CudaForward's fp8_x_f16; one column tile)
                    # (and x's sums of squares: _xf16sq, _xf16sqout; its fp8_x_sumsq)
                    *(f"blink_skinny_{kind}_fp8_xf16{sq}{out}_{a}x1{split}"
                      for kind, out in (("linear", ""), ("linear", "out"),
                                        ("linear_norm", ""), ("qkv_rope_norm", ""))
                      for sq in ("", "sq") for a in (1, 2) for split in ("", "_k2")
                      if not (split and (a == 2 or kind == "linear_norm"))),
                    # bf16 weights writing the next FP8 projection's f16 form (out only)
                    *(f"blink_skinny_linear_xf16{sq}out_{a}x1{split}" for sq in ("", "sq")
                      for a in (1, 2) for split in ("", "_k2") if not (split and a == 2)),
                    "blink_skinny_linear_norm_xf16out_2x1",
                    "blink_quantize_rows", "blink_rms_norm_fp8", "blink_silu_mul_fp8",
                    "blink_tile_weights_fp8")
    # FP8 skinny kernels: decode-sized steps only (the FP8 GEMMs take larger ones), and whole
    # 64-k steps (gemv.cuh Fp8Weights)
    SKINNY_FP8_MAX_ROWS = 16
    # The FP8 skinny kernels that take x's f16 form (gemv.cuh kXF16): one column tile
    SKINNY_X_F16_MAX_ROWS = 8
    # ... and x's sums of squares in parts of 16 features (gemv.cuh kGemvMaxSquareParts)
    SKINNY_SQUARE_PARTS_MAX = 512
    SKINNY_FP8_K_ALIGN = engine_layout.FP8_K_ALIGN

    def __init__(self, head_dim: int, device: int = 0, programmatic_launch: bool = True,
                 held_sms: int = 0, sm_count_target: int | None = None, kv_fp8: bool = False):
        """programmatic_launch: launch every kernel with programmatic stream serialization
        (each may start while its predecessor runs and waits for it in-kernel; utils.cuh
        AwaitPriorKernel). False: plain launches, the comparison bench_decode --no-pdl makes.
        held_sms: SMs another kernel holds while these kernels run (the scheduler kernel's
        CTA); sm_count_target: the SMs grids are sized for (sm_count), by default the device's
        less held_sms, 0 all the device's. kv_fp8: the module for an E4M3 KV cache
        (csrc/kv_cache.cuh; head dims 64 and 128)."""
        if head_dim not in engine_layout.HEAD_DIMS:
            raise ValueError(f"head_dim {head_dim} is not supported "
                             f"(needs a multiple of 16 in [16, 256])")
        if kv_fp8 and head_dim not in engine_layout.FP8_KV_HEAD_DIMS:
            raise ValueError(f"--kv-cache-dtype fp8 needs head_dim 64 or 128 (the attention "
                             f"kernel's mma.sync paths), not {head_dim}")
        self.context = primary_context()  # initializes the driver
        self.device = check(driver.cuDeviceGet(device))
        major = device_attribute("COMPUTE_CAPABILITY_MAJOR", device)
        minor = device_attribute("COMPUTE_CAPABILITY_MINOR", device)
        self.device_sm_count = device_attribute("MULTIPROCESSOR_COUNT", device)
        if not 0 <= held_sms < self.device_sm_count:
            raise ValueError(f"held_sms {held_sms} not in [0, {self.device_sm_count})")
        self.held_sms = held_sms
        self.sm_count = (self.device_sm_count - held_sms if sm_count_target is None
                         else sm_count_target or self.device_sm_count)
        if not 1 <= self.sm_count <= self.device_sm_count:
            raise ValueError(f"sm_count_target {sm_count_target} not in [0, "
                             f"{self.device_sm_count}]")
        if major < 8:
            raise CudaError(f"compute capability {major}.{minor}: bf16 tensor cores need >= 8.0")
        self.programmatic_launch = programmatic_launch and major >= 9  # PDL needs sm_90
        self.compute_capability = (major, minor)
        self.arch = f"{major}{minor}" + ("a" if (major, minor) == (9, 0) else "")
        refusal = fp8_refusal(None, "fp8" if kv_fp8 else "auto", (major, minor))
        if refusal is not None:
            raise CudaError(refusal)
        defines = {"BLINK_HEAD_DIM": head_dim, **({"BLINK_KV_FP8": 1} if kv_fp8 else {})}
        self._image = np.frombuffer(nvcc_cubin(CSRC / "forward_kernels.cu", arch=self.arch,
                                               defines=defines), np.uint8)
        self.module = check(driver.cuModuleLoadData(self._image.ctypes.data), "cuModuleLoadData")
        self.fn = {name: check(driver.cuModuleGetFunction(self.module, name.encode()), name)
                   for name in self.ENTRY_POINTS}
        self.head_dim = self._constant("blink_head_dim")
        self.kv_fp8 = bool(self._constant("blink_kv_fp8"))
        if self.kv_fp8 != kv_fp8:
            raise CudaError(f"module built for kv_fp8 {self.kv_fp8}, wanted {kv_fp8}")
        self.rope_threads = self._constant("blink_rope_threads")
        self.attention_threads = self._constant("blink_attention_threads")
        self.attention_rows = self._constant("blink_attention_rows")
        self.attention_smem = self._constant("blink_attention_smem_bytes")
        self.attention_small_rows = self._constant("blink_attention_small_rows")
        self.attention_small_smem = self._constant("blink_attention_small_smem_bytes")
        self.attention_wide_threads = self._constant("blink_attention_wide_threads")
        self.attention_wide_smem = self._constant("blink_attention_wide_smem_bytes")
        self.attention_wgmma_threads = self._constant("blink_attention_wgmma_threads")
        self.attention_wgmma_rows = self._constant("blink_attention_wgmma_rows")
        self.attention_wgmma_smem = self._constant("blink_attention_wgmma_smem_bytes")
        self.attention_wgmma_available = bool(self._constant("blink_attention_wgmma_available"))
        self.sample_threads = self._constant("blink_sample_threads")
        self.gemv_threads = self._constant("blink_gemv_threads")
        self.attention_max_splits = self._constant("blink_attention_max_splits")
        self.attention_step_keys = self._constant("blink_attention_step_keys")
        self.splitk_threads = self._constant("blink_splitk_threads")
        self.splitk_rows = self._constant("blink_splitk_rows")
        self.splitk_cols = self._constant("blink_splitk_cols")
        self.splitk_chunk_align = self._constant("blink_splitk_chunk_align")
        self.splitk_max_chunk = self._constant("blink_splitk_max_chunk")
        self.rowblock_chunk = self._constant("blink_rowblock_chunk")
        self.rowblock_smem = self._constant("blink_rowblock_smem_bytes")
        # dynamic shared memory of each chunk size (a multiple of splitk_chunk_align)
        self.splitk_smem = dict(zip(
            range(self.splitk_chunk_align, self.splitk_max_chunk + 1, self.splitk_chunk_align),
            self._constant("blink_splitk_smem_bytes", self.splitk_max_chunk
                           // self.splitk_chunk_align)))
        if self.head_dim != head_dim:
            raise CudaError(f"module built for head_dim {self.head_dim}, wanted {head_dim}")
        # each attention kernel's (threads, dynamic shared memory), and the CTAs of it one SM
        # holds (registers and shared memory decide)
        self.attention_launch: dict[str, tuple[int, int]] = {}
        self.attention_ctas_per_sm: dict[str, int] = {}
        for small, wide, wgmma, roomy, threads, smem in (
                (False, False, False, False, self.attention_threads, self.attention_smem),
                (True, False, False, False, self.attention_threads, self.attention_small_smem),
                (True, True, False, False, self.attention_wide_threads, self.attention_wide_smem),
                (False, False, True, False, self.attention_wgmma_threads,
                 self.attention_wgmma_smem),
                (False, False, False, True, self.attention_threads, self.attention_smem)):
            for block_size in (self.attention_step_keys, 1):  # one of each block layout
                name = self.attention_kernel(small, block_size, wide, wgmma, roomy)
                check(driver.cuFuncSetAttribute(
                    self.fn[name],
                    driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    smem), f"cuFuncSetAttribute({name} smem)")
                self.attention_launch[name] = threads, smem
                self.attention_ctas_per_sm[name] = check(
                    driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(
                        self.fn[name], threads, smem), f"occupancy of {name}")
        max_smem = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        for cluster in self.X_SLAB_CLUSTERS:
            for base, smem in (("blink_splitk_add_linear", max(self.splitk_smem.values())),
                               ("blink_rowblock_silu_mul", self.rowblock_smem)):
                name = self._clustered(base, cluster)
                check(driver.cuFuncSetAttribute(self.fn[name], max_smem, smem),
                      f"cuFuncSetAttribute({name} smem)")
        # bench_decode --marginal launches it in place of any op's kernels, their shared memory
        check(driver.cuFuncSetAttribute(
            self.fn["blink_pdl_noop"], max_smem,
            device_attribute("MAX_SHARED_MEMORY_PER_BLOCK_OPTIN", device)),
            "cuFuncSetAttribute(blink_pdl_noop smem)")
        self.chain_smem = self._constant("blink_chain_smem_bytes")  # the most it takes
        self.chain_ring_bytes = self._constant("blink_chain_ring_bytes")  # then two of x
        self.chain_max_k = self._constant("blink_chain_max_k")
        self.chain_counters_words = self._constant("blink_chain_counters_bytes") // 4
        # the consumer warps, a producer, a loader and two epilogue warps
        self.chain_threads = self._constant("blink_chain_threads")
        if self._constant("blink_chain_projection_bytes") != ctypes.sizeof(ChainProjection):
            raise CudaError("blink::ChainProjection and cuda_forward.ChainProjection disagree")
        chain_entries = ("blink_projection_chain", "blink_projection_chain_fp8")  # bf16, E4M3
        for name in chain_entries:
            check(driver.cuFuncSetAttribute(self.fn[name], max_smem, self.chain_smem),
                  f"cuFuncSetAttribute({name} smem)")
        # the chain's CTAs an SM (one, by its shared memory): the fewer of its two entries'
        self.chain_ctas_per_sm = min(
            check(driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(
                self.fn[name], self.chain_threads, self.chain_smem), f"occupancy of {name}")
            for name in chain_entries)
        # the K-splitting skinny kernels' CTAs an SM (their registers decide: skinny_splits)
        self.skinny_split_ctas_per_sm = {
            name: check(driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(
                self.fn[name], self.gemv_threads, 0), f"occupancy of {name}")
            for name in self.ENTRY_POINTS if name.startswith("blink_skinny_") and
            name.endswith("_k2")}
        name = "blink_splitk_add_linear"
        # its CTAs an SM for each chunk size (the chunk of x in shared memory may decide)
        self.splitk_ctas_per_sm = {
            chunk: check(driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(
                self.fn[name], self.splitk_threads, smem), f"occupancy of {name}")
            for chunk, smem in self.splitk_smem.items()}

    def _constant(self, name: str, count: int | None = None):
        """A uint32 the module defines for the host, or its array of `count` of them."""
        ptr, size = check(driver.cuModuleGetGlobal(self.module, name.encode()), name)
        buf = np.zeros(count or 1, np.uint32)
        if size != buf.nbytes:
            raise CudaError(f"{name}: {size} bytes in the module, expected {buf.nbytes}")
        check(driver.cuMemcpyDtoH(buf.ctypes.data, ptr, buf.nbytes), name)
        return [int(v) for v in buf] if count else int(buf[0])

    def launch(self, name: str, grid, block, args, stream, smem: int = 0) -> None:
        grid = tuple(grid) + (1,) * (3 - len(grid))
        block = tuple(block) + (1,) * (3 - len(block))
        params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
        if not self.programmatic_launch:
            check(driver.cuLaunchKernel(self.fn[name], *grid, *block, smem, stream,
                                        ctypes.addressof(params), 0), name)
            return
        config = driver.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = grid
        config.blockDimX, config.blockDimY, config.blockDimZ = block
        config.sharedMemBytes, config.hStream = smem, stream
        attr = driver.CUlaunchAttribute()
        attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        config.attrs, config.numAttrs = [attr], 1
        check(driver.cuLaunchKernelEx(config, self.fn[name], ctypes.addressof(params), 0), name)

    @staticmethod
    def _need(ok: bool, what: str) -> None:
        if not ok:
            raise ValueError(what)

    # rows: the grid's row count (the bucket, or the logit-row capacity); each kernel skips the
    # rows at or past the live count in BatchDesc.

    def embedding(self, stream, rows, desc, token_ids, embed, x, hidden, vocab, x_shadow=0,
                  x_f16=0, norm_w=0, x_sumsq=0):
        # embed: [vocab, hidden] bf16 -> x: [rows, hidden] f32 (and x_shadow, bf16, if given;
        # and x_f16, f16, if given: its f16 form times norm_w [hidden] bf16, the first layer's
        # input RMSNorm weight, as the FP8 skinny qkv kernel takes it; with it x_sumsq, if
        # given: [rows, hidden / 16] f32, x's sums of squares in parts, csrc/gemv.cuh
        # GemvSquareParts)
        self._need(hidden % 8 == 0, f"hidden {hidden} must be a multiple of 8")
        self._need(bool(x_f16) == bool(norm_w), "x's f16 form comes with the norm's weight")
        self._need(not x_sumsq or (x_f16 and hidden % 16 == 0),
                   "x's sums of squares come with its f16 form, hidden a multiple of 16")
        self.launch("blink_embedding_xf16" if x_f16 else "blink_embedding", (rows,), (256,),
                    [_ptr(desc), _ptr(token_ids), _ptr(embed), _ptr(x), _ptr(x_shadow),
                     _i32(hidden), _i32(vocab)]
                    + ([_ptr(x_f16), _ptr(norm_w), _ptr(x_sumsq)] if x_f16 else []), stream)

    def rms_norm(self, stream, rows, desc, x, weight, out, hidden, eps, *, bias=0, gather=0,
                 max_rows=None, release_next=False, x_f16=0):
        # x: [max_rows, hidden] f32 (bias added in place); out: [rows, hidden] bf16.
        # release_next: the next kernel launches once this one's CTAs have waited for theirs.
        # x_f16: out's f16 form too, [rows, hidden] f16, as the FP8 skinny kernels take it
        self._need(hidden % 8 == 0, f"hidden {hidden} must be a multiple of 8")
        self.launch("blink_rms_norm_xf16" if x_f16 else "blink_rms_norm", (rows,), (256,),
                    [_ptr(desc), _ptr(gather), _i32(max_rows or rows), _ptr(x), _ptr(bias),
                     _ptr(weight), _ptr(out), _i32(hidden), _f32(eps),
                     _i32(int(release_next))] + ([_ptr(x_f16)] if x_f16 else []), stream)

    def rope_kv_write(self, stream, rows, desc, positions, token_seq, block_tables,
                      max_blocks_per_seq, qkv, qkv_bias, q_norm, k_norm, eps, inv_freq,
                      num_heads, num_kv_heads, q_out, k_cache, v_cache, block_size, num_blocks,
                      kv_scales=0, kv_amax=0, release_next=False):
        """kv_scales: an E4M3 cache's (the layer's [2, num_kv_heads] float32: keys', values');
        kv_amax: as those, where the calibration pass notes each head's largest |value|.
        release_next: attention, the next kernel, launches once this one's CTAs have started."""
        self._need(bool(q_norm) == bool(k_norm), "q_norm and k_norm come together")
        self._kv_checks(kv_scales, kv_amax)
        warps = self.rope_threads // 32
        head_groups = -(-(num_heads + 2 * num_kv_heads) // warps)  # one head per warp
        self.launch("blink_rope_kv_write", (rows, head_groups), (self.rope_threads,),
                    [_ptr(desc), _ptr(positions), _ptr(token_seq), _ptr(block_tables),
                     _i32(max_blocks_per_seq), _ptr(qkv), _ptr(qkv_bias), _ptr(q_norm),
                     _ptr(k_norm), _f32(eps), _ptr(inv_freq), _i32(num_heads),
                     _i32(num_kv_heads), _ptr(q_out), _ptr(k_cache), _ptr(v_cache),
                     _i32(block_size), _i32(num_blocks), _ptr(kv_scales), _ptr(kv_amax),
                     _i32(int(release_next))], stream)

    def attention(self, stream, rows, desc, positions, token_seq, block_tables,
                  max_blocks_per_seq, q, k_cache, v_cache, block_size, num_heads, num_kv_heads,
                  scale, out, num_splits=1, partial_out=0, partial_stats=0, tile_sems=0,
                  small=False, wide=False, wgmma=False, roomy=False, decode_min_keys=0,
                  release_next=False, kv_scales=0, split_stride=None):
        """One kernel: decode tokens with at least decode_min_keys keys on the flash-decoding
        path, every other token in tensor-core query tiles.
        num_splits > 1 lets up to that many CTAs share a tile's (or a decode token's, as many as
        the kernel's DecodeChunksPerSplit finds fastest) keys; they meet in partial_out:
        [rows, num_heads, split_stride, D] f32, partial_stats: [rows, num_heads, split_stride,
        2] f32 and tile_sems: [rows, num_kv_heads] u32 (zero before the first launch; each use
        leaves it zero). split_stride (default num_splits, at most attention_max_splits) above
        num_splits lets a query tile's keys split over its other tokens' CTAs too, up to
        split_stride splits (csrc/attention_tiles.cuh FindQueryTile). small: the tile variant
        with attention_small_rows query rows per CTA (decode-sized buckets); wide (with small):
        its kernel with attention_wide_threads threads a CTA (csrc/attention_common.cuh
        kAttnWideWarps). wgmma: the kernel whose query tiles of attention_wgmma_rows rows run
        on wgmma (prefill-sized buckets; kAttnWgmmaRows). roomy: the large tiles' kernel
        compiled for fewer CTAs an SM, more registers a thread (csrc/attention_common.cuh
        kAttnRoomyMinCtas). kv_scales: an E4M3 cache's (the layer's, as rope_kv_write takes
        them)."""
        self._kv_checks(kv_scales, 0)
        group = num_heads // num_kv_heads
        max_rows = self.attention_tile_rows(small, wgmma)
        self._need(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads")
        self._need(group <= max_rows, f"GQA group {group} > {max_rows} rows per CTA")
        self._need(1 <= num_splits <= self.attention_max_splits,
                   f"num_splits {num_splits} not in [1, {self.attention_max_splits}]")
        split_stride = num_splits if split_stride is None else split_stride
        self._need(num_splits <= split_stride <= self.attention_max_splits,
                   f"split_stride {split_stride} not in [num_splits {num_splits}, "
                   f"{self.attention_max_splits}]")
        self._need(split_stride == 1 or (partial_out and partial_stats and tile_sems),
                   "splits need the partial-output workspace and tile counters")
        self._need(small or not wide, "the wide attention kernel has the small query tiles")
        self._need(not (small and wgmma), "the wgmma attention kernel has the large query tiles")
        self._need(not (roomy and (small or wgmma)),
                   "the roomy attention kernel has the large mma.sync query tiles")
        self._need(self.attention_wgmma_available or not wgmma,
                   f"the wgmma attention kernel needs sm_90a and head dim 64 or 128 (this "
                   f"module: sm_{self.arch}, head dim {self.head_dim})")
        name = self.attention_kernel(small, block_size, wide, wgmma, roomy)
        threads, smem = self.attention_launch[name]
        self.launch(name, (rows, num_kv_heads, num_splits), (threads,),
                    [_ptr(desc), _ptr(positions), _ptr(token_seq), _ptr(block_tables),
                     _i32(max_blocks_per_seq), _ptr(q), _ptr(k_cache), _ptr(v_cache),
                     _i32(block_size), _i32(num_heads), _i32(num_kv_heads), _f32(scale),
                     _ptr(out), _i32(num_splits), _i32(split_stride), _ptr(partial_out),
                     _ptr(partial_stats), _ptr(tile_sems), _i32(min(decode_min_keys, 2 ** 31 - 1)),
                     _i32(self.attention_slots(small, block_size, wide, wgmma, roomy)),
                     _i32(int(release_next)), _ptr(kv_scales)],
                    stream, smem=smem)

    def attention_tile_rows(self, small: bool = False, wgmma: bool = False) -> int:
        """Query rows a CTA's tile holds in the small, the wgmma or the large kernel."""
        return (self.attention_small_rows if small else
                self.attention_wgmma_rows if wgmma else self.attention_rows)

    def attention_spread_stride(self, num_splits: int, group: int, small: bool = False,
                                wgmma: bool = False) -> int:
        """attention's split_stride where a query tile's keys also split over its other
        tokens' CTAs: num_splits x the tile's tokens (GQA group `group`), at most
        attention_max_splits."""
        tile_tokens = max(1, self.attention_tile_rows(small, wgmma) // group)
        return min(self.attention_max_splits, num_splits * tile_tokens)

    def attention_kernel(self, small: bool, block_size: int, wide: bool = False,
                         wgmma: bool = False, roomy: bool = False) -> str:
        """The attention kernel for query tiles of attention_small_rows (small),
        attention_wgmma_rows on wgmma (wgmma) or attention_rows, with attention_wide_threads
        threads a CTA (wide), attention_wgmma_threads (wgmma) or attention_threads (roomy:
        the large tiles' kernel compiled for fewer CTAs an SM), and a KV cache of block_size
        rows a block: the decode path of block sizes that are multiples of
        attention_step_keys (16) reads a warp step's keys from one block; the others'
        (_any_block) look up each key's block (csrc/attention.cuh AttentionCta)."""
        return ("blink_paged_attention" + ("_small" if small else "") + ("_wide" if wide else "")
                + ("_wgmma" if wgmma else "") + ("_roomy" if roomy else "")
                + ("" if block_size % self.attention_step_keys == 0 else "_any_block"))

    def attention_slots(self, small: bool, block_size: int, wide: bool = False,
                        wgmma: bool = False, roomy: bool = False) -> int:
        """CTAs of that attention kernel the GPU holds at once."""
        name = self.attention_kernel(small, block_size, wide, wgmma, roomy)
        return self.attention_ctas_per_sm[name] * self.sm_count

    @classmethod
    def skinny_fits(cls, rows: int, in_features: int, out_features: int,
                    fp8: bool = False) -> bool:
        """Whether skinny_linear can take this shape (in either weight layout; fp8: FP8
        weights, up to SKINNY_FP8_MAX_ROWS rows)."""
        if fp8:
            return (1 <= rows <= cls.SKINNY_FP8_MAX_ROWS
                    and in_features % cls.SKINNY_FP8_K_ALIGN == 0
                    and cls.tiled_elements(out_features, in_features, 1) < 2 ** 31)
        return (1 <= rows <= cls.SKINNY_MAX_ROWS and in_features % 32 == 0
                and cls.tiled_elements(out_features, in_features) < 2 ** 31)

    # Bytes after each 16-row tile of the tiled layout (1 KB). Without it a tile of K = 4,096
    # columns is 128 KB, and the 8 concurrent tile streams of a split-K or row-block CTA start
    # a power of two apart: a read-only probe of that pattern streamed 4.15 TB/s on 8B's
    # gate|up, 4.51 with the pad (the skinny kernel's pattern: 4.53 either way;
    # docs/performance.md round 8).
    TILE_PAD_BYTES = 1024

    @classmethod
    def tile_stride(cls, cols: int, itemsize: int = 2) -> int:
        """Elements from one 16-row tile of a tiled weight of `cols` columns to the next
        (itemsize 2: bf16; 1: E4M3 codes)."""
        return 16 * cols + cls.TILE_PAD_BYTES // itemsize

    @classmethod
    def tiled_elements(cls, rows: int, cols: int, itemsize: int = 2) -> int:
        """A [rows, cols] weight's size in the tiled layout: whole 16-row tiles, each padded."""
        return -(-rows // 16) * cls.tile_stride(cols, itemsize)

    def tile_weights(self, stream, w, tiled, rows: int, cols: int, fp8: bool = False) -> None:
        """tiled = w [rows, cols] row-major in the skinny kernels' tiled layout (gemv.cuh:
        16-row tiles of 1 KB steps, 32 columns of bf16 or 64 of E4M3 codes (fp8), the tiles
        tile_stride(cols) elements apart, the last tile's rows and the pads zeros); tiled holds
        tiled_elements(rows, cols) elements."""
        itemsize = 1 if fp8 else 2
        align = 64 if fp8 else 32
        self._need(cols % align == 0, f"tiled weights need columns % {align} == 0, got {cols}")
        pieces = self.tiled_elements(rows, cols, itemsize) * itemsize // 16
        self.launch("blink_tile_weights_fp8" if fp8 else "blink_tile_weights",
                    (min(65535, -(-pieces // 256)),), (256,),
                    [_ptr(w), _ptr(tiled), _i32(rows), _i32(cols),
                     _u32(self.tile_stride(cols, itemsize)), ctypes.c_uint64(pieces)], stream)

    # Where the skinny kernel beats cuBLAS (H200, bench_decode, Llama-3.1-8B and 3.2-1B shapes):
    # at up to 16 token rows, for every projection whose output it fuses (the residual add,
    # SiLU * up) or whose weights it reads in the tiled layout (CudaForward's
    # decode_weight_copy), and for plain row-major ones of up to 32 MiB, where cuBLAS's fixed
    # cost per call dominates; cuBLAS streams large row-major weights faster. Steps at 16 rows,
    # tiled weights, 2026-12-01: 8B 5.26 -> 4.90 ms, 1B 1.30 -> 1.12 with the skinny kernel; at
    # 32 rows it loses on 8B (5.65 -> 5.84 ms even with the norms folded in), where it re-reads
    # the activations once per 16 weight rows, and wins only on 1B (1.39 -> 1.32).
    SKINNY_PREFERRED_ROWS = 16
    SKINNY_PREFERRED_PLAIN_BYTES = 32 << 20

    @classmethod
    def skinny_preferred(cls, rows: int, in_features: int, out_features: int,
                         any_size: bool) -> bool:
        """Whether the forward pass should use skinny_linear rather than cuBLAS; any_size: the
        output mode is SKINNY_F32_ADD or SKINNY_SILU_MUL, or the weights are tiled."""
        return (cls.skinny_fits(rows, in_features, out_features)
                and rows <= cls.SKINNY_PREFERRED_ROWS
                and (any_size
                     or 2 * in_features * out_features <= cls.SKINNY_PREFERRED_PLAIN_BYTES))

    def _skinny_tiles(self, rows, in_features, out_features, silu, norm, fp8=False):
        self._need(self.skinny_fits(rows, in_features, out_features, fp8),
                   f"skinny linear takes rows <= {self.SKINNY_MAX_ROWS}, in_features % 32 == 0 "
                   f"(FP8 weights: rows <= {self.SKINNY_FP8_MAX_ROWS}, in_features % "
                   f"{self.SKINNY_FP8_K_ALIGN} == 0), got {rows} x {in_features} -> "
                   f"{out_features}")
        self._need(not norm or rows <= self.SKINNY_NORM_MAX_ROWS,
                   f"the RMSNorm-folding skinny linear takes rows <= {self.SKINNY_NORM_MAX_ROWS}")
        self._need(not silu or out_features % 32 == 0, "gate|up rows must be whole 16-row pairs")
        col_tiles = 1 if rows <= 8 else 2 if rows <= 16 else 4
        # two row tiles per CTA when that still leaves ~2 CTAs per SM (the SiLU mode pairs
        # them), or at four column tiles one: each CTA reads all 32 rows of x, so two row tiles
        # halve those reads
        pairs = -(-out_features // 32)
        row_tiles = 2 if silu or pairs >= (self.sm_count if col_tiles == 4 else
                                           2 * self.sm_count) else 1
        # FP8 weights: a 16-row CTA reads half the bytes, so its fixed costs weigh double; two
        # row tiles where one would leave a second, partial wave of CTAs (8B's qkv: 384 CTAs
        # of one tile on 262 slots, their third CTA an SM run after the first two)
        if fp8 and pairs > self.sm_count:
            row_tiles = 2
        return row_tiles, col_tiles

    def skinny_splits(self, kind: str, rows: int, in_features: int, out_features: int,
                      max_row_blocks: int | None = None, fp8: bool = False) -> int:
        """2 where the skinny kernel `kind` (SKINNY_SPLIT_KINDS: a plain projection, or qkv +
        RoPE with the RMSNorm folded in) may split this shape's K across clusters of two CTAs
        (one row tile a CTA, up to 16 rows) and its grid of two CTAs a row block still fits one
        wave (the _k2 entry's CTAs an SM, which its registers decide, times sm_count), or,
        max_row_blocks given, where its row blocks are at most that; else 1. Such a projection
        otherwise leaves SMs at one CTA, too few loads in flight to stream at the memory's
        rate. Measured on the H200 (bench_decode, Llama-3.2-1B, batch 1 at 512 keys): the o
        and down projections (128 row blocks, 256 CTAs at two an SM) 0.806 -> 0.796 ms a step,
        the down projection 10.9 -> 9.9 us; the qkv one (192, 384 CTAs at three an SM) too
        0.786; at 16 rows (384 CTAs at two an SM: two waves) qkv split made the step 5% slower.
        fp8: the _fp8 entries' (FP8 weights)."""
        if kind not in self.SKINNY_SPLIT_KINDS or not self.skinny_fits(rows, in_features,
                                                                       out_features, fp8):
            return 1
        tiles = self._skinny_tiles(rows, in_features, out_features, False, False, fp8)
        if tiles not in self.SKINNY_SPLIT_SHAPES:
            return 1
        blocks = -(-out_features // 16)
        if max_row_blocks is None:
            ctas_per_sm = self.skinny_split_ctas_per_sm[f"blink_skinny_{kind}{_FP8[fp8]}_"
                                                        f"{tiles[0]}x{tiles[1]}_k2"]
            return 2 if 2 * blocks <= ctas_per_sm * self.sm_count else 1
        return 2 if blocks <= max_row_blocks else 1

    def _skinny_split_name(self, name: str, tiles: tuple[int, int], k_splits: int) -> str:
        self._need(k_splits == 1 or (k_splits == 2 and tiles in self.SKINNY_SPLIT_SHAPES),
                   f"K split across {k_splits} CTAs: 1, or 2 for one row tile and up to 16 rows")
        return name + ("_k2" if k_splits == 2 else "")

    def skinny_linear(self, stream, x, w, out, rows, in_features, out_features, mode, *,
                      shadow=0, norm_eps=None, w_tiled=False, k_splits=1, argmax=0,
                      w_scale=0, norm_w=0, x_f16=0, x_f16_out=0, x_f16_norm_w=0, x_sumsq=0,
                      x_sumsq_out=0):
        """out[rows, out_features] (mode: SKINNY_BF16 / _F32 / _F32_ADD) = x[rows, in] @ w^T
        for rows <= SKINNY_MAX_ROWS, w: [out_features, in_features] bf16, all dense. SILU_MUL:
        w is gate|up interleaved in 16-row groups (interleave_gate_up) and
        out[rows, out_features/2] = silu(gate) * up in bf16. F32_ADD with shadow: the sums
        also go to shadow [rows, out_features] as bf16. norm_eps: x is the residual stream's
        bf16 shadow and each row's result is scaled by 1 / sqrt(mean(x^2) + norm_eps) (the
        RMSNorm whose weight is folded into w; rows <= SKINNY_NORM_MAX_ROWS). w_tiled: w is in
        the tiled layout (tile_weights), else row-major. k_splits 2: K split across clusters
        of two CTAs (skinny_splits; not with norm_eps or SILU_MUL). argmax (F32, without
        norm_eps): [rows] u64, zero before; each row's greedy argmax packed (csrc/argmax.cuh)
        folded in, for sample's lm_argmax.
        w_scale: FP8 weights (the _fp8 entries: w holds E4M3 codes, w_scale [out_features]
        float32 their rows' scales; rows <= SKINNY_FP8_MAX_ROWS, in_features % 64 == 0); with
        norm_eps, norm_w [in_features] bf16 is the RMSNorm's weight (not folded into FP8
        weights). FP8 weights, up to SKINNY_X_F16_MAX_ROWS rows: x_f16 [rows, in_features] f16
        is x's f16 form as the kernel's MMAs take it (x times norm_w with norm_eps, times
        1/16: csrc/fp8.cuh Fp8MmaInput), written by the kernel before, so it converts none
        (x is still read for the norm's sum of squares); x_f16_out [rows, out_features] gets
        the next projection's: the shadow's times x_f16_norm_w [out_features] (F32_ADD), or
        the output's (SILU_MUL). (The _xf16 entries: CudaForward's fp8_x_f16.) x_sumsq [rows,
        in_features / 16] f32 (with norm_eps and x_f16): x's sums of squares in parts
        (csrc/gemv.cuh GemvSquareParts), written by the kernel before, so x is not read at all;
        x_sumsq_out [rows, out_features / 16] (F32_ADD with x_f16_out): the shadow's. (The
        _xf16sq entries: CudaForward's fp8_x_sumsq.) bf16 weights take no x_f16 but write
        x_f16_out (and x_sumsq_out) alike, for an FP8 projection after them (the bf16
        _xf16out entries: a projection an FP8 checkpoint keeps in bf16)."""
        silu = mode == SKINNY_SILU_MUL
        fp8 = bool(w_scale)
        given = bool(x_f16 or x_f16_out)
        squares = bool(x_sumsq or x_sumsq_out)
        self._need(not x_sumsq or (norm_eps is not None and x_f16),
                   "x's sums of squares go to a normalizing projection given x's f16 form")
        self._need(not x_sumsq_out or (mode == SKINNY_F32_ADD and x_f16_out
                                       and out_features % 16 == 0),
                   "the shadow's sums of squares come with its f16 form (F32_ADD)")
        self._need(not x_sumsq or in_features // 16 <= self.SKINNY_SQUARE_PARTS_MAX,
                   f"x's sums of squares: in_features up to {16 * self.SKINNY_SQUARE_PARTS_MAX}")
        self._need(not given or ((fp8 or not x_f16) and rows <= self.SKINNY_X_F16_MAX_ROWS),
                   f"x's f16 form: into FP8 weights (bf16 ones only write it), rows <= "
                   f"{self.SKINNY_X_F16_MAX_ROWS}")
        self._need(norm_eps is None or not fp8 or bool(x_f16) == given,
                   "an FP8 normalizing projection hands x's f16 form over only where it takes it")
        self._need(not x_f16_out or (mode == SKINNY_F32_ADD and shadow and x_f16_norm_w)
                   or (silu and not x_f16_norm_w),
                   "the next projection's f16 form comes from the shadow (F32_ADD, times the "
                   "next RMSNorm's weight) or SiLU * up's output")
        self._need(fp8 == bool(norm_w) or norm_eps is None,
                   "FP8 weights take the RMSNorm's weight (norm_w) where they normalize, bf16 "
                   "ones have it folded in")
        row_tiles, col_tiles = self._skinny_tiles(rows, in_features, out_features, silu,
                                                  norm_eps is not None, fp8)
        ldo = out_features // 2 if silu else out_features
        args = [_ptr(x), _i32(in_features), _i32(rows), _ptr(w),
                _u32(self.tile_stride(in_features, 1 if fp8 else 2) if w_tiled else 0),
                _i32(out_features), _i32(in_features), _ptr(out), _i32(ldo), _i32(mode)]
        self._need(not argmax or (mode == SKINNY_F32 and norm_eps is None),
                   "the argmax comes with fp32 outputs, without the RMSNorm folded in")
        # _xf16: x's f16 form in (and maybe out); _xf16out: only out; "sq": with the squares
        infix = _FP8[fp8] + ("_xf16" + "sq" * squares + "out" * (not x_f16) if given else "")
        if norm_eps is None:
            name = f"blink_skinny_linear{infix}_{row_tiles}x{col_tiles}"
            args = args + [_ptr(shadow), _ptr(argmax)] + ([_ptr(w_scale)] if fp8 else [])
            if given:
                args += [_ptr(x_f16), _ptr(x_f16_out), _ptr(x_f16_norm_w), _ptr(x_sumsq_out)]
            name = self._skinny_split_name(name, (row_tiles, col_tiles), k_splits)
        else:
            self._need(not shadow, "a normalizing projection writes no shadow")
            self._need(k_splits == 1, "a normalizing projection takes no K split")
            name = f"blink_skinny_linear_norm{infix}_{row_tiles}x{col_tiles}"
            args = args + [_f32(norm_eps)] + ([_ptr(w_scale), _ptr(norm_w)] if fp8 else [])
            if given:
                args += [_ptr(x_f16), _ptr(x_f16_out), _ptr(x_sumsq)]
        self.launch(name, (k_splits * -(-out_features // (16 * row_tiles)),),
                    (self.gemv_threads,), args, stream)

    # The projection chain wins at batch 1 where a layer's o, gate|up and down weights come to
    # at least this many bytes (bf16): its ring saves a drain and a refill of the memory pipe
    # at two kernel boundaries, and costs its loader's polls and copies of x, a few round trips
    # a phase, which weigh more the smaller the projections. Measured on the H200
    # (deploy/chain_rule_check.sh, batch 1 at 512 keys, ms a step, chain against none; docs/
    # performance.md round 22): Llama-3.1-8B, 386 MB a layer, 3.795-3.806 against 3.826;
    # Qwen3-4B, 170 MB, 2.627 against 2.527; Llama-3.2-3B, 170 MB, 1.938 against 1.862;
    # Llama-3.2-1B, 109 MB, 0.814 against 0.767. The line sits between 170 and 386 MB.
    CHAIN_MIN_LAYER_BYTES = 256 << 20
    # With E4M3 weights (the _fp8 entry): none, the chain is never on by default. Before its
    # epilogue warp it lost on every shape measured (deploy/chain_rule_check.sh, docs/
    # performance.md round 23; ms a step, chain against none): Llama-3.1-8B, 193 MB of codes
    # a layer, 2.666 against 2.455; Qwen3-4B 2.182 against 1.928; Llama-3.2-3B 1.530 against
    # 1.322; Llama-3.2-1B 0.689 against 0.591. With it (round 26): 8B 2.399-2.401 against
    # 2.406, even; 1B 0.654-0.656 against 0.560. The smaller shapes were not run again.
    CHAIN_MIN_LAYER_BYTES_FP8: int | None = None

    # The skinny qkv projection lets attention launch at its start (CudaForward
    # qkv_release_early) by default where a layer's projection weights, as stored
    # (roofline.layer_projection_weights), come to at most this many bytes: attention's CTAs
    # then load their first keys during the qkv projection, which pays where the kernels are
    # short and latency decides, and may cost where they stream long (the o projection, which
    # attention releases at its start, launches early too and streams beside qkv).
    # bench_decode at 512 keys, ms a step, off against on, in two orders or alternating in one
    # call (docs/performance.md round 41; one H100 unless said):
    #   Llama-3.2-1B, 58 MiB of E4M3 codes a layer: batch 1 0.643 -> 0.635-0.636 (H200: 0.531-
    #     0.533 -> 0.525-0.527; round 38's H200: 0.533-0.534 -> 0.523-0.527), 16 rows 0.826 ->
    #     0.821; its 116 MiB of bf16: batch 1 even (0.991-0.998 -> 0.990-0.999), 8 rows 1.065 ->
    #     1.059-1.060, 16 rows 1.154-1.157 -> 1.132-1.134, 32 rows 1.457-1.458 -> 1.449-1.453;
    #   Llama-3.2-3B, 96 MiB of E4M3 codes: 1.472-1.475 -> 1.469-1.472; 192 MiB of bf16: 2.427
    #     -> 2.408-2.409 (left off by the line: no line between 192 and 208 MiB is supported);
    #   Llama-3.1-8B, 208 MiB of E4M3 codes: batch 1 2.923 -> 2.935-2.943 (round 38's H200:
    #     2.318-2.323 -> 2.324; round 41's H200 the other way, 2.264-2.269 -> 2.238-2.259): its
    #     one-stream step (issue 43's target) stays as it was; 416 MiB of bf16: 5.163-5.167 ->
    #     5.168, 8 rows 5.441-5.443 -> 5.413.
    # Not timed: Qwen2 shapes (their qkv projection releases too; Qwen3's, before its q/k
    # norms, releases nothing either way).
    QKV_RELEASE_EARLY_MAX_LAYER_BYTES = 128 << 20

    @staticmethod
    def chain_layer_bytes(hidden: int, inter: int, q_size: int, fp8: bool = False) -> int:
        """The bytes of a layer's o, gate|up and down weights (bf16, or fp8: E4M3 codes): what
        one chain launch streams."""
        return (1 if fp8 else 2) * (hidden * q_size + 2 * inter * hidden + hidden * inter)

    def chain_preferred(self, hidden: int, inter: int, q_size: int, fp8: bool = False) -> bool:
        """Whether one-token steps should run a layer of these sizes on projection_chain (it
        takes them, and they are at least CHAIN_MIN_LAYER_BYTES, or with fp8 (E4M3 weights)
        CHAIN_MIN_LAYER_BYTES_FP8: None, never)."""
        line = self.CHAIN_MIN_LAYER_BYTES_FP8 if fp8 else self.CHAIN_MIN_LAYER_BYTES
        return (line is not None and self.chain_fits(hidden, inter, q_size, fp8)
                and self.chain_layer_bytes(hidden, inter, q_size, fp8) >= line)

    def chain_fits(self, hidden: int, inter: int, q_size: int, fp8: bool = False) -> bool:
        """Whether projection_chain takes a layer of these sizes (and fits an SM); fp8: with
        E4M3 weights (K a multiple of SKINNY_FP8_K_ALIGN, as the FP8 skinny kernels')."""
        align, itemsize = (self.SKINNY_FP8_K_ALIGN, 1) if fp8 else (32, 2)
        return (self.chain_ctas_per_sm >= 1 and hidden % align == 0 and inter % align == 0
                and q_size % align == 0 and max(hidden, inter, q_size) <= self.chain_max_k
                and all(self.tiled_elements(n, k, itemsize) < 2 ** 31
                        for n, k in ((hidden, q_size), (2 * inter, hidden), (hidden, inter))))

    def projection_chain(self, stream, attn, wo, x, x_shadow, wgu, act, wdown, hidden, inter,
                         q_size, eps, counters, grid: int | None = None, *,
                         w_scales: tuple[int, int, int] | None = None, norm_w=0) -> None:
        """One token row's projections after attention, in one persistent kernel
        (csrc/gemv_chain.cuh): x += attn @ wo^T (x_shadow its bf16 copy); act = silu(gate) * up
        of x_shadow's RMSNorm @ wgu^T (bf16: the norm's weight folded into wgu; gate|up
        interleaved); x += act @ wdown^T (and x_shadow). Every weight tiled (tile_weights).
        counters: chain_counters_words u32, zero before the first launch, left zero by each.
        grid: by default one CTA an SM but the held ones; any count gives the same sums (CTAs
        take row blocks as they go, and none waits for a CTA that has not started).
        w_scales: E4M3 weights (the _fp8 entry): the three weights' rows' scales (o, gate|up,
        down), and norm_w the RMSNorm's weight (not folded into the codes), as the FP8 skinny
        kernels take them."""
        fp8 = w_scales is not None
        self._need(self.chain_fits(hidden, inter, q_size, fp8),
                   f"the projection chain takes sizes that are multiples of "
                   f"{self.SKINNY_FP8_K_ALIGN if fp8 else 32} up to {self.chain_max_k}, got "
                   f"hidden {hidden}, intermediate {inter}, q {q_size}")
        self._need(not fp8 or (len(w_scales) == 3 and all(w_scales) and norm_w),
                   "E4M3 weights need their three scales and the RMSNorm's weight")
        self._need(fp8 or not norm_w, "bf16 weights have the RMSNorm's weight folded in")
        scales = w_scales or (0, 0, 0)
        x_stride = max(hidden, inter, q_size)  # two such buffers of x in shared memory

        def proj(x_in, w, n, k, out, shadow, scale, norm=0):
            return ChainProjection(int(x_in), int(w), self.tile_stride(k, 1 if fp8 else 2), n,
                                   k, int(out), int(shadow), int(scale), int(norm))
        chain = (ChainProjection * 3)(
            proj(attn, wo, hidden, q_size, x, x_shadow, scales[0]),
            proj(x_shadow, wgu, 2 * inter, hidden, act, 0, scales[1], norm_w),
            proj(act, wdown, hidden, inter, x, x_shadow, scales[2]))
        self.launch(f"blink_projection_chain{_FP8[fp8]}",
                    (grid or self.device_sm_count - self.held_sms,),
                    (self.chain_threads,), [chain, _f32(eps), _i32(x_stride), _ptr(counters)],
                    stream, smem=self.chain_ring_bytes + 2 * 2 * x_stride)

    def skinny_qkv_rope(self, stream, rows, desc, x, w, hidden, eps, positions, token_seq,
                        block_tables, max_blocks_per_seq, qkv_bias, inv_freq, num_heads,
                        num_kv_heads, q_out, k_cache, v_cache, block_size, num_blocks, *,
                        w_tiled=False, k_splits=1, w_scale=0, norm_w=0, kv_scales=0,
                        kv_amax=0, release_next=False, x_f16=0, x_sumsq=0):
        """The qkv projection with RoPE + KV write as its epilogue (rope_kv_write's outputs,
        without per-head q/k norms): with its input RMSNorm folded in (as skinny_linear with
        norm_eps; rows <= SKINNY_NORM_MAX_ROWS), or, eps None, of an input already normalized
        (17 to SKINNY_MAX_ROWS rows). w: [(num_heads + 2 num_kv_heads) * head_dim, hidden], q
        and k rows in the RoPE pair layout (rope_pair_order), row-major or tiled (w_tiled);
        qkv_bias likewise or 0. k_splits 2: K split across clusters of two CTAs
        (skinny_splits; with the RMSNorm folded in). w_scale, norm_w: FP8 weights, as
        skinny_linear takes them (with the RMSNorm folded in). kv_scales, kv_amax: an E4M3
        cache's, as rope_kv_write takes them. release_next: the next kernel (attention) launches
        once this one's CTAs have started, not once their weights are read. x_f16: x's f16
        form, as skinny_linear takes it (FP8 weights, up to SKINNY_X_F16_MAX_ROWS rows), and
        x_sumsq with it: x's sums of squares in parts, as skinny_linear takes them."""
        out_features = (num_heads + 2 * num_kv_heads) * self.head_dim
        norm = eps is not None
        fp8 = bool(w_scale)
        self._need(not x_f16 or (fp8 and rows <= self.SKINNY_X_F16_MAX_ROWS),
                   f"x's f16 form: FP8 weights, rows <= {self.SKINNY_X_F16_MAX_ROWS}")
        self._need(not fp8 or (norm and norm_w), "FP8 weights: the qkv projection with its "
                   "RMSNorm folded in, given the norm's weight")
        row_tiles, col_tiles = self._skinny_tiles(rows, hidden, out_features, False, norm, fp8)
        self._need(norm or col_tiles == 4, "the qkv projection without its RMSNorm folded in "
                   f"takes {self.SKINNY_NORM_MAX_ROWS + 1} to {self.SKINNY_MAX_ROWS} rows")
        self._need(k_splits == 1 or norm, "the qkv projection after the RMSNorm kernel takes "
                   "no K split")
        self._need(not x_sumsq or (x_f16 and hidden // 16 <= self.SKINNY_SQUARE_PARTS_MAX),
                   "x's sums of squares come with x's f16 form, hidden up to "
                   f"{16 * self.SKINNY_SQUARE_PARTS_MAX}")
        self._kv_checks(kv_scales, kv_amax)
        name = (f"blink_skinny_qkv_rope{'_norm' if norm else ''}{_FP8[fp8]}"
                f"{'_xf16' if x_f16 else ''}{'sq' if x_sumsq else ''}_{row_tiles}x{col_tiles}")
        self.launch(self._skinny_split_name(name, (row_tiles, col_tiles), k_splits),
                    (k_splits * -(-out_features // (16 * row_tiles)),), (self.gemv_threads,),
                    [_ptr(x), _i32(hidden), _i32(rows), _ptr(w),
                     _u32(self.tile_stride(hidden, 1 if fp8 else 2) if w_tiled else 0),
                     _i32(out_features), _i32(hidden), _f32(eps if norm else 0.0), _ptr(desc),
                     _ptr(positions), _ptr(token_seq), _ptr(block_tables),
                     _i32(max_blocks_per_seq), _ptr(qkv_bias), _ptr(inv_freq), _i32(num_heads),
                     _i32(num_kv_heads), _ptr(q_out), _ptr(k_cache), _ptr(v_cache),
                     _i32(block_size), _i32(num_blocks), _ptr(kv_scales), _ptr(kv_amax),
                     _ptr(w_scale), _ptr(norm_w), _i32(int(release_next)), _ptr(x_f16),
                     _ptr(x_sumsq)], stream)

    def _kv_checks(self, kv_scales, kv_amax) -> None:
        """The KV-cache arguments a KV writer or reader takes: scales with an E4M3 cache (the
        module's), none with bf16."""
        self._need(bool(kv_scales) == self.kv_fp8,
                   "an E4M3 KV cache's kernels take its scales (kv_scales), a bf16 one's none")
        self._need(not kv_amax or self.kv_fp8, "kv_amax calibrates an E4M3 KV cache's scales")

    # --- FP8 weights' and activations' quantizers (csrc/quantize.cuh) --------------------------

    def quantize_rows(self, stream, rows, desc, x, ldx, q, ldq, scale, K) -> None:
        """q[r] (E4M3 codes) and scale[r] (float32) of x[r] (bf16, ldx apart) for r below desc's
        num_tokens (every one of `rows` with desc 0: weights), one scale a row (gpu_engine/
        fp8.py quantize_rows gives the same codes)."""
        self._need(K % 8 == 0 and ldx % 8 == 0 and ldq % 8 == 0,
                   f"quantized rows need K, ldx and ldq % 8 == 0, got {K}, {ldx}, {ldq}")
        self.launch("blink_quantize_rows", (rows,), (256,),
                    [_ptr(desc), _ptr(x), _i32(ldx), _ptr(q), _i32(ldq), _ptr(scale), _i32(K)],
                    stream)

    def rms_norm_fp8(self, stream, rows, desc, x, weight, q, scale, hidden, eps, *,
                     bias=0) -> None:
        """rms_norm's rows (weight applied, fp32; bias added into x first) as E4M3 codes q
        [rows, hidden] with a scale a row: the FP8 GEMMs' input."""
        self._need(hidden % 8 == 0, f"hidden {hidden} must be a multiple of 8")
        self.launch("blink_rms_norm_fp8", (rows,), (256,),
                    [_ptr(desc), _ptr(x), _ptr(bias), _ptr(weight), _ptr(q), _ptr(scale),
                     _i32(hidden), _f32(eps)], stream)

    def silu_mul_fp8(self, stream, rows, desc, gate_up, q, scale, inter) -> None:
        """silu_mul's rows (fp32) as E4M3 codes q [rows, inter] with a scale a row: the FP8
        down projection's input."""
        self._need(inter % 16 == 0, f"intermediate size {inter} must be a multiple of 16")
        self.launch("blink_silu_mul_fp8", (rows,), (256,),
                    [_ptr(desc), _ptr(gate_up), _ptr(q), _ptr(scale), _i32(inter)], stream)

    # CTAs a thread-block cluster of the split-K and row-block kernels' variants (entry points
    # ..._x2, _x4): the cluster's CTAs share each chunk of x's read from L2 (gemv.cuh CopyXSlab)
    X_SLAB_CLUSTERS = (1, 2, 4)

    @staticmethod
    def _clustered(name: str, cluster: int) -> str:
        return name + (f"_x{cluster}" if cluster > 1 else "")

    def _row_blocks(self, out_features: int) -> int:
        """The split-K and row-block kernels' CTAs along the output rows (splitk_rows each)."""
        return -(-out_features // self.splitk_rows)

    def _clustered_row_blocks(self, name: str, out_features: int, cluster: int) -> tuple[str, int]:
        """`name`'s entry point in clusters of `cluster` CTAs and its grid's x: the row blocks
        rounded up to whole clusters (the CTAs past the last row only copy their share of x)."""
        self._need(cluster in self.X_SLAB_CLUSTERS,
                   f"clusters of {self.X_SLAB_CLUSTERS} CTAs, got {cluster}")
        return (self._clustered(name, cluster),
                -(-self._row_blocks(out_features) // cluster) * cluster)

    # What a split-K CTA costs beyond streaming its chunk (the wait for the previous kernel, the
    # copy of x's chunk before the first MMA, the adds), in columns of its chunk: splitk_chunk
    # weighs it.
    SPLITK_CTA_COST_COLUMNS = 256

    def splitk_fits(self, rows: int, in_features: int, out_features: int) -> bool:
        """Whether splitk_add_linear can take this shape (tiled weights)."""
        return (1 <= rows <= self.splitk_cols and out_features > 0 and out_features % 4 == 0
                and in_features > 0 and in_features % self.splitk_chunk_align == 0
                and self.tiled_elements(out_features, in_features) < 2 ** 31)

    def splitk_chunk(self, in_features: int, out_features: int) -> int:
        """The columns of K each split-K CTA takes: of the chunks that divide in_features in
        whole batches (at most splitk_max_chunk), the one that minimizes waves * (CTA cost +
        chunk), waves = ceil(CTAs / slots) on the SMs the forward is sized for; ties go to the
        larger chunk (fewer adds). 8B on the H200: the o projection (K 4,096) takes 512, 256
        CTAs in one wave; the down projection (K 14,336) 896, 512 CTAs in two."""
        blocks = -(-out_features // self.splitk_rows)

        def cost(chunk):
            waves = -(-blocks * (in_features // chunk)
                      // (self.splitk_ctas_per_sm[chunk] * self.sm_count))
            return waves * (self.SPLITK_CTA_COST_COLUMNS + chunk), -chunk

        return min((c for c in self.splitk_smem if in_features % c == 0), key=cost)

    def splitk_add_linear(self, stream, x, w_tiled, out, rows, in_features, out_features, *,
                          desc=0, chunk=None, cluster=1):
        """out[rows, out_features] (f32) += x[rows, in_features] (bf16) @ w^T, w in the tiled
        layout (tile_weights), K split across CTAs whose sums are added into out atomically (in
        an order that varies: the low bits of out are not reproducible); rows <= splitk_cols.
        desc: only the live rows (BatchDesc.num_tokens) are added. chunk: K's columns a CTA
        (default splitk_chunk's). cluster: CTAs a thread-block cluster (X_SLAB_CLUSTERS), which
        share x's chunk."""
        self._need(self.splitk_fits(rows, in_features, out_features),
                   f"split-K linear takes rows <= {self.splitk_cols}, in_features % "
                   f"{self.splitk_chunk_align} == 0, out_features % 4 == 0, got {rows} x "
                   f"{in_features} -> {out_features}")
        if chunk is None:
            chunk = self.splitk_chunk(in_features, out_features)
        self._need(chunk in self.splitk_smem and in_features % chunk == 0,
                   f"split-K chunk {chunk} does not divide {in_features} in whole batches of "
                   f"at most {self.splitk_max_chunk}")
        # 16-byte copies of x and adds into out (tiled weights are whole 1 KB steps)
        self._need(int(x) % 16 == 0 and int(out) % 16 == 0 and int(w_tiled) % 16 == 0,
                   "split-K linear needs x, w and out 16-byte aligned")
        name, blocks = self._clustered_row_blocks("blink_splitk_add_linear", out_features,
                                                  cluster)
        self.launch(name, (blocks, in_features // chunk),
                    (self.splitk_threads,),
                    [_ptr(desc), _ptr(x), _i32(in_features), _i32(rows), _ptr(w_tiled),
                     _u32(self.tile_stride(in_features)), _i32(out_features),
                     _i32(in_features), _i32(chunk), _ptr(out),
                     _i32(out_features)], stream, smem=self.splitk_smem[chunk])

    def rowblock_fits(self, rows: int, in_features: int, out_features: int) -> bool:
        """Whether rowblock_silu_mul can take this gate|up shape (tiled weights): the split-K
        kernel's shapes, in whole 16-row (gate, up) pairs."""
        return self.splitk_fits(rows, in_features, out_features) and out_features % 32 == 0

    # The row-block kernel runs one CTA a 128 weight rows over all of K, so a grid short of the
    # GPU's slots leaves SMs idle: it takes gate|up where its CTAs fill at least this share of
    # two an SM (8B: 224 CTAs for 262 slots; 1B's 128 stay on cuBLAS).
    ROWBLOCK_MIN_FILL = 0.8

    def rowblock_preferred(self, rows: int, in_features: int, out_features: int) -> bool:
        """Whether the forward pass should run gate|up + SiLU on rowblock_silu_mul."""
        return (self.rowblock_fits(rows, in_features, out_features)
                and self._row_blocks(out_features) >= self.ROWBLOCK_MIN_FILL * 2 * self.sm_count)

    def rowblock_chunk_columns(self, in_features: int) -> int:
        """x's columns a slab of rowblock_silu_mul: the most, up to rowblock_chunk, that divide
        in_features in whole batches."""
        return max(c for c in range(self.splitk_chunk_align, self.rowblock_chunk + 1,
                                    self.splitk_chunk_align) if in_features % c == 0)

    def rowblock_silu_mul(self, stream, rows, desc, x, w_tiled, out, in_features,
                          out_features, cluster=1):
        """out[rows, out_features / 2] (bf16) = silu(gate) * up of x[rows, in_features] @ w^T,
        w gate|up interleaved in 16-row groups (interleave_gate_up) in the tiled layout, a
        CTA's 128 rows over all of K with x's chunks in shared memory; rows <= splitk_cols.
        desc: only the live rows (BatchDesc.num_tokens) are written. cluster: CTAs a thread-block
        cluster (X_SLAB_CLUSTERS), which share x's reads from L2."""
        self._need(self.rowblock_fits(rows, in_features, out_features),
                   f"the row-block gate|up takes rows <= {self.splitk_cols}, in_features % "
                   f"{self.splitk_chunk_align} == 0, out_features % 32 == 0, got {rows} x "
                   f"{in_features} -> {out_features}")
        self._need(int(x) % 16 == 0 and int(w_tiled) % 16 == 0,
                   "the row-block gate|up needs x and w 16-byte aligned")
        name, ctas = self._clustered_row_blocks("blink_rowblock_silu_mul", out_features, cluster)
        self.launch(name, (ctas,),
                    (self.splitk_threads,),
                    [_ptr(desc), _ptr(x), _i32(in_features), _i32(rows), _ptr(w_tiled),
                     _u32(self.tile_stride(in_features)), _i32(out_features),
                     _i32(in_features), _i32(self.rowblock_chunk_columns(in_features)),
                     _ptr(out), _i32(out_features // 2)], stream, smem=self.rowblock_smem)

    def silu_mul(self, stream, rows, desc, gate_up, out, inter):
        """gate_up: [rows, 2 inter] bf16 in the interleaved 16-feature layout
        (interleave_gate_up); out: [rows, inter] bf16."""
        self._need(inter % 16 == 0, f"intermediate size {inter} must be a multiple of 16")
        self.launch("blink_silu_mul", (rows, -(-inter // (8 * 256))), (256,),
                    [_ptr(desc), _ptr(gate_up), _ptr(out), _i32(inter)], stream)

    def sample(self, stream, rows, desc, logits, vocab, temperature, top_p, top_k, seed, step,
               sampled, lm_argmax=0, done_sem=0):
        """One token a logit row (csrc/sampling.cuh SampleCta). lm_argmax: [rows] u64 that the
        LM head's skinny_linear(argmax=) filled; greedy rows take their token from it, and
        every row zeroes its word. done_sem: a zeroed u32 the kernel's CTAs count themselves
        out on, the last one bumping desc's done_counter (the forward graph's end)."""
        self.launch("blink_sample", (rows,), (self.sample_threads,),
                    [_ptr(desc), _ptr(logits), _i32(vocab), _ptr(temperature), _ptr(top_p),
                     _ptr(top_k), _ptr(seed), _ptr(step), _ptr(sampled), _ptr(lm_argmax),
                     _ptr(done_sem)], stream)

    def uniform(self, stream, seed, step, out, n):
        self.launch("blink_sampling_uniform", ((n + 255) // 256,), (256,),
                    [_ptr(seed), _ptr(step), _ptr(out), _i32(n)], stream)


# --- the model -----------------------------------------------------------------------------

# The RMSNorm weights in front of the qkv and gate|up projections are folded into those
# projections' columns (W diag(w)): what runs before them is a plain RMSNorm (a unit weight), or
# nothing where the projection normalizes its own input (the skinny *_norm kernels).
@dataclass
class _Layer:
    wqkv: DeviceArray           # [q + 2 kv, H] bf16: q_proj | k_proj | v_proj, q and k rows in
    #                             the RoPE pair layout (rope_pair_order), input_layernorm folded
    bqkv: DeviceArray | None    # [q + 2 kv] bf16 (qwen2), same row order
    q_norm: DeviceArray | None  # [D] bf16 (qwen3)
    k_norm: DeviceArray | None
    wo: DeviceArray             # [H, q] bf16
    bo: DeviceArray | None      # [H] bf16
    wgu: DeviceArray            # [2 I, H] bf16: gate_proj, up_proj interleaved in 16 rows,
    #                             post_attention_layernorm folded
    wdown: DeviceArray          # [H, I] bf16
    # the skinny kernels' copies of wqkv, wo, wgu and wdown in their tiled layout
    # (ForwardKernels.tile_weights), by name; empty without CudaForward's decode_weight_copy
    tiled: dict[str, DeviceArray] = field(default_factory=dict)
    # FP8 weights (CudaForward's quantization "fp8"): wqkv, wo, wgu and wdown (and their tiled
    # copies) hold E4M3 codes, not folded with the RMSNorms, which keep their weights here
    scales: dict[str, DeviceArray] = field(default_factory=dict)  # [rows] float32, by name
    input_norm: DeviceArray | None = None  # [H] bf16
    post_norm: DeviceArray | None = None   # [H] bf16
    # with FP8 weights, those of the four an FP8 checkpoint keeps wider than E4M3
    # (weight_layout.served_bf16), or random weights' random_bf16: bf16, the RMSNorm folded
    # in, as on bf16 weights
    bf16: frozenset[str] = frozenset()


def _rows16(rows: int) -> int:
    """An FP8 GEMM's rows for a bucket of `rows`: whole 16s (cuBLASLt's FP8 kernels take
    those; CudaForward's GEMM buffers hold them)."""
    return -(-rows // 16) * 16


class CudaForward:
    """Weights, KV cache, batch arrays, activations and one device-launchable graph per bucket.

    For the scheduler kernel:
      graph_execs[bucket] -> CUgraphExec (graph_exec_handles: the raw cudaGraphExec_t values);
      device_pointers() -> the BatchDesc and every batch array, by name (layouts in batch.cuh);
      bucket_for(num_tokens) -> the smallest bucket holding them.
    A launch of graph_execs[b] computes the batch described in device memory (num_tokens <= b),
    writes logits[:num_logits] and sampled[:num_logits], then the last CTA of its last kernel
    (sampling) increments BatchDesc.done_counter (a release add at GPU scope): a launcher that
    read the counter before the launch spins until it moves (an acquiring load).
    """

    def __init__(self, cfg: ModelConfig, weights: ModelWeights, *, num_blocks: int | None = None,
                 block_size: int = 16, max_num_batched_tokens: int = 512, max_num_seqs: int = 64,
                 max_model_len: int | None = None, gpu_memory_utilization: float = 0.9,
                 workspace_bytes: int = 32 << 20, device: int = 0, capture: bool = True,
                 random_seed: int = 0, skinny: bool = True,
                 decode_min_keys: int | None = None, programmatic_launch: bool = True,
                 fuse_norm_rope: bool = True, max_attention_splits: int | None = None,
                 gemm_tuning: bool = True, gemm_split_k: bool = False, held_sms: int = 1,
                 sm_count_target: int | None = None, decode_weight_copy: bool = True,
                 splitk_residual: bool = True, skinny_qkv_rope: bool = True,
                 rowblock_gate_up: bool = True, norm_release: bool = True,
                 splitk_cluster: int | None = None, rowblock_cluster: int | None = None,
                 skinny_split_blocks: int | None = None, lm_head_argmax: bool = True,
                 projection_chain: bool | None = None, quantization: str | None = None,
                 kv_cache_dtype: str = "auto", kv_scales: np.ndarray | None = None,
                 fp8_lm_head: bool = True, fp8_fast_accum: bool = True,
                 attention_wgmma_min_bucket: int | None = None,
                 attention_spread_max_bucket: int | None = None,
                 attention_roomy_max_bucket: int | None = None,
                 fine_buckets_from: int = 128, qkv_release_early: bool | None = None,
                 fp8_x_f16: bool | None = None, fp8_x_sumsq: bool | None = None,
                 final_norm_release: bool = False, rope_release: bool = True,
                 random_bf16: str | tuple[str, ...] = ()):
        """num_blocks: KV-cache blocks; None sizes the cache to fill gpu_memory_utilization of
        the device's memory once weights and activations are in. max_model_len (default: the
        model's max_position_embeddings) sets the block-table width. skinny: projections of
        buckets up to ForwardKernels.SKINNY_MAX_ROWS rows use the skinny linear kernel (False:
        cuBLAS for every bucket, the comparison the decode benchmark makes).
        decode_min_keys: overrides DECODE_MIN_KEYS (0: every decode token takes the decode
        path; a huge value: none does). programmatic_launch: see ForwardKernels.
        fuse_norm_rope: buckets of up to SKINNY_NORM_MAX_ROWS rows run each RMSNorm inside the
        projection that follows it and RoPE + KV write inside the qkv projection (False: as
        kernels of their own, the comparison bench_decode --no-fuse makes).
        max_attention_splits: caps attention_splits below the kernel's own cap (the comparison
        bench_decode --options makes). attention_wgmma_min_bucket: overrides
        ATTENTION_WGMMA_MIN_BUCKET (a huge value: no bucket takes the wgmma kernel);
        attention_spread_max_bucket ATTENTION_SPREAD_MAX_BUCKET (0: no query tile's keys split
        over its other tokens' CTAs). attention_roomy_max_bucket: buckets up to this size that
        run the large mma.sync query tiles take the roomy kernel (fewer CTAs an SM, more
        registers: attention_roomy; default ATTENTION_ROOMY_MAX_BUCKET). fine_buckets_from: the
        buckets go four an octave from this size up (engine_layout.default_buckets; 64 adds
        80, 96 and 112, so a warm prefix request's 100-token step runs as 112 rows rather than
        128: the comparison bench_decode --options makes). qkv_release_early: the skinny qkv
        projection (with RoPE + KV write) lets attention launch once its CTAs have started
        rather than once they have read their weights, so attention's CTAs load their first
        keys while it runs (None: where a layer's weights come to at most
        ForwardKernels.QKV_RELEASE_EARLY_MAX_LAYER_BYTES; timed in docs/performance.md rounds
        38 and 41: 1.2-2% off the 1B FP8 batch-1 step, 0.4-0.7% onto the 8B one;
        bench_decode --options makes the comparison). final_norm_release: the final RMSNorm
        lets the LM head launch once its CTAs have started, so the head's first CTAs load their
        weights while it runs (off: the comparison bench_decode --options makes).
        rope_release: RoPE + KV write, where it is a kernel of its own (the steps past the
        fused buckets, such as a warm prefix request's chunk; every step of Qwen3, whose q/k
        norms keep it a kernel: not timed there), lets attention launch once its CTAs have
        started, so attention's launch and its query tiles' search run beside it (on by
        default: docs/performance.md round 54, 1.0-2.7% off a short chunk's step; off: the
        comparison bench_decode --options makes).
        random_bf16 (random weights, quantization "fp8"): the fused projections (wqkv, wo, wgu,
        wdown; a tuple, or joined by "+" as bench_decode --options gives it) every layer keeps
        in bf16 beside the FP8 ones, as an FP8 checkpoint that stores them in bf16 is served
        (_Layer.bf16; Meta's Llama-3.1 FP8 releases: wqkv+wo), for timing such a layout.
        fp8_x_f16 (quantization "fp8"; None: on with it, off without): in buckets of up to
        ForwardKernels.SKINNY_X_F16_MAX_ROWS rows, the kernels that write the residual stream's
        shadow (the embedding, the o and down projections), SiLU * up and the final RMSNorm
        also write x's f16 form as the next FP8 skinny kernel's MMAs take it (times the next
        RMSNorm's weight and 1/16), so the qkv, gate|up and down projections and the LM head
        convert none of it: bit-identical logits, and 0.8-1.1% off the 8B batch-1 FP8 step,
        2.2% off the 1B one (round 38). fp8_x_sumsq (with fp8_x_f16; None: in the buckets of
        up to X_SUMSQ_DEFAULT_MAX_ROWS rows, True: of up to SKINNY_X_F16_MAX_ROWS): those
        writers also leave x's sums of squares in parts of 16 features, so the normalizing ones
        (qkv, gate|up) read no bf16 x at all; their RMSNorm scale is then summed in another
        order (float rounding, not bit for bit). Timed in docs/performance.md round 39: 1.5-2.3%
        off the 8B batch-1 FP8 step, nothing off 1B's, and slower at batch 8.
        gemm_tuning: each cuBLAS GEMM shape runs the fastest of cuBLAS's own choice and
        cuBLASLt's candidates, timed at start-up or read from the cache (gemm_tuning.py; False:
        cuBLAS's own choice everywhere). gemm_split_k: the tuner also times split-K variants
        of cuBLASLt's first candidates for shapes of few rows (Cublas.split_k).
        held_sms: SMs another kernel holds while the graphs run: the scheduler kernel's one CTA
        (0 where the host launches them). The graphs' kernels are sized for the other SMs
        (cuBLAS's SM count target, the attention grids), and bench_decode and the GEMM tuner
        time them beside held_sms spinning CTAs (holding_sms). sm_count_target: size them for
        this many SMs instead (0: all the device's; the comparison bench_decode --options
        makes). decode_weight_copy: the skinny kernels read their own copy of each layer's
        projections and of the LM head in a tiled layout (gemv.cuh), which streams faster than
        the row-major weights cuBLAS reads, and take the LM head from cuBLAS in steps of up to
        SKINNY_PREFERRED_ROWS logit rows (decode-sized steps; every step where max_num_seqs is
        that small); it costs the memory of those weights a second time (False: they read the
        row-major weights, and cuBLAS runs a large LM head). splitk_residual: in steps of
        SKINNY_PREFERRED_ROWS + 1 to splitk_cols rows, the residual-adding projections (o and
        down) run ForwardKernels.splitk_add_linear on the tiled copies, not cuBLAS (False:
        cuBLAS; without the copies cuBLAS anyway). skinny_qkv_rope: in steps of
        SKINNY_NORM_MAX_ROWS + 1 to SKINNY_MAX_ROWS rows, the qkv projection runs the skinny
        kernel on its tiled copy after the RMSNorm kernel, RoPE + KV write as its epilogue
        (False: cuBLAS, then RoPE + KV write as a kernel of their own; so too without the
        tiled copies, and for Qwen3, whose per-head q/k norms keep RoPE a kernel).
        rowblock_gate_up: in steps of SKINNY_PREFERRED_ROWS + 1 to splitk_cols rows, the
        gate|up projection and SiLU * up run ForwardKernels.rowblock_silu_mul on the tiled
        copy, after the RMSNorm kernel, where its grid fills the GPU
        (ForwardKernels.rowblock_preferred: Llama-3.1-8B, not 3.2-1B) (False: cuBLAS, then the
        SiLU kernel). norm_release: the RMSNorm kernels inside a layer let the projection after
        them launch once their CTAs have waited for the kernel before (False: at their end).
        splitk_cluster, rowblock_cluster: the split-K and the row-block kernel in thread-block
        clusters of this many CTAs, which share x's reads from L2
        (ForwardKernels.X_SLAB_CLUSTERS); None: two and four where the hidden size is at least
        X_SLAB_CLUSTER_MIN_HIDDEN, else one.
        skinny_split_blocks: skinny projections (plain, and qkv + RoPE with the RMSNorm folded
        in) split K across clusters of two CTAs where ForwardKernels.skinny_splits says so:
        None, where the split grid fits one wave (Llama-3.2-1B's qkv, o and down projections
        in steps of up to 8 rows, its o and down ones up to 16; none of Llama-3.1-8B's); a
        number, where they have at most that many 16-row blocks (0: none).
        lm_head_argmax: the skinny LM head reduces each logit row's greedy argmax as it
        stores the logits, and the sampling kernel's greedy rows take it (False: they scan
        the logits; so too after a cuBLAS LM head).
        projection_chain: in the one-token bucket, each layer's o, gate|up and down
        projections (with the residual adds, the RMSNorm and SiLU * up) run as one persistent
        kernel (ForwardKernels.projection_chain) where the layer takes it (fused norms, tiled
        weights, no o bias); bit-identical to the three unsplit skinny kernels (bf16 or FP8
        weights). None (the default): where ForwardKernels.chain_preferred says so (bf16
        layers of at least CHAIN_MIN_LAYER_BYTES; never with FP8 weights, where it is slower),
        with the skinny kernels; bench_decode --options chain:projection_chain=1 /
        nochain:projection_chain=0 times either way.
        quantization "fp8": the projections' weights as E4M3 codes with a float32 scale per
        output row (quantized on the GPU at load, csrc/quantize.cuh; the RMSNorm weights kept
        apart, not folded in): decode-sized steps run the FP8 skinny kernels (dequantizing in
        registers, activations in f16), larger ones cuBLASLt's FP8 GEMMs on activations
        quantized per token row; the embedding stays bf16 (see docs/performance.md, *FP8*).
        The projections an FP8 checkpoint keeps in bf16 (weight_layout.served_bf16) stay bf16,
        folded as on bf16 weights, and run the bf16 kernels (_Layer.bf16).
        fp8_lm_head (with quantization "fp8"): the LM head too, as a copy of E4M3 codes with
        a scale per vocabulary row (lm_head_fp8: the FP8 skinny kernel in decode-sized steps,
        cuBLASLt's FP8 GEMM on the final RMSNorm's rows quantized per row in larger ones);
        False keeps it bf16. fp8_fast_accum: cuBLASLt's FP8 GEMMs (prefill-sized steps and
        batches past the skinny kernels') accumulate in the tensor cores' own precision,
        without cuBLASLt's periodic promotion to fp32, as vLLM's and TensorRT-LLM's FP8 GEMMs
        do (Cublas.fp8_fast_accum; what it gains and costs: docs/performance.md, round 30).
        kv_cache_dtype "fp8": an E4M3 KV cache with a float32 scale
        per (layer, KV head): kv_scales [num_layers, 2, num_kv_heads] (keys', values'), or
        calibrated at start-up on fp8.calibration_tokens (calibrate_kv_scales)."""
        H, I, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
        if H % engine_layout.HIDDEN_ALIGN or I % engine_layout.INTERMEDIATE_ALIGN:
            raise ValueError(f"hidden ({H}) must be a multiple of {engine_layout.HIDDEN_ALIGN} "
                             f"and intermediate ({I}) of {engine_layout.INTERMEDIATE_ALIGN}")
        if quantization not in (None, "fp8"):
            raise ValueError(f"quantization {quantization!r}: None or 'fp8'")
        if kv_cache_dtype not in ("auto", "bf16", "fp8"):
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}: 'auto', 'bf16' or 'fp8'")
        self.fp8 = quantization == "fp8"
        kept = random_bf16.split("+") if isinstance(random_bf16, str) else random_bf16
        self.random_bf16 = frozenset(name for name in kept if name)
        if unknown := self.random_bf16 - FUSED_PROJECTIONS.keys():
            raise ValueError(f"random_bf16 {'+'.join(sorted(unknown))}: not among "
                             f"{'+'.join(FUSED_PROJECTIONS)}")
        if self.random_bf16 and (weights is not None or not self.fp8):
            raise ValueError("random_bf16 keeps random weights' projections in bf16 beside FP8 "
                             "ones: it needs random weights and quantization 'fp8' (a "
                             "checkpoint's own formats say which it keeps)")
        if fp8_x_f16 is None:
            fp8_x_f16 = self.fp8
        if fp8_x_f16 and not self.fp8:
            raise ValueError("fp8_x_f16 hands x over to the FP8 skinny kernels: it needs "
                             "quantization 'fp8'")
        if fp8_x_sumsq and not fp8_x_f16:
            raise ValueError("fp8_x_sumsq hands x's sums of squares over beside its f16 form: "
                             "it needs fp8_x_f16")
        if fp8_x_sumsq and H // 16 > ForwardKernels.SKINNY_SQUARE_PARTS_MAX:
            raise ValueError(f"fp8_x_sumsq: hidden ({H}) up to "
                             f"{16 * ForwardKernels.SKINNY_SQUARE_PARTS_MAX}")
        if fp8_x_sumsq is None:  # (a larger hidden size keeps the kernels' own squares)
            fp8_x_sumsq = (fp8_x_f16 and H // 16 <= ForwardKernels.SKINNY_SQUARE_PARTS_MAX
                           and self.X_SUMSQ_DEFAULT_MAX_ROWS > 0)
            x_sumsq_rows = self.X_SUMSQ_DEFAULT_MAX_ROWS
        else:
            x_sumsq_rows = ForwardKernels.SKINNY_X_F16_MAX_ROWS
        self.lm_head_fp8 = self.fp8 and fp8_lm_head
        # an FP8 LM head's GEMM writes only output rows of whole 16s of logits (cuBLASLt offers
        # no FP8 GEMM for another pitch): with another vocabulary (Llama-2 fine-tunes' 32,001)
        # it writes rows padded to them (logits_padded), copied into logits after
        self.lm_head_rows = (_rows16(cfg.vocab_size) if self.lm_head_fp8 and cfg.vocab_size % 16
                             else cfg.vocab_size)
        self.kv_fp8 = kv_cache_dtype == "fp8"
        if self.fp8:
            align = ForwardKernels.SKINNY_FP8_K_ALIGN
            if any(n % align for n in (H, I, cfg.q_size)):
                raise ValueError(f"--quantization fp8 needs hidden ({H}), intermediate ({I}) and "
                                 f"q ({cfg.q_size}) sizes that are multiples of {align}")
            if not skinny:
                raise ValueError("--quantization fp8 runs decode-sized steps on its skinny "
                                 "kernels (skinny=False is a bf16 comparison)")
        if (num_blocks is not None and num_blocks <= 0) or block_size <= 0 \
                or max_num_batched_tokens <= 0 or max_num_seqs <= 0:
            raise ValueError("num_blocks, block_size, max_num_batched_tokens and max_num_seqs "
                             "must be positive")
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization {gpu_memory_utilization} not in (0, 1]")
        self.cfg = cfg
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len or cfg.max_position_embeddings
        self.max_blocks_per_seq = -(-self.max_model_len // block_size)
        self.buckets = engine_layout.default_buckets(max_num_batched_tokens,
                                                     fine_buckets_from)
        self.max_tokens = self.buckets[-1]
        self.skinny = skinny
        self.fuse_norm_rope = fuse_norm_rope
        self.splitk_residual = splitk_residual
        self.skinny_qkv_rope = skinny_qkv_rope
        # (a layer counted as all FP8 where some projections stay bf16: with Meta's layout,
        # q|k|v and o bf16, the 1B and 8B shapes' layers stay on the same side of the line)
        self.qkv_release_early = (
            layer_projection_weights(cfg) * (1 if self.fp8 else 2)
            <= ForwardKernels.QKV_RELEASE_EARLY_MAX_LAYER_BYTES
            if qkv_release_early is None else qkv_release_early)
        self.final_norm_release = final_norm_release
        self.rope_release = rope_release
        self.fp8_x_f16 = fp8_x_f16
        # the buckets whose normalizing FP8 kernels take x's sums of squares (0: none)
        self.x_sumsq_max_rows = x_sumsq_rows if fp8_x_sumsq else 0
        self.rowblock_gate_up = rowblock_gate_up
        self.norm_release = norm_release
        wide = H >= self.X_SLAB_CLUSTER_MIN_HIDDEN
        self.splitk_cluster = (splitk_cluster if splitk_cluster is not None
                               else 2 if wide else 1)
        self.rowblock_cluster = (rowblock_cluster if rowblock_cluster is not None
                                 else 4 if wide else 1)
        self.max_attention_splits = max_attention_splits
        self.attention_wgmma_min_bucket = (self.ATTENTION_WGMMA_MIN_BUCKET
                                           if attention_wgmma_min_bucket is None
                                           else attention_wgmma_min_bucket)
        self.attention_spread_max_bucket = (self.ATTENTION_SPREAD_MAX_BUCKET
                                            if attention_spread_max_bucket is None
                                            else attention_spread_max_bucket)
        self.attention_roomy_max_bucket = (self.ATTENTION_ROOMY_MAX_BUCKET
                                           if attention_roomy_max_bucket is None
                                           else attention_roomy_max_bucket)
        self.lm_head_tiled: DeviceArray | None = None  # the skinny LM head's (decode_weight_copy)
        # lm_head_fp8: the LM head's E4M3 codes [V, H] and their rows' scales [V] (the bf16
        # lm_head stays only where it is the embedding)
        self.lm_head_codes: DeviceArray | None = None
        self.lm_head_scale: DeviceArray | None = None
        self.decode_min_keys = (self.DECODE_MIN_KEYS if decode_min_keys is None
                                else decode_min_keys)
        self._memory: list[DeviceArray] = []
        self._fill_module = None  # random_fill.cu's, loaded on first use (_random_fill)

        self.kernels = k = ForwardKernels(D, device, programmatic_launch, held_sms,
                                          sm_count_target, kv_fp8=self.kv_fp8)
        refusal = fp8_refusal(quantization, "auto", k.compute_capability)
        if refusal is not None:
            raise CudaError(refusal)
        self.skinny_split_blocks = skinny_split_blocks
        self.lm_head_argmax = lm_head_argmax
        self.projection_chain = (skinny and k.chain_preferred(H, I, cfg.q_size, self.fp8)
                                 if projection_chain is None else projection_chain)
        self.stream = new_stream()
        self.blas = Cublas()
        self.graph_execs: dict[int, object] = {}  # (close() frees what exists at any point)
        self.blas.set_stream(int(self.stream))  # before set_workspace: it resets the workspace
        self.workspace = self._alloc(workspace_bytes, np.uint8)
        self.blas.set_workspace(self.workspace.ptr, workspace_bytes)
        self.blas.set_pointer_mode(device=False)
        self.blas.fp8_fast_accum = bool(fp8_fast_accum)
        self.blas.split_k = bool(gemm_split_k)
        # cuBLAS sizes its persistent GEMMs' grids for the device's SMs: with one held, one CTA
        # of such a grid waits for a second round
        self.blas.set_sm_count_target(0 if k.sm_count == k.device_sm_count else k.sm_count)
        self._hold_release = self._alloc(1, np.uint32) if k.held_sms else None
        self._holding = False
        self.gemm_tuner = None
        if gemm_tuning:
            name = check(driver.cuDeviceGetName(256, k.device), "cuDeviceGetName")
            path = cache_file(cache_dir("gemm"), name.split(b"\0")[0].decode(),
                              self.blas.version, workspace_bytes, self.blas.sm_count_target,
                              k.held_sms, self.blas.split_k)
            self.gemm_tuner = GemmTuner(self.blas, self.stream, ChoiceCache(path),
                                        beside=self.holding_sms)

        if weights is not None:
            self._upload_weights(weights)
        else:
            self._random_weights(random_seed)
            if self.fp8:
                self._quantize_projections(self.layers)
        if self.lm_head_fp8:
            self._quantize_lm_head()
        if decode_weight_copy and skinny:
            self._tile_projections()

        T, S, V = self.max_tokens, max_num_seqs, cfg.vocab_size
        self.desc = self._alloc(1, BATCH_DESC_DTYPE)
        self.token_ids = self._alloc(T, np.int32)
        self.positions = self._alloc(T, np.int32)
        self.token_seq = self._alloc(T, np.int32)
        self.context_lens = self._alloc(S, np.int32)
        self.block_tables = self._alloc((S, self.max_blocks_per_seq), np.int32)
        self.logit_token = self._alloc(S, np.int32)
        self.temperature = self._alloc(S, np.float32)
        self.top_p = self._alloc(S, np.float32)
        self.top_k = self._alloc(S, np.int32)
        self.seed = self._alloc(S, np.uint64)
        self.step = self._alloc(S, np.uint32)
        # an FP8 LM head's GEMM writes whole 16s of rows (and of logits: lm_head_rows)
        self.logits = self._alloc((_rows16(S) if self.lm_head_fp8 else S, V), np.float32)
        self.logits_padded = (self._alloc((_rows16(S), self.lm_head_rows), np.float32)
                              if self.lm_head_rows != V else None)
        self.sampled = self._alloc(S, np.int32)
        # each logit row's greedy argmax, packed, that the skinny LM head reduces into and the
        # sampling kernel reads and zeroes (lm_head_argmax)
        self.lm_argmax = self._alloc(S, np.uint64)
        # the sampling kernel's CTAs count themselves out on it; the last ends the graph
        self.sample_done_sem = self._alloc(1, np.uint32)

        Q, KV = cfg.q_size, cfg.kv_size
        G = _rows16(T) if self.fp8 else T  # rows of the GEMMs' outputs (FP8: whole 16s)
        self.x = self._alloc((G, H), np.float32)          # residual stream
        self.x_shadow = self._alloc((T, H), BF16)         # its bf16 copy, in fused buckets
        self.h = self._alloc((T, H), BF16)                # normed activations
        self.qkv = self._alloc((G, Q + 2 * KV), BF16)
        self.q = self._alloc((T, Q), BF16)                # after RoPE
        self.attn = self._alloc((T, Q), BF16)
        self.gate_up = self._alloc((G, 2 * I), BF16)
        self.act = self._alloc((T, I), BF16)
        # fp8_x_f16: the shadow's and act's f16 forms as the FP8 skinny kernels take them
        # (f16 bits; one column tile of token rows)
        x_f16_rows = min(T, ForwardKernels.SKINNY_X_F16_MAX_ROWS)
        self.x_f16 = self._alloc((x_f16_rows, H), np.uint16) if fp8_x_f16 else None
        self.act_f16 = self._alloc((x_f16_rows, I), np.uint16) if fp8_x_f16 else None
        # fp8_x_sumsq: the shadow's sums of squares in parts of 16 features (csrc/gemv.cuh
        # GemvSquareParts)
        self.x_sumsq = (self._alloc((x_f16_rows, H // 16), np.float32)
                        if self.x_sumsq_max_rows else None)
        self.h_logits = self._alloc((min(T, S), H), BF16)
        # FP8 GEMMs' input (prefill-sized steps): the normed rows, attention's output or
        # SiLU * up, one at a time, as E4M3 codes with a scale a token row
        self.act_q = self._alloc((G, max(H, I, Q)), np.uint8) if self.fp8 else None
        self.act_q_scale = self._alloc(G, np.float32) if self.fp8 else None
        if self.fp8:  # the FP8 GEMMs exist on this GPU and cuBLAS: one line now, not later
            reason = self.blas.fp8_supported(self.blas.fp8_shape(32, H, Q + 2 * KV, R_16BF,
                                                                  False))
            if reason is not None:
                raise CudaError(f"--quantization fp8: {reason}")
        # Split-key attention workspace, for the buckets that split (attention_splits), and
        # one arrival counter per (token, kv head): zero now, left zero by every launch.
        part_rows = self.attn_partial_rows = max(b * self.attention_split_stride(b)
                                                 for b in self.buckets)
        self.attn_partial_out = self._alloc(part_rows * cfg.num_heads * D, np.float32)
        self.attn_partial_stats = self._alloc(part_rows * cfg.num_heads * 2, np.float32)
        self.attn_tile_sems = self._alloc(T * cfg.num_kv_heads, np.uint32)
        # each layer's counters of projection_chain: zero now, left zero by every launch
        self.chain_counters = self._alloc(cfg.num_layers * self.kernels.chain_counters_words,
                                          np.uint32)

        kv_dtype = np.uint8 if self.kv_fp8 else BF16  # an E4M3 code, or bf16 bits
        block_bytes = (2 * cfg.num_layers * block_size * cfg.num_kv_heads * D  # k and v
                       * np.dtype(kv_dtype).itemsize)
        free, total = check(driver.cuMemGetInfo(), "cuMemGetInfo")
        headroom = 256 << 20  # room for the graphs and cuBLAS's own state
        too_large = None
        if num_blocks is None:
            budget = int(total * gpu_memory_utilization) - (total - free) - headroom
            num_blocks = budget // block_bytes
            if num_blocks < 1:
                too_large = (f"no memory left for the KV cache at gpu_memory_utilization "
                             f"{gpu_memory_utilization} ({free >> 20} MiB free)")
        elif num_blocks * block_bytes > free - headroom:
            too_large = (f"{num_blocks} KV blocks need {num_blocks * block_bytes >> 20} MiB; "
                         f"{free >> 20} MiB of GPU memory is free after the weights, room for "
                         f"{max(0, free - headroom) // block_bytes} blocks")
        if too_large is not None:  # one line, rather than an allocation's out-of-memory error
            self.close()
            raise engine_layout.KvCacheTooLarge(too_large)
        self.num_blocks = int(num_blocks)
        kv_shape = (cfg.num_layers, self.num_blocks, block_size, cfg.num_kv_heads, D)
        self.k_cache = self._alloc(kv_shape, kv_dtype)  # [layers, blocks, block_size, kv_heads, D]
        self.v_cache = self._alloc(kv_shape, kv_dtype)
        self._layer_kv_bytes = block_bytes // (2 * cfg.num_layers) * self.num_blocks
        # an E4M3 cache's scales, [layers, 2, kv_heads] (keys', values'), and the calibration
        # pass's maxima beside them (calibrate_kv_scales)
        self.kv_scales = self.kv_amax = None
        self._calibrating = False
        if self.kv_fp8:
            self.kv_scales = self._alloc((cfg.num_layers, 2, cfg.num_kv_heads), np.float32)
            self.kv_amax = self._alloc((cfg.num_layers, 2, cfg.num_kv_heads), np.float32)
            if kv_scales is not None:
                self.set_kv_scales(kv_scales)
            else:
                self.calibrate_kv_scales()

        self.graph_node_types: dict[int, dict[str, int]] = {}
        self.graph_edge_types: dict[int, dict[str, int]] = {}  # DEFAULT / PROGRAMMATIC
        if capture:
            for b in self.buckets:
                self.graph_execs[b] = self._capture(b)
            if self.gemm_tuner is not None:
                log.info("gemm tuning: %s", self.gemm_tuner.summary())

    # --- set-up ------------------------------------------------------------------------------

    def _alloc(self, shape, dtype) -> DeviceArray:
        arr = DeviceArray(shape, dtype)
        self._memory.append(arr)
        arr.fill_bytes(0)
        return arr

    def _bf16(self, x: np.ndarray) -> DeviceArray:
        return self._device(to_bf16(x))

    def _device(self, x: np.ndarray) -> DeviceArray:
        arr = DeviceArray.from_numpy(np.ascontiguousarray(x))
        self._memory.append(arr)
        return arr

    @classmethod
    def random_weights(cls, cfg: ModelConfig, seed: int = 0, **kwargs) -> "CudaForward":
        """Random bf16 weights generated on the GPU in the checkpoint's shapes: for benchmarks
        of real model shapes, where the values do not change the cost of a step."""
        return cls(cfg, None, random_seed=seed, **kwargs)

    def _random_fill(self, name: str):
        """random_fill.cu's kernel `name`; the module compiled for this GPU, loaded once."""
        from blink.gpu_engine import cuda_runtime as cr
        if self._fill_module is None:
            self._fill_module = cr.Module(cr.nvcc_cubin(CSRC / "random_fill.cu",
                                                        arch=self.kernels.arch))
        return self._fill_module.function(name)

    def _fill_uniform(self, arr: DeviceArray, seed: int, scale: float, offset: float = 0.0):
        """arr's bf16 elements set to offset + uniform [-scale, scale) on the GPU (seeded)."""
        from blink.gpu_engine import cuda_runtime as cr
        n = arr.nbytes // 2
        cr.launch(self._random_fill("fill_uniform_bf16"), min(4096, (n + 255) // 256), 256,
                  (arr.ptr, n, seed, scale, offset),
                  (ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_float,
                   ctypes.c_float), self.stream)

    def _random_weights(self, seed: int) -> None:
        cfg, counter = self.cfg, [seed]

        def tensor(*shape, fan_in=None, const=None):
            arr = self._alloc(shape, BF16)
            scale, offset = (0.0, const) if const is not None else (fan_in ** -0.5 * 1.7, 0.0)
            counter[0] += 1
            self._fill_uniform(arr, counter[0], scale, offset)
            return arr

        H, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
        Q, KV, D = cfg.q_size, cfg.kv_size, cfg.head_dim
        self.embed = tensor(V, H, fan_in=1)
        self.lm_head = self.embed if cfg.tie_word_embeddings else tensor(V, H, fan_in=H)
        self.final_norm = tensor(H, const=1.0)
        self.unit_norm = tensor(H, const=1.0)
        self.inv_freq = DeviceArray.from_numpy(rope_inv_freq(cfg))
        self._memory.append(self.inv_freq)
        self.layers = [_Layer(
            wqkv=tensor(Q + 2 * KV, H, fan_in=H),
            bqkv=tensor(Q + 2 * KV, fan_in=H) if cfg.attention_bias else None,
            q_norm=tensor(D, const=1.0) if cfg.qk_norm else None,
            k_norm=tensor(D, const=1.0) if cfg.qk_norm else None,
            wo=tensor(H, Q, fan_in=Q), bo=tensor(H, fan_in=Q) if cfg.o_proj_bias else None,
            wgu=tensor(2 * I, H, fan_in=H),
            wdown=tensor(H, I, fan_in=I),
            input_norm=tensor(H, const=1.0) if self.fp8 else None,
            post_norm=tensor(H, const=1.0) if self.fp8 else None, bf16=self.random_bf16)
            for _ in range(cfg.num_layers)]
        synchronize(self.stream)

    def _upload_weights(self, w: ModelWeights) -> None:
        """The checkpoint's weights in bf16, the RMSNorm weights folded into the projections
        after them (FP8: kept apart, and each layer's projections quantized from these by
        _quantize_projections before the next layer's come, so the bf16 model never needs to
        fit). An FP8 checkpoint's projections stored with a scale a tensor or a row are uploaded
        as stored (weight_layout.stored_fp8: quantizing a per-tensor checkpoint's values again
        per row would round them twice); block- and group-scaled ones pass through bf16 on
        their way to the quantizer, a scale per row; those it stores wider stay bf16, folded as
        on bf16 weights (weight_layout.served_bf16, _Layer.bf16). w.layers may be read as they
        are asked for (checkpoint.LayersOnDemand): a layer is uploaded and dropped before the
        next is read."""
        cfg = self.cfg
        self.embed = self._bf16(w.embed)
        self.lm_head = self.embed if w.lm_head is w.embed else self._bf16(w.lm_head)
        self.final_norm = self._bf16(w.final_norm)
        self.unit_norm = self._bf16(np.ones(cfg.hidden_size, np.float32))
        inv_freq = DeviceArray.from_numpy(rope_inv_freq(cfg))
        self._memory.append(inv_freq)
        self.inv_freq = inv_freq
        order = rope_pair_order(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.layers = []
        for lw in w.layers:
            stored = stored_fp8(lw, order) if self.fp8 else {}
            bf16 = frozenset(served_bf16(lw.stored_wide)) if self.fp8 else frozenset()

            def projection(name, values):
                """The stored codes of fused projection `name`, else values() in bf16."""
                return self._device(stored[name][0]) if name in stored else self._bf16(values())

            def wqkv():  # (the RMSNorm is folded into bf16 weights)
                fused = np.concatenate([lw.q_proj, lw.k_proj, lw.v_proj])[order]
                return fused * lw.input_norm[None, :] if self.is_bf16(bf16, "wqkv") else fused

            def wgu():
                fused = interleave_gate_up(lw.gate_proj, lw.up_proj)
                return (fused * lw.post_attention_norm[None, :] if self.is_bf16(bf16, "wgu")
                        else fused)

            self.layers.append(_Layer(
                wqkv=projection("wqkv", wqkv),
                bqkv=(self._bf16(np.concatenate([lw.q_bias, lw.k_bias, lw.v_bias])[order])
                      if lw.q_bias is not None else None),
                q_norm=self._bf16(lw.q_norm) if lw.q_norm is not None else None,
                k_norm=self._bf16(lw.k_norm) if lw.k_norm is not None else None,
                wo=projection("wo", lambda: lw.o_proj),
                bo=self._bf16(lw.o_bias) if lw.o_bias is not None else None,
                wgu=projection("wgu", wgu),
                wdown=projection("wdown", lambda: lw.down_proj),
                input_norm=self._bf16(lw.input_norm) if self.fp8 else None,
                post_norm=self._bf16(lw.post_attention_norm) if self.fp8 else None,
                scales={name: self._device(scale) for name, (_, scale) in stored.items()},
                bf16=bf16,
            ))
            if self.fp8:
                self._quantize_projections(self.layers[-1:])

    def _quantize_projections(self, layers: list[_Layer]) -> None:
        """These layers' bf16 projections -> E4M3 codes with a scale per row (_Layer.scales),
        quantized on the GPU (ForwardKernels.quantize_rows: fp8.py quantize_rows's codes), the
        bf16 copies freed as it goes; those with scales already hold a checkpoint's own codes
        (stored_fp8, _upload_weights)."""
        for lw in layers:
            for name, rows, cols in self._projections():
                if name not in lw.scales and name not in lw.bf16:
                    codes, lw.scales[name] = self._quantized(getattr(lw, name), rows, cols)
                    setattr(lw, name, codes)

    def _quantize_lm_head(self) -> None:
        """The LM head as E4M3 codes with a scale per vocabulary row (lm_head_codes,
        lm_head_scale); its bf16 copy freed unless it is the embedding's table."""
        V, H = self.cfg.vocab_size, self.cfg.hidden_size
        tied = self.lm_head is self.embed
        self.lm_head_codes, self.lm_head_scale = self._quantized(  # rows past V: zero
            self.lm_head, V, H, free=not tied, alloc_rows=self.lm_head_rows)
        if not tied:
            self.lm_head = None

    def _quantized(self, bf16: DeviceArray, rows: int, cols: int, free: bool = True,
                   alloc_rows: int | None = None) -> tuple[DeviceArray, DeviceArray]:
        """bf16 [rows, cols] -> (E4M3 codes, float32 scale per row), quantized on the GPU
        (ForwardKernels.quantize_rows: fp8.py quantize_rows's codes); bf16 freed (free).
        alloc_rows: the arrays hold that many rows, those past `rows` zero."""
        codes = self._alloc((alloc_rows or rows, cols), np.uint8)
        scale = self._alloc(alloc_rows or rows, np.float32)
        if (alloc_rows or rows) > rows:
            codes.fill_bytes(0)
            scale.fill_bytes(0)
        self.kernels.quantize_rows(self.stream, rows, 0, bf16.ptr, cols, codes.ptr, cols,
                                   scale.ptr, cols)
        synchronize(self.stream)
        if free:
            self._memory.remove(bf16)
            bf16.free()
        return codes, scale

    def _unpad_logits(self, stream, rows: int) -> None:
        """logits_padded's first `rows` rows into logits (a 2D copy: a memcpy node of the
        bucket's graph, which device-launched graphs allow for device memory)."""
        V = self.cfg.vocab_size
        copy = driver.CUDA_MEMCPY2D()
        copy.srcMemoryType = driver.CUmemorytype.CU_MEMORYTYPE_DEVICE
        copy.dstMemoryType = driver.CUmemorytype.CU_MEMORYTYPE_DEVICE
        copy.srcDevice, copy.srcPitch = self.logits_padded.ptr, 4 * self.lm_head_rows
        copy.dstDevice, copy.dstPitch = self.logits.ptr, 4 * V
        copy.WidthInBytes, copy.Height = 4 * V, rows
        check(driver.cuMemcpy2DAsync(copy, stream), "cuMemcpy2DAsync(logits)")

    def is_bf16(self, bf16: frozenset[str], name: str) -> bool:
        """Whether a layer's projection `name` is served in bf16: every one without FP8
        weights, and those of the layer's `bf16` (_Layer.bf16) with them."""
        return not self.fp8 or name in bf16

    def _projections(self) -> list[tuple[str, int, int]]:
        """(weight, rows, columns) of a layer's projections, which the skinny kernels take in
        decode-sized buckets."""
        cfg = self.cfg
        H, I, Q, KV = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
        return [("wqkv", Q + 2 * KV, H), ("wo", H, Q), ("wgu", 2 * I, H), ("wdown", H, I)]

    def _tile_projections(self) -> None:
        """Each layer's tiled copies of its projections (_Layer.tiled; FP8: of their codes),
        and the LM head's (lm_head_tiled: bf16, or its codes with lm_head_fp8), made on the
        GPU."""
        k, cfg = self.kernels, self.cfg

        def tiled_copy(w: DeviceArray, rows: int, cols: int,
                       fp8: bool = False) -> DeviceArray | None:
            if not k.skinny_fits(1, cols, rows, fp8):
                return None  # no skinny kernel takes it
            copy = self._alloc(k.tiled_elements(rows, cols, 1 if fp8 else 2),
                               np.uint8 if fp8 else BF16)
            k.tile_weights(self.stream, w.ptr, copy.ptr, rows, cols, fp8)
            return copy
        for lw in self.layers:
            for name, rows, cols in self._projections():
                copy = tiled_copy(getattr(lw, name), rows, cols,
                                  not self.is_bf16(lw.bf16, name))
                if copy is not None:
                    lw.tiled[name] = copy
        self.lm_head_tiled = (
            tiled_copy(self.lm_head_codes, cfg.vocab_size, cfg.hidden_size, fp8=True)
            if self.lm_head_fp8 else tiled_copy(self.lm_head, cfg.vocab_size, cfg.hidden_size))
        synchronize(self.stream)

    def ops(self, rows: int, in_order: bool = True) -> list[tuple[str, object]]:
        """One forward pass over `rows` token rows (a bucket) as (label, enqueue) pairs in
        launch order; each enqueue() puts one op's kernel(s) on self.stream. Labels name what
        an op computes, the same for every layer (the decode benchmark's breakdown groups by
        them). in_order=False: no kernel lets the next one launch early on the assumption that
        the next is the op after it in this list (attention's release of the o projection, the
        RMSNorms' of theirs), for launching one label's ops on their own."""
        cfg, k, s, blas = self.cfg, self.kernels, self.stream, self.blas
        H, I, V, eps = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.rms_norm_eps
        Q, KV, D = cfg.q_size, cfg.kv_size, cfg.head_dim
        d = self.desc.ptr
        out: list[tuple[str, object]] = []

        def op(label, fn, *args, **kwargs):
            out.append((label, lambda: fn(*args, **kwargs)))

        def skinny(in_f, out_f, any_size):
            return self.skinny and k.skinny_preferred(rows, in_f, out_f, any_size)

        def skinny_weight(lw, name) -> tuple[int, bool]:
            """What a skinny kernel reads of lw's weight `name`: its tiled copy where there
            is one, else the row-major weight; and whether it is the tiled copy."""
            tiled = lw.tiled.get(name)
            return (tiled or getattr(lw, name)).ptr, tiled is not None

        def k_splits(in_f, out_f, kind="linear"):
            """CTAs a skinny projection's K is split across (clusters of two where it has
            few row blocks)."""
            return k.skinny_splits(kind, rows, in_f, out_f, self.skinny_split_blocks)

        def splitk(lw, name, in_f, out_f):
            """Whether the residual-adding projection lw.<name> runs the split-K kernel."""
            return (self.splitk_residual and not skinny(in_f, out_f, True) and name in lw.tiled
                    and k.splitk_fits(rows, in_f, out_f))

        def linear(label, x, lw, name, dst, in_f, out_f, accumulate=False, shadow=0):
            """dst (+)= x @ lw.<name>^T: bf16 out, or fp32 added into dst (the residual
            stream, and into its bf16 shadow when given)."""
            w = getattr(lw, name).ptr
            if skinny(in_f, out_f, accumulate or name in lw.tiled):
                w, tiled = skinny_weight(lw, name)
                op(label, k.skinny_linear, s, x, w, dst, rows, in_f, out_f,
                   SKINNY_F32_ADD if accumulate else SKINNY_BF16, shadow=shadow, w_tiled=tiled,
                   k_splits=k_splits(in_f, out_f))
            elif accumulate:
                if shadow:
                    raise ValueError(f"{label}: only the skinny kernel writes the shadow")
                if splitk(lw, name, in_f, out_f):
                    op(label, k.splitk_add_linear, s, x, lw.tiled[name].ptr, dst, rows, in_f,
                       out_f, desc=d, cluster=self.splitk_cluster)
                else:
                    op(label, blas.linear, x, w, dst, rows, in_f, out_f, R_32F, accumulate=True)
            else:
                op(label, blas.linear, x, w, dst, rows, in_f, out_f)

        # Decode-sized buckets: every RMSNorm runs inside the projection after it (which reads
        # the residual stream's bf16 shadow, written by the embedding and by the residual-adding
        # projections), and RoPE + KV write inside the qkv projection: 5 kernels a layer, not 8.
        # (the residual-adding projections must be skinny ones: only they write the shadow)
        fuse = (self.fuse_norm_rope and self.skinny and rows <= k.SKINNY_NORM_MAX_ROWS
                and k.skinny_fits(rows, H, Q + 2 * KV) and k.skinny_fits(rows, H, 2 * I)
                and skinny(Q, H, True) and skinny(I, H, True))
        if self.fp8:  # FP8 weights: the same fusion on the FP8 skinny kernels (fp8_layer),
            # and on the bf16 ones for the projections a checkpoint keeps in bf16
            projections = self._projections()
            fuse = (self.fuse_norm_rope and not cfg.o_proj_bias
                    and rows <= k.SKINNY_NORM_MAX_ROWS
                    and all(k.skinny_fits(rows, kin, kout, fp8=not self.is_bf16(lw.bf16, name))
                            for lw in self.layers for name, kout, kin in projections))
        shadow = self.x_shadow.ptr if fuse else 0
        # 17 to 32 rows: the split-K projections write no shadow, so the RMSNorm stays a kernel,
        # but the qkv projection runs the skinny kernel on its tiled copy, RoPE + KV write in
        # its epilogue. Alone it is about as fast as cuBLAS and the RoPE kernel (8B, 32 rows:
        # 599 against 517 + 91 us a step), but the step is 3% shorter (5.25 -> 5.09 ms): a
        # kernel fewer a layer, and the one it replaces is a cuBLAS GEMM, which starts cold
        # (no PDL)
        qkv_rope_after_norm = (self.skinny_qkv_rope and self.skinny
                               and rows > k.SKINNY_NORM_MAX_ROWS
                               and k.skinny_fits(rows, H, Q + 2 * KV))
        # a layer's RMSNorm kernels (one CTA a row) release the projection after them early,
        # so that its CTAs take the SMs the norm leaves idle and start on their weights (at
        # 17..32 rows; a cuBLAS GEMM after a norm, in larger steps, launches at its end anyway)
        norm_release = in_order and self.norm_release
        qkv_release = in_order and self.qkv_release_early  # (attention comes next)

        def chained(lw) -> bool:
            """Whether layer lw's o, gate|up and down projections run as one persistent kernel
            (batch 1, the norms fused, no o bias, the tiled copies), whose CTAs stream the three
            projections' weights through shared memory without a drain between them."""
            return (self.projection_chain and rows == 1 and fuse and lw.bo is None
                    and not lw.bf16 and all(n in lw.tiled for n in ("wo", "wgu", "wdown"))
                    and k.chain_fits(H, I, Q, self.fp8))

        def chain(li, lw):
            """Layer li's projections after attention on projection_chain (E4M3 weights: with
            their scales and the RMSNorm's weight)."""
            fp8 = ({"w_scales": tuple(lw.scales[n].ptr for n in ("wo", "wgu", "wdown")),
                    "norm_w": lw.post_norm.ptr} if self.fp8 else {})
            op("o proj + residual, rmsnorm + gate|up proj + silu*mul, down proj + residual",
               k.projection_chain, s, self.attn.ptr, lw.tiled["wo"].ptr, self.x.ptr,
               self.x_shadow.ptr, lw.tiled["wgu"].ptr, self.act.ptr, lw.tiled["wdown"].ptr, H,
               I, Q, eps, self.chain_counters.ptr + 4 * k.chain_counters_words * li, **fp8)

        # fp8_x_f16 in this bucket: the FP8 skinny kernels of one column tile take x's f16 form
        # from the kernel before (a chained layer's projections would write none)
        hand_x_f16 = (self.fp8_x_f16 and fuse and rows <= k.SKINNY_X_F16_MAX_ROWS
                      and not any(chained(lw) for lw in self.layers))
        x_f16 = self.x_f16.ptr if hand_x_f16 else 0
        act_f16 = self.act_f16.ptr if hand_x_f16 else 0
        x_sumsq = self.x_sumsq.ptr if hand_x_f16 and rows <= self.x_sumsq_max_rows else 0

        def f16_into(lw, name, form=x_f16):
            """x's f16 form (form) for layer lw's projection `name` where it is an FP8 one,
            which takes it from the kernel before, whatever that one's weights; 0 for bf16."""
            return 0 if self.is_bf16(lw.bf16, name) else form

        def fp8_linear(label, lw, name, dst, in_f, out_f, accumulate=False):
            """dst (+)= act_q @ lw.<name>^T on cuBLASLt's FP8 GEMM (E4M3 act_q with its rows'
            scales, the weight's codes with theirs): bf16 out, or fp32 added into dst. The
            GEMM's rows are the bucket's rounded up to 16 (FP8 GEMMs take whole 16s; the
            buffers have them)."""
            op(label, blas.linear_fp8, self.act_q.ptr, self.act_q_scale.ptr,
               getattr(lw, name).ptr, lw.scales[name].ptr, dst, _rows16(rows), in_f, out_f,
               R_32F if accumulate else R_16BF, accumulate)

        def layer_skinny(label, x, lw, name, dst, in_f, out_f, mode, fp8=True, norm_w=0,
                         **kwargs):
            """dst = x @ lw.<name>^T on the FP8 skinny kernel (its tiled copy where there is
            one), in `mode` (with the RMSNorm's weight given as norm_w: folded in); fp8 False:
            on the bf16 one (a projection the checkpoint keeps in bf16: its RMSNorm's weight is
            in it; it takes no f16 form of x, and writes one only for an FP8 kernel after it)."""
            w, tiled = skinny_weight(lw, name)
            splits = (1 if "norm_eps" in kwargs else
                      k.skinny_splits("linear", rows, in_f, out_f, self.skinny_split_blocks,
                                      fp8=fp8))
            scaled = {"w_scale": lw.scales[name].ptr, "norm_w": norm_w} if fp8 else {}
            op(label, k.skinny_linear, s, x, w, dst, rows, in_f, out_f, mode, w_tiled=tiled,
               k_splits=splits, **scaled, **kwargs)

        def fp8_layer(li, lw, rope_args, cache_args, kv_write, rope, attend):
            """One layer on FP8 weights: decode-sized buckets (fuse) on the FP8 skinny kernels,
            with the RMSNorms and RoPE + KV write folded in as on bf16 weights (the norms'
            weights given, not folded); others on cuBLASLt's FP8 GEMMs, each input quantized
            per token row first (by the RMSNorm and SiLU * up kernels themselves, attention's
            output by a kernel of its own). A projection the checkpoint keeps in bf16
            (_Layer.bf16) runs the bf16 path's kernel in its place, its input as that kernel
            takes it (the RMSNorm before it folded, or a bf16 kernel's)."""
            fp8 = {name: not self.is_bf16(lw.bf16, name) for name in FUSED_PROJECTIONS}
            following = self.layers[li + 1] if li + 1 < len(self.layers) else None
            # x's f16 form (and sums of squares): the embedding or the layer before's down to
            # qkv, o to gate|up, gate|up to down, down to the next layer's qkv
            qkv_f16, gu_f16 = f16_into(lw, "wqkv"), f16_into(lw, "wgu")
            down_f16 = f16_into(lw, "wdown", act_f16)
            next_f16 = f16_into(following, "wqkv") if following else 0
            if fuse and lw.q_norm is None:
                wqkv, tiled = skinny_weight(lw, "wqkv")
                norm = ({"w_scale": lw.scales["wqkv"].ptr, "norm_w": lw.input_norm.ptr,
                         "x_f16": qkv_f16, "x_sumsq": x_sumsq if qkv_f16 else 0}
                        if fp8["wqkv"] else {})
                op("rmsnorm + qkv proj + rope + kv write", k.skinny_qkv_rope, s, rows, d,
                   self.x_shadow.ptr, wqkv, H, eps, *rope_args, lw.bqkv.ptr if lw.bqkv else 0,
                   self.inv_freq.ptr, cfg.num_heads, cfg.num_kv_heads, *cache_args,
                   w_tiled=tiled, k_splits=k.skinny_splits("qkv_rope_norm", rows, H, Q + 2 * KV,
                                                           self.skinny_split_blocks,
                                                           fp8=fp8["wqkv"]),
                   release_next=qkv_release, **norm, **kv_write)
            else:
                if fuse:  # Qwen3: its per-head q/k norms keep RoPE a kernel
                    layer_skinny("rmsnorm + qkv proj", self.x_shadow.ptr, lw, "wqkv",
                                 self.qkv.ptr, H, Q + 2 * KV, SKINNY_BF16, norm_eps=eps,
                                 fp8=fp8["wqkv"], norm_w=lw.input_norm.ptr, x_f16=qkv_f16,
                                 x_sumsq=x_sumsq if qkv_f16 else 0)
                elif fp8["wqkv"]:
                    op("input rmsnorm", k.rms_norm_fp8, s, rows, d, self.x.ptr,
                       lw.input_norm.ptr, self.act_q.ptr, self.act_q_scale.ptr, H, eps)
                    fp8_linear("qkv proj", lw, "wqkv", self.qkv.ptr, H, Q + 2 * KV)
                else:
                    op("input rmsnorm", k.rms_norm, s, rows, d, self.x.ptr, self.unit_norm.ptr,
                       self.h.ptr, H, eps)
                    linear("qkv proj", self.h.ptr, lw, "wqkv", self.qkv.ptr, H, Q + 2 * KV)
                rope()
            attend(release_next=in_order and fuse)
            if chained(lw):
                return chain(li, lw)
            if fuse:
                # (x_f16: each writes the f16 form of x that the next one takes, o and down
                # times the next RMSNorm's weight; the last layer's down writes none)
                layer_skinny("o proj + residual", self.attn.ptr, lw, "wo", self.x.ptr, Q, H,
                             SKINNY_F32_ADD, fp8=fp8["wo"], shadow=self.x_shadow.ptr,
                             x_f16_out=gu_f16, x_f16_norm_w=lw.post_norm.ptr if gu_f16 else 0,
                             x_sumsq_out=x_sumsq if gu_f16 else 0)
                layer_skinny("rmsnorm + gate|up proj + silu*mul", self.x_shadow.ptr, lw, "wgu",
                             self.act.ptr, H, 2 * I, SKINNY_SILU_MUL, fp8=fp8["wgu"],
                             norm_eps=eps, norm_w=lw.post_norm.ptr, x_f16=gu_f16,
                             x_f16_out=down_f16, x_sumsq=x_sumsq if gu_f16 else 0)
                layer_skinny("down proj + residual", self.act.ptr, lw, "wdown", self.x.ptr, I, H,
                             SKINNY_F32_ADD, fp8=fp8["wdown"], shadow=self.x_shadow.ptr,
                             x_f16=down_f16, x_f16_out=next_f16,
                             x_f16_norm_w=following.input_norm.ptr if next_f16 else 0,
                             x_sumsq_out=x_sumsq if next_f16 else 0)
                return
            if fp8["wo"]:
                op("attention quantize", k.quantize_rows, s, rows, d, self.attn.ptr, Q,
                   self.act_q.ptr, Q, self.act_q_scale.ptr, Q)
                fp8_linear("o proj + residual", lw, "wo", self.x.ptr, Q, H, accumulate=True)
            else:
                linear("o proj + residual", self.attn.ptr, lw, "wo", self.x.ptr, Q, H,
                       accumulate=True)
            if fp8["wgu"]:
                op("post-attention rmsnorm", k.rms_norm_fp8, s, rows, d, self.x.ptr,
                   lw.post_norm.ptr, self.act_q.ptr, self.act_q_scale.ptr, H, eps,
                   bias=lw.bo.ptr if lw.bo else 0)
                fp8_linear("gate|up proj", lw, "wgu", self.gate_up.ptr, H, 2 * I)
            else:
                op("post-attention rmsnorm", k.rms_norm, s, rows, d, self.x.ptr,
                   self.unit_norm.ptr, self.h.ptr, H, eps, bias=lw.bo.ptr if lw.bo else 0)
                linear("gate|up proj", self.h.ptr, lw, "wgu", self.gate_up.ptr, H, 2 * I)
            if fp8["wdown"]:
                op("silu*mul", k.silu_mul_fp8, s, rows, d, self.gate_up.ptr, self.act_q.ptr,
                   self.act_q_scale.ptr, I)
                fp8_linear("down proj + residual", lw, "wdown", self.x.ptr, I, H,
                           accumulate=True)
            else:
                op("silu*mul", k.silu_mul, s, rows, d, self.gate_up.ptr, self.act.ptr, I)
                linear("down proj + residual", self.act.ptr, lw, "wdown", self.x.ptr, I, H,
                       accumulate=True)

        # (x's f16 form for the first qkv projection where it is an FP8 one)
        first_f16 = f16_into(self.layers[0], "wqkv")
        op("embedding", k.embedding, s, rows, d, self.token_ids.ptr, self.embed.ptr, self.x.ptr,
           H, V, x_shadow=shadow, x_f16=first_f16,
           norm_w=self.layers[0].input_norm.ptr if first_f16 else 0,
           x_sumsq=x_sumsq if first_f16 else 0)
        for li, lw in enumerate(self.layers):
            k_layer = self.k_cache.ptr + li * self._layer_kv_bytes
            v_layer = self.v_cache.ptr + li * self._layer_kv_bytes
            rope_args = (self.positions.ptr, self.token_seq.ptr, self.block_tables.ptr,
                         self.max_blocks_per_seq)
            cache_args = (self.q.ptr, k_layer, v_layer, self.block_size, self.num_blocks)
            kv_write = self._kv_write_args(li)  # an E4M3 cache's scales (and calibration)

            def rope(lw=lw, rope_args=rope_args, cache_args=cache_args, kv_write=kv_write):
                op("rope + kv write", k.rope_kv_write, s, rows, d, *rope_args, self.qkv.ptr,
                   lw.bqkv.ptr if lw.bqkv else 0, lw.q_norm.ptr if lw.q_norm else 0,
                   lw.k_norm.ptr if lw.k_norm else 0, eps, self.inv_freq.ptr, cfg.num_heads,
                   cfg.num_kv_heads, *cache_args, release_next=in_order and self.rope_release,
                   **kv_write)

            def attend(release_next, k_layer=k_layer, v_layer=v_layer, kv_write=kv_write):
                # (the workspace is sized for the choices made at construction: one changed
                # since, as a test may, would write past it)
                if rows * self.attention_split_stride(rows) > self.attn_partial_rows:
                    raise RuntimeError(f"attention's split workspace holds "
                                       f"{self.attn_partial_rows} rows, a {rows}-token step "
                                       f"needs {rows * self.attention_split_stride(rows)}")
                op("attention", k.attention, s, rows, d, self.positions.ptr,
                   self.token_seq.ptr, self.block_tables.ptr, self.max_blocks_per_seq,
                   self.q.ptr, k_layer, v_layer, self.block_size, cfg.num_heads,
                   cfg.num_kv_heads, D ** -0.5, self.attn.ptr, self.attention_splits(rows),
                   self.attn_partial_out.ptr, self.attn_partial_stats.ptr,
                   self.attn_tile_sems.ptr, small=self.attention_small(rows),
                   wide=self.attention_wide(rows), wgmma=self.attention_wgmma(rows),
                   roomy=self.attention_roomy(rows),
                   decode_min_keys=self.decode_min_keys,
                   release_next=release_next, kv_scales=kv_write["kv_scales"],
                   split_stride=self.attention_split_stride(rows))
            if self.fp8:
                fp8_layer(li, lw, rope_args, cache_args, kv_write, rope, attend)
                continue
            # RoPE + KV write ride in the skinny qkv projection, with the RMSNorm too (decode
            # buckets) or after its kernel (17 to 32 rows); Qwen3's per-head q/k norms need
            # whole heads, so there RoPE stays a kernel
            rope_in_qkv = lw.q_norm is None and (
                fuse or (qkv_rope_after_norm and "wqkv" in lw.tiled))
            if not fuse:
                op("input rmsnorm", k.rms_norm, s, rows, d, self.x.ptr, self.unit_norm.ptr,
                   self.h.ptr, H, eps, release_next=norm_release)
            if rope_in_qkv:
                wqkv, tiled = skinny_weight(lw, "wqkv")
                op("rmsnorm + qkv proj + rope + kv write" if fuse else
                   "qkv proj + rope + kv write", k.skinny_qkv_rope, s, rows, d,
                   self.x_shadow.ptr if fuse else self.h.ptr, wqkv, H, eps if fuse else None,
                   *rope_args, lw.bqkv.ptr if lw.bqkv else 0, self.inv_freq.ptr,
                   cfg.num_heads, cfg.num_kv_heads, *cache_args, w_tiled=tiled,
                   k_splits=k_splits(H, Q + 2 * KV, "qkv_rope_norm") if fuse else 1,
                   release_next=qkv_release, **kv_write)
            else:
                if fuse:
                    wqkv, tiled = skinny_weight(lw, "wqkv")
                    op("rmsnorm + qkv proj", k.skinny_linear, s, self.x_shadow.ptr, wqkv,
                       self.qkv.ptr, rows, H, Q + 2 * KV, SKINNY_BF16, norm_eps=eps,
                       w_tiled=tiled)
                else:
                    linear("qkv proj", self.h.ptr, lw, "wqkv", self.qkv.ptr, H, Q + 2 * KV)
                rope()
            # x += attn @ Wo^T: the residual add rides in the projection (fp32 output); o_proj's
            # bias (where a model has one) is added by the norm kernel, so it stays a kernel
            fuse_post = fuse and lw.bo is None
            attend(release_next=in_order and (chained(lw) or skinny(Q, H, True)
                                              or splitk(lw, "wo", Q, H)))
            if chained(lw):
                chain(li, lw)
                continue
            linear("o proj + residual", self.attn.ptr, lw, "wo", self.x.ptr, Q, H,
                   accumulate=True, shadow=shadow if fuse_post else 0)
            if fuse_post:
                wgu, tiled = skinny_weight(lw, "wgu")
                op("rmsnorm + gate|up proj + silu*mul", k.skinny_linear, s, self.x_shadow.ptr,
                   wgu, self.act.ptr, rows, H, 2 * I, SKINNY_SILU_MUL, norm_eps=eps,
                   w_tiled=tiled)
            else:
                op("post-attention rmsnorm", k.rms_norm, s, rows, d, self.x.ptr,
                   self.unit_norm.ptr, self.h.ptr, H, eps, bias=lw.bo.ptr if lw.bo else 0,
                   release_next=norm_release)
                if skinny(H, 2 * I, True):
                    wgu, tiled = skinny_weight(lw, "wgu")
                    op("gate|up proj + silu*mul", k.skinny_linear, s, self.h.ptr, wgu,
                       self.act.ptr, rows, H, 2 * I, SKINNY_SILU_MUL, w_tiled=tiled)
                # 17 to 32 rows: a CTA's 128 rows over all of K, SiLU in its epilogue (8B, 32
                # rows: 1,974 us a step against cuBLAS's 1,957 and the SiLU kernel's 72)
                elif (self.rowblock_gate_up and "wgu" in lw.tiled
                      and k.rowblock_preferred(rows, H, 2 * I)):
                    op("gate|up proj + silu*mul", k.rowblock_silu_mul, s, rows, d, self.h.ptr,
                       lw.tiled["wgu"].ptr, self.act.ptr, H, 2 * I,
                       cluster=self.rowblock_cluster)
                else:
                    linear("gate|up proj", self.h.ptr, lw, "wgu", self.gate_up.ptr, H, 2 * I)
                    op("silu*mul", k.silu_mul, s, rows, d, self.gate_up.ptr, self.act.ptr, I)
            linear("down proj + residual", self.act.ptr, lw, "wdown", self.x.ptr, I, H,
                   accumulate=True, shadow=shadow)
        logit_rows = min(rows, self.max_num_seqs)
        lm_head_tiled = self.lm_head_tiled is not None
        # the skinny LM head also reduces each row's greedy argmax, which the sampling kernel
        # takes for greedy rows instead of scanning the logits (csrc/argmax.cuh)
        lm_argmax = 0
        if self.lm_head_fp8:
            skinny_head = self.skinny and k.skinny_fits(logit_rows, H, V, fp8=True)
            head = self.lm_head_codes
        else:
            skinny_head = self.skinny and k.skinny_preferred(logit_rows, H, V, lm_head_tiled)
            head = self.lm_head
        # hand_x_f16: the final norm writes the FP8 skinny LM head's input in its f16 form too
        head_f16 = x_f16 if self.lm_head_fp8 and skinny_head else 0
        op("final rmsnorm", k.rms_norm, s, logit_rows, d, self.x.ptr, self.final_norm.ptr,
           self.h_logits.ptr, H, eps, gather=self.logit_token.ptr, max_rows=rows,
           x_f16=head_f16, release_next=self.final_norm_release and in_order and skinny_head)
        if skinny_head:
            lm_argmax = self.lm_argmax.ptr if self.lm_head_argmax else 0
            head = self.lm_head_tiled if lm_head_tiled else head
            op("lm head", k.skinny_linear, s, self.h_logits.ptr, head.ptr, self.logits.ptr,
               logit_rows, H, V, SKINNY_F32, w_tiled=lm_head_tiled,
               k_splits=k.skinny_splits("linear", logit_rows, H, V, self.skinny_split_blocks,
                                        fp8=self.lm_head_fp8),
               argmax=lm_argmax, w_scale=self.lm_head_scale.ptr if self.lm_head_fp8 else 0,
               x_f16=head_f16)
        elif self.lm_head_fp8:  # the final RMSNorm's rows quantized, then the FP8 GEMM
            op("lm head quantize", k.quantize_rows, s, logit_rows, 0, self.h_logits.ptr, H,
               self.act_q.ptr, H, self.act_q_scale.ptr, H)
            padded = self.logits_padded is not None
            op("lm head", blas.linear_fp8, self.act_q.ptr, self.act_q_scale.ptr,
               self.lm_head_codes.ptr, self.lm_head_scale.ptr,
               (self.logits_padded if padded else self.logits).ptr, _rows16(logit_rows), H,
               self.lm_head_rows, R_32F, False)
            if padded:
                op("lm head unpad", self._unpad_logits, s, logit_rows)
        else:
            op("lm head", blas.linear, self.h_logits.ptr, self.lm_head.ptr, self.logits.ptr,
               logit_rows, H, V, R_32F)
        op("sample", k.sample, s, logit_rows, d, self.logits.ptr, V, self.temperature.ptr,
           self.top_p.ptr, self.top_k.ptr, self.seed.ptr, self.step.ptr, self.sampled.ptr,
           lm_argmax=lm_argmax, done_sem=self.sample_done_sem.ptr)  # and ends the graph
        return out

    def _record(self, rows: int) -> None:
        """Enqueues one forward pass over `rows` token rows (a bucket) on self.stream."""
        for _, enqueue in self.ops(rows):
            enqueue()

    def _write_batch_counts(self, counts: np.ndarray) -> None:
        """Queues the BatchDesc's num_tokens, num_seqs and num_logits (int32 [3]; the done
        counter is the graphs' to write). `counts` must live until the stream has passed it."""
        check(driver.cuMemcpyHtoDAsync(self.desc.ptr, counts.ctypes.data, counts.nbytes,
                                       self.stream), "cuMemcpyHtoDAsync(desc)")

    def _describe_empty_batch(self) -> None:
        """Writes an empty batch into the device's BatchDesc. A launch of bucket b's kernels
        may trust num_tokens <= b, so capture's passes must not run on a batch left there by an
        earlier run: the E4M3 cache's calibration prefill leaves up to 512 tokens
        (fp8.calibration_count), and the attention kernel of a smaller bucket then wrote its
        query tiles' partial sums outside the workspace."""
        empty = np.zeros(3, np.int32)
        self._write_batch_counts(empty)
        synchronize(self.stream)

    def _capture(self, rows: int):
        self._describe_empty_batch()
        if self.gemm_tuner is not None:
            # the bucket's GEMMs recorded, not launched (its other kernels run, as in the
            # eager pass below, on an empty batch)
            with self.blas.recording() as calls:
                self._record(rows)
            self.gemm_tuner.tune(calls)
        # One eager pass first (an empty batch: our kernels exit at once, the GEMMs run on
        # whatever their inputs hold) so that module loading and cuBLAS's first-call set-up
        # stay out of the capture.
        self._record(rows)
        synchronize(self.stream)
        mode = driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        check(driver.cuStreamBeginCapture(self.stream, mode), "cuStreamBeginCapture")
        try:
            self._record(rows)
        except BaseException:
            driver.cuStreamEndCapture(self.stream)
            raise
        graph = check(driver.cuStreamEndCapture(self.stream), "cuStreamEndCapture")
        try:
            self.graph_node_types[rows] = _node_types(graph)
            self.graph_edge_types[rows] = _edge_types(graph)
            flags = driver.CUgraphInstantiate_flags.CUDA_GRAPH_INSTANTIATE_FLAG_DEVICE_LAUNCH
            try:
                exe = check(driver.cuGraphInstantiate(graph, int(flags)),
                            f"cuGraphInstantiate(bucket {rows}, device launch)")
            except CudaError as e:
                raise CudaError(f"{e}; graph nodes: {self.graph_node_types[rows]}") from None
            check(driver.cuGraphUpload(exe, self.stream), "cuGraphUpload")
            synchronize(self.stream)
        finally:
            driver.cuGraphDestroy(graph)
        return exe

    # --- the E4M3 KV cache's scales ----------------------------------------------------------

    def _kv_write_args(self, layer: int) -> dict[str, int]:
        """A KV writer's kv_scales and kv_amax for `layer` (0 with a bf16 cache; kv_amax only
        while calibrate_kv_scales runs)."""
        if not self.kv_fp8:
            return {"kv_scales": 0, "kv_amax": 0}
        at = layer * 2 * self.cfg.num_kv_heads * 4
        return {"kv_scales": self.kv_scales.ptr + at,
                "kv_amax": self.kv_amax.ptr + at if self._calibrating else 0}

    def set_kv_scales(self, scales: np.ndarray) -> None:
        """The E4M3 cache's scales: [num_layers, 2, num_kv_heads] float32 (keys', values'), or
        [num_layers, 2] (one a layer's keys, one its values: a checkpoint's k_scale, v_scale)."""
        cfg = self.cfg
        given = list(np.shape(scales))
        scales = per_head_kv_scales(scales, cfg.num_kv_heads)
        if scales.shape != (cfg.num_layers, 2, cfg.num_kv_heads):
            raise ValueError(f"KV scales must be [{cfg.num_layers}, 2(, {cfg.num_kv_heads})], "
                             f"got {given}")
        if not (np.isfinite(scales).all() and (scales > 0).all()):
            raise ValueError(f"KV scales must be positive and finite, got "
                             f"{scales[~(np.isfinite(scales) & (scales > 0))][:4]}")
        self.kv_scales.upload(scales)

    def calibrate_kv_scales(self, tokens: np.ndarray | None = None) -> np.ndarray:
        """Sets the E4M3 cache's scales from one prefill of `tokens` (default
        fp8.calibration_tokens, fp8.calibration_count of them): each head's
        largest |key| and |value| that pass wrote (the KV writers note them, kv_amax) lands at
        1 / fp8.KV_HEADROOM of E4M3's range (fp8.kv_scales_from_amax); the pass itself runs on
        scales of 1. Returns the scales, [num_layers, 2, num_kv_heads]."""
        if not self.kv_fp8:
            raise ValueError("calibrate_kv_scales calibrates an E4M3 KV cache")
        if tokens is None:
            count = calibration_count(self.max_tokens, self.max_model_len,
                                      self.num_blocks * self.block_size)
            tokens = calibration_tokens(self.cfg.vocab_size, count)
        n = len(tokens)
        blocks = -(-n // self.block_size)
        batch = ForwardBatch(np.asarray(tokens, np.int32), np.arange(n, dtype=np.int32),
                             np.array([0, n], np.int32), np.array([n], np.int32),
                             np.arange(blocks, dtype=np.int32)[None, :],
                             np.zeros(1, np.int32))
        self.set_kv_scales(np.ones((self.cfg.num_layers, 2), np.float32))
        self.kv_amax.fill_bytes(0)
        self._calibrating = True
        try:
            self.run(batch, eager=True)
        finally:
            self._calibrating = False
        scales = kv_scales_from_amax(self.kv_amax.download())
        self.set_kv_scales(scales)
        return scales

    # --- for the scheduler kernel ---------------------------------------------------------------

    def attention_splits(self, bucket: int) -> int:
        """The most CTAs that may share one decode token's (or query tile's) keys in a bucket
        (the grid's z), at most the kernel's attention_max_splits (64, what its split merge is
        sized for): when every token of the bucket decodes, the count up to about two waves
        whose CTAs fill the GPU's attention slots (CTAs per SM x SMs) in whole waves best, the
        smaller of equally good ones. A partial last wave costs a whole CTA's time for a few
        CTAs. Of two counts that fill their waves equally, the larger takes more waves, which
        the kernel's cost model never uses (DecodeChunksPerSplit: twice the waves for half the
        keys a split costs more), so its extra CTAs only launch and exit: at batch 1, 32
        splits (one wave) instead of 64 (512 CTAs, 1B and 8B), 1B's step up to 1.5% shorter,
        8B's within -0.5 to +0.1% (H100, docs/performance.md round 47). A decode token may use
        fewer: the kernel weighs waves against keys per CTA for its context
        (attention_decode.cuh DecodeChunksPerSplit; batch 32 at 512 keys takes one split).
        Measured on the H200 (bench_decode, Llama-3.1-8B shape, with the previous, CUDA-core
        decode path): batch 1 at 8,192 keys, 49 splits (392 CTAs in 396 slots) 5.03 ms a step
        against 5.20 with 64 (1.3 waves); batch 32 at 4,096 keys, 3 splits (768 CTAs, 1.94
        waves) 11.90 ms against 13.65 with 1 (a wave 65% full).
        A sequence uses fewer when its keys are short (whole key tiles per split), so short
        contexts stay one or a few CTAs and long ones spread over the GPU."""
        k = self.kernels
        slots = k.attention_slots(self.attention_small(bucket), self.block_size,
                                  self.attention_wide(bucket), self.attention_wgmma(bucket),
                                  self.attention_roomy(bucket))
        ctas = bucket * self.cfg.num_kv_heads

        def fill(splits):
            return ctas * splits / (-(-ctas * splits // slots) * slots)
        cap = min(k.attention_max_splits, self.max_attention_splits or k.attention_max_splits)
        most = max(1, min(cap, -(-2 * slots // ctas)))
        return max(range(1, most + 1), key=lambda s: (fill(s), -s))

    # Buckets of at most this many tokens let a query tile's keys split over its other tokens'
    # CTAs (attention_split_stride): there a chunk of a few hundred tokens deep into its context
    # (a prefix-cache hit, the end of a chunked prompt) has too few tiles to fill the GPU. Its
    # cost is the workspace, 16 splits a token row at most on the 64-row tiles: 134 MB at 8B.
    ATTENTION_SPREAD_MAX_BUCKET = 512

    def attention_split_stride(self, bucket: int) -> int:
        """The workspace's splits per query row in a bucket (ForwardKernels.attention's
        split_stride): attention_splits, times the tokens of a query tile where their CTAs
        take splits of its keys too (ATTENTION_SPREAD_MAX_BUCKET), up to attention_max_splits.
        Measured on the H200 (bench_decode --prefill 100x2100, Llama-3.1-8B shape): see
        docs/performance.md, prefix caching."""
        splits = self.attention_splits(bucket)
        if bucket > self.attention_spread_max_bucket:
            return splits
        return self.kernels.attention_spread_stride(
            splits, self.cfg.num_heads // self.cfg.num_kv_heads, self.attention_small(bucket),
            self.attention_wgmma(bucket))

    # Models at least this wide run the split-K kernel in clusters of two CTAs and the row-block
    # one in clusters of four, which share x's reads from L2. Measured on the H200
    # (bench_decode, two runs each): both in twos against one CTA, 8B a step 5.0% faster at 24
    # x 512, 1.9% at 32 x 512, 1.4% at 32 x 4,096, the same at 16 rows; 1B (2,048 wide) 1.3%
    # slower at 32 x 512, its down projection 2% slower alone. Both in fours: 8B 32 x 512 3%
    # slower than in twos (the split-K o and down projections 20% and 10% slower alone, gate|up
    # 3.5% faster); gate|up alone in fours: 2%, 0.8% and 1% faster than in twos at 24 x 512,
    # 32 x 512 and 32 x 4,096 (5.02 -> 4.98 ms at 32 x 512).
    X_SLAB_CLUSTER_MIN_HIDDEN = 4096

    # Decode tokens attending to at least this many keys take the flash-decoding path; shorter
    # ones go in the query tiles. Measured on the H200 (bench_decode --tile-attention
    # --decode-attention, batch 1 and 32 at 512 to 8,192 keys, both shapes): the decode path
    # is as fast or faster everywhere (8B, 32 x 2048: 7.41 ms a step against 8.47), so every
    # decode token takes it; the tiles remain for prefill chunks and for GQA groups over 8.
    DECODE_MIN_KEYS = 0

    def attention_small(self, bucket: int) -> bool:
        """Decode-sized buckets use the attention variant with fewer query rows per CTA."""
        group = self.cfg.num_heads // self.cfg.num_kv_heads
        return bucket <= 64 and group <= self.kernels.attention_small_rows

    def attention_wide(self, bucket: int) -> bool:
        """Decode-sized buckets whose (token, KV head) pairs fit one wave of the wide kernel's
        CTAs take it (more warps a CTA: a decode token's keys in fewer splits;
        csrc/attention_common.cuh kAttnWideWarps): Llama-3.1-8B's buckets of up to 16 tokens
        (one 8-warp CTA an SM), 1B's of up to 32 (two)."""
        k = self.kernels
        return (self.attention_small(bucket) and k.attention_wide_threads > k.attention_threads
                and bucket * self.cfg.num_kv_heads
                <= k.attention_slots(True, self.block_size, wide=True))

    # Buckets of at least this many tokens run the wgmma attention kernel (128-row query tiles
    # on two warpgroups, csrc/attention_common.cuh kAttnWgmmaRows); smaller ones the mma.sync
    # tiles. Measured on the H200, Llama-3.1-8B shape with FP8 weights: a 2,048-token chunk to
    # context 8,192 (bench_decode --prefill) 1,360 -> 915 us of attention a layer (177 -> 263
    # TFLOP/s; 1,535 -> 1,373 with the FP8 cache), the live 8,000-token first token 238 ->
    # 216 ms (FP8 cache); but with every bucket on it the live 256-stream run (steps of ~460
    # tokens, bucket 512, decodes beside 256-token prompts, FP8 cache) went 19,665 -> 17,750
    # generated tok/s (11.4 -> 12.7 ms a step), so the mixed buckets keep the mma.sync tiles.
    # 1,024 and 1,536 are not measured: the line sits at the one measured each way.
    ATTENTION_WGMMA_MIN_BUCKET = 2048

    def attention_wgmma(self, bucket: int) -> bool:
        """Prefill-sized buckets take the wgmma attention kernel (ATTENTION_WGMMA_MIN_BUCKET;
        never the decode-sized ones, attention_small), where the module has it: built for
        sm_90a, head dims 64 and 128 (ForwardKernels.attention_wgmma_available)."""
        return (bucket >= self.attention_wgmma_min_bucket and not self.attention_small(bucket)
                and self.kernels.attention_wgmma_available)

    # Buckets of at most this many tokens that run the large mma.sync tiles take the roomy
    # attention kernel (attention_roomy). Round 38 (docs/performance.md, one H200): a warm
    # prefix request's 100-token chunk at 2,100 keys, 8B bf16 6.90 -> 6.73 ms and 6.55 -> 6.33
    # in two calls, FP8 5.86 -> 5.67; the 52-token chunk and the 128-row decode step unchanged.
    ATTENTION_ROOMY_MAX_BUCKET = 128

    # Buckets of at most this many rows take x's sums of squares handed over by default
    # (fp8_x_sumsq). Round 39 (docs/performance.md, one H200, FP8 weights and cache, two
    # orders): 8B batch 1 2.300, 2.301 -> 2.266, 2.248 ms; 1B batch 1 0.531, 0.533 -> 0.534,
    # 0.533; batch 8 slower on both (8B 2.448 -> 2.490, 2.548; 1B 0.609 -> 0.637, 0.647). So 1
    # (round 40: its GPU tests passed on the H200).
    X_SUMSQ_DEFAULT_MAX_ROWS = 1

    def attention_roomy(self, bucket: int) -> bool:
        """Buckets of up to attention_roomy_max_bucket tokens that run the large mma.sync query
        tiles (neither decode-sized nor on wgmma) take the roomy kernel: two CTAs an SM rather
        than three at head dim 128, so the tile loop's ldmatrix issue well ahead of their MMAs
        (csrc/attention_common.cuh kAttnRoomyMinCtas). For a short chunk deep into its context
        (a prefix-cache hit's 100 tokens at 2,100 keys: round 27's 3.4 us a 64-key tile, its
        warps waiting on shared-memory results); the decode tokens of such a bucket take the
        same kernel's decode path."""
        return (bucket <= self.attention_roomy_max_bucket and not self.attention_small(bucket)
                and not self.attention_wgmma(bucket))

    def bucket_for(self, num_tokens: int) -> int | None:
        """The smallest bucket holding num_tokens, None when it exceeds the largest."""
        return next((b for b in self.buckets if b >= num_tokens), None)

    @property
    def graph_exec_handles(self) -> dict[int, int]:
        return {b: int(e) for b, e in self.graph_execs.items()}

    def device_pointers(self) -> dict[str, int]:
        names = ("desc", "token_ids", "positions", "token_seq", "context_lens", "block_tables",
                 "logit_token", "temperature", "top_p", "top_k", "seed", "step", "logits",
                 "sampled", "k_cache", "v_cache")
        return {n: getattr(self, n).ptr for n in names}

    def pointer(self, name: str) -> int:
        """One device pointer by name: a device_pointers() key or 'done_counter' (inside desc)."""
        if name == "done_counter":
            return self.desc.ptr + BATCH_DESC_DTYPE.fields["done_counter"][1]
        return self.device_pointers()[name]

    def done_count(self) -> int:
        return int(self.desc.download()[0]["done_counter"])

    def fill_kv_cache(self, byte: int) -> None:
        """Every KV-cache byte set to `byte` (0xFF = NaN: tests prove unwritten slots unread)."""
        self.k_cache.fill_bytes(byte)
        self.v_cache.fill_bytes(byte)

    def randomize_kv_cache(self, seed: int) -> None:
        """Keys and values uniform in [-1, 1), for benchmarks: a cache of one repeated value
        toggles no bits on its way through the attention kernel and draws less power than the
        cache of a live run (docs/performance.md, *Power*). An E4M3 cache gets the codes of
        such values (random bytes would hold NaN codes)."""
        if self.kv_fp8:
            from blink.gpu_engine import cuda_runtime as cr
            fill = self._random_fill("fill_uniform_e4m3")
            for i, arr in enumerate((self.k_cache, self.v_cache)):
                cr.launch(fill, 4096, 256, (arr.ptr, arr.nbytes, seed + i, 1.0),
                          (ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_float),
                          self.stream)
        else:
            self._fill_uniform(self.k_cache, seed, 1.0)
            self._fill_uniform(self.v_cache, seed + 1, 1.0)
        synchronize(self.stream)

    # --- the host-side test path ------------------------------------------------------------

    def run(self, batch: ForwardBatch, temperature=0.0, top_p=1.0, top_k=0, seed=0, step=0, *,
            eager: bool = False, sampled_only: bool = False):
        """Writes the batch into the device arrays, launches its bucket's graph from the host
        (eager=True: the same kernels without a graph), waits, and returns
        (logits [L, V] f32, sampled [L] i32) for the batch's logit_seqs, in their order.
        Sampling parameters are scalars or sequences of length L. sampled_only: the host
        loop's step (HostDrivenCudaEngine): copies, launch and the sampled ids' read-back
        queued on the stream with one wait at the end, no logits, and (None, sampled)."""
        cfg = self.cfg
        T, S, L = batch.num_tokens, batch.num_seqs, len(batch.logit_seqs)
        bucket = self.bucket_for(T)
        if bucket is None or T < 1:
            raise ValueError(f"{T} tokens: outside [1, {self.max_tokens}]")
        if S > self.max_num_seqs:
            raise ValueError(f"{S} sequences > max_num_seqs {self.max_num_seqs}")
        width = batch.block_tables.shape[1]
        if width > self.max_blocks_per_seq:
            raise ValueError(f"block tables {width} wide > max_blocks_per_seq "
                             f"{self.max_blocks_per_seq}")
        starts = np.asarray(batch.seq_starts, np.int64)
        tables = np.full((S, self.max_blocks_per_seq), -1, np.int32)
        tables[:, :width] = batch.block_tables
        logit_seqs = np.asarray(batch.logit_seqs, np.int64)

        def per_row(v, dtype):
            return np.ascontiguousarray(np.broadcast_to(np.asarray(v, dtype), (L,)))

        host = {  # kept alive until the stream has passed the copies
            self.token_ids: np.asarray(batch.token_ids, np.int32),
            self.positions: np.asarray(batch.positions, np.int32),
            self.token_seq: np.repeat(np.arange(S), np.diff(starts)).astype(np.int32),
            self.context_lens: np.asarray(batch.context_lens, np.int32),
            self.block_tables: tables,
            self.logit_token: (starts[logit_seqs + 1] - 1).astype(np.int32),
            self.temperature: per_row(temperature, np.float32),
            self.top_p: per_row(top_p, np.float32),
            self.top_k: per_row(top_k, np.int32),
            self.seed: per_row(seed, np.uint64),
            self.step: per_row(step, np.uint32),
            # num_tokens, num_seqs, num_logits; done_counter is the graph's to write
            self.desc: np.array([T, S, L], np.int32),
        }
        for dev, arr in host.items():
            if dev is self.desc:
                self._write_batch_counts(arr)
            else:
                dev.upload(arr, self.stream)
        if sampled_only:
            sampled = np.empty(L, np.int32)
            check(driver.cuGraphLaunch(self.graph_execs[bucket], self.stream), "cuGraphLaunch")
            check(driver.cuMemcpyDtoHAsync(sampled.ctypes.data, self.sampled.ptr, sampled.nbytes,
                                           self.stream), "cuMemcpyDtoHAsync(sampled)")
            synchronize(self.stream)
            return None, sampled
        synchronize(self.stream)
        before = self.done_count()
        if eager:
            self._record(bucket)
        else:
            check(driver.cuGraphLaunch(self.graph_execs[bucket], self.stream), "cuGraphLaunch")
        synchronize(self.stream)
        if self.done_count() != before + 1:
            raise CudaError(f"done_counter moved from {before} to {self.done_count()}, not by 1")
        logits = self.logits.download(L * cfg.vocab_size).reshape(L, cfg.vocab_size)
        return logits, self.sampled.download(L)

    @contextlib.contextmanager
    def holding_sms(self):
        """`with fwd.holding_sms():` held_sms CTAs (blink_hold_sm: the scheduler kernel's
        threads, registers and shared memory) spin on their own stream while the body runs
        graphs on self.stream, as the scheduler kernel's CTA holds its SM while the graphs it
        launched run. Nothing in the body may wait for the whole context (cuCtxSynchronize, a
        free, fill_bytes): it would wait for the spinning CTAs. So it cannot nest."""
        if self._hold_release is None:
            yield
            return
        if self._holding:
            raise RuntimeError("holding_sms does not nest: the inner one would wait for the "
                               "outer one's spinning CTAs")
        k = self.kernels
        hold, release = new_stream(), new_stream()
        self._holding = True
        try:  # the flag reset in stream order before the launch: no context-wide wait
            check(driver.cuMemsetD32Async(self._hold_release.ptr, 0, 1, hold))
            launch(k.fn["blink_hold_sm"], k.held_sms, engine_layout.SCHEDULER_THREADS,
                   (self._hold_release.ptr,), (ctypes.c_void_p,), hold)
            yield
        finally:  # the release comes on a stream of its own: the holding one is busy
            self._holding = False
            check(driver.cuMemsetD32Async(self._hold_release.ptr, 1, 1, release))
            synchronize(hold)
            driver.cuStreamDestroy(hold)
            driver.cuStreamDestroy(release)

    def close(self) -> None:
        for exe in self.graph_execs.values():
            driver.cuGraphExecDestroy(exe)
        self.graph_execs.clear()
        self.blas.close()
        for arr in self._memory:
            arr.free()
        self._memory.clear()
        driver.cuStreamDestroy(self.stream)


def _edge_types(graph) -> dict[str, int]:
    """Counts of the graph's dependency edge types: {'DEFAULT': n, 'PROGRAMMATIC': m}."""
    count = check(driver.cuGraphGetEdges(graph, 0), "cuGraphGetEdges")[-1]
    _, _, data, _ = check(driver.cuGraphGetEdges(graph, count), "cuGraphGetEdges")
    return dict(Counter(driver.CUgraphDependencyType(int(d.type)).name.replace(
        "CU_GRAPH_DEPENDENCY_TYPE_", "") for d in data))


def _node_types(graph) -> dict[str, int]:
    """Counts of the graph's node types, e.g. {'KERNEL': 40}."""
    _, _, count = driver.cuGraphGetNodes(graph, 0)
    nodes, _ = check(driver.cuGraphGetNodes(graph, count), "cuGraphGetNodes")
    kinds = Counter()
    for node in nodes:
        kind = check(driver.cuGraphNodeGetType(node), "cuGraphNodeGetType")
        kinds[getattr(kind, "name", str(kind)).replace("CU_GRAPH_NODE_TYPE_", "")] += 1
    return dict(kinds)
