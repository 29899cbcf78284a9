"""The built-in demo checkpoint: deterministic, cached, loadable by transformers, decisive."""
from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

from blink.gpu_engine import demo_model
from blink.gpu_engine.checkpoint import load_config, load_weights
from blink.gpu_engine.demo_model import build_demo_tokenizer, ensure_demo_model
from blink.gpu_engine.forward_batch import ForwardBatch
from blink.gpu_engine.reference_model import ReferenceModel

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PROMPTS = ["Hello, world!", "def add(a, b):", "今天天气很好", "🤖 says: ", "The serving system"]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return ensure_demo_model(tmp_path_factory.mktemp("cache"))


def _digests(path):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def test_deterministic_across_directories(tmp_path, demo):
    again = ensure_demo_model(tmp_path)
    assert again == tmp_path / "demo-llama" and again != demo
    assert _digests(again) == _digests(demo)
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", "special_tokens_map.json"} <= set(_digests(demo))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # temp dirs cleaned up


def test_tokenizer_training_is_deterministic_across_processes():
    here = build_demo_tokenizer().to_str()
    assert here == build_demo_tokenizer().to_str()
    # A fresh process has fresh hash seeds: catches any dependence on hash-map iteration order.
    code = ("import hashlib; from blink.gpu_engine.demo_model import build_demo_tokenizer; "
            "print(hashlib.sha256(build_demo_tokenizer().to_str().encode()).hexdigest())")
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert there.stdout.strip() == hashlib.sha256(here.encode()).hexdigest()
    assert 1900 <= build_demo_tokenizer().get_vocab_size() <= 2048


def test_reused_and_replaced_when_stale(tmp_path, monkeypatch):
    monkeypatch.setenv("BLINK_CACHE_DIR", str(tmp_path))
    first = ensure_demo_model()
    assert first == tmp_path / "demo-llama"
    weights = first / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert ensure_demo_model() == first and weights.stat().st_mtime_ns == stamp  # reused

    (first / demo_model._DEMO_MARKER).write_text("0\n")  # an older version's leftovers
    (first / "stale-file").write_text("x")
    assert ensure_demo_model() == first
    assert not (first / "stale-file").exists() and demo_model._is_current(first)
    assert [p.name for p in tmp_path.iterdir()] == ["demo-llama"]


def test_cache_dir_then_env_then_home(tmp_path, demo, monkeypatch):
    """cache_dir, else $BLINK_CACHE_DIR, else ~/.cache/blink: a current model where the first
    that is set points is reused, and nothing is written anywhere else."""
    monkeypatch.setenv("BLINK_CACHE_DIR", str(tmp_path / "env"))
    assert ensure_demo_model(demo.parent) == demo
    assert not (tmp_path / "env").exists()
    shutil.copytree(demo, tmp_path / "env" / "demo-llama")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert ensure_demo_model() == tmp_path / "env" / "demo-llama"
    monkeypatch.delenv("BLINK_CACHE_DIR")
    shutil.copytree(demo, tmp_path / "home" / ".cache" / "blink" / "demo-llama")
    assert ensure_demo_model() == tmp_path / "home" / ".cache" / "blink" / "demo-llama"
    assert sorted(p.name for p in (tmp_path / "env").iterdir()) == ["demo-llama"]


def test_transformers_loads_it_with_decisive_logits(demo):
    cfg = load_config(demo)
    shape = (cfg.architecture, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
             cfg.intermediate_size, cfg.max_position_embeddings)
    assert shape == ("llama", 256, 4, 8, 4, 512, 4096)
    hf = transformers.AutoModelForCausalLM.from_pretrained(demo, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(demo)
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                   tokenize=False)
    assert chat == "<|begin_of_text|>user: hi<|eot|>assistant: "

    gaps = []
    for text in PROMPTS:
        ids = torch.tensor([tok(text).input_ids])
        with torch.no_grad():
            out = hf.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)
            logits = hf(out).logits[0].numpy()
        top2 = np.sort(logits, axis=-1)[:, -2:]
        gaps.extend(top2[:, 1] - top2[:, 0])
    gaps = np.array(gaps)
    print(f"top-1/top-2 gap: median {np.median(gaps):.3f}, 5th percentile "
          f"{np.percentile(gaps, 5):.3f}, min {gaps.min():.2g} over {len(gaps)} positions")
    assert np.median(gaps) > 0.05
    assert np.mean(gaps < 1e-3) < 0.02  # near-ties that float noise could flip are rare


def test_reference_greedy_matches_transformers(demo):
    cfg = load_config(demo)
    hf = transformers.AutoModelForCausalLM.from_pretrained(demo, dtype=torch.float32).eval()
    model = ReferenceModel(cfg, load_weights(demo, cfg), num_blocks=16, block_size=16)
    tok = build_demo_tokenizer()
    for text in PROMPTS[:2]:
        ids = tok.encode(text).ids
        with torch.no_grad():
            expect = hf.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16,
                                 do_sample=False)[0, len(ids):].tolist()
        got, step, pos = [], ids, 0
        for _ in range(16):
            n = len(step)
            batch = ForwardBatch(
                token_ids=np.array(step, np.int32),
                positions=np.arange(pos, pos + n, dtype=np.int32),
                seq_starts=np.array([0, n], np.int32),
                context_lens=np.array([pos + n], np.int32),
                block_tables=np.arange(16, dtype=np.int32)[None],
                logit_seqs=np.array([0], np.int32))
            got.append(int(model.forward(batch)[0].argmax()))
            step, pos = got[-1:], pos + n
        assert got == expect
