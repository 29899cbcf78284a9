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
// Decode tokens (a sequence with a single token in the batch) take a separate path in the same
// kernel, DecodeAttentionCta: no query tile to fill, so CUDA cores instead of tensor cores, one
// pass of each key and value row from the cache for all query heads of the KV head's group, and
// many CTAs per sequence (flash-decoding): grid.z splits the keys into ranges of whole 64-key
// tiles.
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
// ones, where a tile rarely has more rows and the smaller footprint fits 4 CTAs per SM.
static constexpr int kAttnRows = 64;
static constexpr int kAttnRowsSmall = 16;
static constexpr int kAttnKeys = 64;     // keys per shared-memory tile
static constexpr int kAttnThreads = 128;
static constexpr int kAttnWarps = kAttnThreads / kWarpSize;
// CTAs per SM the kernel's registers must allow (a register cap of 168 per thread at 3; head
// dims above 128 need more than that without spilling)
template <int kHeadDim>
static constexpr int kAttnMinCtas = kHeadDim > 128 ? 2 : 3;

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

// Merges the split partials of one tile: `m` tokens from t0, the `group` query heads of
// kv_head. out = sum_z 2^(m_z - M) O_z / sum_z 2^(m_z - M) l_z with M = max_z m_z over the
// tile's active splits; a split that saw no unmasked key of a row (m_z = -inf) weighs nothing
// and its partial output is not read. Other CTAs wrote the partials: read through L2 (ld.cg).
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
    const float* stats = partial_stats + head * num_splits * 2;
    float max_all = -INFINITY;
    for (int z = 0; z < active_splits; ++z) max_all = fmaxf(max_all, __ldcg(stats + 2 * z));
    float acc[kPerLane] = {};
    float total = 0.f;
    for (int z = 0; z < active_splits; ++z) {
      const float mz = __ldcg(stats + 2 * z);
      if (mz == -INFINITY) continue;
      const float w = exp2f(mz - max_all);
      total += w * __ldcg(stats + 2 * z + 1);
      const float* o = partial_out + (head * num_splits + z) * kHeadDim;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        const int c = lane + kWarpSize * i;
        if (c < kHeadDim) acc[i] += w * __ldcg(o + c);
      }
    }
    const float inv_total = 1.f / total;
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
  const int active_splits = (num_keys + split_keys - 1) / split_keys;
  if (split >= active_splits) return;  // uniform over the CTA
  const int key_begin = split * split_keys;
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

// --- decode tokens -------------------------------------------------------------------------

static constexpr int kDecodeMaxGroup = 8;    // larger GQA groups take the tile path
static constexpr int kDecodeMaxSplits = 64;  // the host's attention_splits() stays within it

// The decode path splits a head vector over lanes in 16-byte pieces: head dims whose piece count
// divides the warp (16, 32, 64, 128, 256); others take the tile path for every token.
template <int kHeadDim>
__host__ __device__ constexpr bool DecodePathFits() {
  return kHeadDim % 8 == 0 && kHeadDim / 8 <= kWarpSize && kWarpSize % (kHeadDim / 8) == 0;
}

// 16 bytes global -> shared without passing through registers (cp.async, cached in L2 only);
// `valid` false writes zeros and reads nothing.
__device__ __forceinline__ void CopyAsync16(void* smem_dst, const void* src, bool valid) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
               :: "r"(dst), "l"(src), "r"(valid ? 16 : 0) : "memory");
}
__device__ __forceinline__ void CopyAsyncCommit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void CopyAsyncWait() {
  asm volatile("cp.async.wait_group %0;" :: "n"(kPending) : "memory");
}

__host__ __device__ constexpr size_t MaxBytes(size_t a, size_t b) { return a > b ? a : b; }

// Sums kValues partial values (one per query head) over the kLanes consecutive lanes that share
// a key, with kValues - 1 + log2(kLanes / kValues) shuffles instead of kValues * log2(kLanes):
// while more than one value is left, each exchange hands the partner the half it keeps and keeps
// the other half. Afterwards a lane holds kKept sums, of heads *first_head .. + kKept - 1; the
// lanes of a key hold each head's sum several times when kLanes > kValues, and `*writer` marks
// one lane per head. v: [kValues], results in v[0 .. kKept).
template <int kValues, int kLanes>
struct TransposedLaneSum {
  static constexpr int kKept = kValues > kLanes ? kValues / kLanes : 1;

