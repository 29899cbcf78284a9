// Paged causal attention for a flat batch mixing prefill chunks and decode tokens, with GQA.
//
// Work split (fixed grid, live batch): the grid is (bucket, num_kv_heads). Each sequence's run of
// tokens is cut into tiles at positions that are multiples of rows-per-CTA / group;
// the CTA whose token starts a tile (the first token of its sequence's run, or one at a tile
// boundary) computes the whole tile for one kv head; the other CTAs exit at once. A tile's query
// rows are (token, head of the group) pairs, row = token_offset * group + g, so every key and value
// tile loaded into shared memory serves all of them. The keys 0 .. last position of the tile are
// streamed in tiles of kAttnKeys through shared memory; S = Q K^T and O += P V run on tensor cores
// (WMMA, bf16 in, fp32 accumulate); the softmax is online in fp32 with the running max and sum per
// row (exp2 with log2(e) folded into the scale). Each query attends to cache positions 0..its own
// position, all of which the RoPE/KV-write kernel wrote earlier in the same graph.
//
// Split keys (flash-decoding) for small buckets, where (tiles x kv heads) alone would leave most
// SMs idle: grid.z = num_splits CTAs share one tile, split z taking a kAttnKeys-aligned slice of
// its keys and writing its unnormalized output and (max, sum) per row to a workspace, which
// AttentionCombineCta merges. num_splits == 1 writes the normalized output directly.
#pragma once
#include <mma.h>

#include "batch.cuh"
#include "utils.cuh"

