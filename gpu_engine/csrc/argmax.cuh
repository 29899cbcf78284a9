// Greedy argmax as one 64-bit word, for a reduction spread over many CTAs: the LM head's CTAs
// each fold their logits of a row into it with one atomicMax (gemv.cuh SkinnyStore), and the
// sampling kernel reads the row's greedy token from it instead of scanning the vocabulary
// (sampling.cuh SampleCta), then zeroes it for the next step.
#pragma once
#include <stdint.h>

#include "utils.cuh"

namespace blink {

// Order-preserving map of a float onto uint32: a < b  <=>  OrderedKey(a) < OrderedKey(b).
__device__ __forceinline__ uint32_t OrderedKey(float v) {
  const uint32_t u = __float_as_uint(v);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Logit v of token `index` as a word whose maximum over a row is its argmax with the lowest id
// on ties (the key above the index, the index inverted); NaN below every value, as the scan's
// strict `v > max` never takes it.
__device__ __forceinline__ unsigned long long PackArgMax(float v, int index) {
  const uint32_t key = isnan(v) ? 0u : OrderedKey(v);
  const uint32_t inverted = 0xffffffffu - static_cast<uint32_t>(index);
  return (static_cast<unsigned long long>(key) << 32) | inverted;
}

// The token of a row's packed maximum: 0 where no logit of the row was above -inf (every one
// -inf or NaN), as SampleCta's scan gives.
__device__ __forceinline__ int UnpackArgMax(unsigned long long packed) {
  if (static_cast<uint32_t>(packed >> 32) <= OrderedKey(-INFINITY)) return 0;
  return static_cast<int>(0xffffffffu - static_cast<uint32_t>(packed));
}

}  // namespace blink
