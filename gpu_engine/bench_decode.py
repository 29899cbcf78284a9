"""Decode time per token of the CUDA forward pass on real model shapes, beside its floor.

    python -m blink.gpu_engine.bench_decode [--shapes llama-3.2-1b llama-3.1-8b] [--batches 1 32]

Weights are random bf16 generated on the GPU (no hub is reachable here); the cost of a decode
step does not depend on their values. Each batch of B sequences at context length CONTEXT is
decoded by replaying the bucket-B forward graph (the graph the scheduler kernel launches), timed
with CUDA events, median of REPEATS runs of STEPS steps. The floor is the bytes of weights read
once per step over the measured device-to-device copy bandwidth.
"""
from __future__ import annotations

import argparse
import statistics

import numpy as np

from blink.gpu_engine.checkpoint import ModelConfig

SHAPES = {
    "llama-3.2-1b": ModelConfig(
        name="llama-3.2-1b", architecture="llama", vocab_size=128256, hidden_size=2048,
        intermediate_size=8192, num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
        rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        max_position_embeddings=131072, tie_word_embeddings=True, attention_bias=False,
        o_proj_bias=False, qk_norm=False, bos_token_id=128000, eos_token_ids=(128001,)),
    "llama-3.1-8b": ModelConfig(
        name="llama-3.1-8b", architecture="llama", vocab_size=128256, hidden_size=4096,
        intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
        rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        max_position_embeddings=131072, tie_word_embeddings=False, attention_bias=False,
        o_proj_bias=False, qk_norm=False, bos_token_id=128000, eos_token_ids=(128001,)),
}
CONTEXT = 512
STEPS = 50
REPEATS = 5


def weight_bytes(cfg: ModelConfig) -> int:
    H, I, V, L = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_layers
    per_layer = H * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * H + 3 * H * I + 2 * H
    embed = V * H * (1 if cfg.tie_word_embeddings else 2)
    return 2 * (L * per_layer + embed + H)


def copy_bandwidth() -> float:
    """Device-to-device copy rate in bytes/s, read plus written bytes counted."""
    from blink.gpu_engine import cuda_runtime as cr
    n = 4 << 30
    a, b = cr.DeviceBuffer(n), cr.DeviceBuffer(n)
    stream = cr.new_stream()
    times = []
    for _ in range(5):
        with cr.EventTimer(stream) as t:
            cr.check(cr.cu.cuMemcpyDtoDAsync(b.ptr, a.ptr, n, stream))
        times.append(t.seconds)
    a.free(), b.free()
    return 2 * n / statistics.median(times)


def bench_shape(cfg: ModelConfig, batches: list[int]) -> list[tuple[int, float]]:
    from blink.gpu_engine import cuda_runtime as cr
    from blink.gpu_engine.cuda_forward import CudaForward
    from blink.gpu_engine.forward_batch import ForwardBatch
    block = 16
    blocks_per_seq = CONTEXT // block + 1
    fwd = CudaForward.random_weights(cfg, seed=0, block_size=block,
                                     max_num_batched_tokens=max(batches),
                                     max_num_seqs=max(batches), max_model_len=CONTEXT + block,
                                     num_blocks=max(batches) * blocks_per_seq)
    out = []
    for b in batches:
        # b sequences, each decoding its token at position CONTEXT - 1
        tables = np.arange(b * blocks_per_seq, dtype=np.int32).reshape(b, blocks_per_seq)
        batch = ForwardBatch(np.full(b, 100, np.int32), np.full(b, CONTEXT - 1, np.int32),
                             np.arange(b + 1, dtype=np.int32), np.full(b, CONTEXT, np.int32),
                             tables, np.arange(b, dtype=np.int32))
        fwd.run(batch)  # writes the batch arrays; warms the graph up
        graph = fwd.graph_execs[fwd.bucket_for(b)]
        runs = []
        for _ in range(REPEATS):
            with cr.EventTimer(fwd.stream) as t:
                for _ in range(STEPS):
                    cr.check(cr.cu.cuGraphLaunch(graph, fwd.stream))
            runs.append(t.seconds / STEPS)
        out.append((b, statistics.median(runs)))
    fwd.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 32])
    args = parser.parse_args()
    bw = copy_bandwidth()
    print(f"bench copy bandwidth: {bw / 1e12:.2f} TB/s (device-to-device, read + write)")
    for name in args.shapes:
        cfg = SHAPES[name]
        floor = weight_bytes(cfg) / bw
        for b, seconds in bench_shape(cfg, args.batches):
            print(f"bench decode {name} batch {b}: {seconds * 1e3:.3f} ms/step "
                  f"(floor {floor * 1e3:.3f} ms = {weight_bytes(cfg) / 1e9:.2f} GB of weights; "
                  f"{floor / seconds:.0%} of floor), median of {REPEATS} x {STEPS} graph replays, "
                  f"context {CONTEXT}")


if __name__ == "__main__":
    main()
