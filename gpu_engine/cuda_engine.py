"""The CUDA engine: the host sets up, then the persistent scheduler kernel serves the ring.

Start-up (host): load the checkpoint to the GPU in bf16, size the paged KV cache from free
memory, create the ring and map it into the GPU, compile the kernels, capture one device-
launchable forward graph per token bucket, initialise the scheduler state and launch the
scheduler graph. From then on the host does no per-request or per-step work: it sleeps, checks
the control block for a device-side error once in a while, and on SIGTERM asks the kernel to
stop and waits for it.

Where the ring lives (`--ring-memory`): host, the default, is the /dev/shm segment the GPU maps
(page-locked), which front ends reach in shared memory or through the NIC (RDMA, pinned host
memory); gpu is a ring in GPU memory (cuda_runtime.DeviceRing), for front ends that reach it only
by RDMA: the ring is built in the /dev/shm segment as always, copied to the GPU when the engine
starts serving, and the segment's name removed (a front end on this host could not reach the
GPU's copy); the kernel then polls its own memory instead of reading across PCIe, and the RDMA
export registers the copy by its dma-buf.

With a step log (`--step-log PATH`), the kernel also times every step's phases into device
memory (engine_layout.StepRecord: batch description, forward graph, samples), the last
STEP_LOG_CAPACITY of them, and the host writes them to PATH when the engine stops
(gpu_engine/step_log.py summarizes them).
"""
from __future__ import annotations

import ctypes
import logging
import threading
import time
from pathlib import Path

import numpy as np

from blink.gpu_engine import cuda_runtime as cr
from blink.gpu_engine import engine_layout as el
from blink.gpu_engine.checkpoint import load_config, load_weights
from blink.gpu_engine.cuda_forward import CudaForward
from blink.gpu_engine.reference_engine import (EngineConfig, build_engine,
                                               served_context_length, warn_if_kv_cache_short)
from blink.gpu_engine.ring_server import CORRUPT_GRACE_S, RingServer
from blink.gpu_engine.step_log import STEP_LOG_CAPACITY, save_step_log
from blink.ring.layout import HEADER_DTYPE, EngineKind, EngineState, RingGeometry
from blink.ring.lifecycle import EngineStopSignals, SystemdNotify

log = logging.getLogger("blink.engine")

KERNEL_SOURCE = cr.CSRC / "scheduler_kernel.cu"
# The scheduler kernel's registers a thread: its one CTA shares an SM with the forward pass's
# CTAs, and forward_kernels.cu's blink_hold_sm takes the same (kSchedulerRegisters, in the SM's
# units of 8) so that bench_decode times the graphs beside what the live path has beside them.
# A cap, not only a measurement: the serial walks it calls (scheduler.cuh BLINK_SCHED_CALL) are
# allocated on their own, and linking gives the kernel the largest (prefix_match took 172).
SCHEDULER_MAX_REGISTERS = 88


def scheduler_cubin() -> bytes:
    """The scheduler kernel linked with cudadevrt (device-side graph launch), ready to load."""
    return cr.link_device_runtime(cr.nvcc_cubin(KERNEL_SOURCE, relocatable=True,
                                                max_registers=SCHEDULER_MAX_REGISTERS))
# With nothing to schedule, the scheduler CTA sleeps this long before it polls the ring again.
# Each poll reads three words of every slot across PCIe (with the ring in host memory), so
# polling back to back would load the bus and the front end's cache lines for nothing; 2 us
# (__nanosleep sleeps up to twice that) delays a new request's admission by a few us at most,
# small next to one forward step.
IDLE_SLEEP_NS = 2000

P = ctypes.c_void_p  # every kernel argument here is a device address


class MappedControl:
    """The host<->kernel control words, in page-locked host memory the kernel maps."""

    def __init__(self):
        cr.primary_context()
        flags = cr.cu.CU_MEMHOSTALLOC_DEVICEMAP | cr.cu.CU_MEMHOSTALLOC_PORTABLE
        nbytes = el.CONTROL_DTYPE.itemsize
        self.host_ptr = int(cr.check(cr.cu.cuMemHostAlloc(nbytes, flags)))
        self.device_ptr = int(cr.check(cr.cu.cuMemHostGetDevicePointer(self.host_ptr, 0)))
        buf = (ctypes.c_char * nbytes).from_address(self.host_ptr)
        self.view = np.frombuffer(buf, el.CONTROL_DTYPE)
        self.view[:] = 0

    def read(self) -> np.void:
        return self.view[0].copy()

    def request_stop(self) -> None:
        self.view["stop"] = 1


