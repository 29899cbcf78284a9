"""FP8 on the GPU (--quantization fp8, --kv-cache-dtype fp8): the quantizers and cuBLASLt's FP8
GEMM against NumPy (gpu_engine/fp8.py: bit for bit where the kernel's arithmetic is IEEE), the
whole forward pass against the NumPy reference's FP8 emulation on the same codes and scales,
and the accuracy gate: teacher-forced logits of the FP8 engine against the bf16 engine and
transformers over 2,064 positions, greedy streams that may differ only at near-ties on that
random checkpoint, and exact ones on a checkpoint whose greedy choices are decisive
(tests/periodic_model.py).

The FP8 skinny kernels, the E4M3 KV writers and attention on an E4M3 cache are tested beside
their bf16 forms in test_cuda_forward.py. Needs an NVIDIA GPU with FP8 (compute capability 9.0),
cuda-python and nvcc; skipped otherwise.
"""
from __future__ import annotations

import numpy as np
import pytest
from gpu import free_device_arrays_after_each_test, requires_gpu  # noqa: F401 (autouse)
from test_cuda_forward import (BLOCK, FORWARD_SHAPES, LOGITS_TOL, MAX_SEQS, MAX_TOKENS,
                               NUM_BLOCKS, REPORT, Pair, _blas, bf16_to_f32, cf, dev, desc,
                               kernels, make_batch, prompt, rb, rel_err, stream)

from blink.gpu_engine import fp8
from blink.gpu_engine.checkpoint import load_config, load_weights
from blink.gpu_engine.demo_model import float32_to_bf16_bits, write_random_checkpoint
from blink.gpu_engine.reference_model import ReferenceModel

pytestmark = [pytest.mark.gpu, requires_gpu()]
_FIXTURES = (cf, stream)  # (imported fixtures, used by name)

# FP8 against its emulation: the same codes and scales on both sides; what is left is the
# GPU's bf16 activations (qkv, attention's output, gate and up are stored in bf16, the
# emulation keeps float32), and each FP8 quantization of a prefill-sized step's activations
# turns such a difference into a whole E4M3 step on the elements it moves across a rounding
# boundary. Measured on the H200: 4.1-4.2% (llama, qwen2) and 9.3% (qwen3) after a 99-token
# prefill; a wrong scale or layout is off by its whole size.
FP8_LOGITS_TOL = 0.12


# --- quantizers ---------------------------------------------------------------------------------

@pytest.mark.parametrize("rows,k_in", [(1, 96), (7, 4096), (300, 14336)])
def test_quantize_rows_is_numpys_bit_for_bit(cf, stream, rows, k_in):
    """Codes and scales of every live row as fp8.quantize_rows gives them (a zero row, rows of
    very different sizes, values that saturate nowhere but at each row's largest); rows past
    the live count untouched."""
    k = kernels(cf)
    rng = np.random.default_rng(rows)
    cap = rows + 3
    x = rb(rng.standard_normal((cap, k_in)) * rng.uniform(1e-3, 1e3, (cap, 1)))
    x[min(2, rows - 1)] = 0
    live = max(1, rows - 1)
    dx = dev(cf, float32_to_bf16_bits(x))
    q = dev(cf, np.zeros((cap, k_in), np.uint8), poison=True)
    scale = dev(cf, np.zeros(cap, np.float32), poison=True)
    k.quantize_rows(stream, cap, desc(cf, live).ptr, dx.ptr, k_in, q.ptr, k_in, scale.ptr, k_in)
    cf.synchronize(stream)
    codes, scales = fp8.quantize_rows(x[:live])
    np.testing.assert_array_equal(q.download()[:live], codes)
    np.testing.assert_array_equal(scale.download()[:live], scales)
    assert (q.download()[live:] == 0xFF).all()
    assert (scale.download()[live:].view(np.uint32) == 0xFFFFFFFF).all()


@pytest.mark.parametrize("tokens", [1, 19, 99])
@pytest.mark.parametrize("bias", [False, True])
def test_rms_norm_fp8(cf, stream, tokens, bias):
    """RMSNorm (its weight applied, bias added into x first) as codes with a scale a row:
    against float64 within E4M3's rounding, each row's scale its largest value / 448."""
    k = kernels(cf)
    H, eps = 512, 1e-5
    rng = np.random.default_rng(tokens)
    x = (rng.standard_normal((128, H)) * 3).astype(np.float32)
    weight = rb(1 + 0.2 * rng.standard_normal(H))
    b = rb(rng.standard_normal(H)) if bias else None
    dx = dev(cf, x)
    q = dev(cf, np.zeros((128, H), np.uint8), poison=True)
    scale = dev(cf, np.zeros(128, np.float32), poison=True)
    k.rms_norm_fp8(stream, 128, desc(cf, tokens).ptr, dx.ptr, dev(cf, float32_to_bf16_bits(
        weight)).ptr, q.ptr, scale.ptr, H, eps, bias=dev(cf, float32_to_bf16_bits(b)).ptr
        if bias else 0)
    cf.synchronize(stream)
    xb = x[:tokens].astype(np.float64) + (b if bias else 0)
    ref = weight * xb / np.sqrt((xb * xb).mean(1, keepdims=True) + eps)
    got = fp8.dequantize_rows(q.download()[:tokens], scale.download()[:tokens])
    assert rel_err(got, ref) < 3e-2
    np.testing.assert_allclose(scale.download()[:tokens], np.abs(ref).max(1) / 448, rtol=1e-5)
    assert (q.download()[tokens:] == 0xFF).all()
    if bias:  # added into the residual stream in place
        np.testing.assert_allclose(dx.download()[:tokens], xb, rtol=1e-6)


