"""The benchmark's load: requests sent over gRPC on an arrival schedule, every token timed at
the client as its chunk of the stream arrives.

Open loop: arrivals at --request-rate per second, gaps drawn from a gamma distribution of shape
--burstiness (1: a Poisson process; below 1 burstier, above 1 steadier), the same schedule for
every system under the same seed; rate inf sends everything at once. --concurrency caps the
requests in flight (with rate inf: a closed loop of that many clients, each sending its next
request when the last one finished).
"""
from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from blink.client.bench_data import BenchRequest
from blink.client.sdk import AsyncBlinkClient, BlinkError, Sampling


def arrival_offsets(n: int, rate: float, burstiness: float = 1.0,
                    seed: int = 0) -> np.ndarray:
    """Seconds from the start at which each of n requests is sent: cumulative gamma gaps of
    mean 1 / rate and shape `burstiness` (coefficient of variation 1 / sqrt(burstiness))."""
    if math.isinf(rate):
        return np.zeros(n)
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate * burstiness), n)
    return np.cumsum(gaps) - gaps[0]  # the first request at 0


@dataclass
class RequestRecord:
    """What the client saw of one request (times: time.perf_counter seconds)."""
    prompt_len: int
    output_len: int                  # asked for (max_tokens)
    sent: float = 0.0
    token_times: list[float] = field(default_factory=list)  # one per token, its chunk's arrival
    error: str | None = None
    finish_reason: str = ""

    @property
    def tokens(self) -> int:
        return len(self.token_times)


@dataclass
class ClientLoad:
    """The client's own CPU use over a run, to tell when the client was the bottleneck."""
    process_cpu_s: float   # all of this process's threads (gRPC's included)
    loop_cpu_s: float      # the asyncio event loop's thread alone
    wall_s: float

    @property
    def loop_busy(self) -> float:
        return self.loop_cpu_s / self.wall_s if self.wall_s else 0.0


async def run_requests(target: str, requests: list[BenchRequest], *, rate: float = math.inf,
                       burstiness: float = 1.0, concurrency: int | None = None,
                       ignore_eos: bool = True, seed: int = 0, timeout: float = 3600.0,
                       connections: int = 1, run_timeout: float | None = None,
                       on_done: Callable[[RequestRecord], None] | None = None
                       ) -> tuple[list[RequestRecord], float, ClientLoad]:
    """Sends every request (greedy, max_tokens = its output length) on the schedule, round
    robin over `connections` TCP connections (a server with several front-end workers on one
    port gets connections, not requests, spread over them); returns the records in request
    order, the wall time from the first send to the last token, and the client's CPU use. A
    failed request keeps its error and does not stop the others. run_timeout: seconds after
    which requests not yet finished (or sent) are cancelled and recorded as failed."""
    offsets = arrival_offsets(len(requests), rate, burstiness, seed)
    records = [RequestRecord(len(r.prompt), r.output_len) for r in requests]
    gate = asyncio.Semaphore(concurrency) if concurrency else None
    # gRPC shares one connection among a process's channels to a target unless told not to
    clients = [AsyncBlinkClient(target, options=[("grpc.use_local_subchannel_pool", 1)])
               for _ in range(max(1, connections))]
    try:
        async def one(i: int, request: BenchRequest, record: RequestRecord) -> None:
            client = clients[i % len(clients)]
            sampling = Sampling(max_tokens=request.output_len, temperature=0.0,
                                ignore_eos=ignore_eos)
            record.sent = time.perf_counter()
            try:
                stream = client.stream(list(request.prompt), sampling, timeout=timeout,
                                       return_token_ids=True)
                async for delta in stream:
                    now = time.perf_counter()
                    record.token_times.extend([now] * len(delta.token_ids))
                record.finish_reason = stream.result.finish_reason if stream.result else ""
            except BlinkError as e:
                record.error = str(e)
            if on_done is not None:
                on_done(record)

        async def gated(i: int, request: BenchRequest, record: RequestRecord) -> None:
            if gate is None:
                return await one(i, request, record)
            async with gate:
                await one(i, request, record)

        async def send_all() -> None:
            tasks = []
            try:
                for i, (request, record, offset) in enumerate(zip(requests, records, offsets)):
                    delay = start + offset - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    tasks.append(asyncio.ensure_future(gated(i, request, record)))
                await asyncio.gather(*tasks)
            except asyncio.CancelledError:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise

        loop_cpu0 = time.thread_time()
        cpu0, start = time.process_time(), time.perf_counter()
        try:
            await asyncio.wait_for(send_all(), run_timeout)
        except asyncio.TimeoutError:
            for record in records:
                if record.error is None and (not record.token_times
                                             or record.finish_reason == ""):
                    record.error = f"cut by the run time limit ({run_timeout:g} s)"
        load = ClientLoad(time.process_time() - cpu0, time.thread_time() - loop_cpu0,
                          time.perf_counter() - start)
    finally:
        for client in clients:
            await client.close()
    ends = [r.token_times[-1] for r in records if r.token_times]
    wall = (max(ends) if ends else time.perf_counter()) - start
    return records, wall, load
