"""Load a Hugging Face checkpoint directory: config, weights (float32 NumPy) and RoPE frequencies.

Supported: LlamaForCausalLM, Qwen2ForCausalLM (q/k/v biases), Qwen3ForCausalLM (per-head RMSNorm
on q and k). The directory holds config.json, optionally generation_config.json, one or more
*.safetensors files (sharded through model.safetensors.index.json) and tokenizer.json.

FP8 checkpoints (config.json's quantization_config with quant_method "fp8", as transformers
writes them, "compressed-tensors" as llm-compressor writes FP8 weights, "fbgemm_fp8", or
"modelopt", also from ModelOpt's hf_quant_config.json): a
projection's weight is F8_E4M3 codes with its scales beside it, as `weight_scale_inv`
(transformers: one per weight_block_size block, or one for the tensor) or `weight_scale` (one
for the tensor, per output row, or per block or group of columns as compressed-tensors'
strategies say; FBGEMM's per row); load_weights returns their values,
codes times scales in float32, and the config says quantization "fp8", which serves FP8 weights
(the engines quantize per output row: projections stored with a scale a tensor or a row keep
their codes and scales, LayerWeights.fp8_codes; block- and group-scaled ones are rounded again
to per-row scales). k_scale / v_scale tensors (an FP8 KV
cache's calibrated scales) are read too (ModelWeights.kv_scales).

Whatever cannot be served is a CheckpointError, one line at start-up (check_weights from the
headers before anything starts, load_weights for values), never a crash or wrong output later.
"""
from __future__ import annotations

import json
import logging
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from blink.ring.layout import MAX_EOS_IDS

log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be served, with a message saying why."""


# HF `architectures` entry -> our short name.
_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(frozen=True)
class ModelConfig:
    name: str  # the checkpoint directory's name
    architecture: str  # 'llama' | 'qwen2' | 'qwen3'
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # None for plain RoPE, else {'rope_type': 'llama3', 'factor', 'low_freq_factor',
    # 'high_freq_factor', 'original_max_position_embeddings'}.
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections have biases (always for qwen2)
    o_proj_bias: bool  # o_proj has a bias (llama/qwen3 with attention_bias; never qwen2)
    qk_norm: bool  # qwen3: RMSNorm over head_dim on q and k before RoPE
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]  # union of config.json and generation_config.json
    quantization: str | None = None  # "fp8": the checkpoint's weights are FP8
    # an FP8 checkpoint's quantization_config weight_block_size: (rows, columns) of the blocks
    # its weight_scale_inv tensors scale; None: per-tensor or per-row scales
    fp8_weight_block: tuple[int, int] | None = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _json_error(e: Exception) -> str:
    # (json's decoder recurses a level an array or object: a file nested deeper than Python's
    # stack, which no writer makes, would be a RecursionError's traceback)
    return "nested too deeply" if isinstance(e, RecursionError) else str(e)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(f"{path.name} not found in checkpoint directory {path.parent}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:  # unreadable (permissions): still one line, not a traceback
        raise CheckpointError(f"{path} cannot be read: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {_json_error(e)}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return data


def _int_list(value, what: str) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise CheckpointError(f"{what} must be an int or a list of ints, got {value!r}")
    return values


def _positive(value, what: str) -> float:
    """A config number as a float, refused in one line unless it is a finite number > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and value > 0):
        raise CheckpointError(f"config.json: {what} must be a positive number, got {value!r}")
    return float(value)


