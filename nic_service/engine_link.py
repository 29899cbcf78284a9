"""The front end's only connection to the engine: one-sided reads and writes on its ring.

`EngineLink` attaches to the engine's ring, hands out request slots (bounded waiting when all
are busy), writes requests, polls the output records of live requests and turns what it reads
into per-request events. It also decides whether the engine is alive (its heartbeat moves, its
segment is current) and re-attaches on its own when a new engine instance appears.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from blink.ring.layout import (
    HEADER_DTYPE, LAYOUT_VERSION, RECORD_DTYPE, RING_MAGIC, EngineKind, EngineState,
    FinishReason, RingGeometry, SlotRequest, encode_slot,
)
from blink.ring.shm import ShmSegment, ShmTransport

log = logging.getLogger("blink.frontend")


class EngineUnavailable(Exception):
    """The engine is not attached, stopped, or stopped answering."""


class SlotsExhausted(Exception):
    """Every request slot stayed busy for the whole queue timeout (or the queue is full)."""


@dataclass(frozen=True)
class EngineInfo:
    """What the engine's ring header says about the served model and the ring."""
    instance: int
    model_name: str
    vocab_size: int
    context_length: int
    eos_ids: tuple[int, ...]
    geometry: RingGeometry
    engine_kind: EngineKind


@dataclass
class Tokens:
    ids: list[int]


@dataclass
class Finished:
    reason: FinishReason
    detail: int
    prompt_len: int
    preemptions: int


@dataclass
class RequestHandle:
    slot: int
    gen: int
    request_id: int
    instance: int
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # Tokens | Finished | Exception
    seen: int = 0                 # tokens already read from the record
    cancelled: bool = False
    stop_matched: bool = False    # cancelled because a stop string matched: a finish, not a cancel
    done: bool = False            # the engine finished it (or it was failed locally)


def _open_ring(ring_name: str) -> tuple[ShmTransport, EngineInfo]:
    """Attaches to the segment and checks its header; raises EngineUnavailable."""
    try:
        segment = ShmSegment.attach(ring_name)
    except (FileNotFoundError, PermissionError) as e:
        raise EngineUnavailable(f"no engine ring at /dev/shm/{ring_name}: {e}") from None
    transport = ShmTransport(segment)
    try:
        if segment.size < HEADER_DTYPE.itemsize:
            raise EngineUnavailable("ring segment is truncated")
        h = np.frombuffer(transport.read(0, HEADER_DTYPE.itemsize), HEADER_DTYPE)[0]
        if int(h["magic"]) != RING_MAGIC or int(h["layout_version"]) != LAYOUT_VERSION:
            raise EngineUnavailable(f"ring at /dev/shm/{ring_name} has an unknown layout "
                                    f"(version {int(h['layout_version'])}, want {LAYOUT_VERSION})")
        geom = RingGeometry.from_header(h)
        if geom.total_bytes != int(h["total_bytes"]) or segment.size < geom.total_bytes:
            raise EngineUnavailable("ring header and segment size disagree")
        if int(h["engine_state"]) != EngineState.SERVING:
            raise EngineUnavailable("engine is not serving yet")
        info = EngineInfo(
            instance=int(h["engine_instance"]),
            model_name=bytes(h["model_name"]).rstrip(b"\0").decode(errors="replace"),
            vocab_size=int(h["vocab_size"]), context_length=int(h["context_length"]),
            eos_ids=tuple(int(x) for x in h["eos_ids"][: int(h["num_eos_ids"])]),
            geometry=geom, engine_kind=EngineKind(int(h["engine_kind"])))
        return transport, info
    except BaseException:
        transport.close()
        raise


# Ring header counters that only grow during one engine instance's life.
ENGINE_COUNTERS = ("requests_admitted", "requests_finished", "requests_cancelled",
                   "requests_rejected", "preemptions", "tokens_generated", "engine_steps",
                   "busy_ns", "step_tokens")


