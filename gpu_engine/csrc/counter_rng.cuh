// The counter-based random numbers of the engine, bit-identical to gpu_engine/sampling.py:
// a request's n-th draw depends only on (seed, n), never on the batch it shares.
#pragma once
#include <stdint.h>

#ifndef BLINK_HD
#if defined(__CUDACC__)
#define BLINK_HD __host__ __device__
#else
#define BLINK_HD
#endif
#endif

namespace blink {

BLINK_HD inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// A double in [0, 1) from the top 53 bits; `step` is the index of the token being generated.
// Exact on both sides: a 53-bit integer converts exactly and 2^-53 is a power of two.
BLINK_HD inline double uniform(uint64_t seed, uint64_t step) {
  return static_cast<double>(splitmix64(splitmix64(seed) ^ step) >> 11) *
         (1.0 / 9007199254740992.0);
}

}  // namespace blink
