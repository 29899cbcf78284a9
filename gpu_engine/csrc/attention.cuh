// Paged causal attention for a flat batch mixing prefill chunks and decode tokens, with GQA.
//
// Work split (fixed grid, live batch): the grid is (bucket, num_kv_heads). Each sequence's run of
// tokens is cut into tiles at positions that are multiples of rows-per-CTA / group;
// the CTA whose token starts a tile (the first token of its sequence's run, or one at a tile
// boundary) computes the whole tile for one kv head; the other CTAs exit at once. A tile's query
// rows are (token, head of the group) pairs, row = token_offset * group + g, so every key and
// value the CTA reads serves all of them. The keys 0 .. last position of the tile are streamed
// once per CTA; S = Q K^T and O += P V run on tensor cores (bf16 in, fp32 accumulate); the
// softmax is online in fp32 with the running max and sum per row (exp2 with log2(e) folded into
// the scale). Each query attends to cache positions 0..its own position, all of which the
// RoPE/KV-write kernel wrote earlier in the same graph. Head dims 64 and 128 run the tiles on
// mma.sync, a warp per 16 rows, keys and values copied into shared memory a tile ahead
// (TileAttentionMmaCta); other head dims on WMMA through shared memory (PagedAttentionCta).
//
// Decode tokens (a sequence with a single token in the batch) take a separate path in the same
// kernel, DecodeAttentionCta: one pass of each key and value row, straight from the cache into
// registers, for all query heads of the KV head's group at once; each warp its own keys and
// online softmax on tensor cores (mma.sync with the group's heads as 8 of the MMA's columns);
// and many CTAs per sequence (flash-decoding): grid.z splits the keys into ranges of whole
// chunks, 16 keys for each warp of the CTA.
//
// Split keys, both paths: the CTAs of a tile write their unnormalized output and (max, sum) per
// row to a workspace, and the last of them to finish (a counter per tile and KV head, reset by
// that CTA) merges them into `out` (CombineTileCta). A tile whose keys fit one split writes `out`
// directly. No separate combine kernel: one kernel boundary fewer per layer.
#pragma once
#include <mma.h>

#include <type_traits>

#include "batch.cuh"
#include "utils.cuh"

namespace blink {

// Query rows (tokens x group heads) per CTA: 64 for prefill-sized buckets; 16 for decode-sized
// ones, where a tile rarely has more rows (both variants hold kAttnMinCtas CTAs an SM:
// registers decide).
static constexpr int kAttnRows = 64;
static constexpr int kAttnRowsSmall = 16;
// Keys per tile of PagedAttentionCta; both tile paths' splits hold whole ones.
static constexpr int kAttnKeys = 64;
// Warps of a CTA: kAttnWarps, or kAttnWideWarps in the decode-sized buckets' wide kernel (below).
static constexpr int kAttnWarps = 4;
static constexpr int kAttnThreads = kAttnWarps * kWarpSize;

// The mma.sync paths (DecodeAttentionCta from global memory, TileAttentionMmaCta from shared
// memory) read a lane's share of a head vector in whole 8- or 16-byte pieces and keep their
// accumulators in registers: head dims 64 and 128. Other head dims take the WMMA query tiles
// (PagedAttentionCta) for every token.
template <int kHeadDim>
__host__ __device__ constexpr bool MmaPathsFit() {
  return kHeadDim == 64 || kHeadDim == 128;
}

// The wide kernel's warps. A decode token's keys are spread over its CTA's warps (16 keys a warp
// step), then over CTAs (splits, which meet through global memory at the end): where a batch's
// (token, KV head) pairs fit the GPU in one wave of 8-warp CTAs, twice the warps a CTA means
// half the splits for the same keys a warp. The host takes the wide kernel only there
// (CudaForward.attention_wide): at 8B's 32 x 512, 256 pairs in two waves of one CTA an SM,
// every decode-sized bucket on 8 warps ran 5.329 -> 5.420 ms. Measured on the H200
// (bench_decode, ms a step, 4 warps -> the wide kernel where it fits): Llama-3.1-8B batch 1 at
// 512 and 8,192 keys 3.918 -> 3.862 and 4.218 -> 4.134 (32 x 512 and 32 x 4096, not wide,
// alike); Llama-3.2-1B 0.816 -> 0.805, 0.887 -> 0.883, 32 x 512 1.270 -> 1.253, 32 x 4096
// 2.199 -> 2.154. 12 warps (head dim 128 or 64) or 16 (64) were no faster anywhere, and slower
// at 8,192 keys (8B 4.134 -> 4.203, 1B 0.884 -> 0.915 with 12).
template <int kHeadDim>
static constexpr int kAttnWideWarps = MmaPathsFit<kHeadDim>() ? 8 : kAttnWarps;

// CTAs per SM the kernel's registers must allow, from the warps an SM they allow: 12 at head
// dim 128 (a register cap of 168 a thread: 3 CTAs of 4 warps, 1 of 8), 16 at 64 (a cap of 128)
// and 8 above 128. Head dims above 128 need more than 168 without spilling; 128 spills at a
// cap of 128 (the 8B shape's steps 3-13% slower); 64 fits 128 without spilling, and its fourth
// 4-warp CTA an SM pays (H200, Llama-3.2-1B shape, against 3: 128 x 512 decodes 2.017 -> 1.944
// ms a step, 2,048-token prefill chunks to 8,192 keys 18.67 -> 17.63 ms; batch 1 and 32
// unchanged; at 5, with spills, every point slower).
template <int kHeadDim, int kWarps>
static constexpr int kAttnMinCtas = (kHeadDim > 128 ? 8 : kHeadDim > 64 ? 12 : 16) / kWarps;

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

// The merge weights of one query row's splits, a warp at once: lane z gets weight[i] =
// 2^(m_z - M) of splits z and z + 32 (0 past active_splits <= 64, or where m_z = -inf) with
// M = max_z m_z, and every lane the return value 1 / sum_z 2^(m_z - M) l_z. stats: the row's
// [splits][2] (running max in log2 units, sum), written by other CTAs: read through L2 (ld.cg).
__device__ __forceinline__ float SplitWeights(const float* stats, int active_splits,
                                              float (&weight)[2]) {
  const int lane = threadIdx.x % kWarpSize;
  float split_max[2], split_sum[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int z = lane + kWarpSize * i;
    split_max[i] = z < active_splits ? __ldcg(stats + 2 * z) : -INFINITY;
    split_sum[i] = z < active_splits ? __ldcg(stats + 2 * z + 1) : 0.f;
  }
  const float max_all = WarpMax(fmaxf(split_max[0], split_max[1]));
#pragma unroll
  for (int i = 0; i < 2; ++i) weight[i] = exp2f(split_max[i] - max_all);  // 0 at -inf
  return 1.f / WarpSum(weight[0] * split_sum[0] + weight[1] * split_sum[1]);
}

// Merges the split partials of one tile: `m` tokens from t0, the `group` query heads of
// kv_head. out = sum_z 2^(m_z - M) O_z / sum_z 2^(m_z - M) l_z with M = max_z m_z over the
// tile's active splits (<= 64; split 0 holds key 0, so M is finite); a split that saw no
// unmasked key of a row (m_z = -inf, its partial output zeros) weighs nothing. A warp per row:
// its lanes read the splits' statistics at once (lane z: splits z and z + 32), and the
// partial outputs are read 8 splits at a time, so the merge costs a few L2 round trips rather
// than one per split. Other CTAs wrote the partials: read through L2 (ld.cg).
template <int kHeadDim>
__device__ __forceinline__ void CombineTileCta(int t0, int m, int kv_head, int group,
                                               int num_heads, int num_splits, int active_splits,
                                               const float* partial_out,
                                               const float* partial_stats, bf16* out) {
  constexpr int kPerLane = (kHeadDim + kWarpSize - 1) / kWarpSize;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  for (int r = warp; r < m * group; r += num_warps) {
    const size_t head = static_cast<size_t>(t0 + r / group) * num_heads + kv_head * group +
                        r % group;
    float weight[2];
    const float inv_total =
        SplitWeights(partial_stats + head * num_splits * 2, active_splits, weight);
    float acc[kPerLane] = {};
    const float* o = partial_out + head * num_splits * kHeadDim;
#pragma unroll 8
    for (int z = 0; z < active_splits; ++z) {
      const float w =
          __shfl_sync(kFullMask, z < kWarpSize ? weight[0] : weight[1], z % kWarpSize);
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        const int c = lane + kWarpSize * i;
        if (c < kHeadDim) acc[i] += w * __ldcg(o + z * kHeadDim + c);
      }
    }
    bf16* dst = out + head * kHeadDim;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int c = lane + kWarpSize * i;
      if (c < kHeadDim) dst[c] = __float2bfloat16(acc[i] * inv_total);
    }
  }
}

