"""Wakes the front end's ring poll as soon as the engine writes a live request's record.

Why a thread: the poll loop runs on asyncio, whose timers go through epoll, which counts in whole
milliseconds; a loop that slept 0.5 ms between polls slept about 1.1 ms, so a token (a request's
first one among them) waited 0.55 ms for the front end on average, and up to 1.1 ms. This thread
sleeps with the kernel's high-resolution timer instead, looks at the live records through numpy
views of the shared-memory ring (no copy, five vectorised compares, about 4 us for 128 slots),
and wakes the loop only when one moved: a new token, a finish. The loop then does
its ordinary, ordered poll (EngineLink._poll_records); the thread's look only decides when, so a
torn or stale read here costs at most a poll too many or one tick of delay, never a wrong token.

Shared memory only: an RDMA transport's reads go through the link's own queue pair, which is not
the thread's to use, so over RDMA the loop keeps polling on its own timer.
"""
from __future__ import annotations

import asyncio
import ctypes
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

log = logging.getLogger("blink.frontend")

_PR_SET_TIMERSLACK = 29  # prctl(2)


def tighten_timer_slack() -> None:
    """Has the calling thread's sleeps end when asked: Linux lets a sleep end up to the thread's
    timer slack late, 50 us unless set, so a 200 us tick came every 255 us or more (330 us on a
    2-core VM, 275 with 1 us of slack), and a token waits half a tick on average for the tick
    that sees it. Elsewhere than Linux, nothing."""
    try:
        ctypes.CDLL(None).prctl(_PR_SET_TIMERSLACK, 1000, 0, 0, 0)  # 1 us, in ns
    except (OSError, AttributeError):  # no prctl: not Linux
        pass


@dataclass
class WatchedRecords:
    """The link's share of the output records, as views, and its per-slot state (the arrays the
    loop updates in place: EngineLink._want_gen, _seen, _due; _live, its handles by slot)."""
    gen: np.ndarray            # [n] u4 views of the records' fields in the ring
    finish_reason: np.ndarray
    num_tokens: np.ndarray
    want_gen: np.ndarray       # [n] the live handle's gen, -1 where none
    seen: np.ndarray           # [n] tokens already read
    due: np.ndarray            # [n] monotonic s before which new tokens wait (stream interval)
    live: dict                 # slot -> handle: empty when nothing is live

    def moved(self) -> bool:
        """Whether a live record has something the loop has not read and may hand on now (the
        usual answer, no, in five vectorised operations)."""
        news = self.gen == self.want_gen
        finished = self.finish_reason != 0
        news &= (self.num_tokens > self.seen) | finished
        if not news.any():
            return False
        # tokens that a stream interval holds back wake the loop only once due
        return bool((news & ((self.due <= time.monotonic()) | finished)).any())


class RecordWatch:
    """A daemon thread that calls `wake` on the loop within about `interval_s` of a live record
    moving. The link `watch`es its records when it attaches, `arm`s the thread when a request
    goes live (the thread disarms itself when none is left), calls `polled` after each poll, and
    `unwatch`es before it closes the ring (the views must be gone first)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, wake: Callable[[], None],
                 interval_s: float):
        self._loop, self._wake, self.interval_s = loop, wake, interval_s
        self._lock = threading.Lock()          # guards _records against unwatch while checked
        self._armed = threading.Event()
        self._records: WatchedRecords | None = None
        self._pending = False  # woke the loop, which has not polled since: no second wake
        self._stopped = False
        self.wakes = 0         # loop wake-ups this thread caused (tests, diagnostics)
        self._thread = threading.Thread(target=self._run, name="ring-record-watch", daemon=True)
        self._thread.start()

    def watch(self, records: WatchedRecords) -> None:
        with self._lock:
            self._records = records

    def unwatch(self) -> None:
        with self._lock:
            self._records = None

    def arm(self) -> None:
        """A request went live. Under the lock, so that the thread's 'none live, disarm' cannot
        fall between the caller's marking it live and this (nor stop's wake and the check)."""
        with self._lock:
            self._armed.set()

    def polled(self) -> None:
        self._pending = False

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        with self._lock:  # not between the thread's check of _stopped and its disarming
            self._stopped = True
            self._armed.set()
        self._thread.join(timeout=1.0)

    def _run(self) -> None:
        tighten_timer_slack()
        while True:
            self._armed.wait()
            time.sleep(self.interval_s)
            with self._lock:
                if self._stopped:
                    return
                if self._records is None or not self._records.live:
                    self._armed.clear()  # nothing live: sleep until a request arrives
                    continue
                if self._pending:  # the loop has not polled since the last wake
                    continue
                try:
                    moved = self._records.moved()
                except Exception:  # never expected; a watch that stopped would stall streams
                    log.exception("ring record watch failed: waking the poll loop every tick")
                    moved = True
            if moved:
                self._pending = True
                self.wakes += 1
                try:
                    self._loop.call_soon_threadsafe(self._wake)
                except RuntimeError:  # the loop closed under us: the link is gone
                    return
