"""How FP8 checkpoints are read and served on the CPU (gpu_engine/checkpoint.py's
quantization_config readers and scale grids, gpu_engine/fp8.py, EngineConfig.lm_head_fp8_for):
the contracts a mutation review found no earlier test held.

Oracles, independent of Blink's code: every expected weight is dequantized here by hand from
the format's published definition, element by element through index arithmetic (transformers'
FP8: weight[i, j] = fp8[i, j] * weight_scale_inv[i // bn, j // bk] with (bn, bk) the config's
weight_block_size, the last blocks partial; compressed-tensors, FBGEMM, ModelOpt: fp8 times
weight_scale broadcast per tensor, row, block or group); compressed-tensors' own QuantizationArgs
for the defaults and strategy inference of its configs; torch's float8_e4m3fn conversion and
float32 arithmetic for the GPU's row quantization (csrc/fp8.cuh E4m3ScaleOf: amax / 448 and
448 / amax, each one float32 division).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from blink.gpu_engine.checkpoint import (CheckpointError, check_weights, load_config,
                                         load_weights, unquantized_linear_weights)
from blink.gpu_engine.demo_model import write_random_checkpoint

from test_fp8_formats import NUM_LAYERS, PROJECTIONS

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")



@pytest.fixture(scope="module")
def src(tmp_path_factory):
    """hidden 128, q 128 rows, k and v 64, intermediate 256."""
    return write_random_checkpoint(tmp_path_factory.mktemp("fp8src") / "m", hidden_size=128,
                                   intermediate_size=256, num_layers=NUM_LAYERS, num_heads=4,
                                   num_kv_heads=2, seed=8)


@pytest.fixture(scope="module")
def src96(tmp_path_factory):
    """Shapes whose block grids divide them into other blocks than the config's: q [64, 96],
    k and v [32, 96], o [96, 64], gate and up [160, 96], down [96, 160]."""
    return write_random_checkpoint(tmp_path_factory.mktemp("fp8src96") / "m", hidden_size=96,
                                   intermediate_size=160, num_layers=NUM_LAYERS, num_heads=4,
                                   num_kv_heads=2, head_dim=16, seed=9)


@pytest.fixture(scope="module")
def src_tied(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("fp8srctied") / "m", hidden_size=128,
                                   intermediate_size=256, num_layers=NUM_LAYERS, num_heads=4,
                                   num_kv_heads=2, tie_word_embeddings=True, seed=10)


def by_hand(codes: torch.Tensor, scale: torch.Tensor, bn: int, bk: int) -> np.ndarray:
    """The format's definition, element by element: value[i, j] = fp8[i, j] * scale[i // bn,
    j // bk] (a scale of one element: the tensor's; [N] or [N, 1]: bn = 1, bk >= K)."""
    n, k = codes.shape
    grid = scale.float().numpy().reshape(-1, 1) if scale.dim() == 1 else scale.float().numpy()
    if grid.size == 1:
        grid = grid.reshape(1, 1)
    rows, cols = np.arange(n)[:, None] // bn, np.arange(k)[None, :] // bk
    return codes.float().numpy() * grid[rows, cols]