// Called by every CTA that wrote split partials, once they are written (all threads): true in
// the last of the `active_splits` CTAs to arrive at the counter `sem`, whose reads of the other
// CTAs' partials are then ordered after their writes (threadFenceReduction pattern: fence,
// count, and the last one reads). That CTA merges, then resets *sem for the next launch.
__device__ __forceinline__ bool LastSplitToArrive(uint32_t* sem, int active_splits) {
  __shared__ int s_last;
  __threadfence();  // this thread's partials are visible device-wide before the count moves
  __syncthreads();
  if (threadIdx.x == 0) {
    s_last = atomicAdd(sem, 1u) == static_cast<uint32_t>(active_splits - 1);
  }
  __syncthreads();
  if (s_last) __threadfence();
  return s_last;
}

// The tile path's ending for a split tile: the last CTA merges the tile's rows.
template <int kHeadDim>
__device__ __forceinline__ void FinishSplitCta(int t0, int m, int kv_head, int group,
                                               int num_heads, int num_kv_heads, int num_splits,
                                               int active_splits, const float* partial_out,
                                               const float* partial_stats, uint32_t* tile_sems,
                                               bf16* out) {
  uint32_t* sem = tile_sems + static_cast<size_t>(t0) * num_kv_heads + kv_head;
  if (!LastSplitToArrive(sem, active_splits)) return;
  CombineTileCta<kHeadDim>(t0, m, kv_head, group, num_heads, num_splits, active_splits,
                           partial_out, partial_stats, out);
  if (threadIdx.x == 0) *sem = 0;
}

// The query tile a CTA of the tile paths computes: tokens t0 .. t0 + m - 1 of one sequence (a
// run of its tokens in the batch, cut at positions that are multiples of rows-per-CTA / group),
// `rows` = m * group query rows (row = token offset * group + head of the group), and this
// CTA's split of the keys 0 .. the last token's position: [key_begin, key_end), whole
// kAttnKeys tiles per split.
struct QueryTile {
  int t0, m, rows, seq, num_keys, key_begin, key_end, active_splits;
};

// The tile of CTA (blockIdx.x, ., blockIdx.z) with kRows rows per CTA; false when the CTA has
// none (its token is not a tile's first, or its split is past the tile's keys).
template <int kRows>
__device__ __forceinline__ bool FindQueryTile(const BatchDesc* desc, const int32_t* positions,
                                              const int32_t* token_seq, int group,
                                              int num_splits, QueryTile* tile) {
  const int t0 = blockIdx.x;
  const int num_tokens = desc->num_tokens;
  if (t0 >= num_tokens) return false;
  const int tile_tokens = kRows / group;
  const int seq = token_seq[t0];
  if (t0 > 0 && token_seq[t0 - 1] == seq && positions[t0] % tile_tokens != 0) return false;
  int m = 1;
  while (m < tile_tokens && t0 + m < num_tokens && token_seq[t0 + m] == seq &&
         positions[t0 + m] % tile_tokens != 0) {
    ++m;
  }
  const int num_keys = positions[t0 + m - 1] + 1;
  const int span = (num_keys + num_splits - 1) / num_splits;
  const int split_keys = (span + kAttnKeys - 1) / kAttnKeys * kAttnKeys;
  const int active_splits = (num_keys + split_keys - 1) / split_keys;
  if (static_cast<int>(blockIdx.z) >= active_splits) return false;  // uniform over the CTA
  const int key_begin = blockIdx.z * split_keys;
  *tile = QueryTile{t0, m, m * group, seq, num_keys, key_begin,
                    min(key_begin + split_keys, num_keys), active_splits};
  return true;
}

// Where one KV head's rows sit in a layer's paged cache ([blocks, block_size, kv_heads, D]):
// the element offset of a key's row, -1 where the table maps no block. Shifts for the usual
// power-of-two block sizes, a division otherwise.
template <int kHeadDim>
struct KeyRows {
  const int32_t* table;  // the sequence's block table
  int block_size, block_shift, num_kv_heads, kv_head;
  bool pow2;

  __device__ KeyRows(const int32_t* block_tables, int max_blocks_per_seq, int seq,
                     int block_size_, int num_kv_heads_, int kv_head_)
      : table(block_tables + static_cast<size_t>(seq) * max_blocks_per_seq),
        block_size(block_size_), block_shift(__ffs(block_size_) - 1),
        num_kv_heads(num_kv_heads_), kv_head(kv_head_),
        pow2((block_size_ & (block_size_ - 1)) == 0) {}

  __device__ __forceinline__ int64_t offset(int key) const {
    const int block = block_of(key);
    return block < 0 ? -1 : offset_in(block, key);
  }
  // The table's entry for key (-1: no block).
  __device__ __forceinline__ int block_of(int key) const {
    return table[pow2 ? key >> block_shift : key / block_size];
  }
  // The offset of key's row, given its block (block_of(key) >= 0).
  __device__ __forceinline__ int64_t offset_in(int block, int key) const {
    const int row = pow2 ? key & (block_size - 1) : key % block_size;
    return ((static_cast<int64_t>(block) * block_size + row) * num_kv_heads + kv_head) *
           kHeadDim;
  }
};

