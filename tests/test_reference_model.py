"""The NumPy reference model against Hugging Face transformers, and against itself under paging,
chunking and batching; plus the checkpoint's tokenizer against transformers' view of it."""
from __future__ import annotations

import json

import numpy as np
import pytest

from blink.gpu_engine.checkpoint import load_config, load_weights
from blink.gpu_engine.demo_model import write_random_checkpoint
from blink.gpu_engine.forward_batch import ForwardBatch
from blink.gpu_engine.reference_model import ReferenceModel, rms_norm

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ARCHS = ["llama", "qwen2", "qwen3"]
BLOCK = 4
# Each architecture also exercises one loader/model feature: llama3 RoPE scaling (with an original
# context short enough that the tiny head_dim has scaled, smoothed and kept frequencies), sharded
# weights with q/k/v biases, and an explicit head_dim != hidden/heads with tied embeddings.
SHAPES = {
    "llama": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 256}),
    "qwen2": dict(max_shard_bytes=200_000),
    "qwen3": dict(hidden_size=96, head_dim=32, tie_word_embeddings=True),
}
# HF vs reference: both run in float32 on the same float32 weights, so they differ only by
# summation order (BLAS blocking, softmax/reduction order): ~1e-6 relative per op, a few 1e-6
# after two layers. 1e-3 of the logit scale (max |logit|, ~20) leaves wide margin yet catches
# any real mistake (a wrong RoPE frequency, bias or norm shows up at 1e-2 or more).
HF_REL_TOL = 1e-3
# Reference vs itself with different chunking/batching: the same arithmetic on differently shaped
# matmuls, so only BLAS blocking differs.
SELF_TOL = 1e-4


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """arch -> (checkpoint dir, ModelConfig, ModelWeights, HF model)."""
    root = tmp_path_factory.mktemp("tiny")
    out = {}
    for arch in ARCHS:
        kw = dict(hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                  seed=7)
        path = write_random_checkpoint(root / arch, architecture=arch, **{**kw, **SHAPES[arch]})
        cfg = load_config(path)
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        out[arch] = (path, cfg, load_weights(path, cfg), hf)
    return out


def poisoned_model(cfg, weights, num_blocks: int) -> ReferenceModel:
    """A model whose KV cache is all NaN: any read of a never-written slot makes output NaN."""
    model = ReferenceModel(cfg, weights, num_blocks=num_blocks, block_size=BLOCK)
    model.k_cache.fill(np.nan)
    model.v_cache.fill(np.nan)
    return model


make_batch = ForwardBatch.of_chunks  # chunks: [(token_ids, start, block_table)]


def blocks_for(n_tokens: int) -> int:
    return -(-n_tokens // BLOCK)


def test_of_chunks_lays_out_the_step_contract():
    """Hand-computed: each run's positions continue from its start, context_lens is one past its
    last position, tables are -1 padded (a 0 would name a real block), every array int32."""
    b = make_batch([([5, 6, 7], 0, [2]), ([9], 5, np.array([0, 3])), ([1, 2], 2, [1])])
    want = dict(token_ids=[5, 6, 7, 9, 1, 2], positions=[0, 1, 2, 5, 2, 3],
                seq_starts=[0, 3, 4, 6], context_lens=[3, 6, 4],
                block_tables=[[2, -1], [0, 3], [1, -1]], logit_seqs=[0, 1, 2])
    for name, value in want.items():
        got = getattr(b, name)
        assert got.dtype == np.int32 and got.tolist() == value, name
    assert (b.num_tokens, b.num_seqs) == (6, 3)
    assert make_batch([([4], 3, [0]), ([8], 0, [1])], logit_seqs=[1]).logit_seqs.tolist() == [1]


def logits_at_every_position(cfg, weights, ids) -> np.ndarray:
    """[len(ids), V]: one step whose sequence s is the prefix ids[:s+1], each in its own blocks."""
    total = sum(blocks_for(n) for n in range(1, len(ids) + 1))
    model = poisoned_model(cfg, weights, total)
    chunks, next_block = [], 0
    for n in range(1, len(ids) + 1):
        chunks.append((ids[:n], 0, np.arange(next_block, next_block + blocks_for(n))))
        next_block += blocks_for(n)
    out = model.forward(make_batch(chunks))
    assert np.isfinite(out).all()
    return out


def hf_logits(hf, ids) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor(np.asarray(ids, np.int64)[None])).logits[0].numpy()


def prompt(cfg, n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, n).astype(np.int32)