  __device__ __forceinline__ static void Run(float (&v)[kValues], int lane, int* first_head,
                                             bool* writer) {
    int head = 0;
    bool lead = true;
    int count = kValues;  // constant in each unrolled step
#pragma unroll
    for (int o = kLanes / 2; o >= 1; o >>= 1) {
      const bool upper = (lane & o) != 0;
      if (count > 1) {
        const int half = count / 2;
#pragma unroll
        for (int i = 0; i < kValues / 2; ++i) {
          if (i < half) {
            const float keep = upper ? v[i + half] : v[i];
            const float give = upper ? v[i] : v[i + half];
            v[i] = keep + __shfl_xor_sync(kFullMask, give, o);
          }
        }
        head += upper ? half : 0;
        count = half;
      } else {
        v[0] += __shfl_xor_sync(kFullMask, v[0], o);
        lead = lead && !upper;
      }
    }
    *first_head = head;
    *writer = lead;
  }
};

// Thread roles of DecodeAttentionCta: kLanesPerKey threads share one key (16 bytes of it each),
// kKeysPerPass keys per pass of the CTA, kUnroll passes per key tile. A tile's keys and values
// are staged in shared memory by cp.async, kStages tiles deep, each thread copying and reading
// only its own 16-byte pieces (so only the scores need barriers). Regions in bytes; after the
// tile loop the staging area is reused for the cross-warp sums and the split merge.
template <int kHeadDim, int kGroup>
struct DecodeLayout {
  static constexpr int kLanesPerKey = kHeadDim / 8;
  static_assert(kLanesPerKey <= kWarpSize && kWarpSize % kLanesPerKey == 0, "keys within warps");
  static constexpr int kKeysPerPass = kAttnThreads / kLanesPerKey;
  // 4 passes (2 for groups of 8, whose accumulators take twice the registers) within the
  // register cap of kAttnMinCtas CTAs per SM
  static constexpr int kMaxUnroll = kGroup >= 8 ? 2 : 4;
  static constexpr int kUnroll = 64 / kKeysPerPass < 1 ? 1 : (64 / kKeysPerPass > kMaxUnroll
                                                                ? kMaxUnroll : 64 / kKeysPerPass);
  static constexpr int kTileKeys = kKeysPerPass * kUnroll;  // <= 64: two per lane in softmax
  // 4 stages: 3 tiles in flight while one is computed on. 2 left the loads of 3 CTAs per SM
  // too few to cover the memory latency under load (measured: 8B shape, batch 32, 55 us/layer
  // for 64 MB, 1.2 TB/s).
  static constexpr int kStages = 4;
  static constexpr size_t kStageBytes = sizeof(bf16) * 2 * kTileKeys * kHeadDim;  // K then V
  // The staging area, reused after the tile loop for the cross-warp sums
  // (f32 [kAttnWarps][kGroup][kHeadDim]) and then for the split merge (f32 [2][kGroup][splits]).
  static constexpr size_t kReduceBytes = sizeof(float) * kAttnWarps * kGroup * kHeadDim;
  static constexpr size_t kMergeBytes = sizeof(float) * 2 * kGroup * kDecodeMaxSplits;
  static constexpr size_t kReusedBytes =
      MaxBytes(MaxBytes(kStages * kStageBytes, kReduceBytes), kMergeBytes);
  static constexpr size_t kStaging = 0, kReduce = 0, kMergeWeights = 0;
  static constexpr size_t kScores = kReusedBytes;  // f32 [2][kGroup][kTileKeys]
  static constexpr size_t kMax = kScores + sizeof(float) * 2 * kGroup * kTileKeys;
  static constexpr size_t kSum = kMax + sizeof(float) * kGroup;
  static constexpr size_t kAlpha = kSum + sizeof(float) * kGroup;
  static constexpr size_t kBytes = kAlpha + sizeof(float) * kGroup;
};

