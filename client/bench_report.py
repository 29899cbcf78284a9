"""The benchmark's output: one JSON file per invocation, a summary table, and PNG plots.

JSON schema "blink-bench/1" (bench.json):
    schema        "blink-bench/1"
    complete      false while the benchmark runs (the file is rewritten after every run)
    created       ISO 8601 time
    host          {"cpus": usable CPU count, "platform": str}
    config        the invocation: dataset, num_prompts, request_rates, burstiness, concurrency,
                  seed, slo {"ttft_ms", "tpot_ms"}, cpu_hog, hog_rates, hog_memory, hog
                  (in words), server_cores, client_cores, repeats, systems, model, engine_arg
    runs          one per (system, interference, rate, repeat), in the order they ran:
        system        "blink" | "host-cuda" | "hf" | "hf-static" | "synthetic" | "target" (a
                      server given by --target)
        engine        the engine the server reports (ModelInfo.engine)
        interference  "idle" | "busy" (the --cpu-hog processes running)
        rate          requests per second, or "inf"
        repeat        0, 1, ...
        metrics       bench_metrics.summarize: requests, completed, failed, errors,
                      short_outputs, prompt_tokens, output_tokens, streamed_tokens,
                      cached_prompt_tokens (the prompts' tokens the server's prefix cache
                      held: 0, as each run has a cache salt of its own), wall_s,
                      request_throughput, output_throughput, streamed_throughput (also the
                      tokens of failed and cut requests), total_token_throughput (per second),
                      goodput (requests
                      per second within the SLO, null without one), and ttft_ms, tpot_ms,
                      itl_ms, e2e_ms as {"mean", "p50", "p90", "p99"}; decode_tpot_ms
                      (the mean inter-token gap while no prompt was being prefilled, null
                      without one) over decode_gaps such gaps
        client        {"process_cpu_s", "loop_busy" (the event loop's share of one core),
                       "saturated" (loop_busy > 0.9: the client may have been the bottleneck)}
        server        the engine counters' change over the run (GetServerStats: engine_steps,
                      engine_busy_ns, engine_step_tokens, preemptions), or {} if unavailable;
                      for started servers also engine_cpu_s, frontend_cpu_s (its workers too)
                      and frontend_cpu_us_per_token (front-end CPU per streamed token)
        requests      per request: prompt_len, output_len, tokens, ttft_ms, tpot_ms, e2e_ms,
                      error
    interference  per (system, rate, repeat) run both idle and busy: busy / idle ratios of
                  ttft_p99, tpot_p99 (null where either run had a failed request) and
                  output_throughput (the streamed throughput's ratio)
The plots' throughput axis and the interference ratios use the streamed throughput: it equals
the completed-token throughput when no request failed, and stays meaningful for a peer whose run
was cut by --run-timeout.
"""
from __future__ import annotations

import json
import math
import os
import platform
from datetime import datetime, timezone
from pathlib import Path

from blink.client.bench_load import RequestRecord

SCHEMA = "blink-bench/1"
LOOP_SATURATED = 0.9


def streamed_throughput(metrics: dict) -> float:
    """Generated tokens/s the client received (files written before this field: completed)."""
    return metrics.get("streamed_throughput", metrics["output_throughput"])


def rate_label(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


def request_rows(records: list[RequestRecord]) -> list[dict]:
    rows = []
    for r in records:
        t = r.token_times
        rows.append({
            "prompt_len": r.prompt_len, "output_len": r.output_len, "tokens": r.tokens,
            "ttft_ms": (t[0] - r.sent) * 1e3 if t else None,
            "tpot_ms": (t[-1] - t[0]) / (len(t) - 1) * 1e3 if len(t) > 1 else None,
            "e2e_ms": (t[-1] - r.sent) * 1e3 if t else None, "error": r.error})
    return rows


def interference_ratios(runs: list[dict]) -> list[dict]:
    idle = {(r["system"], r["rate"], r["repeat"]): r for r in runs
            if r["interference"] == "idle"}
    out = []
    for busy in (r for r in runs if r["interference"] == "busy"):
        base = idle.get((busy["system"], busy["rate"], busy["repeat"]))
        if base is None:
            continue

        def ratio(get):
            a, b = get(busy["metrics"]), get(base["metrics"])
            return a / b if a is not None and b else None
        # a run with failed (or cut) requests has latencies of the few that completed, the
        # quick ones first: their P99s are no run's, so no latency ratio from them
        whole = not busy["metrics"]["failed"] and not base["metrics"]["failed"]
        out.append({"system": busy["system"], "rate": busy["rate"], "repeat": busy["repeat"],
                    "ttft_p99": ratio(lambda m: m["ttft_ms"]["p99"]) if whole else None,
                    "tpot_p99": ratio(lambda m: m["tpot_ms"]["p99"]) if whole else None,
                    "output_throughput": ratio(streamed_throughput)})
    return out


def document(config: dict, runs: list[dict], complete: bool = True) -> dict:
    return {"schema": SCHEMA, "complete": complete,
            "created": datetime.now(timezone.utc).isoformat(),
            "host": {"cpus": len(os.sched_getaffinity(0)), "platform": platform.platform()},
            "config": config, "runs": runs, "interference": interference_ratios(runs)}


def write_json(doc: dict, path: Path) -> None:
    """Whole or not at all: a run killed while it writes keeps the previous file."""
    part = path.with_name(path.name + ".part")
    try:
        with open(part, "w") as f:
            f.write(json.dumps(doc, indent=1))
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, path)
    finally:
        part.unlink(missing_ok=True)


