// The scheduler's decisions as plain structs and __host__ __device__ functions.
//
// The same source builds with g++ for the CPU parity tests (tests/test_scheduler_parity.py drives
// it and the Python reference with the same random workloads and asserts identical decisions)
// and with nvcc inside the single-CTA persistent scheduler kernel. Every function here mirrors
// one Python function, named in its comment; "exactly" means the same plans, the same block ids
// in the same block tables, the same stop and reject reasons, bit-identical CRCs and uniforms.
//
// Rules of this header: no dynamic allocation, no STL, no exceptions, no globals that change.
// All mutable state lives in caller-provided arrays (device memory on the GPU) reached through
// one `SchedState`; carve them from one buffer with `state_layout` + `state_bind`.
//
// Threading: everything is serial (called by one thread, thread 0 of the scheduler CTA) except
// the `*_cta` functions at the end, which every thread of the CTA calls together,
// `prompt_tokens_in_range`, which each thread may call on its own strided share, and the
// per-entry pieces of a step (`entry_samples`, `describe_entry`, `commit_entry`, and
// `consume_sample` for one logits row), which touch only their own sequence: a thread each.
//
// Cost on one H200 thread (1.98 GHz), 256 running sequences, state in global memory: a decode
// step's schedule_step + commit_step ~137 k cycles (~0.27 us a sequence; ~108 k when the caller
// works on a register copy of SchedState, ~92 k with seqs/queues/free list/plan in shared
// memory), a 256-sequence prefill admission ~600 k. finish_seq shifts `running` (one L2 round
// trip per element moved: ~200 k cycles for the oldest of 256). Serial code over global memory
// pays an L2 round trip (~700 cycles) for each load that follows a store to the same line.
//
// One engine iteration, as gpu_engine/reference_engine.py ReferenceEngine.step does it (the
// step contract section below holds every decision that is not schedule_step's):
//   validate_slot each consumed slot, then admit_in_order   (add_seq, request-id order)
//   for each slot where cancel_requested:        finish_seq   (FinishReason::kCancelled)
//   schedule_step(state, plan)                   plan.preempted: publish their preemptions
//   describe_batch(state, plan) (before commit_step), run the forward pass
//   commit_step(state, plan)
//   consume_sample for each logits row           finish_seq when the reason is not kNone
#pragma once
#include <stddef.h>
#include <stdint.h>

#include "counter_rng.cuh"  // also defines BLINK_HD (__host__ __device__ under nvcc)
#include "engine_layout.h"  // SchedConfig and kMaxSlots, shared with the host
#include "ring_layout.h"

// Sequences one step can schedule or preempt: StepPlan's arrays are this long, and a config
// with max_num_seqs above it is refused (config_error). Override before including if needed.
#ifndef BLINK_SCHED_MAX_STEP_SEQS
#define BLINK_SCHED_MAX_STEP_SEQS 256
#endif

