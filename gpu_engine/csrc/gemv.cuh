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
// W's layout: row-major [N, K], or tiled (tile_weights below): 16-row tiles, each stored as its
// 32-k steps one after another, a step's 16 rows x 32 k (1 KB) contiguous, the tiles
// w_tile_stride elements apart (the host's ForwardKernels.tile_stride: 16 K and a 1 KB pad,
// which keeps the 8 concurrent tile streams of a split-K or row-block CTA off power-of-two
// strides). A
// warp's load of one step then covers 512 contiguous bytes, and a CTA streams a contiguous
// region, where row-major rows put the CTA's 16 or 32 concurrent streams 2 x K bytes apart.
// Measured on the H200 (gate|up of Llama-3.1-8B, 235 MB, the same kernel): 3.6 TB/s
// row-major, 4.2 TB/s tiled. cuBLAS needs row-major, so the engine keeps a tiled copy of the
// projections and the LM head the skinny kernel takes (CudaForward's decode_weight_copy).
//
// Work split: a CTA owns kRowTiles * 16 consecutive W rows; its warps take the 32-k steps
// round-robin (deterministic split-K inside the CTA) and meet in shared memory for the sum.
// Output modes: bf16, fp32, fp32 added into out (the residual stream: x += attn @ Wo^T), and
// SiLU-gated: with W's gate and up rows interleaved in 16-row groups (gpu_engine/cuda_forward.py
// lays gate_proj|up_proj out so), the CTA's two row tiles are the gate and up rows of the same
// 16 features and it writes silu(gate) * up directly: no [M, 2I] intermediate, no extra kernel.
//
// RMSNorm folded in (kNormIn): the projections that follow an RMSNorm (qkv, gate|up) can take the
// residual stream itself, as its bf16 shadow copy, and normalize on the way. The norm's weight is
// folded into W's columns when the weights are uploaded (W' = W diag(w), cuda_forward.py), so
// what is left is one scale per token row, 1 / rms(x_m): linear, so it is applied to the dot
// products at the end. The sum of squares comes almost free: the CTA's loads of x cover every
// element of its token rows exactly once (lane (g, t) of the warp taking step s loads x row g at
// k = 32 s + 8 t .. + 7), so each lane sums the squares of what it loaded. (Measured on the
// H200, Llama-3.1-8B batch 1: a separate pass over x, before the main loop or after it from L1,
// cost the qkv projection 3 us and the gate|up one 2 us more.) The residual adds (kGemvF32Add)
// write that shadow copy as they update the stream, so no norm kernel runs between projections.
//
// FP8 weights (Fp8Weights): E4M3 codes with a float32 scale per output row, in the same layouts
// with twice the k per 16 bytes (a 16-row tile's step is 64 k, 1 KB, as a bf16 step of 32 k
// is): lane (g, t) loads 16 codes, k = 64 s + 16 t .. + 15, of rows g and g + 8, converts them
// to f16 pairs in registers (exactly, one instruction a pair: fp8.cuh) and runs four f16
// m16n8k16 MMAs against x row g's same 16 k, rounded from bf16 to f16 on the way (times
// kFp8InputScale). The row scales and the input scale's inverse multiply the sums at the
// end. The RMSNorm's weight is not folded into FP8 weights (the checkpoint's codes stay as
// stored): the kNormIn variants multiply x by it before the MMAs.
#pragma once
#include "argmax.cuh"
#include "batch.cuh"
#include "fp8.cuh"
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

// Activations, re-read by every CTA, stay in L1. They are written by the previous kernel, so
// these loads must stay below AwaitPriorKernel: plain coherent loads with a "memory" clobber.
// (ld.global.nc, __ldg's load, promises data constant for the kernel's lifetime, and ptxas does
// hoist it above griddepcontrol.wait; the weight loads may move there, and should.)
__device__ __forceinline__ uint4 LoadActivation16(const void* p) {
  uint4 v;
  asm("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
  return v;
}

// How a skinny kernel reads one kind of weights. A lane loads 16 bytes of each of its two rows
// a step, kStepK / 4 consecutive k; and kXPieces 16-byte pieces of x row g over the same k.
struct Bf16Weights {
  using Element = bf16;
  using XFrag = uint4;  // x row g's k of a step, as a lane holds them
  static constexpr bool kFp8 = false;
  static constexpr int kStepK = 32;
  static constexpr int kXPieces = 1;
};
// E4M3 codes, a float32 scale per output row (the FP8 weights of --quantization fp8).
struct Fp8Weights {
  using Element = fp8;
  using XFrag = uint4[2];
  static constexpr bool kFp8 = true;
  static constexpr int kStepK = 64;
  static constexpr int kXPieces = 2;
};

// 16-byte loads in flight per lane per step: 2 per row tile (rows g, g + 8), kXPieces per column
// tile. Steps are unrolled so that about 16 such loads are in flight per lane. kNormIn: the
// kernel folds the RMSNorm in (SkinnyAccumulate's), which only the FP8 batches below look at.
template <int kRowTiles, int kColTiles, class W = Bf16Weights, bool kNormIn = false>
struct GemvShape {
  static constexpr int kRows = 16 * kRowTiles;
  static constexpr int kCols = 8 * kColTiles;
  static constexpr int kLoadsPerStep = 2 * kRowTiles + W::kXPieces * kColTiles;
  // FP8 weights at one column tile (up to 8 token rows), but for the plain shape of two row
  // tiles: half the batch, double-buffered, so that a warp always has a batch in flight. A CTA
  // of FP8 rows streams half bf16's bytes, so the latency of its first loads and its tail
  // weigh double, most where the grid is a wave or less. Measured on the H200 (bench_decode
  // --breakdown, batch 1 at 512 keys, us a layer, single -> double): Llama-3.1-8B qkv 10.08 ->
  // 9.71, o 6.54 -> 5.90, gate|up 33.72 -> 34.31, down 16.77 -> 15.68, the step 2.453 -> 2.427
  // ms; Llama-3.2-1B qkv 5.40 -> 5.63, o 4.15 -> 3.82, gate|up 12.06 -> 11.50, down 7.15 ->
  // 6.73, the step 0.592 -> 0.565 ms. The plain two-row-tile shape (the LM head's, 4,008 CTAs)
  // lost 132 -> 142 us (8B) and 75 -> 84 (1B), so it keeps one batch. (Also tried: x staged in
  // shared memory, so that a batch holds weights alone; slower on every FP8 projection,
  // docs/performance.md FP8 round 24.)
  static constexpr bool kFp8DoubleBuffer =
      W::kFp8 && kColTiles == 1 && (kRowTiles == 1 || kNormIn);
  static constexpr int kUnroll = (kLoadsPerStep <= 4 ? 4 : 2) / (kFp8DoubleBuffer ? 2 : 1);
  // Two batches in registers (the next one's loads in flight during this one's MMAs) for the
  // shapes with two row tiles and one column tile (10 loads a batch). Measured on the H200:
  // the SiLU-gated gate|up projection (2 x 1) gains 8%, the 1 x 1 shape (12 loads a batch)
  // loses 12% with it, and two of the wider shapes spill under the register cap.
  static constexpr bool kDoubleBuffer = kFp8DoubleBuffer || kLoadsPerStep * kUnroll <= 10;
  // (Tried on FP8 weights and not kept: double-buffering the weights alone, x and the norm's
  // weight loaded per batch just before its MMAs, so that a warp keeps two batches of weights
  // in flight. At 128 registers and no spills in the loop it made every FP8 projection slower,
  // 8B batch 1 on the H200 2.441 -> 2.629 ms a step: gate|up 1,064 -> 1,180 us, down 532 -> 545,
  // qkv 323 -> 344, o 209 -> 232. Under the cap ptxas issued x's loads step by step, each
  // waited on before its MMAs; docs/performance.md, FP8 round 19.)
  static constexpr int kRedLd = kCols + 1;  // padded row of the cross-warp reduction
};

// One batch of kUnroll steps' operands, in registers (and, FP8 kNormIn, the RMSNorm's weight
// over each step's k).
template <int kUnroll, int kRowTiles, int kColTiles, class W = Bf16Weights>
struct GemvBatch {
  uint4 w[kUnroll][kRowTiles][2];
  typename W::XFrag x[kUnroll][kColTiles];
  // FP8 kNormIn only: the RMSNorm's weight over each step's k, or, where x's f16 form is given
  // (SkinnyAccumulate's kXF16), that form (unused registers otherwise)
  typename W::XFrag norm_w[kUnroll];
};

// FP8 weights: each of a CTA's rows' weight scale, beside its sums (bf16: nothing).
template <int kRows, bool kFp8>
struct GemvWeightScales {
  float w_scale[kRows];
};
template <int kRows>
struct GemvWeightScales<kRows, false> {};

// One CTA's dot products, left in shared memory by SkinnyAccumulate for the store epilogues.
// kSplits > 1: K is split across a thread-block cluster of kSplits CTAs (SkinnyAccumulate), and
// the sums over the cluster end up in the first CTA's `part`.
template <int kRowTiles, int kColTiles, int kSplits = 1, class W = Bf16Weights>
struct GemvSums : GemvWeightScales<16 * kRowTiles, W::kFp8> {
  using S = GemvShape<kRowTiles, kColTiles, W>;
  float red[kGemvWarps * S::kRows * S::kRedLd];  // [warp][row][column] per-warp partial sums
  float row_scale[S::kCols];                     // 1, or 1 / rms(x_m) with kNormIn
  float sum_sq[kGemvWarps][S::kCols];            // per-warp sums of x_m^2 (kNormIn)
  // kSplits > 1: this CTA's sums over its warps ([row][column], then x_m^2 per column), which
  // the cluster's first CTA adds the others' to
  float part[kSplits > 1 ? S::kRows * S::kCols + S::kCols : 1];

  // Row r of the CTA's rows (output n0 + r), token row m: the dot product, unscaled.
  __device__ __forceinline__ float raw(int r, int m) const {
    float v = 0.f;
    if constexpr (kSplits > 1) {
      v = part[r * S::kCols + m];
    } else {
#pragma unroll
      for (int q = 0; q < kGemvWarps; ++q) v += red[(q * S::kRows + r) * S::kRedLd + m];
    }
    return v;
  }
  // The same, scaled.
  __device__ __forceinline__ float total(int r, int m) const {
    if constexpr (W::kFp8) return raw(r, m) * row_scale[m] * this->w_scale[r];
    return raw(r, m) * row_scale[m];
  }
  // total(r, m) + addend, the last product and the add rounded once (an FMA), as the residual's
  // `+=` has always compiled: written out, so that the sum does not depend on where the
  // compiler can fuse them.
  __device__ __forceinline__ float total_plus(int r, int m, float addend) const {
    if constexpr (W::kFp8) return fmaf(raw(r, m) * row_scale[m], this->w_scale[r], addend);
    return fmaf(raw(r, m), row_scale[m], addend);
  }
};

// The row block (kRows output rows) a skinny CTA computes: its cluster's, with K split across
// a cluster of kSplits CTAs along x.
template <int kSplits>
__device__ __forceinline__ int SkinnyRowBlock() {
  return static_cast<int>(blockIdx.x) / kSplits;
}

// kSplits > 1, after each CTA's warps have left their sums in red and sum_sq: each CTA sums
// its warps' into part, and the cluster's first CTA (rank 0) adds the other CTAs' parts to its
// own. True in rank 0, whose part then holds the row block's sums; every thread of every CTA of
// the cluster calls it. The other CTAs wait until rank 0 has read their shared memory (a CTA's
// shared memory goes when it exits).
template <int kRowTiles, int kColTiles, int kSplits, class W>
__device__ __forceinline__ bool MeetClusterSums(GemvSums<kRowTiles, kColTiles, kSplits, W>& sums,
                                                int rank) {
  using S = GemvShape<kRowTiles, kColTiles, W>;
  constexpr int kParts = S::kRows * S::kCols + S::kCols;
  for (int i = threadIdx.x; i < kParts; i += blockDim.x) {
    float v = 0.f;
    if (i < S::kRows * S::kCols) {
      const int r = i / S::kCols, m = i % S::kCols;
#pragma unroll
      for (int q = 0; q < kGemvWarps; ++q) v += sums.red[(q * S::kRows + r) * S::kRedLd + m];
    } else {
#pragma unroll
      for (int q = 0; q < kGemvWarps; ++q) v += sums.sum_sq[q][i - S::kRows * S::kCols];
    }
    sums.part[i] = v;
  }
  ClusterArriveRelease();  // every weight load has returned: the release waits for nothing
  ClusterWaitAcquire();
  if (rank == 0) {
    for (int i = threadIdx.x; i < kParts; i += blockDim.x) {
      float v = sums.part[i];
#pragma unroll
      for (int c = 1; c < kSplits; ++c) v += LoadSharedCluster(&sums.part[i], c);
      sums.part[i] = v;
    }
  }
  // rank 0 has read the others' parts: they may exit. A relaxed arrival orders no memory, but
  // rank 0's remote loads have returned before it arrives (their values are added and stored
  // above), which is what keeps them ahead of the other CTAs' exit (utils.cuh ClusterArrive).
  ClusterRendezvous();
  if (rank != 0) return false;
  __syncthreads();
  return true;
}

// One 32-k step of a lane's MMAs: W rows g, g + 8 of each row tile (wv) against x row g of
// each column tile (xv); kNormIn: the lane's share of each x row's sum of squares too.
template <int kRowTiles, int kColTiles, bool kNormIn>
__device__ __forceinline__ void GemvStepMma(float (&acc)[kRowTiles][kColTiles][4],
                                            float (&sum_sq)[kColTiles],
                                            const uint4 (&wv)[kRowTiles][2],
                                            const uint4 (&xv)[kColTiles]) {
#pragma unroll
  for (int a = 0; a < kRowTiles; ++a)
#pragma unroll
    for (int j = 0; j < kColTiles; ++j) MmaBf16Step32(acc[a][j], wv[a][0], wv[a][1], xv[j]);
  if constexpr (kNormIn) {
#pragma unroll
    for (int j = 0; j < kColTiles; ++j) {
      const uint32_t words[4] = {xv[j].x, xv[j].y, xv[j].z, xv[j].w};
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&words[q]));
        sum_sq[j] = fmaf(f.x, f.x, fmaf(f.y, f.y, sum_sq[j]));
      }
    }
  }
}

