"""The client SDK against a real gRPC server on localhost that runs a scripted fake servicer,
then against a real Blink server (engine and front end processes, the synthetic engine).

The prompt text picks the fake's script: "bad" is rejected, "fail-mid" fails after one chunk,
"no-final" ends without a final message, "slow" streams two chunks and then waits for the client
to go away (so deadlines and cancellation can be observed on the server), anything else streams
CHUNKS and a final.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import os
import pickle
import socket
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from blink.client.sdk import (
    HEALTH_SERVICE,
    SESSION_HEADER,
    AsyncBlinkClient,
    BlinkClient,
    BlinkError,
    Completion,
    Delta,
    Sampling,
    build_request,
)
from blink.v1 import blink_pb2, blink_pb2_grpc

CHUNKS = [("Hel", [10]), ("lo", [11]), (" wor", [12, 13]), ("ld", [14])]
FINAL = blink_pb2.Final(
    finish_reason=blink_pb2.FINISH_REASON_STOP,
    matched_stop="\n",
    usage=blink_pb2.Usage(prompt_tokens=3, completion_tokens=5),
    timings=blink_pb2.Timings(time_to_first_token_s=0.25, total_s=1.5, preemptions=1,
                              cached_prompt_tokens=2),
    request_id="req-7",
)
MODEL = blink_pb2.ModelInfo(
    name="tiny", architecture="LlamaForCausalLM", context_length=2048, vocab_size=32000,
    eos_token_ids=[2, 32001], has_chat_template=True, engine="cpu-reference",
)
BIG_COUNTER = 2**40  # a uint64 that must stay an int in stats()
SLOW_WAIT_S = 5.0  # how long the slow script waits for the client to leave before finishing


def _chunk(text: str, ids: list[int]) -> blink_pb2.GenerateResponse:
    return blink_pb2.GenerateResponse(chunk=blink_pb2.Chunk(text=text, token_ids=ids))


class FakeBlink(blink_pb2_grpc.BlinkServicer):
    def __init__(self) -> None:
        self.requests: list[blink_pb2.GenerateRequest] = []
        self.metadata: list[dict[str, str]] = []  # each Generate call's
        self.streaming = threading.Event()  # the slow script has sent its chunks
        self.cancelled = threading.Event()  # a slow call ended before its final

    def Generate(self, request, context):
        self.requests.append(request)
        self.metadata.append(dict(context.invocation_metadata()))
        script = request.text if request.WhichOneof("prompt") == "text" else ""
        if script == "bad":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty")
        if script == "slow":
            yield from self._slow(context)
            return
        for text, ids in CHUNKS:
            yield _chunk(text, ids if request.return_token_ids else [])
            if script == "fail-mid":
                context.abort(grpc.StatusCode.UNAVAILABLE, "engine stopped")
        if script != "no-final":
            yield blink_pb2.GenerateResponse(final=FINAL)

    def _slow(self, context):
        # The callback runs when the call ends for any reason; the script clears `pending` just
        # before sending its final, so pending there means the client left first. (Polling
        # is_active alone misses a cancel that lands during a yield: the server then never
        # resumes this generator.)
        pending = True
        context.add_callback(lambda: pending and self.cancelled.set())
        yield _chunk("a", [])
        yield _chunk("b", [])
        self.streaming.set()
        give_up = time.monotonic() + SLOW_WAIT_S
        while context.is_active() and time.monotonic() < give_up:
            time.sleep(0.005)
        if context.is_active():
            pending = False
            yield blink_pb2.GenerateResponse(final=FINAL)

    def GetModelInfo(self, request, context):
        return MODEL

    def GetServerStats(self, request, context):
        return blink_pb2.ServerStats(engine_alive=True, ring_slots=8, requests_admitted=BIG_COUNTER)


@dataclass
class Server:
    target: str
    fake: FakeBlink
    health: health.HealthServicer


@contextlib.contextmanager
def serve_fake(fake: FakeBlink, health_servicer: health.HealthServicer | None = None):
    """A real gRPC server on a free port serving `fake` (and the health service): yields
    (fake, target)."""
    executor = ThreadPoolExecutor(max_workers=8)
    srv = grpc.server(executor)
    blink_pb2_grpc.add_BlinkServicer_to_server(fake, srv)
    if health_servicer is not None:
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    try:
        yield fake, f"127.0.0.1:{port}"
    finally:
        srv.stop(grace=None)
        executor.shutdown(wait=False)


@pytest.fixture
def server():
    health_servicer = health.HealthServicer()
    health_servicer.set(HEALTH_SERVICE, health_pb2.HealthCheckResponse.SERVING)
    with serve_fake(FakeBlink(), health_servicer) as (fake, target):
        yield Server(target, fake, health_servicer)


@pytest.fixture
def client(server):
    with BlinkClient(server.target) as c:
        yield c


def _check_completion(completion: Completion, token_ids: tuple[int, ...]) -> None:
    assert completion == Completion(
        text="Hello world", token_ids=token_ids, finish_reason="stop", matched_stop="\n",
        prompt_tokens=3, completion_tokens=5, time_to_first_token_s=0.25, total_s=1.5,
        preemptions=1, cached_prompt_tokens=2, request_id="req-7",
    )


# --- request building -----------------------------------------------------------------------


def test_sampling_to_proto_sets_only_given_fields():
    empty = Sampling().to_proto()
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
        assert not empty.HasField(name)
    greedy = Sampling(temperature=0.0, max_tokens=4, stop=("\n",), stop_token_ids=(7,), ignore_eos=True).to_proto()
    assert greedy.HasField("temperature") and greedy.temperature == 0.0
    assert greedy.HasField("max_tokens") and greedy.max_tokens == 4
    assert not greedy.HasField("top_p") and not greedy.HasField("seed")
    assert list(greedy.stop) == ["\n"] and list(greedy.stop_token_ids) == [7] and greedy.ignore_eos


def test_sampling_and_tls_refuse_what_would_go_wrong_later():
    """A stop given as one string is one stop sequence (it became a stop at each of its
    characters); a field protobuf refuses is named; a Tls with a cert and no key, or a key and
    no cert, is a ValueError (gRPC's core aborted the whole process on it)."""
    from blink.client.sdk import Tls
    assert list(Sampling(stop="\n\n").to_proto().stop) == ["\n\n"]
    assert Sampling(stop=["a", "b"]).stop == ("a", "b")
    with pytest.raises(ValueError, match="max_tokens"):
        Sampling(max_tokens=-1).to_proto()
    for half in (dict(cert=b"pem"), dict(key=b"pem"), dict(ca=b"pem", cert=b"pem")):
        with pytest.raises(ValueError, match="cert and key go together"):
            Tls(**half)
    Tls(ca=b"pem")  # server authentication alone


def test_build_request_rejects_mixed_or_odd_prompts():
    with pytest.raises(TypeError):
        build_request([1, {"role": "user", "content": "x"}])
    with pytest.raises(TypeError):
        build_request(b"bytes")
    with pytest.raises(ValueError, match="role"):
        build_request([{"content": "no role"}])
    # An empty token list still selects the oneof, so the server can say the prompt is empty.
    assert build_request([]).WhichOneof("prompt") == "token_ids"
    with pytest.raises(TypeError, match="only token ids"):
        build_request([1, 2.0])
    for ids in ([1, -1], [5, 2**32]):
        with pytest.raises(ValueError, match="uint32"):
            build_request(ids)
    # the type error first where a sequence mixes an id out of range with a string
    with pytest.raises(TypeError, match="only token ids"):
        build_request([2**32, "a"])
    # a bool is no token id: protobuf only warns on one (until it refuses them; it sent 1),
    # so the SDK refuses it whatever the program's warning filters say
    import numpy as np
    for filters in ("ignore", "always", "error"):
        with warnings.catch_warnings():
            warnings.simplefilter(filters)
            for prompt in ([True, 5], [3, False], np.array([True, False])):
                with pytest.raises(TypeError, match="only token ids"):
                    build_request(prompt)


def test_build_request_takes_any_integers_as_token_ids():
    import numpy as np
    for prompt in ([3, 7], (3, 7), range(3, 8, 4), np.array([3, 7]), [np.uint32(3), True + 6]):
        request = build_request(prompt)
        assert request.WhichOneof("prompt") == "token_ids"
        assert list(request.token_ids.ids) == [3, 7]


@pytest.mark.parametrize(
    "prompt, oneof",
    [
        ("hello", "text"),
        ([1, 2, 3], "token_ids"),
        ((5,), "token_ids"),
        ([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}], "messages"),
    ],
)
def test_prompt_kinds_reach_the_server_in_the_right_oneof(server, client, prompt, oneof):
    client.generate(prompt, Sampling(temperature=0.0), model="tiny")
    request = server.fake.requests[-1]
    assert request.WhichOneof("prompt") == oneof
    assert request.model == "tiny"
    assert request.sampling.HasField("temperature") and not request.sampling.HasField("top_k")
    if oneof == "text":
        assert request.text == prompt
    elif oneof == "token_ids":
        assert list(request.token_ids.ids) == list(prompt)
    else:
        assert [(m.role, m.content) for m in request.messages.messages] == [
            (m["role"], m["content"]) for m in prompt
        ]


