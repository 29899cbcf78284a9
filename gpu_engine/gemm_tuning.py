"""Start-up tuning of the forward graphs' cuBLAS GEMMs.

cuBLAS picks a GEMM's kernel by a heuristic, and for some of the bucket sizes the forward graphs
use it picks a slow one (docs/performance.md, *GEMM tuning*: Llama-3.1-8B's gate|up projection
at 448 rows ran 264 µs where another of cuBLASLt's candidates ran 147). So before a bucket's
graph is captured, its forward pass is recorded (Cublas.recording: the GEMMs' shapes and
operands; the other kernels run as in the eager pass, on an empty batch), and each GEMM shape
not yet known is timed with cuBLAS's own choice (GemmEx) and with each algorithm cuBLASLt's
heuristic offers, on the model's own weights (every layer's, in order, as the step reads them,
so no run finds its weights in L2). The fastest replaces cuBLAS's own when at least MARGIN
faster.

The timing runs beside what the live engine's graphs run beside (`beside`: the scheduler
kernel's held SM). Choices are cached on disk per GPU model, cuBLAS version, workspace size and
SM count target (an algorithm may be stored and restored for the same cuBLAS version). Tuning
holds a lock on the cache and reads it again once it has the lock, so engines starting together
on one machine take each other's choices rather than time the same shapes twice: every engine
there runs a shape with the same kernel, and the same bits from the same inputs.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .cublas import R_32F, Cublas, GemmCall, GemmShape, LtAlgo

log = logging.getLogger(__name__)

# A candidate replaces cuBLAS's own choice only when this much faster: timing noise must not
# flip a choice between two equally good kernels. (At 2%, with each algorithm timed in turn
# rather than round-robin, the choices for compute-bound 512- and 2,048-row chunks made 8B
# prefill 1-2% slower; most likely the first algorithm timed met a colder clock.)
MARGIN = 0.03
# Part of the cache's file name: a change to how choices are made starts a new cache.
METHOD_VERSION = 1
ROUNDS = 5        # each algorithm's graph replayed once a round; its fastest replay counts
WARMUP_S = 0.02   # of GPU time before the first round


@dataclass
class Choice:
    """The outcome of tuning one shape: algo None keeps cuBLAS's own (GemmEx) choice, or for an
    FP8 shape cuBLASLt's heuristic's first."""
    algo: LtAlgo | None
    default_us: float   # cuBLAS's own choice, per call
    best_us: float      # the kept one, per call
    described: str = ""

    def to_json(self) -> dict:
        return {"algo": self.algo.to_hex() if self.algo is not None else None,
                "default_us": round(self.default_us, 2), "best_us": round(self.best_us, 2),
                "described": self.described}

    @classmethod
    def from_json(cls, d: dict) -> "Choice":
        algo = LtAlgo.from_hex(d["algo"]) if d.get("algo") else None
        return cls(algo, float(d["default_us"]), float(d["best_us"]), d.get("described", ""))


def choose(default_us: float, candidate_us: list[float], margin: float | None = None
           ) -> int | None:
    """Index of the candidate to use instead of the default, or None: the fastest candidate,
    when it is at least `margin` (default MARGIN) faster than the default."""
    margin = MARGIN if margin is None else margin
    if not candidate_us:
        return None
    best = min(range(len(candidate_us)), key=candidate_us.__getitem__)
    return best if candidate_us[best] <= default_us * (1 - margin) else None


class ChoiceCache:
    """shape key -> Choice, in one JSON file, written whole (by rename) and merged with what
    other processes wrote since; `locked()` serializes the processes that tune."""

    def __init__(self, path: Path | None):
        self.path = path

    def load(self) -> dict[str, Choice]:
        """The cached choices; none when the file is missing, unreadable or not ours (then
        the shapes are timed again and the file rewritten)."""
        if self.path is None:
            return {}
        try:
            raw = json.loads(self.path.read_text())
            if not isinstance(raw, dict):
                return {}
            return {key: Choice.from_json(d) for key, d in raw.items()}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            log.warning("GEMM choices in %s not used (%s): timing them again", self.path, e)
            return {}

    def store(self, choices: dict[str, Choice]) -> None:
        """Merges choices into the file; a cache that cannot be written costs only the next
        start-up's timing (a warning, not an error)."""
        if self.path is None:
            return
        merged = {**self.load(), **choices}
        tmp = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name,
                                       suffix=".tmp")
            umask = os.umask(0)
            os.umask(umask)
            os.fchmod(fd, 0o666 & ~umask)  # as open() would make it, not mkstemp's 0600
            with os.fdopen(fd, "w") as f:
                json.dump({k: c.to_json() for k, c in sorted(merged.items())}, f, indent=1)
            os.replace(tmp, self.path)
        except OSError as e:
            log.warning("GEMM choices not cached (%s): the next start-up times them again", e)
            if tmp is not None:  # (a full disk, the name taken by a folder): no stray file
                with contextlib.suppress(OSError):
                    os.unlink(tmp)

    @contextlib.contextmanager
    def locked(self):
        """Holds an exclusive lock on the cache (a file beside it) while the body runs; without
        one (no cache, a folder that cannot be written) the body runs unlocked."""
        if self.path is None:
            yield
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path.with_name(self.path.name + ".lock"), os.O_RDWR | os.O_CREAT,
                         0o666)
        except OSError:
            yield
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock


def cache_file(directory: Path, device_name: str, cublas_version: int,
               workspace_bytes: int, sm_count_target: int = 0, held_sms: int = 0,
               split_k: bool = False) -> Path:
    """Where one GPU model, cuBLAS version, workspace size, SM count target (0: the device's),
    count of SMs held beside the timing and candidate set keep their choices (the workspace
    bounds which algorithms can run, the target how cuBLAS sizes them, the held SMs what they
    run beside; split_k: Cublas.split_k's variants were timed too)."""
    device = re.sub(r"[^A-Za-z0-9]+", "-", device_name).strip("-").lower() or "gpu"
    sms = (f"-sms{sm_count_target}" if sm_count_target else "") + \
        (f"-held{held_sms}" if held_sms else "") + ("-splitk" if split_k else "")
    return directory / (f"{device}-cublas{cublas_version}-ws{workspace_bytes >> 20}m{sms}"
                        f"-v{METHOD_VERSION}.json")


@dataclass
class GemmTuner:
    """Tunes the shapes of recorded calls (once each), installs the choices in blas.algos."""
    blas: Cublas
    stream: object                    # the CUstream blas runs on
    cache: ChoiceCache
    # a context the timing runs in: CudaForward.holding_sms, the scheduler kernel's held SM
    beside: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    choices: dict[str, Choice] = field(default_factory=dict)  # by shape key, this process
    seconds: float = 0.0              # spent timing
    timed: int = 0                    # shapes timed here (not found in the cache)
    failed: int = 0                   # candidates that could not be captured or run

    def tune(self, calls: list[GemmCall]) -> None:
        by_shape: dict[GemmShape, list[GemmCall]] = {}
        for call in calls:
            if call.shape.key not in self.choices:
                by_shape.setdefault(call.shape, []).append(call)
        if not by_shape:
            return
        with self.cache.locked():
            cached = self.cache.load()  # read under the lock: what others tuned meanwhile
            fresh = {}
            for shape, shape_calls in by_shape.items():
                choice = cached.get(shape.key)
                if choice is not None and choice.algo is not None and bytes(choice.algo) not in {
                        bytes(a) for a in self.blas.lt_candidates(shape)}:
                    choice = None  # not an algorithm this cuBLAS offers the shape: time again
                if choice is None:
                    t0 = time.monotonic()
                    choice = fresh[shape.key] = self._time(shape, shape_calls)
                    self.seconds += time.monotonic() - t0
                    self.timed += 1
                self.choices[shape.key] = choice
                if choice.algo is not None:
                    self.blas.algos[shape] = choice.algo
                else:
                    self.blas.algos.pop(shape, None)
            if fresh:
                self.cache.store(fresh)

    def summary(self) -> str:
        switched = [c for c in self.choices.values() if c.algo is not None]
        saved = sum(c.default_us - c.best_us for c in switched)
        failed = f", {self.failed} candidates failed (logged)" if self.failed else ""
        return (f"{len(self.choices)} GEMM shapes, {len(switched)} on a cuBLASLt algorithm "
                f"faster than cuBLAS's own ({saved:.0f} µs a call summed over them); "
                f"{self.timed} timed now in {self.seconds:.1f} s{failed}, the rest from "
                f"{self.cache.path}")

    def _time(self, shape: GemmShape, calls: list[GemmCall]) -> Choice:
        """Times the shape's calls (all layers, in order) as one graph per algorithm."""
        from cuda.bindings import driver as cu
        from .cuda_runtime import capture_device_graph, check
        # inputs non-zero (tensor cores draw less on zeros), outputs put back to zero after
        spans = {(c.x, shape.x_bytes) for c in calls}
        outs = {(c.out, shape.rows * shape.out_features * (4 if shape.out_type == R_32F else 2))
                for c in calls}
        scales = {(c.x_scale, 4 * shape.rows) for c in calls if shape.fp8}
        for ptr, nbytes in spans:
            if shape.fp8:
                check(cu.cuMemsetD8Async(ptr, 0x30, nbytes, self.stream))  # E4M3 2^-1
            else:
                check(cu.cuMemsetD16Async(ptr, 0x3C00, nbytes // 2, self.stream))  # bf16 2^-7
        for ptr, nbytes in scales:
            check(cu.cuMemsetD32Async(ptr, 0x3C000000, nbytes // 4, self.stream))  # f32 2^-7

        # linear_fp8 runs the handle's accumulation mode, which the calls were recorded in
        assert not shape.fp8 or shape.fast_accum == self.blas.fp8_fast_accum, shape.key

        def run(c: GemmCall, algo) -> None:
            if shape.fp8:  # algo None: cuBLASLt's first choice, the FP8 GEMMs' default
                self.blas.linear_fp8(c.x, c.x_scale, c.w, c.w_scale, c.out, shape.rows,
                                     shape.in_features, shape.out_features, shape.out_type,
                                     shape.accumulate, algo=algo)
            else:
                self.blas.linear(c.x, c.w, c.out, shape.rows, shape.in_features,
                                 shape.out_features, shape.out_type, shape.accumulate, algo=algo)

        def graph_of(algo):
            """The calls as one graph, instantiated as the forward graphs are (for device
            launch), after one eager call that keeps first-call set-up out of the capture."""
            run(calls[0], algo)
            return capture_device_graph(self.stream, lambda _: [run(c, algo) for c in calls])

        candidates = self.blas.lt_candidates(shape)
        exes, best = [], []
        start, end = check(cu.cuEventCreate(0)), check(cu.cuEventCreate(0))

        def replay_us(exe) -> float:
            check(cu.cuEventRecord(start, self.stream))
            check(cu.cuGraphLaunch(exe, self.stream))
            check(cu.cuEventRecord(end, self.stream))
            check(cu.cuEventSynchronize(end))
            return check(cu.cuEventElapsedTime(start, end)) * 1e3

        # FP8 shapes have no cuBLAS default: linear_fp8's own is candidates[0] (the heuristic's
        # first), which is timed as one of the candidates, and any that runs may replace it
        fp8 = shape.fp8
        try:
            if not fp8:
                exes.append(graph_of(None))  # cuBLAS's own choice: as the forward graphs run it
            for algo in candidates:
                try:
                    exes.append(graph_of(algo))
                except Exception as e:  # offered by cuBLASLt, but it cannot run here
                    log.warning("cuBLASLt algorithm (%s) for %s left out: %s",
                                self.blas.lt_describe(algo), shape.key, e)
                    self.failed += 1
                    exes.append(None)
            live = [exe for exe in exes if exe is not None]
            if not live:
                raise RuntimeError(f"no GEMM algorithm for {shape.key} can run in a "
                                   f"device-launched graph")
            # the clock first (WARMUP_S of cuBLAS's own graph), then every graph once a round:
            # a clock still rising or a GPU heating up then favours no algorithm over another
            with self.beside():
                first = replay_us(live[0])
                for _ in range(min(100, int(WARMUP_S * 1e6 / max(first, 1.0)))):
                    check(cu.cuGraphLaunch(live[0], self.stream))
                best = [float("inf")] * len(exes)
                for _ in range(ROUNDS):
                    for i, exe in enumerate(exes):
                        if exe is not None:
                            best[i] = min(best[i], replay_us(exe))
        finally:
            for exe in exes:
                if exe is not None:
                    cu.cuGraphExecDestroy(exe)
            cu.cuEventDestroy(start)
            cu.cuEventDestroy(end)
            for ptr, nbytes in spans | outs | scales:
                check(cu.cuMemsetD8Async(ptr, 0, nbytes, self.stream))
            check(cu.cuStreamSynchronize(self.stream))
        times = [t / len(calls) for t in best]
        default_us, candidate_us = times[0], times if fp8 else times[1:]
        pick = choose(default_us, candidate_us)
        if fp8 and default_us == float("inf"):  # the heuristic's first cannot run: the fastest
            pick = min(range(len(times)), key=times.__getitem__)
        if pick is None:
            return Choice(None, default_us, default_us)
        algo = candidates[pick]
        return Choice(algo, default_us, candidate_us[pick], self.blas.lt_describe(algo))