def _positive_int(value, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise CheckpointError(f"config.json: {what} must be a positive int, got {value!r}")
    return value


def _flag(raw: dict, key: str) -> bool:
    """A true/false config key (absent or null: false). Anything but a JSON boolean is refused:
    Python's truth would read "false" as true (transformers' typed configs refuse it too)."""
    value = raw.get(key)
    if value is not None and not isinstance(value, bool):
        raise CheckpointError(f"config.json: {key} must be true or false, got {value!r}")
    return bool(value)


def _parse_rope(raw: dict, max_pos: int) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either the legacy `rope_theta` + `rope_scaling` keys that
    hub checkpoints carry or the `rope_parameters` dict that transformers 5 writes."""
    new, legacy = raw.get("rope_parameters"), raw.get("rope_scaling")
    if new and legacy and new != legacy:
        # transformers takes rope_scaling then, vLLM rope_parameters: which one the checkpoint
        # was trained with, only its author knows
        raise CheckpointError("config.json has both rope_parameters and rope_scaling, and they "
                              "differ: keep the one the model was trained with")
    params = new or legacy or {}
    if not isinstance(params, dict):
        raise CheckpointError(f"rope_scaling/rope_parameters must be an object, got {params!r}")
    theta = _positive(params.get("rope_theta", raw.get("rope_theta", 10000.0)), "rope_theta")
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if _positive(partial, "partial_rotary_factor") != 1.0:
        raise CheckpointError("partial_rotary_factor != 1 is not supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise CheckpointError(
            f"RoPE type {rope_type!r} is not supported (supported: 'default', 'llama3')")
    missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor") if k not in params]
    if missing:
        raise CheckpointError(f"llama3 RoPE scaling lacks {', '.join(missing)}")
    # a top-level original_max_position_embeddings wins over the scaling's own, as in
    # transformers (Phi-3 style configs keep it there)
    original = raw.get("original_max_position_embeddings",
                       params.get("original_max_position_embeddings", max_pos))
    scaling = {
        "rope_type": "llama3",
        **{k: _positive(params[k], f"RoPE scaling {k}")
           for k in ("factor", "low_freq_factor", "high_freq_factor")},
        "original_max_position_embeddings": _positive_int(
            original, "original_max_position_embeddings"),
    }
    if scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise CheckpointError("llama3 RoPE scaling needs high_freq_factor > low_freq_factor")
    return theta, scaling


def _architecture(raw: dict, model_dir: Path) -> str:
    """Our short name for the model config.json describes: its `architectures` entry, which
    must agree with its `model_type` (transformers builds the model model_type names, so a Qwen2
    folder labelled LlamaForCausalLM would otherwise lose its biases), or model_type alone."""
    archs = raw.get("architectures") or []
    archs = [archs] if isinstance(archs, str) else archs
    model_type = raw.get("model_type")
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise CheckpointError(f"config.json: architectures must be a list of names, got "
                              f"{archs!r}")
    arch = next((_ARCHITECTURES[a] for a in archs if a in _ARCHITECTURES), None)
    if arch is None and not archs and model_type in _ARCHITECTURES.values():
        arch = model_type
    if arch is None:
        raise CheckpointError(
            f"unsupported architecture {archs or model_type!r} in {model_dir}/config.json "
            f"(supported: {', '.join(_ARCHITECTURES)})")
    if model_type is not None and model_type != arch:
        raise CheckpointError(
            f"config.json: model_type {model_type!r} does not match the architecture "
            f"{next(a for a in _ARCHITECTURES if _ARCHITECTURES[a] == arch)} ({arch!r}); "
            f"transformers would build a {model_type!r} model from it")
    return arch


def load_config(model_dir: str | Path) -> ModelConfig:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"checkpoint directory {model_dir} does not exist")
    raw = _read_json(model_dir / "config.json")

    arch = _architecture(raw, model_dir)

    def need_int(key: str) -> int:
        return _positive_int(raw.get(key), key)

    hidden = need_int("hidden_size")
    heads = need_int("num_attention_heads")
    # absent or null take transformers' defaults; a 0 is refused like any other bad size
    kv_heads = (need_int("num_key_value_heads") if raw.get("num_key_value_heads") is not None
                else heads)
    # transformers' defaults when head_dim is absent: hidden/heads, except Qwen3Config's 128.
    if raw.get("head_dim") is not None:
        head_dim = need_int("head_dim")
    elif arch == "qwen3":
        head_dim = 128
    elif hidden % heads:  # transformers refuses it too: the heads would not tile the hidden size
        raise CheckpointError(f"config.json: hidden_size {hidden} is not a multiple of "
                              f"num_attention_heads {heads} (and there is no head_dim)")
    else:
        head_dim = hidden // heads
    if heads % kv_heads:
        raise CheckpointError(f"num_attention_heads {heads} is not a multiple of "
                              f"num_key_value_heads {kv_heads}")
    if head_dim % 2:
        raise CheckpointError(f"head_dim {head_dim} must be even for RoPE")
    if raw.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"hidden_act {raw.get('hidden_act')!r} is not supported (only silu)")
    if _flag(raw, "mlp_bias"):
        raise CheckpointError("mlp_bias=true is not supported")
    if arch in ("qwen2", "qwen3") and _flag(raw, "use_sliding_window"):
        raise CheckpointError("sliding-window attention (use_sliding_window=true) is not supported")

    max_pos = (need_int("max_position_embeddings") if "max_position_embeddings" in raw
               else 2048 if arch == "llama" else 32768)  # transformers' defaults
    rope_theta, rope_scaling = _parse_rope(raw, max_pos)
    vocab = need_int("vocab_size")

    # eos ids: config.json first, then generation_config.json extras (Llama-3 instruct models
    # list <|eot_id|> only in the latter).
    eos = _int_list(raw.get("eos_token_id"), "config.json eos_token_id")
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        eos += _int_list(_read_json(gen_path).get("eos_token_id"), "generation_config eos_token_id")
    eos_ids = tuple(dict.fromkeys(eos))
    if len(eos_ids) > MAX_EOS_IDS:  # what the ring's header carries to both engines
        raise CheckpointError(f"{len(eos_ids)} eos token ids (config.json and "
                              f"generation_config.json): at most {MAX_EOS_IDS} are supported")
    bos = raw.get("bos_token_id")
    if bos is not None and (not isinstance(bos, int) or isinstance(bos, bool)):
        raise CheckpointError(f"config.json bos_token_id must be an int, got {bos!r}")
    for tok in (*eos_ids, *([bos] if bos is not None else [])):
        if not 0 <= tok < vocab:
            raise CheckpointError(f"special token id {tok} is outside the vocabulary ({vocab})")

    bias = _flag(raw, "attention_bias")
    qc = raw.get("quantization_config")
    quantization, fp8_weight_block = _parse_quantization(
        qc if qc is not None else _modelopt_config(model_dir))
    return ModelConfig(
        name=model_dir.resolve().name,
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=need_int("intermediate_size"),
        num_layers=need_int("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_positive(raw.get("rms_norm_eps", 1e-6), "rms_norm_eps"),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_pos,
        tie_word_embeddings=_flag(raw, "tie_word_embeddings"),
        attention_bias=True if arch == "qwen2" else bias,
        o_proj_bias=False if arch == "qwen2" else bias,
        qk_norm=arch == "qwen3",
        bos_token_id=bos,
        eos_token_ids=eos_ids,
        quantization=quantization,
        fp8_weight_block=fp8_weight_block,
    )


def _parse_quantization(qc) -> tuple[str | None, tuple[int, int] | None]:
    """config.json's quantization_config -> (None or "fp8", the (rows, columns) of the blocks
    its weights' scale grids cover, or None: scales per tensor or per row); anything else
    cannot be served. Which weights are FP8 is each tensor's own dtype (F8_E4M3, its scale
    beside it); the config says how to read the scales and refuses what is not E4M3 codes."""
    if qc is None:
        return None, None
    if not isinstance(qc, dict):
        raise CheckpointError(f"quantization_config must be an object, got {qc!r}")
    method = qc.get("quant_method")
    read_block = _FP8_FORMATS.get(method) if isinstance(method, str) else None
    if read_block is None:
        raise CheckpointError(f"quantization_config quant_method {method!r} is not supported "
                              f"(supported, E4M3 weights: {', '.join(map(repr, _FP8_FORMATS))})")
    return "fp8", read_block(qc)


def _block_size(block, what: str) -> tuple[int, int] | None:
    if block is not None and (not isinstance(block, list) or len(block) != 2 or not all(
            isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise CheckpointError(f"{what} must be two positive ints or null, got {block!r}")
    return tuple(block) if block is not None else None


def _static_activation_scales(what: str) -> None:
    # input_scale tensors (static activation scales) are not read: every engine scales each
    # activation row by its own amax, which is never less accurate
    log.info("%s: activations are scaled per token row at run time instead (dynamic); "
             "input_scale tensors are not read", what)


def _transformers_fp8_block(qc: dict) -> tuple[int, int] | None:
    """transformers' FP8 (quant_method "fp8"): weight_scale_inv per tensor, or per
    weight_block_size block (its fine-grained format)."""
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise CheckpointError(f"FP8 format {fmt!r} is not supported (only e4m3)")
    block = _block_size(qc.get("weight_block_size"), "quantization_config weight_block_size")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        _static_activation_scales(
            f"quantization_config activation_scheme {qc.get('activation_scheme')!r}")
    return block


def _modelopt_config(model_dir: Path) -> dict | None:
    """NVIDIA's Model Optimizer (ModelOpt) FP8 releases that predate its quantization_config
    in config.json say what they are in hf_quant_config.json beside it: that, as the
    quantization_config it would be (None without one)."""
    path = model_dir / "hf_quant_config.json"
    if not path.is_file():
        return None
    quant = _read_json(path).get("quantization")
    if not isinstance(quant, dict):
        raise CheckpointError(f"{path.name} has no quantization object")
    return {"quant_method": "modelopt", **quant}


# ModelOpt's FP8 algorithms whose weights are E4M3 codes with a scale per tensor or per row
_MODELOPT_FP8_ALGOS = ("FP8", "FP8_PER_CHANNEL_PER_TOKEN")


def _modelopt_fp8_block(qc: dict) -> None:
    """ModelOpt's FP8 (quant_method "modelopt"): weight_scale per tensor (FP8) or per row
    (FP8_PER_CHANNEL_PER_TOKEN), input_scale (static, not read); an FP8 KV cache's scales
    as the k and v projections' k_scale and v_scale (_KV_SCALE_NAMES)."""
    algo = qc.get("quant_algo")
    if algo not in _MODELOPT_FP8_ALGOS:
        raise CheckpointError(f"ModelOpt quant_algo {algo!r} is not supported (E4M3 weights: "
                              f"{', '.join(_MODELOPT_FP8_ALGOS)})")
    kv = qc.get("kv_cache_quant_algo")
    if kv not in (None, "FP8"):
        raise CheckpointError(f"ModelOpt kv_cache_quant_algo {kv!r} is not supported (FP8 "
                              f"or none)")
    return None


