// Rows of values to E4M3 codes with one float32 scale a row (fp8.cuh E4m3ScaleOf): the FP8
// weights at load time (a scale per output channel), and the activations the FP8 GEMMs of
// prefill-sized steps read (a scale per token row). The RMSNorm and SiLU * up kernels quantize
// their own output rows with the same helper (norm.cuh, activation.cuh).
#pragma once
#include "batch.cuh"
#include "fp8.cuh"

namespace blink {

// One CTA quantizes one row of K values (K % 8 == 0), which load8(i, v) computes 8 at a time
// from column i: a pass for the row's largest |value|, then one that computes them again and
// stores the codes (recomputed rather than kept: a row runs to 14,336 values). q: the row's
// codes; *scale: its scale. Every thread of the CTA calls it.
template <class Load8>
__device__ __forceinline__ void QuantizeRowCta(int K, Load8&& load8, fp8* q, float* scale) {
  __shared__ float scratch[kWarpSize];
  float amax = 0.f;
  for (int i = threadIdx.x * 8; i < K; i += blockDim.x * 8) {
    float v[8];
    load8(i, v);
#pragma unroll
    for (int k = 0; k < 8; ++k) amax = fmaxf(amax, fabsf(v[k]));
  }
  const E4m3RowScale s = E4m3ScaleOf(BlockMax(amax, scratch));
  for (int i = threadIdx.x * 8; i < K; i += blockDim.x * 8) {
    float v[8];
    load8(i, v);
    *reinterpret_cast<uint2*>(q + i) = QuantizeE4m3x8(v, s.inverse);
  }
  if (threadIdx.x == 0) *scale = s.scale;
}

// Grid (rows): CTA r quantizes row r of x [rows, K] bf16 (ldx apart) into q [rows, K] (ldq
// apart) and scale[r], for r below desc->num_tokens (every row when desc is null: weights).
// K % 8 == 0; x, q 16- and 8-byte aligned rows.
__device__ __forceinline__ void QuantizeBf16RowCta(const BatchDesc* desc, const bf16* x, int ldx,
                                                   fp8* q, int ldq, float* scale, int K) {
  const int r = blockIdx.x;
  if (desc != nullptr && r >= desc->num_tokens) return;
  const bf16* row = x + static_cast<size_t>(r) * ldx;
  QuantizeRowCta(K, [&](int i, float (&v)[8]) { LoadBf16x8(row + i, v); },
                 q + static_cast<size_t>(r) * ldq, scale + r);
}

}  // namespace blink
