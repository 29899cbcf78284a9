"""The ring protocol between the front end and the engine, without any model: whole-slot
validation, torn and reordered writes, corrupt slots, field validation, record publication."""
from __future__ import annotations

import contextlib
import hashlib
import random
import secrets
import shutil
import subprocess
import threading
import time

import numpy as np
import pytest

from blink.gpu_engine.ring_server import CORRUPT_GRACE_S, ModelLimits, RingServer
from blink.ring import layout
from blink.ring.layout import (
    SLOT_DTYPE, FinishReason, RejectReason, RingGeometry, SlotRequest, encode_slot,
)
from blink.ring.shm import ShmSegment, ShmTransport, shm_path

VOCAB = 1000
LIMITS = ModelLimits(vocab_size=VOCAB, context_length=64, kv_capacity_tokens=48)


@pytest.fixture
def ring():
    name = f"blink-test-{secrets.token_hex(6)}"
    server = RingServer(name, RingGeometry(4, max_prompt_tokens=63, max_output_tokens=64),
                        model_name="unit", vocab_size=VOCAB, context_length=64, eos_ids=(2,))
    transport = ShmTransport(ShmSegment.attach(name))
    yield server, transport
    transport.close()
    server.close()
    assert not shm_path(name).exists()


def slot_writes(geom: RingGeometry, slot: int, gen: int, req: SlotRequest):
    """The three writes a front end makes: payload, seq_end, then the doorbell."""
    base = geom.slot_offset(slot)
    body, _ = encode_slot(geom, gen, req)
    return [(base + 4, body), (base + geom.seq_end_offset, np.uint32(gen).tobytes()),
            (base, np.uint32(gen).tobytes())]


def request(prompt=(5, 6, 7), **kw) -> SlotRequest:
    fields = dict(request_id=1, prompt=np.asarray(prompt, np.int32), max_tokens=8)
    fields.update(kw)
    return SlotRequest(**fields)


def test_segment_is_owner_only(ring):
    server, _ = ring
    assert (server.segment.path.stat().st_mode & 0o777) == 0o600


def test_whole_slot_is_consumed_once(ring):
    server, t = ring
    for off, data in slot_writes(server.geom, 2, 1, request(stop_ids=(9, 11), seed=7)):
        t.write(off, data)
    new, rejected = server.poll(LIMITS)
    assert rejected == [] and len(new) == 1
    r = new[0]
    assert (r.slot, r.gen, r.prompt) == (2, 1, [5, 6, 7])
    assert r.params.max_tokens == 8 and r.params.seed == 7 and r.params.stop_ids == {9, 11}
    assert server.poll(LIMITS) == ([], [])  # the same generation is never consumed twice


def test_a_cache_salt_crosses_the_ring_as_its_word(ring):
    """The front end writes a salt's 64-bit word into the slot and the engine reads it back:
    none is 0, any other has its top bit set (no block uid reaches it), and distinct salts
    have distinct words (the format pinned: 63 bits of a BLAKE2b digest)."""
    salts = ["tenant-a", "tenant-b", "Tenant-a", "tenant-a ", "é", "x" * 10_000]
    words = [layout.cache_salt_word(salt) for salt in salts]
    assert layout.cache_salt_word("") == 0 and len(set(words)) == len(salts)
    assert all(w >> 63 == 1 and w == layout.cache_salt_word(salt)
               for salt, w in zip(salts, words))
    digest = hashlib.blake2b(b"tenant-a", digest_size=8, person=b"blink cache salt").digest()
    assert words[0] == int.from_bytes(digest, "little") | 1 << 63
    server, t = ring
    for slot, word in ((0, words[0]), (1, 0)):
        for off, data in slot_writes(server.geom, slot, 1, request(cache_salt=word)):
            t.write(off, data)
    new, _ = server.poll(LIMITS)
    assert [(r.slot, r.cache_salt) for r in new] == [(0, words[0]), (1, 0)]


def test_every_geometry_leaves_room_for_a_whole_prompt_and_output():
    """For every prompt and output length up to 80 tokens (every residue of the 64-byte
    alignment): a full-length prompt, as encode_slot writes it, ends before the slot's seq_end
    word, and a full record's last token before the next record; the slots end before the
    records and the records before the segment's end. (A geometry one word short shows only
    where the lengths land on the alignment: context lengths of 15 or 8 modulo 16.)"""
    for n in range(1, 81):
        geom = RingGeometry(num_slots=3, max_prompt_tokens=n, max_output_tokens=n)
        prompt = np.arange(n, dtype=np.int32)
        _, end = encode_slot(geom, 1, SlotRequest(request_id=1, prompt=prompt, max_tokens=1))
        assert end <= geom.seq_end_offset and geom.seq_end_offset + 4 <= geom.slot_bytes, n
        assert geom.slot_offset(2) + geom.slot_bytes <= geom.records_offset, n
        assert (geom.record_offset(0) + layout.RECORD_DTYPE.itemsize + 4 * n
                <= geom.record_offset(1)), n
        assert geom.record_offset(2) + geom.record_bytes <= geom.total_bytes, n


def _poll_one(server, t, req, limits, gen, slot=0):
    for w in slot_writes(server.geom, slot, gen, req):
        t.write(*w)
    new, rejected = server.poll(limits)
    return new, [r.reason for r in rejected]


def test_the_engine_s_checks_at_their_exact_bounds(ring):
    """A request that exactly fills the context or the KV cache is served (the rule: prompt +
    max_tokens must not exceed either); the last id of the vocabulary is a stop id, and every
    listed id is checked; ignore_eos crosses the ring. Each was a surviving mutant of a review:
    no test sat on these bounds."""
    server, t = ring
    new, rejected = _poll_one(server, t, request(max_tokens=61),  # 3 + 61 == 64, the context
                              ModelLimits(VOCAB, context_length=64, kv_capacity_tokens=1000), 1)
    assert rejected == [] and len(new) == 1
    new, rejected = _poll_one(server, t, request(max_tokens=45), LIMITS, 2)  # 3 + 45 == 48
    assert rejected == [] and len(new) == 1
    new, rejected = _poll_one(server, t, request(stop_ids=(VOCAB - 1,)), LIMITS, 3)
    assert rejected == [] and new[0].params.stop_ids == {VOCAB - 1}
    for gen, ids in ((4, (VOCAB,)), (5, (7, VOCAB)), (6, (7, 8, -1))):
        assert _poll_one(server, t, request(stop_ids=ids), LIMITS, gen)[1] == \
            [RejectReason.BAD_STOP_IDS], ids
    new, _ = _poll_one(server, t, request(ignore_eos=True), LIMITS, 7)
    assert new[0].params.ignore_eos is True


