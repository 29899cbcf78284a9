"""Operating a server (issue 9): liveness that never strands a live engine, failing fast and
loudly, a taken port, and the drain on SIGTERM. Real processes, real ports, real rings."""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import numpy as np
import pytest
from conftest import children
from gpu import requires_gpu

from blink.client.bench_server import process_tree_cpu
from blink.client.sdk import BlinkClient, BlinkError, Sampling


def exact(n: int) -> Sampling:
    """n tokens exactly: greedy, EOS ignored (a sampled EOS would end a stream early)."""
    return Sampling(max_tokens=n, temperature=0.0, ignore_eos=True)


def blink(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "blink.client.cli", *args],
                          capture_output=True, text=True, timeout=timeout)


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


class Serve:
    """`blink serve` as an operator starts it, on port 0."""

    def __init__(self, model, tmp_path, *args, session: bool = False):
        """session: in a process group of its own, as a terminal's foreground job is (a
        terminal's Ctrl-C goes to the whole group: os.killpg)."""
        self.ready, self.log_path = tmp_path / "port", tmp_path / "serve.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "blink.client.cli", "serve", "--model", str(model),
             "--port", "0", "--ready-file", str(self.ready), "--engine", "cpu", *args],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=session)
        wait_for(lambda: self.proc.poll() is not None or (self.ready.exists()
                                                          and self.ready.read_text()),
                 60, "the port")
        assert self.proc.poll() is None, self.log_path.read_text()
        self.target = f"127.0.0.1:{self.ready.read_text()}"
        with BlinkClient(self.target) as client:
            client.wait_ready(60)

    def engine_pid(self) -> int:
        def engines() -> list[int]:  # (the other children, with --workers, are front ends)
            return [pid for pid in children(self.proc.pid) if b"engine" in _cmdline(pid)]
        (pid,) = wait_for(engines, 10, "the engine process")
        return pid

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.log.close()
        return self.proc.returncode


def test_stalled_engine_that_recovers_is_attached_again(checkpoints, make_stack):
    """An engine silent for longer than --engine-timeout (a GC pause, a busy host, a long
    step) is given up, and taken back as soon as its heartbeat moves again; it used to stay
    NOT_SERVING for good."""
    stack = make_stack(checkpoints["llama"], frontend_args=["--engine-timeout", "1"])
    stack.wait_serving()
    with BlinkClient(stack.target) as client:
        os.kill(stack.engine.pid, signal.SIGSTOP)
        try:
            wait_for(lambda: client.health() == "NOT_SERVING", 10, "NOT_SERVING")
            with pytest.raises(BlinkError, match="UNAVAILABLE"):
                client.generate("while stalled", Sampling(max_tokens=2))
        finally:
            os.kill(stack.engine.pid, signal.SIGCONT)
        wait_for(lambda: client.health() == "SERVING", 10, "SERVING again")
        assert client.generate("after the stall", exact(4)).completion_tokens == 4
        assert client.stats()["engine_attachments"] == 2


def idle(client) -> bool:
    s = client.stats()
    return (s["sequences_running"] == 0 and s["sequences_waiting"] == 0
            and s["kv_blocks_free"] == s["kv_blocks_total"])


