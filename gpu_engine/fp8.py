"""FP8 on the host: the E4M3 format, per-row quantization and the KV cache's per-head scales.

E4M3 here is the OCP `e4m3fn` format the H100/H200 tensor cores and `cvt` instructions use (and
torch's float8_e4m3fn): 1 sign, 4 exponent bits (bias 7), 3 mantissa bits, no infinities, one
NaN code per sign (0x7F, 0xFF), largest finite 448, subnormals down to 2^-9. Every rule below is
the one the GPU kernels follow, so NumPy reproduces their quantized values bit for bit:

- encoding rounds to nearest, ties to even, and saturates at +-448 (`cvt.rn.satfinite`);
- a row [K] is quantized with one float32 scale: amax = max |x|, scale = amax / 448 and
  q = e4m3(x * (448 / amax)), both divisions and the product rounded to float32 (a row of
  zeros: scale 1); its value is q * scale. Weights get one scale per output row (per output
  channel), activations one per token row (csrc/quantize.cuh QuantizeRowCta);
- keys and values are stored as e4m3(v * inv_scale) with one static scale per (layer, KV head)
  (kv_scales), set at start-up from the checkpoint's k_scale / v_scale, or calibrated.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from .demo_model import bf16_rounded
from .weight_layout import FUSED_PROJECTIONS, served_as_stored, served_bf16

E4M3_MAX = 448.0
E4M3_NAN = 0x7F
# Keys and values are scaled so that the calibration's largest |value| lands at this fraction
# of E4M3_MAX: a later prompt may run up to twice as far before values saturate.
KV_HEADROOM = 2.0


def _e4m3_table() -> np.ndarray:
    """[256] float32: the value of every E4M3 code (NaN for 0x7F and 0xFF)."""
    code = np.arange(256)
    sign = np.where(code & 0x80, -1.0, 1.0)
    exp, man = (code >> 3) & 0xF, code & 0x7
    value = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1 + man / 8.0) * 2.0 ** (exp - 7.0))
    value = sign * value
    value[(code & 0x7F) == E4M3_NAN] = np.nan
    return value.astype(np.float32)


E4M3_VALUES = _e4m3_table()
_POSITIVE = E4M3_VALUES[:E4M3_NAN].astype(np.float64)  # codes 0 .. 126: increasing


def e4m3_to_float32(bits: np.ndarray) -> np.ndarray:
    """E4M3 codes (uint8) -> their float32 values (exact)."""
    return E4M3_VALUES[np.asarray(bits, np.uint8)]


def float32_to_e4m3(x: np.ndarray) -> np.ndarray:
    """float32 -> E4M3 codes (uint8): round to nearest even, saturate at +-448, NaN -> 0x7F."""
    x = np.asarray(x, np.float32)
    a = np.abs(x).astype(np.float64)
    hi = np.searchsorted(_POSITIVE, a, side="left").clip(1, E4M3_NAN - 1)  # _POSITIVE[hi] >= a
    lo = hi - 1
    d_lo, d_hi = a - _POSITIVE[lo], _POSITIVE[hi] - a
    # the nearer code; at a tie the even one (its mantissa's last bit is the code's)
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    code = np.where(pick_hi, hi, lo)
    code = np.where(a >= E4M3_MAX, E4M3_NAN - 1, code)  # saturate (satfinite)
    code = np.where(a == 0, 0, code)
    code = (code | np.where(np.signbit(x), 0x80, 0)).astype(np.uint8)
    return np.where(np.isnan(x), np.uint8(E4M3_NAN), code).astype(np.uint8)


def row_scales(amax: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(scale, inverse) float32 per row from its max |x|: amax / 448 and 448 / amax, or 1 and 1
    for a row of zeros."""
    amax = np.asarray(amax, np.float32)
    live = amax > 0
    safe = np.where(live, amax, np.float32(1))
    scale = np.where(live, safe / np.float32(E4M3_MAX), np.float32(1)).astype(np.float32)
    inverse = np.where(live, np.float32(E4M3_MAX) / safe, np.float32(1)).astype(np.float32)
    return scale, inverse


def quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [N, K] -> (codes [N, K] uint8, scale [N] float32): one scale per row, as the GPU's
    QuantizeRowCta computes them."""
    x = np.asarray(x, np.float32)
    scale, inverse = row_scales(np.abs(x).max(axis=-1))
    return float32_to_e4m3(x * inverse[..., None]), scale


def dequantize_rows(codes: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """(codes [N, K], scale [N]) -> float32 [N, K]."""
    return e4m3_to_float32(codes) * np.asarray(scale, np.float32)[..., None]


def fp8_rounded_rows(x: np.ndarray) -> np.ndarray:
    """x [N, K] as FP8 with a scale per row gives it back: what the GPU's FP8 weights hold."""
    return dequantize_rows(*quantize_rows(x))