class EngineLink:
    def __init__(self, ring_name: str, *, queue_timeout_s: float = 30.0,
                 max_queued: int = 1024, engine_timeout_s: float = 3.0,
                 poll_interval_s: float = 0.0005, attach_interval_s: float = 0.2,
                 on_alive_change: Callable[[bool], None] | None = None,
                 worker: tuple[int, int] = (0, 1)):
        """worker: (index, count) of the front-end processes sharing this ring; this one uses
        its contiguous share of the slots, and request ids that order all of theirs in time."""
        self.ring_name = ring_name
        self.worker_index, self.workers = worker
        if not 0 <= self.worker_index < self.workers:
            raise ValueError(f"worker {worker}: the index must be in [0, count)")
        self.queue_timeout_s = queue_timeout_s
        self.max_queued = max_queued
        self.engine_timeout_s = engine_timeout_s
        self.poll_interval_s = poll_interval_s
        self.attach_interval_s = attach_interval_s
        self.on_alive_change = on_alive_change
        self.info: EngineInfo | None = None
        self.alive = False
        self.attachments = 0
        self._transport: ShmTransport | None = None
        self._free: deque[int] = deque()
        self._next_gen: list[int] = []
        self._waiters: deque[asyncio.Future] = deque()
        self._live: dict[int, RequestHandle] = {}   # slot -> handle
        self._last_request_id = 0
        self._last_beat = 0
        self._last_beat_change = 0.0
        self._task: asyncio.Task | None = None
        self._header_stats: np.void | None = None  # the attached instance's latest header
        # instance -> its heartbeat when declared dead: the same instance is attached again
        # only once that heartbeat moves (a stalled engine that recovers), never while it stays
        # put (a killed engine leaves its segment and a SERVING header behind)
        self._dead_beats: dict[int, int] = {}
        # engine counters (ring header) of the instances before the current one: totals that
        # survive engine restarts (counter_totals)
        self._carried = dict.fromkeys(ENGINE_COUNTERS, 0)
        self._stop_string_finishes = 0  # engine "cancels" that were stop-string finishes
        self._instance = None           # the engine instance attached last
        self._instance_was_alive = False  # ... and whether its heartbeat ever moved

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="engine-link")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._detach(EngineUnavailable("front end is shutting down"))

    @property
    def slots_in_use(self) -> int:
        return len(self._live)

    @property
    def waiting_for_slot(self) -> int:
        return sum(not w.done() for w in self._waiters)

    def header_snapshot(self) -> np.void | None:
        return self._header_stats

    def counter_totals(self) -> dict[str, int]:
        """The engine's counters (ENGINE_COUNTERS) summed over every engine instance this link
        has seen: they keep growing across engine restarts."""
        h = self._header_stats
        totals = {k: self._carried[k] + (int(h[k]) if h is not None else 0)
                  for k in ENGINE_COUNTERS}
        moved = min(self._stop_string_finishes, totals["requests_cancelled"])
        totals["requests_cancelled"] -= moved
        totals["requests_finished"] += moved
        return totals

    # -- requests -------------------------------------------------------------------------------

    def _next_request_id(self) -> int:
        """Increasing, unique across the workers, and in arrival order between them (the
        engine admits by request id): monotonic nanoseconds x workers + this worker's index."""
        n = self.workers
        self._last_request_id = max(self._last_request_id + n,
                                    time.monotonic_ns() * n + self.worker_index)
        return self._last_request_id

    def slot_share(self, num_slots: int) -> range:
        lo = num_slots * self.worker_index // self.workers
        return range(lo, num_slots * (self.worker_index + 1) // self.workers)

    async def submit(self, req_fields: dict) -> RequestHandle:
        """Writes a request into a free slot, waiting (bounded) for one. `req_fields` are
        SlotRequest's fields but request_id, which the link assigns."""
        if not self.alive:
            raise EngineUnavailable("engine is not available")
        instance = self.info.instance
        slot = await self._acquire_slot()
        if not self.alive or self.info is None or self.info.instance != instance:
            raise EngineUnavailable("engine restarted while the request waited for a slot")
        request_id = self._next_request_id()
        gen = self._next_gen[slot]
        self._next_gen[slot] = gen % 0xFFFF_FFFF + 1
        req = SlotRequest(request_id=request_id, **req_fields)
        geom = self.info.geometry
        base = geom.slot_offset(slot)
        body, _ = encode_slot(geom, gen, req)
        self._transport.write(base + 4, body)
        self._transport.write(base + geom.seq_end_offset, np.uint32(gen).tobytes())
        # the doorbell, after the payload has landed: the engine may consume from here on
        self._transport.write(base, np.uint32(gen).tobytes())
        handle = RequestHandle(slot, gen, request_id, instance)
        self._live[slot] = handle
        return handle

    def cancel(self, handle: RequestHandle, *, stop_matched: bool = False) -> None:
        """Asks the engine to stop; the slot is freed once the engine confirms. stop_matched:
        the front end ended the request on a stop string; the engine counts that as a cancel
        and counter_totals moves it to the finished requests."""
        if handle.done or handle.cancelled:
            return
        handle.cancelled, handle.stop_matched = True, stop_matched
        if self.alive and self.info.instance == handle.instance:
            off = self.info.geometry.slot_offset(handle.slot) + 4
            self._transport.write(off, np.uint32(handle.gen).tobytes())

    async def _acquire_slot(self) -> int:
        if self._free and not self._waiters:
            return self._free.popleft()
        if len(self._waiters) >= self.max_queued:
            raise SlotsExhausted(f"all {len(self._live)} request slots are busy and "
                                 f"{len(self._waiters)} requests already wait")
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            return await asyncio.wait_for(fut, self.queue_timeout_s)
        except BaseException as e:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._release_slot(fut.result())  # handed a slot just as the caller gave up
            if isinstance(e, asyncio.TimeoutError):
                raise SlotsExhausted(f"no request slot became free within "
                                     f"{self.queue_timeout_s:g} s") from None
            raise
        finally:
            if fut in self._waiters:
                self._waiters.remove(fut)

    def _release_slot(self, slot: int) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(slot)
                return
        self._free.append(slot)

    # -- the poll loop --------------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            if self._transport is None:
                self._try_attach()
                await asyncio.sleep(self.poll_interval_s if self._transport
                                    else self.attach_interval_s)
                continue
            try:
                self._poll_once()
            except Exception as e:  # a broken mapping must not kill the loop
                log.exception("ring poll failed")
                self._detach(EngineUnavailable(f"ring poll failed: {e}"))
            await asyncio.sleep(self.poll_interval_s)

    def _try_attach(self) -> None:
        try:
            transport, info = _open_ring(self.ring_name)
        except EngineUnavailable as e:
            log.debug("attach: %s", e)
            return
        beat = int(np.frombuffer(transport.read(0, HEADER_DTYPE.itemsize),
                                 HEADER_DTYPE)[0]["heartbeat"])
        if self._dead_beats.get(info.instance, beat + 1) == beat:
            transport.close()  # declared dead and still silent: wait for it or a new engine
            return
        self._dead_beats.pop(info.instance, None)
        if info.instance != self._instance:
            self._instance, self._instance_was_alive = info.instance, False
            if self._header_stats is not None:  # a new engine: fold in the old one's totals
                for k in ENGINE_COUNTERS:
                    self._carried[k] += int(self._header_stats[k])
                self._header_stats = None
        geom = info.geometry
        self._transport, self.info = transport, info
        begins = np.frombuffer(transport.read_strided(geom.slots_offset, geom.slot_bytes,
                                                      geom.num_slots, 4), "<u4")
        # continue each slot's generation so it never repeats one the engine consumed
        self._next_gen = [int(b) % 0xFFFF_FFFF + 1 for b in begins]
        share = self.slot_share(geom.num_slots)
        if not share:
            transport.close()
            self._transport, self.info = None, None
            log.error("the ring has %d slots: too few for %d front-end workers",
                      geom.num_slots, self.workers)
            return
        self._free = deque(share)
        # alive only once the heartbeat moves: a killed engine leaves a SERVING header behind
        self._last_beat = beat
        if not self.alive:
            self._last_beat_change = time.monotonic()
        log.info("attached to engine ring /dev/shm/%s (instance %x): model %s, %d slots",
                 self.ring_name, info.instance, info.model_name, geom.num_slots)

    def heartbeat_age(self) -> float | None:
        """Seconds since the heartbeat of the engine instance attached last moved (it keeps
        counting after the link gave that engine up); None until that instance was alive (an
        engine still starting up)."""
        return time.monotonic() - self._last_beat_change if self._instance_was_alive else None

    def _set_alive(self, alive: bool) -> None:
        if alive != self.alive:
            self.alive = alive
            if alive:
                self.attachments += 1
                self._instance_was_alive = True
            log.info("engine %s", "alive" if alive else "unavailable")
            if self.on_alive_change:
                self.on_alive_change(alive)

    def _detach(self, why: Exception) -> None:
        self._set_alive(False)
        for handle in self._live.values():
            if not handle.done:
                handle.done = True
                handle.events.put_nowait(why)
        self._live.clear()
        for fut in self._waiters:
            if not fut.done():
                fut.set_exception(EngineUnavailable(str(why)))
        self._waiters.clear()
        self._free.clear()
        if self._transport is not None:
            self._transport.close()
        self._transport, self.info = None, None

    def _poll_once(self) -> None:
        t, geom = self._transport, self.info.geometry
        h = np.frombuffer(t.read(0, HEADER_DTYPE.itemsize), HEADER_DTYPE)[0]
        now = time.monotonic()
        if int(h["engine_instance"]) != self.info.instance or not t.is_current():
            return self._detach(EngineUnavailable("the engine was restarted"))
        self._header_stats = h
        if int(h["engine_state"]) == EngineState.STOPPED:
            return self._detach(EngineUnavailable("the engine stopped"))
        beat = int(h["heartbeat"])
        if beat != self._last_beat:
            self._last_beat, self._last_beat_change = beat, now
            self._set_alive(True)
        elif now - self._last_beat_change > self.engine_timeout_s:
            self._dead_beats[self.info.instance] = beat
            return self._detach(EngineUnavailable(
                f"the engine stopped answering (no heartbeat for {self.engine_timeout_s:g} s)"))
        if not self._live:
            return
        # the fixed part of every output record in one strided read
        recs = np.frombuffer(t.read_strided(geom.records_offset, geom.record_bytes,
                                            geom.num_slots, RECORD_DTYPE.itemsize), RECORD_DTYPE)
        for slot, handle in list(self._live.items()):
            rec = recs[slot]
            if int(rec["gen"]) != handle.gen:
                continue  # the engine has not admitted it yet
            finish = int(rec["finish_reason"])   # read before the count: see layout.py
            count = int(rec["num_tokens"])
            if count > handle.seen:
                off = geom.record_offset(slot) + RECORD_DTYPE.itemsize + 4 * handle.seen
                ids = np.frombuffer(t.read(off, 4 * (count - handle.seen)), "<i4").tolist()
                handle.seen = count
                if not handle.cancelled:
                    handle.events.put_nowait(Tokens(ids))
            if finish != FinishReason.NONE:
                if finish == FinishReason.CANCELLED and handle.stop_matched:
                    self._stop_string_finishes += 1
                handle.done = True
                handle.events.put_nowait(Finished(FinishReason(finish), int(rec["detail"]),
                                                  int(rec["prompt_len"]),
                                                  int(rec["preemptions"])))
                del self._live[slot]
                self._release_slot(slot)
