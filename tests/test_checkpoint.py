"""Checkpoint loading: config parsing, safetensors dtypes and sharding, errors, RoPE frequencies."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from blink.gpu_engine.checkpoint import (CheckpointError, load_config, load_tokenizer, load_weights,
                                         rope_inv_freq)
from blink.gpu_engine.demo_model import float32_to_bf16_bits, write_random_checkpoint
from blink.ring.shm import shm_path

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TINY = dict(hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256}


@pytest.fixture(scope="module")
def f32_ckpt(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("f32"), dtype="float32", **TINY)


def _rewrite_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    for k in [k for k, v in changes.items() if v is None]:
        del cfg[k]
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_config_matches_transformers(tmp_path, arch):
    kw = dict(TINY, head_dim=32) if arch == "qwen3" else TINY  # qwen3: head_dim != hidden/heads
    rope = LLAMA3_ROPE if arch == "llama" else None
    path = write_random_checkpoint(tmp_path / arch, architecture=arch, rope_scaling=rope,
                                   tie_word_embeddings=arch == "qwen3", **kw)
    cfg = load_config(path)
    hf = transformers.AutoConfig.from_pretrained(path)
    assert cfg.architecture == arch and cfg.name == arch
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == (
        hf.vocab_size, hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.rms_norm_eps) == (
        hf.num_attention_heads, hf.num_key_value_heads, hf.rms_norm_eps)
    assert cfg.head_dim == (getattr(hf, "head_dim", None)
                            or hf.hidden_size // hf.num_attention_heads)
    assert cfg.head_dim == (32 if arch == "qwen3" else 16)
    assert cfg.attention_bias == (arch == "qwen2") and not cfg.o_proj_bias
    assert cfg.qk_norm == (arch == "qwen3")
    assert cfg.tie_word_embeddings == hf.tie_word_embeddings == (arch == "qwen3")
    assert cfg.rope_theta == 10000.0
    assert cfg.rope_scaling == (LLAMA3_ROPE if arch == "llama" else None)
    # config.json says <|end_of_text|> (1); generation_config.json adds <|eot|> (2).
    assert cfg.bos_token_id == 0 and cfg.eos_token_ids == (1, 2)


def test_config_defaults_and_new_rope_format(tmp_path, f32_ckpt):
    path = shutil.copytree(f32_ckpt, tmp_path / "m")
    # transformers 5 writes rope_parameters (with rope_theta inside) instead of rope_scaling.
    _rewrite_config(path, rope_scaling=None, rope_theta=None, head_dim=None, eos_token_id=[2, 1],
                    rope_parameters=dict(LLAMA3_ROPE, rope_theta=500000.0))
    (path / "generation_config.json").unlink()
    cfg = load_config(path)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling == LLAMA3_ROPE
    assert cfg.head_dim == 16 and cfg.eos_token_ids == (2, 1)
    # Qwen3Config's head_dim default is 128, not hidden/heads.
    _rewrite_config(path, architectures=["Qwen3ForCausalLM"], model_type="qwen3")
    assert load_config(path).head_dim == 128


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_weights_load_bit_exact(tmp_path, f32_ckpt, dtype):
    """Weights written by the safetensors library in each dtype load to exactly torch's float32
    upcast of them; our bf16 writer rounds exactly as torch does."""
    from safetensors.torch import load_file, save_file

    path = shutil.copytree(f32_ckpt, tmp_path / dtype)
    f32 = load_file(path / "model.safetensors")
    tensors = {k: v.to(getattr(torch, dtype)) for k, v in f32.items()}
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    cfg = load_config(path)
    w = load_weights(path, cfg)
    expect = {k: v.float().numpy() for k, v in tensors.items()}
    assert w.embed.dtype == np.float32
    np.testing.assert_array_equal(w.embed, expect["model.embed_tokens.weight"])
    np.testing.assert_array_equal(w.lm_head, expect["lm_head.weight"])
    np.testing.assert_array_equal(w.final_norm, expect["model.norm.weight"])
    layer = w.layers[1]
    np.testing.assert_array_equal(layer.k_proj, expect["model.layers.1.self_attn.k_proj.weight"])
    np.testing.assert_array_equal(layer.down_proj, expect["model.layers.1.mlp.down_proj.weight"])
    np.testing.assert_array_equal(layer.input_norm, expect["model.layers.1.input_layernorm.weight"])
    if dtype == "bfloat16":
        ours = write_random_checkpoint(tmp_path / "ours", dtype="bfloat16", **TINY)
        ours_w = load_weights(ours, load_config(ours))
        np.testing.assert_array_equal(ours_w.layers[1].k_proj, layer.k_proj)
        np.testing.assert_array_equal(ours_w.embed, w.embed)


def test_bf16_rounding_matches_torch():
    x = np.random.default_rng(0).standard_normal(10_000).astype(np.float32) * 100
    x[:4] = [1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -0.0, 65504.0]  # ties to even, both directions
    torch_bits = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(float32_to_bf16_bits(x), torch_bits)


def test_sharded_equals_single(tmp_path, f32_ckpt):
    sharded = write_random_checkpoint(tmp_path / "sharded", dtype="float32",
                                      max_shard_bytes=40_000, **TINY)
    assert len(list(sharded.glob("model-*.safetensors"))) > 2
    assert (sharded / "model.safetensors.index.json").is_file()
    cfg = load_config(sharded)
    a, b = load_weights(sharded, cfg), load_weights(f32_ckpt, cfg)
    np.testing.assert_array_equal(a.embed, b.embed)
    np.testing.assert_array_equal(a.lm_head, b.lm_head)
    for la, lb in zip(a.layers, b.layers):
        for f in dataclasses.fields(la):
            np.testing.assert_array_equal(getattr(la, f.name), getattr(lb, f.name))
    # transformers reads our index and shards too.
    model = transformers.AutoModelForCausalLM.from_pretrained(sharded, dtype=torch.float32)
    np.testing.assert_array_equal(model.model.embed_tokens.weight.detach().numpy(), a.embed)
    # the index, against the shards as the safetensors library reads them: every shard holds
    # tensors, names each of its own, and total_size is their bytes
    from safetensors.numpy import load_file
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = sorted(sharded.glob("model-*.safetensors"))
    held = {f.name: load_file(f) for f in files}
    assert [f.name for f in files] == [f"model-{k:05d}-of-{len(files):05d}.safetensors"
                                       for k in range(1, len(files) + 1)]
    assert all(held.values())
    assert index["weight_map"] == {n: f for f, ts in held.items() for n in ts}
    assert index["metadata"]["total_size"] == sum(t.nbytes for ts in held.values()
                                                  for t in ts.values())


def test_writer_float16_and_data_alignment(tmp_path, f32_ckpt):
    """write_random_checkpoint(dtype="float16") holds the float32 checkpoint's values rounded
    to float16, as the safetensors library reads them; each file's data starts 8-byte aligned
    (the header padded, as the writer says)."""
    from safetensors.numpy import load_file
    f16 = write_random_checkpoint(tmp_path / "f16", dtype="float16", **TINY)
    got, want = load_file(f16 / "model.safetensors"), load_file(f32_ckpt / "model.safetensors")
    assert list(got) == list(want)
    for name, x in want.items():
        assert got[name].dtype == np.float16, name
        np.testing.assert_array_equal(got[name], x.astype(np.float16), name)
    for f in (f16 / "model.safetensors", f32_ckpt / "model.safetensors"):
        with open(f, "rb") as fh:
            assert (8 + int.from_bytes(fh.read(8), "little")) % 8 == 0, f


def test_writer_refuses_what_it_cannot_write(tmp_path):
    with pytest.raises(ValueError, match="qwen2 has no head_dim"):
        write_random_checkpoint(tmp_path / "q", architecture="qwen2", **dict(TINY, head_dim=32))
    with pytest.raises(ValueError, match="architecture must be"):
        write_random_checkpoint(tmp_path / "g", architecture="gpt2", **TINY)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        write_random_checkpoint(tmp_path / "h", **dict(TINY, num_kv_heads=3))
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        write_random_checkpoint(tmp_path / "v", vocab_size=100, **TINY)


def test_tied_embeddings_share_the_array(tmp_path):
    path = write_random_checkpoint(tmp_path / "t", tie_word_embeddings=True, **TINY)
    w = load_weights(path, load_config(path))
    assert w.lm_head is w.embed
    # the embedding is the LM head, so it has the LM head's scale: 4 / sqrt(hidden_size)
    assert w.embed.std() == pytest.approx(4 / TINY["hidden_size"] ** 0.5, rel=0.02)


def test_errors_are_clear(tmp_path, f32_ckpt):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_config(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="config.json not found"):
        load_config(tmp_path / "empty")

    path = shutil.copytree(f32_ckpt, tmp_path / "m")
    cfg = load_config(path)
    _rewrite_config(path, architectures=["GPT2LMHeadModel"])
    with pytest.raises(CheckpointError, match="unsupported architecture.*GPT2LMHeadModel"):
        load_config(path)
    _rewrite_config(path, architectures=["LlamaForCausalLM"],
                    rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(CheckpointError, match="RoPE type 'yarn' is not supported"):
        load_config(path)
    _rewrite_config(path, rope_scaling={"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(CheckpointError, match="lacks low_freq_factor, high_freq_factor"):
        load_config(path)
    _rewrite_config(path, rope_scaling=None, num_key_value_heads=3)
    with pytest.raises(CheckpointError, match="not a multiple"):
        load_config(path)
    _rewrite_config(path, num_key_value_heads=2, hidden_size="64")
    with pytest.raises(CheckpointError, match="hidden_size must be a positive int"):
        load_config(path)
    _rewrite_config(path, hidden_size=64)
    load_config(path)

    wider = dataclasses.replace(cfg, vocab_size=cfg.vocab_size + 1)
    with pytest.raises(CheckpointError, match=r"embed_tokens.weight has shape \[2048, 64\], "
                                              r"config.json implies \[2049, 64\]"):
        load_weights(path, wider)
    with pytest.raises(CheckpointError, match="q_proj.bias not found"):
        load_weights(path, dataclasses.replace(cfg, attention_bias=True))
    (path / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes()[:5000])
    with pytest.raises(CheckpointError, match="past the end of the file"):
        load_weights(path, cfg)
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors weight files"):
        load_weights(path, cfg)
    index = {"weight_map": {"x": "gone.safetensors"}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="shard gone.safetensors .* is missing"):
        load_weights(path, cfg)
    with pytest.raises(CheckpointError, match="tokenizer.json not found"):
        load_tokenizer(tmp_path / "empty")
    assert load_tokenizer(path).get_vocab_size() == cfg.vocab_size


@pytest.mark.parametrize("scaling", [None, "tiny", "llama-3.2"])
def test_rope_inv_freq_matches_transformers(tmp_path, scaling):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    if scaling == "llama-3.2":  # Llama-3.2-1B's head_dim, theta and scaling
        kw = dict(hidden_size=2048, num_heads=32, num_kv_heads=8, num_layers=1, intermediate_size=8,
                  rope_theta=500000.0, max_position_embeddings=131072,
                  rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    else:
        kw = dict(TINY, rope_scaling=LLAMA3_ROPE if scaling else None)
    path = write_random_checkpoint(tmp_path / "m", dtype="float32", **kw)
    hf_cfg = transformers.AutoConfig.from_pretrained(path)
    if scaling is None:
        expect, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(hf_cfg)
    else:
        expect, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg)
    ours = rope_inv_freq(load_config(path))
    assert ours.shape == (load_config(path).head_dim // 2,) and ours.dtype == np.float32
    # Within one float32 ulp: the float32 pow of torch and ours may round the last bit differently.
    np.testing.assert_allclose(ours, expect.numpy(), rtol=1.2e-7, atol=0)
    if scaling:  # the scaling really changes something, so the comparison above means something
        plain, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(hf_cfg)
        assert not np.allclose(ours, plain.numpy())


def test_a_tied_config_with_its_own_lm_head_serves_that_head(tmp_path, f32_ckpt):
    """config.json ties the embedding to the head but the folder stores an lm_head.weight of its
    own: transformers serves the stored head (and warns), so must we; a stored copy equal to the
    embedding stays one array."""
    path = shutil.copytree(f32_ckpt, tmp_path / "m")
    _rewrite_config(path, tie_word_embeddings=True)
    w = load_weights(path, load_config(path))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    head = hf.lm_head.weight.detach().numpy()
    assert not np.array_equal(head, hf.model.embed_tokens.weight.detach().numpy())
    np.testing.assert_array_equal(w.lm_head, head)
    cfg = load_config(path)

    from safetensors.numpy import load_file, save_file
    tensors = load_file(path / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    save_file(tensors, path / "model.safetensors")
    w = load_weights(path, cfg)
    assert w.lm_head is w.embed


def test_rope_keys_as_transformers_reads_them(tmp_path, f32_ckpt):
    """A top-level original_max_position_embeddings wins over the llama3 scaling's own (as
    transformers has it); rope_parameters and rope_scaling that disagree are refused."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    path = shutil.copytree(f32_ckpt, tmp_path / "m")
    _rewrite_config(path, rope_scaling=LLAMA3_ROPE, original_max_position_embeddings=16)
    cfg = load_config(path)
    assert cfg.rope_scaling["original_max_position_embeddings"] == 16
    expect, _ = ROPE_INIT_FUNCTIONS["llama3"](transformers.AutoConfig.from_pretrained(path))
    np.testing.assert_allclose(rope_inv_freq(cfg), expect.numpy(), rtol=1.2e-7, atol=0)

    _rewrite_config(path, original_max_position_embeddings=None,
                    rope_parameters=dict(LLAMA3_ROPE, rope_theta=500000.0))
    with pytest.raises(CheckpointError, match="both rope_parameters and rope_scaling"):
        load_config(path)
    _rewrite_config(path, rope_scaling=dict(LLAMA3_ROPE, rope_theta=500000.0))
    assert load_config(path).rope_theta == 500000.0  # the same in both: no doubt


