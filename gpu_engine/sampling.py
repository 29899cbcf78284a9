"""Token sampling: greedy, temperature, top-k, top-p, with a per-request counter-based RNG.

The random number for a request's n-th generated token depends only on (seed, n), never on
which other requests share the batch, so the same seed gives the same text under any load, and
the GPU kernel can draw the same number with the same 64-bit integer mix.
"""
from __future__ import annotations

import numpy as np

from blink.gpu_engine.sequence import SamplingParams

_MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform(seed: int, step: int) -> float:
    """A float in [0, 1) from the top 53 bits of splitmix64(seed mixed with step)."""
    return (splitmix64(splitmix64(seed & _MASK64) ^ step) >> 11) * (1.0 / (1 << 53))


def _no_nan(logits: np.ndarray) -> np.ndarray:
    """NaN never wins, as in the GPU kernels (argmax.cuh, sampling.cuh): it counts as -inf."""
    return np.where(np.isnan(logits), -np.inf, logits) if np.isnan(logits).any() else logits


def sampling_distribution(logits: np.ndarray, params: SamplingParams
                          ) -> tuple[np.ndarray, np.ndarray]:
    """The tokens a non-greedy request can draw and their probabilities, in draw order:
    softmax(logits / temperature) over the top_k highest (0: all), then the smallest prefix
    whose mass reaches top_p (the token crossing it included), renormalized. Tokens tied with
    the last one kept at either cut-off are kept too, as the GPU kernel cuts on a logit
    threshold (sampling.cuh) and transformers' and vLLM's top-k keep ties."""
    scaled = _no_nan(logits).astype(np.float64) / params.temperature
    order = np.argsort(-scaled, kind="stable")  # descending; ties keep the lower id first
    if 0 < params.top_k < len(order):
        order = order[scaled[order] >= scaled[order[params.top_k - 1]]]
    probs = np.exp(scaled[order] - scaled[order[0]])
    probs /= probs.sum()
    if params.top_p < 1.0:
        keep = min(int(np.searchsorted(np.cumsum(probs), params.top_p)) + 1, len(order))
        keep = int(np.count_nonzero(scaled[order] >= scaled[order[keep - 1]]))
        probs = probs[:keep] / probs[:keep].sum()
        order = order[:keep]
    return order, probs


def sample_token(logits: np.ndarray, params: SamplingParams, step: int) -> int:
    """logits: [vocab] float32. `step` is the index of the token being generated (0-based)."""
    if params.temperature == 0.0 or params.top_k == 1:
        return int(np.argmax(_no_nan(logits)))
    order, probs = sampling_distribution(logits, params)
    u = uniform(params.seed, step)
    idx = int(np.searchsorted(np.cumsum(probs), u, side="right"))
    return int(order[min(idx, len(order) - 1)])
