"""Continuous batching with chunked prefill and recompute preemption.

The same decisions the GPU scheduler kernel makes (it is checked against the vectors in
tests/vectors/ that this implementation produces): which sequences compute how many tokens this
step, and who is preempted when KV blocks run out.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from blink.gpu_engine.block_manager import KvBlockPool
from blink.gpu_engine.sequence import SeqStatus, Sequence


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64               # sequences in one step at most
    max_num_batched_tokens: int = 512    # token budget of one step (prefill chunks + decodes)
    max_model_len: int = 2048            # context length: prompt + output

    def __post_init__(self):
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.max_model_len < 2:
            raise ValueError(f"invalid scheduler config: {self}")


@dataclass
class StepPlan:
    # (sequence, tokens it computes this step), in batch order; the counts sum to num_tokens
    # and each is <= the sequence's num_pending.
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    # sequences evicted this step (blocks freed, back to the waiting queue for recompute)
    preempted: list[Sequence] = field(default_factory=list)
    # how many of `scheduled`'s last entries were admitted from the waiting queue this step
    # (each one's cached_tokens: its prefix cache hit)
    num_admitted: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: KvBlockPool):
        self.config = config
        self.pool = pool
        self.waiting: deque[Sequence] = deque()   # FCFS; preempted sequences go to the front
        self.running: list[Sequence] = []         # arrival order

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule_step(self) -> StepPlan:
        """Invariant: every scheduled sequence's computed tokens catch up with its known tokens
        under one token budget. Running sequences go first (oldest first); when the pool cannot
        hold a running sequence's next tokens, the newest running sequence is preempted, until
        it fits or it is the one preempted. Waiting sequences are admitted FCFS while budget,
        sequence slots and blocks last; admission never preempts. An admitted sequence first
        takes the cached blocks of its longest cached prefix (prefix caching) and computes
        from there."""
        plan = StepPlan()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_pending, budget)
            while not self.pool.can_grow(seq, seq.num_computed + n):
                victim = self.running.pop()
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is seq:
                    break
            else:
                self.pool.grow(seq, seq.num_computed + n)
                plan.scheduled.append((seq, n))
                budget -= n
                i += 1
        while (self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs
               and not plan.preempted):
            seq = self.waiting[0]
            hit = self.pool.match(seq)
            n = min(seq.num_tokens - len(hit) * self.pool.block_size, budget)
            # admitted only when all of its tokens fit beside the running ones, though it takes
            # the blocks of this step's chunk alone: admitted on its first chunk's room, a long
            # prompt under KV pressure was preempted (as the newest) chunks later and admitted
            # again, its prefill recomputed time after time
            if not self.pool.can_admit(seq, hit, seq.num_tokens):
                break
            self.waiting.popleft()
            self.pool.admit(seq, hit)
            self.pool.grow(seq, seq.num_computed + n)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            plan.scheduled.append((seq, n))
            plan.num_admitted += 1
            budget -= n
        return plan

    def _preempt(self, seq: Sequence) -> None:
        self.pool.release(seq)
        seq.num_computed = 0
        seq.preemptions += 1
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    def register(self, plan: StepPlan) -> None:
        """After the plan's forward pass (computed counts committed): the full blocks it
        completed join the prefix cache, in plan order."""
        for seq, _ in plan.scheduled:
            self.pool.register(seq)

    def finish(self, seq: Sequence) -> None:
        """Retires a sequence from wherever it is and frees its blocks."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        self.pool.release(seq)
        seq.status = SeqStatus.FINISHED