def test_cache_salt_session_and_token_reach_the_server(server, client):
    """cache_salt rides in the request; with_session and with_token in each call's metadata,
    on copies that leave the client they came from as it was."""
    client.generate("hello", cache_salt="tenant-1")
    assert server.fake.requests[-1].cache_salt == "tenant-1"
    assert SESSION_HEADER not in server.fake.metadata[-1]
    session = client.with_session("conv-7")
    session.generate("hello")
    assert server.fake.requests[-1].cache_salt == ""
    assert server.fake.metadata[-1][SESSION_HEADER] == "conv-7"
    both = session.with_token("secret")
    both.generate("hello")
    assert server.fake.metadata[-1][SESSION_HEADER] == "conv-7"
    assert server.fake.metadata[-1]["authorization"] == "Bearer secret"
    both.with_session(None).generate("hello")
    assert SESSION_HEADER not in server.fake.metadata[-1]
    assert server.fake.metadata[-1]["authorization"] == "Bearer secret"
    session.generate("hello")  # (with_token left the copy it came from as it was)
    assert "authorization" not in server.fake.metadata[-1]
    client.generate("hello")
    assert not {SESSION_HEADER, "authorization"} & set(server.fake.metadata[-1])
    for bad in ("ünï", "a\nb"):  # gRPC metadata is printable ASCII
        with pytest.raises(ValueError, match="printable ASCII"):
            client.with_session(bad)


