"""FP8 on the host (gpu_engine/fp8.py), FP8 checkpoints, and the CPU engine's emulation of FP8
weights and an FP8 KV cache: the numerics the GPU's FP8 paths reproduce, checked before any GPU
runs them.

Oracles: torch's float8_e4m3fn conversion for the E4M3 codec; torch (and safetensors' own
writer) for FP8 checkpoints; transformers in float32 for the accuracy of the emulated model.
"""
from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest

from blink.gpu_engine import fp8
from blink.gpu_engine.checkpoint import CheckpointError, load_config, load_weights
from blink.gpu_engine.demo_model import write_random_checkpoint
from blink.gpu_engine.forward_batch import ForwardBatch
from blink.gpu_engine.reference_model import ReferenceModel

torch = pytest.importorskip("torch")


def torch_codes(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.asarray(x, np.float32)).to(torch.float8_e4m3fn).view(
        torch.uint8).numpy()


# --- the E4M3 codec -----------------------------------------------------------------------------

def test_every_code_decodes_as_torch_and_encodes_back():
    codes = np.arange(256, dtype=np.uint8)
    values = fp8.e4m3_to_float32(codes)
    ref = torch.from_numpy(codes).view(torch.float8_e4m3fn).float().numpy()
    np.testing.assert_array_equal(np.isnan(values), np.isnan(ref))
    finite = ~np.isnan(values)
    np.testing.assert_array_equal(values[finite], ref[finite])
    assert values[finite].max() == fp8.E4M3_MAX and values[1] == 2.0 ** -9
    np.testing.assert_array_equal(fp8.float32_to_e4m3(values[finite]), codes[finite])


def test_rounding_matches_torch_ties_to_even():
    rng = np.random.default_rng(0)
    # random values over the whole range, and every midpoint between neighbouring codes (the
    # ties), and values a hair off them
    positive = fp8.e4m3_to_float32(np.arange(127, dtype=np.uint8)).astype(np.float64)
    mids = (positive[:-1] + positive[1:]) / 2
    x = np.concatenate([rng.standard_normal(20000) * 30, rng.standard_normal(5000) * 0.01,
                        mids, -mids, np.nextafter(mids.astype(np.float32), np.float32(0)),
                        np.nextafter(mids.astype(np.float32), np.float32(1e9))]).astype(
        np.float32)
    x = x[np.abs(x) < fp8.E4M3_MAX]  # torch turns what lies past 448 into NaN, we saturate
    np.testing.assert_array_equal(fp8.float32_to_e4m3(x), torch_codes(x))


def test_saturation_nan_and_signed_zero():
    codes = fp8.float32_to_e4m3(np.array([448, 464, 1e6, np.inf, -np.inf, np.nan, -0.0, 0.0],
                                         np.float32))
    assert codes.tolist() == [0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0x7F, 0x80, 0x00]


# --- per-row quantization -----------------------------------------------------------------------

def test_quantize_rows_scale_and_error():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((50, 300)) * rng.uniform(1e-3, 1e3, (50, 1))).astype(np.float32)
    x[7] = 0  # a row of zeros: scale 1, codes 0
    codes, scale = fp8.quantize_rows(x)
    amax = np.abs(x).max(1)
    assert scale[7] == 1 and (codes[7] == 0).all()
    live = amax > 0
    np.testing.assert_array_equal(scale[live], (amax[live] / np.float32(448)).astype(np.float32))
    values = fp8.dequantize_rows(codes, scale)
    # each row's largest value maps to 448 (up to the scale's float32 rounding), and every
    # value is off by at most half a step of its binade (2^-4 relative, or 2^-10 of the
    # scale in the subnormal range)
    np.testing.assert_allclose(np.abs(values).max(1)[live], amax[live], rtol=1e-6)
    bound = np.maximum(np.abs(x) * 2.0 ** -4, scale[:, None] * 2.0 ** -10)
    assert (np.abs(values - x) <= bound * (1 + 1e-6)).all()
    # the codes are torch's conversion of x times the row's inverse, in float32
    _, inverse = fp8.row_scales(amax)
    np.testing.assert_array_equal(codes[live], torch_codes(x[live] * inverse[live, None]))


def test_kv_scales_and_rounding():
    amax = np.array([[2.0, 0.0], [224.0, 1e-3]], np.float32)
    scales = fp8.kv_scales_from_amax(amax)
    np.testing.assert_allclose(scales, [[2 * 2 / 448, 1], [1, 2e-3 / 448]], rtol=1e-6)
    rng = np.random.default_rng(2)
    v = rng.standard_normal((5, 2, 64)).astype(np.float32)  # [tokens, kv heads, D]
    head_scale = np.array([0.01, 0.02], np.float32)
    got = fp8.fp8_rounded_kv(v, head_scale)
    inverse = (np.float32(1) / head_scale).astype(np.float32)
    want = fp8.e4m3_to_float32(torch_codes(v * inverse[:, None])) * head_scale[:, None]
    np.testing.assert_array_equal(got, want)