namespace blink::sched {

using ring::FinishReason;
using ring::RejectReason;
using ring::RequestSlotFixed;

static constexpr int32_t kMaxStepSeqs = BLINK_SCHED_MAX_STEP_SEQS;

// The prefix cache's serial walks (release, lookup, registration), each a loop of its own that
// one thread runs now and then: not inlined into the scheduler kernel, whose registers they
// took from 86 to 128 a thread (its CTA shares its SM with the forward's, and blink_hold_sm
// mirrors its footprint). As calls: 88.
#if defined(__CUDACC__)
#define BLINK_SCHED_CALL __noinline__
#else
#define BLINK_SCHED_CALL inline
#endif
// Ring slots at most: a bound for callers' fixed-size per-slot arrays (the kernel's shared-memory
// admission lists). Nothing in this header needs it, but config_error enforces it so that one
// check covers both. Generated (gpu_engine/engine_layout.py): the host refuses more slots too.
static constexpr int32_t kMaxSlots = engine::kMaxSlots;
static constexpr uint32_t kMaxStopIds = ring::kMaxStopIds;

BLINK_HD inline int32_t min_i32(int32_t a, int32_t b) { return a < b ? a : b; }

// block_manager.blocks_for
BLINK_HD inline int32_t blocks_for(int32_t num_tokens, int32_t block_size) {
  return (num_tokens + block_size - 1) / block_size;
}

// ---------------------------------------------------------------------------------------------
// Configuration and state

// SchedulerConfig + KvBlockPool sizes + the arrays' dimensions. Fixed for the engine's life. The
// host fills it, so its layout is generated (engine_layout.h): num_slots, max_model_len,
// block_size, num_blocks, max_num_seqs, max_num_batched_tokens.
using engine::SchedConfig;

// Block-table width: a sequence within max_model_len never needs more.
BLINK_HD inline int32_t max_blocks_per_seq(const SchedConfig& c) {
  return blocks_for(c.max_model_len, c.block_size);
}

// nullptr when usable; else why not (SchedulerConfig.__post_init__ and KvBlockPool's checks,
// plus the bounds this header's fixed-size arrays need).
BLINK_HD inline const char* config_error(const SchedConfig& c) {
  if (c.num_slots < 1 || c.num_slots > kMaxSlots) return "num_slots must be in [1, kMaxSlots]";
  if (c.max_num_seqs < 1 || c.max_num_batched_tokens < 1 || c.max_model_len < 2)
    return "max_num_seqs, max_num_batched_tokens must be >= 1 and max_model_len >= 2";
  if (c.num_blocks < 1 || c.block_size < 1) return "the KV pool needs blocks";
  if (c.max_num_seqs > kMaxStepSeqs) return "max_num_seqs exceeds BLINK_SCHED_MAX_STEP_SEQS";
  if (c.prefix_caching != 0 && c.prefix_caching != 1) return "prefix_caching must be 0 or 1";
  if (c.num_blocks > (1 << 29)) return "num_blocks must be at most 2^29";
  return nullptr;
}

enum class SeqStatus : uint32_t {
  kFree = 0,     // the slot holds no sequence (never admitted, or finished)
  kWaiting = 1,  // in `waiting`, holds no KV blocks (new, or preempted for recompute)
  kRunning = 2,  // in `running`, holds KV blocks for its computed tokens
};

// sequence.SamplingParams, as the slot carried it (params_from_slot).
struct SamplingParams {
  uint64_t seed;
  uint32_t max_tokens;
  float temperature;
  float top_p;
  int32_t top_k;                     // 0: off
  uint32_t ignore_eos;               // 0 or 1
  uint32_t num_stop_ids;             // <= kMaxStopIds
  int32_t stop_ids[ring::kMaxStopIds];
};

// sequence.Sequence, one per ring slot (seqs[slot]). The token history (prompt then output) is
// in state.tokens, the block table in state.block_tables (see SchedState).
struct SeqState {
  uint64_t arrival;       // front end's request id: FCFS order
  uint64_t cache_salt;    // the slot's cache_salt word: its prefix-cache namespace (prefix_root)
  uint32_t gen;           // the slot's generation for this request
  int32_t slot;           // == its index in seqs[]
  int32_t prompt_len;
  int32_t num_tokens;     // prompt_len + num_output
  // Tokens whose K/V are in this sequence's blocks. num_computed <= num_tokens; the sequence
  // samples exactly when a step brings num_computed up to num_tokens.
  int32_t num_computed;
  int32_t num_output;
  int32_t num_blocks;     // entries used in its block-table row
  // Its first num_keyed full computed blocks have a prefix-cache uid (the row of
  // SchedState.seq_block_uids; Sequence.block_uids); 0 while it holds no blocks.
  int32_t num_keyed;
  // Its first num_hashed blocks' keys are in its row of SchedState.seq_block_keys (the tokens
  // never change, so they outlive a preemption).
  int32_t num_hashed;
  // While it waits unadmitted: its first num_hinted blocks have a lookup hint in its rows
  // (prefix_hint_block), which prefix_match checks before it probes; 0 once it holds blocks.
  int32_t num_hinted;
  int32_t cached_tokens;  // prompt tokens its first admission took from the prefix cache
  uint32_t preemptions;
  SeqStatus status;
  SamplingParams params;
};

// Everything the scheduler owns. The struct itself lives in device memory too, so the
// persistent kernel's tail-launched successors continue from its counters.
struct SchedState {
  SchedConfig cfg;
  // max_blocks_per_seq(cfg), kept so no hot path divides: one GPU thread pays ~100 cycles for
  // an integer division by a runtime value.
  int32_t blocks_per_seq;
  SeqState* seqs;          // [num_slots]
  int32_t* tokens;         // [num_slots, max_model_len]: row `slot` = prompt then output
  int32_t* block_tables;   // [num_slots, max_blocks_per_seq]: row `slot`, first num_blocks valid
  // The KV pool's free list as a stack, top at free_blocks[num_free - 1]; reproduces
  // KvBlockPool's deque (popleft to grow, extendleft(reversed(table)) to release).
  int32_t* free_blocks;    // [num_blocks]
  int32_t num_free;
  int32_t* running;        // [num_slots]: slots, admission order (Scheduler.running)
  int32_t num_running;
  // Scheduler.waiting as a ring buffer: element i is waiting[(waiting_head + i) % num_slots].
  // A slot is in at most one queue at most once, so num_slots entries always suffice.
  int32_t* waiting;        // [num_slots]
  int32_t waiting_head;
  int32_t num_waiting;
  // The prefix cache (KvBlockPool's refs, cache and evictable queue). A cached block is known
  // by (the uid of the cached block before it, or for a first block its sequence's root,
  // prefix_root: 0 unless salted; its tokens); `cache_table` finds it by a 64-bit key of the
  // tokens up to its end (prefix_key, chained over the blocks from prefix_root_key), and every
  // candidate's parent uid and tokens are compared, so a key collision costs a probe, never a
  // wrong block. (A key of the tokens rather than of the parent uid lets a sequence's keys be
  // computed once, before any lookup, and kept.)
  int32_t* block_refs;     // [num_blocks] block tables holding each block
  uint64_t* block_uid;     // [num_blocks] its cache uid; 0: not cached
  uint64_t* block_parent;  // [num_blocks] cached: the uid before it (first: the root)
  uint64_t* block_key;     // [num_blocks] cached: its key (the sequence's seq_block_keys)
  int32_t* block_tokens;   // [num_blocks, block_size] cached: its tokens
  // Cached blocks no table holds, least recently released first (KvBlockPool._evictable): a
  // doubly linked list through lru_prev / lru_next, -1 at its ends.
  int32_t* lru_prev;       // [num_blocks]
  int32_t* lru_next;       // [num_blocks]
  int32_t lru_head, lru_tail, num_evictable;
  // Open addressing with linear probing: block ids, -1 empty; at most half full.
  int32_t* cache_table;    // [cache_table_size(cfg)]
  uint32_t cache_mask;     // cache_table_size - 1
  int32_t num_cached;
  uint64_t* seq_block_uids;  // [num_slots, max_blocks_per_seq]: row `slot`, first num_keyed
  uint64_t* seq_block_keys;  // [num_slots, max_blocks_per_seq]: row `slot`, first num_hashed
  uint64_t next_uid;
  // Counters (KvBlockPool's): tokens of admitted sequences looked up, found, blocks evicted.
  uint64_t query_tokens, hit_tokens, evicted_blocks;
};

// Byte offsets of SchedState's arrays inside one buffer, each 256-byte aligned (its own cache
// lines). The buffer must be at least 8-byte aligned (SeqState holds u64s); cudaMalloc's are 256.
struct StateLayout {
  size_t seqs, tokens, block_tables, free_blocks, running, waiting;
  size_t block_refs, block_uid, block_parent, block_key, block_tokens, lru_prev, lru_next;
  size_t cache_table, seq_block_uids, seq_block_keys;
  size_t total_bytes;
};

BLINK_HD inline size_t align256(size_t n) { return (n + 255) & ~static_cast<size_t>(255); }

// The prefix cache's table: the power of two at least twice num_blocks (at most half full, so
// a probe ends within a few entries).
BLINK_HD inline uint32_t cache_table_size(const SchedConfig& c) {
  uint32_t n = 2;
  while (n < 2u * static_cast<uint32_t>(c.num_blocks)) n <<= 1;
  return n;
}

BLINK_HD inline StateLayout state_layout(const SchedConfig& c) {
  const size_t slots = static_cast<size_t>(c.num_slots);
  StateLayout l;
  l.seqs = 0;
  l.tokens = align256(l.seqs + slots * sizeof(SeqState));
  l.block_tables = align256(l.tokens + slots * static_cast<size_t>(c.max_model_len) * 4);
  l.free_blocks = align256(l.block_tables + slots * static_cast<size_t>(max_blocks_per_seq(c)) * 4);
  l.running = align256(l.free_blocks + static_cast<size_t>(c.num_blocks) * 4);
  l.waiting = align256(l.running + slots * 4);
  const size_t blocks = static_cast<size_t>(c.num_blocks);
  l.block_refs = align256(l.waiting + slots * 4);
  l.block_uid = align256(l.block_refs + blocks * 4);
  l.block_parent = align256(l.block_uid + blocks * 8);
  l.block_key = align256(l.block_parent + blocks * 8);
  l.block_tokens = align256(l.block_key + blocks * 8);
  l.lru_prev = align256(l.block_tokens + blocks * static_cast<size_t>(c.block_size) * 4);
  l.lru_next = align256(l.lru_prev + blocks * 4);
  l.cache_table = align256(l.lru_next + blocks * 4);
  l.seq_block_uids = align256(l.cache_table + static_cast<size_t>(cache_table_size(c)) * 4);
  const size_t seq_words = slots * static_cast<size_t>(max_blocks_per_seq(c)) * 8;
  l.seq_block_keys = align256(l.seq_block_uids + seq_words);
  l.total_bytes = align256(l.seq_block_keys + seq_words);
  return l;
}

// Points s's arrays into `mem` (state_layout(c).total_bytes bytes). Does not initialise them.
BLINK_HD inline void state_bind(SchedState& s, const SchedConfig& c, void* mem) {
  const StateLayout l = state_layout(c);
  char* base = static_cast<char*>(mem);
  s.cfg = c;
  s.blocks_per_seq = max_blocks_per_seq(c);
  s.seqs = reinterpret_cast<SeqState*>(base + l.seqs);
  s.tokens = reinterpret_cast<int32_t*>(base + l.tokens);
  s.block_tables = reinterpret_cast<int32_t*>(base + l.block_tables);
  s.free_blocks = reinterpret_cast<int32_t*>(base + l.free_blocks);
  s.running = reinterpret_cast<int32_t*>(base + l.running);
  s.waiting = reinterpret_cast<int32_t*>(base + l.waiting);
  s.block_refs = reinterpret_cast<int32_t*>(base + l.block_refs);
  s.block_uid = reinterpret_cast<uint64_t*>(base + l.block_uid);
  s.block_parent = reinterpret_cast<uint64_t*>(base + l.block_parent);
  s.block_key = reinterpret_cast<uint64_t*>(base + l.block_key);
  s.block_tokens = reinterpret_cast<int32_t*>(base + l.block_tokens);
  s.lru_prev = reinterpret_cast<int32_t*>(base + l.lru_prev);
  s.lru_next = reinterpret_cast<int32_t*>(base + l.lru_next);
  s.cache_table = reinterpret_cast<int32_t*>(base + l.cache_table);
  s.cache_mask = cache_table_size(c) - 1;
  s.seq_block_uids = reinterpret_cast<uint64_t*>(base + l.seq_block_uids);
  s.seq_block_keys = reinterpret_cast<uint64_t*>(base + l.seq_block_keys);
}

BLINK_HD inline int32_t* seq_tokens(const SchedState& s, int32_t slot) {
  return s.tokens + static_cast<size_t>(slot) * static_cast<size_t>(s.cfg.max_model_len);
}

// Row `slot` of one of the [num_slots, max_blocks_per_seq] arrays (block_tables,
// seq_block_uids, seq_block_keys).
template <class T>
BLINK_HD inline T* block_row(const SchedState& s, T* rows, int32_t slot) {
  return rows + static_cast<size_t>(slot) * static_cast<size_t>(s.blocks_per_seq);
}

BLINK_HD inline int32_t* block_table(const SchedState& s, int32_t slot) {
  return block_row(s, s.block_tables, slot);
}

BLINK_HD inline uint64_t* block_uids(const SchedState& s, int32_t slot) {
  return block_row(s, s.seq_block_uids, slot);
}

// ---------------------------------------------------------------------------------------------
// The prefix cache's table and evictable queue (KvBlockPool.cached and ._evictable)

// A block's 64-bit key: the key of the block before it (a seed for the first) mixed with the
// block's digest, splitmix64 folded over its tokens from the seed, so the key stands for every
// token up to the block's end. A digest depends on its block alone: a new prompt's are computed
// all at once (prefix_keys_and_hints_cta, a thread a block), and one splitmix64 a block is left
// serial (a chain folded over every token took one GPU thread ~120 us for 2,000 tokens).
// Override the mask (tests/test_scheduler_parity.py builds the replay with a 2-bit key) to make
// every lookup probe through colliding keys: the decisions must not change.
#ifndef BLINK_PREFIX_KEY_MASK
#define BLINK_PREFIX_KEY_MASK 0xffffffffffffffffull
#endif
static constexpr uint64_t kPrefixKeySeed = 0x424c494e4b505843ull;  // "BLINKPXC"

BLINK_HD inline uint64_t prefix_block_digest(const int32_t* tokens, int32_t n) {
  uint64_t h = kPrefixKeySeed;
  for (int32_t i = 0; i < n; ++i) h = splitmix64(h ^ static_cast<uint32_t>(tokens[i]));
  return h;
}

BLINK_HD inline uint64_t prefix_key(uint64_t previous_key, uint64_t digest) {
  return splitmix64(previous_key ^ digest);
}

// The uid q's first block hangs from (block_manager.prefix_root): 0, or q's cache salt with
// the top bit set, which no uid reaches (they count up from 1), so sequences of different
// salts share no cached block, while one salt's sequences share theirs as unsalted ones do.
BLINK_HD inline uint64_t prefix_root(const SeqState& q) {
  return q.cache_salt == 0 ? 0 : q.cache_salt | (1ull << 63);
}

// The key q's first block is chained from: the seed, mixed with the root where q has a salt,
// so that another salt's blocks of the same tokens sit under other keys (they would fail the
// parent comparison anyway: this only spares the probes).
BLINK_HD inline uint64_t prefix_root_key(const SeqState& q) {
  const uint64_t root = prefix_root(q);
  return root == 0 ? kPrefixKeySeed : splitmix64(kPrefixKeySeed ^ root);
}

// The key of q's block j (its tokens must be known), computing the keys of its blocks up to j
// that are not yet in its row. Serial: the chain goes block by block.
BLINK_HD inline uint64_t seq_block_key(const SchedState& s, SeqState& q, int32_t j) {
  uint64_t* keys = block_row(s, s.seq_block_keys, q.slot);
  const int32_t bs = s.cfg.block_size;
  const int32_t* tokens = seq_tokens(s, q.slot);
  for (; q.num_hashed <= j; ++q.num_hashed) {
    const int32_t k = q.num_hashed;
    keys[k] = prefix_key(k > 0 ? keys[k - 1] : prefix_root_key(q),
                         prefix_block_digest(tokens + k * bs, bs));
  }
  return keys[j] & static_cast<uint64_t>(BLINK_PREFIX_KEY_MASK);
}

BLINK_HD inline const int32_t* cached_tokens_of(const SchedState& s, int32_t block) {
  return s.block_tokens + static_cast<size_t>(block) * static_cast<size_t>(s.cfg.block_size);
}

// The cached block with this identity (parent uid, tokens) under `key`, or -1; any_parent: the
// first with the key and tokens, whatever its parent (prefix_hint_block). The token comparison
// reads every token without an early exit, so its loads are in flight together (one round trip
// to memory, not one a token).
BLINK_HD inline int32_t cache_find(const SchedState& s, uint64_t key, uint64_t parent_uid,
                                   const int32_t* tokens, bool any_parent = false) {
  for (uint32_t i = static_cast<uint32_t>(key) & s.cache_mask;; i = (i + 1) & s.cache_mask) {
    const int32_t b = s.cache_table[i];
    if (b < 0) return -1;
    if (s.block_key[b] != key || (!any_parent && s.block_parent[b] != parent_uid)) continue;
    const int32_t* have = cached_tokens_of(s, b);
    int32_t differ = 0;
#if defined(__CUDA_ARCH__)
#pragma unroll 16
#endif
    for (int32_t t = 0; t < s.cfg.block_size; ++t) differ |= have[t] ^ tokens[t];
    if (differ == 0) return b;
  }
}

BLINK_HD inline void cache_insert(SchedState& s, int32_t block) {
  uint32_t i = static_cast<uint32_t>(s.block_key[block]) & s.cache_mask;
  while (s.cache_table[i] >= 0) i = (i + 1) & s.cache_mask;
  s.cache_table[i] = block;
}

// Removes `block` from the table, shifting later entries of its probe run back into the hole
// (linear probing's deletion without tombstones: every entry stays reachable from its home).
BLINK_HD inline void cache_erase(SchedState& s, int32_t block) {
  const uint32_t mask = s.cache_mask;
  uint32_t hole = static_cast<uint32_t>(s.block_key[block]) & mask;
  while (s.cache_table[hole] != block) hole = (hole + 1) & mask;
  for (uint32_t j = (hole + 1) & mask; s.cache_table[j] >= 0; j = (j + 1) & mask) {
    const uint32_t home = static_cast<uint32_t>(s.block_key[s.cache_table[j]]) & mask;
    // the entry at j may fill the hole unless its home lies cyclically in (hole, j]
    const bool stays = hole <= j ? (hole < home && home <= j) : (hole < home || home <= j);
    if (stays) continue;
    s.cache_table[hole] = s.cache_table[j];
    hole = j;
  }
  s.cache_table[hole] = -1;
}

BLINK_HD inline void lru_push_back(SchedState& s, int32_t block) {
  s.lru_prev[block] = s.lru_tail;
  s.lru_next[block] = -1;
  if (s.lru_tail >= 0) s.lru_next[s.lru_tail] = block;
  else s.lru_head = block;
  s.lru_tail = block;
  ++s.num_evictable;
}

BLINK_HD inline void lru_unlink(SchedState& s, int32_t block) {
  const int32_t prev = s.lru_prev[block], next = s.lru_next[block];
  if (prev >= 0) s.lru_next[prev] = next;
  else s.lru_head = next;
  if (next >= 0) s.lru_prev[next] = prev;
  else s.lru_tail = prev;
  --s.num_evictable;
}

// ---------------------------------------------------------------------------------------------
// KV block pool (block_manager.KvBlockPool)

// KvBlockPool.__init__: deque(range(n)) pops 0 first, so block 0 goes on top of the stack.
BLINK_HD inline void pool_init(SchedState& s) {
  for (int32_t i = 0; i < s.cfg.num_blocks; ++i) {
    s.free_blocks[i] = s.cfg.num_blocks - 1 - i;
    s.block_refs[i] = 0;
    s.block_uid[i] = 0;
  }
  s.num_free = s.cfg.num_blocks;
  for (uint32_t i = 0; i <= s.cache_mask; ++i) s.cache_table[i] = -1;
  s.lru_head = s.lru_tail = -1;
  s.num_evictable = 0;
  s.num_cached = 0;
  s.next_uid = 1;
  s.query_tokens = s.hit_tokens = s.evicted_blocks = 0;
}

// KvBlockPool.num_free: blocks a sequence can take (free, or cached and evictable).
BLINK_HD inline int32_t pool_takeable(const SchedState& s) { return s.num_free + s.num_evictable; }

// KvBlockPool._take: a free block, else the least recently released cached one (evicted).
BLINK_HD inline int32_t pool_take(SchedState& s) {
  int32_t b;
  if (s.num_free > 0) {
    b = s.free_blocks[--s.num_free];
  } else {
    b = s.lru_head;
    lru_unlink(s, b);
    cache_erase(s, b);
    s.block_uid[b] = 0;
    --s.num_cached;
    ++s.evicted_blocks;
  }
  s.block_refs[b] = 1;
  return b;
}

// KvBlockPool.can_grow. The fast path (the blocks held already suffice: Python's need <= 0,
// always <= num_free) needs no division, so a decode step divides only at block boundaries.
// One guard Python has no need for: a row of the block-table array cannot grow past
// blocks_per_seq, which a sequence of <= max_model_len tokens never reaches.
BLINK_HD inline bool pool_can_grow(const SchedState& s, const SeqState& q, int32_t num_tokens) {
  if (num_tokens <= q.num_blocks * s.cfg.block_size) return true;
  const int32_t want = blocks_for(num_tokens, s.cfg.block_size);
  if (want > s.blocks_per_seq) return false;
  return want - q.num_blocks <= pool_takeable(s);
}

// KvBlockPool.grow; false (and nothing taken) where Python raises.
BLINK_HD inline bool pool_grow(SchedState& s, SeqState& q, int32_t num_tokens) {
  if (num_tokens <= q.num_blocks * s.cfg.block_size) return true;
  const int32_t want = blocks_for(num_tokens, s.cfg.block_size);
  if (want > s.blocks_per_seq || want - q.num_blocks > pool_takeable(s)) return false;
  int32_t* table = block_table(s, q.slot);
  while (q.num_blocks < want) table[q.num_blocks++] = pool_take(s);
  return true;
}

// KvBlockPool.release, last block first: a block no table holds any more goes on top of the
// free stack (the table's first block ends on top: the likeliest still in cache), or, cached,
// to the back of the evictable queue (the table's first block evicted last).
// In groups of kReleaseGroup blocks, each group's loads (table entries, then reference counts
// and uids) issued before any of its stores: one thread walking block after block waited out an
// L2 round trip for each load (the stores might alias the next block's loads), two a block.
BLINK_SCHED_CALL BLINK_HD void pool_release(SchedState& s, SeqState& q) {
  constexpr int32_t kReleaseGroup = 8;
  const int32_t* table = block_table(s, q.slot);
  for (int32_t hi = q.num_blocks; hi > 0; hi -= kReleaseGroup) {
    const int32_t n = min_i32(hi, kReleaseGroup);
    int32_t block[kReleaseGroup], refs[kReleaseGroup];
    bool cached[kReleaseGroup];
    for (int32_t i = 0; i < n; ++i) block[i] = table[hi - 1 - i];
    for (int32_t i = 0; i < n; ++i) {
      refs[i] = s.block_refs[block[i]] - 1;
      cached[i] = s.block_uid[block[i]] != 0;
    }
    for (int32_t i = 0; i < n; ++i) {  // (a table holds a block once: no two i share one)
      const int32_t b = block[i];
      s.block_refs[b] = refs[i];
      if (refs[i] > 0) continue;
      if (cached[i]) lru_push_back(s, b);
      else s.free_blocks[s.num_free++] = b;
    }
  }
  q.num_blocks = 0;
  q.num_keyed = 0;
}

// The blocks prefix_match may look up: those of at most num_tokens - 1 tokens (the last token
// is always computed, for its logits).
BLINK_HD inline int32_t prefix_lookable_blocks(const SchedState& s, const SeqState& q) {
  return (q.num_tokens - 1) / s.cfg.block_size;
}

// A lookup hint for waiting q's block j (its key computed): a cached block with its key and
// tokens and that block's uid, written where prefix_match writes its hits (q's block-table and
// uid rows, free while q waits), or -1 and 0. The parent is not compared: prefix_match checks
// it, and that the block is still the same cache entry, and probes where a hint fails. Blocks
// are independent: any thread may hint its own (the kernel's Admit hints a new prompt's blocks
// a thread a block as it adds the request, prefix_keys_and_hints_cta).
BLINK_HD inline void prefix_hint_block(const SchedState& s, const SeqState& q, int32_t j) {
  const uint64_t key =
      block_row(s, s.seq_block_keys, q.slot)[j] & static_cast<uint64_t>(BLINK_PREFIX_KEY_MASK);
  const int32_t found =
      cache_find(s, key, 0, seq_tokens(s, q.slot) + j * s.cfg.block_size, /*any_parent=*/true);
  block_table(s, q.slot)[j] = found;
  block_uids(s, q.slot)[j] = found >= 0 ? s.block_uid[found] : 0;
}

// prefix_hint_block for every block waiting q may look up, serially (the CPU replay's Admit).
BLINK_HD inline void prefix_hint_blocks(const SchedState& s, SeqState& q) {
  if (!s.cfg.prefix_caching) return;
  const int32_t lookable = prefix_lookable_blocks(s, q);
  if (lookable > 0) seq_block_key(s, q, lookable - 1);
  for (int32_t j = 0; j < lookable; ++j) prefix_hint_block(s, q, j);
  q.num_hinted = lookable;
}

// KvBlockPool.match: the cached blocks of q's longest cached prefix of at most num_tokens - 1
// tokens, written into q's block-table row and uid row (q is waiting: it holds no blocks, so
// the rows are free) but not taken; returns how many. 0 when prefix caching is off.
// Hinted blocks are checked kHintBatch at a time, every load of a batch in flight together (the
// serial probe, cache_find, takes three dependent round trips to memory: ~1.6 us a block on the
// H200, the scheduler's data gone from L2 after a forward pass). A hint holds where its block
// is still the same cache entry (its uid unchanged: an evicted block's uid is zeroed, uids are
// never reused) and continues the chain (its parent is the last hit's uid); that block then has
// the identity cache_find looks for, which at most one cached block has (prefix_register never
// caches an identity twice), so it is cache_find's answer. A block whose hint fails (cached
// since the hint, or an older block of the same key and tokens under an evicted parent met
// first) or that has none is probed, and the hints go on from the block after it.
BLINK_SCHED_CALL BLINK_HD int32_t prefix_match(const SchedState& s, SeqState& q) {
  if (!s.cfg.prefix_caching) return 0;
  const int32_t bs = s.cfg.block_size;
  const int32_t* tokens = seq_tokens(s, q.slot);
  int32_t* table = block_table(s, q.slot);
  uint64_t* uids = block_uids(s, q.slot);
  uint64_t parent = prefix_root(q);
  int32_t hit = 0;
  const int32_t lookable = prefix_lookable_blocks(s, q);
  const int32_t hinted = min_i32(q.num_hinted, lookable);
  constexpr int32_t kHintBatch = 8;
  while (hit < lookable) {
    for (bool batch_held = true; batch_held && hit < hinted;) {
      int32_t b[kHintBatch];
      uint64_t hinted_uid[kHintBatch], uid[kHintBatch], parent_of[kHintBatch];
      for (int32_t k = 0; k < kHintBatch; ++k) {
        const bool in = hit + k < hinted;
        b[k] = in ? table[hit + k] : -1;
        hinted_uid[k] = in ? uids[hit + k] : 0;
      }
      for (int32_t k = 0; k < kHintBatch; ++k) {
        uid[k] = b[k] >= 0 ? s.block_uid[b[k]] : 0;
        parent_of[k] = b[k] >= 0 ? s.block_parent[b[k]] : 0;
      }
      for (int32_t k = 0; k < kHintBatch && hit < hinted; ++k) {
        if (uid[k] == 0 || uid[k] != hinted_uid[k] || parent_of[k] != parent) {
          batch_held = false;
          break;
        }
        parent = uid[k];  // (the rows hold the hint: the hit is written)
        ++hit;
      }
    }
    if (hit == lookable) break;
    const int32_t b = cache_find(s, seq_block_key(s, q, hit), parent, tokens + hit * bs);
    if (b < 0) break;
    table[hit] = b;
    parent = uids[hit] = s.block_uid[b];
    ++hit;
  }
  return hit;
}

// KvBlockPool.can_admit: can_grow to num_tokens for a waiting q that first takes the `hit`
// cached blocks prefix_match found (those no table holds stop being takeable).
BLINK_HD inline bool prefix_can_admit(const SchedState& s, const SeqState& q, int32_t hit,
                                      int32_t num_tokens) {
  const int32_t want = blocks_for(num_tokens, s.cfg.block_size);
  if (want > s.blocks_per_seq) return false;
  const int32_t* table = block_table(s, q.slot);
  int32_t taken = 0;
  for (int32_t j = 0; j < hit; ++j) taken += s.block_refs[table[j]] == 0 ? 1 : 0;
  return want - hit <= pool_takeable(s) - taken;
}

// KvBlockPool._hold: one more block table holds the cached block (no longer evictable).
BLINK_HD inline void prefix_hold(SchedState& s, int32_t block) {
  if (s.block_refs[block]++ == 0) lru_unlink(s, block);
}

// KvBlockPool.admit: q takes the blocks prefix_match left in its rows; it computes after them.
BLINK_HD inline void prefix_admit(SchedState& s, SeqState& q, int32_t hit) {
  const int32_t* table = block_table(s, q.slot);
  for (int32_t j = 0; j < hit; ++j) prefix_hold(s, table[j]);
  q.num_blocks = q.num_keyed = hit;
  q.num_hinted = 0;  // its rows are its block table now
  q.num_computed = hit * s.cfg.block_size;
  if (q.preemptions == 0) {  // its first admission alone counts (block_manager.admit)
    q.cached_tokens = min_i32(q.num_computed, q.prompt_len);
    if (s.cfg.prefix_caching) {
      s.query_tokens += static_cast<uint64_t>(q.num_tokens);
      s.hit_tokens += static_cast<uint64_t>(q.num_computed);
    }
  }
}

// Whether q has full computed blocks prefix_register has not seen (one division: the kernel
// asks it a thread per plan entry, then registers only those serially).
BLINK_HD inline bool prefix_has_new_blocks(const SchedState& s, const SeqState& q) {
  return s.cfg.prefix_caching && q.num_computed / s.cfg.block_size > q.num_keyed;
}

// KvBlockPool.register: q's newly full, computed blocks join the cache in order. Where a
// block's identity is cached already (computed twice), q takes the cached block in its table
// row and its own copy goes on top of the free stack (the forward pass reads the row as the
// next step's batch describes it, after this).
BLINK_SCHED_CALL BLINK_HD void prefix_register(SchedState& s, SeqState& q) {
  if (!prefix_has_new_blocks(s, q)) return;
  const int32_t bs = s.cfg.block_size, full = q.num_computed / bs;
  const int32_t* tokens = seq_tokens(s, q.slot);
  int32_t* table = block_table(s, q.slot);
  uint64_t* uids = block_uids(s, q.slot);
  for (int32_t j = q.num_keyed; j < full; ++j) {
    const uint64_t parent = j > 0 ? uids[j - 1] : prefix_root(q);
    const int32_t* block_tokens = tokens + j * bs;
    const uint64_t key = seq_block_key(s, q, j);
    int32_t b = cache_find(s, key, parent, block_tokens);
    if (b < 0) {
      b = table[j];
      s.block_uid[b] = s.next_uid++;
      s.block_parent[b] = parent;
      s.block_key[b] = key;
      int32_t* keep = s.block_tokens + static_cast<size_t>(b) * static_cast<size_t>(bs);
      for (int32_t t = 0; t < bs; ++t) keep[t] = block_tokens[t];
      cache_insert(s, b);
      ++s.num_cached;
    } else {  // table[j] is q's alone (uncached, computed by it): refs 1
      prefix_hold(s, b);
      s.block_refs[table[j]] = 0;
      s.free_blocks[s.num_free++] = table[j];
      table[j] = b;
    }
    uids[j] = s.block_uid[b];
  }
  q.num_keyed = full;
}

// ---------------------------------------------------------------------------------------------
// Queues (Scheduler.running: list; Scheduler.waiting: deque)

BLINK_HD inline void running_push_back(SchedState& s, int32_t slot) {
  s.running[s.num_running++] = slot;
}

BLINK_HD inline int32_t running_pop_back(SchedState& s) { return s.running[--s.num_running]; }

// list.remove: the first occurrence, order kept. False if absent.
BLINK_HD inline bool running_remove(SchedState& s, int32_t slot) {
  for (int32_t i = 0; i < s.num_running; ++i) {
    if (s.running[i] != slot) continue;
    for (int32_t j = i + 1; j < s.num_running; ++j) s.running[j - 1] = s.running[j];
    --s.num_running;
    return true;
  }
  return false;
}

// Index of element i (0 <= i < num_slots) in the ring; a compare, not a modulo (no division).
BLINK_HD inline int32_t waiting_index(const SchedState& s, int32_t i) {
  const int32_t k = s.waiting_head + i;
  return k < s.cfg.num_slots ? k : k - s.cfg.num_slots;
}

BLINK_HD inline int32_t waiting_at(const SchedState& s, int32_t i) {
  return s.waiting[waiting_index(s, i)];
}

BLINK_HD inline void waiting_push_back(SchedState& s, int32_t slot) {
  s.waiting[waiting_index(s, s.num_waiting)] = slot;
  ++s.num_waiting;
}

BLINK_HD inline void waiting_push_front(SchedState& s, int32_t slot) {
  s.waiting_head = s.waiting_head > 0 ? s.waiting_head - 1 : s.cfg.num_slots - 1;
  s.waiting[s.waiting_head] = slot;
  ++s.num_waiting;
}

BLINK_HD inline int32_t waiting_pop_front(SchedState& s) {
  const int32_t slot = s.waiting[s.waiting_head];
  s.waiting_head = waiting_index(s, 1);
  --s.num_waiting;
  return slot;
}

// deque.remove: the first occurrence, order kept. False if absent.
BLINK_HD inline bool waiting_remove(SchedState& s, int32_t slot) {
  for (int32_t i = 0; i < s.num_waiting; ++i) {
    if (waiting_at(s, i) != slot) continue;
    for (int32_t j = i + 1; j < s.num_waiting; ++j)
      s.waiting[waiting_index(s, j - 1)] = s.waiting[waiting_index(s, j)];
    --s.num_waiting;
    return true;
  }
  return false;
}

// All slots free, the pool full, both queues empty.
BLINK_HD inline void state_init(SchedState& s) {
  for (int32_t i = 0; i < s.cfg.num_slots; ++i) {
    s.seqs[i] = SeqState{};
    s.seqs[i].slot = i;
    s.seqs[i].status = SeqStatus::kFree;
  }
  pool_init(s);
  s.num_running = 0;
  s.waiting_head = 0;
  s.num_waiting = 0;
}

// ---------------------------------------------------------------------------------------------
// Admission and retirement

// SamplingParams from a slot that passed validate_slot (RingServer.poll).
BLINK_HD inline SamplingParams params_from_slot(const RequestSlotFixed& f) {
  SamplingParams p{};
  p.seed = f.seed;
  p.max_tokens = f.max_tokens;
  p.temperature = f.temperature;
  p.top_p = f.top_p;
  p.top_k = f.top_k;
  p.ignore_eos = (f.flags & ring::kFlagIgnoreEos) ? 1u : 0u;
  p.num_stop_ids = f.num_stop_ids < kMaxStopIds ? f.num_stop_ids : kMaxStopIds;
  for (uint32_t i = 0; i < kMaxStopIds; ++i) p.stop_ids[i] = i < p.num_stop_ids ? f.stop_ids[i] : 0;
  return p;
}

// Scheduler.finish: retires the slot's sequence from whichever queue holds it and frees its
// blocks. False if the slot held no sequence.
BLINK_HD inline bool finish_seq(SchedState& s, int32_t slot) {
  SeqState& q = s.seqs[slot];
  if (q.status == SeqStatus::kFree) return false;
  if (q.status == SeqStatus::kRunning) running_remove(s, slot);
  else waiting_remove(s, slot);
  pool_release(s, q);
  q.status = SeqStatus::kFree;
  return true;
}

enum class AddResult : uint32_t {
  kAdded = 0,
  kReplacedStale = 1,  // added; the slot's previous sequence was retired first
  kBadSlot = 2,        // slot outside [0, num_slots): nothing done
  kBadPromptLen = 3,   // prompt_len outside [1, max_model_len): nothing done
};

// ReferenceEngine._admit for one accepted request: a slot still holding a sequence means the
// front end reused it (it gave up on the old one), which is retired silently (finish_seq, no
// output record); then Scheduler.add (status WAITING, pushed at the back of `waiting`).
// prompt: [prompt_len] tokens, copied serially into the slot's token row; pass nullptr when
// the caller has already written them there (e.g. a cooperative copy by the whole CTA).
BLINK_HD inline AddResult add_seq(SchedState& s, int32_t slot, uint32_t gen, uint64_t arrival,
                                  const int32_t* prompt, int32_t prompt_len,
                                  const SamplingParams& params, uint64_t cache_salt) {
  if (slot < 0 || slot >= s.cfg.num_slots) return AddResult::kBadSlot;
  if (prompt_len < 1 || prompt_len >= s.cfg.max_model_len) return AddResult::kBadPromptLen;
  const bool stale = finish_seq(s, slot);
  if (prompt != nullptr) {
    int32_t* row = seq_tokens(s, slot);
    for (int32_t i = 0; i < prompt_len; ++i) row[i] = prompt[i];
  }
  SeqState& q = s.seqs[slot];
  q = SeqState{};
  q.arrival = arrival;
  q.cache_salt = cache_salt;
  q.gen = gen;
  q.slot = slot;
  q.prompt_len = prompt_len;
  q.num_tokens = prompt_len;
  q.params = params;
  q.status = SeqStatus::kWaiting;
  waiting_push_back(s, slot);
  return stale ? AddResult::kReplacedStale : AddResult::kAdded;
}

// Appends a sampled token to the slot's history (seq.output.append). False if the slot is free
// or its row is full (cannot happen while context_length <= max_model_len: stop_check ends the
// sequence at context_length).
BLINK_HD inline bool append_token(SchedState& s, int32_t slot, int32_t token) {
  SeqState& q = s.seqs[slot];
  if (q.status == SeqStatus::kFree || q.num_tokens >= s.cfg.max_model_len) return false;
  seq_tokens(s, slot)[q.num_tokens] = token;
  ++q.num_tokens;
  ++q.num_output;
  return true;
}

// ---------------------------------------------------------------------------------------------
// One step (Scheduler.schedule_step)

// What one step decided. Sized by kMaxStepSeqs (>= max_num_seqs, which bounds both lists:
// scheduled sequences are all in `running` afterwards, preempted ones were in it before).
struct StepPlan {
  int32_t num_scheduled;
  int32_t total_tokens;                   // sum of num_new_tokens[:num_scheduled]
  // Batch order: slots[k] computes num_new_tokens[k] tokens, starting at its num_computed
  // (read before commit_step); 1 <= num_new_tokens[k] <= its num_pending in practice.
  int32_t slots[kMaxStepSeqs];
  int32_t num_new_tokens[kMaxStepSeqs];
  // Evicted this step, in eviction order (newest first): blocks freed, num_computed = 0,
  // preemptions + 1, pushed to the front of `waiting` for recompute.
  int32_t num_preempted;
  int32_t preempted[kMaxStepSeqs];
  // The last num_admitted entries were admitted from `waiting` this step (their cached_tokens:
  // the prefix cache's hit).
  int32_t num_admitted;
};

// Scheduler._preempt
BLINK_HD inline void preempt(SchedState& s, SeqState& q) {
  pool_release(s, q);
  q.num_computed = 0;
  ++q.preemptions;
  q.status = SeqStatus::kWaiting;
  waiting_push_front(s, q.slot);
}

// Scheduler.schedule_step. Invariant: every scheduled sequence's computed tokens catch up with
// its known tokens under one token budget. Running sequences go first (oldest first); when the
// pool cannot hold a running sequence's next tokens, the newest running sequence is preempted,
// until it fits or it is the one preempted. Waiting sequences are admitted FCFS while budget,
// sequence slots and blocks last; admission never preempts, and no sequence is admitted in a
// step that preempted. An admitted sequence first takes the cached blocks of its longest cached
// prefix and computes from there. Serial; O(num_running + admitted + blocks taken + blocks
// looked up).
BLINK_HD inline void schedule_step(SchedState& s, StepPlan& plan) {
  // The plan's counters stay in registers until the end: written through the reference they
  // would be reloaded after every store to an int32_t array they might alias.
  int32_t num_scheduled = 0, num_preempted = 0, num_admitted = 0;
  int32_t budget = s.cfg.max_num_batched_tokens;
  int32_t i = 0;
  while (i < s.num_running && budget > 0) {
    const int32_t slot = s.running[i];
    SeqState& q = s.seqs[slot];
    const int32_t n = min_i32(q.num_tokens - q.num_computed, budget);
    bool evicted_itself = false;
    while (!pool_can_grow(s, q, q.num_computed + n)) {
      const int32_t victim = running_pop_back(s);
      preempt(s, s.seqs[victim]);
      plan.preempted[num_preempted++] = victim;
      if (victim == slot) {
        evicted_itself = true;  // it was the last running one: the loop ends
        break;
      }
    }
    if (evicted_itself) continue;
    pool_grow(s, q, q.num_computed + n);
    plan.slots[num_scheduled] = slot;
    plan.num_new_tokens[num_scheduled++] = n;
    budget -= n;
    ++i;
  }
  while (s.num_waiting > 0 && budget > 0 && s.num_running < s.cfg.max_num_seqs &&
         num_preempted == 0) {
    const int32_t slot = waiting_at(s, 0);
    SeqState& q = s.seqs[slot];
    const int32_t hit = prefix_match(s, q);
    const int32_t n = min_i32(q.num_tokens - hit * s.cfg.block_size, budget);
    // all of its tokens must fit, though it takes this chunk's blocks alone (Scheduler.schedule)
    if (!prefix_can_admit(s, q, hit, q.num_tokens)) break;
    waiting_pop_front(s);
    prefix_admit(s, q, hit);
    pool_grow(s, q, q.num_computed + n);
    q.status = SeqStatus::kRunning;
    running_push_back(s, slot);
    plan.slots[num_scheduled] = slot;
    plan.num_new_tokens[num_scheduled++] = n;
    ++num_admitted;
    budget -= n;
  }
  plan.num_scheduled = num_scheduled;
  plan.num_admitted = num_admitted;
  plan.total_tokens = s.cfg.max_num_batched_tokens - budget;
  plan.num_preempted = num_preempted;
}

// After the forward pass: the scheduled tokens are computed (ReferenceEngine.step).
// Plan entry k's share of commit_step (entries have distinct slots: one thread each may run it).
BLINK_HD inline void commit_entry(SchedState& s, const StepPlan& plan, int32_t k) {
  s.seqs[plan.slots[k]].num_computed += plan.num_new_tokens[k];
}

// Scheduler.register after commit: entries' new full blocks into the prefix cache, in plan
// order (serial: the cache is shared).
BLINK_HD inline void commit_step(SchedState& s, const StepPlan& plan) {
  for (int32_t k = 0; k < plan.num_scheduled; ++k) commit_entry(s, plan, k);
  for (int32_t k = 0; k < plan.num_scheduled; ++k) prefix_register(s, s.seqs[plan.slots[k]]);
}

// After commit_step: whether this scheduled sequence samples (its last known token was just
// computed). Only scheduled sequences can: every other live one has a token pending.
BLINK_HD inline bool samples_now(const SeqState& q) { return q.num_computed == q.num_tokens; }

// ---------------------------------------------------------------------------------------------
// Stop check (reference_engine.eos_finish)

struct StopResult {
  FinishReason reason;  // kNone while the sequence goes on
  int32_t detail;       // the token for kEos / kStopToken, else 0 (the record's u32 detail)
};

// After `token` was appended to q (append_token). eos_ids: [num_eos] (the ring header's).
BLINK_HD inline StopResult stop_check(const SeqState& q, int32_t token, const int32_t* eos_ids,
                                      int32_t num_eos, int32_t context_length) {
  const SamplingParams& p = q.params;
  if (!p.ignore_eos) {
    for (int32_t i = 0; i < num_eos; ++i)
      if (eos_ids[i] == token) return {FinishReason::kEos, token};
  }
  const uint32_t nstop = p.num_stop_ids < kMaxStopIds ? p.num_stop_ids : kMaxStopIds;
  for (uint32_t i = 0; i < nstop; ++i)
    if (p.stop_ids[i] == token) return {FinishReason::kStopToken, token};
  if (static_cast<int64_t>(q.num_output) >= static_cast<int64_t>(p.max_tokens))
    return {FinishReason::kLength, 0};
  if (q.num_tokens >= context_length) return {FinishReason::kContextFull, 0};
  return {FinishReason::kNone, 0};
}

// ---------------------------------------------------------------------------------------------
// The step contract: the decisions of one engine iteration that are not the scheduler's own
// (admission order, cancels, the batch description, sample consumption), in the order
// ReferenceEngine.step makes them. The persistent kernel and the replay (tests/csrc/
// sched_replay.cc) both call these, so the parity test runs the code the GPU runs; the kernel
// adds only mechanics (mapped-memory reads and writes, the CTA's parallel copies, the launch).

// A request accepted from its slot, waiting for add_seq (admission is in request-id order).
struct Admission {
  uint64_t arrival;        // the request id: FCFS order
  uint32_t gen;
  int32_t slot, prompt_len;
  const int32_t* prompt;   // [prompt_len], a staging copy (the slot's row may be a stale seq's)
  SamplingParams params;
};

// ReferenceEngine._admit: sorts the accepted requests by request id (insertion sort: a handful
// per iteration) and adds each; on_admitted(admission, add_result) follows every add_seq.
// cache_salt_by_slot: [num_slots] the cache_salt word of the request accepted in each slot (not
// an Admission field: 8 bytes more a copy took the scheduler kernel from 84 to 90 registers).
// copy_prompts false: the caller copies each prompt into its slot's token row afterwards (the
// scheduler kernel's whole CTA), before anything reads it.
template <class OnAdmitted>
BLINK_HD void admit_in_order(SchedState& s, Admission* accepted, int32_t n,
                             const uint64_t* cache_salt_by_slot, OnAdmitted on_admitted,
                             bool copy_prompts = true) {
  for (int32_t a = 1; a < n; ++a)
    for (int32_t b = a; b > 0 && accepted[b - 1].arrival > accepted[b].arrival; --b) {
      const Admission t = accepted[b];
      accepted[b] = accepted[b - 1];
      accepted[b - 1] = t;
    }
  for (int32_t a = 0; a < n; ++a) {
    const Admission& r = accepted[a];
    const bool in_range = r.slot >= 0 && r.slot < s.cfg.num_slots;  // (add_seq checks too)
    on_admitted(r, add_seq(s, r.slot, r.gen, r.arrival, copy_prompts ? r.prompt : nullptr,
                           r.prompt_len, r.params, in_range ? cache_salt_by_slot[r.slot] : 0));
  }
}

// ReferenceEngine._honour_cancels: a live sequence is cancelled when its slot's cancel word
// names its generation (the front end writes it at any time; an older word is ignored).
BLINK_HD inline bool cancel_requested(const SeqState& q, uint32_t cancel_gen) {
  return q.status != SeqStatus::kFree && cancel_gen == q.gen;
}

// Where describe_batch writes: the forward graphs' batch arrays on the GPU, plain arrays in
// the replay. Per plan entry k: starts[k] (flat index of its first token; starts[num] = total)
// and context_lens[k]; per logits row l (a sequence whose last known token is computed this
// step): the flat index of that token, its sampling inputs and row_slot[l], the sequence.
struct BatchView {
  int32_t* starts;        // [num_scheduled + 1]
  int32_t* context_lens;  // [num_scheduled]
  int32_t* logit_token;   // [rows]
  float* temperature;
  float* top_p;
  int32_t* top_k;
  uint64_t* seed;
  uint32_t* step;         // the row's output index: the sampler's counter-RNG step
  int32_t* row_slot;
};

struct BatchSize {
  int32_t num_tokens;
  int32_t num_rows;       // logits rows: the sequences that sample this step, in plan order
};

// Before commit_step: whether plan entry k samples this step (samples_now after commit_step).
BLINK_HD inline bool entry_samples(const SchedState& s, const StepPlan& plan, int32_t k) {
  const SeqState& q = s.seqs[plan.slots[k]];
  return q.num_computed + plan.num_new_tokens[k] == q.num_tokens;
}

// Plan entry k's share of describe_batch, given where its tokens start in the batch (`start`:
// the new tokens of the entries before it) and the logits row it takes if it samples (`row`:
// the entries before it that sample). Entries write disjoint elements: one thread each may run
// it once those two sums are known (the scheduler kernel's BuildBatch scans them).
BLINK_HD inline void describe_entry(const SchedState& s, const StepPlan& plan, int32_t k,
                                    int32_t start, int32_t row, const BatchView& out) {
  const SeqState& q = s.seqs[plan.slots[k]];
  const int32_t end = q.num_computed + plan.num_new_tokens[k];
  out.starts[k + 1] = start + plan.num_new_tokens[k];
  out.context_lens[k] = end;
  if (end == q.num_tokens) {  // entry_samples
    out.logit_token[row] = out.starts[k + 1] - 1;
    out.temperature[row] = q.params.temperature;
    out.top_p[row] = q.params.top_p;
    out.top_k[row] = q.params.top_k;
    out.seed[row] = q.params.seed;
    out.step[row] = q.num_output;
    out.row_slot[row] = q.slot;
  }
}

// ReferenceEngine._build_batch, before commit_step (num_computed is still the step's first position).
BLINK_HD inline BatchSize describe_batch(const SchedState& s, const StepPlan& plan,
                                         const BatchView& out) {
  int32_t rows = 0;
  out.starts[0] = 0;
  for (int32_t k = 0; k < plan.num_scheduled; ++k) {
    const bool samples = entry_samples(s, plan, k);
    describe_entry(s, plan, k, out.starts[k], rows, out);
    rows += samples ? 1 : 0;
  }
  return {out.starts[plan.num_scheduled], rows};
}

// ReferenceEngine._postprocess (_emit), one logits row after commit_step: appends the sampled token
// and checks the stops. The caller retires the sequence (finish_seq + its record) when the
// reason is not kNone. False (nothing changed) if the slot cannot take a token.
BLINK_HD inline bool consume_sample(SchedState& s, int32_t slot, int32_t token,
                                    const int32_t* eos_ids, int32_t num_eos,
                                    int32_t context_length, StopResult* stop) {
  if (!append_token(s, slot, token)) return false;
  *stop = stop_check(s.seqs[slot], token, eos_ids, num_eos, context_length);
  return true;
}

// ---------------------------------------------------------------------------------------------
// Slot validation (ring_server.validate_slot)

BLINK_HD inline uint32_t f32_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  __builtin_memcpy(&u, &x, sizeof u);
  return u;
#endif
}