def streams_until_error(target: str, n: int) -> list[threading.Thread]:
    """n threads, each streaming a request that would run for minutes, until it errors."""
    def stream():
        with BlinkClient(target) as client:
            try:
                for _ in client.stream(list(range(1, 9)), exact(16000)):
                    pass
            except BlinkError:
                pass
    threads = [threading.Thread(target=stream, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


def test_a_killed_front_end_s_requests_are_cancelled_by_the_next(long_checkpoint, make_stack):
    """A front end killed with live streams (OOM, kill -9) leaves their sequences in the engine;
    the front end started after it cancels them as it attaches, so their KV blocks and the
    engine's sequences come back (they used to run for no one until max_tokens)."""
    stack = make_stack(long_checkpoint, engine_args=["--engine", "cpu"])
    with BlinkClient(stack.target) as client:
        threads = streams_until_error(stack.target, 3)
        wait_for(lambda: client.stats()["sequences_running"] == 3, 10, "3 running")
    stack.frontend.send_signal(signal.SIGKILL)
    stack.frontend.wait()
    stack.start_frontend()
    stack.wait_serving()
    with BlinkClient(stack.target) as client:
        wait_for(lambda: idle(client), 10, "the engine idle")
        assert client.stats()["requests_cancelled"] == 3
        assert client.generate(list(range(1, 9)), exact(4)).completion_tokens == 4
    for t in threads:
        t.join(5)


def test_requests_given_up_on_a_stalled_engine_are_cancelled(long_checkpoint, make_stack):
    """Streams that failed UNAVAILABLE because the engine stalled past --engine-timeout are
    cancelled in the engine: once it recovers it does not go on generating for no one."""
    stack = make_stack(long_checkpoint, engine_args=["--engine", "cpu"],
                       frontend_args=["--engine-timeout", "1"])
    with BlinkClient(stack.target) as client:
        threads = streams_until_error(stack.target, 2)
        wait_for(lambda: client.stats()["sequences_running"] == 2, 10, "2 running")
        os.kill(stack.engine.pid, signal.SIGSTOP)
        try:
            for t in threads:
                t.join(10)
            assert not any(t.is_alive() for t in threads)  # the streams ended (UNAVAILABLE)
        finally:
            os.kill(stack.engine.pid, signal.SIGCONT)
        wait_for(lambda: client.health() == "SERVING", 10, "SERVING again")
        wait_for(lambda: idle(client), 10, "the engine idle")
        assert client.stats()["requests_cancelled"] == 2


def test_unset_max_tokens_fits_a_kv_cache_smaller_than_the_context(checkpoints, make_stack):
    """With max_tokens unset a request may generate the rest of the context, or of the whole
    KV cache where that holds fewer tokens (here 128 of a 512-token context); it used to be
    rejected, the context's rest being more than the cache holds. A prompt the cache cannot
    hold with a token to spare is INVALID_ARGUMENT, saying so."""
    stack = make_stack(checkpoints["llama"], engine_args=[
        "--engine", "cpu", "--num-kv-blocks", "8", "--block-size", "16"])
    greedy = Sampling(temperature=0.0, ignore_eos=True)
    with BlinkClient(stack.target) as client:
        out = client.generate(list(range(1, 21)), greedy)
        assert (out.completion_tokens, out.finish_reason) == (108, "length")
        with pytest.raises(BlinkError) as err:
            client.generate(list(range(1, 129)), greedy)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "the KV cache holds 128" in str(err.value)
        # with max_tokens set: refused by the front end, as the context's limit is (the engine
        # refused it, a slot's round trip later, counted as a bad slot)
        with pytest.raises(BlinkError) as err:
            client.generate(list(range(1, 11)), Sampling(max_tokens=500))
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "exceeds the KV cache's 128 tokens" in str(err.value)
        assert client.stats()["requests_rejected"] == 0
        wait_for(lambda: idle(client), 5, "the engine idle")


def test_long_prefill_keeps_the_heartbeat(long_checkpoint, make_stack):
    """One 6,000-token chunk over a 6,000-token context: a layer's attention took longer than
    a one-second liveness timeout when the heartbeat moved only between layers."""
    stack = make_stack(long_checkpoint,
                       engine_args=["--max-batched-tokens", "8192", "--kv-cache-mb", "64"],
                       frontend_args=["--engine-timeout", "1"])
    stack.wait_serving()
    with BlinkClient(stack.target) as client:
        done = client.generate([100 + i % 1900 for i in range(6000)],
                               Sampling(max_tokens=2, temperature=0.0),
                               timeout=300)
        assert done.completion_tokens == 2
        assert client.stats()["engine_attachments"] == 1  # never given up


def test_a_restarted_engine_still_loading_is_not_taken_for_stuck(checkpoints, tmp_path):
    """serve's engine killed, and its successor slow to start (held stopped for 4 s before its
    first heartbeat, as a large model's load would): with --engine-restart-timeout 2 the
    successor is not killed as stuck while it loads (the dead engine's heartbeat age, which the
    front end's link still reported, used to count against it), and it serves."""
    serve = Serve(checkpoints["llama"], tmp_path, "--engine-restart-timeout", "2")
    try:
        first = serve.engine_pid()
        os.kill(first, signal.SIGKILL)
        (second,) = wait_for(lambda: [p for p in children(serve.proc.pid) if p != first], 10,
                             "the next engine")
        os.kill(second, signal.SIGSTOP)
        time.sleep(4)
        os.kill(second, signal.SIGCONT)
        with BlinkClient(serve.target) as client:
            wait_for(lambda: client.stats()["engine_attachments"] == 2
                     and client.health() == "SERVING", 30, "the next engine serving")
            assert client.generate("restarted", exact(3)).completion_tokens == 3
        assert serve.engine_pid() == second
        assert "engine stuck" not in serve.log_path.read_text()
    finally:
        assert serve.stop() == 0


def test_serve_restarts_a_stuck_engine(checkpoints, tmp_path):
    serve = Serve(checkpoints["llama"], tmp_path, "--engine-timeout", "1",
                  "--engine-restart-timeout", "3")
    try:
        stuck = serve.engine_pid()
        os.kill(stuck, signal.SIGSTOP)
        with BlinkClient(serve.target) as client:
            wait_for(lambda: client.stats()["engine_attachments"] == 2
                     and client.health() == "SERVING", 30, "a new engine")
            assert serve.engine_pid() != stuck
            assert client.generate("restarted", exact(3)).completion_tokens == 3
        assert "engine stuck" in serve.log_path.read_text()
    finally:
        assert serve.stop() == 0


def test_serve_stopped_while_it_waits_to_restart_a_killed_engine(checkpoints, tmp_path):
    """serve stopped in the wait before it restarts a killed engine: it stops at once and the
    killed engine's ring is gone from /dev/shm (the wait watched no stop, and the return after
    it left the ring behind)."""
    from blink.ring.shm import shm_path
    ring = f"blink-test-backoff-{os.getpid()}"
    serve = Serve(checkpoints["llama"], tmp_path, "--engine", "synthetic", "--ring-name", ring)
    try:
        os.kill(serve.engine_pid(), signal.SIGKILL)
        wait_for(lambda: "restarting" in serve.log_path.read_text(), 10, "the restart's wait")
        serve.proc.send_signal(signal.SIGTERM)
        serve.proc.wait(5)
        assert serve.proc.returncode == 0
        assert not shm_path(ring).exists(), serve.log_path.read_text()
    finally:
        assert serve.stop() == 0
        shm_path(ring).unlink(missing_ok=True)


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except FileNotFoundError:
        return b""


def _gone(pid: int) -> bool:
    """pid has exited (a zombie no parent reaped counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


# A signal that arrives while the main thread holds the stop event's lock (inside its wait or
# set, as the CUDA engine's main loop and a nested handler do): the event is still set, once
# the lock is free. A handler that set it from the main thread would wait for that lock forever.
_SIGNAL_WHILE_LOCKED = """
import os, signal, sys, threading, time
from blink.ring.lifecycle import EngineStopSignals
stop = threading.Event()
EngineStopSignals().serving(stop)
with stop._cond:
    for _ in range(3):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)  # Python runs its signal handlers here
sys.exit(0 if stop.wait(10) else 3)
"""


def test_a_signal_while_the_stop_events_lock_is_held_still_stops():
    proc = subprocess.run([sys.executable, "-c", _SIGNAL_WHILE_LOCKED], timeout=30,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


# An engine whose start-up goes on after its ring is created (as the CUDA engine's does: the
# scheduler's module, its device state, its graph), or fails there.
_ENGINE_STARTING = """
import logging, sys, time
from pathlib import Path
from blink.gpu_engine.reference_engine import EngineConfig, ReferenceEngine, run_engine

class StillStarting(ReferenceEngine):
    def __init__(self, config):
        super().__init__(config)
        Path(sys.argv[3]).write_text("ring created")
        if sys.argv[4] == "fail":
            raise ValueError("scheduler configuration refused")
        time.sleep(60)

logging.basicConfig(level="INFO")
run_engine(EngineConfig(Path(sys.argv[1]), sys.argv[2]), StillStarting)
"""


@pytest.mark.parametrize("stop", ["SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "fail"])
def test_an_engine_stopped_or_failing_after_its_ring_is_made_removes_it(checkpoints, tmp_path,
                                                                         stop):
    """A stop signal while the engine is still starting, after it created its ring, ends it at
    once with the ring removed; so does an error there. The default action of the signals (and
    the error's traceback) left the ring in /dev/shm."""
    import secrets

    from blink.ring.shm import SHM_DIR, shm_path
    ring = f"blink-test-{secrets.token_hex(6)}"
    marker = tmp_path / "created"
    proc = subprocess.Popen([sys.executable, "-c", _ENGINE_STARTING, str(checkpoints["llama"]),
                             ring, str(marker), stop], stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: marker.exists() or proc.poll() is not None, 60, "the ring")
        assert shm_path(ring).exists() or stop == "fail"
        if stop != "fail":
            proc.send_signal(getattr(signal, stop))
        _, err = proc.communicate(timeout=10)
        left = sorted(p.name for p in SHM_DIR.iterdir() if ring in p.name)
    finally:
        if proc.poll() is None:
            proc.kill()
        for path in SHM_DIR.iterdir():
            if ring in path.name:  # (the failure's leftovers)
                path.unlink()
    assert left == [], (left, err)
    if stop == "fail":
        assert proc.returncode == 1 and "scheduler configuration refused" in err, err
    else:
        assert proc.returncode == 0 and f"stopped by {stop} while starting" in err, err


def test_a_ring_being_created_as_the_stop_comes_is_removed(monkeypatch):
    """The stop's removal (another thread) while the main thread is between recording a ring's
    temporary name and creating its file: it waits for the file and removes it. It found
    nothing to remove, and the file was made after it."""
    import secrets
    from pathlib import Path

    from blink.ring import shm
    name = f"blink-test-{secrets.token_hex(6)}"
    opening, real_open = threading.Event(), os.open

    def slow_open(path, *args):
        if Path(path).name.startswith(f".{name}."):
            opening.set()
            time.sleep(0.3)  # the stop comes now
        return real_open(path, *args)
    monkeypatch.setattr(shm.os, "open", slow_open)
    stop = threading.Thread(target=lambda: (opening.wait(5), shm.unlink_created_segments()))
    stop.start()
    segment = shm.ShmSegment.create(name, 4096)
    stop.join(5)
    try:
        assert [p.name for p in shm.SHM_DIR.iterdir() if name in p.name] == []
    finally:
        segment.unlink()
        segment.close()


def test_a_ring_file_is_its_owners_and_a_failed_one_leaves_nothing():
    """The ring's file is owner-only (0600, as under its temporary name: another user's process
    must not write requests into it or read other clients' tokens); a creation that fails once
    its file exists (an empty ring, which mmap refuses) removes that file and closes it; an
    empty file is no ring to attach (FileNotFoundError: what a front end waits on, not mmap's
    ValueError), and its descriptor is closed."""
    import secrets
    import stat

    from blink.ring import shm
    name = f"blink-test-{secrets.token_hex(6)}"
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(ValueError):
        shm.ShmSegment.create(name, 0)
    assert [p.name for p in shm.SHM_DIR.iterdir() if name in p.name] == []
    assert len(os.listdir("/proc/self/fd")) == fds
    segment = shm.ShmSegment.create(name, 4096)
    try:
        assert stat.S_IMODE(os.stat(segment._tmp_path).st_mode) == 0o600
        segment.publish()
        assert stat.S_IMODE(os.stat(shm.shm_path(name)).st_mode) == 0o600
    finally:
        segment.unlink()
        segment.close()
    try:
        shm.shm_path(name).touch(0o600)
        with pytest.raises(FileNotFoundError, match="is empty"):
            shm.ShmSegment.attach(name)
        assert len(os.listdir("/proc/self/fd")) == fds
    finally:
        shm.shm_path(name).unlink()


def test_a_replaced_ring_s_removal_leaves_the_new_engine_s_ring():
    """An engine that removes its ring after another engine has replaced it (a new inode under
    the same name) leaves the new one's file, which front ends attach to."""
    import secrets

    from blink.ring import shm
    name = f"blink-test-{secrets.token_hex(6)}"
    old = shm.ShmSegment.create(name, 4096)
    old.publish()
    new = shm.ShmSegment.create(name, 4096)
    try:
        new.publish()
        assert not old.is_current() and new.is_current()
        old.unlink()
        assert shm.shm_path(name).exists() and new.is_current()
    finally:
        for segment in (old, new):
            segment.unlink()
            segment.close()
    assert not shm.shm_path(name).exists()


def test_no_ring_is_created_after_the_stop_s_removal(monkeypatch):
    """unlink_created_segments(for_good=True), the stop of an engine still starting, keeps
    creations out until the process ends: a ring created after it would stay in /dev/shm."""
    import secrets

    from blink.ring import shm
    lock = threading.Lock()
    monkeypatch.setattr(shm, "_CREATION_LOCK", lock)  # (this test's, released at its end)
    monkeypatch.setattr(shm, "_CREATED", set())  # (no other test's ring removed)
    name = f"blink-test-{secrets.token_hex(6)}"
    shm.unlink_created_segments(for_good=True)
    made = []
    creator = threading.Thread(target=lambda: made.append(shm.ShmSegment.create(name, 4096)),
                               daemon=True)
    creator.start()
    creator.join(0.3)
    try:
        assert creator.is_alive()
        assert [p.name for p in shm.SHM_DIR.iterdir() if name in p.name] == []
    finally:
        lock.release()
        creator.join(5)
        for segment in made:
            segment.unlink()
            segment.close()


def test_engine_stops_when_serve_is_killed(checkpoints, tmp_path):
    """serve's engine runs in its own session (a terminal's Ctrl-C goes to serve, which drains
    first), so nothing but its parent-death signal (`blink engine --exit-with-parent`, set by
    the engine itself after exec) stops it when serve dies without a word (SIGKILL)."""
    serve = Serve(checkpoints["llama"], tmp_path)
    engine = serve.engine_pid()
    try:
        assert str(serve.proc.pid) in open(f"/proc/{engine}/cmdline").read().split("\0")
        serve.proc.kill()
        serve.proc.wait(10)
        wait_for(lambda: _gone(engine), 30, "the engine to exit")
    finally:
        serve.stop()
        if not _gone(engine):  # (the failure's orphan)
            os.kill(engine, signal.SIGKILL)


def test_workers_counts_are_cleared_when_serve_fails_before_a_worker_starts():
    """serve --workers 2 that fails before it starts worker 2 (its metrics port taken between
    the check and the bind, say): worker 0, serve's own process, made the shared counts' files,
    and serve's end removes them (it removed them only after a worker process had run)."""
    import argparse
    import secrets
    from pathlib import Path

    from blink.client.cli import FrontendWorkers
    from blink.nic_service.engine_link import WorkerCounts
    ring = f"blink-test-{secrets.token_hex(6)}"
    try:
        for kind in WorkerCounts.KINDS:
            WorkerCounts(ring, 0, 2, kind).add()
        FrontendWorkers(argparse.Namespace(ring_name=ring, workers=2), Path(".")).join(0)
        assert not any(WorkerCounts.path(ring, kind).exists() for kind in WorkerCounts.KINDS)
    finally:
        WorkerCounts.reset(ring)


def test_front_end_workers_stop_when_serve_is_killed(checkpoints, tmp_path):
    """serve --workers 2 killed with SIGKILL: its second front-end worker exits too (its own
    parent-death signal) and the port is free for the next serve; it used to go on holding
    the port, answering NOT_SERVING, and the next serve could not listen."""
    from blink.nic_service.engine_link import WorkerCounts
    serve = Serve(checkpoints["llama"], tmp_path, "--workers", "2")
    wait_for(lambda: "worker 2/2 listening" in serve.log_path.read_text(), 30, "worker 2")
    kids = children(serve.proc.pid)
    assert any("spawn_main" in open(f"/proc/{pid}/cmdline").read() for pid in kids), kids
    ring = re.search(r"\(ring /dev/shm/([^)]+)\)", serve.log_path.read_text()).group(1)
    assert WorkerCounts.path(ring).exists()
    try:
        serve.proc.kill()
        serve.proc.wait(10)
        wait_for(lambda: all(_gone(pid) for pid in kids), 30, "every child to exit")
        port = int(serve.target.rsplit(":", 1)[1])
        with socket.socket() as probe:  # as SO_REUSEPORT-less a bind as another program's
            probe.bind(("127.0.0.1", port))
        # the workers clear the counts they shared as they go, the engine its ring
        wait_for(lambda: not any(WorkerCounts.path(ring, kind).exists()
                                 for kind in WorkerCounts.KINDS), 10, "the counts removed")
        assert not (WorkerCounts.path(ring).parent / ring).exists()
    finally:
        serve.stop()
        for pid in kids:
            if not _gone(pid):  # (the failure's orphans)
                os.kill(pid, signal.SIGKILL)


def test_sigterm_with_a_stopped_engine_ends_soon_and_removes_the_ring(checkpoints, tmp_path):
    """SIGTERM to serve whose engine is stopped (SIGSTOP: it cannot act on SIGTERM): serve
    kills it after a short wait rather than the 10 s a live engine gets, and removes the ring
    the killed engine left in /dev/shm."""
    serve = Serve(checkpoints["llama"], tmp_path, "--engine-timeout", "1",
                  "--engine-restart-timeout", "0")
    ring = next(iter(line.split("(ring ")[1].split(")")[0]
                     for line in serve.log_path.read_text().splitlines() if "(ring " in line))
    assert os.path.exists(ring)
    engine = serve.engine_pid()
    os.kill(engine, signal.SIGSTOP)
    try:
        with BlinkClient(serve.target) as client:
            wait_for(lambda: client.health() == "NOT_SERVING", 10, "NOT_SERVING")
        t0 = time.monotonic()
        assert serve.stop() == 0
        assert time.monotonic() - t0 < 6
        assert _gone(engine) and not os.path.exists(ring)
    finally:
        if not _gone(engine):
            os.kill(engine, signal.SIGKILL)


@pytest.mark.gpu
@requires_gpu()
def test_cuda_engine_killed_mid_stream_is_restarted_by_serve(long_checkpoint, tmp_path):
    """blink serve with the CUDA engine: its engine process killed (SIGKILL) while a stream
    runs; the stream fails UNAVAILABLE within seconds, serve starts a new engine (a new
    scheduler kernel) and the same greedy request gives the same tokens as before."""
    serve = Serve(long_checkpoint, tmp_path, "--engine", "cuda", "--num-kv-blocks", "4096",
                  "--engine-timeout", "1")
    try:
        with BlinkClient(serve.target) as client:
            assert client.model_info().engine == "cuda"
            before = client.generate("before the kill", exact(32), return_token_ids=True)
            errors: list[BlinkError] = []

            def stream():
                try:
                    for _ in client.stream("a long stream", exact(16000)):
                        pass
                except BlinkError as e:
                    errors.append(e)

            t = threading.Thread(target=stream)
            t.start()
            wait_for(lambda: client.stats()["sequences_running"] == 1, 30, "the stream")
            os.kill(serve.engine_pid(), signal.SIGKILL)
            t.join(10)
            assert not t.is_alive() and len(errors) == 1, errors
            assert errors[0].code == grpc.StatusCode.UNAVAILABLE
            wait_for(lambda: client.stats()["engine_attachments"] == 2
                     and client.health() == "SERVING", 120, "the restarted engine")
            assert client.model_info().engine == "cuda"
            after = client.generate("before the kill", exact(32), return_token_ids=True)
            assert after.token_ids == before.token_ids
    finally:
        assert serve.stop() == 0


def test_drain_on_sigterm(long_checkpoint, tmp_path):
    """SIGTERM: health NOT_SERVING, new requests UNAVAILABLE 'server shutting down', the
    stream in flight runs to its end, then every process exits with status 0."""
    serve = Serve(long_checkpoint, tmp_path, "--shutdown-timeout", "60")
    results = {}

    def long_stream():
        with BlinkClient(serve.target) as client:
            results["done"] = client.generate("a long answer", Sampling(
                max_tokens=600, temperature=0.0, ignore_eos=True), timeout=120)

    streamer = threading.Thread(target=long_stream)
    streamer.start()
    with BlinkClient(serve.target) as client:
        wait_for(lambda: client.stats()["sequences_running"] == 1, 30, "the stream to run")
        engine = serve.engine_pid()
        serve.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: client.health() == "NOT_SERVING", 10, "NOT_SERVING")
        with pytest.raises(BlinkError, match="UNAVAILABLE.*shutting down"):
            client.generate("too late", Sampling(max_tokens=2))
    streamer.join(120)
    assert results["done"].completion_tokens == 600 and results["done"].finish_reason == "length"
    assert serve.stop() == 0
    assert not os.path.exists(f"/proc/{engine}")


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGQUIT])
def test_a_closed_terminal_or_ctrl_backslash_drains_like_sigterm(long_checkpoint, tmp_path,
                                                                 sig):
    """SIGHUP (the terminal closed) and SIGQUIT: serve drains and stops the engine, which
    removes its ring, and everything exits 0 (serve died at once, its engine left its ring
    behind marked SERVING, and the front end's requests went on generating for no one). A
    stream still open when --shutdown-timeout runs out ends "server shutting down", not as an
    engine that went away."""
    serve = Serve(long_checkpoint, tmp_path, "--shutdown-timeout", "1", "--engine", "synthetic",
                  "--synthetic-step-ms", "5")
    ring = re.search(r"\(ring ([^)]+)\)", serve.log_path.read_text()).group(1)
    results = {}

    def long_stream():
        with BlinkClient(serve.target) as client:
            try:
                client.generate("a long answer", exact(5000), timeout=60)
            except BlinkError as e:
                results["error"] = e

    streamer = threading.Thread(target=long_stream)
    streamer.start()
    with BlinkClient(serve.target) as client:
        wait_for(lambda: client.stats()["sequences_running"] == 1, 30, "the stream to run")
    engine = serve.engine_pid()
    serve.proc.send_signal(sig)
    assert serve.proc.wait(30) == 0
    streamer.join(30)
    assert "UNAVAILABLE" in str(results["error"]) and "shutting down" in str(results["error"])
    assert _gone(engine) and not os.path.exists(ring)


