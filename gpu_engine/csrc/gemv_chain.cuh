// The projections after a decode token's attention (o + residual, RMSNorm + gate|up + SiLU,
// down + residual) in one persistent kernel, for batch 1: three kernels a layer become one.
// Bit for bit the skinny kernels' sums. On by default only where a layer's three projections
// come to ForwardKernels.CHAIN_MIN_LAYER_BYTES (CudaForward projection_chain): on the H200 it
// wins on Llama-3.1-8B's 386 MB a layer and loses on 109-170 MB ones (docs/performance.md
// round 22: batch 1 at 512 keys, 8B 3.795-3.806 against 3.826 ms a step, Qwen3-4B 2.627
// against 2.527, Llama-3.2-3B 1.938 against 1.862, Llama-3.2-1B 0.814 against 0.767).
// E4M3 weights (the _fp8 entry, gemv.cuh Fp8Weights) take the same ring, bit for bit the FP8
// skinny kernels' sums; they are never on by default: at 8B about even with the FP8 skinny
// kernels since the epilogue warp below (round 26: 2.399-2.401 against 2.406 ms a step; 2.643
// before it; 2.401-2.402 against 2.414 with two, round 31), at 1B slower (0.654-0.656 against
// 0.560).
//
// Why try: at batch 1 every projection needs all of the one before it, so each kernel boundary
// is a drain and a refill of the memory pipe: the slowest CTA's tail, then the next kernel's
// first loads (programmatic dependent launch hides the launch, not the tail). In a
// microbenchmark on the H200 (the 1B step's 65 weight streams, a dependent read at each
// boundary) a chain of PDL kernels cost 3.2 us a boundary over one kernel reading everything;
// one persistent kernel with a grid barrier a phase, each CTA's next weights loaded into
// registers before the barrier, 3.9; the same with a ring of shared-memory slots that a TMA
// producer warp keeps full *across* the barriers (the weights depend on nothing), 0.53. This is
// that kernel with the skinny projections' math.
//
// Work split: the producer warp takes each projection's row blocks (the skinny kernel's: 16
// rows, gate|up's 16 gate and 16 up rows) from the layer's counter, one at a time, so an SM
// that streams faster takes more. It copies each row block's tiled weights, kChainSlotBytes at
// a time (a chunk: the same 1 KB steps of each of its row tiles), into the next free slot with
// cp.async.bulk, tags the slot with the chunk's phase and row block, and refills a slot as soon
// as every consumer warp is done with it, so the CTA always has kChainSlots chunks on their way,
// the next projection's first ones while it waits for its x; a slot tagged with no phase
// ends the CTA's work. The 8 consumer warps follow the tags and take a chunk's steps
// round-robin as SkinnyAccumulate's warps take a row block's (warp w: steps w, w + 8, ...,
// ascending), with the same MMAs and epilogues: bit for bit the unsplit skinny kernel's sums,
// whichever CTA takes a row block. They hand each row block's warp sums to the epilogue warps
// (ChainEpilogue: two buffers in shared memory, a warp each, named barriers) and go on with the
// next row block while they store them: the epilogue's three CTA barriers and its read of the
// residual stream held every consumer warp, the ring full behind them (ncu, 1B: a fifth of the
// warps' stall samples at those barriers; E4M3 at 8B 2.643 -> 2.399 ms a step, bf16 3.718 ->
// 3.704), and with one epilogue warp, gate|up's consumers still waited for it to free a buffer
// (ncu, 8B E4M3: 7.5% of the kernel's stall samples; docs/performance.md round 31).
//
// Dataflow, not grid barriers: a projection's x (attn, the residual stream's shadow, act) is
// written by every CTA in the phase before, but a chunk needs only its own columns of x. So each
// stored row block of o and gate|up is counted (a release add) on the slice of the next x it wrote
// (kChainSliceCols columns), and a loader warp copies each slice of x into shared memory (L2-only
// loads, as attention reads what other SMs wrote) once its count is full (each lane acquiring the
// count of the slice it copies), so that gate|up starts on the first columns of the shadow while
// o's last row blocks are still streaming, and down on the first columns of act during gate|up's
// tail (a grid barrier a phase, round 16's first version, waited for the slowest CTA: gate|up's
// last ends ~2 us after the median one, a row block being 4 us of an SM's share of the bandwidth).
// x has two buffers, phase 2 taking phase 0's once the consumers are past it. The down projection
// adds into residual rows that another CTA's o projection added into: ordered by the same chain
// (down's first chunk needs act, act all of the shadow, the shadow every o row block). After
// gate|up the CTA lets the next kernel launch (the next layer's qkv projection takes the room
// beside it and starts on its weights; it waits for this grid's end before reading x). A CTA's
// loader copies the shadow only once its producer has taken a row block of gate|up. The last
// epilogue warp out (an arrival count, by each once its end is handed off and its CTA's loader
// has made its last poll) is the last user of the counters and zeroes them for the next step.
//
// No CTA waits for another CTA, only for row blocks, and a row block is taken only by a running
// CTA's producer, which takes all of a projection's before any of the next: so a CTA waits only
// for work that running CTAs hold and finish without waiting for anything later. The grid need
// not be resident at once (an SM limit such as MPS's, or another kernel beside it, makes it
// slower, not stuck; test_projection_chain runs a grid three times the GPU's). CTAs that start
// after the work is gone find the counters spent, tag their end and count themselves out (their
// loader may still copy attn, and act where down's row blocks remain when it asks).
// Assumed: two launches on the same counters are never next to each other in a stream (the
// second's producers, started early, would take row blocks before the first zeroes the
// counters; the forward pass gives each layer its own). A launch that faults leaves its
// counters nonzero, but a fault is sticky: the context is gone with them.
#pragma once
#include "gemv.cuh"

