"""The client SDK against a real gRPC server on localhost that runs a scripted fake servicer.

The prompt text picks the fake's script: "bad" is rejected, "fail-mid" fails after one chunk,
"no-final" ends without a final message, "slow" streams two chunks and then waits for the client
to go away (so deadlines and cancellation can be observed on the server), anything else streams
CHUNKS and a final.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
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
    # a bool is no token id: protobuf only warns on one (until it refuses them), and the SDK
    # refuses one wherever the warning is made an error
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(TypeError, match="only token ids"):
            build_request([True, 5])


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
