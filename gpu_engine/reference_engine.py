"""The CPU reference engine: serves the ring exactly as the GPU engine does, in NumPy.

Its loop is the scheduler kernel's loop written in Python: consume slots, honour cancels,
schedule a step, run the forward pass, sample, publish tokens, retire finished sequences. The
step's decisions are step_core.StepCore's (shared with the scheduler parity test's replay);
this class adds the ring's I/O, the counters and the forward pass.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from blink.gpu_engine.block_manager import KvBlockPool
from blink.gpu_engine.checkpoint import (PROJECTION_TENSORS, ModelConfig, load_config,
                                         load_weights, unquantized_linear_weights)
from blink.gpu_engine.engine_layout import KvCacheTooLarge
from blink.gpu_engine.forward_batch import ForwardBatch
from blink.gpu_engine.fp8 import (calibration_count, calibration_tokens, fp8_weights,
                                  per_head_kv_scales)
from blink.gpu_engine.reference_model import ReferenceModel
from blink.gpu_engine.ring_server import ModelLimits, RingServer
from blink.gpu_engine.sampling import sample_token
from blink.gpu_engine.scheduler import Scheduler, SchedulerConfig, StepPlan
from blink.gpu_engine.sequence import Sequence
from blink.gpu_engine.step_core import StepCore, samples_now
from blink.gpu_engine.weight_layout import rounded_wide
from blink.ring.layout import EngineKind, EngineState, FinishReason, RingGeometry
from blink.ring.lifecycle import EngineStopSignals, SystemdNotify
from blink.ring.shm import unlink_created_segments

log = logging.getLogger("blink.engine")


@dataclass(frozen=True)
class EngineConfig:
    model_dir: Path
    ring_name: str
    num_slots: int = 128              # request slots in the ring: concurrent requests at most
    block_size: int = 16              # tokens per KV block
    kv_cache_bytes: int = 256 << 20   # KV cache size; num_kv_blocks overrides it
    num_kv_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    idle_sleep_s: float = 0.0002      # poll interval once idle; doubles up to idle_sleep_max_s
    idle_sleep_max_s: float = 0.005   # (an idle CPU engine polled at 28% of a core at 0.2 ms)
    # "auto": the checkpoint's weights; "dummy": random weights generated on the GPU in the
    # checkpoint's shapes (CUDA engine only; for benchmarks of real shapes without the weights)
    load_format: str = "auto"
    # CUDA engines: time cuBLAS's own GEMM choice against cuBLASLt's candidates at start-up and
    # keep the fastest per shape (gpu_engine/gemm_tuning.py); False: cuBLAS's own everywhere
    gemm_tuning: bool = True
    # CUDA engines: the tuner also times split-K variants of cuBLASLt's first candidates for
    # GEMMs of up to 256 rows (Cublas.split_k; off: no step gained on the H200, round 34)
    gemm_split_k: bool = False
    # CUDA engines: the forward graphs' token buckets go four an octave from this many tokens
    # (engine_layout.default_buckets; 64 adds graphs of 80, 96 and 112 tokens)
    fine_buckets_from: int = 128
    # CUDA engines: the SMs the forward pass's kernels are sized for (cuBLAS's SM count target,
    # the attention grids); None: the device's less those the scheduler kernel holds; 0: all
    sm_count_target: int | None = None
    # CUDA engines: the skinny decode kernels read their own tiled copy of each layer's
    # projections and of the LM head, which streams faster than the row-major weights cuBLAS
    # reads, at the cost of those weights' memory a second time (CudaForward's
    # decode_weight_copy)
    decode_weight_copy: bool = True
    # "fp8": the projections' weights as E4M3 with a scale per output row (also what an FP8
    # checkpoint's config asks for); the CPU engine emulates their rounding (gpu_engine/fp8.py);
    # "none": an FP8 checkpoint's values served in bf16 (float32 on the CPU engine)
    quantization: str | None = None
    # with FP8 weights: the LM head as E4M3 with a scale per vocabulary row too (False: bf16);
    # None: as the weights come (lm_head_fp8_for)
    fp8_lm_head: bool | None = None
    # with FP8 weights: cuBLASLt's FP8 GEMMs (prefill-sized steps) accumulate in the tensor
    # cores' own precision, not promoted to fp32 as they go (False: promoted; CUDA engines)
    fp8_fast_accum: bool = True
    # "fp8": an E4M3 KV cache with a scale per (layer, KV head), from the checkpoint or
    # calibrated at start-up; "auto": bf16 (the CPU engine emulates the E4M3 one's rounding)
    kv_cache_dtype: str = "auto"
    # full KV blocks are kept after their sequences finish and shared by later prompts with the
    # same prefix (block_manager.py); False: every prompt is computed whole
    prefix_caching: bool = True

    def __post_init__(self):
        if self.num_slots < 1 or self.block_size < 1:
            raise ValueError("num_slots and block_size must be >= 1")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.quantization not in (None, "fp8", "none"):
            raise ValueError(f"quantization must be None, 'fp8' or 'none', got "
                             f"{self.quantization!r}")
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8', got "
                             f"{self.kv_cache_dtype!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be >= 1")

    def quantization_for(self, cfg: ModelConfig) -> str | None:
        """The weights' format served: --quantization, or the checkpoint's own ("none": None,
        whatever the checkpoint holds)."""
        if self.quantization == "none":
            return None
        return self.quantization or cfg.quantization

    def lm_head_fp8_for(self, cfg: ModelConfig) -> bool:
        """Whether the LM head is served as E4M3 with FP8 weights: --fp8-lm-head or
        --no-fp8-lm-head, else as the weights come: FP8 where they are converted (from a wider
        checkpoint, or --load-format dummy), as an FP8 checkpoint stores it otherwise (nearly
        every release keeps it bf16, as transformers and vLLM then serve it). Says how the
        checkpoint's projections stored wider are served (report_wide_projections)."""
        if self.quantization_for(cfg) != "fp8":
            return False
        if cfg.quantization != "fp8" or self.load_format == "dummy":
            return self.fp8_lm_head is not False
        wider = unquantized_linear_weights(self.model_dir, cfg)
        report_wide_projections(cfg, wider)
        if self.fp8_lm_head is not None:
            return self.fp8_lm_head
        return "lm_head.weight" not in wider