// The last CTA of a decode token's splits merges them, all threads at once (this runs on the
// critical path of every decode step): the splits' (max, sum) become normalized weights
// w_z = 2^(m_z - M) / sum_z' 2^(m_z' - M) l_z' in shared memory, then every output element is
// a weighted sum of independent L2 reads. Every split of a decode token saw a live key, so each
// m_z is finite. s_weight, s_max: [kGroup][kDecodeMaxSplits] f32 each.
template <int kHeadDim>
__device__ __forceinline__ void MergeDecodeSplitsCta(int t, int kv_head, int group,
                                                     int num_heads, int num_splits,
                                                     int active_splits, const float* partial_out,
                                                     const float* partial_stats, bf16* out,
                                                     float* s_weight, float* s_max) {
  const size_t head0 = static_cast<size_t>(t) * num_heads + kv_head * group;
  for (int i = threadIdx.x; i < group * active_splits; i += blockDim.x) {
    const int g = i / active_splits, z = i % active_splits;
    const float* stat = partial_stats + 2 * ((head0 + g) * num_splits + z);
    s_max[g * kDecodeMaxSplits + z] = __ldcg(stat);
    s_weight[g * kDecodeMaxSplits + z] = __ldcg(stat + 1);  // l_z until turned into w_z
  }
  __syncthreads();
  if (threadIdx.x < group) {
    float* m = s_max + threadIdx.x * kDecodeMaxSplits;
    float* w = s_weight + threadIdx.x * kDecodeMaxSplits;
    float max_all = -INFINITY;
    for (int z = 0; z < active_splits; ++z) max_all = fmaxf(max_all, m[z]);
    float total = 0.f;
    for (int z = 0; z < active_splits; ++z) {
      const float scale = exp2f(m[z] - max_all);
      total += scale * w[z];
      w[z] = scale;
    }
    const float inv_total = 1.f / total;
    for (int z = 0; z < active_splits; ++z) w[z] *= inv_total;
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
// split of its keys: keys [0, positions[t]] in tiles of kTileKeys, tiles dealt to the
// num_splits CTAs (grid.z) in contiguous ranges. Scores in fp32 with the online softmax per
// tile; P V on CUDA cores in fp32. The next tile's keys and values are in flight (cp.async)
// while this one is computed, and its block-table entries one tile further ahead. group <=
// kGroup <= kDecodeMaxGroup. Workspaces as in PagedAttentionCta; shared memory:
// DecodeLayout<kHeadDim, kGroup>::kBytes of the dynamic buffer.
template <int kHeadDim, int kGroup>
__device__ __forceinline__ void DecodeAttentionCta(
    int t, int seq, int position, const int32_t* block_tables, int max_blocks_per_seq,
    const bf16* q, const bf16* k_cache, const bf16* v_cache, int block_size, int num_heads,
    int num_kv_heads, float scale, bf16* out, int num_splits, float* partial_out,
    float* partial_stats, uint32_t* tile_sems) {
  using L = DecodeLayout<kHeadDim, kGroup>;
  constexpr int kLanes = L::kLanesPerKey, kPass = L::kKeysPerPass, kUnroll = L::kUnroll;
  constexpr int kTile = L::kTileKeys;
  const int kv_head = blockIdx.y, split = blockIdx.z;
  const int group = num_heads / num_kv_heads;
  const int num_keys = position + 1;
  const int tiles = (num_keys + kTile - 1) / kTile;
  const int tiles_per_split = (tiles + num_splits - 1) / num_splits;
  const int active_splits = (tiles + tiles_per_split - 1) / tiles_per_split;
  if (split >= active_splits) return;
  const int key_begin = split * tiles_per_split * kTile;
  const int key_end = min(key_begin + tiles_per_split * kTile, num_keys);
  const int my_tiles = (key_end - key_begin + kTile - 1) / kTile;
  const int32_t* table = block_tables + static_cast<size_t>(seq) * max_blocks_per_seq;

  extern __shared__ __align__(128) unsigned char smem[];
  bf16* s_staging = reinterpret_cast<bf16*>(smem + L::kStaging);
  float* s_scores = reinterpret_cast<float*>(smem + L::kScores);
  float* s_max = reinterpret_cast<float*>(smem + L::kMax);
  float* s_sum = reinterpret_cast<float*>(smem + L::kSum);
  float* s_alpha = reinterpret_cast<float*>(smem + L::kAlpha);

  const int tid = threadIdx.x, lane = tid % kWarpSize, warp = tid / kWarpSize;
  const int key_lane = tid / kLanes, col = (tid % kLanes) * 8;

  // Key -> (block, row): shifts for the usual power-of-two block sizes, a division otherwise.
  const bool pow2_blocks = (block_size & (block_size - 1)) == 0;
  const int block_shift = __ffs(block_size) - 1;
  auto block_index = [&](int key) { return pow2_blocks ? key >> block_shift : key / block_size; };
  auto block_row = [&](int key) { return pow2_blocks ? key & (block_size - 1) : key % block_size; };
  // Block ids of this thread's keys in tile i of the split (-1 past the end).
  auto fetch_blocks = [&](int i, int (&blocks)[kUnroll]) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int key = key_begin + i * kTile + key_lane + u * kPass;
      blocks[u] = i < my_tiles && key < key_end ? table[block_index(key)] : -1;
    }
  };
  // This thread's 16-byte pieces of tile i's keys and values into stage i % kStages, as one
  // commit group (empty past the last tile, so that groups and tiles stay in step).
  auto stage = [&](int i, const int (&blocks)[kUnroll]) {
    bf16* k_dst = s_staging + (i % L::kStages) * 2 * kTile * kHeadDim;
    bf16* v_dst = k_dst + kTile * kHeadDim;
    if (i < my_tiles) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int j = key_lane + u * kPass, key = key_begin + i * kTile + j;
        const bool valid = blocks[u] >= 0;
        const size_t off = valid ? ((static_cast<size_t>(blocks[u]) * block_size +
                                     block_row(key)) * num_kv_heads + kv_head) * kHeadDim + col
                                 : 0;
        CopyAsync16(k_dst + j * kHeadDim + col, k_cache + off, valid);
        CopyAsync16(v_dst + j * kHeadDim + col, v_cache + off, valid);
      }
    }
    CopyAsyncCommit();
  };

  // Block ids of the first kStages - 1 tiles, all loads in flight at once.
  int first_blocks[L::kStages - 1][kUnroll];