// x's part of one 64-k step of a lane's MMAs on FP8 weights (GemvStepMmaFp8): x row g of each
// column tile over k 16 t .. + 15 of the step (xv: two bf16 pieces, k 16 t .. + 7 and + 8 .. +
// 15), rounded to f16 times kFp8InputScale (and, kNormIn, times the RMSNorm's weight over those
// k: nw), into xb[j] as the MMAs take it (f16 pairs: k 16 t + 2 i, + 1 in word i). kNormIn: the
// lane's share of each x row's sum of squares too (of x as stored).
template <int kColTiles, bool kNormIn>
__device__ __forceinline__ void GemvStepInputFp8(uint32_t (&xb)[kColTiles][8],
                                                 float (&sum_sq)[kColTiles],
                                                 const uint4 (&xv)[kColTiles][2],
                                                 const uint4 (&nw)[2]) {
#pragma unroll
  for (int j = 0; j < kColTiles; ++j) {
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      const uint32_t words[4] = {xv[j][p].x, xv[j][p].y, xv[j][p].z, xv[j][p].w};
      const uint32_t norm[4] = {nw[p].x, nw[p].y, nw[p].z, nw[p].w};
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&words[q]));
        if constexpr (kNormIn) {
          sum_sq[j] = fmaf(f.x, f.x, fmaf(f.y, f.y, sum_sq[j]));
          const float2 w = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&norm[q]));
          f.x *= w.x;
          f.y *= w.y;
        }
        xb[j][4 * p + q] = F32x2ToF16x2(f.x * kFp8InputScale, f.y * kFp8InputScale);
      }
    }
  }
}

// x's part of a step where x's f16 form is given (SkinnyAccumulate's kXF16: the words
// GemvStepInputFp8 would make, written by the kernel before; one column tile): the MMAs take
// them as loaded.
__device__ __forceinline__ void GemvStepInputGiven(uint32_t (&xb)[1][8], const uint4 (&xf)[2]) {
#pragma unroll
  for (int p = 0; p < 2; ++p) {
    xb[0][4 * p] = xf[p].x, xb[0][4 * p + 1] = xf[p].y;
    xb[0][4 * p + 2] = xf[p].z, xb[0][4 * p + 3] = xf[p].w;
  }
}

// One FP8 step's share of a lane's sum of squares of x (its two bf16 pieces), in
// GemvStepInputFp8's order: where x's f16 form is given, SkinnyAccumulate sums these step by
// step in its loop, or before it over the lane's steps in the loop's order: the same sums.
__device__ __forceinline__ void GemvStepSumSquares(float& sum_sq, const uint4 (&xv)[2]) {
#pragma unroll
  for (int p = 0; p < 2; ++p) {
    const uint32_t words[4] = {xv[p].x, xv[p].y, xv[p].z, xv[p].w};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&words[q]));
      sum_sq = fmaf(f.x, f.x, fmaf(f.y, f.y, sum_sq));
    }
  }
}

// The weights' part: W rows g, g + 8 of each row tile (wv: 16 codes each, k 16 t .. + 15 of
// the step) against xb (GemvStepInputFp8); MMA i takes k 16 t + 4 i .. + 3, the same
// permutation of k in A and B (as MmaBf16Step32 permutes them).
template <int kRowTiles, int kColTiles>
__device__ __forceinline__ void GemvStepMmasFp8(
    float (&acc)[kRowTiles][kColTiles][4], const uint4 (&wv)[kRowTiles][2],
    const uint32_t (&xb)[kColTiles][8]) {
#pragma unroll
  for (int a = 0; a < kRowTiles; ++a) {
    const uint32_t lo[4] = {wv[a][0].x, wv[a][0].y, wv[a][0].z, wv[a][0].w};
    const uint32_t hi[4] = {wv[a][1].x, wv[a][1].y, wv[a][1].z, wv[a][1].w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      uint32_t lo0, lo1, hi0, hi1;  // row g: k 4 i, + 1 and 4 i + 2, + 3; row g + 8 likewise
      E4m3x4ToF16x4(lo[i], lo0, lo1);
      E4m3x4ToF16x4(hi[i], hi0, hi1);
#pragma unroll
      for (int j = 0; j < kColTiles; ++j)
        MmaF16(acc[a][j], lo0, hi0, lo1, hi1, xb[j][2 * i], xb[j][2 * i + 1]);
    }
  }
}

