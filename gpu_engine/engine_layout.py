"""What the CUDA engine's host and its scheduler kernel share: limits, the control block, the
scheduler config, the ring view, the forward pointer and bucket table, engine_init's one argument
struct and engine_sizes' answer.

This file is the single source of truth, as proto/ring/layout.py is for the ring. The kernel's
view (`gpu_engine/csrc/engine_layout.h`) is generated from it by
`python -m blink.gpu_engine.engine_layout --write-header`, with static_asserts of every size and
offset; tests/test_engine_layout.py checks the header is current and compiles.

Addresses (device pointers, or mapped host memory's device addresses) are u64 fields here and
typed pointers in C (`pointer`): the header asserts pointers are 8 bytes. Every struct is laid
out as a C compiler would (`align=True`), so the host writes a record's bytes and the kernel
reads the struct.

Set-up, once (gpu_engine/cuda_engine.py):
  engine_sizes(const SchedConfig*, EngineSizes*)          how much device memory to allocate
  engine_init(EngineDevice*, void* sched_mem, const EngineInit*)   fills the engine's state
then the scheduler graph runs `scheduler_run(EngineDevice*)` with SCHEDULER_THREADS threads.
"""
from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from blink.ring.layout import (
    MAX_EOS_IDS, RingGeometry, c_header_text, c_name, c_struct, header_main,
)

MAX_SLOTS = 1024         # ring slots at most: the kernel's per-slot shared-memory lists
MAX_BUCKETS = 32         # forward graphs (token buckets) at most
SCHEDULER_THREADS = 256  # the scheduler CTA: its launch bounds and the host's launch

# What the CUDA kernels take (csrc/; tests/test_engine_layout.py reads each from its source),
# checked before anything loads (cuda_engine_refusal) and again where each is used.
COMPUTE_CAPABILITY = (9, 0)  # thread-block clusters, and the scheduler kernel built for sm_90a
HEAD_DIMS = range(16, 257, 16)  # forward_kernels.cu's static_assert on BLINK_HEAD_DIM
FP8_KV_HEAD_DIMS = (64, 128)    # the E4M3 cache's attention paths (kv_cache.cuh)
MAX_GQA_GROUP = 64       # attention_common.cuh kAttnRows: a query tile holds a whole group
MAX_STEP_SEQS = 256      # scheduler.cuh BLINK_SCHED_MAX_STEP_SEQS: the step plan's arrays
HIDDEN_ALIGN, INTERMEDIATE_ALIGN = 8, 16  # the bf16 kernels' vector and tile widths
FP8_K_ALIGN = 64         # the FP8 skinny kernels' K steps (hidden, intermediate and q sizes)