# --- FP8 checkpoints ---------------------------------------------------------------------------

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


FP8_BLOCK = 48


def fp8_checkpoint(src, dst, scheme: str, kv_scales: bool = False, keep=()):
    """dst: src's checkpoint with every projection stored as F8_E4M3 by torch, in `scheme`:
    "row" (weight_scale [N, 1]), "tensor" (weight_scale_inv, one) or "block" (weight_scale_inv
    [ceil(N / 48), ceil(K / 48)], transformers' fine-grained format; 48 leaves the last blocks
    of every projection partial); config.json says quant_method fp8. keep: the modules
    ("model.layers.0.self_attn.q_proj") left as src stores them, as its quantizer's
    modules_to_not_convert. Returns {tensor name: its values, torch's codes times the scales,
    or the kept ones'}."""
    from safetensors.torch import load_file, save_file
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(src / "model.safetensors"))
    out, values = {}, {}
    for name, t in tensors.items():
        base = name[:-len("weight")]
        if not any(base.endswith(p + ".") for p in PROJECTIONS) or base[:-1] in keep:
            out[name] = t
            if base[:-1] in keep:
                values[name] = t.float().numpy()
            continue
        w = t.float()
        n, k = w.shape
        if scheme == "row":
            scale = w.abs().amax(1, keepdim=True) / 448
            out[base + "weight_scale"] = scale
            full = scale
        elif scheme == "tensor":
            scale = w.abs().amax().reshape(1) / 448
            out[base + "weight_scale_inv"] = scale
            full = scale
        else:
            bn = bk = FP8_BLOCK
            padded = torch.zeros(-(-n // bn) * bn, -(-k // bk) * bk)
            padded[:n, :k] = w
            blocks = padded.reshape(-1, bn, padded.shape[1] // bk, bk).abs().amax((1, 3)) / 448
            out[base + "weight_scale_inv"] = blocks
            full = blocks.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]
        codes = (w / full).to(torch.float8_e4m3fn)
        out[name] = codes
        values[name] = (codes.float() * full).numpy()
    if kv_scales:
        for i in range(2):
            out[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.05 + i)
            out[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.02 + i)
    save_file(out, str(dst / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     **({"weight_block_size": [FP8_BLOCK] * 2}
                                        if scheme == "block"
                                        else {}),
                                     **({"modules_to_not_convert": sorted(keep)} if keep
                                        else {})}
    (dst / "config.json").write_text(json.dumps(config))
    return values


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("fp8src") / "m", hidden_size=128,
                                   intermediate_size=256, num_layers=2, num_heads=4,
                                   num_kv_heads=2, seed=3)


@pytest.mark.parametrize("scheme", ["row", "tensor", "block"])
def test_fp8_checkpoint_loads_its_values(bf16_checkpoint, tmp_path, scheme):
    """Every stored scheme reads back as torch's codes times their scales, exactly; the config
    says fp8; k_scale / v_scale come back as the KV cache's scales."""
    values = fp8_checkpoint(bf16_checkpoint, tmp_path / "fp8", scheme, kv_scales=True)
    cfg = load_config(tmp_path / "fp8")
    assert cfg.quantization == "fp8"
    w = load_weights(tmp_path / "fp8", cfg)
    attr = {"self_attn.q_proj": "q_proj", "self_attn.k_proj": "k_proj",
            "self_attn.v_proj": "v_proj", "self_attn.o_proj": "o_proj",
            "mlp.gate_proj": "gate_proj", "mlp.up_proj": "up_proj", "mlp.down_proj": "down_proj"}
    for name, want in values.items():
        layer = int(name.split(".")[2])
        proj = next(a for p, a in attr.items() if f".{p}." in name)
        np.testing.assert_array_equal(getattr(w.layers[layer], proj), want)
    np.testing.assert_allclose(w.kv_scales, [[0.05, 0.02], [1.05, 1.02]], rtol=1e-6)
    # per-row codes are what FP8 weights hold: quantizing their values again changes nothing
    if scheme == "row":
        lw = w.layers[0]
        np.testing.assert_array_equal(fp8.fp8_rounded_rows(lw.q_proj), lw.q_proj)


def test_bad_quantization_configs_are_refused(bf16_checkpoint, tmp_path):
    dst = tmp_path / "bad"
    dst.mkdir()
    for f in bf16_checkpoint.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    config = json.loads((dst / "config.json").read_text())
    for qc, match in (({"quant_method": "awq"}, "awq"),
                      ({"quant_method": "fp8", "fmt": "e5m2"}, "e5m2"),
                      ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size")):
        (dst / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
        with pytest.raises(CheckpointError, match=match):
            load_config(dst)


def test_engine_config_refuses_bad_values():
    from blink.gpu_engine.reference_engine import EngineConfig
    for kwargs, match in (({"quantization": "int4"}, "quantization"),
                          ({"kv_cache_dtype": "fp16"}, "kv_cache_dtype"),
                          ({"num_kv_blocks": 0}, "num_kv_blocks")):
        with pytest.raises(ValueError, match=match):
            EngineConfig("model", "ring", **kwargs)
    assert EngineConfig("model", "ring", quantization="fp8", kv_cache_dtype="fp8",
                        num_kv_blocks=1).kv_cache_dtype == "fp8"


def test_fp8_block_scales_follow_weight_block_size(bf16_checkpoint, tmp_path):
    """The blocks' size comes from weight_block_size, not from the scale grid's shape (48-row
    blocks of a 64-row projection make a grid of two, which alone would read as two blocks of
    32): a config that names another size is refused, as is a grid that fits no size without it."""
    fp8_checkpoint(bf16_checkpoint, tmp_path / "fp8", "block")
    config_path = tmp_path / "fp8" / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"]["weight_block_size"] = [32, 32]
    config_path.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"not a scale .* per blocks of \[32, 32\]"):
        load_weights(tmp_path / "fp8", load_config(tmp_path / "fp8"))
    del config["quantization_config"]["weight_block_size"]
    config_path.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="per blocks that divide it"):
        load_weights(tmp_path / "fp8", load_config(tmp_path / "fp8"))


def test_fp8_tensor_without_a_scale_is_refused(bf16_checkpoint, tmp_path):
    fp8_checkpoint(bf16_checkpoint, tmp_path / "fp8", "row")
    from safetensors.torch import load_file, save_file
    path = tmp_path / "fp8" / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["model.layers.1.mlp.down_proj.weight_scale"]
    save_file(tensors, str(path))
    with pytest.raises(CheckpointError, match="down_proj.weight has no weight_scale"):
        load_weights(tmp_path / "fp8", load_config(tmp_path / "fp8"))


def _edit_tensors(path, edit) -> None:
    """Rewrites path/model.safetensors with edit(tensors) applied (torch tensors by name)."""
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))