def test_model_type_must_match_the_architecture(tmp_path):
    """transformers builds the model config.json's model_type names: a Qwen2 folder labelled
    LlamaForCausalLM is a Qwen2 model (with q/k/v biases) to it, so it is refused, not served
    as Llama; with no architectures, model_type alone says the model."""
    path = write_random_checkpoint(tmp_path / "q", architecture="qwen2", **TINY)
    _rewrite_config(path, architectures=["LlamaForCausalLM"])
    with pytest.raises(CheckpointError, match="model_type 'qwen2' does not match .*Llama"):
        load_config(path)
    _rewrite_config(path, architectures=None)
    assert load_config(path).architecture == "qwen2"
    _rewrite_config(path, architectures="Qwen2ForCausalLM")
    assert load_config(path).attention_bias


def test_config_values_and_weight_headers_are_refused_in_one_error(tmp_path, f32_ckpt):
    """Malformed numbers, more eos ids than the ring carries and broken safetensors headers are
    CheckpointErrors (one line at start-up), not ValueErrors or KeyErrors from deep inside;
    check_weights finds the weight files' problems from their headers alone."""
    from blink.gpu_engine.checkpoint import check_weights

    path = shutil.copytree(f32_ckpt, tmp_path / "m")
    for changes, message in (
            (dict(rms_norm_eps="x"), "rms_norm_eps must be a positive number"),
            (dict(rope_theta="abc"), "rope_theta must be a positive number"),
            (dict(rope_scaling=dict(LLAMA3_ROPE, low_freq_factor=0)),
             "low_freq_factor must be a positive number"),
            (dict(rope_scaling=dict(LLAMA3_ROPE, original_max_position_embeddings="8k")),
             "original_max_position_embeddings must be a positive int"),
            (dict(eos_token_id=list(range(3, 10))), "9 eos token ids.*at most 8")):
        _rewrite_config(path, **changes)
        with pytest.raises(CheckpointError, match=message):
            load_config(path)
        _rewrite_config(path, **{k: json.loads((f32_ckpt / "config.json").read_text()).get(k)
                                 for k in changes})
    cfg = load_config(path)
    check_weights(path, cfg)
    with pytest.raises(CheckpointError, match="config.json implies"):
        check_weights(path, dataclasses.replace(cfg, intermediate_size=97))
    with pytest.raises(CheckpointError, match="q_norm.weight not found"):
        check_weights(path, dataclasses.replace(cfg, qk_norm=True))

    data = (path / "model.safetensors").read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    for broken, message in (
            ([], "not a JSON object"),
            ({**header, "model.norm.weight": {"dtype": "F32", "shape": [64]}},
             "corrupt safetensors header entry for model.norm.weight"),
            ({**header, "model.norm.weight": dict(header["model.norm.weight"], dtype="F64")},
             "model.norm.weight has dtype F64")):
        text = json.dumps(broken, separators=(",", ":")).encode()
        assert len(text) <= n  # the same header length, its end padded with spaces
        text = text.ljust(n)
        (path / "model.safetensors").write_bytes(data[:8] + text + data[8 + n:])
        for load in (check_weights, load_weights):
            with pytest.raises(CheckpointError, match=message):
                load(path, cfg)


