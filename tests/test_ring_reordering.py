"""The ring protocol under RDMA's semantics, end to end: the front end's real EngineLink and the
engine's real RingServer over a transport whose writes land like one-sided RDMA writes.

RdmaLikeTransport: a front-end write does not land at once; it is cut into 4-byte-aligned
pieces that become visible one at a time, in random order, interleaved with everything else
(other writes' pieces, engine polls, engine steps, front-end polls), as bytes of an RDMA WRITE
may land in any order before its completion. A seeded schedule drives several concurrent
requests per slot set: submissions, cancels, piece deliveries, engine admission, engine token
appends and finishes, front-end record polls. Checked throughout:
  - no torn slot is consumed: every admitted request is exactly what was submitted;
  - nothing lost or duplicated: every request is admitted exactly once, and the tokens the
    front end receives are exactly the engine's, in order, once;
  - cancels are honoured: a cancelled request the engine had not finished ends CANCELLED.
A case is one delivered write piece, with an engine poll and a front-end poll after it.
"""
from __future__ import annotations

import asyncio
import random
import secrets

import numpy as np
import pytest

from blink.gpu_engine import ring_server
from blink.gpu_engine.ring_server import ModelLimits, RingServer
from blink.nic_service import engine_link
from blink.nic_service.engine_link import EngineLink, Finished, Tokens
from blink.ring.layout import EngineState, FinishReason, RingGeometry
from blink.ring.shm import ShmTransport, shm_path

VOCAB, CONTEXT = 500, 64
LIMITS = ModelLimits(vocab_size=VOCAB, context_length=CONTEXT, kv_capacity_tokens=4096)
CASES = 1_000_000