DOWN = "model.layers.1.mlp.down_proj."


def _set(name, value):
    return lambda t: t.__setitem__(name, value)


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop(DOWN + "weight_scale"), "down_proj.weight has no weight_scale"),
    (lambda t: t.__setitem__(DOWN + "weight_scale", t[DOWN + "weight_scale"][:5]),
     r"weight_scale has shape \[5, 1\]: not a scale"),
    (lambda t: t.__setitem__(DOWN + "weight_scale", t[DOWN + "weight_scale"].to(torch.int8)),
     "weight_scale has dtype I8"),
    (lambda t: t.__setitem__("model.norm.weight", t["model.norm.weight"].to(
        torch.float8_e4m3fn)), r"model.norm.weight has shape \[128\]: only 2-D"),
    (lambda t: t.pop("model.layers.1.self_attn.k_scale"), "k_scale / v_scale are in some"),
    (_set("model.layers.0.self_attn.v_scale", torch.ones(2)),
     "v_scale must be one scale, got shape"),
], ids=["scale-missing", "scale-shape", "scale-dtype", "fp8-norm", "kv-scale-missing",
        "kv-scale-shape"])
def test_fp8_scale_tensors_are_checked_from_the_headers(bf16_checkpoint, tmp_path, edit,
                                                        message):
    """What the headers show of an FP8 weight's scale (there, its dtype, its shape against the
    weight's) and of the KV scales is refused by check_weights, the check before anything
    starts (under `blink serve`: before the front end), not first by the engine."""
    from blink.gpu_engine.checkpoint import check_weights
    fp8_checkpoint(bf16_checkpoint, tmp_path / "fp8", "row", kv_scales=True)
    _edit_tensors(tmp_path / "fp8", edit)
    cfg = load_config(tmp_path / "fp8")
    for load in (check_weights, load_weights):
        with pytest.raises(CheckpointError, match=message):
            load(tmp_path / "fp8", cfg)


def _nan_code(t):
    codes = t["model.layers.0.self_attn.q_proj.weight"].view(torch.uint8)
    codes[2, 7] = fp8.E4M3_NAN


def _last_scale(value):
    """An edit: the last of layer 1's down_proj scales (its last row's, block's, or the
    tensor's) set to `value`."""
    def edit(t):
        for suffix in ("weight_scale", "weight_scale_inv"):
            if DOWN + suffix in t:
                t[DOWN + suffix].view(-1)[-1] = value
    return edit


