// The attention kernel's query tiles (attention.cuh): prefill chunks, and the decode tokens of
// GQA groups over the decode path's bound. Head dims 64 and 128 run them on mma.sync, keys and
// values copied into shared memory a tile ahead (TileAttentionMmaCta); other head dims on WMMA
// through shared memory (PagedAttentionCta). A tile whose keys span several splits has its
// partials merged by the last of its CTAs to finish (FinishSplitCta).
#pragma once
#include <mma.h>

#include <type_traits>

#include "attention_common.cuh"
#include "wgmma.cuh"

namespace blink {

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

// Shared memory of a split tile's merge (CombineTileCta), after the tile's own work: each row's
// splits' weights, f32 [kRows][kAttnMaxSplits].
template <int kRows>
__host__ __device__ constexpr size_t TileMergeSmem() {
  return sizeof(float) * kRows * kAttnMaxSplits;
}

// Merges the split partials of one tile: `m` tokens from t0, the `group` query heads of
// kv_head. out = sum_z 2^(m_z - M) O_z / sum_z 2^(m_z - M) l_z with M = max_z m_z over the
// tile's active splits (<= kAttnMaxSplits; split 0 holds key 0, so M is finite); a split that
// saw no unmasked key of a row (m_z = -inf, its partial output zeros) weighs nothing. Other
// CTAs wrote the partials: read through L2 (ld.cg). Two passes, each a few round trips
// whatever the tile's rows: a thread per row turns its splits' (max, sum) into normalized
// weights in shared memory (s_weight: TileMergeSmem), then each thread sums its output
// elements (4 consecutive dims each, kMergeBatch of them at once) split by split, so that a
// split's loads of all of them are in flight together. (A warp per row, as this merge was
// before, took a round trip per row and 8 splits: 16 in series for a 64-row tile.)
// split_stride: the workspace's splits per query row.
template <int kHeadDim>
__device__ __noinline__ void CombineTileCta(int t0, int m, int kv_head, int group,
                                               int num_heads, int split_stride,
                                               int active_splits, const float* partial_out,
                                               const float* partial_stats, bf16* out,
                                               float* s_weight) {
  constexpr int kMergeBatch = 8;
  const int rows = m * group;
  auto head_of = [&](int r) {  // query row r of the tile: its (token, head) row of out
    return static_cast<size_t>(t0 + r / group) * num_heads + kv_head * group + r % group;
  };
  for (int r = threadIdx.x; r < rows; r += blockDim.x) {
    const float2* stats =
        reinterpret_cast<const float2*>(partial_stats) + head_of(r) * split_stride;
    float* weight = s_weight + r * kAttnMaxSplits;
    // M and sum_z 2^(m_z - M) l_z in one pass, rescaled as M grows (split 0's m_z is finite).
    // kMergeBatch splits' loads at once, ahead of their sums: weight is a generic pointer,
    // whose stores the compiler would otherwise keep the next split's load behind (a round
    // trip a split)
    float max_all = -INFINITY, total = 0.f;
    for (int z0 = 0; z0 < active_splits; z0 += kMergeBatch) {
      float2 st[kMergeBatch];
#pragma unroll
      for (int b = 0; b < kMergeBatch; ++b)
        if (z0 + b < active_splits) st[b] = __ldcg(stats + z0 + b);
#pragma unroll
      for (int b = 0; b < kMergeBatch && z0 + b < active_splits; ++b) {
        weight[z0 + b] = st[b].x;
        if (st[b].x > max_all) {
          total *= exp2f(max_all - st[b].x);
          max_all = st[b].x;
        }
        total += exp2f(st[b].x - max_all) * st[b].y;  // 0 at -inf
      }
    }
    const float inv_total = 1.f / total;
    for (int z = 0; z < active_splits; ++z) weight[z] = exp2f(weight[z] - max_all) * inv_total;
  }
  __syncthreads();
  constexpr int kQuads = kHeadDim / 4;  // 4-dim pieces of a head vector
  static_assert(kHeadDim % 4 == 0, "whole 4-dim pieces");
  const int pieces = rows * kQuads, stride = kMergeBatch * blockDim.x;
  for (int base = threadIdx.x; base < pieces; base += stride) {
    float4 acc[kMergeBatch];
    const float4* part[kMergeBatch];
    const float* weight[kMergeBatch];
#pragma unroll
    for (int b = 0; b < kMergeBatch; ++b) {
      const int e = min(base + b * static_cast<int>(blockDim.x), pieces - 1);
      const int r = e / kQuads;
      acc[b] = make_float4(0.f, 0.f, 0.f, 0.f);
      part[b] = reinterpret_cast<const float4*>(partial_out + head_of(r) * split_stride *
                                                                  kHeadDim) + e % kQuads;
      weight[b] = s_weight + r * kAttnMaxSplits;
    }
#pragma unroll 2
    for (int z = 0; z < active_splits; ++z) {
#pragma unroll
      for (int b = 0; b < kMergeBatch; ++b) {
        const float4 v = __ldcg(part[b] + z * kQuads);
        const float w = weight[b][z];
        acc[b].x += w * v.x;
        acc[b].y += w * v.y;
        acc[b].z += w * v.z;
        acc[b].w += w * v.w;
      }
    }
#pragma unroll
    for (int b = 0; b < kMergeBatch; ++b) {
      const int e = base + b * static_cast<int>(blockDim.x);
      if (e >= pieces) break;
      __nv_bfloat162* dst = reinterpret_cast<__nv_bfloat162*>(
          out + head_of(e / kQuads) * kHeadDim + 4 * (e % kQuads));
      dst[0] = __floats2bfloat162_rn(acc[b].x, acc[b].y);
      dst[1] = __floats2bfloat162_rn(acc[b].z, acc[b].w);
    }
  }
}

// The tile path's ending for a split tile: the last CTA merges the tile's rows (s_weight: the
// CTA's shared memory, TileMergeSmem bytes, free once its own rows are written).
template <int kHeadDim>
__device__ __forceinline__ void FinishSplitCta(int t0, int m, int kv_head, int group,
                                               int num_heads, int num_kv_heads, int split_stride,
                                               int active_splits, const float* partial_out,
                                               const float* partial_stats, uint32_t* tile_sems,
                                               bf16* out, float* s_weight) {
  uint32_t* sem = tile_sems + static_cast<size_t>(t0) * num_kv_heads + kv_head;
  if (!LastCtaToArrive(sem, active_splits)) return;
  CombineTileCta<kHeadDim>(t0, m, kv_head, group, num_heads, split_stride, active_splits,
                           partial_out, partial_stats, out, s_weight);
  if (threadIdx.x == 0) *sem = 0;
}

// The query tile a CTA of the tile paths computes: tokens t0 .. t0 + m - 1 of one sequence (a
// run of its tokens in the batch, cut at positions that are multiples of rows-per-CTA / group),
// `rows` = m * group query rows (row = token offset * group + head of the group) of KV head
// kv_head, and this CTA's split of the keys 0 .. the last token's position: split `split` of
// `active_splits`, [key_begin, key_end), whole kAttnKeys tiles per split.
struct QueryTile {
  int t0, m, rows, seq, kv_head, num_keys, key_begin, key_end, split, active_splits;
};

// The first index i in [lo, hi) of the non-decreasing array a with a[i] > value (upper) or
// a[i] >= value (!upper); hi if there is none. Warp-collective (every lane, the same
// arguments): each round probes 32 evenly spaced entries at once, so a bucket of up to 1,024
// tokens takes two round trips (a search one entry at a time took one a token).
__device__ __forceinline__ int WarpBound(const int32_t* a, int lo, int hi, int value,
                                         bool upper) {
  const int lane = threadIdx.x % kWarpSize;
  while (lo < hi) {
    const int step = (hi - lo + kWarpSize - 1) / kWarpSize;
    const int i = lo + lane * step;
    // (a probe at or past hi stands for hi, where the answer is if no entry is)
    const bool past = i >= hi || (upper ? a[i] > value : a[i] >= value);
    const unsigned ballot = __ballot_sync(kFullMask, past);
    const int f = ballot ? __ffs(ballot) - 1 : kWarpSize;  // answer in (probe f - 1, probe f]
    hi = min(lo + f * step, hi);
    lo = f == 0 ? lo : lo + (f - 1) * step + 1;
  }
  return lo;
}

// The tile of CTA (blockIdx.x, blockIdx.y, blockIdx.z) with kRows rows per CTA; false when the
// CTA has none. It reads only the batch arrays, which are written before the graph launches,
// so it runs before the kernel's wait for its predecessor (programmatic dependent launch).
// Warp-collective: every lane of the CTA calls it. A sequence's run of tokens in the batch is
// consecutive in position too, so where each of its tiles starts, its tokens and its keys
// follow by arithmetic from the run's bounds (warp searches, WarpBound) and one position.
// - Splits: the grid's z (num_splits CTAs a token) split every tile's keys, as evenly as whole
//   key tiles allow; CTA (t0, kv_head, z) computes split z of the tile starting at token t0.
// - split_stride > num_splits (the host's choice for buckets of short chunks): a tile's keys
//   also split over the CTAs of the run's other tokens, which would have nothing to do (a
//   chunk of 100 tokens deep into its context, a prefix-cache hit, is 7 tiles a KV head, too
//   few CTAs for the GPU unless their keys split): a split per kTileSplitMinKeys<kRows> keys,
//   or as many as fill the GPU's slots once where the batch leaves them idle
//   (attention_common.cuh), at most split_stride (<= kAttnMaxSplits); a split's partials sit
//   at query row x split_stride + split. The run's (tile, split, KV head) items go to the
//   run's CTAs in the order the GPU dispatches them (x fastest, then y, then z): the first ones
//   dispatched take the work, so it spreads evenly over the SMs. (Each tile's splits were its
//   first tokens' CTAs, a quarter of the grid at 100 tokens in the 128 bucket, scattered among
//   CTAs that exit at once: the SMs the dispatch gave three of them ran long while others
//   idled, 40% of the kernel's time on average under ncu.) Only where the run's items would
//   outnumber its CTAs (a run of a few tokens) does a tile take at most its own tokens' CTAs'
//   worth; otherwise a short last tile's splits are as short as the others' (its 4 tokens
//   capped it at 4 splits of 576 keys beside the full tiles' 7 of 320, the kernel's longest
//   CTAs).
// Not inlined: its split search inlined twice grew the kernel by 640 instructions and moved the
// batch-1 decode path (which never calls it) 10 KB further in, 0.9% slower at 8B; called, it
// costs the prefill CTAs little (8B 100 tokens at 4,000 keys: 89 us; inlined, 82-89).
template <int kRows>
__device__ __noinline__ bool FindQueryTile(const BatchDesc* desc, const int32_t* positions,
                                           const int32_t* token_seq, int group,
                                           int num_kv_heads, int num_splits,
                                           int split_stride, int slots, QueryTile* tile) {
  const int x = blockIdx.x, lane = threadIdx.x % kWarpSize;
  const int num_tokens = desc->num_tokens;
  if (x >= num_tokens) return false;
  const int tile_tokens = kRows / group;
  const int seq = token_seq[x], position = positions[x];
  auto split_size = [](int num_keys, int ctas) {  // keys a split, whole key tiles
    const int span = (num_keys + ctas - 1) / ctas;
    return (span + kAttnKeys - 1) / kAttnKeys * kAttnKeys;
  };
  int t0, m, num_keys, split, kv_head, split_keys;
  if (split_stride <= num_splits) {
    // Only the CTAs of a tile's first token work: the others (in a prefill bucket all but one
    // a tile, 31 in 32 of the wgmma kernel's) leave on one load, before the search.
    if (x > 0 && token_seq[x - 1] == seq && position % tile_tokens != 0) return false;
    const int r1 = WarpBound(token_seq, x + 1, num_tokens, seq, true);  // the run's end
    t0 = x;
    m = min(tile_tokens - position % tile_tokens, r1 - x);
    num_keys = position + m;
    split = blockIdx.z;
    kv_head = blockIdx.y;
    split_keys = split_size(num_keys, num_splits);
  } else {
    const int r0 = WarpBound(token_seq, 0, x, seq, false);
    const int r1 = WarpBound(token_seq, x + 1, num_tokens, seq, true);
    const int run = r1 - r0;
    const int first = position - (x - r0), last = position + (r1 - 1 - x);  // its positions
    const int first_tile = first / tile_tokens;
    const int num_tiles = last / tile_tokens - first_tile + 1;
    // Tile k of the run: its first token, tokens and keys (its last position + 1).
    auto tile_at = [&](int k, int* t0, int* m) {
      const int begin = k == 0 ? first : (first_tile + k) * tile_tokens;
      const int end = min((first_tile + k + 1) * tile_tokens, last + 1);
      *t0 = r0 + (begin - first);
      *m = end - begin;
      return end;
    };
    // The splits a tile would take for the run's CTAs to fill the GPU's slots once, counting a
    // CTA a KV head for each of the batch's other tokens (a decode's, or a part of another
    // run's tile; 0 beside 256 decodes, as a full batch's chunk is).
    const int fill = slots / (num_kv_heads * (num_tiles + num_tokens - run));
    auto split_keys_of = [&](int m, int num_keys, bool capped) {
      const int by_keys = (num_keys + kTileSplitMinKeys<kRows> - 1) / kTileSplitMinKeys<kRows>;
      const int most = (num_keys + kTileSplitFewestKeys - 1) / kTileSplitFewestKeys;
      int ctas = min(max(by_keys, min(fill, most)), split_stride);
      if (capped) ctas = min(ctas, m * num_splits);
      return split_size(num_keys, max(num_splits, ctas));
    };
    // This CTA's item: its place in the run's dispatch order, j = the (tile, split) pair, tile
    // after tile. A warp prefix sum over the tiles' splits finds j's tile (lane 0's tiles
    // before, `before` splits); `total`: the run's splits, which its CTAs must cover.
    const int item = (x - r0) + run * (static_cast<int>(blockIdx.y) +
                                       num_kv_heads * static_cast<int>(blockIdx.z));
    kv_head = item % num_kv_heads;
    const int j = item / num_kv_heads;
    int k = -1, total = 0;
    auto find_item = [&](bool capped) {
      k = -1;
      total = 0;
      for (int base = 0; base < num_tiles; base += kWarpSize) {
        int splits = 0;
        if (base + lane < num_tiles) {
          int lane_t0, lane_m;
          const int lane_keys = tile_at(base + lane, &lane_t0, &lane_m);
          const int size = split_keys_of(lane_m, lane_keys, capped);
          splits = (lane_keys + size - 1) / size;
        }
        int through = splits;  // inclusive prefix sum over the lanes
#pragma unroll
        for (int o = 1; o < kWarpSize; o <<= 1) {
          const int v = __shfl_up_sync(kFullMask, through, o);
          if (lane >= o) through += v;
        }
        const unsigned hit = __ballot_sync(kFullMask, total + through > j);
        if (hit && k < 0) {
          const int f = __ffs(hit) - 1;
          k = base + f;
          split = j - (total + __shfl_sync(kFullMask, through - splits, f));
        }
        total += __shfl_sync(kFullMask, through, kWarpSize - 1);
      }
    };
    bool capped = false;
    find_item(capped);
    if (total > run * num_splits) find_item(capped = true);  // uniform over the CTA
    if (k < 0) return false;
    num_keys = tile_at(k, &t0, &m);
    split_keys = split_keys_of(m, num_keys, capped);
  }
  const int active_splits = (num_keys + split_keys - 1) / split_keys;
  if (split >= active_splits) return false;  // uniform over the CTA
  const int key_begin = split * split_keys;
  *tile = QueryTile{t0, m, m * group, seq, kv_head, num_keys, key_begin,
                    min(key_begin + split_keys, num_keys), split, active_splits};
  return true;
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
    const QueryTile& tile, const int32_t* positions, const int32_t* block_tables,
    int max_blocks_per_seq, const bf16* q, const bf16* k_cache, const bf16* v_cache,
    int block_size, int num_heads, int num_kv_heads, float scale, bf16* out, int split_stride,
    float* partial_out, float* partial_stats, uint32_t* tile_sems) {
  namespace wmma = nvcuda::wmma;
  using L = AttentionSmem<kHeadDim, kRows>;
  constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks per head vector
  constexpr int kDimTiles = kHeadDim / 16, kKeyTiles = kAttnKeys / 16;
  constexpr int kLoads = kAttnKeys * kChunks / kAttnThreads;  // K (and V) chunks per thread
  static_assert(kAttnKeys * kChunks % kAttnThreads == 0, "whole chunks per thread");

  const int kv_head = tile.kv_head;
  const int group = num_heads / num_kv_heads;
  const int t0 = tile.t0, m = tile.m, rows = tile.rows, key_begin = tile.key_begin;
  const int key_end = tile.key_end, split = tile.split, active_splits = tile.active_splits;
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
      const size_t part = head * split_stride + split;
      float* dst = partial_out + part * kHeadDim;
      for (int c = lane; c < kHeadDim; c += kWarpSize) dst[c] = s_o[r * L::kLdO + c];
      if (lane == 0) {
        partial_stats[2 * part] = s_max[r];
        partial_stats[2 * part + 1] = s_sum[r];
      }
    }
  }
  if (active_splits > 1) {
    FinishSplitCta<kHeadDim>(t0, m, kv_head, group, num_heads, num_kv_heads, split_stride,
                             active_splits, partial_out, partial_stats, tile_sems, out,
                             reinterpret_cast<float*>(smem));
  }
}