def test_no_sampling_leaves_the_field_unset(server, client):
    client.generate("hello")
    assert not server.fake.requests[-1].HasField("sampling")


# --- sync client ----------------------------------------------------------------------------


def test_sync_stream_deltas_then_completion(client):
    stream = client.stream("hello", return_token_ids=True)
    assert stream.result is None
    deltas = list(stream)
    assert deltas == [Delta(text, tuple(ids)) for text, ids in CHUNKS]
    _check_completion(stream.result, (10, 11, 12, 13, 14))


def test_sync_generate(client):
    _check_completion(client.generate("hello"), ())


def test_sync_model_info_and_stats(client):
    info = client.model_info()
    assert info.name == "tiny" and info.eos_token_ids == (2, 32001) and info.has_chat_template
    stats = client.stats()
    assert stats["engine_alive"] is True and stats["ring_slots"] == 8
    assert stats["requests_admitted"] == BIG_COUNTER and stats["kv_blocks_free"] == 0


def test_the_caller_s_channel_options_win_over_the_sdk_s(server):
    """A channel option the caller gives replaces the SDK's own for the same key (gRPC keeps
    the first of a repeated key: the SDK's came first, and the caller's were ignored)."""
    small = [("grpc.max_receive_message_length", 10)]
    with BlinkClient(server.target, options=small) as client, pytest.raises(BlinkError) as err:
        client.model_info()
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED

    async def async_info():
        async with AsyncBlinkClient(server.target, options=small) as client:
            await client.model_info()
    with pytest.raises(BlinkError) as err:
        asyncio.run(async_info())
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_invalid_argument_becomes_blink_error(client):
    with pytest.raises(BlinkError) as err:
        client.generate("bad")
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details == "prompt is empty"
    assert str(err.value) == "INVALID_ARGUMENT: prompt is empty"
    assert pickle.loads(pickle.dumps(err.value)).code == grpc.StatusCode.INVALID_ARGUMENT


def test_error_mid_stream_becomes_blink_error(client):
    stream = client.stream("fail-mid")
    assert next(stream).text == "Hel"
    with pytest.raises(BlinkError) as err:
        next(stream)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE and err.value.details == "engine stopped"


def test_stream_without_final_is_an_error(client):
    with pytest.raises(BlinkError, match="without a final message") as err:
        client.generate("no-final")
    assert err.value.code == grpc.StatusCode.UNKNOWN


def test_sync_deadline_cancels_in_server(server, client):
    start = time.monotonic()
    with pytest.raises(BlinkError) as err:
        client.generate("slow", timeout=0.3)
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - start < SLOW_WAIT_S / 2
    assert server.fake.cancelled.wait(2)


def test_sync_cancel_mid_stream(server, client):
    stream = client.stream("slow")
    assert next(stream).text == "a"
    stream.cancel()
    assert list(stream) in ([], [Delta("b", ())])  # "b" may already be buffered
    assert stream.result is None
    assert server.fake.cancelled.wait(2)


def test_sync_stream_dropped_early_cancels(server, client):
    stream = client.stream("slow")
    next(stream)
    del stream
    gc.collect()
    assert server.fake.cancelled.wait(2)


