"""The whole serving path on a CPU: client -> real gRPC port -> front end -> shm ring ->
reference engine -> ring -> front end -> client, checked against transformers."""
from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest
from oracle import check_greedy, check_teacher_forced, hf_greedy
from test_prefix_cache import assert_all_blocks_back
from tokenizers import Tokenizer

from blink.client.sdk import AsyncBlinkClient, BlinkClient, Sampling

pytestmark = pytest.mark.slow

PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "你好，世界！今天天气很好。",
    "日本語のテキストも大丈夫ですか？",
    "한국어 문장도 테스트합니다.",
    "Emoji: 🙂🚀🔥 and a family 👨‍👩‍👧‍👦 with skin tones 👍🏽",
    "Combining marks: e\u0301 a\u0300 n\u0303 o\u0308 — Zalgo: Z\u0336\u0351a\u0337\u0353",
    "Ünïcödé accents: café, naïve, façade, jalapeño",
    "Русский текст и ελληνικά γράμματα",
    "مرحبا بالعالم",
    "   leading and trailing spaces   ",
    "tabs\tand\nnewlines\n\n",
    "1234567890 + 987654321 = ?",
    "a",
    "!!!???...",
    "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is",
    "<html><body><p>markup</p></body></html>",
    "Mixed: English, 中文, 🙂, and मराठी भाषा",
    " ".join(["long"] * 120),
]


@pytest.fixture(scope="module")
def stacks(checkpoints, tmp_path_factory):
    from conftest import BlinkStack
    started = {}

    def get(arch: str) -> BlinkStack:
        if arch not in started:
            stack = BlinkStack(checkpoints[arch], tmp_path_factory.mktemp(f"stack-{arch}"),
                               engine_args=["--max-batched-tokens", "256"])
            started[arch] = stack
            stack.start_engine()
            stack.start_frontend()
            stack.wait_serving()
        return started[arch]

    yield get
    for stack in started.values():
        stack.stop()


async def _generate_all(target: str, prompts, sampling_for) -> list:
    async with AsyncBlinkClient(target) as client:
        return await asyncio.gather(*(
            client.generate(p, sampling_for(i), return_token_ids=True, timeout=120)
            for i, p in enumerate(prompts)))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_matches_transformers(arch, stacks, checkpoints):
    stack = stacks(arch)
    tok = Tokenizer.from_file(str(checkpoints[arch] / "tokenizer.json"))
    n = 12
    eos = set(BlinkClient(stack.target).model_info().eos_token_ids)
    results = asyncio.run(_generate_all(
        stack.target, PROMPTS, lambda i: Sampling(max_tokens=n, temperature=0.0)))
    outcomes = []
    for prompt, done in zip(PROMPTS, results):
        ids = tok.encode(prompt).ids
        assert done.prompt_tokens == len(ids)
        ours = list(done.token_ids)
        ref = hf_greedy(checkpoints[arch], ids, n)
        outcome = check_greedy(checkpoints[arch], ids, ours, ref[:len(ours)])
        assert done.completion_tokens == len(ours)  # every token's id, the EOS one too
        if done.finish_reason == "eos":
            # our stream ended with an EOS token (its id returned, its text not); so must the
            # reference
            assert ours[-1] in eos
            if outcome == "exact":
                assert ref == ours, (ours, ref)
        else:
            assert done.finish_reason == "length" and done.completion_tokens == n == len(ours)
            if outcome == "exact":
                assert ref == ours
        outcomes.append(outcome)
        # the streamed text is the tokenizers library's decode of the same tokens
        assert done.text == tok.decode(list(done.token_ids), skip_special_tokens=True)
    assert outcomes.count("exact") >= len(PROMPTS) - 2, outcomes


def solo_and_staggered(target: str, prompts: list[list[int]], lengths: list[int], *,
                       spread_s: float, timeout: float, rnd: random.Random, during=None):
    """Each prompt's greedy run alone, one after another, then all of them again at random
    times within spread_s (arrivals while others generate), `during` (if given) running in a
    thread meanwhile: (solo Completions, staggered Completions), in prompt order."""
    def sampling(i):
        return Sampling(max_tokens=lengths[i], temperature=0.0, ignore_eos=True)

    with BlinkClient(target) as client:
        solo = [client.generate(p, sampling(i), return_token_ids=True)
                for i, p in enumerate(prompts)]

    async def staggered():
        async with AsyncBlinkClient(target) as client:
            async def one(i):
                await asyncio.sleep(rnd.random() * spread_s)
                return await client.generate(prompts[i], sampling(i), return_token_ids=True,
                                             timeout=timeout)
            return await asyncio.gather(*(one(i) for i in range(len(prompts))))

    watcher = threading.Thread(target=during) if during else None
    if watcher:
        watcher.start()
    together = asyncio.run(staggered())
    if watcher:
        watcher.join(60)
    return solo, together


def test_64_concurrent_streams_equal_solo_runs(stacks, checkpoints):
    stack = stacks("llama")
    rnd = random.Random(5)
    prompts = [[rnd.randrange(3, 2000) for _ in range(rnd.randrange(1, 120))] for _ in range(64)]
    lengths = [rnd.randrange(1, 40) for _ in range(64)]
    solo, together = solo_and_staggered(stack.target, prompts, lengths, spread_s=0.5,
                                        timeout=300, rnd=rnd)
    for i, (a, b) in enumerate(zip(solo, together)):
        assert b.completion_tokens == lengths[i]
        if a.token_ids != b.token_ids:  # allowed only at near-ties of the reference
            check_teacher_forced(checkpoints["llama"], prompts[i], list(a.token_ids))
            check_teacher_forced(checkpoints["llama"], prompts[i], list(b.token_ids))
    with BlinkClient(stack.target) as client:
        assert_all_blocks_back(client)


def test_stream_interval_sends_fewer_messages_with_the_same_tokens(stacks, checkpoints, make_stack):
    """--stream-interval-ms through a real front end: the same greedy tokens as one message per
    step, in fewer messages (several tokens each): after the first message, at most one per
    interval, plus the last."""
    prompt, sampling = [5, 6, 7, 8], Sampling(max_tokens=40, temperature=0.0, ignore_eos=True)

    def chunks(stack):
        with BlinkClient(stack.target) as client:
            t0 = time.monotonic()
            got = [list(d.token_ids) for d in client.stream(prompt, sampling,
                                                            return_token_ids=True)]
            return [c for c in got if c], time.monotonic() - t0  # (the end may carry none)
    every, _ = chunks(stacks("llama"))
    grouped, elapsed = chunks(make_stack(checkpoints["llama"],
                                         frontend_args=["--stream-interval-ms", "100"]))
    assert sum(every, []) == sum(grouped, []) and len(sum(every, [])) == 40
    assert len(grouped) < len(every) and max(map(len, grouped)) > 1
    assert len(grouped) <= 2 + elapsed / 0.1, (len(grouped), elapsed)
