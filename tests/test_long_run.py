"""Long-run operation: what an operator running `blink serve` for days, under mixed and hostile
load, relies on (the tools' own checks too)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_soak_fits_its_requests_to_a_small_kv_cache(checkpoints, tmp_path):
    """A server whose KV cache holds fewer tokens than the context (a small --num-kv-blocks,
    here 8 blocks of 16 tokens) refuses a prompt plus max_tokens past it (INVALID_ARGUMENT):
    the soak drew its prompts and outputs from the context length alone, so such a server
    failed the soak with the soak's own requests as its errors."""
    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, "-m", "blink.client.cli", "soak", "--model",
                           str(checkpoints["llama"]), "--out", str(out), "--duration", "3",
                           "--concurrency", "4", "--engine-arg=--engine=cpu",
                           "--engine-arg=--num-kv-blocks=8"],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    assert doc["error_count"] == 0 and doc["leaked"] == {}, doc
    assert doc["kv_blocks_total"] == 8 and doc["requests"] > 0


def test_stats_counters_never_go_down_under_stop_string_load(checkpoints, tmp_path):
    """GetServerStats' requests_cancelled went down for a step at a time (161 times in 17,282
    polls over 15 s) while streams ended on stop strings: the engine counts such an end as a
    cancel at the end of its step, after it wrote the record the front end reads, and the
    front end moved it to the finished as it read the record. Polled as fast as one client can
    while six others end on stop strings, no count goes down, finished + cancelled never passes
    admitted, and at rest the client's own cancels are the cancelled count."""
    import asyncio
    import time

    import grpc

    from blink.v1 import blink_pb2 as pb
    from blink.v1 import blink_pb2_grpc as pb_grpc
    from test_operations import Serve
    keys = ("requests_admitted", "requests_finished", "requests_cancelled")
    own_cancels, seconds = 3, 6.0

    async def load(target: str) -> tuple[list, list, dict]:
        async with grpc.aio.insecure_channel(target) as channel:
            stub = pb_grpc.BlinkStub(channel)
            for _ in range(own_cancels):
                call = stub.Generate(pb.GenerateRequest(text="x", sampling=pb.SamplingParams(
                    max_tokens=500, ignore_eos=True)))
                await call.read()
                call.cancel()
            end = time.monotonic() + seconds

            async def stop_strings(i: int) -> None:
                while time.monotonic() < end:
                    async for _ in stub.Generate(pb.GenerateRequest(
                            text="hello world " * (1 + i % 7), sampling=pb.SamplingParams(
                                max_tokens=40, temperature=1.0, seed=i, stop=["e", "a", "o"]))):
                        pass

            async def poll() -> tuple[list, list]:
                down, over, last = [], [], None
                while time.monotonic() < end:
                    stats = await stub.GetServerStats(pb.GetServerStatsRequest())
                    now = {k: getattr(stats, k) for k in keys}
                    if now["requests_finished"] + now["requests_cancelled"] > \
                            now["requests_admitted"]:
                        over.append(now)
                    down += [(k, last[k], now[k]) for k in keys if last and now[k] < last[k]]
                    last = now
                return down, over
            (down, over), *_ = await asyncio.gather(poll(), *map(stop_strings, range(6)))
            await asyncio.sleep(1.0)  # at rest
            stats = await stub.GetServerStats(pb.GetServerStatsRequest())
            return down, over, {k: getattr(stats, k) for k in keys}

    serve = Serve(checkpoints["llama"], tmp_path)
    try:
        down, over, rest = asyncio.run(load(serve.target))
    finally:
        assert serve.stop() == 0
    assert down == [] and over == [], (down[:5], over[:5])
    assert rest["requests_cancelled"] == own_cancels, rest
    assert rest["requests_finished"] + own_cancels == rest["requests_admitted"], rest
