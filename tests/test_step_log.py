"""The CUDA engine's step log on the host side: records kept in a ring come out oldest first,
the summary by bucket is the arithmetic of its records, and only the cuda engine takes the
flag. (The kernel's records against the engine's own counters: test_cuda_engine.py.)"""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from blink.gpu_engine.engine_layout import STEP_RECORD_DTYPE, engine_init_record
from blink.gpu_engine.step_log import format_table, load_step_log, main, save_step_log, \
    summarize


def records(n: int, first: int = 0) -> np.ndarray:
    """Steps first .. first + n - 1: step k starts at 1000 (k + 1) µs, 100 tokens, bucket 128."""
    r = np.zeros(n, STEP_RECORD_DTYPE)
    k = np.arange(first, first + n)
    r["start_ns"] = 1_000_000 * (k + 1)
    r["tokens"], r["seqs"], r["rows"], r["bucket"] = 100, 10, 8, 128
    r["build_ns"], r["forward_ns"], r["finish_ns"] = 10_000, 500_000, 20_000
    return r


@pytest.mark.parametrize("steps", [0, 5, 8, 13, 24])
def test_saved_oldest_first_from_the_ring(tmp_path, steps):
    capacity = 8
    ring = np.zeros(capacity, STEP_RECORD_DTYPE)
    for k in range(steps):  # as the kernel writes them: step n at n % capacity
        ring[k % capacity] = records(1, first=k)[0]
    kept = min(steps, capacity)
    assert save_step_log(tmp_path / "log", ring) == kept
    got = load_step_log(tmp_path / "log")
    np.testing.assert_array_equal(got, records(kept, first=steps - kept))


def test_summary_by_bucket(tmp_path, capsys):
    r = np.concatenate([records(3), records(2, first=3)])
    r["bucket"][3:] = 2048
    r["tokens"][3:] = 2000
    r["forward_ns"][3:] = 700_000  # ends 730 µs after its start: the last gap 270 µs
    rows = summarize(r)
    assert [row["bucket"] for row in rows] == [128, 2048, "all"]
    small, large, total = rows
    assert (small["steps"], large["steps"], total["steps"]) == (3, 2, 5)
    assert small["forward_ms"] == 0.5 and large["forward_ms"] == 0.7
    assert total["tokens"] == (3 * 100 + 2 * 2000) / 5
    assert small["gap_us"] == 470.0 and large["gap_us"] == 270.0  # the last step has no gap
    span = 4_000_000 + 730_000
    assert total["share"] == pytest.approx((3 * 530_000 + 2 * 730_000) / span)
    assert summarize(r[:0]) == []
    table = format_table(rows)
    assert table.splitlines()[2].startswith("| 128 | 3 |") and "| all | 5 |" in table
    save_step_log(tmp_path / "log", r)
    main([str(tmp_path / "log")])
    assert "5 steps over 0.004 s, 4300 tokens" in capsys.readouterr().out


def test_a_file_that_is_not_a_step_log_is_refused(tmp_path):
    np.save(tmp_path / "other.npy", np.zeros(3))
    with pytest.raises(ValueError, match="not a step log"):
        load_step_log(tmp_path / "other.npy")


def test_engine_init_takes_a_whole_step_log_or_none():
    with pytest.raises(ValueError, match="step log"):
        engine_init_record(sched=None, ring_base=0, geom=None, control=0, consumed_gen=0,
                           corrupt_since=0, scratch_slot=0, staged_prompts=0, vocab_size=0,
                           context_length=0, kv_capacity_tokens=0, eos_ids=[],
                           corrupt_grace_ns=0, idle_sleep_ns=0, forward_pointers={},
                           max_blocks_per_seq=0, graph_execs={}, step_log=0x1000)