// q: [bucket, num_heads, D] bf16 (after RoPE); k_cache, v_cache: this layer's
// [num_blocks, block_size, num_kv_heads, D] bf16; out: [bucket, num_heads, D] bf16.
// Needs AttentionSmem<D, kRows>::kBytes of dynamic shared memory and kAttnThreads threads;
// num_heads / num_kv_heads <= kRows (checked by the host). The next key tile is fetched into
// registers while the current one is computed on. When a tile's keys span more than one split
// (grid.z = num_splits > 1): partial_out: [bucket, num_heads, num_splits, D] f32,
// partial_stats: [.., num_splits, 2] f32 (running max in log2 units, sum), merged into `out` by
// the tile's last CTA (FinishSplitCta; tile_sems: [bucket, num_kv_heads] u32, zero at rest).
template <int kHeadDim, int kRows>
__device__ __forceinline__ void PagedAttentionCta(
    const BatchDesc* desc, const int32_t* positions, const int32_t* token_seq,
    const int32_t* block_tables, int max_blocks_per_seq, const bf16* q, const bf16* k_cache,
    const bf16* v_cache, int block_size, int num_heads, int num_kv_heads, float scale, bf16* out,
    int num_splits, float* partial_out, float* partial_stats, uint32_t* tile_sems) {
  namespace wmma = nvcuda::wmma;
  using L = AttentionSmem<kHeadDim, kRows>;
  constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks per head vector
  constexpr int kDimTiles = kHeadDim / 16, kKeyTiles = kAttnKeys / 16;
  constexpr int kLoads = kAttnKeys * kChunks / kAttnThreads;  // K (and V) chunks per thread
  static_assert(kAttnKeys * kChunks % kAttnThreads == 0, "whole chunks per thread");

  const int kv_head = blockIdx.y, split = blockIdx.z;
  const int group = num_heads / num_kv_heads;
  QueryTile tile;
  if (!FindQueryTile<kRows>(desc, positions, token_seq, group, num_splits, &tile)) return;
  const int t0 = tile.t0, m = tile.m, rows = tile.rows, key_begin = tile.key_begin;
  const int key_end = tile.key_end, active_splits = tile.active_splits;
  const int row_tiles = (rows + 15) / 16;
  const int padded_rows = row_tiles * 16;
  const int32_t* table = block_tables + static_cast<size_t>(tile.seq) * max_blocks_per_seq;

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

  __syncthreads();  // s_max/s_sum/s_o complete
  for (int r = warp; r < rows; r += kAttnWarps) {
    const size_t head = static_cast<size_t>(t0 + r / group) * num_heads + kv_head * group +
                        r % group;
    if (active_splits == 1) {
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
  if (active_splits > 1) {
    FinishSplitCta<kHeadDim>(t0, m, kv_head, group, num_heads, num_kv_heads, num_splits,
                             active_splits, partial_out, partial_stats, tile_sems, out);
  }
}

// Keys per warp step of DecodeAttentionCta: one MMA's k.
static constexpr int kMmaKeys = 16;

// Shared memory of TileAttentionMmaCta: kStages stages of kKeys keys (a query tile's rows: 64
// keys, or 16 in the decode-sized variant), each stage the keys' K rows then their V rows.
template <int kHeadDim, int kRows>
struct TileStages {
  static constexpr int kKeys = kRows;
  static constexpr int kStages = 2;
  static constexpr int kPieces = kHeadDim / 8;  // 16-byte pieces of a row
  static constexpr size_t kStageBytes = 2 * kKeys * kHeadDim * sizeof(bf16);
  static constexpr size_t kBytes = kStages * kStageBytes;

  // Where piece p of row r sits: p XOR RowMask(r), the mask r mod 8 rotated right by one bit.
  // A row is a multiple of 128 bytes, so a piece's bank group is its index mod 8, and the
  // reads are conflict-free: ldmatrix's 8 rows r .. r + 7 of one piece (the mask is a
  // bijection mod 8), and a quarter warp's key fragments, rows 2 i and 2 i + 1 with pieces
  // 4 s .. 4 s + 3 each (their masks differ in bit 2). The mask depends on r mod 8 only, so a
  // lane whose rows are all alike mod 8 computes it once.
  static __device__ __forceinline__ int RowMask(int r) {
    const int m = r & 7;
    return (m >> 1 | m << 2) & 7;
  }
  static __device__ __forceinline__ int Swizzle(int r, int p) { return p ^ RowMask(r); }
};

// The query tiles on mma.sync (head dims 64 and 128; others take PagedAttentionCta), for prefill
// chunks: warp w owns query rows 16 w .. 16 w + 15 of the tile (kRows / 16 warps work) and runs
// its own online softmax over the split's keys, FlashAttention-2 style: S = Q K^T and O = P V
// with Q, the scores, the probabilities and O in registers.
// - Keys and values come through shared memory: all the CTA's threads copy the next kKeys keys'
//   K and V rows (cp.async, zeros past the tile's keys) while the warps compute on the current
//   ones, two stages; so each key is read from L2 once per CTA, and the warps wait on global
//   memory only for the block-table lookups that start each copy. A warp takes 32 keys as one
//   softmax block: one rescale of O per block (none once its rows' maxima stop moving), and
//   the causal mask only in blocks that cross a row's position or the split's end (warps with
//   rows past the tile take the masked blocks throughout).
// - The row sums add the fp32 probabilities, P V their bf16 roundings (as FlashAttention-2;
//   the other two paths sum the rounded values): a relative difference of at most 2^-9.
// - Q is the A operand (rows g and g + 8 of the warp's 16), K the col-major B operand (column
//   n: key n of an 8-key tile); lane (g, t) reads 16 bytes, dims 32 s + 8 t .. + 7, of each
//   (the k order inside an MMA is free, as in gemv.cuh).
// - The scores' C layout is P's A layout for O = P V (k = 16 keys).
// - V is the B operand, read with ldmatrix.trans: two 8-dim output tiles per ldmatrix.x4.
// A warp stops at the last key its rows may see (causal); the copies run to the tile's last.
// Partials and the split merge as in PagedAttentionCta. kWarps * 32 threads.
template <int kHeadDim, int kRows, int kWarps>
__device__ __forceinline__ void TileAttentionMmaCta(
    const BatchDesc* desc, const int32_t* positions, const int32_t* token_seq,
    const int32_t* block_tables, int max_blocks_per_seq, const bf16* q, const bf16* k_cache,
    const bf16* v_cache, int block_size, int num_heads, int num_kv_heads, float scale, bf16* out,
    int num_splits, float* partial_out, float* partial_stats, uint32_t* tile_sems) {
  using Stages = TileStages<kHeadDim, kRows>;
  constexpr int kKeys = Stages::kKeys, kPieces = Stages::kPieces;
  constexpr int kSteps = kHeadDim / 32;    // 32-dim steps of S = Q K^T (two MMAs each)
  constexpr int kOutTiles = kHeadDim / 8;  // 8-dim tiles of O = P V
  // Keys per softmax block: 32 (64 would rescale O half as often, but its scores and
  // probabilities spill 232 bytes of registers at head dim 128, where 32 spill 24)
  constexpr int kBlockKeys = kKeys < 32 ? kKeys : 32;
  constexpr int kKeyTiles = kBlockKeys / 8;  // 8-key tiles of S
  // threads copying one key row (the CTA's first kKeys * kCopyThreads threads copy)
  constexpr int kCopyThreads = kPieces < kWarps * kWarpSize / kKeys ? kPieces
                                                                     : kWarps * kWarpSize / kKeys;
  static_assert(kHeadDim == 64 || kHeadDim == 128, "head dims 64 and 128");
  static_assert(kRows % 16 == 0 && kRows / 16 <= kWarps, "a warp per 16 rows");
  static_assert(kCopyThreads > 0 && kPieces % kCopyThreads == 0 && kKeys % 16 == 0,
                "every thread copies whole pieces of one row; whole MMA k-steps of keys");
  const int kv_head = blockIdx.y, split = blockIdx.z;
  const int group = num_heads / num_kv_heads;
  QueryTile tile;
  if (!FindQueryTile<kRows>(desc, positions, token_seq, group, num_splits, &tile)) return;
  // The tile's last token sees the most keys: the split ends at or before its key.
  const int key_end = tile.key_end;
  const int num_key_tiles = (key_end - tile.key_begin + kKeys - 1) / kKeys;
  const KeyRows<kHeadDim> cache_rows(block_tables, max_blocks_per_seq, tile.seq, block_size,
                                     num_kv_heads, kv_head);
  const int tid = threadIdx.x, lane = tid % kWarpSize, warp = tid / kWarpSize;
  const int g = lane / 4, tq = lane % 4;

  extern __shared__ __align__(128) unsigned char smem[];
  auto stage_keys = [&](int stage) {
    return reinterpret_cast<bf16*>(smem + stage * Stages::kStageBytes);
  };
  // All threads: keys key_tile * kKeys .. of the split into stage key_tile % 2, then commit.
  // kCopyThreads threads per key row (one block-table lookup each): pieces p, p + kCopyThreads,
  // .. of its K and V rows, p = tid % kCopyThreads.
  auto copy_key_tile = [&](int key_tile) {
    bf16* dst = stage_keys(key_tile % Stages::kStages);
    const int r = tid / kCopyThreads, key = tile.key_begin + key_tile * kKeys + r;
    // every thread copies, unless the CTA has more threads than a key tile has pieces
    if (kKeys * kCopyThreads == kWarps * kWarpSize || r < kKeys) {
      const int64_t off = key < key_end ? cache_rows.offset(key) : -1;
      const int bytes = off >= 0 ? 16 : 0;
      const bf16* k_row = k_cache + (off >= 0 ? off : 0);
      const bf16* v_row = v_cache + (off >= 0 ? off : 0);
#pragma unroll
      for (int i = 0; i < kPieces / kCopyThreads; ++i) {
        const int p = tid % kCopyThreads + kCopyThreads * i;
        const int at = r * kHeadDim + 8 * Stages::Swizzle(r, p);
        CpAsync16(dst + at, k_row + 8 * p, bytes);
        CpAsync16(dst + kKeys * kHeadDim + at, v_row + 8 * p, bytes);
      }
    }
    CpAsyncCommit();
  };
  copy_key_tile(0);  // in flight while Q is read

  // This lane's two rows (h = 0: row g, h = 1: row g + 8 of the warp's): query head (computed
  // where used, not held through the key loop), position (-1 for rows past the tile: every key
  // masked) and Q's 16-byte pieces.
  auto query_head = [&](int h) {
    const int r = 16 * warp + g + 8 * h;
    return static_cast<size_t>(tile.t0 + r / group) * num_heads + kv_head * group + r % group;
  };
  int pos[2];
  uint4 qr[2][kSteps];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const bool live = 16 * warp + g + 8 * h < tile.rows;
    pos[h] = live ? positions[tile.t0 + (16 * warp + g + 8 * h) / group] : -1;
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
      qr[h][s] = live ? *reinterpret_cast<const uint4*>(q + query_head(h) * kHeadDim + 32 * s +
                                                        8 * tq)
                      : make_uint4(0, 0, 0, 0);
    }
  }
  // The warp's keys: up to its last row's; unmasked below the first row's (and the split's end).
  const int key_stop = min(key_end, __reduce_max_sync(kFullMask, max(pos[0], pos[1])) + 1);
  const int unmasked_stop =
      min(key_end, static_cast<int>(__reduce_min_sync(
                       kFullMask, static_cast<unsigned>(min(pos[0], pos[1]) + 1))));
  const float scale_log2 = scale * 1.4426950408889634f;
  float o[kOutTiles][4];
#pragma unroll
  for (int j = 0; j < kOutTiles; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float run_max[2] = {-INFINITY, -INFINITY}, run_sum[2] = {0.f, 0.f};  // run_sum: lane's keys

  // The lane's stage rows: key fragments from rows = g (mod 8), ldmatrix addresses from rows
  // = lane (mod 8) (r0 and every tile offset below are multiples of 8).
  const int key_mask = Stages::RowMask(g), value_mask = Stages::RowMask(lane & 7);
  const int value_row = (lane & 7) + 8 * ((lane >> 3) & 1), value_piece = lane >> 4;

  // One softmax block: keys key0 .. key0 + kBlockKeys - 1, rows r0 .. of the stage, masked or
  // not. Scores stay unscaled until the exponent (scale > 0: the max commutes with it).
  auto key_block = [&](const bf16* k_tile, const bf16* v_tile, int r0, int key0, auto masked) {
    float sc[kKeyTiles][4];  // [8-key tile n][C fragment]: rows g, g + 8; keys 8 n + 2 t (+1)
#pragma unroll
    for (int n = 0; n < kKeyTiles; ++n) {
      const bf16* k_row = k_tile + (r0 + 8 * n + g) * kHeadDim;
      sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.f;
#pragma unroll
      for (int s = 0; s < kSteps; ++s) {
        const uint4 kv =
            *reinterpret_cast<const uint4*>(k_row + 8 * ((4 * s + tq) ^ key_mask));
        MmaBf16Step32(sc[n], qr[0][s], qr[1][s], kv);
      }
    }
    // Online softmax of rows g (h = 0: C elements 0, 1) and g + 8 (h = 1: elements 2, 3); a
    // row may have no live key yet (-inf: p = 0, alpha = 0).
    uint32_t pa[2][kKeyTiles];  // P's A fragments: [h][n]
    float alpha[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float block_max = -INFINITY;
#pragma unroll
      for (int n = 0; n < kKeyTiles; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& v = sc[n][2 * h + e];
          if constexpr (decltype(masked)::value) {
            const int key = key0 + 8 * n + 2 * tq + e;
            if (key >= key_end || key > pos[h]) v = -INFINITY;
          }
          block_max = fmaxf(block_max, v);
        }
      block_max = fmaxf(block_max, __shfl_xor_sync(kFullMask, block_max, 1));
      block_max = fmaxf(block_max, __shfl_xor_sync(kFullMask, block_max, 2));
      const float new_max = fmaxf(run_max[h], block_max * scale_log2);
      const float ref_max = new_max == -INFINITY ? 0.f : new_max;
      alpha[h] = FastExp2(run_max[h] - ref_max);
      run_max[h] = new_max;
      float p_sum = 0.f;
#pragma unroll
      for (int n = 0; n < kKeyTiles; ++n) {
        const float p0 = FastExp2(fmaf(sc[n][2 * h], scale_log2, -ref_max));
        const float p1 = FastExp2(fmaf(sc[n][2 * h + 1], scale_log2, -ref_max));
        p_sum += p0 + p1;
        const __nv_bfloat162 pair = __floats2bfloat162_rn(p0, p1);
        pa[h][n] = *reinterpret_cast<const uint32_t*>(&pair);
      }
      run_sum[h] = run_sum[h] * alpha[h] + p_sum;
    }
    // Once the rows' maxima settle (most blocks of a long context), O needs no rescaling.
    if (__any_sync(kFullMask, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
      for (int j = 0; j < kOutTiles; ++j) {
        o[j][0] *= alpha[0];
        o[j][1] *= alpha[0];
        o[j][2] *= alpha[1];
        o[j][3] *= alpha[1];
      }
    }
    // O += P V, 16 keys (k) at a time; ldmatrix.trans: lanes 8 i .. 8 i + 7 address rows
    // (keys) 8 (i % 2) .. of dims 8 (i / 2) .. of a 16-dim pair of output tiles.
#pragma unroll
    for (int kc = 0; kc < kBlockKeys / 16; ++kc) {
      const bf16* v_row = v_tile + (r0 + 16 * kc + value_row) * kHeadDim;
#pragma unroll
      for (int jp = 0; jp < kOutTiles / 2; ++jp) {
        uint32_t b[4];
        LdMatrixX4Trans(b, v_row + 8 * ((2 * jp + value_piece) ^ value_mask));
        MmaBf16(o[2 * jp], pa[0][2 * kc], pa[1][2 * kc], pa[0][2 * kc + 1], pa[1][2 * kc + 1],
                b[0], b[1]);
        MmaBf16(o[2 * jp + 1], pa[0][2 * kc], pa[1][2 * kc], pa[0][2 * kc + 1],
                pa[1][2 * kc + 1], b[2], b[3]);
      }
    }
  };

  for (int key_tile = 0; key_tile < num_key_tiles; ++key_tile) {
    if (key_tile + 1 < num_key_tiles) {
      copy_key_tile(key_tile + 1);  // its stage's last readers passed the barrier below
      CpAsyncWait<1>();
    } else {
      CpAsyncWait<0>();
    }
    __syncthreads();  // every thread's copies of this key tile have landed
    const bf16* k_tile = stage_keys(key_tile % Stages::kStages);
#pragma unroll 1
    for (int r0 = 0; r0 < kKeys; r0 += kBlockKeys) {
      const int key0 = tile.key_begin + key_tile * kKeys + r0;
      if (key0 + kBlockKeys <= unmasked_stop) {  // warp-uniform branches
        key_block(k_tile, k_tile + kKeys * kHeadDim, r0, key0, std::false_type{});
      } else if (key0 < key_stop) {
        key_block(k_tile, k_tile + kKeys * kHeadDim, r0, key0, std::true_type{});
      }
    }
    __syncthreads();  // every warp is done with this stage before it is copied over
  }

  // Each row: its sum over its four lanes, then out (one split) or the partials; lane (g, t)
  // holds dims 8 j + 2 t and 8 j + 2 t + 1 of its rows.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    run_sum[h] += __shfl_xor_sync(kFullMask, run_sum[h], 1);
    run_sum[h] += __shfl_xor_sync(kFullMask, run_sum[h], 2);
    if (pos[h] < 0) continue;
    if (tile.active_splits == 1) {
      const float inv_sum = 1.f / run_sum[h];
      bf16* dst = out + query_head(h) * kHeadDim + 2 * tq;
#pragma unroll
      for (int j = 0; j < kOutTiles; ++j) {
        *reinterpret_cast<__nv_bfloat162*>(dst + 8 * j) =
            __floats2bfloat162_rn(o[j][2 * h] * inv_sum, o[j][2 * h + 1] * inv_sum);
      }
    } else {
      const size_t part = query_head(h) * num_splits + split;
      float* dst = partial_out + part * kHeadDim + 2 * tq;
#pragma unroll
      for (int j = 0; j < kOutTiles; ++j) {
        *reinterpret_cast<float2*>(dst + 8 * j) = make_float2(o[j][2 * h], o[j][2 * h + 1]);
      }
      if (tq == 0) {
        partial_stats[2 * part] = run_max[h];
        partial_stats[2 * part + 1] = run_sum[h];
      }
    }
  }
  if (tile.active_splits > 1) {
    FinishSplitCta<kHeadDim>(tile.t0, tile.m, kv_head, group, num_heads, num_kv_heads,
                             num_splits, tile.active_splits, partial_out, partial_stats,
                             tile_sems, out);
  }
}

// --- decode tokens -------------------------------------------------------------------------

static constexpr int kDecodeMaxGroup = 8;    // larger GQA groups take the tile path
static constexpr int kDecodeMaxSplits = 64;  // the host's attention_splits() stays within it
// What a decode CTA costs beyond streaming its chunks (block-table and key latencies before its
// first chunk, the partial write and the split merge), in chunk times: fitted on the H200 to
// bench_decode with the split count capped (Llama-3.1-8B and 3.2-1B shapes, batch 1 and 32 at
// 512 to 8,192 keys), where it picks the fastest measured count at every point.
static constexpr int kDecodeSplitCostChunks = 6;

// Chunks per split of a decode token with `chunks` key chunks: the split count s <= num_splits
// that minimizes the estimated time waves(s) * (kDecodeSplitCostChunks + ceil(chunks / s)), with
// waves(s) = ceil(ctas * s / slots) for `ctas` (token, kv head) pairs on `slots` CTA slots, as
// if every token of the batch had this one's keys; ties go to more splits. A short context
// then keeps its keys in a wave of one or a few CTAs each (batch 32 at 512 keys: one split,
// where filling the GPU's slots took two waves), a long one spreads over the GPU.
// Every lane of a warp calls it (lane l weighs s = l + 1 and l + 33) and gets the same answer.
__device__ __forceinline__ int DecodeChunksPerSplit(int chunks, int num_splits, int ctas,
                                                    int slots) {
  static_assert(kDecodeMaxSplits <= 2 * kWarpSize, "two split counts per lane");
  const int lane = threadIdx.x % kWarpSize;
  uint32_t best_cost = ~0u, best_chunks = 0;
  // the cheaper count, and of equal costs the one with fewer chunks a split
  auto keep_better = [&](uint32_t cost, uint32_t per_split) {
    if (cost < best_cost || (cost == best_cost && per_split < best_chunks)) {
      best_cost = cost;
      best_chunks = per_split;
    }
  };
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int s = lane + 1 + kWarpSize * i;
    if (s > num_splits) continue;
    const int per_split = (chunks + s - 1) / s;
    const int active = (chunks + per_split - 1) / per_split;  // the splits that get chunks
    const uint32_t waves = (static_cast<uint32_t>(ctas) * active + slots - 1) / slots;
    keep_better(waves * (kDecodeSplitCostChunks + per_split), per_split);
  }
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o >>= 1)
    keep_better(__shfl_xor_sync(kFullMask, best_cost, o),
                __shfl_xor_sync(kFullMask, best_chunks, o));
  return static_cast<int>(best_chunks);
}