def test_a_new_generation_s_record_starts_from_zero(ring):
    """A slot's next request reports its own cached tokens and preemptions, not the last
    one's."""
    server, t = ring
    server.open_record(1, 5, 3)
    server.set_cached_tokens(1, 16)
    server.set_preemptions(1, 2)
    server.finish(1, 5, FinishReason.LENGTH)
    server.open_record(1, 6, 4)
    rec = np.frombuffer(t.read(server.geom.record_offset(1), layout.RECORD_DTYPE.itemsize),
                        layout.RECORD_DTYPE)[0]
    assert (rec["gen"], rec["num_tokens"], rec["finish_reason"], rec["prompt_len"],
            rec["cached_tokens"], rec["preemptions"]) == (6, 0, FinishReason.NONE, 4, 0, 0)


def test_new_requests_come_first_come_first_served(ring):
    """poll's contract: first come first served by request id, whatever slots they landed in."""
    server, t = ring
    for slot, rid in ((0, 9), (1, 4), (3, 6)):
        for w in slot_writes(server.geom, slot, 1, request(request_id=rid)):
            t.write(*w)
    new, _ = server.poll(LIMITS)
    assert [r.request_id for r in new] == [4, 6, 9]


def test_generation_zero_is_never_a_request(ring):
    """No front end writes generation 0 (EngineLink wraps 0xFFFFFFFF to 1): a slot showing it
    after another generation (a zeroed slot, a stray write) is not consumed (it was admitted
    and at once "cancelled" by its own zero cancel word, counted as both)."""
    server, t = ring
    for gen in (7, 0):
        for off, data in slot_writes(server.geom, 1, gen, request()):
            t.write(off, data)
        new, rejected = server.poll(LIMITS)
        assert [r.gen for r in new] == ([7] if gen else []) and rejected == []


def test_missing_doorbell_or_seq_end_is_not_consumed(ring):
    server, t = ring
    payload, seq_end, doorbell = slot_writes(server.geom, 0, 1, request())
    t.write(*payload)
    t.write(*seq_end)
    assert server.poll(LIMITS) == ([], [])          # no doorbell yet
    t.write(*doorbell)
    t.write(server.geom.slot_offset(0) + server.geom.seq_end_offset, np.uint32(0).tobytes())
    assert server.poll(LIMITS) == ([], [])          # seq_end torn
    t.write(*seq_end)
    assert len(server.poll(LIMITS)[0]) == 1


