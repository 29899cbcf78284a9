// The persistent scheduler kernel: the CUDA engine's whole steady-state loop, on the GPU.
//
// One CTA. Each iteration: beat the heartbeat, consume new request slots from the ring (mapped
// host memory), honour cancel words, schedule a step (scheduler.cuh, the same decisions as
// gpu_engine/scheduler.py), write the batch description, launch the forward graph of the
// matching token bucket from the device, read the ring's stop, cancel and generation words for
// the next iteration while the graph runs, wait for it, append sampled tokens to the output
// records, check stops and retire sequences. After kMaxLaunchesPerRun launches it tail-launches
// its own graph and returns; all state is in device memory (EngineDevice).
//
// Every decision of the step (admission order, cancels, scheduling, the batch description,
// sample consumption, stops) is a scheduler.cuh function that tests/csrc/sched_replay.cc also
// runs against the Python engine's decisions; this file holds the mechanics around them.
//
// Ring memory is host memory mapped into the GPU, or GPU memory a NIC writes and reads by RDMA
// (--ring-memory gpu): either way others change it under the kernel, so every access to it goes
// through volatile pointers, and __threadfence_system() orders what the front end must see in
// order.
#include "device_loop.cuh"
#include "engine_layout.h"
#include "ring_layout.h"
#include "scheduler.cuh"

