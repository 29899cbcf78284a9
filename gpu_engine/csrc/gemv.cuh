// Skinny linear layers for decode-sized batches: out[M, N] = x[M, K] @ W[N, K]^T with M <= 32,
// reading every weight once at close to the memory's rate (cuBLAS reaches ~85% of it at M <= 32).
//
// Tensor cores with the operands swapped: W rows are the MMA's 16-row A tiles and the M token
// rows are its 8-column B tiles (mma.sync m16n8k16, bf16 in, fp32 accumulate), so M = 1 costs
// what M = 8 does and M = 32 still reads W once. Both operands come straight from global memory
// in 16-byte loads, without shared-memory staging: within one MMA the order of the 16 k terms is
// free, so lane (g = lane / 4, t = lane % 4) takes 8 consecutive k (k0 + 8t .. +7) of W rows
// g and g + 8 and of x row g, and each 32-k step is two MMAs over (k0 + 8t + 4s .. +3), s = 0, 1.
// That permutes k identically in A and B, which leaves the dot products unchanged.
//
// Work split: a CTA owns kRowTiles * 16 consecutive W rows; its warps take the 32-k steps
// round-robin (deterministic split-K inside the CTA) and meet in shared memory for the sum.
// Output modes: bf16, fp32, fp32 added into out (the residual stream: x += attn @ Wo^T), and
// SiLU-gated: with W's gate and up rows interleaved in 16-row groups (gpu_engine/cuda_forward.py
// lays gate_proj|up_proj out so), the CTA's two row tiles are the gate and up rows of the same
// 16 features and it writes silu(gate) * up directly: no [M, 2I] intermediate, no extra kernel.
#pragma once
#include "utils.cuh"

