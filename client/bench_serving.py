"""Serving performance on real model shapes, through the live path: an engine with random
weights in the shape's dimensions (`--load-format dummy`, generated on the GPU) and the
persistent scheduler kernel running, a front end on a real port, requests over gRPC.

    python -m blink.client.bench_serving [--shapes llama-3.1-8b llama-3.2-1b] [--suite ...]

Per workload: time per output token at the client (TPOT: (last token - first token) / (n - 1),
per request, median), full-batch TPOT (the mean gap between tokens while all the workload's
streams decode, bench_metrics.full_batch_gaps_ms: the streams arrive together, so their TPOT
also holds the steps that prefilled the later ones' prompts, and their last tokens come from
steps of fewer streams as the first ones finish), time to first token, generated tokens per
second over the run's wall time, and the engine's own time per step from its counters
(d engine_busy_ns / d engine_steps over the run: batch building, forward pass, sampling,
publishing; client and gRPC excluded).
Decode workloads print their floor: roofline.decode_step_bytes for `concurrency` sequences at
the run's mean context (prompt + output / 2) over the device-to-device copy rate measured first.
Prefill workloads (one request, one output token) print prompt tokens / TTFT.

Every workload also prints the GPU's SM clock and power over its run (gpu_monitor.py, NVML): a
sustained run meets the board's power limit and runs at a lower clock than a short one.

--step-log: the engine also times each step's phases on the GPU (`--step-log`, see
gpu_engine/step_log.py); once it stops, each workload's steps are printed by forward graph:
batch description, forward pass, samples, and the scheduler's own time between steps.
"""
from __future__ import annotations

import argparse
import asyncio
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from blink.client.bench_data import random_requests
from blink.client.bench_load import run_requests
from blink.client.bench_metrics import full_batch_gaps_ms, summarize
from blink.client.bench_server import Server, shape_folder
from blink.client.sdk import BlinkClient
from blink.gpu_engine.gpu_monitor import GpuClocks, GpuMonitor


@dataclass(frozen=True)
class Workload:
    name: str
    kind: str              # "decode" | "throughput" | "prefill"
    concurrency: int
    requests: int
    prompt_tokens: int
    output_tokens: int

    @property
    def mean_context(self) -> int:
        return self.prompt_tokens + self.output_tokens // 2


# The points (decode at context ~512, saturation with 256 + 256 requests, long prompts,
# long-context decode) in the order they run; "quick" is a smoke test.
SUITES = {
    "decode": [
        Workload("decode b1 ctx~512", "decode", 1, 3, 384, 256),
        Workload("decode b32 ctx~512", "decode", 32, 32, 384, 256),
    ],
    "saturation": [
        Workload("256+256 x 64 streams", "throughput", 64, 128, 256, 256),
        Workload("256+256 x 128 streams", "throughput", 128, 256, 256, 256),
        Workload("256+256 x 256 streams", "throughput", 256, 512, 256, 256),
    ],
    # Eight requests a stream: long enough that the first wave's burst of prompts and the last
    # wave's drain are a small part of the run, so it shows the engine's sustained rate.
    "sustained": [
        Workload("256+256 x 256 streams, 2048 requests", "throughput", 256, 2048, 256, 256),
    ],
    "long": [
        Workload("prefill 4000", "prefill", 1, 2, 4000, 1),
        Workload("prefill 8000", "prefill", 1, 2, 8000, 1),
        Workload("decode b1 ctx~8192", "decode", 1, 1, 8064, 256),
        Workload("decode b32 ctx~4096", "decode", 32, 32, 3968, 256),
        Workload("4000+64 x 32 streams", "throughput", 32, 32, 4000, 64),
    ],
    "quick": [
        Workload("decode b1 ctx~512", "decode", 1, 2, 384, 128),
        Workload("256+256 x 64 streams", "throughput", 64, 64, 256, 256),
    ],
    # one workload of each target's: one stream, saturation, an 8,000-token prompt
    "targets": [
        Workload("decode b1 ctx~512", "decode", 1, 3, 384, 256),
        Workload("256+256 x 256 streams", "throughput", 256, 512, 256, 256),
        Workload("prefill 8000", "prefill", 1, 2, 8000, 1),
    ],
}


