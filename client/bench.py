"""`blink bench`: the serving benchmark, measured at the client from the gRPC stream.

    blink bench --target HOST:PORT [workload] [load]          a server that is already running
    blink bench [--model DIR | --shape NAME] --systems blink host-cuda hf [workload] [load]
                [--cpu-hog N] [--out DIR]                     servers it starts, one at a time

Workload (bench_data): --dataset sharegpt (the usual serving benchmarks' convention) or random
prompts of --random-input-len / --random-output-len tokens; --num-prompts of them, the same for
every system. Load (bench_load): --request-rate R [R ...] (a sweep; 'inf' sends all at once),
--burstiness, --concurrency. Every token is timed at the client (bench_metrics) and the run's
JSON (bench_report, schema there), summary table and plots go to --out.

Systems, each behind the same front end and client: blink (the CPU-free CUDA engine, or the CPU
reference engine where there is no GPU), host-cuda (the same kernels and graphs driven by a host
loop: the ablation), hf (Hugging Face transformers' generate, static batching) and hf-static
(transformers' batch-1 fast path: a static KV cache, the decoding step compiled on a GPU).
--cpu-hog N repeats every run
with N busy processes pinned to the server's cores and reports busy / idle ratios.

Every run sends the same prompts, so the servers it starts run without prefix caching
(SYSTEM_FLAGS), and each run's requests carry a cache salt of their own: on a --target server,
which keeps its settings (prefix caching on by default), no run finds an earlier run's prompts
in the cache (each run's cached_prompt_tokens in the JSON says so).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import tempfile
import time
import uuid
from contextlib import contextmanager, nullcontext
from pathlib import Path

from blink.client.bench_data import BENCH_EXTRA_HINT, BenchError, BenchRequest, \
    random_requests, sharegpt_requests, warm_up_request
from blink.client.bench_hog import CpuHog
from blink.client.bench_load import RUN_TIME_LIMIT, run_in_processes
from blink.client.bench_metrics import Slo, summarize
from blink.client.bench_report import LOOP_SATURATED, SCHEMA, document, plot, rate_label, \
    request_rows, summary_table, write_json
from blink.client.sdk import BlinkClient, BlinkError, Sampling

# system name -> the engine flag it runs with (and SYSTEM_FLAGS's)
SYSTEMS = {"blink": "auto", "host-cuda": "host-cuda", "hf": "hf", "hf-static": "hf",
           "synthetic": "synthetic"}
# Engine flags beyond --engine. Every run sends the same prompts (each rate, repeat and CPU
# load), so the systems with a prefix cache run without it: with it, every run after the first
# would take its prompts from the cache, work the transformers peers do again each time (the
# cache's own gains: `python -m blink.client.bench_serving --suite prefix`).
SYSTEM_FLAGS = {"blink": ["--no-prefix-caching"], "host-cuda": ["--no-prefix-caching"],
                "hf-static": ["--hf-static-cache"]}
SERVER_COUNTERS = ("engine_steps", "engine_busy_ns", "engine_step_tokens", "preemptions")


def parse_rate(text: str) -> float:
    try:
        rate = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a number of requests per second, or inf")
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the request rate must be > 0")
    return rate


def parse_cores(text: str) -> list[int]:
    """'0-5,8' -> [0, 1, 2, 3, 4, 5, 8]."""
    cores = []
    try:
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            cores += range(int(lo), int(hi or lo) + 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: cores as a list like 0-5,8")
    return sorted(set(cores))


def positive(kind):
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
        return value
    return parse


def add_server_arguments(group) -> None:
    """--target, or the model of the server(s) to start: --model / --shape (blink bench and
    blink soak)."""
    group.add_argument("--target", help="HOST:PORT of a running server (else servers are started)")
    group.add_argument("--model", help="checkpoint folder for the started servers "
                                       "(default: the built-in demo model)")
    group.add_argument("--shape", help="instead of --model: a real model shape with random "
                                       "weights (llama-3.1-8b, llama-3.2-1b; GPU engines only)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    where = p.add_argument_group("what to benchmark")
    add_server_arguments(where)
    where.add_argument("--systems", nargs="+", default=["blink"], choices=list(SYSTEMS),
                       help="systems to start and measure in turn (default: blink)")
    where.add_argument("--tokenizer", type=Path,
                       help="tokenizer.json for ShareGPT (default: the model's)")
    work = p.add_argument_group("workload")
    work.add_argument("--dataset", choices=["sharegpt", "random"], default="random")
    work.add_argument("--num-prompts", type=positive(int), default=200)
    work.add_argument("--random-input-len", type=int, default=256)
    work.add_argument("--random-output-len", type=int, default=128)
    work.add_argument("--random-range-ratio", type=float, default=0.0)
    work.add_argument("--respect-eos", action="store_true",
                      help="let EOS end a reply early (default: every request generates its "
                           "full output length)")
    load = p.add_argument_group("load")
    load.add_argument("--request-rate", type=parse_rate, nargs="+", default=[math.inf],
                      help="requests/s, Poisson arrivals; several values sweep (default inf)")
    load.add_argument("--burstiness", type=positive(float), default=1.0,
                      help="gamma shape of the arrival gaps (1: Poisson)")
    load.add_argument("--concurrency", type=positive(int), default=None,
                      help="requests in flight at most (with rate inf: a closed loop)")
    load.add_argument("--connections", type=positive(int), default=8,
                      help="client TCP connections, requests spread round robin (a server with "
                           "several front-end workers spreads connections over them)")
    load.add_argument("--client-procs", type=positive(int), default=1,
                      help="client processes sharing the load and one arrival schedule (one "
                           "Python client streams up to about 80,000 tokens/s; the run warns "
                           "when its client was saturated)")
    load.add_argument("--repeats", type=positive(int), default=1,
                      help="run every point this many times (shows the noise)")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--slo-ttft-ms", type=positive(float), default=None)
    load.add_argument("--slo-tpot-ms", type=positive(float), default=None)
    cpu = p.add_argument_group("CPU interference")
    cpu.add_argument("--cpu-hog", type=int, default=0,
                     help="also run every point with N busy processes on the server's cores")
    cpu.add_argument("--hog-rates", type=parse_rate, nargs="+", default=None,
                     help="request rates of the busy-CPU runs (default: every --request-rate)")
    cpu.add_argument("--hog-memory", action="store_true",
                     help="hogs copy memory (bandwidth) instead of spinning")
    cpu.add_argument("--server-nice", type=int, default=0,
                     help="niceness of the started servers' processes, as `nice -n N blink "
                          "serve` (below 0: ahead of the hogs; needs root or CAP_SYS_NICE)")
    cpu.add_argument("--server-cores", type=parse_cores, default=None,
                     help="cores for the started servers (default: all but two, which the "
                          "client takes, on machines with 4 or more)")
    eng = p.add_argument_group("started servers (the same for every system)")
    eng.add_argument("--max-num-seqs", type=positive(int), default=256)
    eng.add_argument("--max-batched-tokens", type=positive(int), default=2048)
    eng.add_argument("--max-model-len", type=positive(int), default=None)
    eng.add_argument("--frontend-arg", action="append", default=[],
                     help="extra front-end flag, repeatable (e.g. --frontend-arg=--workers=4)")
    eng.add_argument("--engine-arg", action="append", default=[],
                     help="extra engine flag, repeatable (e.g. --engine-arg=--kv-cache-mb=512)")
    add_fp8_arguments(eng, "the started blink and host-cuda servers'")
    p.add_argument("--out", type=Path, default=None,
                   help="folder for bench.json and the plots (default bench-results; with "
                        "--report: beside the first file)")
    p.add_argument("--report", type=Path, nargs="+", default=None, metavar="BENCH_JSON",
                   help="measure nothing: print the table and draw the plots of earlier runs' "
                        "bench.json files (also ones cut short); several are merged into one")
    p.add_argument("--timeout", type=positive(float), default=3600.0,
                   help="seconds one request may take")
    p.add_argument("--run-timeout", type=positive(float), default=None,
                   help="seconds one run may take: requests still open then are cancelled and "
                        "counted as failed (keeps a suite's time bounded with a slow peer)")


def add_fp8_arguments(group, whose: str) -> None:
    """--quantization and --kv-cache-dtype for started servers (blink bench, blink soak)."""
    group.add_argument("--quantization", choices=["fp8"], default=None,
                       help=f"{whose} --quantization (FP8 weights)")
    group.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                       help=f"{whose} --kv-cache-dtype (an E4M3 KV cache)")


def fp8_flags(args) -> list[str]:
    """The engine flags of add_fp8_arguments' options, as given."""
    return ((["--quantization", args.quantization] if args.quantization else [])
            + (["--kv-cache-dtype", args.kv_cache_dtype] if args.kv_cache_dtype != "auto"
               else []))