#pragma unroll
  for (int i = 0; i < L::kStages - 1; ++i) fetch_blocks(i, first_blocks[i]);
  // this lane's 8 dims of each query head of the group, as floats (zeros past the group), and
  // scale * log2(e) applied to each score
  const float scale_log2 = scale * 1.4426950408889634f;
  float qf[kGroup][8], acc[kGroup][8];
#pragma unroll
  for (int g = 0; g < kGroup; ++g) {
#pragma unroll
    for (int i = 0; i < 8; ++i) qf[g][i] = acc[g][i] = 0.f;
    if (g < group) {
      LoadBf16x8(q + (static_cast<size_t>(t) * num_heads + kv_head * group + g) * kHeadDim + col,
                 qf[g]);
    }
  }
#pragma unroll
  for (int i = 0; i < L::kStages - 1; ++i) stage(i, first_blocks[i]);
  int blocks[kUnroll];  // of tile i + kStages - 1 during iteration i
  fetch_blocks(L::kStages - 1, blocks);
  if (tid < kGroup) {
    s_max[tid] = -INFINITY;
    s_sum[tid] = 0.f;
  }

  for (int i = 0; i < my_tiles; ++i) {
    const int key0 = key_begin + i * kTile;
    stage(i + L::kStages - 1, blocks);
    fetch_blocks(i + L::kStages, blocks);
    // tile i has landed (this thread's pieces, the only ones it reads): of the groups
    // committed so far only the newest kStages - 1 (tiles i + 1 ..) may still be in flight
    CopyAsyncWait<L::kStages - 1>();
    const bf16* k_tile = s_staging + (i % L::kStages) * 2 * kTile * kHeadDim;
    const bf16* v_tile = k_tile + kTile * kHeadDim;
    float* scores = s_scores + (i % 2) * kGroup * kTile;  // [kGroup][kTile], double-buffered
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int j = key_lane + u * kPass;
      float kf[8];
      LoadBf16x8(k_tile + j * kHeadDim + col, kf);
      float dots[kGroup];
#pragma unroll
      for (int g = 0; g < kGroup; ++g) {
        dots[g] = 0.f;
#pragma unroll
        for (int c = 0; c < 8; ++c) dots[g] = fmaf(qf[g][c], kf[c], dots[g]);
      }
      using Sum = TransposedLaneSum<kGroup, kLanes>;
      int first_head;
      bool writer;
      Sum::Run(dots, lane, &first_head, &writer);
      if (writer) {
#pragma unroll
        for (int h = 0; h < Sum::kKept; ++h) {
          if (first_head + h < group) {
            scores[(first_head + h) * kTile + j] =
                key0 + j < key_end ? dots[h] * scale_log2 : -INFINITY;
          }
        }
      }
    }
    __syncthreads();
    // Online softmax, one warp per head: every tile holds at least one live key (key0 < key_end),
    // so the new max is finite; masked keys give p = 0, and alpha = 0 on the first tile.
    for (int g = warp; g < group; g += kAttnWarps) {
      float* row = scores + g * kTile;
      const float s0 = lane < kTile ? row[lane] : -INFINITY;
      const float s1 = lane + kWarpSize < kTile ? row[lane + kWarpSize] : -INFINITY;
      const float old_max = s_max[g];
      const float new_max = fmaxf(old_max, WarpMax(fmaxf(s0, s1)));
      const float p0 = exp2f(s0 - new_max), p1 = exp2f(s1 - new_max);
      if (lane < kTile) row[lane] = p0;
      if (lane + kWarpSize < kTile) row[lane + kWarpSize] = p1;
      const float p_sum = WarpSum(p0 + p1);
      if (lane == 0) {
        const float alpha = exp2f(old_max - new_max);
        s_max[g] = new_max;
        s_sum[g] = s_sum[g] * alpha + p_sum;
        s_alpha[g] = alpha;
      }
    }
    __syncthreads();
    // acc += P V over this lane's keys (masked keys: p = 0 times zero-filled values). The next
    // tile writes the other score buffer, and s_alpha only after its first barrier.
