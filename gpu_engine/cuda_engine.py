"""The CUDA engine: the host sets up, then the persistent scheduler kernel serves the ring.

Start-up (host): load the checkpoint to the GPU in bf16, size the paged KV cache from free
memory, create the ring and map it into the GPU, compile the kernels, capture one device-
launchable forward graph per token bucket, initialise the scheduler state and launch the
scheduler graph. From then on the host does no per-request or per-step work: it sleeps, checks
the control block for a device-side error once in a while, and on SIGTERM asks the kernel to
stop and waits for it.
"""
from __future__ import annotations

import ctypes
import logging
import signal
import threading
import time

import numpy as np

from blink.gpu_engine import cuda_runtime as cr
from blink.gpu_engine.checkpoint import load_config, load_weights
from blink.gpu_engine.cuda_forward import CudaForward
from blink.gpu_engine.reference_engine import EngineConfig, served_context_length
from blink.gpu_engine.ring_server import CORRUPT_GRACE_S, RingServer
from blink.ring.layout import MAX_EOS_IDS, EngineKind, EngineState, RingGeometry

log = logging.getLogger("blink.engine")

KERNEL_SOURCE = cr.CSRC / "scheduler_kernel.cu"
MAX_SLOTS = 1024  # scheduler.cuh's kMaxSlots
CONTROL_DTYPE = np.dtype([("stop", "<u4"), ("exited", "<u4"), ("error", "<i4"), ("runs", "<u4")])
# ForwardPtrs order in scheduler_kernel.cu's engine_init
FORWARD_ARRAYS = ("desc", "done_counter", "token_ids", "positions", "token_seq", "context_lens",
                  "block_tables", "logit_token", "temperature", "top_p", "top_k", "seed", "step",
                  "sampled")

P, I32, U32, U64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_uint32, ctypes.c_uint64


class MappedControl:
    """The host<->kernel control words, in page-locked host memory the kernel maps."""

    def __init__(self):
        cr.primary_context()
        flags = cr.cu.CU_MEMHOSTALLOC_DEVICEMAP | cr.cu.CU_MEMHOSTALLOC_PORTABLE
        self.host_ptr = int(cr.check(cr.cu.cuMemHostAlloc(CONTROL_DTYPE.itemsize, flags)))
        self.device_ptr = int(cr.check(cr.cu.cuMemHostGetDevicePointer(self.host_ptr, 0)))
        buf = (ctypes.c_char * CONTROL_DTYPE.itemsize).from_address(self.host_ptr)
        self.view = np.frombuffer(buf, CONTROL_DTYPE)
        self.view[:] = 0

    def read(self) -> np.void:
        return self.view[0].copy()

    def request_stop(self) -> None:
        self.view["stop"] = 1


