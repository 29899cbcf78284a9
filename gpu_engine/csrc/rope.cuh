// Post-projection attention prologue, fused: q/k/v bias (Qwen2), per-head q/k RMSNorm (Qwen3),
// RoPE on q and k (HF rotate-half convention, precomputed inv_freq so llama3 scaling comes free),
// q to its buffer, k and v into the paged KV cache. Two forms: a kernel over the projection's
// bf16 output (RopeKvWriteCta), and the qkv projection's own epilogue (SkinnyStoreQkvRope).
//
// The RoPE pair layout: within each q and k head, the projection's rows are stored so that every
// 16-row tile holds 8 whole pairs: pair j (dimensions j and j + head_dim / 2) sits at rows
// RopePairRow(j) and RopePairRow(j) + 8. The skinny projection's CTA then owns both halves of
// each pair it computes and can rotate them itself. gpu_engine/cuda_forward.py
// rope_pair_order permutes the checkpoint's rows (and biases) so when it uploads them; v heads
// keep their order.
//
// Keys and values go into the cache as its element type (kv_cache.cuh: bf16, or E4M3 times the
// head's inverse scale, Kv = KvFp8); with kv_amax given (the FP8 cache's calibration pass) each
// head's largest |value| is noted too.
#pragma once
#include "batch.cuh"
#include "gemv.cuh"
#include "kv_cache.cuh"
#include "norm.cuh"
#include "utils.cuh"