// The float checks look at bits, not at float comparisons: a NaN must be rejected even under
// --use_fast_math (which folds NaN tests away), and a denormal must count as non-zero even
// where the GPU flushes denormals to zero in comparisons, as Python's float64 does.
// Python: math.isfinite(t) and not t < 0   (-0.0 passes, a negative denormal does not)
BLINK_HD inline bool temperature_ok(float t) {
  const uint32_t b = f32_bits(t);
  const bool finite = (b & 0x7f800000u) != 0x7f800000u;
  const bool negative = (b & 0x80000000u) != 0 && (b & 0x7fffffffu) != 0;
  return finite && !negative;
}

// Python: 0.0 < top_p <= 1.0. Positive floats order as their bits; 0x3f800000 is 1.0f, and
// every NaN or infinity with the sign clear is above it.
BLINK_HD inline bool top_p_ok(float p) {
  const uint32_t b = f32_bits(p);
  return (b & 0x80000000u) == 0 && b != 0 && b <= 0x3f800000u;
}

BLINK_HD inline bool token_in_vocab(int32_t t, uint32_t vocab_size) {
  return t >= 0 && static_cast<uint32_t>(t) < vocab_size;
}

// Whether prompt[first], prompt[first + stride], ... (below n) are all in the vocabulary: one
// thread's share of the TOKEN_OUT_OF_RANGE scan (first = threadIdx.x, stride = blockDim.x, then
// __syncthreads_and), or the whole scan (0, 1).
BLINK_HD inline bool prompt_tokens_in_range(const int32_t* prompt, uint32_t n, uint32_t vocab_size,
                                            uint32_t first, uint32_t stride) {
  bool ok = true;
  for (uint32_t i = first; i < n; i += stride) ok &= token_in_vocab(prompt[i], vocab_size);
  return ok;
}

