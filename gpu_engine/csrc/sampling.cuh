// Token sampling per logit row: greedy, or temperature + top-k + top-p with a counter-based RNG.
//
// The random number of a row is uniform(seed, step), bit-identical to gpu_engine/sampling.py
// (splitmix64 mixing, top 53 bits). Probabilities are exp((logit - max) / temperature) quantized to
// fixed point (kMassOne = 2^32 for the top token) so that every sum is an exact integer and the
// result never depends on the order threads add in: the same (logits, seed, step) always gives the
// same token. Tokens whose probability is below 2^-32 of the top token's have mass 0 and are never
// drawn. Top-k and top-p are thresholds on the order-preserving integer key of the logit, found by
// radix select over the keys of the candidates (4 passes of 8 bits at most); ties at a threshold
// are all kept. The token is then drawn by inverse CDF over the kept set in vocabulary order, which
// has the same distribution as the CPU sampler's walk in sorted order.
#pragma once
#include "argmax.cuh"
#include "batch.cuh"
#include "counter_rng.cuh"
#include "utils.cuh"

namespace blink {

static constexpr int kSampleThreads = 1024;
static constexpr int kSampleWarps = kSampleThreads / kWarpSize;
static constexpr float kMassOne = 4294967296.0f;  // 2^32: the top token's fixed-point mass

// Calls f(i, x[i]) for every i < n, the block's threads sharing the work: 16-byte loads, several
// in flight per thread, when x is 16-byte aligned and n % 4 == 0 (a thread's indices still rise).
template <typename F>
__device__ __forceinline__ void ForEachLogit(const float* x, int n, F&& f) {
  if ((n & 3) == 0 && (reinterpret_cast<uintptr_t>(x) & 15) == 0) {
    const float4* x4 = reinterpret_cast<const float4*>(x);
#pragma unroll 4
    for (int i = threadIdx.x; i < n / 4; i += blockDim.x) {
      const float4 v = x4[i];
      f(4 * i, v.x);
      f(4 * i + 1, v.y);
      f(4 * i + 2, v.z);
      f(4 * i + 3, v.w);
    }
  } else {
#pragma unroll 4
    for (int i = threadIdx.x; i < n; i += blockDim.x) f(i, x[i]);
  }
}

// Radix histograms are kept in kHistCopies copies (warp w adds into copy w % kHistCopies) so that
// warps rarely contend on one shared-memory address, then summed per digit.
static constexpr int kHistCopies = 8;

struct SampleShared {
  uint32_t count[kHistCopies][256];
  unsigned long long mass[kHistCopies][256];
  uint32_t count_total[256];
  unsigned long long mass_total[256];
  unsigned long long scratch_u64[kWarpSize];
  uint32_t scratch_u32[kWarpSize];
  float scratch_f32[kWarpSize];
  int scratch_i32[kWarpSize];
  unsigned long long remaining;
  uint32_t digit;
  int found;
  int result;
};

__device__ __forceinline__ uint32_t BlockMinU32(uint32_t v, uint32_t* scratch) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(kFullMask, v, o));
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < kSampleWarps ? scratch[lane] : 0xffffffffu;
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}

// The block's largest value and, among equal values, its lowest index (NaN never wins).
__device__ __forceinline__ void BlockArgMax(float& value, int& index, SampleShared& sh) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  auto better = [](float v, int i, float w, int j) { return v > w || (v == w && i < j); };
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o >>= 1) {
    const float w = __shfl_xor_sync(kFullMask, value, o);
    const int j = __shfl_xor_sync(kFullMask, index, o);
    if (better(w, j, value, index)) value = w, index = j;
  }
  __syncthreads();
  if (lane == 0) sh.scratch_f32[warp] = value, sh.scratch_i32[warp] = index;
  __syncthreads();
  value = lane < kSampleWarps ? sh.scratch_f32[lane] : -INFINITY;
  index = lane < kSampleWarps ? sh.scratch_i32[lane] : 0x7fffffff;
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o >>= 1) {
    const float w = __shfl_xor_sync(kFullMask, value, o);
    const int j = __shfl_xor_sync(kFullMask, index, o);
    if (better(w, j, value, index)) value = w, index = j;
  }
}

// Fixed-point probability mass of a logit; 0 for NaN and for anything under 2^-32 of the top.
__device__ __forceinline__ uint64_t LogitMass(float v, float max_logit, float inv_temperature) {
  const float p = expf((v - max_logit) * inv_temperature);
  return p > 0.f ? static_cast<uint64_t>(p * kMassOne) : 0ull;
}