namespace blink {

static constexpr int kRopeThreads = 128;

__host__ __device__ constexpr int RopePairRow(int j) { return 16 * (j / 8) + j % 8; }

// Element offset of (block, row, kv head 0, dim 0) in a layer's KV cache for token t of the
// batch, or -1 when its block is not in the table or outside [0, num_blocks) (then nothing is
// written for it).
__device__ __forceinline__ long long KvCacheOffset(const int32_t* positions,
                                                   const int32_t* token_seq,
                                                   const int32_t* block_tables,
                                                   int max_blocks_per_seq, int block_size,
                                                   int num_blocks, int num_kv_heads,
                                                   int head_dim, int t) {
  const int pos = positions[t];
  const int logical_block = pos / block_size;
  if (pos < 0 || logical_block >= max_blocks_per_seq) return -1;
  const int block =
      block_tables[static_cast<size_t>(token_seq[t]) * max_blocks_per_seq + logical_block];
  if (block < 0 || block >= num_blocks) return -1;
  return (static_cast<long long>(block) * block_size + pos % block_size) * num_kv_heads *
         head_dim;
}

// x * cos + rotate_half(x) * sin for one pair, rotate_half(x) = [-x_hi, x_lo], stored (a
// cache's E4M3 times `inverse`: StoreKv); returns the larger |value| stored.
template <typename T>
__device__ __forceinline__ float RotatePair(float lo, float hi, float c, float s, T* dst_lo,
                                            T* dst_hi, float inverse = 1.f) {
  const float rotated_lo = lo * c - hi * s, rotated_hi = hi * c + lo * s;
  StoreKv(dst_lo, rotated_lo, inverse);
  StoreKv(dst_hi, rotated_hi, inverse);
  return fmaxf(fabsf(rotated_lo), fabsf(rotated_hi));
}

// Grid (bucket, head groups): CTA (t, y) handles token t < num_tokens, and its warps take heads
// y * warps + warp, stepping by gridDim.y * warps, over the num_heads + 2 * num_kv_heads heads
// (one head per warp when gridDim.y = ceil(heads / warps): a decode step's few tokens then
// spread over many SMs instead of one CTA each).
// qkv: [bucket, (num_heads + 2 num_kv_heads) * D] bf16 (the fused projection's output, q|k|v);
// qkv_bias: same width or null; q_norm, k_norm: [D] or null (both or neither);
// inv_freq: [D/2] f32; q_out: [bucket, num_heads, D] bf16;
// k_cache, v_cache: this layer's [num_blocks, block_size, num_kv_heads, D] of Kv::Element;
// kv_scales: the layer's [2][num_kv_heads] (FP8 cache), kv_amax: as those, or null.
// Position p of the token's sequence s lives in block block_tables[s][p / block_size], row
// p % block_size; a block id outside [0, num_blocks) is not written.
template <int kHeadDim, class Kv = KvBf16>
__device__ __forceinline__ void RopeKvWriteCta(
    const BatchDesc* desc, const int32_t* positions, const int32_t* token_seq,
    const int32_t* block_tables, int max_blocks_per_seq, const bf16* qkv, const bf16* qkv_bias,
    const bf16* q_norm, const bf16* k_norm, float eps, const float* inv_freq, int num_heads,
    int num_kv_heads, bf16* q_out, typename Kv::Element* k_cache,
    typename Kv::Element* v_cache, int block_size, int num_blocks,
    const float* kv_scales = nullptr, float* kv_amax = nullptr) {
  static_assert(kHeadDim % 2 == 0, "RoPE pairs dimension j with j + head_dim / 2");
  constexpr int kHalf = kHeadDim / 2;
  constexpr int kPairs = (kHalf + kWarpSize - 1) / kWarpSize;
  __shared__ float cos_s[kHalf], sin_s[kHalf];

  const int t = blockIdx.x;
  if (t >= desc->num_tokens) return;
  const int pos = positions[t];
  for (int j = threadIdx.x; j < kHalf; j += blockDim.x) {
    // The angle in fp32 exactly as transformers forms it (position * inv_freq), then sincos.
    sincosf(static_cast<float>(pos) * inv_freq[j], &sin_s[j], &cos_s[j]);
  }
  __syncthreads();

  const long long slot = KvCacheOffset(positions, token_seq, block_tables, max_blocks_per_seq,
                                       block_size, num_blocks, num_kv_heads, kHeadDim, t);
  const bool write_kv = slot >= 0;

  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  const int total_heads = num_heads + 2 * num_kv_heads;
  const bf16* row = qkv + static_cast<size_t>(t) * total_heads * kHeadDim;

  for (int h = blockIdx.y * num_warps + warp; h < total_heads; h += gridDim.y * num_warps) {
    const int base = h * kHeadDim;
    const bool is_q = h < num_heads;
    const bool is_k = !is_q && h < num_heads + num_kv_heads;
    float lo[kPairs], hi[kPairs];
#pragma unroll
    for (int i = 0; i < kPairs; ++i) {
      const int j = lane + kWarpSize * i;
      lo[i] = hi[i] = 0.f;
      if (j < kHalf) {
        // q and k rows are in the RoPE pair layout, v rows in their own order
        const int r_lo = base + (is_q || is_k ? RopePairRow(j) : j);
        const int r_hi = r_lo + (is_q || is_k ? 8 : kHalf);
        lo[i] = __bfloat162float(row[r_lo]);
        hi[i] = __bfloat162float(row[r_hi]);
        if (qkv_bias != nullptr) {
          lo[i] += __bfloat162float(qkv_bias[r_lo]);
          hi[i] += __bfloat162float(qkv_bias[r_hi]);
        }
      }
    }
    if (!is_q && !is_k) {  // v: bias only
      if (write_kv) {
        const int kv_head = h - num_heads - num_kv_heads;
        const float inverse = KvInverseScale<Kv>(kv_scales, num_kv_heads, 1, kv_head);
        typename Kv::Element* dst = v_cache + slot + static_cast<size_t>(kv_head) * kHeadDim;
        float amax = 0.f;
#pragma unroll
        for (int i = 0; i < kPairs; ++i) {
          const int j = lane + kWarpSize * i;
          if (j < kHalf) {
            StoreKv(dst + j, lo[i], inverse);
            StoreKv(dst + j + kHalf, hi[i], inverse);
            amax = fmaxf(amax, fmaxf(fabsf(lo[i]), fabsf(hi[i])));
          }
        }
        if constexpr (Kv::kFp8) {
          amax = WarpMax(amax);
          if (lane == 0) NoteKvAmax(kv_amax, num_kv_heads, 1, kv_head, amax);
        }
      }
      continue;
    }
    if (q_norm != nullptr) HeadRmsNormWarp(lo, hi, is_q ? q_norm : k_norm, kHeadDim, eps);
    if (is_q) {
      bf16* dst = q_out + (static_cast<size_t>(t) * num_heads + h) * kHeadDim;
#pragma unroll
      for (int i = 0; i < kPairs; ++i) {
        const int j = lane + kWarpSize * i;
        if (j < kHalf) RotatePair(lo[i], hi[i], cos_s[j], sin_s[j], dst + j, dst + j + kHalf);
      }
      continue;
    }
    if (!write_kv) continue;
    const int kv_head = h - num_heads;
    const float inverse = KvInverseScale<Kv>(kv_scales, num_kv_heads, 0, kv_head);
    typename Kv::Element* dst = k_cache + slot + static_cast<size_t>(kv_head) * kHeadDim;
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < kPairs; ++i) {
      const int j = lane + kWarpSize * i;
      if (j < kHalf) {
        amax = fmaxf(amax, RotatePair(lo[i], hi[i], cos_s[j], sin_s[j], dst + j, dst + j + kHalf,
                                      inverse));
      }
    }
    if constexpr (Kv::kFp8) {
      amax = WarpMax(amax);
      if (lane == 0) NoteKvAmax(kv_amax, num_kv_heads, 0, kv_head, amax);
    }
  }
}