@dataclass
class Result:
    shape: str
    workload: Workload
    tpot_ms: float | None
    ttft_ms: float
    tokens_per_s: float
    engine_step_ms: float
    tokens_per_step: float
    floor_ms: float | None
    step_range: tuple[int, int]  # the engine's step count before and after the workload
    gpu: GpuClocks | None = None  # the SM clock, power, energy over the workload (None: not read)
    generated_tokens: int = 0
    full_batch_tpot_ms: float | None = None  # the gaps while every stream decoded

    def line(self) -> str:
        w = self.workload
        parts = [f"bench serving {self.shape} {w.name}:"]
        if w.kind == "prefill":
            parts.append(f"TTFT {self.ttft_ms:.1f} ms, "
                         f"{w.prompt_tokens / self.ttft_ms * 1e3:,.0f} prefill tokens/s;")
        else:
            parts.append(f"TPOT p50 {_ms(self.tpot_ms)} ms, full-batch TPOT "
                         f"{_ms(self.full_batch_tpot_ms)} ms, TTFT p50 {self.ttft_ms:.1f} ms, "
                         f"{self.tokens_per_s:,.0f} generated tokens/s;")
        parts.append(f"engine {self.engine_step_ms:.3f} ms/step, "
                     f"{self.tokens_per_step:.1f} tokens/step")
        if self.floor_ms:
            parts.append(f"(floor {self.floor_ms:.3f} ms/step at batch {w.concurrency}, context "
                         f"{w.mean_context}; TPOT {_ratio(self.tpot_ms, self.floor_ms)}x, "
                         f"full-batch TPOT {_ratio(self.full_batch_tpot_ms, self.floor_ms)}x "
                         f"floor)")
        if self.gpu is not None:
            per_token = (f", {self.gpu.energy_j / self.generated_tokens * 1e3:.1f} mJ a "
                         f"generated token" if self.gpu.energy_j and self.generated_tokens
                         else "")
            parts.append(f"[{self.gpu.describe()}{per_token}]")
        return " ".join(parts)


def full_batch_tpot_ms(records, streams: int) -> float | None:
    """The mean gap (ms) while all `streams` of the workload decode; None for none."""
    gaps = full_batch_gaps_ms(records, streams)
    return float(gaps.mean()) if gaps.size else None


