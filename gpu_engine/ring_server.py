"""The engine's side of the ring: creates the segment, consumes request slots, publishes output.

The CPU reference engine calls these methods from its loop; the CUDA engine's scheduler kernel
does the same reads and writes on the GPU through the registered mapping of the same segment.
"""
from __future__ import annotations

import math
import os
import secrets
import time
from dataclasses import dataclass

import numpy as np

from blink.ring.layout import (
    FLAG_IGNORE_EOS, HEADER_DTYPE, LAYOUT_VERSION, MAX_EOS_IDS, MAX_STOP_IDS, MODEL_NAME_BYTES,
    RECORD_DTYPE, RING_MAGIC, SLOT_DTYPE, EngineKind, EngineState, FinishReason, RejectReason, RingGeometry,
    payload_crc,
)
from blink.ring.lifecycle import RingClaimed, claim_ring
from blink.ring.shm import ShmSegment
from blink.gpu_engine.sequence import SamplingParams

# How long a slot whose sequence words agree but whose CRC does not may stay unconsumed before
# it is rejected as corrupt (a transport may still be landing bytes of a completed write).
CORRUPT_GRACE_S = 0.2


@dataclass(frozen=True)
class ModelLimits:
    vocab_size: int
    context_length: int
    kv_capacity_tokens: int   # the whole KV cache, in tokens: no sequence can grow past it


@dataclass
class NewRequest:
    slot: int
    gen: int
    request_id: int
    prompt: list[int]
    params: SamplingParams
    cache_salt: int = 0  # the slot's cache_salt word


@dataclass
class Rejection:
    slot: int
    gen: int
    reason: RejectReason


def validate_slot(fixed: np.void, prompt: np.ndarray, limits: ModelLimits) -> RejectReason:
    """Bounds-checks every field of a consumed slot; the first failing check wins."""
    plen = int(fixed["prompt_len"])
    if plen == 0 or plen != prompt.size:
        return RejectReason.BAD_PROMPT_LEN
    if prompt.min() < 0 or prompt.max() >= limits.vocab_size:
        return RejectReason.TOKEN_OUT_OF_RANGE
    max_tokens = int(fixed["max_tokens"])
    if max_tokens < 1:
        return RejectReason.BAD_MAX_TOKENS
    temperature = float(fixed["temperature"])
    if not math.isfinite(temperature) or temperature < 0:
        return RejectReason.BAD_TEMPERATURE
    top_p = float(fixed["top_p"])
    if not (0.0 < top_p <= 1.0):
        return RejectReason.BAD_TOP_P
    if int(fixed["top_k"]) < 0:
        return RejectReason.BAD_TOP_K
    nstop = int(fixed["num_stop_ids"])
    if nstop > MAX_STOP_IDS or any(not 0 <= s < limits.vocab_size
                                   for s in fixed["stop_ids"][:nstop]):
        return RejectReason.BAD_STOP_IDS
    if plen + max_tokens > limits.context_length:
        return RejectReason.EXCEEDS_CONTEXT
    if plen + max_tokens > limits.kv_capacity_tokens:
        return RejectReason.EXCEEDS_KV_CAPACITY
    return RejectReason.NONE


class RingInUse(RuntimeError):
    pass


def _refuse_live_engine(name: str, wait_s: float = 0.5) -> None:
    """A ring whose engine is alive must not be replaced (a second engine started by mistake
    would cut the first one's clients off); a dead engine's ring is simply replaced."""
    try:
        seg = ShmSegment.attach(name)
    except (FileNotFoundError, PermissionError):
        return
    header = None
    try:
        if seg.size < HEADER_DTYPE.itemsize:
            return
        header = seg.array()[:HEADER_DTYPE.itemsize].view(HEADER_DTYPE)
        if int(header[0]["engine_state"]) == EngineState.STOPPED:
            return
        beat = int(header[0]["heartbeat"])
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if int(header[0]["heartbeat"]) != beat:
                raise RingInUse(f"another engine (pid {int(header[0]['engine_pid'])}) is serving "
                                f"on /dev/shm/{name}; stop it or pick another --ring-name")
            time.sleep(0.01)
    finally:
        header = None  # drop the view before unmapping
        seg.close()