def check_arguments(args) -> None:
    fp8 = " ".join(fp8_flags(args))
    if fp8 and args.target:
        raise BenchError(f"{fp8} set the servers blink bench starts: drop them with --target "
                         f"(start that server with them instead)")
    fp8_less = [s for s in args.systems if s not in ("blink", "host-cuda")]
    if fp8 and fp8_less:
        raise BenchError(f"{fp8}: an option of the blink and host-cuda systems, not "
                         f"{', '.join(fp8_less)}")
    if args.target and (args.model or args.shape or args.systems != ["blink"]):
        raise BenchError("--target measures a running server: drop --model, --shape and "
                         "--systems (or drop --target to start servers)")
    if args.model and args.shape:
        raise BenchError("give --model or --shape, not both")
    if args.cpu_hog < 0:
        raise BenchError("--cpu-hog must be >= 0")
    if args.server_nice and args.target:
        raise BenchError("--server-nice applies to the servers blink bench starts: drop it with "
                         "--target (start that server with `nice -n N` instead)")
    if not -20 <= args.server_nice <= 19:
        raise BenchError("--server-nice must be between -20 and 19")
    if args.server_nice < 0 and not _may_raise_priority(args.server_nice):
        raise BenchError("--server-nice below 0 needs root or CAP_SYS_NICE")
    if args.dataset == "sharegpt" and args.target and not args.tokenizer:
        raise BenchError("--dataset sharegpt against --target needs --tokenizer (the served "
                         "model's tokenizer.json)")


