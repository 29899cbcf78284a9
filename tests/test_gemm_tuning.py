"""The GEMM tuner's host side: the choice rule, the on-disk cache and its lock, the shape keys,
and the tuner's timing logic with the GPU faked (round-robin replays, the margin, failed
candidates, operands put back to zero, choices shared through the cache). cuBLASLt and real
timings run on the GPU: test_cuda_forward.py."""
from __future__ import annotations

import contextlib
import ctypes
import json
import os
import subprocess
import sys
import types

import pytest

from blink.gpu_engine.cublas import R_16BF, R_32F, GemmCall, GemmShape, LtAlgo
from blink.gpu_engine.gemm_tuning import MARGIN, METHOD_VERSION, Choice, ChoiceCache, \
    cache_file, choose


def algo(seed: int) -> LtAlgo:
    a = LtAlgo()
    for i in range(8):
        a.data[i] = seed * 1_000_003 + i
    return a


def test_choose_takes_the_fastest_only_past_the_margin():
    assert choose(100.0, []) is None
    assert choose(100.0, [101.0, 100.0]) is None                       # none faster
    assert choose(100.0, [100 * (1 - MARGIN / 2)]) is None             # within the noise margin
    assert choose(100.0, [99.0, 80.0, 85.0]) == 1                      # the fastest
    assert choose(100.0, [float("inf"), 90.0]) == 1                    # a failed candidate
    assert choose(100.0, [90.0, 90.0]) == 0                            # ties: the heuristic's order


def test_choose_takes_a_candidate_exactly_the_margin_faster():
    """'At least margin faster' (choose's contract; the README's 'at least 3% faster'): a
    candidate exactly that much faster replaces the default, one a hair slower does not."""
    assert choose(100.0, [75.0], margin=0.25) == 0
    assert choose(100.0, [75.000001], margin=0.25) is None
    assert choose(200.0, [250.0, 200 * (1 - MARGIN)]) == 1


def test_lt_algo_is_64_bytes_and_round_trips_through_hex():
    assert ctypes.sizeof(LtAlgo) == 64
    a = algo(3)
    assert bytes(LtAlgo.from_hex(a.to_hex())) == bytes(a)
    with pytest.raises(ValueError):
        LtAlgo.from_hex("00" * 63)


def test_shape_keys_tell_every_field_apart():
    shapes = [GemmShape(r, i, o, t, a, fp8, fast) for r in (9, 448)
              for i, o in ((4096, 6144), (6144, 4096))
              for t, a in ((R_16BF, False), (R_32F, False), (R_32F, True))
              for fp8, fast in ((False, False), (True, False), (True, True))]
    assert len({s.key for s in shapes}) == len(shapes)
    assert GemmShape(448, 4096, 28672, R_16BF, False).key == "448x4096->28672:bf16"
    # an FP8 GEMM with fast accumulation is another descriptor: its algorithms are timed apart
    assert GemmShape(448, 4096, 28672, R_16BF, False, fp8=True, fast_accum=True).key == \
        "fp8fa:448x4096->28672:bf16"