def run_workload(server: Server, shape: str, w: Workload, bandwidth: float,
                 monitor: GpuMonitor, weights_fp8: bool = False, kv_fp8: bool = False) -> Result:
    from blink.gpu_engine.bench_decode import SHAPES
    from blink.gpu_engine.roofline import decode_step_bytes
    with BlinkClient(server.target) as client:
        since = monitor.mark()
        before = client.stats()
        info = client.model_info()
        requests = random_requests(w.requests, w.prompt_tokens, w.output_tokens,
                                   info.vocab_size)
        records, wall, _ = asyncio.run(run_requests(server.target, requests, rate=math.inf,
                                                    concurrency=w.concurrency))
        after = client.stats()
    m = summarize(records, wall)
    if m["failed"]:
        raise RuntimeError(f"{w.name}: {m['failed']} requests failed: {m['errors']}")
    steps = max(1, after["engine_steps"] - before["engine_steps"])
    floor = None
    if w.kind == "decode":
        need = decode_step_bytes(SHAPES[shape], [w.mean_context] * w.concurrency, weights_fp8,
                                 kv_fp8)
        floor = need.total / bandwidth * 1e3
    return Result(
        shape=shape, workload=w,
        tpot_ms=m["tpot_ms"]["p50"] if w.output_tokens > 1 else None,
        ttft_ms=m["ttft_ms"]["p50"],
        tokens_per_s=m["output_throughput"],
        engine_step_ms=(after["engine_busy_ns"] - before["engine_busy_ns"]) / steps / 1e6,
        tokens_per_step=(after["engine_step_tokens"] - before["engine_step_tokens"]) / steps,
        floor_ms=floor, step_range=(before["engine_steps"], after["engine_steps"]),
        gpu=monitor.summary(since), generated_tokens=m["output_tokens"],
        full_batch_tpot_ms=full_batch_tpot_ms(records, w.concurrency))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["llama-3.1-8b", "llama-3.2-1b"])
    parser.add_argument("--suite", nargs="+", default=["decode", "saturation", "long"],
                        choices=list(SUITES))
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=8448)
    parser.add_argument("--quantization", choices=["fp8"], default=None,
                        help="serve FP8 weights (the engine's --quantization); the floors "
                             "count their bytes")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                        help="the engine's --kv-cache-dtype; the floors count its bytes")
    parser.add_argument("--engine-flag", action="append", default=[],
                        help="extra flag for the engine (repeatable), e.g. --engine-flag=--x")
    parser.add_argument("--step-log", action="store_true",
                        help="time each step's phases on the GPU and print every workload's "
                             "steps by forward graph once the engine stops")
    args = parser.parse_args(argv)
    from blink.gpu_engine.bench_decode import SHAPES, copy_bandwidth
    unknown = set(args.shapes) - set(SHAPES)
    if unknown:
        parser.error(f"unknown shapes {sorted(unknown)}; choose from {sorted(SHAPES)}")
    bandwidth = copy_bandwidth()
    print(f"bench copy bandwidth: {bandwidth / 1e12:.2f} TB/s (device-to-device, read + write)")
    workloads = [w for suite in args.suite for w in SUITES[suite]]
    results = []
    with tempfile.TemporaryDirectory(prefix="blink-bench-") as tmp, \
            GpuMonitor.for_cuda_device(0).reporting("bench serving") as monitor:
        for shape in args.shapes:
            folder = shape_folder(shape, Path(tmp), args.max_model_len)
            flags = ["--engine", "cuda", "--load-format", "dummy",
                     "--slots", str(max(2 * args.max_num_seqs, 128)),
                     "--max-num-seqs", str(args.max_num_seqs),
                     "--max-batched-tokens", str(args.max_batched_tokens),
                     "--max-model-len", str(args.max_model_len),
                     *(["--quantization", args.quantization] if args.quantization else []),
                     "--kv-cache-dtype", args.kv_cache_dtype, *args.engine_flag]
            step_log = Path(tmp) / f"steps-{shape}.npy"
            if args.step_log:
                flags += ["--step-log", str(step_log)]
            t0 = time.monotonic()
            server = Server(folder, Path(tmp), flags)
            print(f"bench serving {shape}: engine up in {time.monotonic() - t0:.0f} s "
                  f"({' '.join(flags)})", flush=True)
            shape_results = []
            try:
                for w in workloads:
                    result = run_workload(server, shape, w, bandwidth, monitor,
                                          args.quantization == "fp8",
                                          args.kv_cache_dtype == "fp8")
                    shape_results.append(result)
                    print(result.line(), flush=True)
            finally:
                server.stop()
            results += shape_results
            if args.step_log:
                print_step_log(step_log, shape, shape_results)
    print("\n| shape | workload | TPOT p50 (ms) | full-batch TPOT, mean (ms) | floor (ms) | "
          "x floor (TPOT, full-batch TPOT) | TTFT p50 (ms) | generated tok/s | engine ms/step "
          "| tokens/step | SM MHz, W (power-capped) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        ratios = (f"{_ratio(r.tpot_ms, r.floor_ms)}, {_ratio(r.full_batch_tpot_ms, r.floor_ms)}"
                  if r.floor_ms else "")
        floor = _ms(r.floor_ms) if r.floor_ms else ""
        print(f"| {r.shape} | {r.workload.name} | {_ms(r.tpot_ms)} | "
              f"{_ms(r.full_batch_tpot_ms)} | "
              f"{floor} | {ratios} | {r.ttft_ms:.1f} | {r.tokens_per_s:,.0f} | "
              f"{r.engine_step_ms:.3f} | {r.tokens_per_step:.1f} | {gpu_cell(r.gpu)} |")


def _ms(value: float | None) -> str:
    return f"{value:.3f}" if value is not None else "n/a"


def _ratio(value: float | None, floor: float | None) -> str:
    return f"{value / floor:.2f}" if value is not None and floor else "n/a"


def gpu_cell(gpu: GpuClocks | None) -> str:
    if gpu is None:
        return ""
    return f"{gpu.sm_mhz_median:,.0f}, {gpu.power_w_median:.0f} ({gpu.power_capped_share:.0%})"


def print_step_log(path: Path, shape: str, results: list[Result]) -> None:
    """Each workload's steps from the engine's step log, by forward graph."""
    from blink.gpu_engine.step_log import STEP_LOG_CAPACITY, format_table, load_step_log, \
        select_steps, summarize
    if not path.exists():
        print(f"bench serving {shape}: no step log (the engine did not stop cleanly)")
        return
    records = load_step_log(path)
    # a log that never wrapped holds every step (the client's last count could lag it by one)
    total = (results[-1].step_range[1] if results and len(records) == STEP_LOG_CAPACITY
             else len(records))
    for r in results:
        first, last = r.step_range
        steps = select_steps(records, total, first, last)
        print(f"\nstep log {shape} {r.workload.name}: {len(steps)} of its {last - first} steps")
        print(format_table(summarize(steps)))


if __name__ == "__main__":
    main()