def _may_raise_priority(nice: int) -> bool:
    """Whether children may start at niceness `nice` < 0 (root, CAP_SYS_NICE or RLIMIT_NICE
    allow it): asks the kernel in a short-lived child rather than reimplementing its rules."""
    import subprocess
    return subprocess.run([sys.executable, "-c", f"import os; os.nice({nice})"],
                          capture_output=True).returncode == 0


def split_cores(args) -> tuple[list[int], list[int]]:
    """(server cores, client cores)."""
    cores = sorted(os.sched_getaffinity(0))
    if args.server_cores:
        missing = set(args.server_cores) - set(cores)
        if missing:
            raise BenchError(f"--server-cores {sorted(missing)} are not usable here "
                             f"(cores {cores[0]}-{cores[-1]})")
        rest = [c for c in cores if c not in args.server_cores]
        return args.server_cores, rest or cores
    if args.target or len(cores) < 4:
        return cores, cores
    return cores[:-2], cores[-2:]


def model_folder(args, workdir: Path) -> Path:
    if args.shape:
        from blink.client.bench_server import shape_folder
        from blink.gpu_engine.bench_decode import SHAPES
        if args.shape not in SHAPES:
            raise BenchError(f"--shape {args.shape}: choose from {sorted(SHAPES)}")
        return shape_folder(args.shape, workdir, args.max_model_len or 8192)
    if args.model:
        path = Path(args.model).expanduser()
        if not (path / "config.json").is_file():
            raise BenchError(f"{path} is not a Hugging Face checkpoint folder (no config.json)")
        return path
    from blink.gpu_engine.demo_model import ensure_demo_model
    return ensure_demo_model()