def _ms(v) -> str:
    return "" if v is None else f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def summary_table(doc: dict) -> str:
    lines = ["| system | CPU | rate (req/s) | run | req/s | output tok/s | TTFT p50 / p99 (ms) "
             "| TPOT p50 / p99 (ms) | ITL p99 (ms) | E2E p99 (ms) | goodput | failed |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in doc["runs"]:
        m = r["metrics"]
        goodput = "" if m["goodput"] is None else f"{m['goodput']:.2f}"
        flag = " (client saturated)" if r["client"]["saturated"] else ""
        if m["failed"]:
            flag = f" (streamed {streamed_throughput(m):,.0f}){flag}"
        lines.append(
            f"| {r['system']} | {r['interference']} | {r['rate']} | {r['repeat'] + 1} | "
            f"{m['request_throughput']:.2f} | {m['output_throughput']:,.0f}{flag} | "
            f"{_ms(m['ttft_ms']['p50'])} / {_ms(m['ttft_ms']['p99'])} | "
            f"{_ms(m['tpot_ms']['p50'])} / {_ms(m['tpot_ms']['p99'])} | "
            f"{_ms(m['itl_ms']['p99'])} | {_ms(m['e2e_ms']['p99'])} | {goodput} | "
            f"{m['failed']} |")
    if doc["interference"]:
        lines += ["", "| system | rate | run | busy/idle: TTFT p99 | TPOT p99 | throughput |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for x in doc["interference"]:
            def f(v):
                return "" if v is None else f"{v:.2f}"
            lines.append(f"| {x['system']} | {x['rate']} | {x['repeat'] + 1} | "
                         f"{f(x['ttft_p99'])} | {f(x['tpot_p99'])} | "
                         f"{f(x['output_throughput'])} |")
    return "\n".join(lines)


def completed_values(rows: list[dict], key: str) -> list[float]:
    """request_rows' `key` of the requests that completed: what the summary's figures count
    (a failed or cut request's TTFT and TPOT are not a latency the server gave)."""
    return [q[key] for q in rows if q[key] is not None and q["error"] is None]


def plot(doc: dict, out_dir: Path) -> list[Path]:
    """latency_throughput.png, cdf.png and (with interference runs) interference.png."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    runs, written = doc["runs"], []
    series: dict[tuple, list] = {}
    for r in runs:
        series.setdefault((r["system"], r["interference"], r["repeat"]), []).append(r)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for (system, cpu, repeat), rs in series.items():
        rs = sorted(rs, key=lambda r: streamed_throughput(r["metrics"]))
        x = [streamed_throughput(r["metrics"]) for r in rs]
        label = f"{system} ({cpu} CPU" + (f", run {repeat + 1})" if repeat else ")")
        style = "-o" if cpu == "idle" else "--x"
        for ax, key in zip(axes, ("ttft_ms", "tpot_ms")):
            ax.plot(x, [r["metrics"][key]["p99"] for r in rs], style, label=label)
    for ax, title in zip(axes, ("P99 time to first token", "P99 time per output token")):
        ax.set(xlabel="generated tokens/s", ylabel="ms", title=title, yscale="log")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    written.append(out_dir / "latency_throughput.png")
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)

    # CDFs at each system's highest-rate idle run
    top: dict[str, dict] = {}
    for r in sorted((r for r in runs if r["interference"] == "idle" and r["repeat"] == 0),
                    key=lambda r: math.inf if r["rate"] == "inf" else r["rate"]):
        top[r["system"]] = r  # the last, highest rate wins
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for system, r in top.items():
        for ax, key in zip(axes, ("ttft_ms", "tpot_ms")):
            v = np.sort(completed_values(r["requests"], key))
            if v.size:
                ax.plot(v, np.arange(1, v.size + 1) / v.size,
                        label=f"{system} (rate {r['rate']})")
    for ax, title in zip(axes, ("time to first token", "time per output token")):
        ax.set(xlabel="ms", ylabel="fraction of requests", title=f"CDF: {title}", xscale="log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    written.append(out_dir / "cdf.png")
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)

    if doc["interference"]:
        rows = doc["interference"]
        labels = [f"{x['system']}\nrate {x['rate']}" + (f" #{x['repeat'] + 1}" if x["repeat"]
                                                         else "") for x in rows]
        fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(rows)), 4.2))
        pos = np.arange(len(rows))
        for i, (key, name) in enumerate((("ttft_p99", "P99 TTFT"), ("tpot_p99", "P99 TPOT"),
                                         ("output_throughput", "throughput"))):
            ax.bar(pos + (i - 1) * 0.27, [x[key] or 0 for x in rows], 0.27, label=name)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set(xticks=pos, ylabel="busy CPU / idle CPU",
               title=f"CPU interference ({doc['config'].get('cpu_hog')} hog processes)")
        ax.set_xticklabels(labels, fontsize=7)
        ax.legend(fontsize=7)
        fig.tight_layout()
        written.append(out_dir / "interference.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    else:  # an earlier run's, in a reused --out, would pass for this one's
        (out_dir / "interference.png").unlink(missing_ok=True)
    return written