class RdmaLikeTransport(ShmTransport):
    """Writes become pending 4-byte-aligned pieces; deliver() lands one at random.

    A new write to bytes that an earlier write has not finished landing first completes that
    earlier write, as an RDMA transport must (it reuses a slot's memory only after the
    completions of its previous writes there): otherwise a piece of an old request that
    rewrote bytes already equal, so that its slot passed the CRC and was consumed, could land
    after the next request's bytes. (Without the rule, 600,000 cases here did not hit it.)"""

    def __init__(self, segment, rng: random.Random):
        super().__init__(segment)
        self.rng = rng
        self.pending: list[tuple[int, bytes]] = []

    def write(self, offset: int, data: bytes) -> None:
        end = offset + len(data)
        earlier = [p for p in self.pending if p[0] < end and offset < p[0] + len(p[1])]
        if earlier:
            self.pending = [p for p in self.pending if p not in earlier]
            for o, d in earlier:
                super().write(o, d)
        cuts = sorted({0, len(data), *(4 * self.rng.randrange(len(data) // 4 + 1)
                                       for _ in range(self.rng.randrange(4)))})
        self.pending += [(offset + a, bytes(data[a:b])) for a, b in zip(cuts, cuts[1:])]

    def deliver(self) -> bool:
        if not self.pending:
            return False
        i = self.rng.randrange(len(self.pending))
        self.pending[i], self.pending[-1] = self.pending[-1], self.pending[i]
        offset, data = self.pending.pop()
        super().write(offset, data)
        return True


def run_schedule(seed: int, cases: int) -> dict:
    rng = random.Random(seed)
    name = f"blink-test-rdma-{secrets.token_hex(4)}"
    server = RingServer(name, RingGeometry(6, max_prompt_tokens=CONTEXT - 1,
                                           max_output_tokens=CONTEXT),
                        model_name="rdma", vocab_size=VOCAB, context_length=CONTEXT, eos_ids=(1,))
    server.set_state(EngineState.SERVING)
    opened = []

    def open_rdma_like(ring_name, dialer=None):
        transport, info = real_open(ring_name, dialer)
        sim = RdmaLikeTransport(transport.segment, rng)
        opened.append(sim)
        return sim, info
    real_open = engine_link._open_ring
    engine_link._open_ring = open_rdma_like
    loop = asyncio.new_event_loop()
    stats = dict(cases=0, admitted=0, finished=0, cancelled=0, tokens=0)
    try:
        link = EngineLink(name, queue_timeout_s=0.01, engine_timeout_s=1e9)
        server.beat()
        link._try_attach()
        server.beat()
        link._poll_once()  # the heartbeat moved: alive
        assert link.alive
        sim = opened[0]
        submitted = {}   # (slot, gen) -> (prompt, handle)
        engine = {}      # slot -> [gen, tokens appended, target length]
        targets = {}     # (slot, gen) -> max_tokens, as admitted
        received = {}    # (slot, gen) -> tokens the front end got
        finished = {}    # (slot, gen) -> FinishReason
        cancelled = set()

        def token(slot: int, gen: int, n: int) -> int:
            return (slot * 31 + gen * 7 + n) % (VOCAB - 2) + 2

        def admit() -> None:
            new, rejected = server.poll(LIMITS)
            assert rejected == [], f"a partial write was judged: {rejected}"
            for r in new:
                key = (r.slot, r.gen)
                assert key not in targets, f"{key} admitted twice"
                assert r.prompt == submitted[key][0], "a torn slot was consumed"
                engine[r.slot] = [r.gen, 0, r.params.max_tokens]
                targets[key] = r.params.max_tokens
                server.open_record(r.slot, r.gen, len(r.prompt))

        def engine_step() -> None:
            server.beat()
            for slot, seq in list(engine.items()):
                gen, n, target = seq
                if server.cancel_requested(slot, gen):
                    server.finish(slot, gen, FinishReason.CANCELLED)
                    del engine[slot]
                    continue
                server.append_token(slot, n, token(slot, gen, n))
                seq[1] = n + 1
                stats["tokens"] += 1
                if seq[1] == target:
                    server.finish(slot, gen, FinishReason.LENGTH)
                    del engine[slot]

        live = {}        # (slot, gen) -> handle, until the front end sees it finish

        def front_end_poll() -> None:
            link._poll_once()
            for key, handle in list(live.items()):
                while not handle.events.empty():
                    event = handle.events.get_nowait()
                    if isinstance(event, Tokens):
                        received.setdefault(key, []).extend(event.ids)
                    else:
                        assert isinstance(event, Finished), event
                        assert key not in finished, f"{key} finished twice"
                        finished[key] = event.reason
                        del live[key]

        while stats["cases"] < cases:
            action = rng.random()
            if action < 0.08 and link._free:  # submit a request
                prompt = [rng.randrange(2, VOCAB) for _ in range(rng.randrange(1, 20))]
                handle = loop.run_until_complete(link.submit(dict(
                    prompt=np.asarray(prompt, np.int32), max_tokens=rng.randrange(1, 12))))
                submitted[(handle.slot, handle.gen)] = (prompt, handle)
                live[(handle.slot, handle.gen)] = handle
            elif action < 0.10 and live:  # cancel one in flight
                key = rng.choice(list(live))
                if not live[key].done:
                    link.cancel(live[key])
                    cancelled.add(key)
            elif action < 0.75:  # one piece lands; both sides look
                stats["cases"] += sim.deliver()
                admit()
                front_end_poll()
            else:
                engine_step()
                front_end_poll()
        # drain: every piece lands, the engine finishes everything, the front end reads it all
        while sim.deliver():
            pass
        for _ in range(100):
            admit()
            engine_step()
            front_end_poll()
            if not engine and len(finished) == len(submitted):
                break
        stats["admitted"] = len(targets)
        assert targets.keys() == submitted.keys(), "a request was lost"
        for key in submitted:
            assert key in finished, f"{key} never finished"
            got = received.get(key, [])
            assert got == [token(*key, n) for n in range(len(got))], \
                f"{key}: tokens lost, duplicated or reordered"
            if finished[key] is FinishReason.LENGTH:
                # all of them, unless the client cancelled (the link stops delivering then)
                assert len(got) == targets[key] or key in cancelled
            else:
                assert finished[key] is FinishReason.CANCELLED and key in cancelled
        stats["finished"] = sum(r is FinishReason.LENGTH for r in finished.values())
        stats["cancelled"] = sum(r is FinishReason.CANCELLED for r in finished.values())
        return stats
    finally:
        engine_link._open_ring = real_open
        loop.close()
        for t in opened:
            t.close()
        server.close()
        assert not shm_path(name).exists()


@pytest.mark.slow
def test_ring_protocol_under_rdma_like_reordering(monkeypatch):
    # The simulation's clock is its schedule, not wall time: a pause of the test process (a
    # garbage collection) must not look like bytes that never land. The grace period itself
    # is tested in test_ring_protocol.py (test_corrupt_slot_is_rejected_after_grace).
    monkeypatch.setattr(ring_server, "CORRUPT_GRACE_S", 3600.0)
    totals = dict(cases=0, admitted=0, finished=0, cancelled=0, tokens=0)
    for seed in range(4):
        for k, v in run_schedule(seed, CASES // 4).items():
            totals[k] += v
    print(f"rdma-like reordering: {totals['cases']} delivered pieces, {totals['admitted']} "
          f"requests, {totals['tokens']} tokens, {totals['cancelled']} cancelled")
    assert totals["cases"] >= CASES and totals["admitted"] > 10_000
    assert totals["cancelled"] > 100 and totals["finished"] > 1_000