def workload(args, vocab_size: int, context_length: int, tokenizer: Path | None
             ) -> list[BenchRequest]:
    if args.dataset == "random":
        if args.random_input_len + args.random_output_len > context_length:
            raise BenchError(f"--random-input-len + --random-output-len exceed the model's "
                             f"context ({context_length})")
        return random_requests(args.num_prompts, args.random_input_len, args.random_output_len,
                               vocab_size, range_ratio=args.random_range_ratio, seed=args.seed)
    return sharegpt_requests(args.num_prompts, tokenizer, context_length=context_length,
                             seed=args.seed)


def engine_flags(args, system: str) -> list[str]:
    flags = ["--engine", SYSTEMS[system], "--max-num-seqs", str(args.max_num_seqs),
             "--max-batched-tokens", str(args.max_batched_tokens),
             "--slots", str(max(128, 2 * args.max_num_seqs))]
    if args.max_model_len:
        flags += ["--max-model-len", str(args.max_model_len)]
    if args.shape:
        flags += ["--load-format", "dummy"]
    return flags + SYSTEM_FLAGS.get(system, []) + fp8_flags(args) + args.engine_arg


def server_counters(target: str) -> dict:
    try:
        with BlinkClient(target) as client:
            stats = client.stats(timeout=10)
        return {k: stats[k] for k in SERVER_COUNTERS}
    except (BlinkError, KeyError):
        return {}


def progress_bar(total: int, desc: str):
    try:
        from tqdm import tqdm
    except ImportError:  # the bench extra brings it; without it, no bar
        return None
    return tqdm(total=total, desc=desc, unit="req", leave=False, file=sys.stderr,
                disable=not sys.stderr.isatty())


def measure(target: str, requests: list[BenchRequest], args, rate: float, desc: str,
            client_cores: list[int], server=None) -> dict:
    """One run at one rate: the JSON schema's run object, less system/interference/repeat.
    server: the started Server, whose processes' CPU time is measured too."""
    bar = progress_bar(len(requests), desc)
    before = server_counters(target)
    cpu_before = server.cpu_seconds() if server is not None else {}
    pinned = os.sched_getaffinity(0)
    os.sched_setaffinity(0, client_cores)
    try:
        records, wall, load = run_in_processes(
            args.client_procs, target, requests, rate=rate, burstiness=args.burstiness,
            concurrency=args.concurrency, ignore_eos=not args.respect_eos, seed=args.seed,
            timeout=args.timeout, connections=args.connections, run_timeout=args.run_timeout,
            on_done=(lambda _: bar.update()) if bar else None,
            cache_salt=f"blink bench {uuid.uuid4()}")  # no run served from another's cache
    except RuntimeError as e:
        raise BenchError(f"{desc}: {e}") from None
    finally:
        os.sched_setaffinity(0, pinned)
        if bar:
            bar.close()
    after = server_counters(target)
    cpu = ({k: v - cpu_before[k] for k, v in server.cpu_seconds().items()}
           if server is not None else {})
    metrics = summarize(records, wall, Slo(args.slo_ttft_ms, args.slo_tpot_ms))
    saturated = load.loop_busy > LOOP_SATURATED
    if saturated:
        print(f"blink bench: warning: the client's event loop was {load.loop_busy:.0%} busy "
              f"({desc}): the client may have limited this run", file=sys.stderr)
    return {"rate": rate_label(rate), "metrics": metrics,
            "client": {"process_cpu_s": load.process_cpu_s, "loop_busy": load.loop_busy,
                       "saturated": saturated},
            "server": {**{k: after[k] - before[k] for k in after if k in before},
                       **{f"{k}_cpu_s": v for k, v in cpu.items()},
                       # per token streamed: a run cut by --run-timeout streamed more than
                       # its completed requests' output tokens
                       **({"frontend_cpu_us_per_token":
                           cpu["frontend"] / metrics["streamed_tokens"] * 1e6}
                          if cpu and metrics["streamed_tokens"] else {})},
            "requests": request_rows(records)}


