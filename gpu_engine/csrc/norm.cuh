// RMSNorm over rows of the fp32 residual stream (optionally adding a bias into it first, and
// optionally gathering rows), and the per-head RMSNorm of Qwen3's q and k.
#pragma once
#include "batch.cuh"
#include "quantize.cuh"
#include "utils.cuh"

namespace blink {

// 1 / sqrt(mean(x^2) + eps) of the fp32 row xr[0 .. hidden), bias (nullable, [hidden]) first
// added into it in place. Every thread of the CTA calls it (BlockSum); thread t handles the
// groups of 8 at 8 t, 8 (t + blockDim.x), .., the same ones NormedRow8 reads back.
__device__ __forceinline__ float AddBiasInverseRms(float* xr, const bf16* bias, int hidden,
                                                   float eps, float* scratch) {
  float sum_sq = 0.f;
  for (int i = threadIdx.x * 8; i < hidden; i += blockDim.x * 8) {
    float v[8];
    LoadF32x8(xr + i, v);
    if (bias != nullptr) {
      float b[8];
      LoadBf16x8(bias + i, b);
#pragma unroll
      for (int k = 0; k < 8; ++k) v[k] += b[k];
      StoreF32x8(xr + i, v);  // re-read below by this same thread only
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) sum_sq += v[k] * v[k];
  }
  return rsqrtf(BlockSum(sum_sq, scratch) / hidden + eps);
}

// Values i .. i + 8 of the normalized row: weight * xr * inv_rms, in fp32.
__device__ __forceinline__ void NormedRow8(const float* xr, const bf16* weight, int i,
                                           float inv_rms, float (&v)[8]) {
  float w[8];
  LoadF32x8(xr + i, v);
  LoadBf16x8(weight + i, w);
#pragma unroll
  for (int k = 0; k < 8; ++k) v[k] = w[k] * (v[k] * inv_rms);
}

// One CTA per output row r. Without `gather`: rows r < num_tokens, source row r. With `gather`
// (the logit_token array): rows r < num_logits, source row gather[r] (clamped to [0, max_rows)).
// bias (nullable, [hidden]) is first added into x[src] in place (o_proj's bias, folded here).
// out[r] = weight * x[src] / sqrt(mean(x[src]^2) + eps), in fp32, stored as bf16.
// x: [max_rows, hidden] f32; weight: [hidden] bf16; out: [rows, hidden] bf16; hidden % 8 == 0.
// x_f16 (not null): out's f16 form too, [rows, hidden], as the FP8 LM head takes it (gemv.cuh
// kXF16).
__device__ __forceinline__ void RmsNormCta(const BatchDesc* desc, const int32_t* gather,
                                           int max_rows, float* x, const bf16* bias,
                                           const bf16* weight, bf16* out, int hidden, float eps,
                                           __half* x_f16 = nullptr) {
  __shared__ float scratch[kWarpSize];
  const int r = blockIdx.x;
  const int count = gather != nullptr ? desc->num_logits : desc->num_tokens;
  if (r >= count) return;  // uniform over the CTA: no barrier is skipped by only some threads
  const int src = gather != nullptr ? min(max(gather[r], 0), max_rows - 1) : r;
  float* xr = x + static_cast<size_t>(src) * hidden;

  const float inv_rms = AddBiasInverseRms(xr, bias, hidden, eps, scratch);

  bf16* yr = out + static_cast<size_t>(r) * hidden;
  for (int i = threadIdx.x * 8; i < hidden; i += blockDim.x * 8) {
    float v[8];
    NormedRow8(xr, weight, i, inv_rms, v);
    StoreBf16x8(yr + i, v);
    if (x_f16 != nullptr) {  // out's f16 form, from its bf16 values (fp8.cuh Fp8MmaInput)
      __align__(16) __half h[8];
#pragma unroll
      for (int e = 0; e < 8; ++e)
        h[e] = Fp8MmaInput(__bfloat162float(__float2bfloat16(v[e])), 1.f);
      *reinterpret_cast<uint4*>(x_f16 + static_cast<size_t>(r) * hidden + i) =
          *reinterpret_cast<const uint4*>(h);
    }
  }
}

// RmsNormCta for an FP8 GEMM's input (--quantization fp8, prefill-sized steps): row r's
// values weight * x[r] / sqrt(mean(x[r]^2) + eps), in fp32 (not rounded to bf16 first), as E4M3
// codes with the row's scale (quantize.cuh QuantizeRowCta). One CTA per row r < num_tokens;
// x: [rows, hidden] f32 (bias, nullable: added into it in place first, as RmsNormCta does);
// q: [rows, hidden]; scale: [rows]; hidden % 8 == 0.
__device__ __forceinline__ void RmsNormE4m3Cta(const BatchDesc* desc, float* x, const bf16* bias,
                                               const bf16* weight, fp8* q, float* scale,
                                               int hidden, float eps) {
  __shared__ float scratch[kWarpSize];
  const int r = blockIdx.x;
  if (r >= desc->num_tokens) return;  // uniform over the CTA
  float* xr = x + static_cast<size_t>(r) * hidden;
  const float inv_rms = AddBiasInverseRms(xr, bias, hidden, eps, scratch);
  QuantizeRowCta(hidden, [&](int i, float (&v)[8]) { NormedRow8(xr, weight, i, inv_rms, v); },
                 q + static_cast<size_t>(r) * hidden, scale + r);
}

// One warp normalizes one head vector of `head_dim` values held as RoPE pairs: lo[i] = x[j],
// hi[i] = x[j + head_dim/2] with j = lane + 32 i; slots with j >= head_dim/2 hold zeros.
// x <- weight * x / sqrt(mean(x^2) + eps). All 32 lanes must call it.
template <int kPairs>
__device__ __forceinline__ void HeadRmsNormWarp(float (&lo)[kPairs], float (&hi)[kPairs],
                                                const bf16* weight, int head_dim, float eps) {
  const int lane = threadIdx.x % kWarpSize, half = head_dim / 2;
  float sum_sq = 0.f;
#pragma unroll
  for (int i = 0; i < kPairs; ++i) sum_sq += lo[i] * lo[i] + hi[i] * hi[i];
  const float inv_rms = rsqrtf(WarpSum(sum_sq) / head_dim + eps);
#pragma unroll
  for (int i = 0; i < kPairs; ++i) {
    const int j = lane + kWarpSize * i;
    if (j < half) {
      lo[i] = __bfloat162float(weight[j]) * (lo[i] * inv_rms);
      hi[i] = __bfloat162float(weight[j + half]) * (hi[i] * inv_rms);
    }
  }
}

}  // namespace blink