def test_rdma_like_reordered_chunks_never_consumed_partially(ring):
    """RDMA gives no order for when the bytes of one write land: apply every write as random
    4-byte-aligned pieces in random order, polling between pieces. The slot may be consumed
    only once complete, and then exactly as written."""
    server, t = ring
    rnd = random.Random(1)
    for gen in range(1, 30):
        prompt = [rnd.randrange(VOCAB) for _ in range(rnd.randrange(1, 40))]
        req = request(prompt, request_id=gen, max_tokens=1, temperature=rnd.random())
        pieces = []
        for off, data in slot_writes(server.geom, 1, gen, req):
            cuts = sorted({0, len(data), *(4 * rnd.randrange(len(data) // 4 + 1)
                                           for _ in range(6))})
            pieces += [(off + a, data[a:b]) for a, b in zip(cuts, cuts[1:])]
        rnd.shuffle(pieces)
        consumed = []
        for i, (off, data) in enumerate(pieces):
            t.write(off, data)
            new, rejected = server.poll(LIMITS)
            consumed += new
            assert rejected == [], "a partial write must wait, not be rejected"
            if new:  # pieces not applied yet must not change a byte: the slot was complete
                diff = [(o - server.geom.slot_offset(1), len(d)) for o, d in pieces[i + 1:]
                        if t.read(o, len(d)) != d]
                assert not diff, f"consumed before the write was complete: {diff}"
        if not consumed:  # the doorbell landed before the payload finished: the next poll sees it
            consumed, _ = server.poll(LIMITS)
        assert [c.prompt for c in consumed] == [prompt]
        assert consumed[0].params.temperature == pytest.approx(req.temperature)


def test_corrupt_slot_is_rejected_after_grace(ring, monkeypatch):
    server, t = ring
    payload, seq_end, doorbell = slot_writes(server.geom, 3, 1, request())
    off, body = payload
    body = bytearray(body)
    body[-1] ^= 0x40  # flip a bit in the last prompt token
    for w in ((off, bytes(body)), seq_end, doorbell):
        t.write(*w)
    assert server.poll(LIMITS) == ([], [])  # within the grace period: maybe still landing
    import blink.gpu_engine.ring_server as rs
    real = rs.time.monotonic
    monkeypatch.setattr(rs.time, "monotonic", lambda: real() + CORRUPT_GRACE_S + 1)
    new, rejected = server.poll(LIMITS)
    assert new == [] and [(r.slot, r.reason) for r in rejected] == [(3, RejectReason.CORRUPT)]


@pytest.mark.parametrize("fields, reason", [
    (dict(prompt=(1, VOCAB)), RejectReason.TOKEN_OUT_OF_RANGE),
    (dict(prompt=(1, -3)), RejectReason.TOKEN_OUT_OF_RANGE),
    (dict(max_tokens=0), RejectReason.BAD_MAX_TOKENS),
    (dict(temperature=-0.5), RejectReason.BAD_TEMPERATURE),
    (dict(temperature=float("nan")), RejectReason.BAD_TEMPERATURE),
    (dict(top_p=0.0), RejectReason.BAD_TOP_P),
    (dict(top_p=1.5), RejectReason.BAD_TOP_P),
    (dict(top_k=-1), RejectReason.BAD_TOP_K),
    (dict(stop_ids=(VOCAB + 5,)), RejectReason.BAD_STOP_IDS),
    (dict(max_tokens=62), RejectReason.EXCEEDS_CONTEXT),
    (dict(max_tokens=46), RejectReason.EXCEEDS_KV_CAPACITY),
])
def test_bad_fields_are_rejected_with_reason(ring, fields, reason):
    server, t = ring
    if "prompt" in fields:
        fields["prompt"] = np.asarray(fields["prompt"], np.int32)
    for w in slot_writes(server.geom, 0, 1, request(**fields)):
        t.write(*w)
    new, rejected = server.poll(LIMITS)
    assert new == [] and [r.reason for r in rejected] == [reason]
    # the rejection is published in the output record with its reason
    server.finish(0, 1, FinishReason.REJECTED, rejected[0].reason)
    rec = np.frombuffer(t.read(server.geom.record_offset(0), layout.RECORD_DTYPE.itemsize),
                        layout.RECORD_DTYPE)[0]
    assert (rec["gen"], rec["finish_reason"], rec["detail"]) == (1, FinishReason.REJECTED, reason)


def test_bad_prompt_len_in_slot_is_rejected(ring):
    """A hand-crafted slot whose prompt_len is beyond the slot is clamped and rejected."""
    server, t = ring
    geom = server.geom
    fixed = np.zeros((), SLOT_DTYPE)
    fixed["prompt_len"] = 10_000
    fixed["max_tokens"] = 1
    fixed["top_p"] = 1.0
    raw = bytearray(fixed.tobytes())
    crc = layout.payload_crc(bytes(raw) + bytes(4 * geom.max_prompt_tokens),
                             geom.max_prompt_tokens, 1)
    raw[8:12] = np.uint32(crc).tobytes()
    base = geom.slot_offset(1)
    t.write(base + 4, bytes(raw[4:]))
    t.write(base + geom.seq_end_offset, np.uint32(1).tobytes())
    t.write(base, np.uint32(1).tobytes())
    new, rejected = server.poll(LIMITS)
    assert new == [] and [r.reason for r in rejected] == [RejectReason.BAD_PROMPT_LEN]


def test_records_publish_tokens_then_finish(ring):
    server, t = ring
    server.open_record(1, 5, 3)
    for i, tok in enumerate((10, 11, 12)):
        server.append_token(1, i, tok)
    server.finish(1, 5, FinishReason.LENGTH)
    off = server.geom.record_offset(1)
    rec = np.frombuffer(t.read(off, layout.RECORD_DTYPE.itemsize), layout.RECORD_DTYPE)[0]
    assert (rec["gen"], rec["num_tokens"], rec["finish_reason"], rec["prompt_len"]) == \
        (5, 3, FinishReason.LENGTH, 3)
    toks = np.frombuffer(t.read(off + layout.RECORD_DTYPE.itemsize, 12), "<i4")
    assert toks.tolist() == [10, 11, 12]


def test_cancel_word(ring):
    server, t = ring
    assert not server.cancel_requested(2, 4)
    t.write(server.geom.slot_offset(2) + 4, np.uint32(4).tobytes())
    assert server.cancel_requested(2, 4) and not server.cancel_requested(2, 5)


@contextlib.contextmanager
def serving_and_beating(server):
    """The ring's engine SERVING, its heartbeat moving every millisecond while inside."""
    server.set_state(layout.EngineState.SERVING)
    beating = threading.Event()

    def beat():
        while not beating.is_set():
            server.beat()
            time.sleep(0.001)

    t = threading.Thread(target=beat)
    t.start()
    try:
        yield
    finally:
        beating.set()
        t.join()


def test_live_engine_ring_is_not_replaced(ring):
    from blink.gpu_engine.ring_server import RingInUse
    server, _ = ring
    with serving_and_beating(server), pytest.raises(RingInUse, match="another engine"):
        RingServer(server.segment.path.name, server.geom, model_name="b", vocab_size=VOCAB,
                   context_length=64, eos_ids=())


def test_engine_replacing_segment_is_detected(ring):
    server, t = ring
    assert t.is_current()
    server.claim.close()  # as the kernel releases it when the engine's process dies
    other = RingServer(server.segment.path.name, server.geom, model_name="b", vocab_size=VOCAB,
                       context_length=64, eos_ids=())
    try:
        assert not t.is_current()
    finally:
        other.close()


def test_the_header_describes_the_ring_and_its_engine():
    """Every field the front end reads (EngineLink._open_ring) is the engine's: the geometry's
    sizes and offsets, the model's limits, the first MAX_EOS_IDS of its EOS ids, its kind and
    pid; each engine start has its own odd instance; a closed engine's ring says STOPPED to a
    front end that still maps it."""
    import os

    from blink.gpu_engine.reference_engine import build_engine
    from blink.ring.layout import MAX_EOS_IDS, EngineKind, EngineState
    name = f"blink-test-{secrets.token_hex(6)}"
    geom = RingGeometry(3, max_prompt_tokens=20, max_output_tokens=100)
    eos = tuple(range(100, 100 + MAX_EOS_IDS + 2))
    instances = []
    for _ in range(2):
        server = build_engine(lambda: RingServer(  # (failing, its ring file goes)
            name, geom, model_name="unit-model", vocab_size=VOCAB, context_length=120,
            eos_ids=eos, engine_kind=EngineKind.SYNTHETIC))
        transport = ShmTransport(ShmSegment.attach(name))
        try:
            h = np.frombuffer(transport.read(0, layout.HEADER_DTYPE.itemsize),
                              layout.HEADER_DTYPE)[0]
            assert (h["magic"], h["layout_version"]) == (layout.RING_MAGIC, layout.LAYOUT_VERSION)
            assert (h["num_slots"], h["max_prompt_tokens"], h["max_output_tokens"]) == (3, 20, 100)
            assert (h["slot_bytes"], h["record_bytes"], h["total_bytes"]) == \
                (geom.slot_bytes, geom.record_bytes, geom.total_bytes)
            assert (h["header_bytes"], h["slots_offset"], h["records_offset"]) == \
                (geom.slots_offset, geom.slots_offset, geom.records_offset)
            assert (h["vocab_size"], h["context_length"], h["engine_pid"]) == \
                (VOCAB, 120, os.getpid())
            assert h["eos_ids"][:h["num_eos_ids"]].tolist() == list(eos[:MAX_EOS_IDS])
            assert bytes(h["model_name"]).rstrip(b"\0") == b"unit-model"
            assert (h["engine_kind"], h["engine_state"]) == \
                (EngineKind.SYNTHETIC, EngineState.STARTING)
            instances.append(int(h["engine_instance"]))
            server.close()
            h = np.frombuffer(transport.read(0, layout.HEADER_DTYPE.itemsize),
                              layout.HEADER_DTYPE)[0]
            assert h["engine_state"] == EngineState.STOPPED
        finally:
            transport.close()
            if server.header is not None:
                server.close()
    assert instances[0] != instances[1] and all(i % 2 == 1 for i in instances)


def test_a_live_engine_that_holds_no_claim_here_keeps_its_ring(ring):
    """An engine whose claim this process cannot see (another network namespace, an older
    Blink) but whose heartbeat moves keeps its ring: a second engine is refused, naming its
    pid, and lets go of its own claim (a later engine, once the first is gone, may start
    while the refusal is still referenced); once the first engine is stopped its ring is
    replaced at once, without the wait for a heartbeat, and nothing opened for the look is
    left open."""
    import os

    from blink.gpu_engine.ring_server import RingInUse, _refuse_live_engine
    from blink.ring.lifecycle import claim_ring
    server, t = ring
    name = server.segment.path.name
    server.claim.close()  # (as the other namespace's: not seen here)
    with serving_and_beating(server):
        try:
            RingServer(name, server.geom, model_name="b", vocab_size=VOCAB, context_length=64,
                       eos_ids=()).close()
        except RingInUse as e:
            refused = e
        else:
            pytest.fail("a live engine's ring was replaced")
    assert f"pid {os.getpid()}" in str(refused) and t.is_current()  # not replaced
    claim_ring(name, "engine").close()  # the refused engine holds no claim
    del refused
    server.set_state(layout.EngineState.STOPPED)
    fds = len(os.listdir("/proc/self/fd"))
    started = time.monotonic()
    _refuse_live_engine(name, wait_s=30)
    assert time.monotonic() - started < 5
    assert len(os.listdir("/proc/self/fd")) == fds


def test_strided_reads_reach_the_ring_s_end_and_no_further(ring):
    """A strided read or live u32 view ending at the ring's last byte is the ring's bytes; one
    byte more is a ValueError that says so (not numpy's error about a buffer too small)."""
    _, t = ring
    t.write(t.size - 12, bytes(range(1, 13)))  # (the last record's last tokens)
    assert t.read_strided(t.size - 12, 8, 2, 4) == bytes([1, 2, 3, 4, 9, 10, 11, 12])
    assert t.strided_u32(t.size - 12, 8, 2).tolist() == [0x04030201, 0x0C0B0A09]
    with pytest.raises(ValueError, match="strided read past the end of the ring"):
        t.read_strided(t.size - 12, 8, 2, 5)
    with pytest.raises(ValueError, match="strided view past the end of the ring"):
        t.strided_u32(t.size - 11, 8, 2)


def test_a_slot_s_grace_for_a_corrupt_write_starts_with_that_write(ring, monkeypatch):
    """A slot whose write was still landing (its CRC off) and was then consumed: the slot's
    next generation whose bytes are still landing gets its own grace, not the one its slot's
    earlier write started (rejected as corrupt at once, seconds later)."""
    import blink.gpu_engine.ring_server as rs
    server, t = ring
    real, offset = rs.time.monotonic, [0.0]
    monkeypatch.setattr(rs.time, "monotonic", lambda: real() + offset[0])

    def landing(gen):
        payload, seq_end, doorbell = slot_writes(server.geom, 3, gen, request(request_id=gen))
        off, body = payload
        torn = bytearray(body)
        torn[-1] ^= 0x40  # the last prompt token not landed yet
        for w in ((off, bytes(torn)), seq_end, doorbell):
            t.write(*w)
        return payload

    payload = landing(1)
    assert server.poll(LIMITS) == ([], [])
    t.write(*payload)  # landed
    assert [r.gen for r in server.poll(LIMITS)[0]] == [1]
    offset[0] = 5.0
    payload = landing(2)
    assert server.poll(LIMITS) == ([], [])  # its own grace
    offset[0] += CORRUPT_GRACE_S + 0.1
    new, rejected = server.poll(LIMITS)
    assert new == [] and [(r.slot, r.gen, r.reason) for r in rejected] == \
        [(3, 2, RejectReason.CORRUPT)]


def test_every_sampling_parameter_crosses_the_ring(ring):
    """A request's sampling parameters, none at its default, reach the engine as written."""
    from blink.gpu_engine.sequence import SamplingParams
    server, t = ring
    new, rejected = _poll_one(server, t, request(max_tokens=5, temperature=0.5, top_p=0.75,
                                                 top_k=7, seed=11, ignore_eos=True,
                                                 stop_ids=(3, 9)), LIMITS, 1)
    assert rejected == [] and new[0].params == SamplingParams(
        max_tokens=5, temperature=0.5, top_p=0.75, top_k=7, seed=11, ignore_eos=True,
        stop_ids=frozenset({3, 9}))


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to compile the C view")
def test_generated_c_header_is_current_and_compiles(tmp_path):
    from pathlib import Path
    header = Path(layout.__file__).resolve().parents[2] / "gpu_engine" / "csrc" / "ring_layout.h"
    assert header.read_text() == layout.c_header(), \
        "run `python -m blink.ring.layout --write-header`"
    src = tmp_path / "check.cc"
    src.write_text(f'#include "{header}"\nint main() {{ return 0; }}\n')
    # the header's static_asserts check every offset and size against layout.py's
    subprocess.run(["g++", "-std=c++17", "-fsyntax-only", str(src)], check=True)



class LinkedRing:
    """An engine's ring of one slot (RingServer, driven by the test) and a front end's EngineLink
    attached to it, alive."""

    def __init__(self, **link_args):
        import asyncio

        from blink.nic_service.engine_link import EngineLink
        self.name = f"blink-test-{secrets.token_hex(6)}"
        self.server = RingServer(self.name, RingGeometry(1, max_prompt_tokens=63,
                                                         max_output_tokens=64),
                                 model_name="unit", vocab_size=VOCAB, context_length=64,
                                 eos_ids=(2,))
        self.server.set_state(layout.EngineState.SERVING)
        self.loop = asyncio.new_event_loop()
        self.link = EngineLink(self.name, engine_timeout_s=1e9, **link_args)
        self.server.beat()
        self.link._try_attach()
        self.server.beat()
        self.link._poll_once()
        assert self.link.alive

    def submit(self, max_tokens: int = 3):
        return self.loop.run_until_complete(self.link.submit(dict(
            prompt=np.asarray([5, 6], np.int32), max_tokens=max_tokens)))

    def admit(self):
        """The engine takes the submitted request: its record now belongs to it."""
        (r,), _ = self.server.poll(LIMITS)
        self.server.open_record(r.slot, r.gen, len(r.prompt))
        return r

    def close(self) -> None:
        self.loop.close()
        self.link._detach(RuntimeError("test over"))
        self.server.close()
        assert not shm_path(self.name).exists()


def test_a_front_end_that_cannot_attach_says_why_once(caplog):
    """A front end that never reaches its engine (a wrong ring name, a wrong --rdma-addr) said
    nothing at the default level: it sat NOT_SERVING with no line. Each new reason is one INFO
    line until the first attach; the same reason again, at debug level."""
    import logging

    from blink.nic_service.engine_link import EngineLink
    link = EngineLink(f"blink-test-{secrets.token_hex(6)}", engine_timeout_s=1e9)
    with caplog.at_level(logging.INFO, logger="blink.frontend"):
        for _ in range(3):
            link._try_attach()
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert len(lines) == 1 and lines[0].startswith(
        f"engine not attached: no engine ring at /dev/shm/{link.ring_name}"), lines


def test_a_slot_s_generation_wraps_past_zero():
    """After generation 2^32 - 1 a slot's next request is generation 1: 0 means an empty slot,
    which the engine never consumes, so a request written as generation 0 would wait forever."""
    ring = LinkedRing()
    server = ring.server
    try:
        ring.link._next_gen[0] = 0xFFFF_FFFF
        for want in (0xFFFF_FFFF, 1):
            handle = ring.submit(max_tokens=1)
            request = ring.admit()
            assert request.gen == handle.gen == want
            server.append_token(request.slot, 0, 7)
            server.finish(request.slot, request.gen, layout.FinishReason.LENGTH)
            ring.link._poll_once()
    finally:
        ring.close()


@pytest.mark.parametrize("ended", ["stopped", "killed"])
def test_an_engine_s_last_counters_are_carried_over_its_restart(ended):
    """The engine writes a request's finish, then its counters at the step's end; a front end
    that read the record between the two, and next saw the engine stopped (its header STOPPED)
    or gone (killed: the old mapping still shows its header), folded in the header before
    (admitted 1, finished 0): the request counted as cancelled and its token was lost from the
    totals that carry over restarts."""
    ring = LinkedRing()
    server = ring.server
    try:
        handle = ring.submit(max_tokens=1)
        r = ring.admit()
        server.header["requests_admitted"] = 1  # the step's counters, read by the front end
        server.beat()
        ring.link._poll_once()
        server.append_token(r.slot, 0, 42)
        server.finish(r.slot, r.gen, layout.FinishReason.LENGTH)
        server.beat()
        ring.link._poll_once()  # the record read: its token and LENGTH
        assert drain(handle) == ([[42]], layout.FinishReason.LENGTH)
        server.header["requests_finished"] = server.header["tokens_generated"] = 1
        if ended == "stopped":
            server.close()  # STOPPED, the ring unlinked
            ring.link._poll_once()
        else:
            server.claim.close()  # killed: its header stays as it was
        ring.server = server = RingServer(ring.name, RingGeometry(1, max_prompt_tokens=63,
                                                                  max_output_tokens=64),
                                          model_name="unit", vocab_size=VOCAB,
                                          context_length=64, eos_ids=(2,))
        server.set_state(layout.EngineState.SERVING)
        if ring.link._transport is not None:
            ring.link._poll_once()  # the new instance seen: detached
        server.beat()
        ring.link._try_attach()
        totals = ring.link.counter_totals()
        assert {k: totals[k] for k in ("requests_admitted", "requests_finished",
                                       "requests_cancelled", "tokens_generated")} == {
            "requests_admitted": 1, "requests_finished": 1, "requests_cancelled": 0,
            "tokens_generated": 1}
    finally:
        ring.close()


@pytest.mark.parametrize("engine_ended", ["cancelled", "length"])
def test_a_pending_stop_string_finish_counts_once_when_the_link_detaches(engine_ended):
    """The front end matched a stop string and wrote the cancel; the link then gave the engine
    up (a stall) before any poll read the record. Where the engine took the cancel, the request
    is a stop-string finish (the engine's cancel moves to the finished); where it had ended the
    request by its length first, the engine's own count has it as finished, and nothing moves.
    It was counted as a stop-string finish either way, so later a client's cancel was reported
    as a finished request."""
    ring = LinkedRing()
    server, link = ring.server, ring.link
    try:
        handle = ring.submit(max_tokens=3)
        r = ring.admit()
        server.append_token(r.slot, 0, 7)
        link.cancel(handle, stop_matched=True)
        reason = (layout.FinishReason.CANCELLED if engine_ended == "cancelled"
                  else layout.FinishReason.LENGTH)
        server.finish(r.slot, r.gen, reason)
        server.header["requests_admitted"] = 1
        server.header["requests_" + ("cancelled" if engine_ended == "cancelled"
                                     else "finished")] = 1
        link._detach(RuntimeError("the engine stalled"))  # before a poll read the record
        server.beat()
        link._try_attach()
        server.beat()
        link._poll_once()
        assert link.alive
        handle = ring.submit(max_tokens=3)  # then a client cancels a request
        r = ring.admit()
        link.cancel(handle)
        server.finish(r.slot, r.gen, layout.FinishReason.CANCELLED)
        server.header["requests_admitted"] = 2
        server.header["requests_cancelled"] += 1
        server.beat()
        link._poll_once()
        totals = link.counter_totals()
        assert (totals["requests_finished"], totals["requests_cancelled"]) == (1, 1)
    finally:
        ring.close()


def test_a_transport_that_fails_as_a_request_is_written_is_unavailable_and_keeps_the_slot():
    """The engine goes away while submit writes a slot (RDMA: the transport's write raises):
    the request is UNAVAILABLE, as a failed poll detaches, and the slot is not lost (the error
    escaped as the transport's, a gRPC UNKNOWN, and the slot was neither free nor live while the
    link stayed attached)."""
    from blink.nic_service.engine_link import EngineUnavailable
    ring = LinkedRing()
    try:
        def gone(offset, data):
            raise RuntimeError("the engine at x disconnected")
        ring.link._transport.write = gone
        with pytest.raises(EngineUnavailable, match="went away as the request was written"):
            ring.submit()
        assert not ring.link.alive and ring.link._transport is None
        ring.server.beat()
        ring.link._try_attach()  # the engine is still there: every slot free again
        ring.server.beat()
        ring.link._poll_once()
        assert ring.link.alive and list(ring.link._free) == [0]
        handle = ring.submit(max_tokens=1)
        assert ring.admit().gen == handle.gen
    finally:
        ring.close()


def test_a_slot_an_earlier_front_end_left_running_is_reused_once_its_cancel_is_confirmed():
    """A front end killed with a request running: the next one cancels it as it attaches, and
    takes the slot only once the engine has finished that generation. (It took it at once: a
    request written before the engine read the cancel word replaced it, the engine dropped the
    old sequence as stale, and counted it neither finished nor cancelled.)"""
    import asyncio

    from blink.nic_service.engine_link import EngineLink
    ring = LinkedRing()
    server = ring.server
    try:
        ring.submit(max_tokens=8)
        old = ring.admit()
        server.append_token(old.slot, 0, 42)
        # the front end is killed; another attaches
        ring.link._detach(RuntimeError("killed"), cancel=False)  # (writes nothing, as a crash)
        ring.link = link = EngineLink(ring.name, engine_timeout_s=1e9)
        server.beat()
        link._try_attach()
        server.beat()
        link._poll_once()
        assert link.alive and link.slots_in_use == 1 and not link._free
        assert server.cancel_words()[old.slot] == old.gen
        waiting = ring.loop.create_task(link.submit(dict(prompt=np.asarray([5, 6], np.int32),
                                                         max_tokens=1)))
        ring.loop.run_until_complete(asyncio.sleep(0.01))
        assert not waiting.done() and server.poll(LIMITS) == ([], [])  # nothing written
        server.finish(old.slot, old.gen, layout.FinishReason.CANCELLED)  # the engine's confirm
        link._poll_once()
        handle = ring.loop.run_until_complete(waiting)
        assert ring.admit().gen == handle.gen != old.gen
    finally:
        ring.close()


def test_a_drain_s_timeout_gives_up_the_requests_waiting_for_a_slot_too():
    """A drain whose time ran out (give_up_live) ends the live requests and cancels them in the
    engine; the requests still waiting for a slot end with the same error and never take the
    slots those cancels free (they did, and generated past the shutdown deadline)."""
    import asyncio

    from blink.nic_service.engine_link import EngineUnavailable
    ring = LinkedRing(queue_timeout_s=30.0)
    try:
        live = ring.submit(max_tokens=8)
        waiting = ring.loop.create_task(ring.link.submit(dict(
            prompt=np.asarray([5, 6], np.int32), max_tokens=8)))
        ring.loop.run_until_complete(asyncio.sleep(0.01))
        assert ring.link.waiting_for_slot == 1 and not waiting.done()
        why = EngineUnavailable("server shutting down")
        ring.link.give_up_live(why)
        assert ring.link.waiting_for_slot == 0
        with pytest.raises(EngineUnavailable, match="shutting down"):
            ring.loop.run_until_complete(waiting)
        assert live.events.get_nowait() is why
    finally:
        ring.close()


def test_a_restarted_worker_publishes_its_load_as_it_attaches():
    """A front-end worker killed with live streams leaves its slots in use (and requests queued)
    in the file that the workers of `--workers N` share; the worker started in its place holds
    none and says so as it attaches (GetServerStats summed the dead worker's 20 slots, which
    looked like a leak, until the new one served a request)."""
    from blink.nic_service.engine_link import EngineLink, WorkerCounts
    name = f"blink-test-{secrets.token_hex(6)}"
    server = RingServer(name, RingGeometry(2, max_prompt_tokens=63, max_output_tokens=64),
                        model_name="unit", vocab_size=VOCAB, context_length=64, eos_ids=(2,))
    server.set_state(layout.EngineState.SERVING)
    try:
        for kind, stale in (("slots", 20), ("queued", 3)):  # the killed worker 1's
            WorkerCounts(name, 1, 2, kind=kind).set(stale)
        link = EngineLink(name, engine_timeout_s=1e9, worker=(1, 2))
        assert link.server_slots_in_use == 20  # (before it attaches: the file as it was left)
        server.beat()
        link._try_attach()
        assert link.info is not None and link.slots_in_use == 0
        assert link.server_slots_in_use == 0
        assert WorkerCounts(name, 1, 2, kind="queued").total() == 0
        link._detach(RuntimeError("test over"))
    finally:
        WorkerCounts.reset(name)
        server.close()


def test_a_worker_without_a_share_of_the_slots_says_why_once_and_to_each_request(caplog):
    """A front-end worker whose share of a ring's slots is empty (`blink frontend --workers 2`
    against an engine of one slot) logs why once, not at every attach attempt (five a second),
    and refuses each request with that reason rather than a bare "not available"."""
    import asyncio
    import logging

    from blink.nic_service.engine_link import EngineLink, EngineUnavailable, WorkerCounts
    name = f"blink-test-{secrets.token_hex(6)}"
    server = RingServer(name, RingGeometry(1, max_prompt_tokens=63, max_output_tokens=64),
                        model_name="unit", vocab_size=VOCAB, context_length=64, eos_ids=(2,))
    server.set_state(layout.EngineState.SERVING)
    loop = asyncio.new_event_loop()
    try:
        link = EngineLink(name, engine_timeout_s=1e9, worker=(0, 2))  # worker 1 has the slot
        with caplog.at_level(logging.ERROR, logger="blink.frontend"):
            for _ in range(5):
                server.beat()
                link._try_attach()
        assert link.info is None and not link.alive
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and "too few request slots (1) for 2 front-end workers" in errors[0]
        with pytest.raises(EngineUnavailable, match=r"slots \(1\) for 2 front-end workers"):
            loop.run_until_complete(link.submit(dict(prompt=np.asarray([5, 6], np.int32),
                                                     max_tokens=3)))
    finally:
        loop.close()
        WorkerCounts.reset(name)
        server.close()


def drain(handle) -> tuple[list[list[int]], FinishReason | None]:
    """(the token lists of the handle's events so far, its finish reason or None)."""
    from blink.nic_service.engine_link import Finished
    chunks, reason = [], None
    while not handle.events.empty():
        event = handle.events.get_nowait()
        if isinstance(event, Finished):
            reason = event.reason
        else:
            chunks.append(event.ids)
    return chunks, reason


class _MoveAfterRead:
    """A front-end transport on which the engine makes one move right after the front end's k-th
    read: the protocol orders a front end's reads one after another, never the bytes in one. A
    read that touches `words` (a record's fixed fields) is taken as the copy it is, word by word
    in address order, the engine free to move between them: so a read of a whole record, which
    would take num_tokens before finish_reason, counts as several."""

    def __init__(self, inner, k: int, move, words: range = range(0)):
        self.inner, self.k, self.move, self.reads, self.words = inner, k, move, 0, words

    def _done(self, data: bytes) -> bytes:
        self.reads += 1
        if self.reads == self.k:
            self.move()
        return data

    def read(self, offset: int, length: int) -> bytes:
        if offset < self.words.stop and offset + length > self.words.start:
            return b"".join(self._done(self.inner.read(o, min(4, offset + length - o)))
                            for o in range(offset, offset + length, 4))
        return self._done(self.inner.read(offset, length))

    def read_strided(self, offset: int, stride: int, count: int, length: int) -> bytes:
        return self._done(self.inner.read_strided(offset, stride, count, length))

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("few_live", [8, 0], ids=["record-by-record", "vectorised"])
@pytest.mark.parametrize("k", range(1, 9))
def test_front_end_record_reads_miss_no_move_of_the_engine(k, few_live, monkeypatch):
    """EngineLink reads a record's gen, then its finish_reason, then its num_tokens: after
    whichever of its reads the engine appends the last token and finishes, no token is lost
    (a count read before the finish would miss it); after whichever the engine admits the
    slot's next request, that request gets nothing of the previous one's record. Both ways of
    reading the records: each live one's words (a few live requests), the share's columns."""
    from blink.nic_service import engine_link
    monkeypatch.setattr(engine_link, "FEW_LIVE", few_live)
    ring = LinkedRing()
    server, link = ring.server, ring.link
    plain = link._transport

    record = link.info.geometry.record_offset(0)  # the ring's one slot's
    fields = range(record, record + layout.RECORD_DTYPE.itemsize)

    def poll_with_move(move) -> None:
        moving = link._transport = _MoveAfterRead(plain, k, move, fields)
        while moving.reads < k:  # the move lands in the first poll, or (k past its reads) later
            link._poll_once()
        link._poll_once()  # and a poll after it
        link._transport = plain

    try:
        first = ring.submit()
        a = ring.admit()
        for i, tok in enumerate((10, 11)):
            server.append_token(a.slot, i, tok)

        def last_token_and_finish():
            server.append_token(a.slot, 2, 12)
            server.finish(a.slot, a.gen, FinishReason.LENGTH)
        poll_with_move(last_token_and_finish)
        chunks, reason = drain(first)
        assert sum(chunks, []) == [10, 11, 12] and reason is FinishReason.LENGTH

        second = ring.submit()  # the ring's only slot again, its record still the first's
        admitted = []
        poll_with_move(lambda: admitted.append(ring.admit()))
        assert admitted and drain(second) == ([], None)
        b = admitted[0]
        server.append_token(b.slot, 0, 20)
        server.finish(b.slot, b.gen, FinishReason.LENGTH)
        link._poll_once()
        assert drain(second) == ([[20]], FinishReason.LENGTH)
    finally:
        ring.close()


@pytest.mark.parametrize("interval_s", [0.0, 3600.0])
def test_stream_interval_holds_tokens_but_not_the_first_or_the_finish(interval_s):
    """With stream_interval_s, the tokens after a request's first wait in the record until the
    interval has passed, to go out together; the finish brings whatever waits at once."""
    ring = LinkedRing(stream_interval_s=interval_s)
    server, link = ring.server, ring.link
    try:
        handle = ring.submit(max_tokens=4)
        r = ring.admit()
        for i, tok in enumerate((10, 11, 12)):
            server.append_token(r.slot, i, tok)
            link._poll_once()
        if interval_s:
            assert drain(handle) == ([[10]], None)  # the first token at once, then held
        else:
            assert drain(handle) == ([[10], [11], [12]], None)
        server.append_token(r.slot, 3, 13)
        server.finish(r.slot, r.gen, FinishReason.LENGTH)
        link._poll_once()
        assert drain(handle) == ([[11, 12, 13]] if interval_s else [[13]], FinishReason.LENGTH)
    finally:
        ring.close()


def serving_ring(name: str, slots: int) -> RingServer:
    server = RingServer(name, RingGeometry(slots, max_prompt_tokens=63, max_output_tokens=64),
                        model_name="unit", vocab_size=VOCAB, context_length=64, eos_ids=(2,))
    server.set_state(layout.EngineState.SERVING)
    return server


async def idling_link(server: RingServer, name: str, **link_args):
    """An EngineLink started on the server's ring and alive, its idle poll then an hour apart:
    only a wake (RecordWatch's, or the live timer's) makes it poll again."""
    import asyncio

    from blink.nic_service.engine_link import EngineLink
    link = EngineLink(name, engine_timeout_s=1e9, idle_poll_interval_s=0.005, **link_args)
    await link.start()
    while not link.alive:
        server.beat()
        await asyncio.sleep(0.01)
    link.idle_poll_interval_s = 3600.0
    await asyncio.sleep(0.05)  # the loop is in its hour-long wait now
    return link


async def submit_and_admit(link, server: RingServer, max_tokens: int):
    """A request through the link, taken by the engine: (its handle, the engine's request)."""
    handle = await link.submit(dict(prompt=np.asarray([5, 6], np.int32), max_tokens=max_tokens))
    (r,), _ = server.poll(LIMITS)
    server.open_record(r.slot, r.gen, len(r.prompt))
    return handle, r


@pytest.mark.parametrize("worker", [(0, 1), (1, 2)], ids=["one-worker", "second-of-two"])
@pytest.mark.parametrize("watched", [True, False], ids=["shared-memory", "no-live-views"])
def test_a_moving_record_wakes_the_poll_loop(watched, worker, monkeypatch):
    """With the idle poll an hour apart, a live request's tokens and finish still reach it: in
    shared memory RecordWatch's thread wakes the loop when the record moves (its views start at
    the worker's share of the slots); on a transport without live views (RDMA) submit moves the
    loop onto its live timer. Once nothing is live, the thread disarms; stopping the link with a
    request live ends the thread."""
    import asyncio

    from blink.nic_service.engine_link import Finished
    if not watched:
        monkeypatch.delattr(ShmTransport, "strided_u32")
    name = f"blink-test-{secrets.token_hex(6)}"
    server = serving_ring(name, 4)

    async def next_event(handle):
        return await asyncio.wait_for(handle.events.get(), 10)

    async def scenario():
        link = await idling_link(server, name, worker=worker)
        try:
            handle, r = await submit_and_admit(link, server, max_tokens=2)
            server.append_token(r.slot, 0, 10)
            assert (await next_event(handle)).ids == [10]
            server.append_token(r.slot, 1, 11)
            server.finish(r.slot, r.gen, FinishReason.LENGTH)
            events = [await next_event(handle)]
            if not isinstance(events[-1], Finished):
                events.append(await next_event(handle))
            assert events[0].ids == [11] and events[-1].reason is FinishReason.LENGTH
            assert link._watched is watched
            if watched:
                assert link._watch.wakes >= 2
                for _ in range(100):  # the thread sees nothing live at its next tick
                    if not link._watch._armed.is_set():
                        break
                    await asyncio.sleep(0.01)
                assert not link._watch._armed.is_set()
            await link.submit(dict(prompt=np.asarray([5, 6], np.int32), max_tokens=2))
            await asyncio.sleep(0.01)  # the thread armed, ticking
        finally:
            await link.stop()
        assert not link._watch.running

    try:
        asyncio.run(scenario())
    finally:
        server.close()
        from blink.nic_service.engine_link import WorkerCounts
        WorkerCounts.reset(name)  # (what a front end's parent clears as it stops)


def test_record_watch_sees_only_what_the_poll_would_hand_on():
    """WatchedRecords.moved, the thread's test for waking the loop, against each case of
    EngineLink._poll_records: a record of the live generation with unread tokens or a finish
    moves; a stale generation's record, read tokens, and tokens a stream interval still holds
    (until the finish) do not."""
    from blink.nic_service.record_watch import WatchedRecords
    n = 4
    ring = np.zeros((n, 16), np.uint32)  # records of 64 bytes: gen, finish, count, ...
    gen, finish, count = (ring[:, i] for i in range(3))
    want_gen, seen, due = np.full(n, -1, np.int64), np.zeros(n, np.int64), np.zeros(n)
    w = WatchedRecords(gen, finish, count, want_gen, seen, due, live={})
    assert gen.base is ring and not w.moved()
    gen[2], count[2] = 7, 3                     # the previous request's record in slot 2
    want_gen[2] = 8
    assert not w.moved()
    gen[2], count[2] = 8, 0                     # the engine took generation 8: reset, nothing yet
    assert not w.moved()
    count[2] = 1
    assert w.moved()
    seen[2] = 1                                 # the loop read it
    assert not w.moved()
    count[2], due[2] = 2, time.monotonic() + 3600
    assert not w.moved()                        # held by the stream interval
    finish[2] = FinishReason.LENGTH
    assert w.moved()                            # the finish goes at once, with what is held
    seen[2] = 2
    assert w.moved()                            # a finish with nothing unread (a cancel) too
    want_gen[2] = -1                            # finished: no longer live
    assert not w.moved()


def test_the_record_watch_wakes_once_held_tokens_are_due():
    """With a stream interval, a token the interval holds wakes the loop when it is due, not
    before (no wake per tick while it waits) and not never (the idle poll is an hour apart)."""
    import asyncio

    name = f"blink-test-{secrets.token_hex(6)}"
    server = serving_ring(name, 2)
    interval_s = 0.1

    async def scenario():
        link = await idling_link(server, name, stream_interval_s=interval_s)
        try:
            handle, r = await submit_and_admit(link, server, max_tokens=4)
            server.append_token(r.slot, 0, 10)
            assert (await asyncio.wait_for(handle.events.get(), 10)).ids == [10]
            held_at, wakes = time.monotonic(), link._watch.wakes
            server.append_token(r.slot, 1, 11)
            event = await asyncio.wait_for(handle.events.get(), 10)
            assert event.ids == [11]
            assert time.monotonic() - held_at >= 0.5 * interval_s  # held, then handed on
            assert link._watch.wakes - wakes <= 3  # one wake once due, not one a tick
        finally:
            await link.stop()

    try:
        asyncio.run(scenario())
    finally:
        server.close()


def _until(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


def test_the_record_watch_wakes_the_loop_once_until_it_polls(caplog):
    """RecordWatch and its loop: a live record that moved wakes the loop once, and again only
    after the loop's poll (`polled`), however many ticks it stays moved; a look at the records
    that fails wakes it too (a watch that gave up would stall the streams); records unwatched
    (their ring about to close) wake nothing more, and the thread disarms."""
    import asyncio

    from blink.nic_service.record_watch import RecordWatch, WatchedRecords
    loop = asyncio.new_event_loop()  # never run: the wakes queue on it
    gen, finish, count = (np.zeros(2, np.uint32) for _ in range(3))
    want_gen, seen, due = np.array([5, -1]), np.zeros(2, np.int64), np.zeros(2)
    gen[0], count[0] = 5, 1  # slot 0's live generation: a token not read yet
    live = {0: "handle"}
    watch = RecordWatch(loop, lambda: None, interval_s=0.001)
    try:
        watch.watch(WatchedRecords(gen, finish, count, want_gen, seen, due, live))
        watch.arm()
        assert _until(lambda: watch.wakes == 1)
        time.sleep(0.05)  # some 50 ticks, the record moved all along, the loop not polled
        assert watch.wakes == 1
        watch.polled()
        assert _until(lambda: watch.wakes == 2)
        # views whose shapes disagree: the look raises
        watch.watch(WatchedRecords(gen, finish, count, np.array([5, -1, -1]), seen, due, live))
        watch.polled()
        assert _until(lambda: watch.wakes == 3) and "ring record watch failed" in caplog.text
        watch.unwatch()
        watch.polled()
        assert _until(lambda: not watch._armed.is_set())
        time.sleep(0.02)
        assert watch.wakes == 3
    finally:
        watch.stop()
        loop.close()
    assert not watch.running


def test_the_record_watch_thread_sleeps_with_a_microsecond_of_timer_slack():
    """The watch thread's ticks end when asked: its timer slack (how late Linux may end a
    sleep) is 1 us, not the default 50, and the thread that started it keeps its own."""
    import asyncio
    from pathlib import Path

    from blink.nic_service.record_watch import RecordWatch
    if not Path("/proc/self/timerslack_ns").exists():
        pytest.skip("no timer slack in /proc: not Linux")

    def slack(task: str) -> int:
        return int(Path(f"/proc/{task}/timerslack_ns").read_text())

    before = slack("self")
    loop = asyncio.new_event_loop()
    watch = RecordWatch(loop, lambda: None, interval_s=0.001)
    try:
        assert _until(lambda: slack(str(watch._thread.native_id)) == 1000)
        assert slack("self") == before
    finally:
        watch.stop()
        loop.close()


def test_a_rejected_generation_drops_the_sequence_its_slot_held(checkpoints):
    """A front end that gave up on slot 0's generation 1 reuses the slot with a request the
    engine rejects: generation 1 is dropped (as an admitted reuse drops it), and the rejected
    generation's record stays REJECTED with no tokens (generation 1 went on writing tokens into
    it, then flipped it back to its own finish), every block back."""
    from blink.gpu_engine.reference_engine import EngineConfig, ReferenceEngine
    name = f"blink-test-{secrets.token_hex(6)}"
    engine = ReferenceEngine(EngineConfig(model_dir=checkpoints["llama"], ring_name=name,
                                          num_slots=4, num_kv_blocks=32))
    t = ShmTransport(ShmSegment.attach(name))
    try:
        def submit(gen, **fields):
            for off, data in slot_writes(engine.ring.geom, 0, gen,
                                         request(max_tokens=40, temperature=0.0, **fields)):
                t.write(off, data)
        submit(1)
        for _ in range(3):
            engine.step()
        assert int(engine.ring.rec_fixed[0]["num_tokens"]) > 0
        submit(2, top_p=0.0)  # out of range: rejected
        for _ in range(60):
            engine.step()
        rec = engine.ring.rec_fixed[0]
        assert (int(rec["gen"]), int(rec["num_tokens"]), int(rec["finish_reason"])) == (
            2, 0, FinishReason.REJECTED)
        assert not engine.core.active
        assert engine.pool.num_free == 32
        assert (int(engine.ring.header["requests_admitted"]),
                int(engine.ring.header["requests_rejected"])) == (1, 1)
    finally:
        t.close()
        engine.close()


def test_the_metrics_thread_reads_the_slot_queue_while_the_loop_changes_it():
    """The Prometheus scrape runs on prometheus_client's thread and reads how many requests
    wait for a slot while the event loop adds and removes them: iterating the live deque there
    raised "deque mutated during iteration" (about 170 times in 2 s of this loop), a 500 for
    the scrape."""
    import collections
    import types

    from blink.nic_service.engine_link import EngineLink

    class Waiting:
        def done(self) -> bool:
            return False
    link = types.SimpleNamespace(_waiters=collections.deque(Waiting() for _ in range(50)))
    stop = threading.Event()

    def loop():  # as requests queue for a slot and leave the queue
        while not stop.is_set():
            link._waiters.append(Waiting())
            link._waiters.popleft()
    mutator = threading.Thread(target=loop)
    mutator.start()
    try:
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            assert 49 <= EngineLink.waiting_for_slot.fget(link) <= 51
    finally:
        stop.set()
        mutator.join()