def _fbgemm_fp8_block(qc: dict) -> None:
    """FBGEMM's FP8 (quant_method "fbgemm_fp8", Meta's Llama 3.1 FP8 releases): weight_scale
    per output row; input_scale_ub (a bound on the activations' scales) is not needed."""
    return None


# tensors beside FP8 weights that scale (or bound) their inputs' quantization (transformers'
# static FP8 stores activation_scale)
_ACTIVATION_SCALE_SUFFIXES = (".input_scale", ".input_scale_ub", ".activation_scale")

# compressed-tensors' formats whose FP8 weights are stored as E4M3 codes beside their scales
_COMPRESSED_TENSORS_FP8_FORMATS = ("float-quantized", "naive-quantized")


def _compressed_tensors_fp8_block(qc: dict) -> tuple[int, int] | None:
    """compressed-tensors (llm-compressor's checkpoints, quant_method "compressed-tensors"):
    each config group's weights must be 8-bit symmetric floats with static scales, per tensor
    or channel (row), or per block (block_structure) or group (group_size columns of a row),
    one block size for the checkpoint; a KV-cache scheme, per-tensor k_scale / v_scale."""
    def refuse(why: str):
        raise CheckpointError(f"compressed-tensors quantization_config: {why}")

    sparsity = qc.get("sparsity_config")
    if sparsity and not (isinstance(sparsity, dict) and sparsity.get("format") == "dense"):
        refuse("sparse weights (sparsity_config) are not supported")
    formats = set()
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        refuse(f"config_groups must name at least one group, got {groups!r}")
    blocks, per_row = set(), False
    for name, group in groups.items():
        if not isinstance(group, dict):
            refuse(f"config group {name!r} must be an object, got {group!r}")
        fmt = group.get("format") or qc.get("format")
        if fmt is not None and not isinstance(fmt, str):
            refuse(f"format must be a string, got {fmt!r}")
        formats.add(fmt)
        weights = group.get("weights")
        if not isinstance(weights, dict):
            refuse(f"config group {name!r} has no weights scheme (only weight quantization "
                   f"is read)")
        kind = (weights.get("num_bits"), str(weights.get("type")).lower())
        if kind != (8, "float"):
            refuse(f"group {name!r} weights are {kind[0]}-bit {kind[1]}: only 8-bit float "
                   f"(E4M3) weights are supported")
        if not weights.get("symmetric", True) or weights.get("dynamic", False):
            refuse(f"group {name!r} weights must be symmetric with static scales")
        strategy = _strategy(weights)
        actorder = weights.get("actorder")
        # (True and "dynamic" were compressed-tensors' other spellings of "group")
        if strategy == "group" and (actorder is True or str(actorder).lower() in
                                    ("group", "dynamic")):
            refuse(f"group {name!r} weights: activation-ordered groups (actorder "
                   f"{actorder!r}, a weight_g_idx) are not supported")
        if strategy == "block":
            structure = weights.get("block_structure")
            if isinstance(structure, str):  # its earlier form, "128x128"
                structure = [int(b) if b.isdigit() else b for b in structure.split("x")]
            block = _block_size(structure, f"group {name!r} weights block_structure")
            if block is None:
                refuse(f"group {name!r} weights strategy 'block' needs a block_structure")
            blocks.add(block)
        elif strategy == "group":
            size = weights.get("group_size")
            if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
                refuse(f"group {name!r} weights group_size must be a positive int, got "
                       f"{size!r}")
            blocks.add((1, size))
        elif strategy == "channel":
            per_row = True
        elif strategy != "tensor":
            refuse(f"group {name!r} weights strategy {strategy!r} is not supported "
                   f"(tensor, channel, block, group)")
        acts = group.get("input_activations")
        if acts is not None and not isinstance(acts, dict):
            refuse(f"group {name!r} input_activations must be an object or null")
        if acts is not None and (acts.get("num_bits"),
                                 str(acts.get("type")).lower()) != (8, "float"):
            refuse(f"group {name!r} input activations must be 8-bit float or unquantized")
        if acts is not None and not acts.get("dynamic", False):
            _static_activation_scales(f"compressed-tensors group {name!r} static input "
                                      f"activations")
        if group.get("output_activations") is not None:
            refuse(f"group {name!r} output activation quantization is not supported")
    bad_formats = formats - {None, *_COMPRESSED_TENSORS_FP8_FORMATS}
    if bad_formats:
        refuse(f"format {sorted(map(str, bad_formats))} is not supported (FP8 weights: "
               f"{', '.join(_COMPRESSED_TENSORS_FP8_FORMATS)})")
    if len(blocks) > 1 or (blocks and per_row):
        refuse("the groups scale their weights in different blocks; one block size, or "
               "tensors and rows, is supported")
    kv = qc.get("kv_cache_scheme")
    if kv is not None and (not isinstance(kv, dict)
                           or (kv.get("num_bits"), kv.get("type"), kv.get("strategy"))
                           != (8, "float", "tensor") or kv.get("dynamic", False)):
        refuse(f"kv_cache_scheme {kv!r} is not supported: per-tensor static k_scale / "
               f"v_scale only")
    return next(iter(blocks), None)