# --- adversarial folders: each refused in one line at start-up -----------------------------------

def _edit_header(path, edit, fname="model.safetensors", extra_bytes=b""):
    """Rewrites a safetensors file's header as edit(header) returns it (the data unchanged, plus
    extra_bytes at the end)."""
    f = path / fname
    data = f.read_bytes()
    n = int.from_bytes(data[:8], "little")
    text = json.dumps(edit(json.loads(data[8:8 + n])), separators=(",", ":")).encode()
    text = text.ljust(-(-len(text) // 8) * 8)
    f.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + n:] + extra_bytes)


def _entry(name, **changes):
    """A header edit: tensor `name`'s entry with `changes`."""
    return lambda h: {**h, name: {**h[name], **changes}}


def _offsets(name, shift):
    return lambda h: _entry(name, data_offsets=[o + shift for o in h[name]["data_offsets"]])(h)


def _same_bytes_as(name, other):
    return lambda h: _entry(name, data_offsets=h[other]["data_offsets"])(h)


NORM = "model.norm.weight"


@pytest.mark.parametrize("edit, extra_bytes", [
    (_entry(NORM, dtype=["F32"]), b""),  # not a string
    (_entry(NORM, shape=["64"]), b""),
    (_entry(NORM, shape=[64.0]), b""),
    (_offsets(NORM, 0.5), b""),
    (_entry(NORM, data_offsets=[-256, 0]), b""),  # the header's own bytes
    (_same_bytes_as(NORM, "model.layers.0.input_layernorm.weight"), b""),  # overlap
    (_offsets("lm_head.weight", 4), b"\0" * 4),  # a hole before the last tensor
    (lambda h: h, b"\0" * 8),  # bytes no tensor owns after the last one
], ids=["dtype-list", "shape-str", "shape-float", "offset-float", "offset-negative", "overlap",
        "gap", "trailing-bytes"])
