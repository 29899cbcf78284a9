// The attention kernel's decode path (attention.cuh): a token alone in its sequence this step
// reads each key and value row once, straight from the cache into registers, for all query
// heads of its KV head's group; its keys spread over the CTA's warps and over CTAs
// (flash-decoding), whose partials the last of them merges.
#pragma once
#include <type_traits>

#include "attention_common.cuh"

namespace blink {

// Keys per warp step of DecodeAttentionCta: one MMA's k.
static constexpr int kMmaKeys = 16;

static constexpr int kDecodeMaxGroup = 8;    // larger GQA groups take the tile path
static constexpr int kDecodeMaxSplits = kAttnMaxSplits;
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

// Splits a merge takes in one round trip through L2 (MergedSplits4), at most: a thread's
// loads of 8 splits (48 registers) fit beside the decode path's without spilling at head dim
// 64, and batch 1 at up to 1,024 keys takes at most 8 (chunks of 128 keys). Measured on the
// H200 (bench_decode, one call, ms a step, two trips -> one): Llama-3.2-1B 1 x 512 0.782 ->
// 0.770, 8 x 512 0.858 -> 0.850, 1 x 2048 (17 splits: two trips either way) 0.807 -> 0.808;
// Llama-3.1-8B 1 x 512 3.841 -> 3.833.
static constexpr int kOneTripMaxSplits = 8;

// One query row's output at dims d .. d + 3 (d % 4 == 0), merged from its `active_splits`
// (<= kOneTripMaxSplits) splits' partials (row_out: [splits][D] f32, row_stats: [splits][2], as
// the splits wrote them) as four bf16 (8 bytes): every split's (max, sum) and output loaded at
// once, the weights 2^(m_z - M) computed by each thread for itself.
__device__ __forceinline__ uint2 MergedSplits4(const float* row_out, const float* row_stats,
                                               int d, int head_dim, int active_splits) {
  constexpr int kMax = kOneTripMaxSplits;
  float2 stats[kMax];
  float4 part[kMax];
#pragma unroll
  for (int z = 0; z < kMax; ++z) {
    if (z < active_splits) {
      stats[z] = __ldcg(reinterpret_cast<const float2*>(row_stats) + z);
      part[z] = __ldcg(reinterpret_cast<const float4*>(row_out + z * head_dim + d));
    }
  }
  float max_all = -INFINITY;
#pragma unroll
  for (int z = 0; z < kMax; ++z)
    if (z < active_splits) max_all = fmaxf(max_all, stats[z].x);
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  float total = 0.f;
#pragma unroll
  for (int z = 0; z < kMax; ++z) {
    if (z < active_splits) {
      const float w = exp2f(stats[z].x - max_all);
      total += w * stats[z].y;
      acc.x += w * part[z].x;
      acc.y += w * part[z].y;
      acc.z += w * part[z].z;
      acc.w += w * part[z].w;
    }
  }
  const float inv = 1.f / total;
  const __nv_bfloat162 lo = __floats2bfloat162_rn(acc.x * inv, acc.y * inv);
  const __nv_bfloat162 hi = __floats2bfloat162_rn(acc.z * inv, acc.w * inv);
  return make_uint2(*reinterpret_cast<const uint32_t*>(&lo),
                    *reinterpret_cast<const uint32_t*>(&hi));
}

// The last CTA of a decode token's splits merges them, all threads at once (this runs on the
// critical path of every decode step). Up to kOneTripMaxSplits splits, in one round trip
// through L2: each thread loads its four dims of every split with their (max, sum) and weighs
// them itself (MergedSplits4). More: a warp per query head turns the splits' (max, sum) into
// normalized weights w_z = 2^(m_z - M) / sum_z' 2^(m_z' - M) l_z' in shared memory (lane z:
// splits z and z + 32), then every output element is a weighted sum of independent L2 reads
// (two round trips and a barrier). Every split of a decode token saw a live key, so each m_z
// is finite.
// s_weight: [kGroup][kDecodeMaxSplits] f32.
template <int kHeadDim>
__device__ __forceinline__ void MergeDecodeSplitsCta(int t, int kv_head, int group,
                                                     int num_heads, int split_stride,
                                                     int active_splits, const float* partial_out,
                                                     const float* partial_stats, bf16* out,
                                                     float* s_weight) {
  static_assert(kDecodeMaxSplits <= 2 * kWarpSize, "two splits per lane");
  const size_t head0 = static_cast<size_t>(t) * num_heads + kv_head * group;
  if (active_splits <= kOneTripMaxSplits) {
    for (int e = 4 * threadIdx.x; e < group * kHeadDim; e += 4 * blockDim.x) {
      const size_t row = head0 + e / kHeadDim;
      const int d = e % kHeadDim;
      *reinterpret_cast<uint2*>(out + row * kHeadDim + d) =
          MergedSplits4(partial_out + row * split_stride * kHeadDim,
                        partial_stats + 2 * row * split_stride, d, kHeadDim, active_splits);
    }
    return;
  }
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  for (int g = warp; g < group; g += blockDim.x / kWarpSize) {
    float weight[2];  // 0 past the splits
    const float inv_total =
        SplitWeights(partial_stats + 2 * (head0 + g) * split_stride, active_splits, weight);
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
        partial_out + (head0 + g) * split_stride * kHeadDim + d);
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
//
// An E4M3 cache (Kv = KvFp8): the same loads at half the bytes, kept as codes until the step
// that uses them (converting at the load would wait for it) and converted to f16 there, the
// MMAs on f16 (AttnOperands); the key scale folds into the softmax's, the value scale
// multiplies the CTA's output (kv_scales: the layer's).
template <int kHeadDim, bool kStepInOneBlock, int kWarps, class Kv = KvBf16>
__device__ __forceinline__ void DecodeAttentionCta(
    int t, int seq, int position, const int32_t* block_tables, int max_blocks_per_seq,
    const bf16* q, const typename Kv::Element* k_cache, const typename Kv::Element* v_cache,
    int block_size, int num_heads, int num_kv_heads, float scale, bf16* out, int num_splits,
    int split_stride, int ctas, int slots, float* partial_out, float* partial_stats,
    uint32_t* tile_sems, const float* kv_scales = nullptr) {
  static_assert(MmaPathsFit<kHeadDim>(), "head dims 64 and 128");
  using L = DecodeLayout<kHeadDim, kWarps>;
  using Ops = AttnOperands<Kv>;
  constexpr int kThreads = kWarps * kWarpSize;
  constexpr int kChunk = kMmaKeys * kWarps;  // keys a CTA step
  constexpr int kSteps = kHeadDim / 32;     // 32-dim steps of S^T = K Q^T (two MMAs each)
  constexpr int kOutTiles = kHeadDim / 16;  // 16-dim tiles of O^T = V^T P^T
  constexpr int kLaneDims = kHeadDim / 16;  // dims of a value row per lane, per row half
  constexpr int kLaneWords = kLaneDims / 2;
  // a lane's 8 dims of a key and kLaneDims of a value row: bf16 16 and 16 or 8 bytes; E4M3
  // codes 8 and 8 or 4
  using KeyLoad = std::conditional_t<Kv::kFp8, uint2, uint4>;
  using ValueLoad = std::conditional_t<Kv::kFp8, std::conditional_t<kLaneDims == 8, uint2, uint32_t>,
                                       std::conditional_t<kLaneDims == 8, uint4, uint2>>;
  // as 16-bit pairs (bf16 as loaded; E4M3 converted to f16)
  auto key_pairs = [](const KeyLoad& raw) -> uint4 {
    if constexpr (Kv::kFp8) {
      uint4 v;
      E4m3x4ToF16x4(raw.x, v.x, v.y);
      E4m3x4ToF16x4(raw.y, v.z, v.w);
      return v;
    } else {
      return raw;
    }
  };
  auto value_pairs = [](const ValueLoad& raw, uint32_t (&words)[kLaneWords]) {
    if constexpr (!Kv::kFp8) {
      *reinterpret_cast<ValueLoad*>(words) = raw;
    } else if constexpr (kLaneWords == 4) {
      E4m3x4ToF16x4(raw.x, words[0], words[1]);
      E4m3x4ToF16x4(raw.y, words[2], words[3]);
    } else {
      E4m3x4ToF16x4(raw, words[0], words[1]);
    }
  };
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
  const KeyLoad no_key{};
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
  auto load_keys = [&](int key0, int64_t row, KeyLoad (&kr)[2][kSteps]) {
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      const int64_t off = kStepInOneBlock ? row + (8 * n + g) * row_stride
                                          : row_offset(key0 + 8 * n + g);
#pragma unroll
      for (int s = 0; s < kSteps; ++s) {
        const KeyLoad* p = reinterpret_cast<const KeyLoad*>(k_cache + off + 32 * s + 8 * tq);
        kr[n][s] = kStepInOneBlock || off >= 0 ? __ldcg(p) : no_key;
      }
    }
  };
  // Values of keys 2 t, 2 t + 1, 2 t + 8, 2 t + 9 of the step (i = 0..3), dims
  // r * D / 16 .. + D / 16 - 1 for rows r = g (h = 0) and g + 8 (h = 1), as bf16 pairs; zeros
  // past the split (P is 0 there, and 0 times a stale NaN would not be).
  auto load_values = [&](int key0, int64_t row, ValueLoad (&vr)[4][2]) {
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
        vr[i][h] = v;
      }
    }
  };

  // (an E4M3 cache: keys' scale folded in, values' applied to the output)
  const float scale_log2 =
      scale * 1.4426950408889634f *
      (Kv::kFp8 ? KvScale(kv_scales, num_kv_heads, 0, kv_head) : 1.f);
  float o[kOutTiles][4];