def report_wide_projections(cfg: ModelConfig, wider: list[str]) -> None:
    """Says at start-up how an FP8 engine serves the projections an FP8 checkpoint stores
    wider than E4M3 (`wider`, unquantized_linear_weights'): in bf16 as stored where a fused
    projection (q|k|v, o, gate|up, down) is wide whole, else rounded to E4M3 with the fused
    projection's E4M3 parts, with a warning (a fused projection has one format)."""
    served, rounded, wider = [], [], set(wider)
    for i in range(cfg.num_layers):
        names = {attr: f"model.layers.{i}.{tensor}.weight"
                 for attr, tensor in PROJECTION_TENSORS.items()}
        wide = {attr for attr, name in names.items() if name in wider}
        rounded_here = rounded_wide(wide)
        rounded += [names[attr] for attr in rounded_here]
        served += [names[attr] for attr in names if attr in wide and attr not in rounded_here]

    def listed(names):
        return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    if served:
        log.info("%d of the %d projection weights of this FP8 checkpoint are stored wider than "
                 "E4M3 (the modules its quantizer left out: %s): served in bf16, as stored",
                 len(served), 7 * cfg.num_layers, listed(served))
    if rounded:
        log.warning("%d of the %d projection weights of this FP8 checkpoint are stored wider "
                    "than E4M3 beside E4M3 parts of the same fused projection (q|k|v or "
                    "gate|up, which has one format: %s); they are served as E4M3 with a scale "
                    "per row like those (--quantization none serves every weight in bf16)",
                    len(rounded), 7 * cfg.num_layers, listed(rounded))


def served_context_length(config: EngineConfig, cfg: ModelConfig) -> int:
    """--max-model-len, at most the model's context (saying so when it asked for more)."""
    limit = cfg.max_position_embeddings
    if config.max_model_len and config.max_model_len > limit:
        log.warning("--max-model-len %d exceeds %s's context of %d tokens: serving %d",
                    config.max_model_len, cfg.name, limit, limit)
    return min(config.max_model_len or limit, limit)


def kv_bytes_per_block(cfg: ModelConfig, block_size: int) -> int:
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * 4  # K and V, f32