// Radix select over the candidates' keys (mass > 0, key >= lower): the largest key K such that the
// candidates with key >= K reach `target` (by count, or by mass when by_mass). Keys are taken
// relative to min_key, the smallest candidate key, so the first digit spreads over the candidates'
// actual range rather than the float exponent. Returns `lower` when all candidates together fall
// short of the target (keep them all).
__device__ __forceinline__ uint32_t RadixSelect(const float* logits, int vocab, float max_logit,
                                                float inv_temperature, uint32_t lower,
                                                uint32_t min_key, uint32_t key_range,
                                                bool by_mass, uint64_t target, SampleShared& sh) {
  const int bits = key_range == 0 ? 0 : 32 - __clz(key_range);
  uint32_t prefix = 0;  // selected bits of (key - min_key) above the current digit
  for (int high = bits; high > 0; high -= 8) {
    const int shift = max(high - 8, 0), width = high - shift;
    for (int i = threadIdx.x; i < kHistCopies * 256; i += blockDim.x) {
      sh.count[i / 256][i % 256] = 0;
      sh.mass[i / 256][i % 256] = 0;
    }
    __syncthreads();
    const int copy = threadIdx.x / kWarpSize % kHistCopies;
    ForEachLogit(logits, vocab, [&](int, float v) {
      const uint64_t q = LogitMass(v, max_logit, inv_temperature);
      const uint32_t key = OrderedKey(v);
      if (q == 0 || key < lower) return;
      const uint32_t rel = key - min_key;
      if ((static_cast<uint64_t>(rel) >> high) != (static_cast<uint64_t>(prefix) >> high)) return;
      const uint32_t d = (rel >> shift) & ((1u << width) - 1);
      atomicAdd(&sh.count[copy][d], 1u);
      if (by_mass) atomicAdd(&sh.mass[copy][d], static_cast<unsigned long long>(q));
    });
    __syncthreads();
    for (int d = threadIdx.x; d < 256; d += blockDim.x) {
      uint32_t c = 0;
      unsigned long long q = 0;
#pragma unroll
      for (int k = 0; k < kHistCopies; ++k) c += sh.count[k][d], q += sh.mass[k][d];
      sh.count_total[d] = c;
      sh.mass_total[d] = q;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      uint64_t remaining = high == bits ? target : sh.remaining;
      sh.found = 0;
      for (int d = (1 << width) - 1; d >= 0; --d) {
        const uint64_t measure = by_mass ? sh.mass_total[d] : sh.count_total[d];
        if (measure >= remaining) {
          sh.found = 1;
          sh.digit = d;
          break;
        }
        remaining -= measure;
      }
      sh.remaining = remaining;
    }
    __syncthreads();
    if (!sh.found) return lower;  // only in the first pass: the target exceeds the total
    prefix |= sh.digit << shift;
  }
  return max(lower, min_key + prefix);
}

// Sum of the masses of the candidates with key >= lower.
__device__ __forceinline__ uint64_t KeptMass(const float* logits, int vocab, float max_logit,
                                             float inv_temperature, uint32_t lower,
                                             SampleShared& sh) {
  uint64_t total = 0;
  ForEachLogit(logits, vocab, [&](int, float v) {
    if (OrderedKey(v) >= lower) total += LogitMass(v, max_logit, inv_temperature);
  });
  return BlockSum<unsigned long long>(total, sh.scratch_u64);
}

