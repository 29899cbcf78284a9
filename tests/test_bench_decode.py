"""bench_decode's points on the CPU: the batches it hands the forward pass are what the scheduler
would build for those sequences (the timing itself needs the GPU); on the GPU, that its read-rate
probe reads every word once."""
from __future__ import annotations

import argparse
import ast
from pathlib import Path

import numpy as np
import pytest

from blink.gpu_engine.bench_decode import LABEL_PROJECTIONS, ROOFLINE_PROJECTIONS, SHAPES, \
    MixedPoint, Point, empty_kernels, op_bytes, parse_options, read_stream, step_batch
from blink.gpu_engine.roofline import BF16_BYTES, projection_weights
from blink.gpu_engine.weight_layout import FUSED_PROJECTIONS
from gpu import requires_gpu


def check_batch(batch, want: list[tuple[int, int]], blocks_per_seq: int) -> None:
    """want: (tokens computed, context after the step) per sequence, in order."""
    assert batch.num_seqs == len(want)
    assert batch.num_tokens == sum(n for n, _ in want)
    for s, (n, context) in enumerate(want):
        lo, hi = batch.seq_starts[s], batch.seq_starts[s + 1]
        assert hi - lo == n
        np.testing.assert_array_equal(batch.positions[lo:hi], np.arange(context - n, context))
        assert batch.context_lens[s] == context
    assert batch.block_tables.shape == (len(want), blocks_per_seq)
    assert len(np.unique(batch.block_tables)) == batch.block_tables.size  # no block shared
    np.testing.assert_array_equal(batch.logit_seqs, np.arange(len(want)))


def test_decode_and_prefill_points_build_their_batches():
    check_batch(step_batch(Point(3, 7), 2), [(1, 7)] * 3, 2)
    check_batch(step_batch(Point.parse_prefill("5x9"), 1), [(5, 9)], 1)


def test_a_step_holds_many_tokens_not_one_repeated():
    """Alike rows toggle fewer bits in the GEMMs than a live step's (a power-capped GPU then
    clocks higher): the tokens are spread over the vocabulary, the same from run to run."""
    point = Point(256, 400)
    tokens = step_batch(point, 26, vocab_size=128256).token_ids
    assert tokens.min() >= 0 and tokens.max() < 128256
    assert len(np.unique(tokens)) > 250
    np.testing.assert_array_equal(tokens, step_batch(point, 26, vocab_size=128256).token_ids)


def test_a_mixed_point_is_its_decodes_then_its_chunks():
    point = MixedPoint.parse("4x40+16x16+8x100")
    assert point.groups == (Point(4, 40), Point(1, 16, 16), Point(1, 100, 8))
    assert (point.tokens, point.batch, point.context, point.chunk) == (28, 6, 100, 16)
    assert str(point) == "batch 4 context 40 + chunk 16 to context 16 + chunk 8 to context 100"
    check_batch(step_batch(point, 7), [(1, 40)] * 4 + [(16, 16), (8, 100)], 7)


@pytest.mark.parametrize("text", ["4x40", "4x40+", "4x40+17x16", "0x40+16x16", "4x40+axb"])
def test_mixed_points_reject_what_is_not_one(text):
    with pytest.raises(argparse.ArgumentTypeError):
        MixedPoint.parse(text)


@pytest.mark.gpu
@requires_gpu()
@pytest.mark.parametrize("words", [512 * 2112 * 3, 512 * 2112 * 3 + 1237, 1000])
def test_read_stream_reads_every_word_once(words):
    """The read-rate probe's sum of every 32-bit word (wrapping) is numpy's: no word skipped or
    read twice, in whole batches (three a warp on an H200's 2,112 warps) and in the tail past
    them."""
    from blink.gpu_engine import cuda_runtime as cr
    data = np.random.default_rng(words).integers(0, 2 ** 32, words * 4, dtype=np.uint32)
    buf, total = cr.DeviceBuffer(data.nbytes), cr.DeviceBuffer(4)
    try:
        buf.upload(data.tobytes())
        total.upload(bytes(4))
        cr.check(cr.cu.cuCtxSynchronize())  # the copies land before the kernel's stream starts
        stream = cr.new_stream()
        read_stream(stream, buf.ptr, words, total.ptr)
        cr.synchronize(stream)
        assert (int(np.frombuffer(total.download(), np.uint32)[0])
                == int(data.sum(dtype=np.uint64)) % 2 ** 32)
    finally:
        buf.free()
        total.free()


