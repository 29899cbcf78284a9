"""Serving behaviour through a real gRPC port: sampling, stop conditions, bad input, cancels and
deadlines, slot exhaustion, engine death and restart, health and reflection.

Every test runs against two engines: the CPU reference engine (CI) and the CUDA engine with its
persistent scheduler kernel (marked `gpu`: deploy/gpu_check.sh runs it, elsewhere it skips with
the reason). CUDA engines here size their KV cache (--num-kv-blocks), since several stacks of
this module share the GPU at once."""
from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from gpu import requires_gpu
from tokenizers import Tokenizer

from blink.client.sdk import AsyncBlinkClient, BlinkClient, BlinkError, Sampling
from blink.gpu_engine.sampling import sample_token, sampling_distribution
from blink.gpu_engine.sequence import SamplingParams
from blink.v1 import blink_pb2 as pb
from blink.v1 import blink_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

GREEDY = Sampling(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=[
    "cpu", pytest.param("cuda", marks=[pytest.mark.gpu, requires_gpu()])])
def engine(request) -> str:
    return request.param


def engine_args(engine: str, extra=()) -> list[str]:
    """--engine, and for CUDA engines a KV cache of their own size unless `extra` sets one."""
    sized = engine == "cuda" and "--num-kv-blocks" not in extra
    return ["--engine", engine, *(["--num-kv-blocks", "4096"] if sized else []), *extra]


def assert_unaffected(engine, model_dir, prompt: list[int], alone, beside_others) -> None:
    """A greedy request's tokens do not depend on what else ran in its batches. The CPU engine
    computes each row alone, so its tokens are equal. The CUDA engine's bf16 sums change with
    the batch's shape (bucket, split counts), so there each token must be the transformers
    bf16 argmax on its own prefix, or a near-tie of it (tests/oracle.py)."""
    if engine == "cpu" or alone.token_ids == beside_others.token_ids:
        assert alone.token_ids == beside_others.token_ids
        return
    from oracle import check_against_bf16_reference, hf_bf16
    check_against_bf16_reference(hf_bf16(model_dir), prompt, list(beside_others.token_ids), 0.25)


@pytest.fixture
def engine_stack(engine, make_stack):
    """make_stack with this module's engine."""
    def make(model_dir, *, extra_engine_args=(), frontend_args=()):
        return make_stack(model_dir, engine_args=engine_args(engine, extra_engine_args),
                          frontend_args=frontend_args)
    return make


def module_stack(engine, model_dir, workdir, frontend_args=()):
    from conftest import BlinkStack
    s = BlinkStack(model_dir, workdir, engine_args(engine), frontend_args)
    s.start_engine()
    s.start_frontend()
    s.wait_serving(timeout=120)
    return s


@pytest.fixture(scope="module")
def stack(engine, checkpoints, tmp_path_factory):
    s = module_stack(engine, checkpoints["llama"], tmp_path_factory.mktemp("behaviour"),
                     ["--max-request-mb", "1"])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def long_stack(engine, long_checkpoint, tmp_path_factory):
    s = module_stack(engine, long_checkpoint, tmp_path_factory.mktemp("long"))
    yield s
    s.stop()


@pytest.fixture
def client(stack):
    with BlinkClient(stack.target) as c:
        yield c