@pytest.mark.parametrize("scheme, edit, message", [
    ("row", _last_scale(float("nan")), "down_proj.weight_scale holds NaN or infinite"),
    ("row", _last_scale(float("inf")), "down_proj.weight_scale holds NaN or infinite"),
    ("block", _last_scale(float("nan")),
     "down_proj.weight_scale_inv holds NaN or infinite"),
    ("row", _last_scale(-0.01), "down_proj.weight_scale holds negative values"),
    ("tensor", _last_scale(-0.01), "down_proj.weight_scale_inv holds negative"),
    ("row", _nan_code, "q_proj.weight holds NaN or infinite values"),
], ids=["scale-nan", "scale-inf", "block-scale-nan", "scale-negative", "tensor-scale-negative",
        "nan-code"])
def test_fp8_values_that_would_serve_garbage_are_refused(bf16_checkpoint, tmp_path, scheme,
                                                         edit, message):
    """A NaN or infinite scale or an E4M3 NaN code makes NaN weights (every logit NaN); a
    negative scale is no amax / 448 (a misread or corrupt tensor): load_weights refuses each,
    naming the tensor, where it used to serve them."""
    fp8_checkpoint(bf16_checkpoint, tmp_path / "fp8", scheme)
    _edit_tensors(tmp_path / "fp8", edit)
    with pytest.raises(CheckpointError, match=message):
        load_weights(tmp_path / "fp8", load_config(tmp_path / "fp8"))


def test_a_zero_scale_is_a_block_of_zeros(bf16_checkpoint, tmp_path):
    """A zero scale is served (its block's values are zero): transformers' own fine-grained
    quantizer writes one for a block of zeros (the reciprocal of 448 / 0)."""
    values = fp8_checkpoint(bf16_checkpoint, tmp_path / "fp8", "block")
    _edit_tensors(tmp_path / "fp8", _last_scale(0.0))
    w = load_weights(tmp_path / "fp8", load_config(tmp_path / "fp8"))
    want = values[DOWN + "weight"].copy()
    want[2 * FP8_BLOCK:, 5 * FP8_BLOCK:] = 0  # the last block of its [3, 6] grid
    np.testing.assert_array_equal(w.layers[1].down_proj, want)


def test_a_nan_scale_stops_the_engine_in_one_line(bf16_checkpoint, tmp_path):
    """Through the real start-up: `blink engine --engine cpu` ends with one line naming the
    scale tensor, no traceback."""
    from test_checkpoint import assert_one_line_refusal, start_engine
    fp8_checkpoint(bf16_checkpoint, tmp_path / "fp8", "row")
    _edit_tensors(tmp_path / "fp8", _last_scale(float("nan")))
    assert_one_line_refusal(start_engine(tmp_path / "fp8", f"fp8-test-{os.getpid()}"),
                            "down_proj.weight_scale holds NaN or infinite values")


# --- the CPU engine's emulation: the accuracy FP8 costs ------------------------------------------

def teacher_forced(model: ReferenceModel, seqs: list[np.ndarray]) -> np.ndarray:
    """[positions, vocab]: the logits after every prefix of every sequence but the last token,
    one decode step a position (all sequences in one step), as an engine serves them."""
    n = len(seqs[0])
    block = model.block_size
    per_seq = -(-n // block)
    tables = np.arange(len(seqs) * per_seq, dtype=np.int32).reshape(len(seqs), per_seq)
    out = []
    for pos in range(n - 1):
        batch = ForwardBatch(np.array([s[pos] for s in seqs], np.int32),
                             np.full(len(seqs), pos, np.int32),
                             np.arange(len(seqs) + 1, dtype=np.int32),
                             np.full(len(seqs), pos + 1, np.int32), tables,
                             np.arange(len(seqs), dtype=np.int32))
        out.append(model.forward(batch))
    return np.stack(out, 1).reshape(-1, model.cfg.vocab_size)  # [seq][pos] order


def accuracy(ours: np.ndarray, ref: np.ndarray) -> dict[str, float]:
    """Relative L2 of the logits, top-1 agreement, and the share of disagreements at a
    reference top-2 gap within 5x the position's RMS logit error (near-ties)."""
    rel = float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))
    a, b = ours.argmax(1), ref.argmax(1)
    disagree = np.nonzero(a != b)[0]
    noise = np.sqrt(((ours - ref) ** 2).mean(1))
    gaps = ref.max(1) - ref[np.arange(len(ref)), a]
    near = float((gaps[disagree] <= 5 * noise[disagree]).mean()) if disagree.size else 1.0
    return {"rel_l2": rel, "top1": float((a == b).mean()), "near_tie_share": near}


