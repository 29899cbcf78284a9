"""Shared fixtures: tiny checkpoints of each architecture and a real serving stack
(engine process + front-end process on a real port, talking through a real shm ring)."""
from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from blink.gpu_engine.demo_model import write_random_checkpoint
from blink.ring.shm import shm_path

ARCHITECTURES = ("llama", "qwen2", "qwen3")

# Small enough for NumPy on 2 cores, large enough to have GQA and several KV blocks per sequence.
TINY_SHAPES = dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, max_position_embeddings=512)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {arch: write_random_checkpoint(root / arch, architecture=arch, seed=i + 1,
                                          **TINY_SHAPES)
            for i, arch in enumerate(ARCHITECTURES)}


@pytest.fixture(scope="session")
def long_checkpoint(tmp_path_factory) -> Path:
    """A llama checkpoint with a long context: streams that run for seconds on a CPU, for
    cancel, deadline, slot-exhaustion and engine-death tests."""
    shapes = dict(TINY_SHAPES, max_position_embeddings=16384)
    return write_random_checkpoint(tmp_path_factory.mktemp("long") / "long", seed=9, **shapes)


def children(pid: int) -> list[int]:
    """The child processes of `pid` (e.g. the engine `blink serve` started)."""
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
        except FileNotFoundError:  # a thread that ended since the listing
            continue
    return out


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "blink.client.cli", *args]


class BlinkStack:
    """An engine process and a front-end process on one host, as an operator runs them."""

    def __init__(self, model_dir: Path, workdir: Path, engine_args=(), frontend_args=()):
        self.model_dir = model_dir
        self.workdir = workdir
        self.ring_name = f"blink-test-{secrets.token_hex(6)}"
        self.engine_args = list(engine_args)
        self.frontend_args = list(frontend_args)
        self.engine: subprocess.Popen | None = None
        self.frontend: subprocess.Popen | None = None
        self.port: int | None = None
        self._logs = []

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.workdir / f"{name}-{len(self._logs)}.log", "w")
        self._logs.append(log)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)

    def start_engine(self) -> None:
        self.engine = self._spawn("engine", _cli(
            "engine", "--model", str(self.model_dir), "--ring-name", self.ring_name,
            *self.engine_args))

    def start_frontend(self) -> None:
        ready = self.workdir / f"ready-{secrets.token_hex(4)}"
        self.frontend = self._spawn("frontend", _cli(
            "frontend", "--model", str(self.model_dir), "--ring-name", self.ring_name,
            "--port", "0", "--ready-file", str(ready), *self.frontend_args))
        deadline = time.monotonic() + 60
        while not (ready.exists() and ready.read_text()):
            if self.frontend.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"front end did not start:\n{self.logs()}")
            time.sleep(0.05)
        self.port = int(ready.read_text())

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def wait_serving(self, timeout: float = 60) -> None:
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(self.target) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while time.monotonic() < deadline:
                try:
                    r = stub.Check(health_pb2.HealthCheckRequest(service="blink.v1.Blink"),
                                   timeout=2)
                    if r.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                if self.engine is not None and self.engine.poll() is not None:
                    raise RuntimeError(f"engine died:\n{self.logs()}")
                time.sleep(0.05)
        raise RuntimeError(f"stack not serving after {timeout}s:\n{self.logs()}")

    def kill_engine(self) -> None:
        self.engine.send_signal(signal.SIGKILL)
        self.engine.wait()

    def logs(self) -> str:
        out = []
        for f in sorted(self.workdir.glob("*.log")):
            out.append(f"--- {f.name}\n{f.read_text()[-4000:]}")
        return "\n".join(out)

    def stop(self) -> None:
        for proc in (self.frontend, self.engine):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in (self.frontend, self.engine):
            if proc is not None:
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for log in self._logs:
            log.close()
        shm_path(self.ring_name).unlink(missing_ok=True)


@pytest.fixture
def make_stack(tmp_path):
    stacks = []

    def make(model_dir: Path, *, engine_args=(), frontend_args=(), start=True) -> BlinkStack:
        stack = BlinkStack(model_dir, tmp_path, engine_args, frontend_args)
        stacks.append(stack)
        if start:
            stack.start_engine()
            stack.start_frontend()
            stack.wait_serving()
        return stack

    yield make
    for stack in stacks:
        stack.stop()
