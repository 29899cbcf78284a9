"""The transformers engine (gpu_engine/hf_engine.py) in-process behind its ring: what it streams
for a request is what the request asks of transformers' float32 model, judged on that model's
own logits (tests/oracle.py); tests/test_bench.py runs it behind the front end."""
from __future__ import annotations

import json
import secrets

import numpy as np
import pytest
from oracle import check_teacher_forced, hf_next_logits
from test_ring_protocol import request, slot_writes

from blink.gpu_engine.demo_model import write_random_checkpoint
from blink.gpu_engine.reference_engine import EngineConfig
from blink.gpu_engine.sampling import sampling_distribution
from blink.gpu_engine.sequence import SamplingParams
from blink.ring.layout import FinishReason
from blink.ring.shm import ShmSegment, ShmTransport

pytest.importorskip("torch")
pytest.importorskip("transformers")

PROMPTS = [[5, 17, 5, 17, 5, 17, 300, 42], [1000, 3, 640]]


@pytest.fixture(scope="module")
def qwen_instruct(tmp_path_factory):
    """A Qwen2 checkpoint whose generation_config.json carries the generation defaults Qwen2.5's
    instruct models ship (repetition_penalty 1.05, top_k 20, top_p 0.8, temperature 0.7)."""
    path = write_random_checkpoint(tmp_path_factory.mktemp("hf") / "q", architecture="qwen2",
                                   hidden_size=64, intermediate_size=128, num_layers=2,
                                   num_heads=4, num_kv_heads=2, dtype="float32", seed=3)
    gen = json.loads((path / "generation_config.json").read_text())
    gen.update(do_sample=True, repetition_penalty=1.05, top_k=20, top_p=0.8, temperature=0.7)
    (path / "generation_config.json").write_text(json.dumps(gen))
    return path


def serve(model_dir, requests, max_model_len=256, on_admit=None):
    """Every request in a slot of its own, the engine stepped until it idles; each slot's
    tokens and finish reason, and the engine's counters. on_admit(engine, transport, n) runs
    before the n-th (from 1) of the engine's admission passes, which generate's steps make."""
    from blink.gpu_engine.hf_engine import HfTransformersEngine
    name = f"blink-test-hf-{secrets.token_hex(6)}"
    engine = HfTransformersEngine(EngineConfig(model_dir, name, num_slots=len(requests),
                                               max_model_len=max_model_len))
    t = ShmTransport(ShmSegment.attach(name))
    if on_admit is not None:
        admit, calls = engine._admit, []

        def hooked():
            calls.append(1)
            on_admit(engine, t, len(calls))
            admit()
        engine._admit = hooked
    try:
        for slot, req in enumerate(requests):
            for off, data in slot_writes(engine.ring.geom, slot, 1, req):
                t.write(off, data)
        while engine.step():
            pass
        ring = engine.ring
        tokens = [ring.rec_tokens[s][:int(ring.rec_fixed[s]["num_tokens"])].tolist()
                  for s in range(len(requests))]
        reasons = [FinishReason(int(ring.rec_fixed[s]["finish_reason"]))
                   for s in range(len(requests))]
        return tokens, reasons, dict(engine.counters)
    finally:
        t.close()
        engine.close()


def test_greedy_batches_are_the_argmax_whatever_the_checkpoint_s_generation_defaults(
        qwen_instruct):
    """Two greedy requests of different lengths, one left-padded batch: every token is the
    argmax of transformers' logits after the request's own prefix (or a near-tie of it).
    generate took the checkpoint's generation_config.json as its defaults, so its
    repetition_penalty changed greedy tokens no request had asked to penalize."""
    streams, _, _ = serve(qwen_instruct, [request(p, max_tokens=20, temperature=0.0,
                                                  ignore_eos=True) for p in PROMPTS])
    for prompt, tokens in zip(PROMPTS, streams):
        assert len(tokens) == 20
        check_teacher_forced(qwen_instruct, prompt, tokens)