// Shared memory of DecodeAttentionCta, after its key loop: each warp's running max and sum per
// query head and its unnormalized output, for the merge of the CTA's warps; then the split
// merge's weights (f32 [kDecodeMaxGroup][kDecodeMaxSplits]).
template <int kHeadDim, int kWarps>
struct DecodeLayout {
  static constexpr size_t kWarpOut = 0;  // f32 [kWarps][kDecodeMaxGroup][kHeadDim]
  static constexpr size_t kWarpMax = kWarpOut + sizeof(float) * kWarps * kDecodeMaxGroup * kHeadDim;
  static constexpr size_t kWarpSum = kWarpMax + sizeof(float) * kWarps * kDecodeMaxGroup;
  static constexpr size_t kMergeWeights = kWarpSum + sizeof(float) * kWarps * kDecodeMaxGroup;
  static constexpr size_t kBytes =
      kMergeWeights + sizeof(float) * kDecodeMaxGroup * kDecodeMaxSplits;
};

// The last CTA of a decode token's splits merges them, all threads at once (this runs on the
// critical path of every decode step): a warp per query head turns the splits' (max, sum) into
// normalized weights w_z = 2^(m_z - M) / sum_z' 2^(m_z' - M) l_z' in shared memory (lane z:
// splits z and z + 32), then every output element is a weighted sum of independent L2 reads.
// Every split of a decode token saw a live key, so each m_z is finite.
// s_weight: [kGroup][kDecodeMaxSplits] f32.
template <int kHeadDim>
__device__ __forceinline__ void MergeDecodeSplitsCta(int t, int kv_head, int group,
                                                     int num_heads, int num_splits,
                                                     int active_splits, const float* partial_out,
                                                     const float* partial_stats, bf16* out,
                                                     float* s_weight) {
  static_assert(kDecodeMaxSplits <= 2 * kWarpSize, "two splits per lane");
  const size_t head0 = static_cast<size_t>(t) * num_heads + kv_head * group;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  for (int g = warp; g < group; g += blockDim.x / kWarpSize) {
    float weight[2];  // 0 past the splits
    const float inv_total =
        SplitWeights(partial_stats + 2 * (head0 + g) * num_splits, active_splits, weight);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int z = lane + kWarpSize * i;
      if (z < active_splits) s_weight[g * kDecodeMaxSplits + z] = weight[i] * inv_total;
    }
  }
  __syncthreads();
  // 4 consecutive dims per thread (16-byte loads), 16 splits' loads in flight at a time
  for (int e = 4 * threadIdx.x; e < group * kHeadDim; e += 4 * blockDim.x) {
    const int g = e / kHeadDim, d = e % kHeadDim;
    const float4* o = reinterpret_cast<const float4*>(
        partial_out + (head0 + g) * num_splits * kHeadDim + d);
    const float* w = s_weight + g * kDecodeMaxSplits;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 16
    for (int z = 0; z < active_splits; ++z) {
      const float4 v = __ldcg(o + z * (kHeadDim / 4));
      acc.x += w[z] * v.x;
      acc.y += w[z] * v.y;
      acc.z += w[z] * v.z;
      acc.w += w[z] * v.w;
    }
    __nv_bfloat162* dst = reinterpret_cast<__nv_bfloat162*>(out + (head0 + g) * kHeadDim + d);
    dst[0] = __floats2bfloat162_rn(acc.x, acc.y);
    dst[1] = __floats2bfloat162_rn(acc.z, acc.w);
  }
}