namespace blink {

// What the host shares with this kernel is generated from gpu_engine/engine_layout.py: the
// control block, the ring view, the forward pointer and bucket table, engine_init's and
// engine_sizes' arguments and the limits.
using engine::Control;
using engine::EngineInit;
using engine::EngineSizes;
using engine::ForwardPtrs;
using engine::kMaxBuckets;
using engine::RingView;
using engine::StepRecord;
using sched::kMaxSlots;  // ring slots at most (config_error refuses more)
using sched::SchedConfig;

static constexpr int kThreads = engine::kSchedulerThreads;

struct Counters {
  uint64_t requests_admitted, requests_finished, requests_cancelled, requests_rejected;
  uint64_t preemptions, tokens_generated, engine_steps, launch_retries, heartbeat;
  uint64_t busy_ns, step_tokens;  // steps that ran a forward: batch building to samples consumed
};


struct EngineDevice {
  sched::SchedState sched;
  ForwardPtrs fwd;
  RingView ring;
  Control* control;          // mapped host memory
  uint32_t* consumed_gen;    // [num_slots] last generation consumed per slot
  uint64_t* corrupt_since;   // [num_slots] globaltimer ns a CRC mismatch was first seen, 0 none
  uint8_t* scratch_slot;     // [slot_bytes] a candidate slot, copied out of mapped memory
  int32_t* staged_prompts;   // [num_slots, max_prompt_tokens] accepted prompts before add_seq
  uint32_t vocab_size, context_length, kv_capacity_tokens;
  int32_t num_eos;
  int32_t eos_ids[ring::kMaxEosIds];
  uint64_t corrupt_grace_ns;
  uint32_t idle_sleep_ns;
  StepRecord* step_log;  // [step_log_capacity] or null: step n at n % step_log_capacity
  uint32_t step_log_capacity;
  Counters counters;
  sched::StepPlan plan;
  // admission, per iteration: accepted requests (sorted by request id before add_seq)
  int32_t num_new;
  sched::Admission staged[kMaxSlots];
  int32_t row_slot[sched::kMaxStepSeqs];  // this step's logits rows' sequences (describe_batch)
  int32_t num_rows;
  uint64_t cache_salt_by_slot[kMaxSlots];  // admission: each accepted request's cache_salt
};
static_assert(sizeof(EngineInit::eos_ids) == sizeof(EngineDevice::eos_ids),
              "EngineInit carries the ring's kMaxEosIds EOS ids");

// --- mapped-memory access ----------------------------------------------------------------------

__device__ __forceinline__ uint32_t vload32(const uint8_t* p) {
  return *reinterpret_cast<const volatile uint32_t*>(p);
}
__device__ __forceinline__ void vstore32(uint8_t* p, uint32_t v) {
  *reinterpret_cast<volatile uint32_t*>(p) = v;
}
__device__ __forceinline__ void vstore64(uint8_t* p, uint64_t v) {
  *reinterpret_cast<volatile uint64_t*>(p) = v;
}

__device__ __forceinline__ ring::RingHeader* header(const EngineDevice& e) {
  return reinterpret_cast<ring::RingHeader*>(e.ring.base);
}
__device__ __forceinline__ uint8_t* slot_ptr(const EngineDevice& e, uint32_t i) {
  return e.ring.base + e.ring.slots_offset + static_cast<uint64_t>(i) * e.ring.slot_bytes;
}
__device__ __forceinline__ uint8_t* record_ptr(const EngineDevice& e, uint32_t i) {
  return e.ring.base + e.ring.records_offset + static_cast<uint64_t>(i) * e.ring.record_bytes;
}
#define FIELD(T, base, field) (reinterpret_cast<uint8_t*>(base) + offsetof(T, field))

// --- output records (ring_server.RingServer.open_record / append_token / finish) ----------------

__device__ void OpenRecord(const EngineDevice& e, int32_t slot, uint32_t gen, int32_t prompt_len) {
  uint8_t* r = record_ptr(e, slot);
  vstore32(FIELD(ring::OutputRecordFixed, r, num_tokens), 0);
  vstore32(FIELD(ring::OutputRecordFixed, r, finish_reason), 0);
  vstore32(FIELD(ring::OutputRecordFixed, r, detail), 0);
  vstore32(FIELD(ring::OutputRecordFixed, r, preemptions), 0);
  vstore32(FIELD(ring::OutputRecordFixed, r, cached_tokens), 0);
  vstore32(FIELD(ring::OutputRecordFixed, r, prompt_len), prompt_len);
  __threadfence_system();
  vstore32(FIELD(ring::OutputRecordFixed, r, gen), gen);  // published last
}

__device__ void FinishRecord(const EngineDevice& e, int32_t slot, uint32_t gen,
                             ring::FinishReason reason, uint32_t detail) {
  uint8_t* r = record_ptr(e, slot);
  if (vload32(FIELD(ring::OutputRecordFixed, r, gen)) != gen) OpenRecord(e, slot, gen, 0);
  vstore32(FIELD(ring::OutputRecordFixed, r, detail), detail);
  __threadfence_system();
  vstore32(FIELD(ring::OutputRecordFixed, r, finish_reason), static_cast<uint32_t>(reason));
}

// --- admission ---------------------------------------------------------------------------------

// Copies candidate slot `i` (fixed part + prompt) out of mapped memory into e.scratch_slot with
// the whole CTA (4-byte volatile loads, many in flight), checks its CRC (slot_crc_cta) and
// fields. Returns the reject reason (kNone: accepted; e.scratch_slot holds it), or -1 to wait
// (CRC wrong within the grace period: bytes of a completed write may still be landing). Not
// inlined: its loads in flight took the kernel from 88 to 96 registers a thread (the launch
// bounds, not -maxrregcount, cap an entry), and blink_hold_sm mirrors the footprint.
__device__ __noinline__ int ConsumeSlot(EngineDevice& e, uint32_t i, uint32_t gen) {
  __shared__ uint32_t s_crc_scratch[2 * kThreads + 256];
  __shared__ int s_tokens_ok, s_result;
  const uint8_t* slot = slot_ptr(e, i);
  const uint32_t fixed_words = sizeof(ring::RequestSlotFixed) / 4;
  uint32_t* words = reinterpret_cast<uint32_t*>(e.scratch_slot);
  for (uint32_t w = threadIdx.x; w < fixed_words; w += kThreads) words[w] = vload32(slot + 4 * w);
  if (threadIdx.x == 0) s_tokens_ok = 1;
  __syncthreads();
  const auto* f = reinterpret_cast<const ring::RequestSlotFixed*>(e.scratch_slot);
  const uint32_t plen = min(f->prompt_len, e.ring.max_prompt_tokens);
  const uint32_t vocab_size = e.vocab_size;  // (not reloaded after each store to words)
  bool ok = true;
  // kTokenLoads loads a thread in flight before any is used: a load then its store, one after
  // the other, waited a round trip over PCIe each (~9 a thread for a 2,100-token prompt)
  constexpr uint32_t kTokenLoads = 8;
  for (uint32_t base = threadIdx.x; base < plen; base += kTokenLoads * kThreads) {
    uint32_t tok[kTokenLoads];
#pragma unroll
    for (uint32_t j = 0; j < kTokenLoads; ++j) {
      const uint32_t t = base + j * kThreads;
      if (t < plen) tok[j] = vload32(slot + 4 * (fixed_words + t));
    }
#pragma unroll
    for (uint32_t j = 0; j < kTokenLoads; ++j) {
      const uint32_t t = base + j * kThreads;
      if (t < plen) {
        words[fixed_words + t] = tok[j];
        ok &= sched::token_in_vocab(static_cast<int32_t>(tok[j]), vocab_size);
      }
    }
  }
  if (!ok) s_tokens_ok = 0;
  __syncthreads();
  const uint32_t crc = sched::slot_crc_cta(
      gen, e.scratch_slot + ring::kPayloadStart,
      sizeof(ring::RequestSlotFixed) - ring::kPayloadStart + 4 * plen, s_crc_scratch);
  if (threadIdx.x == 0) {
    int result;
    if (crc != f->payload_crc) {
      const uint64_t now = global_timer_ns();
      if (e.corrupt_since[i] == 0) e.corrupt_since[i] = now;
      result = (now - e.corrupt_since[i] < e.corrupt_grace_ns)
                   ? -1 : static_cast<int>(ring::RejectReason::kCorrupt);
    } else {
      result = static_cast<int>(sched::validate_slot_scanned(
          *f, s_tokens_ok != 0, e.vocab_size, e.context_length, e.kv_capacity_tokens,
          e.ring.max_prompt_tokens));
    }
    if (result >= 0) e.corrupt_since[i] = 0;
    s_result = result;
  }
  __syncthreads();
  return s_result;
}

// What one pass over the ring's mapped memory found (ScanRing), in shared memory.
struct RingScan {
  uint32_t cancel_gen[kMaxSlots];  // each slot's cancel word
  int32_t candidates[kMaxSlots];   // the slots holding a complete new generation, any order
  uint32_t gens[kMaxSlots];        // and that generation
  int num_candidates;
  uint32_t stop;  // the control block's stop word
};

// Reads the control block's stop word and each slot's cancel word and generation (RingServer's
// side of the ring), the whole CTA. Every load a thread makes is issued before it uses one, so
// the pass costs one round trip to mapped memory (a second one only for the slots with a new
// generation, whose last word tells whether its write is complete). The scheduler makes the
// pass while a forward graph runs (scheduler_run), so that the next iteration finds it done:
// over PCIe a round trip is microseconds, and reading the stop word and then a round trip per
// slot a thread at the top of each iteration took 10 us a step. Measured on the H200
// (bench_serving --step-log, Llama-3.2-1B shape, 512 slots): the scheduler's time between one
// step's samples and the next step's batch 14.5 -> 6.1 us at one stream, 23.5 -> 15.0 at 32;
// time per output token at one stream 0.782 -> 0.772 ms.
__device__ void ScanRing(const EngineDevice& e, RingScan& scan) {
  // a thread's slots in passes of kSlotsAtOnce (its loads of a pass in flight together): every
  // slot of a ring of up to kSlotsAtOnce * kThreads slots in one pass, in registers the loop
  // around the forward graph has spare (the scheduler's footprint decides what fits beside it)
  constexpr int kSlotsAtOnce = 2;
  if (threadIdx.x == 0) scan.num_candidates = 0;
  __syncthreads();
  uint32_t stop = 0;  // stored once the slots' loads are issued, as they are used
  if (threadIdx.x == 0) stop = *reinterpret_cast<const volatile uint32_t*>(&e.control->stop);
  for (uint32_t first = threadIdx.x; first < e.ring.num_slots; first += kSlotsAtOnce * kThreads) {
    uint32_t cancel_gen[kSlotsAtOnce], gen[kSlotsAtOnce];
#pragma unroll
    for (int j = 0; j < kSlotsAtOnce; ++j) {
      const uint32_t i = first + j * kThreads;
      if (i < e.ring.num_slots) {
        const uint8_t* slot = slot_ptr(e, i);
        cancel_gen[j] = vload32(slot + offsetof(ring::RequestSlotFixed, cancel_gen));
        gen[j] = vload32(slot + offsetof(ring::RequestSlotFixed, seq_begin));
      }
    }
#pragma unroll
    for (int j = 0; j < kSlotsAtOnce; ++j) {
      const uint32_t i = first + j * kThreads;
      if (i >= e.ring.num_slots) continue;
      scan.cancel_gen[i] = cancel_gen[j];
      if (gen[j] == 0 || gen[j] == e.consumed_gen[i] ||  // (no front end writes 0: it wraps)
          gen[j] != vload32(slot_ptr(e, i) + e.ring.slot_bytes - 4))
        continue;
      const int k = atomicAdd(&scan.num_candidates, 1);
      scan.candidates[k] = static_cast<int32_t>(i);
      scan.gens[k] = gen[j];
    }
  }
  if (threadIdx.x == 0) scan.stop = stop;
  __syncthreads();
}

// Consumes every slot the scan found holding a complete new generation (RingServer.poll),
// then admits the accepted ones in request-id order (ReferenceEngine._admit: add_seq retires a
// stale sequence of a reused slot itself, so blocks are released in the same order as in
// Python), and the whole CTA copies their prompts into their token rows (thread 0 copying
// token after token took ~0.3 us a token: 0.6 ms for a 2,000-token prompt) and computes their
// blocks' prefix-cache keys and lookup hints (sched::prefix_keys_and_hints_cta).
__device__ void Admit(EngineDevice& e, const RingScan& scan) {
  if (threadIdx.x == 0) e.num_new = 0;
  bool rejected = false;  // (thread 0's)
  __syncthreads();
  for (int k = 0; k < scan.num_candidates; ++k) {
    const int32_t i = scan.candidates[k];
    const uint32_t gen = scan.gens[k];
    const int result = ConsumeSlot(e, i, gen);
    const auto* f = reinterpret_cast<const ring::RequestSlotFixed*>(e.scratch_slot);
    if (threadIdx.x == 0 && result >= 0) {
      e.consumed_gen[i] = gen;
      if (result != static_cast<int>(ring::RejectReason::kNone)) {
        FinishRecord(e, i, gen, ring::FinishReason::kRejected, result);
        ++e.counters.requests_rejected;
        rejected = true;
      } else {
        sched::Admission& r = e.staged[e.num_new];
        r.slot = i;
        r.gen = gen;
        r.arrival = f->request_id;
        r.prompt_len = static_cast<int32_t>(f->prompt_len);
        r.params = sched::params_from_slot(*f);
        e.cache_salt_by_slot[i] = f->cache_salt;
        r.prompt = e.staged_prompts + static_cast<size_t>(e.num_new) * e.ring.max_prompt_tokens;
        ++e.num_new;
      }
    }
    __syncthreads();
    if (result == static_cast<int>(ring::RejectReason::kNone)) {
      // the prompt waits in its staging row until add_seq: the slot's token row may still
      // belong to a stale sequence that add_seq retires
      int32_t* row = e.staged_prompts + static_cast<size_t>(e.num_new - 1) * e.ring.max_prompt_tokens;
      const int32_t* prompt = reinterpret_cast<const int32_t*>(e.scratch_slot + sizeof(ring::RequestSlotFixed));
      for (uint32_t t = threadIdx.x; t < f->prompt_len; t += kThreads) row[t] = prompt[t];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0 && rejected) {
    // A rejected new generation retires the sequence its slot held (StepCore.reject), in slot
    // order and before the admissions, as ReferenceEngine._admit: the slots whose live
    // sequence is of an older generation than the one just consumed, but for those staged
    // (their add_seq retires it in request-id order). Only after a rejection: it walks every
    // slot.
    for (int32_t i = 0; i < static_cast<int32_t>(e.ring.num_slots); ++i) {
      const sched::SeqState& q = e.sched.seqs[i];
      if (q.status == sched::SeqStatus::kFree || q.gen == e.consumed_gen[i]) continue;
      bool staged = false;
      for (int32_t k = 0; k < e.num_new && !staged; ++k) staged = e.staged[k].slot == i;
      if (!staged) sched::finish_seq(e.sched, i);
    }
  }
  if (threadIdx.x == 0) {
    sched::admit_in_order(e.sched, e.staged, e.num_new, e.cache_salt_by_slot,
                          [&](const sched::Admission& r, sched::AddResult) {
                            OpenRecord(e, r.slot, r.gen, r.prompt_len);
                            ++e.counters.requests_admitted;
                          }, /*copy_prompts=*/false);
  }
  __syncthreads();
  // (add_seq took every one: validate_slot keeps slots in range and prompts within the
  // context, below max_model_len)
  for (int a = 0; a < e.num_new; ++a) {
    const sched::Admission& r = e.staged[a];
    int32_t* row = sched::seq_tokens(e.sched, r.slot);
    for (int32_t t = threadIdx.x; t < r.prompt_len; t += kThreads) row[t] = r.prompt[t];
  }
  __syncthreads();
  // their prefix-cache keys and lookup hints, a thread a block, before schedule_step's
  // lookups
  for (int a = 0; a < e.num_new; ++a)
    sched::prefix_keys_and_hints_cta(e.sched, e.sched.seqs[e.staged[a].slot]);
}

// --- retirement and bookkeeping (thread 0) -----------------------------------------------------

__device__ void Retire(EngineDevice& e, int32_t slot, ring::FinishReason reason, uint32_t detail) {
  const uint32_t gen = e.sched.seqs[slot].gen;
  sched::finish_seq(e.sched, slot);
  FinishRecord(e, slot, gen, reason, detail);
  if (reason == ring::FinishReason::kCancelled) ++e.counters.requests_cancelled;
  else ++e.counters.requests_finished;
}

// cancel_gen: the words ScanRing read (one parallel pass over mapped memory, during the last
// forward graph, or at this iteration's start after an idle one). The whole CTA tests the
// slots, a warp's 32 slots into one ballot word (thread 0 walking every slot's state in device
// memory cost about 0.1 ms a step at 128-256 slots); thread 0 then retires the cancelled
// sequences in slot order, as before.
__device__ void HonourCancels(EngineDevice& e, const uint32_t* cancel_gen) {
  static_assert(kMaxSlots % 32 == 0, "whole ballot words");
  __shared__ uint32_t s_cancelled[kMaxSlots / 32];  // bit b of word w: slot 32 w + b
  const uint32_t num_slots = e.ring.num_slots, lane = threadIdx.x % 32;
  const uint32_t words = (num_slots + 31) / 32;
  for (uint32_t first = threadIdx.x - lane; first < 32 * words; first += kThreads) {
    const uint32_t i = first + lane;
    const bool cancel = i < num_slots && sched::cancel_requested(e.sched.seqs[i], cancel_gen[i]);
    const uint32_t mask = __ballot_sync(0xffffffffu, cancel);
    if (lane == 0) s_cancelled[first / 32] = mask;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (uint32_t w = 0; w < words; ++w)
      for (uint32_t m = s_cancelled[w]; m != 0; m &= m - 1)
        Retire(e, static_cast<int32_t>(32 * w + __ffs(m) - 1), ring::FinishReason::kCancelled, 0);
  }
  __syncthreads();
}

__device__ void PublishStats(EngineDevice& e) {
  uint8_t* h = e.ring.base;
  vstore32(FIELD(ring::RingHeader, h, kv_blocks_free), sched::pool_takeable(e.sched));
  vstore32(FIELD(ring::RingHeader, h, kv_blocks_cached), e.sched.num_cached);
  vstore64(FIELD(ring::RingHeader, h, prefix_query_tokens), e.sched.query_tokens);
  vstore64(FIELD(ring::RingHeader, h, prefix_hit_tokens), e.sched.hit_tokens);
  vstore64(FIELD(ring::RingHeader, h, prefix_evicted_blocks), e.sched.evicted_blocks);
  vstore32(FIELD(ring::RingHeader, h, sequences_running), e.sched.num_running);
  vstore32(FIELD(ring::RingHeader, h, sequences_waiting), e.sched.num_waiting);
  vstore64(FIELD(ring::RingHeader, h, requests_admitted), e.counters.requests_admitted);
  vstore64(FIELD(ring::RingHeader, h, requests_finished), e.counters.requests_finished);
  vstore64(FIELD(ring::RingHeader, h, requests_cancelled), e.counters.requests_cancelled);
  vstore64(FIELD(ring::RingHeader, h, requests_rejected), e.counters.requests_rejected);
  vstore64(FIELD(ring::RingHeader, h, preemptions), e.counters.preemptions);
  vstore64(FIELD(ring::RingHeader, h, tokens_generated), e.counters.tokens_generated);
  vstore64(FIELD(ring::RingHeader, h, engine_steps), e.counters.engine_steps);
  vstore64(FIELD(ring::RingHeader, h, busy_ns), e.counters.busy_ns);
  vstore64(FIELD(ring::RingHeader, h, step_tokens), e.counters.step_tokens);
}

// --- one forward step --------------------------------------------------------------------------

// Inclusive sums of a and of b over the CTA's threads in thread order (two scans at once);
// *total_a, *total_b: the whole CTA's. Every thread calls it.
__device__ void CtaInclusiveSums(int32_t& a, int32_t& b, int32_t* total_a, int32_t* total_b) {
  constexpr int kWarps = kThreads / kWarpSize;
  __shared__ int32_t s_warp[2][kWarps];
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  for (int o = 1; o < kWarpSize; o <<= 1) {
    const int32_t x = __shfl_up_sync(kFullMask, a, o), y = __shfl_up_sync(kFullMask, b, o);
    if (lane >= o) {
      a += x;
      b += y;
    }
  }
  if (lane == kWarpSize - 1) {
    s_warp[0][warp] = a;
    s_warp[1][warp] = b;
  }
  __syncthreads();
  int32_t sum_a = 0, sum_b = 0;
  for (int w = 0; w < kWarps; ++w) {
    if (w == warp) {
      a += sum_a;
      b += sum_b;
    }
    sum_a += s_warp[0][w];
    sum_b += s_warp[1][w];
  }
  *total_a = sum_a;
  *total_b = sum_b;
  __syncthreads();  // s_warp may be reused
}

// Writes the batch description of e.plan into the forward graphs' arrays, the whole CTA:
// describe_batch's entries a thread each (two CTA-wide sums give each entry's first token and
// logits row, as describe_batch's running sums do), then each entry's tokens and block table a
// warp each. (Thread 0 walking the entries one after another, each an L2 round trip or more,
// took 440 us a step at 256 sequences: --step-log's build time.)
__device__ int BuildBatch(EngineDevice& e) {
  static_assert(sched::kMaxStepSeqs <= kThreads, "a thread per plan entry");
  __shared__ int32_t s_start[sched::kMaxStepSeqs + 1];
  const sched::StepPlan& plan = e.plan;
  ForwardPtrs& f = e.fwd;
  const int n = plan.num_scheduled, k = threadIdx.x;
  const bool live = k < n;
  const int32_t new_tokens = live ? plan.num_new_tokens[k] : 0;
  const int32_t samples = live && sched::entry_samples(e.sched, plan, k) ? 1 : 0;
  int32_t tokens_through = new_tokens, rows_through = samples, num_tokens, num_rows;
  CtaInclusiveSums(tokens_through, rows_through, &num_tokens, &num_rows);
  if (k == 0) s_start[0] = 0;
  if (live) {
    sched::describe_entry(e.sched, plan, k, tokens_through - new_tokens, rows_through - samples,
                          {s_start, f.context_lens, f.logit_token, f.temperature, f.top_p,
                           f.top_k, f.seed, f.step, e.row_slot});
  }
  if (k == 0) {
    e.num_rows = num_rows;
    f.num_tokens[0] = num_tokens;
    f.num_tokens[1] = n;
    f.num_tokens[2] = num_rows;
  }
  __syncthreads();
  const int lane = threadIdx.x % kWarpSize;
  for (int j = threadIdx.x / kWarpSize; j < n; j += kThreads / kWarpSize) {
    const sched::SeqState& q = e.sched.seqs[plan.slots[j]];
    const int32_t* row = sched::seq_tokens(e.sched, q.slot);
    const int32_t first = s_start[j], computed = q.num_computed;
    for (int t = lane; t < plan.num_new_tokens[j]; t += kWarpSize) {
      f.token_ids[first + t] = row[computed + t];
      f.positions[first + t] = computed + t;
      f.token_seq[first + t] = j;
    }
    const int32_t* table = sched::block_table(e.sched, q.slot);
    for (int b = lane; b < q.num_blocks; b += kWarpSize)
      f.block_tables[j * f.max_blocks_per_seq + b] = table[b];
  }
  __threadfence();
  __syncthreads();
  return num_tokens;
}

__device__ int BucketFor(const ForwardPtrs& f, int num_tokens) {
  for (int b = 0; b < f.num_buckets; ++b)
    if (f.bucket_tokens[b] >= num_tokens) return b;
  return -1;
}

// Whole CTA, after the forward graph finished: tokens to records, stop checks, retirement.
// commit_step and consume_sample a thread per plan entry and logits row (their sequences are
// distinct, and they touch only their own), except commit_step's prefix_register, which shares
// the prefix cache: each entry's thread says whether it filled a block (a ballot bit) and thread
// 0 registers those entries in plan order (a decode step fills a block in one entry of
// block_size, so it walks a few entries, not all); each row's thread then stores its token and
// releases its count at system scope (a release store: no fence in the threads that store
// nothing, none between the phases; round 49 in docs/performance.md); then, after a barrier,
// thread 0 retires, in row order as the serial loop did (the rows whose history is full first,
// then the stops), since finish_seq's order is the KV blocks' order on the free list. A reader
// that sees a count sees its token; one that sees a finish reason sees the final count, which
// the barrier orders before FinishRecord's system fence (cumulative through it). (Thread 0
// consuming row after row took 390 us a step at 256 sequences: --step-log's finish time.)
__device__ void ConsumeSamples(EngineDevice& e) {
  static_assert(sched::kMaxStepSeqs <= kThreads, "a thread per logits row");
  __shared__ int32_t s_index[sched::kMaxStepSeqs];
  __shared__ bool s_taken[sched::kMaxStepSeqs];
  __shared__ sched::StopResult s_stop[sched::kMaxStepSeqs];
  static_assert(sched::kMaxStepSeqs % 32 == 0, "whole ballot words");
  __shared__ uint32_t s_fills[sched::kMaxStepSeqs / 32];  // bit b of word w: entry 32 w + b
  const int l = threadIdx.x, rows = e.num_rows;
  bool fills = false;
  if (l < e.plan.num_scheduled) {
    sched::commit_entry(e.sched, e.plan, l);
    fills = sched::prefix_has_new_blocks(e.sched, e.sched.seqs[e.plan.slots[l]]);
  }
  if (l < sched::kMaxStepSeqs) {
    const uint32_t mask = __ballot_sync(0xffffffffu, fills);
    if (l % 32 == 0) s_fills[l / 32] = mask;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 0; w < sched::kMaxStepSeqs / 32; ++w)
      for (uint32_t m = s_fills[w]; m != 0; m &= m - 1)
        sched::prefix_register(e.sched, e.sched.seqs[e.plan.slots[32 * w + __ffs(m) - 1]]);
  }
  __syncthreads();
  int32_t slot = 0, token = 0;
  bool taken = false;
  if (l < rows) {
    slot = e.row_slot[l];
    token = e.fwd.sampled[l];
    s_index[l] = e.sched.seqs[slot].num_output;
    taken = sched::consume_sample(e.sched, slot, token, e.eos_ids, e.num_eos, e.context_length,
                                  &s_stop[l]);
    s_taken[l] = taken;
  }
  const int generated = __syncthreads_count(taken);
  if (taken) {  // the token, then its count released after it
    vstore32(record_ptr(e, slot) + sizeof(ring::OutputRecordFixed) +
                 4 * static_cast<uint64_t>(s_index[l]), token);
    StoreReleaseSys(reinterpret_cast<uint32_t*>(
                        FIELD(ring::OutputRecordFixed, record_ptr(e, slot), num_tokens)),
                    s_index[l] + 1);
  }
  __syncthreads();  // the counts before thread 0's finish reasons (FinishRecord's fence)
  if (threadIdx.x == 0) {
    e.counters.tokens_generated += generated;
    for (int i = 0; i < rows; ++i) {  // its row is full (stop_check prevents it): end it
      if (!s_taken[i]) Retire(e, e.row_slot[i], ring::FinishReason::kContextFull, 0);
    }
    for (int i = 0; i < rows; ++i) {
      if (s_taken[i] && s_stop[i].reason != ring::FinishReason::kNone)
        Retire(e, e.row_slot[i], s_stop[i].reason, s_stop[i].detail);
    }
  }
  __syncthreads();
}

}  // namespace blink

