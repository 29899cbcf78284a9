"""The benchmark's load: requests sent over gRPC on an arrival schedule, every token timed at
the client as its chunk of the stream arrives.

Open loop: arrivals at --request-rate per second, gaps drawn from a gamma distribution of shape
--burstiness (1: a Poisson process; below 1 burstier, above 1 steadier), the same schedule for
every system under the same seed; rate inf sends everything at once. --concurrency caps the
requests in flight (with rate inf: a closed loop of that many clients, each sending its next
request when the last one finished).

Every connection is open before the clock starts (open_connections): a connection's set-up
(TCP, HTTP/2) is not part of the first request's time to first token.

One Python client process takes roughly 10 us of CPU per streamed token, so past about 80,000
tokens/s the client, not the server, would set the pace: `run_in_processes` spreads the requests
over several client processes (each its own event loop and connections) that keep one common
arrival schedule, and merges what they saw.
"""
from __future__ import annotations

import asyncio
import math
import multiprocessing
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from blink.client.bench_data import BenchRequest
from blink.client.sdk import AsyncBlinkClient, BlinkError, Sampling

RUN_TIME_LIMIT = "cut by the run time limit"  # the error of a request --run-timeout cut


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
    cached_prompt_tokens: int = 0    # taken from the engine's prefix cache (its final's timings)
    # the server's own TTFT (its final's timings): from the front end's receipt of the request
    # to its first token read from the ring, so TTFT minus this is gRPC's and the client's share
    server_ttft_s: float = 0.0

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


async def stream_request(client: AsyncBlinkClient, request: BenchRequest,
                         record: RequestRecord, *, timeout: float = 3600.0,
                         ignore_eos: bool = True, cache_salt: str = "") -> list[int]:
    """Sends one request (greedy, max_tokens = its output length; under cache_salt, the
    server's prefix-cache namespace) and times its tokens into `record`; returns the
    generated token ids. A failure is kept in record.error."""
    sampling = Sampling(max_tokens=request.output_len, temperature=0.0, ignore_eos=ignore_eos)
    token_ids: list[int] = []
    record.sent = time.perf_counter()
    try:
        stream = client.stream(list(request.prompt), sampling, timeout=timeout,
                               return_token_ids=True, cache_salt=cache_salt)
        async for delta in stream:
            now = time.perf_counter()
            record.token_times.extend([now] * len(delta.token_ids))
            token_ids.extend(delta.token_ids)
        if stream.result is not None:
            record.finish_reason = stream.result.finish_reason
            record.cached_prompt_tokens = stream.result.cached_prompt_tokens
            record.server_ttft_s = stream.result.time_to_first_token_s
        if stream.result is not None and stream.result.completion_tokens != len(token_ids):
            # the metrics count the streamed tokens: they must be the ones the server counts
            record.error = (f"the server's usage counts {stream.result.completion_tokens} "
                            f"generated tokens, its stream carried {len(token_ids)}")
    except BlinkError as e:
        record.error = str(e)
    return token_ids


async def open_connections(clients: list[AsyncBlinkClient]) -> None:
    """Opens each client's connection with one health check, whatever its answer (a server
    without the health service, as bench_grpc_floor's, answers UNIMPLEMENTED over an open
    connection; a server that is down fails the requests themselves, each recorded)."""
    async def open_one(client: AsyncBlinkClient) -> None:
        try:
            await client.health(timeout=30)
        except BlinkError:
            pass
    await asyncio.gather(*(open_one(client) for client in clients))