@pytest.fixture(scope="module")
def accuracy_checkpoint(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("fp8acc") / "m", hidden_size=256,
                                   intermediate_size=512, num_layers=2, num_heads=4,
                                   num_kv_heads=2, seed=11)


@pytest.mark.slow
def test_emulated_fp8_accuracy_against_transformers(accuracy_checkpoint):
    """The FP8 numerics on the CPU: teacher-forced logits over 2,032 positions (16 sequences
    of 128 tokens) of the emulated FP8 model (weights, and weights + E4M3 KV cache) against
    transformers in float32 on the same checkpoint, beside the unquantized model's. Every
    top-1 disagreement is at a near-tie of the reference (top-2 gap within 5x the position's
    logit error: the power to fail). Measured: FP8 weights (the LM head's too) rel L2 0.047,
    top-1 0.921; with a bf16 LM head 0.039, 0.932; with the E4M3 KV cache too 0.049, 0.915;
    unquantized 6e-7, 1.000. (The random-weight model's logits are
    flat: most of its top-2 gaps are within a few times FP8's noise, so top-1 agreement is low
    here and every disagreement a near-tie; docs/performance.md, *FP8*.)"""
    from oracle import hf_next_logits
    cfg = load_config(accuracy_checkpoint)
    weights = load_weights(accuracy_checkpoint, cfg)
    rng = np.random.default_rng(5)
    seqs = [rng.integers(0, cfg.vocab_size, 128).astype(np.int32) for _ in range(16)]
    ref = np.concatenate([hf_next_logits(accuracy_checkpoint, list(s))[:-1] for s in seqs])
    blocks = 16 * 8
    results = {}
    for name, w, kv in (("bf16", weights, False), ("fp8", fp8.fp8_weights(weights), False),
                        ("fp8 (bf16 lm head)", fp8.fp8_weights(weights, lm_head=False), False),
                        ("fp8+kv", fp8.fp8_weights(weights), True)):
        model = ReferenceModel(cfg, w, blocks, 16)
        if kv:
            model.calibrate_kv_scales()
        results[name] = accuracy(teacher_forced(model, seqs), ref)
    print("fp8 emulation accuracy:", results)
    assert results["bf16"]["rel_l2"] < 1e-5 and results["bf16"]["top1"] == 1
    for name in ("fp8", "fp8 (bf16 lm head)", "fp8+kv"):
        r = results[name]
        assert r["rel_l2"] < 0.06 and r["top1"] > 0.9 and r["near_tie_share"] == 1, (name, r)


@pytest.fixture(scope="module")
def periodic_checkpoint(tmp_path_factory):
    from periodic_model import write_periodic_checkpoint
    return write_periodic_checkpoint(tmp_path_factory.mktemp("periodic") / "m")


@pytest.mark.slow
@pytest.mark.timeout(600)  # (its fixture trains the periodic model: 200 s on a busy 2-core VM)
def test_emulated_fp8_greedy_streams_are_exact_on_a_decisive_model(periodic_checkpoint):
    """Where greedy choices are decisive, FP8 changes no token. The checkpoint
    (tests/periodic_model.py) is trained to continue a periodic sequence; transformers (float32)
    continues 8 periodic prompts of 32 tokens with the period for 32 tokens, every choice by a
    top-2 gap of at least 2 logits (the premise, checked: 4.2 and more when measured). The
    emulated engines, unquantized, FP8 weights (the LM head's too, or bf16), and FP8 weights
    with the E4M3 KV cache, the FP8 ones with FP8 activations in every projection (more rounding
    than the GPU, whose decode steps keep bf16 activations), write the same 32 tokens, every
    one."""
    from oracle import hf_next_logits
    from periodic_model import (continue_period, greedy_streams, periodic_prompt,
                                smallest_top2_gap)
    cfg = load_config(periodic_checkpoint)
    weights = load_weights(periodic_checkpoint, cfg)
    rng = np.random.default_rng(3)
    prompts = [periodic_prompt(rng, 32) for _ in range(8)]
    want = [continue_period(p, 32) for p in prompts]
    for p, tokens in zip(prompts, want):
        logits = hf_next_logits(periodic_checkpoint, p + tokens)[len(p) - 1:-1]
        assert logits.argmax(1).tolist() == tokens
        assert smallest_top2_gap(logits) > 2
    block = 16
    gaps = {}
    for name, w, kv in (("bf16", weights, False), ("fp8", fp8.fp8_weights(weights), False),
                        ("fp8 (bf16 lm head)", fp8.fp8_weights(weights, lm_head=False), False),
                        ("fp8+kv", fp8.fp8_weights(weights), True)):
        model = ReferenceModel(cfg, w, 8 * 4, block, fp8_activations=name != "bf16")
        if kv:
            model.calibrate_kv_scales()
        streams, logits = greedy_streams(model.forward, prompts, 32, block)
        gaps[name] = smallest_top2_gap(logits)
        assert streams == want, name
    print("fp8 emulation on the periodic model: smallest top-2 gap", gaps)