class CudaEngine:
    def __init__(self, config: EngineConfig, *, gpu_memory_utilization: float = 0.9,
                 step_log: Path | None = None, ring_memory: str = "host", ring_export=None):
        """ring_memory: "host" or "gpu" (the module docstring); ring_export: the RDMA export
        (blink.ring.rdma.RingExport) to hand a GPU-memory ring to, by its dma-buf."""
        if config.num_slots > el.MAX_SLOTS:
            raise ValueError(f"the CUDA engine supports at most {el.MAX_SLOTS} slots")
        if ring_memory not in ("host", "gpu"):
            raise ValueError(f"ring_memory is host or gpu, not {ring_memory!r}")
        self.config = config
        cr.primary_context()
        if ring_memory == "gpu" and ring_export is not None:
            reason = cr.dmabuf_unsupported_reason()  # before anything is loaded
            if reason is not None:
                raise ValueError(f"--ring-memory gpu: {reason}")
        self.ring_export = ring_export
        cfg = self.model_cfg = load_config(config.model_dir)
        self.context_length = served_context_length(config, cfg)
        t0 = time.monotonic()
        weights = (None if config.load_format == "dummy" else
                   load_weights(config.model_dir, cfg, layers_on_demand=True))
        self.forward = CudaForward(
            cfg, weights, block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.context_length, num_blocks=config.num_kv_blocks,
            gpu_memory_utilization=gpu_memory_utilization, gemm_tuning=config.gemm_tuning,
            held_sms=1, sm_count_target=config.sm_count_target,  # the scheduler's CTA
            decode_weight_copy=config.decode_weight_copy, gemm_split_k=config.gemm_split_k,
            fine_buckets_from=config.fine_buckets_from,
            quantization=config.quantization_for(cfg), fp8_lm_head=config.lm_head_fp8_for(cfg),
            fp8_fast_accum=config.fp8_fast_accum, kv_cache_dtype=config.kv_cache_dtype,
            kv_scales=weights.kv_scales if weights is not None else None)
        num_blocks = self.forward.num_blocks
        warn_if_kv_cache_short(num_blocks, config.block_size, self.context_length)
        formats = "bf16"
        if self.forward.fp8:
            kept = sum(len(layer.bf16) for layer in self.forward.layers)  # (served_bf16)
            formats = ("FP8" + (f", {kept} of {4 * cfg.num_layers} fused projections bf16 as "
                                f"stored" if kept else "")
                       + (", LM head FP8" if self.forward.lm_head_fp8 else ", LM head bf16"))
        log.info("weights (%s), KV cache (%s, %d blocks of %d tokens) and %d forward graphs "
                 "ready in %.1f s", formats, "E4M3" if self.forward.kv_fp8 else "bf16",
                 num_blocks, config.block_size, len(self.forward.graph_execs),
                 time.monotonic() - t0)

        geom = RingGeometry(config.num_slots, max_prompt_tokens=self.context_length - 1,
                            max_output_tokens=self.context_length)
        self.ring = RingServer(config.ring_name, geom, model_name=cfg.name,
                               vocab_size=cfg.vocab_size, context_length=self.context_length,
                               eos_ids=cfg.eos_token_ids, engine_kind=EngineKind.CUDA)
        if ring_memory == "gpu":
            self.ring_map, self.device_ring = None, cr.DeviceRing(geom.total_bytes)
            ring_base = self.device_ring.ptr
            log.info("ring: GPU memory (--ring-memory gpu), for front ends that reach it by RDMA")
        else:
            self.ring_map, self.device_ring = cr.HostMapping(self.ring.segment.mmap), None
            ring_base = self.ring_map.device_ptr
            log.info("ring: pinned host memory, /dev/shm/%s, mapped by the GPU "
                     "(--ring-memory host)", config.ring_name)
        h = self.ring.header
        h["kv_blocks_total"] = h["kv_blocks_free"] = num_blocks
        h["kv_block_size"] = config.block_size
        h["prefix_caching"] = int(config.prefix_caching)

        self.module = cr.Module(scheduler_cubin())
        self.control = MappedControl()
        self.step_log_path = step_log
        self.step_log = None
        if step_log is not None:  # (the CLI checked its folder; close() reports a failed save)
            self.step_log = cr.DeviceBuffer(STEP_LOG_CAPACITY * el.STEP_RECORD_DTYPE.itemsize)
            self.step_log.zero()
        self._init_device_state(geom, num_blocks, ring_base)
        self.stream = cr.new_stream()
        fn = self.module.function("scheduler_run")
        self.scheduler_graph = cr.capture_device_graph(self.stream, lambda s: cr.launch(
            fn, 1, el.SCHEDULER_THREADS, (self.state.ptr,), (P,), s))
        self.stop_event = threading.Event()
        self.systemd = SystemdNotify()  # (a Type=notify unit's: a no-op elsewhere)

    def _init_device_state(self, geom: RingGeometry, num_blocks: int, ring_base: int) -> None:
        """Allocates the scheduler's device state and fills it: engine_sizes says how much
        memory, engine_init reads one EngineInit record (gpu_engine/engine_layout.py)."""
        c = self.config
        sched = el.sched_config(
            num_slots=c.num_slots, max_model_len=self.context_length, block_size=c.block_size,
            num_blocks=num_blocks, max_num_seqs=c.max_num_seqs,
            max_num_batched_tokens=c.max_num_batched_tokens,
            prefix_caching=int(c.prefix_caching))
        config_buf = cr.DeviceBuffer(el.SCHED_CONFIG_DTYPE.itemsize)
        config_buf.upload(sched.tobytes())
        sizes_buf = cr.DeviceBuffer(el.ENGINE_SIZES_DTYPE.itemsize)
        cr.launch(self.module.function("engine_sizes"), 1, 1, (config_buf.ptr, sizes_buf.ptr),
                  (P, P))
        cr.check(cr.cu.cuCtxSynchronize())
        sizes = np.frombuffer(sizes_buf.download(), el.ENGINE_SIZES_DTYPE)[0]
        config_buf.free()
        sizes_buf.free()
        if not sizes["config_ok"]:
            raise ValueError(f"scheduler configuration refused: {sched}")
        if int(sizes["max_blocks_per_seq"]) != self.forward.max_blocks_per_seq:
            raise ValueError("block-table widths of the scheduler and the forward pass differ")
        self.state = cr.DeviceBuffer(int(sizes["engine_bytes"]))
        self.sched_mem = cr.DeviceBuffer(int(sizes["sched_bytes"]))
        slots = c.num_slots
        self.consumed_gen = cr.DeviceBuffer(4 * slots)
        self.corrupt_since = cr.DeviceBuffer(8 * slots)
        self.scratch_slot = cr.DeviceBuffer(geom.slot_bytes)
        self.staged_prompts = cr.DeviceBuffer(4 * slots * geom.max_prompt_tokens)
        h = self.ring.header  # the EOS ids the ring publishes are the ones the kernel stops on
        init = el.engine_init_record(
            sched=sched, ring_base=ring_base, geom=geom,
            control=self.control.device_ptr, consumed_gen=self.consumed_gen.ptr,
            corrupt_since=self.corrupt_since.ptr, scratch_slot=self.scratch_slot.ptr,
            staged_prompts=self.staged_prompts.ptr, vocab_size=self.model_cfg.vocab_size,
            context_length=self.context_length, kv_capacity_tokens=num_blocks * c.block_size,
            eos_ids=[int(t) for t in h["eos_ids"][:int(h["num_eos_ids"])]],
            corrupt_grace_ns=int(CORRUPT_GRACE_S * 1e9), idle_sleep_ns=IDLE_SLEEP_NS,
            # ForwardPtrs.num_tokens is the BatchDesc's first word
            forward_pointers={n: self.forward.pointer("desc" if n == "num_tokens" else n)
                              for n in el.FORWARD_POINTERS},
            max_blocks_per_seq=self.forward.max_blocks_per_seq,
            graph_execs={b: cr.graph_exec_handle(e) for b, e in self.forward.graph_execs.items()},
            step_log=self.step_log.ptr if self.step_log else 0,
            step_log_capacity=STEP_LOG_CAPACITY if self.step_log else 0)
        init_buf = cr.DeviceBuffer(el.ENGINE_INIT_DTYPE.itemsize)
        init_buf.upload(init.tobytes())
        cr.launch(self.module.function("engine_init"), 1, 1,
                  (self.state.ptr, self.sched_mem.ptr, init_buf.ptr), (P, P, P))
        cr.check(cr.cu.cuCtxSynchronize())
        init_buf.free()  # engine_init copied what it needs into the engine's state

    # -- serving --------------------------------------------------------------------------------

    def start(self) -> None:
        if self.device_ring is None:
            self.ring.set_state(EngineState.SERVING)
        else:  # the host image never says SERVING: nothing may take it for the ring
            self.ring.segment.unlink()
            self.device_ring.upload(self.ring.segment.mmap)
            self._set_device_ring_state(EngineState.SERVING)
            if self.ring_export is not None:
                self.ring_export.serve_device_ring(self.device_ring.export_dmabuf(),
                                                   self.ring.geom)
        cr.check(cr.cu.cuGraphLaunch(self.scheduler_graph, self.stream))
        log.info("CUDA engine serving: the scheduler kernel owns the ring")
        self.systemd.ready()

    def wait(self, poll_s: float = 0.1) -> None:
        """The host's whole steady-state job: sleep, notice errors, tell systemd's watchdog the
        scheduler kernel's heartbeat moves, handle stop."""
        while not self.stop_event.wait(poll_s):
            c = self.control.read()
            if int(c["exited"]):
                raise cr.CudaError(f"scheduler kernel exited with error {int(c['error'])}")
            self.systemd.keepalive(lambda: int(self.ring_header()["heartbeat"]))
        self.systemd.stopping()
        self.control.request_stop()
        cr.check(cr.cu.cuStreamSynchronize(self.stream))

    def _set_device_ring_state(self, state: EngineState) -> None:
        word = np.uint32(state).tobytes()
        self.device_ring.upload(word, HEADER_DTYPE.fields["engine_state"][1])

    def ring_header(self) -> np.void:
        """The ring's header as the kernel left it (a copy where the ring is in GPU memory)."""
        if self.device_ring is None:
            return self.ring.header
        return np.frombuffer(self.device_ring.download(HEADER_DTYPE.itemsize),
                             HEADER_DTYPE)[0]

    def close(self) -> None:
        try:
            if self.step_log is not None and int(self.control.read()["exited"]):
                records = np.frombuffer(self.step_log.download(), el.STEP_RECORD_DTYPE)
                kept = save_step_log(self.step_log_path, records)
                log.info("step log: %d of %d steps written to %s", kept,
                         int(self.ring_header()["engine_steps"]), self.step_log_path)
        except OSError as e:  # the ring still comes down
            log.error("step log not written to %s: %s", self.step_log_path, e)
        finally:
            self.ring.set_state(EngineState.STOPPED)
            if self.device_ring is not None:
                if self.ring_export is not None:  # its regions go before the memory does
                    self.ring_export.close()
                self._set_device_ring_state(EngineState.STOPPED)
                self.device_ring.free()
            else:
                self.ring_map.close()
            self.ring.close()
            log.info("engine stopped")


def run_cuda_engine(config: EngineConfig, gpu_memory_utilization: float = 0.9,
                    step_log: Path | None = None, ring_memory: str = "host",
                    ring_export=None) -> None:
    signals = EngineStopSignals()
    engine = build_engine(lambda: CudaEngine(
        config, gpu_memory_utilization=gpu_memory_utilization, step_log=step_log,
        ring_memory=ring_memory, ring_export=ring_export))
    signals.serving(engine.stop_event)
    try:  # (a start that fails, its graph launch say, removes the ring too)
        engine.start()
        engine.wait()
    finally:
        engine.close()
