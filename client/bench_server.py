"""Servers for the benchmarks: an engine and a front end started as two processes on this host,
torn down with SIGTERM, and model folders in real shapes without weight files."""
from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

from blink.client.bench_hog import with_parent
from blink.client.sdk import BlinkClient
from blink.ring.shm import shm_path


def shape_folder(name: str, root: Path, max_len: int) -> Path:
    """A model folder in `name`'s dimensions without weight files (config, tokenizer)."""
    from blink.gpu_engine.bench_decode import SHAPES
    from blink.gpu_engine.demo_model import write_random_checkpoint
    cfg = SHAPES[name]
    return write_random_checkpoint(
        root / name, architecture=cfg.architecture, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_layers=cfg.num_layers,
        num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        vocab_size=cfg.vocab_size, max_position_embeddings=max_len, rope_theta=cfg.rope_theta,
        rope_scaling=cfg.rope_scaling, tie_word_embeddings=cfg.tie_word_embeddings,
        write_weights=False)


def process_tree_cpu(pid: int) -> float:
    """User + system CPU seconds of a live process and its live descendants (0 once gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        for task in os.listdir(f"/proc/{pid}/task"):
            children = Path(f"/proc/{pid}/task/{task}/children").read_text().split()
            total += sum(process_tree_cpu(int(c)) for c in children)
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    return total


class Server:
    """An engine and a front end as two processes, started with the given engine flags.
    cores: the CPU cores both may run on (None: all); nice: their niceness (as `nice -n N blink
    serve` would start them; below 0 needs root or CAP_SYS_NICE); logs go to
    workdir/{name}-*.log."""

    def __init__(self, model_dir: Path, workdir: Path, engine_flags: list[str], *,
                 name: str = "server", cores: set[int] | None = None,
                 frontend_flags: list[str] = (), nice: int = 0):
        self.ring = f"blink-bench-{secrets.token_hex(4)}"
        self.cores = cores
        cli = [sys.executable, "-m", "blink.client.cli"]
        common = ["--model", str(model_dir), "--ring-name", self.ring]
        ready = workdir / f"ready-{self.ring}"
        self.logs = [open(workdir / f"{name}-{n}.log", "w") for n in ("engine", "frontend")]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        def pin() -> None:  # in each child before exec
            if cores:
                os.sched_setaffinity(0, cores)
            if nice:
                os.nice(nice)
        # SIGTERM when the benchmark dies: each drains, the engine removes its ring
        self.engine = subprocess.Popen([*cli, "engine", *common, *engine_flags],
                                       stdout=self.logs[0], stderr=subprocess.STDOUT, env=env,
                                       preexec_fn=with_parent(signal.SIGTERM, pin))
        self.frontend = subprocess.Popen(
            [*cli, "frontend", *common, "--port", "0", "--ready-file", str(ready),
             "--queue-timeout", "600", "--engine-timeout", "30", *frontend_flags],
            stdout=self.logs[1], stderr=subprocess.STDOUT, env=env,
            preexec_fn=with_parent(signal.SIGTERM, pin))
        self.ready = ready
        try:  # (either failing, or a Ctrl-C meanwhile, stops the other too)
            deadline = time.monotonic() + 600
            while not (ready.exists() and ready.read_text()):
                self._check_alive(deadline)
                time.sleep(0.1)
            self.target = f"127.0.0.1:{int(ready.read_text())}"
            with BlinkClient(self.target) as client:
                while client.health() != "SERVING":
                    self._check_alive(deadline)
                    time.sleep(0.2)
        except BaseException:
            self.stop()
            raise

    def died(self) -> str | None:
        """Which of its processes has exited (and how), if one has: a run it served is void."""
        for what, proc in (("engine", self.engine), ("front end", self.frontend)):
            if proc.poll() is not None:
                return f"its {what} exited (status {proc.returncode})"
        return None

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time so far of the engine and of the front end (with its worker processes)."""
        return {"engine": process_tree_cpu(self.engine.pid),
                "frontend": process_tree_cpu(self.frontend.pid)}

    def _check_alive(self, deadline: float) -> None:
        for proc, log in zip((self.engine, self.frontend), self.logs):
            if proc.poll() is not None or time.monotonic() > deadline:
                log.flush()
                raise RuntimeError(f"server did not come up; {log.name}:\n"
                                   + Path(log.name).read_text()[-3000:])

    def stop(self) -> None:
        for proc in (self.frontend, self.engine):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in (self.frontend, self.engine):
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        for log in self.logs:
            log.close()
        # what a killed engine leaves (a stopped one removed its ring itself)
        shm_path(self.ring).unlink(missing_ok=True)
        self.ready.unlink(missing_ok=True)
