"""The NumPy float32 reference forward pass over a paged KV cache.

It is the oracle the GPU engine is tested against, and is itself tested against Hugging Face
transformers. Written for reading, not speed: batched matmuls over all tokens of a step, attention
one sequence at a time.

FP8 emulation (gpu_engine/fp8.py has the rules): FP8 weights are weights passed through
fp8.fp8_weights; kv_scales [num_layers, 2, num_kv_heads] stores every key and value as an E4M3
cache with those scales does (fp8_rounded_kv); fp8_activations rounds each projection's input
rows as the FP8 GEMMs of prefill-sized steps take them (a scale per token row; not those of the
projections an FP8 checkpoint keeps in bf16, weight_layout.served_bf16), and fp8_head_input
the LM head's as its FP8 GEMM takes them (more than 16 logit rows).
"""
from __future__ import annotations

import numpy as np

from .checkpoint import ModelConfig, ModelWeights, rope_inv_freq
from .forward_batch import ForwardBatch
from .fp8 import (calibration_count, calibration_tokens, fp8_rounded_kv, fp8_rounded_rows,
                  kv_scales_from_amax)
from .weight_layout import served_bf16


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    # x: [..., D], weight: [D] -> [..., D]
    variance = np.mean(x * x, axis=-1, keepdims=True)
    return weight * (x / np.sqrt(variance + np.float32(eps)))