def test_a_step_log_folder_that_cannot_be_written_is_refused_at_start(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "blink.client.cli", "engine", "--engine", "cuda",
                           "--step-log", str(tmp_path / "missing" / "log")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "its folder does not exist" in proc.stderr


@pytest.mark.parametrize("engine", ["cpu", "hf", "synthetic"])
def test_only_the_cuda_engine_takes_a_step_log(tmp_path, engine):
    proc = subprocess.run([sys.executable, "-m", "blink.client.cli", "engine", "--engine", engine,
                           "--step-log", str(tmp_path / "log")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "--step-log is an option of the cuda engine" in proc.stderr
    assert not (tmp_path / "log").exists()


def test_a_workloads_steps_from_a_log_that_may_have_wrapped():
    from blink.gpu_engine.step_log import select_steps
    log = records(10, first=0)
    np.testing.assert_array_equal(select_steps(log, 10, 3, 7), records(4, first=3))
    wrapped = records(10, first=90)  # the last 10 of 100 steps
    np.testing.assert_array_equal(select_steps(wrapped, 100, 85, 95), records(5, first=90))
    assert len(select_steps(wrapped, 100, 20, 40)) == 0


def test_bench_serving_prints_each_workloads_steps(tmp_path, capsys):
    from blink.client.bench_serving import Result, Workload, print_step_log
    log = np.concatenate([records(4), records(6, first=4)])
    log["bucket"][4:], log["tokens"][4:] = 2048, 2000
    save_step_log(tmp_path / "steps.npy", log)
    results = [Result("tiny", Workload(name, "throughput", 1, 1, 1, 1), 1.0, 1.0, 1.0, 1.0,
                      1.0, None, steps) for name, steps in (("first", (0, 4)), ("second", (4, 10)))]
    print_step_log(tmp_path / "steps.npy", "tiny", results)
    out = capsys.readouterr().out
    first, second = out.split("step log tiny second")
    assert "step log tiny first: 4 of its 4 steps" in first and "| 128 | 4 |" in first
    assert "2048" not in first and "| 2048 | 6 |" in second
    print_step_log(tmp_path / "absent.npy", "tiny", results)
    assert "no step log" in capsys.readouterr().out


def test_every_column_of_the_summary_is_its_fields_mean_and_the_gap_a_median():
    """Each field in its own column (no two alike, so a column showing another's field shows),
    the gap to the next step the median (a skewed set, where the mean differs) of the gaps
    there are, a gap of 0 among them (back to back) and the last step's missing one not; the
    table's rows in the header's columns. Hand-computed from the records below."""
    #        start build forward finish schedule (µs)  bucket tokens seqs rows retries
    steps = [(1000, 10, 100, 20, 5, 64, 10, 2, 3, 0),     # ends 1130: gap 70
             (1200, 30, 300, 40, 7, 64, 30, 4, 5, 2),     # ends 1570: gap 0
             (1570, 50, 500, 60, 11, 256, 200, 8, 9, 1),  # ends 2180: gap 820
             (3000, 20, 200, 30, 9, 64, 20, 6, 7, 1)]     # ends 3250: the last, no gap
    r = np.zeros(len(steps), STEP_RECORD_DTYPE)
    for i, (start, build, forward, finish, schedule, *counts) in enumerate(steps):
        r[i]["start_ns"], r[i]["build_ns"], r[i]["forward_ns"] = start * 1000, build * 1000, \
            forward * 1000
        r[i]["finish_ns"], r[i]["schedule_ns"] = finish * 1000, schedule * 1000
        for name, value in zip(("bucket", "tokens", "seqs", "rows", "launch_retries"), counts):
            r[i][name] = value
    span = 3250 - 1000
    want = [dict(bucket=64, steps=3, share=(130 + 370 + 250) / span, tokens=20, seqs=4,
                 rows=5, schedule_us=7, build_us=20, forward_ms=0.2, finish_us=30,
                 gap_us=35, retries=1),
            dict(bucket=256, steps=1, share=610 / span, tokens=200, seqs=8, rows=9,
                 schedule_us=11, build_us=50, forward_ms=0.5, finish_us=60, gap_us=820,
                 retries=1),
            dict(bucket="all", steps=4, share=1360 / span, tokens=65, seqs=5, rows=6,
                 schedule_us=8, build_us=27.5, forward_ms=0.275, finish_us=37.5, gap_us=70,
                 retries=1)]
    rows = summarize(r)
    assert rows == [pytest.approx(row) for row in want]
    lines = format_table(rows).splitlines()
    assert len({line.count("|") for line in lines}) == 1  # every row in the header's columns
    assert lines[2] == "| 64 | 3 | 33.3% | 20.0 | 4.0 | 7.0 | 20.0 | 0.200 | 30.0 | 35.0 | 1.0 |"
    assert lines[4] == "| all | 4 | 60.4% | 65.0 | 5.0 | 8.0 | 27.5 | 0.275 | 37.5 | 70.0 | 1.0 |"


def test_a_workload_that_ended_before_the_wrapped_log_begins_has_no_steps_in_it():
    """Steps 85 .. 87 of 100, from a log holding the last 10 (90 .. 99): none (the range's end,
    2 before the log's first step, was read as 2 before the log's end: its first 8 steps); a
    range that straddles the log's first step has the steps from there."""
    from blink.gpu_engine.step_log import select_steps
    wrapped = records(10, first=90)
    assert len(select_steps(wrapped, 100, 85, 88)) == 0
    assert len(select_steps(wrapped, 100, 85, 90)) == 0
    np.testing.assert_array_equal(select_steps(wrapped, 100, 85, 92), records(2, first=90))
