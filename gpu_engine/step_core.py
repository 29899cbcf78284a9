"""One engine step's decisions on plain state, without a ring or a model.

The engines (ReferenceEngine and its subclasses) add the ring's I/O and a forward pass around
it; the scheduler parity test's replay (tests/test_scheduler_parity.py) drives it directly, so
the decisions it checks against the GPU scheduler's header (csrc/scheduler.cuh) are the code the
Python engines run. A step, as the kernel's loop makes it:

    admit(seq) for each new request      a reused slot drops the sequence it held
    retire(seq) for each cancelled one
    plan = schedule()                     admission (prefix cache hits), chunked prefill, preemption
    samplers = commit(plan)               after the forward pass: computed counts, full blocks
                                          into the prefix cache
    accept(seq, token) for each sampler   the token, then the stop check; retire when finished
"""
from __future__ import annotations

from typing import Callable

from blink.gpu_engine.scheduler import Scheduler, StepPlan
from blink.gpu_engine.sequence import Sequence
from blink.ring.layout import FinishReason


def eos_finish(seq: Sequence, token: int, eos_ids: frozenset[int],
               context_length: int) -> tuple[FinishReason, int]:
    """The stop check after a token is appended: (NONE, 0) while the sequence goes on."""
    p = seq.params
    if token in eos_ids and not p.ignore_eos:
        return FinishReason.EOS, token
    if token in p.stop_ids:
        return FinishReason.STOP_TOKEN, token
    if len(seq.output) >= p.max_tokens:
        return FinishReason.LENGTH, 0
    if seq.num_tokens >= context_length:
        return FinishReason.CONTEXT_FULL, 0
    return FinishReason.NONE, 0


def samples_now(seq: Sequence, n: int) -> bool:
    """Whether computing n more of seq's tokens this step reaches its end: a token is sampled."""
    return seq.num_computed + n == seq.num_tokens


def plan_samplers(plan: StepPlan) -> list[Sequence]:
    """The plan's sequences that sample a token this step, in plan order (before commit)."""
    return [seq for seq, n in plan.scheduled if samples_now(seq, n)]


class StepCore:
    """The active sequences by slot and the step's decisions over them. queue / drop put a
    sequence into / take it out of whatever schedules it (default: the scheduler; the
    transformers peer keeps its own static batches)."""

    def __init__(self, scheduler: Scheduler | None, eos_ids: frozenset[int], context_length: int,
                 *, queue: Callable[[Sequence], None] | None = None,
                 drop: Callable[[Sequence], None] | None = None):
        self.scheduler = scheduler
        self.eos_ids = eos_ids
        self.context_length = context_length
        self.queue = queue or scheduler.add
        self.drop = drop or scheduler.finish
        self.active: dict[int, Sequence] = {}  # slot -> its sequence

    def admit(self, seq: Sequence) -> Sequence | None:
        """A new request; returns the sequence its slot held, dropped (the front end gave up
        on it and reused the slot)."""
        stale = self.reject(seq.slot)
        self.queue(seq)
        self.active[seq.slot] = seq
        return stale

    def reject(self, slot: int) -> Sequence | None:
        """A new generation of `slot` that the engine rejected: the sequence the slot held is
        dropped all the same (the front end gave up on it, as in admit; left running, it wrote
        into the rejected generation's record)."""
        stale = self.active.pop(slot, None)
        if stale is not None:
            self.drop(stale)
        return stale

    def retire(self, seq: Sequence) -> None:
        self.drop(seq)
        del self.active[seq.slot]

    def schedule(self) -> StepPlan:
        return self.scheduler.schedule_step()

    def commit(self, plan: StepPlan) -> list[Sequence]:
        """After the forward pass: the computed counts, then the blocks they filled into the
        prefix cache; returns the sequences that sample, in plan order."""
        samplers = plan_samplers(plan)
        for seq, n in plan.scheduled:
            seq.num_computed += n
        self.scheduler.register(plan)
        return samplers

    def accept(self, seq: Sequence, token: int) -> tuple[FinishReason, int]:
        """A sampled token joins the output; (reason, detail) of the stop check. The caller
        retires the sequence when the reason is not NONE (after publishing it)."""
        seq.output.append(token)
        return eos_finish(seq, token, self.eos_ids, self.context_length)
