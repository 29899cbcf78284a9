"""The GPU scheduler's logic (gpu_engine/csrc/scheduler.cuh) makes exactly the Python reference's
decisions: the same plans, block tables, queues, stop and reject reasons, CRCs and uniforms.

Both sides run the same event stream. The Python side (`PyReplay`) applies it to the engines'
own step core (gpu_engine/step_core.py: StepCore over Scheduler and KvBlockPool, the code
ReferenceEngine runs); the C++ side is
tests/csrc/sched_replay.cc (its header comment defines the event and output format) built with
g++. tests/vectors/scheduler_vectors.txt freezes a few scenarios with their expected output for
the CUDA kernel's own GPU test; regenerate it with
    python tests/test_scheduler_parity.py --write-vectors
"""
from __future__ import annotations

import random
import re
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from gpu import requires_gpu

from blink.gpu_engine.block_manager import KvBlockPool, blocks_for
from blink.gpu_engine.ring_server import ModelLimits, validate_slot
from blink.gpu_engine.sampling import splitmix64, uniform
from blink.gpu_engine.scheduler import Scheduler, SchedulerConfig
from blink.gpu_engine.sequence import SamplingParams, SeqStatus, Sequence
from blink.gpu_engine.step_core import StepCore
from blink.ring import layout
from blink.ring.layout import (
    MAX_EOS_IDS, MAX_STOP_IDS, SLOT_DTYPE, FinishReason, RejectReason, RingGeometry, SlotRequest,
    encode_slot,
)

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "gpu_engine" / "csrc"
REPLAY_SRC = ROOT / "tests" / "csrc" / "sched_replay.cc"
VECTORS = ROOT / "tests" / "vectors" / "scheduler_vectors.txt"
ONE = 0x3F800000  # 1.0f


def f32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def f32_from_bits(b: int) -> float:
    return struct.unpack("<f", struct.pack("<I", b))[0]


# -- the Python side of a scenario ------------------------------------------------------------

class PyReplay:
    """Runs scenario events against the Python reference; `run` returns the lines sched_replay
    prints for the event."""

    def __init__(self):
        self.core: StepCore | None = None
        self.samplers: list[int] = []  # slots that sample after the last step, plan order

    @property
    def active(self) -> dict[int, Sequence]:
        return self.core.active if self.core else {}

    def run(self, line: str) -> list[str]:
        op, *fields = line.split()
        return getattr(self, "_" + op)(*fields)

    def _config(self, *f):
        (num_slots, max_model_len, block_size, num_blocks, max_num_seqs, budget, prefix_caching,
         ctx, neos) = (int(x, 0) for x in f[:9])
        self.pool = KvBlockPool(num_blocks, block_size, bool(prefix_caching))
        self.sched = Scheduler(SchedulerConfig(max_num_seqs, budget, max_model_len), self.pool)
        self.core = StepCore(self.sched, frozenset(int(x, 0) for x in f[9:9 + neos]), ctx)
        return []

    def _add(self, *f):
        v = [int(x, 0) for x in f]
        slot, gen, arrival, max_tokens, temp, top_p, top_k, seed, salt, ignore_eos, nstop = v[:11]
        stop_ids, rest = v[11:11 + nstop], v[11 + nstop:]
        prompt = rest[1:1 + rest[0]]
        params = SamplingParams(max_tokens=max_tokens, temperature=f32_from_bits(temp),
                                top_p=f32_from_bits(top_p), top_k=top_k, seed=seed,
                                ignore_eos=bool(ignore_eos), stop_ids=frozenset(stop_ids))
        self.core.admit(Sequence(slot, gen, arrival, prompt, params, salt))
        return []

    def _finish(self, slot):
        self.core.retire(self.core.active[int(slot)])
        return []

    def _step(self):
        plan = self.core.schedule()
        self.samplers = [s.slot for s in self.core.commit(plan)]
        sched = ",".join(f"{s.slot}:{n}" for s, n in plan.scheduled)
        pre = ",".join(f"{s.slot}:{s.preemptions}" for s in plan.preempted)
        smp = ",".join(map(str, self.samplers))
        run = ",".join(f"{s.slot}:" + ".".join(map(str, s.block_table))
                       for s in self.sched.running)
        wait = ",".join(str(s.slot) for s in self.sched.waiting)
        adm = ",".join(f"{s.slot}:{s.cached_tokens}"
                       for s, _ in plan.scheduled[len(plan.scheduled) - plan.num_admitted:])
        p = self.pool
        cache = f"{p.num_cached}:{p.num_evictable}:{p.evicted_blocks}:{p.hit_tokens}:" \
                f"{p.query_tokens}"
        return [f"step sched={sched} pre={pre} smp={smp} run={run} wait={wait} "
                f"free={p.num_free} adm={adm} cache={cache}"]

    def _sample(self, slot, token):
        slot, token = int(slot), int(token)
        seq = self.core.active[slot]
        assert seq.status is SeqStatus.RUNNING and seq.num_computed == seq.num_tokens
        reason, detail = self.core.accept(seq, token)
        if reason is not FinishReason.NONE:
            self.core.retire(seq)
        return [f"sample {slot} {token} {int(reason)} {detail}"]

    def _validate(self, vocab, ctx, kvcap, max_prompt, fixed_hex, ntok, *tokens):
        fixed = np.frombuffer(bytes.fromhex(fixed_hex), SLOT_DTYPE)[0]
        prompt = np.array([int(t, 0) for t in tokens], np.int32)
        # RingServer.poll hands over min(prompt_len, max_prompt_tokens) tokens
        assert prompt.size == int(ntok) == min(int(fixed["prompt_len"]), int(max_prompt, 0))
        limits = ModelLimits(int(vocab, 0), int(ctx, 0), int(kvcap, 0))
        return [f"validate {int(validate_slot(fixed, prompt, limits))}"]

    def _crc(self, gen, split, payload_hex):
        payload = b"" if payload_hex == "-" else bytes.fromhex(payload_hex)
        crc = zlib.crc32(payload, zlib.crc32(struct.pack("<I", int(gen, 0))))
        return [f"crc {crc} {crc}"]

    def _uniform(self, seed, step):
        seed, step = int(seed, 0), int(step, 0)
        bits = struct.unpack("<Q", struct.pack("<d", uniform(seed, step)))[0]
        return [f"uniform {seed} {step} {splitmix64(seed):016x} {bits:016x}"]