def test_cache_round_trip_merges_and_survives_garbage(tmp_path):
    path = cache_file(tmp_path / "gemm", "NVIDIA H200 (141 GB)", 130100, 32 << 20)
    assert path.name == f"nvidia-h200-141-gb-cublas130100-ws32m-v{METHOD_VERSION}.json"
    assert cache_file(tmp_path, "NVIDIA H200", 130100, 8 << 20) != \
        cache_file(tmp_path, "NVIDIA H200", 130100, 32 << 20)
    # GEMMs sized for the SMs the scheduler leaves are other kernels: their own file
    assert cache_file(tmp_path, "NVIDIA H200", 130100, 32 << 20, 131, 1).name == \
        f"nvidia-h200-cublas130100-ws32m-sms131-held1-v{METHOD_VERSION}.json"
    # the same target timed on the whole GPU (a host-launched engine): other timings
    assert cache_file(tmp_path, "NVIDIA H200", 130100, 32 << 20, 131).name == \
        f"nvidia-h200-cublas130100-ws32m-sms131-v{METHOD_VERSION}.json"
    # split-K variants timed too: another candidate set, another file
    assert cache_file(tmp_path, "NVIDIA H200", 130100, 32 << 20, 131, 1, split_k=True).name \
        == f"nvidia-h200-cublas130100-ws32m-sms131-held1-splitk-v{METHOD_VERSION}.json"
    cache = ChoiceCache(path)
    assert cache.load() == {}
    first = {"a": Choice(algo(1), 267.0, 145.4, "id 6 tile 20 split-k 1"),
             "b": Choice(None, 33.5, 33.5)}
    cache.store(first)
    # another process adds a shape and re-times one: both kept, the newer wins
    ChoiceCache(path).store({"c": Choice(algo(2), 20.0, 17.0), "b": Choice(algo(4), 34.0, 30.0)})
    got = cache.load()
    assert set(got) == {"a", "b", "c"}
    assert bytes(got["a"].algo) == bytes(algo(1)) and got["a"].best_us == 145.4
    assert got["a"].described == "id 6 tile 20 split-k 1"
    assert bytes(got["b"].algo) == bytes(algo(4))
    assert list(tmp_path.glob("gemm/*.tmp")) == []
    assert path.stat().st_mode & 0o777 == 0o666 & ~current_umask()  # others may read it
    for garbage in ("{not json", json.dumps({"a": {"algo": "zz"}}), "[1, 2]", "null",
                    json.dumps({"a": [1]})):
        path.write_text(garbage)
        assert cache.load() == {}, garbage
    path.unlink()
    path.mkdir()  # unreadable as a file
    assert cache.load() == {}
    assert ChoiceCache(None).load() == {}
    ChoiceCache(None).store(first)  # no file: nothing happens


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_the_lock_keeps_a_second_tuner_out(tmp_path):
    """While one process holds the cache's lock, another cannot take it (flock is per open
    file, so a child process is the real test)."""
    cache = ChoiceCache(tmp_path / "gemm" / "choices.json")
    probe = ("import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR); "
             "fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)")
    lock = str(cache.path) + ".lock"
    with cache.locked():
        held = subprocess.run([sys.executable, "-c", probe, lock], capture_output=True)
    free = subprocess.run([sys.executable, "-c", probe, lock], capture_output=True)
    assert held.returncode != 0 and b"BlockingIOError" in held.stderr
    assert free.returncode == 0, free.stderr
    with ChoiceCache(None).locked():  # no cache: nothing to lock
        pass


def test_the_lock_admits_no_second_holder_at_all(tmp_path):
    """The tuners' lock is exclusive: while one holds it another process cannot take even a
    shared lock (two tuners holding shared locks would both time the same shapes)."""
    cache = ChoiceCache(tmp_path / "choices.json")
    probe = ("import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR); "
             "fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)")
    with cache.locked():
        held = subprocess.run([sys.executable, "-c", probe, str(cache.path) + ".lock"],
                              capture_output=True)
    assert held.returncode != 0 and b"BlockingIOError" in held.stderr


def test_a_cache_that_cannot_be_replaced_leaves_no_temporary_file(tmp_path, caplog):
    """A store whose last step fails (here the cache's name is a folder's) only warns, and
    leaves nothing beside the cache: each start-up's try left a .tmp file behind."""
    path = tmp_path / "gemm" / "choices.json"
    path.mkdir(parents=True)
    ChoiceCache(path).store({"a": Choice(None, 1.0, 1.0)})
    assert "not cached" in caplog.text and list(path.parent.iterdir()) == [path]