namespace blink {

// 8 warps per CTA, and a register cap (2 CTAs per SM) that makes ptxas keep a whole unrolled
// batch of loads in flight: without the cap it interleaves loads with MMAs to save registers.
static constexpr int kGemvWarps = 8;
static constexpr int kGemvThreads = kGemvWarps * kWarpSize;
static constexpr int kGemvMinCtas = 2;

enum GemvOut : int { kGemvBf16 = 0, kGemvF32 = 1, kGemvF32Add = 2, kGemvSiluMul = 3 };

// Weights stream through once: no L1 allocation (x, re-read by every CTA, keeps the L1). Not
// volatile, so the compiler may hoist a whole unrolled batch of loads ahead of their MMAs.
__device__ __forceinline__ uint4 LoadStreaming16(const void* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ void MmaBf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                        uint32_t a3, uint32_t b0, uint32_t b1) {
  asm(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// 16-byte loads in flight per lane per 32-k step: 2 per row tile (rows g, g + 8), 1 per column
// tile. Steps are unrolled so that about 16 such loads are in flight per lane.
template <int kRowTiles, int kColTiles>
struct GemvShape {
  static constexpr int kRows = 16 * kRowTiles;
  static constexpr int kCols = 8 * kColTiles;
  static constexpr int kLoadsPerStep = 2 * kRowTiles + kColTiles;
  static constexpr int kUnroll = kLoadsPerStep <= 4 ? 4 : 2;
  // Two batches in registers (the next one's loads in flight during this one's MMAs) for the
  // shapes with two row tiles and one column tile (10 loads a batch). Measured on the H200:
  // the SiLU-gated gate|up projection (2 x 1) gains 8%, the 1 x 1 shape (12 loads a batch)
  // loses 12% with it, and two of the wider shapes spill under the register cap.
  static constexpr bool kDoubleBuffer = kLoadsPerStep * kUnroll <= 10;
  static constexpr int kRedLd = kCols + 1;  // padded row of the cross-warp reduction
  static constexpr size_t kSmemBytes = sizeof(float) * kGemvWarps * kRows * kRedLd;
  static_assert(kSmemBytes <= 48 * 1024, "static shared memory");
};

// One batch of kUnroll 32-k steps' operands, in registers.
template <int kUnroll, int kRowTiles, int kColTiles>
struct GemvBatch {
  uint4 w[kUnroll][kRowTiles][2];
  uint4 x[kUnroll][kColTiles];
};

// x: [M, ldx] bf16 (row m at x + m * ldx, K used); w: [N, K] bf16 row-major; K % 32 == 0.
// out: [M, ldo] in `mode`'s type; rows m < M and columns n < N written (kGemvSiluMul: columns
// n < N / 2 of silu(gate) * up, N = 2 * features, kRowTiles == 2). grid.x = ceil(N / kRows);
// blockDim.x = kGemvThreads.
template <int kRowTiles, int kColTiles>
__device__ __forceinline__ void SkinnyLinearCta(const bf16* x, int ldx, int M, const bf16* w,
                                                int N, int K, void* out, int ldo, int mode) {
  using S = GemvShape<kRowTiles, kColTiles>;
  constexpr int kUnroll = S::kUnroll;
  __shared__ float red[kGemvWarps * S::kRows * S::kRedLd];  // [warp][row][column]

  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  constexpr int warps = kGemvWarps;
  const int g = lane / 4, t = lane % 4;
  const int n0 = blockIdx.x * S::kRows;

  // Element offsets of this lane's rows at its 8-element column offset (32-bit: N * K < 2^31,
  // checked by the host); rows past the end re-read the last row (their results are computed
  // and dropped), so no load is ever predicated off.
  uint32_t w_off[kRowTiles][2], x_off[kColTiles];
#pragma unroll
  for (int a = 0; a < kRowTiles; ++a)
#pragma unroll
    for (int h = 0; h < 2; ++h)
      w_off[a][h] = static_cast<uint32_t>(min(n0 + 16 * a + 8 * h + g, N - 1)) * K + 8 * t;
#pragma unroll
  for (int j = 0; j < kColTiles; ++j)
    x_off[j] = static_cast<uint32_t>(min(8 * j + g, M - 1)) * ldx + 8 * t;

  float acc[kRowTiles][kColTiles][4];
#pragma unroll
  for (int a = 0; a < kRowTiles; ++a)
#pragma unroll
    for (int j = 0; j < kColTiles; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[a][j][e] = 0.f;

  // One 32-k step: its loads (W rows g, g + 8 of each row tile; x row g of each column tile).
  auto load = [&](int step, uint4 (&wv)[kRowTiles][2], uint4 (&xv)[kColTiles]) {
    const uint32_t k = static_cast<uint32_t>(step) * 32;
#pragma unroll
    for (int a = 0; a < kRowTiles; ++a)
#pragma unroll
      for (int h = 0; h < 2; ++h) wv[a][h] = LoadStreaming16(w + (w_off[a][h] + k));
#pragma unroll
    for (int j = 0; j < kColTiles; ++j)
      xv[j] = __ldg(reinterpret_cast<const uint4*>(x + (x_off[j] + k)));
  };
  auto mma = [&](const uint4 (&wv)[kRowTiles][2], const uint4 (&xv)[kColTiles]) {
#pragma unroll
    for (int a = 0; a < kRowTiles; ++a)
#pragma unroll
      for (int j = 0; j < kColTiles; ++j) {
        const uint4 lo = wv[a][0], hi = wv[a][1], b = xv[j];
        MmaBf16(acc[a][j], lo.x, hi.x, lo.y, hi.y, b.x, b.y);
        MmaBf16(acc[a][j], lo.z, hi.z, lo.w, hi.w, b.z, b.w);
      }
  };

  // Warp w takes steps w, w + warps, ...: whole batches of kUnroll steps with every load issued
  // before the first MMA (no predicates, so they all stay in flight), double-buffered where
  // registers allow (batch b + 1's loads issued before batch b's MMAs, so a warp always has
  // loads in flight); then the remainder.
  using Batch = GemvBatch<kUnroll, kRowTiles, kColTiles>;
  const int steps = K / 32, batch_steps = kUnroll * warps;
  const int batches = steps >= warp + (kUnroll - 1) * warps + 1
                          ? (steps - warp - (kUnroll - 1) * warps - 1) / batch_steps + 1
                          : 0;
  auto load_batch = [&](int b, Batch& batch) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      load(warp + b * batch_steps + u * warps, batch.w[u], batch.x[u]);
  };
  auto mma_batch = [&](const Batch& batch) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) mma(batch.w[u], batch.x[u]);
  };
  if constexpr (S::kDoubleBuffer) {
    Batch even, odd;
    if (batches > 0) load_batch(0, even);
    for (int b = 0; b < batches; b += 2) {
      if (b + 1 < batches) load_batch(b + 1, odd);
      mma_batch(even);
      if (b + 1 < batches) {
        if (b + 2 < batches) load_batch(b + 2, even);
        mma_batch(odd);
      }
    }
  } else {
    for (int b = 0; b < batches; ++b) {
      Batch batch;
      load_batch(b, batch);
      mma_batch(batch);
    }
  }
  for (int s = warp + batches * batch_steps; s < steps; s += warps) {
    uint4 wv[kRowTiles][2], xv[kColTiles];
    load(s, wv, xv);
    mma(wv, xv);
  }
  ReleaseNextKernel();  // every weight is read: the next kernel may take freed SM slots

  // Accumulator element e of tile (a, j): row 16a + g + 8 (e / 2), column 8j + 2t + e % 2.
  float* my_red = red + static_cast<size_t>(warp) * S::kRows * S::kRedLd;
#pragma unroll
  for (int a = 0; a < kRowTiles; ++a)
#pragma unroll
    for (int j = 0; j < kColTiles; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        my_red[(16 * a + g + 8 * (e / 2)) * S::kRedLd + 8 * j + 2 * t + e % 2] = acc[a][j][e];
  __syncthreads();

  const int cols = min(M, S::kCols);
  auto total = [&](int r, int m) {
    float v = 0.f;
    for (int q = 0; q < warps; ++q) v += red[(static_cast<size_t>(q) * S::kRows + r) * S::kRedLd + m];
    return v;
  };
  if (mode == kGemvSiluMul) {
    // rows 0..15: gate of features f0 .. f0 + 15; rows 16..31: their up (kRowTiles == 2)
    const int f0 = blockIdx.x * 16;
    bf16* dst = static_cast<bf16*>(out);
    for (int i = threadIdx.x; i < 16 * cols; i += blockDim.x) {
      const int r = i % 16, m = i / 16;
      if (f0 + r >= N / 2) continue;
      // rounded to bf16 as the unfused path stores gate and up before SiLU
      const float gate = __bfloat162float(__float2bfloat16(total(r, m)));
      const float up = __bfloat162float(__float2bfloat16(total(r + 16, m)));
      dst[static_cast<size_t>(m) * ldo + f0 + r] = __float2bfloat16(gate / (1.f + expf(-gate)) * up);
    }
    return;
  }
  for (int i = threadIdx.x; i < S::kRows * cols; i += blockDim.x) {
    const int r = i % S::kRows, m = i / S::kRows, n = n0 + r;
    if (n >= N) continue;
    const float v = total(r, m);
    const size_t o = static_cast<size_t>(m) * ldo + n;
    if (mode == kGemvBf16) {
      static_cast<bf16*>(out)[o] = __float2bfloat16(v);
    } else if (mode == kGemvF32) {
      static_cast<float*>(out)[o] = v;
    } else {
      static_cast<float*>(out)[o] += v;
    }
  }
}

}  // namespace blink