def wait_for(predicate, timeout=10.0, interval=0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False


def engine_idle(client) -> bool:
    s = client.stats()
    return (s["kv_blocks_free"] == s["kv_blocks_total"] and s["ring_slots_in_use"] == 0
            and s["sequences_running"] == 0 and s["sequences_waiting"] == 0)


# -- sampling ---------------------------------------------------------------------------------

def test_same_seed_same_text_and_top_k_1_is_greedy(client):
    prompt = "Sampling test: once upon a time"
    a = client.generate(prompt, Sampling(max_tokens=24, temperature=0.9, seed=42,
                                         ignore_eos=True), return_token_ids=True)
    b = client.generate(prompt, Sampling(max_tokens=24, temperature=0.9, seed=42,
                                         ignore_eos=True), return_token_ids=True)
    c = client.generate(prompt, Sampling(max_tokens=24, temperature=0.9, seed=43,
                                         ignore_eos=True), return_token_ids=True)
    assert a.token_ids == b.token_ids and a.text == b.text
    assert a.token_ids != c.token_ids
    greedy = client.generate(prompt, GREEDY, return_token_ids=True)
    top1 = client.generate(prompt, Sampling(max_tokens=24, temperature=1.5, top_k=1, seed=7,
                                            ignore_eos=True), return_token_ids=True)
    assert greedy.token_ids == top1.token_ids
    nucleus = client.generate(prompt, Sampling(max_tokens=24, temperature=1.0, top_p=0.5,
                                               seed=42, ignore_eos=True), return_token_ids=True)
    assert nucleus.completion_tokens == 24


def test_a_seeded_stream_draws_each_token_with_its_own_step_s_number(stack, checkpoints,
                                                                     engine):
    """The n-th generated token's random number is uniform(seed, n) (README: a seeded stream
    depends only on the seed and the step, the contract the GPU kernel shares): each token of a
    seeded stream is sample_token over transformers' logits for the prefix before it with that
    step's number. An engine that drew step n + 1's number (every seeded text changes, and the
    CPU and GPU engines' stop agreeing) passed every test before. Steps whose number lies within
    1e-4 of an edge of the distribution's cumulative sums are not judged (float32 against the
    engine's own sums)."""
    from oracle import hf_next_logits

    from blink.gpu_engine.sampling import uniform
    if engine != "cpu":
        pytest.skip("bf16 logits move the distribution's edges by about 1%: the CPU engine's "
                    "float32 ones are the ones to hold to 1e-4")
    prompt, seed = [17, 300, 42, 99, 1000, 3, 640], 1234
    params = SamplingParams(max_tokens=12, temperature=1.0, top_k=16, seed=seed)
    with BlinkClient(stack.target) as client:
        done = client.generate(prompt, Sampling(max_tokens=12, temperature=1.0, top_k=16,
                                                seed=seed, ignore_eos=True),
                               return_token_ids=True)
    logits = hf_next_logits(checkpoints["llama"], prompt + list(done.token_ids))
    judged = 0
    for step, token in enumerate(done.token_ids):
        order, probs = sampling_distribution(logits[len(prompt) - 1 + step], params)
        if np.abs(np.cumsum(probs) - uniform(seed, step)).min() < 1e-4:
            continue
        assert token == sample_token(logits[len(prompt) - 1 + step], params, step), step
        judged += 1
    assert judged >= 10, judged


def within_sigmas(counts: dict[int, int], order, probs, n: int, sigmas: float = 5.0) -> bool:
    """Every drawn token is in the distribution's support and every token's count is within
    `sigmas` binomial standard deviations (+1) of n * its probability."""
    if not set(counts) <= set(int(t) for t in order):
        return False
    sd = np.sqrt(n * probs * (1 - probs))
    return all(abs(counts.get(int(t), 0) - n * p) <= sigmas * d + 1
               for t, p, d in zip(order, probs, sd))


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.8, 8, 1.0), (1.3, 0, 0.8)])
def test_sampling_follows_the_reference_distribution(stack, checkpoints, temperature, top_k,
                                                     top_p):
    """Temperature, top-k and top-p through the engine: 400 one-token requests (seeds 0..399)
    draw only tokens of the top-k / top-p set, at frequencies within 5 standard deviations of
    gpu_engine.sampling's distribution over transformers' float32 logits for the same prompt.
    The check rejects what the CPU sampler draws with the same seeds at another temperature,
    or without the top-k / top-p cut: it has the power to fail."""
    from dataclasses import replace

    from oracle import hf_next_logits
    prompt, n = [17, 300, 42, 99, 1000, 3, 640], 400
    params = SamplingParams(max_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p)
    logits = hf_next_logits(checkpoints["llama"], prompt)[-1]
    order, probs = sampling_distribution(logits, params)

    async def run():
        async with AsyncBlinkClient(stack.target) as c:
            gate = asyncio.Semaphore(32)

            async def one(seed):
                async with gate:
                    return await c.generate(prompt, Sampling(
                        max_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p,
                        seed=seed, ignore_eos=True), return_token_ids=True, timeout=60)
            return await asyncio.gather(*(one(seed) for seed in range(n)))

    counts: dict[int, int] = {}
    for done in asyncio.run(run()):
        counts[done.token_ids[0]] = counts.get(done.token_ids[0], 0) + 1
    assert within_sigmas(counts, order, probs, n), (counts, dict(zip(order.tolist(), n * probs)))
    for other in (replace(params, temperature=temperature * 1.6),
                  replace(params, top_k=0, top_p=1.0)):
        drawn: dict[int, int] = {}  # what a sampler with `other` would have drawn
        for seed in range(n):
            token = sample_token(logits, replace(other, seed=seed), 0)
            drawn[token] = drawn.get(token, 0) + 1
        assert not within_sigmas(drawn, order, probs, n), other


def test_max_tokens_ends_with_length(client):
    done = client.generate("count", Sampling(max_tokens=5, temperature=0.0, ignore_eos=True),
                           return_token_ids=True)
    assert done.finish_reason == "length" and done.completion_tokens == 5
    assert len(done.token_ids) == 5


def test_stop_token_id_ends_stream(client):
    prompt = "stop token test"
    full = client.generate(prompt, GREEDY, return_token_ids=True)
    # the first position whose token did not occur before it
    k = next(i for i, t in enumerate(full.token_ids) if i >= 2 and t not in full.token_ids[:i])
    stop_id = full.token_ids[k]
    done = client.generate(prompt, Sampling(max_tokens=24, temperature=0.0, ignore_eos=True,
                                            stop_token_ids=(stop_id,)), return_token_ids=True)
    assert done.finish_reason == "stop" and done.matched_stop == str(stop_id)
    assert done.token_ids == full.token_ids[:k + 1]      # the stop token's id is returned
    assert done.completion_tokens == k + 1               # and counted
    assert done.text == client.generate(prompt, Sampling(max_tokens=k, temperature=0.0,
                                                         ignore_eos=True)).text  # not its text


