"""`blink bench`: a closed-loop load generator against a running server.

N concurrent clients each send requests back to back (random token prompts of a given length,
greedy, a fixed number of generated tokens with EOS ignored) for a number of requests, then it
prints time to first token and per-token latency percentiles and total generated throughput.
"""
from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass

from blink.client.sdk import AsyncBlinkClient, Sampling


@dataclass
class BenchResult:
    requests: int
    wall_s: float
    generated_tokens: int
    ttft_s: list[float]
    tpot_s: list[float]   # per request: (total - ttft) / (tokens - 1)

    def summary(self) -> str:
        def pct(xs, q):
            return statistics.quantiles(xs, n=100)[q - 1] if len(xs) > 1 else xs[0]
        return (f"{self.requests} requests in {self.wall_s:.2f} s: "
                f"{self.generated_tokens / self.wall_s:.1f} generated tokens/s; "
                f"TTFT p50 {pct(self.ttft_s, 50) * 1e3:.1f} ms p99 {pct(self.ttft_s, 99) * 1e3:.1f} ms; "
                f"time per output token p50 {pct(self.tpot_s, 50) * 1e3:.2f} ms "
                f"p99 {pct(self.tpot_s, 99) * 1e3:.2f} ms")


async def run_bench(target: str, *, concurrency: int, requests: int, prompt_tokens: int,
                    output_tokens: int, seed: int = 0) -> BenchResult:
    rnd = random.Random(seed)
    async with AsyncBlinkClient(target) as client:
        info = await client.model_info()
        # ids from the middle of the vocabulary: ordinary tokens, no special ones
        lo, hi = min(256, info.vocab_size // 4), info.vocab_size - 1
        prompts = [[rnd.randrange(lo, hi) for _ in range(prompt_tokens)] for _ in range(requests)]
        sampling = Sampling(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)
        queue = list(range(requests))
        done = []

        async def worker():
            while queue:
                i = queue.pop()
                done.append(await client.generate(prompts[i], sampling, timeout=600))

        await client.generate(prompts[0], Sampling(max_tokens=2, temperature=0.0))  # warm up
        t0 = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.monotonic() - t0
    return BenchResult(
        requests=requests, wall_s=wall,
        generated_tokens=sum(c.completion_tokens for c in done),
        ttft_s=[c.time_to_first_token_s for c in done],
        tpot_s=[(c.total_s - c.time_to_first_token_s) / max(1, c.completion_tokens - 1)
                for c in done])