// One 64-k step of a lane's MMAs on FP8 weights: x's part (GemvStepInputFp8), then the
// weights' (GemvStepMmasFp8).
template <int kRowTiles, int kColTiles, bool kNormIn>
__device__ __forceinline__ void GemvStepMmaFp8(float (&acc)[kRowTiles][kColTiles][4],
                                               float (&sum_sq)[kColTiles],
                                               const uint4 (&wv)[kRowTiles][2],
                                               const uint4 (&xv)[kColTiles][2],
                                               const uint4 (&nw)[2]) {
  uint32_t xb[kColTiles][8];
  GemvStepInputFp8<kColTiles, kNormIn>(xb, sum_sq, xv, nw);
  GemvStepMmasFp8(acc, wv, xb);
}

// A warp's accumulators (and kNormIn sums of squares) into sums.red / sums.sum_sq. Accumulator
// element e of tile (a, j): row 16a + g + 8 (e / 2), column 8j + 2t + e % 2.
template <bool kNormIn, int kRowTiles, int kColTiles, int kSplits, class W>
__device__ __forceinline__ void GemvWarpSums(const float (&acc)[kRowTiles][kColTiles][4],
                                             const float (&sum_sq)[kColTiles],
                                             GemvSums<kRowTiles, kColTiles, kSplits, W>& sums) {
  using S = GemvShape<kRowTiles, kColTiles, W>;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int g = lane / 4, t = lane % 4;
  float* my_red = sums.red + static_cast<size_t>(warp) * S::kRows * S::kRedLd;
#pragma unroll
  for (int a = 0; a < kRowTiles; ++a)
#pragma unroll
    for (int j = 0; j < kColTiles; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        my_red[(16 * a + g + 8 * (e / 2)) * S::kRedLd + 8 * j + 2 * t + e % 2] = acc[a][j][e];
  if constexpr (kNormIn) {
#pragma unroll
    for (int j = 0; j < kColTiles; ++j) {  // the 4 lanes of row g hold 4 disjoint k ranges
      float v = sum_sq[j];
      v += __shfl_xor_sync(kFullMask, v, 1);
      v += __shfl_xor_sync(kFullMask, v, 2);
      if (t == 0) sums.sum_sq[warp][8 * j + g] = v;
    }
  }
}

// sums.row_scale of each token row, once the warps' sums are in (and, kSplits > 1, met in
// part): 1 / rms(x_m) with kNormIn, else 1; FP8 weights: times 1 / kFp8InputScale.
// tid: the calling thread's index among those that call it (thread m computes row m's).
// kSquaresGiven: each row's whole sum of squares is in sums.sum_sq[0] (GemvAddSquareParts).
template <bool kNormIn, int kRowTiles, int kColTiles, int kSplits, class W,
          bool kSquaresGiven = false>
__device__ __forceinline__ void GemvTokenScales(GemvSums<kRowTiles, kColTiles, kSplits, W>& sums,
                                                int M, int K, float eps,
                                                int tid = threadIdx.x) {
  using S = GemvShape<kRowTiles, kColTiles, W>;
  if (tid < min(M, S::kCols)) {
    float scale = 1.f;
    if constexpr (kNormIn) {
      float v = 0.f;
      if constexpr (kSquaresGiven) {
        v = sums.sum_sq[0][tid];
      } else if constexpr (kSplits > 1) {
        v = sums.part[S::kRows * S::kCols + tid];
      } else {
#pragma unroll
        for (int q = 0; q < kGemvWarps; ++q) v += sums.sum_sq[q][tid];
      }
      scale = rsqrtf(v / K + eps);
    }
    if constexpr (W::kFp8) scale *= 1.f / kFp8InputScale;
    sums.row_scale[tid] = scale;
  }
}

// GemvTokenScales, and FP8 weights: each of the CTA's rows' weight scale into sums.w_scale,
// thread r's row_w_scale (GemvRowWeightScale) for row r.
template <bool kNormIn, int kRowTiles, int kColTiles, int kSplits, class W,
          bool kSquaresGiven = false>
__device__ __forceinline__ void GemvRowScales(GemvSums<kRowTiles, kColTiles, kSplits, W>& sums,
                                              int M, int K, float eps, float row_w_scale) {
  using S = GemvShape<kRowTiles, kColTiles, W>;
  GemvTokenScales<kNormIn, kRowTiles, kColTiles, kSplits, W, kSquaresGiven>(sums, M, K, eps);
  if constexpr (W::kFp8) {
    if (threadIdx.x < S::kRows) sums.w_scale[threadIdx.x] = row_w_scale;
  }
}

// FP8 weights: the weight scale of the CTA's row threadIdx.x (rows past N: the last row's), for
// GemvRowScales; bf16 weights, or threads past the CTA's rows: 0, unused.
template <int kRows, class W>
__device__ __forceinline__ float GemvRowWeightScale(const float* w_scale, int n0, int N) {
  if constexpr (W::kFp8) {
    const int r = threadIdx.x;
    if (r < kRows) return __ldg(w_scale + min(n0 + r, N - 1));
  }
  return 0.f;
}

// --- x's sums of squares handed over in parts (SkinnyAccumulate's kSquaresGiven) ---------------
//
// The kernel that writes x and its f16 form (SkinnyStore's and EmbeddingCta's x_sumsq) also
// leaves each token row's sum of squares of x as stored, in parts of 16 features:
// parts[m * (K / 16) + p] for features 16 p .. + 15. A normalizing FP8 projection then loads
// neither x's bf16 words nor squares them on its MMAs' path (round 38 left those loads beside
// the f16 form's): warp m copies token row m's parts into shared memory once the previous kernel
// is done (cp.async, so no register is held across the loop) and adds them after the loop in a
// fixed order (lane l its parts l, l + 32, ... in turn, then the warp's tree), so the sum is
// reproducible, though not in the order the kernel's own squares take: the scale agrees with
// it to float rounding, not bit for bit.
static constexpr int kGemvMaxSquareParts = 512;  // K / 16: hidden sizes up to 8,192
struct GemvSquareParts {
  float part[8][kGemvMaxSquareParts];  // [token row][part]: one column tile's rows
};

// The staging buffer, a CTA's (only the kernels that take the parts have it).
template <int kCols>
__device__ __forceinline__ GemvSquareParts& GemvSquarePartsStage() {
  static_assert(kCols <= 8 && kCols <= kGemvWarps, "a warp a token row, one column tile");
  __shared__ __align__(16) GemvSquareParts staged;
  return staged;
}

// Warp m < min(M, kCols) starts the copy of token row m's parts (K / 16 of them). Every thread
// calls it, after waiting for the previous kernel.
template <int kCols>
__device__ __forceinline__ void GemvStageSquareParts(const float* parts, int M, int K) {
  const int lane = threadIdx.x % kWarpSize, m = threadIdx.x / kWarpSize, count = K / 16;
  if (m < min(M, kCols)) {
    float* dst = GemvSquarePartsStage<kCols>().part[m];
    const float* src = parts + static_cast<size_t>(m) * count;
    for (int c = 4 * lane; c < count; c += 4 * kWarpSize) CpAsync16(dst + c, src + c, 16);
  }
  CpAsyncCommit();
}

// Warp m's sum of the parts it copied, into total[m] (sums.sum_sq[0], which GemvTokenScales
// reads with kSquaresGiven). Every thread calls it; total is read after a CTA barrier.
template <int kCols>
__device__ __forceinline__ void GemvAddSquareParts(float* total, int M, int K) {
  const int lane = threadIdx.x % kWarpSize, m = threadIdx.x / kWarpSize, count = K / 16;
  CpAsyncWait<0>();
  __syncwarp();  // the warp's lanes see each other's copies
  if (m < min(M, kCols)) {
    const float* part = GemvSquarePartsStage<kCols>().part[m];
    float v = 0.f;
    for (int c = lane; c < count; c += kWarpSize) v += part[c];
    v = WarpSum(v);
    if (lane == 0) total[m] = v;
  }
}

// What a skinny CTA reads for its epilogue right after waiting for the previous kernel
// (SkinnyAccumulate's after_wait): nothing by default.
struct NoLoadsAfterWait {
  __device__ __forceinline__ void operator()() const {}
};

// x: [M, ldx] bf16 (row m at x + m * ldx, K used); w: [N, K] bf16 row-major (w_tile_stride
// 0), or tiled (tiles of 16 rows w_tile_stride elements apart, the last one padded); K %
// W::kStepK == 0; the CTA's rows are n0 = SkinnyRowBlock() * kRows .. + kRows - 1 (rows past N
// compute and drop the last row, or the padding). kNormIn: row_scale[m] = 1 / sqrt(mean(x_m^2)
// + eps), else 1. FP8 weights (W = Fp8Weights): w holds E4M3 codes in the same layouts (a
// tiled step is 64 k), w_scale [N] their rows' scales, and norm_w [K] (kNormIn) the RMSNorm's
// weight, which x is multiplied by (bf16 weights have it folded in).
// Every thread of the CTA calls it; sums is in shared memory and complete when it returns true.
// blockDim.x = kGemvThreads. It waits for the previous kernel itself (AwaitPriorKernel), after
// its first weight loads (and FP8 row scales), then calls after_wait(): loads for the epilogue
// of what earlier kernels wrote (SkinnyLinearCta: the residual), not to be waited on there.
//
// kSplits > 1 (a grid of kSplits CTAs a row block, launched in clusters of kSplits along x):
// the cluster's CTAs take the row block's steps round-robin as if their warps were one
// CTA's, and the first CTA adds the others' sums from their shared memory (distributed shared
// memory, after a cluster barrier); it returns true, the others false (they have nothing to
// store). Where a projection has fewer row blocks than the GPU has SMs (Llama-3.2-1B's o and
// down projections at batch 1: 128 row blocks of 16 rows), one CTA an SM has too few loads in
// flight to stream at the memory's rate, and two CTAs a row block double them.
//
// kXF16 (FP8 weights, up to 8 token rows): x_f16 [M, ldx] holds x's f16 form, the words
// GemvStepInputFp8 makes (times the RMSNorm's weight norm_w with kNormIn, and kFp8InputScale;
// fp8.cuh Fp8MmaInput), written by the kernel before beside x (SkinnyStore's x_f16). The MMAs
// take them as loaded, with no conversion on their path: the same sums, bit for bit; norm_w is
// not read. kNormIn still sums the squares of x as stored (its RMSNorm's scale), in the same
// order, step by step in the loop (x's words loaded with its f16 form's; summed before the
// loop instead, once the second batch's loads were issued, the 8B FP8 step took 2.416 ms
// against 2.323: docs/performance.md round 38). Why: x's conversion, each CTA doing its own
// steps' on its MMAs' path, cost 2.5% of the 8B FP8 batch-1 step (round 29; handed over, the
// 8B step took 0.8-1.1% less and the 1B one 2.2% at batch 1: round 38).
//
// kSquaresGiven (kXF16 with kNormIn): x's sums of squares come in parts too (x_sumsq,
// GemvSquareParts), so x as stored is not read at all; the scale agrees with the kernel's own
// squares to float rounding, not bit for bit (CudaForward's fp8_x_sumsq).
template <int kRowTiles, int kColTiles, bool kNormIn, int kSplits = 1, class W = Bf16Weights,
          bool kXF16 = false, bool kSquaresGiven = false, class AfterWait = NoLoadsAfterWait>
__device__ __forceinline__ bool SkinnyAccumulate(const bf16* x, int ldx, int M,
                                                 const typename W::Element* w,
                                                 uint32_t w_tile_stride, int N, int K,
                                                 float eps,
                                                 GemvSums<kRowTiles, kColTiles, kSplits, W>& sums,
                                                 const float* w_scale = nullptr,
                                                 const bf16* norm_w = nullptr,
                                                 AfterWait&& after_wait = AfterWait{},
                                                 const __half* x_f16 = nullptr,
                                                 const float* x_sumsq = nullptr) {
  using S = GemvShape<kRowTiles, kColTiles, W, kNormIn>;
  static_assert(sizeof(sums) <= 48 * 1024, "static shared memory");
  static_assert(!kXF16 || (W::kFp8 && kColTiles == 1), "x's f16 form: FP8, one column tile");
  static_assert(!kSquaresGiven || (kXF16 && kNormIn), "squares given: with x's f16 form, norm");
  constexpr int kUnroll = S::kUnroll;
  constexpr int kStepK = W::kStepK, kPieceK = kStepK / 4;  // k a step, k a lane loads a row
  constexpr bool kNormW = W::kFp8 && kNormIn && !kXF16;
  // kXF16 with kNormIn: x as stored too, its squares summed step by step in the loop (its f16
  // form then goes into the batch's norm_w registers), unless they are given
  constexpr bool kSquaresInLoop = kXF16 && kNormIn && !kSquaresGiven;

  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  // the steps' round-robin runs over the cluster's warps: this warp's place in it
  constexpr int warps = kGemvWarps * kSplits;
  const int rank = static_cast<int>(blockIdx.x) % kSplits;
  const int slot = rank * kGemvWarps + warp;
  const int g = lane / 4, t = lane % 4;
  const int n0 = SkinnyRowBlock<kSplits>() * S::kRows;

  // Element offsets of this lane's rows at its column offset in step 0, and from one step to
  // the next (32-bit: the padded N * K < 2^31, checked by the host); rows past the end re-read
  // the last row, or the last tile (their results are computed and dropped), so no load is
  // ever predicated off.
  uint32_t w_off[kRowTiles][2], x_off[kColTiles];
  const uint32_t w_step = w_tile_stride ? 16 * kStepK : kStepK;
#pragma unroll
  for (int a = 0; a < kRowTiles; ++a)
#pragma unroll
    for (int h = 0; h < 2; ++h)
      w_off[a][h] = w_tile_stride
                        ? static_cast<uint32_t>(min(n0 / 16 + a, (N - 1) / 16)) * w_tile_stride +
                              (8 * h + g) * kStepK + kPieceK * t
                        : static_cast<uint32_t>(min(n0 + 16 * a + 8 * h + g, N - 1)) * K +
                              kPieceK * t;
#pragma unroll
  for (int j = 0; j < kColTiles; ++j)
    x_off[j] = static_cast<uint32_t>(min(8 * j + g, M - 1)) * ldx + kPieceK * t;

  float acc[kRowTiles][kColTiles][4];
  float sum_sq[kColTiles];  // kNormIn: this lane's share of x row 8 j + g's sum of squares
#pragma unroll
  for (int j = 0; j < kColTiles; ++j) {
    sum_sq[j] = 0.f;
#pragma unroll
    for (int a = 0; a < kRowTiles; ++a)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[a][j][e] = 0.f;
  }

  using XFrag = typename W::XFrag;
  // One step's loads: W rows g, g + 8 of each row tile; x row g of each column tile (kXF16: its
  // f16 form, and with kSquaresInLoop x as stored too, the form into nw), and the RMSNorm's
  // weight over the same k (kNormW).
  auto load_w = [&](int step, uint4 (&wv)[kRowTiles][2]) {
    const uint32_t k = static_cast<uint32_t>(step) * w_step;
#pragma unroll
    for (int a = 0; a < kRowTiles; ++a)
#pragma unroll
      for (int h = 0; h < 2; ++h) wv[a][h] = LoadStreaming16(w + (w_off[a][h] + k));
  };
  auto load_x = [&](int step, XFrag (&xv)[kColTiles], XFrag& nw) {
    const uint32_t k = static_cast<uint32_t>(step) * kStepK;
#pragma unroll
    for (int j = 0; j < kColTiles; ++j) {
      if constexpr (W::kFp8) {
#pragma unroll
        for (int p = 0; p < 2; ++p) {
          const uint32_t i = x_off[j] + k + 8 * p;
          if constexpr (!kXF16 || kSquaresInLoop) xv[j][p] = LoadActivation16(x + i);
          if constexpr (kSquaresInLoop) {
            nw[p] = LoadActivation16(x_f16 + i);
          } else if constexpr (kXF16) {
            xv[j][p] = LoadActivation16(x_f16 + i);
          }
        }
      } else {
        xv[j] = LoadActivation16(x + (x_off[j] + k));
      }
    }
    if constexpr (kNormW) {  // constant for the kernel's life: cached, may move above the wait
#pragma unroll
      for (int p = 0; p < 2; ++p)
        nw[p] = __ldg(reinterpret_cast<const uint4*>(norm_w + k + kPieceK * t + 8 * p));
    }
  };
  auto mma = [&](const uint4 (&wv)[kRowTiles][2], const XFrag (&xv)[kColTiles],
                 const XFrag& nw) {
    if constexpr (kXF16) {
      uint32_t xb[1][8];
      if constexpr (kSquaresInLoop) {
        GemvStepSumSquares(sum_sq[0], xv[0]);
        GemvStepInputGiven(xb, nw);
      } else {
        GemvStepInputGiven(xb, xv[0]);
      }
      GemvStepMmasFp8(acc, wv, xb);
    } else if constexpr (W::kFp8) {
      GemvStepMmaFp8<kRowTiles, kColTiles, kNormIn>(acc, sum_sq, wv, xv, nw);
    } else {
      GemvStepMma<kRowTiles, kColTiles, kNormIn>(acc, sum_sq, wv, xv);
    }
  };

  // Warp w takes steps w, w + warps, ...: whole batches of kUnroll steps with every load issued
  // before the first MMA (no predicates, so they all stay in flight), double-buffered where
  // registers allow (batch b + 1's loads issued before batch b's MMAs, so a warp always has
  // loads in flight); then the remainder.
  using Batch = GemvBatch<kUnroll, kRowTiles, kColTiles, W>;
  const int steps = K / kStepK, batch_steps = kUnroll * warps;
  const int batches = steps >= slot + (kUnroll - 1) * warps + 1
                          ? (steps - slot - (kUnroll - 1) * warps - 1) / batch_steps + 1
                          : 0;
  auto load_batch_w = [&](int b, Batch& batch) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) load_w(slot + b * batch_steps + u * warps, batch.w[u]);
  };
  auto load_batch_x = [&](int b, Batch& batch) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      load_x(slot + b * batch_steps + u * warps, batch.x[u], batch.norm_w[u]);
  };
  auto load_batch = [&](int b, Batch& batch) {
    load_batch_w(b, batch);
    load_batch_x(b, batch);
  };
  auto mma_batch = [&](const Batch& batch) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) mma(batch.w[u], batch.x[u], batch.norm_w[u]);
  };
  // The weights do not depend on the previous kernel, x does: the first batch's weight loads
  // are issued before waiting for it (programmatic dependent launch), so they are in flight
  // while the previous kernel finishes.
  Batch first;
  if (batches > 0) load_batch_w(0, first);
  // FP8: the row scales now, not in the epilogue, where a load is a memory latency with the
  // SM's slot idle (in a grid of one wave, added to the whole kernel)
  const float row_w_scale = GemvRowWeightScale<S::kRows, W>(w_scale, n0, N);
  AwaitPriorKernel();
  after_wait();
  // (in a K-split cluster only the first CTA, which scales the sums, needs them)
  if constexpr (kSquaresGiven) {
    if (rank == 0) GemvStageSquareParts<S::kCols>(x_sumsq, M, K);
  }
  if (batches > 0) load_batch_x(0, first);
  if constexpr (S::kDoubleBuffer) {
    Batch& even = first;
    Batch odd;
    for (int b = 0; b < batches; b += 2) {
      if (b + 1 < batches) load_batch(b + 1, odd);
      mma_batch(even);
      if (b + 1 < batches) {
        if (b + 2 < batches) load_batch(b + 2, even);
        mma_batch(odd);
      }
    }
  } else {
    if (batches > 0) mma_batch(first);
    for (int b = 1; b < batches; ++b) {
      Batch batch;  // fresh registers: all of its loads are issued before its first MMA
      load_batch(b, batch);
      mma_batch(batch);
    }
  }
  for (int s = slot + batches * batch_steps; s < steps; s += warps) {
    uint4 wv[kRowTiles][2];
    XFrag xv[kColTiles], nw;
    load_w(s, wv);
    load_x(s, xv, nw);
    mma(wv, xv, nw);
  }
  ReleaseNextKernel();  // every weight is read: the next kernel may take freed SM slots

  GemvWarpSums<kNormIn && !kSquaresGiven>(acc, sum_sq, sums);
  if constexpr (kSquaresGiven) {
    if (rank == 0) GemvAddSquareParts<S::kCols>(sums.sum_sq[0], M, K);
  }
  __syncthreads();
  if constexpr (kSplits > 1) {
    if (!MeetClusterSums(sums, rank)) return false;
  }
  GemvRowScales<kNormIn, kRowTiles, kColTiles, kSplits, W, kSquaresGiven>(sums, M, K, eps,
                                                                          row_w_scale);
  __syncthreads();
  return true;
}