def test_safetensors_headers_are_checked_as_the_library_checks_them(tmp_path, f32_ckpt, edit,
                                                                     extra_bytes):
    """A header the safetensors library refuses (so transformers cannot load the file either) is
    refused in one CheckpointError, never read: offsets that overlap or point into the header
    would serve another tensor's bytes as this one's."""
    from safetensors import SafetensorError, safe_open

    from blink.gpu_engine.checkpoint import check_weights

    path = shutil.copytree(f32_ckpt, tmp_path / "m")
    _edit_header(path, edit, extra_bytes=extra_bytes)
    with pytest.raises(SafetensorError):  # the oracle refuses it
        safe_open(str(path / "model.safetensors"), "np")
    cfg = load_config(path)
    for load in (check_weights, load_weights):
        with pytest.raises(CheckpointError, match="model.safetensors"):
            load(path, cfg)


def _dangling_weights(path):
    (path / "model.safetensors").unlink()
    (path / "model.safetensors").symlink_to(path / "blobs" / "never-downloaded")


def _weights_beside_a_folder_named_like_them(path):
    # (no model.safetensors, which would be taken alone, as transformers takes it)
    (path / "model.safetensors").rename(path / "weights.safetensors")
    (path / "extra.safetensors").mkdir()


def _sharded_with_a_null_shard(path):
    (path / "model.safetensors").unlink()
    write_random_checkpoint(path, dtype="float32", max_shard_bytes=40_000, **TINY)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"][NORM] = None
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def _nan_weight(path):
    from safetensors.numpy import load_file, save_file
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = np.nan
    save_file(tensors, path / "model.safetensors")