def _strategy(weights: dict) -> str | None:
    """A compressed-tensors scheme's strategy, inferred as compressed-tensors infers one that is
    not given: per group of group_size columns, per row (group_size -1), or per tensor."""
    strategy = weights.get("strategy")
    if strategy is not None:
        return str(strategy).lower()
    size = weights.get("group_size")
    if size == -1:
        return "channel"
    return "group" if size is not None else "tensor"


# quant_method -> its weights' scale blocks from its quantization_config
_FP8_FORMATS = {"fp8": _transformers_fp8_block,
                "compressed-tensors": _compressed_tensors_fp8_block,
                "fbgemm_fp8": _fbgemm_fp8_block, "modelopt": _modelopt_fp8_block}


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """[head_dim // 2] float32 inverse frequencies, step by step in float32 as transformers does."""
    dim = cfg.head_dim
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    # The power in float64 rounded to float32 reproduces torch's float32 pow (numpy's float32 pow
    # differs from it in the last bit for about a tenth of the entries).
    inv_freq = np.float32(1.0) / (cfg.rope_theta ** exponents.astype(np.float64)).astype(np.float32)
    if cfg.rope_scaling is None:
        return inv_freq
    s = cfg.rope_scaling
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = np.float32(2 * math.pi) / inv_freq
    # Long wavelengths (low frequencies) are slowed by `factor`, short ones kept, the band between
    # interpolated smoothly.
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / np.float32(factor), inv_freq)
    smooth = (np.float32(old_len) / wavelen - np.float32(low)) / np.float32(high - low)
    smoothed = (1 - smooth) * scaled / np.float32(factor) + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


# --- safetensors -------------------------------------------------------------------------------

# The safetensors NumPy backend cannot return bf16, so the format is read directly:
# 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}}, raw data.
_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"),
           "F8_E4M3": np.dtype("u1")}


@dataclass(frozen=True)
class _TensorRef:
    path: Path
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int


def _nonnegative_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _entry_ok(e) -> bool:
    """A header entry as the safetensors format defines it: a dtype name, a shape of sizes and
    [begin, end] byte offsets into the data after the header."""
    if not isinstance(e, dict):
        return False
    shape, offsets = e.get("shape"), e.get("data_offsets")
    return (isinstance(e.get("dtype"), str) and isinstance(shape, list)
            and all(map(_nonnegative_int, shape)) and isinstance(offsets, list)
            and len(offsets) == 2 and all(map(_nonnegative_int, offsets))
            and offsets[0] <= offsets[1])