// The plain outputs: out[m, n] for m < M, n < N in `mode`'s type (kGemvBf16, kGemvF32, or
// kGemvF32Add: added into an fp32 out; then `shadow`, when not null, gets the sum as bf16: the
// copy a following kNormIn projection reads). kGemvF32 with `argmax` (the LM head): each row m
// of out also folds its argmax over the CTA's columns into argmax[m] (argmax.cuh PackArgMax;
// zero before the first CTA), a warp a row and one atomicMax a CTA. tid, threads: the calling
// thread's index among the `threads` (whole warps) that call it. has_prior (kGemvF32Add,
// where each thread stores one element at most): prior is that element of out as the thread
// read it before (SkinnyLinearCta, right after waiting for the previous kernel), so the
// epilogue does not wait for the load. x_f16 (with shadow): the shadow's f16 form as the next
// projection's FP8 skinny kernel takes it (SkinnyAccumulate's kXF16), times x_f16_norm_w [N],
// that projection's RMSNorm weight; and x_sumsq (with x_f16), where not null, the shadow's sums
// of squares in parts of 16 features (GemvSquareParts: [M, N / 16]; N % 16 == 0, threads and
// tid's lane whole warps apart, so that a part's 16 rows are one half-warp's).
template <int kRowTiles, int kColTiles, int kSplits, class W>
__device__ __forceinline__ void SkinnyStore(const GemvSums<kRowTiles, kColTiles, kSplits, W>& sums,
                                            int row_block, int M, int N, void* out, int ldo,
                                            int mode, bf16* shadow,
                                            unsigned long long* argmax = nullptr,
                                            int tid = threadIdx.x, int threads = blockDim.x,
                                            bool has_prior = false, float prior = 0.f,
                                            __half* x_f16 = nullptr,
                                            const bf16* x_f16_norm_w = nullptr,
                                            float* x_sumsq = nullptr) {
  using S = GemvShape<kRowTiles, kColTiles, W>;
  const int n0 = row_block * S::kRows, cols = min(M, S::kCols);
  if (argmax != nullptr && mode == kGemvF32) {
    const int lane = tid % kWarpSize;
    for (int m = tid / kWarpSize; m < cols; m += threads / kWarpSize) {
      unsigned long long best = 0;
      for (int r = lane; r < S::kRows; r += kWarpSize) {
        if (n0 + r < N) {
          best = max(best, PackArgMax(sums.total(r, m), n0 + r));
        }
      }
      best = WarpMax(best);
      if (lane == 0) atomicMax(argmax + m, best);
    }
  }
  for (int i = tid; i < S::kRows * cols; i += threads) {
    const int r = i % S::kRows, m = i / S::kRows, n = n0 + r;
    if (n >= N) continue;
    const size_t o = static_cast<size_t>(m) * ldo + n;
    if (mode == kGemvBf16) {
      static_cast<bf16*>(out)[o] = __float2bfloat16(sums.total(r, m));
    } else if (mode == kGemvF32) {
      static_cast<float*>(out)[o] = sums.total(r, m);
    } else {
      float* dst = static_cast<float*>(out) + o;
      const float sum = sums.total_plus(r, m, has_prior ? prior : *dst);
      *dst = sum;
      if (shadow != nullptr) shadow[o] = __float2bfloat16(sum);
      if (x_f16 != nullptr) {  // (with the shadow): from its bf16 value
        const float stored = __bfloat162float(__float2bfloat16(sum));
        x_f16[o] = Fp8MmaInput(stored, __bfloat162float(x_f16_norm_w[n]));
        if (x_sumsq != nullptr) {  // rows 16 p .. + 15 of token row m: one half-warp's
          const float part = HalfWarpSum(stored * stored);
          if (r % 16 == 0) x_sumsq[static_cast<size_t>(m) * (N / 16) + n / 16] = part;
        }
      }
    }
  }
}