def test_stop_string_spanning_tokens(client, checkpoints):
    tok = Tokenizer.from_file(str(checkpoints["llama"] / "tokenizer.json"))
    prompt = "stop string test, a longer prompt"
    full = client.generate(prompt, GREEDY, return_token_ids=True)
    # a stop string that starts inside one token and ends inside a later one
    pieces = [tok.decode(full.token_ids[:i]) for i in range(len(full.token_ids) + 1)]
    i = next(i for i in range(2, len(pieces) - 2)
             if len(pieces[i + 1]) - len(pieces[i]) >= 2 and full.text.startswith(pieces[i + 2])
             and "\ufffd" not in pieces[i + 2][len(pieces[i]):])
    start = len(pieces[i]) + 1
    stop = pieces[i + 2][start:start + max(2, len(pieces[i + 2]) - start)]
    assert len(stop) >= 2
    expect = full.text[:full.text.find(stop)]
    done = client.generate(prompt, Sampling(max_tokens=24, temperature=0.0, ignore_eos=True,
                                            stop=("never-matches", stop)))
    assert done.finish_reason == "stop" and done.matched_stop == stop
    assert done.text == expect and stop not in done.text
    # streamed deltas never contained the stop string either
    deltas = list(client.stream(prompt, Sampling(max_tokens=24, temperature=0.0,
                                                 ignore_eos=True, stop=(stop,))))
    assert "".join(d.text for d in deltas) == expect
    assert wait_for(lambda: engine_idle(client))


def test_a_stop_string_ends_the_stream_on_the_token_that_completes_it(checkpoints,
                                                                      engine_stack):
    """Tokens that reach the front end together (here by --stream-interval-ms; a fast engine
    does it too) are matched a token at a time: a stop string's finish returns and counts the
    tokens up to the one that completes it, as vLLM does, never those generated after it."""
    tok = Tokenizer.from_file(str(checkpoints["llama"] / "tokenizer.json"))
    stack = engine_stack(checkpoints["llama"], frontend_args=["--stream-interval-ms", "300"])
    with BlinkClient(stack.target) as c:
        prompt = "stop string test, a longer prompt"
        full = c.generate(prompt, GREEDY, return_token_ids=True)
        pieces = [tok.decode(full.token_ids[:i]) for i in range(len(full.token_ids) + 1)]
        # the last two characters of the text up to token k, absent from the text before it
        k = next(k for k in range(6, len(pieces) - 4)
                 if full.text.startswith(pieces[k + 1]) and pieces[k + 1][-2:] not in pieces[k]
                 and "\ufffd" not in pieces[k + 1][-2:])
        stop = pieces[k + 1][-2:]
        done = c.generate(prompt, Sampling(max_tokens=24, temperature=0.0, ignore_eos=True,
                                           stop=(stop,)), return_token_ids=True)
        assert done.finish_reason == "stop" and done.matched_stop == stop
        assert done.text == full.text[:full.text.find(stop)]
        assert done.token_ids == full.token_ids[:k + 1] and done.completion_tokens == k + 1
        assert wait_for(lambda: engine_idle(c))