def _read_safetensors_header(path: Path) -> dict[str, _TensorRef]:
    """The tensors of a safetensors file by name, from its header, checked as the safetensors
    library checks it (transformers cannot load a file it refuses): entries of _entry_ok's form
    whose bytes tile the data to the end of the file, with no hole or overlap (the format's
    rule). Offsets that overlap or point into the header would serve other bytes as a tensor's."""
    if not path.is_file():
        what = "a link to a missing file" if path.is_symlink() else "a folder or special file"
        raise CheckpointError(f"{path} is not a file ({what})")
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise CheckpointError(f"{path} is too short to be a safetensors file")
            n = int.from_bytes(head, "little")
            if n > 100_000_000:  # checked before the read, which would allocate n bytes
                raise CheckpointError(f"{path}: implausible safetensors header length {n}")
            if 8 + n > size:
                raise CheckpointError(f"{path}: the safetensors header runs past the end of "
                                      f"the file (truncated?)")
            text = f.read(n)
    except OSError as e:  # unreadable (permissions): still one line, not a traceback
        raise CheckpointError(f"{path} cannot be read: {e.strerror}") from None
    try:
        header = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header: {_json_error(e)}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    refs = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        if not _entry_ok(e):
            raise CheckpointError(f"{path}: corrupt safetensors header entry for {name}: {e!r}")
        begin, end = e["data_offsets"]
        if 8 + n + end > size:
            raise CheckpointError(
                f"{path}: tensor {name} runs past the end of the file (truncated?)")
        refs[name] = _TensorRef(path, e["dtype"], tuple(e["shape"]), 8 + n + begin, 8 + n + end)
    covered = 8 + n  # where the next tensor's bytes must start
    for name, ref in sorted(refs.items(), key=lambda item: (item[1].start, item[1].end)):
        if ref.start != covered:
            raise CheckpointError(f"{path}: tensor {name}'s data_offsets overlap another "
                                  f"tensor's or leave a gap before it (corrupt header)")
        covered = ref.end
    if covered != size:
        raise CheckpointError(f"{path}: {size - covered} bytes after the last tensor that no "
                              f"header entry describes (corrupt header)")
    return refs


def _check_ref(ref: _TensorRef, name: str) -> None:
    """What a tensor's header entry must say for _read_tensor to read it."""
    if ref.dtype not in _DTYPES:
        raise CheckpointError(f"{ref.path.name}: tensor {name} has dtype {ref.dtype}; "
                              f"only F32, F16, BF16 and F8_E4M3 are supported")
    if ref.end - ref.start != math.prod(ref.shape) * _DTYPES[ref.dtype].itemsize:
        raise CheckpointError(f"{ref.path.name}: tensor {name} byte size does not match its shape")


def _read_tensor(ref: _TensorRef, mm: np.memmap, name: str) -> np.ndarray:
    """The tensor as a fresh float32 array (F8_E4M3: the codes' values, unscaled)."""
    _check_ref(ref, name)
    raw = mm[ref.start:ref.end].view(_DTYPES[ref.dtype]).reshape(ref.shape)
    if ref.dtype == "BF16":
        # bf16 is the top half of a float32: shift the 16 bits up and reinterpret.
        return (raw.astype(np.uint32) << 16).view(np.float32)
    if ref.dtype == "F8_E4M3":
        from .fp8 import e4m3_to_float32
        return e4m3_to_float32(raw)
    return raw.astype(np.float32)


def _weight_files(model_dir: Path) -> list[Path]:
    """The checkpoint's weight files, as transformers picks them: model.safetensors where it
    exists (beside an index too), else the shards its index lists, else every *.safetensors."""
    single, index = model_dir / "model.safetensors", model_dir / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no weight_map")
        for name, file in weight_map.items():
            if not isinstance(file, str):
                raise CheckpointError(f"{index.name}: weight_map gives {name} the file "
                                      f"{file!r}, not a file name")
        files = [model_dir / f for f in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"shard {f.name} listed in {index.name} is missing")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors weight files in {model_dir}")
    return files


@dataclass
class LayerWeights:
    # HF layout: every projection is [out_features, in_features]; y = x @ w.T
    q_proj: np.ndarray  # [num_heads * head_dim, H]
    k_proj: np.ndarray  # [num_kv_heads * head_dim, H]
    v_proj: np.ndarray  # [num_kv_heads * head_dim, H]
    o_proj: np.ndarray  # [H, num_heads * head_dim]
    q_bias: np.ndarray | None  # [num_heads * head_dim] when cfg.attention_bias
    k_bias: np.ndarray | None  # [num_kv_heads * head_dim]
    v_bias: np.ndarray | None  # [num_kv_heads * head_dim]
    o_bias: np.ndarray | None  # [H] when cfg.o_proj_bias
    q_norm: np.ndarray | None  # [head_dim] when cfg.qk_norm
    k_norm: np.ndarray | None  # [head_dim]
    input_norm: np.ndarray  # [H]
    post_attention_norm: np.ndarray  # [H]
    gate_proj: np.ndarray  # [I, H]
    up_proj: np.ndarray  # [I, H]
    down_proj: np.ndarray  # [H, I]
    # an FP8 checkpoint's projections stored with a scale per tensor or per row, by the names
    # above: (E4M3 codes [out, in] uint8 as stored, float32 scale per row [out]), whose values
    # the arrays above hold; an FP8 engine serves these codes as they are (fp8.fp8_weights,
    # CudaForward), since quantizing the values again per row would round them twice
    fp8_codes: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    # an FP8 checkpoint's projections stored wider than E4M3 (bf16, f16 or f32: the modules its
    # quantizer left out, such as the self_attn projections of Meta's Llama-3.1 FP8 releases),
    # by the names above; an FP8 engine serves them in bf16 where a fused projection's every
    # part is one (weight_layout.served_bf16)
    stored_wide: frozenset[str] = frozenset()