def cuda_engine_refusal(cfg, *, kind: str, quantization: str | None, kv_cache_dtype: str,
                        max_num_seqs: int, slots: int, sm_count_target: int | None,
                        compute_capability: tuple[int, int], sm_count: int) -> str | None:
    """Why the CUDA engines (kind "cuda" or "host-cuda") cannot serve the model `cfg`
    (checkpoint.ModelConfig) with these flags on this GPU, in one line; None when they can.
    Everything here is known before a weight is read, and each would otherwise fail late (a
    compile error, a CUDA error after the weights are up) or not at all (a wrong answer)."""
    if tuple(compute_capability) != COMPUTE_CAPABILITY:
        return (f"the CUDA engines need compute capability {'.'.join(map(str, COMPUTE_CAPABILITY))}"
                f" (Hopper: thread-block clusters, the scheduler built for sm_90a); this GPU is "
                f"{'.'.join(map(str, compute_capability))} (--engine cpu serves on the CPU)")
    d, group = cfg.head_dim, cfg.num_heads // cfg.num_kv_heads
    if d not in HEAD_DIMS:
        return f"head_dim {d}: the CUDA kernels take a multiple of 16 in [16, 256]"
    if kv_cache_dtype == "fp8" and d not in FP8_KV_HEAD_DIMS:
        return f"--kv-cache-dtype fp8 needs head_dim 64 or 128, not {d}"
    if group > MAX_GQA_GROUP:
        return (f"{cfg.num_heads} query heads on {cfg.num_kv_heads} KV heads: the attention "
                f"kernels take at most {MAX_GQA_GROUP} query heads a KV head")
    if cfg.hidden_size % HIDDEN_ALIGN or cfg.intermediate_size % INTERMEDIATE_ALIGN:
        return (f"hidden size {cfg.hidden_size} and intermediate size "
                f"{cfg.intermediate_size}: the CUDA kernels need multiples of {HIDDEN_ALIGN} "
                f"and {INTERMEDIATE_ALIGN}")
    sizes = (cfg.hidden_size, cfg.intermediate_size, cfg.q_size)
    if quantization == "fp8" and any(n % FP8_K_ALIGN for n in sizes):
        return (f"FP8 weights need hidden ({sizes[0]}), intermediate ({sizes[1]}) and q "
                f"({sizes[2]}) sizes that are multiples of {FP8_K_ALIGN}")
    if kind == "cuda" and max_num_seqs > MAX_STEP_SEQS:
        return f"--max-num-seqs {max_num_seqs}: the cuda engine runs at most {MAX_STEP_SEQS}"
    if kind == "cuda" and slots > MAX_SLOTS:
        return f"--slots {slots}: the cuda engine has at most {MAX_SLOTS}"
    if sm_count_target is not None and not 0 <= sm_count_target <= sm_count:
        return f"--sm-count-target {sm_count_target}: this GPU has {sm_count} SMs"
    return None


class GpuSetupError(RuntimeError):
    """A CUDA or cuBLAS call failed (CudaError, CublasError): at start-up most often an
    operator's matter (weights past the GPU's memory, pinned memory refused), which the
    engine's start-up says in one line, the driver's error named (a traceback with --log-level
    debug)."""


class KvCacheTooLarge(ValueError):
    """The KV cache asked for (its blocks, or gpu_memory_utilization's share) does not fit in
    the GPU's memory left after the weights (CudaForward), or, the CPU engine's, in the host's:
    an operator's setting, which the engine's start-up says in one line, naming `flags`, the
    settings that size it."""

    def __init__(self, message: str, flags: str = "--num-kv-blocks, --gpu-memory-utilization"):
        super().__init__(message)
        self.flags = flags


def default_buckets(max_num_batched_tokens: int, fine_from: int = 128) -> list[int]:
    """1, 2, 4, ... up to fine_from, then four buckets an octave (with 128: 160, 192, 224, 256,
    320, ...; two an octave where four would pass MAX_BUCKETS), below the cap, then the cap
    itself. A step runs its bucket's graph, padded to the bucket's size; prefill-heavy steps are
    compute-bound, so padding costs its share of the step: with powers of two only, a 600-token
    step (the 256-stream saturation's usual size) ran as 1,024 tokens. fine_from: at least 4
    (below, a quarter octave is no step at all)."""
    if fine_from < 4:
        raise ValueError(f"fine_from must be at least 4, got {fine_from}")
    for per_octave in (4, 2, 1):
        out, b = [], 1
        while b < max_num_batched_tokens:
            out.append(b)
            octave = 1 << (b.bit_length() - 1)  # the power of two at or below b
            b += octave // per_octave if b >= fine_from else b
        if len(out) < MAX_BUCKETS:
            return out + [max_num_batched_tokens]
    raise ValueError(f"max_num_batched_tokens {max_num_batched_tokens} needs more than "
                     f"{MAX_BUCKETS} buckets")


def pointer(c_type: str, doc: str) -> np.dtype:
    """An address: u64 here, `c_type` in C."""
    return np.dtype("<u8", metadata={"c_type": c_type, "doc": doc})


def doc(dtype, text: str) -> np.dtype:
    """`dtype` (a scalar or a (scalar, shape) array) with the comment the header prints."""
    return np.dtype(dtype, metadata={"doc": text})


def struct(name: str, fields: list) -> np.dtype:
    """A C-aligned structured dtype that nests as the C struct `name`."""
    return np.dtype(fields, align=True, metadata={"c_name": name})


