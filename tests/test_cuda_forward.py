"""The CUDA forward pass: every kernel against a NumPy reference, cuBLAS through our binding, and
the whole graph-launched forward against gpu_engine.reference_model on tiny checkpoints of all
three architectures (bf16 weights on both sides).

Needs an NVIDIA GPU, cuda-python and nvcc; skipped otherwise (CI). Nothing CUDA is imported at
module import: the skip check imports cuda.bindings inside a function and survives its absence.
Outputs are poisoned (0xFF bytes: NaN for floats, -1 for ints) before each launch, so an element
the kernel should write and did not shows up, and so does one it should not have written.
Set BLINK_GPU_REPORT=<file.json> to collect the measured errors and environment facts.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import types
from pathlib import Path

import numpy as np
import pytest
from gpu import free_device_arrays_after_each_test, requires_gpu  # noqa: F401 (autouse)

from blink.gpu_engine.checkpoint import load_config, load_weights, rope_inv_freq
from blink.gpu_engine.demo_model import float32_to_bf16_bits, write_random_checkpoint
from blink.gpu_engine.forward_batch import ForwardBatch
from blink.gpu_engine.fp8 import dequantize_rows, e4m3_to_float32, float32_to_e4m3, \
    quantize_rows
from blink.gpu_engine.reference_model import ReferenceModel
from blink.gpu_engine.sampling import sample_token, sampling_distribution, uniform
from blink.gpu_engine.sequence import SamplingParams


pytestmark = [pytest.mark.gpu, requires_gpu()]

CSRC = Path(__file__).resolve().parents[1] / "gpu_engine" / "csrc"
POISON_F32 = 0xFFFFFFFF
POISON_BF16 = 0xFFFF
REPORT: dict = {"errors": {}, "env": {}}


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    path = os.environ.get("BLINK_GPU_REPORT")
    if path:
        old = json.loads(Path(path).read_text()) if Path(path).is_file() else {}
        for key, value in REPORT.items():
            old.setdefault(key, {}).update(value)
        Path(path).write_text(json.dumps(old, indent=1, sort_keys=True, default=str))


def rb(x) -> np.ndarray:
    """x rounded to bf16, as float32."""
    return bf16_to_f32(float32_to_bf16_bits(np.asarray(x, np.float32)))


def bf16_to_f32(bits) -> np.ndarray:
    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32)


def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


@pytest.fixture(scope="module")
def cf():
    from blink.gpu_engine import cuda_forward
    cuda_forward.primary_context()
    return cuda_forward


@pytest.fixture(scope="module")
def stream(cf):
    return cf.new_stream()


_KERNELS = {}


def kernels(cf, head_dim: int = 64, kv_fp8: bool = False):
    """The forward module for head_dim (kv_fp8: built for an E4M3 KV cache), loaded once."""
    if (head_dim, kv_fp8) not in _KERNELS:
        _KERNELS[head_dim, kv_fp8] = cf.ForwardKernels(head_dim, kv_fp8=kv_fp8)
    return _KERNELS[head_dim, kv_fp8]


def e4m3_half_step(v) -> np.ndarray:
    """Half the spacing of the E4M3 grid around each |v| (a rounding's largest error there):
    2^(e - 4) in the binade [2^e, 2^(e + 1)), 2^-10 in the subnormal range."""
    a = np.abs(np.asarray(v, np.float64))
    e = np.floor(np.log2(np.maximum(a, 2.0 ** -6)))
    return 2.0 ** (e - 4)


def f16_input(x) -> np.ndarray:
    """x as the FP8 skinny kernels feed it to their f16 MMAs: times 1/16, rounded to f16 (round
    to nearest even, as __floats2half2_rn), times 16 again; float64."""
    return (np.asarray(x, np.float32) * np.float32(1 / 16)).astype(np.float16).astype(
        np.float64) * 16


def f16_form(x, norm_w=None) -> np.ndarray:
    """x's f16 form as the FP8 skinny kernels' MMAs take it, as bits (csrc/fp8.cuh
    Fp8MmaInput): x (bf16 values) times norm_w in float32, times 1/16, rounded to f16."""
    v = np.asarray(x, np.float32)
    if norm_w is not None:
        v = v * np.asarray(norm_w, np.float32)
    return (v * np.float32(1 / 16)).astype(np.float16).view(np.uint16)


def assert_f16_form_written(form, rows, out, shadow, from_out, next_norm_w) -> None:
    """The next FP8 projection's f16 form of x as a skinny kernel wrote it (poisoned first):
    from its bf16 output (from_out: SiLU * up, every row written) or from the residual
    stream's shadow times the next RMSNorm's weight, exactly, and nothing past `rows`."""
    if from_out:
        assert (out[:rows] != POISON_BF16).all()
        np.testing.assert_array_equal(form[:rows], f16_form(bf16_to_f32(out[:rows])))
    else:
        np.testing.assert_array_equal(form[:rows],
                                      f16_form(bf16_to_f32(shadow[:rows]), next_norm_w))
    assert (form[rows:] == POISON_BF16).all()


def fp8_weight(w) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes, scales, their float64 values) of w quantized per row (gpu_engine/fp8.py)."""
    codes, scale = quantize_rows(w)
    return codes, scale, dequantize_rows(codes, scale).astype(np.float64)


def dev(cf, arr, poison: bool = False):
    d = cf.DeviceArray.from_numpy(np.ascontiguousarray(arr))
    if poison:
        d.fill_bytes(0xFF)
    return d


def desc(cf, num_tokens, num_seqs=1, num_logits=0):
    return dev(cf, np.array([(num_tokens, num_seqs, num_logits, 0)], cf.BATCH_DESC_DTYPE))


class PagedBatch:
    """Sequences [(start_position, num_tokens)] laid out flat, with shuffled KV blocks."""

    def __init__(self, seqs, block_size, rng, extra_blocks=3):
        self.seqs, self.block_size = seqs, block_size
        self.positions = np.concatenate([np.arange(p, p + n) for p, n in seqs]).astype(np.int32)
        self.token_seq = np.concatenate([np.full(n, s) for s, (_, n) in enumerate(seqs)]
                                        ).astype(np.int32)
        self.context_lens = np.array([p + n for p, n in seqs], np.int32)
        need = [-(-c // block_size) for c in self.context_lens]
        self.max_blocks = max(need) + 1
        self.num_blocks = sum(need) + extra_blocks
        pool = rng.permutation(self.num_blocks)
        self.tables = np.full((len(seqs), self.max_blocks), -1, np.int32)
        at = 0
        for s, k in enumerate(need):
            self.tables[s, :k] = pool[at:at + k]
            at += k
        self.num_tokens = len(self.positions)

    def slot(self, s: int, pos: int) -> tuple[int, int]:
        return int(self.tables[s, pos // self.block_size]), pos % self.block_size


# --- layout and cuBLAS ---------------------------------------------------------------------

def test_batch_desc_layout_matches_header(cf):
    body = re.search(r"struct BatchDesc \{(.*?)\};", (CSRC / "batch.cuh").read_text(), re.S)[1]
    assert re.findall(r"int32_t\s+(\w+);", body) == list(cf.BATCH_DESC_DTYPE.names)
    assert cf.BATCH_DESC_DTYPE.itemsize == 16


def _blas(cf, stream, workspace_bytes=8 << 20):
    """A cuBLAS handle on the stream with a workspace of its own (keep the workspace alive)."""
    from blink.gpu_engine.cublas import Cublas
    blas = Cublas()
    blas.set_stream(int(stream))
    workspace = cf.DeviceArray(workspace_bytes, np.uint8)
    blas.set_workspace(workspace.ptr, workspace_bytes)
    return blas, workspace


@pytest.mark.parametrize("rows", [1, 19, 99])
def test_cublas_linear_bf16_and_fp32_accumulate(cf, stream, rows):
    from blink.gpu_engine.cublas import R_32F
    rng = np.random.default_rng(rows)
    k_in, n_out = 264, 136
    x = rb(rng.standard_normal((rows, k_in)))
    w = rb(rng.standard_normal((n_out, k_in)) * k_in ** -0.5)
    resid = rng.standard_normal((rows, n_out)).astype(np.float32)
    blas, _workspace = _blas(cf, stream, 4 << 20)
    dx, dw = dev(cf, float32_to_bf16_bits(x)), dev(cf, float32_to_bf16_bits(w))
    out16 = dev(cf, np.zeros((rows, n_out), np.uint16), poison=True)
    out32 = dev(cf, resid)
    blas.linear(dx.ptr, dw.ptr, out16.ptr, rows, k_in, n_out)
    blas.linear(dx.ptr, dw.ptr, out32.ptr, rows, k_in, n_out, R_32F, accumulate=True)
    cf.synchronize(stream)
    ref = x.astype(np.float64) @ w.T.astype(np.float64)
    assert rel_err(bf16_to_f32(out16.download()), ref) < 1e-2
    assert rel_err(out32.download(), ref + resid) < 1e-5
    REPORT["env"]["cublas_library"] = blas.path
    REPORT["env"]["cublas_version"] = blas.version
    blas.close()


@pytest.mark.parametrize("split_k", [False, True])
@pytest.mark.parametrize("rows", [19, 160])
def test_cublas_lt_every_candidate_computes_the_linear(cf, stream, rows, split_k):
    """Every algorithm cuBLASLt offers for a shape (what the GEMM tuner may pick; split_k: with
    Cublas.split_k's variants), bf16 out and fp32 accumulate, against float64; and a recorded
    linear() launches nothing."""
    from blink.gpu_engine.cublas import R_16BF, R_32F, GemmShape
    rng = np.random.default_rng(rows)
    k_in, n_out = 1024, 384
    x = rb(rng.standard_normal((rows, k_in)))
    w = rb(rng.standard_normal((n_out, k_in)) * k_in ** -0.5)
    resid = rng.standard_normal((rows, n_out)).astype(np.float32)
    ref = x.astype(np.float64) @ w.T.astype(np.float64)
    blas, _ws = _blas(cf, stream)
    blas.split_k = split_k
    dx, dw = dev(cf, float32_to_bf16_bits(x)), dev(cf, float32_to_bf16_bits(w))
    for out_type, accumulate in ((R_16BF, False), (R_32F, True)):
        algos = blas.lt_candidates(GemmShape(rows, k_in, n_out, out_type, accumulate))
        assert algos, "cuBLASLt offered no algorithm"
        REPORT["env"][f"cublas_lt_candidates_{rows}_rows_{out_type}_split_k_{split_k}"] = \
            [blas.lt_describe(a) for a in algos]
        for algo in algos:
            if accumulate:
                out = dev(cf, resid)
                blas.linear(dx.ptr, dw.ptr, out.ptr, rows, k_in, n_out, R_32F, True, algo=algo)
                cf.synchronize(stream)
                assert rel_err(out.download(), ref + resid) < 1e-5, blas.lt_describe(algo)
            else:
                out = dev(cf, np.zeros((rows, n_out), np.uint16), poison=True)
                blas.linear(dx.ptr, dw.ptr, out.ptr, rows, k_in, n_out, algo=algo)
                cf.synchronize(stream)
                assert rel_err(bf16_to_f32(out.download()), ref) < 1e-2, blas.lt_describe(algo)
    out = dev(cf, np.zeros((rows, n_out), np.uint16), poison=True)
    with blas.recording() as calls:
        blas.linear(dx.ptr, dw.ptr, out.ptr, rows, k_in, n_out)
    cf.synchronize(stream)
    assert [(c.shape, c.x, c.w, c.out) for c in calls] == [
        (GemmShape(rows, k_in, n_out, R_16BF, False), dx.ptr, dw.ptr, out.ptr)]
    assert (out.download() == POISON_BF16).all()
    blas.close()


@pytest.mark.parametrize("split_k", [False, True])
def test_gemm_tuner_times_caches_and_installs(cf, stream, tmp_path, monkeypatch, split_k):
    """The tuner times each recorded shape over all its calls (layers), installs its choice in
    blas.algos (here every shape takes its fastest cuBLASLt candidate: margin -100%), leaves
    the operands zero; a second tuner takes every choice from the cache (same algorithms,
    nothing timed), a third times again only the shape whose cached algorithm is not one
    cuBLAS offers; the tuned (cuBLASLt) linear computes x @ w^T. split_k: with Cublas.split_k's
    variants among the candidates (timed in device-launched graphs, as the forward runs them)."""
    from blink.gpu_engine import gemm_tuning
    from blink.gpu_engine.cublas import R_16BF, R_32F, GemmShape, LtAlgo
    from blink.gpu_engine.gemm_tuning import Choice, ChoiceCache, GemmTuner
    monkeypatch.setattr(gemm_tuning, "MARGIN", -1.0)
    rng = np.random.default_rng(7)
    layers, k_in, n_out = 4, 2048, 1024
    ws = [dev(cf, float32_to_bf16_bits(rng.standard_normal((n_out, k_in)) * k_in ** -0.5))
          for _ in range(layers)]
    x = dev(cf, np.zeros((256, k_in), np.uint16))
    out16 = dev(cf, np.zeros((256, n_out), np.uint16))
    out32 = dev(cf, np.zeros((256, n_out), np.float32))
    blas, _ws = _blas(cf, stream, 32 << 20)
    blas.split_k = split_k
    cache = ChoiceCache(tmp_path / "gemm.json")
    with blas.recording() as calls:
        for rows in (24, 256):
            for w in ws:
                blas.linear(x.ptr, w.ptr, out16.ptr, rows, k_in, n_out)
                blas.linear(x.ptr, w.ptr, out32.ptr, rows, k_in, n_out, R_32F, True)
    tuner = GemmTuner(blas, stream, cache)
    tuner.tune(calls)
    shapes = {GemmShape(r, k_in, n_out, t, a) for r in (24, 256)
              for t, a in ((R_16BF, False), (R_32F, True))}
    assert set(tuner.choices) == {sh.key for sh in shapes}
    assert tuner.timed == 4 and tuner.failed == 0
    assert set(blas.algos) == shapes  # every shape on its fastest candidate
    for sh in shapes:
        c = tuner.choices[sh.key]
        assert c.default_us > 0 and c.best_us > 0 and c.described.startswith("id ")
        assert bytes(blas.algos[sh]) == bytes(c.algo)
    assert not x.download().any() and not out32.download().any()
    assert not out16.download().any()
    again, _ws2 = _blas(cf, stream, 32 << 20)
    again.split_k = split_k
    second = GemmTuner(again, stream, cache)
    second.tune(calls)
    assert second.timed == 0
    assert {sh: bytes(a) for sh, a in again.algos.items()} == \
        {sh: bytes(a) for sh, a in blas.algos.items()}
    stale = GemmShape(24, k_in, n_out, R_16BF, False)
    bogus = LtAlgo.from_hex("ff" * 64)
    cache.store({stale.key: Choice(bogus, 1.0, 1.0)})
    third_blas, _ws3 = _blas(cf, stream, 32 << 20)
    third_blas.split_k = split_k
    third = GemmTuner(third_blas, stream, cache)
    third.tune(calls)
    assert third.timed == 1 and bytes(third_blas.algos[stale]) != bytes(bogus)
    third_blas.close()
    xs = rb(rng.standard_normal((256, k_in)))
    x.upload(float32_to_bf16_bits(xs))
    for rows in (24, 256):
        blas.linear(x.ptr, ws[1].ptr, out16.ptr, rows, k_in, n_out)
        cf.synchronize(stream)
        ref = xs[:rows].astype(np.float64) @ bf16_to_f32(ws[1].download()).T.astype(np.float64)
        got = bf16_to_f32(out16.download()[:rows])
        assert rel_err(got, ref) < 1e-2
    REPORT["env"][f"gemm_tuner_test{'_split_k' if split_k else ''}"] = tuner.summary()
    blas.close()
    again.close()


def tiled(cf, w_bits: np.ndarray) -> np.ndarray:
    """The skinny kernels' tiled weight layout, from its definition (gemv.cuh), flat: rows
    padded with zeros to whole 16-row tiles, each tile's 1 KB steps one after another (32
    columns of bf16, 64 of E4M3 codes: uint8), a step's 16 rows contiguous, then
    ForwardKernels.TILE_PAD_BYTES of zeros after each tile."""
    n, k = w_bits.shape
    step = 1024 // (16 * w_bits.itemsize)
    padded = np.zeros((-(-n // 16) * 16, k), w_bits.dtype)
    padded[:n] = w_bits
    tiles = padded.reshape(-1, 16, k // step, step).transpose(0, 2, 1, 3).reshape(-1, 16 * k)
    pad = np.zeros((tiles.shape[0], cf.ForwardKernels.TILE_PAD_BYTES // w_bits.itemsize),
                   w_bits.dtype)
    return np.concatenate([tiles, pad], axis=1).ravel()


@pytest.mark.parametrize("rows,cols", [(16, 32), (200, 544), (6144, 4096)])
@pytest.mark.parametrize("fp8", [False, True])
def test_tile_weights(cf, stream, rows, cols, fp8):
    """The tiling kernel writes the layout's definition (padding included), element for
    element: of bf16 weights, and of FP8 weights' codes (64 columns a step)."""
    if fp8 and cols % 64:
        cols += 32
    k = kernels(cf)
    dtype = np.uint8 if fp8 else np.uint16
    w = np.random.default_rng(rows).integers(0, np.iinfo(dtype).max + 1, (rows, cols),
                                             dtype=dtype)
    src = dev(cf, w)
    dst = dev(cf, np.zeros(k.tiled_elements(rows, cols, w.itemsize), dtype), poison=True)
    k.tile_weights(stream, src.ptr, dst.ptr, rows, cols, fp8=fp8)
    cf.synchronize(stream)
    np.testing.assert_array_equal(dst.download(), tiled(cf, w))


# (rows, in_features, out_features): 1..32 token rows (every column-tile count and partial
# tiles), in_features with and without a remainder of 32-k steps past the unrolled batches,
# out_features with a partial last row tile, and one wide enough for two row tiles per CTA.
SKINNY_CASES = [(1, 256, 200), (3, 96, 48), (8, 544, 1000), (13, 256, 136), (16, 1024, 40),
                (29, 160, 264), (32, 512, 300), (4, 256, 132 * 64 + 48)]


@pytest.mark.parametrize("rows,k_in,n_out", SKINNY_CASES)
@pytest.mark.parametrize("mode", ["bf16", "f32", "f32_add", "silu_mul"])
@pytest.mark.parametrize("layout", ["row-major", "tiled"])
def test_skinny_linear(cf, stream, rows, k_in, n_out, mode, layout):
    """The skinny linear kernel against float64 on the same bf16 inputs, with the weights in
    either layout; every output element written once (poison first) and nothing past row
    `rows` or column `n_out` touched."""
    check_skinny_linear(cf, stream, rows, k_in, n_out, mode, layout, k_splits=1)


# The shapes whose K may split across clusters of two CTAs (one row tile, up to 16 rows): K in
# remainder steps only, in whole batches of the cluster's 16 warps and with a remainder
# (Llama-3.2-1B's o and down projections: 2,048 and 8,192), N with a partial last tile.
SKINNY_SPLIT_CASES = [(1, 256, 200), (3, 96, 48), (8, 544, 1000), (13, 256, 136),
                      (16, 1024, 40), (1, 8192, 2048), (5, 2048 + 96, 72), (16, 2048, 2048)]


@pytest.mark.parametrize("rows,k_in,n_out", SKINNY_SPLIT_CASES)
@pytest.mark.parametrize("mode", ["bf16", "f32", "f32_add"])
@pytest.mark.parametrize("layout", ["row-major", "tiled"])
def test_skinny_linear_k_split(cf, stream, rows, k_in, n_out, mode, layout):
    """The same with K split across clusters of two CTAs (the first adds the second's sums
    from its shared memory and stores): the same outputs, and the shadow of the residual add."""
    check_skinny_linear(cf, stream, rows, k_in, n_out, mode, layout, k_splits=2)


def test_skinny_split_rule(cf, monkeypatch):
    """Clusters of two where the split grid still fits one wave of the _k2 kernel's CTAs (or
    where the row blocks are at most max_row_blocks), launched as the _k2 entry point on two
    CTAs a row block; never for shapes without such an entry point, which the launches
    refuse."""
    k = kernels(cf)
    occupancy = k.skinny_split_ctas_per_sm
    REPORT["env"]["skinny K-split CTAs an SM (head dim 64)"] = occupancy
    assert min(occupancy.values()) >= 2  # __launch_bounds__(..., kGemvMinCtas)
    slots = occupancy["blink_skinny_linear_1x1_k2"] * k.sm_count
    most = slots // 2  # row blocks whose grid of two CTAs each fits one wave
    assert k.skinny_splits("linear", 1, 8192, 16 * min(most, 128)) == 2  # 1B's down, batch 1
    assert k.skinny_splits("linear", 1, 8192, 16 * most) == 2
    assert k.skinny_splits("linear", 1, 8192, 16 * (most + 1)) == 1
    fits = 2 * 192 <= occupancy["blink_skinny_qkv_rope_norm_1x1_k2"] * k.sm_count
    assert k.skinny_splits("qkv_rope_norm", 1, 2048, 3072) == (2 if fits else 1)  # 1B's qkv
    assert k.skinny_splits("linear", 1, 2048, 3072, max_row_blocks=191) == 1
    assert k.skinny_splits("linear", 1, 2048, 3072, max_row_blocks=192) == 2
    assert k.skinny_splits("linear", 1, 2048, 2048, max_row_blocks=0) == 1
    assert k.skinny_splits("linear", 17, 2048, 2048) == 1  # four column tiles
    assert k.skinny_splits("linear_norm", 1, 2048, 2048) == 1
    launches = []
    monkeypatch.setattr(k, "launch", lambda name, grid, *args, **kwargs:
                        launches.append((name, tuple(grid))))
    k.skinny_linear(None, 0, 0, 0, 1, 8192, 2000, cf.SKINNY_F32_ADD, k_splits=2)
    k.skinny_linear(None, 0, 0, 0, 9, 2048, 2048, cf.SKINNY_BF16, k_splits=2)
    k.skinny_linear(None, 0, 0, 0, 9, 2048, 2048, cf.SKINNY_BF16)
    assert launches == [("blink_skinny_linear_1x1_k2", (250,)),
                        ("blink_skinny_linear_1x2_k2", (256,)),
                        ("blink_skinny_linear_1x2", (128,))]
    with pytest.raises(ValueError, match="K split"):
        k.skinny_linear(None, 0, 0, 0, 17, 256, 64, cf.SKINNY_BF16, k_splits=2)
    with pytest.raises(ValueError, match="no K split"):
        k.skinny_linear(None, 0, 0, 0, 1, 256, 64, cf.SKINNY_BF16, k_splits=2, norm_eps=1e-5)


# FP8 weights (the _fp8 entry points): up to 16 rows, K in whole 64-k steps: remainder steps
# only, whole unrolled batches, the cluster's 16 warps' batches and a remainder past them.
SKINNY_FP8_CASES = [(1, 256, 200), (3, 128, 48), (8, 576, 1000), (13, 256, 136),
                    (16, 1024, 40), (4, 256, 132 * 64 + 48), (1, 8192, 2048), (5, 2048 + 128, 72),
                    (16, 4096, 6144)]


@pytest.mark.parametrize("rows,k_in,n_out", SKINNY_FP8_CASES)
@pytest.mark.parametrize("mode", ["bf16", "f32", "f32_add", "silu_mul"])
@pytest.mark.parametrize("layout", ["row-major", "tiled"])
@pytest.mark.parametrize("k_splits", [1, 2])
def test_skinny_linear_fp8(cf, stream, rows, k_in, n_out, mode, layout, k_splits):
    """The FP8-weight skinny kernels against float64 on the codes' values (a scale a row) and
    x as the kernel rounds it to f16: every output written once, nothing past it; K split
    across clusters of two too."""
    if k_splits == 2 and (mode == "silu_mul" or kernels(cf).skinny_splits(
            "linear", rows, k_in, n_out, 10 ** 6, fp8=True) != 2):
        pytest.skip("no K split for this shape or mode")
    check_skinny_linear(cf, stream, rows, k_in, n_out, mode, layout, k_splits, fp8=True)


@pytest.mark.parametrize("rows,k_in,n_out", [(1, 256, 200), (3, 128, 48), (8, 576, 1000),
                                             (4, 256, 132 * 64 + 48), (1, 8192, 2048),
                                             (5, 2048 + 128, 72), (1, 4096, 6144)])
@pytest.mark.parametrize("kind", ["o", "down", "gate_up"])
@pytest.mark.parametrize("k_splits", [1, 2])
def test_skinny_fp8_x_f16(cf, stream, rows, k_in, n_out, kind, k_splits):
    """x's f16 form handed over (CudaForward's fp8_x_f16): the _xf16 entries, given x's f16 form
    (down: SiLU * up's; gate|up: the shadow's times the RMSNorm's weight), give the outputs of
    the entries that convert x themselves bit for bit, and each writes the next projection's
    form exactly (o and down: the shadow's times the next norm's weight; gate|up: its output's),
    nothing past `rows`. o takes its x as stored (_xf16out)."""
    k = kernels(cf)
    norm = kind == "gate_up"
    if k_splits == 2 and (norm or k.skinny_splits("linear", rows, k_in, n_out, 10 ** 6,
                                                  fp8=True) != 2):
        pytest.skip("no K split for this shape or kind")
    rng = np.random.default_rng(rows * 11 + k_in + n_out)
    cap, eps = 12, 1e-5
    n_w = 2 * (-(-n_out // 32) * 16) if norm else n_out
    x = rb(rng.standard_normal((cap, k_in)) * (7 if norm else 1))
    norm_w = rb(1 + 0.3 * rng.standard_normal(k_in))  # the RMSNorm before gate|up
    next_norm_w = rb(1 + 0.3 * rng.standard_normal(n_out))  # o's and down's next one
    codes, scale, _ = fp8_weight(rb(rng.standard_normal((n_w, k_in)) * k_in ** -0.5))
    dx, dw = dev(cf, float32_to_bf16_bits(x)), dev(cf, tiled(cf, codes))
    d_norm_w = dev(cf, float32_to_bf16_bits(norm_w))
    d_next = dev(cf, float32_to_bf16_bits(next_norm_w))
    x_f16 = dev(cf, f16_form(x, norm_w if norm else None))
    common = dict(w_tiled=True, w_scale=dev(cf, scale).ptr)
    resid = rng.standard_normal((cap, n_out)).astype(np.float32)
    outputs = []
    for handed in (False, True):
        if norm:
            out = dev(cf, np.zeros((cap, n_w // 2), np.uint16), poison=True)
            form = dev(cf, np.zeros((cap, n_w // 2), np.uint16), poison=True)
            k.skinny_linear(stream, dx.ptr, dw.ptr, out.ptr, rows, k_in, n_w, cf.SKINNY_SILU_MUL,
                            norm_eps=eps, norm_w=d_norm_w.ptr, **common,
                            **(dict(x_f16=x_f16.ptr, x_f16_out=form.ptr) if handed else {}))
            shadow = None
        else:
            out, form = dev(cf, resid), dev(cf, np.zeros((cap, n_out), np.uint16), poison=True)
            shadow = dev(cf, np.zeros((cap, n_out), np.uint16), poison=True)
            given = (dict(x_f16=x_f16.ptr if kind == "down" else 0, x_f16_out=form.ptr,
                          x_f16_norm_w=d_next.ptr) if handed else {})
            k.skinny_linear(stream, dx.ptr, dw.ptr, out.ptr, rows, k_in, n_out,
                            cf.SKINNY_F32_ADD, shadow=shadow.ptr, k_splits=k_splits, **common,
                            **given)
        cf.synchronize(stream)
        outputs.append((out.download(), shadow.download() if shadow else None, form.download()))
    (plain, plain_shadow, _), (got, got_shadow, form) = outputs
    np.testing.assert_array_equal(got, plain)
    if not norm:
        np.testing.assert_array_equal(got_shadow, plain_shadow)
    assert_f16_form_written(form, rows, got, got_shadow, norm, next_norm_w)
    with pytest.raises(ValueError, match="f16 form"):
        k.skinny_linear(stream, dx.ptr, dw.ptr, out.ptr, 9, k_in, n_out, cf.SKINNY_F32_ADD,
                        shadow=dx.ptr, x_f16=x_f16.ptr, **common)


def square_parts(x) -> np.ndarray:
    """x's sums of squares in parts of 16 features (csrc/gemv.cuh GemvSquareParts), float64."""
    x = np.asarray(x, np.float64)
    return (x * x).reshape(len(x), -1, 16).sum(-1)


# the x_f16 cases whose out_features are whole 16s (the parts' granularity)
@pytest.mark.parametrize("rows,k_in,n_out", [(1, 256, 208), (3, 128, 48), (8, 576, 1008),
                                             (1, 8192, 2048), (5, 2048 + 128, 80),
                                             (1, 4096, 6144)])
@pytest.mark.parametrize("kind", ["o", "down", "gate_up", "f32_norm"])
@pytest.mark.parametrize("k_splits", [1, 2])
def test_skinny_fp8_x_sumsq(cf, stream, rows, k_in, n_out, kind, k_splits):
    """x's sums of squares handed over in parts (CudaForward's fp8_x_sumsq): o and down
    (_xf16sqout, _xf16sq) write the same outputs, shadow and f16 form as without them, bit for
    bit, and each token row's parts of the shadow's squares (against float64, nothing past
    `rows`); the normalizing entry (_xf16sq: gate|up, and the plain f32 output the Qwen3 qkv
    projection's bf16 one shares) given them reads no x (it is NaN here) and agrees with the
    entry that squares x itself to float rounding: within one bf16 step after SiLU * up, 1e-5
    in f32; parts four times as large halve the f32 outputs (the RMSNorm's scale is theirs)."""
    k = kernels(cf)
    norm = kind in ("gate_up", "f32_norm")
    if k_splits == 2 and (norm or k.skinny_splits("linear", rows, k_in, n_out, 10 ** 6,
                                                  fp8=True) != 2):
        pytest.skip("no K split for this shape or kind")
    rng = np.random.default_rng(rows * 13 + k_in + n_out)
    cap, eps = 12, 1e-5
    x = rb(rng.standard_normal((cap, k_in)) * (7 if norm else 1))
    norm_w = rb(1 + 0.3 * rng.standard_normal(k_in))
    next_norm_w = rb(1 + 0.3 * rng.standard_normal(n_out))
    n_w = 2 * (-(-n_out // 32) * 16) if kind == "gate_up" else n_out
    codes, scale, _ = fp8_weight(rb(rng.standard_normal((n_w, k_in)) * k_in ** -0.5))
    dx, dw = dev(cf, float32_to_bf16_bits(x)), dev(cf, tiled(cf, codes))
    nan_x = dev(cf, np.full((cap, k_in), 0x7FC0, np.uint16))  # bf16 NaN: must not be read
    d_scale, d_norm_w = dev(cf, scale), dev(cf, float32_to_bf16_bits(norm_w))
    d_next = dev(cf, float32_to_bf16_bits(next_norm_w))  # (held: freed memory is not read)
    common = dict(w_tiled=True, w_scale=d_scale.ptr)
    if norm:
        x_f16 = dev(cf, f16_form(x, norm_w))
        mode = cf.SKINNY_SILU_MUL if kind == "gate_up" else cf.SKINNY_F32
        width = n_w // 2 if kind == "gate_up" else n_w
        dtype = np.uint16 if kind == "gate_up" else np.float32

        def launch(x_ptr, **given):
            out = dev(cf, np.zeros((cap, width), dtype), poison=True)
            k.skinny_linear(stream, x_ptr, dw.ptr, out.ptr, rows, k_in, n_w, mode,
                            norm_eps=eps, norm_w=d_norm_w.ptr, x_f16=x_f16.ptr, **common,
                            **given)
            cf.synchronize(stream)
            return out.download()

        own = launch(dx.ptr)
        parts = square_parts(x[:rows]).astype(np.float32)
        d_parts, d_larger = dev(cf, parts), dev(cf, 4 * parts)
        got = launch(nan_x.ptr, x_sumsq=d_parts.ptr)
        if kind == "gate_up":
            assert (got[:rows] != POISON_BF16).all()
            # (a step of the scale can flip gate's or up's bf16 rounding: two of act's steps)
            steps = np.abs(got[:rows].astype(np.int32) - own[:rows].astype(np.int32))
            assert steps.max() <= 2, steps.max()  # (same sign: steps in the bits' order)
        else:
            np.testing.assert_allclose(got[:rows], own[:rows], rtol=1e-5, atol=1e-6)
            larger = launch(nan_x.ptr, x_sumsq=d_larger.ptr)
            np.testing.assert_allclose(larger[:rows], own[:rows] / 2, rtol=1e-5, atol=1e-6)
        if kind == "gate_up":
            assert (got[rows:] == POISON_BF16).all()
        else:
            assert (got[rows:].view(np.uint32) == POISON_F32).all()
        return
    act = x  # down's input: SiLU * up's f16 form; o's: attention's output as stored
    x_f16 = dev(cf, f16_form(act)) if kind == "down" else None
    resid = rng.standard_normal((cap, n_out)).astype(np.float32)
    outputs = []
    for squares in (False, True):
        out, form = dev(cf, resid), dev(cf, np.zeros((cap, n_out), np.uint16), poison=True)
        shadow = dev(cf, np.zeros((cap, n_out), np.uint16), poison=True)
        parts = dev(cf, np.zeros((cap, n_out // 16), np.float32), poison=True)
        k.skinny_linear(stream, dx.ptr, dw.ptr, out.ptr, rows, k_in, n_out, cf.SKINNY_F32_ADD,
                        shadow=shadow.ptr, k_splits=k_splits, x_f16=x_f16.ptr if x_f16 else 0,
                        x_f16_out=form.ptr, x_f16_norm_w=d_next.ptr,
                        x_sumsq_out=parts.ptr if squares else 0, **common)
        cf.synchronize(stream)
        outputs.append([a.download() for a in (out, shadow, form, parts)])
    (plain, plain_shadow, plain_form, _), (got, got_shadow, got_form, got_parts) = outputs
    for a, b in ((got, plain), (got_shadow, plain_shadow), (got_form, plain_form)):
        np.testing.assert_array_equal(a, b)
    want = square_parts(bf16_to_f32(got_shadow[:rows]))
    np.testing.assert_allclose(got_parts[:rows], want, rtol=1e-5)
    assert (got_parts[rows:].view(np.uint32) == POISON_F32).all()
    with pytest.raises(ValueError, match="sums of squares"):
        k.skinny_linear(stream, dx.ptr, dw.ptr, out.ptr, rows, k_in, n_out, cf.SKINNY_F32_ADD,
                        shadow=shadow.ptr, x_sumsq_out=parts.ptr, **common)


# (132 * 64 + 48 outputs: two row tiles a CTA, on 132 SMs)
@pytest.mark.parametrize("rows,k_in,n_out", [(1, 256, 208), (3, 128, 48), (8, 576, 1008),
                                             (4, 256, 132 * 64 + 48), (1, 8192, 2048),
                                             (5, 2048 + 128, 80)])
@pytest.mark.parametrize("kind", ["o", "o_squares", "gate_up"])
@pytest.mark.parametrize("k_splits", [1, 2])
def test_skinny_bf16_writes_x_f16_for_an_fp8_projection(cf, stream, rows, k_in, n_out, kind,
                                                         k_splits):
    """A projection an FP8 checkpoint keeps in bf16 hands the FP8 one after it x's f16 form
    (the bf16 _xf16out entries, CudaForward's fp8_x_f16 beside bf16 projections): o and down
    write the same outputs and shadow as the plain entries, bit for bit, plus the shadow's f16
    form times the next RMSNorm's weight exactly (and its sums of squares against float64);
    gate|up (its RMSNorm folded in) the same SiLU * up plus its f16 form. Nothing past `rows`."""
    k = kernels(cf)
    silu = kind == "gate_up"
    if k_splits == 2 and (silu or k.skinny_splits("linear", rows, k_in, n_out, 10 ** 6) != 2):
        pytest.skip("no K split for this shape or kind")
    rng = np.random.default_rng(rows * 17 + k_in + n_out)
    cap, eps = 12, 1e-5
    n_w = 2 * (-(-n_out // 32) * 16) if silu else n_out
    x = rb(rng.standard_normal((cap, k_in)) * (7 if silu else 1))
    w = rb(rng.standard_normal((n_w, k_in)) * k_in ** -0.5)
    next_norm_w = rb(1 + 0.3 * rng.standard_normal(n_out))
    dx, dw = dev(cf, float32_to_bf16_bits(x)), dev(cf, tiled(cf, float32_to_bf16_bits(w)))
    d_next = dev(cf, float32_to_bf16_bits(next_norm_w))
    resid = rng.standard_normal((cap, n_out)).astype(np.float32)
    width = n_w // 2 if silu else n_out
    outputs = []
    for handed in (False, True):
        form = dev(cf, np.zeros((cap, width), np.uint16), poison=True)
        parts = dev(cf, np.zeros((cap, n_out // 16), np.float32), poison=True)
        if silu:
            out, shadow = dev(cf, np.zeros((cap, width), np.uint16), poison=True), None
            k.skinny_linear(stream, dx.ptr, dw.ptr, out.ptr, rows, k_in, n_w,
                            cf.SKINNY_SILU_MUL, norm_eps=eps, w_tiled=True,
                            **(dict(x_f16_out=form.ptr) if handed else {}))
        else:
            out = dev(cf, resid)
            shadow = dev(cf, np.zeros((cap, n_out), np.uint16), poison=True)
            given = dict(x_f16_out=form.ptr, x_f16_norm_w=d_next.ptr,
                         x_sumsq_out=parts.ptr if kind == "o_squares" else 0)
            k.skinny_linear(stream, dx.ptr, dw.ptr, out.ptr, rows, k_in, n_out,
                            cf.SKINNY_F32_ADD, shadow=shadow.ptr, w_tiled=True,
                            k_splits=k_splits, **(given if handed else {}))
        cf.synchronize(stream)
        outputs.append([None if a is None else a.download() for a in (out, shadow, form, parts)])
    (plain, plain_shadow, _, _), (got, got_shadow, got_form, got_parts) = outputs
    np.testing.assert_array_equal(got, plain)
    if not silu:
        np.testing.assert_array_equal(got_shadow, plain_shadow)
    assert_f16_form_written(got_form, rows, got, got_shadow, silu, next_norm_w)
    if kind == "o_squares":
        want = square_parts(bf16_to_f32(got_shadow[:rows]))
        np.testing.assert_allclose(got_parts[:rows], want, rtol=1e-5)
        assert (got_parts[rows:].view(np.uint32) == POISON_F32).all()
    else:
        assert (got_parts.view(np.uint32) == POISON_F32).all()
    with pytest.raises(ValueError, match="f16 form"):  # bf16 weights take none in
        k.skinny_linear(stream, dx.ptr, dw.ptr, out.ptr, rows, k_in, n_out, cf.SKINNY_F32_ADD,
                        shadow=dx.ptr, w_tiled=True, x_f16=form.ptr)


def check_skinny_linear(cf, stream, rows, k_in, n_out, mode, layout, k_splits, fp8=False):
    k = kernels(cf)
    if k_splits > 1:
        assert k.skinny_splits("linear", rows, k_in, n_out, 10 ** 6, fp8=fp8) == k_splits
    rng = np.random.default_rng(rows * 7 + k_in)
    cap = 40  # allocated rows: rows .. cap must stay poisoned
    n_w = 2 * (-(-n_out // 32) * 16) if mode == "silu_mul" else n_out  # whole 16-row pairs
    x = rb(rng.standard_normal((cap, k_in)))
    w = rb(rng.standard_normal((n_w, k_in)) * k_in ** -0.5)
    w_tiled = layout == "tiled"
    if fp8:  # the codes' values against x as the kernel feeds it to the MMAs
        codes, scale, w_values = fp8_weight(w)
        ref = f16_input(x[:rows]) @ w_values.T
        dw = dev(cf, tiled(cf, codes) if w_tiled else codes)
        fp8_args = {"w_scale": dev(cf, scale).ptr}
    else:
        ref = x[:rows].astype(np.float64) @ w.T.astype(np.float64)
        dw = dev(cf, tiled(cf, float32_to_bf16_bits(w)) if w_tiled else float32_to_bf16_bits(w))
        fp8_args = {}
    dx = dev(cf, float32_to_bf16_bits(x))
    if mode in ("bf16", "silu_mul"):
        expect, launch_mode = ref, cf.SKINNY_BF16
        if mode == "silu_mul":
            # rows of w are gate|up interleaved in 16s: the reference un-interleaves them
            inter = n_w // 2
            pairs = ref.reshape(rows, inter // 16, 2, 16)
            gate = rb(pairs[:, :, 0].reshape(rows, inter))
            up = rb(pairs[:, :, 1].reshape(rows, inter))
            expect, launch_mode = gate / (1 + np.exp(-gate.astype(np.float64))) * up, \
                cf.SKINNY_SILU_MUL
        out = dev(cf, np.zeros((cap, expect.shape[1]), np.uint16), poison=True)
        k.skinny_linear(stream, dx.ptr, dw.ptr, out.ptr, rows, k_in, n_w, launch_mode,
                        w_tiled=w_tiled, k_splits=k_splits, **fp8_args)
        cf.synchronize(stream)
        got = out.download()
        assert rel_err(bf16_to_f32(got[:rows]), expect) < 1e-2
        assert (got[rows:] == POISON_BF16).all()
        return
    resid = rng.standard_normal((cap, n_out)).astype(np.float32)
    out = dev(cf, resid) if mode == "f32_add" else \
        dev(cf, np.zeros((cap, n_out), np.float32), poison=True)
    shadow = dev(cf, np.zeros((cap, n_out), np.uint16), poison=True)
    k.skinny_linear(stream, dx.ptr, dw.ptr, out.ptr, rows, k_in, n_out,
                    cf.SKINNY_F32_ADD if mode == "f32_add" else cf.SKINNY_F32,
                    shadow=shadow.ptr if mode == "f32_add" else 0, w_tiled=w_tiled,
                    k_splits=k_splits, **fp8_args)
    cf.synchronize(stream)
    got = out.download()
    expect = ref + resid[:rows] if mode == "f32_add" else ref
    err = rel_err(got[:rows], expect)
    if fp8:
        REPORT["errors"][f"skinny fp8 {rows}x{k_in}->{n_out} {mode} {layout} "
                         f"k{k_splits}"] = err
    assert err < 1e-5
    if mode == "f32_add":
        np.testing.assert_array_equal(got[rows:], resid[rows:])
        # the residual stream's bf16 shadow: exactly the stored sums, rounded
        np.testing.assert_array_equal(shadow.download()[:rows], float32_to_bf16_bits(got[:rows]))
        assert (shadow.download()[rows:] == POISON_BF16).all()
    else:
        assert (got[rows:].view(np.uint32) == POISON_F32).all()
        assert (shadow.download() == POISON_BF16).all()


def _rms_scale(x, eps):
    """1 / rms of each row, float64."""
    x = np.asarray(x, np.float64)
    return 1 / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)


# in_features from a remainder-only loop to whole unrolled batches in both row-tile shapes
# (4096 and 4192: a Llama-3.1-8B-sized qkv / gate|up input, and one with a remainder)
@pytest.mark.parametrize("rows,k_in,n_out", [(1, 256, 200), (3, 96, 48), (8, 544, 1000),
                                             (5, 2048, 132 * 64 + 48), (1, 4096, 6144),
                                             (7, 4192, 3000), (12, 544, 1000),
                                             (16, 4096, 6144)])
@pytest.mark.parametrize("mode", ["bf16", "silu_mul"])
@pytest.mark.parametrize("layout", ["row-major", "tiled"])
@pytest.mark.parametrize("fp8", [False, True])
def test_skinny_linear_with_rmsnorm(cf, stream, rows, k_in, n_out, mode, layout, fp8):
    """The RMSNorm-folding variant (x: the residual stream's bf16 shadow, the norm weight
    already in w) against float64: rms_norm(x) @ w^T, and silu(gate) * up of it, with the
    weights in either layout. FP8 weights: the norm's weight given apart (norm_w), x times it
    rounded to f16 as the kernel feeds the MMAs."""
    if fp8 and k_in % 64:
        k_in += 32
    k = kernels(cf)
    rng = np.random.default_rng(rows * 5 + k_in)
    cap, eps = 20, 1e-5
    n_w = 2 * (-(-n_out // 32) * 16) if mode == "silu_mul" else n_out
    x = rb(rng.standard_normal((cap, k_in)) * 7)  # a residual stream's scale
    w = rb(rng.standard_normal((n_w, k_in)) * k_in ** -0.5)
    fp8_args = {}
    if fp8:
        norm_w = rb(1 + 0.3 * rng.standard_normal(k_in))
        codes, scale, w_values = fp8_weight(w)
        h = f16_input(x[:rows].astype(np.float32) * norm_w)
        ref = h * _rms_scale(x[:rows], eps) @ w_values.T
        fp8_args = {"w_scale": dev(cf, scale).ptr, "norm_w": dev(cf, float32_to_bf16_bits(
            norm_w)).ptr}
    else:
        ref = (x[:rows] * _rms_scale(x[:rows], eps)) @ w.T.astype(np.float64)
    if mode == "silu_mul":
        inter = n_w // 2
        pairs = ref.reshape(rows, inter // 16, 2, 16)
        gate, up = rb(pairs[:, :, 0].reshape(rows, inter)), rb(pairs[:, :, 1].reshape(rows, inter))
        ref = gate / (1 + np.exp(-gate.astype(np.float64))) * up
    w_tiled = layout == "tiled"
    dx = dev(cf, float32_to_bf16_bits(x))
    w_bits = codes if fp8 else float32_to_bf16_bits(w)
    dw = dev(cf, tiled(cf, w_bits) if w_tiled else w_bits)
    out = dev(cf, np.zeros((cap, ref.shape[1]), np.uint16), poison=True)
    k.skinny_linear(stream, dx.ptr, dw.ptr, out.ptr, rows, k_in, n_w,
                    cf.SKINNY_SILU_MUL if mode == "silu_mul" else cf.SKINNY_BF16, norm_eps=eps,
                    w_tiled=w_tiled, **fp8_args)
    cf.synchronize(stream)
    got = out.download()
    assert rel_err(bf16_to_f32(got[:rows]), ref) < 1e-2
    assert (got[rows:] == POISON_BF16).all()
    with pytest.raises(ValueError, match="RMSNorm|FP8"):
        k.skinny_linear(stream, dx.ptr, dw.ptr, out.ptr, 17, k_in, n_w, cf.SKINNY_BF16,
                        norm_eps=eps, **fp8_args)


# (hidden, intermediate, q size): Llama-3.1-8B's (where the chain is on by default) and
# Llama-3.2-1B's (row blocks past the grid, chunks past the ring), one where every projection
# ends on a partial chunk (E4M3 weights: each size 32 more, whole 64-k steps), and a small one
# (one chunk each)
@pytest.mark.parametrize("hidden,inter,q_size", [(4096, 14336, 4096), (2048, 8192, 2048),
                                                 (2080, 1056, 544), (256, 512, 256)])
@pytest.mark.parametrize("fp8", [False, True])
def test_projection_chain(cf, stream, hidden, inter, q_size, fp8):
    """The batch-1 projections after attention in one persistent kernel (gemv_chain.cuh): x +=
    attn Wo^T, act = silu(gate) * up of rms_norm(x) Wgu^T, x += act Wdown^T, against float64,
    and bit for bit against the three skinny kernels (unsplit), whose sums it takes in the same
    order; twice, each launch leaving its counters zero for the next; and with a grid
    three times what the GPU holds at once, since no CTA may wait for one that has not
    started. E4M3 weights (the _fp8 entry): the reference takes the codes' values, x rounded
    to f16 as the kernels feed their MMAs, and the RMSNorm's weight given apart."""
    if fp8:
        hidden, inter, q_size = (-(-n // 64) * 64 for n in (hidden, inter, q_size))
    k = kernels(cf)
    rng = np.random.default_rng(hidden + inter)
    eps = 1e-5
    attn = rb(rng.standard_normal(q_size))
    x0 = (rng.standard_normal(hidden) * 7).astype(np.float32)  # a residual stream's scale
    ws = [rb(rng.standard_normal((n, kin)) * kin ** -0.5)
          for n, kin in ((hidden, q_size), (2 * inter, hidden), (hidden, inter))]
    fp8_args = [{}, {}, {}]
    if fp8:
        norm_w = rb(1 + 0.3 * rng.standard_normal(hidden))
        quantized = [fp8_weight(w) for w in ws]
        d_w = [dev(cf, tiled(cf, codes)) for codes, _, _ in quantized]
        scales = [dev(cf, scale) for _, scale, _ in quantized]
        d_norm_w = dev(cf, float32_to_bf16_bits(norm_w))
        fp8_args = [{"w_scale": scale.ptr} for scale in scales]
        fp8_args[1]["norm_w"] = d_norm_w.ptr
        chain_args = {"w_scales": tuple(scale.ptr for scale in scales), "norm_w": d_norm_w.ptr}
        wo, wgu, wdown = (values for _, _, values in quantized)
        mma_input = f16_input
    else:
        d_w = [dev(cf, tiled(cf, float32_to_bf16_bits(w))) for w in ws]
        chain_args = {}
        wo, wgu, wdown = (w.astype(np.float64) for w in ws)
        norm_w = 1
        mma_input = np.asarray
    d_attn = dev(cf, float32_to_bf16_bits(attn))

    def run(chain: bool, grid=None):
        x = dev(cf, x0)
        shadow = dev(cf, np.zeros(hidden, np.uint16), poison=True)
        act = dev(cf, np.zeros(inter, np.uint16), poison=True)
        counters = dev(cf, np.zeros(k.chain_counters_words, np.uint32))
        if chain:
            k.projection_chain(stream, d_attn.ptr, d_w[0].ptr, x.ptr, shadow.ptr, d_w[1].ptr,
                               act.ptr, d_w[2].ptr, hidden, inter, q_size, eps, counters.ptr,
                               grid=grid, **chain_args)
        else:
            k.skinny_linear(stream, d_attn.ptr, d_w[0].ptr, x.ptr, 1, q_size, hidden,
                            cf.SKINNY_F32_ADD, shadow=shadow.ptr, w_tiled=True, **fp8_args[0])
            k.skinny_linear(stream, shadow.ptr, d_w[1].ptr, act.ptr, 1, hidden, 2 * inter,
                            cf.SKINNY_SILU_MUL, norm_eps=eps, w_tiled=True, **fp8_args[1])
            k.skinny_linear(stream, act.ptr, d_w[2].ptr, x.ptr, 1, inter, hidden,
                            cf.SKINNY_F32_ADD, shadow=shadow.ptr, w_tiled=True, **fp8_args[2])
        cf.synchronize(stream)
        assert not counters.download().any()
        return x.download(), shadow.download(), act.download()

    x1 = x0 + mma_input(attn) @ wo.T
    h = mma_input(rb(x1) * norm_w) * _rms_scale(rb(x1), eps)[0]
    gate_up = (h @ wgu.T).reshape(inter // 16, 2, 16)
    gate, up = rb(gate_up[:, 0].ravel()), rb(gate_up[:, 1].ravel())
    act_ref = gate / (1 + np.exp(-gate.astype(np.float64))) * up
    x_ref = x1 + mma_input(rb(act_ref)) @ wdown.T
    skinny = run(chain=False)
    for grid in (None, None, 3 * k.chain_ctas_per_sm * k.device_sm_count):
        x, shadow, act = run(chain=True, grid=grid)
        assert rel_err(bf16_to_f32(act), act_ref) < 1e-2
        assert rel_err(x - x0, x_ref - x0) < 1e-2
        np.testing.assert_array_equal(shadow, float32_to_bf16_bits(x))
        for got, want in zip((x, shadow, act), skinny):
            np.testing.assert_array_equal(got, want)


def test_projection_chain_refuses_shapes_it_does_not_take(cf, stream):
    k = kernels(cf)
    assert k.chain_fits(2048, 8192, 2048) and not k.chain_fits(2048, 8200, 2048)
    # E4M3 weights: whole 64-k steps
    assert k.chain_fits(2048, 8192, 2048, fp8=True) and not k.chain_fits(2048, 8224, 2048,
                                                                         fp8=True)
    # the rule by size: on for Llama-3.1-8B's bf16 layers, off for Llama-3.2-1B's, never with
    # E4M3 weights (slower on every shape measured), nor where the chain does not take the shape
    assert k.chain_preferred(4096, 14336, 4096) and not k.chain_preferred(2048, 8192, 2048)
    assert not k.chain_preferred(4096, k.chain_max_k + 32, 4096)
    assert not any(k.chain_preferred(*shape, fp8=True)
                   for shape in ((4096, 14336, 4096), (2048, 8192, 2048)))
    assert not k.chain_fits(4096, k.chain_max_k + 32, 4096)
    with pytest.raises(ValueError, match="projection chain"):
        k.projection_chain(stream, 0, 0, 0, 0, 0, 0, 0, 256, 520, 256, 1e-5, 0)
    with pytest.raises(ValueError, match="projection chain"):  # 544: not whole 64-k steps
        k.projection_chain(stream, 0, 0, 0, 0, 0, 0, 0, 256, 544, 256, 1e-5, 0,
                           w_scales=(1, 1, 1), norm_w=1)
    with pytest.raises(ValueError, match="scales"):
        k.projection_chain(stream, 0, 0, 0, 0, 0, 0, 0, 256, 512, 256, 1e-5, 0,
                           w_scales=(1, 0, 1), norm_w=1)
    with pytest.raises(ValueError, match="folded"):  # bf16 weights have the norm in them
        k.projection_chain(stream, 0, 0, 0, 0, 0, 0, 0, 256, 512, 256, 1e-5, 0, norm_w=1)


def test_skinny_linear_refuses_shapes_it_does_not_take(cf, stream):
    k = kernels(cf)
    assert not k.skinny_fits(33, 256, 64) and not k.skinny_fits(4, 100, 64)
    with pytest.raises(ValueError, match="skinny linear"):
        k.skinny_linear(stream, 0, 0, 0, 33, 256, 64, cf.SKINNY_BF16)


# (rows, in_features, out_features, chunk): 17..32 token rows and fewer (partial column
# tiles); K in one chunk of one batch up to many chunks of several batches, even and odd counts
# (8B's o and down projections: 4,096 and 14,336, split into 512- and 896-column chunks on the
# H200; chunk None: splitk_chunk's); N with a partial CTA of rows and a partial 16-row tile.
SPLITK_CASES = [(17, 128, 132, None), (32, 512, 300, None), (24, 4096, 520, 512),
                (29, 14336, 264, 896), (3, 1152, 1000, None), (32, 2048, 4096, 1024),
                (20, 4096, 4096, None), (32, 14336, 4096, None)]


@pytest.mark.parametrize("rows,k_in,n_out,chunk", SPLITK_CASES)
@pytest.mark.parametrize("live", [None, 13, 0])
@pytest.mark.parametrize("cluster", [1, 2, 4])
def test_splitk_add_linear(cf, stream, rows, k_in, n_out, chunk, live, cluster):
    """The split-K kernel adds x @ w^T into an fp32 output, against float64 on the same bf16
    inputs: every chunk of K added once (one missed or added twice is off by its share) and
    nothing past row `rows` touched, nor, given a BatchDesc of `live` tokens, past those (none
    for an empty step). x has exactly `rows` rows (compute-sanitizer sees a read past them)."""
    k = kernels(cf)
    d = desc(cf, live) if live is not None else None
    added = rows if live is None else min(rows, live)
    rng = np.random.default_rng(rows * 11 + k_in)
    cap = 40  # the output's rows: added .. cap must stay as they were
    x = rb(rng.standard_normal((rows, k_in)))
    w = rb(rng.standard_normal((n_out, k_in)) * k_in ** -0.5)
    resid = rng.standard_normal((cap, n_out)).astype(np.float32)
    expect = resid[:added] + x[:added].astype(np.float64) @ w.T.astype(np.float64)
    dx = dev(cf, float32_to_bf16_bits(x))
    dw = dev(cf, tiled(cf, float32_to_bf16_bits(w)))
    out = dev(cf, resid)
    k.splitk_add_linear(stream, dx.ptr, dw.ptr, out.ptr, rows, k_in, n_out, chunk=chunk,
                        desc=d.ptr if d else 0, cluster=cluster)
    cf.synchronize(stream)
    got = out.download()
    if added:
        assert rel_err(got[:added], expect) < 1e-5
    np.testing.assert_array_equal(got[added:], resid[added:])


def test_splitk_add_linear_refuses_shapes_it_does_not_take(cf, stream):
    k = kernels(cf)
    assert not k.splitk_fits(33, 256, 64) and not k.splitk_fits(4, 100, 64)
    assert not k.splitk_fits(4, 256, 66)  # 16-byte adds: whole groups of 4 columns
    with pytest.raises(ValueError, match="split-K linear"):
        k.splitk_add_linear(stream, 0, 0, 0, 33, 256, 64)
    assert not k.splitk_fits(4, 0, 64) and not k.splitk_fits(4, 256, 0)
    with pytest.raises(ValueError, match="split-K chunk 384"):
        k.splitk_add_linear(stream, 0, 0, 0, 32, 1024, 64, chunk=384)
    with pytest.raises(ValueError, match="16-byte aligned"):
        k.splitk_add_linear(stream, 8, 0, 0, 32, 1024, 64)
    # the default chunk divides K in whole batches, and leaves several where the grid needs them
    chunk = k.splitk_chunk(14336, 4096)
    assert 14336 % chunk == 0 and chunk % k.splitk_chunk_align == 0
    assert 4096 // k.splitk_chunk(4096, 4096) > 1


# (rows, in_features, out_features): 17..32 token rows and fewer; K in one slab of x and in
# several (slabs of 384 and 512 columns: 8B's gate|up is 4,096 in 8); gate|up rows in whole
# CTAs and with a partial last one (9 pairs: two CTAs of 4 and one of 1).
ROWBLOCK_CASES = [(17, 256, 256), (32, 4096, 1024), (20, 1152, 288), (3, 2048, 512),
                  (32, 4608, 256)]


@pytest.mark.parametrize("rows,k_in,n_w", ROWBLOCK_CASES)
@pytest.mark.parametrize("live", [None, 13, 0])
@pytest.mark.parametrize("cluster", [1, 2, 4])
def test_rowblock_silu_mul(cf, stream, rows, k_in, n_w, live, cluster):
    """gate|up + SiLU with a CTA's rows over all of K, against float64 on the same bf16 inputs
    (gate and up rounded to bf16, as a GEMM stores them): every output of the live rows written
    once, nothing past them (poison first), none for an empty step. x has exactly `rows` rows
    (compute-sanitizer sees a read past them)."""
    k = kernels(cf)
    d = desc(cf, live) if live is not None else None
    written = rows if live is None else min(rows, live)
    rng = np.random.default_rng(rows * 13 + k_in)
    cap, inter = 40, n_w // 2
    x = rb(rng.standard_normal((rows, k_in)))
    w = rb(rng.standard_normal((n_w, k_in)) * k_in ** -0.5)
    pairs = (x[:written].astype(np.float64) @ w.T.astype(np.float64)).reshape(
        written, inter // 16, 2, 16)  # rows of w: gate|up interleaved in 16s
    gate = rb(pairs[:, :, 0].reshape(written, inter))
    up = rb(pairs[:, :, 1].reshape(written, inter))
    expect = gate / (1 + np.exp(-gate.astype(np.float64))) * up
    dx = dev(cf, float32_to_bf16_bits(x))
    dw = dev(cf, tiled(cf, float32_to_bf16_bits(w)))
    out = dev(cf, np.zeros((cap, inter), np.uint16), poison=True)
    k.rowblock_silu_mul(stream, rows, d.ptr if d else 0, dx.ptr, dw.ptr, out.ptr, k_in, n_w,
                        cluster=cluster)
    cf.synchronize(stream)
    got = out.download()
    if written:
        assert rel_err(bf16_to_f32(got[:written]), expect) < 1e-2
    assert (got[written:] == POISON_BF16).all()


def test_rowblock_silu_mul_refuses_shapes_it_does_not_take(cf, stream):
    k = kernels(cf)
    assert not k.rowblock_fits(33, 256, 64) and not k.rowblock_fits(4, 96, 64)
    assert not k.rowblock_fits(4, 256, 48)  # whole gate|up pairs of 16 rows
    with pytest.raises(ValueError, match="row-block gate"):
        k.rowblock_silu_mul(stream, 33, 0, 0, 0, 0, 256, 64)
    assert [k.rowblock_chunk_columns(c) for c in (256, 1152, 4096, 14336)] == [256, 384, 512,
                                                                               512]


# --- elementwise kernels -------------------------------------------------------------------

BUCKET = 128


@pytest.mark.parametrize("tokens", [1, 19, 99])
@pytest.mark.parametrize("hidden", [264, 256, 4112])
def test_embedding(cf, stream, tokens, hidden):
    """x, its shadow, its f16 form (fp8_x_f16) and, where hidden is whole 16s, its sums of
    squares in parts (fp8_x_sumsq), nothing past the live rows."""
    k = kernels(cf)
    rng = np.random.default_rng(tokens)
    vocab = 1000
    table = rb(rng.standard_normal((vocab, hidden)))
    ids = rng.integers(0, vocab, BUCKET).astype(np.int32)
    d_table, d_ids = dev(cf, float32_to_bf16_bits(table)), dev(cf, ids)
    x = dev(cf, np.zeros((BUCKET, hidden), np.float32), poison=True)
    shadow = dev(cf, np.zeros((BUCKET, hidden), np.uint16), poison=True)
    form = dev(cf, np.zeros((BUCKET, hidden), np.uint16), poison=True)
    norm_w = rb(1 + 0.3 * rng.standard_normal(hidden))
    squares = hidden % 16 == 0
    parts = dev(cf, np.zeros((BUCKET, hidden // 16), np.float32), poison=True)
    d_norm_w, d_desc = dev(cf, float32_to_bf16_bits(norm_w)), desc(cf, tokens)
    k.embedding(stream, BUCKET, d_desc.ptr, d_ids.ptr, d_table.ptr, x.ptr, hidden, vocab,
                x_shadow=shadow.ptr, x_f16=form.ptr, norm_w=d_norm_w.ptr,
                x_sumsq=parts.ptr if squares else 0)
    cf.synchronize(stream)
    out = x.download()
    np.testing.assert_array_equal(out[:tokens], table[ids[:tokens]])
    assert (out[tokens:].view(np.uint32) == POISON_F32).all()
    np.testing.assert_array_equal(shadow.download()[:tokens],
                                  float32_to_bf16_bits(table[ids[:tokens]]))
    assert (shadow.download()[tokens:] == POISON_BF16).all()
    # x's f16 form for the first layer's FP8 qkv kernel (CudaForward's fp8_x_f16)
    np.testing.assert_array_equal(form.download()[:tokens], f16_form(table[ids[:tokens]], norm_w))
    assert (form.download()[tokens:] == POISON_BF16).all()
    if squares:  # x's sums of squares in parts (CudaForward's fp8_x_sumsq)
        np.testing.assert_allclose(parts.download()[:tokens],
                                   square_parts(table[ids[:tokens]]), rtol=1e-5)
        assert (parts.download()[tokens:].view(np.uint32) == POISON_F32).all()
    else:
        with pytest.raises(ValueError, match="sums of squares"):
            k.embedding(stream, BUCKET, d_desc.ptr, d_ids.ptr, d_table.ptr, x.ptr, hidden,
                        vocab, x_shadow=shadow.ptr, x_f16=form.ptr, norm_w=d_norm_w.ptr,
                        x_sumsq=parts.ptr)


@pytest.mark.parametrize("tokens", [1, 19, 99])
@pytest.mark.parametrize("mode", ["plain", "bias", "gather"])
def test_rms_norm(cf, stream, tokens, mode):
    k = kernels(cf)
    rng = np.random.default_rng(tokens)
    hidden, eps = 264, 1e-5
    x = (rng.standard_normal((BUCKET, hidden)) * 3).astype(np.float32)
    weight = rb(1 + 0.1 * rng.standard_normal(hidden))
    bias = rb(rng.standard_normal(hidden))
    d_x, d_w = dev(cf, x), dev(cf, float32_to_bf16_bits(weight))
    d_b = dev(cf, float32_to_bf16_bits(bias))
    out = dev(cf, np.zeros((BUCKET, hidden), np.uint16), poison=True)
    form = dev(cf, np.zeros((BUCKET, hidden), np.uint16), poison=True)
    if mode == "gather":  # (the final norm: with the FP8 LM head's f16 form, fp8_x_f16)
        count = min(tokens, 8)
        gather = rng.integers(0, tokens, count).astype(np.int32)
        d_g = dev(cf, gather)
        k.rms_norm(stream, 8, desc(cf, tokens, count, count).ptr, d_x.ptr, d_w.ptr, out.ptr,
                   hidden, eps, gather=d_g.ptr, max_rows=BUCKET, x_f16=form.ptr)
        src = x[gather]
    else:
        count = tokens
        k.rms_norm(stream, BUCKET, desc(cf, tokens).ptr, d_x.ptr, d_w.ptr, out.ptr, hidden, eps,
                   bias=d_b.ptr if mode == "bias" else 0)
        src = x[:tokens] + (bias if mode == "bias" else 0)
    cf.synchronize(stream)
    src = src.astype(np.float64)
    ref = weight * src / np.sqrt(np.mean(src * src, -1, keepdims=True) + eps)
    got = out.download()
    assert rel_err(bf16_to_f32(got[:count]), ref) < 1e-2
    assert (got[count:] == POISON_BF16).all()
    if mode == "gather":
        np.testing.assert_array_equal(form.download()[:count], f16_form(bf16_to_f32(got[:count])))
    assert (form.download()[count if mode == "gather" else 0:] == POISON_BF16).all()
    if mode == "bias":  # the bias was added into the residual stream in place
        np.testing.assert_allclose(d_x.download()[:tokens], src, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(d_x.download()[tokens:], x[tokens:])


@pytest.mark.parametrize("tokens", [1, 19, 99])
@pytest.mark.parametrize("inter", [272, 4112])  # one CTA a row; three, the last partial
def test_silu_mul(cf, stream, tokens, inter):
    k = kernels(cf)
    rng = np.random.default_rng(tokens)
    gate = rb(rng.standard_normal((BUCKET, inter)) * 4)
    up = rb(rng.standard_normal((BUCKET, inter)) * 4)
    # the fused projection's output layout: the row of interleave_gate_up's weight layout
    gu = cf.interleave_gate_up(gate.T, up.T).T
    d_gu = dev(cf, float32_to_bf16_bits(np.ascontiguousarray(gu)))
    out = dev(cf, np.zeros((BUCKET, inter), np.uint16), poison=True)
    k.silu_mul(stream, BUCKET, desc(cf, tokens).ptr, d_gu.ptr, out.ptr, inter)
    cf.synchronize(stream)
    g, u = gate[:tokens].astype(np.float64), up[:tokens].astype(np.float64)
    got = out.download()
    assert rel_err(bf16_to_f32(got[:tokens]), g / (1 + np.exp(-g)) * u) < 1e-2
    assert (got[tokens:] == POISON_BF16).all()


# --- RoPE + KV write and paged attention ------------------------------------------------------

# Mixed batches: (start position, tokens) per sequence: prefill chunks, decodes, a fresh prompt.
MIXED = {1: [(0, 1)], 12: [(20, 9), (3, 1), (0, 2)], 19: [(37, 15), (300, 1), (5, 1), (0, 2)],
         99: [(0, 61), (64, 20), (130, 1), (7, 1), (0, 16)]}


def _inv_freq(head_dim: int, llama3: bool) -> np.ndarray:
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64} if llama3 else None
    return rope_inv_freq(types.SimpleNamespace(head_dim=head_dim, rope_theta=10000.0,
                                               rope_scaling=scaling))


def _ref_head_norm(x, w, eps):
    return w * x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)


def _ref_rope(x, positions, inv_freq):
    # x: [T, heads, D] f64; angles in f32 as the reference model forms them
    freqs = positions.astype(np.float32)[:, None] * inv_freq[None, :]
    emb = np.concatenate([freqs, freqs], -1).astype(np.float64)
    half = x.shape[-1] // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * np.cos(emb)[:, None] + rot * np.sin(emb)[:, None]


class RopeCase:
    """A mixed batch of q|k|v rows (natural layout) for the RoPE + KV write kernels, their
    device inputs (q and k rows in the pair layout) and poisoned outputs, and the check.
    kv_fp8: an E4M3 cache with a scale per (k|v, KV head) (kv_scales), and the calibration's
    maxima (kv_amax), zero before."""

    def __init__(self, cf, head_dim, tokens, variant, rng, nh=4, nkv=2, kv_fp8=False):
        self.D, self.nh, self.nkv, self.bs, self.eps = head_dim, nh, nkv, 16, 1e-6
        self.tokens, bf = tokens, float32_to_bf16_bits
        self.pb = PagedBatch(MIXED[tokens], self.bs, rng)
        self.width = (nh + 2 * nkv) * head_dim
        self.order = cf.rope_pair_order(nh, nkv, head_dim)
        self.bias = rb(rng.standard_normal(self.width)) if variant == "bias" else None
        self.q_norm = rb(1 + 0.1 * rng.standard_normal(head_dim)) if variant == "qk_norm" else None
        self.k_norm = rb(1 + 0.1 * rng.standard_normal(head_dim)) if variant == "qk_norm" else None
        self.inv_freq = _inv_freq(head_dim, variant == "llama3")
        self.d = {name: dev(cf, arr) for name, arr in dict(
            positions=self.pb.positions, token_seq=self.pb.token_seq, tables=self.pb.tables,
            inv_freq=self.inv_freq).items()}
        opt = {"bias": self.bias[self.order] if self.bias is not None else None,
               "q_norm": self.q_norm, "k_norm": self.k_norm}
        self.ptr = {name: dev(cf, bf(a)).ptr if a is not None else 0 for name, a in opt.items()}
        self.q_out = dev(cf, np.zeros((BUCKET, nh, head_dim), np.uint16), poison=True)
        cache = (self.pb.num_blocks, self.bs, nkv, head_dim)
        self.kv_fp8 = kv_fp8
        element = np.uint8 if kv_fp8 else np.uint16
        self.kc = dev(cf, np.zeros(cache, element), poison=True)
        self.vc = dev(cf, np.zeros(cache, element), poison=True)
        self.kv = {}  # the KV writers' kv_scales and kv_amax (an E4M3 cache)
        if kv_fp8:
            self.scales = (0.01 + 0.02 * rng.random((2, nkv))).astype(np.float32)
            self.amax = dev(cf, np.zeros((2, nkv), np.float32))
            self.kv = {"kv_scales": dev(cf, self.scales).ptr, "kv_amax": self.amax.ptr}

    def cache_values(self, got, kind) -> np.ndarray:
        """A cache row's values as float32: bf16 bits, or E4M3 codes times their head's scale
        (kind 0: keys, 1: values)."""
        if not self.kv_fp8:
            return bf16_to_f32(got)
        return e4m3_to_float32(got) * self.scales[kind][:, None]

    def check(self, qkv):
        """qkv: [tokens, width] float64, natural layout, before bias."""
        nh, nkv, D, pb, tokens = self.nh, self.nkv, self.D, self.pb, self.tokens
        x = qkv + (self.bias if self.bias is not None else 0)
        q = x[:, :nh * D].reshape(tokens, nh, D)
        kk = x[:, nh * D:(nh + nkv) * D].reshape(tokens, nkv, D)
        v = x[:, (nh + nkv) * D:].reshape(tokens, nkv, D)
        if self.q_norm is not None:
            q = _ref_head_norm(q, self.q_norm, self.eps)
            kk = _ref_head_norm(kk, self.k_norm, self.eps)
        positions = pb.positions[:tokens]
        q, kk = _ref_rope(q, positions, self.inv_freq), _ref_rope(kk, positions, self.inv_freq)
        got_q = self.q_out.download()
        assert rel_err(bf16_to_f32(got_q[:tokens]), q) < 1e-2
        assert (got_q[tokens:] == POISON_BF16).all()
        got_k, got_v = self.kc.download(), self.vc.download()
        written = np.zeros(got_k.shape[:2], bool)
        for t in range(tokens):
            blk, row = pb.slot(pb.token_seq[t], pb.positions[t])
            written[blk, row] = True
            for kind, got, want in ((0, got_k[blk, row], kk[t]), (1, got_v[blk, row], v[t])):
                values = self.cache_values(got, kind)
                if self.kv_fp8:  # the nearest code (or, within the bf16 inputs' rounding, the
                    # other one of the two around the value): within half a grid step and 1%,
                    # of the value saturated at the head's largest (448 times its scale)
                    scale = self.scales[kind][:, None]
                    want = np.clip(want, -448 * scale, 448 * scale)
                    bound = e4m3_half_step(want / scale) * scale + 1e-2 * np.abs(want)
                    assert (np.abs(values - want) <= bound).all(), (kind, t)
                else:
                    assert rel_err(values, want) < 1e-2
        poison = 0xFF if self.kv_fp8 else POISON_BF16
        assert (got_k[~written] == poison).all() and (got_v[~written] == poison).all()
        if self.kv_fp8:  # each head's largest |key| and |value| written, noted
            amax = self.amax.download()
            want = [np.abs(kk[:tokens]).max((0, 2)), np.abs(v[:tokens]).max((0, 2))]
            np.testing.assert_allclose(amax, want, rtol=1e-2)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("tokens", [1, 19, 99])
@pytest.mark.parametrize("variant", ["plain", "bias", "qk_norm", "llama3"])
@pytest.mark.parametrize("kv_fp8", [False, True])
def test_rope_kv_write(cf, stream, head_dim, tokens, variant, kv_fp8):
    """RoPE + KV write against float64: q rotated, k rotated and v into the cache (bf16, or
    E4M3 with its head's scale, each head's largest |value| noted), nothing else written."""
    k = kernels(cf, head_dim, kv_fp8)
    rng = np.random.default_rng(head_dim + tokens)
    case = RopeCase(cf, head_dim, tokens, variant, rng, kv_fp8=kv_fp8)
    qkv = rb(rng.standard_normal((BUCKET, case.width)))
    d_qkv = dev(cf, float32_to_bf16_bits(qkv[:, case.order]))  # the projection's row order
    k.rope_kv_write(stream, BUCKET, desc(cf, tokens, len(case.pb.seqs)).ptr,
                    case.d["positions"].ptr, case.d["token_seq"].ptr, case.d["tables"].ptr,
                    case.pb.max_blocks, d_qkv.ptr, case.ptr["bias"], case.ptr["q_norm"],
                    case.ptr["k_norm"], case.eps, case.d["inv_freq"].ptr, case.nh, case.nkv,
                    case.q_out.ptr, case.kc.ptr, case.vc.ptr, case.bs, case.pb.num_blocks,
                    **case.kv)
    cf.synchronize(stream)
    case.check(qkv[:tokens].astype(np.float64))


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("tokens", [1, 12, 19])
@pytest.mark.parametrize("variant", ["plain", "bias", "llama3"])
@pytest.mark.parametrize("wide", [False, True])  # one and two row tiles per CTA
@pytest.mark.parametrize("hidden", [256, 4096])  # remainder steps only; whole batches too
@pytest.mark.parametrize("layout", ["row-major", "tiled"])
@pytest.mark.parametrize("rows", [8, 16, 32])  # one, two and four column tiles
def test_skinny_qkv_rope(cf, stream, head_dim, tokens, variant, wide, hidden, layout, rows):
    """The qkv projection with RoPE + KV write fused, against float64: rms_norm(x) @ w^T (8
    and 16 rows: the RMSNorm folded in) or x @ w^T (32 rows: x is the RMSNorm kernel's output),
    then RoPE, q to its buffer, k and v into the paged cache. Rows past the live tokens (the
    bucket's `rows`) write nothing. tokens 12 and 19: their first `rows` tokens at most (12 of
    16: the second column tile part live; 19 of 32: the third)."""
    check_skinny_qkv_rope(cf, stream, head_dim, tokens, variant, wide, hidden, layout, rows, 1)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("tokens", [1, 12])
@pytest.mark.parametrize("variant", ["plain", "bias"])
@pytest.mark.parametrize("hidden", [256, 2048])
@pytest.mark.parametrize("rows", [8, 16])
def test_skinny_qkv_rope_k_split(cf, stream, head_dim, tokens, variant, hidden, rows):
    """The same with the RMSNorm folded in and K split across clusters of two CTAs: the norm's
    sum of squares, too, is the two CTAs' halves added."""
    check_skinny_qkv_rope(cf, stream, head_dim, tokens, variant, False, hidden, "tiled", rows, 2)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("tokens", [1, 12])
@pytest.mark.parametrize("variant", ["plain", "bias"])
@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("rows,k_splits", [(8, 1), (16, 1), (8, 2)])
@pytest.mark.parametrize("weights,kv", [("fp8", "bf16"), ("bf16", "fp8"), ("fp8", "fp8"),
                                        ("fp8 x_f16", "bf16"), ("fp8 x_f16", "fp8"),
                                        ("fp8 x_f16 x_sumsq", "fp8")])
def test_skinny_qkv_rope_fp8(cf, stream, head_dim, tokens, variant, wide, rows, k_splits,
                             weights, kv):
    """The fused qkv projection (RMSNorm folded in, tiled weights; the row-major layout is
    test_skinny_linear_fp8's) with FP8 weights (the _fp8 entries: the norm's weight given
    apart), an E4M3 KV cache (its head's scale, the calibration maxima noted), or both; and
    with x's f16 form given (the _xf16 entries, up to 8 rows: CudaForward's fp8_x_f16), and its
    sums of squares in parts too (the _xf16sq entries, given x as NaN: CudaForward's
    fp8_x_sumsq; the reference check is then on their outputs)."""
    if k_splits == 2 and wide:
        pytest.skip("K splits take one row tile a CTA")
    if "x_f16" in weights and rows > 8:
        pytest.skip("x's f16 form: one column tile")
    check_skinny_qkv_rope(cf, stream, head_dim, tokens, variant, wide, 2048, "tiled", rows,
                          k_splits, fp8="fp8" in weights, kv_fp8=kv == "fp8",
                          x_f16="x_f16" in weights, x_sumsq="x_sumsq" in weights)


def check_skinny_qkv_rope(cf, stream, head_dim, tokens, variant, wide, hidden, layout, rows,
                          k_splits, fp8=False, kv_fp8=False, x_f16=False, x_sumsq=False):
    k = kernels(cf, head_dim, kv_fp8)
    rng = np.random.default_rng(head_dim + tokens + wide)
    heads = ((64, 8) if head_dim == 128 else (128, 8)) if wide else (4, 2)
    case = RopeCase(cf, head_dim, tokens, variant, rng, *heads, kv_fp8=kv_fp8)
    norm = rows <= k.SKINNY_NORM_MAX_ROWS
    assert k._skinny_tiles(rows, 256, case.width, False, norm) == (2 if wide else 1, rows // 8)
    live = min(tokens, rows)
    case.tokens = live
    x = rb(rng.standard_normal((rows, hidden)) * 5)
    w = rb(rng.standard_normal((case.width, hidden)) * hidden ** -0.5)
    fp8_args = {}
    if fp8:  # the codes' values against x times the norm's weight, as the kernel rounds it
        norm_w = rb(1 + 0.3 * rng.standard_normal(hidden))
        codes, scale, _ = fp8_weight(w[case.order])
        _, _, w_values = fp8_weight(w)  # (row-separable: the same values in the natural order)
        w_bits = codes
        h = f16_input(x[:live].astype(np.float32) * norm_w) * _rms_scale(x[:live], case.eps)
        fp8_args = {"w_scale": dev(cf, scale).ptr,
                    "norm_w": dev(cf, float32_to_bf16_bits(norm_w)).ptr}
        if x_f16:  # the kernel's MMAs take this form as it is (the reference is the same)
            d_form = dev(cf, f16_form(x, norm_w))
    else:
        w_bits = float32_to_bf16_bits(w[case.order])
        w_values = w.astype(np.float64)
        h = x[:live] * _rms_scale(x[:live], case.eps) if norm else x[:live]
    d_x, d_w = dev(cf, float32_to_bf16_bits(x)), dev(cf, tiled(cf, w_bits) if layout == "tiled"
                                                      else w_bits)
    d_desc = desc(cf, live, len(case.pb.seqs))

    def launch(x_ptr=d_x.ptr, **given):
        k.skinny_qkv_rope(stream, rows, d_desc.ptr, x_ptr, d_w.ptr, hidden,
                          case.eps if norm else None, case.d["positions"].ptr,
                          case.d["token_seq"].ptr, case.d["tables"].ptr, case.pb.max_blocks,
                          case.ptr["bias"], case.d["inv_freq"].ptr, case.nh, case.nkv,
                          case.q_out.ptr, case.kc.ptr, case.vc.ptr, case.bs, case.pb.num_blocks,
                          w_tiled=layout == "tiled", k_splits=k_splits, **fp8_args, **given,
                          **case.kv)
        cf.synchronize(stream)
        return [a.download() for a in (case.q_out, case.kc, case.vc)]

    converted = launch()
    if x_f16:  # the _xf16 entry, given x's f16 form, writes the same bits
        for got, want in zip(launch(x_f16=d_form.ptr), converted):
            np.testing.assert_array_equal(got, want)
    if x_sumsq:  # the _xf16sq entry reads no x (NaN here): its outputs, poisoned first, are the
        # ones checked
        nan_x = dev(cf, np.full((rows, hidden), 0x7FC0, np.uint16))
        parts = dev(cf, square_parts(x).astype(np.float32))  # (every row the kernel computes)
        for out in (case.q_out, case.kc, case.vc):
            out.fill_bytes(0xFF)
        launch(nan_x.ptr, x_f16=d_form.ptr, x_sumsq=parts.ptr)
    case.check(rb(h @ w_values.T).astype(np.float64))


def _ref_attention(q, kc, vc, pb: PagedBatch, nh, nkv):
    # q: [T, nh, D]; kc, vc: [num_blocks, bs, nkv, D] -> [T, nh, D], all f64
    D, group = q.shape[-1], nh // nkv
    out = np.zeros_like(q)
    t = 0
    for s, (start, n) in enumerate(pb.seqs):
        ctx = start + n
        kv_pos = np.arange(ctx)
        blk, row = pb.tables[s, kv_pos // pb.block_size], kv_pos % pb.block_size
        keys, vals = kc[blk, row], vc[blk, row]  # [ctx, nkv, D]
        qs = q[t:t + n].reshape(n, nkv, group, D)
        scores = np.einsum("nkgd,ckd->kgnc", qs, keys) * D ** -0.5
        scores = np.where(kv_pos[None, :] <= pb.positions[t:t + n, None], scores, -np.inf)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[t:t + n] = np.einsum("kgnc,ckd->nkgd", p, vals).reshape(n, nh, D)
        t += n
    return out


# Decode batches: one token per sequence (the flash-decoding path), contexts from 1 key to
# several thousand, so that splits hold one tile, many tiles, or none at all.
DECODES = [(1000, 1), (63, 1), (64, 1), (0, 1), (2047, 1), (129, 1), (5, 1), (700, 1),
           (3000, 1), (31, 1), (32, 1)]
# One decode token at 4,000 keys (63 chunks of 64): with few (token, KV head) CTAs its keys
# spread over more splits than the merge keeps loads in flight for (16).
ATTENTION_BATCHES = {**MIXED, "decode": DECODES, "one long decode": [(3999, 1)],
                     # chunks deep into their contexts (as a prefix-cache hit leaves them),
                     # two starting inside a query tile, beside a decode and a fresh prompt
                     "deep chunks": [(3990, 40), (1900, 50), (700, 21), (1300, 1), (3, 4)]}


# (head_dim, num_heads, num_kv_heads): GQA groups 1, 4 (Llama 8B), 3 and 7 (runtime groups under
# a larger compile-time bound), 8, and 64 (over the decode path's bound: tile path only).
@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads",
                         [(64, 8, 8), (64, 8, 2), (64, 12, 4), (128, 32, 8), (128, 28, 4),
                          (128, 16, 2), (128, 32, 4), (128, 64, 1)])
@pytest.mark.parametrize("batch", [1, 19, 99, "decode"])
@pytest.mark.parametrize("splits", [1, 3, 64])
# the kernel: 64-row query tiles, 16-row ones, 16-row ones with more warps a CTA, 128-row ones
# on wgmma (two warpgroups), 64-row ones compiled for fewer CTAs an SM (roomy)
@pytest.mark.parametrize("variant", ["", "small", "small_wide", "wgmma", "roomy"])
# decode tokens: all on the flash-decoding path, none, or split by context length in one launch
@pytest.mark.parametrize("decode_min_keys", [0, 500, 2 ** 31 - 1])
def test_paged_attention(cf, stream, head_dim, num_heads, num_kv_heads, batch, splits, variant,
                         decode_min_keys):
    """Mixed batches and decode batches against float64; every output row written, nothing
    past num_tokens written, no unreadable cache slot read (NaN there), the tile counters back
    at zero after each launch, and a second launch bit-identical (fixed merge order)."""
    _check_attention(cf, stream, head_dim, num_heads, num_kv_heads, batch, splits, variant,
                     decode_min_keys, block_size=16)


# Block sizes other than 16: multiples of 16 (the decode path's one block-table lookup a warp
# step: 32, and 48, which is not a power of two) and others (a lookup a key: 8, 24, 5).
@pytest.mark.parametrize("block_size", [32, 48, 8, 24, 5])
@pytest.mark.parametrize("batch", [19, "decode"])
@pytest.mark.parametrize("splits", [1, 64])
@pytest.mark.parametrize("variant", ["", "small_wide", "wgmma", "roomy"])
def test_paged_attention_block_sizes(cf, stream, block_size, batch, splits, variant):
    """As test_paged_attention, with other block sizes (Llama-3.1-8B's heads, the decode path
    for every decode token)."""
    _check_attention(cf, stream, 128, 32, 8, batch, splits, variant, 0, block_size=block_size)


# A decode token whose keys spread over more splits than the merge keeps loads in flight for
# (16): at most 21 splits give 21 splits of 3 chunks; 64 give 63 splits of one chunk, or 32 of
# two at 8 KV heads (8 x 63 CTAs would not fit one wave).
@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads",
                         [(64, 8, 2), (64, 12, 4), (128, 32, 8), (128, 28, 4)])
@pytest.mark.parametrize("splits", [21, 64])
@pytest.mark.parametrize("variant", ["", "small_wide"])
def test_paged_attention_many_splits(cf, stream, head_dim, num_heads, num_kv_heads, splits,
                                     variant):
    """As test_paged_attention, for one decode token at 4,000 keys."""
    _check_attention(cf, stream, head_dim, num_heads, num_kv_heads, "one long decode", splits,
                     variant, 0, block_size=16)


# An E4M3 KV cache (the module built with kv_fp8): both paths at both head dims, GQA groups
# 1, 4, 8 and 64 (tile path only), splits, the block layouts.
@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads",
                         [(64, 8, 8), (64, 8, 2), (128, 32, 8), (128, 16, 2), (128, 64, 1)])
@pytest.mark.parametrize("batch", [19, 99, "decode", "one long decode"])
@pytest.mark.parametrize("splits", [1, 64])
@pytest.mark.parametrize("variant", ["", "small_wide", "wgmma", "roomy"])
@pytest.mark.parametrize("block_size", [16, 24])
def test_paged_attention_fp8_kv(cf, stream, head_dim, num_heads, num_kv_heads, batch, splits,
                                variant, block_size):
    """As test_paged_attention on an E4M3 cache with a scale per (k|v, KV head): against
    float64 on the codes' values (the query, the probabilities in f16 on the way)."""
    _check_attention(cf, stream, head_dim, num_heads, num_kv_heads, batch, splits, variant,
                     0, block_size=block_size, kv_fp8=True)


# Query tiles spread over their tokens' CTAs (split_stride above the grid's splits): chunks deep
# into their contexts take a split per kTileSplitMinKeys keys, from CTAs of several tokens.
@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads",
                         [(64, 8, 2), (64, 12, 4), (128, 32, 8), (128, 28, 4), (128, 64, 1)])
@pytest.mark.parametrize("batch", ["deep chunks", 99])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("variant", ["", "small", "small_wide", "wgmma", "roomy"])
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_paged_attention_spread_tiles(cf, stream, head_dim, num_heads, num_kv_heads, batch,
                                      splits, variant, kv):
    """As test_paged_attention with split_stride = splits x a tile's tokens (CudaForward's
    attention_split_stride for the buckets of short chunks)."""
    if kv == "fp8" and head_dim == 64 and num_heads == 12:
        pytest.skip("one GQA group of 3 is enough beside the bf16 cache")
    _check_attention(cf, stream, head_dim, num_heads, num_kv_heads, batch, splits, variant, 0,
                     block_size=16, kv_fp8=kv == "fp8", spread=True)


def _attention_flags(variant: str) -> dict[str, bool]:
    """ForwardKernels.attention's kernel arguments for a variant ("", "small", "small_wide",
    "wgmma", "roomy")."""
    return dict(small=variant.startswith("small"), wide=variant.endswith("wide"),
                wgmma=variant == "wgmma", roomy=variant == "roomy")


def _check_attention(cf, stream, head_dim, num_heads, num_kv_heads, batch, splits, variant,
                     decode_min_keys, block_size, kv_fp8=False, spread=False):
    """variant: the kernel's name past blink_paged_attention ("", "small", "small_wide",
    "wgmma", "roomy").
    kv_fp8: an E4M3 cache (the module built for it) with a scale per (k|v, KV head).
    spread: a query tile's keys split over its tokens' CTAs too (split_stride = splits x the
    tile's tokens, at most attention_max_splits)."""
    k = kernels(cf, head_dim, kv_fp8)
    flags = _attention_flags(variant)
    if flags["wgmma"] and not k.attention_wgmma_available:
        pytest.skip(f"no wgmma attention in this module (sm_{k.arch}; it needs sm_90a)")
    if flags["small"] and num_heads // num_kv_heads > k.attention_small_rows:
        pytest.skip("GQA group larger than the small variant's rows")
    seqs = ATTENTION_BATCHES[batch]
    tokens = sum(n for _, n in seqs)
    rng = np.random.default_rng(head_dim * num_heads + tokens)
    D, bs = head_dim, block_size
    pb = PagedBatch(seqs, bs, rng)
    q = rb(rng.standard_normal((BUCKET, num_heads, D)))
    kc = rb(rng.standard_normal((pb.num_blocks, bs, num_kv_heads, D)))
    vc = rb(rng.standard_normal((pb.num_blocks, bs, num_kv_heads, D)))
    kv_args, poison = {}, POISON_BF16
    if kv_fp8:  # the cache's codes, each head with its scale; the reference takes their values
        scales = (0.005 + 0.01 * rng.random((2, num_kv_heads))).astype(np.float32)
        kc_bits, vc_bits = (float32_to_e4m3(c * (np.float32(1) / scales[i])[:, None])
                            for i, c in enumerate((kc, vc)))
        kc = e4m3_to_float32(kc_bits) * scales[0][:, None]
        vc = e4m3_to_float32(vc_bits) * scales[1][:, None]
        kv_args, poison = {"kv_scales": dev(cf, scales).ptr}, 0xFF
    else:
        kc_bits, vc_bits = float32_to_bf16_bits(kc), float32_to_bf16_bits(vc)
    # Every cache slot no query may read is NaN: reading one would poison the output.
    readable = np.zeros((pb.num_blocks, bs), bool)
    for s, (start, n) in enumerate(pb.seqs):
        for p in range(start + n):
            readable[pb.slot(s, p)] = True
    kc_bits[~readable] = poison
    vc_bits[~readable] = poison
    # Batch arrays at the bucket's capacity, as the engine allocates them; the rows past
    # num_tokens hold stale values (the last token's sequence: it must still count as alone).
    pad = BUCKET - tokens
    d = {name: dev(cf, arr) for name, arr in dict(
        positions=np.concatenate([pb.positions, np.full(pad, 7, np.int32)]),
        token_seq=np.concatenate([pb.token_seq, np.full(pad, pb.token_seq[-1], np.int32)]),
        tables=pb.tables, q=float32_to_bf16_bits(q), kc=kc_bits, vc=vc_bits).items()}
    out = dev(cf, np.zeros((BUCKET, num_heads, D), np.uint16), poison=True)
    stride = (k.attention_spread_stride(splits, num_heads // num_kv_heads, flags["small"],
                                        flags["wgmma"]) if spread else splits)
    # Splits: workspaces poisoned too (a split with no key must not be read).
    part_out = dev(cf, np.zeros((BUCKET, num_heads, stride, D), np.float32), poison=True)
    part_stats = dev(cf, np.zeros((BUCKET, num_heads, stride, 2), np.float32), poison=True)
    sems = dev(cf, np.zeros((BUCKET, num_kv_heads), np.uint32))

    def launch():
        out.fill_bytes(0xFF)
        k.attention(stream, BUCKET, desc(cf, tokens, len(pb.seqs)).ptr, d["positions"].ptr,
                    d["token_seq"].ptr, d["tables"].ptr, pb.max_blocks, d["q"].ptr, d["kc"].ptr,
                    d["vc"].ptr, bs, num_heads, num_kv_heads, D ** -0.5, out.ptr, splits,
                    part_out.ptr, part_stats.ptr, sems.ptr, **flags,
                    decode_min_keys=decode_min_keys, split_stride=stride, **kv_args)
        cf.synchronize(stream)
        assert (sems.download() == 0).all(), "a tile counter was left non-zero"
        return out.download()

    got = launch()
    ref = _ref_attention(q[:tokens].astype(np.float64), kc.astype(np.float64),
                         vc.astype(np.float64), pb, num_heads, num_kv_heads)
    err = rel_err(bf16_to_f32(got[:tokens]), ref)
    REPORT["errors"][f"attention D={D} heads={num_heads}/{num_kv_heads} batch={batch} "
                     f"splits={splits}{f'/{stride}' if spread else ''} "
                     f"kernel={variant or 'large'} "
                     f"decode_min_keys={decode_min_keys}"
                     + ("" if bs == 16 else f" block_size={bs}")
                     + (" kv fp8" if kv_fp8 else "")] = err
    assert np.isfinite(bf16_to_f32(got[:tokens])).all()
    assert err < 1e-2
    assert (got[tokens:] == POISON_BF16).all()
    if spread and batch == "deep chunks" and stride > splits:
        # the first chunk's tiles (4,030 keys) split beyond the grid's splits: its rows'
        # partials were written past them (the workspace is poisoned elsewhere)
        written = np.isfinite(part_stats.download()[:seqs[0][1], :, splits:, 0])
        assert written.any(), "no query tile's keys spread over its tokens' CTAs"

    np.testing.assert_array_equal(launch(), got)


# --- sampling --------------------------------------------------------------------------------

def _sample(cf, stream, logits, temperature, top_p, top_k, seed, step):
    """Runs the sampling kernel over logits [rows, V]; per-row parameters broadcast."""
    rows, vocab = logits.shape
    k = kernels(cf)

    def col(v, dtype):
        return np.ascontiguousarray(np.broadcast_to(np.asarray(v, dtype), (rows,)))
    arrs = [dev(cf, col(v, t)) for v, t in ((temperature, np.float32), (top_p, np.float32),
                                             (top_k, np.int32), (seed, np.uint64),
                                             (step, np.uint32))]
    d_logits = dev(cf, logits.astype(np.float32))
    out = dev(cf, np.zeros(rows + 1, np.int32), poison=True)
    k.sample(stream, rows + 1, desc(cf, rows, rows, rows).ptr, d_logits.ptr, vocab,
             *[a.ptr for a in arrs], out.ptr)
    cf.synchronize(stream)
    got = out.download()
    assert got[rows] == -1  # the row past num_logits is not written
    return got[:rows]


# (logit rows, vocab, K split): one row (batch 1, clusters of two), a decode batch, 16 rows over
# two column tiles; a vocabulary with a partial last row block.
@pytest.mark.parametrize("rows,vocab,k_splits", [(1, 4000, 2), (7, 5000, 1), (16, 3000, 1)])
def test_lm_head_argmax_feeds_greedy_sampling(cf, stream, rows, vocab, k_splits):
    """The skinny LM head with argmax= reduces each row's greedy token as it stores the logits
    (one atomicMax a CTA a row), and the sampling kernel's greedy rows take it: the argmax of
    the logits it wrote, the lowest id on exact ties (two equal weight rows in different row
    blocks, one a row's maximum; a row of equal logits), 0 for a row of NaN logits; a sampling
    row (temperature 1; top-k 1 is greedy) still draws a token; every row's word is zero
    again after, and a second step gives the same tokens."""
    k = kernels(cf)
    rng = np.random.default_rng(rows + vocab)
    hidden = 256
    x = rb(rng.standard_normal((rows, hidden)))
    w = rb(rng.standard_normal((vocab, hidden)) * hidden ** -0.5)
    best = int(np.argmax(x[0] @ w.T))  # row 0's maximum, copied half the vocabulary away
    copy = (best + vocab // 2) % vocab
    w[copy] = w[best]
    if rows > 2:
        x[1] = np.nan  # every logit NaN: token 0
        x[2] = 0.0  # every logit equal: token 0
    d_x, d_w = dev(cf, float32_to_bf16_bits(x)), dev(cf, tiled(cf, float32_to_bf16_bits(w)))
    logits = dev(cf, np.zeros((rows, vocab), np.float32), poison=True)
    words = dev(cf, np.zeros(rows, np.uint64))
    temperature = np.zeros(rows, np.float32)
    top_k = np.zeros(rows, np.int32)
    if rows > 4:
        temperature[3:5] = 1.0
        top_k[4] = 1  # greedy by top-k
    params = [dev(cf, a) for a in (temperature, np.ones(rows, np.float32), top_k,
                                   np.arange(rows, dtype=np.uint64), np.zeros(rows, np.uint32))]
    sampled = dev(cf, np.zeros(rows, np.int32), poison=True)

    def step():
        k.skinny_linear(stream, d_x.ptr, d_w.ptr, logits.ptr, rows, hidden, vocab,
                        cf.SKINNY_F32, w_tiled=True, k_splits=k_splits, argmax=words.ptr)
        k.sample(stream, rows, desc(cf, rows, rows, rows).ptr, logits.ptr, vocab,
                 *[a.ptr for a in params], sampled.ptr, lm_argmax=words.ptr)
        cf.synchronize(stream)
        assert (words.download() == 0).all(), "a row's argmax word was left non-zero"
        return sampled.download()

    got, lg = step(), logits.download()
    greedy = (temperature <= 0) | (top_k == 1)
    np.testing.assert_array_equal(got[greedy], np.argmax(lg, -1)[greedy])
    assert got[0] == min(best, copy) and lg[0, best] == lg[0, copy] == lg[0].max()
    if rows > 2:
        assert np.isnan(lg[1]).all() and got[1] == 0 and got[2] == 0
    if rows > 4:
        assert 0 <= got[3] < vocab
    np.testing.assert_array_equal(step(), got)


def test_uniform_bit_identical_to_cpu(cf, stream):
    rng = np.random.default_rng(0)
    seeds = np.concatenate([rng.integers(0, 2 ** 63, 998, dtype=np.uint64) * np.uint64(2),
                            np.array([0, 2 ** 64 - 1], np.uint64)])
    steps = np.concatenate([rng.integers(0, 2 ** 32, 998, dtype=np.uint64),
                            np.array([0, 2 ** 32 - 1])]).astype(np.uint32)
    d_seed, d_step = dev(cf, seeds), dev(cf, steps)
    out = dev(cf, np.zeros(len(seeds), np.float64), poison=True)
    kernels(cf).uniform(stream, d_seed.ptr, d_step.ptr, out.ptr, len(seeds))
    cf.synchronize(stream)
    expect = np.array([uniform(int(s), int(t)) for s, t in zip(seeds, steps)])
    np.testing.assert_array_equal(out.download(), expect)


def test_greedy_is_argmax_lowest_id_on_ties(cf, stream):
    rng = np.random.default_rng(1)
    vocab = 151936
    logits = (rng.standard_normal((6, vocab)) * 3).astype(np.float32)
    logits[2, [17, 90000]] = 100.0  # an exact tie: the lower id wins
    logits[3, :] = -np.inf
    logits[3, 123] = 0.0
    temperature = [0.0, 0.0, 0.0, 0.0, 1.0, 0.7]
    top_k = [0, 0, 0, 0, 1, 1]
    got = _sample(cf, stream, logits, temperature, 1.0, top_k, 7, 0)
    np.testing.assert_array_equal(got, np.argmax(logits, -1))
    assert got[2] == 17 and got[3] == 123


def _expected_probs(logits, temperature, top_k, top_p):
    """The CPU sampler's distribution (gpu_engine.sampling.sampling_distribution) in float64,
    over the vocabulary."""
    order, probs = sampling_distribution(logits, SamplingParams(
        max_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p))
    out = np.zeros(len(logits))
    out[order] = probs
    return out


SAMPLING_CONFIGS = [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (1.0, 10, 0.9), (2.0, 3, 0.3)]


@pytest.mark.parametrize("temperature,top_k,top_p", SAMPLING_CONFIGS)
def test_sampling_distribution(cf, stream, temperature, top_k, top_p):
    rng = np.random.default_rng(int(temperature * 10) + top_k)
    vocab, rows = 50, 8192
    base = (rng.standard_normal(vocab) * 2).astype(np.float32)
    got = _sample(cf, stream, np.tile(base, (rows, 1)), temperature, top_p, top_k,
                  np.arange(rows, dtype=np.uint64) * np.uint64(7919) + np.uint64(3), 11)
    expect = _expected_probs(base, temperature, top_k, top_p)
    counts = np.bincount(got, minlength=vocab)
    assert counts[expect == 0].sum() == 0, "sampled a token outside the top-k/top-p set"
    # Chi-square over the kept tokens; bins below 5 expected draws pooled.
    e = expect[expect > 0] * rows
    o = counts[expect > 0]
    small = e < 5
    e = np.append(e[~small], e[small].sum()) if small.any() else e
    o = np.append(o[~small], o[small].sum()) if small.any() else o
    chi2, dof = float(((o - e) ** 2 / np.maximum(e, 1e-9)).sum()), max(len(e) - 1, 1)
    REPORT["errors"][f"sampling chi2 T={temperature} k={top_k} p={top_p}"] = f"{chi2:.1f}/{dof}"
    assert chi2 < dof + 6 * np.sqrt(2 * dof) + 10


def test_sampling_matches_cpu_when_vocab_order_is_sorted_order(cf, stream):
    # With logits descending in vocabulary order, the GPU's inverse CDF in vocabulary order and
    # the CPU's in sorted order walk the same sequence: the draws agree except where u lands
    # within rounding of a boundary.
    rng = np.random.default_rng(5)
    vocab, rows = 64, 2048
    base = np.sort(rng.standard_normal(vocab) * 2)[::-1].astype(np.float32)
    configs = [SAMPLING_CONFIGS[i % len(SAMPLING_CONFIGS)] for i in range(rows)]
    temperature = [c[0] for c in configs]
    top_k = [c[1] for c in configs]
    top_p = [c[2] for c in configs]
    seeds = rng.integers(0, 2 ** 63, rows, dtype=np.uint64)
    steps = rng.integers(0, 1000, rows).astype(np.uint32)
    got = _sample(cf, stream, np.tile(base, (rows, 1)), temperature, top_p, top_k, seeds, steps)
    cpu = [sample_token(base, SamplingParams(max_tokens=1, temperature=t, top_p=p, top_k=kk,
                                             seed=int(s)), int(st))
           for t, p, kk, s, st in zip(temperature, top_p, top_k, seeds, steps)]
    mismatch = int((got != np.array(cpu)).sum())
    REPORT["errors"]["sampling cpu mismatches /2048"] = mismatch
    assert mismatch <= rows // 100


def test_sampling_large_vocab_stays_in_top_k_and_top_p(cf, stream):
    rng = np.random.default_rng(6)
    vocab, rows = 151936, 256
    base = (rng.standard_normal(vocab) * 3).astype(np.float32)
    logits = np.tile(base, (rows, 1))
    seeds = np.arange(rows, dtype=np.uint64)
    top40 = set(np.argsort(-base)[:40].tolist())
    got = _sample(cf, stream, logits, 1.5, 1.0, 40, seeds, 0)
    assert set(got.tolist()) <= top40 and len(set(got.tolist())) > 10
    nucleus = set(np.nonzero(_expected_probs(base, 0.8, 0, 0.5))[0].tolist())
    got = _sample(cf, stream, logits, 0.8, 0.5, 0, seeds, 1)
    assert set(got.tolist()) <= nucleus


# --- the whole forward pass ------------------------------------------------------------------

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
FORWARD_SHAPES = {  # head dims 64 and 128; GQA groups 2, 2, 4; biases; q/k norm; tied
    "llama": dict(hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=64, rope_scaling=LLAMA3),
    "qwen2": dict(hidden_size=256, intermediate_size=512, num_layers=2, num_heads=2,
                  num_kv_heads=1),
    "qwen3": dict(hidden_size=256, intermediate_size=512, num_layers=2, num_heads=8,
                  num_kv_heads=2, head_dim=128, tie_word_embeddings=True),
}
BLOCK, NUM_BLOCKS, MAX_TOKENS, MAX_SEQS = 16, 64, 128, 8
LOGITS_TOL = 2e-2


@pytest.fixture(scope="module")
def models(cf, tmp_path_factory):
    root = tmp_path_factory.mktemp("cuda_ckpt")
    out = {}
    for i, (arch, shape) in enumerate(FORWARD_SHAPES.items()):
        path = write_random_checkpoint(root / arch, architecture=arch, seed=20 + i, **shape)
        cfg = load_config(path)
        w = load_weights(path, cfg)  # bf16 checkpoint: the same bf16 values on both sides
        engine = cf.CudaForward(cfg, w, num_blocks=NUM_BLOCKS, block_size=BLOCK,
                                max_num_batched_tokens=MAX_TOKENS, max_num_seqs=MAX_SEQS)
        REPORT["env"][f"graph nodes {arch} bucket {MAX_TOKENS}"] = \
            engine.graph_node_types[MAX_TOKENS]
        out[arch] = (cfg, w, engine)
    yield out
    for _, _, engine in out.values():
        engine.close()


class Pair:
    """The CUDA engine and the NumPy reference fed the same batches, compared step by step."""

    def __init__(self, models, arch):
        self.arch = arch
        self.cfg, w, self.engine = models[arch]
        self.engine.fill_kv_cache(0xFF)  # NaN: any read of an unwritten slot shows
        self.ref = ReferenceModel(self.cfg, w, NUM_BLOCKS, BLOCK)
        self.ref.k_cache.fill(np.nan)
        self.ref.v_cache.fill(np.nan)
        self.errors = []

    def step(self, chunks, want=None, eager=False, tol=LOGITS_TOL):
        """chunks: [(token_ids, start_position, block_table)]; returns GPU logits."""
        batch = make_batch(chunks, want)
        logits, sampled = self.engine.run(batch, eager=eager)
        ref = self.ref.forward(batch)
        assert np.isfinite(logits).all()
        np.testing.assert_array_equal(sampled, np.argmax(logits, -1))  # greedy rows
        err = rel_err(logits, ref)
        self.errors.append(err)
        assert err < tol, f"{self.arch}: relative logits error {err:.3g}"
        for row in range(len(ref)):  # top-1 agrees except at near-ties
            ours = int(np.argmax(logits[row]))
            if ours != int(np.argmax(ref[row])):
                noise = np.sqrt(np.mean((logits[row] - ref[row]) ** 2))
                assert ref[row].max() - ref[row][ours] <= 5 * noise, f"{self.arch} row {row}"
        return logits

    def record(self, what: str) -> None:
        REPORT["errors"][f"forward {self.arch} {what} (max rel L2)"] = max(self.errors)


make_batch = ForwardBatch.of_chunks  # chunks: [(token_ids, start, block_table)]


def prompt(cfg, n, seed):
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, n).astype(np.int32)


ARCHS = list(FORWARD_SHAPES)


@pytest.mark.parametrize("arch", ARCHS)
def test_forward_one_shot_prefill(models, arch):
    pair = Pair(models, arch)
    table = np.random.default_rng(1).permutation(NUM_BLOCKS)[:7]
    ids = prompt(pair.cfg, 99, seed=2)
    graph = pair.step([(ids, 0, table)])
    eager, _ = pair.engine.run(make_batch([(ids, 0, table)]), eager=True)
    np.testing.assert_allclose(graph, eager, rtol=0, atol=1e-4 * np.abs(eager).max())
    pair.record("one-shot prefill")


@pytest.mark.parametrize("arch", ARCHS)
def test_forward_chunked_prefill_then_decode(models, arch):
    pair = Pair(models, arch)
    table = np.random.default_rng(3).permutation(NUM_BLOCKS)[:6]
    ids = list(prompt(pair.cfg, 70, seed=4))
    pos = 0
    for n in (1, 19, 33, 17):  # chunked prefill
        logits = pair.step([(np.array(ids[pos:pos + n]), pos, table)])
        pos += n
    for _ in range(8):  # decode: the GPU's greedy token fed back to both
        ids.append(int(np.argmax(logits[0])))
        logits = pair.step([(np.array(ids[pos:pos + 1]), pos, table)])
        pos += 1
    pair.record("chunked prefill + decode")


@pytest.mark.parametrize("arch", ARCHS)
def test_forward_prefill_on_the_wgmma_attention_kernel(cf, models, arch):
    """Prefill chunks past the decode-sized buckets with the wgmma attention kernel taking them
    (its default line, ATTENTION_WGMMA_MIN_BUCKET, is past these engines' buckets): a 99-token
    prompt, then its next 70 tokens over those keys beside another sequence's one-token prompt
    (the decode path, in the wgmma kernel's 8-warp CTAs), against the reference. An engine of
    its own, built so: its attention workspace is sized for its own choices (the shared one's,
    changed after it was built, was too small once fewer splits tied, and NaNs came back)."""
    cfg, w, shared = models[arch]
    if not shared.kernels.attention_wgmma_available:
        pytest.skip(f"no wgmma attention in this module (sm_{shared.kernels.arch}; "
                    "it needs sm_90a)")
    # one split, so that each CTA walks the keys' tiles through both stages
    engine = cf.CudaForward(cfg, w, num_blocks=NUM_BLOCKS, block_size=BLOCK,
                            max_num_batched_tokens=MAX_TOKENS, max_num_seqs=MAX_SEQS,
                            attention_wgmma_min_bucket=1, max_attention_splits=1)
    try:
        pair = Pair({arch: (cfg, w, engine)}, arch)
        assert engine.attention_wgmma(MAX_TOKENS) and not engine.attention_wgmma(64)
        prefill_beside_a_new_prompt(pair)
        pair.record("prefill on the wgmma attention kernel")
    finally:
        engine.close()


def prefill_beside_a_new_prompt(pair, eager=False) -> None:
    """A 99-token prompt, then its next 70 tokens over those keys beside another sequence's
    one-token prompt (the decode path), through pair's engine and reference (bucket 128)."""
    blocks = np.random.default_rng(5).permutation(NUM_BLOCKS)
    ids, other = prompt(pair.cfg, 169, seed=6), prompt(pair.cfg, 1, seed=7)
    pair.step([(ids[:99], 0, blocks[:11])], eager=eager)
    pair.step([(ids[99:], 99, blocks[:11]), (other, 0, blocks[11:12])], eager=eager)


@pytest.mark.parametrize("arch", ARCHS)
def test_forward_prefill_on_the_roomy_attention_kernel(cf, models, arch):
    """attention_roomy_max_bucket: the buckets up to it that run the large mma.sync tiles take
    the roomy kernel (two CTAs an SM at head dim 128: qwen2's and qwen3's), whose slots size the
    splits: prefill_beside_a_new_prompt against the reference."""
    pair = Pair(models, arch)
    pair.engine = cf.CudaForward(pair.cfg, models[arch][1], num_blocks=NUM_BLOCKS,
                                 block_size=BLOCK, max_num_batched_tokens=MAX_TOKENS,
                                 max_num_seqs=MAX_SEQS, attention_roomy_max_bucket=MAX_TOKENS)
    try:
        engine, k = pair.engine, pair.engine.kernels
        assert engine.attention_roomy(MAX_TOKENS) and not engine.attention_roomy(64)
        roomy = k.attention_slots(False, BLOCK, roomy=True)
        assert roomy <= k.attention_slots(False, BLOCK)
        if pair.cfg.head_dim == 128:
            assert roomy == 2 * k.sm_count
        engine.fill_kv_cache(0xFF)
        prefill_beside_a_new_prompt(pair)
        pair.record("prefill on the roomy attention kernel")
    finally:
        pair.engine.close()


@pytest.mark.parametrize("splitk_cluster,rowblock_cluster", [(1, 1), (2, 2), (4, 4), (2, 4)])
def test_forward_splitk_runs_the_residual_projections_of_17_to_32_rows(models, monkeypatch,
                                                                       splitk_cluster,
                                                                       rowblock_cluster):
    """A step of 17..32 rows runs its o and down projections on the split-K kernel and gate|up
    + SiLU on the row-block kernel (one of 16 rows or fewer on the skinny kernel, of 33 or more
    on cuBLAS), in clusters of the CTAs given (the default for wide models: 2 and 4), its two
    RMSNorm kernels a layer release the projection after them early, and its logits follow the
    reference's."""
    pair = Pair(models, "llama")
    k, layers = pair.engine.kernels, pair.cfg.num_layers
    monkeypatch.setattr(pair.engine, "splitk_cluster", splitk_cluster)
    monkeypatch.setattr(pair.engine, "rowblock_cluster", rowblock_cluster)
    calls, rowblock_calls, norm_releases = [], [], []
    clusters = {"split-K": set(), "row-block": set()}
    splitk, rowblock, rms_norm = k.splitk_add_linear, k.rowblock_silu_mul, k.rms_norm

    def norm_counted(*args, release_next=False, **kwargs):
        norm_releases.append(release_next)
        return rms_norm(*args, release_next=release_next, **kwargs)

    def counted(stream, x, w, out, rows, in_features, out_features, **kwargs):
        calls.append(rows)
        clusters["split-K"].add(kwargs.get("cluster", 1))
        return splitk(stream, x, w, out, rows, in_features, out_features, **kwargs)

    def rowblock_counted(stream, rows, *args, **kwargs):
        rowblock_calls.append(rows)
        clusters["row-block"].add(kwargs.get("cluster", 1))
        return rowblock(stream, rows, *args, **kwargs)

    monkeypatch.setattr(k, "splitk_add_linear", counted)
    monkeypatch.setattr(k, "rowblock_silu_mul", rowblock_counted)
    monkeypatch.setattr(k, "rms_norm", norm_counted)
    monkeypatch.setattr(k, "ROWBLOCK_MIN_FILL", 0)  # this model's 8 CTAs: the kernel anyway
    table = np.random.default_rng(6).permutation(NUM_BLOCKS)[:6]
    ids = prompt(pair.cfg, 62, seed=7)
    pos = 0
    for n, want in ((9, []), (20, [32] * 2 * layers), (33, [])):  # buckets 16, 32, 64
        calls.clear()
        rowblock_calls.clear()
        norm_releases.clear()
        pair.step([(ids[pos:pos + n], pos, table)], eager=True)  # ops() runs again: counted
        assert calls == want, f"{n} tokens"
        assert rowblock_calls == want[:layers], f"{n} tokens: gate|up + SiLU"
        if want:  # two a layer, then the final norm (before the LM head: released at its end)
            assert norm_releases == [True] * 2 * layers + [False], f"{n} tokens: norms"
        pos += n
    assert clusters == {"split-K": {splitk_cluster}, "row-block": {rowblock_cluster}}
    pair.record(f"split-K steps, clusters of {splitk_cluster} and {rowblock_cluster}")


@pytest.mark.parametrize("split", [True, False])
def test_forward_skinny_k_split(models, monkeypatch, split):
    """Decode-sized steps run their skinny projections of few row blocks (this model's qkv, o
    and down) with K split across clusters of two CTAs (by default: where the split grid fits
    one wave), or one CTA a row block (skinny_split_blocks 0); the SiLU-gated gate|up never
    splits. Both follow the reference."""
    pair = Pair(models, "llama")
    engine, k, cfg = pair.engine, pair.engine.kernels, pair.cfg
    if not split:
        monkeypatch.setattr(engine, "skinny_split_blocks", 0)
    splits = []

    def counted(fn):
        def launch(*args, k_splits=1, **kwargs):
            splits.append(k_splits)
            return fn(*args, k_splits=k_splits, **kwargs)
        return launch

    monkeypatch.setattr(k, "skinny_linear", counted(k.skinny_linear))
    monkeypatch.setattr(k, "skinny_qkv_rope", counted(k.skinny_qkv_rope))
    launch, split_launches = k.launch, []

    def launch_counted(name, grid, *args, **kwargs):
        if name.endswith("_k2"):
            split_launches.append(name)
        return launch(name, grid, *args, **kwargs)

    monkeypatch.setattr(k, "launch", launch_counted)
    table = np.random.default_rng(8).permutation(NUM_BLOCKS)[:4]
    ids = prompt(cfg, 21, seed=9)
    pos = 0
    for n, bucket in ((5, 8), (13, 16), (1, 1), (1, 1)):
        splits.clear()
        split_launches.clear()
        pair.step([(ids[pos:pos + n], pos, table)], eager=True)  # ops() runs again: counted
        lm_head = k.skinny_splits("linear", min(bucket, MAX_SEQS), cfg.hidden_size,
                                  cfg.vocab_size, engine.skinny_split_blocks) == 2
        assert len(splits) == 4 * cfg.num_layers + 1, f"{n} tokens"
        assert splits.count(2) == ((3 * cfg.num_layers + lm_head) if split else 0), f"{n} tokens"
        assert len(split_launches) == splits.count(2)  # the _k2 entry points ran
        pos += n
    pair.record(f"skinny projections, K split {split}")


@pytest.mark.parametrize("arch", ARCHS)
def test_forward_mixed_batch(models, arch):
    pair = Pair(models, arch)
    plans = [[37, 1, 1, 1], [20, 45, 0, 1], [2, 1, 3, 1], [0, 60, 1, 1], [1, 1, 1, 1]]
    seqs = [list(prompt(pair.cfg, sum(p), seed=10 + s)) for s, p in enumerate(plans)]
    pool = np.random.default_rng(5).permutation(NUM_BLOCKS)
    tables = [pool[12 * s:12 * s + -(-len(t) // BLOCK)] for s, t in enumerate(seqs)]
    done = [0] * len(seqs)
    for step in range(4):
        active = [s for s in range(len(seqs)) if plans[s][step]]
        chunks = [(np.array(seqs[s][done[s]:done[s] + plans[s][step]]), done[s], tables[s])
                  for s in active]
        # logits for every sequence except the one whose first chunk stops short of its prompt
        want = [i for i, s in enumerate(active) if not (s == 1 and step == 0)]
        pair.step(chunks, want)
        for s in active:
            done[s] += plans[s][step]
    pair.record("mixed batch")


def test_forward_graphs_cover_every_bucket(models):
    _, _, engine = models["llama"]
    assert sorted(engine.graph_execs) == engine.buckets == [1, 2, 4, 8, 16, 32, 64, 128]
    assert engine.bucket_for(1) == 1 and engine.bucket_for(19) == 32
    assert engine.bucket_for(128) == 128 and engine.bucket_for(129) is None
    ptrs = engine.device_pointers()
    assert len(set(ptrs.values())) == len(ptrs) and all(ptrs.values())
    assert all(engine.graph_exec_handles.values())
    for types_ in engine.graph_node_types.values():
        assert set(types_) == {"KERNEL"}


# The options two engines compared bit for bit take where a chunk has 17..32 tokens: no split-K
# residual adds, whose CTAs add into the residual stream in the order they finish, so that its
# low bits differ from run to run (CudaForward splitk_residual), the same engine's too. Seen: a
# 20-token chunk's logits all a little apart, now and then.
REPRODUCIBLE = dict(splitk_residual=False)


def assert_same_steps(cfg, a_fwd, b_fwd, seed: int, chunks=(33, 7)) -> None:
    """A prompt prefilled in the chunks given (default 33 and 7 tokens), then three decode steps
    fed the greedy token, through both forwards (caches zeroed first): bit-identical logits and
    samples. A chunk of 17..32 tokens: both forwards built with REPRODUCIBLE."""
    table = np.arange(-(-(sum(chunks) + 3) // BLOCK))
    ids = list(prompt(cfg, sum(chunks), seed=seed))
    for fwd in (a_fwd, b_fwd):
        fwd.fill_kv_cache(0)
    pos = 0
    for n in (*chunks, 1, 1, 1):
        batch = make_batch([(np.array(ids[pos:pos + n]), pos, table)])
        a, a_sampled = a_fwd.run(batch)
        b, b_sampled = b_fwd.run(batch)
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a_sampled, b_sampled)
        pos += n
        if pos == len(ids):
            ids.append(int(a_sampled[0]))


def test_forward_programmatic_launch_matches_plain_launches(cf, models):
    """The graphs are captured with programmatic dependent launch (every kernel may start before
    its predecessor ends and waits for it in-kernel): their edges say so, and prefill + decode
    through them gives bit-identical logits to the same kernels launched plainly."""
    cfg, w, engine = models["llama"]
    assert engine.kernels.programmatic_launch  # the lent H200 is sm_90
    plain = cf.CudaForward(cfg, w, num_blocks=NUM_BLOCKS, block_size=BLOCK,
                           max_num_batched_tokens=MAX_TOKENS, max_num_seqs=MAX_SEQS,
                           programmatic_launch=False)
    try:
        for bucket in engine.buckets:
            # at least attention after RoPE in every layer (edges into cuBLAS kernels stay
            # plain); the plain graphs have no programmatic edge
            edges = engine.graph_edge_types[bucket]
            assert edges.get("PROGRAMMATIC", 0) >= cfg.num_layers, f"bucket {bucket}: {edges}"
            assert "PROGRAMMATIC" not in plain.graph_edge_types[bucket]
        REPORT["env"]["graph edges llama bucket 1 / 128"] = \
            f"{engine.graph_edge_types[1]} / {engine.graph_edge_types[MAX_TOKENS]}"
        assert_same_steps(cfg, engine, plain, seed=8)
    finally:
        plain.close()


def test_qkv_release_early_is_the_default_where_layers_are_small(cf, models):
    """qkv_release_early's default line (ForwardKernels.QKV_RELEASE_EARLY_MAX_LAYER_BYTES) sits
    between Llama-3.2-1B's layers, bf16 or E4M3 (where the FP8 step gained), and Llama-3.1-8B's
    (where the FP8 step lost on two of three machines); the test checkpoints' engines take it."""
    from blink.gpu_engine.bench_decode import SHAPES
    from blink.gpu_engine.roofline import layer_projection_weights
    line = cf.ForwardKernels.QKV_RELEASE_EARLY_MAX_LAYER_BYTES
    assert 2 * layer_projection_weights(SHAPES["llama-3.2-1b"]) <= line  # bf16 (FP8: half)
    assert layer_projection_weights(SHAPES["llama-3.1-8b"]) > line  # E4M3 (bf16: twice)
    assert all(engine.qkv_release_early for _, _, engine in models.values())


def recorded_releases(engine, monkeypatch, name) -> list[bool]:
    """The release_next of each later launch of engine.kernels.<name>, in order."""
    releases, launch = [], getattr(engine.kernels, name)

    def recorded(*args, release_next=False, **kwargs):
        releases.append(release_next)
        return launch(*args, release_next=release_next, **kwargs)

    monkeypatch.setattr(engine.kernels, name, recorded)
    return releases


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_forward_qkv_release_early_is_bit_identical(cf, models, monkeypatch, quantization):
    """qkv_release_early (the skinny qkv projection lets attention launch at its start) changes
    when attention's CTAs launch, not what any kernel computes: chunks of 20 tokens (bf16: the
    skinny qkv kernel after the RMSNorm kernel; FP8 weights: the FP8 GEMMs), 13 and 7 (the
    RMSNorm folded in), then decode steps, give bit-identical logits and samples with it on and
    off, on bf16 and on FP8 weights (with the FP8 cache); every layer's skinny qkv kernel
    releases early with it on, none without."""
    cfg, w, _ = models["llama"]
    options = dict(num_blocks=NUM_BLOCKS, block_size=BLOCK, max_num_batched_tokens=MAX_TOKENS,
                   max_num_seqs=MAX_SEQS)
    if quantization:
        options.update(quantization=quantization, kv_cache_dtype=quantization)
    engines = [cf.CudaForward(cfg, w, **options, **REPRODUCIBLE, qkv_release_early=early)
               for early in (False, True)]
    try:
        assert_same_steps(cfg, *engines, seed=12, chunks=(20, 13, 7))
        for engine in engines:
            releases = recorded_releases(engine, monkeypatch, "skinny_qkv_rope")
            sizes = (20, 13, 1) if quantization is None else (13, 1)  # steps on the skinny qkv
            for n in sizes:  # ops() runs again when eager: counted
                engine.run(make_batch([(prompt(cfg, n, seed=13), 0, np.arange(2))]), eager=True)
            assert releases == [engine.qkv_release_early] * len(sizes) * cfg.num_layers
    finally:
        for engine in engines:
            engine.close()


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_forward_final_norm_release_is_bit_identical(cf, models, monkeypatch, quantization):
    """final_norm_release (the final RMSNorm lets the skinny LM head launch at its start)
    changes when the head's CTAs launch, not what any kernel computes: bit-identical logits
    and samples with it on and off, on bf16 and FP8 weights; the norm releases only where the
    skinny head follows it (a cuBLAS head does not wait for it), never with it off."""
    cfg, w, _ = models["llama"]
    options = dict(num_blocks=NUM_BLOCKS, block_size=BLOCK, max_num_batched_tokens=MAX_TOKENS,
                   max_num_seqs=48)  # logit rows past the skinny head's too
    if quantization:
        options.update(quantization=quantization, kv_cache_dtype=quantization)
    engines = [cf.CudaForward(cfg, w, **options, **REPRODUCIBLE, final_norm_release=on)
               for on in (False, True)]
    try:
        assert_same_steps(cfg, *engines, seed=14, chunks=(20, 13, 7))
        for engine in engines:
            k, events = engine.kernels, []
            for name in ("rms_norm", "skinny_linear"):
                def recorded(*args, name=name, launch=getattr(k, name), **kwargs):
                    events.append((name, kwargs.get("release_next", False)))
                    return launch(*args, **kwargs)
                monkeypatch.setattr(k, name, recorded)
            heads = set()
            for seqs in (1, 40):  # one logit row: the skinny head; 40: cuBLAS's
                events.clear()
                engine.run(make_batch([(prompt(cfg, 1, seed=15 + i), 0, np.array([i]))
                                       for i in range(seqs)]), eager=True)
                final = max(i for i, (name, _) in enumerate(events) if name == "rms_norm")
                skinny_head = final + 1 < len(events) and events[final + 1][0] == "skinny_linear"
                heads.add(skinny_head)
                assert events[final][1] is (engine.final_norm_release and skinny_head), events
            assert heads == {True, False}  # both heads were seen
    finally:
        for engine in engines:
            engine.close()


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_forward_rope_release_is_bit_identical(cf, models, monkeypatch, quantization):
    """rope_release (the RoPE + KV write kernel lets attention launch at its start) changes
    when attention's CTAs launch, not what any kernel computes: a 40-token chunk (past the
    fused buckets: RoPE a kernel of its own), then 13 and 7 and decode steps, bit-identical
    with it on and off, on bf16 and FP8 weights (with the FP8 cache); with it on every layer's
    RoPE kernel releases, with it off none."""
    cfg, w, _ = models["llama"]
    options = dict(num_blocks=NUM_BLOCKS, block_size=BLOCK, max_num_batched_tokens=MAX_TOKENS,
                   max_num_seqs=MAX_SEQS)
    if quantization:
        options.update(quantization=quantization, kv_cache_dtype=quantization)
    engines = [cf.CudaForward(cfg, w, **options, rope_release=on) for on in (False, True)]
    try:
        assert_same_steps(cfg, *engines, seed=16, chunks=(40, 13, 7))
        for engine in engines:
            releases = recorded_releases(engine, monkeypatch, "rope_kv_write")
            engine.run(make_batch([(prompt(cfg, 40, seed=17), 0, np.arange(3))]), eager=True)
            assert releases == [engine.rope_release] * cfg.num_layers
    finally:
        for engine in engines:
            engine.close()


def launched_entries(engine, monkeypatch, cfg, token_counts, infix, seed):
    """{n: the names containing infix of the entries that a step of n prompt tokens launches},
    for each n of token_counts (eager, so that ops() runs again and its launches are recorded)."""
    names, launch = [], engine.kernels.launch

    def recorded(name, *args, **kwargs):
        names.append(name)
        return launch(name, *args, **kwargs)

    monkeypatch.setattr(engine.kernels, "launch", recorded)
    launched = {}
    for n in token_counts:
        names.clear()
        engine.run(make_batch([(prompt(cfg, n, seed=seed), 0, np.arange(2))]), eager=True)
        launched[n] = [name for name in names if infix in name]
    return launched


def test_empty_kernels_keep_every_launch_and_do_none_of_its_work(cf, models, monkeypatch):
    """bench_decode --marginal's empty ops: inside empty_kernels each launch of a step's ops
    runs blink_pdl_noop on that launch's own grid, block and dynamic shared memory, and they
    write neither the logits nor the residual stream (which keep a poison that the same ops'
    real kernels overwrite, run next on the same batch)."""
    from blink.gpu_engine.bench_decode import empty_kernels
    cfg, _, engine = models["llama"]
    ids = prompt(cfg, 5, seed=31)
    engine.run(make_batch([(ids, 0, np.arange(2))]), eager=True)  # the batch arrays
    ops = engine.ops(engine.bucket_for(len(ids)))
    launches, launch = [], engine.kernels.launch

    def recorded(name, grid, block, args, stream, smem=0):
        launches.append((name, tuple(grid), tuple(block), smem))
        launch(name, grid, block, args, stream, smem)

    monkeypatch.setattr(engine.kernels, "launch", recorded)
    poison = {buf: np.full(buf.shape, 7.5, np.float32) for buf in (engine.logits, engine.x)}

    def step(*, empty: bool) -> list[bool]:
        """Which buffers kept the poison after the ops ran."""
        launches.clear()
        for buf, values in poison.items():
            buf.upload(values)
        with empty_kernels(engine.kernels) if empty else contextlib.nullcontext():
            for _, enqueue in ops:
                enqueue()
        cf.synchronize(engine.stream)
        return [np.array_equal(buf.download(), values) for buf, values in poison.items()]

    assert step(empty=True) == [True, True]
    empty = list(launches)
    # every kernel of the bucket's graph is a launch through ForwardKernels.launch (none that
    # empty_kernels would miss, a cuBLAS GEMM's say)
    assert len(empty) == engine.graph_node_types[engine.bucket_for(len(ids))]["KERNEL"]
    assert engine.kernels.launch == recorded  # what was there before, again
    assert step(empty=False) == [False, False]
    assert len(empty) == len(launches) > 4 * cfg.num_layers
    assert {name for name, *_ in empty} == {"blink_pdl_noop"}
    assert [shape for _, *shape in empty] == [shape for _, *shape in launches]


# Llama (qkv + RoPE fused), Qwen2 (with the qkv bias), Qwen3 (per-head q/k norms: the qkv
# projection on the norm-folding linear entry, RoPE a kernel)
@pytest.mark.parametrize("arch,kv_cache_dtype", [("llama", "bf16"), ("llama", "fp8"),
                                                 ("qwen2", "fp8"), ("qwen3", "bf16")])
def test_forward_fp8_x_f16_is_bit_identical(cf, models, monkeypatch, arch, kv_cache_dtype):
    """fp8_x_f16 (the kernels that write the residual stream's shadow, and SiLU * up, also write
    x's f16 form, which the next FP8 skinny kernel's MMAs take as it is) changes no sum: chunks
    of 7 tokens (the 8-token bucket: handed over), 13 (16: not) and 5, then decode steps, give
    bit-identical logits and samples with it on and off (FP8 weights, either cache). With it on,
    the embedding, each layer's qkv, o, gate|up and down projections, the final norm and the LM
    head run _xf16 entries in the buckets of up to 8 rows, none in larger ones; without, none."""
    cfg, w, _ = models[arch]
    options = dict(num_blocks=NUM_BLOCKS, block_size=BLOCK, max_num_batched_tokens=MAX_TOKENS,
                   max_num_seqs=MAX_SEQS, quantization="fp8", kv_cache_dtype=kv_cache_dtype)
    engines = [cf.CudaForward(cfg, w, **options, fp8_x_f16=on, fp8_x_sumsq=False)
               for on in (False, True)]
    try:
        assert_same_steps(cfg, *engines, seed=14, chunks=(7, 13, 5))
        for engine in engines:
            launched = launched_entries(engine, monkeypatch, cfg, (1, 7, 13), "_xf16", seed=15)
            for n, handed in launched.items():
                on = engine.fp8_x_f16 and n <= engine.kernels.SKINNY_X_F16_MAX_ROWS
                assert len(handed) == (4 * cfg.num_layers + 3 if on else 0), (n, handed)
    finally:
        for engine in engines:
            engine.close()
    with pytest.raises(ValueError, match="fp8_x_f16"):
        cf.CudaForward(cfg, w, num_blocks=NUM_BLOCKS, block_size=BLOCK, fp8_x_f16=True)


@pytest.mark.parametrize("arch,kv_cache_dtype", [("llama", "fp8"), ("qwen3", "bf16")])
def test_forward_fp8_x_sumsq(cf, models, monkeypatch, arch, kv_cache_dtype):
    """fp8_x_sumsq (x's sums of squares handed over in parts beside its f16 form, so the qkv and
    gate|up projections read no bf16 x) moves the logits by float rounding only (each RMSNorm
    scale summed in another order) against fp8_x_f16 alone: chunks of 7 tokens (handed over),
    13 (not) and 5, then decode steps, relative L2 under 1e-3 a step. The qkv, o, gate|up and
    down projections of every layer but the last down run _xf16sq entries in the buckets of up
    to 8 rows with it on, and in those of up to X_SUMSQ_DEFAULT_MAX_ROWS by default; it needs
    fp8_x_f16."""
    cfg, w, _ = models[arch]
    options = dict(num_blocks=NUM_BLOCKS, block_size=BLOCK, max_num_batched_tokens=MAX_TOKENS,
                   max_num_seqs=MAX_SEQS, quantization="fp8", kv_cache_dtype=kv_cache_dtype)
    engines = []
    try:
        for on in (False, True, None):  # (one at a time: a failed start closes those before it)
            engines.append(cf.CudaForward(cfg, w, **options, fp8_x_sumsq=on))
        plain, squares, default = engines
        table = np.arange(-(-(25 + 3) // BLOCK))
        ids = list(prompt(cfg, 25, seed=16))
        for fwd in (plain, squares):
            fwd.fill_kv_cache(0)
        pos, worst = 0, 0.0
        for n in (7, 13, 5, 1, 1, 1):
            batch = make_batch([(np.array(ids[pos:pos + n]), pos, table)])
            (a, a_sampled), (b, _) = plain.run(batch), squares.run(batch)
            worst = max(worst, rel_err(b, a))
            pos += n
            if pos == len(ids):
                ids.append(int(a_sampled[0]))
        assert worst < 1e-3, worst
        REPORT["errors"][f"fp8_x_sumsq logits {arch}"] = worst
        for engine, max_rows in ((squares, 8), (default, default.X_SUMSQ_DEFAULT_MAX_ROWS)):
            launched = launched_entries(engine, monkeypatch, cfg, (1, 2, 13), "_xf16sq", seed=17)
            for n, handed in launched.items():
                expected = 4 * cfg.num_layers - 1 if engine.bucket_for(n) <= max_rows else 0
                assert len(handed) == expected, (n, max_rows, handed)
    finally:
        for engine in engines:
            engine.close()
    with pytest.raises(ValueError, match="fp8_x_sumsq"):
        cf.CudaForward(cfg, w, **options, fp8_x_f16=False, fp8_x_sumsq=True)


def test_forward_decode_weight_copy_matches_row_major(cf, models):
    """By default the skinny kernels read a tiled copy of each layer's projections and of the
    LM head (decode_weight_copy); the same kernels on the row-major weights sum the same products
    in the same order, so prefill + decode give bit-identical logits either way. (This model's
    LM head is small enough for the skinny kernel row-major too; a large one goes to cuBLAS
    without the copy.)"""
    cfg, w, engine = models["llama"]
    assert all(set(lw.tiled) == {"wqkv", "wo", "wgu", "wdown"} for lw in engine.layers)
    assert engine.lm_head_tiled is not None
    assert engine.kernels.skinny_preferred(MAX_SEQS, cfg.hidden_size, cfg.vocab_size, False)
    shared = cf.CudaForward(cfg, w, num_blocks=NUM_BLOCKS, block_size=BLOCK,
                            max_num_batched_tokens=MAX_TOKENS, max_num_seqs=MAX_SEQS,
                            decode_weight_copy=False)
    try:
        assert all(not lw.tiled for lw in shared.layers) and shared.lm_head_tiled is None
        assert_same_steps(cfg, engine, shared, seed=10)
    finally:
        shared.close()


def test_forward_sized_for_the_sms_the_scheduler_leaves(cf, models):
    """The scheduler kernel's CTA holds an SM while the graphs it launched run: by default the
    forward's kernels are sized for the others (cuBLAS's SM count target, the attention grids),
    and holding_sms holds one as it does (what bench_decode and the GEMM tuner time beside).
    A graph run beside the held SM gives the logits it gives alone, and the SM is let go."""
    cfg, w, engine = models["llama"]
    k = engine.kernels
    assert (k.held_sms, k.sm_count) == (1, k.device_sm_count - 1)
    assert engine.blas.sm_count_target == k.sm_count
    batch = make_batch([(prompt(cfg, 40, seed=9), 0, np.arange(6))])
    engine.fill_kv_cache(0)
    alone, _ = engine.run(batch)
    with engine.holding_sms():
        beside, _ = engine.run(batch)
        with pytest.raises(RuntimeError, match="does not nest"):
            with engine.holding_sms():
                pass
    np.testing.assert_array_equal(alone, beside)
    again, _ = engine.run(batch)  # after the release: nothing left spinning in the way
    np.testing.assert_array_equal(alone, again)
    # the held SM's CTA takes what the scheduler kernel's takes, in the units the SM hands out
    # (registers 8 a thread, shared memory 128 bytes): the same kernels fit beside either
    from blink.gpu_engine import cuda_runtime as cr
    from blink.gpu_engine.cuda_engine import scheduler_cubin
    scheduler = cr.Module(scheduler_cubin())
    attr = cr.cu.CUfunction_attribute

    def footprint(fn):
        regs = cr.check(cr.cu.cuFuncGetAttribute(attr.CU_FUNC_ATTRIBUTE_NUM_REGS, fn))
        smem = cr.check(cr.cu.cuFuncGetAttribute(attr.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, fn))
        return -(-regs // 8), -(-smem // 128)
    held, running = footprint(k.fn["blink_hold_sm"]), footprint(scheduler.function("scheduler_run"))
    assert held == running, f"blink_hold_sm takes {held}, scheduler_run {running}"
    whole = cf.CudaForward(cfg, w, num_blocks=NUM_BLOCKS, block_size=BLOCK,
                           max_num_batched_tokens=MAX_TOKENS, max_num_seqs=MAX_SEQS,
                           capture=False, held_sms=0)  # host-launched graphs
    try:
        assert whole.kernels.sm_count == k.device_sm_count and whole.blas.sm_count_target == 0
        with whole.holding_sms():  # nothing to hold
            pass
    finally:
        whole.close()
    with pytest.raises(ValueError, match="held_sms"):
        cf.CudaForward(cfg, w, num_blocks=NUM_BLOCKS, block_size=BLOCK, capture=False,
                       held_sms=k.device_sm_count)


def test_kv_cache_too_large_is_one_line_and_frees_the_weights(cf, models, monkeypatch):
    """A KV cache the GPU has no room for after the weights (--num-kv-blocks too large) is a
    KvCacheTooLarge that says how many blocks fit, raised before any allocation fails, and
    the engine it stopped frees what it had taken (its weights among them): every device array
    it made, and, where no other test process shares the GPU, the GPU's free memory back (on
    4 xdist workers another worker's allocations in between failed that check once, H100,
    2026-12-06)."""
    import os

    from blink.gpu_engine.cuda_runtime import check
    from blink.gpu_engine.engine_layout import KvCacheTooLarge
    cfg, w, _ = models["llama"]
    made = []
    init = cf.DeviceArray.__init__

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)
    monkeypatch.setattr(cf.DeviceArray, "__init__", recording_init)
    free_before, total = check(cf.driver.cuMemGetInfo(), "cuMemGetInfo")
    block_bytes = 2 * cfg.num_layers * BLOCK * cfg.num_kv_heads * cfg.head_dim * 2
    # more than the whole GPU holds: one more than the free memory fitted once another worker
    # had freed some in between, and the cache took the GPU from the other three (H100,
    # 2026-12-06: this test did not raise, two others found 177 MiB free)
    too_many = total // block_bytes + 1
    with pytest.raises(KvCacheTooLarge, match=rf"^{too_many} KV blocks need \d+ MiB; \d+ MiB "
                       r"of GPU memory is free after the weights, room for \d+ blocks$"):
        cf.CudaForward(cfg, w, num_blocks=too_many, block_size=BLOCK,
                       max_num_batched_tokens=MAX_TOKENS, max_num_seqs=MAX_SEQS)
    assert made and not [a.shape for a in made if a.ptr]  # the weights among them
    if os.environ.get("PYTEST_XDIST_WORKER") is None:  # the GPU's memory is this process's
        free_after = check(cf.driver.cuMemGetInfo(), "cuMemGetInfo")[0]
        assert free_after >= free_before - (64 << 20), (free_before, free_after)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_forward_fused_norm_rope_matches_separate_kernels(cf, models, arch):
    """Decode buckets run RMSNorm inside the projections and RoPE + KV write inside the qkv
    projection (Qwen3: RMSNorm only); the same steps with those as kernels of their own
    (fuse_norm_rope=False) give the same logits up to bf16 rounding, with 3 (Qwen3: 2) kernels
    a layer fewer."""
    cfg, w, engine = models[arch]
    separate = cf.CudaForward(cfg, w, num_blocks=NUM_BLOCKS, block_size=BLOCK,
                              max_num_batched_tokens=MAX_TOKENS, max_num_seqs=MAX_SEQS,
                              fuse_norm_rope=False)
    try:
        for bucket in (1, 8, 16):  # 2 norms and RoPE (Qwen3: the 2 norms) a layer fewer
            fused = sum(engine.graph_node_types[bucket].values())
            assert sum(separate.graph_node_types[bucket].values()) - fused == \
                (2 if cfg.qk_norm else 3) * cfg.num_layers
        assert engine.graph_node_types[32] == separate.graph_node_types[32]  # not fused
        table = np.arange(6)
        ids = list(prompt(cfg, 40, seed=18))
        for fwd in (engine, separate):
            fwd.fill_kv_cache(0)
        pos, errors = 0, []
        for n in (5, 8, 13, 1, 1, 1):  # prefill chunks in decode buckets, then decode steps
            batch = make_batch([(np.array(ids[pos:pos + n]), pos, table)])
            a, a_sampled = engine.run(batch)
            b, _ = separate.run(batch)
            errors.append(rel_err(a, b))
            assert errors[-1] < LOGITS_TOL, f"step {len(errors)}: {errors}"
            pos += n
            if pos == len(ids):
                ids.append(int(a_sampled[0]))
        REPORT["errors"][f"forward {arch} fused vs separate norm/rope (max rel L2)"] = max(errors)
    finally:
        separate.close()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_forward_projection_chain_matches_skinny_kernels(cf, models, arch, quantization):
    """With projection_chain, one-token steps run each layer's o, gate|up and down projections
    as one persistent kernel: two kernels a layer fewer than the skinny kernels, whose sums it
    takes in the same order, so a prompt fed one token at a time and then decoded gives
    bit-identical logits and tokens to those kernels unsplit (skinny_split_blocks 0), and
    every layer's counters are zero after each step; bf16 and E4M3 weights."""
    cfg, w, _ = models[arch]
    make = functools.partial(cf.CudaForward, cfg, w, num_blocks=NUM_BLOCKS, block_size=BLOCK,
                             max_num_batched_tokens=MAX_TOKENS, max_num_seqs=MAX_SEQS,
                             skinny_split_blocks=0, quantization=quantization,
                             fp8_x_sumsq=False)  # (the chain squares x itself)
    chained, skinny = make(projection_chain=True), make(projection_chain=False)
    try:
        assert sum(skinny.graph_node_types[1].values()) - \
            sum(chained.graph_node_types[1].values()) == 2 * cfg.num_layers
        assert chained.graph_node_types[2] == skinny.graph_node_types[2]  # one token only
        table = np.arange(3)
        ids = list(prompt(cfg, 12, seed=23))
        for fwd in (chained, skinny):
            fwd.fill_kv_cache(0)
        for pos in range(20):  # 12 prompt tokens, then the greedy token fed back
            batch = make_batch([(np.array(ids[pos:pos + 1]), pos, table)])
            a, a_sampled = chained.run(batch)
            b, b_sampled = skinny.run(batch)
            np.testing.assert_array_equal(a, b)
            np.testing.assert_array_equal(a_sampled, b_sampled)
            assert not chained.chain_counters.download().any()
            if pos + 1 == len(ids):
                ids.append(int(a_sampled[0]))
    finally:
        chained.close()
        skinny.close()


def test_forward_sampling_in_graph(models):
    """Non-greedy rows through the graph: sampled ids are in each row's top-k set and follow the
    same (seed, step) -> token rule when the same logits are sampled again."""
    cfg, _, engine = models["qwen2"]
    engine.fill_kv_cache(0)
    table = np.arange(8)
    ids = prompt(cfg, 40, seed=9)
    chunks = [(ids[:10], 0, table[:1]), (ids[10:25], 0, table[1:2]), (ids[25:], 0, table[2:3])]
    batch = make_batch(chunks)
    a_logits, a = engine.run(batch, temperature=[1.0, 0.8, 0.5], top_k=[5, 0, 3],
                             top_p=[1.0, 0.9, 1.0], seed=[1, 2, 3], step=[4, 5, 6])
    b_logits, b = engine.run(batch, temperature=[1.0, 0.8, 0.5], top_k=[5, 0, 3],
                             top_p=[1.0, 0.9, 1.0], seed=[1, 2, 3], step=[4, 5, 6])
    np.testing.assert_array_equal(a_logits, b_logits)
    np.testing.assert_array_equal(a, b)
    for row, kk in ((0, 5), (2, 3)):
        assert a[row] in set(np.argsort(-a_logits[row])[:kk].tolist())


# --- environment facts and kernel timings (recorded, not asserted) ---------------------------

def test_environment_facts(cf, models):
    from cuda.bindings import driver
    import cuda.bindings
    env = REPORT["env"]
    env["cuda_bindings"] = cuda.bindings.__version__
    env["driver_version"] = cf.check(driver.cuDriverGetVersion())
    name = cf.check(driver.cuDeviceGetName(128, cf.check(driver.cuDeviceGet(0))))
    env["device"] = name.split(b"\0")[0].decode()
    env["kernel_arch"] = kernels(cf).arch
    env["attention_smem_bytes_d128"] = kernels(cf, 128).attention_smem
    try:
        import pycuda
        import pycuda.autoprimaryctx  # noqa: F401 - the primary context we share
        env["pycuda"] = pycuda.VERSION_TEXT
    except Exception as e:  # noqa: BLE001 - recorded as a fact
        env["pycuda"] = f"not importable: {e}"


def _time_ms(cf, stream, fn, reps=20, capture=True) -> float:
    """Device time per call of fn (which enqueues on `stream`): with capture, `reps` calls are
    captured into one graph and replayed, so host launch overhead stays out of the number."""
    from cuda.bindings import driver
    start, end = cf.check(driver.cuEventCreate(0)), cf.check(driver.cuEventCreate(0))
    fn()
    cf.synchronize(stream)
    launch, per_launch = fn, 1
    if capture:
        mode = driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        cf.check(driver.cuStreamBeginCapture(stream, mode))
        for _ in range(reps):
            fn()
        exe = cf.check(driver.cuGraphInstantiate(cf.check(driver.cuStreamEndCapture(stream)), 0))
        launch, per_launch = (lambda: cf.check(driver.cuGraphLaunch(exe, stream))), reps
        launch()
        cf.synchronize(stream)
    launches = 5 if capture else reps
    cf.check(driver.cuEventRecord(start, stream))
    for _ in range(launches):
        launch()
    cf.check(driver.cuEventRecord(end, stream))
    cf.check(driver.cuEventSynchronize(end))
    return cf.check(driver.cuEventElapsedTime(start, end)) / (launches * per_launch)


class _ClockWarmer:
    """Sustained bf16 GEMMs before each measurement, so that the SM clock has left its idle
    state (seen at 345 MHz on these machines) and the timings compare at full clock."""

    def __init__(self, cf, stream, n=8192):
        from blink.gpu_engine.cublas import Cublas
        self.cf, self.stream, self.n = cf, stream, n
        self.blas = Cublas()
        self.blas.set_stream(int(stream))
        self.workspace = cf.DeviceArray(32 << 20, np.uint8)
        self.blas.set_workspace(self.workspace.ptr, 32 << 20)
        rng = np.random.default_rng(0)
        self.a = dev(cf, float32_to_bf16_bits(rng.standard_normal((n, n)).astype(np.float32)))
        self.out = cf.DeviceArray((n, n), np.uint16)

    def gemm(self):  # ~1.4 ms at full clock; enqueue only (capturable)
        self.blas.linear(self.a.ptr, self.a.ptr, self.out.ptr, self.n, self.n, self.n)

    def __call__(self, gemms=40):
        for _ in range(gemms):
            self.gemm()
        self.cf.synchronize(self.stream)


def test_kernel_timings(cf, stream, models):
    """Llama-3.1-8B attention shapes (32 q heads, 8 kv heads, D=128, block 16), sampling over a
    128256 vocab, and the tiny models' whole graphs; microseconds per launch, each measured
    right after ~50 ms of GEMMs (clock warm-up)."""
    from cuda.bindings import driver
    k, t = kernels(cf, 128), REPORT.setdefault("timings_us", {})
    warm = _ClockWarmer(cf, stream)
    warm()
    t["gemm 8192^3 bf16 (clock check)"] = 1000 * _time_ms(cf, stream, warm.gemm, reps=10)
    nh, nkv, D, bs, ctx = 32, 8, 128, 16, 1024
    rng = np.random.default_rng(0)
    blocks = 64 * ctx // bs + 64
    kc = dev(cf, float32_to_bf16_bits(rng.standard_normal((blocks, bs, nkv, D)) * 0.5))
    vc = dev(cf, float32_to_bf16_bits(rng.standard_normal((blocks, bs, nkv, D)) * 0.5))
    q = dev(cf, float32_to_bf16_bits(rng.standard_normal((512, nh, D))))
    out = dev(cf, np.zeros((512, nh, D), np.uint16))
    part_out = dev(cf, np.zeros(512 * nh * 64 * D, np.float32))
    part_stats = dev(cf, np.zeros(512 * nh * 64 * 2, np.float32))
    sems = dev(cf, np.zeros(512 * nkv, np.uint32))
    for label, seqs, rows, splits, variant in (
            ("decode b1 ctx1024", [(ctx - 1, 1)], 1, 1, "small"),
            ("decode b1 ctx1024", [(ctx - 1, 1)], 1, 64, "small"),
            ("decode b1 ctx1024", [(ctx - 1, 1)], 1, 64, "small_wide"),
            ("decode b32 ctx1024", [(ctx - 1, 1)] * 32, 32, 1, "small"),
            ("decode b32 ctx1024", [(ctx - 1, 1)] * 32, 32, 3, "small"),
            ("decode b64 ctx1024", [(ctx - 1, 1)] * 64, 64, 1, "small"),
            ("decode b64 ctx1024", [(ctx - 1, 1)] * 64, 64, 2, "small"),
            ("prefill 64 after 960", [(960, 64)], 64, 3, "small"),
            ("prefill 64 after 960", [(960, 64)], 64, 1, ""),
            ("prefill 512 from 0", [(0, 512)], 512, 1, ""),
            ("prefill 512 from 0", [(0, 512)], 512, 1, "wgmma"),
            ("prefill 512 after 512", [(512, 512)], 512, 1, ""),
            ("prefill 512 after 512", [(512, 512)], 512, 1, "wgmma")):
        if variant == "wgmma" and not k.attention_wgmma_available:
            continue  # (sm_90a only)
        pb = PagedBatch(seqs, bs, rng)
        pb.tables = np.arange(pb.tables.size, dtype=np.int32).reshape(pb.tables.shape) % blocks
        d = [dev(cf, a) for a in (pb.positions, pb.token_seq, pb.tables)]
        dd = desc(cf, pb.num_tokens, len(seqs))
        warm()
        t[f"attention {label} splits={splits} {variant or 'large'}"] = 1000 * _time_ms(
            cf, stream, lambda: k.attention(
                stream, rows, dd.ptr, d[0].ptr, d[1].ptr, d[2].ptr, pb.max_blocks, q.ptr, kc.ptr,
                vc.ptr, bs, nh, nkv, D ** -0.5, out.ptr, splits, part_out.ptr, part_stats.ptr,
                sems.ptr, **_attention_flags(variant)))
    vocab, rows = 128256, 64
    logits = dev(cf, (rng.standard_normal((rows, vocab)) * 3).astype(np.float32))
    for label, (temp, top_p, top_k) in (("greedy", (0.0, 1.0, 0)), ("T=1", (1.0, 1.0, 0)),
                                        ("T=0.7 top_p=0.9", (0.7, 0.9, 0)),
                                        ("T=0.7 top_k=50 top_p=0.9", (0.7, 0.9, 50))):
        params = [dev(cf, np.full(rows, v, dt)) for v, dt in (
            (temp, np.float32), (top_p, np.float32), (top_k, np.int32), (1, np.uint64),
            (0, np.uint32))]
        sampled = dev(cf, np.zeros(rows, np.int32))
        dd = desc(cf, rows, rows, rows)
        warm()
        t[f"sample 64 rows V=128256 {label}"] = 1000 * _time_ms(cf, stream, lambda: k.sample(
            stream, rows, dd.ptr, logits.ptr, vocab, *[p.ptr for p in params], sampled.ptr))
    for arch, (cfg, _, engine) in models.items():
        for bucket in (1, 128):
            # a bucket's graph computes the batch in device memory, which must fit the bucket
            # (another test's batch may not): one of that many tokens, written by run()
            engine.run(make_batch([(prompt(cfg, bucket, seed=bucket), 0, np.arange(8))]))
            exe = engine.graph_execs[bucket]
            warm()
            t[f"graph {arch} tiny bucket {bucket}"] = 1000 * _time_ms(
                cf, engine.stream, lambda: cf.check(driver.cuGraphLaunch(exe, engine.stream)),
                capture=False)
    warm.blas.close()
