"""What one forward step must read from device memory, for the benchmarks' floors.

A decode step is bound by memory: every linear weight and the LM head are read once per step
whatever the batch, the embedding table only one row per token, and attention reads each
sequence's keys and values once. Floor = those bytes over the device-to-device copy rate
measured in the same run (read plus written bytes counted, so the copy rate is the rate a
kernel that streams memory can reach). Activations are left out: at decode sizes they are
kilobytes per layer, and they stay in L2.
"""
from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from .checkpoint import ModelConfig

BF16_BYTES = 2


def projection_weights(cfg: ModelConfig) -> dict[str, int]:
    """Weights (elements) of each projection of one layer (fused as the engine stores them),
    and of the LM head."""
    H, I = cfg.hidden_size, cfg.intermediate_size
    return {"qkv": H * (cfg.q_size + 2 * cfg.kv_size), "o": cfg.q_size * H,
            "gate_up": 2 * H * I, "down": I * H, "lm_head": cfg.vocab_size * H}


def projection_rows(cfg: ModelConfig) -> dict[str, int]:
    """Output rows of each projection of one layer (the FP8 weights' float32 scales)."""
    H, I = cfg.hidden_size, cfg.intermediate_size
    return {"qkv": cfg.q_size + 2 * cfg.kv_size, "o": H, "gate_up": 2 * I, "down": H}


def layer_projection_weights(cfg: ModelConfig) -> int:
    """Weights (elements) of one layer's qkv, o, gate|up and down projections."""
    w = projection_weights(cfg)
    return w["qkv"] + w["o"] + w["gate_up"] + w["down"]


def layer_vector_weights(cfg: ModelConfig) -> int:
    """Weights (elements) of one layer's vectors, bf16 in every format: the two RMSNorms', the
    q/k/v biases (Qwen2, attention_bias), the o projection's bias and Qwen3's q and k norms."""
    return (2 * cfg.hidden_size
            + (cfg.q_size + 2 * cfg.kv_size if cfg.attention_bias else 0)
            + (cfg.hidden_size if cfg.o_proj_bias else 0)
            + (2 * cfg.head_dim if cfg.qk_norm else 0))


def linear_weight_bytes(cfg: ModelConfig, fp8: bool = False,
                        lm_head_fp8: bool | None = None,
                        kept_bf16: Collection[str] = ()) -> int:
    """Every projection of every layer, the LM head and the vector weights (norms, biases), in
    bf16; fp8: the projections as E4M3 codes and a float32 scale per output row, but those of
    kept_bf16 (projection_weights' keys: an FP8 checkpoint's projections kept in bf16, every
    layer's), and the LM head too unless lm_head_fp8 is False (CudaForward's fp8_lm_head)."""
    w, rows = projection_weights(cfg), projection_rows(cfg)
    per_layer = sum(w[p] + 4 * rows[p] if fp8 and p not in kept_bf16 else BF16_BYTES * w[p]
                    for p in rows) + BF16_BYTES * layer_vector_weights(cfg)
    lm_head = (w["lm_head"] + 4 * cfg.vocab_size if fp8 and lm_head_fp8 is not False
               else BF16_BYTES * w["lm_head"])
    return cfg.num_layers * per_layer + lm_head + BF16_BYTES * cfg.hidden_size


def kv_bytes_per_token(cfg: ModelConfig, fp8: bool = False) -> int:
    """Keys and values of one token over all layers, bf16 (fp8: E4M3 codes, one byte each)."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * (1 if fp8 else BF16_BYTES)


@dataclass(frozen=True)
class StepBytes:
    weights: int      # linear weights + LM head + norms, once per step
    embedding: int    # one embedding row per token of the step
    kv: int           # the keys and values the step's tokens attend to

    @property
    def total(self) -> int:
        return self.weights + self.embedding + self.kv

    def describe(self) -> str:
        return (f"{self.weights / 1e9:.2f} GB weights + {self.kv / 1e9:.2f} GB KV"
                + (f" + {self.embedding / 1e6:.1f} MB embedding rows" if self.embedding >= 1e5
                   else ""))


def decode_step_bytes(cfg: ModelConfig, context_lens: list[int], weights_fp8: bool = False,
                      kv_fp8: bool = False, lm_head_fp8: bool | None = None,
                      kept_bf16: Collection[str] = ()) -> StepBytes:
    """One decode step of len(context_lens) sequences, each attending to its context_lens[i]
    keys (the new token's included); FP8 weights (the LM head's too unless lm_head_fp8 is
    False, the projections of kept_bf16 excepted) and an E4M3 KV cache counted at the bytes
    their kernels read."""
    return StepBytes(weights=linear_weight_bytes(cfg, weights_fp8, lm_head_fp8, kept_bf16),
                     embedding=len(context_lens) * cfg.hidden_size * BF16_BYTES,
                     kv=sum(context_lens) * kv_bytes_per_token(cfg, kv_fp8))


@dataclass(frozen=True)
class StepFlops:
    projections: int  # every linear layer over the step's tokens, the LM head over its logit rows
    attention: int    # S = Q K^T and O = P V, each token over the keys it sees (causal)

    @property
    def total(self) -> int:
        return self.projections + self.attention


def step_flops(cfg: ModelConfig, positions: list[int], logit_rows: int) -> StepFlops:
    """Multiply-add work (2 FLOPs each) of one step over tokens at `positions` (a token at
    position p attends to p + 1 keys), `logit_rows` of them through the LM head: what bounds a
    prefill chunk, where the weights are read once for thousands of tokens."""
    w = projection_weights(cfg)
    per_token = w["qkv"] + w["o"] + w["gate_up"] + w["down"]
    keys = sum(int(p) + 1 for p in positions)  # Python ints: numpy's int32 would overflow
    return StepFlops(
        projections=2 * (len(positions) * cfg.num_layers * per_token + logit_rows * w["lm_head"]),
        attention=4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * keys)