def kv_scales_from_amax(amax: np.ndarray) -> np.ndarray:
    """Per-head KV scales [..] float32 from the calibration's max |value| of each head: the
    largest value lands at E4M3_MAX / KV_HEADROOM; a head that saw only zeros gets 1."""
    amax = np.asarray(amax, np.float32)
    return np.where(amax > 0, amax * np.float32(KV_HEADROOM / E4M3_MAX),
                    np.float32(1)).astype(np.float32)


def per_head_kv_scales(scales: np.ndarray, num_kv_heads: int) -> np.ndarray:
    """KV scales as [num_layers, 2, num_kv_heads] float32: given so, or [num_layers, 2] (one for
    a layer's keys, one for its values: a checkpoint's k_scale, v_scale) repeated per head."""
    scales = np.asarray(scales, np.float32)
    return np.repeat(scales[:, :, None], num_kv_heads, axis=2) if scales.ndim == 2 else scales


def fp8_rounded_kv(v: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """v [..., kv_heads, D] stored in an FP8 KV cache with per-head `scale` [kv_heads] and read
    back: e4m3(v * (1 / scale)) * scale, the inverse rounded to float32 first, as the kernels
    take it."""
    scale = np.asarray(scale, np.float32)[..., None]
    inverse = (np.float32(1) / scale).astype(np.float32)
    return e4m3_to_float32(float32_to_e4m3(np.asarray(v, np.float32) * inverse)) * scale


CALIBRATION_TOKENS = 512  # the KV-scale calibration prompt's length, where the engine takes it


def calibration_count(max_step_tokens: int, context_length: int, cache_tokens: int) -> int:
    """How many calibration tokens an engine prefills: CALIBRATION_TOKENS, or fewer where one
    step, the served context or the KV cache holds fewer. Every engine passes its own limits, so
    engines configured alike calibrate on the same prompt."""
    return min(CALIBRATION_TOKENS, max_step_tokens, context_length, cache_tokens)


def calibration_tokens(vocab_size: int, count: int = CALIBRATION_TOKENS,
                       seed: int = 0) -> np.ndarray:
    """The token ids of the KV-scale calibration prompt: `count` seeded random ids (the same on
    every engine, so CPU and GPU calibrate on the same input)."""
    return np.random.default_rng(seed).integers(0, vocab_size, count).astype(np.int32)


def fp8_weights(weights, lm_head: bool = True):
    """ModelWeights with every layer's projections as FP8 weights hold them (fp8_rounded_rows
    of their bf16 values: the GPU quantizes its bf16 copies, a scale per output row; an FP8
    checkpoint's projections stored with a scale a row keep their codes and scales,
    LayerWeights.fp8_codes, whose values the loader gave, and those it stores wider are served
    in bf16, weight_layout.served_bf16), and the LM head too (lm_head:
    CudaForward's fp8_lm_head); the embedding and the norms unchanged (they stay bf16 on the
    GPU; a tied embedding's table keeps its values, the LM head's copy is rounded). The CPU
    engine's emulation of --quantization fp8, and the GPU tests' reference. (The bf16 step
    matters where the values are not bf16 already: a float32 or float16 checkpoint's, and a
    block-scaled FP8 checkpoint's codes times its scales.)"""
    def quantized(x):
        return fp8_rounded_rows(bf16_rounded(x))

    def rounded(lw):
        kept = {part for name in served_as_stored(lw) for part in FUSED_PROJECTIONS[name]}
        wide = {part for name in served_bf16(lw.stored_wide)
                for part in FUSED_PROJECTIONS[name]}
        return {part: bf16_rounded(getattr(lw, part)) if part in wide
                else quantized(getattr(lw, part))
                for parts in FUSED_PROJECTIONS.values() for part in parts if part not in kept}

    layers = [dataclasses.replace(lw, **rounded(lw)) for lw in weights.layers]
    head = quantized(weights.lm_head) if lm_head else weights.lm_head
    return dataclasses.replace(weights, layers=layers, lm_head=head)


FP8_WEIGHTS_CC = (9, 0)  # cuBLASLt's FP8 GEMMs with per-row (outer-vector) scales: Hopper
FP8_KV_MIN_CC = (8, 9)  # cvt between e4m3x2 and f16x2 / f32x2


def fp8_refusal(quantization: str | None, kv_cache_dtype: str,
                compute_capability: tuple[int, int]) -> str | None:
    """Why a GPU of this compute capability cannot run these FP8 options (one line, for the
    start-up check), or None where it can."""
    cc = "{}.{}".format(*compute_capability)
    if quantization == "fp8" and tuple(compute_capability) != FP8_WEIGHTS_CC:
        return (f"--quantization fp8 needs a Hopper GPU (compute capability 9.0: cuBLASLt's FP8 "
                f"GEMMs with per-row scales); this one is {cc}")
    if kv_cache_dtype == "fp8" and tuple(compute_capability) < FP8_KV_MIN_CC:
        return (f"--kv-cache-dtype fp8 needs a GPU with FP8 conversions (compute capability 8.9 "
                f"or later); this one is {cc}")
    return None