# Host<->kernel control words, in page-locked host memory the kernel maps. The host writes only
# before launch and at shutdown.
CONTROL_DTYPE = struct("Control", [
    ("stop", doc("<u4", "host sets 1: the kernel exits at its next iteration")),
    ("exited", doc("<u4", "the kernel sets 1 when it has returned for good")),
    ("error", doc("<i4", "a device-side launch error, 0 if none")),
    ("runs", doc("<u4", "executions of the scheduler graph (1 + tail launches)")),
])

# scheduler.cuh's configuration (SchedulerConfig + KvBlockPool sizes + the arrays' dimensions),
# fixed for the engine's life; sched::config_error says whether it is usable.
SCHED_CONFIG_DTYPE = struct("SchedConfig", [
    ("num_slots", doc("<i4", "ring slots: the index space of seqs[] and both queues")),
    ("max_model_len", doc("<i4", "tokens one sequence can hold (>= the context length)")),
    ("block_size", doc("<i4", "tokens per KV block")),
    ("num_blocks", doc("<i4", "KV blocks in the pool")),
    ("max_num_seqs", doc("<i4", "sequences in one step at most (<= sched::kMaxStepSeqs)")),
    ("max_num_batched_tokens", doc("<i4", "token budget of one step (prefill chunks + decodes)")),
    ("prefix_caching", doc("<i4", "1: full KV blocks are cached and shared by prompt prefix")),
])

# The ring segment as the kernel addresses it (RingGeometry, plus where it is mapped).
RING_VIEW_DTYPE = struct("RingView", [
    ("base", pointer("uint8_t*", "the mapped segment's device address")),
    ("num_slots", "<u4"),
    ("slot_bytes", "<u4"),
    ("record_bytes", "<u4"),
    ("max_prompt_tokens", "<u4"),
    ("max_output_tokens", "<u4"),
    ("slots_offset", "<u8"),
    ("records_offset", "<u8"),
])

# The forward graphs' inputs and outputs (gpu_engine/cuda_forward.py allocates them; batch.cuh
# describes them) and one graph per token bucket.
FORWARD_PTRS_DTYPE = struct("ForwardPtrs", [
    ("num_tokens", pointer("int32_t*", "BatchDesc: num_tokens, then num_seqs, num_logits")),
    ("done_counter", pointer("uint32_t*", "BatchDesc.done_counter: bumped by each graph's "
                                          "last kernel")),
    ("token_ids", pointer("int32_t*", "[max_tokens]")),
    ("positions", pointer("int32_t*", "[max_tokens]")),
    ("token_seq", pointer("int32_t*", "[max_tokens] batch sequence of each token")),
    ("context_lens", pointer("int32_t*", "[max_seqs]")),
    ("block_tables", pointer("int32_t*", "[max_seqs, max_blocks_per_seq]")),
    ("logit_token", pointer("int32_t*", "[max_seqs] flat token index of logits row l")),
    ("temperature", pointer("float*", "[max_seqs] per logits row")),
    ("top_p", pointer("float*", "[max_seqs]")),
    ("top_k", pointer("int32_t*", "[max_seqs]")),
    ("seed", pointer("uint64_t*", "[max_seqs]")),
    ("step", pointer("uint32_t*", "[max_seqs]")),
    ("sampled", pointer("int32_t*", "[max_seqs] out: the token sampled for logits row l")),
    ("max_blocks_per_seq", doc("<i4", "block_tables' row width: sched::max_blocks_per_seq")),
    ("num_buckets", doc("<i4", "<= kMaxBuckets")),
    ("bucket_tokens", doc(("<i4", (MAX_BUCKETS,)), "ascending: graph b takes up to this many "
                                                    "tokens")),
    ("graph_execs", doc(("<u8", (MAX_BUCKETS,)), "cudaGraphExec_t, instantiated for device "
                                                  "launch")),
])
FORWARD_POINTERS = tuple(n for n, (t, _) in FORWARD_PTRS_DTYPE.fields.items()
                         if t.metadata and "c_type" in t.metadata)