namespace blink {

// Query rows (tokens x group heads) per CTA: 64 for prefill-sized buckets; 16 for decode-sized
// ones, where a tile rarely has more rows and the smaller footprint fits 4 CTAs per SM.
static constexpr int kAttnRows = 64;
static constexpr int kAttnRowsSmall = 16;
static constexpr int kAttnKeys = 64;     // keys per shared-memory tile
static constexpr int kAttnThreads = 128;
static constexpr int kAttnWarps = kAttnThreads / kWarpSize;

// Shared-memory layout, rows padded against bank conflicts; every region and every 16x16 WMMA
// tile pointer stays 32-byte aligned (WMMA needs 256-bit aligned pointers).
template <int kHeadDim, int kRows>
struct AttentionSmem {
  static_assert(kHeadDim % 16 == 0 && kHeadDim >= 16 && kHeadDim <= 256,
                "head_dim must be a multiple of 16 in [16, 256]");
  static constexpr int kLdQ = kHeadDim + 8;    // bf16 Q, K, V rows
  static constexpr int kLdS = kAttnKeys + 4;   // f32 scores
  static constexpr int kLdP = kAttnKeys + 8;   // bf16 probabilities
  static constexpr int kLdO = kHeadDim + 4;    // f32 output accumulator
  static constexpr size_t kQ = 0;
  static constexpr size_t kK = kQ + sizeof(bf16) * kRows * kLdQ;
  static constexpr size_t kV = kK + sizeof(bf16) * kAttnKeys * kLdQ;
  static constexpr size_t kS = kV + sizeof(bf16) * kAttnKeys * kLdQ;
  static constexpr size_t kP = kS + sizeof(float) * kRows * kLdS;
  static constexpr size_t kO = kP + sizeof(bf16) * kRows * kLdP;
  static constexpr size_t kMax = kO + sizeof(float) * kRows * kLdO;  // running max per row
  static constexpr size_t kSum = kMax + sizeof(float) * kRows;       // running sum per row
  static constexpr size_t kPos = kSum + sizeof(float) * kRows;       // position per row
  static constexpr size_t kBytes = kPos + sizeof(int) * kRows;
  static_assert(kK % 32 == 0 && kV % 32 == 0 && kS % 32 == 0 && kP % 32 == 0 && kO % 32 == 0,
                "WMMA regions must be 32-byte aligned");
};

// q: [bucket, num_heads, D] bf16 (after RoPE); k_cache, v_cache: this layer's
// [num_blocks, block_size, num_kv_heads, D] bf16; out: [bucket, num_heads, D] bf16.
// Needs AttentionSmem<D, kRows>::kBytes of dynamic shared memory and kAttnThreads threads;
// num_heads / num_kv_heads <= kRows (checked by the host). The next key tile is fetched into
// registers while the current one is computed on. With num_splits > 1:
// partial_out: [bucket, num_heads, num_splits, D] f32, partial_stats: [.., num_splits, 2] f32
// (running max in log2 units, sum), combined into `out` by AttentionCombineCta.
template <int kHeadDim, int kRows>
__device__ __forceinline__ void PagedAttentionCta(
    const BatchDesc* desc, const int32_t* positions, const int32_t* token_seq,
    const int32_t* block_tables, int max_blocks_per_seq, const bf16* q, const bf16* k_cache,
    const bf16* v_cache, int block_size, int num_heads, int num_kv_heads, float scale, bf16* out,
    int num_splits, float* partial_out, float* partial_stats) {
  namespace wmma = nvcuda::wmma;
  using L = AttentionSmem<kHeadDim, kRows>;
  constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks per head vector
  constexpr int kDimTiles = kHeadDim / 16, kKeyTiles = kAttnKeys / 16;
  constexpr int kLoads = kAttnKeys * kChunks / kAttnThreads;  // K (and V) chunks per thread
  static_assert(kAttnKeys * kChunks % kAttnThreads == 0, "whole chunks per thread");

  const int t0 = blockIdx.x, kv_head = blockIdx.y;
  const int num_tokens = desc->num_tokens;
  if (t0 >= num_tokens) return;
  const int group = num_heads / num_kv_heads;
  const int tile_tokens = kRows / group;
  const int seq = token_seq[t0];
  if (t0 > 0 && token_seq[t0 - 1] == seq && positions[t0] % tile_tokens != 0) return;
  int m = 1;  // tokens in this tile
  while (m < tile_tokens && t0 + m < num_tokens && token_seq[t0 + m] == seq &&
         positions[t0 + m] % tile_tokens != 0) {
    ++m;
  }
  const int rows = m * group;
  const int row_tiles = (rows + 15) / 16;
  const int padded_rows = row_tiles * 16;
  const int num_keys = positions[t0 + m - 1] + 1;
  const int split = blockIdx.z;
  const int span = (num_keys + num_splits - 1) / num_splits;
  const int split_keys = (span + kAttnKeys - 1) / kAttnKeys * kAttnKeys;
  const int key_begin = min(split * split_keys, num_keys);
  const int key_end = min(key_begin + split_keys, num_keys);
  const int32_t* table = block_tables + static_cast<size_t>(seq) * max_blocks_per_seq;

  extern __shared__ __align__(128) unsigned char smem[];
  bf16* s_q = reinterpret_cast<bf16*>(smem + L::kQ);
  bf16* s_k = reinterpret_cast<bf16*>(smem + L::kK);
  bf16* s_v = reinterpret_cast<bf16*>(smem + L::kV);
  float* s_s = reinterpret_cast<float*>(smem + L::kS);
  bf16* s_p = reinterpret_cast<bf16*>(smem + L::kP);
  float* s_o = reinterpret_cast<float*>(smem + L::kO);
  float* s_max = reinterpret_cast<float*>(smem + L::kMax);
  float* s_sum = reinterpret_cast<float*>(smem + L::kSum);
  int* s_pos = reinterpret_cast<int*>(smem + L::kPos);

  const int tid = threadIdx.x, lane = tid % kWarpSize, warp = tid / kWarpSize;
  for (int c = tid; c < padded_rows * kChunks; c += kAttnThreads) {
    const int r = c / kChunks, col = (c % kChunks) * 8;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (r < rows) {
      const size_t head = static_cast<size_t>(t0 + r / group) * num_heads +
                          kv_head * group + r % group;
      v = *reinterpret_cast<const uint4*>(q + head * kHeadDim + col);
    }
    *reinterpret_cast<uint4*>(s_q + r * L::kLdQ + col) = v;
  }
  for (int c = tid; c < padded_rows * kHeadDim; c += kAttnThreads) {
    s_o[(c / kHeadDim) * L::kLdO + c % kHeadDim] = 0.f;
  }
  for (int r = tid; r < kRows; r += kAttnThreads) {
    s_max[r] = -INFINITY;
    s_sum[r] = 0.f;
    s_pos[r] = r < rows ? positions[t0 + r / group] : -1;
  }
  const float scale_log2 = scale * 1.4426950408889634f;

  // Gathers a key tile's keys and values from their blocks into registers; keys past the end
  // read as zeros.
  uint4 k_reg[kLoads], v_reg[kLoads];
  auto fetch = [&](int key0) {
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      const int c = tid + i * kAttnThreads;
      const int j = c / kChunks, col = (c % kChunks) * 8, key = key0 + j;
      k_reg[i] = v_reg[i] = make_uint4(0, 0, 0, 0);
      if (key < key_end) {
        const int block = table[key / block_size];
        if (block >= 0) {
          const size_t off =
              ((static_cast<size_t>(block) * block_size + key % block_size) * num_kv_heads +
               kv_head) * kHeadDim + col;
          k_reg[i] = *reinterpret_cast<const uint4*>(k_cache + off);
          v_reg[i] = *reinterpret_cast<const uint4*>(v_cache + off);
        }
      }
    }
  };
  if (key_begin < key_end) fetch(key_begin);
  for (int key0 = key_begin; key0 < key_end; key0 += kAttnKeys) {
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      const int c = tid + i * kAttnThreads;
      const int j = c / kChunks, col = (c % kChunks) * 8;
      *reinterpret_cast<uint4*>(s_k + j * L::kLdQ + col) = k_reg[i];
      *reinterpret_cast<uint4*>(s_v + j * L::kLdQ + col) = v_reg[i];
    }
    __syncthreads();
    if (key0 + kAttnKeys < key_end) fetch(key0 + kAttnKeys);  // in flight during this tile