def test_an_unwritable_cache_only_warns(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    cache = ChoiceCache(blocker / "gemm" / "choices.json")  # its folder cannot be made
    cache.store({"a": Choice(None, 1.0, 1.0)})
    assert "not cached" in caplog.text and cache.load() == {}
    with cache.locked():  # no lock to be had: the body still runs
        pass


# --- the tuner's logic with the GPU faked ------------------------------------------------------

class FakeGpu:
    """Stands in for cuda.bindings.driver and cuda_runtime: a 'graph' is the list of algorithms
    its calls ran with; replaying it takes the sum of their per-call times."""

    def __init__(self, per_call_us: dict):
        self.per_call_us = per_call_us  # algorithm name (None: GemmEx) -> µs a call
        self.launched = []              # graphs replayed, in order
        self.memsets = []               # (value, ptr, count)
        self.destroyed = 0
        self.events = 0                 # created and not destroyed
        # extra µs of a graph's replay by how many times it ran before (its first: a clock
        # still rising; another process's kernel in the way)
        self.extra_us = {}
        self._recording = None

    # cuda_runtime
    def check(self, result, what=""):
        return result

    def capture_device_graph(self, stream, record):
        self._recording = []
        record(stream)
        graph, self._recording = tuple(self._recording), None
        return graph

    # driver
    def cuMemsetD16Async(self, ptr, value, count, stream):
        self.memsets.append((value, ptr, count))

    def cuMemsetD8Async(self, ptr, value, count, stream):
        self.memsets.append((value, ptr, count))

    def cuMemsetD32Async(self, ptr, value, count, stream):
        self.memsets.append((value, ptr, count))

    def cuStreamSynchronize(self, stream):
        pass

    def cuEventCreate(self, flags):
        self.events += 1
        return types.SimpleNamespace(at=None)

    def cuEventDestroy(self, event):
        self.events -= 1

    def cuEventRecord(self, event, stream):
        event.at = len(self.launched)

    def cuEventSynchronize(self, event):
        pass

    def cuEventElapsedTime(self, start, end):  # ms: the graphs launched between the two
        return sum(sum(self.per_call_us[a] for a in g)
                   + self.extra_us.get(self.launched[:i].count(g), 0.0)
                   for i, g in enumerate(self.launched[start.at:end.at], start.at)) / 1e3

    def cuGraphLaunch(self, graph, stream):
        self.launched.append(graph)

    def cuGraphExecDestroy(self, graph):
        self.destroyed += 1


class FakeLt:
    """The cuBLASLt calls Cublas.lt_candidates makes, on fake algorithms: an algorithm is its
    name's bytes, with the split-K count in data[6] and the reduction scheme in data[7]. The
    heuristic offers `offered`; "nosplit" takes no split-K count; "noinplace" no in-place
    reduction; a workspace reduction needs rows x out x 4 bytes a part, as cuBLASLt's does."""

    def __init__(self, offered: list[LtAlgo]):
        self.offered, self.checked = offered, []
        self.api = {name: getattr(self, name) for name in (
            "cublasLtMatmulPreferenceCreate", "cublasLtMatmulPreferenceSetAttribute",
            "cublasLtMatmulPreferenceDestroy", "cublasLtMatmulAlgoGetHeuristic",
            "cublasLtMatmulAlgoConfigSetAttribute", "cublasLtMatmulAlgoCheck")}

    def cublasLtMatmulPreferenceCreate(self, pref):
        return 0

    def cublasLtMatmulPreferenceSetAttribute(self, pref, attr, value, size):
        return 0

    def cublasLtMatmulPreferenceDestroy(self, pref):
        return 0

    def cublasLtMatmulAlgoGetHeuristic(self, handle, desc, a, b, c, d, pref, count, results,
                                       found):
        for i, offered in enumerate(self.offered[:count]):
            results[i].algo = offered
        found._obj.value = min(count, len(self.offered))
        return 0

    def cublasLtMatmulAlgoConfigSetAttribute(self, algo, attr, value, size):
        from blink.gpu_engine.cublas import LT_CONFIG_SPLITK_NUM
        assert size == 4  # both attributes are uint32_t
        if attr == LT_CONFIG_SPLITK_NUM and bytes(algo._obj).startswith(b"nosplit"):
            return 15  # CUBLAS_STATUS_NOT_SUPPORTED
        algo._obj.data[6 if attr == LT_CONFIG_SPLITK_NUM else 7] = value._obj.value
        return 0

    def cublasLtMatmulAlgoCheck(self, handle, desc, a, b, c, d, algo, result):
        from blink.gpu_engine.cublas import LT_REDUCTION_INPLACE
        parts, scheme = algo._obj.data[6], algo._obj.data[7]
        self.checked.append((split_name(algo._obj), parts, scheme))
        if scheme == LT_REDUCTION_INPLACE:
            if bytes(algo._obj).startswith(b"noinplace"):
                return 15
            result._obj.workspace_size = 64
        else:
            result._obj.workspace_size = self.rows * self.out * 4 * parts
        return 0


def split_name(algo: LtAlgo) -> str:
    return bytes(algo)[:48].rstrip(b"\0").decode()


def fake_lt_blas(shape: GemmShape, offered: list[str], workspace: int = 8 << 20):
    from blink.gpu_engine.cublas import Cublas
    lt = FakeLt([name_algo(n) for n in offered])
    lt.rows, lt.out = shape.rows, shape.out_features
    blas = Cublas.__new__(Cublas)  # no libcublas: the fake's calls only
    blas.split_k, blas.workspace, blas.workspace_bytes = True, 1, workspace
    blas._lt, blas._lt_plans, blas._fp8_defaults = (lt.api, None), {shape: (1, 2, 3, 4)}, {}
    return blas, lt


def test_split_k_variants_follow_what_cublaslt_accepts():
    """Cublas.split_k adds, after the heuristic's candidates in its order, each of the first
    SPLIT_K_BASES with each SPLIT_K_COUNTS count: summed in place where the output is fp32
    and the algorithm takes it, in the workspace otherwise (bf16 outputs always), kept only
    where cuBLASLt's check accepts it within the workspace; no variant twice; none for shapes
    past SPLIT_K_MAX_ROWS rows, none with split_k off; an FP8 shape's default stays the
    heuristic's first."""
    from blink.gpu_engine.cublas import LT_REDUCTION_COMPUTE_TYPE as WS
    from blink.gpu_engine.cublas import LT_REDUCTION_INPLACE as INPLACE
    from blink.gpu_engine.cublas import SPLIT_K_BASES, SPLIT_K_COUNTS, SPLIT_K_MAX_ROWS
    assert SPLIT_K_BASES == 3
    offered = ["noinplace-a", "nosplit-b", "c", "d"]

    def candidates(shape, workspace=8 << 20):
        blas, lt = fake_lt_blas(shape, offered, workspace)
        names = [(split_name(a), a.data[6], a.data[7]) for a in blas.lt_candidates(shape)]
        return names, lt.checked

    # bf16 out, 128 x 4096 -> 4096: a part's fp32 sums are 2 MB, 4 fit in 8 MB
    bf16 = GemmShape(128, 4096, 4096, R_16BF, False)
    names, checked = candidates(bf16)
    assert names[:4] == [(n, 0, 0) for n in offered]  # the heuristic's, in its order
    assert names[4:] == [(n, k, WS) for n in ("noinplace-a", "c") for k in (2, 3, 4)]
    assert {(n, s) for n, _, s in checked} == {("noinplace-a", WS), ("c", WS)}  # never d
    # fp32 out (the residual add): in place where the algorithm takes it, whatever the count
    f32 = GemmShape(128, 4096, 4096, R_32F, True)
    names, checked = candidates(f32)
    assert names[4:] == [("noinplace-a", k, WS) for k in (2, 3, 4)] + \
        [("c", k, INPLACE) for k in SPLIT_K_COUNTS]
    assert ("noinplace-a", 8, INPLACE) in checked and ("noinplace-a", 8, WS) in checked
    # a workspace of 1 MB holds no part's sums: only in-place variants are left
    names, _ = candidates(f32, workspace=1 << 20)
    assert names[4:] == [("c", k, INPLACE) for k in SPLIT_K_COUNTS]
    # shapes with enough output tiles, and split_k off: the heuristic's alone
    wide = GemmShape(SPLIT_K_MAX_ROWS + 1, 4096, 4096, R_16BF, False)
    assert [n for n, _, _ in candidates(wide)[0]] == offered
    blas, _ = fake_lt_blas(bf16, offered)
    blas.split_k = False
    assert [split_name(a) for a in blas.lt_candidates(bf16)] == offered
    # a variant the heuristic already offers keeps the heuristic's place, once
    blas, lt = fake_lt_blas(bf16, offered)
    twin = name_algo("c")
    twin.data[6], twin.data[7] = 3, WS
    lt.offered.append(twin)
    found = [(split_name(a), a.data[6]) for a in blas.lt_candidates(bf16)]
    assert found.count(("c", 3)) == 1 and found.index(("c", 3)) == 4
    # FP8 GEMMs with no tuned choice run the heuristic's first, found with no variant checked
    fp8 = GemmShape(128, 4096, 4096, R_16BF, False, fp8=True)
    blas, lt = fake_lt_blas(fp8, offered)
    assert split_name(blas._fp8_default(fp8)) == "noinplace-a" and lt.checked == []


class FakeBlas:
    def __init__(self, gpu: FakeGpu, candidates: list[str], broken: set[str] = frozenset()):
        self.gpu, self.candidates, self.broken = gpu, candidates, broken
        self.algos = {}

    def lt_candidates(self, shape):
        return [name_algo(n) for n in self.candidates]

    def lt_describe(self, algo):
        return f"id {algo_name(algo)}"

    fp8_fast_accum = False

    def linear_fp8(self, x, x_scale, w, w_scale, out, rows, in_f, out_f, out_type, accumulate,
                   algo):
        self.linear(x, w, out, rows, in_f, out_f, out_type, accumulate, algo)

    def linear(self, x, w, out, rows, in_f, out_f, out_type, accumulate, algo):
        name = None if algo is None else algo_name(algo)
        if name in self.broken:
            raise RuntimeError(f"{name} cannot run")
        if self.gpu._recording is not None:
            self.gpu._recording.append(name)


def name_algo(name: str) -> LtAlgo:
    return LtAlgo.from_buffer_copy(name.encode().ljust(64, b"\0"))


def algo_name(algo: LtAlgo) -> str:
    return bytes(algo).rstrip(b"\0").decode()


@pytest.fixture
def fake_gpu(monkeypatch):
    gpu = FakeGpu({None: 100.0, "slow": 110.0, "fast": 80.0, "close": 98.5, "broken": 1.0})
    driver = types.ModuleType("cuda.bindings.driver")
    for name in dir(gpu):
        if name.startswith("cu"):
            setattr(driver, name, getattr(gpu, name))
    bindings = types.ModuleType("cuda.bindings")
    bindings.driver = driver
    runtime = types.ModuleType("blink.gpu_engine.cuda_runtime")
    runtime.check, runtime.capture_device_graph = gpu.check, gpu.capture_device_graph
    monkeypatch.setitem(sys.modules, "cuda", types.ModuleType("cuda"))
    monkeypatch.setitem(sys.modules, "cuda.bindings", bindings)
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", driver)
    monkeypatch.setitem(sys.modules, "blink.gpu_engine.cuda_runtime", runtime)
    return gpu


def recorded(rows: int, layers: int = 3) -> list[GemmCall]:
    shape = GemmShape(rows, 64, 32, R_32F, True)
    return [GemmCall(shape, x=1000, w=2000 + i, out=3000) for i in range(layers)]


def test_the_tuner_times_round_robin_and_keeps_the_fastest(fake_gpu, tmp_path, caplog):
    from blink.gpu_engine.gemm_tuning import ROUNDS, GemmTuner
    blas = FakeBlas(fake_gpu, ["slow", "fast", "broken"], broken={"broken"})
    beside = []  # (first, end) launches while the held SM's context was open

    @contextlib.contextmanager
    def holding_sms():
        first = len(fake_gpu.launched)
        yield
        beside.append((first, len(fake_gpu.launched)))
    tuner = GemmTuner(blas, stream=None, cache=ChoiceCache(tmp_path / "c.json"),
                      beside=holding_sms)
    calls = recorded(24)
    tuner.tune(calls)
    assert beside == [(0, len(fake_gpu.launched))]  # every replay timed beside it
    shape = calls[0].shape
    assert algo_name(blas.algos[shape]) == "fast"
    choice = tuner.choices[shape.key]
    assert (choice.default_us, choice.best_us, choice.described) == (100.0, 80.0, "id fast")
    assert tuner.timed == 1 and tuner.failed == 1 and "broken" in caplog.text
    # each graph holds every layer's call; after the warm-up, one replay of each a round
    default, slow, fast = (None,) * 3, ("slow",) * 3, ("fast",) * 3
    timed = fake_gpu.launched[-3 * ROUNDS:]
    assert timed == [default, slow, fast] * ROUNDS
    assert fake_gpu.launched[0] == default and fake_gpu.destroyed == 3
    # inputs set non-zero first, inputs and outputs zero again after
    assert fake_gpu.memsets[0] == (0x3C00, 1000, 24 * 64)
    assert sorted(fake_gpu.memsets[1:]) == [(0, 1000, 24 * 64 * 2), (0, 3000, 24 * 32 * 4)]
    # a second tuner (another engine) takes the cached choice without timing it
    again = GemmTuner(FakeBlas(fake_gpu, ["slow", "fast"]), None, ChoiceCache(tmp_path / "c.json"))
    again.tune(calls)
    assert again.timed == 0 and algo_name(again.blas.algos[shape]) == "fast"
    # a cached algorithm this cuBLAS no longer offers is timed again
    third = GemmTuner(FakeBlas(fake_gpu, ["slow"]), None, ChoiceCache(tmp_path / "c.json"))
    third.tune(calls)
    assert third.timed == 1 and shape not in third.blas.algos  # slow loses to GemmEx


def test_the_tuner_keeps_cublas_within_the_margin(fake_gpu, tmp_path):
    from blink.gpu_engine.gemm_tuning import GemmTuner
    blas = FakeBlas(fake_gpu, ["close", "slow"])
    tuner = GemmTuner(blas, None, ChoiceCache(tmp_path / "c.json"))
    tuner.tune(recorded(160) + recorded(160))  # two passes' calls of one shape: timed once
    assert blas.algos == {} and tuner.timed == 1
    assert "0 on a cuBLASLt algorithm" in tuner.summary()
    tuner.tune(recorded(160))  # known in this process: nothing timed, nothing read
    assert tuner.timed == 1


def test_each_algorithm_keeps_its_own_fastest_replay(fake_gpu, tmp_path):
    """A candidate that cannot run, ahead of the others, moves no time onto another algorithm;
    each algorithm's fastest replay counts (not its first, 100 µs slower, nor its last, hit by
    1 ms); a call's time is its graph's over the layers (two here); cuBLAS's own graph warms
    the clock for WARMUP_S first; a bf16 output is zeroed after at 2 bytes an element; the
    events go."""
    from blink.gpu_engine.gemm_tuning import ROUNDS, WARMUP_S, GemmTuner
    fake_gpu.extra_us = {0: 100.0, ROUNDS - 1: 1000.0}
    blas = FakeBlas(fake_gpu, ["broken", "slow", "fast", "close"], broken={"broken"})
    tuner = GemmTuner(blas, None, ChoiceCache(tmp_path / "c.json"))
    shape = GemmShape(24, 64, 32, R_16BF, False)
    tuner.tune([GemmCall(shape, x=1000, w=2000 + i, out=3000) for i in range(2)])
    choice = tuner.choices[shape.key]
    assert algo_name(blas.algos[shape]) == "fast" and choice.described == "id fast"
    assert (choice.default_us, choice.best_us) == (100.0, 80.0)
    warmup = int(WARMUP_S * 1e6 / (2 * 100 + 100))  # after a first replay of 300 µs
    default, slow, fast, close = ((a, a) for a in (None, "slow", "fast", "close"))
    assert fake_gpu.launched == [default] * (1 + warmup) + [default, slow, fast, close] * ROUNDS
    assert fake_gpu.memsets[0] == (0x3C00, 1000, 24 * 64)
    assert sorted(fake_gpu.memsets[1:]) == [(0, 1000, 24 * 64 * 2), (0, 3000, 24 * 32 * 2)]
    assert fake_gpu.events == 0 and fake_gpu.destroyed == 4 and tuner.seconds > 0


def fp8_calls(layers: int = 2) -> list[GemmCall]:
    shape = GemmShape(24, 64, 32, R_16BF, False, fp8=True)
    return [GemmCall(shape, x=1000, w=2000 + i, out=3000, x_scale=5000, w_scale=6000 + i)
            for i in range(layers)]


def test_an_fp8_shape_s_default_is_the_heuristic_s_first(fake_gpu, tmp_path):
    """FP8 GEMMs have no cuBLAS default: the heuristic's first candidate is the one to beat by
    the margin, timed among the candidates (no GemmEx graph); its inputs are E4M3 codes (0x30
    a byte) with f32 row scales, all zero again after. Where the heuristic's first cannot
    run, the fastest that can is taken; where none can, the tuning fails and still cleans
    up."""
    from blink.gpu_engine.gemm_tuning import ROUNDS, GemmTuner
    blas = FakeBlas(fake_gpu, ["close", "slow", "fast"])
    tuner = GemmTuner(blas, None, ChoiceCache(tmp_path / "c.json"))
    calls = fp8_calls()
    shape = calls[0].shape
    tuner.tune(calls)
    choice = tuner.choices[shape.key]
    assert algo_name(blas.algos[shape]) == "fast"
    assert (choice.default_us, choice.best_us) == (98.5, 80.0)
    assert None not in {a for g in fake_gpu.launched for a in g}
    assert fake_gpu.launched[-3 * ROUNDS:] == [("close",) * 2, ("slow",) * 2, ("fast",) * 2] * \
        ROUNDS
    assert fake_gpu.memsets[:2] == [(0x30, 1000, 24 * 64), (0x3C000000, 5000, 24)]
    assert sorted(fake_gpu.memsets[2:]) == [(0, 1000, 24 * 64), (0, 3000, 24 * 32 * 2),
                                            (0, 5000, 4 * 24)]
    # within the margin of the heuristic's first: it stays
    blas = FakeBlas(fake_gpu, ["fast", "close"])
    GemmTuner(blas, None, ChoiceCache(None)).tune(calls)
    assert blas.algos == {}
    # the heuristic's first cannot run
    blas = FakeBlas(fake_gpu, ["broken", "slow", "close"], broken={"broken"})
    tuner = GemmTuner(blas, None, ChoiceCache(None))
    tuner.tune(calls)
    assert algo_name(blas.algos[shape]) == "close" and tuner.choices[shape.key].best_us == 98.5
    # none can
    fake_gpu.memsets.clear()
    blas = FakeBlas(fake_gpu, ["broken"], broken={"broken"})
    with pytest.raises(RuntimeError, match="no GEMM algorithm"):
        GemmTuner(blas, None, ChoiceCache(None)).tune(calls)
    assert sorted(fake_gpu.memsets[2:]) == [(0, 1000, 24 * 64), (0, 3000, 24 * 32 * 2),
                                            (0, 5000, 4 * 24)]
    assert fake_gpu.events == 0