def test_sampled_streams_are_the_tokenizers_decode_of_their_tokens(client, checkpoints):
    """Text sampled from the random model is full of split and invalid UTF-8: byte tokens,
    tokens that end inside a character, max_tokens ending inside one. The deltas concatenate to
    the tokenizers library's decode of every generated token (nothing lost or doubled at the
    end), every prefix of the stream is a prefix of it, and with a stop string (a U+FFFD of an
    invalid byte too) the text is the decode up to the stop."""
    tok = Tokenizer.from_file(str(checkpoints["llama"] / "tokenizer.json"))
    replaced = 0
    for seed in range(12):
        sampling = dict(max_tokens=12, temperature=3.0, seed=seed, ignore_eos=True)
        deltas = list(client.stream("hi", Sampling(**sampling), return_token_ids=True))
        want = tok.decode([t for d in deltas for t in d.token_ids])
        streamed = ""
        for delta in deltas:
            streamed += delta.text
            assert want.startswith(streamed), (streamed, want)
        assert streamed == want
        replaced += "\ufffd" in want
        for stop in {want[len(want) // 2:][:2], "\ufffd"} - {""}:
            done = client.generate("hi", Sampling(**sampling, stop=(stop,)))
            assert done.text == (want[:want.find(stop)] if stop in want else want)
            assert done.matched_stop == (stop if stop in want else "")
    assert replaced  # some stream did end inside a character or hold an invalid byte


def test_text_held_back_for_a_stop_string_comes_out_when_none_matches(client):
    """The output's last characters, held back because a stop string begins with them, are
    delivered when the stream ends another way (here by length), whole and in the stream too:
    the oracle is the same request without the stop string (they were lost without a test
    that would have seen it)."""
    prompt = "stop string test, a longer prompt"
    sampling = dict(max_tokens=12, temperature=0.0, ignore_eos=True)
    full = client.generate(prompt, Sampling(**sampling))
    assert len(full.text.strip()) >= 2
    stop = (full.text[-2:] + "\x07never",)  # begins with the text's end, never matches
    done = client.generate(prompt, Sampling(**sampling, stop=stop))
    assert (done.text, done.finish_reason, done.matched_stop) == (full.text, "length", "")
    deltas = list(client.stream(prompt, Sampling(**sampling, stop=stop)))
    assert "".join(d.text for d in deltas) == full.text


def test_top_k_and_stop_token_ids_at_the_vocabulary_s_bounds(client):
    """top_k up to the vocabulary size and stop ids up to its last id are served; one past
    either is INVALID_ARGUMENT in the front end's own words (before a slot is taken)."""
    vocab = client.model_info().vocab_size
    done = client.generate("hi", Sampling(max_tokens=3, temperature=1.0, seed=1, top_k=vocab,
                                          stop_token_ids=(vocab - 1,), ignore_eos=True))
    assert done.completion_tokens >= 1
    for sampling, says in ((dict(top_k=vocab + 1), f"top_k must be at most the vocabulary size "
                                                   f"{vocab}"),
                           (dict(stop_token_ids=(vocab,)), f"stop token id {vocab} is outside "
                                                          f"the vocabulary")):
        with pytest.raises(BlinkError) as err:
            client.generate("hi", Sampling(max_tokens=3, **sampling))
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT, sampling
        assert says in err.value.details, (sampling, err.value.details)


def test_stop_strings_at_their_limits(client):
    """At most 16 stop strings of 1 to 256 characters (characters, not bytes: 256 emoji make one
    stop); one past either limit is INVALID_ARGUMENT naming it."""
    stops = tuple(chr(0x4E00 + i) + "😀" * 255 for i in range(16))
    sampling = dict(max_tokens=4, temperature=0.0, ignore_eos=True)
    assert client.generate("hi", Sampling(**sampling, stop=stops)).completion_tokens == 4
    for stop, says in ((stops + ("x",), "at most 16 stop strings"),
                       (("😀" * 257,), "stop strings must be 1 to 256 characters")):
        with pytest.raises(BlinkError) as err:
            client.generate("hi", Sampling(**sampling, stop=stop))
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and says in err.value.details


def test_a_stop_string_completed_by_a_token_that_splits_a_character(client, checkpoints):
    """A byte-level token can hold text and then the first bytes of a character the next token
    finishes (" \\xe4", "λ\\xce"). A stop string such a token completes ends the stream on that
    token, as on any other: its text was held back with the split character, so the stream went
    on for a token or more, and usage and token_ids counted tokens after the one that completed
    the stop. The text is the tokenizers library's decode up to the stop."""
    tok = Tokenizer.from_file(str(checkpoints["llama"] / "tokenizer.json"))
    for seed in range(100):  # sampled text from the random model, until a token splits a char
        sampling = dict(max_tokens=20, temperature=3.0, seed=seed, ignore_eos=True)
        full = client.generate("hi", Sampling(**sampling), return_token_ids=True)
        ids = full.token_ids
        for k in range(1, len(ids)):
            before = tok.decode(ids[:k]).rstrip("\ufffd")
            text = tok.decode(ids[:k + 1])
            shown = text.rstrip("\ufffd")
            if text != shown and len(shown) > len(before) and shown[-1] not in before:
                break
        else:
            continue
        stop = shown[-1]  # completed by token k, which also starts a character it leaves split
        done = client.generate("hi", Sampling(**sampling, stop=(stop,)), return_token_ids=True)
        assert done.finish_reason == "stop" and done.matched_stop == stop
        assert done.text == shown[:shown.find(stop)]
        assert done.token_ids == ids[:k + 1] and done.completion_tokens == k + 1
        return
    pytest.fail("no sampled token split a character")


def test_eos_ends_stream(checkpoints, tmp_path, engine_stack):
    """A checkpoint whose EOS is a token the model produces greedily: generation ends there
    (finish EOS) unless ignore_eos is set."""
    model = tmp_path / "eos-model"
    shutil.copytree(checkpoints["llama"], model)
    prompt = "eos test"
    with BlinkClient(engine_stack(checkpoints["llama"]).target) as c:
        full = c.generate(prompt, GREEDY, return_token_ids=True)
    k = next(i for i, t in enumerate(full.token_ids) if i >= 2 and t not in full.token_ids[:i])
    gen_cfg = json.loads((model / "generation_config.json").read_text())
    gen_cfg["eos_token_id"] = [full.token_ids[k]]
    (model / "generation_config.json").write_text(json.dumps(gen_cfg))
    with BlinkClient(engine_stack(model).target) as c:
        done = c.generate(prompt, Sampling(max_tokens=24, temperature=0.0),
                          return_token_ids=True)
        assert done.finish_reason == "eos" and done.token_ids == full.token_ids[:k + 1]
        assert done.completion_tokens == k + 1
        ignored = c.generate(prompt, GREEDY, return_token_ids=True)
        assert ignored.finish_reason == "length" and ignored.token_ids == full.token_ids


# -- bad input --------------------------------------------------------------------------------

BAD_REQUESTS = [
    (pb.GenerateRequest(text=""), "prompt is empty"),
    (pb.GenerateRequest(), "prompt is empty"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[])), "prompt is empty"),
    (pb.GenerateRequest(text="word " * 600), "context length"),
    (pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=0)),
     "max_tokens must be at least 1"),
    (pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=10_000)),
     "exceeds the context length"),
    (pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(temperature=-0.1)),
     "temperature must be >= 0"),
    (pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(temperature=float("nan"))),
     "temperature must be >= 0"),
    (pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(top_p=0.0)), "top_p must be in"),
    (pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(top_p=1.01)), "top_p must be in"),
    (pb.GenerateRequest(text="hi", model="gpt-17"), "unknown model 'gpt-17'"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 999_999, 2**32 - 1])),
     "token id 999999 is outside the vocabulary"),
    # past int32 too: checked before the ids are taken as int32
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 2**31])),
     "token id 2147483648 is outside the vocabulary"),
    (pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(stop_token_ids=[10**6])),
     "outside the vocabulary"),
    (pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(stop=[""])), "stop strings"),
    (pb.GenerateRequest(text="x" * (1 << 20 | 1)), "the limit is"),
]