class RingServer:
    def __init__(self, name: str, geom: RingGeometry, *, model_name: str, vocab_size: int,
                 context_length: int, eos_ids: tuple[int, ...],
                 engine_kind: EngineKind = EngineKind.CPU_REFERENCE):
        self.geom = geom
        try:  # held until close (or this process's end): a second engine is refused at once
            self.claim = claim_ring(name, "engine")
        except RingClaimed as e:
            raise RingInUse(str(e)) from None
        try:  # refused or failed: the claim goes now, not when the collector finds it
            _refuse_live_engine(name)  # an engine of another network namespace, or older Blink
            self.segment = ShmSegment.create(name, geom.total_bytes)
        except BaseException:
            self.claim.close()
            raise
        mem = self.segment.array()
        self.header = mem[:HEADER_DTYPE.itemsize].view(HEADER_DTYPE)[0]
        # slots: [num_slots, slot_bytes] u8; records: [num_slots, record_bytes] u8
        self.slots = mem[geom.slots_offset:geom.slots_offset + geom.num_slots * geom.slot_bytes] \
            .reshape(geom.num_slots, geom.slot_bytes)
        self.records = mem[geom.records_offset:geom.records_offset
                           + geom.num_slots * geom.record_bytes].reshape(geom.num_slots,
                                                                          geom.record_bytes)
        self.slot_fixed = [s[:SLOT_DTYPE.itemsize].view(SLOT_DTYPE)[0] for s in self.slots]
        # one u32 word of every slot as a strided column: poll reads the whole ring's seq_begin
        # and seq_end in two numpy reads and visits only slots with a new generation; a step
        # reads every cancel word at once
        def word_column(offset: int) -> np.ndarray:
            return self.slots[:, offset:offset + 4].view("<u4")[:, 0]
        self.begin_column = word_column(SLOT_DTYPE.fields["seq_begin"][1])
        self.end_column = word_column(geom.seq_end_offset)
        self.cancel_column = word_column(SLOT_DTYPE.fields["cancel_gen"][1])
        self.rec_fixed = [r[:RECORD_DTYPE.itemsize].view(RECORD_DTYPE)[0] for r in self.records]
        self.rec_tokens = [r[RECORD_DTYPE.itemsize:].view("<i4") for r in self.records]
        self.consumed_gen = np.zeros(geom.num_slots, np.uint32)
        self._corrupt_since: dict[int, float] = {}

        h = self.header
        h["magic"] = RING_MAGIC
        h["layout_version"] = LAYOUT_VERSION
        h["header_bytes"] = geom.slots_offset
        h["num_slots"] = geom.num_slots
        h["max_prompt_tokens"] = geom.max_prompt_tokens
        h["max_output_tokens"] = geom.max_output_tokens
        h["slot_bytes"] = geom.slot_bytes
        h["record_bytes"] = geom.record_bytes
        h["slots_offset"] = geom.slots_offset
        h["records_offset"] = geom.records_offset
        h["total_bytes"] = geom.total_bytes
        h["engine_pid"] = os.getpid()
        h["vocab_size"] = vocab_size
        h["context_length"] = context_length
        eos = list(eos_ids)[:MAX_EOS_IDS]
        h["num_eos_ids"] = len(eos)
        h["eos_ids"][: len(eos)] = eos
        h["model_name"] = model_name.encode()[:MODEL_NAME_BYTES]
        h["engine_kind"] = engine_kind
        h["engine_instance"] = secrets.randbits(63) | 1
        h["engine_state"] = EngineState.STARTING
        self.segment.publish()

    def set_state(self, state: EngineState) -> None:
        self.header["engine_state"] = state

    def beat(self) -> None:
        self.header["heartbeat"] += 1

    def poll(self, limits: ModelLimits) -> tuple[list[NewRequest], list[Rejection]]:
        """Consumes every slot holding a complete new generation; FCFS by request id."""
        new, rejected = [], []
        now = None
        begins = self.begin_column.copy()  # seq_begin before seq_end, as the protocol says
        ends = self.end_column.copy()
        # slots whose generation is new and whose write has landed (seq_end caught up); no
        # front end writes generation 0 (it wraps to 1), so a 0 is never a request
        for i in np.flatnonzero((begins != self.consumed_gen) & (begins == ends)
                                & (begins != 0)).tolist():
            fixed, gen = self.slot_fixed[i], int(begins[i])
            plen = min(int(fixed["prompt_len"]), self.geom.max_prompt_tokens)
            if payload_crc(self.slots[i].data, plen, gen) != int(fixed["payload_crc"]):
                now = now or time.monotonic()
                first = self._corrupt_since.setdefault(i, now)
                if now - first < CORRUPT_GRACE_S:
                    continue
                reason = RejectReason.CORRUPT
            else:
                prompt = self.slots[i][SLOT_DTYPE.itemsize:SLOT_DTYPE.itemsize + 4 * plen] \
                    .view("<i4").copy()
                reason = validate_slot(fixed, prompt, limits)
            self._corrupt_since.pop(i, None)
            self.consumed_gen[i] = gen
            if reason is not RejectReason.NONE:
                rejected.append(Rejection(i, gen, reason))
                continue
            nstop = int(fixed["num_stop_ids"])
            params = SamplingParams(
                max_tokens=int(fixed["max_tokens"]), temperature=float(fixed["temperature"]),
                top_p=float(fixed["top_p"]), top_k=int(fixed["top_k"]), seed=int(fixed["seed"]),
                ignore_eos=bool(int(fixed["flags"]) & FLAG_IGNORE_EOS),
                stop_ids=frozenset(int(s) for s in fixed["stop_ids"][:nstop]))
            new.append(NewRequest(i, gen, int(fixed["request_id"]), prompt.tolist(), params,
                                  int(fixed["cache_salt"])))
        new.sort(key=lambda r: r.request_id)
        return new, rejected

    def open_record(self, slot: int, gen: int, prompt_len: int) -> None:
        rec = self.rec_fixed[slot]
        rec["num_tokens"] = 0
        rec["finish_reason"] = FinishReason.NONE
        rec["detail"] = 0
        rec["preemptions"] = 0
        rec["cached_tokens"] = 0
        rec["prompt_len"] = prompt_len
        rec["gen"] = gen  # published last: the record now belongs to this generation

    def append_token(self, slot: int, index: int, token: int) -> None:
        self.rec_tokens[slot][index] = token
        self.rec_fixed[slot]["num_tokens"] = index + 1  # after the token (x86 store order)

    def set_preemptions(self, slot: int, count: int) -> None:
        self.rec_fixed[slot]["preemptions"] = count

    def set_cached_tokens(self, slot: int, count: int) -> None:
        self.rec_fixed[slot]["cached_tokens"] = count

    def finish(self, slot: int, gen: int, reason: FinishReason, detail: int = 0) -> None:
        rec = self.rec_fixed[slot]
        if int(rec["gen"]) != gen:
            self.open_record(slot, gen, 0)
        rec["detail"] = detail
        rec["finish_reason"] = reason  # last: the front end may free the slot after this

    def cancel_requested(self, slot: int, gen: int) -> bool:
        return int(self.cancel_column[slot]) == gen

    def cancel_words(self) -> list[int]:
        """Every slot's cancel word in one read (a step checks all its sequences against it)."""
        return self.cancel_column.tolist()

    def close(self) -> None:
        self.set_state(EngineState.STOPPED)
        self.segment.unlink()
        # views into the mapping stay referenced; drop them before closing
        self.slot_fixed = self.rec_fixed = self.rec_tokens = []
        self.begin_column = self.end_column = self.cancel_column = None
        self.header = self.slots = self.records = None
        self.segment.close()
        self.claim.close()
