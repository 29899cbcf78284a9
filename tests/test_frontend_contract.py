"""The gRPC front end's contract (nic_service/server.py, engine_link.py) where the other serving
tests did not hold it (a mutation review found each gap): every test goes through a real gRPC
channel to a real stack (the CPU reference engine and a front end) and checks what blink.proto,
the CLI's help or the `tokenizers` library say: the request size limit, a message's name, the
default temperature, the stop ids the ring carries, the final message's timings and ids, a stop
string's end in the counters, cache salts, the model's EOS ids, the server stats, ignore_eos, the
slot queue, and the answers while the engine is down."""
from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import grpc
import pytest
from tokenizers import Tokenizer

from blink.v1 import blink_pb2 as pb
from blink.v1 import blink_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

# Renders a message's `name` only where the template sees one (`message.name is defined`).
NAMED_TEMPLATE = ("{% for m in messages %}{% if m.name is defined %}<{{ m.name }}>{% endif %}"
                  "{{ m.role }}: {{ m.content }}\n{% endfor %}")


@pytest.fixture(scope="module")
def model(checkpoints, tmp_path_factory) -> Path:
    """The llama test checkpoint with NAMED_TEMPLATE as its chat template."""
    out = tmp_path_factory.mktemp("named-template") / "m"
    shutil.copytree(checkpoints["llama"], out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = NAMED_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def stack(model, tmp_path_factory):
    from conftest import BlinkStack
    s = BlinkStack(model, tmp_path_factory.mktemp("contract-stack"),
                   ["--engine", "cpu", "--slots", "6"], ["--max-request-mb", "1"])
    s.start_engine()
    s.start_frontend()
    s.wait_serving(timeout=120)
    yield s
    s.stop()


@pytest.fixture
def stub(stack):
    with grpc.insecure_channel(stack.target) as channel:
        yield pb_grpc.BlinkStub(channel)


@pytest.fixture(scope="module")
def tok(model) -> Tokenizer:
    return Tokenizer.from_file(str(model / "tokenizer.json"))


def run(stub, request: pb.GenerateRequest, timeout: float = 60):
    """(chunks, final) of a Generate stream."""
    chunks, final = [], None
    for response in stub.Generate(request, timeout=timeout):
        assert final is None, "a message after the final one"
        if response.WhichOneof("kind") == "chunk":
            chunks.append(response.chunk)
        else:
            final = response.final
    assert final is not None
    return chunks, final


def greedy(max_tokens: int, **kw) -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def test_a_request_of_exactly_the_size_limit_is_accepted_and_one_byte_more_is_not(stub):
    """--max-request-mb is the "largest request accepted" (the CLI's help): a request of exactly
    1 MiB is served; one byte more is INVALID_ARGUMENT saying the limit."""
    limit = 1 << 20

    def of_size(n: int) -> pb.GenerateRequest:
        req = pb.GenerateRequest(text="hi", sampling=greedy(1), client_request_id="")
        pad = n - req.ByteSize() - 1 - 3  # the id field's tag and 3-byte length
        req.client_request_id = "x" * pad
        assert req.ByteSize() == n
        return req

    chunks, final = run(stub, of_size(limit))
    assert final.usage.completion_tokens == 1
    with pytest.raises(grpc.RpcError) as err:
        run(stub, of_size(limit + 1))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"the limit is {limit}" in err.value.details()


def test_a_message_without_a_name_reaches_the_template_without_one(stub, tok):
    """ChatMessage.name: "the chat template sees [it] as `message.name` when it is not empty;
    empty (the default): the message has no name" (blink.proto). The prompt's tokens are the
    tokenizers library's encoding of the conversation rendered by hand."""
    for messages, rendered in (
            ([pb.ChatMessage(role="user", content="hi there")], "user: hi there\n"),
            ([pb.ChatMessage(role="user", content="hi", name="bob"),
              pb.ChatMessage(role="user", content="and me")], "<bob>user: hi\nuser: and me\n")):
        want = tok.encode(rendered, add_special_tokens=False).ids
        _, final = run(stub, pb.GenerateRequest(messages=pb.ChatMessages(messages=messages),
                                                sampling=greedy(4), return_token_ids=True))
        _, by_ids = run(stub, pb.GenerateRequest(token_ids=pb.TokenIds(ids=want),
                                                 sampling=greedy(4)))
        assert final.usage.prompt_tokens == len(want), rendered
        assert final.usage.completion_tokens == by_ids.usage.completion_tokens == 4


def test_unset_temperature_is_1(stub):
    """SamplingParams.temperature: "Default 1.0" (blink.proto): a seeded request without a
    temperature draws the tokens that temperature 1.0 with the same seed draws, not greedy's."""
    def ids(**sampling):
        chunks, _ = run(stub, pb.GenerateRequest(
            text="once upon a time", return_token_ids=True,
            sampling=pb.SamplingParams(max_tokens=16, ignore_eos=True, **sampling)))
        return [t for c in chunks for t in c.token_ids]

    unset = [ids(seed=seed) for seed in (1, 2, 3)]
    assert unset == [ids(seed=seed, temperature=1.0) for seed in (1, 2, 3)]
    assert any(u != ids(seed=seed, temperature=0.0) for seed, u in zip((1, 2, 3), unset))


def test_stop_token_ids_up_to_what_the_ring_carries(stub, stack):
    """The ring carries MAX_STOP_IDS stop ids (blink.ring.layout): that many are served and one
    more is INVALID_ARGUMENT in the front end's words, not an error from inside the server."""
    from blink.ring.layout import MAX_STOP_IDS
    ids = list(range(100, 100 + MAX_STOP_IDS))
    _, final = run(stub, pb.GenerateRequest(text="hi", sampling=greedy(2, stop_token_ids=ids)))
    assert final.usage.completion_tokens >= 1
    with pytest.raises(grpc.RpcError) as err:
        run(stub, pb.GenerateRequest(text="hi", sampling=greedy(
            2, stop_token_ids=ids + [100 + MAX_STOP_IDS])))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"at most {MAX_STOP_IDS} stop_token_ids" in err.value.details()


def test_timings_request_id_and_token_ids_of_the_final_message(stub, stack):
    """Final (blink.proto): time_to_first_token_s runs to the first token, total_s to the end of
    generation (so a 64-token stream's first token comes well before its end); request_id is the
    server's own id "as in its logs", whatever client_request_id says, and differs between
    requests; chunks carry token_ids "only when return_token_ids is set"."""
    ids_seen = set()
    for client_id in ("mine", "mine"):
        chunks, final = run(stub, pb.GenerateRequest(text="timings", sampling=greedy(64),
                                                     client_request_id=client_id))
        assert final.usage.completion_tokens == 64
        t = final.timings
        assert 0 < t.time_to_first_token_s < t.total_s < 60
        assert all(not c.token_ids for c in chunks) and "".join(c.text for c in chunks)
        assert final.request_id and final.request_id != client_id
        ids_seen.add(final.request_id)
    assert len(ids_seen) == 2

    def logged():
        return all(f"request {i}" in stack.logs() for i in ids_seen)
    deadline = time.monotonic() + 5
    while not logged() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert logged(), stack.logs()


def wait_stats(stub, predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while True:
        stats = stub.GetServerStats(pb.GetServerStatsRequest(), timeout=10)
        if predicate(stats) or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def test_a_stop_string_s_end_counts_as_finished_not_cancelled(stub, tok):
    """A stream that ends on a stop string is a finished request in GetServerStats, not a
    cancelled one (engine_link: "The engine counts a stop string's end as a cancel (the front
    end cancels the sequence): those move to the finished"); the engine idles afterwards."""
    prompt = "where to stop"
    chunks, _ = run(stub, pb.GenerateRequest(text=prompt, sampling=greedy(16),
                                             return_token_ids=True))
    text = tok.decode([t for c in chunks for t in c.token_ids])
    stop = text[len(text) // 2:][:2]
    assert stop.strip()
    idle = lambda s: s.ring_slots_in_use == 0 and s.sequences_running == 0  # noqa: E731
    before = wait_stats(stub, lambda s: idle(s) and s.requests_finished == s.requests_admitted)
    for _ in range(3):
        _, final = run(stub, pb.GenerateRequest(text=prompt, sampling=greedy(16, stop=[stop])))
        assert final.finish_reason == pb.FINISH_REASON_STOP and final.matched_stop == stop
    after = wait_stats(stub, lambda s: idle(s) and s.requests_finished
                       == before.requests_finished + 3)
    assert (after.requests_admitted - before.requests_admitted,
            after.requests_finished - before.requests_finished,
            after.requests_cancelled - before.requests_cancelled) == (3, 3, 0)


def test_a_cache_salt_keeps_prefixes_apart(stub):
    """GenerateRequest.cache_salt: a request reuses cached prompt prefixes only from requests
    with the same salt (blink.proto), which Timings.cached_prompt_tokens shows."""
    block = stub.GetServerStats(pb.GetServerStatsRequest(), timeout=10).kv_block_size
    prompt = [300 + i for i in range(3 * block + 3)]

    def cached(salt: str) -> int:
        _, final = run(stub, pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt),
                                                sampling=greedy(2), cache_salt=salt))
        return final.timings.cached_prompt_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0
    assert cached("") == 0
    assert cached("tenant-a") == 3 * block


def test_model_info_s_eos_ids_are_the_checkpoint_s(stub, model):
    """ModelInfo.eos_token_ids: the end-of-sequence ids of the checkpoint, config.json's and
    generation_config.json's eos_token_id (either an id or a list of them)."""
    want = set()
    for name in ("config.json", "generation_config.json"):
        path = model / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            want |= set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert want and set(info.eos_token_ids) == want
    assert len(info.eos_token_ids) == len(want)


def test_server_stats_describe_the_engine_s_ring_and_kv_cache(stub):
    """ServerStats (blink.proto): ring_slots is the engine's --slots (6 here), prefix caching is
    on by default, and engine_busy_ns are nanoseconds of the engine's steps while
    engine_step_tokens counts the tokens those steps computed: one request's prompt plus all
    but its last generated token."""
    before = wait_stats(stub, lambda s: s.ring_slots_in_use == 0 and s.sequences_running == 0)
    assert before.ring_slots == 6 and before.prefix_caching
    prompt = pb.TokenIds(ids=[700 + i for i in range(9)])
    _, final = run(stub, pb.GenerateRequest(token_ids=prompt, sampling=greedy(20)))
    after = wait_stats(stub, lambda s: s.engine_step_tokens >= before.engine_step_tokens + 28)
    assert after.engine_step_tokens - before.engine_step_tokens == 9 + 20 - 1
    busy = after.engine_busy_ns - before.engine_busy_ns
    assert busy > 1000 * (after.engine_steps - before.engine_steps)  # > 1 us a step
    assert busy <= final.timings.total_s * 1e9


def test_ignore_eos_streams_an_eos_token_s_text(stub, checkpoints, tok, tmp_path, make_stack):
    """A checkpoint whose end-of-sequence id is an ordinary text token the model produces
    greedily. Without ignore_eos the stream ends there (FINISH_REASON_EOS) and that token's text
    is not returned ("the EOS or stop token that ended the stream (whose text is never
    returned)", blink.proto); with ignore_eos it does not end the stream, so its text is part
    of the stream like any other token's: the text is the tokenizers library's decode of every
    generated id."""
    prompt = "eos test"
    chunks, _ = run(stub, pb.GenerateRequest(text=prompt, sampling=greedy(24),
                                             return_token_ids=True))
    full = [t for c in chunks for t in c.token_ids]
    special = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    k = next(i for i, t in enumerate(full) if i >= 2 and t not in full[:i] and t not in special
             and tok.decode([t]).strip())
    model = tmp_path / "eos-model"
    shutil.copytree(checkpoints["llama"], model)
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((model / name).read_text())
        cfg["eos_token_id"] = full[k]
        (model / name).write_text(json.dumps(cfg))
    with grpc.insecure_channel(make_stack(model, engine_args=["--engine", "cpu"]).target) as ch:
        eos_stub = pb_grpc.BlinkStub(ch)
        chunks, final = run(eos_stub, pb.GenerateRequest(
            text=prompt, return_token_ids=True,
            sampling=pb.SamplingParams(max_tokens=24, temperature=0.0)))
        ids = [t for c in chunks for t in c.token_ids]
        assert final.finish_reason == pb.FINISH_REASON_EOS and ids == full[:k + 1]
        assert "".join(c.text for c in chunks) == tok.decode(full[:k])
        chunks, final = run(eos_stub, pb.GenerateRequest(text=prompt, sampling=greedy(24),
                                                         return_token_ids=True))
        assert final.finish_reason == pb.FINISH_REASON_LENGTH
        assert [t for c in chunks for t in c.token_ids] == full
        assert "".join(c.text for c in chunks) == tok.decode(full)


LONG = pb.SamplingParams(max_tokens=16000, temperature=0.0, ignore_eos=True)  # seconds of work


def stats(stub) -> pb.ServerStats:
    return stub.GetServerStats(pb.GetServerStatsRequest(), timeout=10)


def wait_for(predicate, timeout=10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_max_queued_requests_wait_and_one_more_is_refused_at_once(long_checkpoint, make_stack):
    """One slot, --max-queued 1, --queue-timeout 60: with the slot busy, one request waits for
    it (ServerStats.requests_waiting_for_slot says 1), the next is RESOURCE_EXHAUSTED at once
    rather than after the queue timeout, and the waiting one is served once the slot frees."""
    stack = make_stack(long_checkpoint, engine_args=["--engine", "cpu", "--slots", "1"],
                       frontend_args=["--max-queued", "1", "--queue-timeout", "60"])
    with grpc.insecure_channel(stack.target) as channel:
        stub = pb_grpc.BlinkStub(channel)
        running = stub.Generate(pb.GenerateRequest(text="hold the slot", sampling=LONG),
                                timeout=120)
        next(running)  # its first chunk: it has the slot
        assert stats(stub).ring_slots_in_use == 1
        queued = {}

        def wait_in_queue():
            try:
                queued["final"] = list(stub.Generate(pb.GenerateRequest(
                    text="queued", sampling=pb.SamplingParams(
                        max_tokens=3, temperature=0.0, ignore_eos=True)), timeout=120))[-1]
            except grpc.RpcError as e:
                queued["error"] = e
        thread = threading.Thread(target=wait_in_queue)
        thread.start()
        assert wait_for(lambda: stats(stub).requests_waiting_for_slot == 1), stats(stub)
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(pb.GenerateRequest(text="one too many", sampling=LONG),
                               timeout=120))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert time.monotonic() - t0 < 10  # at once, not after the 60 s queue timeout
        assert stats(stub).requests_waiting_for_slot == 1
        running.cancel()
        thread.join(60)
        assert "error" not in queued, queued
        assert queued["final"].final.usage.completion_tokens == 3
        assert wait_for(lambda: (s := stats(stub)).ring_slots_in_use == 0
                        and s.requests_waiting_for_slot == 0)


def test_model_info_and_stats_while_the_engine_is_down(checkpoints, make_stack):
    """With the engine gone: GetModelInfo is UNAVAILABLE ("the engine is not running or
    stopped answering; retry later", blink.proto), GetServerStats answers with engine_alive
    false, and Generate is UNAVAILABLE too."""
    stack = make_stack(checkpoints["llama"], engine_args=["--engine", "cpu"],
                       frontend_args=["--engine-timeout", "1.0"])
    with grpc.insecure_channel(stack.target) as channel:
        stub = pb_grpc.BlinkStub(channel)
        assert stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).name == "llama"
        stack.kill_engine()
        assert wait_for(lambda: not stats(stub).engine_alive, 15)
        with pytest.raises(grpc.RpcError) as err:
            stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(pb.GenerateRequest(text="hi"), timeout=10))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_requests_that_waited_in_vain_leave_the_queue(long_checkpoint, make_stack):
    """One slot, --max-queued 1, --queue-timeout 1: with the slot busy, each request waits the
    queue timeout and is RESOURCE_EXHAUSTED ("every request slot stayed busy for the server's
    queue timeout", blink.proto); one that gave up does not keep its place in the queue (the
    next one waits its own timeout too), and once the slot is free a request is served."""
    stack = make_stack(long_checkpoint, engine_args=["--engine", "cpu", "--slots", "1"],
                       frontend_args=["--max-queued", "1", "--queue-timeout", "1"])
    short = pb.SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    with grpc.insecure_channel(stack.target) as channel:
        stub = pb_grpc.BlinkStub(channel)
        running = stub.Generate(pb.GenerateRequest(text="hold the slot", sampling=LONG),
                                timeout=120)
        next(running)
        for _ in range(2):
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(pb.GenerateRequest(text="waits", sampling=short),
                                   timeout=30))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert time.monotonic() - t0 >= 0.9, err.value.details()  # its own wait
        assert stats(stub).requests_waiting_for_slot == 0
        running.cancel()
        assert wait_for(lambda: stats(stub).ring_slots_in_use == 0)
        final = list(stub.Generate(pb.GenerateRequest(text="served", sampling=short),
                                   timeout=30))[-1].final
        assert final.usage.completion_tokens == 3


def test_concurrent_requests_get_distinct_request_ids(checkpoints, make_stack):
    """Final.request_id is "the server's id for this request": 24 requests sent at once get 24
    different ids."""
    import asyncio
    stack = make_stack(checkpoints["llama"], engine_args=["--engine", "cpu", "--slots", "32"])

    async def all_at_once():
        async with grpc.aio.insecure_channel(stack.target) as channel:
            stub = pb_grpc.BlinkStub(channel)

            async def one(i):
                responses = [r async for r in stub.Generate(pb.GenerateRequest(
                    text=f"request {i}", sampling=pb.SamplingParams(
                        max_tokens=2, temperature=0.0, ignore_eos=True)), timeout=60)]
                return responses[-1].final.request_id
            return await asyncio.gather(*(one(i) for i in range(24)))

    ids = asyncio.run(all_at_once())
    assert all(ids) and len(set(ids)) == 24, ids