# --- which FP8 options a GPU can run: decided at start-up, before any weight is read ----------

def test_fp8_options_are_checked_against_the_gpu(bf16_checkpoint, tmp_path):
    """`blink engine`'s start-up check (client/cli.py _fp8_for_this_gpu) on GPUs of three
    compute capabilities: flags a GPU cannot run stop in one line; an FP8 checkpoint on a GPU
    without FP8 GEMMs is served in bf16 ("none"), and the CPU engine's model then holds the
    checkpoint's values unrounded."""
    from blink.client.cli import _fp8_for_this_gpu
    from blink.gpu_engine.reference_engine import EngineConfig
    values = fp8_checkpoint(bf16_checkpoint, tmp_path / "fp8", "tensor")
    bf16_cfg = EngineConfig(bf16_checkpoint, "ring")
    fp8_cfg = EngineConfig(tmp_path / "fp8", "ring")
    hopper, ada, ampere = (9, 0), (8, 9), (8, 0)
    for config, cc in ((bf16_cfg, ampere), (fp8_cfg, hopper)):
        assert _fp8_for_this_gpu(config, cc) is config
    with pytest.raises(SystemExit, match="--quantization fp8 needs a Hopper GPU .* 8.9"):
        _fp8_for_this_gpu(EngineConfig(bf16_checkpoint, "ring", quantization="fp8"), ada)
    with pytest.raises(SystemExit, match="--kv-cache-dtype fp8 needs .* 8.0"):
        _fp8_for_this_gpu(EngineConfig(bf16_checkpoint, "ring", kv_cache_dtype="fp8"), ampere)
    kv_on_ada = EngineConfig(bf16_checkpoint, "ring", kv_cache_dtype="fp8")
    assert _fp8_for_this_gpu(kv_on_ada, ada) is kv_on_ada
    served = _fp8_for_this_gpu(fp8_cfg, ampere)
    assert served.quantization == "none" and served.quantization_for(load_config(
        tmp_path / "fp8")) is None

    from blink.gpu_engine.reference_engine import ReferenceEngine
    engine = ReferenceEngine(EngineConfig(tmp_path / "fp8", f"blink-test-fp8none-{id(served)}",
                                          quantization="none", num_kv_blocks=8))
    try:
        name = "model.layers.0.self_attn.q_proj.weight"
        np.testing.assert_array_equal(engine.model.w.layers[0].q_proj, values[name])
        assert not np.array_equal(fp8.fp8_rounded_rows(values[name]), values[name])
    finally:
        engine.close()


# --- from a mutation review: contracts no test held (each test fails on its mutant) -----------

@pytest.mark.parametrize("value", [0.0, -0.5])
def test_a_kv_scale_that_is_not_positive_is_refused(bf16_checkpoint, tmp_path, value):
    """The cache stores v * (1 / scale): a zero k_scale is an infinite inverse, every key NaN."""
    fp8_checkpoint(bf16_checkpoint, tmp_path / "fp8", "row", kv_scales=True)
    name = "model.layers.1.self_attn.k_scale"
    _edit_tensors(tmp_path / "fp8", lambda t: t.__setitem__(name, torch.tensor(value)))
    with pytest.raises(CheckpointError, match=f"{name} must be a positive scale"):
        load_weights(tmp_path / "fp8", load_config(tmp_path / "fp8"))


def test_calibration_never_asks_more_tokens_than_the_kv_cache_holds():
    """calibration_count: fewer than 512 where one step, the context or the KV cache holds
    fewer (the calibration prefill must fit the cache it calibrates)."""
    assert fp8.calibration_count(2048, 4096, 100) == 100
    assert fp8.calibration_count(64, 4096, 8192) == 64
    assert fp8.calibration_count(2048, 300, 8192) == 300


def test_fp8_weights_round_the_lm_head_unless_told_not_to(bf16_checkpoint):
    w = load_weights(bf16_checkpoint, load_config(bf16_checkpoint))
    np.testing.assert_array_equal(fp8.fp8_weights(w).lm_head, fp8.fp8_rounded_rows(w.lm_head))
    assert fp8.fp8_weights(w, lm_head=False).lm_head is w.lm_head


