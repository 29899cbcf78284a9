// FP8 (E4M3) primitives of the FP8 paths: code <-> f16 / f32 conversions, the f16 tensor-core
// MMA those paths run on, and the per-row quantization rule. gpu_engine/fp8.py has the same
// rules on the host and reproduces the codes these produce bit for bit.
//
// Why f16 MMAs: an E4M3 pair converts to an f16 pair exactly in one instruction
// (cvt.rn.f16x2.e4m3x2, sm_89+); sm_90 has no such conversion to bf16 (four instructions a pair,
// through f32). The other operand (bf16 activations, queries, probabilities) is rounded to f16
// instead: three more mantissa bits than bf16, a smaller range (to 65,504), so operands that
// may be large are scaled by a power of two on the way (kFp8InputScale).
#pragma once
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "utils.cuh"

namespace blink {

using fp8 = __nv_fp8_storage_t;  // one E4M3 code
static constexpr float kE4m3Max = 448.f;

// bf16 activations enter the f16 MMAs of the FP8 skinny kernels times this (exact: a power of
// two), and their sums are multiplied back: |x| up to 2^20 stays finite in f16 (the residual
// stream the RMSNorm-folding kernels read can run into the thousands), and only |x| < 2^-10
// (a thousandth of a unit) loses bits to f16's subnormal range.
static constexpr float kFp8InputScale = 1.f / 16.f;

// Four E4M3 codes in a word (the first in the low byte) -> two f16 pairs, exactly: lo holds
// codes 0 and 1 (code 0 in its low half), hi codes 2 and 3. One cvt.rn.f16x2.e4m3x2 a pair on
// sm_89+ (the intrinsics convert in software below that, where only bf16 models run).
__device__ __forceinline__ void E4m3x4ToF16x4(uint32_t codes, uint32_t& lo, uint32_t& hi) {
  const __half2_raw a = __nv_cvt_fp8x2_to_halfraw2(codes & 0xffffu, __NV_E4M3);
  const __half2_raw b = __nv_cvt_fp8x2_to_halfraw2(codes >> 16, __NV_E4M3);
  lo = static_cast<uint32_t>(a.x) | static_cast<uint32_t>(a.y) << 16;
  hi = static_cast<uint32_t>(b.x) | static_cast<uint32_t>(b.y) << 16;
}

// Two floats -> two E4M3 codes in the low 16 bits (a in the low byte): rounded to nearest even,
// saturated at +-448 (cvt.rn.satfinite).
__device__ __forceinline__ uint32_t F32x2ToE4m3x2(float a, float b) {
  return __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
}

// Two floats -> an f16 pair (a in the low half), rounded to nearest.
__device__ __forceinline__ uint32_t F32x2ToF16x2(float a, float b) {
  const __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// A bf16 pair times `scale` -> an f16 pair.
__device__ __forceinline__ uint32_t Bf16x2ToF16x2(uint32_t v, float scale) {
  const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v));
  return F32x2ToF16x2(f.x * scale, f.y * scale);
}

// One element of x as the FP8 skinny kernels' MMAs take it (gemv.cuh GemvStepInputFp8): its
// bf16 value v (as a float) times its RMSNorm weight (1 where none) and kFp8InputScale, rounded
// to f16. The same float operations in the same order, so a kernel that writes x's f16 form for
// the next one (gemv.cuh kXF16) hands over exactly the words that kernel would have made.
__device__ __forceinline__ __half Fp8MmaInput(float v, float norm_w) {
  return __float2half_rn(v * norm_w * kFp8InputScale);
}

// An f16 pair -> two floats.
__device__ __forceinline__ float2 F16x2ToF32x2(uint32_t v) {
  return __half22float2(*reinterpret_cast<const __half2*>(&v));
}

// D += A B on tensor cores, mma.sync m16n8k16 with f16 inputs and fp32 accumulators; fragments
// as MmaBf16 (utils.cuh) lays them out.
__device__ __forceinline__ void MmaF16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                       uint32_t a3, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The per-row quantization rule (fp8.py row_scales): a row whose largest |x| is amax is stored
// as e4m3(x * inverse) with value code * scale, scale = amax / 448 and inverse = 448 / amax,
// each rounded to float32; a row of zeros takes 1 and 1.
struct E4m3RowScale {
  float scale, inverse;
};

__device__ __forceinline__ E4m3RowScale E4m3ScaleOf(float amax) {
  if (!(amax > 0.f)) return {1.f, 1.f};
  return {__fdiv_rn(amax, kE4m3Max), __fdiv_rn(kE4m3Max, amax)};
}

// 8 floats times `inverse` -> 8 E4M3 codes (a uint2, the first in the low byte).
__device__ __forceinline__ uint2 QuantizeE4m3x8(const float (&v)[8], float inverse) {
  uint2 out;
  out.x = F32x2ToE4m3x2(v[0] * inverse, v[1] * inverse) |
          F32x2ToE4m3x2(v[2] * inverse, v[3] * inverse) << 16;
  out.y = F32x2ToE4m3x2(v[4] * inverse, v[5] * inverse) |
          F32x2ToE4m3x2(v[6] * inverse, v[7] * inverse) << 16;
  return out;
}

}  // namespace blink