// The qkv projection's epilogue: the CTA's row tiles (16 rows each, inside one head since
// head_dim % 16 == 0) of the q|k|v output [M, (num_heads + 2 num_kv_heads) * kHeadDim], q and k
// in the RoPE pair layout, written as RopeKvWriteCta writes them (same rounding: each projection
// output is rounded to bf16 first, as when it is stored; bias added; rotated in fp32): q rows to
// q_out, k and v rows of tokens t < num_tokens into the paged cache (Kv::Element; kv_scales,
// kv_amax as RopeKvWriteCta takes them). qkv_bias is in the same row order as w (nullable). No
// per-head q/k norm (Qwen3 takes the kernel path).
template <int kHeadDim, class Kv, int kRowTiles, int kColTiles, int kSplits, class W>
__device__ __forceinline__ void SkinnyStoreQkvRope(
    const GemvSums<kRowTiles, kColTiles, kSplits, W>& sums, int M, const BatchDesc* desc,
    const int32_t* positions, const int32_t* token_seq, const int32_t* block_tables,
    int max_blocks_per_seq, const bf16* qkv_bias, const float* inv_freq, int num_heads,
    int num_kv_heads, bf16* q_out, typename Kv::Element* k_cache,
    typename Kv::Element* v_cache, int block_size, int num_blocks, const float* kv_scales,
    float* kv_amax) {
  static_assert(kHeadDim % 16 == 0, "a 16-row tile must lie inside one head");
  constexpr int kHalf = kHeadDim / 2;
  const int cols = min(min(M, desc->num_tokens), GemvShape<kRowTiles, kColTiles, W>::kCols);
  const int total_rows = (num_heads + 2 * num_kv_heads) * kHeadDim;
  auto value = [&](int r, int n, int m) {
    const float v = __bfloat162float(__float2bfloat16(sums.total(r, m)));
    return qkv_bias != nullptr ? v + __bfloat162float(qkv_bias[n]) : v;
  };
  // Work items: (row tile a, token m, 8 pairs or 16 v rows); a thread takes one row pair.
  for (int i = threadIdx.x; i < kRowTiles * cols * 8; i += blockDim.x) {
    const int p = i % 8, m = (i / 8) % cols, a = i / (8 * cols);
    const int tile = SkinnyRowBlock<kSplits>() * kRowTiles + a;  // rows 16 tile ..: one head's
    const int r = 16 * a + p, n = 16 * tile + p;   // tile rows p and p + 8: n and n + 8
    if (n >= total_rows) continue;
    const int head = n / kHeadDim, within = n % kHeadDim;
    const long long slot = KvCacheOffset(positions, token_seq, block_tables, max_blocks_per_seq,
                                         block_size, num_blocks, num_kv_heads, kHeadDim, m);
    if (head >= num_heads + num_kv_heads) {  // v: rows n and n + 8, bias only
      if (slot < 0) continue;
      const int kv_head = head - num_heads - num_kv_heads;
      const float inverse = KvInverseScale<Kv>(kv_scales, num_kv_heads, 1, kv_head);
      typename Kv::Element* dst = v_cache + slot + static_cast<size_t>(kv_head) * kHeadDim;
      const float v_lo = value(r, n, m), v_hi = value(r + 8, n + 8, m);
      StoreKv(dst + within, v_lo, inverse);
      StoreKv(dst + within + 8, v_hi, inverse);
      if constexpr (Kv::kFp8)
        NoteKvAmax(kv_amax, num_kv_heads, 1, kv_head, fmaxf(fabsf(v_lo), fabsf(v_hi)));
      continue;
    }
    const int j = (within - p) / 2 + p;  // the tile starts at row 16 t': pair 8 t'
    float sn, cs;
    // the angle in fp32 exactly as transformers forms it (position * inv_freq), then sincos
    sincosf(static_cast<float>(positions[m]) * inv_freq[j], &sn, &cs);
    const float lo = value(r, n, m), hi = value(r + 8, n + 8, m);
    if (head < num_heads) {
      bf16* dst = q_out + (static_cast<size_t>(m) * num_heads + head) * kHeadDim;
      RotatePair(lo, hi, cs, sn, dst + j, dst + j + kHalf);
      continue;
    }
    if (slot < 0) continue;
    const int kv_head = head - num_heads;
    const float inverse = KvInverseScale<Kv>(kv_scales, num_kv_heads, 0, kv_head);
    typename Kv::Element* dst = k_cache + slot + static_cast<size_t>(kv_head) * kHeadDim;
    const float amax = RotatePair(lo, hi, cs, sn, dst + j, dst + j + kHalf, inverse);
    if constexpr (Kv::kFp8) NoteKvAmax(kv_amax, num_kv_heads, 0, kv_head, amax);
  }
}