@pytest.mark.parametrize("tokens", [1, 19, 99])
def test_silu_mul_fp8(cf, stream, tokens):
    k = kernels(cf)
    inter = 1024
    rng = np.random.default_rng(tokens + 5)
    gate_up = rb(rng.standard_normal((128, 2 * inter)) * 2)
    q = dev(cf, np.zeros((128, inter), np.uint8), poison=True)
    scale = dev(cf, np.zeros(128, np.float32), poison=True)
    k.silu_mul_fp8(stream, 128, desc(cf, tokens).ptr, dev(cf, float32_to_bf16_bits(gate_up)).ptr,
                   q.ptr, scale.ptr, inter)
    cf.synchronize(stream)
    pairs = gate_up[:tokens].astype(np.float64).reshape(tokens, inter // 16, 2, 16)
    gate, up = pairs[:, :, 0].reshape(tokens, inter), pairs[:, :, 1].reshape(tokens, inter)
    ref = gate / (1 + np.exp(-gate)) * up
    got = fp8.dequantize_rows(q.download()[:tokens], scale.download()[:tokens])
    assert rel_err(got, ref) < 3e-2
    np.testing.assert_allclose(scale.download()[:tokens], np.abs(ref).max(1) / 448, rtol=1e-5)
    assert (q.download()[tokens:] == 0xFF).all()


# --- cuBLASLt's FP8 GEMM ----------------------------------------------------------------------

@pytest.mark.parametrize("fast_accum", [False, True], ids=["promoted", "fast-accum"])
@pytest.mark.parametrize("rows", [16, 32, 160])
def test_cublas_linear_fp8(cf, stream, rows, fast_accum):
    """E4M3 x and w with a scale per token row and per weight row (outer-vector scaling): bf16
    out and fp32 added into the residual, against float64 on the codes' values; two calls with
    their own scales captured into one graph (a scale pointer is each call's), and every
    candidate algorithm the tuner may pick (split-K variants too, and with fp32 outputs); with
    cuBLASLt's periodic promotion to fp32 and without it (fast_accum, the engine's default)."""
    from blink.gpu_engine import cuda_runtime as cr
    from blink.gpu_engine.cublas import R_16BF, R_32F
    rng = np.random.default_rng(rows)
    k_in, n_out = 1024, 384
    x_codes, x_scale = fp8.quantize_rows(rng.standard_normal((rows, k_in)) * 4)
    blas, _ws = _blas(cf, stream)
    blas.fp8_fast_accum = fast_accum
    dx, dxs = dev(cf, x_codes), dev(cf, x_scale)
    resid = rng.standard_normal((rows, n_out)).astype(np.float32)
    layers = []
    for seed in range(2):
        w = np.random.default_rng(seed).standard_normal((n_out, k_in)) * k_in ** -0.5 * (seed + 1)
        codes, scale = fp8.quantize_rows(w)
        ref = fp8.dequantize_rows(x_codes, x_scale).astype(np.float64) @ \
            fp8.dequantize_rows(codes, scale).astype(np.float64).T
        layers.append((dev(cf, codes), dev(cf, scale), ref,
                       dev(cf, np.zeros((rows, n_out), np.uint16), poison=True), dev(cf, resid)))

    def calls():
        for dw, dws, _, out16, out32 in layers:
            blas.linear_fp8(dx.ptr, dxs.ptr, dw.ptr, dws.ptr, out16.ptr, rows, k_in, n_out)
            blas.linear_fp8(dx.ptr, dxs.ptr, dw.ptr, dws.ptr, out32.ptr, rows, k_in, n_out,
                            R_32F, accumulate=True)
    calls()  # first-call set-up outside the capture
    for *_, out16, out32 in layers:
        out16.fill_bytes(0xFF)
        out32.upload(resid)
    exe = cr.capture_device_graph(stream, lambda _: calls())
    cr.check(cr.cu.cuGraphLaunch(exe, stream))
    cf.synchronize(stream)
    errors = []
    for _, _, ref, out16, out32 in layers:
        assert rel_err(bf16_to_f32(out16.download()), ref) < 1e-2
        # Hopper's FP8 tensor cores sum in less than fp32 between cuBLAS's promotions:
        # measured 1.2e-4 (bf16 GEMMs: within 1e-5); without the promotions, over all of K,
        # 5.3e-4 to 5.5e-4
        errors.append(rel_err(out32.download(), ref + resid))
        assert errors[-1] < (2e-3 if fast_accum else 1e-3)
    REPORT["errors"][f"cublas fp8 {rows} rows, {'fast' if fast_accum else 'promoted'} "
                     f"accumulation (rel err, fp32 out)"] = float(max(errors))
    print(f"cublas fp8 {rows} rows, fast_accum={fast_accum}: fp32 out rel err {max(errors):.2e}")
    if fast_accum:  # the mode took effect: the promoted GEMM's sums differ in their low bits
        dw, dws, _, _, out32 = layers[0]
        fast = out32.download()
        blas.fp8_fast_accum = False
        out32.upload(resid)
        blas.linear_fp8(dx.ptr, dxs.ptr, dw.ptr, dws.ptr, out32.ptr, rows, k_in, n_out, R_32F,
                        accumulate=True)
        cf.synchronize(stream)
        assert not np.array_equal(out32.download(), fast)
        blas.fp8_fast_accum = True
    dw, dws, ref, out16, out32 = layers[1]
    blas.split_k = True  # the heuristic's candidates and their split-K variants
    for algo in blas.lt_candidates(blas.fp8_shape(rows, k_in, n_out, R_16BF, False)):
        out16.fill_bytes(0xFF)
        blas.linear_fp8(dx.ptr, dxs.ptr, dw.ptr, dws.ptr, out16.ptr, rows, k_in, n_out,
                        algo=algo)
        cf.synchronize(stream)
        assert rel_err(bf16_to_f32(out16.download()), ref) < 1e-2, blas.lt_describe(algo)
    for algo in blas.lt_candidates(blas.fp8_shape(rows, k_in, n_out, R_32F, True)):
        out32.upload(resid)
        blas.linear_fp8(dx.ptr, dxs.ptr, dw.ptr, dws.ptr, out32.ptr, rows, k_in, n_out, R_32F,
                        accumulate=True, algo=algo)
        cf.synchronize(stream)
        assert rel_err(out32.download(), ref + resid) < (2e-3 if fast_accum else 1e-3), \
            blas.lt_describe(algo)
    blas.close()


# --- the forward pass against the reference's FP8 emulation -----------------------------------

# the llama model's checkpoint stored as FP8 with one scale a tensor, which the engine serves
# as stored (the checkpoint's codes uploaded, weight_layout.stored_fp8), not quantized again
STORED_FP8 = "llama, FP8 checkpoint with a scale a tensor"
# three layers, some projections kept in bf16 (test_fp8.KEPT_WIDE: q|k|v, o and down of layer
# 0, gate|up of layer 1, down of layer 2), so that every kind of neighbour an FP8 skinny kernel
# can have, FP8 or bf16, is in the step
MIXED_FP8 = "llama, FP8 checkpoint keeping some projections in bf16"


@pytest.fixture(scope="module")
def fp8_models(cf, tmp_path_factory):
    """Per architecture: (config, bf16 weights, the FP8 engine with FP8 weights and an E4M3
    cache), the checkpoints test_cuda_forward's models use; and STORED_FP8's and MIXED_FP8's."""
    from test_fp8 import KEPT_WIDE, PROJECTIONS, fp8_checkpoint

    root = tmp_path_factory.mktemp("fp8_ckpt")
    paths = {arch: write_random_checkpoint(root / arch, architecture=arch, seed=20 + i, **shape)
             for i, (arch, shape) in enumerate(FORWARD_SHAPES.items())}
    paths[STORED_FP8] = root / "llama-fp8-tensor"
    fp8_checkpoint(paths["llama"], paths[STORED_FP8], "tensor")
    paths[MIXED_FP8] = root / "llama-fp8-mixed"
    three = write_random_checkpoint(root / "llama-3", architecture="llama", seed=23,
                                    **{**FORWARD_SHAPES["llama"], "num_layers": len(KEPT_WIDE)})
    fp8_checkpoint(three, paths[MIXED_FP8], "row",
                   keep=[f"model.layers.{i}.{p}" for i, wide in enumerate(KEPT_WIDE)
                         for p in PROJECTIONS if p.split(".")[1] in wide])
    out = {}
    for arch, path in paths.items():
        cfg = load_config(path)
        w = load_weights(path, cfg)
        assert bool(w.layers[0].fp8_codes) == (arch in (STORED_FP8, MIXED_FP8))
        engine = cf.CudaForward(cfg, w, num_blocks=NUM_BLOCKS, block_size=BLOCK,
                                max_num_batched_tokens=MAX_TOKENS, max_num_seqs=MAX_SEQS,
                                quantization="fp8", kv_cache_dtype="fp8")
        out[arch] = (cfg, w, engine)
    yield out
    for _, _, engine in out.values():
        engine.close()


class Fp8Pair(Pair):
    """Pair's step-by-step comparison for the FP8 engine, against the reference on the same
    FP8 weights (fp8.fp8_weights) and E4M3 cache scales (the engine's calibrated ones), the
    FP8 GEMMs' input rounding emulated in the steps that run them (buckets past the skinny
    kernels'), each step's logits within `tol`."""

    tol = FP8_LOGITS_TOL

    def __init__(self, models, arch):
        self.arch = arch
        self.cfg, w, self.engine = models[arch]
        self.engine.fill_kv_cache(0xFF)  # NaN codes: a read of an unwritten slot shows
        scales = self.engine.kv_scales.download() if self.engine.kv_fp8 else None
        self.ref = ReferenceModel(self.cfg, fp8.fp8_weights(w, self.engine.lm_head_fp8),
                                  self.engine.num_blocks, BLOCK, kv_scales=scales)
        self.ref.k_cache.fill(np.nan)
        self.ref.v_cache.fill(np.nan)
        self.errors = []

    def step(self, chunks, want=None, eager=False):
        tokens = sum(len(t) for t, _, _ in chunks)
        bucket, skinny_rows = self.engine.bucket_for(tokens), \
            self.engine.kernels.SKINNY_FP8_MAX_ROWS
        self.ref.fp8_activations = bucket > skinny_rows
        # an FP8 LM head of more than 16 logit rows: the FP8 GEMM on the rows quantized
        self.ref.fp8_head_input = (self.engine.lm_head_fp8
                                   and min(bucket, self.engine.max_num_seqs) > skinny_rows)
        return super().step(chunks, want, eager, tol=self.tol)


ARCHS = list(FORWARD_SHAPES)


@pytest.mark.parametrize("arch", [*ARCHS, STORED_FP8, MIXED_FP8])
def test_fp8_forward_prefill_chunks_and_decode(fp8_models, arch):
    """A 99-token prefill (FP8 GEMMs), chunked prefill (both paths) and decode steps (the FP8
    skinny kernels) of several sequences, the GPU's greedy token fed back: every step's logits
    within FP8_LOGITS_TOL of the emulation, top-1 equal except at near-ties. STORED_FP8: the
    emulation's weights are the checkpoint's values (fp8.fp8_weights keeps them), so the GPU
    must hold its codes and scales, not a second rounding of them. MIXED_FP8: the projections
    kept in bf16 run bf16 kernels on bf16 weights and inputs beside the FP8 ones, x's f16 form
    handed over only between FP8 ones (a rounding to E4M3 too many or too few, or an f16 form
    read where none was written, is off by far more than the tolerance)."""
    pair = Fp8Pair(fp8_models, arch)
    pool = np.random.default_rng(1).permutation(NUM_BLOCKS)
    seqs = [list(prompt(pair.cfg, 99, seed=2)), list(prompt(pair.cfg, 70, seed=4))]
    tables = [pool[:8], pool[8:16]]
    logits = pair.step([(np.array(seqs[0]), 0, tables[0])])
    seqs[0].append(int(np.argmax(logits[0])))
    pos = [99, 0]
    for n in (1, 19, 33, 17):  # chunked prefill of the second
        logits = pair.step([(np.array(seqs[1][pos[1]:pos[1] + n]), pos[1], tables[1])])
        pos[1] += n
    seqs[1].append(int(np.argmax(logits[0])))
    for _ in range(8):  # both decode, their greedy tokens fed back
        logits = pair.step([(np.array(s[p:p + 1]), p, t)
                            for s, p, t in zip(seqs, pos, tables)])
        for s, row in zip(seqs, logits):
            s.append(int(np.argmax(row)))
        pos = [p + 1 for p in pos]
    pair.record("fp8 prefill, chunks, decode")


def test_fp8_checkpoint_codes_are_uploaded_as_stored(fp8_models):
    """STORED_FP8's engine holds the checkpoint's codes and scales, fused in its layout
    (weight_layout.stored_fp8, which the CPU tests check against the CPU engine's weights),
    bit for bit: the forward test's tolerance would not see a second rounding."""
    from blink.gpu_engine.weight_layout import rope_pair_order, stored_fp8

    cfg, w, engine = fp8_models[STORED_FP8]
    order = rope_pair_order(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    for lw, layer in zip(w.layers, engine.layers):
        fused = stored_fp8(lw, order)
        assert sorted(fused) == ["wdown", "wgu", "wo", "wqkv"]
        for name, (codes, scales) in fused.items():
            np.testing.assert_array_equal(getattr(layer, name).download(), codes, name)
            np.testing.assert_array_equal(layer.scales[name].download(), scales, name)


def test_fp8_checkpoint_s_bf16_projections_are_uploaded_as_stored(fp8_models):
    """MIXED_FP8's engine serves the fused projections whose every part the checkpoint keeps
    in bf16 (weight_layout.served_bf16) as bf16 weights with no scales, bit for bit the stored
    values fused as on bf16 weights (q|k|v in the RoPE pair order times the input RMSNorm's
    weight, gate|up interleaved times the post-attention one's: the forward test's tolerance
    would not see a weight folded twice or not at all), and the others as the checkpoint's
    codes and row scales."""
    from test_fp8 import KEPT_WIDE

    from blink.gpu_engine.weight_layout import (interleave_gate_up, rope_pair_order,
                                                served_bf16, stored_fp8)

    cfg, w, engine = fp8_models[MIXED_FP8]
    order = rope_pair_order(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    assert len(engine.layers) == len(KEPT_WIDE)
    for lw, layer, wide in zip(w.layers, engine.layers, KEPT_WIDE):
        assert sorted(layer.bf16) == sorted(served_bf16(wide)) != []
        codes = stored_fp8(lw, order)
        assert sorted(layer.bf16 | set(codes)) == ["wdown", "wgu", "wo", "wqkv"]
        assert sorted(layer.scales) == sorted(codes)
        folded = {"wqkv": np.concatenate([lw.q_proj, lw.k_proj, lw.v_proj])[order]
                  * lw.input_norm[None, :], "wo": lw.o_proj,
                  "wgu": interleave_gate_up(lw.gate_proj, lw.up_proj)
                  * lw.post_attention_norm[None, :], "wdown": lw.down_proj}
        for name in layer.bf16:
            np.testing.assert_array_equal(getattr(layer, name).download(),
                                          float32_to_bf16_bits(folded[name]), name)
        for name, (stored, scales) in codes.items():
            np.testing.assert_array_equal(getattr(layer, name).download(), stored, name)
            np.testing.assert_array_equal(layer.scales[name].download(), scales, name)


def test_random_weights_keep_the_projections_they_are_told_in_bf16(cf, tmp_path):
    """bench_decode's mixed layouts (CudaForward's random_bf16; Meta's Llama-3.1 FP8 layout:
    wqkv+wo): random weights whose kept projections stay bf16 (two bytes a weight, no scales,
    bf16 tiled copies) beside E4M3 ones, every bucket's graph captured, and a prefill and
    decode steps (skinny and cuBLAS, both formats side by side) give finite logits; a name that
    is not a fused projection, or a kept projection without FP8 weights, refused."""
    model = write_random_checkpoint(tmp_path / "shape", write_weights=False,
                                    **FORWARD_SHAPES["llama"])
    cfg = load_config(model)
    options = dict(num_blocks=NUM_BLOCKS, block_size=BLOCK, max_num_batched_tokens=MAX_TOKENS,
                   max_num_seqs=MAX_SEQS, quantization="fp8")
    engine = cf.CudaForward.random_weights(cfg, random_bf16="wqkv+wo", **options)
    try:
        assert set(engine.graph_execs) == set(engine.buckets)
        for layer in engine.layers:
            assert layer.bf16 == {"wqkv", "wo"} and sorted(layer.scales) == ["wdown", "wgu"]
            for name, rows, cols in engine._projections():
                size = 2 if name in layer.bf16 else 1
                assert getattr(layer, name).nbytes == rows * cols * size, name
                assert layer.tiled[name].nbytes == size * engine.kernels.tiled_elements(
                    rows, cols, size), name
        seqs = [list(prompt(cfg, n, seed=50 + i)) for i, n in enumerate((40, 9))]
        tables = [np.arange(8), np.arange(8, 16)]
        chunks = [(np.array(s), 0, t) for s, t in zip(seqs, tables)]
        for _ in range(3):  # a 49-token prefill, then decode steps of two rows
            logits = engine.run(make_batch(chunks))[0]
            assert np.isfinite(logits).all()
            for s, row in zip(seqs, logits):
                s.append(int(np.argmax(row)))
            chunks = [(np.array(s[-1:]), len(s) - 1, t) for s, t in zip(seqs, tables)]
    finally:
        engine.close()
    with pytest.raises(ValueError, match="w_o: not among"):
        cf.CudaForward.random_weights(cfg, random_bf16="wqkv+w_o", **options)
    with pytest.raises(ValueError, match="quantization 'fp8'"):
        cf.CudaForward.random_weights(cfg, random_bf16="wo",
                                      **{**options, "quantization": None})


@pytest.fixture
def mixed_on_a_bf16_cache(cf, fp8_models):
    """MIXED_FP8's checkpoint on an FP8 engine with a bf16 KV cache."""
    cfg, w, _ = fp8_models[MIXED_FP8]
    engine = cf.CudaForward(cfg, w, num_blocks=NUM_BLOCKS, block_size=BLOCK,
                            max_num_batched_tokens=MAX_TOKENS, max_num_seqs=MAX_SEQS,
                            quantization="fp8")
    yield {MIXED_FP8: (cfg, w, engine)}
    engine.close()


def test_fp8_mixed_skinny_steps_are_as_close_as_bf16_ones(mixed_on_a_bf16_cache):
    """MIXED_FP8 in steps of at most 8 token rows only (two prompts in chunks, then decode),
    on a bf16 KV cache: the FP8 and bf16 skinny kernels side by side, x's f16 form handed to
    each FP8 one by the kernel before, of either kind (a bf16 one writes it through its _xf16out
    entry), no activation rounded to E4M3 on either side, so every step is
    within the bf16 engine's LOGITS_TOL of the emulation. What this catches that the FP8
    tolerance would not: on the CPU (the emulation against itself, these steps), the kept
    projections rounded to E4M3 as before move the logits 3.6-4.1%, q|k|v's and gate|up's
    RMSNorm weight folded twice 4.5-6.1%."""
    pair = Fp8Pair(mixed_on_a_bf16_cache, MIXED_FP8)
    pair.tol = LOGITS_TOL
    assert not pair.engine.kv_fp8
    seqs = [list(prompt(pair.cfg, 20, seed=6)), list(prompt(pair.cfg, 13, seed=7))]
    tables, pos = [np.arange(8), np.arange(8, 16)], [0, 0]
    for chunk in ((8, 6), (8, 7), (4, 0)):  # (seq 1's prompt is in after the second)
        logits = pair.step([(np.array(s[p:p + n]), p, t)
                            for s, p, t, n in zip(seqs, pos, tables, chunk) if n])
        if chunk[1] and pos[1] + chunk[1] == 13:
            seqs[1].append(int(np.argmax(logits[1])))
        pos = [p + n for p, n in zip(pos, chunk)]
    seqs[0].append(int(np.argmax(logits[0])))
    for _ in range(6):
        logits = pair.step([(np.array(s[p:p + 1]), p, t) for s, p, t in zip(seqs, pos, tables)])
        for s, row in zip(seqs, logits):
            s.append(int(np.argmax(row)))
        pos = [p + 1 for p in pos]
    pair.record("fp8 mixed, skinny steps on a bf16 cache")


def test_fp8_kv_calibration_leaves_capture_an_empty_batch(cf, tmp_path_factory):
    """The E4M3 cache's calibration prefill runs before the graphs are captured, on one
    sequence of up to 512 tokens (here 456); capture's passes run each bucket's kernels on the batch
    in device memory, which must be empty then (a bucket's kernels trust num_tokens <= the
    bucket: on the calibration's batch the attention of a smaller bucket wrote its query tiles'
    partial sums outside the workspace, an illegal address at start-up on the Llama shapes).
    An engine that calibrated gives the same logits, bit for bit, as one given its scales (no
    calibration before its capture), over prefill and decode steps in several buckets."""
    path = write_random_checkpoint(tmp_path_factory.mktemp("fp8_calib") / "llama", seed=20,
                                   **FORWARD_SHAPES["llama"])
    cfg = load_config(path)
    w = load_weights(path, cfg)
    options = dict(num_blocks=NUM_BLOCKS, block_size=BLOCK, max_num_batched_tokens=456,
                   max_num_seqs=MAX_SEQS, quantization="fp8", kv_cache_dtype="fp8")
    calibrated = cf.CudaForward(cfg, w, **options)
    try:
        counts = calibrated.desc.download()[0]  # what capture ran on
        assert (counts["num_tokens"], counts["num_seqs"], counts["num_logits"]) == (0, 0, 0)
        given = cf.CudaForward(cfg, w, kv_scales=calibrated.kv_scales.download(), **options)
        try:
            seqs = [list(prompt(cfg, n, seed=40 + i)) for i, n in enumerate((200, 33, 7))]
            tables = [np.arange(16 * i, 16 * i + 16) for i in range(3)]
            chunks = [(np.array(s), 0, t) for s, t in zip(seqs, tables)]
            for _ in range(4):  # a 240-token prefill, then decode steps of the three
                want = given.run(make_batch(chunks))[0]
                np.testing.assert_array_equal(calibrated.run(make_batch(chunks))[0], want)
                for s, row in zip(seqs, want):
                    s.append(int(np.argmax(row)))
                chunks = [(np.array(s[-1:]), len(s) - 1, t) for s, t in zip(seqs, tables)]
        finally:
            given.close()
    finally:
        calibrated.close()


# (fp8_lm_head, vocabulary): the demo tokenizer's 2,048 rows, and 2,049: a logits row of an
# odd number of floats, 4-byte aligned only (Llama-2 fine-tunes with 32,001 tokens), for which
# cuBLASLt offers no FP8 GEMM (CudaForward.lm_head_rows: it writes padded rows, copied in)
@pytest.mark.parametrize("fp8_lm_head,vocab", [(True, None), (False, None), (True, 2049),
                                                (False, 2049)],
                         ids=["fp8", "bf16", "fp8-odd-vocab", "bf16-odd-vocab"])
def test_fp8_lm_head_in_both_paths(cf, tmp_path_factory, fp8_lm_head, vocab):
    """The LM head as FP8 (fp8_lm_head, the default: E4M3 codes with a scale per vocabulary row)
    or bf16, on an engine of 24 sequences: a prefill of 20 prompts and decode steps of the 20
    (more than 16 logit rows: the final RMSNorm's rows quantized, then cuBLASLt's FP8 GEMM), then
    decode steps of 5 of them (the FP8 skinny kernel and its argmax): every step's logits within
    FP8_LOGITS_TOL of the emulation (the LM head rounded or not), the greedy tokens the
    logits' argmax, top-1 equal except at near-ties."""
    path = write_random_checkpoint(tmp_path_factory.mktemp("fp8_head") / "llama", seed=20,
                                   vocab_size=vocab, **FORWARD_SHAPES["llama"])
    cfg = load_config(path)
    w = load_weights(path, cfg)
    engine = cf.CudaForward(cfg, w, num_blocks=NUM_BLOCKS, block_size=BLOCK,
                            max_num_batched_tokens=MAX_TOKENS, max_num_seqs=24,
                            quantization="fp8", fp8_lm_head=fp8_lm_head)
    try:
        assert engine.lm_head_fp8 == fp8_lm_head
        # 24 logit rows: the FP8 GEMM; on an odd vocabulary into padded rows, copied in
        padded = fp8_lm_head and cfg.vocab_size % 16
        assert engine.graph_node_types[32].get("MEMCPY", 0) == (1 if padded else 0)
        pair = Fp8Pair({"llama": (cfg, w, engine)}, "llama")
        seqs = [list(prompt(cfg, 5, seed=30 + i)) for i in range(20)]
        tables = [np.array([2 * i, 2 * i + 1]) for i in range(20)]
        logits = pair.step([(np.array(s), 0, t) for s, t in zip(seqs, tables)])
        for step in range(4):
            live = range(20) if step < 2 else range(5)
            for i, row in zip(live, logits):
                seqs[i].append(int(np.argmax(row)))
            logits = pair.step([(np.array(seqs[i][-1:]), len(seqs[i]) - 1, tables[i])
                                for i in live])
        assert cfg.vocab_size == (vocab or cfg.vocab_size)
        pair.record(f"fp8 lm head {'fp8' if fp8_lm_head else 'bf16'}, vocabulary "
                    f"{cfg.vocab_size}, gemm and skinny")
    finally:
        engine.close()


def test_fp8_kv_calibration_matches_the_reference(fp8_models):
    """The engine's calibrated E4M3 scales (its KV writers' maxima on the calibration prompt)
    against the reference's calibration on the same FP8 weights: within the bf16 activations'
    difference."""
    cfg, w, engine = fp8_models["llama"]
    ref = ReferenceModel(cfg, fp8.fp8_weights(w), NUM_BLOCKS, BLOCK)
    tokens = fp8.calibration_tokens(cfg.vocab_size, min(512, engine.max_tokens))
    want = ref.calibrate_kv_scales(tokens)
    np.testing.assert_allclose(engine.calibrate_kv_scales(tokens), want, rtol=5e-2)


# --- the accuracy gate --------------------------------------------------------------------------

GATE_SEQS, GATE_PREFIX, GATE_DECODE = 16, 64, 128  # 16 x (1 + 128) = 2,064 positions
# The gate's bounds on FP8's logits (relative L2 over all positions, top-1 agreement): the CPU
# emulation's figures (tests/test_fp8.py: 0.047-0.049, 0.915-0.932) with a margin
GATE_REL_L2, GATE_TOP1 = 0.08, 0.85


def teacher_forced_logits(engine, seqs: list[np.ndarray]) -> np.ndarray:
    """[positions, vocab]: every sequence's logits after its GATE_PREFIX-token prompt (one
    prefill step of them all: the GEMM path) and then after each of its next GATE_DECODE
    tokens fed one decode step at a time (all sequences a step: the skinny kernels)."""
    engine.fill_kv_cache(0)
    per_seq = -(-(GATE_PREFIX + GATE_DECODE) // BLOCK)
    tables = [np.arange(s * per_seq, (s + 1) * per_seq) for s in range(len(seqs))]
    out = [engine.run(make_batch([(s[:GATE_PREFIX], 0, t) for s, t in zip(seqs, tables)]))[0]]
    for p in range(GATE_PREFIX, GATE_PREFIX + GATE_DECODE):
        out.append(engine.run(make_batch([(s[p:p + 1], p, t) for s, t in zip(seqs, tables)]))[0])
    return np.stack(out, 1).reshape(-1, engine.cfg.vocab_size)  # [seq][position]


def gate_metrics(ours: np.ndarray, ref: np.ndarray) -> dict[str, float]:
    """Relative L2, top-1 agreement, and whether every disagreement is a near-tie of the
    reference (top-2 gap within 5x the position's RMS logit error)."""
    a, b = ours.argmax(1), ref.argmax(1)
    disagree = np.nonzero(a != b)[0]
    noise = np.sqrt(((ours - ref) ** 2).mean(1))
    gaps = ref.max(1) - ref[np.arange(len(ref)), a]
    return {"rel_l2": float(np.linalg.norm(ours - ref) / np.linalg.norm(ref)),
            "top1": float((a == b).mean()), "positions": len(ref),
            "all_near_ties": bool((gaps[disagree] <= 5 * noise[disagree]).all())}


@pytest.fixture(scope="module")
def gate_engines(cf, tmp_path_factory):
    """The llama test checkpoint on four engines: bf16, FP8 weights (the LM head's too), FP8
    weights with a bf16 LM head, FP8 weights and cache; and the gate's sequences."""
    shape = FORWARD_SHAPES["llama"]
    path = write_random_checkpoint(tmp_path_factory.mktemp("gate") / "llama", seed=20, **shape)
    cfg = load_config(path)
    w = load_weights(path, cfg)
    blocks = GATE_SEQS * -(-(GATE_PREFIX + GATE_DECODE) // BLOCK)
    options = dict(num_blocks=blocks, block_size=BLOCK, max_num_seqs=GATE_SEQS,
                   max_num_batched_tokens=GATE_SEQS * GATE_PREFIX)
    engines = {"bf16": cf.CudaForward(cfg, w, **options),
               "fp8": cf.CudaForward(cfg, w, quantization="fp8", **options),
               "fp8 (bf16 lm head)": cf.CudaForward(cfg, w, quantization="fp8",
                                                    fp8_lm_head=False, **options),
               "fp8+kv": cf.CudaForward(cfg, w, quantization="fp8", kv_cache_dtype="fp8",
                                        **options)}
    rng = np.random.default_rng(7)
    seqs = [rng.integers(0, cfg.vocab_size, GATE_PREFIX + GATE_DECODE).astype(np.int32)
            for _ in range(GATE_SEQS)]
    yield path, engines, seqs
    for engine in engines.values():
        engine.close()


def test_fp8_accuracy_gate(gate_engines):
    """FP8 against the bf16 engine and against transformers (float32, CPU) on the same
    checkpoint, teacher-forced over 2,064 positions: relative L2 of the logits and top-1
    agreement (printed, and kept in the GPU report), every disagreement a near-tie. Bounds: the
    CPU emulation's figures (tests/test_fp8.py) with a margin; the bf16 engine itself must stay
    where test_cuda_forward holds it."""
    from oracle import hf_next_logits
    path, engines, seqs = gate_engines
    logits = {name: teacher_forced_logits(e, seqs) for name, e in engines.items()}
    hf = np.concatenate([hf_next_logits(path, list(s))[GATE_PREFIX - 1:GATE_PREFIX +
                                                       GATE_DECODE] for s in seqs])
    results = {}
    for name in engines:
        results[f"{name} vs transformers"] = gate_metrics(logits[name], hf)
        if name != "bf16":
            results[f"{name} vs bf16 engine"] = gate_metrics(logits[name], logits["bf16"])
    for key, r in results.items():
        print(f"fp8 accuracy gate: {key}: rel L2 {r['rel_l2']:.4f}, top-1 {r['top1']:.4f} "
              f"over {r['positions']} positions")
        REPORT["errors"][f"fp8 gate {key} (rel L2, top-1)"] = (round(r["rel_l2"], 4),
                                                               round(r["top1"], 4))
        assert r["all_near_ties"], key
    assert results["bf16 vs transformers"]["rel_l2"] < 2e-2
    for key, r in results.items():
        if key.startswith("fp8"):
            assert r["rel_l2"] < GATE_REL_L2 and r["top1"] > GATE_TOP1, (key, r)


def test_fp8_greedy_streams_differ_only_at_near_ties(gate_engines):
    """Greedy decoding of every gate sequence's prompt, 64 tokens, on the FP8 engines and the
    bf16 one: each FP8 stream equals the bf16 stream up to its first difference, and there the
    bf16 engine's top-2 gap is within 5x the two engines' logit difference (a near-tie), and
    that difference is FP8's rounding, not a fault: the step's relative L2 within twice the
    gate's bound (a garbage row would otherwise make every gap a near-tie)."""
    from periodic_model import greedy_streams
    _, engines, seqs = gate_engines
    prompts = [list(s[:GATE_PREFIX]) for s in seqs]
    streams = {}
    for name, engine in engines.items():
        engine.fill_kv_cache(0)
        streams[name] = greedy_streams(lambda batch: engine.run(batch)[0], prompts, 64, BLOCK)
    base_ids, base_logits = streams["bf16"]
    for name in (n for n in engines if n != "bf16"):
        ids, logits = streams[name]
        same = 0
        for s in range(len(seqs)):
            ours, ref = ids[s], base_ids[s]
            k = next((j for j, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
            if k is None:
                same += 1
                continue
            row_ref, row_ours = base_logits[s, k], logits[s, k]
            noise = np.sqrt(np.mean((row_ours - row_ref) ** 2))
            rel = noise / np.sqrt(np.mean(row_ref ** 2))
            assert rel < 2 * GATE_REL_L2, f"{name} seq {s} step {k}: relative L2 {rel:.3g}"
            gap = row_ref.max() - row_ref[ours[k]]
            assert gap <= 5 * noise, f"{name} seq {s} step {k}: gap {gap:.4g}, noise {noise:.4g}"
        REPORT["errors"][f"fp8 greedy streams equal to bf16 ({name}, of {len(seqs)})"] = same
        print(f"fp8 greedy: {name}: {same} of {len(seqs)} streams of 64 tokens equal to bf16's")


def test_fp8_greedy_streams_are_exact_on_a_decisive_model(cf, tmp_path_factory):
    """Where greedy choices are decisive, FP8 changes no token: on the checkpoint trained to
    continue a periodic sequence (tests/periodic_model.py; transformers and the CPU emulation
    of these engines continue the period, tests/test_fp8.py), the bf16 engine and the FP8 ones
    (the LM head's too, or bf16; with the E4M3 KV cache) continue 16 periodic prompts of 64
    tokens (one prefill step: the FP8 GEMMs) with the period for 64 decode steps (the FP8
    skinny kernels), every token."""
    from periodic_model import (continue_period, greedy_streams, periodic_prompt,
                                smallest_top2_gap, write_periodic_checkpoint)
    path = write_periodic_checkpoint(tmp_path_factory.mktemp("periodic") / "m")
    cfg = load_config(path)
    w = load_weights(path, cfg)
    rng = np.random.default_rng(4)
    prompts = [periodic_prompt(rng, 64) for _ in range(16)]
    want = [continue_period(p, 64) for p in prompts]
    options = dict(num_blocks=16 * 8, block_size=BLOCK, max_num_seqs=16,
                   max_num_batched_tokens=16 * 64)
    for name, extra in (("bf16", {}), ("fp8", dict(quantization="fp8")),
                        ("fp8 (bf16 lm head)", dict(quantization="fp8", fp8_lm_head=False)),
                        ("fp8+kv", dict(quantization="fp8", kv_cache_dtype="fp8"))):
        engine = cf.CudaForward(cfg, w, **options, **extra)
        try:
            streams, logits = greedy_streams(lambda batch: engine.run(batch)[0], prompts, 64,
                                             BLOCK)
        finally:
            engine.close()
        same = sum(s == t for s, t in zip(streams, want))
        print(f"fp8 periodic model: {name}: {same} of 16 streams of 64 tokens exact, smallest "
              f"top-2 gap {smallest_top2_gap(logits):.2f}")
        REPORT["errors"][f"periodic model streams exact ({name}, of 16)"] = same
        assert streams == want, name