// One query token t that is alone in its sequence this step (a decode token), one KV head, one
// split of its keys [0, position]: whole chunks of 16 * kWarps keys per split
// (DecodeChunksPerSplit: at most num_splits splits, ctas and slots as there), and in each
// chunk warp w takes keys 16 w .. 16 w + 15. Each warp runs its own online softmax on tensor
// cores, straight from global memory into registers (no shared-memory staging, no barrier in
// the key loop), and the CTA's warps merge at the end.
//
// Per warp step (16 keys; lane = (g = lane / 4, t = lane % 4) as in mma.sync m16n8k16):
// - S^T = K Q^T: the step's 16 keys are the MMA's rows (lane (g, t): keys g and g + 8), the
//   group's query heads its 8 columns (Q^T's column g: head g, zeros past the group), so no
//   MMA row is padding and a 32-dim step takes two MMAs, where S = Q K^T with the heads as
//   rows (half of them padding at GQA group 4) took four. Within an MMA the order of the k
//   terms (head dims) is free, so lane (g, t) loads 16 bytes, dims 32 s + 8 t .. + 7, of key
//   g, key g + 8 and Q row g, as the skinny projections do (gemv.cuh); the .x/.y and .z/.w
//   halves of a step go to two accumulators (two shorter MMA chains), summed after.
// - Lane (g, t) ends with the scores of keys g and g + 8 for heads 2 t and 2 t + 1: it keeps
//   those heads' running max and sum itself (the max over a step's keys is a reduction over
//   the eight lanes of a t), and its P values, rounded to bf16 and transposed by `movmatrix`,
//   become P^T's B fragment below (column g: head g; keys 2 t, 2 t + 1, 2 t + 8, 2 t + 9).
//   Measured on the H200 against S = Q K^T: 8B 32 x 512 5.630 -> 5.602 ms, 128 x 512 8.107 ->
//   8.057, 32 x 4096 9.224 -> 9.181; 1B within 0.4%, no point slower.
// - O^T = V^T P^T, with P^T's fragment as the col-major B operand (column g: query head g) and
//   V^T as the A operand: rows g and g + 8 (head dims), k = keys 2 t, 2 t + 1, 2 t + 8, 2 t + 9.
//   Every accumulator is then a live (head, dim) pair (a 16 x 8 tile: 16 dims of 8 heads),
//   not half of them padding as with O = P V. The dims are permuted: row r of tile j is dim
//   r * D / 16 + j, so that a lane loads D / 16 contiguous dims of each of its four keys for
//   row g and as many for row g + 8, and byte permutes pair the keys up. Lane (g, t) ends
//   holding heads 2 t and 2 t + 1 at dims g * D / 16 .. + D / 16 - 1 and (g + 8) * D / 16 ..
// The next step's keys are loaded into the registers the current step's scores have freed, and
// its values into those the P V product has freed. Keys are read through L2 only (ld.cg: the
// newest one was written by this graph's qkv kernel, and a coherent load stays below the wait).
// group <= kDecodeMaxGroup. Workspaces as in PagedAttentionCta. kWarps * 32 threads.
template <int kHeadDim, bool kStepInOneBlock, int kWarps>
__device__ __forceinline__ void DecodeAttentionCta(
    int t, int seq, int position, const int32_t* block_tables, int max_blocks_per_seq,
    const bf16* q, const bf16* k_cache, const bf16* v_cache, int block_size, int num_heads,
    int num_kv_heads, float scale, bf16* out, int num_splits, int ctas, int slots,
    float* partial_out, float* partial_stats, uint32_t* tile_sems) {
  static_assert(MmaPathsFit<kHeadDim>(), "head dims 64 and 128");
  using L = DecodeLayout<kHeadDim, kWarps>;
  constexpr int kThreads = kWarps * kWarpSize;
  constexpr int kChunk = kMmaKeys * kWarps;  // keys a CTA step
  constexpr int kSteps = kHeadDim / 32;     // 32-dim steps of S^T = K Q^T (two MMAs each)
  constexpr int kOutTiles = kHeadDim / 16;  // 16-dim tiles of O^T = V^T P^T
  constexpr int kLaneDims = kHeadDim / 16;  // dims of a value row per lane, per row half
  constexpr int kLaneWords = kLaneDims / 2;
  using ValueLoad = std::conditional_t<kLaneDims == 8, uint4, uint2>;  // 16 or 8 bytes
  const int kv_head = blockIdx.y, split = blockIdx.z;
  const int group = num_heads / num_kv_heads;
  const int num_keys = position + 1;
  const int chunks = (num_keys + kChunk - 1) / kChunk;
  const int chunks_per_split = DecodeChunksPerSplit(chunks, num_splits, ctas, slots);
  const int active_splits = (chunks + chunks_per_split - 1) / chunks_per_split;
  if (split >= active_splits) return;  // (split 0 of the token waits for the prior kernel)
  const int key_begin = split * chunks_per_split * kChunk;
  const int key_end = min(key_begin + chunks_per_split * kChunk, num_keys);
  const KeyRows<kHeadDim> cache_rows(block_tables, max_blocks_per_seq, seq, block_size,
                                     num_kv_heads, kv_head);
  // -1 past the split's keys
  auto row_offset = [&](int key) -> int64_t {
    return key < key_end ? cache_rows.offset(key) : -1;
  };

  extern __shared__ __align__(128) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid % kWarpSize, warp = tid / kWarpSize;
  const int g = lane / 4, tq = lane % 4;

  const uint4 zero = make_uint4(0, 0, 0, 0);
  // The step's keys this lane loads: key g + 8 n of S = Q K^T (n = 0, 1) and value key
  // value_key(i) of O^T = V^T P^T (i = 0..3).
  auto value_key = [&](int i) { return 2 * tq + (i & 1) + 8 * (i >> 1); };
  const int row_stride = num_kv_heads * kHeadDim;
  // kStepInOneBlock (block_size a multiple of 16, which a step's first key is): the step's 16
  // keys are consecutive rows of one block, row_stride elements apart, so a step needs one
  // block-table entry, not one a key. The entries are read ahead, 32 steps at a time: lane l
  // holds that of the warp's step 32 w + l (window w), so a step's block is a shuffle away and
  // the table's latency stays off the chain that leads to its keys (ncu: 13% of the stall
  // samples waited on the entries when each step read its own).
  const int warp_key0 = key_begin + kMmaKeys * warp;
  auto window_blocks = [&](int window) {
    const int key = warp_key0 + (kWarpSize * window + lane) * kChunk;
    return kStepInOneBlock && key < key_end ? cache_rows.block_of(key) : 0;
  };
  int window = 0, window_block = window_blocks(0);
  // The row of the step's first key (kStepInOneBlock; every lane, steps in order).
  auto step_row = [&](int key0) -> int64_t {
    if (!kStepInOneBlock) return 0;
    const int step = (key0 - warp_key0) / kChunk;
    if (step / kWarpSize != window) {  // past 2,048 keys of the warp's split (8,192 of its CTA)
      window = step / kWarpSize;
      window_block = window_blocks(window);
    }
    return cache_rows.offset_in(__shfl_sync(kFullMask, window_block, step % kWarpSize), key0);
  };
  // Keys g and 8 + g of the step at key0 (first row `row`): dims 32 s + 8 t .. + 7. In one
  // block, keys past the split are read too (their rows exist; the scores mask them out).
  auto load_keys = [&](int key0, int64_t row, uint4 (&kr)[2][kSteps]) {
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      const int64_t off = kStepInOneBlock ? row + (8 * n + g) * row_stride
                                          : row_offset(key0 + 8 * n + g);
#pragma unroll
      for (int s = 0; s < kSteps; ++s) {
        const uint4* p = reinterpret_cast<const uint4*>(k_cache + off + 32 * s + 8 * tq);
        kr[n][s] = kStepInOneBlock || off >= 0 ? __ldcg(p) : zero;
      }
    }
  };
  // Values of keys 2 t, 2 t + 1, 2 t + 8, 2 t + 9 of the step (i = 0..3), dims
  // r * D / 16 .. + D / 16 - 1 for rows r = g (h = 0) and g + 8 (h = 1), as bf16 pairs; zeros
  // past the split (P is 0 there, and 0 times a stale NaN would not be).
  auto load_values = [&](int key0, int64_t row, uint32_t (&vr)[4][2][kLaneWords]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int key = key0 + value_key(i);
      const int64_t off = kStepInOneBlock
                              ? (key < key_end ? row + value_key(i) * row_stride : -1)
                              : row_offset(key);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        ValueLoad v{};
        if (off >= 0) {
          v = __ldcg(reinterpret_cast<const ValueLoad*>(v_cache + off +
                                                        (g + 8 * h) * kLaneDims));
        }
        *reinterpret_cast<ValueLoad*>(vr[i][h]) = v;
      }
    }
  };

  const float scale_log2 = scale * 1.4426950408889634f;
  float o[kOutTiles][4];
