"""`blink soak`: a saturation soak with random cancels and deadlines, then a leak check.

    blink soak --target HOST:PORT | [--model DIR | --shape NAME] [--duration S]
               [--concurrency N] [--cancel-fraction F] [--deadline-fraction F] [--out FILE]

N closed-loop clients send random requests (random prompt tokens and output lengths, greedy,
EOS ignored) for --duration seconds, each drawn as one of:
  - completed: it must stream exactly its max_tokens tokens, finish "length" and count them
    in its usage;
  - cancelled by the client after a random number of its tokens (a stream that ends by
    itself before that is short: an error);
  - sent with a deadline drawn around its expected time: it must end DEADLINE_EXCEEDED, or
    complete in time with every token.
Anything else is an error: another status, a stream short or long. Afterwards the server must
go idle within --idle-timeout: every KV block free, no ring slot in use, nothing running or
waiting (the leak check). The summary (JSON with --out) counts each outcome, tokens, engine
steps and the server's own counters over the run; the exit status is 1 on any error or leak.
"""
from __future__ import annotations

import argparse
import asyncio
import math
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc

from blink.client.bench_report import write_json
from blink.client.sdk import AsyncBlinkClient, BlinkError, Sampling

# server counters whose change over the run the summary reports
COUNTERS = ("requests_admitted", "requests_finished", "requests_cancelled", "requests_rejected",
            "preemptions", "tokens_generated", "engine_steps")
# stats that are back at rest once the server is idle
IDLE = ("ring_slots_in_use", "requests_waiting_for_slot", "sequences_running",
        "sequences_waiting", "kv_blocks_in_use", "requests_in_flight")


@dataclass
class Outcomes:
    completed: int = 0
    cancelled: int = 0
    deadline_exceeded: int = 0
    deadline_met: int = 0
    tokens: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def requests(self) -> int:
        return self.completed + self.cancelled + self.deadline_exceeded + self.deadline_met


@dataclass(frozen=True)
class Mix:
    cancel_fraction: float
    deadline_fraction: float
    max_prompt: int
    max_output: int
    vocab_size: int


def at_rest(stats: dict) -> dict[str, int]:
    """The stats that must be zero when the server is idle (KV blocks in use derived, and the
    requests in flight: admitted and neither finished nor cancelled; a rejected request is
    never admitted), and engine_silent: an engine that does not answer shows nothing in use,
    which proves nothing."""
    rest = dict(stats, kv_blocks_in_use=stats["kv_blocks_total"] - stats["kv_blocks_free"],
                requests_in_flight=stats["requests_admitted"] - stats["requests_finished"]
                - stats["requests_cancelled"])
    return {**{k: int(rest[k]) for k in IDLE},
            "engine_silent": int(not stats["engine_alive"] or not stats["kv_blocks_total"])}


async def one_request(client: AsyncBlinkClient, rnd: random.Random, mix: Mix,
                      out: Outcomes, step_s: float) -> None:
    prompt = [rnd.randrange(3, mix.vocab_size) for _ in range(rnd.randint(1, mix.max_prompt))]
    n = rnd.randint(1, mix.max_output)
    sampling = Sampling(max_tokens=n, temperature=0.0, ignore_eos=True)
    kind = rnd.random()
    got = 0
    if kind < mix.cancel_fraction:
        cancel_after = rnd.randint(1, n)
        stream = client.stream(prompt, sampling, return_token_ids=True, timeout=600)
        try:
            async for delta in stream:
                got += len(delta.token_ids)
                if got >= cancel_after:
                    stream.cancel()
                    break
            else:  # cancel_after <= n: a whole stream reaches it
                result = stream.result
                out.errors.append(f"request of {n} tokens, to cancel after {cancel_after}, "
                                  f"ended with {got} "
                                  f"({result.finish_reason if result else 'no result'})")
                return
        except BlinkError as e:
            out.errors.append(f"cancelled request: {e}")
            return
        out.cancelled += 1
        out.tokens += got
        return
    # a deadline around the request's expected time (step_s a token), so both outcomes occur
    deadline = (rnd.uniform(0.2, 2.0) * (n + 1) * step_s
                if kind < mix.cancel_fraction + mix.deadline_fraction else None)
    stream = client.stream(prompt, sampling, return_token_ids=True, timeout=deadline or 600)
    try:
        async for delta in stream:
            got += len(delta.token_ids)
    except BlinkError as e:
        if deadline is not None and e.code == grpc.StatusCode.DEADLINE_EXCEEDED:
            out.deadline_exceeded += 1
            out.tokens += got
        else:
            out.errors.append(f"request of {n} tokens after {got}: {e}")
        return
    result = stream.result
    if (got != n or result is None or result.finish_reason != "length"
            or result.completion_tokens != got):
        out.errors.append(f"request of {n} tokens ended with {got} "
                          + (f"({result.finish_reason}, usage {result.completion_tokens})"
                             if result else "(no result)"))
        return
    out.tokens += got
    if deadline is None:
        out.completed += 1
    else:
        out.deadline_met += 1