namespace blink {

static constexpr int kChainSlots = 4;
static constexpr int kChainSlotBytes = 32 * 1024;
static constexpr int kChainStepBytes = 16 * 32 * static_cast<int>(sizeof(bf16));  // 1 KB
// x of the phase, copied into shared memory by the loader warp (read from L2 a step at a time,
// each chunk waited a round trip: 2.7 TB/s on the 1B shape, against 3.2-3.4 so)
static constexpr int kChainMaxK = 16384;
static constexpr int kChainRingBytes = kChainSlots * kChainSlotBytes;
// the most a launch takes (the host asks for the ring and two of its layer's largest x)
static constexpr int kChainSmemBytes =
    kChainRingBytes + 2 * kChainMaxK * static_cast<int>(sizeof(bf16));
static constexpr int kChainPhases = 3;  // o, gate|up, down
// x's columns a ready counter covers: a projection may start on the columns of x that the one
// before has finished (32 of its 16-row blocks), not wait for all of them
static constexpr int kChainSliceCols = 512;
static constexpr int kChainMaxSlices = kChainMaxK / kChainSliceCols;

// One projection of the chain: out (+)= x @ W^T for the one token row.
struct ChainProjection {
  const bf16* x;  // [K]
  const void* w;  // tiled (gemv.cuh): bf16, or E4M3 codes (the _fp8 entry), tiles
  uint32_t w_tile_stride;  // elements apart
  int N, K;
  void* out;    // the fp32 residual stream, added into (o, down), or act in bf16 (gate|up)
  bf16* shadow;  // the residual stream's bf16 copy (o, down)
  const float* w_scale;  // E4M3 codes: their rows' scales (bf16 weights: null)
  const bf16* norm_w;    // E4M3 gate|up: the RMSNorm's weight (bf16 weights have it folded in)
};

// The kernel's argument: o, gate|up, down (ForwardKernels.projection_chain packs it; the module
// exports its size, which the host checks).
struct ChainProjections {
  ChainProjection p[kChainPhases];
};

// A phase's row tiles a row block: gate|up pairs 16 gate rows with their 16 up rows.
__device__ __forceinline__ int ChainRowTiles(int phase) { return phase == 1 ? 2 : 1; }

// A chunk's steps (1 KB of a row tile each: 32 k of bf16, 64 of E4M3): a slot holds the same
// steps of each of the row block's row tiles.
__device__ __forceinline__ constexpr int ChainChunkSteps(int row_tiles) {
  return kChainSlotBytes / (row_tiles * kChainStepBytes);
}

// The layer's counters: the epilogue warps out, and each phase's next row block (the
// producers take row blocks as they need them, so an SM that streams faster takes more).
// Zero before the first launch; the last epilogue warp out zeroes them for the next.
struct ChainCounters {
  uint32_t arrivals;
  uint32_t next_row_block[kChainPhases];
  // row blocks of o (gate|up) stored into each slice of the shadow (act): gate|up's (down's) x
  uint32_t ready[kChainPhases - 1][kChainMaxSlices];
};

// Slices of x that its first `cols` columns touch.
__device__ __forceinline__ int ChainSlices(int cols) {
  return (cols + kChainSliceCols - 1) / kChainSliceCols;
}

// Row blocks of the phase before that write slice j of phase `phase`'s x (K columns).
__device__ __forceinline__ uint32_t ChainSliceRowBlocks(int j, int K) {
  return static_cast<uint32_t>(min(kChainSliceCols * (j + 1), K) - kChainSliceCols * j) / 16;
}

// Which chunk a slot holds, written by the producer before its copy (phase kChainPhases: none,
// the CTA's work is done).
struct ChainTag {
  int phase, row_block;
};

// What the producer tells the loader of each phase, once it knows (0 until then): whether its
// CTA took any row block of it. The loader waits for it before copying the shadow: a CTA that
// starts after gate|up's row blocks are gone must not copy the shadow while other CTAs' down
// projections rewrite it (never read, but a race, and bandwidth for nothing).
enum ChainPhaseWork : int { kChainWorkUnknown = 0, kChainWorkSome = 1, kChainWorkNone = 2 };

// A phase's row blocks and the chunks of each.
__device__ __forceinline__ int ChainRowBlocks(const ChainProjection& q, int phase) {
  return (q.N + 16 * ChainRowTiles(phase) - 1) / (16 * ChainRowTiles(phase));
}
template <class W>
__device__ __forceinline__ int ChainChunks(const ChainProjection& q, int phase) {
  const int per_chunk = ChainChunkSteps(ChainRowTiles(phase));
  return (q.K / W::kStepK + per_chunk - 1) / per_chunk;
}

// The producer: chunk `chunk` of `row_block` of phase `phase` into `slot`, counted on `full`.
template <class W>
__device__ __forceinline__ void IssueChainChunk(const ChainProjection& q, int phase,
                                                int row_block, int chunk, char* slot,
                                                uint64_t* full) {
  const int rt = ChainRowTiles(phase), per_chunk = ChainChunkSteps(rt);
  const int first = chunk * per_chunk, steps = min(per_chunk, q.K / W::kStepK - first);
  const uint32_t bytes = static_cast<uint32_t>(steps) * kChainStepBytes;
  MbarrierExpectBytes(full, rt * bytes);
  for (int a = 0; a < rt; ++a) {
    const int tile = min(row_block * rt + a, (q.N - 1) / 16);
    const char* src = static_cast<const char*>(q.w) +
                      static_cast<size_t>(tile) * q.w_tile_stride * sizeof(typename W::Element) +
                      static_cast<size_t>(first) * kChainStepBytes;
    BulkCopy(slot + a * per_chunk * kChainStepBytes, src, bytes, full);
  }
}

// The ring: slot i % kChainSlots holds the CTA's chunk i, tag[s] which one it is; full[s]
// completes when its copy has landed, empty[s] when all kGemvWarps consumer warps are done
// with it.
struct ChainRing {
  char* slots;
  uint64_t* full;
  uint64_t* empty;
  ChainTag* tag;
  int next = 0;  // the chunk the CTA consumes next