// One CTA (kSampleThreads) per logit row l < num_logits. logits: [rows, vocab] f32.
// Greedy (argmax, lowest id on ties) when temperature <= 0 or top_k == 1; else temperature,
// top_k (0: off), top_p (>= 1: off), then one draw of uniform(seed[l], step[l]).
// lm_argmax (null: none): each row's argmax packed (argmax.cuh) by the LM head that wrote
// logits, which a greedy row takes instead of scanning its logits; every row of the grid zeroes
// its word for the next step's LM head. One CTA's scan of 128,256 logits is a chain of L2 round
// trips after the LM head: measured on the H200 (bench_decode, one call, ms a step, scan ->
// the LM head's argmax), Llama-3.2-1B 1 x 512 0.772 -> 0.763, Llama-3.1-8B 3.866 -> 3.849; at
// 8 rows (eight CTAs scanning side by side) 0.843 -> 0.848, within the run-to-run spread.
__device__ __forceinline__ void SampleCta(const BatchDesc* desc, const float* logits, int vocab,
                                          const float* temperature, const float* top_p,
                                          const int32_t* top_k, const uint64_t* seed,
                                          const uint32_t* step, int32_t* sampled,
                                          unsigned long long* lm_argmax) {
  __shared__ SampleShared sh;
  const int row = blockIdx.x;
  unsigned long long lm_best = 0;
  if (lm_argmax != nullptr) {
    lm_best = lm_argmax[row];
    __syncthreads();  // every thread has read it
    if (threadIdx.x == 0) lm_argmax[row] = 0;
  }
  if (row >= desc->num_logits) return;
  if (lm_argmax != nullptr && (!(temperature[row] > 0.f) || top_k[row] == 1)) {
    if (threadIdx.x == 0) sampled[row] = UnpackArgMax(lm_best);
    return;
  }
  const float* x = logits + static_cast<size_t>(row) * vocab;

  float max_logit = -INFINITY;
  int argmax = 0x7fffffff;
  ForEachLogit(x, vocab, [&](int i, float v) {
    if (v > max_logit) max_logit = v, argmax = i;  // strict: the first of equal values stays
  });
  BlockArgMax(max_logit, argmax, sh);
  if (argmax == 0x7fffffff) argmax = 0;  // every logit NaN

  const float temp = temperature[row];
  const int k = top_k[row];
  if (!(temp > 0.f) || k == 1 || !(max_logit > -INFINITY)) {
    if (threadIdx.x == 0) sampled[row] = argmax;
    return;
  }
  const float inv_temp = 1.f / temp;

  // Candidates: mass > 0. Their smallest key anchors the radix digits.
  uint32_t min_key = 0xffffffffu;
  ForEachLogit(x, vocab, [&](int, float v) {
    if (LogitMass(v, max_logit, inv_temp) > 0) min_key = min(min_key, OrderedKey(v));
  });
  min_key = BlockMinU32(min_key, sh.scratch_u32);
  const uint32_t key_range = OrderedKey(max_logit) - min_key;

  uint32_t lower = min_key;  // keep candidates with key >= lower
  if (k > 0) {
    lower = RadixSelect(x, vocab, max_logit, inv_temp, lower, min_key, key_range, false,
                        static_cast<uint64_t>(k), sh);
  }
  const float p = top_p[row];
  if (p < 1.f) {
    const uint64_t kept = KeptMass(x, vocab, max_logit, inv_temp, lower, sh);
    // The smallest prefix (descending) whose mass reaches p of the kept mass, the crossing token
    // included: first key where the cumulative mass >= ceil(p * kept).
    uint64_t target = static_cast<uint64_t>(ceil(static_cast<double>(fmaxf(p, 0.f)) *
                                                 static_cast<double>(kept)));
    if (target < 1) target = 1;
    if (target > kept) target = kept;
    lower = RadixSelect(x, vocab, max_logit, inv_temp, lower, min_key, key_range, true, target, sh);
  }
  const uint64_t total = KeptMass(x, vocab, max_logit, inv_temp, lower, sh);
  if (total == 0) {  // no finite mass (a +inf logit): fall back to greedy
    if (threadIdx.x == 0) sampled[row] = argmax;
    return;
  }

  // Inverse CDF in vocabulary order: the first token whose inclusive cumulative mass > u * total.
  const double u = uniform(seed[row], step[row]);
  uint64_t target = static_cast<uint64_t>(u * static_cast<double>(total));
  if (target >= total) target = total - 1;  // u < 1; guards the double rounding up
  constexpr int kItems = 4;
  const bool vectorized = (vocab & 3) == 0 && (reinterpret_cast<uintptr_t>(x) & 15) == 0;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  if (threadIdx.x == 0) sh.result = -1;
  uint64_t before = 0;  // mass of all earlier chunks
  for (int base = 0; base < vocab; base += kSampleThreads * kItems) {
    const int first = base + threadIdx.x * kItems;
    float v[kItems];
    if (vectorized && first < vocab) {
      const float4 v4 = reinterpret_cast<const float4*>(x)[first / kItems];
      v[0] = v4.x, v[1] = v4.y, v[2] = v4.z, v[3] = v4.w;
    } else {
#pragma unroll
      for (int j = 0; j < kItems; ++j) v[j] = first + j < vocab ? x[first + j] : -INFINITY;
    }
    uint64_t q[kItems], mine = 0;
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      q[j] = OrderedKey(v[j]) >= lower ? LogitMass(v[j], max_logit, inv_temp) : 0;
      mine += q[j];
    }
    // Inclusive block scan of `mine`.
    uint64_t incl = mine;
#pragma unroll
    for (int o = 1; o < kWarpSize; o <<= 1) {
      const uint64_t y = __shfl_up_sync(kFullMask, incl, o);
      if (lane >= o) incl += y;
    }
    __syncthreads();  // scratch and sh.result from the previous chunk are read
    if (lane == kWarpSize - 1) sh.scratch_u64[warp] = incl;
    __syncthreads();
    uint64_t warp_before = 0, chunk_total = 0;
    for (int w = 0; w < kSampleWarps; ++w) {
      const uint64_t s = sh.scratch_u64[w];
      if (w < warp) warp_before += s;
      chunk_total += s;
    }
    const uint64_t start = before + warp_before + incl - mine;
    if (mine > 0 && start <= target && target < start + mine) {
      uint64_t c = start;
#pragma unroll
      for (int j = 0; j < kItems; ++j) {
        if (q[j] > 0 && target < c + q[j]) {
          sh.result = first + j;
          break;
        }
        c += q[j];
      }
    }
    before += chunk_total;
    __syncthreads();
    if (sh.result >= 0) break;
  }
  if (threadIdx.x == 0) sampled[row] = sh.result >= 0 ? sh.result : argmax;
}

// Test hook: out[i] = uniform(seed[i], step[i]) for i < n.
__device__ __forceinline__ void SamplingUniformThread(const uint64_t* seed, const uint32_t* step,
                                                      double* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = uniform(seed[i], step[i]);
}

}  // namespace blink