// validate_slot with the token scan already done (tokens_ok = the prompt's
// min(prompt_len, max_prompt_tokens) tokens are all in range); same order of checks, the first
// failing one wins.
BLINK_HD inline RejectReason validate_slot_scanned(const RequestSlotFixed& f, bool tokens_ok,
                                                   uint32_t vocab_size, uint32_t context_length,
                                                   uint64_t kv_capacity_tokens,
                                                   uint32_t max_prompt_tokens) {
  // RingServer.poll hands validate_slot min(prompt_len, max_prompt_tokens) tokens, so Python's
  // `plen != prompt.size` is `plen > max_prompt_tokens` here.
  if (f.prompt_len == 0 || f.prompt_len > max_prompt_tokens) return RejectReason::kBadPromptLen;
  if (!tokens_ok) return RejectReason::kTokenOutOfRange;
  if (f.max_tokens < 1) return RejectReason::kBadMaxTokens;
  if (!temperature_ok(f.temperature)) return RejectReason::kBadTemperature;
  if (!top_p_ok(f.top_p)) return RejectReason::kBadTopP;
  if (f.top_k < 0) return RejectReason::kBadTopK;
  if (f.num_stop_ids > kMaxStopIds) return RejectReason::kBadStopIds;
  for (uint32_t i = 0; i < f.num_stop_ids; ++i)
    if (!token_in_vocab(f.stop_ids[i], vocab_size)) return RejectReason::kBadStopIds;
  const uint64_t total = static_cast<uint64_t>(f.prompt_len) + f.max_tokens;
  if (total > context_length) return RejectReason::kExceedsContext;
  if (total > kv_capacity_tokens) return RejectReason::kExceedsKvCapacity;
  return RejectReason::kNone;
}