# a layer's projections (LayerWeights' names) and their tensors' names in the layer
PROJECTION_TENSORS = {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj",
                      "v_proj": "self_attn.v_proj", "o_proj": "self_attn.o_proj",
                      "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
                      "down_proj": "mlp.down_proj"}


@dataclass
class ModelWeights:
    embed: np.ndarray  # [V, H]
    layers: Sequence[LayerWeights]  # a list, or LayersOnDemand
    final_norm: np.ndarray  # [H]
    lm_head: np.ndarray  # [V, H]; the same array as `embed` when tied
    # an FP8 checkpoint's KV-cache scales: [num_layers, 2] (k_scale, v_scale), or None
    kv_scales: np.ndarray | None = None


def _tensor_refs(model_dir: Path) -> dict[str, _TensorRef]:
    """Every tensor of the checkpoint's weight files, by name, from their headers."""
    refs: dict[str, _TensorRef] = {}
    for f in _weight_files(model_dir):
        for name, ref in _read_safetensors_header(f).items():
            if name in refs:
                raise CheckpointError(f"tensor {name} appears in both {refs[name].path.name} "
                                      f"and {f.name}")
            refs[name] = ref
    return refs


def _model_ref(refs: dict[str, _TensorRef], model_dir: Path, name: str,
               shape: tuple[int, ...]) -> _TensorRef:
    """The header entry of a tensor the model needs, checked against the shape `cfg` implies."""
    ref = refs.get(name)
    if ref is None:
        raise CheckpointError(f"tensor {name} not found in the weights of {model_dir}")
    if ref.shape != shape:
        raise CheckpointError(f"tensor {name} has shape {list(ref.shape)}, "
                              f"config.json implies {list(shape)}")
    _check_ref(ref, name)
    return ref


def check_weights(model_dir: str | Path, cfg: ModelConfig) -> None:
    """Refuses (CheckpointError) weight files load_weights would refuse for their names, shapes,
    dtypes or sizes, from the headers alone (no tensor is read): a command's check before
    anything starts. That covers an FP8 weight's scale tensor and the KV-cache scales too;
    only values (NaN, infinities, negative scales) wait for load_weights."""
    model_dir = Path(model_dir)
    _model_tensor_names(model_dir, _tensor_refs(model_dir), cfg)


def _model_tensor_names(model_dir: Path, refs: dict[str, _TensorRef],
                        cfg: ModelConfig) -> set[str]:
    """The names of every tensor the model reads (its weights, an FP8 weight's scale and zero
    point, the KV-cache scales), each checked from its header as check_weights says."""
    names: set[str] = set()

    def check(name: str, shape: tuple[int, ...]) -> _TensorRef:
        ref = _model_ref(refs, model_dir, name, shape)
        names.add(name)
        if ref.dtype == "F8_E4M3":
            names.add(_fp8_scale(name, ref, refs, cfg.fp8_weight_block)[0])
            if name + "_zero_point" in refs:
                names.add(name + "_zero_point")
        return ref

    _model_tensors(cfg, "lm_head.weight" in refs, check)
    names.update(name for pair in _kv_scale_names(cfg, refs) for name in pair)
    return names


class LayersOnDemand(Sequence):
    """A model's layers, each read from the checkpoint when it is asked for and not kept (the
    memory-mapped files are): what load_weights(layers_on_demand=True) gives the CUDA engine,
    which uploads a layer and drops it as it asks for the next, so the host holds about two
    layers' float32 arrays at a time (Llama-3.1-70B: 3.4 GB a layer), not the model's (about
    280 GB, past the lent hosts' 128 GiB). Each access reads the layer again."""

    def __init__(self, count: int, read_layer):
        self._count, self._read_layer = count, read_layer

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._count))]
        i = operator.index(i)  # (a float named a layer "1.0" that no checkpoint holds)
        if not -self._count <= i < self._count:
            raise IndexError(f"layer {i} of {self._count}")
        return self._read_layer(i % self._count)