@pytest.mark.parametrize("arch", ARCHS)
def test_matches_transformers_at_every_position(tiny, arch):
    _, cfg, w, hf = tiny[arch]
    ids = prompt(cfg, 40)
    ours, theirs = logits_at_every_position(cfg, w, ids), hf_logits(hf, ids)
    scale = np.abs(theirs).max()
    err = np.abs(ours - theirs).max()
    print(f"{arch}: max |ref - hf| = {err:.3g}, logit scale {scale:.3g}, "
          f"relative {err / scale:.3g}")
    assert err <= HF_REL_TOL * scale
    np.testing.assert_array_equal(ours.argmax(-1), theirs.argmax(-1))


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generation_matches_transformers(tiny, arch):
    path, cfg, w, hf = tiny[arch]
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(path / "tokenizer.json")).encode("The quick brown fox 你好 🚀").ids
    new_tokens = 12
    with torch.no_grad():
        expect = hf.generate(torch.tensor([ids]), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False)[0, len(ids):].tolist()

    model = poisoned_model(cfg, w, blocks_for(len(ids) + new_tokens))
    table = np.arange(model.num_blocks)
    got, step, pos = [], np.array(ids), 0
    for _ in range(new_tokens):
        logits = model.forward(make_batch([(step, pos, table)]))
        pos += len(step)
        got.append(int(logits[0].argmax()))
        step = np.array(got[-1:])
    assert got == expect


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_and_decode_through_shuffled_blocks(tiny, arch):
    _, cfg, w, _ = tiny[arch]
    ids = list(prompt(cfg, 30, seed=1))
    num_blocks = 40
    model = poisoned_model(cfg, w, num_blocks)
    # Non-contiguous, out-of-order blocks; the others stay NaN and must never be read.
    table = np.random.default_rng(2).permutation(num_blocks)[:blocks_for(30 + 6)]

    got = {}  # position -> logits after the token at that position
    pos, sizes = 0, [1, 3, 7]
    while pos < len(ids):
        n = min(sizes[len(got) % 3], len(ids) - pos)
        got[pos + n - 1] = model.forward(make_batch([(np.array(ids[pos:pos + n]), pos, table)]))[0]
        pos += n
    for _ in range(6):  # decode: greedy token appended, one token per step
        ids.append(int(got[pos - 1].argmax()))
        got[pos] = model.forward(make_batch([(np.array(ids[pos:]), pos, table)]))[0]
        pos += 1

    oneshot = logits_at_every_position(cfg, w, np.array(ids))
    for p, logits in got.items():
        assert np.isfinite(logits).all()
        np.testing.assert_allclose(logits, oneshot[p], rtol=0, atol=SELF_TOL)
    unused = np.setdiff1d(np.arange(num_blocks), table)
    assert np.isnan(model.k_cache[:, unused]).all() and np.isnan(model.v_cache[:, unused]).all()


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_sequences_equal_solo_runs(tiny, arch):
    _, cfg, w, _ = tiny[arch]
    # Per sequence: the token count of each step (prefill chunks, then decode steps); zero means
    # the sequence sits out that step.
    plans = [[5, 1, 1, 1], [4, 7, 0, 1], [2, 1, 3, 1], [0, 9, 1, 1]]
    seqs = [list(prompt(cfg, sum(p), seed=10 + s)) for s, p in enumerate(plans)]
    pool = np.random.default_rng(3).permutation(64)
    tables = [pool[16 * s:16 * s + blocks_for(len(t))] for s, t in enumerate(seqs)]

    batched = poisoned_model(cfg, w, 64)
    solos = [poisoned_model(cfg, w, 64) for _ in seqs]
    done = [0] * len(seqs)
    for step in range(4):
        active = [s for s in range(len(seqs)) if plans[s][step]]
        chunks = [(np.array(seqs[s][done[s]:done[s] + plans[s][step]]), done[s], tables[s])
                  for s in active]
        # Logits only for sequences whose chunk ends their prefill or decodes (not seq 1's first
        # chunk), as the scheduler would ask.
        want = [i for i, s in enumerate(active) if not (s == 1 and step == 0)]
        out = batched.forward(make_batch(chunks, want))
        assert out.shape == (len(want), cfg.vocab_size) and np.isfinite(out).all()
        solo = [solos[s].forward(make_batch([chunk]))[0] for s, chunk in zip(active, chunks)]
        for row, i in enumerate(want):
            np.testing.assert_allclose(out[row], solo[i], rtol=0, atol=SELF_TOL)
        for s in active:
            done[s] += plans[s][step]


