"""How the GPU engine lays a layer's weights out, from a checkpoint's projections: the fused
q|k|v rows in the RoPE pair layout, gate|up interleaved for the fused SiLU, an FP8 checkpoint's
own codes fused the same way, and which projections such a checkpoint keeps wider than E4M3.
Host-side NumPy (CudaForward uploads the results), so the CPU tests check the layouts against
the CPU engine's weights."""
from __future__ import annotations

from collections.abc import Collection

import numpy as np

from .checkpoint import LayerWeights


def interleave_gate_up(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """[I, H] gate_proj and up_proj -> [2I, H] in 16-row groups: gate rows 16b..16b+15, then up
    rows 16b..16b+15, for b = 0 .. I/16 - 1. One skinny-linear CTA then holds both halves of
    16 features and applies SiLU(gate) * up itself; silu_mul reads the same layout."""
    inter, hidden = gate.shape
    if inter % 16:
        raise ValueError(f"intermediate size {inter} must be a multiple of 16")
    return np.stack([gate.reshape(inter // 16, 16, hidden), up.reshape(inter // 16, 16, hidden)],
                    axis=1).reshape(2 * inter, hidden)


# CudaForward's fused projections and the checkpoint projections (LayerWeights' names) in each
FUSED_PROJECTIONS = {"wqkv": ("q_proj", "k_proj", "v_proj"), "wo": ("o_proj",),
                     "wgu": ("gate_proj", "up_proj"), "wdown": ("down_proj",)}


def served_as_stored(lw: LayerWeights) -> list[str]:
    """The fused projections (FUSED_PROJECTIONS) an FP8 engine serves with the checkpoint's
    own codes and scales: those all of whose parts were stored with a scale a row
    (LayerWeights.fp8_codes). A fused projection with one part stored otherwise (a block
    scale, or bf16 beside E4M3 parts) is quantized again per row whole, on the GPU as on the
    CPU."""
    return [name for name, parts in FUSED_PROJECTIONS.items()
            if all(part in lw.fp8_codes for part in parts)]


def served_bf16(stored_wide: Collection[str]) -> list[str]:
    """The fused projections (FUSED_PROJECTIONS) an FP8 engine serves in bf16, as an FP8
    checkpoint stores them: those all of whose parts are among `stored_wide`, a layer's
    projections stored wider than E4M3 (LayerWeights.stored_wide; Meta's Llama-3.1 FP8
    releases keep every self_attn projection in bf16). Their inputs are not rounded to E4M3
    either, on the GPU as on the CPU."""
    return [name for name, parts in FUSED_PROJECTIONS.items()
            if all(part in stored_wide for part in parts)]


def rounded_wide(stored_wide: Collection[str]) -> list[str]:
    """The projections among `stored_wide` that an FP8 engine rounds to E4M3 all the same:
    parts of a fused projection whose other parts are E4M3 (a fused projection has one
    format)."""
    bf16 = served_bf16(stored_wide)
    return [part for name, parts in FUSED_PROJECTIONS.items() if name not in bf16
            for part in parts if part in stored_wide]


def stored_fp8(lw: LayerWeights, qkv_order: np.ndarray) -> dict[str, tuple[np.ndarray,
                                                                         np.ndarray]]:
    """The codes and row scales of the fused projections served_as_stored names, fused as
    CudaForward fuses its projections (wqkv in qkv_order, rope_pair_order's; wgu interleaved):
    what the GPU uploads, whose values fp8.fp8_weights keeps on the CPU."""
    fused = {}
    for name in served_as_stored(lw):
        parts = FUSED_PROJECTIONS[name]
        codes = [lw.fp8_codes[a][0] for a in parts]
        scales = [lw.fp8_codes[a][1].astype(np.float32)[:, None] for a in parts]
        if name == "wqkv":
            codes, scales = np.concatenate(codes)[qkv_order], np.concatenate(scales)[qkv_order]
        elif name == "wgu":
            codes, scales = interleave_gate_up(*codes), interleave_gate_up(*scales)
        else:
            codes, scales = codes[0], scales[0]
        fused[name] = (np.ascontiguousarray(codes), np.ascontiguousarray(scales[:, 0]))
    return fused


def rope_pair_order(num_heads: int, num_kv_heads: int, head_dim: int) -> np.ndarray:
    """Row order of the fused q|k|v projection in the RoPE pair layout (csrc/rope.cuh): within
    every q and k head, pair j's two rows (dimensions j and j + head_dim / 2) sit 8 apart in
    one 16-row tile; v heads keep their order. new_rows = rows[order]."""
    if head_dim % 16:
        raise ValueError(f"head_dim {head_dim} must be a multiple of 16")
    half = head_dim // 2
    j = np.arange(half)
    within = np.empty(head_dim, np.int64)
    within[16 * (j // 8) + j % 8] = j            # RopePairRow(j) holds dimension j
    within[16 * (j // 8) + j % 8 + 8] = j + half  # 8 rows later, its partner
    rotated = num_heads + num_kv_heads
    order = [h * head_dim + within for h in range(rotated)]
    order.append(np.arange(rotated * head_dim, (rotated + num_kv_heads) * head_dim))
    return np.concatenate(order)