#pragma unroll
    for (int g = 0; g < kGroup; ++g) {
      if (g >= group) continue;
      const float alpha = s_alpha[g];
#pragma unroll
      for (int c = 0; c < 8; ++c) acc[g][c] *= alpha;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int j = key_lane + u * kPass;
      float vf[8];
      LoadBf16x8(v_tile + j * kHeadDim + col, vf);
#pragma unroll
      for (int g = 0; g < kGroup; ++g) {
        if (g >= group) continue;
        const float p = scores[g * kTile + j];
#pragma unroll
        for (int c = 0; c < 8; ++c) acc[g][c] = fmaf(p, vf[c], acc[g][c]);
      }
    }
  }

  // Sum the key lanes: within the warp by shuffles, across warps in shared memory (the staging
  // area: every copy has landed and been read once all threads pass the barrier).
#pragma unroll
  for (int g = 0; g < kGroup; ++g)
#pragma unroll
    for (int c = 0; c < 8; ++c)
#pragma unroll
      for (int o = kLanes; o < kWarpSize; o <<= 1)
        acc[g][c] += __shfl_xor_sync(kFullMask, acc[g][c], o);
  __syncthreads();
  float* s_reduce = reinterpret_cast<float*>(smem + L::kReduce);  // [warp][kGroup][kHeadDim]
  if (lane < kLanes) {
#pragma unroll
    for (int g = 0; g < kGroup; ++g)
#pragma unroll
      for (int c = 0; c < 8; ++c) s_reduce[(warp * kGroup + g) * kHeadDim + col + c] = acc[g][c];
  }
  __syncthreads();
  const size_t head0 = static_cast<size_t>(t) * num_heads + kv_head * group;
  for (int e = tid; e < group * kHeadDim; e += kAttnThreads) {
    const int g = e / kHeadDim, d = e % kHeadDim;
    float v = 0.f;
#pragma unroll
    for (int w = 0; w < kAttnWarps; ++w) v += s_reduce[(w * kGroup + g) * kHeadDim + d];
    if (active_splits == 1) {
      out[(head0 + g) * kHeadDim + d] = __float2bfloat16(v / s_sum[g]);
    } else {
      const size_t part = (head0 + g) * num_splits + split;
      partial_out[part * kHeadDim + d] = v;
      if (d == 0) {
        partial_stats[2 * part] = s_max[g];
        partial_stats[2 * part + 1] = s_sum[g];
      }
    }
  }
  if (active_splits == 1) return;
  // The last of the token's splits to arrive merges them.
  uint32_t* sem = tile_sems + static_cast<size_t>(t) * num_kv_heads + kv_head;
  if (!LastSplitToArrive(sem, active_splits)) return;
  float* s_weight = reinterpret_cast<float*>(smem + L::kMergeWeights);
  MergeDecodeSplitsCta<kHeadDim>(t, kv_head, group, num_heads, num_splits, active_splits,
                                 partial_out, partial_stats, out, s_weight,
                                 s_weight + kGroup * kDecodeMaxSplits);
  if (tid == 0) *sem = 0;
}