  // the next chunk's tag, once it has landed
  __device__ __forceinline__ ChainTag peek() {
    const int s = next % kChainSlots;
    MbarrierWait(&full[s], static_cast<uint32_t>(next / kChainSlots) & 1);
    return tag[s];
  }
  __device__ __forceinline__ const char* acquire() {
    const int s = next % kChainSlots;
    MbarrierWait(&full[s], static_cast<uint32_t>(next / kChainSlots) & 1);
    return slots + s * kChainSlotBytes;
  }
  // this warp is done with chunk `next`
  __device__ __forceinline__ void release() {
    __syncwarp();
    if (threadIdx.x % kWarpSize == 0) MbarrierArrive(&empty[next % kChainSlots]);
    ++next;
  }
  // The producer warp's lane: row blocks taken from the layer's counters, phase after phase,
  // each chunk into its slot as soon as the consumers are done with the chunk kChainSlots
  // before it; then an empty slot tagged as the end. work[phase] says, as soon as it is known,
  // whether any row block of the phase was taken (ChainPhaseWork).
  template <class W>
  __device__ __forceinline__ void produce(const ChainProjection* p, ChainCounters* counters,
                                          volatile int* work) {
    int i = 0;
    auto take_slot = [&]() {
      const int s = i % kChainSlots;
      if (i >= kChainSlots)
        MbarrierWait(&empty[s], static_cast<uint32_t>(i / kChainSlots - 1) & 1);
      ++i;
      return s;
    };
    for (int phase = 0; phase < kChainPhases; ++phase) {
      const int blocks = ChainRowBlocks(p[phase], phase);
      const int chunks = ChainChunks<W>(p[phase], phase);
      int rb = atomicAdd(&counters->next_row_block[phase], 1u);
      work[phase] = rb < blocks ? kChainWorkSome : kChainWorkNone;
      for (; rb < blocks; rb = atomicAdd(&counters->next_row_block[phase], 1u)) {
        for (int c = 0; c < chunks; ++c) {
          const int s = take_slot();
          tag[s] = {phase, rb};
          IssueChainChunk<W>(p[phase], phase, rb, c, slots + s * kChainSlotBytes, &full[s]);
        }
      }
    }
    const int s = take_slot();
    tag[s] = {kChainPhases, 0};
    MbarrierArrive(&full[s]);
  }
};

// The loader's progress word: phase `phase`'s x has its first `slices` slices in shared memory.
__device__ __forceinline__ constexpr int ChainXLoaded(int phase, int slices) {
  return phase * 2 * kChainMaxSlices + slices;
}

// The loader warp: each phase's x into shared memory (phase % 2's buffer), slices as the phase
// before finishes them (phase 0's, attn, after the prior kernel): each poll looks at the next eight
// slices, and the run of finished ones is copied and published on x_loaded. Phase 2 reuses phase
// 0's buffer once the consumers are past phase 0 (consumers_phase). The shadow's slices are copied
// only once the producer has taken a row block of gate|up (work), and other phases' x is skipped
// where it knows there is none of theirs. loader_done is set once the loader will touch no counter
// again.
__device__ __forceinline__ void LoadChainX(const ChainProjection* p, ChainCounters* counters,
                                           bf16* x_buffers, int x_stride,
                                           volatile int* x_loaded,
                                           const volatile int* consumers_phase,
                                           const volatile int* work, volatile int* loader_done) {
  // Four lanes a slice, eight slices a poll: every lane polls the slice whose columns it then
  // copies, so its own acquire orders its loads (lanes copying slices other lanes polled would
  // need a fence each, which cost the chain 1-2 µs a layer on the H200: 8B 3.764 -> 3.822 ms
  // a step with fence.acq_rel.gpu, 1B 0.808 -> 0.833; docs/performance.md round 22).
  constexpr int kSliceLoads = kChainSliceCols / 8;  // 16-byte pieces a slice
  constexpr int kLanesPerSlice = 4;
  constexpr int kSlicesPerPoll = kWarpSize / kLanesPerSlice;
  constexpr int kBatch = kSliceLoads / kLanesPerSlice;  // a lane's loads of its slice, in flight
  const int lane = threadIdx.x % kWarpSize;
  bool copied_shadow = false;
  AwaitPriorKernel();  // attn
  for (int phase = 0; phase < kChainPhases; ++phase) {
    const ChainProjection& q = p[phase];
    uint4* dst = reinterpret_cast<uint4*>(x_buffers + (phase % 2) * x_stride);
    const uint4* src = reinterpret_cast<const uint4*>(q.x);
    // The shadow (phase 1's x) is rewritten by the down projections of phase 2, so it is
    // copied only once the producer has taken a gate|up row block (which it knows about a
    // row block before its o work ends; the shadow is whole only at the grid's o end). attn
    // and act are written once a launch and final once counted: their slices are copied as
    // they become ready, unless the producer already knows there is no work (act's answer
    // comes only at the end of the CTA's gate|up; waiting for it, down's first chunk waited
    // for all of act to be copied at once: 8B 3.72 -> 3.87 ms a step). Where the CTA has no
    // gate|up row block, act waits for the answer too: it comes one atomic later then.
    // Lane 0's look serves the warp: lanes reading the word apart, as the producer writes it,
    // could take different ways around the warp's collectives below.
    auto look = [&]() { return __shfl_sync(kFullMask, work[phase], 0); };
    int phase_work = look();
    if (phase == 1 || (phase == 2 && !copied_shadow)) {
      while ((phase_work = look()) == kChainWorkUnknown) __nanosleep(64);
    }
    if (phase_work == kChainWorkNone) continue;  // no consumer of this CTA waits for it
    copied_shadow |= phase == 1;
    if (phase == 2) {
      while (*consumers_phase < 1) {
      }
      __threadfence_block();
    }
    const int slices = ChainSlices(q.K), pieces = q.K / 8;
    for (int next = 0; next < slices;) {
      const int j = next + lane / kLanesPerSlice;
      const bool ready = phase == 0 || j >= slices ||
                         LoadAcquireGpu(&counters->ready[phase - 1][j]) >=
                             ChainSliceRowBlocks(j, q.K);
      // the run of ready slices from `next`, copied and published together
      const uint32_t waiting = __ballot_sync(kFullMask, !ready);
      const int end = min(slices, next + (waiting ? (__ffs(waiting) - 1) / kLanesPerSlice
                                                  : kSlicesPerPoll));
      if (j < end) {
        const int first = j * kSliceLoads + lane % kLanesPerSlice;
        const int last = min((j + 1) * kSliceLoads, pieces);
        uint4 v[kBatch];
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          const int i = first + kLanesPerSlice * b;
          if (i < last) v[b] = __ldcg(src + i);
        }
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          const int i = first + kLanesPerSlice * b;
          if (i < last) dst[i] = v[b];
        }
      }
      if (end > next) {
        __syncwarp();
        if (lane == 0) {
          __threadfence_block();
          *x_loaded = ChainXLoaded(phase, end);
        }
        next = end;
      }
    }
  }
  __syncwarp();
  if (lane == 0) {  // every poll has returned (its value was used above)
    __threadfence_block();
    *loader_done = 1;
  }
}

