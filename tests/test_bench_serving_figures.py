"""bench_serving's figures from hand-made timestamps and counters, against the module
doc's definitions: TPOT ((last - first) / (n - 1) per request, median), full-batch TPOT (the
mean gap while every stream decodes), TTFT median, tokens/s, the engine's ms a step and tokens a
step from the counters' change, the decode floor (Llama-3.2-1B's bytes at batch `concurrency`
and the mean context, over the copy rate), the prefix suite's warm / cold and client-path
figures, the chat's cached share, and the GPU notes. The server and its client are stand-ins
(the numbers are what is tested)."""
from __future__ import annotations

import statistics

import pytest

from blink.client import bench_serving
from blink.client.bench_load import RequestRecord
from blink.client.bench_serving import Chat, ChatResult, Result, SharedPrefix, \
    SharedPrefixResult, Workload, gpu_cell, gpu_note, run_workload
from blink.gpu_engine.gpu_monitor import GpuClocks, GpuMonitor

LLAMA_1B_PARAMETERS = 1_235_814_400  # tied embeddings: the table is the LM head, read whole
KV_TOKEN_BYTES = 2 * 16 * 8 * 64 * 2  # K and V, 16 layers, 8 KV heads of 64, bf16


class FakeClient:
    """The engine's counters before and after the workload; the model's vocabulary."""

    def __init__(self, target):
        self.counters = iter([
            {"engine_steps": 100, "engine_busy_ns": 5_000_000_000, "engine_step_tokens": 1000},
            {"engine_steps": 120, "engine_busy_ns": 5_000_000_000 + 20 * 3_500_000,
             "engine_step_tokens": 1000 + 1167}])

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def stats(self):
        return next(self.counters)

    def model_info(self):
        class Info:
            vocab_size = 128256
        return Info()


def rec(sent, times, prompt=384, want=4):
    return RequestRecord(prompt, want, sent, list(times))


RECORDS = [rec(0.0, [0.10, 0.12, 0.14, 0.20]),   # TTFT 100, TPOT 100 / 3 = 33.3
           rec(0.0, [0.11, 0.13, 0.15, 0.19]),   # TTFT 110, TPOT 80 / 3 = 26.7
           rec(0.0, [0.15, 0.16, 0.18, 0.30])]   # TTFT 150, TPOT 150 / 3 = 50


def test_a_decode_workloads_result(monkeypatch):
    async def run_requests(target, requests, rate, concurrency):
        assert concurrency == 3 and len(requests) == 3
        return RECORDS, 0.5, None
    monkeypatch.setattr(bench_serving, "BlinkClient", FakeClient)
    monkeypatch.setattr(bench_serving, "run_requests", run_requests)

    class Server:
        target = "unix:///nowhere"
    w = Workload("decode b3", "decode", 3, 3, 384, 4)
    bandwidth = 4e12
    got = run_workload(Server(), "llama-3.2-1b", w, bandwidth,
                       GpuMonitor(None, unavailable="no GPU in this test"))
    tpots = [(r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1) * 1e3
             for r in RECORDS]
    assert got.tpot_ms == pytest.approx(statistics.median(tpots)) == pytest.approx(100 / 3)
    assert got.ttft_ms == pytest.approx(110.0)
    assert got.tokens_per_s == pytest.approx(12 / 0.5)
    assert got.engine_step_ms == pytest.approx(3.5)
    assert got.tokens_per_step == pytest.approx(1167 / 20)
    assert got.step_range == (100, 120) and got.generated_tokens == 12
    # every stream decodes from the last first token (150 ms) to the first last token (190)
    first = [r.token_times[0] for r in RECORDS]
    last = [r.token_times[-1] for r in RECORDS]
    full = [(e - s) * 1e3 for r in RECORDS for s, e in zip(r.token_times, r.token_times[1:])
            if all(f <= s and e <= x for f, x in zip(first, last))]
    assert full == pytest.approx([40.0, 10.0, 20.0])  # B's 150-190, C's 150-160, 160-180
    assert got.full_batch_tpot_ms == pytest.approx(statistics.mean(full))
    # the floor: 3 sequences at the mean context, prompt + output / 2 = 386 keys, all bf16
    step_bytes = (2 * LLAMA_1B_PARAMETERS + 3 * 2048 * 2 + 3 * 386 * KV_TOKEN_BYTES)
    assert got.floor_ms == pytest.approx(step_bytes / bandwidth * 1e3)
    cells = [c.strip(" |") for c in got.row().split(" | ")]
    assert float(cells[2]) == pytest.approx(100 / 3, abs=6e-4)
    assert float(cells[4]) == pytest.approx(got.floor_ms, abs=6e-4)
    assert cells[5] == f"{100 / 3 / got.floor_ms:.2f}, {70 / 3 / got.floor_ms:.2f}"