// The qkv projection with RoPE + KV write as its epilogue (SkinnyAccumulate, then
// SkinnyStoreQkvRope). kNormIn: x is the residual stream's bf16 shadow and the input RMSNorm is
// folded in (decode buckets of up to 16 rows); else x is the RMSNorm's output (17 to 32 rows,
// where the residual-adding projections are split-K ones and write no shadow). kSplits > 1: K
// split across clusters of kSplits CTAs along x (SkinnyAccumulate). FP8 weights (W =
// Fp8Weights): w_scale and norm_w as SkinnyAccumulate takes them, and with kXF16 x's f16 form
// (x_f16); kSquares: x's sums of squares in parts too (x_sumsq, SkinnyAccumulate's
// kSquaresGiven).
template <int kHeadDim, int kRowTiles, int kColTiles, bool kNormIn, int kSplits = 1,
          class Kv = KvBf16, class W = Bf16Weights, bool kXF16 = false, bool kSquares = false>
__device__ __forceinline__ void SkinnyQkvRopeCta(
    const bf16* x, int ldx, int M, const typename W::Element* w, uint32_t w_tile_stride, int N,
    int K, float eps, const BatchDesc* desc, const int32_t* positions, const int32_t* token_seq,
    const int32_t* block_tables, int max_blocks_per_seq, const bf16* qkv_bias,
    const float* inv_freq, int num_heads, int num_kv_heads, bf16* q_out,
    typename Kv::Element* k_cache, typename Kv::Element* v_cache, int block_size,
    int num_blocks, const float* kv_scales = nullptr, float* kv_amax = nullptr,
    const float* w_scale = nullptr, const bf16* norm_w = nullptr,
    const __half* x_f16 = nullptr, const float* x_sumsq = nullptr) {
  __shared__ GemvSums<kRowTiles, kColTiles, kSplits, W> sums;
  if (!SkinnyAccumulate<kRowTiles, kColTiles, kNormIn, kSplits, W, kXF16, kSquares>(
          x, ldx, M, w, w_tile_stride, N, K, eps, sums, w_scale, norm_w, NoLoadsAfterWait{},
          x_f16, x_sumsq))
    return;
  SkinnyStoreQkvRope<kHeadDim, Kv>(sums, M, desc, positions, token_seq, block_tables,
                                   max_blocks_per_seq, qkv_bias, inv_freq, num_heads,
                                   num_kv_heads, q_out, k_cache, v_cache, block_size,
                                   num_blocks, kv_scales, kv_amax);
}

}  // namespace blink
