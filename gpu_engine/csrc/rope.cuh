// Post-projection attention prologue, fused: q/k/v bias (Qwen2), per-head q/k RMSNorm (Qwen3),
// RoPE on q and k (HF rotate-half convention, precomputed inv_freq so llama3 scaling comes free),
// q to its buffer, k and v into the paged KV cache.
#pragma once
#include "batch.cuh"
#include "norm.cuh"
#include "utils.cuh"

namespace blink {

static constexpr int kRopeThreads = 128;

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

  const int logical_block = pos / block_size;
  const int block = (pos >= 0 && logical_block < max_blocks_per_seq)
                        ? block_tables[static_cast<size_t>(token_seq[t]) * max_blocks_per_seq +
                                       logical_block]
                        : -1;
  const bool write_kv = block >= 0 && block < num_blocks;
  // Element offset of (block, row, kv head 0, dim 0) in the cache.
  const size_t slot =
      (static_cast<size_t>(block) * block_size + pos % block_size) * num_kv_heads * kHeadDim;

  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  const int total_heads = num_heads + 2 * num_kv_heads;
  const bf16* row = qkv + static_cast<size_t>(t) * total_heads * kHeadDim;

  for (int h = blockIdx.y * num_warps + warp; h < total_heads; h += gridDim.y * num_warps) {
    const int base = h * kHeadDim;
    float lo[kPairs], hi[kPairs];
#pragma unroll
    for (int i = 0; i < kPairs; ++i) {
      const int j = lane + kWarpSize * i;
      lo[i] = hi[i] = 0.f;
      if (j < kHalf) {
        lo[i] = __bfloat162float(row[base + j]);
        hi[i] = __bfloat162float(row[base + j + kHalf]);
        if (qkv_bias != nullptr) {
          lo[i] += __bfloat162float(qkv_bias[base + j]);
          hi[i] += __bfloat162float(qkv_bias[base + j + kHalf]);
        }
      }
    }
    const bool is_q = h < num_heads;
    const bool is_k = !is_q && h < num_heads + num_kv_heads;
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
      if (j < kHalf) {
        // x * cos + rotate_half(x) * sin, rotate_half(x) = [-x_hi, x_lo]
        const float c = cos_s[j], s = sin_s[j];
        dst[j] = __float2bfloat16(lo[i] * c - hi[i] * s);
        dst[j + kHalf] = __float2bfloat16(hi[i] * c + lo[i] * s);
      }
    }
  }
}

}  // namespace blink
