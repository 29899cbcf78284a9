"""The GEMM tuner's host side: the choice rule, the on-disk cache of choices and the shape keys.
(The timing and cuBLASLt itself run on the GPU: test_cuda_forward.py.)"""
from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys

import pytest

from blink.gpu_engine.cublas import R_16BF, R_32F, GemmShape, LtAlgo
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


def test_lt_algo_is_64_bytes_and_round_trips_through_hex():
    assert ctypes.sizeof(LtAlgo) == 64
    a = algo(3)
    assert bytes(LtAlgo.from_hex(a.to_hex())) == bytes(a)
    with pytest.raises(ValueError):
        LtAlgo.from_hex("00" * 63)


def test_shape_keys_tell_every_field_apart():
    shapes = [GemmShape(r, i, o, t, a) for r in (9, 448) for i, o in ((4096, 6144), (6144, 4096))
              for t, a in ((R_16BF, False), (R_32F, False), (R_32F, True))]
    assert len({s.key for s in shapes}) == len(shapes)
    assert GemmShape(448, 4096, 28672, R_16BF, False).key == "448x4096->28672:bf16"


def test_cache_round_trip_merges_and_survives_garbage(tmp_path):
    path = cache_file(tmp_path / "gemm", "NVIDIA H200 (141 GB)", 130100, 32 << 20)
    assert path.name == f"nvidia-h200-141-gb-cublas130100-ws32m-v{METHOD_VERSION}.json"
    assert cache_file(tmp_path, "NVIDIA H200", 130100, 8 << 20) != \
        cache_file(tmp_path, "NVIDIA H200", 130100, 32 << 20)
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


def test_an_unwritable_cache_only_warns(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    cache = ChoiceCache(blocker / "gemm" / "choices.json")  # its folder cannot be made
    cache.store({"a": Choice(None, 1.0, 1.0)})
    assert "not cached" in caplog.text and cache.load() == {}
    with cache.locked():  # no lock to be had: the body still runs
        pass
