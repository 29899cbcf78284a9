"""`blink soak` (issue 8): random cancels and deadlines at saturation, then the leak check, on
the CPU engine in CI and on the CUDA engine where a GPU is (deploy/gpu_check.sh; the long soak
is deploy/soak_gpu.sh)."""
from __future__ import annotations

import contextlib
import json
import subprocess
import sys

import pytest
from gpu import requires_gpu

from blink.client.soak import at_rest

pytestmark = pytest.mark.slow


def run_soak(model_dir, tmp_path, *args, timeout=300):
    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, "-m", "blink.client.cli", "soak", "--model",
                           str(model_dir), "--out", str(out), *args],
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text()), proc.stdout


def check(doc: dict) -> None:
    assert doc["error_count"] == 0 and doc["leaked"] == {}, doc
    assert doc["completed"] > 0 and doc["cancelled"] > 0
    assert doc["deadline_exceeded"] + doc["deadline_met"] > 0
    assert doc["server"]["engine_steps"] > 0 and doc["server"]["requests_cancelled"] > 0


def test_soak_on_the_cpu_engine(checkpoints, tmp_path):
    doc, text = run_soak(checkpoints["llama"], tmp_path, "--duration", "6", "--concurrency",
                         "8", "--max-prompt", "32", "--max-output", "24",
                         "--engine-arg=--engine=cpu")
    assert doc["engine"] == "cpu-reference"
    check(doc)
    assert "errors: 0; leaked at rest: nothing" in text


def test_leak_check_reports_what_is_left():
    rest = dict(ring_slots_in_use=0, requests_waiting_for_slot=0, sequences_running=0,
                sequences_waiting=0, kv_blocks_total=64, kv_blocks_free=64, engine_alive=True,
                requests_admitted=9, requests_finished=6, requests_cancelled=3,
                requests_rejected=1)
    assert not any(at_rest(rest).values())
    leaky = dict(rest, ring_slots_in_use=1, kv_blocks_free=61, requests_waiting_for_slot=2,
                 requests_finished=5)
    assert at_rest(leaky) == dict(ring_slots_in_use=1, requests_waiting_for_slot=2,
                                  sequences_running=0, sequences_waiting=0, kv_blocks_in_use=3,
                                  requests_in_flight=1, engine_silent=0)
    # a silent engine's zeros are no proof of rest (they passed as "nothing leaked"): one that
    # does not answer, or says no KV cache
    for silent in (dict(rest, engine_alive=False, kv_blocks_total=0, kv_blocks_free=0),
                   dict(rest, engine_alive=False), dict(rest, kv_blocks_total=0,
                                                       kv_blocks_free=0)):
        assert at_rest(silent)["engine_silent"] == 1


@pytest.mark.parametrize("errors, leaked, status", [(0, {}, None), (2, {}, 1),
                                                     (0, {"kv_blocks_in_use": 3}, 1)])
def test_the_exit_status_says_errors_and_leaks(monkeypatch, capsys, errors, leaked, status):
    """`blink soak` exits 1 on any error or on anything left in use once idle, else 0."""
    import argparse

    from blink.client import soak
    doc = dict(engine="scripted", model="m", duration_s=1.0, concurrency=1, requests=4,
               completed=4, cancelled=0, deadline_exceeded=0, deadline_met=0, tokens=8,
               errors=["e"] * errors, error_count=errors, generated_tokens_per_s=8.0,
               server={k: 0 for k in soak.COUNTERS}, kv_blocks_total=64, leaked=leaked,
               ms_per_token_probe=1.0)

    async def soaked(target, **options):
        return doc
    monkeypatch.setattr(soak, "soak", soaked)
    monkeypatch.setattr("blink.client.bench.stop_on_sigterm", lambda: None)  # (pytest's own)
    parser = argparse.ArgumentParser()
    soak.add_arguments(parser)
    with pytest.raises(SystemExit) if status else contextlib.nullcontext() as ended:
        soak.cmd_soak(parser.parse_args(["--target", "h:1"]))
    assert (ended.value.code if status else None) == status
    assert f"errors: {errors}; leaked at rest: {leaked or 'nothing'}" in capsys.readouterr().out