def _config(**changes):
    return lambda path: _rewrite_config(path, **changes)


# case -> (how the folder is broken, what its one line says)
UNSERVABLE = {
    "weights a dangling link": (_dangling_weights, r"model.safetensors is not a file"),
    "a folder named like weights": (_weights_beside_a_folder_named_like_them,
                                    r"extra.safetensors is not a file"),
    "header dtype not a string": (lambda p: _edit_header(p, _entry(NORM, dtype=["F32"])),
                                  r"corrupt safetensors header entry for model.norm.weight"),
    "shard listed as null": (_sharded_with_a_null_shard,
                             r"weight_map.*model.norm.weight.*None"),
    "architectures not strings": (_config(architectures=[["LlamaForCausalLM"]]),
                                  r"architectures must be a list of names"),
    "zero kv heads": (_config(num_key_value_heads=0),
                      r"num_key_value_heads must be a positive int, got 0"),
    "zero head_dim": (_config(head_dim=0), r"head_dim must be a positive int, got 0"),
    "hidden not a multiple of heads": (
        _config(num_attention_heads=5, num_key_value_heads=5, head_dim=None),
        r"hidden_size 64 is not a multiple of num_attention_heads 5"),
    "tie flag a string": (_config(tie_word_embeddings="false"),
                          r"tie_word_embeddings must be true or false, got 'false'"),
    "bias flag a string": (_config(attention_bias="false"),
                           r"attention_bias must be true or false, got 'false'"),
    "NaN in a weight": (_nan_weight,
                        r"model.layers.1.mlp.up_proj.weight holds NaN or infinite values"),
}