def test_fp8_weights_quantize_the_bf16_copies_the_gpu_quantizes(tmp_path):
    """The GPU quantizes its bf16 copies of the weights (CudaForward._upload_weights), so the
    CPU emulation rounds a float32 checkpoint's values to bf16 first (it quantized the float32
    values, a code off where the bf16 rounding crosses an E4M3 step). Oracle: torch's bf16 and
    E4M3 conversions with the GPU's per-row scale (amax / 448, x * (448 / amax))."""
    path = write_random_checkpoint(tmp_path / "f32", hidden_size=64, intermediate_size=128,
                                   num_layers=1, num_heads=4, num_kv_heads=2, dtype="float32",
                                   seed=11)
    w = load_weights(path, load_config(path))

    def gpu_rows(x):
        t = torch.from_numpy(np.asarray(x, np.float32)).to(torch.bfloat16).float()
        amax = t.abs().amax(1, keepdim=True)
        inverse = torch.tensor(448.0) / amax  # one float32 division, as the kernel's
        return ((t * inverse).to(torch.float8_e4m3fn).float() * (amax / 448)).numpy()

    served = fp8.fp8_weights(w)
    for part in ("q_proj", "gate_proj", "down_proj"):
        values = getattr(w.layers[0], part)
        np.testing.assert_array_equal(getattr(served.layers[0], part), gpu_rows(values))
    np.testing.assert_array_equal(served.lm_head, gpu_rows(w.lm_head))
    # the float32 values quantized directly give other codes (the test has something to see)
    assert (fp8.fp8_rounded_rows(w.layers[0].gate_proj) != served.layers[0].gate_proj).any()


def test_the_cpu_engine_s_fp8_cache_takes_each_layer_s_k_and_v_scales(bf16_checkpoint,
                                                                        tmp_path):
    """The checkpoint's k_scale and v_scale (fp8_checkpoint writes 0.05 + i and 0.02 + i)
    scale layer i's keys and values, one per KV head (values took the keys' scale in a
    mutant no test saw)."""
    from blink.gpu_engine.reference_engine import EngineConfig, ReferenceEngine
    fp8_checkpoint(bf16_checkpoint, tmp_path / "fp8", "row", kv_scales=True)
    engine = ReferenceEngine(EngineConfig(tmp_path / "fp8", f"blink-test-kv-{id(tmp_path)}",
                                          kv_cache_dtype="fp8", num_kv_blocks=8))
    try:
        want = np.array([[[0.05] * 2, [0.02] * 2], [[1.05] * 2, [1.02] * 2]], np.float32)
        np.testing.assert_array_equal(engine.model.kv_scales, want)  # [layer, k|v, kv head]
    finally:
        engine.close()


def test_fp8_rounded_kv_uses_the_float32_inverse_as_torch_and_the_kernels():
    """A value where v * fl32(1 / s) and v * (1 / s) round to different E4M3 codes (about 1 in
    2 million): the cache's rounding is torch's float32 arithmetic, as the kernels'."""
    v = np.full((1, 1, 1), -1.1315999031066895, np.float32)
    s = np.array([0.0123], np.float32)
    want = ((torch.from_numpy(v) * (1 / torch.from_numpy(s))[:, None])
            .to(torch.float8_e4m3fn).float() * torch.from_numpy(s)[:, None]).numpy()
    np.testing.assert_array_equal(fp8.fp8_rounded_kv(v, s), want)


def torch_rows(x: np.ndarray) -> np.ndarray:
    """x [N, K] through an FP8 GEMM's input: E4M3 by torch with a scale per row, amax / 448,
    and x * (448 / amax) the value converted (a row of zeros stays zeros)."""
    t = torch.from_numpy(np.asarray(x, np.float32))
    amax = t.abs().amax(-1, keepdim=True)
    live = amax > 0
    scale = torch.where(live, amax / 448, torch.ones_like(amax))
    inverse = torch.where(live, torch.tensor(448.0) / amax, torch.ones_like(amax))
    return ((t * inverse).to(torch.float8_e4m3fn).float() * scale).numpy()


# what the mixed-format tests keep wider than E4M3, layer by layer: layer 0's self_attn
# projections (as Meta's Llama-3.1 FP8 releases keep them) and down; layer 1's gate and up;
# layer 2's down (where there is one). On the GPU every hand-over of x's f16 form between FP8
# skinny kernels happens in some layer, and every FP8 kernel beside a bf16 one takes or writes
# none: layer 1's FP8 down writes one without taking one, layer 2's FP8 gate|up takes one and
# writes none.
KEPT_WIDE = ({"q_proj", "k_proj", "v_proj", "o_proj", "down_proj"}, {"gate_proj", "up_proj"},
             {"down_proj"})


