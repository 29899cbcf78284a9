"""FP8 checkpoints in the formats other tools write, beside transformers' own (test_fp8.py):
compressed-tensors (llm-compressor's, quant_method "compressed-tensors": RedHat's and Neural
Magic's FP8 releases), FBGEMM's (quant_method "fbgemm_fp8": Meta's Llama 3.1 FP8 releases) and
NVIDIA ModelOpt's (quant_method "modelopt", or hf_quant_config.json).

Oracle: transformers with the compressed-tensors package, which reads a compressed-tensors
checkpoint back as dense weights (dequantize=True); torch's E4M3 codes times their scales for
FBGEMM's and ModelOpt's, which transformers reads only on a GPU.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from blink.gpu_engine.checkpoint import (CheckpointError, check_weights, load_config,
                                         load_weights)
from blink.gpu_engine.demo_model import write_random_checkpoint

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

PROJECTIONS = {"self_attn.q_proj": "q_proj", "self_attn.k_proj": "k_proj",
               "self_attn.v_proj": "v_proj", "self_attn.o_proj": "o_proj",
               "mlp.gate_proj": "gate_proj", "mlp.up_proj": "up_proj",
               "mlp.down_proj": "down_proj"}
NUM_LAYERS = 2


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("formats") / "m", hidden_size=128,
                                   intermediate_size=256, num_layers=NUM_LAYERS, num_heads=4,
                                   num_kv_heads=2, seed=5)


def _scales(w, strategy: str, block: tuple[int, int] | None):
    """(the stored scale tensor, its value for every element of w) of a max-abs E4M3 scale
    per tensor, row, or (rows, columns) block (the last blocks partial where they do not
    divide w)."""
    if strategy == "tensor":
        scale = w.abs().amax().reshape(1) / 448
        return scale, scale
    if strategy == "channel":
        scale = w.abs().amax(1, keepdim=True) / 448
        return scale, scale
    (n, k), (bn, bk) = w.shape, block
    padded = torch.zeros(-(-n // bn) * bn, -(-k // bk) * bk)
    padded[:n, :k] = w
    scale = padded.reshape(-1, bn, padded.shape[1] // bk, bk).abs().amax((1, 3)) / 448
    return scale, scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]


def _write(src: Path, dst: Path, quantization_config: dict, strategy: str,
           block: tuple[int, int] | None = None, scale_dtype=torch.float32,
           extra=lambda base, out: None) -> None:
    """dst: src with every projection's weight as torch's E4M3 codes and a `weight_scale` of
    scale_dtype (per `strategy`, as _scales), config.json's quantization_config as given;
    extra(base, tensors) adds tensors beside each projection's."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    out = {}
    for name, t in safetensors_torch.load_file(str(src / "model.safetensors")).items():
        base = name[:-len("weight")]
        if not any(base.endswith(p + ".") for p in PROJECTIONS):
            out[name] = t
            continue
        scale, full = _scales(t.float(), strategy, block)
        scale = scale.to(scale_dtype)
        out[name] = (t.float() / full.to(scale_dtype).float()).to(torch.float8_e4m3fn)
        out[base + "weight_scale"] = scale
        extra(base, out)
    safetensors_torch.save_file(out, str(dst / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config))


def ct_config(strategy: str = "channel", block: tuple[int, int] | None = None,
              static_inputs: bool = False, kv_cache: bool = False) -> dict:
    """compressed-tensors' quantization_config as llm-compressor writes it for FP8 weights:
    one group over every Linear but the LM head."""
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
               "strategy": strategy, "group_size": block[1] if strategy == "group" else None,
               "block_structure": list(block) if strategy == "block" else None,
               "actorder": None, "observer": "minmax", "observer_kwargs": {}}
    inputs = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": not static_inputs,
              "strategy": "tensor" if static_inputs else "token", "group_size": None,
              "block_structure": None, "observer": None if not static_inputs else "minmax"}
    kv = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
          "strategy": "tensor"}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed", "global_compression_ratio": None,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": inputs,
                                          "output_activations": None}},
            "ignore": ["lm_head"], "kv_cache_scheme": kv if kv_cache else None}