// The consumer warps' barrier (named barrier 1; the other warps do not take part).
__device__ __forceinline__ void ConsumerSync() {
  asm volatile("bar.sync 1, %0;" ::"n"(kGemvThreads) : "memory");
}

// The consumers' hand-off to the epilogue warps: kChainHandOffs buffers, each a row block's warp
// sums (and, E4M3, its rows' weight scales) and which row block they are (phase kChainPhases:
// no more). Named barriers kChainFullBarrier + b: buffer b is full (the consumer warps arrive,
// its epilogue warp waits); kChainFreeBarrier + b: that warp is done with it (it arrives, the
// consumers wait before they write it again). A barrier orders the shared-memory accesses of
// the threads that take part. Two buffers: the consumers may run a row block ahead
// of the epilogue (three measured the same on the H200, 1B and 8B, bf16 and E4M3, within 3 us
// a step; docs/performance.md round 26).
static constexpr int kChainHandOffs = 2;
template <class W>
struct ChainHandOff {
  union Buffer {
    GemvSums<1, 1, 1, W> one;
    GemvSums<2, 1, 1, W> two;
  } buffer[kChainHandOffs];
  ChainTag job[kChainHandOffs];
};
static constexpr int kChainFullBarrier = 2, kChainFreeBarrier = 2 + kChainHandOffs;
static constexpr int kChainHandOffThreads = kGemvThreads + kWarpSize;
// Epilogue warps: warp e takes the jobs k = e, e + kChainEpilogueWarps, ..., so each buffer has
// one epilogue warp (its barriers count the consumers and that warp), and one warp's stores and
// release of a row block's count overlap the other's. Two against one on the H200 (bench_decode,
// batch 1 at 512 keys, ms a step, alternating in one call, two runs each): 8B 3.708 -> 3.699,
// E4M3 2.406 -> 2.401-2.402; 1B 0.808-0.809 -> 0.795-0.796, E4M3 0.656 -> 0.657. The twelfth
// warp costs no registers: the cap for 11 warps a CTA was already 168 (12 warps' worth).
static constexpr int kChainEpilogueWarps = 2;
static_assert(kChainHandOffs % kChainEpilogueWarps == 0, "a buffer's jobs go to one warp");