def load_weights(model_dir: str | Path, cfg: ModelConfig, *,
                 layers_on_demand: bool = False) -> ModelWeights:
    """All weights as float32 NumPy arrays, shapes checked against `cfg`, values finite (a NaN
    or an infinity in one weight makes every logit NaN). Tensors the model does not take are
    ignored with a warning, as transformers ignores them. Every header is checked before any
    value is read. layers_on_demand: the layers are a LayersOnDemand (read as each is asked
    for, a NaN refused then), the embedding, LM head and norms read now."""
    model_dir = Path(model_dir)
    refs = _tensor_refs(model_dir)
    used = _model_tensor_names(model_dir, refs, cfg)
    maps: dict[Path, np.memmap] = {}
    codes: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # LayerWeights.fp8_codes, by tensor

    def read(name: str, ref: _TensorRef) -> np.ndarray:
        if ref.path not in maps:
            maps[ref.path] = np.memmap(ref.path, dtype=np.uint8, mode="r")
        value = _read_tensor(ref, maps[ref.path], name)
        if not np.isfinite(value).all():  # F8_E4M3 too: its NaN codes read as NaN
            raise CheckpointError(f"tensor {name} holds NaN or infinite values "
                                  f"({ref.path.name})")
        return value

    def get(name: str, shape: tuple[int, ...]) -> np.ndarray:
        ref = _model_ref(refs, model_dir, name, shape)
        value = read(name, ref)
        if ref.dtype == "F8_E4M3":  # the codes times their scales
            scale_name, block = _fp8_scale(name, ref, refs, cfg.fp8_weight_block)
            scale = read(scale_name, refs[scale_name])
            if (scale < 0).any():  # no quantizer writes one: a misread or corrupt tensor
                raise CheckpointError(f"tensor {scale_name} holds negative values; a scale is "
                                      f"its block's max |value| / 448")
            value = _dequantized(value, scale, block)
            if block[1] >= ref.shape[1]:  # one scale a row (per tensor, row or rows): kept
                raw = maps[ref.path][ref.start:ref.end].view(np.uint8).reshape(ref.shape)
                codes[name] = (raw, np.repeat(scale.reshape(-1), block[0])[:ref.shape[0]])
            zero_point = name + "_zero_point"  # compressed-tensors may store symmetric zeros
            if zero_point in refs and read(zero_point, refs[zero_point]).any():
                raise CheckpointError(f"tensor {zero_point} is not zero: asymmetric FP8 "
                                      f"weights are not supported")
        return value

    def read_layer(i: int) -> LayerWeights:
        lw = _layer_tensors(cfg, i, get)
        lw.fp8_codes = {attr: codes.pop(f"model.layers.{i}.{tensor}.weight")
                        for attr, tensor in PROJECTION_TENSORS.items()
                        if f"model.layers.{i}.{tensor}.weight" in codes}
        if cfg.quantization == "fp8":
            lw.stored_wide = frozenset(
                attr for attr, tensor in PROJECTION_TENSORS.items()
                if refs[f"model.layers.{i}.{tensor}.weight"].dtype != "F8_E4M3")
        return lw

    layers = LayersOnDemand(cfg.num_layers, read_layer)
    weights = _model_tensors(cfg, "lm_head.weight" in refs, get,
                             layers if layers_on_demand else list(layers))
    if weights.lm_head is not weights.embed and cfg.tie_word_embeddings:
        if np.array_equal(weights.lm_head, weights.embed):
            weights.lm_head = weights.embed
        else:  # as transformers does: the stored head, not the embedding
            log.warning("config.json ties the embedding to the LM head, but lm_head.weight "
                        "differs from it: serving lm_head.weight, as transformers does")
    weights.kv_scales = _kv_scales(cfg, refs, read)
    # static activation scales (and FBGEMM's bounds on them) are not read: activations are
    # scaled per token row (_static_activation_scales)
    unused = sorted(n for n in refs.keys() - used
                    if not (cfg.quantization and n.endswith(_ACTIVATION_SCALE_SUFFIXES)))
    if unused:  # transformers' load report calls them UNEXPECTED, and loads the model
        log.warning("%d tensor%s of %s not part of a %s model with its config.json, ignored "
                    "as transformers ignores them: %s%s", len(unused),
                    " is" if len(unused) == 1 else "s are", model_dir.name, cfg.architecture,
                    ", ".join(unused[:5]), ", ..." if len(unused) > 5 else "")
    return weights


def unquantized_linear_weights(model_dir: str | Path, cfg: ModelConfig) -> list[str]:
    """The projection weights and LM head an FP8 checkpoint stores wider than E4M3, from its
    headers: the modules its quantizer left out (modules_to_not_convert, ignore,
    exclude_modules): the LM head in nearly every release ("lm_head.weight" here where it is
    tied to the embedding), every self_attn projection in Meta's Llama-3.1 FP8 ones. Empty for
    a checkpoint that is not FP8."""
    if cfg.quantization != "fp8":
        return []
    refs = _tensor_refs(Path(model_dir))
    names = [f"model.layers.{i}.{tensor}.weight" for i in range(cfg.num_layers)
             for tensor in PROJECTION_TENSORS.values()] + ["lm_head.weight"]
    return [name for name in names if name not in refs or refs[name].dtype != "F8_E4M3"]