@contextmanager
def serving(args, system: str, model_dir: Path | None, cores: list[int]):
    """(target, Server or None) for one system: the --target, or a server started for it and
    stopped afterwards."""
    if args.target:
        yield args.target, None
        return
    from blink.client.bench_server import Server
    t0 = time.monotonic()
    try:
        server = Server(model_dir, args.out, engine_flags(args, system), name=system,
                        cores=set(cores), frontend_flags=args.frontend_arg,
                        nice=args.server_nice)
    except RuntimeError as e:
        raise BenchError(f"{system}: {e}") from None
    print(f"blink bench: {system} up in {time.monotonic() - t0:.0f} s "
          f"(logs: {args.out}/{system}-*.log)", file=sys.stderr)
    try:
        yield server.target, server
    finally:
        server.stop()


def prepare(args, system: str, target: str, model_dir: Path | None,
            requests: list[BenchRequest] | None):
    """The server's ModelInfo and the workload (built once, the same for every system); one
    warm-up request, of a prompt no request of the workload starts with (a --target server's
    prefix cache would serve the first one from it)."""
    with BlinkClient(target) as client:
        try:
            client.wait_ready(30)  # a started server is SERVING already
            info = client.model_info()
            if requests is None:
                tokenizer = args.tokenizer or (model_dir / "tokenizer.json" if model_dir
                                               else None)
                requests = workload(args, info.vocab_size, info.context_length, tokenizer)
            warm_up = warm_up_request(len(requests[0].prompt), info.vocab_size)
            client.generate(list(warm_up.prompt), Sampling(max_tokens=warm_up.output_len,
                                                           temperature=0.0))
        except BlinkError as e:
            raise BenchError(f"{system} at {target}: {e}") from None
    return info, requests


def run(args) -> dict:
    check_arguments(args)
    args.out = args.out or Path("bench-results")
    server_cores, client_cores = split_cores(args)
    hog = CpuHog(args.cpu_hog, server_cores, memory=args.hog_memory)
    runs: list[dict] = []
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
              if k not in ("func", "verbose", "request_rate", "hog_rates")}
    config.update(request_rates=[rate_label(r) for r in args.request_rate],
                  hog_rates=[rate_label(r) for r in args.hog_rates or args.request_rate],
                  slo=Slo(args.slo_ttft_ms, args.slo_tpot_ms).to_json(),
                  server_cores=server_cores, client_cores=client_cores, hog=hog.describe())
    phases = [("idle", nullcontext(), args.request_rate)]
    if args.cpu_hog:
        phases.append(("busy", hog, args.hog_rates or args.request_rate))
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="blink-bench-") as tmp:
        model_dir = None if args.target else model_folder(args, Path(tmp))
        requests = None
        for system in (["target"] if args.target else args.systems):
            with serving(args, system, model_dir, server_cores) as (target, server):
                info, requests = prepare(args, system, target, model_dir, requests)
                config["model"] = info.name
                for interference, cpu_load, rates in phases:
                    with cpu_load:
                        for rate in rates:
                            for repeat in range(args.repeats):
                                desc = f"{system} {interference} rate {rate_label(rate)}"
                                result = measure(target, requests, args, rate, desc,
                                                 client_cores, server)
                                if server is not None and (why := server.died()):
                                    raise BenchError(f"{system}'s server failed during "
                                                     f"{desc}: {why} (its logs: {args.out})")
                                runs.append({"system": system, "engine": info.engine,
                                             "interference": interference,
                                             "repeat": repeat, **result})
                                # after every run: a benchmark cut short keeps what it measured
                                write_json(document(config, runs, complete=False),
                                           args.out / "bench.json")
                                print_run(desc, repeat, result)
    doc = document(config, runs, complete=True)
    write_json(doc, args.out / "bench.json")
    publish(doc, args.out)
    return doc