__device__ __forceinline__ void ChainHandOffArrive(int barrier) {
  asm volatile("bar.arrive %0, %1;" ::"r"(barrier), "n"(kChainHandOffThreads) : "memory");
}
__device__ __forceinline__ void ChainHandOffWait(int barrier) {
  asm volatile("bar.sync %0, %1;" ::"r"(barrier), "n"(kChainHandOffThreads) : "memory");
}

template <int kRowTiles, class W>
__device__ __forceinline__ auto& ChainSumsOf(typename ChainHandOff<W>::Buffer& buffer) {
  if constexpr (kRowTiles == 2) {
    return buffer.two;
  } else {
    return buffer.one;
  }
}

// The consumers' side of the hand-off: job `jobs` (the CTA's row blocks so far) into buffer
// jobs % kChainHandOffs, once its epilogue warp is done with the job that buffer held.
template <int kRowTiles, bool kNormIn, class W>
__device__ __forceinline__ void ChainHandOffSums(ChainHandOff<W>& hand_off, int& jobs,
                                                 ChainTag job, const float (&acc)[kRowTiles][1][4],
                                                 const float (&sum_sq)[1], float w_scale) {
  const int b = jobs % kChainHandOffs;
  if (jobs >= kChainHandOffs) ChainHandOffWait(kChainFreeBarrier + b);
  if (job.phase < kChainPhases) {
    auto& sums = ChainSumsOf<kRowTiles, W>(hand_off.buffer[b]);
    GemvWarpSums<kNormIn>(acc, sum_sq, sums);
    if constexpr (W::kFp8) {
      if (threadIdx.x < 16 * kRowTiles) sums.w_scale[threadIdx.x] = w_scale;
    }
  }
  if (threadIdx.x == 0) hand_off.job[b] = job;
  ChainHandOffArrive(kChainFullBarrier + b);
  ++jobs;
}