def block_scales(w: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """max |w| / 448 over each (bn, bk) block, the last ones partial: [ceil(N/bn), ceil(K/bk)]."""
    n, k = w.shape
    out = torch.empty(-(-n // bn), -(-k // bk))
    for r in range(out.shape[0]):
        for c in range(out.shape[1]):
            out[r, c] = w[r * bn:(r + 1) * bn, c * bk:(c + 1) * bk].abs().max() / 448
    return out


def codes_for(w: torch.Tensor, scale: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    n, k = w.shape
    full = torch.from_numpy(by_hand(torch.ones(n, k), scale, bn, bk))
    return (w / full).to(torch.float8_e4m3fn)


def write_fp8(src: Path, dst: Path, quantization_config: dict | None, quantize,
              extra=lambda out: None) -> dict[str, np.ndarray]:
    """dst: src with each projection's weight replaced as quantize(name, w float32) says: a
    dict of tensors to store under the projection's base name (its "weight" and scales), and
    the value the format defines for it; None keeps the tensor. Returns {weight name: value}."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    out, values = {}, {}
    for name, t in safetensors_torch.load_file(str(src / "model.safetensors")).items():
        base = name[:-len("weight")]
        if not any(base.endswith(p + ".") for p in PROJECTIONS):
            out[name] = t
            continue
        result = quantize(name, t.float())
        if result is None:
            out[name] = t
            continue
        tensors, value = result
        out.update({base + suffix: v for suffix, v in tensors.items()})
        values[name] = value
    extra(out)
    safetensors_torch.save_file(out, str(dst / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config))
    return values


def loaded_by_name(weights) -> dict[str, np.ndarray]:
    return {f"model.layers.{i}.{p}.weight": getattr(weights.layers[i], a)
            for i in range(NUM_LAYERS) for p, a in PROJECTIONS.items()}


def fp8_block_config(block) -> dict:
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
            "weight_block_size": list(block)}


def block_quantizer(bn: int, bk: int, suffix: str = "weight_scale_inv"):
    def quantize(name, w):
        scale = block_scales(w, bn, bk)
        codes = codes_for(w, scale, bn, bk)
        return {"weight": codes, suffix: scale}, by_hand(codes, scale, bn, bk)
    return quantize


def row_quantizer(shape_of_scale, suffix="weight_scale"):
    """A max-abs scale per output row, stored in the shape shape_of_scale(n) gives."""
    def quantize(name, w):
        scale = w.abs().amax(1) / 448
        codes = (w / scale[:, None]).to(torch.float8_e4m3fn)
        return ({"weight": codes, suffix: scale.reshape(shape_of_scale(w.shape[0]))},
                by_hand(codes, scale, 1, w.shape[1]))
    return quantize


def tensor_quantizer(suffix="weight_scale"):
    def quantize(name, w):
        scale = (w.abs().amax() / 448).reshape(1)
        codes = (w / scale).to(torch.float8_e4m3fn)
        return {"weight": codes, suffix: scale}, by_hand(codes, scale, *w.shape)
    return quantize


def ct_config(weights: dict, groups: dict | None = None, kv_cache_scheme=None) -> dict:
    """compressed-tensors' quantization_config with one group of `weights` (and more groups)."""
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": None,
                                          "output_activations": None}, **(groups or {})},
            "ignore": ["lm_head"], "kv_cache_scheme": kv_cache_scheme}


FP8_WEIGHTS = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
               "strategy": "channel"}


# --- the scale grids -------------------------------------------------------------------------

@pytest.mark.parametrize("block", [(48, 48), (32, 64)])
def test_weight_block_size_decides_blocks_the_grid_would_divide_otherwise(src96, tmp_path,
                                                                          block):
    """transformers' fine-grained FP8: the blocks are weight_block_size's, not the ones the
    grid's shape divides the weight into. With (48, 48) blocks q_proj [64, 96] has a [2, 2]
    grid, which divides it into (32, 48) blocks: read that way, rows 32..47 took the second
    row of scales. (32, 64) also has rows and columns of different sizes."""
    dst = tmp_path / "fp8"
    values = write_fp8(src96, dst, fp8_block_config(block), block_quantizer(*block))
    cfg = load_config(dst)
    assert cfg.fp8_weight_block == block
    check_weights(dst, cfg)
    ours = loaded_by_name(load_weights(dst, cfg))
    for name, want in values.items():
        np.testing.assert_array_equal(ours[name], want, err_msg=name)