async def soak(target: str, *, duration_s: float, concurrency: int, cancel_fraction: float,
               deadline_fraction: float, max_prompt: int, max_output: int, seed: int,
               idle_timeout_s: float) -> dict:
    async with AsyncBlinkClient(target) as client:
        await client.wait_ready(60)
        info = await client.model_info()
        # what one sequence can hold: the context, or the whole KV cache where that is smaller
        # (the server refuses a prompt plus max_tokens past it, INVALID_ARGUMENT, which counted
        # as the soak's errors against a server with a small --num-kv-blocks)
        kv = await client.stats()
        room = info.context_length
        if kv["kv_blocks_total"] and kv["kv_block_size"]:
            room = min(room, kv["kv_blocks_total"] * kv["kv_block_size"])
        max_output = max(1, min(max_output, room // 2))
        mix = Mix(cancel_fraction, deadline_fraction,
                  max(1, min(max_prompt, room - max_output)), max_output,
                  info.vocab_size)
        # a measured time per token at this concurrency scales the deadlines
        t0 = time.monotonic()
        probe = Outcomes()
        await asyncio.gather(*(one_request(client, random.Random(-w), Mix(0, 0, 8, 16,
                                                                            info.vocab_size),
                                           probe, 0) for w in range(concurrency)))
        step_s = (time.monotonic() - t0) / 17
        before = await client.stats()
        out = Outcomes(errors=list(probe.errors))
        stop_at = time.monotonic() + duration_s

        async def worker(w: int) -> None:
            rnd = random.Random(seed * 7919 + w)
            while time.monotonic() < stop_at:
                await one_request(client, rnd, mix, out, step_s)

        t0 = time.monotonic()
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
        wall = time.monotonic() - t0
        deadline = time.monotonic() + idle_timeout_s
        while True:
            after = await client.stats()
            leaked = {k: v for k, v in at_rest(after).items() if v}
            if not leaked or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
    return {"engine": info.engine, "model": info.name, "duration_s": wall,
            "concurrency": concurrency, "requests": out.requests, **asdict(out),
            "errors": out.errors[:20], "error_count": len(out.errors),
            "generated_tokens_per_s": out.tokens / wall if wall else 0.0,
            "server": {k: after[k] - before[k] for k in COUNTERS},
            "kv_blocks_total": after["kv_blocks_total"], "leaked": leaked,
            "ms_per_token_probe": step_s * 1e3}


def summary(doc: dict) -> str:
    s = doc["server"]
    lines = [
        f"blink soak: {doc['engine']} engine, {doc['model']}, {doc['duration_s']:.0f} s at "
        f"concurrency {doc['concurrency']}",
        f"  requests {doc['requests']}: {doc['completed']} completed, {doc['cancelled']} "
        f"cancelled, {doc['deadline_exceeded']} past their deadline, {doc['deadline_met']} "
        f"within it; {doc['tokens']} tokens ({doc['generated_tokens_per_s']:,.0f}/s)",
        f"  server: {s['engine_steps']} scheduler steps, {s['requests_finished']} finished, "
        f"{s['requests_cancelled']} cancelled, {s['preemptions']} preemptions",
        f"  errors: {doc['error_count']}; leaked at rest: {doc['leaked'] or 'nothing'} "
        f"(KV blocks {doc['kv_blocks_total']})"]
    lines += [f"  error: {e}" for e in doc["errors"]]
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from blink.client.bench import add_fp8_arguments, add_server_arguments
    where = p.add_argument_group("what to soak")
    add_server_arguments(where)
    add_fp8_arguments(where, "the started server's")
    where.add_argument("--max-model-len", type=int, default=None,
                       help="context length for the started server")
    where.add_argument("--engine-arg", action="append", default=[],
                       help="extra engine flag for the started server, repeatable")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    p.add_argument("--concurrency", type=int, default=64, help="requests in flight")
    p.add_argument("--cancel-fraction", type=float, default=0.1)
    p.add_argument("--deadline-fraction", type=float, default=0.1)
    p.add_argument("--max-prompt", type=int, default=512, help="prompt tokens at most")
    p.add_argument("--max-output", type=int, default=256, help="output tokens at most")
    p.add_argument("--idle-timeout", type=float, default=30.0,
                   help="seconds the server may take to come to rest after the load")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="write the summary as JSON here")


def check_arguments(args) -> None:
    from blink.client.bench import fp8_flags
    if args.target and (args.model or args.shape or args.engine_arg or args.max_model_len
                        or fp8_flags(args)):
        sys.exit("blink soak: --target soaks a running server: drop --model, --shape, "
                 "--max-model-len, --engine-arg, --quantization and --kv-cache-dtype")
    if args.model and args.shape:
        sys.exit("blink soak: give --model or --shape, not both")
    # (not x > 0: nan, which ran no request at all and passed)
    if not args.duration > 0 or args.concurrency < 1 or args.max_prompt < 1 \
            or args.max_output < 1:
        sys.exit("blink soak: --duration, --concurrency, --max-prompt and --max-output must be "
                 "positive")
    if not 0 <= args.idle_timeout < math.inf:  # (nan or inf: a leak waited for for ever)
        sys.exit("blink soak: --idle-timeout must be a finite number of seconds >= 0")
    if not (0 <= args.cancel_fraction and 0 <= args.deadline_fraction
            and args.cancel_fraction + args.deadline_fraction <= 1):
        sys.exit("blink soak: --cancel-fraction and --deadline-fraction must be >= 0 and sum "
                 "to at most 1")


def cmd_soak(args) -> None:
    from blink.client.bench import stop_on_sigterm
    stop_on_sigterm()
    check_arguments(args)
    options = dict(duration_s=args.duration, concurrency=args.concurrency,
                   cancel_fraction=args.cancel_fraction,
                   deadline_fraction=args.deadline_fraction, max_prompt=args.max_prompt,
                   max_output=args.max_output, seed=args.seed, idle_timeout_s=args.idle_timeout)
    if args.target:
        doc = asyncio.run(soak(args.target, **options))
    else:
        from blink.client.bench import fp8_flags, model_folder
        from blink.client.bench_data import BenchError
        from blink.client.bench_server import Server
        with tempfile.TemporaryDirectory(prefix="blink-soak-") as tmp:
            try:
                model_dir = model_folder(args, Path(tmp))
            except BenchError as e:
                sys.exit(f"blink soak: {e}")
            flags = ["--slots", str(max(128, 2 * args.concurrency)),
                     *(["--load-format", "dummy"] if args.shape else []),
                     *(["--max-model-len", str(args.max_model_len)] if args.max_model_len
                       else []), *fp8_flags(args), *args.engine_arg]
            try:
                server = Server(model_dir, Path(tmp), flags, name="soak")
            except RuntimeError as e:
                sys.exit(f"blink soak: {e}")
            try:
                doc = asyncio.run(soak(server.target, **options))
            finally:
                server.stop()
    print(summary(doc))
    if args.out:
        write_json(doc, args.out)
    if doc["error_count"] or doc["leaked"]:
        sys.exit(1)
