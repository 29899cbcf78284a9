"""The CUDA engine's step log: where a live engine's time goes, step by step.

`blink engine --step-log PATH` (or `blink serve --step-log PATH`) has the scheduler kernel time
each step that runs a forward pass (engine_layout.StepRecord: the batch description, the forward
graph from launch to its done counter, the samples' publication) into device memory; the engine
writes the records to PATH (a NumPy .npy file) when it stops. Then

    python -m blink.gpu_engine.step_log PATH

prints them by forward graph (token bucket): steps, tokens and sequences a step, each phase's
time, the iteration's work before the step (admission, cancels, scheduling: prefix cache
lookups), and the scheduler's own time between steps (that, and idle polling where the engine
had nothing to do). The forward column is what bench_decode's graph replays
measure for the same bucket, there beside a CTA holding the scheduler's SM.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from blink.gpu_engine.engine_layout import STEP_RECORD_DTYPE

# Steps a step log keeps (the last ones): 10 MiB of device memory, minutes of a busy engine.
STEP_LOG_CAPACITY = 1 << 18

# StepRecord's layout without the header comments its dtype carries (.npy files drop them, and
# NumPy warns that it does)
FILE_DTYPE = np.dtype({"names": list(STEP_RECORD_DTYPE.names),
                       "formats": [STEP_RECORD_DTYPE.fields[n][0].str
                                   for n in STEP_RECORD_DTYPE.names],
                       "offsets": [STEP_RECORD_DTYPE.fields[n][1]
                                   for n in STEP_RECORD_DTYPE.names],
                       "itemsize": STEP_RECORD_DTYPE.itemsize})


def save_step_log(path: Path, records: np.ndarray) -> int:
    """Writes the steps the engine's log holds (all of them, or the last len(records) once the
    ring wrapped), oldest first, and returns how many. The order comes from the records' own
    start times (a record never written starts at 0), not from a step count read elsewhere,
    which could lag the log by a step."""
    kept = records[records["start_ns"] != 0]
    ordered = kept[np.argsort(kept["start_ns"], kind="stable")]
    with open(path, "wb") as f:
        np.save(f, np.ascontiguousarray(ordered).view(FILE_DTYPE))
    return len(ordered)


def load_step_log(path: Path) -> np.ndarray:
    records = np.load(path, allow_pickle=False)
    if records.dtype != FILE_DTYPE:
        raise ValueError(f"{path}: not a step log ({records.dtype})")
    return records


def select_steps(records: np.ndarray, total_steps: int, first: int, last: int) -> np.ndarray:
    """Steps first .. last - 1 of an engine that ran total_steps, from its log (which holds the
    last len(records) of them): those the log still holds. A log that never wrapped holds
    every step: then total_steps = len(records), whatever a counter read earlier said."""
    kept_first = total_steps - len(records)
    return records[max(first, kept_first) - kept_first:max(last, kept_first) - kept_first]


def summarize(records: np.ndarray) -> list[dict]:
    """One row per bucket (ascending), then 'all': steps, their share of the logged time, means
    per step of tokens, sequences and each phase, and the median gap to the next step."""
    if len(records) == 0:
        return []
    r = records
    end = r["start_ns"] + r["build_ns"] + r["forward_ns"] + r["finish_ns"]
    # the scheduler's time before the next step (the last step has none)
    gap = np.append(r["start_ns"][1:].astype(np.int64) - end[:-1].astype(np.int64), -1)
    span = int(end[-1] - r["start_ns"][0])
    rows = []
    for bucket in [*np.unique(r["bucket"]), None]:
        sel = np.ones(len(r), bool) if bucket is None else r["bucket"] == bucket
        s, g = r[sel], gap[sel]
        step_ns = (s["build_ns"].astype(np.int64) + s["forward_ns"] + s["finish_ns"])
        rows.append({
            "bucket": "all" if bucket is None else int(bucket),
            "steps": int(sel.sum()),
            "share": float(step_ns.sum() / span) if span > 0 else 1.0,
            "tokens": float(s["tokens"].mean()),
            "seqs": float(s["seqs"].mean()),
            "rows": float(s["rows"].mean()),
            "schedule_us": float(s["schedule_ns"].mean() / 1e3),
            "build_us": float(s["build_ns"].mean() / 1e3),
            "forward_ms": float(s["forward_ns"].mean() / 1e6),
            "finish_us": float(s["finish_ns"].mean() / 1e3),
            "gap_us": float(np.median(g[g >= 0]) / 1e3) if (g >= 0).any() else 0.0,
            "retries": float(s["launch_retries"].mean()),
        })
    return rows


def format_table(rows: list[dict]) -> str:
    head = ("| bucket | steps | share of time | tokens | seqs | schedule (µs) | build (µs) | "
            "forward (ms) | finish (µs) | gap to next (µs, median) | launch retries |")
    lines = [head, "|" + " --- |" * 11]
    for row in rows:
        lines.append(f"| {row['bucket']} | {row['steps']} | {row['share']:.1%} | "
                     f"{row['tokens']:.1f} | {row['seqs']:.1f} | {row['schedule_us']:.1f} | "
                     f"{row['build_us']:.1f} | "
                     f"{row['forward_ms']:.3f} | {row['finish_us']:.1f} | {row['gap_us']:.1f} | "
                     f"{row['retries']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path, help="a step log the engine wrote (--step-log)")
    args = parser.parse_args(argv)
    records = load_step_log(args.path)
    span = (records["start_ns"][-1] - records["start_ns"][0]) / 1e9 if len(records) else 0
    print(f"{len(records)} steps over {span:.3f} s, {int(records['tokens'].sum())} tokens")
    print(format_table(summarize(records)))


if __name__ == "__main__":
    main()