// An epilogue warp (`warp` of kChainEpilogueWarps): the row blocks' sums of its buffer as the
// consumers hand them off, stored (o and down added into the residual stream and its shadow,
// gate|up as SiLU(gate) * up) and counted on the slice of the next projection's x they wrote,
// while the consumers go on with the next row block (each row block's epilogue, a read of the
// residual stream among it, held all eight consumer warps, the CTA's ring filling up behind
// them). Then, its end handed off, the warp's arrival (ProjectionChainCta).
template <class W>
__device__ __forceinline__ void ChainEpilogue(int warp, const ChainProjection* p, float eps,
                                              ChainHandOff<W>& hand_off,
                                              ChainCounters* counters,
                                              const volatile int* loader_done) {
  const int lane = threadIdx.x % kWarpSize;
  bool released = false;
  for (int k = warp;; k += kChainEpilogueWarps) {
    const int b = k % kChainHandOffs;
    ChainHandOffWait(kChainFullBarrier + b);
    const ChainTag job = hand_off.job[b];
    // The next kernel (the next layer's qkv) may take the room beside this CTA and start on
    // its weights during the last projection; it waits for this grid's end before reading x.
    if (job.phase >= 2 && !released) {
      ReleaseNextKernel();
      released = true;
    }
    if (job.phase == kChainPhases) break;
    const ChainProjection& q = p[job.phase];
    if (job.phase == 1) {
      auto& sums = hand_off.buffer[b].two;
      GemvTokenScales<true>(sums, 1, q.K, eps, lane);
      __syncwarp();
      SkinnyStoreSiluMul(sums, job.row_block, 1, q.N, static_cast<bf16*>(q.out), q.N / 2, lane,
                         kWarpSize);
    } else {
      auto& sums = hand_off.buffer[b].one;
      GemvTokenScales<false>(sums, 1, q.K, eps, lane);
      __syncwarp();
      SkinnyStore(sums, job.row_block, 1, q.N, q.out, q.N, kGemvF32Add, q.shadow, nullptr, lane,
                  kWarpSize);
    }
    __syncwarp();  // every lane's stores before lane 0's count (a release)
    if (job.phase + 1 < kChainPhases && lane == 0)  // its columns of the next one's x
      RedAddReleaseGpu(&counters->ready[job.phase][job.row_block * 16 / kChainSliceCols], 1u);
    ChainHandOffArrive(kChainFreeBarrier + b);
  }
  // Every CTA's producer took its last row block before tagging the end, which its consumers
  // saw before they handed the ends off, and its loader says when it is done with the counters:
  // the last epilogue warp out (kChainEpilogueWarps a CTA) is the last user of every counter.
  // Fence, count, and the last one fences again before its stores (LastCtaToArrive's pattern),
  // so the zeroing follows every other warp's last use.
  if (lane == 0) {
    while (*loader_done == 0) {
    }
    __threadfence();
    if (atomicAdd(&counters->arrivals, 1u) == kChainEpilogueWarps * gridDim.x - 1) {
      __threadfence();
      *counters = ChainCounters{};
    }
  }
}