def test_soak_arguments_fail_clearly(tmp_path):
    for args, message in ((["--target", "h:1", "--model", "m"], "--target soaks a running"),
                          (["--target", "h:1", "--quantization", "fp8"], "--target soaks a"),
                          (["--cancel-fraction", "0.8", "--deadline-fraction", "0.5"],
                           "sum to at most 1"),
                          (["--duration", "0"], "must be positive"),
                          # nan: a soak of no request that passed; a leak waited for for ever
                          (["--duration", "nan"], "must be positive"),
                          (["--idle-timeout", "nan"], "--idle-timeout must be a finite"),
                          (["--idle-timeout", "-1"], "--idle-timeout must be a finite")):
        proc = subprocess.run([sys.executable, "-m", "blink.client.cli", "soak", *args],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode != 0 and message in proc.stderr, proc.stderr


@pytest.mark.gpu
@requires_gpu()
def test_soak_on_the_cuda_engine(checkpoints, tmp_path):
    doc, text = run_soak(checkpoints["llama"], tmp_path, "--duration", "20", "--concurrency",
                         "64", "--max-prompt", "64", "--max-output", "48",
                         "--engine-arg=--engine=cuda", "--engine-arg=--num-kv-blocks=256")
    assert doc["engine"] == "cuda"
    check(doc)
    print(f"engine soak: {text.splitlines()[1].strip()}; {doc['server']['engine_steps']} "
          f"scheduler steps, {doc['server']['preemptions']} preemptions, 0 errors, 0 leaked")


@pytest.mark.parametrize("kind", ["cancelled", "completed", "short"])
def test_short_or_miscounted_streams_are_errors(kind):
    """A stream meant to be cancelled that ends by itself before its cancel point (here with no
    token at all) is an error, not a cancel; a completed stream whose usage counts another
    number of tokens than it carried, or one a token short of its max_tokens (its usage
    counting what it carried), is an error, not a completion."""
    import asyncio
    import random

    from test_bench import as_asked, scripted_server

    from blink.client.sdk import AsyncBlinkClient
    from blink.client.soak import Mix, Outcomes, one_request

    def script(request):
        ids, usage, _ = as_asked(request)
        if kind == "short":
            return ids[:-1], usage - 1, None
        return ([], 0, None) if kind == "cancelled" else (ids, usage + 1, None)

    async def send(target: str) -> Outcomes:
        out = Outcomes()
        async with AsyncBlinkClient(target) as client:
            rnd = random.Random(1)
            mix = Mix(cancel_fraction=1.0 if kind == "cancelled" else 0.0,
                      deadline_fraction=0.0, max_prompt=8, max_output=6, vocab_size=2048)
            for _ in range(5):
                await one_request(client, rnd, mix, out, step_s=0.01)
        return out

    with scripted_server(script) as (target, _):
        out = asyncio.run(send(target))
    assert (out.requests, len(out.errors)) == (0, 5), out
    assert all(("to cancel after" in e) if kind == "cancelled" else ("usage" in e)
               for e in out.errors), out.errors


@pytest.mark.parametrize("fails", [False, True])
def test_deadline_requests_are_met_or_errors_unless_past_their_deadline(fails):
    """A request sent with a deadline that is served in full within it is a deadline met, its
    tokens counted (not a completion: the summary tells them apart); one that fails with
    another status than DEADLINE_EXCEEDED is an error, not a missed deadline."""
    import asyncio
    import random

    import grpc
    from test_bench import as_asked, scripted_server

    from blink.client.sdk import AsyncBlinkClient
    from blink.client.soak import Mix, Outcomes, one_request

    def script(request):
        ids, usage, _ = as_asked(request)
        return (ids[:1], 0, grpc.StatusCode.UNAVAILABLE) if fails else (ids, usage, None)

    async def send(target: str) -> Outcomes:
        out = Outcomes()
        async with AsyncBlinkClient(target) as client:
            rnd = random.Random(1)
            mix = Mix(cancel_fraction=0.0, deadline_fraction=1.0, max_prompt=8, max_output=6,
                      vocab_size=2048)
            for _ in range(5):  # (deadlines of 0.2 to 2 times 10 s a token: none is missed)
                await one_request(client, rnd, mix, out, step_s=10.0)
        return out

    with scripted_server(script) as (target, servicer):
        out = asyncio.run(send(target))
    if fails:
        assert (out.requests, out.tokens, len(out.errors)) == (0, 0, 5), out
        assert all(" tokens after 1: " in e for e in out.errors), out.errors
    else:
        assert (out.deadline_met, out.requests, out.errors) == (5, 5, []), out
        assert out.tokens == sum(r.sampling.max_tokens for r in servicer.requests)