def test_a_prefill_line_says_prompt_tokens_a_second():
    w = Workload("prefill 8000", "prefill", 1, 2, 8000, 1)
    result = Result("llama-3.2-1b", w, None, 400.0, 2.5, 50.0, 4000.0, None, (0, 2))
    assert "TTFT 400.0 ms, 20,000 prefill tokens/s;" in result.line()


def timed(sent, ttft_s, server_ttft_s, cached):
    return RequestRecord(2100, 4, sent, [sent + ttft_s] * 4, cached_prompt_tokens=cached,
                         server_ttft_s=server_ttft_s)


def test_shared_prefix_figures():
    w = SharedPrefix("shared prefix 2000 + 100", 3, 2000, 100, 4)
    # cold TTFTs 200, 260, 210 ms (median 210); warm 20, 21, 40 (median 21): warm / cold 10%
    cold = [timed(0.0, 0.200, 0.190, 0), timed(1.0, 0.260, 0.250, 0),
            timed(2.0, 0.210, 0.204, 0)]
    warm = [timed(3.0, 0.020, 0.016, 2000), timed(4.0, 0.021, 0.0165, 2000),
            timed(5.0, 0.040, 0.020, 2000)]
    floor = [timed(6.0, 0.0190, 0.0165, 0), timed(7.0, 0.0195, 0.0165, 0),
             timed(8.0, 0.0300, 0.0165, 0)]
    result = SharedPrefixResult("llama-3.2-1b", w, cold, warm, floor=floor)
    assert result.cold_ttft_ms == pytest.approx(210.0)
    assert result.warm_ttft_ms == pytest.approx(21.0)
    cells = [c.strip(" |") for c in result.row().split(" | ")]
    assert cells[2:5] == ["210.0", "21.0", "10.0%"]
    # the client's TTFT minus the server's own: warm 4.0, 4.5, 20.0 ms (median 4.5); the floor's
    # 2.5, 3.0, 13.5 (median 3.0)
    assert cells[5] == "4.50 (3.00)"
    assert cells[6] == "2,000 (0)"
    line = result.line()
    assert "warm / cold 10.0% (target <= 10%)" in line
    # the server's own TTFT, medians: cold 204 ms, warm 16.5
    assert "the server's own (from the request's receipt) cold 204.0 ms, warm 16.5 ms" in line


def test_chat_cached_share_is_of_the_prompt_tokens():
    turns = [RequestRecord(100, 8, 0.0, [0.1 + 0.01 * i for i in range(8)]),
             RequestRecord(208, 8, 0.5, [0.6 + 0.01 * i for i in range(8)],
                           cached_prompt_tokens=96)]
    result = ChatResult("llama-3.2-1b", Chat("chat", 1, 2, 100, 8), turns, wall_s=1.0)
    assert result.cached_share == pytest.approx(96 / 308)
    assert "31.2% of 308 prompt tokens from the cache" in result.line()


def test_gpu_notes():
    gpu = GpuClocks(samples=40, sm_mhz_median=1605.0, sm_mhz_min=1500.0, power_w_median=688.0,
                    power_limit_w=700.0, power_capped_share=0.75, thermal_share=0.0,
                    energy_j=1400.0)
    # 1,400 J over 20,000 generated tokens: 70 mJ a token
    assert gpu_note(gpu, 20_000).endswith(", 70.0 mJ a generated token]")
    assert gpu_cell(gpu) == "1,605, 688 (75%)"
    assert gpu_note(None) == "" and gpu_cell(None) == ""