def slots_in_use(ring: str, workers: int) -> list[int]:
    """Each front-end worker's ring slots in use (the file `--workers N` share)."""
    from blink.nic_service.engine_link import WorkerCounts
    return [int(n) for n in np.fromfile(WorkerCounts.path(ring, "slots"), np.uint64)[:workers]]


def streams_on_every_worker(target: str, ring: str, workers: int, tokens: int, results: list,
                            log_text):
    """Long streams, a connection each (gRPC shares one between a process's channels to one
    target), started one at a time until every worker has one (at most 16); each thread
    appends its result or its BlinkError to `results`. First, every worker listening, as the
    front end's log (log_text()) says: worker 1 answers health, and so readiness, before the
    others bind the port (on a loaded 2-core VM all 16 streams once went to it)."""
    wait_for(lambda: all(f"worker {i}/{workers} listening" in log_text()
                         for i in range(1, workers + 1)), 60, "every front-end worker")

    def stream():
        with BlinkClient(target, options=[("grpc.use_local_subchannel_pool", 1)]) as client:
            try:
                results.append(client.generate("a long answer", exact(tokens), timeout=120))
            except BlinkError as e:
                results.append(e)
    threads = []
    while len(threads) < 16 and not (len(threads) >= 2 and min(slots_in_use(ring, workers))):
        threads.append(threading.Thread(target=stream))
        threads[-1].start()
        wait_for(lambda: sum(slots_in_use(ring, workers)) == len(threads), 30, "the stream")
    assert min(slots_in_use(ring, workers)) > 0, slots_in_use(ring, workers)
    return threads


def test_a_second_stop_signal_cuts_the_drain_short(long_checkpoint, tmp_path):
    """Ctrl-C twice, as a terminal sends it (to serve and its front-end workers alike): the
    first drains, every stream going on though each worker has it twice (the terminal's and
    serve's passing on, which counted as a second signal); the second ends the drain at once
    in every worker, rather than after --shutdown-timeout: the open streams end "server
    shutting down" and every process exits 0, the engine's ring removed. Each cut stream is one
    line of the request log (it was two: its own, then a "refused" one with no request id)."""
    serve = Serve(long_checkpoint, tmp_path, "--shutdown-timeout", "120", "--engine",
                  "synthetic", "--synthetic-step-ms", "5", "--workers", "2", "--log-format",
                  "json", session=True)
    ring = re.search(r"\(ring ([^)]+)\)", serve.log_path.read_text()).group(1)  # its path
    results = []
    try:
        streamers = streams_on_every_worker(serve.target, os.path.basename(ring), 2, 5000,
                                            results, serve.log_path.read_text)
        engine = serve.engine_pid()
        os.killpg(serve.proc.pid, signal.SIGINT)
        with BlinkClient(serve.target) as client:
            wait_for(lambda: client.health() == "NOT_SERVING", 10, "NOT_SERVING")
        time.sleep(1.0)
        assert serve.proc.poll() is None and not results  # draining: 5,000 tokens take 25 s
        began = time.monotonic()
        os.killpg(serve.proc.pid, signal.SIGINT)
        assert serve.proc.wait(30) == 0
        assert time.monotonic() - began < 15
    finally:  # (a failed check leaves no server behind)
        serve.stop()
    for streamer in streamers:
        streamer.join(30)
    assert len(results) == len(streamers)
    assert all(isinstance(r, BlinkError) and "UNAVAILABLE" in str(r) and "shutting down"
               in str(r) for r in results), results
    assert _gone(engine) and not os.path.exists(ring)
    assert request_outcomes(serve) == ["unavailable: server shutting down"] * len(streamers)


def test_one_sigterm_lets_every_front_end_worker_finish_its_streams(long_checkpoint,
                                                                    make_stack):
    """`blink frontend --workers 2`, as the shipped systemd unit runs it, on one SIGTERM: every
    stream runs to its end and the front end exits 0 (its passing on of the signal to the
    workers, sent twice, once counted as a second signal: the workers' streams were cut)."""
    stack = make_stack(long_checkpoint, engine_args=[
        "--engine", "synthetic", "--synthetic-step-ms", "5", "--slots", "32"],
        frontend_args=["--workers", "2", "--shutdown-timeout", "60"])
    results = []
    streamers = streams_on_every_worker(  # (stack.logs() keeps each log's tail only)
        stack.target, stack.ring_name, 2, 2000, results,
        lambda: "".join(f.read_text() for f in stack.workdir.glob("frontend-*.log")))
    stack.frontend.send_signal(signal.SIGTERM)
    assert stack.frontend.wait(60) == 0
    for streamer in streamers:
        streamer.join(30)
    assert len(results) == len(streamers)
    assert all(not isinstance(r, BlinkError) and r.completion_tokens == 2000 for r in results), \
        results


