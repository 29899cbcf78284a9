// SiLU(gate) * up over the fused [T, 2I] gate|up projection output.
#pragma once
#include "batch.cuh"
#include "utils.cuh"

namespace blink {

// One CTA per token row t < num_tokens: out[t, i] = silu(gate_up[t, i]) * gate_up[t, I + i], fp32
// math. gate_up: [bucket, 2 inter] bf16; out: [bucket, inter] bf16; inter % 8 == 0.
__device__ __forceinline__ void SiluMulCta(const BatchDesc* desc, const bf16* gate_up, bf16* out,
                                           int inter) {
  const int t = blockIdx.x;
  if (t >= desc->num_tokens) return;
  const bf16* gate = gate_up + static_cast<size_t>(t) * 2 * inter;
  const bf16* up = gate + inter;
  bf16* dst = out + static_cast<size_t>(t) * inter;
  for (int i = threadIdx.x * 8; i < inter; i += blockDim.x * 8) {
    float g[8], u[8];
    LoadBf16x8(gate + i, g);
    LoadBf16x8(up + i, u);
#pragma unroll
    for (int k = 0; k < 8; ++k) g[k] = g[k] / (1.f + expf(-g[k])) * u[k];  // exp overflow -> -0
    StoreBf16x8(dst + i, g);
  }
}

}  // namespace blink
