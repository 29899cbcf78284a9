"""Per-request state on the engine side: one `Sequence` per admitted ring slot."""
from __future__ import annotations

import array
import enum
from dataclasses import dataclass, field


class SeqStatus(enum.Enum):
    WAITING = "waiting"    # admitted, holds no KV blocks (new, or preempted for recompute)
    RUNNING = "running"    # holds KV blocks for its computed tokens
    FINISHED = "finished"


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0           # 0: off
    seed: int = 0
    ignore_eos: bool = False
    stop_ids: frozenset[int] = frozenset()


@dataclass
class Sequence:
    slot: int                # ring slot the request came in and its output goes to
    gen: int                 # the slot's generation for this request
    arrival: int             # front end's request id: FCFS order
    prompt: list[int]
    params: SamplingParams
    # the slot's cache_salt word (ring.layout.cache_salt_word): the prefix cache's namespace
    cache_salt: int = 0
    output: list[int] = field(default_factory=list)
    # Tokens whose K/V are in this sequence's blocks. Invariant kept by the scheduler:
    # num_computed <= num_tokens, and the sequence samples exactly when a step brings
    # num_computed up to num_tokens (the last known token has been computed).
    num_computed: int = 0
    # KV blocks in order; an int32 array rather than a list so that a step copies each table into
    # the batch's block_tables with one memcpy (a list is converted element by element)
    block_table: array.array = field(default_factory=lambda: array.array("i"))
    # With prefix caching: the cache uid of each of its first full computed blocks (all cached:
    # KvBlockPool.register), the identity its next block is keyed by
    block_uids: list[int] = field(default_factory=list)
    cached_tokens: int = 0   # prompt tokens its first admission took from the prefix cache
    status: SeqStatus = SeqStatus.WAITING
    preemptions: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def num_pending(self) -> int:
        return self.num_tokens - self.num_computed

    def token_range(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output without building the whole list."""
        p = len(self.prompt)
        if end <= p:
            return self.prompt[start:end]
        if start >= p:
            return self.output[start - p:end - p]
        return self.prompt[start:] + self.output[:end - p]