#pragma unroll
  for (int j = 0; j < kOutTiles; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  // of heads 2 t and 2 t + 1; run_sum: this lane's keys (g, g + 8) only
  float run_max[2] = {-INFINITY, -INFINITY}, run_sum[2] = {0.f, 0.f};

  int key0 = warp_key0;
  uint4 kr[2][kSteps];
  uint32_t vr[4][2][kLaneWords];
  // A warp whose first step lies wholly before the token's own key (written this step by the
  // qkv kernel) loads it before waiting for that kernel (programmatic dependent launch): those
  // keys and values were written by earlier steps, the block tables before the graph launched.
  const bool first_step_early = key0 + kMmaKeys <= position;
  const int64_t first_row = key0 < key_end ? step_row(key0) : 0;
  if (first_step_early) {
    load_keys(key0, first_row, kr);
    load_values(key0, first_row, vr);
  }
  AwaitPriorKernel();
  if (!first_step_early && key0 < key_end) {
    load_keys(key0, first_row, kr);
    load_values(key0, first_row, vr);
  }
  // Query head g of the group (zeros past it): dims 32 s + 8 t .. + 7.
  uint4 qr[kSteps];
#pragma unroll
  for (int s = 0; s < kSteps; ++s) {
    qr[s] = g < group ? *reinterpret_cast<const uint4*>(
                            q + (static_cast<size_t>(t) * num_heads + kv_head * group + g) *
                                    kHeadDim + 32 * s + 8 * tq)
                      : zero;
  }
  for (; key0 < key_end; key0 += kChunk) {
    const int next = key0 + kChunk;
    const int64_t next_row = next < key_end ? step_row(next) : 0;
    float sc[2][4];
    // S^T = K Q^T: the step's keys are the MMA's rows (lane (g, t): keys g and g + 8, the same
    // 16-byte loads as below), the group's heads its columns (Q^T's column g: head g), so no
    // MMA row is padding; sc[0] takes the .x/.y half of each 32-dim step, sc[1] the .z/.w half
    // (two chains of kSteps MMAs). Element e: key g + 8 (e / 2), head 2 t + e % 2.
    sc[0][0] = sc[0][1] = sc[0][2] = sc[0][3] = 0.f;
    sc[1][0] = sc[1][1] = sc[1][2] = sc[1][3] = 0.f;
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
      MmaBf16(sc[0], kr[0][s].x, kr[1][s].x, kr[0][s].y, kr[1][s].y, qr[s].x, qr[s].y);
      MmaBf16(sc[1], kr[0][s].z, kr[1][s].z, kr[0][s].w, kr[1][s].w, qr[s].z, qr[s].w);
    }
    if (next < key_end) load_keys(next, next_row, kr);

    // Online softmax of heads 2 t and 2 t + 1 over this step's keys (the eight lanes of a t
    // hold its 16 keys); the step's first key is live, so each new max is finite.
    const bool live_lo = key0 + g < key_end, live_hi = key0 + g + 8 < key_end;
    float p[4], alpha[2];
#pragma unroll
    for (int e = 0; e < 4; ++e)
      p[e] = (e < 2 ? live_lo : live_hi) ? (sc[0][e] + sc[1][e]) * scale_log2 : -INFINITY;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float step_max = fmaxf(p[h], p[2 + h]);
      step_max = fmaxf(step_max, __shfl_xor_sync(kFullMask, step_max, 4));
      step_max = fmaxf(step_max, __shfl_xor_sync(kFullMask, step_max, 8));
      step_max = fmaxf(step_max, __shfl_xor_sync(kFullMask, step_max, 16));
      const float new_max = fmaxf(run_max[h], step_max);
      alpha[h] = exp2f(run_max[h] - new_max);  // 0 on the first step
      run_max[h] = new_max;
    }
    // P rounded to bf16, heads 2 t, 2 t + 1 of key g (lo) and of key g + 8 (hi); transposed,
    // P^T's B fragment: column g (head g), keys 2 t, 2 t + 1 (lo) and 2 t + 8, 2 t + 9 (hi).
    const __nv_bfloat162 lo = __floats2bfloat162_rn(exp2f(p[0] - run_max[0]),
                                                    exp2f(p[1] - run_max[1]));
    const __nv_bfloat162 hi = __floats2bfloat162_rn(exp2f(p[2] - run_max[0]),
                                                    exp2f(p[3] - run_max[1]));
    const float2 rounded_lo = __bfloat1622float2(lo), rounded_hi = __bfloat1622float2(hi);
    run_sum[0] = run_sum[0] * alpha[0] + (rounded_lo.x + rounded_hi.x);
    run_sum[1] = run_sum[1] * alpha[1] + (rounded_lo.y + rounded_hi.y);
    const uint32_t pb[2] = {TransposeFragment16(*reinterpret_cast<const uint32_t*>(&lo)),
                            TransposeFragment16(*reinterpret_cast<const uint32_t*>(&hi))};

    // O^T = O^T * alpha + V^T P^T; this lane's accumulators are heads 2 t and 2 t + 1, whose
    // alphas it holds itself.
