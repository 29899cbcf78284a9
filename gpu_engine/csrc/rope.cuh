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
#pragma once
#include "batch.cuh"
#include "gemv.cuh"
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

// x * cos + rotate_half(x) * sin for one pair, rotate_half(x) = [-x_hi, x_lo].
__device__ __forceinline__ void RotatePair(float lo, float hi, float c, float s, bf16* dst_lo,
                                           bf16* dst_hi) {
  *dst_lo = __float2bfloat16(lo * c - hi * s);
  *dst_hi = __float2bfloat16(hi * c + lo * s);
}

// Grid (bucket, head groups): CTA (t, y) handles token t < num_tokens, and its warps take heads
// y * warps + warp, stepping by gridDim.y * warps, over the num_heads + 2 * num_kv_heads heads
// (one head per warp when gridDim.y = ceil(heads / warps): a decode step's few tokens then
// spread over many SMs instead of one CTA each).
// qkv: [bucket, (num_heads + 2 num_kv_heads) * D] bf16 (the fused projection's output, q|k|v);
// qkv_bias: same width or null; q_norm, k_norm: [D] or null (both or neither);
// inv_freq: [D/2] f32; q_out: [bucket, num_heads, D] bf16;
// k_cache, v_cache: this layer's [num_blocks, block_size, num_kv_heads, D] bf16.
// Position p of the token's sequence s lives in block block_tables[s][p / block_size], row
// p % block_size; a block id outside [0, num_blocks) is not written.
template <int kHeadDim>
__device__ __forceinline__ void RopeKvWriteCta(
    const BatchDesc* desc, const int32_t* positions, const int32_t* token_seq,
    const int32_t* block_tables, int max_blocks_per_seq, const bf16* qkv, const bf16* qkv_bias,
    const bf16* q_norm, const bf16* k_norm, float eps, const float* inv_freq, int num_heads,
    int num_kv_heads, bf16* q_out, bf16* k_cache, bf16* v_cache, int block_size,
    int num_blocks) {
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
        bf16* dst = v_cache + slot + static_cast<size_t>(h - num_heads - num_kv_heads) * kHeadDim;
#pragma unroll
        for (int i = 0; i < kPairs; ++i) {
          const int j = lane + kWarpSize * i;
          if (j < kHalf) {
            dst[j] = __float2bfloat16(lo[i]);
            dst[j + kHalf] = __float2bfloat16(hi[i]);
          }
        }
      }
      continue;
    }
    if (q_norm != nullptr) HeadRmsNormWarp(lo, hi, is_q ? q_norm : k_norm, kHeadDim, eps);
    bf16* dst = is_q ? q_out + (static_cast<size_t>(t) * num_heads + h) * kHeadDim
                     : k_cache + slot + static_cast<size_t>(h - num_heads) * kHeadDim;
    if (!is_q && !write_kv) continue;
#pragma unroll
    for (int i = 0; i < kPairs; ++i) {
      const int j = lane + kWarpSize * i;
      if (j < kHalf) RotatePair(lo[i], hi[i], cos_s[j], sin_s[j], dst + j, dst + j + kHalf);
    }
  }
}

// The qkv projection's epilogue: the CTA's row tiles (16 rows each, inside one head since
// head_dim % 16 == 0) of the q|k|v output [M, (num_heads + 2 num_kv_heads) * kHeadDim], q and k
// in the RoPE pair layout, written as RopeKvWriteCta writes them (same rounding: each projection
// output is rounded to bf16 first, as when it is stored; bias added; rotated in fp32): q rows to
// q_out, k and v rows of tokens t < num_tokens into the paged cache. qkv_bias is in the same row
// order as w (nullable). No per-head q/k norm (Qwen3 takes the kernel path).
template <int kHeadDim, int kRowTiles, int kColTiles, int kSplits>
__device__ __forceinline__ void SkinnyStoreQkvRope(
    const GemvSums<kRowTiles, kColTiles, kSplits>& sums, int M, const BatchDesc* desc,
    const int32_t* positions, const int32_t* token_seq, const int32_t* block_tables,
    int max_blocks_per_seq, const bf16* qkv_bias, const float* inv_freq, int num_heads,
    int num_kv_heads, bf16* q_out, bf16* k_cache, bf16* v_cache, int block_size,
    int num_blocks) {
  static_assert(kHeadDim % 16 == 0, "a 16-row tile must lie inside one head");
  constexpr int kHalf = kHeadDim / 2;
  const int cols = min(min(M, desc->num_tokens), GemvShape<kRowTiles, kColTiles>::kCols);
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
      bf16* dst = v_cache + slot + static_cast<size_t>(head - num_heads - num_kv_heads) * kHeadDim;
      dst[within] = __float2bfloat16(value(r, n, m));
      dst[within + 8] = __float2bfloat16(value(r + 8, n + 8, m));
      continue;
    }
    const int j = (within - p) / 2 + p;  // the tile starts at row 16 t': pair 8 t'
    float sn, cs;
    // the angle in fp32 exactly as transformers forms it (position * inv_freq), then sincos
    sincosf(static_cast<float>(positions[m]) * inv_freq[j], &sn, &cs);
    const float lo = value(r, n, m), hi = value(r + 8, n + 8, m);
    bf16* dst;
    if (head < num_heads) {
      dst = q_out + (static_cast<size_t>(m) * num_heads + head) * kHeadDim;
    } else {
      if (slot < 0) continue;
      dst = k_cache + slot + static_cast<size_t>(head - num_heads) * kHeadDim;
    }
    RotatePair(lo, hi, cs, sn, dst + j, dst + j + kHalf);
  }
}

// The qkv projection with RoPE + KV write as its epilogue (SkinnyAccumulate, then
// SkinnyStoreQkvRope). kNormIn: x is the residual stream's bf16 shadow and the input RMSNorm is
// folded in (decode buckets of up to 16 rows); else x is the RMSNorm's output (17 to 32 rows,
// where the residual-adding projections are split-K ones and write no shadow). kSplits > 1: K
// split across clusters of kSplits CTAs along x (SkinnyAccumulate).
template <int kHeadDim, int kRowTiles, int kColTiles, bool kNormIn, int kSplits = 1>
__device__ __forceinline__ void SkinnyQkvRopeCta(
    const bf16* x, int ldx, int M, const bf16* w, uint32_t w_tile_stride, int N, int K,
    float eps, const BatchDesc* desc, const int32_t* positions, const int32_t* token_seq,
    const int32_t* block_tables, int max_blocks_per_seq, const bf16* qkv_bias,
    const float* inv_freq, int num_heads, int num_kv_heads, bf16* q_out, bf16* k_cache,
    bf16* v_cache, int block_size, int num_blocks) {
  __shared__ GemvSums<kRowTiles, kColTiles, kSplits> sums;
  if (!SkinnyAccumulate<kRowTiles, kColTiles, kNormIn, kSplits>(x, ldx, M, w, w_tile_stride, N,
                                                                K, eps, sums))
    return;
  SkinnyStoreQkvRope<kHeadDim>(sums, M, desc, positions, token_seq, block_tables,
                               max_blocks_per_seq, qkv_bias, inv_freq, num_heads, num_kv_heads,
                               q_out, k_cache, v_cache, block_size, num_blocks);
}

}  // namespace blink