# engine_sizes' answer, for the host to allocate by.
ENGINE_SIZES_DTYPE = struct("EngineSizes", [
    ("engine_bytes", doc("<u8", "sizeof(EngineDevice)")),
    ("sched_bytes", doc("<u8", "the scheduler state's arrays: sched::state_layout")),
    ("max_blocks_per_seq", doc("<i4", "sched::max_blocks_per_seq")),
    ("config_ok", doc("<u4", "1 when sched::config_error accepts the config")),
])

# One step that ran a forward pass, as the scheduler kernel times it (globaltimer ns), for
# profiling (`--step-log`): the engine keeps the last step_log_capacity of them in device memory,
# step n at n % capacity, and writes them out when it stops (gpu_engine/step_log.py reads them).
STEP_RECORD_DTYPE = struct("StepRecord", [
    ("start_ns", doc("<u8", "globaltimer when the step began writing its batch description")),
    ("tokens", doc("<u4", "tokens the forward pass computed (prefill chunks + decode tokens)")),
    ("seqs", doc("<u4", "sequences scheduled")),
    ("rows", doc("<u4", "logits rows: sequences that sample this step")),
    ("bucket", doc("<u4", "the forward graph's token count")),
    ("build_ns", doc("<u4", "writing the batch description")),
    ("forward_ns", doc("<u4", "the graph's launch (retries included) until its done counter "
                              "moved")),
    ("finish_ns", doc("<u4", "samples to records, stop checks, retirement")),
    ("launch_retries", doc("<u4", "launches refused while the previous one retired")),
    ("schedule_ns", doc("<u4", "the iteration before the step: admission (prompt copies), "
                               "cancels and scheduling (prefix cache lookups)")),
])

# engine_init's one argument: everything the engine's state starts from.
ENGINE_INIT_DTYPE = struct("EngineInit", [
    ("sched", SCHED_CONFIG_DTYPE),
    ("ring", RING_VIEW_DTYPE),
    ("fwd", FORWARD_PTRS_DTYPE),
    ("control", pointer("Control*", "mapped host memory")),
    ("consumed_gen", pointer("uint32_t*", "[num_slots] last generation consumed per slot")),
    ("corrupt_since", pointer("uint64_t*", "[num_slots] when a CRC mismatch was first seen")),
    ("scratch_slot", pointer("uint8_t*", "[slot_bytes] a candidate slot, copied out of the ring")),
    ("staged_prompts", pointer("int32_t*", "[num_slots, max_prompt_tokens]")),
    ("vocab_size", "<u4"),
    ("context_length", "<u4"),
    ("kv_capacity_tokens", doc("<u4", "num_blocks * block_size")),
    ("num_eos", doc("<i4", "<= ring::kMaxEosIds")),
    ("eos_ids", ("<i4", (MAX_EOS_IDS,))),
    ("corrupt_grace_ns", doc("<u8", "a slot whose CRC stays wrong this long is rejected")),
    ("idle_sleep_ns", doc("<u4", "__nanosleep after an iteration with nothing to schedule")),
    ("step_log", pointer("StepRecord*", "[step_log_capacity], or null: no step log")),
    ("step_log_capacity", "<u4"),
])

STRUCTS = (CONTROL_DTYPE, SCHED_CONFIG_DTYPE, RING_VIEW_DTYPE, FORWARD_PTRS_DTYPE,
           ENGINE_SIZES_DTYPE, STEP_RECORD_DTYPE, ENGINE_INIT_DTYPE)  # in declaration order


def sched_config(**fields: int) -> np.ndarray:
    """A SchedConfig record (shape ()) from every one of its fields, by name; the kernel's
    config_error judges it (EngineSizes.config_ok)."""
    if sorted(fields) != sorted(SCHED_CONFIG_DTYPE.names):
        raise ValueError(f"SchedConfig takes exactly {SCHED_CONFIG_DTYPE.names}")
    rec = np.zeros((), SCHED_CONFIG_DTYPE)
    for name, value in fields.items():
        rec[name] = value
    return rec