def test_breakdown_labels_are_the_forward_pass_labels_and_count_their_weights():
    """Each projection label the breakdown rates (bytes a launch, for its GB/s column) is one
    CudaForward.ops emits, word for word (cuda_forward.py needs CUDA to import, so its source
    is read), and the one-kernel chain of a layer's o, gate|up and down projections counts the
    three projections' weights, as the three kernels it replaces do together."""
    source = (Path(__file__).resolve().parents[1] / "gpu_engine" / "cuda_forward.py").read_text()
    emitted = set()  # the string constants in the label argument of ops()'s op() and linear()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("op", "linear"):
            emitted |= {c.value for c in ast.walk(node.args[0]) if isinstance(c, ast.Constant)}
    assert "attention" in emitted and "lm head" in emitted
    for label in LABEL_PROJECTIONS:
        assert label in emitted, f"{label!r} is not a label of CudaForward.ops"
    cfg, point = SHAPES["llama-3.2-1b"], Point(1, 512)
    weights = projection_weights(cfg)
    chain = "o proj + residual, rmsnorm + gate|up proj + silu*mul, down proj + residual"
    assert op_bytes(cfg, chain, point) == sum(
        op_bytes(cfg, label, point) for label in ("o proj + residual",
                                                  "rmsnorm + gate|up proj + silu*mul",
                                                  "down proj + residual"))
    assert op_bytes(cfg, chain, point) == BF16_BYTES * (weights["o"] + weights["gate_up"]
                                                        + weights["down"])
    assert op_bytes(cfg, "embedding", point) is None
    # FP8 weights: one byte a weight, the LM head's too unless it is kept bf16
    head = weights["lm_head"]
    assert op_bytes(cfg, "lm head", point, weights_fp8=True) == BF16_BYTES * head
    assert op_bytes(cfg, "lm head", point, weights_fp8=True, lm_head_fp8=True) == head
    assert op_bytes(cfg, "down proj + residual", point, weights_fp8=True) == weights["down"]
    # projections kept in bf16 beside FP8 ones (CudaForward's random_bf16, by
    # ROOFLINE_PROJECTIONS: its fused names, every one of them) count two bytes a weight
    assert ROOFLINE_PROJECTIONS.keys() == FUSED_PROJECTIONS.keys()
    assert set(ROOFLINE_PROJECTIONS.values()) == weights.keys() - {"lm_head"}
    meta = frozenset({"qkv", "o"})
    assert op_bytes(cfg, "o proj + residual", point, weights_fp8=True,
                    kept_bf16=meta) == BF16_BYTES * weights["o"]
    assert op_bytes(cfg, "rmsnorm + qkv proj + rope + kv write", point, weights_fp8=True,
                    kept_bf16=meta) == BF16_BYTES * weights["qkv"]
    assert op_bytes(cfg, "rmsnorm + gate|up proj + silu*mul", point, weights_fp8=True,
                    kept_bf16=meta) == weights["gate_up"]


def test_options_take_ints_and_words():
    assert parse_options("bf16head:quantization=fp8,fp8_lm_head=0,max_attention_splits=-1") == (
        "bf16head", {"quantization": "fp8", "fp8_lm_head": 0, "max_attention_splits": -1})
    assert parse_options("plain") == ("plain", {})
    assert parse_options("meta:quantization=fp8,random_bf16=wqkv+wo") == (
        "meta", {"quantization": "fp8", "random_bf16": "wqkv+wo"})


class _Kernels:
    """A stand-in for ForwardKernels: an op method that launches through self.launch."""

    def __init__(self):
        self.launched = []

    def launch(self, name, grid, block, args, stream, smem=0):
        self.launched.append((name, grid, block, args, stream, smem))

    def norm(self, stream):
        self.launch("blink_rms_norm", (3,), (256,), ("x", "w"), stream, 4096)


def test_empty_kernels_swap_the_noop_in_on_the_same_grid_and_then_restore_launch():
    kernels = _Kernels()
    with empty_kernels(kernels) as emptied:
        kernels.norm("s")
    kernels.norm("s")
    assert emptied == ["blink_rms_norm"]
    assert kernels.launched == [("blink_pdl_noop", (3,), (256,), (), "s", 4096),
                                ("blink_rms_norm", (3,), (256,), ("x", "w"), "s", 4096)]
    assert "launch" not in vars(kernels)  # the class's method again
    patched = kernels.launch = lambda *a, **kw: None  # a launch patched before is put back
    with empty_kernels(kernels):
        pass
    assert kernels.launch is patched


class _Forward:
    """A stand-in for CudaForward whose ops launch through _Kernels, and one op (`cublas`, if
    asked) that launches a kernel the ForwardKernels cannot empty."""
    cfg = SHAPES["llama-3.2-1b"]

    def __init__(self, cublas: bool = False):
        self.kernels, self.cublas = _Kernels(), cublas

    def run(self, batch):
        pass

    def bucket_for(self, tokens):
        return tokens

    def ops(self, rows):
        def launching(name):
            return lambda: self.kernels.launch(name, (2,), (256,), (), "s")
        ops = [("embedding", launching("blink_embedding")), ("qkv", launching("blink_qkv")),
               ("attention", launching("blink_attention")), ("qkv", launching("blink_qkv")),
               ("attention", launching("blink_attention"))]
        return ops + ([("lm head", lambda: None)] if self.cublas else [])


def test_marginal_empties_and_leaves_out_one_label_at_a_time(monkeypatch):
    """Each label's ops, and only them, are left out, then emptied, in the step's graphs (here a
    graph "takes" 10 s a real kernel and 1 s an empty one); an op that launches nothing
    through ForwardKernels (a cuBLAS GEMM) cannot be emptied and says so."""
    from blink.gpu_engine import bench_decode

    def graph_seconds(fwd, enqueues, steps=bench_decode.STEPS):
        fwd.kernels.launched.clear()
        for enqueue in enqueues:
            enqueue()
        return sum(1 if name == "blink_pdl_noop" else 10
                   for name, *_ in fwd.kernels.launched)

    monkeypatch.setattr(bench_decode, "time_enqueues", graph_seconds)
    whole, rows = bench_decode.marginal(_Forward(), Point(1, 512), 32)
    assert whole == 50
    assert rows == [bench_decode.Marginal("embedding", 1, 40, 41),
                    bench_decode.Marginal("qkv", 2, 30, 32),
                    bench_decode.Marginal("attention", 2, 30, 32)]
    with pytest.raises(ValueError, match="'lm head' launches no kernel of ForwardKernels"):
        bench_decode.marginal(_Forward(cublas=True), Point(1, 512), 32)