#pragma unroll
    for (int j = 0; j < kOutTiles; ++j) {
      const uint32_t sel = j % 2 ? 0x7632u : 0x5410u;  // the high or low bf16 of each word
      const int w = j / 2;
      o[j][0] *= alpha[0];
      o[j][1] *= alpha[1];
      o[j][2] *= alpha[0];
      o[j][3] *= alpha[1];
      MmaBf16(o[j], __byte_perm(vr[0][0][w], vr[1][0][w], sel),
              __byte_perm(vr[0][1][w], vr[1][1][w], sel),
              __byte_perm(vr[2][0][w], vr[3][0][w], sel),
              __byte_perm(vr[2][1][w], vr[3][1][w], sel), pb[0], pb[1]);
    }
    if (next < key_end) load_values(next, next_row, vr);
  }

  // Each head's sum over the eight lanes of its t; then the warps' (max, sum, output) meet in
  // shared memory (a warp without keys: max -inf, sum 0, output 0).
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int lanes = 4; lanes < kWarpSize; lanes *= 2)
      run_sum[h] += __shfl_xor_sync(kFullMask, run_sum[h], lanes);
  float* s_out = reinterpret_cast<float*>(smem + L::kWarpOut);
  float* s_max = reinterpret_cast<float*>(smem + L::kWarpMax);
  float* s_sum = reinterpret_cast<float*>(smem + L::kWarpSum);