def engine_init_record(*, sched: np.ndarray, ring_base: int, geom: RingGeometry, control: int,
                       consumed_gen: int, corrupt_since: int, scratch_slot: int,
                       staged_prompts: int, vocab_size: int, context_length: int,
                       kv_capacity_tokens: int, eos_ids: Sequence[int], corrupt_grace_ns: int,
                       idle_sleep_ns: int, forward_pointers: Mapping[str, int],
                       max_blocks_per_seq: int, graph_execs: Mapping[int, int],
                       step_log: int = 0, step_log_capacity: int = 0) -> np.ndarray:
    """The EngineInit record (shape ()) whose bytes engine_init reads.

    sched: a `sched_config` record. Addresses are device addresses. forward_pointers: a device
    address for each of FORWARD_POINTERS. graph_execs: bucket token count -> its
    cudaGraphExec_t handle. step_log: room for step_log_capacity StepRecords (0: none).
    """
    if bool(step_log) != bool(step_log_capacity):
        raise ValueError("a step log needs both its address and its capacity")
    if sorted(forward_pointers) != sorted(FORWARD_POINTERS):
        raise ValueError(f"forward pointers {sorted(forward_pointers)} are not ForwardPtrs' "
                         f"{sorted(FORWARD_POINTERS)}")
    if not 1 <= len(graph_execs) <= MAX_BUCKETS:
        raise ValueError(f"{len(graph_execs)} forward graphs: the engine takes 1 to "
                         f"{MAX_BUCKETS} buckets")
    if len(eos_ids) > MAX_EOS_IDS:
        raise ValueError(f"{len(eos_ids)} EOS ids: the ring carries at most {MAX_EOS_IDS}")
    rec = np.zeros((), ENGINE_INIT_DTYPE)
    rec["sched"] = sched
    ring = rec["ring"]
    ring["base"] = ring_base
    for name in ("num_slots", "slot_bytes", "record_bytes", "max_prompt_tokens",
                 "max_output_tokens", "slots_offset", "records_offset"):
        ring[name] = getattr(geom, name)
    fwd = rec["fwd"]
    for name, address in forward_pointers.items():
        fwd[name] = address
    fwd["max_blocks_per_seq"] = max_blocks_per_seq
    buckets = sorted(graph_execs)
    fwd["num_buckets"] = len(buckets)
    fwd["bucket_tokens"][:len(buckets)] = buckets
    fwd["graph_execs"][:len(buckets)] = [graph_execs[b] for b in buckets]
    rec["control"] = control
    rec["consumed_gen"] = consumed_gen
    rec["corrupt_since"] = corrupt_since
    rec["scratch_slot"] = scratch_slot
    rec["staged_prompts"] = staged_prompts
    rec["vocab_size"] = vocab_size
    rec["context_length"] = context_length
    rec["kv_capacity_tokens"] = kv_capacity_tokens
    rec["num_eos"] = len(eos_ids)
    rec["eos_ids"][:len(eos_ids)] = eos_ids
    rec["corrupt_grace_ns"] = corrupt_grace_ns
    rec["idle_sleep_ns"] = idle_sleep_ns
    rec["step_log"] = step_log
    rec["step_log_capacity"] = step_log_capacity
    return rec


# ---------------------------------------------------------------------------------------------
# C view, generated for the scheduler kernel.

def c_header() -> str:
    out = [f"static constexpr int32_t {c_name(n)} = {v};"
           for n, v in (("MAX_SLOTS", MAX_SLOTS), ("MAX_BUCKETS", MAX_BUCKETS),
                        ("SCHEDULER_THREADS", SCHEDULER_THREADS))]
    out += ["static_assert(sizeof(void*) == 8, \"the host writes addresses as u64\");", ""]
    for dtype in STRUCTS:
        out += c_struct(dtype.metadata["c_name"], dtype) + [""]
    return c_header_text("blink.gpu_engine.engine_layout", "gpu_engine/engine_layout.py",
                         "tests/test_engine_layout.py", "blink::engine", out)


if __name__ == "__main__":
    header_main(sys.argv[1:], c_header(), Path(__file__).resolve().parent / "csrc" /
                "engine_layout.h")