// kGemvSiluMul: the CTA's rows 0..15 are the gate of features f0 .. f0 + 15 (f0 = 16 x its row
// block) and rows 16..31 their up (kRowTiles == 2); out[m, f] = silu(gate) * up in bf16, f < N / 2.
// tid, threads: as SkinnyStore's. x_f16: out's f16 form as the down projection's FP8 skinny
// kernel takes it (SkinnyAccumulate's kXF16), beside out (ldo apart).
template <int kColTiles, int kSplits, class W>
__device__ __forceinline__ void SkinnyStoreSiluMul(const GemvSums<2, kColTiles, kSplits, W>& sums,
                                                   int row_block, int M, int N, bf16* out,
                                                   int ldo, int tid = threadIdx.x,
                                                   int threads = blockDim.x,
                                                   __half* x_f16 = nullptr) {
  const int f0 = row_block * 16, cols = min(M, GemvShape<2, kColTiles, W>::kCols);
  for (int i = tid; i < 16 * cols; i += threads) {
    const int r = i % 16, m = i / 16;
    if (f0 + r >= N / 2) continue;
    // rounded to bf16 as the unfused path stores gate and up before SiLU
    const float gate = __bfloat162float(__float2bfloat16(sums.total(r, m)));
    const float up = __bfloat162float(__float2bfloat16(sums.total(r + 16, m)));
    const float act = gate / (1.f + expf(-gate)) * up;
    out[static_cast<size_t>(m) * ldo + f0 + r] = __float2bfloat16(act);
    if (x_f16 != nullptr) {  // from its bf16 value
      x_f16[static_cast<size_t>(m) * ldo + f0 + r] =
          Fp8MmaInput(__bfloat162float(__float2bfloat16(act)), 1.f);
    }
  }
}