using namespace blink;

__device__ __forceinline__ void SetControl(uint32_t* word, uint32_t v) {
  __threadfence_system();
  *reinterpret_cast<volatile uint32_t*>(word) = v;
}

extern "C" __global__ void __launch_bounds__(kThreads, 1) scheduler_run(EngineDevice* e) {
  __shared__ int s_bucket;
  __shared__ RingScan s_scan;
  if (threadIdx.x == 0) SetControl(&e->control->runs, e->control->runs + 1);
  bool scanned = false;  // s_scan is this iteration's: the pass ran during the last forward
  for (int launches = 0; launches < kMaxLaunchesPerRun;) {
    if (!scanned) ScanRing(*e, s_scan);
    scanned = false;
    const uint64_t iteration_start = threadIdx.x == 0 ? global_timer_ns() : 0;  // step log
    if (threadIdx.x == 0) {
      vstore64(FIELD(ring::RingHeader, e->ring.base, heartbeat), ++e->counters.heartbeat);
    }
    if (s_scan.stop) {
      if (threadIdx.x == 0) {
        PublishStats(*e);
        SetControl(&e->control->exited, 1);
      }
      return;
    }
    Admit(*e, s_scan);
    HonourCancels(*e, s_scan.cancel_gen);
    if (threadIdx.x == 0) {
      sched::schedule_step(e->sched, e->plan);
      for (int p = 0; p < e->plan.num_preempted; ++p) {
        const int32_t slot = e->plan.preempted[p];
        ++e->counters.preemptions;
        vstore32(FIELD(ring::OutputRecordFixed, record_ptr(*e, slot), preemptions),
                 e->sched.seqs[slot].preemptions);
      }
      for (int k = e->plan.num_scheduled - e->plan.num_admitted; k < e->plan.num_scheduled; ++k) {
        const int32_t slot = e->plan.slots[k];
        vstore32(FIELD(ring::OutputRecordFixed, record_ptr(*e, slot), cached_tokens),
                 e->sched.seqs[slot].cached_tokens);
      }
      PublishStats(*e);
    }
    __syncthreads();
    if (e->plan.num_scheduled == 0) {
      __nanosleep(e->idle_sleep_ns);
      continue;
    }
    const uint64_t step_start = global_timer_ns();
    const int num_tokens = BuildBatch(*e);
    uint64_t launched_at = 0, done_at = 0;  // thread 0's: for the step log
    uint32_t retries = 0, target = 0;
    if (threadIdx.x == 0) {
      launched_at = global_timer_ns();
      s_bucket = BucketFor(e->fwd, num_tokens);
      if (s_bucket < 0) {
        SetControl(reinterpret_cast<uint32_t*>(&e->control->error), 0xFFFFFFFFu);  // no bucket: a host bug
      } else {
        target = LoadAcquireGpu(e->fwd.done_counter) + 1;
        const cudaError_t err = LaunchGraphRetrying(
            reinterpret_cast<cudaGraphExec_t>(e->fwd.graph_execs[s_bucket]), &retries);
        e->counters.launch_retries += retries;
        if (err != cudaSuccess) {
          SetControl(reinterpret_cast<uint32_t*>(&e->control->error), err);
          s_bucket = -1;
        }
      }
    }
    // the next iteration's pass over the ring, while the forward graph runs (thread 0 joins
    // it after the launch: the graph does not wait for it)
    ScanRing(*e, s_scan);
    scanned = true;
    if (threadIdx.x == 0 && s_bucket >= 0) {
      WaitCounter(e->fwd.done_counter, target);
      done_at = global_timer_ns();
    }
    __syncthreads();
    if (s_bucket < 0) {  // unrecoverable: stop so the host sees the error word
      if (threadIdx.x == 0) SetControl(&e->control->exited, 1);
      return;
    }
    ConsumeSamples(*e);
    if (threadIdx.x == 0) {
      const uint64_t end = global_timer_ns();
      if (e->step_log != nullptr) {
        e->step_log[e->counters.engine_steps % e->step_log_capacity] = StepRecord{
            step_start, static_cast<uint32_t>(num_tokens),
            static_cast<uint32_t>(e->plan.num_scheduled), static_cast<uint32_t>(e->num_rows),
            static_cast<uint32_t>(e->fwd.bucket_tokens[s_bucket]),
            static_cast<uint32_t>(launched_at - step_start),
            static_cast<uint32_t>(done_at - launched_at), static_cast<uint32_t>(end - done_at),
            retries, static_cast<uint32_t>(step_start - iteration_start)};
      }
      ++e->counters.engine_steps;
      e->counters.busy_ns += end - step_start;
      e->counters.step_tokens += num_tokens;
    }
    ++launches;
  }
  if (threadIdx.x == 0) {
    const cudaError_t err = RelaunchSelf();
    if (err != cudaSuccess) {
      SetControl(reinterpret_cast<uint32_t*>(&e->control->error), 1000 + err);
      SetControl(&e->control->exited, 1);
    }
  }
}

