// Replays a scheduler scenario through gpu_engine/csrc/scheduler.cuh and prints one line per
// decision, for tests/test_scheduler_parity.py to compare with the Python reference.
//
// Built two ways from this one file:
//   g++  -std=c++17 -I gpu_engine/csrc -x c++ tests/csrc/sched_replay.cc   runs on the CPU
//   nvcc -std=c++17 -I gpu_engine/csrc -x cu  tests/csrc/sched_replay.cc   runs on the GPU: one
//        CTA of 128 threads, thread 0 making every decision as the persistent kernel will, and
//        the whole CTA computing slot_crc_cta next to the serial CRC
// The text is parsed on the host into a flat u32 event stream, the events run where the build
// says (`run_events`, the same code for both), and the decisions come back as an i64 stream that
// the host prints. Lines starting with '#' or '=' are ignored, so a vectors file
// (tests/vectors/scheduler_vectors.txt: events, each followed by its expected lines prefixed
// "= ") is a valid input as it is.
//
// Input, one event a line, integers in decimal or 0x-hex:
//   config SLOTS MAX_MODEL_LEN BLOCK_SIZE NUM_BLOCKS MAX_NUM_SEQS MAX_BATCHED_TOKENS PREFIX_CACHING
//          CONTEXT_LENGTH NUM_EOS EOS_ID...   fresh scheduler state; later events use it
//   add SLOT GEN ARRIVAL MAX_TOKENS TEMPERATURE_BITS TOP_P_BITS TOP_K SEED CACHE_SALT
//       IGNORE_EOS NUM_STOP STOP_ID... PROMPT_LEN TOKEN...   admit (a live slot is retired first)
//   finish SLOT                       retire (a cancel)
//   step                              schedule_step + commit_step
//   sample SLOT TOKEN                 append_token + stop_check (+ finish_seq if it stops)
//   validate VOCAB CONTEXT_LENGTH KV_CAPACITY MAX_PROMPT FIXED_HEX NUM_TOKENS TOKEN...
//                                     validate_slot; FIXED_HEX: the RequestSlotFixed bytes
//   crc GEN SPLIT PAYLOAD_HEX|-       slot_crc, and the same via crc32_combine split at SPLIT
//   uniform SEED STEP                 splitmix64(SEED), uniform(SEED, STEP)
// Output, one line per decision:
//   step sched=SLOT:N,... pre=SLOT:PREEMPTIONS,... smp=SLOT,... run=SLOT:BLOCK.BLOCK,...
//        wait=SLOT,... free=NUM_FREE adm=SLOT:CACHED_TOKENS,...
//        cache=CACHED:EVICTABLE:EVICTED:HIT_TOKENS:QUERY_TOKENS
//                                           (run: every running sequence's block table, in
//                                            running order; wait: the waiting queue, front first;
//                                            adm: the sequences admitted this step)
//   sample SLOT TOKEN REASON DETAIL
//   validate REJECT_REASON
//   crc SERIAL COMBINED
//   uniform SEED STEP SPLITMIX64_HEX DOUBLE_BITS_HEX
//   error WHAT ARG                        (never in a passing run; the host build audits the
//                                          state after every add, finish, step and sample:
//                                          `error 9 CHECK` names the first broken AuditCheck)
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "scheduler.cuh"

