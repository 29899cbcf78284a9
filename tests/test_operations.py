"""Operating a server (issue 9): liveness that never strands a live engine, failing fast and
loudly, a taken port, and the drain on SIGTERM. Real processes, real ports, real rings."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from conftest import children

from blink.client.sdk import BlinkClient, BlinkError, Sampling


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

    def __init__(self, model, tmp_path, *args):
        self.ready, self.log_path = tmp_path / "port", tmp_path / "serve.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "blink.client.cli", "serve", "--model", str(model),
             "--port", "0", "--ready-file", str(self.ready), "--engine", "cpu", *args],
            stdout=self.log, stderr=subprocess.STDOUT)
        wait_for(lambda: self.proc.poll() is not None or (self.ready.exists()
                                                          and self.ready.read_text()),
                 60, "the port")
        assert self.proc.poll() is None, self.log_path.read_text()
        self.target = f"127.0.0.1:{self.ready.read_text()}"
        with BlinkClient(self.target) as client:
            client.wait_ready(60)

    def engine_pid(self) -> int:
        (pid,) = wait_for(lambda: children(self.proc.pid), 10, "the engine process")
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
        assert client.generate("after the stall", Sampling(max_tokens=4)).completion_tokens == 4
        assert client.stats()["engine_attachments"] == 2


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
            assert client.generate("restarted", Sampling(max_tokens=3)).completion_tokens == 3
        assert "engine stuck" in serve.log_path.read_text()
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


@pytest.fixture
def broken_models(checkpoints, tmp_path):
    good = checkpoints["llama"]
    no_tok, no_weights = tmp_path / "no-tokenizer", tmp_path / "no-weights"
    shutil.copytree(good, no_tok)
    (no_tok / "tokenizer.json").unlink()
    shutil.copytree(good, no_weights)
    for f in no_weights.glob("*.safetensors"):
        f.unlink()
    return no_tok, no_weights


def test_fail_fast_with_one_line(checkpoints, broken_models):
    """Each of these used to hang, restart the engine forever, or print a traceback."""
    no_tok, no_weights = broken_models
    for args, message in (
            (["serve", "--model", str(no_tok), "--port", "0"], "no tokenizer.json"),
            (["serve", "--model", str(no_weights), "--port", "0"], "no *.safetensors"),
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