class GreedyBeside:
    """A greedy generate of `ids` on a connection of its own, started with the block (the bad
    requests sent in it must not disturb it); .tokens once the block has ended: its ids."""

    def __init__(self, target: str, ids: list[int]):
        self.target, self.ids, self.tokens = target, ids, None
        self._thread = threading.Thread(target=self._run)

    def _run(self):
        with BlinkClient(self.target) as c:
            self.tokens = c.generate(self.ids, GREEDY, return_token_ids=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._thread.join(60)


def test_bad_input_is_invalid_argument_and_others_keep_going(engine, stack, client,
                                                            checkpoints):
    beside_bad = [11, 12, 13, 14, 15]
    expected = client.generate(beside_bad, GREEDY, return_token_ids=True)
    vocab = client.model_info().vocab_size  # the first id outside it, at the boundary
    at_vocab = (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, vocab - 1, vocab])),
                f"token id {vocab} is outside the vocabulary")
    with GreedyBeside(stack.target, beside_bad) as bg, grpc.insecure_channel(stack.target) as ch:
        stub = pb_grpc.BlinkStub(ch)
        for req, message in BAD_REQUESTS + [at_vocab]:
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(req, timeout=30))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (req, err.value)
            assert message in err.value.details(), (message, err.value.details())
    assert_unaffected(engine, checkpoints["llama"], beside_bad, expected, bg.tokens)
    assert client.generate("still serving", GREEDY).completion_tokens == 24


def test_message_over_grpc_limit_is_refused_cleanly(stack, client):
    with grpc.insecure_channel(stack.target) as ch:
        with pytest.raises(grpc.RpcError) as err:
            list(pb_grpc.BlinkStub(ch).Generate(pb.GenerateRequest(text="y" * (4 << 20)),
                                                timeout=30))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert client.generate("still serving", GREEDY).completion_tokens == 24


def test_large_prompts_do_not_hold_up_the_tokenizing_of_others():
    """Megabyte prompts take seconds to tokenize (often to be refused as over the context only
    then): 8 of 2.3 MB took every thread of the event loop's default pool and held a 2-token
    request 44 s on the 2-core VM. Prompts of more than LARGE_PROMPT_CHARS characters, as text
    or as messages, are tokenized on a thread of their own, one at a time: here the tokenizer
    holds the large ones until released, more of them than any default pool has threads, and a
    small request's prompt must still be read; then every large one's."""
    from types import SimpleNamespace

    from blink.nic_service.server import LARGE_PROMPT_CHARS, BlinkServicer, FrontendConfig
    release, started = threading.Event(), []

    class HeldTokenizer:  # the large prompts' tokenizing takes until release
        chat_template = "x"

        def encode(self, text, add_special_tokens):
            if len(text) > LARGE_PROMPT_CHARS:
                started.append(len(text))
                assert release.wait(60)
            return [1, 2, 3]

        def render(self, messages):
            return "".join(m["content"] for m in messages)

    info = SimpleNamespace(model_name="m", vocab_size=100, context_length=64,
                           kv_capacity_tokens=64, eos_ids=(2,))
    servicer = BlinkServicer(FrontendConfig(model_dir=Path("."), ring_name="r"),
                             HeldTokenizer(), SimpleNamespace(info=info))
    large = "x" * (LARGE_PROMPT_CHARS + 1)
    pool = 33  # more than the threads of any default pool (at most 32)

    async def run():
        loop = asyncio.get_running_loop()
        held = [asyncio.create_task(servicer._prepare(pb.GenerateRequest(text=large)))
                for _ in range(pool)]
        held.append(asyncio.create_task(servicer._prepare(chat_request(
            [{"role": "user", "content": large}]))))
        await asyncio.sleep(0.2)
        small = await asyncio.wait_for(servicer._prepare(pb.GenerateRequest(text="hi")), 10)
        assert list(small.prompt_ids) == [1, 2, 3] and started == [len(large)]
        await loop.run_in_executor(None, release.set)
        return await asyncio.wait_for(asyncio.gather(*held), 30)

    try:
        assert len(asyncio.run(run())) == pool + 1 and len(started) == pool + 1
    finally:
        release.set()
        servicer.large_prompts.shutdown()