def warn_if_kv_cache_short(num_blocks: int, block_size: int, context_length: int) -> None:
    """A KV cache smaller than one sequence of the served context serves only shorter requests
    (the longer ones are INVALID_ARGUMENT, each): said once at start-up, where it was silent."""
    if num_blocks * block_size < context_length:
        log.warning("the KV cache holds %d tokens (%d blocks of %d), fewer than the context of "
                    "%d: a request of more is refused (--num-kv-blocks, --kv-cache-mb, "
                    "--gpu-memory-utilization, --max-model-len)", num_blocks * block_size,
                    num_blocks, block_size, context_length)


def host_memory_available() -> int | None:
    """Bytes of memory the kernel says a new allocation can have without swapping (MemAvailable
    in /proc/meminfo); None where that cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_host_kv_cache(num_blocks: int, block_bytes: int) -> None:
    """KvCacheTooLarge for a CPU engine's KV cache (float32, in host memory) larger than the
    memory available: --num-kv-blocks 100000000 was NumPy's out-of-memory traceback, and one
    that fit the address space but not the memory was taken, to be killed once filled."""
    available = host_memory_available()
    if available is not None and num_blocks * block_bytes > available:
        raise KvCacheTooLarge(
            f"{num_blocks} KV blocks need {num_blocks * block_bytes >> 20} MiB of host memory; "
            f"{available >> 20} MiB is available, room for {available // block_bytes} blocks",
            flags="--num-kv-blocks, --kv-cache-mb")


class ReferenceEngine:
    """The host loop: scheduler.py's decisions, a forward pass and sampling per step. The
    forward pass is the NumPy reference model here; HostDrivenCudaEngine swaps in the CUDA
    forward graphs (_load_model, _forward_sample)."""

    engine_kind = EngineKind.CPU_REFERENCE

    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_cfg = cfg = load_config(config.model_dir)
        self.context_length = served_context_length(config, cfg)
        num_blocks = self._load_model(cfg)
        self.pool = KvBlockPool(num_blocks, config.block_size, config.prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                            self.context_length), self.pool)
        self.limits = ModelLimits(cfg.vocab_size, self.context_length,
                                  num_blocks * config.block_size)
        self.eos_ids = frozenset(cfg.eos_token_ids)
        self.core = StepCore(self.scheduler, self.eos_ids, self.context_length,
                             queue=self._queue, drop=self._drop)
        geom = RingGeometry(config.num_slots, max_prompt_tokens=self.context_length - 1,
                            max_output_tokens=self.context_length)
        self.ring = RingServer(config.ring_name, geom, model_name=cfg.name,
                               vocab_size=cfg.vocab_size, context_length=self.context_length,
                               eos_ids=cfg.eos_token_ids, engine_kind=self.engine_kind)
        self.stop_event = threading.Event()
        self.counters = dict(requests_admitted=0, requests_finished=0, requests_cancelled=0,
                             requests_rejected=0, preemptions=0, tokens_generated=0,
                             engine_steps=0, busy_ns=0, step_tokens=0)
        self._publish_stats()
        warn_if_kv_cache_short(num_blocks, config.block_size, self.context_length)
        log.info("engine ready: model %s (%s), context %d, %d KV blocks of %d tokens, %d slots, "
                 "ring /dev/shm/%s", cfg.name, cfg.architecture, self.context_length, num_blocks,
                 config.block_size, config.num_slots, config.ring_name)

    def _load_model(self, cfg: ModelConfig) -> int:
        """Loads the model and its KV cache; returns the cache's block count. FP8 weights and
        an FP8 KV cache are emulated: the GPU's roundings of the weights and of the cache, in
        float32 (not the rounding of the activations its FP8 GEMMs take in steps of more than 16
        rows, which depends on the step's size: ReferenceModel's fp8_activations)."""
        config = self.config
        block_bytes = kv_bytes_per_block(cfg, config.block_size)
        num_blocks = config.num_kv_blocks or max(1, config.kv_cache_bytes // block_bytes)
        check_host_kv_cache(num_blocks, block_bytes)
        weights = load_weights(config.model_dir, cfg)
        if config.quantization_for(cfg) == "fp8":
            weights = fp8_weights(weights, lm_head=config.lm_head_fp8_for(cfg))
        self.model = ReferenceModel(cfg, weights, num_blocks, config.block_size)
        if config.kv_cache_dtype == "fp8":
            if weights.kv_scales is not None:
                self.model.kv_scales = per_head_kv_scales(weights.kv_scales, cfg.num_kv_heads)
            else:
                count = calibration_count(config.max_num_batched_tokens, self.context_length,
                                          num_blocks * config.block_size)
                self.model.calibrate_kv_scales(calibration_tokens(cfg.vocab_size, count))
            log.info("KV cache: E4M3 emulated, scales %s", "from the checkpoint"
                     if weights.kv_scales is not None else "calibrated")
        return num_blocks

    # a Type=notify unit's watchdog (serve_forever's; None outside it)
    systemd: SystemdNotify | None = None

    def _progress(self) -> None:
        """A forward pass's progress, layer by layer: the ring's heartbeat, and the systemd
        watchdog's ping with it (pinged once a step, a prefill of seconds went unpinged while
        its heartbeat moved: WatchdogSec= would kill an engine making progress)."""
        self.ring.beat()
        if self.systemd is not None:
            self.systemd.keepalive(self._heartbeat)

    def _heartbeat(self) -> int:
        return int(self.ring.header["heartbeat"])

    def _forward_sample(self, batch: ForwardBatch, samplers: list[Sequence]) -> list[int]:
        """One forward pass over the batch; the token sampled for each of its logit rows."""
        logits = self.model.forward(batch, on_progress=self._progress)
        return [sample_token(row, seq.params, len(seq.output))
                for row, seq in zip(logits, samplers)]

    # -- one iteration of the loop ------------------------------------------------------------

    def step(self) -> bool:
        """One scheduler iteration (the kernel's loop, in the same four parts); returns whether
        a forward pass ran."""
        self._admit()
        plan = self._schedule()
        if not plan.scheduled:
            return False
        started = time.perf_counter_ns()
        batch, samplers = self._build_batch(plan)
        self._postprocess(plan, batch, samplers, self._forward_sample(batch, samplers), started)
        return True

    def _schedule(self) -> StepPlan:
        plan = self.core.schedule()
        for seq in plan.preempted:
            self.counters["preemptions"] += 1
            self.ring.set_preemptions(seq.slot, seq.preemptions)
        for seq, _ in plan.scheduled[len(plan.scheduled) - plan.num_admitted:]:
            self.ring.set_cached_tokens(seq.slot, seq.cached_tokens)
        if not plan.scheduled:
            self._publish_stats()
        return plan

    def _postprocess(self, plan: StepPlan, batch: ForwardBatch, samplers: list[Sequence],
                     tokens: list[int], started_ns: int) -> None:
        """The step's tokens: computed counts, tokens to the ring, stop checks, counters."""
        self.core.commit(plan)
        for token, seq in zip(tokens, samplers):
            self._emit(seq, token)
        self.counters["engine_steps"] += 1
        self.counters["busy_ns"] += time.perf_counter_ns() - started_ns
        self.counters["step_tokens"] += batch.num_tokens
        self._publish_stats()

    def _emit(self, seq: Sequence, token: int) -> bool:
        """Publishes one sampled token; True when the sequence finished with it."""
        self.ring.append_token(seq.slot, len(seq.output), token)
        reason, detail = self.core.accept(seq, token)
        self.counters["tokens_generated"] += 1
        if reason is FinishReason.NONE:
            return False
        self._retire(seq, reason, detail)
        return True

    def _admit(self) -> None:
        """The ring's new requests into the scheduler (rejects answered), then its cancels."""
        self.ring.beat()
        new, rejected = self.ring.poll(self.limits)
        for r in rejected:  # in slot order, before the admissions (the kernel's Admit too)
            log.warning("slot %d gen %d rejected: %s", r.slot, r.gen, r.reason.describe())
            self.counters["requests_rejected"] += 1
            self.core.reject(r.slot)
            self.ring.finish(r.slot, r.gen, FinishReason.REJECTED, r.reason)
        for r in new:  # a reused slot drops its old sequence: the front end gave up on it
            self.ring.open_record(r.slot, r.gen, len(r.prompt))
            self.core.admit(Sequence(r.slot, r.gen, r.request_id, r.prompt, r.params,
                                     r.cache_salt))
            self.counters["requests_admitted"] += 1
        self._honour_cancels()

    def _honour_cancels(self) -> None:
        """Retires the cancelled sequences in slot order, as the kernel's HonourCancels: the
        order sets the free list and the prefix cache's eviction order, so every later decision
        of the two engines depends on it."""
        cancels = self.ring.cancel_words()
        for seq in sorted(self.core.active.values(), key=lambda s: s.slot):
            if cancels[seq.slot] == seq.gen:
                self.counters["requests_cancelled"] += 1
                self._retire(seq, FinishReason.CANCELLED, 0)

    def _queue(self, seq: Sequence) -> None:
        """A new request joins the engine's queue."""
        self.scheduler.add(seq)

    def _drop(self, seq: Sequence) -> None:
        """A sequence leaves the engine (finished, cancelled, or its slot reused)."""
        self.scheduler.finish(seq)

    def _retire(self, seq: Sequence, reason: FinishReason, detail: int) -> None:
        self.core.retire(seq)
        self.ring.finish(seq.slot, seq.gen, reason, detail)
        if reason is not FinishReason.CANCELLED:
            self.counters["requests_finished"] += 1

    def _build_batch(self, plan: StepPlan) -> tuple[ForwardBatch, list[Sequence]]:
        tokens, positions, starts, ctx, logit_seqs, samplers = [], [], [0], [], [], []
        width = max(len(seq.block_table) for seq, _ in plan.scheduled)
        tables = np.full((len(plan.scheduled), width), -1, np.int32)
        for s, (seq, n) in enumerate(plan.scheduled):
            lo = seq.num_computed
            tokens += seq.token_range(lo, lo + n)
            positions += range(lo, lo + n)
            starts.append(starts[-1] + n)
            ctx.append(lo + n)
            tables[s, :len(seq.block_table)] = seq.block_table
            if samples_now(seq, n):
                logit_seqs.append(s)
                samplers.append(seq)
        batch = ForwardBatch(np.asarray(tokens, np.int32), np.asarray(positions, np.int32),
                             np.asarray(starts, np.int32), np.asarray(ctx, np.int32), tables,
                             np.asarray(logit_seqs, np.int32))
        return batch, samplers

    def _queue_stats(self) -> dict[str, int]:
        pool = self.pool
        return dict(kv_blocks_total=pool.num_blocks, kv_blocks_free=pool.num_free,
                    kv_block_size=pool.block_size, kv_blocks_cached=pool.num_cached,
                    prefix_caching=int(pool.prefix_caching),
                    prefix_query_tokens=pool.query_tokens, prefix_hit_tokens=pool.hit_tokens,
                    prefix_evicted_blocks=pool.evicted_blocks,
                    sequences_running=len(self.scheduler.running),
                    sequences_waiting=len(self.scheduler.waiting))

    def _publish_stats(self) -> None:
        h = self.ring.header
        for key, value in (*self._queue_stats().items(), *self.counters.items()):
            h[key] = value

    # -- the loop -------------------------------------------------------------------------------

    def serve_forever(self) -> None:
        self.ring.set_state(EngineState.SERVING)
        log.info("engine serving")
        systemd = self.systemd = SystemdNotify()
        systemd.ready()
        sleep = self.config.idle_sleep_s
        try:
            while not self.stop_event.is_set():
                if self.step():
                    sleep = self.config.idle_sleep_s
                else:  # idle: back off, so waiting costs little CPU and a new request <= 5 ms
                    time.sleep(sleep)
                    sleep = min(2 * sleep, self.config.idle_sleep_max_s)
                systemd.keepalive(self._heartbeat)
        finally:
            systemd.stopping()
            self.close()

    def close(self) -> None:
        if self.ring.header is not None:
            self.ring.close()
            log.info("engine stopped")


def run_engine(config: EngineConfig, engine_cls=ReferenceEngine, **options) -> None:
    """Serves the ring with `engine_cls` (ReferenceEngine or a subclass) until SIGTERM/SIGINT."""
    signals = EngineStopSignals()
    engine = build_engine(lambda: engine_cls(config, **options))
    signals.serving(engine.stop_event)
    engine.serve_forever()


def build_engine(build):
    """build(), and if it fails, the ring files it had created removed (an error after the
    ring's creation, a scheduler configuration refused say, left it in /dev/shm)."""
    try:
        return build()
    except BaseException:
        unlink_created_segments()
        raise