// --- set-up, called once by the host before the first launch of scheduler_run -----------------

// Sizes the host allocates, and whether the scheduler takes the config.
extern "C" __global__ void engine_sizes(const SchedConfig* config, EngineSizes* out) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  out->engine_bytes = sizeof(EngineDevice);
  out->sched_bytes = sched::state_layout(*config).total_bytes;
  out->max_blocks_per_seq = sched::max_blocks_per_seq(*config);
  out->config_ok = sched::config_error(*config) == nullptr ? 1 : 0;
}

// Fills an EngineDevice (one thread) from the record the host uploaded (EngineInit, in device
// memory; the host validated it and may free it once this kernel has finished).
extern "C" __global__ void engine_init(EngineDevice* e, void* sched_mem, const EngineInit* init) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  *e = EngineDevice{};
  sched::state_bind(e->sched, init->sched, sched_mem);
  sched::state_init(e->sched);
  e->fwd = init->fwd;
  e->fwd.num_buckets = min(init->fwd.num_buckets, kMaxBuckets);
  e->ring = init->ring;
  e->control = init->control;
  e->consumed_gen = init->consumed_gen;
  e->corrupt_since = init->corrupt_since;
  e->scratch_slot = init->scratch_slot;
  e->staged_prompts = init->staged_prompts;
  e->vocab_size = init->vocab_size;
  e->context_length = init->context_length;
  e->kv_capacity_tokens = init->kv_capacity_tokens;
  e->num_eos = min(init->num_eos, static_cast<int32_t>(ring::kMaxEosIds));
  for (int i = 0; i < e->num_eos; ++i) e->eos_ids[i] = init->eos_ids[i];
  e->corrupt_grace_ns = init->corrupt_grace_ns;
  e->idle_sleep_ns = init->idle_sleep_ns;
  e->step_log = init->step_log_capacity > 0 ? init->step_log : nullptr;
  e->step_log_capacity = init->step_log_capacity;
  for (int32_t i = 0; i < init->sched.num_slots; ++i) {
    e->consumed_gen[i] = 0;
    e->corrupt_since[i] = 0;
  }
}