// Whether a query tile's MMAs run on wgmma (Hopper's warpgroup MMAs, wgmma.cuh): the wgmma
// kernel's 128-row tiles on two warpgroups, a warp per 16 rows as on mma.sync
// (attention_common.cuh kAttnWgmmaRows). The other kernels' tiles keep mma.sync.
template <int kRows, int kWarps>
__host__ __device__ constexpr bool TileUsesWgmma() {
  return kRows == 128 && kWarps == 8;
}

// Shared memory of TileAttentionMmaCta: kStages stages of kKeys keys (on mma.sync a query tile's
// rows: 64 keys, or 16 in the decode-sized variant; on wgmma 64), each stage the keys' K rows
// then their V rows, 16 bits an element. Beside an E4M3 cache (kFp8) the codes are copied as
// they are into raw stages (two, half a 16-bit stage each), which each thread converts into a
// 16-bit (f16) stage: on mma.sync the first stage is the only 16-bit one and the second holds
// the two raw stages; on wgmma (whose pipelined loop reads two 16-bit stages) the raw stages
// follow both. kWgmma: the layout wgmma's descriptors read (kAlign bytes more, for the
// 1,024-byte alignment the swizzle needs).
template <int kHeadDim, int kRows, bool kWgmma = false, bool kFp8 = false>
struct TileStages {
  static constexpr int kKeys = kWgmma ? 64 : kRows;
  static constexpr int kStages = 2;
  static constexpr int kPieces = kHeadDim / 8;  // 16-byte pieces of a row
  static constexpr size_t kStageBytes = 2 * kKeys * kHeadDim * sizeof(bf16);
  static constexpr size_t kAlign = kWgmma ? 1024 : 0;
  static constexpr int kRawPieces = kHeadDim / 16;  // 16-byte pieces of an E4M3 row
  static constexpr size_t kRawStageBytes = 2 * kKeys * kHeadDim;
  static_assert(2 * kRawStageBytes == kStageBytes, "two raw stages in one 16-bit stage");
  // where the raw stages start, and the 16-bit stages' number
  static constexpr size_t kRawOffset = kFp8 && !kWgmma ? kStageBytes : kStages * kStageBytes;
  static constexpr int k16BitStages = kFp8 && !kWgmma ? 1 : kStages;
  static constexpr size_t kBytes =
      kStages * kStageBytes + (kFp8 && kWgmma ? kStageBytes : 0) + kAlign;

