"""`blink soak` (issue 8): random cancels and deadlines at saturation, then the leak check, on
the CPU engine in CI and on the CUDA engine where a GPU is (deploy/gpu_check.sh; the long soak
is deploy/soak_gpu.sh)."""
from __future__ import annotations

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
    # a silent engine's zeros are no proof of rest (they passed as "nothing leaked")
    silent = dict(rest, engine_alive=False, kv_blocks_total=0, kv_blocks_free=0)
    assert at_rest(silent)["engine_silent"] == 1


def test_soak_arguments_fail_clearly(tmp_path):
    for args, message in ((["--target", "h:1", "--model", "m"], "--target soaks a running"),
                          (["--target", "h:1", "--quantization", "fp8"], "--target soaks a"),
                          (["--cancel-fraction", "0.8", "--deadline-fraction", "0.5"],
                           "sum to at most 1"),
                          (["--duration", "0"], "must be positive")):
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


@pytest.mark.parametrize("kind", ["cancelled", "completed"])
def test_short_or_miscounted_streams_are_errors(kind):
    """A stream meant to be cancelled that ends by itself before its cancel point (here with no
    token at all) is an error, not a cancel; a completed stream whose usage counts another
    number of tokens than it carried is an error, not a completion."""
    import asyncio
    import random

    from test_bench import as_asked, scripted_server

    from blink.client.sdk import AsyncBlinkClient
    from blink.client.soak import Mix, Outcomes, one_request

    def script(request):
        ids, usage, _ = as_asked(request)
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