def test_row_wide_blocks_with_a_partial_last_block_keep_one_scale_a_row(src, tmp_path):
    """Blocks of 48 rows as wide as the weight (a grid of one column) are one scale a row,
    served as stored (LayerWeights.fp8_codes): each row's scale is its block's, N of them
    however the last block is cut (q_proj's 128 rows: blocks of 48, 48 and 32)."""
    from blink.gpu_engine.fp8 import e4m3_to_float32, fp8_weights

    dst = tmp_path / "fp8"
    block = (48, 4096)
    values = write_fp8(src, dst, fp8_block_config(block), block_quantizer(*block))
    stored = safetensors_torch.load_file(str(dst / "model.safetensors"))
    loaded = load_weights(dst, load_config(dst))
    served = fp8_weights(loaded)
    for i, (lw, fw) in enumerate(zip(loaded.layers, served.layers)):
        for tensor, attr in PROJECTIONS.items():
            name = f"model.layers.{i}.{tensor}.weight"
            grid = stored[name + "_scale_inv"].numpy()
            n = getattr(lw, attr).shape[0]
            codes, scales = lw.fp8_codes[attr]
            want_scales = grid[np.arange(n) // 48, 0]
            assert scales.shape == (n,), (name, scales.shape)
            np.testing.assert_array_equal(scales, want_scales, err_msg=name)
            np.testing.assert_array_equal(codes, stored[name].view(torch.uint8).numpy())
            np.testing.assert_array_equal(e4m3_to_float32(codes) * scales[:, None],
                                          values[name], err_msg=name)
            np.testing.assert_array_equal(getattr(fw, attr), values[name], err_msg=name)


def test_a_row_scale_beside_weight_block_size_is_refused(src, tmp_path):
    """With weight_block_size [48, 48] every scale must be its weight's [ceil(N/48),
    ceil(K/48)] grid (transformers' FP8Linear holds that shape): a down_proj stored with a
    scale a row is refused from the headers, not read as rows."""
    dst = tmp_path / "fp8"
    blocks, rows = block_quantizer(48, 48), row_quantizer(lambda n: (n, 1), "weight_scale_inv")
    write_fp8(src, dst, fp8_block_config((48, 48)),
              lambda name, w: (rows if "down_proj" in name else blocks)(name, w))
    cfg = load_config(dst)
    for load in (check_weights, load_weights):
        with pytest.raises(CheckpointError, match=r"down_proj.weight_scale_inv has shape "
                                                  r"\[128, 1\]: not a scale"):
            load(dst, cfg)


@pytest.mark.parametrize("algo", ["FP8_PER_CHANNEL_PER_TOKEN", "FP8"])
@pytest.mark.parametrize("scale_shape", ["[N]", "[N, 1]"])
def test_row_scales_of_either_shape(src, tmp_path, algo, scale_shape):
    """A scale per output row stored as [N] or as [N, 1] (ModelOpt's FP8_PER_CHANNEL_PER_TOKEN,
    and its FP8 where a checkpoint has it so) reads as codes times the row's scale and is
    served as stored; a ModelOpt config without an FP8 KV cache (kv_cache_quant_algo null)
    is read, with no KV scales."""
    shape = (lambda n: (n,)) if scale_shape == "[N]" else (lambda n: (n, 1))
    dst = tmp_path / "modelopt"
    values = write_fp8(src, dst, {"quant_method": "modelopt", "quant_algo": algo,
                                  "kv_cache_quant_algo": None,
                                  "exclude_modules": ["lm_head"]}, row_quantizer(shape))
    cfg = load_config(dst)
    assert (cfg.quantization, cfg.fp8_weight_block) == ("fp8", None)
    check_weights(dst, cfg)
    weights = load_weights(dst, cfg)
    assert weights.kv_scales is None
    ours = loaded_by_name(weights)
    for name, want in values.items():
        np.testing.assert_array_equal(ours[name], want, err_msg=name)
    assert sorted(weights.layers[0].fp8_codes) == sorted(PROJECTIONS.values())


# --- quantization_config readers ---------------------------------------------------------------

@pytest.mark.parametrize("block", [[0, 128], [128, 128, 128], [128, -1]])
def test_weight_block_sizes_that_name_no_block_are_refused_in_one_line(src, tmp_path, block):
    dst = tmp_path / "bad"
    write_fp8(src, dst, {"quant_method": "fp8", "weight_block_size": block},
              lambda name, w: None)
    with pytest.raises(CheckpointError, match="weight_block_size must be two positive ints"):
        load_config(dst)


def test_an_empty_quantization_config_is_refused(src, tmp_path):
    """{} names no quant_method (transformers refuses it too); it is not an unquantized
    checkpoint."""
    dst = tmp_path / "empty"
    write_fp8(src, dst, {}, lambda name, w: None)
    with pytest.raises(CheckpointError, match="quant_method None is not supported"):
        load_config(dst)


def test_compressed_tensors_defaults_are_its_own(src, tmp_path):
    """A weights scheme without "symmetric" or "dynamic" takes compressed-tensors' defaults
    (symmetric, static: what its QuantizationArgs says), so it is read, not refused."""
    from compressed_tensors.quantization import QuantizationArgs

    weights = {"num_bits": 8, "type": "float", "strategy": "channel"}
    args = QuantizationArgs(**weights)
    assert args.symmetric is True and args.dynamic is False  # the oracle
    dst = tmp_path / "ct"
    values = write_fp8(src, dst, ct_config(weights), row_quantizer(lambda n: (n, 1)))
    cfg = load_config(dst)
    assert (cfg.quantization, cfg.fp8_weight_block) == ("fp8", None)
    ours = loaded_by_name(load_weights(dst, cfg))
    for name, want in values.items():
        np.testing.assert_array_equal(ours[name], want, err_msg=name)


@pytest.mark.parametrize("strategy, block", [("CHANNEL", None), ("Block", (48, 48)),
                                             ("GROUP", (1, 32))])
def test_compressed_tensors_strategies_in_upper_case_are_read(src, tmp_path, strategy, block):
    """compressed-tensors lower-cases a strategy (QuantizationArgs' validator): "CHANNEL" is
    the channel strategy, read as such."""
    from compressed_tensors.quantization import QuantizationArgs

    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
               "strategy": strategy,
               "group_size": block[1] if strategy == "GROUP" else None,
               "block_structure": list(block) if strategy == "Block" else None}
    assert QuantizationArgs(**weights).strategy == strategy.lower()  # the oracle
    dst = tmp_path / "ct"
    quantize = (row_quantizer(lambda n: (n, 1)) if block is None
                else block_quantizer(*block, suffix="weight_scale"))
    values = write_fp8(src, dst, ct_config(weights), quantize)
    cfg = load_config(dst)
    assert (cfg.quantization, cfg.fp8_weight_block) == ("fp8", block)
    ours = loaded_by_name(load_weights(dst, cfg))
    for name, want in values.items():
        np.testing.assert_array_equal(ours[name], want, err_msg=name)