  // mma.sync: piece p of row r sits at p XOR RowMask(r), the mask r mod 8 rotated right by one
  // bit. A row is a multiple of 128 bytes, so a piece's bank group is its index mod 8, and the
  // reads are conflict-free: ldmatrix's 8 rows r .. r + 7 of one piece (the mask is a
  // bijection mod 8), and a quarter warp's key fragments, rows 2 i and 2 i + 1 with pieces
  // 4 s .. 4 s + 3 each (their masks differ in bit 2). The mask depends on r mod 8 only, so a
  // lane whose rows are all alike mod 8 computes it once.
  static __device__ __forceinline__ int RowMask(int r) {
    const int m = r & 7;
    return (m >> 1 | m << 2) & 7;
  }
  static __device__ __forceinline__ int Swizzle(int r, int p) { return p ^ RowMask(r); }
  // wgmma: a K or V tile is kHeadDim / 64 blocks of 64 dims, each kKeys rows of 128 bytes
  // swizzled as wgmma's 128-byte mode reads them (piece p of row r at p XOR r mod 8). The K
  // tile is then S = Q K^T's K-major B, the V tile O = P V's MN-major one.
  static constexpr int kBlockElements = kKeys * 64;  // elements of one 64-dim block

  // Where piece p (dims 8 p .. 8 p + 7) of row r of a K or V tile starts, in elements.
  static __device__ __forceinline__ int PieceAt(int r, int p) {
    if constexpr (kWgmma) {
      return (p / 8) * kBlockElements + r * 64 + 8 * ((p % 8) ^ (r % 8));
    } else {
      return r * kHeadDim + 8 * Swizzle(r, p);
    }
  }
};

