"""CPU interference for the benchmark: N busy processes pinned to the server's cores.

Each hog is a separate Python process spinning in a loop (pure CPU), or, with memory=True,
copying a 64 MiB NumPy buffer back and forth (the memory bandwidth a busy neighbour eats too).
Hog i is pinned to cores[i % len(cores)], so N = 2 x len(cores) puts two on every core. They
are started before a run and killed after it; a context manager makes sure of the killing.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys

_SPIN = "while True:\n    pass\n"
_COPY = ("import numpy as np\n"
         "a = np.ones(8 << 20); b = np.empty_like(a)\n"
         "while True:\n    np.copyto(b, a); np.copyto(a, b)\n")


def with_parent(sig: int, then=None):
    """A preexec_fn: the child gets `sig` when the process that started it dies, however it
    ends (Linux prctl PR_SET_PDEATHSIG: a benchmark killed with SIGKILL leaves no hog or
    server behind); then(): more of the child's set-up."""
    def preexec() -> None:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, sig)
        if then is not None:
            then()
    return preexec


class CpuHog:
    def __init__(self, count: int, cores: list[int], *, memory: bool = False):
        if count < 0:
            raise ValueError("the hog count must be >= 0")
        if count and not cores:
            raise ValueError("no cores to pin the hogs to")
        self.count, self.cores, self.memory = count, sorted(cores), memory
        self.procs: list[subprocess.Popen] = []

    def start(self) -> None:
        code = _COPY if self.memory else _SPIN
        for i in range(self.count):
            core = self.cores[i % len(self.cores)]
            self.procs.append(subprocess.Popen(
                [sys.executable, "-c", code], stdin=subprocess.DEVNULL,
                preexec_fn=with_parent(signal.SIGKILL,
                                       lambda c=core: os.sched_setaffinity(0, {c}))))

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
        for proc in self.procs:
            proc.wait()
        self.procs.clear()

    def __enter__(self) -> CpuHog:
        try:
            self.start()
        except BaseException:  # (a core not ours, no process left): the started ones go now
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def describe(self) -> str:
        kind = "memory-copy" if self.memory else "spinning"
        return f"{self.count} {kind} processes on cores {self.cores}" if self.count else "none"