BLOCK_GROUP = {"group_1": {"targets": ["re:.*down_proj"],
                           "weights": {**FP8_WEIGHTS, "strategy": "block",
                                       "block_structure": [64, 64]}}}


def test_compressed_tensors_inferred_strategies_mix_with_blocks_as_given_ones(src, tmp_path):
    """A scheme without a strategy is what compressed-tensors infers (QuantizationArgs): with
    group_size -1 per channel, so beside a block group it is refused as rows and blocks are;
    with neither, per tensor, which reads beside blocks (a scale of one element is every
    block's)."""
    from compressed_tensors.quantization import QuantizationArgs

    channel = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": -1}
    tensor = {"num_bits": 8, "type": "float", "symmetric": True}
    assert QuantizationArgs(**channel).strategy == "channel"  # the oracle
    assert QuantizationArgs(**tensor).strategy == "tensor"
    rows = tmp_path / "rows"
    write_fp8(src, rows, ct_config(channel, BLOCK_GROUP), lambda name, w: None)
    with pytest.raises(CheckpointError, match="different blocks"):
        load_config(rows)

    mixed = tmp_path / "mixed"
    per_tensor, blocks = tensor_quantizer(), block_quantizer(64, 64, suffix="weight_scale")
    values = write_fp8(src, mixed, ct_config(tensor, BLOCK_GROUP),
                       lambda name, w: (blocks if "down_proj" in name else per_tensor)(name, w))
    cfg = load_config(mixed)
    assert (cfg.quantization, cfg.fp8_weight_block) == ("fp8", (64, 64))
    ours = loaded_by_name(load_weights(mixed, cfg))
    for name, want in values.items():
        np.testing.assert_array_equal(ours[name], want, err_msg=name)


def test_a_dynamic_kv_cache_scheme_is_refused(src, tmp_path):
    """Dynamic KV scales are computed at run time, not stored: no k_scale / v_scale to read."""
    dst = tmp_path / "ct"
    kv = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True,
          "strategy": "tensor"}
    write_fp8(src, dst, ct_config(FP8_WEIGHTS, kv_cache_scheme=kv), lambda name, w: None)
    with pytest.raises(CheckpointError, match="kv_cache_scheme"):
        load_config(dst)


