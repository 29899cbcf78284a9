"""bench_decode's CPU arithmetic for Llama-3.2-1B (published config: hidden 2048,
intermediate 8192, 16 layers, 32 heads of 64, 8 KV heads, vocabulary 128,256, tied
embeddings): the summary table's floors in every variant --fp8 and --options make, the
breakdown's and --marginal's per-op figures, and the prefill FLOPs of one launch. The forward
pass, its timing and the copy rates are stand-ins (those need the GPU); the bytes, the formats
and the arithmetic on the timings are the module's."""
from __future__ import annotations

import re

import numpy as np
import pytest

from blink.gpu_engine import bench_decode
from blink.gpu_engine.bench_decode import SHAPES, Marginal, Point, op_bytes, op_flops
from blink.gpu_engine.gpu_monitor import GpuMonitor

H, I, L, HEADS, KV_HEADS, D, V = 2048, 8192, 16, 32, 8, 64, 128256
CFG = SHAPES["llama-3.2-1b"]
LAYER_PROJECTIONS = H * HEADS * D + 2 * H * KV_HEADS * D + HEADS * D * H + 3 * H * I
LAYER_ROWS = HEADS * D + 2 * KV_HEADS * D + H + 2 * I + H  # output rows: one scale each
NORMS = L * 2 * H + H
KV_TOKEN = 2 * L * KV_HEADS * D  # elements of K and V a token over all layers


def step_bytes(batch, context, weights_fp8=False, lm_head_fp8=False, kv_fp8=False,
               attention_bf16=False) -> int:
    """One decode step's bytes for the 1B, by hand (attention_bf16: FP8 weights but q|k|v and
    o in bf16, Meta's Llama-3.1 FP8 layout)."""
    if weights_fp8:
        layers = L * (LAYER_PROJECTIONS + 4 * LAYER_ROWS)
        if attention_bf16:  # q|k|v and o: a byte more a weight, no scale a row
            attention = H * HEADS * D + 2 * H * KV_HEADS * D + HEADS * D * H
            layers += L * (attention - 4 * (HEADS * D + 2 * KV_HEADS * D + H))
    else:
        layers = L * LAYER_PROJECTIONS * 2
    head = V * H + 4 * V if lm_head_fp8 else 2 * V * H
    return (layers + head + 2 * NORMS + batch * H * 2
            + batch * context * KV_TOKEN * (1 if kv_fp8 else 2))


class FakeForward:
    """CudaForward's formats from its options, as its constructor sets them."""
    gemm_tuner = None

    def __init__(self, cfg, quantization=None, kv_cache_dtype="auto", fp8_lm_head=True,
                 random_bf16="", **_):
        self.cfg = cfg
        self.fp8 = quantization == "fp8"
        self.random_bf16 = frozenset(name for name in random_bf16.split("+") if name)
        self.lm_head_fp8 = self.fp8 and bool(fp8_lm_head)
        self.kv_fp8 = kv_cache_dtype == "fp8"

    def close(self):
        pass


def test_summary_table_floors_count_each_variants_formats(monkeypatch, capsys):
    bw, read_bw, seconds = 4e12, 4.4e12, 2e-3
    monkeypatch.setattr(bench_decode, "copy_bandwidth", lambda: bw)
    monkeypatch.setattr(bench_decode, "read_bandwidth", lambda: read_bw)
    monkeypatch.setattr(bench_decode.GpuMonitor, "for_cuda_device", classmethod(
        lambda cls, ordinal=0: GpuMonitor(None, unavailable="no GPU in this test")))
    monkeypatch.setattr(bench_decode, "make_forward",
                        lambda cfg, points, **options: (FakeForward(cfg, **options), 33))
    monkeypatch.setattr(bench_decode, "time_step", lambda fwd, point, blocks: seconds)
    bench_decode.main(["--shapes", "llama-3.2-1b", "--points", "32x512", "--fp8",
                       "--options", "bf16head:quantization=fp8,fp8_lm_head=0",
                       "meta:quantization=fp8,random_bf16=wqkv+wo"])
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines()
            if line.startswith("| llama-3.2-1b | 32 | 512 |")]
    want = {"default": step_bytes(32, 512),
            "fp8": step_bytes(32, 512, weights_fp8=True, lm_head_fp8=True),
            "fp8+kv": step_bytes(32, 512, weights_fp8=True, lm_head_fp8=True, kv_fp8=True),
            "bf16head": step_bytes(32, 512, weights_fp8=True),
            "meta": step_bytes(32, 512, weights_fp8=True, lm_head_fp8=True, attention_bf16=True)}
    assert [row[3] for row in rows] == list(want)
    for row in rows:
        floor_s = want[row[3]] / bw
        ms, floor_ms, x, x_read = (float(v.strip(" |")) for v in row[4:8])
        assert ms == pytest.approx(seconds * 1e3)
        assert floor_ms == pytest.approx(floor_s * 1e3, abs=6e-4)
        assert x == pytest.approx(seconds / floor_s, abs=6e-3)
        # against the same bytes at the read rate (higher: a smaller floor, a larger ratio)
        assert x_read == pytest.approx(seconds / (want[row[3]] / read_bw), abs=6e-3)
    assert float(rows[0][5]) == pytest.approx(3_008_630_784 / bw * 1e3, abs=6e-4)


def test_one_launch_reads_one_layers_keys_and_values():
    point = Point(32, 512)
    per_layer = 32 * 512 * 2 * KV_HEADS * D  # K and V of one layer
    assert op_bytes(CFG, "attention", point) == 2 * per_layer
    assert op_bytes(CFG, "attention", point, kv_fp8=True) == per_layer