def test_bad_batches_raise(tiny):
    _, cfg, w, _ = tiny["llama"]
    model = ReferenceModel(cfg, w, num_blocks=4, block_size=BLOCK)
    ids = prompt(cfg, 6)
    model.forward(make_batch([(ids, 0, np.array([3, 0]))]))
    with pytest.raises(ValueError, match="block table entries"):
        model.forward(make_batch([(ids, 0, np.array([3, 4]))]))
    with pytest.raises(ValueError, match="block table entries"):
        model.forward(make_batch([(ids, 0, np.array([-1, 0]))]))
    with pytest.raises(ValueError, match="needs 2 blocks"):
        model.forward(make_batch([(ids, 0, np.array([1]))]))
    bad = make_batch([(ids, 0, np.array([0, 1]))])
    bad.token_ids[2] = cfg.vocab_size
    with pytest.raises(ValueError, match="vocabulary"):
        model.forward(bad)
    bad = make_batch([(ids, 0, np.array([0, 1]))])
    bad.context_lens[0] = 7
    with pytest.raises(ValueError, match="context_lens"):
        model.forward(bad)


def good_batch(cfg):
    """Two sequences, 6 prompt tokens and a 3-token chunk at position 4, blocks of their own."""
    return make_batch([(prompt(cfg, 6), 0, np.array([0, 1])),
                       (prompt(cfg, 3, 1), 4, np.array([2, 3]))])


def _set(field, index, value):
    def edit(b):
        getattr(b, field)[index] = value
    return edit


def _replace(field, value):
    def edit(b):
        setattr(b, field, np.asarray(value, np.int32))
    return edit


@pytest.mark.parametrize("edit, match", [
    (_replace("seq_starts", [1, 6, 9]), "must rise strictly from 0"),
    (_replace("seq_starts", [0, 6, 6, 9]), "must rise strictly from 0"),  # an empty sequence
    (_replace("seq_starts", [0, 6, 8]), "must rise strictly from 0 to 9"),
    (_replace("positions", np.arange(10)), "wrong shape"),
    (_replace("context_lens", [6, 7, 7]), "wrong shape"),
    (_set("token_ids", 0, -1), "vocabulary"),
    (_replace("logit_seqs", [0, 2]), "logit_seqs"),
    (_replace("logit_seqs", [-1]), "logit_seqs"),
    (_set("positions", 1, 2), "consecutive"),
], ids=["starts not from 0", "empty sequence", "starts not to T", "positions shape",
        "context_lens shape", "negative token", "logit_seqs past S", "negative logit_seqs",
        "positions skip"])
def test_every_malformed_batch_is_refused(tiny, edit, match):
    """Each of _check's rules on its own: a batch that breaks one is a ValueError naming it, not
    a NumPy wrap-around read (a negative token id, sequence or block index) or a silent result."""
    _, cfg, w, _ = tiny["llama"]
    model = ReferenceModel(cfg, w, num_blocks=4, block_size=BLOCK)
    assert model.forward(good_batch(cfg)).shape == (2, cfg.vocab_size)
    bad = good_batch(cfg)
    edit(bad)
    with pytest.raises(ValueError, match=match):
        model.forward(bad)


def test_negative_positions_an_empty_batch_and_an_empty_cache_are_refused(tiny):
    _, cfg, w, _ = tiny["llama"]
    model = ReferenceModel(cfg, w, num_blocks=4, block_size=BLOCK)
    bad = make_batch([(prompt(cfg, 3), 0, np.array([0]))])
    bad.positions -= 1
    bad.context_lens -= 1
    with pytest.raises(ValueError, match="consecutive from >= 0"):
        model.forward(bad)
    empty = ForwardBatch(*(np.zeros(0, np.int32),) * 2, np.zeros(1, np.int32),
                         np.zeros(0, np.int32), np.zeros((0, 1), np.int32), np.zeros(0, np.int32))
    with pytest.raises(ValueError, match="must rise strictly"):
        model.forward(empty)
    for blocks, size in ((0, BLOCK), (4, 0)):
        with pytest.raises(ValueError, match="must be > 0"):
            ReferenceModel(cfg, w, num_blocks=blocks, block_size=size)