// The whole skinny linear layer for the plain and SiLU-gated modes. grid.x = ceil(N / kRows)
// x kSplits (kGemvSiluMul: N = 2 * features, kRowTiles == 2); blockDim.x = kGemvThreads;
// kSplits > 1: clusters of kSplits CTAs along x. FP8 weights (W = Fp8Weights): w_scale, and
// norm_w with kNormIn, as SkinnyAccumulate takes them, and x's f16 form given with kXF16In
// (x_f16, SkinnyAccumulate's kXF16); kXF16Out: x_f16_out, where not null, gets out's
// (kGemvSiluMul) or the shadow's (kGemvF32Add, times x_f16_norm_w) f16 form for the next
// projection's kXF16 kernel. kSquares (CudaForward's fp8_x_sumsq): x's sums of squares handed
// over in parts too (GemvSquareParts): taken from x_sumsq with kNormIn (SkinnyAccumulate's
// kSquaresGiven), written to x_sumsq_out with the shadow's f16 form. (All compile-time, so the
// entries without them are the same machine code as before them.)
template <int kRowTiles, int kColTiles, bool kNormIn, int kSplits = 1, class W = Bf16Weights,
          bool kXF16In = false, bool kXF16Out = false, bool kSquares = false>
__device__ __forceinline__ void SkinnyLinearCta(const bf16* x, int ldx, int M,
                                                const typename W::Element* w,
                                                uint32_t w_tile_stride, int N, int K, void* out,
                                                int ldo, int mode, bf16* shadow, float eps,
                                                unsigned long long* argmax = nullptr,
                                                const float* w_scale = nullptr,
                                                const bf16* norm_w = nullptr,
                                                const __half* x_f16 = nullptr,
                                                __half* x_f16_out = nullptr,
                                                const bf16* x_f16_norm_w = nullptr,
                                                const float* x_sumsq = nullptr,
                                                float* x_sumsq_out = nullptr) {
  using S = GemvShape<kRowTiles, kColTiles, W>;
  __shared__ GemvSums<kRowTiles, kColTiles, kSplits, W> sums;
  const int row_block = SkinnyRowBlock<kSplits>();
  // kGemvF32Add: the residual stream's element this thread will add to (SkinnyStore's i = tid),
  // read as soon as the previous kernel is done, where every thread has one element at most
  constexpr bool kPrefetch = S::kRows * S::kCols <= kGemvThreads;
  const int r = threadIdx.x % S::kRows, m = threadIdx.x / S::kRows, n = row_block * S::kRows + r;
  const bool mine = kPrefetch && mode == kGemvF32Add && m < min(M, S::kCols) && n < N;
  const float* at = static_cast<const float*>(out) + static_cast<size_t>(m) * ldo + n;
  float prior = 0.f;
  auto read_residual = [&] {
    if (mine) prior = *at;
  };
  if (!SkinnyAccumulate<kRowTiles, kColTiles, kNormIn, kSplits, W, kXF16In,
                        kSquares && kNormIn>(x, ldx, M, w, w_tile_stride, N, K, eps, sums,
                                             w_scale, norm_w, read_residual, x_f16, x_sumsq))
    return;
  if constexpr (!kXF16Out) x_f16_out = nullptr;
  if constexpr (!kSquares || kNormIn) x_sumsq_out = nullptr;
  if constexpr (kRowTiles == 2) {
    if (mode == kGemvSiluMul)
      return SkinnyStoreSiluMul(sums, row_block, M, N, static_cast<bf16*>(out), ldo, threadIdx.x,
                                blockDim.x, x_f16_out);
  }
  SkinnyStore(sums, row_block, M, N, out, ldo, mode, shadow, argmax, threadIdx.x, blockDim.x,
              mine, prior, x_f16_out, x_f16_norm_w, x_sumsq_out);
}

// --- split K with shared activations: 17 to 32 token rows, added into the residual stream -------
//
// At 17..32 token rows a skinny CTA re-reads all 32 rows of x for each of its 16-row tiles (one
// or two bytes of x from L1 / L2 for every byte of weights), and cuBLAS wins there. Here a CTA's
// kSplitKWarps warps take consecutive 16-row tiles (kSplitKRows weight rows) over the same chunk
// of K, and that chunk of x (kSplitKCols rows) is copied into shared memory once: a quarter of a
// byte of x from L2 per byte of weights, and the MMAs read it from shared memory. K is split
// across CTAs (grid.y, k_chunk columns each) so that the grid fills the GPU, and the chunks'
// sums meet in the output itself: red.global.add into the fp32 residual stream (x += attn Wo^T,
// x += act Wdown^T), so no CTA waits for another. (Measured with the chunks meeting in a
// workspace, the last CTA adding them: its fence and the arrival count cost 16-27% of the
// rate.) The adds' order varies from run to run, so at these row counts the residual stream's
// low bits are not reproducible. The weights are tiled (tile_weights below); each warp streams
// its tile's steps in order, kSplitKUnroll steps a batch, one batch in flight while the other's
// MMAs run, the first two issued before waiting for the previous kernel (it takes part in
// programmatic dependent launch, where cuBLAS's kernels start cold).
//
// Measured on the H200 (bench_decode, Llama-3.1-8B shape, 32 rows at 512 keys, against cuBLAS in
// the same call): o 14.4 -> 11.8 us a layer, down 35.0 -> 33.6, the step 5.61 -> 5.42 ms (5.62 ->
// 5.44 in a later call, with the second batch of weights also issued before the wait: o 11.7,
// down 33.2); 1B's step 1.407 -> 1.325. The projections stream at only 2.8-3.5 TB/s; most of
// the gain is two cold starts a layer. Tried and not kept: the qkv and gate|up projections
// this way (fp32 sums that the RoPE and SiLU kernels read and zero): 2.7 and 3.5 TB/s against
// cuBLAS's 3.1 and 3.95, the step 5.39 -> 5.74 ms; 4 warps a CTA (64 rows, so that
// a CTA fits beside attention's): o and down 378 -> 398 and 1,070 -> 1,140 us a step; a CTA
// looping over several row blocks with one copy of x: down 1,069 -> 1,049 us, the step the same.
// Timed with wrong results, the loop streams 8% faster without x's copy and 3% without the adds.
static constexpr int kSplitKWarps = 8;
static constexpr int kSplitKThreads = kSplitKWarps * kWarpSize;
static constexpr int kSplitKMinCtas = 16 / kSplitKWarps;  // a cap of 128 registers a thread
static constexpr int kSplitKRows = 16 * kSplitKWarps;  // weight rows a CTA
static constexpr int kSplitKCols = 32;                 // token rows at most: 4 column tiles
static constexpr int kSplitKUnroll = 4;                // 32-k steps a batch
static constexpr int kSplitKChunkAlign = 32 * kSplitKUnroll;  // k_chunk: whole batches
static constexpr int kSplitKMaxChunk = 1024;
// x's rows in shared memory are k_chunk + kSplitKPad elements apart: with k_chunk a multiple
// of 64, a row pitch of 64 bytes past a multiple of 128 makes the 8 lanes of each quarter-warp
// (rows g, g + 1, k 8 t .. + 7) hit distinct banks.
static constexpr int kSplitKPad = 32;
static constexpr int kSplitKOutLd = kSplitKRows + 4;  // the epilogue's [token][row] f32 tile

// Dynamic shared memory of SplitKAddLinearCta for a chunk of k_chunk columns: the x slab, which
// the epilogue's output tile reuses.
__host__ __device__ constexpr int SplitKSmemBytes(int k_chunk) {
  return kSplitKCols * (k_chunk + kSplitKPad) * 2 > kSplitKCols * kSplitKOutLd * 4
             ? kSplitKCols * (k_chunk + kSplitKPad) * 2
             : kSplitKCols * kSplitKOutLd * 4;
}

// 16 bytes added to fp32 memory in one reduction (sm_90+; four before).
__device__ __forceinline__ void RedAddF32x4(float* p, const float4& v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(v.x), "f"(v.y),
               "f"(v.z), "f"(v.w)
               : "memory");
#else
  atomicAdd(p, v.x);
  atomicAdd(p + 1, v.y);
  atomicAdd(p + 2, v.z);
  atomicAdd(p + 3, v.w);
#endif
}

// The token rows a split-K or row-block CTA computes: M, or the step's live ones given its
// BatchDesc (written before the graph launches, so read before the wait). None: false, after
// waiting for the previous kernel (an empty step's grid must not complete before it).
__device__ __forceinline__ bool SplitKLiveRows(const BatchDesc* desc, int& M) {
  if (desc != nullptr) M = min(M, desc->num_tokens);
  if (M > 0) return true;
  AwaitPriorKernel();
  return false;
}

// One warp's part of the split-K and row-block kernels: a 16-row tile of tiled weights, streamed
// kSplitKUnroll 32-k steps a batch, against x's rows (kSplitKCols) in a shared-memory slab.
struct SplitKWarpTile {
  using Batch = uint4[kSplitKUnroll][2];
  const bf16* w;
  uint32_t w_lane;  // lane (g, t)'s first element: row g of the tile's first step, k 8 t
  int g, t, warp;
  float acc[kSplitKCols / 8][4];

