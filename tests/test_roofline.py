"""The benchmarks' floor (gpu_engine/roofline.py) against the bytes of a real checkpoint: a
decode step reads every tensor of the model once except the embedding table, of which it reads
one row per token (with tied embeddings the table is the LM head and is read whole)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from blink.gpu_engine.bench_decode import SHAPES
from blink.gpu_engine.checkpoint import load_config
from blink.gpu_engine.demo_model import write_random_checkpoint
from blink.gpu_engine.roofline import decode_step_bytes, kv_bytes_per_token, \
    layer_projection_weights, step_flops


def tensor_header(model_dir) -> dict[str, dict]:
    """name -> its safetensors header entry (the checkpoint, not our arithmetic)."""
    raw = (model_dir / "model.safetensors").read_bytes()
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    return {name: e for name, e in header.items() if name != "__metadata__"}


def tensor_bytes(model_dir) -> dict[str, int]:
    """name -> bytes, read from the safetensors header."""
    return {name: e["data_offsets"][1] - e["data_offsets"][0]
            for name, e in tensor_header(model_dir).items()}


# (head dim 32: 4 heads of q make 128 rows against a hidden size of 64, o's input and output)
@pytest.mark.parametrize("tied, arch, head_dim", [(False, "llama", None), (True, "llama", None),
                                                   (False, "qwen2", None), (False, "qwen3", None),
                                                   (False, "llama", 32)])
def test_step_bytes_match_the_checkpoint(tmp_path, tied, arch, head_dim):
    """Qwen2's qkv biases and Qwen3's q and k norms are read every step too."""
    model = write_random_checkpoint(tmp_path / "m", hidden_size=64, intermediate_size=160,
                                    num_layers=3, num_heads=4, num_kv_heads=2, vocab_size=2304,
                                    tie_word_embeddings=tied, architecture=arch,
                                    **({"head_dim": head_dim} if head_dim else {}))
    cfg = load_config(model)
    assert head_dim is None or cfg.q_size != cfg.hidden_size
    sizes = tensor_bytes(model)
    rows = {name: e["shape"][0] for name, e in tensor_header(model).items()}
    embed = sizes["model.embed_tokens.weight"]
    read_whole = sum(sizes.values()) - (0 if tied else embed)
    contexts = [1, 17, 300]
    need = decode_step_bytes(cfg, contexts)
    assert need.weights == read_whole
    assert need.embedding == len(contexts) * embed // cfg.vocab_size
    # K and V: layers x kv heads x head dim (64 / 4 heads unless given), bf16, per token
    assert need.kv == sum(contexts) * 3 * 2 * 2 * (head_dim or 64 // 4) * 2 == \
        sum(contexts) * kv_bytes_per_token(cfg)
    assert need.total == need.weights + need.embedding + need.kv
    # FP8 weights: every 2-D projection (the LM head's too, unless kept bf16) as one byte an
    # element and a float32 scale a row; the norm weights stay bf16
    matrices = {n: b for n, b in sizes.items() if n.endswith("proj.weight")}
    head = sizes["lm_head.weight" if not tied else "model.embed_tokens.weight"]
    fp8_matrices = sum(b // 2 for b in matrices.values()) + 4 * sum(rows[n] for n in matrices)
    norms = read_whole - sum(matrices.values()) - head
    fp8_head = head // 2 + 4 * cfg.vocab_size
    assert decode_step_bytes(cfg, contexts, weights_fp8=True).weights == \
        fp8_matrices + fp8_head + norms
    assert decode_step_bytes(cfg, contexts, weights_fp8=True, lm_head_fp8=False).weights == \
        fp8_matrices + head + norms
    # q|k|v and o kept in bf16 beside FP8 ones (Meta's Llama-3.1 FP8 layout): as stored
    attention = {n: b for n, b in matrices.items() if ".self_attn." in n}
    kept = sum(b - b // 2 - 4 * rows[n] for n, b in attention.items())
    assert len(attention) == 4 * cfg.num_layers
    assert decode_step_bytes(cfg, contexts, weights_fp8=True, kept_bf16={"qkv", "o"}).weights \
        == fp8_matrices + kept + fp8_head + norms


def test_a_weightless_folder_for_dummy_weights(tmp_path):
    model = write_random_checkpoint(tmp_path / "shape", hidden_size=64, intermediate_size=160,
                                    num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=4096,
                                    write_weights=False)
    assert not list(model.glob("*.safetensors"))
    cfg = load_config(model)
    assert (cfg.hidden_size, cfg.num_layers, cfg.vocab_size) == (64, 2, 4096)
    assert (model / "tokenizer.json").is_file()
    assert np.isfinite(decode_step_bytes(cfg, [8]).total)


def test_step_flops_match_the_checkpoint(tmp_path):
    """A prefill chunk's work: every 2-D projection tensor of the checkpoint (not the embedding;
    per layer, roofline.layer_projection_weights) once per token, the LM head once per logit
    row, and attention counted from the causal mask itself: one (query, key) pair per
    unmasked cell, head_dim multiply-adds for Q K^T and as many for P V, per head and
    layer."""
    model = write_random_checkpoint(tmp_path / "m", hidden_size=64, intermediate_size=160,
                                    num_layers=3, num_heads=4, num_kv_heads=2, vocab_size=2304)
    cfg = load_config(model)
    raw = (model / "model.safetensors").read_bytes()
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    layer_weights = sum(int(np.prod(e["shape"])) for name, e in header.items()
                        if name.startswith("model.layers.") and len(e["shape"]) == 2)
    lm_head = int(np.prod(header["lm_head.weight"]["shape"]))
    positions = list(range(40, 57))  # a 17-token chunk after 40 cached tokens
    mask = np.arange(57)[None, :] <= np.array(positions)[:, None]
    got = step_flops(cfg, positions, logit_rows=1)
    assert cfg.num_layers * layer_projection_weights(cfg) == layer_weights
    assert got.projections == 2 * (len(positions) * layer_weights + lm_head)
    assert got.attention == 2 * 2 * int(mask.sum()) * cfg.head_dim * cfg.num_heads * 3
    assert got.total == got.projections + got.attention


# Llama-3.2-1B from its published config (hidden 2048, intermediate 8192, 16 layers, 32 heads of
# 64, 8 KV heads, vocabulary 128,256, tied embeddings: 1,235,814,400 parameters), counted by hand.
H, I, L, HEADS, KV_HEADS, D, V = 2048, 8192, 16, 32, 8, 64, 128256


def llama_1b_parameters() -> int:
    per_layer = (H * HEADS * D            # q_proj
                 + 2 * H * KV_HEADS * D   # k_proj, v_proj
                 + HEADS * D * H          # o_proj
                 + 3 * H * I              # gate, up, down
                 + 2 * H)                 # input and post-attention RMSNorm
    return V * H + L * per_layer + H      # embedding (= LM head, tied), layers, final norm


def test_llama_1b_bf16_step_reads_every_parameter_once_and_its_kv():
    assert llama_1b_parameters() == 1_235_814_400  # the model card's 1.24B
    batch, context = 32, 512
    need = decode_step_bytes(SHAPES["llama-3.2-1b"], [context] * batch)
    # tied: the table is the LM head and is read whole (its embedding rows on top)
    assert need.weights == 2 * llama_1b_parameters()
    assert need.embedding == batch * H * 2
    kv_per_token = 2 * L * KV_HEADS * D * 2  # K and V, every layer, bf16: 32 KiB
    assert kv_per_token == 32 * 1024
    assert need.kv == batch * context * kv_per_token
    # FP8 weights and cache: one byte a projection weight (LM head's too) and a float32 scale
    # a projection output row; norms stay bf16; the KV cache one byte an element
    rows = L * (HEADS * D + 2 * KV_HEADS * D + H + 2 * I + H) + V
    norms = L * 2 * H + H
    projections = llama_1b_parameters() - norms
    fp8 = decode_step_bytes(SHAPES["llama-3.2-1b"], [context] * batch, weights_fp8=True,
                            kv_fp8=True)
    assert fp8.weights == projections + 4 * rows + 2 * norms
    assert fp8.kv == batch * context * kv_per_token // 2


def test_a_floor_is_described_in_gigabytes_and_megabytes():
    need = decode_step_bytes(SHAPES["llama-3.2-1b"], [512] * 32)
    weights_gb = 2 * llama_1b_parameters() / 1e9          # 2.47
    kv_gb = 32 * 512 * 2 * L * KV_HEADS * D * 2 / 1e9      # 0.54
    embedding_mb = 32 * H * 2 / 1e6                        # 0.13
    assert need.describe() == (f"{weights_gb:.2f} GB weights + {kv_gb:.2f} GB KV + "
                               f"{embedding_mb:.1f} MB embedding rows")
    assert need.describe() == "2.47 GB weights + 0.54 GB KV + 0.1 MB embedding rows"