// One phase: the row blocks of projection q that the producer tagged with `phase`, each
// accumulated from the ring and handed to the epilogue warps (ChainHandOffSums; `jobs` counts the
// CTA's hand-offs). W: the weights' kind, as the skinny kernels take it (E4M3 codes: the same
// MMAs as SkinnyAccumulate's on them, x times the RMSNorm's weight with kNormIn, the rows'
// scales in the epilogue).
template <class W, int kRowTiles, bool kNormIn>
__device__ __forceinline__ void ChainPhaseCta(int phase, const ChainProjection& q,
                                              ChainRing& ring, bf16* x,
                                              const volatile int* x_loaded,
                                              ChainHandOff<W>& hand_off, int& jobs) {
  constexpr int kPerChunk = ChainChunkSteps(kRowTiles);
  constexpr int kWarpSteps = kPerChunk / kGemvWarps;  // a warp's steps of a full chunk
  static_assert(kPerChunk % kGemvWarps == 0, "a chunk's steps round-robin over the warps");
  constexpr int kStepK = W::kStepK, kPieceK = kStepK / 4;  // k a step, k a lane's row piece
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int g = lane / 4, t = lane % 4;
  const int steps = q.K / kStepK, chunks = ChainChunks<W>(q, phase);
  // lane (g, t)'s 16 bytes of a step: rows g and g + 8, k kPieceK t .. + kPieceK - 1 (gemv.cuh's
  // tiled layout: 64 g + 16 t bytes either way)
  const int lane_bytes = g * (kChainStepBytes / 16) + 16 * t;
  int x_needed = 0;  // slices of x this CTA has waited for
  // E4M3: x's f16 form (GemvStepInputFp8) is the same for every row block of the phase, and a
  // warp reads only its own steps' columns of x (w, w + 8, ... of every row block). So a warp's
  // first row block of the phase converts them in place, in shared memory, and sums the squares
  // of x (kNormIn), and its later ones read the f16 words and keep those sums: the skinny
  // kernels' values, computed once a CTA a phase, not once a row block.
  bool x_converted = false;
  float sum_sq[1] = {0.f};
  for (ChainTag tag = ring.peek(); tag.phase == phase; tag = ring.peek()) {
    const int rb = tag.row_block;
    // E4M3: the row block's weight scales, loaded as it starts, for its epilogue (loaded in
    // it, each row block's wait on DRAM stalled the CTA's ring: 8B batch 1 on the H200 2.828
    // -> 2.742 ms a step)
    float w_scale = 0.f;
    if constexpr (W::kFp8) {
      if (threadIdx.x < 16 * kRowTiles)
        w_scale = q.w_scale[min(rb * 16 * kRowTiles + static_cast<int>(threadIdx.x), q.N - 1)];
    }
    float acc[kRowTiles][1][4] = {};
    if constexpr (!W::kFp8) sum_sq[0] = 0.f;
    for (int c = 0; c < chunks; ++c) {
      const char* slot = ring.acquire();
      const int first = c * kPerChunk, here = min(kPerChunk, steps - first);
      const int slices = ChainSlices((first + here) * kStepK);
      if (slices > x_needed) {  // the loader warp's copies of them
        while (*x_loaded < ChainXLoaded(phase, slices)) {
        }
        __threadfence_block();
        x_needed = slices;
      }
      using XFrag = typename W::XFrag;
      uint4 wv[kWarpSteps][kRowTiles][2];
      // E4M3: x as stored (bf16), or converted (f16 words); nw: kNormIn's RMSNorm weight
      XFrag xv[kWarpSteps][1], nw[kWarpSteps];
#pragma unroll
      for (int u = 0; u < kWarpSteps; ++u) {
        const int step = warp + u * kGemvWarps;
        if (step >= here) continue;
#pragma unroll
        for (int a = 0; a < kRowTiles; ++a)
#pragma unroll
          for (int h = 0; h < 2; ++h)
            wv[u][a][h] = *reinterpret_cast<const uint4*>(
                slot + (a * kPerChunk + step) * kChainStepBytes + lane_bytes + h * 512);
        const int k = (first + step) * kStepK + kPieceK * t;
        if constexpr (W::kFp8) {
#pragma unroll
          for (int p = 0; p < 2; ++p) {
            xv[u][0][p] = *reinterpret_cast<const uint4*>(x + k + 8 * p);
            if (kNormIn && !x_converted)
              nw[u][p] = __ldg(reinterpret_cast<const uint4*>(q.norm_w + k + 8 * p));
          }
        } else {
          xv[u][0] = *reinterpret_cast<const uint4*>(x + k);
        }
      }
      // E4M3, first row block: the eight lanes of each t loaded the same words of x, which one
      // of them rewrites below; every lane's load is done first
      if (W::kFp8 && !x_converted) __syncwarp();
#pragma unroll
      for (int u = 0; u < kWarpSteps; ++u) {
        if (warp + u * kGemvWarps >= here) continue;
        if constexpr (W::kFp8) {
          uint32_t xb[1][8];
          uint4* xs = reinterpret_cast<uint4*>(x + (first + warp + u * kGemvWarps) * kStepK +
                                               kPieceK * t);
          if (x_converted) {
            xb[0][0] = xv[u][0][0].x, xb[0][1] = xv[u][0][0].y, xb[0][2] = xv[u][0][0].z;
            xb[0][3] = xv[u][0][0].w, xb[0][4] = xv[u][0][1].x, xb[0][5] = xv[u][0][1].y;
            xb[0][6] = xv[u][0][1].z, xb[0][7] = xv[u][0][1].w;
          } else {
            GemvStepInputFp8<1, kNormIn>(xb, sum_sq, xv[u], nw[u]);
            if (g == 0) {
              xs[0] = make_uint4(xb[0][0], xb[0][1], xb[0][2], xb[0][3]);
              xs[1] = make_uint4(xb[0][4], xb[0][5], xb[0][6], xb[0][7]);
            }
          }
          GemvStepMmasFp8(acc, wv[u], xb);
        } else {
          GemvStepMma<kRowTiles, 1, kNormIn>(acc, sum_sq, wv[u], xv[u]);
        }
      }
      ring.release();
    }
    x_converted = true;
    ChainHandOffSums<kRowTiles, kNormIn>(hand_off, jobs, tag, acc, sum_sq, w_scale);
  }
}