def test_one_front_end_and_one_engine_a_ring(checkpoints, tmp_path):
    """A second front end on a ring is refused before it touches anything (it took the first
    one's slots and cancelled its requests as orphans); a second engine is refused even while
    the first one's heartbeat is slow (its 0.5 s wait for a beat let it replace a busy engine's
    ring)."""
    ring = f"blink-test-claim-{os.getpid()}"
    first = subprocess.Popen(
        [sys.executable, "-m", "blink.client.cli", "frontend", "--model",
         str(checkpoints["llama"]), "--ring-name", ring, "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: "listening" in first.stdout.readline(), 30, "the first front end")
        second = blink("frontend", "--model", str(checkpoints["llama"]), "--ring-name", ring,
                       "--port", "0")
        assert second.returncode == 1 and second.stderr == (
            f"blink: another frontend is running on the ring /dev/shm/{ring}; stop it or pick "
            f"another --ring-name\n")
    finally:
        first.terminate()
        first.wait(30)

    from blink.gpu_engine.ring_server import RingInUse, RingServer
    from blink.ring.layout import RingGeometry
    geom = RingGeometry(4, max_prompt_tokens=16, max_output_tokens=16)
    engine = RingServer(ring, geom, model_name="a", vocab_size=64, context_length=32,
                        eos_ids=())  # never beats: a busy first step
    try:
        with pytest.raises(RingInUse, match="another engine is running"):
            RingServer(ring, geom, model_name="b", vocab_size=64, context_length=32, eos_ids=())
    finally:
        engine.close()
    RingServer(ring, geom, model_name="c", vocab_size=64, context_length=32, eos_ids=()).close()


def test_a_refused_claim_says_whose_and_leaves_nothing_open():
    """A second claim on a ring in one role is RingClaimed naming the role, and its socket is
    closed (each refused try left a descriptor open); the other role's claim is separate; the
    first one's close frees the ring at once. A name that cannot be a ring's is a ValueError
    before any socket: empty, with '/', a leading '.', a NUL, or over 92 bytes (UTF-8: 47
    characters of two bytes each are 94)."""
    import secrets

    from blink.ring.lifecycle import RING_NAME_MAX_BYTES, RingClaimed, claim_ring
    ring = f"blink-test-claim-{secrets.token_hex(4)}"
    first = claim_ring(ring, "engine")
    try:
        claim_ring(ring, "frontend").close()
        fds = len(os.listdir("/proc/self/fd"))
        for _ in range(3):
            with pytest.raises(RingClaimed) as refused:
                claim_ring(ring, "engine")
        assert str(refused.value) == (f"another engine is running on the ring /dev/shm/{ring}; "
                                      f"stop it or pick another --ring-name")
        assert len(os.listdir("/proc/self/fd")) == fds
    finally:
        first.close()
    claim_ring(ring, "engine").close()
    assert RING_NAME_MAX_BYTES == 92
    for name in ("", "a/b", ".a", "a\0b"):
        with pytest.raises(ValueError, match="is not a ring name"):
            claim_ring(name, "engine")
    with pytest.raises(ValueError, match="is 94 bytes long; a ring name has at most 92"):
        claim_ring("\u00e9" * 47, "engine")


def test_lifecycle_flags_are_checked_before_anything_starts(checkpoints, tmp_path):
    """Out-of-range ports and durations and a ready file in a folder that does not exist are
    one line before anything starts (--port 70000 served on 4464, --engine-restart-timeout -1
    restarted the engine every few seconds, --metrics-port 70000 ended in a traceback, a
    missing ready-file folder hung serve with its port held), as are the front end's poll and
    stream intervals out of range and a negative queue."""
    model = str(checkpoints["llama"])
    for flags, message in ((["--port", "70000"], "'70000' is not a port"),
                           (["--metrics-port", "70000"], "'70000' is not a port"),
                           (["--engine-restart-timeout", "-1"], "'-1' is not a number of"),
                           (["--shutdown-timeout", "nan"], "'nan' is not a number of"),
                           # taken, and then: a poll thread's OverflowError on the first
                           # request; nothing streamed until the end; a queue of -3
                           (["--poll-interval-us", "inf"], "'inf' is not a number of"),
                           (["--poll-interval-us", "1e300"], "'1e300' is not a number of"),
                           (["--stream-interval-ms", "-5"], "'-5' is not a number of"),
                           (["--stream-interval-ms", "nan"], "'nan' is not a number of"),
                           (["--max-queued", "-3"], "'-3' is not a whole number"),
                           (["--ready-file", str(tmp_path / "none" / "port")],
                            "its folder does not exist")):
        out = blink("serve", "--model", model, *flags)
        assert out.returncode == 2 and message in out.stderr, out.stderr
        assert "Traceback" not in out.stderr


def test_workers_listen_again_on_the_port_they_just_left(long_checkpoint, tmp_path):
    """--workers 2, stopped after serving a request and started again on the same port at once:
    the port check no longer takes the old connections' TIME_WAIT for a listener (it refused
    for a minute)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = Serve(long_checkpoint, tmp_path / "a", "--workers", "2", "--engine",
                  "synthetic", "--synthetic-step-ms", "20", "--shutdown-timeout", "1")
    port = first.target.rsplit(":", 1)[1]
    # streams longer than the drain, cut by the server as it stops: it closes their connections
    # first, so the TIME_WAITs that follow are on the server's port
    clients = [BlinkClient(first.target) for _ in range(4)]
    streams = [c.stream("a long one", exact(4000)) for c in clients]
    for stream in streams:
        next(stream)
    assert first.stop() == 0
    time.sleep(0.5)
    for c in clients:
        c.close()
    again = Serve(long_checkpoint, tmp_path / "b", "--workers", "2", "--port", port)
    try:
        with BlinkClient(again.target) as client:
            assert client.generate("hello again", exact(2)).completion_tokens == 2
    finally:
        assert again.stop() == 0


@pytest.fixture
def broken_models(checkpoints, tmp_path):
    good = checkpoints["llama"]
    no_tok, no_weights = tmp_path / "no-tokenizer", tmp_path / "no-weights"
    shutil.copytree(good, no_tok)
    (no_tok / "tokenizer.json").unlink()
    shutil.copytree(good, no_weights)
    for f in no_weights.glob("*.safetensors"):
        f.unlink()
    bad_tok = tmp_path / "bad-tokenizer"
    shutil.copytree(good, bad_tok)
    (bad_tok / "tokenizer.json").write_text("{not json")
    wrong_shape = tmp_path / "wrong-shape"  # config.json and the weights disagree
    shutil.copytree(good, wrong_shape)
    config = json.loads((wrong_shape / "config.json").read_text())
    config["intermediate_size"] += 1
    (wrong_shape / "config.json").write_text(json.dumps(config))
    return no_tok, no_weights, bad_tok, wrong_shape


def test_fail_fast_with_one_line(checkpoints, broken_models):
    """Each of these used to hang, restart the engine forever, or print a traceback."""
    no_tok, no_weights, bad_tok, wrong_shape = broken_models
    for args, message in (
            (["serve", "--model", str(bad_tok), "--port", "0"], "cannot load"),
            (["frontend", "--model", str(bad_tok), "--port", "0"], "cannot load"),
            (["serve", "--model", str(no_tok), "--port", "0"], "no tokenizer.json"),
            (["serve", "--model", str(no_weights), "--port", "0"], "no *.safetensors"),
            (["serve", "--model", str(wrong_shape), "--port", "0"], "config.json implies"),
            (["engine", "--model", str(wrong_shape)], "config.json implies"),
            (["serve", "--model", str(checkpoints["llama"]), "--slots", "0", "--port", "0"],
             "--slots must be >= 1"),
            (["engine", "--model", str(checkpoints["llama"]), "--max-num-seqs", "0"],
             "--max-num-seqs must be >= 1")):
        t0 = time.monotonic()
        out = blink(*args)
        assert out.returncode != 0 and message in out.stderr, out.stderr
        assert "Traceback" not in out.stderr and time.monotonic() - t0 < 30


def test_engine_that_never_comes_up_ends_serve(checkpoints, tmp_path):
    """An engine that exits before its first heartbeat (here: the CPU engine refusing dummy
    weights) ends `blink serve` with a non-zero status and one line, not a restart loop."""
    out = subprocess.run(
        [sys.executable, "-m", "blink.client.cli", "serve", "--model",
         str(checkpoints["llama"]), "--port", "0", "--engine", "cpu", "--load-format", "dummy"],
        capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "engine exited with status" in out.stderr and "before it was ready" in out.stderr
    assert out.stderr.count("needs the cuda, host-cuda or hf engine") == 1  # no restart loop


def test_taken_port_is_an_error(checkpoints):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        out = blink("frontend", "--model", str(checkpoints["llama"]), "--port", str(port),
                    "--ring-name", f"blink-test-taken-{os.getpid()}")
    assert out.returncode != 0 and "cannot listen on 127.0.0.1:" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} from the Prometheus endpoint."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def failures(port: int) -> dict[str, float]:
    """request_failure_total of the clients' cancels and deadlines, from the metrics port."""
    m = scrape(port)
    return {code: m.get(("blink:request_failure_total", (("code", code),)), 0)
            for code in ("CANCELLED", "DEADLINE_EXCEEDED")}


def request_outcomes(serve: Serve) -> list[str]:
    """The outcome of every request line of a server started with `--log-format json`."""
    import json
    return [json.loads(line)["request"]["outcome"]
            for line in serve.log_path.read_text().splitlines()
            if line.startswith("{") and '"request"' in line]


def metrics_port(serve: Serve) -> int:
    """The port `--metrics-port 0` took, as the server's log says."""
    import re
    shown = r"([\d.]+|\[[\da-f:]+\])"  # an IPv4 address or a bracketed IPv6 one
    return int(wait_for(lambda: re.search(rf"metrics on http://{shown}:(\d+)/metrics",
                                          serve.log_path.read_text()), 10,
                        "the metrics port").group(2))


def test_metrics_request_logs_and_counters_across_restarts(checkpoints, tmp_path):
    import json
    serve = Serve(checkpoints["llama"], tmp_path, "--metrics-port", "0", "--log-format", "json",
                  "--engine-timeout", "1")
    try:
        port = metrics_port(serve)
        greedy = Sampling(max_tokens=12, temperature=0.0, ignore_eos=True)
        with BlinkClient(serve.target) as client:
            for i in range(3):
                client.generate(f"prompt number {i}", greedy)
            text = client.generate("where to stop", greedy).text
            stop = text[len(text) // 2:][:2]
            stopped = client.generate("where to stop", Sampling(max_tokens=12, temperature=0.0,
                                                                ignore_eos=True, stop=(stop,)))
            assert stopped.finish_reason == "stop"
            client.generate("tagged", Sampling(max_tokens=3, temperature=0.0, ignore_eos=True),
                            client_request_id="client-42")
        m = scrape(port)
        assert m[("blink:time_to_first_token_seconds_count", ())] == 6
        assert m[("blink:e2e_request_latency_seconds_count", ())] == 6
        # a gap per streamed token after each request's first chunk (its other tokens, when
        # the front end saw the first late, have none: test_request_clock_observes_as_vllm_does)
        streamed = 4 * 12 + stopped.completion_tokens + 3
        assert 0 < m[("blink:inter_token_latency_seconds_count", ())] <= streamed - 6
        assert m[("blink:request_success_total", (("finished_reason", "length"),))] == 5
        assert m[("blink:request_success_total", (("finished_reason", "stop"),))] == 1
        assert m[("blink:engine_alive", ())] == 1
        # (a gauge of the engine's is the front end's last read of the ring header: the engine
        # frees a request's blocks after its finish record, and an idle front end reads the
        # header every idle poll, so the scrape just after the last finish may see one block
        # in use: a CI run on a loaded 2-core VM did; a block leaked still fails this)
        wait_for(lambda: scrape(port)[("blink:kv_cache_usage_perc", ())] == 0, 2,
                 "the KV cache free again")
        assert m[("blink:prompt_tokens_total", ())] > 0
        tokens_before = m[("blink:generation_tokens_total", ())]
        assert tokens_before >= 4 * 12 + 3

        requests = [json.loads(line)["request"] for line in serve.log_path.read_text().splitlines()
                    if line.startswith("{") and '"request"' in line]
        assert len(requests) == 6
        assert {r["outcome"] for r in requests} == {"length", "stop"}
        (tagged,) = [r for r in requests if r["client_request_id"] == "client-42"]
        assert tagged["completion_tokens"] == 3 and tagged["ttft_s"] > 0

        os.kill(serve.engine_pid(), signal.SIGKILL)
        with BlinkClient(serve.target) as client:
            wait_for(lambda: client.stats()["engine_attachments"] == 2
                     and client.health() == "SERVING", 30, "the restarted engine")
            client.generate("after the restart", greedy)
            # (the engine's counters are the front end's last read of the ring header, up to
            # its idle poll old: a full run on the 2-core machine once read 6 here)
            stats = wait_for(lambda: (s := client.stats())["requests_finished"] >= 7 and s, 2,
                             "the restarted engine's finished request in the stats")
        assert stats["tokens_generated"] >= tokens_before + 12
        m = scrape(port)
        assert m[("blink:generation_tokens_total", ())] >= tokens_before + 12
        assert m[("blink:engine_attachments_total", ())] == 2
    finally:
        assert serve.stop() == 0


def test_client_cancels_and_deadlines_are_counted_and_logged(long_checkpoint, tmp_path):
    """Streams the client cancels, and streams whose deadline passes (of 0.3 s, and of 1.5 s,
    which the client's own deadline ends), mid-stream on a fast engine: each counts once in
    request_failure_total (CANCELLED, DEADLINE_EXCEEDED) and logs its line with the tokens it
    streamed; every line of its output is a JSON object. Both used to go uncounted and unlogged
    whenever gRPC
    was sending a message as the cancel came (the handler is then closed at its yield), and a
    cancel's log line said 0 tokens."""
    import json
    serve = Serve(long_checkpoint, tmp_path, "--metrics-port", "0", "--log-format", "json",
                  "--engine", "synthetic", "--synthetic-step-ms", "1")
    try:
        port = metrics_port(serve)
        with BlinkClient(serve.target) as client:
            for _ in range(3):
                stream, got = client.stream("cancel me", exact(5000), return_token_ids=True), 0
                for delta in stream:
                    got += len(delta.token_ids)
                    if got >= 5:
                        break
                stream.cancel()
                assert got >= 5
            # 1.5 s: the header rounds it up, so the client's deadline passes first and its
            # cancel arrives with the server's still ahead (these counted as cancels)
            for timeout in (0.3, 0.3, 1.5, 1.5):
                with pytest.raises(BlinkError) as err:
                    for _ in client.stream("too slow", exact(10_000), timeout=timeout):
                        pass
                assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            wait_for(lambda: idle(client), 10, "the engine idle")

        wait_for(lambda: failures(port) == {"CANCELLED": 3, "DEADLINE_EXCEEDED": 4}, 10,
                 f"the failures counted (have {failures(port)})")
        lines = serve.log_path.read_text().splitlines()
        # stdout's lines too (serve's "serving", the front end's "listening"): a plain line in
        # a JSON log breaks its parser
        records = [json.loads(line) for line in lines]
        assert any(r["message"].startswith("blink: serving") for r in records)
        requests = [r["request"] for r in records if "request" in r]
        outcomes = sorted(r["outcome"] for r in requests)
        assert outcomes == ["cancelled by the client"] * 3 + ["deadline exceeded"] * 4
        assert all(r["completion_tokens"] >= 5 for r in requests)
    finally:
        assert serve.stop() == 0


def test_a_prompt_refused_after_tokenizing_logs_its_tokens(long_checkpoint, tmp_path):
    """A request refused once its prompt is tokenized (max_tokens past the context) logs the
    prompt's token count, as the tokenizers library counts it (it logged 0 prompt tokens)."""
    import json

    from tokenizers import Tokenizer
    serve = Serve(long_checkpoint, tmp_path, "--log-format", "json", "--engine", "synthetic")
    try:
        with BlinkClient(serve.target) as client:
            with pytest.raises(BlinkError) as err:
                client.generate("hello there, world", exact(10_000_000))
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        want = len(Tokenizer.from_file(str(long_checkpoint / "tokenizer.json"))
                   .encode("hello there, world").ids)
        requests = wait_for(lambda: [json.loads(line)["request"] for line in
                                     serve.log_path.read_text().splitlines()
                                     if '"request"' in line], 10, "the request's log line")
        assert [r["prompt_tokens"] for r in requests] == [want] and want > 1
    finally:
        assert serve.stop() == 0


def test_a_long_client_request_id_is_cut_in_the_request_log(caplog):
    """The client's request id is free-form and echoed in the request's log line: a 1 MB one made
    a line of a million characters. The line (and its JSON fields) shows its first
    LOGGED_CLIENT_ID_CHARS characters and its length; a short one whole."""
    import logging

    import numpy as np

    from blink.nic_service.metrics import RequestClock
    from blink.nic_service.server import LOGGED_CLIENT_ID_CHARS, Prepared, log_request
    cut = "x" * LOGGED_CLIENT_ID_CHARS + "... (1000000 characters)"
    for client_id, shown in (("client-42", "client-42"), ("x" * 1_000_000, cut)):
        prep = Prepared(prompt_ids=np.zeros(3, np.int32), slot_fields={}, stops=[],
                        terminal_ids=frozenset(), return_token_ids=False,
                        client_request_id=client_id)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="blink.frontend"):
            log_request(None, prep, RequestClock(None, time.monotonic()), "length", 2)
        (record,) = caplog.records
        assert record.request["client_request_id"] == shown
        assert f"(client id {shown!r})" in record.getMessage()
        assert len(record.getMessage()) < 300


def test_request_clock_observes_as_vllm_does():
    """The front end's per-request metrics, against vLLM's definitions: the tokens that came
    with the first have no inter-token gap (it used to observe zeros), later chunks one gap a
    token; prompt tokens count once the first token came (a request given up before it does
    not count them); an EOS finish is labelled "stop" and both labels exist from the start."""
    import types

    from blink.nic_service.metrics import FrontendMetrics, RequestClock
    link = types.SimpleNamespace(alive=False, heartbeat_age=lambda: None, attachments=0,
                                 slots_in_use=0, waiting_for_slot=0)
    metrics = FrontendMetrics(link, engine_wide=False)

    def value(name, **labels):
        return metrics.registry.get_sample_value(name, labels) or 0.0
    for label in ("stop", "length"):  # exported at 0 before any request
        assert metrics.registry.get_sample_value("blink:request_success_total",
                                                 {"finished_reason": label}) == 0.0
    given_up = RequestClock(metrics, time.monotonic())
    given_up.prompt_tokens = 5
    given_up.failed("CANCELLED")
    clock = RequestClock(metrics, time.monotonic())
    clock.prompt_tokens = 7
    clock.tokens(3)
    assert value("blink:inter_token_latency_seconds_count") == 0
    assert value("blink:prompt_tokens_total") == 7
    clock.tokens(2)
    assert value("blink:inter_token_latency_seconds_count") == 2
    clock.finished("eos")
    assert value("blink:request_success_total", finished_reason="stop") == 1
    assert value("blink:request_failure_total", code="CANCELLED") == 1


def test_request_latencies_are_the_intervals_vllm_defines(monkeypatch):
    """On a clock the test moves: time to first token from the request's receipt, a chunk of n
    tokens n inter-token gaps of its interval / n, end to end from receipt to the finish."""
    import types

    from blink.nic_service import metrics as m
    now = [100.0]
    monkeypatch.setattr(m.time, "monotonic", lambda: now[0])
    link = types.SimpleNamespace(alive=False, heartbeat_age=lambda: None, attachments=0,
                                 slots_in_use=0, waiting_for_slot=0)
    metrics = m.FrontendMetrics(link, engine_wide=False)
    value = lambda name: metrics.registry.get_sample_value(name, {})  # noqa: E731
    clock = m.RequestClock(metrics, received=100.0)
    now[0] = 101.0
    clock.tokens(3)  # the first chunk: TTFT 1 s, no gaps
    now[0] = 102.0
    clock.tokens(2)  # a chunk of 2 tokens 1 s later: two gaps of 0.5 s
    now[0] = 105.0
    clock.finished("length")
    assert value("blink:time_to_first_token_seconds_sum") == 1.0
    assert value("blink:inter_token_latency_seconds_count") == 2
    assert value("blink:inter_token_latency_seconds_sum") == 1.0
    assert value("blink:e2e_request_latency_seconds_sum") == 5.0


def test_engine_gauges_and_counters_are_the_ring_header_s_fields():
    """Each engine-wide metric is the header field or counter it names, in its unit."""
    import types

    from blink.nic_service.engine_link import ENGINE_COUNTERS
    from blink.nic_service.metrics import FrontendMetrics
    from blink.ring.layout import HEADER_DTYPE
    header = np.zeros((), HEADER_DTYPE)
    for field, v in dict(sequences_running=3, sequences_waiting=5, kv_blocks_total=40,
                         kv_blocks_free=30, kv_blocks_cached=7).items():
        header[field] = v
    totals = {name: 1000 + i for i, name in enumerate(ENGINE_COUNTERS)}
    link = types.SimpleNamespace(alive=True, heartbeat_age=lambda: 0.25, attachments=2,
                                 slots_in_use=4, waiting_for_slot=9, info=object(),
                                 header_snapshot=lambda: header, counter_totals=lambda: totals)
    metrics = FrontendMetrics(link, engine_wide=True)
    value = lambda name: metrics.registry.get_sample_value(name, {})  # noqa: E731
    assert value("blink:num_requests_running") == 3
    assert value("blink:num_requests_waiting") == 5
    assert value("blink:kv_cache_usage_perc") == 0.25  # (40 - 30) / 40
    assert value("blink:ring_slots_in_use") == 4
    assert value("blink:num_requests_queued") == 9
    assert value("blink:engine_heartbeat_age_seconds") == 0.25
    assert value("blink:num_preemptions_total") == totals["preemptions"]
    assert value("blink:engine_busy_seconds_total") == totals["busy_ns"] / 1e9
    assert value("blink:requests_rejected_by_engine_total") == totals["requests_rejected"]


def test_requests_that_end_waiting_for_a_slot_are_counted_and_logged(long_checkpoint,
                                                                     tmp_path):
    """--slots 1, held by a long stream: a request whose deadline passes in the queue for the
    slot and one its client cancels there each count in request_failure_total and log a line
    (both went uncounted and unlogged: the handler was cancelled before it had a slot); their
    prompts are not counted in prompt_tokens_total (no prefill ran)."""
    import json
    import threading
    serve = Serve(long_checkpoint, tmp_path, "--metrics-port", "0", "--log-format", "json",
                  "--engine", "synthetic", "--synthetic-step-ms", "5", "--slots", "1")
    try:
        port = metrics_port(serve)
        with BlinkClient(serve.target) as client:
            holder = client.stream("hold the slot", exact(5000))
            next(iter(holder))
            prompt_tokens = scrape(port)[("blink:prompt_tokens_total", ())]
            with pytest.raises(BlinkError) as err:
                client.generate("too late", exact(4), timeout=0.3)
            assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            queued = client.stream("given up", exact(4))
            threading.Timer(0.3, queued.cancel).start()
            assert list(queued) == []
            holder.cancel()

        wait_for(lambda: failures(port) == {"CANCELLED": 2, "DEADLINE_EXCEEDED": 1}, 10,
                 f"the failures counted (have {failures(port)})")
        assert scrape(port)[("blink:prompt_tokens_total", ())] == prompt_tokens
        requests = [json.loads(line)["request"] for line in serve.log_path.read_text().splitlines()
                    if line.startswith("{") and '"request"' in line]
        outcomes = sorted(r["outcome"] for r in requests)
        assert outcomes == ["cancelled by the client",
                            "cancelled by the client before it had a slot",
                            "deadline exceeded before it had a slot"], outcomes
    finally:
        assert serve.stop() == 0


def test_deadlines_that_pass_before_the_request_is_read_are_counted_and_logged(
        long_checkpoint, tmp_path):
    """--slots 1, held: calls whose deadline passes before the front end has their request
    message (headers in, the message still on its way: a large prompt on a slow link, or a
    burst the server's event loop is behind on) count in request_failure_total as
    DEADLINE_EXCEEDED and log a line, as a deadline that passes in the queue for a slot does.
    gRPC ended them before a unary handler ran: of a burst of 100 calls with a 50 ms deadline,
    28 went unseen."""
    from blink.v1 import blink_pb2 as pb
    serve = Serve(long_checkpoint, tmp_path, "--metrics-port", "0", "--log-format", "json",
                  "--engine", "synthetic", "--synthetic-step-ms", "5", "--slots", "1")
    late_calls = 3
    try:
        port = metrics_port(serve)
        with BlinkClient(serve.target) as client, grpc.insecure_channel(serve.target) as ch:
            holder = client.stream("hold the slot", exact(5000))
            next(iter(holder))
            # Generate as the wire carries it, with its one request message sent late
            generate = ch.stream_stream("/blink.v1.Blink/Generate",
                                        request_serializer=pb.GenerateRequest.SerializeToString,
                                        response_deserializer=pb.GenerateResponse.FromString)

            def late():
                time.sleep(1.0)
                yield pb.GenerateRequest(text="too late")
            for _ in range(late_calls):
                with pytest.raises(grpc.RpcError) as err:
                    list(generate(late(), timeout=0.3))
                assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            with pytest.raises(BlinkError) as err:  # one in the queue, as before
                client.generate("too late", exact(4), timeout=0.05)
            assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            holder.cancel()
        wait_for(lambda: failures(port) == {"CANCELLED": 1,
                                            "DEADLINE_EXCEEDED": late_calls + 1}, 10,
                 f"the failures counted (have {failures(port)})")
    finally:
        assert serve.stop() == 0
    outcomes = request_outcomes(serve)
    assert sorted(outcomes) == ["cancelled by the client"] + [
        "deadline exceeded before it had a slot"] * (late_calls + 1), outcomes


def test_calls_cancelled_before_their_request_is_read_are_counted_and_logged(checkpoints,
                                                                              tmp_path):
    """A client that cancels its call after the headers and before its request message (or
    whose message is over gRPC's size limit: the same thing to the server) counts in
    request_failure_total as CANCELLED and logs a line; both went unseen."""
    import asyncio
    serve = Serve(checkpoints["llama"], tmp_path, "--metrics-port", "0", "--log-format", "json")
    cancels = 3

    async def cancel_before_the_request() -> None:
        async with grpc.aio.insecure_channel(serve.target) as channel:
            generate = channel.stream_stream("/blink.v1.Blink/Generate",
                                             request_serializer=bytes,
                                             response_deserializer=bytes)
            never = asyncio.Event()

            async def no_message_yet():
                await never.wait()
                yield b""
            for _ in range(cancels):
                call = generate(no_message_yet())
                await call.wait_for_connection()
                await asyncio.sleep(0.3)  # the front end is reading the request
                call.cancel()
    try:
        port = metrics_port(serve)
        asyncio.run(cancel_before_the_request())
        wait_for(lambda: failures(port)["CANCELLED"] == cancels, 10,
                 f"the cancels counted (have {failures(port)})")
    finally:
        assert serve.stop() == 0
    outcomes = request_outcomes(serve)
    assert outcomes == ["ended before its request was read: cancelled by the client, or its "
                        "message was over gRPC's size limit"] * cancels, outcomes


def test_refusals_before_a_slot_are_counted_and_logged(long_checkpoint, tmp_path):
    """A request refused before it has a slot counts in request_failure_total and logs a line,
    whatever refuses it: a prompt outside the vocabulary (INVALID_ARGUMENT: counted, never
    logged), the drain (UNAVAILABLE "server shutting down", as an engine outage's: neither
    counted nor logged, so an alert on UNAVAILABLE stayed silent through an outage)."""
    import json
    serve = Serve(long_checkpoint, tmp_path, "--metrics-port", "0", "--log-format", "json",
                  "--engine", "synthetic", "--synthetic-step-ms", "5")
    try:
        port = metrics_port(serve)
        with BlinkClient(serve.target) as client:
            with pytest.raises(BlinkError, match="INVALID_ARGUMENT"):
                client.generate([10 ** 6], exact(2))
            holder = client.stream("keep the drain going", exact(5000))
            next(iter(holder))
            serve.proc.send_signal(signal.SIGTERM)
            wait_for(lambda: client.health() == "NOT_SERVING", 10, "NOT_SERVING")
            with pytest.raises(BlinkError, match="UNAVAILABLE.*shutting down"):
                client.generate("too late", exact(2))
            counted = scrape(port)
            holder.cancel()
        assert {code: counted.get(("blink:request_failure_total", (("code", code),)), 0)
                for code in ("INVALID_ARGUMENT", "UNAVAILABLE")} == {
                    "INVALID_ARGUMENT": 1, "UNAVAILABLE": 1}
    finally:
        serve.stop()
    outcomes = request_outcomes(serve)
    assert "refused, UNAVAILABLE: server shutting down" in outcomes, outcomes
    assert any(o.startswith("refused, INVALID_ARGUMENT: token id 1000000 is outside")
               for o in outcomes), outcomes


def listening_address(port: int) -> str:
    """The local address of this host's TCP listener on `port`, from /proc/net/tcp and tcp6
    (the kernel's own view: needs no address but loopback to tell 127.0.0.1 from 0.0.0.0)."""
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        with open(f"/proc/net/{table}") as f:
            for row in f.read().splitlines()[1:]:
                local, state = row.split()[1], row.split()[3]
                address, hex_port = local.split(":")
                if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                    raw = bytes.fromhex(address)  # 32-bit words in host (little-endian) order
                    return socket.inet_ntop(family, b"".join(raw[i:i + 4][::-1]
                                                             for i in range(0, len(raw), 4)))
    raise AssertionError(f"nothing listens on port {port}")


@pytest.mark.parametrize("flags, metrics_on", [
    ((), "127.0.0.1"), (("--host", "0.0.0.0"), "::"),
    (("--metrics-host", "0.0.0.0"), "0.0.0.0")], ids=["loopback", "wildcard", "explicit"])
def test_metrics_listen_where_the_grpc_port_does(checkpoints, tmp_path, flags, metrics_on):
    """The metrics endpoint (no authentication) listens on --host unless --metrics-host says
    otherwise: it listened on every interface while the gRPC port was on loopback. --host
    0.0.0.0, which gRPC takes for both families, gives it both too (it was IPv4's alone: an
    IPv6-only cluster reached the gRPC port and not the metrics)."""
    from blink.nic_service.server import metrics_address
    if metrics_on == "::" and metrics_address("0.0.0.0") != "::":
        pytest.skip("no IPv6 here")
    serve = Serve(checkpoints["llama"], tmp_path, "--engine", "synthetic", "--metrics-port", "0",
                  *flags)
    try:
        port = metrics_port(serve)
        assert listening_address(port) == metrics_on
        shown = f"[{metrics_on}]" if ":" in metrics_on else metrics_on
        assert f"metrics on http://{shown}:{port}/metrics" in serve.log_path.read_text()
        assert ("blink:engine_alive", ()) in scrape(port)  # (scrape: through 127.0.0.1)
        if metrics_on == "::":  # and through IPv6, as the gRPC port answers it
            with urllib.request.urlopen(f"http://[::1]:{port}/metrics", timeout=10) as reply:
                assert b"blink:engine_alive" in reply.read()
    finally:
        assert serve.stop() == 0


def test_metrics_follow_a_bracketed_ipv6_host():
    """--host [::1] (gRPC's form of an IPv6 address) gives the metrics ::1, as a socket takes
    it: taken whole, the start-up check failed ("Name or service not known")."""
    from blink.client.cli import _check_metrics_ports, build_parser
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
            free = probe.getsockname()[1]
    except OSError as e:
        pytest.skip(f"no IPv6 loopback here: {e}")
    for port in ("0", str(free)):
        args = build_parser().parse_args(["frontend", "--host", "[::1]", "--metrics-port", port,
                                          "--workers", "2"])
        for reservation in _check_metrics_ports(args):  # exits on a failure
            reservation.close()
        assert args.metrics_host == "::1"


def test_metrics_ports_stay_reserved_for_their_workers():
    """The metrics ports of --workers 2 stay held by serve's own sockets while it runs, picked
    (--metrics-port 0) or given: another program's bind of one, with SO_REUSEADDR as servers
    bind, is refused (checked and closed, they were free until each worker bound its own, and
    a test's bind(0) took one now and then: that worker failed, "Address already in use"), as
    is another serve's check of them, while each worker's metrics server binds its port beside
    them and serves, and again after a restart (its scrapes' connections in TIME_WAIT)."""
    from prometheus_client import CollectorRegistry, Counter

    from blink.client.cli import _check_metrics_ports, build_parser
    if not hasattr(socket, "SO_REUSEPORT"):
        pytest.skip("no SO_REUSEPORT here: the ports are checked at start, not held")

    def resolve(metrics_port: int) -> tuple[list, list[int]]:
        args = build_parser().parse_args(["frontend", "--metrics-port", str(metrics_port),
                                          "--workers", "2"])
        held = _check_metrics_ports(args)  # exits on a failure
        return held, [args.metrics_port, args.metrics_port + 1]

    def refused_to_others(ports: list[int]) -> None:
        for port in ports:
            with socket.socket() as other:
                other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                with pytest.raises(OSError) as err:
                    other.bind(("127.0.0.1", port))
                assert err.value.errno == errno.EADDRINUSE, port
        with pytest.raises(SystemExit, match=f"cannot serve metrics on 127.0.0.1:{ports[0]} "):
            resolve(ports[0])

    def served(ports: list[int]) -> None:
        from blink.nic_service.metrics import start_metrics_server
        registry = CollectorRegistry()
        Counter("reserved_port_scrapes", "a sample to find", registry=registry).inc()
        for port in ports:
            server = start_metrics_server(port, "127.0.0.1", registry, reuse_port=True)
            try:
                assert ("reserved_port_scrapes_total", ()) in scrape(port)
            finally:
                server.shutdown()
                server.server_close()

    held, ports = resolve(0)
    try:
        refused_to_others(ports)
        served(ports)
        refused_to_others(ports)  # (the reservation outlives a worker's server)
    finally:
        for reservation in held:
            reservation.close()
    held, again = resolve(ports[0])  # a serve started again on the ports the last one took
    try:
        assert again == ports
        refused_to_others(ports)
        served(ports)
    finally:
        for reservation in held:
            reservation.close()


def test_a_metrics_port_just_left_by_another_server_is_taken():
    """--metrics-port P where another server (without SO_REUSEPORT: an older serve's, another
    program's) closed its side of a connection moments ago: serve starts, and its worker's
    metrics server binds P (the reservation, SO_REUSEPORT without SO_REUSEADDR, is refused
    beside that connection in TIME_WAIT, and serve exited "Address already in use" although
    the check had passed)."""
    from prometheus_client import CollectorRegistry

    from blink.client.cli import _check_metrics_ports, build_parser
    from blink.nic_service.metrics import start_metrics_server
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client:
            accepted, _ = listener.accept()
            accepted.close()  # the server's side closes first: TIME_WAIT on `port`
            client.recv(1)
    args = build_parser().parse_args(["frontend", "--metrics-port", str(port)])
    held = _check_metrics_ports(args)  # exits on a failure
    try:
        server = start_metrics_server(port, "127.0.0.1", CollectorRegistry())
        server.shutdown()
        server.server_close()
    finally:
        for reservation in held:
            reservation.close()


@pytest.mark.parametrize("workers", [1, 2])
def test_serve_holds_its_metrics_ports_until_it_exits(workers):
    """`_claim_port` (serve's start) keeps the reservations of the metrics ports it was given,
    with one worker as with several: another program's bind of one is refused from the check
    to serve's exit (dropped, they were closed at once, and the port was free again before the
    metrics server bound it), while the metrics server binds beside them."""
    from prometheus_client import CollectorRegistry

    from blink.client import cli
    from blink.nic_service.metrics import start_metrics_server
    if not hasattr(socket, "SO_REUSEPORT"):
        pytest.skip("no SO_REUSEPORT here: the ports are checked at start, not held")
    picked = cli.build_parser().parse_args(["frontend", "--metrics-port", "0",
                                            "--workers", "2"])
    for reservation in cli._check_metrics_ports(picked):  # two free ports
        reservation.close()
    args = cli.build_parser().parse_args([
        "frontend", "--port", "0", "--ring-name", f"blink-test-hold-{os.getpid()}-{workers}",
        "--metrics-port", str(picked.metrics_port), "--workers", str(workers)])
    before = len(cli._HELD_UNTIL_EXIT)
    cli._claim_port(args)
    held = cli._HELD_UNTIL_EXIT[before:]
    try:
        for port in range(args.metrics_port, args.metrics_port + workers):
            assert port in args.metrics_ports_held  # (its worker binds beside the reservation)
            with socket.socket() as other:
                other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                with pytest.raises(OSError, match="in use"):
                    other.bind(("127.0.0.1", port))
            server = start_metrics_server(port, "127.0.0.1", CollectorRegistry(),
                                          reuse_port=True)
            server.shutdown()
            server.server_close()
    finally:
        del cli._HELD_UNTIL_EXIT[before:]
        for sock in held:
            sock.close()


def test_metrics_ports_may_end_at_65535():
    """--metrics-port 65534 --workers 2: worker 2 on 65535, the last port, is let through
    (only a run past it is refused at start)."""
    from blink.client.cli import _check_metrics_ports, build_parser
    args = build_parser().parse_args(["frontend", "--metrics-port", "65534", "--workers", "2"])
    try:
        held = _check_metrics_ports(args)
    except SystemExit as e:  # (one taken on this host: said so, as for any port)
        assert "past 65535" not in str(e.code) and "cannot serve metrics" in str(e.code)
    else:
        for reservation in held:
            reservation.close()


def test_a_refused_metrics_port_check_leaves_no_port_held():
    """--metrics-port P --workers 3 with P + 2 taken: serve exits, and the ports it had already
    reserved (P, P + 1) are free again at once (each held until the process's exit, they kept
    the ports of a check that had failed)."""
    from blink.client.cli import _check_metrics_ports, build_parser

    def args(port: int):
        return build_parser().parse_args(["frontend", "--metrics-port", str(port),
                                          "--workers", "3"])
    picked = args(0)
    for reservation in _check_metrics_ports(picked):  # a run of three free ports
        reservation.close()
    first = picked.metrics_port
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", first + 2))
        taken.listen()
        with pytest.raises(SystemExit, match=f"127.0.0.1:{first + 2} .*worker 3") as err:
            _check_metrics_ports(args(first))
        for port in (first, first + 1):  # (err keeps the check's frame, and its sockets, alive)
            with socket.socket() as other:  # (no option: refused beside any socket on the port)
                other.bind(("127.0.0.1", port))
        assert err.value.code


def test_a_free_port_run_closes_the_runs_it_gives_up():
    """_free_port_run: a run whose next port is taken is closed, all of it, before the next
    pick (a run given up stayed open until serve's exit, its ports held for nothing), and
    the run it returns is n sockets on consecutive ports."""
    from blink.client.cli import _free_port_run
    opened, blockers = [], []

    def bind(port: int) -> socket.socket:
        sock = socket.socket()
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            sock.close()
            raise
        opened.append(sock)
        if port == 0 and not blockers:  # the first pick's next port taken: a run given up
            blocker = socket.socket()
            blockers.append(blocker)
            try:
                blocker.bind(("127.0.0.1", sock.getsockname()[1] + 1))
            except OSError:
                pass  # (taken already)
        return sock
    try:
        run = _free_port_run(bind, 3)
        ports = [sock.getsockname()[1] for sock in run]
        assert ports == list(range(ports[0], ports[0] + 3))
        given_up = [sock for sock in opened if sock not in run]
        assert given_up and all(sock.fileno() == -1 for sock in given_up)
    finally:
        for sock in opened + blockers:
            sock.close()


def test_a_picked_metrics_port_run_joins_no_listener_of_this_user(monkeypatch):
    """--metrics-port 0 --workers 2: a run's next port, where a server of this user listens
    with SO_REUSEPORT (another serve's worker), is no port of the run (with SO_REUSEPORT set
    before its bind, the reservation joined it, and the worker's metrics server would have
    shared that port with the other serve's: a scrape reached either)."""
    import blink.client.cli as cli
    if not hasattr(socket, "SO_REUSEPORT"):
        pytest.skip("no SO_REUSEPORT here")
    for _ in range(64):  # a free port whose next one is free too (to be `other`'s)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            first = probe.getsockname()[1]
        other = socket.socket()  # another serve's worker on the port after `first`
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            other.bind(("127.0.0.1", first + 1))
            break
        except OSError:
            other.close()
    with other:
        other.listen()
        real = cli._free_port_run
        # the kernel's pick made `first`, every time: the run can only be first, first + 1
        monkeypatch.setattr(cli, "_free_port_run",
                            lambda bind, n: real(lambda port: bind(port or first), n))
        args = cli.build_parser().parse_args(["frontend", "--metrics-port", "0",
                                              "--workers", "2"])
        with pytest.raises(SystemExit, match="found no 2 consecutive free ports"):
            for reservation in cli._check_metrics_ports(args):
                reservation.close()


def test_a_metrics_server_not_held_for_takes_no_port_in_use():
    """A metrics server whose port serve does not hold for it (a Frontend built in-process,
    `blink serve --metrics-port 0` with one worker) binds without SO_REUSEPORT: on a port
    another one listens on it fails, "Address already in use" (with the option, set on every
    server, the two shared the port and the scrapes were split between them)."""
    from prometheus_client import CollectorRegistry

    from blink.nic_service.metrics import start_metrics_server
    first = start_metrics_server(0, "127.0.0.1", CollectorRegistry())
    try:
        with pytest.raises(OSError) as err:
            second = start_metrics_server(first.server_port, "127.0.0.1", CollectorRegistry())
            second.shutdown()
            second.server_close()
        assert err.value.errno == errno.EADDRINUSE
    finally:
        first.shutdown()
        first.server_close()


def test_metrics_requests_are_not_logged(capfd):
    """The metrics endpoint writes nothing per request (wsgiref's line on stderr for each
    scrape, every few seconds, filled the front end's log)."""
    from prometheus_client import CollectorRegistry

    from blink.nic_service.metrics import start_metrics_server
    server = start_metrics_server(0, "127.0.0.1", CollectorRegistry())
    try:
        scrape(server.server_port)
    finally:
        server.shutdown()
        server.server_close()
    assert "GET /metrics" not in capfd.readouterr().err


def test_every_worker_s_stats_count_every_worker_s_slots(checkpoints, tmp_path):
    """--workers 2 with 8 live streams: GetServerStats, from whichever worker a connection
    reaches, says 8 slots in use of the ring's (it said that worker's own, 2 or 6, beside the
    whole ring's slot count); each worker's metrics keep its own share (their sum is 8)."""
    import asyncio

    from blink.client.sdk import AsyncBlinkClient
    serve = Serve(checkpoints["llama"], tmp_path, "--workers", "2", "--engine", "synthetic",
                  "--synthetic-step-ms", "20", "--metrics-port", "0")
    try:
        async def run():
            def connection():
                return AsyncBlinkClient(serve.target,
                                        options=[("grpc.use_local_subchannel_pool", 1)])
            streamers, askers = [connection() for _ in range(8)], [connection() for _ in
                                                                   range(12)]
            streams = [c.stream("hold on", Sampling(max_tokens=400, ignore_eos=True))
                       for c in streamers]
            for stream in streams:  # every one streaming
                await stream.__anext__()
            stats = await asyncio.gather(*(c.stats() for c in askers))
            shares = [scrape(p)[("blink:ring_slots_in_use", ())] for p in ports]
            for stream in streams:
                stream.cancel()
            for c in streamers + askers:
                await c.close()
            return stats, shares
        ports = wait_for(lambda: [int(p) for p in re.findall(
            r"metrics on http://[\d.]+:(\d+)/metrics", serve.log_path.read_text())][1:] and
            [int(p) for p in re.findall(r"metrics on http://[\d.]+:(\d+)/metrics",
                                        serve.log_path.read_text())], 30, "both metrics ports")
        stats, shares = asyncio.run(run())
        assert {(s["ring_slots_in_use"], s["ring_slots"]) for s in stats} == {(8, 128)}
        # each answer names the worker that gave it, of the two
        assert {(s["frontend_worker"], s["frontend_workers"]) for s in stats} <= {(0, 2), (1, 2)}
        assert sum(shares) == 8 and len(shares) == 2
        with BlinkClient(serve.target) as client:
            wait_for(lambda: client.stats()["ring_slots_in_use"] == 0, 10, "the slots back")
    finally:
        assert serve.stop() == 0


def test_a_worker_out_of_slots_says_the_other_workers_have_some(checkpoints, tmp_path):
    """--workers 2 of a slot each: a second request on the connection of a streaming one waits
    in vain for its worker's share while the other worker's slot is free, and its error says so
    and what to do (it said only that no slot became free, as if the server were full: what a
    client on one connection, such as the OpenAI gateway, was told)."""
    serve = Serve(checkpoints["llama"], tmp_path, "--workers", "2", "--slots", "2", "--engine",
                  "synthetic", "--synthetic-step-ms", "20", "--queue-timeout", "1")
    try:
        with BlinkClient(serve.target) as client:
            holder = client.stream("hold on", Sampling(max_tokens=400, ignore_eos=True))
            next(iter(holder))
            with pytest.raises(BlinkError, match=r"RESOURCE_EXHAUSTED.*within 1 s in this "
                               r"front-end worker's share \(1 of the 2 slots; 1 free in the "
                               r"other workers' shares: a connection reaches one worker"):
                client.generate("me too", Sampling(max_tokens=2))
            holder.cancel()
    finally:
        assert serve.stop() == 0


def test_front_end_workers_agree_on_stats_and_export_the_engine_once(checkpoints, tmp_path):
    """--workers 2: half the requests end on a stop string (the engine counts those as
    cancels, the front end as finishes). Every worker's GetServerStats gives the same counts,
    each worker's own stop-string finishes and the other's (they used to differ by worker);
    the engine's gauges and counters are on the first worker's metrics port alone (a sum over
    the workers' targets counted each token twice), the front end's own on both."""
    import asyncio

    from blink.client.sdk import AsyncBlinkClient
    import re
    serve = Serve(checkpoints["llama"], tmp_path, "--workers", "2", "--metrics-port", "0")
    try:
        ports = wait_for(lambda: [int(p) for p in re.findall(
            r"metrics on http://[\d.]+:(\d+)/metrics", serve.log_path.read_text())][1:] and
            [int(p) for p in re.findall(r"metrics on http://[\d.]+:(\d+)/metrics",
                                        serve.log_path.read_text())], 30, "both metrics ports")
        with BlinkClient(serve.target) as client:
            text = client.generate("where to stop", exact(12)).text
        stop = text[len(text) // 2:][:2]

        async def many():
            clients = [AsyncBlinkClient(serve.target,
                                        options=[("grpc.use_local_subchannel_pool", 1)])
                       for _ in range(24)]
            try:
                return await asyncio.gather(*(c.generate("where to stop", Sampling(
                    max_tokens=12, temperature=0.0, ignore_eos=True,
                    stop=(stop,) if i % 2 else ())) for i, c in enumerate(clients)))
            finally:
                for c in clients:
                    await c.close()
        done = asyncio.run(many())
        assert sorted(d.finish_reason for d in done) == ["length"] * 12 + ["stop"] * 12

        async def stats_of_each_connection():
            clients = [AsyncBlinkClient(serve.target,
                                        options=[("grpc.use_local_subchannel_pool", 1)])
                       for _ in range(12)]
            try:
                return await asyncio.gather(*(c.stats() for c in clients))
            finally:
                for c in clients:
                    await c.close()
        def answers():  # (each worker's header read is up to its idle poll, 20 ms, old)
            return {(s["requests_finished"], s["requests_cancelled"])
                    for s in asyncio.run(stats_of_each_connection())}
        wait_for(lambda: answers() == {(25, 0)}, 5, "the workers' stats to agree")
        engine_wide = [("blink:generation_tokens_total", ()) in scrape(p) for p in ports]
        assert sorted(engine_wide) == [False, True]  # one worker's port has them
        first, second = (scrape(p) for p in sorted(ports, key=lambda p: not engine_wide[
            ports.index(p)]))
        assert first[("blink:generation_tokens_total", ())] >= 12 * 13
        assert ("blink:engine_alive", ()) in second
        successes = sum(m.get(("blink:request_success_total", (("finished_reason", r),)), 0)
                        for m in (first, second) for r in ("length", "stop"))
        assert successes == 25
    finally:
        assert serve.stop() == 0


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["on", "off"])
def test_prefix_cache_in_timings_stats_and_metrics(checkpoints, tmp_path, prefix_caching):
    """A prompt of three full KV blocks and a bit, sent twice: with prefix caching the second
    takes the three blocks from the cache (no prefill for them) and gives the same greedy
    tokens, and GetServerStats, `blink stats` and /metrics count the hit; with
    --no-prefix-caching nothing is reused, nothing is counted and the stats say it is off. The
    second ends on a stop string: a finish the front end decides, as a rule while the engine
    still runs it."""
    import json
    serve = Serve(checkpoints["llama"], tmp_path, "--metrics-port", "0",
                  *([] if prefix_caching else ["--no-prefix-caching"]))
    try:
        with BlinkClient(serve.target) as client:
            block = client.stats()["kv_block_size"]
            prompt = [100 + i for i in range(3 * block + 5)]
            first = client.generate(prompt, exact(8), return_token_ids=True)
            stop = first.text[len(first.text) // 2]
            second = client.generate(prompt, Sampling(max_tokens=8, temperature=0.0,
                                                      ignore_eos=True, stop=(stop,)),
                                     return_token_ids=True)
        hit = 3 * block if prefix_caching else 0
        assert (first.cached_prompt_tokens, second.cached_prompt_tokens) == (0, hit)
        assert second.finish_reason == "stop"
        assert second.token_ids == first.token_ids[:len(second.token_ids)]
        queried = 2 * len(prompt) if prefix_caching else 0
        out = blink("stats", "--target", serve.target)
        assert out.returncode == 0, out.stderr
        stats = json.loads(out.stdout)
        assert stats["prefix_caching"] is prefix_caching
        assert (stats["prefix_query_tokens"], stats["prefix_hit_tokens"]) == (queried, hit)
        assert stats["prefix_cache_hit_rate"] == (hit / queried if prefix_caching else None)
        # the first request's three full blocks (neither filled a fourth)
        assert stats["kv_blocks_cached"] == hit // block
        assert stats["prefix_evicted_blocks"] == 0
        m = scrape(metrics_port(serve))
        assert m[("blink:prefix_cache_queries_total", ())] == queried
        assert m[("blink:prefix_cache_hits_total", ())] == hit
        assert m[("blink:kv_cache_blocks_cached", ())] == hit // block
        assert m[("blink:prefix_cache_evicted_blocks_total", ())] == 0
    finally:
        assert serve.stop() == 0


def test_version_info_json_and_generate_to_nothing(checkpoints):
    out = blink("--version")
    assert out.returncode == 0 and out.stdout.startswith("blink ")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free, and nothing listens there
    t0 = time.monotonic()
    out = blink("generate", "--target", f"127.0.0.1:{port}", "--wait", "2", "hi")
    assert out.returncode != 0 and time.monotonic() - t0 < 20
    assert "waiting up to 2 s" in out.stderr and "not SERVING" in out.stderr
    assert "Traceback" not in out.stderr


def _certificates(folder):
    """A CA, a server certificate for 127.0.0.1 / localhost and a client certificate (PEM)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    def name(cn):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    now = datetime.datetime.now(datetime.timezone.utc)

    def issue(subject, key, issuer, issuer_key, *, ca=False, san=None):
        b = (x509.CertificateBuilder().subject_name(name(subject)).issuer_name(name(issuer))
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(minutes=1))
             .not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if san:
            b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return b.sign(issuer_key, hashes.SHA256())

    def write(stem, cert, key):
        (folder / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (folder / f"{stem}.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()))

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = issue("blink test CA", ca_key, "blink test CA", ca_key, ca=True)
    write("ca", ca, ca_key)
    for stem in ("server", "client"):
        key = ec.generate_private_key(ec.SECP256R1())
        san = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        write(stem, issue(f"blink {stem}", key, "blink test CA", ca_key,
                          san=san if stem == "server" else None), key)
    return {f.name: f for f in folder.iterdir()}


def test_mutual_tls_and_bearer_token(checkpoints, make_stack, tmp_path):
    pytest.importorskip("cryptography", reason="the test extra (cryptography) is not installed")
    from blink.client.sdk import Tls
    pem = _certificates(tmp_path)
    (tmp_path / "token").write_text("s3cret-token\n")
    stack = make_stack(checkpoints["llama"], start=False, frontend_args=[
        "--tls-cert", str(pem["server.pem"]), "--tls-key", str(pem["server.key"]),
        "--tls-client-ca", str(pem["ca.pem"]), "--auth-token-file", str(tmp_path / "token"),
        "--max-connection-age", "600"])
    stack.start_engine()
    stack.start_frontend()
    ca = pem["ca.pem"].read_bytes()
    mutual = Tls(ca=ca, cert=pem["client.pem"].read_bytes(), key=pem["client.key"].read_bytes())
    with BlinkClient(stack.target, tls=mutual, token="s3cret-token") as client:
        client.wait_ready(60)
        assert client.generate("over TLS", exact(3)).completion_tokens == 3
    with BlinkClient(stack.target, tls=mutual) as client:
        assert client.health() == "SERVING"  # probes need no token
        with pytest.raises(BlinkError, match="UNAUTHENTICATED"):
            client.generate("no token", Sampling(max_tokens=3))
    with BlinkClient(stack.target, tls=mutual, token="wrong") as client:
        with pytest.raises(BlinkError, match="UNAUTHENTICATED"):
            client.model_info()
    for tls in (Tls(ca=ca), None):  # no client certificate; no TLS at all
        with BlinkClient(stack.target, tls=tls, token="s3cret-token") as client:
            with pytest.raises(BlinkError, match="UNAVAILABLE"):
                client.model_info(timeout=5)
    # the client commands take the same (they could reach no TLS or token server)
    flags = ["--target", stack.target, "--tls-ca", str(pem["ca.pem"]), "--tls-cert",
             str(pem["client.pem"]), "--tls-key", str(pem["client.key"]), "--token-file",
             str(tmp_path / "token")]
    assert json.loads(blink("stats", *flags).stdout)["engine_alive"]
    out = blink("generate", "over TLS", "--max-tokens", "3", "--ignore-eos", *flags)
    assert out.returncode == 0 and "3 generated tokens" in out.stderr, out.stderr
    out = blink("info", *flags[:-2])  # no token
    assert out.returncode == 1 and "UNAUTHENTICATED" in out.stderr


def test_auth_and_tls_files_that_cannot_work_are_refused_at_start(checkpoints, tmp_path):
    """A token gRPC metadata cannot carry (two lines, not ASCII, past 4,096 characters) locked
    every client out of a server that started as if nothing were wrong; a key that is not the
    certificate's failed the bind, which read as a port in use; an empty client CA refused
    every client. Each is now one line at start, naming the file."""
    pytest.importorskip("cryptography", reason="the test extra (cryptography) is not installed")
    pem = _certificates(tmp_path)
    files = {"two lines": b"tok1\ntok2\n", "not ascii": b"s3cr\xc3\xa9t\n",
             "too long": b"x" * 5000, "empty CA": b""}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    tls = ["--tls-cert", str(pem["server.pem"]), "--tls-key", str(pem["server.key"])]
    for flags, says in (
            (["--auth-token-file", str(tmp_path / "two lines")], "one line of printable ASCII"),
            (["--auth-token-file", str(tmp_path / "not ascii")], "one line of printable ASCII"),
            (["--auth-token-file", str(tmp_path / "too long")], "at most 4096 characters"),
            (["--tls-cert", str(pem["server.pem"]), "--tls-key", str(pem["client.key"])],
             "its unencrypted PEM private key"),
            ([*tls, "--tls-client-ca", str(tmp_path / "empty CA")], "no PEM certificate"),
            ([*tls, "--tls-client-ca", str(tmp_path / "two lines")], "no PEM certificate"),
            ([*tls, "--tls-client-ca", str(pem["server.key"])], "no PEM certificate")):
        out = blink("frontend", "--model", str(checkpoints["llama"]), "--ring-name",
                    f"blink-test-refused-{os.getpid()}", "--port", "0", *flags, timeout=30)
        assert out.returncode != 0 and says in out.stderr, (flags, out.stderr)
        assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    # what gRPC serves is not refused: a client certificate pinned as the client "CA" (not a
    # CA's), an RSA-1024 certificate (which Python's default security level refuses)
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import NameOID

    import datetime
    import types

    from blink.client.cli import _check_tls_files
    key = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "legacy")])
    legacy = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
              .public_key(key.public_key()).serial_number(1)
              .not_valid_before(datetime.datetime(2020, 1, 1))
              .not_valid_after(datetime.datetime(2100, 1, 1)).sign(key, hashes.SHA256()))
    (tmp_path / "legacy.pem").write_bytes(legacy.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "legacy.key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
        serialization.NoEncryption()))
    for cert, key_file, client_ca in ((pem["server.pem"], pem["server.key"], pem["client.pem"]),
                                      (tmp_path / "legacy.pem", tmp_path / "legacy.key", None)):
        _check_tls_files(types.SimpleNamespace(tls_cert=cert, tls_key=key_file,
                                               tls_client_ca=client_ca))


def test_a_bearer_token_without_tls_on_a_public_address_is_warned_of(checkpoints, tmp_path):
    """--auth-token-file on 0.0.0.0 without TLS: the front end says, once, that the token
    travels in clear text (it said nothing)."""
    (tmp_path / "token").write_text("s3cret\n")
    log = tmp_path / "frontend.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "blink.client.cli", "frontend", "--model",
             str(checkpoints["llama"]), "--ring-name", f"blink-test-clear-{os.getpid()}",
             "--host", "0.0.0.0", "--port", "0", "--auth-token-file", str(tmp_path / "token"),
             "--ready-file", str(tmp_path / "port")], stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: (tmp_path / "port").exists() and "clear text" in log.read_text(), 30,
                 f"the warning ({log.read_text()[-500:]})")
        (line,) = [line for line in log.read_text().splitlines() if "clear text" in line]
        assert "WARNING" in line and "--tls-cert" in line, line
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


def test_every_worker_s_metrics_port_is_checked_at_start(checkpoints, tmp_path):
    """Worker i serves metrics on --metrics-port + i: a taken one, or one past 65535, is one
    line at start (that worker failed and was restarted for ever, its share of the slots
    unused, while serve said it was serving)."""
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for first, says in ((port - 1, "cannot serve metrics on 127.0.0.1:"),
                            (65535, "needs the ports up to 65536")):
            out = blink("serve", "--model", str(checkpoints["llama"]), "--port", "0",
                        "--engine", "cpu", "--workers", "2", "--slots", "4", "--metrics-port",
                        str(first), timeout=30)
            assert out.returncode != 0 and says in out.stderr, out.stderr
            assert "Traceback" not in out.stderr


def test_bearer_scheme_in_any_case_and_every_authorization_header_checked(checkpoints,
                                                                          make_stack, tmp_path):
    """The scheme's name is case-insensitive (RFC 7235: "bearer" was refused); of two
    authorization headers, both must carry the token (the last one alone decided). Each
    refusal logs a line with its peer, and a refused Generate counts in request_failure_total
    (a client guessing tokens left no trace)."""
    from blink.v1 import blink_pb2, blink_pb2_grpc
    (tmp_path / "token").write_text("s3cret\n")
    stack = make_stack(checkpoints["llama"], frontend_args=[
        "--auth-token-file", str(tmp_path / "token"), "--metrics-port", "0"])
    with grpc.insecure_channel(stack.target) as channel:
        info = blink_pb2_grpc.BlinkStub(channel).GetModelInfo
        assert info(blink_pb2.GetModelInfoRequest(), timeout=10,
                    metadata=[("authorization", "bearer s3cret")]).name
        for headers in ([("authorization", "Bearer wrong"), ("authorization", "Bearer s3cret")],
                        [("authorization", "Bearer s3cret"), ("authorization", "Bearer wrong")],
                        [("authorization", "Basic s3cret")]):
            with pytest.raises(grpc.RpcError) as err:
                info(blink_pb2.GetModelInfoRequest(), timeout=10, metadata=headers)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, headers
    with pytest.raises(ValueError, match="printable ASCII") as err:  # read with its newline
        BlinkClient(stack.target, token="s3cret\n")
    assert "character 7 of 7" in str(err.value) and "s3cret" not in str(err.value)
    with BlinkClient(stack.target, token="guess") as client:
        with pytest.raises(BlinkError, match="UNAUTHENTICATED"):
            client.generate("hi", exact(2))
    log = next(tmp_path.glob("frontend-*.log")).read_text()
    assert "in clear text" not in log  # (on 127.0.0.1)
    port = int(re.search(r"metrics on http://[\d.]+:(\d+)/metrics", log).group(1))
    assert scrape(port).get(("blink:request_failure_total", (("code", "UNAUTHENTICATED"),))) == 1
    assert len(re.findall(r"refused /blink.v1.Blink/\w+ from \S+, UNAUTHENTICATED", log)) == 4


def test_an_aged_connection_s_streams_run_to_their_end(long_checkpoint, make_stack):
    """--max-connection-age 1: a stream of about 3 s on a connection that ages under it runs
    to its end (it was cut after a fixed 300 s, so a long generation died mid-stream), and new
    requests still work; with --max-connection-age-grace 1 the stream is cut, as asked."""
    for grace, cut in ((), False), (("--max-connection-age-grace", "1"), True):
        stack = make_stack(long_checkpoint, engine_args=["--engine", "synthetic",
                                                         "--synthetic-step-ms", "10"],
                           frontend_args=["--max-connection-age", "1", *grace])
        with BlinkClient(stack.target) as client:
            if cut:
                with pytest.raises(BlinkError, match="UNAVAILABLE"):
                    client.generate("a long one", exact(300))
            else:
                assert client.generate("a long one", exact(300)).completion_tokens == 300
            assert client.generate("and after", exact(3)).completion_tokens == 3
        stack.stop()


def test_idle_cpu_engine_sleeps(checkpoints, make_stack):
    """An idle CPU engine backs off its polling (it used 28% of a core at a fixed 0.2 ms)."""
    stack = make_stack(checkpoints["llama"])
    stack.wait_serving()
    time.sleep(0.5)
    before, t0 = process_tree_cpu(stack.engine.pid), time.monotonic()
    time.sleep(3)
    share = (process_tree_cpu(stack.engine.pid) - before) / (time.monotonic() - t0)
    assert share < 0.08, f"idle engine used {share:.0%} of a core"
    with BlinkClient(stack.target) as client:  # and still answers at once
        done = client.generate("wake up", exact(2))
        assert done.completion_tokens == 2 and done.time_to_first_token_s < 1


def test_max_model_len_above_the_model_is_said(checkpoints, make_stack):
    stack = make_stack(checkpoints["llama"], engine_args=["--max-model-len", "100000"])
    stack.wait_serving()
    with BlinkClient(stack.target) as client:
        assert client.model_info().context_length == 512
    assert "--max-model-len 100000 exceeds llama's context of 512 tokens: serving 512" \
        in stack.logs()


def test_two_servers_on_port_0_do_not_share_a_ring(checkpoints, tmp_path):
    """`--port 0` used to name the ring '...-0' for every such server: the second one's engine
    took over the first one's ring."""
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    a = Serve(checkpoints["llama"], tmp_path / "a")
    try:
        b = Serve(checkpoints["llama"], tmp_path / "b")
        try:
            for serve in (a, b):
                with BlinkClient(serve.target) as client:
                    assert client.generate("hello", exact(3)).completion_tokens == 3
                    assert client.stats()["engine_attachments"] == 1
        finally:
            assert b.stop() == 0
    finally:
        assert a.stop() == 0


def test_a_restarted_worker_keeps_its_metrics_port(checkpoints, make_stack, tmp_path):
    """`blink frontend --workers 3 --metrics-port 0`: the ports are picked once, at start, as
    a run (worker i on the first + i, as for a given port), so a worker that dies is started
    again on the port it had (it took another free one, and a scrape configuration naming the
    old one lost that worker without a word)."""
    stack = make_stack(checkpoints["llama"], frontend_args=["--workers", "3",
                                                            "--metrics-port", "0"])
    log = next(tmp_path.glob("frontend-*.log"))

    def ports() -> list[int]:  # as each worker logged its own, in order
        return [int(p) for p in re.findall(r"metrics on http://[\d.]+:(\d+)/metrics",
                                           log.read_text())]
    first = wait_for(lambda: len(ports()) == 3 and ports(), 30, "three metrics ports")
    workers = [pid for pid in children(stack.frontend.pid)  # multiprocessing's spawned ones
               if "spawn_main" in open(f"/proc/{pid}/cmdline").read()]
    os.kill(workers[0], signal.SIGKILL)
    wait_for(lambda: len(ports()) == 4, 30, "the worker restarted")
    assert ports()[3] in first, (first, ports())
    for port in first:
        assert ("blink:engine_alive", ()) in scrape(port)
    assert sorted(first) == list(range(min(first), min(first) + 3))


@pytest.mark.parametrize("command", ["serve", "frontend"])
def test_front_end_workers_share_port_and_ring(checkpoints, make_stack, tmp_path, command):
    """--workers 3: three processes on one port, each with its share of the ring's slots;
    requests from many connections land on all of them and all finish; SIGTERM drains all."""
    import asyncio
    import re

    from blink.client.sdk import AsyncBlinkClient
    if command == "serve":
        serve = Serve(checkpoints["llama"], tmp_path, "--workers", "3", "--slots", "12")
        target, proc, log = serve.target, serve.proc, serve.log_path
    else:
        stack = make_stack(checkpoints["llama"], engine_args=["--slots", "12"],
                           frontend_args=["--workers", "3"])
        stack.wait_serving()
        target, proc = stack.target, stack.frontend
        log = next(f for f in tmp_path.glob("frontend-*.log"))

    wait_for(lambda: len(re.findall(r"worker \d/3 listening", log.read_text())) == 3, 30,
             "three workers listening")

    async def many():
        # a connection each (gRPC shares one between same-target channels of a process)
        clients = [AsyncBlinkClient(target, options=[("grpc.use_local_subchannel_pool", 1)])
                   for _ in range(24)]
        try:
            return await asyncio.gather(*(c.generate(f"request {i}", Sampling(
                max_tokens=4, temperature=0.0, ignore_eos=True))
                                          for i, c in enumerate(clients)))
        finally:
            for c in clients:
                await c.close()
    done = asyncio.run(many())
    assert all(d.completion_tokens == 4 for d in done)
    assert len({d.request_id for d in done}) == 24
    text = log.read_text()
    assert {m for m in re.findall(r"worker (\d)/3", text)} == {"1", "2", "3"}
    served = {m for m in re.findall(r"request (\d+)\D", text)}  # request ids end in the worker
    assert len({int(i) % 3 for i in served}) >= 2  # more than one worker answered
    # a worker that dies is started again by its parent
    workers = [pid for pid in children(proc.pid)  # multiprocessing's spawned processes
               if "spawn_main" in open(f"/proc/{pid}/cmdline").read()]
    assert len(workers) == 2, workers
    os.kill(workers[0], signal.SIGKILL)
    wait_for(lambda: "exited with -9 after" in log.read_text()
             and len(re.findall(r"worker \d/3 listening", log.read_text())) == 4, 30,
             "the worker restarted")
    assert all(d.completion_tokens == 4 for d in asyncio.run(many()))
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0


# -- systemd's notify protocol (a Type=notify engine unit with WatchdogSec=) ---------------------

class NotifySocket:
    """A stand-in for systemd's notify socket: a datagram socket in tmp_path; .wait(state)
    returns once that message came (the messages kept, in order, in .got)."""

    def __init__(self, path: Path):
        self.path, self.got = str(path), []
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.2)

    def receive(self) -> None:
        """Keeps the next message, if one comes within 0.2 s."""
        try:
            self.got.append(self.sock.recv(4096).decode())
        except TimeoutError:
            pass

    def wait(self, state: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while state not in self.got:
            assert time.monotonic() < deadline, f"no {state} within {timeout} s: {self.got}"
            self.receive()

    def close(self) -> None:
        self.sock.close()


def test_systemd_watchdog_pings_only_while_the_heartbeat_moves(tmp_path):
    from blink.ring.lifecycle import SystemdNotify
    notify = NotifySocket(tmp_path / "notify")
    try:
        systemd = SystemdNotify({"NOTIFY_SOCKET": notify.path, "WATCHDOG_USEC": "400000"})
        assert systemd.watchdog_s == 0.4
        systemd.ready()
        beats = iter([1, 1, 1, 2])
        systemd.keepalive(lambda: next(beats))  # the first look: a ping
        systemd.keepalive(lambda: next(beats))  # too soon to look again: not read
        time.sleep(0.11)
        systemd.keepalive(lambda: next(beats))  # read, unmoved: no ping
        systemd.keepalive(lambda: next(beats))  # unmoved again
        systemd.keepalive(lambda: next(beats))  # moved: a ping
        systemd.stopping()
        notify.wait("STOPPING=1", 5)
        assert notify.got == ["READY=1", "WATCHDOG=1", "WATCHDOG=1", "STOPPING=1"]
        # another process's watchdog (a child inherits the variables), and no unit at all
        assert SystemdNotify({"NOTIFY_SOCKET": notify.path, "WATCHDOG_USEC": "400000",
                              "WATCHDOG_PID": "1"}).watchdog_s is None
        SystemdNotify({}).ready()  # nothing to send to: nothing happens
    finally:
        notify.close()


def test_a_heartbeat_that_stands_still_gets_no_watchdog_ping(tmp_path):
    """A hung scheduler's heartbeat stays: after the first look, each look due (every 10 ms
    under a 40 ms watchdog) reads it unmoved and pings nothing, so systemd restarts the engine
    (a ping for each look due kept a hung engine alive)."""
    from blink.ring.lifecycle import SystemdNotify
    notify = NotifySocket(tmp_path / "notify")
    try:
        systemd = SystemdNotify({"NOTIFY_SOCKET": notify.path, "WATCHDOG_USEC": "40000"})
        for _ in range(8):
            systemd.keepalive(lambda: 7)
            time.sleep(0.015)
        systemd.stopping()
        notify.wait("STOPPING=1", 5)
        assert notify.got == ["WATCHDOG=1", "STOPPING=1"]
    finally:
        notify.close()


def test_systemd_notify_reaches_an_abstract_socket_and_outlives_a_gone_one(tmp_path, caplog):
    """NOTIFY_SOCKET=@name is the abstract socket "\\0name" (sd_notify(3)); a socket that is
    gone (systemd restarted) is a warning, and the engine serves on."""
    import secrets

    from blink.ring.lifecycle import SystemdNotify
    name = f"blink-test-notify-{secrets.token_hex(4)}"
    notify = NotifySocket("\0" + name)
    try:
        SystemdNotify({"NOTIFY_SOCKET": "@" + name}).ready()
        notify.wait("READY=1", 5)
    finally:
        notify.close()
    with caplog.at_level("WARNING", logger="blink.engine"):
        SystemdNotify({"NOTIFY_SOCKET": str(tmp_path / "gone")}).stopping()
    assert f"systemd notification STOPPING=1 not sent to {tmp_path / 'gone'}" in caplog.text


def test_a_long_cpu_step_keeps_pinging_the_watchdog_while_it_beats(tmp_path):
    """A CPU engine's forward pass beats the ring's heartbeat layer by layer; the watchdog is
    pinged with it (it was pinged once a step: a prefill of seconds under WatchdogSec= went
    unpinged while its heartbeat moved, and systemd would kill an engine making progress)."""
    import types

    import numpy as np

    from blink.gpu_engine.reference_engine import ReferenceEngine
    from blink.ring.lifecycle import SystemdNotify
    notify = NotifySocket(tmp_path / "notify")
    try:
        ring = types.SimpleNamespace(header={"heartbeat": 0})
        ring.beat = lambda: ring.header.update(heartbeat=ring.header["heartbeat"] + 1)

        def forward(batch, on_progress):  # a 0.8-s pass over 16 layers
            for _ in range(16):
                time.sleep(0.05)
                on_progress()
            return np.zeros((0, 8), np.float32)
        engine = ReferenceEngine.__new__(ReferenceEngine)
        engine.ring, engine.model = ring, types.SimpleNamespace(forward=forward)
        # (at most one ping a 0.1 s: the socket's queue, unread meanwhile, holds them all)
        engine.systemd = SystemdNotify({"NOTIFY_SOCKET": notify.path, "WATCHDOG_USEC": "400000"})
        assert engine._forward_sample(None, []) == []
        for _ in range(12):
            notify.receive()
        assert ring.header["heartbeat"] == 16
        assert notify.got.count("WATCHDOG=1") >= 4, notify.got
    finally:
        notify.close()


def test_an_engine_unit_is_told_ready_alive_and_stopping(checkpoints, tmp_path):
    """`blink engine` under a Type=notify unit with WatchdogSec=: READY=1 once it serves,
    WATCHDOG=1 a few times a period while its loop beats, STOPPING=1 on SIGTERM, exit 0. (A
    hung scheduler stops the heartbeat and with it the pings: systemd then restarts it.)"""
    notify = NotifySocket(tmp_path / "notify")
    env = {**os.environ, "NOTIFY_SOCKET": notify.path, "WATCHDOG_USEC": "400000"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "blink.client.cli", "engine", "--engine", "cpu", "--model",
         str(checkpoints["llama"]), "--ring-name", f"blink-notify-{os.getpid()}"],
        env=env, stderr=subprocess.DEVNULL)
    try:
        notify.wait("READY=1")
        ready_at = time.monotonic()
        while notify.got.count("WATCHDOG=1") < 5:
            assert time.monotonic() - ready_at < 10, notify.got
            notify.receive()
        assert time.monotonic() - ready_at < 3  # four pings a 0.4-s period at most: ~0.5 s
        proc.send_signal(signal.SIGTERM)
        notify.wait("STOPPING=1", 10)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        notify.close()