def publish(doc: dict, out: Path) -> None:
    """The summary table on stdout and the plots in `out`."""
    print(summary_table(doc))
    try:
        written = plot(doc, out)
        print(f"\nblink bench: {out / 'bench.json'}, " + ", ".join(str(p) for p in written),
              file=sys.stderr)
    except ImportError:
        print(f"\nblink bench: {out / 'bench.json'} (no plots: matplotlib is missing; "
              f"{BENCH_EXTRA_HINT})", file=sys.stderr)


def report(paths: list[Path], out: Path | None) -> dict:
    """--report: the table and plots of earlier runs' bench.json files, also of runs cut short
    (the file is written after every run). Several files (say, the serving systems' sweep and
    the slow peers' runs, measured apart) become one document, written to `out`/bench.json;
    the plots go to `out` (default: beside the first file)."""
    docs = []
    for path in paths:
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise BenchError(f"--report {path}: {e}") from None
        if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
            raise BenchError(f"--report {path}: not a {SCHEMA} document")
        if not doc.get("complete"):
            print(f"blink bench: {path} is from a run cut short ({len(doc['runs'])} runs)",
                  file=sys.stderr)
        docs.append(doc)
    out = out or paths[0].parent
    if len(docs) == 1:
        doc = docs[0]
    else:
        config = dict(docs[0]["config"], merged_from=[str(p) for p in paths])
        doc = document(config, [r for d in docs for r in d["runs"]],
                       complete=all(d.get("complete") for d in docs))
    if len(docs) > 1 or out.resolve() != paths[0].parent.resolve():
        out.mkdir(parents=True, exist_ok=True)
        write_json(doc, out / "bench.json")
    publish(doc, out)
    return doc


def unexpected_failures(doc: dict) -> list[str]:
    """A line for each run with requests that failed other than by --run-timeout's cut (which
    was asked for): a server that fails requests has no figures to publish."""
    lines = []
    for run in doc["runs"]:
        errors = [q["error"] or "no token" for q in run["requests"]
                  if (q["error"] or not q["tokens"])
                  and not (q["error"] or "").startswith(RUN_TIME_LIMIT)]
        if errors:
            lines.append(f"{run['system']} {run['interference']} rate {run['rate']} run "
                         f"{run['repeat'] + 1}: {len(errors)} of {len(run['requests'])} "
                         f"requests failed ({errors[0]})")
    return lines


def print_run(desc: str, repeat: int, result: dict) -> None:
    m = result["metrics"]
    failed = f"{m['failed']} failed" + (f" (streamed {m['streamed_throughput']:,.0f} tok/s)"
                                         if m["failed"] else "")
    frontend = result["server"].get("frontend_cpu_us_per_token")
    cpu = (f", front end {frontend:.1f} us CPU/token, client loop "
           f"{result['client']['loop_busy']:.0%} busy" if frontend is not None else "")
    def ms(value, digits: int) -> str:  # none completed: no figure, as the table leaves it
        return "-" if value is None else f"{value:.{digits}f} ms"
    print(f"blink bench: {desc} run {repeat + 1}: {m['output_throughput']:,.0f} tok/s, "
          f"TTFT p99 {ms(m['ttft_ms']['p99'], 1)}, TPOT p99 {ms(m['tpot_ms']['p99'], 2)}, "
          f"{failed}{cpu}", file=sys.stderr)


def stop_on_sigterm() -> None:
    """SIGTERM (kill, timeout, systemd) ends the command as Ctrl-C does, through its clean-up:
    the servers it started stopped, its hogs killed (the default action skipped all that)."""
    def stop(signum, frame):
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, stop)


def cmd_bench(args) -> None:
    stop_on_sigterm()
    try:
        if args.report:
            if args.target or args.model or args.shape:
                raise BenchError("--report reads an earlier run and measures nothing: drop "
                                 "--target, --model and --shape")
            report(args.report, args.out)
        elif failed := unexpected_failures(run(args)):
            sys.exit("blink bench: requests failed (their runs' figures count only the "
                     "completed ones):\n  " + "\n  ".join(failed))
    except BenchError as e:
        sys.exit(f"blink bench: {e}")