def expected(events: list[str]) -> list[tuple[str, list[str]]]:
    rep = PyReplay()
    return [(e, rep.run(e)) for e in events]


# -- scenario generators ----------------------------------------------------------------------

def add_line(slot, gen, arrival, prompt, max_tokens, *, temperature=ONE, top_p=ONE, top_k=0,
             seed=0, cache_salt=0, ignore_eos=0, stop_ids=()) -> str:
    return " ".join(map(str, [
        "add", slot, gen, arrival, max_tokens, hex(temperature), hex(top_p), top_k, seed,
        hex(cache_salt), ignore_eos, len(stop_ids), *stop_ids, len(prompt), *prompt]))


def random_workload(seed: int, steps: int, **overrides) -> list[str]:
    """Random arrivals (sometimes into a live slot), prompt lengths, max_tokens (sometimes past
    the context), cancels, tokens that hit EOS or stop ids, tiny pools that force preemption,
    small max_num_seqs and budgets, prefix caching on or off, prompts that share prefixes (a
    few fixed ones, or an earlier request's prompt and output: a chat's next turn), under a few
    cache salts (none among them; words with and without their top bit, which name the same
    namespace) or none at all. Returns the
    event lines. `overrides` fix config values: prompts are at most prompt_frac of the context,
    output_frac > 0 favours long outputs, p_shared is how often a prompt reuses a prefix."""
    rng = random.Random(seed)
    c = dict(num_slots=rng.randint(1, 10), block_size=rng.choice([1, 2, 3, 4, 8, 16]),
             ctx=rng.randint(3, 48), max_num_seqs=rng.randint(1, 6),
             budget=rng.choice([1, 2, 3, rng.randint(4, 24), rng.randint(25, 96)]),
             vocab=rng.choice([8, 40]), p_arrive=rng.uniform(0.2, 1.0),
             p_cancel=rng.choice([0.0, 0.05, 0.2]), prompt_frac=1.0, output_frac=0.0,
             prefix_caching=int(rng.random() < 0.75), p_shared=rng.choice([0.0, 0.5, 0.9]))
    # the salts from a generator of their own: each seed's scenario stays what it was before
    # salts existed, but for them
    salt_rng = random.Random(seed ^ 0x5A17)
    c["salts"] = salt_rng.choice([(0,), (0,), (0, 1 << 63 | 5, 5, 2 ** 64 - 1)])
    c["max_model_len"] = c["ctx"] + rng.choice([0, 0, 1, 7])
    min_blocks = blocks_for(c["ctx"], c["block_size"])  # one sequence alone always fits
    c["num_blocks"] = rng.randint(min_blocks, 2 * min_blocks + 1)
    if rng.random() < 0.35:  # memory pressure: many sequences, blocks for little more than one
        c.update(num_blocks=rng.randint(min_blocks, min_blocks + 3), p_arrive=1.0,
                 max_num_seqs=rng.randint(3, 6), budget=rng.randint(8, 64),
                 prompt_frac=rng.choice([0.3, 1.0]), output_frac=rng.choice([0.0, 0.5]))
    c.update(overrides)
    eos = rng.sample(range(c["vocab"]), rng.randint(0, min(3, MAX_EOS_IDS)))
    events: list[str] = []
    rep = PyReplay()

    def emit(line: str) -> None:
        events.append(line)
        rep.run(line)

    emit(" ".join(map(str, ["config", c["num_slots"], c["max_model_len"], c["block_size"],
                            c["num_blocks"], c["max_num_seqs"], c["budget"],
                            c["prefix_caching"], c["ctx"], len(eos), *eos])))
    prefixes = [[rng.randrange(c["vocab"]) for _ in range(c["ctx"])] for _ in range(3)]
    history: list[list[int]] = []  # earlier requests' prompt + output, as a chat resends them
    gens = [0] * c["num_slots"]
    request_id = 0
    ctx = c["ctx"]
    for _ in range(steps):
        while rng.random() < c["p_arrive"] * 0.6:
            free = [s for s in range(c["num_slots"]) if s not in rep.active]
            if not free and rng.random() < 0.9:
                break
            reuse = not free or rng.random() < 0.05  # into a live slot: the old one is dropped
            slot = rng.randrange(c["num_slots"]) if reuse else rng.choice(free)
            gens[slot] += 1
            request_id += rng.randint(1, 3)
            plen = rng.randint(1, max(1, int((ctx - 1) * c["prompt_frac"])))
            prompt = [rng.randrange(c["vocab"]) for _ in range(plen)]
            if rng.random() < c["p_shared"]:
                shared = rng.choice(prefixes + history[-4:])
                keep = min(len(shared), rng.randint(plen // 2, plen))
                prompt[:keep] = shared[:keep]
            if rng.random() < 0.85:  # outputs of at least output_frac of the room left
                max_tokens = rng.randint(max(1, int((ctx - plen) * c["output_frac"])), ctx - plen)
            else:  # more than the context holds: ends with CONTEXT_FULL
                max_tokens = rng.randint(ctx - plen + 1, 2 * ctx)
            stop_ids = rng.sample(range(c["vocab"]), rng.randint(0, 3))
            if slot in rep.active:
                history.append(rep.active[slot].token_range(0, rep.active[slot].num_tokens))
            emit(add_line(slot, gens[slot], request_id, prompt, max_tokens,
                          seed=rng.getrandbits(64), cache_salt=salt_rng.choice(c["salts"]),
                          ignore_eos=int(rng.random() < 0.3), stop_ids=stop_ids))
        if rep.active and rng.random() < c["p_cancel"]:
            emit(f"finish {rng.choice(sorted(rep.active))}")
        emit("step")
        for slot in rep.samplers:
            stops = sorted(rep.active[slot].params.stop_ids)
            r = rng.random()
            if r < 0.05 and eos:
                token = rng.choice(eos)
            elif r < 0.08 and stops:
                token = rng.choice(stops)
            else:
                token = rng.randrange(c["vocab"])
            seq = rep.active[slot]
            emit(f"sample {slot} {token}")
            if rep.active.get(slot) is not seq:  # it finished: a chat's next turn resends it
                history.append(seq.token_range(0, seq.num_tokens))
    return events


def adversarial_workload(seed: int, steps: int = 80) -> list[str]:
    """Workloads aimed at the prefix cache's edges: most prompts copy a live sequence's prompt
    and output (a chat turn sent while the last one still runs), a finished one's or a fixed
    one's, cut at a block boundary, one token before or after it, whole, or with a few tokens
    more; pools from exactly one longest sequence's blocks (every third seed: every slot busy,
    long outputs) to a few times that; block sizes 1 to 16, budgets from 1 token to past a
    block; cancels that favour preempted sequences; slots reused while live; then no arrivals
    until every sequence has ended (a leak or a deadlock shows). Returns the event lines."""
    rng = random.Random(seed)
    bs = rng.choice([1, 1, 2, 3, 4, 5, 8, 16])
    ctx = rng.randint(3, 64)
    least = blocks_for(ctx - 1, bs)  # a sequence computes ctx - 1 tokens at most
    c = dict(num_slots=rng.randint(1, 10), max_model_len=ctx + rng.choice([0, 0, 1, 5]),
             num_blocks=rng.choice([least, least, least + 1, least + 3, 2 * least + 2,
                                    4 * least]),
             max_num_seqs=rng.randint(1, 8),
             budget=rng.choice([1, 2, bs, bs + 1, rng.randint(3, 40), 200]),
             prefix_caching=int(rng.random() < 0.85), vocab=rng.choice([3, 4, 40]),
             p_arrive=rng.uniform(0.2, 1.0), p_cancel=rng.choice([0.0, 0.1, 0.3]),
             p_copy=rng.choice([0.3, 0.7, 0.95]),
             salts=rng.choice([(0,), (0, 5, 1 << 63 | 5, 9)]))
    if seed % 3 == 0:
        c.update(num_blocks=rng.choice([least, least + 1, least + 2]), p_arrive=1.0,
                 num_slots=rng.randint(4, 10), max_num_seqs=rng.randint(3, 8),
                 budget=rng.randint(bs + 1, 64))
    eos = rng.sample(range(c["vocab"]), rng.randint(0, 2))
    events: list[str] = []
    rep = PyReplay()

    def emit(line: str) -> None:
        events.append(line)
        rep.run(line)

    def sample_all() -> None:
        for slot in rep.samplers:
            token = rng.choice(eos) if eos and rng.random() < 0.03 else rng.randrange(c["vocab"])
            seq = rep.active[slot]
            emit(f"sample {slot} {token}")
            if rep.active.get(slot) is not seq:
                finished.append(seq.token_range(0, seq.num_tokens))

    emit(" ".join(map(str, ["config", c["num_slots"], c["max_model_len"], bs, c["num_blocks"],
                            c["max_num_seqs"], c["budget"], c["prefix_caching"], ctx, len(eos),
                            *eos])))
    fixed = [[rng.randrange(c["vocab"]) for _ in range(ctx)] for _ in range(2)]
    finished: list[list[int]] = []
    gens = [0] * c["num_slots"]
    request_id = 0
    for _ in range(steps):
        while rng.random() < c["p_arrive"] * 0.6:
            free = [s for s in range(c["num_slots"]) if s not in rep.active]
            if not free and rng.random() < 0.8:
                break
            slot = rng.choice(free) if free and rng.random() < 0.95 \
                else rng.randrange(c["num_slots"])
            gens[slot] += 1
            request_id += 1
            sources = [q.token_range(0, q.num_tokens) for q in rep.active.values()]
            sources += finished[-4:] + fixed
            if rng.random() < c["p_copy"]:
                source = rng.choice(sources)
                k = rng.randint(0, len(source) // bs)
                cut = rng.choice([len(source), len(source), k * bs, k * bs - 1, k * bs + 1,
                                  len(source) + rng.randint(1, 4)])
                prompt = source[:max(1, cut)]
                prompt += [rng.randrange(c["vocab"]) for _ in range(cut - len(prompt))]
            else:
                prompt = [rng.randrange(c["vocab"]) for _ in range(rng.randint(1, ctx - 1))]
            prompt = prompt[:ctx - 1]
            room = ctx - len(prompt)
            max_tokens = rng.choice([1, room, rng.randint(1, room), room + rng.randint(1, 5)])
            if slot in rep.active:
                finished.append(rep.active[slot].token_range(0, rep.active[slot].num_tokens))
            emit(add_line(slot, gens[slot], request_id, prompt, max_tokens,
                          seed=rng.getrandbits(32), cache_salt=rng.choice(c["salts"]),
                          ignore_eos=int(rng.random() < 0.5)))
        if rep.active and rng.random() < c["p_cancel"]:
            live = sorted(rep.active)
            preempted = [s for s in live if rep.active[s].preemptions
                         and rep.active[s].status is SeqStatus.WAITING]
            emit(f"finish {rng.choice(preempted if preempted and rng.random() < 0.5 else live)}")
        emit("step")
        sample_all()
    for _ in range(4 * ctx * c["num_slots"] + 50):
        if not rep.active:
            break
        emit("step")
        sample_all()
    return events


FIXED_OFFSET = {name: off for name, (_, off) in SLOT_DTYPE.fields.items()}


def validate_line(*, vocab, ctx, kvcap, max_prompt, prompt_len, max_tokens=8, temperature=ONE,
                  top_p=ONE, top_k=0, stop_ids=(), num_stop_ids=None, prompt=None,
                  rng: random.Random | None = None) -> str:
    """A `validate` event; float fields are bit patterns, so NaN payloads survive."""
    rng = rng or random.Random(0)
    buf = bytearray(SLOT_DTYPE.itemsize)
    for name, fmt, value in [
            ("seq_begin", "<I", rng.getrandbits(32)), ("payload_crc", "<I", rng.getrandbits(32)),
            ("request_id", "<Q", rng.getrandbits(64)), ("prompt_len", "<I", prompt_len),
            ("max_tokens", "<I", max_tokens), ("temperature", "<I", temperature),
            ("top_p", "<I", top_p), ("top_k", "<i", top_k), ("flags", "<I", rng.getrandbits(1)),
            ("seed", "<Q", rng.getrandbits(64)),
            ("num_stop_ids", "<I", len(stop_ids) if num_stop_ids is None else num_stop_ids)]:
        struct.pack_into(fmt, buf, FIXED_OFFSET[name], value)
    for i, s in enumerate(stop_ids[:MAX_STOP_IDS]):
        struct.pack_into("<i", buf, FIXED_OFFSET["stop_ids"] + 4 * i, s)
    n = min(prompt_len, max_prompt)
    if prompt is None:
        prompt = [rng.randrange(vocab) for _ in range(n)]
    assert len(prompt) == n
    return " ".join(map(str, ["validate", vocab, ctx, kvcap, max_prompt, buf.hex(), n, *prompt]))


NAN, NEG_NAN, SNAN = 0x7FC00000, 0xFFC00000, 0x7F800001
INF, NEG_INF, NEG_ZERO = 0x7F800000, 0xFF800000, 0x80000000
DENORMAL, NEG_DENORMAL = 0x00000001, 0x80000001
ABOVE_ONE = ONE + 1  # the float right after 1.0f


def handcrafted_validate_cases() -> list[tuple[str, RejectReason]]:
    base = dict(vocab=100, ctx=64, kvcap=48, max_prompt=32, prompt_len=4, max_tokens=8)
    cases = [
        (dict(), RejectReason.NONE),
        (dict(prompt_len=0), RejectReason.BAD_PROMPT_LEN),
        (dict(prompt_len=33), RejectReason.BAD_PROMPT_LEN),  # longer than the slot holds
        (dict(prompt_len=0xFFFFFFFF), RejectReason.BAD_PROMPT_LEN),
        (dict(prompt=[1, 2, 100, 3]), RejectReason.TOKEN_OUT_OF_RANGE),
        (dict(prompt=[-1, 2, 3, 4]), RejectReason.TOKEN_OUT_OF_RANGE),
        (dict(prompt=[1, 2, 3, -2 ** 31]), RejectReason.TOKEN_OUT_OF_RANGE),
        (dict(prompt=[2 ** 31 - 1, 0, 0, 0]), RejectReason.TOKEN_OUT_OF_RANGE),
        (dict(prompt=[0, 99, 0, 99]), RejectReason.NONE),
        (dict(prompt=[100, 0, 0, 0], max_tokens=0), RejectReason.TOKEN_OUT_OF_RANGE),  # order
        (dict(max_tokens=0), RejectReason.BAD_MAX_TOKENS),
        (dict(temperature=NAN), RejectReason.BAD_TEMPERATURE),
        (dict(temperature=NEG_NAN), RejectReason.BAD_TEMPERATURE),
        (dict(temperature=SNAN), RejectReason.BAD_TEMPERATURE),
        (dict(temperature=INF), RejectReason.BAD_TEMPERATURE),
        (dict(temperature=NEG_INF), RejectReason.BAD_TEMPERATURE),
        (dict(temperature=f32_bits(-0.5)), RejectReason.BAD_TEMPERATURE),
        (dict(temperature=NEG_DENORMAL), RejectReason.BAD_TEMPERATURE),
        (dict(temperature=NEG_ZERO), RejectReason.NONE),
        (dict(temperature=0), RejectReason.NONE),
        (dict(temperature=DENORMAL), RejectReason.NONE),
        (dict(temperature=f32_bits(3.4e38)), RejectReason.NONE),
        (dict(top_p=0), RejectReason.BAD_TOP_P),
        (dict(top_p=NEG_ZERO), RejectReason.BAD_TOP_P),
        (dict(top_p=NAN), RejectReason.BAD_TOP_P),
        (dict(top_p=NEG_NAN), RejectReason.BAD_TOP_P),
        (dict(top_p=INF), RejectReason.BAD_TOP_P),
        (dict(top_p=ABOVE_ONE), RejectReason.BAD_TOP_P),
        (dict(top_p=NEG_DENORMAL), RejectReason.BAD_TOP_P),
        (dict(top_p=DENORMAL), RejectReason.NONE),
        (dict(top_p=ONE), RejectReason.NONE),
        (dict(top_p=f32_bits(0.9)), RejectReason.NONE),
        (dict(top_k=-1), RejectReason.BAD_TOP_K),
        (dict(top_k=-2 ** 31), RejectReason.BAD_TOP_K),
        (dict(top_k=2 ** 31 - 1), RejectReason.NONE),
        (dict(num_stop_ids=17, stop_ids=tuple(range(16))), RejectReason.BAD_STOP_IDS),
        (dict(num_stop_ids=0xFFFFFFFF), RejectReason.BAD_STOP_IDS),
        (dict(stop_ids=(5, 100)), RejectReason.BAD_STOP_IDS),
        (dict(stop_ids=(-1,)), RejectReason.BAD_STOP_IDS),
        (dict(stop_ids=tuple(range(84, 100))), RejectReason.NONE),
        # ids past num_stop_ids are not looked at
        (dict(num_stop_ids=1, stop_ids=(5, 100)), RejectReason.NONE),
        (dict(prompt_len=4, max_tokens=61), RejectReason.EXCEEDS_CONTEXT),
        (dict(prompt_len=4, max_tokens=0xFFFFFFFF), RejectReason.EXCEEDS_CONTEXT),  # no wrap
        (dict(prompt_len=4, max_tokens=60, kvcap=64), RejectReason.NONE),
        (dict(prompt_len=4, max_tokens=45), RejectReason.EXCEEDS_KV_CAPACITY),
        (dict(prompt_len=4, max_tokens=44), RejectReason.NONE),
        (dict(prompt_len=32, max_tokens=1, vocab=1, prompt=[0] * 32), RejectReason.NONE),
    ]
    return [(validate_line(**dict(base, **kw)), want) for kw, want in cases]


def random_validate_lines(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    floats = [0, NEG_ZERO, ONE, ABOVE_ONE, NAN, NEG_NAN, SNAN, INF, NEG_INF, DENORMAL,
              NEG_DENORMAL, f32_bits(0.7), f32_bits(-2.0), f32_bits(1e30)]
    lines = []
    for _ in range(count):
        vocab = rng.choice([1, 2, 50, 32000, 2 ** 31 - 1])
        max_prompt = rng.randint(1, 24)
        ctx = rng.randint(2, 64)
        bad = lambda: rng.random() < 0.12  # noqa: E731 (each field fails now and then)
        plen = rng.choice([0, max_prompt + 1, 0xFFFFFFFF]) if bad() else rng.randint(1, max_prompt)
        n = min(plen, max_prompt)
        prompt = [rng.randrange(vocab) for _ in range(n)]
        if prompt and bad():
            prompt[rng.randrange(n)] = rng.choice([-1, vocab, -2 ** 31, 2 ** 31 - 1])
        stop_ids = [rng.randrange(vocab) for _ in range(rng.randint(0, MAX_STOP_IDS))]
        if stop_ids and bad():
            stop_ids[rng.randrange(len(stop_ids))] = rng.choice([-1, vocab, -2 ** 31])
        lines.append(validate_line(
            vocab=vocab, ctx=ctx, kvcap=rng.choice([1, ctx, rng.randint(1, 2 * ctx), 2 ** 40]),
            max_prompt=max_prompt, prompt_len=plen, prompt=prompt,
            max_tokens=rng.choice([0, 0xFFFFFFFF]) if bad() else rng.randint(1, 2 * ctx),
            temperature=rng.choice(floats) if bad() else f32_bits(rng.uniform(0, 2)),
            top_p=rng.choice(floats) if bad() else f32_bits(rng.uniform(0.01, 1)),
            top_k=rng.choice([-1, -2 ** 31]) if bad() else rng.randint(0, 50),
            stop_ids=tuple(stop_ids),
            num_stop_ids=rng.choice([17, 0xFFFFFFFF]) if bad() else None, rng=rng))
    return lines


def crc_lines(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for i in range(count):
        n = rng.choice([0, 1, 3, 4, 112, rng.randint(0, 600)])
        payload = rng.randbytes(n)
        gen = rng.choice([0, 1, 0xFFFFFFFF, rng.getrandbits(32)])
        lines.append(f"crc {gen} {rng.randint(0, n)} {payload.hex() or '-'}")
    return lines


def slot_crc_lines(seed: int) -> list[tuple[str, int]]:
    """`crc` events over real slots' payloads, with the CRC the front end wrote into them."""
    rng = random.Random(seed)
    geom = RingGeometry(1, max_prompt_tokens=300, max_output_tokens=4)
    out = []
    for plen in (1, 2, 31, 300):
        gen = rng.getrandbits(32)
        req = SlotRequest(request_id=rng.getrandbits(63),
                          prompt=np.array([rng.randrange(50000) for _ in range(plen)], np.int32),
                          max_tokens=rng.randint(1, 100), temperature=rng.random(),
                          top_p=rng.random(), top_k=rng.randint(0, 9), seed=rng.getrandbits(64),
                          ignore_eos=rng.random() < 0.5, stop_ids=(3, 4))
        body, end = encode_slot(geom, gen, req)
        slot = bytes(4) + body  # seq_begin (the doorbell) is not part of the payload
        written = struct.unpack_from("<I", slot, FIXED_OFFSET["payload_crc"])[0]
        assert layout.payload_crc(slot, plen, gen) == written
        payload = slot[layout.PAYLOAD_START:end]
        out.append((f"crc {gen} {rng.randint(0, len(payload))} {payload.hex()}", written))
    return out


def uniform_lines(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    special = [(0, 0), (1, 0), (2 ** 64 - 1, 0), (0, 2 ** 64 - 1), (77, 5), (1234, 49)]
    pairs = special + [(rng.getrandbits(64), rng.choice([rng.randrange(4096), rng.getrandbits(64)]))
                       for _ in range(count)]
    return [f"uniform {s} {t}" for s, t in pairs]


# -- the C++ side -----------------------------------------------------------------------------

def build_replay(tmp_path_factory, *defines: str):
    """Runs sched_replay (built once with g++ and `defines`) on event lines; returns its output
    lines."""
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ is not installed: the C++ scheduler parity tests need it")
    exe = tmp_path_factory.mktemp("sched_replay") / "sched_replay"
    subprocess.run([gxx, "-std=c++17", "-O1", "-Wall", "-Werror", *defines, f"-I{CSRC}",
                    str(REPLAY_SRC), "-o", str(exe)], check=True, capture_output=True, text=True)

    def run(lines: list[str]) -> list[str]:
        r = subprocess.run([str(exe)], input="\n".join(lines) + "\n", capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return r.stdout.splitlines()

    return run


@pytest.fixture(scope="session")
def replay(tmp_path_factory):
    return build_replay(tmp_path_factory)


@pytest.fixture(scope="session")
def replay_colliding_keys(tmp_path_factory):
    """The replay with the prefix cache's keys cut to 2 bits: nearly every lookup meets blocks
    of other identities under its key."""
    return build_replay(tmp_path_factory, "-DBLINK_PREFIX_KEY_MASK=0x3ull")


def assert_same(pairs: list[tuple[str, list[str]]], got: list[str]) -> None:
    """Compares the C++ output with the Python lines event by event; names the first event
    whose decisions differ, with the scenario's config."""
    i = 0
    config = None
    for event, want in pairs:
        if event.startswith("config"):
            config = event
        have = got[i:i + len(want)]
        if have != want:
            pytest.fail(f"C++ differs from Python at event {event!r} (scenario {config!r}):\n"
                        f"  python: {want}\n  c++:    {have}")
        i += len(want)
    assert got[i:] == [], f"C++ printed extra lines: {got[i:i + 5]}"


def test_header_is_freestanding(tmp_path):
    """No STL, no exceptions, no RTTI: the header compiles with the C++ library headers gone."""
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ is not installed")
    r = subprocess.run([gxx, "-std=c++17", "-fsyntax-only", "-Wall", "-Wextra", "-Werror",
                        "-fno-exceptions", "-fno-rtti", "-nostdinc++", f"-I{CSRC}", "-x", "c++",
                        "-"], input='#include "scheduler.cuh"\n', capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    text = (CSRC / "scheduler.cuh").read_text()
    for banned in ("malloc(", "free(", "std::", "throw ", "#include <"):
        assert banned not in text.replace("#include <stddef.h>", "").replace(
            "#include <stdint.h>", ""), banned


def cache_counters(line: str) -> list[int]:
    """A step line's cache=CACHED:EVICTABLE:EVICTED:HIT_TOKENS:QUERY_TOKENS."""
    return [int(x) for x in line.rsplit("cache=", 1)[1].split(":")]


def test_random_workloads_match_python(replay):
    pairs = []
    for seed in range(400):
        pairs += expected(random_workload(seed, steps=60))
    assert_same(pairs, replay([e for e, _ in pairs]))
    outputs = [line for _, lines in pairs for line in lines]
    # the workloads reach every decision they are meant to test
    assert sum(" pre=" in s and " pre= " not in s for s in outputs) > 100, "too few preemptions"
    reasons = {int(s.split()[3]) for s in outputs if s.startswith("sample")}
    assert reasons >= {int(r) for r in (FinishReason.NONE, FinishReason.EOS, FinishReason.LENGTH,
                                        FinishReason.STOP_TOKEN, FinishReason.CONTEXT_FULL)}
    # prefix caching: hits, admissions that took cached blocks, evictions, shared blocks
    steps = [s for s in outputs if s.startswith("step")]
    assert sum(1 for s in steps if re.search(r"adm=\S*:[1-9]", s)) > 300, "too few cache hits"
    assert sum(cache_counters(s)[2] > 0 for s in steps) > 300, "too few evictions"
    shared = 0
    for s in steps:
        tables = [t.split(":")[1].split(".") for t in s.split(" run=")[1].split()[0].split(",")
                  if ":" in t and t.split(":")[1]]
        blocks = [b for t in tables for b in t]
        shared += len(blocks) != len(set(blocks))
    assert shared > 300, "too few steps where running sequences share a block"


SALT = 0x1234_5678_9ABC_DEF0 | 1 << 63


def salted_prefix_events() -> list[str]:
    """One 13-token prompt (three blocks of 4 it may take from the cache) sent six times, one
    request after another, under cache salts: none, SALT, SALT again, SALT without its top bit
    (the same namespace), another salt, none again."""
    prompt = [7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9, 0]
    events = ["config 4 32 4 32 4 64 1 32 0"]
    for n, salt in enumerate([0, SALT, SALT, SALT & ~(1 << 63), 0x42, 0]):
        events += [add_line(n % 4, n // 4 + 1, n, prompt, 1, cache_salt=salt), "step",
                   f"sample {n % 4} 3"]
    return events


def test_cache_salts_namespace_the_prefix_cache(replay):
    """A request finds the blocks that requests of its own salt (or of none, unsalted) left,
    and nothing of another salt's, in both schedulers."""
    pairs = expected(salted_prefix_events())
    assert_same(pairs, replay([e for e, _ in pairs]))
    admitted = [re.search(r" adm=\d+:(\d+) ", lines[0]).group(1)
                for e, lines in pairs if e == "step"]
    assert admitted == ["0", "0", "12", "12", "0", "12"]


def burst_events() -> list[str]:
    """Three requests of one 10-token prompt (two blocks of 4 to cache) admitted in one step,
    none finding it cached, then a fourth after the first has ended."""
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    events = ["config 4 32 4 16 4 64 1 32 0"]
    events += [add_line(slot, 1, slot, prompt, 4) for slot in range(3)] + ["step"]
    events += [f"sample {slot} 7" for slot in range(3)] + ["finish 0"]
    return events + [add_line(3, 1, 3, prompt + [7], 4), "step"]


def test_a_prefix_computed_twice_is_held_once(replay):
    """Blocks computed by several sequences in one step are kept once: the later ones take the
    cached blocks and free their copies, in both schedulers."""
    pairs = expected(burst_events())
    assert_same(pairs, replay([e for e, _ in pairs]))
    first, last = (lines[0] for e, lines in pairs if e == "step")
    tables = re.search(r" run=(\S+) ", first).group(1)
    assert tables == "0:0.1.2,1:0.1.5,2:0.1.8", tables  # their copies 3, 4, 6, 7 went back
    assert " free=11 " in first and re.search(r" adm=\S*3:8 ", last)


def test_colliding_prefix_keys_change_no_decision(replay_colliding_keys):
    """Keys of 2 bits: every lookup probes past blocks of other identities, which the parent
    uid and token comparison must reject, so the decisions stay exactly Python's (which keys
    its cache by the identity itself, no hash)."""
    pairs = []
    for seed in range(150):
        pairs += expected(random_workload(seed, steps=60, prefix_caching=1))
    for seed in range(150):
        pairs += expected(adversarial_workload(seed))
    assert_same(pairs, replay_colliding_keys([e for e, _ in pairs]))


def test_adversarial_workloads_match_python(replay):
    """adversarial_workload's edges of the prefix cache (the replay's host build also checks
    its state's consistency after every event: an `error` line would differ)."""
    pairs = []
    for seed in range(300):
        pairs += expected(adversarial_workload(seed))
    assert_same(pairs, replay([e for e, _ in pairs]))


def test_validate_slot_matches_python(replay):
    cases = handcrafted_validate_cases()
    for line, want in cases:  # the hand-made cases test what they claim to
        assert PyReplay().run(line) == [f"validate {int(want)}"], line
    pairs = expected([line for line, _ in cases] + random_validate_lines(1, 3000))
    assert_same(pairs, replay([e for e, _ in pairs]))
    seen = {int(lines[0].split()[1]) for _, lines in pairs}
    assert seen == {int(r) for r in RejectReason} - {int(RejectReason.CORRUPT)}


def test_crc_matches_zlib_and_payload_crc(replay):
    slots = slot_crc_lines(2)
    lines = crc_lines(3, 400) + [line for line, _ in slots]
    got = replay(lines)
    assert_same(expected(lines), got)
    for (_, written), line in zip(slots, got[-len(slots):]):
        assert line == f"crc {written} {written}"  # what the front end wrote into the slot


def test_uniform_matches_python(replay):
    lines = uniform_lines(4, 500)
    assert_same(expected(lines), replay(lines))


# -- frozen vectors for the CUDA kernel's GPU test --------------------------------------------

def vector_events() -> list[str]:
    """The scenarios frozen into tests/vectors/scheduler_vectors.txt."""
    events = []
    # preemption-heavy: a tiny pool, a large budget, short prompts and long outputs
    events += random_workload(1004, 50, num_slots=6, block_size=2, ctx=24, max_model_len=24,
                              num_blocks=13, max_num_seqs=6, budget=64, p_arrive=1.0,
                              vocab=400, p_cancel=0.0, prompt_frac=0.3, output_frac=0.6)
    # chunked prefill: a small budget, long prompts
    events += random_workload(1002, 50, num_slots=4, block_size=4, ctx=48, max_model_len=56,
                              num_blocks=40, max_num_seqs=4, budget=5, p_arrive=0.5)
    # max_num_seqs bounds admission; cancels
    events += random_workload(1003, 50, num_slots=8, block_size=3, ctx=20, max_model_len=21,
                              num_blocks=30, max_num_seqs=2, budget=16, p_cancel=0.2)
    # block size 1, one slot (reused while live), budget 1
    events += random_workload(1003, 40, num_slots=1, block_size=1, ctx=8, max_model_len=8,
                              num_blocks=8, max_num_seqs=1, budget=1, p_arrive=1.0, p_cancel=0.0)
    events += random_workload(1005, 60)
    # prefix caching under KV pressure: shared prefixes and chat turns, evictions, preemptions
    events += random_workload(1010, 60, num_slots=6, block_size=2, ctx=32, max_model_len=32,
                              num_blocks=24, max_num_seqs=4, budget=24, p_arrive=0.8,
                              vocab=8, p_cancel=0.05, prefix_caching=1, p_shared=0.9)
    events += salted_prefix_events()
    # blocks computed twice at once (the cached one taken, the copy freed), and the cache's
    # edges under pressure
    events += burst_events()
    for seed in range(3):
        events += adversarial_workload(seed)
    events += [line for line, _ in handcrafted_validate_cases()]
    events += crc_lines(1006, 12) + [line for line, _ in slot_crc_lines(1007)]
    events += ["crc 7 5000 " + random.Random(1008).randbytes(8192).hex()]  # a long prompt
    events += uniform_lines(1009, 10)
    return events


def render_vectors(events: list[str]) -> str:
    out = [
        "# Scheduler parity vectors: events for tests/csrc/sched_replay.cc (format in its header",
        "# comment), each followed by the lines it must print, prefixed '= '. Generated by the",
        "# Python reference: python tests/test_scheduler_parity.py --write-vectors",
    ]
    for event, lines in expected(events):
        out.append(event)
        out += ["= " + line for line in lines]
    return "\n".join(out) + "\n"


def read_vectors() -> list[tuple[str, list[str]]]:
    pairs = []
    for line in VECTORS.read_text().splitlines():
        if line.startswith("= "):
            pairs[-1][1].append(line[2:])
        elif line and not line.startswith("#"):
            pairs.append((line, []))
    return pairs


def test_vectors_still_reproduced_by_python():
    pairs = read_vectors()
    assert len(pairs) > 100
    assert expected([e for e, _ in pairs]) == pairs, \
        "the Python reference changed its decisions: regenerate the vectors (see module doc)"


def test_vectors_replayed_by_cpp(replay):
    pairs = read_vectors()
    assert_same(pairs, replay(VECTORS.read_text().splitlines()))


def build_gpu_replay(out_dir: Path) -> Path:
    """sched_replay.cc's GPU build (sm_90a): thread 0 of one CTA replays the events."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed")
    exe = out_dir / "sched_replay_gpu"
    r = subprocess.run([nvcc, "-std=c++17", "-arch=sm_90a", "-Xcompiler", "-Wall,-Werror",
                        "--Werror", "all-warnings", f"-I{CSRC}", "-x", "cu", str(REPLAY_SRC),
                        "-o", str(exe)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return exe


def test_nvcc_builds_replay_for_the_gpu(tmp_path):
    """The header compiles as CUDA (sm_90a) inside a __global__ kernel, without warnings."""
    build_gpu_replay(tmp_path)


@pytest.mark.gpu
@requires_gpu()
def test_gpu_replays_the_vectors(tmp_path):
    """The CUDA build makes the frozen vectors' decisions on the GPU."""
    exe = build_gpu_replay(tmp_path)
    r = subprocess.run([str(exe)], input=VECTORS.read_text(), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert_same(read_vectors(), r.stdout.splitlines())


if __name__ == "__main__":
    if sys.argv[1:] == ["--write-vectors"]:
        VECTORS.parent.mkdir(parents=True, exist_ok=True)
        VECTORS.write_text(render_vectors(vector_events()))
        print(f"wrote {VECTORS}")
    else:
        sys.exit(f"usage: {sys.argv[0]} --write-vectors")


def test_the_cpu_engine_retires_one_iteration_s_cancels_in_slot_order():
    """Cancels seen in one iteration retire in slot order, as the kernel's HonourCancels does:
    the order sets the free list and the prefix cache's eviction order, so every later decision
    of the two engines depends on it (the CPU engine retired them in admission order)."""
    from types import SimpleNamespace

    from blink.gpu_engine.reference_engine import ReferenceEngine
    engine = ReferenceEngine.__new__(ReferenceEngine)  # its cancel pass alone, no model
    admitted = [Sequence(slot, 1, i, [1, 2], SamplingParams(max_tokens=4))
                for i, slot in enumerate((5, 2, 7, 0))]
    engine.core = SimpleNamespace(active={s.slot: s for s in admitted})
    cancel_gen = [0] * 8
    for slot in (5, 7, 0):
        cancel_gen[slot] = 1
    engine.ring = SimpleNamespace(cancel_words=lambda: cancel_gen)
    engine.counters = {"requests_cancelled": 0}
    retired = []
    engine._retire = lambda seq, reason, detail: retired.append(seq.slot)
    engine._honour_cancels()
    assert retired == [0, 5, 7] and engine.counters["requests_cancelled"] == 3


def test_the_gpu_scheduler_makes_the_same_no_readmission_decision(replay):
    """test_prefix_cache's test_a_sequence_preempted_this_step_is_not_readmitted_in_it through
    the parity replay: csrc/scheduler.cuh (built with g++) and the
    Python step core print the same plans, and step 2's is a's decode alone beside b's
    preemption."""
    prompt = list(range(12))
    events = ["config 4 32 4 6 4 14 1 32 0",
              add_line(0, 1, 0, prompt, 8), add_line(1, 1, 1, prompt, 8),
              "step", "sample 0 99", "step", "sample 0 99", "step", "sample 0 99",
              "sample 1 99", "step"]
    pairs = expected(events)
    assert_same(pairs, replay([e for e, _ in pairs]))
    steps = [lines[0] for e, lines in pairs if e == "step"]
    assert " sched=0:12,1:2 " in steps[0]
    assert " sched=0:1 pre=1:1 " in steps[1] and " adm= " in steps[1], steps[1]
    assert " sched=0:1,1:4 pre= " in steps[2] and " adm=1:0 " in steps[2], steps[2]