// ring_server.validate_slot. f: a snapshot of the slot's fixed part (copy it out of the ring
// once, so the CRC and the checks see the same bytes); prompt: the slot's prompt,
// min(f.prompt_len, max_prompt_tokens) tokens. Serial: O(prompt_len).
BLINK_HD inline RejectReason validate_slot(const RequestSlotFixed& f, const int32_t* prompt,
                                           uint32_t vocab_size, uint32_t context_length,
                                           uint64_t kv_capacity_tokens,
                                           uint32_t max_prompt_tokens) {
  const uint32_t n = f.prompt_len < max_prompt_tokens ? f.prompt_len : max_prompt_tokens;
  const bool tokens_ok = prompt_tokens_in_range(prompt, n, vocab_size, 0, 1);
  return validate_slot_scanned(f, tokens_ok, vocab_size, context_length, kv_capacity_tokens,
                               max_prompt_tokens);
}

// ---------------------------------------------------------------------------------------------
// CRC-32 (zlib.crc32: reflected polynomial 0xEDB88320, initial and final inversion)

static constexpr uint32_t kCrc32Poly = 0xEDB88320u;

// a * b modulo the CRC polynomial, bits reflected (x^0 is bit 31): zlib's multmodp. 32 steps.
BLINK_HD constexpr uint32_t crc32_multmodp(uint32_t a, uint32_t b) {
  uint32_t p = 0;
  for (uint32_t m = 1u << 31; m != 0; m >>= 1) {
    if (a & m) p ^= b;
    b = (b & 1) ? (b >> 1) ^ kCrc32Poly : b >> 1;
  }
  return p;
}