# -- cancel and deadline ----------------------------------------------------------------------

LONG = Sampling(max_tokens=16000, temperature=0.0, ignore_eos=True)  # seconds of work


def test_cancel_frees_slot_and_blocks(long_stack):
    client = BlinkClient(long_stack.target)
    before = client.stats()
    stream = client.stream("cancel me", LONG)
    got = [next(stream) for _ in range(3)]
    assert all(d.text is not None for d in got)
    stream.cancel()
    assert wait_for(lambda: engine_idle(client)), client.stats()
    after = client.stats()
    assert after["requests_cancelled"] == before["requests_cancelled"] + 1


def test_deadline_frees_slot_and_blocks_others_unaffected(engine, long_stack, long_checkpoint):
    stack = long_stack
    client = BlinkClient(stack.target)
    bystander_prompt = [21, 22, 23, 24]
    expected = client.generate(bystander_prompt, GREEDY, return_token_ids=True)
    before = client.stats()

    async def run():
        async with AsyncBlinkClient(stack.target) as c:
            slow = c.generate("deadline me", LONG, timeout=1.0)
            bystander = c.generate(bystander_prompt, GREEDY, return_token_ids=True, timeout=60)
            return await asyncio.gather(slow, bystander, return_exceptions=True)

    slow, bystander = asyncio.run(run())
    assert isinstance(slow, BlinkError) and slow.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert_unaffected(engine, long_checkpoint, bystander_prompt, expected, bystander)
    assert wait_for(lambda: engine_idle(client)), client.stats()
    assert client.stats()["requests_cancelled"] == before["requests_cancelled"] + 1


# -- more requests than slots -----------------------------------------------------------------

def test_more_requests_than_slots(long_checkpoint, engine_stack):
    stack = engine_stack(long_checkpoint, extra_engine_args=["--slots", "2"],
                         frontend_args=["--queue-timeout", "1.0", "--max-queued", "3"])
    sampling = Sampling(max_tokens=3000, temperature=0.0, ignore_eos=True)

    async def run():
        async with AsyncBlinkClient(stack.target) as c:
            return await asyncio.gather(*(c.generate(f"request {i}", sampling, timeout=60)
                                          for i in range(8)), return_exceptions=True)

    t0 = time.monotonic()
    results = asyncio.run(run())
    elapsed = time.monotonic() - t0
    ok = [r for r in results if not isinstance(r, Exception)]
    errors = [r for r in results if isinstance(r, Exception)]
    assert all(isinstance(e, BlinkError) and e.code == grpc.StatusCode.RESOURCE_EXHAUSTED
               for e in errors), errors
    assert len(ok) >= 2 and errors, (len(ok), errors)
    assert len(errors) >= 8 - 2 - 3  # beyond slots + queue: refused at once
    assert all(r.completion_tokens == 3000 for r in ok)
    assert elapsed < 60  # bounded waiting: nothing hangs
    with BlinkClient(stack.target) as c:
        assert wait_for(lambda: engine_idle(c))
        assert c.generate("after the rush", GREEDY).completion_tokens == 24
    # with a queue timeout longer than the work, everyone waits their turn and finishes
    stack = engine_stack(long_checkpoint, extra_engine_args=["--slots", "2"],
                         frontend_args=["--queue-timeout", "60"])
    sampling = Sampling(max_tokens=100, temperature=0.0, ignore_eos=True)
    results = asyncio.run(run())
    assert all(not isinstance(r, Exception) and r.completion_tokens == 100 for r in results)


# -- engine death and restart -----------------------------------------------------------------

