// The paged KV cache's element: bf16, or (--kv-cache-dtype fp8) E4M3 codes with one float32
// scale per (layer, KV head). The forward module is built for one of them (-DBLINK_KV_FP8=1
// for FP8: gpu_engine/cuda_forward.py ForwardKernels), so every kernel of a forward pass agrees
// on what a cache row holds, and the bf16 build's kernels are the ones they were before FP8.
//
// Scales: each layer's are [2][num_kv_heads] floats, keys' then values' (kv_scales below), fixed
// at start-up (the checkpoint's k_scale / v_scale, or a calibration pass: gpu_engine/fp8.py).
// A value v is stored as e4m3(v * (1 / scale)), the inverse rounded to float32 first (fp8.py
// fp8_rounded_kv reproduces it). Attention folds the key scale into the softmax's and applies
// the value scale to each output.
#pragma once
#include "fp8.cuh"

namespace blink {

struct KvBf16 {
  using Element = bf16;
  static constexpr bool kFp8 = false;
};

struct KvFp8 {
  using Element = fp8;
  static constexpr bool kFp8 = true;
};

#if defined(BLINK_KV_FP8) && BLINK_KV_FP8
using KvCache = KvFp8;
#else
using KvCache = KvBf16;
#endif

// A KV head's key (kind 0) or value (kind 1) scale in a layer's scales [2][num_kv_heads].
__device__ __forceinline__ float KvScale(const float* kv_scales, int num_kv_heads, int kind,
                                         int kv_head) {
  return kv_scales[kind * num_kv_heads + kv_head];
}

// One value into a cache row: bf16 as it is, E4M3 times its head's inverse scale.
__device__ __forceinline__ void StoreKv(bf16* dst, float v, float) { *dst = __float2bfloat16(v); }

__device__ __forceinline__ void StoreKv(fp8* dst, float v, float inverse) {
  *dst = static_cast<fp8>(F32x2ToE4m3x2(v * inverse, 0.f) & 0xff);
}

// The inverse a head's values are stored with (1 for bf16, where StoreKv ignores it).
template <class Kv>
__device__ __forceinline__ float KvInverseScale(const float* kv_scales, int num_kv_heads,
                                                int kind, int kv_head) {
  if constexpr (Kv::kFp8) return 1.f / KvScale(kv_scales, num_kv_heads, kind, kv_head);
  return 1.f;
}

// Calibration (kv_amax not null): the largest |value| a thread wrote to a head, folded into
// that head's word of kv_amax ([2][num_kv_heads] floats, as kv_scales; non-negative floats
// order as their bit patterns do).
__device__ __forceinline__ void NoteKvAmax(float* kv_amax, int num_kv_heads, int kind,
                                           int kv_head, float amax) {
  if (kv_amax != nullptr)
    atomicMax(reinterpret_cast<unsigned int*>(kv_amax + kind * num_kv_heads + kv_head),
              __float_as_uint(amax));
}

}  // namespace blink