def start_engine(model, ring: str) -> subprocess.CompletedProcess:
    """`blink engine --engine cpu --model DIR` as `blink serve` starts it (warnings and errors
    only): a folder it cannot serve ends it before it serves; one it can would run until the
    timeout, which fails the caller."""
    try:
        return subprocess.run(
            [sys.executable, "-m", "blink.client.cli", "engine", "--engine", "cpu", "--model",
             str(model), "--ring-name", ring, "--log-level", "warning"],
            capture_output=True, text=True, timeout=60)
    finally:
        shm_path(ring).unlink(missing_ok=True)  # left only by an engine the timeout killed


def assert_one_line_refusal(done: subprocess.CompletedProcess, message: str) -> None:
    lines = done.stderr.strip().splitlines()
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    assert len(lines) == 1 and re.search(message, lines[0]), done.stderr


@pytest.mark.parametrize("case", list(UNSERVABLE))
def test_unservable_folders_stop_the_engine_in_one_line(tmp_path, f32_ckpt, case):
    """The real start-up (`blink engine --engine cpu`): a folder it cannot serve exits non-zero
    with one line naming the file, tensor or key and what is wrong; never a traceback, never
    served."""
    path = shutil.copytree(f32_ckpt, tmp_path / "m")
    broken, message = UNSERVABLE[case]
    broken(path)
    assert_one_line_refusal(start_engine(path, f"ckpt-test-{os.getpid()}"), message)