// The whole chain; blockDim.x = kChainThreads (the consumer warps, the producer warp, the
// loader warp, the epilogue warps), kChainRingBytes + 2 x_stride bf16 of dynamic shared memory,
// x_stride the layer's largest K; any grid size (one CTA an SM, by default). p: o, gate|up,
// down. W: Bf16Weights, or Fp8Weights (every projection's E4M3 codes, with w_scale, and norm_w
// for gate|up).
static constexpr int kChainThreads = kGemvThreads + (2 + kChainEpilogueWarps) * kWarpSize;
template <class W>
__device__ __forceinline__ void ProjectionChainCta(const ChainProjection* p, float eps,
                                                   int x_stride, ChainCounters* counters) {
  extern __shared__ __align__(128) char chain_slots[];
  __shared__ __align__(8) uint64_t full[kChainSlots], empty[kChainSlots];
  __shared__ ChainTag tag[kChainSlots];
  __shared__ int x_loaded, consumers_phase, loader_done, work[kChainPhases];
  __shared__ ChainHandOff<W> hand_off;
  ChainRing ring{chain_slots, full, empty, tag};
  bf16* x = reinterpret_cast<bf16*>(chain_slots + kChainRingBytes);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kChainSlots; ++s) {
      MbarrierInit(&full[s]);
      MbarrierInit<kGemvWarps>(&empty[s]);
    }
    x_loaded = 0;
    consumers_phase = 0;
    loader_done = 0;
    for (int phase = 0; phase < kChainPhases; ++phase) work[phase] = kChainWorkUnknown;
  }
  __syncthreads();
  if (threadIdx.x >= kGemvThreads + 2 * kWarpSize) {
    ChainEpilogue((threadIdx.x - kGemvThreads) / kWarpSize - 2, p, eps, hand_off, counters,
                  &loader_done);
    return;
  }
  if (threadIdx.x >= kGemvThreads + kWarpSize) {
    LoadChainX(p, counters, x, x_stride, &x_loaded, &consumers_phase, work, &loader_done);
    return;
  }
  if (threadIdx.x >= kGemvThreads) {  // the producer warp: weights, which nothing before
    if (threadIdx.x == kGemvThreads) ring.produce<W>(p, counters, work);  // this kernel writes
    return;
  }
  AwaitPriorKernel();  // the residual stream
  int jobs = 0;  // row blocks handed to the epilogue warps
  ChainPhaseCta<W, 1, false>(0, p[0], ring, x, &x_loaded, hand_off, jobs);
  ConsumerSync();  // every consumer warp is past phase 0's x
  if (threadIdx.x == 0) {  // the loader may refill phase 0's buffer
    __threadfence_block();
    *static_cast<volatile int*>(&consumers_phase) = 1;
  }
  ChainPhaseCta<W, 2, true>(1, p[1], ring, x + x_stride, &x_loaded, hand_off, jobs);
  ReleaseNextKernel();  // (the epilogue warps call it too, at their first job past gate|up)
  ChainPhaseCta<W, 1, false>(2, p[2], ring, x, &x_loaded, hand_off, jobs);
  // The end of the hand-off, one a warp; handing them off waited for the buffers' releases of
  // the last real row blocks, so every barrier arrival has its wait (the loop below has work
  // only where there are more buffers than epilogue warps).
  const float no_acc[1][1][4] = {}, no_sum_sq[1] = {};
  for (int e = 0; e < kChainEpilogueWarps; ++e)  // one end a warp
    ChainHandOffSums<1, false>(hand_off, jobs, ChainTag{kChainPhases, 0}, no_acc, no_sum_sq,
                               0.f);
  for (int j = max(jobs - kChainHandOffs, 0); j < jobs - kChainEpilogueWarps; ++j)
    ChainHandOffWait(kChainFreeBarrier + j % kChainHandOffs);
}

}  // namespace blink