#pragma unroll
  for (int j = 0; j < kOutTiles; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  // of heads 2 t and 2 t + 1; run_sum: this lane's keys (g, g + 8) only
  float run_max[2] = {-INFINITY, -INFINITY}, run_sum[2] = {0.f, 0.f};

  int key0 = warp_key0;
  KeyLoad kr[2][kSteps];
  ValueLoad vr[4][2];
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
    qr[s] = g < group ? Ops::Query(*reinterpret_cast<const uint4*>(
                            q + (static_cast<size_t>(t) * num_heads + kv_head * group + g) *
                                    kHeadDim + 32 * s + 8 * tq))
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
      const uint4 k_lo = key_pairs(kr[0][s]), k_hi = key_pairs(kr[1][s]);
      Ops::Mma(sc[0], k_lo.x, k_hi.x, k_lo.y, k_hi.y, qr[s].x, qr[s].y);
      Ops::Mma(sc[1], k_lo.z, k_hi.z, k_lo.w, k_hi.w, qr[s].z, qr[s].w);
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
    // P rounded to the operands' type (bf16, or f16 beside an E4M3 cache), heads 2 t, 2 t + 1
    // of key g (lo) and of key g + 8 (hi); transposed, P^T's B fragment: column g (head g),
    // keys 2 t, 2 t + 1 (lo) and 2 t + 8, 2 t + 9 (hi).
    const uint32_t lo = Ops::Pack(exp2f(p[0] - run_max[0]), exp2f(p[1] - run_max[1]));
    const uint32_t hi = Ops::Pack(exp2f(p[2] - run_max[0]), exp2f(p[3] - run_max[1]));
    const float2 rounded_lo = Ops::Unpack(lo), rounded_hi = Ops::Unpack(hi);
    run_sum[0] = run_sum[0] * alpha[0] + (rounded_lo.x + rounded_hi.x);
    run_sum[1] = run_sum[1] * alpha[1] + (rounded_lo.y + rounded_hi.y);
    const uint32_t pb[2] = {TransposeFragment16(lo), TransposeFragment16(hi)};

    // O^T = O^T * alpha + V^T P^T; this lane's accumulators are heads 2 t and 2 t + 1, whose
    // alphas it holds itself.
    uint32_t vw[4][2][kLaneWords];  // the values as 16-bit pairs
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) value_pairs(vr[i][h], vw[i][h]);
#pragma unroll
    for (int j = 0; j < kOutTiles; ++j) {
      const uint32_t sel = j % 2 ? 0x7632u : 0x5410u;  // the high or low half of each word
      const int w = j / 2;
      o[j][0] *= alpha[0];
      o[j][1] *= alpha[1];
      o[j][2] *= alpha[0];
      o[j][3] *= alpha[1];
      Ops::Mma(o[j], __byte_perm(vw[0][0][w], vw[1][0][w], sel),
               __byte_perm(vw[0][1][w], vw[1][1][w], sel),
               __byte_perm(vw[2][0][w], vw[3][0][w], sel),
               __byte_perm(vw[2][1][w], vw[3][1][w], sel), pb[0], pb[1]);
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
  const float value_scale = Kv::kFp8 ? KvScale(kv_scales, num_kv_heads, 1, kv_head) : 1.f;
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
    if constexpr (Kv::kFp8) v *= value_scale;
    if (active_splits == 1) {
      out[(head0 + h) * kHeadDim + d] = __float2bfloat16(v / sum);
    } else {
      const size_t part = (head0 + h) * split_stride + split;
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
  if (!LastCtaToArrive(sem, active_splits)) return;
  MergeDecodeSplitsCta<kHeadDim>(t, kv_head, group, num_heads, split_stride, active_splits,
                                 partial_out, partial_stats, out,
                                 reinterpret_cast<float*>(smem + L::kMergeWeights));
  if (tid == 0) *sem = 0;
}

}  // namespace blink