def test_tensors_the_model_does_not_use_are_ignored_with_a_warning(tmp_path, f32_ckpt, caplog):
    """As transformers does (its load report lists them as UNEXPECTED and loads the model):
    a tensor no module of the model takes is skipped, and named in one warning."""
    from safetensors.numpy import load_file, save_file

    path = shutil.copytree(f32_ckpt, tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.2.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.0.self_attn.o_proj.bias"] = np.ones(64, np.float32)
    save_file(tensors, path / "model.safetensors")
    cfg = load_config(path)
    with caplog.at_level("WARNING", logger="blink.gpu_engine.checkpoint"):
        w = load_weights(path, cfg)
    assert "2 tensors" in caplog.text and "model.layers.2.mlp.up_proj.weight" in caplog.text
    assert "model.layers.0.self_attn.o_proj.bias" in caplog.text
    np.testing.assert_array_equal(w.layers[1].up_proj,
                                  tensors["model.layers.1.mlp.up_proj.weight"])
    assert w.layers[0].o_bias is None
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert len(hf.model.layers) == 2 and hf.model.layers[0].self_attn.o_proj.bias is None


def _walk_as_the_cuda_engine_uploads(weights) -> int:
    """Each layer's fused projections to bf16 bits, one layer at a time, as
    CudaForward._upload_weights makes them (the host's part of an upload); the layers seen."""
    seen = 0
    for lw in weights.layers:
        float32_to_bf16_bits(np.concatenate([lw.q_proj, lw.k_proj, lw.v_proj]))
        float32_to_bf16_bits(np.concatenate([lw.gate_proj, lw.up_proj]))
        seen += 1
    return seen


def test_layers_on_demand_hold_one_layer_at_a_time(tmp_path):
    """load_weights(layers_on_demand=True), as the CUDA engines load: the eager load's arrays
    (an FP8 checkpoint's stored codes and scales too), with the host holding about one layer's
    float32 arrays while the layers are walked as the upload walks them, where the eager load
    holds every layer's (tracemalloc sees NumPy's allocations); every header is checked before
    anything is read, and a layer's bad value is refused when that layer is read."""
    import tracemalloc

    from safetensors.numpy import load_file, save_file
    from test_fp8 import fp8_checkpoint

    shape = dict(hidden_size=128, intermediate_size=512, num_layers=12, num_heads=4,
                 num_kv_heads=2)
    path = write_random_checkpoint(tmp_path / "m", dtype="float32", **shape)
    cfg = load_config(path)
    layer_bytes = 4 * (2 * 128 * 128 + 2 * 64 * 128 + 3 * 512 * 128)

    def peak(**kw) -> int:
        tracemalloc.start()
        try:
            w = load_weights(path, cfg, **kw)
            assert _walk_as_the_cuda_engine_uploads(w) == 12
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    heads = 2 * 4 * cfg.vocab_size * 128  # the embedding and the LM head, read at once
    eager, on_demand = peak(), peak(layers_on_demand=True)
    assert eager > heads + 12 * layer_bytes, (eager, heads, layer_bytes)
    # two layers (the next is read while the walk still holds the last) and their temporaries
    assert on_demand < heads + 4 * layer_bytes, (on_demand, heads, layer_bytes)

    fp8_path = tmp_path / "fp8"
    fp8_checkpoint(path, fp8_path, "row")
    for folder in (path, fp8_path):
        c = load_config(folder)
        a, b = load_weights(folder, c), load_weights(folder, c, layers_on_demand=True)
        assert len(b.layers) == 12 and b.layers[-1] is not b.layers[-1]  # read again, not kept
        with pytest.raises(TypeError):
            b.layers[1.0]
        for la, lb in zip(a.layers, b.layers):
            for f in dataclasses.fields(la):
                if f.name != "fp8_codes":
                    np.testing.assert_array_equal(getattr(la, f.name), getattr(lb, f.name))
            assert sorted(la.fp8_codes) == sorted(lb.fp8_codes) == (
                sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                        "down_proj"]) if folder == fp8_path else [])
            for name, (codes, scale) in la.fp8_codes.items():
                np.testing.assert_array_equal(lb.fp8_codes[name][0], codes)
                np.testing.assert_array_equal(lb.fp8_codes[name][1], scale)
        np.testing.assert_array_equal(a.embed, b.embed)

    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.11.mlp.down_proj.weight"][3, 5] = np.nan
    save_file(tensors, path / "model.safetensors")
    w = load_weights(path, cfg, layers_on_demand=True)  # the values wait for their layer
    w.layers[10]
    with pytest.raises(CheckpointError, match=r"model\.layers\.11\.mlp\.down_proj\.weight "
                                              r"holds NaN"):
        w.layers[11]
    tensors["model.layers.11.mlp.down_proj.weight"] = np.zeros((128, 500), np.float32)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"down_proj\.weight has shape \[128, 500\]"):
        load_weights(path, cfg, layers_on_demand=True)  # the headers, all before anything