namespace {

using namespace blink::sched;

enum Op : uint32_t { kOpStep = 1, kOpAdd, kOpSample, kOpFinish, kOpValidate, kOpCrc, kOpUniform };
enum Out : int64_t { kOutStep = 1, kOutSample, kOutValidate, kOutCrc, kOutUniform, kOutError };
enum Error : int64_t {
  kErrNoState = 1, kErrAdd, kErrNotSampling, kErrAppend, kErrFinishFree, kErrValidateTokens,
  kErrCtaCrc, kErrOverflow, kErrAudit,
};

// What the engine knows beyond the scheduler: the model's stop tokens and context length.
struct Env {
  int32_t has_state;
  int32_t context_length;
  int32_t num_eos;
  int32_t eos_ids[blink::ring::kMaxEosIds];
};

struct Writer {
  int64_t* out;  // [cap]
  int64_t cap;
  int64_t n;
  BLINK_HD void put(int64_t v) {
    if (n < cap) out[n] = v;
    ++n;  // past cap: counted, not written; the host reports the overflow
  }
};

BLINK_HD uint64_t u64_at(const uint32_t* a) { return a[0] | (static_cast<uint64_t>(a[1]) << 32); }

BLINK_HD float f32_from_bits(uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(b);
#else
  float f;
  __builtin_memcpy(&f, &b, sizeof f);
  return f;
#endif
}

// The batch description of a step, as the kernel's forward arrays would hold it.
struct ReplayBatch {
  int32_t starts[kMaxStepSeqs + 1], context_lens[kMaxStepSeqs], logit_token[kMaxStepSeqs];
  float temperature[kMaxStepSeqs], top_p[kMaxStepSeqs];
  int32_t top_k[kMaxStepSeqs];
  uint64_t seed[kMaxStepSeqs];
  uint32_t step[kMaxStepSeqs];
  int32_t row_slot[kMaxStepSeqs];
  BLINK_HD BatchView view() {
    return {starts, context_lens, logit_token, temperature, top_p, top_k, seed, step, row_slot};
  }
};

// One step's working memory: the plan and its batch description.
struct StepScratch {
  StepPlan plan;
  ReplayBatch batch;
};

// smp: the logits rows' sequences, as describe_batch chose them before commit_step.
BLINK_HD void emit_step(const SchedState& s, const StepPlan& plan, const ReplayBatch& batch,
                        BatchSize size, Writer& w) {
  w.put(kOutStep);
  w.put(plan.num_scheduled);
  for (int32_t k = 0; k < plan.num_scheduled; ++k) {
    w.put(plan.slots[k]);
    w.put(plan.num_new_tokens[k]);
  }
  w.put(plan.num_preempted);
  for (int32_t k = 0; k < plan.num_preempted; ++k) {
    w.put(plan.preempted[k]);
    w.put(s.seqs[plan.preempted[k]].preemptions);
  }
  w.put(size.num_rows);
  for (int32_t l = 0; l < size.num_rows; ++l) w.put(batch.row_slot[l]);
  w.put(s.num_running);
  for (int32_t k = 0; k < s.num_running; ++k) {
    const SeqState& q = s.seqs[s.running[k]];
    w.put(q.slot);
    w.put(q.num_blocks);
    for (int32_t j = 0; j < q.num_blocks; ++j) w.put(block_table(s, q.slot)[j]);
  }
  w.put(s.num_waiting);
  for (int32_t k = 0; k < s.num_waiting; ++k) w.put(waiting_at(s, k));
  w.put(pool_takeable(s));
  w.put(plan.num_admitted);
  for (int32_t k = plan.num_scheduled - plan.num_admitted; k < plan.num_scheduled; ++k) {
    w.put(plan.slots[k]);
    w.put(s.seqs[plan.slots[k]].cached_tokens);
  }
  w.put(s.num_cached);
  w.put(s.num_evictable);
  w.put(static_cast<int64_t>(s.evicted_blocks));
  w.put(static_cast<int64_t>(s.hit_tokens));
  w.put(static_cast<int64_t>(s.query_tokens));
}

BLINK_HD void emit_error(Writer& w, Error what, int64_t arg) {
  w.put(kOutError);
  w.put(what);
  w.put(arg);
}

#if !defined(__CUDACC__)
// The host build checks the state's own consistency after every event that changes it (the
// parity test compares decisions; this catches a corrupt free list, evictable queue, cache table
// or reference count before it shows in one): error kErrAudit CHECK on the first that fails.
enum AuditCheck : int64_t {
  kAuditSeqBlocks = 1, kAuditRefs, kAuditFreeList, kAuditLru, kAuditPartition, kAuditCacheTable,
  kAuditCacheFind, kAuditKeyed, kAuditKeys, kAuditQueues,
};

int64_t audit_state(const SchedState& s) {
  const SchedConfig& c = s.cfg;
  std::vector<int32_t> held(c.num_blocks, 0);
  std::vector<int32_t> queued(c.num_slots, 0);
  for (int32_t k = 0; k < s.num_running; ++k) ++queued[s.running[k]];
  for (int32_t k = 0; k < s.num_waiting; ++k) ++queued[waiting_at(s, k)];
  for (int32_t slot = 0; slot < c.num_slots; ++slot) {
    const SeqState& q = s.seqs[slot];
    if (queued[slot] != (q.status == SeqStatus::kFree ? 0 : 1)) return kAuditQueues;
    if (q.status != SeqStatus::kRunning) {  // (a finished one keeps its last count)
      if (q.num_blocks != 0 || (q.status == SeqStatus::kWaiting && q.num_computed != 0))
        return kAuditSeqBlocks;
      continue;
    }
    if (q.num_blocks != blocks_for(q.num_computed, c.block_size)) return kAuditSeqBlocks;
    for (int32_t j = 0; j < q.num_blocks; ++j) ++held[block_table(s, slot)[j]];
    if (c.prefix_caching && q.num_keyed != q.num_computed / c.block_size) return kAuditKeyed;
    for (int32_t j = 0; j < q.num_keyed; ++j)  // its keyed blocks are the cached ones
      if (s.block_uid[block_table(s, slot)[j]] != block_uids(s, slot)[j]) return kAuditKeyed;
  }
  for (int32_t k = 0; k < s.num_running; ++k)
    if (s.seqs[s.running[k]].status != SeqStatus::kRunning) return kAuditQueues;
  for (int32_t k = 0; k < s.num_waiting; ++k)
    if (s.seqs[waiting_at(s, k)].status != SeqStatus::kWaiting) return kAuditQueues;
  int32_t in_use = 0, cached = 0;
  for (int32_t b = 0; b < c.num_blocks; ++b) {
    if (s.block_refs[b] != held[b]) return kAuditRefs;
    in_use += held[b] > 0;
    cached += s.block_uid[b] != 0;
  }
  std::vector<char> seen(c.num_blocks, 0);
  for (int32_t k = 0; k < s.num_free; ++k) {
    const int32_t b = s.free_blocks[k];
    if (b < 0 || b >= c.num_blocks || seen[b] || s.block_refs[b] || s.block_uid[b])
      return kAuditFreeList;
    seen[b] = 1;
  }
  int32_t walked = 0;
  for (int32_t b = s.lru_head, prev = -1; b >= 0; prev = b, b = s.lru_next[b]) {
    if (b >= c.num_blocks || seen[b] || s.lru_prev[b] != prev || s.block_refs[b] ||
        !s.block_uid[b] || ++walked > s.num_evictable)
      return kAuditLru;
    seen[b] = 1;
    if (s.lru_next[b] < 0 && s.lru_tail != b) return kAuditLru;
  }
  if (walked != s.num_evictable) return kAuditLru;
  if (s.num_free + s.num_evictable + in_use != c.num_blocks) return kAuditPartition;
  if (cached != s.num_cached) return kAuditCacheTable;
  int32_t entries = 0;
  for (uint32_t i = 0; i <= s.cache_mask; ++i) {
    const int32_t b = s.cache_table[i];
    if (b < 0) continue;
    ++entries;
    if (b >= c.num_blocks || !s.block_uid[b]) return kAuditCacheTable;
    // each cached identity once, found from its key's home
    if (cache_find(s, s.block_key[b], s.block_parent[b], cached_tokens_of(s, b)) != b)
      return kAuditCacheFind;
  }
  if (entries != s.num_cached) return kAuditCacheTable;
  for (int32_t slot = 0; slot < c.num_slots; ++slot) {  // keys: the chain over the tokens
    const SeqState& q = s.seqs[slot];
    if (q.status == SeqStatus::kFree) continue;
    const uint64_t* keys = block_row(s, s.seq_block_keys, slot);
    uint64_t key = prefix_root_key(q);
    for (int32_t j = 0; j < q.num_hashed; ++j) {
      if (j >= q.num_tokens / c.block_size) return kAuditKeys;
      key = prefix_key(key, prefix_block_digest(seq_tokens(s, slot) + j * c.block_size,
                                                c.block_size));
      if (keys[j] != key) return kAuditKeys;
    }
  }
  return 0;
}
#endif

// One serial event (everything but the CTA part of crc). a: the event's arguments.
BLINK_HD void run_event(SchedState* s, StepPlan* plan, ReplayBatch* batch, const Env& env,
                        uint32_t op, const uint32_t* a, Writer& w) {
  const bool needs_state = op == kOpStep || op == kOpAdd || op == kOpSample || op == kOpFinish;
  if (needs_state && !env.has_state) return emit_error(w, kErrNoState, op);
  switch (op) {
    case kOpStep: {
      schedule_step(*s, *plan);
      const BatchSize size = describe_batch(*s, *plan, batch->view());
      commit_step(*s, *plan);
      return emit_step(*s, *plan, *batch, size, w);
    }
    case kOpAdd: {
      SamplingParams p{};
      p.max_tokens = a[4];
      p.temperature = f32_from_bits(a[5]);
      p.top_p = f32_from_bits(a[6]);
      p.top_k = static_cast<int32_t>(a[7]);
      p.seed = u64_at(a + 8);
      p.ignore_eos = a[12];
      p.num_stop_ids = a[13];
      for (uint32_t i = 0; i < a[13]; ++i) p.stop_ids[i] = static_cast<int32_t>(a[14 + i]);
      const uint32_t* prompt = a + 14 + a[13];
      Admission one{u64_at(a + 2), a[1], static_cast<int32_t>(a[0]),
                    static_cast<int32_t>(prompt[0]), reinterpret_cast<const int32_t*>(prompt + 1),
                    p};
      uint64_t cache_salt_by_slot[kMaxSlots] = {};  // (the one slot's entry is read)
      if (one.slot >= 0 && one.slot < kMaxSlots) cache_salt_by_slot[one.slot] = u64_at(a + 10);
      bool added = false;
      admit_in_order(*s, &one, 1, cache_salt_by_slot, [&](const Admission&, AddResult r) {
        added = r == AddResult::kAdded || r == AddResult::kReplacedStale;
        if (!added) emit_error(w, kErrAdd, static_cast<int64_t>(r));
      });
      // as the kernel's Admit does: the new prompt's lookup hints
      if (added) prefix_hint_blocks(*s, s->seqs[one.slot]);
      return;
    }
    case kOpSample: {
      const int32_t slot = static_cast<int32_t>(a[0]), token = static_cast<int32_t>(a[1]);
      if (slot < 0 || slot >= s->cfg.num_slots || s->seqs[slot].status != SeqStatus::kRunning ||
          !samples_now(s->seqs[slot]))
        return emit_error(w, kErrNotSampling, slot);
      StopResult r;
      if (!consume_sample(*s, slot, token, env.eos_ids, env.num_eos, env.context_length, &r))
        return emit_error(w, kErrAppend, slot);
      if (r.reason != FinishReason::kNone) finish_seq(*s, slot);
      w.put(kOutSample);
      w.put(slot);
      w.put(token);
      w.put(static_cast<int64_t>(r.reason));
      w.put(r.detail);
      return;
    }
    case kOpFinish: {
      const int32_t slot = static_cast<int32_t>(a[0]);
      if (slot < 0 || slot >= s->cfg.num_slots || !finish_seq(*s, slot))
        emit_error(w, kErrFinishFree, slot);
      return;
    }
    case kOpValidate: {
      RequestSlotFixed f;
      const uint8_t* bytes = reinterpret_cast<const uint8_t*>(a + 5);
      uint8_t* dst = reinterpret_cast<uint8_t*>(&f);
      for (uint32_t i = 0; i < sizeof f; ++i) dst[i] = bytes[i];
      const uint32_t max_prompt = a[4];
      const uint32_t ntok = a[5 + sizeof f / 4];
      const uint32_t expect = f.prompt_len < max_prompt ? f.prompt_len : max_prompt;
      if (ntok != expect) return emit_error(w, kErrValidateTokens, ntok);
      const RejectReason r = validate_slot(
          f, reinterpret_cast<const int32_t*>(a + 6 + sizeof f / 4), a[0], a[1], u64_at(a + 2),
          max_prompt);
      w.put(kOutValidate);
      w.put(static_cast<int64_t>(r));
      return;
    }
    case kOpCrc: {
      const uint32_t gen = a[0], split = a[1], n = a[2];
      const uint8_t* payload = reinterpret_cast<const uint8_t*>(a + 3);
      const uint32_t serial = slot_crc(gen, payload, n);
      const uint32_t combined = crc32_combine(slot_crc(gen, payload, split),
                                              crc32_update(0, payload + split, n - split),
                                              n - split);
      w.put(kOutCrc);
      w.put(serial);
      w.put(combined);
      return;
    }
    case kOpUniform: {
      const uint64_t seed = u64_at(a), step = u64_at(a + 2);
      const double u = uniform(seed, step);
      uint64_t bits;
      static_assert(sizeof bits == sizeof u, "double is 64-bit");
      const uint8_t* src = reinterpret_cast<const uint8_t*>(&u);
      uint8_t* dst = reinterpret_cast<uint8_t*>(&bits);
      for (int i = 0; i < 8; ++i) dst[i] = src[i];
      w.put(kOutUniform);
      w.put(static_cast<int64_t>(seed));
      w.put(static_cast<int64_t>(step));
      w.put(static_cast<int64_t>(splitmix64(seed)));
      w.put(static_cast<int64_t>(bits));
      return;
    }
    default:
      return;
  }
}

// ev: [num_words] u32 of events, each [op, num_args, args...]. On the GPU every thread of the
// CTA runs this loop: thread 0 makes the decisions, all take part in slot_crc_cta.
// scratch: [2 * blockDim.x + 256] u32 shared memory on the GPU, unused on the host.
BLINK_HD void run_events(SchedState* s, StepScratch* step, const Env* env, const uint32_t* ev,
                         int64_t num_words, int64_t* out, int64_t cap, int64_t* out_len,
                         uint32_t* scratch) {
#if defined(__CUDA_ARCH__)
  const bool lead = threadIdx.x == 0;
#else
  const bool lead = true;
  (void)scratch;
#endif
  Writer w{out, cap, 0};
  if (lead && env->has_state) state_init(*s);
  for (int64_t pos = 0; pos < num_words; pos += 2 + ev[pos + 1]) {
    const uint32_t op = ev[pos];
    const uint32_t* a = ev + pos + 2;
#if defined(__CUDA_ARCH__)
    __syncthreads();
    if (op == kOpCrc) {
      const uint8_t* payload = reinterpret_cast<const uint8_t*>(a + 3);
      const uint32_t cta = slot_crc_cta(a[0], payload, a[2], scratch);
      if (lead && cta != slot_crc(a[0], payload, a[2]))
        emit_error(w, kErrCtaCrc, cta);
    }
#endif
    if (lead) run_event(s, &step->plan, &step->batch, *env, op, a, w);
#if !defined(__CUDACC__)
    if (env->has_state && (op == kOpStep || op == kOpAdd || op == kOpSample || op == kOpFinish))
      if (const int64_t failed = audit_state(*s)) emit_error(w, kErrAudit, failed);
#endif
  }
  if (lead) *out_len = w.n;
}

// -- host side: parse, run, print --------------------------------------------------------------

struct Segment {
  Env env{};
  SchedConfig cfg{};
  std::vector<uint32_t> events;
  int64_t out_bound = 0;  // i64 words the output can take at most
};

[[noreturn]] void die(const std::string& why, int line) {
  std::cerr << "sched_replay: line " << line << ": " << why << "\n";
  exit(2);
}

void push_u64(std::vector<uint32_t>& v, uint64_t x) {
  v.push_back(static_cast<uint32_t>(x));
  v.push_back(static_cast<uint32_t>(x >> 32));
}

std::vector<uint8_t> parse_hex(const std::string& h, int line) {
  if (h == "-") return {};
  if (h.size() % 2) die("odd hex length", line);
  std::vector<uint8_t> b(h.size() / 2);
  for (size_t i = 0; i < b.size(); ++i)
    b[i] = static_cast<uint8_t>(std::stoul(h.substr(2 * i, 2), nullptr, 16));
  return b;
}

void push_bytes(std::vector<uint32_t>& v, const std::vector<uint8_t>& b) {
  const size_t first = v.size();
  v.resize(first + (b.size() + 3) / 4, 0);
  if (!b.empty()) memcpy(v.data() + first, b.data(), b.size());
}

std::vector<Segment> parse(std::istream& in) {
  std::vector<Segment> segs(1);
  std::string text;
  int line = 0;
  while (std::getline(in, text)) {
    ++line;
    std::istringstream ls(text);
    std::string op;
    if (!(ls >> op) || op[0] == '#' || op[0] == '=') continue;
    std::vector<std::string> f;
    for (std::string t; ls >> t;) f.push_back(t);
    size_t at = 0;
    auto next = [&]() -> const std::string& {
      if (at >= f.size()) die("too few fields", line);
      return f[at++];
    };
    auto i64 = [&]() { return static_cast<int64_t>(std::stoll(next(), nullptr, 0)); };
    auto u64 = [&]() { return static_cast<uint64_t>(std::stoull(next(), nullptr, 0)); };
    auto u32 = [&]() { return static_cast<uint32_t>(i64()); };
    Segment* seg = &segs.back();
    std::vector<uint32_t> args;
    uint32_t code = 0;
    if (op == "config") {
      segs.emplace_back();
      seg = &segs.back();
      SchedConfig& c = seg->cfg;
      c.num_slots = static_cast<int32_t>(i64());
      c.max_model_len = static_cast<int32_t>(i64());
      c.block_size = static_cast<int32_t>(i64());
      c.num_blocks = static_cast<int32_t>(i64());
      c.max_num_seqs = static_cast<int32_t>(i64());
      c.max_num_batched_tokens = static_cast<int32_t>(i64());
      c.prefix_caching = static_cast<int32_t>(i64());
      seg->env.context_length = static_cast<int32_t>(i64());
      seg->env.num_eos = static_cast<int32_t>(i64());
      if (seg->env.num_eos < 0 || seg->env.num_eos > static_cast<int32_t>(blink::ring::kMaxEosIds))
        die("bad eos count", line);
      for (int32_t i = 0; i < seg->env.num_eos; ++i)
        seg->env.eos_ids[i] = static_cast<int32_t>(i64());
      if (const char* err = config_error(c)) die(err, line);
      seg->env.has_state = 1;
    } else if (op == "step") {
      code = kOpStep;
    } else if (op == "add") {
      code = kOpAdd;
      args.push_back(u32());  // slot
      args.push_back(u32());  // gen
      push_u64(args, u64());  // arrival
      for (int i = 0; i < 4; ++i) args.push_back(u32());  // max_tokens temperature top_p top_k
      push_u64(args, u64());  // seed
      push_u64(args, u64());  // cache_salt
      args.push_back(u32());  // ignore_eos
      const uint32_t nstop = u32();
      if (nstop > kMaxStopIds) die("too many stop ids", line);
      args.push_back(nstop);
      for (uint32_t i = 0; i < nstop; ++i) args.push_back(u32());
      const uint32_t plen = u32();
      args.push_back(plen);
      for (uint32_t i = 0; i < plen; ++i) args.push_back(u32());
    } else if (op == "sample") {
      code = kOpSample;
      args.push_back(u32());
      args.push_back(u32());
    } else if (op == "finish") {
      code = kOpFinish;
      args.push_back(u32());
    } else if (op == "validate") {
      code = kOpValidate;
      args.push_back(u32());  // vocab
      args.push_back(u32());  // context length
      push_u64(args, u64());  // kv capacity tokens
      args.push_back(u32());  // max prompt tokens
      const std::vector<uint8_t> fixed = parse_hex(next(), line);
      if (fixed.size() != sizeof(RequestSlotFixed))
        die("fixed part must be sizeof(RequestSlotFixed) bytes", line);
      push_bytes(args, fixed);
      const uint32_t ntok = u32();
      args.push_back(ntok);
      for (uint32_t i = 0; i < ntok; ++i) args.push_back(u32());
    } else if (op == "crc") {
      code = kOpCrc;
      args.push_back(u32());  // gen
      const uint32_t split = u32();
      const std::vector<uint8_t> payload = parse_hex(next(), line);
      if (split > payload.size()) die("split past the payload", line);
      args.push_back(split);
      args.push_back(static_cast<uint32_t>(payload.size()));
      push_bytes(args, payload);
    } else if (op == "uniform") {
      code = kOpUniform;
      push_u64(args, u64());
      push_u64(args, u64());
    } else {
      die("unknown event " + op, line);
    }
    if (at != f.size()) die("trailing fields", line);
    if (code == 0) continue;
    seg->events.push_back(code);
    seg->events.push_back(static_cast<uint32_t>(args.size()));
    seg->events.insert(seg->events.end(), args.begin(), args.end());
    const SchedConfig& c = seg->cfg;
    // a step: its plan, preemptions, rows and admissions (a few words per slot each), every
    // running block table (shared blocks appear in each table holding them) and the counters
    seg->out_bound += code == kOpStep
        ? 13 + int64_t{c.num_slots} * (10 + max_blocks_per_seq(c)) : 8;
  }
  return segs;
}

std::string join(const std::vector<std::string>& parts, const char* sep) {
  std::string s;
  for (size_t i = 0; i < parts.size(); ++i) s += (i ? sep : "") + parts[i];
  return s;
}

void print(const int64_t* o, int64_t n) {
  int64_t i = 0;
  auto next = [&]() -> int64_t {
    if (i < n) return o[i++];
    fprintf(stderr, "sched_replay: truncated output\n");
    exit(2);
  };
  char buf[64];
  while (i < n) {
    const int64_t kind = next();
    if (kind == kOutStep) {
      std::vector<std::string> sched, pre, smp, run, wait;
      for (int64_t k = next(); k > 0; --k) {
        const int64_t slot = next(), tokens = next();
        sched.push_back(std::to_string(slot) + ":" + std::to_string(tokens));
      }
      for (int64_t k = next(); k > 0; --k) {
        const int64_t slot = next(), count = next();
        pre.push_back(std::to_string(slot) + ":" + std::to_string(count));
      }
      for (int64_t k = next(); k > 0; --k) smp.push_back(std::to_string(next()));
      for (int64_t k = next(); k > 0; --k) {
        const int64_t slot = next();
        std::vector<std::string> blocks;
        for (int64_t b = next(); b > 0; --b) blocks.push_back(std::to_string(next()));
        run.push_back(std::to_string(slot) + ":" + join(blocks, "."));
      }
      for (int64_t k = next(); k > 0; --k) wait.push_back(std::to_string(next()));
      const int64_t free_blocks = next();
      std::vector<std::string> adm, cache;
      for (int64_t k = next(); k > 0; --k) {
        const int64_t slot = next(), cached = next();
        adm.push_back(std::to_string(slot) + ":" + std::to_string(cached));
      }
      for (int k = 0; k < 5; ++k) cache.push_back(std::to_string(next()));
      printf("step sched=%s pre=%s smp=%s run=%s wait=%s free=%lld adm=%s cache=%s\n",
             join(sched, ",").c_str(), join(pre, ",").c_str(), join(smp, ",").c_str(),
             join(run, ",").c_str(), join(wait, ",").c_str(), static_cast<long long>(free_blocks),
             join(adm, ",").c_str(), join(cache, ":").c_str());
    } else if (kind == kOutSample) {
      const int64_t slot = next(), token = next(), reason = next(), detail = next();
      printf("sample %lld %lld %lld %lld\n", static_cast<long long>(slot),
             static_cast<long long>(token), static_cast<long long>(reason),
             static_cast<long long>(detail));
    } else if (kind == kOutValidate) {
      printf("validate %lld\n", static_cast<long long>(next()));
    } else if (kind == kOutCrc) {
      const int64_t serial = next(), combined = next();
      printf("crc %lld %lld\n", static_cast<long long>(serial), static_cast<long long>(combined));
    } else if (kind == kOutUniform) {
      const uint64_t seed = next(), step = next(), mixed = next(), bits = next();
      snprintf(buf, sizeof buf, "%016llx %016llx", static_cast<unsigned long long>(mixed),
               static_cast<unsigned long long>(bits));
      printf("uniform %llu %llu %s\n", static_cast<unsigned long long>(seed),
             static_cast<unsigned long long>(step), buf);
    } else if (kind == kOutError) {
      const int64_t what = next(), arg = next();
      printf("error %lld %lld\n", static_cast<long long>(what), static_cast<long long>(arg));
    } else {
      fprintf(stderr, "bad output kind %lld\n", static_cast<long long>(kind));
      exit(2);
    }
  }
}

#if defined(__CUDACC__)

#define CUDA_CHECK(x)                                                                   \
  do {                                                                                  \
    cudaError_t e_ = (x);                                                               \
    if (e_ != cudaSuccess) {                                                            \
      fprintf(stderr, "sched_replay: %s: %s\n", #x, cudaGetErrorString(e_));            \
      exit(3);                                                                          \
    }                                                                                   \
  } while (0)

constexpr int kThreads = 128;

__global__ void replay_kernel(SchedState* s, StepScratch* step, const Env* env, const uint32_t* ev,
                              int64_t num_words, int64_t* out, int64_t cap, int64_t* out_len) {
  __shared__ uint32_t scratch[2 * kThreads + 256];
  run_events(s, step, env, ev, num_words, out, cap, out_len, scratch);
}

std::vector<int64_t> run_segment(const Segment& seg) {
  SchedState host_state{};
  void* mem = nullptr;
  if (seg.env.has_state) {
    CUDA_CHECK(cudaMalloc(&mem, state_layout(seg.cfg).total_bytes));
    state_bind(host_state, seg.cfg, mem);  // device addresses, computed on the host
  }
  SchedState* d_state;
  StepScratch* d_step;
  Env* d_env;
  uint32_t* d_ev;
  int64_t *d_out, *d_len;
  const int64_t cap = seg.out_bound + 3;
  CUDA_CHECK(cudaMalloc(&d_state, sizeof(SchedState)));
  CUDA_CHECK(cudaMalloc(&d_step, sizeof(StepScratch)));
  CUDA_CHECK(cudaMalloc(&d_env, sizeof(Env)));
  CUDA_CHECK(cudaMalloc(&d_ev, seg.events.size() * 4 + 4));
  CUDA_CHECK(cudaMalloc(&d_out, cap * 8));
  CUDA_CHECK(cudaMalloc(&d_len, 8));
  CUDA_CHECK(cudaMemcpy(d_state, &host_state, sizeof host_state, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(d_env, &seg.env, sizeof seg.env, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(d_ev, seg.events.data(), seg.events.size() * 4, cudaMemcpyHostToDevice));
  replay_kernel<<<1, kThreads>>>(d_state, d_step, d_env, d_ev,
                                 static_cast<int64_t>(seg.events.size()), d_out, cap, d_len);
  CUDA_CHECK(cudaGetLastError());
  CUDA_CHECK(cudaDeviceSynchronize());
  int64_t n = 0;
  CUDA_CHECK(cudaMemcpy(&n, d_len, 8, cudaMemcpyDeviceToHost));
  std::vector<int64_t> out(static_cast<size_t>(n < cap ? n : cap));
  CUDA_CHECK(cudaMemcpy(out.data(), d_out, out.size() * 8, cudaMemcpyDeviceToHost));
  if (n > cap) out = {kOutError, kErrOverflow, n};
  for (void* p : {mem, static_cast<void*>(d_state), static_cast<void*>(d_step),
                  static_cast<void*>(d_env), static_cast<void*>(d_ev), static_cast<void*>(d_out),
                  static_cast<void*>(d_len)})
    if (p) CUDA_CHECK(cudaFree(p));
  return out;
}

#else

std::vector<int64_t> run_segment(const Segment& seg) {
  SchedState state{};
  std::vector<uint64_t> mem;  // 8-byte aligned, as SeqState needs
  if (seg.env.has_state) {
    mem.resize(state_layout(seg.cfg).total_bytes / 8 + 1);
    state_bind(state, seg.cfg, mem.data());
  }
  static StepScratch step;
  const int64_t cap = seg.out_bound + 3;
  std::vector<int64_t> out(static_cast<size_t>(cap));
  int64_t n = 0;
  run_events(&state, &step, &seg.env, seg.events.data(), static_cast<int64_t>(seg.events.size()),
             out.data(), cap, &n, nullptr);
  if (n > cap) return {kOutError, kErrOverflow, n};
  out.resize(static_cast<size_t>(n));
  return out;
}

#endif

}  // namespace

int main() {
  std::ios::sync_with_stdio(false);
  for (const Segment& seg : parse(std::cin)) {
    if (seg.events.empty()) continue;
    const std::vector<int64_t> out = run_segment(seg);
    print(out.data(), static_cast<int64_t>(out.size()));
  }
  return 0;
}