def _weights_by_name(w) -> dict[str, np.ndarray]:
    return {f"model.layers.{i}.{p}.weight": getattr(w.layers[i], a)
            for i in range(NUM_LAYERS) for p, a in PROJECTIONS.items()}


@pytest.mark.parametrize("strategy, block, scale_dtype, static_inputs", [
    ("tensor", None, torch.float32, True),
    ("channel", None, torch.bfloat16, False),
    ("block", (48, 48), torch.bfloat16, False),  # 48: every projection's last blocks partial
    ("group", (1, 32), torch.float32, False),
])
def test_compressed_tensors_fp8_reads_as_transformers_dequantizes_it(
        bf16_checkpoint, tmp_path, caplog, strategy, block, scale_dtype, static_inputs):
    """Every projection reads back as transformers (with compressed-tensors) dequantizes it:
    exactly with float32 scales; with bf16 ones transformers multiplies in bf16, so ours
    (exact in float32: an E4M3 code times a bf16 scale has 12 significant bits) rounded to
    bf16 is its value. The static input scales are not read and not reported as unused."""
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    dst = tmp_path / "ct"
    inputs = (lambda base, out: out.__setitem__(base + "input_scale",
                                                torch.tensor([0.01], dtype=scale_dtype)))
    _write(bf16_checkpoint, dst, ct_config(strategy, block, static_inputs), strategy, block,
           scale_dtype, extra=inputs if static_inputs else lambda base, out: None)
    cfg = load_config(dst)
    assert (cfg.quantization, cfg.fp8_weight_block) == ("fp8", block)
    check_weights(dst, cfg)
    with caplog.at_level(logging.WARNING, logger="blink.gpu_engine.checkpoint"):
        ours = _weights_by_name(load_weights(dst, cfg))
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    model = AutoModelForCausalLM.from_pretrained(
        dst, quantization_config=CompressedTensorsConfig(dequantize=True), dtype=torch.float32)
    theirs = model.state_dict()
    for name, value in ours.items():
        if scale_dtype == torch.bfloat16:
            value = torch.from_numpy(value).to(torch.bfloat16).float().numpy()
        np.testing.assert_array_equal(value, theirs[name].numpy(), err_msg=name)


@pytest.mark.parametrize("keys, values", [
    ("self_attn.k_scale", "self_attn.v_scale"),  # llm-compressor now, as vLLM names them
    ("self_attn.k_proj.output_scale", "self_attn.v_proj.output_scale"),  # its earlier releases
])
def test_compressed_tensors_kv_cache_scales(bf16_checkpoint, tmp_path, caplog, keys, values):
    """A kv_cache_scheme's per-tensor scales, under either name llm-compressor has given
    them, are the FP8 cache's scales."""
    dst = tmp_path / "ct"
    _write(bf16_checkpoint, dst, ct_config(kv_cache=True), "channel")
    tensors = safetensors_torch.load_file(str(dst / "model.safetensors"))
    for i in range(NUM_LAYERS):
        tensors[f"model.layers.{i}.{keys}"] = torch.tensor([0.04 + i])
        tensors[f"model.layers.{i}.{values}"] = torch.tensor([0.03 + i])
    safetensors_torch.save_file(tensors, str(dst / "model.safetensors"))
    with caplog.at_level(logging.WARNING, logger="blink.gpu_engine.checkpoint"):
        w = load_weights(dst, load_config(dst))
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    np.testing.assert_allclose(w.kv_scales, [[0.04, 0.03], [1.04, 1.03]], rtol=1e-6)


def _group(config: dict) -> dict:
    return config["config_groups"]["group_0"]


