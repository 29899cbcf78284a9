// SiLU(gate) * up over the fused [T, 2I] gate|up projection output.
#pragma once
#include "batch.cuh"
#include "quantize.cuh"
#include "utils.cuh"

namespace blink {

// Grid (bucket, feature chunks): CTA (t, y) takes token row t < num_tokens and features from
// 8 (y * blockDim.x + thread) on, stepping by 8 gridDim.y * blockDim.x (one step each when the
// host covers the row: a decode step's few rows spread over many SMs, and every load of a thread
// is issued at once). out[t, i] = silu(gate[i]) * up[i], fp32 math, with the fused projection's
// features interleaved in 16-wide groups (gpu_engine/cuda_forward.py interleave_gate_up):
// gate[i] at gate_up[t, 32 (i / 16) + i % 16], up[i] 16 further on.
// gate_up: [bucket, 2 inter] bf16; out: [bucket, inter] bf16; inter % 16 == 0.
__device__ __forceinline__ void SiluMulCta(const BatchDesc* desc, const bf16* gate_up, bf16* out,
                                           int inter) {
  const int t = blockIdx.x;
  if (t >= desc->num_tokens) return;
  const bf16* row = gate_up + static_cast<size_t>(t) * 2 * inter;
  bf16* dst = out + static_cast<size_t>(t) * inter;
  const int stride = 8 * gridDim.y * blockDim.x;
  for (int i = 8 * (blockIdx.y * blockDim.x + threadIdx.x); i < inter; i += stride) {
    const bf16* gate = row + 2 * (i - i % 16) + i % 16;
    float g[8], u[8];
    LoadBf16x8(gate, g);
    LoadBf16x8(gate + 16, u);
#pragma unroll
    for (int k = 0; k < 8; ++k) g[k] = g[k] / (1.f + expf(-g[k])) * u[k];  // exp overflow -> -0
    StoreBf16x8(dst + i, g);
  }
}

// SiluMulCta for the FP8 down projection's input (--quantization fp8, prefill-sized steps): one
// CTA per token row t < num_tokens, its inter values silu(gate) * up in fp32 as E4M3 codes with
// the row's scale (quantize.cuh QuantizeRowCta). q: [bucket, inter]; scale: [bucket].
__device__ __forceinline__ void SiluMulE4m3Cta(const BatchDesc* desc, const bf16* gate_up,
                                               fp8* q, float* scale, int inter) {
  const int t = blockIdx.x;
  if (t >= desc->num_tokens) return;
  const bf16* row = gate_up + static_cast<size_t>(t) * 2 * inter;
  QuantizeRowCta(inter, [&](int i, float (&v)[8]) {
    const bf16* gate = row + 2 * (i - i % 16) + i % 16;
    float u[8];
    LoadBf16x8(gate, v);
    LoadBf16x8(gate + 16, u);
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = v[k] / (1.f + expf(-v[k])) * u[k];
  }, q + static_cast<size_t>(t) * inter, scale + t);
}

}  // namespace blink
