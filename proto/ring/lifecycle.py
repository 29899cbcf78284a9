"""The ring's two sides as processes: the signals that stop them, and one of each per ring.

STOP_SIGNALS: every Blink process (engine, front end, serve) stops cleanly on each of them, the
engine removing its ring and the front end draining: SIGTERM (systemd, Kubernetes), SIGINT
(Ctrl-C), SIGHUP (its terminal closed) and SIGQUIT (Ctrl-\\). A second one, to the process
an operator started (Ctrl-C twice), ends a front end's drain at once; the front-end workers that
process started are told so with HURRY_SIGNAL, since a terminal's Ctrl-C and their parent's
passing on of the first signal already reach them twice (watch_stop_signals).

One engine and one front end per ring, held by the process that runs it.

A ring's engine and its front end (with its workers) each claim the ring by binding an abstract
Unix socket named after the ring and the role. A second process's claim fails at once, whatever
the first one is doing (a busy engine whose heartbeat is slow, a front end still waiting for its
engine), and the kernel releases a claim when its process exits however it ends: no file is left
behind in /dev/shm and none needs cleaning up after a SIGKILL. Abstract sockets are per network
namespace, as containers sharing one /dev/shm share one.

An engine run by systemd as a Type=notify unit tells it when it serves and when it stops, and,
with WatchdogSec=, that it is alive while its heartbeat moves (SystemdNotify): a scheduler that
hangs stops the heartbeat, and systemd restarts the engine, as `blink serve` restarts its own
(--engine-restart-timeout).
"""
from __future__ import annotations

import errno
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable

log = logging.getLogger("blink.engine")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
HURRY_SIGNAL = signal.SIGUSR1


def watch_stop_signals(loop, stop, hurry, *, repeats_hurry: bool = True) -> None:
    """On `loop`: the first of STOP_SIGNALS sets the event `stop`; HURRY_SIGNAL, or with
    repeats_hurry a later stop signal, sets `hurry` (counted in the handler, so that a second
    signal that comes before the stopping code has run is not lost). repeats_hurry=False: a
    process whose stop signals may come twice for one stop (a front-end worker: the terminal's
    and its parent's), hurried by its parent alone."""
    def stop_signal() -> None:
        (hurry if stop.is_set() and repeats_hurry else stop).set()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop_signal)
    loop.add_signal_handler(HURRY_SIGNAL, hurry.set)


class EngineStopSignals:
    """STOP_SIGNALS for an engine process, from its first step (create it in the main thread,
    before anything else) to its end.

    Before `serving`: a stop signal removes the ring files this process has created
    (blink.ring.shm.unlink_created_segments) and ends the process at once with status 0, as a
    stop in service does. The default action did the same minus the removal, so a stop between
    the ring's creation and its service (systemd stopping a unit still starting, a second Ctrl-C)
    left the ring in /dev/shm. No exception is raised into the start-up code: it holds nothing
    but memory, which goes with the process, and it may be inside any C call.

    From `serving(stop_event)`: a stop signal sets stop_event, from a thread of its own. A Python
    signal handler runs in the main thread between any two bytecodes, so one that sets the event
    can run while the main thread holds the event's lock (inside its wait or set, or inside the
    handler itself when signals come close together) and wait for that lock forever. Seen: `blink
    serve` killed with SIGKILL, its engine got SIGTERM once for each of serve's threads it was
    handed to as they died (the parent-death signal) and hung in nested handlers. Here the C-level
    handler writes the signal's number to a pipe (set_wakeup_fd) and the thread reads it."""

    def __init__(self):
        self._stop_event: threading.Event | None = None
        self._lock = threading.Lock()
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)  # a full pipe drops a signal's byte, not the handler
        signal.set_wakeup_fd(write_fd)
        for sig in STOP_SIGNALS:
            # replaces the default action; the pipe does the rest
            signal.signal(sig, lambda *_: None)
        threading.Thread(target=self._watch, args=(read_fd,), name="stop-on-signal",
                         daemon=True).start()

    def serving(self, stop_event: threading.Event) -> None:
        """From now on a stop signal sets stop_event (the engine, built, removes its own
        ring as it stops)."""
        with self._lock:
            self._stop_event = stop_event

    def _watch(self, read_fd: int) -> None:
        signum = os.read(read_fd, 1)[0]
        with self._lock:
            if self._stop_event is not None:
                self._stop_event.set()
                return
            from blink.ring.shm import unlink_created_segments
            unlink_created_segments(for_good=True)  # (a ring created after it would stay)
            log.info("engine stopped by %s while starting", signal.Signals(signum).name)
            logging.shutdown()  # (flushes the handlers; os._exit skips the interpreter's exit)
            os._exit(0)


