// Token embedding lookup into the fp32 residual stream.
#pragma once
#include "batch.cuh"
#include "fp8.cuh"
#include "utils.cuh"

namespace blink {

// One CTA per token row t < num_tokens: x[t] = embed[token_ids[t]] (ids clamped into the vocab),
// and the same row into x_shadow when not null (the residual stream's bf16 copy, gemv.cuh), and
// into x_f16 when not null: its f16 form times norm_w (the first layer's input RMSNorm weight),
// as the qkv projection's FP8 skinny kernel takes it (gemv.cuh kXF16), and, where x_sumsq is not
// null, the row's sums of squares in parts of 16 features (gemv.cuh GemvSquareParts; hidden %
// 16 == 0).
// embed: [vocab, hidden] bf16; x: [bucket, hidden] f32; x_shadow: [bucket, hidden] bf16; x_f16:
// [bucket, hidden] f16; hidden % 8 == 0.
__device__ __forceinline__ void EmbeddingCta(const BatchDesc* desc, const int32_t* token_ids,
                                             const bf16* embed, float* x, bf16* x_shadow,
                                             int hidden, int vocab, __half* x_f16 = nullptr,
                                             const bf16* norm_w = nullptr,
                                             float* x_sumsq = nullptr) {
  const int t = blockIdx.x;
  if (t >= desc->num_tokens) return;
  const int id = min(max(token_ids[t], 0), vocab - 1);
  const bf16* src = embed + static_cast<size_t>(id) * hidden;
  float* dst = x + static_cast<size_t>(t) * hidden;
  for (int i = threadIdx.x * 8; i < hidden; i += blockDim.x * 8) {
    float v[8];
    LoadBf16x8(src + i, v);
    StoreF32x8(dst + i, v);
    const size_t row = static_cast<size_t>(t) * hidden + i;
    if (x_shadow != nullptr)
      *reinterpret_cast<uint4*>(x_shadow + row) = *reinterpret_cast<const uint4*>(src + i);
    if (x_f16 != nullptr) {
      float w[8];
      LoadBf16x8(norm_w + i, w);
      __align__(16) __half h[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) h[e] = Fp8MmaInput(v[e], w[e]);
      *reinterpret_cast<uint4*>(x_f16 + row) = *reinterpret_cast<const uint4*>(h);
      if (x_sumsq != nullptr) {  // features 16 p .. + 15: this lane's 8 and its pair's
        float part = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) part = fmaf(v[e], v[e], part);
        part += __shfl_xor_sync(3u << (threadIdx.x % kWarpSize & ~1u), part, 1);
        if (threadIdx.x % 2 == 0) x_sumsq[static_cast<size_t>(t) * (hidden / 16) + i / 16] = part;
      }
    }
  }
}

}  // namespace blink