def test_a_folder_with_both_weight_forms_loads_what_transformers_loads(tmp_path, f32_ckpt):
    """model.safetensors beside a shard index (a re-saved checkpoint's leftovers): transformers
    loads model.safetensors; Blink took the shards, and served other weights without a word."""
    path = shutil.copytree(f32_ckpt, tmp_path / "m")
    shards = write_random_checkpoint(tmp_path / "shards", dtype="float32", seed=7,
                                     max_shard_bytes=40_000, **TINY)
    for f in shards.glob("model*.safetensors*"):
        shutil.copy(f, path / f.name)
    cfg = load_config(path)
    ours = load_weights(path, cfg)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    want = model.model.embed_tokens.weight.detach().numpy()
    np.testing.assert_array_equal(ours.embed, want)
    assert not np.array_equal(load_weights(shards, cfg).embed, want)  # the two sets differ


@pytest.mark.parametrize("where", ["config.json", "safetensors header"])
def test_json_nested_past_the_parser_s_depth_is_one_error(tmp_path, f32_ckpt, where):
    """JSON nested deeper than Python's recursion limit (no writer makes it; a corrupt or
    hostile file) was a RecursionError's traceback; the safetensors library refuses such a
    header too."""
    path = shutil.copytree(f32_ckpt, tmp_path / "m")
    deep = "[" * 100_000 + "]" * 100_000
    if where == "config.json":
        (path / "config.json").write_text(deep)
        with pytest.raises(CheckpointError, match="config.json is not valid JSON: nested too "
                                                  "deeply"):
            load_config(path)
        return
    raw = deep.encode()
    (path / "model.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw)
    with pytest.raises(CheckpointError, match="corrupt safetensors header: nested too deeply"):
        load_weights(path, load_config(f32_ckpt))


TINY_SHAPE = dict(hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=4)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_defaults_of_absent_config_keys_are_transformers(tmp_path, arch):
    """A config.json without the optional keys: the values Blink takes are AutoConfig's on the
    same folder. (Qwen2's and Qwen3's num_key_value_heads default is 32 in transformers, not
    the heads; Blink takes the heads, whose weights the checkpoint then has, so it is left
    out there.)"""
    transformers = pytest.importorskip("transformers")
    path = write_random_checkpoint(tmp_path / arch, architecture=arch, dtype="float32",
                                   **TINY_SHAPE)
    raw = json.loads((path / "config.json").read_text())
    for key in (("num_key_value_heads",) if arch == "llama" else ()) + (
            "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling",
            "rope_parameters"):
        raw.pop(key, None)
    (path / "config.json").write_text(json.dumps(raw))
    ours, hf = load_config(path), transformers.AutoConfig.from_pretrained(path)
    theta = ((getattr(hf, "rope_parameters", None) or {}).get("rope_theta")
             or getattr(hf, "rope_theta", None))
    assert (ours.num_kv_heads, ours.max_position_embeddings, ours.rms_norm_eps,
            ours.rope_theta) == (hf.num_key_value_heads, hf.max_position_embeddings,
                                 hf.rms_norm_eps, theta)


def test_legacy_rope_scaling_type_key_is_read(tmp_path):
    """Older hub configs write rope_scaling {"type": ...} (not rope_type): transformers reads
    the same scaling from either, and so does Blink."""
    transformers = pytest.importorskip("transformers")
    path = write_random_checkpoint(tmp_path / "m", dtype="float32", **TINY_SHAPE)
    raw = json.loads((path / "config.json").read_text())
    raw.pop("rope_parameters", None)
    raw["rope_scaling"] = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
    (path / "config.json").write_text(json.dumps(raw))
    ours, hf = load_config(path), transformers.AutoConfig.from_pretrained(path)
    params = getattr(hf, "rope_parameters", None) or hf.rope_scaling
    assert params.get("rope_type", params.get("type")) == "llama3"
    assert ours.rope_scaling is not None and ours.rope_scaling["factor"] == 8.0


def test_a_special_token_id_equal_to_the_vocabulary_size_is_refused(tmp_path):
    """Ids run 0 .. vocab_size - 1: an eos id of vocab_size names no token."""
    path = write_random_checkpoint(tmp_path / "m", dtype="float32", **TINY_SHAPE)
    raw = json.loads((path / "config.json").read_text())
    (path / "generation_config.json").unlink(missing_ok=True)
    raw["eos_token_id"] = raw["vocab_size"]
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="outside the vocabulary"):
        load_config(path)