async def run_requests(target: str, requests: list[BenchRequest], *, rate: float = math.inf,
                       burstiness: float = 1.0, concurrency: int | None = None,
                       ignore_eos: bool = True, seed: int = 0, timeout: float = 3600.0,
                       connections: int = 1, run_timeout: float | None = None,
                       on_done: Callable[[RequestRecord], None] | None = None,
                       offsets: np.ndarray | None = None,
                       synchronise: Callable[[], float] | None = None,
                       claim: Callable[[], int] | None = None, cache_salt: str = ""
                       ) -> tuple[list[RequestRecord], float, ClientLoad]:
    """Sends every request (greedy, max_tokens = its output length) on the schedule, round
    robin over `connections` TCP connections (a server with several front-end workers on one
    port gets connections, not requests, spread over them); returns the records in request
    order, the wall time from the first send to the last token, and the client's CPU use. A
    failed request keeps its error and does not stop the others. run_timeout: seconds after
    which requests not yet finished (or sent) are cancelled and recorded as failed.
    offsets: this process's share of a schedule drawn elsewhere (run_in_processes);
    synchronise: called in a thread once the connections are open, returns the perf_counter
    time the offsets count from (run_in_processes: the processes' common start). claim (with
    concurrency): the index of the next request to send, from a counter several processes
    share, so that their `concurrency` workers together are one closed loop over the whole
    list (the records of requests another process claimed stay unsent here). cache_salt:
    every request's (stream_request)."""
    if offsets is None:
        offsets = arrival_offsets(len(requests), rate, burstiness, seed)
    records = [RequestRecord(len(r.prompt), r.output_len) for r in requests]
    gate = asyncio.Semaphore(concurrency) if concurrency else None
    # gRPC shares one connection among a process's channels to a target unless told not to
    clients = [AsyncBlinkClient(target, options=[("grpc.use_local_subchannel_pool", 1)])
               for _ in range(max(1, connections))]
    try:
        async def one(i: int, request: BenchRequest, record: RequestRecord) -> None:
            await stream_request(clients[i % len(clients)], request, record, timeout=timeout,
                                 ignore_eos=ignore_eos, cache_salt=cache_salt)
            if on_done is not None:
                on_done(record)

        async def gated(i: int, request: BenchRequest, record: RequestRecord) -> None:
            if gate is None:
                return await one(i, request, record)
            async with gate:
                await one(i, request, record)

        async def claimed_loop() -> None:  # a client of the shared closed loop
            while (i := claim()) < len(requests):
                delay = start + offsets[i] - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                await one(i, requests[i], records[i])

        async def send_all() -> None:
            tasks = []
            try:
                if claim is not None:
                    tasks = [asyncio.ensure_future(claimed_loop()) for _ in range(concurrency)]
                for i, (request, record, offset) in enumerate(
                        zip(requests, records, offsets) if claim is None else ()):
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

        await open_connections(clients)  # before the clock: no request's TTFT holds it
        start = await asyncio.to_thread(synchronise) if synchronise else time.perf_counter()
        loop_cpu0, cpu0 = time.thread_time(), time.process_time()
        try:
            await asyncio.wait_for(send_all(), run_timeout)
        except asyncio.TimeoutError:
            for record in records:
                if record.error is None and (not record.token_times
                                             or record.finish_reason == ""):
                    record.error = f"{RUN_TIME_LIMIT} ({run_timeout:g} s)"
        load = ClientLoad(time.process_time() - cpu0, time.thread_time() - loop_cpu0,
                          time.perf_counter() - start)
    finally:
        for client in clients:
            await client.close()
    ends = [r.token_times[-1] for r in records if r.token_times]
    wall = (max(ends) if ends else time.perf_counter()) - start
    return records, wall, load


async def run_conversations(target: str, user_turns: list[list[tuple[int, ...]]],
                            output_len: int, *, timeout: float = 3600.0
                            ) -> tuple[list[list[RequestRecord]], float]:
    """Multi-turn chats, all started at once, each a closed loop: every turn sends the whole
    conversation so far (the previous turn's prompt, the reply generated to it, then the user's
    next message) and waits for its reply of output_len tokens before the next. Returns each
    conversation's records turn by turn (a failed turn ends its conversation) and the wall time
    from the first send to the last token."""
    async with AsyncBlinkClient(target) as client:
        await open_connections([client])

        async def converse(messages: list[tuple[int, ...]]) -> list[RequestRecord]:
            records: list[RequestRecord] = []
            prompt: tuple[int, ...] = ()
            reply: tuple[int, ...] = ()
            for message in messages:
                prompt = prompt + reply + message
                records.append(RequestRecord(len(prompt), output_len))
                reply = tuple(await stream_request(client, BenchRequest(prompt, output_len),
                                                   records[-1], timeout=timeout))
                if records[-1].error is not None:
                    break
            return records

        start = time.perf_counter()
        conversations = await asyncio.gather(*(converse(m) for m in user_turns))
    ends = [r.token_times[-1] for c in conversations for r in c if r.token_times]
    return conversations, (max(ends) if ends else time.perf_counter()) - start