def _layer_tensors(cfg: ModelConfig, i: int, get) -> LayerWeights:
    """Layer i's tensors as `get(name, shape)` gives them (_model_tensors)."""
    H, I, D, Q, KV = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.q_size, cfg.kv_size
    shapes = {"q_proj": (Q, H), "k_proj": (KV, H), "v_proj": (KV, H), "o_proj": (H, Q),
              "gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}
    p = f"model.layers.{i}."
    a = p + "self_attn."
    bias = cfg.attention_bias
    return LayerWeights(
        **{attr: get(f"{p}{tensor}.weight", shapes[attr])
           for attr, tensor in PROJECTION_TENSORS.items()},
        q_bias=get(a + "q_proj.bias", (Q,)) if bias else None,
        k_bias=get(a + "k_proj.bias", (KV,)) if bias else None,
        v_bias=get(a + "v_proj.bias", (KV,)) if bias else None,
        o_bias=get(a + "o_proj.bias", (H,)) if cfg.o_proj_bias else None,
        q_norm=get(a + "q_norm.weight", (D,)) if cfg.qk_norm else None,
        k_norm=get(a + "k_norm.weight", (D,)) if cfg.qk_norm else None,
        input_norm=get(p + "input_layernorm.weight", (H,)),
        post_attention_norm=get(p + "post_attention_layernorm.weight", (H,)),
    )


def _model_tensors(cfg: ModelConfig, has_lm_head: bool, get,
                   layers: Sequence[LayerWeights] | None = None) -> ModelWeights:
    """The model's tensors as `get(name, shape)` gives them: load_weights' arrays, or
    check_weights' header entries; `layers` where the caller reads them itself. A tied model's
    stored lm_head.weight is taken too."""
    H, V = cfg.hidden_size, cfg.vocab_size
    if layers is None:
        layers = [_layer_tensors(cfg, i, get) for i in range(cfg.num_layers)]
    embed = get("model.embed_tokens.weight", (V, H))
    tied = cfg.tie_word_embeddings and not has_lm_head
    lm_head = embed if tied else get("lm_head.weight", (V, H))
    return ModelWeights(embed=embed, layers=layers, final_norm=get("model.norm.weight", (H,)),
                        lm_head=lm_head)


def _fp8_scale(name: str, ref: _TensorRef, refs: dict[str, _TensorRef],
               block: tuple[int, int] | None) -> tuple[str, tuple[int, int]]:
    """(the scale tensor's name, the (rows, columns) block each of its values scales) of an
    F8_E4M3 weight [N, K], from the headers. The scale is the tensor beside it
    (name.replace("weight", "weight_scale_inv" or "weight_scale")): one for the tensor ([] or
    [1]; block (N, K)), one per output row ([N] or [N, 1]; (1, K)), or one per block of `block`
    = (bn, bk) rows and columns (config.json's weight_block_size; the last blocks may be
    partial): a [ceil(N / bn), ceil(K / bk)] grid. Without weight_block_size a grid is read only
    where its blocks divide N and K exactly (otherwise their size is ambiguous)."""
    if len(ref.shape) != 2:
        raise CheckpointError(f"FP8 tensor {name} has shape {list(ref.shape)}: only 2-D "
                              f"weights ([out, in]) are read as FP8 codes with scales")
    base = name[:-len("weight")] if name.endswith("weight") else name + "_"
    scale_name = next((base + s for s in ("weight_scale_inv", "weight_scale")
                       if base + s in refs), None)
    if scale_name is None:
        raise CheckpointError(f"FP8 tensor {name} has no weight_scale_inv or weight_scale "
                              f"beside it")
    scale = refs[scale_name]
    _check_ref(scale, scale_name)
    n, k = ref.shape
    if math.prod(scale.shape) == 1:
        return scale_name, (n, k)
    if block is None and scale.shape in ((n,), (n, 1)):
        return scale_name, (1, k)
    if len(scale.shape) == 2:
        rows, cols = scale.shape
        if block is None and n % rows == 0 and k % cols == 0:
            block = (n // rows, k // cols)
        if block is not None and (rows, cols) == (-(-n // block[0]), -(-k // block[1])):
            return scale_name, block
    blocks = f"blocks of {list(block)}" if block else "blocks that divide it"
    raise CheckpointError(f"{scale_name} has shape {list(scale.shape)}: not a scale for the "
                          f"tensor, per row or per {blocks} of {name} {[n, k]}")


def _dequantized(codes: np.ndarray, scale: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """codes [N, K] (their values) times `scale`, one value per (bn, bk) = `block` block as
    _fp8_scale gives it; a grid of one row or column broadcasts instead of being repeated."""
    (n, k), (bn, bk) = codes.shape, block
    rows, cols = -(-n // bn), -(-k // bk)
    grid = scale.reshape(rows, cols)
    if rows > 1:
        grid = np.repeat(grid, bn, 0)[:n]
    if cols > 1:
        grid = np.repeat(grid, bk, 1)[:, :k]
    return codes * grid


# where FP8 checkpoints keep a layer's calibrated KV-cache scales (keys', values'): beside the
# attention (vLLM's name, llm-compressor's now), as the k and v projections' output scales
# (compressed-tensors' kv_cache_scheme in earlier llm-compressor releases), or as ModelOpt's
_KV_SCALE_NAMES = (("self_attn.k_scale", "self_attn.v_scale"),
                   ("self_attn.k_proj.output_scale", "self_attn.v_proj.output_scale"),
                   ("self_attn.k_proj.k_scale", "self_attn.v_proj.v_scale"))


def _kv_scale_names(cfg: ModelConfig, refs: dict[str, _TensorRef]) -> list[tuple[str, str]]:
    """Each layer's (keys', values') scale tensors, as FP8 checkpoints store an FP8 KV cache's
    calibrated scales (_KV_SCALE_NAMES: the first naming any layer uses), checked from the
    headers: in every layer or in none ([] then: an FP8 cache calibrates its own), one value
    each."""
    for k_name, v_name in _KV_SCALE_NAMES:
        names = [(f"model.layers.{i}.{k_name}", f"model.layers.{i}.{v_name}")
                 for i in range(cfg.num_layers)]
        present = [k in refs and v in refs for k, v in names]
        if any(present):
            break
    else:
        return []
    if not all(present):
        raise CheckpointError("k_scale / v_scale are in some layers' weights and not others")
    for name in (name for pair in names for name in pair):
        _check_ref(refs[name], name)
        if math.prod(refs[name].shape) != 1:
            raise CheckpointError(f"{name} must be one scale, got shape "
                                  f"{list(refs[name].shape)}")
    return names


def _kv_scales(cfg: ModelConfig, refs: dict[str, _TensorRef], read) -> np.ndarray | None:
    """[num_layers, 2] (keys', values') scales from _kv_scale_names' tensors, or None without
    them."""
    names = _kv_scale_names(cfg, refs)
    if not names:
        return None
    out = np.array([[read(name, refs[name]).reshape(()) for name in pair] for pair in names],
                   np.float32)
    if (out <= 0).any():  # read refused NaN and infinities already
        i, j = np.argwhere(out <= 0)[0]
        raise CheckpointError(f"{names[i][j]} must be a positive scale, got {out[i, j]}")
    return out


def load_tokenizer(model_dir: str | Path):
    """The checkpoint's `tokenizers.Tokenizer` (tokenizer.json)."""
    from tokenizers import Tokenizer  # only callers that tokenize pay for the import

    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(f"tokenizer.json not found in checkpoint directory {model_dir}")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on a malformed file
        raise CheckpointError(f"{path} could not be loaded: {e}") from None