// Dynamic shared memory of the attention kernel: the larger of its two paths' needs.
template <int kHeadDim, int kRows>
__host__ __device__ constexpr size_t AttentionKernelSmem() {
  if constexpr (DecodePathFits<kHeadDim>()) {
    // every group bound the dispatcher instantiates (their tiles differ, so any may be largest)
    return MaxBytes(MaxBytes(AttentionSmem<kHeadDim, kRows>::kBytes,
                             MaxBytes(DecodeLayout<kHeadDim, 1>::kBytes,
                                      DecodeLayout<kHeadDim, 2>::kBytes)),
                    MaxBytes(DecodeLayout<kHeadDim, 4>::kBytes, DecodeLayout<kHeadDim, 8>::kBytes));
  } else {
    return AttentionSmem<kHeadDim, kRows>::kBytes;
  }
}

// The attention kernel's body: grid (bucket, num_kv_heads, num_splits), kAttnThreads threads,
// AttentionKernelSmem<kHeadDim, kRows>() bytes of dynamic shared memory. A token alone in its
// sequence this step that attends to at least decode_min_keys keys goes to DecodeAttentionCta
// when its GQA group fits; every other token belongs to a query tile of PagedAttentionCta.
// (Measured on the H200: the tensor-core tiles are faster up to ~2k keys, the pipelined
// decode path beyond; gpu_engine/cuda_forward.py sets the threshold.)
template <int kHeadDim, int kRows>
__device__ __forceinline__ void AttentionCta(
    const BatchDesc* desc, const int32_t* positions, const int32_t* token_seq,
    const int32_t* block_tables, int max_blocks_per_seq, const bf16* q, const bf16* k_cache,
    const bf16* v_cache, int block_size, int num_heads, int num_kv_heads, float scale, bf16* out,
    int num_splits, float* partial_out, float* partial_stats, uint32_t* tile_sems,
    int decode_min_keys) {
  // Everything the path choice needs, loaded at once (one memory latency, not a chain): rows
  // up to the bucket exist, so t - 1 and t + 1 may be read before the bounds test.
  const int t = blockIdx.x, bucket = gridDim.x;
  const int num_tokens = desc->num_tokens;
  const int seq = token_seq[t];
  const int prev_seq = t > 0 ? token_seq[t - 1] : -1;
  const int next_seq = t + 1 < bucket ? token_seq[t + 1] : -1;
  const int position = positions[t];
  if (t >= num_tokens) return;
  if constexpr (DecodePathFits<kHeadDim>()) {
    const bool alone = prev_seq != seq && (t + 1 == num_tokens || next_seq != seq);
    const int group = num_heads / num_kv_heads;
    // one dispatch point: the runtime group becomes the template bound kGroup >= group
    auto decode = [&](auto bound) {
      DecodeAttentionCta<kHeadDim, decltype(bound)::value>(
          t, seq, position, block_tables, max_blocks_per_seq, q, k_cache, v_cache, block_size,
          num_heads, num_kv_heads, scale, out, num_splits, partial_out, partial_stats,
          tile_sems);
    };
    if (alone && group <= kDecodeMaxGroup && position + 1 >= decode_min_keys) {
      // (the same bounds AttentionKernelSmem sizes shared memory for)
      static_assert(kDecodeMaxGroup == 8, "bounds 1, 2, 4, 8");
      if (group == 1) decode(std::integral_constant<int, 1>{});
      else if (group == 2) decode(std::integral_constant<int, 2>{});
      else if (group <= 4) decode(std::integral_constant<int, 4>{});
      else decode(std::integral_constant<int, 8>{});
      return;
    }
  }
  PagedAttentionCta<kHeadDim, kRows>(desc, positions, token_seq, block_tables,
                                     max_blocks_per_seq, q, k_cache, v_cache, block_size,
                                     num_heads, num_kv_heads, scale, out, num_splits,
                                     partial_out, partial_stats, tile_sems);
}

}  // namespace blink