def test_engine_killed_then_restarted(long_checkpoint, engine_stack):
    from grpc_health.v1 import health_pb2
    stack = engine_stack(long_checkpoint, frontend_args=["--engine-timeout", "1.0"])
    frontend_pid = stack.frontend.pid
    client = BlinkClient(stack.target)
    errors = []

    def stream_until_error():
        try:
            for _ in client.stream("long stream", LONG):
                pass
            errors.append(None)
        except BlinkError as e:
            errors.append(e)

    threads = [threading.Thread(target=stream_until_error) for _ in range(3)]
    for t in threads:
        t.start()
    assert wait_for(lambda: client.stats()["sequences_running"] == 3, 10)
    stack.kill_engine()
    t_kill = time.monotonic()
    for t in threads:
        t.join(15)
    assert time.monotonic() - t_kill < 5, "streams must end within a few seconds"
    assert len(errors) == 3 and all(e is not None and e.code == grpc.StatusCode.UNAVAILABLE
                                    for e in errors), errors
    assert client.health() == health_pb2.HealthCheckResponse.ServingStatus.Name(
        health_pb2.HealthCheckResponse.NOT_SERVING)
    with pytest.raises(BlinkError) as err:
        client.generate("while down", GREEDY)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE

    stack.start_engine()
    stack.wait_serving()
    assert stack.frontend.pid == frontend_pid and stack.frontend.poll() is None
    assert client.generate("after restart", GREEDY).completion_tokens == 24
    assert client.stats()["engine_attachments"] == 2

    def counts() -> tuple[int, int, int]:  # summed over both engines
        s = client.stats()
        return s["requests_admitted"], s["requests_finished"], s["requests_cancelled"]
    # the killed engine's three end as cancelled (they stayed in flight for good: admitted
    # less finished and cancelled); the counters are the front end's last read of the
    # header, up to its idle poll old
    assert wait_for(lambda: counts() == (4, 1, 3), 5), counts()
    client.close()


# -- health, reflection, model info -----------------------------------------------------------

