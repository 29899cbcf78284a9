"""Deterministic random-weight checkpoints in real Hugging Face format.

The weights are random, so the text such a model writes is meaningless: the demo model exists to
exercise the whole serving path (tokenizer, weights, KV cache, sampling, streaming) with a model
that transformers, our NumPy reference and the GPU engine all load from the same files. Its logits
are made decisive (greedy top-1 / top-2 gaps far above float32 summation noise) so that greedy
outputs can be compared token for token across implementations.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", "<|eot|>")
DEMO_TOKENIZER_VOCAB = 2048

# Training text for the demo tokenizer: enough English, code, CJK and emoji that common words get
# merged tokens. Byte-level BPE keeps all 256 bytes in its vocabulary, so any text still encodes.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A serving system answers many requests at once:
it batches prompts, keeps a cache of keys and values for every token, and streams text back as
soon as each new token is sampled. When memory runs short, the scheduler pauses a request and
computes it again later instead of failing. Latency matters to people; throughput matters to
the people who pay for the machines. Both depend on keeping the accelerator busy.

Hello, world! How are you today? I am fine, thank you. What time is it? It is half past nine.
Please write a short story about a robot who learns to paint. Once upon a time, in a small town
by the sea, there lived a robot named Pixel. Every morning Pixel watched the sunrise and tried to
remember its colors: orange, pink, gold and a deep, quiet blue. "Why do you paint?" asked a child.
"Because the light changes," said Pixel, "and I would like to keep a little of it."

Numbers and dates: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 2048 4096 65536 3.14159 2.71828
-1 +7 1e-5 0x1F 2024-05-17 12:30:45 $19.99 50% #1 @user a+b=c (x, y) [i, j] {k: v} <tag/>

def greedy_decode(model, prompt_ids, max_new_tokens=16):
    \"\"\"Return the prompt followed by the greedily chosen continuation.\"\"\"
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        logits = model(ids)[-1]
        next_id = int(logits.argmax())
        ids.append(next_id)
        if next_id == model.eos_token_id:
            break
    return ids

class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        self.free = list(range(num_blocks))

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self.free):
            return None
        taken, self.free = self.free[:n], self.free[n:]
        return taken

for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }
if (err != cudaSuccess) { fprintf(stderr, "error: %s\\n", cudaGetErrorString(err)); return 1; }
__global__ void add(const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) y[i] += x[i]; }
fn main() { let v: Vec<u32> = (0..10).map(|x| x * x).collect(); println!("{:?}", v); }
SELECT name, count(*) FROM requests WHERE status = 'done' GROUP BY name ORDER BY 2 DESC;
{"model": "demo", "messages": [{"role": "user", "content": "hi"}], "stream": true}
$ pip install -e . && python -m pytest -q tests/ && git status --short

Le renard brun saute par-dessus le chien paresseux. Ça va très bien, merci ! Où est la gare ?
Der schnelle braune Fuchs springt über den faulen Hund. Schöne Grüße aus München und Köln.
El veloz zorro marrón salta sobre el perro perezoso. ¿Dónde está la biblioteca? ¡Muy bien!
Быстрая коричневая лиса прыгает через ленивую собаку. Привет, как дела? Спасибо, хорошо.
Η γρήγορη καφέ αλεπού πηδά πάνω από τον τεμπέλη σκύλο. Καλημέρα σας.
Hızlı kahverengi tilki tembel köpeğin üzerinden atlar. Nguyễn Văn Anh đang học tiếng Việt.

今天天气很好，我们去公园散步吧。人工智能正在改变世界，大型语言模型可以回答问题、写文章和翻译。
北京是中国的首都，上海是最大的城市。我喜欢喝茶，也喜欢看书。这个问题很有意思，我们一起想一想。
服务器在处理请求时，需要为每个序列保存键和值的缓存。请用中文回答下面的问题：什么是注意力机制？
こんにちは、世界！今日はいい天気ですね。東京は日本の首都です。私は毎朝コーヒーを飲みます。
ありがとうございます。すみません、駅はどこですか？ひらがな、カタカナ、そして漢字を勉強しています。
기계 학습은 재미있습니다. 안녕하세요, 만나서 반갑습니다. 서울은 한국의 수도입니다.
مرحبا بالعالم. اللغة العربية جميلة. שלום עולם. नमस्ते दुनिया, आप कैसे हैं? สวัสดีครับ

Emoji and symbols: 😀 😂 🥲 😍 🤖 🚀 🔥 ✨ 🎉 👍 👋🏽 ❤️ 💡 🌍 🌸 🍣 🐍 🦀 ☕ ⚡ ✅ ❌ ⚠️ 👨‍👩‍👧‍👦 🇯🇵 🇫🇷
Math: ∑ ∫ √ ∞ ≈ ≠ ≤ ≥ ± × ÷ π λ μ σ Δ ∀ ∃ ∈ → ⇒ ← ↔ ° € £ ¥ © ™ • … — – « » „ “ ” ‘ ’
Combining marks: e\u0301 a\u0300 o\u0308 n\u0303 c\u0327 Å Ω ﬁ ﬀ Ⅻ ① ② ③ ｆｕｌｌｗｉｄｔｈ ＡＢＣ １２３

Questions people ask a chat assistant: explain this code, summarize the article, translate the
sentence into French, write an email to my manager, what is the capital of Australia, how do I
sort a list in Python, why is the sky blue, give me three ideas for dinner, tell me a joke.
Answers should be helpful, honest and short. If you do not know, say that you do not know.
The end of a turn is marked with a special token, and the model stops when it samples one.
"""