def silu(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # exp(-x) overflows to inf for x < -88: silu -> -0, correct
        return x / (np.float32(1) + np.exp(-x))


def rotate_half(x: np.ndarray) -> np.ndarray:
    # x: [..., D] -> [..., D]; the HF Llama convention pairs dimension i with i + D/2.
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    # x: [T, heads, D], cos/sin: [T, D]
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


class ReferenceModel:
    def __init__(self, cfg: ModelConfig, weights: ModelWeights, num_blocks: int, block_size: int,
                 kv_scales: np.ndarray | None = None, fp8_activations: bool = False):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be > 0")
        self.cfg = cfg
        self.w = weights
        self.num_blocks = num_blocks
        self.block_size = block_size
        # FP8 emulation (module docstring): an E4M3 cache's scales, and the FP8 GEMMs' inputs
        self.kv_scales = None if kv_scales is None else np.asarray(kv_scales, np.float32)
        self.fp8_activations = fp8_activations
        self.fp8_head_input = False
        self.kv_amax: np.ndarray | None = None  # [L, 2, kv_heads] while calibrating
        shape = (cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        # k_cache, v_cache: [num_layers, num_blocks, block_size, num_kv_heads, head_dim]
        self.k_cache = np.zeros(shape, np.float32)
        self.v_cache = np.zeros(shape, np.float32)
        self.inv_freq = rope_inv_freq(cfg)  # [head_dim // 2]

    def _check(self, b: ForwardBatch) -> tuple[np.ndarray, np.ndarray]:
        """Validates the batch; returns each token's (kv block, row in block), both [T]."""
        T, S = b.num_tokens, b.num_seqs
        starts = np.asarray(b.seq_starts, np.int64)
        if S < 1 or starts[0] != 0 or starts[-1] != T or np.any(np.diff(starts) <= 0):
            raise ValueError(f"seq_starts {starts.tolist()} must rise strictly from 0 to {T}")
        if b.positions.shape != (T,) or b.context_lens.shape != (S,) or b.block_tables.ndim != 2 \
                or b.block_tables.shape[0] != S:
            raise ValueError("positions, context_lens or block_tables have the wrong shape")
        if np.any((b.token_ids < 0) | (b.token_ids >= self.cfg.vocab_size)):
            raise ValueError(f"token id outside the vocabulary [0, {self.cfg.vocab_size})")
        if np.any((b.logit_seqs < 0) | (b.logit_seqs >= S)):
            raise ValueError(f"logit_seqs {b.logit_seqs.tolist()} outside [0, {S})")
        seq_of_token = np.repeat(np.arange(S), np.diff(starts))  # [T]
        pos = b.positions.astype(np.int64)
        for s in range(S):
            p = pos[starts[s]:starts[s + 1]]
            if p[0] < 0 or np.any(np.diff(p) != 1) or b.context_lens[s] != p[-1] + 1:
                raise ValueError(f"sequence {s}: positions must be consecutive from >= 0 and "
                                 f"context_lens[s] = last position + 1")
            needed = (int(b.context_lens[s]) + self.block_size - 1) // self.block_size
            if needed > b.block_tables.shape[1]:
                raise ValueError(f"sequence {s} needs {needed} blocks, block table holds "
                                 f"{b.block_tables.shape[1]}")
            used = b.block_tables[s, :needed]
            if np.any((used < 0) | (used >= self.num_blocks)):
                raise ValueError(f"sequence {s}: block table entries {used.tolist()} outside "
                                 f"[0, {self.num_blocks})")
        blocks = b.block_tables[seq_of_token, pos // self.block_size].astype(np.int64)
        return blocks, pos % self.block_size

    # Queries per attention block: bounds the score matrix, and on_progress runs between
    # blocks, so the heartbeat moves during a long chunk over a long context (a 512-token chunk
    # at 23k keys took longer than the front end's liveness timeout for one layer).
    QUERY_BLOCK = 64

    def forward(self, batch: ForwardBatch, on_progress=None) -> np.ndarray:
        """Runs one step; returns logits [len(batch.logit_seqs), vocab] float32. on_progress()
        is called between layers and between attention's query blocks (liveness)."""
        on_progress = on_progress or (lambda: None)
        cfg, w = self.cfg, self.w
        blocks, rows = self._check(batch)
        T, D = batch.num_tokens, cfg.head_dim
        starts = batch.seq_starts

        # RoPE angles in float32, as transformers computes them.
        freqs = batch.positions.astype(np.float32)[:, None] * self.inv_freq[None, :]  # [T, D/2]
        emb = np.concatenate([freqs, freqs], axis=-1)  # [T, D]
        cos, sin = np.cos(emb), np.sin(emb)

        # the FP8 GEMMs' inputs (fp8_activations), else the values themselves
        gemm_input = fp8_rounded_rows if self.fp8_activations else (lambda a: a)
        x = w.embed[batch.token_ids]  # [T, H]
        for li, lw in enumerate(w.layers):
            on_progress()
            wide = served_bf16(lw.stored_wide)  # an FP8 checkpoint's projections kept in bf16

            def into(name, a, wide=wide):
                """Fused projection `name`'s input as its GEMM takes it."""
                return a if name in wide else gemm_input(a)
            h = into("wqkv", rms_norm(x, lw.input_norm, cfg.rms_norm_eps))
            q, k, v = h @ lw.q_proj.T, h @ lw.k_proj.T, h @ lw.v_proj.T
            if lw.q_bias is not None:
                q, k, v = q + lw.q_bias, k + lw.k_bias, v + lw.v_bias
            q = q.reshape(T, cfg.num_heads, D)
            k = k.reshape(T, cfg.num_kv_heads, D)
            v = v.reshape(T, cfg.num_kv_heads, D)
            if cfg.qk_norm:
                q = rms_norm(q, lw.q_norm, cfg.rms_norm_eps)
                k = rms_norm(k, lw.k_norm, cfg.rms_norm_eps)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

            # Write this step's keys and values first: attention then reads only the cache.
            if self.kv_amax is not None:  # calibrating: each head's largest |key|, |value|
                self.kv_amax[li, 0] = np.maximum(self.kv_amax[li, 0], np.abs(k).max((0, 2)))
                self.kv_amax[li, 1] = np.maximum(self.kv_amax[li, 1], np.abs(v).max((0, 2)))
            if self.kv_scales is not None:
                k = fp8_rounded_kv(k, self.kv_scales[li, 0])
                v = fp8_rounded_kv(v, self.kv_scales[li, 1])
            self.k_cache[li, blocks, rows] = k
            self.v_cache[li, blocks, rows] = v

            attn = np.empty((T, cfg.num_heads, D), np.float32)
            for s in range(batch.num_seqs):
                for a in range(starts[s], starts[s + 1], self.QUERY_BLOCK):
                    b = min(a + self.QUERY_BLOCK, starts[s + 1])
                    keys = int(batch.positions[b - 1]) + 1  # causal: the block's last query
                    attn[a:b] = self._attend(li, q[a:b], batch.positions[a:b],
                                             batch.block_tables[s], keys)
                    on_progress()
            o = into("wo", attn.reshape(T, cfg.q_size)) @ lw.o_proj.T
            x = x + (o + lw.o_bias if lw.o_bias is not None else o)

            h = into("wgu", rms_norm(x, lw.post_attention_norm, cfg.rms_norm_eps))
            x = x + into("wdown", silu(h @ lw.gate_proj.T) * (h @ lw.up_proj.T)) @ lw.down_proj.T

        last = starts[batch.logit_seqs + 1] - 1  # [L] each wanted sequence's last token
        h = rms_norm(x[last], w.final_norm, cfg.rms_norm_eps)
        if self.fp8_head_input:
            h = fp8_rounded_rows(h)
        return h @ w.lm_head.T  # [L, V]

    def calibrate_kv_scales(self, tokens: np.ndarray | None = None) -> np.ndarray:
        """An E4M3 cache's scales from one prefill of `tokens` (default fp8.calibration_tokens,
        as many as the model's context and the cache take, up to 512; an engine passes its own,
        fp8.calibration_count) with the cache unrounded, as CudaForward's calibrate_kv_scales
        sets them; sets and returns them, [num_layers, 2, num_kv_heads]."""
        cfg = self.cfg
        if tokens is None:
            cache_tokens = self.num_blocks * self.block_size
            count = calibration_count(cache_tokens, cfg.max_position_embeddings, cache_tokens)
            tokens = calibration_tokens(cfg.vocab_size, count)
        n = len(tokens)
        batch = ForwardBatch(np.asarray(tokens, np.int32), np.arange(n, dtype=np.int32),
                             np.array([0, n], np.int32), np.array([n], np.int32),
                             np.arange(-(-n // self.block_size), dtype=np.int32)[None, :],
                             np.zeros(1, np.int32))
        self.kv_scales = None
        self.kv_amax = np.zeros((cfg.num_layers, 2, cfg.num_kv_heads), np.float32)
        try:
            self.forward(batch)
            self.kv_scales = kv_scales_from_amax(self.kv_amax)
        finally:
            self.kv_amax = None
        return self.kv_scales

    def _attend(self, layer: int, q: np.ndarray, positions: np.ndarray, block_table: np.ndarray,
                context_len: int) -> np.ndarray:
        # q: [n, num_heads, D] one sequence's queries at `positions` [n]; block_table: [max_blocks]
        # -> [n, num_heads, D]. Causal: the query at position p reads cache positions 0..p.
        cfg = self.cfg
        kv_pos = np.arange(context_len)
        blk, row = block_table[kv_pos // self.block_size], kv_pos % self.block_size
        k = self.k_cache[layer, blk, row]  # [C, kv_heads, D]
        v = self.v_cache[layer, blk, row]
        n, group = q.shape[0], cfg.num_heads // cfg.num_kv_heads
        # GQA: query head h uses kv head h // group (transformers' repeat_kv order).
        qg = q.reshape(n, cfg.num_kv_heads, group, cfg.head_dim)
        scores = np.einsum("nkgd,ckd->kgnc", qg, k) * np.float32(cfg.head_dim ** -0.5)
        scores = np.where(kv_pos[None, :] <= positions[:, None], scores, -np.inf)  # [.., n, C]
        scores = scores - scores.max(axis=-1, keepdims=True)
        p = np.exp(scores)
        p /= p.sum(axis=-1, keepdims=True)
        out = np.einsum("kgnc,ckd->nkgd", p, v)
        return out.reshape(n, cfg.num_heads, cfg.head_dim)