class RingClaimed(RuntimeError):
    """Another live process holds the ring in this role."""


CLAIM_ROLES = ("engine", "frontend")


def _claim_address(ring_name: str, role: str) -> str:
    return f"\0blink-{role}:{ring_name}"


# A Unix socket's address holds 108 bytes, an abstract name's leading NUL among them.
RING_NAME_MAX_BYTES = 108 - max(len(_claim_address("", role).encode()) for role in CLAIM_ROLES)


def check_ring_name(name: str) -> str:
    """name if it can name a ring, else ValueError saying why in one line: it is a file name in
    /dev/shm (the ring and its front end's counters beside it) and part of the claim's socket
    address (claim_ring)."""
    if not name or "/" in name or name.startswith(".") or "\0" in name:
        raise ValueError(f"{name!r} is not a ring name: a file name in /dev/shm, without '/', "
                         f"not starting with '.'")
    if len(name.encode()) > RING_NAME_MAX_BYTES:
        raise ValueError(f"the ring name {name[:20]!r}... is {len(name.encode())} bytes long; "
                         f"a ring name has at most {RING_NAME_MAX_BYTES}")
    return name


def claim_ring(ring_name: str, role: str) -> socket.socket:
    """Claims ring_name for role (one of CLAIM_ROLES); keep the socket open for as long as the
    claim must hold (closing it releases it). RingClaimed when another process holds it."""
    check_ring_name(ring_name)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(_claim_address(ring_name, role))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise RingClaimed(f"another {role} is running on the ring /dev/shm/{ring_name}; "
                              f"stop it or pick another --ring-name") from None
        raise
    return sock


class SystemdNotify:
    """systemd's notify protocol (sd_notify(3)): READY=1 once the engine serves, STOPPING=1 as it
    stops, and, under WatchdogSec=, WATCHDOG=1 only while its heartbeat moves. Nothing to do
    outside such a unit (no NOTIFY_SOCKET)."""

    def __init__(self, environ=os.environ):
        self._path = path = environ.get("NOTIFY_SOCKET", "")
        # "@name": an abstract socket
        self._address = "\0" + path[1:] if path.startswith("@") else path or None
        usec, pid = environ.get("WATCHDOG_USEC"), environ.get("WATCHDOG_PID")
        mine = not pid or pid == str(os.getpid())  # (a child inherits the parent's variables)
        self.watchdog_s = int(usec) / 1e6 if self._address and usec and mine else None
        self._beat: int | None = None
        self._pinged = -float("inf")

    def ready(self) -> None:
        self._send("READY=1")

    def stopping(self) -> None:
        self._send("STOPPING=1")

    def keepalive(self, heartbeat: Callable[[], int]) -> None:
        """Call often from the engine's steady loop: pings the watchdog, four times a period at
        most, when heartbeat() has moved since the last ping (read only when one is due)."""
        if self.watchdog_s is None:
            return
        now = time.monotonic()
        if now - self._pinged < self.watchdog_s / 4:
            return
        beat = heartbeat()
        if beat != self._beat:
            self._beat, self._pinged = beat, now
            self._send("WATCHDOG=1")

    def _send(self, state: str) -> None:
        if self._address is None:
            return
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.sendto(state.encode(), self._address)
        except OSError as e:  # systemd went away: the engine serves on
            log.warning("systemd notification %s not sent to %s: %s", state, self._path, e)