# (what the edit does, the edit of ct_config()'s output, what the refusal names)
REFUSED = [
    ("int8 weights", lambda c: _group(c)["weights"].update(type="int"), "8-bit int"),
    ("4-bit weights", lambda c: _group(c)["weights"].update(num_bits=4), "4-bit float"),
    ("asymmetric", lambda c: _group(c)["weights"].update(symmetric=False), "symmetric"),
    ("dynamic weights", lambda c: _group(c)["weights"].update(dynamic=True), "static scales"),
    ("NVFP4's strategy", lambda c: _group(c)["weights"].update(strategy="tensor_group"),
     "tensor_group"),
    ("a block without its size", lambda c: _group(c)["weights"].update(strategy="block"),
     "block_structure"),
    ("a bad group size", lambda c: _group(c)["weights"].update(strategy="group", group_size=0),
     "group_size"),
    ("packed weights", lambda c: c.update(format="pack-quantized"), "pack-quantized"),
    ("a format not a string", lambda c: c.update(format=["float-quantized"]), "format"),
    ("a quant_method not a string", lambda c: c.update(quant_method=["fp8"]), "quant_method"),
    ("activation-ordered groups", lambda c: _group(c)["weights"].update(
        strategy="group", group_size=32, actorder="group"), "actorder"),
    # compressed-tensors' other spellings of "group" (its validator maps both to GROUP)
    ("activation-ordered groups, actorder true", lambda c: _group(c)["weights"].update(
        strategy="group", group_size=32, actorder=True), "actorder"),
    ("activation-ordered groups, actorder 'dynamic'", lambda c: _group(c)["weights"].update(
        strategy="group", group_size=32, actorder="dynamic"), "actorder"),
    ("a group's own format", lambda c: _group(c).update(format="int-quantized"),
     "int-quantized"),
    ("2:4 sparsity", lambda c: c.update(sparsity_config={"format": "sparse-24-bitmask"}),
     "sparsity_config"),
    ("int8 activations", lambda c: _group(c)["input_activations"].update(type="int"),
     "input activations"),
    ("output activations", lambda c: _group(c).update(output_activations={"num_bits": 8}),
     "output activation"),
    ("per-head KV scales", lambda c: c.update(kv_cache_scheme={
        "num_bits": 8, "type": "float", "strategy": "attn_head", "dynamic": False}),
     "kv_cache_scheme"),
    ("no group", lambda c: c.update(config_groups={}), "config_groups"),
    ("weights not described", lambda c: _group(c).pop("weights"), "no weights scheme"),
    ("two block sizes", lambda c: c["config_groups"].update(group_1={
        "targets": ["re:.*down_proj"], "weights": {**_group(c)["weights"], "strategy": "block",
                                                    "block_structure": [64, 64]}}) or
     _group(c)["weights"].update(strategy="block", block_structure=[128, 128]),
     "different blocks"),
    ("rows and blocks", lambda c: c["config_groups"].update(group_1={
        "targets": ["re:.*down_proj"], "weights": {**_group(c)["weights"], "strategy": "block",
                                                    "block_structure": [64, 64]}}),
     "different blocks"),
]


# (what the edit does, the edit of ct_config()'s output, the weights' blocks it reads as):
# forms compressed-tensors itself reads
ACCEPTED = [
    ("dense sparsity (none)", lambda c: c.update(sparsity_config={"format": "dense"}), None),
    ("a block_structure as a string", lambda c: _group(c)["weights"].update(
        strategy="block", block_structure="48x48"), (48, 48)),
    ("an upper-case type", lambda c: _group(c)["weights"].update(type="FLOAT"), None),
    ("no strategy, a group size", lambda c: _group(c)["weights"].update(
        strategy=None, group_size=32), (1, 32)),
    ("no strategy, group size -1: rows", lambda c: _group(c)["weights"].update(
        strategy=None, group_size=-1), None),
]