class CudaEngine:
    def __init__(self, config: EngineConfig, *, gpu_memory_utilization: float = 0.9):
        if config.num_slots > MAX_SLOTS:
            raise ValueError(f"the CUDA engine supports at most {MAX_SLOTS} slots")
        self.config = config
        cr.primary_context()
        cfg = self.model_cfg = load_config(config.model_dir)
        self.context_length = served_context_length(config, cfg)
        t0 = time.monotonic()
        weights = None if config.load_format == "dummy" else load_weights(config.model_dir, cfg)
        self.forward = CudaForward(
            cfg, weights, block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.context_length, num_blocks=config.num_kv_blocks,
            gpu_memory_utilization=gpu_memory_utilization)
        num_blocks = self.forward.num_blocks
        log.info("weights, KV cache (%d blocks of %d tokens) and %d forward graphs ready in "
                 "%.1f s", num_blocks, config.block_size, len(self.forward.graph_execs),
                 time.monotonic() - t0)

        geom = RingGeometry(config.num_slots, max_prompt_tokens=self.context_length - 1,
                            max_output_tokens=self.context_length)
        self.ring = RingServer(config.ring_name, geom, model_name=cfg.name,
                               vocab_size=cfg.vocab_size, context_length=self.context_length,
                               eos_ids=cfg.eos_token_ids, engine_kind=EngineKind.CUDA)
        self.ring_map = cr.HostMapping(self.ring.segment.mmap)
        h = self.ring.header
        h["kv_blocks_total"] = h["kv_blocks_free"] = num_blocks
        h["kv_block_size"] = config.block_size

        self.module = cr.Module(cr.link_device_runtime(cr.nvcc_cubin(KERNEL_SOURCE,
                                                                      relocatable=True)))
        self.control = MappedControl()
        self._init_device_state(geom, num_blocks)
        self.stream = cr.new_stream()
        fn = self.module.function("scheduler_run")
        self.scheduler_graph = cr.capture_device_graph(self.stream, lambda s: cr.launch(
            fn, 1, 256, (self.state.ptr,), (P,), s))
        self.stop_event = threading.Event()

    def _sched_args(self, num_blocks: int) -> tuple:
        c = self.config
        return (c.num_slots, self.context_length, c.block_size, num_blocks, c.max_num_seqs,
                c.max_num_batched_tokens)

    def _init_device_state(self, geom: RingGeometry, num_blocks: int) -> None:
        sched = self._sched_args(num_blocks)
        sizes = cr.DeviceBuffer(8 * 4)
        cr.launch(self.module.function("engine_sizes"), 1, 1, (*sched, sizes.ptr),
                  (I32,) * 6 + (P,))
        cr.check(cr.cu.cuCtxSynchronize())
        engine_bytes, sched_bytes, max_blocks, bad = np.frombuffer(sizes.download(), "<u8")
        if bad:
            raise ValueError(f"scheduler configuration refused: {sched}")
        if int(max_blocks) != self.forward.max_blocks_per_seq:
            raise ValueError("block-table widths of the scheduler and the forward pass differ")
        self.state = cr.DeviceBuffer(int(engine_bytes))
        self.sched_mem = cr.DeviceBuffer(int(sched_bytes))
        slots = self.config.num_slots
        self.consumed_gen = cr.DeviceBuffer(4 * slots)
        self.corrupt_since = cr.DeviceBuffer(8 * slots)
        self.scratch_slot = cr.DeviceBuffer(geom.slot_bytes)
        self.staged_prompts = cr.DeviceBuffer(4 * slots * geom.max_prompt_tokens)
        small = cr.DeviceBuffer(8 * (7 + MAX_EOS_IDS + len(FORWARD_ARRAYS) + 2 * 16))
        ring_geom = np.array([geom.num_slots, geom.slot_bytes, geom.record_bytes,
                              geom.max_prompt_tokens, geom.max_output_tokens,
                              geom.slots_offset, geom.records_offset], "<u8")
        eos = np.zeros(MAX_EOS_IDS, "<i4")
        eos_ids = list(self.model_cfg.eos_token_ids)[:MAX_EOS_IDS]
        eos[:len(eos_ids)] = eos_ids
        fwd_ptrs = np.array([self.forward.pointer(n) for n in FORWARD_ARRAYS], "<u8")
        buckets = sorted(self.forward.graph_execs)
        bucket_tokens = np.zeros(16, "<i4")
        bucket_tokens[:len(buckets)] = buckets
        execs = np.zeros(16, "<u8")
        execs[:len(buckets)] = [cr.graph_exec_handle(self.forward.graph_execs[b]) for b in buckets]
        parts = [ring_geom.tobytes(), eos.tobytes().ljust(8 * MAX_EOS_IDS, b"\0"),
                 fwd_ptrs.tobytes(), bucket_tokens.tobytes().ljust(8 * 16, b"\0"), execs.tobytes()]
        offsets, blob = [], b""
        for part in parts:
            offsets.append(small.ptr + len(blob))
            blob += part
        small.upload(blob)
        self._small = small
        kv_capacity = num_blocks * self.config.block_size
        cr.launch(self.module.function("engine_init"), 1, 1, (
            self.state.ptr, self.sched_mem.ptr, *sched, self.ring_map.device_ptr, offsets[0],
            self.control.device_ptr, self.consumed_gen.ptr, self.corrupt_since.ptr,
            self.scratch_slot.ptr, self.staged_prompts.ptr, self.model_cfg.vocab_size, self.context_length,
            kv_capacity, offsets[1], len(eos_ids), int(CORRUPT_GRACE_S * 1e9), 2000,
            offsets[2], offsets[3], offsets[4], len(buckets)),
            (P, P) + (I32,) * 6 + (P, P, P, P, P, P, P, U32, U32, U32, P, I32, U64, I32, P, P, P,
                                    I32))
        cr.check(cr.cu.cuCtxSynchronize())

    # -- serving --------------------------------------------------------------------------------

    def start(self) -> None:
        self.ring.set_state(EngineState.SERVING)
        cr.check(cr.cu.cuGraphLaunch(self.scheduler_graph, self.stream))
        log.info("CUDA engine serving: the scheduler kernel owns the ring")

    def wait(self, poll_s: float = 0.1) -> None:
        """The host's whole steady-state job: sleep, notice errors, handle stop."""
        while not self.stop_event.wait(poll_s):
            c = self.control.read()
            if int(c["exited"]):
                raise cr.CudaError(f"scheduler kernel exited with error {int(c['error'])}")
        self.control.request_stop()
        cr.check(cr.cu.cuStreamSynchronize(self.stream))

    def close(self) -> None:
        self.ring.set_state(EngineState.STOPPED)
        self.ring_map.close()
        self.ring.close()
        log.info("engine stopped")


def run_cuda_engine(config: EngineConfig, gpu_memory_utilization: float = 0.9) -> None:
    engine = CudaEngine(config, gpu_memory_utilization=gpu_memory_utilization)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: engine.stop_event.set())
    engine.start()
    try:
        engine.wait()
    finally:
        engine.close()