def build_demo_tokenizer() -> Tokenizer:
    """A byte-level BPE tokenizer (~2048 tokens) trained deterministically on `_CORPUS`.

    Encoding adds <|begin_of_text|> in front, as Llama-3 tokenizers do.
    """
    tok = Tokenizer(models.BPE())  # no unk token: every byte has a token
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=DEMO_TOKENIZER_VOCAB,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS], trainer)
    bos = SPECIAL_TOKENS[0]
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1",
                                      special_tokens=[(bos, tok.token_to_id(bos))]),
    ])
    return tok


# --- bf16 and safetensors writing --------------------------------------------------------------

def float32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round float32 to the nearest bf16 (ties to even); returns the bf16 bit patterns as uint16.

    Finite inputs only: the rounding add could carry a NaN's payload into the sign bit.
    """
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    rounding = ((u >> 16) & 1) + np.uint32(0x7FFF)
    return ((u + rounding) >> 16).astype(np.uint16)


def bf16_rounded(x: np.ndarray) -> np.ndarray:
    """float32 rounded to the nearest bf16 (ties to even), as float32: what a bf16 copy holds."""
    return (float32_to_bf16_bits(x).astype(np.uint32) << 16).view(np.float32)


_ST_DTYPES = {"bfloat16": ("BF16", 2), "float16": ("F16", 2), "float32": ("F32", 4)}


def _encode(x: np.ndarray, dtype: str) -> bytes:
    if dtype == "bfloat16":
        return float32_to_bf16_bits(x).astype("<u2").tobytes()
    return np.ascontiguousarray(x, "<f2" if dtype == "float16" else "<f4").tobytes()


def _write_safetensors(path: Path, specs: list[tuple[str, tuple[int, ...]]], make, dtype: str):
    """Writes tensors one at a time so that big shapes never sit in memory all together.

    specs: [(name, shape)] in file order; make(name) -> float32 array of that shape.
    """
    st_dtype, itemsize = _ST_DTYPES[dtype]
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in specs:
        nbytes = int(np.prod(shape)) * itemsize
        header[name] = {"dtype": st_dtype, "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # pad so the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for name, shape in specs:
            data = make(name)
            if data.shape != shape:
                raise RuntimeError(f"{name}: made shape {data.shape}, expected {shape}")
            f.write(_encode(data, dtype))


# --- checkpoint --------------------------------------------------------------------------------

_LOGIT_STD = 4.0  # logits' spread: gives greedy top-1/top-2 gaps ~1, far above float noise


def _tensor_specs(architecture, H, I, L, heads, kv_heads, D, V, tied):
    """[(name, shape, init)] in HF order; init is ('normal', std) or ('ones', noise std)."""
    qkv_bias = architecture == "qwen2"
    # Tied: the embedding is also the LM head, so it gets the LM head's scale (the first RMSNorm
    # makes the small input embeddings harmless).
    embed_std = _LOGIT_STD / H ** 0.5 if tied else 1.0
    specs = [("model.embed_tokens.weight", (V, H), ("normal", embed_std))]
    for i in range(L):
        a, p = f"model.layers.{i}.self_attn.", f"model.layers.{i}."
        specs += [
            (a + "q_proj.weight", (heads * D, H), ("normal", H ** -0.5)),
            (a + "k_proj.weight", (kv_heads * D, H), ("normal", H ** -0.5)),
            (a + "v_proj.weight", (kv_heads * D, H), ("normal", H ** -0.5)),
            (a + "o_proj.weight", (H, heads * D), ("normal", (heads * D) ** -0.5)),
        ]
        if qkv_bias:
            specs += [(a + n + "_proj.bias", (s,), ("normal", 0.5))
                      for n, s in (("q", heads * D), ("k", kv_heads * D), ("v", kv_heads * D))]
        if architecture == "qwen3":
            specs += [(a + "q_norm.weight", (D,), ("ones", 0.05)),
                      (a + "k_norm.weight", (D,), ("ones", 0.05))]
        specs += [
            (p + "input_layernorm.weight", (H,), ("ones", 0.05)),
            (p + "post_attention_layernorm.weight", (H,), ("ones", 0.05)),
            (p + "mlp.gate_proj.weight", (I, H), ("normal", H ** -0.5)),
            (p + "mlp.up_proj.weight", (I, H), ("normal", H ** -0.5)),
            (p + "mlp.down_proj.weight", (H, I), ("normal", I ** -0.5)),
        ]
    specs.append(("model.norm.weight", (H,), ("ones", 0.05)))
    if not tied:
        specs.append(("lm_head.weight", (V, H), ("normal", _LOGIT_STD / H ** 0.5)))
    return specs


def _config_json(architecture, *, H, I, L, heads, kv_heads, D, V, max_pos, rope_theta,
                 rope_scaling, tied, dtype, bos, eos) -> dict:
    common = {
        "attention_dropout": 0.0,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "hidden_act": "silu",
        "hidden_size": H,
        "initializer_range": 0.02,
        "intermediate_size": I,
        "max_position_embeddings": max_pos,
        "num_attention_heads": heads,
        "num_hidden_layers": L,
        "num_key_value_heads": kv_heads,
        "rope_scaling": rope_scaling,
        "rope_theta": rope_theta,
        "tie_word_embeddings": tied,
        "torch_dtype": dtype,
        "use_cache": True,
        "vocab_size": V,
    }
    if architecture == "llama":
        extra = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                 "attention_bias": False, "head_dim": D, "mlp_bias": False, "pretraining_tp": 1,
                 "rms_norm_eps": 1e-5}
    elif architecture == "qwen2":
        if D != H // heads:
            raise ValueError("qwen2 has no head_dim setting: head_dim must be "
                             "hidden_size // num_heads")
        extra = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "rms_norm_eps": 1e-6,
                 "use_sliding_window": False, "sliding_window": None, "max_window_layers": L}
    elif architecture == "qwen3":
        extra = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                 "attention_bias": False, "head_dim": D, "rms_norm_eps": 1e-6,
                 "use_sliding_window": False, "sliding_window": None, "max_window_layers": L}
    else:
        raise ValueError(f"architecture must be 'llama', 'qwen2' or 'qwen3', got {architecture!r}")
    return dict(sorted({**common, **extra}.items()))


_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}<|eot|>"
    "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)


def write_random_checkpoint(
    out_dir: str | Path,
    *,
    architecture: str = "llama",
    hidden_size: int = 128,
    intermediate_size: int = 256,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    vocab_size: int | None = None,
    max_position_embeddings: int = 2048,
    rope_theta: float = 10000.0,
    rope_scaling: dict | None = None,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    dtype: str = "bfloat16",
    max_shard_bytes: int | None = None,
    write_weights: bool = True,
) -> Path:
    """Writes a complete random-weight HF checkpoint into `out_dir` (best empty) and returns it.

    vocab_size defaults to the demo tokenizer's size; a larger one pads the embedding with rows no
    tokenization produces. max_shard_bytes splits the weights into model-0000k-of-0000n.safetensors
    files with a model.safetensors.index.json, as big hub checkpoints are. write_weights=False
    writes everything but the weights: a folder for `--load-format dummy` (benchmarks of real
    model shapes, whose weights the CUDA engine generates on the GPU).
    """
    if dtype not in _ST_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_ST_DTYPES)}, got {dtype!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_demo_tokenizer()
    V = vocab_size if vocab_size is not None else tok.get_vocab_size()
    if V < tok.get_vocab_size():
        raise ValueError(f"vocab_size {V} is smaller than the tokenizer's {tok.get_vocab_size()}")
    if num_heads % num_kv_heads:
        raise ValueError("num_heads must be a multiple of num_kv_heads")
    D = head_dim or hidden_size // num_heads
    bos, eot_text, eot = (tok.token_to_id(t) for t in SPECIAL_TOKENS)

    config = _config_json(
        architecture, H=hidden_size, I=intermediate_size, L=num_layers, heads=num_heads,
        kv_heads=num_kv_heads, D=D, V=V, max_pos=max_position_embeddings, rope_theta=rope_theta,
        rope_scaling=rope_scaling, tied=tie_word_embeddings, dtype=dtype, bos=bos, eos=eot_text)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": bos, "eos_token_id": [eot_text, eot], "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")

    specs = _tensor_specs(architecture, hidden_size, intermediate_size, num_layers, num_heads,
                          num_kv_heads, D, V, tie_word_embeddings) if write_weights else []
    index_of = {name: i for i, (name, _, _) in enumerate(specs)}
    init_of = {name: init for name, _, init in specs}
    shape_of = {name: shape for name, shape, _ in specs}

    def make(name: str) -> np.ndarray:
        # One RNG stream per tensor, keyed by (seed, tensor index): values do not depend on
        # sharding, and big tensors are made one at a time.
        rng = np.random.default_rng([seed, index_of[name]])
        kind, std = init_of[name]
        x = rng.standard_normal(shape_of[name], dtype=np.float32) * np.float32(std)
        return x + np.float32(1) if kind == "ones" else x

    itemsize = _ST_DTYPES[dtype][1]
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    shard_bytes = 0
    for name, shape, _ in specs:
        nbytes = int(np.prod(shape)) * itemsize
        if max_shard_bytes is not None and shards[-1] and shard_bytes + nbytes > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append((name, shape))
        shard_bytes += nbytes
    if not write_weights:
        pass
    elif len(shards) == 1:
        _write_safetensors(out / "model.safetensors", shards[0], make, dtype)
    else:
        weight_map, total = {}, 0
        for k, shard in enumerate(shards):
            fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            _write_safetensors(out / fname, shard, make, dtype)
            for name, shape in shard:
                weight_map[name] = fname
                total += int(np.prod(shape)) * itemsize
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")

    tok.save(str(out / "tokenizer.json"))
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[0],
        "eos_token": SPECIAL_TOKENS[1],
        "chat_template": _CHAT_TEMPLATE,
        "model_max_length": max_position_embeddings,
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    special_map = {"bos_token": SPECIAL_TOKENS[0], "eos_token": SPECIAL_TOKENS[1]}
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")
    return out


# --- the built-in demo model -------------------------------------------------------------------

DEMO_NAME = "demo-llama"
# Bump when anything that changes the demo's files changes (shape, init, tokenizer, corpus).
DEMO_VERSION = "1"
_DEMO_MARKER = "blink-demo-version"
_DEMO_SHAPE = dict(architecture="llama", hidden_size=256, intermediate_size=512, num_layers=4,
                   num_heads=8, num_kv_heads=4, max_position_embeddings=4096, seed=0)


def _is_current(path: Path) -> bool:
    try:
        return (path / _DEMO_MARKER).read_text().strip() == DEMO_VERSION
    except OSError:
        return False


def ensure_demo_model(cache_dir: str | Path | None = None) -> Path:
    """The built-in demo checkpoint, generated on first use and reused afterwards.

    Lives in `cache_dir`, else $BLINK_CACHE_DIR, else ~/.cache/blink, under "demo-llama". It is
    written into a temporary directory and renamed into place, so a reader never sees a half-written
    model and two processes racing both end up with the same complete one.
    """
    root = Path(cache_dir or os.environ.get("BLINK_CACHE_DIR") or Path.home() / ".cache" / "blink")
    final = root / DEMO_NAME
    if _is_current(final):
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEMO_NAME}-new-", dir=root))
    stale = Path(tempfile.mkdtemp(prefix=f".{DEMO_NAME}-old-", dir=root))
    try:
        write_random_checkpoint(tmp, **_DEMO_SHAPE)
        (tmp / _DEMO_MARKER).write_text(DEMO_VERSION + "\n")  # written last: marks it complete
        if final.exists() and not _is_current(final):
            try:  # an older version: move it out of the way (rename cannot replace a full dir)
                os.rename(final, stale / DEMO_NAME)
            except FileNotFoundError:
                pass  # another process moved it first
        try:
            os.rename(tmp, final)
        except OSError:
            if not _is_current(final):  # lost a race only if the winner's copy is complete
                raise
        return final
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(stale, ignore_errors=True)
