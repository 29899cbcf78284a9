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
the run's mean context (prompt + output / 2) over the device-to-device copy rate measured first,
in the formats the engine's flags serve (served_formats: --quantization, --no-fp8-lm-head and
--kv-cache-dtype, also when given through --engine-flag).
Prefill workloads (one request, one output token) print prompt tokens / TTFT.

Every workload also prints the GPU's SM clock and power over its run (gpu_monitor.py, NVML): a
sustained run meets the board's power limit and runs at a lower clock than a short one.

Cold by construction: each request of the decode, throughput and prefill workloads is random
token ids drawn for it alone, every workload of a run from a seed of its own (its place in the
run), so no two prompts sent to one server share their first KV block and none takes anything
from the engine's prefix cache (on by default): every prompt is computed whole, as the figures
above assume (an 8,000-token prompt's first token is the time to prefill all of it). Each
server gets one warm-up request first (random tokens from a seed no workload uses), so the
first workload's first request does not carry the server's first-request costs.

The prefix suite measures that cache, on a server started as for the others:
- shared prefix: requests sent one at a time, alternately cold (random from the first token)
  and warm (one 2,000-token prefix that the first cold request put in the cache, then 100
  tokens of their own), a few output tokens each: the median TTFT of each kind, warm / cold
  (the target: at most 10%), and the prompt tokens each request was served from the cache
  (what the engine reports, Timings.cached_prompt_tokens); then the same with an 8,000-token
  prefix (a long system prompt or document: the lookup walks 500 cached blocks). Beside the
  server's own TTFT, the client's and gRPC's share (the client's TTFT minus the server's own)
  and its floor: the warm requests sent again, by the same client code, to a bare gRPC server
  that waits as long as the engine took and answers (bench_grpc_floor.py).
- chat: 32 conversations at once, 8 turns each; a turn sends the whole conversation so far
  (the previous turn's prompt, its reply, 100 new user tokens) and generates 128 tokens:
  generated tokens/s over the run, TTFT and TPOT medians, and the share of prompt tokens
  served from the cache.
--compare-prefix-caching runs the suites again on a server restarted with
--no-prefix-caching, and the tables print each workload's two runs one after the other:

    python -m blink.client.bench_serving --shapes llama-3.1-8b --suite prefix \
        --compare-prefix-caching

--step-log: the engine also times each step's phases on the GPU (`--step-log`, see
gpu_engine/step_log.py); once it stops, each workload's steps are printed by forward graph:
batch description, forward pass, samples, and the scheduler's own time between steps.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import math
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from blink.client.bench_data import BenchRequest, chat_user_turns, random_requests, \
    shared_prefix_requests, warm_up_request
from blink.client.bench_grpc_floor import floor_server
from blink.client.bench_load import RequestRecord, run_conversations, run_requests
from blink.client.bench_metrics import full_batch_gaps_ms, summarize
from blink.client.bench_server import Server, shape_folder
from blink.client.sdk import BlinkClient, Sampling
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

    def draw(self, vocab_size: int, seed: int) -> list[BenchRequest]:
        """Its requests: random prompts from `seed` (one a workload of a run: the module doc)."""
        return random_requests(self.requests, self.prompt_tokens, self.output_tokens,
                               vocab_size, seed=seed)


@dataclass(frozen=True)
class SharedPrefix:
    """Cold and warm requests sent one at a time, alternately (see the module doc)."""
    name: str
    pairs: int             # cold requests, and as many warm ones
    prefix_tokens: int     # the warm ones' shared prefix
    own_tokens: int        # after it, each request's own
    output_tokens: int

    def run(self, target: str, shape: str, vocab_size: int, seed: int) -> SharedPrefixResult:
        requests = shared_prefix_requests(self.pairs, self.prefix_tokens, self.own_tokens,
                                          self.output_tokens, vocab_size, seed=seed)
        records, _, _ = asyncio.run(run_requests(target, requests, concurrency=1))
        result = SharedPrefixResult(shape, self, cold=records[0::2], warm=records[1::2])
        # the warm requests again, to a bare gRPC server that waits as long as the engine did
        with floor_server(statistics.median(r.server_ttft_s for r in result.warm)) as floor:
            result.floor, _, _ = asyncio.run(run_requests(floor, requests[1::2],
                                                          concurrency=1))
        return result


@dataclass(frozen=True)
class Chat:
    """Multi-turn conversations at once, each turn the whole conversation so far (the module
    doc, bench_load.run_conversations)."""
    name: str
    conversations: int
    turns: int
    user_tokens: int       # new user tokens a turn
    output_tokens: int     # the reply generated a turn

    def run(self, target: str, shape: str, vocab_size: int, seed: int) -> ChatResult:
        user_turns = chat_user_turns(self.conversations, self.turns, self.user_tokens,
                                     vocab_size, seed=seed)
        conversations, wall = asyncio.run(run_conversations(target, user_turns,
                                                            self.output_tokens))
        return ChatResult(shape, self, [r for c in conversations for r in c], wall)


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
    # the prefix cache (module doc); on the 8B shape, an H200: about 8 s of requests with the
    # cache and 13 without, most of it the chat (with --compare-prefix-caching, 44 s in all,
    # the copy-rate check and the two engine starts included), before the shared prefixes' pairs
    # went from 8 and 4 to 24 and 8 (about 3 s more): a p50 of 8 warm requests moved by 0.3 ms
    # from call to call, as much as a change to the front end it was to measure
    "prefix": [
        SharedPrefix("shared prefix 2000 + 100", 24, 2000, 100, 4),
        # a long system prompt or document: the lookup walks 500 cached blocks
        SharedPrefix("shared prefix 8000 + 100", 8, 8000, 100, 4),
        Chat("chat 32 x 8 turns of 100 + 128", 32, 8, 100, 128),
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
    prefix_caching: bool = True  # the engine's (off: --no-prefix-caching)

    HEADER = ("| shape | workload | TPOT p50 (ms) | full-batch TPOT, mean (ms) | floor (ms) | "
              "x floor (TPOT, full-batch TPOT) | TTFT p50 (ms) | generated tok/s | engine "
              "ms/step | tokens/step | SM MHz, W (power-capped) |")

    def line(self) -> str:
        w = self.workload
        parts = [f"bench serving {self.shape} {label(self)}:"]
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
        return " ".join(parts) + gpu_note(self.gpu, self.generated_tokens)

    def row(self) -> str:
        ratios = (f"{_ratio(self.tpot_ms, self.floor_ms)}, "
                  f"{_ratio(self.full_batch_tpot_ms, self.floor_ms)}" if self.floor_ms else "")
        floor = _ms(self.floor_ms) if self.floor_ms else ""
        return (f"| {self.shape} | {label(self)} | {_ms(self.tpot_ms)} | "
                f"{_ms(self.full_batch_tpot_ms)} | {floor} | {ratios} | {self.ttft_ms:.1f} | "
                f"{self.tokens_per_s:,.0f} | {self.engine_step_ms:.3f} | "
                f"{self.tokens_per_step:.1f} | {gpu_cell(self.gpu)} |")


@dataclass
class SharedPrefixResult:
    shape: str
    workload: SharedPrefix
    cold: list[RequestRecord]  # in the order sent
    warm: list[RequestRecord]
    step_range: tuple[int, int] = (0, 0)  # as Result's
    gpu: GpuClocks | None = None
    prefix_caching: bool = True
    floor: list[RequestRecord] = field(default_factory=list)  # the warm ones, bench_grpc_floor

    HEADER = ("| shape | workload | TTFT p50 cold (ms) | TTFT p50 warm (ms) | warm / cold | "
              "client and gRPC, warm (their floor) (ms) | "
              "cached prompt tokens a request, warm (cold) | SM MHz, W (power-capped) |")

    @property
    def cold_ttft_ms(self) -> float:
        return summarize(self.cold, wall_s=0.0)["ttft_ms"]["p50"]  # (no throughput wanted)

    @property
    def warm_ttft_ms(self) -> float:
        return summarize(self.warm, wall_s=0.0)["ttft_ms"]["p50"]

    def line(self) -> str:
        w = self.workload
        server = [statistics.median(r.server_ttft_s for r in rs) * 1e3
                  for rs in (self.cold, self.warm)]
        return (f"bench serving {self.shape} {label(self)}: TTFT p50 cold "
                f"{self.cold_ttft_ms:.1f} ms, warm {self.warm_ttft_ms:.1f} ms, warm / cold "
                f"{self.warm_ttft_ms / self.cold_ttft_ms:.1%} (target <= 10%); the server's "
                f"own (from the request's receipt) cold {server[0]:.1f} ms, warm "
                f"{server[1]:.1f} ms; the client and gRPC, warm {client_path_ms(self.warm):.2f}"
                f" ms (a bare gRPC server after the same wait: "
                f"{client_path_ms(self.floor):.2f}); cached prompt tokens a request: warm "
                f"{_counts(self.warm)} of {w.prefix_tokens + w.own_tokens:,}, cold "
                f"{_counts(self.cold)}" + gpu_note(self.gpu))

    def row(self) -> str:
        return (f"| {self.shape} | {label(self)} | {self.cold_ttft_ms:.1f} | "
                f"{self.warm_ttft_ms:.1f} | {self.warm_ttft_ms / self.cold_ttft_ms:.1%} | "
                f"{client_path_ms(self.warm):.2f} ({client_path_ms(self.floor):.2f}) | "
                f"{_counts(self.warm)} ({_counts(self.cold)}) | {gpu_cell(self.gpu)} |")


def client_path_ms(records: list[RequestRecord]) -> float:
    """The median of the client's TTFT minus the server's own (what the final's timings say):
    gRPC both ways and the client's side."""
    return statistics.median((r.token_times[0] - r.sent - r.server_ttft_s) * 1e3
                             for r in records)


@dataclass
class ChatResult:
    shape: str
    workload: Chat
    turns: list[RequestRecord]  # every conversation's, one conversation after another
    wall_s: float
    step_range: tuple[int, int] = (0, 0)  # as Result's
    gpu: GpuClocks | None = None
    prefix_caching: bool = True

    HEADER = ("| shape | workload | generated tok/s | TTFT p50 (ms) | TPOT p50 (ms) | prompt "
              "tokens from the cache | SM MHz, W (power-capped) |")

    @functools.cached_property
    def metrics(self) -> dict:
        return summarize(self.turns, self.wall_s)

    @property
    def cached_share(self) -> float:
        return (sum(r.cached_prompt_tokens for r in self.turns)
                / max(1, sum(r.prompt_len for r in self.turns)))

    def line(self) -> str:
        m = self.metrics
        return (f"bench serving {self.shape} {label(self)}: {m['output_throughput']:,.0f} "
                f"generated tokens/s, TTFT p50 {m['ttft_ms']['p50']:.1f} ms, TPOT p50 "
                f"{_ms(m['tpot_ms']['p50'])} ms; {self.cached_share:.1%} of "
                f"{m['prompt_tokens']:,} prompt tokens from the cache"
                + gpu_note(self.gpu, m["output_tokens"]))

    def row(self) -> str:
        m = self.metrics
        return (f"| {self.shape} | {label(self)} | {m['output_throughput']:,.0f} | "
                f"{m['ttft_ms']['p50']:.1f} | {_ms(m['tpot_ms']['p50'])} | "
                f"{self.cached_share:.1%} | {gpu_cell(self.gpu)} |")


def full_batch_tpot_ms(records, streams: int) -> float | None:
    """The mean gap (ms) while all `streams` of the workload decode; None for none."""
    gaps = full_batch_gaps_ms(records, streams)
    return float(gaps.mean()) if gaps.size else None


def check_completed(name: str, metrics: dict) -> None:
    """Raises when a request of the workload failed: its figures would mislead."""
    if metrics["failed"]:
        raise RuntimeError(f"{name}: {metrics['failed']} requests failed: {metrics['errors']}")


@dataclass(frozen=True)
class ServedFormats:
    """What the engine's weights, LM head and KV cache are served in (the floors' bytes)."""
    weights_fp8: bool = False
    lm_head_fp8: bool = False
    kv_fp8: bool = False


def served_formats(flags: list[str]) -> ServedFormats:
    """The formats an engine started with `flags` on a shape's folder (a bf16 config: the flags
    alone decide) serves, read by the engine's own argument parser: the last of a repeated
    flag wins there as here."""
    from blink.client.cli import build_parser
    args = build_parser().parse_args(["engine", *flags])
    fp8 = args.quantization == "fp8"
    # (the shapes' dummy weights are converted: their LM head is FP8 unless told otherwise)
    return ServedFormats(fp8, fp8 and args.fp8_lm_head is not False,
                         args.kv_cache_dtype == "fp8")


def decode_floor_bytes(shape: str, w: Workload, formats: ServedFormats):
    """roofline.StepBytes of one decode step of w: `concurrency` sequences at its mean
    context."""
    from blink.gpu_engine.bench_decode import SHAPES
    from blink.gpu_engine.roofline import decode_step_bytes
    return decode_step_bytes(SHAPES[shape], [w.mean_context] * w.concurrency,
                             formats.weights_fp8, formats.kv_fp8, formats.lm_head_fp8)


def warm_up(target: str) -> None:
    """One short request before the workloads (the module doc); raises if it fails."""
    with BlinkClient(target) as client:
        request = warm_up_request(16, client.model_info().vocab_size)
        client.generate(list(request.prompt), Sampling(max_tokens=request.output_len,
                                                       temperature=0.0, ignore_eos=True))


def run_workload(server: Server, shape: str, w: Workload, bandwidth: float,
                 monitor: GpuMonitor, formats: ServedFormats = ServedFormats(),
                 seed: int = 0) -> Result:
    with BlinkClient(server.target) as client:
        since = monitor.mark()
        before = client.stats()
        info = client.model_info()
        records, wall, _ = asyncio.run(run_requests(server.target,
                                                    w.draw(info.vocab_size, seed),
                                                    rate=math.inf, concurrency=w.concurrency))
        after = client.stats()
    m = summarize(records, wall)
    check_completed(w.name, m)
    steps = max(1, after["engine_steps"] - before["engine_steps"])
    floor = None
    if w.kind == "decode":
        floor = decode_floor_bytes(shape, w, formats).total / bandwidth * 1e3
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


def run_prefix_workload(server: Server, shape: str, w: SharedPrefix | Chat,
                        monitor: GpuMonitor, seed: int) -> SharedPrefixResult | ChatResult:
    """w's run on the server, with the engine's steps and the GPU over it."""
    with BlinkClient(server.target) as client:
        since = monitor.mark()
        before = client.stats()["engine_steps"]
        result = w.run(server.target, shape, client.model_info().vocab_size, seed)
        result.step_range = (before, client.stats()["engine_steps"])
    records = result.turns if isinstance(result, ChatResult) else result.cold + result.warm
    check_completed(w.name, summarize(records, wall_s=0.0))
    result.gpu = monitor.summary(since)
    return result


def run_server(shape: str, folder: Path, workdir: Path, flags: list[str], workloads: list,
               bandwidth: float, monitor: GpuMonitor, args: argparse.Namespace) -> list:
    """Every workload, in order, on one server started with the engine flags; their results."""
    prefix_caching = "--no-prefix-caching" not in flags
    step_log = workdir / f"steps-{shape}{'' if prefix_caching else '-no-prefix-caching'}.npy"
    if args.step_log:
        flags = [*flags, "--step-log", str(step_log)]
    formats = served_formats(flags)
    t0 = time.monotonic()
    server = Server(folder, workdir, flags)
    print(f"bench serving {shape}: engine up in {time.monotonic() - t0:.0f} s "
          f"({' '.join(flags)})", flush=True)
    results = []
    try:
        warm_up(server.target)
        # each workload's prompts from a seed of its own: no prompt of one is in the prefix
        # cache from another (the module doc)
        for seed, w in enumerate(workloads):
            if isinstance(w, Workload):
                result = run_workload(server, shape, w, bandwidth, monitor, formats, seed)
            else:
                result = run_prefix_workload(server, shape, w, monitor, seed)
            result.prefix_caching = prefix_caching
            results.append(result)
            print(result.line(), flush=True)
    finally:
        server.stop()
    if args.step_log:
        print_step_log(step_log, shape, results)
    return results


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
                             "count their bytes (and the LM head's in bf16 with "
                             "--engine-flag=--no-fp8-lm-head)")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                        help="the engine's --kv-cache-dtype; the floors count its bytes")
    parser.add_argument("--engine-flag", action="append", default=[],
                        help="extra flag for the engine (repeatable), e.g. --engine-flag=--x")
    parser.add_argument("--compare-prefix-caching", action="store_true",
                        help="run the suites again on a server restarted with "
                             "--no-prefix-caching; each workload's two runs print together")
    parser.add_argument("--step-log", action="store_true",
                        help="time each step's phases on the GPU and print every workload's "
                             "steps by forward graph once the engine stops")
    args = parser.parse_args(argv)
    from blink.gpu_engine.bench_decode import SHAPES, copy_bandwidth
    unknown = set(args.shapes) - set(SHAPES)
    if unknown:
        parser.error(f"unknown shapes {sorted(unknown)}; choose from {sorted(SHAPES)}")
    if args.compare_prefix_caching and "--no-prefix-caching" in args.engine_flag:
        parser.error("--compare-prefix-caching runs with prefix caching and without: "
                     "leave out --engine-flag=--no-prefix-caching")
    bandwidth = copy_bandwidth()
    print(f"bench copy bandwidth: {bandwidth / 1e12:.2f} TB/s (device-to-device, read + write)")
    workloads = [w for suite in args.suite for w in SUITES[suite]]
    caching_flags = [[], ["--no-prefix-caching"]] if args.compare_prefix_caching else [[]]
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
            for caching in caching_flags:
                results += run_server(shape, folder, Path(tmp), flags + caching, workloads,
                                      bandwidth, monitor, args)
    print_tables(results, args.shapes, workloads)