struct Crc32Tables {
  uint32_t bytes[256];  // the CRC of each byte value: the byte-wise update
  uint32_t x2n[32];     // x^(2^k) modulo the polynomial (period 32, as zlib's x2n_table)
};

constexpr Crc32Tables make_crc32_tables() {
  Crc32Tables t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kCrc32Poly : c >> 1;
    t.bytes[i] = c;
  }
  uint32_t p = 1u << 30;  // x^1
  for (int k = 0; k < 32; ++k) {
    t.x2n[k] = p;
    p = crc32_multmodp(p, p);
  }
  return t;
}

// 1.1 KiB of tables, built at compile time: in __constant__ memory for the device (one thread's
// data-dependent lookups hit the constant cache; lanes of a warp indexing differently would
// serialise, which only slot_crc_cta does, over short chunks), a constexpr array for the host.
// static: each translation unit gets its own copy, so -rdc links cleanly.
#if defined(__CUDACC__)
static __constant__ Crc32Tables kCrc32TablesDevice = make_crc32_tables();
#endif
static constexpr Crc32Tables kCrc32TablesHost = make_crc32_tables();

BLINK_HD inline const Crc32Tables& crc32_tables() {
#if defined(__CUDA_ARCH__)
  return kCrc32TablesDevice;
#else
  return kCrc32TablesHost;
#endif
}

