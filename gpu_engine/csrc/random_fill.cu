// Random bf16 weights generated on the GPU, for benchmarks on real model shapes (no hub here):
// uniform in [-scale, scale) from a counter-based hash, so any size fills in milliseconds.
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include "counter_rng.cuh"

// scale == 0 with offset: a constant (RMSNorm weights of 1.0).
extern "C" __global__ void fill_uniform_bf16(__nv_bfloat16* out, uint64_t n, uint64_t seed,
                                             float scale, float offset) {
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    const float u = (blink::splitmix64(seed ^ (i * 0xD1B54A32D192ED03ull)) >> 40) * (1.0f / 16777216.0f);
    out[i] = __float2bfloat16(offset + scale * (2.0f * u - 1.0f));
  }
}

// The same uniform values as E4M3 codes (an FP8 KV cache's contents for benchmarks: random bytes
// would hold NaN codes).
extern "C" __global__ void fill_uniform_e4m3(__nv_fp8_storage_t* out, uint64_t n, uint64_t seed,
                                             float scale) {
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    const float u = (blink::splitmix64(seed ^ (i * 0xD1B54A32D192ED03ull)) >> 40) * (1.0f / 16777216.0f);
    out[i] = __nv_cvt_float_to_fp8(scale * (2.0f * u - 1.0f), __NV_SATFINITE, __NV_E4M3);
  }
}