def _client_process(requests: list[BenchRequest], offsets: np.ndarray, options: dict,
                    ready, go, start, results, index: int, processes: int, counter) -> None:
    """One client process of run_in_processes: waits for the common start, runs its share:
    with a concurrency cap, the requests it claims from the shared counter; otherwise every
    processes-th one from its index, once its connections are open. Puts (its index,
    [(request index, record)], its load)."""
    def synchronise() -> float:  # every process connected: the common start
        ready.wait()
        go.wait()
        return start.value

    try:
        claimed: list[int] = []

        def claim() -> int:
            with counter.get_lock():
                i, counter.value = counter.value, counter.value + 1
            if i < len(requests):
                claimed.append(i)
            return i

        if options["concurrency"] is None:  # open loop: a fixed share of the schedule
            claimed = list(range(index, len(requests), processes))
            requests, offsets = requests[index::processes], offsets[index::processes]
        records, _, load = asyncio.run(run_requests(
            options.pop("target"), requests, offsets=offsets, synchronise=synchronise,
            claim=None if options["concurrency"] is None else claim, **options))
        mine = records if options["concurrency"] is None else [records[i] for i in claimed]
        results.put((index, list(zip(claimed, mine)), load))
    except BaseException as e:  # the parent reports it; a silent child would hang the run
        results.put((index, None, f"{type(e).__name__}: {e}"))
        ready.abort()  # a parent still waiting for every process to connect stops waiting


def run_in_processes(processes: int, target: str, requests: list[BenchRequest], *,
                     rate: float = math.inf, burstiness: float = 1.0,
                     concurrency: int | None = None, seed: int = 0, connections: int = 1,
                     **options) -> tuple[list[RequestRecord], float, ClientLoad]:
    """run_requests spread over `processes` client processes on the one arrival schedule, the
    records back in request order. Open loop, request i goes to process i % processes; with a
    concurrency cap, the cap is shared out and each process's clients take the next request of
    the whole list when they are free (a shared counter), so the processes together stay one
    closed loop of `concurrency` to the end. Connections are shared out. The merged ClientLoad
    sums the processes' CPU and keeps the busiest event loop's (what tells a saturated client)."""
    # no process without a request, or without a share of the concurrency cap
    processes = max(1, min(processes, len(requests), concurrency or processes))
    on_done = options.pop("on_done", None)  # called here: a callback does not cross processes
    if processes == 1:
        return asyncio.run(run_requests(target, requests, rate=rate, burstiness=burstiness,
                                        concurrency=concurrency, seed=seed,
                                        connections=connections, on_done=on_done, **options))
    offsets = arrival_offsets(len(requests), rate, burstiness, seed)
    ctx = multiprocessing.get_context("spawn")  # no copy of the parent's gRPC state
    ready, go = ctx.Barrier(processes + 1), ctx.Event()
    start, results, counter = ctx.Value("d", 0.0), ctx.Queue(), ctx.Value("q", 0)
    workers = []
    for k in range(processes):
        share = dict(options, target=target,
                     connections=max(1, -(-connections // processes)),
                     concurrency=(concurrency // processes + (k < concurrency % processes)
                                  if concurrency else None))
        workers.append(ctx.Process(target=_client_process, daemon=True, args=(
            requests, offsets, share, ready, go, start, results, k, processes, counter)))
    for worker in workers:
        worker.start()
    shares = {}
    try:
        ready.wait(timeout=120)        # every process has connected and is waiting
        start.value = time.perf_counter() + 0.05  # CLOCK_MONOTONIC: one clock for all
        go.set()
        while len(shares) < processes:
            try:
                index, records, load = results.get(timeout=1.0)
            except queue.Empty:
                dead = [w.exitcode for w in workers if w.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"a client process died (exit code {dead[0]})")
                continue
            if records is None:
                raise RuntimeError(f"client process {index}: {load}")
            shares[index] = (records, load)
    except threading.BrokenBarrierError:
        try:  # a process that failed before it connected says why
            index, _, why = results.get(timeout=1.0)
        except queue.Empty:
            raise RuntimeError("the client processes did not start within 120 s") from None
        raise RuntimeError(f"client process {index}: {why}") from None
    finally:  # after an error or a signal, no process still sending is waited for
        for worker in workers:
            worker.join(timeout=5 if len(shares) == processes else 0)
            if worker.is_alive():
                worker.kill()
                worker.join()
    records: list[RequestRecord | None] = [None] * len(requests)
    for pairs, _ in shares.values():
        for i, record in pairs:
            records[i] = record
    limit = options.get("run_timeout")
    for i, record in enumerate(records):  # never claimed: the run's time limit came first
        if record is None:
            records[i] = RequestRecord(len(requests[i].prompt), requests[i].output_len,
                                       error=f"{RUN_TIME_LIMIT} ({limit:g} s)"
                                       if limit else "never sent")
    for record in records if on_done else ():
        on_done(record)
    loads = [load for _, load in shares.values()]
    busiest = max(loads, key=lambda load: load.loop_busy)
    ends = [r.token_times[-1] for r in records if r.token_times]
    wall = (max(ends) if ends else time.perf_counter()) - start.value
    return records, wall, ClientLoad(sum(load.process_cpu_s for load in loads),
                                     busiest.loop_cpu_s, busiest.wall_s)