// zlib.crc32(bytes[:n], crc). Byte-wise, one dependent table lookup per byte: one H200 thread
// spends ~55 cycles a byte (32 KiB: 1.8 M cycles, 0.9 ms), so long prompts want slot_crc_cta
// (32 KiB: 33 us). bytes must be in device or shared memory, never walked byte by byte over
// host-mapped memory (a PCIe round trip per load).
BLINK_HD inline uint32_t crc32_update_with(const uint32_t* byte_table, uint32_t crc,
                                           const uint8_t* bytes, size_t n) {
  crc = ~crc;
  for (size_t i = 0; i < n; ++i) crc = byte_table[(crc ^ bytes[i]) & 0xffu] ^ (crc >> 8);
  return ~crc;
}

BLINK_HD inline uint32_t crc32_update(uint32_t crc, const uint8_t* bytes, size_t n) {
  return crc32_update_with(crc32_tables().bytes, crc, bytes, n);
}

// The operator "append n zero bytes": x^(8 n) modulo the polynomial (zlib's x2nmodp(n, 3)), one
// multmodp per set bit of n.
BLINK_HD inline uint32_t crc32_zeros_op(uint64_t n) {
  const Crc32Tables& t = crc32_tables();
  uint32_t p = 1u << 31;  // x^0
  for (uint32_t k = 3; n != 0; n >>= 1, ++k)
    if (n & 1) p = crc32_multmodp(t.x2n[k & 31], p);
  return p;
}

