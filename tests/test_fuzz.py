"""Fuzzing the front end with GenerateRequest bytes over a real gRPC channel (CPU engine).

10,000 cases: valid requests mutated (bit flips, truncation, insertion, deletion, repeated
pieces), random bytes, and well-formed wire data with invalid UTF-8 in each string field (text,
model, client_request_id, stop, role, content). Every case must end with a clear status, never
UNKNOWN or INTERNAL (undecodable bytes: INVALID_ARGUMENT); a stream that starts is cancelled
after its first message; the server stays SERVING and every slot comes back.
"""
from __future__ import annotations

import asyncio
import collections
import random

import grpc
import pytest

from blink.client.sdk import BlinkClient
from blink.v1 import blink_pb2 as pb

CASES = 10_000
CONCURRENCY = 32
METHOD = "/blink.v1.Blink/Generate"
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.CANCELLED,
           grpc.StatusCode.RESOURCE_EXHAUSTED}


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def base_requests() -> list[bytes]:
    sampling = pb.SamplingParams(max_tokens=2, temperature=0.0)
    reqs = [
        pb.GenerateRequest(text="Hello there", sampling=sampling),
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 17, 300, 42]), sampling=sampling,
                           return_token_ids=True, client_request_id="fuzz"),
        pb.GenerateRequest(messages=pb.ChatMessages(messages=[
            pb.ChatMessage(role="user", content="Hi!")]), sampling=sampling),
        pb.GenerateRequest(text="stop here", sampling=pb.SamplingParams(
            max_tokens=3, temperature=0.7, top_p=0.9, top_k=5, seed=3, stop=["x", "yz"],
            stop_token_ids=[1, 2])),
    ]
    return [r.SerializeToString() for r in reqs]


def invalid_utf8_cases() -> list[bytes]:
    bad = b"ok\xff\xfe\xc3("
    sampling = pb.SamplingParams(max_tokens=1).SerializeToString()
    return [
        _field(2, bad) + _field(5, sampling),                                  # text
        _field(1, bad) + _field(2, b"hello") + _field(5, sampling),            # model
        _field(8, bad) + _field(2, b"hello") + _field(5, sampling),            # client id
        _field(2, b"hello") + _field(5, sampling + _field(6, bad)),            # stop
        _field(4, _field(1, _field(1, bad) + _field(2, b"hi"))) + _field(5, sampling),  # role
        _field(4, _field(1, _field(1, b"user") + _field(2, bad))) + _field(5, sampling),
    ]


def mutate(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(6)
        if op == 0 and b:                       # bit flip
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
        elif op == 1 and b:                     # truncate
            del b[rng.randrange(len(b)):]
        elif op == 2:                           # insert random bytes
            i = rng.randrange(len(b) + 1)
            b[i:i] = rng.randbytes(rng.randint(1, 8))
        elif op == 3 and b:                     # delete a piece
            i = rng.randrange(len(b))
            del b[i:i + rng.randint(1, 8)]
        elif op == 4 and b:                     # repeat a piece
            i = rng.randrange(len(b))
            b[i:i] = b[i:i + rng.randint(1, 16)]
        else:                                   # random byte value
            if b:
                b[rng.randrange(len(b))] = rng.randrange(256)
    return bytes(b)


def cases(n: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    bases, utf8 = base_requests(), invalid_utf8_cases()
    out = list(utf8)
    while len(out) < n:
        r = rng.random()
        if r < 0.7:
            out.append(mutate(rng, rng.choice(bases)))
        elif r < 0.9:
            out.append(rng.randbytes(rng.randint(0, 200)))
        else:
            out.append(mutate(rng, rng.choice(utf8)))
    return out


async def fuzz(target: str, payloads: list[bytes]) -> collections.Counter:
    statuses: collections.Counter = collections.Counter()
    bad: list[tuple[bytes, grpc.StatusCode, str]] = []
    gate = asyncio.Semaphore(CONCURRENCY)
    async with grpc.aio.insecure_channel(target) as channel:
        call_method = channel.unary_stream(METHOD)  # bytes in, bytes out

        async def one(data: bytes) -> None:
            async with gate:
                call = call_method(data, timeout=30)
                try:
                    async for _ in call:
                        call.cancel()  # a stream started: the case passed validation
                        break
                except asyncio.CancelledError:
                    pass
                except grpc.aio.AioRpcError:
                    pass
                code = await call.code()
                statuses[code] += 1
                if code not in ALLOWED:
                    bad.append((data, code, await call.details()))
        await asyncio.gather(*(one(p) for p in payloads))
    assert not bad, f"{len(bad)} cases ended badly, e.g. {bad[:3]}"
    return statuses


@pytest.mark.slow
def test_generate_request_fuzz(checkpoints, make_stack):
    stack = make_stack(checkpoints["llama"], engine_args=["--slots", "64"])
    stack.wait_serving()
    payloads = cases(CASES)
    assert len(payloads) == CASES
    statuses = asyncio.run(fuzz(stack.target, payloads))
    print(f"fuzz: {CASES} GenerateRequest cases: "
          + ", ".join(f"{code.name} {n}" for code, n in statuses.most_common()))
    assert statuses[grpc.StatusCode.INVALID_ARGUMENT] > CASES // 10  # the fuzz reached parsing
    assert statuses[grpc.StatusCode.CANCELLED] > 100                 # and generation
    with BlinkClient(stack.target) as client:
        assert client.health() == "SERVING"
        for _ in range(100):  # cancelled streams hand their slots back
            stats = client.stats()
            if stats["ring_slots_in_use"] == 0 and stats["sequences_running"] == 0:
                break
            asyncio.run(asyncio.sleep(0.05))
        assert stats["ring_slots_in_use"] == 0 and stats["sequences_running"] == 0
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_invalid_utf8_in_every_string_field_is_invalid_argument(checkpoints, make_stack):
    stack = make_stack(checkpoints["llama"])
    stack.wait_serving()
    statuses = asyncio.run(fuzz(stack.target, invalid_utf8_cases()))
    assert statuses == {grpc.StatusCode.INVALID_ARGUMENT: len(invalid_utf8_cases())}