    // S = Q K^T: [padded_rows, kAttnKeys]
    for (int tile = warp; tile < row_tiles * kKeyTiles; tile += kAttnWarps) {
      const int mt = tile / kKeyTiles, nt = tile % kKeyTiles;
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::fill_fragment(acc, 0.f);
#pragma unroll
      for (int kk = 0; kk < kDimTiles; ++kk) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> a;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> b;
        wmma::load_matrix_sync(a, s_q + mt * 16 * L::kLdQ + kk * 16, L::kLdQ);
        wmma::load_matrix_sync(b, s_k + nt * 16 * L::kLdQ + kk * 16, L::kLdQ);
        wmma::mma_sync(acc, a, b, acc);
      }
      wmma::store_matrix_sync(s_s + mt * 16 * L::kLdS + nt * 16, acc, L::kLdS,
                              wmma::mem_row_major);
    }
    __syncthreads();

    // Online softmax, one warp per row; each lane owns keys lane and lane + 32 of the tile.
    static_assert(kAttnKeys == 2 * kWarpSize, "softmax assumes two keys per lane");
    for (int r = warp; r < padded_rows; r += kAttnWarps) {
      bf16* p_row = s_p + r * L::kLdP;
      if (r >= rows) {
        p_row[lane] = p_row[lane + kWarpSize] = __float2bfloat16(0.f);
        continue;
      }
      const float* s_row = s_s + r * L::kLdS;
      const int qpos = s_pos[r];
      const float s0 = key0 + lane <= qpos ? s_row[lane] * scale_log2 : -INFINITY;
      const float s1 = key0 + lane + kWarpSize <= qpos ? s_row[lane + kWarpSize] * scale_log2
                                                       : -INFINITY;
      const float old_max = s_max[r];
      const float new_max = fmaxf(old_max, WarpMax(fmaxf(s0, s1)));
      // -inf while every key so far is masked (a split that starts past this row's position):
      // exponentiate against 0 then, so that p = 0 and alpha = 0 rather than NaN.
      const float ref_max = new_max == -INFINITY ? 0.f : new_max;
      const bf16 p0 = __float2bfloat16(exp2f(s0 - ref_max));
      const bf16 p1 = __float2bfloat16(exp2f(s1 - ref_max));
      p_row[lane] = p0;
      p_row[lane + kWarpSize] = p1;
      // Sum the rounded probabilities that P V will use.
      const float p_sum = WarpSum(__bfloat162float(p0) + __bfloat162float(p1));
      const float alpha = exp2f(old_max - ref_max);  // 0 while old_max is -inf
      float* o_row = s_o + r * L::kLdO;
      for (int c = lane; c < kHeadDim; c += kWarpSize) o_row[c] *= alpha;
      __syncwarp();
      if (lane == 0) {
        s_max[r] = new_max;
        s_sum[r] = s_sum[r] * alpha + p_sum;
      }
    }
    __syncthreads();

    // O += P V: [padded_rows, D]
    for (int tile = warp; tile < row_tiles * kDimTiles; tile += kAttnWarps) {
      const int mt = tile / kDimTiles, dt = tile % kDimTiles;
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      float* o_tile = s_o + mt * 16 * L::kLdO + dt * 16;
      wmma::load_matrix_sync(acc, o_tile, L::kLdO, wmma::mem_row_major);
#pragma unroll
      for (int kk = 0; kk < kKeyTiles; ++kk) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> a;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> b;
        wmma::load_matrix_sync(a, s_p + mt * 16 * L::kLdP + kk * 16, L::kLdP);
        wmma::load_matrix_sync(b, s_v + kk * 16 * L::kLdQ + dt * 16, L::kLdQ);
        wmma::mma_sync(acc, a, b, acc);
      }
      wmma::store_matrix_sync(o_tile, acc, L::kLdO, wmma::mem_row_major);
    }
    __syncthreads();
  }

  __syncthreads();  // s_max/s_sum/s_o complete even when this split had no key tile
  for (int r = warp; r < rows; r += kAttnWarps) {
    const size_t head = static_cast<size_t>(t0 + r / group) * num_heads + kv_head * group +
                        r % group;
    if (num_splits == 1) {
      const float inv_sum = 1.f / s_sum[r];
      bf16* dst = out + head * kHeadDim;
      for (int c = lane; c < kHeadDim; c += kWarpSize) {
        dst[c] = __float2bfloat16(s_o[r * L::kLdO + c] * inv_sum);
      }
    } else {
      const size_t part = head * num_splits + split;
      float* dst = partial_out + part * kHeadDim;
      for (int c = lane; c < kHeadDim; c += kWarpSize) dst[c] = s_o[r * L::kLdO + c];
      if (lane == 0) {
        partial_stats[2 * part] = s_max[r];
        partial_stats[2 * part + 1] = s_sum[r];
      }
    }
  }
}