def test_a_zero_point_with_one_nonzero_value_is_refused(src, tmp_path):
    """One nonzero zero point makes the weights asymmetric: refused, not only an all-nonzero
    one."""
    def zero_points(out):
        for name in [n for n in out if n.endswith(".weight_scale")]:
            zp = torch.zeros(out[name].shape[0], 1)
            if name.startswith("model.layers.1.mlp.up_proj"):
                zp[3, 0] = 2
            out[name.replace("weight_scale", "weight_zero_point")] = zp

    dst = tmp_path / "ct"
    write_fp8(src, dst, ct_config(FP8_WEIGHTS), row_quantizer(lambda n: (n, 1)),
              extra=zero_points)
    with pytest.raises(CheckpointError, match="up_proj.weight_zero_point is not zero"):
        load_weights(dst, load_config(dst))


def test_static_activation_scales_are_said_once_at_info(src, tmp_path, caplog):
    """activation_scheme "static" (input_scale tensors) is reported: activations are scaled
    per token row instead; "dynamic" says nothing."""
    for scheme in ("dynamic", "static"):
        dst = tmp_path / scheme
        write_fp8(src, dst, {"quant_method": "fp8", "activation_scheme": scheme},
                  lambda name, w: None)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="blink.gpu_engine.checkpoint"):
            load_config(dst)
        said = [r.getMessage() for r in caplog.records if "input_scale" in r.getMessage()]
        assert len(said) == (scheme == "static"), (scheme, said)


# --- which LM head is served FP8 -----------------------------------------------------------

def test_a_tied_fp8_checkpoint_s_lm_head_is_its_bf16_embedding(src_tied, tmp_path):
    """A tied FP8 checkpoint (no lm_head.weight; the bf16 embedding is the head) serves its
    head bf16, as stored: "lm_head.weight" is among the weights stored wider than E4M3."""
    from blink.gpu_engine.reference_engine import EngineConfig

    dst = tmp_path / "tied"
    write_fp8(src_tied, dst, {"quant_method": "fp8", "activation_scheme": "dynamic"},
              tensor_quantizer("weight_scale_inv"))
    cfg = load_config(dst)
    assert cfg.tie_word_embeddings
    assert unquantized_linear_weights(dst, cfg) == ["lm_head.weight"]
    assert EngineConfig(dst, "ring").lm_head_fp8_for(cfg) is False


def _with_fp8_head(src, dst):
    def head(out):
        w = out["lm_head.weight"].float()
        scale = w.abs().amax(1, keepdim=True) / 448
        out["lm_head.weight"] = (w / scale).to(torch.float8_e4m3fn)
        out["lm_head.weight_scale"] = scale
    write_fp8(src, dst, {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0},
              row_quantizer(lambda n: (n, 1)), extra=head)


def test_no_fp8_lm_head_wins_over_a_head_stored_fp8(src, tmp_path):
    """--no-fp8-lm-head serves the LM head bf16 even where the checkpoint stores it E4M3."""
    from blink.gpu_engine.reference_engine import EngineConfig

    dst = tmp_path / "head"
    _with_fp8_head(src, dst)
    cfg = load_config(dst)
    assert unquantized_linear_weights(dst, cfg) == []
    assert EngineConfig(dst, "ring").lm_head_fp8_for(cfg) is True
    assert EngineConfig(dst, "ring", fp8_lm_head=False).lm_head_fp8_for(cfg) is False


def test_dummy_weights_of_an_fp8_checkpoint_convert_the_lm_head(src, tmp_path):
    """--load-format dummy generates every weight (none is read), so the head is converted to
    E4M3 like the projections, whatever the checkpoint's own head is; --no-fp8-lm-head still
    keeps it bf16."""
    from blink.gpu_engine.reference_engine import EngineConfig

    dst = tmp_path / "fbgemm"
    write_fp8(src, dst, {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                         "modules_to_not_convert": ["lm_head"]},
              row_quantizer(lambda n: (n, 1)))
    cfg = load_config(dst)
    assert unquantized_linear_weights(dst, cfg) == ["lm_head.weight"]
    assert EngineConfig(dst, "ring").lm_head_fp8_for(cfg) is False
    assert EngineConfig(dst, "ring", load_format="dummy").lm_head_fp8_for(cfg) is True
    assert EngineConfig(dst, "ring", load_format="dummy",
                        fp8_lm_head=False).lm_head_fp8_for(cfg) is False