def test_reflection_and_model_info(engine, stack, client, checkpoints):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )
    from grpc_reflection.v1alpha import reflection_pb2 as r
    with grpc.insecure_channel(stack.target) as ch:
        services = set(ProtoReflectionDescriptorDatabase(ch).get_services())
        # grpc.reflection.v1 too (what grpcurl asks first); its messages are v1alpha's on the wire
        v1 = ch.stream_stream("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
                              request_serializer=r.ServerReflectionRequest.SerializeToString,
                              response_deserializer=r.ServerReflectionResponse.FromString)
        (answer,) = list(v1(iter([r.ServerReflectionRequest(list_services="")]), timeout=10))
    assert {"blink.v1.Blink", "grpc.health.v1.Health"} <= services
    assert {"blink.v1.Blink", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection"} \
        <= {x.name for x in answer.list_services_response.service}
    info = client.model_info()
    cfg = json.loads((checkpoints["llama"] / "config.json").read_text())
    assert info.name == "llama" and info.architecture == "LlamaForCausalLM"
    assert info.context_length == cfg["max_position_embeddings"]
    assert info.vocab_size == cfg["vocab_size"] and info.has_chat_template
    assert info.engine == {"cpu": "cpu-reference", "cuda": "cuda"}[engine]
    assert client.health() == "SERVING"


def test_chat_messages(client, checkpoints):
    messages = [{"role": "user", "content": "hi there"}]
    done = client.generate(messages, Sampling(max_tokens=4, temperature=0.0, ignore_eos=True))
    # same as sending the rendered template as text without special tokens added again
    from blink.nic_service.chat_template import load_chat_template, render_chat
    tcfg = json.loads((checkpoints["llama"] / "tokenizer_config.json").read_text())
    text = render_chat(load_chat_template(checkpoints["llama"]), messages,
                       bos_token=tcfg["bos_token"], eos_token=tcfg["eos_token"])
    tok = Tokenizer.from_file(str(checkpoints["llama"] / "tokenizer.json"))
    ids = tok.encode(text, add_special_tokens=False).ids
    assert done.prompt_tokens == len(ids)
    assert done.text == client.generate(ids, Sampling(max_tokens=4, temperature=0.0,
                                                      ignore_eos=True)).text


# Renders as the demo model's template does, but refuses a role it does not know, writes without
# end for a message "flood", and loops without end on a conversation of more than 3 messages.
MISBEHAVING_TEMPLATE = (
    "{% if messages | length > 3 %}{% for i in range(100000) %}{% for j in range(100000) %}"
    "{% endfor %}{% endfor %}{% endif %}{{ bos_token }}{% for m in messages %}"
    "{% if m.role not in ('system', 'user', 'assistant') %}"
    "{{ raise_exception('unknown role ' + m.role) }}{% endif %}"
    "{% if m.content == 'flood' %}{% for i in range(1000) %}{{ 'x' * 100000 }}{% endfor %}"
    "{% endif %}{{ m.role }}: {{ m.content }}<|eot|>{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}")


def with_chat_template(model_dir: Path, out: Path, template: str | None) -> Path:
    """A copy of a model folder with another chat template (None: without one)."""
    shutil.copytree(model_dir, out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    if template is not None:
        config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def process_cpu_seconds(pid: int) -> float:
    """A process's user + system CPU time so far, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def chat_request(messages: list[dict[str, str]], **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        messages=pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in messages]),
        sampling=pb.SamplingParams(**sampling))


def test_chats_a_template_refuses_or_cannot_finish_are_invalid_argument(engine, checkpoints,
                                                                        tmp_path, engine_stack):
    """A conversation the template refuses (raise_exception), one it writes more than a prompt
    can be for, one it loops on without end, and none at all: each is INVALID_ARGUMENT saying why,
    while another stream gets every token. The looping render held its front-end thread for good
    (the request hung past its deadline, and a few of them held every thread the front end
    encodes prompts on: text prompts hung too); now it stops within its CPU budget, and the front
    end idles again. No slot is left taken."""
    model = with_chat_template(checkpoints["llama"], tmp_path / "m", MISBEHAVING_TEMPLATE)
    stack = engine_stack(model)
    beside = [11, 12, 13, 14, 15]
    user = {"role": "user", "content": "hi"}
    with BlinkClient(stack.target) as client, grpc.insecure_channel(stack.target) as channel:
        expected = client.generate(beside, GREEDY, return_token_ids=True)
        stub = pb_grpc.BlinkStub(channel)
        with GreedyBeside(stack.target, beside) as bg:
            for messages, says in (
                    ([user] * 4, "the chat template did not finish within 5 s of CPU"),
                    ([{"role": "intruder", "content": "hi"}],
                     "the chat template rejected the conversation: unknown role intruder"),
                    ([{"role": "user", "content": "flood"}],
                     "the chat template wrote more than 67,108,864 characters"),
                    ([], "messages is empty")):
                with pytest.raises(grpc.RpcError) as err:
                    list(stub.Generate(chat_request(messages, max_tokens=4), timeout=30))
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
                assert says in err.value.details(), err.value.details()
        assert_unaffected(engine, checkpoints["llama"], beside, expected, bg.tokens)
        # nothing still renders: the front end's process idles
        spent = process_cpu_seconds(stack.frontend.pid)
        time.sleep(1.0)
        assert process_cpu_seconds(stack.frontend.pid) - spent < 0.5
        chat = client.generate([user] * 3, Sampling(max_tokens=4, temperature=0.0))
        assert chat.completion_tokens == 4
        assert client.generate("still serving", GREEDY).completion_tokens == 24
        assert wait_for(lambda: engine_idle(client))


def test_a_model_without_a_chat_template_refuses_chats(checkpoints, tmp_path, engine_stack):
    model = with_chat_template(checkpoints["llama"], tmp_path / "m", None)
    with BlinkClient(engine_stack(model).target) as client:
        assert not client.model_info().has_chat_template
        with pytest.raises(BlinkError) as err:
            client.generate([{"role": "user", "content": "hi"}], Sampling(max_tokens=2))
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "this model has no chat template" in err.value.details
        assert client.generate("hi", Sampling(max_tokens=2)).completion_tokens == 2


def test_a_chat_template_that_does_not_compile_stops_the_front_end_at_start(checkpoints,
                                                                            tmp_path):
    """A syntax error in the model folder's template: one line when the front end starts (it
    served, reported a chat template, and refused every chat as the client's INVALID_ARGUMENT)."""
    model = with_chat_template(checkpoints["llama"], tmp_path / "m",
                               "{% for m in messages %}{{ m.content }}")
    out = subprocess.run(
        [sys.executable, "-m", "blink.client.cli", "frontend", "--model", str(model),
         "--ring-name", f"blink-test-template-{secrets.token_hex(4)}", "--port", "0"],
        capture_output=True, text=True, timeout=30)
    assert out.returncode != 0 and "syntax error on line 1" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_kv_pressure_preempts_and_every_token_follows_the_reference(engine, checkpoints,
                                                                   engine_stack):
    """12 KV blocks for 6 concurrent 30 + 40-token greedy requests (5 blocks each when done):
    sequences are preempted and recomputed, and every token of every request is still the
    transformers reference's argmax after its own prefix (or a near-tie, tests/oracle.py);
    all blocks come back."""
    import random

    from oracle import check_teacher_forced
    if engine == "cuda":
        pytest.skip("the float32 oracle's near-tie rule does not fit bf16 logits: the CUDA "
                    "engine's preemption test is in test_cuda_engine.py (bf16 reference)")
    model_dir = checkpoints["llama"]
    stack = engine_stack(model_dir, extra_engine_args=[
        "--num-kv-blocks", "12", "--block-size", "16", "--max-num-seqs", "8",
        "--max-batched-tokens", "64"])
    stack.wait_serving()
    rnd = random.Random(11)
    prompts = [[rnd.randrange(8, 2000) for _ in range(30)] for _ in range(6)]
    greedy = Sampling(max_tokens=40, temperature=0.0, ignore_eos=True)

    async def run():
        async with AsyncBlinkClient(stack.target) as client:
            return await asyncio.gather(*(client.generate(p, greedy, return_token_ids=True)
                                          for p in prompts))
    done = asyncio.run(run())
    assert sum(c.preemptions for c in done) > 0
    for prompt, completion in zip(prompts, done):
        assert len(completion.token_ids) == 40
        check_teacher_forced(model_dir, prompt, list(completion.token_ids))
    with BlinkClient(stack.target) as client:
        stats = client.stats()
    assert stats["preemptions"] == sum(c.preemptions for c in done)
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] == 12