// Merges the splits of PagedAttentionCta: one CTA per token row t < num_tokens, warps over its
// heads. out = sum_z 2^(m_z - M) O_z / sum_z 2^(m_z - M) l_z with M = max_z m_z; splits that saw
// no unmasked key (m_z = -inf) weigh nothing and their partial output is not read.
template <int kHeadDim>
__device__ __forceinline__ void AttentionCombineCta(const BatchDesc* desc, int num_heads,
                                                    int num_splits, const float* partial_out,
                                                    const float* partial_stats, bf16* out) {
  const int t = blockIdx.x;
  if (t >= desc->num_tokens) return;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  for (int h = warp; h < num_heads; h += num_warps) {
    const size_t head = static_cast<size_t>(t) * num_heads + h;
    const float* stats = partial_stats + head * num_splits * 2;
    float max_all = -INFINITY;
    for (int z = 0; z < num_splits; ++z) max_all = fmaxf(max_all, stats[2 * z]);
    float acc[(kHeadDim + kWarpSize - 1) / kWarpSize] = {};
    float total = 0.f;
    for (int z = 0; z < num_splits; ++z) {
      const float m = stats[2 * z];
      if (m == -INFINITY) continue;
      const float w = exp2f(m - max_all);
      total += w * stats[2 * z + 1];
      const float* o = partial_out + (head * num_splits + z) * kHeadDim;
#pragma unroll
      for (int i = 0; i < (kHeadDim + kWarpSize - 1) / kWarpSize; ++i) {
        const int c = lane + kWarpSize * i;
        if (c < kHeadDim) acc[i] += w * o[c];
      }
    }
    const float inv_total = 1.f / total;
    bf16* dst = out + head * kHeadDim;
#pragma unroll
    for (int i = 0; i < (kHeadDim + kWarpSize - 1) / kWarpSize; ++i) {
      const int c = lane + kWarpSize * i;
      if (c < kHeadDim) dst[c] = __float2bfloat16(acc[i] * inv_total);
    }
  }
}

}  // namespace blink