# --- fp8.py ----------------------------------------------------------------------------------

def test_row_quantization_takes_448_over_amax_as_the_gpu_does():
    """The codes are e4m3(x * fl32(448 / amax)), one float32 division (csrc/fp8.cuh
    E4m3ScaleOf), not x times the reciprocal of the rounded scale: this row's 448 / amax and
    1 / fl32(amax / 448) differ in the last bit, and its second value's codes with them."""
    from blink.gpu_engine import fp8

    x = np.array([[1.2677323818206787, 0.19242367148399353]], np.float32)
    t = torch.from_numpy(x)
    amax = t.abs().amax(1, keepdim=True)
    inverse = torch.tensor(448.0) / amax  # float32 division
    want_codes = (t * inverse).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    reciprocal = 1 / (amax / 448)
    assert (t * reciprocal).to(torch.float8_e4m3fn).view(torch.uint8)[0, 1] != want_codes[0, 1]
    codes, scale = fp8.quantize_rows(x)
    np.testing.assert_array_equal(codes, want_codes)
    np.testing.assert_array_equal(scale, (amax / 448).reshape(-1).numpy())


@pytest.mark.parametrize("cc", [(10, 0), (12, 0), (8, 9)])
def test_fp8_weights_need_hopper_exactly(cc):
    """cuBLASLt's FP8 GEMMs with per-row (outer-vector) scales: compute capability 9.0 only;
    a later GPU is refused too, not only an earlier one."""
    from blink.gpu_engine.fp8 import fp8_refusal

    assert "needs a Hopper GPU" in fp8_refusal("fp8", "auto", cc)
    assert fp8_refusal("fp8", "fp8", (9, 0)) is None
    assert fp8_refusal(None, "fp8", cc) is None


def test_input_scales_in_an_unquantized_checkpoint_are_reported_unused(src, tmp_path, caplog):
    """input_scale tensors go unreported only beside FP8 weights (whose static activation
    scales Blink does not need); in a checkpoint that is not FP8 they are tensors the model
    does not take, reported as transformers reports them."""
    dst = tmp_path / "bf16"
    write_fp8(src, dst, None, lambda name, w: None, extra=lambda out: out.__setitem__(
        "model.layers.0.self_attn.q_proj.input_scale", torch.tensor([0.5])))
    cfg = load_config(dst)
    assert cfg.quantization is None
    with caplog.at_level(logging.WARNING, logger="blink.gpu_engine.checkpoint"):
        load_weights(dst, cfg)
    assert "model.layers.0.self_attn.q_proj.input_scale" in caplog.text


def test_a_grid_without_weight_block_size_is_read_where_its_blocks_divide(src, tmp_path):
    """Without weight_block_size a scale grid whose blocks divide the weight exactly is read as
    those blocks: (32, 64) ones here (rows and columns of different sizes), so q_proj [128,
    128] has a [4, 2] grid and down_proj [128, 256] a [4, 4] one."""
    dst = tmp_path / "fp8"
    values = write_fp8(src, dst, {"quant_method": "fp8", "activation_scheme": "dynamic"},
                       block_quantizer(32, 64))
    cfg = load_config(dst)
    assert cfg.fp8_weight_block is None
    check_weights(dst, cfg)
    ours = loaded_by_name(load_weights(dst, cfg))
    for name, want in values.items():
        np.testing.assert_array_equal(ours[name], want, err_msg=name)


def test_transformers_static_activation_scales_are_not_reported_unused(src, tmp_path, caplog):
    """transformers' FP8 with activation_scheme "static" stores FP8Linear's `activation_scale`
    beside each weight (not `input_scale`): Blink does not need it (activations are scaled per
    token row), and it is not a tensor the model lacks: no warning names it."""
    def activation_scales(out):
        for name in [n for n in out if n.endswith(".weight_scale_inv")]:
            out[name.replace("weight_scale_inv", "activation_scale")] = torch.tensor(0.01)

    dst = tmp_path / "static"
    write_fp8(src, dst, {"quant_method": "fp8", "activation_scheme": "static"},
              block_quantizer(64, 64), extra=activation_scales)
    with caplog.at_level(logging.WARNING, logger="blink.gpu_engine.checkpoint"):
        load_weights(dst, load_config(dst))
    assert "activation_scale" not in caplog.text

