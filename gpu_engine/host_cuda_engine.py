"""The host-driven ablation of the CUDA engine, for the benchmark's side-by-side runs.

The same kernels and forward graphs as the CUDA engine (CudaForward), driven the way host-driven
servers drive theirs: a Python loop on the CPU admits requests, makes the scheduling decisions
(scheduler.py, the decisions the scheduler kernel makes on the GPU), copies each step's batch
arrays to the device, launches the bucket's graph, waits for it and reads the sampled tokens
back. Only where the loop runs differs from `--engine cuda`, so the two side by side measure
what moving the loop onto the GPU buys, under a busy host CPU too (`blink bench --cpu-hog`).
"""
from __future__ import annotations

import logging
import time

from blink.gpu_engine.checkpoint import ModelConfig, load_weights
from blink.gpu_engine.cuda_forward import CudaForward
from blink.gpu_engine.forward_batch import ForwardBatch
from blink.gpu_engine.reference_engine import EngineConfig, ReferenceEngine
from blink.gpu_engine.sequence import Sequence
from blink.ring.layout import EngineKind

log = logging.getLogger("blink.engine")


class HostDrivenCudaEngine(ReferenceEngine):
    engine_kind = EngineKind.HOST_DRIVEN_CUDA

    def __init__(self, config: EngineConfig, *, gpu_memory_utilization: float = 0.9):
        self.gpu_memory_utilization = gpu_memory_utilization
        super().__init__(config)

    def _load_model(self, cfg: ModelConfig) -> int:
        config = self.config
        t0 = time.monotonic()
        weights = (None if config.load_format == "dummy" else
                   load_weights(config.model_dir, cfg, layers_on_demand=True))
        self.forward = CudaForward(
            cfg, weights, block_size=config.block_size, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.context_length, num_blocks=config.num_kv_blocks,
            gpu_memory_utilization=self.gpu_memory_utilization, gemm_tuning=config.gemm_tuning,
            held_sms=0, sm_count_target=config.sm_count_target,  # the host launches the graphs
            decode_weight_copy=config.decode_weight_copy, gemm_split_k=config.gemm_split_k,
            fine_buckets_from=config.fine_buckets_from,
            quantization=config.quantization_for(cfg), fp8_lm_head=config.lm_head_fp8_for(cfg),
            fp8_fast_accum=config.fp8_fast_accum, kv_cache_dtype=config.kv_cache_dtype,
            kv_scales=weights.kv_scales if weights is not None else None)
        log.info("host-driven CUDA engine: weights, KV cache (%d blocks) and %d forward graphs "
                 "ready in %.1f s", self.forward.num_blocks, len(self.forward.graph_execs),
                 time.monotonic() - t0)
        return self.forward.num_blocks

    def _forward_sample(self, batch: ForwardBatch, samplers: list[Sequence]) -> list[int]:
        params = [seq.params for seq in samplers]
        _, sampled = self.forward.run(
            batch, temperature=[p.temperature for p in params], top_p=[p.top_p for p in params],
            top_k=[p.top_k for p in params], seed=[p.seed for p in params],
            step=[len(seq.output) for seq in samplers], sampled_only=True)
        return [int(t) for t in sampled]

    def close(self) -> None:
        super().close()
        if getattr(self, "forward", None) is not None:
            self.forward.close()
            self.forward = None