// The query tiles on mma.sync (head dims 64 and 128; others take PagedAttentionCta), for prefill
// chunks: warp w owns query rows 16 w .. 16 w + 15 of the tile (kRows / 16 warps work) and runs
// its own online softmax over the split's keys, FlashAttention-2 style: S = Q K^T and O = P V
// with Q, the scores, the probabilities and O in registers.
// - Keys and values come through shared memory: all the CTA's threads copy the next kKeys keys'
//   K and V rows (cp.async, zeros past the tile's keys) while the warps compute on the current
//   ones, two stages; so each key is read from L2 once per CTA, and the warps wait on global
//   memory only for the block-table lookups that start each copy (none in the wgmma loop,
//   which loads them a tile ahead: table_entry). A warp takes 32 keys as one softmax block:
//   one rescale of O per block (none once its rows' maxima stop moving), and the causal mask
//   only in blocks that cross a row's position or the split's end (warps with rows past the
//   tile take the masked blocks throughout).
// - The row sums add the fp32 probabilities, P V their bf16 roundings (as FlashAttention-2;
//   the other two paths sum the rounded values): a relative difference of at most 2^-9.
// - Q is the A operand (rows g and g + 8 of the warp's 16), K the col-major B operand (column
//   n: key n of an 8-key tile); lane (g, t) reads 16 bytes, dims 32 s + 8 t .. + 7, of each
//   (the k order inside an MMA is free, as in gemv.cuh).
// - The scores' C layout is P's A layout for O = P V (k = 16 keys).
// - V is the B operand, read with ldmatrix.trans: two 8-dim output tiles per ldmatrix.x4.
// A warp stops at the last key its rows may see (causal); the copies run to the tile's last.
// Partials and the split merge as in PagedAttentionCta. kWarps * 32 threads.
// An E4M3 cache (Kv = KvFp8): the copies bring the codes (16-byte pieces, kRawCopyThreads a
// row) into a raw stage (mma.sync: two tiles in flight as before; wgmma: tile j + 1's, issued
// once tile j's have landed); once a tile's have landed, each thread converts the pieces it
// copied into an f16 stage (TileStages), and from there on the tile runs as with bf16, on f16
// operands (AttnOperands); the key scale folds into the softmax's, the value scale multiplies
// the output (kv_scales: the layer's).
// On wgmma (TileUsesWgmma: the wgmma kernel's 128 rows, two warpgroups): the stages hold 64
// keys in wgmma's 128-byte swizzled layout (TileStages::PieceAt); each warpgroup computes S =
// Q K^T for its 64 rows over a whole key tile (Q's A fragments in registers, K by descriptor),
// each warp the softmax of its 16 rows (the same code), then O += P V (P from registers, V by
// descriptor, MN-major). The loop is pipelined: S of tile j is computed while O += P V of
// tile j - 1 runs, and its softmax while that finishes. Every warp issues every wgmma, so a
// warp whose rows end before a key tile still takes it, masked; a shared-memory fence hands
// the copies (and an E4M3 cache's conversions) to the wgmmas' async proxy.
template <int kHeadDim, int kRows, int kWarps, class Kv = KvBf16>
__device__ __forceinline__ void TileAttentionMmaCta(
    const QueryTile& tile, const int32_t* positions, const int32_t* block_tables,
    int max_blocks_per_seq, const bf16* q, const typename Kv::Element* k_cache,
    const typename Kv::Element* v_cache, int block_size, int num_heads, int num_kv_heads,
    float scale, bf16* out, int split_stride, float* partial_out, float* partial_stats,
    uint32_t* tile_sems, const float* kv_scales = nullptr) {
  constexpr bool kWgmma = TileUsesWgmma<kRows, kWarps>();
  using Stages = TileStages<kHeadDim, kRows, kWgmma, Kv::kFp8>;
  using Ops = AttnOperands<Kv>;
  constexpr int kKeys = Stages::kKeys, kPieces = Stages::kPieces;
  constexpr int kSteps = kHeadDim / 32;    // 32-dim steps of S = Q K^T (two MMAs each)
  constexpr int kOutTiles = kHeadDim / 8;  // 8-dim tiles of O = P V
  // Keys per softmax block: on mma.sync 32 (64 would rescale O half as often, but its scores
  // and probabilities spill 232 bytes of registers at head dim 128, where 32 spill 24); on
  // wgmma a whole tile, the N of S = Q K^T's MMAs.
  constexpr int kBlockKeys = kWgmma ? kKeys : kKeys < 32 ? kKeys : 32;
  constexpr int kKeyTiles = kBlockKeys / 8;  // 8-key tiles of S
  // threads copying one key row (the CTA's first kKeys * kCopyThreads threads copy)
  constexpr int kCopyThreads = kPieces < kWarps * kWarpSize / kKeys ? kPieces
                                                                     : kWarps * kWarpSize / kKeys;
  static_assert(kHeadDim == 64 || kHeadDim == 128, "head dims 64 and 128");
  static_assert(kRows % 16 == 0 && kRows / 16 <= kWarps, "a warp per 16 rows");
  static_assert(kCopyThreads > 0 && kPieces % kCopyThreads == 0 && kKeys % 16 == 0,
                "every thread copies whole pieces of one row; whole MMA k-steps of keys");
  const int kv_head = tile.kv_head;
  const int group = num_heads / num_kv_heads;
  // The tile's last token sees the most keys: the split ends at or before its key.
  const int key_end = tile.key_end;
  const int num_key_tiles = (key_end - tile.key_begin + kKeys - 1) / kKeys;
  const KeyRows<kHeadDim> cache_rows(block_tables, max_blocks_per_seq, tile.seq, block_size,
                                     num_kv_heads, kv_head);
  const int tid = threadIdx.x, lane = tid % kWarpSize, warp = tid / kWarpSize;
  const int g = lane / 4, tq = lane % 4;

  extern __shared__ __align__(128) unsigned char smem_base[];
  unsigned char* smem = smem_base;
  if constexpr (kWgmma) smem += (1024 - SharedAddress(smem_base) % 1024) % 1024;
  auto stage_keys = [&](int stage) {  // (mma.sync beside an E4M3 cache: the one f16 stage)
    return reinterpret_cast<bf16*>(smem + (stage % Stages::k16BitStages) * Stages::kStageBytes);
  };
  // E4M3: kRawCopyThreads threads copy a key row's codes, as kCopyThreads its bf16 values
  constexpr int kRawCopyThreads = Stages::kRawPieces < kWarps * kWarpSize / kKeys
                                      ? Stages::kRawPieces
                                      : kWarps * kWarpSize / kKeys;
  static_assert(!Kv::kFp8 || Stages::kRawPieces % kRawCopyThreads == 0, "whole raw pieces");
  auto raw_stage = [&](int key_tile) {  // E4M3: where tile key_tile's codes are copied
    return reinterpret_cast<fp8*>(smem + Stages::kRawOffset +
                                  (key_tile % 2) * Stages::kRawStageBytes);
  };
  // The key row this thread copies in every tile (kCopyThreads or kRawCopyThreads threads a
  // row), if any (a CTA may have more threads than a key tile has pieces).
  constexpr int kRowCopyThreads = Kv::kFp8 ? kRawCopyThreads : kCopyThreads;
  const int copy_row = tid / kRowCopyThreads;
  const bool copies = kKeys * kRowCopyThreads == kWarps * kWarpSize || copy_row < kKeys;
  // The block-table entry of this thread's key row in tile key_tile (-1: no key there, or no
  // block in the table). The wgmma loop loads each copy's a tile ahead of it, so that no copy
  // waits on the table there (one CTA an SM: no other CTA's work would cover the wait). With a
  // bf16 cache that changed nothing measurable (the entries hit L1; docs/performance.md, round
  // 21).
  auto table_entry = [&](int key_tile) {
    const int key = tile.key_begin + key_tile * kKeys + copy_row;
    return copies && key < key_end ? cache_rows.block_of(key) : -1;
  };
  // All threads: keys key_tile * kKeys .. of the split into stage key_tile % 2, then commit;
  // `block`: table_entry(key_tile), or LookUpNow{} (the copying threads look it up here).
  // kCopyThreads threads per key row: pieces p, p + kCopyThreads, .. of its K and V rows, p =
  // tid % kCopyThreads (bf16: `parts`, K rows, V rows or both). E4M3: the codes of both into
  // raw_stage(key_tile), unswizzled (only the thread that copies a piece reads it back).
  constexpr int kCopyKeys = 1, kCopyValues = 2;
  struct LookUpNow {};
  auto copy_key_tile = [&](int key_tile, auto block, int parts = 3) {  // 3: both
    const int r = copy_row, key = tile.key_begin + key_tile * kKeys + r;
    constexpr bool kNow = std::is_same_v<decltype(block), LookUpNow>;
    int64_t block_off = -1;  // (the offset from a prefetched entry)
    if constexpr (!kNow) block_off = block >= 0 ? cache_rows.offset_in(block, key) : -1;
    auto key_offset = [&]() -> int64_t {
      if constexpr (kNow) return key < key_end ? cache_rows.offset(key) : -1;
      return block_off;
    };
    if constexpr (Kv::kFp8) {
      fp8* dst = raw_stage(key_tile);
      if (copies) {
        const int64_t off = key_offset();
        const int bytes = off >= 0 ? 16 : 0;
        const fp8* k_row = k_cache + (off >= 0 ? off : 0);
        const fp8* v_row = v_cache + (off >= 0 ? off : 0);
#pragma unroll
        for (int i = 0; i < Stages::kRawPieces / kRawCopyThreads; ++i) {
          const int p = tid % kRawCopyThreads + kRawCopyThreads * i;
          CpAsync16(dst + r * kHeadDim + 16 * p, k_row + 16 * p, bytes);
          CpAsync16(dst + (kKeys + r) * kHeadDim + 16 * p, v_row + 16 * p, bytes);
        }
      }
      CpAsyncCommit();
    } else {
      bf16* dst = stage_keys(key_tile % Stages::kStages);
      if (copies) {
        const int64_t off = key_offset();
        const int bytes = off >= 0 ? 16 : 0;
        const bf16* k_row = k_cache + (off >= 0 ? off : 0);
        const bf16* v_row = v_cache + (off >= 0 ? off : 0);
#pragma unroll
        for (int i = 0; i < kPieces / kCopyThreads; ++i) {
          const int p = tid % kCopyThreads + kCopyThreads * i;
          const int at = Stages::PieceAt(r, p);
          if (parts & kCopyKeys) CpAsync16(dst + at, k_row + 8 * p, bytes);
          if (parts & kCopyValues) CpAsync16(dst + kKeys * kHeadDim + at, v_row + 8 * p, bytes);
        }
      }
      CpAsyncCommit();
    }
  };
  // E4M3: once tile key_tile's copies have landed (this thread's own: it reads back only what
  // it copied), its pieces as f16 into its f16 stage, where the bf16 copies would have put
  // them (two 8-dim pieces, swizzled, for each 16 codes)
  auto convert_key_tile = [&](int key_tile) {
    const fp8* src = raw_stage(key_tile);
    bf16* dst = stage_keys(key_tile % Stages::kStages);
    const int r = copy_row;
    if (copies) {
#pragma unroll
      for (int i = 0; i < Stages::kRawPieces / kRawCopyThreads; ++i) {
        const int p = tid % kRawCopyThreads + kRawCopyThreads * i;
#pragma unroll
        for (int kv = 0; kv < 2; ++kv) {  // the key's K row, then its V row
          const uint4 codes =
              *reinterpret_cast<const uint4*>(src + (kv * kKeys + r) * kHeadDim + 16 * p);
          uint4 lo, hi;  // dims 16 p .. + 7 and + 8 .. + 15
          E4m3x4ToF16x4(codes.x, lo.x, lo.y);
          E4m3x4ToF16x4(codes.y, lo.z, lo.w);
          E4m3x4ToF16x4(codes.z, hi.x, hi.y);
          E4m3x4ToF16x4(codes.w, hi.z, hi.w);
          bf16* tile = dst + kv * kKeys * kHeadDim;
          *reinterpret_cast<uint4*>(tile + Stages::PieceAt(r, 2 * p)) = lo;
          *reinterpret_cast<uint4*>(tile + Stages::PieceAt(r, 2 * p + 1)) = hi;
        }
      }
    }
  };
  if constexpr (kWgmma) {  // in flight while Q is read
    copy_key_tile(0, table_entry(0));
  } else {
    copy_key_tile(0, LookUpNow{});
  }
  int block_ahead = kWgmma ? table_entry(1) : -1;  // the next copy's (wgmma)

  // This lane's two rows (h = 0: row g, h = 1: row g + 8 of the warp's): query head (computed
  // where used, not held through the key loop), position (-1 for rows past the tile: every key
  // masked) and Q: on mma.sync its 16-byte pieces qr[h][s] (dims 32 s + 8 t .. + 7, the k
  // order of MmaStep32); on wgmma the A fragments of each 16-dim step, qa[kk] (wgmma.cuh).
  auto query_head = [&](int h) {
    const int r = 16 * warp + g + 8 * h;
    return static_cast<size_t>(tile.t0 + r / group) * num_heads + kv_head * group + r % group;
  };
  int pos[2];
  uint4 qr[2][kWgmma ? 1 : kSteps];
  uint32_t qa[kWgmma ? kHeadDim / 16 : 1][4];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const bool live = 16 * warp + g + 8 * h < tile.rows;
    pos[h] = live ? positions[tile.t0 + (16 * warp + g + 8 * h) / group] : -1;
    const bf16* q_row = q + (live ? query_head(h) : 0) * kHeadDim;
    if constexpr (kWgmma) {
#pragma unroll
      for (int kk = 0; kk < kHeadDim / 16; ++kk)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const uint32_t pair =
              live ? *reinterpret_cast<const uint32_t*>(q_row + 16 * kk + 8 * half + 2 * tq)
                   : 0u;
          qa[kk][2 * half + h] = Ops::QueryPair(pair);
        }
    } else {
#pragma unroll
      for (int s = 0; s < kSteps; ++s) {
        qr[h][s] = live ? Ops::Query(*reinterpret_cast<const uint4*>(q_row + 32 * s + 8 * tq))
                        : make_uint4(0, 0, 0, 0);
      }
    }
  }
  // The warp's keys: up to its last row's; unmasked below the first row's (and the split's end).
  const int key_stop = min(key_end, __reduce_max_sync(kFullMask, max(pos[0], pos[1])) + 1);
  const int unmasked_stop =
      min(key_end, static_cast<int>(__reduce_min_sync(
                       kFullMask, static_cast<unsigned>(min(pos[0], pos[1]) + 1))));
  // (an E4M3 cache: keys' scale folded in, values' applied to the output)
  const float scale_log2 =
      scale * 1.4426950408889634f *
      (Kv::kFp8 ? KvScale(kv_scales, num_kv_heads, 0, kv_head) : 1.f);
  float o[kOutTiles][4];