def test_sync_health_and_wait_ready(server, client):
    assert client.health() == "SERVING"
    client.wait_ready(1)
    server.health.set(HEALTH_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
    assert client.health() == "NOT_SERVING"
    with pytest.raises(BlinkError, match="NOT_SERVING") as err:
        client.wait_ready(0.3)
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    timer = threading.Timer(0.2, server.health.set, (HEALTH_SERVICE, health_pb2.HealthCheckResponse.SERVING))
    timer.start()
    client.wait_ready(3)
    timer.join()


def test_wait_ready_without_a_server():
    with socket.socket() as s:  # a port that nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with BlinkClient(f"127.0.0.1:{port}") as c:
        with pytest.raises(BlinkError, match="UNAVAILABLE"):
            c.wait_ready(0.3)


# --- async client ---------------------------------------------------------------------------


def test_async_stream_generate_and_unary(server):
    async def main():
        async with AsyncBlinkClient(server.target) as c:
            stream = c.stream("hello", return_token_ids=True)
            assert stream.result is None
            deltas = [d async for d in stream]
            assert deltas == [Delta(text, tuple(ids)) for text, ids in CHUNKS]
            _check_completion(stream.result, (10, 11, 12, 13, 14))
            _check_completion(await c.generate([1, 2]), ())
            assert server.fake.requests[-1].WhichOneof("prompt") == "token_ids"
            assert (await c.model_info()).vocab_size == 32000
            assert (await c.stats())["requests_admitted"] == BIG_COUNTER
            assert await c.health() == "SERVING"
            await c.wait_ready(1)

    asyncio.run(main())


def test_async_errors(server):
    async def main():
        async with AsyncBlinkClient(server.target) as c:
            with pytest.raises(BlinkError) as err:
                await c.generate("bad")
            assert str(err.value) == "INVALID_ARGUMENT: prompt is empty"
            stream = c.stream("fail-mid")
            assert (await anext(stream)).text == "Hel"
            with pytest.raises(BlinkError, match="UNAVAILABLE: engine stopped"):
                await anext(stream)
            with pytest.raises(BlinkError, match="without a final message"):
                await c.generate("no-final")

    asyncio.run(main())


def test_async_deadline_cancels_in_server(server):
    async def main():
        async with AsyncBlinkClient(server.target) as c:
            with pytest.raises(BlinkError) as err:
                await c.generate("slow", timeout=0.3)
            assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED

    asyncio.run(main())
    assert server.fake.cancelled.wait(2)


def test_async_cancel_mid_stream(server):
    async def main():
        async with AsyncBlinkClient(server.target) as c:
            stream = c.stream("slow")
            assert (await anext(stream)).text == "a"
            stream.cancel()
            assert [d async for d in stream] in ([], [Delta("b", ())])
            assert stream.result is None
            # Checked while the channel is open, so it is the cancel and not the close.
            assert await asyncio.to_thread(server.fake.cancelled.wait, 2)

    asyncio.run(main())


def test_async_task_cancel_cancels_in_server(server):
    async def main():
        async with AsyncBlinkClient(server.target) as c:
            task = asyncio.create_task(c.generate("slow"))
            assert await asyncio.to_thread(server.fake.streaming.wait, 2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await asyncio.to_thread(server.fake.cancelled.wait, 2)

    asyncio.run(main())


def test_async_health_wait_ready(server):
    async def main():
        async with AsyncBlinkClient(server.target) as c:
            server.health.set(HEALTH_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
            with pytest.raises(BlinkError, match="NOT_SERVING"):
                await c.wait_ready(0.3)
            asyncio.get_running_loop().call_later(
                0.2, server.health.set, HEALTH_SERVICE, health_pb2.HealthCheckResponse.SERVING
            )
            await c.wait_ready(3)

    asyncio.run(main())


def test_async_stream_dropped_early_cancels(server):
    async def main():
        async with AsyncBlinkClient(server.target) as c:
            stream = c.stream("slow")
            await anext(stream)
            del stream
            gc.collect()
            assert await asyncio.to_thread(server.fake.cancelled.wait, 2)

    asyncio.run(main())


# --- against a real server ------------------------------------------------------------------
# `blink engine --engine synthetic` (a token every STEP_MS, so a LONG stream runs for minutes
# unless the server cancels it) behind `blink frontend` on a free port, serving conftest's
# long_checkpoint (a tiny random Llama with a 16,384-token context).

STEP_MS = "20"
LONG = Sampling(max_tokens=10_000, ignore_eos=True)
SHORT = Sampling(max_tokens=3, ignore_eos=True)


def synthetic_stack(model_dir, workdir, frontend_args=()):
    """A started BlinkStack (tests/conftest.py) on the synthetic engine; the caller stops it."""
    from conftest import BlinkStack
    stack = BlinkStack(model_dir, workdir, ["--engine", "synthetic", "--synthetic-step-ms",
                                            STEP_MS, "--slots", "4"], frontend_args)
    stack.start_engine()
    stack.start_frontend()
    stack.wait_serving()
    return stack


@pytest.fixture(scope="module")
def real(long_checkpoint, tmp_path_factory):
    stack = synthetic_stack(long_checkpoint, tmp_path_factory.mktemp("sdk"))
    yield stack
    stack.stop()


@pytest.fixture
def real_client(real):
    with BlinkClient(real.target) as c:
        yield c


def assert_cancelled_in_server(client: BlinkClient, cancelled_before: int) -> None:
    """Every slot free again, the abandoned stream counted as cancelled: the server stopped
    generating for it (a slot held until max_tokens would take minutes here)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        stats = client.stats()
        if (stats["ring_slots_in_use"], stats["requests_cancelled"]) == (0, cancelled_before + 1):
            return
        time.sleep(0.02)
    pytest.fail(f"not cancelled in the server: {client.stats()}")


def _abandon_by_break(client, target):
    for _ in client.stream("hi", LONG):
        break


def _abandon_by_gc(client, target):
    stream = client.stream("hi", LONG)
    next(stream)
    del stream
    gc.collect()


def _abandon_by_exception(client, target):
    with contextlib.suppress(KeyError):
        for _ in client.stream("hi", LONG):
            raise KeyError("the caller's own error")


def _abandon_by_closing_the_client(client, target):
    with BlinkClient(target) as other:
        stream = other.stream("hi", LONG)
        next(stream)
    # the stream is still referenced: it is the close that cancels it, and says so
    with pytest.raises(BlinkError, match="CANCELLED: the client was closed") as err:
        list(stream)
    assert err.value.code == grpc.StatusCode.CANCELLED


@pytest.mark.parametrize("abandon", [_abandon_by_break, _abandon_by_gc, _abandon_by_exception,
                                     _abandon_by_closing_the_client])
def test_abandoned_sync_stream_is_cancelled_in_the_server(real, real_client, abandon):
    before = real_client.stats()["requests_cancelled"]
    abandon(real_client, real.target)
    assert_cancelled_in_server(real_client, before)


async def _abandon_async(way: str, client: AsyncBlinkClient, target: str) -> None:
    if way == "break":
        async for _ in client.stream("hi", LONG):
            break
    elif way == "exception":
        with contextlib.suppress(KeyError):
            async for _ in client.stream("hi", LONG):
                raise KeyError("the caller's own error")
    elif way == "task.cancel":
        task = asyncio.create_task(client.generate("hi", LONG))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    elif way == "wait_for":
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(client.generate("hi", LONG), 0.2)
    else:  # the client closed while another task reads the stream: that task is not cancelled
        other = AsyncBlinkClient(target)
        stream = other.stream("hi", LONG)
        await anext(stream)

        async def read_all():
            return [d async for d in stream]
        reader = asyncio.create_task(read_all())
        await asyncio.sleep(0.1)
        await other.close()
        with pytest.raises(BlinkError, match="CANCELLED: the client was closed"):
            await reader  # (it raised CancelledError, as if the reader had been cancelled)


@pytest.mark.parametrize("way", ["break", "exception", "task.cancel", "wait_for", "close"])
def test_abandoned_async_stream_is_cancelled_in_the_server(real, real_client, way):
    before = real_client.stats()["requests_cancelled"]

    async def main():
        async with AsyncBlinkClient(real.target) as c:
            await _abandon_async(way, c, real.target)
            # checked while this client is open: the abandoning, not a close, cancelled it
            await asyncio.to_thread(assert_cancelled_in_server, real_client, before)

    asyncio.run(main())


def test_call_timeouts_are_seconds_or_none(real, real_client):
    """inf or a deadline too far for gRPC (which failed the call DEADLINE_EXCEEDED at once) is no
    deadline; 0, a negative or NaN (the same failure, with no word on why) and a non-number
    are refused before anything is sent."""
    for far in (math.inf, 1e20, 2**63):
        assert real_client.generate("hi", SHORT, timeout=far).completion_tokens == 3
        assert real_client.health(timeout=far) == "SERVING"
        assert real_client.stats(timeout=far)["ring_slots"] == 4
    admitted = real_client.stats()["requests_admitted"]
    for bad, error in ((0, ValueError), (-1, ValueError), (math.nan, ValueError),
                       ("1", TypeError), (True, TypeError)):
        for call in (lambda: real_client.generate("hi", SHORT, timeout=bad),
                     lambda: real_client.stream("hi", SHORT, timeout=bad),
                     lambda: real_client.stats(timeout=bad),
                     lambda: real_client.model_info(timeout=bad)):
            with pytest.raises(error, match="timeout must be"):
                call()
    assert real_client.stats()["requests_admitted"] == admitted

    async def main():
        async with AsyncBlinkClient(real.target) as c:
            assert (await c.generate("hi", SHORT, timeout=math.inf)).completion_tokens == 3
            with pytest.raises(ValueError, match="timeout must be > 0"):
                await c.stats(timeout=math.nan)

    asyncio.run(main())


@pytest.mark.timeout(30)
def test_wait_ready_timeouts(real, real_client):
    """NaN polled for ever (no time compares past it), and so did inf, even with the server
    SERVING: each poll's health(timeout=inf) failed DEADLINE_EXCEEDED at once."""
    for bad in (-1, math.nan):
        with pytest.raises(ValueError, match="wait_ready's timeout must be >= 0"):
            real_client.wait_ready(bad)
    real_client.wait_ready(math.inf)
    real_client.wait_ready(0)  # one poll

    async def main():
        async with AsyncBlinkClient(real.target) as c:
            await c.wait_ready(math.inf)
            with pytest.raises(ValueError, match="wait_ready's timeout"):
                await c.wait_ready(math.nan)

    asyncio.run(main())


@pytest.mark.parametrize("sampling, error, says", [
    # refused by the SDK, naming the field (protobuf's errors named none, or took the value)
    (dict(max_tokens=-1), ValueError, "max_tokens: Value out of range"),
    (dict(max_tokens=True), TypeError, "max_tokens must be a number, not bool"),
    (dict(top_k=-1), ValueError, "top_k: Value out of range"),
    (dict(seed=2**64), ValueError, "seed: Value out of range"),
    (dict(temperature="0.5"), TypeError, "temperature: "),
    # finite, but not as the message's float32 (the server said "got inf", "got 0.0")
    (dict(temperature=1e300), ValueError, "temperature: 1e.300 is outside what a float32"),
    (dict(top_p=1e-50), ValueError, "top_p: 1e-50 is outside what a float32 holds"),
    (dict(stop=[1]), TypeError, r"stop\[0\] must be a str, not int"),
    (dict(stop=["ok", None]), TypeError, r"stop\[1\] must be a str, not NoneType"),
    (dict(stop=[b"\n"]), TypeError, r"stop\[0\] must be a str, not bytes"),
    (dict(stop_token_ids=[-1]), ValueError, "stop_token_ids: Value out of range"),
    (dict(stop_token_ids=[True]), TypeError, "stop_token_ids must be token ids"),
    (dict(ignore_eos="yes"), TypeError, "ignore_eos: "),
    # the server's checks, which the SDK leaves to it: INVALID_ARGUMENT naming the rule
    (dict(max_tokens=0), BlinkError, "INVALID_ARGUMENT: max_tokens must be at least 1"),
    (dict(temperature=math.nan), BlinkError, "INVALID_ARGUMENT: temperature must be >= 0"),
    (dict(temperature=-1.0), BlinkError, "INVALID_ARGUMENT: temperature must be >= 0"),
    (dict(top_p=1.5), BlinkError, r"INVALID_ARGUMENT: top_p must be in \(0, 1\]"),
    (dict(top_p=0.0), BlinkError, r"INVALID_ARGUMENT: top_p must be in \(0, 1\]"),
    (dict(stop=["x"] * 17), BlinkError, "INVALID_ARGUMENT: at most 16 stop strings"),
    (dict(stop=["x" * 257]), BlinkError, "INVALID_ARGUMENT: stop strings must be 1 to 256"),
    (dict(stop=[""]), BlinkError, "INVALID_ARGUMENT: stop strings must be 1 to 256"),
])
def test_bad_sampling_is_one_clear_error(real_client, sampling, error, says):
    with pytest.raises(error, match=says) as err:
        real_client.generate("hi", Sampling(**sampling))
    if error is BlinkError:
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_sampling_refuses_a_stop_that_is_no_sequence():
    for bad in (None, 5, b"\n"):
        with pytest.raises(TypeError, match="stop must be a sequence"):
            Sampling(stop=bad)
    with pytest.raises(TypeError, match="stop_token_ids must be a sequence"):
        Sampling(stop_token_ids=5)


@pytest.mark.parametrize("prompt, error, says", [
    ([{"role": "user", "content": 5}], TypeError, "chat message 0's content must be a str"),
    ([{"role": "user", "content": None}], TypeError, "chat message 0's content must be a str"),
    ([{"role": "system", "content": "a"}, {"role": 1, "content": "b"}], TypeError,
     "chat message 1's role must be a str"),
    ([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], TypeError,
     "chat message 0's content must be a str, not list"),
    ([1.0], TypeError, "only token ids"),
    ([-1], ValueError, "uint32"),
    ([2**32], ValueError, "uint32"),
    ("", BlinkError, "INVALID_ARGUMENT: prompt is empty"),
    ([], BlinkError, "INVALID_ARGUMENT: prompt is empty"),
    ([2**31], BlinkError, "INVALID_ARGUMENT: token id 2147483648 is outside the vocabulary"),
])
def test_bad_prompt_is_one_clear_error(real_client, prompt, error, says):
    with pytest.raises(error, match=says):
        real_client.generate(prompt, SHORT)


@pytest.mark.parametrize("call, error, says", [
    (lambda c: c.generate("hi", SHORT, client_request_id=5), TypeError, "client_request_id"),
    (lambda c: c.generate("hi", SHORT, cache_salt=5), TypeError, "cache_salt must be a str"),
    (lambda c: c.generate("hi", 5), TypeError, "sampling must be a Sampling, not int"),
    (lambda c: c.generate("hi", {"max_tokens": 3}), TypeError, "sampling must be a Sampling"),
    (lambda c: c.with_token(123), TypeError, "a bearer token must be a str, not int"),
    (lambda c: c.generate("a\ud800", SHORT), ValueError, "prompt: .*surrogates"),
    (lambda c: c.generate([{"role": "user", "content": "\ud800"}], SHORT), ValueError,
     "chat message 0: .*surrogates"),
    (lambda c: c.generate("hi", SHORT, cache_salt="\ud800"), ValueError, "cache_salt: "),
    (lambda c: c.generate("hi", Sampling(max_tokens=3, stop=["\ud800"])), ValueError,
     "stop: .*surrogates"),
])
def test_a_bad_argument_is_named_before_anything_is_sent(real_client, call, error, says):
    """Each argument the SDK cannot send is a TypeError or ValueError naming it (protobuf's
    own said "bad argument type for built-in operation", an AttributeError came from a
    Sampling's place, UnicodeEncodeError named no field)."""
    with pytest.raises(error, match=says):
        call(real_client)


def test_special_tokens_can_be_left_out_of_a_text_prompt(long_checkpoint, real_client):
    """skip_special_tokens_in_prompt, a field of the request the SDK could not set: the text
    is tokenized as the tokenizers library does without special tokens (here BOS)."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(long_checkpoint / "tokenizer.json"))
    for skip in (False, True):
        done = real_client.generate("hello world", SHORT, skip_special_tokens_in_prompt=skip)
        assert done.prompt_tokens == len(tok.encode("hello world",
                                                    add_special_tokens=not skip).ids)
    assert len(tok.encode("hello world").ids) > len(tok.encode("hello world",
                                                               add_special_tokens=False).ids)


def test_numpy_token_ids_reach_the_server(real_client):
    import numpy as np
    for prompt in (np.array([5, 6], dtype=np.int64), [np.uint32(5), np.int8(6)]):
        assert real_client.generate(prompt, SHORT).prompt_tokens == 2


def test_one_client_from_many_threads(real, real_client):
    """More callers than slots: every call completes (waiting for a slot), none interferes."""
    with ThreadPoolExecutor(16) as pool:
        done = list(pool.map(lambda i: real_client.generate(f"thread {i}", SHORT), range(48)))
    assert [d.completion_tokens for d in done] == [3] * 48
    assert real_client.stats()["ring_slots_in_use"] == 0


async def _async_client(target: str) -> AsyncBlinkClient:
    """An AsyncBlinkClient bound to the loop that runs this (it must be made in one)."""
    return AsyncBlinkClient(target)


def test_async_client_belongs_to_one_event_loop(real, real_client):
    """A call from another loop (or none) is a RuntimeError that says why, sent nowhere; it
    failed with "got Future attached to a different loop", its request task left pending."""
    with pytest.raises(RuntimeError, match="created in a coroutine"):
        AsyncBlinkClient(real.target)
    home = asyncio.new_event_loop()
    client = home.run_until_complete(_async_client(real.target))
    admitted = real_client.stats()["requests_admitted"]

    async def elsewhere():
        with pytest.raises(RuntimeError, match="belongs to the event loop it was created on"):
            await client.generate("hi", SHORT)
        with pytest.raises(RuntimeError, match="belongs to the event loop"):
            await client.stats()
    asyncio.run(elsewhere())
    assert real_client.stats()["requests_admitted"] == admitted
    assert home.run_until_complete(client.generate("hi", SHORT)).completion_tokens == 3
    home.run_until_complete(client.close())
    home.close()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_with_token_and_session_share_the_channel(real, real_client):
    """Copies open no channel of their own (no connection, no fd), and closing any one closes
    them all: a call then is one clear ValueError in both clients (grpc's said "Cannot invoke
    RPC: Channel closed!", grpc.aio's was a UsageError that is no RpcError)."""
    real_client.generate("warm", SHORT)  # the connection is up before counting
    fds = _open_fds()
    for i in range(200):
        real_client.with_token(f"t{i}").with_session(f"s{i}").stats()
    assert _open_fds() <= fds
    client = BlinkClient(real.target)
    copy = client.with_session("conv")
    copy.close()
    for c in (client, copy):
        with pytest.raises(ValueError, match="this Blink client is closed"):
            c.generate("hi", SHORT)
        with pytest.raises(ValueError, match="this Blink client is closed"):
            c.health()

    async def main():
        c = AsyncBlinkClient(real.target)
        await c.with_token("t").close()
        with pytest.raises(ValueError, match="this Blink client is closed"):
            await c.stats()
        with pytest.raises(ValueError, match="this Blink client is closed"):
            c.stream("hi", SHORT)
    asyncio.run(main())


def _seconds_until_it_works(call) -> float:
    """How long `call` keeps failing UNAVAILABLE (it must work within 10 s)."""
    start = time.monotonic()
    while True:
        try:
            call()
            return time.monotonic() - start
        except BlinkError as e:
            assert e.code == grpc.StatusCode.UNAVAILABLE and time.monotonic() - start < 10, e
        time.sleep(0.05)


OUTAGE_S = 10


def test_a_restarted_server_is_reached_again(long_checkpoint, tmp_path):
    """The front end stops for OUTAGE_S and starts again on its port: in between a call is
    UNAVAILABLE, and once it serves the same clients' channels reconnect within about a second
    (gRPC's wait between connection attempts grew to 120 s: they failed for seconds more)."""
    with socket.socket() as s:  # a free port, to start the front end on twice
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    stack = synthetic_stack(long_checkpoint, tmp_path, ["--port", str(port)])
    loop = asyncio.new_event_loop()
    aclient = loop.run_until_complete(_async_client(stack.target))
    try:
        with BlinkClient(stack.target) as client:
            calls = (lambda: client.generate("hi", SHORT),
                     lambda: loop.run_until_complete(aclient.generate("hi", SHORT)))
            for call in calls:
                assert call().completion_tokens == 3
            stack.frontend.terminate()
            stack.frontend.wait(10)
            back = time.monotonic() + OUTAGE_S
            while time.monotonic() < back:  # (each failed attempt lengthened gRPC's wait)
                for call in calls:
                    with pytest.raises(BlinkError, match="UNAVAILABLE"):
                        call()
                time.sleep(0.2)
            stack.start_frontend()
            stack.wait_serving()  # (on a channel of its own)
            for call in calls:
                assert _seconds_until_it_works(call) < 2
    finally:
        loop.run_until_complete(aclient.close())
        loop.close()
        stack.stop()


def test_wait_ready_gives_up_after_its_timeout_not_later():
    """wait_ready's documented bound: BlinkError(DEADLINE_EXCEEDED) after `timeout` seconds of
    NOT_SERVING, on the wall clock."""
    servicer = health.HealthServicer()
    servicer.set(HEALTH_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
    with serve_fake(FakeBlink(), servicer) as (_, target), BlinkClient(target) as c:
        c.health()  # connected
        for timeout in (0.0, 0.3):
            start = time.monotonic()
            with pytest.raises(BlinkError, match="NOT_SERVING") as err:
                c.wait_ready(timeout)
            assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            assert time.monotonic() - start < timeout + 0.3, timeout


def test_wait_ready_against_a_server_that_never_answers_still_ends():
    """A peer that accepts TCP and never speaks HTTP/2 (a hung process, a wrong port): each
    poll's health call carries the remaining time as its deadline, so wait_ready ends."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        outcome = []

        def wait():
            with BlinkClient(f"127.0.0.1:{port}") as c:
                try:
                    c.wait_ready(0.5)
                except BlinkError as e:
                    outcome.append(e.code)
        start = time.monotonic()
        waiter = threading.Thread(target=wait, daemon=True)
        waiter.start()
        waiter.join(5)
        assert outcome == [grpc.StatusCode.DEADLINE_EXCEEDED] and time.monotonic() - start < 2