  // warp w of the CTA takes tile first_tile + w; a warp past N's last tile reads it again (its
  // results are dropped)
  __device__ __forceinline__ SplitKWarpTile(const bf16* weights, int first_tile, int N,
                                            uint32_t tile_stride, int first_step)
      : w(weights) {
    const int lane = threadIdx.x % kWarpSize;
    g = lane / 4, t = lane % 4, warp = threadIdx.x / kWarpSize;
    const int tile = min(first_tile + warp, (N - 1) / 16);
    w_lane = static_cast<uint32_t>(tile) * tile_stride + first_step * 512 + g * 32 + 8 * t;
#pragma unroll
    for (int j = 0; j < kSplitKCols / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  }

  // batch b's weights: rows g and g + 8 (256 elements further) of each of its steps
  __device__ __forceinline__ void load(int b, Batch& wv) const {
#pragma unroll
    for (int u = 0; u < kSplitKUnroll; ++u) {
      const uint32_t o = w_lane + static_cast<uint32_t>(b * kSplitKUnroll + u) * 512;
      wv[u][0] = LoadStreaming16(w + o);
      wv[u][1] = LoadStreaming16(w + o + 256);
    }
  }

  // a batch's MMAs: x rows 8 j + g, k 32 u + 8 t .. + 7 past the slab column k_first (the
  // batch's first step; rows past M are copies of row M - 1)
  __device__ __forceinline__ void mma(const bf16* slab, int pitch, int k_first,
                                      const Batch& wv) {
#pragma unroll
    for (int u = 0; u < kSplitKUnroll; ++u) {
      const int k = k_first + 32 * u + 8 * t;
#pragma unroll
      for (int j = 0; j < kSplitKCols / 8; ++j) {
        const uint4 xv = *reinterpret_cast<const uint4*>(slab + (8 * j + g) * pitch + k);
        MmaBf16Step32(acc[j], wv[u][0], wv[u][1], xv);
      }
    }
  }

  // Until every MMA so far has its operands (in-order issue: their shared-memory reads have
  // returned): the accumulators pass through an empty asm, so no MMA moves below what follows.
  __device__ __forceinline__ void settle() {
#pragma unroll
    for (int j = 0; j < kSplitKCols / 8; ++j)
      asm volatile("" : "+f"(acc[j][0]), "+f"(acc[j][1]), "+f"(acc[j][2]), "+f"(acc[j][3])
                   :: "memory");
  }

  // The rest of the stream, batches 0 and 1 already loaded into even and odd: mma(b, wv) takes
  // batch b, and batch b + 2's loads go out into its registers as soon as its MMAs are in.
  template <class Mma>
  __device__ __forceinline__ void stream(int batches, Batch& even, Batch& odd, Mma&& mma) {
    for (int b = 0; b < batches; b += 2) {
      mma(b, even);
      if (b + 2 < batches) load(b + 2, even);
      if (b + 1 < batches) {
        mma(b + 1, odd);
        if (b + 3 < batches) load(b + 3, odd);
      }
    }
  }

  // The sums into shared memory as [token][row] fp32, kSplitKOutLd a token: accumulator element
  // e of column tile j is weight row 16 warp + g + 8 (e / 2) of the CTA, token 8 j + 2 t + e % 2.
  __device__ __forceinline__ void store(float* tile_out) const {
#pragma unroll
    for (int j = 0; j < kSplitKCols / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        tile_out[(8 * j + 2 * t + e % 2) * kSplitKOutLd + 16 * warp + g + 8 * (e / 2)] =
            acc[j][e];
  }
};

// --- x's rows into shared memory, for a CTA or shared by a cluster's CTAs -----------------------
//
// The split-K and row-block CTAs each need x's kSplitKCols rows, a chunk of columns at a time,
// in a shared-memory slab. kCluster 1: every thread copies 16-byte pieces (cp.async). kCluster >
// 1 (CTAs launched in clusters of kCluster along x, which need the same chunks): the cluster
// reads each chunk from L2 once. CTA rank r copies rows r, r + kCluster, ... (one bulk copy a
// row), multicast into the same slab of every CTA, and each CTA's mbarrier for that slab counts
// the whole slab's bytes. Where x's reads from L2 compete with the weights' for the L2's
// delivery to the SMs, that leaves the weights more of it.

// kCluster > 1: the CTA's `count` slab barriers, set before any CTA of the cluster copies.
template <int kCluster>
__device__ __forceinline__ void InitXSlabs(uint64_t* full, int count) {
  if constexpr (kCluster > 1) {
    if (threadIdx.x == 0)
      for (int i = 0; i < count; ++i) MbarrierInit(&full[i]);
    ClusterRendezvous();
  }
}

// x[m, k0 .. k0 + cols) for m < kSplitKCols (rows past M are row M - 1 again) into slab (row
// pitch `pitch` elements); kCluster > 1: counted on `full` (every CTA of the cluster calls it for
// the same chunk).
template <int kCluster>
__device__ __forceinline__ void CopyXSlab(bf16* slab, int pitch, const bf16* x, int ldx, int M,
                                          int k0, int cols, uint64_t* full) {
  static_assert(kCluster >= 1 && kSplitKCols % kCluster == 0, "whole rows a CTA");
  if constexpr (kCluster > 1) {
    if (threadIdx.x == 0) MbarrierExpectBytes(full, kSplitKCols * cols * 2);
    if (threadIdx.x < kSplitKCols / kCluster) {
      const int m = ClusterRank() + kCluster * threadIdx.x;
      BulkCopyMulticast(slab + m * pitch, x + static_cast<size_t>(min(m, M - 1)) * ldx + k0,
                        cols * 2, full, (1u << kCluster) - 1);
    }
  } else {
    const int pieces = cols / 8;
    for (int i = threadIdx.x; i < kSplitKCols * pieces; i += blockDim.x) {
      const int m = i / pieces, p = i % pieces;
      CpAsync16(slab + m * pitch + 8 * p, x + static_cast<size_t>(min(m, M - 1)) * ldx + k0 + 8 * p,
                16);
    }
    CpAsyncCommit();
  }
}

// Until the slab copied last (kCluster 1; every thread's pieces) or the one `full` counts, phase
// `parity` (kCluster > 1), is in this CTA's shared memory for every thread.
template <int kCluster>
__device__ __forceinline__ void AwaitXSlab(uint64_t* full, uint32_t parity) {
  if constexpr (kCluster > 1) {
    MbarrierWait(full, parity);
  } else {
    CpAsyncWait<0>();
    __syncthreads();
  }
}

// out[m, n] += sum_k x[m, k] W[n, k] for m < M <= kSplitKCols (and m < desc->num_tokens, the
// live rows, when desc is given), n < N, k in this CTA's chunk [blockIdx.y * k_chunk, +
// k_chunk). w: tiled, ceil(N / 16) tiles w_tile_stride elements apart; N % 4 == 0, ldo % 4 ==
// 0 (16-byte adds); k_chunk a multiple of kSplitKChunkAlign, at most kSplitKMaxChunk, dividing
// K; grid (ceil(N / kSplitKRows) rounded up to whole clusters, K / k_chunk), kSplitKThreads
// threads, SplitKSmemBytes(k_chunk) bytes of dynamic shared memory. kCluster > 1: clusters of
// kCluster CTAs along x (the same chunk of K) share x's chunk (CopyXSlab).
template <int kCluster>
__device__ __forceinline__ void SplitKAddLinearCta(const BatchDesc* desc, const bf16* x, int ldx,
                                                   int M, const bf16* w,
                                                   uint32_t w_tile_stride, int N, int K,
                                                   int k_chunk, float* out, int ldo) {
  extern __shared__ __align__(128) unsigned char splitk_smem[];
  __shared__ __align__(8) uint64_t x_full;  // kCluster > 1: the slab's bytes have landed
  if (!SplitKLiveRows(desc, M)) return;  // (the same for every CTA of a cluster)
  InitXSlabs<kCluster>(&x_full, 1);
  bf16* slab = reinterpret_cast<bf16*>(splitk_smem);
  const int pitch = k_chunk + kSplitKPad;
  const int n0 = blockIdx.x * kSplitKRows, k0 = blockIdx.y * k_chunk;
  SplitKWarpTile part(w, n0 / 16, N, w_tile_stride, k0 / 32);
  const int batches = k_chunk / kSplitKChunkAlign;
  SplitKWarpTile::Batch even, odd;
  // the first two batches of weights before waiting for the previous kernel (nothing in this
  // graph writes them): they stream while that kernel ends and while x's chunk is copied
  part.load(0, even);
  if (batches > 1) part.load(1, odd);
  AwaitPriorKernel();
  CopyXSlab<kCluster>(slab, pitch, x, ldx, M, k0, k_chunk, &x_full);
  AwaitXSlab<kCluster>(&x_full, 0);
  part.stream(batches, even, odd, [&](int b, const SplitKWarpTile::Batch& wv) {
    part.mma(slab, pitch, b * kSplitKChunkAlign, wv);
  });
  ReleaseNextKernel();  // every weight is read: the next kernel may take freed SM slots
  // kCluster > 1: no CTA exits while its copies into the others may be in flight (each arrives
  // once its slab has landed)
  if constexpr (kCluster > 1) ClusterArrive();

  // the sums through shared memory as [token][row], then 16-byte adds along the rows
  __syncthreads();  // every warp is done with the slab
  float* tile_out = reinterpret_cast<float*>(splitk_smem);
  part.store(tile_out);
  __syncthreads();
  for (int i = threadIdx.x; i < kSplitKCols * kSplitKRows / 4; i += blockDim.x) {
    const int m = i / (kSplitKRows / 4), r = 4 * (i % (kSplitKRows / 4));
    if (m >= M || n0 + r >= N) continue;
    RedAddF32x4(out + static_cast<size_t>(m) * ldo + n0 + r,
                *reinterpret_cast<const float4*>(tile_out + m * kSplitKOutLd + r));
  }
  if constexpr (kCluster > 1) ClusterWait();
}

// --- whole rows with shared activations: gate|up + SiLU at 17 to 32 token rows -----------------
//
// The split-K kernel's warp-per-tile loop over all of K instead of a chunk: a CTA's 8 warps each
// stream one 16-row tile of the tiled weights (kSplitKRows rows a CTA, 4 gate|up pairs of
// interleave_gate_up's layout), so the CTA holds whole sums and applies SiLU * up itself: no
// partial sums to meet, no [M, 2I] intermediate, no SiLU kernel. x passes through shared memory
// in chunks of up to kRowBlockChunk columns, double-buffered (chunk c + 1 is copied while chunk c's
// MMAs run; a CTA waits only for the first): a quarter of a byte of x from L2 per byte of
// weights, where a skinny CTA at 32 rows reads a byte. Llama-3.1-8B's gate|up is 224 CTAs: one
// wave at two an SM. Measured on the H200 (bench_decode, 8B, 32 rows at 512 keys, against cuBLAS
// and the SiLU kernel in the same call): 1,974 against 1,957 + 72 us a step, the step 5.178 ->
// 5.067 ms. (Round 9 of docs/performance.md: the same weights on the split-K kernel, whose
// partial sums a SiLU kernel must then read and zero, and on skinny CTAs of four row tiles,
// one an SM, were both slower than cuBLAS.)
static constexpr int kRowBlockChunk = 512;
static constexpr int kRowBlockPitch = kRowBlockChunk + kSplitKPad;  // bf16 elements a row
static constexpr int kRowBlockSmemBytes = 2 * kSplitKCols * kRowBlockPitch * 2;
static_assert(kRowBlockSmemBytes >= kSplitKCols * kSplitKOutLd * 4, "the epilogue's tile fits");

// out[m, f] = silu(gate) * up (bf16; gate and up rounded to bf16 first, as stored by a GEMM)
// for m < M <= kSplitKCols (and m < desc->num_tokens when desc is given) and features f < N /
// 2, with w: gate|up interleaved in 16-row groups, tiled, ceil(N / 16) tiles w_tile_stride
// elements apart; N % 32 == 0; k_chunk (x's columns a slab) a multiple of kSplitKChunkAlign, at
// most kRowBlockChunk, dividing K; grid ceil(N / kSplitKRows) rounded up to whole clusters,
// kSplitKThreads threads, kRowBlockSmemBytes of dynamic shared memory.
//
// kCluster > 1 (clusters of kCluster CTAs along x): the cluster's CTAs share each chunk of x
// (CopyXSlab), and a slab is refilled only once every CTA of the cluster is done with it (a
// cluster rendezvous a chunk, where kCluster 1 has the CTA's barrier). At kCluster 1 the CTAs
// read a quarter of a byte of x from L2 a byte of weights, at 2 an eighth.
template <int kCluster>
__device__ __forceinline__ void RowBlockSiluMulCta(const BatchDesc* desc, const bf16* x, int ldx,
                                                   int M, const bf16* w,
                                                   uint32_t w_tile_stride, int N, int K,
                                                   int k_chunk, bf16* out, int ldo) {
  extern __shared__ __align__(128) unsigned char rowblock_smem[];
  __shared__ __align__(8) uint64_t slab_full[2];  // kCluster > 1: a slab's bytes have landed
  if (!SplitKLiveRows(desc, M)) return;  // (the same for every CTA of a cluster)
  InitXSlabs<kCluster>(slab_full, 2);
  bf16* slabs = reinterpret_cast<bf16*>(rowblock_smem);  // [2][kSplitKCols][kRowBlockPitch]
  SplitKWarpTile part(w, blockIdx.x * kSplitKWarps, N, w_tile_stride, 0);
  // x's chunk c into slab c % 2
  auto copy_chunk = [&](int c) {
    CopyXSlab<kCluster>(slabs + (c & 1) * kSplitKCols * kRowBlockPitch, kRowBlockPitch, x, ldx,
                        M, c * k_chunk, k_chunk, &slab_full[c & 1]);
  };
  const int batches = K / kSplitKChunkAlign, chunks = K / k_chunk;
  const int chunk_batches = k_chunk / kSplitKChunkAlign;
  int chunk = 0, in_chunk = 0;  // where the next batch lies: its chunk, its batch in that chunk
  // at a chunk's first batch, first: every warp (of the cluster) is done with the other slab,
  // which takes the next chunk, and this chunk's copy has landed
  auto mma_batch = [&](int, const SplitKWarpTile::Batch& wv) {
    if (in_chunk == 0) {
      if constexpr (kCluster > 1) {
        part.settle();  // this warp's reads of the slab the next chunk takes have returned
        ClusterRendezvous();
        if (chunk + 1 < chunks) copy_chunk(chunk + 1);
        AwaitXSlab<kCluster>(&slab_full[chunk & 1], (chunk >> 1) & 1);
      } else {
        AwaitXSlab<kCluster>(nullptr, 0);
        if (chunk + 1 < chunks) copy_chunk(chunk + 1);
      }
    }
    part.mma(slabs + (chunk & 1) * kSplitKCols * kRowBlockPitch, kRowBlockPitch,
             in_chunk * kSplitKChunkAlign, wv);
    if (++in_chunk == chunk_batches) {
      in_chunk = 0;
      ++chunk;
    }
  };

  SplitKWarpTile::Batch even, odd;
  // the first two batches of weights before waiting for the previous kernel
  part.load(0, even);
  if (batches > 1) part.load(1, odd);
  AwaitPriorKernel();
  copy_chunk(0);
  part.stream(batches, even, odd, mma_batch);
  ReleaseNextKernel();  // every weight is read: the next kernel may take freed SM slots
  // kCluster > 1: no CTA exits while its copies into the others may be in flight (each arrives
  // once its last chunk has landed)
  if constexpr (kCluster > 1) ClusterArrive();

  __syncthreads();  // every warp is done with the slabs (and every copy into them has landed)
  float* tile_out = reinterpret_cast<float*>(rowblock_smem);
  part.store(tile_out);  // [token][row]
  __syncthreads();
  // the CTA's rows 32 p .. + 15 are the gate of features f0 + 16 p .. + 15, the next 16 their up
  constexpr int kFeatures = kSplitKRows / 2;
  const int f0 = blockIdx.x * kFeatures;
  for (int i = threadIdx.x; i < kFeatures * M; i += blockDim.x) {
    const int f = i % kFeatures, m = i / kFeatures, r = 32 * (f / 16) + f % 16;
    if (f0 + f >= N / 2) continue;
    const float gate = __bfloat162float(__float2bfloat16(tile_out[m * kSplitKOutLd + r]));
    const float up = __bfloat162float(__float2bfloat16(tile_out[m * kSplitKOutLd + r + 16]));
    out[static_cast<size_t>(m) * ldo + f0 + f] = __float2bfloat16(gate / (1.f + expf(-gate)) * up);
  }
  if constexpr (kCluster > 1) ClusterWait();
}

// W [N, K] row-major -> tiled (the layout above), one 16-byte piece (kPieceK = 16 / sizeof(T)
// k: 8 of bf16, 16 of E4M3 codes) a thread: piece i of the tiled copy is tile i / (tile_stride
// / kPieceK), and within its tile (j = i % (tile_stride / kPieceK)) step j / 64, row (j % 64) /
// 4, k 4 kPieceK (j / 64) + kPieceK (j % 4); j >= 16 K / kPieceK is the tile's pad. Rows past N
// (the last tile's padding) and the pads are zeros. tiled: ceil(N / 16) * tile_stride
// elements; tile_stride >= 16 K, a multiple of kPieceK.
template <typename T = bf16>
__device__ __forceinline__ void TileWeightsThread(const T* w, T* tiled, int N, int K,
                                                  uint32_t tile_stride, size_t piece) {
  constexpr int kPieceK = 16 / sizeof(T);
  const size_t tile = piece / (tile_stride / kPieceK);
  const int within = static_cast<int>(piece % (tile_stride / kPieceK));
  const int step = within / 64, row = within % 64 / 4;
  const int k = 4 * kPieceK * step + kPieceK * (within % 4);
  const size_t n = 16 * tile + row;
  uint4 v = make_uint4(0, 0, 0, 0);
  if (within < 16 * K / kPieceK && n < static_cast<size_t>(N))
    v = *reinterpret_cast<const uint4*>(w + n * K + k);
  reinterpret_cast<uint4*>(tiled)[piece] = v;
}

}  // namespace blink