// crc32(A + B) from crc1 = crc32(A), crc2 = crc32(B) and op = crc32_zeros_op(len(B)): one
// multmodp, for combining many chunks of one length with one operator.
BLINK_HD inline uint32_t crc32_combine_op(uint32_t crc1, uint32_t crc2, uint32_t op) {
  return crc32_multmodp(op, crc1) ^ crc2;
}

// zlib's crc32_combine: crc32(A + B) from crc32(A), crc32(B) and len(B).
BLINK_HD inline uint32_t crc32_combine(uint32_t crc1, uint32_t crc2, uint64_t len2) {
  return crc32_combine_op(crc1, crc2, crc32_zeros_op(len2));
}

// layout.payload_crc: the CRC of the u32 generation (little-endian) then the payload, i.e.
// slot bytes [kPayloadStart, sizeof(RequestSlotFixed) + 4 * prompt_len). Serial.
BLINK_HD inline uint32_t slot_crc(uint32_t gen, const uint8_t* payload, size_t n) {
  const uint8_t g[4] = {static_cast<uint8_t>(gen), static_cast<uint8_t>(gen >> 8),
                        static_cast<uint8_t>(gen >> 16), static_cast<uint8_t>(gen >> 24)};
  return crc32_update(crc32_update(0, g, 4), payload, n);
}

// ---------------------------------------------------------------------------------------------
// Counter-based random numbers (sampling.splitmix64 / sampling.uniform): counter_rng.cuh, shared
// with the sampling kernel.

using blink::splitmix64;
using blink::uniform;

// ---------------------------------------------------------------------------------------------
// Cooperative versions: every thread of the CTA calls them together (they __syncthreads).

#if defined(__CUDACC__)

// slot_crc over the whole CTA: each thread checksums one contiguous chunk (byte table copied to
// shared memory: constant memory serialises lanes that index differently), then a tree of
// crc32_combine merges them in log2(blockDim.x) rounds. scratch: [2 * blockDim.x + 256] u32,
// shared memory, free again on return. Returns the CRC in every thread. Measured on an H200,
// 256 threads: 4 KiB 21 us, 32 KiB 33 us, 128 KiB 62 us (serial slot_crc: 0.1, 0.9, 3.5 ms).
__device__ inline uint32_t slot_crc_cta(uint32_t gen, const uint8_t* payload, uint32_t n,
                                        uint32_t* scratch) {
  const uint32_t nt = blockDim.x, t = threadIdx.x;
  uint32_t* crc = scratch;
  uint32_t* len = scratch + nt;
  uint32_t* table = scratch + 2 * nt;
  for (uint32_t i = t; i < 256; i += nt) table[i] = crc32_tables().bytes[i];
  __syncthreads();
  const uint32_t chunk = (n + nt - 1) / nt;
  const uint32_t lo = min(n, t * chunk), hi = min(n, lo + chunk);
  crc[t] = crc32_update_with(table, 0, payload + lo, hi - lo);
  len[t] = hi - lo;
  __syncthreads();
  for (uint32_t s = 1; s < nt; s <<= 1) {
    if ((t & (2 * s - 1)) == 0 && t + s < nt) {
      crc[t] = crc32_combine(crc[t], crc[t + s], len[t + s]);
      len[t] += len[t + s];
    }
    __syncthreads();
  }
  const uint32_t payload_crc = crc[0];
  __syncthreads();
  return crc32_combine(slot_crc(gen, nullptr, 0), payload_crc, n);
}

// A newly added (waiting) q's prefix-cache keys and lookup hints, the whole CTA: each thread
// digests its own blocks, thread 0 chains the digests into keys (one splitmix64 a block), then
// each thread hints its own blocks (prefix_hint_block), so that prefix_match mostly checks
// hints a batch at a time instead of probing block after block. q's token row must be written
// and visible to the CTA. A no-op when prefix caching is off. Measured on the H200 (the live
// prefix suite's step log, Llama-3.1-8B shape): see docs/performance.md, *A prompt's prefix
// keys and lookups, a thread a block*.
__device__ __noinline__ void prefix_keys_and_hints_cta(const SchedState& s, SeqState& q) {
  if (!s.cfg.prefix_caching) return;
  const int32_t bs = s.cfg.block_size, first = q.num_hashed, blocks = q.num_tokens / bs;
  const int32_t tid = static_cast<int32_t>(threadIdx.x), nt = static_cast<int32_t>(blockDim.x);
  uint64_t* keys = block_row(s, s.seq_block_keys, q.slot);
  const int32_t* tokens = seq_tokens(s, q.slot);
  for (int32_t k = first + tid; k < blocks; k += nt)
    keys[k] = prefix_block_digest(tokens + k * bs, bs);
  __syncthreads();
  if (tid == 0 && blocks > first) {
    uint64_t key = first > 0 ? keys[first - 1] : prefix_root_key(q);
#pragma unroll 8
    for (int32_t k = first; k < blocks; ++k) keys[k] = key = prefix_key(key, keys[k]);
    q.num_hashed = blocks;
  }
  __syncthreads();
  const int32_t lookable = prefix_lookable_blocks(s, q);
  for (int32_t j = tid; j < lookable; j += nt) prefix_hint_block(s, q, j);
  if (tid == 0) q.num_hinted = lookable;
  __syncthreads();
}

#endif  // __CUDACC__

}  // namespace blink::sched