def test_prefill_flops_of_one_launch():
    point = Point.parse_prefill("256x1024")  # the last 256 tokens of a 1,024-token prompt
    assert op_flops(CFG, "rmsnorm + gate|up proj + silu*mul", point) == 2 * (2 * H * I) * 256
    assert op_flops(CFG, "down proj + residual", point) == 2 * I * H * 256
    # one layer's attention: a multiply-add a head dim for Q K^T and one for P V, per query
    # head and unmasked (query, key) cell
    positions = np.arange(768, 1024)
    cells = int((np.arange(1024)[None, :] <= positions[:, None]).sum())
    assert op_flops(CFG, "attention", point) == 2 * 2 * HEADS * D * cells
    assert op_flops(CFG, "lm head", point) is None


def fwd_formats(**kw):
    return FakeForward(CFG, **kw)


def test_breakdown_rates_are_all_launches_bytes_over_their_time(capsys):
    point = Point(32, 512)
    rows = [("down proj + residual", 16, 200e-6), ("attention", 16, 100e-6),
            ("whole step", 120, 1000e-6)]
    bench_decode.print_breakdown("llama-3.2-1b", CFG, point, rows, 4e12, "default",
                                 fwd_formats())
    out = {line.split(" | ")[0]: line.split(" | ")
           for line in capsys.readouterr().out.splitlines() if line.startswith("| ")}
    down_gbs = 16 * I * H * 2 / 200e-6 / 1e9                 # 2,684 GB/s
    attention_gbs = 16 * 32 * 512 * 2 * KV_HEADS * D * 2 / 100e-6 / 1e9  # 5,369 GB/s
    assert float(out["| down proj + residual"][5].strip(" |")) == pytest.approx(down_gbs, abs=1)
    assert float(out["| attention"][5].strip(" |")) == pytest.approx(attention_gbs, abs=1)
    # FP8 weights but o kept in bf16 (random_bf16): o's launches count two bytes a weight,
    # down's one
    rows = [("o proj + residual", 16, 100e-6), ("down proj + residual", 16, 200e-6),
            ("whole step", 120, 1000e-6)]
    bench_decode.print_breakdown("llama-3.2-1b", CFG, point, rows, 4e12, "meta",
                                 fwd_formats(quantization="fp8", random_bf16="wqkv+wo"))
    out = {line.split(" | ")[0]: line.split(" | ")
           for line in capsys.readouterr().out.splitlines() if line.startswith("| ")}
    o_gbs = 16 * HEADS * D * H * 2 / 100e-6 / 1e9
    assert float(out["| o proj + residual"][5].strip(" |")) == pytest.approx(o_gbs, abs=1)
    assert float(out["| down proj + residual"][5].strip(" |")) == pytest.approx(down_gbs / 2,
                                                                                 abs=1)


def test_marginal_rows_are_the_steps_differences(capsys):
    """work = whole - emptied, boundaries = emptied - left out; per launch; the label's bytes of
    one launch at the copy rate."""
    qkv = "rmsnorm + qkv proj + rope + kv write"
    rows = [Marginal(qkv, 16, seconds_left_out=700e-6, seconds_emptied=760e-6),
            Marginal("attention", 16, seconds_left_out=850e-6, seconds_emptied=880e-6)]
    bench_decode.print_marginal("llama-3.2-1b", CFG, Point(32, 512), 1000e-6, rows, 4e12,
                                "default", fwd_formats())
    printed = capsys.readouterr().out.splitlines()
    out = {line.split(" | ")[0]: [c.strip(" |") for c in line.split(" | ")]
           for line in printed if line.startswith("| ")}
    got = out["| " + qkv]
    assert [float(v) for v in got[1:7]] == pytest.approx(
        [16, 240.0, 60.0, 15.0, 3.75, H * (HEADS * D + 2 * KV_HEADS * D) * 2 / 4e12 * 1e6],
        abs=6e-3)
    got = out["| attention"]
    assert [float(v) for v in got[1:7]] == pytest.approx(
        [16, 120.0, 30.0, 7.5, 1.875, 32 * 512 * 2 * KV_HEADS * D * 2 / 4e12 * 1e6], abs=6e-3)
    (total,) = [line for line in printed if line.startswith("| sum |")]
    assert [float(v) for v in re.findall(r"[0-9.]+", total)] == pytest.approx([360.0, 90.0])


def test_marginal_whole_step_is_the_mean_of_its_timings_before_and_after(monkeypatch):
    """The clock drifts between the variants (here each graph timed takes 1 s longer than the
    one before): the whole step is the mean of its timing before the variants and after."""
    from test_bench_decode import _Forward
    whole_step_times = []
    whole_step = ["blink_embedding", "blink_qkv", "blink_attention", "blink_qkv",
                  "blink_attention"]

    def graph_seconds(fwd, enqueues, steps=bench_decode.STEPS):
        fwd.kernels.launched.clear()
        for enqueue in enqueues:
            enqueue()
        graph_seconds.calls += 1
        t = 10 * len(fwd.kernels.launched) + graph_seconds.calls
        if [launch[0] for launch in fwd.kernels.launched] == whole_step:
            whole_step_times.append(t)
        return t
    graph_seconds.calls = 0
    monkeypatch.setattr(bench_decode, "time_enqueues", graph_seconds)
    whole, rows = bench_decode.marginal(_Forward(), Point(1, 512), 32)
    assert len(whole_step_times) == 2 and whole_step_times[0] != whole_step_times[1]
    assert whole == pytest.approx((whole_step_times[0] + whole_step_times[1]) / 2)
    assert [r.label for r in rows] == ["embedding", "qkv", "attention"]