@pytest.mark.parametrize("edit, block", [r[1:] for r in ACCEPTED], ids=[r[0] for r in ACCEPTED])
def test_compressed_tensors_configs_in_other_forms_are_read(bf16_checkpoint, tmp_path, edit,
                                                             block):
    config = ct_config()
    edit(config)
    dst = tmp_path / "ok"
    _write(bf16_checkpoint, dst, config, "channel")
    cfg = load_config(dst)
    assert (cfg.quantization, cfg.fp8_weight_block) == ("fp8", block)


@pytest.mark.parametrize("edit, match", [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_unsupported_compressed_tensors_configs_are_refused_in_one_line(
        bf16_checkpoint, tmp_path, edit, match):
    """What Blink cannot serve as E4M3 weights with their scales is a CheckpointError naming
    it, from config.json alone (before any weight is read)."""
    config = ct_config()
    edit(config)
    dst = tmp_path / "bad"
    _write(bf16_checkpoint, dst, config, "channel")
    with pytest.raises(CheckpointError, match=match) as refusal:
        load_config(dst)
    assert "\n" not in str(refusal.value)


def test_a_nonzero_zero_point_is_refused_and_zeros_are_read(bf16_checkpoint, tmp_path):
    """compressed-tensors may store zero points beside symmetric weights: zeros load as the
    weights without them; anything else would be asymmetric weights, which are refused."""
    def zero_points(fill):
        def extra(base, out):
            n = out[base + "weight"].shape[0]
            out[base + "weight_zero_point"] = torch.full((n, 1), fill, dtype=torch.float32)
        return extra

    _write(bf16_checkpoint, tmp_path / "plain", ct_config(), "channel")
    _write(bf16_checkpoint, tmp_path / "zeros", ct_config(), "channel", extra=zero_points(0))
    plain = _weights_by_name(load_weights(tmp_path / "plain", load_config(tmp_path / "plain")))
    zeros = _weights_by_name(load_weights(tmp_path / "zeros", load_config(tmp_path / "zeros")))
    for name, value in plain.items():
        np.testing.assert_array_equal(zeros[name], value, err_msg=name)
    _write(bf16_checkpoint, tmp_path / "shifted", ct_config(), "channel",
           extra=zero_points(3))
    with pytest.raises(CheckpointError, match="weight_zero_point is not zero"):
        load_weights(tmp_path / "shifted", load_config(tmp_path / "shifted"))


def test_fbgemm_fp8_reads_its_codes_times_row_scales(bf16_checkpoint, tmp_path, caplog):
    """FBGEMM's FP8: E4M3 codes with a float32 scale per output row, and an input_scale_ub
    beside each (a bound Blink's per-row activation scales do not need: not reported as
    unused)."""
    def bound(base, out):
        out[base + "input_scale_ub"] = torch.tensor([1200.0])

    dst = tmp_path / "fbgemm"
    _write(bf16_checkpoint, dst, {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                                  "modules_to_not_convert": ["lm_head"]}, "channel",
           extra=bound)
    cfg = load_config(dst)
    assert (cfg.quantization, cfg.fp8_weight_block) == ("fp8", None)
    with caplog.at_level(logging.WARNING, logger="blink.gpu_engine.checkpoint"):
        ours = _weights_by_name(load_weights(dst, cfg))
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    stored = safetensors_torch.load_file(str(dst / "model.safetensors"))
    for name, value in ours.items():
        want = stored[name].float() * stored[name + "_scale"]
        np.testing.assert_array_equal(value, want.numpy(), err_msg=name)


@pytest.mark.parametrize("where", ["config.json", "hf_quant_config.json"])
def test_modelopt_fp8_reads_its_codes_times_tensor_scales(bf16_checkpoint, tmp_path, caplog,
                                                          where):
    """NVIDIA ModelOpt's FP8: E4M3 codes with a scale per tensor and a static input_scale
    (not read, not reported), the FP8 cache's scales as the k and v projections' k_scale and
    v_scale; said in config.json's quantization_config, or in hf_quant_config.json alone as
    its earlier releases did."""
    def input_scale(base, out):
        out[base + "input_scale"] = torch.tensor([0.02])

    quant = {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8", "exclude_modules": ["lm_head"]}
    dst = tmp_path / "modelopt"
    _write(bf16_checkpoint, dst, {"quant_method": "modelopt", **quant}, "tensor",
           extra=input_scale)
    stored = safetensors_torch.load_file(str(dst / "model.safetensors"))
    for i in range(NUM_LAYERS):
        stored[f"model.layers.{i}.self_attn.k_proj.k_scale"] = torch.tensor(0.06 + i)
        stored[f"model.layers.{i}.self_attn.v_proj.v_scale"] = torch.tensor(0.05 + i)
    safetensors_torch.save_file(stored, str(dst / "model.safetensors"))
    if where == "hf_quant_config.json":
        config = json.loads((dst / "config.json").read_text())
        del config["quantization_config"]
        (dst / "config.json").write_text(json.dumps(config))
        (dst / where).write_text(json.dumps({"producer": {"name": "modelopt"},
                                             "quantization": quant}))
    cfg = load_config(dst)
    assert (cfg.quantization, cfg.fp8_weight_block) == ("fp8", None)
    with caplog.at_level(logging.WARNING, logger="blink.gpu_engine.checkpoint"):
        w = load_weights(dst, cfg)
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    for name, value in _weights_by_name(w).items():
        want = stored[name].float() * stored[name + "_scale"]
        np.testing.assert_array_equal(value, want.numpy(), err_msg=name)
    np.testing.assert_allclose(w.kv_scales, [[0.06, 0.05], [1.06, 1.05]], rtol=1e-6)


@pytest.mark.parametrize("quant, match", [
    ({"quant_algo": "NVFP4"}, "NVFP4"),
    ({"quant_algo": "W4A16_NVFP4"}, "W4A16_NVFP4"),
    ({"quant_algo": "FP8", "kv_cache_quant_algo": "NVFP4"}, "kv_cache_quant_algo"),
])
def test_unsupported_modelopt_configs_are_refused_in_one_line(bf16_checkpoint, tmp_path,
                                                               quant, match):
    dst = tmp_path / "bad"
    _write(bf16_checkpoint, dst, {"quant_method": "modelopt", **quant}, "tensor")
    with pytest.raises(CheckpointError, match=match):
        load_config(dst)


@pytest.mark.parametrize("strategy, block, kept", [
    ("tensor", None, True), ("channel", None, True), ("block", (48, 48), False),
    ("group", (1, 32), False)])
def test_fp8_checkpoints_with_a_scale_a_row_are_served_as_stored(bf16_checkpoint, tmp_path,
                                                                 strategy, block, kept):
    """An FP8 engine serves a checkpoint stored with a scale per tensor or per row as stored:
    the CPU engine's FP8 weights (fp8.fp8_weights) are the loaded values, which transformers'
    dequantization gives (above), and the GPU's fused projections (weight_layout.stored_fp8,
    what CudaForward uploads) are the stored codes and scales in its layout, whose values are
    the CPU engine's. Quantizing a per-tensor checkpoint's values again per row, as before,
    rounded every row without the tensor's largest value a second time. Block and group
    scales cannot be one scale a row: those projections are quantized again, per row."""
    from blink.gpu_engine.fp8 import e4m3_to_float32, fp8_weights
    from blink.gpu_engine.weight_layout import interleave_gate_up, rope_pair_order, stored_fp8

    dst = tmp_path / "ct"
    _write(bf16_checkpoint, dst, ct_config(strategy, block), strategy, block)
    cfg = load_config(dst)
    loaded = load_weights(dst, cfg)
    served = fp8_weights(loaded)
    stored = safetensors_torch.load_file(str(dst / "model.safetensors"))
    order = rope_pair_order(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    for i, (lw, fw) in enumerate(zip(loaded.layers, served.layers)):
        assert sorted(lw.fp8_codes) == (sorted(PROJECTIONS.values()) if kept else [])
        for tensor, attr in PROJECTIONS.items():
            if kept:
                codes = stored[f"model.layers.{i}.{tensor}.weight"].view(torch.uint8).numpy()
                np.testing.assert_array_equal(lw.fp8_codes[attr][0], codes)
                np.testing.assert_array_equal(getattr(fw, attr), getattr(lw, attr))
            else:  # the row's own scale: not the stored values, unless by chance
                assert not np.array_equal(getattr(fw, attr), getattr(lw, attr)), attr
        fused = stored_fp8(lw, order)
        assert sorted(fused) == (["wdown", "wgu", "wo", "wqkv"] if kept else [])
        want = {"wqkv": np.concatenate([fw.q_proj, fw.k_proj, fw.v_proj])[order],
                "wo": fw.o_proj, "wgu": interleave_gate_up(fw.gate_proj, fw.up_proj),
                "wdown": fw.down_proj}
        for name, (codes, scales) in fused.items():
            assert codes.dtype == np.uint8 and scales.dtype == np.float32
            np.testing.assert_array_equal(e4m3_to_float32(codes) * scales[:, None],
                                          want[name], err_msg=name)


def test_a_fused_projection_served_as_stored_only_when_every_part_is(bf16_checkpoint,
                                                                      tmp_path):
    """With k_proj left bf16 (an ignore entry), q|k|v cannot be one stored matrix: the GPU
    quantizes the fused matrix's bf16 copy again per row, so the CPU engine must round q, k and
    v again too (the two served different weights before the review caught it); o, gate|up
    and down stay as stored."""
    from blink.gpu_engine.demo_model import bf16_rounded
    from blink.gpu_engine.fp8 import fp8_rounded_rows, fp8_weights
    from blink.gpu_engine.weight_layout import rope_pair_order, served_as_stored, stored_fp8

    def keep_k_bf16(base, out):
        if base.endswith("self_attn.k_proj."):
            out[base + "weight"] = (out[base + "weight"].float()
                                    * out.pop(base + "weight_scale").float()).bfloat16()

    dst = tmp_path / "ct"
    _write(bf16_checkpoint, dst, ct_config("tensor"), "tensor", extra=keep_k_bf16)
    cfg = load_config(dst)
    loaded = load_weights(dst, cfg)
    served = fp8_weights(loaded)
    order = rope_pair_order(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    for lw, fw in zip(loaded.layers, served.layers):
        assert "k_proj" not in lw.fp8_codes and "q_proj" in lw.fp8_codes
        assert served_as_stored(lw) == ["wo", "wgu", "wdown"]
        assert sorted(stored_fp8(lw, order)) == ["wdown", "wgu", "wo"]
        for attr in ("q_proj", "k_proj", "v_proj"):
            np.testing.assert_array_equal(
                getattr(fw, attr), fp8_rounded_rows(bf16_rounded(getattr(lw, attr))), attr)
        for attr in ("o_proj", "gate_proj", "up_proj", "down_proj"):
            np.testing.assert_array_equal(getattr(fw, attr), getattr(lw, attr), attr)


def test_blocks_as_wide_as_a_row_are_one_scale_a_row(bf16_checkpoint, tmp_path):
    """Blocks of 32 rows and every column (a scale grid of one column) are one scale a row:
    served as stored, each row the scale of its block."""
    from blink.gpu_engine.fp8 import fp8_weights

    dst = tmp_path / "ct"
    _write(bf16_checkpoint, dst, ct_config("block", (32, 512)), "block", (32, 512))
    loaded = load_weights(dst, load_config(dst))
    stored = safetensors_torch.load_file(str(dst / "model.safetensors"))
    for i, (lw, fw) in enumerate(zip(loaded.layers, fp8_weights(loaded).layers)):
        assert sorted(lw.fp8_codes) == sorted(PROJECTIONS.values())
        for tensor, attr in PROJECTIONS.items():
            grid = stored[f"model.layers.{i}.{tensor}.weight_scale"].float().numpy()
            np.testing.assert_array_equal(lw.fp8_codes[attr][1],
                                          np.repeat(grid[:, 0], 32)[:grid.shape[0] * 32][
                                              :getattr(lw, attr).shape[0]])
            np.testing.assert_array_equal(getattr(fw, attr), getattr(lw, attr), attr)


def test_projections_an_fp8_checkpoint_keeps_in_bf16_are_served_in_bf16(bf16_checkpoint,
                                                                         tmp_path, caplog):
    """Meta's Llama-3.1 FP8 releases (FBGEMM) keep every self_attn projection in bf16: the FP8
    engines serve q|k|v and o in bf16, their stored values exactly (E4M3 rounded them, with a
    warning), and the MLP's as the stored codes and row scales; start-up says so in one line,
    not a warning. (The GPU's side: test_cuda_fp8.py's MIXED_FP8.)"""
    from blink.gpu_engine.fp8 import fp8_rounded_rows, fp8_weights
    from blink.gpu_engine.reference_engine import EngineConfig, ReferenceEngine
    from blink.gpu_engine.weight_layout import served_as_stored, served_bf16

    src = safetensors_torch.load_file(str(bf16_checkpoint / "model.safetensors"))

    def keep_attention(base, out):
        if ".self_attn." in base:  # as stored in bf16, no scales
            out[base + "weight"] = src[base + "weight"]
            del out[base + "weight_scale"]
        else:
            out[base + "input_scale_ub"] = torch.tensor([1200.0])

    dst = tmp_path / "meta-fp8"
    kept = [f"model.layers.{i}.self_attn.{p}" for i in range(NUM_LAYERS)
            for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    _write(bf16_checkpoint, dst, {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                                  "modules_to_not_convert": ["lm_head", *kept]}, "channel",
           extra=keep_attention)
    cfg = load_config(dst)
    loaded = load_weights(dst, cfg)
    served = fp8_weights(loaded, lm_head=False)
    for i, (lw, fw) in enumerate(zip(loaded.layers, served.layers)):
        assert lw.stored_wide == {"q_proj", "k_proj", "v_proj", "o_proj"}
        assert (served_bf16(lw.stored_wide), served_as_stored(lw)) == (["wqkv", "wo"],
                                                                       ["wgu", "wdown"])
        for tensor, attr in PROJECTIONS.items():
            np.testing.assert_array_equal(getattr(fw, attr), getattr(lw, attr), attr)
            if tensor.startswith("self_attn."):
                stored = src[f"model.layers.{i}.{tensor}.weight"].float().numpy()
                np.testing.assert_array_equal(getattr(lw, attr), stored, attr)
                assert not np.array_equal(fp8_rounded_rows(stored), stored)  # E4M3 would move it
    with caplog.at_level(logging.INFO, logger="blink.engine"):
        assert EngineConfig(dst, "ring").lm_head_fp8_for(cfg) is False
    assert [r.levelname for r in caplog.records] == ["INFO"], caplog.text
    assert ("8 of the 14 projection weights of this FP8 checkpoint are stored wider than E4M3 "
            "(the modules its quantizer left out: model.layers.0.self_attn.q_proj.weight, "
            "model.layers.0.self_attn.k_proj.weight, model.layers.0.self_attn.v_proj.weight, "
            "...): served in bf16, as stored") in caplog.text
    engine = ReferenceEngine(EngineConfig(dst, f"blink-test-kept-{id(dst)}", num_kv_blocks=8))
    try:
        for lw, kept in zip(engine.model.w.layers, loaded.layers):
            np.testing.assert_array_equal(lw.q_proj, kept.q_proj)
            np.testing.assert_array_equal(lw.gate_proj, kept.gate_proj)
    finally:
        engine.close()


def test_an_fp8_checkpoint_s_lm_head_is_served_as_stored(bf16_checkpoint, tmp_path, caplog):
    """An FP8 checkpoint's LM head stored bf16 (in modules_to_not_convert, as nearly every
    release has it) is served bf16, as transformers and vLLM serve it; it was rounded to E4M3
    with a scale per row, silently. One stored FP8 is served FP8, and --quantization fp8 on a
    bf16 checkpoint converts it too; --fp8-lm-head / --no-fp8-lm-head decide over both.
    A projection kept wider beside E4M3 parts of the same fused projection (k beside q and v)
    is rounded with them (a fused projection has one format), which the engine says."""
    from blink.gpu_engine.checkpoint import unquantized_linear_weights
    from blink.gpu_engine.fp8 import fp8_rounded_rows
    from blink.gpu_engine.reference_engine import EngineConfig, ReferenceEngine

    def keep_k_bf16(base, out):
        if base.endswith("self_attn.k_proj."):
            out[base + "weight"] = (out[base + "weight"].float()
                                    * out.pop(base + "weight_scale").float()).bfloat16()

    dst = tmp_path / "fbgemm"
    kept = [f"model.layers.{i}.self_attn.k_proj" for i in range(NUM_LAYERS)]
    _write(bf16_checkpoint, dst, {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                                  "modules_to_not_convert": ["lm_head", *kept]}, "channel",
           extra=keep_k_bf16)
    cfg = load_config(dst)
    assert unquantized_linear_weights(dst, cfg) == [k + ".weight" for k in kept] + [
        "lm_head.weight"]
    with caplog.at_level(logging.WARNING, logger="blink.engine"):
        assert EngineConfig(dst, "ring").lm_head_fp8_for(cfg) is False
    assert ("2 of the 14 projection weights of this FP8 checkpoint are stored wider than E4M3 "
            "beside E4M3 parts of the same fused projection (q|k|v or gate|up, which has one "
            "format: model.layers.0.self_attn.k_proj.weight, "
            "model.layers.1.self_attn.k_proj.weight)") in caplog.text
    assert EngineConfig(dst, "ring", fp8_lm_head=True).lm_head_fp8_for(cfg) is True
    assert EngineConfig(dst, "ring", quantization="none").lm_head_fp8_for(cfg) is False
    bf16_cfg = load_config(bf16_checkpoint)
    assert unquantized_linear_weights(bf16_checkpoint, bf16_cfg) == []
    for flag, served in ((None, True), (False, False)):
        assert EngineConfig(bf16_checkpoint, "ring", quantization="fp8",
                            fp8_lm_head=flag).lm_head_fp8_for(bf16_cfg) is served

    head_fp8 = tmp_path / "head-fp8"  # the same with its LM head stored as E4M3 too
    head_fp8.mkdir()
    for f in dst.iterdir():
        (head_fp8 / f.name).write_bytes(f.read_bytes())
    tensors = safetensors_torch.load_file(str(dst / "model.safetensors"))
    head = tensors["lm_head.weight"].float()
    scale = head.abs().amax(1, keepdim=True) / 448
    tensors["lm_head.weight"] = (head / scale).to(torch.float8_e4m3fn)
    tensors["lm_head.weight_scale"] = scale
    safetensors_torch.save_file(tensors, str(head_fp8 / "model.safetensors"))
    assert EngineConfig(head_fp8, "ring").lm_head_fp8_for(load_config(head_fp8)) is True

    # the CPU engine serves the stored head's values, not their E4M3 rounding
    stored_head = load_weights(dst, cfg).lm_head
    assert not np.array_equal(fp8_rounded_rows(stored_head), stored_head)
    engine = ReferenceEngine(EngineConfig(dst, f"blink-test-head-{id(dst)}", num_kv_blocks=8))
    try:
        np.testing.assert_array_equal(engine.model.w.lm_head, stored_head)
    finally:
        engine.close()