#pragma unroll
  for (int j = 0; j < kOutTiles; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float run_max[2] = {-INFINITY, -INFINITY}, run_sum[2] = {0.f, 0.f};  // run_sum: lane's keys

  // The lane's stage rows (mma.sync): key fragments from rows = g (mod 8), ldmatrix addresses
  // from rows = lane (mod 8) (r0 and every tile offset below are multiples of 8).
  const int key_mask = Stages::RowMask(g), value_mask = Stages::RowMask(lane & 7);
  const int value_row = (lane & 7) + 8 * ((lane >> 3) & 1), value_piece = lane >> 4;

  // The online softmax of one block of scores: keys key0 .. key0 + kBlockKeys - 1 (sc[n]: the
  // C fragments of 8-key tile n, rows g (elements 0, 1) and g + 8 (2, 3), keys 8 n + 2 t, + 1),
  // masked or not, into P's A fragments pa[h][n] and the factors alpha[h] that O's rows are to
  // be rescaled by (rescale_o). Scores stay unscaled until the exponent (scale > 0: the max
  // commutes with it); a row may have no live key yet (-inf: p = 0, alpha = 0).
  // (sc: float[kKeyTiles][4], pa: uint32_t[2][kKeyTiles], alpha: float[2]; spelled out, those
  // parameter types crash CUDA 13.0's front end in this generic lambda)
  auto softmax_block = [&](auto& sc, auto& pa, auto& alpha, int key0, auto masked) {
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
        pa[h][n] = Ops::Pack(p0, p1);
      }
      run_sum[h] = run_sum[h] * alpha[h] + p_sum;
    }
  };
  // Once the rows' maxima settle (most blocks of a long context), O needs no rescaling.
  auto rescale_o = [&](const float (&alpha)[2]) {
    if (__any_sync(kFullMask, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
      for (int j = 0; j < kOutTiles; ++j) {
        o[j][0] *= alpha[0];
        o[j][1] *= alpha[0];
        o[j][2] *= alpha[1];
        o[j][3] *= alpha[1];
      }
    }
  };
  // The softmax of a block whose keys start at key0, masked where they cross one of the warp's
  // rows' positions or the split's end (warp-uniform).
  auto softmax_any = [&](auto& sc, auto& pa, auto& alpha, int key0) {
    if (key0 + kBlockKeys <= unmasked_stop) {
      softmax_block(sc, pa, alpha, key0, std::false_type{});
    } else {
      softmax_block(sc, pa, alpha, key0, std::true_type{});
    }
  };

  // One softmax block on mma.sync: keys key0 .. of rows r0 .. of the stage.
  auto key_block = [&](const bf16* k_tile, const bf16* v_tile, int r0, int key0, auto masked) {
    float sc[kKeyTiles][4];
#pragma unroll
    for (int n = 0; n < kKeyTiles; ++n) {
      const bf16* k_row = k_tile + (r0 + 8 * n + g) * kHeadDim;
      sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.f;
#pragma unroll
      for (int s = 0; s < kSteps; ++s) {
        const uint4 kv =
            *reinterpret_cast<const uint4*>(k_row + 8 * ((4 * s + tq) ^ key_mask));
        Ops::MmaStep32(sc[n], qr[0][s], qr[1][s], kv);
      }
    }
    uint32_t pa[2][kKeyTiles];
    float alpha[2];
    softmax_block(sc, pa, alpha, key0, masked);
    rescale_o(alpha);
    // O += P V, 16 keys (k) at a time; ldmatrix.trans: lanes 8 i .. 8 i + 7 address rows
    // (keys) 8 (i % 2) .. of dims 8 (i / 2) .. of a 16-dim pair of output tiles.
#pragma unroll
    for (int kc = 0; kc < kBlockKeys / 16; ++kc) {
      const bf16* v_row = v_tile + (r0 + 16 * kc + value_row) * kHeadDim;
#pragma unroll
      for (int jp = 0; jp < kOutTiles / 2; ++jp) {
        uint32_t b[4];
        LdMatrixX4Trans(b, v_row + 8 * ((2 * jp + value_piece) ^ value_mask));
        Ops::Mma(o[2 * jp], pa[0][2 * kc], pa[1][2 * kc], pa[0][2 * kc + 1], pa[1][2 * kc + 1],
                 b[0], b[1]);
        Ops::Mma(o[2 * jp + 1], pa[0][2 * kc], pa[1][2 * kc], pa[0][2 * kc + 1],
                 pa[1][2 * kc + 1], b[2], b[3]);
      }
    }
  };

  // wgmma (the warpgroup's, asynchronous; each commits one group): S = Q K^T over a key tile
  // (its 64 keys as N), and O += P V (16 keys a wgmma). The operand fences keep every write
  // and read of their registers before wgmma.fence.
  auto scores_wgmma = [&](const bf16* k_tile, float (&sc)[kKeyTiles][4]) {
    if constexpr (kWgmma) {
      WgmmaFenceOperands(qa);
      WgmmaFenceOperands(sc);
      WgmmaFence();
#pragma unroll
      for (int kk = 0; kk < kHeadDim / 16; ++kk) {
        const bf16* k_step = k_tile + (kk / 4) * Stages::kBlockElements + 16 * (kk % 4);
        WgmmaRs<kKeyTiles, Kv::kFp8, 0>(sc, qa[kk], WgmmaDescriptor(k_step, 16, 1024), kk > 0);
      }
      WgmmaCommit();
    }
  };
  auto values_wgmma = [&](const bf16* v_tile, uint32_t (&pa)[2][kKeyTiles]) {
    if constexpr (kWgmma) {
      WgmmaFenceOperands(pa);
      WgmmaFenceOperands(o);
      WgmmaFence();
#pragma unroll
      for (int kc = 0; kc < kBlockKeys / 16; ++kc) {
        const uint32_t a[4] = {pa[0][2 * kc], pa[1][2 * kc], pa[0][2 * kc + 1],
                               pa[1][2 * kc + 1]};
        WgmmaRs<kOutTiles, Kv::kFp8, 1>(
            o, a, WgmmaDescriptor(v_tile + 16 * kc * 64, Stages::kBlockElements * 2, 1024), 1);
      }
      WgmmaCommit();
    }
  };

  if constexpr (kWgmma) {
    // wgmma, pipelined (FlashAttention-3's intra-warpgroup overlap): iteration j issues S(j) =
    // Q K(j)^T and then O += P(j - 1) V(j - 1), and computes the softmax of S(j) while the
    // latter runs; O is rescaled once it has landed.
    // - A bf16 cache: K and V are copied apart, K(j + 1) as iteration j starts (its stage's K
    //   was last read by S(j - 1)), V(j + 1) once O += P(j - 1) V(j - 1) has read its stage's
    //   V. So at the top of iteration j, K(j) and V(j - 1) must have landed; only V(j)'s copy
    //   may still be in flight.
    // - An E4M3 cache: tile j + 1's codes are copied whole into their raw stage as iteration j
    //   starts (its last reader: this thread's conversion of tile j - 1), once tile j's have
    //   landed and before they are converted into f16 stage j % 2 (last read by S(j - 2) and
    //   O += P(j - 2) V(j - 2), both done before the barrier that ends iteration j - 1).
    uint32_t pa_prev[2][kKeyTiles];
    for (int key_tile = 0; key_tile < num_key_tiles; ++key_tile) {
      const bool next = key_tile + 1 < num_key_tiles;
      const int block_next = block_ahead;  // tile key_tile + 1's
      if constexpr (Kv::kFp8) {
        CpAsyncWait<0>();
        if (next) copy_key_tile(key_tile + 1, block_next);
        block_ahead = table_entry(key_tile + 2);
        convert_key_tile(key_tile);
      } else if (key_tile == 0) {
        CpAsyncWait<0>();
      } else {
        CpAsyncWait<1>();
      }
      FenceSharedForWgmma();  // this thread's copies (or conversions), for the wgmmas
      __syncthreads();        // every thread's
      if constexpr (!Kv::kFp8) {
        if (next) copy_key_tile(key_tile + 1, block_next, kCopyKeys);
        block_ahead = table_entry(key_tile + 2);
      }
      const bf16* stage = stage_keys(key_tile % Stages::kStages);
      float sc[kKeyTiles][4];  // (the first wgmma overwrites it)
      scores_wgmma(stage, sc);
      if (key_tile > 0) {
        values_wgmma(stage_keys((key_tile - 1) % Stages::kStages) + kKeys * kHeadDim, pa_prev);
        WgmmaWait<1>();
      } else {
        WgmmaWait<0>();
      }
      WgmmaFenceOperands(sc);
      uint32_t pa[2][kKeyTiles];
      float alpha[2];
      softmax_any(sc, pa, alpha, tile.key_begin + key_tile * kKeys);
      WgmmaWait<0>();
      WgmmaFenceOperands(o);
      rescale_o(alpha);
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int n = 0; n < kKeyTiles; ++n) pa_prev[h][n] = pa[h][n];
      __syncthreads();  // every warp's O += P V is done with the previous stage's V
      if (!Kv::kFp8 && next) copy_key_tile(key_tile + 1, block_next, kCopyValues);
    }
    if (num_key_tiles > 0) {  // the last tile's V (bf16: its copy may have been in flight)
      if constexpr (!Kv::kFp8) {
        CpAsyncWait<0>();
        FenceSharedForWgmma();
        __syncthreads();
      }
      values_wgmma(stage_keys((num_key_tiles - 1) % Stages::kStages) + kKeys * kHeadDim,
                   pa_prev);
      WgmmaWait<0>();
      WgmmaFenceOperands(o);
    }
  } else {
    for (int key_tile = 0; key_tile < num_key_tiles; ++key_tile) {
      if (key_tile + 1 < num_key_tiles) {
        copy_key_tile(key_tile + 1, LookUpNow{});  // its stage's readers passed the barrier
        CpAsyncWait<1>();
      } else {
        CpAsyncWait<0>();
      }
      if constexpr (Kv::kFp8) convert_key_tile(key_tile);  // the f16 stage's readers are done
      __syncthreads();  // every thread's copies of this key tile have landed
      const bf16* k_tile = stage_keys(key_tile % Stages::kStages);
      const int key0 = tile.key_begin + key_tile * kKeys;
#pragma unroll 1
      for (int r0 = 0; r0 < kKeys; r0 += kBlockKeys) {
        if (key0 + r0 + kBlockKeys <= unmasked_stop) {  // warp-uniform branches
          key_block(k_tile, k_tile + kKeys * kHeadDim, r0, key0 + r0, std::false_type{});
        } else if (key0 + r0 < key_stop) {
          key_block(k_tile, k_tile + kKeys * kHeadDim, r0, key0 + r0, std::true_type{});
        }
      }
      __syncthreads();  // every warp is done with this stage before it is copied over
    }
  }

  // Each row: its sum over its four lanes, then out (one split) or the partials; lane (g, t)
  // holds dims 8 j + 2 t and 8 j + 2 t + 1 of its rows.
  if constexpr (Kv::kFp8) {
    const float value_scale = KvScale(kv_scales, num_kv_heads, 1, kv_head);
#pragma unroll
    for (int j = 0; j < kOutTiles; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[j][e] *= value_scale;
  }
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
      const size_t part = query_head(h) * split_stride + tile.split;
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
                             split_stride, tile.active_splits, partial_out, partial_stats,
                             tile_sems, out, reinterpret_cast<float*>(smem));
  }
}

}  // namespace blink