def test_rms_norm_is_transformers_on_small_and_zero_rows():
    """eps inside the square root, as LlamaRMSNorm (and Qwen's, and Qwen3's q/k norms over a
    head) adds it: rows whose mean square is near eps (small activations, a q or k head near
    zero), and a row of zeros (zeros, not NaN). The random models' activations are far above
    eps, so the model tests cannot tell eps left out or added outside the root."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((4, 64)) * np.array([[1e-3], [3e-4], [1.0], [0.0]])).astype(
        np.float32)
    weight = rng.uniform(0.5, 1.5, 64).astype(np.float32)
    norm = LlamaRMSNorm(64, eps=1e-6)
    norm.weight.data = torch.from_numpy(weight)
    with torch.no_grad():
        want = norm(torch.from_numpy(x)).numpy()
    got = rms_norm(x, weight, 1e-6)
    assert got.dtype == np.float32 and not got[3].any()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=0)


def test_prefills_longer_than_a_query_block_match_transformers(tiny):
    """A chunk of more than QUERY_BLOCK (64) queries attends block by block: sequences of 150
    and 129 tokens in one step (blocks end at 64 and 128; the last ones hold 22 and 1 queries),
    each last token's logits against transformers. Every other test's chunks fit one block."""
    _, cfg, w, hf = tiny["llama"]
    assert ReferenceModel.QUERY_BLOCK == 64
    ids = prompt(cfg, 150, seed=5)
    a, b = blocks_for(150), blocks_for(129)
    model = poisoned_model(cfg, w, a + b)
    ours = model.forward(make_batch([(ids, 0, np.arange(a)), (ids[:129], 0, np.arange(a, a + b))]))
    theirs = hf_logits(hf, ids)[[149, 128]]
    assert np.isfinite(ours).all()
    assert np.abs(ours - theirs).max() <= HF_REL_TOL * np.abs(theirs).max()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_attention_biases_match_transformers(tmp_path, arch):
    """attention_bias true on Llama and Qwen3: transformers gives q, k, v and o_proj biases
    (Qwen2 has no o_proj bias); no checkpoint the other tests run has an o_proj bias."""
    from safetensors.numpy import load_file, save_file
    path = write_random_checkpoint(tmp_path / arch, architecture=arch, dtype="float32",
                                   hidden_size=128, intermediate_size=256, num_layers=2,
                                   num_heads=4, num_kv_heads=2, seed=8)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(config, attention_bias=True)))
    tensors = load_file(path / "model.safetensors")
    rng = np.random.default_rng(9)
    for i in range(2):
        for name, size in (("q_proj", 128), ("k_proj", 64), ("v_proj", 64), ("o_proj", 128)):
            tensors[f"model.layers.{i}.self_attn.{name}.bias"] = rng.normal(0, 1, size).astype(
                np.float32)
    save_file(tensors, path / "model.safetensors")
    cfg = load_config(path)
    assert cfg.attention_bias and cfg.o_proj_bias
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = prompt(cfg, 24)
    ours = logits_at_every_position(cfg, load_weights(path, cfg), ids)
    theirs = hf_logits(hf, ids)
    assert np.abs(ours - theirs).max() <= HF_REL_TOL * np.abs(theirs).max()


TEXTS = [
    "Hello, world!",
    "def f(x):\n    return x ** 2  # square\n",
    "今天天气很好，我们去公园散步吧。",
    "東京は日本の首都です。ｆｕｌｌｗｉｄｔｈ",
    "Emoji: 😀🤖🚀 👨‍👩‍👧‍👦 🇯🇵 👋🏽",
    "Combining: e\u0301 a\u0300 o\u0308 Z\u0335\u0321\u0358a\u0337lgo",
    "   leading, inner    runs\t\ttabs\n\n\nand trailing   ",
    "Здравствуй, мир! Ελληνικά. مرحبا. שלום. नमस्ते",
    "unseen rare bytes: \x00\x7f \u2028 \U0001F9EC\U0001FAE0 \uFFFD",
    "Mixed <|eot|> special text <|begin_of_text|> inside",
]


def test_tokenizer_agrees_with_transformers(tiny):
    from tokenizers import Tokenizer

    path = tiny["llama"][0]
    fast = Tokenizer.from_file(str(path / "tokenizer.json"))
    auto = transformers.AutoTokenizer.from_pretrained(path)
    for text in TEXTS:
        ids = fast.encode(text).ids
        assert ids[0] == 0  # <|begin_of_text|> prepended, as Llama-3 does
        assert auto(text).input_ids == ids, text
        bare = fast.encode(text, add_special_tokens=False).ids
        assert auto(text, add_special_tokens=False).input_ids == bare
        if "<|" not in text:
            assert fast.decode(ids) == text
            assert auto.decode(ids, skip_special_tokens=True) == text
        else:  # special tokens in text are recognised as such; decoding keeps them when asked
            assert fast.decode(ids, skip_special_tokens=False) == "<|begin_of_text|>" + text