def print_tables(results: list, shapes: list[str], workloads: list) -> None:
    """A markdown table for each kind of result, by shape and workload: a workload's runs with
    and without prefix caching one after the other."""
    results = sorted(results, key=lambda r: (shapes.index(r.shape), workloads.index(r.workload)))
    for kind in (Result, SharedPrefixResult, ChatResult):
        rows = [r.row() for r in results if isinstance(r, kind)]
        if rows:
            columns = kind.HEADER.count(" | ") + 1
            print(f"\n{kind.HEADER}\n|{' --- |' * columns}")
            print("\n".join(rows))


def label(result: Result | SharedPrefixResult | ChatResult) -> str:
    """The workload's name, which says when the engine ran without prefix caching."""
    return result.workload.name + ("" if result.prefix_caching else " (no prefix caching)")


def _counts(records: list[RequestRecord]) -> str:
    """The requests' cached prompt tokens: one number when they all had the same."""
    low = min(r.cached_prompt_tokens for r in records)
    high = max(r.cached_prompt_tokens for r in records)
    return f"{low:,}" if low == high else f"{low:,}-{high:,}"


def gpu_note(gpu: GpuClocks | None, generated_tokens: int = 0) -> str:
    """A result line's GPU clock and power over the workload; "" when not read."""
    if gpu is None:
        return ""
    per_token = (f", {gpu.energy_j / generated_tokens * 1e3:.1f} mJ a generated token"
                 if gpu.energy_j and generated_tokens else "")
    return f" [{gpu.describe()}{per_token}]"


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
        print(f"\nstep log {shape} {label(r)}: {len(steps)} of its {last - first} steps")
        print(format_table(summarize(steps)))


if __name__ == "__main__":
    main()