@pytest.mark.parametrize("kept", [False, True], ids=["all-fp8", "some-kept-bf16"])
def test_fp8_activations_round_each_projection_s_input_and_the_head_s(bf16_checkpoint, kept):
    """fp8_activations rounds the input rows of all seven projections of every layer, and
    fp8_head_input the LM head's, as torch's float8_e4m3fn with a scale per row; kept: not
    those of the fused projections an FP8 checkpoint keeps wider than E4M3 (KEPT_WIDE: q|k|v, o
    and down of layer 0, gate|up of layer 1), which run bf16 GEMMs. Six one-token sequences at
    position 0 make attention each token's own value (one key, weight exactly 1), so the layers
    written out below, with torch rounding where each FP8 GEMM takes its input, are the same
    arithmetic exactly: any rounding left out or added moves logits by about 1%. (Against
    transformers with rounding hooks, float32 order differences flip E4M3 codes, and the flips
    alone move the logits that far.)"""
    from blink.gpu_engine.reference_model import rms_norm, silu
    cfg = load_config(bf16_checkpoint)
    w = load_weights(bf16_checkpoint, cfg)
    if kept:
        w.layers = [dataclasses.replace(lw, stored_wide=frozenset(wide))
                    for lw, wide in zip(w.layers, KEPT_WIDE)]
    ids = np.random.default_rng(2).integers(0, cfg.vocab_size, 6).astype(np.int32)
    x = w.embed[ids]
    group = cfg.num_heads // cfg.num_kv_heads
    for lw in w.layers:
        def into(part, a, lw=lw):
            return a if part in lw.stored_wide else torch_rows(a)
        h = into("q_proj", rms_norm(x, lw.input_norm, cfg.rms_norm_eps))
        v = (h @ lw.v_proj.T).reshape(len(ids), cfg.num_kv_heads, 1, cfg.head_dim)
        attn = np.repeat(v, group, axis=2).reshape(len(ids), cfg.q_size)  # head i: kv head i // g
        x = x + into("o_proj", attn) @ lw.o_proj.T
        h = into("gate_proj", rms_norm(x, lw.post_attention_norm, cfg.rms_norm_eps))
        x = x + into("down_proj", silu(h @ lw.gate_proj.T) * (h @ lw.up_proj.T)) @ lw.down_proj.T
    want = torch_rows(rms_norm(x, w.final_norm, cfg.rms_norm_eps)) @ w.lm_head.T
    model = ReferenceModel(cfg, w, len(ids), 16, fp8_activations=True)
    model.fp8_head_input = True
    batch = ForwardBatch.of_chunks([(ids[i:i + 1], 0, [i]) for i in range(len(ids))])
    np.testing.assert_allclose(model.forward(batch), want, rtol=0,
                               atol=1e-5 * np.abs(want).max())


def test_kv_scales_calibrate_to_transformers_keys_and_values(bf16_checkpoint):
    """calibrate_kv_scales: the scale of each (layer, keys | values, KV head) puts the largest
    |key| (after RoPE) or |value| that transformers' cache holds for the calibration prompt at
    448 / 2, whatever scales the model had before (its cache is unrounded while calibrating).
    A cache with those scales then stores layer 0's keys and values (their inputs do not read
    the cache) as torch's float8_e4m3fn rounds them at their own scales, x * (1 / scale)."""
    from transformers import AutoModelForCausalLM
    cfg = load_config(bf16_checkpoint)
    w = load_weights(bf16_checkpoint, cfg)
    tokens = fp8.calibration_tokens(cfg.vocab_size, 48)
    hf = AutoModelForCausalLM.from_pretrained(bf16_checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        cache = hf(torch.tensor(tokens[None].astype(np.int64)), use_cache=True).past_key_values
    kv = [(layer.keys[0].numpy(), layer.values[0].numpy()) for layer in cache.layers]
    amax = np.array([[np.abs(k).max((1, 2)), np.abs(v).max((1, 2))] for k, v in kv])
    model = ReferenceModel(cfg, w, 12, 4, kv_scales=np.full((2, 2, 2), 0.05, np.float32))
    scales = model.calibrate_kv_scales(tokens)
    np.testing.assert_allclose(scales, amax * 2 / 448, rtol=1e-5)
    assert (scales[0, 0] != scales[0, 1]).all()

    model.forward(ForwardBatch.of_chunks([(tokens, 0, np.arange(12))]))
    for cached, theirs, scale in ((model.k_cache, kv[0][0], scales[0, 0]),
                                  (model.v_cache, kv[0][1], scales[0, 1])):
        s = torch.from_numpy(scale)[:, None, None]
        want = (torch.from_numpy(theirs) * (1 / s)).to(torch.float8_e4m3fn).float() * s
        ours = cached[0].reshape(48, cfg.num_kv_heads, cfg.head_dim).transpose(1, 0, 2)
        assert (ours == want.numpy()).mean() > 0.999