def test_sampled_tokens_are_drawn_from_the_request_s_top_k_set(qwen_instruct):
    """temperature 1.5, top_k 3: every sampled token is one of the three most likely after its
    prefix (transformers' logits); top_k 0 is off, not the checkpoint's 20 nor transformers'
    default 50: at temperature 3 some tokens fall outside the top 50; the same seed draws the
    same tokens again."""
    prompt = PROMPTS[0]
    top3 = dict(max_tokens=16, temperature=1.5, top_k=3, seed=11, ignore_eos=True)
    (tokens,), _, _ = serve(qwen_instruct, [request(prompt, **top3)])
    logits = hf_next_logits(qwen_instruct, prompt + tokens)[len(prompt) - 1:-1]
    params = SamplingParams(16, temperature=1.5, top_k=3)
    for row, token in zip(logits, tokens):
        assert token in sampling_distribution(row, params)[0].tolist()
    assert serve(qwen_instruct, [request(prompt, **top3)])[0] == [tokens]
    (wide,), _, _ = serve(qwen_instruct, [request(prompt, max_tokens=16, temperature=3.0,
                                                  seed=11, ignore_eos=True)])
    logits = hf_next_logits(qwen_instruct, prompt + wide)[len(prompt) - 1:-1]
    ranks = [int((row > row[token]).sum()) for row, token in zip(logits, wide)]
    assert max(ranks) >= 50, ranks


def test_sampled_tokens_are_drawn_from_the_request_s_top_p_set(qwen_instruct):
    """top_p 0.3 at temperature 1: every token is in the smallest set of most likely tokens
    (transformers' logits) whose mass reaches 0.3, where transformers' default is no cut."""
    prompt = PROMPTS[1]
    (tokens,), _, _ = serve(qwen_instruct, [request(prompt, max_tokens=16, temperature=1.0,
                                                    top_p=0.3, seed=5, ignore_eos=True)])
    logits = hf_next_logits(qwen_instruct, prompt + tokens)[len(prompt) - 1:-1]
    params = SamplingParams(16, temperature=1.0, top_p=0.3)
    sets = [sampling_distribution(row, params)[0].tolist() for row in logits]
    assert all(token in kept for token, kept in zip(tokens, sets))
    assert max(len(kept) for kept in sets) < 200  # a cut well inside the vocabulary


def test_a_request_takes_the_context_s_last_token_and_a_cancel_ends_only_its_row(
        qwen_instruct):
    """A 246-token prompt asking for the 4 tokens left of --max-model-len 250 (not a whole
    number of KV blocks) is served, all 4 of them. In a batch of two, the row whose
    cancel comes after its third token ends there, CANCELLED, and no token of the batch's later
    steps lands in its record; the other runs to its 12 tokens. The counters: a step per
    decoding step, a token per live row in it."""
    long_prompt = list(np.random.default_rng(1).integers(3, 1000, 246))
    (tokens,), (reason,), _ = serve(qwen_instruct, [request(long_prompt, max_tokens=4,
                                                            temperature=0.0, ignore_eos=True)],
                                    max_model_len=250)
    assert (len(tokens), reason) == (4, FinishReason.LENGTH)

    def cancel_slot_0(engine, transport, n):
        if n == 4:  # step()'s admission pass, then one after each of three tokens
            transport.write(engine.ring.geom.slot_offset(0) + 4, np.uint32(1).tobytes())
    streams, reasons, counters = serve(
        qwen_instruct, [request(p, max_tokens=12, temperature=0.0, ignore_eos=True)
                        for p in PROMPTS], on_admit=cancel_slot_0)
    assert [len(s) for s in streams] == [3, 12]
    assert reasons == [FinishReason.CANCELLED, FinishReason.LENGTH]
    assert (counters["engine_steps"], counters["step_tokens"]) == (12, 3 * 2 + 9)


def test_a_temperature_too_small_for_float32_logits_is_greedy(qwen_instruct):
    """temperature 1e-40 (a float32 the ring takes): logits / temperature overflow float32, and
    generate's draw raised on the NaN probabilities, which stopped the engine. The distribution
    there is the argmax (Blink's samplers draw it): the tokens are transformers' greedy ones."""
    prompt = PROMPTS[1]
    (tokens,), (reason,), _ = serve(qwen_instruct, [request(prompt, max_tokens=6,
                                                            temperature=1e-40, top_k=50,
                                                            seed=3, ignore_eos=True)])
    assert (len(tokens), reason) == (6, FinishReason.LENGTH)
    check_teacher_forced(qwen_instruct, prompt, tokens)