#pragma unroll
  for (int e = 0; e < 2; ++e) {  // heads 2 t + e
    if (2 * tq + e < group) {
      float* row = s_out + (warp * kDecodeMaxGroup + 2 * tq + e) * kHeadDim;
#pragma unroll
      for (int j = 0; j < kOutTiles; ++j) {
        row[g * kLaneDims + j] = o[j][e];
        row[(g + 8) * kLaneDims + j] = o[j][2 + e];
      }
    }
  }
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    if (g == 0 && 2 * tq + e < group) {
      s_max[warp * kDecodeMaxGroup + 2 * tq + e] = run_max[e];
      s_sum[warp * kDecodeMaxGroup + 2 * tq + e] = run_sum[e];
    }
  }
  __syncthreads();
  const size_t head0 = static_cast<size_t>(t) * num_heads + kv_head * group;
  for (int e = tid; e < group * kHeadDim; e += kThreads) {
    const int h = e / kHeadDim, d = e % kHeadDim;
    float cta_max = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) cta_max = fmaxf(cta_max, s_max[w * kDecodeMaxGroup + h]);
    float v = 0.f, sum = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float weight = exp2f(s_max[w * kDecodeMaxGroup + h] - cta_max);  // 0 at -inf
      v += weight * s_out[(w * kDecodeMaxGroup + h) * kHeadDim + d];
      sum += weight * s_sum[w * kDecodeMaxGroup + h];
    }
    if (active_splits == 1) {
      out[(head0 + h) * kHeadDim + d] = __float2bfloat16(v / sum);
    } else {
      const size_t part = (head0 + h) * num_splits + split;
      partial_out[part * kHeadDim + d] = v;
      if (d == 0) {
        partial_stats[2 * part] = cta_max;
        partial_stats[2 * part + 1] = sum;
      }
    }
  }
  if (active_splits == 1) return;
  // The last of the token's splits to arrive merges them.
  uint32_t* sem = tile_sems + static_cast<size_t>(t) * num_kv_heads + kv_head;
  if (!LastSplitToArrive(sem, active_splits)) return;
  MergeDecodeSplitsCta<kHeadDim>(t, kv_head, group, num_heads, num_splits, active_splits,
                                 partial_out, partial_stats, out,
                                 reinterpret_cast<float*>(smem + L::kMergeWeights));
  if (tid == 0) *sem = 0;
}

// Dynamic shared memory of the attention kernel: the more of the decode path's and the mma.sync
// query tiles' (a CTA takes one path), or the WMMA query tiles' for the other head dims.
template <int kHeadDim, int kRows, int kWarps>
__host__ __device__ constexpr size_t AttentionKernelSmem() {
  if constexpr (MmaPathsFit<kHeadDim>()) {
    return DecodeLayout<kHeadDim, kWarps>::kBytes > TileStages<kHeadDim, kRows>::kBytes
               ? DecodeLayout<kHeadDim, kWarps>::kBytes
               : TileStages<kHeadDim, kRows>::kBytes;
  } else {
    return AttentionSmem<kHeadDim, kRows>::kBytes;
  }
}

// The attention kernel's body: grid (bucket, num_kv_heads, num_splits), kWarps * 32 threads
// (kAttnWarps, or kAttnWideWarps<kHeadDim> with kRows = kAttnRowsSmall: the wide kernel),
// AttentionKernelSmem<kHeadDim, kRows, kWarps>() bytes of dynamic shared memory. A token alone
// in its sequence this step that attends to at least decode_min_keys keys goes to
// DecodeAttentionCta when its GQA group fits; every other token belongs to a query tile
// (TileAttentionMmaCta for head dims 64 and 128, PagedAttentionCta for the others).
// (gpu_engine/cuda_forward.py sets the threshold: 0, the decode path is the faster one at every
// context measured.) slots: the CTAs of this kernel the GPU holds at once (CTAs an SM x SMs).
// kStepInOneBlock: block_size is a multiple of kMmaKeys (the host picks the kernel by block
// size), and the decode path reads a warp step's keys from one block (DecodeAttentionCta).
// Each block layout is its own kernel. With both decode variants in one kernel (chosen by
// block_size at run time) every step ran slower, though only one variant ever ran and its loop
// compiled the same. On the H200 (bench_decode, block size 16, ms a step): 8B batch 1 at 512
// and 8,192 keys 3.959 -> 3.920 and 4.313 -> 4.222, 32 x 512 5.446 -> 5.327; 1B 0.831 ->
// 0.816, 0.905 -> 0.887 and 1.325 -> 1.269 (docs/performance.md, round 6).
template <int kHeadDim, int kRows, bool kStepInOneBlock, int kWarps>
__device__ __forceinline__ void AttentionCta(
    const BatchDesc* desc, const int32_t* positions, const int32_t* token_seq,
    const int32_t* block_tables, int max_blocks_per_seq, const bf16* q, const bf16* k_cache,
    const bf16* v_cache, int block_size, int num_heads, int num_kv_heads, float scale, bf16* out,
    int num_splits, float* partial_out, float* partial_stats, uint32_t* tile_sems,
    int decode_min_keys, int slots) {
  // Everything the path choice needs, loaded at once (one memory latency, not a chain): rows
  // up to the bucket exist, so t - 1 and t + 1 may be read before the bounds test. The batch
  // arrays are written before the graph launches, so these loads precede the wait for the
  // previous kernel (programmatic dependent launch); each path waits before it reads what the
  // step's earlier kernels wrote.
  const int t = blockIdx.x, bucket = gridDim.x;
  const int num_tokens = desc->num_tokens;
  const int seq = token_seq[t];
  const int prev_seq = t > 0 ? token_seq[t - 1] : -1;
  const int next_seq = t + 1 < bucket ? token_seq[t + 1] : -1;
  const int position = positions[t];
  if (t >= num_tokens) {
    AwaitPriorKernel();  // an empty batch's grid must not complete before its predecessor
    return;
  }
  if constexpr (MmaPathsFit<kHeadDim>()) {
    const bool alone = prev_seq != seq && (t + 1 == num_tokens || next_seq != seq);
    if (alone && num_heads / num_kv_heads <= kDecodeMaxGroup &&
        position + 1 >= decode_min_keys) {
      DecodeAttentionCta<kHeadDim, kStepInOneBlock, kWarps>(
          t, seq, position, block_tables, max_blocks_per_seq, q, k_cache, v_cache, block_size,
          num_heads, num_kv_heads, scale, out, num_splits, num_tokens * num_kv_heads, slots,
          partial_out, partial_stats, tile_sems);
      return;
    }
  }
  AwaitPriorKernel();  // the query tiles read this step's keys, values and q throughout
  if constexpr (MmaPathsFit<kHeadDim>()) {
    TileAttentionMmaCta<kHeadDim, kRows, kWarps>(desc, positions, token_seq, block_tables,
                                                 max_blocks_per_seq, q, k_cache, v_cache,
                                                 block_size, num_heads, num_kv_heads, scale,
                                                 out, num_splits, partial_out, partial_stats,
                                                 tile_sems);
  } else {
    static_assert(kWarps == kAttnWarps, "the WMMA query tiles run on kAttnWarps warps");
    PagedAttentionCta<kHeadDim, kRows>(desc, positions, token_seq, block_tables,
                                       max_blocks_per_seq, q, k_cache, v_cache, block_size,
                                       num_heads, num_kv_heads, scale, out, num_splits,
                                       partial_out, partial_stats, tile_sems);
  }
}

}  // namespace blink
